"""A/B legs for device runs: each leg is a frozen tree of one git revision with its own
artifact cache, so a run on the GPU host can time several revisions side by side.

Here (builds; the CuTe DSL needed):

    python bench/ab.py build NAME REV [--plan tests/gpu_plan.toml] [--op CLASS ...] [--root .ab]

copies REV's precast/, bench/ and tests/ into ROOT/NAME (git archive) and precompiles the
plan's entries (only those of the --op classes, when given) for sm_90a into ROOT/c_NAME.
Never build from a tree that is being edited: the cache fingerprint reads the sources when
each entry compiles.

On the GPU host (after `source .gpuhost/prelude.sh`; carry ROOT and .gpuhost):

    python3 bench/ab.py run NAME [NAME ...] [--rounds 2] [--root .ab] -- COMMAND ...

runs COMMAND in each leg's tree with that leg first on PYTHONPATH (before the prelude's
entries, which tvm-ffi needs) and PRECAST_CACHE_DIR at its cache, legs interleaved round by
round (a sweep inside one process drifts by ~3 %: compare legs of the same round), each
output line prefixed by the leg's name. Exit status: the number of failed commands.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TREES = ("precast", "bench", "tests")


def build(name: str, rev: str, plan: Path, ops: list, root: Path, jobs: int) -> int:
    tree, cache = root / name, root / f"c_{name}"
    tree.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, *TREES],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    sys.path.insert(0, str(tree))  # the leg's plan loader (its op names)
    from precast.plan import load_plan
    entries = load_plan(plan)
    if ops:
        unknown = set(ops) - {e.op for e in entries}
        if unknown:
            raise SystemExit(f"{plan} has no entries of {sorted(unknown)}")
        entries = [e for e in entries if e.op in ops]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump({"op": [dict(e.config, name=e.op) for e in entries]}, fh)
    env = dict(os.environ, PYTHONPATH=str(tree), PRECAST_ARCH="sm_90a")
    print(f"{name}: {rev} -> {tree}, {len(entries)} entries -> {cache}", flush=True)
    try:
        return subprocess.run([sys.executable, "-m", "precast", "--cache-dir", str(cache),
                               "precompile", fh.name, "--arch", "sm_90a", "-j", str(jobs)],
                              cwd=tree, env=env).returncode
    finally:
        os.unlink(fh.name)


def run(names: list, command: list, rounds: int, root: Path) -> int:
    failed = 0
    for r in range(rounds):
        for name in names:
            tree = (root / name).resolve()
            inherited = os.environ.get("PYTHONPATH")
            env = dict(os.environ, PRECAST_CACHE_DIR=str((root / f"c_{name}").resolve()),
                       PYTHONPATH=str(tree) + (os.pathsep + inherited if inherited else ""))
            print(f"=== {name} round {r + 1}", flush=True)
            proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            for line in proc.stdout:
                print(f"{name}: {line}", end="", flush=True)
            failed += proc.wait() != 0
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build")
    b.add_argument("name")
    b.add_argument("rev")
    b.add_argument("--plan", type=Path, default=REPO / "tests" / "gpu_plan.toml")
    b.add_argument("--op", action="append", default=[])
    b.add_argument("--root", type=Path, default=REPO / ".ab")
    b.add_argument("-j", "--jobs", type=int, default=2)
    r = sub.add_parser("run")
    r.add_argument("names", nargs="+")
    r.add_argument("--rounds", type=int, default=2)
    r.add_argument("--root", type=Path, default=REPO / ".ab")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    command = argv[cut + 1:]
    if args.verb == "build":
        if command:
            ap.error("build takes no command")
        return build(args.name, args.rev, args.plan.resolve(), args.op, args.root.resolve(),
                     args.jobs)
    if not command:
        ap.error("run: give the command after --")
    return run(args.names, command, args.rounds, args.root)


if __name__ == "__main__":
    sys.exit(main())
