"""HSTU LMSD on the GPU, from precompiled artifacts (tests/gpu_plan.toml).

Every check poisons its outputs first (NaN / 0x7F) and compares against the fp32
reference of precast.reference applied with the kernel's own mask; the mask itself
must equal the reference Philox mask bit for bit.
"""
import pytest
import torch
from conftest import streams_of_every_kind

from precast import HstuLmsdBwdSm90, HstuLmsdFwdSm90, hstu_lmsd, hstu_lmsd_backward, hstu_lmsd_forward
from precast.reference.lmsd import lmsd_backward_reference, lmsd_forward_reference, lmsd_mask

pytestmark = pytest.mark.gpu
DEV = "cuda"
FLAGS = [(s, cu, cx) for s in (True, False) for cu in (True, False) for cx in (True, False)]
POISON_MASK = 0x7F


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def tol(dtype):
    return 1e-2 if dtype == torch.bfloat16 else 2e-3


def make_inputs(n, d, dtype, *, pad=0, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rows():
        base = torch.randn(n, d + pad, device=DEV, dtype=torch.float32, generator=g)
        return base.to(dtype)[:, :d] if pad else base.to(dtype)
    x, u = rows(), rows()
    x = x * 2 + 0.5  # non-zero mean, non-unit variance
    weight = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(d, device=DEV, generator=g)).to(dtype)
    return x, u, weight, bias


def poisoned_forward_outputs(n, d, seg, dtype, dropout, pad=0):
    y = torch.full((n, seg * d + pad), float("nan"), device=DEV, dtype=dtype)[:, :seg * d]
    mean = torch.full((n,), float("nan"), device=DEV)
    rstd = torch.full((n,), float("nan"), device=DEV)
    mask = torch.full((n, d), POISON_MASK, device=DEV, dtype=torch.int8) if dropout else None
    return y, mean, rstd, mask


def check_forward(n, d, dtype, silu, cu, cx, p, seed, pad=0):
    seg = 1 + cu + cx
    x, u, w, b = make_inputs(n, d, dtype, pad=pad, seed=seed + n)
    y, mean, rstd, mask = poisoned_forward_outputs(n, d, seg, dtype, p > 0, pad=pad)
    out = hstu_lmsd_forward(x, u, w, b, 1e-5, p, seed, silu, cu, cx, y_tensor=y,
                            mean_tensor=mean, rstd_tensor=rstd, mask_tensor=mask)
    torch.cuda.synchronize()
    assert out.y_tensor is y and out["mask_tensor"] is mask
    assert not torch.isnan(y).any(), "y not fully written"
    if p > 0:
        ref_mask = lmsd_mask(n, d, seed, p, cu, cx, device=DEV)
        assert torch.equal(mask, ref_mask), "dropout mask differs from the Philox reference"
    ref_y, ref_mean, ref_rstd, _ = lmsd_forward_reference(x, u, w, b, 1e-5, p, seed, silu, cu, cx,
                                                          mask=mask)
    assert rel_err(y, ref_y) < tol(dtype)
    torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, ref_rstd, rtol=1e-4, atol=1e-5)
    return x, u, w, b, y, mean, rstd, mask


@pytest.mark.parametrize("silu,cu,cx", FLAGS)
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_forward_every_flag(silu, cu, cx, p):
    check_forward(777, 256, torch.bfloat16, silu, cu, cx, p, seed=11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 520, 512, 1024, 4096])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_forward_widths(dtype, d, p):
    check_forward(301, d, dtype, True, True, True, p, seed=-5)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 17, 1025, 4099])
def test_one_compile_serves_every_n(n):
    op = HstuLmsdFwdSm90.from_config(dtype="bfloat16", dim=520, dropout=True, concat_u=True,
                                     concat_x=True).compile()
    x, u, w, b = make_inputs(n, 520, torch.bfloat16, seed=n)
    y, mean, rstd, mask = poisoned_forward_outputs(n, 520, 3, torch.bfloat16, True)
    op.execute(x, u, w, b, y, mean, rstd, mask, seed=123, dropout_ratio=0.2)
    torch.cuda.synchronize()
    if n:
        assert not torch.isnan(y).any()
        ref_y, _, _, _ = lmsd_forward_reference(x, u, w, b, 1e-5, 0.2, 123, True, True, True, mask=mask)
        assert torch.equal(mask, lmsd_mask(n, 520, 123, 0.2, True, True, device=DEV))
        assert rel_err(y, ref_y) < 1e-2


def test_padded_strides():
    check_forward(333, 512, torch.bfloat16, True, True, True, 0.1, seed=3, pad=24)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.7])
