"""Gated DeltaNet forward, stage 1 of 2 for SM90: the per-chunk WY factors (no state).

Verified on an H200 (2026-11-30) by tests/test_gdn_stages_gpu.py and tests/test_gdn_fwd_gpu.py.

One CTA (one warpgroup) per (64-token chunk, output head). With the chunk's raw rows Qc, Kc,
Vc, the row scales r_q, r_k of the L2 norm (ones without it; r_q from Qc's rows, r_k from
the diagonal of Kc Kc^T, so q and k are never rewritten), in-chunk cumulative log gates G
(fp32), gamma = exp(G), beta, and the notation of precast/reference/gated_delta_net.py:

    A  = strict_tril(diag(beta r_k) (Gamma * Kc Kc^T) diag(r_k))   (fp32, shared memory)
    T  = (I + A)^-1                                (fp32, by 16 x 16 blocks: see invert)
    W  = T diag(beta gamma r_k) Kc,   U = T diag(beta) Vc  (wgmma, fp32 accumulators)
    M  = scale diag(r_q) (Gamma * Qc Kc^T) diag(r_k), causal with the diagonal
    q_f = scale gamma r_q,   k_f = exp(G_L - G) r_k        (zero past the sequence end)

M and T go, 16-bit, into one packed 64 x 64 workspace block per (chunk, head) (work16:
M's lower triangle, T's strict lower one transposed into the upper one; gdn_layout) and
[q_f | k_f | G_L] into its fp32 factor row. With store_wu=False (what the ops run) W and U
are neither made nor stored, nor V loaded: the recurrence and the backward read T from the
packed block, and the column scales of the scaled inverses Tw = T diag(beta gamma r_k),
Tu = T diag(beta) (W = Tw Kc, U = Tu Vc) from the second factor row; the fused kernel
still makes W and U (precast/kernels/gdn_layout.py; the contract is
precast/reference/gdn_workspace.py). Stage 2 (gdn_recurrence_sm90) reads q and k
themselves and applies q_f, k_f to its products. Chunks are packed over the batch:
sequence b's chunk c is number sum_{b' < b} ceil(len_b' / 64) + c, so the workspace has at
most T // 64 + N chunk rows.

Rows past a sequence's end are zeros in shared memory (Q, K, V) and get g = beta = 0, which
makes their rows of A, W, U, M and their factors zero and leaves G constant, so G_L is the
last real token's.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cute.nvgpu.warp import MmaTF32Op
from cutlass.tensor_utils import LayoutEnum

from .attention_sm90 import (find_in_sequences, select_modes, store_stmatrix, tma_load_tile,
                             tma_store_tile, transposed, warp_inclusive_sum, wgmma)
from .gdn_layout import CHUNK, FACTOR_COLS, G_LAST, K_FACTORS, Q_FACTORS, U_FACTORS, W_FACTORS
from .gdn_seq_table_sm90 import find_in_table, has_table

THREADS = 128
PREPARE_BARRIER = 1
# Without W and U (and V) the standalone kernel fits ~100 registers and ~34 KB of shared
# memory (A, T and M over the dead Q and K tiles): 5 CTAs per SM (it is latency-bound: 3
# per SM, when it made W and U, was 9 % slower than 4).
CTAS_PER_SM = 5
INV_BLOCK = 16  # diagonal blocks of T solved by substitution (see invert)
TF32_ROUND = 1 << 12  # half a unit of tf32's last mantissa place (bit 13)
L2NORM_EPS = 1e-24
# A's rows in shared memory (fp32): row 8 m + j starts at word 576 m + 64 j + pad_j, pad =
# 0, 8, 16, 24, 36, 44, 52, 60 (rows never overlap), so in every group of 8 rows the rows
# start in 8 distinct 16-byte bank groups, and rows 0-3 and 4-7 of it in distinct 8-bank
# windows. Every access of stage 1 is then conflict-free: the epilogue's and the products'
# 8-byte stores of accumulator pairs (four rows per half-warp), the tf32 fragments' loads
# (eight rows by four columns; B four rows by eight), the 16-byte row loads. (A uniform
# 68-word stride served the 4-byte patterns only: 2-way conflicts on a fifth of the
# kernel's shared-memory wavefronts, ncu run 37b.) Rows stay 16-byte aligned.
A_GROUP_ROWS = 8
A_ROW_GROUP = (4, 2, CHUNK // A_GROUP_ROWS)  # row r as (r % 4, (r // 4) % 2, r // 8)
A_ROW_STEPS = (CHUNK + 8, 4 * CHUNK + 36, 9 * CHUNK)
A_ELEMS = sum((n - 1) * d for n, d in zip(A_ROW_GROUP, A_ROW_STEPS)) + CHUNK


def a_layout(rows: int = CHUNK, cols: int = CHUNK):
    """(rows, cols) of A from a row that is a multiple of 8."""
    return cute.make_layout(((*A_ROW_GROUP[:2], rows // A_GROUP_ROWS), cols),
                            stride=(A_ROW_STEPS, 1))


def a_tile(sA, corner, rows: int, cols: int, transpose: bool = False):
    """The (rows, cols) block of A at ``corner`` (row a multiple of 8), or its (cols, rows)
    transposed view."""
    layout = a_layout(rows, cols)
    if transpose:
        layout = cute.select(layout, mode=[1, 0])
    return cute.make_tensor(sA.iterator + (corner[0] // A_GROUP_ROWS * A_ROW_STEPS[2]
                                          + corner[1]), layout)


# Rows of the per-token values in shared memory (sRows): the L2 row scales r_q, r_k, then
# (over them, once row_values read them) T's column scales for W and U.
R_Q, R_K = range(2)
T_W, T_U = R_Q, R_K
ROW_VALUES = 2
GRID_Y_MAX = 65535  # CUDA's limit on gridDim.y (and z)


def chunk_grid(chunks, heads: int):
    """Grid of the per-(chunk, head) kernels, heads fastest: the CTAs resident together
    then read whole token rows of q, k, v (every head's 256-byte piece of a row, adjacent in
    memory) instead of one head's piece of rows 16 KB apart. Chunks run over y, then z."""
    return [heads, cutlass.min(chunks, GRID_Y_MAX), (chunks + GRID_Y_MAX - 1) // GRID_Y_MAX]


@cute.jit
def block_chunk_head():
    """(packed chunk, head) of this CTA in chunk_grid (chunks past the workspace's rows
    find no sequence and exit)."""
    head, y, z = cute.arch.block_idx()
    return y + z * GRID_Y_MAX, head



@cute.jit
def warp_block_product(sA, a_at, b_at, c_at, rows: cutlass.Constexpr,
                       depth: cutlass.Constexpr, negate: cutlass.Constexpr, lane: Int32):
    """One warp: C = (-) A B with A (rows x depth) at sA[a_at], B (depth x 8) at sA[b_at],
    C (rows x 8) written to sA[c_at] (fp32 tiles of A's padded rows, corners given as
    (row, column)), by tf32 mma.sync (m16n8k8; operands rounded to nearest). On the CUDA
    cores these products re-read their rows from shared memory for every output: that was
    most of the inverse's time (shared-memory bound, ~45 % of the kernel)."""
    mma = cute.make_tiled_mma(cute.make_mma_atom(MmaTF32Op((16, 8, 8))))
    thr = mma.get_slice(lane)
    t_a = thr.partition_A(a_tile(sA, a_at, rows, depth))
    t_b = thr.partition_B(a_tile(sA, b_at, depth, 8, transpose=True))  # (N, K) view of B
    t_c = thr.partition_C(a_tile(sA, c_at, rows, 8))
    operands = []
    for t in (t_a, t_b):
        r = cute.make_rmem_tensor(t.shape, Float32)
        r.store(t.load())
        bits = cute.make_tensor(cute.recast_ptr(r.iterator, dtype=Int32), r.layout)
        for e in cutlass.range_constexpr(cute.size(r)):  # fp32 -> tf32, to nearest
            bits[e] = bits[e] + Int32(TF32_ROUND)
        operands.append(cute.make_tensor(cute.recast_ptr(r.iterator, dtype=cutlass.TFloat32),
                                         r.layout))
    acc = cute.make_rmem_tensor(thr.partition_shape_C((rows, 8)), Float32)
    acc.fill(0.0)
    cute.gemm(mma, acc, operands[0], operands[1], acc)
    if const_expr(negate):
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = -acc[e]
    t_c.store(acc.load())


class GdnChunkPrepareSm90:
    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, l2norm: bool, g_dtype, beta_dtype, store_wu: bool = True):
        """store_wu=False (what the ops run): neither W nor U is computed or stored; T
        goes into work16's packed block (with M) and its column scales to the second
        factor row, for the recurrence and the backward, which make W and U's
        products themselves."""
        assert k_dim in (64, 128) and v_dim in (64, 128)
        self.dtype = dtype
        self.k_dim, self.v_dim = k_dim, v_dim
        self.heads = max(q_heads, v_heads)
        self.q_group = self.heads // q_heads
        self.k_group = self.heads // k_heads
        self.v_group = self.heads // v_heads
        self.l2norm = l2norm
        self.g_dtype, self.beta_dtype = g_dtype, beta_dtype
        self.store_wu = store_wu

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor,
                 mWork16: cute.Tensor, mWork32: cute.Tensor, scale: Float32,
                 stream: cuda.CUstream):
        """mQ (T, HQ, K), mK (T, HK, K), mV (T, HV, V); mG, mBeta (T, HO); mCuSeqlens
        (N + 1,) int32; mSeqTable: gdn_seq_table_sm90's table (or cu_seqlens: none); mWork16
        / mWork32 as gdn_layout.workspace_shapes."""
        # W and U are formed only inside the fused kernel (gdn_fwd_sm90): work16 has no
        # room for them
        assert not self.store_wu, "the standalone stage 1 stores T and M, not W and U"
        dt = self.dtype
        C = CHUNK
        layouts, loads, mmas = self.prepare_setup(mQ, mK, mV, 1)
        sQK_layout, sV_layout, _ = layouts  # (T's layout: the fused kernel's)
        tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma = loads
        mma_s, mma_wk, mma_wv = mmas
        # M, with T's strict lower triangle transposed into its upper one (the packed block
        # P), leaves by a TMA store of a (64, 64) 16-bit tile into work16 (viewed (64, 64,
        # HO, chunks)).
        sM_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, C), dt, 1)
        one = lambda layout: cute.slice_(layout, (None, None, 0))  # noqa: E731
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        store_m, mW_t = cpasync.make_tiled_tma_atom(s2g, select_modes(mWork16, [2, 3, 1, 0]),
                                                    one(sM_layout), (C, C))

        a_elems = 1 if self.a_over_qk() else A_ELEMS

        @cute.struct
        class SharedStorage:
            bar: cute.struct.MemRange[cutlass.Int64, 1]
            gate: cute.struct.MemRange[Float32, C]  # G (cumulative log gate)
            beta: cute.struct.MemRange[Float32, C]
            rows: cute.struct.MemRange[Float32, ROW_VALUES * C]  # see row_values
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQK_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQK_layout)], 1024]
            # (none: V, which only U needs, is not loaded here)
            sV: cute.struct.Align[cute.struct.MemRange[dt, 8], 1024]
            # A, then T over it (16-bit, swizzled), when the dead Q and K tiles cannot hold
            # A and M (K = 64); at K = 128 A goes over Q (and K's first KB), M over K's
            # second half: ~34 KB of shared memory, 5 CTAs per SM
            sA: cute.struct.Align[cute.struct.MemRange[Float32, a_elems], 1024]

        self.storage = SharedStorage
        chunks = mWork32.shape[0]
        num_batches = mCuSeqlens.shape[0] - 1
        self.kernel(mma_s, mma_wk, mma_wv, mQ_tma, mK_tma, mV_tma, tma_q, tma_k, tma_v,
                    sQK_layout, sV_layout, sM_layout, mG, mBeta, mCuSeqlens,
                    mSeqTable, mW_t, store_m, mWork32, num_batches, scale).launch(
            grid=chunk_grid(chunks, self.heads), block=[THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=CTAS_PER_SM, preferred_smem_carveout=-1)

    def a_over_qk(self) -> bool:
        """Whether the dead Q and K tiles (2 x 64 x K 16-bit) hold A (fp32, A_ELEMS words)
        and M (16-bit, 64 x 64) side by side."""
        return 2 * CHUNK * self.k_dim * 2 >= A_ELEMS * 4 + CHUNK * CHUNK * 2

    def prepare_setup(self, mQ, mK, mV, stages: int):
        """Host-side pieces of the preparing role: shared-memory layouts (Q/K and V tiles
        with ``stages`` stages, T), TMA atoms of the (T, H, D) inputs and the tiled MMAs;
        sets ``self.load_bytes`` (one chunk's Q, K and, when U is made, V)."""
        dt = self.dtype
        K, V, C = self.k_dim, self.v_dim, CHUNK
        mQ, mK, mV = [select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV)]  # (T, D, H)
        # Q and K tiles serve as K-major A and B operands and (K) as an MN-major B operand
        # through a transposed view; V only as the latter. One layout kind for all three.
        sQK_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, K), dt, stages)
        sV_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, C, V), dt, stages)
        sT_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (C, K, C), dt, 1)
        one = lambda layout: cute.slice_(layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, one(sQK_layout), (C, K))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, one(sQK_layout), (C, K))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, one(sV_layout), (C, V))
        # V only makes U: a prepare without W and U loads Q and K alone
        self.load_bytes = (2 * cute.size_in_bytes(dt, one(sQK_layout))
                           + (cute.size_in_bytes(dt, one(sV_layout))
                              if const_expr(self.store_wu) else 0))
        # Scores: 64 x 64 from K-major Q / K tiles. Factors: 64 x D from T (K-major A) and
        # the K / V tiles read transposed (MN-major B).
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        mma_s = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, Float32,
                                                  (1, 1, 1), (C, C))
        mma_wk = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                   (1, 1, 1), (C, K))
        mma_wv = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, Float32,
                                                   (1, 1, 1), (C, V))
        return ((sQK_layout, sV_layout, sT_layout),
                (tma_q, mQ_tma, tma_k, mK_tma, tma_v, mV_tma), (mma_s, mma_wk, mma_wv))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_wk: cute.TiledMma, mma_wv: cute.TiledMma,
               mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, tma_q: cute.CopyAtom,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, sQK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sM_layout: cute.ComposedLayout,
               mG: cute.Tensor, mBeta: cute.Tensor, mCuSeqlens: cute.Tensor,
               mSeqTable: cute.Tensor, mWork16: cute.Tensor, store_m: cute.CopyAtom,
               mWork32: cute.Tensor, num_batches: Int32, scale: Float32):
        C = CHUNK
        tidx, _, _ = cute.arch.thread_idx()
        packed, head = block_chunk_head()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        batch, chunk = self.find_chunk(packed, mCuSeqlens, num_batches, mSeqTable)
        if batch < num_batches:
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.storage)
            sQ = storage.sQ.get_tensor(sQK_layout.outer, swizzle=sQK_layout.inner)
            sK = storage.sK.get_tensor(sQK_layout.outer, swizzle=sQK_layout.inner)
            sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
            # Q and K are dead once the scores are made (see SharedStorage)
            a_ptr = storage.sA.data_ptr()
            m_ptr = storage.sQ.data_ptr()
            if const_expr(self.a_over_qk()):
                a_ptr = cute.recast_ptr(storage.sQ.data_ptr(), dtype=Float32)
                m_ptr = storage.sK.data_ptr() + cute.cosize(sM_layout.outer)
            sA = cute.make_tensor(a_ptr, a_layout())
            sGate = storage.gate.get_tensor(cute.make_layout(C))
            sBeta = storage.beta.get_tensor(cute.make_layout(C))
            sRows = storage.rows.get_tensor(cute.make_layout((ROW_VALUES, C), stride=(C, 1)))
            bar = storage.bar.data_ptr()
            start = mCuSeqlens[batch]
            rows = cutlass.min(mCuSeqlens[batch + 1] - start - chunk * C, C)
            if tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            if warp == 0:
                self.load_tiles(mQ, mK, mV, tma_q, tma_k, tma_v, sQ, sK, sV, bar, start,
                                chunk, head)
            self.load_gates(mG, mBeta, sGate, sBeta, start + chunk * C, rows, head, tidx)
            cute.arch.mbarrier_wait(bar, 0)
            # M from the score accumulator, staged into sM by prepare_chunk
            thr_s = mma_s.get_slice(tidx)
            m16 = cute.make_rmem_tensor(thr_s.partition_shape_C((C, C)), self.dtype)
            out = (sK[None, None, 0], sV[None, None, 0], m16, mWork32[packed, head, None])
            sM = cute.make_tensor(cute.recast_ptr(m_ptr, swizzle_=sM_layout.inner,
                                                  dtype=self.dtype), sM_layout.outer)
            # (no scaled inverses: only the fused kernel makes W and U)
            self.prepare_chunk(mma_s, mma_wk, mma_wv, sQ, sK, sV, 0, None, None, sA, sGate,
                               sBeta, sRows, out, rows, scale, tidx, sM[None, None, 0])
            cute.arch.fence_proxy("async.shared", space="cta")
            self.sync()
            if warp == 0:  # the whole warp: each TMA copy elects its issuing lane itself
                tma_store_tile(store_m, sM, mWork16[None, None, head, packed])
                cute.arch.cp_async_bulk_commit_group()
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # before the CTA exits

    @cute.jit
    def prepare_chunk(self, mma_s, mma_wk, mma_wv, sQ, sK, sV, stage, sTw, sTu, sA, sGate,
                      sBeta, sRows, out, rows: Int32, scale: Float32, tidx: Int32, sM=None):
        """One warpgroup (thread ``tidx`` of 128), after the chunk's Q, K, V (stage
        ``stage`` of sQ, sK, sV) and its g, beta (sGate, sBeta) are in shared memory:
        writes W, U (with store_wu, through the scaled inverses sTw, sTu; else both are
        None) (2-D views, which may be sK, sV of the stage), M (this thread's elements in
        the score accumulator's order) and the factor row (1-D) into ``out``;
        sGate ends as G. Q and K are only read by it (rows past ``rows`` are zeroed).
        Shared-memory outputs are written by the generic proxy and not yet fenced. With
        ``sM`` (a 16-bit tile over dead Q or K rows), M goes there by stmatrix right after
        the scores instead of waiting in registers through the inverse, and T's strict lower
        triangle then transposed into its upper one: work16's packed block."""
        C = CHUNK
        q2, k2, v2 = (t[None, None, stage] for t in (sQ, sK, sV))  # (rows, cols) views
        if rows < C:  # rows of the next sequence (or TMA zero fill): zeros
            self.zero_rows(q2, k2, v2, rows, tidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.sync()
        self.scores(mma_s, sQ, sK, stage, sA, sGate, sBeta, sRows, out[2], scale, tidx)
        if const_expr(sM is not None):
            store_stmatrix(out[2], mma_s, sM, tidx)
        self.sync()
        if tidx >= C:
            # Threads 64..127, which have no column of invert's diagonal blocks to solve:
            # token j's factors beside the solve. T's column scales replace the row scales
            # of token j (read only by its thread here).
            j = tidx - C
            t_w, t_u = self.row_values(sGate, sBeta, out[3], rows, scale, sRows, j)
            sRows[T_W, j] = t_w
            sRows[T_U, j] = t_u
        scaled = (None, None)  # T diag(t_w), T diag(t_u): the A operands of W and U
        if const_expr(self.store_wu):
            scaled = (sTw[None, None, 0], sTu[None, None, 0])
        self.invert(sA, *scaled, sRows, tidx, sM)
        cute.arch.fence_proxy("async.shared", space="cta")
        self.sync()
        if const_expr(self.store_wu):
            self.factors(mma_wk, mma_wv, sTw, sTu, sK, sV, stage, out[0], out[1], tidx)

    def sync(self):
        """The preparing warpgroup's barrier (the whole CTA here; one warpgroup of the
        fused kernel)."""
        cute.arch.barrier(barrier_id=PREPARE_BARRIER, number_of_threads=THREADS)

    @cute.jit
    def find_chunk(self, packed: Int32, mCuSeqlens, num_batches: Int32, mSeqTable):
        """(batch, chunk in the sequence) of packed chunk number ``packed``: a search of
        the sequence table when there is one, else each warp scanning the sequences 32 at a
        time; batch == num_batches past the last chunk."""
        batch = num_batches
        chunk = Int32(0)
        if has_table(mSeqTable, mCuSeqlens):
            batch = find_in_table(mSeqTable, 0, num_batches, packed)
            if batch < num_batches:
                chunk = packed - mSeqTable[batch]
        else:
            batch, chunk, _ = find_in_sequences(packed, mCuSeqlens, num_batches, CHUNK)
        return batch, chunk

    @cute.jit
    def load_tiles(self, mQ, mK, mV, tma_q, tma_k, tma_v, sQ, sK, sV, bar, start: Int32,
                   chunk: Int32, head: Int32, stage=0):
        """Warp 0: the chunk's Q, K, V rows by TMA onto ``bar`` (one expect-tx arrival)."""
        K, V, C = self.k_dim, self.v_dim, CHUNK
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, self.load_bytes)
        heads = (head // self.q_group, head // self.k_group, head // self.v_group)
        tiles = ((tma_q, mQ, sQ, K, heads[0]), (tma_k, mK, sK, K, heads[1]))
        if const_expr(self.store_wu):  # V only makes U
            tiles = tiles + ((tma_v, mV, sV, V, heads[2]),)
        for atom, m, s, d, h in tiles:
            g = cute.local_tile(cute.domain_offset((start, 0), m[None, None, h]), (C, d),
                                (chunk, 0))
            tma_load_tile(atom, g, s, stage, bar)

    @cute.jit
    def load_gates(self, mG, mBeta, sGate, sBeta, first: Int32, rows: Int32, head: Int32,
                   tidx: Int32):
        """g and beta of the chunk's rows (fp32; zero past the sequence end)."""
        if tidx < CHUNK:
            g = Float32(0.0)
            b = Float32(0.0)
            if tidx < rows:
                g = mG[first + tidx, head].to(Float32)
                b = mBeta[first + tidx, head].to(Float32)
            sGate[tidx] = g
            sBeta[tidx] = b

    @cute.jit
    def zero_rows(self, sQ, sK, sV, rows: Int32, tidx: Int32):
        K, V, C = self.k_dim, self.v_dim, CHUNK
        for idx in cutlass.range(tidx, C * K, THREADS, unroll=1):
            if idx // K >= rows:
                sQ[idx // K, idx % K] = self.dtype(0.0)
                sK[idx // K, idx % K] = self.dtype(0.0)
        if const_expr(self.store_wu):  # (V is not loaded without U)
            for idx in cutlass.range(tidx, C * V, THREADS, unroll=1):
                if idx // V >= rows:
                    sV[idx // V, idx % V] = self.dtype(0.0)

    @cute.jit
    def cumulative_gates(self, sGate):
        """Warp 0: G = inclusive prefix sum of g over the chunk (two rows per lane)."""
        lane = cute.arch.lane_idx()
        g0 = sGate[2 * lane]
        g1 = sGate[2 * lane + 1]
        ends = warp_inclusive_sum(g0 + g1)
        before = ends - g0 - g1
        sGate[2 * lane] = before + g0
        sGate[2 * lane + 1] = ends

    @cute.jit
    def scores(self, mma_s, sQ, sK, stage, sA, sGate, sBeta, sRows, t_m, scale: Float32,
               tidx: Int32):
        """Warp 0: G (cumulative gates, over sGate) beside the first product. K K^T -> A
        (gated, strictly lower, fp32 in shared memory); Q K^T -> M (gated,
        causal with the diagonal, scaled; 16-bit into ``t_m``, this thread's elements in
        accumulator order); with the L2 norm, r_q and
        r_k (Q's row norms, K K^T's diagonal) into sRows first. Ends with the
        warpgroup synchronized (sGate written before is read here)."""
        C = CHUNK
        thr = mma_s.get_slice(tidx)
        tSrQa = thr.make_fragment_A(thr.partition_A(sQ))[None, None, None, stage]
        tSrKa = thr.make_fragment_A(thr.partition_A(sK))[None, None, None, stage]
        tSrKb = thr.make_fragment_B(thr.partition_B(sK))[None, None, None, stage]
        acc_kk = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), Float32)
        acc_qk = cute.make_rmem_tensor(thr.partition_shape_C((C, C)), Float32)
        coords = thr.partition_C(cute.make_identity_tensor((C, C)))
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4  # of the warpgroup
        wgmma(mma_s, acc_kk, tSrKa, tSrKb, False)
        wgmma(mma_s, acc_qk, tSrQa, tSrKb, False)
        if tidx < cute.arch.WARP_SIZE:  # G, while the tensor cores work
            self.cumulative_gates(sGate)
        if const_expr(self.l2norm):
            # r_q from the rows of Q on the CUDA cores while both products run (a Q Q^T
            # for its diagonal was a third of the products, on the chain): two threads a
            # row, 16-byte loads; r_k from K K^T's diagonal below. At K = 128 a row's two
            # halves lie in two 128-byte swizzle atoms 8 KB apart, so the pair's pieces v
            # fell in one bank group (2-way conflicts, ncu run 37b): the odd thread walks
            # its pieces in the order v ^ 4.
            row = tidx // 2
            pieces = self.k_dim // 16  # 16-byte pieces in half a row
            turn = (tidx % 2) * 4 if const_expr(pieces == 8) else 0
            vals = cute.make_rmem_tensor(cute.make_layout(8), self.dtype)
            sums = [Float32(0.0), Float32(0.0)]
            for v in cutlass.range_constexpr(pieces):
                cute.autovec_copy(cute.local_tile(sQ[row, None, stage], (8,),
                                                  (tidx % 2 * pieces + (v ^ turn),)), vals)
                for e in cutlass.range_constexpr(8):
                    x = vals[e].to(Float32)
                    sums[e % 2] = sums[e % 2] + x * x
            total = sums[0] + sums[1]
            total = total + cute.arch.shuffle_sync_bfly(total, 1)
            eps = Float32(L2NORM_EPS)
            sRows[R_Q, row] = cute.math.rsqrt(cutlass.max(total, eps))
            warpgroup.wait_group(0)
            # The diagonal: warp w's rows 16 w .. are in column slots 4 w .. 4 w + 3, its
            # elements e = 4 (2 w + h) + 2 h + p (row half h, column parity p): 4 of the
            # thread's 32 can be diagonal ones (a branch per warp keeps e static).
            for w in cutlass.range_constexpr(4):
                if warp == w:
                    for h in cutlass.range_constexpr(2):
                        for p in cutlass.range_constexpr(2):
                            e = 4 * (2 * w + h) + 2 * h + p
                            if coords[e][0] == coords[e][1]:
                                i = coords[e][0]
                                sRows[R_K, i] = cute.math.rsqrt(cutlass.max(acc_kk[e], eps))
        warpgroup.wait_group(0)
        self.sync()  # G and the row scales
        # A = diag(beta r_k) (Gamma * K K^T) diag(r_k), M = scale diag(r_q) (Gamma * Q K^T)
        # diag(r_k): one factor per row for each, r_k per column, the decay per element.
        # Element e of the accumulator is row half (e // 2) % 2 and column slot
        # (e // 4) * 2 + e % 2: row values are read once, column values once per column
        # pair (read per element, they were reloaded after every store into sA). Column
        # group g (elements 4 g .. 4 g + 3, columns 8 g ..) meets warp w's 16 rows' diagonal
        # when g is 2 w or 2 w + 1; groups after those are zeros (no decays made: 3 of the 8
        # on average), groups before them need no causal selects.
        row_g, row_a, row_m = [], [], []
        for h in cutlass.range_constexpr(2):
            i = coords[2 * h][0]
            row_g.append(sGate[i])
            row_a.append(sBeta[i] * sRows[R_K, i] if const_expr(self.l2norm) else sBeta[i])
            row_m.append(scale * sRows[R_Q, i] if const_expr(self.l2norm) else scale)
        rows = (row_g, row_a, row_m)
        for g in cutlass.range_constexpr(cute.size(acc_kk) // 4):
            if g >= 2 * warp + 2:
                for e in cutlass.range_constexpr(4 * g, 4 * g + 4):
                    sA[coords[e][0], coords[e][1]] = Float32(0.0)
                    t_m[e] = self.dtype(0.0)
            else:
                # (two calls: whether the group is diagonal is known per warp at run time,
                # but column_group's selects are compiled in or out)
                if g < 2 * warp:
                    self.column_group(acc_kk, acc_qk, coords, sA, t_m, sGate, sRows, rows, g,
                                      False)
                else:
                    self.column_group(acc_kk, acc_qk, coords, sA, t_m, sGate, sRows, rows, g,
                                      True)

    @cute.jit
    def column_group(self, acc_kk, acc_qk, coords, sA, t_m, sGate, sRows, rows,
                     g: cutlass.Constexpr, diagonal: cutlass.Constexpr):
        """scores' epilogue for column group g of the thread's accumulators: A's elements
        into sA, M's into t_m (``rows``: the row values row_g, row_a, row_m). ``diagonal``:
        the group meets the warp's diagonal (the causal selects); else it lies below it."""
        row_g, row_a, row_m = rows
        col_g, col_rk = [], []
        for p in cutlass.range_constexpr(2):
            j = coords[4 * g + p][1]
            col_g.append(sGate[j])
            col_rk.append(sRows[R_K, j] if const_expr(self.l2norm) else None)
        for h in cutlass.range_constexpr(2):
            for p in cutlass.range_constexpr(2):
                e = 4 * g + 2 * h + p
                i = coords[e][0]
                j = coords[e][1]
                # (above the diagonal the decay may overflow: the selects drop it)
                decay = cute.math.exp(row_g[h] - col_g[p], fastmath=True)
                if const_expr(self.l2norm):
                    decay = decay * col_rk[p]
                a = acc_kk[e] * row_a[h] * decay
                m = acc_qk[e] * row_m[h] * decay
                if const_expr(diagonal):
                    a = Float32(cutlass.select_(j < i, a, Float32(0.0)))
                    m = Float32(cutlass.select_(j <= i, m, Float32(0.0)))
                sA[i, j] = a
                t_m[e] = Float32(m).to(self.dtype)

    @cute.jit
    def row_values(self, sGate, sBeta, out_f, rows: Int32, scale: Float32, sRows, j: Int32):
        """Thread j < 64: token j's factors q_f, k_f (and, thread 0, G_L) into the factor
        row ``out_f``; returns its column scales of T for W and U (beta gamma r_k, beta).
        Reads the row scales r_q, r_k from sRows (with the L2 norm)."""
        C = CHUNK
        g = sGate[j]
        g_last = sGate[C - 1]
        r_q = Float32(1.0)
        r_k = Float32(1.0)
        if const_expr(self.l2norm):
            r_q = sRows[R_Q, j]
            r_k = sRows[R_K, j]
        beta = sBeta[j]
        real = j < rows
        out_f[Q_FACTORS + j] = cutlass.select_(
            real, scale * cute.math.exp(g, fastmath=True) * r_q, Float32(0.0))
        out_f[K_FACTORS + j] = cutlass.select_(
            real, cute.math.exp(g_last - g, fastmath=True) * r_k, Float32(0.0))
        if j == 0:
            out_f[G_LAST] = g_last
        t_w = beta * cute.math.exp(g, fastmath=True) * r_k
        if const_expr(not self.store_wu):  # the scales of T (second factor row)
            out_f[FACTOR_COLS + W_FACTORS + j] = t_w
            out_f[FACTOR_COLS + U_FACTORS + j] = beta
        return t_w, beta

    @cute.jit
    def invert(self, sA, sTw, sTu, sRows, tidx: Int32, sP=None):
        """T = (I + A)^-1 (unit lower triangular) in fp32, in place over A, by the 128
        threads: the four 16 x 16 diagonal blocks by forward substitution (one column per
        thread), then the blocks below them by doubling, T_21 = -T_22 (A_21 T_11), at 16 and
        at 32 rows (four products, each warp 8 columns of them by tf32 mma.sync: fp32
        accumulation, operands to 10 mantissa bits, well under T's 16-bit rounding). The
        products' intermediates go to A's upper-right 32 x 32 quarter, which holds zeros
        nobody reads. Then T diag(t_w) and
        T diag(t_u) (the column scales in sRows) in 16 bits: the A operands of W and U, and,
        with ``sP`` (the packed block, holding M), T's strict lower triangle transposed into
        sP's upper one. One forward substitution over 64 rows on 64 threads was half of the
        CTA's time."""
        C = CHUNK
        B = INV_BLOCK
        # Diagonal blocks: thread tidx < 64 solves column tidx % 16 of block tidx // 16.
        x = cute.make_rmem_tensor(cute.make_layout(B), Float32)
        a4 = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        b0 = tidx // B * B
        col = tidx % B
        if tidx < C:
            for i in cutlass.range_constexpr(B):
                part = [cutlass.select_(col == i, Float32(1.0), Float32(0.0)), Float32(0.0),
                        Float32(0.0), Float32(0.0)]
                for l4 in cutlass.range_constexpr(i // 4):
                    cute.autovec_copy(cute.local_tile(sA[b0 + i, None], (4,), (b0 // 4 + l4,)),
                                      a4)
                    for u in cutlass.range_constexpr(4):
                        part[u] = part[u] - a4[u] * x[4 * l4 + u]
                for l in cutlass.range_constexpr(i // 4 * 4, i):
                    part[0] = part[0] - sA[b0 + i, b0 + l] * x[l]
                x[i] = (part[0] + part[1]) + (part[2] + part[3])
        self.sync()  # every solver read its block of A
        if tidx < C:
            for i in cutlass.range_constexpr(B):
                sA[b0 + i, b0 + col] = x[i]
        # 16-row doubling: warp w makes columns 8 (w % 2) .. of block (2p + 1, 2p),
        # p = w // 2, through the scratch block at (p, 2 + p).
        warp, lane = tidx // cute.arch.WARP_SIZE, tidx % cute.arch.WARP_SIZE
        pair = warp // 2
        half = warp % 2 * 8
        lo, hi, scratch = 2 * pair * B, (2 * pair + 1) * B, 2 * B + pair * B
        H = 2 * B
        self.sync()
        warp_block_product(sA, (hi, lo), (lo, lo + half), (pair * B, scratch + half), B, B,
                           False, lane)
        self.sync()  # every warp read A_21 (the next product writes T_21 over it)
        warp_block_product(sA, (hi, hi), (pair * B, scratch + half), (hi, lo + half), B, B,
                           True, lane)
        # 32-row doubling: warp w makes columns 8 w .. of rows 32.., through the scratch
        # quarter.
        self.sync()
        warp_block_product(sA, (H, 0), (0, 8 * warp), (0, H + 8 * warp), H, H, False, lane)
        self.sync()
        warp_block_product(sA, (H, H), (0, H + 8 * warp), (H, 8 * warp), H, H, True, lane)
        self.sync()
        # Half a row per thread (a warp: 16 rows, lanes 16.. the right halves, so the eight
        # lanes of a 16-byte access read distinct banks) of the scaled 16-bit copies, eight
        # columns at a time (16-byte stores); the upper triangle is zeros (the scratch
        # quarter holds products).
        row = tidx // 32 * B + tidx % B
        c0 = tidx % 32 // B * H
        t = cute.make_rmem_tensor(cute.make_layout(H), Float32)
        for v in cutlass.range_constexpr(H // 4):
            cute.autovec_copy(cute.local_tile(sA[row, None], (4,), (c0 // 4 + v,)),
                              cute.local_tile(t, (4,), (v,)))
        if const_expr(sP is not None):
            # T[row, c] (c < row) to P[c, row]: 2-byte stores, the 16 lanes of a half-warp
            # in one row of P
            for w in cutlass.range_constexpr(H):
                if c0 + w < row:
                    sP[c0 + w, row] = t[w].to(self.dtype)
        if const_expr(self.store_wu):
            for w in cutlass.range_constexpr(H):
                t[w] = cutlass.select_(c0 + w <= row, t[w], Float32(0.0))
            scales = cute.make_rmem_tensor(cute.make_layout(8), Float32)
            vals = cute.make_rmem_tensor(cute.make_layout(8), self.dtype)
            for g in cutlass.range_constexpr(H // 8):
                for dst, scale_row in ((sTw, T_W), (sTu, T_U)):
                    cute.autovec_copy(
                        cute.local_tile(sRows[scale_row, None], (8,), (c0 // 8 + g,)), scales)
                    for e in cutlass.range_constexpr(8):
                        vals[e] = (t[8 * g + e] * scales[e]).to(self.dtype)
                    cute.autovec_copy(vals, cute.local_tile(dst[row, None],
                                                            (8,), (c0 // 8 + g,)))

    @cute.jit
    def store_acc(self, acc, mma, out, tidx: Int32):
        """A warpgroup's fp32 accumulator of ``mma`` -> 16-bit shared-memory tile ``out``
        by stmatrix (a 2-byte store per element was most of the epilogues' instructions)."""
        vals = cute.make_rmem_tensor(acc.layout, self.dtype)
        vals.store(acc.load().to(self.dtype))
        store_stmatrix(vals, mma, out, tidx)

    @cute.jit
    def factors(self, mma_wk, mma_wv, sTw, sTu, sK, sV, stage, out_w, out_u, tidx: Int32):
        """W = Tw Kc and U = Tu Vc (Kc, Vc read transposed), 16-bit into ``out_w`` and
        ``out_u`` (which may be sV itself: the products are complete before the stores)."""
        K, V, C = self.k_dim, self.v_dim, CHUNK
        # One product at a time: fewer live registers (the fused kernel's preparing
        # warpgroup has about 100).
        for mma, sT, sX, cols, out in ((mma_wk, sTw, sK, K, out_w), (mma_wv, sTu, sV, V, out_u)):
            thr = mma.get_slice(tidx)
            x_t = transposed(sX, C, cols)
            tCrT = thr.make_fragment_A(thr.partition_A(sT))[None, None, None, 0]
            tCrX = thr.make_fragment_B(thr.partition_B(x_t))[None, None, None, stage]
            acc = cute.make_rmem_tensor(thr.partition_shape_C((C, cols)), Float32)
            wgmma(mma, acc, tCrT, tCrX, False)
            warpgroup.wait_group(0)
            self.sync()  # every warp's share of the product read sX (out may overwrite it)
            self.store_acc(acc, mma, out, tidx)
