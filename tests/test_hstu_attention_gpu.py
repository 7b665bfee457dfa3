"""HSTU attention forward (HSTUFwdSm90) on the GPU, from precompiled artifacts.

Every kernel used here is one of the static configurations of tests/gpu_plan.toml (num_heads
4; num_kv_heads 4, or 2 / 1 for bf16 D in {64, 128} with full / causal windows; func masks
with window (-1, -1); paged KV causal with num_kv_heads 4 or 1). Outputs are poisoned with
NaN before every launch and compared against the fp32 reference of precast.reference
(computed on the GPU, TF32 off): max|o - ref| / max|ref| < TOL[dtype]; rows that see no key
must be exact zeros. Comparisons between two launches that compute the same math (strided
views vs copies, paged vs dense, GQA vs MHA on repeated heads, graph replay vs eager,
streams, torch.compile) are bitwise.
"""
import math
from dataclasses import dataclass, replace
from typing import List, Optional

import pytest
import torch
from conftest import streams_of_every_kind

from precast import HSTUFwdSm90, TensorDesc, hstu_attention_forward
from precast.reference.hstu_attention import (FUNC_PAD_COLUMNS, PAGE_SIZE, gather_paged_kv,
                                              hstu_attention_reference, random_func_tensor,
                                              visible_mask)
from precast.lifecycle.launch import SCHEDULER_COUNTER_SHAPE
from precast.reference.offsets import offsets_from_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_matmuls")]
DEV = "cuda"
BF, FP = torch.bfloat16, torch.float16
DTYPES = (BF, FP)
HEAD_DIMS = (32, 64, 128, 256)
H = 4  # query heads of every planned configuration
TOL = {BF: 2e-2, FP: 1e-2}  # max|o - ref| / max|ref|
# Ragged: 0- and 1-token sequences, max_seqlen_q (497) < max_seqlen_k (500), keys longer than
# queries by 0..300, lengths on and off the 128-row tile edges.
RAGGED_Q = [497, 16, 1, 480, 0, 253, 128, 129]
RAGGED_K = [lq + extra for lq, extra in zip(RAGGED_Q, [3, 200, 0, 17, 5, 1, 128, 300])]
EQUAL = [300] * 4
WINDOWS = [(-1, -1), (-1, 0), (256, 0), (7, 33), (0, 0), (64, -1), (-1, 5)]
_OPS = {}


# --- helpers --------------------------------------------------------------------------------------
def make_op(dtype, d, *, hkv=H, window=(-1, 0), func=0, paged=False) -> HSTUFwdSm90:
    """A compiled op built from descriptors (the kernel comes from the artifact cache, loaded
    once per process). Every execute here passes max_seqlen_q/k and alpha explicitly, so the
    descriptor batch only has to be valid."""
    batch, seqlen = 8, 128
    tokens = batch * seqlen
    cu = TensorDesc(torch.int32, (batch + 1,))
    q = TensorDesc(dtype, (tokens, H, d))
    f = TensorDesc(torch.int32, (1, func, tokens + FUNC_PAD_COLUMNS)) if func else None
    if paged:
        pages = tokens // PAGE_SIZE
        op = HSTUFwdSm90(q, None, None, None, cu, cu, seqlen, seqlen, window,
                         sample_paged_kv=TensorDesc(dtype, (pages, 2, PAGE_SIZE, hkv, d)),
                         sample_page_ids=TensorDesc(torch.int32, (pages,)),
                         sample_page_indptrs=cu)
    else:
        kv = TensorDesc(dtype, (tokens, hkv, d))
        op = HSTUFwdSm90(q, kv, kv, None, cu, cu, seqlen, seqlen, window, sample_func=f)
    return op.check_support().compile()


def get_op(dtype, d, *, hkv=H, window=(-1, 0), func=0, paged=False) -> HSTUFwdSm90:
    """make_op, one instance per (static configuration, window values) for the module."""
    key = (dtype, d, hkv, tuple(window), func, paged)
    op = _OPS.get(key)
    if op is None:
        op = _OPS[key] = make_op(dtype, d, hkv=hkv, window=window, func=func, paged=paged)
    return op


def cu_seqlens(lens: List[int]) -> torch.Tensor:
    return offsets_from_lengths(lens, device=DEV)


