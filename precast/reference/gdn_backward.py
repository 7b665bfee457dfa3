"""The Gated DeltaNet backward by chunks, with explicit formulas: the math the backward
kernels are to implement (the backward issue), checked on the CPU against autograd of the
token-by-token reference (tests/test_reference_gdn_backward.py).

Per sequence, chunks of 64 tokens are visited last to first with dS, the gradient of the
state leaving the chunk (dfinal for the last one). The state entering each chunk comes from
the forward's checkpoints where given (every n tokens, n a multiple of 64) and is
regenerated chunk by chunk from the nearest one before it (from the initial state without
checkpoints). With S (K x V) entering, the chunk's forward is (notation of
precast/reference/gated_delta_net.py, q and k rows L2-normalized when asked):

    G = cumsum(g), gamma = exp(G), Gamma_ij = exp(G_i - G_j) (i >= j), d = exp(G_L - G)
    A = strict_tril(diag(beta) (Gamma * K K^T)),  T = (I + A)^-1
    W = T diag(beta gamma) K,  U = T diag(beta) V,  Delta = U - W S
    O = scale (diag(gamma) Q S + (Gamma * Q K^T) Delta)
    S' = gamma_L S + (diag(d) K)^T Delta

and its backward, given dO and dS' (each line the chain rule of one line above, in
reverse; products are per head):

    dS = gamma_L dS' + scale Q^T diag(gamma) dO - W^T dDelta
    dDelta = diag(d) K dS' + scale (Gamma * Q K^T)^T dO
    dW = -dDelta S^T,  dU = dDelta,  dT = dU (diag(beta) V)^T + dW (diag(beta gamma) K)^T
    dA = strict_tril(-T^T dT T^T)
    dV = diag(beta) T^T dU
    dQ = scale diag(gamma) dO S^T + (dM * Gamma) K,   dM = tril(scale dO Delta^T)
    dK = diag(d) Delta dS'^T + (dM * Gamma)^T Q + diag(beta gamma) T^T dW + (dP + dP^T) K,
         dP = diag(beta) (dA * Gamma)
    dbeta = rowsum((T^T dU) * V) + gamma * rowsum((T^T dW) * K) + rowsum(dA * Gamma * K K^T)
    dG: from gamma (O, W), from d and gamma_L (S'), from Gamma (A, M); dg = reverse cumsum
    within the chunk.

The L2 norm's Jacobian then maps dQ, dK to the raw rows: dx = r dx_n - r^3 (x . dx_n) x
(r = rsqrt(max(|x|^2, 1e-24)); only the first term where the clamp is active). Grouped
heads sum their output heads' gradients.
"""
from __future__ import annotations

import torch

from .gated_delta_net import (CHUNK_SIZE, L2NORM_EPS, _chunk_factors, _expand_heads,
                              l2_row_scales, l2norm_rows, to_chunks)
from .offsets import sequence_offsets


def _unchunk(x: torch.Tensor, L: int) -> torch.Tensor:
    """[HO, n, C, *] -> [L, HO, *]."""
    HO, n, C = x.shape[:3]
    return x.movedim(0, 2).reshape(n * C, HO, *x.shape[3:])[:L]


def _l2norm_backward(x: torch.Tensor, dxn: torch.Tensor) -> torch.Tensor:
    """d/dx of x * rsqrt(max(|x|^2, eps)), applied to dxn (rows on the last axis)."""
    r = l2_row_scales(x)[..., None]
    proj = (x * dxn).sum(-1, keepdim=True) * r ** 3 * x
    clamped = (x * x).sum(-1, keepdim=True) < L2NORM_EPS  # r is a constant there
    return r * dxn - torch.where(clamped, torch.zeros_like(proj), proj)


