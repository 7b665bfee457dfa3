"""Instruction mix of cached kernels (run where cuobjdump exists):
    python bench/sass_stats.py [OP_SUBSTRING]"""
import collections
import subprocess
import sys

from precast.lifecycle.cache import ArtifactCache

want = sys.argv[1] if len(sys.argv) > 1 else ""
for entry, manifest in ArtifactCache().entries():
    key = manifest["key"]
    if want not in key["op"]:
        continue
    cfg = ",".join(f"{k}={v}" for k, v in sorted(key["config"].items())
                   if k in ("dim", "vecs_per_thread", "min_ctas_per_sm", "dropout"))
    for name, info in manifest["kernels"].items():
        sass = subprocess.run(["cuobjdump", "-sass", str(entry / info["file"])],
                              capture_output=True, text=True).stdout
        ops = collections.Counter()
        for line in sass.splitlines():
            parts = line.split("*/")
            if len(parts) > 1 and parts[0].strip().startswith("/*") and len(parts[0].strip()) <= 8:
                body = parts[1].strip().split()
                if body:
                    op = body[0] if not body[0].startswith("@") else body[1]
                    ops[op.split(".")[0] + ("." + op.split(".")[1] if op.startswith("IMAD.WIDE") else "")] += 1
        top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(12))
        print(f"{key['op']}[{cfg}] {name}: {sum(ops.values())} instr; {top}")
