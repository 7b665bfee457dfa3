"""Frozen, hashable descriptions of tensors: what a kernel is compiled for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

_DTYPES = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float64": torch.float64, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64,
    "uint8": torch.uint8, "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def parse_dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    aliases = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
               "float": "float32"}
    name = aliases.get(name, name)
    if name not in _DTYPES:
        raise TypeError(f"unknown dtype {value!r}; expected one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _contiguous_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, acc = [], 1
    for extent in reversed(shape):
        strides.append(acc)
        acc *= max(extent, 1)
    return tuple(reversed(strides))


def _largest_pow2_dividing(value: int, cap: int = 256) -> int:
    if value == 0:
        return cap
    align = 1
    while align < cap and value % (align * 2) == 0:
        align *= 2
    return align


@dataclass(frozen=True)
class TensorDesc:
    """dtype, shape, strides (elements), device type and base-address alignment (bytes).

    Built from a tensor with :meth:`from_tensor`, or by hand for compiling on a machine
    that has no GPU (``TensorDesc(torch.bfloat16, (1024, 512))``: contiguous, 16-byte
    aligned, on CUDA).
    """

    dtype: torch.dtype
    shape: Tuple[int, ...]
    stride: Optional[Tuple[int, ...]] = None
    device: str = "cuda"
    alignment: int = 16

    def __post_init__(self):
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        stride = _contiguous_strides(self.shape) if self.stride is None else tuple(
            int(s) for s in self.stride)
        object.__setattr__(self, "stride", stride)
        if len(stride) != len(self.shape):
            raise ValueError(f"TensorDesc: stride {stride} does not match shape {self.shape}")
        if any(s < 0 for s in self.shape) or any(s < 0 for s in stride):
            raise ValueError(f"TensorDesc: negative extent or stride in {self.shape}/{stride}")
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"TensorDesc: alignment must be a power of two, got {self.alignment}")

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> "TensorDesc":
        if isinstance(tensor, TensorDesc):
            return tensor
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or TensorDesc, got {type(tensor).__name__}")
        align = 16 if tensor.device.type == "meta" else _largest_pow2_dividing(tensor.data_ptr())
        return cls(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                   tensor.device.type, min(align, 256))

    @classmethod
    def optional(cls, tensor) -> Optional["TensorDesc"]:
        """from_tensor, with None (an absent optional tensor) passed through."""
        return None if tensor is None else cls.from_tensor(tensor)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype, device="meta").element_size()

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def span_elements(self) -> int:
        """Elements from the first to one past the last addressed element."""
        if self.numel == 0:
            return 0
        return 1 + sum((e - 1) * s for e, s in zip(self.shape, self.stride))

    def is_contiguous(self) -> bool:
        return all(e <= 1 or s == c for e, s, c in zip(self.shape, self.stride,
                                                      _contiguous_strides(self.shape)))

    def describe(self) -> str:
        return (f"{dtype_name(self.dtype)}{list(self.shape)} stride {list(self.stride)} on "
                f"{self.device} ({self.alignment}-byte aligned)")
