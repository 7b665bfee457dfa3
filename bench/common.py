"""Benchmark plumbing: the package's timing helpers plus result files under $OUT."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from precast.benchmarking import (copy_bandwidth, do_bench, environment, gdn_inputs,  # noqa: E402
                                  lmsd_inputs, lmsd_traffic_bytes, matmul_rate)

__all__ = ["copy_bandwidth", "do_bench", "environment", "gdn_inputs", "lmsd_inputs",
           "lmsd_traffic_bytes", "matmul_rate", "write_json"]


def write_json(name: str, payload: dict) -> None:
    out = os.environ.get("OUT") or os.environ.get("BENCH_OUT")
    if out:
        with open(os.path.join(out, name), "w") as fh:
            json.dump(payload, fh, indent=1)
