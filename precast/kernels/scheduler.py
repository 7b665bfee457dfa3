"""Device side of the persistent kernels' claim counter (host side: lifecycle.launch's
SCHEDULER_COUNTER_SHAPE and own_scheduler_counter).

The counter is two int32 words: [0] the next unit of work to claim, [1] how many CTAs have
finished. It starts zeroed, and the last CTA out zeroes it again, so the next launch on the
same stream needs no memset.
"""
import cutlass.cute as cute
from cutlass import Int32

CLAIM_WORD, FINISHED_WORD = 0, 1
COUNTER_WORDS = 2  # a workspace may hold more after them (lifecycle.launch's shape agrees)


@cute.jit
def count_out(counter: cute.Tensor, ctas: Int32):
    """One thread of a CTA that has made its final claim (the one past the end) counts the
    CTA out; the last of ``ctas`` resets both words. Every CTA's claims precede its count
    (release), so no claim can land after the reset."""
    cute.arch.fence_acq_rel_gpu()
    finished = cute.arch.atomic_add(counter.iterator + FINISHED_WORD, Int32(1))
    if finished == ctas - 1:
        counter[CLAIM_WORD] = Int32(0)
        counter[FINISHED_WORD] = Int32(0)


@cute.jit
def claim_work(counter: cute.Tensor) -> Int32:
    """The next unit of work (numbers past the last one mean none is left)."""
    return cute.arch.atomic_add(counter.iterator + CLAIM_WORD, Int32(1))
