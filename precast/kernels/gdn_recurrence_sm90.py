"""Gated DeltaNet forward, stage 2 of 2 for SM90: the state recurrence over chunks.

Verified on an H200 (2026-11-30) by tests/test_gdn_stages_gpu.py and tests/test_gdn_fwd_gpu.py.

One CTA per (sequence, output head) walks the sequence's chunks in order, reading what
stage 1 (gdn_chunk_sm90) left in the workspace (M and T = (I + A)^-1 packed into one
block, which the producer warpgroup's idle warps split (gdn_unpack_sm90), and the factor
rows [q_f | k_f | G_L], [t_w | t_u]; the fused kernel: W and U) and the chunk's raw q, k
and v rows. The state is held transposed, S^T
(V x K, V-major as stored), fp32 in the registers of V / 64 consumer warpgroups (64 V-rows
each), so every chunk product takes S^T or Delta^T as a register A operand and the chunk's
tiles as shared-memory B operands. W = T diag(t_w) Kc and U = T diag(t_u) Vc
(t_w = beta gamma r_k, t_u = beta; raw rows) are never formed (from_inverse, what the ops
run; 16 KB fewer loads per chunk than W and U, one more 64-deep product on the chain):

    Y^T     = S^T K^T                                   (N = 64, K-dim = K)
    Z^T     = V^T diag(t_u) - Y^T diag(t_w)             (fp32, then 16-bit)
    Delta^T = Z^T T^T  (= U^T - S^T W^T)                (N = 64, K-dim = 64; 16-bit, twice:
                                                         as is and times diag(k_f))
    S^T     = exp(G_L) S^T + (Delta^T diag(k_f)) K      (N = K, K read transposed)
    O^T     = (S^T Q^T) diag(q_f) + Delta^T M^T         (beside the state's update)

The fused kernel (gdn_fwd_sm90) reads W and U instead: X^T = S^T W^T (in flight with
S^T Q^T), Delta^T = U^T - X^T. The backward's states pass (states_only) is the first form
without o.
A producer warp streams the tiles through a TMA ring. The state entering local positions
0, n, 2n, ... is written to the checkpoint rows (n a multiple of 64), and the final state to
final_state or back into the pool row. o rows past the sequence end are not written.
"""
from typing import NamedTuple

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
from .gdn_layout import (CHUNK, FACTOR_COLS, FACTOR_ROWS, G_LAST, K_FACTORS, Q_FACTORS,
                         U_FACTORS, W_FACTORS)
from .gdn_seq_table_sm90 import find_in_table, has_table
from .gdn_unpack_sm90 import init_ring_barriers, load_packed, one_bits, unpack_ring
from .tiling import check_register_split

THREADS_PER_WG = 128


class StateParts(NamedTuple):
    """One state thread's pieces (state_parts): MMAs, shared-memory B fragments (W, Q, M,
    K read transposed; every stage), accumulators and their 16-bit operand copies, thread
    slices, and which rows of the state its CTA owns (split)."""
    mma_tok: object
    mma_state: object
    frags: tuple
    acc_state: object
    acc_x: object
    acc_o: object
    state16: object
    deltas: tuple  # Delta^T and Delta^T diag(k_f), 16-bit
    thr_state: object
    thr_tok: object
    consumer_tidx: object
    split: object


