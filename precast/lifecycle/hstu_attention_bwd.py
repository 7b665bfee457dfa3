"""HSTU attention backward for SM90: HSTUBwdSm90.

Given dO, writes dQ, dK, dV of o = (M * SiLU(alpha q k^T)) v / scaling_seqlen for the same
packed batch, masks and scalars as the forward (paged KV is forward only). Semantics:
precast/reference/hstu_attention.py (hstu_attention_backward_reference).

Two paths, chosen by the static configuration:

* default (deterministic=False, D <= 128): one fused kernel with the key tiles fixed computes
  dK and dV and adds each query tile's dQ part into an fp32 workspace (T_q, H, D) with TMA
  reduce-adds. The kernel's idle warps convert the rows of finished L2 groups into dq (and
  zero them) while later groups run; a small kernel (dq_finish) converts the rest (the
  last group's, and any the warps had no time for). Jagged batches, whose CTAs are not
  scheduled in groups, and narrow windows, whose CTAs are too short to convert beside
  (converts_in_kernel), take two torch passes instead (dq = workspace, workspace = 0). The
  reduce-adds land in a varying order: dq may differ in the last bits from run to run (dk
  and dv do not).
* deterministic=True, or D = 256: two kernels, no atomics: dQ with the query tiles fixed
  (K, V streamed), dK and dV with the key tiles fixed (Q, dO streamed; at D = 256 dK and dV
  are separate passes, their accumulators do not fit in registers together). Every
  gradient row is summed by one CTA in a fixed order: bitwise identical run after run, at
  the price of recomputing S and dP for dQ (7 matmuls instead of 5).
"""
from __future__ import annotations

from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from .cache import KernelBuilder
from .hstu_attention import (DATA_ALIGN, FLOAT32_MAX, INDEX_ALIGN, TMA_SPAN_LIMIT, WINDOW_CAP,
                             _AttentionRules, check_offsets, check_tokens)
from .launch import (device_guard, stream_handle, stream_is_capturing, stream_workspace,
                     torch_stream)
from .op import Op
from .tensor_desc import TensorDesc, dtype_name
from .validation import (check_bool, check_int, check_no_overlap, check_same_device,
                         check_tensor, check_value)

KERNEL_SOURCES = ("precast.kernels.hstu_attention_bwd_sm90",
                  "precast.kernels.hstu_attention_fwd_sm90", "precast.kernels.attention_sm90",
                  "precast.kernels.activation",
                  "precast.kernels.scheduler", "precast.kernels.tiling", "precast.kernels.fake")
GRADIENTS = ("dq", "dk", "dv")
# Streamed data of the (sequence, head) pairs scheduled together. 16 MB with the fused
# kernel's dQ one tile behind: causal 1k-16k +1.6-3.7 % against 32 MB (bench/RESULTS.md
# runs 35b-35c; the best size is not monotonic in L, and 16 MB lost 6 % at 1k without the
# lag).
L2_GROUP_BYTES = 16 << 20
SYNC_ROWS_PER = 32768  # query tokens per workspace row of sync words (at least one row)


def fixed_rows(head_dim: int) -> int:
    """Rows of a kernel's fixed tile (64 per consumer warpgroup)."""
    return 128 if head_dim <= 128 else 64


SYNC_EXTRA_WORDS = 2  # sync words beside the two per L2 group (see HstuAttentionBackwardSm90)


def sync_rows(total_q: int) -> int:
    """Workspace rows after the T_q accumulator rows that hold the fused kernel's int32 sync
    words (two per L2 group, plus SYNC_EXTRA_WORDS)."""
    return 1 + total_q // SYNC_ROWS_PER


def sync_group_capacity(words: int) -> int:
    """The most L2 groups that ``words`` int32 sync words serve."""
    return (words - SYNC_EXTRA_WORDS) // 2