@dataclass
class Batch:
    lens_q: List[int]
    lens_k: List[int]
    q: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    func: Optional[torch.Tensor] = None
    paged_kv: Optional[torch.Tensor] = None
    page_ids: Optional[torch.Tensor] = None
    page_indptrs: Optional[torch.Tensor] = None

    @property
    def dtype(self):
        return self.q.dtype

    @property
    def d(self):
        return self.q.shape[-1]


def make_batch(lens_q, lens_k, d, dtype, *, hkv=H, seed=0, max_q=None, max_k=None) -> Batch:
    g = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEV, generator=g).to(dtype)
    t_q, t_k = sum(lens_q), sum(lens_k)
    return Batch(list(lens_q), list(lens_k), randn(t_q, H, d), randn(t_k, hkv, d),
                 randn(t_k, hkv, d), cu_seqlens(lens_q), cu_seqlens(lens_k),
                 max(lens_q, default=0) if max_q is None else max_q,
                 max(lens_k, default=0) if max_k is None else max_k)


def with_func(b: Batch, n: int, seed: int = 0, extra_columns: int = 0) -> Batch:
    """random_func_tensor: overlapping, unordered, often empty intervals; dead rows."""
    g = torch.Generator().manual_seed(seed)
    func = random_func_tensor(b.cu_q.cpu(), b.cu_k.cpu(), n, generator=g)
    if extra_columns:  # columns past T_q + 256 are never read: fill them with junk
        junk = torch.randint(0, 1 << 20, (1, n, extra_columns), generator=g, dtype=torch.int32)
        func = torch.cat([func, junk], dim=-1)
    return replace(b, func=func.to(DEV))


