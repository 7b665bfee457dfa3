"""Gated DeltaNet forward for SM90: GdnFwdSm90.

Semantics, layouts and head grouping: precast/reference/gated_delta_net.py; every host rule
of a call: precast/lifecycle/gdn_rules.py (reused here, never restated). Two kernels run
in order on one stream, through a workspace of (T // 64 + N) chunk rows:

* "prepare" (precast/kernels/gdn_chunk_sm90.py): one CTA per (64-token chunk, output head)
  writes the chunk's T = (I + A)^-1, M, row factors and total log decay (no W or U);
* "recurrence" (precast/kernels/gdn_recurrence_sm90.py): one CTA per (sequence, output
  head) walks the sequence's chunks with the fp32 state: o, checkpoints, the final state
  (or the pool row, in place).

batch_invariant=True is accepted and costs nothing: no CTA of either kernel reads another
sequence's tokens or results (chunks never straddle sequences, the recurrence owns one
sequence), so a sequence's outputs are bitwise the same alone or in any batch.

int64 cu_seqlens are converted on the stream into an int32 buffer the op keeps per device
and stream (the kernels read int32; the values stay on the device).

Shared with the backward (gdn_bwd.GdnBwdSm90): the kernels' fake arguments
(prepare_kernel, recurrence_kernel), stream_buffers, offsets_as_int32, check_same_config,
check_workspace_pair.

The workspace (work16, work32) holds T = (I + A)^-1 and M of every (chunk, head), packed
into one 64 x 64 block (kernels/gdn_layout.py), and the factor rows (with the column
scales that turn T into the scaled inverses: W = T diag(t_w) K, U = T diag(t_u) V): all
the backward needs of stage 1. A caller who keeps it (for
training: gated_delta_net(..., keep_workspace=True)) hands it to
GdnBwdSm90.execute(forward_workspace=...), which then skips its own prepare.

What the kernels cannot do yet (NotImplementedError from check_support() and execute()):
more than 65535 sequences (one recurrence grid row each); q, k, v or o head offsets beyond
2^31 - 1 elements (the kernels index heads with 32-bit strides).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch

from ..reference.gated_delta_net import CHUNK_SIZE
from . import gdn_rules
from .cache import KernelBuilder
from .gdn_rules import MAX_SPAN, GdnShapes, check_gdn_inputs
from .launch import (device_guard, sm_count, stream_handle, stream_is_capturing,
                     stream_workspace, torch_stream)
from .op import Op
from .tensor_desc import TensorDesc, dtype_name, parse_dtype
from .validation import (INT32_MAX, check_bool, check_int, check_no_overlap, check_same_device,
                         check_tensor, check_value)

# Fingerprinted with the op's module: the kernels and the workspace layout they share.
KERNEL_SOURCES = ("precast.kernels.gdn_chunk_sm90", "precast.kernels.gdn_recurrence_sm90",
                  "precast.kernels.gdn_seq_table_sm90", "precast.kernels.gdn_layout",
                  "precast.kernels.gdn_unpack_sm90", "precast.kernels.attention_sm90",
                  "precast.kernels.tiling", "precast.kernels.fake")
# Batches of more sequences than this get the per-sequence table (gdn_seq_table_sm90, one
# small launch); up to it the kernels' scans of cu_seqlens are a single warp step.
TABLE_MIN_SEQS = 32


def kernel_modes(v_dim: int) -> Tuple[str, ...]:
    """The kernels of an op: stage 1, stage 2 and, at V = 128, stage 2 split over two CTAs
    per (sequence, head) (64 state rows each; see splits_recurrences)."""
    return ("seq_table", "prepare", "recurrence") + (
        ("recurrence_split",) if v_dim == 128 else ())


def splits_recurrences(s: GdnShapes, index: Optional[int], rows: Optional[int] = None) -> bool:
    """Whether the recurrences (the forward's stage 2, the backward's states pass and state
    gradient) run split over two CTAs per (sequence, head), 64 state rows each: at V = 128,
    when the pairs fill at most half of the SMs (e.g. one long sequence), so that each CTA
    has an SM to itself instead of half of the SMs idling. Otherwise one CTA per pair reads
    the chunk's tiles once. ``rows``: the grid's rows per head when not the N sequences
    (the backward's states pass from checkpoints: one per checkpoint row)."""
    return s.V == 128 and 2 * (s.N if rows is None else rows) * s.HO <= sm_count(index)


# initial_state and checkpoint dtypes in the static configuration: none, float32 or the io
# dtype ("io" keeps a plan's dtype lists free to expand over both io dtypes).
DTYPE_OPTIONS = ("none", "float32", "io")
MAX_SEQUENCES = 65535  # the recurrence launches one grid row (y) per sequence
DATA_ALIGN = 16  # bytes: the workspace's base (TMA)
# Where each static field comes from in a call (for the messages when a call differs).
CONFIG_SOURCES = {
    "dtype": "q, k, v dtype", "k_dim": "q and k head dim K", "v_dim": "v head dim V",
    "q_heads": "q heads HQ", "k_heads": "k heads HK", "v_heads": "v heads HV",
    "g_dtype": "g dtype", "beta_dtype": "beta dtype",
    "state_dtype": "initial_state dtype ('none': no initial_state)",
    "state_pool": "state_indices given (a state pool)",
    "output_final_state": "output_final_state",
    "use_qk_l2norm_in_kernel": "use_qk_l2norm_in_kernel",
    "checkpoint_dtype": "checkpoint dtype ('none': no checkpoint_every_n_tokens)",
}
WORKSPACE_NAMES = ("work16", "work32")


def workspace_dtypes(io: torch.dtype) -> Tuple[torch.dtype, ...]:
    """The dtypes of the workspace pair (gdn_layout.workspace_shapes' order)."""
    return (io, torch.float32)


def _dtype_option(dtype: Optional[torch.dtype], io: torch.dtype) -> str:
    return "none" if dtype is None else "io" if dtype == io else dtype_name(dtype)


def _option_dtype(name: str, option, io: torch.dtype) -> Optional[torch.dtype]:
    check_value(option in DTYPE_OPTIONS, ValueError,
                f"{name} must be one of {', '.join(map(repr, DTYPE_OPTIONS))} ('io': the io "
                f"dtype), got {option!r}")
    return {"none": None, "float32": torch.float32, "io": io}[option]


def static_config_of(s: GdnShapes) -> Dict[str, object]:
    """The static configuration (cache key) of a validated call: what selects the generated
    code. Scale, checkpoint_every_n_tokens, T, N and strides are runtime values."""
    return {"dtype": dtype_name(s.dtype), "k_dim": s.K, "v_dim": s.V, "q_heads": s.HQ,
            "k_heads": s.HK, "v_heads": s.HV, "g_dtype": dtype_name(s.g_dtype),
            "beta_dtype": dtype_name(s.beta_dtype),
            "state_dtype": _dtype_option(s.state_dtype, s.dtype), "state_pool": s.uses_pool,
            "output_final_state": s.output_final_state,
            "use_qk_l2norm_in_kernel": s.use_qk_l2norm_in_kernel,
            "checkpoint_dtype": _dtype_option(s.checkpoint_dtype, s.dtype)}


def _stride(t) -> Tuple[int, ...]:
    return tuple(t.stride()) if isinstance(t, torch.Tensor) else t.stride


def _check_head_offsets(name: str, t) -> None:
    _, heads, dim = t.shape
    head_stride = _stride(t)[1]
    last_head = (heads - 1) * head_stride + dim if heads > 1 else 0
    check_value(last_head <= INT32_MAX, NotImplementedError,
                f"{name}: the head stride {head_stride} puts the last head {last_head} elements "
                "from the first; the kernels take at most 2^31 - 1 (32-bit head offsets): pass "
                "a copy with heads packed")


def check_kernel_limits(s: GdnShapes, tokens: Mapping[str, object]) -> None:
    """What valid calls the kernels cannot run yet (beyond gdn_rules); ``tokens`` names the
    [T, heads, dim] tensors (q, k, v, o)."""
    check_value(s.N <= MAX_SEQUENCES, NotImplementedError,
                f"cu_seqlens: N = {s.N} sequences; the recurrence kernel takes at most "
                f"{MAX_SEQUENCES} (one grid row per sequence)")
    for name, t in tokens.items():
        if t is not None:
            _check_head_offsets(name, t)


def readable_in_place(role: str, t: torch.Tensor) -> bool:
    """Whether execute() reads (or writes) ``t`` where it is, as far as its own layout goes
    (gdn_rules' per-tensor layout rules and the kernel limits; dtype, shape and relation
    errors are left to execute()). ``role``: "tokens" (q, k, v), "gate" (g, beta),
    "offsets" (cu_seqlens, state_indices) or "state" (initial_state / pool). The allocating
    function copies what is not."""
    check_value(role in ("tokens", "gate", "offsets", "state"), ValueError,
                f"unknown role {role!r}")
    try:
        if role == "tokens":
            gdn_rules._tokens("t", t, (t.dtype,), "", None, t.device.type)
            _check_head_offsets("t", t)
        elif role == "state":
            gdn_rules._state("t", t, (t.dtype,), (None,) * 4, "", t.device.type)
        else:
            gdn_rules._tensor("t", t, "", dtypes=(t.dtype,), rank=t.dim(),
                              align=t.element_size(), contiguous=role == "offsets",
                              device=t.device.type)
    except (ValueError, NotImplementedError):
        return False
    return True



# --- fake arguments (cutlass is imported only when building) -----------------------------------
def _cute_type(dtype: torch.dtype):
    from ..kernels.fake import cute_dtype
    return cute_dtype(dtype_name(dtype))


def _strides64(count: int, itemsize: int) -> tuple:
    """Runtime 64-bit strides, multiples of 16 bytes (as gdn_rules requires): a pool, the
    checkpoints or the workspace may span more than 2^31 elements."""
    import cutlass.cute as cute
    return tuple(cute.sym_int(width=64, divisibility=16 // itemsize) for _ in range(count))


def _fake_gate(dtype: torch.dtype, tokens, heads: int):
    """g, beta (T, HO): any token stride (a column of a fused projection), element aligned."""
    import cutlass.cute as cute
    return cute.runtime.make_fake_tensor(_cute_type(dtype), (tokens, heads),
                                         (cute.sym_int(width=64), 1),
                                         assumed_align=dtype.itemsize)


def _fake_state(dtype: torch.dtype, s: GdnShapes):
    """States (rows, HO, V, K): K contiguous, the other strides free (gdn_rules)."""
    import cutlass.cute as cute
    return cute.runtime.make_fake_tensor(_cute_type(dtype), (cute.sym_int(), s.HO, s.V, s.K),
                                         _strides64(3, dtype.itemsize) + (1,),
                                         assumed_align=DATA_ALIGN)


def _fake_rows(dtype: torch.dtype, rows, tail: Tuple[int, ...]):
    """(rows, *tail) compact but for a 64-bit leading stride: workspaces may span more than
    2^31 elements."""
    import cutlass.cute as cute
    inner = tuple(math.prod(tail[i + 1:]) for i in range(len(tail)))
    return cute.runtime.make_fake_tensor(_cute_type(dtype), (rows,) + tuple(tail),
                                         _strides64(1, dtype.itemsize) + inner,
                                         assumed_align=DATA_ALIGN)


def _fake_workspace(s: GdnShapes, chunks=None) -> tuple:
    """work16 (chunks, HO, 64, F) and work32 (chunks, HO, FACTOR_COLS), compact but for
    64-bit chunk strides; ``chunks``: their symbolic row count (a new one by default)."""
    import cutlass.cute as cute
    from ..kernels.gdn_layout import workspace_shapes
    chunks = cute.sym_int() if chunks is None else chunks
    shape16, shape32 = workspace_shapes(0, 1, s.HO, s.K, s.V)
    return (_fake_rows(s.dtype, chunks, shape16[1:]),
            _fake_rows(torch.float32, chunks, shape32[1:]))


def _fake_offsets():
    """cu_seqlens (N + 1,) and state_indices (N,): int32, contiguous."""
    import cutlass
    import cutlass.cute as cute
    from ..kernels.fake import fake_packed
    return fake_packed(cutlass.Int32, (cute.sym_int(),), 4)


def prepare_kernel(s: GdnShapes):
    """Stage 1 (GdnChunkPrepareSm90, without W and U: gdn_layout) and its fake arguments
    (q, k, v, g, beta, cu_seqlens, table, work16, work32, scale, stream): the forward's
    and the backward's."""
    import cutlass
    import cutlass.cute as cute
    from ..kernels.fake import fake_stream, fake_tokens, scalar
    from ..kernels.gdn_chunk_sm90 import GdnChunkPrepareSm90
    io, tokens, chunks = _cute_type(s.dtype), cute.sym_int(), cute.sym_int()
    kernel = GdnChunkPrepareSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, s.use_qk_l2norm_in_kernel,
                                 _cute_type(s.g_dtype), _cute_type(s.beta_dtype),
                                 store_wu=False)
    args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
            fake_tokens(io, tokens, s.HV, s.V), _fake_gate(s.g_dtype, tokens, s.HO),
            _fake_gate(s.beta_dtype, tokens, s.HO), _fake_offsets(), _fake_offsets(),
            *_fake_workspace(s, chunks), scalar(cutlass.Float32, 1.0), fake_stream())
    return kernel, args


def seq_table_kernel():
    """The per-sequence table (GdnSeqTableSm90) and its fake arguments (cu_seqlens, table,
    checkpoint interval, stream)."""
    import cutlass
    from ..kernels.fake import fake_stream, scalar
    from ..kernels.gdn_seq_table_sm90 import GdnSeqTableSm90
    return GdnSeqTableSm90(), (_fake_offsets(), _fake_offsets(), scalar(cutlass.Int32, 0),
                               fake_stream())


def recurrence_kernel(s: GdnShapes, *, state_dtype: Optional[torch.dtype], pool: bool,
                      final_state: bool, checkpoint_dtype: Optional[torch.dtype],
                      v_splits: int = 1, states_only: bool = False,
                      from_checkpoints: bool = False):
    """Stage 2 (GdnChunkRecurrenceSm90) and its fake arguments (q, k, work16, work32,
    cu_seqlens, table, o, initial state, state_indices, final state, checkpoints, v,
    ckpt_every, stream); absent tensors are None. W and U's products are made from v, T (in
    work16's packed block) and its scales. states_only: no o, the checkpoints (io dtype)
    stored by TMA (the backward's states pass); from_checkpoints: that pass started from the
    forward's checkpoints (passed as the initial state, of ``state_dtype``)."""
    import cutlass
    import cutlass.cute as cute
    from ..kernels.fake import fake_stream, fake_tokens, scalar
    from ..kernels.gdn_recurrence_sm90 import GdnChunkRecurrenceSm90
    io, tokens = _cute_type(s.dtype), cute.sym_int()
    kernel = GdnChunkRecurrenceSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, state_dtype is not None,
                                    pool, final_state, checkpoint_dtype is not None,
                                    v_splits=v_splits, states_only=states_only,
                                    from_checkpoints=from_checkpoints)
    o = None if states_only else fake_tokens(io, cute.sym_int(), s.HO, s.V)
    args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
            *_fake_workspace(s), _fake_offsets(), _fake_offsets(), o,
            None if state_dtype is None else _fake_state(state_dtype, s),
            _fake_offsets() if pool else None,
            _fake_state(torch.float32, s) if final_state else None,
            None if checkpoint_dtype is None else _fake_state(checkpoint_dtype, s),
            fake_tokens(io, tokens, s.HV, s.V), scalar(cutlass.Int32, CHUNK_SIZE), fake_stream())
    return kernel, args


