"""HSTU attention forward for SM90: TMA + wgmma, warp-specialized, varlen, every mask.

For each packed sequence and query head h (kv head h // (H / H_kv)):
    S = alpha * Q K^T;  P = mask * SiLU(S);  O = P V / scaling_seqlen

One CTA computes a 128-row query tile of one (sequence, head):
- warp 0 (producer warpgroup, registers given back) streams Q once and K/V tiles
  through TMA into multi-stage shared-memory rings (separate K and V barriers);
- two consumer warpgroups own 64 query rows each. Per key tile they issue
  S = Q K^T, and while the tensor cores run P_prev V for the previous tile they
  turn S into P = SiLU in registers (fp32, in place); P feeds the second wgmma as a
  register operand, so S never touches shared memory.
SiLU(z) = s + s * tanh(s) with s = z / 2: one MUFU.TANH per score. The mask is
evaluated only on key tiles that cut a window edge or the sequence end (the func
mask on every tile); tiles outside the window are never loaded. Key tiles run
from the last to the first, so the masked edge tiles come first.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.utils import LayoutEnum

TILE_M = 128  # query rows per CTA (two consumer warpgroups of 64)
WG_ROWS = 64
THREADS_PER_WG = 128
PAGE_SIZE = 128
# (key tile, pipeline stages) per head dim: fits 227 KB of shared memory and 240 registers.
TILE_N = {32: 128, 64: 128, 128: 128, 256: 64}
STAGES = {32: 4, 64: 4, 128: 2, 256: 2}
PRODUCER_REGS, CONSUMER_REGS = 24, 240


def _select(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """wgmma accumulator ((2 cols, 2 rows, N/8), M, N) viewed as (rows, cols)."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
                            stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))


