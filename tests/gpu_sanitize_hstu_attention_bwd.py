"""Small ragged HSTU attention backward launches for compute-sanitizer (run on the GPU host):

  compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu_sanitize_hstu_attention_bwd.py
  compute-sanitizer --tool racecheck --error-exitcode 1 python tests/gpu_sanitize_hstu_attention_bwd.py

Causal, a local window, a func mask and GQA at D = 64 (the fused kernel with its dQ
reduce-adds), causal at D = 256 (the dK/dV split) and deterministic D = 128, the fused
kernel converting dQ behind one-pair L2 groups, with 0- and 1-token sequences, tile-edge lengths and fewer keys than queries; dk and dv are the two
halves of one NaN-poisoned buffer. Exits nonzero when a result is wrong (NaN left, a write
outside the views, error above tolerance against fp32 autograd of the reference).
"""
import math
import sys

import torch

from precast import HSTUBwdSm90
from precast.lifecycle import hstu_attention_bwd as bwd_module
from precast.reference.hstu_attention import hstu_attention_backward_reference, random_func_tensor
from precast.reference.offsets import offsets_from_lengths

DEV = "cuda"
H = 4
LENS_Q = [37, 1, 0, 130, 5, 64]
LENS_K = [40, 1, 3, 200, 2, 64]
# One long sequence among short and empty ones: the kernels number only existing tiles.
LENS_HEAVY = [700, 0, 1, 3, 0, 2, 5, 1]
LENS_DENSE = [300, 257, 1, 0, 290, 310]  # most CTAs of a max_seqlen-sized grid have rows
failures = []


def cu(lens):
    return offsets_from_lengths(lens, device=DEV)


def case(name, d, window, *, hkv=H, func_n=0, seed=0, deterministic=False, lens_q=LENS_Q,
         lens_k=LENS_K):
    g = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16
    q, do = (torch.randn(sum(lens_q), H, d, generator=g).to(dt).to(DEV) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), hkv, d, generator=g).to(dt).to(DEV) for _ in range(2))
    cu_q, cu_k = cu(lens_q), cu(lens_k)
    func = random_func_tensor(cu_q.cpu(), cu_k.cpu(), func_n, generator=g).to(DEV) \
        if func_n else None
    dq = torch.full_like(q, float("nan"))
    dkv = torch.full((sum(lens_k), 3, hkv, d), float("nan"), dtype=dt, device=DEV)
    dk, dv = dkv[:, 0], dkv[:, 2]  # the middle third must stay untouched
    max_q, max_k = max(lens_q), max(lens_k)
    alpha = 1 / math.sqrt(d)
    op = HSTUBwdSm90(do, q, k, v, dq, dk, dv, cu_q, cu_k, max_q, max_k, window, alpha,
                     sample_func=func, deterministic=deterministic).check_support().compile()
    op.execute(do, q, k, v, dq, dk, dv, cu_q, cu_k, func)
    torch.cuda.synchronize()
    ref = hstu_attention_backward_reference(do, q, k, v, cu_q, cu_k, max_q, max_k,
                                            window_size=window, alpha=alpha, func_tensor=func)
    errs = []
    for nm, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        if torch.isnan(got).any():
            failures.append(f"{name}: {nm} not fully written")
        errs.append(((got.float() - want).abs().max() / want.abs().max()).item())
    if max(errs) > 4e-2:
        failures.append(f"{name}: error {max(errs):.3g}")
    if not torch.isnan(dkv[:, 1]).all():
        failures.append(f"{name}: wrote outside the dk/dv views")
    print(f"{name}: max rel err {max(errs):.2e}", flush=True)


case("causal D64", 64, (-1, 0))
case("local D64", 64, (7, 33), seed=1)
case("func3 D64", 64, (-1, -1), func_n=3, seed=2)
case("GQA causal D64", 64, (-1, 0), hkv=1, seed=3)
case("causal D256", 256, (-1, 0), seed=4)
case("deterministic causal D128", 128, (-1, 0), seed=5, deterministic=True)
case("heavy-tailed causal D64", 64, (-1, 0), seed=6, lens_q=LENS_HEAVY, lens_k=LENS_HEAVY)
case("heavy-tailed deterministic D128", 128, (-1, 0), seed=7, deterministic=True,
     lens_q=LENS_HEAVY, lens_k=LENS_HEAVY)
# One (sequence, kv head) pair per L2 group: the fused kernel's idle warps convert finished
# groups' dQ beside the running ones, dq_finish the rest (dense numbering).
bwd_module.L2_GROUP_BYTES = 1
case("one pair per L2 group causal D64", 64, (-1, 0), seed=8, lens_q=LENS_DENSE,
     lens_k=LENS_DENSE)
case("one pair per L2 group GQA D128", 128, (-1, -1), hkv=2, seed=9, lens_q=LENS_DENSE,
     lens_k=LENS_DENSE)
print("\n".join(failures) or "all ok")
sys.exit(1 if failures else 0)
