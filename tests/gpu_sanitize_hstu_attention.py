"""Small ragged HSTU attention forward launches for compute-sanitizer (run on the GPU host):

  compute-sanitizer --tool memcheck --error-exitcode 1 python tests/gpu_sanitize_hstu_attention.py
  compute-sanitizer --tool racecheck --error-exitcode 1 python tests/gpu_sanitize_hstu_attention.py

(--error-exitcode makes a reported hazard fail the run; without it compute-sanitizer returns
this script's own status, which is nonzero only when a result is wrong.)

Covers causal, local windows, a func mask, paged KV (MQA) and GQA, with 0- and 1-token
sequences, tile-edge lengths, sequences whose keys are fewer than their queries, and an o
that is a strided view of a NaN-poisoned buffer. Every configuration is in
tests/gpu_plan.toml. Exits nonzero when a result is wrong (NaN left in o, a write outside
the o view, error above tolerance against the fp32 reference, a row with no visible key not
exactly zero, a scheduler workspace not left zero).
"""
import math
import sys

import torch

from precast import HSTUFwdSm90
from precast.lifecycle.launch import SCHEDULER_COUNTER_SHAPE
from precast.reference.hstu_attention import (PAGE_SIZE, hstu_attention_reference,
                                              random_func_tensor, visible_mask)
from precast.reference.offsets import offsets_from_lengths

DEV = "cuda"
H = 4
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
LENS_Q = [37, 1, 0, 130, 5, 64]
LENS_K = [40, 1, 3, 200, 2, 64]   # the fifth sequence has fewer keys than queries
failures = []


def cu(lens):
    return offsets_from_lengths(lens, device=DEV)


def pages_for(k, v, lens_k, g):
    """k/v scattered into pages in random order (one spare page, junk in unused slots)."""
    need = [-(-n // PAGE_SIZE) for n in lens_k]
    total = sum(need) + 1
    ids = torch.randperm(total, generator=g)[:sum(need)].to(torch.int32)
    indptrs = [0]
    for n in need:
        indptrs.append(indptrs[-1] + n)
    paged = (torch.randn(total, 2, PAGE_SIZE, *k.shape[1:], generator=g) * 50).to(k.dtype)
    paged = paged.to(DEV)
    page = torch.cat([ids[indptrs[i] + torch.arange(n) // PAGE_SIZE].long()
                      for i, n in enumerate(lens_k)]).to(DEV)
    slot = torch.cat([torch.arange(n) % PAGE_SIZE for n in lens_k]).to(DEV)
    paged[page, 0, slot] = k
    paged[page, 1, slot] = v
    return paged, ids.to(DEV), torch.tensor(indptrs, dtype=torch.int32, device=DEV)


def case(name, dtype, d, window, *, hkv=H, func_n=0, paged=False, strided_o=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(LENS_Q), H, d, generator=g).to(dtype).to(DEV)
    k = torch.randn(sum(LENS_K), hkv, d, generator=g).to(dtype).to(DEV)
    v = torch.randn(sum(LENS_K), hkv, d, generator=g).to(dtype).to(DEV)
    cu_q, cu_k = cu(LENS_Q), cu(LENS_K)
    max_q, max_k = max(LENS_Q), max(LENS_K)
    func = (random_func_tensor(cu_q.cpu(), cu_k.cpu(), func_n, generator=g).to(DEV)
            if func_n else None)
    paged_kv = page_ids = page_indptrs = None
    if paged:
        paged_kv, page_ids, page_indptrs = pages_for(k, v, LENS_K, g)
        k = v = None
    if strided_o:  # heads [H, 2H) of a (T, 3H, D) buffer
        big = torch.full((q.shape[0], 3 * H, d), float("nan"), dtype=dtype, device=DEV)
        o = big[:, H:2 * H]
    else:
        big = o = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
    op = HSTUFwdSm90(q, k, v, o, cu_q, cu_k, max_q, max_k, window, sample_func=func,
                     sample_paged_kv=paged_kv, sample_page_ids=page_ids,
                     sample_page_indptrs=page_indptrs).check_support().compile()
    ws = torch.zeros(op.workspace_shape(), dtype=torch.int32, device=DEV)
    alpha = 1 / math.sqrt(d)
    op.execute(q, k, v, o, cu_q, cu_k, func, paged_kv, page_ids, page_indptrs, alpha=alpha,
               workspace=ws)
    torch.cuda.synchronize()
    ref = hstu_attention_reference(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window,
                                   alpha=alpha, func_tensor=func, paged_kv=paged_kv,
                                   page_ids=page_ids, page_indptrs=page_indptrs,
                                   compute_dtype=torch.float32)
    dead, start = [], 0
    for lq, lk in zip(LENS_Q, LENS_K):
        rows = func[0, :, start:start + lq] if func is not None else None
        dead.append(~visible_mask(lq, lk, window, rows, device=DEV).any(dim=1))
        start += lq
    dead = torch.cat(dead)
    problems = []
    if torch.isnan(o).any():
        problems.append("NaN left in o")
    if strided_o:
        outside = torch.ones(big.shape, dtype=torch.bool, device=DEV)
        outside[:, H:2 * H] = False
        if not torch.isnan(big[outside]).all():
            problems.append("wrote outside the o view")
    err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
    if not err < TOL[dtype]:
        problems.append(f"max|o - ref| / max|ref| = {err:.3g}")
    if dead.any() and torch.count_nonzero(o[dead]):
        problems.append("a row with no visible key is not zero")
    if torch.count_nonzero(ws[:SCHEDULER_COUNTER_SHAPE[0]]):
        problems.append(f"scheduler counter left {ws[:SCHEDULER_COUNTER_SHAPE[0]].tolist()}")
    print(f"{name}: err {err:.2e}, dead rows {int(dead.sum())}", "ok" if not problems
          else "FAILED: " + "; ".join(problems))
    if problems:
        failures.append(name)


torch.backends.cuda.matmul.allow_tf32 = False
case("causal bf16 D64", torch.bfloat16, 64, (-1, 0), seed=1)
case("local (7, 33) fp16 D128, strided o", torch.float16, 128, (7, 33), strided_o=True, seed=2)
case("local (0, 0) bf16 D256", torch.bfloat16, 256, (0, 0), seed=3)
case("left-only (16, -1) fp16 D32", torch.float16, 32, (16, -1), seed=4)
case("func n=3 bf16 D32", torch.bfloat16, 32, (-1, -1), func_n=3, seed=5)
case("func n=1 fp16 D256", torch.float16, 256, (-1, -1), func_n=1, seed=6)
case("paged MQA fp16 D256", torch.float16, 256, (-1, 0), hkv=1, paged=True, seed=7)
case("paged bf16 D128", torch.bfloat16, 128, (-1, 0), paged=True, seed=8)
case("GQA full bf16 D128", torch.bfloat16, 128, (-1, -1), hkv=2, seed=9)
if failures:
    print(f"{len(failures)} case(s) failed: {', '.join(failures)}", file=sys.stderr)
    sys.exit(1)
print("all ok")
