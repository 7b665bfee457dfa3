"""work16's packed block P (gdn_layout: M's lower triangle, T's strict lower triangle
transposed into the upper one) split back into the tiles T and M in shared memory, by
any group of threads of a CTA; shared by every kernel that reads the workspace.

Both steps run on 2-D views (64, 64) of swizzled 16-bit tiles and store 16 bytes at a
time. unpack_t reads P's upper triangle, mask_m then overwrites it: a reader that needs
both runs a barrier of the group between them (P's tile becomes M in place). Either
leaves generic-proxy stores that a wgmma may read only after a proxy fence. The readers
load P ahead of their other tiles, on an mbarrier of its own, so that the split overlaps
those loads (after the whole stage had landed, it cost the recurrences 15-25 %).
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from .attention_sm90 import tma_load_tile
from .gdn_layout import CHUNK

VEC = 8  # 16-bit elements per 16-byte access
PIECES = CHUNK // VEC  # 16-byte pieces of a row


@cute.jit
def unpack_t(sP, sT, tid: Int32, threads: cutlass.Constexpr):
    """All of T = P's strict upper triangle transposed, plus the unit diagonal, into sT.
    Thread ``tid`` of ``threads`` makes the 16-byte pieces (rows n, n + 1, columns k0 ..
    k0 + 7) of T from 4-byte reads P[k, n:n + 2]; consecutive threads take consecutive row
    pairs, so a warp's reads cover one row of P (no bank conflicts)."""
    dt = sT.element_type
    zero, one = dt(0.0), dt(1.0)
    pair = cute.make_rmem_tensor(cute.make_layout(2), dt)
    vals = cute.make_rmem_tensor(cute.make_layout((VEC, 2)), dt)
    pairs = CHUNK // 2
    for q in cutlass.range(tid, pairs * PIECES, threads, unroll=1):
        n = q % pairs * 2
        piece = q // pairs
        k0 = piece * VEC
        if k0 <= n:  # some of T's strict lower triangle (P's rows k < n + 1 of n, n + 1)
            for e in cutlass.range_constexpr(VEC):
                k = k0 + e
                cute.autovec_copy(cute.local_tile(sP[k, None], (2,), (n // 2,)), pair)
                for h in cutlass.range_constexpr(2):
                    vals[e, h] = cutlass.select_(k < n + h, pair[h],
                                                 cutlass.select_(k == n + h, one, zero))
        else:
            for e in cutlass.range_constexpr(VEC):
                for h in cutlass.range_constexpr(2):
                    vals[e, h] = cutlass.select_(k0 + e == n + h, one, zero)
        for h in cutlass.range_constexpr(2):
            cute.autovec_copy(vals[None, h], cute.local_tile(sT[n + h, None], (VEC,), (piece,)))


@cute.jit
def mask_m(sP, tid: Int32, threads: cutlass.Constexpr):
    """M from P in place: P's strict upper triangle (T's) cleared; pieces wholly above the
    diagonal are stored as zeros without being read."""
    dt = sP.element_type
    zero = dt(0.0)
    vals = cute.make_rmem_tensor(cute.make_layout(VEC), dt)
    for q in cutlass.range(tid, CHUNK * PIECES, threads, unroll=1):
        i = q // PIECES
        piece = q - i * PIECES
        j0 = piece * VEC
        seg = cute.local_tile(sP[i, None], (VEC,), (piece,))
        if j0 > i:
            vals.fill(zero)
            cute.autovec_copy(vals, seg)
        elif j0 + VEC - 1 > i:  # the piece crosses the diagonal
            cute.autovec_copy(seg, vals)
            for e in cutlass.range_constexpr(VEC):
                vals[e] = cutlass.select_(j0 + e > i, zero, vals[e])
            cute.autovec_copy(vals, seg)


UNPACK_WARPS = 3  # the recurrences' producer warpgroup: warps 1-3, idle otherwise


@cute.jit
def load_packed(atom, g, sP, stage: Int32, p_full):
    """The producer warp (all of it): TMA of P (the 2-D global tile ``g``) into stage
    ``stage`` of sP, completing on ``p_full + stage`` (its own mbarrier: one arrival with
    the byte count)."""
    with cute.arch.elect_one():
        cute.arch.mbarrier_arrive_and_expect_tx(p_full + stage,
                                                CHUNK * CHUNK * sP.element_type.width // 8)
    tma_load_tile(atom, g, sP, stage, p_full + stage)


@cute.jit
def unpack_ring(sP, sT, p_full, unpacked, chunks: Int32, tid: Int32,
                stages: cutlass.Constexpr, with_m: cutlass.Constexpr,
                barrier_id: cutlass.Constexpr):
    """The unpacking warps of a recurrence (thread ``tid`` of UNPACK_WARPS warps): for each
    of ``chunks`` rounds of a ``stages``-stage ring, once P has landed in sP's stage
    (``p_full``, see load_packed), T into sT's and, ``with_m``, M in place; then each warp
    arrives on the stage's ``unpacked`` mbarrier (initialized for UNPACK_WARPS arrivals),
    which the consumers wait on beside the ring's own. A stage is refilled only after the
    consumers released it, which they do after waiting on ``unpacked``."""
    threads = UNPACK_WARPS * cute.arch.WARP_SIZE
    for c in cutlass.range(chunks, unroll=1):
        s = c % stages
        cute.arch.mbarrier_wait(p_full + s, (c // stages) % 2)
        unpack_t(sP[None, None, s], sT[None, None, s], tid, threads)
        if const_expr(with_m):
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
            mask_m(sP[None, None, s], tid, threads)
        # generic-proxy stores, read next by wgmma
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(unpacked + s)
