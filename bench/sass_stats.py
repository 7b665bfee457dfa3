"""Instruction mix and registers of cached kernels, from their exported libraries.

    python bench/sass_stats.py [OP_SUBSTRING] [--cuobjdump PATH] [--loop [--min-mma N]]

The exported .so embeds the sm_90a cubin as raw data (not a fatbin), so cuobjdump cannot
read the .so directly: the cubin is cut out first. cuobjdump comes from the CUDA toolkit or
from Triton's wheel (triton/backends/nvidia/bin/cuobjdump), which runs without a GPU.

--loop prints, per kernel, the hot loop instead of the whole kernel: the smallest loop (a
backward branch and the code it jumps over) holding at least --min-mma wgmma instructions,
its opcode mix, and each forward branch inside it that skips more than 40 instructions
(a mask path, a tail, a first-step case), so that the steady state can be counted without
them. Session 42 counted the attention backward's stream step this way (--min-mma 32: the
fused D = 128 step issues 32; a peeled first step with 24 is a loop too); the forward's key
loop is the smallest with 16 (docs/NOTES.md).
"""
from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precast.lifecycle.cache import ArtifactCache  # noqa: E402
from precast.lifecycle.cubin import embedded_cubins as cubins  # noqa: E402

SASS_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA(\.\w+)*\s+(0x[0-9a-f]+)")
SKIPPED_REGION = 40  # instructions: forward branches over more are listed by --loop


def instructions(sass: str) -> list:
    """(address, text) of every instruction."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(SASS_LINE.match, sass.splitlines())
            if m]


def opcode(text: str) -> str:
    """An instruction's opcode without its modifiers (IMAD.WIDE kept apart from IMAD)."""
    words = text.split()
    pieces = (words[1] if words[0].startswith("@") else words[0]).split(".")
    return pieces[0] + (".WIDE" if pieces[0] == "IMAD" and "WIDE" in pieces else "")


def opcode_histogram(code: list) -> collections.Counter:
    return collections.Counter(opcode(text) for _, text in code)


def hot_loop(code: list, min_mma: int):
    """(body, skipped regions) of the innermost loop holding at least min_mma HGMMA (the
    smallest such body), or None. Backward branches whose span holds an EXIT are not loops
    (the retry stubs of mbarrier waits sit after the kernel's end and jump back into it).
    A skipped region is (first address, end address, instructions) of a forward branch in
    the body over more than SKIPPED_REGION instructions."""
    loops = []
    for addr, text in code:
        m = BRANCH.match(text)
        if m and int(m.group(3), 16) < addr:
            body = [c for c in code if int(m.group(3), 16) <= c[0] <= addr]
            mma = sum(opcode(t) == "HGMMA" for _, t in body)
            if mma >= min_mma and not any(opcode(t) == "EXIT" for _, t in body):
                loops.append(body)
    if not loops:
        return None
    body = min(loops, key=len)
    end = body[-1][0]
    skipped = []
    for addr, text in body:
        m = BRANCH.match(text)
        if m and m.group(1) and addr < int(m.group(3), 16) <= end:
            inside = [c for c in body if addr < c[0] < int(m.group(3), 16)]
            if len(inside) > SKIPPED_REGION:
                skipped.append((inside[0][0], int(m.group(3), 16), len(inside)))
    return body, skipped


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("op", nargs="?", default="")
    parser.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    parser.add_argument("--loop", action="store_true", help="the hot loop's mix (see above)")
    parser.add_argument("--min-mma", type=int, default=16,
                        help="wgmma instructions the hot loop holds at least (--loop)")
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
                if args.loop:
                    print_hot_loop(f"{key['op']}[{cfg}] {name}", sass, args.min_mma)
                    continue
                ops = opcode_histogram(instructions(sass))
                regs = [w for w in res.replace(",", " ").split() if w.startswith("REG:")]
                top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(10))
                print(f"{key['op']}[{cfg}] {name}: {regs[0] if regs else '?'} "
                      f"{sum(ops.values())} instructions; {top}")
    return 0


def print_hot_loop(name: str, sass: str, min_mma: int) -> None:
    found = hot_loop(instructions(sass), min_mma)
    if found is None:
        print(f"{name}: no loop holds {min_mma} wgmma instructions")
        return
    body, skipped = found
    ops = opcode_histogram(body)
    top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(16))
    print(f"{name}: loop {body[0][0]:#x}-{body[-1][0]:#x}, {len(body)} instructions; {top}")
    for first, end, count in skipped:
        print(f"    forward branch over {first:#x}-{end:#x}: {count} instructions")


if __name__ == "__main__":
    sys.exit(main())
