"""precast: compile-once / execute-many CuTe DSL kernels for generative-recommender and
linear-attention models."""
__version__ = "0.1.0"

from .lifecycle.tensor_desc import TensorDesc  # noqa: E402
from .lifecycle.op import OP_REGISTRY, Op  # noqa: E402
from .lifecycle.cache import ArtifactCache, ArtifactMissing, default_cache  # noqa: E402
from .lifecycle.lmsd import HstuLmsdBwdSm90, HstuLmsdFwdSm90  # noqa: E402
from .hstu_lmsd import hstu_lmsd, hstu_lmsd_backward, hstu_lmsd_forward  # noqa: E402
from .lifecycle.hstu_attention import HSTUFwdSm90  # noqa: E402
from .lifecycle.hstu_attention_bwd import HSTUBwdSm90  # noqa: E402
from .hstu_attention import (hstu_attention, hstu_attention_backward,  # noqa: E402
                             hstu_attention_forward)
from .lifecycle.gdn_fwd import GdnFwdSm90  # noqa: E402
from .lifecycle.gdn_bwd import GdnBwdSm90  # noqa: E402
from .linear_attention import gated_delta_net, gated_delta_net_backward  # noqa: E402

__all__ = ["TensorDesc", "Op", "OP_REGISTRY", "ArtifactCache", "ArtifactMissing", "default_cache",
           "HstuLmsdFwdSm90", "HstuLmsdBwdSm90", "hstu_lmsd_forward", "hstu_lmsd_backward",
           "hstu_lmsd", "HSTUFwdSm90", "hstu_attention_forward", "HSTUBwdSm90",
           "hstu_attention_backward", "hstu_attention", "GdnFwdSm90", "gated_delta_net",
           "GdnBwdSm90", "gated_delta_net_backward"]
