"""Gated DeltaNet backward for SM90: GdnBwdSm90.

Gradients of the forward's o (and final state) w.r.t. q, k, v, g, beta and the initial
state; the math, chunk by chunk: precast/reference/gdn_backward.py. Every rule of the
forward inputs is gdn_rules.check_gdn_inputs', of do, dfinal and the gradients
gdn_rules.check_gdn_gradients'. Five kernels run in order on the caller's stream, but for
the states pass, which runs on a side stream beside state_grad (launch.side_stream: both
need only prepare's results; joined back before chunk_grad):

* "prepare": the forward's stage 1 (precast/kernels/gdn_chunk_sm90.py; without W and U):
  M and the factor rows of every (64-token chunk, output head) and T = (I + A)^-1 with the
  column scales of the scaled inverses (W = T diag(t_w) K, U = T diag(t_u) V: 8.5 KB
  instead of 32, no products to make them, and no V loaded).
  Skipped when the caller passes ``forward_workspace``: the (work16, work32) a GdnFwdSm90
  wrote for these same inputs (training that keeps them trades 64 x 2 + 17 bytes per
  token and head for this kernel's time);
* "states": the forward's stage 2 (gdn_recurrence_sm90.py) in its states_only mode, writing
  the state entering every chunk (io dtype) into a workspace; it makes each chunk's Delta
  from v, T and its scales (so its states are the forward's up to where the roundings
  fall, not bitwise). Skipped when the caller passes
  the forward's checkpoints at n = 64 in the io dtype: those rows are exactly these states,
  in the same order. With checkpoints at a coarser n (or in float32) the "regenerate" mode
  runs instead: one CTA per (checkpoint row, head) walks only the chunks of its n tokens,
  starting from that checkpoint, so one long sequence spreads over T / n CTAs per head
  instead of one, from the forward's fp32 or rounded io state;
* "state_grad" (gdn_bwd_recurrence_sm90.py): one CTA per (sequence, output head) walks the
  chunks last to first with dS: the gradient of the state leaving each chunk, and the
  initial state's gradient (its W^T dDelta term through T and t_w);
* "chunk_grad" (gdn_bwd_chunk_sm90.py): one CTA per (chunk, output head) (dDelta
  recomputed there from dS, not stored by state_grad; Delta from T, V and S): dg and dbeta,
  and each of dq, dk, dv final where that input has a head per output head, added into
  the gradient (zeroed on the side stream before) where an input head serves two output
  heads (gdn_layout.gradients_in_place / gradients_added), else per output head (io dtype);
* "finish" (gdn_bwd_finish_sm90.py, only with groups of more than two output heads per
  input head): sums each input head's output heads of those gradients in a fixed order
  (in fp32) and applies the L2 norm's Jacobian to q and k, into dq, dk, dv.

Deterministic: the gradients are bitwise reproducible run to run. Only pairs of output
heads accumulate with atomics, each adding its part into a zeroed gradient, and two
rounded adds into zero give the same bits in either order; larger groups are summed by
"finish" in a fixed order. (The pairs' adds replaced "finish" there: at one 32k-token
sequence with 16 q / k and 32 v heads it took 0.35 ms of a 2.9 ms backward on an H100.)

dinitial_state: the state-gradient kernel writes float32. A float32 initial state gets its
gradient written in place; one in the io dtype (state_dtype "io" in the static
configuration) goes through an fp32 workspace converted by a copy on the stream.

The state pool (state_indices) is forward only: NotImplementedError. Limits of the kernels
(NotImplementedError): as the forward's (gdn_fwd.check_kernel_limits).
"""
from __future__ import annotations

import functools
from typing import Dict, Mapping, Optional, Tuple

import torch

from ..kernels.gdn_layout import gradients_added, gradients_in_place
from ..reference.gated_delta_net import CHUNK_SIZE
from .cache import KernelBuilder
from .gdn_fwd import (CONFIG_SOURCES, DATA_ALIGN, KERNEL_SOURCES, _cute_type, _fake_gate,
                      _fake_offsets, _fake_rows, _fake_state, _fake_workspace, _option_dtype,
                      check_kernel_limits, check_same_config, check_workspace_pair,
                      offsets_as_int32,
                      prepare_kernel, recurrence_kernel, seq_table_kernel, sequence_table,
                      splits_recurrences,
                      WORKSPACE_NAMES as FORWARD_WORKSPACE,
                      static_config_of as forward_config, stream_buffers)
