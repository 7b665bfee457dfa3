"""Benchmark plumbing: the package's timing helpers plus result files under $OUT."""
from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from precast.benchmarking import (back_to_back_ms, burst_ms, copy_bandwidth,  # noqa: E402
                                  do_bench, environment, gdn_inputs, lmsd_inputs,
                                  lmsd_traffic_bytes, matmul_rate, rest)

__all__ = ["back_to_back_ms", "burst_ms", "copy_bandwidth", "do_bench", "environment",
           "gdn_inputs", "kernel_times", "lmsd_inputs", "lmsd_traffic_bytes", "matmul_rate",
           "recorded_launches", "rest", "write_json"]


def recorded_launches(op, device_index: int, execute) -> list:
    """[(mode, kernel, args)]: each kernel launch of one ``execute()`` of the compiled
    ``op``, in launch order, recorded instead of launched (every kernel takes its stream
    last in ``args``)."""
    kernels = op._ready(device_index)
    real = dict(kernels)
    launched = []
    for mode, fn in real.items():
        kernels[mode] = (lambda m, f: lambda *a: launched.append((m, f, a)))(mode, fn)
    try:
        execute()
    finally:
        kernels.update(real)
    return launched


def kernel_times(op, device_index: int, execute) -> dict:
    """{kernel: us}: each kernel that one ``execute()`` of the compiled ``op`` launches,
    timed alone (do_bench median) with the same arguments on the current stream (an execute
    may fork some of them onto a side stream), in launch order."""
    stream = torch.cuda.current_stream().cuda_stream
    times = {}
    for mode, fn, args in recorded_launches(op, device_index, execute):
        args = args[:-1] + (stream,)
        fn(*args)
        times[mode] = do_bench(lambda: fn(*args)) * 1e3
    return times


def write_json(name: str, payload: dict) -> None:
    out = os.environ.get("OUT") or os.environ.get("BENCH_OUT")
    if out:
        with open(os.path.join(out, name), "w") as fh:
            json.dump(payload, fh, indent=1)
