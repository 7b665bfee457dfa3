"""Allocating function and torch custom op for the Gated DeltaNet forward.

``gated_delta_net`` takes the arguments of the issue (flash-linear-attention's names, packed
THD layout; semantics: precast/reference/gated_delta_net.py), copies inputs whose layout the
kernels cannot read in place, allocates the outputs and returns ``(o, final_state)`` with
``.checkpoints``. ``torch.ops.precast.gated_delta_net`` is the same as a torch custom op
with a fake implementation (it traces under torch.compile).

Forward only: no autograd is registered yet (the backward is a later issue), so gradients
do not flow through either entry point.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .lifecycle.gdn_fwd import GdnFwdSm90, readable_in_place, static_config_of
from .lifecycle.gdn_rules import check_gdn_inputs, max_checkpoint_rows
from .lifecycle.launch import in_stream_order
from .lifecycle.results import Results
from .op_cache import compiled_op


class GatedDeltaNetResults(Results):
    """Unpacks like ``(o, final_state)`` (final_state None unless output_final_state);
    ``.checkpoints`` is the checkpoint series or None."""

    _fields = ("o", "final_state")

    def __new__(cls, o, final_state, checkpoints=None):
        self = super().__new__(cls, o, final_state)
        self.checkpoints = checkpoints
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

    There is no backward yet: with gradients enabled and an input that requires them, this
    raises rather than return outputs that silently carry none (use torch.no_grad(), or
    detach the inputs).
    """
    differentiable = [name for name, t in (("q", q), ("k", k), ("v", v), ("g", g),
                                           ("beta", beta), ("initial_state", initial_state))
                      if isinstance(t, torch.Tensor) and t.requires_grad]
    if differentiable and torch.is_grad_enabled():
        raise NotImplementedError(
            f"gated_delta_net has no backward yet, and {', '.join(differentiable)} "
            "require(s) grad: its outputs would carry no gradient. Call it under "
            "torch.no_grad() (or pass detached inputs) for inference")
    return _forward(q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
                    output_final_state=output_final_state,
                    use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                    checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                    checkpoint_dtype=checkpoint_dtype, state_indices=state_indices,
                    batch_invariant=batch_invariant, stream=stream)


def _forward(q, k, v, g, beta, cu_seqlens, *, scale, initial_state, output_final_state,
             use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, checkpoint_dtype,
             state_indices, batch_invariant, stream) -> GatedDeltaNetResults:
    """gated_delta_net without the gradient guard (the custom op's implementation: torch
    refuses its backward itself, with no autograd formula registered)."""
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
        op.execute(q, k, v, g, beta, cu_seqlens, o, initial_state=initial_state,
                   state_indices=state_indices, final_state=final_state,
                   checkpoints=checkpoints, stream=stream, scale=s.scale,
                   checkpoint_every_n_tokens=s.checkpoint_every_n_tokens)
        if pool is not None and pool is not initial_state:  # the kernel updated a copy
            pool.copy_(initial_state)
    return GatedDeltaNetResults(o, final_state, checkpoints)


# --- torch custom op -------------------------------------------------------------------------

@torch.library.custom_op("precast::gated_delta_net", mutates_args=("initial_state",),
                         device_types="cuda")
def _gated_delta_net_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, cu_seqlens: torch.Tensor, scale: Optional[float],
                        initial_state: Optional[torch.Tensor], output_final_state: bool,
                        use_qk_l2norm_in_kernel: bool, checkpoint_every_n_tokens: Optional[int],
                        checkpoint_dtype: Optional[torch.dtype],
                        state_indices: Optional[torch.Tensor], batch_invariant: bool
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, final_state, checkpoints); custom ops return tensors only, so an output not
    asked for is an empty [0, HO, V, K] tensor. initial_state is declared mutated: it is
    the state pool when state_indices is given."""
    o, final_state = r = _forward(
        q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        checkpoint_every_n_tokens=checkpoint_every_n_tokens, checkpoint_dtype=checkpoint_dtype,
        state_indices=state_indices, batch_invariant=batch_invariant, stream=None)
    return (o, _absent_output(q, v) if final_state is None else final_state,
            _absent_output(q, v) if r.checkpoints is None else r.checkpoints)


def _absent_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An output not asked for: [0, HO, V, K] (a fresh tensor each: outputs never alias)."""
    return q.new_empty((0, max(q.shape[1], v.shape[1]), v.shape[2], q.shape[2]),
                       dtype=torch.float32)


@_gated_delta_net_op.register_fake
def _(q, k, v, g, beta, cu_seqlens, scale, initial_state, output_final_state,
      use_qk_l2norm_in_kernel, checkpoint_every_n_tokens, checkpoint_dtype, state_indices,
      batch_invariant):
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
    return o, final_state, checkpoints