from .gdn_rules import (MAX_SPAN, GdnShapes, check_gdn_gradients, check_gdn_inputs,
                        max_checkpoint_rows)
from .launch import device_guard, side_stream, stream_handle, torch_stream
from .op import Op
from .tensor_desc import TensorDesc, parse_dtype
from .validation import (check_bool, check_int, check_no_overlap, check_same_device,
                         check_tensor, check_value)

def kernel_modes(s: GdnShapes) -> Tuple[str, ...]:
    """The kernels of an op: stage 1 with T, the states pass and the state-gradient
    recurrence (at V = 128 also split over two CTAs per (sequence, head): see
    gdn_fwd.splits_recurrences), the chunk gradients, with groups of more than two output
    heads per input head the finishing kernel and, with checkpoints, the states pass from
    them (regenerate)."""
    split = ("states_split", "state_grad_split") if s.V == 128 else ()
    finish = () if all(gradients_in_place(s.HQ, s.HK, s.HV)) else ("finish",)
    regenerate = (() if s.checkpoint_dtype is None
                  else ("regenerate",) + (("regenerate_split",) if s.V == 128 else ()))
    return (("seq_table", "prepare", "states", "state_grad", "chunk_grad") + split + finish
            + regenerate)


BWD_KERNEL_SOURCES = KERNEL_SOURCES + (
    "precast.kernels.gdn_bwd_recurrence_sm90", "precast.kernels.gdn_bwd_chunk_sm90",
    "precast.kernels.gdn_bwd_finish_sm90", "precast.kernels.rowwise")
# The forward's static fields the backward's kernels depend on, plus the dfinal flag.
FORWARD_FIELDS = ("dtype", "k_dim", "v_dim", "q_heads", "k_heads", "v_heads", "g_dtype",
                  "beta_dtype", "state_dtype", "use_qk_l2norm_in_kernel", "checkpoint_dtype")
BWD_CONFIG_SOURCES = {**{key: CONFIG_SOURCES[key] for key in FORWARD_FIELDS},
                      "final_state_grad": "dfinal given (the final state's gradient)"}

# The workspace: name -> (rows it has per call, dtype: "io" or "float32"); tails of the
# shapes come from workspace_shapes. "chunks": T // 64 + N (one row per (chunk, head)).
WORKSPACE = {
    "work16": ("chunks", "io"),  # the forward's stage 1: T = (I + A)^-1 and M, packed
    "work32": ("chunks", "float32"),  # and factor rows
    "dstates": ("chunks", "io"),  # gradient of the state leaving each chunk, (.., V, K)
    "states": ("chunks", "io"),  # states entering each chunk (not with reused checkpoints)
    # gradients of heads in groups of more than two (not gdn_layout.gradients_in_place):
    # per output head, w.r.t. the normalized rows
    "dq_heads": ("tokens", "io"),  # per output head, for "finish"
    "dk_heads": ("tokens", "io"),
    "dv_heads": ("tokens", "io"),
    "dinit32": ("sequences", "float32"),  # only for an initial state in the io dtype
}
RECOMPUTE_ONLY = ("states",)
# Groups of the op's own workspace, made (and grown) together: the same row count; each
# call makes the members it needs (_needed).
HEAD_GRADS = ("dq_heads", "dk_heads", "dv_heads")
OWN_GROUPS = (("work16", "work32", "dstates"), HEAD_GRADS, ("states",),
              ("dinit32",))


def static_config_of(s: GdnShapes, final_state_grad: bool) -> Dict[str, object]:
    """The backward's static configuration: the forward's fields its kernels depend on
    and whether dfinal is given. Scale, checkpoints, T, N and strides are runtime values."""
    forward = forward_config(s)
    return {**{key: forward[key] for key in FORWARD_FIELDS},
            "final_state_grad": final_state_grad}


