r"""Reference Gated DeltaNet (gated delta rule linear attention), packed THD layout.

Everything here is plain torch (CPU or GPU), computed in ``compute_dtype``
(float64 by default). GPU kernels, their tests and benchmarks compare against
these functions.

Recurrence
----------
Every (sequence, head) pair carries a matrix state. In the math below the state
is written ``S`` with shape ``K x V`` (rows indexed by the key dimension). Per
token ``t`` with query ``q_t`` (K), key ``k_t`` (K), value ``v_t`` (V), log gate
``g_t`` and write strength ``beta_t``::

    alpha_t = exp(g_t)                     # g is a natural-log gate (usually <= 0)
    S      <- alpha_t * S                  # decay
    r       = v_t - S^T k_t                # delta-rule residual (uses the decayed S)
    S      <- S + beta_t * k_t r^T         # rank-1 correction
    o_t     = S^T (scale * q_t)            # read-out with the updated state

or in one line ``S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``.
``scale`` defaults to ``1 / sqrt(K)``.

Memory layout
-------------
* ``q [T, HQ, K]``, ``k [T, HK, K]``, ``v [T, HV, V]``, ``g [T, HO]``,
  ``beta [T, HO]``: all sequences packed along T; sequence ``b`` is the token
  range ``cu_seqlens[b]:cu_seqlens[b + 1]``.
* ``HO = max(HQ, HV)`` output heads; grouped heads: output head ``h`` reads q
  head ``h // (HO // HQ)``, k head ``h // (HO // HK)``, v head
  ``h // (HO // HV)``. ``HK`` is ``HQ`` or ``HV``.
* ``o [T, HO, V]``.
* States are stored **V-major**: ``[N, HO, V, K]`` with K contiguous, i.e. each
  ``[V, K]`` slice is ``S^T``. Internally the functions work with ``S`` in
  ``K x V`` form and transpose only at the boundary.

Chunked (WY) form -- what the GPU kernels implement
---------------------------------------------------
Split each sequence into chunks of ``C = 64`` tokens (the last one may be
partial; chunks restart at every sequence start). Inside one chunk let ``S_0``
be the state entering it, ``i, j = 1..L`` local token indices and

    G_i     = g_1 + ... + g_i               (in-chunk cumulative log decay)
    gamma_i = exp(G_i)                      (decay from the chunk start to token i)
    Gamma   = [exp(G_i - G_j)]_{i >= j}     (causal decay, zero above the diagonal)

Write the update as ``S_t = alpha_t S_{t-1} + k_t delta_t^T`` with
``delta_t = beta_t (v_t - alpha_t S_{t-1}^T k_t)``. Unrolling,

    S_t = gamma_t S_0 + sum_{j<=t} exp(G_t - G_j) k_j delta_j^T,

and substituting ``alpha_t S_{t-1}`` into ``delta_t`` gives a unit
lower-triangular system for the stacked rows ``Delta = [delta_t^T]`` (L x V):

    (I + A) Delta = diag(beta) (Vc - diag(gamma) Kc S_0),
    A = strict_tril(diag(beta) (Gamma * Kc Kc^T))          (L x L)

(``Kc``, ``Vc``, ``Qc`` are the chunk's rows of k, v, q; ``*`` is elementwise).
With the WY factors

    Tm = (I + A)^{-1}                       (unit lower triangular, L x L)
    U  = Tm diag(beta) Vc                   (L x V, "pseudo values")
    W  = Tm diag(beta * gamma) Kc           (L x K, decayed "pseudo keys")

we have ``Delta = U - W S_0`` and

    S_L = gamma_L S_0 + Kd^T (U - W S_0),   Kd = diag(exp(G_L - G)) Kc
    O   = scale (diag(gamma) Qc S_0 + (Gamma * Qc Kc^T) (U - W S_0))

(the ``Gamma * Qc Kc^T`` mask is causal *including* the diagonal because
``o_t`` reads the state after token t's own update). So a chunk acts on the
incoming state affinely: ``S_L = Phi S_0 + Kd^T U`` with
``Phi = gamma_L I - Kd^T W`` (K x K).

Span summaries (context parallelism)
------------------------------------
Composing the chunk maps over a whole span gives, in the stored V-major
convention (``S0``, ``S_end`` are ``[V, K]`` slices):

    S_end = S0 @ A + E

where ``E`` (``[HO, V, K]`` per span) is the end state for a zero initial state
and ``A = Phi_total^T`` (``[HO, K, K]``) is the transposed K x V transition,
``Phi_total = prod_t alpha_t (I - beta_t k_t k_t^T)`` (latest token leftmost).
Two consecutive spans compose as ``A = A1 @ A2``, ``E = E1 @ A2 + E2``.

Backward
--------
There is no hand-written backward here: the backward reference for the GPU
backward kernels is ``torch.autograd`` applied to
:func:`gdn_recurrent_reference` (every op is out-of-place and differentiable
w.r.t. q, k, v, g, beta and initial_state). The chunked and summary references
are differentiable too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .offsets import sequence_offsets

__all__ = [
    "CHUNK_SIZE",
    "L2NORM_EPS",
    "l2norm_rows",
    "gdn_recurrent_reference",
    "gdn_chunked_reference",
    "summary_reference",
    "rms_error_ratio",
    "chunk_flops",
    "forward_flops",
]

#: Tokens per chunk of the chunked algorithm (and granularity of checkpoints).
CHUNK_SIZE = 64
#: Floor on the sum of squares in :func:`l2norm_rows`.
L2NORM_EPS = 1e-24

_HALF = (torch.float16, torch.bfloat16)


def l2norm_rows(x: torch.Tensor) -> torch.Tensor:
    """Normalize the last dimension: ``x * rsqrt(max(sum(x^2), 1e-24))``.

    fp32 semantics: half-precision inputs (fp16/bf16) are upcast and the
    result is float32; float32/float64 inputs are computed and returned in
    their own dtype. An all-zero row stays zero.
    """
    if not x.is_floating_point():
        raise ValueError(f"l2norm_rows expects a floating tensor, got {x.dtype}")
    xf = x.float() if x.dtype in _HALF else x
    return xf * l2_row_scales(xf)[..., None]


def l2_row_scales(x: torch.Tensor) -> torch.Tensor:
    """``r = rsqrt(max(sum(x^2), 1e-24))`` over the last dimension (``l2norm_rows(x) = r x``
    for float32/float64 x), in x's dtype."""
    return torch.rsqrt(torch.clamp((x * x).sum(dim=-1), min=L2NORM_EPS))


