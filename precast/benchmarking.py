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
