"""Pure-torch reference implementations used by tests and benchmarks."""

from .lmsd import (
    lmsd_backward_reference,
    lmsd_forward_naive,
    lmsd_forward_reference,
    lmsd_mask,
    segment_count,
)
from .philox import (
    dropout_keep,
    keep_threshold,
    philox4x32_10,
    philox4x32_10_scalar,
    seed_to_key,
)

__all__ = [
    "dropout_keep",
    "keep_threshold",
    "lmsd_backward_reference",
    "lmsd_forward_naive",
    "lmsd_forward_reference",
    "lmsd_mask",
    "philox4x32_10",
    "philox4x32_10_scalar",
    "seed_to_key",
    "segment_count",
]
