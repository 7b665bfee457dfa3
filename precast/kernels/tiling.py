"""How threads cover rows in the row-wise kernels (pure Python: the host side sizes
grids and workspaces from it without importing the compiler)."""
from dataclasses import dataclass

VEC = 8  # elements of a 16-bit dtype in one 16-byte access
WARP = 32


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
