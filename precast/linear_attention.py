"""Allocating functions and torch custom ops for the Gated DeltaNet forward and backward.

``gated_delta_net`` takes the arguments of the issue (flash-linear-attention's names, packed
THD layout; semantics: precast/reference/gated_delta_net.py), copies inputs whose layout the
kernels cannot read in place, allocates the outputs and returns ``(o, final_state)`` with
``.checkpoints``. ``gated_delta_net_backward`` returns the gradients (GdnBwdSm90).

Custom ops (each with a fake implementation: they trace under torch.compile):

* ``torch.ops.precast.gated_delta_net``: the forward, functional, with an autograd formula
  (the backward op): ``o, s = gated_delta_net(...); loss.backward()`` trains. The final
  state's gradient is the backward's dfinal; checkpoints are not differentiable, and the
  backward starts its states pass from them (at n = 64 in the io dtype they are its chunk
  states; see GdnBwdSm90). With keep_workspace it also returns the forward's chunk factors
  (work16, work32; placeholders otherwise), which the backward then reuses instead of
  recomputing them. gated_delta_net calls it under autograd only, with keep_workspace=True
  unless given keep_workspace=False (its default, None, keeps the workspace for training;
  False trades that memory for the recomputation).
* ``torch.ops.precast.gated_delta_net_backward``: dq, dk, dv, dg, dbeta, dinitial_state.
* ``torch.ops.precast.gated_delta_net_pool``: the forward with a state pool updated in
  place (inference only: the pool has no gradient).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .lifecycle.gdn_bwd import GdnBwdSm90, check_forward_inputs, refuse_state_pool
from .lifecycle.gdn_bwd import static_config_of as backward_config
from .lifecycle.gdn_fwd import GdnFwdSm90, readable_in_place, static_config_of
from .lifecycle.gdn_rules import check_gdn_inputs, max_checkpoint_rows
from .kernels.gdn_layout import workspace_shapes
from .lifecycle.launch import in_stream_order
from .lifecycle.results import Results
from .lifecycle.validation import check_bool, check_value
from .op_cache import compiled_op


class GatedDeltaNetResults(Results):
    """Unpacks like ``(o, final_state)`` (final_state None unless output_final_state);
    ``.checkpoints`` is the checkpoint series or None; ``.workspace`` the forward's chunk
    factors (work16, work32) with keep_workspace=True outside autograd (for
    gated_delta_net_backward(forward_workspace=...)), else None (under autograd a kept
    workspace goes to the backward, not here)."""

    _fields = ("o", "final_state")

    def __new__(cls, o, final_state, checkpoints=None, workspace=None):
        self = super().__new__(cls, o, final_state)
        self.checkpoints = checkpoints
        self.workspace = workspace
        return self


def _in_place_or_copy(role: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """t where the kernels read it in place, else a compact copy (anything but a tensor is
    left to the rules)."""
    if not isinstance(t, torch.Tensor) or readable_in_place(role, t):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def gated_delta_net(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
                    scale: Optional[float] = None, initial_state: Optional[torch.Tensor] = None,
                    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                    checkpoint_every_n_tokens: Optional[int] = None,
                    checkpoint_dtype: Optional[torch.dtype] = None,
                    state_indices: Optional[torch.Tensor] = None, batch_invariant: bool = False,
                    keep_workspace: Optional[bool] = None,
                    stream=None) -> GatedDeltaNetResults:
    """Gated DeltaNet forward over packed sequences.

    q [T, HQ, K], k [T, HK, K], v [T, HV, V] (bf16 or fp16), g and beta [T, HO]
    (HO = max(HQ, HV); g natural-log gates), cu_seqlens [N + 1] int32 or int64. Returns
    ``(o [T, HO, V], final_state [N, HO, V, K] float32 or None)``; with
    ``checkpoint_every_n_tokens`` n (a multiple of 64) ``.checkpoints`` holds
    [T // n + N, HO, V, K] rows of ``checkpoint_dtype`` (default the io dtype): each
    sequence's states entering its local positions 0, n, 2n, ..., sequence after sequence;
    rows past sum(ceil(len / n)) are left unwritten (their count needs cu_seqlens' values,
    which are never read on the host, so a call stays capturable in a CUDA graph).

    ``initial_state`` [N, HO, V, K] (float32 or the io dtype; None: zeros), or with
    ``state_indices`` [N] int32 a pool [N_pool, HO, V, K] read at those rows and updated
    there in place with the final states. ``batch_invariant`` is always honoured at no cost
    (see GdnFwdSm90). The compiled op is made once per static configuration; scale, n and
    the batch are runtime values.

    Differentiable in q, k, v, g, beta and initial_state through
    ``torch.ops.precast.gated_delta_net`` (taken when grad mode is on and an input requires
    grad; the backward is GdnBwdSm90). Checkpoints asked for here are kept for the backward,
    which starts its states pass from them instead of walking each sequence from its start:
    for training on few long sequences (fewer (sequence, head) pairs than SMs), float32
    checkpoints every ~1024 tokens make the backward faster (gradients equal to
    recomputation's up to rounding: the backward's states pass makes Delta from T and
    its column scales, the forward from W and U); with
    many pairs they cost more than they save (bench/RESULTS.md, session 13).
    ``keep_workspace`` (None, True or False) decides whether the forward's chunk factors
    (M, T = (I + A)^-1 and the factor rows: about 0.14 KB per token and output head, a
    fifth of q, k and v's at K = V = 128; flash-linear-attention's autograd saves a similar
    block, its ``A``) outlive the call. None (the default) keeps them when the call goes
    through autograd: the backward then skips recomputing them (its "prepare" kernel,
    ~0.45-0.5 ms of a ~4.7 ms backward at 4 x 8192 tokens, 64 heads, H200; bitwise the same
    gradients); outside autograd None keeps nothing (``.workspace`` is None). True keeps
    them either way: under autograd for the backward, outside it as ``.workspace`` for
    gated_delta_net_backward(forward_workspace=...). False never keeps them: under
    autograd the backward recomputes them (the choice that saves the memory). The state
    pool is forward only: with an input requiring grad it raises (use torch.no_grad(), or
    gather the pool rows into an initial_state); keep_workspace=True with it raises too.
    """
    keep_workspace = check_bool("keep_workspace", keep_workspace, optional=True)
    check_value(not (keep_workspace and state_indices is not None), ValueError,
                "keep_workspace=True keeps the forward's chunk factors for the backward, and a "
                "state pool (state_indices) has no backward: leave keep_workspace None or "
                "pass False")
    differentiable = [name for name, t in (("q", q), ("k", k), ("v", v), ("g", g),
                                           ("beta", beta), ("initial_state", initial_state))
                      if isinstance(t, torch.Tensor) and t.requires_grad]
    autograd = bool(differentiable) and torch.is_grad_enabled()
    if keep_workspace is None:  # training keeps the workspace, inference does not
        keep_workspace = autograd
    options = dict(scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state,
                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                   checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                   checkpoint_dtype=checkpoint_dtype, batch_invariant=batch_invariant,
                   keep_workspace=keep_workspace)
    if not autograd:
        return _forward(q, k, v, g, beta, cu_seqlens, state_indices=state_indices,
                        stream=stream, **options)
    if state_indices is not None:
        raise NotImplementedError(
            f"gated_delta_net: {', '.join(differentiable)} require(s) grad, but the state "
            "pool (state_indices) is forward only: its rows are overwritten in place and have "
            "no gradient. Call it under torch.no_grad() for inference, or pass the gathered "
            "rows as an [N, HO, V, K] initial_state to train")
    with in_stream_order(stream, q.device):
        o, final_state, checkpoints, *_ = torch.ops.precast.gated_delta_net(
            q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, checkpoint_dtype, None,
            batch_invariant, keep_workspace)
    return GatedDeltaNetResults(o, final_state if output_final_state else None,
                                None if checkpoint_every_n_tokens is None else checkpoints)


def _forward(q, k, v, g, beta, cu_seqlens, *, scale, initial_state, output_final_state,
             use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, checkpoint_dtype,
             state_indices, batch_invariant, keep_workspace, stream) -> GatedDeltaNetResults:
    """gated_delta_net outside autograd (the custom ops' implementation)."""
    with in_stream_order(stream, q.device):
        q, k, v = (_in_place_or_copy("tokens", t) for t in (q, k, v))
        g, beta = (_in_place_or_copy("gate", t) for t in (g, beta))
        cu_seqlens, state_indices = (_in_place_or_copy("offsets", t)
                                     for t in (cu_seqlens, state_indices))
        pool = initial_state if state_indices is not None else None
        initial_state = _in_place_or_copy("state", initial_state)
        options = dict(scale=scale, output_final_state=output_final_state,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                       checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                       checkpoint_dtype=checkpoint_dtype, batch_invariant=batch_invariant)
        s = check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state=initial_state,
                             state_indices=state_indices, **options)
        key = ("gated_delta_net",) + tuple(sorted(static_config_of(s).items()))
        op = compiled_op(key, lambda: GdnFwdSm90(
            q, k, v, g, beta, cu_seqlens, sample_initial_state=initial_state,
            sample_state_indices=state_indices, **options))
        o = q.new_empty((s.T, s.HO, s.V))
        final_state = (q.new_empty(s.state_shape, dtype=torch.float32) if output_final_state
                       else None)
        checkpoints = None
        if s.checkpoint_rows is not None:
            checkpoints = q.new_empty((s.checkpoint_rows,) + s.state_shape[1:],
                                      dtype=s.checkpoint_dtype)
        # kept factors are the caller's: the op's own workspace is reused by its next call
        workspace = op.make_workspace(s.T, s.N, q.device) if keep_workspace else None
        op.execute(q, k, v, g, beta, cu_seqlens, o, initial_state=initial_state,
                   state_indices=state_indices, final_state=final_state,
                   checkpoints=checkpoints, workspace=workspace, stream=stream, scale=s.scale,
                   checkpoint_every_n_tokens=s.checkpoint_every_n_tokens)
        if pool is not None and pool is not initial_state:  # the kernel updated a copy
            pool.copy_(initial_state)
    return GatedDeltaNetResults(o, final_state, checkpoints, workspace)


# --- the backward ------------------------------------------------------------------------------

class GatedDeltaNetGradients(Results):
    """Unpacks like ``(dq, dk, dv, dg, dbeta, dinitial_state)`` (dinitial_state None
    without an initial state)."""

    _fields = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")


def gated_delta_net_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                             do: torch.Tensor, *, scale: Optional[float] = None,
                             initial_state: Optional[torch.Tensor] = None,
                             dfinal: Optional[torch.Tensor] = None,
                             checkpoints: Optional[torch.Tensor] = None,
                             checkpoint_every_n_tokens: Optional[int] = None,
                             use_qk_l2norm_in_kernel: bool = False,
                             state_indices: Optional[torch.Tensor] = None,
                             forward_workspace=None, stream=None) -> GatedDeltaNetGradients:
    """Gradients of gated_delta_net's o (and final state) given ``do`` [T, HO, V] (q's
    dtype) and ``dfinal`` [N, HO, V, K] float32 (None: the final state is not
    differentiated). The forward's inputs and options as they were (``checkpoints``: the
    forward's, written every ``checkpoint_every_n_tokens`` tokens: the chunk states at
    n = 64 in the io dtype, else where the states pass starts from). Returns dq, dk, dv,
    dg, dbeta in each input's dtype and shape and dinitial_state (initial_state's dtype;
    None without one). ``forward_workspace``: the forward's ``.workspace`` (gated_delta_net
    with keep_workspace=True on these inputs): the backward skips recomputing it. Inputs
    whose layout the kernels cannot read in place (e.g. an expanded do) are copied. The
    compiled op is made once per static configuration (GdnBwdSm90.static_config)."""
    refuse_state_pool(state_indices)
    with in_stream_order(stream, q.device):
        q, k, v, do = (_in_place_or_copy("tokens", t) for t in (q, k, v, do))
        g, beta = (_in_place_or_copy("gate", t) for t in (g, beta))
        cu_seqlens = _in_place_or_copy("offsets", cu_seqlens)
        initial_state, dfinal, checkpoints = (_in_place_or_copy("state", t)
                                              for t in (initial_state, dfinal, checkpoints))
        flags = dict(scale=scale, checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        s = check_forward_inputs(q, k, v, g, beta, cu_seqlens, initial_state=initial_state,
                                 checkpoints=checkpoints, **flags)
        key = ("gated_delta_net_backward",) + tuple(sorted(
            backward_config(s, dfinal is not None).items()))
        op = compiled_op(key, lambda: GdnBwdSm90(
            q, k, v, g, beta, cu_seqlens, do, sample_initial_state=initial_state,
            sample_dfinal=dfinal, sample_checkpoints=checkpoints, **flags))
        grads = GatedDeltaNetGradients(
            q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            g.new_empty(g.shape), beta.new_empty(beta.shape),
            None if initial_state is None else initial_state.new_empty(initial_state.shape))
        op.execute(q, k, v, g, beta, cu_seqlens, do, *grads[:5], initial_state=initial_state,
                   dinitial_state=grads.dinitial_state, dfinal=dfinal, checkpoints=checkpoints,
                   forward_workspace=forward_workspace, stream=stream, scale=s.scale,
                   checkpoint_every_n_tokens=s.checkpoint_every_n_tokens)
    return grads


# --- torch custom ops ----------------------------------------------------------------------------

@torch.library.custom_op("precast::gated_delta_net", mutates_args=(), device_types="cuda")
def _gated_delta_net_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, scale: Optional[float],
                        initial_state: Optional[torch.Tensor], output_final_state: bool,
                        use_qk_l2norm_in_kernel: bool, checkpoint_every_n_tokens: Optional[int],
                        checkpoint_dtype: Optional[torch.dtype],
                        state_indices: Optional[torch.Tensor], batch_invariant: bool,
                        keep_workspace: bool = False
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor]:
    """(o, final_state, checkpoints, work16, work32); custom ops return tensors only,
    so an output not asked for is an empty [0, HO, V, K] tensor (the last two but with
    keep_workspace). Functional (it has an autograd formula): state_indices must be None;
    a state pool goes through gated_delta_net_pool."""
    _refuse_pool_in_functional_op(state_indices)
    o, final_state = r = _forward(
        q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        checkpoint_every_n_tokens=checkpoint_every_n_tokens, checkpoint_dtype=checkpoint_dtype,
        state_indices=None, batch_invariant=batch_invariant, keep_workspace=keep_workspace,
        stream=None)
    workspace = r.workspace or tuple(_absent_output(q, v) for _ in range(2))
    return (o, _absent_output(q, v) if final_state is None else final_state,
            _absent_output(q, v) if r.checkpoints is None else r.checkpoints, *workspace)


