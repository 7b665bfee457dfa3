"""Gated DeltaNet forward at the issue's shapes (bf16, K = V = 128, q and k L2-normalized in
the kernel, the final state written; g float32, beta bfloat16, as flash-linear-attention
takes them):
- B = 4 sequences of 8192 tokens, 64 heads (the target: <= 1.1 ms, >= 3.5x fla);
- one sequence of 32768 tokens, 16 q/k heads and 64 v heads;
- 64 sequences of 512 tokens, 64 heads.

    python bench/bench_gdn.py [--case NAME ...] [--no-peer] [--stages]

Times ``gated_delta_net`` (the allocating function: the compiled op is made on the first call,
outputs are allocated each call) with triton.testing.do_bench (median) and prints per case:
- us (and "burst": 10 back-to-back calls from rest, burst_ms; under do_bench's sustained
  load the H200 runs at its 700 W limit);
- TFLOP/s of the chunked algorithm's matmuls (reference.gated_delta_net.forward_flops);
- GB/s of the bytes a forward must move (q, k, v, g, beta read; o and the final state
  written) as a fraction of the copy bandwidth measured in the same run, and what the
  two-kernel path moves besides (its workspace written and read once);
and flash-linear-attention's chunk_gated_delta_rule on the same inputs where it imports
(q and k expanded to the v heads when grouped), with the RMS error ratio of the outputs.
``--stages`` also times each kernel of the op alone (prepare, recurrence or its split form).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from common import (burst_ms, copy_bandwidth, do_bench, environment, gdn_inputs,
                    kernel_times, write_json)

from precast import GdnFwdSm90, gated_delta_net
from precast.reference.gated_delta_net import forward_flops, rms_error_ratio


CASES = {  # name: (sequences, tokens each, q/k heads, v heads)
    "4x8192": (4, 8192, 64, 64),
    "1x32768-gva": (1, 32768, 16, 64),
    "64x512": (64, 512, 64, 64),
    # many short sequences (serving prefill): the per-sequence table's case
    "1024x64": (1024, 64, 64, 64),
}
DIM = 128


def make_inputs(batch: int, seqlen: int, qk_heads: int, v_heads: int, seed: int = 0):
    return gdn_inputs([seqlen] * batch, qk_heads, v_heads, DIM, seed)


def io_bytes(q, k, v, g, beta, batch: int) -> int:
    """Fewest bytes a forward moves: inputs read once, o and the fp32 final state written."""
    tokens, heads, dim = v.shape
    o = tokens * heads * dim * v.element_size()
    final = batch * heads * dim * q.shape[2] * 4
    return sum(t.numel() * t.element_size() for t in (q, k, v, g, beta)) + o + final


def workspace_bytes(q, k, v, g, beta, cu) -> int:
    """What the two-kernel path moves besides its inputs and outputs: the workspace (T and M
    packed, and the factor rows), written by the first kernel and read by the second, and v read a
    second time by the second."""
    op = GdnFwdSm90(q, k, v, g, beta, cu)  # descriptors only: nothing compiled
    s16, s32 = op.workspace_shapes(q.shape[0], cu.shape[0] - 1)
    return (2 * (math.prod(s16) * q.element_size() + math.prod(s32) * 4)
            + v.numel() * v.element_size())


def peer_gdn():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def stage_times(q, k, v, g, beta, cu) -> dict:
    """Each forward kernel alone, in the op's order."""
    op = GdnFwdSm90(q, k, v, g, beta, cu, use_qk_l2norm_in_kernel=True,
                    output_final_state=True).check_support()
    o = torch.empty_like(v)
    final = torch.empty(cu.shape[0] - 1, v.shape[1], v.shape[2], q.shape[2],
                        dtype=torch.float32, device=q.device)
    return kernel_times(op, q.device.index,
                        lambda: op.execute(q, k, v, g, beta, cu, o, final_state=final))


def run_case(name: str, peer, copy_bw: float, stages: bool = False) -> dict:
    batch, seqlen, qk_heads, v_heads = CASES[name]
    q, k, v, g, beta, cu = make_inputs(batch, seqlen, qk_heads, v_heads)
    run = lambda: gated_delta_net(q, k, v, g, beta, cu, output_final_state=True,  # noqa: E731
                                  use_qk_l2norm_in_kernel=True)
    o, _ = run()  # compiles (or loads) the op
    torch.cuda.synchronize()
    ms = do_bench(run)
    burst = burst_ms(run)
    flops = forward_flops([seqlen] * batch, v_heads, DIM, DIM)
    moved = io_bytes(q, k, v, g, beta, batch)
    work = workspace_bytes(q, k, v, g, beta, cu)
    io_gbs = moved / (ms * 1e-3) / 1e9
    row = {"case": name, "batch": batch, "seqlen": seqlen, "qk_heads": qk_heads,
           "v_heads": v_heads, "dim": DIM, "us": ms * 1e3, "tflops": flops / (ms * 1e-3) / 1e12,
           "io_gbs": io_gbs, "io_of_copy": io_gbs * 1e9 / copy_bw,
           "with_workspace_gbs": (moved + work) / (ms * 1e-3) / 1e9,
           "io_bytes": moved, "workspace_bytes": work, "flops": flops, "burst_us": burst * 1e3}
    print(f"{name:>12}: precast {row['us']:8.1f} us  {row['tflops']:6.1f} TFLOP/s  "
          f"{io_gbs:5.0f} GB/s of inputs and outputs ({moved / 1e9:.2f} GB, "
          f"{row['io_of_copy']:.2f}x copy), {row['with_workspace_gbs']:5.0f} GB/s with the "
          f"workspace ({work / 1e9:.2f} GB); burst {burst * 1e3:.1f} us", flush=True)
    if stages:
        row["stages_us"] = stage_times(q, k, v, g, beta, cu)
        print(f"{'':>12}  " + "  ".join(f"{m} {t:.1f}" for m, t in row["stages_us"].items()),
              flush=True)
    if peer is not None:
        # fla takes [B, T, H, D] (B = 1 with cu_seqlens, int64) and returns its final state
        # K-major: compare o only. Grouped q/k heads are expanded for it.
        group = v_heads // qk_heads
        qe, ke = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (q, k))
        peer_fn = lambda: peer(qe[None], ke[None], v[None], g[None], beta[None],  # noqa: E731
                               output_final_state=True, cu_seqlens=cu.long(),
                               use_qk_l2norm_in_kernel=True)
        peer_o, _ = peer_fn()  # also autotunes
        peer_ms = do_bench(peer_fn)
        row.update(peer_us=peer_ms * 1e3, speedup=peer_ms / ms,
                   rms_vs_peer=rms_error_ratio(o, peer_o[0]))
        print(f"{'':>12}  fla chunk_gated_delta_rule {peer_ms * 1e3:8.1f} us: precast "
              f"{peer_ms / ms:.2f}x faster; RMS ratio of o vs fla {row['rms_vs_peer']:.2e}",
              flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="a case to run (repeatable; default: all)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--stages", action="store_true", help="also time each kernel alone")
    args = ap.parse_args(argv)
    env = environment()
    bw = copy_bandwidth()
    print(f"{env['gpu']} {env['date']}: Gated DeltaNet forward, K = V = {DIM}, bf16, l2norm, "
          f"final state; copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    peer = None if args.no_peer else peer_gdn()
    if peer is None:
        print("flash-linear-attention: not importable (or --no-peer), skipped")
    rows = [run_case(name, peer, bw, args.stages) for name in (args.case or list(CASES))]
    write_json("bench_gdn.json", {"env": env, "copy_bandwidth": bw, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