def factor_row_loads(mWork32: cute.Tensor, stages: int):
    """TMA access to work32's two factor rows per (chunk, head) ([q_f | k_f | G_L] and
    [t_w | t_u], gdn_layout), for recurrences that read them on their chain: returns (TMA
    atom, work32 as a (2, F, HO, chunks) tensor of (2, F) tiles, the (2, F, stages)
    shared-memory layout, bytes per (chunk, head)). Reading them from global memory put L2
    latency on every chunk step."""
    F, R = FACTOR_COLS, FACTOR_ROWS
    rows, heads, cols = mWork32.shape
    view = cute.make_tensor(mWork32.iterator, cute.make_layout(
        (R, F, heads, rows), stride=(F, 1, cols, heads * cols)))
    # TMA writes shared memory at 128-byte aligned addresses: stages 288 floats apart
    stage_stride = -(-(R * F) // 32) * 32
    layout = cute.make_layout((R, F, stages), stride=(F, 1, stage_stride))
    atom, tma_view = cpasync.make_tiled_tma_atom(
        cpasync.CopyBulkTensorTileG2SOp(), view, cute.slice_(layout, (None, None, 0)), (R, F))
    return atom, tma_view, layout, R * F * 4


@cute.jit
def load_factor_row(atom, m_view, s_rows, head: Int32, chunk: Int32, stage: Int32, bar):
    """The factor rows of (chunk, head) into stage ``stage`` of ``s_rows`` (whole warp)."""
    tma_load_tile(atom, cute.local_tile(m_view[None, None, head, chunk],
                                        (FACTOR_ROWS, FACTOR_COLS),
                                        (0, 0)), s_rows, stage, bar)


@cute.jit
def packed_chunk_start(mCuSeqlens: cute.Tensor, batch: Int32, mSeqTable: cute.Tensor):
    """The packed number (stage 1's numbering) of sequence ``batch``'s first chunk: the
    chunks of the sequences before it (from the sequence table when there is one)."""
    first = Int32(0)
    if has_table(mSeqTable, mCuSeqlens):
        first = mSeqTable[batch]
    else:
        first = sum_before(mCuSeqlens, batch, Int32(CHUNK))
    return first


@cute.jit
def sum_before(mCuSeqlens: cute.Tensor, batch: Int32, per: Int32):
    """Sum of ceil(len / per) over the sequences before ``batch`` (one thread, O(batch))."""
    total = Int32(0)
    for b in cutlass.range(batch, unroll=1):
        total = total + (mCuSeqlens[b + 1] - mCuSeqlens[b] + per - 1) // per
    return total


STAGES = 2
O_BARRIER = 1  # the consumer warpgroups, around the o staging tile
PRODUCER_REGS = 40
CONSUMER_REGS = 232


class GdnChunkRecurrenceSm90:
    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, initial_state: bool, pool: bool, final_state: bool,
                 checkpoints: bool, overlap_products: bool = True, v_splits: int = 1,
                 states_only: bool = False, from_checkpoints: bool = False,
                 from_inverse: bool = True):
        """initial_state: an [N or N_pool, HO, V, K] state is read (with pool: at row
        state_indices[b], and the final state written back there); final_state: the end
        state goes to an [N, HO, V, K] fp32 tensor; checkpoints: [rows, HO, V, K].
        overlap_products: S^T W^T and S^T Q^T in flight together (more registers live:
        off in the fused kernel). v_splits: CTAs per (sequence, head), each owning
        V / v_splits of the state's rows (the rows evolve independently; every CTA reads the
        chunk's q, k, W, M and its columns of U): more CTAs when (sequence, head) pairs are
        fewer than the SMs. states_only: no o (mO is None); the checkpoints (in the io
        dtype) leave through a staging tile by TMA stores: the backward's pass that writes
        the state entering every chunk, from T, its column scales and v (module
        docstring). from_checkpoints (with states_only): the states pass regenerated from
        the forward's checkpoints, every ckpt_every tokens (mState0, io dtype or float32):
        one CTA per (checkpoint row, head) walks only its segment (its grid covers mState0's
        rows; rows past the series exit), so a long sequence spreads over many SMs; the
        states go to mCkpt at every chunk's packed row. from_inverse (every standalone
        launch): W and U are not read but their products made from T, its column scales
        and v (module docstring); False only for the fused kernel (gdn_fwd_sm90), which
        keeps W and U in shared memory and uses chunk_update's other form."""
        assert k_dim in (64, 128) and v_dim in (64, 128)
        assert not states_only or checkpoints
        assert not from_checkpoints or (states_only and initial_state and not pool
                                        and not final_state)
        self.states_only, self.from_checkpoints = states_only, from_checkpoints
        self.from_inverse = from_inverse
        assert from_inverse or not states_only
        # (only the fused kernel, which reads W and U, keeps S^T Q^T beside the update)
        assert overlap_products or not from_inverse
        assert not pool or initial_state
        self.dtype = dtype
        self.k_dim, self.v_dim = k_dim, v_dim
        self.heads = max(q_heads, v_heads)
        self.q_group, self.k_group = self.heads // q_heads, self.heads // k_heads
        self.v_group = self.heads // v_heads
        self.overlap_products = overlap_products
        self.initial_state, self.pool = initial_state, pool
        self.final_state, self.checkpoints = final_state, checkpoints
        assert not (states_only and final_state)  # (its last update is skipped)
        # the states pass from zeros: the state entering a one-chunk sequence is not
        # written (it is zero: the backward's chunk kernel makes the first chunk's state
        # tile zero without loading it)
        self.zero_first = states_only and not initial_state
        assert v_dim % (64 * v_splits) == 0
        self.v_splits = v_splits
        self.v_rows = v_dim // v_splits  # state rows (V) of one CTA
        self.nwg = self.v_rows // 64
        self.num_threads = (self.nwg + 1) * THREADS_PER_WG
        self.register_split = check_register_split(
            type(self).__name__, self.num_threads,
            (PRODUCER_REGS,) + (CONSUMER_REGS,) * self.nwg)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mWork16: cute.Tensor,
                 mWork32: cute.Tensor, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor,
                 mO: cute.Tensor, mState0: cute.Tensor, mStateIdx: cute.Tensor,
                 mFinal: cute.Tensor, mCkpt: cute.Tensor, mV: cute.Tensor,
                 ckpt_every: Int32, stream: cuda.CUstream):
        """mQ (T, HQ, K), mK (T, HK, K); mWork16 / mWork32 as gdn_layout.workspace_shapes;
        mSeqTable: gdn_seq_table_sm90's table (or cu_seqlens: none); mO (T, HO, V); states
        (rows, HO, V, K); mV (T, HV, V). Unused tensors: None."""
        # W and U are read only by the fused kernel (gdn_fwd_sm90), from shared memory
        assert self.from_inverse, "the standalone recurrence reads T, not W and U"
        dt = self.dtype
        K, C = self.k_dim, CHUNK
        # Tiles of one (chunk, head): rows x columns, K-major B operands (Q, M, T) and K read
        # transposed; v is read element-wise.
        sK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, K), dt, STAGES)
        Vc = self.v_rows  # this CTA's columns of v and o
        sU_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, Vc), dt, STAGES)
        sM_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, C), dt, STAGES)
        one = lambda layout: cute.slice_(layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        # (chunks, HO, 64, F) -> (64, F, HO, chunks): rows and columns first, as TMA tiles.
        mW = select_modes(mWork16, [2, 3, 1, 0])
        # work16's packed 64 x 64 block P (T and M, gdn_layout)
        tma_blk, mW_blk = cpasync.make_tiled_tma_atom(g2s, mW, one(sM_layout), (C, C))
        # q, k and v (T, H, D) -> (T, D, H); of v this CTA's columns
        tma_u, mW_u = cpasync.make_tiled_tma_atom(g2s, select_modes(mV, [0, 2, 1]),
                                                  one(sU_layout), (C, Vc))
        tma_q, mQ_t = cpasync.make_tiled_tma_atom(g2s, select_modes(mQ, [0, 2, 1]),
                                                  one(sK_layout), (C, K))
        tma_kr, mK_t = cpasync.make_tiled_tma_atom(g2s, select_modes(mK, [0, 2, 1]),
                                                   one(sK_layout), (C, K))

        def checkpoint_staging():
            """A (V rows x K) 16-bit staging tile and the TMA store of it to a checkpoint
            row: (layout, atom, the atom's view of mCkpt)."""
            layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, Vc, K), dt, 1)
            atom, view = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), select_modes(mCkpt, [2, 3, 1, 0]),
                one(layout), (Vc, K))
            return layout, atom, view

        if const_expr(self.states_only):
            # the staging tile holds a checkpoint instead of o
            sO_layout, store_o, mO_t = checkpoint_staging()
        else:
            # o of a whole chunk leaves by a TMA store of a (64 tokens, V) staging tile
            sO_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, Vc), dt, 1)
            store_o, mO_t = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(),
                                                        select_modes(mO, [0, 2, 1]),
                                                        one(sO_layout), (C, Vc))
        # Checkpoints in the io dtype beside o leave through their own (V rows x K) staging
        # tile by TMA stores too (per-thread stores of the state cost ~0.8 ms per GB written)
        staged_ckpt = None
        sCk_elems = 0
        if const_expr(self.checkpoints and not self.states_only):
            if const_expr(mCkpt.element_type == dt):
                sCk_layout, store_ck, mCk_t = checkpoint_staging()
                staged_ckpt = (store_ck, mCk_t, sCk_layout)
                sCk_elems = cute.cosize(sCk_layout)
        # K and v's columns; with o also Q (P, loaded first, has an mbarrier of its own)
        with_o = 0 if const_expr(self.states_only) else 1
        self.stage_bytes = ((1 + with_o) * cute.size_in_bytes(dt, one(sK_layout))
                            + cute.size_in_bytes(dt, one(sU_layout)))
        tma_f, mF_t, sF_layout, factor_bytes = factor_row_loads(mWork32, STAGES)
        self.stage_bytes += factor_bytes
        rmem = warpgroup.OperandSource.RMEM
        mma_tok = sm90_utils.make_trivial_tiled_mma(  # (V rows) x 64 tokens
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (self.nwg, 1, 1), (64, C), rmem)
        mma_state = sm90_utils.make_trivial_tiled_mma(  # (V rows) x K
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (self.nwg, 1, 1), (64, K), rmem)

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
            # a stage's P landed (TMA bytes), then its T and M unpacked (UNPACK_WARPS
            # arrivals)
            p_full: cute.struct.MemRange[cutlass.Int64, STAGES]
            unpacked: cute.struct.MemRange[cutlass.Int64, STAGES]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            # T's tiles, unpacked from P (which TMA puts into sM and becomes M there)
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sM_layout)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_layout)], 1024]
            sM: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sM_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sO_layout)], 1024]
            sF: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sF_layout)], 128]
            sCk: cute.struct.Align[cute.struct.MemRange[dt, sCk_elems], 1024]

        self.storage = SharedStorage
        num_batches = mCuSeqlens.shape[0] - 1
        # one grid column per (sequence) or, from checkpoints, per checkpoint row
        grid = ([mState0.shape[0], self.heads, self.v_splits] if const_expr(self.from_checkpoints)
                else [self.heads, cutlass.max(num_batches, 1), self.v_splits])
        self.kernel(mma_tok, mma_state, mQ_t, mK_t, mW_blk, mW_u, tma_q, tma_kr, tma_blk,
                    tma_u, sK_layout, sU_layout, sM_layout, sO_layout, store_o, mO_t,
                    (tma_f, mF_t, sF_layout), staged_ckpt, mCuSeqlens, mSeqTable, mO, mState0,
                    mStateIdx, mFinal, mCkpt, ckpt_every, num_batches).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_tok: cute.TiledMma, mma_state: cute.TiledMma, mQ: cute.Tensor,
               mK: cute.Tensor, mW_blk: cute.Tensor, mW_u: cute.Tensor,
               tma_q: cute.CopyAtom, tma_kr: cute.CopyAtom, tma_blk: cute.CopyAtom,
               tma_u: cute.CopyAtom, sK_layout: cute.ComposedLayout,
               sU_layout: cute.ComposedLayout, sM_layout: cute.ComposedLayout,
               sO_layout: cute.ComposedLayout, store_o: cute.CopyAtom, mO_t: cute.Tensor,
               factor_rows: tuple, staged_ckpt, mCuSeqlens: cute.Tensor,
               mSeqTable: cute.Tensor, mO: cute.Tensor, mState0: cute.Tensor,
               mStateIdx: cute.Tensor, mFinal: cute.Tensor,
               mCkpt: cute.Tensor, ckpt_every: Int32, num_batches: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.from_checkpoints):
            # batch: the checkpoint row this segment starts from
            batch, head, split = cute.arch.block_idx()
        else:
            head, batch, split = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        pipe = tma_pipeline(storage.bars.data_ptr(), STAGES, self.stage_bytes,
                            self.nwg * THREADS_PER_WG)
        p_full, unpacked = storage.p_full.data_ptr(), storage.unpacked.data_ptr()
        init_ring_barriers(p_full, unpacked, STAGES, tidx)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        sQ = storage.sQ.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sW = storage.sW.get_tensor(sM_layout.outer, swizzle=sM_layout.inner)  # T (with o)
        sU = storage.sU.get_tensor(sU_layout.outer, swizzle=sU_layout.inner)
        sM = storage.sM.get_tensor(sM_layout.outer, swizzle=sM_layout.inner)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        tma_f, mF_t, sF_layout = factor_rows
        sF = storage.sF.get_tensor(sF_layout)
        ckpt_tile = None  # (its staging tile, TMA atom, view of the checkpoints)
        if const_expr(staged_ckpt is not None):
            store_ck, mCk_t, sCk_layout = staged_ckpt
            ckpt_tile = (storage.sCk.get_tensor(sCk_layout.outer, swizzle=sCk_layout.inner),
                         store_ck, mCk_t)

        if const_expr(self.from_checkpoints):
            start, length, first_chunk, batch = self.find_segment(mCuSeqlens, num_batches,
                                                                  ckpt_every, batch, mSeqTable)
        else:
            start = mCuSeqlens[batch]
            length = mCuSeqlens[batch + 1] - start
            first_chunk = packed_chunk_start(mCuSeqlens, batch, mSeqTable)
        chunks = (length + CHUNK - 1) // CHUNK
        # chunk updates: without o, a sequence's (or segment's) last one would only make the
        # state leaving it, which nothing reads (at 1024 x 64 every update was such a one)
        updates = cutlass.max(chunks - 1, 0) if const_expr(self.states_only) else chunks
        if warp == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mQ, mK, mW_blk, mW_u, tma_q, tma_kr, tma_blk, tma_u, sQ, sK,
                         sU, sM, (tma_f, mF_t, sF), pipe, p_full, head, start,
                         first_chunk, updates, split)
        elif warp < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            # P (sM) -> T (sW) and, with o, M (sM)
            unpack_ring(storage.sM.data_ptr().toint(), storage.sW.data_ptr().toint(), p_full,
                        unpacked, updates, warp - 1, STAGES, not self.states_only,
                        one_bits(self.dtype))
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(mma_tok, mma_state, sQ, sK, sW, sU, sM, (sO, store_o, mO_t), pipe,
                         unpacked, sF, ckpt_tile, mO,
                         mState0, mStateIdx, mFinal, mCkpt, ckpt_every, mCuSeqlens, mSeqTable,
                         batch, head, start, length, first_chunk, chunks, updates,
                         tidx - THREADS_PER_WG, split)

    @cute.jit
    def find_segment(self, mCuSeqlens, num_batches: Int32, every: Int32, row: Int32,
                     mSeqTable):
        """Checkpoint row ``row`` (rows of the sequences in order, ceil(len / every) each)
        as (its first token, its token count (0 past the series), its first chunk's packed
        number, the row to read, 0 past the series). With the sequence table: a warp search
        of its checkpoint-row half (the whole CTA calls this); else a serial scan."""
        start, length, first_chunk, state_row = Int32(0), Int32(0), Int32(0), Int32(0)
        if has_table(mSeqTable, mCuSeqlens):
            rows_at = num_batches + 1  # the table's checkpoint-row half
            b = find_in_table(mSeqTable, rows_at, num_batches, row)
            if b < num_batches:
                j = row - mSeqTable[rows_at + b]
                seq_start = mCuSeqlens[b]
                start = seq_start + j * every
                length = cutlass.min(every, mCuSeqlens[b + 1] - start)
                first_chunk = mSeqTable[b] + j * (every // CHUNK)
                state_row = row
        else:
            start, length, first_chunk, state_row = self.scan_for_segment(
                mCuSeqlens, num_batches, every, row)
        return start, length, first_chunk, state_row

    @cute.jit
    def scan_for_segment(self, mCuSeqlens, num_batches: Int32, every: Int32, row: Int32):
        """find_segment without a table: O(N) serial steps."""
        before = Int32(0)  # checkpoint rows of the sequences before b
        chunks_before = Int32(0)
        start, length, first_chunk, state_row = Int32(0), Int32(0), Int32(0), Int32(0)
        for b in cutlass.range(num_batches, unroll=1):
            seq_start = mCuSeqlens[b]
            seq_len = mCuSeqlens[b + 1] - seq_start
            rows = (seq_len + every - 1) // every
            j = row - before
            if j >= 0:
                if j < rows:
                    start = seq_start + j * every
                    length = cutlass.min(every, seq_len - j * every)
                    first_chunk = chunks_before + j * (every // CHUNK)
                    state_row = row
            before = before + rows
            chunks_before = chunks_before + (seq_len + CHUNK - 1) // CHUNK
        return start, length, first_chunk, state_row

    @cute.jit
    def produce(self, mQ, mK, mW_blk, mW_u, tma_q, tma_kr, tma_blk, tma_u, sQ, sK,
                sU, sM, factor_rows, pipe, p_full, head: Int32, start: Int32,
                first_chunk: Int32, chunks: Int32, split: Int32):
        K, V, C = self.k_dim, self.v_dim, CHUNK
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, STAGES)
        # work16's packed block P first, into sM (unpack_ring splits it while the stage's
        # other tiles land); v's columns go into sU (below)
        token_tiles = ((tma_kr, mK, sK, head // self.k_group),)
        if const_expr(not self.states_only):  # Q only makes o
            token_tiles = ((tma_q, mQ, sQ, head // self.q_group),) + token_tiles
        for c in cutlass.range(chunks, unroll=1):
            pipe.producer_acquire(state)
            load_packed(tma_blk, mW_blk[None, None, head, first_chunk + c], sM, state.index,
                        p_full)
            bar = pipe.producer_get_barrier(state)
            for atom, m, s, h in token_tiles:
                g = cute.local_tile(cute.domain_offset((start, 0), m[None, None, h]), (C, K),
                                    (c, 0))
                tma_load_tile(atom, g, s, state.index, bar)
            g = cute.local_tile(cute.domain_offset(
                (start, 0), mW_u[None, None, head // self.v_group]), (C, self.v_rows),
                (c, split))
            tma_load_tile(tma_u, g, sU, state.index, bar)
            load_factor_row(*factor_rows, head, first_chunk + c, state.index, bar)
            state = advanced(state)

    @cute.jit
    def consume(self, mma_tok, mma_state, sQ, sK, sW, sU, sM, staged_o, pipe, unpacked, sF,
                ckpt_tile, mO, mState0, mStateIdx, mFinal, mCkpt, ckpt_every: Int32, mCuSeqlens,
                mSeqTable, batch: Int32,
                head: Int32, start: Int32, length: Int32, first_chunk: Int32, chunks: Int32,
                updates: Int32, consumer_tidx: Int32, split: Int32):
        # the "W" B operand is Kc itself (Y^T = S^T Kc^T); T (sW) stands in M's place
        # without o, else has its own B fragment
        parts = self.state_parts(mma_tok, mma_state, sQ, sK, sK,
                                 sW if const_expr(self.states_only) else sM, consumer_tidx,
                                 split)
        frag_t = None
        if const_expr(not self.states_only):
            wg_tok = mma_tok.get_slice((consumer_tidx // THREADS_PER_WG) * THREADS_PER_WG)
            frag_t = wg_tok.make_fragment_B(wg_tok.partition_B(sW))
        state_row, ckpt_row = self.load_state(parts, mState0, mStateIdx, mCuSeqlens,
                                              ckpt_every, batch, head, mSeqTable)
        every = ckpt_every
        if const_expr(self.from_checkpoints):  # a state at every chunk of the segment
            every, ckpt_row = Int32(CHUNK), first_chunk
        # the checkpoints' staging tile: the o tile's in states_only, their own beside o (io
        # dtype); fp32 checkpoints are stored element by element (checkpoint)
        ckpt_stage = staged_o if const_expr(self.states_only) else ckpt_tile
        # With o (one CTA per (sequence, head)), chunk c's O^T leaves during chunk c + 1,
        # once its first products are issued, through o16: off the state's chain (4 x 8192:
        # recurrence -4 %). The split recurrence stores each chunk's after it: it gained
        # nothing (latency-bound, 64 CTAs) and in one variant (fp16, initial state) ptxas
        # serialized its wgmmas around the store's single-warp TMA issue.
        behind = not self.states_only and self.v_splits == 1
        o16 = None
        if const_expr(behind):
            o16 = cute.make_rmem_tensor(parts.acc_o.layout, self.dtype)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, STAGES)
        for c in cutlass.range(updates, unroll=1):
            if const_expr(ckpt_stage is not None):
                if (c * CHUNK) % every == 0:
                    self.save_state_staged(parts, ckpt_stage, ckpt_row + (c * CHUNK) // every,
                                           head)
            else:
                self.checkpoint(parts, mCkpt, ckpt_every, ckpt_row, c, head)
            pipe.consumer_wait(state)
            cute.arch.mbarrier_wait(unpacked + state.index, state.phase)
            store_previous = None
            if const_expr(behind):
                store_previous = lambda: self.store_previous_o(  # noqa: E731
                    parts, staged_o, start, c, head, o16)
            self.chunk_update(parts, sU[None, None, state.index], state.index,
                              sF[0, None, state.index], sF[1, None, state.index], frag_t,
                              o16, store_previous)
            cute.arch.sync_warp()
            pipe.consumer_release(state)
            state = advanced(state)
            if const_expr(not self.states_only and not behind):
                self.store_o(parts, mO, start, length, c, head, staged_o)
        if const_expr(behind):
            if updates > 0:
                o16.store(parts.acc_o.load().to(self.dtype))
                self.store_o(parts, mO, start, length, updates - 1, head, staged_o, o16)
        if const_expr(self.states_only):
            # the state entering the last chunk (every = CHUNK without o), but for a
            # one-chunk sequence's zero state
            if chunks > int(self.zero_first):
                self.save_state_staged(parts, ckpt_stage, ckpt_row + updates, head)
        if consumer_tidx < cute.arch.WARP_SIZE:  # the staging tile's last store has read it
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.store_state(parts, mState0, mFinal, state_row, batch, head)

    # The state role's pieces, shared with the fused kernel (gdn_fwd_sm90).
    @cute.jit
    def state_parts(self, mma_tok, mma_state, sQ, sK, sW, sM, consumer_tidx: Int32,
                    split: Int32 = 0):
        """Accumulators, their 16-bit operand copies, shared-memory B fragments (every
        stage) and element coordinates of one state thread (of the CTA owning state rows
        split * v_rows ...)."""
        K, C = self.k_dim, CHUNK
        rows = 64 * self.nwg
        wg = consumer_tidx // THREADS_PER_WG
        wg_tok = mma_tok.get_slice(wg * THREADS_PER_WG)
        wg_state = mma_state.get_slice(wg * THREADS_PER_WG)
        thr_tok = mma_tok.get_slice(consumer_tidx)
        thr_state = mma_state.get_slice(consumer_tidx)
        k_t = transposed(sK, C, K)
        frags = (wg_tok.make_fragment_B(wg_tok.partition_B(sW)),
                 wg_tok.make_fragment_B(wg_tok.partition_B(sQ)),
                 wg_tok.make_fragment_B(wg_tok.partition_B(sM)),
                 wg_state.make_fragment_B(wg_state.partition_B(k_t)))
        acc_state = cute.make_rmem_tensor(wg_state.partition_shape_C((rows, K)), Float32)
        acc_x = cute.make_rmem_tensor(wg_tok.partition_shape_C((rows, C)), Float32)
        acc_o = cute.make_rmem_tensor(wg_tok.partition_shape_C((rows, C)), Float32)
        state16 = cute.make_rmem_tensor(acc_state.layout, self.dtype)
        deltas = tuple(cute.make_rmem_tensor(acc_x.layout, self.dtype) for _ in range(2))
        return StateParts(mma_tok, mma_state, frags, acc_state, acc_x, acc_o, state16, deltas,
                          thr_state, thr_tok, consumer_tidx, split)

    @cute.jit
    def load_state(self, parts, mState0, mStateIdx, mCuSeqlens, ckpt_every: Int32,
                   batch: Int32, head: Int32, mSeqTable):
        """The entering state (or zeros) into the accumulator; returns (its row in
        mState0, the sequence's first checkpoint row). mSeqTable: the sequence table, or
        cu_seqlens standing in for none."""
        acc_state = parts.acc_state
        state_row = batch
        if const_expr(self.pool):
            state_row = mStateIdx[batch]
        acc_state.fill(0.0)
        if const_expr(self.initial_state):
            src = self.state_view(parts, mState0, state_row, head)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                acc_state[e] = src[e].to(Float32)
        ckpt_row = Int32(0)
        if const_expr(self.checkpoints and not self.from_checkpoints):
            # Rows of the checkpoint series before this sequence's: ceil(len / n) each.
            if has_table(mSeqTable, mCuSeqlens):
                ckpt_row = mSeqTable[mCuSeqlens.shape[0] + batch]
            else:
                ckpt_row = sum_before(mCuSeqlens, batch, ckpt_every)
        return state_row, ckpt_row

    @cute.jit
    def checkpoint(self, parts, mCkpt, ckpt_every: Int32, ckpt_row: Int32, c: Int32,
                   head: Int32):
        """The state entering chunk c, when its first token is a checkpoint position."""
        if const_expr(self.checkpoints):
            if (c * CHUNK) % ckpt_every == 0:
                self.save_state(parts, mCkpt, ckpt_row + (c * CHUNK) // ckpt_every, head)

    @cute.jit
    def chunk_update(self, parts, sU, s, factors, scales=None, frag_t=None,
                     o16=None, after_issue=None):
        """One chunk (its tiles in stage s, U (from_inverse: v's columns) as the 2-D view
        ``sU``, its factor rows [q_f | k_f | G_L] and (from_inverse) [t_w | t_u] as the 1-D
        views ``factors``, ``scales``; with o and from_inverse T's B fragment ``frag_t``):
        O^T into acc_o, the state advanced; every wgmma waited for. With o and
        from_inverse, ``o16`` receives the previous chunk's O^T (acc_o as it came in, 16-bit)
        once Y^T is issued, and ``after_issue()`` runs once S^T Q^T is too (it stores o16)."""
        mma_tok, mma_state, acc_state = parts.mma_tok, parts.mma_state, parts.acc_state
        acc_x, acc_o, state16, thr_tok = parts.acc_x, parts.acc_o, parts.state16, parts.thr_tok
        delta16, delta_k16 = parts.deltas
        tXrW, tXrQ, tOrM, tSrK = parts.frags
        rows, C = 64 * self.nwg, CHUNK
        # U^T as (V rows, tokens), partitioned like the accumulator
        u_t = thr_tok.partition_C(cute.composition(
            sU, cute.make_ordered_layout((rows, C), order=(1, 0))))
        # q_f and k_f broadcast over the V rows, partitioned like the accumulator
        by_token = cute.make_layout((rows, C), stride=(0, 1))
        t_qf = thr_tok.partition_C(cute.make_tensor(
            cute.domain_offset((Q_FACTORS,), factors).iterator, by_token))
        t_kf = thr_tok.partition_C(cute.make_tensor(
            cute.domain_offset((K_FACTORS,), factors).iterator, by_token))
        tXrS = cute.make_tensor(state16.iterator, acc_as_operand_a(acc_state.layout))
        tSrD = cute.make_tensor(delta16.iterator, acc_as_operand_a(acc_x.layout))
        tSrDk = cute.make_tensor(delta_k16.iterator, acc_as_operand_a(acc_x.layout))
        state16.store(acc_state.load().to(self.dtype))
        wgmma(mma_tok, acc_x, tXrS, tXrW[None, None, None, s], False)
        t_w = t_u = None
        if const_expr(self.from_inverse):
            t_w = thr_tok.partition_C(cute.make_tensor(
                cute.domain_offset((W_FACTORS,), scales).iterator, by_token))
            t_u = thr_tok.partition_C(cute.make_tensor(
                cute.domain_offset((U_FACTORS,), scales).iterator, by_token))
        if const_expr(self.states_only):  # no o: X^T, Delta^T, the update
            self.update_state(parts, u_t, t_kf, t_w, t_u, factors, tSrDk,
                              tSrK[None, None, None, s], tOrM[None, None, None, s])
        elif const_expr(self.from_inverse):
            decay = cute.math.exp(factors[G_LAST], fastmath=True)
            acc_d = cute.make_rmem_tensor(acc_x.layout, Float32)
            if const_expr(o16 is not None):
                o16.store(acc_o.load().to(self.dtype))  # the previous chunk's O^T (c > 0)
            wgmma(mma_tok, acc_o, tXrS, tXrQ[None, None, None, s], False)  # beside Y^T
            if const_expr(after_issue is not None):
                after_issue()  # the previous chunk's o leaves while Y^T and S^T Q^T run
            # the decay while Delta^T runs (acc_state is no wgmma's operand until the update)
            self.delta_from_inverse(parts, acc_d, u_t, t_w, t_u, frag_t[None, None, None, s],
                                    1, acc_state, decay)
            for e in cutlass.range_constexpr(cute.size(acc_x)):
                delta16[e] = acc_d[e].to(self.dtype)
                delta_k16[e] = (acc_d[e] * t_kf[e]).to(self.dtype)
            wgmma(mma_state, acc_state, tSrDk, tSrK[None, None, None, s], True)
            # O^T's scaling and product queue behind the update instead of waiting for it:
            # the next chunk needs only the state
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * t_qf[e]
            wgmma(mma_tok, acc_o, tSrD, tOrM[None, None, None, s], True)
            warpgroup.wait_group(0)
        else:
            if const_expr(self.overlap_products):
                wgmma(mma_tok, acc_o, tXrS, tXrQ[None, None, None, s], False)
            decay = cute.math.exp(factors[G_LAST], fastmath=True)
            # X^T is the state's critical path; S^T Q^T (in flight with it) waits until the
            # state's update is issued.
            warpgroup.wait_group(1 if const_expr(self.overlap_products) else 0)
            for e in cutlass.range_constexpr(cute.size(acc_x)):  # Delta^T = U^T - X^T
                d = u_t[e].to(Float32) - acc_x[e]
                delta16[e] = d.to(self.dtype)
                delta_k16[e] = (d * t_kf[e]).to(self.dtype)
            for e in cutlass.range_constexpr(cute.size(acc_state)):
                acc_state[e] = acc_state[e] * decay
            if const_expr(self.overlap_products):
                wgmma(mma_state, acc_state, tSrDk, tSrK[None, None, None, s], True)
                warpgroup.wait_group(1)  # S^T Q^T
            else:
                wgmma(mma_tok, acc_o, tXrS, tXrQ[None, None, None, s], False)
                warpgroup.wait_group(0)
            for e in cutlass.range_constexpr(cute.size(acc_o)):
                acc_o[e] = acc_o[e] * t_qf[e]
            wgmma(mma_tok, acc_o, tSrD, tOrM[None, None, None, s], True)
            if const_expr(not self.overlap_products):
                wgmma(mma_state, acc_state, tSrDk, tSrK[None, None, None, s], True)
            warpgroup.wait_group(0)

    @cute.jit
    def update_state(self, parts, v_t, t_kf, t_w, t_u, factors, tSrDk, tSrK, tYrT):
        """states_only's chunk, after Y^T = S^T Kc^T was issued into acc_x (V^T as ``v_t``,
        the accumulator's partition of v's tile; T as the B fragment ``tYrT``):
        Z^T = V^T diag(t_u) - Y^T diag(t_w), Delta^T = Z^T T^T (= U^T - S^T W^T),
        Delta^T diag(k_f) and the state update, waited for."""
        acc_x, acc_state, delta_k16 = parts.acc_x, parts.acc_state, parts.deltas[1]
        acc_d = parts.acc_o  # (free in states_only)
        decay = cute.math.exp(factors[G_LAST], fastmath=True)
        self.delta_from_inverse(parts, acc_d, v_t, t_w, t_u, tYrT, 0, acc_state, decay)
        for e in cutlass.range_constexpr(cute.size(acc_x)):
            delta_k16[e] = (acc_d[e] * t_kf[e]).to(self.dtype)
        wgmma(parts.mma_state, acc_state, tSrDk, tSrK, True)
        warpgroup.wait_group(0)

    @cute.jit
    def delta_from_inverse(self, parts, acc_d, v_t, t_w, t_u, tYrT, after_y: int,
                           decayed=None, decay=None):
        """Delta^T = Z^T T^T into acc_d, Z^T = V^T diag(t_u) - Y^T diag(t_w) (16-bit, in
        deltas[0]'s registers), waited for; Y^T = S^T Kc^T was issued into acc_x with
        ``after_y`` wgmma groups after it. V^T as ``v_t`` (the accumulator's partition of
        v's tile), T as the B fragment ``tYrT``. With ``decayed`` (an accumulator no
        pending wgmma touches), decayed *= decay while Delta^T runs."""
        acc_x, z16 = parts.acc_x, parts.deltas[0]
        warpgroup.wait_group(after_y)  # Y^T
        for e in cutlass.range_constexpr(cute.size(acc_x)):
            z16[e] = (t_u[e] * v_t[e].to(Float32) - t_w[e] * acc_x[e]).to(self.dtype)
        wgmma(parts.mma_tok, acc_d, cute.make_tensor(z16.iterator,
                                                     acc_as_operand_a(acc_x.layout)),
              tYrT, False)
        if const_expr(decayed is not None):
            for e in cutlass.range_constexpr(cute.size(decayed)):
                decayed[e] = decayed[e] * decay
        warpgroup.wait_group(0)

    @cute.jit
    def store_o(self, parts, mO, start: Int32, length: Int32, c: Int32, head: Int32,
                staged_o=None, values=None):
        """``values`` (acc_o when not given: O^T of chunk c, in accumulator order) -> o rows
        of the sequence (none past its end). With ``staged_o`` = (sO, TMA store atom, its
        view of o), a whole chunk goes through the (64, V) staging tile and one TMA store
        issued by the first consumer warp; a partial last chunk (and the fused kernel,
        without staged_o) stores element by element."""
        if const_expr(values is None):
            values = parts.acc_o
        rows = cutlass.min(length - c * CHUNK, CHUNK)
        if const_expr(staged_o is None):
            self.store_o_rows(parts, mO, start, rows, c, head, values)
        else:
            if rows == CHUNK:
                self.store_o_staged(parts, staged_o, start, c, head, values)
            else:
                self.store_o_rows(parts, mO, start, rows, c, head, values)

    @cute.jit
    def store_previous_o(self, parts, staged_o, start: Int32, c: Int32, head: Int32, o16):
        """During chunk c > 0: chunk c - 1's O^T (o16), a whole chunk since c follows it.
        At c = 0 (o16 holds no chunk's values) only the TMA issue is left out: the fewer
        branches between wgmma issue and wait, the less ptxas serializes (a branch around
        the whole store did, in the split recurrence, before it stopped storing behind)."""
        self.store_o_staged(parts, staged_o, start, c - 1, head, o16, c > 0)

    @cute.jit
    def store_o_staged(self, parts, staged_o, start: Int32, c: Int32, head: Int32, values,
                       send=None):
        sO, store_o, mO_t = staged_o
        V, C = 64 * self.nwg, CHUNK
        s_t = parts.thr_tok.partition_C(cute.composition(
            sO[None, None, 0], cute.make_ordered_layout((V, C), order=(1, 0))))

        def write():  # this thread's elements of O^T, element-wise
            for e in cutlass.range_constexpr(cute.size(values)):
                s_t[e] = values[e].to(self.dtype)
        self.store_staged(parts, write, store_o, sO, lambda: cute.local_tile(
            cute.domain_offset((start + c * C, 0), mO_t[None, None, head]), (C, V),
            (0, parts.split)), send)

    @cute.jit
    def save_state_staged(self, parts, staged, row: Int32, head: Int32):
        """The state (16-bit) into checkpoint row ``row`` through the staging tile."""
        sCk, store_ck, mCk_t = staged

        def write():  # by stmatrix (was element-wise: ~190 instructions a chunk in the
            # states pass); state16 is free here: chunk_update remakes it from acc_state first
            parts.state16.store(parts.acc_state.load().to(self.dtype))
            store_stmatrix(parts.state16, parts.mma_state, sCk[None, None, 0],
                           parts.consumer_tidx)
        self.store_staged(parts, write, store_ck, sCk, lambda: cute.local_tile(
            mCk_t[None, None, head, row], (self.v_rows, self.k_dim), (parts.split, 0)))

    @cute.jit
    def store_staged(self, parts, write, atom, s_tile, global_tile, send=None):
        """``write()`` (each consumer thread its part of the 16-bit staging tile
        ``s_tile``) once the previous store from the tile has read it, then one TMA store of
        the tile to ``global_tile()`` issued by the first consumer warp (if ``send``, when
        given, holds)."""
        issuer = parts.consumer_tidx < cute.arch.WARP_SIZE
        # the previous store has read the tile (a no-op in threads that issued none: no
        # branch, which ptxas would have to fence between wgmma issues)
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=O_BARRIER, number_of_threads=self.nwg * THREADS_PER_WG)
        write()
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=O_BARRIER, number_of_threads=self.nwg * THREADS_PER_WG)
        if const_expr(send is not None):
            issuer = issuer & send
        if issuer:  # the whole warp: the TMA copy elects its issuing lane itself
            tma_store_tile(atom, s_tile, global_tile())
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def store_o_rows(self, parts, mO, start: Int32, rows: Int32, c: Int32, head: Int32,
                     values):
        thr_tok, split = parts.thr_tok, parts.split
        V, C = 64 * self.nwg, CHUNK
        # o rows of the chunk as (V, tokens), partitioned like the accumulator. (A
        # composition with a (V, 64):(64, 1) layout, as for the shared-memory tiles, would
        # be wrong here: the token extent of mO is T, not 64.)
        g_o = cute.domain_offset((start + c * C, split * V), mO[None, head, None])  # (T, V)
        g_t = thr_tok.partition_C(cute.local_tile(select_modes(g_o, [1, 0]), (V, C), (0, 0)))
        c_tok = thr_tok.partition_C(cute.make_identity_tensor((V, C)))
        for e in cutlass.range_constexpr(cute.size(values)):
            if c_tok[e][1] < rows:
                g_t[e] = values[e].to(mO.element_type)

    @cute.jit
    def store_state(self, parts, mState0, mFinal, state_row: Int32, batch: Int32,
                    head: Int32):
        if const_expr(self.final_state):
            self.save_state(parts, mFinal, batch, head)
        if const_expr(self.pool):
            self.save_state(parts, mState0, state_row, head)

    @cute.jit
    def state_view(self, parts, mStates, row: Int32, head: Int32):
        """This thread's elements of state ``mStates[row, head]`` (V x K; this CTA's rows),
        in accumulator order."""
        return parts.thr_state.partition_C(cute.local_tile(
            mStates[row, head, None, None], (self.v_rows, self.k_dim), (parts.split, 0)))

    @cute.jit
    def save_state(self, parts, mStates, row: Int32, head: Int32):
        acc_state = parts.acc_state
        dst = self.state_view(parts, mStates, row, head)
        for e in cutlass.range_constexpr(cute.size(acc_state)):
            dst[e] = acc_state[e].to(mStates.element_type)
