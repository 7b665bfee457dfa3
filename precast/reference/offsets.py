"""Packed-sequence offsets (cu_seqlens): built from lengths, and validated, for the
references, tests and benchmarks."""
from __future__ import annotations

import torch


def sequence_offsets(cu: torch.Tensor, what: str, dtypes) -> list[int]:
    """The offsets of a (B + 1,) integer tensor as a list: 1-D, starting at 0,
    non-decreasing, of one of ``dtypes``. Raises ValueError naming ``what``."""
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{what} must be {names}, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        raise ValueError(f"{what} must be 1-D with B + 1 >= 1 entries, got shape {tuple(cu.shape)}")
    offsets = [int(x) for x in cu.tolist()]
    if offsets[0] != 0:
        raise ValueError(f"{what} must start at 0, got {what}[0]={offsets[0]}")
    for b in range(len(offsets) - 1):
        if offsets[b + 1] < offsets[b]:
            raise ValueError(
                f"{what} must be non-decreasing, got {what}[{b}]={offsets[b]} > "
                f"{what}[{b + 1}]={offsets[b + 1]}")
    return offsets


def offsets_from_lengths(lengths, *, dtype=torch.int32, device="cpu") -> torch.Tensor:
    """cu_seqlens (B + 1,) of sequences with these lengths: [0, l0, l0 + l1, ...]."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=dtype, device=device)
