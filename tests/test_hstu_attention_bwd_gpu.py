"""HSTU attention backward (HSTUBwdSm90) on the GPU, from precompiled artifacts.

Every kernel used here is one of the static configurations of tests/gpu_plan.toml. Gradient
buffers are poisoned with NaN before every launch and compared against torch.autograd on the
fp32 reference (computed on the GPU, TF32 off): max|g - ref| / max|ref| < TOL[dtype] per
gradient. Gradients of keys that no query sees, and of queries that see no key, must be
exact zeros. Runs that compute the same math (views vs copies, graph replay vs eager,
autograd vs the function, repeated runs) must be bitwise equal, except dq of the default
(fused) kernel, whose fp32 reduce-adds land in a varying order: there equal to within a few
bf16 rounding steps.
"""
import math
from dataclasses import replace

import pytest
import torch
from test_hstu_attention_gpu import (BF, DEV, DTYPES, EQUAL, FP, H, HEAD_DIMS, RAGGED_K,
                                     RAGGED_Q, Batch, make_batch, with_func)

from precast import HSTUBwdSm90, TensorDesc, hstu_attention, hstu_attention_backward
from precast.lifecycle import hstu_attention_bwd as bwd_module
from precast.reference.hstu_attention import (FUNC_PAD_COLUMNS, hstu_attention_backward_reference,
                                              visible_mask)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_matmuls")]
TOL = {BF: 4e-2, FP: 2e-2}
WINDOWS = [(-1, -1), (-1, 0), (256, 0), (7, 33), (64, -1), (-1, 5)]
_OPS = {}


def get_op(dtype, d, *, hkv=H, window=(-1, 0), func=0, deterministic=False) -> HSTUBwdSm90:
    """One compiled op per (static configuration, window values); every launch passes
    max_seqlen_q/k and alpha, so the descriptor batch only has to be valid."""
    key = (dtype, d, hkv, tuple(window), func, deterministic)
    op = _OPS.get(key)
    if op is None:
        batch, seqlen = 8, 128
        tokens = batch * seqlen
        cu = TensorDesc(torch.int32, (batch + 1,))
        q = TensorDesc(dtype, (tokens, H, d))
        kv = TensorDesc(dtype, (tokens, hkv, d))
        f = TensorDesc(torch.int32, (1, func, tokens + FUNC_PAD_COLUMNS)) if func else None
        op = _OPS[key] = HSTUBwdSm90(q, q, kv, kv, None, None, None, cu, cu, seqlen, seqlen,
                                     window, sample_func=f,
                                     deterministic=deterministic).check_support().compile()
    return op


def with_do(b: Batch, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed + 1000)
    return torch.randn(b.q.shape, device=DEV, generator=g).to(b.dtype)


def assert_same(got, want, op, what=""):
    """dq, dk, dv of two launches: bitwise, but dq of the fused kernel only up to the order
    of its fp32 additions (then rounded to 16 bits)."""
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        if name == "dq" and op.fused:
            scale = y.float().abs().max().item()
            diff = (x.float() - y.float()).abs().max().item()
            assert diff <= 1e-2 * scale, f"{what}: dq differs by {diff:.3g} (max {scale:.3g})"
        else:
            assert torch.equal(x, y), f"{what}: {name} differs"


def poisoned_grads(b: Batch):
    return tuple(torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEV)
                 for t in (b.q, b.k, b.v))


def launch(op, b: Batch, do, grads=None, *, alpha=None, scaling_seqlen=None, stream=None,
           sync=True, workspace=None):
    grads = poisoned_grads(b) if grads is None else grads
    op.execute(do, b.q, b.k, b.v, *grads, b.cu_q, b.cu_k, b.func, stream,
               alpha=1 / math.sqrt(b.d) if alpha is None else alpha,
               scaling_seqlen=scaling_seqlen, max_seqlen_q=b.max_q, max_seqlen_k=b.max_k,
               workspace=workspace)
    if sync:
        torch.cuda.synchronize()
    return grads


def reference(b: Batch, do, window, *, alpha=None, scaling_seqlen=None):
    return hstu_attention_backward_reference(
        do, b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k, scaling_seqlen=scaling_seqlen,
        window_size=window, alpha=1 / math.sqrt(b.d) if alpha is None else alpha,
        func_tensor=b.func, compute_dtype=torch.float32)


