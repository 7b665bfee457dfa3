"""Gated DeltaNet forward (GdnFwdSm90, gated_delta_net) on the GPU, from precompiled artifacts.

Every op here is one of the static configurations of tests/gpu_plan.toml (CONFIGS; a CPU
test in tests/test_gdn_fwd_cpu.py checks that each is planned). Outputs (o, final_state,
checkpoints) are poisoned with NaN before every launch and compared with the float64
token-by-token reference (gdn_recurrent_reference, on the GPU): RMS error ratio at most
TOL[dtype] for o, the final state, the checkpoints and the pool rows. Comparisons of two
launches that compute the same math (a sequence alone vs in a batch, strided views vs
copies, graph replay vs eager, the allocating function and the custom op vs execute) are
bitwise.
"""
import math
from dataclasses import dataclass
from typing import List, Optional

import pytest
import torch

from precast import GdnFwdSm90, gated_delta_net
from precast.reference.gated_delta_net import (gdn_recurrent_reference, l2norm_rows,
                                               rms_error_ratio)
from precast.reference.offsets import offsets_from_lengths

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_matmuls")]

DEV = "cuda"
BF, FP, F32 = torch.bfloat16, torch.float16, torch.float32
TOL = {BF: 2e-2, FP: 1e-2}  # RMS(got - ref) / RMS(ref)
# Ragged: an empty and a one-token sequence, lengths on and off the 64-token chunk edges;
# many short sequences (each a single partial chunk).
RAGGED = [497, 16, 1, 480, 0, 253]
SHORT = [7] * 24 + [1] * 8
LENGTHS = {"ragged": RAGGED, "short": SHORT}
# 100 sequences (more than TABLE_MIN_SEQS): the kernels use the per-sequence table
MANY = [0, 1, 7, 63, 64, 65, 130, 2, 33, 128] * 10

# The static configurations of tests/gpu_plan.toml.
BASE = dict(dtype="bfloat16", k_dim=128, v_dim=128, q_heads=4, k_heads=4, v_heads=4,
            g_dtype="float32", beta_dtype="float32", state_dtype="none", state_pool=False,
            output_final_state=True, use_qk_l2norm_in_kernel=True, checkpoint_dtype="none")


def _config(**changes):
    return {**BASE, **changes}


CONFIGS = {
    "bf16": BASE,
    "bf16-no-l2norm": _config(use_qk_l2norm_in_kernel=False),
    "bf16-state-checkpoints": _config(state_dtype="float32", checkpoint_dtype="float32"),
    "bf16-pool": _config(state_dtype="float32", state_pool=True, output_final_state=False),
    "bf16-hv16": _config(v_heads=16, beta_dtype="bfloat16"),
    "bf16-hq16": _config(q_heads=16, beta_dtype="bfloat16"),
    "fp16-state": _config(dtype="float16", state_dtype="float32"),
    "bf16-d64-io-state": _config(k_dim=64, v_dim=64, state_dtype="io"),
    "fp16-d64-io-state": _config(dtype="float16", k_dim=64, v_dim=64, state_dtype="io"),
}
_OPS = {}


def get_op(name: str) -> GdnFwdSm90:
    """The compiled op of CONFIGS[name] (the kernels come from the artifact cache), one per
    configuration for the module. Every execute here passes its runtime values."""
    op = _OPS.get(name)
    if op is None:
        op = _OPS[name] = GdnFwdSm90.from_config(**CONFIGS[name]).check_support().compile()
    return op


