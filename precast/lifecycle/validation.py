"""Validation rules shared by check_support() (on descriptors) and execute() (on tensors).

Each rule names the tensor, the rule and what would be accepted. The functions take either
a TensorDesc or a torch.Tensor and read only host-side metadata (never device memory).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np
import torch

from .tensor_desc import TensorDesc, dtype_name

INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)  # kernels take float scalars


def _facts(t):
    if isinstance(t, torch.Tensor):
        ptr = t.data_ptr()
        align = 256 if ptr == 0 else (ptr & -ptr)
        return t.dtype, tuple(t.shape), t.stride(), t.device.type, min(align, 256)
    if isinstance(t, TensorDesc):  # "cuda:0" describes a cuda tensor too
        return t.dtype, t.shape, t.stride, t.device.split(":")[0], t.alignment
    raise TypeError(f"expected a torch.Tensor or TensorDesc, got {type(t).__name__}")


def _fmt_dtypes(dtypes) -> str:
    return " or ".join(dtype_name(d) for d in dtypes)


def check_value(cond: bool, exc: type, message: str) -> None:
    if not cond:
        raise exc(message)


def check_tensor(name: str, t, *, dtypes: Sequence[torch.dtype], shape: Sequence[Optional[int]],
                 row_multiple: int = 1, align: int = 16, contiguous: bool = False,
                 device: str = "cuda", max_span: int = INT32_MAX) -> Tuple[int, ...]:
    """Checks one tensor; ``None`` in ``shape`` is a free (runtime) extent. Returns its shape.

    Rules: dtype, rank, extents, device type, innermost stride 1, every outer stride a
    multiple of ``row_multiple`` elements (each row starts 16-byte aligned for vector access),
    no two elements at one address, base address ``align`` bytes, (``contiguous``) the
    canonical packed layout, and at most ``max_span`` addressed elements (kernels index with
    32-bit offsets unless they declare 64-bit strides).
    """
    dtype, tshape, stride, dev, alignment = _facts(t)
    if dtype not in dtypes:
        raise TypeError(f"{name}: dtype {dtype_name(dtype)} is not supported; expected "
                        f"{_fmt_dtypes(dtypes)}")
    if len(tshape) != len(shape):
        raise ValueError(f"{name}: expected a rank-{len(shape)} tensor of shape "
                         f"{_fmt_shape(shape)}, got shape {list(tshape)}")
    for axis, (got, want) in enumerate(zip(tshape, shape)):
        if want is not None and got != want:
            raise ValueError(f"{name}: extent {got} on axis {axis} does not match "
                             f"{_fmt_shape(shape)} (expected {want})")
    if dev not in (device, "meta"):
        raise ValueError(f"{name}: tensor is on {dev}; expected a {device} tensor")
    if tshape and tshape[-1] > 1 and stride[-1] != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got "
                         f"strides {list(stride)}")
    if contiguous:
        expect, acc = [], 1
        for e in reversed(tshape):
            expect.append(acc)
            acc *= max(e, 1)
        if any(e > 1 and s != c for e, s, c in zip(tshape, stride, reversed(expect))):
            raise ValueError(f"{name}: must be contiguous (strides {list(reversed(expect))}), "
                             f"got strides {list(stride)}")
    for axis in range(len(tshape) - 1):
        if tshape[axis] > 1 and stride[axis] % row_multiple:
            raise ValueError(f"{name}: {_stride_name(axis, len(tshape))} {stride[axis]} must be "
                             f"a multiple of {row_multiple} elements so that every row starts "
                             "16-byte aligned")
    _check_disjoint(name, tshape, stride)
    if alignment < align:
        raise ValueError(f"{name}: base address is {alignment}-byte aligned; {align}-byte "
                         f"alignment is required")
    span = 1 + sum((e - 1) * s for e, s in zip(tshape, stride)) if all(tshape) else 0
    if span > max_span:
        raise ValueError(f"{name}: spans {span} elements; at most {max_span} are supported")
    return tshape


def _stride_name(axis: int, rank: int) -> str:
    return "row stride" if rank == 2 else f"axis-{axis} stride"


def _check_disjoint(name: str, shape, stride) -> None:
    """No two elements share an address: taken from the fastest axis out, every stride must
    clear the span of the axes inside it (sufficient, and exact for the usual layouts)."""
    span = 1
    for step, extent, axis in sorted((s, e, a) for a, (e, s) in enumerate(zip(shape, stride))
                                     if e > 1):
        if step < span:
            if len(shape) == 2:
                raise ValueError(f"{name}: row stride {step} is smaller than the row length "
                                 f"{span}: rows would overlap")
            raise ValueError(f"{name}: {_stride_name(axis, len(shape))} {step} is smaller than "
                             f"the {span} elements spanned by the faster axes (strides "
                             f"{list(stride)}): elements would overlap")
        span += (extent - 1) * step


def _fmt_shape(shape) -> str:
    return "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"


def byte_range(t) -> Optional[Tuple[int, int]]:
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
        return None  # meta tensors own no memory: they cannot alias anything
    span = 1 + sum((e - 1) * s for e, s in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + span * t.element_size()


def _offset_reachable(delta: int, dims, budget: list) -> bool:
    """Whether delta = sum k_i s_i with lo_i <= k_i <= hi_i over dims (s_i, lo_i, hi_i),
    largest stride first. Gives up (answers True) after a bounded search."""
    if not dims:
        return delta == 0
    (s, lo, hi), rest = dims[0], dims[1:]
    below = sum(max(abs(l), abs(h)) * st for st, l, h in rest)
    k_lo, k_hi = max(lo, -((below - delta) // s)), min(hi, (delta + below) // s)
    for k in range(k_lo, k_hi + 1):
        budget[0] -= 1
        if budget[0] < 0 or _offset_reachable(delta - k * s, rest, budget):
            return True
    return False


def _share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact for equally strided views (e.g. dk and dv interleaved in one packed KV buffer,
    column slices of one projection); any other overlapping byte ranges count as shared."""
    if a.stride() != b.stride() or a.element_size() != b.element_size():
        return True
    delta, rem = divmod(b.data_ptr() - a.data_ptr(), a.element_size())
    if rem:
        return True
    # a's element i meets b's element j when delta = sum (i_k - j_k) s_k.
    dims = sorted(((s, -(nb - 1), na - 1) for s, na, nb in zip(a.stride(), a.shape, b.shape)
                   if s > 0 and max(na, nb) > 1), reverse=True)
    if any(s == 0 for s in a.stride()):
        return True
    return _offset_reachable(delta, dims, [4096])