def unseen(b: Batch, window):
    """(dead query rows (T_q,), unseen key rows (T_k,)) as bool masks."""
    dead_q, dead_k = [], []
    start_q = 0
    for lq, lk in zip(b.lens_q, b.lens_k):
        func = b.func[0, :, start_q:start_q + lq] if b.func is not None else None
        m = visible_mask(lq, lk, window, func, device=DEV)
        dead_q.append(~m.any(dim=1))
        dead_k.append(~m.any(dim=0))
        start_q += lq
    return torch.cat(dead_q), torch.cat(dead_k)


def check(grads, b: Batch, do, window, *, alpha=None, scaling_seqlen=None, what=""):
    ref = reference(b, do, window, alpha=alpha, scaling_seqlen=scaling_seqlen)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        assert not torch.isnan(g).any(), f"{what}: {name} not fully written (NaN left)"
        scale = r.float().abs().max().item()
        assert scale > 0, f"{what}: the {name} reference is all zeros (a trivial test)"
        err = ((g.float() - r.float()).abs().max() / scale).item()
        assert err < TOL[b.dtype], f"{what}: {name}: max|g - ref| / max|ref| = {err:.3g}"
    dead_q, dead_k = unseen(b, window)
    dq, dk, dv = grads
    if dead_q.any():
        assert torch.count_nonzero(dq[dead_q]) == 0, f"{what}: dq of a query seeing no key"
    if dead_k.any():
        assert torch.count_nonzero(dk[dead_k]) == 0, f"{what}: dk of a key no query sees"
        assert torch.count_nonzero(dv[dead_k]) == 0, f"{what}: dv of a key no query sees"
    return dead_q.any().item(), dead_k.any().item()


# --- masks, head dims, dtypes -------------------------------------------------------------
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_window_masks(dtype, d, window):
    """Every window kind x D x dtype on a ragged batch (0/1-token sequences, max_seqlen_q <
    max_seqlen_k, keys longer than queries) and on equal lengths."""
    op = get_op(dtype, d, window=window)
    b = make_batch(RAGGED_Q, RAGGED_K, d, dtype, seed=d)
    do = with_do(b, d)
    check(launch(op, b, do), b, do, window, what="ragged")
    check(launch(op, b, do, scaling_seqlen=123.5), b, do, window, scaling_seqlen=123.5,
          what="ragged, scaling_seqlen=123.5")
    e = make_batch(EQUAL, EQUAL, d, dtype, seed=d + 1)
    do_e = with_do(e, d + 1)
    check(launch(op, e, do_e), e, do_e, window, what="equal lengths")


def test_unseen_keys_and_dead_queries_get_exact_zeros():
    """A local window leaves the first keys of long-key sequences unseen; sequences with
    fewer keys than queries leave queries that see nothing."""
    window = (7, 33)
    b = make_batch([16, 200, 3, 130, 64], [216, 40, 0, 300, 64], 128, BF, seed=5)
    do = with_do(b, 5)
    dead_q, dead_k = check(launch(get_op(BF, 128, window=window), b, do), b, do, window)
    assert dead_q and dead_k  # both kinds occur in this batch


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_func_masks(dtype, d, n):
    """Arbitrary masks: overlapping, unordered intervals, dead rows, unseen keys."""
    b = with_func(make_batch(RAGGED_Q, RAGGED_K, d, dtype, seed=d + n), n, seed=d + n)
    do = with_do(b, d + n)
    check(launch(get_op(dtype, d, window=(-1, -1), func=n), b, do), b, do, (-1, -1))


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0)], ids=["full", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hkv", [2, 1])
def test_gqa_mqa(hkv, d, window):
    """dk, dv of a kv head sum over the query heads that share it."""
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, hkv=hkv, seed=hkv * d)
    do = with_do(b, hkv * d)
    check(launch(get_op(BF, d, hkv=hkv, window=window), b, do), b, do, window)


