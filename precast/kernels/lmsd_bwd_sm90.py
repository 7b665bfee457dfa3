"""HSTU LMSD backward for SM90: dx, du per row, and dweight/dbias in two deterministic steps.

Step 1 (persistent grid): each row group walks rows ``rb * rows_per_cta + r`` for its
CTA's row blocks, writes dx and du, and keeps running column sums of d_ln (dbias) and
d_ln * xhat (dweight) in registers; at the end each row group writes its sums to one
row of an fp32 workspace. Step 2 sums the workspace rows in a fixed order, so results
are bitwise reproducible run to run.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int8, const_expr

from .activation import fast_sigmoid
from .rowwise import row_sum, vector_copy_atom
from .tiling import VEC, RowTiling

DBIAS_SLOT, DWEIGHT_SLOT = 0, 1
REDUCE_COLS, REDUCE_SLICES = 32, 32


class LmsdBackwardSm90:
    def __init__(self, dtype, dim: int, apply_u_silu: bool, concat_u: bool, concat_x: bool,
                 use_dropout: bool, compute_dweight: bool, vecs_per_thread: int = 2,
                 min_ctas_per_sm: int = 0):
        self.dtype = dtype
        self.dim = dim
        self.apply_u_silu = apply_u_silu
        self.concat_u = concat_u
        self.concat_x = concat_x
        self.use_dropout = use_dropout
        self.compute_dweight = compute_dweight
        self.tiling = RowTiling(dim, vecs_per_thread_target=vecs_per_thread)
        # Register cap through the launch bounds (0: let the compiler choose).
        self.bounds = ({"min_blocks_per_mp": min_ctas_per_sm, "preferred_smem_carveout": -1}
                       if min_ctas_per_sm else {})
        self.a_seg = 0 if concat_u else None
        self.x_seg = (1 if concat_u else 0) if concat_x else None
        self.main_seg = int(concat_u) + int(concat_x)
        self.num_slots = 2 if compute_dweight else 1

    @cute.jit
    def __call__(self, mDY: cute.Tensor, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor,
                 mB: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
                 mDX: cute.Tensor, mDU: cute.Tensor, mWork: cute.Tensor, keep_scale: Float32,
                 num_ctas: Int32, stream: cuda.CUstream):
        t = self.tiling
        self.rows_kernel(mDY, mX, mU, mW, mB, mMean, mRstd, mMask, mDX, mDU, mWork,
                         keep_scale).launch(grid=[num_ctas, 1, 1], block=[t.num_threads, 1, 1],
                                            stream=stream, **self.bounds)

    @cute.kernel
    def rows_kernel(self, mDY: cute.Tensor, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor,
                    mB: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
                    mDX: cute.Tensor, mDU: cute.Tensor, mWork: cute.Tensor, keep_scale: Float32):
        t = self.tiling
        tpr = const_expr(t.threads_per_row)
        vpt = const_expr(t.vecs_per_thread)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        lane = tidx % tpr
        row_in_cta = tidx // tpr
        num_rows = mX.shape[0]
        num_blocks = (num_rows + t.rows_per_cta - 1) // t.rows_per_cta

        sbuf = None
        if const_expr(t.warps_per_row > 1):
            smem = cutlass.memory.SmemAllocator()
            sbuf = smem.allocate_tensor(
                Float32, cute.make_layout((t.rows_per_cta, t.warps_per_row, 2)), byte_alignment=16)

        atom = vector_copy_atom(self.dtype, VEC)
        mask_atom = vector_copy_atom(Int8, VEC)
        frag = cute.make_layout((VEC, vpt))
        rW = cute.make_rmem_tensor(frag, self.dtype)
        rB = cute.make_rmem_tensor(frag, self.dtype)
        rW.fill(0.0)
        rB.fill(0.0)
        for v in cutlass.range_constexpr(vpt):
            j = lane + v * tpr
            if const_expr(t.even) or j < t.num_vecs:
                cute.copy(atom, cute.local_tile(mW, (VEC,), (j,)), rW[None, v])
                cute.copy(atom, cute.local_tile(mB, (VEC,), (j,)), rB[None, v])
        acc_db = cute.make_rmem_tensor(frag, Float32)
        acc_dw = cute.make_rmem_tensor(frag, Float32)
        acc_db.fill(0.0)
        acc_dw.fill(0.0)

        rX = cute.make_rmem_tensor(frag, self.dtype)
        rU = cute.make_rmem_tensor(frag, self.dtype)
        rG = cute.make_rmem_tensor(frag, self.dtype)   # dy of the main segment
        rGX = cute.make_rmem_tensor(frag, self.dtype)  # dy of the x segment
        rGA = cute.make_rmem_tensor(frag, self.dtype)  # dy of the a segment
        rM = cute.make_rmem_tensor(frag, Int8)
        rDX = cute.make_rmem_tensor(frag, self.dtype)
        rDU = cute.make_rmem_tensor(frag, self.dtype)
        xhat = cute.make_rmem_tensor(frag, Float32)
        dxhat = cute.make_rmem_tensor(frag, Float32)

        for rb in cutlass.range(bidx, num_blocks, nctas, unroll=1):
            if const_expr(t.warps_per_row > 1):
                cute.arch.barrier()  # the previous row's readers are done with sbuf
            row = rb * t.rows_per_cta + row_in_cta
            row_ok = row < num_rows
            row_c = row if row_ok else Int32(0)
            gDY = mDY[row_c, None]
            gX = mX[row_c, None]
            gU = mU[row_c, None]
            rX.fill(0.0)
            rU.fill(0.0)
            rG.fill(0.0)
            rGX.fill(0.0)
            rGA.fill(0.0)
            rM.fill(0)
            for v in cutlass.range_constexpr(vpt):
                j = lane + v * tpr
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(atom, cute.local_tile(gX, (VEC,), (j,)), rX[None, v])
                    cute.copy(atom, cute.local_tile(gU, (VEC,), (j,)), rU[None, v])
                    cute.copy(atom, cute.local_tile(gDY, (VEC,), (self.main_seg * t.num_vecs + j,)),
                              rG[None, v])
                    if const_expr(self.concat_x):
                        cute.copy(atom, cute.local_tile(gDY, (VEC,), (self.x_seg * t.num_vecs + j,)),
                                  rGX[None, v])
                    if const_expr(self.concat_u):
                        cute.copy(atom, cute.local_tile(gDY, (VEC,), (self.a_seg * t.num_vecs + j,)),
                                  rGA[None, v])
                    if const_expr(self.use_dropout):
                        cute.copy(mask_atom, cute.local_tile(mMask[row_c, None], (VEC,), (j,)),
                                  rM[None, v])
            mean = Float32(0.0)
            rstd = Float32(0.0)
            if row_ok:
                mean = mMean[row]
                rstd = mRstd[row]

            sum_g = Float32(0.0)
            sum_gx = Float32(0.0)
            for v in cutlass.range_constexpr(vpt):
                for e in cutlass.range_constexpr(VEC):
                    m = Int32(rM[e, v])
                    g = rG[e, v].to(Float32)
                    if const_expr(self.use_dropout):
                        g = g * (keep_scale if (m & 1) != 0 else Float32(0.0))
                    u = rU[e, v].to(Float32)
                    a = u
                    dsilu = Float32(1.0)
                    if const_expr(self.apply_u_silu):
                        sig = fast_sigmoid(u)
                        a = u * sig
                        dsilu = sig * (Float32(1.0) + u * (Float32(1.0) - sig))
                    xh = (rX[e, v].to(Float32) - mean) * rstd
                    ln = xh * rW[e, v].to(Float32) + rB[e, v].to(Float32)
                    d_ln = g * a
                    d_a = g * ln
                    if const_expr(self.concat_u):
                        ga = rGA[e, v].to(Float32)
                        if const_expr(self.use_dropout):
                            ga = ga * (keep_scale if (m & 4) != 0 else Float32(0.0))
                        d_a = d_a + ga
                    rDU[e, v] = (d_a * dsilu).to(self.dtype)
                    acc_db[e, v] = acc_db[e, v] + d_ln
                    if const_expr(self.compute_dweight):
                        acc_dw[e, v] = acc_dw[e, v] + d_ln * xh
                    dxh = d_ln * rW[e, v].to(Float32)
                    xhat[e, v] = xh
                    dxhat[e, v] = dxh
                    sum_g = sum_g + dxh
                    sum_gx = sum_gx + dxh * xh
            mean_g = row_sum(sum_g, t, sbuf, 0) * Float32(1.0 / self.dim)
            mean_gx = row_sum(sum_gx, t, sbuf, 1) * Float32(1.0 / self.dim)
            for v in cutlass.range_constexpr(vpt):
                for e in cutlass.range_constexpr(VEC):
                    dx = rstd * (dxhat[e, v] - mean_g - xhat[e, v] * mean_gx)
                    if const_expr(self.concat_x):
                        gx = rGX[e, v].to(Float32)
                        if const_expr(self.use_dropout):
                            m = Int32(rM[e, v])
                            gx = gx * (keep_scale if (m & 2) != 0 else Float32(0.0))
                        dx = dx + gx
                    rDX[e, v] = dx.to(self.dtype)
            gDX = mDX[row_c, None]
            gDU = mDU[row_c, None]
            for v in cutlass.range_constexpr(vpt):
                j = lane + v * tpr
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(atom, rDX[None, v], cute.local_tile(gDX, (VEC,), (j,)))
                    cute.copy(atom, rDU[None, v], cute.local_tile(gDU, (VEC,), (j,)))

        # One workspace row per row group: (bidx * rows_per_cta + row_in_cta, slot, column).
        work_row = bidx * t.rows_per_cta + row_in_cta
        acc_atom = vector_copy_atom(Float32, 4)
        for v in cutlass.range_constexpr(vpt):
            j = lane + v * tpr
            if const_expr(t.even) or j < t.num_vecs:
                gDB = cute.local_tile(mWork[work_row, DBIAS_SLOT, None], (VEC,), (j,))
                for h in cutlass.range_constexpr(2):
                    cute.copy(acc_atom, cute.local_tile(acc_db[None, v], (4,), (h,)),
                              cute.local_tile(gDB, (4,), (h,)))
                if const_expr(self.compute_dweight):
                    gDW = cute.local_tile(mWork[work_row, DWEIGHT_SLOT, None], (VEC,), (j,))
                    for h in cutlass.range_constexpr(2):
                        cute.copy(acc_atom, cute.local_tile(acc_dw[None, v], (4,), (h,)),
                                  cute.local_tile(gDW, (4,), (h,)))


class LmsdParamGradReduceSm90:
    """dbias[c] (and dweight[c]) = sum over the used workspace rows, in a fixed order."""

    def __init__(self, dtype, dim: int, compute_dweight: bool):
        self.dtype = dtype
        self.dim = dim
        self.compute_dweight = compute_dweight

    @cute.jit
    def __call__(self, mWork: cute.Tensor, mDB: cute.Tensor, mDW: cute.Tensor, used_rows: Int32,
                 stream: cuda.CUstream):
        grid = (self.dim + REDUCE_COLS - 1) // REDUCE_COLS
        self.kernel(mWork, mDB, mDW, used_rows).launch(
            grid=[grid, 1, 1], block=[REDUCE_COLS * REDUCE_SLICES, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mWork: cute.Tensor, mDB: cute.Tensor, mDW: cute.Tensor, used_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        col = bidx * REDUCE_COLS + tidx % REDUCE_COLS
        part = tidx // REDUCE_COLS
        smem = cutlass.memory.SmemAllocator()
        sdata = smem.allocate_tensor(
            Float32, cute.make_layout((REDUCE_COLS, REDUCE_SLICES, 2),
                                      stride=(1, REDUCE_COLS + 1, (REDUCE_COLS + 1) * REDUCE_SLICES)),
            byte_alignment=16)
        col_c = col if col < self.dim else Int32(0)
        sdb = Float32(0.0)
        sdw = Float32(0.0)
        for r in cutlass.range(part, used_rows, REDUCE_SLICES, unroll=4):
            sdb = sdb + mWork[r, DBIAS_SLOT, col_c]
            if const_expr(self.compute_dweight):
                sdw = sdw + mWork[r, DWEIGHT_SLOT, col_c]
        sdata[tidx % REDUCE_COLS, part, 0] = sdb
        sdata[tidx % REDUCE_COLS, part, 1] = sdw
        cute.arch.barrier()
        if part == 0 and col < self.dim:
            tb = Float32(0.0)
            tw = Float32(0.0)
            for p in cutlass.range_constexpr(REDUCE_SLICES):
                tb = tb + sdata[tidx, p, 0]
                tw = tw + sdata[tidx, p, 1]
            mDB[col] = tb.to(self.dtype)
            if const_expr(self.compute_dweight):
                mDW[col] = tw.to(self.dtype)
