"""One compiled op per key for the allocating functions (hstu_lmsd_*, hstu_attention_*)."""
from __future__ import annotations

import threading
from typing import Callable, Dict

_ops: Dict[tuple, object] = {}
_lock = threading.Lock()


def compiled_op(key: tuple, make: Callable[[], object]):
    """The op for ``key``, made, validated and compiled on first use."""
    op = _ops.get(key)
    if op is None:
        op = make().check_support().compile()
        with _lock:
            op = _ops.setdefault(key, op)
    return op
