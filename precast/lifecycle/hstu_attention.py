"""HSTU attention forward for SM90: HSTUFwdSm90.

Packed (THD) ragged batches: q, o (T_q, H, D); k, v (T_k, H_kv, D) or a paged KV cache;
cu_seqlens_q / cu_seqlens_k (B + 1,) int32. Semantics: precast/reference/hstu_attention.py.
The values inside device metadata (cu_seqlens, func_tensor, page tables) are trusted and
never read on the host: every rule here reads shapes, strides, dtypes and addresses only.
"""
from __future__ import annotations

from typing import Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from ..reference.hstu_attention import FUNC_PAD_COLUMNS, PAGE_SIZE
from ..reference.hstu_attention import _check_window as check_window
from .cache import KernelBuilder
from .launch import (SCHEDULER_COUNTER_SHAPE, device_guard, own_scheduler_counter, sm_count,
                     stream_handle)
from .op import Op
from .tensor_desc import TensorDesc, dtype_name, parse_dtype
from .validation import (FLOAT32_MAX, INT32_MAX, check_bool, check_finite, check_int,
                         check_no_overlap, check_same_device, check_tensor, check_value)

ATTENTION_DTYPES = (torch.bfloat16, torch.float16)
HEAD_DIMS = (32, 64, 128, 256)
ROW_MULTIPLE = 8  # token and head strides in elements: 16-byte rows of a 16-bit dtype
DATA_ALIGN, INDEX_ALIGN = 16, 4  # base alignment (bytes) of q/k/v/o/paged_kv, of int32 tensors
TMA_SPAN_LIMIT = 2**39  # elements: TMA takes global strides below 2^40 bytes
QUERY_TILE_ROWS = 128  # query rows of a kernel work tile
# K/V of the sequences a dense causal batch schedules together, to stay in L2 (H200, run 29d:
# 32 MB beat 12, 24 and 48 at 4k-8k and D = 256; 48 lost 16 % at 1k).
KV_GROUP_BYTES = 32 << 20
# The persistent kernel numbers its work tiles (heads x query tiles x sequences) in int32.
MAX_WORK_TILES = INT32_MAX
# Batches of 2 .. ORDER_MAX_SEQUENCES sequences (kernels.sequence_order_sm90's limit: one CTA
# ranks them) may run longest sequence first.
ORDER_MAX_SEQUENCES = 1024
# Scheduler workspace: the persistent kernel's claim counter, then room for the order.
WORKSPACE_SHAPE = (SCHEDULER_COUNTER_SHAPE[0] + ORDER_MAX_SEQUENCES,)
# Windows wider than any sequence act as unbounded on that side; capping them keeps the
# kernel's int32 bound arithmetic (row + offset + window) from overflowing.
WINDOW_CAP = 2**30
KV_REQUIRED = "k and v are required (or paged_kv, page_ids and page_indptrs for paged KV)"
# Everything the compiled code depends on besides this module (fingerprinted into the cache
# key); extend it when the kernel imports more of precast.kernels.
KERNEL_SOURCES = ("precast.kernels.hstu_attention_fwd_sm90", "precast.kernels.attention_sm90",
                  "precast.kernels.scheduler", "precast.kernels.sequence_order_sm90",
                  "precast.kernels.tiling", "precast.kernels.fake")


def _stride(t) -> Tuple[int, ...]:
    return tuple(t.stride()) if isinstance(t, torch.Tensor) else t.stride


def check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise NotImplementedError(f"q: head dim D = {head_dim} is not supported; expected one of "
                                  f"{', '.join(map(str, HEAD_DIMS))}")


def check_tokens(name: str, t, dtypes, heads: Optional[int], head_dim: Optional[int],
                 device: str = "cuda") -> Tuple[int, int, int]:
    """q, k, v, o: (T, heads, head_dim) with the last dimension contiguous, token and head
    strides multiples of 8 elements, a 16-byte aligned base and no aliased elements."""
    shape = check_tensor(name, t, dtypes=dtypes, shape=(None, heads, head_dim),
                         row_multiple=ROW_MULTIPLE, align=DATA_ALIGN, device=device,
                         max_span=TMA_SPAN_LIMIT)
    tokens, h, d = shape
    check_value(tokens <= INT32_MAX, ValueError,
                f"{name}: {tokens} tokens exceed 2^31 - 1, the range of the int32 cu_seqlens")
    # Head offsets are 32-bit in the compiled code (token offsets are 64-bit).
    head_stride = _stride(t)[1]
    last_head = (h - 1) * head_stride + d if h > 1 else 0
    check_value(last_head <= INT32_MAX, ValueError,
                f"{name}: the head stride {head_stride} puts the last head {last_head} elements "
                "from the first; at most 2^31 - 1 are supported")
    return shape


