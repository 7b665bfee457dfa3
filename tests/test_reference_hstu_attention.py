"""CPU tests of the HSTU attention reference (the oracle of the GPU kernels)."""


import pytest
import torch
import torch.nn.functional as F

from precast.reference.hstu_attention import (
    BACKWARD_FLOPS_FACTOR,
    FUNC_PAD_COLUMNS,
    PAGE_SIZE,
    attention_flops,
    gather_paged_kv,
    hstu_attention_backward_reference,
    hstu_attention_naive,
    hstu_attention_reference,
    random_func_tensor,
    visible_mask,
    visible_pairs,
)
from precast.reference.offsets import offsets_from_lengths

F64, F32, I32 = torch.float64, torch.float32, torch.int32
WINDOWS = [(-1, -1), (-1, 0), (3, 0), (2, 5), (0, 0)]

# Tiny ragged batch: empty and 1-token sequences, len_q < len_k, one len_q > len_k and
# one sequence with queries but no keys.
LENS_Q = [0, 1, 5, 3, 0, 4, 2, 2]
LENS_K = [0, 1, 5, 7, 3, 2, 6, 0]


def cu(lens):
    return offsets_from_lengths(lens, dtype=I32)


def make_qkv(lens_q, lens_k, H, H_kv, D, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), H, D, generator=g, dtype=dtype)
    k = torch.randn(sum(lens_k), H_kv, D, generator=g, dtype=dtype)
    v = torch.randn(sum(lens_k), H_kv, D, generator=g, dtype=dtype)
    return q, k, v


def args(lens_q=LENS_Q, lens_k=LENS_K):
    return cu(lens_q), cu(lens_k), max(lens_q, default=0), max(lens_k, default=0)


def ref64(q, k, v, *a, **kw):
    return hstu_attention_reference(q, k, v, *a, compute_dtype=F64, **kw)


def func_rows(func, cq, b):
    return func[0, :, int(cq[b]):int(cq[b + 1])]


# ---------------------------------------------------------------------------
# Reference vs naive
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("H,H_kv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("D", [8, 16])
@pytest.mark.parametrize("alpha,scaling", [(1.0, None), (0.37, 3.5)])
def test_reference_matches_naive(window, H, H_kv, D, alpha, scaling):
    q, k, v = make_qkv(LENS_Q, LENS_K, H, H_kv, D, seed=H_kv * 100 + D)
    kw = dict(window_size=window, alpha=alpha, scaling_seqlen=scaling)
    o = ref64(q, k, v, *args(), **kw)
    n = hstu_attention_naive(q, k, v, *args(), **kw)
    assert o.dtype == F64 and o.shape == q.shape
    torch.testing.assert_close(o, n, atol=1e-10, rtol=0)
    # The last sequence has queries but no keys: exact zeros.
    assert torch.all(o[-LENS_Q[-1]:] == 0)


def test_default_scaling_is_max_seqlen_q():
    q, k, v = make_qkv(LENS_Q, LENS_K, 2, 1, 8)
    cq, ck, mq, mk = args()
    o = ref64(q, k, v, cq, ck, mq, mk)
    torch.testing.assert_close(o, ref64(q, k, v, cq, ck, mq, mk, scaling_seqlen=mq), atol=0, rtol=0)
    # A larger max_seqlen_q (still an upper bound) changes only the scale.
    o2 = ref64(q, k, v, cq, ck, mq + 3, mk + 3)
    torch.testing.assert_close(o2 * (mq + 3), o * mq, atol=1e-12, rtol=1e-12)


def test_float32_and_low_precision_inputs():
    q, k, v = make_qkv(LENS_Q, LENS_K, 4, 2, 16)
    o64 = ref64(q, k, v, *args())
    qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
    o32 = hstu_attention_reference(qb, kb, vb, *args())
    assert o32.dtype == F32  # returns the compute dtype
    o64b = ref64(qb, kb, vb, *args())
    torch.testing.assert_close(o32.double(), o64b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o64b, o64, atol=0.05, rtol=0.05)


def test_gqa_equals_repeated_kv_heads():
    H, H_kv = 4, 2
    q, k, v = make_qkv(LENS_Q, LENS_K, H, H_kv, 8)
    rep = H // H_kv
    o = ref64(q, k, v, *args(), window_size=(2, 5))
    o_mha = ref64(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), *args(),
                  window_size=(2, 5))
    torch.testing.assert_close(o, o_mha, atol=1e-12, rtol=0)


