"""precast LMSD vs the Triton LayerNorm-Mul-Dropout of meta-recsys/generative-recommenders.

The peer is not on PyPI: put its package on PYTHONPATH (e.g. a fetched checkout copied to an
ignored folder, never committed). Same shapes and flags: SiLU(u) multiplies LN(x), both
extra segments, dropout 0.1. The peer's forward writes no mask (its backward regenerates
the RNG), so its forward moves 1 byte per element less; times are compared directly.
"""
from __future__ import annotations

import sys

import torch

from common import do_bench, environment, lmsd_inputs, write_json
from precast import hstu_lmsd_backward, hstu_lmsd_forward


def main(rows=1 << 20, dims=(256, 512, 1024), p=0.1):
    from generative_recommenders.ops.triton.triton_hstu_linear import (
        triton_layer_norm_mul_dropout_bwd, triton_layer_norm_mul_dropout_fwd)
    env = environment()
    print(f"{env['gpu']} {env['date']}: precast vs generative-recommenders Triton LMSD")
    print(f"{'D':>5} | {'ours fwd':>8} {'peer fwd':>8} {'speedup':>7} | {'ours bwd':>8} {'peer bwd':>8} {'speedup':>7}")
    results = []
    for d in dims:
        x, u, w, b = lmsd_inputs(rows, d)
        kw = dict(silu_u=True, concat_u=True, concat_x=True, mul_u_activation_type="silu")
        peer = triton_layer_norm_mul_dropout_fwd(x, u, w, b, 1e-5, p, True, seed=1, **kw)
        peer_fwd = do_bench(lambda: triton_layer_norm_mul_dropout_fwd(x, u, w, b, 1e-5, p, True,
                                                                      seed=1, **kw))
        y_p, mean_p, rstd_p, block_d, warps, seed, rmask = peer
        dy = torch.randn_like(y_p)
        peer_bwd = do_bench(lambda: triton_layer_norm_mul_dropout_bwd(
            dy, x, u, w, b, mean_p, rstd_p, block_d, warps, 1e-5, True, p, seed=seed,
            random_mask=rmask, **kw))
        out = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 1, True, True, True)
        ours_fwd = do_bench(lambda: hstu_lmsd_forward(x, u, w, b, 1e-5, p, 1, True, True, True,
                                                      y_tensor=out[0], mean_tensor=out[1],
                                                      rstd_tensor=out[2], mask_tensor=out[3]))
        g = hstu_lmsd_backward(dy, x, u, w, b, out[1], out[2], out[3], p, True, True, True)
        ours_bwd = do_bench(lambda: hstu_lmsd_backward(
            dy, x, u, w, b, out[1], out[2], out[3], p, True, True, True, dx_tensor=g[0],
            du_tensor=g[1], dweight_tensor=g[2], dbias_tensor=g[3]))
        results.append({"dim": d, "ours_fwd_ms": ours_fwd, "peer_fwd_ms": peer_fwd,
                        "ours_bwd_ms": ours_bwd, "peer_bwd_ms": peer_bwd})
        print(f"{d:>5} | {ours_fwd:8.3f} {peer_fwd:8.3f} {peer_fwd / ours_fwd:6.2f}x | "
              f"{ours_bwd:8.3f} {peer_bwd:8.3f} {peer_bwd / ours_bwd:6.2f}x")
        torch.cuda.empty_cache()
    write_json("bench_lmsd_peer.json", {"env": env, "rows": rows, "p": p, "results": results})


if __name__ == "__main__":
    sys.exit(main())
