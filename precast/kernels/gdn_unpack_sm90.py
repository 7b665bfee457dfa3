"""work16's packed block P (gdn_layout: M's lower triangle, T's strict lower triangle
transposed into the upper one) split back into the tiles T and M in shared memory, by
one or more warps of a CTA; shared by every kernel that reads the workspace.

P's upper triangle is 36 blocks of 8 x 8 (28 above the diagonal, 8 on it). A warp takes
four at a time: one ldmatrix.x4.trans, one stmatrix.x4 of them (transposed) into T, one
stmatrix.x4 of zeros (or of the masked diagonal blocks) back into P, which becomes M in
place. Each block is read and rewritten by one warp, so no barrier is needed between the
warps. T's blocks above the diagonal are zeros written once (zero_t_upper). The tiles are
64 x 64 16-bit, K-major with the 128-byte swizzle that TMA and wgmma use (16-byte piece c
of row i at i * 128 + ((c ^ i % 8) * 16) from a 1024-byte-aligned base). The stores are
generic-proxy: a wgmma may read them only after a proxy fence. The readers load P ahead of
their other tiles, on an mbarrier of its own, so that the split overlaps those loads.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32, const_expr

from .attention_sm90 import tma_load_tile
from .gdn_layout import CHUNK

BLOCK = 8
BLOCKS = CHUNK // BLOCK
ROW_BYTES = CHUNK * 2
TILE_BYTES = CHUNK * ROW_BYTES
_ABOVE = [(i, j) for i in range(BLOCKS) for j in range(i + 1, BLOCKS)]
_ON = [(i, i) for i in range(BLOCKS)]
# four 8 x 8 blocks per ldmatrix / stmatrix .x4: above the diagonal, then on it
ABOVE_GROUPS = [_ABOVE[g:g + 4] for g in range(0, len(_ABOVE), 4)]
GROUPS = ABOVE_GROUPS + [_ON[g:g + 4] for g in range(0, len(_ON), 4)]
UNPACK_WARPS = 3  # the recurrences' producer warpgroup: warps 1-3, idle otherwise


def one_bits(dtype) -> int:
    """1.0 in the 16-bit io dtype, as bits."""
    return 0x3F80 if dtype is cutlass.BFloat16 else 0x3C00


def block_row(base: Int32, bi: Int32, bj: Int32, r: Int32) -> Int32:
    """Shared address of row r of 8 x 8 block (bi, bj) of the swizzled tile at ``base``."""
    return base + (bi * BLOCK + r) * ROW_BYTES + ((bj ^ r) * 16)


def pick(blocks, m: Int32):
    """(row block, column block) of the group's block m (0..3), for this lane."""
    bi, bj = Int32(blocks[3][0]), Int32(blocks[3][1])
    for k in (2, 1, 0):
        bi = cutlass.select_(m == k, Int32(blocks[k][0]), bi)
        bj = cutlass.select_(m == k, Int32(blocks[k][1]), bj)
    return bi, bj


def zero_word() -> Uint32:
    """0 in a register (a constant would become an immediate, which stmatrix refuses)."""
    return cute.arch.inline_ptx("mov.b32 {$w0}, 0;", write_only_types=[Uint32])


