"""Host-side validation rules of the Gated DeltaNet forward (GdnFwdSm90) and, in
check_gdn_gradients, of the tensors only its backward (GdnBwdSm90) adds.

Semantics, layouts and head grouping: precast/reference/gated_delta_net.py. Everything here
reads dtypes, shapes, strides, devices and addresses only, of torch tensors and TensorDescs
alike; no value in device memory (cu_seqlens, state_indices) is ever read, so a varlen batch
stays capturable in a CUDA graph. Values of cu_seqlens and state_indices are trusted: offsets
start at 0, never decrease and end at T; pool rows are distinct and inside the pool.

Choices where the issue is silent (each rule's message says what is accepted):

* initial_state (and a state pool) is float32 or the io dtype; final_state is float32 (the
  state is accumulated in fp32 and returned unrounded, as flash-linear-attention does).
* g and beta may have different dtypes; their token stride is free (a column slice of a
  fused projection) and their base needs only element alignment: per chunk a kernel reads
  64 scalars per head, which need no vector access. q, k, v, o and the states have 16-byte
  aligned rows and base.
* T is at most 2^31 - 1 (int32 token indices) even with int64 cu_seqlens; any tensor spans
  at most 2^39 elements (TMA takes global strides below 2^40 bytes).
* checkpoint_dtype is None (the io dtype), the io dtype itself or float32, and only together
  with checkpoint_every_n_tokens; a checkpoints buffer has exactly
  ``max_checkpoint_rows(T, N, n)`` rows (the bound, since the true count depends on
  cu_seqlens values).
* final_state / checkpoints buffers may be given only when they are asked for
  (output_final_state / checkpoint_every_n_tokens).
* state_indices is int32 only (the issue's type; the reference also takes int64).
* Outputs (o, final_state, checkpoints) alias nothing, not even initial_state: the in-place
  path is the state pool, which (read and written) may alias no other argument.
* Backward: do has o's layout; dfinal is float32 like the final state; each gradient has
  its input's shape and dtype (dinitial_state: the initial state's, required exactly when
  there is one); gradients alias nothing, as outputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..reference.gated_delta_net import CHUNK_SIZE
from .tensor_desc import TensorDesc, dtype_name
from .validation import (FLOAT32_MAX, INT32_MAX, check_bool, check_finite, check_int,
                         check_no_overlap, check_same_device, check_tensor, check_value)

__all__ = ["IO_DTYPES", "GATE_DTYPES", "CU_SEQLENS_DTYPES", "STATE_INDEX_DTYPES", "HEAD_DIMS",
           "FINAL_STATE_DTYPE", "MAX_SPAN", "GdnShapes", "check_gdn_inputs",
           "check_gdn_gradients", "max_checkpoint_rows"]

IO_DTYPES = (torch.bfloat16, torch.float16)  # q, k, v, o
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # g, beta
CU_SEQLENS_DTYPES = (torch.int32, torch.int64)
STATE_INDEX_DTYPES = (torch.int32,)
HEAD_DIMS = (64, 128)  # K and V
FINAL_STATE_DTYPE = torch.float32
ROW_BYTES = 16  # q/k/v/o/state rows start 16-byte aligned (vector and TMA access)
DATA_ALIGN = 16  # base address (bytes) of q, k, v, o and the states
MAX_SPAN = 2**39  # elements: TMA takes global strides below 2^40 bytes


@dataclass(frozen=True)
class GdnShapes:
    """One validated call: extents, dtypes and resolved options.

    Output head h reads q head ``h // q_group``, k head ``h // k_group`` and v head
    ``h // v_group`` (HO = max(HQ, HV)).
    """

    T: int  # packed tokens
    N: int  # sequences (cu_seqlens has N + 1 entries)
    HQ: int
    HK: int
    HV: int
    HO: int
    K: int
    V: int
    dtype: torch.dtype  # q, k, v and o
    g_dtype: torch.dtype
    beta_dtype: torch.dtype
    cu_seqlens_dtype: torch.dtype
    scale: float  # resolved: 1 / sqrt(K) when not given
    state_dtype: Optional[torch.dtype]  # initial_state's (or the pool's); None: zeros
    pool_rows: Optional[int]  # N_pool with state_indices, else None
    output_final_state: bool
    use_qk_l2norm_in_kernel: bool
    checkpoint_every_n_tokens: Optional[int]
    checkpoint_dtype: Optional[torch.dtype]  # resolved: the io dtype or float32; None: off
    checkpoint_rows: Optional[int]  # max_checkpoint_rows(T, N, n); None: off
    batch_invariant: bool

    @property
    def q_group(self) -> int:
        return self.HO // self.HQ

    @property
    def k_group(self) -> int:
        return self.HO // self.HK

    @property
    def v_group(self) -> int:
        return self.HO // self.HV

    @property
    def state_shape(self) -> Tuple[int, int, int, int]:
        """[N, HO, V, K]: initial_state and final_state (V-major, K contiguous)."""
        return (self.N, self.HO, self.V, self.K)

    @property
    def uses_pool(self) -> bool:
        return self.pool_rows is not None


def max_checkpoint_rows(T: int, N: int, n: int) -> int:
    """Rows of the checkpoint series for any N sequences of T tokens in all, one row for
    every local position 0, n, 2n, ... strictly before each sequence's end: a sequence of
    L tokens has ceil(L / n) <= L // n + 1 rows (0 when L = 0), so at most T // n + N, a
    bound reached whenever the remainders L mod n are all nonzero and add up to < n."""
    T = check_int("T", T, lo=0)
    N = check_int("N", N, lo=0)
    n = check_int("checkpoint_every_n_tokens", n, lo=1)
    return T // n + N


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _tensor(name: str, t, what: str, *, dtypes, rank: int, row_multiple: int = 1,
            align: int = DATA_ALIGN, contiguous: bool = False,
            device: str = "cuda") -> Tuple[int, ...]:
    """Presence and type, then check_tensor's rules with every extent free; returns the
    shape. ``what`` is the expected layout, for the messages."""
    check_value(t is not None, ValueError, f"{name} is required: {what}")
    check_value(isinstance(t, (torch.Tensor, TensorDesc)), TypeError,
                f"{name}: expected a torch.Tensor or TensorDesc {what}, got {type(t).__name__}")
    return tuple(check_tensor(name, t, dtypes=dtypes, shape=(None,) * rank,
                              row_multiple=row_multiple, align=align, contiguous=contiguous,
                              device=device, max_span=MAX_SPAN))


def _itemsize(t) -> int:
    """Element size in bytes (1 for anything else: _tensor then refuses it)."""
    return t.dtype.itemsize if isinstance(t, (torch.Tensor, TensorDesc)) else 1


def _row_multiple(t) -> int:
    """Elements per 16 bytes: outer strides in these units keep every row 16-byte aligned."""
    return max(1, ROW_BYTES // _itemsize(t))


def _same_shape(name: str, got, layout: str, want) -> None:
    check_value(tuple(got) == tuple(want), ValueError,
                f"{name}: shape {list(got)} does not match {layout} = {_shape_str(want)}")


def _tokens(name: str, t, dtypes, what: str, T: Optional[int], device: str) -> Tuple[int, ...]:
    """q, k, v, o: [T, heads, dim], rows 16-byte aligned (token and head strides free)."""
    shape = _tensor(name, t, what, dtypes=dtypes, rank=3, row_multiple=_row_multiple(t),
                    device=device)
    if T is not None:
        check_value(shape[0] == T, ValueError, f"{name}: has {shape[0]} tokens but q has {T}")
    return shape


def _state(name: str, t, dtypes, expected, layout: str, device: str) -> Tuple[int, ...]:
    """States [rows, HO, V, K]: K contiguous, rows 16-byte aligned; other strides free."""
    shape = _tensor(name, t, f"{layout} = {_shape_str(expected)}", dtypes=dtypes, rank=4,
                    row_multiple=_row_multiple(t), device=device)
    check_value(all(e is None or s == e for s, e in zip(shape, expected)), ValueError,
                f"{name}: shape {list(shape)} does not match {layout} = {_shape_str(expected)} "
                "(states are V-major: K contiguous)")
    return shape


def _dtype_option(value, io: torch.dtype) -> torch.dtype:
    check_value(isinstance(value, torch.dtype), TypeError,
                f"checkpoint_dtype must be None, torch.float32 or the io dtype "
                f"{dtype_name(io)}, got {type(value).__name__}")
    check_value(value in (io, torch.float32), TypeError,
                f"checkpoint_dtype: {dtype_name(value)} is not supported; expected None (the io "
                f"dtype {dtype_name(io)}), {dtype_name(io)} or float32")
    return value


def check_gdn_inputs(q, k, v, g, beta, cu_seqlens, *, scale=None, initial_state=None,
                     output_final_state=False, use_qk_l2norm_in_kernel=False,
                     checkpoint_every_n_tokens=None, checkpoint_dtype=None, state_indices=None,
                     batch_invariant=False, o=None, final_state=None, checkpoints=None,
                     device: str = "cuda") -> GdnShapes:
    """Every rule of a Gated DeltaNet forward call that needs no device memory.

    Tensors are torch tensors or TensorDescs, on the ``device`` type the kernels run on
    ("cuda"; a CPU test passes "cpu") or meta, all on one device. ``o``,
    ``final_state`` and ``checkpoints`` are optional output buffers; ``initial_state`` with
    ``state_indices`` is the state pool, read and written in place. Raises ValueError for
    values and shapes, TypeError for dtypes and types, NotImplementedError for valid but
    unsupported configurations (head dims); returns the call's :class:`GdnShapes`.
    """
    # --- q, k, v ------------------------------------------------------------------------------
    T, HQ, K = _tokens("q", q, IO_DTYPES, "[T, HQ, K] bfloat16 or float16", None, device)
    io = q.dtype
    check_value(T <= INT32_MAX, ValueError,
                f"q: T = {T} tokens exceed 2^31 - 1 (token indices are int32)")
    check_value(HQ >= 1, ValueError, f"q: needs at least one head (HQ >= 1), got shape "
                f"{[T, HQ, K]}")
    check_value(K in HEAD_DIMS, NotImplementedError,
                f"q: head dim K = {K} is not supported; expected 64 or 128")
    _, HK, Kk = _tokens("k", k, IO_DTYPES, f"[T, HK, K] {dtype_name(io)}", T, device)
    _, HV, V = _tokens("v", v, IO_DTYPES, f"[T, HV, V] {dtype_name(io)}", T, device)
    for name, t in (("k", k), ("v", v)):
        check_value(t.dtype == io, TypeError,
                    f"{name}: dtype {dtype_name(t.dtype)} differs from q's {dtype_name(io)}; q, k "
                    "and v must have one dtype (bfloat16 or float16)")
    check_value(Kk == K, ValueError, f"k: head dim {Kk} differs from q's K = {K}")
    check_value(HK >= 1, ValueError, "k: needs at least one head (HK >= 1)")
    check_value(HV >= 1, ValueError, "v: needs at least one head (HV >= 1)")
    check_value(V in HEAD_DIMS, NotImplementedError,
                f"v: head dim V = {V} is not supported; expected 64 or 128")
    HO = max(HQ, HV)
    check_value(HO % min(HQ, HV) == 0, ValueError,
                f"v: HV = {HV} heads and q's HQ = {HQ}: HQ and HV must be equal or one a "
                "multiple of the other")
    check_value(HK in (HQ, HV), ValueError,
                f"k: HK = {HK} heads; expected HQ = {HQ} or HV = {HV}")

    # --- gates and offsets --------------------------------------------------------------------
    for name, t in (("g", g), ("beta", beta)):
        shape = _tensor(name, t, "[T, HO] float32, bfloat16 or float16", dtypes=GATE_DTYPES,
                        rank=2, align=_itemsize(t), device=device)
        check_value(shape[0] == T, ValueError, f"{name}: has {shape[0]} tokens but q has {T}")
        check_value(shape[1] == HO, ValueError,
                    f"{name}: has {shape[1]} heads; expected HO = max(HQ, HV) = {HO}")
    (entries,) = _tensor("cu_seqlens", cu_seqlens, "[N + 1] int32 or int64",
                         dtypes=CU_SEQLENS_DTYPES, rank=1, align=_itemsize(cu_seqlens),
                         contiguous=True, device=device)
    check_value(entries >= 1, ValueError,
                "cu_seqlens: needs N + 1 >= 1 entries (the offsets start at 0), got 0")
    N = entries - 1

    # --- scalar options -----------------------------------------------------------------------
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    else:
        scale = check_finite("scale", scale, positive=True)
        check_value(scale <= FLOAT32_MAX, ValueError,
                    f"scale = {scale} overflows float32 (the kernels' scalar type); expected a "
                    f"finite value in (0, {FLOAT32_MAX:.4g}]")
        check_value(float(np.float32(scale)) > 0, ValueError,
                    f"scale = {scale} rounds to 0 in float32 (the kernels' scalar type); "
                    "expected at least about 1.4e-45")
    output_final_state = check_bool("output_final_state", output_final_state)
    use_qk_l2norm_in_kernel = check_bool("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    batch_invariant = check_bool("batch_invariant", batch_invariant)

    n = ckpt_dtype = rows = None
    if checkpoint_every_n_tokens is not None:
        n = check_int("checkpoint_every_n_tokens", checkpoint_every_n_tokens, lo=1,
                      hi=INT32_MAX)
        check_value(n % CHUNK_SIZE == 0, ValueError,
                    f"checkpoint_every_n_tokens = {n} must be a positive multiple of the chunk "
                    f"size {CHUNK_SIZE}")
        ckpt_dtype = io if checkpoint_dtype is None else _dtype_option(checkpoint_dtype, io)
        rows = max_checkpoint_rows(T, N, n)
    else:
        check_value(checkpoint_dtype is None, ValueError,
                    "checkpoint_dtype is given but checkpoint_every_n_tokens is None: no "
                    "checkpoints are written (pass both, or neither)")
        check_value(checkpoints is None, ValueError,
                    "checkpoints is given but checkpoint_every_n_tokens is None: pass n (a "
                    f"positive multiple of {CHUNK_SIZE}) with the buffer, or no buffer")

    # --- states -------------------------------------------------------------------------------
    state_dtypes = (torch.float32, io)
    state_dtype = pool_rows = None
    if state_indices is not None:
        check_value(n is None, ValueError,
                    "state_indices and checkpoint_every_n_tokens are mutually exclusive (the "
                    "state pool is forward only; checkpoints are for the backward)")
        check_value(initial_state is not None, ValueError,
                    "state_indices requires initial_state: the state pool [N_pool, HO, V, K]")
        _tensor("state_indices", state_indices, f"[N] = [{N}] int32", dtypes=STATE_INDEX_DTYPES,
                rank=1, align=4, contiguous=True, device=device)
        _same_shape("state_indices", state_indices.shape, "[N]", (N,))
        pool_rows = _state("initial_state", initial_state, state_dtypes, (None, HO, V, K),
                           "the state pool [N_pool, HO, V, K]", device)[0]
        check_value(pool_rows >= N, ValueError,
                    f"initial_state: the state pool has {pool_rows} rows but the {N} sequences "
                    f"need distinct rows; expected [N_pool >= N = {N}, HO, V, K]")
        state_dtype = initial_state.dtype
    elif initial_state is not None:
        _state("initial_state", initial_state, state_dtypes, (N, HO, V, K), "[N, HO, V, K]",
               device)
        state_dtype = initial_state.dtype

    # --- output buffers -----------------------------------------------------------------------
    if o is not None:
        shape = _tokens("o", o, (io,), f"[T, HO, V] {dtype_name(io)}", None, device)
        _same_shape("o", shape, "[T, HO, V]", (T, HO, V))
    if final_state is not None:
        check_value(output_final_state, ValueError,
                    "final_state is given but output_final_state is False: pass "
                    "output_final_state=True with the buffer, or no buffer")
        _state("final_state", final_state, (FINAL_STATE_DTYPE,), (N, HO, V, K),
               "[N, HO, V, K]", device)
    if checkpoints is not None:
        _state("checkpoints", checkpoints, (ckpt_dtype,), (rows, HO, V, K),
               f"[T // n + N, HO, V, K] (n = {n})", device)

    # --- relations ----------------------------------------------------------------------------
    pool = initial_state if state_indices is not None else None
    named = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_seqlens,
                 initial_state=initial_state, state_indices=state_indices, o=o,
                 final_state=final_state, checkpoints=checkpoints)
    check_same_device([(key, t) for key, t in named.items() if t is not None])
    # The pool is read and written in place: it may alias no other argument, like an output.
    written = ("o", "final_state", "checkpoints") + (("initial_state",) if pool is not None
                                                     else ())
    check_no_overlap([(key, named[key]) for key in written],
                     [(key, t) for key, t in named.items() if key not in written])

    return GdnShapes(T=T, N=N, HQ=HQ, HK=HK, HV=HV, HO=HO, K=K, V=V, dtype=io,
                     g_dtype=g.dtype, beta_dtype=beta.dtype, cu_seqlens_dtype=cu_seqlens.dtype,
                     scale=float(scale), state_dtype=state_dtype, pool_rows=pool_rows,
                     output_final_state=output_final_state,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                     checkpoint_every_n_tokens=n, checkpoint_dtype=ckpt_dtype,
                     checkpoint_rows=rows, batch_invariant=batch_invariant)


def check_gdn_gradients(s: GdnShapes, inputs, *, do, dfinal=None, gradients=None,
                        device: str = "cuda") -> None:
    """The backward's own tensors, for a call whose forward inputs check_gdn_inputs gave
    ``s``; ``inputs`` names those inputs (q, k, v, g, beta, cu_seqlens, initial_state,
    checkpoints; None where absent). Read: ``do`` [T, HO, V] in the io dtype and ``dfinal``
    [N, HO, V, K] float32 (optional). ``gradients`` names the written tensors dq, dk, dv,
    dg, dbeta and dinitial_state (None: not checked, as for an op's samples): each has its
    input's shape and dtype, dinitial_state exactly when there is an initial state, and
    none may alias anything. Raises as check_gdn_inputs does."""
    io, T, HO = s.dtype, s.T, s.HO
    shape = _tokens("do", do, (io,), f"[T, HO, V] {dtype_name(io)}", None, device)
    _same_shape("do", shape, "[T, HO, V]", (T, HO, s.V))
    if dfinal is not None:
        _state("dfinal", dfinal, (FINAL_STATE_DTYPE,), s.state_shape, "[N, HO, V, K]", device)
    read = {**{key: t for key, t in inputs.items() if t is not None}, "do": do}
    if dfinal is not None:
        read["dfinal"] = dfinal
    if gradients is None:
        check_same_device(list(read.items()))
        return
    for name, layout, want in (("dq", "[T, HQ, K]", (T, s.HQ, s.K)),
                               ("dk", "[T, HK, K]", (T, s.HK, s.K)),
                               ("dv", "[T, HV, V]", (T, s.HV, s.V))):
        shape = _tokens(name, gradients[name], (io,), f"{layout} {dtype_name(io)} (its input's)",
                        None, device)
        _same_shape(name, shape, layout, want)
    for name, dtype in (("dg", s.g_dtype), ("dbeta", s.beta_dtype)):
        t = gradients[name]
        shape = _tensor(name, t, f"[T, HO] {dtype_name(dtype)} (its input's)", dtypes=(dtype,),
                        rank=2, align=_itemsize(t), device=device)
        _same_shape(name, shape, "[T, HO]", (T, HO))
    if s.state_dtype is None:
        check_value(gradients["dinitial_state"] is None, ValueError,
                    "dinitial_state is given but there is no initial_state to differentiate")
    else:
        check_value(gradients["dinitial_state"] is not None, ValueError,
                    "dinitial_state is required with an initial_state: its gradient, "
                    f"[N, HO, V, K] {dtype_name(s.state_dtype)} (initial_state's dtype)")
        _state("dinitial_state", gradients["dinitial_state"], (s.state_dtype,), s.state_shape,
               "[N, HO, V, K]", device)
    written = [(key, t) for key, t in gradients.items() if t is not None]
    check_same_device(list(read.items()) + written)
    check_no_overlap(written, list(read.items()))
