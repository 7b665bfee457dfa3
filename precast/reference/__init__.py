"""Pure-torch reference implementations used by tests and benchmarks.

Modules: ``lmsd`` and ``philox`` (HSTU LMSD), ``hstu_attention`` (HSTU attention forward and,
through autograd, backward; FLOP counting), ``gated_delta_net`` (token-by-token and chunked
Gated DeltaNet, summaries for context parallelism).
"""

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
