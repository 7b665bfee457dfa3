"""Every host-side rule of the Gated DeltaNet forward (precast/lifecycle/gdn_rules.py) on a
CPU machine: valid configurations and the GdnShapes they give, one case per rule (exception
type and message), overlap and device rules on real CPU tensors, TensorDescs, meta and CPU
tensors alike, and the checkpoint row bound against the reference."""
import dataclasses
import math

import numpy as np
import pytest
import torch

from precast.lifecycle.gdn_rules import (FINAL_STATE_DTYPE, MAX_SPAN, GdnShapes,
                                         check_gdn_inputs, max_checkpoint_rows)
from precast.lifecycle.tensor_desc import TensorDesc
from precast.reference.gated_delta_net import CHUNK_SIZE, gdn_chunked_reference

BF, FP, F32, F64, I32, I64 = (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                              torch.int32, torch.int64)
# The base configuration of the rule table: grouped heads with K != V so that every shape
# mix-up is visible.
T, N, HQ, HK, HV, K, V = 128, 4, 4, 4, 8, 64, 128
HO = max(HQ, HV)
ROWS = T // CHUNK_SIZE + N  # checkpoint rows at n = 64


def desc(shape, dtype=BF, stride=None, alignment=16, device="cuda"):
    return TensorDesc(dtype, shape, stride, device, alignment)


def inputs(hq=HQ, hk=None, hv=HV, k=K, v=V, dtype=BF, t=T, n=N, g_dtype=F32, beta_dtype=F32,
           cu_dtype=I32):
    """q, k, v, g, beta, cu_seqlens descriptors (compact, on CUDA)."""
    hk = hq if hk is None else hk
    ho = max(hq, hv)
    return dict(q=desc((t, hq, k), dtype), k=desc((t, hk, k), dtype), v=desc((t, hv, v), dtype),
                g=desc((t, ho), g_dtype), beta=desc((t, ho), beta_dtype),
                cu_seqlens=desc((n + 1,), cu_dtype))


BASE = inputs()


def check(**kw):
    return check_gdn_inputs(**{**BASE, **kw})


def state(rows=N, dtype=F32, **kw):
    return desc((rows, HO, V, K), dtype, **kw)


