"""Gated DeltaNet backward (GdnBwdSm90, gated_delta_net_backward, autograd through
gated_delta_net) on the GPU, from precompiled artifacts.

Every op here is a static configuration of tests/gpu_plan.toml (CONFIGS, and the forward's
FORWARD_CONFIGS besides those of tests/test_gdn_fwd_gpu.py; CPU tests check that each is
planned). Gradient buffers are poisoned with NaN before every launch and compared with the
float64 chunked backward (gdn_chunked_backward_reference, equal to autograd of the
token-by-token reference to ~1e-14; the end-to-end test uses that autograd itself): RMS
error ratio at most 4e-2 for dq, dk, dv, dg, dbeta and 6e-2 for dinitial_state (bf16).
Two launches of the same math (the forward's kept workspace vs recomputed, graph replay vs
eager, the allocating function, autograd and torch.compile vs execute, two runs) are
compared bitwise.
Inputs and the RMS check are the forward GPU tests' (make_batch, assert_close).
"""
import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
from test_gdn_fwd_gpu import BASE as FORWARD_BASE
from test_gdn_fwd_gpu import CONFIGS as FORWARD_TESTED
from test_gdn_fwd_gpu import MANY, RAGGED, SHORT, Batch, assert_close, make_batch

from precast import GdnBwdSm90, GdnFwdSm90, gated_delta_net, gated_delta_net_backward
from precast.reference.gated_delta_net import gdn_recurrent_reference
from precast.reference.gdn_backward import gdn_chunked_backward_reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_matmuls")]

DEV = "cuda"
BF, F32, F64 = torch.bfloat16, torch.float32, torch.float64
TOL_GRAD, TOL_INITIAL = 4e-2, 6e-2  # RMS error ratios (bf16), the bars
LENGTHS = {"ragged": RAGGED, "short": SHORT}
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dinitial_state")

# The backward's static configurations in tests/gpu_plan.toml.
BASE = dict(dtype="bfloat16", k_dim=128, v_dim=128, q_heads=4, k_heads=4, v_heads=4,
            g_dtype="float32", beta_dtype="float32", state_dtype="none",
            use_qk_l2norm_in_kernel=True, final_state_grad=True, checkpoint_dtype="none")


def _config(**changes):
    return {**BASE, **changes}


CONFIGS = {
    "bf16": BASE,
    "bf16-no-dfinal": _config(final_state_grad=False),
    "bf16-no-l2norm": _config(use_qk_l2norm_in_kernel=False),
    "bf16-state": _config(state_dtype="float32"),
    "bf16-hv16": _config(v_heads=16, beta_dtype="bfloat16"),
    "bf16-hq16": _config(q_heads=16, beta_dtype="bfloat16"),
    # two output heads per input head: added into the zeroed gradients (dq, dk; dk, dv)
    "bf16-hv8": _config(v_heads=8, beta_dtype="bfloat16"),
    "bf16-hq8": _config(q_heads=8, beta_dtype="bfloat16"),
    "fp16-d64-hv8": _config(dtype="float16", k_dim=64, v_dim=64, v_heads=8),
    "bf16-d64-io-state": _config(k_dim=64, v_dim=64, state_dtype="io"),
    "fp16-d64-io-state": _config(dtype="float16", k_dim=64, v_dim=64, state_dtype="io"),
    # given the forward's checkpoints (test_checkpoints_reused_or_regenerated)
    "bf16-state-ckpt-io": _config(state_dtype="float32", checkpoint_dtype="io"),
    "bf16-state-ckpt-f32": _config(state_dtype="float32", checkpoint_dtype="float32"),
}
WITHOUT_CHECKPOINTS = sorted(n for n, c in CONFIGS.items() if c["checkpoint_dtype"] == "none")
# Forward configurations only these tests run (checkpoints in the io dtype, which the
# backward reuses), or the backward's sanitizer script, besides test_gdn_fwd_gpu's CONFIGS.
FORWARD_CONFIGS = {
    "bf16-state-io-checkpoints": {**FORWARD_BASE, "state_dtype": "float32",
                                  "checkpoint_dtype": "io"},
    # the workspace kept for the backward (test_forward_workspace_reused)
    "bf16-state": {**FORWARD_BASE, "state_dtype": "float32"},
    # two output heads per q / k head: tests/gpu_sanitize_gdn_bwd.py --pairs
    "bf16-hv8": {**FORWARD_BASE, "v_heads": 8, "beta_dtype": "bfloat16"},
}
_OPS = {}


