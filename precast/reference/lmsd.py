"""Reference HSTU LMSD: LayerNorm -> Multiply -> SiLU -> Dropout.

Per row of x (N, D):
    ln   = LayerNorm(x) * weight + bias      (biased variance)
    a    = SiLU(u) if apply_u_silu else u
    y    = concat([dropout(a)?, dropout(x)?, dropout(ln * a)], dim=-1)

Dropout is inverted and decided per element and per segment by Philox4x32-10
(see ``philox.py``); the decisions are packed in an int8 mask per element of x:
bit 0 main segment, bit 1 x segment, bit 2 a (u) segment.

The vectorized functions are the ones tests and benchmarks compare kernels
against; ``lmsd_forward_naive`` is a slow loop version that only exists to
cross-check them on tiny inputs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .philox import dropout_keep, philox4x32_10_scalar, seed_to_key

__all__ = [
    "PLANE_MAIN",
    "PLANE_X",
    "PLANE_U",
    "segment_count",
    "lmsd_mask",
    "lmsd_forward_reference",
    "lmsd_backward_reference",
    "lmsd_forward_naive",
]

# Philox counter plane == mask bit index of each segment.
PLANE_MAIN = 0
PLANE_X = 1
PLANE_U = 2


def segment_count(concat_u: bool, concat_x: bool) -> int:
    """Number of D-wide segments in the output: main + optional u and x."""
    return 1 + int(bool(concat_u)) + int(bool(concat_x))


def _check_ratio(dropout_ratio: float) -> float:
    p = float(dropout_ratio)
    # Validate on the float32 value too: the keep threshold is computed from it.
    if not (math.isfinite(p) and 0.0 <= p < 1.0 and np.float32(p) < 1.0):
        raise ValueError(f"dropout_ratio must be in [0, 1), got {dropout_ratio!r}")
    return p


def lmsd_mask(
    N: int,
    D: int,
    seed: int,
    dropout_ratio: float,
    concat_u: bool,
    concat_x: bool,
    device: torch.device | str | None = "cpu",
) -> torch.Tensor | None:
    """Packed int8 keep-mask (N, D), or None when dropout is disabled (p == 0)."""
    p = _check_ratio(dropout_ratio)
    if p == 0.0:
        return None
    mask = dropout_keep(N, D, PLANE_MAIN, seed, p, device).to(torch.int8)
    if concat_x:
        mask |= dropout_keep(N, D, PLANE_X, seed, p, device).to(torch.int8) << PLANE_X
    if concat_u:
        mask |= dropout_keep(N, D, PLANE_U, seed, p, device).to(torch.int8) << PLANE_U
    return mask


def _check_mask(mask: torch.Tensor | None, p: float, N: int, D: int) -> None:
    if p == 0.0:
        if mask is not None:
            raise ValueError("mask must be None when dropout_ratio == 0")
        return
    if mask is None:
        raise ValueError("mask is required when dropout_ratio > 0")
    if mask.shape != (N, D):
        raise ValueError(f"mask must have shape {(N, D)}, got {tuple(mask.shape)}")
    if mask.dtype not in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"mask must be an integer tensor, got {mask.dtype}")


def _keep_scale(mask: torch.Tensor, bit: int, s: float, dtype: torch.dtype) -> torch.Tensor:
    """Per-element dropout multiplier for one segment: s where kept, 0 where dropped."""
    return ((mask >> bit) & 1).to(dtype) * s


def _check_shapes(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (N, D), got shape {tuple(x.shape)}")
    N, D = x.shape
    if u.shape != (N, D):
        raise ValueError(f"u must have shape {(N, D)}, got {tuple(u.shape)}")
    if weight.shape != (D,) or bias.shape != (D,):
        raise ValueError(
            f"weight/bias must have shape {(D,)}, got {tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    return N, D


def lmsd_forward_reference(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_ratio: float,
    seed: int,
    apply_u_silu: bool,
    concat_u: bool,
    concat_x: bool,
    mask: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Vectorized LMSD forward.

    Returns (y (N, S*D), mean (N,), rstd (N,), mask (N, D) int8 or None), all
    floats in ``compute_dtype``. If ``mask`` is None and dropout is on, the
    Philox mask for ``seed`` is generated; otherwise the given mask is applied
    (lets GPU tests reuse the kernel's own mask).
    """
    p = _check_ratio(dropout_ratio)
    N, D = _check_shapes(x, u, weight, bias)
    if mask is None and p > 0.0:
        mask = lmsd_mask(N, D, seed, p, concat_u, concat_x, x.device)
    _check_mask(mask, p, N, D)

    xc = x.to(compute_dtype)
    uc = u.to(compute_dtype)
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype)

    mean = xc.mean(dim=-1)
    xm = xc - mean[:, None]
    var = (xm * xm).mean(dim=-1)  # biased, as LayerNorm
    rstd = torch.rsqrt(var + eps)
    ln = xm * rstd[:, None] * w + b
    a = F.silu(uc) if apply_u_silu else uc

    main = ln * a
    x_seg = xc
    a_seg = a
    if p > 0.0:
        s = 1.0 / (1.0 - p)
        main = main * _keep_scale(mask, PLANE_MAIN, s, compute_dtype)
        if concat_x:
            x_seg = x_seg * _keep_scale(mask, PLANE_X, s, compute_dtype)
        if concat_u:
            a_seg = a_seg * _keep_scale(mask, PLANE_U, s, compute_dtype)

    segments = []
    if concat_u:
        segments.append(a_seg)
    if concat_x:
        segments.append(x_seg)
    segments.append(main)
    y = torch.cat(segments, dim=-1)
    return y, mean, rstd, mask


