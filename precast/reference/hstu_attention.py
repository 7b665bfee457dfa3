"""Reference HSTU attention over packed (THD) ragged batches.

For every sequence ``b`` and query head ``h`` (kv head ``h // (H // H_kv)``)::

    S   = alpha * Q_h K_h^T                       (len_q, len_k)
    A   = (M * SiLU(S)) / scaling_seqlen          no softmax, no row normalization
    O_h = A V_h

``SiLU(s) = s * sigmoid(s)``; ``M`` is the boolean visibility mask of the
sequence (see :func:`visible_mask`):

* window masks, ``window_size=(left, right)`` with ``-1`` meaning unbounded,
  aligned bottom-right: local query ``i`` sees key ``j`` when
  ``i + off - left <= j <= i + off + right`` with ``off = len_k - len_q`` and
  ``0 <= j < len_k``. ``(-1, -1)`` is full attention, ``(-1, 0)`` causal.
* arbitrary masks, ``func_tensor`` int32 ``(1, n, L)`` with ``n`` odd and
  ``L >= T_q + 256``: packed query row ``r`` sees the keys
  ``[0, F0) U [F1, F2) U [F3, F4) ...`` with ``F = func_tensor[0, :, r]``,
  key indices local to the sequence and still bounded by ``0 <= j < len_k``.
  Intervals may overlap and need not be ordered; a row without any visible key
  outputs zeros. Only with ``window_size == (-1, -1)`` and no paged KV.

Paged KV (forward, causal only): ``paged_kv`` ``(num_pages, 2, 128, H_kv, D)``,
dim 1 selects K (0) or V (1); sequence ``b`` uses the pages
``page_ids[page_indptrs[b]:page_indptrs[b + 1]]`` in order and its keys are the
first ``len_k`` rows of their concatenation (:func:`gather_paged_kv`).

Backward reference: :func:`hstu_attention_reference` is built from plain,
differentiable torch ops, so the dq/dk/dv references are
``torch.autograd.grad(o, (q, k, v), do)`` on its output (compute in float64 for
the tightest oracle); :func:`hstu_attention_backward_reference` wraps exactly
that.

FLOPs: ``4 * H * D * visible_pairs`` for the forward (two matmuls of 2 FLOPs
per multiply-add over the visible pairs); the backward is counted as
``BACKWARD_FLOPS_FACTOR`` (2.5) times the forward.

:func:`hstu_attention_naive` is a deliberately slow float64 loop version that
only exists to cross-check the vectorized reference on tiny inputs.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .offsets import sequence_offsets

__all__ = [
    "PAGE_SIZE",
    "FUNC_PAD_COLUMNS",
    "BACKWARD_FLOPS_FACTOR",
    "visible_mask",
    "visible_pairs",
    "attention_flops",
    "gather_paged_kv",
    "hstu_attention_reference",
    "hstu_attention_backward_reference",
    "hstu_attention_naive",
    "random_func_tensor",
]

PAGE_SIZE = 128  # tokens per KV page (fixed)
FUNC_PAD_COLUMNS = 256  # func_tensor must have at least T_q + 256 columns
BACKWARD_FLOPS_FACTOR = 2.5  # backward FLOPs = 2.5 x forward FLOPs

_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)


# ---------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------


def _check_window(window_size) -> tuple[int, int]:
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(
            f"window_size must be a pair (left, right), got {window_size!r}"
        ) from None
    out = []
    for name, w in (("left", left), ("right", right)):
        if isinstance(w, bool):
            raise ValueError(f"window_size {name} must be an int >= -1, got {w!r}")
        try:
            w = operator.index(w)
        except TypeError:
            raise ValueError(f"window_size {name} must be an int >= -1, got {w!r}") from None
        if w < -1:
            raise ValueError(
                f"window_size {name} must be >= -1 (-1 = unbounded), got {w}"
            )
        out.append(w)
    return out[0], out[1]


def _check_nonneg_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}") from None
    if value < 0:
        raise ValueError(f"{what} must be non-negative, got {value}")
    return value


def _check_index_tensor(t, what: str, *, int32: bool) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if int32 and t.dtype != torch.int32:
        raise ValueError(f"{what} must be int32, got {t.dtype}")
    if not int32 and t.dtype not in _INT_DTYPES:
        raise ValueError(f"{what} must be an integer tensor, got {t.dtype}")


def _seqlens(cu: torch.Tensor, what: str, *, int32: bool) -> list[int]:
    """Validated cu_seqlens -> python list of boundaries."""
    return sequence_offsets(cu, what, (torch.int32,) if int32 else _INT_DTYPES)


def _func_rows_check(func_rows: torch.Tensor, len_q: int) -> None:
    _check_index_tensor(func_rows, "func_rows", int32=False)
    if func_rows.dim() != 2 or func_rows.shape[1] != len_q:
        raise ValueError(f"func_rows must have shape (n, {len_q}), got {tuple(func_rows.shape)}")
    n = func_rows.shape[0]
    if n < 1 or n % 2 == 0:
        raise ValueError(f"func_rows must have a positive odd number n of rows, got n={n}")


def _check_func_tensor(func_tensor, total_q: int, *, int32: bool) -> int:
    _check_index_tensor(func_tensor, "func_tensor", int32=int32)
    if func_tensor.dim() != 3 or func_tensor.shape[0] != 1:
        raise ValueError(f"func_tensor must have shape (1, n, L), got {tuple(func_tensor.shape)}")
    n, L = func_tensor.shape[1], func_tensor.shape[2]
    if n < 1 or n % 2 == 0:
        raise ValueError(
            f"func_tensor must have a positive odd number n of interval bounds "
            f"(F0, then [F1, F2), [F3, F4), ...), got n={n}"
        )
    if L < total_q + FUNC_PAD_COLUMNS:
        raise ValueError(
            f"func_tensor must have L >= T_q + {FUNC_PAD_COLUMNS} = {total_q + FUNC_PAD_COLUMNS} "
            f"columns, got L={L}"
        )
    return n


@dataclass(frozen=True)
class _Problem:
    bounds_q: list[int]
    bounds_k: list[int]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: tuple[int, int]
    scaling: float
    alpha: float
    paged: bool

    @property
    def batch(self) -> int:
        return len(self.bounds_q) - 1

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _validate(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scaling_seqlen,
    window_size,
    alpha,
    func_tensor,
    paged_kv,
    page_ids,
    page_indptrs,
) -> _Problem:
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (T_q, H, D), got shape {tuple(q.shape)}")
    if not q.is_floating_point():
        raise ValueError(f"q must be a floating-point tensor, got {q.dtype}")
    T_q, H, D = q.shape
    if H < 1 or D < 1:
        raise ValueError(f"q must have H >= 1 and D >= 1, got shape {tuple(q.shape)}")

    paged = paged_kv is not None
    if paged:
        if not isinstance(paged_kv, torch.Tensor):
            raise ValueError(f"paged_kv must be a torch.Tensor, got {type(paged_kv).__name__}")
        if paged_kv.dim() != 5 or paged_kv.shape[1] != 2 or paged_kv.shape[2] != PAGE_SIZE:
            raise ValueError(
                f"paged_kv must have shape (num_pages, 2, {PAGE_SIZE}, H_kv, D), "
                f"got {tuple(paged_kv.shape)}"
            )
        if paged_kv.shape[4] != D:
            raise ValueError(f"paged_kv head dim must equal q's D={D}, got {paged_kv.shape[4]}")
        if paged_kv.dtype != q.dtype:
            raise ValueError(f"paged_kv dtype {paged_kv.dtype} must match q dtype {q.dtype}")
        if paged_kv.device != q.device:
            raise ValueError(f"paged_kv is on {paged_kv.device}, q on {q.device}")
        if not paged_kv.is_contiguous():
            raise ValueError("paged_kv must be contiguous")
        if page_ids is None or page_indptrs is None:
            raise ValueError("paged_kv requires page_ids and page_indptrs")
        H_kv = paged_kv.shape[3]
    else:
        if page_ids is not None or page_indptrs is not None:
            raise ValueError("page_ids/page_indptrs are only valid together with paged_kv")
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{name} must be 3-D (T_k, H_kv, D), got shape {tuple(t.shape)}")
            if t.dtype != q.dtype:
                raise ValueError(f"{name} dtype {t.dtype} must match q dtype {q.dtype}")
            if t.device != q.device:
                raise ValueError(f"{name} is on {t.device}, q on {q.device}")
        if k.shape != v.shape:
            raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[2] != D:
            raise ValueError(f"k/v head dim must equal q's D={D}, got {k.shape[2]}")
        H_kv = k.shape[1]
    if H_kv < 1 or H % H_kv != 0:
        raise ValueError(f"H_kv={H_kv} must be >= 1 and divide the number of query heads H={H}")

    bounds_q = _seqlens(cu_seqlens_q, "cu_seqlens_q", int32=True)
    bounds_k = _seqlens(cu_seqlens_k, "cu_seqlens_k", int32=True)
    if len(bounds_q) != len(bounds_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got "
            f"{len(bounds_q)} and {len(bounds_k)}"
        )
    if bounds_q[-1] != T_q:
        raise ValueError(f"cu_seqlens_q[-1]={bounds_q[-1]} must equal T_q={T_q} (q.shape[0])")
    if not paged and bounds_k[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_k[-1]={bounds_k[-1]} must equal T_k={k.shape[0]} (k.shape[0])")

    max_q = _check_nonneg_int(max_seqlen_q, "max_seqlen_q")
    max_k = _check_nonneg_int(max_seqlen_k, "max_seqlen_k")
    if max_q > max_k:
        raise ValueError(f"max_seqlen_q={max_q} must be <= max_seqlen_k={max_k}")
    B = len(bounds_q) - 1
    for b in range(B):
        lq = bounds_q[b + 1] - bounds_q[b]
        lk = bounds_k[b + 1] - bounds_k[b]
        if lq > max_q:
            raise ValueError(f"sequence {b} has len_q={lq} > max_seqlen_q={max_q}")
        if lk > max_k:
            raise ValueError(f"sequence {b} has len_k={lk} > max_seqlen_k={max_k}")

    if scaling_seqlen is None:
        # max_seqlen_q == 0 implies T_q == 0: nothing is scaled, any positive value will do.
        scaling = float(max_q) if max_q > 0 else 1.0
    else:
        if isinstance(scaling_seqlen, bool):
            raise ValueError(f"scaling_seqlen must be a positive number, got {scaling_seqlen!r}")
        scaling = float(scaling_seqlen)
        if not (math.isfinite(scaling) and scaling > 0.0):
            raise ValueError(f"scaling_seqlen must be finite and > 0, got {scaling_seqlen!r}")

    alpha_f = float(alpha)
    if not math.isfinite(alpha_f):
        raise ValueError(f"alpha must be finite, got {alpha!r}")

    window = _check_window(window_size)

    if func_tensor is not None:
        if window != (-1, -1):
            raise ValueError(
                f"func_tensor (arbitrary mask) cannot be combined with a window mask: "
                f"window_size must be (-1, -1), got {window}"
            )
        if paged:
            raise ValueError("func_tensor (arbitrary mask) cannot be combined with paged KV")
        _check_func_tensor(func_tensor, T_q, int32=True)

    if paged:
        if window != (-1, 0):
            raise ValueError(f"paged KV supports only the causal mask window_size=(-1, 0), got {window}")
        _check_index_tensor(page_ids, "page_ids", int32=True)
        _check_index_tensor(page_indptrs, "page_indptrs", int32=True)
        _check_pages(paged_kv.shape[0], page_ids, page_indptrs, bounds_k)

    return _Problem(bounds_q, bounds_k, H, H_kv, D, window, scaling, alpha_f, paged)


def _check_pages(num_pages: int, page_ids, page_indptrs, bounds_k: list[int]) -> list[int]:
    if page_ids.dim() != 1:
        raise ValueError(f"page_ids must be 1-D, got shape {tuple(page_ids.shape)}")
    if page_indptrs.dim() != 1 or page_indptrs.numel() != len(bounds_k):
        raise ValueError(
            f"page_indptrs must have shape (B + 1,) = ({len(bounds_k)},), "
            f"got {tuple(page_indptrs.shape)}"
        )
    ptr = page_indptrs.tolist()
    n_ids = page_ids.numel()
    for b in range(len(ptr) - 1):
        if not 0 <= ptr[b] <= ptr[b + 1] <= n_ids:
            raise ValueError(
                f"page_indptrs must be non-decreasing within [0, len(page_ids)={n_ids}], "
                f"got page_indptrs[{b}:{b + 2}]={ptr[b:b + 2]}"
            )
        len_k = bounds_k[b + 1] - bounds_k[b]
        need = -(-len_k // PAGE_SIZE)
        have = ptr[b + 1] - ptr[b]
        if have < need:
            raise ValueError(
                f"sequence {b} has len_k={len_k} and needs {need} pages of {PAGE_SIZE}, "
                f"but page_indptrs gives it {have}"
            )
    if n_ids:
        lo, hi = int(page_ids.min()), int(page_ids.max())
        if lo < 0 or hi >= num_pages:
            raise ValueError(
                f"page_ids must be in [0, num_pages={num_pages}), got values in [{lo}, {hi}]"
            )
    return ptr


# ---------------------------------------------------------------------------
# Masks and pair counting
# ---------------------------------------------------------------------------


def visible_mask(
    len_q: int,
    len_k: int,
    window_size=(-1, -1),
    func_rows: torch.Tensor | None = None,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean (len_q, len_k) mask of one sequence: True where query i sees key j.

    ``func_rows`` is the (n, len_q) integer slice of func_tensor for this
    sequence's query rows (``func_tensor[0, :, cu_q[b]:cu_q[b + 1]]``). The
    device is ``device`` if given, else func_rows' device, else CPU.
    """
    len_q = _check_nonneg_int(len_q, "len_q")
    len_k = _check_nonneg_int(len_k, "len_k")
    left, right = _check_window(window_size)
    if func_rows is not None:
        _func_rows_check(func_rows, len_q)
        if (left, right) != (-1, -1):
            raise ValueError(
                f"func_rows cannot be combined with a window mask: window_size must be "
                f"(-1, -1), got {(left, right)}"
            )
    if device is None:
        device = func_rows.device if func_rows is not None else "cpu"
    i = torch.arange(len_q, device=device, dtype=torch.int64)[:, None]
    j = torch.arange(len_k, device=device, dtype=torch.int64)[None, :]
    off = len_k - len_q
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= i + off - left
    if right >= 0:
        mask &= j <= i + off + right
    if func_rows is not None:
        f = func_rows.to(device=device, dtype=torch.int64)
        fmask = j < f[0][:, None]
        for t in range(1, f.shape[0], 2):
            fmask |= (j >= f[t][:, None]) & (j < f[t + 1][:, None])
        mask &= fmask
    return mask