def get_op(name: str) -> GdnBwdSm90:
    op = _OPS.get(name)
    if op is None:
        op = _OPS[name] = GdnBwdSm90.from_config(**CONFIGS[name]).check_support().compile()
    return op


def forward_op(config: dict) -> GdnFwdSm90:
    key = ("forward",) + tuple(sorted(config.items()))
    op = _OPS.get(key)
    if op is None:
        op = _OPS[key] = GdnFwdSm90.from_config(**config).check_support().compile()
    return op


@dataclass
class Cotangents:
    do: torch.Tensor  # [T, HO, V], the io dtype
    dfinal: Optional[torch.Tensor]  # [N, HO, V, K] float32


def cotangents(name: str, b: Batch, seed: int) -> Cotangents:
    gen = torch.Generator(device=DEV).manual_seed(seed + 1000)
    do = torch.randn(b.T, b.HO, b.V, device=DEV, generator=gen).to(b.q.dtype)
    dfinal = None
    if CONFIGS[name]["final_state_grad"]:
        dfinal = 0.1 * torch.randn(b.N, b.HO, b.V, b.K, device=DEV, generator=gen)
    return Cotangents(do, dfinal)


@dataclass
class Grads:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dg: torch.Tensor
    dbeta: torch.Tensor
    dinitial_state: Optional[torch.Tensor]

    def equal(self, other: "Grads") -> bool:
        return all((a is None and b is None) or torch.equal(a, b)
                   for a, b in zip(self.__dict__.values(), other.__dict__.values()))


def poisoned(b: Batch) -> Grads:
    """NaN-filled gradient buffers shaped and typed like the inputs."""
    def nan_like(t):
        return None if t is None else torch.full_like(t, math.nan)
    return Grads(*(nan_like(t) for t in (b.q, b.k, b.v, b.g, b.beta, b.initial_state)))


def launch(name: str, b: Batch, ct: Cotangents, *, checkpoints=None, n=None, scale=None,
           out: Optional[Grads] = None, stream=None, workspace=None, forward_workspace=None,
           sync=True) -> Grads:
    """get_op(name).execute into NaN-poisoned gradients (unless given)."""
    out = poisoned(b) if out is None else out
    get_op(name).execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, ct.do, out.dq, out.dk,
                         out.dv, out.dg, out.dbeta, initial_state=b.initial_state,
                         dinitial_state=out.dinitial_state, dfinal=ct.dfinal,
                         checkpoints=checkpoints, checkpoint_every_n_tokens=n, scale=scale,
                         workspace=workspace, forward_workspace=forward_workspace,
                         stream=stream)
    if sync:
        torch.cuda.synchronize()
    return out


def reference(name: str, b: Batch, ct: Cotangents, scale=None) -> dict:
    return gdn_chunked_backward_reference(
        b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, ct.do, dfinal=ct.dfinal, scale=scale,
        initial_state=b.initial_state,
        use_qk_l2norm_in_kernel=CONFIGS[name]["use_qk_l2norm_in_kernel"])


def assert_grads_close(got: Grads, want: dict, dtype, what: str) -> None:
    for grad in GRADS:
        value = getattr(got, grad)
        if value is None:
            continue
        tol = TOL_INITIAL if grad == "dinitial_state" else TOL_GRAD
        assert_close(value, want[grad], dtype, f"{what}: {grad}", tol=tol)


# --- against the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("name", WITHOUT_CHECKPOINTS)
def test_matches_the_reference(name, lengths):
    """Every planned configuration: head ratios 1:1, 1:2, 1:4 (v heads), 2:1 and 4:1 (q
    heads; pairs add into the gradients, larger groups go through "finish"), K = V
    = 64 and 128, with and without the L2 norm, an initial state (float32 and io) and the
    final state's gradient; ragged lengths with 0- and 1-token sequences and many short
    ones. Every element of every gradient is written (NaN-poisoned first)."""
    b = make_batch(CONFIGS[name], LENGTHS[lengths], seed=len(name))
    ct = cotangents(name, b, seed=len(name))
    got = launch(name, b, ct)
    assert_grads_close(got, reference(name, b, ct), b.q.dtype, f"{name} {lengths}")