@dataclass
class Batch:
    lengths: List[int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    cu_seqlens: torch.Tensor
    initial_state: Optional[torch.Tensor] = None  # [N, HO, V, K], or the pool
    state_indices: Optional[torch.Tensor] = None

    @property
    def T(self) -> int:
        return self.q.shape[0]

    @property
    def N(self) -> int:
        return len(self.lengths)

    @property
    def HO(self) -> int:
        return max(self.q.shape[1], self.v.shape[1])

    @property
    def K(self) -> int:
        return self.q.shape[2]

    @property
    def V(self) -> int:
        return self.v.shape[2]


def make_batch(name, lengths, seed: int = 0, pool_rows: Optional[int] = None) -> Batch:
    """Random inputs of configuration ``name`` (a key of CONFIGS, or a static configuration
    of GdnFwdSm90 or GdnBwdSm90 itself): gates log-sigmoid(x + 3) (decays near 1, as
    trained models have), beta sigmoid(x); q and k unit rows when the kernel does not
    normalize them (the delta rule diverges for |beta k|^2 >> 1); an initial state (or a
    pool of ``pool_rows`` rows with distinct shuffled indices) when the configuration reads
    one."""
    c = name if isinstance(name, dict) else CONFIGS[name]
    gen = torch.Generator(device=DEV).manual_seed(seed)
    dtype = getattr(torch, c["dtype"])
    T, K, V = sum(lengths), c["k_dim"], c["v_dim"]
    HO = max(c["q_heads"], c["v_heads"])

    def randn(*shape):
        return torch.randn(*shape, device=DEV, generator=gen)
    q, k = randn(T, c["q_heads"], K), randn(T, c["k_heads"], K)
    if not c["use_qk_l2norm_in_kernel"]:
        q, k = l2norm_rows(q), l2norm_rows(k)
    g = torch.nn.functional.logsigmoid(randn(T, HO) + 3.0).to(getattr(torch, c["g_dtype"]))
    beta = torch.sigmoid(randn(T, HO)).to(getattr(torch, c["beta_dtype"]))
    b = Batch(list(lengths), q.to(dtype), k.to(dtype), randn(T, c["v_heads"], V).to(dtype), g,
              beta, offsets_from_lengths(lengths, device=DEV))
    if c["state_dtype"] != "none":
        state_dtype = F32 if c["state_dtype"] == "float32" else dtype
        pool = c.get("state_pool", False)
        rows = pool_rows if pool else len(lengths)
        b.initial_state = (0.5 * randn(rows, HO, V, K)).to(state_dtype)
        if pool:
            perm = torch.randperm(rows, device=DEV, generator=gen)[:len(lengths)]
            b.state_indices = perm.to(torch.int32)
    return b


def checkpoint_dtype(name: str, b: Batch) -> Optional[torch.dtype]:
    option = CONFIGS[name]["checkpoint_dtype"]
    return None if option == "none" else F32 if option == "float32" else b.q.dtype


@dataclass
class Outputs:
    o: torch.Tensor
    final_state: Optional[torch.Tensor]
    checkpoints: Optional[torch.Tensor]


def poisoned(name: str, b: Batch, n: Optional[int]) -> Outputs:
    """NaN-filled output buffers for configuration ``name``."""
    o = torch.full((b.T, b.HO, b.V), math.nan, dtype=b.q.dtype, device=DEV)
    final = ckpt = None
    if CONFIGS[name]["output_final_state"]:
        final = torch.full((b.N, b.HO, b.V, b.K), math.nan, device=DEV)
    if n is not None:
        ckpt = torch.full((b.T // n + b.N, b.HO, b.V, b.K), math.nan,
                          dtype=checkpoint_dtype(name, b), device=DEV)
    return Outputs(o, final, ckpt)


def launch(name: str, b: Batch, *, n: Optional[int] = None, scale: Optional[float] = None,
           out: Optional[Outputs] = None, stream=None, workspace=None,
           sync: bool = True) -> Outputs:
    """get_op(name).execute on b into NaN-poisoned buffers (unless given); n defaults to 64
    where the configuration writes checkpoints."""
    if n is None and checkpoint_dtype(name, b) is not None:
        n = 64
    out = poisoned(name, b, n) if out is None else out
    get_op(name).execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, out.o,
                         initial_state=b.initial_state, state_indices=b.state_indices,
                         final_state=out.final_state, checkpoints=out.checkpoints,
                         workspace=workspace, stream=stream, scale=scale,
                         checkpoint_every_n_tokens=n)
    if sync:
        torch.cuda.synchronize()
    return out


def reference(name: str, b: Batch, *, n: Optional[int] = None,
              scale: Optional[float] = None) -> dict:
    return gdn_recurrent_reference(
        b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, scale=scale, initial_state=b.initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=CONFIGS[name]["use_qk_l2norm_in_kernel"],
        checkpoint_every_n_tokens=n, state_indices=b.state_indices)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype, what: str,
                 tol: Optional[float] = None) -> None:
    """No NaN (outputs are poisoned first) and RMS error ratio <= tol (default TOL[dtype])."""
    tol = TOL[dtype] if tol is None else tol
    assert not torch.isnan(got).any(), f"{what}: NaN (a row was not written)"
    ratio = rms_error_ratio(got, want)
    assert ratio <= tol, f"{what}: RMS error ratio {ratio:.3e} > {tol}"