def with_pages(b: Batch, seed: int = 0, spare_pages: int = 5, junk=float("nan")) -> Batch:
    """b's k/v scattered into a page pool in random order. Some sequences own an extra page
    past the ones they need, the pool has pages nobody owns, and every slot that holds no
    key (tails of last pages, extra and spare pages) holds ``junk`` (NaN: what an
    uninitialized cache may hold; it must not reach the output through 0 * NaN)."""
    g = torch.Generator().manual_seed(seed)
    hkv, d = b.k.shape[1], b.k.shape[2]
    need = [-(-lk // PAGE_SIZE) for lk in b.lens_k]
    owned = [n + (i % 3 == 1) for i, n in enumerate(need)]
    total = sum(owned) + spare_pages
    order = torch.randperm(total, generator=g)
    page_ids = order[:sum(owned)].to(torch.int32)
    indptrs = [0]
    for n in owned:
        indptrs.append(indptrs[-1] + n)
    paged_kv = torch.full((total, 2, PAGE_SIZE, hkv, d), junk, dtype=b.dtype, device=DEV)
    pages, slots = [], []
    for i, lk in enumerate(b.lens_k):
        j = torch.arange(lk)
        pages.append(page_ids[indptrs[i] + j // PAGE_SIZE].long())
        slots.append(j % PAGE_SIZE)
    page, slot = torch.cat(pages).to(DEV), torch.cat(slots).to(DEV)
    paged_kv[page, 0, slot] = b.k
    paged_kv[page, 1, slot] = b.v
    out = replace(b, k=None, v=None, paged_kv=paged_kv, page_ids=page_ids.to(DEV),
                  page_indptrs=torch.tensor(indptrs, dtype=torch.int32, device=DEV))
    k, v = gather_paged_kv(out.paged_kv, out.page_ids, out.page_indptrs, out.cu_k)
    assert torch.equal(k, b.k) and torch.equal(v, b.v)  # the pages hold exactly b's keys
    return out


def poisoned(b: Batch) -> torch.Tensor:
    return torch.full(b.q.shape, float("nan"), dtype=b.dtype, device=DEV)


def launch(op, b: Batch, *, o=None, alpha=None, scaling_seqlen=None, stream=None,
           workspace=None, sync=True) -> torch.Tensor:
    """op.execute on b into o (a fresh NaN-poisoned buffer unless given)."""
    o = poisoned(b) if o is None else o
    op.execute(b.q, b.k, b.v, o, b.cu_q, b.cu_k, b.func, b.paged_kv, b.page_ids,
               b.page_indptrs, stream,
               alpha=1 / math.sqrt(b.d) if alpha is None else alpha,
               scaling_seqlen=scaling_seqlen, max_seqlen_q=b.max_q, max_seqlen_k=b.max_k,
               workspace=workspace)
    if sync:
        torch.cuda.synchronize()
    return o


def reference(b: Batch, window, *, alpha=None, scaling_seqlen=None) -> torch.Tensor:
    return hstu_attention_reference(
        b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k, scaling_seqlen=scaling_seqlen,
        window_size=window, alpha=1 / math.sqrt(b.d) if alpha is None else alpha,
        func_tensor=b.func, paged_kv=b.paged_kv, page_ids=b.page_ids,
        page_indptrs=b.page_indptrs, compute_dtype=torch.float32)


def dead_rows(b: Batch, window) -> torch.Tensor:
    """(T_q,) bool: packed query rows that see no key."""
    rows = [torch.zeros(0, dtype=torch.bool, device=DEV)]
    start = 0
    for lq, lk in zip(b.lens_q, b.lens_k):
        func = b.func[0, :, start:start + lq] if b.func is not None else None
        rows.append(~visible_mask(lq, lk, window, func, device=DEV).any(dim=1))
        start += lq
    return torch.cat(rows)


def rel_err(o, ref) -> float:
    return ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def check(o, b: Batch, window, *, alpha=None, scaling_seqlen=None, what=""):
    """o fully written, within TOL of the fp32 reference; rows with no key exactly zero."""
    assert not torch.isnan(o).any(), f"{what}: o not fully written (NaN left)"
    ref = reference(b, window, alpha=alpha, scaling_seqlen=scaling_seqlen)
    assert ref.abs().max().item() > 0, f"{what}: the reference is all zeros (a trivial test)"
    err = rel_err(o, ref)
    assert err < TOL[b.dtype], f"{what}: max|o - ref| / max|ref| = {err:.3g}"
    dead = dead_rows(b, window)
    if dead.any():
        assert torch.count_nonzero(o[dead]) == 0, f"{what}: a row with no visible key is not 0"
    return ref


# --- masks, head dims, dtypes ---------------------------------------------------------------------
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_window_masks(dtype, d, window):
    """Every window kind x D x dtype on a ragged batch (0/1-token sequences, max_seqlen_q <
    max_seqlen_k) and on equal lengths; scaling_seqlen by default (max_seqlen_q) and explicit."""
    op = get_op(dtype, d, window=window)
    b = make_batch(RAGGED_Q, RAGGED_K, d, dtype, seed=d)
    check(launch(op, b), b, window, what="ragged")
    check(launch(op, b, scaling_seqlen=123.5), b, window, scaling_seqlen=123.5,
          what="ragged, scaling_seqlen=123.5")
    e = make_batch(EQUAL, EQUAL, d, dtype, seed=d + 1)
    check(launch(op, e), e, window, what="equal lengths")


@pytest.mark.parametrize("window", [(-1, 0), (0, 0), (-1, 5), (64, -1), (-1, -1)],
                         ids=lambda w: f"w{w[0]}_{w[1]}")
def test_keys_shorter_than_queries(window):
    """Sequences with fewer keys than queries (negative bottom-right offset, len_k = 0):
    the rows that see no key are exact zeros."""
    op = get_op(BF, 128, window=window)
    b = make_batch([200, 3, 130, 64, 1], [40, 0, 300, 64, 0], 128, BF, seed=5)
    dead = dead_rows(b, window)
    assert dead.any()
    check(launch(op, b), b, window)


def test_many_sequences():
    """B = 100 (the scheduler scans sequences 32 at a time), lengths 0..300."""
    g = torch.Generator().manual_seed(3)
    lens_q = torch.randint(0, 301, (100,), generator=g)
    lens_q[::17] = 0
    lens_k = lens_q + torch.randint(0, 50, (100,), generator=g)
    b = make_batch(lens_q.tolist(), lens_k.tolist(), 64, BF, seed=3)
    for window in ((-1, 0), (-1, -1)):
        check(launch(get_op(BF, 64, window=window), b), b, window, what=str(window))


@pytest.mark.parametrize("window", [(-1, 0), (7, 33), (-1, 5)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_dense_batches_run_in_groups(window, monkeypatch):
    """Equal query lengths (T_q = B x max_seqlen_q) under right-bounded windows take the
    kernel's dense tile order (heaviest tiles of all sequences first, by groups of
    sequences): small groups (KV_GROUP_BYTES lowered) with a larger last one, keys longer
    than the queries and unequal; paged KV too (causal)."""
    import precast.lifecycle.hstu_attention as lifecycle
    lens_q = [640] * 7
    b = make_batch(lens_q, [640 + 37 * i for i in range(7)], 64, BF, seed=11)
    monkeypatch.setattr(lifecycle, "KV_GROUP_BYTES", 2 * (2 * b.max_k * H * 64 * 2))
    assert lifecycle.dense_seq_group(sum(lens_q), 7, b.max_q, b.max_k, H, 64, 2, True) == 2
    check(launch(get_op(BF, 64, window=window), b), b, window, what="dense")
    if window == (-1, 0):
        p = with_pages(b, seed=11)
        check(launch(get_op(BF, 64, paged=True), p), p, window, what="dense, paged")


def test_empty_batches_launch_nothing():
    op = get_op(BF, 64, window=(-1, 0))
    for lens in ([], [0, 0, 0]):
        b = make_batch(lens, lens, 64, BF)
        o = launch(op, b)
        assert o.shape[0] == 0


# --- arbitrary masks ------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_func_masks(dtype, d, n):
    """func_tensor with n = 1 and 3 bounds: overlapping, unordered, empty and out-of-range
    intervals; about 15% of the rows (and the last) see no key and must be exact zeros."""
    op = get_op(dtype, d, window=(-1, -1), func=n)
    b = with_func(make_batch(RAGGED_Q, RAGGED_K, d, dtype, seed=d), n, seed=d + n)
    assert dead_rows(b, (-1, -1)).any()
    check(launch(op, b), b, (-1, -1), what="ragged")
    e = with_func(make_batch(EQUAL, EQUAL, d, dtype, seed=d + 7), n, seed=d, extra_columns=40)
    check(launch(op, e, scaling_seqlen=1000.0), e, (-1, -1), scaling_seqlen=1000.0,
          what="equal lengths, wide func_tensor")


# --- paged KV -------------------------------------------------------------------------------------
@pytest.mark.parametrize("hkv", [4, 1])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_paged_kv(dtype, d, hkv):
    """Pages in random order with spare pages and junk in every unused slot: the paged
    output matches the reference and equals, bit for bit, the dense op on the gathered k/v
    (on the MHA op with the kv head repeated where the plan has no dense MQA kernel)."""
    dense_b = make_batch(RAGGED_Q, RAGGED_K, d, dtype, hkv=hkv, seed=d + hkv)
    b = with_pages(dense_b, seed=d)
    o = launch(get_op(dtype, d, hkv=hkv, paged=True), b)
    check(o, b, (-1, 0))
    k, v = gather_paged_kv(b.paged_kv, b.page_ids, b.page_indptrs, b.cu_k)
    if hkv != H:
        k, v = k.repeat_interleave(H // hkv, dim=1), v.repeat_interleave(H // hkv, dim=1)
    dense = launch(get_op(dtype, d, window=(-1, 0)), replace(dense_b, k=k, v=v))
    assert torch.equal(o, dense), "paged output differs from the dense op on the same k/v"
    if hkv != H and dtype == BF and d in (64, 128):  # the plan has this dense MQA kernel
        assert torch.equal(o, launch(get_op(dtype, d, hkv=hkv, window=(-1, 0)), dense_b))


@pytest.mark.parametrize("window", [(-1, 0), (-1, -1)], ids=["causal", "full"])
@pytest.mark.parametrize("d", [64, 256])
def test_nonfinite_values_of_other_sequences_do_not_leak(d, window):
    """A sequence's last key tile reaches into the next sequence's keys and values: NaN and
    Inf there must not reach this sequence's output (P is zero there, but 0 * NaN is NaN)."""
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=7)
    bad = 3  # its keys follow sequence 2's last (partial) key tile
    k0, k1 = int(b.cu_k[bad]), int(b.cu_k[bad + 1])
    assert k1 > k0
    k, v = b.k.clone(), b.v.clone()
    k[k0:k1], v[k0:k1] = float("inf"), float("nan")
    o = launch(get_op(BF, d, window=window), replace(b, k=k, v=v))
    ref = reference(b, window)
    q0, q1 = int(b.cu_q[bad]), int(b.cu_q[bad + 1])
    keep = torch.ones(o.shape[0], dtype=torch.bool, device=o.device)
    keep[q0:q1] = False
    assert not torch.isnan(o[keep]).any()
    assert rel_err(o[keep], ref[keep]) < TOL[BF]


# --- GQA / MQA ------------------------------------------------------------------------------------
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hkv", [2, 1])
def test_gqa_mqa(hkv, d, window):
    """num_kv_heads 2 and 1 match the reference and, bit for bit, the MHA kernel on the kv
    heads repeated (query head h reads kv head h // (H / H_kv))."""
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, hkv=hkv, seed=hkv + d)
    o = launch(get_op(BF, d, hkv=hkv, window=window), b)
    check(o, b, window)
    rep = H // hkv
    mha = replace(b, k=b.k.repeat_interleave(rep, dim=1), v=b.v.repeat_interleave(rep, dim=1))
    assert torch.equal(o, launch(get_op(BF, d, window=window), mha))


# --- layouts --------------------------------------------------------------------------------------
@pytest.mark.parametrize("hkv", [4, 2])
def test_strided_qkv_views_of_a_fused_projection(hkv):
    """q, k, v as views of one (T, ., D) projection buffer (token stride > H * D, last dim
    contiguous) give exactly the result of contiguous copies."""
    d, window = 128, (-1, 0)
    op = get_op(BF, d, hkv=hkv, window=window)
    b = make_batch(RAGGED_Q, RAGGED_Q, d, BF, hkv=hkv, seed=11)
    t = b.q.shape[0]
    g = torch.Generator(device=DEV).manual_seed(12)
    if hkv == H:  # (T, 3, H, D): q = buf[:, 0], k = buf[:, 1], v = buf[:, 2]
        fused = torch.randn(t, 3, H, d, device=DEV, generator=g).to(BF)
        q, k, v = fused[:, 0], fused[:, 1], fused[:, 2]
    else:  # (T, H + 2 H_kv, D): heads of q, then k, then v
        fused = torch.randn(t, H + 2 * hkv, d, device=DEV, generator=g).to(BF)
        q, k, v = fused[:, :H], fused[:, H:H + hkv], fused[:, H + hkv:]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    views = replace(b, q=q, k=k, v=v)
    copies = replace(b, q=q.contiguous(), k=k.contiguous(), v=v.contiguous())
    o = launch(op, views)
    check(o, views, window)
    assert torch.equal(o, launch(op, copies))


@pytest.mark.parametrize("layout", ["head_slice", "padded_head_dim"])
def test_strided_output_view_touches_nothing_outside(layout):
    """o a strided view of a larger NaN-poisoned buffer: the view is fully written (equal to
    a contiguous o) and every element outside it is still NaN."""
    d, window = 64, (7, 33)
    op = get_op(FP, d, window=window)
    b = make_batch(RAGGED_Q, RAGGED_K, d, FP, seed=21)
    t = b.q.shape[0]
    if layout == "head_slice":  # heads [4, 8) of a (T, 12, D) buffer
        big = torch.full((t, 3 * H, d), float("nan"), dtype=FP, device=DEV)
        region = (slice(None), slice(H, 2 * H))
    else:  # (T, H, D + 16), columns [8, 8 + D): token and head strides padded
        big = torch.full((t, H, d + 16), float("nan"), dtype=FP, device=DEV)
        region = (slice(None), slice(None), slice(8, 8 + d))
    o = big[region]
    assert not o.is_contiguous()
    launch(op, b, o=o)
    check(o, b, window)
    assert torch.equal(o, launch(op, b))
    outside = torch.ones(big.shape, dtype=torch.bool, device=DEV)
    outside[region] = False
    assert torch.isnan(big[outside]).all(), "the kernel wrote outside the o view"


def test_allocating_function_copies_unreadable_layouts():
    """hstu_attention_forward copies a q the kernel cannot read in place (head stride not a
    multiple of 8) and writes back into an unreadable o_tensor; a readable o view is
    written in place. Both equal the op's own result."""
    d, window = 64, (-1, -1)
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=31)
    expect = launch(get_op(BF, d, window=window), b)
    alpha = 1 / math.sqrt(d)
    t = b.q.shape[0]
    qbuf = torch.full((t, H, d + 4), float("nan"), dtype=BF, device=DEV)
    qbuf[..., :d] = b.q
    obuf = torch.full((t, H, d + 4), float("nan"), dtype=BF, device=DEV)
    out = hstu_attention_forward(qbuf[..., :d], b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                 None, window, alpha, o_tensor=obuf[..., :d])
    torch.cuda.synchronize()
    assert out.o_tensor.data_ptr() == obuf.data_ptr()
    assert torch.equal(obuf[..., :d], expect) and torch.isnan(obuf[..., d:]).all()
    obuf2 = torch.full((t, 2 * H, d), float("nan"), dtype=BF, device=DEV)
    (o,) = hstu_attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                  window_size=window, alpha=alpha, o_tensor=obuf2[:, H:])
    torch.cuda.synchronize()
    assert torch.equal(o, expect) and torch.isnan(obuf2[:, :H]).all()
    fresh = hstu_attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                   window_size=window, alpha=alpha).o_tensor
    torch.cuda.synchronize()
    assert torch.equal(fresh, expect)


# --- runtime values -------------------------------------------------------------------------------
def test_one_compile_serves_batches_alphas_and_scalings():
    """One compiled op: several batch compositions, alpha and scaling_seqlen changed at
    execute (never recompiled), max_seqlen values above the longest sequence."""
    d, window = 128, (256, 0)
    op = get_op(BF, d, window=window)
    kernels = op._kernels
    batches = [make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=41),
               make_batch(EQUAL, EQUAL, d, BF, seed=42),
               make_batch([1], [1], d, BF, seed=43),
               make_batch([1000, 77], [1100, 900], d, BF, seed=44),
               make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=45, max_q=600, max_k=700)]
    for i, b in enumerate(batches):
        for alpha, scaling in ((None, None), (-0.7 / math.sqrt(d), None), (2 / math.sqrt(d), 64.0),
                               (0.05, 3.0)):
            o = launch(op, b, alpha=alpha, scaling_seqlen=scaling)
            check(o, b, window, alpha=alpha, scaling_seqlen=scaling,
                  what=f"batch {i}, alpha {alpha}, scaling_seqlen {scaling}")
    assert op._kernels is kernels