def test_keep_rate_within_binomial_bounds(p):
    n, d = 4096, 512
    x, u, w, b = make_inputs(n, d, torch.bfloat16)
    mask = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 2024, True, True, True).mask_tensor
    for bit in range(3):
        kept = ((mask.to(torch.int32) >> bit) & 1).double().mean().item()
        sigma = (p * (1 - p) / (n * d)) ** 0.5
        assert abs(kept - (1 - p)) < 6 * sigma, (bit, kept)


def test_seed_determines_mask():
    x, u, w, b = make_inputs(512, 512, torch.bfloat16)
    m1 = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.4, 7, True, True, True).mask_tensor.clone()
    m2 = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.4, 7, True, True, True).mask_tensor.clone()
    m3 = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.4, 8, True, True, True).mask_tensor.clone()
    m4 = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.4, -(2**63), True, True, True).mask_tensor
    assert torch.equal(m1, m2)
    assert (m1 != m3).float().mean().item() > 0.3
    assert torch.equal(m4, lmsd_mask(512, 512, -(2**63), 0.4, True, True, device=DEV))


def check_backward(n, d, dtype, silu, cu, cx, p, compute_dweight=True, pad=0, seed=5):
    x, u, w, b, y, mean, rstd, mask = check_forward(n, d, dtype, silu, cu, cx, p, seed, pad=pad)
    seg = 1 + cu + cx
    g = torch.Generator(device=DEV).manual_seed(seed + 1)
    dy = torch.randn(n, seg * d + pad, device=DEV, generator=g).to(dtype)[:, :seg * d]
    dx = torch.full((n, d), float("nan"), device=DEV, dtype=dtype)
    du = torch.full((n, d), float("nan"), device=DEV, dtype=dtype)
    dw = torch.full((d,), float("nan"), device=DEV, dtype=dtype) if compute_dweight else None
    db = torch.full((d,), float("nan"), device=DEV, dtype=dtype)
    out = hstu_lmsd_backward(dy, x, u, w, b, mean, rstd, mask, p, silu, cu, cx, compute_dweight,
                             dx_tensor=dx, du_tensor=du, dweight_tensor=dw, dbias_tensor=db)
    torch.cuda.synchronize()
    assert out.dx_tensor is dx and out["dbias_tensor"] is db
    ref = lmsd_backward_reference(dy, x, u, w, b, mean, rstd, mask, p, silu, cu, cx,
                                  compute_dweight)
    for name, got, want in zip(("dx", "du", "dweight", "dbias"), out, ref):
        if want is None:
            assert got is None
            continue
        assert not torch.isnan(got).any(), f"{name} not fully written"
        assert rel_err(got, want) < tol(dtype), name
    return dy, x, u, w, b, mean, rstd, mask, out


@pytest.mark.parametrize("silu,cu,cx", FLAGS)
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("compute_dweight", [True, False])
def test_backward_every_flag(silu, cu, cx, p, compute_dweight):
    check_backward(1001, 256, torch.bfloat16, silu, cu, cx, p, compute_dweight)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 520, 512, 1024, 4096])
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_backward_widths(dtype, d, p):
    check_backward(517, d, dtype, True, True, True, p)


@pytest.mark.parametrize("n", [1, 2, 3, 4099])
def test_backward_small_and_odd_n(n):
    check_backward(n, 512, torch.bfloat16, True, True, True, 0.1, pad=8)


def test_backward_zero_rows_gives_zero_param_grads():
    d = 512
    x, u, w, b = make_inputs(0, d, torch.bfloat16)
    dy = torch.empty(0, 3 * d, device=DEV, dtype=torch.bfloat16)
    mean = torch.empty(0, device=DEV)
    mask = torch.empty(0, d, device=DEV, dtype=torch.int8)
    out = hstu_lmsd_backward(dy, x, u, w, b, mean, mean.clone(), mask, 0.1, True, True, True)
    torch.cuda.synchronize()
    assert torch.count_nonzero(out.dweight_tensor) == 0 and torch.count_nonzero(out.dbias_tensor) == 0


def test_backward_is_deterministic():
    dy, x, u, w, b, mean, rstd, mask, out = check_backward(20000, 512, torch.bfloat16, True, True,
                                                           True, 0.1)
    first = [t.clone() for t in out]
    for _ in range(3):
        again = hstu_lmsd_backward(dy, x, u, w, b, mean, rstd, mask, 0.1, True, True, True)
        torch.cuda.synchronize()
        for a, b_ in zip(first, again):
            assert torch.equal(a, b_)


def test_autograd_training_step():
    n, d = 640, 256
    x, u, w, b = make_inputs(n, d, torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (x, u, w, b)]
    y = hstu_lmsd(*leaves, eps=1e-5, dropout_ratio=0.2, seed=99, apply_u_silu=True,
                  concat_u=True, concat_x=True)
    g = torch.randn_like(y)
    y.backward(g)
    _, mean, rstd, mask = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.2, 99, True, True, True)
    ref = lmsd_backward_reference(g, x, u, w, b, mean, rstd, mask, 0.2, True, True, True)
    for leaf, want in zip(leaves, ref):
        assert rel_err(leaf.grad, want) < 1e-2


