"""HSTU LMSD forward/backward bandwidth vs the measured copy ceiling and plain torch.

    python bench/bench_lmsd.py [--rows 1048576] [--dims 256 512 1024]

Effective bytes: forward reads x, u and writes y, mask; backward reads dy, x, u, mask and
writes dx, du (mean/rstd and the parameter vectors are counted too: they are tiny).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from common import (copy_bandwidth, do_bench, environment, lmsd_inputs, lmsd_traffic_bytes,
                    write_json)
from precast import hstu_lmsd_backward, hstu_lmsd_forward


def torch_forward(x, u, w, b, eps, p, keep):
    """Plain torch: the same math with precomputed keep masks (RNG cost not counted)."""
    ln = F.layer_norm(x, (x.shape[1],), w, b, eps)
    a = F.silu(u)
    s = 1.0 / (1.0 - p)
    return torch.cat([a * keep[2] * s, x * keep[1] * s, ln * a * keep[0] * s], dim=1)


def run(rows: int, dim: int, p: float, dtype=torch.bfloat16):
    x, u, w, b = lmsd_inputs(rows, dim, dtype)
    out = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 1, True, True, True)
    y, mean, rstd, mask = out
    fwd_bytes = lmsd_traffic_bytes(rows, dim, "fwd", x.element_size(), dropout=p > 0)
    fwd_ms = do_bench(lambda: hstu_lmsd_forward(x, u, w, b, 1e-5, p, 1, True, True, True,
                                                y_tensor=y, mean_tensor=mean, rstd_tensor=rstd,
                                                mask_tensor=mask))
    dy = torch.randn_like(y)
    grads = hstu_lmsd_backward(dy, x, u, w, b, mean, rstd, mask, p, True, True, True)
    bwd_bytes = lmsd_traffic_bytes(rows, dim, "bwd", x.element_size(), dropout=p > 0)
    bwd_ms = do_bench(lambda: hstu_lmsd_backward(
        dy, x, u, w, b, mean, rstd, mask, p, True, True, True, dx_tensor=grads[0],
        du_tensor=grads[1], dweight_tensor=grads[2], dbias_tensor=grads[3]))

    if mask is None:  # p = 0: no mask, every element kept
        keep = [torch.ones_like(x)] * 3
    else:
        keep = [((mask >> bit) & 1).to(dtype) for bit in range(3)]
    torch_fwd_ms = do_bench(lambda: torch_forward(x, u, w, b, 1e-5, p, keep))
    leaves = [t.clone().requires_grad_(True) for t in (x, u, w, b)]
    ty = torch_forward(*leaves, 1e-5, p, keep)
    torch_bwd_ms = do_bench(lambda: torch.autograd.grad(ty, leaves, dy, retain_graph=True))
    return {"rows": rows, "dim": dim, "p": p, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms,
            "fwd_bytes": fwd_bytes, "bwd_bytes": bwd_bytes, "torch_fwd_ms": torch_fwd_ms,
            "torch_bwd_ms": torch_bwd_ms}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1 << 20)
    parser.add_argument("--dims", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--p", type=float, default=0.1)
    args = parser.parse_args()
    env = environment()
    bw = copy_bandwidth()
    results = []
    print(f"{env['gpu']} {env['date']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'N':>8} {'D':>5} | {'fwd ms':>7} {'TB/s':>5} {'xcopy':>5} {'torch':>6} | "
          f"{'bwd ms':>7} {'TB/s':>5} {'xcopy':>5} {'torch':>6}")
    for dim in args.dims:
        r = run(args.rows, dim, args.p)
        r["fwd_vs_copy"] = r["fwd_bytes"] / (r["fwd_ms"] * 1e-3) / bw
        r["bwd_vs_copy"] = r["bwd_bytes"] / (r["bwd_ms"] * 1e-3) / bw
        results.append(r)
        print(f"{r['rows']:>8} {dim:>5} | {r['fwd_ms']:7.3f} {r['fwd_bytes'] / r['fwd_ms'] / 1e9:5.2f} "
              f"{r['fwd_vs_copy']:5.2f} {r['torch_fwd_ms'] / r['fwd_ms']:5.1f}x | "
              f"{r['bwd_ms']:7.3f} {r['bwd_bytes'] / r['bwd_ms'] / 1e9:5.2f} "
              f"{r['bwd_vs_copy']:5.2f} {r['torch_bwd_ms'] / r['bwd_ms']:5.1f}x")
        torch.cuda.empty_cache()
    write_json("bench_lmsd.json", {"env": env, "copy_bandwidth": bw, "results": results})


if __name__ == "__main__":
    main()