class Launch(NamedTuple):
    """How one backward kernel numbers its CTAs: compact (1: only the fixed tiles that
    exist, jagged batches) or dense in L2 groups of pair_group (sequence, head) pairs."""
    compact: int
    pair_group: int

    @staticmethod
    def plan(head_dim: int, heads: int, total_fixed: int, batch: int, max_fixed: int,
             max_groups: int) -> "Launch":
        """heads: the fixed side's (H_kv with the keys fixed); at most max_groups groups."""
        rows = fixed_rows(head_dim)
        tiles = max(-(-max_fixed // rows), 1)
        pairs = heads * max(batch, 1)
        # Dense CTAs of sequences shorter than max_seqlen have no rows: with most of them
        # empty, number only the tiles that exist (T / R + B per head at most).
        compact = int((total_fixed // rows + batch) * 2 <= tiles * max(batch, 1))
        # A group holds about L2_GROUP_BYTES of streamed data: 8 bytes per element of a
        # pair's longest side (fp32 dQ plus two 16-bit tiles).
        per_tile = rows * head_dim * 8
        pair_group = max(min(L2_GROUP_BYTES // per_tile // tiles, pairs), 1,
                         -(-pairs // max_groups))
        return Launch(compact, pair_group)

    def groups(self, heads: int, batch: int) -> int:
        return -(-heads * max(batch, 1) // self.pair_group)


# The fused kernel's idle warps convert dQ only behind CTAs that may stream at least this many
# query rows: under a narrow window (a local window of 256: ~6 streamed tiles a CTA) a slice
# still in flight when the producer finishes stretches a short CTA, and the torch passes win
# (run 27c: -1.4 % converting in the kernel).
MIN_CONVERT_STREAM_ROWS = 768


def converts_in_kernel(plan: Launch, window: Tuple[int, int], head_dim: int) -> bool:
    """Whether the fused kernel with this plan converts dQ itself (then dq_finish the rest)
    rather than leaving it to two torch passes: dense numbering (jagged batches have no L2
    groups to convert behind) and key tiles that see at least MIN_CONVERT_STREAM_ROWS query
    rows when the window is bounded on both sides (left + right + the tile's rows)."""
    left, right = window
    if plan.compact:
        return False
    return (left < 0 or right < 0
            or left + right + fixed_rows(head_dim) >= MIN_CONVERT_STREAM_ROWS)


class HSTUBwdSm90(_AttentionRules, Op):
    """dq, dk, dv of HSTU attention. Construct from sample tensors or TensorDescs (dq, dk,
    dv default to q's and k's shapes), then check_support(), compile(), execute().

    Compiled for (dtype, head_dim, num_heads, num_kv_heads, which window sides are bounded,
    func_intervals, deterministic); token counts, batch size, max_seqlen, window values,
    alpha and scaling_seqlen are runtime values.
    """

    supported_archs = ("sm_90a",)
    kernel_sources = KERNEL_SOURCES
    paged_kv = None  # forward only

    def __init__(self, sample_do, sample_q, sample_k, sample_v, sample_dq, sample_dk,
                 sample_dv, sample_cu_seqlens_q, sample_cu_seqlens_k, max_seqlen_q: int,
                 max_seqlen_k: int, window_size=(-1, -1), alpha: float = 1.0,
                 scaling_seqlen: Optional[float] = None, sample_func=None,
                 deterministic: bool = False):
        super().__init__()
        desc = TensorDesc.optional
        self.do, self.q, self.k, self.v = (desc(t) for t in (sample_do, sample_q, sample_k,
                                                             sample_v))
        # Omitted gradient samples: compact tensors shaped like their inputs.
        self.dq, self.dk, self.dv = (
            desc(grad) if grad is not None or like is None else TensorDesc(like.dtype, like.shape)
            for grad, like in ((sample_dq, self.q), (sample_dk, self.k), (sample_dv, self.v)))
        self.cu_seqlens_q = desc(sample_cu_seqlens_q)
        self.cu_seqlens_k = desc(sample_cu_seqlens_k)
        self.func = desc(sample_func)
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.window_size = window_size
        self.alpha, self.scaling_seqlen = alpha, scaling_seqlen
        self.deterministic = deterministic
        # fp32 dQ accumulators this op made, per (device, stream): see _own_workspace. Ones
        # that were outgrown stay alive: a graph captured earlier may still use them.
        self._workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
        self._outgrown: list = []
        self._samples = dict(do=sample_do, q=sample_q, k=sample_k, v=sample_v, dq=sample_dq,
                             dk=sample_dk, dv=sample_dv, cu_seqlens_q=sample_cu_seqlens_q,
                             cu_seqlens_k=sample_cu_seqlens_k, func_tensor=sample_func)

    def static_config(self) -> Dict[str, object]:
        return dict(self._attention_config(), deterministic=bool(self.deterministic))

    @classmethod
    def from_config(cls, dtype="bfloat16", head_dim=128, num_heads=4, num_kv_heads=None,
                    window_left_bounded=False, window_right_bounded=True, func_intervals=0,
                    deterministic=False):
        """Descriptors of a small batch with this static configuration (for precompile)."""
        b = cls._config_batch(dtype, head_dim, num_heads, num_kv_heads, window_left_bounded,
                              window_right_bounded, func_intervals)
        return cls(b.q, b.q, b.kv, b.kv, None, None, None, b.cu_seqlens, b.cu_seqlens,
                   b.seqlen, b.seqlen, b.window, sample_func=b.func,
                   deterministic=check_bool("deterministic", deterministic))

    # --- rules ------------------------------------------------------------------------------
    def _check(self) -> None:
        check_value(self.q is not None and self.do is not None, ValueError,
                    "do and q are required")
        check_bool("deterministic", self.deterministic)
        self._check_static()
        self._check_masks()
        t_q, t_k, entries = self._validate(self.do, self.q, self.k, self.v, self.dq, self.dk,
                                           self.dv, self.cu_seqlens_q, self.cu_seqlens_k,
                                           self.func)
        max_q, _ = self._seqlens(self.max_seqlen_q, self.max_seqlen_k, t_q, t_k, entries)
        self._kernel_scalars(self.alpha, self.scaling_seqlen, max_q)
        self._check_relations(self._samples)

    def _validate(self, do, q, k, v, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                  func_tensor) -> Tuple[int, int, int]:
        """Every per-tensor rule against the static configuration; shared by check_support()
        and execute(). Returns (T_q, T_k, B + 1)."""
        h, h_kv, d, dt = self.num_heads, self.num_kv_heads, self.head_dim, (self.dtype,)
        t_q = check_tokens("q", q, dt, h, d)[0]
        for name, t in (("do", do), ("dq", dq)):
            check_value(t is not None, ValueError, f"{name} is required")
            self._same_tokens(name, check_tokens(name, t, dt, h, d)[0], "q", t_q)
        entries = check_offsets("cu_seqlens_q", cu_seqlens_q)
        check_value(entries >= 1, ValueError,
                    "cu_seqlens_q: needs B + 1 >= 1 entries (the offsets start at 0), got 0")
        self._same_entries("cu_seqlens_k", check_offsets("cu_seqlens_k", cu_seqlens_k), entries)
        check_value(k is not None and v is not None, ValueError, "k and v are required")
        t_k = check_tokens("k", k, dt, h_kv, d)[0]
        for name, t in (("v", v), ("dk", dk), ("dv", dv)):
            check_value(t is not None, ValueError, f"{name} is required")
            self._same_tokens(name, check_tokens(name, t, dt, h_kv, d)[0], "k", t_k)
        self._check_func_argument(func_tensor, t_q)
        return t_q, t_k, entries

    def _work_tiles(self, max_q: int, max_k: int, batch: int) -> Tuple[int, str]:
        # Each kernel numbers its CTAs (sequence, head, fixed tile) in one int32 grid axis.
        rows = fixed_rows(self.head_dim)
        name, longest = max(("max_seqlen_k", max_k), ("max_seqlen_q", max_q),
                            key=lambda item: item[1])
        return (self.num_heads * -(-longest // rows) * batch,
                f"{name} = {longest}: H x ceil({name} / {rows}) x B")

    def _kernel_scalars(self, alpha, scaling_seqlen, max_q: int) -> Tuple[float, float, float]:
        """(alpha / 2, alpha / scaling_seqlen, 1 / scaling_seqlen) as the kernels take them."""
        half_alpha, inv_scaling = self._scalars(alpha, scaling_seqlen, max_q)
        scale_ds = 2.0 * half_alpha * inv_scaling
        check_value(abs(scale_ds) <= FLOAT32_MAX, ValueError,
                    f"alpha / scaling_seqlen = {scale_ds} overflows float32")
        return half_alpha, scale_ds, inv_scaling

    @staticmethod
    def _check_relations(named: Mapping[str, object]) -> None:
        """One device; dq, dk, dv alias nothing (disjoint views of one buffer are fine)."""
        check_same_device(list(named.items()))
        written = GRADIENTS + ("workspace",)
        check_no_overlap([(k, named.get(k)) for k in written],
                         [(k, t) for k, t in named.items() if k not in written])

    # --- compile ------------------------------------------------------------------------------
    @property
    def fused(self) -> bool:
        """One pass with dQ reduced through an fp32 workspace (D <= 128, not deterministic)."""
        return not self.deterministic and self.head_dim <= 128

    def kernel_modes(self) -> Tuple[str, ...]:
        if self.fused:  # the kernel, then the rest of the dQ conversion
            return ("fused", "dq_finish")
        # D = 256: the dK and dV accumulators do not fit in registers together.
        return ("dq", "dkdv") if self.head_dim <= 128 else ("dq", "dk", "dv")

    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        def builder(mode):
            def build():
                import cutlass
                import cutlass.cute as cute
                from ..kernels.fake import (cute_dtype, fake_packed, fake_stream, fake_tokens,
                                            scalar)
                from ..kernels.hstu_attention_bwd_sm90 import (DqFinishSm90,
                                                               HstuAttentionBackwardSm90)
                dt = cute_dtype(dtype_name(self.dtype))
                h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim

                def tokens(count, heads):
                    return fake_tokens(dt, count, heads, d)

                def packed(shape):
                    return fake_packed(cutlass.Int32, shape, INDEX_ALIGN)

                t_q, t_k, entries = cute.sym_int(), cute.sym_int(), cute.sym_int()
                # the op's compact fp32 workspace (T_q, H, D) and its int32 sync words
                dq_acc = cute.runtime.make_fake_tensor(
                    cutlass.Float32, (t_q, h, d), (h * d, d, 1), assumed_align=DATA_ALIGN)
                sync = packed((cute.sym_int(),))
                if mode == "dq_finish":
                    return DqFinishSm90(h, h_kv), (
                        dq_acc, tokens(t_q, h), sync, packed((entries,)),
                        scalar(cutlass.Int32, 1), scalar(cutlass.Int32, 1), fake_stream())
                func = None
                if self.func_intervals:
                    func = packed((1, self.func_intervals, cute.sym_int()))
                left, right = self.window
                kernel = HstuAttentionBackwardSm90(dt, d, h, h_kv, left >= 0, right >= 0,
                                                   self.func_intervals, mode)
                grad_a = {"dq": tokens(t_q, h), "dkdv": tokens(t_k, h_kv),
                          "fused": tokens(t_k, h_kv), "dk": tokens(t_k, h_kv), "dv": None}[mode]
                grad_b = tokens(t_k, h_kv) if mode in ("dkdv", "dv", "fused") else None
                fused = mode == "fused"
                args = (tokens(t_q, h), tokens(t_k, h_kv), tokens(t_k, h_kv), tokens(t_q, h),
                        grad_a, grad_b, dq_acc if fused else None,
                        tokens(t_q, h) if fused else None, sync if fused else None,
                        packed((entries,)), packed((entries,)), func,
                        scalar(cutlass.Int32, 0), scalar(cutlass.Int32, 0),
                        scalar(cutlass.Int32, 0), scalar(cutlass.Int32, 1),
                        scalar(cutlass.Int32, 0),
                        scalar(cutlass.Int32, -1), scalar(cutlass.Int32, -1),
                        scalar(cutlass.Float32, 0.5),
                        scalar(cutlass.Float32, 1.0), scalar(cutlass.Float32, 1.0),
                        fake_stream())
                return kernel, args
            return build
        return {mode: builder(mode) for mode in self.kernel_modes()}

    # --- run ----------------------------------------------------------------------------------
    def workspace_shape(self, total_q: int) -> Tuple[int, ...]:
        """Shape of the float32 workspace ``execute(workspace=...)`` takes for T_q query
        tokens: (T_q + sync_rows(T_q), H, D) for the fused kernel, its dQ accumulator and a
        few int32 words the kernels synchronize with (zero it once; every execute leaves it
        zero), else (0,): no workspace (deterministic=True or D = 256)."""
        t_q = check_int("total_q", total_q, lo=0)
        if not self.fused:
            return (0,)
        return (t_q + sync_rows(t_q), self.num_heads, self.head_dim)

    def _own_workspace(self, index: int, handle: int, total_q: int) -> torch.Tensor:
        """This op's workspace for (device, stream) (launch.stream_workspace); a view of its
        first workspace_shape(T_q)[0] rows."""
        def make(rows):
            with torch.cuda.stream(torch_stream(handle, index)):
                return torch.zeros((rows, self.num_heads, self.head_dim),
                                   dtype=torch.float32, device=f"cuda:{index}")
        rows = self.workspace_shape(total_q)[0]
        ws = stream_workspace(
            self._workspaces, self._outgrown, (index, handle), rows, make,
            lambda: stream_is_capturing(handle),
            lambda: "HSTUBwdSm90.execute: the stream is capturing a CUDA graph and this op "
                    f"has no workspace of {total_q} rows for it; pass workspace= (float32, "
                    f"shape workspace_shape({total_q}), zeroed) or execute once on this "
                    "stream with as many query tokens before capturing")
        return ws[:rows]

    def execute(self, do, q, k, v, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, func_tensor=None,
                stream=None, *, alpha: Optional[float] = None,
                scaling_seqlen: Optional[float] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_k: Optional[int] = None, workspace: Optional[torch.Tensor] = None):
        """Overwrites dq, dk, dv (every row of every sequence; all of them when T_q or T_k is
        0). Never reads device memory; allocates nothing when ``workspace`` is given or not
        needed (see workspace_shape; else the op keeps one per device and stream).

        alpha, scaling_seqlen and max_seqlen_q/k default to the constructor's; an omitted
        scaling_seqlen (there and here) means max_seqlen_q of this call.
        """
        if not self._checked:
            self.check_support()
        named = dict(do=do, q=q, k=k, v=v, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, func_tensor=func_tensor)
        def validate():
            result = self._validate(do, q, k, v, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    func_tensor)
            if workspace is not None and self.fused:
                check_tensor("workspace", workspace, dtypes=(torch.float32,),
                             shape=self.workspace_shape(result[0]), align=DATA_ALIGN,
                             contiguous=True, max_span=TMA_SPAN_LIMIT)
            self._check_relations(dict(named, workspace=workspace if self.fused else None))
            return result

        t_q, t_k, entries = self._validated(tuple(named.values()) + (workspace,), validate)
        max_q, max_k = self._seqlens(self.max_seqlen_q if max_seqlen_q is None else max_seqlen_q,
                                     self.max_seqlen_k if max_seqlen_k is None else max_seqlen_k,
                                     t_q, t_k, entries)
        half_alpha, scale_ds, scale_p = self._kernel_scalars(alpha, scaling_seqlen, max_q)
        index = q.device.index
        kernels = self._ready(index)
        if entries == 1:  # no sequence: nothing to write
            return
        handle = stream_handle(stream, index)
        if t_q == 0 or t_k == 0:
            # No query or no key token: every gradient is zero (and TMA cannot describe an
            # empty tensor). A memset on the stream, capturable like the kernels.
            with torch.cuda.stream(torch_stream(handle, index)):
                for grad in (dq, dk, dv):
                    grad.zero_()
            return
        left, right = min(self.window[0], WINDOW_CAP), min(self.window[1], WINDOW_CAP)
        batch = entries - 1
        launches = {"dq": (dq, None, max_q), "dkdv": (dk, dv, max_k), "dk": (dk, None, max_k),
                    "dv": (None, dv, max_k), "fused": (dk, dv, max_k)}
        dq_acc = sync = None
        max_groups = 1 << 31  # no bound: only the fused kernel keeps sync words
        if self.fused:
            ws = workspace if workspace is not None else self._own_workspace(index, handle,
                                                                             t_q)
            dq_acc = ws[:t_q]
            sync = ws[t_q:].view(torch.int32).reshape(-1)
            max_groups = sync_group_capacity(sync.shape[0])
        with device_guard(index):
            for mode in self.kernel_modes():
                if mode == "dq_finish":
                    continue
                grad_a, grad_b, longest = launches[mode]
                keys_fixed = mode != "dq"
                plan = Launch.plan(self.head_dim,
                                   self.num_kv_heads if keys_fixed else self.num_heads,
                                   t_k if keys_fixed else t_q, batch, longest, max_groups)
                convert = mode == "fused" and converts_in_kernel(plan, (left, right),
                                                                self.head_dim)
                kernels[mode](q, k, v, do, grad_a, grad_b, dq_acc,
                              dq if mode == "fused" else None, sync, cu_seqlens_q,
                              cu_seqlens_k, func_tensor, longest, plan.compact, int(convert),
                              plan.pair_group, max_q, left, right, half_alpha, scale_ds,
                              scale_p, handle)
                if mode != "fused":
                    continue
                if not convert:
                    # Convert the accumulator into dq and leave it zero for the next launch
                    # (two stream-ordered passes, no allocation).
                    with torch.cuda.stream(torch_stream(handle, index)):
                        dq.copy_(dq_acc)
                        dq_acc.zero_()
                else:  # what the kernel's idle warps did not convert
                    kernels["dq_finish"](dq_acc, dq, sync, cu_seqlens_q, plan.pair_group,
                                         max_q, handle)
