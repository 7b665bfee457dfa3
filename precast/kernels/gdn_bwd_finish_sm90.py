"""Gated DeltaNet backward, last step: the per-output-head gradients of q, k and v become
the gradients of the raw inputs (SIMT, memory bound).

For each of q, k, v whose input heads serve more than two output heads (not
gdn_layout.gradients_in_place: the chunk kernel writes or adds the others into the final
gradients itself) the chunk kernel writes dq_heads, dk_heads (T, HO, K) or
dv_heads (T, HO, V) in the io dtype, one row per output head, w.r.t. the rows it used: the
L2-normalized q
and k when the forward normalized them in the kernel. Per token and input head this kernel

* sums the rows of the head's group of output heads (output head h reads q head
  h // (HO // HQ), likewise k and v) in a fixed order, so results are bitwise reproducible;
* for q and k with the L2 norm, applies its Jacobian to that sum s with the raw row x:
  dx = r s - r^3 (x . s) x, r = rsqrt(max(|x|^2, 1e-24)); only r s where the clamp is
  active (r is then a constant; precast/reference/gdn_backward.py, _l2norm_backward);
* writes the result in the io dtype, strided like the input.

Grid: (ceil(T / tokens_per_cta), grouped gradients): blockIdx.y picks one of them. A
row of D elements is D / 8 threads of one warp, 8 elements each (16-byte io accesses, two
one 16-byte load per summed row, summed in fp32); row dot products are shuffles within
those threads.
"""
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .gdn_layout import gradients_in_place
from .rowwise import vector_copy_atom
from .tiling import VEC

THREADS = 128
L2NORM_EPS = 1e-24  # the forward's clamp of |x|^2 (reference L2NORM_EPS)
ITEMS_PER_CTA = 1024  # thread-items (8 elements each) of the largest role per CTA


class Role(NamedTuple):
    """One of q, k, v: its input heads, row length, output heads per input head and
    whether the L2 norm's Jacobian applies."""
    heads: int
    dim: int
    group: int
    normalized: bool

    @property
    def threads_per_row(self) -> int:
        return self.dim // VEC