def cpu(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


# --- valid configurations -------------------------------------------------------------------------
@pytest.mark.parametrize("hq,hv", [(1, 1), (4, 16), (16, 4)])
@pytest.mark.parametrize("k_is", ["HQ", "HV"])
@pytest.mark.parametrize("kd,vd", [(64, 64), (128, 128), (64, 128), (128, 64)])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_head_ratios_and_dims(hq, hv, k_is, kd, vd, dtype):
    hk = hq if k_is == "HQ" else hv
    s = check_gdn_inputs(**inputs(hq, hk, hv, kd, vd, dtype))
    ho = max(hq, hv)
    assert (s.T, s.N, s.HQ, s.HK, s.HV, s.HO, s.K, s.V) == (T, N, hq, hk, hv, ho, kd, vd)
    assert s.dtype == dtype and s.g_dtype == s.beta_dtype == F32 and s.cu_seqlens_dtype == I32
    assert s.scale == 1.0 / math.sqrt(kd)
    assert (s.q_group, s.k_group, s.v_group) == (ho // hq, ho // hk, ho // hv)
    assert s.state_shape == (N, ho, vd, kd)
    assert s.state_dtype is None and s.pool_rows is None and not s.uses_pool
    assert s.checkpoint_every_n_tokens is s.checkpoint_dtype is s.checkpoint_rows is None
    assert s.output_final_state is s.use_qk_l2norm_in_kernel is s.batch_invariant is False


def test_grouping_matches_the_reference_rule():
    """Output head h reads q head h // (HO // HQ) (module docstring of the reference)."""
    s = check_gdn_inputs(**inputs(hq=4, hk=16, hv=16))
    assert [h // s.q_group for h in range(s.HO)] == [h // 4 for h in range(16)]
    assert s.k_group == s.v_group == 1
    s = check_gdn_inputs(**inputs(hq=16, hk=4, hv=4))
    assert (s.q_group, s.k_group, s.v_group) == (1, 4, 4)


@pytest.mark.parametrize("cu_dtype", [I32, I64])
@pytest.mark.parametrize("g_dtype,beta_dtype", [(F32, F32), (BF, BF), (FP, FP), (F32, BF),
                                                (FP, F32)])
def test_index_and_gate_dtypes(cu_dtype, g_dtype, beta_dtype):
    s = check_gdn_inputs(**inputs(g_dtype=g_dtype, beta_dtype=beta_dtype, cu_dtype=cu_dtype))
    assert (s.cu_seqlens_dtype, s.g_dtype, s.beta_dtype) == (cu_dtype, g_dtype, beta_dtype)


VALID = [
    # (id, check kwargs, {GdnShapes field: expected value})
    ("scale", dict(scale=0.5), dict(scale=0.5)),
    ("scale-int", dict(scale=2), dict(scale=2.0)),
    ("scale-numpy", dict(scale=np.float32(0.25)), dict(scale=0.25)),
    ("scale-tiny", dict(scale=1e-30), dict(scale=1e-30)),
    ("flags", dict(output_final_state=True, use_qk_l2norm_in_kernel=True, batch_invariant=True),
     dict(output_final_state=True, use_qk_l2norm_in_kernel=True, batch_invariant=True)),
    ("flags-numpy-bool", dict(batch_invariant=np.bool_(True)), dict(batch_invariant=True)),
    ("initial-fp32", dict(initial_state=state()), dict(state_dtype=F32)),
    ("initial-io", dict(initial_state=state(dtype=BF)), dict(state_dtype=BF)),
    ("initial-padded-rows", dict(initial_state=state(stride=(HO * V * 68, V * 68, 68, 1))),
     dict(state_dtype=F32)),  # fp32 rows: multiples of 4 elements
    ("initial-padded-rows-io", dict(initial_state=state(dtype=BF,
                                                        stride=(HO * V * 72, V * 72, 72, 1))),
     dict(state_dtype=BF)),
    ("pool", dict(initial_state=state(rows=10), state_indices=desc((N,), I32)),
     dict(pool_rows=10, state_dtype=F32)),
    ("pool-exact", dict(initial_state=state(rows=N, dtype=BF), state_indices=desc((N,), I32)),
     dict(pool_rows=N, state_dtype=BF)),
    ("pool-and-final", dict(initial_state=state(rows=6), state_indices=desc((N,), I32),
                            output_final_state=True, final_state=state()),
     dict(pool_rows=6, output_final_state=True)),
    ("ckpt-64", dict(checkpoint_every_n_tokens=64),
     dict(checkpoint_every_n_tokens=64, checkpoint_dtype=BF, checkpoint_rows=T // 64 + N)),
    ("ckpt-128-fp32", dict(checkpoint_every_n_tokens=128, checkpoint_dtype=F32),
     dict(checkpoint_dtype=F32, checkpoint_rows=T // 128 + N)),
    ("ckpt-io-explicit", dict(checkpoint_every_n_tokens=64, checkpoint_dtype=BF),
     dict(checkpoint_dtype=BF)),
    ("ckpt-longer-than-T", dict(checkpoint_every_n_tokens=4096), dict(checkpoint_rows=N)),
    ("ckpt-numpy-int", dict(checkpoint_every_n_tokens=np.int64(192)),
     dict(checkpoint_every_n_tokens=192, checkpoint_rows=T // 192 + N)),
    ("ckpt-buffer", dict(checkpoint_every_n_tokens=64, checkpoints=state(rows=ROWS, dtype=BF)),
     dict(checkpoint_rows=ROWS)),
    ("ckpt-buffer-fp32", dict(checkpoint_every_n_tokens=64, checkpoint_dtype=F32,
                              checkpoints=state(rows=ROWS)), dict(checkpoint_dtype=F32)),
    ("ckpt-and-initial", dict(checkpoint_every_n_tokens=64, initial_state=state(dtype=BF)),
     dict(checkpoint_rows=ROWS, state_dtype=BF)),
    ("outputs", dict(o=desc((T, HO, V)), output_final_state=True, final_state=state()),
     dict(output_final_state=True)),
    ("o-padded", dict(o=desc((T, HO, V), stride=(2 * HO * V, V + 8, 1))), dict(HO=HO)),
    ("o-in-a-bigger-buffer", dict(o=desc((T, HO, V), stride=(HO * V * 3, V, 1), alignment=256)),
     dict(HO=HO)),
    # g and beta: column slices of one fused [T, 2 HO] fp32 tensor; any token stride
    ("gates-fused", dict(g=desc((T, HO), F32, stride=(2 * HO, 1)),
                         beta=desc((T, HO), F32, stride=(2 * HO, 1), alignment=32)), dict(HO=HO)),
    ("gates-odd-stride", dict(g=desc((T, HO), F32, stride=(HO + 1, 1), alignment=4),
                              beta=desc((T, HO), BF, stride=(HO + 3, 1), alignment=2)),
     dict(beta_dtype=BF)),
    ("one-head-gates", dict(inputs(hq=1, hv=1), g=desc((T, 1), F32, stride=(1, 1))),
     dict(HO=1)),
    ("no-sequence", dict(inputs(t=0, n=0), initial_state=desc((0, HO, V, K), F32),
                         checkpoint_every_n_tokens=64), dict(T=0, N=0, checkpoint_rows=0)),
    ("empty-sequences", dict(inputs(t=0, n=3), checkpoint_every_n_tokens=64,
                             checkpoints=desc((3, HO, V, K))), dict(T=0, N=3, checkpoint_rows=3)),
    ("pool-no-sequence", dict(inputs(n=0, t=0), initial_state=state(rows=0),
                              state_indices=desc((0,), I32)), dict(N=0, pool_rows=0)),
    ("one-sequence", dict(cu_seqlens=desc((2,), I64)), dict(N=1, cu_seqlens_dtype=I64)),
    ("int64-cu-aligned-8", dict(cu_seqlens=desc((N + 1,), I64, alignment=8)), dict(N=N)),
    ("cu-aligned-4", dict(cu_seqlens=desc((N + 1,), I32, alignment=4)), dict(N=N)),
    ("most-tokens", dict(inputs(hq=1, hv=1, t=2**31 - 1)), dict(T=2**31 - 1)),
    ("meta", dict(q=meta(T, HQ, K), k=meta(T, HK, K), v=meta(T, HV, V),
                  g=meta(T, HO, dtype=F32), beta=meta(T, HO, dtype=FP),
                  cu_seqlens=meta(N + 1, dtype=I64)), dict(beta_dtype=FP, cu_seqlens_dtype=I64)),
]


@pytest.mark.parametrize("kw,fields", [r[1:] for r in VALID], ids=[r[0] for r in VALID])
def test_valid_configurations(kw, fields):
    s = check(**kw)
    assert isinstance(s, GdnShapes)
    got = {name: getattr(s, name) for name in fields}
    assert got == fields
    assert s.HO == max(s.HQ, s.HV) and s.HK in (s.HQ, s.HV)


def test_shapes_are_frozen_and_hashable():
    s = check(checkpoint_every_n_tokens=64)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.T = 1
    assert hash(s) == hash(check(checkpoint_every_n_tokens=64))
    assert s == check(checkpoint_every_n_tokens=64) != check()
    assert type(s.T) is int and type(s.scale) is float
    assert type(check(checkpoint_every_n_tokens=np.int64(64)).checkpoint_every_n_tokens) is int


# --- every rule -----------------------------------------------------------------------------------
def fused_q(token_stride, head_stride=K, last=1, alignment=16):
    return desc((T, HQ, K), stride=(token_stride, head_stride, last), alignment=alignment)


RULES = [
    # (id, check kwargs, exception, message fragment)
    # required arguments and their types
    ("q-missing", dict(q=None), ValueError, r"^q is required: \[T, HQ, K\] bfloat16 or float16"),
    ("k-missing", dict(k=None), ValueError, r"^k is required: \[T, HK, K\]"),
    ("v-missing", dict(v=None), ValueError, r"^v is required: \[T, HV, V\]"),
    ("g-missing", dict(g=None), ValueError, r"^g is required: \[T, HO\]"),
    ("beta-missing", dict(beta=None), ValueError, r"^beta is required: \[T, HO\]"),
    ("cu-missing", dict(cu_seqlens=None), ValueError,
     r"^cu_seqlens is required: \[N \+ 1\] int32 or int64"),
    ("q-not-a-tensor", dict(q=[[0.0]]), TypeError,
     r"^q: expected a torch.Tensor or TensorDesc \[T, HQ, K\].*got list"),
    ("cu-numpy", dict(cu_seqlens=np.zeros(N + 1, np.int32)), TypeError,
     "cu_seqlens: expected a torch.Tensor or TensorDesc .*got ndarray"),
    ("state-not-a-tensor", dict(initial_state=0.0), TypeError,
     "initial_state: expected a torch.Tensor or TensorDesc"),
    # dtypes
    ("q-fp32", dict(q=desc((T, HQ, K), F32)), TypeError,
     "^q: dtype float32 is not supported; expected bfloat16 or float16$"),
    ("all-fp32", inputs(dtype=F32), TypeError, "^q: dtype float32 is not supported"),
    ("q-fp64", dict(q=desc((T, HQ, K), F64)), TypeError, "q: dtype float64"),
    ("k-other-io", dict(k=desc((T, HK, K), FP)), TypeError,
     "^k: dtype float16 differs from q's bfloat16; q, k and v must have one dtype "
     r"\(bfloat16 or float16\)"),
    ("v-other-io", dict(v=desc((T, HV, V), FP)), TypeError, "^v: dtype float16 differs from q's"),
    ("k-fp32", dict(k=desc((T, HK, K), F32)), TypeError,
     "^k: dtype float32 is not supported; expected bfloat16 or float16"),
    ("v-int", dict(v=desc((T, HV, V), I32)), TypeError, "^v: dtype int32 is not supported"),
    ("g-fp64", dict(g=desc((T, HO), F64)), TypeError,
     "^g: dtype float64 is not supported; expected float32 or bfloat16 or float16"),
    ("beta-int", dict(beta=desc((T, HO), I32)), TypeError, "^beta: dtype int32 is not supported"),
    ("cu-fp32", dict(cu_seqlens=desc((N + 1,), F32)), TypeError,
     "^cu_seqlens: dtype float32 is not supported; expected int32 or int64"),
    ("cu-uint8", dict(cu_seqlens=desc((N + 1,), torch.uint8)), TypeError,
     "^cu_seqlens: dtype uint8"),
    # ranks
    ("q-rank-2", dict(q=desc((T, HQ * K))), ValueError,
     r"^q: expected a rank-3 tensor of shape \(\*, \*, \*\), got shape \[128, 256\]"),
    ("k-rank-4", dict(k=desc((T, HK, K, 1))), ValueError, "^k: expected a rank-3"),
    ("v-rank-2", dict(v=desc((T, HV * V))), ValueError, "^v: expected a rank-3"),
    ("g-rank-3", dict(g=desc((T, HO, 1), F32)), ValueError, "^g: expected a rank-2"),
    ("beta-rank-1", dict(beta=desc((T,), F32)), ValueError, "^beta: expected a rank-2"),
    ("cu-rank-2", dict(cu_seqlens=desc((1, N + 1), I32)), ValueError,
     "^cu_seqlens: expected a rank-1"),
    # tokens
    ("k-tokens", dict(k=desc((T - 1, HK, K))), ValueError, "^k: has 127 tokens but q has 128$"),
    ("v-tokens", dict(v=desc((T + 64, HV, V))), ValueError, "^v: has 192 tokens but q has 128$"),
    ("g-tokens", dict(g=desc((T - 1, HO), F32)), ValueError, "^g: has 127 tokens but q has 128$"),
    ("beta-tokens", dict(beta=desc((0, HO), F32)), ValueError, "^beta: has 0 tokens but q has 128"),
    ("too-many-tokens", dict(q=desc((2**31, 1, K))), ValueError,
     r"^q: T = 2147483648 tokens exceed 2\^31 - 1 \(token indices are int32\)"),
    # head dims
    ("K-96", inputs(k=96), NotImplementedError,
     "^q: head dim K = 96 is not supported; expected 64 or 128$"),
    ("K-32", inputs(k=32), NotImplementedError, "^q: head dim K = 32 is not supported"),
    ("K-256", inputs(k=256), NotImplementedError, "^q: head dim K = 256 is not supported"),
    ("V-256", inputs(v=256), NotImplementedError,
     "^v: head dim V = 256 is not supported; expected 64 or 128$"),
    ("V-32", inputs(v=32), NotImplementedError, "^v: head dim V = 32"),
    ("V-0", dict(v=desc((T, HV, 0), stride=(HV * 8, 8, 1))), NotImplementedError,
     "^v: head dim V = 0"),
    ("k-head-dim", dict(k=desc((T, HK, 128))), ValueError,
     "^k: head dim 128 differs from q's K = 64$"),
    # heads
    ("HQ-0", inputs(hq=0, hk=4), ValueError,
     r"^q: needs at least one head \(HQ >= 1\), got shape \[128, 0, 64\]"),
    ("HK-0", inputs(hk=0), ValueError, r"^k: needs at least one head \(HK >= 1\)"),
    ("HV-0", inputs(hv=0, hq=4), ValueError, r"^v: needs at least one head \(HV >= 1\)"),
    ("HQ-HV-not-multiples", inputs(hq=3, hv=8), ValueError,
     "^v: HV = 8 heads and q's HQ = 3: HQ and HV must be equal or one a multiple of the other"),
    ("HQ-HV-not-multiples-2", inputs(hq=6, hv=4), ValueError, "HV = 4 heads and q's HQ = 6"),
    ("HK-neither", inputs(hk=2), ValueError, "^k: HK = 2 heads; expected HQ = 4 or HV = 8$"),
    ("HK-above", inputs(hk=16), ValueError, "^k: HK = 16 heads; expected HQ = 4 or HV = 8"),
    ("HK-equal-heads", inputs(hq=8, hk=4, hv=8), ValueError, "^k: HK = 4 heads; expected HQ = 8"),
    ("g-heads-HQ", dict(g=desc((T, HQ), F32)), ValueError,
     r"^g: has 4 heads; expected HO = max\(HQ, HV\) = 8$"),
    ("beta-heads", dict(beta=desc((T, 2 * HO), F32)), ValueError,
     r"^beta: has 16 heads; expected HO = max\(HQ, HV\) = 8"),
    # layouts of q, k, v: innermost contiguous, 16-byte rows and base, no aliasing, span
    ("q-last-stride", dict(q=fused_q(2 * HQ * K, 2 * K, 2)), ValueError,
     r"^q: the last dimension must be contiguous \(stride 1\), got strides \[512, 128, 2\]"),
    ("q-token-stride", dict(q=fused_q(HQ * K + 4)), ValueError,
     "^q: axis-0 stride 260 must be a multiple of 8 elements so that every row starts 16-byte "
     "aligned"),
    ("k-head-stride", dict(k=desc((T, HK, K), stride=(HK * 2 * K, K + 4, 1))), ValueError,
     "^k: axis-1 stride 68 must be a multiple of 8 elements"),
    ("v-token-stride-odd", dict(v=desc((T, HV, V), stride=(HV * V + 1, V, 1))), ValueError,
     "^v: axis-0 stride 1025 must be a multiple of 8"),
    ("q-alignment", dict(q=fused_q(HQ * K, alignment=8)), ValueError,
     "^q: base address is 8-byte aligned; 16-byte alignment is required"),
    ("v-alignment", dict(v=desc((T, HV, V), alignment=2)), ValueError,
     "^v: base address is 2-byte"),
    ("q-heads-overlap", dict(q=fused_q(HQ * K, K // 2)), ValueError,
     "^q: axis-1 stride 32 is smaller than the 64 elements spanned by the faster axes"),
    ("k-broadcast-tokens", dict(k=desc((T, HK, K), stride=(0, K, 1))), ValueError,
     "^k: axis-0 stride 0 is smaller than"),
    ("q-span", dict(q=fused_q(2**38)), ValueError,
     f"^q: spans [0-9]+ elements; at most {MAX_SPAN} are supported"),
    ("q-on-cpu", dict(q=desc((T, HQ, K), device="cpu")), ValueError,
     "^q: tensor is on cpu; expected a cuda tensor"),
    # layouts of g, beta, cu_seqlens
    ("g-last-stride", dict(g=desc((T, HO), F32, stride=(2 * HO, 2))), ValueError,
     r"^g: the last dimension must be contiguous \(stride 1\)"),
    ("g-alignment", dict(g=desc((T, HO), F32, alignment=2)), ValueError,
     "^g: base address is 2-byte aligned; 4-byte alignment is required"),
    ("beta-alignment", dict(beta=desc((T, HO), BF, alignment=1)), ValueError,
     "^beta: base address is 1-byte aligned; 2-byte"),
    ("g-rows-overlap", dict(g=desc((T, HO), F32, stride=(HO - 1, 1))), ValueError,
     "^g: row stride 7 is smaller than the row length 8: rows would overlap"),
    ("cu-strided", dict(cu_seqlens=desc((N + 1,), I32, stride=(2,))), ValueError,
     "^cu_seqlens: the last dimension must be contiguous"),
    ("cu-int64-alignment", dict(cu_seqlens=desc((N + 1,), I64, alignment=4)), ValueError,
     "^cu_seqlens: base address is 4-byte aligned; 8-byte alignment is required"),
    ("cu-int32-alignment", dict(cu_seqlens=desc((N + 1,), I32, alignment=2)), ValueError,
     "^cu_seqlens: base address is 2-byte aligned; 4-byte"),
    ("cu-empty", dict(cu_seqlens=desc((0,), I32)), ValueError,
     r"^cu_seqlens: needs N \+ 1 >= 1 entries \(the offsets start at 0\), got 0$"),
    ("cu-on-cpu", dict(cu_seqlens=desc((N + 1,), I32, device="cpu")), ValueError,
     "^cu_seqlens: tensor is on cpu; expected a cuda tensor"),
    # scale
    ("scale-0", dict(scale=0.0), ValueError, "^scale must be positive, got 0.0$"),
    ("scale-negative", dict(scale=-0.125), ValueError, "^scale must be positive, got -0.125"),
    ("scale-nan", dict(scale=float("nan")), ValueError, "^scale must be finite, got nan"),
    ("scale-inf", dict(scale=math.inf), ValueError, "^scale must be finite, got inf"),
    ("scale-str", dict(scale="0.5"), TypeError, "^scale must be a real number, got str"),
    ("scale-list", dict(scale=[0.5]), TypeError, "^scale must be a real number, got list"),
    ("scale-float32-overflow", dict(scale=1e39), ValueError,
     r"^scale = 1e\+39 overflows float32 \(the kernels' scalar type\); expected a finite value "
     r"in \(0, 3.403e\+38\]"),
    ("scale-float32-underflow", dict(scale=1e-50), ValueError,
     r"^scale = 1e-50 rounds to 0 in float32 \(the kernels' scalar type\)"),
    # flags
    ("output_final_state-int", dict(output_final_state=1), TypeError,
     "^output_final_state must be a bool, got int$"),
    ("l2norm-str", dict(use_qk_l2norm_in_kernel="yes"), TypeError,
     "^use_qk_l2norm_in_kernel must be a bool, got str"),
    ("batch_invariant-None", dict(batch_invariant=None), TypeError,
     "^batch_invariant must be a bool, got NoneType"),
    # checkpoints
    ("n-0", dict(checkpoint_every_n_tokens=0), ValueError,
     "^checkpoint_every_n_tokens must be >= 1, got 0$"),
    ("n-negative", dict(checkpoint_every_n_tokens=-64), ValueError,
     "^checkpoint_every_n_tokens must be >= 1, got -64"),
    ("n-32", dict(checkpoint_every_n_tokens=32), ValueError,
     "^checkpoint_every_n_tokens = 32 must be a positive multiple of the chunk size 64$"),
    ("n-100", dict(checkpoint_every_n_tokens=100), ValueError,
     "checkpoint_every_n_tokens = 100 must be a positive multiple of the chunk size 64"),
    ("n-float", dict(checkpoint_every_n_tokens=64.0), TypeError,
     "^checkpoint_every_n_tokens must be an int, got float$"),
    ("n-bool", dict(checkpoint_every_n_tokens=True), TypeError,
     "^checkpoint_every_n_tokens must be an int, got bool"),
    ("n-too-large", dict(checkpoint_every_n_tokens=2**31), ValueError,
     "^checkpoint_every_n_tokens must be <= 2147483647, got 2147483648"),
    ("ckpt-dtype-other-half", dict(checkpoint_every_n_tokens=64, checkpoint_dtype=FP), TypeError,
     r"^checkpoint_dtype: float16 is not supported; expected None \(the io dtype bfloat16\), "
     "bfloat16 or float32$"),
    ("ckpt-dtype-fp64", dict(checkpoint_every_n_tokens=64, checkpoint_dtype=F64), TypeError,
     "^checkpoint_dtype: float64 is not supported"),
    ("ckpt-dtype-str", dict(checkpoint_every_n_tokens=64, checkpoint_dtype="float32"), TypeError,
     "^checkpoint_dtype must be None, torch.float32 or the io dtype bfloat16, got str$"),
    ("ckpt-dtype-without-n", dict(checkpoint_dtype=F32), ValueError,
     "^checkpoint_dtype is given but checkpoint_every_n_tokens is None: no checkpoints are "
     r"written \(pass both, or neither\)"),
    ("ckpt-buffer-without-n", dict(checkpoints=state(rows=ROWS, dtype=BF)), ValueError,
     "^checkpoints is given but checkpoint_every_n_tokens is None"),
    ("ckpt-rows-short", dict(checkpoint_every_n_tokens=64, checkpoints=state(rows=ROWS - 1,
                                                                            dtype=BF)),
     ValueError, r"^checkpoints: shape \[5, 8, 128, 64\] does not match \[T // n \+ N, HO, V, K\] "
                 r"\(n = 64\) = \[6, 8, 128, 64\] \(states are V-major: K contiguous\)$"),
    ("ckpt-rows-long", dict(checkpoint_every_n_tokens=128, checkpoints=state(rows=ROWS,
                                                                            dtype=BF)),
     ValueError, r"^checkpoints: shape \[6, 8, 128, 64\] does not match .*= \[5, 8, 128, 64\]"),
    ("ckpt-K-major", dict(checkpoint_every_n_tokens=64,
                          checkpoints=desc((ROWS, HO, K, V))), ValueError,
     r"^checkpoints: shape \[6, 8, 64, 128\] does not match"),
    ("ckpt-rank", dict(checkpoint_every_n_tokens=64, checkpoints=desc((ROWS * HO, V, K))),
     ValueError, "^checkpoints: expected a rank-4"),
    ("ckpt-buffer-fp32-default", dict(checkpoint_every_n_tokens=64, checkpoints=state(rows=ROWS)),
     TypeError, "^checkpoints: dtype float32 is not supported; expected bfloat16$"),
    ("ckpt-buffer-io-for-fp32", dict(checkpoint_every_n_tokens=64, checkpoint_dtype=F32,
                                     checkpoints=state(rows=ROWS, dtype=BF)),
     TypeError, "^checkpoints: dtype bfloat16 is not supported; expected float32$"),
    ("ckpt-buffer-last-stride", dict(checkpoint_every_n_tokens=64, checkpoints=state(
        rows=ROWS, dtype=BF, stride=(HO * V * K * 2, V * K * 2, K * 2, 2))), ValueError,
     "^checkpoints: the last dimension must be contiguous"),
    # initial state
    ("initial-K-major", dict(initial_state=desc((N, HO, K, V), F32)), ValueError,
     r"^initial_state: shape \[4, 8, 64, 128\] does not match \[N, HO, V, K\] = "
     r"\[4, 8, 128, 64\] \(states are V-major: K contiguous\)$"),
    ("initial-N", dict(initial_state=state(rows=N + 1)), ValueError,
     r"^initial_state: shape \[5, 8, 128, 64\] does not match \[N, HO, V, K\]"),
    ("initial-HQ-heads", dict(initial_state=desc((N, HQ, V, K), F32)), ValueError,
     r"^initial_state: shape \[4, 4, 128, 64\]"),
    ("initial-rank", dict(initial_state=desc((HO, V, K), F32)), ValueError,
     r"^initial_state: expected a rank-4 tensor"),
    ("initial-other-half", dict(initial_state=state(dtype=FP)), TypeError,
     "^initial_state: dtype float16 is not supported; expected float32 or bfloat16$"),
    ("initial-fp64", dict(initial_state=state(dtype=F64)), TypeError,
     "^initial_state: dtype float64 is not supported"),
    ("initial-transposed-view", dict(initial_state=desc((N, HO, V, K), F32,
                                                        stride=(HO * V * K, V * K, 1, V))),
     ValueError, r"^initial_state: the last dimension must be contiguous \(stride 1\)"),
    ("initial-row-fp32", dict(initial_state=state(stride=(HO * V * 66, V * 66, 66, 1))),
     ValueError, "^initial_state: axis-2 stride 66 must be a multiple of 4 elements"),
    ("initial-row-io", dict(initial_state=state(dtype=BF, stride=(HO * V * 68, V * 68, 68, 1))),
     ValueError, "^initial_state: axis-2 stride 68 must be a multiple of 8 elements"),
    ("initial-alignment", dict(initial_state=state(alignment=8)), ValueError,
     "^initial_state: base address is 8-byte aligned; 16-byte alignment is required"),
    ("initial-on-cpu", dict(initial_state=state(device="cpu")), ValueError,
     "^initial_state: tensor is on cpu; expected a cuda tensor"),
    # state pool
    ("indices-without-pool", dict(state_indices=desc((N,), I32)), ValueError,
     r"^state_indices requires initial_state: the state pool \[N_pool, HO, V, K\]$"),
    ("indices-and-checkpoints", dict(state_indices=desc((N,), I32), initial_state=state(rows=8),
                                     checkpoint_every_n_tokens=64), ValueError,
     r"^state_indices and checkpoint_every_n_tokens are mutually exclusive \(the state pool is "
     "forward only"),
    ("indices-int64", dict(state_indices=desc((N,), I64), initial_state=state(rows=8)), TypeError,
     "^state_indices: dtype int64 is not supported; expected int32$"),
    ("indices-fp32", dict(state_indices=desc((N,), F32), initial_state=state(rows=8)), TypeError,
     "^state_indices: dtype float32"),
    ("indices-length", dict(state_indices=desc((N + 1,), I32), initial_state=state(rows=8)),
     ValueError, r"^state_indices: shape \[5\] does not match \[N\] = \[4\]$"),
    ("indices-rank", dict(state_indices=desc((N, 1), I32), initial_state=state(rows=8)),
     ValueError, "^state_indices: expected a rank-1"),
    ("indices-strided", dict(state_indices=desc((N,), I32, stride=(2,)),
                             initial_state=state(rows=8)), ValueError,
     "^state_indices: the last dimension must be contiguous"),
    ("indices-alignment", dict(state_indices=desc((N,), I32, alignment=2),
                               initial_state=state(rows=8)), ValueError,
     "^state_indices: base address is 2-byte aligned; 4-byte"),
    ("indices-not-a-tensor", dict(state_indices=[0, 1, 2, 3], initial_state=state(rows=8)),
     TypeError, "^state_indices: expected a torch.Tensor or TensorDesc"),
    ("pool-heads", dict(state_indices=desc((N,), I32), initial_state=desc((10, HQ, V, K), F32)),
     ValueError, r"^initial_state: shape \[10, 4, 128, 64\] does not match the state pool "
                 r"\[N_pool, HO, V, K\] = \[\*, 8, 128, 64\]"),
    ("pool-too-small", dict(state_indices=desc((N,), I32), initial_state=state(rows=N - 1)),
     ValueError, "^initial_state: the state pool has 3 rows but the 4 sequences need distinct "
                 r"rows; expected \[N_pool >= N = 4, HO, V, K\]$"),
    ("pool-empty", dict(state_indices=desc((N,), I32), initial_state=state(rows=0)), ValueError,
     "the state pool has 0 rows"),
    ("pool-dtype", dict(state_indices=desc((N,), I32), initial_state=state(rows=8, dtype=FP)),
     TypeError, "^initial_state: dtype float16 is not supported; expected float32 or bfloat16"),
    # output buffers
    ("o-fp32", dict(o=desc((T, HO, V), F32)), TypeError,
     "^o: dtype float32 is not supported; expected bfloat16$"),
    ("o-other-half", dict(o=desc((T, HO, V), FP)), TypeError, "^o: dtype float16 is not supported"),
    ("o-HQ-heads", dict(o=desc((T, HQ, V))), ValueError,
     r"^o: shape \[128, 4, 128\] does not match \[T, HO, V\] = \[128, 8, 128\]$"),
    ("o-K", dict(o=desc((T, HO, K))), ValueError, r"^o: shape \[128, 8, 64\] does not match"),
    ("o-tokens", dict(o=desc((T - 1, HO, V))), ValueError, r"^o: shape \[127, 8, 128\]"),
    ("o-rank", dict(o=desc((T, HO * V))), ValueError, "^o: expected a rank-3"),
    ("o-last-stride", dict(o=desc((T, HO, V), stride=(2 * HO * V, 2 * V, 2))), ValueError,
     "^o: the last dimension must be contiguous"),
    ("o-row", dict(o=desc((T, HO, V), stride=(HO * (V + 4), V + 4, 1))), ValueError,
     "^o: axis-1 stride 132 must be a multiple of 8"),
    ("o-alignment", dict(o=desc((T, HO, V), alignment=4)), ValueError,
     "^o: base address is 4-byte aligned"),
    ("o-not-a-tensor", dict(o="out"), TypeError, "^o: expected a torch.Tensor or TensorDesc"),
    ("final-not-asked", dict(final_state=state()), ValueError,
     "^final_state is given but output_final_state is False: pass output_final_state=True"),
    ("final-io", dict(output_final_state=True, final_state=state(dtype=BF)), TypeError,
     "^final_state: dtype bfloat16 is not supported; expected float32$"),
    ("final-shape", dict(output_final_state=True, final_state=desc((N, HO, K, V), F32)),
     ValueError, r"^final_state: shape \[4, 8, 64, 128\] does not match \[N, HO, V, K\] = "
                 r"\[4, 8, 128, 64\]"),
    ("final-N", dict(output_final_state=True, final_state=state(rows=N - 1)), ValueError,
     r"^final_state: shape \[3, 8, 128, 64\]"),
    ("final-alignment", dict(output_final_state=True, final_state=state(alignment=4)),
     ValueError, "^final_state: base address is 4-byte aligned"),
    # device type
    ("device-argument", dict(device="cpu"), ValueError,
     "^q: tensor is on cuda; expected a cpu tensor"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(kw, exc, match):
    with pytest.raises(exc, match=match):
        check(**kw)


def test_rule_ids_are_unique():
    ids = [r[0] for r in RULES] + [r[0] for r in VALID]
    assert len(ids) == len(set(ids))


def test_final_state_dtype_is_float32():
    assert FINAL_STATE_DTYPE == F32
    s = check(output_final_state=True, final_state=state(dtype=FINAL_STATE_DTYPE))
    assert s.output_final_state and s.state_dtype is None


# --- TensorDescs, meta and CPU tensors alike ----------------------------------------------------
def fused_projection(hq, hk, hv, kd, vd, t=T, dtype=BF, device="cpu", extra=0):
    """q, k, v as column slices of one [T, HQ K + HK K + HV V + extra] projection, viewed as
    rank 3 (token stride = the whole row, head stride = the head dim, innermost stride 1)."""
    width = hq * kd + hk * kd + hv * vd + extra
    proj = torch.empty(t, width, dtype=dtype, device=device)
    a, b = hq * kd, hq * kd + hk * kd
    q = proj[:, :a].view(t, hq, kd)
    k = proj[:, a:b].view(t, hk, kd)
    v = proj[:, b:b + hv * vd].view(t, hv, vd)
    return proj, q, k, v


def real_inputs(hq=HQ, hk=HK, hv=HV, kd=K, vd=V, t=T, n=N, device="cpu", cu_dtype=I32):
    proj, q, k, v = fused_projection(hq, hk, hv, kd, vd, t, device=device)
    ho = max(hq, hv)
    gb = torch.empty(t, 2 * ho, dtype=F32, device=device)  # g and beta: one fused [T, 2 HO]
    cu = torch.arange(0, t + 1, max(t // max(n, 1), 1), dtype=cu_dtype, device=device)[:n + 1]
    return proj, dict(q=q, k=k, v=v, g=gb[:, :ho], beta=gb[:, ho:], cu_seqlens=cu)


@pytest.mark.parametrize("hq,hk,hv", [(1, 1, 1), (4, 4, 16), (4, 16, 16), (16, 4, 4),
                                      (16, 16, 4)])
@pytest.mark.parametrize("kd,vd", [(64, 64), (128, 128), (64, 128)])
@pytest.mark.parametrize("cu_dtype", [I32, I64])
def test_strided_views_of_a_fused_projection(hq, hk, hv, kd, vd, cu_dtype):
    """Real CPU tensors: q, k, v are consumed in place as column slices of one projection;
    a dense batch of N equal sequences is the cu_seqlens [0, L, 2L, ...]."""
    proj, named = real_inputs(hq, hk, hv, kd, vd, cu_dtype=cu_dtype)
    q, k, v = named["q"], named["k"], named["v"]
    assert not q.is_contiguous() and q.stride() == (proj.shape[1], kd, 1)
    assert k.stride() == (proj.shape[1], kd, 1) and v.stride() == (proj.shape[1], vd, 1)
    assert v.data_ptr() - q.data_ptr() == (hq + hk) * kd * 2  # one allocation, no copy
    assert named["cu_seqlens"].tolist() == [0, 32, 64, 96, 128]
    ho = max(hq, hv)
    s = check_gdn_inputs(**named, device="cpu")
    assert (s.T, s.N, s.HQ, s.HK, s.HV, s.HO, s.K, s.V) == (T, N, hq, hk, hv, ho, kd, vd)
    assert s.cu_seqlens_dtype == cu_dtype
    # the same call described by TensorDescs (device type "cpu") and by meta tensors
    descs = {key: TensorDesc.from_tensor(t) for key, t in named.items()}
    assert descs["q"].stride == q.stride() and descs["q"].device == "cpu"
    assert check_gdn_inputs(**descs, device="cpu") == s
    metas = {key: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
             for key, t in named.items()}
    assert check_gdn_inputs(**metas) == s  # meta passes the default (cuda) device type
    # the same shapes as compact CUDA descriptors
    compact = {key: desc(tuple(t.shape), t.dtype) for key, t in named.items()}
    assert check_gdn_inputs(**compact) == s


@pytest.mark.parametrize("make", ["tensor", "desc"])
def test_descs_and_tensors_fail_alike(make):
    """A projection whose row is not a multiple of 16 bytes: refused as a tensor and as its
    TensorDesc with the same message."""
    proj, named = real_inputs()
    odd = torch.empty(T, HQ * K + 4, dtype=BF)[:, :HQ * K].view(T, HQ, K)
    q = odd if make == "tensor" else TensorDesc.from_tensor(odd)
    with pytest.raises(ValueError, match=r"^q: axis-0 stride 260 must be a multiple of 8 "):
        check_gdn_inputs(**{**named, "q": q}, device="cpu")
    # a misaligned base (one element in)
    flat = torch.empty(T * HO * V + 1, dtype=BF)
    o = flat[1:].view(T, HO, V)
    o = o if make == "tensor" else TensorDesc.from_tensor(o)
    with pytest.raises(ValueError, match="^o: base address is 2-byte aligned; 16-byte"):
        check_gdn_inputs(**named, o=o, device="cpu")


def test_states_pools_and_checkpoints_as_tensors():
    proj, named = real_inputs()
    pool = torch.empty(10, HO, V, K, dtype=F32)
    s = check_gdn_inputs(**named, initial_state=pool, state_indices=torch.arange(N, dtype=I32),
                         output_final_state=True, final_state=torch.empty(N, HO, V, K),
                         o=torch.empty(T, HO, V, dtype=BF), device="cpu")
    assert s.pool_rows == 10 and s.uses_pool and s.state_dtype == F32
    for dtype in (BF, F32):
        s = check_gdn_inputs(**named, initial_state=torch.empty(N, HO, V, K, dtype=dtype),
                             checkpoint_every_n_tokens=64,
                             checkpoint_dtype=None if dtype == BF else F32,
                             checkpoints=torch.empty(ROWS, HO, V, K, dtype=dtype), device="cpu")
        assert s.checkpoint_dtype == dtype and s.checkpoint_rows == ROWS
        assert s.state_dtype == dtype
    # a slice of a bigger state buffer: rows of states strided along N
    big = torch.empty(2 * N, HO, V, K)
    s = check_gdn_inputs(**named, initial_state=big[::2], device="cpu")
    assert s.state_dtype == F32


def test_no_device_memory_is_read():
    """Garbage offsets and out-of-range, repeated pool rows pass: values are trusted (they
    live on the device and a CUDA graph replays them); meta tensors have no values at all."""
    proj, named = real_inputs()
    garbage = torch.tensor([5, 3, -1, 10**9, 7], dtype=I32)
    s = check_gdn_inputs(**{**named, "cu_seqlens": garbage}, device="cpu")
    assert s.N == N
    pool = torch.empty(N, HO, V, K)
    s = check_gdn_inputs(**named, initial_state=pool, device="cpu",
                         state_indices=torch.tensor([99, 99, -1, 0], dtype=I32))
    assert s.pool_rows == N
    metas = dict(q=meta(T, HQ, K), k=meta(T, HK, K), v=meta(T, HV, V),
                 g=meta(T, HO, dtype=F32), beta=meta(T, HO, dtype=F32),
                 cu_seqlens=meta(N + 1, dtype=I32))
    s = check_gdn_inputs(**metas, initial_state=meta(8, HO, V, K, dtype=F32),
                         state_indices=meta(N, dtype=I32), o=meta(T, HO, V),
                         output_final_state=True, final_state=meta(N, HO, V, K, dtype=F32))
    assert s.pool_rows == 8


# --- overlap and device rules on real CPU tensors -------------------------------------------------
def outputs(**kw):
    named = dict(o=torch.empty(T, HO, V, dtype=BF), output_final_state=True,
                 final_state=torch.empty(N, HO, V, K))
    return {**named, **kw}


def test_outputs_beside_inputs_in_one_buffer():
    """Disjoint views of one allocation are fine: o in the free columns of the projection.
    (K = V here: check_no_overlap is exact for equally strided views and refuses views of
    different strides whose byte ranges interleave.)"""
    d = 128
    proj, q, k, v = fused_projection(HQ, HK, HV, d, d, extra=HO * d)
    gb = torch.empty(T, 2 * HO)
    cu = torch.zeros(N + 1, dtype=I32)
    o = proj[:, -HO * d:].view(T, HO, d)
    assert o.stride() == v.stride() == q.stride()
    s = check_gdn_inputs(q, k, v, gb[:, :HO], gb[:, HO:], cu, o=o, device="cpu")
    assert s.HO == HO and s.K == s.V == d
    # one head further left, o would take v's last head
    o = proj[:, -HO * d - d:-d].view(T, HO, d)
    with pytest.raises(ValueError, match="^o overlaps v in memory"):
        check_gdn_inputs(q, k, v, gb[:, :HO], gb[:, HO:], cu, o=o, device="cpu")
    # final_state and checkpoints as two halves of one fp32 buffer
    proj, named = real_inputs()
    states = torch.empty(N + ROWS, HO, V, K)
    s = check_gdn_inputs(**named, output_final_state=True, final_state=states[:N],
                         checkpoint_every_n_tokens=64, checkpoint_dtype=F32,
                         checkpoints=states[N:], device="cpu")
    assert s.checkpoint_rows == ROWS
    # inputs may alias each other: k is v's memory (same shape); the initial state (read
    # only without state_indices) may share memory with g
    proj, q, k, v = fused_projection(HQ, HK, HQ, K, K)
    gates = torch.empty(N * HQ * K * K)
    g = gates[:T * HQ].view(T, HQ)
    s = check_gdn_inputs(q, v, v, g, g, torch.zeros(N + 1, dtype=I32), device="cpu",
                         initial_state=gates.view(N, HQ, K, K))
    assert s.state_dtype == F32


def _pool_named():
    """Real CPU inputs, outputs and a state pool of 8 rows, each its own buffer."""
    named = real_inputs()[1]
    return dict(named, **outputs(), initial_state=torch.empty(8, HO, V, K),
                state_indices=torch.arange(N, dtype=I32))


def _alias_args():
    """Real CPU inputs and outputs, each its own buffer, plus spare buffers (keys starting
    with "_") that the cases carve aliasing views from."""
    gb = torch.empty(T, 2 * HO, V, dtype=BF)  # g and (a candidate) o: views of one buffer
    return dict(q=cpu(T, HQ, K), k=cpu(T, HK, K), v=cpu(T, HV, V),
                g=gb.view(-1).view(F32)[:T * HO].view(T, HO), beta=cpu(T, HO, dtype=F32),
                cu_seqlens=torch.zeros(N + 1, dtype=I32), **outputs(),
                initial_state=torch.empty(N, HO, V, K), _gb=gb,
                _states=torch.empty(ROWS + N, HO, V, K), _big=cpu(ROWS * HO * V * K))


ALIASES = [
    # (id, (arguments) -> replaced arguments, message or None: accepted)
    ("o-is-v", lambda r: dict(o=r["v"]),
     "^o overlaps v in memory; outputs must not alias each other or the inputs$"),
    ("o-after-q", lambda r: dict(o=r["_big"][T * HQ * K:][:T * HO * V].view(T, HO, V),
                                 q=r["_big"][:T * HQ * K].view(T, HQ, K)), None),
    ("o-one-token-of-q", lambda r: dict(
        o=r["_big"][:T * HO * V].view(T, HO, V),
        q=r["_big"][T * HO * V - HQ * K:][:T * HQ * K].view(T, HQ, K)), "^o overlaps q in memory"),
    ("k-in-o", lambda r: dict(k=r["o"].view(-1)[-T * HK * K:].view(T, HK, K)),
     "^o overlaps k in memory"),
    ("o-in-g", lambda r: dict(o=r["_gb"][:, :HO]), "^o overlaps g in memory"),
    ("final-is-initial", lambda r: dict(final_state=r["initial_state"]),
     "^final_state overlaps initial_state in memory"),  # the in-place path is the pool
    ("final-beside-checkpoints", lambda r: dict(
        final_state=r["_states"][:N], checkpoint_every_n_tokens=64, checkpoint_dtype=F32,
        checkpoints=r["_states"][N:]), None),
    ("final-one-row-of-checkpoints", lambda r: dict(
        final_state=r["_states"][:N], checkpoint_every_n_tokens=64, checkpoint_dtype=F32,
        checkpoints=r["_states"][N - 1:N - 1 + ROWS]), "^final_state overlaps checkpoints"),
    ("o-in-checkpoints", lambda r: dict(
        checkpoint_every_n_tokens=64, checkpoints=r["_big"].view(ROWS, HO, V, K),
        o=r["_big"][-T * HO * V:].view(T, HO, V)), "^o overlaps checkpoints in memory"),
    ("cu-in-final", lambda r: dict(cu_seqlens=r["final_state"].view(-1).view(I32)[:N + 1]),
     "^final_state overlaps cu_seqlens in memory"),
]


@pytest.mark.parametrize("change,match", [r[1:] for r in ALIASES], ids=[r[0] for r in ALIASES])
def test_outputs_may_not_alias(change, match):
    named = _alias_args()
    check_gdn_inputs(**{key: t for key, t in named.items() if not key.startswith("_")},
                     device="cpu")  # the base is valid
    args = {**named, **change(named)}
    if match is None:  # disjoint: accepted
        check_gdn_inputs(**{key: t for key, t in args.items() if not key.startswith("_")},
                         device="cpu")
        return
    with pytest.raises(ValueError, match=match):
        check_gdn_inputs(**{key: t for key, t in args.items() if not key.startswith("_")},
                         device="cpu")


POOL_ALIASES = [
    ("final-in-pool", lambda r: dict(final_state=r["initial_state"][:N]),
     "^final_state overlaps initial_state in memory"),
    ("o-in-pool", lambda r: dict(o=r["initial_state"].view(-1).view(BF)[:T * HO * V]
                                 .view(T, HO, V)), "^o overlaps initial_state in memory"),
    ("q-in-pool", lambda r: dict(q=r["initial_state"].view(-1).view(BF)[:T * HQ * K]
                                 .view(T, HQ, K)), "^initial_state overlaps q in memory"),
    ("g-in-pool", lambda r: dict(g=r["initial_state"].view(-1)[-T * HO:].view(T, HO)),
     "^initial_state overlaps g in memory"),
    ("indices-in-pool", lambda r: dict(state_indices=r["initial_state"].view(-1).view(I32)[:N]),
     "^initial_state overlaps state_indices in memory"),
    ("cu-in-pool", lambda r: dict(cu_seqlens=r["initial_state"].view(-1).view(I32)[8:8 + N + 1]),
     "^initial_state overlaps cu_seqlens in memory"),
]


@pytest.mark.parametrize("change,match", [r[1:] for r in POOL_ALIASES],
                         ids=[r[0] for r in POOL_ALIASES])
def test_state_pool_aliases_nothing(change, match):
    """The pool is read and written in place: like an output, it may alias no other argument
    (not even an input)."""
    named = _pool_named()
    assert check_gdn_inputs(**named, device="cpu").pool_rows == 8  # the base is valid
    with pytest.raises(ValueError, match=match):
        check_gdn_inputs(**{**named, **change(named)}, device="cpu")


def test_state_pool_beside_other_buffers():
    """A pool next to final_state in one allocation: disjoint rows are fine."""
    proj, named = real_inputs()
    buf = torch.empty(8 + N, HO, V, K)
    s = check_gdn_inputs(**named, initial_state=buf[:8], state_indices=torch.arange(N, dtype=I32),
                         output_final_state=True, final_state=buf[8:], device="cpu")
    assert s.pool_rows == 8
    # without state_indices the same initial_state is an input: g may share its memory
    g = buf.view(-1)[:T * HO].view(T, HO)
    s = check_gdn_inputs(**{**named, "g": g}, initial_state=buf[:N], device="cpu")
    assert s.state_dtype == F32 and not s.uses_pool


def test_one_device():
    proj, named = real_inputs()
    with pytest.raises(ValueError, match="^o is on meta but q is on cpu; all tensors must be on "
                                         "one device"):
        check_gdn_inputs(**named, o=meta(T, HO, V), device="cpu")
    with pytest.raises(ValueError, match="^cu_seqlens is on meta but q is on cpu"):
        check_gdn_inputs(**{**named, "cu_seqlens": meta(N + 1, dtype=I32)}, device="cpu")
    with pytest.raises(ValueError, match="^initial_state is on meta but q is on cpu"):
        check_gdn_inputs(**named, initial_state=meta(N, HO, V, K, dtype=F32), device="cpu")
    # TensorDescs carry no device index: they are never compared
    s = check_gdn_inputs(**{**named, "g": TensorDesc.from_tensor(named["g"])}, device="cpu")
    assert s.N == N


def test_cpu_tensors_are_refused_for_the_gpu():
    proj, named = real_inputs()
    with pytest.raises(ValueError, match="^q: tensor is on cpu; expected a cuda tensor$"):
        check_gdn_inputs(**named)


# --- checkpoint row bound -----------------------------------------------------------------------
@pytest.mark.parametrize("t,n_seq,n,rows", [(0, 0, 64, 0), (0, 5, 64, 5), (128, 4, 64, 6),
                                            (127, 1, 64, 2), (4096, 2, 128, 34),
                                            (1247, 6, 64, 25), (10, 3, 1, 13)])
def test_max_checkpoint_rows(t, n_seq, n, rows):
    assert max_checkpoint_rows(t, n_seq, n) == rows == t // n + n_seq


@pytest.mark.parametrize("args,exc,match", [
    ((-1, 1, 64), ValueError, "^T must be >= 0, got -1"),
    ((64, -1, 64), ValueError, "^N must be >= 0, got -1"),
    ((64, 1, 0), ValueError, "^checkpoint_every_n_tokens must be >= 1, got 0"),
    ((64.0, 1, 64), TypeError, "^T must be an int, got float"),
    ((64, 1, None), TypeError, "^checkpoint_every_n_tokens must be an int, got NoneType"),
])
def test_max_checkpoint_rows_rules(args, exc, match):
    with pytest.raises(exc, match=match):
        max_checkpoint_rows(*args)


@pytest.mark.parametrize("lens,n,exact", [
    ([65, 1, 129], 64, True),       # remainders 1 + 1 + 1 < 64, all nonzero: the bound
    ([7] * 24 + [1] * 8, 64, False),
    ([497, 16, 1, 480, 0, 253], 64, False),
    ([497, 16, 1, 480, 0, 253], 128, False),
    ([64, 128], 64, False),         # multiples of n: no extra rows
    ([], 64, True),
])
def test_bound_holds_for_the_reference(lens, n, exact):
    """The reference's checkpoint series never has more rows than the bound (and reaches it
    when every remainder is nonzero and they add up to less than n)."""
    t = sum(lens)
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=I64)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(t, 1, 2, generator=gen, dtype=F64), torch.randn(t, 1, 2, generator=gen,
                                                                       dtype=F64)
    v = torch.randn(t, 1, 2, generator=gen, dtype=F64)
    g, beta = -torch.rand(t, 1, dtype=F64), torch.rand(t, 1, dtype=F64)
    res = gdn_chunked_reference(q, k, v, g, beta, cu, checkpoint_every_n_tokens=n,
                                use_qk_l2norm_in_kernel=True)
    got = res["checkpoints"].shape[0]
    assert got == sum(-(-length // n) for length in lens)
    bound = max_checkpoint_rows(t, len(lens), n)
    assert got <= bound and (got == bound) is exact
    # the rules ask the op's checkpoints buffer for exactly the bound
    s = check_gdn_inputs(**inputs(t=t, n=len(lens)), checkpoint_every_n_tokens=n)
    assert s.checkpoint_rows == bound
