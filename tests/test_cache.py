"""The artifact cache, cache keys, plan files and the CLI, on a CPU machine (cross-compiling
for sm_90a). Tests that run the compiler are marked ``compile``."""
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import shutil
import time
from pathlib import Path

import pytest

import precast.cli
from precast import ArtifactCache, ArtifactMissing, HstuLmsdBwdSm90, HstuLmsdFwdSm90, TensorDesc
from precast.lifecycle import cache as cache_mod
from precast.lifecycle import compiler
from precast.lifecycle import op as op_mod
from precast.lifecycle.cache import MANIFEST, default_cache, source_fingerprint
from precast.plan import PlanEntry, expand, load_plan

ARCH = "sm_90a"
try:
    DSL_VERSION = importlib.metadata.version("nvidia-cutlass-dsl")
except importlib.metadata.PackageNotFoundError:  # a GPU host that only runs artifacts
    pytest.skip("the cache tests key entries by the installed nvidia-cutlass-dsl",
                allow_module_level=True)
SMALL = dict(dim=64, dropout=False)


def small_fwd(**overrides):
    return HstuLmsdFwdSm90.from_config(**{**SMALL, **overrides})


def entry_dirs(root: Path):
    return sorted(p for p in Path(root).glob("*/*/dsl-*") if p.is_dir())


def leftovers(root: Path):
    root = Path(root)
    return sorted(list(root.rglob(".tmp-*")) + list(root.rglob(".trash-*")))


def count_exports(monkeypatch):
    """Wraps the exporter (build() imports it from the module at call time) to count builds."""
    calls = []
    real = compiler.export_shared_library

    def counting(jit_fn, args, out_path, symbol, arch):
        calls.append((Path(out_path).name, symbol, arch))
        return real(jit_fn, args, out_path, symbol, arch)
    monkeypatch.setattr(compiler, "export_shared_library", counting)
    return calls