# --- what both GDN ops share at run time -------------------------------------------------------
def check_workspace_pair(role: str, pair, s: GdnShapes) -> list:
    """[(label, tensor)] of the workspace pair (work16, work32) passed as ``role`` (the
    forward's ``workspace``, the backward's ``forward_workspace``), checked against
    gdn_layout.workspace_shapes(T, N) and workspace_dtypes: contiguous, 16-byte aligned."""
    from ..kernels.gdn_layout import workspace_shapes
    paired = isinstance(pair, (tuple, list))
    check_value(paired and len(pair) == len(WORKSPACE_NAMES), TypeError,
                f"{role}: expected the pair (work16, work32) shaped "
                f"GdnFwdSm90.workspace_shapes(T, N), got {type(pair).__name__}"
                + (f" of {len(pair)}" if paired else ""))
    labelled = []
    for name, t, dtype, shape in zip(WORKSPACE_NAMES, pair, workspace_dtypes(s.dtype),
                                     workspace_shapes(s.T, s.N, s.HO, s.K, s.V)):
        label = f"{role} ({name})"
        check_tensor(label, t, dtypes=(dtype,), shape=shape, align=DATA_ALIGN,
                     contiguous=True, max_span=MAX_SPAN)
        labelled.append((label, t))
    return labelled


