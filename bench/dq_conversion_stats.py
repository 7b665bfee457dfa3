"""Where the fused attention backward's dQ conversion happens: for causal batches of 64k
tokens, the share of each L2 group's dQ slices that the kernel's idle warps converted (the
rest is dq_finish's), and each kernel of one execute() timed alone.

    python bench/dq_conversion_stats.py [L[:LEFT] ...]   (default 1024 4096 16384; D = 128)

L:LEFT is a local window (LEFT, 0) instead of causal.
"""
from __future__ import annotations

import math
import sys

import torch

from bench_hstu_attention import HEADS, TOKENS, make_inputs
from common import do_bench, kernel_times
from precast import HSTUBwdSm90
from precast.lifecycle.hstu_attention_bwd import Launch

SLICE_ROWS = 16  # precast.kernels.hstu_attention_bwd_sm90.SLICE_ROWS (no DSL on a GPU host)


def converted_shares(op, args, ws):
    """Per L2 group: the share of its slices claimed inside the fused kernel."""
    kernels = op._ready(torch.cuda.current_device())
    if "dq_finish" not in kernels:
        return None  # a build before the kernel converted dQ itself (torch passes)
    real = kernels["dq_finish"]
    seen = {}

    def spy(dq_acc, dq, sync, cu_q, pair_group, max_q, handle):
        torch.cuda.synchronize()
        seen.update(sync=sync.clone(), pair_group=pair_group, max_q=max_q,
                    batch=cu_q.shape[0] - 1)
        return real(dq_acc, dq, sync, cu_q, pair_group, max_q, handle)

    kernels["dq_finish"] = spy
    try:
        op.execute(*args, workspace=ws)
        torch.cuda.synchronize()
    finally:
        kernels["dq_finish"] = real
    if not seen:
        return None  # compact numbering: torch passes
    groups = Launch(0, seen["pair_group"]).groups(op.num_kv_heads, seen["batch"])
    slices = seen["pair_group"] * -(-seen["max_q"] // SLICE_ROWS)
    claims = seen["sync"][groups:2 * groups].clamp(max=slices).float() / slices
    assert torch.count_nonzero(ws) == 0, "workspace not left zero"
    return seen["pair_group"], claims.tolist()


def split_costs(op, args, ws):
    """us of (the fused kernel converting on fresh sync words, dq_finish with nothing left
    to convert, dq_finish on the sync words a converting kernel left): with execute's total and the fused kernel on stale sync
    words (no conversion work), this splits the conversion's cost between the kernel's
    warps and dq_finish's fixed part. Each repeat first resets the words it needs (its
    cost, timed alone, is subtracted)."""
    kernels = op._ready(torch.cuda.current_device())
    if "dq_finish" not in kernels:
        return None
    calls = {}
    real = dict(kernels)
    for mode in ("fused", "dq_finish"):
        kernels[mode] = (lambda m: lambda *a: calls.setdefault(m, a))(mode)
    try:
        op.execute(*args, workspace=ws)
    finally:
        kernels.update(real)
    if "dq_finish" not in calls:
        return None  # compact numbering
    fused_args, finish_args = calls["fused"], calls["dq_finish"]
    sync = finish_args[2]
    zero = do_bench(lambda: sync.zero_())
    converting = do_bench(lambda: (sync.zero_(), real["fused"](*fused_args))) - zero
    claimed = 1 << 30  # every claim count past its group's slices: nothing to convert
    groups = Launch(0, finish_args[4]).groups(op.num_kv_heads, finish_args[3].shape[0] - 1)
    fill = do_bench(lambda: sync[groups:2 * groups].fill_(claimed))
    idle_finish = do_bench(lambda: (sync[groups:2 * groups].fill_(claimed),
                                    real["dq_finish"](*finish_args))) - fill
    # dq_finish as execute runs it: on the sync words one converting kernel left behind
    sync.zero_()
    real["fused"](*fused_args)
    torch.cuda.synchronize()
    left = sync.clone()
    restore = do_bench(lambda: sync.copy_(left))
    after_kernel = do_bench(lambda: (sync.copy_(left), real["dq_finish"](*finish_args))) - restore
    op.execute(*args, workspace=ws)  # leaves the workspace zero again
    torch.cuda.synchronize()
    return converting * 1e3, idle_finish * 1e3, after_kernel * 1e3


def main(argv) -> int:
    for case in argv or ["1024", "4096", "16384"]:
        seqlen, _, left = case.partition(":")
        seqlen, window = int(seqlen), ((int(left), 0) if left else (-1, 0))
        lens = [seqlen] * (TOKENS // seqlen)
        q, k, v, cu_q, cu_k = make_inputs(lens, lens, 128)
        do = torch.randn_like(q)
        cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
        grads = [torch.empty_like(t) for t in (q, k, v)]
        op = HSTUBwdSm90(do, q, k, v, *grads, cu_q, cu_k, seqlen, seqlen, window,
                         alpha=1 / math.sqrt(128)).check_support().compile()
        ws = torch.zeros(op.workspace_shape(q.shape[0]), dtype=torch.float32, device="cuda")
        args = (do, q, k, v, *grads, cu_q, cu_k)
        shares = converted_shares(op, args, ws)
        total = do_bench(lambda: op.execute(*args, workspace=ws)) * 1e3
        alone = kernel_times(op, torch.cuda.current_device(),
                             lambda: op.execute(*args, workspace=ws))
        times = ", ".join(f"{m} {us:.1f} us" for m, us in alone.items())
        name = f"local {window[0]}" if left else "causal"
        print(f"{name} L={seqlen}: execute {total:.1f} us ({times})")
        split = split_costs(op, args, ws)
        if split is not None:
            print(f"  fused kernel converting {split[0]:.1f} us, dq_finish with nothing to "
                  f"convert {split[1]:.1f} us, after a converting kernel {split[2]:.1f} us")
        if shares is not None:
            pair_group, claimed = shares
            print(f"  {len(claimed)} groups of {pair_group} pairs; converted in the kernel: "
                  + " ".join(f"{c:.2f}" for c in claimed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