def _refuse_pool_in_functional_op(state_indices) -> None:
    if state_indices is not None:
        raise NotImplementedError(
            "torch.ops.precast.gated_delta_net is functional (it has a backward) and does not "
            "update a state pool: use torch.ops.precast.gated_delta_net_pool for "
            "state_indices")


def _absent_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An output not asked for: [0, HO, V, K] (a fresh tensor each: outputs never alias)."""
    return q.new_empty((0, max(q.shape[1], v.shape[1]), v.shape[2], q.shape[2]),
                       dtype=torch.float32)


@_gated_delta_net_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
      use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, checkpoint_dtype, state_indices,
      batch_invariant, keep_workspace=False):
    _refuse_pool_in_functional_op(state_indices)
    T, K = q.shape[0], q.shape[2]
    N, HO, V = cu_seqlens.shape[0] - 1, max(q.shape[1], v.shape[1]), v.shape[2]
    o = q.new_empty((T, HO, V))
    final_state, checkpoints = _absent_output(q, v), _absent_output(q, v)
    if output_final_state:
        final_state = q.new_empty((N, HO, V, K), dtype=torch.float32)
    if checkpoint_every_n_tokens is not None:
        n = checkpoint_every_n_tokens
        # max_checkpoint_rows takes ints; under dynamic shapes T and N are symbolic
        rows = (max_checkpoint_rows(T, N, n) if isinstance(T, int) and isinstance(N, int)
                else T // n + N)
        checkpoints = q.new_empty((rows, HO, V, K), dtype=checkpoint_dtype or q.dtype)
    workspace = tuple(_absent_output(q, v) for _ in range(2))
    if keep_workspace:
        shape16, shape32 = workspace_shapes(T, N, HO, K, V)  # T, N may be symbolic
        workspace = (q.new_empty(shape16), q.new_empty(shape32, dtype=torch.float32))
    return (o, final_state, checkpoints) + workspace


@torch.library.custom_op("precast::gated_delta_net_backward", mutates_args=(),
                         device_types="cuda")
def _gated_delta_net_backward_op(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        cu_seqlens: torch.Tensor, do: torch.Tensor, scale: Optional[float],
        initial_state: Optional[torch.Tensor], dfinal: Optional[torch.Tensor],
        checkpoints: Optional[torch.Tensor], checkpoint_every_n_tokens: Optional[int],
        use_qk_l2norm_in_kernel: bool, work16: Optional[torch.Tensor] = None,
        work32: Optional[torch.Tensor] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dinitial_state) of gated_delta_net_backward; without an
    initial state dinitial_state is an empty [0, HO, V, K] tensor. work16, work32: the
    forward's kept workspace (both or none)."""
    kept = (work16, work32)
    *grads, dinitial_state = gated_delta_net_backward(
        q, k, v, g, beta, cu_seqlens, do, scale=scale, initial_state=initial_state,
        dfinal=dfinal, checkpoints=checkpoints,
        checkpoint_every_n_tokens=checkpoint_every_n_tokens,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        forward_workspace=None if all(t is None for t in kept) else kept)
    return (*grads, _absent_output(q, v) if dinitial_state is None else dinitial_state)


