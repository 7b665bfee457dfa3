"""HSTU attention forward: TFLOP/s (4 * H * D * visible pairs), as a ratio to the torch bf16
matmul rate measured in the same run, and to generative-recommenders' Triton HSTU attention
where it is importable (put its package on PYTHONPATH; it is not on PyPI).

The matmul rate drifts 3-10 % within a run as the device warms (session 29), so each case's
ratio is to the mean of the rates measured just before and just after it.

    python bench/bench_hstu_attention.py [--quick] [--no-peer]

Timed through the lifecycle class (compiled once, caller-owned workspace), so the numbers
are the kernel plus execute()'s host-side checks.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from common import do_bench, environment, matmul_rate, write_json
from precast import HSTUFwdSm90
from precast.reference.hstu_attention import attention_flops
from precast.reference.offsets import offsets_from_lengths

HEADS = 4
TOKENS = 65536  # per batch, as in the issue




def heavy_tailed_lengths(total: int, longest: int, seed: int = 0):
    """Log-normal sequence lengths (a few long, many short) clipped to [1, longest] until
    about ``total`` tokens: what recommendation histories look like."""
    g = torch.Generator().manual_seed(seed)
    out, used = [], 0
    while used < total:
        n = int(min(longest, max(1, math.exp(6.0 + 1.2 * torch.randn(1, generator=g).item()))))
        out.append(n)
        used += n
    return out


def cases(quick: bool):
    """(name, lens_q, lens_k, head_dim, window)."""
    out = []
    for seqlen in ((4096,) if quick else (1024, 4096, 8192, 16384)):
        n = TOKENS // seqlen
        out.append((f"causal L={seqlen}", [seqlen] * n, [seqlen] * n, 128, (-1, 0)))
    l4k = [4096] * (TOKENS // 4096)
    if not quick:
        out += [("causal L=4096 D=64", l4k, l4k, 64, (-1, 0)),
                ("causal L=4096 D=256", l4k, l4k, 256, (-1, 0)),
                ("full L=4096", l4k, l4k, 128, (-1, -1)),
                ("local 256 L=4096", l4k, l4k, 128, (256, 0))]
    jagged = heavy_tailed_lengths(TOKENS, 8192)
    out.append((f"jagged causal ({len(jagged)} seqs, max {max(jagged)})", jagged, jagged, 128,
                (-1, 0)))
    g = torch.Generator().manual_seed(1)
    new = torch.randint(1, 9, (1024,), generator=g).tolist()
    out.append(("incremental 1-8 q vs 4096 k", new, [4096] * len(new), 128, (-1, 0)))
    return out


def make_inputs(lens_q, lens_k, head_dim, dtype=torch.bfloat16):
    cu_q, cu_k = offsets_from_lengths(lens_q), offsets_from_lengths(lens_k)
    q = torch.randn(sum(lens_q), HEADS, head_dim, device="cuda", dtype=dtype)
    k = torch.randn(sum(lens_k), HEADS, head_dim, device="cuda", dtype=dtype)
    v = torch.randn_like(k)
    return q, k, v, cu_q, cu_k


def peer_attention():
    try:
        from generative_recommenders.ops.triton.triton_hstu_attention import triton_hstu_mha
    except ImportError:
        return None
    return triton_hstu_mha


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="one causal size, jagged, incremental")
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    peer = None if args.no_peer else peer_attention()
    mm_before = matmul_rate() / 1e12
    print(f"{env['gpu']} {env['date']}: HSTU attention forward, bf16, H={HEADS}; "
          f"torch bf16 matmul {mm_before:.0f} TFLOP/s")
    print(f"{'case':42s} {'D':>4} {'us':>9} {'TFLOP/s':>8} {'x matmul':>8} {'peer us':>9} "
          f"{'speedup':>7}   (x matmul: the mean rate just before and after the case)")
    results = []
    for name, lens_q, lens_k, d, window in cases(args.quick):
        q, k, v, cu_q, cu_k = make_inputs(lens_q, lens_k, d)
        cu_q_dev, cu_k_dev = cu_q.cuda(), cu_k.cuda()
        max_q, max_k = max(lens_q), max(lens_k)
        o = torch.empty_like(q)
        op = HSTUFwdSm90(q, k, v, o, cu_q_dev, cu_k_dev, max_q, max_k, window,
                         alpha=1 / math.sqrt(d)).check_support().compile()
        ws = torch.zeros(op.workspace_shape(), dtype=torch.int32, device="cuda")
        run = lambda: op.execute(q, k, v, o, cu_q_dev, cu_k_dev, workspace=ws)  # noqa: E731
        mm_case = [matmul_rate() / 1e12]
        ms = do_bench(run)
        mm_case.append(matmul_rate() / 1e12)
        mm = sum(mm_case) / 2
        flops = attention_flops(cu_q, cu_k, HEADS, d, window)
        rate = flops / (ms * 1e-3) / 1e12
        kv_gbs = 2 * k.numel() * k.element_size() / (ms * 1e-3) / 1e9  # K and V read once
        row = {"case": name, "head_dim": d, "window": window, "us": ms * 1e3,
               "tflops": rate, "x_matmul": rate / mm, "matmul_tflops": mm_case,
               "kv_read_gbs": kv_gbs, "visible_pairs": flops // (4 * HEADS * d)}
        peer_txt = ""
        # The peer autotunes every new shape (about a minute each): two representative cases.
        if peer is not None and (name == "causal L=4096" or name.startswith("jagged")):
            offsets = cu_q_dev.to(torch.int64)
            peer_fn = lambda: peer(max_q, 1 / math.sqrt(d), q, k, v, offsets)  # noqa: E731
            ref = peer_fn()  # also autotunes
            diff = ((ref.float() - o.float()).abs().max() / o.float().abs().max()).item()
            peer_ms = do_bench(peer_fn)
            row.update(peer_us=peer_ms * 1e3, speedup=peer_ms / ms, peer_rel_diff=diff)
            peer_txt = f"{peer_ms * 1e3:9.1f} {peer_ms / ms:6.2f}x"
        results.append(row)
        print(f"{name:42s} {d:4d} {ms * 1e3:9.1f} {rate:8.1f} {rate / mm:8.2f} {peer_txt}"
              + (f"  (K/V read at {kv_gbs:.0f} GB/s)" if lens_q != lens_k else ""), flush=True)
        del q, k, v, o
        torch.cuda.empty_cache()
    mm_after = matmul_rate() / 1e12
    print(f"torch bf16 matmul after the run: {mm_after:.0f} TFLOP/s")
    write_json("bench_hstu_attention.json", {"env": env, "matmul_tflops": [mm_before, mm_after],
                                             "heads": HEADS, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