def check_forward_inputs(q, k, v, g, beta, cu_seqlens, *, scale, initial_state, checkpoints,
                         checkpoint_every_n_tokens, use_qk_l2norm_in_kernel) -> GdnShapes:
    """gdn_rules on the forward inputs of a backward call: the checkpoints as the forward
    wrote them (T // n + N rows, float32 or the io dtype; their dtype is the buffer's). n
    describes the checkpoints: without them it is not used."""
    with_n = checkpoints is not None and checkpoint_every_n_tokens is not None
    return check_gdn_inputs(
        q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        checkpoint_every_n_tokens=(checkpoint_every_n_tokens if checkpoints is not None
                                   else None),
        checkpoint_dtype=checkpoints.dtype if with_n else None, checkpoints=checkpoints)


def refuse_state_pool(state_indices) -> None:
    """The backward (the op and gated_delta_net_backward) takes no state pool."""
    check_value(state_indices is None, NotImplementedError,
                "state_indices: the state pool is forward only (inference); the backward "
                "takes an [N, HO, V, K] initial_state (gather the pool rows first)")


class GdnBwdSm90(Op):
    """dq, dk, dv, dg, dbeta (and dinitial_state) of the Gated DeltaNet forward.

    Construct from sample tensors or TensorDescs of the forward's q, k, v, g, beta,
    cu_seqlens, of do (and of initial_state, dfinal, the forward's checkpoints when used),
    then check_support(), compile(), execute(). Compiled for the fields of
    :func:`static_config_of`; scale, checkpoint_every_n_tokens, T, N and strides are
    runtime values. See the module docstring for the kernels and checkpoint reuse.
    """

    supported_archs = ("sm_90a",)
    kernel_sources = BWD_KERNEL_SOURCES
    host_sources = ("precast.lifecycle.gdn_fwd",)  # the stage 1 and 2 fake arguments

    def __init__(self, sample_q, sample_k, sample_v, sample_g, sample_beta, sample_cu_seqlens,
                 sample_do, *, scale: Optional[float] = None, sample_initial_state=None,
                 sample_dfinal=None, sample_checkpoints=None,
                 checkpoint_every_n_tokens: Optional[int] = None,
                 use_qk_l2norm_in_kernel: bool = False, sample_state_indices=None):
        super().__init__()
        self._samples = {name: TensorDesc.optional(t) for name, t in (
            ("q", sample_q), ("k", sample_k), ("v", sample_v), ("g", sample_g),
            ("beta", sample_beta), ("cu_seqlens", sample_cu_seqlens), ("do", sample_do),
            ("initial_state", sample_initial_state), ("dfinal", sample_dfinal),
            ("checkpoints", sample_checkpoints))}
        self._sample_state_indices = sample_state_indices
        self.scale = scale
        self.checkpoint_every_n_tokens = checkpoint_every_n_tokens
        self.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel
        self.final_state_grad = sample_dfinal is not None
        self._shapes: Optional[GdnShapes] = None
        # Buffers this op made, per (device, stream, group): see _own_workspace; outgrown
        # ones stay alive (a graph captured earlier may still use them).
        self._workspaces: Dict[tuple, Tuple[torch.Tensor, ...]] = {}
        self._outgrown: list = []
        self._offset_buffers: Dict[tuple, Tuple[torch.Tensor]] = {}  # see offsets_as_int32
        self._table_buffers: Dict[tuple, Tuple[torch.Tensor]] = {}  # see sequence_table

    # --- the static configuration -----------------------------------------------------------
    def _call_shapes(self, q, k, v, g, beta, cu_seqlens, *, scale, initial_state=None,
                     checkpoints=None, checkpoint_every_n_tokens=None) -> GdnShapes:
        return check_forward_inputs(q, k, v, g, beta, cu_seqlens, scale=scale,
                                    initial_state=initial_state, checkpoints=checkpoints,
                                    checkpoint_every_n_tokens=checkpoint_every_n_tokens,
                                    use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel)

    @property
    def shapes(self) -> GdnShapes:
        """The samples' GdnShapes (validated once)."""
        if self._shapes is None:
            refuse_state_pool(self._sample_state_indices)
            names = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "checkpoints")
            s = self._call_shapes(**{n: self._samples[n] for n in names}, scale=self.scale,
                                  checkpoint_every_n_tokens=self.checkpoint_every_n_tokens)
            check_gdn_gradients(s, {n: self._samples[n] for n in names},
                                do=self._samples["do"], dfinal=self._samples["dfinal"])
            self._shapes = s
        return self._shapes

    def static_config(self) -> Dict[str, object]:
        return static_config_of(self.shapes, self.final_state_grad)

    @classmethod
    def from_config(cls, dtype="bfloat16", k_dim=128, v_dim=128, q_heads=4, k_heads=None,
                    v_heads=None, g_dtype="float32", beta_dtype="float32", state_dtype="none",
                    final_state_grad=False, use_qk_l2norm_in_kernel=False,
                    checkpoint_dtype="none") -> "GdnBwdSm90":
        """Descriptors of a small batch (2 sequences of 64 tokens) with this static
        configuration (for precompile). k_heads and v_heads default to q_heads;
        checkpoint_dtype: of the forward's checkpoints the backward is given ('none': none)."""
        io = parse_dtype(dtype)
        k_dim, v_dim, hq = (check_int(name, value, lo=1) for name, value in (
            ("k_dim", k_dim), ("v_dim", v_dim), ("q_heads", q_heads)))
        hk = hq if k_heads is None else check_int("k_heads", k_heads, lo=1)
        hv = hq if v_heads is None else check_int("v_heads", v_heads, lo=1)
        state = _option_dtype("state_dtype", state_dtype, io)
        ckpt = _option_dtype("checkpoint_dtype", checkpoint_dtype, io)
        n, tokens, ho = 2, 2 * CHUNK_SIZE, max(hq, hv)
        dfinal = TensorDesc(torch.float32, (n, ho, v_dim, k_dim))
        checkpoints = (None if ckpt is None else TensorDesc(
            ckpt, (max_checkpoint_rows(tokens, n, CHUNK_SIZE), ho, v_dim, k_dim)))
        return cls(TensorDesc(io, (tokens, hq, k_dim)), TensorDesc(io, (tokens, hk, k_dim)),
                   TensorDesc(io, (tokens, hv, v_dim)), TensorDesc(g_dtype, (tokens, ho)),
                   TensorDesc(beta_dtype, (tokens, ho)), TensorDesc(torch.int32, (n + 1,)),
                   TensorDesc(io, (tokens, ho, v_dim)),
                   sample_initial_state=(None if state is None
                                         else TensorDesc(state, (n, ho, v_dim, k_dim))),
                   sample_dfinal=(dfinal if check_bool("final_state_grad",
                                                           final_state_grad) else None),
                   sample_checkpoints=checkpoints,
                   checkpoint_every_n_tokens=None if ckpt is None else CHUNK_SIZE,
                   use_qk_l2norm_in_kernel=check_bool("use_qk_l2norm_in_kernel",
                                                      use_qk_l2norm_in_kernel))

    # --- rules --------------------------------------------------------------------------------
    def _check(self) -> None:
        s = self.shapes
        check_kernel_limits(s, {name: self._samples[name] for name in ("q", "k", "v", "do")})

    def _same_config(self, s: GdnShapes, final_state_grad: bool) -> None:
        check_same_config(type(self).__name__, self.static_config(),
                          static_config_of(s, final_state_grad), BWD_CONFIG_SOURCES,
                          "gated_delta_net_backward")

    # --- compile ------------------------------------------------------------------------------
    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        s = self.shapes
        final_grad, init_grad = self.final_state_grad, s.state_dtype is not None

        def states(v_splits: int = 1, from_checkpoints: bool = False):
            # starting from the initial state, or from the forward's checkpoints
            start = s.checkpoint_dtype if from_checkpoints else s.state_dtype
            return recurrence_kernel(s, state_dtype=start, pool=False, final_state=False,
                                     checkpoint_dtype=s.dtype, v_splits=v_splits,
                                     states_only=True, from_checkpoints=from_checkpoints)

        def state_grad(v_splits: int = 1):
            import cutlass.cute as cute
            from ..kernels.fake import fake_stream, fake_tokens
            from ..kernels.gdn_bwd_recurrence_sm90 import GdnStateGradSm90
            io, tokens, chunks = _cute_type(s.dtype), cute.sym_int(), cute.sym_int()
            kernel = GdnStateGradSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, final_grad, init_grad,
                                      v_splits=v_splits)
            args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
                    fake_tokens(io, tokens, s.HO, s.V), *_fake_workspace(s, chunks),
                    _fake_offsets(), _fake_offsets(),
                    _fake_state(torch.float32, s) if final_grad else None,
                    _fake_state(s.dtype, s),
                    _fake_state(torch.float32, s) if init_grad else None, fake_stream())
            return kernel, args

        def chunk_grad():
            import cutlass
            import cutlass.cute as cute
            from ..kernels.fake import fake_stream, fake_tokens, scalar
            from ..kernels.gdn_bwd_chunk_sm90 import GdnChunkGradSm90
            io, tokens, chunks = _cute_type(s.dtype), cute.sym_int(), cute.sym_int()
            kernel = GdnChunkGradSm90(io, s.K, s.V, s.HQ, s.HK, s.HV,
                                      s.use_qk_l2norm_in_kernel, _cute_type(s.g_dtype),
                                      _cute_type(s.beta_dtype), initial_state=init_grad,
                                      final_grad=final_grad)
            args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
                    fake_tokens(io, tokens, s.HV, s.V), _fake_gate(s.g_dtype, tokens, s.HO),
                    _fake_gate(s.beta_dtype, tokens, s.HO), _fake_offsets(), _fake_offsets(),
                    fake_tokens(io, tokens, s.HO, s.V), *_fake_workspace(s, chunks),
                    _fake_state(s.dtype, s), _fake_state(s.dtype, s),
                    *_fake_head_grads(s, tokens, finals="io"), _fake_gate(s.g_dtype, tokens, s.HO),
                    _fake_gate(s.beta_dtype, tokens, s.HO), scalar(cutlass.Float32, 1.0),
                    fake_stream())
            return kernel, args

        def finish():
            import cutlass.cute as cute
            from ..kernels.fake import fake_stream, fake_tokens
            from ..kernels.gdn_bwd_finish_sm90 import GdnGradFinishSm90
            io, tokens = _cute_type(s.dtype), cute.sym_int()
            kernel = GdnGradFinishSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, s.use_qk_l2norm_in_kernel)
            args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
                    *_fake_head_grads(s, tokens, finals=None),
                    fake_tokens(io, tokens, s.HQ, s.K),
                    fake_tokens(io, tokens, s.HK, s.K), fake_tokens(io, tokens, s.HV, s.V),
                    fake_stream())
            return kernel, args

        builders = {"seq_table": seq_table_kernel,
                    "prepare": lambda: prepare_kernel(s),
                    "states": states,
                    "regenerate": lambda: states(from_checkpoints=True),
                    "regenerate_split": lambda: states(2, from_checkpoints=True),
                    "state_grad": state_grad, "chunk_grad": chunk_grad, "finish": finish,
                    "states_split": lambda: states(v_splits=2),
                    "state_grad_split": lambda: state_grad(v_splits=2)}
        return {mode: builders[mode] for mode in kernel_modes(s)}

    # --- the workspace ------------------------------------------------------------------------
    def workspace_shapes(self, total_tokens: int, num_seqs: int) -> Dict[str, Tuple[int, ...]]:
        """Shapes of the buffers ``execute(workspace=...)`` takes for T tokens in N sequences
        (a dict name -> tensor, all contiguous, dtypes as WORKSPACE says; make_workspace
        allocates one): the forward's work16 and work32, dstates, states with
        T // 64 + N chunk rows, dq_heads, dk_heads, dv_heads with T rows for those of q, k, v
        whose heads serve more than two output heads (not gdn_layout.gradients_in_place)
        and, with an initial state
        in the io dtype, dinit32 [N, HO, V, K]. "states" is not used when the
        call reuses checkpoints (n = 64, io dtype). Nothing needs zeroing."""
        from ..kernels.gdn_layout import workspace_shapes as forward_shapes
        s = self.shapes
        T = check_int("total_tokens", total_tokens, lo=0)
        N = check_int("num_seqs", num_seqs, lo=0)
        work16, work32 = forward_shapes(T, N, s.HO, s.K, s.V)
        chunks = work16[0]
        shapes = {"work16": work16, "work32": work32,
                  "dstates": (chunks, s.HO, s.V, s.K), "states": (chunks, s.HO, s.V, s.K)}
        finals = gradients_in_place(s.HQ, s.HK, s.HV)
        for name, dim, final in zip(HEAD_GRADS, (s.K, s.K, s.V), finals):
            if not final:
                shapes[name] = (T, s.HO, dim)
        if self._converts_dinit:
            shapes["dinit32"] = (N,) + s.state_shape[1:]
        return shapes

    def workspace_dtype(self, name: str) -> torch.dtype:
        return self.shapes.dtype if WORKSPACE[name][1] == "io" else torch.float32

    def make_workspace(self, total_tokens: int, num_seqs: int, device=None
                       ) -> Dict[str, torch.Tensor]:
        """An uninitialized workspace for execute(workspace=...) (e.g. before capturing a
        CUDA graph), on ``device`` (default: the current CUDA device, as execute needs)."""
        device = "cuda" if device is None else device
        return {name: torch.empty(shape, dtype=self.workspace_dtype(name), device=device)
                for name, shape in self.workspace_shapes(total_tokens, num_seqs).items()}

    @functools.cached_property
    def _added_gradients(self) -> Tuple[bool, bool, bool]:
        """Of dq, dk, dv, those chunk_grad adds into (zeroed first; a static property of the
        head counts, gdn_layout.gradients_added)."""
        s = self.shapes
        return gradients_added(s.HQ, s.HK, s.HV)

    @property
    def _converts_dinit(self) -> bool:
        """dinitial_state goes through dinit32 (the kernel writes float32)."""
        state = self.shapes.state_dtype
        return state is not None and state != torch.float32

    @staticmethod
    def _reuses(s: GdnShapes, checkpoints) -> bool:
        """Whether the given checkpoints are the states entering every chunk."""
        return (checkpoints is not None and s.checkpoint_every_n_tokens == CHUNK_SIZE
                and s.checkpoint_dtype == s.dtype)

    def _needed(self, reuse: bool, prepared: bool) -> Tuple[str, ...]:
        """The workspace entries a call uses: not the states when it reuses checkpoints as
        them, not the forward's factors when it is given them."""
        return tuple(name for name in self.workspace_shapes(0, 0)
                     if not (reuse and name in RECOMPUTE_ONLY)
                     and not (prepared and name in FORWARD_WORKSPACE))

    def _check_workspace(self, workspace, s: GdnShapes, reuse: bool,
                         prepared: bool) -> Dict[str, torch.Tensor]:
        check_value(isinstance(workspace, Mapping), TypeError,
                    "workspace: expected a dict name -> tensor (see workspace_shapes(T, N), "
                    f"make_workspace(T, N)), got {type(workspace).__name__}")
        shapes = self.workspace_shapes(s.T, s.N)
        unknown = sorted(set(workspace) - set(shapes))
        check_value(not unknown, ValueError,
                    f"workspace: unknown entries {unknown}; expected {sorted(shapes)}")
        needed = self._needed(reuse, prepared)
        missing = [name for name in needed if workspace.get(name) is None]
        check_value(not missing, ValueError,
                    f"workspace: lacks {missing} (see workspace_shapes({s.T}, {s.N}))")
        for name in needed:
            check_tensor(f"workspace[{name!r}]", workspace[name],
                         dtypes=(self.workspace_dtype(name),), shape=shapes[name],
                         align=DATA_ALIGN, contiguous=True, max_span=MAX_SPAN)
        return {name: workspace[name] for name in needed}

    def _own_workspace(self, index: Optional[int], handle: int, s: GdnShapes,
                       reuse: bool, prepared: bool) -> Dict[str, torch.Tensor]:
        """This op's buffers for (device, stream), group by group (OWN_GROUPS, each made
        and grown by gdn_fwd.stream_buffers); the states only when they are not the reused
        checkpoints."""
        shapes = self.workspace_shapes(s.T, s.N)
        needed = self._needed(reuse, prepared)
        rows = {"chunks": shapes["work16"][0], "tokens": s.T, "sequences": s.N}
        out = {}
        for group in OWN_GROUPS:
            group = tuple(name for name in group if name in needed)
            if not group:
                continue
            count = rows[WORKSPACE[group[0]][0]]
            buffers = stream_buffers(
                type(self).__name__, self._workspaces, self._outgrown, (index, handle) + group,
                count, tuple((shapes[name][1:], self.workspace_dtype(name)) for name in group),
                index, handle, f"workspace {list(group)} of {count} rows for it",
                f"pass workspace= (make_workspace({s.T}, {s.N})) or execute once on this "
                "stream with as many tokens and sequences before capturing")
            out.update(zip(group, buffers))
        return out

    # --- run ----------------------------------------------------------------------------------
    def execute(self, q, k, v, g, beta, cu_seqlens, do, dq, dk, dv, dg, dbeta, *,
                initial_state=None, dinitial_state=None, dfinal=None, checkpoints=None,
                workspace=None, forward_workspace=None, stream=None,
                scale: Optional[float] = None, checkpoint_every_n_tokens: Optional[int] = None,
                state_indices=None) -> None:
        """Writes dq [T, HQ, K], dk [T, HK, K], dv [T, HV, V], dg, dbeta [T, HO] (each in its
        input's dtype and shape, any layout the forward reads) and, with an initial state,
        dinitial_state [N, HO, V, K] (initial_state's dtype), given do [T, HO, V] and, when
        compiled with final_state_grad, dfinal [N, HO, V, K] float32. ``checkpoints``: the
        forward's, every ``checkpoint_every_n_tokens`` (default the constructor's) tokens:
        the states entering every chunk at n = 64 in the io dtype, else the starts of the
        states pass (see the module docstring). ``forward_workspace``: the (work16,
        work32) a GdnFwdSm90 wrote for these same inputs (trusted, like cu_seqlens' values):
        the prepare kernel is skipped and ``workspace`` needs no work16, work32. Never reads
        device memory; allocates nothing when ``workspace`` is given (see workspace_shapes;
        else the op keeps one per device and stream) but the int32 copy of int64 cu_seqlens and, for
        more than 32 sequences, the per-sequence table (both kept per device and stream like
        the workspace; see GdnFwdSm90.execute). scale defaults to the constructor's.

        T == 0: no kernel runs; dinitial_state is dfinal (zeros without one), copied on the
        stream. N == 0: nothing to write.
        """
        if not self._checked:
            self.check_support()
        refuse_state_pool(state_indices)
        check_value(dfinal is not None or not self.final_state_grad, ValueError,
                    "dfinal is required: this op is compiled for final_state_grad=True; pass "
                    "the final state's gradient [N, HO, V, K] float32")
        n = (self.checkpoint_every_n_tokens if checkpoint_every_n_tokens is None
             else checkpoint_every_n_tokens)
        scale = self.scale if scale is None else scale
        inputs = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                      initial_state=initial_state, checkpoints=checkpoints)
        gradients = dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dinitial_state=dinitial_state)
        prepared = forward_workspace is not None

        def validate():
            s = self._call_shapes(q, k, v, g, beta, cu_seqlens, scale=scale,
                                  initial_state=initial_state, checkpoints=checkpoints,
                                  checkpoint_every_n_tokens=n)
            self._same_config(s, dfinal is not None)
            check_gdn_gradients(s, inputs, do=do, dfinal=dfinal, gradients=gradients)
            check_kernel_limits(s, dict(q=q, k=k, v=v, do=do, dq=dq, dk=dk, dv=dv))
            reuse = self._reuses(s, checkpoints)
            factors_read = (check_workspace_pair("forward_workspace", forward_workspace, s)
                            if prepared else [])
            if workspace is not None:
                written = [(f"workspace[{name!r}]", t) for name, t in
                           self._check_workspace(workspace, s, reuse, prepared).items()]
                read = list({**inputs, "do": do, "dfinal": dfinal, **gradients}.items())
                check_same_device(written + read + factors_read)
                check_no_overlap(written, read + factors_read)
            if prepared:
                check_same_device(factors_read + list(inputs.items()))
                check_no_overlap(list(gradients.items()), factors_read)
            return s, reuse

        ws_items, ws_form = self._layout_items(workspace)
        fws_items, fws_form = self._layout_items(forward_workspace)
        s, reuse = self._validated(
            tuple(inputs.values()) + (do, dfinal) + tuple(gradients.values()) + ws_items
            + fws_items, validate, extra=(scale, n, ws_form, fws_form))
        # the checked containers as the kernels take them (rebuilt: the memo keeps no tensors)
        factors = dict(zip(FORWARD_WORKSPACE, forward_workspace)) if prepared else {}
        if workspace is not None:
            workspace = {name: workspace[name] for name in self._needed(reuse, prepared)}
        index = q.device.index
        kernels = self._ready(index)
        if s.N == 0:
            return
        handle = stream_handle(stream, index)
        if s.T == 0:
            if dinitial_state is not None:
                with torch.cuda.stream(torch_stream(handle, index)):
                    if dfinal is None:
                        dinitial_state.zero_()
                    else:
                        dinitial_state.copy_(dfinal)
            return
        ws = {**(self._own_workspace(index, handle, s, reuse, prepared) if workspace is None
                 else workspace), **factors}
        if s.cu_seqlens_dtype == torch.int64:
            cu_seqlens = offsets_as_int32(type(self).__name__, self._offset_buffers,
                                          self._outgrown, index, handle, cu_seqlens, s.N)
        states = checkpoints if reuse else ws["states"]
        # the states pass: from the checkpoints when given (one grid row per checkpoint
        # row: T // n + N, the bound), else from the initial state
        split = "_split" if splits_recurrences(s, index) else ""
        if checkpoints is not None:
            states_pass = "regenerate" + (
                "_split" if splits_recurrences(s, index, rows=checkpoints.shape[0]) else "")
            states_args = (checkpoints, None, None, states, v, n)
        else:
            states_pass = "states" + split
            states_args = (initial_state, None, None, states, v, CHUNK_SIZE)
        dinit = ws.get("dinit32", dinitial_state)
        work = (ws["work16"], ws["work32"])
        # the chunk kernel's outputs: the final gradient, or its per-head buffer for "finish"
        grads = tuple(ws.get(name, final) for final, name in zip((dq, dk, dv), HEAD_GRADS))
        with device_guard(index):
            # the table's checkpoint rows: the forward's every n tokens when the states pass
            # starts from them, else the states pass's own rows (one per chunk)
            every = n if checkpoints is not None and not reuse else CHUNK_SIZE
            table = sequence_table(kernels, self._table_buffers, self._outgrown, index, handle,
                                   cu_seqlens, s.N, every)
            if not prepared:
                kernels["prepare"](q, k, v, g, beta, cu_seqlens, table, *work, s.scale,
                                   handle)
            added = [t for t, add in zip((dq, dk, dv), self._added_gradients) if add]
            # The states pass and the zeroing of the gradients chunk_grad adds into run on
            # a side stream beside state_grad (module docstring): each alone leaves SMs idle
            # (few sequences and heads, or a half-empty last wave). The zeroing is queued
            # last, behind the states pass: launched first, its many CTAs held back the
            # recurrences' start.
            side = side_stream(index, handle) if added or not reuse else None
            side_handle = None if side is None else side.fork(handle)
            if not reuse:
                kernels[states_pass](q, k, *work, cu_seqlens, table, None, *states_args,
                                     side_handle)
            kernels["state_grad" + split](q, k, do, *work, cu_seqlens, table, dfinal,
                                          ws["dstates"], dinit, handle)
            if added:
                with torch.cuda.stream(torch_stream(side_handle, index)):
                    for t in added:
                        t.zero_()
            if side is not None:
                side.join(handle)
            kernels["chunk_grad"](q, k, v, g, beta, cu_seqlens, table, do, *work, states,
                                  ws["dstates"], *grads, dg, dbeta, s.scale, handle)
            if "finish" in kernels:
                kernels["finish"](q, k, *(ws.get(name) for name in HEAD_GRADS), dq, dk, dv,
                                  handle)
        if dinit is not dinitial_state:
            with torch.cuda.stream(torch_stream(handle, index)):
                dinitial_state.copy_(dinit)


def _fake_head_grads(s: GdnShapes, tokens, finals) -> tuple:
    """The chunk kernel's dq, dk, dv outputs: dq_heads, dk_heads (T, HO, K) and dv_heads
    (T, HO, V) in the io dtype, compact but for a 64-bit token stride, for the gradients
    whose input heads serve more than two output heads (not gdn_layout.gradients_in_place);
    for the others, which it writes final (or adds into), the io-dtype gradient strided like its input (``finals="io"``: the chunk
    kernel's arguments) or None (``finals=None``: the finishing kernel's)."""
    from ..kernels.fake import fake_tokens
    io = _cute_type(s.dtype)
    out = []
    for final, heads, dim in zip(gradients_in_place(s.HQ, s.HK, s.HV), (s.HQ, s.HK, s.HV),
                                 (s.K, s.K, s.V)):
        if not final:
            out.append(_fake_rows(s.dtype, tokens, (s.HO, dim)))
        else:
            out.append(fake_tokens(io, tokens, heads, dim) if finals == "io" else None)
    return tuple(out)