def test_many_sequences_use_the_table(monkeypatch):
    """More than 32 sequences: the backward's kernels locate chunks, first chunks and
    checkpoint rows in the per-sequence table. Against the reference, also with states
    regenerated from float32 checkpoints (every 64 and 192 tokens); the scans the kernels
    make without the table give bitwise the same gradients."""
    import precast.lifecycle.gdn_fwd as gdn_fwd
    b = make_batch(CONFIGS["bf16-state"], MANY, seed=23)
    ct = cotangents("bf16-state", b, seed=23)
    got = launch("bf16-state", b, ct)
    want = reference("bf16-state", b, ct)
    assert_grads_close(got, want, BF, "100 sequences")
    f32 = FORWARD_TESTED["bf16-state-checkpoints"]
    for n in (64, 64):
        regenerated = launch("bf16-state-ckpt-f32", b, ct,
                             checkpoints=forward_checkpoints(f32, b, n), n=n)
        assert_grads_close(regenerated, want, BF, f"100 sequences, checkpoints every {n}")
    monkeypatch.setattr(gdn_fwd, "TABLE_MIN_SEQS", 1 << 30)
    assert launch("bf16-state", b, ct).equal(got), "scans without the table"


def test_scale_is_a_runtime_value():
    b = make_batch(BASE, RAGGED, seed=3)
    ct = cotangents("bf16", b, seed=3)
    for scale in (0.3, 1.0):
        got = launch("bf16", b, ct, scale=scale)
        assert_grads_close(got, reference("bf16", b, ct, scale=scale), BF, f"scale {scale}")


def test_bitwise_reproducible():
    """Two runs give the same bits: groups of four summed in a fixed order, pairs added
    into zeros (two adds commute), including partial chunks' atomic adds."""
    for name in ("bf16-hq16", "bf16-hv16", "bf16-hv8", "bf16-hq8"):
        b = make_batch(CONFIGS[name], RAGGED, seed=5)
        ct = cotangents(name, b, seed=5)
        assert launch(name, b, ct).equal(launch(name, b, ct)), name


