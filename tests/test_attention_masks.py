"""The attention kernels' keep-bit -> packed-pair AND masks (attention_sm90.pair_mask_steps),
checked on the host with an emulated prmt against the per-column definition."""
import random

import pytest

pytest.importorskip("cutlass")

from precast.kernels.attention_sm90 import pair_mask_steps  # noqa: E402


def prmt(a: int, b: int, selector: int) -> int:
    """PTX prmt.b32 (default mode): bytes of {b, a} by selector nibbles; bit 3 of a nibble
    replicates the selected byte's top bit over the output byte."""
    source = a | b << 32
    out = 0
    for i in range(4):
        nibble = selector >> 4 * i & 0xF
        byte = source >> 8 * (nibble & 7) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


@pytest.mark.parametrize("groups", [8, 16])  # 64- and 128-column masked tiles
def test_every_pair_gets_its_two_columns(groups):
    steps = [(g, lo, hi, sel) for lo, hi, pairs in pair_mask_steps(groups) for g, sel in pairs]
    assert sorted(g for g, *_ in steps) == list(range(groups))
    rng = random.Random(groups)
    words = [0, (1 << 2 * groups) - 1] + [rng.getrandbits(2 * groups) for _ in range(2000)]
    for keep in words:
        for g, lo_shift, hi_shift, selector in steps:
            mask = prmt(keep << lo_shift & 0xFFFFFFFF, keep << hi_shift & 0xFFFFFFFF, selector)
            expected = (0xFFFF if keep >> 2 * g & 1 else 0) | (
                0xFFFF0000 if keep >> 2 * g + 1 & 1 else 0)
            assert mask == expected, (hex(keep), g)


def test_groups_must_come_in_fours():
    with pytest.raises(AssertionError):
        pair_mask_steps(6)
