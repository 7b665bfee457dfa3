"""Allocating functions, torch custom ops and autograd for HSTU LMSD.

``hstu_lmsd_forward`` / ``hstu_lmsd_backward`` follow the argument names of cuDNN
Frontend's hstu_lmsd API and return results that unpack like tuples and index like dicts.
``hstu_lmsd`` is differentiable (torch custom ops with fake implementations, so it also
traces under torch.compile).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from .lifecycle.lmsd import HstuLmsdBwdSm90, HstuLmsdFwdSm90
from .reference.lmsd import segment_count
from .lifecycle.results import results_type
from .op_cache import compiled_op

LmsdForwardResults = results_type("LmsdForwardResults",
                                  ("y_tensor", "mean_tensor", "rstd_tensor", "mask_tensor"))
LmsdBackwardResults = results_type("LmsdBackwardResults",
                                   ("dx_tensor", "du_tensor", "dweight_tensor", "dbias_tensor"))

_workspaces: Dict[tuple, torch.Tensor] = {}


def hstu_lmsd_forward(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                      eps: float = 1e-5, dropout_ratio: float = 0.0, seed: int = 0,
                      apply_u_silu: bool = True, concat_u: bool = False, concat_x: bool = False,
                      stream=None, *, y_tensor: Optional[torch.Tensor] = None,
                      mean_tensor: Optional[torch.Tensor] = None,
                      rstd_tensor: Optional[torch.Tensor] = None,
                      mask_tensor: Optional[torch.Tensor] = None) -> LmsdForwardResults:
    """LayerNorm(x) * SiLU(u) with dropout and optional concatenated segments.

    Returns (y_tensor, mean_tensor, rstd_tensor, mask_tensor); mask_tensor is None when
    dropout_ratio == 0. Outputs may be supplied (they are written and returned).
    """
    n, d = x.shape if x.dim() == 2 else (0, 0)
    dropout = float(dropout_ratio) != 0.0
    seg = segment_count(concat_u, concat_x)
    if x.dim() == 2:
        y_tensor = y_tensor if y_tensor is not None else x.new_empty((n, seg * d))
        mean_tensor = mean_tensor if mean_tensor is not None else x.new_empty((n,), dtype=torch.float32)
        rstd_tensor = rstd_tensor if rstd_tensor is not None else x.new_empty((n,), dtype=torch.float32)
        if dropout and mask_tensor is None:
            mask_tensor = x.new_empty((n, d), dtype=torch.int8)
    key = ("fwd", x.dtype, d, bool(apply_u_silu), bool(concat_u), bool(concat_x), dropout)
    op = compiled_op(key, lambda: HstuLmsdFwdSm90(
        x, u, weight, bias, y_tensor, mean_tensor, rstd_tensor, mask_tensor, eps=eps,
        dropout_ratio=dropout_ratio, apply_u_silu=apply_u_silu, concat_u=concat_u,
        concat_x=concat_x))
    op.execute(x, u, weight, bias, y_tensor, mean_tensor, rstd_tensor, mask_tensor, seed=seed,
               eps=eps, dropout_ratio=dropout_ratio, stream=stream)
    return LmsdForwardResults(y_tensor, mean_tensor, rstd_tensor, mask_tensor)


def hstu_lmsd_backward(dy: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                       mask: Optional[torch.Tensor], dropout_ratio: float = 0.0,
                       apply_u_silu: bool = True, concat_u: bool = False, concat_x: bool = False,
                       compute_dweight: bool = True, stream=None, *,
                       dx_tensor: Optional[torch.Tensor] = None,
                       du_tensor: Optional[torch.Tensor] = None,
                       dweight_tensor: Optional[torch.Tensor] = None,
                       dbias_tensor: Optional[torch.Tensor] = None,
                       workspace: Optional[torch.Tensor] = None) -> LmsdBackwardResults:
    """Returns (dx_tensor, du_tensor, dweight_tensor or None, dbias_tensor)."""
    dropout = float(dropout_ratio) != 0.0
    d = x.shape[-1] if x.dim() == 2 else 0
    dx_tensor = dx_tensor if dx_tensor is not None else torch.empty_like(x, memory_format=torch.contiguous_format)
    du_tensor = du_tensor if du_tensor is not None else torch.empty_like(u, memory_format=torch.contiguous_format)
    if compute_dweight and dweight_tensor is None:
        dweight_tensor = torch.empty_like(weight)
    dbias_tensor = dbias_tensor if dbias_tensor is not None else torch.empty_like(bias)
    key = ("bwd", x.dtype, d, bool(apply_u_silu), bool(concat_u), bool(concat_x), dropout,
           bool(compute_dweight))
    op = compiled_op(key, lambda: HstuLmsdBwdSm90(
        dy, x, u, weight, bias, mean, rstd, mask, dx_tensor, du_tensor, dweight_tensor,
        dbias_tensor, dropout_ratio=dropout_ratio, apply_u_silu=apply_u_silu,
        concat_u=concat_u, concat_x=concat_x, compute_dweight=compute_dweight))
    if workspace is None:
        workspace = _workspace(op, x.device, stream)
    op.execute(dy, x, u, weight, bias, mean, rstd, mask, dx_tensor, du_tensor, dweight_tensor,
               dbias_tensor, workspace, dropout_ratio=dropout_ratio, stream=stream)
    return LmsdBackwardResults(dx_tensor, du_tensor, dweight_tensor, dbias_tensor)


def _workspace(op: HstuLmsdBwdSm90, device: torch.device, stream) -> torch.Tensor:
    """A per-(device, shape) workspace reused across calls on the same stream order.

    Calls on other streams get their own buffer, so concurrent backward passes never
    share one.
    """
    shape = op.workspace_shape(device)
    key = (device.index, shape, _stream_key(stream, device.index))
    ws = _workspaces.get(key)
    if ws is None:
        ws = torch.empty(shape, dtype=torch.float32, device=device)
        _workspaces[key] = ws
    return ws


def _stream_key(stream, device_index) -> int:
    from .lifecycle.launch import stream_handle
    return stream_handle(stream, device_index)


# --- torch custom ops + autograd -------------------------------------------------------

@torch.library.custom_op("precast::hstu_lmsd_fwd", mutates_args=(), device_types="cuda")
def _lmsd_fwd_op(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 eps: float, dropout_ratio: float, seed: int, apply_u_silu: bool,
                 concat_u: bool, concat_x: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    y, mean, rstd, mask = hstu_lmsd_forward(x, u, weight, bias, eps, dropout_ratio, seed,
                                            apply_u_silu, concat_u, concat_x)
    if mask is None:  # custom ops return tensors only: an empty mask stands for "no dropout"
        mask = x.new_empty((0, x.shape[1]), dtype=torch.int8)
    return y, mean, rstd, mask


@_lmsd_fwd_op.register_fake
def _(x, u, weight, bias, eps, dropout_ratio, seed, apply_u_silu, concat_u, concat_x):
    n, d = x.shape
    rows = n if float(dropout_ratio) != 0.0 else 0
    return (x.new_empty((n, segment_count(concat_u, concat_x) * d)),
            x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32),
            x.new_empty((rows, d), dtype=torch.int8))


@torch.library.custom_op("precast::hstu_lmsd_bwd", mutates_args=(), device_types="cuda")
def _lmsd_bwd_op(dy: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, mask: torch.Tensor,
                 dropout_ratio: float, apply_u_silu: bool, concat_u: bool, concat_x: bool
                 ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    mask_or_none = mask if float(dropout_ratio) != 0.0 else None
    return tuple(hstu_lmsd_backward(dy.contiguous(), x, u, weight, bias, mean, rstd,
                                    mask_or_none, dropout_ratio, apply_u_silu, concat_u,
                                    concat_x, True))


@_lmsd_bwd_op.register_fake
def _(dy, x, u, weight, bias, mean, rstd, mask, dropout_ratio, apply_u_silu, concat_u, concat_x):
    return (torch.empty_like(x), torch.empty_like(u), torch.empty_like(weight),
            torch.empty_like(bias))


def _setup_context(ctx, inputs, output):
    x, u, weight, bias, eps, dropout_ratio, seed, apply_u_silu, concat_u, concat_x = inputs
    _, mean, rstd, mask = output
    ctx.save_for_backward(x, u, weight, bias, mean, rstd, mask)
    ctx.config = (dropout_ratio, apply_u_silu, concat_u, concat_x)


def _backward(ctx, dy, _dmean, _drstd, _dmask):
    x, u, weight, bias, mean, rstd, mask = ctx.saved_tensors
    dx, du, dweight, dbias = _lmsd_bwd_op(dy, x, u, weight, bias, mean, rstd, mask, *ctx.config)
    return dx, du, dweight, dbias, None, None, None, None, None, None


_lmsd_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def hstu_lmsd(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
              eps: float = 1e-5, dropout_ratio: float = 0.0, seed: int = 0,
              apply_u_silu: bool = True, concat_u: bool = False, concat_x: bool = False
              ) -> torch.Tensor:
    """Differentiable LMSD for training: returns y; gradients flow to x, u, weight, bias."""
    return _lmsd_fwd_op(x, u, weight, bias, float(eps), float(dropout_ratio), int(seed),
                        bool(apply_u_silu), bool(concat_u), bool(concat_x))[0]
