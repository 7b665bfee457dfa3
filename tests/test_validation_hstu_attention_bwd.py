"""Every check_support() and execute() rule of HSTUBwdSm90, its static configuration and
cache key, the overlap rule it relies on (check_no_overlap / _share_elements: disjoint views
of one allocation are accepted), the allocating function and the custom ops' fakes -- all on
a CPU machine (ops are built from TensorDescs, meta or CPU tensors; kernels are never built
or loaded)."""
import contextlib
import itertools
import math
import random
import sys
import types

import pytest
import torch

import precast
from precast import HSTUBwdSm90, HSTUFwdSm90, TensorDesc, hstu_attention_backward
from precast.lifecycle import op as op_mod
from precast.lifecycle.hstu_attention import FLOAT32_MAX, WINDOW_CAP
from precast.lifecycle.hstu_attention_bwd import fixed_rows
from precast.lifecycle.op import Op
from precast.lifecycle.validation import (INT32_MAX, _share_elements, byte_range,
                                          check_no_overlap)
from precast.plan import expand
from precast.reference.hstu_attention import FUNC_PAD_COLUMNS

BF, FP, F32, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64
T, H, HKV, D, B = 64, 4, 2, 64, 4  # tokens (q and k), heads, kv heads, head dim, sequences
MAXS = T // B  # the smallest max_seqlen that B sequences of T tokens allow
L = T + FUNC_PAD_COLUMNS
COMPILED_OPS = sys.modules["precast.op_cache"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing here may build or load kernels; the allocating function starts with no ops."""
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "cache"))

    def no_kernels(self, device_index):
        raise AssertionError("validation test reached kernel loading")
    monkeypatch.setattr(Op, "_ready", no_kernels)
    monkeypatch.setattr(COMPILED_OPS, "_ops", {})


def desc(shape, dtype=BF, stride=None, alignment=16, device="cuda"):
    return TensorDesc(dtype, shape, stride, device, alignment)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


SAMPLES = ("do", "q", "k", "v", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "func")
BASE = dict(do=desc((T, H, D)), q=desc((T, H, D)), k=desc((T, HKV, D)), v=desc((T, HKV, D)),
            dq=None, dk=None, dv=None, cu_seqlens_q=desc((B + 1,), I32),
            cu_seqlens_k=desc((B + 1,), I32), max_seqlen_q=MAXS, max_seqlen_k=MAXS)
FUNC = dict(func=desc((1, 3, L), I32), window_size=(-1, -1))


def bwd(**kw):
    """The op from BASE with some arguments replaced (None included)."""
    args = {**BASE, **kw}
    return HSTUBwdSm90(**{("sample_" + k if k in SAMPLES else k): v for k, v in args.items()})


def dims(head_dim, dtype=BF, t_q=T, t_k=T, heads=H, kv_heads=HKV):
    """do, q, k, v descriptors of another head dim / dtype."""
    return dict(do=desc((t_q, heads, head_dim), dtype), q=desc((t_q, heads, head_dim), dtype),
                k=desc((t_k, kv_heads, head_dim), dtype), v=desc((t_k, kv_heads, head_dim), dtype))


# --- valid configurations -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {}, dict(window_size=(-1, 0)), dict(window_size=(16, 0)), dict(window_size=(0, 0)),
    dict(window_size=[3, -1]), dict(window_size=(2**31 - 1, 2**31 - 1)),
    dict(alpha=-2.5, scaling_seqlen=7.0), dict(deterministic=True), FUNC,
    dict(func=desc((1, 1, L + 100), I32), window_size=(-1, -1)),
    dict(dq=desc((T, H, D)), dk=desc((T, HKV, D)), dv=desc((T, HKV, D))),  # given gradients
    dict(dq=desc((T, H, D), stride=(2 * H * D, D, 1)),                   # padded gradients
         dk=desc((T, HKV, D), stride=(2 * HKV * D, D, 1)),
         dv=desc((T, HKV, D), stride=(2 * HKV * D, D, 1))),
    dict(k=desc((T, 1, D)), v=desc((T, 1, D))),   # MQA
    dict(k=desc((T, H, D)), v=desc((T, H, D))),   # MHA
    dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D)), max_seqlen_k=2 * MAXS),  # T_k != T_q
    dict(max_seqlen_q=0, max_seqlen_k=0, **dims(D, t_q=0, t_k=0)),  # empty batch
    dict(cu_seqlens_q=desc((1,), I32), cu_seqlens_k=desc((1,), I32)),  # B = 0
])
def test_valid_configurations(kw):
    op = bwd(**kw).check_support()
    assert op._checked


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_supported_head_dims_and_dtypes(head_dim, dtype):
    op = bwd(**dims(head_dim, dtype)).check_support()
    assert op.head_dim == head_dim and op.dtype == dtype


def test_meta_samples_are_accepted():
    op = HSTUBwdSm90(meta(T, H, D), meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D),
                     meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D), meta(B + 1, dtype=I32),
                     meta(B + 1, dtype=I32), MAXS, MAXS).check_support()
    assert op.static_config()["num_kv_heads"] == HKV


def test_exported():
    assert precast.HSTUBwdSm90 is HSTUBwdSm90
    assert "HSTUBwdSm90" in precast.__all__
    assert callable(precast.hstu_attention_backward) and callable(precast.hstu_attention)
    assert "hstu_attention_backward" in precast.__all__ and "hstu_attention" in precast.__all__
    assert op_mod.OP_REGISTRY["HSTUBwdSm90"] is HSTUBwdSm90


def test_omitted_gradients_default_to_input_shapes():
    op = bwd(k=desc((2 * T, HKV, D), FP), v=desc((2 * T, HKV, D), FP),
             do=desc((T, H, D), FP), q=desc((T, H, D), stride=(2 * H * D, D, 1), dtype=FP),
             max_seqlen_k=2 * MAXS)
    assert op.dq == TensorDesc(FP, (T, H, D))  # compact, not q's padded strides
    assert op.dq.is_contiguous() and op.dq.stride == (H * D, D, 1)
    assert op.dk == TensorDesc(FP, (2 * T, HKV, D)) and op.dv == TensorDesc(FP, (2 * T, HKV, D))
    op.check_support()
    given = desc((T, H, D), stride=(H * D + 8, D, 1))
    assert bwd(dq=given).dq is given  # a given gradient descriptor is kept as is


@pytest.mark.parametrize("head_dim,modes", [
    (32, ("dq", "dkdv")), (64, ("dq", "dkdv")), (128, ("dq", "dkdv")), (256, ("dq", "dk", "dv")),
])
def test_kernel_modes_and_workspace(head_dim, modes):
    op = bwd(**dims(head_dim))
    assert op.kernel_modes() == modes
    assert fixed_rows(head_dim) == (128 if head_dim <= 128 else 64)
    assert HSTUBwdSm90.workspace_shape() == (0,)
    assert op.workspace_shape(12345) == (0,)


# --- every rule -----------------------------------------------------------------------------------
RULES = [
    # (id, bwd kwargs, exception, message fragment)
    # required tensors
    ("do-missing", dict(do=None), ValueError, "do and q are required"),
    ("q-missing", dict(q=None), ValueError, "do and q are required"),
    ("k-missing", dict(k=None), ValueError, "k and v are required"),
    ("v-missing", dict(v=None), ValueError, "k and v are required"),
    # dtypes
    ("q-dtype-fp32", dict(q=desc((T, H, D), F32)), TypeError,
     "q: dtype float32 is not supported; expected bfloat16 or float16"),
    ("all-fp32", dims(D, F32), TypeError, "q: dtype float32 is not supported"),
    ("do-dtype", dict(do=desc((T, H, D), FP)), TypeError,
     "do: dtype float16 is not supported; expected bfloat16"),
    ("dq-dtype", dict(dq=desc((T, H, D), FP)), TypeError,
     "dq: dtype float16 is not supported; expected bfloat16"),
    ("dq-dtype-fp32", dict(dq=desc((T, H, D), F32)), TypeError, "dq: dtype float32"),
    ("dk-dtype", dict(dk=desc((T, HKV, D), FP)), TypeError,
     "dk: dtype float16 is not supported; expected bfloat16"),
    ("dv-dtype", dict(dv=desc((T, HKV, D), F32)), TypeError, "dv: dtype float32"),
    ("k-dtype", dict(k=desc((T, HKV, D), FP)), TypeError, "k: dtype float16"),
    ("v-dtype", dict(v=desc((T, HKV, D), FP)), TypeError, "v: dtype float16"),
    # head dim and heads
    ("D-96", dims(96), NotImplementedError,
     "q: head dim D = 96 is not supported; expected one of 32, 64, 128, 256"),
    ("D-16", dims(16), NotImplementedError, "head dim D = 16"),
    ("D-512", dims(512), NotImplementedError, "head dim D = 512"),
    ("H-0", dims(D, heads=0), ValueError, r"q: needs at least one head, got shape \[64, 0, 64\]"),
    ("kv-heads-not-dividing", dict(k=desc((T, 3, D)), v=desc((T, 3, D))), ValueError,
     "k: H_kv = 3 key/value heads must be >= 1 and divide the H = 4 query heads"),
    ("kv-heads-above-H", dict(k=desc((T, 8, D)), v=desc((T, 8, D))), ValueError, "H_kv = 8"),
    ("kv-heads-0", dict(k=desc((T, 0, D)), v=desc((T, 0, D))), ValueError, "k: H_kv = 0"),
    ("k-head-dim", dict(k=desc((T, HKV, 32))), ValueError,
     r"k: extent 32 on axis 2 does not match \(\*, \*, 64\)"),
    ("do-heads", dict(do=desc((T, HKV, D))), ValueError,
     r"do: extent 2 on axis 1 does not match \(\*, 4, 64\)"),
    ("dq-heads", dict(dq=desc((T, 2 * H, D))), ValueError, r"dq: extent 8 on axis 1"),
    ("dq-head-dim", dict(dq=desc((T, H, 2 * D))), ValueError, "dq: extent 128 on axis 2"),
    ("v-heads", dict(v=desc((T, 1, D))), ValueError,
     r"v: extent 1 on axis 1 does not match \(\*, 2, 64\)"),
    ("dk-heads", dict(dk=desc((T, H, D))), ValueError,
     r"dk: extent 4 on axis 1 does not match \(\*, 2, 64\)"),
    ("dv-head-dim", dict(dv=desc((T, HKV, 32))), ValueError, "dv: extent 32 on axis 2"),
    ("do-rank", dict(do=desc((T, H * D))), ValueError, "do: expected a rank-3"),
    ("dk-rank", dict(dk=desc((T, HKV, D, 1))), ValueError, "dk: expected a rank-3"),
    # token counts
    ("do-tokens", dict(do=desc((T - 1, H, D))), ValueError, "do: has 63 tokens but q has 64"),
    ("dq-tokens", dict(dq=desc((T + 8, H, D))), ValueError, "dq: has 72 tokens but q has 64"),
    ("v-tokens", dict(v=desc((T - 1, HKV, D))), ValueError, "v: has 63 tokens but k has 64"),
    ("dk-tokens", dict(dk=desc((T - 1, HKV, D))), ValueError, "dk: has 63 tokens but k has 64"),
    ("dv-tokens", dict(dv=desc((2 * T, HKV, D))), ValueError, "dv: has 128 tokens but k has 64"),
    ("dk-tokens-of-q", dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D)),
                            dk=desc((T, HKV, D)), max_seqlen_k=2 * MAXS),
     ValueError, "dk: has 64 tokens but k has 128"),
    # layouts of the gradients
    ("dq-last-stride", dict(dq=desc((T, H, D), stride=(2 * H * D, 2 * D, 2))), ValueError,
     r"dq: the last dimension must be contiguous \(stride 1\)"),
    ("dk-token-stride-multiple", dict(dk=desc((T, HKV, D), stride=(HKV * D + 4, D, 1))),
     ValueError, "dk: axis-0 stride 132 must be a multiple of 8"),
    ("dv-alignment", dict(dv=desc((T, HKV, D), alignment=8)), ValueError,
     "dv: base address is 8-byte aligned; 16-byte alignment is required"),
    ("do-alignment", dict(do=desc((T, H, D), alignment=4)), ValueError,
     "do: base address is 4-byte"),
    ("dq-heads-overlap", dict(dq=desc((T, H, D), stride=(H * D, D // 2, 1))), ValueError,
     "dq: axis-1 stride 32 is smaller than the 64 elements spanned by the faster axes"),
    ("dk-broadcast", dict(dk=desc((T, HKV, D), stride=(0, D, 1))), ValueError,
     "dk: axis-0 stride 0 is smaller than"),
    ("dv-on-cpu", dict(dv=desc((T, HKV, D), device="cpu")), ValueError,
     "dv: tensor is on cpu; expected a cuda tensor"),
    # cu_seqlens
    ("cu_q-dtype", dict(cu_seqlens_q=desc((B + 1,), I64)), TypeError,
     "cu_seqlens_q: dtype int64 is not supported; expected int32"),
    ("cu_k-dtype", dict(cu_seqlens_k=desc((B + 1,), I64)), TypeError,
     "cu_seqlens_k: dtype int64 is not supported; expected int32"),
    ("cu_q-rank", dict(cu_seqlens_q=desc((1, B + 1), I32)), ValueError,
     r"cu_seqlens_q: expected a rank-1 tensor of shape \(\*\)"),
    ("cu_q-empty", dict(cu_seqlens_q=desc((0,), I32), cu_seqlens_k=desc((0,), I32)), ValueError,
     r"cu_seqlens_q: needs B \+ 1 >= 1 entries"),
    ("cu_k-length", dict(cu_seqlens_k=desc((B + 2,), I32)), ValueError,
     r"cu_seqlens_k: has 6 entries but cu_seqlens_q has 5; both hold B \+ 1 offsets"),
    ("cu_q-length", dict(cu_seqlens_q=desc((B,), I32)), ValueError,
     "cu_seqlens_k: has 5 entries but cu_seqlens_q has 4"),
    ("cu_k-strided", dict(cu_seqlens_k=desc((B + 1,), I32, stride=(2,))), ValueError,
     "cu_seqlens_k: the last dimension must be contiguous"),
    # arbitrary masks
    ("func-n-even", dict(FUNC, func=desc((1, 2, L), I32)), ValueError,
     r"func_tensor: n = 2 rows; expected a positive odd n \(F0, then \[F1, F2\)"),
    ("func-n-zero", dict(FUNC, func=desc((1, 0, L), I32)), ValueError, "func_tensor: n = 0 rows"),
    ("func-columns", dict(FUNC, func=desc((1, 3, L - 1), I32)), ValueError,
     rf"func_tensor: L = {L - 1} columns; at least T_q \+ 256 = {L} are required"),
    ("func-columns-for-more-q", dict(FUNC, **dims(D, t_q=2 * T), max_seqlen_q=2 * MAXS,
                                     max_seqlen_k=2 * MAXS),
     ValueError, rf"func_tensor: L = {L} columns; at least T_q \+ 256 = {2 * T + 256}"),
    ("func-dtype", dict(FUNC, func=desc((1, 3, L), I64)), TypeError,
     "func_tensor: dtype int64 is not supported; expected int32"),
    ("func-rank", dict(FUNC, func=desc((3, L), I32)), ValueError,
     r"func_tensor: expected a rank-3 tensor of shape \(1, \*, \*\)"),
    ("func-padded", dict(FUNC, func=desc((1, 3, L), I32, stride=(3 * (L + 8), L + 8, 1))),
     ValueError, "func_tensor: must be contiguous"),
    ("func-with-causal", dict(func=FUNC["func"], window_size=(-1, 0)), ValueError,
     r"func_tensor \(arbitrary mask\) cannot be combined with a window mask: window_size must "
     r"be \(-1, -1\), got \(-1, 0\)"),
    ("func-with-local", dict(func=FUNC["func"], window_size=(4, 4)), ValueError,
     r"got \(4, 4\)"),
    ("func-with-left", dict(func=FUNC["func"], window_size=(8, -1)), ValueError,
     r"got \(8, -1\)"),
    # window
    ("window-below-minus-one", dict(window_size=(-2, 0)), ValueError,
     r"window_size left must be >= -1 \(-1 = unbounded\), got -2"),
    ("window-right-below-minus-one", dict(window_size=(0, -5)), ValueError,
     "window_size right must be >= -1"),
    ("window-int32", dict(window_size=(2**31, 0)), ValueError,
     r"window_size left = 2147483648 must be <= 2\^31 - 1"),
    ("window-right-int32", dict(window_size=(-1, 2**31)), ValueError,
     r"window_size right = 2147483648 must be <= 2\^31 - 1"),
    ("window-float", dict(window_size=(0, 1.5)), ValueError,
     "window_size right must be an int >= -1, got 1.5"),
    ("window-not-a-pair", dict(window_size=(0,)), ValueError,
     r"window_size must be a pair \(left, right\)"),
    # max_seqlen
    ("max_q-above-max_k", dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max_q-too-small", dict(max_seqlen_q=MAXS - 1), ValueError,
     "max_seqlen_q = 15 is too small: 4 sequences hold T_q = 64 tokens"),
    ("max_k-too-small", dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D))), ValueError,
     "max_seqlen_k = 16 is too small: 4 sequences hold T_k = 128 tokens"),
    ("max_q-zero-with-tokens", dict(max_seqlen_q=0), ValueError, "max_seqlen_q = 0 is too small"),
    ("max_q-negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0, got -1"),
    ("max_k-negative", dict(max_seqlen_k=-5), ValueError, "max_seqlen_k must be >= 0, got -5"),
    ("max_q-float", dict(max_seqlen_q=16.0), TypeError, "max_seqlen_q must be an int, got float"),
    ("max_k-bool", dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
    ("max_k-int32", dict(max_seqlen_k=2**31), ValueError, "max_seqlen_k must be <= 2147483647"),
    # H x ceil(max(max_q, max_k) / rows) x B work tiles fit in int32; rows = 128 for D <= 128
    ("work-tiles-D64", dict(max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((33,), I32),
                            cu_seqlens_k=desc((33,), I32)), ValueError,
     r"max_seqlen_k = 2147483647: H x ceil\(max_seqlen / 128\) x B = 2147483648 work tiles "
     r"exceed 2\^31 - 1"),
    # ... and 64 for D = 256
    ("work-tiles-D256", dict(dims(256), max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((17,), I32),
                             cu_seqlens_k=desc((17,), I32)), ValueError,
     r"H x ceil\(max_seqlen / 64\) x B = 2147483648 work tiles exceed"),
    # alpha and scaling_seqlen
    ("alpha-nan", dict(alpha=math.nan), ValueError, "alpha must be finite, got nan"),
    ("alpha-inf", dict(alpha=math.inf), ValueError, "alpha must be finite, got inf"),
    ("alpha-str", dict(alpha="1"), TypeError, "alpha must be a real number, got str"),
    ("alpha-half-overflow", dict(alpha=1e39), ValueError, "alpha / 2 overflows float32"),
    ("scaling-zero", dict(scaling_seqlen=0), ValueError, "scaling_seqlen must be positive, got 0"),
    ("scaling-negative", dict(scaling_seqlen=-16.0), ValueError,
     "scaling_seqlen must be positive"),
    ("scaling-nan", dict(scaling_seqlen=math.nan), ValueError, "scaling_seqlen must be finite"),
    ("scaling-inverse-overflow", dict(scaling_seqlen=1e-39), ValueError,
     "1 / scaling_seqlen overflows float32"),
    ("alpha-over-scaling-overflow", dict(alpha=3e38, scaling_seqlen=1e-3), ValueError,
     r"alpha / scaling_seqlen = 3(\.\d*)?e\+41 overflows float32"),
    ("negative-alpha-over-scaling-overflow", dict(alpha=-3e38, scaling_seqlen=0.5), ValueError,
     "alpha / scaling_seqlen = -6e\\+38 overflows float32"),
    # an empty batch: the default scaling_seqlen is 1, alpha / 2 fits but alpha does not
    ("alpha-over-default-scaling", dict(alpha=3.4e38 * 1.001, max_seqlen_q=0, max_seqlen_k=0,
                                        **dims(D, t_q=0, t_k=0)),
     ValueError, "alpha / scaling_seqlen = .* overflows float32"),
    # deterministic
    ("deterministic-int", dict(deterministic=1), TypeError,
     "deterministic must be a bool, got int"),
    ("deterministic-none", dict(deterministic=None), TypeError,
     "deterministic must be a bool, got NoneType"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(kw, exc, match):
    op = bwd(**kw)
    with pytest.raises(exc, match=match):
        op.check_support()
    assert not op._checked


def test_work_tiles_at_the_limit_are_accepted():
    bwd(max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((32,), I32),
        cu_seqlens_k=desc((32,), I32)).check_support()          # 4 x 2^24 x 31 < 2^31
    bwd(**dims(256), max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((16,), I32),
        cu_seqlens_k=desc((16,), I32)).check_support()          # 4 x 2^25 x 15 < 2^31


@pytest.mark.xfail(strict=True, reason="HSTUBwdSm90._work_tiles labels max(max_seqlen_q, "
                   "max_seqlen_k) as 'max_seqlen_k' even when max_seqlen_q is the larger")
def test_work_tiles_message_names_max_seqlen_q_when_it_is_the_larger():
    op = bwd(max_seqlen_q=INT32_MAX, max_seqlen_k=MAXS, cu_seqlens_q=desc((33,), I32),
             cu_seqlens_k=desc((33,), I32))
    with pytest.raises(ValueError, match="max_seqlen_q = 2147483647"):
        op.check_support()


def test_scalar_product_limit_is_backward_only():
    """The forward takes alpha / 2 and 1 / scaling_seqlen separately; the backward also needs
    alpha / scaling_seqlen in float32."""
    fwd = HSTUFwdSm90(desc((T, H, D)), desc((T, HKV, D)), desc((T, HKV, D)), None,
                      desc((B + 1,), I32), desc((B + 1,), I32), MAXS, MAXS, alpha=3e38,
                      scaling_seqlen=1e-3)
    fwd.check_support()
    with pytest.raises(ValueError, match="alpha / scaling_seqlen = .* overflows float32"):
        bwd(alpha=3e38, scaling_seqlen=1e-3).check_support()
    # right at the limit is fine
    op = bwd(alpha=FLOAT32_MAX, scaling_seqlen=1.0).check_support()
    assert op._kernel_scalars(None, None, MAXS) == (FLOAT32_MAX / 2, FLOAT32_MAX, 1.0)


def test_kernel_scalars():
    op = bwd(alpha=0.5).check_support()
    assert op._kernel_scalars(None, None, MAXS) == (0.25, 0.5 / MAXS, 1 / MAXS)
    assert op._kernel_scalars(-4.0, 8.0, MAXS) == (-2.0, -0.5, 0.125)
    assert bwd(scaling_seqlen=10.0)._kernel_scalars(None, None, 99) == (0.5, 0.1, 0.1)
    assert op._kernel_scalars(None, None, 0) == (0.25, 0.5, 1.0)  # max_seqlen_q = 0


def test_compile_checks_first():
    op = bwd(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.compile(arch="sm_90a")
    assert not op.is_compiled
    with pytest.raises(NotImplementedError, match="HSTUBwdSm90 has kernels for sm_90a, not sm_80"):
        bwd().compile(arch="sm_80")


# --- the overlap rule: check_no_overlap and _share_elements -----------------------------------
def test_share_elements_equal_strides():
    x = torch.empty(T, H, 128, dtype=BF)
    assert not _share_elements(x[..., :64], x[..., 64:])     # column halves: disjoint
    assert not _share_elements(x[..., 64:], x[..., :64])     # either order
    assert _share_elements(x[..., :64], x[..., 32:96])       # overlapping columns
    assert _share_elements(x[..., 32:96], x[..., :64])
    assert _share_elements(x, x)
    assert not _share_elements(x[:T // 2], x[T // 2:])       # token halves
    assert _share_elements(x[:T // 2 + 1], x[T // 2:])       # one shared token
    kv = torch.empty(T, 2, H, D, dtype=BF)
    assert not _share_elements(kv[:, 0], kv[:, 1])           # interleaved dk, dv
    assert _share_elements(kv[:, 0], kv[:, 0])


def test_share_elements_different_shapes_same_strides():
    x = torch.empty(T, H, 128, dtype=BF)
    a, b = x[:10, :, :64], x[:, :, 64:]
    assert a.stride() == b.stride() and a.shape != b.shape
    assert not _share_elements(a, b) and not _share_elements(b, a)
    assert _share_elements(x[:10, :, :64], x[5:20, :, :32])  # tokens 5..9, columns 0..31
    assert not _share_elements(x[:, :2, :64], x[:, 2:, :32])  # other heads
    assert _share_elements(x[:, :3, :64], x[:, 2:, :32])      # head 2 in both
    assert not _share_elements(x[:10, :, :64], x[10:12, :, 32:40])  # later tokens only


def test_share_elements_is_conservative_otherwise():
    x = torch.empty(4, 128, dtype=BF)
    a = x[:, :64]
    # b reads only columns 64..127 (disjoint from a) but with other strides: counted as shared
    b = x.as_strided((4, 2, 32), (128, 32, 1), storage_offset=64)
    assert a.stride() != b.stride()
    assert _share_elements(a, b)
    # another element size
    assert _share_elements(a, x.view(torch.int32)[:, 32:])
    # broadcast (stride 0) views
    row = torch.empty(1, 64, dtype=BF)
    assert _share_elements(row.expand(4, 64), row.expand(4, 64))


def test_share_elements_gives_up_conservatively():
    """The bounded search answers True when it runs out of budget."""
    x = torch.empty(40000, dtype=BF)
    a = x.as_strided((64, 64), (8 * 64 + 8, 8), storage_offset=0)
    b = x.as_strided((64, 64), (8 * 64 + 8, 8), storage_offset=4)  # odd column: never shared
    from precast.lifecycle import validation
    assert not validation._offset_reachable(4, [(520, -63, 63), (8, -63, 63)], [4096])
    assert validation._offset_reachable(4, [(520, -63, 63), (8, -63, 63)], [0])
    assert not _share_elements(a, b)


def test_share_elements_is_exact_for_equal_strides():
    """Random equally strided views of one buffer against the brute-force element sets."""
    rng = random.Random(0)
    buf = torch.empty(4096, dtype=BF)
    checked = shared = 0
    for _ in range(1500):
        rank = rng.randint(1, 3)
        stride = tuple(rng.choice([1, 2, 3, 5, 8, 16, 24, 64, 100]) for _ in range(rank))
        shapes = [tuple(rng.randint(1, 5) for _ in range(rank)) for _ in range(2)]
        starts = [rng.randint(0, 200) for _ in range(2)]
        if any(o + 1 + sum((e - 1) * st for e, st in zip(sh, stride)) > buf.numel()
               for sh, o in zip(shapes, starts)):
            continue
        a, b = (buf.as_strided(sh, stride, o) for sh, o in zip(shapes, starts))
        elements = [{o + sum(i * st for i, st in zip(idx, stride))
                     for idx in itertools.product(*(range(e) for e in sh))}
                    for sh, o in zip(shapes, starts)]
        truth = bool(elements[0] & elements[1])
        assert _share_elements(a, b) == truth == _share_elements(b, a), (shapes, stride, starts)
        checked += 1
        shared += truth
    assert checked > 1000 and 0 < shared < checked


def test_check_no_overlap():
    kv = torch.empty(T, 2, H, D, dtype=BF)
    dk, dv = kv[:, 0], kv[:, 1]
    check_no_overlap([("dk", dk), ("dv", dv)], [])
    with pytest.raises(ValueError, match="dk overlaps dv in memory; outputs must not alias each "
                                         "other or the inputs"):
        check_no_overlap([("dk", dk), ("dv", dk)], [])
    x = torch.empty(T, H, 128, dtype=BF)
    check_no_overlap([("a", x[..., :64])], [("b", x[..., 64:])])
    with pytest.raises(ValueError, match="a overlaps b in memory"):
        check_no_overlap([("a", x[..., :64])], [("b", x[..., 32:96])])
    # inputs may alias each other; None and meta tensors never overlap anything
    check_no_overlap([("o", x[..., 64:])], [("i", x[..., :64]), ("j", x[..., :64]), ("n", None),
                                           ("m", meta(T, H, 128))])
    assert byte_range(meta(T, H, D)) is None
    # different strides with overlapping byte ranges: conservatively refused
    with pytest.raises(ValueError, match="a overlaps b"):
        check_no_overlap([("a", x[..., :64])],
                         [("b", x.as_strided((T, H, 2, 32), (H * 128, 128, 32, 1), 64))])
    # different strides, disjoint byte ranges: fine
    y = torch.empty(2 * T * H * 128, dtype=BF)
    check_no_overlap([("a", y[:T * H * 128].view(T, H, 128))],
                     [("b", y[T * H * 128:].view(T * H, 128)[:, :64])])


def relations(**kw):
    """CPU tensors for the relation rule: dq, dk, dv and the inputs, each its own buffer."""
    named = dict(do=torch.empty(T, H, D, dtype=BF), q=torch.empty(T, H, D, dtype=BF),
                 k=torch.empty(T, HKV, D, dtype=BF), v=torch.empty(T, HKV, D, dtype=BF),
                 dq=torch.empty(T, H, D, dtype=BF), dk=torch.empty(T, HKV, D, dtype=BF),
                 dv=torch.empty(T, HKV, D, dtype=BF), cu_seqlens_q=torch.zeros(B + 1, dtype=I32),
                 cu_seqlens_k=torch.zeros(B + 1, dtype=I32), func_tensor=None)
    return {**named, **kw}


def test_relations_accept_disjoint_views_of_one_buffer():
    """check_support and execute share this rule; on a CPU machine the per-tensor rules reject
    CPU tensors first, so the relation rule is called directly."""
    HSTUBwdSm90._check_relations(relations())
    kv = torch.empty(T, 2, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(dk=kv[:, 0], dv=kv[:, 1]))
    # dq, dk, dv as column slices of one (T, H + 2 H_kv, D) gradient buffer
    g = torch.empty(T, H + 2 * HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(dq=g[:, :H], dk=g[:, H:H + HKV], dv=g[:, H + HKV:]))
    # dk, dv beside k, v in one (T, 4, H_kv, D) buffer
    kvg = torch.empty(T, 4, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(k=kvg[:, 0], v=kvg[:, 1], dk=kvg[:, 2], dv=kvg[:, 3]))
    # inputs may alias each other (k = v)
    k = torch.empty(T, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(k=k, v=k))
    # column halves of one (T, H, 128) buffer
    x = torch.empty(T, H, 2 * D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(q=x[..., :D], dq=x[..., D:]))


@pytest.mark.parametrize("change,match", [
    (lambda r: dict(dv=r["dk"]), "dk overlaps dv in memory"),
    (lambda r: dict(dq=r["q"]), "dq overlaps q in memory; outputs must not alias"),
    (lambda r: dict(dq=r["do"]), "dq overlaps do in memory"),
    (lambda r: dict(dk=r["k"]), "dk overlaps k in memory"),
    (lambda r: dict(dv=r["v"]), "dv overlaps v in memory"),
    (lambda r: dict(dv=r["k"]), "dv overlaps k in memory"),
    (lambda r: dict(dk=r["dq"][:, :HKV]), "dq overlaps dk in memory"),
    (lambda r: dict(cu_seqlens_q=r["dv"].view(-1).view(I32)[:B + 1]), "dv overlaps cu_seqlens_q"),
    (lambda r: dict(func_tensor=r["dq"].view(-1).view(I32)[:8]), "dq overlaps func_tensor"),
])
def test_relations_refuse_aliasing_outputs(change, match):
    named = relations()
    with pytest.raises(ValueError, match=match):
        HSTUBwdSm90._check_relations({**named, **change(named)})


def test_relations_refuse_overlapping_views():
    kv = torch.empty(T, 2, HKV, D, dtype=BF)
    with pytest.raises(ValueError, match="dk overlaps dv in memory"):
        HSTUBwdSm90._check_relations(relations(dk=kv[:, 0], dv=kv[:, 0]))
    x = torch.empty(T, H, 2 * D, dtype=BF)
    with pytest.raises(ValueError, match="dq overlaps q in memory"):
        HSTUBwdSm90._check_relations(relations(q=x[..., :D], dq=x[..., D // 2:D // 2 + D]))
    buf = torch.empty(2 * T, HKV, D, dtype=BF)
    with pytest.raises(ValueError, match="dk overlaps k in memory"):  # one shared token
        HSTUBwdSm90._check_relations(relations(k=buf[:T], dk=buf[T - 1:2 * T - 1]))


def test_relations_one_device():
    with pytest.raises(ValueError, match="dq is on meta but do is on cpu; all tensors must be "
                                         "on one device"):
        HSTUBwdSm90._check_relations(relations(dq=meta(T, H, D)))


# --- static configuration and cache key -----------------------------------------------------------
STATIC_KEYS = {"dtype", "head_dim", "num_heads", "num_kv_heads", "window_left_bounded",
               "window_right_bounded", "func_intervals", "deterministic"}


def test_static_config_reads_the_samples():
    assert bwd().static_config() == {
        "dtype": "bfloat16", "head_dim": D, "num_heads": H, "num_kv_heads": HKV,
        "window_left_bounded": False, "window_right_bounded": False, "func_intervals": 0,
        "deterministic": False}
    assert set(bwd().static_config()) == STATIC_KEYS
    cfg = bwd(window_size=(7, 0), deterministic=True).static_config()
    assert cfg["window_left_bounded"] is True and cfg["window_right_bounded"] is True
    assert cfg["deterministic"] is True
    assert bwd(**FUNC).static_config()["func_intervals"] == 3
    cfg = bwd(**dims(256, FP, heads=8, kv_heads=1)).static_config()
    assert (cfg["dtype"], cfg["head_dim"], cfg["num_heads"], cfg["num_kv_heads"]) == (
        "float16", 256, 8, 1)


@pytest.mark.parametrize("config", [
    {}, dict(dtype="float16", head_dim=32), dict(head_dim=256),
    dict(head_dim=256, num_heads=8, num_kv_heads=1), dict(num_kv_heads=1),
    dict(window_left_bounded=True), dict(window_left_bounded=True, window_right_bounded=False),
    dict(window_right_bounded=False, func_intervals=1),
    dict(window_right_bounded=False, func_intervals=3), dict(deterministic=True),
    dict(dtype="float16", head_dim=256, deterministic=True, window_right_bounded=False,
         func_intervals=3),
])
def test_from_config_round_trip(config):
    op = HSTUBwdSm90.from_config(**config).check_support()
    cfg = op.static_config()
    assert set(cfg) == STATIC_KEYS
    for key, value in config.items():
        assert cfg[key] == value
    assert HSTUBwdSm90.from_config(**cfg).static_config() == cfg
    (entry,) = expand({"name": "HSTUBwdSm90", **cfg})
    assert dict(entry.config) == cfg
    assert op.kernel_modes() == (("dq", "dk", "dv") if cfg["head_dim"] == 256 else ("dq", "dkdv"))


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_left_bounded=1), TypeError, "window_left_bounded must be a bool, got int"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool, got int"),
    (dict(deterministic="yes"), TypeError, "deterministic must be a bool, got str"),
    (dict(func_intervals=1.0), TypeError, "func_intervals must be an int, got float"),
    (dict(func_intervals=-1), ValueError, "func_intervals must be >= 0, got -1"),
    (dict(dtype="float8"), TypeError, "unknown dtype 'float8'"),
])
def test_from_config_types(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUBwdSm90.from_config(**config)


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_right_bounded=False, func_intervals=2), ValueError, "n = 2 rows"),
    (dict(func_intervals=3), ValueError, "cannot be combined with a window mask"),
    (dict(num_heads=4, num_kv_heads=3), ValueError, "H_kv = 3"),
    (dict(head_dim=80), NotImplementedError, "head dim D = 80"),
    (dict(dtype="float32"), TypeError, "q: dtype float32 is not supported"),
])
def test_from_config_invalid_combinations(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUBwdSm90.from_config(**config).check_support()


@pytest.fixture
def fixed_sources(monkeypatch):
    # The cache key fingerprints the kernel sources; pin it so keys differ by config only.
    monkeypatch.setattr(op_mod, "source_fingerprint", lambda modules: "sources")


def key_of(op):
    return op.check_support().cache_key("sm_90a")


STATIC_CHANGES = {
    "dtype": dims(D, FP),
    "head_dim": dims(128),
    "num_heads": dict(do=desc((T, 2 * H, D)), q=desc((T, 2 * H, D))),
    "num_kv_heads": dict(k=desc((T, 1, D)), v=desc((T, 1, D))),
    "window_left_bounded": dict(window_size=(8, -1)),
    "window_right_bounded": dict(window_size=(-1, 0)),
    "func_intervals": FUNC,
    "deterministic": dict(deterministic=True),
}


@pytest.mark.parametrize("field", sorted(STATIC_CHANGES))
def test_cache_key_changes_with_each_static_field(fixed_sources, field):
    base, changed = bwd(), bwd(**STATIC_CHANGES[field])
    assert key_of(changed) != key_of(base)
    diff = {k for k, v in changed.static_config().items() if base.static_config()[k] != v}
    assert diff == {field}


def test_cache_key_differs_from_the_forward(fixed_sources):
    fwd = HSTUFwdSm90(desc((T, H, D)), desc((T, HKV, D)), desc((T, HKV, D)), None,
                      desc((B + 1,), I32), desc((B + 1,), I32), MAXS, MAXS)
    assert key_of(fwd) != key_of(bwd())


@pytest.mark.parametrize("kw", [
    dict(alpha=0.125), dict(alpha=-3.0), dict(scaling_seqlen=1000.0), dict(scaling_seqlen=1e-3),
    dict(max_seqlen_q=32, max_seqlen_k=64),
    dict(dims(D, t_q=4 * T, t_k=2 * T), max_seqlen_q=64, max_seqlen_k=64),
    dict(cu_seqlens_q=desc((2,), I32), cu_seqlens_k=desc((2,), I32), max_seqlen_q=T,
         max_seqlen_k=T),
    dict(q=desc((T, H, D), stride=(2 * H * D, D + 8, 1)),
         k=desc((T, HKV, D), stride=(D, T * D, 1))),
    dict(dq=desc((T, H, D), alignment=256), dk=desc((T, HKV, D), stride=(2 * HKV * D, D, 1))),
])
def test_cache_key_ignores_runtime_values(fixed_sources, kw):
    assert key_of(bwd(**kw)) == key_of(bwd())


@pytest.mark.parametrize("windows", [[(64, 0), (128, 0)], [(-1, 0), (-1, 7), (-1, 2**31 - 1)],
                                     [(0, 0), (5, 3), (100, 0)], [(3, -1), (0, -1)],
                                     [(-1, -1)]])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cache_key_ignores_window_values(fixed_sources, windows, deterministic):
    keys = {key_of(bwd(window_size=w, deterministic=deterministic)) for w in windows}
    assert len(keys) == 1


def test_cache_key_window_boundedness_and_determinism(fixed_sources):
    assert key_of(bwd(window_size=(64, 0))) == key_of(bwd(window_size=(128, 0)))
    assert key_of(bwd(window_size=(64, 0))) != key_of(bwd(window_size=(-1, 0)))
    assert key_of(bwd(window_size=(64, 0))) != key_of(bwd(window_size=(64, -1)))
    assert key_of(bwd(deterministic=True)) != key_of(bwd(deterministic=False))
    assert key_of(bwd(window_size=(64, 0), deterministic=True)) == key_of(
        bwd(window_size=(128, 0), deterministic=True, alpha=2.0, scaling_seqlen=3.0,
            max_seqlen_q=MAXS * 2, max_seqlen_k=MAXS * 4))


def test_func_intervals_are_static(fixed_sources):
    one = bwd(func=desc((1, 1, L), I32), window_size=(-1, -1))
    three = bwd(**FUNC)
    longer = bwd(func=desc((1, 3, 2 * L), I32), window_size=(-1, -1))
    assert key_of(one) != key_of(three) == key_of(longer)


# --- execute --------------------------------------------------------------------------------------
def meta_args(t_q=T, t_k=T, batch=B, heads=H, kv_heads=HKV, head_dim=D, dtype=BF):
    q_like = lambda: meta(t_q, heads, head_dim, dtype=dtype)  # noqa: E731
    kv_like = lambda: meta(t_k, kv_heads, head_dim, dtype=dtype)  # noqa: E731
    return dict(do=q_like(), q=q_like(), k=kv_like(), v=kv_like(), dq=q_like(), dk=kv_like(),
                dv=kv_like(), cu_seqlens_q=meta(batch + 1, dtype=I32),
                cu_seqlens_k=meta(batch + 1, dtype=I32))


EXECUTE_RULES = [
    # (id, bwd kwargs, changes to meta_args(), exception, match)
    ("do-missing", {}, dict(do=None), ValueError, "do is required"),
    ("dq-missing", {}, dict(dq=None), ValueError, "dq is required"),
    ("dk-missing", {}, dict(dk=None), ValueError, "dk is required"),
    ("dv-missing", {}, dict(dv=None), ValueError, "dv is required"),
    ("k-missing", {}, dict(k=None), ValueError, "k and v are required"),
    ("v-missing", {}, dict(v=None), ValueError, "k and v are required"),
    ("q-missing", {}, dict(q=None), TypeError, "expected a torch.Tensor or TensorDesc"),
    ("heads", {}, dict(q=meta(T, 2 * H, D)), ValueError,
     r"q: extent 8 on axis 1 does not match \(\*, 4, 64\)"),
    ("do-dtype", {}, dict(do=meta(T, H, D, dtype=FP)), TypeError,
     "do: dtype float16 is not supported; expected bfloat16"),
    ("dk-dtype", {}, dict(dk=meta(T, HKV, D, dtype=F32)), TypeError, "dk: dtype float32"),
    ("do-tokens", {}, dict(do=meta(T + 8, H, D)), ValueError, "do: has 72 tokens but q has 64"),
    ("dq-tokens", {}, dict(dq=meta(T - 8, H, D)), ValueError, "dq: has 56 tokens but q has 64"),
    ("dk-tokens", {}, dict(dk=meta(T + 8, HKV, D)), ValueError, "dk: has 72 tokens but k has 64"),
    ("dv-tokens", {}, dict(dv=meta(T + 8, HKV, D)), ValueError, "dv: has 72 tokens but k has 64"),
    ("dv-heads", {}, dict(dv=meta(T, H, D)), ValueError, r"dv: extent 4 on axis 1"),
    ("dq-last-dim-strided", {}, dict(dq=meta(T, H, 2 * D)[:, :, ::2]), ValueError,
     "dq: the last dimension must be contiguous"),
    ("dk-head-stride", {}, dict(dk=meta(T, HKV, D + 4)[:, :, :D]), ValueError,
     "dk: axis-1 stride 68 must be a multiple of 8"),
    ("cu-lengths", {}, dict(cu_seqlens_k=meta(B + 2, dtype=I32)), ValueError,
     "cu_seqlens_k: has 6 entries but cu_seqlens_q has 5"),
    ("cu-dtype", {}, dict(cu_seqlens_q=meta(B + 1, dtype=I64)), TypeError,
     "cu_seqlens_q: dtype int64"),
    ("cpu", {}, dict(dv=torch.zeros(T, HKV, D, dtype=BF)), ValueError, "dv: tensor is on cpu"),
    ("func-given", {}, dict(func_tensor=meta(1, 3, L, dtype=I32)), ValueError,
     "func_tensor must be None: this op applies no arbitrary mask"),
    ("func-missing", FUNC, {}, ValueError,
     r"func_tensor \(1, 3, L\) is required: this op applies an arbitrary mask"),
    ("func-n", FUNC, dict(func_tensor=meta(1, 5, L, dtype=I32)), ValueError,
     r"func_tensor: extent 5 on axis 1 does not match \(1, 3, \*\)"),
    ("func-columns", FUNC, dict(func_tensor=meta(1, 3, L - 1, dtype=I32)), ValueError,
     rf"func_tensor: L = {L - 1} columns; at least T_q \+ 256 = {L}"),
    ("max-seqlen-override", {}, dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max-seqlen-for-more-tokens", {}, dict(meta_args(t_q=2 * T)), ValueError,
     "max_seqlen_q = 16 is too small: 4 sequences hold T_q = 128 tokens"),
    ("max-seqlen-k-for-more-tokens", {}, dict(meta_args(t_k=2 * T)), ValueError,
     "max_seqlen_k = 16 is too small: 4 sequences hold T_k = 128 tokens"),
    ("max-seqlen-negative", {}, dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    ("alpha-override", {}, dict(alpha=math.inf), ValueError, "alpha must be finite"),
    ("scaling-override", {}, dict(scaling_seqlen=0.0), ValueError,
     "scaling_seqlen must be positive"),
    ("alpha-over-scaling-override", {}, dict(alpha=3e38, scaling_seqlen=1e-3), ValueError,
     "alpha / scaling_seqlen = .* overflows float32"),
]


@pytest.mark.parametrize("op_kw,changes,exc,match", [r[1:] for r in EXECUTE_RULES],
                         ids=[r[0] for r in EXECUTE_RULES])
def test_execute_refuses(op_kw, changes, exc, match):
    op = bwd(**op_kw).check_support()
    with pytest.raises(exc, match=match):
        op.execute(**{**meta_args(), **changes})


@pytest.fixture
def launches(monkeypatch):
    """Stands in for the loaded kernels: records each launch's mode and arguments."""
    recorder = types.SimpleNamespace(calls=[])

    def ready(self, device_index):
        return {mode: (lambda *args, mode=mode: recorder.calls.append((mode, args)))
                for mode in self.kernel_modes()}
    monkeypatch.setattr(Op, "_ready", ready)
    return recorder


def test_execute_launch_arguments(launches):
    op = bwd(window_size=(16, 0), alpha=0.5).check_support()
    a = meta_args()
    op.execute(**a, stream=7)
    assert [mode for mode, _ in launches.calls] == ["dq", "dkdv"]
    (_, dq_call), (_, dkdv_call) = launches.calls
    inputs = (a["q"], a["k"], a["v"], a["do"])
    assert dq_call[:4] == inputs and dkdv_call[:4] == inputs
    assert dq_call[4] is a["dq"] and dq_call[5] is None
    assert dkdv_call[4] is a["dk"] and dkdv_call[5] is a["dv"]
    assert dq_call[6:9] == (a["cu_seqlens_q"], a["cu_seqlens_k"], None)
    # longest, left, right, alpha / 2, alpha / scaling_seqlen, 1 / scaling_seqlen, stream
    assert dq_call[9:] == (MAXS, 16, 0, 0.25, 0.5 / MAXS, 1 / MAXS, 7)
    assert dkdv_call[9:] == (MAXS, 16, 0, 0.25, 0.5 / MAXS, 1 / MAXS, 7)
    # runtime values: another batch, alpha, scaling and max_seqlen, without a new op
    launches.calls.clear()
    op.execute(**meta_args(t_q=3 * T, t_k=5 * T, batch=2 * B), stream=7, alpha=-3.0,
               scaling_seqlen=4.0, max_seqlen_q=40, max_seqlen_k=80)
    assert launches.calls[0][1][9:] == (40, 16, 0, -1.5, -0.75, 0.25, 7)   # dq: max_q
    assert launches.calls[1][1][9:] == (80, 16, 0, -1.5, -0.75, 0.25, 7)   # dk, dv: max_k


def test_execute_head_dim_256_runs_three_kernels(launches):
    a = meta_args(head_dim=256)
    bwd(**dims(256)).check_support().execute(**a, stream=1)
    assert [mode for mode, _ in launches.calls] == ["dq", "dk", "dv"]
    calls = dict(launches.calls)
    assert calls["dq"][4] is a["dq"] and calls["dq"][5] is None
    assert calls["dk"][4] is a["dk"] and calls["dk"][5] is None
    assert calls["dv"][4] is None and calls["dv"][5] is a["dv"]


def test_execute_writes_disjoint_views_in_place(launches):
    kv = meta(T, 2, HKV, D)
    a = {**meta_args(), "dk": kv[:, 0], "dv": kv[:, 1]}
    op = HSTUBwdSm90(*(a[n] for n in ("do", "q", "k", "v", "dq", "dk", "dv", "cu_seqlens_q",
                                      "cu_seqlens_k")), MAXS, MAXS).check_support()
    op.execute(**a, stream=0)
    assert launches.calls[-1][1][4] is a["dk"] and launches.calls[-1][1][5] is a["dv"]


def test_execute_caps_wide_windows_and_passes_func(launches):
    bwd(window_size=(2**31 - 1, 2**30 + 5)).check_support().execute(**meta_args(), stream=1)
    assert launches.calls[-1][1][10:12] == (WINDOW_CAP, WINDOW_CAP)
    func = meta(1, 3, 2 * L, dtype=I32)  # wider than needed is fine
    bwd(**FUNC).check_support().execute(**meta_args(), func_tensor=func, stream=3)
    assert all(call[8] is func for _, call in launches.calls[-2:])
    assert launches.calls[-1][1][10:12] == (-1, -1)


@pytest.fixture
def zeroing(monkeypatch):
    """Stands in for the stream context the empty-batch path zeroes the gradients in:
    records the stream handle and each zeroed tensor."""
    recorder = types.SimpleNamespace(streams=[], zeroed=[])

    class ExternalStream:
        def __init__(self, handle, device=None):
            recorder.streams.append((handle, device))

    monkeypatch.setattr(torch.cuda, "ExternalStream", ExternalStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    zero_ = torch.Tensor.zero_

    def record_zero(t):
        recorder.zeroed.append(t)
        return zero_(t)
    monkeypatch.setattr(torch.Tensor, "zero_", record_zero)
    return recorder


@pytest.mark.parametrize("args,max_q,max_k", [
    (meta_args(t_q=0, t_k=0), 0, 0),
    (meta_args(t_q=0, t_k=T), 0, MAXS),     # dk, dv must still be written (zeros)
    (meta_args(t_q=T, t_k=0), MAXS, MAXS),  # dq must still be written (zeros)
])
def test_execute_empty_tokens_zero_every_gradient(launches, zeroing, args, max_q, max_k):
    op = bwd().check_support()
    op.execute(**args, stream=5, max_seqlen_q=max_q, max_seqlen_k=max_k)
    assert launches.calls == []  # no kernel: a memset on the stream
    assert zeroing.streams == [(5, None)]
    assert [id(t) for t in zeroing.zeroed] == [id(args[n]) for n in ("dq", "dk", "dv")]


def test_execute_no_sequence_writes_nothing(launches, zeroing):
    bwd().check_support().execute(**meta_args(batch=0), stream=0)
    assert launches.calls == [] and zeroing.zeroed == [] and zeroing.streams == []


def test_execute_checks_first_when_unchecked(launches):
    op = bwd(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.execute(**meta_args(), stream=0)
    assert launches.calls == []


# --- the kernel builder (fake arguments of the fixed kernel interface) ----------------------------
@pytest.fixture
def stub_kernel(monkeypatch):
    pytest.importorskip("cutlass")
    made = []

    class Kernel:
        def __init__(self, *args):
            made.append(args)

    module = types.ModuleType("precast.kernels.hstu_attention_bwd_sm90")
    module.HstuAttentionBackwardSm90 = Kernel
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return made


@pytest.mark.parametrize("config,none_args", [
    ({}, {"dq": (5, 8), "dkdv": (8,)}),
    (dict(head_dim=256, num_kv_heads=1), {"dq": (5, 8), "dk": (5, 8), "dv": (4, 8)}),
    (dict(window_right_bounded=False, func_intervals=3, num_kv_heads=2),
     {"dq": (5,), "dkdv": ()}),
])
def test_kernel_builder_arguments(stub_kernel, config, none_args):
    import cutlass
    op = HSTUBwdSm90.from_config(dtype="float16", **config).check_support()
    builders = op._kernel_builders()
    assert tuple(builders) == op.kernel_modes() == tuple(none_args)
    cfg = op.static_config()
    for mode, build in builders.items():
        kernel, args = build()
        assert stub_kernel[-1] == (cutlass.Float16, cfg["head_dim"], 4, cfg["num_kv_heads"],
                                   cfg["window_left_bounded"], cfg["window_right_bounded"],
                                   cfg["func_intervals"], mode)
        assert len(args) == 16
        assert tuple(i for i, a in enumerate(args) if a is None) == none_args[mode]
        q, k, v, do = args[:4]
        assert tuple(q.shape[1:]) == (4, cfg["head_dim"]) and q.stride[2] == 1
        assert tuple(k.shape[1:]) == (cfg["num_kv_heads"], cfg["head_dim"])
        assert q.shape[0] is do.shape[0] and k.shape[0] is v.shape[0]  # one T_q, one T_k
        assert args[6].shape[0] is args[7].shape[0]  # B + 1 entries in both cu_seqlens
        grads = [g for g in args[4:6] if g is not None]
        expected_tokens = q.shape[0] if mode == "dq" else k.shape[0]
        assert all(g.shape[0] is expected_tokens for g in grads)
        if cfg["func_intervals"]:
            assert tuple(args[8].shape[:2]) == (1, 3) and args[8].stride[2] == 1


# --- the allocating function and the custom ops ---------------------------------------------------
@pytest.fixture
def no_compile(monkeypatch, launches):
    def compile(self, arch=None, cache=None):
        self._kernels, self._arch = {}, "sm_90a"
        return self
    monkeypatch.setattr(Op, "compile", compile)
    return launches


def backward_args(**kw):
    a = meta_args()
    for name in ("dq", "dk", "dv"):
        del a[name]
    return {**a, "max_seqlen_q": MAXS, "max_seqlen_k": MAXS, "stream": 0, **kw}


def test_allocating_backward(no_compile):
    r = hstu_attention_backward(**backward_args(alpha=2.0))
    dq, dk, dv = r
    assert r.dq_tensor is dq and r["dk_tensor"] is dk and r.dv_tensor is dv
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, HKV, D)
    assert dq.dtype == dk.dtype == dv.dtype == BF
    assert [m for m, _ in no_compile.calls] == ["dq", "dkdv"]
    call = no_compile.calls[0][1]
    assert call[4] is dq and call[9:11] == (MAXS, -1) and call[11] == 0  # causal by default
    assert len(COMPILED_OPS._ops) == 1
    # runtime values reuse the op; deterministic is static
    hstu_attention_backward(**backward_args(alpha=0.5, scaling_seqlen=2.0))
    assert len(COMPILED_OPS._ops) == 1
    hstu_attention_backward(**backward_args(deterministic=True))
    assert len(COMPILED_OPS._ops) == 2
    # supplied gradient buffers (dk, dv split from one packed buffer) are written in place
    kv = meta(T, 2, HKV, D)
    r = hstu_attention_backward(**backward_args(), dk_tensor=kv[:, 0], dv_tensor=kv[:, 1])
    dk, dv = no_compile.calls[-1][1][4:6]
    assert dk is r.dk_tensor and dv is r.dv_tensor
    assert dk.shape == dv.shape == (T, HKV, D) and dk.stride() == kv[:, 0].stride()


def test_allocating_backward_validates(no_compile):
    with pytest.raises(ValueError, match="q: tensor is on cpu"):
        hstu_attention_backward(**backward_args(q=torch.zeros(T, H, D, dtype=BF)))
    with pytest.raises(NotImplementedError, match="head dim D = 48"):
        hstu_attention_backward(**backward_args(q=meta(T, H, 48), do=meta(T, H, 48)))
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        hstu_attention_backward(**backward_args(window_size=(-3, 0)))
    with pytest.raises(ValueError, match="dk: has 72 tokens but k has 64"):
        hstu_attention_backward(**backward_args(), dk_tensor=meta(T + 8, HKV, D))
    assert COMPILED_OPS._ops == {}  # nothing invalid is cached


def test_custom_ops_are_registered():
    assert hasattr(torch.ops.precast, "hstu_attention")
    assert hasattr(torch.ops.precast, "hstu_attention_bwd")
    assert hasattr(torch.ops.precast, "hstu_attention_fwd")


@pytest.mark.parametrize("kv_heads", [HKV, H, 1])
def test_custom_op_fakes_give_shapes(kv_heads):
    q, do = meta(T, H, D), meta(T, H, D)
    k, v = meta(2 * T, kv_heads, D), meta(2 * T, kv_heads, D)
    cu = meta(B + 1, dtype=I32)
    o = torch.ops.precast.hstu_attention(q, k, v, cu, cu, MAXS, 2 * MAXS, None, -1, 0, 1.0,
                                         None, False)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta"
    dq, dk, dv = torch.ops.precast.hstu_attention_bwd(do, q, k, v, cu, cu, MAXS, 2 * MAXS, None,
                                                      -1, 0, 1.0, None, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == BF
    assert {t.device.type for t in (dq, dk, dv)} == {"meta"}


def test_custom_op_autograd_reaches_the_backward_fake():
    q, k, v = (t.requires_grad_() for t in (meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D)))
    cu = meta(B + 1, dtype=I32)
    o = precast.hstu_attention(q, k, v, cu, cu, MAXS, MAXS, window_size=(-1, -1), alpha=0.5,
                               deterministic=True)
    assert o.shape == (T, H, D) and o.requires_grad
    o.backward(meta(T, H, D))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_custom_op_fakes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, do = torch.empty(T, H, D, dtype=BF), torch.empty(T, H, D, dtype=BF)
        k, v = torch.empty(T, HKV, D, dtype=BF), torch.empty(T, HKV, D, dtype=BF)
        cu = torch.empty(B + 1, dtype=I32)
        dq, dk, dv = torch.ops.precast.hstu_attention_bwd(do, q, k, v, cu, cu, MAXS, MAXS, None,
                                                          -1, 0, 1.0, None, False)
        o = torch.ops.precast.hstu_attention(q, k, v, cu, cu, MAXS, MAXS, None, -1, 0, 1.0,
                                             None, False)
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, HKV, D) and o.shape == (T, H, D)
