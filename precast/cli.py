"""The ``precast`` command line (also ``python -m precast``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_PLAN = Path(__file__).parent / "plans" / "default.toml"


def _cmd_precompile(args) -> int:
    from .plan import expand, load_plan, precompile
    if args.op:
        config = json.loads(args.config or "{}")
        entries = expand({"name": args.op, **config})
    else:
        entries = load_plan(args.plan or DEFAULT_PLAN)
    results = precompile(entries, arch=args.arch, cache_dir=args.cache_dir, jobs=args.jobs)
    failed = [(e, r) for e, r in results if isinstance(r, Exception)]
    cache = args.cache_dir or str(_cache_root())
    print(f"built {len(results) - len(failed)} of {len(results)} kernels into {cache}")
    return 1 if failed else 0


def _cache_root():
    from .lifecycle.cache import default_cache_dir
    return default_cache_dir()


def _cmd_info(args) -> int:
    from .lifecycle.arch import device_arch, target_arch
    from .lifecycle.cache import ArtifactCache, dsl_available, versions
    try:
        target = target_arch(args.arch)
    except RuntimeError:
        target = "(none: no GPU and no PRECAST_ARCH)"
    print(f"GPU architecture : {device_arch() or 'no GPU visible'}")
    print(f"build target     : {target}")
    for name, version in versions().items():
        print(f"{name:17s}: {version or 'not installed'}")
    print(f"compiler present : {dsl_available()}")
    cache = ArtifactCache(args.cache_dir) if args.cache_dir else ArtifactCache()
    print(f"cache            : {cache.root}")
    count = 0
    for entry, manifest in cache.entries():
        key = manifest["key"]
        cfg = ", ".join(f"{k}={v}" for k, v in sorted(key["config"].items()))
        size = sum(p.stat().st_size for p in entry.glob("*.so"))
        print(f"  {key['op']}({cfg}) {key['arch']} dsl-{manifest['dsl_version']} "
              f"{size / 1024:.0f} KiB")
        count += 1
    print(f"{count} cached artifacts")
    return 0


def _cmd_quickstart(args) -> int:
    from .quickstart import run
    return run(plan=args.plan or DEFAULT_PLAN, arch=args.arch, jobs=args.jobs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="precast", description=__doc__)
    parser.add_argument("--cache-dir", help="artifact cache (default $PRECAST_CACHE_DIR or "
                        "~/.cache/precast)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("precompile", help="build every kernel of a plan file (TOML or JSON)")
    p.add_argument("plan", nargs="?", help=f"plan file (default {DEFAULT_PLAN.name})")
    p.add_argument("--op", help="one op instead of a plan, with --config JSON")
    p.add_argument("--config", help="static configuration as JSON (lists expand)")
    p.add_argument("--arch", help="target, e.g. sm_90a (default: $PRECAST_ARCH or the GPU)")
    p.add_argument("-j", "--jobs", type=int, help="parallel compile processes")
    p.set_defaults(func=_cmd_precompile)
    p = sub.add_parser("info", help="architecture, versions, cache location and artifacts")
    p.add_argument("--arch")
    p.set_defaults(func=_cmd_info)
    p = sub.add_parser("quickstart", help="precompile the default plan; on a GPU also check "
                       "and time the ops")
    p.add_argument("plan", nargs="?")
    p.add_argument("--arch")
    p.add_argument("-j", "--jobs", type=int)
    p.set_defaults(func=_cmd_quickstart)
    args = parser.parse_args(argv)
    if args.cache_dir:
        os.environ["PRECAST_CACHE_DIR"] = args.cache_dir
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