# --- checkpoints --------------------------------------------------------------------------------
def forward_checkpoints(config: dict, b: Batch, n: int) -> torch.Tensor:
    """The forward's checkpoints every n tokens (its o and final state discarded)."""
    op = forward_op(config)
    dtype = F32 if config["checkpoint_dtype"] == "float32" else b.q.dtype
    o = torch.empty(b.T, b.HO, b.V, dtype=b.q.dtype, device=DEV)
    final = torch.empty(b.N, b.HO, b.V, b.K, device=DEV)
    ckpt = torch.full((b.T // n + b.N, b.HO, b.V, b.K), math.nan, dtype=dtype, device=DEV)
    op.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, o, initial_state=b.initial_state,
               final_state=final, checkpoints=ckpt, checkpoint_every_n_tokens=n)
    return ckpt


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_checkpoints_reused_or_regenerated(lengths):
    """The forward's checkpoints at n = 64 in the io dtype are chunk states: reused (no
    states kernel). float32 checkpoints at any n: the states pass starts from each (one CTA
    per checkpoint row and head; both grid sizes, split and not, occur here). io
    checkpoints at a coarser n: each segment starts from the rounded state. Each within the
    reference's tolerance, not bitwise the recomputation: the backward's states pass makes
    Delta from T and its column scales, the forward from W and U (the same values up to where
    the roundings fall). float32 checkpoints every 64 tokens round to exactly the io ones:
    bitwise the same gradients. The ragged lengths put sequences of 0 and 1 tokens and
    partial segments between them."""
    b = make_batch(CONFIGS["bf16-state"], LENGTHS[lengths], seed=11)
    ct = cotangents("bf16-state", b, seed=11)
    recomputed = launch("bf16-state", b, ct)
    want = reference("bf16-state", b, ct)
    assert_grads_close(recomputed, want, BF, "recomputed")
    io, f32 = FORWARD_CONFIGS["bf16-state-io-checkpoints"], FORWARD_TESTED[
        "bf16-state-checkpoints"]
    by_f32 = {}
    for n in (64, 128, 192, 640):
        by_f32[n] = launch("bf16-state-ckpt-f32", b, ct,
                           checkpoints=forward_checkpoints(f32, b, n), n=n)
        assert_grads_close(by_f32[n], want, BF, f"float32 checkpoints every {n}")
    got = launch("bf16-state-ckpt-io", b, ct, checkpoints=forward_checkpoints(io, b, 64), n=64)
    assert_grads_close(got, want, BF, "io checkpoints every 64")
    # both are the forward's states rounded to the io dtype, one chunk apart
    assert got.equal(by_f32[64])
    for n in (128, 640):
        got = launch("bf16-state-ckpt-io", b, ct, checkpoints=forward_checkpoints(io, b, n),
                     n=n)
        assert_grads_close(got, want, BF, f"io checkpoints every {n}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality that holds for NaN too (unwritten rows of a NaN-filled buffer)."""
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(ints), b.view(ints))


def handed_workspaces(monkeypatch) -> list:
    """The forward_workspace each gated_delta_net_backward call of the autograd path gets,
    in call order (the call itself goes through)."""
    import precast.linear_attention as functional
    handed = []
    real = functional.gated_delta_net_backward

    def recording(*args, forward_workspace=None, **kwargs):
        handed.append(forward_workspace)
        return real(*args, forward_workspace=forward_workspace, **kwargs)
    monkeypatch.setattr(functional, "gated_delta_net_backward", recording)
    return handed


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_forward_workspace_reused(lengths, monkeypatch):
    """The chunk factors, T and its column scales a forward wrote (its workspace) replace
    the backward's prepare kernel: bitwise the gradients of recomputation
    (the same products made them). Through autograd, gated_delta_net(keep_workspace=True)
    hands them to the backward."""
    name = "bf16-state"
    b = make_batch(CONFIGS[name], LENGTHS[lengths], seed=12)
    ct = cotangents(name, b, seed=12)
    expect = launch(name, b, ct)
    config = FORWARD_CONFIGS["bf16-state"]
    fwd = forward_op(config)
    kept = tuple(torch.full(shape, math.nan, dtype=dtype, device=DEV) for shape, dtype in
                 zip(fwd.workspace_shapes(b.T, b.N), fwd.workspace_dtypes()))
    o = torch.full((b.T, b.HO, b.V), math.nan, dtype=BF, device=DEV)
    final = torch.full((b.N, b.HO, b.V, b.K), math.nan, device=DEV)
    fwd.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, o, initial_state=b.initial_state,
                final_state=final, workspace=kept)
    before = tuple(t.clone() for t in kept)
    # this forward makes Delta from T, its scales and v, not from W and U: its own outputs
    want = gdn_recurrent_reference(*(t.double() for t in (b.q, b.k, b.v, b.g, b.beta)),
                                   b.cu_seqlens, initial_state=b.initial_state.double(),
                                   use_qk_l2norm_in_kernel=True)
    assert_close(o, want["o"], BF, "o of the forward keeping its workspace")
    assert_close(final, want["final_state"], BF, "its final state")
    assert launch(name, b, ct, forward_workspace=kept).equal(expect)
    # the caller's factors are read only: the backward writes its own workspace alone
    assert all(map(same_bits, kept, before)), "forward_workspace was written"
    # autograd
    handed = handed_workspaces(monkeypatch)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    x = leaves(b, *names)
    o2, s2 = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], b.cu_seqlens,
                             initial_state=x["initial_state"], output_final_state=True,
                             use_qk_l2norm_in_kernel=True, keep_workspace=True)
    assert torch.equal(o2, o) and torch.equal(s2, final)
    ((o2.float() * ct.do.float()).sum() + (s2 * ct.dfinal).sum()).backward()
    assert len(handed) == 1 and [tuple(t.shape) for t in handed[0]] == [
        tuple(t.shape) for t in kept]
    assert Grads(*(x[n].grad for n in names)).equal(expect)


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_autograd_keeps_the_forward_workspace_by_default(lengths, monkeypatch):
    """Training without keep_workspace (its default, None) keeps the forward's workspace for
    the backward, as keep_workspace=True: the same o and final state as keep_workspace=False
    (which keeps nothing: the backward recomputes the factors) and bitwise its gradients,
    which are execute's."""
    name = "bf16-state"
    b = make_batch(CONFIGS[name], LENGTHS[lengths], seed=13)
    ct = cotangents(name, b, seed=13)
    handed = handed_workspaces(monkeypatch)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    runs = {}
    for keep in ("default", False):
        x = leaves(b, *names)
        kw = {} if keep == "default" else {"keep_workspace": keep}
        r = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], b.cu_seqlens,
                            initial_state=x["initial_state"], output_final_state=True,
                            use_qk_l2norm_in_kernel=True, **kw)
        assert r.workspace is None  # under autograd it is the backward's, not the caller's
        o, s = r
        ((o.float() * ct.do.float()).sum() + (s * ct.dfinal).sum()).backward()
        runs[keep] = (o.detach(), s.detach(), Grads(*(x[n].grad for n in names)))
    kept, recomputed = handed
    fwd = forward_op(FORWARD_CONFIGS["bf16-state"])
    assert recomputed is None and [(tuple(t.shape), t.dtype) for t in kept] == list(zip(
        fwd.workspace_shapes(b.T, b.N), fwd.workspace_dtypes()))
    (o1, s1, by_default), (o0, s0, by_recomputing) = runs["default"], runs[False]
    assert torch.equal(o1, o0) and torch.equal(s1, s0)
    assert by_default.equal(by_recomputing), "the kept workspace changed the gradients"
    assert by_default.equal(launch(name, b, ct))
    assert_grads_close(by_default, reference(name, b, ct), BF, "kept by default")


