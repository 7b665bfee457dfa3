"""CPU tests of the Gated DeltaNet references (recurrent, chunked WY, span summaries)."""

import math

import pytest
import torch
import torch.nn.functional as F

from precast.reference.gated_delta_net import (
    CHUNK_SIZE,
    gdn_chunked_reference,
    gdn_recurrent_reference,
    l2norm_rows,
    summary_reference,
)

TOL = dict(rtol=1e-10, atol=1e-10)
REFS = [gdn_recurrent_reference, gdn_chunked_reference]


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The references run many tiny ops; intra-op threads only add overhead
    # (and make the runtime swing on a loaded machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def cu_of(lens, dtype=torch.int32):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def make_inputs(lens, HQ, HK, HV, K, V, *, seed=0, raw_k=False, dtype=torch.float64):
    """Random packed inputs. Keys are unit-norm unless ``raw_k`` (for the l2norm path)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    HO = max(HQ, HV)
    q = torch.randn(T, HQ, K, generator=gen, dtype=torch.float64)
    k = torch.randn(T, HK, K, generator=gen, dtype=torch.float64)
    if not raw_k:
        k = F.normalize(k, dim=-1)
    v = torch.randn(T, HV, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(T, HO, generator=gen, dtype=torch.float64) + 1.0)
    beta = torch.rand(T, HO, generator=gen, dtype=torch.float64)
    s0 = torch.randn(len(lens), HO, V, K, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta, s0))


def literal_gdn(q, k, v, g, beta, cu, *, scale=None, s0=None, l2norm=False, second_form=False):
    """Direct per-(sequence, head, token) transcription of the recurrence, K x V state.

    Returns o [T, HO, V], final states [N, HO, V, K] and, for every token, the
    V-major state entering it: entering[t] = [HO, V, K].
    """
    T, HQ, K = q.shape
    HK, HV, V = k.shape[1], v.shape[1], v.shape[2]
    HO = max(HQ, HV)
    if scale is None:
        scale = 1.0 / math.sqrt(K)
    offs = cu.tolist()
    N = len(offs) - 1
    o = torch.zeros(T, HO, V, dtype=torch.float64)
    finals = torch.zeros(N, HO, V, K, dtype=torch.float64)
    entering = torch.zeros(T, HO, V, K, dtype=torch.float64)

    def norm(x):
        return x / math.sqrt(max(float((x * x).sum()), 1e-24)) if l2norm else x

    for b in range(N):
        for h in range(HO):
            S = s0[b, h].T.clone() if s0 is not None else torch.zeros(K, V, dtype=torch.float64)
            for t in range(offs[b], offs[b + 1]):
                qt = norm(q[t, h // (HO // HQ)])
                kt = norm(k[t, h // (HO // HK)])
                vt = v[t, h // (HO // HV)]
                entering[t, h] = S.T
                alpha = math.exp(float(g[t, h]))
                bt = float(beta[t, h])
                if second_form:
                    S = alpha * (torch.eye(K, dtype=torch.float64) - bt * torch.outer(kt, kt)) @ S
                    S = S + bt * torch.outer(kt, vt)
                else:
                    S = alpha * S
                    r = vt - S.T @ kt
                    S = S + bt * torch.outer(kt, r)
                o[t, h] = S.T @ (scale * qt)
            finals[b, h] = S.T
    return o, finals, entering


# ---------------------------------------------------------------------------
# l2norm helper
# ---------------------------------------------------------------------------


def test_l2norm_rows():
    x = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-13, 0.0]], dtype=torch.float64)
    y = l2norm_rows(x)
    torch.testing.assert_close(y[0], torch.tensor([0.6, 0.8], dtype=torch.float64))
    assert torch.equal(y[1], torch.zeros(2, dtype=torch.float64))
    # Below the 1e-24 floor on sum(x^2): x * rsqrt(1e-24) = x * 1e12.
    torch.testing.assert_close(y[2], torch.tensor([0.1, 0.0], dtype=torch.float64))
    yb = l2norm_rows(torch.randn(4, 8).to(torch.bfloat16))
    assert yb.dtype == torch.float32
    torch.testing.assert_close(yb.norm(dim=-1), torch.ones(4), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# recurrent == literal transcription
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "HQ,HK,HV",
    [(1, 1, 1), (2, 2, 4), (2, 4, 4), (4, 4, 2), (4, 2, 2)],
)
@pytest.mark.parametrize("variant", ["plain", "init_l2_scale"])
def test_recurrent_matches_literal(HQ, HK, HV, variant):
    lens = [9, 0, 1, 6]
    K, V = 8, 6  # K != V catches transposed states
    q, k, v, g, beta, s0 = make_inputs(lens, HQ, HK, HV, K, V, seed=HQ * 10 + HV, raw_k=variant != "plain")
    cu = cu_of(lens)
    kw = {}
    if variant != "plain":
        kw = dict(scale=0.37, initial_state=s0, use_qk_l2norm_in_kernel=True)
    res = gdn_recurrent_reference(q, k, v, g, beta, cu, **kw)
    lit = dict(scale=kw.get("scale"), s0=kw.get("initial_state"), l2norm=bool(kw))
    o, fin, _ = literal_gdn(q, k, v, g, beta, cu, **lit)
    torch.testing.assert_close(res["o"], o, **TOL)
    torch.testing.assert_close(res["final_state"], fin, **TOL)
    # The two formulations in the spec agree.
    o2, fin2, _ = literal_gdn(q, k, v, g, beta, cu, second_form=True, **lit)
    torch.testing.assert_close(o2, o, **TOL)
    torch.testing.assert_close(fin2, fin, **TOL)
    assert res["o"].shape == (sum(lens), max(HQ, HV), V)
    assert res["final_state"].shape == (len(lens), max(HQ, HV), V, K)
    assert res["checkpoints"] is None and res["state_pool"] is None


# ---------------------------------------------------------------------------
# chunked == recurrent
# ---------------------------------------------------------------------------

LENS_SETS = [[97, 16, 1, 70, 0, 33], [7] * 5 + [1] * 3]
HEADS = [(1, 1, 1), (2, 2, 4), (2, 4, 4), (4, 4, 2), (4, 2, 2)]


@pytest.mark.parametrize("lens", LENS_SETS, ids=["ragged", "short"])
@pytest.mark.parametrize("HQ,HK,HV", HEADS)
@pytest.mark.parametrize("init", [False, True])
@pytest.mark.parametrize("l2", [False, True])
def test_chunked_matches_recurrent(lens, HQ, HK, HV, init, l2):
    K, V = 16, 32 if init else 16
    q, k, v, g, beta, s0 = make_inputs(lens, HQ, HK, HV, K, V, seed=len(lens) + HQ + 3 * HV, raw_k=l2)
    kw = dict(
        initial_state=s0 if init else None,
        use_qk_l2norm_in_kernel=l2,
        scale=0.21 if l2 else None,
    )
    cu = cu_of(lens, torch.int64 if init else torch.int32)
    r = gdn_recurrent_reference(q, k, v, g, beta, cu, **kw)
    c = gdn_chunked_reference(q, k, v, g, beta, cu, **kw)
    torch.testing.assert_close(c["o"], r["o"], **TOL)
    torch.testing.assert_close(c["final_state"], r["final_state"], **TOL)


def test_chunked_matches_recurrent_k64():
    lens = [130, 64, 3, 0, 65]
    q, k, v, g, beta, s0 = make_inputs(lens, 2, 2, 2, 64, 64, seed=7)
    cu = cu_of(lens)
    r = gdn_recurrent_reference(q, k, v, g, beta, cu, initial_state=s0, checkpoint_every_n_tokens=64)
    c = gdn_chunked_reference(q, k, v, g, beta, cu, initial_state=s0, checkpoint_every_n_tokens=64)
    for key in ("o", "final_state", "checkpoints"):
        torch.testing.assert_close(c[key], r[key], **TOL)


def test_strong_gates_and_full_beta():
    # Near-zero decays and beta = 1 (pure overwrite) stress the in-chunk exp(G_i - G_j).
    lens = [100, 64]
    q, k, v, g, beta, s0 = make_inputs(lens, 1, 1, 1, 16, 16, seed=3)
    g = -torch.rand_like(g) * 8.0
    g[::5] = 0.0
    beta = torch.ones_like(beta)
    cu = cu_of(lens)
    r = gdn_recurrent_reference(q, k, v, g, beta, cu, initial_state=s0)
    c = gdn_chunked_reference(q, k, v, g, beta, cu, initial_state=s0)
    torch.testing.assert_close(c["o"], r["o"], **TOL)
    torch.testing.assert_close(c["final_state"], r["final_state"], **TOL)


@pytest.mark.parametrize("ref", REFS)
def test_float32_and_bf16_inputs(ref):
    lens = [70, 5]
    q, k, v, g, beta, s0 = make_inputs(lens, 2, 2, 2, 16, 16, seed=11)
    cu = cu_of(lens)
    exact = gdn_recurrent_reference(q, k, v, g, beta, cu, initial_state=s0)
    res = ref(q, k, v, g, beta, cu, initial_state=s0, compute_dtype=torch.float32)
    assert res["o"].dtype == torch.float32 and res["final_state"].dtype == torch.float32
    torch.testing.assert_close(res["o"], exact["o"].float(), rtol=1e-4, atol=1e-4)
    half = [x.to(torch.bfloat16) for x in (q, k, v, g, beta)]
    res = ref(*half, cu, use_qk_l2norm_in_kernel=True)
    assert res["o"].dtype == torch.float64 and torch.isfinite(res["o"]).all()


@pytest.mark.parametrize("ref", REFS)
def test_empty_batch_and_flags(ref):
    q, k, v, g, beta, _ = make_inputs([], 2, 2, 2, 8, 8)
    res = ref(q, k, v, g, beta, cu_of([]), checkpoint_every_n_tokens=64)
    assert res["o"].shape == (0, 2, 8)
    assert res["final_state"].shape == (0, 2, 8, 8)
    assert res["checkpoints"].shape == (0, 2, 8, 8)
    q, k, v, g, beta, _ = make_inputs([3, 0], 2, 2, 2, 8, 8)
    res = ref(q, k, v, g, beta, cu_of([3, 0]), output_final_state=False)
    assert res["final_state"] is None and res["checkpoints"] is None and res["state_pool"] is None
    assert res["o"].shape == (3, 2, 8)


# ---------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [64, 128])
def test_checkpoints(n):
    lens = [97, 16, 1, 200, 0, 130, 128]
    HQ, HK, HV, K, V = 2, 2, 4, 8, 16
    q, k, v, g, beta, s0 = make_inputs(lens, HQ, HK, HV, K, V, seed=n)
    cu = cu_of(lens)
    _, fin, entering = literal_gdn(q, k, v, g, beta, cu, s0=s0)
    expected_rows, first_rows = [], []
    for b, L in enumerate(lens):
        lo = int(cu[b])
        if L:
            first_rows.append(len(expected_rows))
        for p in range(0, L, n):
            expected_rows.append(entering[lo + p])
    assert len(expected_rows) == sum(-(-L // n) for L in lens)
    assert len(expected_rows) <= sum(lens) // n + len(lens)
    expected = torch.stack(expected_rows)
    for ref in REFS:
        res = ref(q, k, v, g, beta, cu, initial_state=s0, checkpoint_every_n_tokens=n)
        ck = res["checkpoints"]
        assert ck.shape == (len(expected_rows), max(HQ, HV), V, K)
        torch.testing.assert_close(ck, expected, **TOL)
        nonempty = [b for b, L in enumerate(lens) if L]
        torch.testing.assert_close(ck[first_rows], s0[nonempty], rtol=0, atol=0)
        torch.testing.assert_close(res["final_state"], fin, **TOL)


# ---------------------------------------------------------------------------
# state pool
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ref", REFS)
def test_state_pool(ref):
    lens = [70, 0, 9]
    HQ, HK, HV, K, V = 4, 2, 2, 8, 16
    q, k, v, g, beta, _ = make_inputs(lens, HQ, HK, HV, K, V, seed=5)
    pool = torch.randn(6, 4, V, K, dtype=torch.float64)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    cu = cu_of(lens)
    res = ref(q, k, v, g, beta, cu, initial_state=pool, state_indices=idx)
    direct = ref(q, k, v, g, beta, cu, initial_state=pool[idx.long()])
    torch.testing.assert_close(res["o"], direct["o"], rtol=0, atol=0)
    torch.testing.assert_close(res["final_state"], direct["final_state"], rtol=0, atol=0)
    new_pool = res["state_pool"]
    assert new_pool.shape == pool.shape
    torch.testing.assert_close(new_pool[idx.long()], direct["final_state"], rtol=0, atol=0)
    others = [i for i in range(pool.shape[0]) if i not in idx.tolist()]
    torch.testing.assert_close(new_pool[others], pool[others], rtol=0, atol=0)
    # the empty sequence's pool row keeps its initial state
    torch.testing.assert_close(new_pool[0], pool[0], rtol=0, atol=0)
    # the input pool is not modified
    assert not torch.equal(new_pool[4], pool[4])


# ---------------------------------------------------------------------------
# span summaries
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("HK,HV,HO,l2", [(1, 1, 1, False), (2, 4, 4, True), (4, 2, 4, False)])
def test_summary_composition(HK, HV, HO, l2):
    La, Lb = 90, 41
    K, V = 8, 12
    HQ = HO if HV < HO else HK
    q, k, v, g, beta, _ = make_inputs([La + Lb], HQ, HK, HV, K, V, seed=HO + HV, raw_k=l2)
    s0 = torch.randn(1, HO, V, K, dtype=torch.float64)

    whole = summary_reference(k, v, g, beta, cu_of([La + Lb]), use_qk_l2norm_in_kernel=l2)
    parts = summary_reference(k, v, g, beta, cu_of([La, 0, Lb]), use_qk_l2norm_in_kernel=l2)
    A, E = parts["transition"], parts["end_state"]
    assert A.shape == (3, HO, K, K) and E.shape == (3, HO, V, K)
    # empty span: identity / zero
    torch.testing.assert_close(A[1], torch.eye(K, dtype=torch.float64).expand(HO, K, K), rtol=0, atol=0)
    assert torch.equal(E[1], torch.zeros_like(E[1]))
    # composition: S -> (S A1 + E1) A2 + E2
    A12 = A[0] @ A[2]
    E12 = E[0] @ A[2] + E[2]
    torch.testing.assert_close(A12, whole["transition"][0], **TOL)
    torch.testing.assert_close(E12, whole["end_state"][0], **TOL)
    # and it is the recurrence over the concatenation
    rec = gdn_recurrent_reference(
        q, k, v, g, beta, cu_of([La + Lb]), initial_state=s0, use_qk_l2norm_in_kernel=l2
    )
    torch.testing.assert_close(s0[0] @ A12 + E12, rec["final_state"][0], **TOL)
    # each part alone against the recurrence with a random initial state
    rec_a = gdn_recurrent_reference(
        q[:La], k[:La], v[:La], g[:La], beta[:La], cu_of([La]), initial_state=s0,
        use_qk_l2norm_in_kernel=l2,
    )
    torch.testing.assert_close(s0[0] @ A[0] + E[0], rec_a["final_state"][0], **TOL)
    zero = gdn_recurrent_reference(
        q[La:], k[La:], v[La:], g[La:], beta[La:], cu_of([Lb]), use_qk_l2norm_in_kernel=l2
    )
    torch.testing.assert_close(E[2], zero["final_state"][0], **TOL)


# ---------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------


def _tiny_grad_inputs():
    gen = torch.Generator().manual_seed(123)
    T, K, V = 5, 3, 3
    q = torch.randn(T, 1, K, generator=gen, dtype=torch.float64)
    k = F.normalize(torch.randn(T, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(T, 1, V, generator=gen, dtype=torch.float64)
    g = F.logsigmoid(torch.randn(T, 1, generator=gen, dtype=torch.float64))
    beta = torch.rand(T, 1, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    s0 = torch.randn(1, 1, V, K, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, v, g, beta, s0)]


@pytest.mark.parametrize("ref", REFS)
def test_gradcheck(ref):
    cu = cu_of([5])

    def fn(q, k, v, g, beta, s0):
        res = ref(q, k, v, g, beta, cu, initial_state=s0)
        return res["o"], res["final_state"]

    assert torch.autograd.gradcheck(fn, _tiny_grad_inputs(), eps=1e-6, atol=1e-7, rtol=1e-6)


def test_gradients_chunked_match_recurrent():
    lens = [70, 0, 9]
    q, k, v, g, beta, s0 = make_inputs(lens, 2, 2, 4, 8, 8, seed=9, raw_k=True)
    cu = cu_of(lens)
    grads = []
    for ref in REFS:
        xs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, s0)]
        res = ref(*xs[:5], cu, initial_state=xs[5], use_qk_l2norm_in_kernel=True)
        loss = (res["o"] ** 2).sum() + (res["final_state"] * 0.5).sum()
        grads.append(torch.autograd.grad(loss, xs))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------
# batch invariance
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("ref", REFS)
def test_batch_invariance(ref):
    L = 77
    q, k, v, g, beta, s0 = make_inputs([L], 2, 2, 2, 16, 16, seed=21)
    qo, ko, vo, go, bo, so = make_inputs([40, 65], 2, 2, 2, 16, 16, seed=22)
    alone = ref(q, k, v, g, beta, cu_of([L]), initial_state=s0)
    # put the sequence in the middle of a batch
    cat = lambda a, b: torch.cat([a[:40], b, a[40:]])  # noqa: E731
    res = ref(
        cat(qo, q), cat(ko, k), cat(vo, v), cat(go, g), cat(bo, beta), cu_of([40, L, 65]),
        initial_state=torch.stack([so[0], s0[0], so[1]]),
    )
    torch.testing.assert_close(res["o"][40 : 40 + L], alone["o"], rtol=0, atol=0)
    torch.testing.assert_close(res["final_state"][1], alone["final_state"][0], rtol=0, atol=0)


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


def _valid(lens=(5, 3)):
    q, k, v, g, beta, s0 = make_inputs(list(lens), 2, 2, 2, 4, 4)
    return dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu_of(lens)), s0


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a, s0: a.update(q=a["q"][:, :1].repeat(1, 3, 1), g=a["g"][:, :1].repeat(1, 3),
                                beta=a["beta"][:, :1].repeat(1, 3)), "HQ and HV"),
        (lambda a, s0: a.update(k=a["k"][:, :1]), "HK must equal"),
        (lambda a, s0: a.update(k=a["k"][..., :3]), "same head dim K"),
        (lambda a, s0: a.update(v=a["v"][:-1]), "same number of tokens"),
        (lambda a, s0: a.update(g=a["g"][:, :1], beta=a["beta"][:, :1]), "HO = max"),
        (lambda a, s0: a.update(beta=a["beta"][:-1]), "beta must have the shape of g"),
        (lambda a, s0: a.update(q=a["q"][0]), "q must be 3-D"),
        (lambda a, s0: a.update(cu_seqlens=torch.tensor([0, 5, 8.0])), "int32 or int64"),
        (lambda a, s0: a.update(cu_seqlens=torch.tensor([0, 5, 9], dtype=torch.int32)), r"cu_seqlens\[-1\]"),
        (lambda a, s0: a.update(cu_seqlens=torch.tensor([1, 5, 8], dtype=torch.int32)), r"cu_seqlens\[0\]"),
        (lambda a, s0: a.update(cu_seqlens=torch.tensor([0, 9, 8], dtype=torch.int32)), "non-decreasing"),
        (lambda a, s0: a.update(checkpoint_every_n_tokens=96), "multiple of the chunk size"),
        (lambda a, s0: a.update(checkpoint_every_n_tokens=0), "multiple of the chunk size"),
        (lambda a, s0: a.update(initial_state=s0[:1]), "initial_state must have shape"),
        (lambda a, s0: a.update(initial_state=s0, state_indices=torch.tensor([0, 1], dtype=torch.int32),
                                checkpoint_every_n_tokens=64), "mutually exclusive"),
        (lambda a, s0: a.update(state_indices=torch.tensor([0, 1], dtype=torch.int32)),
         "requires initial_state"),
        (lambda a, s0: a.update(initial_state=s0, state_indices=torch.tensor([0, 2], dtype=torch.int32)),
         r"\[0, N_pool=2\)"),
        (lambda a, s0: a.update(initial_state=s0, state_indices=torch.tensor([1, 1], dtype=torch.int32)),
         "distinct"),
        (lambda a, s0: a.update(initial_state=s0, state_indices=torch.tensor([0.0, 1.0])), "int32"),
        (lambda a, s0: a.update(initial_state=s0, state_indices=torch.tensor([0], dtype=torch.int32)),
         "shape \\[N\\]"),
        (lambda a, s0: a.update(scale=float("nan")), "scale must be finite"),
        (lambda a, s0: a.update(compute_dtype=torch.float16), "compute_dtype"),
    ],
)
@pytest.mark.parametrize("ref", REFS)
def test_validation(ref, change, match):
    args, s0 = _valid()
    change(args, s0)
    a = dict(args)
    pos = [a.pop(n) for n in ("q", "k", "v", "g", "beta", "cu_seqlens")]
    with pytest.raises(ValueError, match=match):
        ref(*pos, **a)


def test_summary_validation():
    args, _ = _valid()
    with pytest.raises(ValueError, match="must divide"):
        summary_reference(args["k"], args["v"], args["g"][:, :1], args["beta"][:, :1], args["cu_seqlens"])
    with pytest.raises(ValueError, match="same number of tokens"):
        summary_reference(args["k"], args["v"][:-1], args["g"], args["beta"], args["cu_seqlens"])


def test_chunk_size_constant():
    assert CHUNK_SIZE == 64