def check_packed(name: str, t, dtypes, shape, align: int, device: str = "cuda",
                 max_span: int = INT32_MAX) -> Tuple[int, ...]:
    """cu_seqlens, func_tensor, page tables and paged_kv: contiguous and aligned."""
    return check_tensor(name, t, dtypes=dtypes, shape=shape, align=align, contiguous=True,
                        device=device, max_span=max_span)


def check_offsets(name: str, t) -> int:
    """cu_seqlens and page_indptrs: int32 (B + 1,). Returns B + 1."""
    return check_packed(name, t, (torch.int32,), (None,), INDEX_ALIGN)[0]


def dense_seq_group(t_q: int, batch: int, max_seqlen_q: int, max_seqlen_k: int,
                    kv_heads: int, head_dim: int, elem_bytes: int, right_bounded: bool) -> int:
    """The kernel's tile order: 0 (sequence by sequence) unless every sequence has
    max_seqlen_q queries, which the token count shows (no length exceeds max_seqlen_q), and
    a right-bounded window (causal) makes a sequence's last tiles the heaviest; then the
    number of sequences whose K/V (about KV_GROUP_BYTES) run together, heaviest tiles
    first, so the batch's longest tiles never start last. (Under other windows the tiles
    weigh the same and the larger working set only costs L2 hits: full mask -5 % at 4k.)"""
    if (not right_bounded or batch < 2 or max_seqlen_q <= 0
            or t_q != batch * max_seqlen_q):
        return 0
    kv_bytes = 2 * max_seqlen_k * kv_heads * head_dim * elem_bytes  # > 0: max_k >= max_q
    return min(max(KV_GROUP_BYTES // kv_bytes, 1), batch)


def longest_first(batch: int, max_seqlen_q: int, seq_group: int) -> bool:
    """Whether a call first orders its sequences longest first on the device (one small
    kernel): batches not run in the dense order whose sequences can span several query
    tiles, so lengths, and with them the sequences' work, can differ (the bench's
    heavy-tailed batch: +4-5 % over any batch order, run 31c). Decoding batches (every
    sequence within one query tile) keep their order and save the launch."""
    return (seq_group == 0 and 2 <= batch <= ORDER_MAX_SEQUENCES
            and max_seqlen_q > QUERY_TILE_ROWS)


def default_scaling_seqlen(max_seqlen_q: int) -> float:
    # As the reference: max_seqlen_q == 0 means T_q == 0, so any positive value will do.
    return float(max_seqlen_q) if max_seqlen_q > 0 else 1.0


def kernel_scalars(alpha, scaling_seqlen) -> Tuple[float, float]:
    """(alpha / 2, 1 / scaling_seqlen): the kernel's float32 scalars, runtime values.

    The kernel evaluates SiLU(alpha s) as h + h tanh(h) with h = alpha s / 2.
    """
    a = check_finite("alpha", alpha)
    s = check_finite("scaling_seqlen", scaling_seqlen, positive=True)
    check_value(abs(a) / 2 <= FLOAT32_MAX, ValueError,
                f"alpha = {alpha}: alpha / 2 overflows float32")
    check_value(1.0 / s <= FLOAT32_MAX, ValueError,
                f"scaling_seqlen = {scaling_seqlen} is too small: 1 / scaling_seqlen overflows "
                "float32")
    return a / 2, 1.0 / s


class ConfigBatch(NamedTuple):
    dtype: torch.dtype
    window: Tuple[int, int]
    seqlen: int
    tokens: int
    cu_seqlens: TensorDesc
    q: TensorDesc
    kv: TensorDesc
    func: Optional[TensorDesc]


class _AttentionRules:
    """Static configuration and rules shared by the HSTU attention forward and backward ops
    (they read q, k, func, paged_kv, window_size, alpha, scaling_seqlen off the op)."""

    # --- the static configuration, read off the samples -----------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.q.dtype

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1] if self.q.ndim else 0

    @property
    def num_heads(self) -> int:
        return self.q.shape[1] if self.q.ndim == 3 else 0

    @property
    def paged(self) -> bool:
        return self.paged_kv is not None

    @property
    def num_kv_heads(self) -> int:
        kv = self.paged_kv if self.paged else self.k  # (T_k, H_kv, D) or (pages, 2, 128, H_kv, D)
        return kv.shape[-2] if kv is not None and kv.ndim >= 2 else 0

    @property
    def func_intervals(self) -> int:
        return self.func.shape[1] if self.func is not None and self.func.ndim >= 2 else 0

    @property
    def window(self) -> Tuple[int, int]:
        return check_window(self.window_size)

    def _attention_config(self) -> Dict[str, object]:
        """The static configuration both directions share."""
        left, right = self.window
        return {"dtype": dtype_name(self.dtype), "head_dim": self.head_dim,
                "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
                "window_left_bounded": left >= 0, "window_right_bounded": right >= 0,
                "func_intervals": self.func_intervals}

    @staticmethod
    def _config_batch(dtype, head_dim, num_heads, num_kv_heads, window_left_bounded,
                      window_right_bounded, func_intervals) -> "ConfigBatch":
        """Descriptors of a small batch with a static configuration (for from_config)."""
        dt = parse_dtype(dtype)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        window = (64 if check_bool("window_left_bounded", window_left_bounded) else -1,
                  0 if check_bool("window_right_bounded", window_right_bounded) else -1)
        n = check_int("func_intervals", func_intervals, lo=0)
        batch, seqlen = 8, 128
        tokens = batch * seqlen
        return ConfigBatch(
            dt, window, seqlen, tokens, TensorDesc(torch.int32, (batch + 1,)),
            TensorDesc(dt, (tokens, num_heads, head_dim)),
            TensorDesc(dt, (tokens, num_kv_heads, head_dim)),
            TensorDesc(torch.int32, (1, n, tokens + FUNC_PAD_COLUMNS)) if n else None)

    def _check_static(self) -> None:
        """dtype, ranks and the static extents the other rules compare against."""
        check_tokens("q", self.q, ATTENTION_DTYPES, None, None)
        check_head_dim(self.head_dim)
        check_value(self.num_heads >= 1, ValueError,
                    f"q: needs at least one head, got shape {list(self.q.shape)}")
        if self.paged:
            name = "paged_kv"
            self._check_paged_kv(self.paged_kv, None)
        else:
            name = "k"
            check_value(self.k is not None and self.v is not None, ValueError, KV_REQUIRED)
            check_tokens(name, self.k, (self.dtype,), None, self.head_dim)
        h, h_kv = self.num_heads, self.num_kv_heads
        check_value(h_kv >= 1 and h % h_kv == 0, ValueError,
                    f"{name}: H_kv = {h_kv} key/value heads must be >= 1 and divide the H = {h} "
                    "query heads")
        if self.func is not None:
            self._check_func(self.func, None)
            n = self.func_intervals
            check_value(n >= 1 and n % 2 == 1, ValueError,
                        f"func_tensor: n = {n} rows; expected a positive odd n (F0, then "
                        "[F1, F2), [F3, F4), ...)")

    def _check_masks(self) -> None:
        left, right = self.window
        for side, w in (("left", left), ("right", right)):
            check_value(w <= INT32_MAX, ValueError,
                        f"window_size {side} = {w} must be <= 2^31 - 1 (-1 = unbounded)")
        if self.func is not None:
            check_value(not self.paged, ValueError,
                        "func_tensor (arbitrary mask) cannot be combined with paged KV")
            check_value((left, right) == (-1, -1), ValueError,
                        "func_tensor (arbitrary mask) cannot be combined with a window mask: "
                        f"window_size must be (-1, -1), got {(left, right)}")
        if self.paged:
            check_value((left, right) == (-1, 0), NotImplementedError,
                        "paged KV supports only the causal mask window_size=(-1, 0), got "
                        f"{(left, right)}")

    @staticmethod
    def _check_func(func_tensor, intervals: Optional[int]) -> Tuple[int, int, int]:
        return check_packed("func_tensor", func_tensor, (torch.int32,), (1, intervals, None),
                            INDEX_ALIGN)

    def _check_func_argument(self, func_tensor, t_q: int) -> None:
        """func_tensor is given exactly when the op applies an arbitrary mask, with at least
        T_q + FUNC_PAD_COLUMNS columns."""
        n = self.func_intervals
        if n:
            check_value(func_tensor is not None, ValueError,
                        f"func_tensor (1, {n}, L) is required: this op applies an arbitrary mask")
            columns = self._check_func(func_tensor, n)[2]
            check_value(columns >= t_q + FUNC_PAD_COLUMNS, ValueError,
                        f"func_tensor: L = {columns} columns; at least T_q + {FUNC_PAD_COLUMNS} = "
                        f"{t_q + FUNC_PAD_COLUMNS} are required")
        else:
            check_value(func_tensor is None, ValueError,
                        "func_tensor must be None: this op applies no arbitrary mask")

    @staticmethod
    def _same_tokens(name: str, tokens: int, other: str, other_tokens: int) -> None:
        check_value(tokens == other_tokens, ValueError,
                    f"{name}: has {tokens} tokens but {other} has {other_tokens}")

    @staticmethod
    def _same_entries(name: str, entries: int, expected: int) -> None:
        check_value(entries == expected, ValueError,
                    f"{name}: has {entries} entries but cu_seqlens_q has {expected}; both hold "
                    "B + 1 offsets")

    def _seqlens(self, max_seqlen_q, max_seqlen_k, t_q: int, t_k: Optional[int],
                 entries: int) -> Tuple[int, int]:
        """max_seqlen_q and max_seqlen_k against each other and the token counts."""
        max_q = check_int("max_seqlen_q", max_seqlen_q, lo=0, hi=INT32_MAX)
        max_k = check_int("max_seqlen_k", max_seqlen_k, lo=0, hi=INT32_MAX)
        tiles, formula = self._work_tiles(max_q, max_k, entries - 1)
        check_value(tiles <= MAX_WORK_TILES, ValueError,
                    f"{formula} = {tiles} work tiles exceed 2^31 - 1")
        check_value(max_q <= max_k, ValueError,
                    f"max_seqlen_q = {max_q} must be <= max_seqlen_k = {max_k}")
        # B sequences of at most max_seqlen tokens hold T tokens only if max_seqlen * B >= T.
        batch = entries - 1
        for name, longest, tokens in (("q", max_q, t_q), ("k", max_k, t_k)):
            check_value(batch == 0 or tokens is None or longest * batch >= tokens, ValueError,
                        f"max_seqlen_{name} = {longest} is too small: {batch} sequences hold "
                        f"T_{name} = {tokens} tokens")
        return max_q, max_k

    def _scalars(self, alpha, scaling_seqlen, max_seqlen_q: int) -> Tuple[float, float]:
        if scaling_seqlen is None:
            scaling_seqlen = (self.scaling_seqlen if self.scaling_seqlen is not None
                              else default_scaling_seqlen(max_seqlen_q))
        return kernel_scalars(self.alpha if alpha is None else alpha, scaling_seqlen)


class HSTUFwdSm90(_AttentionRules, Op):
    """o = (mask * SiLU(alpha q k^T)) v / scaling_seqlen per sequence and head (no softmax).

    Construct from sample tensors or TensorDescs, then check_support(), compile(),
    execute(). Compiled for (dtype, head_dim, num_heads, num_kv_heads, which window sides
    are bounded, func_intervals, paged): token counts, batch size, max_seqlen, window
    values, alpha and scaling_seqlen are runtime values. ``window_size`` is fixed per
    instance (another instance of the same static configuration reuses the kernel).
    """

    supported_archs = ("sm_90a",)
    kernel_sources = KERNEL_SOURCES

    def __init__(self, sample_q, sample_k, sample_v, sample_o, sample_cu_seqlens_q,
                 sample_cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                 window_size=(-1, -1), alpha: float = 1.0,
                 scaling_seqlen: Optional[float] = None, sample_func=None, sample_paged_kv=None,
                 sample_page_ids=None, sample_page_indptrs=None):
        super().__init__()
        desc = TensorDesc.optional
        self.q, self.k, self.v = desc(sample_q), desc(sample_k), desc(sample_v)
        self.cu_seqlens_q = desc(sample_cu_seqlens_q)
        self.cu_seqlens_k = desc(sample_cu_seqlens_k)
        self.func, self.paged_kv = desc(sample_func), desc(sample_paged_kv)
        self.page_ids, self.page_indptrs = desc(sample_page_ids), desc(sample_page_indptrs)
        self.o = desc(sample_o) or TensorDesc(self.q.dtype, self.q.shape)
        self.max_seqlen_q, self.max_seqlen_k = max_seqlen_q, max_seqlen_k
        self.window_size = window_size
        self.alpha, self.scaling_seqlen = alpha, scaling_seqlen
        # Scheduler workspaces this op made, per (device, stream): see _own_workspace.
        self._workspaces: Dict[Tuple[int, int], torch.Tensor] = {}
        self._samples = dict(q=sample_q, k=sample_k, v=sample_v, o=sample_o,
                             cu_seqlens_q=sample_cu_seqlens_q, cu_seqlens_k=sample_cu_seqlens_k,
                             func_tensor=sample_func, paged_kv=sample_paged_kv,
                             page_ids=sample_page_ids, page_indptrs=sample_page_indptrs)

    def static_config(self) -> Dict[str, object]:
        return dict(self._attention_config(), paged=self.paged)

    @classmethod
    def from_config(cls, dtype="bfloat16", head_dim=128, num_heads=4, num_kv_heads=None,
                    window_left_bounded=False, window_right_bounded=True, func_intervals=0,
                    paged=False):
        """Descriptors of a small batch with this static configuration (for precompile)."""
        b = cls._config_batch(dtype, head_dim, num_heads, num_kv_heads, window_left_bounded,
                              window_right_bounded, func_intervals)
        if check_bool("paged", paged):
            pages = b.tokens // PAGE_SIZE
            paged_kv = TensorDesc(b.dtype, (pages, 2, PAGE_SIZE) + b.kv.shape[1:])
            return cls(b.q, None, None, None, b.cu_seqlens, b.cu_seqlens, b.seqlen, b.seqlen,
                       b.window, sample_func=b.func, sample_paged_kv=paged_kv,
                       sample_page_ids=TensorDesc(torch.int32, (pages,)),
                       sample_page_indptrs=b.cu_seqlens)
        return cls(b.q, b.kv, b.kv, None, b.cu_seqlens, b.cu_seqlens, b.seqlen, b.seqlen,
                   b.window, sample_func=b.func)

    # --- rules ------------------------------------------------------------------------------
    def _check(self) -> None:
        self._check_static()
        self._check_masks()
        t_q, t_k, entries = self._validate(self.q, self.k, self.v, self.o, self.cu_seqlens_q,
                                           self.cu_seqlens_k, self.func, self.paged_kv,
                                           self.page_ids, self.page_indptrs)
        max_q, _ = self._seqlens(self.max_seqlen_q, self.max_seqlen_k, t_q, t_k, entries)
        self._scalars(self.alpha, self.scaling_seqlen, max_q)
        self._check_relations(self._samples)

    def _validate(self, q, k, v, o, cu_seqlens_q, cu_seqlens_k, func_tensor, paged_kv, page_ids,
                  page_indptrs) -> Tuple[int, Optional[int], int]:
        """Every per-tensor rule against the static configuration; shared by check_support()
        and execute(). Returns (T_q, T_k or None when paged, B + 1)."""
        h, h_kv, d, dt = self.num_heads, self.num_kv_heads, self.head_dim, (self.dtype,)
        t_q = check_tokens("q", q, dt, h, d)[0]
        self._same_tokens("o", check_tokens("o", o, dt, h, d)[0], "q", t_q)
        entries = check_offsets("cu_seqlens_q", cu_seqlens_q)
        check_value(entries >= 1, ValueError,
                    "cu_seqlens_q: needs B + 1 >= 1 entries (the offsets start at 0), got 0")
        self._same_entries("cu_seqlens_k", check_offsets("cu_seqlens_k", cu_seqlens_k), entries)
        if self.paged:
            check_value(k is None and v is None, ValueError,
                        "k and v must be None with paged KV: keys and values come from paged_kv")
            check_value(paged_kv is not None and page_ids is not None
                        and page_indptrs is not None, ValueError,
                        "paged KV needs paged_kv, page_ids and page_indptrs")
            self._check_paged_kv(paged_kv, h_kv)
            check_packed("page_ids", page_ids, (torch.int32,), (None,), INDEX_ALIGN)
            self._same_entries("page_indptrs", check_offsets("page_indptrs", page_indptrs),
                               entries)
            t_k = None
        else:
            check_value(paged_kv is None and page_ids is None and page_indptrs is None,
                        ValueError, "paged_kv, page_ids and page_indptrs must be None: this op "
                        "is not for paged KV")
            check_value(k is not None and v is not None, ValueError, KV_REQUIRED)
            t_k = check_tokens("k", k, dt, h_kv, d)[0]
            self._same_tokens("v", check_tokens("v", v, dt, h_kv, d)[0], "k", t_k)
        self._check_func_argument(func_tensor, t_q)
        return t_q, t_k, entries

    def _check_paged_kv(self, paged_kv, kv_heads: Optional[int]) -> None:
        # TMA reads the pages: 64-bit addresses, 32-bit page coordinates.
        check_packed("paged_kv", paged_kv, (self.dtype,),
                     (None, 2, PAGE_SIZE, kv_heads, self.head_dim), DATA_ALIGN,
                     max_span=TMA_SPAN_LIMIT)

    def _work_tiles(self, max_q: int, max_k: int, batch: int) -> Tuple[int, str]:
        # The persistent kernel numbers its work tiles in int32.
        return (self.num_heads * -(-max_q // QUERY_TILE_ROWS) * batch,
                f"max_seqlen_q = {max_q}: H x ceil(max_seqlen_q / {QUERY_TILE_ROWS}) x B")

    @staticmethod
    def _check_relations(named: Mapping[str, object]) -> None:
        """One device; o and the workspace alias nothing (host metadata only)."""
        check_same_device(list(named.items()))
        written = ("o", "workspace")
        check_no_overlap([(k, named.get(k)) for k in written],
                         [(k, t) for k, t in named.items() if k not in written])

    # --- compile ------------------------------------------------------------------------------
    def _kernel_builders(self) -> Mapping[str, KernelBuilder]:
        def build():
            import cutlass
            import cutlass.cute as cute
            from ..kernels.fake import (cute_dtype, fake_packed, fake_stream, fake_tokens,
                                        scalar)
            from ..kernels.hstu_attention_fwd_sm90 import HstuAttentionForwardSm90
            dt = cute_dtype(dtype_name(self.dtype))
            h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
            packed = fake_packed

            def tokens(count, heads):
                return fake_tokens(dt, count, heads, d)

            t_q, entries = cute.sym_int(), cute.sym_int()  # o has q's tokens; B + 1 offsets
            k = v = paged_kv = page_ids = page_indptrs = func = None
            if self.paged:
                paged_kv = packed(dt, (cute.sym_int(), 2, PAGE_SIZE, h_kv, d), DATA_ALIGN)
                page_ids = packed(cutlass.Int32, (cute.sym_int(),), INDEX_ALIGN)
                page_indptrs = packed(cutlass.Int32, (entries,), INDEX_ALIGN)
            else:
                t_k = cute.sym_int()
                k, v = tokens(t_k, h_kv), tokens(t_k, h_kv)
            if self.func_intervals:
                func = packed(cutlass.Int32, (1, self.func_intervals, cute.sym_int()),
                              INDEX_ALIGN)
            left, right = self.window
            kernel = HstuAttentionForwardSm90(dt, d, h, h_kv, left >= 0, right >= 0,
                                              self.func_intervals, self.paged)
            args = (tokens(t_q, h), k, v, tokens(t_q, h),
                    packed(cutlass.Int32, (entries,), INDEX_ALIGN),
                    packed(cutlass.Int32, (entries,), INDEX_ALIGN), func, paged_kv, page_ids,
                    page_indptrs, packed(cutlass.Int32, WORKSPACE_SHAPE, INDEX_ALIGN),
                    scalar(cutlass.Int32, 0), scalar(cutlass.Int32, -1),
                    scalar(cutlass.Int32, -1), scalar(cutlass.Float32, 0.5),
                    scalar(cutlass.Float32, 1.0), scalar(cutlass.Int32, 132),
                    scalar(cutlass.Int32, 0), scalar(cutlass.Int32, 0), fake_stream())
            return kernel, args

        def build_order():
            import cutlass
            import cutlass.cute as cute
            from ..kernels.fake import fake_packed, fake_stream
            from ..kernels.sequence_order_sm90 import SequenceOrderSm90
            entries = cute.sym_int()
            offsets = fake_packed(cutlass.Int32, (entries,), INDEX_ALIGN)
            return SequenceOrderSm90(), (
                offsets, fake_packed(cutlass.Int32, (entries,), INDEX_ALIGN),
                fake_packed(cutlass.Int32, WORKSPACE_SHAPE, INDEX_ALIGN), fake_stream())
        return {"fwd": build, "order": build_order}

    # --- run ----------------------------------------------------------------------------------
    @staticmethod
    def workspace_shape() -> Tuple[int, ...]:
        """Shape of the int32 scheduler workspace ``execute(workspace=...)`` takes: zero it
        once; every launch leaves its first words (the claim counter) zero, and a ragged
        batch's sequence order in the rest. Launches that may run concurrently (different
        streams) need different workspaces."""
        return WORKSPACE_SHAPE

    def _own_workspace(self, index: int, handle: int) -> torch.Tensor:
        """This op's workspace for (device, stream), made on the first execute there."""
        return own_scheduler_counter(self._workspaces, index, handle, "HSTUFwdSm90",
                                     WORKSPACE_SHAPE)

    def execute(self, q, k, v, o, cu_seqlens_q, cu_seqlens_k, func_tensor=None, paged_kv=None,
                page_ids=None, page_indptrs=None, stream=None, *, alpha: Optional[float] = None,
                scaling_seqlen: Optional[float] = None, max_seqlen_q: Optional[int] = None,
                max_seqlen_k: Optional[int] = None, workspace: Optional[torch.Tensor] = None):
        """Writes o. Never reads device memory; allocates nothing when ``workspace`` is given
        (else the op keeps one per device and stream, made on first use there).

        alpha, scaling_seqlen and max_seqlen_q/k default to the constructor's; an omitted
        scaling_seqlen (there and here) means max_seqlen_q of this call.
        """
        if not self._checked:
            self.check_support()
        named = dict(q=q, k=k, v=v, o=o, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                     func_tensor=func_tensor, paged_kv=paged_kv, page_ids=page_ids,
                     page_indptrs=page_indptrs)
        def validate():
            result = self._validate(**named)
            if workspace is not None:
                check_packed("workspace", workspace, (torch.int32,), WORKSPACE_SHAPE,
                             INDEX_ALIGN)
            self._check_relations(dict(named, workspace=workspace))
            return result

        t_q, t_k, entries = self._validated(tuple(named.values()) + (workspace,), validate)
        max_q, max_k = self._seqlens(self.max_seqlen_q if max_seqlen_q is None else max_seqlen_q,
                                     self.max_seqlen_k if max_seqlen_k is None else max_seqlen_k,
                                     t_q, t_k, entries)
        half_alpha, out_scale = self._scalars(alpha, scaling_seqlen, max_q)
        index = q.device.index
        kernels = self._ready(index)
        if t_q == 0 or entries == 1:  # no query token or no sequence: nothing to write
            return
        left, right = self.window
        handle = stream_handle(stream, index)
        if workspace is None:
            workspace = self._own_workspace(index, handle)
        seq_group = dense_seq_group(t_q, entries - 1, max_q, max_k, self.num_kv_heads,
                                    self.head_dim, q.element_size(), right >= 0)
        sort = longest_first(entries - 1, max_q, seq_group)
        with device_guard(index):
            if sort:
                kernels["order"](cu_seqlens_q, cu_seqlens_k, workspace, handle)
            kernels["fwd"](q, k, v, o, cu_seqlens_q, cu_seqlens_k, func_tensor, paged_kv,
                           page_ids, page_indptrs, workspace, max_q, min(left, WINDOW_CAP),
                           min(right, WINDOW_CAP), half_alpha, out_scale, sm_count(index),
                           seq_group, int(sort), handle)