# --- layouts, offsets, empty batches, streams ----------------------------------------------------
def test_strided_inputs_and_gradients():
    """q, k, v as column slices of one projection and their gradients as slices of one
    gradient buffer: the bits of compact tensors."""
    name = "bf16-hv16"
    b = make_batch(CONFIGS[name], RAGGED, seed=21)
    ct = cotangents(name, b, seed=21)
    expect = launch(name, b, ct)
    widths = [b.q[0].numel(), b.k[0].numel(), b.v[0].numel()]

    def fused_views(tensors):
        buf = torch.full((b.T, sum(widths) + 24), math.nan, dtype=BF, device=DEV)
        views, col = [], 0
        for t, width in zip(tensors, widths):
            buf[:, col:col + width] = t.flatten(1)
            views.append(buf[:, col:col + width].unflatten(1, t.shape[1:]))
            col += width
        return views
    q, k, v = fused_views((b.q, b.k, b.v))
    strided = Batch(b.lengths, q, k, v, b.g, b.beta, b.cu_seqlens)
    dq, dk, dv = fused_views([torch.full_like(t, math.nan) for t in (b.q, b.k, b.v)])
    out = Grads(dq, dk, dv, torch.full_like(b.g, math.nan), torch.full_like(b.beta, math.nan),
                None)
    got = launch(name, strided, ct, out=out)
    assert got.equal(expect)


def test_int64_offsets_equal_int32():
    name = "bf16-state"
    b = make_batch(CONFIGS[name], RAGGED, seed=31)
    ct = cotangents(name, b, seed=31)
    expect = launch(name, b, ct)
    b64 = Batch(b.lengths, b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens.long(), b.initial_state)
    assert launch(name, b64, ct).equal(expect)


def test_no_tokens_initial_state_gradient_is_dfinal():
    name = "bf16-state"
    b = make_batch(CONFIGS[name], [0, 0, 0], seed=41)
    ct = cotangents(name, b, seed=41)
    got = launch(name, b, ct)
    assert got.dq.shape[0] == 0 and torch.equal(got.dinitial_state, ct.dfinal)