def test_longest_first_order(monkeypatch):
    """Ragged batches run their sequences longest first: the order kernel writes the
    permutation after the counter (by key length, then query length, descending; ties in
    batch order), and the output is bitwise the batch order's (every tile is computed alone).
    Batches of more than ORDER_MAX_SEQUENCES sequences keep the batch order."""
    import precast.lifecycle.hstu_attention as lifecycle
    lens_q = [1, 700, 0, 130, 1500, 17, 700, 129, 2049, 128]
    lens_k = [1, 700, 0, 130, 1500, 17, 700, 300, 2049, 128]
    b = make_batch(lens_q, lens_k, 128, BF, seed=61)
    counter = SCHEDULER_COUNTER_SHAPE[0]
    for window in ((-1, 0), (-1, -1)):
        op = get_op(BF, 128, window=window)
        ws = torch.zeros(HSTUFwdSm90.workspace_shape(), dtype=torch.int32, device=DEV)
        o = launch(op, b, workspace=ws)
        check(o, b, window, what=f"longest first {window}")
        expected = sorted(range(len(lens_q)), key=lambda i: (-lens_k[i], -lens_q[i], i))
        assert ws[counter:counter + len(lens_q)].tolist() == expected
        assert torch.count_nonzero(ws[:counter]) == 0
        with monkeypatch.context() as m:
            m.setattr(lifecycle, "longest_first", lambda *args: False)
            o_batch_order = launch(op, b)
        assert torch.equal(o, o_batch_order)
    # past the order kernel's limit: batch order (and a correct result)
    many = [0, 1, 200] * 350
    mb = make_batch(many, many, 64, BF, seed=62)
    assert not lifecycle.longest_first(len(many), mb.max_q, 0)
    check(launch(get_op(BF, 64, window=(-1, 0)), mb), mb, (-1, 0), what="1050 sequences")