class GdnGradFinishSm90:
    def __init__(self, dtype, k_dim: int, v_dim: int, q_heads: int, k_heads: int,
                 v_heads: int, l2norm: bool):
        assert k_dim in (64, 128) and v_dim in (64, 128)
        heads = max(q_heads, v_heads)
        self.dtype = dtype
        roles = (Role(q_heads, k_dim, heads // q_heads, l2norm),
                 Role(k_heads, k_dim, heads // k_heads, l2norm),
                 Role(v_heads, v_dim, heads // v_heads, False))
        # (index into (q, k, v), role) of the gradients left to finish
        self.roles = tuple((i, role) for i, (role, final) in enumerate(
            zip(roles, gradients_in_place(q_heads, k_heads, v_heads))) if not final)
        assert self.roles, "no groups of more than two heads: the chunk kernel writes every gradient"
        # Enough tokens per CTA that the largest role fills ~ITEMS_PER_CTA thread-items
        # (small head counts would otherwise leave most threads idle), a power of two.
        widest = max(r.heads * r.threads_per_row for _, r in self.roles)
        self.tokens_per_cta = 1 << max(0, (ITEMS_PER_CTA // widest).bit_length() - 1)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mDQh: cute.Tensor,
                 mDKh: cute.Tensor, mDVh: cute.Tensor, mDQ: cute.Tensor, mDK: cute.Tensor,
                 mDV: cute.Tensor, stream: cuda.CUstream):
        """mQ (T, HQ, K), mK (T, HK, K) raw rows; mDQh, mDKh (T, HO, K), mDVh (T, HO, V)
        per output head; mDQ (T, HQ, K), mDK (T, HK, K), mDV (T, HV, V) written; all in the
        io dtype. T >= 1. The per-head buffer of a gradient the chunk kernel writes final is
        None."""
        tokens = mQ.shape[0]
        grid_x = (tokens + self.tokens_per_cta - 1) // self.tokens_per_cta
        self.kernel(mQ, mK, mDQh, mDKh, mDVh, mDQ, mDK, mDV).launch(
            grid=[grid_x, len(self.roles), 1], block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mDQh: cute.Tensor, mDKh: cute.Tensor,
               mDVh: cute.Tensor, mDQ: cute.Tensor, mDK: cute.Tensor, mDV: cute.Tensor):
        _, slot, _ = cute.arch.block_idx()
        # v's mX is unused (no Jacobian)
        tensors = ((mQ, mDQh, mDQ), (mK, mDKh, mDK), (mDV, mDVh, mDV))
        for j in cutlass.range_constexpr(len(self.roles)):
            which, role = self.roles[j]
            if slot == j:
                self.finish_rows(role, *tensors[which])

    @cute.jit
    def finish_rows(self, role: cutlass.Constexpr, mX: cute.Tensor, mHeads: cute.Tensor,
                    mOut: cute.Tensor):
        """This CTA's tokens x role.heads rows; thread-item i covers row i // tpr, elements
        8 (i % tpr) .. 8 (i % tpr) + 7. Rows past the tokens load token 0 (in bounds) so
        that every lane joins the shuffles, and store nothing."""
        tpr = const_expr(role.threads_per_row)
        rows = const_expr(self.tokens_per_cta * role.heads)
        items = const_expr(-(-rows * tpr // THREADS))
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        num_tokens = mHeads.shape[0]
        io_atom = vector_copy_atom(self.dtype, VEC)
        for it in cutlass.range_constexpr(items):
            item = it * THREADS + tidx
            row = item // tpr
            lane = item % tpr
            token = bidx * self.tokens_per_cta + row // role.heads
            head = row % role.heads
            row_ok = row < rows and token < num_tokens
            token_c = token if row_ok else Int32(0)

            total = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
            total.fill(0.0)
            part = cute.make_rmem_tensor(cute.make_layout((VEC,)), self.dtype)
            for j in cutlass.range_constexpr(role.group):  # fixed order: deterministic
                src = mHeads[token_c, head * role.group + j, None]
                cute.copy(io_atom, cute.local_tile(src, (VEC,), (lane,)), part)
                total.store(total.load() + part.load().to(Float32))

            out = cute.make_rmem_tensor(cute.make_layout((VEC,)), self.dtype)
            if const_expr(role.normalized):
                raw = cute.make_rmem_tensor(cute.make_layout((VEC,)), self.dtype)
                cute.copy(io_atom, cute.local_tile(mX[token_c, head, None], (VEC,), (lane,)),
                          raw)
                x = cute.make_rmem_tensor(cute.make_layout((VEC,)), Float32)
                x.store(raw.load().to(Float32))
                sq = Float32(0.0)
                dot = Float32(0.0)
                for e in cutlass.range_constexpr(VEC):
                    sq = sq + x[e] * x[e]
                    dot = dot + x[e] * total[e]
                sq = cute.arch.warp_reduction(sq, lambda a, b: a + b, threads_in_group=tpr)
                dot = cute.arch.warp_reduction(dot, lambda a, b: a + b, threads_in_group=tpr)
                clamped = sq < Float32(L2NORM_EPS)
                r = cute.math.rsqrt(Float32(L2NORM_EPS) if clamped else sq)
                # the projection term vanishes where the clamp holds r constant
                proj = Float32(0.0) if clamped else r * r * r * dot
                for e in cutlass.range_constexpr(VEC):
                    out[e] = (r * total[e] - proj * x[e]).to(self.dtype)
            else:
                for e in cutlass.range_constexpr(VEC):
                    out[e] = total[e].to(self.dtype)
            if row_ok:
                cute.copy(io_atom, out,
                          cute.local_tile(mOut[token_c, head, None], (VEC,), (lane,)))