# --- against the reference ------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
@pytest.mark.parametrize("name", [n for n in CONFIGS if not CONFIGS[n]["state_pool"]])
def test_matches_the_reference(name, lengths):
    """o and the final state (and the checkpoints every 64 tokens where the configuration
    writes them) of every planned configuration; head ratios, K, V, both io dtypes, with
    and without an initial state and in-kernel L2 norms."""
    b = make_batch(name, LENGTHS[lengths], seed=len(name))
    n = 64 if checkpoint_dtype(name, b) is not None else None
    out = launch(name, b, n=n)
    ref = reference(name, b, n=n)
    assert_close(out.o, ref["o"], b.q.dtype, f"{name} {lengths}: o")
    assert_close(out.final_state, ref["final_state"], b.q.dtype, f"{name} {lengths}: final")
    if n is not None:
        rows = ref["checkpoints"].shape[0]
        assert_close(out.checkpoints[:rows], ref["checkpoints"], b.q.dtype,
                     f"{name} {lengths}: checkpoints")


@pytest.mark.parametrize("name", ["bf16-state-checkpoints", "bf16-hv16"])
def test_many_sequences_use_the_table(name, monkeypatch):
    """More than 32 sequences: stage 1 finds its chunk, stage 2 its first chunk and first
    checkpoint row in the per-sequence table (gdn_seq_table_sm90). Against the reference,
    and bitwise equal to the scans of cu_seqlens the kernels make without the table."""
    import precast.lifecycle.gdn_fwd as gdn_fwd
    b = make_batch(name, MANY, seed=21)
    n = 64 if checkpoint_dtype(name, b) is not None else None
    out = launch(name, b, n=n)
    ref = reference(name, b, n=n)
    assert_close(out.o, ref["o"], b.q.dtype, f"{name}: o")
    assert_close(out.final_state, ref["final_state"], b.q.dtype, f"{name}: final")
    rows = 0
    if n is not None:
        rows = ref["checkpoints"].shape[0]
        assert_close(out.checkpoints[:rows], ref["checkpoints"], b.q.dtype,
                     f"{name}: checkpoints")
    monkeypatch.setattr(gdn_fwd, "TABLE_MIN_SEQS", 1 << 30)
    scanned = launch(name, b, n=n)
    assert torch.equal(out.o, scanned.o) and torch.equal(out.final_state, scanned.final_state)
    if n is not None:
        assert torch.equal(out.checkpoints[:rows], scanned.checkpoints[:rows])


def test_scale_is_a_runtime_value():
    b = make_batch("bf16", RAGGED, seed=3)
    for scale in (0.3, 1.0):
        out = launch("bf16", b, scale=scale)
        assert_close(out.o, reference("bf16", b, scale=scale)["o"], BF, f"scale {scale}")


