"""What stage 1 of the Gated DeltaNet forward (precast/kernels/gdn_chunk_sm90.py) leaves in
its workspace, computed with the reference's chunk factors: the contract between the two
stages, so a GPU test can check each stage alone (stage 1 against this; stage 2 fed with
this instead of stage 1's output).

Per packed chunk p (sequence b's chunk c is p = sum_{b' < b} ceil(len_b' / 64) + c) and
output head h: ``work[p, h]`` is 64 rows of [Qd | Kd | W | U | M] (K, K, K, V and 64
columns) and ``g_last[p, h]`` the chunk's cumulative log gate at its last real token, with
    Qd = scale diag(exp(G)) Qc,  Kd = diag(exp(G_L - G)) Kc,  W = T diag(beta exp(G)) Kc,
    U = T diag(beta) Vc,         M = scale (Gamma * Qc Kc^T)   (causal, diagonal included)
(rows past a sequence's end are zero). Rows p past the batch's chunk count stay zero.
"""
from __future__ import annotations

import torch

from .gated_delta_net import CHUNK_SIZE, _chunk_factors, _expand_heads, l2norm_rows
from .offsets import sequence_offsets


def gdn_chunk_workspace_reference(q, k, v, g, beta, cu_seqlens, *, scale=None,
                                  use_qk_l2norm_in_kernel: bool = False,
                                  compute_dtype: torch.dtype = torch.float32):
    """(work [T // 64 + N, HO, 64, 3K + V + 64], g_last [T // 64 + N, HO]) in
    ``compute_dtype``, on q's device."""
    T, HQ, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    HO = max(HQ, HV)
    offs = sequence_offsets(cu_seqlens, "cu_seqlens", (torch.int32, torch.int64))
    N = len(offs) - 1
    scale = K ** -0.5 if scale is None else scale
    qe, ke, ve = (_expand_heads(x, HO).to(compute_dtype) for x in (q, k, v))
    if use_qk_l2norm_in_kernel:
        qe, ke = l2norm_rows(qe), l2norm_rows(ke)
    g, beta = g.to(compute_dtype), beta.to(compute_dtype)
    C = CHUNK_SIZE
    chunks = T // C + N
    work = q.new_zeros((chunks, HO, C, 3 * K + V + C), dtype=compute_dtype)
    g_last = q.new_zeros((chunks, HO), dtype=compute_dtype)
    p = 0
    for b in range(N):
        s, e = offs[b], offs[b + 1]
        if e == s:
            continue
        G, Gamma, _, U, W, Kd, _, kc, n, pad = _chunk_factors(ke[s:e], ve[s:e], g[s:e],
                                                               beta[s:e], C)
        qc = qe[s:e]
        if pad:
            qc = torch.cat([qc, qc.new_zeros((pad, *qc.shape[1:]))], dim=0)
        qc = qc.reshape(n, C, HO, K).movedim(2, 0)  # [HO, n, C, K]
        Qd = scale * torch.exp(G)[..., None] * qc
        M = scale * Gamma * (qc @ kc.transpose(-1, -2))
        block = torch.cat([Qd, Kd, W, U, M], dim=-1)  # [HO, n, C, F]
        work[p:p + n] = block.movedim(1, 0)
        g_last[p:p + n] = G[..., -1].movedim(1, 0)
        p += n
    return work, g_last