def _window_row_counts(len_q: int, len_k: int, left: int, right: int) -> torch.Tensor:
    """Visible keys per query row under a window mask (closed form, int64 (len_q,))."""
    i = torch.arange(len_q, dtype=torch.int64)
    off = len_k - len_q
    lo = (i + off - left).clamp(min=0) if left >= 0 else torch.zeros_like(i)
    hi = (i + off + right + 1).clamp(max=len_k) if right >= 0 else torch.full_like(i, len_k)
    return (hi - lo).clamp(min=0)


def _func_row_counts(f: torch.Tensor, len_k: int) -> torch.Tensor:
    """Size of the union of the func intervals clipped to [0, len_k), per row.

    f: int64 (n, rows). Sweep over the intervals sorted by start, vectorized over rows.
    """
    starts = [torch.zeros_like(f[0])] + [f[t] for t in range(1, f.shape[0], 2)]
    ends = [f[0]] + [f[t + 1] for t in range(1, f.shape[0], 2)]
    s = torch.stack(starts).clamp(0, len_k)
    e = torch.stack(ends).clamp(0, len_k)
    empty = e <= s
    s = torch.where(empty, torch.zeros_like(s), s)
    e = torch.where(empty, torch.zeros_like(e), e)
    s, order = torch.sort(s, dim=0, stable=True)
    e = torch.gather(e, 0, order)
    covered = torch.zeros_like(f[0])
    reach = torch.zeros_like(f[0])
    for m in range(s.shape[0]):
        covered += (e[m] - torch.maximum(s[m], reach)).clamp(min=0)
        reach = torch.maximum(reach, e[m])
    return covered


