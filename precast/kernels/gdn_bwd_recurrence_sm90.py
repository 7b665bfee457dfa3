"""Gated DeltaNet backward for SM90, the reverse recurrence: the gradient of the state.

One CTA per (sequence, output head) (or ``v_splits`` CTAs, each owning V / v_splits rows of
the state) walks the sequence's chunks from the last to the first with D = dS'^T, the
transposed gradient of the state leaving the chunk (V x K, fp32 in the registers of V / 64
consumer warpgroups; it starts as the final state's gradient, or zeros). It reads stage 1's
M and factor rows [q_f | k_f | G_L], [t_w | t_u] and, instead of W = T diag(t_w) Kc,
T = (I + A)^-1 itself (t_w = beta gamma r_k; with M in work16's packed block, split by the
idle producer warps, see gdn_unpack_sm90, which also scale q's rows by q_f), and the
chunk's raw q, k and do rows. In the notation of precast/reference/gdn_backward.py
(transposed; q_f = scale gamma r_q, k_f = exp(G_L - G) r_k and M the scaled, gated,
causal Q K^T as stage 1 stores them):

    dDelta^T = (D K^T) diag(k_f) + dO^T M                 (V x 64)
    D       <- exp(G_L) D + dO^T diag(q_f) Q - (dDelta^T T diag(t_w))_16 Kc
                                                          (the gradient entering the chunk)

Every chunk's D (the gradient *leaving* it, 16-bit) goes to ``dstates`` by a TMA store from
a staging tile, at the chunk's packed number (stage 1's numbering), but for a one-chunk
sequence's without dfinal (zero; the chunk kernel does not load it); the gradient entering
the first chunk goes to the initial state's gradient (fp32), and without one the first
chunk's step is not made. dDelta is not stored: the
chunk kernel (gdn_bwd_chunk_sm90) recomputes it from dS' and the chunk's own tiles, which
costs less than writing and reading it. Rows of a partial last chunk past the sequence end have
q_f = k_f = 0 and zero rows of M, so they add nothing (do rows there belong to the next
sequence or to TMA's zero fill and must only be finite).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .attention_sm90 import (acc_as_operand_a, advanced, select_modes, store_stmatrix,
                             tma_load_tile, tma_pipeline, tma_store_tile, transposed, wgmma)
from .gdn_layout import CHUNK, G_LAST, K_FACTORS, Q_FACTORS, W_FACTORS
from .gdn_recurrence_sm90 import factor_row_loads, load_factor_row, packed_chunk_start
from .gdn_unpack_sm90 import (UNPACK_WARPS, init_ring_barriers, load_packed, one_bits,
                              unpack_ring)
from .tiling import check_register_split

THREADS_PER_WG = 128
# stages of the load ring: three where one consumer warpgroup owns 64 rows of the state
# (the split form; 184 KB), else two. Measured only together with Q's scaling moved off
# the chain (-7.7 % on the H100); its consumer barely waits for loads (ncu, session 45)
SPLIT_STAGES, STAGES = 3, 2
CONSUMER_BARRIER = 1  # the consumer warpgroups, around the staging tile
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class GdnStateGradSm90:
    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, final_grad: bool, init_grad: bool, v_splits: int = 1):
        """final_grad: an [N, HO, V, K] fp32 gradient of the final state is read (else
        zeros); init_grad: the initial state's gradient goes to an [N, HO, V, K] fp32
        tensor. v_splits: CTAs per (sequence, head), as the forward's recurrence."""
        assert k_dim in (64, 128) and v_dim in (64, 128)
        assert v_dim % (64 * v_splits) == 0
        self.dtype = dtype
        self.k_dim, self.v_dim = k_dim, v_dim
        self.heads = max(q_heads, v_heads)
        self.q_group, self.k_group = self.heads // q_heads, self.heads // k_heads
        self.final_grad, self.init_grad = final_grad, init_grad
        self.v_splits = v_splits
        self.v_rows = v_dim // v_splits
        self.nwg = self.v_rows // 64
        self.num_threads = (self.nwg + 1) * THREADS_PER_WG
        self.stages = SPLIT_STAGES if self.nwg == 1 else STAGES
        self.register_split = check_register_split(
            type(self).__name__, self.num_threads,
            (PRODUCER_REGS,) + (CONSUMER_REGS,) * self.nwg)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mDO: cute.Tensor,
                 mWork16: cute.Tensor, mWork32: cute.Tensor, mCuSeqlens: cute.Tensor,
                 mSeqTable: cute.Tensor, mDFinal: cute.Tensor, mDStates: cute.Tensor,
                 mDInit: cute.Tensor, stream: cuda.CUstream):
        """mQ (T, HQ, K), mK (T, HK, K), mDO (T, HO, V); mWork16 / mWork32 as
        gdn_layout.workspace_shapes (the packed P); mSeqTable: gdn_seq_table_sm90's table (or
        cu_seqlens: none); mDFinal, mDInit (N, HO, V, K) fp32 or None; mDStates (chunks, HO,
        V, K) in the io dtype."""
        dt = self.dtype
        K, C, Vc = self.k_dim, CHUNK, self.v_rows
        n = self.stages
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, K), dt, n)
        sDO_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, Vc), dt, n)
        sM_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, C), dt, n)
        sDS_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, Vc, K), dt, 1)
        one = lambda layout: cute.slice_(layout, (None, None, 0))  # noqa: E731
        g2s, s2g = cpasync.CopyBulkTensorTileG2SOp(), cpasync.CopyBulkTensorTileS2GOp()
        mW = select_modes(mWork16, [2, 3, 1, 0])  # (64, F, HO, chunks)
        # work16's packed 64 x 64 block P: T (instead of W = T diag(t_w) Kc) and M in 8 KB
        tma_blk, mW_blk = cpasync.make_tiled_tma_atom(g2s, mW, one(sM_layout), (C, C))
        tma_q, mQ_t = cpasync.make_tiled_tma_atom(g2s, select_modes(mQ, [0, 2, 1]),
                                                  one(sK_layout), (C, K))
        tma_k, mK_t = cpasync.make_tiled_tma_atom(g2s, select_modes(mK, [0, 2, 1]),
                                                  one(sK_layout), (C, K))
        tma_do, mDO_t = cpasync.make_tiled_tma_atom(g2s, select_modes(mDO, [0, 2, 1]),
                                                    one(sDO_layout), (C, Vc))
        store_ds, mDS_t = cpasync.make_tiled_tma_atom(
            s2g, select_modes(mDStates, [2, 3, 1, 0]), one(sDS_layout), (Vc, K))
        tma_f, mF_t, sF_layout, factor_bytes = factor_row_loads(mWork32, self.stages)
        # (P, loaded first, has an mbarrier of its own)
        self.stage_bytes = (2 * cute.size_in_bytes(dt, one(sK_layout))
                            + cute.size_in_bytes(dt, one(sDO_layout)) + factor_bytes)
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # (V rows) x 64 tokens: D K^T (D from registers) and dO^T M (both from shared memory)
        mma_tok = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32,
                                                    (self.nwg, 1, 1), (64, C), rmem)
        mma_tok_ss = sm90_utils.make_trivial_tiled_mma(dt, dt, mn_major, mn_major, Float32,
                                                       (self.nwg, 1, 1), (64, C))
        # (V rows) x K: -(dDelta^T T diag(t_w)) Kc (from registers) and dO^T (diag(q_f) Q)
        mma_state = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                      (self.nwg, 1, 1), (64, K), rmem)
        mma_state_ss = sm90_utils.make_trivial_tiled_mma(dt, dt, mn_major, mn_major, Float32,
                                                         (self.nwg, 1, 1), (64, K))
        # (V rows) x 64 tokens: dDelta^T T (dDelta^T from registers, T read transposed)
        mma_t = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                   (self.nwg, 1, 1), (64, C), rmem)

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
            # a stage's P landed (TMA bytes), then its T and M made (UNPACK_WARPS arrivals)
            p_full: cute.struct.MemRange[cutlass.Int64, self.stages]
            unpacked: cute.struct.MemRange[cutlass.Int64, self.stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sT: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sM_layout)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sDO_layout)], 1024]
            sM: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sM_layout)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sDS_layout)], 1024]
            sF: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sF_layout)], 128]

        self.storage = SharedStorage
        num_batches = mCuSeqlens.shape[0] - 1
        loads = ((tma_q, mQ_t), (tma_k, mK_t), (tma_blk, mW_blk), (tma_do, mDO_t),
                 (tma_f, mF_t))
        self.kernel((mma_tok, mma_tok_ss, mma_state, mma_state_ss, mma_t), loads,
                    (store_ds, mDS_t),
                    (sK_layout, sDO_layout, sM_layout, sDS_layout, sF_layout),
                    mCuSeqlens, mSeqTable, mDFinal, mDInit, num_batches).launch(
            grid=[self.heads, cutlass.max(num_batches, 1), self.v_splits],
            block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mmas: tuple, loads: tuple, store: tuple, layouts: tuple,
               mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor, mDFinal: cute.Tensor,
               mDInit: cute.Tensor, num_batches: Int32):
        sK_layout, sDO_layout, sM_layout, sDS_layout, sF_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        head, batch, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        pipe = tma_pipeline(storage.bars.data_ptr(), self.stages, self.stage_bytes,
                            self.nwg * THREADS_PER_WG)
        p_full, unpacked = storage.p_full.data_ptr(), storage.unpacked.data_ptr()
        init_ring_barriers(p_full, unpacked, self.stages, tidx)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        tiles = tuple(s.get_tensor(layout.outer, swizzle=layout.inner) for s, layout in (
            (storage.sQ, sK_layout), (storage.sK, sK_layout), (storage.sT, sM_layout),
            (storage.sM, sM_layout), (storage.sDO, sDO_layout))) + (
                storage.sF.get_tensor(sF_layout),)
        sDS = storage.sDS.get_tensor(sDS_layout.outer, swizzle=sDS_layout.inner)

        start = mCuSeqlens[batch]
        length = mCuSeqlens[batch + 1] - start
        chunks = (length + CHUNK - 1) // CHUNK
        first_chunk = packed_chunk_start(mCuSeqlens, batch, mSeqTable)
        # chunk steps: without the initial state's gradient, the first chunk's would only
        # make the gradient entering it, which nothing reads (its dS' is stored after them)
        updates = chunks if const_expr(self.init_grad) else cutlass.max(chunks - 1, 0)
        if warp == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(loads, tiles, pipe, p_full, head, start, first_chunk, chunks, updates,
                         split)
        elif warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            # P (sM) -> T (sT) and M (sM); then, once the stage's other tiles have landed,
            # Q's rows scaled by q_f (dO^T diag(q_f) Q contracts over tokens): work the
            # consumers no longer do on their chain (state_grad_split -1.5 %, run 46a)
            sQ, sF = tiles[0], tiles[5]

            def scale_q(stage, phase):  # (a wait on the ring's full barrier, no arrival)
                pipe.sync_object_full.wait(stage, phase)
                self.scale_rows(sQ[None, None, stage], sF[0, None, stage],
                                tidx - cute.arch.WARP_SIZE, UNPACK_WARPS * cute.arch.WARP_SIZE)
            unpack_ring(storage.sM.data_ptr().toint(), storage.sT.data_ptr().toint(), p_full,
                        unpacked, updates, warp - 1, self.stages, True,
                        one_bits(self.dtype), also=scale_q)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(mmas, tiles, sDS, store, pipe, unpacked, mDFinal, mDInit,
                         batch, head, first_chunk, chunks, updates, tidx - THREADS_PER_WG,
                         split)

    @cute.jit
    def produce(self, loads, tiles, pipe, p_full, head: Int32, start: Int32,
                first_chunk: Int32, chunks: Int32, updates: Int32, split: Int32):
        """The chunks' packed P (into sM, first: unpack_ring splits it while the rest
        lands), q, k (raw rows), factor row and this CTA's do columns, last chunk first,
        for the last ``updates`` chunks."""
        K, C, Vc = self.k_dim, CHUNK, self.v_rows
        (tma_q, mQ), (tma_k, mK), (tma_blk, mW_blk), (tma_do, mDO), (tma_f, mF) = loads
        sQ, sK, _, sM, sDO, sF = tiles  # (T, tiles[2], is made from P by unpack_ring)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                             self.stages)
        for i in cutlass.range(updates, unroll=1):
            c = chunks - 1 - i
            pipe.producer_acquire(state)
            load_packed(tma_blk, mW_blk[None, None, head, first_chunk + c], sM, state.index,
                        p_full)
            bar = pipe.producer_get_barrier(state)
            for atom, m, s, h, cols, col_tile in (
                    (tma_q, mQ, sQ, head // self.q_group, K, 0),
                    (tma_k, mK, sK, head // self.k_group, K, 0),
                    (tma_do, mDO, sDO, head, Vc, split)):
                g = cute.local_tile(cute.domain_offset((start, 0), m[None, None, h]), (C, cols),
                                    (c, col_tile))
                tma_load_tile(atom, g, s, state.index, bar)
            load_factor_row(tma_f, mF, sF, head, first_chunk + c, state.index, bar)
            state = advanced(state)

    def consumer_sync(self):
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER,
                          number_of_threads=self.nwg * THREADS_PER_WG)

    @cute.jit
    def consume(self, mmas, tiles, sDS, store, pipe, unpacked, mDFinal, mDInit,
                batch: Int32, head: Int32, first_chunk: Int32, chunks: Int32, updates: Int32,
                consumer_tidx: Int32, split: Int32):
        mma_tok, mma_tok_ss, mma_state, mma_state_ss, mma_t = mmas
        sQ, sK, sT, sM, sDO, sF = tiles
        store_ds, mDS_t = store
        K, C, rows = self.k_dim, CHUNK, self.v_rows
        wg = consumer_tidx // THREADS_PER_WG
        issuer = consumer_tidx < cute.arch.WARP_SIZE  # the warp that issues the TMA stores
        wg_tok, wg_tok_ss = (m.get_slice(wg * THREADS_PER_WG) for m in (mma_tok, mma_tok_ss))
        wg_state, wg_state_ss = (m.get_slice(wg * THREADS_PER_WG)
                                 for m in (mma_state, mma_state_ss))
        thr_tok = mma_tok.get_slice(consumer_tidx)
        thr_state = mma_state.get_slice(consumer_tidx)
        do_t = transposed(sDO, C, rows)  # (V rows, tokens, stages)
        tXrK = wg_tok.make_fragment_B(wg_tok.partition_B(sK))
        tYrDO = wg_tok_ss.make_fragment_A(wg_tok_ss.partition_A(do_t))
        tYrM = wg_tok_ss.make_fragment_B(wg_tok_ss.partition_B(transposed(sM, C, C)))
        # -dDelta^T W = (-dDelta^T T diag(t_w)) Kc: T read transposed, then Kc read transposed
        wg_t = mma_t.get_slice(wg * THREADS_PER_WG)
        thr_t = mma_t.get_slice(consumer_tidx)
        tPrT = wg_t.make_fragment_B(wg_t.partition_B(transposed(sT, C, C)))
        tSrW = wg_state.make_fragment_B(wg_state.partition_B(transposed(sK, C, K)))
        acc_p = cute.make_rmem_tensor(wg_t.partition_shape_C((rows, C)), Float32)
        p16 = cute.make_rmem_tensor(acc_p.layout, self.dtype)
        tSrP = cute.make_tensor(p16.iterator, acc_as_operand_a(acc_p.layout))
        tSrDO = wg_state_ss.make_fragment_A(wg_state_ss.partition_A(do_t))
        tSrQ = wg_state_ss.make_fragment_B(wg_state_ss.partition_B(transposed(sQ, C, K)))
        acc_state = cute.make_rmem_tensor(wg_state.partition_shape_C((rows, K)), Float32)
        acc_dd = cute.make_rmem_tensor(wg_tok.partition_shape_C((rows, C)), Float32)
        acc_dm = cute.make_rmem_tensor(acc_dd.layout, Float32)  # dO^T M
        state16 = cute.make_rmem_tensor(acc_state.layout, self.dtype)
        neg_dd16 = cute.make_rmem_tensor(acc_dd.layout, self.dtype)
        tXrS = cute.make_tensor(state16.iterator, acc_as_operand_a(acc_state.layout))
        tSrD = cute.make_tensor(neg_dd16.iterator, acc_as_operand_a(acc_dd.layout))
        by_token = cute.make_layout((rows, C), stride=(0, 1))

        acc_state.fill(0.0)
        if const_expr(self.final_grad):
            src = self.state_view(thr_state, mDFinal, batch, head, split)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                acc_state[e] = src[e]
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                             self.stages)
        for i in cutlass.range(updates, unroll=1):
            c = chunks - 1 - i
            chunk = first_chunk + c
            s = state.index
            factors = sF[0, None, s]  # [q_f | k_f | G_L]
            pipe.consumer_wait(state)
            cute.arch.mbarrier_wait(unpacked + s, state.phase)
            if issuer:  # the previous chunk's store has read the staging tile
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            self.consumer_sync()
            state16.store(acc_state.load().to(self.dtype))
            # D's staging copy by stmatrix (was element-wise: 32 STS and 48 PRMT a chunk)
            store_stmatrix(state16, mma_state, sDS[None, None, 0], consumer_tidx)
            decay = cute.math.exp(factors[G_LAST], fastmath=True)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                acc_state[e] = acc_state[e] * decay
            # Only D K^T is on the chain: it and dO^T M (dDelta^T = (D K^T) diag(k_f) +
            # dO^T M, separate accumulators) go first, then D <- exp(G_L) D + dO^T diag(q_f)
            # Q (Q scaled by the unpacking warps) joins them.
            wgmma(mma_tok, acc_dd, tXrS, tXrK[None, None, None, s], False)
            wgmma(mma_tok_ss, acc_dm, tYrDO[None, None, None, s], tYrM[None, None, None, s],
                  False)
            cute.arch.fence_proxy("async.shared", space="cta")
            self.consumer_sync()  # the staging tile is complete
            wgmma(mma_state_ss, acc_state, tSrDO[None, None, None, s],
                  tSrQ[None, None, None, s], True)
            if issuer:  # the whole warp: the TMA copy elects its lane itself
                tma_store_tile(store_ds, sDS, cute.local_tile(
                    mDS_t[None, None, head, chunk], (rows, K), (split, 0)))
                cute.arch.cp_async_bulk_commit_group()
            warpgroup.wait_group(1)  # D K^T and dO^T M (the state's product may run on)
            t_kf = thr_tok.partition_C(cute.make_tensor(
                cute.domain_offset((K_FACTORS,), factors).iterator, by_token))
            # in fp32, then converted as a whole (pairs per F2FP; negating after an
            # element-wise conversion cost a bf16 HFMA2 and a PRMT per element)
            for e in cutlass.range_constexpr(cute.size(acc_dd)):
                acc_dd[e] = -(acc_dd[e] * t_kf[e]) - acc_dm[e]
            neg_dd16.store(acc_dd.load().to(self.dtype))
            # D -= dDelta^T W = (dDelta^T T diag(t_w)) Kc: one more 64-deep product on the
            # chain, 8 KB fewer loads
            wgmma(mma_t, acc_p, tSrD, tPrT[None, None, None, s], False)
            t_w = thr_t.partition_C(cute.make_tensor(
                cute.domain_offset((W_FACTORS,), sF[1, None, s]).iterator, by_token))
            warpgroup.wait_group(0)
            for e in cutlass.range_constexpr(cute.size(acc_p)):
                acc_p[e] = acc_p[e] * t_w[e]
            p16.store(acc_p.load().to(self.dtype))
            wgmma(mma_state, acc_state, tSrP, tSrW[None, None, None, s], True)
            warpgroup.wait_group(0)
            cute.arch.sync_warp()
            pipe.consumer_release(state)
            state = advanced(state)
        if const_expr(not self.init_grad):
            # the first chunk's dS' (no step made the gradient entering it); in a one-chunk
            # sequence without dfinal it is zero and not stored (the chunk kernel makes
            # the last chunk's dS' tile zero without loading it)
            if chunks > int(not self.final_grad):
                if issuer:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                self.consumer_sync()
                state16.store(acc_state.load().to(self.dtype))
                store_stmatrix(state16, mma_state, sDS[None, None, 0], consumer_tidx)
                cute.arch.fence_proxy("async.shared", space="cta")
                self.consumer_sync()
                if issuer:
                    tma_store_tile(store_ds, sDS, cute.local_tile(
                        mDS_t[None, None, head, first_chunk], (rows, K), (split, 0)))
                    cute.arch.cp_async_bulk_commit_group()
        if issuer:  # the last store has read the staging tile before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        if const_expr(self.init_grad):
            dst = self.state_view(thr_state, mDInit, batch, head, split)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                dst[e] = acc_state[e]

    @cute.jit
    def scale_rows(self, sQ, factors, tidx: Int32, threads: cutlass.Constexpr):
        """sQ[i, :] *= q_f[i] over ``threads`` threads, this one ``tidx`` (one stage, 64 x
        K), 8 elements (16 bytes) per access."""
        K, C = self.k_dim, CHUNK
        x8 = cute.make_rmem_tensor(cute.make_layout((1, 8)), self.dtype)
        for idx in cutlass.range(tidx, C * K // 8, threads, unroll=2):
            i = idx // (K // 8)
            tile = cute.local_tile(sQ, (1, 8), (i, idx - i * (K // 8)))
            cute.autovec_copy(tile, x8)
            f = factors[Q_FACTORS + i]
            for u in cutlass.range_constexpr(8):
                x8[u] = (x8[u].to(Float32) * f).to(self.dtype)
            cute.autovec_copy(x8, tile)

    @cute.jit
    def state_view(self, thr_state, mStates, row: Int32, head: Int32, split: Int32):
        """This thread's elements of ``mStates[row, head]`` (V x K; this CTA's rows), in
        accumulator order."""
        return thr_state.partition_C(cute.local_tile(
            mStates[row, head, None, None], (self.v_rows, self.k_dim), (split, 0)))