def test_single_head_matches_dense_matrix_formula():
    # One sequence, no ragged packing: O = (M * silu(alpha Q K^T)) V / scaling.
    lq, lk, D = 6, 9, 8
    q, k, v = make_qkv([lq], [lk], 1, 1, D)
    alpha, scaling = 0.5, 7.0
    s = alpha * q[:, 0] @ k[:, 0].T
    m = torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq)
    want = ((F.silu(s) * m) @ v[:, 0] / scaling)[:, None]
    got = ref64(q, k, v, *args([lq], [lk]), alpha=alpha, scaling_seqlen=scaling)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_empty_batch_and_empty_sequences():
    q, k, v = make_qkv([], [], 2, 1, 8)
    o = ref64(q, k, v, cu([]), cu([]), 0, 0)
    assert o.shape == (0, 2, 8)
    q, k, v = make_qkv([0, 0], [0, 3], 2, 1, 8)
    o = ref64(q, k, v, cu([0, 0]), cu([0, 3]), 0, 3, window_size=(-1, -1))
    assert o.shape == (0, 2, 8)


def test_rows_without_keys_are_zero():
    # len_q > len_k under causal: the first len_q - len_k queries see nothing.
    q, k, v = make_qkv([5, 2], [2, 0], 2, 2, 8)
    o = ref64(q, k, v, cu([5, 2]), cu([2, 0]), 5, 5)
    assert torch.all(o[:3] == 0) and torch.all(o[5:] == 0)
    assert torch.all(o[3:5].abs().sum(-1) > 0)


# ---------------------------------------------------------------------------
# Arbitrary (func) masks
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_func_matches_naive(n, seed):
    q, k, v = make_qkv(LENS_Q, LENS_K, 4, 2, 8, seed=seed + 10)
    cq, ck, mq, mk = args()
    func = random_func_tensor(cq, ck, n, generator=torch.Generator().manual_seed(seed))
    kw = dict(window_size=(-1, -1), func_tensor=func, alpha=0.8, scaling_seqlen=4.0)
    o = ref64(q, k, v, cq, ck, mq, mk, **kw)
    torch.testing.assert_close(o, hstu_attention_naive(q, k, v, cq, ck, mq, mk, **kw),
                               atol=1e-10, rtol=0)
    # Rows with no valid key output exactly zero (the last packed row always is one).
    for b in range(len(LENS_Q)):
        m = visible_mask(LENS_Q[b], LENS_K[b], func_rows=func_rows(func, cq, b))
        dead = ~m.any(dim=1)
        assert torch.all(o[int(cq[b]):int(cq[b + 1])][dead] == 0)
    assert torch.all(o[-1] == 0)


