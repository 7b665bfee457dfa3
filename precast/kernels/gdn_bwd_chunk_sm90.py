"""Gated DeltaNet backward for SM90, the chunk-parallel gradients of q, k, v, g and beta.

Verified on an H200 (2026-11-30) by tests/test_gdn_bwd_gpu.py; again on an H100
(2026-12-07) after dW and dT left it and again after the q side's reorder (session 50),
with tests/gpu_sanitize_gdn_bwd.py's racecheck and memcheck.

One CTA of two warpgroups per (64-token chunk, output head), after the forward's stage 1
(of its factors only M and T = (I + A)^-1 are read here: W and U would cost
32 KB of loads per CTA, more than recomputing Delta = U - W S from T, V and Kn, which
this kernel loads anyway), the states entering every chunk (S, V x K as
stored), and the reverse recurrence (gdn_bwd_recurrence_sm90: dS', the gradient of the
state leaving the chunk). Every formula of precast/reference/gdn_backward.py's
_chunk_backward that does not involve the recurrence runs here, each product a wgmma on
16-bit tiles in shared memory (a few take their A operand from registers). The warpgroups
take different products: warpgroup 0 the q side (Delta = T Z, dM', dq, dk's Delta and
dQK^T terms), warpgroup 1 the WY side (Z, dDelta, dv, dA, dBk, dP and their dk terms);
mbarriers and a CTA barrier order the shared-memory tiles one hands to the other. q and k
rows are normalized in shared memory first. With Qn,
Kn the L2-normalized rows (diag(r_q) Q, diag(r_k) K; r = 1 without the norm),
gamma = exp(G), d = exp(G_L - G), Gamma_ij = exp(G_i - G_j) (j <= i) and M as stage 1
stores it (scale Gamma * Qn Kn^T, causal):

    Delta = U - W S = T Z,  Z = diag(beta) (V - diag(gamma) Kn S)   (U = T diag(beta) V,
                                           W = T diag(beta gamma) Kn, as stage 1 has them)
    dM' = tril(dO Delta^T)                dQK = scale dM' * Gamma
    dDelta = M^T dO + diag(d) Kn dS'^T    (as the reverse recurrence has it; recomputed here
                                           instead of stored there)
    dq_n  = diag(scale gamma) dO S^T + dQK Kn
    dW    = -dDelta S^T                   dT  = dDelta V^T diag(beta) + dW Kn^T diag(beta gamma)
    dv    = diag(beta) T^T dDelta         dBk = T^T dW      dA = strict_tril(-T^T dT T^T)
    (neither dW, dT nor T^T dT is formed: with Z's definition dT = dDelta Z^T, so
    (T^T dT) T^T = (T^T dDelta) (T Z)^T = (T^T dDelta) Delta^T, and dBk = -(T^T dDelta) S^T:
    both take dv's product before its row scale from registers; session 48)
    dP    = diag(beta) (dA * Gamma)
    dk_n  = diag(d) Delta dS'^T + dQK^T Qn + diag(beta gamma) dBk + (dP + dP^T) Kn
    dbeta = rowsum(T^T dDelta * V) + gamma rowsum(dBk * Kn) + rowsum(dA * Gamma * Kn Kn^T)
    dG    = scale gamma rowsum((dO S^T) * Qn) - d rowsum((Delta dS'^T) * Kn)
            + beta gamma rowsum(dBk * Kn) + rowsum(E) - colsum(E),
            E = dM' * M + dP * Kn Kn^T;  dG_L += exp(G_L) <S, dS'> + sum_i d_i rowsum_i(...)
    dg    = reverse cumsum of dG over the chunk

A gradient whose input has a head per output head (gdn_layout.gradients_in_place) is final
here, in the io dtype (dq, dk with the L2 norm's Jacobian applied); one whose input head
serves two output heads (gdn_layout.gradients_added) is added here into the input's
gradient, zeroed before (each output head's part, the Jacobian applied to it: it is
linear in the gradient; TMA reduce-add stores, or atomic adds in a partial chunk; two
adds into zero give the same bits in either order); for larger groups the others (dq_n,
dk_n: the gradients of the normalized rows, and dv) go to per-output-head buffers in the
io dtype for gdn_bwd_finish_sm90, which sums each group in fp32 (16-bit partials halve
those buffers' traffic, written here and read there; a rounding of ~2^-9 per term, well
inside the gradients' tolerance). dg and dbeta are
written in g's and beta's dtypes. Rows of a partial chunk past the sequence end are zero in
shared memory (and have g = beta = 0), so they add nothing; only real rows are written.
The state entering a sequence's first chunk without an initial state, and dS' of its last
chunk without dfinal, are zero: such a tile is not loaded, and the products that read it
(Kn S, dO S^T, Delta dS'^T, diag(d) Kn dS'^T, <S, dS'>) are not issued: a one-chunk
sequence's chunk does about half a middle chunk's tensor work. (dBk = -(T^T dDelta) S^T
still runs, on a zero S written into shared memory: skipping it too made ptxas spill, or
serialize every wgmma where only S can be zero.) Every sum inside the kernel runs in a
fixed order, and the pairs' adds commute: the results are bitwise reproducible.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .attention_sm90 import (acc_as_operand_a, load_ldmatrix, select_modes, store_stmatrix,
                             tma_load_tile, tma_store_tile, transposed, wgmma)
from .gdn_chunk_sm90 import L2NORM_EPS, GdnChunkPrepareSm90, block_chunk_head, chunk_grid
from .gdn_layout import CHUNK, gradients_added, gradients_in_place, head_groups
from .gdn_unpack_sm90 import one_bits, split_packed, zero_t_upper

WGS = 2  # warpgroup 0: the q side; warpgroup 1: the WY side
THREADS = 128 * WGS
WARPS = THREADS // 32
# named barriers (0 is sync_threads)
WG_BARRIER = (1, 2)
# mbarriers: the two load groups, then the warpgroups' signals to each other (all 128
# threads of one arrive; mbarrier arrive/wait order the shared-memory accesses around them)
(FIRST_LOADS, REST_LOADS, Z_READY, STATES_FREE, DK_READY, LATE_LOADS, QK_LOADS, M_READ,
 M_READY) = range(9)
# QK_LOADS: Q and K, issued first: the warpgroups normalize their rows (warpgroup 0 Q,
# warpgroup 1 K, then the gate scan) while S, V and T, the operands of Delta, are on their
# way (FIRST_LOADS)
# LATE_LOADS: dS', which no side needs before its second step
# Z_READY: warpgroup 1 wrote Z = diag(beta) (V - diag(gamma) Kn S) (into sZ), so
# warpgroup 0 may compute Delta = T Z; STATES_FREE: warpgroup 0 read S and dS', so
# warpgroup 1's dk terms may go there; DK_READY: they are there; M_READ:
# warpgroup 1's M^T dO (dDelta) has read M, so warpgroup 0's dQK may go over it;
# M_READY: warpgroup 0 has split work16's packed P (loaded into sM, QK_LOADS) into T
# (sT) and M (sM in place), so warpgroup 1 may read M
# per-token values in shared memory (rows of sRows): G, beta, the row scales r_q, r_k and
# whether the L2 norm's projection term applies (0 where the norm's clamp is active)
R_G, R_BETA, R_Q, R_K, R_QP, R_KP = range(6)
ROW_VALUES = 6
# warpgroup 0's per-warp partial sums: <S, dS'> in slots 0..3, sum_i d_i rowsum_i in 4..7
REDUCE_SLOTS = 8


# Element e of a thread's (64, N) warpgroup accumulator (see row_context): which of its two
# rows, and in a 64-wide tile which of its 16 column slots.
def row_half(e: int) -> int:
    return (e // 2) % 2


def col_slot(e: int) -> int:
    return (e // 4) * 2 + e % 2


def stage0(t):
    """The (rows, cols) tile of a one-stage shared-memory buffer."""
    return t[None, None, 0]


def stage0_t(t, rows: int, cols: int):
    """That tile read transposed (attention_sm90.transposed)."""
    return transposed(t, rows, cols)[None, None, 0]


class GdnChunkGradSm90(GdnChunkPrepareSm90):
    """Reuses stage 1's chunk lookup (find_chunk) and gate loading (load_gates,
    cumulative_gates)."""

    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, l2norm: bool, g_dtype, beta_dtype, initial_state: bool = True,
                 final_grad: bool = True):
        """initial_state / final_grad: whether the forward had an initial state / the
        backward a final state's gradient. Without one, the state entering a sequence's
        first chunk (without the other, dS' of its last chunk) is zero: the tile is not
        loaded and (but for dBk's) the products that read it are not issued, and the
        recurrences need not write it (in a one-chunk sequence they do not)."""
        super().__init__(dtype, k_dim, v_dim, q_heads, k_heads, v_heads, l2norm, g_dtype,
                         beta_dtype)
        self.zero_first_state, self.zero_last_dstate = not initial_state, not final_grad
        # dq, dk, dv: final here where that input has at most two output heads per head
        # (the L2 norm's Jacobian applied, in the io dtype); otherwise the normalized rows'
        # gradients per output head (io dtype), for gdn_bwd_finish_sm90.
        self.final_outputs = gradients_in_place(q_heads, k_heads, v_heads)
        # of those, the ones added into the input's gradient (two output heads per input
        # head) and, for each of dq, dk, dv, output heads per head of the tensor written
        self.added_outputs = gradients_added(q_heads, k_heads, v_heads)
        self.out_groups = tuple(g if final else 1 for g, final in zip(
            head_groups(q_heads, k_heads, v_heads), self.final_outputs))

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mG: cute.Tensor,
                 mBeta: cute.Tensor, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor,
                 mDO: cute.Tensor, mWork16: cute.Tensor, mWork32: cute.Tensor,
                 mStates: cute.Tensor, mDStates: cute.Tensor,
                 mDQ: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor, mDG: cute.Tensor,
                 mDBeta: cute.Tensor, scale: Float32, stream: cuda.CUstream):
        """mQ (T, HQ, K), mK (T, HK, K), mV (T, HV, V), mDO (T, HO, V); mG, mBeta, mDG,
        mDBeta (T, HO); mSeqTable: gdn_seq_table_sm90's table (or cu_seqlens: none);
        mWork16 / mWork32 as gdn_layout.workspace_shapes (packed P); mStates, mDStates
        (chunks, HO, V, K);
        mDQ, mDK, mDV: each the final gradient in the io dtype (strided like its input) where
        gdn_layout.gradients_in_place says so (zeroed before where gradients_added says so:
        this kernel adds into it), else (T, HO, K or V) per output head, io dtype as
        well."""
        dt = self.dtype
        K, V, C = self.k_dim, self.v_dim, CHUNK

        def tile(rows, cols):  # a (rows, cols) 16-bit tile, cols contiguous
            return sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (C, rows, cols), dt, 1)
        lay_k, lay_v, lay_c, lay_s = tile(C, K), tile(C, V), tile(C, C), tile(V, K)
        one = lambda layout: cute.slice_(layout, (None, None, 0))  # noqa: E731
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tok = lambda m: select_modes(m, [0, 2, 1])  # noqa: E731  (T, D, H)
        blk = lambda m: select_modes(m, [2, 3, 1, 0])  # noqa: E731  (rows, cols, HO, chunks)
        loads = (
            cpasync.make_tiled_tma_atom(g2s, tok(mQ), one(lay_k), (C, K)),
            cpasync.make_tiled_tma_atom(g2s, tok(mK), one(lay_k), (C, K)),
            cpasync.make_tiled_tma_atom(g2s, tok(mV), one(lay_v), (C, V)),
            cpasync.make_tiled_tma_atom(g2s, tok(mDO), one(lay_v), (C, V)),
            cpasync.make_tiled_tma_atom(g2s, blk(mWork16), one(lay_c), (C, C)),  # P
            cpasync.make_tiled_tma_atom(g2s, blk(mStates), one(lay_s), (V, K)),
            cpasync.make_tiled_tma_atom(g2s, blk(mDStates), one(lay_s), (V, K)))
        size = lambda layout: cute.size_in_bytes(dt, one(layout))  # noqa: E731
        # Q, K (the row normalization) and P (T and M), then S, V, then dO, dS' last
        self.qk_bytes = 2 * size(lay_k) + size(lay_c)
        self.first_bytes = size(lay_s) + size(lay_v)
        self.rest_bytes = size(lay_v)
        self.late_bytes = size(lay_s)
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN

        rmem = warpgroup.OperandSource.RMEM

        def mma(a, b, n, a_source=warpgroup.OperandSource.SMEM):  # (64, n), one warpgroup
            return sm90_utils.make_trivial_tiled_mma(dt, dt, a, b, Float32, (1, 1, 1), (C, n),
                                                     a_source)
        mmas = (mma(k_major, k_major, V), mma(k_major, k_major, C), mma(k_major, mn_major, K),
                mma(mn_major, mn_major, K), mma(mn_major, mn_major, V),
                # A from registers: diag(d) Kn (scaled after ldmatrix) for dDelta, then
                # T^T dDelta for dA and dBk
                mma(k_major, k_major, V, rmem), mma(k_major, mn_major, K, rmem),
                mma(k_major, k_major, C, rmem),
                mma(k_major, mn_major, V))  # Delta = T Z

        @cute.struct
        class SharedStorage:
            bars: cute.struct.MemRange[cutlass.Int64, 9]
            rows: cute.struct.MemRange[Float32, ROW_VALUES * C]
            dg: cute.struct.MemRange[Float32, WGS * C]
            dbeta: cute.struct.MemRange[Float32, WGS * C]
            reduce: cute.struct.MemRange[Float32, REDUCE_SLOTS]
            col_e: cute.struct.MemRange[Float32, WARPS * C]  # E's column sums per warp
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_k)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_k)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_v)], 1024]
            sDO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_v)], 1024]
            sZ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_v)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_v)], 1024]
            sM: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_c)], 1024]
            sT: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_c)], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_s)], 1024]
            sDS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_s)], 1024]
            sDD: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_v)], 1024]
            # warpgroup 1's dP
            sWY: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(lay_c)], 1024]

        self.storage = SharedStorage
        chunks = mWork32.shape[0]
        num_batches = mCuSeqlens.shape[0] - 1
        # Whole chunks of a gradient (final or per output head, both 16-bit) leave by TMA
        # stores of a shared-memory tile (per-thread stores of accumulator pairs wrote
        # half-filled sectors).
        out_stores = tuple(
            cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp() if const_expr(added)
                else cpasync.CopyBulkTensorTileS2GOp(), tok(m), one(lay), (C, cols))
            for m, lay, cols, added in ((mDQ, lay_k, K, self.added_outputs[0]),
                                        (mDK, lay_k, K, self.added_outputs[1]),
                                        (mDV, lay_v, V, self.added_outputs[2])))
        self.kernel(mmas, loads, (lay_k, lay_v, lay_c, lay_s), mG, mBeta, mCuSeqlens,
                    mSeqTable, mDQ, mDK, mDV, mDG, mDBeta, out_stores, num_batches, scale).launch(
            grid=chunk_grid(chunks, self.heads), block=[THREADS, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mmas: tuple, loads: tuple, layouts: tuple, mG: cute.Tensor,
               mBeta: cute.Tensor, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor,
               mDQ: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor, mDG: cute.Tensor,
               mDBeta: cute.Tensor,
               out_stores: tuple, num_batches: Int32, scale: Float32):
        C = CHUNK
        tidx, _, _ = cute.arch.thread_idx()
        packed, head = block_chunk_head()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        batch, chunk = self.find_chunk(packed, mCuSeqlens, num_batches, mSeqTable)
        if batch < num_batches:
            lay_k, lay_v, lay_c, lay_s = layouts
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.storage)
            tiles = tuple(s.get_tensor(layout.outer, swizzle=layout.inner) for s, layout in (
                (storage.sQ, lay_k), (storage.sK, lay_k), (storage.sV, lay_v),
                (storage.sDO, lay_v), (storage.sZ, lay_v), (storage.sU, lay_v),
                (storage.sM, lay_c), (storage.sT, lay_c), (storage.sS, lay_s),
                (storage.sDS, lay_s), (storage.sDD, lay_v)))
            sRows = storage.rows.get_tensor(cute.make_layout((ROW_VALUES, C), stride=(C, 1)))
            bars = storage.bars.data_ptr()
            start = mCuSeqlens[batch]
            first = start + chunk * C
            left = mCuSeqlens[batch + 1] - first  # tokens from this chunk's first on
            rows = cutlass.min(left, C)
            if tidx == 0:
                cute.arch.mbarrier_init(bars + FIRST_LOADS, 1)
                cute.arch.mbarrier_init(bars + REST_LOADS, 1)
                cute.arch.mbarrier_init(bars + Z_READY, 128)
                cute.arch.mbarrier_init(bars + STATES_FREE, 128)
                cute.arch.mbarrier_init(bars + DK_READY, 128)
                cute.arch.mbarrier_init(bars + LATE_LOADS, 1)
                cute.arch.mbarrier_init(bars + QK_LOADS, 1)
                cute.arch.mbarrier_init(bars + M_READ, 128)
                cute.arch.mbarrier_init(bars + M_READY, 128)
            cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            # S of a sequence's first chunk without an initial state and dS' of its last
            # without dfinal are zero: 1 where this chunk's is (not loaded; the products
            # that read it are not issued, but for dBk on a zero-filled S), None where the
            # configuration rules it out (no branch is made)
            zero_s, zero_ds = None, None
            if const_expr(self.zero_first_state):
                zero_s = cutlass.select_(chunk == 0, Int32(1), Int32(0))
            if const_expr(self.zero_last_dstate):
                zero_ds = cutlass.select_(left <= C, Int32(1), Int32(0))
            zeros = (zero_s, zero_ds)
            if warp == 0:
                self.load_all(loads, tiles, storage.sS, bars, start, chunk, packed, head,
                              zeros)
            # by warpgroup 1 (its threads 0..63), which scans them
            self.load_gates(mG, mBeta, sRows[R_G, None], sRows[R_BETA, None], first, rows,
                            head, (tidx + 128) % THREADS)
            staged = self.staged_outputs(out_stores, tiles, storage, lay_k)
            self.gradients(mmas, tiles, layouts, storage, sRows, bars, mDQ, mDK, mDV, mDG,
                           mDBeta, staged, zeros, first, rows, head, scale, tidx)
            if warp % 4 == 0:  # the issuers' output stores have read shared memory
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    def staged_outputs(self, out_stores, tiles, storage, lay_k):
        """For dq, dk, dv: (TMA atom, its (T, D, H) view of the gradient, the shared-memory
        tile a whole chunk leaves from), or None without such a tile. dk and dv
        overwrite K and V (each thread its own elements, after reading them; nothing reads
        them later), dq the dO tile (free once dO S^T is done; too small when K > V)."""
        sK, sV, sDO = tiles[1:4]
        sDQ = None
        if const_expr(cute.cosize(lay_k) <= cute.cosize(sDO.layout)):
            sDQ = cute.make_tensor(cute.recast_ptr(storage.sDO.data_ptr(),
                                                   swizzle_=lay_k.inner, dtype=self.dtype),
                                   lay_k.outer)
        out = []
        for store, tile in zip(out_stores, (sDQ, sK, sV)):
            out.append(None if const_expr(tile is None)
                       else (store[0], store[1], tile))
        return tuple(out)

    @cute.jit
    def load_all(self, loads, tiles, s_buffer, bars, start: Int32, chunk: Int32,
                 packed: Int32, head: Int32, zeros):
        """Warp 0: the chunk's tiles by TMA, issued in the order of the barriers they
        arrive on: Q, K, P (QK_LOADS; P into sM), S, V (FIRST_LOADS), dO (REST_LOADS),
        dS' (LATE_LOADS). A zero S or dS' (``zeros``, kernel) is not loaded: its barrier
        expects that many bytes fewer. Nothing reads a zero dS'; a zero S is written here
        (``s_buffer``: its memory) before its barrier's arrival, which publishes it, for
        the one product that still reads it (dBk)."""
        K, V, C = self.k_dim, self.v_dim, CHUNK
        sQ, sK, sV, sDO, sZ, sU, sM, sT, sS, sDS, sDD = tiles
        lq, lk, lv, ldo, lw, ls, lds = loads  # lw: work16's packed 64 x 64 block
        zero_s, zero_ds = (Int32(0) if const_expr(z is None) else z for z in zeros)

        def token_tile(atom, m, s, h, cols, bar):  # rows [start + 64 chunk, +64) of head h
            g = cute.local_tile(cute.domain_offset((start, 0), m[None, None, h]), (C, cols),
                                (chunk, 0))
            tma_load_tile(atom, g, s, 0, bars + bar)

        def block_tile(atom, m, s, bar):  # this (chunk, head)'s whole row block
            tma_load_tile(atom, m[None, None, head, packed], s, 0, bars + bar)

        if const_expr(all(z is None for z in zeros)):
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bars + QK_LOADS, self.qk_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + FIRST_LOADS, self.first_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + REST_LOADS, self.rest_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + LATE_LOADS, self.late_bytes)
            token_tile(*lq, sQ, head // self.q_group, K, QK_LOADS)
            token_tile(*lk, sK, head // self.k_group, K, QK_LOADS)
            block_tile(*lw, sM, QK_LOADS)
            block_tile(*ls, sS, FIRST_LOADS)
            token_tile(*lv, sV, head // self.v_group, V, FIRST_LOADS)
            token_tile(*ldo, sDO, head, V, REST_LOADS)
            block_tile(*lds, sDS, LATE_LOADS)
        else:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bars + QK_LOADS, self.qk_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(bars + REST_LOADS, self.rest_bytes)
                cute.arch.mbarrier_arrive_and_expect_tx(
                    bars + LATE_LOADS, self.late_bytes - zero_ds * self.late_bytes)
            token_tile(*lq, sQ, head // self.q_group, K, QK_LOADS)
            token_tile(*lk, sK, head // self.k_group, K, QK_LOADS)
            block_tile(*lw, sM, QK_LOADS)
            if zero_s == 1:
                self.zero_tile(s_buffer)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    bars + FIRST_LOADS, self.first_bytes - zero_s * self.late_bytes)
            if zero_s == 0:  # (no closure may be called under a dynamic branch)
                tma_load_tile(ls[0], ls[1][None, None, head, packed], sS, 0, bars + FIRST_LOADS)
            token_tile(*lv, sV, head // self.v_group, V, FIRST_LOADS)
            token_tile(*ldo, sDO, head, V, REST_LOADS)
            if zero_ds == 0:
                tma_load_tile(lds[0], lds[1][None, None, head, packed], sDS, 0,
                              bars + LATE_LOADS)

    @cute.jit
    def zero_tile(self, buffer):
        """A (V x K) 16-bit state tile's memory (``buffer``: its struct field) zeroed by
        the calling warp, 16 bytes a store, then fenced for the tensor cores (the caller's
        mbarrier arrival publishes it to the other warps)."""
        vectors = self.v_dim * self.k_dim // 8
        flat = buffer.get_tensor(cute.make_layout((8, vectors), stride=(1, 8)))
        zeros = cute.make_rmem_tensor(cute.make_layout((8,)), self.dtype)
        zeros.fill(0.0)
        lane = cute.arch.lane_idx()
        for i in cutlass.range(lane, vectors, cute.arch.WARP_SIZE, unroll=4):
            cute.autovec_copy(zeros, flat[None, i])
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()

    @cute.jit
    def zero_tail(self, tiles, rows: Int32, tidx: Int32, threads: int):
        """Rows past the sequence end (the next sequence's tokens, or TMA's zero fill) of
        the given token tiles: zeros, so that they reach no real row's gradient."""
        C = CHUNK
        for t in tiles:
            cols = cute.size(t, mode=[1])
            for idx in cutlass.range(tidx, C * cols, threads, unroll=1):
                if idx // cols >= rows:
                    t[idx // cols, idx % cols, 0] = self.dtype(0.0)

    @cute.jit
    def normalize_tile(self, s, sRows, r_slot: int, wg: int, bars, rows: Int32, wtidx: Int32):
        """One warpgroup, on its own tile (warpgroup 0: Q, 1: K) once Q and K have landed:
        tail rows zeroed (a partial chunk); the row scales into sRows[r_slot] (rsqrt of the
        clamped squared norms with the L2 norm, else ones) and, with the L2 norm, whether
        its projection applies (not where the clamp is active) into the matching
        projection slot; then the rows scaled in place. 16-byte accesses, two threads per
        row for the norms. Ends with its writes fenced for the tensor cores (the CTA
        barrier after publishes them)."""
        K, C = self.k_dim, CHUNK
        cute.arch.mbarrier_wait(bars + QK_LOADS, 0)
        if rows < C:
            self.zero_tail((s,), rows, wtidx, 128)
        self.wg_sync(wg)  # the tails (and, on warpgroup 1, g and beta) written
        if const_expr(self.l2norm):
            vecs = K // 8
            row = wtidx // 2
            x8 = cute.make_rmem_tensor(cute.make_layout((1, 8)), self.dtype)
            part = [Float32(0.0)] * 8  # no chain of K / 2 dependent adds
            for v in cutlass.range_constexpr(vecs // 2):
                cute.autovec_copy(cute.local_tile(stage0(s), (1, 8),
                                                  (row, (wtidx % 2) * (vecs // 2) + v)), x8)
                for u in cutlass.range_constexpr(8):
                    part[u] = part[u] + x8[u].to(Float32) * x8[u].to(Float32)
            acc = ((part[0] + part[1]) + (part[2] + part[3])) + (
                (part[4] + part[5]) + (part[6] + part[7]))
            acc = acc + cute.arch.shuffle_sync_bfly(acc, 1)
            if wtidx % 2 == 0:
                sRows[r_slot, row] = cute.math.rsqrt(cutlass.max(acc, Float32(L2NORM_EPS)))
                sRows[r_slot + R_QP - R_Q, row] = cutlass.select_(
                    acc < Float32(L2NORM_EPS), Float32(0.0), Float32(1.0))
            self.wg_sync(wg)
            for idx in cutlass.range(wtidx, C * vecs, 128, unroll=4):
                r = idx // vecs
                self.scale_vector(s, r, idx - r * vecs, sRows[r_slot, r], x8)
        else:
            if wtidx < C:
                sRows[r_slot, wtidx] = Float32(1.0)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def scale_vector(self, s, row: Int32, v: Int32, factor: Float32, x8):
        """Elements [8 v, 8 v + 8) of row ``row`` of the 16-bit tile ``s`` times factor."""
        tile = cute.local_tile(stage0(s), (1, 8), (row, v))
        cute.autovec_copy(tile, x8)
        for u in cutlass.range_constexpr(8):
            x8[u] = (x8[u].to(Float32) * factor).to(self.dtype)
        cute.autovec_copy(x8, tile)

    @cute.jit
    def gradients(self, mmas, tiles, layouts, storage, sRows, bars, mDQ, mDK, mDV, mDG,
                  mDBeta, staged, zeros, first: Int32, rows: Int32, head: Int32,
                  scale: Float32, tidx: Int32):
        """Every product and reduction of the chunk (module docstring), the q side on
        warpgroup 0 and the WY side on warpgroup 1, then dg and dbeta from both. A product
        that reads a zero S or dS' (``zeros``, kernel) is not issued: its result is zeros
        (or nothing is added)."""
        C, V = CHUNK, self.v_dim
        wg = tidx // 128
        sDG = storage.dg.get_tensor(cute.make_layout((WGS, C), stride=(C, 1)))
        sDB = storage.dbeta.get_tensor(cute.make_layout((WGS, C), stride=(C, 1)))
        # dk's accumulator, one for both sides: warpgroup 1's terms go through shared
        # memory to warpgroup 0, which adds them after the second CTA barrier below
        acc_dk = cute.make_rmem_tensor(
            mmas[2].get_slice(tidx % 128).partition_shape_C((C, self.k_dim)), Float32)
        # Q, K and P land first: each warpgroup normalizes one of Q and K while S and V are
        # on their way; warpgroup 0 splits P into T and M, warpgroup 1 scans the gates, makes
        # Z (delta_rhs) and issues dDelta's M^T dO, while warpgroup 0 turns Z into
        # Delta = T Z (into sU); before Z is made, warpgroup 0 issues dq's first product
        # dO S^T. Rows of a partial chunk past the sequence end: warpgroup 0 zeroes dO's
        # (before its dO S^T and warpgroup 1's M^T dO read it) and V's (once Z, which reads
        # them times beta = 0, is made).
        if wg == 0:
            self.normalize_tile(tiles[0], sRows, R_Q, 0, bars, rows, tidx % 128)
            # P landed with Q (normalize_tile waited): T into sT, M over P in sM
            p_base, t_base = storage.sM.data_ptr().toint(), storage.sT.data_ptr().toint()
            warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
            split_packed(p_base, t_base, warp, 4, True, one_bits(self.dtype))
            zero_t_upper(t_base, warp, 4)
            cute.arch.mbarrier_wait(bars + FIRST_LOADS, 0)  # S, V (V's tail is zeroed below)
            cute.arch.mbarrier_wait(bars + REST_LOADS, 0)  # dO
            if rows < C:
                self.zero_tail((tiles[3],), rows, tidx, 128)
            # T (Delta's wgmma), M (warpgroup 1's) and dO's zeros (both sides') made
            self.wg_sync(0, fence=True)
            cute.arch.mbarrier_arrive(bars + M_READY)
            # dq's first product, dO S^T, while warpgroup 1 makes Z (delta waits for it)
            mma_kmn_k = mmas[2]
            acc_k = cute.make_rmem_tensor(
                mma_kmn_k.get_slice(tidx % 128).partition_shape_C((C, self.k_dim)), Float32)
            self.product_unless(zeros[0], mma_kmn_k, acc_k, stage0(tiles[3]),
                                stage0_t(tiles[8], self.v_dim, self.k_dim))
            cute.arch.mbarrier_wait(bars + Z_READY, 0)
            self.delta(mmas[8], tiles, tidx % 128)
            if rows < C:
                self.zero_tail((tiles[2],), rows, tidx, 128)
            # Delta's (and V's zeros') generic-proxy stores, before wgmmas read them
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            self.q_side(mmas, tiles, storage, sRows, sDG, bars, mDQ, staged[0], acc_dk, acc_k,
                        zeros, first, rows, head, scale, tidx % 128)
        else:
            wtidx = tidx - 128
            self.normalize_tile(tiles[1], sRows, R_K, 1, bars, rows, wtidx)
            if wtidx < cute.arch.WARP_SIZE:
                self.cumulative_gates(sRows[R_G, None])
            self.wg_sync(1)  # G, and Kn (fenced by normalize_tile) for this warpgroup's wgmma
            cute.arch.mbarrier_wait(bars + FIRST_LOADS, 0)  # S, V
            self.delta_rhs(mmas[0], tiles, sRows, bars, zeros[0], rows, wtidx)
            cute.arch.mbarrier_wait(bars + REST_LOADS, 0)  # dO (this side's own wait on it)
            cute.arch.mbarrier_wait(bars + M_READY, 0)  # ... and dO's tail rows zeroed
            # dDelta's first term, M^T dO, while warpgroup 0 computes Delta
            mma_mnmn_v = mmas[4]  # (64, V), both operands MN-major
            thr_v = mma_mnmn_v.get_slice(wtidx)
            acc_v = cute.make_rmem_tensor(thr_v.partition_shape_C((C, V)), Float32)
            self.ss(mma_mnmn_v, acc_v, stage0_t(tiles[6], C, C), stage0_t(tiles[3], C, V),
                    False)
            cute.arch.sync_threads()
            self.wy_side(mmas, tiles, layouts, storage, sRows, sDG, sDB, bars, mDV, staged[2],
                         acc_dk, acc_v, zeros, first, rows, head, wtidx)
        # dG's partial sums are written (every thread meets this barrier at one instruction)
        cute.arch.sync_threads()
        if wg == 0:
            self.finish_dk(mmas, tiles, storage, sRows, bars, mDK, staged[1], acc_dk, first,
                           rows, head, tidx % 128)
        else:  # meanwhile warpgroup 1: dG's totals, then dg and dbeta
            wtidx = tidx - 128
            if wtidx < C:
                col_e = storage.col_e.get_tensor(cute.make_layout((WARPS, C), stride=(C, 1)))
                total = sDG[0, wtidx] + sDG[1, wtidx]
                for w in cutlass.range_constexpr(WARPS):
                    total = total - col_e[w, wtidx]
                if wtidx == C - 1:
                    red = storage.reduce.get_tensor(cute.make_layout(REDUCE_SLOTS))
                    states = Float32(0.0)
                    for w in cutlass.range_constexpr(4):
                        states = states + red[w]
                    gl = states * cute.math.exp(sRows[R_G, C - 1], fastmath=True)
                    for w in cutlass.range_constexpr(4):
                        gl = gl + red[4 + w]
                    total = total + gl
                sDG[0, wtidx] = total
            self.wg_sync(1)
            if wtidx < cute.arch.WARP_SIZE:  # dg = reverse cumsum of dG; past the end skipped
                self.write_gate_grads(sDG[0, None], sDB[1, None], mDG, mDBeta, first, rows,
                                      head)

    def row_context(self, sRows, wtidx):
        """This thread's accumulator rows (row_lo, row_lo + 8), its 16 columns of a 64-wide
        tile and per-row values: element e is row rows_of[row_half(e)] and, in a 64-wide
        tile, column cols_of[col_slot(e)]."""
        C = CHUNK
        lane = wtidx % 32
        row_lo = 16 * (wtidx // 32) + lane // 4
        rows_of = [row_lo, row_lo + 8]
        cols_of = [2 * (lane % 4) + 8 * (slot // 2) + slot % 2 for slot in range(C // 4)]
        g_last = sRows[R_G, C - 1]
        g_r = [sRows[R_G, i] for i in rows_of]
        return dict(rows_of=rows_of, cols_of=cols_of, g_r=g_r,
                    eg_r=[cute.math.exp(x, fastmath=True) for x in g_r],
                    d_r=[cute.math.exp(g_last - x, fastmath=True) for x in g_r],
                    beta_r=[sRows[R_BETA, i] for i in rows_of],
                    leader=lane % 4 == 0)

    @cute.jit
    def delta_rhs(self, mma_kk_v, tiles, sRows, bars, zero_s, rows: Int32, wtidx: Int32):
        """Warpgroup 1: Z = diag(beta) (V - diag(gamma) Kn S) (16-bit) into sZ, for
        warpgroup 0's Delta = T Z (Z_READY once written and fenced). Rows past the sequence
        end are zeros (selected: V's rows there, the next sequence's, are not zeroed yet,
        and need not be finite)."""
        V, C = self.v_dim, CHUNK
        sK, sV, sZ, sS = tiles[1], tiles[2], tiles[4], tiles[8]
        thr = mma_kk_v.get_slice(wtidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((C, V)), Float32)
        self.product_unless(zero_s, mma_kk_v, acc, stage0(sK), stage0(sS))
        ctx = self.row_context(sRows, wtidx)
        warpgroup.wait_group(0)
        v = self.loaded(mma_kk_v, stage0(sV), acc)
        z16 = cute.make_rmem_tensor(acc.layout, self.dtype)
        real = [r < rows for r in ctx["rows_of"]]
        for e in cutlass.range_constexpr(cute.size(acc)):
            h = row_half(e)
            z = ctx["beta_r"][h] * (v[e].to(Float32) - self.unless_zero(
                zero_s, ctx["eg_r"][h] * acc[e]))
            z16[e] = Float32(cutlass.select_(real[h], z, Float32(0.0))).to(self.dtype)
        store_stmatrix(z16, mma_kk_v, stage0(sZ), wtidx)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(bars + Z_READY)

    @cute.jit
    def delta(self, mma_kmn_v, tiles, wtidx: Int32):
        """Warpgroup 0: Delta = T Z into sU (each thread its own elements)."""
        V, C = self.v_dim, CHUNK
        sZ, sU, sT = tiles[4], tiles[5], tiles[7]
        thr = mma_kmn_v.get_slice(wtidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((C, V)), Float32)
        self.ss(mma_kmn_v, acc, stage0(sT), stage0_t(sZ, C, V), False)
        warpgroup.wait_group(0)
        self.store_acc(acc, mma_kmn_v, stage0(sU), wtidx)

    @cute.jit
    def q_side(self, mmas, tiles, storage, sRows, sDG, bars, mDQ, staged_dq, acc_dk, acc_k,
               zeros, first: Int32, rows: Int32, head: Int32, scale: Float32, wtidx: Int32):
        """Warpgroup 0: dM' = tril(dO Delta^T), dQK = scale dM' Gamma (over M), E's first
        term; dq_n = diag(scale gamma) dO S^T + dQK Kn; <S, dS'>; dk_n's diag(d) Delta dS'^T
        and dQK^T Qn terms into ``acc_dk`` (finish_dk adds warpgroup 1's); dG's q-side
        terms. ``acc_k``: dO S^T, made before Delta."""
        K, V, C = self.k_dim, self.v_dim, CHUNK
        mma_kk_v, mma_kk_c, mma_kmn_k, mma_mnmn_k, mma_mnmn_v = mmas[:5]
        mma_rs_v, mma_rs_k, mma_rs_c = mmas[5:8]
        sQ, sK, sV, sDO, sZ, sU, sM, sT, sS, sDS, sDD = tiles
        ctx = self.row_context(sRows, wtidx)
        rows_of, cols_of, g_r, eg_r, d_r = (ctx[n] for n in ("rows_of", "cols_of", "g_r",
                                                             "eg_r", "d_r"))
        sDelta, sX = sU, sM
        dg_part = [Float32(0.0), Float32(0.0)]
        # ---- dM' = tril(dO Delta^T); dQK = scale dM' Gamma (over M); E = dM' * M
        thr_c = mma_kk_c.get_slice(wtidx)
        acc_c = cute.make_rmem_tensor(thr_c.partition_shape_C((C, C)), Float32)
        self.ss(mma_kk_c, acc_c, stage0(sDO), stage0(sDelta), False)
        g_c = [sRows[R_G, j] for j in cols_of]
        warpgroup.wait_group(0)
        e_cols = [Float32(0.0)] * len(cols_of)
        e_rows = [Float32(0.0), Float32(0.0)]
        m16 = self.loaded(mma_kk_c, stage0(sM), acc_c)
        for e in cutlass.range_constexpr(cute.size(acc_c)):
            h, sl = row_half(e), col_slot(e)
            seen = cols_of[sl] <= rows_of[h]
            gamma_ij = cute.math.exp(cutlass.select_(seen, g_r[h] - g_c[sl], Float32(0.0)),
                                     fastmath=True)
            dmp = cutlass.select_(seen, acc_c[e], Float32(0.0))
            x = dmp * m16[e].to(Float32)
            e_rows[h] = e_rows[h] + x
            e_cols[sl] = e_cols[sl] + x
            acc_c[e] = scale * dmp * gamma_ij
        # dQK: the A operand of dq's second product from registers; its copy in shared
        # memory (over M, once warpgroup 1 has read M) is dQK^T's, for dk
        dqk16 = cute.make_rmem_tensor(acc_c.layout, self.dtype)
        dqk16.store(acc_c.load().to(self.dtype))
        cute.arch.mbarrier_wait(bars + M_READ, 0)
        store_stmatrix(dqk16, mma_kk_c, stage0(sX), wtidx)
        self.flush_e(e_rows, e_cols, dg_part, storage)
        # ---- dq_n = diag(scale gamma) dO S^T + dQK Kn;  dG += scale gamma rowsum((dO S^T) Qn)
        part = self.row_dots_then_scale(acc_k, mma_kmn_k, stage0(sQ), [scale * x for x in eg_r])
        for h in cutlass.range_constexpr(2):
            dg_part[h] = dg_part[h] + self.unless_zero(zeros[0], part[h] * scale * eg_r[h])
        self.rs(mma_rs_k, acc_k, dqk16, stage0_t(sK, C, K), self.made(zeros[0]))
        # ---- dk_n = diag(d) Delta dS'^T + dQK^T Qn + (warpgroup 1's terms, finish_dk): its
        # first product runs while dq is finished and stored
        cute.arch.mbarrier_wait(bars + LATE_LOADS, 0)  # dS'
        self.product_unless(zeros[1], mma_kmn_k, acc_dk, stage0(sDelta),
                            stage0_t(sDS, V, K))
        self.state_dot(sS, sDS, storage, zeros, wtidx)
        if const_expr(zeros[1] is None):
            warpgroup.wait_group(1)  # dQK Kn
        else:
            if zeros[1] == 1:  # (the dS' product was not issued)
                warpgroup.wait_group(0)
            else:
                warpgroup.wait_group(1)
        self.store_grad(mma_kmn_k, mDQ, acc_k, stage0(sQ), R_Q, 0, sRows, rows_of, first,
                        rows, head, staged_dq, 0)
        warpgroup.wait_group(0)  # diag(d) Delta dS'^T
        # S and dS' are read (by this warpgroup; warpgroup 1 reads neither)
        cute.arch.mbarrier_arrive(bars + STATES_FREE)
        part = self.row_dots_then_scale(acc_dk, mma_kmn_k, stage0(sK), d_r)
        dd_sum = Float32(0.0)  # sum of dd over this thread's rows (leaders only count)
        for h in cutlass.range_constexpr(2):
            dd = self.unless_zero(zeros[1], part[h] * d_r[h])
            dg_part[h] = dg_part[h] - dd
            dd_sum = dd_sum + dd
        self.warp_reduce_to(storage, 4 + wtidx // 32,
                            cutlass.select_(ctx["leader"], dd_sum, Float32(0.0)))
        self.wg_sync(0, fence=True)  # dQK's shared copy written (dq took it from registers)
        self.ss(mma_mnmn_k, acc_dk, stage0_t(sX, C, C), stage0_t(sQ, C, K),
                self.made(zeros[1]))
        if ctx["leader"]:
            for h in cutlass.range_constexpr(2):
                sDG[0, rows_of[h]] = dg_part[h]
        warpgroup.wait_group(0)

    @cute.jit
    def finish_dk(self, mmas, tiles, storage, sRows, bars, mDK, staged_dk, acc_dk,
                  first: Int32, rows: Int32, head: Int32, wtidx: Int32):
        """Warpgroup 0: warpgroup 1's dk terms (shared memory, DK_READY) added to its own,
        then dk stored. (The CTA barrier before already orders them; the mbarrier states the
        hand-off in the form compute-sanitizer racecheck follows: through a CTA or named
        barrier alone it reported hazards.)"""
        cute.arch.mbarrier_wait(bars + DK_READY, 0)
        dk_wy = self.dk_exchange(storage, acc_dk)
        for e in cutlass.range_constexpr(cute.size(acc_dk)):
            acc_dk[e] = acc_dk[e] + dk_wy[e * 128 + wtidx]
        self.store_grad(mmas[2], mDK, acc_dk, stage0(tiles[1]), R_K, 1, sRows,
                        self.row_context(sRows, wtidx)["rows_of"], first, rows, head,
                        staged_dk, 0)

    @cute.jit
    def wy_side(self, mmas, tiles, layouts, storage, sRows, sDG, sDB, bars, mDV, staged_dv,
                acc_dk, acc_v, zeros, first: Int32, rows: Int32, head: Int32, wtidx: Int32):
        """Warpgroup 1: dDelta = M^T dO (issued by the caller into ``acc_v``) + diag(d) Kn
        dS'^T; dv = diag(beta) T^T dDelta; dA = strict_tril(-(T^T dDelta) Delta^T);
        dBk = -(T^T dDelta) S^T; dP = diag(beta) (dA Gamma), E's
        second term; dk_n's diag(beta gamma) dBk + dP Kn + dP^T Kn (to warpgroup 0 through
        shared memory); dbeta and dG's WY-side terms."""
        K, V, C = self.k_dim, self.v_dim, CHUNK
        dt = self.dtype
        mma_kk_v, mma_kk_c, mma_kmn_k, mma_mnmn_k, mma_mnmn_v = mmas[:5]
        mma_rs_v, mma_rs_k, mma_rs_c = mmas[5:8]
        sQ, sK, sV, sDO, sZ, sU, sM, sT, sS, sDS, sDD = tiles
        lay_c = layouts[2]
        ctx = self.row_context(sRows, wtidx)
        rows_of, cols_of, g_r, eg_r, beta_r = (ctx[n] for n in ("rows_of", "cols_of", "g_r",
                                                                "eg_r", "beta_r"))
        sP = cute.make_tensor(cute.recast_ptr(storage.sWY.data_ptr(), swizzle_=lay_c.inner,
                                              dtype=dt), lay_c.outer)
        dg_part = [Float32(0.0), Float32(0.0)]
        db_part = [Float32(0.0), Float32(0.0)]
        # ---- dDelta = M^T dO (issued before the CTA barrier, in acc_v) + diag(d) Kn dS'^T;
        # once M^T dO has read M, warpgroup 0 may write dQK over it (M_READ). Its 16-bit
        # copy goes to shared memory (sDD) for dv's product, which takes it as the B
        # operand.
        if const_expr(zeros[1] is None):
            self.ddelta_state_term(mmas, tiles, bars, acc_dk, acc_v, ctx["d_r"])
        else:
            if zeros[1] == 1:  # no dS' term
                warpgroup.wait_group(0)
                cute.arch.mbarrier_arrive(bars + M_READ)
            else:
                self.ddelta_state_term(mmas, tiles, bars, acc_dk, acc_v, ctx["d_r"])
        warpgroup.wait_group(0)
        dd16 = cute.make_rmem_tensor(acc_v.layout, dt)
        dd16.store(acc_v.load().to(dt))
        store_stmatrix(dd16, mma_mnmn_v, stage0(sDD), wtidx)
        self.wg_sync(1, fence=True)  # dDelta written
        # ---- dv = diag(beta) T^T dDelta;  dbeta += rowsum(T^T dDelta * V)
        self.ss(mma_mnmn_v, acc_v, stage0_t(sT, C, C), stage0_t(sDD, C, V), False)
        warpgroup.wait_group(0)
        # ---- dA and dBk, both from T^T dDelta in registers: with Z's definition
        # dT = dDelta V^T diag(beta) + dW Kn^T diag(beta gamma) = dDelta Z^T (dW =
        # -dDelta S^T, Z = diag(beta) (V - diag(gamma) Kn S)), so (T^T dT) T^T =
        # (T^T dDelta) (T Z)^T = (T^T dDelta) Delta^T, and dBk = T^T dW = -(T^T dDelta) S^T
        # (acc_dk holds -dBk until scaled): neither dW nor dT nor T^T dT is formed
        tdd16 = cute.make_rmem_tensor(acc_v.layout, dt)
        tdd16.store(acc_v.load().to(dt))
        thr_c = mma_rs_c.get_slice(wtidx)
        acc_da = cute.make_rmem_tensor(thr_c.partition_shape_C((C, C)), Float32)  # dA, then dP
        self.rs(mma_rs_c, acc_da, tdd16, stage0(sU), False)  # dA before tril and sign
        acc_c = cute.make_rmem_tensor(acc_da.layout, Float32)
        self.ss(mma_kk_c, acc_c, stage0(sK), stage0(sK), False)  # P = Kn Kn^T
        # (issued on a zero S too, zeroed for it by load_all: skipping it made ptxas spill)
        self.rs(mma_rs_k, acc_dk, tdd16, stage0_t(sS, V, K), False)
        part = self.row_dots_then_scale(acc_v, mma_mnmn_v, stage0(sV), beta_r)
        for h in cutlass.range_constexpr(2):
            db_part[h] = db_part[h] + part[h]
        self.store_out(mma_mnmn_v, mDV, acc_v, rows_of, first, rows, head, staged_dv, 2, 1)
        g_c = [sRows[R_G, j] for j in cols_of]
        warpgroup.wait_group(0)  # dA's product, P and dBk (T^T dDelta's registers free)
        # ---- dP = diag(beta) (dA Gamma) (into sP); dbeta += rowsum(dA Gamma P); E = dP P
        e_cols = [Float32(0.0)] * len(cols_of)
        e_rows = [Float32(0.0), Float32(0.0)]
        part = [Float32(0.0), Float32(0.0)]
        for e in cutlass.range_constexpr(cute.size(acc_c)):
            h, sl = row_half(e), col_slot(e)
            below = cols_of[sl] < rows_of[h]
            gamma_ij = cute.math.exp(cutlass.select_(below, g_r[h] - g_c[sl], Float32(0.0)),
                                     fastmath=True)
            da_g = cutlass.select_(below, -acc_da[e], Float32(0.0)) * gamma_ij
            part[h] = part[h] + da_g * acc_c[e]
            dp = beta_r[h] * da_g
            e_rows[h] = e_rows[h] + dp * acc_c[e]
            e_cols[sl] = e_cols[sl] + dp * acc_c[e]
            acc_da[e] = dp
        part = self.quad_sums(part)
        for h in cutlass.range_constexpr(2):
            db_part[h] = db_part[h] + part[h]
        self.store_acc(acc_da, mma_kk_c, stage0(sP), wtidx)
        self.flush_e(e_rows, e_cols, dg_part, storage)
        # ---- dk_n = diag(beta gamma) dBk ...; t = rowsum(dBk Kn)
        part = self.row_dots_then_scale(acc_dk, mma_kmn_k, stage0(sK),
                                        [-b * x for b, x in zip(beta_r, eg_r)])
        for h in cutlass.range_constexpr(2):
            t_i = -part[h] * eg_r[h]
            db_part[h] = db_part[h] + t_i
            dg_part[h] = dg_part[h] + t_i * beta_r[h]
        self.wg_sync(1, fence=True)  # dP written
        # ---- dk_n += dP Kn + dP^T Kn, to warpgroup 0 (over S, once it is free)
        self.ss(mma_kmn_k, acc_dk, stage0(sP), stage0_t(sK, C, K), True)
        self.ss(mma_mnmn_k, acc_dk, stage0_t(sP, C, C), stage0_t(sK, C, K), True)
        if ctx["leader"]:
            for h in cutlass.range_constexpr(2):
                sDG[1, rows_of[h]] = dg_part[h]
                sDB[1, rows_of[h]] = db_part[h]
        warpgroup.wait_group(0)
        cute.arch.mbarrier_wait(bars + STATES_FREE, 0)
        dk_wy = self.dk_exchange(storage, acc_dk)
        for e in cutlass.range_constexpr(cute.size(acc_dk)):
            dk_wy[e * 128 + wtidx] = acc_dk[e]
        cute.arch.mbarrier_arrive(bars + DK_READY)

    @cute.jit
    def ddelta_state_term(self, mmas, tiles, bars, acc_dk, acc_v, d_r):
        """Warpgroup 1: diag(d) Kn dS'^T added to M^T dO (in ``acc_v``, waited for here;
        then M_READ), once dS' has landed (not waited for)."""
        mma_kmn_k, mma_rs_v = mmas[2], mmas[5]
        sK, sDS = tiles[1], tiles[9]
        kd = self.loaded(mma_kmn_k, stage0(sK), acc_dk)  # (acc_dk: for its (64, K) layout)
        for e in cutlass.range_constexpr(cute.size(kd)):
            kd[e] = (kd[e].to(Float32) * d_r[row_half(e)]).to(self.dtype)
        warpgroup.wait_group(0)
        cute.arch.mbarrier_arrive(bars + M_READ)
        cute.arch.mbarrier_wait(bars + LATE_LOADS, 0)  # dS'
        self.rs(mma_rs_v, acc_v, kd, stage0(sDS), True)

    # ---------------------------------------------------------------- helpers
    @cute.jit
    def product_unless(self, zero, mma, acc, sA, sB):
        """acc = A B^T (ss), not issued where ``zero`` (an operand is zero, kernel's flags;
        None: never) is 1: acc is then undefined, so its readers take unless_zero and the
        next product into it overwrites (made). No register of it is written here: ptxas
        serializes every wgmma of a kernel where other instructions write an accumulator
        while a wgmma is in flight."""
        if const_expr(zero is None):
            self.ss(mma, acc, sA, sB, False)
        else:
            if zero == 0:
                self.ss(mma, acc, sA, sB, False)

    def unless_zero(self, zero, value):
        """``value``, or 0 where ``zero`` is 1 (value read a product_unless not issued)."""
        if const_expr(zero is None):
            return value
        return cutlass.select_(zero == 1, Float32(0.0), value)

    def made(self, zero):
        """Whether the product_unless guarded by ``zero`` was issued: the next product's
        accumulate flag (a wgmma's scale-d predicate may be dynamic)."""
        return True if const_expr(zero is None) else zero == 0

    @cute.jit
    def ss(self, mma, acc, sA, sB, accumulate):
        """acc (+)= A B^T, both from shared memory, on this warpgroup (``accumulate``: a
        Python bool, or a dynamic Boolean)."""
        thr = mma.get_slice(cute.arch.thread_idx()[0] % 128)
        wgmma(mma, acc, thr.make_fragment_A(thr.partition_A(sA)),
              thr.make_fragment_B(thr.partition_B(sB)), accumulate)

    @cute.jit
    def rs(self, mma, acc, vals, sB, accumulate):
        """acc (+)= A B^T with A the 16-bit fragment ``vals`` in registers (laid out as an
        accumulator, like store_stmatrix's), B from shared memory, on this warpgroup."""
        thr = mma.get_slice(cute.arch.thread_idx()[0] % 128)
        wgmma(mma, acc, cute.make_tensor(vals.iterator, acc_as_operand_a(vals.layout)),
              thr.make_fragment_B(thr.partition_B(sB)), accumulate)

    @cute.jit
    def loaded(self, mma, tile, acc):
        """This thread's elements of the 16-bit shared-memory tile ``tile`` in the order of
        its accumulator ``acc`` of ``mma``, by ldmatrix (eight elements a thread per
        instruction; paired loads took four)."""
        frag = cute.make_rmem_tensor(acc.layout, self.dtype)
        load_ldmatrix(mma, tile, frag, cute.arch.thread_idx()[0] % 128)
        return frag

    def wg_sync(self, wg: int, fence: bool = False):
        """One warpgroup's barrier; with ``fence``, its shared-memory writes are made
        visible to wgmma (the async proxy) first."""
        if fence:
            cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=WG_BARRIER[wg], number_of_threads=128)

    def dk_exchange(self, storage, acc):
        """fp32 (elements x 128 threads) over S and dS' (free by then): warpgroup 1's dk
        terms, element e of thread t at e * 128 + t (consecutive threads, consecutive
        words)."""
        return cute.make_tensor(cute.recast_ptr(storage.sS.data_ptr(), dtype=Float32),
                                cute.make_layout(cute.size(acc) * 128))

    @cute.jit
    def flush_e(self, e_rows, e_cols, dg_part, storage):
        """E's partial sums of this thread into dG: rows (+, into dg_part) and columns
        (each warp's sums into its row of col_e, subtracted at the end)."""
        C = CHUNK
        rows = self.quad_sums(e_rows)
        for h in cutlass.range_constexpr(2):
            dg_part[h] = dg_part[h] + rows[h]
        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        col_e = storage.col_e.get_tensor(cute.make_layout((WARPS, C), stride=(C, 1)))
        for slot in cutlass.range_constexpr(len(e_cols)):
            x = e_cols[slot]
            for d in cutlass.range_constexpr(2, 5):  # over the 8 row groups of the warp
                x = x + cute.arch.shuffle_sync_bfly(x, 1 << d)
            if lane < 4:
                col_e[warp, 8 * (slot // 2) + 2 * lane + slot % 2] = x

    @cute.jit
    def row_dots_then_scale(self, acc, mma, tile, factors):
        """The sums over each of the thread's two accumulator rows of acc * x (x: its
        elements of the 16-bit shared-memory tile ``tile``, in the order of acc, an
        accumulator of ``mma``), over the row's 4 threads; acc's rows are then multiplied
        by ``factors`` (one per row)."""
        x16 = self.loaded(mma, tile, acc)
        part = [Float32(0.0), Float32(0.0)]
        for e in cutlass.range_constexpr(cute.size(acc)):
            h = row_half(e)
            part[h] = part[h] + acc[e] * x16[e].to(Float32)
            acc[e] = acc[e] * factors[h]
        return self.quad_sums(part)

    @cute.jit
    def quad_sums(self, part):
        """Each of the thread's two row partials summed over the 4 threads of its rows."""
        out = [part[0], part[1]]
        for h in cutlass.range_constexpr(2):
            for d in cutlass.range_constexpr(2):
                out[h] = out[h] + cute.arch.shuffle_sync_bfly(out[h], 1 << d)
        return out

    @cute.jit
    def warp_reduce_to(self, storage, slot, value: Float32):
        """The warp's sum of ``value`` into reduce slot ``slot`` (lane 0 writes)."""
        for d in cutlass.range_constexpr(5):
            value = value + cute.arch.shuffle_sync_bfly(value, 1 << d)
        if cute.arch.lane_idx() == 0:
            storage.reduce.get_tensor(cute.make_layout(REDUCE_SLOTS))[slot] = value

    @cute.jit
    def state_dot(self, sS, sDS, storage, zeros, wtidx: Int32):
        """One warpgroup: <S, dS'> over the (V, K) tiles, 8 elements (16 bytes) per load;
        per-warp partial sums into reduce slots 0..3 (zeros where either is zero)."""
        acc = Float32(0.0)
        present = [z for z in zeros if z is not None]
        if const_expr(len(present) == 0):
            acc = self.state_dot_partial(sS, sDS, wtidx)
        else:
            either = present[0] if const_expr(len(present) == 1) else present[0] | present[1]
            if either == 0:
                acc = self.state_dot_partial(sS, sDS, wtidx)
        self.warp_reduce_to(storage, wtidx // cute.arch.WARP_SIZE, acc)

    @cute.jit
    def state_dot_partial(self, sS, sDS, wtidx: Int32) -> Float32:
        """This thread's part of <S, dS'>."""
        K, V = self.k_dim, self.v_dim
        acc = Float32(0.0)
        a8 = cute.make_rmem_tensor(cute.make_layout((1, 8)), self.dtype)
        b8 = cute.make_rmem_tensor(cute.make_layout((1, 8)), self.dtype)
        for idx in cutlass.range(wtidx, V * K // 8, 128, unroll=2):
            r = idx // (K // 8)
            c8 = idx - r * (K // 8)
            cute.autovec_copy(cute.local_tile(stage0(sS), (1, 8), (r, c8)), a8)
            cute.autovec_copy(cute.local_tile(stage0(sDS), (1, 8), (r, c8)), b8)
            for u in cutlass.range_constexpr(8):
                acc = acc + a8[u].to(Float32) * b8[u].to(Float32)
        return acc

    @cute.jit
    def store_rows(self, mma, mOut, acc, rows_of, first: Int32, rows: Int32, head: Int32,
                   added: cutlass.Constexpr):
        """Accumulator ``acc`` of ``mma``, rows < ``rows``, into mOut[first + row, head, :]
        (converted to mOut's dtype); with ``added``, atomically added there."""
        C = CHUNK
        g = cute.local_tile(cute.domain_offset((first, 0), mOut[None, head, None]),
                            (C, cute.size(mOut, mode=[2])), (0, 0))
        t_g = mma.get_slice(cute.arch.thread_idx()[0] % 128).partition_C(g)
        out = cute.make_rmem_tensor(acc.layout, mOut.element_type)
        out.store(acc.load().to(mOut.element_type))
        if const_expr(added):
            for e in cutlass.range_constexpr(cute.size(acc)):
                if rows_of[row_half(e)] < rows:
                    cute.arch.red(t_g.iterator + t_g.layout(e), out[e], op="add",
                                  dtype=mOut.element_type, sem="relaxed", scope="gpu")
        else:
            if rows == C:  # adjacent column pairs leave as one store
                cute.autovec_copy(out, t_g)
            else:
                for e in cutlass.range_constexpr(cute.size(acc)):
                    if rows_of[row_half(e)] < rows:
                        t_g[e] = out[e]

    @cute.jit
    def store_grad(self, mma, mOut, acc, x_tile, r_row: int, which: int, sRows, rows_of,
                   first: Int32, rows: Int32, head: Int32, staged, wg: int):
        """dq or dk (``which`` 0 or 1): when written in place with the L2 norm, the Jacobian
        dx = r (dx_n - (x_n . dx_n) x_n) (x_n from shared memory, x_tile; only the first
        term where the clamp is active) before the store (an added gradient's part too: the
        Jacobian is linear in it). ``acc`` is reused."""
        if const_expr(self.final_outputs[which] and self.l2norm):
            xn = self.loaded(mma, x_tile, acc)
            part = [Float32(0.0), Float32(0.0)]
            for e in cutlass.range_constexpr(cute.size(acc)):
                h = row_half(e)
                part[h] = part[h] + acc[e] * xn[e].to(Float32)
            part = self.quad_sums(part)
            coef = [part[h] * sRows[r_row + R_QP - R_Q, rows_of[h]] for h in range(2)]
            r_of = [sRows[r_row, i] for i in rows_of]
            for e in cutlass.range_constexpr(cute.size(acc)):
                h = row_half(e)
                acc[e] = r_of[h] * (acc[e] - coef[h] * xn[e].to(Float32))
        self.store_out(mma, mOut, acc, rows_of, first, rows, head, staged, which, wg)

    @cute.jit
    def store_out(self, mma, mOut, acc, rows_of, first: Int32, rows: Int32, head: Int32,
                  staged, which: int, wg: int):
        """store_rows of gradient ``which`` (0, 1, 2: dq, dk, dv) of output head ``head``
        (into its input head's rows where written in place), but a whole chunk with
        ``staged`` (staged_outputs) goes through its shared-memory tile: warpgroup ``wg``'s
        threads write their elements, its first warp issues the TMA store (a reduce-add
        where the gradient is added into; waited for before the CTA exits)."""
        added = self.added_outputs[which]
        if const_expr(self.out_groups[which] > 1):
            head = head // self.out_groups[which]
        if const_expr(staged is None):
            self.store_rows(mma, mOut, acc, rows_of, first, rows, head, added)
        else:
            if rows == CHUNK:
                atom, m_t, s_tile = staged
                self.store_acc(acc, mma, stage0(s_tile), cute.arch.thread_idx()[0] % 128)
                self.wg_sync(wg, fence=True)
                if cute.arch.thread_idx()[0] % 128 < cute.arch.WARP_SIZE:
                    cols = cute.size(s_tile, mode=[1])
                    tma_store_tile(atom, s_tile, cute.local_tile(
                        cute.domain_offset((first, 0), m_t[None, None, head]), (CHUNK, cols),
                        (0, 0)))
                    cute.arch.cp_async_bulk_commit_group()
            else:
                self.store_rows(mma, mOut, acc, rows_of, first, rows, head, added)

    @cute.jit
    def write_gate_grads(self, sDG, sDB, mDG, mDBeta, first: Int32, rows: Int32,
                         head: Int32):
        """One warp: dg_i = sum_{l >= i} dG_l (two rows per lane) and dbeta, real rows only."""
        lane = cute.arch.lane_idx()
        a = sDG[2 * lane]
        b = sDG[2 * lane + 1]
        # inclusive suffix sums: a prefix sum over reversed lanes
        rev = a + b
        for d in cutlass.range_constexpr(5):
            down = cute.arch.shuffle_sync_down(rev, 1 << d)
            if lane + (1 << d) < cute.arch.WARP_SIZE:
                rev = rev + down
        after = rev - a - b  # rows past 2 lane + 1
        for r, val in ((2 * lane, after + a + b), (2 * lane + 1, after + b)):
            if r < rows:
                mDG[first + r, head] = val.to(mDG.element_type)
                mDBeta[first + r, head] = sDB[r].to(mDBeta.element_type)
