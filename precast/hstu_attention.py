"""Allocating function and torch custom op for the HSTU attention forward.

``hstu_attention_forward`` takes cuDNN Frontend-style arguments, allocates o, copies
inputs whose layout the kernel cannot read in place and returns results that unpack like
a tuple and index like a dict. ``torch.ops.precast.hstu_attention_fwd`` is the same as a
torch custom op with a fake implementation (it traces under torch.compile).
``hstu_attention_backward`` computes dq, dk, dv; ``hstu_attention`` is the autograd-aware
op (``torch.ops.precast.hstu_attention`` with its backward ``hstu_attention_bwd``).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .lifecycle.launch import in_stream_order
from .lifecycle.hstu_attention import (DATA_ALIGN, INDEX_ALIGN, HSTUFwdSm90, check_packed,
                                       check_tokens, check_window)
from .lifecycle.hstu_attention_bwd import HSTUBwdSm90
from .lifecycle.results import results_type
from .op_cache import compiled_op

HstuAttentionForwardResults = results_type("HstuAttentionForwardResults", ("o_tensor",))
HstuAttentionBackwardResults = results_type("HstuAttentionBackwardResults",
                                            ("dq_tensor", "dk_tensor", "dv_tensor"))


def _in_place_or_copy(t: Optional[torch.Tensor], check: Callable) -> Optional[torch.Tensor]:
    """t where the kernel reads it in place, else a compact copy (a fresh, aligned buffer)."""
    if t is None or _readable(t, check):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _output_buffer(given: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The caller's output where the kernel can write it in place, else a fresh compact one
    (handed back through _delivered)."""
    if given is not None and _readable(given, _tokens_layout):
        return given
    return torch.empty(like.shape, dtype=like.dtype, device=like.device)


def _delivered(given: Optional[torch.Tensor], written: torch.Tensor) -> torch.Tensor:
    """The caller's output holding the result (copied in when the kernel wrote elsewhere)."""
    if given is None or given is written:
        return written
    given.copy_(written)
    return given


def _readable(t: torch.Tensor, check: Callable) -> bool:
    try:
        check(t)
    except ValueError:
        return False
    return True


def _tokens_layout(t):
    check_tokens("t", t, (t.dtype,), None, None, device=t.device.type)


def _packed_layout(align: int):
    def check(t):
        check_packed("t", t, (t.dtype,), (None,) * t.dim(), align, device=t.device.type)
    return check


def _kv_heads(k, paged_kv) -> Optional[int]:
    kv = paged_kv if paged_kv is not None else k
    return kv.shape[-2] if kv is not None and kv.dim() >= 2 else None


def hstu_attention_forward(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                           cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                           max_seqlen_q: int, max_seqlen_k: int,
                           scaling_seqlen: Optional[float] = None, window_size=(-1, 0),
                           alpha: float = 1.0, func_tensor: Optional[torch.Tensor] = None,
                           paged_kv: Optional[torch.Tensor] = None,
                           page_ids: Optional[torch.Tensor] = None,
                           page_indptrs: Optional[torch.Tensor] = None, stream=None, *,
                           o_tensor: Optional[torch.Tensor] = None,
                           workspace: Optional[torch.Tensor] = None
                           ) -> HstuAttentionForwardResults:
    """o = (mask * SiLU(alpha q k^T)) v / scaling_seqlen over packed (THD) sequences.

    Returns (o_tensor,). ``o_tensor`` may be supplied (written and returned, whatever its
    layout). With ``paged_kv`` (causal only), k and v must be None. max_seqlen_q and
    max_seqlen_k must bound every sequence's length: cu_seqlens are trusted, never read on
    the host (a batch with T_q = B x max_seqlen_q is taken to be dense). The compiled op is made
    once per static configuration and window_size; every other argument is a runtime value.
    ``workspace``: see ``HSTUFwdSm90.workspace_shape`` (by default the op keeps one per
    device and stream; pass one to capture a stream the op has not run on yet).
    """
    # The static configuration, and the window values an op instance keeps.
    func_shape = None if func_tensor is None else tuple(func_tensor.shape[:-1])
    key = ("attention_fwd", q.dtype, tuple(q.shape[1:]), _kv_heads(k, paged_kv),
           check_window(window_size), func_shape, paged_kv is not None)
    tokens = _tokens_layout
    with in_stream_order(stream, q.device):
        q, k, v = (_in_place_or_copy(t, tokens) for t in (q, k, v))
        cu_seqlens_q, cu_seqlens_k, func_tensor, page_ids, page_indptrs = (
            _in_place_or_copy(t, _packed_layout(INDEX_ALIGN))
            for t in (cu_seqlens_q, cu_seqlens_k, func_tensor, page_ids, page_indptrs))
        paged_kv = _in_place_or_copy(paged_kv, _packed_layout(DATA_ALIGN))
        o = _output_buffer(o_tensor, q)
        op = compiled_op(key, lambda: HSTUFwdSm90(
            q, k, v, o, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size,
            alpha, scaling_seqlen, func_tensor, paged_kv, page_ids, page_indptrs))
        op.execute(q, k, v, o, cu_seqlens_q, cu_seqlens_k, func_tensor, paged_kv, page_ids,
                   page_indptrs, stream, alpha=alpha, scaling_seqlen=scaling_seqlen,
                   max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, workspace=workspace)
        o = _delivered(o_tensor, o)
    return HstuAttentionForwardResults(o)


# --- torch custom op -------------------------------------------------------------------------

