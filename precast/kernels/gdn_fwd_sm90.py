"""Gated DeltaNet forward for SM90 in one kernel: the two stages of gdn_chunk_sm90 and
gdn_recurrence_sm90 as warp-specialized roles of one CTA per (sequence, output head), with
shared memory instead of the workspace between them.

Verified against the fp64 recurrence on an H200 (2026-11-30, raw kernel; no op path yet).

- warp 0 (producer): TMA loads of the chunk's raw Q, K, V rows into stage c % 2;
- warpgroup 1 (preparing role): gates, L2 row scales, A, T, W, U, M and the factor row of
  chunk c (stage 1's code), writing U over V and W, M, the factors into their stage
  buffers, one chunk ahead of the state; Q and K stay as loaded;
- warpgroups 2.. (state role, V / 64 of them): stage 2's per-chunk update on those buffers.
Per stage three mbarriers: raw_full (TMA bytes), prepared (128 preparing threads arrive),
empty (every state thread arrives once its wgmmas have read the stage).
Only q, k, v, g, beta are read and o (and the states) written: ~64 KB per (chunk, head)
against ~150 KB for the two-stage kernels.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from .gdn_chunk_sm90 import A_ELEMS, ROW_VALUES, GdnChunkPrepareSm90, a_layout
from .gdn_layout import CHUNK, FACTOR_COLS
from .gdn_recurrence_sm90 import THREADS_PER_WG, GdnChunkRecurrenceSm90
from .tiling import check_register_split, launch_registers

STAGES = 2
PRODUCER_REGS = 24


class GdnForwardSm90(GdnChunkPrepareSm90):
    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, l2norm: bool, g_dtype, beta_dtype, initial_state: bool,
                 pool: bool, final_state: bool, checkpoints: bool):
        super().__init__(dtype, k_dim, v_dim, q_heads, k_heads, v_heads, l2norm, g_dtype,
                         beta_dtype)
        self.state_role = GdnChunkRecurrenceSm90(dtype, k_dim, v_dim, q_heads, k_heads,
                                                 v_heads, initial_state, pool, final_state,
                                                 checkpoints, overlap_products=False,
                                                 from_inverse=False)
        self.nwg = v_dim // 64
        self.num_threads = (2 + self.nwg) * THREADS_PER_WG
        # Per-thread register counts of the warpgroups sum to at most the launch's
        # allocation (tiling.launch_registers for each warpgroup: 4 x 128 at V = 128, 3 x
        # 168 at V = 64): V = 128 gives 24 + 120 + 2 x 184. ptxas then reports ~0.8 KB of
        # spills and serialized wgmma (2026-11-30). The spills seen in the SASS earlier: the
        # preparing role's per-thread swizzled shared-memory addresses (unrolled epilogues,
        # now also the solver's column stores), the same in every chunk, hoisted out of the
        # chunk loop and parked in local memory. Stage 1 alone has none (168 registers).
        self.producer_regs = PRODUCER_REGS
        budget = (launch_registers(self.num_threads) * self.num_threads // THREADS_PER_WG
                  - self.producer_regs)
        self.prepare_regs = 120 if self.nwg == 2 else 240
        self.state_regs = min((budget - self.prepare_regs) // self.nwg // 8 * 8, 240)
        self.register_split = check_register_split(
            type(self).__name__, self.num_threads,
            (self.producer_regs, self.prepare_regs)
            + (self.state_regs,) * self.nwg)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mCuSeqlens: cute.Tensor, mO: cute.Tensor,
                 mState0: cute.Tensor, mStateIdx: cute.Tensor, mFinal: cute.Tensor,
                 mCkpt: cute.Tensor, scale: Float32, ckpt_every: Int32,
                 stream: cuda.CUstream):
        """Tensors as the two-stage kernels take them (no workspace). Unused: None."""
        dt = self.dtype
        K, C = self.k_dim, CHUNK
        layouts, loads, mmas = self.prepare_setup(mQ, mK, mV, STAGES)
        sQK_layout, sV_layout, sT_layout = layouts
        tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma = loads
        mma_s, mma_wk, mma_wv = mmas
        sM_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, C), dt, STAGES)
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        mma_tok = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32,
                                                    (self.nwg, 1, 1), (64, C), rmem)
        mma_state = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                      (self.nwg, 1, 1), (64, K), rmem)

        @cute.struct
        class SharedStorage:
            raw_full: cute.struct.MemRange[cutlass.Int64, STAGES]
            prepared: cute.struct.MemRange[cutlass.Int64, STAGES]
            empty: cute.struct.MemRange[cutlass.Int64, STAGES]
            gate: cute.struct.MemRange[Float32, C]
            beta: cute.struct.MemRange[Float32, C]
            rows: cute.struct.MemRange[Float32, ROW_VALUES * C]
            factors: cute.struct.Align[cute.struct.MemRange[Float32, STAGES * FACTOR_COLS], 16]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQK_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQK_layout)], 1024]
            sM: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sM_layout)], 1024]
            sTw: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sT_layout)], 1024]
            sTu: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sT_layout)], 1024]
            sA: cute.struct.Align[cute.struct.MemRange[Float32, A_ELEMS], 16]

        self.storage = SharedStorage
        num_batches = mCuSeqlens.shape[0] - 1
        self.kernel(mma_s, mma_wk, mma_wv, mma_tok, mma_state, mQ_tma, mK_tma, mV_tma, tma_q,
                    tma_k, tma_v, sQK_layout, sV_layout, sM_layout, sT_layout, mG, mBeta,
                    mCuSeqlens, mO, mState0, mStateIdx, mFinal, mCkpt, num_batches, scale,
                    ckpt_every).launch(grid=[self.heads, cutlass.max(num_batches, 1), 1],
                                       block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_wk: cute.TiledMma, mma_wv: cute.TiledMma,
               mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mQ: cute.Tensor,
               mK: cute.Tensor, mV: cute.Tensor, tma_q: cute.CopyAtom, tma_k: cute.CopyAtom,
               tma_v: cute.CopyAtom, sQK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sM_layout: cute.ComposedLayout,
               sT_layout: cute.ComposedLayout, mG: cute.Tensor, mBeta: cute.Tensor,
               mCuSeqlens: cute.Tensor, mO: cute.Tensor, mState0: cute.Tensor,
               mStateIdx: cute.Tensor, mFinal: cute.Tensor, mCkpt: cute.Tensor,
               num_batches: Int32, scale: Float32, ckpt_every: Int32):
        C = CHUNK
        tidx, _, _ = cute.arch.thread_idx()
        head, batch, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        raw_full = storage.raw_full.data_ptr()
        prepared = storage.prepared.data_ptr()
        empty = storage.empty.data_ptr()
        if tidx == 0:
            for s in cutlass.range_constexpr(STAGES):
                cute.arch.mbarrier_init(raw_full + s, 1)
                cute.arch.mbarrier_init(prepared + s, THREADS_PER_WG)
                cute.arch.mbarrier_init(empty + s, self.nwg * THREADS_PER_WG)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sQ = storage.sQ.get_tensor(sQK_layout.outer, swizzle=sQK_layout.inner)
        sK = storage.sK.get_tensor(sQK_layout.outer, swizzle=sQK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sW = storage.sW.get_tensor(sQK_layout.outer, swizzle=sQK_layout.inner)
        sM = storage.sM.get_tensor(sM_layout.outer, swizzle=sM_layout.inner)
        sTw = storage.sTw.get_tensor(sT_layout.outer, swizzle=sT_layout.inner)
        sTu = storage.sTu.get_tensor(sT_layout.outer, swizzle=sT_layout.inner)
        sA = storage.sA.get_tensor(a_layout())
        sGate = storage.gate.get_tensor(cute.make_layout(C))
        sBeta = storage.beta.get_tensor(cute.make_layout(C))
        sRows = storage.rows.get_tensor(cute.make_layout((ROW_VALUES, C), stride=(C, 1)))
        sF = storage.factors.get_tensor(cute.make_layout((STAGES, FACTOR_COLS),
                                                         stride=(FACTOR_COLS, 1)))
        start = mCuSeqlens[batch]
        length = mCuSeqlens[batch + 1] - start
        chunks = (length + C - 1) // C
        if warp < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp == 0:
                self.produce(mQ, mK, mV, tma_q, tma_k, tma_v, sQ, sK, sV, raw_full, empty, start,
                             chunks, head)
        elif warp < 8:
            if const_expr(self.prepare_regs < 65536 // self.num_threads):
                cute.arch.setmaxregister_decrease(self.prepare_regs)
            else:
                cute.arch.setmaxregister_increase(self.prepare_regs)
            self.prepare(mma_s, mma_wk, mma_wv, sQ, sK, sV, sW, sM, sTw, sTu, sA, sGate, sBeta,
                         sRows, sF, raw_full, prepared, mG, mBeta, start, length, chunks, head,
                         scale, tidx - THREADS_PER_WG)
        else:
            cute.arch.setmaxregister_increase(self.state_regs)
            self.advance_state(mma_tok, mma_state, sQ, sK, sV, sW, sM, sF, prepared, empty,
                               mO, mState0, mStateIdx, mFinal, mCkpt, mCuSeqlens, ckpt_every,
                               batch, head, start, length, chunks, tidx - 2 * THREADS_PER_WG)

    @cute.jit
    def produce(self, mQ, mK, mV, tma_q, tma_k, tma_v, sQ, sK, sV, raw_full, empty,
                start: Int32, chunks: Int32, head: Int32):
        for c in cutlass.range(chunks, unroll=1):
            s = c % STAGES
            if c >= STAGES:  # the state is done with chunk c - STAGES
                cute.arch.mbarrier_wait(empty + s, (c // STAGES - 1) % 2)
            self.load_tiles(mQ, mK, mV, tma_q, tma_k, tma_v, sQ, sK, sV, raw_full + s, start,
                            c, head, s)

    @cute.jit
    def prepare(self, mma_s, mma_wk, mma_wv, sQ, sK, sV, sW, sM, sTw, sTu, sA, sGate, sBeta,
                sRows, sF, raw_full, prepared, mG, mBeta, start: Int32, length: Int32,
                chunks: Int32, head: Int32, scale: Float32, ptidx: Int32):
        C = CHUNK
        for c in cutlass.range(chunks, unroll=1):
            s = c % STAGES
            rows = cutlass.min(length - c * C, C)
            self.sync()  # the previous chunk's reads of the gate buffers are done
            self.load_gates(mG, mBeta, sGate, sBeta, start + c * C, rows, head, ptidx)
            cute.arch.mbarrier_wait(raw_full + s, (c // STAGES) % 2)
            # W, U (over V), M and the factor row of stage s
            out = (sW[None, None, s], sV[None, None, s],
                   mma_s.get_slice(ptidx).partition_C(sM[None, None, s]), sF[s, None])
            self.prepare_chunk(mma_s, mma_wk, mma_wv, sQ, sK, sV, s, sTw, sTu, sA, sGate,
                               sBeta, sRows, out, rows, scale, ptidx)
            # Generic-proxy writes, read next by the state's wgmma (async proxy).
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.mbarrier_arrive(prepared + s)

    @cute.jit
    def advance_state(self, mma_tok, mma_state, sQ, sK, sV, sW, sM, sF, prepared, empty, mO,
                      mState0, mStateIdx, mFinal, mCkpt, mCuSeqlens, ckpt_every: Int32,
                      batch: Int32, head: Int32, start: Int32, length: Int32, chunks: Int32,
                      stidx: Int32):
        parts = self.state_role.state_parts(mma_tok, mma_state, sQ, sK, sW, sM, stidx)
        state_row, ckpt_row = self.state_role.load_state(
            parts, mState0, mStateIdx, mCuSeqlens, ckpt_every, batch, head,
            mCuSeqlens)  # no sequence table: cu_seqlens stands in (load_state scans it)
        for c in cutlass.range(chunks, unroll=1):
            s = c % STAGES
            self.state_role.checkpoint(parts, mCkpt, ckpt_every, ckpt_row, c, head)
            cute.arch.mbarrier_wait(prepared + s, (c // STAGES) % 2)
            self.state_role.chunk_update(parts, sV[None, None, s], s, sF[s, None])
            cute.arch.mbarrier_arrive(empty + s)
            self.state_role.store_o(parts, mO, start, length, c, head)
        self.state_role.store_state(parts, mState0, mFinal, state_row, batch, head)