def test_workspace_is_left_zero():
    """A caller-owned scheduler workspace's counter is zero after every launch, so one buffer
    serves every launch on one stream (different ops included)."""
    counter = SCHEDULER_COUNTER_SHAPE[0]
    ws = torch.zeros(HSTUFwdSm90.workspace_shape(), dtype=torch.int32, device=DEV)
    cases = [(get_op(BF, 128, window=(-1, 0)), make_batch(RAGGED_Q, RAGGED_K, 128, BF, seed=51),
              (-1, 0)),
             (get_op(BF, 128, window=(-1, 0)), make_batch(EQUAL, EQUAL, 128, BF, seed=52), (-1, 0)),
             (get_op(FP, 64, window=(7, 33)), make_batch(RAGGED_Q, RAGGED_K, 64, FP, seed=53),
              (7, 33))]
    for op, b, window in cases * 2:
        o = launch(op, b, workspace=ws)
        assert torch.count_nonzero(ws[:counter]) == 0, f"counter left {ws[:counter].tolist()}"
        check(o, b, window)
    fb = with_func(make_batch(RAGGED_Q, RAGGED_K, 32, BF, seed=54), 3, seed=54)
    check(launch(get_op(BF, 32, window=(-1, -1), func=3), fb, workspace=ws), fb, (-1, -1))
    pb = with_pages(make_batch(RAGGED_Q, RAGGED_K, 256, FP, hkv=1, seed=55), seed=55)
    check(launch(get_op(FP, 256, hkv=1, paged=True), pb, workspace=ws), pb, (-1, 0))
    assert torch.count_nonzero(ws[:counter]) == 0


