"""Every check_support() rule of the LMSD ops, the shared validation helpers, the build target
and Results -- all on a CPU machine (ops are built from TensorDescs, meta or CPU tensors)."""
import math

import numpy as np
import pytest
import torch

from precast import HstuLmsdBwdSm90, HstuLmsdFwdSm90, TensorDesc
from precast.lifecycle import arch as arch_mod
from precast.lifecycle.arch import normalize_arch, target_arch
from precast.lifecycle.lmsd import MAX_ROW_ELEMENTS, ROW_SPAN_LIMIT
from conftest import isolate_from_kernels
from precast.lifecycle.results import Results, results_type
from precast.lifecycle.validation import (INT32_MAX, byte_range, check_finite, check_int64,
                                          check_no_overlap, check_same_device, check_tensor)

BF, FP, F32, I8 = torch.bfloat16, torch.float16, torch.float32, torch.int8
N, D = 32, 64


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing here may build kernels: point the default cache at a temp dir and make any
    attempt to load kernels for execute() fail loudly."""
    isolate_from_kernels(monkeypatch, tmp_path)

def desc(shape, dtype=BF, stride=None, alignment=16, device="cuda"):
    return TensorDesc(dtype, shape, stride, device, alignment)


def fwd(x=None, u=None, weight=None, bias=None, y=None, mean=None, rstd=None, mask=None, **kw):
    x = desc((N, D)) if x is None else x
    dim = x.shape[-1] if x.ndim else 0
    n = x.shape[0] if x.ndim else 0
    return HstuLmsdFwdSm90(x, desc((n, dim), x.dtype) if u is None else u,
                           desc((dim,), x.dtype) if weight is None else weight,
                           desc((dim,), x.dtype) if bias is None else bias, y, mean, rstd, mask,
                           **kw)


def seg(kw):
    return 1 + int(bool(kw.get("concat_u", False))) + int(bool(kw.get("concat_x", False)))


def bwd(dy=None, x=None, u=None, weight=None, bias=None, mean=None, rstd=None, mask=None,
        dx=None, du=None, dweight=None, dbias=None, **kw):
    x = desc((N, D)) if x is None else x
    dim, n = x.shape[-1], x.shape[0]
    dt = x.dtype
    if mask is None and float(kw.get("dropout_ratio", 0.0)) != 0.0 and not kw.pop("no_mask", False):
        mask = desc((n, dim), I8)
    kw.pop("no_mask", None)
    return HstuLmsdBwdSm90(
        desc((n, seg(kw) * dim), dt) if dy is None else dy, x,
        desc((n, dim), dt) if u is None else u, desc((dim,), dt) if weight is None else weight,
        desc((dim,), dt) if bias is None else bias, desc((n,), F32) if mean is None else mean,
        desc((n,), F32) if rstd is None else rstd, mask, dx, du, dweight, dbias, **kw)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --- valid configurations -----------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {}, {"dropout_ratio": 0.1}, {"concat_u": True, "concat_x": True, "dropout_ratio": 0.5},
    {"apply_u_silu": False}, {"apply_u_silu": np.bool_(True)}, {"eps": 1e-12},
])
def test_fwd_valid_configurations(kw):
    op = fwd(**kw).check_support()
    assert op._checked
    assert op.static_config()["dropout"] == (float(kw.get("dropout_ratio", 0)) != 0)
    assert op.y.shape == (N, seg(kw) * D)


@pytest.mark.parametrize("dim", [8, 16, 520, 4096])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_supported_dims_and_dtypes(dim, dtype):
    x = desc((N, dim), dtype)
    fwd(x=x).check_support()
    bwd(x=x).check_support()


def test_padded_rows_and_other_row_counts_are_valid():
    # padded row strides (multiple of 8) and an empty batch are valid
    x = desc((N, D), stride=(D + 8, 1))
    fwd(x=x, u=desc((N, D), stride=(D + 16, 1))).check_support()
    fwd(x=desc((0, D))).check_support()
    fwd(x=desc((1, D), stride=(3, 1))).check_support()  # a single row has no row stride rule


def test_bwd_valid_configurations():
    bwd().check_support()
    bwd(dropout_ratio=0.3, concat_u=True).check_support()
    op = bwd(compute_dweight=False).check_support()
    assert op.dweight is None
    bwd(dweight=desc((D,), alignment=2), dbias=desc((D,), alignment=2)).check_support()


def test_from_config_round_trip():
    for cls in (HstuLmsdFwdSm90, HstuLmsdBwdSm90):
        op = cls.from_config(dtype="fp16", dim=256, concat_u=True, dropout=False)
        op.check_support()
        cfg = op.static_config()
        assert cfg["dtype"] == "float16" and cfg["dim"] == 256 and cfg["concat_u"] is True
        assert cfg["dropout"] is False
        assert cls.from_config(**cfg).static_config() == cfg


# --- meta and CPU tensors ----------------------------------------------------------------------
def test_meta_tensors_are_accepted():
    op = HstuLmsdFwdSm90(meta(N, D), meta(N, D), meta(D), meta(D))
    op.check_support()
    assert op.x.device == "meta"
    # with every output given as a meta tensor too (meta tensors own no memory, no overlap)
    HstuLmsdFwdSm90(meta(N, D), meta(N, D), meta(D), meta(D), meta(N, 2 * D),
                    meta(N, dtype=F32), meta(N, dtype=F32), meta(N, D, dtype=I8),
                    dropout_ratio=0.2, concat_u=True).check_support()
    HstuLmsdBwdSm90(meta(N, D), meta(N, D), meta(N, D), meta(D), meta(D), meta(N, dtype=F32),
                    meta(N, dtype=F32), None, meta(N, D), meta(N, D), meta(D),
                    meta(D)).check_support()


def test_cpu_tensors_are_rejected():
    cpu = torch.zeros(N, D, dtype=BF)
    with pytest.raises(ValueError, match="x: tensor is on cpu; expected a cuda tensor"):
        HstuLmsdFwdSm90(cpu, meta(N, D), meta(D), meta(D)).check_support()
    with pytest.raises(ValueError, match="weight: tensor is on cpu"):
        HstuLmsdFwdSm90(meta(N, D), meta(N, D), torch.zeros(D, dtype=BF), meta(D)).check_support()
    with pytest.raises(ValueError, match="dy: tensor is on cpu"):
        HstuLmsdBwdSm90(torch.zeros(N, D, dtype=BF), meta(N, D), meta(N, D), meta(D), meta(D),
                        meta(N, dtype=F32), meta(N, dtype=F32)).check_support()
    with pytest.raises(ValueError, match="tensor is on cpu"):
        fwd(x=desc((N, D), device="cpu")).check_support()


# --- forward rules -----------------------------------------------------------------------------
FWD_RULES = [
    # (id, builder kwargs, exception, message fragment)
    ("x-dtype-fp32", dict(x=desc((N, D), F32)), TypeError, "x: dtype float32 is not supported"),
    ("x-dtype-int8", dict(x=desc((N, D), I8)), TypeError, "expected bfloat16 or float16"),
    ("u-dtype-mismatch", dict(u=desc((N, D), FP)), TypeError,
     "u: dtype float16 is not supported; expected bfloat16"),
    ("weight-dtype", dict(weight=desc((D,), F32)), TypeError, "weight: dtype float32"),
    ("bias-dtype", dict(bias=desc((D,), FP)), TypeError, "bias: dtype float16"),
    ("y-dtype", dict(y=desc((N, D), FP)), TypeError, "y: dtype float16"),
    ("x-rank-3", dict(x=desc((2, N, D)), u=desc((2, D))), ValueError,
     r"x: expected a rank-2 tensor of shape \(\*, 64\), got shape \[2, 32, 64\]"),
    ("x-rank-1", dict(x=desc((D,)), u=desc((D, D))), ValueError, "x: expected a rank-2"),
    ("u-rank", dict(u=desc((N, D, 1))), ValueError, "u: expected a rank-2"),
    ("weight-rank", dict(weight=desc((1, D))), ValueError, "weight: expected a rank-1"),
    ("weight-length", dict(weight=desc((D + 8,))), ValueError,
     r"weight: extent 72 on axis 0 does not match \(64\)"),
    ("bias-length", dict(bias=desc((D - 8,))), ValueError, "bias: extent 56 on axis 0"),
    ("u-width", dict(u=desc((N, D + 8))), ValueError, "u: extent 72 on axis 1"),
    ("D-not-multiple-of-8", dict(x=desc((N, 60))), ValueError, "D = 60 must be a multiple of 8"),
    ("D-odd", dict(x=desc((N, 4097))), ValueError, "D = 4097 must be a multiple of 8"),
    ("D-below-8", dict(x=desc((N, 0))), ValueError, "D = 0 must be at least 8"),
    ("D-above-4096", dict(x=desc((N, 4104))), NotImplementedError,
     "D = 4104 is above the supported maximum 4096"),
    ("x-last-stride", dict(x=desc((N, D), stride=(2 * D, 2))), ValueError,
     r"x: the last dimension must be contiguous \(stride 1\)"),
    ("u-last-stride", dict(u=desc((N, D), stride=(D, 2))), ValueError,
     "u: the last dimension must be contiguous"),
    ("x-row-stride-multiple", dict(x=desc((N, D), stride=(D + 4, 1))), ValueError,
     "x: row stride 68 must be a multiple of 8"),
    ("y-row-stride-multiple", dict(y=desc((N, D), stride=(D + 2, 1))), ValueError,
     "y: row stride 66 must be a multiple of 8"),
    ("x-row-stride-too-small", dict(x=desc((N, D), stride=(D - 8, 1))), ValueError,
     "x: row stride 56 is smaller than the row length 64: rows would overlap"),
    ("x-alignment", dict(x=desc((N, D), alignment=8)), ValueError,
     "x: base address is 8-byte aligned; 16-byte alignment is required"),
    ("u-alignment", dict(u=desc((N, D), alignment=2)), ValueError, "u: base address is 2-byte"),
    ("weight-alignment", dict(weight=desc((D,), alignment=4)), ValueError,
     "weight: base address is 4-byte"),
    ("y-alignment", dict(y=desc((N, D), alignment=8)), ValueError, "y: base address is 8-byte"),
    ("weight-not-contiguous", dict(weight=desc((D,), stride=(2,))), ValueError,
     "weight: the last dimension must be contiguous"),
    ("u-rows", dict(u=desc((N + 1, D))), ValueError, "u: has 33 rows but x has 32"),
    ("y-rows", dict(y=desc((N - 1, D))), ValueError, "y: has 31 rows but x has 32"),
    ("y-width", dict(y=desc((N, D)), concat_u=True), ValueError,
     r"y: extent 64 on axis 1 does not match \(\*, 128\)"),
    ("y-width-3-segments", dict(y=desc((N, 2 * D)), concat_u=True, concat_x=True), ValueError,
     r"y: extent 128 on axis 1 does not match \(\*, 192\)"),
    ("mean-dtype", dict(mean=desc((N,), BF)), TypeError,
     "mean: dtype bfloat16 is not supported; expected float32"),
    ("rstd-dtype", dict(rstd=desc((N,), torch.float64)), TypeError, "rstd: dtype float64"),
    ("mean-rows", dict(mean=desc((N - 1,), F32)), ValueError, "mean: has 31 rows but x has 32"),
    ("rstd-rows", dict(rstd=desc((N + 8,), F32)), ValueError, "rstd: has 40 rows but x has 32"),
    ("mean-rank", dict(mean=desc((N, 1), F32)), ValueError, "mean: expected a rank-1"),
    ("mean-strided", dict(mean=desc((N,), F32, stride=(2,))), ValueError,
     "mean: the last dimension must be contiguous"),
    ("mean-alignment", dict(mean=desc((N,), F32, alignment=2)), ValueError,
     "mean: base address is 2-byte aligned; 4-byte alignment is required"),
    ("mask-dtype", dict(mask=desc((N, D), torch.uint8), dropout_ratio=0.1), TypeError,
     "mask: dtype uint8 is not supported; expected int8"),
    ("mask-bool", dict(mask=desc((N, D), torch.bool), dropout_ratio=0.1), TypeError,
     "mask: dtype bool"),
    ("mask-width", dict(mask=desc((N, D + 8), I8), dropout_ratio=0.1), ValueError,
     r"mask: extent 72 on axis 1 does not match \(\*, 64\)"),
    ("mask-rows", dict(mask=desc((N - 1, D), I8), dropout_ratio=0.1), ValueError,
     "mask: has 31 rows but x has 32"),
    ("mask-rank", dict(mask=desc((N * D,), I8), dropout_ratio=0.1), ValueError,
     "mask: expected a rank-2"),
    ("mask-padded", dict(mask=desc((N, D), I8, stride=(D + 16, 1)), dropout_ratio=0.1),
     ValueError, r"mask: must be contiguous \(strides \[64, 1\]\)"),
    ("mask-without-dropout", dict(mask=desc((N, D), I8)), ValueError,
     "mask must be None when dropout_ratio == 0"),
    ("eps-zero", dict(eps=0.0), ValueError, "eps must be positive, got 0.0"),
    ("eps-negative", dict(eps=-1e-5), ValueError, "eps must be positive"),
    ("eps-nan", dict(eps=math.nan), ValueError, "eps must be finite, got nan"),
    ("eps-inf", dict(eps=math.inf), ValueError, "eps must be finite, got inf"),
    ("eps-string", dict(eps="small"), TypeError, "eps must be a real number, got str"),
    ("eps-none", dict(eps=None), TypeError, "eps must be a real number, got NoneType"),
    ("eps-numeric-string", dict(eps="1e-5"), TypeError, "eps must be a real number, got str"),
    ("dropout-negative", dict(dropout_ratio=-0.1), ValueError,
     "dropout_ratio must be >= 0.0, got -0.1"),
    ("dropout-one", dict(dropout_ratio=1.0), ValueError,
     "dropout_ratio must be < 1 after float32 conversion, got 1.0"),
    ("dropout-above-one", dict(dropout_ratio=1.5), ValueError, "dropout_ratio must be < 1"),
    ("dropout-rounds-to-one", dict(dropout_ratio=0.99999999), ValueError,
     "dropout_ratio must be < 1 after float32 conversion, got 0.99999999"),
    ("dropout-nan", dict(dropout_ratio=math.nan), ValueError, "dropout_ratio must be finite"),
    ("dropout-inf", dict(dropout_ratio=math.inf), ValueError, "dropout_ratio must be finite"),
    ("dropout-string", dict(dropout_ratio="0.5"), TypeError, "dropout_ratio must be a real number"),
    ("apply_u_silu-int", dict(apply_u_silu=1), TypeError, "apply_u_silu must be a bool, got int"),
    ("concat_u-str", dict(concat_u="yes"), TypeError, "concat_u must be a bool, got str"),
    ("concat_x-none", dict(concat_x=None), TypeError, "concat_x must be a bool, got NoneType"),
    ("x-rows-times-D", dict(x=desc((MAX_ROW_ELEMENTS // 1024 + 1, 1024))), ValueError,
     rf"x: N \* D = {MAX_ROW_ELEMENTS // 1024 + 1} \* 1024 exceeds 2\^31 elements"),
    ("y-span-padded", dict(y=desc((N, D), stride=((ROW_SPAN_LIMIT // (N - 1) // 8 + 1) * 8, 1))),
     ValueError, rf"y: spans \d+ elements; at most {ROW_SPAN_LIMIT} are supported"),
    ("u-span-padded", dict(u=desc((2, D), stride=(ROW_SPAN_LIMIT, 1))), ValueError, "u: spans"),
    ("mask-span", dict(x=desc((MAX_ROW_ELEMENTS // 1024, 1024)), dropout_ratio=0.5), ValueError,
     rf"mask: spans {MAX_ROW_ELEMENTS} elements; at most {INT32_MAX} are supported"),
    ("grid-does-not-fit", dict(x=desc((N, 4096)), min_ctas_per_sm=9), ValueError,
     r"min_ctas_per_sm = 9 puts 2304 threads on an SM \(256 per CTA at D = 4096\); the "
     "persistent forward grid must fit at once: at most 8"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in FWD_RULES], ids=[r[0] for r in FWD_RULES])
def test_fwd_rule(kw, exc, match):
    op = fwd(**kw)
    with pytest.raises(exc, match=match):
        op.check_support()
    assert not op._checked


def test_dropout_just_below_one_in_float32_is_accepted():
    below = float(np.nextafter(np.float32(1.0), np.float32(0.0)))
    assert np.float32(below) < 1.0
    fwd(dropout_ratio=below).check_support()
    assert np.float32(0.99999999) == 1.0  # why the rule exists


def test_span_boundaries():
    # N * D up to 2^31 row elements; padded row tensors index with 64-bit strides
    rows = MAX_ROW_ELEMENTS // 1024
    fwd(x=desc((rows, 1024))).check_support()
    with pytest.raises(ValueError, match="exceeds 2\\^31 elements"):
        fwd(x=desc((rows + 1, 1024))).check_support()
    # a padded row stride whose span exceeds 2^31 - 1 but not the 64-bit limit is fine
    big = desc((N, D), stride=(2**27, 1))
    assert INT32_MAX < big.span_elements() <= ROW_SPAN_LIMIT
    fwd(x=big).check_support()
    edge = desc((2, D), stride=(ROW_SPAN_LIMIT - D, 1))
    assert edge.span_elements() == ROW_SPAN_LIMIT
    fwd(y=edge, x=desc((2, D))).check_support()
    with pytest.raises(ValueError, match="y: spans"):
        fwd(y=desc((2, D), stride=(ROW_SPAN_LIMIT - D + 8, 1)), x=desc((2, D))).check_support()


def test_compile_checks_first():
    op = fwd(eps=-1.0)
    with pytest.raises(ValueError, match="eps must be positive"):
        op.compile(arch="sm_90a")
    assert not op.is_compiled


# --- backward rules ----------------------------------------------------------------------------
BWD_RULES = [
    ("x-dtype", dict(x=desc((N, D), F32)), TypeError, "x: dtype float32 is not supported"),
    ("dy-dtype", dict(dy=desc((N, D), FP)), TypeError, "dy: dtype float16"),
    ("dy-width", dict(dy=desc((N, D)), concat_x=True), ValueError,
     r"dy: extent 64 on axis 1 does not match \(\*, 128\)"),
    ("dy-width-3", dict(dy=desc((N, 2 * D)), concat_u=True, concat_x=True), ValueError,
     r"dy: extent 128 on axis 1 does not match \(\*, 192\)"),
    ("dy-rows", dict(dy=desc((N + 1, D))), ValueError, "dy: has 33 rows but x has 32"),
    ("dy-alignment", dict(dy=desc((N, D), alignment=4)), ValueError, "dy: base address is 4-byte"),
    ("dy-row-stride", dict(dy=desc((N, D), stride=(D + 1, 1))), ValueError,
     "dy: row stride 65 must be a multiple of 8"),
    ("u-rows", dict(u=desc((N - 1, D))), ValueError, "u: has 31 rows"),
    ("u-dtype", dict(u=desc((N, D), FP)), TypeError, "u: dtype float16"),
    ("weight-length", dict(weight=desc((D * 2,))), ValueError, "weight: extent 128 on axis 0"),
    ("mean-dtype", dict(mean=desc((N,), BF)), TypeError, "mean: dtype bfloat16"),
    ("rstd-rows", dict(rstd=desc((N - 1,), F32)), ValueError, "rstd: has 31 rows"),
    ("mask-missing", dict(dropout_ratio=0.1, no_mask=True), ValueError,
     "mask_tensor is required when dropout_ratio > 0"),
    ("mask-without-dropout", dict(mask=desc((N, D), I8)), ValueError,
     "mask must be None when dropout_ratio == 0"),
    ("mask-dtype", dict(mask=desc((N, D), BF), dropout_ratio=0.1), TypeError,
     "mask: dtype bfloat16 is not supported; expected int8"),
    ("mask-rows", dict(mask=desc((N + 1, D), I8), dropout_ratio=0.1), ValueError,
     "mask: has 33 rows"),
    ("dx-rows", dict(dx=desc((N - 1, D))), ValueError, "dx: has 31 rows but x has 32"),
    ("dx-dtype", dict(dx=desc((N, D), F32)), TypeError, "dx: dtype float32"),
    ("du-width", dict(du=desc((N, 2 * D))), ValueError, "du: extent 128 on axis 1"),
    ("du-last-stride", dict(du=desc((N, D), stride=(2 * D, 2))), ValueError,
     "du: the last dimension must be contiguous"),
    ("dx-alignment", dict(dx=desc((N, D), alignment=8)), ValueError, "dx: base address is 8-byte"),
    ("dweight-with-compute-false", dict(compute_dweight=False, dweight=desc((D,))), ValueError,
     "dweight must be None when compute_dweight=False"),
    ("dweight-length", dict(dweight=desc((D + 8,))), ValueError, "dweight: extent 72 on axis 0"),
    ("dweight-alignment", dict(dweight=desc((D,), alignment=1)), ValueError,
     "dweight: base address is 1-byte aligned; 2-byte"),
    ("dbias-dtype", dict(dbias=desc((D,), F32)), TypeError, "dbias: dtype float32"),
    ("dbias-strided", dict(dbias=desc((D,), stride=(2,))), ValueError,
     "dbias: the last dimension must be contiguous"),
    ("compute_dweight-int", dict(compute_dweight=1), TypeError,
     "compute_dweight must be a bool, got int"),
    ("compute_dweight-none", dict(compute_dweight=None), TypeError,
     "compute_dweight must be a bool, got NoneType"),
    ("apply_u_silu-str", dict(apply_u_silu="no"), TypeError, "apply_u_silu must be a bool"),
    ("concat_x-float", dict(concat_x=1.0), TypeError, "concat_x must be a bool, got float"),
    ("dropout-negative", dict(dropout_ratio=-0.5, mask=desc((N, D), I8)), ValueError,
     "dropout_ratio must be >= 0.0"),
    ("dropout-rounds-to-one", dict(dropout_ratio=0.99999999, mask=desc((N, D), I8)), ValueError,
     "dropout_ratio must be < 1 after float32 conversion"),
    ("dropout-nan", dict(dropout_ratio=math.nan, mask=desc((N, D), I8)), ValueError,
     "dropout_ratio must be finite"),
    ("D-not-multiple", dict(x=desc((N, 100))), ValueError, "D = 100 must be a multiple of 8"),
    ("D-above-4096", dict(x=desc((N, 8192))), NotImplementedError, "above the supported maximum"),
    ("x-rows-times-D", dict(x=desc((MAX_ROW_ELEMENTS // 512 + 1, 512))), ValueError,
     r"x: N \* D = \d+ \* 512 exceeds 2\^31 elements"),
    ("dy-span-padded", dict(dy=desc((2, D), stride=(ROW_SPAN_LIMIT, 1))), ValueError, "dy: spans"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in BWD_RULES], ids=[r[0] for r in BWD_RULES])
def test_bwd_rule(kw, exc, match):
    op = bwd(**kw)
    with pytest.raises(exc, match=match):
        op.check_support()
    assert not op._checked


# --- rules only execute() can see (descriptors fill in defaults at construction) ------------------
def fwd_meta_tensors(dropout=False, concat=False):
    s = 2 if concat else 1
    return dict(x=meta(N, D), u=meta(N, D), weight=meta(D), bias=meta(D), y=meta(N, s * D),
                mean=meta(N, dtype=F32), rstd=meta(N, dtype=F32),
                mask=meta(N, D, dtype=I8) if dropout else None)


def test_fwd_execute_requires_mask_with_dropout():
    op = fwd(dropout_ratio=0.25)
    assert op.mask is not None  # the descriptor op invents the mask output...
    op.check_support()
    t = fwd_meta_tensors(dropout=True)
    t["mask"] = None  # ...but execute() must be given one
    with pytest.raises(ValueError, match="mask_tensor is required when dropout_ratio > 0"):
        op.execute(**t)


@pytest.mark.parametrize("seed,exc,match", [
    (2**63, ValueError, "seed must fit in a signed 64-bit integer"),
    (-2**63 - 1, ValueError, "seed must fit in a signed 64-bit integer"),
    (1.5, TypeError, "seed must be an int, got float"),
    (True, TypeError, "seed must be an int, got bool"),
    ("7", TypeError, "seed must be an int, got str"),
])
def test_fwd_execute_seed(seed, exc, match):
    op = fwd(dropout_ratio=0.5).check_support()
    with pytest.raises(exc, match=match):
        op.execute(**fwd_meta_tensors(dropout=True), seed=seed)


@pytest.mark.parametrize("kw,op_kw,match", [
    (dict(eps=0.0), {}, "eps must be positive"),
    (dict(eps=math.nan), {}, "eps must be finite"),
    (dict(dropout_ratio=0.0), dict(dropout_ratio=0.5),
     "compiled with dropout: dropout_ratio must stay > 0"),
    (dict(dropout_ratio=1.0), dict(dropout_ratio=0.5), "dropout_ratio must be < 1"),
    (dict(dropout_ratio=0.3), {}, "compiled without dropout: dropout_ratio must be 0"),
])
def test_fwd_execute_scalars(kw, op_kw, match):
    op = fwd(**op_kw).check_support()
    with pytest.raises(ValueError, match=match):
        op.execute(**fwd_meta_tensors(dropout=op.use_dropout), **kw)


def test_fwd_execute_revalidates_tensors():
    op = fwd().check_support()
    t = fwd_meta_tensors()
    t["y"] = meta(N + 1, D)
    with pytest.raises(ValueError, match="y: has 33 rows but x has 32"):
        op.execute(**t)
    t = fwd_meta_tensors()
    t["x"] = meta(N, 2 * D)
    with pytest.raises(ValueError, match=r"x: extent 128 on axis 1 does not match \(\*, 64\)"):
        op.execute(**t)


@pytest.mark.parametrize("workspace, error, match", [
    (torch.zeros(3, dtype=torch.int32, device="meta"), ValueError, r"workspace: extent 3 on axis 0"),
    (torch.zeros(2, dtype=torch.int64, device="meta"), TypeError, "workspace: dtype int64"),
    (torch.zeros(2, 2, dtype=torch.int32, device="meta"), ValueError, "workspace"),
    (torch.zeros(4, dtype=torch.int32, device="meta")[::2], ValueError,
     "workspace: the last dimension must be contiguous"),
])
def test_fwd_execute_rejects_bad_workspaces(workspace, error, match):
    with pytest.raises(error, match=match):
        fwd().check_support().execute(**fwd_meta_tensors(), workspace=workspace)


def test_fwd_execute_launch_arguments(monkeypatch):
    """The scheduler counter: the caller's when given, else the op's own for (device,
    stream); the grid is the SMs' CTAs, or fewer for few rows."""
    import types
    from precast.lifecycle import lmsd as lmsd_mod
    from precast.lifecycle.op import Op
    calls, owned = [], []

    def own(cache, index, handle, owner):
        owned.append((index, handle, owner))
        return cache.setdefault((index, handle), types.SimpleNamespace(stream=handle))
    monkeypatch.setattr(Op, "_ready", lambda self, index: {"fwd": lambda *a: calls.append(a)})
    monkeypatch.setattr(lmsd_mod, "sm_count", lambda index: 132)
    monkeypatch.setattr(lmsd_mod, "own_scheduler_counter", own)
    op = fwd(dropout_ratio=0.5).check_support()
    t = fwd_meta_tensors(dropout=True)
    op.execute(**t, stream=5)
    op.execute(**t, stream=5)
    op.execute(**t, stream=6)
    assert [c[8].stream for c in calls] == [5, 5, 6]
    assert calls[0][8] is calls[1][8] and calls[0][8] is not calls[2][8]
    assert owned[0][2] == "HstuLmsdFwdSm90"
    rows_per_cta = op.tiling.rows_per_cta
    assert calls[0][-2] == -(-N // rows_per_cta)  # fewer row blocks than SMs' CTAs
    ws = torch.zeros(HstuLmsdFwdSm90.workspace_shape(), dtype=torch.int32, device="meta")
    op.execute(**t, stream=5, workspace=ws)
    assert calls[-1][8] is ws and len(owned) == 3
    big = dict(t, x=meta(1 << 20, D), u=meta(1 << 20, D), y=meta(1 << 20, D),
               mean=meta(1 << 20, dtype=F32), rstd=meta(1 << 20, dtype=F32),
               mask=meta(1 << 20, D, dtype=I8))
    op.execute(**big, stream=5)
    assert calls[-1][-2] == 132 * op.ctas_per_sm


def test_execute_validation_runs_once_per_layout():
    op = fwd().check_support()
    calls = []

    def validate():
        calls.append(1)
        return len(calls)

    a, b = torch.empty(4, 8), torch.empty(8)
    assert op._validated((a, None, b), validate) == 1
    assert op._validated((a, None, b), validate) == 1  # same tensors: the rules are skipped
    assert op._validated((a.clone(), None, b), validate) == 2  # another address
    for other in (a.t(), a[:2], a.view(torch.int32), a.to("meta")):  # strides, shape, dtype, device
        before = len(calls)
        op._validated((other, None, b), validate)
        assert len(calls) == before + 1
    assert op._validated((a, b, None), validate) == len(calls)  # None in another slot

    def failing():
        calls.append(1)
        raise ValueError("x: wrong")

    before = len(calls)
    for _ in range(2):  # a failure is not kept: the next call checks (and fails) again
        with pytest.raises(ValueError, match="x: wrong"):
            op._validated((b, None, a), failing)
    assert len(calls) == before + 2


def test_execute_validation_memo_reads_scalars_and_containers():
    op = fwd().check_support()
    a, b = torch.empty(4, 8), torch.empty(8)
    assert op._layout_items(None) == ((), None)
    items, form = op._layout_items({"w": a, "s": None})
    assert items == (a, None) and form == ("dict", ("w", "s"))
    items, form = op._layout_items([a, b])
    assert items == (a, b) and form == ("seq", 2)
    assert op._layout_items("not a tensor") == (("not a tensor",), ("other",))
    calls = []

    def validate():
        calls.append(1)
        return len(calls)

    assert op._validated((a, b), validate, extra=(0.5, 64)) == 1
    assert op._validated((a, b), validate, extra=(0.5, 64)) == 1
    assert op._validated((a, b), validate, extra=(0.25, 64)) == 2  # another scale
    assert op._validated((a, b), validate, extra=(0.25, None)) == 3
    # a container that is not all tensors: validated every time (the rules name it)
    assert op._validated((a, "x"), validate) == 4
    assert op._validated((a, "x"), validate) == 5


def bwd_meta_tensors(dropout=False, compute_dweight=True):
    return dict(dy=meta(N, D), x=meta(N, D), u=meta(N, D), weight=meta(D), bias=meta(D),
                mean=meta(N, dtype=F32), rstd=meta(N, dtype=F32),
                mask=meta(N, D, dtype=I8) if dropout else None, dx=meta(N, D), du=meta(N, D),
                dweight=meta(D) if compute_dweight else None, dbias=meta(D),
                workspace=meta(1024, 2 if compute_dweight else 1, D, dtype=F32))


def test_bwd_execute_requires_dweight_when_computing_it():
    op = bwd()
    assert op.dweight is not None  # the descriptor op invents it...
    op.check_support()
    t = bwd_meta_tensors()
    t["dweight"] = None  # ...execute() must be given one
    with pytest.raises(ValueError, match="dweight is required when compute_dweight=True"):
        op.execute(**t)


def test_bwd_execute_workspace_rules():
    op = bwd().check_support()
    t = bwd_meta_tensors()
    t["workspace"] = meta(1024, 1, D, dtype=F32)
    with pytest.raises(ValueError, match=r"workspace: extent 1 on axis 1 does not match \(\*, 2, 64\)"):
        op.execute(**t)
    t["workspace"] = meta(1024, 2, D, dtype=BF)
    with pytest.raises(TypeError, match="workspace: dtype bfloat16 is not supported; expected float32"):
        op.execute(**t)
    t["workspace"] = meta(0, 2, D, dtype=F32)
    with pytest.raises(ValueError, match="workspace: needs at least .* rows; see workspace_shape"):
        op.execute(**t)


def test_bwd_execute_dropout_scalars():
    op = bwd(dropout_ratio=0.5).check_support()
    with pytest.raises(ValueError, match="compiled with dropout: dropout_ratio must stay > 0"):
        op.execute(**bwd_meta_tensors(dropout=True), dropout_ratio=0.0)
    op = bwd().check_support()
    with pytest.raises(ValueError, match="compiled without dropout"):
        op.execute(**bwd_meta_tensors(), dropout_ratio=0.1)


# --- helpers: overlap, device, ints, floats ----------------------------------------------------
def test_check_no_overlap_with_cpu_views():
    buf = torch.zeros(4 * N, D, dtype=BF)
    a, b = buf[:N], buf[N:2 * N]          # disjoint (adjacent) halves
    c = buf[N - 1:2 * N - 1]              # shares one row with a
    check_no_overlap([("y", a)], [("x", b)])
    check_no_overlap([("y", a), ("mean", b)], [])
    with pytest.raises(ValueError, match="y overlaps x in memory"):
        check_no_overlap([("y", a)], [("x", c)])
    with pytest.raises(ValueError, match="y overlaps mean in memory; outputs must not alias"):
        check_no_overlap([("y", a), ("mean", c)], [])
    with pytest.raises(ValueError, match="y overlaps x"):
        check_no_overlap([("y", a)], [("x", a)])  # identical tensors alias
    # inputs may alias each other, and None / empty tensors are ignored
    check_no_overlap([("y", b)], [("x", a), ("u", a), ("mask", None), ("e", buf[:0])])
    check_no_overlap([("y", None)], [("x", a)])


def test_check_no_overlap_compares_elements_of_strided_views():
    buf = torch.zeros(8, 16, dtype=torch.float32)
    left, right = buf[:, :8], buf[:, 8:]
    # interleaved columns: the address ranges intersect but no element is shared
    check_no_overlap([("dx", left), ("du", right)], [])
    with pytest.raises(ValueError, match="dx overlaps du"):
        check_no_overlap([("dx", left), ("du", buf[:, 4:12])], [])
    with pytest.raises(ValueError, match="dx overlaps x"):  # an output over an input too
        check_no_overlap([("dx", left)], [("x", buf[1:3, 6:10])])
    lo, hi = byte_range(left)
    assert lo == left.data_ptr() and hi == left.data_ptr() + (7 * 16 + 8) * 4
    assert byte_range(buf[:0]) is None
    assert byte_range(None) is None
    assert byte_range(TensorDesc(F32, (4,))) is None
    assert byte_range(meta(4, 4)) is None  # meta tensors own no memory


def test_check_same_device():
    cpu, m = torch.zeros(2), meta(2)
    check_same_device([("x", cpu), ("u", torch.ones(3)), ("mask", None),
                       ("w", TensorDesc(F32, (2,)))])
    with pytest.raises(ValueError, match="u is on meta but x is on cpu; all tensors must be on one"):
        check_same_device([("x", cpu), ("mask", None), ("u", m)])


def test_check_int64():
    assert check_int64("seed", 0) == 0
    assert check_int64("seed", 2**63 - 1) == 2**63 - 1
    assert check_int64("seed", -2**63) == -2**63
    v = check_int64("seed", np.int64(42))
    assert v == 42 and type(v) is int
    assert check_int64("seed", np.uint32(7)) == 7
    with pytest.raises(ValueError, match="seed must fit in a signed 64-bit integer, got 9223372036854775808"):
        check_int64("seed", 2**63)
    with pytest.raises(ValueError, match="seed must fit"):
        check_int64("seed", -2**63 - 1)
    for bad, tname in [(False, "bool"), (1.0, "float"), ("1", "str"), (None, "NoneType"),
                       (np.float32(1), "float32")]:
        with pytest.raises(TypeError, match=f"seed must be an int, got {tname}"):
            check_int64("seed", bad)


def test_check_finite():
    assert check_finite("eps", 1e-5, positive=True) == 1e-5
    assert check_finite("p", np.float32(0.5), lo=0.0, hi_open=1.0) == 0.5
    with pytest.raises(ValueError, match="p must be < 1.0, got 1.0"):
        check_finite("p", 1.0, hi_open=1.0)
    with pytest.raises(ValueError, match="p must be >= 0, got -1"):
        check_finite("p", -1, lo=0)
    with pytest.raises(ValueError, match="eps must be finite, got -inf"):
        check_finite("eps", -math.inf)


def test_check_tensor_contiguous_and_free_extents():
    assert check_tensor("m", desc((5, 8), I8), dtypes=(I8,), shape=(None, 8),
                        contiguous=True) == (5, 8)
    with pytest.raises(ValueError, match=r"m: must be contiguous \(strides \[8, 1\]\), got strides \[16, 1\]"):
        check_tensor("m", desc((5, 8), I8, stride=(16, 1)), dtypes=(I8,), shape=(None, 8),
                     contiguous=True)
    with pytest.raises(TypeError, match="expected a torch.Tensor or TensorDesc, got str"):
        check_tensor("m", "tensor", dtypes=(I8,), shape=(None,))
    # CPU tensors are fine where the rule asks for a CPU device
    t = torch.zeros(4, 8, dtype=BF)
    assert check_tensor("t", t, dtypes=(BF,), shape=(4, 8), device="cpu") == (4, 8)
    with pytest.raises(ValueError, match="t: base address is 2-byte aligned"):
        check_tensor("t", t.view(-1)[1:], dtypes=(BF,), shape=(None,), device="cpu")


# --- target architecture ------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["sm_90a", "90a", "sm90", "9.0", "SM_90A", " sm90a ", "90", 90])
def test_normalize_arch_hopper(text):
    assert normalize_arch(text) == "sm_90a"


@pytest.mark.parametrize("text,expected", [("sm_80", "sm_80"), ("8.6", "sm_86"),
                                            ("sm_100a", "sm_100a"), ("100f", "sm_100f"),
                                            ("9", "sm_90a")])
def test_normalize_arch_others(text, expected):
    assert normalize_arch(text) == expected


@pytest.mark.parametrize("bad", ["garbage", "", "sm_", "sm_90b", "hopper", "9.0.1", "sm_9x"])
def test_normalize_arch_rejects_garbage(bad):
    with pytest.raises(ValueError, match="unrecognised architecture"):
        normalize_arch(bad)


def test_target_arch_sources(monkeypatch):
    monkeypatch.setattr(arch_mod, "device_arch", lambda device_index=None: None)
    monkeypatch.delenv("PRECAST_ARCH", raising=False)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(RuntimeError, match="no GPU is visible and no target architecture"):
        target_arch()
    with pytest.raises(RuntimeError, match="PRECAST_ARCH=sm_90a"):
        target_arch(None)
    assert target_arch("90a") == "sm_90a"  # explicit always wins
    monkeypatch.setenv("CUTE_DSL_ARCH", "9.0")
    assert target_arch() == "sm_90a"
    monkeypatch.setenv("PRECAST_ARCH", "sm_100a")
    assert target_arch() == "sm_100a"  # PRECAST_ARCH before CUTE_DSL_ARCH
    assert target_arch("sm_90") == "sm_90a"
    monkeypatch.setattr(arch_mod, "device_arch", lambda device_index=None: "sm_86")
    monkeypatch.delenv("PRECAST_ARCH")
    monkeypatch.delenv("CUTE_DSL_ARCH")
    assert target_arch() == "sm_86"  # the visible GPU comes last


def test_compile_without_any_target_raises(monkeypatch):
    monkeypatch.setattr(arch_mod, "device_arch", lambda device_index=None: None)
    monkeypatch.delenv("PRECAST_ARCH", raising=False)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    op = fwd()
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        op.compile()
    assert not op.is_compiled


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a", "8.9"])
def test_compile_unsupported_arch(arch):
    for op in (fwd(), bwd()):
        with pytest.raises(NotImplementedError, match=rf"{type(op).__name__} has kernels for "
                                                      rf"sm_90a, not sm_\d+"):
            op.compile(arch=arch)
        assert not op.is_compiled


def test_build_command_names_the_config():
    cmd = fwd(dropout_ratio=0.1, concat_u=True).build_command("sm_90a")
    assert cmd.startswith("python -m precast precompile --op HstuLmsdFwdSm90 --config '")
    assert '"concat_u": true' in cmd and '"dropout": true' in cmd and cmd.endswith("--arch sm_90a")


# --- Results ------------------------------------------------------------------------------------
Pair = results_type("Pair", ("first_tensor", "second_tensor"))


def test_results_unpack_index_and_attributes():
    r = Pair(1, "two")
    a, b = r
    assert (a, b) == (1, "two")
    assert isinstance(r, tuple) and len(r) == 2
    assert r[0] == 1 and r[-1] == "two" and r[:1] == (1,)
    assert r["first_tensor"] == 1 and r["second_tensor"] == "two"
    assert r.first_tensor == 1 and r.second_tensor == "two"
    assert r.keys() == ["first_tensor", "second_tensor"]
    assert r.items() == [("first_tensor", 1), ("second_tensor", "two")]
    assert dict(r.items()) == {"first_tensor": 1, "second_tensor": "two"}
    assert "first_tensor" in r and "nope" not in r
    assert 1 in r and 3 not in r  # non-strings test the values, like a tuple
    assert r == (1, "two")


def test_results_by_name():
    r = Pair(second_tensor=2, first_tensor=1)
    assert tuple(r) == (1, 2)


def test_results_key_error_names_fields():
    r = Pair(1, 2)
    with pytest.raises(KeyError, match=r"'third_tensor'; Pair has \['first_tensor', 'second_tensor'\]"):
        r["third_tensor"]
    with pytest.raises(AttributeError, match="third_tensor"):
        r.third_tensor
    with pytest.raises(IndexError):
        r[2]


@pytest.mark.parametrize("args,kwargs,match", [
    ((1,), {}, "Pair takes 2 values, got 1"),
    ((1, 2, 3), {}, "Pair takes 2 values, got 3"),
    ((), {"first_tensor": 1}, r"missing \['second_tensor'\]"),
    ((), {"first_tensor": 1, "second_tensor": 2, "x": 3}, r"unexpected \['x'\]"),
    ((1,), {"second_tensor": 2}, "pass values positionally or by name, not both"),
])
def test_results_wrong_arity(args, kwargs, match):
    with pytest.raises(TypeError, match=match):
        Pair(*args, **kwargs)


def test_results_repr_shortens_tensors():
    r = Pair(torch.zeros(3, 4, dtype=BF), None)
    assert repr(r) == "Pair(first_tensor=Tensor[3, 4]:bfloat16, second_tensor=None)"


def test_lmsd_results_types():
    from precast.hstu_lmsd import LmsdBackwardResults, LmsdForwardResults
    y, mean, rstd, mask = LmsdForwardResults(1, 2, 3, None)
    assert (y, mean, rstd, mask) == (1, 2, 3, None)
    r = LmsdBackwardResults(dx_tensor=1, du_tensor=2, dweight_tensor=None, dbias_tensor=4)
    assert r.dbias_tensor == 4 and r["dweight_tensor"] is None
    assert issubclass(LmsdForwardResults, Results)