def test_no_sequence():
    b = make_batch(BASE, [], seed=42)
    got = launch("bf16", b, cotangents("bf16", b, seed=42))
    assert got.dq.shape[0] == 0


def test_side_stream_equals_the_current_stream():
    b = make_batch(BASE, SHORT, seed=51)
    ct = cotangents("bf16", b, seed=51)
    expect = launch("bf16", b, ct)
    side = torch.cuda.Stream()
    out = poisoned(b)
    torch.cuda.synchronize()
    launch("bf16", b, ct, out=out, stream=side, sync=False)
    side.synchronize()
    assert out.equal(expect)


def test_back_to_back_calls_and_two_streams():
    """Calls that overlap on the device: three on one stream without a host sync between
    them (each call's states pass, forked onto a side stream, must not overwrite the op's
    states buffer before the previous call's chunk kernel has read it), then two on two
    streams at once (each caller stream has its own side stream and workspace)."""
    batches = [make_batch(BASE, SHORT, seed=60 + i) for i in range(3)]
    cts = [cotangents("bf16", b, seed=60 + i) for i, b in enumerate(batches)]
    expect = [launch("bf16", b, ct) for b, ct in zip(batches, cts)]
    outs = [poisoned(b) for b in batches]
    torch.cuda.synchronize()
    for b, ct, out in zip(batches, cts, outs):
        launch("bf16", b, ct, out=out, sync=False)
    torch.cuda.synchronize()
    assert all(out.equal(e) for out, e in zip(outs, expect))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = [poisoned(b) for b in batches[:2]]
    torch.cuda.synchronize()
    for b, ct, out, s in zip(batches, cts, outs, streams):
        launch("bf16", b, ct, out=out, stream=s, sync=False)
    torch.cuda.synchronize()
    assert all(out.equal(e) for out, e in zip(outs, expect))


def test_allocating_function_and_custom_op_equal_execute():
    name = "bf16-d64-io-state"
    b = make_batch(CONFIGS[name], RAGGED, seed=61)
    ct = cotangents(name, b, seed=61)
    expect = launch(name, b, ct)
    r = gated_delta_net_backward(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, ct.do,
                                 initial_state=b.initial_state, dfinal=ct.dfinal,
                                 use_qk_l2norm_in_kernel=True)
    assert Grads(*r).equal(expect)
    assert r.dinitial_state.dtype == BF
    grads = torch.ops.precast.gated_delta_net_backward(
        b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, ct.do, None, b.initial_state, ct.dfinal, None,
        None, True)
    assert Grads(*grads).equal(expect)


# --- graphs, autograd, torch.compile --------------------------------------------------------------
def test_cuda_graph_capture_of_forward_and_backward():
    """The forward and the backward captured together with caller-owned workspaces; replays
    after the inputs change in place equal eager runs; capture allocates nothing."""
    from precast.graphs import CudaGraph
    b = make_batch(BASE, RAGGED, seed=71)
    ct = cotangents("bf16", b, seed=71)
    fwd, bwd = forward_op(FORWARD_TESTED["bf16"]), get_op("bf16")
    s16, s32 = fwd.workspace_shapes(b.T, b.N)
    fwd_ws = (torch.empty(s16, dtype=BF, device=DEV), torch.empty(s32, device=DEV))
    bwd_ws = bwd.make_workspace(b.T, b.N, device=DEV)
    o = torch.full((b.T, b.HO, b.V), math.nan, dtype=BF, device=DEV)
    final = torch.full((b.N, b.HO, b.V, b.K), math.nan, device=DEV)
    out = poisoned(b)
    torch.cuda.synchronize()
    graph = CudaGraph()
    before = torch.cuda.memory_allocated()
    with graph.capture() as s:
        fwd.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, o, final_state=final,
                    workspace=fwd_ws, stream=s)
        launch("bf16", b, ct, out=out, stream=s, workspace=bwd_ws, sync=False)
    assert torch.cuda.memory_allocated() == before, "capture allocated device memory"
    assert torch.isnan(out.dq).all(), "capture ran the kernels"
    gen = torch.Generator(device=DEV).manual_seed(72)
    for step in range(3):
        if step == 1:
            b.q.copy_(torch.randn(b.q.shape, device=DEV, generator=gen).to(BF))
            ct.do.mul_(-1.5)
        if step == 2:
            b.g.copy_(torch.nn.functional.logsigmoid(
                torch.randn(b.g.shape, device=DEV, generator=gen) + 1.0))
        for t in out.__dict__.values():
            if t is not None:
                t.fill_(math.nan)
        torch.cuda.synchronize()
        graph.replay()
        graph.synchronize()
        assert out.equal(launch("bf16", b, ct)), f"step {step}: replay differs from eager"
    assert_grads_close(out, reference("bf16", b, ct), BF, "replay vs reference")
    graph.close()