def to_chunks(x: torch.Tensor, C: int = CHUNK_SIZE) -> torch.Tensor:
    """One sequence's rows ``[L, HO, *]`` as ``[HO, n, C, *]`` chunks (n = ceil(L / C)),
    zero rows past the end."""
    L = x.shape[0]
    n = -(-L // C)
    if n * C > L:
        x = torch.cat([x, x.new_zeros((n * C - L, *x.shape[1:]))], dim=0)
    return x.reshape(n, C, *x.shape[1:]).movedim(2, 0)


# ---------------------------------------------------------------------------
# Validation and preparation
# ---------------------------------------------------------------------------


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _check_compute_dtype(compute_dtype) -> None:
    if not isinstance(compute_dtype, torch.dtype) or compute_dtype not in (
        torch.float32,
        torch.float64,
    ):
        raise ValueError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype!r}")


def _check_cu_seqlens(cu_seqlens: torch.Tensor, T: int) -> list[int]:
    offs = sequence_offsets(cu_seqlens, "cu_seqlens", (torch.int32, torch.int64))
    if offs[-1] != T:
        raise ValueError(f"cu_seqlens[-1] must equal the packed length T={T}, got {offs[-1]}")
    return offs


def _check_gates(g: torch.Tensor, beta: torch.Tensor, T: int) -> int:
    _check_float("g", g)
    _check_float("beta", beta)
    if g.dim() != 2:
        raise ValueError(f"g must be 2-D [T, HO], got shape {tuple(g.shape)}")
    if beta.shape != g.shape:
        raise ValueError(f"beta must have the shape of g {tuple(g.shape)}, got {tuple(beta.shape)}")
    if g.shape[0] != T:
        raise ValueError(f"g/beta must have T={T} rows, got {g.shape[0]}")
    return g.shape[1]


def _expand_heads(x: torch.Tensor, HO: int) -> torch.Tensor:
    """[T, H, D] -> [T, HO, D]: output head h reads input head h // (HO // H)."""
    group = HO // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


