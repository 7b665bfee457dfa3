"""Timing helpers and hardware ceilings measured in the same run (used by bench/ and
`precast quickstart`)."""
from __future__ import annotations

import platform
import time

import torch


def do_bench(fn, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of fn() (triton.testing.do_bench when installed, else CUDA events)."""
    try:
        from triton.testing import do_bench as triton_bench
        return float(triton_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def burst_ms(fn, launches: int = 10, rounds: int = 5, rest_s: float = 0.5) -> float:
    """Median milliseconds per launch of ``launches`` back-to-back fn() calls (CUDA events
    around the whole burst, L2 not flushed), each burst after ``rest_s`` of idle time and
    two warm-up calls. do_bench keeps the GPU busy for ~0.3 s, long enough for a board at its
    power limit (the H200's 700 W) to lower its clocks; a short burst from rest is what a
    bursty serving loop sees, do_bench what sustained training sees."""
    per_launch = []
    for _ in range(rounds):
        rest(fn, rest_s)
        per_launch.append(back_to_back_ms(fn, launches))
    return sorted(per_launch)[len(per_launch) // 2]


def rest(fn, seconds: float) -> None:
    """Idle for ``seconds`` once the queued work is done (the clocks recover), then two
    warm-up calls of fn."""
    torch.cuda.synchronize()
    time.sleep(seconds)
    for _ in range(2):
        fn()


def back_to_back_ms(fn, calls: int) -> float:
    """Milliseconds per call of ``calls`` back-to-back fn() calls (CUDA events around all of
    them, nothing in between)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    n = int(gib * 2**30)
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a))
    return 2 * n / (ms * 1e-3)


def matmul_rate(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "gpu": props.name,
            "sms": props.multi_processor_count, "torch": torch.__version__,
            "python": platform.python_version()}


def lmsd_inputs(rows: int, dim: int, dtype=torch.bfloat16, device="cuda"):
    """Random (x, u, weight, bias) for HSTU LMSD measurements (never zeros)."""
    x = torch.randn(rows, dim, device=device, dtype=dtype)
    u = torch.randn_like(x)
    weight = torch.randn(dim, device=device, dtype=dtype)
    bias = torch.randn_like(weight)
    return x, u, weight, bias


def gdn_inputs(lens, qk_heads: int, v_heads: int, dim: int = 128, seed: int = 0,
               device="cuda"):
    """Random Gated DeltaNet inputs (q, k, v, g, beta, cu_seqlens) for sequences of the
    given lengths: bf16 q, k, v (K = V = dim), float32 log decays, bf16 beta."""
    from .reference.offsets import offsets_from_lengths
    gen = torch.Generator(device=device).manual_seed(seed)
    tokens = sum(lens)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=gen)
    q, k = (randn(tokens, qk_heads, dim).to(torch.bfloat16) for _ in range(2))
    v = randn(tokens, v_heads, dim).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(randn(tokens, v_heads))
    beta = torch.sigmoid(randn(tokens, v_heads)).to(torch.bfloat16)
    return q, k, v, g, beta, offsets_from_lengths(lens, device=device)


def lmsd_traffic_bytes(rows: int, dim: int, direction: str, itemsize: int = 2,
                       segments: int = 3, dropout: bool = True) -> int:
    """Fewest bytes an LMSD pass must move: forward reads x, u and writes y (+ mask);
    backward reads dy, x, u (+ mask) and writes dx, du; mean/rstd are 8 bytes a row."""
    mask = 1 if dropout else 0
    if direction == "fwd":
        per_element = 2 * itemsize + segments * itemsize + mask
    elif direction == "bwd":
        per_element = segments * itemsize + 2 * itemsize + mask + 2 * itemsize
    else:
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return rows * dim * per_element + 8 * rows
