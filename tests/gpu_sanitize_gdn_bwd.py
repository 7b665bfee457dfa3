"""A small Gated DeltaNet forward + backward for compute-sanitizer (run on the GPU host, from
precompiled artifacts of tests/gpu_plan.toml's bf16 K = V = 128, 4-head, l2norm entries,
forward with the final state, backward with its gradient):

    compute-sanitizer --tool memcheck --report-api-errors no python tests/gpu_sanitize_gdn_bwd.py
    compute-sanitizer --tool racecheck python tests/gpu_sanitize_gdn_bwd.py [BATCH ...] [--pairs]
        [--no-dfinal]

Ragged lengths with empty and one-token sequences and a partial last chunk, then 40 such
sequences (more than 32: the kernels read the per-sequence table; the batches and inputs of
tests/gpu_sanitize_gdn.py; racecheck of "ragged" alone takes under a minute, of both
several), through autograd (o, s = gated_delta_net(...);
loss.backward()); the gradients are checked against
the float64 chunked backward so a silent wrong answer fails too. --pairs: v, the gates and
beta (bf16) with twice the heads of q and k, so that two output heads add into each head's
dq and dk (chunk_grad's TMA reduce-adds and atomics; the plan's 4 / 4 / 8-head entries).
--no-dfinal: the loss on o alone (no final state's gradient: the last chunk's dS' is zero,
made in shared memory, and one-chunk sequences skip state_grad's work)."""
import sys

import torch

from gpu_sanitize_gdn import H, K, V, chosen_batches, inputs
from precast import gated_delta_net
from precast.reference.gated_delta_net import rms_error_ratio
from precast.reference.gdn_backward import gdn_chunked_backward_reference

TOL = 4e-2  # RMS error ratio (bf16), the backward's bar
FLAGS = ("--pairs", "--no-dfinal")
pairs, with_dfinal = "--pairs" in sys.argv[1:], "--no-dfinal" not in sys.argv[1:]
failures = []
for what, lens in chosen_batches([a for a in sys.argv[1:] if a not in FLAGS]).items():
    (q, k, v, gate, beta, cu), g = inputs(lens)
    T, N = sum(lens), len(lens)
    HO = 2 * H if pairs else H
    if pairs:
        v = torch.randn(T, HO, V, device="cuda", generator=g).bfloat16()
        gate = -0.05 * torch.rand(T, HO, device="cuda", generator=g)
        beta = torch.rand(T, HO, device="cuda", generator=g).bfloat16()
    do = torch.randn(T, HO, V, device="cuda", generator=g).bfloat16()
    dfinal = 0.1 * torch.randn(N, HO, V, K, device="cuda", generator=g) if with_dfinal else None

    leaves = [t.clone().requires_grad_() for t in (q, k, v, gate, beta)]
    o, final = gated_delta_net(*leaves, cu, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
    loss = (o.float() * do.float()).sum()
    (loss + (final * dfinal).sum() if with_dfinal else loss).backward()
    torch.cuda.synchronize()
    ref = gdn_chunked_backward_reference(q, k, v, gate, beta, cu, do, dfinal=dfinal,
                                         use_qk_l2norm_in_kernel=True)
    for name, leaf in zip(("dq", "dk", "dv", "dg", "dbeta"), leaves):
        ratio = rms_error_ratio(leaf.grad, ref[name])
        print(f"{what}: {name}: RMS error ratio {ratio:.3g}", flush=True)
        if not ratio < TOL:
            failures.append(f"{what}: {name}")
print("all ok" if not failures else "FAILED: " + ", ".join(failures))
sys.exit(1 if failures else 0)