def test_streams_of_every_kind():
    from cuda.bindings import driver
    from precast.graphs import check
    n, d = 1000, 512
    x, u, w, b = make_inputs(n, d, torch.bfloat16)
    expect = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.1, 5, True, True, True).y_tensor.clone()
    with streams_of_every_kind() as streams:
        torch.cuda.synchronize()
        for stream in streams:
            y = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.1, 5, True, True, True,
                                  stream=stream).y_tensor
            torch.cuda.synchronize()
            check(driver.cuCtxSynchronize())
            assert torch.equal(y, expect), type(stream).__name__


def test_cuda_graph_capture_and_replay():
    from precast.graphs import CudaGraph
    n, d, p = 2048, 512, 0.1
    x, u, w, b = make_inputs(n, d, torch.bfloat16)
    fwd = HstuLmsdFwdSm90(x, u, w, b, dropout_ratio=p, concat_u=True, concat_x=True).compile()
    y, mean, rstd, mask = poisoned_forward_outputs(n, d, 3, torch.bfloat16, True)
    dy = torch.randn_like(y)
    dx, du = torch.empty_like(x), torch.empty_like(u)
    dw, db = torch.empty_like(w), torch.empty_like(b)
    bwd = HstuLmsdBwdSm90(dy, x, u, w, b, mean, rstd, mask, dx, du, dw, db, dropout_ratio=p,
                          concat_u=True, concat_x=True).compile()
    ws = bwd.make_workspace(x.device)
    counter = torch.zeros(fwd.workspace_shape(), dtype=torch.int32, device=DEV)
    torch.cuda.synchronize()
    graph = CudaGraph()
    before = torch.cuda.memory_allocated()
    with graph.capture() as s:
        fwd.execute(x, u, w, b, y, mean, rstd, mask, seed=77, stream=s, workspace=counter)
        bwd.execute(dy, x, u, w, b, mean, rstd, mask, dx, du, dw, db, ws, stream=s)
    assert torch.cuda.memory_allocated() == before, "capture allocated device memory"
    assert graph.num_nodes() == 3
    for step in range(2):
        x.copy_(torch.randn_like(x) * (step + 1))  # inputs change in place between replays
        dy.copy_(torch.randn_like(dy))
        graph.replay()
        graph.synchronize()
        eager = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 77, True, True, True)
        assert torch.equal(y, eager.y_tensor) and torch.equal(mask, eager.mask_tensor)
        grads = hstu_lmsd_backward(dy, x, u, w, b, eager.mean_tensor, eager.rstd_tensor,
                                   eager.mask_tensor, p, True, True, True)
        torch.cuda.synchronize()
        for got, want in zip((dx, du, dw, db), grads):
            assert torch.equal(got, want)
        assert torch.count_nonzero(counter) == 0
    graph.close()


def test_torch_graph_capture_without_a_workspace():
    """torch.cuda.graph (and torch.compile's CUDA graphs) capture on a stream of their own,
    where the op has no counter yet: it takes one from the graph's memory pool, zeroed by
    the graph before every replay (enough rows that CTAs claim blocks)."""
    n, d, p = 20011, 512, 0.1
    x, u, w, b = make_inputs(n, d, torch.bfloat16, seed=6)
    fwd = HstuLmsdFwdSm90(x, u, w, b, dropout_ratio=p, concat_u=True, concat_x=True).compile()
    y, mean, rstd, mask = poisoned_forward_outputs(n, d, 3, torch.bfloat16, True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fwd.execute(x, u, w, b, y, mean, rstd, mask, seed=5)
    for step in range(2):
        x.copy_(torch.randn_like(x) * (step + 1))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        eager = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 5, True, True, True)
        assert torch.equal(y, eager.y_tensor) and torch.equal(mask, eager.mask_tensor)


def test_capture_without_workspace_on_a_new_stream_is_refused():
    from precast.graphs import CudaGraph
    n, d = 64, 512
    x, u, w, b = make_inputs(n, d, torch.bfloat16)
    fwd = HstuLmsdFwdSm90(x, u, w, b, dropout_ratio=0.1, concat_u=True, concat_x=True).compile()
    y, mean, rstd, mask = poisoned_forward_outputs(n, d, 3, torch.bfloat16, True)
    graph = CudaGraph()
    with pytest.raises(RuntimeError, match="capturing a CUDA graph.*pass workspace="):
        with graph.capture() as s:
            fwd.execute(x, u, w, b, y, mean, rstd, mask, stream=s)
    graph.close()


