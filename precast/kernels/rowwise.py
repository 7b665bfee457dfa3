"""Shared pieces of the row-wise (one row = one LayerNorm) memory-bound kernels.

A row of D elements is cut into 16-byte vectors of VEC elements. A group of
``threads_per_row`` threads owns a row; thread ``t`` of the group owns vectors
t, t + threads_per_row, t + 2 * threads_per_row, ... so that each warp-wide load
is contiguous. Row sums use warp shuffles and, when a row spans several warps, a
small shared-memory exchange.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .tiling import WARP


@cute.jit
def row_sum(val: Float32, tiling: cutlass.Constexpr, sbuf: cute.Tensor, slot: cutlass.Constexpr,
            row_barrier: cutlass.Constexpr = False):
    """Sum of ``val`` over the threads of one row group; every thread gets the total.

    ``sbuf`` is a (rows_per_cta, warps_per_row, slots) fp32 shared tensor, used only
    when a row spans several warps; each slot is written once between barriers. Those are
    CTA-wide, or with ``row_barrier`` named barriers of the row's warps only (1 + its row in
    the CTA; the backward spills more registers with them).
    """
    lanes = cutlass.const_expr(min(tiling.threads_per_row, WARP))
    val = cute.arch.warp_reduction(val, lambda a, b: a + b, threads_in_group=lanes)
    if cutlass.const_expr(tiling.warps_per_row > 1):
        tidx, _, _ = cute.arch.thread_idx()
        row_in_cta = tidx // tiling.threads_per_row
        warp_in_row = (tidx % tiling.threads_per_row) // WARP
        if cute.arch.lane_idx() == 0:
            sbuf[row_in_cta, warp_in_row, slot] = val
        if cutlass.const_expr(row_barrier):
            cute.arch.barrier(barrier_id=1 + row_in_cta,
                              number_of_threads=tiling.threads_per_row)
        else:
            cute.arch.barrier()
        val = Float32(0.0)
        for w in cutlass.range_constexpr(tiling.warps_per_row):
            val = val + sbuf[row_in_cta, w, slot]
    return val


def vector_copy_atom(dtype, num_elems: int):
    """A copy atom moving ``num_elems`` contiguous elements as one access."""
    return cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=num_elems * dtype.width
    )