@dataclass
class _Prepared:
    q: torch.Tensor  # [T, HO, K] compute dtype (l2-normalized if asked, unscaled)
    k: torch.Tensor  # [T, HO, K]
    v: torch.Tensor  # [T, HO, V]
    g: torch.Tensor  # [T, HO]
    beta: torch.Tensor  # [T, HO]
    offs: list[int]
    scale: float
    s0: torch.Tensor | None  # [N, HO, V, K] (gathered from the pool if any)
    pool: torch.Tensor | None  # [N_pool, HO, V, K]
    idx: torch.Tensor | None  # [N] int64
    ckpt: int | None
    HO: int
    K: int
    V: int


def _prepare(
    q, k, v, g, beta, cu_seqlens, scale, initial_state, checkpoint_every_n_tokens, state_indices,
    use_qk_l2norm_in_kernel, compute_dtype,
) -> _Prepared:
    _check_compute_dtype(compute_dtype)
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(t.shape)}")
    T, HQ, K = q.shape
    _, HK, Kk = k.shape
    _, HV, V = v.shape
    if k.shape[0] != T or v.shape[0] != T:
        raise ValueError(
            f"q, k, v must have the same number of tokens, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if Kk != K:
        raise ValueError(f"q and k must have the same head dim K, got {K} and {Kk}")
    if K < 1 or V < 1:
        raise ValueError(f"head dims must be positive, got K={K}, V={V}")
    if HQ < 1 or HV < 1 or HK < 1:
        raise ValueError(f"head counts must be positive, got HQ={HQ}, HK={HK}, HV={HV}")
    HO = max(HQ, HV)
    if HO % min(HQ, HV) != 0:
        raise ValueError(
            f"HQ and HV must be equal or one a multiple of the other, got HQ={HQ}, HV={HV}"
        )
    if HK not in (HQ, HV):
        raise ValueError(f"HK must equal HQ ({HQ}) or HV ({HV}), got {HK}")
    HOg = _check_gates(g, beta, T)
    if HOg != HO:
        raise ValueError(f"g/beta must have HO = max(HQ, HV) = {HO} heads, got {HOg}")
    offs = _check_cu_seqlens(cu_seqlens, T)
    N = len(offs) - 1

    if scale is None:
        scale = 1.0 / math.sqrt(K)
    else:
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"scale must be a real number or None, got {scale!r}") from None
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")

    ckpt = None
    if checkpoint_every_n_tokens is not None:
        if isinstance(checkpoint_every_n_tokens, bool) or not isinstance(checkpoint_every_n_tokens, int):
            raise ValueError(
                f"checkpoint_every_n_tokens must be an int or None, got {checkpoint_every_n_tokens!r}"
            )
        ckpt = checkpoint_every_n_tokens
        if ckpt <= 0 or ckpt % CHUNK_SIZE != 0:
            raise ValueError(
                f"checkpoint_every_n_tokens must be a positive multiple of the chunk size "
                f"{CHUNK_SIZE}, got {ckpt}"
            )

    state_shape = (HO, V, K)
    s0 = pool = idx = None
    if state_indices is not None:
        if ckpt is not None:
            raise ValueError("state_indices and checkpoint_every_n_tokens are mutually exclusive")
        if initial_state is None:
            raise ValueError("state_indices requires initial_state (the state pool [N_pool, HO, V, K])")
        int_types = (torch.int32, torch.int64)
        if not isinstance(state_indices, torch.Tensor) or state_indices.dtype not in int_types:
            raise ValueError(
                f"state_indices must be an int32 (or int64) tensor, got "
                f"{getattr(state_indices, 'dtype', type(state_indices).__name__)}"
            )
        if state_indices.shape != (N,):
            raise ValueError(f"state_indices must have shape [N] = ({N},), got {tuple(state_indices.shape)}")
        _check_float("initial_state", initial_state)
        if initial_state.dim() != 4 or tuple(initial_state.shape[1:]) != state_shape:
            raise ValueError(
                f"initial_state (state pool) must have shape [N_pool, {HO}, {V}, {K}], got "
                f"{tuple(initial_state.shape)}"
            )
        n_pool = initial_state.shape[0]
        ids = [int(i) for i in state_indices.tolist()]
        bad = [i for i in ids if not 0 <= i < n_pool]
        if bad:
            raise ValueError(f"state_indices must lie in [0, N_pool={n_pool}), got {bad[:4]}")
        if len(set(ids)) != len(ids):
            raise ValueError("state_indices must be distinct (two sequences cannot share a pool row)")
        pool = initial_state.to(compute_dtype)
        idx = state_indices.to(device=pool.device, dtype=torch.int64)
        s0 = pool.index_select(0, idx)
    elif initial_state is not None:
        _check_float("initial_state", initial_state)
        if tuple(initial_state.shape) != (N, *state_shape):
            raise ValueError(
                f"initial_state must have shape [N, HO, V, K] = {(N, *state_shape)}, got "
                f"{tuple(initial_state.shape)}"
            )
        s0 = initial_state.to(compute_dtype)

    qc = q.to(compute_dtype)
    kc = k.to(compute_dtype)
    if use_qk_l2norm_in_kernel:
        qc = l2norm_rows(qc)
        kc = l2norm_rows(kc)
    return _Prepared(
        q=_expand_heads(qc, HO),
        k=_expand_heads(kc, HO),
        v=_expand_heads(v.to(compute_dtype), HO),
        g=g.to(compute_dtype),
        beta=beta.to(compute_dtype),
        offs=offs,
        scale=scale,
        s0=s0,
        pool=pool,
        idx=idx,
        ckpt=ckpt,
        HO=HO,
        K=K,
        V=V,
    )