def test_random_func_tensor_properties():
    lens_q, lens_k = [30, 0, 25, 1], [40, 5, 25, 3]
    cq, ck = cu(lens_q), cu(lens_k)
    f = random_func_tensor(cq, ck, 5, generator=torch.Generator().manual_seed(3))
    T_q = sum(lens_q)
    assert f.dtype == I32 and f.shape == (1, 5, T_q + FUNC_PAD_COLUMNS)
    assert torch.all(f[0, :, T_q:] == 0)
    assert torch.all(f >= 0)
    starts, ends = f[0, 1::2, :T_q], f[0, 2::2, :T_q]
    assert (ends < starts).any() and (ends == starts).any()  # empty intervals, both kinds
    assert (starts[1:] < starts[:-1]).any()  # unordered
    lo = torch.maximum(starts[:, None], starts[None, :])
    hi = torch.minimum(ends[:, None], ends[None, :])
    pair = ~torch.eye(starts.shape[0], dtype=torch.bool)[:, :, None]
    assert ((lo < hi) & pair).any()  # two intervals of one row overlap
    lk_row = torch.repeat_interleave(torch.tensor(lens_k), torch.tensor(lens_q))
    assert (f[0, :, :T_q] > lk_row).any()  # beyond len_k
    dead = [int((~visible_mask(lens_q[b], lens_k[b], func_rows=func_rows(f, cq, b)).any(1)).sum())
            for b in range(len(lens_q))]
    assert sum(dead) >= 2
    # Deterministic with a generator.
    f2 = random_func_tensor(cq, ck, 5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(f, f2)


def _func_from_rows(rows, T_q):
    n = len(rows[0])
    f = torch.zeros(1, n, T_q + FUNC_PAD_COLUMNS, dtype=I32)
    f[0, :, :T_q] = torch.tensor(rows, dtype=I32).T
    return f


def test_func_unordered_overlapping_equals_union():
    lq, lk = 4, 10
    q, k, v = make_qkv([lq], [lk], 2, 1, 8)
    a = args([lq], [lk])
    messy = _func_from_rows([
        [2, 5, 9, 3, 6],    # [0,2) U [5,9) U [3,6)      = [0,2) U [3,9)
        [2, 1, 4, 4, 6],    # [0,2) U [1,4) U [4,6)      = [0,6)
        [0, 7, 30, 8, 3],   # [7,30) clipped, [8,3) empty = [7,10)
        [0, 6, 2, 9, 9],    # all empty
    ], lq)
    tidy3 = _func_from_rows([[2, 3, 9], [6, 0, 0], [0, 7, 10], [0, 0, 0]], lq)
    tidy1 = _func_from_rows([[2], [6], [0], [0]], lq)
    kw = dict(window_size=(-1, -1))
    o_messy = ref64(q, k, v, *a, func_tensor=messy, **kw)
    o_tidy = ref64(q, k, v, *a, func_tensor=tidy3, **kw)
    torch.testing.assert_close(o_messy, o_tidy, atol=0, rtol=0)
    assert torch.all(o_messy[3] == 0)
    # Rows 0 and 1 with n = 1: only the prefix intervals agree on row 1 and row 3.
    o1 = ref64(q, k, v, *a, func_tensor=tidy1, **kw)
    torch.testing.assert_close(o1[1], o_messy[1], atol=0, rtol=0)
    torch.testing.assert_close(o1[3], o_messy[3], atol=0, rtol=0)
    want = torch.zeros(lq, lk, dtype=torch.bool)
    want[0, [0, 1, 3, 4, 5, 6, 7, 8]] = True
    want[1, :6] = True
    want[2, 7:] = True
    assert torch.equal(visible_mask(lq, lk, func_rows=messy[0, :, :lq]), want)
    assert visible_pairs(*a[:2], func_tensor=messy) == int(want.sum())


# ---------------------------------------------------------------------------
# visible_mask
# ---------------------------------------------------------------------------


def test_visible_mask_causal_square_is_lower_triangular():
    for L in [1, 2, 7]:
        m = visible_mask(L, L, (-1, 0))
        assert torch.equal(m, torch.ones(L, L, dtype=torch.bool).tril())


def test_visible_mask_bottom_right_alignment():
    lq, lk = 3, 8
    m = visible_mask(lq, lk, (-1, 0))
    assert m[-1].all()  # last query sees every key
    assert m.sum(1).tolist() == [6, 7, 8]
    assert torch.equal(m, torch.ones(lq, lk, dtype=torch.bool).tril(diagonal=lk - lq))
    # (0, 0): each query sees exactly its bottom-right-aligned diagonal key.
    d = visible_mask(lq, lk, (0, 0))
    assert [row.nonzero().flatten().tolist() for row in d] == [[5], [6], [7]]
    # Local window (2, 1) around i + off.
    w = visible_mask(lq, lk, (2, 1))
    assert [row.nonzero().flatten().tolist() for row in w] == [[3, 4, 5, 6], [4, 5, 6, 7], [5, 6, 7]]


def test_visible_mask_full_and_empty():
    assert visible_mask(4, 6, (-1, -1)).all()
    assert visible_mask(0, 6).shape == (0, 6)
    assert visible_mask(3, 0, (-1, 0)).shape == (3, 0)
    # len_q > len_k, causal: the first rows see nothing.
    m = visible_mask(5, 2, (-1, 0))
    assert m.sum(1).tolist() == [0, 0, 0, 1, 2]


def test_visible_mask_func_clips_to_len_k():
    rows = torch.tensor([[9, 0], [2, 1], [12, 3]])  # n = 3; columns are the two query rows
    m = visible_mask(2, 5, func_rows=rows)
    assert m[0].all()  # [0, 9) U [2, 12), clipped to 5 keys
    assert m[1].tolist() == [False, True, True, False, False]  # [0, 0) U [1, 3)


# ---------------------------------------------------------------------------
# Paged KV
# ---------------------------------------------------------------------------


def _paged_setup(lens_k, H_kv, D, seed=0, spare_pages=3):
    """Dense k/v and the same data scattered into shuffled pages (plus unused pages)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(sum(lens_k), H_kv, D, generator=g, dtype=F64)
    v = torch.randn(sum(lens_k), H_kv, D, generator=g, dtype=F64)
    need = [-(-lk // PAGE_SIZE) for lk in lens_k]
    num_pages = sum(need) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    paged = torch.randn(num_pages, 2, PAGE_SIZE, H_kv, D, generator=g, dtype=F64)  # garbage
    ids, indptr, pos, tok = [], [0], 0, 0
    for lk, npg in zip(lens_k, need):
        pages = perm[pos:pos + npg].tolist()
        pos += npg
        for j in range(lk):
            paged[pages[j // PAGE_SIZE], 0, j % PAGE_SIZE] = k[tok + j]
            paged[pages[j // PAGE_SIZE], 1, j % PAGE_SIZE] = v[tok + j]
        tok += lk
        ids += pages
        indptr.append(len(ids))
    return k, v, paged, torch.tensor(ids, dtype=I32), torch.tensor(indptr, dtype=I32)


def test_paged_kv_equals_dense():
    lens_q = [5, 0, 1, 100, 128, 3]
    lens_k = [130, 0, 1, 257, 128, 3]
    H, H_kv, D = 2, 1, 8
    k, v, paged, ids, indptr = _paged_setup(lens_k, H_kv, D)
    cq, ck, mq, mk = args(lens_q, lens_k)
    kg, vg = gather_paged_kv(paged, ids, indptr, ck)
    assert torch.equal(kg, k) and torch.equal(vg, v)
    q = torch.randn(sum(lens_q), H, D, generator=torch.Generator().manual_seed(5), dtype=F64)
    dense = ref64(q, k, v, cq, ck, mq, mk, window_size=(-1, 0))
    pg = ref64(q, None, None, cq, ck, mq, mk, paged_kv=paged, page_ids=ids, page_indptrs=indptr)
    torch.testing.assert_close(pg, dense, atol=0, rtol=0)
    # k/v arguments are ignored when paged_kv is given.
    pg2 = ref64(q, k * 0, v * 0, cq, ck, mq, mk, paged_kv=paged, page_ids=ids, page_indptrs=indptr)
    torch.testing.assert_close(pg2, dense, atol=0, rtol=0)
    # float32 compute from float32 pages.
    pg32 = hstu_attention_reference(q.float(), None, None, cq, ck, mq, mk, paged_kv=paged.float(),
                                    page_ids=ids, page_indptrs=indptr)
    torch.testing.assert_close(pg32.double(), dense, atol=1e-5, rtol=1e-5)


def test_paged_kv_extra_pages_per_sequence_are_ignored():
    lens_k = [3, 129]
    k, v, paged, ids, indptr = _paged_setup(lens_k, 1, 4, spare_pages=0)
    # Give sequence 0 one extra (unused) page at the end of its list.
    ids2 = torch.cat([ids[:1], ids[2:3], ids[1:]])
    indptr2 = torch.tensor([0, 2, 4], dtype=I32)
    kg, vg = gather_paged_kv(paged, ids2, indptr2, cu(lens_k))
    assert torch.equal(kg, k) and torch.equal(vg, v)


# ---------------------------------------------------------------------------
# Pair / FLOP counting
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS + [(5, -1), (0, 3)])
def test_visible_pairs_matches_mask_sum(window):
    g = torch.Generator().manual_seed(7)
    lens_k = torch.randint(0, 40, (12,), generator=g).tolist()
    lens_q = [int(torch.randint(0, lk + 1, (1,), generator=g)) for lk in lens_k]
    lens_q[0], lens_k[0] = 6, 3  # one len_q > len_k
    cq, ck = cu(lens_q), cu(lens_k)
    want = sum(int(visible_mask(a, b, window).sum()) for a, b in zip(lens_q, lens_k))
    assert visible_pairs(cq, ck, window) == want
    assert attention_flops(cq, ck, 4, 64, window) == 4 * 4 * 64 * want


@pytest.mark.parametrize("n", [1, 3, 5, 7])
def test_visible_pairs_func_matches_mask_sum(n):
    lens_q, lens_k = [0, 9, 1, 30, 17], [4, 9, 6, 30, 40]
    cq, ck = cu(lens_q), cu(lens_k)
    f = random_func_tensor(cq, ck, n, generator=torch.Generator().manual_seed(n))
    want = sum(int(visible_mask(lens_q[b], lens_k[b], func_rows=func_rows(f, cq, b)).sum())
               for b in range(len(lens_q)))
    assert visible_pairs(cq, ck, func_tensor=f) == want
    assert attention_flops(cq, ck, 2, 32, func_tensor=f) == 4 * 2 * 32 * want


def test_visible_pairs_closed_forms():
    cq, ck = cu([4, 3]), cu([4, 8])
    assert visible_pairs(cq, ck) == 4 * 4 + 3 * 8
    assert visible_pairs(cq, ck, (-1, 0)) == 10 + (6 + 7 + 8)
    assert visible_pairs(cq, ck, (0, 0)) == 4 + 3
    assert BACKWARD_FLOPS_FACTOR == 2.5


# ---------------------------------------------------------------------------
# Autograd (backward reference)
# ---------------------------------------------------------------------------


def test_gradcheck_causal():
    q, k, v = make_qkv([3, 2], [3, 2], 1, 1, 4)
    cq, ck, mq, mk = args([3, 2], [3, 2])
    for t in (q, k, v):
        t.requires_grad_(True)
    fn = lambda q, k, v: ref64(q, k, v, cq, ck, mq, mk, window_size=(-1, 0), alpha=0.7)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_gradcheck_gqa_func_mask():
    lens_q, lens_k = [2, 3], [4, 3]
    q, k, v = make_qkv(lens_q, lens_k, 2, 1, 4, seed=3)
    cq, ck, mq, mk = args(lens_q, lens_k)
    f = random_func_tensor(cq, ck, 3, generator=torch.Generator().manual_seed(2))
    for t in (q, k, v):
        t.requires_grad_(True)
    fn = lambda q, k, v: ref64(q, k, v, cq, ck, mq, mk, window_size=(-1, -1), func_tensor=f)
    assert torch.autograd.gradcheck(fn, (q, k, v))


def _closed_form_grads(do, q, k, v, lens_q, lens_k, window, alpha, scaling):
    """dQ, dK, dV from the analytic backward, per sequence and head (float64)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    H, H_kv = q.shape[1], k.shape[1]
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        m = visible_mask(lq, lk, window).double()
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        for h in range(H):
            hk = h // (H // H_kv)
            Q, K, V, dO = q[qs, h], k[ks, hk], v[ks, hk], do[qs, h]
            S = alpha * Q @ K.T
            sig = torch.sigmoid(S)
            A = m * S * sig / scaling
            dv[ks, hk] += A.T @ dO
            dA = dO @ V.T
            dS = dA * m / scaling * sig * (1 + S * (1 - sig))
            dq[qs, h] += alpha * dS @ K
            dk[ks, hk] += alpha * dS.T @ Q
    return dq, dk, dv


@pytest.mark.parametrize("window", [(-1, 0), (2, 5)])
def test_backward_reference_matches_closed_form(window):
    H, H_kv, D = 4, 2, 8
    q, k, v = make_qkv(LENS_Q, LENS_K, H, H_kv, D, seed=9)
    do = torch.randn_like(q)
    cq, ck, mq, mk = args()
    dq, dk, dv = hstu_attention_backward_reference(
        do, q, k, v, cq, ck, mq, mk, window_size=window, alpha=0.6, compute_dtype=F64)
    want = _closed_form_grads(do, q, k, v, LENS_Q, LENS_K, window, 0.6, float(mq))
    for got, ref in zip((dq, dk, dv), want):
        torch.testing.assert_close(got, ref, atol=1e-10, rtol=0)
    # Same as calling torch.autograd.grad on the reference directly.
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o = ref64(*leaves, cq, ck, mq, mk, window_size=window, alpha=0.6)
    for got, ref in zip((dq, dk, dv), torch.autograd.grad(o, leaves, do)):
        torch.testing.assert_close(got, ref, atol=0, rtol=0)


def test_backward_reference_low_precision_inputs_return_compute_dtype():
    q, k, v = (t.to(torch.bfloat16) for t in make_qkv([3, 4], [5, 4], 2, 2, 8))
    do = torch.randn(q.shape, dtype=torch.bfloat16)
    grads = hstu_attention_backward_reference(do, q, k, v, *args([3, 4], [5, 4]))
    assert [g.dtype for g in grads] == [F32] * 3
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _valid():
    q, k, v = make_qkv([3, 2], [4, 2], 4, 2, 8)
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu([3, 2]), cu_seqlens_k=cu([4, 2]),
                max_seqlen_q=3, max_seqlen_k=4)