def check_no_overlap(outputs: Iterable[Tuple[str, object]], others: Iterable[Tuple[str, object]]):
    """Outputs must not share memory with each other or with any input (disjoint views of
    one allocation are fine)."""
    outs = [(n, t, byte_range(t)) for n, t in outputs if t is not None]
    outs = [x for x in outs if x[2] is not None]
    ins = [(n, t, byte_range(t)) for n, t in others if t is not None]
    ins = [x for x in ins if x[2] is not None]
    for i, (name, t, (a0, a1)) in enumerate(outs):
        for other, u, (b0, b1) in outs[i + 1:] + ins:
            if a0 < b1 and b0 < a1 and _share_elements(t, u):
                raise ValueError(f"{name} overlaps {other} in memory; outputs must not alias "
                                 "each other or the inputs")


def check_same_device(named: Iterable[Tuple[str, object]]) -> None:
    first = None
    for name, t in named:
        if isinstance(t, torch.Tensor):
            if first is None:
                first = (name, t.device)
            elif t.device != first[1]:
                raise ValueError(f"{name} is on {t.device} but {first[0]} is on {first[1]}; "
                                 "all tensors must be on one device")


def check_finite(name: str, value: float, *, positive: bool = False, lo=None, hi_open=None):
    if isinstance(value, (str, bytes)):  # float("0.5") would otherwise accept text
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}") from None
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and not v > 0:
        raise ValueError(f"{name} must be positive, got {value}")
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi_open is not None and not v < hi_open:
        raise ValueError(f"{name} must be < {hi_open}, got {value}")
    return v


def _as_int(name: str, value) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_int(name: str, value, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    v = _as_int(name, value)
    if lo is not None and v < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ValueError(f"{name} must be <= {hi}, got {v}")
    return v


def check_int64(name: str, value) -> int:
    v = _as_int(name, value)
    if not -2**63 <= v < 2**63:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, got {v}")
    return v


def check_bool(name: str, value, optional: bool = False) -> Optional[bool]:
    """A bool (numpy's too); with ``optional``, None passes through (the caller resolves
    it)."""
    if optional and value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool{' or None' if optional else ''}, "
                        f"got {type(value).__name__}")
    return bool(value)
