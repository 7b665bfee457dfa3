"""Plan files: which ops and static configurations to precompile.

TOML or JSON. Each ``[[op]]`` table names an op class and its static configuration; a
list value expands into one entry per element (the cartesian product over all lists):

    [[op]]
    name = "HstuLmsdFwdSm90"
    dtype = ["bfloat16", "float16"]
    dim = [256, 512]
    dropout = true
"""
from __future__ import annotations

import itertools
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from .lifecycle.op import OP_REGISTRY


@dataclass(frozen=True)
class PlanEntry:
    op: str
    config: tuple  # sorted (name, value) pairs

    def describe(self) -> str:
        return f"{self.op}(" + ", ".join(f"{k}={v}" for k, v in self.config) + ")"


# Modules of the op classes: each registers its ops in OP_REGISTRY when imported.
OP_MODULES = ("precast.lifecycle.lmsd", "precast.lifecycle.hstu_attention",
              "precast.lifecycle.gdn_fwd", "precast.lifecycle.gdn_bwd")


def _load_ops():
    import importlib
    for module in OP_MODULES:
        importlib.import_module(module)


def expand(table: Dict[str, object]) -> List[PlanEntry]:
    table = dict(table)
    name = table.pop("name", None) or table.pop("op", None)
    if not isinstance(name, str):
        raise ValueError(f"plan entry {table} has no op name ('name = \"HstuLmsdFwdSm90\"')")
    _load_ops()
    if name not in OP_REGISTRY:
        raise ValueError(f"plan names unknown op {name!r}; known ops: {sorted(OP_REGISTRY)}")
    keys = sorted(table)
    values = [table[k] if isinstance(table[k], list) else [table[k]] for k in keys]
    return [PlanEntry(name, tuple(zip(keys, combo))) for combo in itertools.product(*values)]


def load_plan(path: os.PathLike) -> List[PlanEntry]:
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import tomllib
        data = tomllib.loads(text)
    tables = data.get("op") if isinstance(data, dict) else data
    if not isinstance(tables, list):
        raise ValueError(f"{path}: expected [[op]] tables (TOML) or a list / {{'op': [...]}} (JSON)")
    entries: List[PlanEntry] = []
    for table in tables:
        for entry in expand(table):
            if entry not in entries:
                entries.append(entry)
    return entries


def build_entry(entry: PlanEntry, arch: Optional[str], cache_dir: Optional[str]) -> float:
    """Compiles (or finds) one entry; returns seconds spent. Runs in a worker process."""
    _load_ops()
    from .lifecycle.cache import ArtifactCache, default_cache
    start = time.perf_counter()
    op = OP_REGISTRY[entry.op].from_config(**dict(entry.config))
    cache = ArtifactCache(cache_dir) if cache_dir else default_cache()
    op.check_support().compile(arch=arch, cache=cache)
    return time.perf_counter() - start


def _bar(done: int, total: int, width: int = 28) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{total}"


def precompile(entries: List[PlanEntry], arch: Optional[str] = None,
               cache_dir: Optional[str] = None, jobs: Optional[int] = None,
               stream=None) -> List[tuple]:
    """Builds every entry in parallel processes with a progress bar (on ``stream``, default
    the current sys.stderr); returns (entry, seconds or exception) per entry. Already-cached
    entries cost a load."""
    stream = sys.stderr if stream is None else stream
    from .lifecycle.arch import target_arch
    arch = target_arch(arch)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(entries) or 1))
    results = []
    tty = hasattr(stream, "isatty") and stream.isatty()
    stream.write(f"precompiling {len(entries)} kernels for {arch} with {jobs} processes\n")
    import multiprocessing
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no CUDA/DSL state shared
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = {pool.submit(build_entry, e, arch, cache_dir): e for e in entries}
        for future in as_completed(futures):
            entry = futures[future]
            try:
                outcome = future.result()
                status = f"{outcome:6.1f} s  {entry.describe()}"
            except Exception as exc:  # report every failure, keep building the rest
                outcome = exc
                status = f"FAILED  {entry.describe()}: {type(exc).__name__}: {exc}"
            results.append((entry, outcome))
            line = f"{_bar(len(results), len(entries))}  {status}"
            stream.write(("\r\033[K" if tty else "") + line + ("" if tty else "\n"))
            stream.flush()
    if tty:
        stream.write("\n")
    return results