@pytest.mark.parametrize("n", [64, 128, 192, 4096])
def test_checkpoints_are_the_states_at_their_tokens(n):
    """Row r of sequence b is the state entering its local token r * n: the first row of each
    sequence is its initial state exactly (fp32 in, fp32 out); rows past sum(ceil(len / n))
    are never written."""
    name = "bf16-state-checkpoints"
    b = make_batch(name, RAGGED, seed=n)
    out = launch(name, b, n=n)
    ref = reference(name, b, n=n)
    rows = ref["checkpoints"].shape[0]
    assert rows == sum(-(-length // n) for length in RAGGED)
    assert_close(out.checkpoints[:rows], ref["checkpoints"], BF, f"checkpoints n={n}")
    assert torch.isnan(out.checkpoints[rows:]).all()
    first = 0
    for seq, length in enumerate(RAGGED):
        if length:
            assert torch.equal(out.checkpoints[first], b.initial_state[seq]), seq
        first += -(-length // n)
    assert_close(out.final_state, ref["final_state"], BF, "final")


@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_pool_rows_written_in_place(lengths):
    """Sequence b starts from pool[state_indices[b]] and leaves its final state there; other
    rows stay bitwise untouched."""
    name = "bf16-pool"
    b = make_batch(name, LENGTHS[lengths], seed=11, pool_rows=len(LENGTHS[lengths]) + 7)
    before = b.initial_state.clone()
    ref = reference(name, b)
    out = launch(name, b)
    assert out.final_state is None
    assert_close(out.o, ref["o"], BF, "o")
    rows = b.state_indices.long()
    assert_close(b.initial_state[rows], ref["final_state"], BF, "pool rows")
    untouched = torch.ones(before.shape[0], dtype=torch.bool, device=DEV)
    untouched[rows] = False
    assert torch.equal(b.initial_state[untouched], before[untouched])


# --- bitwise properties ---------------------------------------------------------------------------
def sequence(b: Batch, i: int) -> Batch:
    """Sequence i of b as a batch of its own (copies)."""
    lo, hi = sum(b.lengths[:i]), sum(b.lengths[:i + 1])
    rows = slice(lo, hi)
    s = Batch([b.lengths[i]], *(t[rows].clone() for t in (b.q, b.k, b.v, b.g, b.beta)),
              offsets_from_lengths([b.lengths[i]], device=DEV))
    if b.initial_state is not None:
        s.initial_state = b.initial_state[i:i + 1].clone()
    return s


@pytest.mark.parametrize("name", ["bf16", "bf16-state-checkpoints", "bf16-hq16"])
def test_batch_invariance_is_bitwise(name):
    """batch_invariant=True (always honoured): each sequence alone gives the bits it gets
    inside the ragged batch."""
    b = make_batch(name, RAGGED, seed=21)
    whole = launch(name, b)
    start = 0
    for i, length in enumerate(RAGGED):
        alone = launch(name, sequence(b, i))
        assert torch.equal(alone.o, whole.o[start:start + length]), i
        assert torch.equal(alone.final_state[0], whole.final_state[i]), i
        start += length


def test_strided_views_of_one_projection():
    """q, k, v column slices of one fused projection and g, beta of one gate tensor (padded
    rows) give the bits of compact copies, read in place."""
    name = "bf16-hv16"
    b = make_batch(name, RAGGED, seed=31)
    widths = [b.q[0].numel(), b.k[0].numel(), b.v[0].numel()]
    fused = torch.full((b.T, sum(widths) + 24), math.nan, dtype=BF, device=DEV)
    views, col = [], 0
    for t, width in zip((b.q, b.k, b.v), widths):
        fused[:, col:col + width] = t.flatten(1)
        views.append(fused[:, col:col + width].unflatten(1, t.shape[1:]))
        col += width
    gates = torch.full((b.T, 2 * b.HO + 3), math.nan, device=DEV)  # g fp32, one column gap
    gates[:, :b.HO] = b.g
    betas = torch.full((b.T, b.HO + 8), math.nan, dtype=BF, device=DEV)  # beta bf16, padded
    betas[:, :b.HO] = b.beta
    strided = Batch(b.lengths, *views, gates[:, :b.HO], betas[:, :b.HO], b.cu_seqlens)
    expect = launch(name, b)
    got = launch(name, strided)
    assert torch.equal(got.o, expect.o) and torch.equal(got.final_state, expect.final_state)


def test_allocating_function_and_custom_op_equal_execute():
    name = "bf16-state-checkpoints"
    b = make_batch(name, RAGGED, seed=41)
    expect = launch(name, b, n=128)
    r = gated_delta_net(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, initial_state=b.initial_state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True,
                        checkpoint_every_n_tokens=128, checkpoint_dtype=F32)
    o, final = r
    rows = sum(-(-length // 128) for length in RAGGED)
    assert torch.equal(o, expect.o) and torch.equal(final, expect.final_state)
    assert torch.equal(r.checkpoints[:rows], expect.checkpoints[:rows])
    o2, final2, ckpt2, *_ = torch.ops.precast.gated_delta_net(
        b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, None, b.initial_state, True, True, 128, F32,
        None, False)
    assert torch.equal(o2, expect.o) and torch.equal(final2, expect.final_state)
    assert torch.equal(ckpt2[:rows], expect.checkpoints[:rows])
    # no checkpoints asked: an empty tensor from the custom op, None from the function
    b = make_batch("bf16", RAGGED, seed=42)
    o3, final3, ckpt3, *_ = torch.ops.precast.gated_delta_net(
        b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, None, None, True, True, None, None, None,
        True)
    assert ckpt3.shape[0] == 0 and final3.shape == (b.N, b.HO, b.V, b.K)
    assert torch.equal(o3, launch("bf16", b).o)
    assert gated_delta_net(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, output_final_state=True,
                           use_qk_l2norm_in_kernel=True).checkpoints is None


def test_allocating_function_pool_in_place():
    name = "bf16-pool"
    b = make_batch(name, RAGGED, seed=51, pool_rows=9)
    pool = b.initial_state.clone()
    launch(name, b)
    o, final = gated_delta_net(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, initial_state=pool,
                               state_indices=b.state_indices, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()
    assert final is None and torch.equal(pool, b.initial_state)


def test_torch_compile_traces_the_custom_op():
    b = make_batch("bf16", RAGGED, seed=61)

    def step(q, k, v, g, beta, cu):
        o, final, *_ = torch.ops.precast.gated_delta_net(q, k, v, g, beta, cu, None, None,
                                                         True, True, None, None, None, False)
        return o * 2, final
    compiled = torch.compile(step, fullgraph=True)
    o, final = compiled(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens)
    expect = launch("bf16", b)
    assert torch.equal(o, expect.o * 2) and torch.equal(final, expect.final_state)


# --- empty batches, streams, graphs --------------------------------------------------------------
def test_no_tokens_final_state_is_the_initial_state():
    name = "bf16-state-checkpoints"
    b = make_batch(name, [0, 0, 0], seed=71)
    out = launch(name, b, n=64)
    assert out.o.shape[0] == 0
    assert torch.equal(out.final_state, b.initial_state)
    assert torch.isnan(out.checkpoints).all()  # no sequence has a checkpoint row
    b = make_batch("bf16", [0, 0], seed=72)  # no initial state: zeros
    final = launch("bf16", b).final_state
    assert torch.equal(final, torch.zeros_like(final))


def test_no_sequence():
    b = make_batch("bf16", [], seed=73)
    out = launch("bf16", b)
    assert out.o.shape[0] == 0 and out.final_state.shape[0] == 0


def test_side_stream_equals_the_current_stream():
    b = make_batch("bf16", SHORT, seed=81)
    expect = launch("bf16", b)
    side = torch.cuda.Stream()
    out = poisoned("bf16", b, None)
    torch.cuda.synchronize()
    launch("bf16", b, out=out, stream=side, sync=False)
    side.synchronize()
    assert torch.equal(out.o, expect.o) and torch.equal(out.final_state, expect.final_state)


def test_int64_offsets_equal_int32():
    """int64 cu_seqlens (flash-linear-attention's type) run from the op's int32 copy: the
    same bits as int32 offsets, through execute() and the allocating function."""
    name = "bf16-state-checkpoints"
    b = make_batch(name, RAGGED, seed=85)
    written = sum(-(-n // 64) for n in b.lengths)  # checkpoint rows; the rest stay NaN
    expect = launch(name, b)
    b64 = Batch(b.lengths, b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens.long(), b.initial_state)
    got = launch(name, b64)
    r = gated_delta_net(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens.long(),
                        initial_state=b.initial_state, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, checkpoint_every_n_tokens=64,
                        checkpoint_dtype=F32)  # the configuration's static fields
    for o, final, ckpt in ((got.o, got.final_state, got.checkpoints),
                           (r.o, r.final_state, r.checkpoints)):
        assert torch.equal(o, expect.o) and torch.equal(final, expect.final_state)
        assert torch.equal(ckpt[:written], expect.checkpoints[:written])


def test_cuda_graph_capture_and_replay():
    """execute() captured on a varlen batch with a caller-owned workspace; replays after q,
    v and g change in place equal eager runs; capture allocates nothing."""
    from precast.graphs import CudaGraph
    name = "bf16-state-checkpoints"
    b = make_batch(name, RAGGED, seed=91)
    op = get_op(name)
    s16, s32 = op.workspace_shapes(b.T, b.N)
    ws = (torch.empty(s16, dtype=BF, device=DEV), torch.empty(s32, device=DEV))
    out = poisoned(name, b, 128)
    torch.cuda.synchronize()
    graph = CudaGraph()
    before = torch.cuda.memory_allocated()
    with graph.capture() as s:
        launch(name, b, n=128, out=out, stream=s, workspace=ws, sync=False)
    assert torch.cuda.memory_allocated() == before, "capture allocated device memory"
    assert graph.num_nodes() == 2
    assert torch.isnan(out.o).all(), "capture ran the kernels"
    gen = torch.Generator(device=DEV).manual_seed(92)
    previous = None
    rows = sum(-(-length // 128) for length in RAGGED)
    for step in range(3):
        if step == 1:
            b.q.copy_(torch.randn(b.q.shape, device=DEV, generator=gen).to(BF))
            b.v.mul_(-1.5)
        if step == 2:
            b.g.copy_(torch.nn.functional.logsigmoid(torch.randn(b.g.shape, device=DEV,
                                                                 generator=gen) + 1.0))
        for t in (out.o, out.final_state, out.checkpoints):
            t.fill_(math.nan)
        torch.cuda.synchronize()
        graph.replay()
        graph.synchronize()
        eager = launch(name, b, n=128)
        assert torch.equal(out.o, eager.o), f"step {step}: replay differs from eager"
        assert torch.equal(out.final_state, eager.final_state), f"step {step}"
        assert torch.equal(out.checkpoints[:rows], eager.checkpoints[:rows]), f"step {step}"
        if previous is not None:
            assert not torch.equal(out.o, previous), f"step {step}: the change was not seen"
        previous = out.o.clone()
    assert_close(out.o, reference(name, b, n=128)["o"], BF, "replay vs reference")
    graph.close()


def test_capture_without_workspace_on_a_new_stream_is_refused():
    from precast.graphs import CudaGraph
    b = make_batch("bf16", SHORT, seed=93)
    op = GdnFwdSm90.from_config(**CONFIGS["bf16"]).check_support().compile()  # no workspace
    out = poisoned("bf16", b, None)
    torch.cuda.synchronize()
    graph = CudaGraph()
    with pytest.raises(RuntimeError, match="workspace"):
        with graph.capture() as s:
            op.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, out.o,
                       final_state=out.final_state, stream=s)
    graph.close()
    # after one run on a stream, that stream's own workspace serves a capture
    graph = CudaGraph()
    op.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, out.o, final_state=out.final_state,
               stream=graph.stream)
    torch.cuda.synchronize()
    out.o.fill_(math.nan)
    with graph.capture() as s:
        op.execute(b.q, b.k, b.v, b.g, b.beta, b.cu_seqlens, out.o,
                   final_state=out.final_state, stream=s)
    graph.replay()
    graph.synchronize()
    assert torch.equal(out.o, launch("bf16", b).o)
    graph.close()
