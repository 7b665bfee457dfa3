"""work16's packed block P (gdn_layout: M's lower triangle, T's strict lower triangle
transposed into the upper one) split back into the tiles T and M in shared memory, by
any group of threads of a CTA; shared by every kernel that reads the workspace.

Both steps run on 2-D views (64, 64) of swizzled 16-bit tiles and move 16 bytes per
store. unpack_t reads P's upper triangle, mask_m then overwrites it: a reader that needs
both runs a barrier of the group between them (P's tile becomes M in place). Either
leaves generic-proxy stores that a wgmma may read only after a proxy fence.
"""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr

from .attention_sm90 import advanced
from .gdn_layout import CHUNK

VEC = 8  # 16-bit elements per 16-byte access
VECS = CHUNK * CHUNK // VEC


@cute.jit
def unpack_t(sP, sT, tid: Int32, threads: cutlass.Constexpr):
    """All of T = P's strict upper triangle transposed, plus the unit diagonal, into sT.
    Thread ``tid`` of ``threads`` makes 16-byte pieces (row n, columns k0 .. k0 + 7) of
    T; consecutive threads take consecutive rows n, so the column reads P[k, n] of a warp
    fall in one row of P (no bank conflicts)."""
    dt = sT.element_type
    zero, one = dt(0.0), dt(1.0)
    vals = cute.make_rmem_tensor(cute.make_layout(VEC), dt)
    for q in cutlass.range(tid, VECS, threads, unroll=1):
        n = q % CHUNK
        piece = q // CHUNK
        k0 = piece * VEC
        if k0 < n:  # some of T's strict lower triangle (P's rows k < n of column n)
            for e in cutlass.range_constexpr(VEC):
                vals[e] = cutlass.select_(k0 + e < n, sP[k0 + e, n],
                                          cutlass.select_(k0 + e == n, one, zero))
        else:
            for e in cutlass.range_constexpr(VEC):
                vals[e] = cutlass.select_(k0 + e == n, one, zero)
        cute.autovec_copy(vals, cute.local_tile(sT[n, None], (VEC,), (piece,)))


@cute.jit
def mask_m(sP, tid: Int32, threads: cutlass.Constexpr):
    """M from P in place: P's strict upper triangle (T's) cleared."""
    dt = sP.element_type
    zero = dt(0.0)
    vals = cute.make_rmem_tensor(cute.make_layout(VEC), dt)
    per_row = CHUNK // VEC
    for q in cutlass.range(tid, VECS, threads, unroll=1):
        i = q // per_row
        piece = q - i * per_row
        j0 = piece * VEC
        if j0 + VEC - 1 > i:  # the piece reaches above the diagonal
            seg = cute.local_tile(sP[i, None], (VEC,), (piece,))
            cute.autovec_copy(seg, vals)
            for e in cutlass.range_constexpr(VEC):
                vals[e] = cutlass.select_(j0 + e > i, zero, vals[e])
            cute.autovec_copy(vals, seg)


UNPACK_WARPS = 3  # the recurrences' producer warpgroup: warps 1-3, idle otherwise


@cute.jit
def unpack_ring(sP, sT, pipe, unpacked, chunks: Int32, tid: Int32,
                stages: cutlass.Constexpr, with_m: cutlass.Constexpr,
                barrier_id: cutlass.Constexpr):
    """The unpacking warps of a recurrence (thread ``tid`` of UNPACK_WARPS warps): for each
    of ``chunks`` rounds of the TMA ring ``pipe`` (``stages`` stages), once its P has
    landed in sP's stage, T into sT's and, ``with_m``, M in place; then each warp arrives
    on the stage's ``unpacked`` mbarrier (initialized for UNPACK_WARPS arrivals), which the
    consumers wait on after the ring's own."""
    threads = UNPACK_WARPS * cute.arch.WARP_SIZE
    state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, stages)
    for _ in cutlass.range(chunks, unroll=1):
        s = state.index
        pipe.consumer_wait(state)
        unpack_t(sP[None, None, s], sT[None, None, s], tid, threads)
        if const_expr(with_m):
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=threads)
            mask_m(sP[None, None, s], tid, threads)
        # generic-proxy stores, read next by wgmma
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(unpacked + s)
        state = advanced(state)
