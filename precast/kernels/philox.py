"""Philox4x32-10 counter-based RNG on the device (Random123 constants).

The host-side twin lives in ``precast.reference.philox``; tests compare the two bit for bit.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Uint32, Uint64

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10


@cute.jit
def _mulhilo(a: Uint32, b: Uint32):
    # One IMAD.WIDE.U32 gives both halves of the 64-bit product.
    wide = cute.arch.mul_wide(a, b)
    return Uint32(wide >> Uint64(32)), Uint32(wide)


@cute.jit
def philox4x32_10(c0: Uint32, c1: Uint32, c2: Uint32, c3: Uint32, k0: Uint32, k1: Uint32):
    """Returns the four 32-bit output words for counter (c0..c3) and key (k0, k1)."""
    for r in cutlass.range_constexpr(PHILOX_ROUNDS):
        if cutlass.const_expr(r > 0):
            k0 = k0 + Uint32(PHILOX_W0)
            k1 = k1 + Uint32(PHILOX_W1)
        hi0, lo0 = _mulhilo(Uint32(PHILOX_M0), c0)
        hi1, lo1 = _mulhilo(Uint32(PHILOX_M1), c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3