@torch.library.custom_op("precast::hstu_attention_fwd", mutates_args=(), device_types="cuda")
def _attention_fwd_op(q: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, scaling_seqlen: Optional[float], window_left: int,
                      window_right: int, alpha: float, func_tensor: Optional[torch.Tensor],
                      paged_kv: Optional[torch.Tensor], page_ids: Optional[torch.Tensor],
                      page_indptrs: Optional[torch.Tensor]) -> torch.Tensor:
    return hstu_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, scaling_seqlen, (window_left, window_right),
                                  alpha, func_tensor, paged_kv, page_ids,
                                  page_indptrs).o_tensor


@_attention_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
      window_left, window_right, alpha, func_tensor, paged_kv, page_ids, page_indptrs):
    return q.new_empty(q.shape)


def hstu_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                            max_seqlen_q: int, max_seqlen_k: int,
                            scaling_seqlen: Optional[float] = None, window_size=(-1, 0),
                            alpha: float = 1.0, func_tensor: Optional[torch.Tensor] = None,
                            deterministic: bool = False, stream=None, *,
                            dq_tensor: Optional[torch.Tensor] = None,
                            dk_tensor: Optional[torch.Tensor] = None,
                            dv_tensor: Optional[torch.Tensor] = None,
                            workspace: Optional[torch.Tensor] = None
                            ) -> HstuAttentionBackwardResults:
    """dq, dk, dv of ``hstu_attention_forward`` (same arguments; paged KV is forward only).

    Returns (dq_tensor, dk_tensor, dv_tensor). Supplied gradient buffers are optional and
    independent; they are overwritten and returned (disjoint views of one allocation, such
    as dk and dv split from one packed KV buffer, are written in place). Today every
    configuration is bitwise reproducible (see HSTUBwdSm90); ``workspace``: see
    ``HSTUBwdSm90.workspace_shape`` (none is needed while the fused kernel is off).
    """
    func_shape = None if func_tensor is None else tuple(func_tensor.shape[:-1])
    key = ("attention_bwd", q.dtype, tuple(q.shape[1:]), _kv_heads(k, None),
           check_window(window_size), func_shape, bool(deterministic))
    tokens = _tokens_layout
    with in_stream_order(stream, q.device):
        do, q, k, v = (_in_place_or_copy(t, tokens) for t in (do, q, k, v))
        cu_seqlens_q, cu_seqlens_k, func_tensor = (
            _in_place_or_copy(t, _packed_layout(INDEX_ALIGN))
            for t in (cu_seqlens_q, cu_seqlens_k, func_tensor))
        given = (dq_tensor, dk_tensor, dv_tensor)
        grads = [_output_buffer(g, like) for g, like in zip(given, (q, k, v))]
        op = compiled_op(key, lambda: HSTUBwdSm90(
            do, q, k, v, *grads, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            window_size, alpha, scaling_seqlen, func_tensor, deterministic))
        op.execute(do, q, k, v, *grads, cu_seqlens_q, cu_seqlens_k, func_tensor, stream,
                   alpha=alpha, scaling_seqlen=scaling_seqlen, max_seqlen_q=max_seqlen_q,
                   max_seqlen_k=max_seqlen_k, workspace=workspace)
        grads = [_delivered(g, written) for g, written in zip(given, grads)]
    return HstuAttentionBackwardResults(*grads)


# --- autograd ----------------------------------------------------------------------------------

@torch.library.custom_op("precast::hstu_attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                  scaling_seqlen: Optional[float], window_left: int, window_right: int,
                  alpha: float, func_tensor: Optional[torch.Tensor],
                  deterministic: bool) -> torch.Tensor:
    return hstu_attention_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, scaling_seqlen, (window_left, window_right),
                                  alpha, func_tensor).o_tensor


@_attention_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
      window_left, window_right, alpha, func_tensor, deterministic):
    return q.new_empty(q.shape)


@torch.library.custom_op("precast::hstu_attention_bwd", mutates_args=(), device_types="cuda")
def _attention_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                      max_seqlen_k: int, scaling_seqlen: Optional[float], window_left: int,
                      window_right: int, alpha: float, func_tensor: Optional[torch.Tensor],
                      deterministic: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(hstu_attention_backward(do, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, scaling_seqlen,
                                         (window_left, window_right), alpha, func_tensor,
                                         deterministic))


@_attention_bwd_op.register_fake
def _(do, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
      window_left, window_right, alpha, func_tensor, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


_SAVED_ARGS = ("max_seqlen_q", "max_seqlen_k", "scaling_seqlen", "window_left", "window_right",
               "alpha", "deterministic")


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
     window_left, window_right, alpha, func_tensor, deterministic) = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens_q, cu_seqlens_k, func_tensor)
    ctx.args = (max_seqlen_q, max_seqlen_k, scaling_seqlen, window_left, window_right, alpha)
    ctx.deterministic = deterministic


def _backward(ctx, do):
    q, k, v, cu_seqlens_q, cu_seqlens_k, func_tensor = ctx.saved_tensors
    dq, dk, dv = torch.ops.precast.hstu_attention_bwd(do, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                      *ctx.args, func_tensor, ctx.deterministic)
    return (dq, dk, dv) + (None,) * 10


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def hstu_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                   max_seqlen_k: int, scaling_seqlen: Optional[float] = None,
                   window_size=(-1, 0), alpha: float = 1.0,
                   func_tensor: Optional[torch.Tensor] = None,
                   deterministic: bool = False) -> torch.Tensor:
    """o = (mask * SiLU(alpha q k^T)) v / scaling_seqlen, differentiable in q, k and v
    (torch.ops.precast.hstu_attention; works under torch.compile)."""
    left, right = check_window(window_size)
    return torch.ops.precast.hstu_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, scaling_seqlen, left, right,
                                            float(alpha), func_tensor, bool(deterministic))
