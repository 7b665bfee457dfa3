"""HSTU attention forward for SM90: TMA + wgmma, warp-specialized, persistent, varlen.

For each packed sequence and query head h (kv head h // (H / H_kv)):
    S = alpha * Q K^T;  P = mask * SiLU(S);  O = P V / scaling_seqlen

Work tiles are (sequence, head, 128 query rows). Persistent CTAs (one per SM) claim them
from an int32 counter in global memory, the heaviest query tiles of a sequence first (they
see the most keys under a causal mask); a warp prefix sum over cu_seqlens_q maps a tile
number to its sequence on the device, so no host ever reads the metadata. Ragged batches
visit their sequences longest first (the order SequenceOrderSm90 writes beside the
counter). Dense batches (the host passes seq_group) run the heaviest tiles of groups of
sequences first instead, decoded by arithmetic. The last CTA to finish resets the counter
for the next launch.
- warp 0 (producer; the other three warps of its warpgroup give their registers back)
  claims a tile, posts it with its Q into one of two Q buffers, and streams the tile's
  visible K and V tiles through TMA into separate multi-stage rings;
- two consumer warpgroups own 64 query rows each. Per key tile they issue S = Q K^T beside
  O += P V of the previous key tile, and turn S into P = SiLU in registers (fp32, in place)
  while P V runs; P feeds the second wgmma as a register operand, so S never touches shared
  memory. The warpgroups take turns issuing (ping-pong), so one's SiLU overlaps the other's
  matmuls.
SiLU(z) = s + s * tanh(s) with s = z / 2: one MUFU.TANH per score; at D = 128 alpha / 2 is
multiplied into each tile's Q in shared memory (prescale_q), so S leaves the wgmma as s.
Masks (window edges, the sequence end, func intervals) are applied only on key tiles that
need them, as one bit per column of the thread's packed 16-bit P pairs: a few integer ops
per row, exact zeros. Key tiles outside the window are never loaded; they run from the last
to the first. The first of them may hide its second half from all 64 rows of a warpgroup
(warpgroup 0 on the causal diagonal, the sequence end): that warpgroup then computes S and
P V over its first half only.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .attention_sm90 import (AttentionTileOps, acc_as_operand_a, acc_mn_layout, advanced,
                             copy_rows_out, row_vectors, select_modes, store_stmatrix, tma_pipeline,
                             warp_inclusive_sum, wgmma)
from .scheduler import COUNTER_WORDS, claim_work, count_out
from .tiling import check_register_split

TILE_M = 128  # query rows of a work tile (two consumer warpgroups of 64)
WG_ROWS = 64
THREADS_PER_WG = 128
PAGE_SIZE = 128
# (key tile, pipeline stages) per head dim: fits 227 KB of shared memory and 240 registers.
TILE_N = {32: 128, 64: 128, 128: 128, 256: 64}
STAGES = {32: 4, 64: 4, 128: 2, 256: 2}
PRODUCER_REGS, CONSUMER_REGS = 24, 240
# Whether alpha / 2 goes into each tile's Q (prescale_q) instead of an FMUL per score: D = 128
# only for now; at D = 32, 64 and 256 ptxas then spills 24-36 bytes (64: +3.3 % measured
# with the spills, run 32d; fp16 and the local families spill).
PRESCALE_Q = {32: False, 64: False, 128: True, 256: False}
# A posted work tile, as the consumers read it from shared memory (no global loads on their
# critical path): sequence (num_batches = stop), head, first query row, query and key
# lengths, query start, visible key tiles [n_min, n_max).
WORK_FIELDS = 8
W_BATCH, W_HEAD, W_M0, W_LEN_Q, W_LEN_K, W_Q_START, W_N_MIN, W_N_MAX = range(WORK_FIELDS)
TURN_BARRIER = 1  # named barriers 1 and 2: "warpgroup 0 / 1 may issue" (0 is sync_threads)
ZERO_V_BARRIER = 3  # both consumer warpgroups cleared the rows past a sequence's end
EPILOGUE_BARRIER = 4  # 4 and 5: a warpgroup's output rows are staged in shared memory


class HstuAttentionForwardSm90(AttentionTileOps):
    def __init__(self, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                 window_left_bounded: bool, window_right_bounded: bool, func_intervals: int,
                 paged: bool, pingpong: bool = True):
        assert head_dim in TILE_N, head_dim
        self.init_attention(dtype, head_dim, num_heads, num_kv_heads, window_left_bounded,
                            window_right_bounded, func_intervals)
        self.paged = paged
        # The two consumer warpgroups take turns issuing their wgmmas, so one's SiLU runs
        # while the other's matmuls keep the tensor cores busy.
        self.pingpong = pingpong
        self.tile_n = TILE_N[head_dim]
        self.mask_width = self.tile_n  # masks cover a whole key tile
        # Keys of the half key tile a warpgroup multiplies when the other half is hidden from
        # all its rows (0: never). With 128-key tiles only the first (highest) key tile of a
        # work tile can be such a tile (see half_tile_hidden).
        self.half_n = self.tile_n // 2 if self.tile_n == 128 else 0
        self.stages = STAGES[head_dim]
        self.prescale = PRESCALE_Q[head_dim]
        # A second Q buffer lets the producer load the next tile's Q during this tile
        # (shared memory allows it up to D = 128).
        self.q_stages = 2 if head_dim <= 128 else 1
        # Tile slots rotate through one more than the Q buffers: a slot is rewritten only
        # after the consumers released the *next* tile, so no late read of a tile's fields
        # can see the following post.
        self.work_slots = self.q_stages + 1
        # With two Q buffers the finished tile's buffer holds its output on the way out, so
        # the rows leave as coalesced 16-byte stores instead of 2-byte scattered ones.
        self.staged_output = self.q_stages == 2
        self.num_threads = 3 * THREADS_PER_WG
        self.register_split = check_register_split(
            type(self).__name__, self.num_threads,
            (PRODUCER_REGS, CONSUMER_REGS, CONSUMER_REGS))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mFunc: cute.Tensor,
                 mPagedKV: cute.Tensor, mPageIds: cute.Tensor, mPageIndptrs: cute.Tensor,
                 mScheduler: cute.Tensor, max_seqlen_q: Int32, window_left: Int32,
                 window_right: Int32, half_alpha: Float32, out_scale: Float32, num_ctas: Int32,
                 seq_group: Int32, sorted_order: Int32, stream: cuda.CUstream):
        """seq_group > 0: every sequence has max_seqlen_q queries (the host knows it from the
        token count), and the tiles run by rank from the end of their sequence across groups
        of seq_group sequences (the last group takes the remainder): the heaviest tiles of
        the whole batch start first while a group's K/V stays in L2. 0: sequence by
        sequence, each heaviest first: in batch order, or with sorted_order = 1 in the order
        that SequenceOrderSm90 wrote after the claim counter in mScheduler."""
        dt = self.dtype
        D, tn = self.head_dim, self.tile_n
        # (T, H, D) -> (T, D, H): rows and head dim first, as TMA tiles them.
        mQ, mO = [select_modes(t, [0, 2, 1]) for t in (mQ, mO)]
        if const_expr(self.paged):
            # (pages, 2, 128, H_kv, D) -> K rows (128, D, H_kv, 2, pages), V^T (D, 128, ...)
            mK = select_modes(mPagedKV, [2, 4, 3, 1, 0])
            mVt = select_modes(mPagedKV, [4, 2, 3, 1, 0])
        else:
            mK = select_modes(mK, [0, 2, 1])
            mVt = select_modes(mV, [2, 0, 1])  # (D, T_k, H_kv): V^T, MN-major B operand

        mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (TILE_M // WG_ROWS, 1, 1), (WG_ROWS, tn))
        # The same S = Q K^T over the first half of the key tile only.
        mma_qk_half = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (TILE_M // WG_ROWS, 1, 1), (WG_ROWS, tn // 2))
        mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (TILE_M // WG_ROWS, 1, 1), (WG_ROWS, D), warpgroup.OperandSource.RMEM)

        sQ_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, tn, D), dt,
                                                  self.q_stages)
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

        stages, q_stages = self.stages, self.q_stages

        @cute.struct
        class SharedStorage:
            q_bars: cute.struct.MemRange[cutlass.Int64, 2 * q_stages]
            work: cute.struct.MemRange[Int32, WORK_FIELDS * (q_stages + 1)]
            k_bars: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            v_bars: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sVt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sVt_layout)], 1024]

        self.storage = SharedStorage
        # Persistent CTAs; at most one per work tile (max_seqlen_q bounds the tile count).
        num_batches = mCuSeqlensQ.shape[0] - 1
        m_blocks = (max_seqlen_q + TILE_M - 1) // TILE_M  # query tiles of the longest sequence
        tile_bound = self.num_heads * m_blocks * num_batches
        grid = cutlass.max(cutlass.min(tile_bound, num_ctas), 1)
        self.kernel(mma_qk, mma_qk_half, mma_pv, mQ_tma, mK_tma, mVt_tma, mO, tma_q, tma_k,
                    tma_v, sQ_layout, sK_layout, sVt_layout, mCuSeqlensQ, mCuSeqlensK, mFunc,
                    mPageIds, mPageIndptrs, mScheduler, num_batches, window_left,
                    window_right, half_alpha, out_scale, seq_group, m_blocks,
                    sorted_order).launch(
            grid=[grid, 1, 1], block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_qk: cute.TiledMma, mma_qk_half: cute.TiledMma,
               mma_pv: cute.TiledMma, mQ: cute.Tensor,
               mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor, tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sVt_layout: cute.ComposedLayout,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mFunc: cute.Tensor,
               mPageIds: cute.Tensor, mPageIndptrs: cute.Tensor, mScheduler: cute.Tensor,
               num_batches: Int32, window_left: Int32, window_right: Int32, half_alpha: Float32,
               out_scale: Float32, seq_group: Int32, m_blocks: Int32, sorted_order: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        consumers = 2 * THREADS_PER_WG
        pipe_q = tma_pipeline(storage.q_bars.data_ptr(), self.q_stages, self.q_bytes, consumers)
        pipe_k = tma_pipeline(storage.k_bars.data_ptr(), self.stages, self.kv_bytes, consumers)
        pipe_v = tma_pipeline(storage.v_bars.data_ptr(), self.stages, self.kv_bytes, consumers)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVt = storage.sVt.get_tensor(sVt_layout.outer, swizzle=sVt_layout.inner)
        work = storage.work.get_tensor(cute.make_layout((WORK_FIELDS, self.work_slots)))

        if warp_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mK, mVt, tma_q, tma_k, tma_v, sQ, sK, sVt, work, pipe_q, pipe_k,
                         pipe_v, mCuSeqlensQ, mCuSeqlensK, mScheduler, num_batches,
                         window_left, window_right, mPageIds, mPageIndptrs,
                         (seq_group, m_blocks, sorted_order))
        elif warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(mma_qk, mma_qk_half, mma_pv, mO, sQ, sK, sVt, work, pipe_q, pipe_k,
                         pipe_v, tidx - THREADS_PER_WG, num_batches, mFunc, window_left,
                         window_right, half_alpha, out_scale)

    @cute.jit
    def tile_info(self, batch: Int32, m_block: Int32, mCuSeqlensQ, mCuSeqlensK,
                  window_left: Int32, window_right: Int32):
        """(m0, q_start, len_q, k_start, len_k, n_min, n_max) of a work tile."""
        q_start = mCuSeqlensQ[batch]
        len_q = mCuSeqlensQ[batch + 1] - q_start
        k_start = mCuSeqlensK[batch]
        len_k = mCuSeqlensK[batch + 1] - k_start
        m0 = m_block * TILE_M
        n_min, n_max = self.key_tile_range(m0, len_q, len_k, window_left, window_right)
        return m0, q_start, len_q, k_start, len_k, n_min, n_max

    @cute.jit
    def find_tile(self, tile: Int32, group: Int32, base: Int32, mCuSeqlensQ, mScheduler,
                  num_batches: Int32, order):
        """Maps a work-tile number to (batch, m_block, head), scanning the sequences 32 at a
        time from (group, base): the first sequence of the current group and the number of
        tiles before it. Tiles count only query rows that exist: sequence b has
        H * ceil(len_q / 128) of them, its heaviest (last) query tiles first. Returns
        batch == num_batches past the last tile. order = (seq_group, m_blocks, sorted_order):
        with seq_group > 0 (a dense batch, see __call__) the tile is decoded by arithmetic;
        with sorted_order = 1 the scan visits the sequences in the order after the counter's
        words in mScheduler."""
        lane = cute.arch.lane_idx()
        heads = self.num_heads
        batch = num_batches
        m_block = Int32(0)
        head = Int32(0)
        seq_group, m_blocks, sorted_order = order
        searching = seq_group == 0
        if seq_group > 0:
            group_tiles = seq_group * m_blocks * heads
            groups = cutlass.max(num_batches // seq_group, 1)
            g = cutlass.min(tile // group_tiles, groups - 1)
            first = g * seq_group
            local = tile - g * group_tiles
            width = heads * seq_group
            if g == groups - 1:
                width = heads * (num_batches - first)
            rank = local // width
            if rank < m_blocks:
                batch = first + local % width // heads
                head = local % heads
                m_block = m_blocks - 1 - rank
        while searching:
            b = group + lane
            seq = b
            count = Int32(0)
            if b < num_batches:
                if sorted_order != 0:
                    seq = mScheduler[COUNTER_WORDS + b]
                count = (mCuSeqlensQ[seq + 1] - mCuSeqlensQ[seq] + TILE_M - 1) // TILE_M
                count = count * heads
            ends = warp_inclusive_sum(count)
            total = cute.arch.shuffle_sync(ends, 31)
            if tile < base + total:
                owner = cute.arch.popc(cute.arch.vote_ballot_sync(tile >= base + ends))
                start = base + cute.arch.shuffle_sync(ends - count, owner)
                local = tile - start
                batch = cute.arch.shuffle_sync(seq, owner)
                m_blocks = (mCuSeqlensQ[batch + 1] - mCuSeqlensQ[batch] + TILE_M - 1) // TILE_M
                m_block = m_blocks - 1 - local // heads
                head = local % heads
                searching = Boolean(False)
            else:
                base = base + total
                group = group + 32
                if group >= num_batches:
                    searching = Boolean(False)
        return batch, m_block, head, group, base

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
    def produce(self, mQ, mK, mVt, tma_q, tma_k, tma_v, sQ, sK, sVt, work, pipe_q, pipe_k,
                pipe_v, mCuSeqlensQ, mCuSeqlensK, mScheduler, num_batches: Int32,
                window_left: Int32, window_right: Int32, mPageIds, mPageIndptrs, order):
        """Warp 0: claims work tiles (dynamically, so the heaviest finish first), posts each
        to the consumers beside its Q, and streams the tile's K/V. With two Q buffers the
        next tile is claimed and posted before this one's K/V, so its Q is in shared memory
        when the consumers get to it."""
        lane = cute.arch.lane_idx()
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                               self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                self.stages)
        cta, _, _ = cute.arch.block_idx()
        ctas, _, _ = cute.arch.grid_dim()
        group = Int32(0)
        base = Int32(0)
        batch, m_block, head, group, base = self.find_tile(cta, group, base, mCuSeqlensQ,
                                                          mScheduler, num_batches, order)
        if batch < num_batches:
            q_state = self.post_tile(mQ, tma_q, sQ, work, pipe_q, q_state, batch, m_block,
                                     head, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)
        while batch < num_batches:
            m0, q_start, len_q, k_start, len_k, n_min, n_max = self.tile_info(
                batch, m_block, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)
            views = self.kv_views(mK, mVt, tma_k, tma_v, sK, sVt, head, k_start)
            page_base = Int32(0)
            if const_expr(self.paged):
                page_base = mPageIndptrs[batch]
            # The next tile is claimed (and, with two Q buffers, posted) once this tile's first
            # K/V loads are out: the claim's latency hides behind this tile's compute.
            claim_at = cutlass.min(n_max - n_min - 1, 1)
            next_batch, next_m_block, next_head = num_batches, Int32(0), Int32(0)
            for i in cutlass.range(n_max - n_min, unroll=1):
                kv_state = self.load_kv_tile(views, pipe_k, pipe_v, kv_state, n_max - 1 - i,
                                             page_base, mPageIds)
                if i == claim_at:
                    next_batch, next_m_block, next_head, group, base, q_state = self.claim_next(
                        mQ, tma_q, sQ, work, pipe_q, q_state, mScheduler, group, base,
                        mCuSeqlensQ, mCuSeqlensK, num_batches, window_left, window_right,
                        order)
            if claim_at < 0:  # no visible key tile
                next_batch, next_m_block, next_head, group, base, q_state = self.claim_next(
                    mQ, tma_q, sQ, work, pipe_q, q_state, mScheduler, group, base,
                    mCuSeqlensQ, mCuSeqlensK, num_batches, window_left, window_right, order)
            if const_expr(self.q_stages == 1):
                # One Q buffer: it frees only after this tile's last Q K^T, which needs the
                # K/V just issued.
                if next_batch < num_batches:
                    q_state = self.post_tile(mQ, tma_q, sQ, work, pipe_q, q_state, next_batch,
                                             next_m_block, next_head, mCuSeqlensQ,
                                             mCuSeqlensK, window_left, window_right)
            batch, m_block, head = next_batch, next_m_block, next_head
        # Tell the consumers to stop.
        pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
        with cute.arch.elect_one():  # the thread that writes the slot is the one that arrives
            for field in range(WORK_FIELDS):  # a whole slot, like any posted tile
                work[field, q_state.count % self.work_slots] = (
                    num_batches if field == W_BATCH else Int32(0))
            cute.arch.mbarrier_arrive(pipe_q.sync_object_full.get_barrier(q_state.index))
        if lane == 0:
            count_out(mScheduler, ctas)

    @cute.jit
    def post_tile(self, mQ, tma_q, sQ, work, pipe_q, q_state, batch: Int32, m_block: Int32,
                  head: Int32, mCuSeqlensQ, mCuSeqlensK, window_left: Int32,
                  window_right: Int32):
        """Writes the tile into a free Q stage's slot and loads its Q (when it sees keys)."""
        m0, q_start, len_q, k_start, len_k, n_min, n_max = self.tile_info(
            batch, m_block, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)
        stage = q_state.index
        slot = q_state.count % self.work_slots
        pipe_q.sync_object_empty.wait(stage, q_state.phase)
        full = pipe_q.sync_object_full.get_barrier(stage)
        with cute.arch.elect_one():  # the thread that writes the slot is the one that arrives
            for field, value in ((W_BATCH, batch), (W_HEAD, head), (W_M0, m0),
                                 (W_LEN_Q, len_q), (W_LEN_K, len_k), (W_Q_START, q_start),
                                 (W_N_MIN, n_min), (W_N_MAX, n_max)):
                work[field, slot] = value
            if n_max > n_min:
                cute.arch.mbarrier_arrive_and_expect_tx(full, self.q_bytes)
            else:
                # Nothing visible: no Q to load, the consumers only write zeros.
                cute.arch.mbarrier_arrive(full)
        if n_max > n_min:
            gQ = cute.local_tile(cute.domain_offset((q_start, 0), mQ[None, None, head]),
                                 (TILE_M, self.head_dim), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            cute.copy(tma_q, tQgQ, tQsQ[None, stage], tma_bar_ptr=full)
        return advanced(q_state)

    @cute.jit
    def claim_next(self, mQ, tma_q, sQ, work, pipe_q, q_state, mScheduler, group: Int32,
                   base: Int32, mCuSeqlensQ, mCuSeqlensK, num_batches: Int32,
                   window_left: Int32, window_right: Int32, order):
        """Claims the next tile (one atomic, lane 0 for the warp); with two Q buffers also
        posts it."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = claim_work(mScheduler)
        ctas, _, _ = cute.arch.grid_dim()
        batch, m_block, head, group, base = self.find_tile(
            ctas + cute.arch.shuffle_sync(claimed, 0), group, base, mCuSeqlensQ, mScheduler,
            num_batches, order)
        if const_expr(self.q_stages > 1):
            if batch < num_batches:
                q_state = self.post_tile(mQ, tma_q, sQ, work, pipe_q, q_state, batch, m_block,
                                         head, mCuSeqlensQ, mCuSeqlensK, window_left,
                                         window_right)
        return batch, m_block, head, group, base, q_state

    @cute.jit
    def kv_views(self, mK, mVt, tma_k, tma_v, sK, sVt, head: Int32, k_start: Int32):
        """TMA partitions of the K and V^T tiles of (sequence, kv head): indexed by key tile
        (or by (sub-tile, page) when paged)."""
        tn = self.tile_n
        D = self.head_dim
        kv_head = head // self.group
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
        return tma_k, tma_v, tKsK, tKgK, tVsV, tVgV

    @cute.jit
    def load_kv_tile(self, views, pipe_k, pipe_v, state, n: Int32, page_base: Int32,
                     mPageIds):
        """Key tile n's K and V into the next ring stage."""
        tma_k, tma_v, tKsK, tKgK, tVsV, tVgV = views
        pipe_k.producer_acquire(state)
        if const_expr(self.paged):
            sub_tiles = PAGE_SIZE // self.tile_n
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
        return advanced(state)

    @cute.jit
    def consume(self, mma_qk, mma_qk_half, mma_pv, mO, sQ, sK, sVt, work, pipe_q, pipe_k,
                pipe_v, tidx: Int32, num_batches: Int32, mFunc,
                window_left: Int32, window_right: Int32, half_alpha: Float32,
                out_scale: Float32):
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
        p_regs = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        tOrP = cute.make_tensor(p_regs.iterator, acc_as_operand_a(acc_s.layout))
        half = None
        if const_expr(self.half_n > 0):
            # S over keys 0 .. half_n - 1 (the K rows of the first half of each stage) into
            # an accumulator of its own. In the wgmma layout ((2, 2, N / 8), M, N) its
            # register e holds the score of acc_s's register e (columns 8 g .. 8 g + 7 in
            # registers 4 g .. 4 g + 3).
            wg_qk_half = mma_qk_half.get_slice(wg * THREADS_PER_WG)
            sK_half = cute.local_tile(sK, (self.half_n, D, self.stages), (0, 0, 0))
            tSrK_half = wg_qk_half.make_fragment_B(wg_qk_half.partition_B(sK_half))
            acc_half_shape = wg_qk_half.partition_shape_C((TILE_M, self.half_n))
            assert cute.size(acc_half_shape) * 2 == cute.size(acc_s)
            half = (mma_qk_half, tSrK_half, acc_half_shape)

        rows = 2  # accumulator rows per thread (r and r + 8 of its warp's 16)
        row_i = cute.make_rmem_tensor(cute.make_layout(rows), Int32)
        nf = const_expr(self.func_intervals)
        func = None
        if const_expr(nf > 0):
            func = cute.make_rmem_tensor(cute.make_layout((rows, nf)), Int32)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                               self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        if const_expr(self.pingpong):
            if wg == 1:  # warpgroup 0 issues first
                cute.arch.barrier_arrive(barrier_id=TURN_BARRIER,
                                         number_of_threads=2 * THREADS_PER_WG)
        # With Q prescaled S is already the tanh's argument; a constant 1 lets the FMUL fold.
        tanh_scale = Float32(1.0) if const_expr(self.prescale) else half_alpha
        pipe_q.consumer_wait(q_state)
        batch = work[W_BATCH, q_state.count % self.work_slots]
        while batch < num_batches:
            slot = q_state.count % self.work_slots
            head = work[W_HEAD, slot]
            m0 = work[W_M0, slot]
            len_q = work[W_LEN_Q, slot]
            len_k = work[W_LEN_K, slot]
            q_start = work[W_Q_START, slot]
            n_min = work[W_N_MIN, slot]
            n_max = work[W_N_MAX, slot]
            if n_max > n_min:
                if const_expr(self.prescale):
                    self.prescale_q(sQ[None, None, q_state.index], tidx, half_alpha)
                acc_o.fill(0.0)
                # Per-row mask data: local query index, func intervals.
                coords = self.score_coords(thr_qk)
                for r in cutlass.range_constexpr(rows):
                    row_i[r] = m0 + coords[r, 0][0]
                if const_expr(nf > 0):
                    for r in cutlass.range_constexpr(rows):
                        for t in cutlass.range_constexpr(nf):
                            func[r, t] = mFunc[0, t, q_start + row_i[r]]
                kv_state = self.attend(mma_qk, mma_pv, tSrQ[None, None, None, q_state.index],
                                       tSrK, half, tOrVt, sVt, acc_s, acc_o, p_regs, tOrP,
                                       thr_qk, tidx, row_i, func, pipe_q, pipe_k, pipe_v, q_state,
                                       kv_state, m0 + wg * WG_ROWS, len_q, len_k, n_min, n_max,
                                       window_left, window_right, tanh_scale)
                if const_expr(self.staged_output):
                    self.store_output_staged(mO, acc_o, mma_pv, sQ[None, None, q_state.index],
                                             tidx, head, m0, q_start, len_q, out_scale)
                    # The generic-proxy reads of the buffer precede the next TMA write.
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.release_q(pipe_q, q_state)
                else:
                    self.store_output(mO, acc_o, thr_pv, head, m0, q_start, len_q, out_scale)
            else:
                self.release_q(pipe_q, q_state)
                self.store_output(mO, None, thr_pv, head, m0, q_start, len_q, out_scale)
            q_state = advanced(q_state)
            pipe_q.consumer_wait(q_state)
            batch = work[W_BATCH, q_state.count % self.work_slots]

    @cute.jit
    def attend(self, mma_qk, mma_pv, tSrQ, tSrK, half, tOrVt, sVt, acc_s, acc_o, p_regs, tOrP,
               thr_qk, consumer_tidx: Int32, row_i, func, pipe_q, pipe_k, pipe_v, q_state,
               kv_state, m0_wg: Int32, len_q: Int32, len_k: Int32, n_min: Int32, n_max: Int32,
               window_left: Int32, window_right: Int32, half_alpha: Float32):
        """acc_o = sum over key tiles n_max-1 .. n_min of P_n V_n; returns the K/V state."""
        off = len_k - len_q
        # The thread's first key column in a tile (its others are + 8 g + e).
        first_col = self.score_coords(thr_qk)[0, 0][1]
        # First key tile: S, then P (always masked: it holds the sequence end).
        k_state = kv_state
        n = n_max - 1
        # Whether this warpgroup sees nothing in the tile's second half: then S and P V run
        # over the first half only. S of that half goes to an accumulator of its own that
        # lives only in its branch (ptxas serializes every wgmma of the kernel when one
        # accumulator serves wgmmas of two widths, or when the half accumulator lives on
        # past the branch), its SiLU into the first half of acc_s. The second half of acc_s
        # keeps stale values (the previous tile's, or never written): P there is zeroed
        # bitwise by the mask below (it covers the whole tile), and P V never reads it.
        half_hidden = Boolean(False)
        if const_expr(self.half_n > 0):
            half_hidden = self.half_tile_hidden(n * self.tile_n, m0_wg, len_k, off,
                                                window_right)
        pipe_k.consumer_wait(k_state)
        self.take_turn()
        if const_expr(self.half_n > 0):
            mma_qk_half, tSrK_half, acc_half_shape = half
            if half_hidden:
                acc_half = cute.make_rmem_tensor(acc_half_shape, Float32)
                self.gemm(mma_qk_half, acc_half,
                          tSrQ, tSrK_half[None, None, None, k_state.index], accumulate=False)
                self.pass_turn()
                warpgroup.wait_group(0)
                pipe_k.consumer_release(k_state)
                # Registers 0 .. 4 g + 3 of either accumulator hold columns 0 .. 8 g + 7.
                for e in cutlass.range_constexpr(cute.size(acc_half)):
                    acc_s[e] = self.silu_half(acc_half[e], half_alpha)
            else:
                self.first_s(mma_qk, acc_s, tSrQ, tSrK, pipe_k, k_state, half_alpha)
        else:
            self.first_s(mma_qk, acc_s, tSrQ, tSrK, pipe_k, k_state, half_alpha)
        p_regs.store(acc_s.load().to(self.dtype))
        self.mask_p(p_regs, row_i, func, n * self.tile_n + first_col, len_k, off, window_left,
                    window_right)
        v_state = k_state.clone()
        k_state.advance()
        if n_max * self.tile_n > len_k:
            # The last key tile runs past the sequence: its P is zero there, but 0 * NaN is
            # NaN, and those V rows hold another sequence's values or unused page slots.
            pipe_v.consumer_wait(v_state)
            self.zero_v_rows(sVt[None, None, v_state.index], len_k - (n_max - 1) * self.tile_n,
                             consumer_tidx)
        # Steady state: S_n = Q K_n^T and its SiLU run beside O += P_{n+1} V_{n+1}. Only the
        # first P V (of key tile n_max - 1) may run over half a tile.
        pv_half = half_hidden
        for i in cutlass.range(1, n_max - n_min, unroll=1):
            n = n_max - 1 - i
            pipe_k.consumer_wait(k_state)
            pipe_v.consumer_wait(v_state)
            self.take_turn()
            self.gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index],
                      accumulate=False)
            self.gemm_pv(mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], pv_half)
            self.pass_turn()
            warpgroup.wait_group(1)
            pipe_k.consumer_release(k_state)
            self.silu(acc_s, half_alpha)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
            p_regs.store(acc_s.load().to(self.dtype))
            # Only tiles that cut a window edge or the sequence end are masked, and after
            # P V so the mask's temporaries never compete with the in-flight accumulators.
            if self.tile_needs_mask(n, m0_wg, len_k, off, window_left, window_right):
                self.mask_p(p_regs, row_i, func, n * self.tile_n + first_col, len_k, off,
                            window_left, window_right)
            v_state.advance()
            k_state.advance()
            pv_half = Boolean(False)
        if const_expr(not self.staged_output):
            # Every Q K^T of this tile is done: the producer may load the next Q.
            self.release_q(pipe_q, q_state)
        pipe_v.consumer_wait(v_state)
        self.gemm_pv(mma_pv, acc_o, tOrP, tOrVt[None, None, None, v_state.index], pv_half)
        warpgroup.wait_group(0)
        pipe_v.consumer_release(v_state)
        v_state.advance()
        return v_state

    @cute.jit
    def first_s(self, mma_qk, acc_s, tSrQ, tSrK, pipe_k, k_state, half_alpha: Float32):
        """The first key tile's S = Q K^T (the turn taken), then its SiLU."""
        self.gemm(mma_qk, acc_s, tSrQ, tSrK[None, None, None, k_state.index], accumulate=False)
        self.pass_turn()
        warpgroup.wait_group(0)
        pipe_k.consumer_release(k_state)
        self.silu(acc_s, half_alpha)

    @cute.jit
    def gemm_pv(self, mma_pv, acc_o, tOrP, tOrVt, first_half: Boolean):
        """acc_o += P V over the whole key tile, or over its first half_n keys (one wgmma
        group either way)."""
        if const_expr(self.half_n > 0):
            if first_half:  # the k16 blocks of keys 0 .. half_n - 1
                wgmma(mma_pv, acc_o, tOrP, tOrVt, True, k_blocks=self.half_n // 16)
            else:
                self.gemm(mma_pv, acc_o, tOrP, tOrVt, accumulate=True)
        else:
            self.gemm(mma_pv, acc_o, tOrP, tOrVt, accumulate=True)

    @cute.jit
    def half_tile_hidden(self, j0: Int32, m0_wg: Int32, len_k: Int32, off: Int32,
                         window_right: Int32) -> Boolean:
        """Whether keys j0 + half_n .. j0 + tile_n - 1 are hidden from all 64 rows of the
        warpgroup (the last one included, even past len_q): they lie past the sequence end or
        right of the window of its last row m0_wg + 63 (row i sees keys <= i + off +
        window_right). Func intervals only hide more. The tiles run from the highest down, so
        with 128-key tiles only the first can qualify: it holds the last key hi any row of
        the work tile sees, and hi <= (the warpgroup's last visible key) + 64."""
        mid = j0 + self.half_n
        hidden = mid >= len_k
        if const_expr(self.right_bounded):
            hidden = hidden or (mid > m0_wg + WG_ROWS - 1 + off + window_right)
        # Uniform over the warpgroup (its inputs come from shared memory); without the hint
        # ptxas moves the wgmma descriptor arithmetic off the uniform datapath everywhere.
        return cute.arch.make_warp_uniform(Int32(hidden)) != 0

    @cute.jit
    def zero_v_rows(self, sVt, first_row: Int32, consumer_tidx: Int32):
        """Zeroes keys first_row.. of a V^T stage (D, tile_n), both warpgroups together."""
        D, tn = self.head_dim, self.tile_n
        for idx in cutlass.range(consumer_tidx, D * tn, 2 * THREADS_PER_WG, unroll=1):
            row = idx // D
            if row >= first_row:
                sVt[idx % D, row] = self.dtype(0.0)
        # Generic-proxy stores, read next by wgmma (async proxy): fence, then both
        # warpgroups must be done before either multiplies.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=ZERO_V_BARRIER, number_of_threads=2 * THREADS_PER_WG)

    def release_q(self, pipe_q, q_state):
        # Lane 0 of each warp arrives for the warp: every lane's reads of the tile slot must
        # be done first (racecheck flags the release otherwise).
        cute.arch.sync_warp()
        pipe_q.consumer_release(q_state)

    def take_turn(self):
        if const_expr(self.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
            cute.arch.barrier(barrier_id=TURN_BARRIER + wg, number_of_threads=2 * THREADS_PER_WG)

    def pass_turn(self):
        if const_expr(self.pingpong):
            wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
            cute.arch.barrier_arrive(barrier_id=TURN_BARRIER + 1 - wg,
                                     number_of_threads=2 * THREADS_PER_WG)

    @cute.jit
    def tile_needs_mask(self, n: Int32, m0_wg: Int32, len_k: Int32, off: Int32,
                        window_left: Int32, window_right: Int32) -> Boolean:
        """Whether any score of this warpgroup's 64 rows x key tile n is masked (rows past
        the sequence are never stored: not checked)."""
        j0 = n * self.tile_n
        return self.hides_any(m0_wg, m0_wg + WG_ROWS - 1, j0, j0 + self.tile_n - 1, None,
                              len_k, off, window_left, window_right)

    @cute.jit
    def silu(self, acc_s, half_alpha: Float32):
        """S -> SiLU(alpha S) in place (fp32)."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            acc_s[e] = self.silu_half(acc_s[e], half_alpha)

    @cute.jit
    def mask_p(self, p_regs, row_i, func, first: Int32, len_k: Int32, off: Int32,
               window_left: Int32, window_right: Int32):
        """Zeroes the hidden keys of P (both of the thread's rows)."""
        for h in cutlass.range_constexpr(2):
            self.and_keep_bits(p_regs, h, self.keys_seen_by_query(
                row_i[h], first, func, h, len_k, off, window_left, window_right))

    @cute.jit
    def score_coords(self, thr_qk):
        """(row, col) in the CTA tile of each score this thread holds, as (rows, cols)."""
        c_s = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n)))
        return cute.make_tensor(c_s.iterator, acc_mn_layout(c_s.layout))

    @cute.jit
    def prescale_q(self, sQ_tile, consumer_tidx: Int32, half_alpha: Float32):
        """This warpgroup's 64 rows of the tile's Q times alpha / 2, in place, once per work
        tile: S then leaves the wgmma as the tanh's argument, one FMUL per score fewer
        (causal 4k +2.6 % at D = 128, run 32f). Exact when alpha / 2 is a power of two;
        otherwise Q is rounded once more to 16 bits, as a model that scales q before
        attention does."""
        wg = consumer_tidx // THREADS_PER_WG
        rows = cute.local_tile(sQ_tile, (WG_ROWS, self.head_dim), (wg, 0))
        _, thr = row_vectors(rows, consumer_tidx % THREADS_PER_WG)
        t_s = thr.partition_S(rows)
        # One 16-byte vector at a time.
        for m in cutlass.range_constexpr(cute.size(t_s.shape[1])):
            piece = cute.make_rmem_tensor_like(t_s[None, m, None])
            cute.autovec_copy(t_s[None, m, None], piece)
            piece.store((piece.load().to(Float32) * half_alpha).to(self.dtype))
            cute.autovec_copy(piece, t_s[None, m, None])
        # Generic-proxy stores, read next by this warpgroup's wgmma (async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=THREADS_PER_WG)

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
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, None, head]),
                             (TILE_M, D), (m0 // TILE_M, 0))
        tOgO = thr_pv.partition_C(gO)
        coords = thr_pv.partition_C(cute.make_identity_tensor((TILE_M, D)))
        g_mn = cute.make_tensor(tOgO.iterator, acc_mn_layout(tOgO.layout))
        c_mn = cute.make_tensor(coords.iterator, acc_mn_layout(coords.layout))
        if const_expr(acc_o is None):  # no visible key: zeros
            for r in cutlass.range_constexpr(cute.size(g_mn, mode=[0])):
                if m0 + c_mn[r, 0][0] < len_q:
                    for c in cutlass.range_constexpr(cute.size(g_mn, mode=[1])):
                        g_mn[r, c] = self.dtype(0.0)
        else:
            out = cute.make_rmem_tensor(acc_o.layout, self.dtype)
            out.store((acc_o.load() * out_scale).to(self.dtype))
            out_mn = cute.make_tensor(out.iterator, acc_mn_layout(out.layout))
            for r in cutlass.range_constexpr(cute.size(g_mn, mode=[0])):
                if m0 + c_mn[r, 0][0] < len_q:
                    for c in cutlass.range_constexpr(cute.size(g_mn, mode=[1])):
                        g_mn[r, c] = out_mn[r, c]

    @cute.jit
    def store_output_staged(self, mO, acc_o, mma_pv, sO, consumer_tidx: Int32, head: Int32,
                            m0: Int32, q_start: Int32, len_q: Int32, out_scale: Float32):
        """O / scaling_seqlen -> the tile's Q buffer (stmatrix) -> this sequence's rows as
        16-byte stores. Each warpgroup stages and writes only its own 64 rows."""
        D = self.head_dim
        wg = consumer_tidx // THREADS_PER_WG
        out = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        out.store((acc_o.load() * out_scale).to(self.dtype))
        store_stmatrix(out, mma_pv, sO, consumer_tidx)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=THREADS_PER_WG)
        m_wg = m0 + wg * WG_ROWS
        gO = cute.local_tile(cute.domain_offset((q_start, 0), mO[None, None, head]),
                             (WG_ROWS, D), (m_wg // WG_ROWS, 0))
        copy_rows_out(cute.local_tile(sO, (WG_ROWS, D), (wg, 0)), gO, m_wg, len_q,
                      consumer_tidx % THREADS_PER_WG)
