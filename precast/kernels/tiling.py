"""How threads cover rows in the row-wise kernels, and how the warp-specialized kernels may
split their registers with setmaxnreg (pure Python: the host side sizes grids and
workspaces from it without importing the compiler)."""
from dataclasses import dataclass
from typing import Optional

VEC = 8  # elements of a 16-bit dtype in one 16-byte access
WARP = 32
WARPGROUP = 128  # threads
REGISTER_FILE = 65536  # 32-bit registers of an SM


def launch_registers(threads: int) -> int:
    """Registers per thread that ptxas gives a kernel of ``threads`` threads per CTA and
    one CTA per SM: the register file over the threads rounded up to whole warpgroups, down
    to a multiple of 8 (640 threads: 96; 384: 168; 512: 128), at most 248."""
    groups = -(-threads // WARPGROUP)
    return min(REGISTER_FILE // (groups * WARPGROUP) // 8 * 8, 248)


def check_register_split(kernel: str, threads: int, per_warpgroup,
                         registers: Optional[int] = None) -> tuple:
    """setmaxnreg only moves registers within the CTA's launch allocation: a split asking
    for more makes setmaxnreg.inc wait forever (a hung kernel, not an error).
    ``per_warpgroup``: the registers each of the CTA's warpgroups ends with, in order.
    ``registers``: what the compiled kernel is launched with per thread (its cubin's
    maximum register count, lifecycle.cubin.kernel_registers; taken down to a multiple of
    8), when known; before compiling, the most a CTA of ``threads`` threads can get,
    launch_registers(threads). The build checks the split again against the compiled
    kernel (lifecycle.cubin.check_compiled_split). Raises ValueError; returns (threads,
    per_warpgroup), the kernel's ``register_split``."""
    per_warpgroup = tuple(per_warpgroup)
    if len(per_warpgroup) * WARPGROUP != threads:
        raise ValueError(f"{kernel}: {len(per_warpgroup)} warpgroup register counts for "
                         f"{threads} threads")
    bad = [r for r in per_warpgroup if r % 8 or not 24 <= r <= 256]
    if bad:
        raise ValueError(f"{kernel}: setmaxnreg counts must be multiples of 8 in [24, 256], "
                         f"got {bad}")
    per_thread = (launch_registers(threads) if registers is None
                  else min(registers // 8 * 8, launch_registers(threads)))
    pool = per_thread * threads
    wanted = sum(per_warpgroup) * WARPGROUP
    if wanted > pool:
        source = ("the launch allocates" if registers is None
                  else f"the compiled kernel is launched with {registers} registers a thread: "
                       f"the launch allocates")
        raise ValueError(f"{kernel}: warpgroup registers {list(per_warpgroup)} need {wanted} "
                         f"registers, {source} {pool} ({per_thread} x {threads} threads)")
    return threads, per_warpgroup


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class RowTiling:
    """How threads cover rows for a given D (a multiple of VEC)."""

    dim: int
    vecs_per_thread_target: int
    min_threads: int = 128

    @property
    def num_vecs(self) -> int:
        return self.dim // VEC

    @property
    def threads_per_row(self) -> int:
        return _next_pow2(-(-self.num_vecs // self.vecs_per_thread_target))

    @property
    def vecs_per_thread(self) -> int:
        return -(-self.num_vecs // self.threads_per_row)

    @property
    def num_threads(self) -> int:
        return max(self.min_threads, self.threads_per_row)

    @property
    def rows_per_cta(self) -> int:
        return self.num_threads // self.threads_per_row

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // WARP)

    @property
    def even(self) -> bool:
        """Every thread's vectors are all inside the row (no column predicate)."""
        return self.num_vecs % self.threads_per_row == 0