def test_two_ops_on_two_streams_concurrently():
    """Two ops, each with its own workspace, launched alternately on two streams without
    synchronizing in between; and one op on both streams with the workspaces it keeps per
    stream. Every output equals the serial result."""
    b1 = make_batch([1024] * 8, [1024] * 8, 128, BF, seed=61)
    b2 = make_batch(RAGGED_Q, RAGGED_K, 64, FP, seed=62)
    op1, op2 = get_op(BF, 128, window=(-1, 0)), get_op(FP, 64, window=(-1, -1))
    expect1, expect2 = launch(op1, b1), launch(op2, b2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ws1, ws2 = (torch.zeros(op1.workspace_shape(), dtype=torch.int32, device=DEV)
                for _ in range(2))
    rounds = 6
    outs1 = [poisoned(b1) for _ in range(rounds)]
    outs2 = [poisoned(b2) for _ in range(rounds)]
    outs3 = [poisoned(b1) for _ in range(2 * rounds)]
    torch.cuda.synchronize()
    for i in range(rounds):
        launch(op1, b1, o=outs1[i], stream=s1, workspace=ws1, sync=False)
        launch(op2, b2, o=outs2[i], stream=s2, workspace=ws2, sync=False)
    for i in range(rounds):
        launch(op1, b1, o=outs3[2 * i], stream=s1, sync=False)
        launch(op1, b1, o=outs3[2 * i + 1], stream=s2, sync=False)
    torch.cuda.synchronize()
    assert all(torch.equal(o, expect1) for o in outs1)
    assert all(torch.equal(o, expect2) for o in outs2)
    assert all(torch.equal(o, expect1) for o in outs3)
    counter = SCHEDULER_COUNTER_SHAPE[0]
    assert torch.count_nonzero(ws1[:counter]) == 0 and torch.count_nonzero(ws2[:counter]) == 0


def test_streams_of_every_kind():
    from cuda.bindings import driver
    from precast.graphs import check as cu_check
    window = (-1, 0)
    b = make_batch(RAGGED_Q, RAGGED_K, 64, FP, seed=71)
    op = get_op(FP, 64, window=window)
    expect = launch(op, b)
    check(expect, b, window)
    with streams_of_every_kind() as streams:
        for stream in streams:
            o = poisoned(b)
            torch.cuda.synchronize()
            launch(op, b, o=o, stream=stream, sync=False)
            fn = hstu_attention_forward(b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                        window_size=window, alpha=1 / math.sqrt(64),
                                        stream=stream).o_tensor
            cu_check(driver.cuCtxSynchronize())
            torch.cuda.synchronize()
            assert torch.equal(o, expect), type(stream).__name__
            assert torch.equal(fn, expect), type(stream).__name__
            del fn  # allocated in the order of a stream destroyed on exit


def test_cuda_graph_capture_and_replay():
    """execute() captured with a caller-provided workspace (a func-mask op and a local-window
    op on one workspace); replays after q and func_tensor change in place equal eager runs."""
    from precast.graphs import CudaGraph
    d = 128
    alpha = 1 / math.sqrt(d)
    b = with_func(make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=81), 3, seed=81)
    op_f = get_op(BF, d, window=(-1, -1), func=3)
    op_w = get_op(BF, d, window=(256, 0))
    bw = replace(b, func=None)
    o_f, o_w = poisoned(b), poisoned(b)
    ws = torch.zeros(op_f.workspace_shape(), dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    graph = CudaGraph()
    before = torch.cuda.memory_allocated()
    with graph.capture() as s:
        launch(op_f, b, o=o_f, alpha=alpha, stream=s, workspace=ws, sync=False)
        launch(op_w, bw, o=o_w, alpha=alpha, stream=s, workspace=ws, sync=False)
    assert torch.cuda.memory_allocated() == before, "capture allocated device memory"
    assert graph.num_nodes() == 4  # each op: its sequence order, then the forward
    assert torch.isnan(o_f).all(), "capture ran the kernel"
    g = torch.Generator(device=DEV).manual_seed(82)
    previous = None
    for step in range(3):
        if step == 1:  # q changes in place
            b.q.copy_(torch.randn(b.q.shape, device=DEV, generator=g).to(BF) * 1.5)
        if step == 2:  # the mask changes in place
            b.func.copy_(with_func(b, 3, seed=83).func)
        o_f.fill_(float("nan"))
        o_w.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        graph.synchronize()
        assert torch.count_nonzero(ws[:SCHEDULER_COUNTER_SHAPE[0]]) == 0
        assert torch.equal(o_f, launch(op_f, b)), f"step {step}: replay differs from eager"
        assert torch.equal(o_w, launch(op_w, bw)), f"step {step}: replay differs from eager"
        check(o_f, b, (-1, -1), what=f"replay step {step}")
        if previous is not None:
            assert not torch.equal(o_f, previous), f"step {step}: the in-place change was not seen"
        previous = o_f.clone()
    graph.close()


def test_torch_graph_capture_without_a_workspace():
    """torch.cuda.graph captures on a stream of its own, where the op has no counter yet: it
    takes one from the graph's memory pool, zeroed by the graph before every replay."""
    d = 128
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=95)
    op = get_op(BF, d, window=(-1, 0))
    o = poisoned(b)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(op, b, o=o, sync=False)
    for step in range(2):
        b.q.copy_(torch.randn_like(b.q) * (step + 1))
        o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, launch(op, b)), f"step {step}: replay differs from eager"
        check(o, b, (-1, 0), what=f"replay step {step}")


