"""HSTU attention backward for SM90: TMA + wgmma, warp-specialized, varlen, no atomics.

With z = alpha q.k, h = z / 2, t = tanh(h), L = scaling_seqlen and M the mask:
    P = M SiLU(z) = M h (1 + t);   dP = dO V^T;   dS = M dP (1 + t) (1 + h (1 - t)) / 2
    dV = P^T dO / L;   dK = alpha dS^T Q / L;   dQ = alpha dS K / L
(SiLU'(z) = sigma(z) (1 + z (1 - sigma(z))) with sigma(z) = (1 + t) / 2.) One MUFU.TANH per
score; no row statistics are saved by the forward. The kernel makes 2 dS = M dP ((1 + t) +
h (1 + t) (1 - t)) from the unmasked P and halves the gradients' scales instead; the fixed tile
X is multiplied by alpha / 2 in shared memory once per CTA (prescale), so S leaves the wgmma
as h (fused: dQ = 2 dS (alpha K / 2) / L then).

Every mode is one pattern. A CTA owns a *fixed* tile of 64 rows per consumer warpgroup and
streams 64-row tiles of the other side through a TMA ring:
    S = X U^T,  dP = Y W^T  (fixed X, Y from shared memory, streamed U, W; fp32 registers),
    acc_ds += dS U,  acc_p += P W  (dS, P as 16-bit register A operands; U, W read
    transposed from the same shared memory).
- mode "dq":   X = Q,  Y = dO, U = K,  W = V;  acc_ds = dQ (fixed rows: queries)
- mode "dkdv": X = K,  Y = V,  U = Q,  W = dO; acc_ds = dK, acc_p = dV (fixed rows: keys)
- "dk" / "dv": one of the two (D = 256, where both accumulators do not fit in registers).
- "fused" (D <= 128): "dkdv" plus dQ in the same pass: dS goes to shared memory, both
  warpgroups multiply it by K (each its half of D) and the 64 x D/2 fp32 partial is added
  into a (T_q, H, D) fp32 workspace by a TMA reduce-add. One pass instead of two, but the
  order of the additions varies from run to run (not bitwise reproducible). dQ runs one
  streamed tile behind dK and dV (step i multiplies tile i - 1's dS), so a warpgroup waits
  only for the other's previous tile, not its current one, and the two may drift apart
  (one's scores beside the other's products; not observed directly, the gain came with
  smaller L2 groups: bench/RESULTS.md run 35c). The next
  streamed tile's S and dP are issued before a tile's dQ partial is staged and sent, and
  CTAs are scheduled a few (sequence, head) pairs at a time (an L2 group) so the reduce-adds
  hit L2. Once every CTA of a group has counted its reduce-adds in, the idle warps of the
  producer warpgroup in later CTAs turn that group's fp32 rows into dq (and zeros) while
  their consumers compute; DqFinishSm90 converts what they did not reach. A warpgroup
  whose 64 keys a whole streamed tile cannot see skips that tile's scores and dK, dV terms
  (staging zeros as its dS half): the second warpgroup's first tile under a right bound
  (causal: every key tile's, 1 of ~33 tiles at L = 4096, 1 of 2-8 in short sequences;
  skip_step) and the first warpgroup's last tile under a left bound (local windows; it still
  makes that tile's dQ product, which the other half of dS feeds: dq_only_step).
Jagged batches (T / R + B fixed tiles at most half of the max_seqlen-sized grid): the grid
counts only the fixed tiles that exist; each CTA finds its sequence by a warp scan of the
sequence lengths, 32 at a time (the forward's device-side varlen decode).
In the other modes each output row is owned by exactly one CTA and summed in a fixed order,
so the gradients are bitwise reproducible. GQA: a kv head's CTA streams the queries of all
its query heads.
Masks are bits ANDed on the packed 16-bit P and dS (exact zeros whatever S was); streamed
rows past a sequence's end are zeroed in shared memory (0 * NaN is NaN).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from .activation import tanh_approx
from .attention_sm90 import (AttentionTileOps, acc_as_operand_a, acc_mn_layout, advanced,
                             copy_rows_out, find_in_sequences, row_vectors, select_modes,
                             store_stmatrix, tma_pipeline)
from .hstu_attention_fwd_sm90 import PRODUCER_REGS, THREADS_PER_WG, WG_ROWS
from .tiling import check_register_split

STREAM_ROWS = 64
CONSUMER_REGS = 240
ZERO_BARRIER = 1  # the consumer warpgroups cleared the streamed rows past a sequence's end
K_FREE_BARRIER = ZERO_BARRIER  # 1 again (fused): no warpgroup reads K (sX) any more
DQ_STAGED_BARRIER = 3  # 3 and 4: a warpgroup's dQ buffer is free / staged (fused)
EPILOGUE_BARRIER = DQ_STAGED_BARRIER  # 3 and 4 again: a warpgroup's gradients are staged
# fused: warpgroup w's dS^T of tile p is in shared memory and its dQ product of tile p - 1
# is done: barrier DS_STAGED_BARRIER + 2 w + p % 2 (arrived by w, waited on by the other;
# two parities, as w may arrive for p + 1 before the other has waited for p). Parities and
# buffer slots are taken with "& 1" of non-negative step numbers: a signed "% 2" costs
# three instructions where the mask costs one.
DS_STAGED_BARRIER = 5  # 5 .. 8
MODES = ("dq", "dkdv", "dk", "dv", "fused")
# fused, dense numbering: the producer warpgroup's idle warps convert finished groups' dQ.
SLICE_ROWS = 16  # query rows (x the kv head's query heads x D) a warp converts at a time
CONVERTER_WARPS = 3  # warps 1-3 (the producer warpgroup's idle ones)
CLAIM_MARGIN = 3  # a warp claims a slice only while its producer has this many tiles to load
POLL_NS = 2000  # backoff between looks at a group's arrival counter
# The producer warp's word to the converting warps: streamed tiles it has still to load, and
# whether it is done (its consumers then have at most `stages` tiles left).
PROGRESS_REMAINING, PROGRESS_DONE = 0, 1
# The int32 sync words (mSync) of n L2 groups: n arrival counts, n claim counts, then
# SYNC_EXTRA_WORDS more: the finisher's CTA count and the oldest group that may have unclaimed
# slices (a hint). The lifecycle sizes the workspace by the same count.
FINISHED_WORD, LOWEST_WORD = 0, 1  # after the 2 n group words
SYNC_EXTRA_WORDS = 2


def claims_at(n_groups):
    """Offset of group 0's claim count (the arrival counts come first)."""
    return n_groups


def extra_at(n_groups, word):
    """Offset of one of the SYNC_EXTRA_WORDS."""
    return 2 * n_groups + word


def consumer_warpgroups(head_dim: int) -> int:
    # D = 256: one warpgroup keeps the fixed tile and two stream stages within 227 KB.
    return 2 if head_dim <= 128 else 1


# Whether alpha / 2 goes into the fixed tile in shared memory (prescale_fixed) instead of an
# FMUL per score.
PRESCALE_FIXED = {32: True, 64: True, 128: True, 256: True}


def stream_stages(head_dim: int, fused: bool) -> int:
    # fused: dS (2 x 16 KB) and dQ (32 KB) buffers take a stage's room at D = 128.
    return {32: 4, 64: 4, 128: 2 if fused else 3, 256: 2}[head_dim]


