"""setmaxnreg register splits are checked on the host (precast.kernels.tiling): a split that
asks for more registers than the launch allocated hangs the kernel on the GPU (run 38a of
bench/RESULTS.md), so it must fail when the kernel is built instead. Every kernel that
uses setmaxnreg calls the check in its constructor; tests/test_cross_compile.py builds
them all."""
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
