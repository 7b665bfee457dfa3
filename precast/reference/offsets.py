"""Validation of packed-sequence offsets (cu_seqlens), shared by the references."""
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
