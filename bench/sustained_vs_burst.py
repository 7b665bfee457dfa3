"""Sustained vs burst timing: which of do_bench's L2 flush and its ~0.3 s of load makes it
slower than a short burst (bench/RESULTS.md run 36d: the load, through the board's power
limit). Causal attention backward at 4k and 8k (D = 128), the GDN forward at 4 x 8192, and
the LMSD forward at issue 2's shape (N = 2^20, D = 512, p = 0.1, SiLU, both segments) with
its ratio to a copy timed in the same forms (the copy draws less power than the kernel).

    python bench/sustained_vs_burst.py [--only lmsd|attention|gdn ...]
"""
import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hstu_attention import TOKENS, make_inputs  # noqa: E402
from common import (back_to_back_ms, burst_ms, do_bench, gdn_inputs, lmsd_inputs,  # noqa: E402
                    lmsd_traffic_bytes, rest)

from precast import HSTUBwdSm90, gated_delta_net, hstu_lmsd_forward  # noqa: E402

BUSY_MS = 300  # about as long as do_bench keeps the GPU busy
REST_S = 1.0  # idle time before each form (the clocks recover)


def flushed_ms(fn, calls: int, flush) -> float:
    """Median milliseconds of ``calls`` calls timed one by one, the buffer ``flush`` zeroed
    (L2 flushed) before each."""
    pairs = []
    for _ in range(calls):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in pairs)
    return times[len(times) // 2]


def report(name: str, fn, flush) -> dict:
    """The five forms' ms per call, each after REST_S of idle time (printed and returned)."""
    rest(fn, REST_S)
    busy = max(int(BUSY_MS / back_to_back_ms(fn, 3)), 20)
    rows = [("do_bench", do_bench(fn))]
    rest(fn, REST_S)
    rows.append(("burst_ms", burst_ms(fn)))
    rest(fn, REST_S)
    rows.append((f"{busy} back-to-back", back_to_back_ms(fn, busy)))
    rest(fn, REST_S)
    rows.append((f"{busy} flushed", flushed_ms(fn, busy, flush)))
    rest(fn, REST_S)
    rows.append(("10 flushed from rest", flushed_ms(fn, 10, flush)))
    print(f"{name}: " + " | ".join(f"{k} {v * 1e3:.1f} us" for k, v in rows), flush=True)
    return dict(rows)


def lmsd_vs_copy(flush, rows: int = 1 << 20, dim: int = 512, p: float = 0.1):
    """Issue 2's ratio (LMSD forward bytes per second over a copy's) in every form."""
    x, u, w, b = lmsd_inputs(rows, dim)
    lmsd = report(f"LMSD forward {rows} x {dim}, p = {p}",
                  lambda: hstu_lmsd_forward(x, u, w, b, 1e-5, p, 1, True, True, True), flush)
    del x, u, w, b
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy = report("copy 1 GiB", lambda: dst.copy_(src), flush)
    moved = lmsd_traffic_bytes(rows, dim, "fwd")
    # (the forms in report's order: their busy counts differ between the two)
    ratios = {form: (moved / ms) / (2 * src.numel() / copy_ms)
              for (form, ms), copy_ms in zip(lmsd.items(), copy.values())}
    print("LMSD forward / copy: " + " | ".join(f"{k} {v:.3f}" for k, v in ratios.items()),
          flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", action="append", choices=("lmsd", "attention", "gdn"))
    parts = parser.parse_args().only or ("attention", "gdn", "lmsd")
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for seqlen in (4096, 8192) if "attention" in parts else ():
        lens = [seqlen] * (TOKENS // seqlen)
        q, k, v, cu_q, cu_k = make_inputs(lens, lens, 128)
        do = torch.randn_like(q)
        cu_q, cu_k = cu_q.cuda(), cu_k.cuda()
        grads = [torch.empty_like(t) for t in (q, k, v)]
        op = HSTUBwdSm90(do, q, k, v, *grads, cu_q, cu_k, seqlen, seqlen, (-1, 0),
                         alpha=1 / math.sqrt(128)).check_support().compile()
        report(f"attention backward causal L={seqlen}",
               lambda: op.execute(do, q, k, v, *grads, cu_q, cu_k), flush)
        del q, k, v, do, grads
        torch.cuda.empty_cache()
    if "gdn" in parts:
        q, k, v, g, beta, cu = gdn_inputs([8192] * 4, 64, 64, dim=128)
        report("GDN forward 4 x 8192",
               lambda: gated_delta_net(q, k, v, g, beta, cu, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True), flush)
        del q, k, v, g, beta, cu
    if "lmsd" in parts:
        lmsd_vs_copy(flush)
    return 0


if __name__ == "__main__":
    sys.exit(main())
