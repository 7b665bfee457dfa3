"""HSTU LayerNorm-Multiply-SiLU-Dropout forward for SM90 (memory bound, one pass).

Per row: mean/rstd of x, ln = LN(x) * w + b, a = SiLU(u) or u, then up to three
dropped-out segments written to y = [a?, x?, ln * a] and one int8 mask byte per
element (bit 0 main, bit 1 x segment, bit 2 a segment).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Int8, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync

from .activation import fast_sigmoid
from .philox import philox4x32_10
from .rowwise import row_sum, vector_copy_atom
from .tiling import VEC, RowTiling

MAIN_BIT, X_BIT, A_BIT = 0, 1, 2


class LmsdForwardSm90:
    def __init__(self, dtype, dim: int, apply_u_silu: bool, concat_u: bool, concat_x: bool,
                 use_dropout: bool, vecs_per_thread: int = 2,
                 min_ctas_per_sm: int = 0):
        self.dtype = dtype
        self.dim = dim
        self.apply_u_silu = apply_u_silu
        self.concat_u = concat_u
        self.concat_x = concat_x
        self.use_dropout = use_dropout
        self.tiling = RowTiling(dim, vecs_per_thread_target=vecs_per_thread)
        # Register cap through the launch bounds (0: let the compiler choose).
        self.bounds = ({"min_blocks_per_mp": min_ctas_per_sm, "preferred_smem_carveout": -1}
                       if min_ctas_per_sm else {})
        # Segment slots in y, in output order.
        self.a_seg = 0 if concat_u else None
        self.x_seg = (1 if concat_u else 0) if concat_x else None
        self.main_seg = int(concat_u) + int(concat_x)
        self.planes = [MAIN_BIT] + [X_BIT] * concat_x + [A_BIT] * concat_u

    @cute.jit
    def __call__(self, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor,
                 mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
                 eps: Float32, keep_threshold: Int64, keep_scale: Float32, seed: Int64,
                 stream: cuda.CUstream):
        t = self.tiling
        num_rows = mX.shape[0]
        grid_x = (num_rows + t.rows_per_cta - 1) // t.rows_per_cta
        self.kernel(mX, mU, mW, mB, mY, mMean, mRstd, mMask, eps, keep_threshold, keep_scale,
                    seed).launch(grid=[grid_x, 1, 1], block=[t.num_threads, 1, 1], stream=stream,
                                    **self.bounds)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor,
               mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
               eps: Float32, keep_threshold: Int64, keep_scale: Float32, seed: Int64):
        t = self.tiling
        tpr = const_expr(t.threads_per_row)
        vpt = const_expr(t.vecs_per_thread)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % tpr
        row = bidx * t.rows_per_cta + tidx // tpr
        row_ok = row < mX.shape[0]
        row_c = row if row_ok else Int32(0)  # keeps address arithmetic in bounds

        smem = cutlass.utils.SmemAllocator()
        sbuf = None
        if const_expr(t.warps_per_row > 1):
            sbuf = smem.allocate_tensor(
                Float32, cute.make_layout((t.rows_per_cta, t.warps_per_row, 2)), byte_alignment=16)

        atom = vector_copy_atom(self.dtype, VEC)
        frag = cute.make_layout((VEC, vpt))
        rX = cute.make_rmem_tensor(frag, self.dtype)
        rU = cute.make_rmem_tensor(frag, self.dtype)
        rW = cute.make_rmem_tensor(frag, self.dtype)
        rB = cute.make_rmem_tensor(frag, self.dtype)
        rX.fill(0.0)
        rU.fill(0.0)
        rW.fill(0.0)
        rB.fill(0.0)
        gX = mX[row_c, None]
        gU = mU[row_c, None]
        gY = mY[row_c, None]
        # Rows spanning several warps stage x, u, w, b through shared memory with cp.async:
        # issued here, in flight during the Philox work below (loaded straight into
        # registers, the compiler sinks the loads past the RNG to save registers, and every
        # warp then waits for memory right after it). Measured: D = 1024 0.69 -> 0.76 x copy;
        # one-warp rows (D <= 512) are 3% faster with direct loads. Each thread reads back
        # only what it copied itself, so no barrier is needed.
        staged = const_expr(t.warps_per_row > 1)
        row_in_cta = tidx // tpr
        if const_expr(staged):
            stage_layout = cute.make_layout((t.rows_per_cta, self.dim), stride=(self.dim, 1))
            sX, sU, sW, sB = [smem.allocate_tensor(self.dtype, stage_layout, byte_alignment=16)
                              for _ in range(4)]
            async_atom = cute.make_copy_atom(cpasync.CopyG2SOp(), self.dtype,
                                             num_bits_per_copy=VEC * self.dtype.width)
        sources = ((gX, rX, "x"), (gU, rU, "u"), (mW, rW, "w"), (mB, rB, "b"))
        for v in cutlass.range_constexpr(vpt):
            j = lane + v * tpr
            for g, r, name in sources:
                per_row = const_expr(name in ("x", "u"))
                if (row_ok or not per_row) and (const_expr(t.even) or j < t.num_vecs):
                    if const_expr(staged):
                        stage = {"x": sX, "u": sU, "w": sW, "b": sB}[name]
                        cute.copy(async_atom, cute.local_tile(g, (VEC,), (j,)),
                                  cute.local_tile(stage[row_in_cta, None], (VEC,), (j,)))
                    else:
                        cute.copy(atom, cute.local_tile(g, (VEC,), (j,)), r[None, v])
        if const_expr(staged):
            cute.arch.cp_async_commit_group()

        # Dropout decisions depend only on (seed, row, column, plane): computing them while
        # the loads above are in flight hides their latency behind the Philox arithmetic.
        rWords = cute.make_rmem_tensor(cute.make_layout((2, vpt)), Uint32)
        rWords.fill(0)
        if const_expr(staged):
            sWords = smem.allocate_tensor(Uint32, cute.make_layout((2 * vpt, t.num_threads),
                                                                   stride=(1, 2 * vpt)),
                                          byte_alignment=16)
        if const_expr(self.use_dropout):
            k0 = Uint32(seed)
            k1 = Uint32(seed >> Int64(32))
            threshold = Uint32(keep_threshold)
            for v in cutlass.range_constexpr(vpt):
                j = lane + v * tpr
                for plane in self.planes:
                    # Counter (row, column // 4, plane, 0); word column % 4.
                    for half in cutlass.range_constexpr(2):
                        w = philox4x32_10(Uint32(row_c), Uint32(j * 2 + half), Uint32(plane),
                                          Uint32(0), k0, k1)
                        for q in cutlass.range_constexpr(4):
                            if w[q] >= threshold:
                                rWords[half, v] = rWords[half, v] | Uint32(1 << (8 * q + plane))
            if const_expr(staged):
                # Parked in shared memory before the wait below: the stores pin the Philox
                # work ahead of it (kept in registers, it would be sunk past the wait).
                for k in cutlass.range_constexpr(2 * vpt):
                    sWords[k, tidx] = rWords[k]

        if const_expr(staged):
            cute.arch.cp_async_wait_group(0)
            stages = ((sX, rX, True), (sU, rU, True), (sW, rW, False), (sB, rB, False))
            for v in cutlass.range_constexpr(vpt):
                j = lane + v * tpr
                for stage, r, per_row in stages:
                    if (row_ok or not per_row) and (const_expr(t.even) or j < t.num_vecs):
                        cute.autovec_copy(cute.local_tile(stage[row_in_cta, None], (VEC,), (j,)),
                                          r[None, v])
            if const_expr(self.use_dropout):
                for k in cutlass.range_constexpr(2 * vpt):
                    rWords[k] = sWords[k, tidx]
        x = cute.make_rmem_tensor(frag, Float32)
        x.store(rX.load().to(Float32))
        partial = Float32(0.0)
        for i in cutlass.range_constexpr(VEC * vpt):
            partial = partial + x[i]
        mean = row_sum(partial, t, sbuf, 0) * Float32(1.0 / self.dim)
        partial = Float32(0.0)
        for v in cutlass.range_constexpr(vpt):
            sq = Float32(0.0)
            for e in cutlass.range_constexpr(VEC):
                d = x[e, v] - mean
                sq = sq + d * d
            if const_expr(t.even):
                partial = partial + sq
            else:
                # Unloaded vectors hold zeros; they must not add mean^2 to the variance.
                if lane + v * tpr < t.num_vecs:
                    partial = partial + sq
        var = row_sum(partial, t, sbuf, 1) * Float32(1.0 / self.dim)
        rstd = cute.math.rsqrt(var + eps)
        if row_ok and lane == 0:
            mMean[row] = mean
            mRstd[row] = rstd

        rY = cute.make_rmem_tensor(frag, self.dtype)
        mask_atom = vector_copy_atom(Int8, VEC)
        gM = mMask[row_c, None] if const_expr(self.use_dropout) else None
        for v in cutlass.range_constexpr(vpt):
            j = lane + v * tpr
            a = cute.make_rmem_tensor((VEC,), Float32)
            main = cute.make_rmem_tensor((VEC,), Float32)
            for e in cutlass.range_constexpr(VEC):
                u = rU[e, v].to(Float32)
                if const_expr(self.apply_u_silu):
                    u = u * fast_sigmoid(u)
                if const_expr(self.use_dropout):
                    u = u * keep_scale  # inverted dropout: fold 1 / (1 - p) in once
                a[e] = u
                ln = (x[e, v] - mean) * rstd * rW[e, v].to(Float32) + rB[e, v].to(Float32)
                main[e] = ln * u
            segments = [(self.main_seg, MAIN_BIT, main)]
            if const_expr(self.concat_x):
                segments.append((self.x_seg, X_BIT, None))
            if const_expr(self.concat_u):
                segments.append((self.a_seg, A_BIT, a))
            for seg, plane, vals in segments:
                for e in cutlass.range_constexpr(VEC):
                    val = Float32(0.0)
                    if const_expr(vals is not None):
                        val = vals[e]
                    else:
                        val = x[e, v] * keep_scale if const_expr(self.use_dropout) else x[e, v]
                    if const_expr(self.use_dropout):
                        bit = Uint32(1 << (8 * (e % 4) + plane))
                        val = val if (rWords[e // 4, v] & bit) != Uint32(0) else Float32(0.0)
                    rY[e, v] = val.to(self.dtype)
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(atom, rY[None, v], cute.local_tile(gY, (VEC,), (seg * t.num_vecs + j,)))
            if const_expr(self.use_dropout):
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(mask_atom, cute.recast_tensor(rWords[None, v], Int8),
                              cute.local_tile(gM, (VEC,), (j,)))
