"""Where can a Gated DeltaNet forward kernel round to 16 bits? A CPU study (no GPU needed).

Runs the chunked WY algorithm (chunk 64, the form in precast/reference/gated_delta_net.py)
with every matmul operand rounded the way a wgmma kernel would feed it, and with a choice of
precision at each design point, and reports the RMS error ratio against the float64
token-by-token reference for o and the final state (the issue's bar: 2e-2 for bf16).

    python bench/gdn_precision_study.py [--tokens 4096] [--heads 2] [--seed 0]

Design points (each a variant below):
- T = (I + A)^-1 handed to the U/W matmuls as bf16, fp16 or fp32 (tf32-like);
- Delta = U - W S formed in fp32 or rounded to bf16 before it feeds two matmuls;
- the state S rounded to bf16 (or kept fp32) as the operand of W S and Q S;
- q and k L2-normalized in fp32 before rounding (use_qk_l2norm_in_kernel), or the norms
  folded into fp32-side factors while the matmuls read the raw bf16 q and k.
Results go into docs/NOTES.md with the date; the script is the record of how.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from precast.reference.gated_delta_net import (CHUNK_SIZE, gdn_recurrent_reference,  # noqa: E402
                                               l2norm_rows, rms_error_ratio)

BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32


def rounded(x: torch.Tensor, dtype) -> torch.Tensor:
    """x as a wgmma operand of ``dtype`` (fp32 means no rounding), computed on in fp32."""
    return x.to(dtype).to(F32) if dtype != F32 else x


def kernel_model(q, k, v, g, beta, scale, *, t_dtype, delta_dtype, state_dtype):
    """One sequence, all heads: [L, H, D] inputs (already the io dtype), fp32 math with the
    chosen roundings. Returns (o [L, H, V] fp32, final state [H, K, V] fp32)."""
    L, H, K = k.shape
    V = v.shape[-1]
    C = CHUNK_SIZE
    S = torch.zeros(H, K, V, dtype=F32)
    outs = []
    for c0 in range(0, L, C):
        c1 = min(c0 + C, L)
        qc, kc, vc = (x[c0:c1].to(F32).transpose(0, 1) for x in (q, k, v))  # [H, n, D]
        gc, bc = g[c0:c1].to(F32).t(), beta[c0:c1].to(F32).t()  # [H, n]
        n = c1 - c0
        G = torch.cumsum(gc, dim=-1)
        incl = torch.ones(n, n, dtype=torch.bool).tril()
        Gamma = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")))
        A = (bc[..., :, None] * Gamma * (kc @ kc.transpose(-1, -2))).masked_fill(
            ~incl.tril(-1), 0.0)
        eye = torch.eye(n, dtype=F32)
        T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False,
                                          unitriangular=True)
        T = rounded(T, t_dtype)
        U = T @ rounded(bc[..., None] * vc, BF)
        W = T @ rounded((bc * torch.exp(G))[..., None] * kc, BF)
        S_op = rounded(S, state_dtype)
        delta = rounded(U - rounded(W, BF) @ S_op, delta_dtype)
        P = rounded(Gamma * (qc @ kc.transpose(-1, -2)), BF)
        Qd = rounded(torch.exp(G)[..., None] * qc, BF)
        outs.append(scale * (Qd @ S_op + P @ delta))
        Kd = rounded(torch.exp(G[..., -1:] - G)[..., None] * kc, BF)
        S = torch.exp(G[..., -1])[..., None, None] * S + Kd.transpose(-1, -2) @ delta
    return torch.cat(outs, dim=1).transpose(0, 1), S


def folded_model(q, k, v, g, beta, scale, *, t_dtype, delta_dtype, state_dtype):
    """kernel_model with the L2 norms folded instead of applied: the matmuls read the raw
    bf16 q and k (exact operands) and 1/|q|, 1/|k| (fp32) go where a kernel can put them
    for free: into the fp32 scores, into T's columns (T diag(beta gamma rk) before T is
    rounded), onto Q S's rows, and into Delta's rows for the state update."""
    L, H, K = k.shape
    V = v.shape[-1]
    C = CHUNK_SIZE
    rq = torch.rsqrt(q.to(F32).pow(2).sum(-1).clamp_min(1e-24)).t()  # [H, L]
    rk = torch.rsqrt(k.to(F32).pow(2).sum(-1).clamp_min(1e-24)).t()
    S = torch.zeros(H, K, V, dtype=F32)
    outs = []
    for c0 in range(0, L, C):
        c1 = min(c0 + C, L)
        qc, kc, vc = (x[c0:c1].to(F32).transpose(0, 1) for x in (q, k, v))  # raw, exact
        gc, bc = g[c0:c1].to(F32).t(), beta[c0:c1].to(F32).t()
        rqc, rkc = rq[:, c0:c1], rk[:, c0:c1]
        n = c1 - c0
        G = torch.cumsum(gc, dim=-1)
        incl = torch.ones(n, n, dtype=torch.bool).tril()
        Gamma = torch.exp((G[..., :, None] - G[..., None, :]).masked_fill(~incl, float("-inf")))
        KK = rkc[..., :, None] * rkc[..., None, :] * (kc @ kc.transpose(-1, -2))
        A = (bc[..., :, None] * Gamma * KK).masked_fill(~incl.tril(-1), 0.0)
        eye = torch.eye(n, dtype=F32)
        T = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False,
                                          unitriangular=True)
        U = rounded(T * bc[..., None, :], t_dtype) @ vc
        W = rounded(T * (bc * torch.exp(G) * rkc)[..., None, :], t_dtype) @ kc
        S_op = rounded(S, state_dtype)
        delta = U - rounded(W, BF) @ S_op  # fp32
        P = rounded(Gamma * rqc[..., :, None] * rkc[..., None, :]
                    * (qc @ kc.transpose(-1, -2)), BF)
        QS = (torch.exp(G) * rqc)[..., None] * (qc @ S_op)
        outs.append(scale * (QS + P @ rounded(delta, delta_dtype)))
        dk = rounded((torch.exp(G[..., -1:] - G) * rkc)[..., None] * delta, delta_dtype)
        S = torch.exp(G[..., -1])[..., None, None] * S + kc.transpose(-1, -2) @ dk
    return torch.cat(outs, dim=1).transpose(0, 1), S


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    gen = torch.Generator().manual_seed(args.seed)
    L, H, D = args.tokens, args.heads, args.dim
    q, k, v = (torch.randn(L, H, D, generator=gen).to(BF) for _ in range(3))
    # Typical gates: log-sigmoid of a pre-activation (decays in (0, 1)), beta = sigmoid.
    g = torch.nn.functional.logsigmoid(torch.randn(L, H, generator=gen) + 3.0)
    beta = torch.sigmoid(torch.randn(L, H, generator=gen))
    scale = 1 / math.sqrt(D)
    cu = torch.tensor([0, L], dtype=torch.int32)
    ref = gdn_recurrent_reference(q, k, v, g, beta, cu, scale=scale,
                                  use_qk_l2norm_in_kernel=True)
    # The kernel normalizes q and k in fp32 and rounds them to bf16 for the matmuls.
    qn = l2norm_rows(q.to(F32)).to(BF)
    kn = l2norm_rows(k.to(F32)).to(BF)
    variants = [
        ("all fp32 operands (math check)", dict(t_dtype=F32, delta_dtype=F32, state_dtype=F32)),
        ("T bf16, Delta fp32, S bf16", dict(t_dtype=BF, delta_dtype=F32, state_dtype=BF)),
        ("T fp16, Delta fp32, S bf16", dict(t_dtype=FP, delta_dtype=F32, state_dtype=BF)),
        ("T fp32, Delta bf16, S bf16", dict(t_dtype=F32, delta_dtype=BF, state_dtype=BF)),
        ("T bf16, Delta bf16, S bf16", dict(t_dtype=BF, delta_dtype=BF, state_dtype=BF)),
        ("T fp16, Delta bf16, S bf16", dict(t_dtype=FP, delta_dtype=BF, state_dtype=BF)),
    ]
    print(f"L={L} H={H} K=V={D}, bf16 inputs, l2norm on; RMS error ratio vs float64 recurrence")
    print(f"{'variant':34s} {'o':>10s} {'final state':>12s}")
    runs = [(name, kernel_model, qn, kn, kw) for name, kw in variants]
    runs += [("folded norms: T bf16, Delta bf16", folded_model, q, k,
              dict(t_dtype=BF, delta_dtype=BF, state_dtype=BF)),
             ("folded norms: T bf16, Delta fp32", folded_model, q, k,
              dict(t_dtype=BF, delta_dtype=F32, state_dtype=BF))]
    for name, model, qq, kk, kw in runs:
        o, S = model(qq, kk, v, g, beta, scale, **kw)
        # The reference stores states V-major ([N, H, V, K]); ours is [H, K, V].
        print(f"{name:34s} {rms_error_ratio(o.to(BF), ref['o']):10.2e} "
              f"{rms_error_ratio(S.transpose(-1, -2), ref['final_state'][0]):12.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
