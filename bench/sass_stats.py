"""Instruction mix and registers of cached kernels, from their exported libraries.

    python bench/sass_stats.py [OP_SUBSTRING] [--cuobjdump PATH]

The exported .so embeds the sm_90a cubin as raw data (not a fatbin), so cuobjdump cannot
read the .so directly: the cubin is cut out first. cuobjdump comes from the CUDA toolkit or
from Triton's wheel (triton/backends/nvidia/bin/cuobjdump), which runs without a GPU.
"""
from __future__ import annotations

import argparse
import collections
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precast.lifecycle.cache import ArtifactCache  # noqa: E402

CUDA_ELF_MACHINE = 190


def cubins(blob: bytes):
    """Every CUDA ELF image embedded in ``blob``."""
    start = 1
    while (start := blob.find(b"\x7fELF", start)) >= 0:
        if struct.unpack_from("<H", blob, start + 18)[0] == CUDA_ELF_MACHINE:
            phoff, shoff = struct.unpack_from("<QQ", blob, start + 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, start + 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            yield blob[start:start + end]
        start += 4


def opcode_histogram(sass: str) -> collections.Counter:
    ops = collections.Counter()
    for line in sass.splitlines():
        parts = line.strip().split(None, 2)
        if len(parts) < 2 or not (parts[0].startswith("/*") and parts[0].endswith("*/")):
            continue
        op = parts[1] if not parts[1].startswith("@") else line.split()[2]
        pieces = op.rstrip(";").split(".")
        ops[pieces[0] + (".WIDE" if pieces[0] == "IMAD" and "WIDE" in pieces else "")] += 1
    return ops


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", nargs="?", default="")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    args = parser.parse_args()
    for entry, manifest in ArtifactCache().entries():
        key = manifest["key"]
        if args.op not in key["op"]:
            continue
        cfg = ",".join(f"{k}={v}" for k, v in sorted(key["config"].items()))
        for name, info in manifest["kernels"].items():
            for image in cubins((entry / info["file"]).read_bytes()):
                with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
                    tmp.write(image)
                    tmp.flush()
                    sass = subprocess.run([args.cuobjdump, "-sass", tmp.name], capture_output=True,
                                          text=True).stdout
                    res = subprocess.run([args.cuobjdump, "-res-usage", tmp.name],
                                         capture_output=True, text=True).stdout
                ops = opcode_histogram(sass)
                regs = [w for w in res.replace(",", " ").split() if w.startswith("REG:")]
                top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(10))
                print(f"{key['op']}[{cfg}] {name}: {regs[0] if regs else '?'} "
                      f"{sum(ops.values())} instructions; {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