def _run(p: _Prepared, output_final_state: bool, per_sequence, dtype) -> dict:
    """Drive ``per_sequence`` over all sequences and assemble the result dict.

    ``per_sequence(q, k, v, g, beta, S0, scale, ckpt)`` gets one sequence's
    head-expanded rows and its K x V initial state ``[HO, K, V]`` and returns
    ``(o [L, HO, V], S_end [HO, K, V], checkpoint states list of [HO, K, V])``.
    """
    HO, K, V = p.HO, p.K, p.V
    dev = p.q.device
    N = len(p.offs) - 1
    outs, finals, ckpts = [], [], []
    for b in range(N):
        lo, hi = p.offs[b], p.offs[b + 1]
        if p.s0 is not None:
            S0 = p.s0[b].transpose(-1, -2)  # V-major [HO, V, K] -> K x V [HO, K, V]
        else:
            S0 = torch.zeros(HO, K, V, dtype=dtype, device=dev)
        o, S, cps = per_sequence(
            p.q[lo:hi], p.k[lo:hi], p.v[lo:hi], p.g[lo:hi], p.beta[lo:hi], S0, p.scale, p.ckpt
        )
        outs.append(o)
        finals.append(S.transpose(-1, -2))
        ckpts.extend(c.transpose(-1, -2) for c in cps)

    o = torch.cat(outs, dim=0) if outs else torch.zeros(0, HO, V, dtype=dtype, device=dev)
    final = torch.stack(finals) if finals else torch.zeros(0, HO, V, K, dtype=dtype, device=dev)
    res = {
        "o": o,
        "final_state": final if output_final_state else None,
        "checkpoints": None,
        "state_pool": None,
    }
    if p.ckpt is not None:
        res["checkpoints"] = (
            torch.stack(ckpts) if ckpts else torch.zeros(0, HO, V, K, dtype=dtype, device=dev)
        )
    if p.pool is not None:
        res["state_pool"] = p.pool.index_copy(0, p.idx, final) if N else p.pool.clone()
    return res


_DOC_ARGS = """
    Args:
        q: ``[T, HQ, K]`` queries, k: ``[T, HK, K]`` keys, v: ``[T, HV, V]``
            values, g: ``[T, HO]`` natural-log gates, beta: ``[T, HO]`` write
            strengths; all packed along T.
        cu_seqlens: ``[N + 1]`` int32/int64 sequence offsets (read on the host).
        scale: query scale, default ``1 / sqrt(K)``.
        initial_state: ``[N, HO, V, K]`` V-major initial states (None: zeros),
            or with ``state_indices`` a pool ``[N_pool, HO, V, K]``.
        output_final_state: return ``final_state [N, HO, V, K]``.
        use_qk_l2norm_in_kernel: l2-normalize q and k rows (:func:`l2norm_rows`)
            before use (before ``scale`` is applied).
        checkpoint_every_n_tokens: n, a positive multiple of 64: also return
            ``checkpoints [R, HO, V, K]``, for each sequence (in order) the state
            entering local positions 0, n, 2n, ... < len; ``R = sum ceil(len / n)``.
        state_indices: ``[N]`` int32 distinct rows of the pool: sequence b reads
            its initial state from ``pool[state_indices[b]]``; ``state_pool`` is
            a copy of the pool with the final states written at those rows.
            Exclusive with checkpoints.
        compute_dtype: float64 (default) or float32.

    Returns:
        dict with ``o [T, HO, V]``, ``final_state`` (or None), ``checkpoints``
        (or None), ``state_pool`` (or None), all in ``compute_dtype``.
"""