def _call(**over):
    kw = _valid()
    kw.update(over)
    pos = [kw.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                               "max_seqlen_q", "max_seqlen_k")]
    return hstu_attention_reference(*pos, **kw)


def _paged_kw():
    k, v, paged, ids, indptr = _paged_setup([4, 2], 2, 8, spare_pages=1)
    return dict(k=None, v=None, paged_kv=paged.float(), page_ids=ids, page_indptrs=indptr)


def _pg(**over):
    """Full keyword set of a valid float32 paged call, with overrides."""
    kw = {n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
          for n, t in _valid().items()}
    kw.update(_paged_kw())
    kw.update(over)
    return kw


BAD = [
    ("q 2-D", lambda: dict(q=torch.zeros(5, 8, dtype=F64)), r"q must be 3-D"),
    ("q int", lambda: dict(q=torch.zeros(5, 4, 8, dtype=I32)), r"q must be a floating"),
    ("k rank", lambda: dict(k=torch.zeros(6, 16, dtype=F64)), r"k must be 3-D"),
    ("v shape", lambda: dict(v=torch.zeros(6, 2, 4, dtype=F64)), r"k and v must have the same shape"),
    ("k dtype", lambda: dict(k=torch.zeros(6, 2, 8, dtype=F32)), r"k dtype .* must match q"),
    ("head dim", lambda: dict(k=torch.zeros(6, 2, 4, dtype=F64), v=torch.zeros(6, 2, 4, dtype=F64)),
     r"head dim must equal q's D=8"),
    ("H % H_kv", lambda: dict(k=torch.zeros(6, 3, 8, dtype=F64), v=torch.zeros(6, 3, 8, dtype=F64)),
     r"H_kv=3 must be >= 1 and divide .* H=4"),
    ("cu len", lambda: dict(cu_seqlens_k=torch.tensor([0, 6], dtype=I32)), r"B \+ 1 entries, got 3 and 2"),
    ("cu dtype", lambda: dict(cu_seqlens_q=torch.tensor([0, 3, 5])), r"cu_seqlens_q must be int32"),
    ("cu start", lambda: dict(cu_seqlens_q=torch.tensor([1, 3, 5], dtype=I32)), r"must start at 0"),
    ("cu order", lambda: dict(cu_seqlens_q=torch.tensor([0, 6, 5], dtype=I32)), r"non-decreasing"),
    ("cu rank", lambda: dict(cu_seqlens_q=torch.zeros(1, 3, dtype=I32)), r"must be 1-D"),
    ("T_q", lambda: dict(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=I32)), r"cu_seqlens_q\[-1\]=4 must equal T_q=5"),
    ("T_k", lambda: dict(cu_seqlens_k=torch.tensor([0, 4, 5], dtype=I32)), r"cu_seqlens_k\[-1\]=5 must equal T_k=6"),
    ("max q > k", lambda: dict(max_seqlen_q=5), r"max_seqlen_q=5 must be <= max_seqlen_k=4"),
    ("len > max", lambda: dict(max_seqlen_k=3, max_seqlen_q=2), r"len_q=3 > max_seqlen_q=2"),
    ("scaling", lambda: dict(scaling_seqlen=0), r"scaling_seqlen must be finite and > 0"),
    ("alpha", lambda: dict(alpha=float("inf")), r"alpha must be finite"),
    ("window", lambda: dict(window_size=(-2, 0)), r"window_size left must be >= -1"),
    ("window pair", lambda: dict(window_size=3), r"window_size must be a pair"),
    ("func even n", lambda: dict(window_size=(-1, -1), func_tensor=torch.zeros(1, 2, 261, dtype=I32)),
     r"positive odd number n .* got n=2"),
    ("func short", lambda: dict(window_size=(-1, -1), func_tensor=torch.zeros(1, 3, 260, dtype=I32)),
     r"L >= T_q \+ 256 = 261"),
    ("func shape", lambda: dict(window_size=(-1, -1), func_tensor=torch.zeros(3, 261, dtype=I32)),
     r"func_tensor must have shape \(1, n, L\)"),
    ("func dtype", lambda: dict(window_size=(-1, -1), func_tensor=torch.zeros(1, 3, 261)),
     r"func_tensor must be int32"),
    ("func + window", lambda: dict(func_tensor=torch.zeros(1, 3, 261, dtype=I32)),
     r"cannot be combined with a window mask: window_size must be \(-1, -1\), got \(-1, 0\)"),
    ("func + paged", lambda: _pg(window_size=(-1, -1), func_tensor=torch.zeros(1, 3, 261, dtype=I32)),
     r"func_tensor .* cannot be combined with paged KV"),
    ("paged shape", lambda: _pg(paged_kv=torch.zeros(3, 2, 64, 2, 8)),
     r"paged_kv must have shape \(num_pages, 2, 128, H_kv, D\)"),
    ("paged contiguous", lambda: _pg(paged_kv=torch.zeros(3, 2, 128, 8, 2).transpose(3, 4)),
     r"paged_kv must be contiguous"),
    ("paged window", lambda: _pg(window_size=(-1, -1)),
     r"paged KV supports only the causal mask"),
    ("paged no ids", lambda: _pg(page_ids=None),
     r"paged_kv requires page_ids and page_indptrs"),
    ("paged id range", lambda: _pg(page_ids=torch.tensor([0, 9], dtype=I32)),
     r"page_ids must be in \[0, num_pages=3\)"),
    ("paged too few", lambda: _pg(cu_seqlens_k=torch.tensor([0, 200, 202], dtype=I32), max_seqlen_k=200),
     r"sequence 0 has len_k=200 and needs 2 pages"),
    ("paged indptr", lambda: _pg(page_indptrs=torch.tensor([0, 2], dtype=I32)),
     r"page_indptrs must have shape \(B \+ 1,\) = \(3,\)"),
    ("ids without paged", lambda: dict(page_ids=torch.tensor([0], dtype=I32)),
     r"only valid together with paged_kv"),
]