def lmsd_backward_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_ratio: float,
    apply_u_silu: bool,
    concat_u: bool,
    concat_x: bool,
    compute_dweight: bool = True,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Closed-form LMSD backward given the forward's mask and saved mean/rstd.

    Returns (dx (N, D), du (N, D), dweight (D,) or None, dbias (D,)) in
    ``compute_dtype``.
    """
    p = _check_ratio(dropout_ratio)
    N, D = _check_shapes(x, u, weight, bias)
    S = segment_count(concat_u, concat_x)
    if dy.shape != (N, S * D):
        raise ValueError(f"dy must have shape {(N, S * D)}, got {tuple(dy.shape)}")
    if mean.shape != (N,) or rstd.shape != (N,):
        raise ValueError(f"mean/rstd must have shape {(N,)}")
    _check_mask(mask, p, N, D)

    dyc = dy.to(compute_dtype)
    xc = x.to(compute_dtype)
    uc = u.to(compute_dtype)
    w = weight.to(compute_dtype)
    b = bias.to(compute_dtype)
    mean_c = mean.to(compute_dtype)[:, None]
    rstd_c = rstd.to(compute_dtype)[:, None]

    # Segment order in y is [a?, x?, main].
    seg = 0
    dy_a = dy_x = None
    if concat_u:
        dy_a = dyc[:, seg * D : (seg + 1) * D]
        seg += 1
    if concat_x:
        dy_x = dyc[:, seg * D : (seg + 1) * D]
        seg += 1
    dy_main = dyc[:, seg * D : (seg + 1) * D]

    if p > 0.0:
        s = 1.0 / (1.0 - p)
        g = dy_main * _keep_scale(mask, PLANE_MAIN, s, compute_dtype)
        if concat_u:
            dy_a = dy_a * _keep_scale(mask, PLANE_U, s, compute_dtype)
        if concat_x:
            dy_x = dy_x * _keep_scale(mask, PLANE_X, s, compute_dtype)
    else:
        g = dy_main

    # Recompute the forward intermediates from the saved statistics.
    xhat = (xc - mean_c) * rstd_c
    ln = xhat * w + b
    if apply_u_silu:
        sig = torch.sigmoid(uc)
        a = uc * sig
    else:
        a = uc

    d_ln = g * a
    d_a = g * ln
    if concat_u:
        d_a = d_a + dy_a
    du = d_a * (sig * (1.0 + uc * (1.0 - sig))) if apply_u_silu else d_a

    dweight = (d_ln * xhat).sum(dim=0) if compute_dweight else None
    dbias = d_ln.sum(dim=0)

    dxhat = d_ln * w
    c1 = dxhat.mean(dim=-1, keepdim=True)
    c2 = (dxhat * xhat).mean(dim=-1, keepdim=True)
    dx = rstd_c * (dxhat - c1 - xhat * c2)
    if concat_x:
        dx = dx + dy_x
    return dx, du, dweight, dbias


def lmsd_forward_naive(
    x: torch.Tensor,
    u: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    dropout_ratio: float,
    seed: int,
    apply_u_silu: bool,
    concat_u: bool,
    concat_x: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Deliberately simple loop version in float64 (tiny sizes only).

    Uses the scalar Philox and its own float32 keep comparison, so it checks the
    vectorized reference, ``keep_threshold`` and ``dropout_keep`` independently.
    """
    p = _check_ratio(dropout_ratio)
    N, D = _check_shapes(x, u, weight, bias)
    S = segment_count(concat_u, concat_x)
    xs = x.double().tolist()
    us = u.double().tolist()
    ws = weight.double().tolist()
    bs = bias.double().tolist()
    key = seed_to_key(seed)
    p32 = np.float32(p)
    scale = 1.0 / (1.0 - p)

    def keep(row: int, col: int, plane: int) -> bool:
        word = philox4x32_10_scalar((row, col // 4, plane, 0), key)[col % 4]
        return bool(np.float32(word * 2.0**-32) > p32)

    y = [[0.0] * (S * D) for _ in range(N)]
    means = [0.0] * N
    rstds = [0.0] * N
    mask = [[0] * D for _ in range(N)]
    # Output column offsets of each segment, order [a?, x?, main].
    off_a = 0
    off_x = D if concat_u else 0
    off_main = (S - 1) * D
    for i in range(N):
        m = sum(xs[i]) / D
        var = sum((v - m) ** 2 for v in xs[i]) / D
        r = 1.0 / math.sqrt(var + eps)
        means[i], rstds[i] = m, r
        for j in range(D):
            ln = (xs[i][j] - m) * r * ws[j] + bs[j]
            uv = us[i][j]
            a = uv / (1.0 + math.exp(-uv)) if apply_u_silu else uv
            segs = [(PLANE_MAIN, off_main, ln * a)]
            if concat_x:
                segs.append((PLANE_X, off_x, xs[i][j]))
            if concat_u:
                segs.append((PLANE_U, off_a, a))
            for plane, off, val in segs:
                if p > 0.0:
                    if keep(i, j, plane):
                        mask[i][j] |= 1 << plane
                        val = val * scale
                    else:
                        val = 0.0
                y[i][off + j] = val

    f64 = torch.float64
    mask_t = torch.tensor(mask, dtype=torch.int8).reshape(N, D) if p > 0.0 else None
    return (
        torch.tensor(y, dtype=f64).reshape(N, S * D),
        torch.tensor(means, dtype=f64),
        torch.tensor(rstds, dtype=f64),
        mask_t,
    )
