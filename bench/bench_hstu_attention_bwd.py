"""HSTU attention backward: TFLOP/s counted as 2.5 x the forward's FLOPs (4 * H * D * visible
pairs), as a ratio to the torch bf16 matmul rate measured in the same run, and to
generative-recommenders' Triton HSTU attention backward where it is importable (put its
package on PYTHONPATH; it is not on PyPI).

    python bench/bench_hstu_attention_bwd.py [--quick] [--no-peer]

Timed through the lifecycle class (compiled once), so the numbers are the kernels plus
execute()'s host-side checks: us and TFLOP/s by do_bench (sustained load: the H200 then runs
at its 700 W limit), and "burst" TFLOP/s of 10 back-to-back executes from rest (burst_ms).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from bench_hstu_attention import HEADS, TOKENS, heavy_tailed_lengths, make_inputs, peer_attention
from common import burst_ms, do_bench, environment, matmul_rate, write_json
from precast import HSTUBwdSm90
from precast.reference.hstu_attention import BACKWARD_FLOPS_FACTOR, attention_flops


def cases(quick: bool):
    """(name, lens, head_dim, window, deterministic)."""
    out = []
    for seqlen in ((4096,) if quick else (1024, 4096, 8192, 16384)):
        n = TOKENS // seqlen
        out.append((f"causal L={seqlen}", [seqlen] * n, 128, (-1, 0), False))
    l4k = [4096] * (TOKENS // 4096)
    out.append(("causal L=4096 deterministic", l4k, 128, (-1, 0), True))
    if not quick:
        out += [("causal L=4096 D=64", l4k, 64, (-1, 0), False),
                ("causal L=4096 D=256", l4k, 256, (-1, 0), False),
                ("full L=4096", l4k, 128, (-1, -1), False),
                ("local 256 L=4096", l4k, 128, (256, 0), False)]
    jagged = heavy_tailed_lengths(TOKENS, 8192)
    out.append((f"jagged causal ({len(jagged)} seqs, max {max(jagged)})", jagged, 128, (-1, 0),
                False))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="causal 4k (both modes) and jagged")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    peer = None if args.no_peer else peer_attention()
    mm_before = matmul_rate() / 1e12
    print(f"{env['gpu']} {env['date']}: HSTU attention backward, bf16, H={HEADS}; "
          f"torch bf16 matmul {mm_before:.0f} TFLOP/s")
    print(f"{'case':42s} {'D':>4} {'us':>9} {'TFLOP/s':>8} {'x matmul':>8} {'burst':>7} "
          f"{'peer us':>9} {'speedup':>7}")
    results = []
    for name, lens, d, window, deterministic in cases(args.quick):
        q, k, v, cu_q, cu_k = make_inputs(lens, lens, d)
        do = torch.randn_like(q)
        cu_q_dev, cu_k_dev = cu_q.cuda(), cu_k.cuda()
        longest = max(lens)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        op = HSTUBwdSm90(do, q, k, v, *grads, cu_q_dev, cu_k_dev, longest, longest, window,
                         alpha=1 / math.sqrt(d),
                         deterministic=deterministic).check_support().compile()
        run = lambda: op.execute(do, q, k, v, *grads, cu_q_dev, cu_k_dev)  # noqa: E731
        ms = do_bench(run)
        burst = burst_ms(run)
        flops = BACKWARD_FLOPS_FACTOR * attention_flops(cu_q, cu_k, HEADS, d, window)
        rate = flops / (ms * 1e-3) / 1e12
        burst_rate = flops / (burst * 1e-3) / 1e12
        row = {"case": name, "head_dim": d, "window": window, "deterministic": deterministic,
               "us": ms * 1e3, "tflops": rate, "x_matmul": rate / mm_before,
               "burst_us": burst * 1e3, "burst_tflops": burst_rate}
        peer_txt = ""
        # The peer autotunes every new shape (minutes for its backward): one case.
        if peer is not None and name == "causal L=4096":
            offsets = cu_q_dev.to(torch.int64)
            leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
            o = peer(longest, 1 / math.sqrt(d), *leaves, offsets)
            peer_fn = lambda: torch.autograd.grad(o, leaves, do, retain_graph=True)  # noqa: E731
            peer_grads = peer_fn()  # also autotunes
            diff = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                       for a, b in zip(peer_grads, grads))
            peer_ms = do_bench(peer_fn)
            row.update(peer_us=peer_ms * 1e3, speedup=peer_ms / ms, peer_rel_diff=diff)
            peer_txt = f"{peer_ms * 1e3:9.1f} {peer_ms / ms:6.2f}x  (grads differ by {diff:.1e})"
        results.append(row)
        print(f"{name:42s} {d:4d} {ms * 1e3:9.1f} {rate:8.1f} {rate / mm_before:8.2f} "
              f"{burst_rate:7.1f} {peer_txt}", flush=True)
        del q, k, v, do, grads
        torch.cuda.empty_cache()
    mm_after = matmul_rate() / 1e12
    print(f"torch bf16 matmul after the run: {mm_after:.0f} TFLOP/s")
    write_json("bench_hstu_attention_bwd.json", {"env": env, "matmul_tflops": [mm_before, mm_after],
                                                 "heads": HEADS, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