@pytest.mark.parametrize("name,over,match", BAD, ids=[b[0] for b in BAD])
def test_validation_errors(name, over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over())


def test_valid_calls_pass():
    _call()
    _call(**_pg())  # the paged setup the error cases start from is valid


def test_helper_validation_errors():
    with pytest.raises(ValueError, match=r"func_rows must have a positive odd number"):
        visible_mask(2, 3, func_rows=torch.zeros(2, 2, dtype=I32))
    with pytest.raises(ValueError, match=r"func_rows must have shape \(n, 2\)"):
        visible_mask(2, 3, func_rows=torch.zeros(3, 4, dtype=I32))
    with pytest.raises(ValueError, match=r"cannot be combined with a window"):
        visible_mask(2, 3, (-1, 0), func_rows=torch.zeros(1, 2, dtype=I32))
    with pytest.raises(ValueError, match=r"n must be positive and odd"):
        random_func_tensor(cu([2]), cu([3]), 4)
    with pytest.raises(ValueError, match=r"B \+ 1 entries"):
        visible_pairs(cu([2]), cu([3, 1]))
    with pytest.raises(ValueError, match=r"do must have q's shape"):
        q, k, v = make_qkv([2], [2], 1, 1, 4)
        hstu_attention_backward_reference(q[:1], q, k, v, *args([2], [2]))
    with pytest.raises(ValueError, match=r"paged KV is forward only"):
        q, k, v = make_qkv([2], [2], 1, 1, 4)
        hstu_attention_backward_reference(q, q, k, v, *args([2], [2]), paged_kv=k)
