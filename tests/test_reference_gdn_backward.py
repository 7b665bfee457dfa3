"""The chunked Gated DeltaNet backward with explicit formulas
(precast/reference/gdn_backward.py: the math for the backward kernels) against autograd of
the token-by-token reference, in float64 on the CPU: ragged batches with empty and
one-token sequences, grouped heads both ways, with and without the L2 norm, an initial
state and a final-state gradient, and the states taken from the forward's checkpoints
(every chunk, or every two chunks with the one between regenerated). Also a
finite-difference gradcheck of the reference path on a tiny case."""
import pytest
import torch

from precast.reference.gated_delta_net import gdn_recurrent_reference, l2norm_rows
from precast.reference.gdn_backward import gdn_chunked_backward_reference
from precast.reference.offsets import offsets_from_lengths

F64 = dict(dtype=torch.float64)


def problem(lens, hq, hk, hv, K, V, seed, state=True, unit_qk=False):
    """Random inputs; ``unit_qk``: unit q, k rows (without the in-kernel norm the delta
    rule diverges for |beta k|^2 >> 1, and so do its gradients)."""
    g = torch.Generator().manual_seed(seed)
    T, HO = sum(lens), max(hq, hv)
    unit = l2norm_rows if unit_qk else (lambda t: t)
    x = {"q": unit(torch.randn(T, hq, K, generator=g, **F64)),
         "k": unit(torch.randn(T, hk, K, generator=g, **F64)),
         "v": torch.randn(T, hv, V, generator=g, **F64),
         "g": torch.nn.functional.logsigmoid(torch.randn(T, HO, generator=g, **F64) + 2.0),
         "beta": torch.rand(T, HO, generator=g, **F64)}
    if state:
        x["initial_state"] = 0.3 * torch.randn(len(lens), HO, V, K, generator=g, **F64)
    cu = offsets_from_lengths(lens)
    do = torch.randn(T, HO, V, generator=g, **F64)
    dfinal = torch.randn(len(lens), HO, V, K, generator=g, **F64)
    return x, cu, do, dfinal


def assert_close(got, want, name):
    """Relative to the gradient's largest element (float64 rounding of the products)."""
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1e-300)).item()
    assert err < 1e-10, f"{name}: max|got - want| / max|want| = {err:.3g}"


def autograd_grads(x, cu, do, dfinal, l2norm, n=None):
    leaves = {name: t.clone().requires_grad_() for name, t in x.items()}
    ref = gdn_recurrent_reference(**leaves, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                  checkpoint_every_n_tokens=n)
    loss = (ref["o"] * do).sum()
    if dfinal is not None:
        loss = loss + (ref["final_state"] * dfinal).sum()
    loss.backward()
    return {"d" + name: t.grad for name, t in leaves.items()}, ref


@pytest.mark.parametrize("lens,heads,dims,l2norm,state,with_dfinal", [
    ([130, 1, 0, 64, 65], (2, 2, 4), (16, 8), True, True, True),
    ([7] * 5 + [1] * 3, (4, 2, 2), (8, 16), False, True, False),
    ([200], (1, 1, 1), (16, 16), True, False, True),
    ([64, 63, 129], (2, 2, 2), (8, 8), False, False, False),
])
def test_chunked_backward_equals_autograd(lens, heads, dims, l2norm, state, with_dfinal):
    x, cu, do, dfinal = problem(lens, *heads, *dims, seed=len(lens), state=state,
                                unit_qk=not l2norm)
    dfinal = dfinal if with_dfinal else None
    want, _ = autograd_grads(x, cu, do, dfinal, l2norm)
    got = gdn_chunked_backward_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], cu, do, dfinal=dfinal,
        initial_state=x.get("initial_state"), use_qk_l2norm_in_kernel=l2norm)
    for name in ("dq", "dk", "dv", "dg", "dbeta") + (("dinitial_state",) if state else ()):
        assert_close(got[name], want[name], name)


@pytest.mark.parametrize("n", [64, 128])
def test_checkpointed_states_give_the_same_gradients(n):
    """States read from the forward's checkpoints (every n tokens; at n = 128 the chunk in
    between is regenerated) instead of recomputed from the initial state."""
    lens = [300, 0, 1, 192]
    x, cu, do, dfinal = problem(lens, 2, 2, 2, 16, 8, seed=7)
    want, ref = autograd_grads(x, cu, do, dfinal, True, n=n)
    got = gdn_chunked_backward_reference(
        x["q"], x["k"], x["v"], x["g"], x["beta"], cu, do, dfinal=dfinal,
        initial_state=x["initial_state"], use_qk_l2norm_in_kernel=True,
        checkpoints=ref["checkpoints"].detach(), checkpoint_every_n_tokens=n)
    for name in ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"):
        assert_close(got[name], want[name], name)


def test_checkpoints_are_used_not_recomputed():
    """A perturbed checkpoint changes the gradients of its chunks only: the backward reads
    the states it is given."""
    lens = [256]
    x, cu, do, dfinal = problem(lens, 1, 1, 1, 8, 8, seed=3, unit_qk=True)
    _, ref = autograd_grads(x, cu, do, dfinal, False, n=128)
    ckpt = ref["checkpoints"].detach()
    base = gdn_chunked_backward_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, do,
                                          dfinal=dfinal, initial_state=x["initial_state"],
                                          checkpoints=ckpt, checkpoint_every_n_tokens=128)
    bumped = ckpt.clone()
    bumped[1] += 1.0  # the state entering token 128
    moved = gdn_chunked_backward_reference(x["q"], x["k"], x["v"], x["g"], x["beta"], cu, do,
                                           dfinal=dfinal, initial_state=x["initial_state"],
                                           checkpoints=bumped, checkpoint_every_n_tokens=128)
    # chunks 2 and 3 (tokens 128..255) see another state: their dq changes; the dq of
    # chunks 0 and 1 depend only on the states before token 128
    assert not torch.allclose(moved["dq"][128:], base["dq"][128:])
    assert torch.equal(moved["dq"][:128], base["dq"][:128])