def test_many_sequences_and_empty_ones():
    """B = 100 with lengths 0..300 (some sequences without queries: their keys' gradients
    are zero), and a batch whose every query length is 0."""
    g = torch.Generator().manual_seed(3)
    lens_q = torch.randint(0, 301, (100,), generator=g)
    lens_q[::17] = 0
    lens_k = lens_q + torch.randint(0, 50, (100,), generator=g)
    b = make_batch(lens_q.tolist(), lens_k.tolist(), 64, BF, seed=3)
    do = with_do(b, 3)
    for window in ((-1, 0), (-1, -1)):
        check(launch(get_op(BF, 64, window=window), b, do), b, do, window, what=str(window))
    e = make_batch([0, 0, 0], [5, 130, 0], 64, BF, seed=4, max_q=0)
    dq, dk, dv = launch(get_op(BF, 64, window=(-1, -1)), e, with_do(e, 4))
    assert dq.numel() == 0 and torch.count_nonzero(dk) == 0 and torch.count_nonzero(dv) == 0
    assert not torch.isnan(dk).any() and not torch.isnan(dv).any()


@pytest.mark.parametrize("d,deterministic", [(64, False), (128, False), (128, True), (256, False)])
def test_heavy_tailed_batch(d, deterministic):
    """One long sequence among many short and empty ones: nearly every CTA of a grid sized by
    max_seqlen would have no rows, so the kernels number only the fixed tiles that exist
    (compact numbering); every gradient row must still be written once."""
    lens = [1500, 0, 1, 37, 0, 5, 2, 128, 3, 1, 0, 700, 129, 0, 64, 2]
    b = make_batch(lens, lens, d, BF, seed=11)
    do = with_do(b, 11)
    windows = ((-1, 0),) if deterministic else ((-1, 0), (-1, -1))
    for window in windows:
        op = get_op(BF, d, window=window, deterministic=deterministic)
        check(launch(op, b, do), b, do, window, what=f"{window} deterministic={deterministic}")


# --- determinism, layouts -----------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_mode_is_bitwise_identical_across_runs(d):
    """deterministic=True: five runs give bitwise-identical dq, dk, dv (long sequences)."""
    b = make_batch([1000, 3000, 17], [1000, 3000, 17], d, BF, seed=7)
    op = get_op(BF, d, window=(-1, 0), deterministic=True)
    assert not op.fused
    do = with_do(b, 7)
    first = launch(op, b, do)
    check(first, b, do, (-1, 0))
    for _ in range(4):
        again = launch(op, b, do)
        assert all(torch.equal(x, y) for x, y in zip(again, first))


def test_default_mode_repeats():
    """The default op (GQA, long sequences): five runs agree (bitwise, or for a fused dq up
    to the order of its fp32 additions); a fused op's workspace is left zero each time."""
    b = make_batch([1000, 3000, 17], [1000, 3000, 17], 128, BF, hkv=2, seed=8)
    op = get_op(BF, 128, hkv=2, window=(-1, 0))
    do = with_do(b, 8)
    ws = torch.zeros(op.workspace_shape(b.q.shape[0]), dtype=torch.float32, device=DEV)
    first = launch(op, b, do, workspace=ws)
    check(first, b, do, (-1, 0))
    assert torch.count_nonzero(ws) == 0
    for _ in range(4):
        assert_same(launch(op, b, do, workspace=ws), first, op)
        assert torch.count_nonzero(ws) == 0


@pytest.mark.parametrize("group_pairs", [1, 3])
@pytest.mark.parametrize("dtype,d,hkv", [(BF, 128, H), (FP, 64, H), (BF, 64, 2), (BF, 128, 1),
                                         (FP, 32, H)], ids=["bf16-128", "fp16-64", "bf16-64-gqa",
                                                            "bf16-128-mqa", "fp16-32"])