def check_same_config(op_name: str, want: Mapping[str, object], got: Mapping[str, object],
                      sources: Mapping[str, str], function: str) -> None:
    """A call's static fields (``got``) against an op's (``want``): one message per
    differing field, naming where it comes from (``sources``) and the allocating
    ``function`` that keeps one op per configuration."""
    for key, value in got.items():
        if value != want[key]:
            both_dtypes = key.endswith("dtype") and "none" not in (value, want[key])
            raise (TypeError if both_dtypes else ValueError)(
                f"{key} = {value!r} ({sources[key]}) but this op is compiled for "
                f"{key} = {want[key]!r}; make another {op_name} for this configuration "
                f"({function} keeps one per configuration)")


def stream_buffers(op_name: str, cache: dict, outgrown: list, key, rows: int,
                   layouts: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...], index,
                   handle: int, what: str, remedy: str) -> Tuple[torch.Tensor, ...]:
    """Uninitialized buffers (rows, *tail) of each (tail, dtype) in ``layouts``, made on
    the stream and kept per ``key`` (device, stream, ...) by launch.stream_workspace
    (grown when a call needs more rows, never made while the stream captures a graph:
    then the RuntimeError names ``what`` is missing and the ``remedy``); views of their
    first ``rows`` rows."""
    def make(count):
        with torch.cuda.stream(torch_stream(handle, index)):
            return tuple(torch.empty((count,) + tail, dtype=dtype, device=f"cuda:{index}")
                         for tail, dtype in layouts)
    buffers = stream_workspace(
        cache, outgrown, key, rows, make, lambda: stream_is_capturing(handle),
        lambda: f"{op_name}.execute: the stream is capturing a CUDA graph and this op has "
                f"no {what}; {remedy}")
    return tuple(b[:rows] for b in buffers)


