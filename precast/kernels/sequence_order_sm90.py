"""The sequences of a varlen batch, longest first, made on the device once per call.

A persistent kernel that claims work tiles in batch order starts a long sequence's heavy
tiles wherever the sequence sits in the batch: one late in the batch leaves most SMs idle
while a few finish it (the heavy-tailed batch of bench_hstu_attention: 529-563 TFLOP/s over
batch orders, 576-584 with its longest sequence first). This kernel writes the order
(a permutation of 0 .. N - 1) into the scheduler workspace after the claim counter's
words: by key length, then query length, descending; equal sequences keep their batch
order. One CTA ranks every sequence against all others from shared memory, so N is at
most THREADS.
"""
import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .scheduler import COUNTER_WORDS

THREADS = 1024
MAX_SEQUENCES = THREADS  # one sequence per thread


class SequenceOrderSm90:
    """mWorkspace[COUNTER_WORDS + rank] = b for each sequence b of cu_seqlens_q / cu_seqlens_k."""

    @cute.jit
    def __call__(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                 mWorkspace: cute.Tensor, stream: cuda.CUstream):
        @cute.struct
        class SharedStorage:
            len_q: cute.struct.MemRange[Int32, THREADS]
            len_k: cute.struct.MemRange[Int32, THREADS]

        self.storage = SharedStorage
        self.kernel(mCuSeqlensQ, mCuSeqlensK, mWorkspace).launch(
            grid=[1, 1, 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               mWorkspace: cute.Tensor):
        b, _, _ = cute.arch.thread_idx()
        n = mCuSeqlensQ.shape[0] - 1
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        s_len_q = storage.len_q.get_tensor(cute.make_layout(THREADS))
        s_len_k = storage.len_k.get_tensor(cute.make_layout(THREADS))
        len_q = Int32(0)
        len_k = Int32(0)
        if b < n:
            len_q = mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]
            len_k = mCuSeqlensK[b + 1] - mCuSeqlensK[b]
            s_len_q[b] = len_q
            s_len_k[b] = len_k
        cute.arch.sync_threads()
        if b < n:
            rank = Int32(0)
            for j in cutlass.range(n, unroll=4):
                other_k = s_len_k[j]
                other_q = s_len_q[j]
                before = (other_k > len_k) or (other_k == len_k and (
                    other_q > len_q or (other_q == len_q and j < b)))
                rank = rank + Int32(before)
            mWorkspace[COUNTER_WORDS + rank] = b