def test_reference_gradcheck_tiny():
    """Finite differences in float64 through the reference path (the ground truth the
    backward is checked against)."""
    x, cu, do, dfinal = problem([3, 2], 1, 1, 1, 4, 3, seed=11)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def f(*tensors):
        ref = gdn_recurrent_reference(**dict(zip(names, tensors)), cu_seqlens=cu,
                                      use_qk_l2norm_in_kernel=True)
        return ref["o"], ref["final_state"]
    inputs = tuple(x[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("l2norm", [True, False])
def test_state_gradient_is_affine_in_dfinal_through_the_forward_transition(l2norm):
    """What a chunk-parallel scan of the backward's state recurrence relies on (NOTES: the
    segment-parallel plan): per span, the state gradient entering it is
    dfinal @ transition^T + (the gradient with dfinal = 0), with ``transition`` the
    forward's span summary (summary_reference). A segment's backward map is the transpose
    of its forward one."""
    from precast.reference.gated_delta_net import summary_reference
    x, cu, do, dfinal = problem([130, 0, 1, 64, 200], 2, 2, 4, 16, 8, seed=7, state=True,
                                unit_qk=not l2norm)
    args = dict(cu_seqlens=cu, do=do, use_qk_l2norm_in_kernel=l2norm)
    with_dfinal = gdn_chunked_backward_reference(**x, dfinal=dfinal, **args)
    without = gdn_chunked_backward_reference(**x, **args)
    transition = summary_reference(x["k"], x["v"], x["g"], x["beta"], cu,
                                   use_qk_l2norm_in_kernel=l2norm)["transition"]
    want = dfinal @ transition.transpose(-1, -2) + without["dinitial_state"]
    assert_close(with_dfinal["dinitial_state"], want, "dinitial_state")


@pytest.mark.parametrize("length", [64, 37])
def test_chunk_kernel_products_equal_the_reference_chain_rule(length):
    """What the chunk kernel (gdn_bwd_chunk_sm90) computes instead of the reference's
    dW, dT and dBk (session 48): with Z = diag(beta) V - diag(beta gamma) K S (so
    Delta = T Z), dT = dDelta Z^T, hence T^T dT = (T^T dDelta) Z^T, and
    dBk = T^T dW = -(T^T dDelta) S^T; since session 50 (gdn-qovda merged) also dA's
    product (T^T dT) T^T = (T^T dDelta) Delta^T; and what an unmerged branch uses (NOTES,
    session 48): the split T^T dDelta = (T^T M^T) dO + (T^T Kd) dS' (gdn-tddf, measured
    slower in session 49). One chunk (a partial one too), float64."""
    from precast.reference.gated_delta_net import _chunk_factors, to_chunks
    HO, K, V, scale = 2, 16, 8, 0.25
    x, _, do, _ = problem([length], HO, HO, HO, K, V, seed=5, state=False)
    g = torch.Generator().manual_seed(6)
    G, Gamma, T, U, W, Kd, _, kc, _, _ = _chunk_factors(x["k"], x["v"], x["g"], x["beta"], 64)
    G, Gamma, T, U, W, Kd, kc = (t[:, 0] for t in (G, Gamma, T, U, W, Kd, kc))
    qc, vc, beta, dOs = (to_chunks(t, 64)[:, 0] for t in (x["q"], x["v"], x["beta"], scale * do))
    S = torch.randn(HO, K, V, generator=g, **F64)
    dSn = torch.randn(HO, K, V, generator=g, **F64)
    tr = lambda t: t.transpose(-1, -2)  # noqa: E731
    gamma = torch.exp(G)
    M = Gamma * (qc @ tr(kc))  # Gamma is zero above the diagonal
    Bv, Bk = beta[..., None] * vc, (beta * gamma)[..., None] * kc
    # the reference's chain rule (precast/reference/gdn_backward.py, _chunk_backward)
    dDelta = Kd @ dSn + tr(M) @ dOs
    dW = -dDelta @ tr(S)
    dT = dDelta @ tr(Bv) + dW @ tr(Bk)
    dBk = tr(T) @ dW
    # the kernel's forms
    Z = Bv - Bk @ S
    assert_close(T @ Z, U - W @ S, "Delta = T Z")
    tdd = tr(T) @ dDelta
    assert_close(dDelta @ tr(Z), dT, "dT = dDelta Z^T")
    assert_close(tdd @ tr(Z), tr(T) @ dT, "T^T dT = (T^T dDelta) Z^T")
    # dA's product without T^T dT (the kernel's since session 50)
    assert_close(tdd @ tr(T @ Z), tr(T) @ dT @ tr(T), "(T^T dT) T^T = (T^T dDelta) Delta^T")
    assert_close(-tdd @ tr(S), dBk, "dBk = -(T^T dDelta) S^T")
    assert_close((tr(T) @ tr(M)) @ dOs + (tr(T) @ Kd) @ dSn, tdd, "T^T dDelta, split")