# ---------------------------------------------------------------------------
# Recurrent (token-by-token) reference
# ---------------------------------------------------------------------------


def _recurrent_sequence(q, k, v, g, beta, S, scale, ckpt):
    alpha = torch.exp(g)  # [L, HO]
    outs, cps = [], []
    for t in range(q.shape[0]):
        if ckpt is not None and t % ckpt == 0:
            cps.append(S)
        S = alpha[t, :, None, None] * S
        r = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
        S = S + beta[t, :, None, None] * k[t, :, :, None] * r[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, q[t] * scale))
    o = torch.stack(outs) if outs else v.new_zeros(v.shape)
    return o, S, cps


def gdn_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    checkpoint_every_n_tokens: int | None = None,
    state_indices: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> dict:
    """Gated DeltaNet forward, token by token (the ground truth).

    Loops over sequences and tokens, vectorized over heads, exactly as the
    recurrence in the module docstring. Every op is out-of-place, so this is
    also the **backward reference**: gradients w.r.t. q, k, v, g, beta and
    initial_state come from ``torch.autograd`` on this function.
    """
    p = _prepare(
        q, k, v, g, beta, cu_seqlens, scale, initial_state, checkpoint_every_n_tokens, state_indices,
        use_qk_l2norm_in_kernel, compute_dtype,
    )
    return _run(p, output_final_state, _recurrent_sequence, compute_dtype)


gdn_recurrent_reference.__doc__ += _DOC_ARGS


# ---------------------------------------------------------------------------
# Chunked (WY representation) reference
# ---------------------------------------------------------------------------


