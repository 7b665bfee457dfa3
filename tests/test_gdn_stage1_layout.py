"""Stage 1's fp32 A tile in shared memory (precast/kernels/gdn_chunk_sm90.py): its rows never
overlap, stay 16-byte aligned, and every access pattern of the kernel is free of bank
conflicts (32 banks of 4 bytes; a 4-, 8- or 16-byte access serves 32, 16 or 8 lanes per
wavefront). The patterns are the tf32 m16n8k8 fragments of the inverse's products, the
64 x 64 accumulator pairs of the score epilogue and the 16-byte row loads."""
import pytest

pytest.importorskip("cutlass")
from precast.kernels.gdn_chunk_sm90 import A_ELEMS, A_ROW_GROUP, A_ROW_STEPS  # noqa: E402
from precast.kernels.gdn_layout import CHUNK  # noqa: E402


def row_start(r: int) -> int:
    """Word offset of A's row r (the layout's row mode, colexicographic)."""
    index, words = r, 0
    for extent, step in zip(A_ROW_GROUP, A_ROW_STEPS):
        words += (index % extent) * step
        index //= extent
    return words


def wavefronts(words, width: int) -> int:
    """Wavefronts one warp-wide access of ``width`` words per lane takes."""
    lanes = {1: 32, 2: 16, 4: 8}[width]
    total = 0
    for first in range(0, 32, lanes):
        banks = {}
        for w in words[first:first + lanes]:
            for k in range(width):
                banks.setdefault((w + k) % 32, set()).add(w + k)
        total += max(len(a) for a in banks.values())
    return total


def test_rows_do_not_overlap_and_stay_aligned():
    starts = [row_start(r) for r in range(CHUNK)]
    assert all(b - a >= CHUNK for a, b in zip(starts, starts[1:]))
    assert all(s % 4 == 0 for s in starts)
    assert starts[-1] + CHUNK == A_ELEMS


@pytest.mark.parametrize("r0", [0, 16, 32, 48])
def test_inverse_fragments_are_conflict_free(r0):
    # m16n8k8 tf32, lane l: A (row l // 4 (+ 8), column l % 4 (+ 4)); B (k = l % 4 (+ 4),
    # n = l // 4) read from rows k; C pairs (row l // 4 (+ 8), columns 2 (l % 4), + 1)
    lanes = range(32)
    for dr, dc in ((0, 0), (8, 4)):
        assert wavefronts([row_start(r0 + dr + l // 4) + l % 4 + dc for l in lanes], 1) == 1
    for dk in (0, 4):
        assert wavefronts([row_start(r0 + dk + l % 4) + 8 + l // 4 for l in lanes], 1) == 1
    for dr in (0, 8):
        assert wavefronts([row_start(r0 + dr + l // 4) + 40 + 2 * (l % 4) for l in lanes], 2) == 2


@pytest.mark.parametrize("warp", range(4))
def test_score_epilogue_pairs_are_conflict_free(warp):
    # the 64 x 64 wgmma accumulator: lane l holds rows 16 w + l // 4 (+ 8), column pairs
    # 8 g + 2 (l % 4)
    for half in (0, 8):
        for g in range(8):
            words = [row_start(16 * warp + half + l // 4) + 8 * g + 2 * (l % 4)
                     for l in range(32)]
            assert wavefronts(words, 2) == 2


def test_row_loads_are_conflict_free():
    # the inverse's 16-bit copies: lane l reads row 16 w + l % 16 from column 32 (l // 16)
    for warp in range(4):
        for v in range(8):
            words = [row_start(16 * warp + l % 16) + 32 * (l // 16) + 4 * v for l in range(32)]
            assert wavefronts(words, 4) == 4
