"""Compile a CuTe DSL function for a named target and export it as a TVM-FFI shared library.

Imported only where nvidia-cutlass-dsl is installed.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def _link_flags():
    import cutlass
    import tvm_ffi.libinfo
    dsl_root = Path(cutlass.__file__).resolve().parents[2]
    runtime_dir = next((dsl_root / sub / "lib" for sub in ("cu13", "cu12")
                        if (dsl_root / sub / "lib" / "libcute_dsl_runtime.so").is_file()), None)
    if runtime_dir is None:
        raise RuntimeError(f"libcute_dsl_runtime.so not found under {dsl_root}: install "
                           "nvidia-cutlass-dsl[cu13]")
    tvm_dir = Path(tvm_ffi.libinfo.find_libtvm_ffi()).parent
    return [f"-L{runtime_dir}", "-lcute_dsl_runtime", f"-L{tvm_dir}", "-ltvm_ffi"]


def export_shared_library(jit_fn, args: tuple, out_path: Path, symbol: str, arch: str) -> None:
    """cute.compile(jit_fn, *args) for ``arch``, export the object, link ``out_path``."""
    import cutlass.cute as cute
    compiled = cute.compile(jit_fn, *args, options=f"--enable-tvm-ffi --gpu-arch {arch}")
    with tempfile.TemporaryDirectory(prefix="precast-link-") as tmp:
        obj = Path(tmp) / f"{symbol}.o"
        compiled.export_to_c(str(obj), function_name=symbol, export_only_tvm_ffi_symbols=True)
        cc = os.environ.get("CC", "gcc")
        cmd = [cc, "-shared", "-o", str(out_path), str(obj)] + _link_flags()
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"linking {out_path.name} failed ({' '.join(cmd)}):\n{result.stderr}")