def forbid_builds(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the compiler must not run: the artifact is cached")
    monkeypatch.setattr(compiler, "export_shared_library", refuse)


def without_compiler(monkeypatch):
    """What a GPU host without nvidia-cutlass-dsl reports: no DSL version."""
    real = cache_mod.versions

    def versions():
        return {**real(), "nvidia-cutlass-dsl": None}
    monkeypatch.setattr(cache_mod, "versions", versions)


@pytest.fixture(autouse=True)
def _arch(monkeypatch):
    monkeypatch.setenv("PRECAST_ARCH", ARCH)
    monkeypatch.delenv("PRECAST_DSL_VERSION", raising=False)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One real build of the small forward kernel, copied by each test that needs a warm cache."""
    root = tmp_path_factory.mktemp("pristine")
    start = time.perf_counter()
    op = small_fwd().check_support().compile(arch=ARCH, cache=ArtifactCache(root))
    assert op.is_compiled
    return root, op.cache_key(ARCH), time.perf_counter() - start


@pytest.fixture
def warm_root(pristine, tmp_path):
    root = tmp_path / "cache"
    shutil.copytree(pristine[0], root)
    return root


# --- miss -> build ---------------------------------------------------------------------------
@pytest.mark.compile
def test_miss_builds_entry_layout(pristine):
    root, key, _ = pristine
    assert key.dsl_version == DSL_VERSION
    (entry,) = entry_dirs(root)
    assert entry == root / "HstuLmsdFwdSm90" / key.family / f"dsl-{DSL_VERSION}"
    assert entry == ArtifactCache(root).entry_dir(key)
    manifest = json.loads((entry / MANIFEST).read_text())
    assert set(manifest["kernels"]) == {"fwd"}
    info = manifest["kernels"]["fwd"]
    so = entry / info["file"]
    assert so.name == "fwd.so" and so.stat().st_size > 0
    assert info["symbol"] == "precast_fwd"
    assert info["sha256"] == hashlib.sha256(so.read_bytes()).hexdigest()
    assert manifest["dsl_version"] == DSL_VERSION
    assert manifest["key"] == json.loads(json.dumps(key.family_fields()))
    assert manifest["key"]["config"]["dim"] == 64 and manifest["key"]["arch"] == ARCH
    assert leftovers(root) == []
    listed = list(ArtifactCache(root).entries())
    assert [e for e, _ in listed] == [entry]


@pytest.mark.compile
def test_hit_in_new_instance_loads_from_disk(warm_root, monkeypatch):
    forbid_builds(monkeypatch)
    before = {p: p.stat().st_mtime_ns for p in warm_root.rglob("*") if p.is_file()}
    start = time.perf_counter()
    op = small_fwd().check_support().compile(arch=ARCH, cache=ArtifactCache(warm_root))
    elapsed = time.perf_counter() - start
    assert op.is_compiled and callable(op._kernels["fwd"])
    assert elapsed < 30
    after = {p: p.stat().st_mtime_ns for p in warm_root.rglob("*") if p.is_file()}
    assert {p: t for p, t in after.items() if not p.name.endswith(".lock")} == \
        {p: t for p, t in before.items() if not p.name.endswith(".lock")}


@pytest.mark.compile
def test_in_process_hit_does_not_touch_disk(warm_root, monkeypatch):
    forbid_builds(monkeypatch)
    cache = ArtifactCache(warm_root)
    first = small_fwd().check_support().compile(arch=ARCH, cache=cache)

    def no_disk(*args, **kwargs):
        raise AssertionError("the in-process cache should have answered")
    monkeypatch.setattr(ArtifactCache, "lookup", no_disk)
    monkeypatch.setattr(ArtifactCache, "build", no_disk)
    # another op instance with the same static configuration, built from other sample shapes
    rows = TensorDesc("bf16", (7, 64), (72, 1))
    vec = TensorDesc("bf16", (64,))
    second = HstuLmsdFwdSm90(rows, rows, vec, vec)
    start = time.perf_counter()
    second.compile(arch=ARCH, cache=cache)
    assert time.perf_counter() - start < 1.0
    assert second._kernels is first._kernels
    # removing the files changes nothing for this process
    shutil.rmtree(warm_root)
    third = small_fwd().compile(arch=ARCH, cache=cache)
    assert third._kernels is first._kernels


# --- corrupt entries are rebuilt ----------------------------------------------------------------
def _flip_byte(entry):
    so = entry / "fwd.so"
    data = bytearray(so.read_bytes())
    data[len(data) // 2] ^= 0xFF
    so.write_bytes(bytes(data))


def _truncate(entry):
    so = entry / "fwd.so"
    so.write_bytes(so.read_bytes()[:100])


def _edit_manifest(change):
    def corrupt(entry):
        manifest = json.loads((entry / MANIFEST).read_text())
        change(manifest)
        (entry / MANIFEST).write_text(json.dumps(manifest))
    return corrupt


CORRUPTIONS = {
    "so-byte-flipped": _flip_byte,
    "so-truncated": _truncate,
    "so-missing": lambda entry: (entry / "fwd.so").unlink(),
    "manifest-garbled": lambda entry: (entry / MANIFEST).write_text("{\"kernels\": {"),
    "manifest-missing": lambda entry: (entry / MANIFEST).unlink(),
    "manifest-no-kernels": _edit_manifest(lambda m: m.update(kernels={})),
    "manifest-sha-changed": _edit_manifest(
        lambda m: m["kernels"]["fwd"].update(sha256="0" * 64)),
    # a valid entry whose kernel set no longer matches the op's builders
    "manifest-other-kernel-names": _edit_manifest(
        lambda m: m.update(kernels={"old_fwd": m["kernels"]["fwd"]})),
}


@pytest.mark.compile
@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_entry_is_rebuilt(warm_root, monkeypatch, corruption):
    (entry,) = entry_dirs(warm_root)
    CORRUPTIONS[corruption](entry)
    cache = ArtifactCache(warm_root)
    assert cache._load_entry(entry, ("fwd",)) is None  # really corrupt
    calls = count_exports(monkeypatch)
    op = small_fwd().check_support().compile(arch=ARCH, cache=cache)
    assert op.is_compiled
    assert calls == [("fwd.so", "precast_fwd", ARCH)]
    assert entry_dirs(warm_root) == [entry]
    manifest = cache._read_manifest(entry)
    assert manifest is not None and set(manifest["kernels"]) == {"fwd"}
    assert leftovers(warm_root) == []
    # and a fresh process view of the cache loads it without another build
    forbid_builds(monkeypatch)
    assert small_fwd().compile(arch=ARCH, cache=ArtifactCache(warm_root)).is_compiled


# --- concurrency ------------------------------------------------------------------------------
def _concurrent_worker(root, barrier, queue):
    """Runs in a spawned process: compile the same key as the sibling, at the same moment."""
    try:
        os.environ["PRECAST_ARCH"] = ARCH
        import cutlass.cute  # noqa: F401  (import the compiler before the race starts)
        from precast.lifecycle import compiler as comp
        calls = []
        real = comp.export_shared_library

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)
        comp.export_shared_library = counting
        op = small_fwd().check_support()
        barrier.wait(timeout=300)
        op.compile(arch=ARCH, cache=ArtifactCache(root))
        queue.put(("ok", len(calls), op.is_compiled))
    except BaseException as exc:  # report, never hang the parent
        queue.put(("error", repr(exc), False))


@pytest.mark.compile
def test_concurrent_compiles_of_one_key(tmp_path):
    root = tmp_path / "shared"
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(str(root), barrier, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    try:
        outcomes = [queue.get(timeout=420) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [o[0] for o in outcomes] == ["ok", "ok"], outcomes
    assert all(o[2] for o in outcomes)
    assert sum(o[1] for o in outcomes) == 1, outcomes  # exactly one process built it
    assert all(p.exitcode == 0 for p in procs)
    (entry,) = entry_dirs(root)
    assert ArtifactCache(root)._read_manifest(entry) is not None
    assert leftovers(root) == []


# --- a host without the compiler -------------------------------------------------------------------
@pytest.mark.compile
def test_no_compiler_loads_entry_by_family(warm_root, pristine, monkeypatch):
    without_compiler(monkeypatch)
    forbid_builds(monkeypatch)
    op = small_fwd().check_support()
    key = op.cache_key(ARCH)
    assert key.dsl_version is None
    assert key.family == pristine[1].family and key != pristine[1]
    cache = ArtifactCache(warm_root)
    assert cache._resolve_entry(key).name == f"dsl-{DSL_VERSION}"
    op.compile(arch=ARCH, cache=cache)
    assert op.is_compiled and callable(op._kernels["fwd"])


@pytest.mark.compile
def test_no_compiler_picks_newest_dsl_version(warm_root, monkeypatch):
    without_compiler(monkeypatch)
    forbid_builds(monkeypatch)
    (entry,) = entry_dirs(warm_root)
    for version in ("4.10.0", "4.9.2", "0.1"):  # numeric, not lexicographic, order
        shutil.copytree(entry, entry.parent / f"dsl-{version}")
    key = small_fwd().cache_key(ARCH)
    cache = ArtifactCache(warm_root)
    assert cache._resolve_entry(key).name == "dsl-4.10.0"
    monkeypatch.setenv("PRECAST_DSL_VERSION", DSL_VERSION)
    assert cache._resolve_entry(key) == entry
    assert small_fwd().compile(arch=ARCH, cache=cache).is_compiled
    monkeypatch.setenv("PRECAST_DSL_VERSION", "99.0")
    with pytest.raises(ArtifactMissing):
        small_fwd().compile(arch=ARCH, cache=ArtifactCache(warm_root))


@pytest.mark.compile
def test_no_compiler_corrupt_entry_is_missing(warm_root, monkeypatch):
    without_compiler(monkeypatch)
    forbid_builds(monkeypatch)
    (entry,) = entry_dirs(warm_root)
    _flip_byte(entry)
    with pytest.raises(ArtifactMissing, match="nvidia-cutlass-dsl is not installed"):
        small_fwd().compile(arch=ARCH, cache=ArtifactCache(warm_root))


def test_no_compiler_empty_cache_raises_artifact_missing(tmp_path, monkeypatch):
    without_compiler(monkeypatch)
    forbid_builds(monkeypatch)
    op = small_fwd(concat_u=True).check_support()
    with pytest.raises(ArtifactMissing) as info:
        op.compile(arch=ARCH, cache=ArtifactCache(tmp_path / "empty"))
    message = str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert "no precompiled kernel for HstuLmsdFwdSm90(" in message
    for fragment in ("apply_u_silu=True", "concat_u=True", "concat_x=False", "dim=64",
                     "dropout=False", "dtype=bfloat16"):
        assert fragment in message
    assert "for sm_90a" in message and "cutlass-dsl (not installed)" in message
    assert "precast precompile" in message
    assert "--op HstuLmsdFwdSm90" in message and '"concat_u": true' in message
    assert str(tmp_path / "empty") in message
    assert not op.is_compiled
    assert not (tmp_path / "empty").exists()  # nothing was created


# --- cache keys ----------------------------------------------------------------------------------
def test_key_is_independent_of_row_count_and_aliases():
    a = small_fwd().cache_key(ARCH)
    rows = TensorDesc("bf16", (3, 64), (128, 1))
    vec = TensorDesc("bfloat16", (64,))
    b = HstuLmsdFwdSm90(rows, rows, vec, vec).cache_key("90a")
    assert a == b and hash(a) == hash(b) and a.family == b.family
    assert a.op == "HstuLmsdFwdSm90" and a.arch == ARCH
    assert dict(a.config) == small_fwd().static_config()
    assert {k: v for k, v in a.config if k in ("dtype", "dim", "apply_u_silu", "concat_u",
                                               "concat_x", "dropout")} == {
        "dtype": "bfloat16", "dim": 64, "apply_u_silu": True, "concat_u": False,
        "concat_x": False, "dropout": False}
    # the dropout value itself is a runtime scalar: 0.1 and 0.7 share a kernel
    c = HstuLmsdFwdSm90(rows, rows, vec, vec, dropout_ratio=0.1).cache_key(ARCH)
    d = HstuLmsdFwdSm90(rows, rows, vec, vec, dropout_ratio=0.7, eps=1e-3).cache_key(ARCH)
    assert c == d and c != a


@pytest.mark.parametrize("change", [dict(dim=128), dict(dtype="float16"), dict(dropout=True),
                                    dict(apply_u_silu=False), dict(concat_u=True),
                                    dict(concat_x=True)])
def test_key_changes_with_static_config(change):
    base = small_fwd().cache_key(ARCH)
    other = small_fwd(**change).cache_key(ARCH)
    assert other != base and other.family != base.family
    cache = ArtifactCache("/nonexistent")
    assert cache.entry_dir(other) != cache.entry_dir(base)


def test_key_changes_with_op_arch_fingerprint_and_versions(monkeypatch):
    base = small_fwd().cache_key(ARCH)
    bwd = HstuLmsdBwdSm90.from_config(**SMALL, compute_dweight=True).cache_key(ARCH)
    assert bwd.op == "HstuLmsdBwdSm90" and bwd.family != base.family
    assert bwd.fingerprint != base.fingerprint  # different kernel sources
    other_arch = small_fwd().cache_key("sm_100a")
    assert other_arch.arch == "sm_100a" and other_arch.family != base.family
    # a newer DSL: same family (found by hosts without the compiler), different entry
    newer = dataclasses.replace(base, dsl_version="99.0")
    assert newer != base and newer.family == base.family
    cache = ArtifactCache("/nonexistent")
    assert cache.family_dir(newer) == cache.family_dir(base)
    assert cache.entry_dir(newer).name == "dsl-99.0"
    for field, value in [("precast_version", "9.9.9"), ("tvm_ffi_version", "0.0.1"),
                         ("fingerprint", "0" * 24)]:
        changed = dataclasses.replace(base, **{field: value})
        assert changed != base and changed.family != base.family, field
    seen = []
    monkeypatch.setattr(op_mod, "source_fingerprint", lambda mods: seen.append(mods) or "cafe" * 6)
    patched = small_fwd().cache_key(ARCH)
    assert patched.fingerprint == "cafe" * 6 and patched.family != base.family
    # the kernel sources and the op's own module (fake arguments, argument order)
    assert seen == [HstuLmsdFwdSm90.kernel_sources + (HstuLmsdFwdSm90.__module__,)]


def test_kernel_sources_cover_every_kernel_module_they_import():
    """A change to any precast.kernels module an op's kernels import (a layout shared with
    the host, a helper) must change the op's fingerprint: each op lists them all."""
    import ast
    from precast.plan import OP_REGISTRY, _load_ops
    _load_ops()
    for name, op in OP_REGISTRY.items():
        listed, todo, missing = set(op.kernel_sources), list(op.kernel_sources), set()
        while todo:
            spec = importlib.util.find_spec(todo.pop())
            for node in ast.walk(ast.parse(Path(spec.origin).read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import
                    dep = f"precast.kernels.{node.module}"
                    if dep not in listed:
                        missing.add(dep)
                        listed.add(dep)
                        todo.append(dep)
        assert not missing, f"{name}: kernel_sources lacks {sorted(missing)}"


def test_source_fingerprint_follows_file_contents(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "precast_fp_probe_a.py").write_text("X = 1\n")
    (tmp_path / "precast_fp_probe_b.py").write_text("Y = 1\n")
    importlib.invalidate_caches()
    mods = ("precast_fp_probe_a", "precast_fp_probe_b")
    first = source_fingerprint(mods)
    assert len(first) == 24 and int(first, 16) >= 0
    assert source_fingerprint(tuple(reversed(mods))) == first  # order does not matter
    assert source_fingerprint(mods[:1]) != first
    (tmp_path / "precast_fp_probe_b.py").write_text("Y = 2\n")
    assert source_fingerprint(mods) != first
    with pytest.raises(RuntimeError, match="kernel source module precast_fp_probe_missing not found"):
        source_fingerprint(("precast_fp_probe_missing",))


def test_key_describe_and_cache_dirs(tmp_path, monkeypatch):
    key = small_fwd().cache_key(ARCH)
    text = key.describe()
    assert text.startswith("HstuLmsdFwdSm90(apply_u_silu=True") and f"cutlass-dsl {DSL_VERSION}" in text
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "a"))
    first = default_cache()
    assert first.root == tmp_path / "a" and default_cache() is first
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path / "b"))
    assert default_cache().root == tmp_path / "b"
    monkeypatch.delenv("PRECAST_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_mod.default_cache_dir() == tmp_path / "xdg" / "precast"
    assert list(ArtifactCache(tmp_path / "does-not-exist").entries()) == []


# --- CLI -------------------------------------------------------------------------------------------
@pytest.mark.compile
def test_cli_info_lists_artifacts(warm_root, monkeypatch, capsys):
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(warm_root))  # main() sets it; restore afterwards
    assert precast.cli.main(["--cache-dir", str(warm_root), "info"]) == 0
    out = capsys.readouterr().out
    assert f"cache            : {warm_root}" in out
    assert "build target     : sm_90a" in out
    assert f"nvidia-cutlass-dsl: {DSL_VERSION}" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("  HstuLmsdFwdSm90(")]
    for fragment in ("apply_u_silu=True", "concat_u=False", "concat_x=False", "dim=64",
                     "dropout=False", "dtype=bfloat16"):
        assert fragment in line
    assert f") sm_90a dsl-{DSL_VERSION} " in line and line.endswith(" KiB")
    assert "1 cached artifacts" in out