def visible_pairs(cu_seqlens_q, cu_seqlens_k, window_size=(-1, -1), func_tensor=None) -> int:
    """Number of visible (query, key) pairs summed over sequences (per head).

    Computed in closed form per query row (no len_q x len_k masks), so it is
    cheap for benchmark-sized batches; tests check it against ``visible_mask``.
    """
    bq = _seqlens(cu_seqlens_q, "cu_seqlens_q", int32=False)
    bk = _seqlens(cu_seqlens_k, "cu_seqlens_k", int32=False)
    if len(bq) != len(bk):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got {len(bq)} and {len(bk)}"
        )
    left, right = _check_window(window_size)
    f_all = None
    if func_tensor is not None:
        if (left, right) != (-1, -1):
            raise ValueError(
                f"func_tensor cannot be combined with a window mask: window_size must be "
                f"(-1, -1), got {(left, right)}"
            )
        _check_func_tensor(func_tensor, bq[-1], int32=False)
        f_all = func_tensor[0].to(device="cpu", dtype=torch.int64)
    total = 0
    for b in range(len(bq) - 1):
        lq, lk = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        if lq == 0 or lk == 0:
            continue
        if f_all is not None:
            total += int(_func_row_counts(f_all[:, bq[b]:bq[b + 1]], lk).sum())
        else:
            total += int(_window_row_counts(lq, lk, left, right).sum())
    return total