def store_matrices(addr: Int32, words, trans: bool):
    """stmatrix.x4 (.trans) of four 32-bit words per lane, rows at ``addr``."""
    op = "stmatrix.sync.aligned.m8n8.x4" + (".trans" if trans else "") + ".shared.b16"
    cute.arch.inline_ptx(op + " [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                         read_only_args=[addr, *words])


def diagonal_word(w: Uint32, rho: Int32, kappa: Int32, one: int, for_t: bool) -> Uint32:
    """A word of a diagonal block's transposed fragment (P[kappa + h, rho] of the block,
    h = 0, 1) masked: for T (T[rho, kappa + h]) P's value where kappa + h < rho, ``one``
    on the diagonal, else 0; for M (P in place) P's value where kappa + h >= rho, else 0."""
    out = Uint32(0)
    for h in (0, 1):
        half = (w >> Uint32(16 * h)) & Uint32(0xFFFF)
        col = kappa + h
        if for_t:
            half = cutlass.select_(col < rho, half,
                                   cutlass.select_(col == rho, Uint32(one), Uint32(0)))
        else:
            half = cutlass.select_(col >= rho, half, Uint32(0))
        out = out | (half << Uint32(16 * h))
    return out


@cute.jit
def split_packed(p_base: Int32, t_base: Int32, warp: Int32, warps: cutlass.Constexpr,
                 with_m: cutlass.Constexpr, one: cutlass.Constexpr):
    """P (the tile at shared address ``p_base``) split by ``warps`` warps, this one
    ``warp``: T's blocks on and below the diagonal into the tile at ``t_base`` and, with
    ``with_m``, M in place of P. ``one``: one_bits of the io dtype."""
    lane = cute.arch.lane_idx()
    m, r = lane // BLOCK, lane % BLOCK
    rho, kappa = lane // 4, lane % 4 * 2  # the lane's row, first column of a fragment
    for g in cutlass.range_constexpr(len(GROUPS)):
        if g % warps == warp:
            blocks = GROUPS[g]
            diagonal = blocks[0][0] == blocks[0][1]
            bi, bj = pick(blocks, m)
            frag = cute.arch.inline_ptx(
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 "
                "{{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                write_only_types=[Uint32] * 4, read_only_args=[block_row(p_base, bi, bj, r)])
            t_words = list(frag)
            if const_expr(diagonal):
                t_words = [diagonal_word(w, rho, kappa, one, True) for w in frag]
            # T's block (bj, bi) is P's block (bi, bj) transposed
            store_matrices(block_row(t_base, bj, bi, r), t_words, False)
            if const_expr(with_m):
                cute.arch.sync_warp()  # the warp's reads of these blocks precede its writes
                if const_expr(diagonal):  # back in P's orientation (.trans), masked
                    store_matrices(block_row(p_base, bi, bj, r),
                                   [diagonal_word(w, rho, kappa, one, False) for w in frag],
                                   True)
                else:
                    store_matrices(block_row(p_base, bi, bj, r), [zero_word()] * 4, False)


@cute.jit
def zero_t_upper(t_base: Int32, warp: Int32, warps: cutlass.Constexpr):
    """T's 28 blocks above the diagonal (never written by split_packed): zeros."""
    lane = cute.arch.lane_idx()
    m, r = lane // BLOCK, lane % BLOCK
    for g in cutlass.range_constexpr(len(ABOVE_GROUPS)):
        if g % warps == warp:
            bi, bj = pick(ABOVE_GROUPS[g], m)
            store_matrices(block_row(t_base, bi, bj, r), [zero_word()] * 4, False)


@cute.jit
def init_ring_barriers(p_full, unpacked, stages: cutlass.Constexpr, tidx: Int32):
    """Thread 0: a ring's ``p_full`` mbarriers (load_packed's one arrival) and ``unpacked``
    ones (unpack_ring's UNPACK_WARPS arrivals), ``stages`` of each; the caller fences and
    synchronizes the CTA after."""
    if tidx == 0:
        for s in cutlass.range_constexpr(stages):
            cute.arch.mbarrier_init(p_full + s, 1)
            cute.arch.mbarrier_init(unpacked + s, UNPACK_WARPS)


@cute.jit
def load_packed(atom, g, sP, stage: Int32, p_full):
    """The producer warp (all of it): TMA of P (the 2-D global tile ``g``) into stage
    ``stage`` of sP, completing on ``p_full + stage`` (its own mbarrier: one arrival with
    the byte count)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(p_full + stage, TILE_BYTES)
    tma_load_tile(atom, g, sP, stage, p_full + stage)


@cute.jit
def unpack_ring(p_base: Int32, t_base: Int32, p_full, unpacked, chunks: Int32, warp: Int32,
                stages: cutlass.Constexpr, with_m: cutlass.Constexpr,
                one: cutlass.Constexpr, also=None):
    """The unpacking warps of a recurrence (``warp`` of UNPACK_WARPS), for the ring of
    ``stages`` P tiles at ``p_base`` and T tiles at ``t_base`` (TILE_BYTES apart): T's
    upper blocks zeroed once, then for each of ``chunks`` rounds, once P has landed
    (``p_full``, see load_packed), split_packed; then each warp arrives on the stage's
    ``unpacked`` mbarrier (initialized for UNPACK_WARPS arrivals), which the consumers
    wait on beside the ring's own. A stage is refilled only after the consumers released
    it, which they do after waiting on ``unpacked``. ``also(stage, phase)``, when given,
    runs after split_packed on the same warps, before the fence and the arrival (more work
    on the stage's tiles that the consumers would otherwise do on their chain); ``phase``
    is this round's parity of the stage's barriers."""
    for s in cutlass.range_constexpr(stages):
        zero_t_upper(t_base + s * TILE_BYTES, warp, UNPACK_WARPS)
    for c in cutlass.range(chunks, unroll=1):
        s, phase = c % stages, (c // stages) % 2
        cute.arch.mbarrier_wait(p_full + s, phase)
        split_packed(p_base + s * TILE_BYTES, t_base + s * TILE_BYTES, warp, UNPACK_WARPS,
                     with_m, one)
        if const_expr(also is not None):
            also(s, phase)
        # generic-proxy stores, read next by wgmma
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(unpacked + s)
