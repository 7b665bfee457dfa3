"""What a compiled artifact's embedded sm_90a cubin says about its kernels, read without a
GPU or CUDA tools: the exported library embeds the cubin as raw data (a CUDA ELF image,
e_machine 190), whose ``.nv.info`` sections hold each kernel's register counts."""
from __future__ import annotations

import struct
from pathlib import Path
from typing import Dict, Iterator, Tuple

from ..kernels.tiling import check_register_split

CUDA_ELF_MACHINE = 190
SHT_SYMTAB = 2
SYMBOL_SIZE = 24  # Elf64_Sym
EIFMT_NVAL, EIFMT_SVAL = 0x01, 0x04  # attribute formats: no value, a sized value
EIATTR_REGCOUNT, EIATTR_MAXREG_COUNT = 0x2F, 0x1B


def embedded_cubins(blob: bytes) -> Iterator[bytes]:
    """Every CUDA ELF image embedded in ``blob`` (an exported library's bytes)."""
    start = 1
    while (start := blob.find(b"\x7fELF", start)) >= 0:
        if struct.unpack_from("<H", blob, start + 18)[0] == CUDA_ELF_MACHINE:
            phoff, shoff = struct.unpack_from("<QQ", blob, start + 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", blob, start + 0x36)
            end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
            yield blob[start:start + end]
        start += 4


def _sections(cubin: bytes):
    """(name, type, offset, size, link) of every section."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQII", cubin, shoff + i * shentsize)
             for i in range(shnum)]
    names_at = heads[shstrndx][4]
    return [(_string(cubin, names_at + h[0]), h[1], h[4], h[5], h[6]) for h in heads]


def _string(blob: bytes, at: int) -> str:
    return blob[at:blob.index(b"\0", at)].decode()


def _attributes(cubin: bytes, offset: int, size: int):
    """(attribute, value bytes) of an .nv.info section: a format byte, an attribute byte,
    then no value (EIFMT_NVAL), a 16-bit one (EIFMT_HVAL, EIFMT_BVAL) or a sized one
    (EIFMT_SVAL: a 16-bit length, then the value)."""
    at = offset
    while at < offset + size:
        fmt, attr = cubin[at], cubin[at + 1]
        if fmt == EIFMT_SVAL:
            length, = struct.unpack_from("<H", cubin, at + 2)
            yield attr, cubin[at + 4:at + 4 + length]
            at += 4 + length
        elif fmt == EIFMT_NVAL:
            yield attr, b""
            at += 2
        else:
            yield attr, cubin[at + 2:at + 4]
            at += 4


def kernel_registers(cubin: bytes) -> Dict[str, Tuple[int, int]]:
    """Per kernel of a cubin, (registers it uses, the most it may use): EIATTR_REGCOUNT of
    the ``.nv.info`` section (what ``cuobjdump -res-usage`` prints as REG) and
    EIATTR_MAXREG_COUNT of its own ``.nv.info.<kernel>`` section. A kernel that moves
    registers with setmaxnreg is launched with the second (the attention backward uses
    137-160 registers but its warpgroups end at 24 + 240 + 240 = 3 x 168, its maximum)."""
    sections = _sections(cubin)
    symtab = next(s for s in sections if s[1] == SHT_SYMTAB)
    strings_at = sections[symtab[4]][2]

    def symbol(index: int) -> str:
        st_name, = struct.unpack_from("<I", cubin, symtab[2] + index * SYMBOL_SIZE)
        return _string(cubin, strings_at + st_name)

    used, most = {}, {}
    for name, _, offset, size, _ in sections:
        if name == ".nv.info":
            for attr, value in _attributes(cubin, offset, size):
                if attr == EIATTR_REGCOUNT:
                    index, count = struct.unpack_from("<II", value)
                    used[symbol(index)] = count
        elif name.startswith(".nv.info."):
            for attr, value in _attributes(cubin, offset, size):
                if attr == EIATTR_MAXREG_COUNT:
                    most[name[len(".nv.info."):]] = struct.unpack_from("<H", value)[0]
    return {k: (n, most.get(k, n)) for k, n in used.items()}


def check_compiled_split(kernel, library: Path) -> None:
    """A warp-specialized kernel's setmaxnreg split (its ``register_split``, from
    kernels.tiling.check_register_split) against the registers its compiled cubin in
    ``library`` is launched with (kernel_registers' maximum): a split asking for more would
    hang the kernel on the GPU, so the build fails here instead (ValueError). Kernels
    without a split pass."""
    split = getattr(kernel, "register_split", None)
    if split is None:
        return
    launched = [most for cubin in embedded_cubins(library.read_bytes())
                for _, most in kernel_registers(cubin).values()]
    if not launched:
        raise RuntimeError(f"{library.name}: no kernel register count in its cubin")
    threads, per_warpgroup = split
    check_register_split(type(kernel).__name__, threads, per_warpgroup,
                         registers=min(launched))
