"""Every check_support() and execute() rule of HSTUFwdSm90, its static configuration and
cache key, the allocating function and the custom op's fake -- all on a CPU machine (ops are
built from TensorDescs, meta or CPU tensors; kernels are never built or loaded)."""
import math
import sys
import types

import pytest
import torch
from conftest import isolate_from_kernels, key_of

from precast import HSTUFwdSm90, TensorDesc, hstu_attention_forward
from precast.lifecycle.hstu_attention import (KV_GROUP_BYTES, ORDER_MAX_SEQUENCES,
                                              QUERY_TILE_ROWS, TMA_SPAN_LIMIT,
                                              WORKSPACE_SHAPE, dense_seq_group,
                                              kernel_scalars, longest_first)
from precast.lifecycle.launch import SCHEDULER_COUNTER_SHAPE
from precast.lifecycle.op import Op
from precast.lifecycle.validation import INT32_MAX
from precast.plan import expand
from precast.reference.hstu_attention import FUNC_PAD_COLUMNS, PAGE_SIZE

BF, FP, F32, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64
T, H, HKV, D, B = 64, 4, 2, 64, 4  # tokens (q and k), heads, kv heads, head dim, sequences
MAXS = T // B  # the smallest max_seqlen that B sequences of T tokens allow
PAGES = 8
L = T + FUNC_PAD_COLUMNS
# The module that keeps one compiled op per key for the allocating functions.
COMPILED_OPS = sys.modules["precast.op_cache"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing here may build or load kernels; the allocating function starts with no ops."""
    isolate_from_kernels(monkeypatch, tmp_path)


def desc(shape, dtype=BF, stride=None, alignment=16, device="cuda"):
    return TensorDesc(dtype, shape, stride, device, alignment)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


SAMPLES = ("q", "k", "v", "o", "cu_seqlens_q", "cu_seqlens_k", "func", "paged_kv", "page_ids",
           "page_indptrs")
BASE = dict(q=desc((T, H, D)), k=desc((T, HKV, D)), v=desc((T, HKV, D)), o=None,
            cu_seqlens_q=desc((B + 1,), I32), cu_seqlens_k=desc((B + 1,), I32),
            max_seqlen_q=MAXS, max_seqlen_k=MAXS)
PAGED = dict(k=None, v=None, paged_kv=desc((PAGES, 2, PAGE_SIZE, HKV, D)),
             page_ids=desc((PAGES,), I32), page_indptrs=desc((B + 1,), I32), window_size=(-1, 0))
FUNC = dict(func=desc((1, 3, L), I32), window_size=(-1, -1))


def attn(**kw):
    """The op from BASE with some arguments replaced (None included)."""
    args = {**BASE, **kw}
    return HSTUFwdSm90(**{("sample_" + k if k in SAMPLES else k): v for k, v in args.items()})


# --- valid configurations -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {}, dict(window_size=(-1, -1)), dict(window_size=(-1, 0)), dict(window_size=(16, 0)),
    dict(window_size=(0, 0)), dict(window_size=(-1, 5)), dict(window_size=[3, -1]),
    dict(alpha=-2.5, scaling_seqlen=1e-3), dict(scaling_seqlen=7), FUNC,
    dict(func=desc((1, 1, L + 100), I32), window_size=(-1, -1)), PAGED,
    dict(k=desc((T, 1, D)), v=desc((T, 1, D))),   # MQA
    dict(k=desc((T, H, D)), v=desc((T, H, D))),   # MHA
    dict(max_seqlen_q=0, max_seqlen_k=0, q=desc((0, H, D)), k=desc((0, HKV, D)),
         v=desc((0, HKV, D))),                    # empty batch
    dict(cu_seqlens_q=desc((1,), I32), cu_seqlens_k=desc((1,), I32)),  # B = 0
    # H x ceil(max_q / 128) x B = 2^31 - 1 work tiles at most: here 4 x 2^22 x 127 < 2^31
    dict(max_seqlen_q=QUERY_TILE_ROWS * 2**22, max_seqlen_k=INT32_MAX,
         cu_seqlens_q=desc((128,), I32), cu_seqlens_k=desc((128,), I32)),
    dict(cu_seqlens_q=desc((70000,), I32), cu_seqlens_k=desc((70000,), I32)),  # B > 65535
])
def test_valid_configurations(kw):
    op = attn(**kw).check_support()
    assert op._checked


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_supported_head_dims_and_dtypes(head_dim, dtype):
    attn(q=desc((T, H, head_dim), dtype), k=desc((T, HKV, head_dim), dtype),
         v=desc((T, HKV, head_dim), dtype)).check_support()


@pytest.mark.parametrize("q", [
    desc((T, H, D), stride=(H * D + 64, D + 8, 1)),   # padded tokens and heads
    desc((T, H, D), stride=(D, T * D, 1)),            # heads-major storage (a transposed view)
    desc((T, H, D), stride=(3 * H * D, D, 1)),        # q of a packed qkv projection
    desc((T, H, D), alignment=256),
    desc((1, H, D), stride=(3, D, 1)),                # one token: its stride is never used
    desc((T, H, D), device="cuda:0"),
    meta(T, H, D), meta(T, H, 2 * D)[:, :, D:],
])
def test_strided_views_are_accepted(q):
    attn(q=q, max_seqlen_q=max(1, q.shape[0] // B)).check_support()


def test_cpu_tensors_are_rejected():
    with pytest.raises(ValueError, match="q: tensor is on cpu; expected a cuda tensor"):
        attn(q=torch.zeros(T, H, D, dtype=BF)).check_support()
    with pytest.raises(ValueError, match="cu_seqlens_k: tensor is on cpu"):
        attn(cu_seqlens_k=torch.zeros(B + 1, dtype=I32)).check_support()
    with pytest.raises(ValueError, match="paged_kv: tensor is on cpu"):
        attn(**{**PAGED, "paged_kv": torch.zeros(PAGES, 2, PAGE_SIZE, HKV, D,
                                                  dtype=BF)}).check_support()
    with pytest.raises(ValueError, match="k: tensor is on cpu"):
        attn(k=desc((T, HKV, D), device="cpu")).check_support()


# --- every rule -----------------------------------------------------------------------------------
def _huge_pages():
    pages = TMA_SPAN_LIMIT // (2 * PAGE_SIZE * HKV * D) + 1
    return {**PAGED, "paged_kv": desc((pages, 2, PAGE_SIZE, HKV, D))}


RULES = [
    # (id, attn kwargs, exception, message fragment)
    # q: dtype, rank, head dim, heads
    ("q-dtype-fp32", dict(q=desc((T, H, D), F32)), TypeError,
     "q: dtype float32 is not supported; expected bfloat16 or float16"),
    ("q-dtype-int8", dict(q=desc((T, H, D), torch.int8)), TypeError, "q: dtype int8"),
    ("q-rank-2", dict(q=desc((T, H * D))), ValueError,
     r"q: expected a rank-3 tensor of shape \(\*, \*, \*\), got shape \[64, 256\]"),
    ("q-rank-4", dict(q=desc((1, T, H, D))), ValueError, "q: expected a rank-3"),
    ("D-96", dict(q=desc((T, H, 96))), NotImplementedError,
     "q: head dim D = 96 is not supported; expected one of 32, 64, 128, 256"),
    ("D-16", dict(q=desc((T, H, 16))), NotImplementedError, "head dim D = 16"),
    ("D-512", dict(q=desc((T, H, 512))), NotImplementedError, "head dim D = 512"),
    ("H-0", dict(q=desc((T, 0, D))), ValueError,
     r"q: needs at least one head, got shape \[64, 0, 64\]"),
    # k and v
    ("k-dtype", dict(k=desc((T, HKV, D), FP)), TypeError,
     "k: dtype float16 is not supported; expected bfloat16"),
    ("v-dtype", dict(v=desc((T, HKV, D), F32)), TypeError, "v: dtype float32"),
    ("k-rank", dict(k=desc((T, HKV * D))), ValueError, "k: expected a rank-3"),
    ("v-rank", dict(v=desc((T, HKV, D, 1))), ValueError, "v: expected a rank-3"),
    ("k-head-dim", dict(k=desc((T, HKV, 32))), ValueError,
     r"k: extent 32 on axis 2 does not match \(\*, \*, 64\)"),
    ("v-head-dim", dict(v=desc((T, HKV, 128))), ValueError, "v: extent 128 on axis 2"),
    ("kv-heads-not-dividing", dict(k=desc((T, 3, D)), v=desc((T, 3, D))), ValueError,
     "k: H_kv = 3 key/value heads must be >= 1 and divide the H = 4 query heads"),
    ("kv-heads-above-H", dict(k=desc((T, 8, D)), v=desc((T, 8, D))), ValueError, "H_kv = 8"),
    ("kv-heads-0", dict(k=desc((T, 0, D)), v=desc((T, 0, D))), ValueError, "k: H_kv = 0"),
    ("v-heads", dict(v=desc((T, 1, D))), ValueError,
     r"v: extent 1 on axis 1 does not match \(\*, 2, 64\)"),
    ("v-tokens", dict(v=desc((T - 1, HKV, D))), ValueError, "v: has 63 tokens but k has 64"),
    ("k-missing", dict(k=None), ValueError,
     r"k and v are required \(or paged_kv, page_ids and page_indptrs for paged KV\)"),
    ("v-missing", dict(v=None), ValueError, "k and v are required"),
    # o
    ("o-dtype", dict(o=desc((T, H, D), FP)), TypeError, "o: dtype float16"),
    ("o-tokens", dict(o=desc((T - 1, H, D))), ValueError, "o: has 63 tokens but q has 64"),
    ("o-heads", dict(o=desc((T, HKV, D))), ValueError,
     r"o: extent 2 on axis 1 does not match \(\*, 4, 64\)"),
    ("o-head-dim", dict(o=desc((T, H, 2 * D))), ValueError, "o: extent 128 on axis 2"),
    ("o-rank", dict(o=desc((T, H * D))), ValueError, "o: expected a rank-3"),
    # layouts of q, k, v, o
    ("q-last-stride", dict(q=desc((T, H, D), stride=(2 * H * D, 2 * D, 2))), ValueError,
     r"q: the last dimension must be contiguous \(stride 1\)"),
    ("o-last-stride", dict(o=desc((T, H, D), stride=(2 * H * D, 2 * D, 2))), ValueError,
     "o: the last dimension must be contiguous"),
    ("q-token-stride-multiple", dict(q=desc((T, H, D), stride=(H * D + 4, D, 1))), ValueError,
     "q: axis-0 stride 260 must be a multiple of 8 elements so that every row starts 16-byte"),
    ("k-head-stride-multiple", dict(k=desc((T, HKV, D), stride=(HKV * 68, 68, 1))), ValueError,
     "k: axis-1 stride 68 must be a multiple of 8"),
    ("v-token-stride-multiple", dict(v=desc((T, HKV, D), stride=(HKV * D + 2, D, 1))),
     ValueError, "v: axis-0 stride 130 must be a multiple of 8"),
    ("q-heads-overlap", dict(q=desc((T, H, D), stride=(H * D, D // 2, 1))), ValueError,
     r"q: axis-1 stride 32 is smaller than the 64 elements spanned by the faster axes "
     r"\(strides \[256, 32, 1\]\): elements would overlap"),
    ("q-tokens-overlap", dict(q=desc((T, H, D), stride=(D, D, 1))), ValueError,
     "q: axis-0 stride 64 is smaller than the 256 elements spanned by the faster axes"),
    ("o-broadcast", dict(o=desc((T, H, D), stride=(0, D, 1))), ValueError,
     "o: axis-0 stride 0 is smaller than the 1 elements"),
    ("q-alignment", dict(q=desc((T, H, D), alignment=8)), ValueError,
     "q: base address is 8-byte aligned; 16-byte alignment is required"),
    ("k-alignment", dict(k=desc((T, HKV, D), alignment=4)), ValueError,
     "k: base address is 4-byte"),
    ("v-alignment", dict(v=desc((T, HKV, D), alignment=2)), ValueError,
     "v: base address is 2-byte"),
    ("o-alignment", dict(o=desc((T, H, D), alignment=8)), ValueError, "o: base address is 8-byte"),
    ("q-head-offsets-32-bit", dict(q=desc((T, H, D), stride=(D, 2**30, 1))), ValueError,
     "q: the head stride 1073741824 puts the last head 3221225536 elements from the first; at "
     r"most 2\^31 - 1 are supported"),
    ("q-span", dict(q=desc((T, H, D), stride=(2**34, D, 1))), ValueError,
     rf"q: spans \d+ elements; at most {TMA_SPAN_LIMIT} are supported"),
    ("q-tokens-int32", dict(q=desc((2**31, 1, 32)), k=desc((T, 1, 32)), v=desc((T, 1, 32))),
     ValueError, r"q: 2147483648 tokens exceed 2\^31 - 1, the range of the int32 cu_seqlens"),
    # cu_seqlens
    ("cu_q-dtype", dict(cu_seqlens_q=desc((B + 1,), I64)), TypeError,
     "cu_seqlens_q: dtype int64 is not supported; expected int32"),
    ("cu_k-dtype", dict(cu_seqlens_k=desc((B + 1,), torch.uint8)), TypeError,
     "cu_seqlens_k: dtype uint8"),
    ("cu_q-rank", dict(cu_seqlens_q=desc((1, B + 1), I32)), ValueError,
     r"cu_seqlens_q: expected a rank-1 tensor of shape \(\*\)"),
    ("cu_q-empty", dict(cu_seqlens_q=desc((0,), I32), cu_seqlens_k=desc((0,), I32)), ValueError,
     r"cu_seqlens_q: needs B \+ 1 >= 1 entries"),
    ("cu_q-strided", dict(cu_seqlens_q=desc((B + 1,), I32, stride=(2,))), ValueError,
     "cu_seqlens_q: the last dimension must be contiguous"),
    ("cu_k-alignment", dict(cu_seqlens_k=desc((B + 1,), I32, alignment=2)), ValueError,
     "cu_seqlens_k: base address is 2-byte aligned; 4-byte alignment is required"),
    ("cu_k-length", dict(cu_seqlens_k=desc((B + 2,), I32)), ValueError,
     r"cu_seqlens_k: has 6 entries but cu_seqlens_q has 5; both hold B \+ 1 offsets"),
    # max_seqlen
    ("max_q-negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0, got -1"),
    ("max_k-negative", dict(max_seqlen_k=-5), ValueError, "max_seqlen_k must be >= 0"),
    ("max_q-float", dict(max_seqlen_q=16.0), TypeError, "max_seqlen_q must be an int, got float"),
    ("max_k-bool", dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
    ("max_q-none", dict(max_seqlen_q=None), TypeError, "max_seqlen_q must be an int, got NoneType"),
    ("max_q-above-max_k", dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max_q-int32", dict(max_seqlen_q=2**31, max_seqlen_k=2**31), ValueError,
     "max_seqlen_q must be <= 2147483647"),
    ("work-tiles-int32", dict(max_seqlen_q=QUERY_TILE_ROWS * 2**22, max_seqlen_k=INT32_MAX,
                              cu_seqlens_q=desc((129,), I32), cu_seqlens_k=desc((129,), I32)),
     ValueError, r"H x ceil\(max_seqlen_q / 128\) x B = 2147483648 work tiles exceed 2\^31 - 1"),
    ("max_k-int32", dict(max_seqlen_k=2**31), ValueError, "max_seqlen_k must be <= 2147483647"),
    ("max_q-too-small", dict(max_seqlen_q=MAXS - 1), ValueError,
     "max_seqlen_q = 15 is too small: 4 sequences hold T_q = 64 tokens"),
    ("max_k-too-small", dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D))), ValueError,
     "max_seqlen_k = 16 is too small: 4 sequences hold T_k = 128 tokens"),
    ("max_q-zero-with-tokens", dict(max_seqlen_q=0), ValueError, "max_seqlen_q = 0 is too small"),
    # alpha and scaling_seqlen
    ("alpha-nan", dict(alpha=math.nan), ValueError, "alpha must be finite, got nan"),
    ("alpha-inf", dict(alpha=-math.inf), ValueError, "alpha must be finite, got -inf"),
    ("alpha-str", dict(alpha="1"), TypeError, "alpha must be a real number, got str"),
    ("alpha-none", dict(alpha=None), TypeError, "alpha must be a real number, got NoneType"),
    ("alpha-float32-overflow", dict(alpha=1e39), ValueError,
     "alpha = 1e[+]?39: alpha / 2 overflows float32"),
    ("scaling-zero", dict(scaling_seqlen=0), ValueError, "scaling_seqlen must be positive, got 0"),
    ("scaling-negative", dict(scaling_seqlen=-16), ValueError, "scaling_seqlen must be positive"),
    ("scaling-nan", dict(scaling_seqlen=math.nan), ValueError, "scaling_seqlen must be finite"),
    ("scaling-inf", dict(scaling_seqlen=math.inf), ValueError, "scaling_seqlen must be finite"),
    ("scaling-str", dict(scaling_seqlen="16"), TypeError, "scaling_seqlen must be a real number"),
    ("scaling-float32-overflow", dict(scaling_seqlen=1e-39), ValueError,
     "scaling_seqlen = 1e-39 is too small: 1 / scaling_seqlen overflows float32"),
    # window
    ("window-below-minus-one", dict(window_size=(-2, 0)), ValueError,
     r"window_size left must be >= -1 \(-1 = unbounded\), got -2"),
    ("window-right-float", dict(window_size=(0, 1.5)), ValueError,
     "window_size right must be an int >= -1, got 1.5"),
    ("window-bool", dict(window_size=(True, 0)), ValueError, "window_size left must be an int"),
    ("window-not-a-pair", dict(window_size=(0,)), ValueError,
     r"window_size must be a pair \(left, right\), got \(0,\)"),
    ("window-int", dict(window_size=3), ValueError, "window_size must be a pair"),
    ("window-int32", dict(window_size=(2**31, 0)), ValueError,
     r"window_size left = 2147483648 must be <= 2\^31 - 1"),
    ("window-right-int32", dict(window_size=(-1, 2**31)), ValueError, "window_size right = "),
    # arbitrary masks
    ("func-with-causal", dict(func=FUNC["func"], window_size=(-1, 0)), ValueError,
     r"func_tensor \(arbitrary mask\) cannot be combined with a window mask: window_size must "
     r"be \(-1, -1\), got \(-1, 0\)"),
    ("func-with-local", dict(func=FUNC["func"], window_size=(4, 4)), ValueError,
     r"got \(4, 4\)"),
    ("func-with-paged", dict(**PAGED, func=FUNC["func"]), ValueError,
     "func_tensor \\(arbitrary mask\\) cannot be combined with paged KV"),
    ("func-dtype", dict(FUNC, func=desc((1, 3, L), I64)), TypeError,
     "func_tensor: dtype int64 is not supported; expected int32"),
    ("func-rank", dict(FUNC, func=desc((3, L), I32)), ValueError,
     r"func_tensor: expected a rank-3 tensor of shape \(1, \*, \*\)"),
    ("func-batch-axis", dict(FUNC, func=desc((2, 3, L), I32)), ValueError,
     r"func_tensor: extent 2 on axis 0 does not match \(1, \*, \*\)"),
    ("func-n-even", dict(FUNC, func=desc((1, 2, L), I32)), ValueError,
     r"func_tensor: n = 2 rows; expected a positive odd n \(F0, then \[F1, F2\)"),
    ("func-n-zero", dict(FUNC, func=desc((1, 0, L), I32)), ValueError, "func_tensor: n = 0 rows"),
    ("func-columns", dict(FUNC, func=desc((1, 3, L - 1), I32)), ValueError,
     rf"func_tensor: L = {L - 1} columns; at least T_q \+ 256 = {L} are required"),
    ("func-padded", dict(FUNC, func=desc((1, 3, L), I32, stride=(3 * (L + 8), L + 8, 1))),
     ValueError, r"func_tensor: must be contiguous \(strides \[960, 320, 1\]\)"),
    ("func-alignment", dict(FUNC, func=desc((1, 3, L), I32, alignment=2)), ValueError,
     "func_tensor: base address is 2-byte aligned; 4-byte"),
    ("func-span", dict(FUNC, func=desc((1, 3, 2**30), I32)), ValueError,
     rf"func_tensor: spans {3 * 2**30} elements; at most {INT32_MAX}"),
    # paged KV
    ("paged-full-mask", dict(PAGED, window_size=(-1, -1)), NotImplementedError,
     r"paged KV supports only the causal mask window_size=\(-1, 0\), got \(-1, -1\)"),
    ("paged-local-mask", dict(PAGED, window_size=(8, 0)), NotImplementedError, r"got \(8, 0\)"),
    ("paged-with-k", dict(PAGED, k=BASE["k"]), ValueError,
     "k and v must be None with paged KV: keys and values come from paged_kv"),
    ("paged-with-v", dict(PAGED, v=BASE["v"]), ValueError, "k and v must be None with paged KV"),
    ("paged-no-page-ids", dict(PAGED, page_ids=None), ValueError,
     "paged KV needs paged_kv, page_ids and page_indptrs"),
    ("paged-no-indptrs", dict(PAGED, page_indptrs=None), ValueError, "paged KV needs"),
    ("page-ids-without-paged-kv", dict(page_ids=PAGED["page_ids"]), ValueError,
     "paged_kv, page_ids and page_indptrs must be None: this op is not for paged KV"),
    ("page-indptrs-without-paged-kv", dict(page_indptrs=PAGED["page_indptrs"]), ValueError,
     "must be None: this op is not for paged KV"),
    ("paged_kv-dtype", dict(PAGED, paged_kv=desc((PAGES, 2, PAGE_SIZE, HKV, D), FP)), TypeError,
     "paged_kv: dtype float16 is not supported; expected bfloat16"),
    ("paged_kv-rank", dict(PAGED, paged_kv=desc((PAGES, 2 * PAGE_SIZE, HKV, D))), ValueError,
     r"paged_kv: expected a rank-5 tensor of shape \(\*, 2, 128, \*, 64\)"),
    ("paged_kv-page-size", dict(PAGED, paged_kv=desc((PAGES, 2, 64, HKV, D))), ValueError,
     r"paged_kv: extent 64 on axis 2 does not match \(\*, 2, 128, \*, 64\)"),
    ("paged_kv-kv-axis", dict(PAGED, paged_kv=desc((PAGES, 3, PAGE_SIZE, HKV, D))), ValueError,
     "paged_kv: extent 3 on axis 1"),
    ("paged_kv-head-dim", dict(PAGED, paged_kv=desc((PAGES, 2, PAGE_SIZE, HKV, 128))),
     ValueError, "paged_kv: extent 128 on axis 4"),
    ("paged_kv-heads", dict(PAGED, paged_kv=desc((PAGES, 2, PAGE_SIZE, 3, D))), ValueError,
     "paged_kv: H_kv = 3 key/value heads must be >= 1 and divide the H = 4 query heads"),
    ("paged_kv-padded", dict(PAGED, paged_kv=desc(
        (PAGES, 2, PAGE_SIZE, HKV, D), stride=(2 * PAGE_SIZE * HKV * D + 8, PAGE_SIZE * HKV * D,
                                               HKV * D, D, 1))), ValueError,
     "paged_kv: must be contiguous"),
    ("paged_kv-alignment", dict(PAGED, paged_kv=desc((PAGES, 2, PAGE_SIZE, HKV, D), alignment=8)),
     ValueError, "paged_kv: base address is 8-byte aligned; 16-byte"),
    ("paged_kv-span", _huge_pages(), ValueError,
     rf"paged_kv: spans \d+ elements; at most {TMA_SPAN_LIMIT}"),
    ("page_ids-dtype", dict(PAGED, page_ids=desc((PAGES,), I64)), TypeError,
     "page_ids: dtype int64 is not supported; expected int32"),
    ("page_ids-rank", dict(PAGED, page_ids=desc((1, PAGES), I32)), ValueError,
     "page_ids: expected a rank-1"),
    ("page_ids-strided", dict(PAGED, page_ids=desc((PAGES,), I32, stride=(2,))), ValueError,
     "page_ids: the last dimension must be contiguous"),
    ("page_indptrs-dtype", dict(PAGED, page_indptrs=desc((B + 1,), I64)), TypeError,
     "page_indptrs: dtype int64"),
    ("page_indptrs-length", dict(PAGED, page_indptrs=desc((B,), I32)), ValueError,
     r"page_indptrs: has 4 entries but cu_seqlens_q has 5; both hold B \+ 1 offsets"),
    ("page_indptrs-alignment", dict(PAGED, page_indptrs=desc((B + 1,), I32, alignment=1)),
     ValueError, "page_indptrs: base address is 1-byte"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(kw, exc, match):
    op = attn(**kw)
    with pytest.raises(exc, match=match):
        op.check_support()
    assert not op._checked


def test_compile_checks_first():
    op = attn(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.compile(arch="sm_90a")
    assert not op.is_compiled
    with pytest.raises(NotImplementedError, match="HSTUFwdSm90 has kernels for sm_90a, not sm_80"):
        attn().compile(arch="sm_80")


def test_relations_one_device_and_o_aliases_no_input():
    """check_support and execute share these; on a CPU machine only CPU/meta tensors exist,
    which the per-tensor rules reject first, so the relation rule is called directly."""
    buf = torch.zeros(3 * T, H, D, dtype=BF)
    q, o = buf[:T], buf[T:2 * T]
    named = dict(q=q, k=buf[2 * T:], v=buf[2 * T:], o=o, cu_seqlens_q=None)
    HSTUFwdSm90._check_relations(named)  # adjacent buffers, k and v alias each other: fine
    with pytest.raises(ValueError, match="o overlaps q in memory; outputs must not alias"):
        HSTUFwdSm90._check_relations({**named, "o": buf[T - 1:2 * T - 1]})
    with pytest.raises(ValueError, match="o overlaps k in memory"):
        HSTUFwdSm90._check_relations({**named, "o": buf[2 * T:]})
    with pytest.raises(ValueError, match="o overlaps func_tensor"):
        HSTUFwdSm90._check_relations({**named, "func_tensor": o.view(torch.int32)})
    with pytest.raises(ValueError, match="o is on meta but q is on cpu; all tensors must be on"):
        HSTUFwdSm90._check_relations({**named, "o": meta(T, H, D)})


# --- static configuration and cache key -----------------------------------------------------------
def test_static_config_reads_the_samples():
    assert attn().static_config() == {
        "dtype": "bfloat16", "head_dim": D, "num_heads": H, "num_kv_heads": HKV,
        "window_left_bounded": False, "window_right_bounded": False, "func_intervals": 0,
        "paged": False}
    cfg = attn(**PAGED).static_config()
    assert cfg["paged"] is True and cfg["num_kv_heads"] == HKV and cfg["window_right_bounded"]
    assert attn(**FUNC).static_config()["func_intervals"] == 3
    cfg = attn(window_size=(7, 0)).static_config()
    assert cfg["window_left_bounded"] is True and cfg["window_right_bounded"] is True


@pytest.mark.parametrize("config", [
    {}, dict(dtype="float16", head_dim=32), dict(head_dim=256, num_heads=8, num_kv_heads=1),
    dict(window_left_bounded=True), dict(window_left_bounded=True, window_right_bounded=False),
    dict(window_right_bounded=False, func_intervals=1),
    dict(window_right_bounded=False, func_intervals=5), dict(paged=True, num_kv_heads=2),
])
def test_from_config_round_trip(config):
    op = HSTUFwdSm90.from_config(**config).check_support()
    cfg = op.static_config()
    for key, value in config.items():
        assert cfg[key] == value
    assert HSTUFwdSm90.from_config(**cfg).static_config() == cfg
    # plan entries are spelled with the same names
    (entry,) = expand({"name": "HSTUFwdSm90", **cfg})
    assert dict(entry.config) == cfg


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_left_bounded=1), TypeError, "window_left_bounded must be a bool, got int"),
    (dict(window_right_bounded="yes"), TypeError, "window_right_bounded must be a bool, got str"),
    (dict(paged=None), TypeError, "paged must be a bool, got NoneType"),
    (dict(func_intervals=1.0), TypeError, "func_intervals must be an int, got float"),
    (dict(func_intervals=-1), ValueError, "func_intervals must be >= 0, got -1"),
    (dict(dtype="float8"), TypeError, "unknown dtype 'float8'"),
])
def test_from_config_types(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUFwdSm90.from_config(**config)


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_right_bounded=False, func_intervals=2), ValueError, "n = 2 rows"),
    (dict(func_intervals=3), ValueError, "cannot be combined with a window mask"),
    (dict(paged=True, window_right_bounded=False), NotImplementedError, "paged KV supports only"),
    (dict(paged=True, func_intervals=1, window_right_bounded=False), ValueError,
     "cannot be combined with paged KV"),
    (dict(num_heads=4, num_kv_heads=3), ValueError, "H_kv = 3"),
    (dict(head_dim=80), NotImplementedError, "head dim D = 80"),
])
def test_from_config_invalid_combinations(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUFwdSm90.from_config(**config).check_support()


STATIC_CHANGES = {
    "dtype": dict(q=desc((T, H, D), FP), k=desc((T, HKV, D), FP), v=desc((T, HKV, D), FP)),
    "head_dim": dict(q=desc((T, H, 128)), k=desc((T, HKV, 128)), v=desc((T, HKV, 128))),
    "num_heads": dict(q=desc((T, 2 * H, D))),
    "num_kv_heads": dict(k=desc((T, 1, D)), v=desc((T, 1, D))),
    "window_left_bounded": dict(window_size=(8, -1)),
    "window_right_bounded": dict(window_size=(-1, 0)),
    "func_intervals": FUNC,
    "paged": dict(PAGED, window_size=(-1, -1)),
}


@pytest.mark.parametrize("field", sorted(STATIC_CHANGES))
def test_cache_key_changes_with_each_static_field(fixed_sources, field):
    base = attn()
    changed = attn(**STATIC_CHANGES[field])
    if field == "paged":  # paged KV is causal: compare with the causal op
        base, changed = attn(window_size=(-1, 0)), attn(**PAGED)
    assert key_of(changed) != key_of(base)
    diff = {k for k, v in changed.static_config().items() if base.static_config()[k] != v}
    assert diff == {field}


@pytest.mark.parametrize("kw", [
    dict(alpha=0.125), dict(scaling_seqlen=1000.0), dict(max_seqlen_q=32, max_seqlen_k=64),
    dict(q=desc((4 * T, H, D)), max_seqlen_q=64, max_seqlen_k=64, o=desc((4 * T, H, D))),
    dict(cu_seqlens_q=desc((2,), I32), cu_seqlens_k=desc((2,), I32), max_seqlen_q=T,
         max_seqlen_k=T),
    dict(q=desc((T, H, D), stride=(2 * H * D, D + 8, 1)),
         k=desc((T, HKV, D), stride=(D, T * D, 1))),
    dict(q=desc((T, H, D), alignment=256)),
])
def test_cache_key_ignores_runtime_values(fixed_sources, kw):
    assert key_of(attn(**kw)) == key_of(attn())


@pytest.mark.parametrize("windows", [[(-1, -1)], [(-1, 0), (-1, 7), (-1, 2**31 - 1)],
                                     [(0, 0), (5, 3), (100, 0)], [(3, -1), (0, -1)]])
def test_cache_key_ignores_window_values(fixed_sources, windows):
    keys = {key_of(attn(window_size=w)) for w in windows}
    assert len(keys) == 1


def test_func_intervals_are_static(fixed_sources):
    one = attn(func=desc((1, 1, L), I32), window_size=(-1, -1))
    three = attn(**FUNC)
    longer = attn(func=desc((1, 3, 2 * L), I32), window_size=(-1, -1))
    assert key_of(one) != key_of(three) == key_of(longer)


# --- execute --------------------------------------------------------------------------------------
def meta_args(t_q=T, t_k=T, batch=B, heads=H, kv_heads=HKV, head_dim=D, dtype=BF):
    return dict(q=meta(t_q, heads, head_dim, dtype=dtype),
                k=meta(t_k, kv_heads, head_dim, dtype=dtype),
                v=meta(t_k, kv_heads, head_dim, dtype=dtype),
                o=meta(t_q, heads, head_dim, dtype=dtype),
                cu_seqlens_q=meta(batch + 1, dtype=I32), cu_seqlens_k=meta(batch + 1, dtype=I32))


def paged_meta_args(t_q=T, batch=B):
    args = meta_args(t_q=t_q, batch=batch)
    args.update(k=None, v=None, paged_kv=meta(PAGES, 2, PAGE_SIZE, HKV, D),
                page_ids=meta(PAGES, dtype=I32), page_indptrs=meta(batch + 1, dtype=I32))
    return args


EXECUTE_RULES = [
    # (id, attn kwargs, changes to meta_args() (paged_meta_args() for paged ops), exception, match)
    ("heads", {}, dict(q=meta(T, 2 * H, D), o=meta(T, 2 * H, D)), ValueError,
     r"q: extent 8 on axis 1 does not match \(\*, 4, 64\)"),
    ("head-dim", {}, dict(q=meta(T, H, 128)), ValueError, "q: extent 128 on axis 2"),
    ("dtype", {}, dict(q=meta(T, H, D, dtype=FP)), TypeError,
     "q: dtype float16 is not supported; expected bfloat16"),
    ("kv-heads", {}, dict(k=meta(T, H, D), v=meta(T, H, D)), ValueError,
     r"k: extent 4 on axis 1 does not match \(\*, 2, 64\)"),
    ("o-tokens", {}, dict(o=meta(T + 8, H, D)), ValueError, "o: has 72 tokens but q has 64"),
    ("o-missing", {}, dict(o=None), TypeError,
     "expected a torch.Tensor or TensorDesc, got NoneType"),
    ("q-last-dim-strided", {}, dict(q=meta(T, H, 2 * D)[:, :, ::2]), ValueError,
     "q: the last dimension must be contiguous"),
    ("q-misaligned", {}, dict(q=desc((T, H, D), alignment=8)), ValueError,
     "q: base address is 8-byte aligned"),
    ("v-head-stride", {}, dict(v=meta(T, HKV, D + 4)[:, :, :D]), ValueError,
     "v: axis-1 stride 68 must be a multiple of 8"),
    ("cu-lengths", {}, dict(cu_seqlens_k=meta(B + 2, dtype=I32)), ValueError,
     "cu_seqlens_k: has 6 entries but cu_seqlens_q has 5"),
    ("cu-dtype", {}, dict(cu_seqlens_q=meta(B + 1, dtype=I64)), TypeError,
     "cu_seqlens_q: dtype int64"),
    ("cpu", {}, dict(v=torch.zeros(T, HKV, D, dtype=BF)), ValueError, "v: tensor is on cpu"),
    ("func-given", {}, dict(func_tensor=meta(1, 3, L, dtype=I32)), ValueError,
     "func_tensor must be None: this op applies no arbitrary mask"),
    ("func-missing", FUNC, {}, ValueError,
     r"func_tensor \(1, 3, L\) is required: this op applies an arbitrary mask"),
    ("func-n", FUNC, dict(func_tensor=meta(1, 5, L, dtype=I32)), ValueError,
     r"func_tensor: extent 5 on axis 1 does not match \(1, 3, \*\)"),
    ("func-columns-for-more-tokens", FUNC,
     dict(q=meta(2 * T, H, D), o=meta(2 * T, H, D), func_tensor=meta(1, 3, L, dtype=I32)),
     ValueError, rf"func_tensor: L = {L} columns; at least T_q \+ 256 = {2 * T + 256}"),
    ("k-missing", {}, dict(k=None), ValueError, "k and v are required"),
    ("paged-args-given", {}, dict(page_ids=meta(PAGES, dtype=I32)), ValueError,
     "this op is not for paged KV"),
    ("paged-missing", PAGED, dict(paged_kv=None), ValueError,
     "paged KV needs paged_kv, page_ids and page_indptrs"),
    ("paged-k-given", PAGED, dict(k=meta(T, HKV, D)), ValueError, "k and v must be None"),
    ("paged-kv-heads", PAGED, dict(paged_kv=meta(PAGES, 2, PAGE_SIZE, 1, D)), ValueError,
     r"paged_kv: extent 1 on axis 3 does not match \(\*, 2, 128, 2, 64\)"),
    ("paged-indptrs", PAGED, dict(page_indptrs=meta(B, dtype=I32)), ValueError,
     "page_indptrs: has 4 entries but cu_seqlens_q has 5"),
    ("max-seqlen-override", {}, dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max-seqlen-for-more-tokens", {}, dict(q=meta(2 * T, H, D), o=meta(2 * T, H, D)),
     ValueError, "max_seqlen_q = 16 is too small: 4 sequences hold T_q = 128 tokens"),
    ("max-seqlen-k-type", {}, dict(max_seqlen_k=16.5), TypeError, "max_seqlen_k must be an int"),
    ("alpha-override", {}, dict(alpha=math.inf), ValueError, "alpha must be finite"),
    ("scaling-override", {}, dict(scaling_seqlen=0.0), ValueError,
     "scaling_seqlen must be positive"),
]


@pytest.mark.parametrize("op_kw,changes,exc,match", [r[1:] for r in EXECUTE_RULES],
                         ids=[r[0] for r in EXECUTE_RULES])
def test_execute_refuses(op_kw, changes, exc, match):
    op = attn(**op_kw).check_support()
    args = paged_meta_args() if "paged_kv" in op_kw else meta_args()
    if "func" in op_kw:
        args["func_tensor"] = None
    with pytest.raises(exc, match=match):
        op.execute(**{**args, **changes})


OWN_WORKSPACE = torch.zeros(WORKSPACE_SHAPE, dtype=I32, device="meta")


@pytest.fixture
def launches(monkeypatch):
    """Stands in for the loaded kernels, the device's SM count and the op's own workspace:
    records each launch's arguments."""
    recorder = types.SimpleNamespace(calls=[], orders=[])

    def ready(self, device_index):
        return {"fwd": lambda *args: recorder.calls.append(args),
                "order": lambda *args: recorder.orders.append(args)}
    monkeypatch.setattr(Op, "_ready", ready)
    monkeypatch.setattr("precast.lifecycle.hstu_attention.sm_count", lambda index: 132)
    monkeypatch.setattr(HSTUFwdSm90, "_own_workspace", lambda self, index, handle: OWN_WORKSPACE)
    return recorder


def test_execute_launch_arguments(launches):
    op = attn(window_size=(16, 0), alpha=0.5).check_support()
    args = meta_args()
    op.execute(**args, stream=7)
    (call,) = launches.calls
    assert call[:11] == (args["q"], args["k"], args["v"], args["o"], args["cu_seqlens_q"],
                         args["cu_seqlens_k"], None, None, None, None, OWN_WORKSPACE)
    # (T_q = B x max_seqlen_q: the dense tile order, all B sequences in one group)
    assert call[11:] == (MAXS, 16, 0, 0.25, 1 / MAXS, 132, B, 0, 7)
    # runtime values: another batch, alpha, scaling and max_seqlen, without a new op
    args = meta_args(t_q=3 * T, t_k=5 * T, batch=2 * B)
    op.execute(**args, stream=7, alpha=-3.0, scaling_seqlen=4.0, max_seqlen_q=40,
               max_seqlen_k=80)
    assert launches.calls[1][11:] == (40, 16, 0, -1.5, 0.25, 132, 0, 0, 7)
    # an omitted scaling_seqlen follows this call's max_seqlen_q
    op.execute(**args, stream=7, max_seqlen_q=48, max_seqlen_k=80)
    assert launches.calls[2][11:] == (48, 16, 0, 0.25, 1 / 48, 132, 0, 0, 7)
    # a caller's workspace replaces the op's own
    ws = torch.zeros(WORKSPACE_SHAPE, dtype=I32, device="meta")
    op.execute(**args, stream=7, max_seqlen_q=48, max_seqlen_k=80, workspace=ws)
    assert launches.calls[3][10] is ws
    op.execute(**args, stream=7, max_seqlen_q=3 * T // (2 * B), max_seqlen_k=80)
    assert launches.calls[4][17] == 2 * B  # dense again: 2 B sequences of 3 T / 2 B
    assert launches.orders == []  # every sequence fits one query tile


def test_execute_orders_ragged_batches_longest_first(launches):
    """A batch not in the dense order whose sequences may span several query tiles first
    runs the order kernel into the workspace (after the counter), then the forward with
    sorted_order = 1; dense and one-tile (decoding) batches, one sequence, and batches
    beyond ORDER_MAX_SEQUENCES keep the batch order."""
    op = attn(window_size=(-1, 0)).check_support()
    ws = torch.zeros(WORKSPACE_SHAPE, dtype=I32, device="meta")
    args = meta_args(t_q=3 * T, t_k=3 * T)
    op.execute(**args, stream=5, max_seqlen_q=3 * T - 8, max_seqlen_k=3 * T - 8,
               workspace=ws)
    assert launches.orders == [(args["cu_seqlens_q"], args["cu_seqlens_k"], ws, 5)]
    assert launches.calls[-1][17:] == (0, 1, 5)
    for kw in (dict(max_seqlen_q=3 * T // B, max_seqlen_k=3 * T // B),  # dense
               dict(max_seqlen_q=QUERY_TILE_ROWS, max_seqlen_k=3 * T)):  # one tile each
        op.execute(**args, stream=5, workspace=ws, **kw)
        assert launches.calls[-1][18] == 0 and len(launches.orders) == 1
    assert longest_first(2, QUERY_TILE_ROWS + 1, 0)
    assert longest_first(ORDER_MAX_SEQUENCES, QUERY_TILE_ROWS + 1, 0)
    assert not longest_first(ORDER_MAX_SEQUENCES + 1, 4096, 0)
    assert not longest_first(1, 4096, 0)
    assert not longest_first(8, 4096, 2)
    assert WORKSPACE_SHAPE == (SCHEDULER_COUNTER_SHAPE[0] + ORDER_MAX_SEQUENCES,)


def test_execute_caps_wide_windows(launches):
    attn(window_size=(2**31 - 1, 2**30 + 5)).check_support().execute(**meta_args(), stream=1)
    assert launches.calls[-1][12:14] == (2**30, 2**30)


@pytest.mark.parametrize("workspace, error, match", [
    (torch.zeros(3, dtype=I32, device="meta"), ValueError, r"workspace: extent 3 on axis 0"),
    (torch.zeros(WORKSPACE_SHAPE, dtype=I64, device="meta"), TypeError, "workspace: dtype int64"),
    (torch.zeros(2 * WORKSPACE_SHAPE[0], dtype=I32, device="meta")[::2], ValueError,
     "workspace: the last dimension must be contiguous"),
])
def test_execute_rejects_bad_workspaces(launches, workspace, error, match):
    with pytest.raises(error, match=match):
        attn().check_support().execute(**meta_args(), stream=1, workspace=workspace)
    assert launches.calls == []


def test_workspace_aliases_nothing():
    buf = torch.zeros(3 * T, H, D, dtype=BF)
    named = dict(q=buf[:T], k=buf[2 * T:], v=buf[2 * T:], o=buf[T:2 * T])
    HSTUFwdSm90._check_relations({**named, "workspace": torch.zeros(2, dtype=I32)})
    with pytest.raises(ValueError, match="o overlaps workspace in memory"):
        HSTUFwdSm90._check_relations({**named, "workspace": named["o"].view(-1).view(I32)[:2]})
    with pytest.raises(ValueError, match="workspace overlaps q in memory"):
        HSTUFwdSm90._check_relations({**named, "workspace": named["q"].view(-1).view(I32)[:2]})


def test_own_workspace_refused_while_capturing(monkeypatch):
    monkeypatch.setattr("precast.lifecycle.launch.stream_is_capturing", lambda h: True)
    with pytest.raises(RuntimeError, match="capturing a CUDA graph.*pass workspace="):
        attn().check_support()._own_workspace(0, 1234)


def test_execute_constructor_scaling_and_unbounded_windows(launches):
    attn(scaling_seqlen=10.0).check_support().execute(**meta_args(), stream=1)
    assert launches.calls[-1][11:] == (MAXS, -1, -1, 0.5, 0.1, 132, 0, 0, 1)
    op = attn(**PAGED).check_support()
    args = paged_meta_args()
    op.execute(**args, stream=2)
    call = launches.calls[-1]
    assert call[1] is None and call[2] is None and call[6] is None
    assert call[7:10] == (args["paged_kv"], args["page_ids"], args["page_indptrs"])
    assert call[12:14] == (-1, 0)
    op = attn(**FUNC).check_support()
    func = meta(1, 3, 2 * L, dtype=I32)  # wider than needed is fine
    op.execute(**meta_args(), func_tensor=func, stream=3)
    assert launches.calls[-1][6] is func


@pytest.mark.parametrize("args", [
    meta_args(t_q=0, t_k=0), meta_args(t_q=0, t_k=T), meta_args(batch=0),
])
def test_execute_empty_batch_launches_nothing(launches, args):
    op = attn().check_support()
    op.execute(**args, stream=0, max_seqlen_q=0 if args["q"].shape[0] == 0 else MAXS)
    assert launches.calls == []


def test_execute_checks_first_when_unchecked(launches):
    op = attn(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.execute(**meta_args(), stream=0)
    assert launches.calls == []


def test_kernel_scalars():
    assert kernel_scalars(1.0, 256) == (0.5, 1 / 256)
    assert kernel_scalars(-6e38, 3e-38) == (-3e38, 1 / 3e-38)
    with pytest.raises(ValueError, match="alpha / 2 overflows float32"):
        kernel_scalars(7e38, 1.0)


# --- the kernel builder (fake arguments of the fixed kernel interface) ----------------------------
@pytest.fixture
def stub_kernel(monkeypatch):
    pytest.importorskip("cutlass")
    made = []

    class Kernel:
        def __init__(self, *args):
            made.append(args)

    module = types.ModuleType("precast.kernels.hstu_attention_fwd_sm90")
    module.HstuAttentionForwardSm90 = Kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return made


@pytest.mark.parametrize("config,none_args", [
    ({}, (6, 7, 8, 9)),
    (dict(paged=True, num_kv_heads=1), (1, 2, 6)),
    (dict(window_right_bounded=False, func_intervals=3, num_kv_heads=2), (7, 8, 9)),
])
def test_kernel_builder_arguments(stub_kernel, config, none_args):
    import cutlass
    op = HSTUFwdSm90.from_config(dtype="float16", head_dim=64, **config).check_support()
    builders = op._kernel_builders()
    assert set(builders) == {"fwd", "order"}
    kernel, args = builders["fwd"]()
    cfg = op.static_config()
    assert stub_kernel == [(cutlass.Float16, 64, 4, cfg["num_kv_heads"],
                            cfg["window_left_bounded"], cfg["window_right_bounded"],
                            cfg["func_intervals"], cfg["paged"])]
    assert len(args) == 19
    assert tuple(args[10].shape) == WORKSPACE_SHAPE and args[10].element_type == cutlass.Int32
    assert tuple(i for i, a in enumerate(args) if a is None) == none_args
    q, o = args[0], args[3]
    assert tuple(q.shape[1:]) == (4, 64) and q.stride[2] == 1
    assert q.shape[0] is o.shape[0] and q.stride[0] is not o.stride[0]  # one T_q, own strides
    assert args[4].shape[0] is args[5].shape[0]  # B + 1 entries in both cu_seqlens
    if cfg["paged"]:
        assert tuple(args[7].shape[1:]) == (2, PAGE_SIZE, 1, 64)
        assert tuple(args[7].stride) == (2 * PAGE_SIZE * 64, PAGE_SIZE * 64, 64, 64, 1)
        assert args[9].shape[0] is args[4].shape[0]
    if cfg["func_intervals"]:
        assert tuple(args[6].shape[:2]) == (1, 3) and args[6].stride[2] == 1


# --- the allocating function and the custom op ----------------------------------------------------
def forward_args(**kw):
    args = meta_args()
    del args["o"]
    return {**args, "max_seqlen_q": MAXS, "max_seqlen_k": MAXS, "stream": 0, **kw}


def test_allocating_function_allocates_o_and_reuses_one_op(no_compile):
    r = hstu_attention_forward(**forward_args(alpha=2.0))
    (o,) = r
    assert r.o_tensor is o and r["o_tensor"] is o
    assert o.shape == (T, H, D) and o.dtype == BF and o.is_contiguous()
    call = no_compile.calls[-1]
    assert call[3] is o and call[11:] == (MAXS, -1, 0, 1.0, 1 / MAXS, 132, B, 0, 0)  # causal
    # runtime values reuse the op; another window makes another instance (same kernel)
    hstu_attention_forward(**forward_args(alpha=0.5, scaling_seqlen=2.0, max_seqlen_q=20,
                                          max_seqlen_k=20))
    assert no_compile.calls[-1][11:] == (20, -1, 0, 0.25, 0.5, 132, 0, 0, 0)
    hstu_attention_forward(**forward_args(q=meta(2 * T, H, D), max_seqlen_q=32, max_seqlen_k=32))
    assert len(COMPILED_OPS._ops) == 1
    hstu_attention_forward(**forward_args(window_size=(4, 0)))
    assert no_compile.calls[-1][12:14] == (4, 0)
    assert len(COMPILED_OPS._ops) == 2


def test_allocating_function_copies_unreadable_layouts(no_compile):
    q = meta(T, H, 2 * D)[:, :, ::2]           # last dimension strided
    k = meta(T, HKV, D + 4)[:, :, :D]          # head stride 68
    cu = meta(2 * (B + 1), dtype=I32)[::2]     # strided offsets
    v = meta(T, HKV, D)
    hstu_attention_forward(**forward_args(q=q, k=k, v=v, cu_seqlens_q=cu))
    call = no_compile.calls[-1]
    assert call[0] is not q and call[0].is_contiguous() and call[0].shape == q.shape
    assert call[1] is not k and call[1].is_contiguous()
    assert call[2] is v  # readable in place: not copied
    assert call[4] is not cu and call[4].is_contiguous()


def test_allocating_function_writes_a_given_o(no_compile):
    o = meta(T, H, D)
    assert hstu_attention_forward(**forward_args(), o_tensor=o).o_tensor is o
    assert no_compile.calls[-1][3] is o
    strided = meta(T, H, 2 * D)[:, :, ::2]     # computed into a buffer, then copied back
    assert hstu_attention_forward(**forward_args(), o_tensor=strided).o_tensor is strided
    assert no_compile.calls[-1][3] is not strided


def test_allocating_function_paged_and_func(no_compile):
    args = forward_args(k=None, v=None, paged_kv=meta(PAGES, 2, PAGE_SIZE, HKV, D),
                        page_ids=meta(PAGES, dtype=I32), page_indptrs=meta(B + 1, dtype=I32))
    hstu_attention_forward(**args)
    assert no_compile.calls[-1][7] is args["paged_kv"]
    func = meta(1, 3, L, dtype=I32)
    hstu_attention_forward(**forward_args(window_size=(-1, -1), func_tensor=func))
    assert no_compile.calls[-1][6] is func


def test_allocating_function_validates(no_compile):
    with pytest.raises(ValueError, match="q: tensor is on cpu"):
        hstu_attention_forward(**forward_args(q=torch.zeros(T, H, D, dtype=BF)))
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        hstu_attention_forward(**forward_args(window_size=(-3, 0)))
    with pytest.raises(NotImplementedError, match="head dim D = 48"):
        hstu_attention_forward(**forward_args(q=meta(T, H, 48)))
    assert COMPILED_OPS._ops == {}  # nothing invalid is cached


def test_custom_op_fake_gives_o_shape():
    q, k, v = meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D)
    cu = meta(B + 1, dtype=I32)
    o = torch.ops.precast.hstu_attention_fwd(q, k, v, cu, cu, MAXS, MAXS, None, -1, 0, 1.0,
                                             None, None, None, None)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta"


def test_dense_seq_group():
    """The forward's dense tile order only when T_q = B x max_seqlen_q (every sequence has
    max_seqlen_q queries) under a right-bounded window, with about KV_GROUP_BYTES of K/V per
    group of sequences."""
    per_seq = 2 * 4096 * 4 * 128 * 2  # K and V of one 4096-key sequence, 4 heads, D 128
    args = (16 * 4096, 16, 4096, 4096, 4, 128, 2)
    assert dense_seq_group(*args, True) == KV_GROUP_BYTES // per_seq
    assert dense_seq_group(*args, False) == 0  # equal tiles: sequence by sequence
    assert dense_seq_group(16 * 4096 - 1, 16, 4096, 4096, 4, 128, 2, True) == 0  # one shorter
    assert dense_seq_group(4096, 1, 4096, 4096, 4, 128, 2, True) == 0  # one sequence
    assert dense_seq_group(0, 4, 0, 0, 4, 128, 2, True) == 0
    assert dense_seq_group(3 * 100, 3, 100, 100, 1, 32, 2, True) == 3  # at most the batch
    assert dense_seq_group(2 * 65536, 2, 65536, 65536, 8, 256, 2, True) == 1  # at least one