@_gated_delta_net_backward_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, do, scale, initial_state, dfinal, checkpoints,
      checkpoint_every_n_tokens, use_qk_l2norm_in_kernel, work16=None, work32=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            g.new_empty(g.shape), beta.new_empty(beta.shape),
            _absent_output(q, v) if initial_state is None
            else initial_state.new_empty(initial_state.shape))


def _setup_context(ctx, inputs, output):
    (q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
     use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, _, _, _, *keep) = inputs
    _, final_state, checkpoints, *workspace = output
    ctx.mark_non_differentiable(checkpoints, *workspace)
    if not output_final_state:  # the empty placeholder
        ctx.mark_non_differentiable(final_state)
    ctx.set_materialize_grads(False)  # an unused final state costs no dfinal
    kept = workspace if keep and keep[0] else [None] * 2
    ctx.save_for_backward(q, k, v, g, beta, cu_seqlens, initial_state,
                          checkpoints if checkpoint_every_n_tokens is not None else None, *kept)
    ctx.scale, ctx.n, ctx.l2norm = scale, checkpoint_every_n_tokens, use_qk_l2norm_in_kernel
    ctx.final = output_final_state


def _backward(ctx, do, dfinal, _dcheckpoints, *_dworkspace):
    q, k, v, g, beta, cu_seqlens, initial_state, checkpoints, *kept = ctx.saved_tensors
    if do is None:  # only the final state reaches the loss
        do = q.new_zeros((q.shape[0], max(q.shape[1], v.shape[1]), v.shape[2]))
    dq, dk, dv, dg, dbeta, dinitial_state = torch.ops.precast.gated_delta_net_backward(
        q, k, v, g, beta, cu_seqlens, do, ctx.scale, initial_state,
        dfinal if ctx.final else None, checkpoints,
        None if checkpoints is None else ctx.n, ctx.l2norm, *kept)
    return (dq, dk, dv, dg, dbeta, None, None,
            None if initial_state is None else dinitial_state) + (None,) * 7


