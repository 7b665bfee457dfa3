"""Sustained vs burst timing: which of do_bench's L2 flush and its ~0.3 s of load makes it
slower than a short burst (bench/RESULTS.md run 36d: the load, through the board's power
limit). Causal attention backward at 4k and 8k (D = 128) and the GDN forward at 4 x 8192.

    python bench/sustained_vs_burst.py
"""
import math, os, sys, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from bench_hstu_attention import TOKENS, make_inputs
from common import burst_ms, do_bench
from precast import HSTUBwdSm90, gated_delta_net
from precast.benchmarking import gdn_inputs

flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")

def events(fn, n, with_flush):
    """Per-launch ms of n launches; with_flush: an L2 flush before each, timed apart."""
    torch.cuda.synchronize()
    if not with_flush:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n): fn()
        e.record(); e.synchronize()
        return s.elapsed_time(e) / n
    ts = []
    for _ in range(n):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record()
        ts.append((s, e))
    torch.cuda.synchronize()
    v = sorted(a.elapsed_time(b) for a, b in ts)
    return v[len(v) // 2]

def report(name, fn, one_ms):
    n_long = max(int(300 / one_ms), 20)  # ~0.3 s busy, as do_bench
    rows = []
    rows.append(("do_bench", do_bench(fn)))
    time.sleep(1); fn(); fn()
    rows.append(("burst 10", burst_ms(fn)))
    time.sleep(1); fn(); fn()
    rows.append((f"back-to-back {n_long}, no flush", events(fn, n_long, False)))
    time.sleep(1); fn(); fn()
    rows.append((f"{n_long} with flush, median", events(fn, n_long, True)))
    time.sleep(1); fn(); fn()
    rows.append(("10 with flush from rest, median", events(fn, 10, True)))
    print(name + ": " + " | ".join(f"{k} {v * 1e3:.1f} us" for k, v in rows), flush=True)

for L in (4096, 8192):
    lens = [L] * (TOKENS // L)
    q, k, v, cu_q, cu_k = make_inputs(lens, lens, 128)
    do = torch.randn_like(q)
    cq, ck = cu_q.cuda(), cu_k.cuda()
    grads = [torch.empty_like(t) for t in (q, k, v)]
    op = HSTUBwdSm90(do, q, k, v, *grads, cq, ck, L, L, (-1, 0), alpha=1 / math.sqrt(128)).check_support().compile()
    run = lambda: op.execute(do, q, k, v, *grads, cq, ck)
    run(); torch.cuda.synchronize()
    report(f"attention bwd causal {L}", run, 1.4 * L / 4096)
    del q, k, v, do, grads
    torch.cuda.empty_cache()

q, k, v, g, beta, cu = gdn_inputs([8192] * 4, 64, 64, dim=128)
run = lambda: gated_delta_net(q, k, v, g, beta, cu, output_final_state=True, use_qk_l2norm_in_kernel=True)
run(); torch.cuda.synchronize()
report("GDN forward 4x8192", run, 1.15)