@pytest.mark.parametrize("d", [256, 512, 4096])
def test_scheduler_workspace_is_left_zero(d):
    """The forward's CTAs claim row blocks from the counter: a caller-owned one is zero after
    every launch (row counts from fewer blocks than CTAs to many blocks per CTA), so one
    buffer serves them all, and every row is written each time."""
    op = HstuLmsdFwdSm90.from_config(dtype="bfloat16", dim=d, dropout=True, concat_u=True,
                                     concat_x=True).compile()
    counter = torch.zeros(op.workspace_shape(), dtype=torch.int32, device=DEV)
    for n in (1, 5, 130, 3001, 70001):
        x, u, w, b = make_inputs(n, d, torch.bfloat16, seed=n)
        y, mean, rstd, mask = poisoned_forward_outputs(n, d, 3, torch.bfloat16, True)
        op.execute(x, u, w, b, y, mean, rstd, mask, seed=9, dropout_ratio=0.25,
                   workspace=counter)
        torch.cuda.synchronize()
        assert torch.count_nonzero(counter) == 0, f"n = {n}: counter left {counter.tolist()}"
        assert not torch.isnan(y).any() and not torch.isnan(mean).any(), f"n = {n}"
        assert torch.equal(mask, lmsd_mask(n, d, 9, 0.25, True, True, device=DEV)), f"n = {n}"
        ref_y, ref_mean, _, _ = lmsd_forward_reference(x, u, w, b, 1e-5, 0.25, 9, True, True,
                                                       True, mask=mask)
        assert rel_err(y, ref_y) < 1e-2, f"n = {n}"
        torch.testing.assert_close(mean, ref_mean, rtol=1e-5, atol=1e-5)


def test_launches_on_two_streams_overlap_safely():
    """One op launched on two streams without synchronizing in between uses the counter it
    keeps per stream; two launches sharing one counter would split each other's blocks."""
    n, d, p = 200003, 512, 0.1
    x, u, w, b = make_inputs(n, d, torch.bfloat16, seed=4)
    op = HstuLmsdFwdSm90(x, u, w, b, dropout_ratio=p, concat_u=True, concat_x=True).compile()
    expect = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 21, True, True, True).y_tensor.clone()
    outs = [poisoned_forward_outputs(n, d, 3, torch.bfloat16, True) for _ in range(6)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s, out in zip(streams, outs):  # each stream's counter is made (and zeroed) here
        op.execute(x, u, w, b, *out, seed=21, stream=s)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        op.execute(x, u, w, b, *out, seed=21, stream=streams[i % 2])
    torch.cuda.synchronize()
    for out in outs:
        assert torch.equal(out[0], expect)


def test_execute_rejects_mismatched_runtime_tensors():
    op = HstuLmsdFwdSm90.from_config(dtype="bfloat16", dim=512, dropout=True, concat_u=True,
                                     concat_x=True).compile()
    x, u, w, b = make_inputs(64, 512, torch.bfloat16)
    y, mean, rstd, mask = poisoned_forward_outputs(64, 512, 3, torch.bfloat16, True)
    with pytest.raises(TypeError, match="x: dtype"):
        op.execute(x.half(), u, w, b, y, mean, rstd, mask)
    with pytest.raises(ValueError, match="y: extent"):
        op.execute(x, u, w, b, y[:, :1024], mean, rstd, mask)
    with pytest.raises(ValueError, match="overlaps"):
        op.execute(x, u, w, b, y, mean, mean, mask)
    with pytest.raises(ValueError, match="dropout_ratio"):
        op.execute(x, u, w, b, y, mean, rstd, mask, dropout_ratio=0.0)
    with pytest.raises(ValueError, match="mean: has 63 rows"):
        op.execute(x, u, w, b, y, mean[:63], rstd, mask)
    with pytest.raises(ValueError, match="rstd overlaps workspace"):
        op.execute(x, u, w, b, y, mean, rstd, mask, workspace=rstd.view(torch.int32)[:2])


def test_torch_compile_traces_the_custom_op():
    n, d = 256, 256
    x, u, w, b = make_inputs(n, d, torch.bfloat16)

    def step(x, u, w, b):
        return hstu_lmsd(x, u, w, b, eps=1e-5, dropout_ratio=0.0, seed=0, apply_u_silu=True,
                         concat_u=True, concat_x=True).float().square().sum()

    compiled = torch.compile(step, fullgraph=True)
    leaves = [t.clone().requires_grad_(True) for t in (x, u, w, b)]
    eager_leaves = [t.clone().requires_grad_(True) for t in (x, u, w, b)]
    compiled(*leaves).backward()
    step(*eager_leaves).backward()
    for got, want in zip(leaves, eager_leaves):
        assert rel_err(got.grad, want.grad) < 1e-2