def _acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Accumulator registers ((2, 2, N/8), M, N) read as a 16-bit A operand
    ((2, 2, 2), M, (N/16, N)): two 8-column groups make one k16 slice."""
    s, d = acc_layout.shape, acc_layout.stride
    groups = s[0][2]
    return cute.make_layout(((s[0][0], s[0][1], 2), s[1], (groups // 2, s[2])),
                            stride=((d[0][0], d[0][1], d[0][2]), d[1],
                                    (d[0][2] * 2, d[2])))


class HstuAttentionForwardSm90:
    def __init__(self, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                 window_left_bounded: bool, window_right_bounded: bool, func_intervals: int,
                 paged: bool):
        assert head_dim in TILE_N, head_dim
        assert num_heads % num_kv_heads == 0
        assert func_intervals == 0 or func_intervals % 2 == 1
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.left_bounded = window_left_bounded
        self.right_bounded = window_right_bounded
        self.func_intervals = func_intervals
        self.paged = paged
        self.tile_n = TILE_N[head_dim]
        self.stages = STAGES[head_dim]
        self.num_threads = 3 * THREADS_PER_WG

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mFunc: cute.Tensor,
                 mPagedKV: cute.Tensor, mPageIds: cute.Tensor, mPageIndptrs: cute.Tensor,
                 max_seqlen_q: Int32, window_left: Int32, window_right: Int32,
                 half_alpha: Float32, out_scale: Float32, stream: cuda.CUstream):
        dt = self.dtype
        D, tn = self.head_dim, self.tile_n
        # (T, H, D) -> (T, D, H): rows and head dim first, as TMA tiles them.
        mQ, mO = [_select(t, [0, 2, 1]) for t in (mQ, mO)]
        if const_expr(self.paged):
            # (pages, 2, 128, H_kv, D) -> K rows (128, D, H_kv, 2, pages), V^T (D, 128, ...)
            mK = _select(mPagedKV, [2, 4, 3, 1, 0])
            mVt = _select(mPagedKV, [4, 2, 3, 1, 0])
        else:
            mK = _select(mK, [0, 2, 1])
            mVt = _select(mV, [2, 0, 1])  # (D, T_k, H_kv): V^T, MN-major B operand

        mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            (TILE_M // WG_ROWS, 1, 1), (WG_ROWS, tn))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            (TILE_M // WG_ROWS, 1, 1), (WG_ROWS, D), warpgroup.OperandSource.RMEM)

        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, tn, D), dt, 1)
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, tn, D), dt,
                                                  self.stages)
        sVt_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, D, tn), dt,
                                                   self.stages)
        one = lambda layout: cute.slice_(layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, one(sQ_layout), (TILE_M, D))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, one(sK_layout), (tn, D))
        tma_v, mVt_tma = cpasync.make_tiled_tma_atom(g2s, mVt, one(sVt_layout), (D, tn))
        self.q_bytes = cute.size_in_bytes(dt, one(sQ_layout))
        self.kv_bytes = cute.size_in_bytes(dt, one(sK_layout))

        stages = self.stages

        @cute.struct
        class SharedStorage:
            q_bars: cute.struct.MemRange[cutlass.Int64, 2]
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sVt_layout)], 1024]

        self.storage = SharedStorage
        num_batches = mCuSeqlensQ.shape[0] - 1
        m_blocks = cutlass.max((max_seqlen_q + TILE_M - 1) // TILE_M, 1)
        self.kernel(mma_qk, mma_pv, mQ_tma, mK_tma, mVt_tma, mO, tma_q, tma_k, tma_v, sQ_layout, sK_layout,
                    sVt_layout, mCuSeqlensQ, mCuSeqlensK, mFunc, mPageIds, mPageIndptrs,
                    window_left, window_right, half_alpha, out_scale).launch(
            grid=[self.num_heads, m_blocks, num_batches], block=[self.num_threads, 1, 1],
            stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_v: cute.CopyAtom,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sVt_layout: cute.ComposedLayout, mCuSeqlensQ: cute.Tensor,
               mCuSeqlensK: cute.Tensor, mFunc: cute.Tensor, mPageIds: cute.Tensor,
               mPageIndptrs: cute.Tensor, window_left: Int32, window_right: Int32,
               half_alpha: Float32, out_scale: Float32):
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        head, m_rev, batch = cute.arch.block_idx()
        _, m_blocks, _ = cute.arch.grid_dim()
        m_block = m_blocks - 1 - m_rev  # heaviest (causal) tiles start first
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(self.storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                              2 * THREADS_PER_WG // cute.arch.WARP_SIZE)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_bars.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.q_bytes, defer_sync=True)
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_bars.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.kv_bytes,
            defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_bars.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.kv_bytes,
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)

        # The tile's sequence; everything below is uniform over the CTA.
        q_start = mCuSeqlensQ[batch]
        len_q = mCuSeqlensQ[batch + 1] - q_start
        k_start = mCuSeqlensK[batch]
        len_k = mCuSeqlensK[batch + 1] - k_start
        m0 = m_block * TILE_M
        if m0 < len_q:
            n_min, n_max = self.key_tile_range(m0, len_q, len_k, window_left, window_right)
            if warp_idx == 0:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                self.produce(mQ, mK, mVt, tma_q, tma_k, tma_v, sQ, sK, sVt, pipe_q, pipe_k,
                             pipe_v, head, batch, m_block, q_start, k_start, n_min, n_max,
                             mPageIds, mPageIndptrs)
            elif warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            else:
                cute.arch.setmaxregister_increase(CONSUMER_REGS)
                self.consume(mma_qk, mma_pv, mO, sQ, sK, sVt, pipe_q, pipe_k, pipe_v, tidx - THREADS_PER_WG,
                             head, m0, q_start, len_q, len_k, n_min, n_max, mFunc,
                             window_left, window_right, half_alpha, out_scale)

    @cute.jit
    def key_tile_range(self, m0: Int32, len_q: Int32, len_k: Int32, window_left: Int32,
                       window_right: Int32):
        """[n_min, n_max): the key tiles any row of the query tile can see."""
        tn = self.tile_n
        off = len_k - len_q
        m_last = cutlass.min(m0 + TILE_M, len_q) - 1
        lo = Int32(0)
        hi = len_k - 1
        if const_expr(self.left_bounded):
            lo = cutlass.max(m0 + off - window_left, 0)
        if const_expr(self.right_bounded):
            hi = cutlass.min(m_last + off + window_right, len_k - 1)
        n_min = lo // tn
        n_max = (hi + tn) // tn
        if hi < lo:
            n_max = n_min
        return n_min, n_max

    @cute.jit
    def produce(self, mQ, mK, mVt, tma_q, tma_k, tma_v, sQ, sK, sVt, pipe_q, pipe_k, pipe_v,
                head: Int32, batch: Int32, m_block: Int32, q_start: Int32, k_start: Int32,
                n_min: Int32, n_max: Int32, mPageIds, mPageIndptrs):
        tn = self.tile_n
        D = self.head_dim
        kv_head = head // self.group
        gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, None, head]),
                             (TILE_M, D), (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        if const_expr(self.paged):
            # (tn, D, sub-tiles of a page, pages) and (D, tn, sub-tiles, pages)
            gK = cute.local_tile(mK[None, None, kv_head, 0, None], (tn, D), (None, 0, None))
            gVt = cute.local_tile(mVt[None, None, kv_head, 1, None], (D, tn), (0, None, None))
        else:
            gK = cute.local_tile(cute.domain_offset((k_start, 0), mK[None, None, kv_head]),
                                 (tn, D), (None, 0))
            gVt = cute.local_tile(cute.domain_offset((0, k_start), mVt[None, None, kv_head]),
                                  (D, tn), (0, None))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                           cute.group_modes(sVt, 0, 2),
                                           cute.group_modes(gVt, 0, 2))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ[None, 0],
                  tma_bar_ptr=pipe_q.producer_get_barrier(q_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        page_base = Int32(0)
        if const_expr(self.paged):
            page_base = mPageIndptrs[batch]
        for i in cutlass.range(n_max - n_min, unroll=1):
            n = n_max - 1 - i
            pipe_k.producer_acquire(state)
            if const_expr(self.paged):
                sub_tiles = PAGE_SIZE // tn
                page = mPageIds[page_base + n // sub_tiles]
                sub = n % sub_tiles
                cute.copy(tma_k, tKgK[None, sub, page], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(state)
                cute.copy(tma_v, tVgV[None, sub, page], tVsV[None, state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state))
            else:
                cute.copy(tma_k, tKgK[None, n], tKsK[None, state.index],
                          tma_bar_ptr=pipe_k.producer_get_barrier(state))
                pipe_v.producer_acquire(state)
                cute.copy(tma_v, tVgV[None, n], tVsV[None, state.index],
                          tma_bar_ptr=pipe_v.producer_get_barrier(state))
            state.advance()

    @cute.jit
    def consume(self, mma_qk, mma_pv, mO, sQ, sK, sVt, pipe_q, pipe_k, pipe_v, tidx: Int32, head: Int32,
                m0: Int32, q_start: Int32, len_q: Int32, len_k: Int32, n_min: Int32,
                n_max: Int32, mFunc, window_left: Int32, window_right: Int32,
                half_alpha: Float32, out_scale: Float32):
        tn = self.tile_n
        D = self.head_dim
        wg = tidx // THREADS_PER_WG
        wg_qk = mma_qk.get_slice(wg * THREADS_PER_WG)
        wg_pv = mma_pv.get_slice(wg * THREADS_PER_WG)
        thr_qk = mma_qk.get_slice(tidx)
        thr_pv = mma_pv.get_slice(tidx)

        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        acc_s = cute.make_rmem_tensor(wg_qk.partition_shape_C((TILE_M, tn)), Float32)
        acc_o = cute.make_rmem_tensor(wg_pv.partition_shape_C((TILE_M, D)), Float32)
        acc_o.fill(0.0)
        p_regs = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        tOrP = cute.make_tensor(p_regs.iterator, _acc_as_operand_a(acc_s.layout))

        # (row, col) of each score this thread holds, in the CTA tile.
        c_s = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, tn)))
        coords = cute.make_tensor(c_s.iterator, _acc_mn_layout(c_s.layout))
        s_mn = cute.make_tensor(acc_s.iterator, _acc_mn_layout(acc_s.layout))

        # Per-row data of the mask: local query index, window bounds or func intervals.
        rows = cute.size(s_mn, mode=[0])
        row_i = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        for r in cutlass.range_constexpr(rows):
            row_i[r] = m0 + coords[r, 0][0]
        off = len_k - len_q
        nf = const_expr(self.func_intervals)
        func = None
        if const_expr(nf > 0):
            func = cute.make_rmem_tensor(cute.make_layout((rows, nf)), Int32)
            for r in cutlass.range_constexpr(rows):
                for t in cutlass.range_constexpr(nf):
                    func[r, t] = mFunc[0, t, q_start + row_i[r]]

        m0_wg = m0 + wg * WG_ROWS
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)

        num_tiles = n_max - n_min
        if num_tiles > 0:
            # First key tile: S, then P (always masked: it holds the sequence end).
            n = n_max - 1
            pipe_k.consumer_wait(k_state)
            self.gemm(mma_qk, acc_s, tSrQ[None, None, None, 0], tSrK[None, None, None, k_state.index],
                      accumulate=False)
            warpgroup.wait_group(0)
            pipe_k.consumer_release(k_state)
            self.scores_to_p(s_mn, coords, row_i, func, n, True, len_k, off, window_left,
                             window_right, half_alpha)
            p_regs.store(acc_s.load().to(self.dtype))
            v_state = k_state.clone()
            k_state.advance()
            for i in cutlass.range(1, num_tiles, unroll=1):
                n = n_max - 1 - i
                pipe_k.consumer_wait(k_state)
                self.gemm(mma_qk, acc_s, tSrQ[None, None, None, 0],
                          tSrK[None, None, None, k_state.index], accumulate=False)
                pipe_v.consumer_wait(v_state)
                self.gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], accumulate=True)
                warpgroup.wait_group(1)
                pipe_k.consumer_release(k_state)
                masked = self.tile_needs_mask(n, m0_wg, len_k, off, window_left, window_right)
                self.scores_to_p(s_mn, coords, row_i, func, n, masked, len_k, off,
                                 window_left, window_right, half_alpha)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                p_regs.store(acc_s.load().to(self.dtype))
                v_state.advance()
                k_state.advance()
            pipe_v.consumer_wait(v_state)
            self.gemm(mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], accumulate=True)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)

        self.store_output(mO, acc_o, thr_pv, head, m0, q_start, len_q, out_scale)

    @cute.jit
    def gemm(self, tiled_mma, acc, tCrA, tCrB, accumulate: cutlass.Constexpr):
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its ACCUMULATE flag is mutated
        for k in cutlass.range_constexpr(cute.size(tCrA.shape[2])):
            atom.set(warpgroup.Field.ACCUMULATE, accumulate or k != 0)
            cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        warpgroup.commit_group()

    @cute.jit
    def tile_needs_mask(self, n: Int32, m0_wg: Int32, len_k: Int32, off: Int32,
                        window_left: Int32, window_right: Int32) -> Boolean:
        """Whether any score of this warpgroup's 64 rows x key tile n is masked."""
        tn = self.tile_n
        j0 = n * tn
        masked = j0 + tn > len_k
        if const_expr(self.func_intervals > 0):
            masked = Boolean(True)
        if const_expr(self.right_bounded):
            masked = masked or (j0 + tn - 1 - m0_wg > off + window_right)
        if const_expr(self.left_bounded):
            masked = masked or (j0 - (m0_wg + WG_ROWS - 1) < off - window_left)
        return masked

    @cute.jit
    def scores_to_p(self, s_mn, coords, row_i, func, n: Int32, masked: Boolean, len_k: Int32,
                    off: Int32, window_left: Int32, window_right: Int32, half_alpha: Float32):
        """S -> SiLU(alpha S) in place (fp32); zero where the mask hides the key."""
        j0 = n * self.tile_n
        rows = cute.size(s_mn, mode=[0])
        cols = cute.size(s_mn, mode=[1])
        if masked:
            for r in cutlass.range_constexpr(rows):
                i = row_i[r]
                for c in cutlass.range_constexpr(cols):
                    j = j0 + coords[0, c][1]
                    visible = j < len_k
                    if const_expr(self.right_bounded):
                        visible = visible and (j <= i + off + window_right)
                    if const_expr(self.left_bounded):
                        visible = visible and (j >= i + off - window_left)
                    if const_expr(self.func_intervals > 0):
                        inside = j < func[r, 0]
                        for t in cutlass.range_constexpr(1, self.func_intervals, 2):
                            inside = inside or (j >= func[r, t] and j < func[r, t + 1])
                        visible = visible and inside
                    p = self.silu_half(s_mn[r, c], half_alpha)
                    s_mn[r, c] = p if visible else Float32(0.0)
        else:
            for r in cutlass.range_constexpr(rows):
                for c in cutlass.range_constexpr(cols):
                    s_mn[r, c] = self.silu_half(s_mn[r, c], half_alpha)

    @cute.jit
    def silu_half(self, acc: Float32, half_alpha: Float32) -> Float32:
        # SiLU(z) = s + s * tanh(s), s = z / 2 (the 1 / scaling_seqlen goes on O).
        s = acc * half_alpha
        t = cute.arch.inline_ptx("tanh.approx.f32 {$w0}, {$r0};", write_only_types=[Float32],
                                 read_only_args=[s])
        return s + s * t

    @cute.jit
    def store_output(self, mO, acc_o, thr_pv, head: Int32, m0: Int32, q_start: Int32,
                     len_q: Int32, out_scale: Float32):
        """O / scaling_seqlen -> rows of this sequence only (other rows belong to others)."""
        D = self.head_dim
        out = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        out.store((acc_o.load() * out_scale).to(self.dtype))
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, None, head]),
                             (TILE_M, D), (m0 // TILE_M, 0))
        tOgO = thr_pv.partition_C(gO)
        coords = thr_pv.partition_C(cute.make_identity_tensor((TILE_M, D)))
        out_mn = cute.make_tensor(out.iterator, _acc_mn_layout(out.layout))
        g_mn = cute.make_tensor(tOgO.iterator, _acc_mn_layout(tOgO.layout))
        c_mn = cute.make_tensor(coords.iterator, _acc_mn_layout(coords.layout))
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            if m0 + c_mn[r, 0][0] < len_q:
                for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                    g_mn[r, c] = out_mn[r, c]
