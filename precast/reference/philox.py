"""Philox4x32-10 counter-based RNG (Random123 / curand flavour) and the
dropout keep decision built on it.

Two implementations are provided: a vectorized torch one (works on any device,
uses only int64 arithmetic) and a naive pure-Python one used to cross-check it.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

__all__ = [
    "PHILOX_M0",
    "PHILOX_M1",
    "PHILOX_W0",
    "PHILOX_W1",
    "philox4x32_10",
    "philox4x32_10_scalar",
    "seed_to_key",
    "keep_threshold",
    "dropout_keep",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9  # golden ratio
PHILOX_W1 = 0xBB67AE85  # sqrt(3) - 1
PHILOX_ROUNDS = 10

_MASK32 = 0xFFFFFFFF
_MASK16 = 0xFFFF


def _check_u32(value: int, what: str) -> int:
    value = operator.index(value)
    if not 0 <= value <= _MASK32:
        raise ValueError(f"{what} must be a uint32 value, got {value}")
    return value


def _check_key(key) -> tuple[int, int]:
    if len(key) != 2:
        raise ValueError(f"key must have 2 words, got {len(key)}")
    return _check_u32(key[0], "key[0]"), _check_u32(key[1], "key[1]")


# ---------------------------------------------------------------------------
# Naive scalar version
# ---------------------------------------------------------------------------


def philox4x32_10_scalar(counter, key) -> tuple[int, int, int, int]:
    """Pure-Python Philox4x32-10 of one counter block (Python ints are exact)."""
    if len(counter) != 4:
        raise ValueError(f"counter must have 4 words, got {len(counter)}")
    c0, c1, c2, c3 = (_check_u32(c, "counter word") for c in counter)
    k0, k1 = _check_key(key)
    for _ in range(PHILOX_ROUNDS):
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        hi0, lo0 = p0 >> 32, p0 & _MASK32
        hi1, lo1 = p1 >> 32, p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return c0, c1, c2, c3


# ---------------------------------------------------------------------------
# Vectorized torch version
# ---------------------------------------------------------------------------


def _mulhilo32(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product m * c, m and c uint32.

    The full product can reach ~2^64 and overflow signed int64, so c is split
    into 16-bit halves: m * c = (m * c_hi) * 2^16 + m * c_lo, each partial
    product < 2^48.
    """
    p_hi = m * (c >> 16)  # < 2^48
    p_lo = m * (c & _MASK16)  # < 2^48
    # Low 16 bits of p_hi land in bits 16..31 of the result; the sum is < 2^49.
    t = p_lo + ((p_hi & _MASK16) << 16)
    lo = t & _MASK32
    hi = (p_hi >> 16) + (t >> 32)  # mathematically < 2^32
    return hi, lo


def philox4x32_10(counter: torch.Tensor, key) -> torch.Tensor:
    """Vectorized Philox4x32-10.

    counter: int64 tensor of shape (..., 4) holding uint32 values.
    key: (k0, k1) uint32 Python ints.
    Returns an int64 tensor of shape (..., 4) holding the uint32 output words.
    """
    if counter.dtype != torch.int64:
        raise TypeError(f"counter must be int64, got {counter.dtype}")
    if counter.shape[-1:] != (4,):
        raise ValueError(f"counter must have shape (..., 4), got {tuple(counter.shape)}")
    k0, k1 = _check_key(key)
    c0, c1, c2, c3 = (counter[..., i] & _MASK32 for i in range(4))
    for _ in range(PHILOX_ROUNDS):
        hi0, lo0 = _mulhilo32(PHILOX_M0, c0)
        hi1, lo1 = _mulhilo32(PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _MASK32
        k1 = (k1 + PHILOX_W1) & _MASK32
    return torch.stack((c0, c1, c2, c3), dim=-1)


# ---------------------------------------------------------------------------
# Seed / threshold / dropout helpers
# ---------------------------------------------------------------------------


def seed_to_key(seed: int) -> tuple[int, int]:
    """Split a signed 64-bit seed (two's complement) into the Philox key."""
    if isinstance(seed, bool):
        raise TypeError("seed must be an int, not bool")
    seed = operator.index(seed)
    if not -(1 << 63) <= seed < (1 << 63):
        raise ValueError(f"seed must be a signed 64-bit integer, got {seed}")
    bits = seed & 0xFFFFFFFFFFFFFFFF  # Python '&' yields the two's complement bits
    return bits & _MASK32, (bits >> 32) & _MASK32


def _u32_to_unit_f32(u: int) -> np.float32:
    # u * 2^-32 is exact in float64 (u has <= 33 significant bits); the single
    # rounding happens in the float32 conversion (round to nearest even), which
    # equals float32(u) * 2^-32 as a kernel would compute it.
    return np.float32(np.float64(u) * 2.0**-32)


def keep_threshold(p: float) -> int:
    """Smallest uint32 T with float32(T * 2^-32) > float32(p).

    An element is kept iff its random word r satisfies r >= T, i.e. iff the
    float32 uniform r * 2^-32 is > p.
    """
    p32 = np.float32(p)
    if not (np.isfinite(p32) and 0.0 <= p32 < 1.0):
        raise ValueError(f"dropout ratio must be in [0, 1) as float32, got {p!r}")
    # float32(u * 2^-32) is non-decreasing in u, so bisect on u.  At u = 2^32 the
    # value is 1.0 > p32, so a solution <= 2^32 - 1 always exists for p32 < 1:
    # the largest float32 below 1 is 1 - 2^-24 and (2^32 - 1) * 2^-32 rounds to 1.
    lo, hi = 0, 1 << 32  # invariant: f(lo - 1) <= p32 (or lo == 0), f(hi) > p32
    while lo < hi:
        mid = (lo + hi) // 2
        if _u32_to_unit_f32(mid) > p32:
            hi = mid
        else:
            lo = mid + 1
    if lo > _MASK32:  # unreachable for p32 < 1; guards the invariant above
        raise AssertionError(f"no uint32 threshold for p={p!r}")
    return lo


def dropout_keep(
    rows: int,
    cols: int,
    plane: int,
    seed: int,
    p: float,
    device: torch.device | str | None = "cpu",
) -> torch.Tensor:
    """Bool keep-tensor (rows, cols) for one dropout plane.

    Element (r, c) uses counter (r, c // 4, plane, 0) and output word c % 4.
    """
    rows, cols, plane = operator.index(rows), operator.index(cols), operator.index(plane)
    if rows < 0 or cols < 0:
        raise ValueError(f"rows/cols must be non-negative, got {rows}, {cols}")
    if rows > _MASK32 + 1 or (cols + 3) // 4 > _MASK32 + 1:
        raise ValueError("rows / column groups exceed the 32-bit counter range")
    _check_u32(plane, "plane")
    key = seed_to_key(seed)
    threshold = keep_threshold(p)
    groups = (cols + 3) // 4
    r = torch.arange(rows, dtype=torch.int64, device=device)
    g = torch.arange(groups, dtype=torch.int64, device=device)
    counter = torch.zeros(rows, groups, 4, dtype=torch.int64, device=device)
    counter[..., 0] = r[:, None]
    counter[..., 1] = g[None, :]
    counter[..., 2] = plane
    words = philox4x32_10(counter, key).reshape(rows, groups * 4)[:, :cols]
    return words >= threshold