def test_capture_without_workspace_on_a_new_stream_is_refused():
    """The op cannot allocate its per-stream workspace during capture: it says so."""
    from precast.graphs import CudaGraph
    b = make_batch([64], [64], 64, BF, seed=91)
    op = make_op(BF, 64, window=(-1, 0))  # a fresh instance: no workspace for any stream yet
    torch.cuda.synchronize()
    graph = CudaGraph()
    with pytest.raises(RuntimeError, match="workspace"):
        with graph.capture() as s:
            launch(op, b, stream=s, sync=False)
    graph.close()
    check(launch(op, b), b, (-1, 0))  # the op still works


def test_torch_compile_traces_the_custom_op():
    """torch.compile(fullgraph=True) over torch.ops.precast.hstu_attention_fwd (window and
    func-mask forms) equals eager, which matches the reference."""
    d = 128
    alpha = 1 / math.sqrt(d)
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=101)
    fb = with_func(b, 1, seed=101)

    def step(q, k, v, cu_q, cu_k, func):
        local = torch.ops.precast.hstu_attention_fwd(q, k, v, cu_q, cu_k, b.max_q, b.max_k,
                                                     None, 7, 33, alpha, None, None, None, None)
        masked = torch.ops.precast.hstu_attention_fwd(q, k, v, cu_q, cu_k, b.max_q, b.max_k,
                                                      250.0, -1, -1, alpha, func, None, None,
                                                      None)
        return local, masked, local.float() * 2 + masked.float()

    args = (b.q, b.k, b.v, b.cu_q, b.cu_k, fb.func)
    eager = step(*args)
    torch.cuda.synchronize()
    check(eager[0], b, (7, 33))
    check(eager[1], fb, (-1, -1), scaling_seqlen=250.0)
    compiled = torch.compile(step, fullgraph=True)
    got = compiled(*args)
    torch.cuda.synchronize()
    for g_, e_ in zip(got, eager):
        assert torch.equal(g_, e_)