def test_cli_info_empty_cache_and_no_target(tmp_path, monkeypatch, capsys):
    from precast.lifecycle import arch as arch_mod
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PRECAST_ARCH")
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr(arch_mod, "device_arch", lambda device_index=None: None)
    assert precast.cli.main(["--cache-dir", str(tmp_path / "none"), "info"]) == 0
    out = capsys.readouterr().out
    assert "(none: no GPU and no PRECAST_ARCH)" in out
    assert "GPU architecture : no GPU visible" in out
    assert "0 cached artifacts" in out


@pytest.mark.compile
def test_cli_precompile_op_config(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cli"
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(root))
    rc = precast.cli.main(["--cache-dir", str(root), "precompile", "--op", "HstuLmsdFwdSm90",
                           "--config", '{"dim": 64, "dropout": [true, false]}', "-j", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured
    assert f"built 2 of 2 kernels into {root}" in captured.out
    assert "precompiling 2 kernels for sm_90a with 2 processes" in captured.err
    listed = list(ArtifactCache(root).entries())
    assert len(listed) == 2
    assert sorted(m["key"]["config"]["dropout"] for _, m in listed) == [False, True]
    assert all(m["key"]["config"]["dim"] == 64 for _, m in listed)
    assert leftovers(root) == []


@pytest.mark.compile
def test_cli_precompile_reports_failures(tmp_path, monkeypatch, capsys):
    root = tmp_path / "cli"
    monkeypatch.setenv("PRECAST_CACHE_DIR", str(root))
    rc = precast.cli.main(["--cache-dir", str(root), "precompile", "--op", "HstuLmsdFwdSm90",
                           "--config", '{"dim": 60}', "--arch", "sm_90a", "-j", "1"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "built 0 of 1 kernels" in captured.out
    assert "FAILED" in captured.err and "D = 60 must be a multiple of 8" in captured.err


# --- plan files ------------------------------------------------------------------------------------
TOML_PLAN = """
[[op]]
name = "HstuLmsdFwdSm90"
dtype = ["bfloat16", "float16"]
dim = [256, 512]
dropout = true

[[op]]
name = "HstuLmsdBwdSm90"
dim = 64
compute_dweight = [true, false]
dropout = [true, false]

# a duplicate of one entry above: kept once
[[op]]
name = "HstuLmsdFwdSm90"
dtype = "float16"
dim = 512
dropout = true
"""


def test_load_plan_toml_expands_cartesian_product(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text(TOML_PLAN)
    entries = load_plan(path)
    assert len(entries) == 4 + 4
    fwd = [dict(e.config) for e in entries if e.op == "HstuLmsdFwdSm90"]
    assert sorted((c["dtype"], c["dim"]) for c in fwd) == [
        ("bfloat16", 256), ("bfloat16", 512), ("float16", 256), ("float16", 512)]
    assert all(c["dropout"] is True for c in fwd)
    bwd = [dict(e.config) for e in entries if e.op == "HstuLmsdBwdSm90"]
    assert sorted((c["compute_dweight"], c["dropout"]) for c in bwd) == [
        (False, False), (False, True), (True, False), (True, True)]
    assert all(e.config == tuple(sorted(e.config)) for e in entries)  # sorted pairs
    assert entries[0].describe().startswith("HstuLmsdFwdSm90(dim=256, dropout=True, dtype=")
    # every entry builds a checkable op
    for e in entries:
        precast.OP_REGISTRY[e.op].from_config(**dict(e.config)).check_support()


@pytest.mark.parametrize("wrap", [lambda tables: tables, lambda tables: {"op": tables}])
def test_load_plan_json(tmp_path, wrap):
    tables = [{"op": "HstuLmsdFwdSm90", "dim": [8, 16, 24], "concat_u": [True, False]},
              {"name": "HstuLmsdBwdSm90", "dim": 8}]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(wrap(tables)))
    entries = load_plan(path)
    assert len(entries) == 3 * 2 + 1
    assert PlanEntry("HstuLmsdBwdSm90", (("dim", 8),)) in entries
    assert PlanEntry("HstuLmsdFwdSm90", (("concat_u", True), ("dim", 16))) in entries


def test_plan_unknown_op_names_known_ops(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[[op]]\nname = "HstuLmsdFwdSm100"\ndim = 64\n')
    with pytest.raises(ValueError, match=r"unknown op 'HstuLmsdFwdSm100'; known ops: .*"
                                         r"'HstuLmsdBwdSm90', 'HstuLmsdFwdSm90'"):
        load_plan(path)
    with pytest.raises(ValueError, match="known ops"):
        expand({"name": "Nope"})


def test_plan_malformed(tmp_path):
    with pytest.raises(ValueError, match="has no op name"):
        expand({"dim": 64})
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"ops": []}))
    with pytest.raises(ValueError, match=r"expected \[\[op\]\] tables"):
        load_plan(path)


def test_default_plan_loads():
    entries = load_plan(precast.cli.DEFAULT_PLAN)
    assert len(entries) == len(set(entries)) == 68
    assert {e.op for e in entries} == {"HstuLmsdFwdSm90", "HstuLmsdBwdSm90", "HSTUFwdSm90",
                                       "HSTUBwdSm90", "GdnFwdSm90", "GdnBwdSm90"}
