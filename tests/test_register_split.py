"""setmaxnreg register splits are checked on the host (precast.kernels.tiling): a split that
asks for more registers than the launch allocated hangs the kernel on the GPU (run 38a of
bench/RESULTS.md), so it must fail when the kernel is built instead. Every kernel that
uses setmaxnreg calls the check in its constructor; tests/test_cross_compile.py builds
them all."""
import struct

import pytest

from precast.kernels.tiling import check_register_split, launch_registers


@pytest.mark.parametrize("threads, regs", [(256, 248), (384, 168), (512, 128), (576, 96),
                                           (640, 96), (768, 80)])
def test_launch_registers(threads, regs):
    assert launch_registers(threads) == regs


@pytest.mark.parametrize("threads, split", [
    (384, (24, 240, 240)),            # the attention kernels
    (384, (40, 232, 232)),            # the GDN recurrences
    (512, (24, 120, 184, 184)),       # the fused GDN forward
    (640, (32, 112, 112, 112, 112)),  # five warpgroups at 96 each, moved
])
def test_splits_within_the_launch_allocation(threads, split):
    check_register_split("kernel", threads, split)


def test_a_split_beyond_the_allocation_is_refused():
    # 40 x 128 + 112 x 512 = 62464 > 96 x 640 = 61440: setmaxnreg.inc would never return
    with pytest.raises(ValueError, match=r"need 62464 registers, the launch allocates 61440"):
        check_register_split("kernel", 640, (40, 112, 112, 112, 112))


@pytest.mark.parametrize("split", [(20, 240, 240), (24, 236, 240), (24, 240, 264)])
def test_counts_setmaxnreg_cannot_take(split):
    with pytest.raises(ValueError, match="multiples of 8"):
        check_register_split("kernel", 384, split)


def test_one_count_per_warpgroup():
    with pytest.raises(ValueError, match="3 warpgroup register counts for 512 threads"):
        check_register_split("kernel", 512, (24, 240, 240))


def test_a_split_beyond_the_compiled_launch_is_refused():
    # 256 threads: the register file's share is 248 a thread, but a kernel compiled to be
    # launched with 160 cannot end with 120 + 232
    assert check_register_split("kernel", 256, (120, 232)) == (256, (120, 232))
    with pytest.raises(ValueError, match=r"need 45056 registers, the compiled kernel is "
                                         r"launched with 160 registers a thread: the launch "
                                         r"allocates 40960"):
        check_register_split("kernel", 256, (120, 232), registers=160)
    # taken down to a multiple of 8, and never above the register file's share
    check_register_split("kernel", 384, (40, 232, 232), registers=168)
    with pytest.raises(ValueError, match="allocates 61440"):
        check_register_split("kernel", 384, (40, 232, 232), registers=167)
    check_register_split("kernel", 256, (160, 232), registers=255)


def synthetic_cubin(name: str, used: int, most: int) -> bytes:
    """A minimal CUDA ELF image: a symbol table naming one kernel, the .nv.info section
    with its EIATTR_REGCOUNT (after another attribute, as ptxas writes them) and its own
    .nv.info.<kernel> section with EIATTR_MAXREG_COUNT (after a value-less attribute)."""
    shstr = b"\0.shstrtab\0.strtab\0.symtab\0.nv.info\0.nv.info." + name.encode() + b"\0"
    strtab = b"\0" + name.encode() + b"\0"
    symtab = bytes(24) + struct.pack("<IBBHQQ", 1, 0x12, 0, 0, 0, 0)  # symbol 1: the kernel
    nv_info = (struct.pack("<BBHII", 0x04, 0x11, 8, 1, 0)
               + struct.pack("<BBHII", 0x04, 0x2F, 8, 1, used))
    own_info = struct.pack("<BB", 0x01, 0x54) + struct.pack("<BBH", 0x03, 0x1B, most)
    blobs = [shstr, strtab, symtab, nv_info, own_info]
    offsets, at = [], 64
    for blob in blobs:
        offsets.append(at)
        at += len(blob)
    header = bytearray(64)
    header[:4] = b"\x7fELF"
    struct.pack_into("<H", header, 18, 190)  # e_machine: CUDA
    struct.pack_into("<QQ", header, 0x20, 0, at)
    struct.pack_into("<HHHHH", header, 0x36, 56, 0, 64, 6, 1)  # shentsize, shnum, shstrndx

    def section(name_off, kind, k, link=0):
        return struct.pack("<IIQQQQIIQQ", name_off, kind, 0, 0, offsets[k], len(blobs[k]),
                           link, 0, 0, 0)
    sections = (bytes(64) + section(1, 3, 0) + section(11, 3, 1) + section(19, 2, 2, link=2)
                + section(27, 0x70000000, 3) + section(36, 0x70000000, 4))
    return bytes(header) + b"".join(blobs) + sections


def test_cubin_register_counts_are_read_without_cuda_tools(tmp_path):
    from precast.lifecycle.cubin import check_compiled_split, embedded_cubins, kernel_registers
    library = b"host code before" + synthetic_cubin("kernel_x", 150, 160) + b"and after"
    (image,) = embedded_cubins(library)
    assert kernel_registers(image) == {"kernel_x": (150, 160)}

    class Kernel:  # what a warp-specialized kernel records in its constructor
        register_split = (256, (120, 232))
    path = tmp_path / "k.so"
    path.write_bytes(library)
    with pytest.raises(ValueError, match="launched with 160 registers"):
        check_compiled_split(Kernel(), path)
    Kernel.register_split = (256, (40, 232))
    check_compiled_split(Kernel(), path)
    check_compiled_split(object(), path)  # no split: nothing to check