def sequence_table(kernels, cache: dict, outgrown: list, index, handle: int, cu_seqlens,
                   num_seqs: int, every: int):
    """What the kernels take as their sequence table: for more than TABLE_MIN_SEQS
    sequences the table (gdn_seq_table_sm90) made on the stream into the op's buffer for
    (device, stream); else, or while the stream captures a graph before that buffer exists,
    cu_seqlens itself (the kernels then scan it, as they did before the table)."""
    rows = 2 * (num_seqs + 1)
    have = cache.get((index, handle))
    if num_seqs <= TABLE_MIN_SEQS or (
            (have is None or have[0].shape[0] < rows) and stream_is_capturing(handle)):
        return cu_seqlens
    # (never refused, so no message: a capturing stream without the buffer returned above)
    (table,) = stream_buffers("GDN", cache, outgrown, (index, handle), rows,
                              (((), torch.int32),), index, handle, "", "")
    kernels["seq_table"](cu_seqlens, table, every, handle)
    return table


def offsets_as_int32(op_name: str, cache: dict, outgrown: list, index, handle: int,
                     cu_seqlens, num_seqs: int) -> torch.Tensor:
    """int64 cu_seqlens converted, on the stream, into the op's int32 buffer for (device,
    stream) (stream_buffers): the kernels read int32 offsets. Every valid offset is at
    most T < 2^31, so the conversion is exact; values are never read on the host."""
    (offsets,) = stream_buffers(
        op_name, cache, outgrown, (index, handle), num_seqs + 1, (((), torch.int32),), index,
        handle, f"int32 buffer of {num_seqs + 1} offsets for int64 cu_seqlens on it",
        "execute once on this stream with as many sequences before capturing, or pass "
        "int32 cu_seqlens")
    with torch.cuda.stream(torch_stream(handle, index)):
        offsets.copy_(cu_seqlens)
    return offsets