def attention_flops(
    cu_seqlens_q,
    cu_seqlens_k,
    num_heads: int,
    head_dim: int,
    window_size=(-1, -1),
    func_tensor=None,
) -> int:
    """Forward FLOPs: 4 * H * D * visible_pairs. Backward: x BACKWARD_FLOPS_FACTOR."""
    H = _check_nonneg_int(num_heads, "num_heads")
    D = _check_nonneg_int(head_dim, "head_dim")
    return 4 * H * D * visible_pairs(cu_seqlens_q, cu_seqlens_k, window_size, func_tensor)


# ---------------------------------------------------------------------------
# Paged KV
# ---------------------------------------------------------------------------


def gather_paged_kv(paged_kv, page_ids, page_indptrs, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (T_k, H_kv, D) k and v gathered from the pages (differentiable)."""
    if not isinstance(paged_kv, torch.Tensor) or paged_kv.dim() != 5 or paged_kv.shape[1] != 2 \
            or paged_kv.shape[2] != PAGE_SIZE:
        shape = tuple(paged_kv.shape) if isinstance(paged_kv, torch.Tensor) else type(paged_kv).__name__
        raise ValueError(f"paged_kv must have shape (num_pages, 2, {PAGE_SIZE}, H_kv, D), got {shape}")
    bounds_k = _seqlens(cu_seqlens_k, "cu_seqlens_k", int32=False)
    _check_index_tensor(page_ids, "page_ids", int32=False)
    _check_index_tensor(page_indptrs, "page_indptrs", int32=False)
    ptr = _check_pages(paged_kv.shape[0], page_ids, page_indptrs, bounds_k)
    dev = paged_kv.device
    ids = page_ids.to(device=dev, dtype=torch.int64)
    pages, slots = [], []
    for b in range(len(bounds_k) - 1):
        j = torch.arange(bounds_k[b + 1] - bounds_k[b], device=dev, dtype=torch.int64)
        pages.append(ids[ptr[b] + torch.div(j, PAGE_SIZE, rounding_mode="floor")])
        slots.append(j % PAGE_SIZE)
    empty = torch.zeros(0, dtype=torch.int64, device=dev)
    page = torch.cat(pages) if pages else empty
    slot = torch.cat(slots) if slots else empty
    return paged_kv[page, 0, slot], paged_kv[page, 1, slot]


# ---------------------------------------------------------------------------
# Vectorized reference
# ---------------------------------------------------------------------------


def hstu_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scaling_seqlen: float | None = None,
    window_size=(-1, 0),
    alpha: float = 1.0,
    func_tensor: torch.Tensor | None = None,
    paged_kv: torch.Tensor | None = None,
    page_ids: torch.Tensor | None = None,
    page_indptrs: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """HSTU attention output o (T_q, H, D) in ``compute_dtype``.

    Differentiable w.r.t. q, k, v (and paged_kv): the backward reference is
    ``torch.autograd.grad`` on this output. With ``paged_kv`` the k/v arguments
    are ignored (may be None) and keys/values come from the pages.
    """
    p = _validate(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
        window_size, alpha, func_tensor, paged_kv, page_ids, page_indptrs,
    )
    if p.paged:
        k, v = gather_paged_kv(paged_kv, page_ids, page_indptrs, cu_seqlens_k)
    dev = q.device
    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype)
    vc = v.to(compute_dtype)
    func = func_tensor[0].to(dev) if func_tensor is not None else None
    G = p.group
    outs = []
    for b in range(p.batch):
        sq, eq = p.bounds_q[b], p.bounds_q[b + 1]
        sk, ek = p.bounds_k[b], p.bounds_k[b + 1]
        lq, lk = eq - sq, ek - sk
        if lq == 0:
            continue
        rows = func[:, sq:eq] if func is not None else None
        mask = visible_mask(lq, lk, p.window, rows, device=dev)
        heads = []
        for g in range(p.num_kv_heads):
            qg = qc[sq:eq, g * G:(g + 1) * G]  # (lq, G, D)
            kg = kc[sk:ek, g]  # (lk, D)
            vg = vc[sk:ek, g]
            s = p.alpha * torch.einsum("qhd,kd->hqk", qg, kg)
            a = torch.where(mask, F.silu(s), torch.zeros((), dtype=s.dtype, device=dev))
            a = a / p.scaling
            heads.append(torch.einsum("hqk,kd->qhd", a, vg))
        outs.append(torch.cat(heads, dim=1))
    if not outs:
        return qc * 0.0  # T_q == 0 or every sequence has no query
    if sum(o.shape[0] for o in outs) != qc.shape[0]:
        raise AssertionError("internal error: output rows do not cover q")
    return torch.cat(outs, dim=0)


def hstu_attention_backward_reference(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in ``compute_dtype`` via torch.autograd.grad on the reference.

    ``kwargs`` are those of :func:`hstu_attention_reference` (paged KV is
    forward-only and rejected here).
    """
    if kwargs.get("paged_kv") is not None:
        raise ValueError("paged KV is forward only: no backward reference")
    if not isinstance(do, torch.Tensor) or not isinstance(q, torch.Tensor) or do.shape != q.shape:
        shape = tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__
        want = tuple(q.shape) if isinstance(q, torch.Tensor) else "q's shape"
        raise ValueError(f"do must have q's shape {want}, got {shape}")
    _validate(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              kwargs.get("scaling_seqlen"), kwargs.get("window_size", (-1, 0)),
              kwargs.get("alpha", 1.0), kwargs.get("func_tensor"), None, None, None)
    cd = kwargs.get("compute_dtype", torch.float32)
    with torch.enable_grad():
        leaves = [t.detach().to(cd).requires_grad_(True) for t in (q, k, v)]
        o = hstu_attention_reference(*leaves, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, **kwargs)
        if not o.requires_grad:  # T_q == 0: nothing depends on the inputs
            return tuple(torch.zeros_like(t) for t in leaves)
        grads = torch.autograd.grad(o, leaves, do.to(o.dtype), allow_unused=True)
    return tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves))


