"""The chunk factors behind stage 1 of the Gated DeltaNet forward
(precast/kernels/gdn_chunk_sm90.py), computed with the reference's chunk factors: the
contract between the two stages, so a GPU test can check each stage alone (stage 1 against
this; stage 2 fed with this instead of stage 1's output). Stage 1 stores M, T and both
factor rows (laid out as precast/kernels/gdn_layout.py says: work16 = T and M packed into
one block, pack_work16 below); W and U
are what T and the second factor row make, and what a CPU emulation of stage 2 uses.

Per packed chunk p (sequence b's chunk c is p = sum_{b' < b} ceil(len_b' / 64) + c) and
output head h, with Q^, K^ the chunk's q, k rows (L2-normalized when asked: q^ = r_q q with
r_q = rsqrt(max(|q|^2, 1e-24)), else r_q = 1) and G the in-chunk cumulative log gate:
``work[p, h]`` is 64 rows of [W | U | M] (K, V and 64 columns),
    W = T diag(beta exp(G)) K^,   U = T diag(beta) V,   M = scale (Gamma * Q^ K^^T)
(causal, diagonal included), and ``factors[p, h]`` is [q_f | k_f | G_L] (64, 64, 1):
    q_f = scale exp(G) r_q,   k_f = exp(G_L - G) r_k,   G_L = G at the last real token,
the per-row factors that turn the raw q, k rows into Qd = diag(q_f) Q and
Kd = diag(k_f) K (stage 2 reads q and k themselves). Rows past a sequence's end, and
rows p past the batch's chunk count, are zero.

With ``with_inverse=True`` also ``inv[p, h]`` = T = (I + A)^-1 (64 x 64; identity rows past
a sequence's end) and
``scales[p, h]`` = [t_w | t_u] = [beta exp(G) r_k | beta] (64, 64), the column scales of
the scaled inverses (W = T diag(t_w) K, U = T diag(t_u) V with the raw rows; zero past the
end): work32's second factor row (precast/kernels/gdn_layout.py).
"""
from __future__ import annotations

import torch

from .gated_delta_net import (CHUNK_SIZE, _chunk_factors, _expand_heads, l2_row_scales,
                              to_chunks)
from .offsets import sequence_offsets


def gdn_chunk_workspace_reference(q, k, v, g, beta, cu_seqlens, *, scale=None,
                                  use_qk_l2norm_in_kernel: bool = False,
                                  compute_dtype: torch.dtype = torch.float32,
                                  with_inverse: bool = False):
    """(work [T // 64 + N, HO, 64, K + V + 64], factors [T // 64 + N, HO, 129]) in
    ``compute_dtype``, on q's device; with_inverse: also (inv [T // 64 + N, HO, 64, 64],
    scales [T // 64 + N, HO, 128])."""
    T, HQ, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    HO = max(HQ, HV)
    offs = sequence_offsets(cu_seqlens, "cu_seqlens", (torch.int32, torch.int64))
    N = len(offs) - 1
    scale = K ** -0.5 if scale is None else scale
    qe, ke, ve = (_expand_heads(x, HO).to(compute_dtype) for x in (q, k, v))
    r_q, r_k = (l2_row_scales(x) if use_qk_l2norm_in_kernel  # [T, HO]
                else torch.ones(x.shape[:-1], dtype=x.dtype, device=x.device) for x in (qe, ke))
    qn, kn = qe * r_q[..., None], ke * r_k[..., None]
    g, beta = g.to(compute_dtype), beta.to(compute_dtype)
    C = CHUNK_SIZE
    chunks = T // C + N
    work = q.new_zeros((chunks, HO, C, K + V + C), dtype=compute_dtype)
    factors = q.new_zeros((chunks, HO, 2 * C + 1), dtype=compute_dtype)
    inv = q.new_zeros((chunks, HO, C, C), dtype=compute_dtype)
    scales = q.new_zeros((chunks, HO, 2 * C), dtype=compute_dtype)
    p = 0
    for b in range(N):
        s, e = offs[b], offs[b + 1]
        if e == s:
            continue
        G, Gamma, Tm, U, W, _, _, kc, n, _ = _chunk_factors(kn[s:e], ve[s:e], g[s:e],
                                                             beta[s:e], C)
        qc, rq, rk = (to_chunks(x[s:e], C) for x in (qn, r_q, r_k))
        real = to_chunks(torch.ones(e - s, HO, dtype=compute_dtype, device=q.device), C)
        M = scale * Gamma * (qc @ kc.transpose(-1, -2))
        g_last = G[..., -1:]
        q_f = scale * torch.exp(G) * rq * real
        k_f = torch.exp(g_last - G) * rk * real
        work[p:p + n] = torch.cat([W, U, M], dim=-1).movedim(1, 0)  # [n, HO, C, F]
        factors[p:p + n] = torch.cat([q_f, k_f, g_last], dim=-1).movedim(1, 0)
        bc = to_chunks(beta[s:e], C)  # zero past the end
        inv[p:p + n] = Tm.movedim(1, 0)
        scales[p:p + n] = torch.cat([bc * torch.exp(G) * rk, bc], dim=-1).movedim(1, 0)
        p += n
    return (work, factors, inv, scales) if with_inverse else (work, factors)


def pack_work16(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """work16's packed block P from T (unit lower triangular) and M (causal, diagonal
    included), both [..., 64, 64]: P[i, j] = M[i, j] for j <= i and T[j, i] for j > i
    (precast/kernels/gdn_layout.py)."""
    n = t.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool, device=t.device).triu(1)
    return torch.where(upper, t.transpose(-1, -2), m)


def unpack_work16(p: torch.Tensor):
    """(T, M) from work16's packed blocks P [..., 64, 64] (pack_work16's inverse)."""
    n = p.shape[-1]
    upper = torch.ones(n, n, dtype=torch.bool, device=p.device).triu(1)
    zero = p.new_zeros(())
    t = torch.where(upper, p, zero).transpose(-1, -2) + torch.eye(n, dtype=p.dtype,
                                                                 device=p.device)
    return t, torch.where(upper, zero, p)