class GdnFwdSm90(Op):
    """o (and the final state, checkpoints, the pool rows) of the Gated DeltaNet forward.

    Construct from sample tensors or TensorDescs of q, k, v, g, beta, cu_seqlens (and the
    initial state / pool and state_indices when used), then check_support(), compile(),
    execute(). Compiled for the fields of :func:`static_config_of` (the workspace holds
    what a backward that reuses it needs: see the module docstring); scale,
    checkpoint_every_n_tokens (a multiple of 64), token and sequence counts and strides are
    runtime values. batch_invariant is accepted and free (see the module docstring).
    """

    supported_archs = ("sm_90a",)
    kernel_sources = KERNEL_SOURCES

    def __init__(self, sample_q, sample_k, sample_v, sample_g, sample_beta, sample_cu_seqlens,
                 *, scale: Optional[float] = None, sample_initial_state=None,
                 output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                 checkpoint_every_n_tokens: Optional[int] = None,
                 checkpoint_dtype: Optional[torch.dtype] = None, sample_state_indices=None,
                 batch_invariant: bool = False):
        super().__init__()
        self._samples = {name: TensorDesc.optional(t) for name, t in (
            ("q", sample_q), ("k", sample_k), ("v", sample_v), ("g", sample_g),
            ("beta", sample_beta), ("cu_seqlens", sample_cu_seqlens),
            ("initial_state", sample_initial_state), ("state_indices", sample_state_indices))}
        self.scale = scale
        self.output_final_state = output_final_state
        self.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel
        self.checkpoint_every_n_tokens = checkpoint_every_n_tokens
        self.checkpoint_dtype = checkpoint_dtype
        self.batch_invariant = batch_invariant
        self._shapes: Optional[GdnShapes] = None
        # Workspaces this op made, per (device, stream): see _own_workspace. Outgrown ones
        # stay alive: a graph captured earlier may still use them.
        self._workspaces: Dict[Tuple[Optional[int], int], Tuple[torch.Tensor, ...]] = {}
        self._outgrown: list = []
        # int32 copies of int64 cu_seqlens, per (device, stream): see offsets_as_int32
        self._offset_buffers: Dict[Tuple[Optional[int], int], torch.Tensor] = {}
        # per-sequence tables, per (device, stream): see sequence_table
        self._table_buffers: Dict[Tuple[Optional[int], int], Tuple[torch.Tensor]] = {}

    # --- the static configuration -----------------------------------------------------------
    def _call_shapes(self, q, k, v, g, beta, cu_seqlens, *, scale, initial_state=None,
                     state_indices=None, checkpoint_every_n_tokens=None, o=None,
                     final_state=None, checkpoints=None) -> GdnShapes:
        """gdn_rules on one call with this op's static flags."""
        return check_gdn_inputs(
            q, k, v, g, beta, cu_seqlens, scale=scale, initial_state=initial_state,
            output_final_state=self.output_final_state,
            use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel,
            checkpoint_every_n_tokens=checkpoint_every_n_tokens,
            checkpoint_dtype=self.checkpoint_dtype, state_indices=state_indices,
            batch_invariant=self.batch_invariant, o=o, final_state=final_state,
            checkpoints=checkpoints)

    @property
    def shapes(self) -> GdnShapes:
        """The samples' GdnShapes (validated once)."""
        if self._shapes is None:
            self._shapes = self._call_shapes(
                **self._samples, scale=self.scale,
                checkpoint_every_n_tokens=self.checkpoint_every_n_tokens)
        return self._shapes

    def static_config(self) -> Dict[str, object]:
        return static_config_of(self.shapes)

    @classmethod
    def from_config(cls, dtype="bfloat16", k_dim=128, v_dim=128, q_heads=4, k_heads=None,
                    v_heads=None, g_dtype="float32", beta_dtype="float32", state_dtype="none",
                    state_pool=False, output_final_state=False, use_qk_l2norm_in_kernel=False,
                    checkpoint_dtype="none") -> "GdnFwdSm90":
        """Descriptors of a small batch (2 sequences of 64 tokens) with this static
        configuration (for precompile). k_heads and v_heads default to q_heads."""
        io = parse_dtype(dtype)
        k_dim, v_dim, hq = (check_int(name, value, lo=1) for name, value in (
            ("k_dim", k_dim), ("v_dim", v_dim), ("q_heads", q_heads)))
        hk = hq if k_heads is None else check_int("k_heads", k_heads, lo=1)
        hv = hq if v_heads is None else check_int("v_heads", v_heads, lo=1)
        state = _option_dtype("state_dtype", state_dtype, io)
        ckpt = _option_dtype("checkpoint_dtype", checkpoint_dtype, io)
        pool = check_bool("state_pool", state_pool)
        check_value(not pool or state is not None, ValueError,
                    "state_pool=True needs state_dtype 'float32' or 'io' (the pool is the "
                    "initial state)")
        n, tokens, ho = 2, 2 * CHUNK_SIZE, max(hq, hv)
        rows = 2 * n if pool else n
        return cls(TensorDesc(io, (tokens, hq, k_dim)), TensorDesc(io, (tokens, hk, k_dim)),
                   TensorDesc(io, (tokens, hv, v_dim)), TensorDesc(g_dtype, (tokens, ho)),
                   TensorDesc(beta_dtype, (tokens, ho)), TensorDesc(torch.int32, (n + 1,)),
                   sample_initial_state=(None if state is None
                                         else TensorDesc(state, (rows, ho, v_dim, k_dim))),
                   sample_state_indices=TensorDesc(torch.int32, (n,)) if pool else None,
                   output_final_state=check_bool("output_final_state", output_final_state),
                   use_qk_l2norm_in_kernel=check_bool("use_qk_l2norm_in_kernel",
                                                      use_qk_l2norm_in_kernel),
                   checkpoint_every_n_tokens=None if ckpt is None else CHUNK_SIZE,
                   checkpoint_dtype=ckpt)

    # --- rules --------------------------------------------------------------------------------
    def _check(self) -> None:
        s = self.shapes
        check_kernel_limits(s, {name: self._samples[name] for name in ("q", "k", "v")})

    def _same_config(self, s: GdnShapes) -> None:
        """A call's static fields against this op's (one message per differing field)."""
        check_same_config(type(self).__name__, static_config_of(self.shapes),
                          static_config_of(s), CONFIG_SOURCES, "gated_delta_net")

    # --- compile ------------------------------------------------------------------------------
    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        s = self.shapes

        # Stage 1 stores T (packed with M into one 64 x 64 block, where the backward reads
        # it too) and its column scales instead of W and U; stage 2 makes W and U's products
        # from them, k and v: 32 KB fewer stores and 16 KB fewer loads per (chunk, head),
        # one more 64-deep product on the state's chain. Split or not, every state row's
        # arithmetic is the same (batch invariance is bitwise).
        def recurrence(v_splits: int = 1):
            return recurrence_kernel(s, state_dtype=s.state_dtype, pool=s.uses_pool,
                                     final_state=s.output_final_state,
                                     checkpoint_dtype=s.checkpoint_dtype, v_splits=v_splits)

        builders = {"seq_table": seq_table_kernel,
                    "prepare": lambda: prepare_kernel(s),
                    "recurrence": recurrence,
                    "recurrence_split": lambda: recurrence(v_splits=2)}
        return {mode: builders[mode] for mode in kernel_modes(s.V)}

    # --- run ----------------------------------------------------------------------------------
    def workspace_shapes(self, total_tokens: int, num_seqs: int) -> Tuple[Tuple[int, ...], ...]:
        """Shapes of the workspace ``execute(workspace=...)`` takes for T tokens in N
        sequences: the pair (work16, work32), work16 (T // 64 + N, HO, 64, 64) in the
        io dtype and work32 (T // 64 + N, HO, 272) float32, both contiguous: what a
        backward reusing them reads (GdnBwdSm90.execute(forward_workspace=...)).
        No zeroing needed: the prepare kernel writes every row the recurrence (and the
        backward) reads."""
        from ..kernels.gdn_layout import workspace_shapes
        s = self.shapes
        return workspace_shapes(check_int("total_tokens", total_tokens, lo=0),
                                check_int("num_seqs", num_seqs, lo=0), s.HO, s.K, s.V)

    def workspace_dtypes(self) -> Tuple[torch.dtype, ...]:
        """The dtypes of the workspace's tensors, in workspace_shapes' order."""
        return workspace_dtypes(self.shapes.dtype)

    def make_workspace(self, total_tokens: int, num_seqs: int, device=None
                       ) -> Tuple[torch.Tensor, ...]:
        """An uninitialized workspace for execute(workspace=...), on ``device`` (default:
        the current CUDA device, as execute needs)."""
        device = "cuda" if device is None else device
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in zip(
            self.workspace_shapes(total_tokens, num_seqs), self.workspace_dtypes()))

    def _own_workspace(self, index: Optional[int], handle: int, total_tokens: int,
                       num_seqs: int) -> Tuple[torch.Tensor, ...]:
        """This op's workspace for (device, stream) (stream_buffers); views of its first
        T // 64 + N chunk rows."""
        shapes = self.workspace_shapes(total_tokens, num_seqs)
        return stream_buffers(
            type(self).__name__, self._workspaces, self._outgrown, (index, handle),
            shapes[0][0], tuple((shape[1:], dtype) for shape, dtype in zip(
                shapes, self.workspace_dtypes())),
            index, handle, f"workspace of {shapes[0][0]} chunk rows for it",
            f"pass workspace= (make_workspace({total_tokens}, {num_seqs})) or execute once "
            "on this stream with as many tokens and sequences before capturing")

    def execute(self, q, k, v, g, beta, cu_seqlens, o, *, initial_state=None,
                state_indices=None, final_state=None, checkpoints=None, workspace=None,
                stream=None, scale: Optional[float] = None,
                checkpoint_every_n_tokens: Optional[int] = None) -> None:
        """Writes o [T, HO, V] and, as compiled, final_state [N, HO, V, K] (float32), the
        checkpoints [T // n + N, HO, V, K] (the state entering local positions 0, n, 2n, ...
        of each sequence, in order; rows past sum(ceil(len / n)) are not written) and the
        pool rows state_indices of initial_state (in place). Never reads device memory;
        allocates nothing when ``workspace`` is given (see workspace_shapes; else the op
        keeps one per device and stream), but for the pool rows gathered when T == 0 and
        the int32 copy of int64 cu_seqlens (kept per device and stream, like the
        workspace: execute once before capturing a graph with int64 offsets) and, for more
        than 32 sequences, the per-sequence table (2 (N + 1) int32, kept the same way; a
        capture before it exists runs without it, the kernels then scanning cu_seqlens).
        scale and checkpoint_every_n_tokens default to the constructor's.

        T == 0 (every sequence empty; TMA cannot describe empty tensors): no kernel runs;
        final_state is the initial state (the pool rows, or zeros without one) converted to
        float32 by a copy on the stream; the pool is unchanged and no checkpoint row exists.
        N == 0: nothing to write.
        """
        if not self._checked:
            self.check_support()
        check_value(o is not None, ValueError, "o is required: a [T, HO, V] output buffer of "
                    "q's dtype")
        check_value(final_state is not None or not self.output_final_state, ValueError,
                    "final_state is required: this op writes the final state "
                    "(output_final_state=True); pass an [N, HO, V, K] float32 buffer")
        n = (self.checkpoint_every_n_tokens if checkpoint_every_n_tokens is None
             else checkpoint_every_n_tokens)
        checkpointing = self.checkpoint_every_n_tokens is not None
        check_value(checkpoints is not None or not checkpointing, ValueError,
                    "checkpoints is required: this op writes checkpoints; pass a "
                    "[T // n + N, HO, V, K] buffer (see max_checkpoint_rows)")
        named = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                     initial_state=initial_state, state_indices=state_indices, o=o,
                     final_state=final_state, checkpoints=checkpoints)
        scale = self.scale if scale is None else scale

        def validate():
            s = self._call_shapes(q, k, v, g, beta, cu_seqlens, scale=scale,
                                  initial_state=initial_state, state_indices=state_indices,
                                  checkpoint_every_n_tokens=n, o=o, final_state=final_state,
                                  checkpoints=checkpoints)
            self._same_config(s)
            check_kernel_limits(s, dict(q=q, k=k, v=v, o=o))
            if workspace is not None:
                written = check_workspace_pair("workspace", workspace, s)
                check_same_device(written + list(named.items()))
                check_no_overlap(written, list(named.items()))
            return s

        ws_items, ws_form = self._layout_items(workspace)
        s = self._validated(tuple(named.values()) + ws_items, validate,
                            extra=(scale, n, ws_form))
        if workspace is not None:
            workspace = tuple(workspace)
        index = q.device.index
        kernels = self._ready(index)
        if s.N == 0:
            return
        handle = stream_handle(stream, index)
        if s.T == 0:
            if final_state is not None:
                with torch.cuda.stream(torch_stream(handle, index)):
                    if initial_state is None:
                        final_state.zero_()
                    elif state_indices is not None:
                        final_state.copy_(initial_state.index_select(0, state_indices))
                    else:
                        final_state.copy_(initial_state)
            return
        if workspace is None:
            workspace = self._own_workspace(index, handle, s.T, s.N)
        work16, work32 = workspace
        if s.cu_seqlens_dtype == torch.int64:
            cu_seqlens = offsets_as_int32(type(self).__name__, self._offset_buffers,
                                          self._outgrown, index, handle, cu_seqlens, s.N)
        every = n if checkpointing else 0
        with device_guard(index):
            table = sequence_table(kernels, self._table_buffers, self._outgrown, index, handle,
                                   cu_seqlens, s.N, every)
            kernels["prepare"](q, k, v, g, beta, cu_seqlens, table, work16, work32, s.scale,
                               handle)
            # ckpt_every is unused (compiled out) without checkpoints
            recurrence = "recurrence_split" if splits_recurrences(s, index) else "recurrence"
            kernels[recurrence](q, k, work16, work32, cu_seqlens, table, o, initial_state,
                                state_indices, final_state, checkpoints, v, every, handle)
