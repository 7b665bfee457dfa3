"""Which GPU architecture kernels are built for, with or without a GPU present."""
from __future__ import annotations

import os
import re
from typing import Optional

ENV_VARS = ("PRECAST_ARCH", "CUTE_DSL_ARCH")


def normalize_arch(arch: str) -> str:
    """'sm_90a', 'sm90a', '90a', '9.0' -> 'sm_90a' (SM90 kernels need the 'a' features)."""
    text = str(arch).strip().lower().replace("sm_", "").replace("sm", "")
    m = re.fullmatch(r"(\d+)\.?(\d)?([af]?)", text)
    if not m:
        raise ValueError(f"unrecognised architecture {arch!r}; expected e.g. 'sm_90a'")
    major_minor = m.group(1) + (m.group(2) or "")
    if len(major_minor) == 1:
        major_minor += "0"
    suffix = m.group(3) or ("a" if major_minor == "90" else "")
    return f"sm_{major_minor}{suffix}"


def device_arch(device_index: Optional[int] = None) -> Optional[str]:
    try:
        import torch
        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability(device_index)
    except Exception:
        return None
    return normalize_arch(f"{major}{minor}")


def target_arch(explicit: Optional[str] = None) -> str:
    """The build target: an explicit argument, else $PRECAST_ARCH / $CUTE_DSL_ARCH, else the
    current GPU. Raises when none is known (a CPU machine must name its target)."""
    if explicit:
        return normalize_arch(explicit)
    for var in ENV_VARS:
        if os.environ.get(var):
            return normalize_arch(os.environ[var])
    arch = device_arch()
    if arch is None:
        raise RuntimeError(
            "no GPU is visible and no target architecture was named: pass arch='sm_90a' or set "
            "PRECAST_ARCH=sm_90a (or CUTE_DSL_ARCH) to compile for Hopper on this machine")
    return arch
