"""Registers, spills and wgmma serialization of plan entries, without a GPU.

    python bench/ptxas_report.py [SUBSTRING ...] [--plan tests/gpu_plan.toml] [--ptxas PATH]

Each matching entry is compiled for sm_90a with its PTX kept, and a local ptxas (any CUDA
toolkit's; the PTX `.version` line is lowered to 9.0, what CUDA 13.0 ptxas accepts) reports on it. ptxas only
warns when it serializes wgmma ("insufficient register resources" and similar): every
HGMMA then waits for the previous one, which costs Hopper kernels 20-30 %. Exit status 1 when
any entry serializes or spills.

--hash also prints a digest of each kernel's PTX (without its .loc / .file / comment lines):
run it before and after a refactor and diff the outputs to see whether the code moved.
"""
from __future__ import annotations

import argparse
import atexit
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
DUMP_DIR = Path(tempfile.mkdtemp(prefix="precast-ptx-"))  # emptied between entries
atexit.register(shutil.rmtree, DUMP_DIR, True)

from precast.lifecycle.op import OP_REGISTRY  # noqa: E402
from precast.plan import load_plan  # noqa: E402

DEFAULT_PLAN = Path(__file__).resolve().parents[1] / "tests" / "gpu_plan.toml"


def find_ptxas(explicit: str | None) -> str:
    for candidate in (explicit, shutil.which("ptxas"), *sorted(Path("/usr/local").glob(
            "cuda*/bin/ptxas"), reverse=True)):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    raise SystemExit("no ptxas found: pass --ptxas (any CUDA toolkit's)")


def compile_ptx(entry, out_dir: Path) -> list[Path]:
    """The PTX of every kernel the entry's op builds (one folder per kernel: the DSL names
    the file after the function, which two kernels of one op may share)."""
    import cutlass.cute as cute
    shutil.rmtree(out_dir, ignore_errors=True)
    op = OP_REGISTRY[entry.op].from_config(**dict(entry.config)).check_support()
    ptxs = []
    for name, build in op._kernel_builders().items():
        fn, args = build()
        folder = out_dir / name
        folder.mkdir(parents=True)
        cute.compile(fn, *args, options=f"--enable-tvm-ffi --gpu-arch sm_90a --keep-ptx "
                                        f"--dump-dir {folder}")
        ptxs += sorted(folder.glob("*.ptx"))
    return ptxs


def ptxas_verdict(ptxas: str, ptx: Path) -> dict:
    text = re.sub(r"^\.version \d+\.\d+", ".version 9.0", ptx.read_text(), count=1, flags=re.M)
    lowered = ptx.with_suffix(".lowered.ptx")
    lowered.write_text(text)
    result = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(lowered), "-o", os.devnull],
                            capture_output=True, text=True)
    log = result.stdout + result.stderr
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", log)]
    spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", log)]
    serialized = re.findall(r"serialized due to ([^\n']+)", log)
    return {"registers": max(regs, default=0), "spill_bytes": sum(spills),
            "serialized": sorted(set(serialized)), "error": "" if result.returncode == 0 else log}


def ptx_digest(ptx: Path) -> str:
    """sha256 (16 hex digits) of the PTX without its source-position and comment lines:
    equal for edits that give ptxas the same input. (Not the cubin's: ptxas 13.0 made two
    different cubins of one fused backward PTX in repeated runs.)"""
    lines = ptx.read_text().splitlines()
    kept = "\n".join(line for line in lines
                     if not line.lstrip().startswith((".loc", ".file", "//")))
    return hashlib.sha256(kept.encode()).hexdigest()[:16]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("substrings", nargs="*", help="keep entries whose description contains these")
    ap.add_argument("--plan", default=str(DEFAULT_PLAN))
    ap.add_argument("--ptxas")
    ap.add_argument("--hash", action="store_true", help="also print each kernel's PTX digest")
    args = ap.parse_args(argv)
    ptxas = find_ptxas(args.ptxas)
    entries = [e for e in dict.fromkeys(load_plan(args.plan))
               if all(s in e.describe() for s in args.substrings)]
    bad = 0
    for entry in entries:
        ptxs = compile_ptx(entry, DUMP_DIR)
        if not ptxs:
            raise SystemExit(f"{entry.describe()}: the DSL kept no PTX in {DUMP_DIR}")
        for ptx in ptxs:
            v = ptxas_verdict(ptxas, ptx)
            flag = v["error"] and "ptxas failed" or (
                "SERIALIZED: " + "; ".join(v["serialized"]) if v["serialized"] else
                f"{v['spill_bytes']} spill bytes" if v["spill_bytes"] else "ok")
            bad += flag != "ok"
            digest = f" ptx {ptx_digest(ptx)}" if args.hash else ""
            print(f"{entry.describe()} [{ptx.parent.name}]: {v['registers']} registers, "
                  f"{flag}{digest}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
