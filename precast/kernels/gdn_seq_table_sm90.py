"""The Gated DeltaNet kernels' per-sequence offsets, made on the device once per call.

Stage 1 and the backward's chunk kernel number their CTAs by packed chunk (the chunks of 64
tokens of every sequence, in order); the recurrences need each sequence's first packed chunk
and first checkpoint row. Without a table each CTA rebuilds those from cu_seqlens: a warp
scan of 32 sequences per step (stage 1) or a serial sum over the sequences before its own
(the recurrences), O(N) per CTA and O(N^2 H) per launch: seconds at tens of thousands of
sequences. With the table every lookup is one load, or a 32-ary warp search
(``find_in_table``: log32(N) steps).

The table (2 (N + 1) int32) holds
    [0, N]:          chunks before sequence b (entry N: all chunks);
    [N + 1, 2N + 1]: checkpoint rows before sequence b, ceil(len / every) each (zeros when
                     every is 0).
One CTA of THREADS threads makes it in ceil((N + 1) / THREADS) steps of a block-wide scan.
Kernels always take a table argument (``has_table``): any other length (the op passes
cu_seqlens itself) means "no table", and they scan cu_seqlens (the op skips the table for
N <= 32, where a scan is one warp step, and while a stream captures without the table's
buffer).
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32

from .attention_sm90 import warp_inclusive_sum
from .gdn_layout import CHUNK

THREADS = 1024
WARPS = THREADS // 32


@cute.jit
def has_table(mSeqTable, mCuSeqlens) -> Boolean:
    """Whether ``mSeqTable`` is a table (2 (N + 1) entries) rather than the stand-in."""
    return mSeqTable.shape[0] == 2 * mCuSeqlens.shape[0]


@cute.jit
def find_in_table(mSeqTable, first: Int32, n: Int32, value: Int32):
    """The sequence b < n whose numbers [table[first + b], table[first + b + 1]) hold
    ``value`` (the largest b with table[first + b] <= value: empty sequences are skipped),
    or n when value >= table[first + n]. The whole warp takes part: 32 probes per step."""
    lane = cute.arch.lane_idx()
    found = n
    if value < mSeqTable[first + n]:
        lo = Int32(0)  # table[first + lo] <= value (table[first] is 0)
        hi = n  # the answer is below hi
        while hi - lo > 1:
            step = (hi - lo + 31) // 32
            probe = lo + lane * step
            ok = Boolean(False)
            if probe < hi:
                ok = mSeqTable[first + probe] <= value
            # ok holds for lanes 0 .. k (the table never decreases): k = count - 1
            k = cute.arch.popc(cute.arch.vote_ballot_sync(ok)) - 1
            lo = lo + k * step
            hi = cutlass.min(lo + step, hi)
        found = lo
    return found


class GdnSeqTableSm90:
    """table (2 (N + 1),) int32 from cu_seqlens (N + 1,) int32 and the checkpoint interval
    (0: no checkpoint rows)."""

    @cute.jit
    def __call__(self, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor, every: Int32,
                 stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            totals: cute.struct.MemRange[Int32, 2 * WARPS]

        self.storage = SharedStorage
        self.kernel(mCuSeqlens, mSeqTable, every).launch(grid=[1, 1, 1],
                                                         block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCuSeqlens: cute.Tensor, mSeqTable: cute.Tensor, every: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        warp = tidx // 32
        lane = cute.arch.lane_idx()
        n = mCuSeqlens.shape[0] - 1
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.storage)
        totals = storage.totals.get_tensor(cute.make_layout((2, WARPS), stride=(WARPS, 1)))
        carry_chunks = Int32(0)
        carry_rows = Int32(0)
        for step in cutlass.range((n + THREADS) // THREADS, unroll=1):
            b = step * THREADS + tidx
            chunks = Int32(0)
            rows = Int32(0)
            if b < n:
                length = mCuSeqlens[b + 1] - mCuSeqlens[b]
                chunks = (length + CHUNK - 1) // CHUNK
                if every > 0:
                    rows = (length + every - 1) // every
            upto_chunks = warp_inclusive_sum(chunks)
            upto_rows = warp_inclusive_sum(rows)
            if lane == 31:
                totals[0, warp] = upto_chunks
                totals[1, warp] = upto_rows
            cute.arch.sync_threads()
            before_chunks = Int32(0)
            before_rows = Int32(0)
            all_chunks = Int32(0)
            all_rows = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                if w < warp:
                    before_chunks = before_chunks + totals[0, w]
                    before_rows = before_rows + totals[1, w]
                all_chunks = all_chunks + totals[0, w]
                all_rows = all_rows + totals[1, w]
            if b <= n:
                mSeqTable[b] = carry_chunks + before_chunks + upto_chunks - chunks
                mSeqTable[n + 1 + b] = carry_rows + before_rows + upto_rows - rows
            carry_chunks = carry_chunks + all_chunks
            carry_rows = carry_rows + all_rows
            # totals is rewritten by the next step
            cute.arch.sync_threads()