_gated_delta_net_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("precast::gated_delta_net_pool", mutates_args=("pool",),
                         device_types="cuda")
def _gated_delta_net_pool_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor,
                             scale: Optional[float], pool: torch.Tensor,
                             state_indices: torch.Tensor, output_final_state: bool,
                             use_qk_l2norm_in_kernel: bool, batch_invariant: bool
                             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(o, final_state): gated_delta_net with a state pool [N_pool, HO, V, K] read at rows
    state_indices and updated there in place (inference: no autograd formula).
    final_state is an empty [0, HO, V, K] tensor unless asked for."""
    o, final_state = _forward(
        q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=pool,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        checkpoint_every_n_tokens=None, checkpoint_dtype=None, state_indices=state_indices,
        batch_invariant=batch_invariant, keep_workspace=False, stream=None)
    return o, _absent_output(q, v) if final_state is None else final_state


@_gated_delta_net_pool_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale, pool, state_indices, output_final_state,
      use_qk_l2norm_in_kernel, batch_invariant):
    T, K = q.shape[0], q.shape[2]
    N, HO, V = cu_seqlens.shape[0] - 1, max(q.shape[1], v.shape[1]), v.shape[2]
    final_state = (q.new_empty((N, HO, V, K), dtype=torch.float32) if output_final_state
                   else _absent_output(q, v))
    return q.new_empty((T, HO, V)), final_state
