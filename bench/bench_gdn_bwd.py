"""Gated DeltaNet backward at the issue's shapes (bf16, K = V = 128, q and k L2-normalized in
the kernel; g float32, beta bfloat16; the loss on o only, so no final-state gradient):
- B = 4 sequences of 8192 tokens, 64 heads (the target: backward <= 3x our forward);
- one sequence of 32768 tokens, 16 q/k heads and 32 v heads (the target: <= 2.3 ms);
- 64 sequences of 512 tokens, 64 heads;
- 1024 sequences of 64 tokens, 64 heads; 128 of 300 tokens with 16 q / k and 32 v heads
  (each sequence's last chunk partial: its dq and dk rows are added by atomics).

    python bench/bench_gdn_bwd.py [--case NAME ...] [--no-peer] [--stages]
                                  [--checkpoints N] [--no-keep]

Times with triton.testing.do_bench (median), per case: the forward (``gated_delta_net``),
the backward (``gated_delta_net_backward``, which recomputes the forward's chunk factors and
states: what autograd does with keep_workspace=False), their ratio, and forward + backward
tokens per second; with ``--checkpoints N`` (default 1024, 0: off) also the training pair
that keeps fp32 checkpoints every N tokens (the forward writes them, the backward's states
pass starts from them, one CTA per checkpoint row and head); the training pair that keeps
the forward's workspace (what autograd does by default, keep_workspace=None; timed here
outside autograd with keep_workspace=True: the forward returns its workspace, the backward
skips its prepare kernel; ``--no-keep`` skips it); ``--stages`` also times each of the
backward's kernels alone (GdnBwdSm90.execute with a caller-owned workspace, kernels
launched one by one from the op's loaded modes). flash-linear-attention's backward is
attempted for reference (its Triton kernels may refuse this Triton version on Hopper; the
error is printed).
"""
from __future__ import annotations

import argparse
import sys

import torch

from bench_gdn import DIM
from bench_gdn import make_inputs as forward_inputs
from common import do_bench, environment, kernel_times, write_json

from precast import GdnBwdSm90, gated_delta_net, gated_delta_net_backward

CASES = {  # name: (sequences, tokens each, q/k heads, v heads)
    "4x8192": (4, 8192, 64, 64),
    "1x32768-hv32": (1, 32768, 16, 32),
    "64x512": (64, 512, 64, 64),
    # many short sequences: the per-sequence table's case (bench_gdn.py has it too)
    "1024x64": (1024, 64, 64, 64),
    "128x300-hv32": (128, 300, 16, 32),  # 300 = 4 x 64 + 44: a partial chunk each
}