# ---------------------------------------------------------------------------
# Naive loop version (tiny sizes only)
# ---------------------------------------------------------------------------


def _silu_scalar(s: float) -> float:
    if s >= 0.0:
        return s / (1.0 + math.exp(-s))
    e = math.exp(s)
    return s * e / (1.0 + e)


def hstu_attention_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scaling_seqlen: float | None = None,
    window_size=(-1, 0),
    alpha: float = 1.0,
    func_tensor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 loops over sequences, heads, query rows and keys (no paged KV).

    The mask is evaluated per (i, j) straight from the definition, independently
    of :func:`visible_mask`.
    """
    p = _validate(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scaling_seqlen,
        window_size, alpha, func_tensor, None, None, None,
    )
    T_q, H, D = q.shape
    qs = q.detach().double().cpu().tolist()
    ks = k.detach().double().cpu().tolist()
    vs = v.detach().double().cpu().tolist()
    fs = func_tensor[0].cpu().tolist() if func_tensor is not None else None
    left, right = p.window
    out = [[[0.0] * D for _ in range(H)] for _ in range(T_q)]

    def visible(i: int, j: int, r: int, lq: int, lk: int) -> bool:
        if not 0 <= j < lk:
            return False
        off = lk - lq
        if left >= 0 and j < i + off - left:
            return False
        if right >= 0 and j > i + off + right:
            return False
        if fs is not None:
            bounds = [fs[t][r] for t in range(len(fs))]
            inside = j < bounds[0]
            for t in range(1, len(bounds), 2):
                if bounds[t] <= j < bounds[t + 1]:
                    inside = True
            return inside
        return True

    for b in range(p.batch):
        sq, sk = p.bounds_q[b], p.bounds_k[b]
        lq = p.bounds_q[b + 1] - sq
        lk = p.bounds_k[b + 1] - sk
        for h in range(H):
            hk = h // p.group
            for i in range(lq):
                r = sq + i
                acc = out[r][h]
                for j in range(lk):
                    if not visible(i, j, r, lq, lk):
                        continue
                    s = 0.0
                    for d in range(D):
                        s += qs[r][h][d] * ks[sk + j][hk][d]
                    a = _silu_scalar(p.alpha * s) / p.scaling
                    for d in range(D):
                        acc[d] += a * vs[sk + j][hk][d]
    return torch.tensor(out, dtype=torch.float64).reshape(T_q, H, D).to(q.device)


# ---------------------------------------------------------------------------
# Random arbitrary masks
# ---------------------------------------------------------------------------


def random_func_tensor(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    n: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random int32 func_tensor (1, n, T_q + 256) exercising the arbitrary mask.

    Per query row: F0 is sometimes 0 (empty prefix) and sometimes beyond len_k;
    the (F[t], F[t + 1]) pairs are drawn independently, so they overlap, come in
    any order and are often empty (end <= start); values range over
    [0, len_k + 4], so the semantics must clip them. About 15% of the rows (and
    always the last packed query row, when T_q > 0) have no valid key at all.
    Columns beyond T_q are zero. Values are never negative. Built on CPU.
    """
    n = _check_nonneg_int(n, "n")
    if n % 2 == 0:
        raise ValueError(f"n must be positive and odd, got {n}")
    bq = _seqlens(cu_seqlens_q, "cu_seqlens_q", int32=False)
    bk = _seqlens(cu_seqlens_k, "cu_seqlens_k", int32=False)
    if len(bq) != len(bk):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have B + 1 entries, got {len(bq)} and {len(bk)}"
        )
    T_q = bq[-1]
    out = torch.zeros(1, n, T_q + FUNC_PAD_COLUMNS, dtype=torch.int32)
    g = generator

    def rand(*shape):
        return torch.rand(*shape, generator=g)

    for b in range(len(bq) - 1):
        lq, lk = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        if lq == 0:
            continue
        hi = lk + 4
        f = torch.randint(0, hi + 1, (n, lq), generator=g, dtype=torch.int64)
        # F0: sometimes empty prefix, sometimes everything (beyond len_k).
        u = rand(lq)
        f[0] = torch.where(u < 0.25, torch.zeros_like(f[0]), f[0])
        f[0] = torch.where(u > 0.85, torch.full_like(f[0], lk + 3), f[0])
        # Some zero-length intervals on top of the random (often reversed) ones.
        for t in range(1, n, 2):
            z = rand(lq) < 0.15
            f[t + 1] = torch.where(z, f[t], f[t + 1])
        # Rows with no valid key: F0 = 0 and every interval empty (end <= start).
        dead = rand(lq) < 0.15
        if bq[b + 1] == T_q:
            dead[-1] = True  # the last packed query row is always one of them
        f[0] = torch.where(dead, torch.zeros_like(f[0]), f[0])
        for t in range(1, n, 2):
            shrunk = (f[t].double() * rand(lq)).floor().to(torch.int64)
            f[t + 1] = torch.where(dead, shrunk, f[t + 1])
        out[0, :, bq[b]:bq[b + 1]] = f.to(torch.int32)
    return out