def _chunk_backward(qc, kc, vc, bc, G, Gamma, T, W, U, S, dO, dSn, scale):
    """One chunk, every head at once: qc, kc [HO, C, K], vc [HO, C, V], bc [HO, C] and the
    chunk's forward factors (_chunk_factors: G, Gamma, T, W, U); S and dSn [HO, K, V]
    (entering state, gradient of the leaving one), dO [HO, C, V].
    Returns (dq, dk, dv, dg, dbeta, dS entering)."""
    C = qc.shape[1]
    incl = torch.ones(C, C, dtype=torch.bool, device=qc.device).tril()
    strict = incl.tril(-1)
    gamma = torch.exp(G)
    g_last = G[:, -1]
    gamma_last = torch.exp(g_last)
    d = torch.exp(g_last[:, None] - G)
    P = kc @ kc.transpose(-1, -2)
    Bk = (bc * gamma)[:, :, None] * kc
    Bv = bc[:, :, None] * vc
    Delta = U - W @ S
    QK = qc @ kc.transpose(-1, -2)
    M = (Gamma * QK).masked_fill(~incl, 0.0)
    Kd = d[:, :, None] * kc
    QS = qc @ S

    # S' = gamma_L S + Kd^T Delta
    dS = gamma_last[:, None, None] * dSn
    dG = torch.zeros_like(G)
    dg_last = gamma_last * (S * dSn).sum((-1, -2))
    dKd = Delta @ dSn.transpose(-1, -2)
    dDelta = Kd @ dSn
    dk = d[:, :, None] * dKd
    dd = (kc * dKd).sum(-1) * d
    dg_last = dg_last + dd.sum(-1)
    dG = dG - dd
    # O = scale (diag(gamma) Q S + M Delta)
    dOs = scale * dO
    dq = gamma[:, :, None] * (dOs @ S.transpose(-1, -2))
    dS = dS + qc.transpose(-1, -2) @ (gamma[:, :, None] * dOs)
    dG = dG + (QS * dOs).sum(-1) * gamma
    dM = (dOs @ Delta.transpose(-1, -2)).masked_fill(~incl, 0.0)
    dDelta = dDelta + M.transpose(-1, -2) @ dOs
    dQK = dM * Gamma
    dq = dq + dQK @ kc
    dk = dk + dQK.transpose(-1, -2) @ qc
    dGamma = dM * QK
    # Delta = U - W S
    dU, dW = dDelta, -dDelta @ S.transpose(-1, -2)
    dS = dS - W.transpose(-1, -2) @ dDelta
    # U = T Bv, W = T Bk
    dT = dU @ Bv.transpose(-1, -2) + dW @ Bk.transpose(-1, -2)
    dBv = T.transpose(-1, -2) @ dU
    dBk = T.transpose(-1, -2) @ dW
    dv = bc[:, :, None] * dBv
    dbeta = (dBv * vc).sum(-1)
    dk = dk + (bc * gamma)[:, :, None] * dBk
    t = (dBk * kc).sum(-1)
    dbeta = dbeta + t * gamma
    dG = dG + t * bc * gamma
    # T = (I + A)^-1 over A's strictly lower entries
    dA = (-T.transpose(-1, -2) @ dT @ T.transpose(-1, -2)).masked_fill(~strict, 0.0)
    # A = strict_tril(diag(beta) (Gamma * P))
    dbeta = dbeta + (dA * Gamma * P).sum(-1)
    dGamma = dGamma + bc[:, :, None] * dA * P
    dP = bc[:, :, None] * dA * Gamma
    dk = dk + (dP + dP.transpose(-1, -2)) @ kc
    # Gamma_ij = exp(G_i - G_j) (the diagonal's two terms cancel)
    E = dGamma * Gamma
    dG = dG + E.sum(-1) - E.sum(-2)
    dG[:, -1] = dG[:, -1] + dg_last
    dg = torch.flip(torch.cumsum(torch.flip(dG, [-1]), -1), [-1])
    return dq, dk, dv, dg, dbeta, dS