class HstuAttentionBackwardSm90(AttentionTileOps):
    def __init__(self, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                 window_left_bounded: bool, window_right_bounded: bool, func_intervals: int,
                 mode: str):
        assert mode in MODES, mode
        self.init_attention(dtype, head_dim, num_heads, num_kv_heads, window_left_bounded,
                            window_right_bounded, func_intervals)
        self.mode = mode
        self.fused = mode == "fused"
        self.keys_fixed = mode != "dq"
        self.want_ds = mode != "dv"  # dQ or dK
        self.want_p = mode in ("dkdv", "dv", "fused")  # dV
        self.nwg = consumer_warpgroups(head_dim)
        assert not self.fused or self.nwg == 2, "fused needs two consumer warpgroups (D <= 128)"
        self.fixed_rows = WG_ROWS * self.nwg
        self.mask_width = STREAM_ROWS  # masks cover a streamed tile's columns
        self.stages = stream_stages(head_dim, self.fused)
        self.num_threads = (self.nwg + 1) * THREADS_PER_WG
        self.register_split = check_register_split(
            type(self).__name__, self.num_threads,
            (PRODUCER_REGS,) + (CONSUMER_REGS,) * self.nwg)
        # fused: dQ staging buffers. Two let a reduce still read one while the next is
        # written: +2 % at D = 64; at D = 128 (2 x 32 KB, shared memory full) -5 % (H200).
        self.dq_buffers = 2 if head_dim <= 64 else 1  # a power of two: see dq_buffer
        # P is masked and its gemm issued before dS is masked: fewer live registers (fused
        # D = 64: spill slots 88 -> 56 B, +4.5 % on the H200), except in the fused D = 128
        # kernel, where that order ran 1 % slower (104 -> 88 B).
        self.mask_between_gemms = not (self.fused and head_dim > 64)
        self.prescale = PRESCALE_FIXED[head_dim]
        # fused: under a right bound the second warpgroup's keys may be hidden from the whole
        # first streamed tile (hidden_lead): it skips that tile; under a left bound the
        # first warpgroup's from the whole last one (hidden_trail): it makes only that
        # tile's dQ product (dq_only_step). Not in "dkdv" (deterministic), whose kernel ran
        # 1.2 % slower with the lead skip (run 39b), nor where no bound allows it: those
        # kernels keep the code they had.
        self.skips_lead = self.fused and self.right_bounded
        self.skips_trail = self.fused and self.left_bounded
        # fused D = 128: a warpgroup whose first step is tile 0 makes no dQ product there
        # (there is no tile -1). Not at D <= 64, where the extra peeled step cost ~100 B of
        # spills.
        self.peels_first = self.fused and head_dim == 128
        # The fixed tiles (X, then Y) land on one barrier each: X is prescaled while Y is
        # still on its way.
        self.fixed_tiles = 1 if mode == "dv" else 2  # dV needs no dP: no Y

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdA: cute.Tensor, mdB: cute.Tensor, mdQacc: cute.Tensor, mdQ: cute.Tensor,
                 mSync: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                 mFunc: cute.Tensor, max_seqlen_fixed: Int32, compact: Int32,
                 convert: Int32, pair_group: Int32, max_seqlen_q: Int32, window_left: Int32,
                 window_right: Int32,
                 half_alpha: Float32, scale_ds: Float32, scale_p: Float32,
                 stream: cuda.CUstream):
        """mdA: dQ (mode dq) or dK (dkdv, dk, fused); mdB: dV (dkdv, dv, fused); mdQacc: the
        fp32 (T_q, H, D) dQ accumulator (fused: zero before). Unused: None.

        The host decides the CTA numbering (compact: 1 for jagged batches) and the L2 groups
        (pair_group (sequence, head) pairs each). Fused with convert = 1 (dense numbering
        only), the kernel converts most of mdQacc into mdQ itself (and zeroes it): the idle
        producer warps of group g's CTAs convert finished earlier groups' rows in slices of
        SLICE_ROWS query rows (ceil(max_seqlen_q / SLICE_ROWS) per pair), claimed from a
        counter per group; DqFinishSm90 converts the rest after the kernel. mSync: the int32
        sync words (claims_at, extra_at), zero before and after."""
        dt = self.dtype
        D, R, C = self.head_dim, self.fixed_rows, STREAM_ROWS
        mQ, mK, mV, mdO = [select_modes(t, [0, 2, 1]) for t in (mQ, mK, mV, mdO)]  # (T, D, H)
        if const_expr(self.keys_fixed):
            mX, mY, mU, mW = mK, mV, mQ, mdO
        else:
            mX, mY, mU, mW = mQ, mdO, mK, mV
        mma_s = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K, Float32,
            (self.nwg, 1, 1), (WG_ROWS, C))
        mma_g = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN, Float32,
            (self.nwg, 1, 1), (WG_ROWS, D), warpgroup.OperandSource.RMEM)
        sX_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (R, C, D), dt, 1)
        sU_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (R, C, D), dt,
                                                  self.stages)
        one = lambda layout: cute.slice_(layout, (None, None, 0))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_x, mX_tma = cpasync.make_tiled_tma_atom(g2s, mX, one(sX_layout), (R, D))
        tma_y, mY_tma = cpasync.make_tiled_tma_atom(g2s, mY, one(sX_layout), (R, D))
        tma_u, mU_tma = cpasync.make_tiled_tma_atom(g2s, mU, one(sU_layout), (C, D))
        tma_w, mW_tma = cpasync.make_tiled_tma_atom(g2s, mW, one(sU_layout), (C, D))
        self.fixed_bytes = cute.size_in_bytes(dt, one(sX_layout))  # per fixed tile
        self.stream_bytes = cute.size_in_bytes(dt, one(sU_layout)) * 2
        stages = self.stages
        # fused: dQ = dS K with dS^T (keys x queries) double-buffered in shared memory, the two
        # warpgroups splitting D; A = dS (MN-major view), B = K^T (MN-major view of sX).
        mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, cute.nvgpu.OperandMajorMode.MN, cute.nvgpu.OperandMajorMode.MN, Float32,
            (1, self.nwg, 1), (WG_ROWS, D // self.nwg))
        sdS_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (R, C, C), dt, 2)
        sdQ_layout = sm90_utils.make_smem_layout_epi(Float32, LayoutEnum.ROW_MAJOR,
                                                     (C, D // self.nwg), self.nwg)
        tma_dq = None
        mdQacc_tma = None
        if const_expr(self.fused):
            tma_dq, mdQacc_tma = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), select_modes(mdQacc, [0, 2, 1]),
                one(sdQ_layout), (C, D // self.nwg))
        # Only the fused mode has dS and dQ buffers.
        sdS_size = cute.cosize(sdS_layout) if const_expr(self.fused) else 0
        sdQ_size = cute.cosize(sdQ_layout) if const_expr(self.fused) else 0
        sdQ2_size = sdQ_size if const_expr(self.dq_buffers == 2) else 0
        # the converting warps' staging slices (fused)
        convert_size = CONVERTER_WARPS * SLICE_ROWS * D if const_expr(self.fused) else 0

        @cute.struct
        class SharedStorage:
            fixed_bars: cute.struct.MemRange[cutlass.Int64, 2 * self.fixed_tiles]
            stream_bars: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sX: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sX_layout)], 1024]
            sY: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sX_layout)], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_layout)], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sU_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, sdS_size], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, sdQ_size], 1024]
            sdQ2: cute.struct.Align[cute.struct.MemRange[Float32, sdQ2_size], 1024]
            progress: cute.struct.MemRange[Int32, 2]  # PROGRESS_REMAINING, PROGRESS_DONE
            convert: cute.struct.Align[cute.struct.MemRange[Float32, convert_size], 128]

        self.storage = SharedStorage
        num_batches = mCuSeqlensQ.shape[0] - 1
        heads = self.num_kv_heads if const_expr(self.keys_fixed) else self.num_heads
        tiles = cutlass.max((max_seqlen_fixed + R - 1) // R, 1)
        # One grid axis (the host checks tiles x heads x B < 2^31). Dense numbering: CTA
        # numbers run over the heads, then the sequences, then the fixed tiles, heaviest tiles
        # first; sequences shorter than max_seqlen leave CTAs with no rows. Compact numbering
        # (jagged batches, where most dense CTAs would be empty): only the fixed tiles that
        # exist, at most T / R + B of them, found by a scan of the sequence lengths.
        dense = tiles * cutlass.max(num_batches, 1)
        compact_tiles = mX.shape[0] // R + num_batches
        q_chunks = (max_seqlen_q + SLICE_ROWS - 1) // SLICE_ROWS
        grid_tiles = dense + compact * (compact_tiles - dense)
        self.kernel(mma_s, mma_g, mma_dq, mX_tma, mY_tma, mU_tma, mW_tma, mdQacc_tma, tma_x,
                    tma_y, tma_u, tma_w, tma_dq, sX_layout, sU_layout, sdS_layout, sdQ_layout,
                    mdA, mdB, mdQacc, mdQ, mSync, mCuSeqlensQ, mCuSeqlensK, mFunc, tiles,
                    compact, convert, pair_group, q_chunks, num_batches, window_left,
                    window_right,
                    half_alpha, scale_ds, scale_p).launch(grid=[grid_tiles * heads, 1, 1],
                                    block=[self.num_threads, 1, 1], stream=stream)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mma_s: cute.TiledMma, mma_g: cute.TiledMma, mma_dq: cute.TiledMma,
               mX: cute.Tensor, mY: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor,
               mdQacc: cute.Tensor, tma_x: cute.CopyAtom, tma_y: cute.CopyAtom,
               tma_u: cute.CopyAtom, tma_w: cute.CopyAtom, tma_dq: cute.CopyAtom,
               sX_layout: cute.ComposedLayout, sU_layout: cute.ComposedLayout,
               sdS_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               mdA: cute.Tensor, mdB: cute.Tensor, mAcc: cute.Tensor, mdQ: cute.Tensor,
               mSync: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               mFunc: cute.Tensor, tiles: Int32, compact: Int32, convert: Int32,
               pair_group: Int32,
               q_chunks: Int32, num_batches: Int32,
               window_left: Int32, window_right: Int32, half_alpha: Float32, scale_ds: Float32,
               scale_p: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        heads = self.num_kv_heads if const_expr(self.keys_fixed) else self.num_heads
        # CTAs run in groups of (sequence, head) pairs, heaviest tiles first within a group:
        # the CTAs in flight share few pairs, so the tiles they stream and the fp32 dQ rows
        # they add into stay in L2. (All pairs in flight at once, the fused kernel's dQ
        # reduce-adds missed L2: 396 -> 437 TFLOP/s at causal 16 x 4096 on the H200.) The
        # host sizes the groups (Launch.plan: L2_GROUP_BYTES of streamed data each).
        head = Int32(0)
        batch = Int32(0)
        block = Int32(0)
        group = Int32(0)
        pairs = heads * cutlass.max(num_batches, 1)
        if compact == 0:
            group_ctas = pair_group * tiles
            group = cta // group_ctas
            in_group = cutlass.min(pair_group, pairs - group * pair_group)
            rank = cta - group * group_ctas
            pair = group * pair_group + rank % in_group
            order = rank // in_group
            head = pair % heads
            batch = pair // heads
            # Under a causal mask the first key tiles and the last query tiles see the most.
            block = order if const_expr(self.keys_fixed) else tiles - 1 - order
        else:
            # Consecutive CTAs: the heads of one fixed tile, then the sequence's next tile
            # (heaviest first), then the next sequence; CTAs past the last tile get no rows.
            head = cta % heads
            batch, order, count = find_in_sequences(
                cta // heads, mCuSeqlensK if const_expr(self.keys_fixed) else mCuSeqlensQ,
                num_batches, self.fixed_rows)
            if batch < num_batches:
                block = order if const_expr(self.keys_fixed) else count - 1 - order
            else:
                batch = Int32(0)
                block = tiles  # past every sequence's end: an empty span
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_x, tma_y, tma_u, tma_w):
                cpasync.prefetch_descriptor(atom)
        if const_expr(self.fused):
            if warp_idx == 4:  # the first consumer warp issues the reduce-adds
                cpasync.prefetch_descriptor(tma_dq)

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        consumers = self.nwg * THREADS_PER_WG
        pipe_fixed = tma_pipeline(storage.fixed_bars.data_ptr(), self.fixed_tiles,
                                  self.fixed_bytes, consumers)
        pipe_stream = tma_pipeline(storage.stream_bars.data_ptr(), self.stages,
                                   self.stream_bytes, consumers)
        progress = storage.progress.get_tensor(cute.make_layout(2))
        # (its sequence-start loads before the CTA-wide sync: the K and V loads wait on them)
        span = self.work_span(block, batch, mCuSeqlensQ, mCuSeqlensK, window_left, window_right)
        if tidx == 0:
            progress[PROGRESS_REMAINING] = Int32(0)
            progress[PROGRESS_DONE] = Int32(0)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sX = storage.sX.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sY = storage.sY.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sU = storage.sU.get_tensor(sU_layout.outer, swizzle=sU_layout.inner)
        sW = storage.sW.get_tensor(sU_layout.outer, swizzle=sU_layout.inner)
        sdS = None
        sdQ = None
        if const_expr(self.fused):
            sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
            # dQ staging buffers: a reduce may still be reading one while the next is written.
            sdQ = (storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner),)
            if const_expr(self.dq_buffers == 2):
                sdQ = sdQ + (storage.sdQ2.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner),)

        if warp_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            self.produce(mX, mY, mU, mW, tma_x, tma_y, tma_u, tma_w, sX, sY, sU, sW,
                         pipe_fixed, pipe_stream, block, head, span, progress)
        elif warp_idx < 4:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if const_expr(self.fused):
                if convert != 0:
                    staging = (storage.convert.data_ptr()
                               + (warp_idx - 1) * SLICE_ROWS * self.head_dim)
                    self.convert_finished_groups(mAcc, mdQ, mSync, mCuSeqlensQ, progress, group,
                                                pair_group, pairs, tiles, q_chunks, staging)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGS)
            self.consume(mma_s, mma_g, mma_dq, sX, sY, sU, sW, sdS, sdQ, pipe_fixed,
                         pipe_stream, tidx - THREADS_PER_WG, block, head, span, mdA, mdB,
                         mdQacc, tma_dq, mFunc, window_left, window_right, half_alpha,
                         scale_ds, scale_p, mSync, pair_group, tiles, convert)

    @cute.jit
    def work_span(self, block: Int32, batch: Int32, mCuSeqlensQ, mCuSeqlensK,
                  window_left: Int32, window_right: Int32):
        """(q_start, len_q, k_start, len_k, s_min, s_max): the CTA's sequence and the streamed
        tiles [s_min, s_max) any of its fixed rows sees (empty past the sequence end)."""
        q_start = mCuSeqlensQ[batch]
        len_q = mCuSeqlensQ[batch + 1] - q_start
        k_start = mCuSeqlensK[batch]
        len_k = mCuSeqlensK[batch + 1] - k_start
        off = len_k - len_q
        r0 = block * self.fixed_rows
        _, len_fixed, _, len_stream = self.sides(q_start, len_q, k_start, len_k)
        r_last = cutlass.min(r0 + self.fixed_rows, len_fixed) - 1
        lo, hi = self.seen_rows(r0, r_last, len_q, len_k, len_stream, off, window_left,
                                window_right)
        s_min = lo // STREAM_ROWS
        s_max = (hi + STREAM_ROWS) // STREAM_ROWS
        if hi < lo or r0 >= len_fixed:
            s_max = s_min
        return q_start, len_q, k_start, len_k, s_min, s_max

    @cute.jit
    def seen_rows(self, f0: Int32, f_last: Int32, len_q: Int32, len_k: Int32,
                  len_stream: Int32, off: Int32, window_left: Int32, window_right: Int32):
        """(lo, hi): the streamed rows that any of the fixed rows f0 .. f_last may see under
        the window bounds (none when hi < lo). The CTA's span (work_span) and a warpgroup's
        hidden first or last tile (hidden_lead, hidden_trail) both come from it."""
        lo = Int32(0)
        hi = len_stream - 1
        # Query i sees key j when i + off - left <= j <= i + off + right.
        if const_expr(self.keys_fixed):
            if const_expr(self.right_bounded):
                lo = cutlass.max(f0 - off - window_right, 0)
            if const_expr(self.left_bounded):
                hi = cutlass.min(f_last - off + window_left, len_q - 1)
        else:
            if const_expr(self.left_bounded):
                lo = cutlass.max(f0 + off - window_left, 0)
            if const_expr(self.right_bounded):
                hi = cutlass.min(f_last + off + window_right, len_k - 1)
        return lo, hi

    def sides(self, q_start, len_q, k_start, len_k):
        """(start, length) of the fixed side's sequence, then of the streamed side's."""
        if const_expr(self.keys_fixed):
            return k_start, len_k, q_start, len_q
        return q_start, len_q, k_start, len_k

    def stream_heads(self) -> int:
        """Heads streamed per fixed tile: all query heads of a kv head when keys are fixed."""
        return self.group if self.keys_fixed else 1

    def dq_buffer(self, p):
        """The dQ staging buffer of stream step p >= 0."""
        return p & (self.dq_buffers - 1)

    def stream_step_place(self, p, tiles):
        """(streamed head offset, tile offset) of stream step p: the steps walk the tiles once
        per streamed head. With one streamed head p < tiles already: no integer division
        (~50 instructions a step per warp, a float reciprocal included)."""
        if const_expr(self.stream_heads() == 1):
            return 0, p
        return p // tiles, p % tiles

    @cute.jit
    def produce(self, mX, mY, mU, mW, tma_x, tma_y, tma_u, tma_w, sX, sY, sU, sW, pipe_fixed,
                pipe_stream, block: Int32, head: Int32, span, progress):
        q_start, len_q, k_start, len_k, s_min, s_max = span
        D, R, C = self.head_dim, self.fixed_rows, STREAM_ROWS
        fixed_start, _, stream_start, _ = self.sides(q_start, len_q, k_start, len_k)
        if s_max > s_min:
            fixed_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                       self.fixed_tiles)
            fixed = ((tma_x, mX, sX), (tma_y, mY, sY))[:self.fixed_tiles]
            for f_atom, f_gmem, f_smem in fixed:
                pipe_fixed.producer_acquire(fixed_state)
                bar = pipe_fixed.producer_get_barrier(fixed_state)
                f_tile = cute.local_tile(
                    cute.domain_offset((fixed_start, 0), f_gmem[None, None, head]), (R, D),
                    (block, 0))
                f_s, f_g = cpasync.tma_partition(f_atom, 0, cute.make_layout(1),
                                                 cute.group_modes(f_smem, 0, 2),
                                                 cute.group_modes(f_tile, 0, 2))
                cute.copy(f_atom, f_g, f_s[None, 0], tma_bar_ptr=bar)
                fixed_state = advanced(fixed_state)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            tiles = s_max - s_min
            for i in cutlass.range(tiles * self.stream_heads(), unroll=1):
                stream_head = head
                head_offset, tile_offset = self.stream_step_place(i, tiles)
                if const_expr(self.keys_fixed):
                    stream_head = head * self.group + head_offset
                else:
                    stream_head = head // self.group
                s = s_min + tile_offset
                pipe_stream.producer_acquire(state)
                bar = pipe_stream.producer_get_barrier(state)
                for atom, m, smem_t in ((tma_u, mU, sU), (tma_w, mW, sW)):
                    g = cute.local_tile(
                        cute.domain_offset((stream_start, 0), m[None, None, stream_head]),
                        (C, D), (s, 0))
                    ts, tg = cpasync.tma_partition(atom, 0, cute.make_layout(1),
                                                   cute.group_modes(smem_t, 0, 2),
                                                   cute.group_modes(g, 0, 2))
                    cute.copy(atom, tg, ts[None, state.index], tma_bar_ptr=bar)
                state = advanced(state)
                if const_expr(self.fused):  # a hint for the converting warps
                    if cute.arch.lane_idx() == 0:
                        cute.arch.atomic_exch(progress.iterator + PROGRESS_REMAINING,
                                              tiles * self.stream_heads() - 1 - i)
        if const_expr(self.fused):
            if cute.arch.lane_idx() == 0:
                cute.arch.atomic_exch(progress.iterator + PROGRESS_DONE, Int32(1))

    @cute.jit
    def consume(self, mma_s, mma_g, mma_dq, sX, sY, sU, sW, sdS, sdQ, pipe_fixed, pipe_stream,
                consumer_tidx: Int32, block: Int32, head: Int32, span, mdA, mdB, mdQacc,
                tma_dq, mFunc, window_left: Int32, window_right: Int32, half_alpha: Float32,
                scale_ds: Float32, scale_p: Float32, mSync, pair_group: Int32,
                seq_tiles: Int32, convert: Int32):
        q_start, len_q, k_start, len_k, s_min, s_max = span
        D, R, C = self.head_dim, self.fixed_rows, STREAM_ROWS
        wg = consumer_tidx // THREADS_PER_WG
        # The loop makes 2 dS; fused with the prescale, dQ's B operand is alpha K / 2.
        scale_ds = scale_ds * Float32(0.5)
        scale_dq = scale_p if const_expr(self.prescale) else scale_ds
        wg_s = mma_s.get_slice(wg * THREADS_PER_WG)
        wg_g = mma_g.get_slice(wg * THREADS_PER_WG)
        thr_s = mma_s.get_slice(consumer_tidx)
        # U and W transposed: (D, rows, stages), the MN-major B operand of the gradients.
        transposed = cute.make_ordered_layout((D, C, self.stages), order=(1, 0, 2))
        tSrX = wg_s.make_fragment_A(wg_s.partition_A(sX))
        tSrY = wg_s.make_fragment_A(wg_s.partition_A(sY))
        tSrU = wg_s.make_fragment_B(wg_s.partition_B(sU))
        tSrW = wg_s.make_fragment_B(wg_s.partition_B(sW))
        tGrUt = wg_g.make_fragment_B(wg_g.partition_B(cute.composition(sU, transposed)))
        tGrWt = wg_g.make_fragment_B(wg_g.partition_B(cute.composition(sW, transposed)))

        acc_s = cute.make_rmem_tensor(wg_s.partition_shape_C((R, C)), Float32)
        acc_dp = cute.make_rmem_tensor(wg_s.partition_shape_C((R, C)), Float32)
        ds_regs = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        p_regs = cute.make_rmem_tensor(acc_s.layout, self.dtype)
        tGrdS = cute.make_tensor(ds_regs.iterator, acc_as_operand_a(acc_s.layout))
        tGrP = cute.make_tensor(p_regs.iterator, acc_as_operand_a(acc_s.layout))
        acc_a = None
        acc_b = None
        if const_expr(self.want_ds):
            acc_a = cute.make_rmem_tensor(wg_g.partition_shape_C((R, D)), Float32)
            acc_a.fill(0.0)
        if const_expr(self.want_p):
            acc_b = cute.make_rmem_tensor(wg_g.partition_shape_C((R, D)), Float32)
            acc_b.fill(0.0)
        dq_parts = None
        if const_expr(self.fused):
            dq_parts = self.dq_partitions(mma_dq, sX, sdS, sdQ, consumer_tidx)

        c_s = thr_s.partition_C(cute.make_identity_tensor((R, C)))
        coords = cute.make_tensor(c_s.iterator, acc_mn_layout(c_s.layout))
        r0 = block * R
        row_i = (r0 + coords[0, 0][0], r0 + coords[1, 0][0])  # local fixed-side indices
        first_col = coords[0, 0][1]
        off = len_k - len_q
        fixed_start, len_fixed, _, len_stream = self.sides(q_start, len_q, k_start, len_k)
        nf = self.func_intervals
        func = None
        if const_expr(nf > 0 and not self.keys_fixed):
            func = cute.make_rmem_tensor(cute.make_layout((2, nf)), Int32)
            for r in cutlass.range_constexpr(2):
                for t in cutlass.range_constexpr(nf):
                    func[r, t] = Int32(0)
                    if row_i[r] < len_q:
                        func[r, t] = mFunc[0, t, q_start + row_i[r]]

        outputs = ()  # (gradient, accumulator, staging tile, scale)
        if const_expr(self.want_ds):
            outputs = outputs + ((mdA, acc_a, sX[None, None, 0], scale_ds),)
        if const_expr(self.want_p):
            outputs = outputs + ((mdB, acc_b, sY[None, None, 0], scale_p),)
        # fused (outputs dK, dV): dV, staged in V's place, leaves before dK, staged in K's,
        # which the last dQ products read
        early, late = (outputs[1:], outputs[:1]) if const_expr(self.fused) else ((), outputs)
        if s_max > s_min:
            fixed_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                       self.fixed_tiles)
            pipe_fixed.consumer_wait(fixed_state)  # X
            # fused: dQ sums dS K over the tile's keys: K rows past the sequence (another
            # sequence's, maybe NaN) must be zeros, not just multiplied by zero.
            if const_expr(self.prescale):
                self.prescale_fixed(sX[None, None, 0], len_fixed - r0, consumer_tidx,
                                    half_alpha)
            elif const_expr(self.fused):
                if r0 + R > len_k:
                    self.zero_fixed_rows(sX[None, None, 0], len_k - r0, consumer_tidx)
            if const_expr(self.fixed_tiles == 2):
                pipe_fixed.consumer_wait(advanced(fixed_state))  # Y
            if const_expr(self.fused):
                # tile -1: no dS, and dS buffer 1 is free for the other warpgroup's tile 1
                self.ds_staged_arrive(-1, consumer_tidx)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            tiles = s_max - s_min
            count = tiles * self.stream_heads()
            if const_expr(self.skips_lead or self.skips_trail):
                # the streamed rows this warpgroup's own keys may see
                wg_lo, wg_hi = self.seen_rows(
                    r0 + wg * WG_ROWS, cutlass.min(r0 + (wg + 1) * WG_ROWS, len_fixed) - 1,
                    len_q, len_k, len_stream, off, window_left, window_right)
            skip = 0
            if const_expr(self.skips_lead):
                skip = self.hidden_lead(wg_lo, s_min, count)
                if skip > 0:
                    state = self.skip_step(state, ds_regs, mma_s, sU, sW, sdS, pipe_stream,
                                           s_min, len_stream, consumer_tidx)
            # S and dP of the next streamed tile are issued before this tile's dQ goes out,
            # so the tensor cores have work while the dQ partial is staged and reduced.
            self.issue_scores(mma_s, acc_s, acc_dp, tSrX, tSrY, tSrU, tSrW, sU, sW, pipe_stream,
                              state, s_min + self.stream_step_place(skip, tiles)[1], len_stream,
                              consumer_tidx)
            # The last step is peeled: a wgmma issued under a branch serializes them all.
            ops = (mma_s, mma_g, mma_dq, acc_s, acc_dp, acc_a, acc_b, p_regs, ds_regs, tGrP,
                   tGrdS, tGrUt, tGrWt, tSrX, tSrY, tSrU, tSrW, dq_parts)
            where = (row_i, first_col, func, mFunc, q_start, len_q, len_k, off, window_left,
                     window_right, half_alpha, scale_dq, s_min, tiles, len_stream, head)
            trail = 0
            if const_expr(self.skips_trail):
                trail = self.hidden_trail(wg_hi, s_max, count - skip)
            first = skip
            if const_expr(self.peels_first):
                # tile 0 as this warpgroup's first step, not its last: no dQ product
                # (a loop of 0 or 1 steps, not a branch: it issues wgmmas)
                first = Int32(skip)
                if skip == 0 and count - 1 - trail > 0:
                    first = Int32(1)
                for i in cutlass.range(skip, first, unroll=1):
                    state = self.stream_step(i, state, ops, where, sU, sW, sdS, sdQ,
                                             pipe_stream, mdQacc, tma_dq, consumer_tidx, True,
                                             False)
            for i in cutlass.range(first, count - 1 - trail, unroll=1):
                state = self.stream_step(i, state, ops, where, sU, sW, sdS, sdQ, pipe_stream,
                                         mdQacc, tma_dq, consumer_tidx, True)
            state = self.stream_step(count - 1 - trail, state, ops, where, sU, sW, sdS, sdQ,
                                     pipe_stream, mdQacc, tma_dq, consumer_tidx, False)
            if const_expr(self.skips_trail):
                # (a loop of 0 or 1 steps, not a branch: it issues a wgmma)
                for i in cutlass.range(count - trail, count, unroll=1):
                    state = self.dq_only_step(i, state, ops, where, sU, sW, sdS, sdQ,
                                              pipe_stream, mdQacc, tma_dq, consumer_tidx)
            if const_expr(self.fused):
                # the last tile's dQ (each step multiplies the previous tile's); dV, final
                # now, is staged meanwhile (early below)
                self.ds_staged_wait(count - 1, consumer_tidx)
                acc_dq, tQrdSt, tQrKt, _ = dq_parts
                self.gemm(mma_dq, acc_dq, tQrdSt[None, None, None, (count - 1) & 1],
                          tQrKt[None, None, None, 0], accumulate=False)
                for _, acc, staging, scale in early:
                    self.stage_gradient(acc, staging, scale, mma_g, consumer_tidx)
                warpgroup.wait_group(0)
                self.stage_dq(dq_parts, self.dq_buffer(count - 1), scale_dq,
                              consumer_tidx)
                self.send_dq(mdQacc, tma_dq, sdQ, count - 1, tiles, s_min, head, q_start,
                             consumer_tidx)
        else:
            for _, acc, staging, scale in early:
                self.stage_gradient(acc, staging, scale, mma_g, consumer_tidx)

        # The gradients leave through the fixed tiles' shared memory as 16-byte stores:
        # scattered 4-byte stores from the accumulators held the epilogue on the LSU queue
        # (lg throttle, ~5 % of the warp samples at causal 4k in ncu). fused: dV first,
        # while the other warpgroup may still read K (sX) in its last dQ product; only this
        # warpgroup's own dP products read its rows of V (sY), and they are done.
        if const_expr(self.fused):
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg,
                              number_of_threads=THREADS_PER_WG)
            for grad, _, staging, _ in early:
                self.gradient_rows_out(grad, staging, fixed_start, head, r0, len_fixed,
                                       consumer_tidx)
            # The dQ staging buffer must outlive the last reduce's read of it (the adds
            # themselves complete without us).
            if consumer_tidx % THREADS_PER_WG < cute.arch.WARP_SIZE:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=K_FREE_BARRIER,
                              number_of_threads=self.nwg * THREADS_PER_WG)
        for _, acc, staging, scale in late:
            self.stage_gradient(acc, staging, scale, mma_g, consumer_tidx)
        cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg, number_of_threads=THREADS_PER_WG)
        for grad, _, staging, _ in late:
            self.gradient_rows_out(grad, staging, fixed_start, head, r0, len_fixed,
                                   consumer_tidx)
        if const_expr(self.fused):
            if convert != 0:
                # This warpgroup's dQ reduce-adds are complete and visible: count it in.
                if consumer_tidx % THREADS_PER_WG < cute.arch.WARP_SIZE:
                    cute.arch.cp_async_bulk_wait_group(0)
                    cute.arch.fence_proxy("async.global")
                    cute.arch.sync_warp()
                    if consumer_tidx % THREADS_PER_WG == 0:
                        # (The group again from the CTA index: no pointer kept live through
                        # the loop.)
                        cta, _, _ = cute.arch.block_idx()
                        group = cta // (pair_group * seq_tiles)
                        cute.arch.atomic_add(mSync.iterator + group, Int32(1), sem="release",
                                             scope="gpu")

    @cute.jit
    def stage_gradient(self, acc, staging, scale: Float32, mma_g, consumer_tidx: Int32):
        """A gradient accumulator times scale, in the io dtype, into this warpgroup's rows of
        the staging tile."""
        out = cute.make_rmem_tensor(acc.layout, self.dtype)
        out.store((acc.load() * scale).to(self.dtype))
        store_stmatrix(out, mma_g, staging, consumer_tidx)

    @cute.jit
    def gradient_rows_out(self, grad, staging, fixed_start: Int32, head: Int32, r0: Int32,
                          len_fixed: Int32, consumer_tidx: Int32):
        """This warpgroup's staged rows of a gradient -> its rows of grad (those in the
        sequence)."""
        D = self.head_dim
        wg = consumer_tidx // THREADS_PER_WG
        rows = cute.domain_offset((fixed_start, 0),
                                  select_modes(grad, [0, 2, 1])[None, None, head])
        copy_rows_out(cute.local_tile(staging, (WG_ROWS, D), (wg, 0)),
                      cute.local_tile(rows, (WG_ROWS, D), (r0 // WG_ROWS + wg, 0)),
                      r0 + wg * WG_ROWS, len_fixed, consumer_tidx % THREADS_PER_WG)

    @cute.jit
    def stream_step(self, i: Int32, state, ops, where, sU, sW, sdS, sdQ, pipe_stream, mdQacc,
                    tma_dq, consumer_tidx: Int32, issue_next: cutlass.Constexpr,
                    dq_of_previous: cutlass.Constexpr = True):
        """Streamed tile i (S and dP already issued): gradients, then the next tile's S and
        dP (issue_next), then the previous tile's dQ partial (fused; not when
        dq_of_previous is False: step 0, whose previous tile does not exist). Returns the
        next stage."""
        (mma_s, mma_g, mma_dq, acc_s, acc_dp, acc_a, acc_b, p_regs, ds_regs, tGrP, tGrdS,
         tGrUt, tGrWt, tSrX, tSrY, tSrU, tSrW, dq_parts) = ops
        (row_i, first_col, func, mFunc, q_start, len_q, len_k, off, window_left, window_right,
         half_alpha, scale_dq, s_min, tiles, len_stream, head) = where
        C = STREAM_ROWS
        s = s_min + self.stream_step_place(i, tiles)[1]
        warpgroup.wait_group(0)
        self.scores_to_operands(acc_s, acc_dp, p_regs, ds_regs, half_alpha)
        # Only tiles that cut a window edge or a sequence end are masked (most of a causal
        # pass sees whole tiles).
        masked = self.tile_needs_mask(s, row_i[0] // WG_ROWS * WG_ROWS, len_q, len_k, off,
                                      window_left, window_right)
        keep = [Uint32(0xFFFFFFFF), Uint32(0xFFFFFFFF)]
        if masked:
            keep = self.keep_bits(row_i, first_col + s * C, func, mFunc, q_start, len_q,
                                  len_k, off, window_left, window_right)
            if const_expr(not self.mask_between_gemms):
                self.mask_rows(keep, p_regs, ds_regs)
        if const_expr(self.want_p):
            if const_expr(self.mask_between_gemms):
                if masked:
                    self.mask_rows(keep, p_regs, None)
            self.gemm(mma_g, acc_b, tGrP, tGrWt[None, None, None, state.index],
                      accumulate=True)
        if const_expr(self.want_ds):
            if const_expr(self.mask_between_gemms):
                if masked:
                    self.mask_rows(keep, None, ds_regs)
            self.gemm(mma_g, acc_a, tGrdS, tGrUt[None, None, None, state.index],
                      accumulate=True)
        if const_expr(self.fused):
            # dV and dK run while dS is staged; the dQ product is one tile behind (the
            # previous tile's, from both warpgroups' halves), so neither warpgroup waits for
            # the other's current tile: one's scores can overlap the other's products.
            # (Where step 0 is not peeled (D <= 64) it multiplies buffer 1 for nothing: that
            # product is not sent.)
            self.ds_staged_wait(i - 1, consumer_tidx)
            store_stmatrix(ds_regs, mma_s, sdS[None, None, i & 1], consumer_tidx)
            cute.arch.fence_proxy("async.shared", space="cta")
            if const_expr(dq_of_previous):
                acc_dq, tQrdSt, tQrKt, tQsdQ = dq_parts
                self.gemm(mma_dq, acc_dq, tQrdSt[None, None, None, (i + 1) & 1],
                          tQrKt[None, None, None, 0], accumulate=False)
        warpgroup.wait_group(0)
        cute.arch.sync_warp()
        if const_expr(self.fused):
            self.ds_staged_arrive(i, consumer_tidx)
        pipe_stream.consumer_release(state)
        state = advanced(state)
        if const_expr(self.fused and dq_of_previous):
            if i > 0:
                self.stage_dq(dq_parts, self.dq_buffer(i - 1), scale_dq, consumer_tidx)
        if const_expr(issue_next):
            self.issue_scores(mma_s, acc_s, acc_dp, tSrX, tSrY, tSrU, tSrW, sU, sW,
                              pipe_stream, state,
                              s_min + self.stream_step_place(i + 1, tiles)[1], len_stream,
                              consumer_tidx)
        if const_expr(self.fused and dq_of_previous):
            if i > 0:
                self.send_dq(mdQacc, tma_dq, sdQ, i - 1, tiles, s_min, head, q_start,
                             consumer_tidx)
        return state

    @cute.jit
    def hidden_lead(self, wg_lo: Int32, s_min: Int32, count: Int32) -> Int32:
        """1 when the first streamed row this warpgroup's keys may see (wg_lo, seen_rows)
        lies past the first streamed tile s_min and more tiles follow, else 0. Causal
        self-attention: every 128-key tile's second warpgroup, whose first tile is all above
        the diagonal (1 of ~33 tiles at L = 4096, 1 of 2-8 in short sequences). Uniform
        over the warpgroup. Only where skips_lead."""
        skip = Int32(0)
        if wg_lo // STREAM_ROWS > s_min and count > 1:
            skip = Int32(1)
        return cute.arch.make_warp_uniform(skip)

    @cute.jit
    def skip_step(self, state, ds_regs, mma_s, sU, sW, sdS, pipe_stream, s: Int32,
                  len_stream: Int32, consumer_tidx: Int32):
        """Streamed tile 0 (tile s) when hidden_lead says it hides all of it: only what
        stage_hidden_tile does, then the arrival and the stage's release. The other
        warpgroup's dQ product of tile 0 (step 1, both dS halves) then adds nothing for
        these keys; tile 0's own dQ product (of "tile -1") is not needed. No wgmma here: a
        wgmma under a branch serializes them all. Returns the next stage."""
        self.stage_hidden_tile(0, state, ds_regs, mma_s, sU, sW, sdS, pipe_stream, s,
                               len_stream, consumer_tidx)
        cute.arch.sync_warp()
        self.ds_staged_arrive(0, consumer_tidx)
        cute.arch.sync_warp()
        pipe_stream.consumer_release(state)
        return advanced(state)

    @cute.jit
    def stage_hidden_tile(self, i, state, ds_regs, mma_s, sU, sW, sdS, pipe_stream, s: Int32,
                          len_stream: Int32, consumer_tidx: Int32):
        """A skipped streamed tile i (tile s), up to its dQ product: its stage waited for (a
        stage is released only after its fill), this warpgroup's share of zeroing its rows
        past the sequence end done (zero_rows is cooperative: under GQA a one-tile span
        streams the same partial tile for each query head), and zeros staged as this
        warpgroup's dS half once the other's dQ product of tile i - 2 has left the buffer."""
        pipe_stream.consumer_wait(state)
        if (s + 1) * STREAM_ROWS > len_stream:
            self.zero_rows(sU[None, None, state.index], sW[None, None, state.index],
                           len_stream - s * STREAM_ROWS, consumer_tidx)
        self.ds_staged_wait(i - 1, consumer_tidx)
        ds_regs.fill(0.0)
        store_stmatrix(ds_regs, mma_s, sdS[None, None, i & 1], consumer_tidx)
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def hidden_trail(self, wg_hi: Int32, s_max: Int32, remaining: Int32) -> Int32:
        """1 when the last streamed row this warpgroup's keys may see (wg_hi, seen_rows)
        lies before the last streamed tile s_max - 1 and it has another tile to compute,
        else 0. A local window: the first warpgroup's last tile. Uniform over the
        warpgroup. Only where skips_trail."""
        trail = Int32(0)
        if wg_hi < (s_max - 1) * STREAM_ROWS and remaining > 1:
            trail = Int32(1)
        return cute.arch.make_warp_uniform(trail)

    @cute.jit
    def dq_only_step(self, i: Int32, state, ops, where, sU, sW, sdS, sdQ, pipe_stream, mdQacc,
                     tma_dq, consumer_tidx: Int32):
        """Streamed tile i when hidden_trail says it hides all of it: stage_hidden_tile,
        then this warpgroup's dQ product of tile i - 1 (the other warpgroup's dS half of
        that tile still feeds it), the arrival, the stage's release, and that partial staged
        and sent. Returns the next stage."""
        (mma_s, mma_g, mma_dq, acc_s, acc_dp, acc_a, acc_b, p_regs, ds_regs, tGrP, tGrdS,
         tGrUt, tGrWt, tSrX, tSrY, tSrU, tSrW, dq_parts) = ops
        (row_i, first_col, func, mFunc, q_start, len_q, len_k, off, window_left, window_right,
         half_alpha, scale_dq, s_min, tiles, len_stream, head) = where
        self.stage_hidden_tile(i, state, ds_regs, mma_s, sU, sW, sdS, pipe_stream,
                               s_min + self.stream_step_place(i, tiles)[1], len_stream,
                               consumer_tidx)
        acc_dq, tQrdSt, tQrKt, _ = dq_parts
        self.gemm(mma_dq, acc_dq, tQrdSt[None, None, None, (i + 1) & 1],
                  tQrKt[None, None, None, 0], accumulate=False)
        warpgroup.wait_group(0)
        cute.arch.sync_warp()
        self.ds_staged_arrive(i, consumer_tidx)
        pipe_stream.consumer_release(state)
        state = advanced(state)
        self.stage_dq(dq_parts, self.dq_buffer(i - 1), scale_dq, consumer_tidx)
        self.send_dq(mdQacc, tma_dq, sdQ, i - 1, tiles, s_min, head, q_start, consumer_tidx)
        return state

    @cute.jit
    def mask_rows(self, keep, p_regs, ds_regs):
        """Both accumulator rows' hidden columns -> zero in P and dS (those given and used
        by the mode), row by row."""
        for h in cutlass.range_constexpr(2):
            if const_expr(self.want_p and p_regs is not None):
                self.and_keep_bits(p_regs, h, keep[h])
            if const_expr(self.want_ds and ds_regs is not None):
                self.and_keep_bits(ds_regs, h, keep[h])

    @cute.jit
    def issue_scores(self, mma_s, acc_s, acc_dp, tSrX, tSrY, tSrU, tSrW, sU, sW, pipe_stream,
                     state, s: Int32, len_stream: Int32, consumer_tidx: Int32):
        """Waits for streamed tile s (stage ``state``), zeroes its rows past the sequence end
        and issues S = X U^T and dP = Y W^T (not waited for)."""
        C = STREAM_ROWS
        pipe_stream.consumer_wait(state)
        if (s + 1) * C > len_stream:
            self.zero_rows(sU[None, None, state.index], sW[None, None, state.index],
                           len_stream - s * C, consumer_tidx)
        if const_expr(self.mode != "dv"):
            self.gemm(mma_s, acc_dp, tSrY[None, None, None, 0],
                      tSrW[None, None, None, state.index], accumulate=False)
        self.gemm(mma_s, acc_s, tSrX[None, None, None, 0],
                  tSrU[None, None, None, state.index], accumulate=False)

    @cute.jit
    def zero_rows(self, sU, sW, first_row: Int32, consumer_tidx: Int32):
        """Zeroes rows first_row.. of a stream stage's U and W (all consumer warpgroups)."""
        D, C = self.head_dim, STREAM_ROWS
        threads = self.nwg * THREADS_PER_WG
        for idx in cutlass.range(consumer_tidx, C * D, threads, unroll=1):
            row = idx // D
            if row >= first_row:
                sU[row, idx % D] = self.dtype(0.0)
                sW[row, idx % D] = self.dtype(0.0)
        # Generic-proxy stores read next by wgmma (async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=ZERO_BARRIER, number_of_threads=threads)

    @cute.jit
    def prescale_fixed(self, sX_tile, first_zero_row: Int32, consumer_tidx: Int32,
                       half_alpha: Float32):
        """This warpgroup's 64 rows of the fixed tile times alpha / 2, in place, once per CTA:
        S then leaves the wgmma as the tanh's argument, one FMUL per score fewer. Exact when
        alpha / 2 is a power of two; otherwise X is rounded once more to 16 bits, as a model
        that scales it before attention does. fused: rows first_zero_row.. become zeros (dQ
        reads every row of K)."""
        D = self.head_dim
        wg = consumer_tidx // THREADS_PER_WG
        rows = cute.local_tile(sX_tile, (WG_ROWS, D), (wg, 0))
        _, thr = row_vectors(rows, consumer_tidx % THREADS_PER_WG)
        t_s = thr.partition_S(rows)
        t_c = thr.partition_S(cute.make_identity_tensor(rows.shape))
        # One 16-byte vector at a time.
        for m in cutlass.range_constexpr(cute.size(t_s.shape[1])):
            piece = cute.make_rmem_tensor_like(t_s[None, m, None])
            cute.autovec_copy(t_s[None, m, None], piece)
            piece.store((piece.load().to(Float32) * half_alpha).to(self.dtype))
            if const_expr(self.fused):
                if wg * WG_ROWS + t_c[0, m, 0][0] >= first_zero_row:
                    piece.fill(0.0)
            cute.autovec_copy(piece, t_s[None, m, None])
        # Generic-proxy stores read next by wgmma (async proxy): fused, both warpgroups'
        # dQ products read every row.
        cute.arch.fence_proxy("async.shared", space="cta")
        if const_expr(self.fused):
            cute.arch.barrier(barrier_id=ZERO_BARRIER,
                              number_of_threads=self.nwg * THREADS_PER_WG)
        else:
            cute.arch.barrier(barrier_id=EPILOGUE_BARRIER + wg,
                              number_of_threads=THREADS_PER_WG)

    @cute.jit
    def zero_fixed_rows(self, sX, first_row: Int32, consumer_tidx: Int32):
        """fused: zeroes rows first_row.. of the fixed K tile (all consumer warpgroups)."""
        D, R = self.head_dim, self.fixed_rows
        threads = self.nwg * THREADS_PER_WG
        for idx in cutlass.range(consumer_tidx, R * D, threads, unroll=1):
            row = idx // D
            if row >= first_row:
                sX[row, idx % D] = self.dtype(0.0)
        # Generic-proxy stores read next by wgmma (async proxy).
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=ZERO_BARRIER, number_of_threads=threads)

    @cute.jit
    def scores_to_operands(self, acc_s, acc_dp, p_regs, ds_regs, half_alpha: Float32):
        """S, dP (fp32) -> P = SiLU(alpha S) and 2 dS = 2 dP SiLU'(alpha S) (16-bit)."""
        for e in cutlass.range_constexpr(cute.size(acc_s)):
            h = acc_s[e]
            if const_expr(not self.prescale):
                h = h * half_alpha
            t = tanh_approx(h)
            p = h * t + h  # P = h (1 + t): one FFMA, rounded once
            acc_s[e] = p
            if const_expr(self.want_ds):
                # 2 dS = dP (1 + t) (1 + h (1 - t)) = dP (1 + t + P (1 - t)) = dP + dP c with
                # c = t + (P - P t): three instructions (FFMA, FADD, FFMA), four with P's
                # (five before: 1 + t, P, 1 - t, FFMA, FMUL). From P and t, not h: with the
                # prescale h is the S wgmma's own register, and reading it here (ptxas sinks
                # this past the next gemm's issue) serializes every wgmma.
                c = (p - p * t) + t
                dp = acc_dp[e]
                acc_dp[e] = dp * c + dp
        if const_expr(self.want_p):
            p_regs.store(acc_s.load().to(self.dtype))
        if const_expr(self.want_ds):
            ds_regs.store(acc_dp.load().to(self.dtype))

    @cute.jit
    def tile_needs_mask(self, s: Int32, f0: Int32, len_q: Int32, len_k: Int32, off: Int32,
                        window_left: Int32, window_right: Int32) -> Boolean:
        """Whether any pair of this warpgroup's fixed rows f0 .. f0 + 63 and streamed tile s's
        rows is hidden (hides_any). Uniform over the warpgroup."""
        fixed = (f0, f0 + WG_ROWS - 1)
        streamed = (s * STREAM_ROWS, s * STREAM_ROWS + STREAM_ROWS - 1)
        queries, keys = (streamed, fixed) if const_expr(self.keys_fixed) else (fixed, streamed)
        masked = self.hides_any(*queries, *keys, len_q, len_k, off, window_left, window_right)
        return cute.arch.make_warp_uniform(Int32(masked)) != 0

    @cute.jit
    def keep_bits(self, row_i, first: Int32, func, mFunc, q_start: Int32, len_q: Int32,
                  len_k: Int32, off: Int32, window_left: Int32, window_right: Int32):
        """Per fixed row (2 per thread), bits 2 g + e of the visible streamed columns
        first + 8 g + e (g < 8, e < 2) of this tile."""
        keep = [Uint32(0), Uint32(0)]
        for r in cutlass.range_constexpr(2):
            i = row_i[r]
            if const_expr(self.keys_fixed):
                # Row: key j = i; columns: queries.
                bits = self.cols_below(len_q, first)
                if const_expr(self.right_bounded):
                    bits = bits & ~self.cols_below(i - off - window_right, first)
                if const_expr(self.left_bounded):
                    bits = bits & self.cols_below(i - off + window_left + 1, first)
                if const_expr(self.func_intervals > 0):
                    bits = bits & self.func_cols_seeing_key(i, first, mFunc, q_start, len_q)
                if i >= len_k:
                    bits = Uint32(0)
                keep[r] = bits
            else:
                bits = self.keys_seen_by_query(i, first, func, r, len_k, off, window_left,
                                               window_right)
                if i >= len_q:
                    bits = Uint32(0)
                keep[r] = bits
        return keep

    @cute.jit
    def func_cols_seeing_key(self, j: Int32, first: Int32, mFunc, q_start: Int32,
                             len_q: Int32) -> Uint32:
        """Bits of this thread's query columns whose func intervals contain key j."""
        bits = Uint32(0)
        for g in cutlass.range_constexpr(STREAM_ROWS // 8):
            for e in cutlass.range_constexpr(2):
                i = first + 8 * g + e
                if i < len_q:
                    seen = j < mFunc[0, 0, q_start + i]
                    for t in cutlass.range_constexpr(1, self.func_intervals, 2):
                        seen = seen or (mFunc[0, t, q_start + i] <= j
                                        and j < mFunc[0, t + 1, q_start + i])
                    if seen:
                        bits = bits | Uint32(1 << (2 * g + e))
        return bits

    # ---------------------------------------------------------------- fused dQ
    @cute.jit
    def dq_partitions(self, mma_dq, sX, sdS, sdQ, consumer_tidx: Int32):
        """The dQ accumulator, its operands (dS = sdS^T, K^T = sX^T, both MN-major views)
        and this thread's slots of the fp32 staging buffer (viewed as one C x D tile)."""
        D, R, C = self.head_dim, self.fixed_rows, STREAM_ROWS
        wg = consumer_tidx // THREADS_PER_WG
        wg_dq = mma_dq.get_slice(wg * THREADS_PER_WG)
        thr_dq = mma_dq.get_slice(consumer_tidx)
        sdSt = cute.composition(sdS, cute.make_ordered_layout((C, R, 2), order=(1, 0, 2)))
        sKt = cute.composition(sX, cute.make_ordered_layout((D, R, 1), order=(1, 0, 2)))
        tQrdSt = wg_dq.make_fragment_A(wg_dq.partition_A(sdSt))
        tQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(sKt))
        acc_dq = cute.make_rmem_tensor(wg_dq.partition_shape_C((C, D)), Float32)
        # each buffer viewed as one (C, (D / 2, warpgroup)) = (C, D) tile
        tQsdQ = tuple(thr_dq.partition_C(cute.group_modes(b, 1, 3)) for b in sdQ)
        return acc_dq, tQrdSt, tQrKt, tQsdQ

    @cute.jit
    def ds_staged_arrive(self, p: Int32, consumer_tidx: Int32):
        """This warpgroup staged dS^T of tile p and finished its dQ product of tile p - 1."""
        wg = consumer_tidx // THREADS_PER_WG
        cute.arch.barrier_arrive(barrier_id=DS_STAGED_BARRIER + 2 * wg + ((p + 2) & 1),
                                 number_of_threads=self.nwg * THREADS_PER_WG)

    @cute.jit
    def ds_staged_wait(self, p: Int32, consumer_tidx: Int32):
        """Until the other warpgroup has arrived for tile p (p >= -1): its dS^T half of tile
        p is in shared memory and dS buffer (p + 1) % 2 is free of its dQ product."""
        other = 1 - consumer_tidx // THREADS_PER_WG
        cute.arch.barrier(barrier_id=DS_STAGED_BARRIER + 2 * other + ((p + 2) & 1),
                          number_of_threads=self.nwg * THREADS_PER_WG)

    @cute.jit
    def stage_dq(self, dq_parts, buf: Int32, scale_dq: Float32, consumer_tidx: Int32):
        """scale_dq * (2 dS K)[:, this warpgroup's half of D] -> staging buffer ``buf``, once
        the reduce that last read it is done (the accumulator registers are free after)."""
        acc_dq, tQrdSt, tQrKt, tQsdQ = dq_parts
        wg = consumer_tidx // THREADS_PER_WG
        if consumer_tidx % THREADS_PER_WG < cute.arch.WARP_SIZE:  # the issuing warp
            # one bulk group per step: the newest dq_buffers - 1 may still be reading
            cute.arch.cp_async_bulk_wait_group(self.dq_buffers - 1, read=True)
        cute.arch.barrier(barrier_id=DQ_STAGED_BARRIER + wg, number_of_threads=THREADS_PER_WG)
        # scaled in place (the next dQ product overwrites acc_dq), then stored as column
        # pairs (8-byte stores: the staging swizzle moves 16-byte units, so a thread's two
        # adjacent columns stay adjacent)
        acc_dq.store(acc_dq.load() * scale_dq)
        for b in cutlass.range_constexpr(self.dq_buffers):
            if buf == b:
                cute.autovec_copy(acc_dq, tQsdQ[b])
        cute.arch.fence_proxy("async.shared", space="cta")

    @cute.jit
    def send_dq(self, mdQacc, tma_dq, sdQ, p: Int32, tiles: Int32, s_min: Int32, head: Int32,
                q_start: Int32, consumer_tidx: Int32):
        """Stream step p's staged partial (staging buffer dq_buffer(p)) -> TMA reduce-add
        into the fp32 accumulator rows of its query tile (s_min + p % tiles of query head
        head x group + p // tiles). Rows past the sequence add exact zeros (their dS
        columns are masked and K has no NaN)."""
        D, C = self.head_dim, STREAM_ROWS
        buf = self.dq_buffer(p)
        head_offset, tile_offset = self.stream_step_place(p, tiles)
        stream_head = head * self.group + head_offset
        s = s_min + tile_offset
        wg = consumer_tidx // THREADS_PER_WG
        cute.arch.barrier(barrier_id=DQ_STAGED_BARRIER + wg, number_of_threads=THREADS_PER_WG)
        if consumer_tidx % THREADS_PER_WG < cute.arch.WARP_SIZE:
            half = D // self.nwg
            g = cute.local_tile(cute.domain_offset((q_start, 0), mdQacc[None, None, stream_head]),
                                (C, half), (s, wg))
            # The whole warp calls the copy: the TMA copy elects its one issuing lane itself
            # (an elect_one around it nests elect.sync inside a one-lane branch: undefined,
            # and it hung multi-tile CTAs). Bulk groups are per thread; the warp commits and
            # later waits together, the lanes without a copy on empty groups.
            for b in cutlass.range_constexpr(self.dq_buffers):
                if buf == b:
                    t_s, t_g = cpasync.tma_partition(tma_dq, 0, cute.make_layout(1),
                                                     cute.group_modes(sdQ[b], 0, 2),
                                                     cute.group_modes(g, 0, 2))
                    cute.copy(tma_dq, t_s[None, wg], t_g)
            cute.arch.cp_async_bulk_commit_group()

    # ---------------------------------------------------------------- dQ conversion
    @cute.jit
    def convert_finished_groups(self, mAcc, mdQ, mSync, mCuSeqlensQ, progress, group: Int32,
                                pair_group: Int32, pairs: Int32, tiles: Int32,
                                q_chunks: Int32, staging):
        """fused, dense numbering, each idle producer warp of a CTA of L2 group ``group``:
        claims the dQ slices of earlier groups, oldest first, once every CTA of that group
        has counted its reduce-adds in, and converts them (dq = acc, acc = 0), while this
        CTA's producer still has CLAIM_MARGIN streamed tiles to load; stops when it is done
        or no earlier group has a slice left. Any later CTA may convert a finished
        group: when a group completes, the CTAs of the next one are mostly the light tiles
        near its end, with too few tiles left to convert much (run 27a: +1 % at 4k with the
        next group alone converting). Nothing here waits on another CTA: what no warp
        claims, DqFinishSm90 converts after the kernel."""
        if group > 0:
            n_groups = (pairs + pair_group - 1) // pair_group
            expected = pair_group * tiles * self.nwg  # every group before the last is full
            slices = pair_group * q_chunks
            lowest = mSync.iterator + extra_at(n_groups, LOWEST_WORD)  # groups below: claimed
            lane = cute.arch.lane_idx()
            prev = cute.arch.load(lowest, Int32, sem="relaxed", scope="gpu")
            ready = Int32(0)
            going = Int32(1)
            while going != 0:
                # (Atomics on the progress words: they are hints, read and written without
                # barriers.)
                if cute.arch.atomic_add(progress.iterator + PROGRESS_DONE, Int32(0)) != 0:
                    going = Int32(0)
                elif prev >= group:
                    going = Int32(0)
                else:
                    if ready == 0:
                        if cute.arch.load(mSync.iterator + prev, Int32, sem="acquire",
                                          scope="gpu") >= expected:
                            ready = Int32(1)
                    remaining = cute.arch.atomic_add(progress.iterator + PROGRESS_REMAINING,
                                                     Int32(0))
                    if ready != 0 and remaining >= CLAIM_MARGIN:
                        k = Int32(0)
                        if lane == 0:
                            k = cute.arch.atomic_add(mSync.iterator + claims_at(n_groups)
                                                     + prev, Int32(1))
                        k = cute.arch.shuffle_sync(k, 0)
                        if k < slices:
                            # The claim order (DqFinishSm90 decodes it too): slice k = chunk
                            # * pairs in the group + the pair's place (prev is a full group).
                            chunk = k // pair_group
                            convert_slice(mAcc, mdQ, mCuSeqlensQ,
                                          prev * pair_group + k - chunk * pair_group, chunk,
                                          lane, self.num_kv_heads, self.group, staging)
                        else:  # group prev is claimed: on to the next, and tell the others
                            if lane == 0:
                                cute.arch.atomic_max(lowest, prev + 1)
                            prev = prev + 1
                            ready = Int32(0)
                    else:
                        cute.arch.inline_ptx("nanosleep.u32 {$r0};",
                                             read_only_args=[Int32(POLL_NS)])


@cute.jit
def convert_slice(mAcc, mdQ, mCuSeqlensQ, pair: Int32, chunk: Int32, lane: Int32,
                  num_kv_heads: cutlass.Constexpr, group: cutlass.Constexpr, staging):
    """Query rows chunk * SLICE_ROWS .. + SLICE_ROWS of (sequence, kv head) pair ``pair``
    (pair = sequence * H_kv + kv head), all its query heads: dq = acc, acc = 0 (one warp)."""
    batch = pair // num_kv_heads
    q_start = mCuSeqlensQ[batch]
    rows = mCuSeqlensQ[batch + 1] - q_start - chunk * SLICE_ROWS
    if rows > 0:
        head0 = (pair - batch * num_kv_heads) * group
        first = q_start + chunk * SLICE_ROWS
        # Rolled loops here and in convert_rows: the converting warps have 24 registers, and
        # unrolled (GQA: a copy per query head) ptxas spilled over 1 KB of their state.
        for j in cutlass.range(group, unroll=1):
            convert_rows(mAcc, mdQ, first, rows, head0 + j, lane, staging)


@cute.jit
def convert_rows(mAcc: cute.Tensor, mdQ: cute.Tensor, first: Int32, rows: Int32,
                 head: Int32, lane: Int32, staging):
    """Rows first .. first + min(rows, SLICE_ROWS) - 1 of head ``head``: mdQ = mAcc (fp32 ->
    16-bit) and mAcc = 0, by one warp. The fp32 rows come into ``staging`` (this warp's
    SLICE_ROWS x D fp32 in shared memory) by cp.async, all at once: the warps that convert
    beside the fused kernel's consumers have 24 registers, too few to keep more than two
    16-byte loads in flight, and a slice then took several DRAM round trips. Each lane reads
    back only what it copied, so no barrier is needed."""
    D = cute.size(mAcc, mode=[2])
    chunks = SLICE_ROWS * D // 4 // cute.arch.WARP_SIZE  # 16-byte pieces per lane
    per_row = D // 4
    half2 = "bf16x2" if const_expr(mdQ.element_type == cutlass.BFloat16) else "f16x2"
    # 64-bit addresses: the workspace may hold more than 2^31 elements.
    acc_row, acc_head = mAcc.stride[0], mAcc.stride[1]
    dq_row, dq_head = mdQ.stride[0], mdQ.stride[1]
    dq_bytes = mdQ.element_type.width // 8
    acc_base = mAcc.iterator.toint() + Int64(head) * acc_head * 4
    dq_base = mdQ.iterator.toint() + Int64(head) * dq_head * dq_bytes
    smem = staging.toint()
    for c in cutlass.range(chunks, unroll=1):
        piece = c * cute.arch.WARP_SIZE + lane
        r = cutlass.min(piece // per_row, rows - 1)  # rows past the slice: read nothing
        size = Int32(16) if piece // per_row < rows else Int32(0)
        src = acc_base + (Int64(first + r) * acc_row + piece % per_row * 4) * 4
        cute.arch.inline_ptx("cp.async.cg.shared.global [{$r0}], [{$r1}], 16, {$r2};",
                             read_only_args=[smem + piece * 16, src, size])
    cute.arch.inline_ptx("cp.async.commit_group;")
    cute.arch.inline_ptx("cp.async.wait_group 0;")
    for c in cutlass.range(chunks, unroll=1):
        piece = c * cute.arch.WARP_SIZE + lane
        r = piece // per_row
        on = Int32(r < rows)
        col = piece % per_row * 4
        src = acc_base + (Int64(first + r) * acc_row + col) * 4
        dst = dq_base + (Int64(first + r) * dq_row + col) * dq_bytes
        cute.arch.inline_ptx(
            "{ .reg .pred p; .reg .f32 x0, x1, x2, x3, z; .reg .b32 lo, hi; "
            "setp.ne.b32 p, {$r0}, 0; ld.shared.v4.f32 {x0, x1, x2, x3}, [{$r1}]; "
            "mov.f32 z, 0f00000000; @p st.global.v4.f32 [{$r2}], {z, z, z, z}; "
            "cvt.rn." + half2 + ".f32 lo, x1, x0; cvt.rn." + half2 + ".f32 hi, x3, x2; "
            "@p st.global.v2.b32 [{$r3}], {lo, hi}; }",
            read_only_args=[on, smem + piece * 16, src, dst])


FINISH_WARPS = 4
FINISH_CTAS = 512  # at most: every warp strides over the slices past the claimed groups


class DqFinishSm90:
    """After the fused backward (dense numbering): converts the dQ slices its idle warps did
    not claim (dq = acc, acc = 0) and clears the sync words for the next launch. Slices are
    numbered group by group (slice k of group g as the fused kernel claims them); the warps
    of at most FINISH_CTAS CTAs stride over those of the groups from the oldest one with
    unclaimed slices (the hint word) on, so the groups the kernel converted cost nothing (a
    CTA per 4 slices of every group spent 9 us at causal 4k on claim counts alone)."""

    def __init__(self, num_heads: int, num_kv_heads: int):
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mSync: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, pair_group: Int32, max_seqlen_q: Int32,
                 stream: cuda.CUstream):
        q_chunks = (max_seqlen_q + SLICE_ROWS - 1) // SLICE_ROWS
        pairs = self.num_kv_heads * cutlass.max(mCuSeqlensQ.shape[0] - 1, 1)
        ctas = cutlass.max(cutlass.min((pairs * q_chunks + FINISH_WARPS - 1) // FINISH_WARPS,
                                       FINISH_CTAS), 1)
        self.kernel(mdQacc, mdQ, mSync, mCuSeqlensQ, pairs, pair_group, q_chunks,
                    ctas).launch(grid=[ctas, 1, 1],
                                 block=[FINISH_WARPS * cute.arch.WARP_SIZE, 1, 1],
                                 stream=stream)

    @cute.kernel
    def kernel(self, mAcc: cute.Tensor, mdQ: cute.Tensor, mSync: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, pairs: Int32, pair_group: Int32, q_chunks: Int32,
               ctas: Int32):
        cta, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        lane = cute.arch.lane_idx()
        D = cute.size(mAcc, mode=[2])

        @cute.struct
        class Staging:
            convert: cute.struct.Align[cute.struct.MemRange[Float32,
                                                            FINISH_WARPS * SLICE_ROWS * D], 128]

        storage = cutlass.memory.SmemAllocator().allocate(Staging)
        staging = storage.convert.data_ptr() + warp * SLICE_ROWS * D
        n_groups = (pairs + pair_group - 1) // pair_group
        group_slices = pair_group * q_chunks  # of a full group (every group but the last)
        # Groups below the hint are claimed whole (the fused kernel's warps converted them).
        lowest = cutlass.min(mSync[extra_at(n_groups, LOWEST_WORD)], n_groups)
        for s in cutlass.range(lowest * group_slices + cta * FINISH_WARPS + warp,
                               pairs * q_chunks, ctas * FINISH_WARPS, unroll=1):
            group = s // group_slices
            k = s - group * group_slices
            in_group = cutlass.min(pair_group, pairs - group * pair_group)
            # the fused kernel's claim order: slice k = chunk * in_group + the pair's place
            chunk = k // in_group
            if k >= mSync[claims_at(n_groups) + group]:
                convert_slice(mAcc, mdQ, mCuSeqlensQ, group * pair_group + k - chunk * in_group,
                              chunk, lane, self.num_kv_heads, self.group, staging)
        # The last CTA out clears the sync words: every CTA has read what it needed.
        cute.arch.sync_threads()
        if warp == 0:
            finished = Int32(0)
            if lane == 0:
                cute.arch.fence_acq_rel_gpu()
                finished = cute.arch.atomic_add(
                    mSync.iterator + extra_at(n_groups, FINISHED_WORD), Int32(1))
            finished = cute.arch.shuffle_sync(finished, 0)
            if finished == ctas - 1:
                cute.arch.fence_acq_rel_gpu()
                for w in cutlass.range(lane, extra_at(n_groups, SYNC_EXTRA_WORDS),
                                       cute.arch.WARP_SIZE, unroll=1):
                    mSync[w] = Int32(0)