def test_dq_converted_behind_small_l2_groups(monkeypatch, dtype, d, hkv, group_pairs):
    """L2 groups of group_pairs (sequence, kv head) pairs (the last one smaller): the fused
    kernel's idle warps convert each finished group's dQ while later groups run and
    dq_finish converts the rest. dq right (sequences of 0 and 1 tokens among long ones),
    the workspace (accumulator and sync words) zero after every launch, repeats agree."""
    lens = [1000, 1000, 999, 1, 0, 1000, 900, 1000]  # dense numbering: 8 tiles x 8 pairs
    tiles = 8
    monkeypatch.setattr(bwd_module, "L2_GROUP_BYTES", group_pairs * 128 * d * 8 * tiles)
    b = make_batch(lens, lens, d, dtype, hkv=hkv, seed=d + hkv)
    do = with_do(b, d + hkv)
    windows = ((-1, 0), (-1, -1)) if d == 128 and hkv == H else ((-1, 0),)
    for window in windows:
        op = get_op(dtype, d, hkv=hkv, window=window)
        assert op.kernel_modes() == ("fused", "dq_finish")
        plan = bwd_module.Launch.plan(d, hkv, b.k.shape[0], len(lens), b.max_k, 1 << 31)
        assert plan == (0, group_pairs), plan  # dense, the groups asked for
        ws = torch.zeros(op.workspace_shape(b.q.shape[0]), dtype=torch.float32, device=DEV)
        first = launch(op, b, do, workspace=ws)
        check(first, b, do, window, what=str(window))
        assert torch.count_nonzero(ws) == 0, "workspace not left zero"
        assert_same(launch(op, b, do, workspace=ws), first, op, "again")
        assert torch.count_nonzero(ws) == 0, "workspace not left zero"


def test_split_gradient_buffers_and_strided_inputs():
    """dk and dv as the two halves of one packed KV gradient buffer, dq a head-slice view;
    q, k, v column slices of one fused projection: bitwise equal to compact buffers, and
    nothing outside the views is written."""
    d, t = 64, sum(RAGGED_Q)
    window = (-1, 0)
    b = make_batch(RAGGED_Q, RAGGED_Q, d, BF, seed=9)
    do = with_do(b, 9)
    op = get_op(BF, d, window=window)
    expect = launch(op, b, do)
    check(expect, b, do, window)
    fused = torch.randn(t, 3, H, d, device=DEV).to(BF)
    fused[:, 0], fused[:, 1], fused[:, 2] = b.q, b.k, b.v
    views = replace(b, q=fused[:, 0], k=fused[:, 1], v=fused[:, 2])
    dkv = torch.full((t, 2, H, d), 7.0, dtype=BF, device=DEV)
    dq_wide = torch.full((t, H + 2, d), 7.0, dtype=BF, device=DEV)
    grads = (dq_wide[:, 1:H + 1], dkv[:, 0], dkv[:, 1])
    for g in grads:
        g.fill_(float("nan"))
    launch(op, views, do, grads)
    assert_same(grads, expect, op, "views")
    assert torch.all(dq_wide[:, 0] == 7) and torch.all(dq_wide[:, H + 1] == 7)
    # The allocating function writes supplied split buffers in place and returns them.
    dkv.fill_(float("nan"))
    out = hstu_attention_backward(do, views.q, views.k, views.v, b.cu_q, b.cu_k, b.max_q,
                                  b.max_k, window_size=window, alpha=1 / math.sqrt(d),
                                  dk_tensor=dkv[:, 0], dv_tensor=dkv[:, 1])
    assert out.dk_tensor.data_ptr() == dkv[:, 0].data_ptr()
    assert_same((out.dq_tensor, dkv[:, 0], dkv[:, 1]), expect, op, "function")


def test_unreadable_layouts_are_copied_by_the_function():
    """A non-contiguous head dim (transposed view) is copied; a gradient buffer with such a
    layout is written through a temporary."""
    d = 64
    b = make_batch([100, 37], [100, 37], d, BF, seed=11)
    do = with_do(b, 11)
    op = get_op(BF, d, window=(-1, -1))
    expect = launch(op, b, do)
    q_t = b.q.transpose(1, 2).contiguous().transpose(1, 2)  # last dim stride H
    dv_t = torch.full(b.v.shape[::-1], float("nan"), dtype=BF, device=DEV).permute(2, 1, 0)
    out = hstu_attention_backward(do, q_t, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                  window_size=(-1, -1), alpha=1 / math.sqrt(d), dv_tensor=dv_t)
    assert out.dv_tensor is dv_t
    assert_same(tuple(out), expect, op, "copies")