def gdn_chunked_backward_reference(q, k, v, g, beta, cu_seqlens, do, *, dfinal=None,
                                   scale=None, initial_state=None,
                                   use_qk_l2norm_in_kernel: bool = False, checkpoints=None,
                                   checkpoint_every_n_tokens=None,
                                   compute_dtype: torch.dtype = torch.float64) -> dict:
    """Gradients of the forward's o (and final state) w.r.t. q, k, v, g, beta and the
    initial state, by chunks (module docstring). ``do`` [T, HO, V]; ``dfinal``
    [N, HO, V, K] or None; ``checkpoints`` [R, HO, V, K] as the forward wrote them every
    ``checkpoint_every_n_tokens`` tokens (then reused: the states between them are
    regenerated), or None (states recomputed from the initial state).

    Returns a dict dq [T, HQ, K], dk [T, HK, K], dv [T, HV, V], dg, dbeta [T, HO],
    dinitial_state [N, HO, V, K] (V-major, as the states), all in ``compute_dtype``."""
    T, HQ, K = q.shape
    HK, HV, V = k.shape[1], v.shape[1], v.shape[2]
    HO = max(HQ, HV)
    C = CHUNK_SIZE
    offs = sequence_offsets(cu_seqlens, "cu_seqlens", (torch.int32, torch.int64))
    N = len(offs) - 1
    scale = K ** -0.5 if scale is None else scale
    cd = dict(dtype=compute_dtype, device=q.device)
    qe, ke, ve = (_expand_heads(x, HO).to(compute_dtype) for x in (q, k, v))
    qn, kn = (l2norm_rows(qe), l2norm_rows(ke)) if use_qk_l2norm_in_kernel else (qe, ke)
    g, beta, do = g.to(compute_dtype), beta.to(compute_dtype), do.to(compute_dtype)
    step = None
    if checkpoints is not None:
        assert checkpoint_every_n_tokens is not None and checkpoint_every_n_tokens % C == 0
        step = checkpoint_every_n_tokens // C
        checkpoints = checkpoints.to(compute_dtype)
    dqn, dkn, dve = (torch.zeros(T, HO, x, **cd) for x in (K, K, V))
    dg, dbeta = torch.zeros(T, HO, **cd), torch.zeros(T, HO, **cd)
    ds0 = torch.zeros(N, HO, V, K, **cd)
    ckpt_row = 0
    for b in range(N):
        lo, hi = offs[b], offs[b + 1]
        L = hi - lo
        S = (torch.zeros(HO, K, V, **cd) if initial_state is None
             else initial_state[b].to(compute_dtype).transpose(-1, -2))
        dS = (torch.zeros(HO, K, V, **cd) if dfinal is None
              else dfinal[b].to(compute_dtype).transpose(-1, -2))
        if L == 0:
            ds0[b] = dS.transpose(-1, -2)
            continue
        qc, kc, vc, bc, dOc = (to_chunks(x[lo:hi], C) for x in (qn, kn, ve, beta, do))
        n = qc.shape[1]
        # states entering each chunk: checkpoints where present, regenerated in between
        G, Gamma, Tm, U, W, Kd, gamma_end, _, _, _ = _chunk_factors(
            kn[lo:hi], ve[lo:hi], g[lo:hi], beta[lo:hi], C)
        states = []
        for c in range(n):
            if step is not None and c % step == 0:
                S = checkpoints[ckpt_row + c // step].transpose(-1, -2)
            states.append(S)
            S = gamma_end[:, c, None, None] * S + Kd[:, c].transpose(-1, -2) @ (
                U[:, c] - W[:, c] @ S)
        if step is not None:
            ckpt_row += -(-n // step)
        grads = [torch.zeros(HO, n, C, x, **cd) for x in (K, K, V)] + [
            torch.zeros(HO, n, C, **cd) for _ in range(2)]
        for c in reversed(range(n)):
            *chunk_grads, dS = _chunk_backward(
                qc[:, c], kc[:, c], vc[:, c], bc[:, c], G[:, c], Gamma[:, c], Tm[:, c],
                W[:, c], U[:, c], states[c], dOc[:, c], dS, scale)
            for acc, grad in zip(grads, chunk_grads):
                acc[:, c] = grad
        ds0[b] = dS.transpose(-1, -2)
        for dst, grad in zip((dqn, dkn, dve, dg, dbeta), grads):
            dst[lo:hi] = _unchunk(grad, L)
    if use_qk_l2norm_in_kernel:
        dqe, dke = _l2norm_backward(qe, dqn), _l2norm_backward(ke, dkn)
    else:
        dqe, dke = dqn, dkn

    def grouped(dx, heads):  # output head h reads input head h // (HO // heads)
        return dx.reshape(T, heads, HO // heads, dx.shape[-1]).sum(2)
    return {"dq": grouped(dqe, HQ), "dk": grouped(dke, HK), "dv": grouped(dve, HV),
            "dg": dg, "dbeta": dbeta, "dinitial_state": ds0}