def leaves(b: Batch, *names):
    return {name: getattr(b, name).detach().clone().requires_grad_() for name in names}


def test_autograd_end_to_end_matches_autograd_of_the_reference():
    """o, s = gated_delta_net(...); loss.backward() with an initial state and fp32
    checkpoints (forward "bf16-state-checkpoints", backward "bf16-state-ckpt-f32", its
    states regenerated from them; the forward's workspace kept, the default): the gradients of
    q, k, v, g, beta and the initial state against autograd of the float64 token-by-token
    reference under the same loss."""
    name = "bf16-state"
    lengths = [130, 0, 1, 70, 64]
    b = make_batch(CONFIGS[name], lengths, seed=81)
    ct = cotangents(name, b, seed=81)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    x = leaves(b, *names)
    o, s = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], b.cu_seqlens,
                           initial_state=x["initial_state"], output_final_state=True,
                           use_qk_l2norm_in_kernel=True, checkpoint_every_n_tokens=64,
                           checkpoint_dtype=F32)
    ((o.float() * ct.do.float()).sum() + (s * ct.dfinal).sum()).backward()
    ref = {n: t.detach().to(F64).requires_grad_() for n, t in x.items()}
    want = gdn_recurrent_reference(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"],
                                   b.cu_seqlens, initial_state=ref["initial_state"],
                                   use_qk_l2norm_in_kernel=True)
    ((want["o"] * ct.do.to(F64)).sum() + (want["final_state"] * ct.dfinal).sum()).backward()
    for n in names:
        tol = TOL_INITIAL if n == "initial_state" else TOL_GRAD
        assert x[n].grad.dtype == x[n].dtype
        assert_close(x[n].grad, ref[n].grad, BF, f"d{n}", tol=tol)
    # and the bits of execute given the same checkpoints
    expect = launch("bf16-state-ckpt-f32", b, ct, n=64, checkpoints=forward_checkpoints(
        FORWARD_TESTED["bf16-state-checkpoints"], b, 64))
    got = Grads(*(x[n].grad for n in names))
    assert got.equal(expect)


def test_autograd_without_the_final_state_in_the_loss():
    """Only o reaches the loss: the backward runs without dfinal (configuration
    "bf16-no-dfinal")."""
    b = make_batch(BASE, RAGGED, seed=91)
    ct = cotangents("bf16-no-dfinal", b, seed=91)
    x = leaves(b, "q", "k", "v", "g", "beta")
    o, _ = gated_delta_net(x["q"], x["k"], x["v"], x["g"], x["beta"], b.cu_seqlens,
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    o.backward(ct.do)
    expect = launch("bf16-no-dfinal", b, ct)
    assert Grads(*(x[n].grad for n in ("q", "k", "v", "g", "beta")), None).equal(expect)


def test_torch_compile_trains_through_the_custom_ops():
    b = make_batch(BASE, RAGGED, seed=95)
    ct = cotangents("bf16", b, seed=95)

    def step(q, k, v, g, beta, cu):
        o, s = gated_delta_net(q, k, v, g, beta, cu, output_final_state=True,
                               use_qk_l2norm_in_kernel=True)
        return (o.float() * ct.do.float()).sum() + (s * ct.dfinal).sum()
    x = leaves(b, "q", "k", "v", "g", "beta")
    torch.compile(step, fullgraph=True)(*x.values(), b.cu_seqlens).backward()
    expect = launch("bf16", b, ct)
    assert Grads(*(x[n].grad for n in ("q", "k", "v", "g", "beta")), None).equal(expect)
