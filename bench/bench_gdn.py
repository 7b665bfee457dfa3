"""Gated DeltaNet forward at the issue's shape: B = 4 sequences of 8192 tokens, H = 64 heads,
K = V = 128, bf16, q and k L2-normalized in the kernel, the final state written (g float32,
beta bfloat16, as flash-linear-attention takes them).

    python bench/bench_gdn.py [--batch 4] [--seqlen 8192] [--heads 64] [--no-peer]

Times ``gated_delta_net`` (the allocating function: the compiled op is made on the first call,
outputs are allocated each call) with triton.testing.do_bench (median) and prints:
- us;
- TFLOP/s of the chunked algorithm's matmuls (reference.gated_delta_net.forward_flops,
  ~11.5 MFLOP per 64-token chunk and head at K = V = 128);
- GB/s of the bytes a forward must move (q, k, v, g, beta read; o and the final state
  written), and of what the two-kernel path moves besides (its workspace written and read
  once);
and flash-linear-attention's chunk_gated_delta_rule on the same inputs where it imports
(skipped otherwise), with the RMS error ratio between the two outputs.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from common import do_bench, environment, write_json

from precast import GdnFwdSm90, gated_delta_net
from precast.reference.gated_delta_net import forward_flops, rms_error_ratio
from precast.reference.offsets import offsets_from_lengths


def make_inputs(batch: int, seqlen: int, heads: int, dim: int, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    tokens = batch * seqlen

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)
    q, k, v = (randn(tokens, heads, dim).to(torch.bfloat16) for _ in range(3))
    g = torch.nn.functional.logsigmoid(randn(tokens, heads))  # float32 log decays
    beta = torch.sigmoid(randn(tokens, heads)).to(torch.bfloat16)
    cu = offsets_from_lengths([seqlen] * batch, device="cuda")
    return q, k, v, g, beta, cu


def io_bytes(q, k, v, g, beta, batch: int) -> int:
    """Fewest bytes a forward moves: inputs read once, o and the fp32 final state written."""
    tokens, heads, dim = v.shape
    o = tokens * heads * dim * v.element_size()
    final = batch * heads * dim * q.shape[2] * 4
    return sum(t.numel() * t.element_size() for t in (q, k, v, g, beta)) + o + final


def workspace_bytes(q, k, v, g, beta, cu) -> int:
    """The two-kernel path's workspace, written by the first kernel and read by the second."""
    op = GdnFwdSm90(q, k, v, g, beta, cu)  # descriptors only: nothing compiled
    s16, s32 = op.workspace_shapes(q.shape[0], cu.shape[0] - 1)
    return 2 * (math.prod(s16) * q.element_size() + math.prod(s32) * 4)


def peer_gdn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--no-peer", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    q, k, v, g, beta, cu = make_inputs(args.batch, args.seqlen, args.heads, args.dim)
    run = lambda: gated_delta_net(q, k, v, g, beta, cu, output_final_state=True,  # noqa: E731
                                  use_qk_l2norm_in_kernel=True)
    o, final = run()  # compiles (or loads) the op
    torch.cuda.synchronize()
    ms = do_bench(run)
    flops = forward_flops([args.seqlen] * args.batch, args.heads, args.dim, args.dim)
    moved = io_bytes(q, k, v, g, beta, args.batch)
    work = workspace_bytes(q, k, v, g, beta, cu)
    row = {"batch": args.batch, "seqlen": args.seqlen, "heads": args.heads, "dim": args.dim,
           "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
           "io_gbs": moved / (ms * 1e-3) / 1e9,
           "with_workspace_gbs": (moved + work) / (ms * 1e-3) / 1e9,
           "io_bytes": moved, "workspace_bytes": work, "flops": flops}
    print(f"{env['gpu']} {env['date']}: Gated DeltaNet forward, B={args.batch} x "
          f"{args.seqlen}, H={args.heads}, K=V={args.dim}, bf16, l2norm, final state")
    print(f"precast gated_delta_net: {row['us']:9.1f} us  {row['tflops']:6.1f} TFLOP/s  "
          f"{row['io_gbs']:6.0f} GB/s of inputs and outputs ({moved / 1e9:.2f} GB), "
          f"{row['with_workspace_gbs']:6.0f} GB/s with the workspace ({work / 1e9:.2f} GB)",
          flush=True)
    peer = None if args.no_peer else peer_gdn()
    if peer is None:
        print("flash-linear-attention: not importable (or --no-peer), skipped")
    else:
        # fla takes [B, T, H, D] (B = 1 with cu_seqlens, int64) and returns its final state
        # K-major: compare o only.
        peer_fn = lambda: peer(q[None], k[None], v[None], g[None], beta[None],  # noqa: E731
                               output_final_state=True, cu_seqlens=cu.long(),
                               use_qk_l2norm_in_kernel=True)
        peer_o, _ = peer_fn()  # also autotunes
        peer_ms = do_bench(peer_fn)
        row.update(peer_us=peer_ms * 1e3, speedup=peer_ms / ms,
                   rms_vs_peer=rms_error_ratio(o, peer_o[0]))
        print(f"fla chunk_gated_delta_rule: {peer_ms * 1e3:9.1f} us  "
              f"(precast {peer_ms / ms:.2f}x faster; RMS ratio of o vs fla "
              f"{row['rms_vs_peer']:.2e})", flush=True)
    write_json("bench_gdn.json", {"env": env, "results": [row]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