def _chunk_factors(k, v, g, beta, C: int):
    """Per-chunk WY factors for one sequence, all chunks at once.

    Inputs ``k [L, HO, K]``, ``v [L, HO, V]``, ``g, beta [L, HO]``. The sequence
    is zero-padded to a multiple of ``C``; a padding token has ``g = 0`` (no
    decay), ``beta = 0`` and ``k = v = 0``, so its row of ``A`` is zero, its row
    of ``Tm`` is the identity row, ``U``/``W``/``Kd`` rows are zero and the
    chunk's total decay is that of its last real token: the padded chunk acts
    exactly like the partial chunk of its real rows.

    Returns, with heads first and chunks second (``n`` chunks):
        G      [HO, n, C]     in-chunk cumulative log decay
        Gamma  [HO, n, C, C]  exp(G_i - G_j) for i >= j, else 0
        Tm     [HO, n, C, C]  (I + A)^{-1}
        U      [HO, n, C, V]  Tm diag(beta) V
        W      [HO, n, C, K]  Tm diag(beta gamma) K
        Kd     [HO, n, C, K]  diag(exp(G_C - G)) K   (decay to the chunk end)
        gamma_end [HO, n]     exp(G_C), whole-chunk decay
        Kc     [HO, n, C, K]  the chunked (padded) keys
    plus the chunk count ``n`` and the padding length.
    """
    L = k.shape[0]
    n = -(-L // C)
    pad = n * C - L
    kc, vc, gc, bc = (to_chunks(x, C) for x in (k, v, g, beta))
    G = torch.cumsum(gc, dim=-1)
    incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    strict = incl.tril(-1)
    diff = G[..., :, None] - G[..., None, :]
    Gamma = torch.exp(diff.masked_fill(~incl, float("-inf")))
    kk = kc @ kc.transpose(-1, -2)
    A = (bc[..., :, None] * Gamma * kk).masked_fill(~strict, 0.0)
    eye = torch.eye(C, dtype=k.dtype, device=k.device)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    U = Tm @ (bc[..., None] * vc)
    W = Tm @ ((bc * torch.exp(G))[..., None] * kc)
    Kd = torch.exp(G[..., -1:] - G)[..., None] * kc
    gamma_end = torch.exp(G[..., -1])
    return G, Gamma, Tm, U, W, Kd, gamma_end, kc, n, pad


def _chunked_sequence(q, k, v, g, beta, S, scale, ckpt, C: int = CHUNK_SIZE):
    L, HO, Vd = v.shape
    if L == 0:
        return v.new_zeros((0, HO, Vd)), S, []
    G, Gamma, _, U, W, Kd, gamma_end, kc, n, _ = _chunk_factors(k, v, g, beta, C)
    qc = to_chunks(q, C)  # [HO, n, C, K]
    # Intra-chunk attention with the causal decay mask (diagonal included).
    P = Gamma * (qc @ kc.transpose(-1, -2))  # Gamma is already zero above the diagonal
    Qd = torch.exp(G)[..., None] * qc  # diag(gamma) Q

    outs, cps = [], []
    step = None if ckpt is None else ckpt // C
    for c in range(n):
        if step is not None and c % step == 0:
            cps.append(S)
        D = U[:, c] - W[:, c] @ S  # Delta = U - W S0          [HO, C, V]
        outs.append(scale * (Qd[:, c] @ S + P[:, c] @ D))  # [HO, C, V]
        S = gamma_end[:, c, None, None] * S + Kd[:, c].transpose(-1, -2) @ D
    o = torch.cat(outs, dim=1)[:, :L].movedim(0, 1)  # [L, HO, V]
    return o, S, cps


def gdn_chunked_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm_in_kernel: bool = False,
    checkpoint_every_n_tokens: int | None = None,
    state_indices: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> dict:
    """Gated DeltaNet forward by the chunked WY algorithm (chunk size 64).

    Same contract as :func:`gdn_recurrent_reference` (equal to it to ~1e-10 in
    float64). Per sequence and chunk (see the module docstring for the
    derivation):

    1. ``G = cumsum(g)`` inside the chunk; ``Gamma_ij = exp(G_i - G_j)`` (i >= j).
    2. ``A = strict_tril(diag(beta) (Gamma * K K^T))``, ``Tm = (I + A)^{-1}``
       by a unit lower-triangular solve.
    3. ``U = Tm diag(beta) V``, ``W = Tm diag(beta exp(G)) K``.
    4. With the incoming state ``S`` (K x V): ``Delta = U - W S``;
       ``O = scale (diag(exp(G)) Q S + (Gamma * Q K^T) Delta)``;
       ``S <- exp(G_last) S + (diag(exp(G_last - G)) K)^T Delta``.

    Chunks restart at every sequence start; a partial last chunk is handled by
    identity padding (see ``_chunk_factors``). Checkpoints fall on chunk
    boundaries because n is a multiple of 64.
    """
    p = _prepare(
        q, k, v, g, beta, cu_seqlens, scale, initial_state, checkpoint_every_n_tokens, state_indices,
        use_qk_l2norm_in_kernel, compute_dtype,
    )
    return _run(p, output_final_state, _chunked_sequence, compute_dtype)


gdn_chunked_reference.__doc__ += _DOC_ARGS


# ---------------------------------------------------------------------------
# Span summaries for context parallelism
# ---------------------------------------------------------------------------


def summary_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    use_qk_l2norm_in_kernel: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> dict:
    """Affine summary of each span (sequence of ``cu_seqlens``) for context parallelism.

    For span b, the end state as a function of its initial state ``S0``
    (V-major ``[HO, V, K]``) is ``S_end = S0 @ A[b] + E[b]`` where

    * ``E = end_state [N, HO, V, K]``: the span's end state from a zero state;
    * ``A = transition [N, HO, K, K]``: ``Phi^T`` with
      ``Phi = prod_t alpha_t (I - beta_t k_t k_t^T)`` (latest token leftmost),
      the linear part of the K x V update ``S_end = Phi S0 + E^T``.

    Spans compose left to right: span 1 then span 2 gives
    ``A = A1 @ A2`` and ``E = E1 @ A2 + E2``. An empty span has ``A = I``,
    ``E = 0``.

    Computed chunk by chunk with the WY factors: a chunk maps ``S -> Phi_c S + e_c``
    with ``Phi_c = exp(G_last) I - Kd^T W`` and ``e_c = Kd^T U``.

    Args: ``k [T, HK, K]``, ``v [T, HV, V]``, ``g``/``beta [T, HO]`` (HO from g;
    HK and HV must divide HO), ``cu_seqlens [N + 1]``; ``use_qk_l2norm_in_kernel``
    normalizes k rows. Returns ``dict(transition=A, end_state=E)`` in
    ``compute_dtype``.
    """
    _check_compute_dtype(compute_dtype)
    for name, t in (("k", k), ("v", v)):
        _check_float(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D [T, H, D], got shape {tuple(t.shape)}")
    T, HK, K = k.shape
    if v.shape[0] != T:
        raise ValueError(f"k and v must have the same number of tokens, got {T} and {v.shape[0]}")
    HV, V = v.shape[1], v.shape[2]
    HO = _check_gates(g, beta, T)
    if HK < 1 or HV < 1 or HO % HK or HO % HV:
        raise ValueError(f"HK ({HK}) and HV ({HV}) must divide the number of gate heads HO ({HO})")
    offs = _check_cu_seqlens(cu_seqlens, T)

    kc = k.to(compute_dtype)
    if use_qk_l2norm_in_kernel:
        kc = l2norm_rows(kc)
    kc = _expand_heads(kc, HO)
    vc = _expand_heads(v.to(compute_dtype), HO)
    gc = g.to(compute_dtype)
    bc = beta.to(compute_dtype)
    dev = k.device

    trans, ends = [], []
    eye = torch.eye(K, dtype=compute_dtype, device=dev)
    for b in range(len(offs) - 1):
        lo, hi = offs[b], offs[b + 1]
        Phi = eye.expand(HO, K, K)
        E = torch.zeros(HO, K, V, dtype=compute_dtype, device=dev)  # K x V form
        if hi > lo:
            _, _, _, U, W, Kd, gamma_end, _, n, _ = _chunk_factors(
                kc[lo:hi], vc[lo:hi], gc[lo:hi], bc[lo:hi], CHUNK_SIZE
            )
            for c in range(n):
                KdT = Kd[:, c].transpose(-1, -2)
                Phi_c = gamma_end[:, c, None, None] * eye - KdT @ W[:, c]
                Phi = Phi_c @ Phi
                E = Phi_c @ E + KdT @ U[:, c]
        trans.append(Phi.transpose(-1, -2))
        ends.append(E.transpose(-1, -2))
    N = len(offs) - 1
    return {
        "transition": torch.stack(trans) if N else torch.zeros(0, HO, K, K, dtype=compute_dtype, device=dev),
        "end_state": torch.stack(ends) if N else torch.zeros(0, HO, V, K, dtype=compute_dtype, device=dev),
    }


# ---------------------------------------------------------------------------
# Accuracy and work measures (tests and benchmarks)
# ---------------------------------------------------------------------------


def rms_error_ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    """``RMS(got - want) / RMS(want)`` in float64: the accuracy measure of the issue (2e-2
    for bf16 outputs). 0 when both are all zero (an empty tensor included); inf when only
    ``want`` is."""
    want = want.to(torch.float64)
    err = (got.to(device=want.device, dtype=torch.float64) - want).pow(2).mean().sqrt()
    ref = want.pow(2).mean().sqrt()
    if want.numel() == 0 or (ref == 0 and err == 0):
        return 0.0
    return (err / ref).item()


def chunk_flops(k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> int:
    """Matmul FLOPs of the chunked algorithm per chunk and head (the triangular inverse and
    elementwise work left out): Q K^T, K K^T, W = Tm (beta gamma K), U = Tm (beta V) and
    M Delta at ``2 C^2 (3K + 2V)``, then W S, Q S and Kd^T Delta at ``6 C K V``. 11.5
    MFLOP at K = V = 128."""
    return 2 * chunk * chunk * (3 * k_dim + 2 * v_dim) + 6 * chunk * k_dim * v_dim


def forward_flops(lengths, heads: int, k_dim: int, v_dim: int, chunk: int = CHUNK_SIZE) -> int:
    """Matmul FLOPs of a forward over sequences of these lengths with ``heads`` output heads:
    a partial last chunk counts as a whole one (the kernels compute it padded)."""
    chunks = sum(-(-int(n) // chunk) for n in lengths)
    return chunks * heads * chunk_flops(k_dim, v_dim, chunk)
