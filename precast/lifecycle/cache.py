"""On-disk artifact cache of exported kernels, plus an in-process cache of loaded ones.

Layout: ``<root>/<op>/<family>/dsl-<version>/{manifest.json, <kernel>.so}`` where
``family`` hashes every key field except the DSL version, so that a GPU host without
the compiler (which cannot know the DSL version) still finds what a build host made.
Builds take a file lock and land by atomic rename; a corrupt entry is rebuilt.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Mapping, Optional, Tuple

from .launch import load_kernel

MANIFEST = "manifest.json"


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dsl_available() -> bool:
    return importlib.util.find_spec("cutlass") is not None and _version("nvidia-cutlass-dsl") is not None


def versions() -> Dict[str, Optional[str]]:
    from .. import __version__
    return {"precast": __version__, "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
            "apache-tvm-ffi": _version("apache-tvm-ffi")}


def default_cache_dir() -> Path:
    if os.environ.get("PRECAST_CACHE_DIR"):
        return Path(os.environ["PRECAST_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "precast"


def source_fingerprint(modules: Tuple[str, ...]) -> str:
    """sha256 over the source files of the given modules (kernel code and its helpers)."""
    digest = hashlib.sha256()
    for name in sorted(modules):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise RuntimeError(f"kernel source module {name} not found")
        digest.update(name.encode())
        digest.update(Path(spec.origin).read_bytes())
    return digest.hexdigest()[:24]


@dataclass(frozen=True)
class CacheKey:
    op: str
    config: Tuple[Tuple[str, object], ...]
    arch: str
    fingerprint: str
    precast_version: str
    tvm_ffi_version: Optional[str]
    dsl_version: Optional[str] = None  # unknown where the compiler is not installed

    @classmethod
    def make(cls, op: str, config: Mapping[str, object], arch: str, fingerprint: str):
        v = versions()
        return cls(op, tuple(sorted(config.items())), arch, fingerprint, v["precast"],
                   v["apache-tvm-ffi"], v["nvidia-cutlass-dsl"])

    def family_fields(self) -> dict:
        return {"op": self.op, "config": dict(self.config), "arch": self.arch,
                "fingerprint": self.fingerprint, "precast": self.precast_version,
                "apache-tvm-ffi": self.tvm_ffi_version}

    @property
    def family(self) -> str:
        blob = json.dumps(self.family_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def describe(self) -> str:
        cfg = ", ".join(f"{k}={v}" for k, v in self.config)
        return (f"{self.op}({cfg}) for {self.arch}, source {self.fingerprint}, precast "
                f"{self.precast_version}, tvm-ffi {self.tvm_ffi_version}, "
                f"cutlass-dsl {self.dsl_version or '(not installed)'}")


class ArtifactMissing(RuntimeError):
    """The compiler is absent and the cache holds no artifact for the key."""


KernelBuilder = Callable[[], Tuple[Callable, tuple]]  # returns (jit function, fake args)


class ArtifactCache:
    def __init__(self, root: Optional[os.PathLike] = None):
        self.root = Path(root).expanduser() if root is not None else default_cache_dir()
        self._loaded: Dict[CacheKey, Dict[str, Callable]] = {}
        self._lock = threading.Lock()

    # --- paths -----------------------------------------------------------------------
    def family_dir(self, key: CacheKey) -> Path:
        return self.root / key.op / key.family

    def entry_dir(self, key: CacheKey) -> Path:
        return self.family_dir(key) / f"dsl-{key.dsl_version}"

    def _resolve_entry(self, key: CacheKey) -> Optional[Path]:
        if key.dsl_version is not None:
            return self.entry_dir(key)
        family = self.family_dir(key)
        if not family.is_dir():
            return None
        entries = [p for p in family.iterdir() if p.is_dir() and p.name.startswith("dsl-")]
        wanted = os.environ.get("PRECAST_DSL_VERSION")
        if wanted:
            entries = [p for p in entries if p.name == f"dsl-{wanted}"]
        if not entries:
            return None

        def version_tuple(p: Path):
            return tuple(int(x) if x.isdigit() else 0 for x in p.name[4:].split("."))
        return max(entries, key=version_tuple)

    # --- reading ---------------------------------------------------------------------
    @staticmethod
    def _read_manifest(entry: Path) -> Optional[dict]:
        try:
            manifest = json.loads((entry / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        kernels = manifest.get("kernels")
        if not isinstance(kernels, dict) or not kernels:
            return None
        for info in kernels.values():
            path = entry / info.get("file", "")
            try:
                if hashlib.sha256(path.read_bytes()).hexdigest() != info.get("sha256"):
                    return None
            except OSError:
                return None
        return manifest

    def _load_entry(self, entry: Path, names: Tuple[str, ...]) -> Optional[Dict[str, Callable]]:
        manifest = self._read_manifest(entry)
        if manifest is None or set(manifest["kernels"]) != set(names):
            return None
        try:
            return {name: load_kernel(entry / info["file"], info["symbol"])
                    for name, info in manifest["kernels"].items()}
        except Exception:  # an unloadable library counts as corrupt
            return None

    def lookup(self, key: CacheKey, names: Tuple[str, ...]) -> Optional[Dict[str, Callable]]:
        entry = self._resolve_entry(key)
        return None if entry is None else self._load_entry(entry, names)

    # --- writing ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _file_lock(self, key: CacheKey):
        family = self.family_dir(key)
        family.mkdir(parents=True, exist_ok=True)
        with open(family / f"dsl-{key.dsl_version}.lock", "w") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def build(self, key: CacheKey, builders: Mapping[str, KernelBuilder]) -> Path:
        """Compiles, exports and links every kernel of ``builders`` into the entry of ``key``."""
        from .compiler import export_shared_library
        from .cubin import check_compiled_split
        with self._file_lock(key):
            entry = self.entry_dir(key)
            done = self._read_manifest(entry)
            if done is not None and set(done["kernels"]) == set(builders):
                return entry  # another process finished it while we waited
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.family_dir(key)))
            os.chmod(tmp, 0o755)  # a shared cache is readable by every user of the machine
            try:
                kernels = {}
                for name, builder in builders.items():
                    symbol = f"precast_{name}"
                    path = tmp / f"{name}.so"
                    jit_fn, args = builder()
                    export_shared_library(jit_fn, args, path, symbol, key.arch)
                    check_compiled_split(jit_fn, path)
                    kernels[name] = {"file": path.name, "symbol": symbol,
                                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
                manifest = {"key": key.family_fields(), "dsl_version": key.dsl_version,
                            "kernels": kernels, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
                (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, default=str))
                if entry.exists():  # corrupt leftovers: move aside, then replace atomically
                    trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=self.family_dir(key)))
                    os.rename(entry, trash / "old")
                    shutil.rmtree(trash, ignore_errors=True)
                os.rename(tmp, entry)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return entry

    # --- the one entry point ops use -------------------------------------------------
    def get(self, key: CacheKey, builders: Mapping[str, KernelBuilder],
            build_hint: str = "") -> Dict[str, Callable]:
        with self._lock:
            hit = self._loaded.get(key)
        if hit is not None:
            return hit
        names = tuple(builders)
        kernels = self.lookup(key, names)
        if kernels is None:
            if key.dsl_version is None:
                raise ArtifactMissing(
                    f"no precompiled kernel for {key.describe()} in {self.root} (family "
                    f"{key.family}) and nvidia-cutlass-dsl is not installed here to build it. "
                    f"Build it on any machine with the compiler, then copy the cache folder: "
                    f"{build_hint or 'python -m precast precompile PLAN'}")
            self.build(key, builders)
            kernels = self.lookup(key, names)
            if kernels is None:
                raise RuntimeError(f"artifact for {key.describe()} was built but cannot be loaded "
                                   f"from {self.entry_dir(key)}")
        with self._lock:
            self._loaded[key] = kernels
        return kernels

    def entries(self):
        """Yields (entry path, manifest) for every valid artifact under the root."""
        if not self.root.is_dir():
            return
        for manifest_path in sorted(self.root.glob(f"*/*/dsl-*/{MANIFEST}")):
            manifest = self._read_manifest(manifest_path.parent)
            if manifest is not None:
                yield manifest_path.parent, manifest


_default_cache: Optional[ArtifactCache] = None
_default_root: Optional[Path] = None


def default_cache() -> ArtifactCache:
    """The process-wide cache; follows $PRECAST_CACHE_DIR if it changes."""
    global _default_cache, _default_root
    root = default_cache_dir()
    if _default_cache is None or _default_root != root:
        _default_cache, _default_root = ArtifactCache(root), root
    return _default_cache