# --- capture, autograd ----------------------------------------------------------------------
def test_cuda_graph_capture_and_replay():
    """execute() captured in a CUDA graph (with a caller-owned dQ workspace) allocates
    nothing; replays after in-place edits of q and do equal eager runs."""
    from precast.graphs import CudaGraph
    d = 128
    b = with_func(make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=21), 3, seed=21)
    do = with_do(b, 21)
    op = get_op(BF, d, window=(-1, -1), func=3)
    grads = poisoned_grads(b)
    ws = torch.zeros(op.workspace_shape(b.q.shape[0]), dtype=torch.float32, device=DEV)
    torch.cuda.synchronize()
    graph = CudaGraph()
    before = torch.cuda.memory_allocated()
    with graph.capture() as s:
        launch(op, b, do, grads, stream=s, sync=False, workspace=ws)
    assert torch.cuda.memory_allocated() == before, "capture allocated device memory"
    assert torch.isnan(grads[0]).all(), "capture ran the kernels"
    g = torch.Generator(device=DEV).manual_seed(22)
    previous = None
    for step in range(3):
        if step == 1:
            b.q.copy_(torch.randn(b.q.shape, device=DEV, generator=g).to(BF))
        if step == 2:
            do.copy_(torch.randn(do.shape, device=DEV, generator=g).to(BF))
        for t in grads:
            t.fill_(float("nan"))
        torch.cuda.synchronize()
        graph.replay()
        graph.synchronize()
        assert torch.count_nonzero(ws) == 0
        assert_same(grads, launch(op, b, do), op, f"step {step}")
        check(grads, b, do, (-1, -1), what=f"replay step {step}")
        if previous is not None:
            assert not torch.equal(grads[0], previous), f"step {step}: the change was not seen"
        previous = grads[0].clone()
    graph.close()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "torch_compile"])
def test_autograd(compiled):
    """loss.backward() through hstu_attention gives the function's gradients (bitwise) and
    the reference's; under torch.compile(fullgraph=True) as well."""
    d, window = 64, (-1, 0)
    alpha = 1 / math.sqrt(d)
    b = make_batch(RAGGED_Q, RAGGED_K, d, BF, seed=31)
    do = with_do(b, 31)
    leaves = [t.clone().requires_grad_(True) for t in (b.q, b.k, b.v)]

    def forward(q, k, v):
        return hstu_attention(q, k, v, b.cu_q, b.cu_k, b.max_q, b.max_k, window_size=window,
                              alpha=alpha)

    fn = torch.compile(forward, fullgraph=True) if compiled else forward
    o = fn(*leaves)
    (o.float() * do.float()).sum().backward()
    torch.cuda.synchronize()
    expect = hstu_attention_backward(do, b.q, b.k, b.v, b.cu_q, b.cu_k, b.max_q, b.max_k,
                                     window_size=window, alpha=alpha)
    assert_same(tuple(leaf.grad for leaf in leaves), tuple(expect), get_op(BF, d, window=window))
    check(tuple(leaf.grad for leaf in leaves), b, do, window)


def test_capture_without_workspace_on_a_new_stream():
    """A fused op cannot allocate its dQ workspace during capture: it says so, and still
    works afterwards; an op without a workspace captures on any stream."""
    from precast.graphs import CudaGraph
    b = make_batch([64, 100], [64, 100], 64, BF, seed=41)
    do = with_do(b, 41)
    batch, seqlen = 2, 128
    cu = TensorDesc(torch.int32, (batch + 1,))
    q = TensorDesc(BF, (batch * seqlen, H, 64))
    op = HSTUBwdSm90(q, q, q, q, None, None, None, cu, cu, seqlen, seqlen, (-1, 0)
                     ).check_support().compile()  # a fresh instance: no workspace yet
    torch.cuda.synchronize()
    graph = CudaGraph()
    grads = poisoned_grads(b)
    if op.fused:
        with pytest.raises(RuntimeError, match="workspace"):
            with graph.capture() as s:
                launch(op, b, do, grads, stream=s, sync=False)
    else:
        with graph.capture() as s:
            launch(op, b, do, grads, stream=s, sync=False)
        graph.replay()
        graph.synchronize()
        check(grads, b, do, (-1, 0), what="replay")
    graph.close()
    check(launch(op, b, do), b, do, (-1, 0))