def make_inputs(batch: int, seqlen: int, qk_heads: int, v_heads: int, seed: int = 0):
    """bench_gdn's inputs and an output gradient do [T, HV, V]."""
    q, k, v, g, beta, cu = forward_inputs(batch, seqlen, qk_heads, v_heads, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    do = torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
    return q, k, v, g, beta, cu, do


def stage_times(q, k, v, g, beta, cu, do, checkpoints=None, n=None) -> dict:
    """Each backward kernel alone, in the op's order, on a caller-owned workspace."""
    op = GdnBwdSm90(q, k, v, g, beta, cu, do, use_qk_l2norm_in_kernel=True,
                    sample_checkpoints=checkpoints,
                    checkpoint_every_n_tokens=n).check_support()
    ws = op.make_workspace(q.shape[0], cu.shape[0] - 1, device="cuda")
    grads = [torch.empty_like(t) for t in (q, k, v, g, beta)]
    return kernel_times(op, q.device.index, lambda: op.execute(
        q, k, v, g, beta, cu, do, *grads, workspace=ws, checkpoints=checkpoints,
        checkpoint_every_n_tokens=n))


def peer_backward(q, k, v, g, beta, cu, do):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError as exc:
        return None, f"not importable ({exc})"
    group = v.shape[1] // q.shape[1]
    qe, ke = (x.repeat_interleave(group, dim=1) if group > 1 else x for x in (q, k))
    leaves = [t[None].detach().clone().requires_grad_() for t in (qe, ke, v, g, beta)]
    try:
        o, _ = chunk_gated_delta_rule(*leaves, cu_seqlens=cu.long(),
                                      use_qk_l2norm_in_kernel=True)

        def backward():
            o.backward(do[None], retain_graph=True)
        backward()
        return do_bench(backward) * 1e3, None
    except Exception as exc:  # noqa: BLE001 (reported, not hidden)
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"


def pair(inputs, forward_options: dict, backward_options_of) -> tuple:
    """(forward, backward, the forward's result): callables of gated_delta_net with
    ``forward_options`` and of gated_delta_net_backward with ``backward_options_of(result)``
    (what the backward takes from that forward), each run once (loading its op)."""
    q, k, v, g, beta, cu, do = inputs
    fwd = lambda: gated_delta_net(q, k, v, g, beta, cu, use_qk_l2norm_in_kernel=True,  # noqa
                                  output_final_state=True, **forward_options)
    result = fwd()
    options = backward_options_of(result)
    bwd = lambda: gated_delta_net_backward(q, k, v, g, beta, cu, do,  # noqa: E731
                                           use_qk_l2norm_in_kernel=True, **options)
    bwd()
    torch.cuda.synchronize()
    return fwd, bwd, result


def timed_pair(inputs, forward_options: dict, backward_options_of) -> tuple:
    """(forward us, backward us, the forward's result) of ``pair``'s two calls."""
    fwd, bwd, result = pair(inputs, forward_options, backward_options_of)
    return do_bench(fwd) * 1e3, do_bench(bwd) * 1e3, result


def run_case(name: str, peer: bool, stages: bool, every: int, keep: bool) -> dict:
    batch, seqlen, qk_heads, v_heads = CASES[name]
    inputs = make_inputs(batch, seqlen, qk_heads, v_heads)
    q, k, v, g, beta, cu, do = inputs
    tokens = batch * seqlen

    def per_s(f_us, b_us):  # forward + backward tokens per second
        return tokens / ((f_us + b_us) * 1e-6)
    fwd_us, bwd_us, _ = timed_pair(inputs, {}, lambda r: {})
    row = {"case": name, "batch": batch, "seqlen": seqlen, "qk_heads": qk_heads,
           "v_heads": v_heads, "dim": DIM, "fwd_us": fwd_us, "bwd_us": bwd_us,
           "bwd_over_fwd": bwd_us / fwd_us, "train_tokens_per_s": per_s(fwd_us, bwd_us)}
    print(f"{name:>13}: forward {fwd_us:8.1f} us  backward (recomputing) {bwd_us:8.1f} us "
          f"({row['bwd_over_fwd']:.2f}x the forward)  forward+backward "
          f"{row['train_tokens_per_s'] / 1e6:6.2f} M tokens/s", flush=True)
    if stages:
        row["stages_us"] = stage_times(q, k, v, g, beta, cu, do)
        print(f"{'':>13}  " + "  ".join(f"{m} {t:.1f}" for m, t in row["stages_us"].items()),
              flush=True)
    if every:
        f_us, b_us, r = timed_pair(
            inputs, dict(checkpoint_every_n_tokens=every, checkpoint_dtype=torch.float32),
            lambda r: dict(checkpoints=r.checkpoints, checkpoint_every_n_tokens=every))
        row.update(checkpoint_every=every, fwd_ckpt_us=f_us, bwd_ckpt_us=b_us,
                   train_ckpt_tokens_per_s=per_s(f_us, b_us))
        print(f"{'':>13}  fp32 checkpoints every {every}: forward {f_us:8.1f} us  backward "
              f"{b_us:8.1f} us ({b_us / fwd_us:.2f}x the plain forward)  forward+backward "
              f"{row['train_ckpt_tokens_per_s'] / 1e6:6.2f} M tokens/s", flush=True)
        if stages:
            row["stages_ckpt_us"] = stage_times(q, k, v, g, beta, cu, do, r.checkpoints, every)
            print(f"{'':>13}  " + "  ".join(
                f"{m} {t:.1f}" for m, t in row["stages_ckpt_us"].items()), flush=True)
        del r
    if keep:
        f_us, b_us, r = timed_pair(inputs, dict(keep_workspace=True),
                                   lambda r: dict(forward_workspace=r.workspace))
        kept_bytes = sum(t.numel() * t.element_size() for t in r.workspace)
        row.update(fwd_keep_us=f_us, bwd_keep_us=b_us, kept_bytes=kept_bytes,
                   train_keep_tokens_per_s=per_s(f_us, b_us))
        print(f"{'':>13}  workspace kept (the autograd default, {kept_bytes / 1e9:.2f} GB): "
              f"forward {f_us:8.1f} us  "
              f"backward {b_us:8.1f} us ({b_us / f_us:.2f}x its forward, {b_us / fwd_us:.2f}x "
              f"the plain forward)  forward+backward "
              f"{row['train_keep_tokens_per_s'] / 1e6:6.2f} M tokens/s", flush=True)
        del r
        # ... and the chunk states too (io checkpoints every 64 tokens: the backward then
        # runs only its two gradient kernels)
        f_us, b_us, r = timed_pair(
            inputs, dict(keep_workspace=True, checkpoint_every_n_tokens=64),
            lambda r: dict(forward_workspace=r.workspace, checkpoints=r.checkpoints,
                           checkpoint_every_n_tokens=64))
        kept_bytes += r.checkpoints.numel() * r.checkpoints.element_size()
        row.update(fwd_keep_states_us=f_us, bwd_keep_states_us=b_us,
                   train_keep_states_tokens_per_s=per_s(f_us, b_us))
        print(f"{'':>13}  workspace and chunk states kept ({kept_bytes / 1e9:.2f} GB): forward "
              f"{f_us:8.1f} us  backward {b_us:8.1f} us  forward+backward "
              f"{row['train_keep_states_tokens_per_s'] / 1e6:6.2f} M tokens/s", flush=True)
        del r
    if peer:
        peer_us, error = peer_backward(q, k, v, g, beta, cu, do)
        row.update(peer_bwd_us=peer_us, peer_error=error)
        print(f"{'':>13}  fla chunk_gated_delta_rule backward: "
              + (f"{peer_us:8.1f} us" if peer_us else error), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--case", action="append", choices=sorted(CASES))
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--checkpoints", type=int, default=1024, metavar="N",
                    help="also time the pair with fp32 checkpoints every N tokens (0: off)")
    ap.add_argument("--no-keep", action="store_true",
                    help="skip the pair that keeps the forward's workspace (autograd's "
                    "default)")
    args = ap.parse_args(argv)
    env = environment()
    print(f"{env['gpu']} {env['date']}: Gated DeltaNet backward, K = V = {DIM}, bf16, l2norm, "
          "loss on o", flush=True)
    rows = [run_case(name, not args.no_peer, args.stages, args.checkpoints, not args.no_keep)
            for name in (args.case or list(CASES))]
    write_json("bench_gdn_bwd.json", {"env": env, "results": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
