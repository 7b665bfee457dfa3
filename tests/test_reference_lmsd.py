"""CPU tests of the LMSD reference implementation and its Philox RNG."""

import itertools
import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from precast.reference.lmsd import (
    lmsd_backward_reference,
    lmsd_forward_naive,
    lmsd_forward_reference,
    lmsd_mask,
    segment_count,
)
from precast.reference.philox import (
    dropout_keep,
    keep_threshold,
    philox4x32_10,
    philox4x32_10_scalar,
    seed_to_key,
)

U32 = 0xFFFFFFFF
EPS = 1e-5


# ---------------------------------------------------------------------------
# Philox
# ---------------------------------------------------------------------------

# Known-answer vectors for Philox4x32-10 from the Random123 distribution.
PHILOX_KATS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((U32, U32, U32, U32), (U32, U32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KATS)
def test_philox_kat_scalar(counter, key, expected):
    assert philox4x32_10_scalar(counter, key) == expected


@pytest.mark.parametrize("counter,key,expected", PHILOX_KATS)
def test_philox_kat_vectorized(counter, key, expected):
    out = philox4x32_10(torch.tensor(counter, dtype=torch.int64), key)
    assert tuple(out.tolist()) == expected


def _random_counters(rng: random.Random, n: int) -> list:
    edge = [0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFF, 0x10000, U32 - 1, U32]
    counters = [tuple(rng.choice(edge) for _ in range(4)) for _ in range(n // 2)]
    counters += [tuple(rng.getrandbits(32) for _ in range(4)) for _ in range(n - n // 2)]
    return counters


@pytest.mark.parametrize(
    "key", [(0, 0), (U32, U32), (0x80000000, 0x7FFFFFFF), (0x12345678, 0x9ABCDEF0)]
)
def test_philox_vectorized_matches_scalar(key):
    rng = random.Random(hash(key) & U32)
    counters = _random_counters(rng, 256)
    out = philox4x32_10(torch.tensor(counters, dtype=torch.int64).reshape(16, 16, 4), key)
    assert out.shape == (16, 16, 4)
    got = [tuple(v) for v in out.reshape(-1, 4).tolist()]
    assert got == [philox4x32_10_scalar(c, key) for c in counters]
    assert int(out.min()) >= 0 and int(out.max()) <= U32


def test_philox_vectorized_matches_scalar_random_keys():
    rng = random.Random(7)
    for _ in range(8):
        key = (rng.getrandbits(32), rng.getrandbits(32))
        counters = _random_counters(rng, 32)
        out = philox4x32_10(torch.tensor(counters, dtype=torch.int64), key).tolist()
        assert [tuple(v) for v in out] == [philox4x32_10_scalar(c, key) for c in counters]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_philox_cuda_matches_cpu():
    rng = random.Random(3)
    counters = torch.tensor(_random_counters(rng, 4096), dtype=torch.int64)
    key = (0xDEADBEEF, U32)
    cpu = philox4x32_10(counters, key)
    gpu = philox4x32_10(counters.cuda(), key).cpu()
    assert torch.equal(cpu, gpu)


def test_seed_to_key():
    assert seed_to_key(0) == (0, 0)
    assert seed_to_key(0x0123456789ABCDEF) == (0x89ABCDEF, 0x01234567)
    assert seed_to_key(-1) == (U32, U32)
    assert seed_to_key(-(1 << 63)) == (0, 0x80000000)
    assert seed_to_key((1 << 63) - 1) == (U32, 0x7FFFFFFF)
    for bad in (1 << 63, -(1 << 63) - 1):
        with pytest.raises(ValueError):
            seed_to_key(bad)


# ---------------------------------------------------------------------------
# Keep threshold
# ---------------------------------------------------------------------------


def _unit_f32(u: int) -> np.float32:
    return np.float32(np.float64(u) * 2.0**-32)


PS = [1e-7, 0.1, 0.25, 0.5, 0.9, 0.999999]


@pytest.mark.parametrize("p", PS)
def test_keep_threshold_definition(p):
    t = keep_threshold(p)
    p32 = np.float32(p)
    assert 1 <= t <= U32
    assert _unit_f32(t) > p32
    assert _unit_f32(t - 1) <= p32


def test_keep_threshold_monotonic_and_exact_values():
    ts = [keep_threshold(p) for p in PS]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    # 0.5 is exact; the next float32 up is 0.5 + 2^-24 and 2^31 + 128 ties to 0.5.
    assert keep_threshold(0.5) == (1 << 31) + 129
    assert keep_threshold(0.0) == 1
    for bad in (-0.1, 1.0, 0.99999999, float("nan")):
        with pytest.raises(ValueError):
            keep_threshold(bad)


# ---------------------------------------------------------------------------
# Mask
# ---------------------------------------------------------------------------


def _scalar_keep(row, col, plane, seed, p):
    word = philox4x32_10_scalar((row, col // 4, plane, 0), seed_to_key(seed))[col % 4]
    return bool(_unit_f32(word) > np.float32(p))


@pytest.mark.parametrize("seed", [0, 1234567, -1, -(1 << 63), (1 << 63) - 1])
def test_mask_bits_match_scalar_philox(seed):
    N, D, p = 7, 30, 0.3  # D not a multiple of 4
    mask = lmsd_mask(N, D, seed, p, concat_u=True, concat_x=True, device="cpu")
    assert mask.dtype == torch.int8 and mask.shape == (N, D)
    points = [(0, 0), (0, 3), (1, 5), (2, 29), (6, 28), (6, 13), (3, 17), (5, 2)]
    for row, col in points:
        for plane in range(3):
            bit = (int(mask[row, col]) >> plane) & 1
            assert bit == _scalar_keep(row, col, plane, seed, p), (row, col, plane)
    assert int(mask.max()) <= 7 and int(mask.min()) >= 0


def test_mask_disabled_segments_clear():
    N, D, p, seed = 16, 20, 0.5, 99
    full = lmsd_mask(N, D, seed, p, True, True)
    assert lmsd_mask(N, D, seed, 0.0, True, True) is None
    for cu, cx in itertools.product([False, True], repeat=2):
        m = lmsd_mask(N, D, seed, p, cu, cx)
        enabled = 1 | (2 if cx else 0) | (4 if cu else 0)
        assert int((m & ~enabled).abs().sum()) == 0
        # Each segment's decisions do not depend on which other segments exist.
        assert torch.equal(m, full & enabled)


def test_mask_seed_dependence():
    a = lmsd_mask(32, 64, 1, 0.5, True, True)
    b = lmsd_mask(32, 64, 2, 0.5, True, True)
    c = lmsd_mask(32, 64, -2, 0.5, True, True)
    assert torch.equal(a, lmsd_mask(32, 64, 1, 0.5, True, True))
    assert not torch.equal(a, b) and not torch.equal(b, c)
    # Planes are independent streams.
    assert not torch.equal(a & 1, (a >> 1) & 1)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_keep_rate_binomial(p):
    rows, cols = 256, 250
    n = rows * cols
    sigma = math.sqrt(p * (1 - p) / n)
    for plane in range(3):
        keep = dropout_keep(rows, cols, plane, seed=20240607, p=p)
        assert keep.dtype == torch.bool and keep.shape == (rows, cols)
        rate = keep.double().mean().item()
        assert abs(rate - (1 - p)) < 6 * sigma, (plane, rate)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def _inputs(N, D, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g, dtype=dtype) * 2 + 0.5
    u = torch.randn(N, D, generator=g, dtype=dtype) * 3
    w = torch.randn(D, generator=g, dtype=dtype)
    b = torch.randn(D, generator=g, dtype=dtype)
    return x, u, w, b


CONFIGS = list(itertools.product([False, True], repeat=3))  # apply_u_silu, concat_u, concat_x


@pytest.mark.parametrize("N,D", [(1, 8), (3, 24), (5, 8)])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("silu,cu,cx", CONFIGS)
def test_forward_matches_naive(N, D, p, silu, cu, cx):
    x, u, w, b = _inputs(N, D, seed=N * 100 + D)
    seed = -123456789012345
    args = (x, u, w, b, EPS, p, seed, silu, cu, cx)
    y, mean, rstd, mask = lmsd_forward_reference(*args, compute_dtype=torch.float64)
    y_n, mean_n, rstd_n, mask_n = lmsd_forward_naive(*args)
    assert y.shape == (N, segment_count(cu, cx) * D) and y.dtype == torch.float64
    torch.testing.assert_close(y, y_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mean, mean_n, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(rstd, rstd_n, rtol=1e-12, atol=1e-12)
    if p == 0.0:
        assert mask is None and mask_n is None
    else:
        assert torch.equal(mask, mask_n)


def test_forward_given_mask_and_segment_layout():
    N, D, p = 4, 16, 0.4
    x, u, w, b = _inputs(N, D)
    f64 = torch.float64
    y, _, _, mask = lmsd_forward_reference(x, u, w, b, EPS, p, 5, True, True, True, compute_dtype=f64)
    # An explicit mask is applied as given (here: keep-all and the generated one).
    y2, _, _, m2 = lmsd_forward_reference(
        x, u, w, b, EPS, p, 999, True, True, True, mask=mask, compute_dtype=f64
    )
    assert torch.equal(y, y2) and m2 is mask
    keep_all = torch.full((N, D), 7, dtype=torch.int8)
    y3, _, _, _ = lmsd_forward_reference(
        x, u, w, b, EPS, p, 5, True, True, True, mask=keep_all, compute_dtype=f64
    )
    s = 1 / (1 - p)
    a = F.silu(u)
    ln = F.layer_norm(x, (D,), w, b, EPS)
    torch.testing.assert_close(y3[:, :D], a * s)
    torch.testing.assert_close(y3[:, D : 2 * D], x * s)
    torch.testing.assert_close(y3[:, 2 * D :], ln * a * s)
    with pytest.raises(ValueError):
        lmsd_forward_reference(x, u, w, b, EPS, 0.0, 5, True, True, True, mask=keep_all)


def test_forward_low_precision_inputs_upcast():
    N, D = 6, 32
    x, u, w, b = (t.to(torch.bfloat16) for t in _inputs(N, D))
    y, mean, rstd, _ = lmsd_forward_reference(x, u, w, b, EPS, 0.2, 11, True, False, True)
    assert y.dtype == mean.dtype == rstd.dtype == torch.float32
    ref, mean64, rstd64, _ = lmsd_forward_reference(
        x.double(), u.double(), w.double(), b.double(), EPS, 0.2, 11, True, False, True,
        compute_dtype=torch.float64,
    )
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean.double(), mean64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def _autograd_grads(dy, x, u, w, b, mask, p, silu, cu, cx):
    """Gradients by autograd through a float64 torch-op forward with a fixed mask."""
    x, u, w, b = (t.detach().clone().requires_grad_(True) for t in (x, u, w, b))
    D = x.shape[1]
    ln = F.layer_norm(x, (D,), w, b, EPS)
    a = F.silu(u) if silu else u
    if p > 0:
        s = 1.0 / (1.0 - p)
        keep = [((mask >> k) & 1).double() * s for k in range(3)]
    else:
        keep = [1.0, 1.0, 1.0]
    segs = ([a * keep[2]] if cu else []) + ([x * keep[1]] if cx else []) + [ln * a * keep[0]]
    y = torch.cat(segs, dim=-1)
    (y * dy).sum().backward()
    return x.grad, u.grad, w.grad, b.grad


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("silu,cu,cx", CONFIGS)
def test_backward_matches_autograd(p, silu, cu, cx):
    N, D = 5, 24
    x, u, w, b = _inputs(N, D, seed=3)
    f64 = torch.float64
    _, mean, rstd, mask = lmsd_forward_reference(
        x, u, w, b, EPS, p, 77, silu, cu, cx, compute_dtype=f64
    )
    dy = torch.randn(N, segment_count(cu, cx) * D, dtype=f64, generator=torch.Generator().manual_seed(4))
    dx, du, dw, db = lmsd_backward_reference(
        dy, x, u, w, b, mean, rstd, mask, p, silu, cu, cx, compute_dtype=f64
    )
    gx, gu, gw, gb = _autograd_grads(dy, x, u, w, b, mask, p, silu, cu, cx)
    for got, want in ((dx, gx), (du, gu), (dw, gw), (db, gb)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)

    dx2, du2, dw2, db2 = lmsd_backward_reference(
        dy, x, u, w, b, mean, rstd, mask, p, silu, cu, cx, compute_dweight=False,
        compute_dtype=f64,
    )
    assert dw2 is None
    assert torch.equal(dx2, dx) and torch.equal(du2, du) and torch.equal(db2, db)


def test_padded_strides_match_contiguous():
    N, D, p, seed = 6, 24, 0.25, 31
    silu, cu, cx = True, True, True
    S = segment_count(cu, cx)
    x, u, w, b = _inputs(N, D, seed=9)
    dy = torch.randn(N, S * D, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    # Row strides larger than D, plus a non-unit stride for weight.
    x_p = torch.zeros(N, D + 8, dtype=torch.float64)
    x_p[:, 3 : 3 + D] = x
    u_p = torch.zeros(N, D + 5, dtype=torch.float64)
    u_p[:, :D] = u
    dy_p = torch.zeros(N, S * D + 7, dtype=torch.float64)
    dy_p[:, 2 : 2 + S * D] = dy
    w_p = torch.zeros(2 * D, dtype=torch.float64)
    w_p[::2] = w
    xs, us, dys, ws = x_p[:, 3 : 3 + D], u_p[:, :D], dy_p[:, 2 : 2 + S * D], w_p[::2]
    assert not xs.is_contiguous() and not ws.is_contiguous()

    f64 = torch.float64
    fwd = lmsd_forward_reference(x, u, w, b, EPS, p, seed, silu, cu, cx, compute_dtype=f64)
    fwd_s = lmsd_forward_reference(xs, us, ws, b, EPS, p, seed, silu, cu, cx, compute_dtype=f64)
    for a_, b_ in zip(fwd, fwd_s):
        torch.testing.assert_close(a_, b_, rtol=1e-14, atol=1e-14)
    _, mean, rstd, mask = fwd
    bwd = lmsd_backward_reference(dy, x, u, w, b, mean, rstd, mask, p, silu, cu, cx, compute_dtype=f64)
    bwd_s = lmsd_backward_reference(
        dys, xs, us, ws, b, mean, rstd, mask, p, silu, cu, cx, compute_dtype=f64
    )
    for a_, b_ in zip(bwd, bwd_s):
        torch.testing.assert_close(a_, b_, rtol=1e-14, atol=1e-14)
