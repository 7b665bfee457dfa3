"""HSTU LayerNorm-Multiply-SiLU-Dropout forward for SM90 (memory bound, one pass).

Per row: mean/rstd of x, ln = LN(x) * w + b, a = SiLU(u) or u, then up to three
dropped-out segments written to y = [a?, x?, ln * a] and one int8 mask byte per
element (bit 0 main, bit 1 x segment, bit 2 a segment).

Persistent CTAs walk blocks of rows_per_cta rows: each its first stages - 1 blocks by
number (b, b + grid, ...), then blocks claimed one at a time from a global counter, so CTAs
that run slower (SMs sharing more of their GPC's bandwidth) take fewer blocks and all end
together (a fixed share each left a tail: ~11 % of the warp slots idle by the end). Thread
0 claims a block one iteration before it loads it (the atomic's latency hides behind a
block of row work) and posts its number in the ring stage's slot (an mbarrier per slot);
the last CTA out resets the counter for the next launch. The x and u
rows of the next blocks arrive by bulk copies (cp.async.bulk: one per block and tensor when
rows are unpadded, else one per row and tensor) in a
ring of shared-memory stages, a few blocks ahead of the threads: the memory system always
has loads in flight while the threads do the Philox, LayerNorm and output work of the
current block (with one block per thread and loads into registers, each warp waited for its
own loads after the RNG, and DRAM idled while most warps computed). w and b stay in
registers for every block.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64, Int8, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync

from .activation import tanh_approx
from .philox import philox4x32_10
from .rowwise import row_sum, vector_copy_atom
from .scheduler import claim_work, count_out
from .tiling import VEC, WARP, RowTiling

MAIN_BIT, X_BIT, A_BIT = 0, 1, 2
MAX_STAGES = 4
# Shared memory the stage rings of one SM may take (of 227 KB; the rest stays L1 cache).
RING_BYTES_PER_SM = 160 * 1024


@cute.jit
def keep_halves(mask_word: Uint32, plane: cutlass.Constexpr, pair: cutlass.Constexpr) -> Uint32:
    """0xFFFF in each 16-bit half whose element keeps its value: elements 2 pair and
    2 pair + 1 of the 4 whose mask bytes ``mask_word`` holds, segment bit ``plane``. The
    shift puts that bit at each byte's top; prmt's sign mode spreads a byte's top bit over
    a whole output byte."""
    top = mask_word << Uint32(7 - plane)
    selector = 0x9988 if pair == 0 else 0xBBAA  # sign of byte 0, 0, 1, 1 (or 2, 2, 3, 3)
    return cute.arch.inline_ptx(f"prmt.b32 {{$w0}}, {{$r0}}, 0, {selector:#x};",
                                write_only_types=[Uint32], read_only_args=[top])


def forward_stages(tiling: RowTiling, elem_bytes: int, ctas_per_sm: int) -> int:
    """Ring stages per CTA: as many as fit (at most MAX_STAGES), at least 2."""
    stage_bytes = 2 * tiling.rows_per_cta * tiling.dim * elem_bytes  # x and u
    return max(2, min(MAX_STAGES, RING_BYTES_PER_SM // (ctas_per_sm * stage_bytes)))


class LmsdForwardSm90:
    def __init__(self, dtype, dim: int, apply_u_silu: bool, concat_u: bool, concat_x: bool,
                 use_dropout: bool, vecs_per_thread: int, ctas_per_sm: int):
        self.dtype = dtype
        self.dim = dim
        self.apply_u_silu = apply_u_silu
        self.concat_u = concat_u
        self.concat_x = concat_x
        self.use_dropout = use_dropout
        self.tiling = RowTiling(dim, vecs_per_thread_target=vecs_per_thread)
        # The grid is ctas_per_sm per SM: the launch bounds make that many fit (registers).
        self.bounds = {"min_blocks_per_mp": ctas_per_sm, "preferred_smem_carveout": -1}
        self.stages = forward_stages(self.tiling, dtype.width // 8, ctas_per_sm)
        # Segment slots in y, in output order.
        self.a_seg = 0 if concat_u else None
        self.x_seg = (1 if concat_u else 0) if concat_x else None
        self.main_seg = int(concat_u) + int(concat_x)
        self.planes = [MAIN_BIT] + [X_BIT] * concat_x + [A_BIT] * concat_u

    @cute.jit
    def __call__(self, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor,
                 mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
                 mCounter: cute.Tensor, eps: Float32, keep_threshold: Int64,
                 keep_scale: Float32, seed: Int64, num_ctas: Int32, stream: cuda.CUstream):
        """mCounter: int32 (2,), zero before the launch and left zero (next claim, CTAs
        finished)."""
        t = self.tiling
        rows_layout = cute.make_layout((self.stages, t.rows_per_cta, self.dim),
                                       stride=(t.rows_per_cta * self.dim, self.dim, 1))

        @cute.struct
        class SharedStorage:
            full: cute.struct.MemRange[cutlass.Int64, self.stages]
            empty: cute.struct.MemRange[cutlass.Int64, self.stages]
            posted: cute.struct.MemRange[cutlass.Int64, self.stages]  # a stage's block number
            ids: cute.struct.MemRange[Int32, self.stages]
            sums: cute.struct.MemRange[Float32, t.rows_per_cta * t.warps_per_row * 2]
            sX: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(rows_layout)],
                                  128]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(rows_layout)],
                                  128]

        self.storage = SharedStorage
        self.kernel(mX, mU, mW, mB, mY, mMean, mRstd, mMask, mCounter, eps, keep_threshold,
                    keep_scale, seed, rows_layout).launch(grid=[num_ctas, 1, 1],
                                              block=[t.num_threads, 1, 1], stream=stream,
                                              **self.bounds)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mU: cute.Tensor, mW: cute.Tensor, mB: cute.Tensor,
               mY: cute.Tensor, mMean: cute.Tensor, mRstd: cute.Tensor, mMask: cute.Tensor,
               mCounter: cute.Tensor, eps: Float32, keep_threshold: Int64,
               keep_scale: Float32, seed: Int64, rows_layout: cute.Layout):
        t = self.tiling
        tpr = const_expr(t.threads_per_row)
        vpt = const_expr(t.vecs_per_thread)
        stages = const_expr(self.stages)
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nctas, _, _ = cute.arch.grid_dim()
        lane = tidx % tpr
        row_in_cta = tidx // tpr
        num_rows = mX.shape[0]
        num_blocks = (num_rows + t.rows_per_cta - 1) // t.rows_per_cta

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        full = storage.full.data_ptr()
        empty = storage.empty.data_ptr()
        posted = storage.posted.data_ptr()
        ids = storage.ids.get_tensor(cute.make_layout(stages))
        sX = storage.sX.get_tensor(rows_layout)
        sU = storage.sU.get_tensor(rows_layout)
        sbuf = None
        if const_expr(t.warps_per_row > 1):
            sbuf = storage.sums.get_tensor(cute.make_layout((t.rows_per_cta, t.warps_per_row, 2)))
        if tidx == 0:
            for s in cutlass.range_constexpr(stages):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, t.num_threads // WARP)
                cute.arch.mbarrier_init(posted + s, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # The CTA's i-th block: bidx + i * nctas for i < stages - 1 (all CTAs together: the
        # first (stages - 1) * nctas blocks), then (stages - 1) * nctas + a claim. Its number
        # goes to stage i % stages' slot; a number >= num_blocks ends the CTA.
        claimed_from = (stages - 1) * nctas
        row_bytes = self.dim * (self.dtype.width // 8)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.dtype,
                                   num_bits_per_copy=self.dim * self.dtype.width)
        claim = Int32(0)
        claiming = Boolean(False)
        if tidx == 0:
            for i in cutlass.range_constexpr(stages - 1):
                self.post_block(mX, mU, sX, sU, bulk, full, posted, ids, bidx + i * nctas, i,
                                num_rows, num_blocks, row_bytes)
            claiming = bidx + (stages - 2) * nctas < num_blocks
            if claiming:
                claim = claim_work(mCounter)

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
        rX = cute.make_rmem_tensor(frag, self.dtype)
        rU = cute.make_rmem_tensor(frag, self.dtype)
        rY = cute.make_rmem_tensor(frag, self.dtype)
        rWords = cute.make_rmem_tensor(cute.make_layout((2, vpt)), Uint32)
        x = cute.make_rmem_tensor(frag, Float32)
        # Dropout decisions depend only on (seed, row, column, plane): each block's are made
        # during the previous block, between its loads and its row reductions, where the
        # Philox work fills the shuffles' latency.
        # Rows spanning several warps make theirs before the wait for the row's data instead
        # (measured: 0.76 -> 0.67 x copy at D = 1024 with the Philox work between their
        # barriers).
        rng_ahead = const_expr(self.use_dropout and t.warps_per_row == 1)
        rNext = None
        block = bidx
        if const_expr(rng_ahead):
            rNext = cute.make_rmem_tensor(cute.make_layout((2, vpt)), Uint32)
            self.dropout_words(rNext, block * t.rows_per_cta + row_in_cta, num_rows, lane,
                               seed, keep_threshold)

        i = Int32(0)
        while block < num_blocks:
            stage = i % stages
            phase = (i // stages) % 2
            if tidx == 0:
                if claiming:
                    # Refill the stage read in the previous iteration, stages - 1 blocks
                    # ahead, with the block claimed in the previous iteration; claim the next.
                    ahead_block = claimed_from + claim
                    claiming = ahead_block < num_blocks
                    if claiming:
                        claim = claim_work(mCounter)
                    prev = (i + stages - 1) % stages
                    if i > 0:
                        cute.arch.mbarrier_wait(empty + prev, ((i - 1) // stages) % 2)
                    self.post_block(mX, mU, sX, sU, bulk, full, posted, ids, ahead_block, prev,
                                    num_rows, num_blocks, row_bytes)
            # The next block's number (posted stages - 2 iterations ago, at the latest in
            # this one's refill above): its rows' dropout words are made during this block.
            cute.arch.mbarrier_wait(posted + (i + 1) % stages, ((i + 1) // stages) % 2)
            next_block = ids[(i + 1) % stages]
            row = block * t.rows_per_cta + row_in_cta
            row_ok = row < num_rows
            row_c = row if row_ok else Int32(0)

            if const_expr(self.use_dropout and not rng_ahead):
                self.dropout_words(rWords, row, num_rows, lane, seed, keep_threshold)
            cute.arch.mbarrier_wait(full + stage, phase)
            rX.fill(0.0)
            rU.fill(0.0)
            for v in cutlass.range_constexpr(vpt):
                j = lane + v * tpr
                if const_expr(t.even) or j < t.num_vecs:
                    cute.autovec_copy(cute.local_tile(sX[stage, row_in_cta, None], (VEC,), (j,)),
                                      rX[None, v])
                    cute.autovec_copy(cute.local_tile(sU[stage, row_in_cta, None], (VEC,), (j,)),
                                      rU[None, v])
            # The warp has read its rows of this stage: one arrival per warp frees it. The
            # proxy fence orders these generic-proxy reads before the bulk copies (async
            # proxy) that refill the stage. (racecheck still reports the refill as racing
            # with lanes 1-31's reads: it does not carry the warp barrier over to lane 0's
            # arrival. Every thread arriving silences it but costs 1-2.5 %, run 30d.)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_warp()
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive(empty + stage)

            x.store(rX.load().to(Float32))
            partial = Float32(0.0)
            for e in cutlass.range_constexpr(VEC * vpt):
                partial = partial + x[e]
            if const_expr(rng_ahead):
                rWords.store(rNext.load())
                self.dropout_words(rNext, next_block * t.rows_per_cta + row_in_cta, num_rows,
                                   lane, seed, keep_threshold)
            # (Rows spanning warps: each sbuf slot is rewritten only after the barrier of the
            # other slot, which every reader of the previous block has passed.)
            mean = row_sum(partial, t, sbuf, 0, True) * Float32(1.0 / self.dim)
            partial = Float32(0.0)
            for v in cutlass.range_constexpr(vpt):
                sq = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    d = x[e, v] - mean
                    sq = sq + d * d
                if const_expr(t.even):
                    partial = partial + sq
                else:
                    # Unread vectors hold zeros; they must not add mean^2 to the variance.
                    if lane + v * tpr < t.num_vecs:
                        partial = partial + sq
            var = row_sum(partial, t, sbuf, 1, True) * Float32(1.0 / self.dim)
            rstd = cute.math.rsqrt(var + eps)
            if row_ok and lane == 0:
                mMean[row] = mean
                mRstd[row] = rstd
            self.write_row(mY, mMask, x, rU, rW, rB, rY, rWords, atom, mask_atom, mean, rstd,
                           keep_scale, row_c, row_ok, lane)
            block = next_block
            i = i + 1
        if tidx == 0:
            count_out(mCounter, nctas)

    @cute.jit
    def dropout_words(self, rWords, row: Int32, num_rows: Int32, lane: Int32, seed: Int64,
                      keep_threshold: Int64):
        """The mask bytes of the thread's elements of ``row`` (any row past the end: 0),
        four per word: bit ``plane`` of byte q set when the element keeps its value."""
        t = self.tiling
        row_c = row if row < num_rows else Int32(0)
        k0 = Uint32(seed)
        k1 = Uint32(seed >> Int64(32))
        threshold = Uint32(keep_threshold)
        rWords.fill(0)
        for v in cutlass.range_constexpr(t.vecs_per_thread):
            j = lane + v * t.threads_per_row
            for plane in self.planes:
                # Counter (row, column // 4, plane, 0); word column % 4.
                for half in cutlass.range_constexpr(2):
                    w = philox4x32_10(Uint32(row_c), Uint32(j * 2 + half), Uint32(plane),
                                      Uint32(0), k0, k1)
                    for q in cutlass.range_constexpr(4):
                        if w[q] >= threshold:
                            rWords[half, v] = rWords[half, v] | Uint32(1 << (8 * q + plane))

    @cute.jit
    def post_block(self, mX, mU, sX, sU, bulk, full, posted, ids, block: Int32, stage: Int32,
                   num_rows: Int32, num_blocks: Int32, row_bytes: cutlass.Constexpr):
        """Thread 0: the block's number into the stage's slot (any number >= num_blocks
        ends the readers' loop), then its loads when it exists."""
        ids[stage] = block
        cute.arch.mbarrier_arrive(posted + stage)
        if block < num_blocks:
            self.load_block(mX, mU, sX, sU, bulk, full, block, stage, num_rows, row_bytes)

    @cute.jit
    def load_block(self, mX, mU, sX, sU, bulk, full, block: Int32, stage: Int32,
                   num_rows: Int32, row_bytes: cutlass.Constexpr):
        """Bulk copies of a block's x and u rows (those that exist) into a ring stage."""
        t = self.tiling
        first = block * t.rows_per_cta
        rows = cutlass.min(num_rows - first, t.rows_per_cta)
        cute.arch.mbarrier_arrive_and_expect_tx(full + stage, rows * 2 * row_bytes)
        block_elems = const_expr(t.rows_per_cta * self.dim)
        for m, s_rows in ((mX, sX), (mU, sU)):
            if rows == t.rows_per_cta and m.stride[0] == self.dim:
                # Unpadded rows: the whole block is one contiguous copy (the copy engine's
                # rate per copy, not bytes, limits row-sized copies).
                whole = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), self.dtype,
                                            num_bits_per_copy=block_elems * self.dtype.width)
                src = cute.make_tensor(m[first, None].iterator, cute.make_layout(block_elems))
                dst = cute.make_tensor(s_rows[stage, 0, None].iterator,
                                       cute.make_layout(block_elems))
                cute.copy(whole, src, dst, mbar_ptr=full + stage)
            else:
                for r in cutlass.range(rows, unroll=1):
                    cute.copy(bulk, m[first + r, None], s_rows[stage, r, None],
                              mbar_ptr=full + stage)

    @cute.jit
    def write_row(self, mY, mMask, x, rU, rW, rB, rY, rWords, atom, mask_atom, mean: Float32,
                  rstd: Float32, keep_scale: Float32, row: Int32, row_ok, lane: Int32):
        """The row's y segments and mask bytes from registers (stored when row_ok)."""
        t = self.tiling
        tpr = const_expr(t.threads_per_row)
        vpt = const_expr(t.vecs_per_thread)
        gY = mY[row, None]
        gM = mMask[row, None] if const_expr(self.use_dropout) else None
        # Inverted dropout's 1 / (1 - p) is folded into a once (main = ln * a inherits it).
        scale = keep_scale if const_expr(self.use_dropout) else Float32(1.0)
        half_scale = scale * Float32(0.5)
        shift = -mean * rstd  # LN as one FFMA: x * rstd - mean * rstd
        for v in cutlass.range_constexpr(vpt):
            j = lane + v * tpr
            a = cute.make_rmem_tensor((VEC,), Float32)
            main = cute.make_rmem_tensor((VEC,), Float32)
            for e in cutlass.range_constexpr(VEC):
                u = rU[e, v].to(Float32)
                if const_expr(self.apply_u_silu):
                    # SiLU(u) = h + h tanh(h), h = u / 2; scaled: hs + hs tanh(h).
                    hs = u * half_scale
                    a[e] = hs + hs * tanh_approx(u * Float32(0.5))
                else:
                    a[e] = u * scale if const_expr(self.use_dropout) else u
                ln = (x[e, v] * rstd + shift) * rW[e, v].to(Float32) + rB[e, v].to(Float32)
                main[e] = ln * a[e]
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
                    rY[e, v] = val.to(self.dtype)
                if const_expr(self.use_dropout):
                    # Dropped elements: their 16 bits of the packed pair cleared by a mask made
                    # from the mask byte's plane bit (2 integer ops per pair; a select per
                    # element after packing cost 7).
                    pairs = cute.recast_tensor(rY, Uint32)
                    for k in cutlass.range_constexpr(VEC // 2):
                        pairs[k, v] = pairs[k, v] & keep_halves(rWords[k // 2, v], plane, k % 2)
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(atom, rY[None, v],
                              cute.local_tile(gY, (VEC,), (seg * t.num_vecs + j,)))
            if const_expr(self.use_dropout):
                if row_ok and (const_expr(t.even) or j < t.num_vecs):
                    cute.copy(mask_atom, cute.recast_tensor(rWords[None, v], Int8),
                              cute.local_tile(gM, (VEC,), (j,)))
