"""GdnBwdSm90 (precast/lifecycle/gdn_bwd.py), gated_delta_net_backward and the backward
custom op (precast/linear_attention.py) on a CPU machine: static configuration and cache
key, from_config, the backward's rules (gdn_rules.check_gdn_gradients, through the op and
on real CPU tensors), execute()'s launches (kernels stood in for and recorded): order,
arguments, checkpoint reuse, the initial state's gradient, int64 offsets, the
per-sequence table (N > 32); the workspace (shapes, given, the op's own per device and
stream, refused while capturing); N == 0 and T == 0; the allocating function and the
custom op's fake; the kernels' fake arguments and one cross-compilation of every backward
kernel (marked compile)."""
import math
import sys

import pytest
import torch
from conftest import SIDE_OFFSET, isolate_from_kernels, key_of, record_launches
from test_gdn_fwd_cpu import desc, meta

import precast
from precast import GdnBwdSm90, GdnFwdSm90, gated_delta_net_backward
from precast.lifecycle import gdn_bwd as bwd_module
from precast.lifecycle import gdn_fwd as fwd_module
from precast.lifecycle.cache import ArtifactCache
from precast.lifecycle.gdn_bwd import FORWARD_FIELDS, kernel_modes
from precast.lifecycle.gdn_rules import check_gdn_gradients, check_gdn_inputs
from precast.lifecycle.op import OP_REGISTRY
from precast.plan import OP_MODULES, expand

BF, FP, F32, F64, I32, I64 = (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                              torch.int32, torch.int64)
# Grouped v heads (four per q / k head: the finishing kernel runs) and K != V, so that every
# shape mix-up is visible.
T, N, HQ, HK, HV, K, V = 128, 4, 2, 2, 8, 64, 128
HO = max(HQ, HV)
CHUNKS = T // 64 + N
COMPILED_OPS = sys.modules["precast.op_cache"]
# What a call of this file's (grouped) configuration launches on a 16-SM stand-in device
# (too few SMs to split the recurrences).
LAUNCHED = ["prepare", "states", "state_grad", "chunk_grad", "finish"]


def expected_modes(cfg) -> tuple:
    split = ("states_split", "state_grad_split") if cfg["v_dim"] == 128 else ()
    grouped = len({cfg["q_heads"], cfg["k_heads"], cfg["v_heads"]}) > 1
    regenerate = () if cfg["checkpoint_dtype"] == "none" else (
        ("regenerate", "regenerate_split") if cfg["v_dim"] == 128 else ("regenerate",))
    return ("seq_table", "prepare", "states", "state_grad", "chunk_grad") + split + (
        ("finish",) if grouped else ()) + regenerate


@pytest.fixture(autouse=True)
def _isolated(request, monkeypatch, tmp_path):
    """Nothing here builds or loads kernels (but the compile-marked tests); no cached ops."""
    if request.node.get_closest_marker("compile") is None:
        isolate_from_kernels(monkeypatch, tmp_path)


def samples(t=T, n=N, hq=HQ, hk=HK, hv=HV, k=K, v=V, dtype=BF, g_dtype=F32, beta_dtype=F32):
    ho = max(hq, hv)
    return dict(sample_q=desc((t, hq, k), dtype), sample_k=desc((t, hk, k), dtype),
                sample_v=desc((t, hv, v), dtype), sample_g=desc((t, ho), g_dtype),
                sample_beta=desc((t, ho), beta_dtype), sample_cu_seqlens=desc((n + 1,), I32),
                sample_do=desc((t, ho, v), dtype))


def bwd(**kw) -> GdnBwdSm90:
    return GdnBwdSm90(**{**samples(), **kw})


def keeping_forward() -> GdnFwdSm90:
    """The forward of bwd()'s inputs (whose workspace a backward may reuse)."""
    return GdnFwdSm90(**{n: t for n, t in samples().items() if n != "sample_do"}
                      ).check_support()


def kept_factors(forward: GdnFwdSm90):
    """Meta tensors of its kept workspace (work16, work32) for T tokens, N sequences
    (made here, not by the op under test: ``launches`` records allocations)."""
    return tuple(meta(*shape, dtype=dtype) for shape, dtype in zip(
        forward.workspace_shapes(T, N), forward.workspace_dtypes()))


def state(rows=N, dtype=F32):
    return desc((rows, HO, V, K), dtype)


def call(t=T, n=N, dtype=BF, **kw):
    """execute() arguments (meta tensors) of the base configuration."""
    a = dict(q=meta(t, HQ, K, dtype=dtype), k=meta(t, HK, K, dtype=dtype),
             v=meta(t, HV, V, dtype=dtype), g=meta(t, HO, dtype=F32),
             beta=meta(t, HO, dtype=F32), cu_seqlens=meta(n + 1, dtype=I32),
             do=meta(t, HO, V, dtype=dtype), dq=meta(t, HQ, K, dtype=dtype),
             dk=meta(t, HK, K, dtype=dtype), dv=meta(t, HV, V, dtype=dtype),
             dg=meta(t, HO, dtype=F32), dbeta=meta(t, HO, dtype=F32))
    return {**a, **kw}


# --- registration -------------------------------------------------------------------------------
def test_exported_and_registered():
    assert precast.GdnBwdSm90 is GdnBwdSm90
    assert precast.gated_delta_net_backward is gated_delta_net_backward
    assert {"GdnBwdSm90", "gated_delta_net_backward"} <= set(precast.__all__)
    assert OP_REGISTRY["GdnBwdSm90"] is GdnBwdSm90
    assert "precast.lifecycle.gdn_bwd" in OP_MODULES
    assert hasattr(torch.ops.precast, "gated_delta_net_backward")
    assert GdnBwdSm90.supported_archs == ("sm_90a",)
    assert set(GdnBwdSm90.kernel_sources) >= {
        "precast.kernels.gdn_chunk_sm90", "precast.kernels.gdn_recurrence_sm90",
        "precast.kernels.gdn_bwd_recurrence_sm90", "precast.kernels.gdn_bwd_chunk_sm90",
        "precast.kernels.gdn_bwd_finish_sm90", "precast.kernels.gdn_layout",
        "precast.kernels.gdn_seq_table_sm90"}
    # the stage 1 and 2 fake arguments are built by the forward's module
    assert GdnBwdSm90.host_sources == ("precast.lifecycle.gdn_fwd",)


def test_cache_key_fingerprints_the_forward_module(monkeypatch):
    from precast.lifecycle import op as op_mod
    seen = []
    monkeypatch.setattr(op_mod, "source_fingerprint", lambda mods: seen.append(mods) or "x")
    bwd().check_support().cache_key("sm_90a")
    assert seen == [GdnBwdSm90.kernel_sources + ("precast.lifecycle.gdn_bwd",
                                                 "precast.lifecycle.gdn_fwd")]


# --- static configuration and cache key ---------------------------------------------------------
BASE_CONFIG = {"dtype": "bfloat16", "k_dim": K, "v_dim": V, "q_heads": HQ, "k_heads": HK,
               "v_heads": HV, "g_dtype": "float32", "beta_dtype": "float32",
               "state_dtype": "none", "use_qk_l2norm_in_kernel": False,
               "final_state_grad": False, "checkpoint_dtype": "none"}


def test_static_config_reads_the_samples():
    assert bwd().static_config() == BASE_CONFIG
    op = bwd(sample_initial_state=state(dtype=BF), sample_dfinal=state(),
             use_qk_l2norm_in_kernel=True, **samples(g_dtype=BF, beta_dtype=FP))
    assert op.static_config() == {**BASE_CONFIG, "state_dtype": "io", "final_state_grad": True,
                                  "use_qk_l2norm_in_kernel": True, "g_dtype": "bfloat16",
                                  "beta_dtype": "float16"}


STATIC_CHANGES = {
    "dtype": samples(dtype=FP),
    "k_dim": samples(k=128),
    "v_dim": samples(v=64),
    "k_heads": samples(hk=HV),
    "v_heads": samples(hv=HQ),
    "g_dtype": samples(g_dtype=BF),
    "beta_dtype": samples(beta_dtype=BF),
    "state_dtype": dict(sample_initial_state=state()),
    "final_state_grad": dict(sample_dfinal=state()),
    "use_qk_l2norm_in_kernel": dict(use_qk_l2norm_in_kernel=True),
    "checkpoint_dtype": dict(sample_checkpoints=state(rows=CHUNKS, dtype=BF),
                             checkpoint_every_n_tokens=64),
}


@pytest.mark.parametrize("field", sorted(STATIC_CHANGES))
def test_cache_key_changes_with_each_static_field(fixed_sources, field):
    base, changed = bwd(), bwd(**STATIC_CHANGES[field])
    assert key_of(changed) != key_of(base)
    assert {k for k, v in changed.static_config().items()
            if base.static_config()[k] != v} == {field}


@pytest.mark.parametrize("kw", [
    dict(scale=0.125), dict(**samples(t=4096, n=1)), dict(**samples(t=0, n=0)),
    # without checkpoints, n describes nothing
    dict(checkpoint_every_n_tokens=128),
    dict(sample_q=desc((T, HQ, K), stride=(3 * HQ * K, K + 8, 1)),
         sample_do=desc((T, HO, V), stride=(2 * HO * V, V, 1))),
])
def test_cache_key_ignores_runtime_values(fixed_sources, kw):
    assert key_of(bwd(**kw)) == key_of(bwd())


@pytest.mark.parametrize("dtype", [BF, F32])
def test_checkpoint_spacing_is_a_runtime_value(fixed_sources, dtype):
    """Reused (n = 64 in the io dtype) or regenerated from, one compile: only the
    checkpoints' dtype is static."""
    keys = {key_of(bwd(sample_checkpoints=state(rows=T // n + N, dtype=dtype),
                       checkpoint_every_n_tokens=n)) for n in (64, 128, 640)}
    assert len(keys) == 1 and key_of(bwd()) not in keys


CONFIGS = [
    {}, dict(dtype="float16", k_dim=64, v_dim=64),
    dict(q_heads=4, k_heads=4, v_heads=16), dict(q_heads=16, k_heads=4, v_heads=4),
    dict(g_dtype="bfloat16", beta_dtype="float16"),
    dict(state_dtype="float32", final_state_grad=True, use_qk_l2norm_in_kernel=True),
    dict(state_dtype="io"), dict(final_state_grad=True), dict(checkpoint_dtype="float32"),
    dict(checkpoint_dtype="io", v_dim=64, state_dtype="float32"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_from_config_round_trip(config):
    op = GdnBwdSm90.from_config(**config).check_support()
    cfg = op.static_config()
    assert set(cfg) == set(BASE_CONFIG)
    for key, value in config.items():
        assert cfg[key] == value
    assert GdnBwdSm90.from_config(**cfg).static_config() == cfg
    (entry,) = expand({"name": "GdnBwdSm90", **cfg})
    assert dict(entry.config) == cfg
    assert tuple(op._kernel_builders()) == kernel_modes(op.shapes) == expected_modes(cfg)


@pytest.mark.parametrize("config,exc,match", [
    (dict(state_dtype="bfloat16"), ValueError, "state_dtype must be one of 'none', 'float32', "
     "'io'"),
    (dict(final_state_grad=1), TypeError, "final_state_grad must be a bool, got int"),
    (dict(use_qk_l2norm_in_kernel="yes"), TypeError, "use_qk_l2norm_in_kernel must be a bool"),
    (dict(k_dim=96), NotImplementedError, "head dim K = 96 is not supported"),
    (dict(q_heads=3, v_heads=4), ValueError, "HQ and HV must be equal or one a multiple"),
    (dict(dtype="float8"), TypeError, "unknown dtype 'float8'"),
])
def test_from_config_rules(config, exc, match):
    with pytest.raises(exc, match=match):
        GdnBwdSm90.from_config(**config).check_support()


# --- the backward's rules on the samples ----------------------------------------------------------
@pytest.mark.parametrize("kw,exc,match", [
    (dict(sample_state_indices=desc((N,), I32), sample_initial_state=state(rows=9)),
     NotImplementedError, r"state_indices: the state pool is forward only"),
    (dict(sample_do=None), ValueError, r"do is required: \[T, HO, V\] bfloat16"),
    (dict(sample_do=desc((T, HO, K))), ValueError,
     r"do: shape \[128, 8, 64\] does not match \[T, HO, V\] = \[128, 8, 128\]"),
    (dict(sample_do=desc((T, HO, V), F32)), TypeError,
     "do: dtype float32 is not supported; expected bfloat16"),
    (dict(sample_do=desc((T, HV, V), stride=(HV * V, V + 4, 1))), ValueError,
     "do: axis-1 stride 132 must be a multiple of 8 elements"),
    (dict(sample_dfinal=state(dtype=BF)), TypeError,
     "dfinal: dtype bfloat16 is not supported; expected float32"),
    (dict(sample_dfinal=desc((N + 1, HO, V, K), F32)), ValueError,
     r"dfinal: shape \[5, 8, 128, 64\] does not match \[N, HO, V, K\]"),
    (dict(sample_initial_state=state(dtype=FP)), TypeError, "initial_state: dtype float16"),
    (dict(sample_checkpoints=state(rows=CHUNKS, dtype=BF)), ValueError,
     "checkpoints is given but checkpoint_every_n_tokens is None"),
    (dict(sample_checkpoints=state(rows=CHUNKS, dtype=BF), checkpoint_every_n_tokens=128),
     ValueError, r"checkpoints: shape \[6, 8, 128, 64\] does not match"),
    (dict(sample_checkpoints=state(rows=CHUNKS, dtype=FP), checkpoint_every_n_tokens=64),
     TypeError, "checkpoint_dtype: float16 is not supported"),
    (dict(scale=0.0), ValueError, "scale must be positive"),
    (dict(sample_do=desc((T, HO, V), stride=(V, 2**30, 1))), NotImplementedError,
     "do: the head stride 1073741824 puts the last head"),
])
def test_sample_rules(kw, exc, match):
    with pytest.raises(exc, match=match):
        bwd(**kw).check_support()


def test_at_most_65535_sequences():
    bwd(**samples(t=0, n=65535)).check_support()
    with pytest.raises(NotImplementedError, match="N = 65536 sequences"):
        bwd(**samples(t=0, n=65536)).check_support()


# --- execute: the call against the op's configuration ---------------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """conftest.record_launches for GdnBwdSm90: its torch-side work runs in its module and
    in the forward's (stream_buffers, offsets_as_int32)."""
    monkeypatch.setattr(fwd_module, "sm_count", lambda index: 16)  # splits_recurrences
    return record_launches(monkeypatch, (bwd_module, fwd_module),
                           lambda op: tuple(op._kernel_builders()), "empty")


def kinds(rec):  # what happened on the device, but for the side stream's fork and join
    return [e[0] for e in rec.events if e[0] not in ("fork", "join")]


def workspace(op, t=T, n=N, device="meta"):
    """make_workspace's buffers, made by the real torch (the recorder stands in for the
    module's)."""
    return {name: torch.empty(shape, dtype=op.workspace_dtype(name), device=device)
            for name, shape in op.workspace_shapes(t, n).items()}


def same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


@pytest.mark.parametrize("op_kw,changes,exc,match", [
    ({}, dict(q=meta(T, 2 * HQ, K), k=meta(T, 2 * HK, K)), ValueError,
     r"q_heads = 4 \(q heads HQ\) but this op is compiled for q_heads = 2; make another "
     r"GdnBwdSm90 for this configuration \(gated_delta_net_backward keeps one"),
    ({}, dict(dfinal=meta(N, HO, V, K, dtype=F32)), ValueError,
     r"final_state_grad = True \(dfinal given \(the final state's gradient\)\) but this op is "
     "compiled for final_state_grad = False"),
    (dict(sample_dfinal=state()), {}, ValueError, "dfinal is required: this op is compiled "
     "for final_state_grad=True"),
    ({}, dict(initial_state=meta(N, HO, V, K, dtype=F32)), ValueError,
     r"state_dtype = 'float32'.*compiled for state_dtype = 'none'"),
    ({}, dict(g=meta(T, HO), dg=meta(T, HO)), TypeError, "g_dtype = 'bfloat16'"),
    ({}, dict(state_indices=meta(N, dtype=I32)), NotImplementedError,
     "state pool is forward only"),
    ({}, dict(do=None), ValueError, "do is required"),
    ({}, dict(dq=None), ValueError, r"dq is required: \[T, HQ, K\] bfloat16 \(its input's\)"),
    ({}, dict(dk=meta(T, HV, K)), ValueError, r"dk: shape \[128, 8, 64\] does not match "
     r"\[T, HK, K\] = \[128, 2, 64\]"),
    ({}, dict(dv=meta(T, HV, V, dtype=FP)), TypeError, "dv: dtype float16 is not supported; "
     "expected bfloat16"),
    ({}, dict(dg=meta(T, HO)), TypeError, "dg: dtype bfloat16 is not supported; expected "
     "float32"),
    ({}, dict(dbeta=meta(T, HO + 1, dtype=F32)), ValueError, r"dbeta: shape \[128, 9\] does "
     r"not match \[T, HO\]"),
    ({}, dict(dinitial_state=meta(N, HO, V, K, dtype=F32)), ValueError,
     "dinitial_state is given but there is no initial_state to differentiate"),
    (dict(sample_initial_state=state()), dict(initial_state=meta(N, HO, V, K, dtype=F32)),
     ValueError, "dinitial_state is required with an initial_state"),
    (dict(sample_initial_state=state(dtype=BF)),
     dict(initial_state=meta(N, HO, V, K), dinitial_state=meta(N, HO, V, K, dtype=F32)),
     TypeError, "dinitial_state: dtype float32 is not supported; expected bfloat16"),
])
def test_execute_refuses(launches, op_kw, changes, exc, match):
    op = bwd(**op_kw).check_support()
    with pytest.raises(exc, match=match):
        op.execute(**call(**changes), stream=1)
    assert launches.events == []


# --- execute: launches (kernels stood in for) -----------------------------------------------------
def test_execute_launches_every_stage_in_order(launches):
    op = bwd(use_qk_l2norm_in_kernel=True, scale=0.5).check_support()
    a = call()
    op.execute(**a, stream=7)
    assert [m for m, _ in launches.calls] == LAUNCHED
    (_, prep), (_, states), (_, sgrad), (_, cgrad), (_, fin) = launches.calls
    q, k, v, g, beta, cu, do = (a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens", "do"))
    # N <= 32 sequences: no table, cu_seqlens stands in for it (the argument after it)
    # prepare(q, k, v, g, beta, cu_seqlens, table, work16, work32, scale, stream)
    assert same(prep[:7], [q, k, v, g, beta, cu, cu]) and prep[9:] == (0.5, 7)
    assert [tuple(t.shape) for t in prep[7:9]] == [(CHUNKS, HO, 64, 64), (CHUNKS, HO, 272)]
    # states(q, k, work16, work32, cu_seqlens, table, no o, initial state, None, None,
    # states, v, 64, stream): on a side stream forked after prepare, joined before
    # chunk_grad (W and U made from v, T and its scales)
    assert same(states[:6], [q, k, prep[7], prep[8], cu, cu])
    assert states[6:10] == (None, None, None, None) and states[12:] == (64, 7 + SIDE_OFFSET)
    assert states[11] is a["v"]
    assert [e for e in launches.events if e[0] in ("fork", "join", "launch")] == [
        ("launch", "prepare"), ("fork", 7), ("launch", "states"), ("launch", "state_grad"),
        ("join", 7), ("launch", "chunk_grad"), ("launch", "finish")]
    assert tuple(states[10].shape) == (CHUNKS, HO, V, K) and states[10].dtype == BF
    # state_grad(q, k, do, work16, work32, cu_seqlens, table, dfinal, dstates, dinit, stream)
    assert same(sgrad[:7], [q, k, do, prep[7], prep[8], cu, cu]) and sgrad[7] is None
    assert tuple(sgrad[8].shape) == (CHUNKS, HO, V, K) and sgrad[8].dtype == BF
    assert sgrad[9:] == (None, 7)
    # chunk_grad(q, k, v, g, beta, cu_seqlens, table, do, work16, work32, states,
    # dstates, dq_heads, dk_heads, dv (v's heads are not grouped: final there), dg, dbeta,
    # scale,
    # stream)
    assert same(cgrad[:12], [q, k, v, g, beta, cu, cu, do, prep[7], prep[8], states[10],
                             sgrad[8]])
    assert [(tuple(t.shape), t.dtype) for t in cgrad[12:14]] == [
        ((T, HO, K), BF), ((T, HO, K), BF)] and cgrad[14] is a["dv"]
    assert same(cgrad[15:17], [a["dg"], a["dbeta"]]) and cgrad[17:] == (0.5, 7)
    # finish(q, k, dq_heads, dk_heads, no dv_heads, dq, dk, dv, stream)
    assert same(fin[:4], [q, k, *cgrad[12:14]]) and fin[4] is None
    assert same(fin[5:8], [a["dq"], a["dk"], a["dv"]]) and fin[-1] == 7
    # the op's buffers, made once on the launch stream before the launches
    assert kinds(launches)[-5:] == ["launch"] * 5 and "launch" not in kinds(launches)[:-5]
    assert launches.capture_queries == [7] * 3 and len(op._workspaces) == 3
    assert op._table_buffers == {}


def test_split_recurrences_when_the_pairs_fill_at_most_half_the_sms(launches, monkeypatch):
    """The forward's rule (gdn_fwd.splits_recurrences): N HO = 32 pairs here."""
    op = bwd().check_support()
    for sms, split in ((63, False), (64, True), (132, True)):
        monkeypatch.setattr(fwd_module, "sm_count", lambda index: sms)
        launches.calls.clear()
        op.execute(**call(), stream=1)
        suffix = "_split" if split else ""
        assert [m for m, _ in launches.calls] == [
            "prepare", "states" + suffix, "state_grad" + suffix, "chunk_grad", "finish"]


def io_checkpoint_op(**kw) -> GdnBwdSm90:
    """The base configuration with an fp32 initial state and io-dtype checkpoints."""
    return bwd(sample_initial_state=state(), sample_checkpoints=state(rows=CHUNKS, dtype=BF),
               checkpoint_every_n_tokens=64, **kw).check_support()


def test_checkpoints_at_64_in_the_io_dtype_are_reused(launches):
    """The states kernel is skipped and the checkpoints are the chunk states; the op does
    not make the states buffer."""
    op = io_checkpoint_op()
    ckpt = meta(CHUNKS, HO, V, K)
    s0, ds0 = meta(N, HO, V, K, dtype=F32), meta(N, HO, V, K, dtype=F32)
    op.execute(**call(), initial_state=s0, dinitial_state=ds0, checkpoints=ckpt,
               checkpoint_every_n_tokens=64, stream=3)
    assert [m for m, _ in launches.calls] == ["prepare", "state_grad", "chunk_grad", "finish"]
    assert launches.calls[2][1][10] is ckpt
    assert launches.calls[1][1][9] is ds0  # a float32 initial state: written in place
    assert all("states" not in key and "o" not in key for key in op._workspaces)


@pytest.mark.parametrize("n,dtype", [(128, BF), (640, BF), (64, F32), (192, F32)])
def test_states_are_regenerated_from_coarse_or_float32_checkpoints(launches, n, dtype):
    """The states pass starts from the checkpoints (one grid row per checkpoint row, n a
    runtime argument) instead of the initial state; the chunk kernel reads its states."""
    op = (io_checkpoint_op() if dtype == BF else bwd(
        sample_initial_state=state(), sample_checkpoints=state(rows=CHUNKS, dtype=F32),
        checkpoint_every_n_tokens=64).check_support())
    s0, ds0 = meta(N, HO, V, K, dtype=F32), meta(N, HO, V, K, dtype=F32)
    ckpt = meta(T // n + N, HO, V, K, dtype=dtype)
    op.execute(**call(), initial_state=s0, dinitial_state=ds0, checkpoints=ckpt,
               checkpoint_every_n_tokens=n, stream=3)
    assert [m for m, _ in launches.calls] == ["prepare", "regenerate", "state_grad",
                                              "chunk_grad", "finish"]
    # regenerate(q, k, work16, work32, cu_seqlens, table, no o, checkpoints, None, None,
    # states, v, n, stream)
    states = launches.calls[1][1]
    assert states[5] is states[4]  # N <= 32: cu_seqlens stands in for the table
    assert states[6] is None and states[7] is ckpt and states[8:10] == (None, None)
    assert tuple(states[10].shape) == (CHUNKS, HO, V, K) and states[12:] == (n, 3 + SIDE_OFFSET)
    assert launches.calls[3][1][10] is states[10]
    assert not any(x is s0 for x in states)


def test_regeneration_splits_by_checkpoint_rows(launches, monkeypatch):
    """gdn_fwd.splits_recurrences with the checkpoint rows (T // n + N) as the grid rows:
    V = 128, 2 rows HO <= SMs."""
    op = bwd(sample_checkpoints=desc((CHUNKS, HO, 128, 128), BF), checkpoint_every_n_tokens=64,
             **samples(v=128, k=128)).check_support()
    rows = T // 128 + N
    for sms, split in ((2 * rows * HO - 1, False), (2 * rows * HO, True)):
        monkeypatch.setattr(fwd_module, "sm_count", lambda index: sms)
        launches.calls.clear()
        op.execute(**call(v=meta(T, HV, 128), do=meta(T, HO, 128), dv=meta(T, HV, 128),
                          q=meta(T, HQ, 128), k=meta(T, HK, 128), dq=meta(T, HQ, 128),
                          dk=meta(T, HK, 128)),
                   checkpoints=meta(rows, HO, 128, 128), checkpoint_every_n_tokens=128,
                   stream=1)
        assert launches.calls[1][0] == "regenerate" + ("_split" if split else "")


def test_io_initial_state_gradient_is_converted_on_the_stream(launches):
    op = bwd(sample_initial_state=state(dtype=BF), sample_dfinal=state()).check_support()
    s0, ds0, dfin = meta(N, HO, V, K), meta(N, HO, V, K), meta(N, HO, V, K, dtype=F32)
    op.execute(**call(), initial_state=s0, dinitial_state=ds0, dfinal=dfin, stream=5)
    sgrad = launches.calls[2][1]
    assert sgrad[7] is dfin and sgrad[9].dtype == F32
    assert tuple(sgrad[9].shape) == (N, HO, V, K)
    assert launches.calls[1][1][7] is s0
    assert launches.events[-3:] == [("stream", 5, None), ("copy", ds0, sgrad[9]),
                                    ("end stream",)]
    assert op.workspace_shapes(T, N)["dinit32"] == (N, HO, V, K)
    assert "dinit32" not in bwd(sample_initial_state=state()).workspace_shapes(T, N)


def test_int64_cu_seqlens_run_from_an_int32_copy(launches):
    op = bwd().check_support()
    cu64 = meta(N + 1, dtype=I64)
    op.execute(**call(cu_seqlens=cu64), stream=4)
    offsets = launches.calls[0][1][5]
    assert offsets.dtype == I32 and tuple(offsets.shape) == (N + 1,)
    assert launches.calls[0][1][6] is offsets  # the table's stand-in too
    assert same(launches.calls[1][1][4:6], [offsets] * 2)  # states
    assert same(launches.calls[2][1][5:7], [offsets] * 2)  # state_grad
    assert same(launches.calls[3][1][5:7], [offsets] * 2)
    copies = [e for e in launches.events if e[0] == "copy"]
    assert copies[-1][1] is offsets and copies[-1][2] is cu64


def test_scale_is_a_runtime_value(launches):
    op = bwd(scale=0.5).check_support()
    op.execute(**call(), stream=1)
    op.execute(**call(), stream=1, scale=0.25)
    assert [c[9] for m, c in launches.calls if m == "prepare"] == [0.5, 0.25]
    assert [c[17] for m, c in launches.calls if m == "chunk_grad"] == [0.5, 0.25]
    bwd().check_support().execute(**call(), stream=1)
    assert launches.calls[-5][1][9] == 1 / math.sqrt(K)


# --- the per-sequence table (gdn_fwd.sequence_table) ----------------------------------------------
MANY = fwd_module.TABLE_MIN_SEQS + 8  # 40 sequences: the table
TABLE = 2 * (MANY + 1)  # its int32 entries
# where each kernel that locates chunks takes cu_seqlens (the table right after it)
CU_AT = {"prepare": 5, "states": 4, "regenerate": 4, "state_grad": 5, "chunk_grad": 5}


def tables(rec):
    """(cu_seqlens, table) as each recorded launch of CU_AT's kernels took them."""
    return [(m, *args[CU_AT[m]:CU_AT[m] + 2]) for m, args in rec.calls if m in CU_AT]


@pytest.mark.parametrize("n,dtype", [(None, None), (128, BF), (64, F32)])
def test_more_than_32_sequences_get_the_sequence_table(launches, n, dtype):
    """N = 40: seq_table(cu_seqlens, table, every, stream) runs first, into an int32 buffer
    of 2 (N + 1) the op makes on the stream and keeps per (device, stream); every kernel
    that locates chunks takes the table right after cu_seqlens. every: n when the states
    are regenerated from checkpoints (coarse, or float32), else 64 (the states pass writes
    one state per chunk, at the rows the table's checkpoint half gives)."""
    a, kw = call(n=MANY), {}
    if n is None:
        op = bwd().check_support()
    else:
        op = bwd(sample_initial_state=state(), checkpoint_every_n_tokens=64,
                 sample_checkpoints=state(rows=CHUNKS, dtype=dtype)).check_support()
        kw = dict(initial_state=meta(MANY, HO, V, K, dtype=F32),
                  dinitial_state=meta(MANY, HO, V, K, dtype=F32),
                  checkpoints=meta(T // n + MANY, HO, V, K, dtype=dtype),
                  checkpoint_every_n_tokens=n)
    op.execute(**a, **kw, stream=7)
    states = "states" if n is None else "regenerate"
    assert [m for m, _ in launches.calls] == ["seq_table", "prepare", states, "state_grad",
                                              "chunk_grad", "finish"]
    made = launches.calls[0][1]
    (buffer,) = op._table_buffers[(None, 7)]
    table = made[1]
    assert made[0] is a["cu_seqlens"] and made[2:] == (n or 64, 7)
    assert table._base is buffer and table.dtype == I32 and tuple(table.shape) == (TABLE,)
    assert len(tables(launches)) == 4
    assert all(cu is a["cu_seqlens"] and t is table for _, cu, t in tables(launches))
    assert ("empty", (TABLE,), I32) in launches.events
    # the next call on the stream reuses the buffer
    launches.calls.clear()
    launches.events.clear()
    op.execute(**a, **kw, stream=7)
    assert kinds(launches) == ["launch"] * 6 and op._table_buffers[(None, 7)][0] is buffer
    table = launches.calls[0][1][1]
    assert table._base is buffer and all(t is table for *_, t in tables(launches))


def test_32_sequences_scan_cu_seqlens(launches):
    """N = TABLE_MIN_SEQS: no seq_table launch; cu_seqlens stands in for the table (also
    with the forward's factors, which skip prepare)."""
    op = bwd().check_support()
    a = call(n=fwd_module.TABLE_MIN_SEQS)
    op.execute(**a, stream=7)
    assert [m for m, _ in launches.calls] == LAUNCHED
    assert len(tables(launches)) == 4
    assert all(cu is t is a["cu_seqlens"] for _, cu, t in tables(launches))
    assert op._table_buffers == {}


def test_sequence_table_with_the_forward_workspace(launches):
    """Without prepare (the forward's factors) the other kernels still take the table."""
    op = bwd().check_support()
    forward = keeping_forward()
    factors = tuple(meta(*shape, dtype=dtype) for shape, dtype in zip(
        forward.workspace_shapes(T, MANY), forward.workspace_dtypes()))
    op.execute(**call(n=MANY), forward_workspace=factors, stream=3)
    assert [m for m, _ in launches.calls] == ["seq_table"] + LAUNCHED[1:]
    table = launches.calls[0][1][1]
    assert [t is table for *_, t in tables(launches)] == [True] * 3


def test_sequence_table_of_int64_cu_seqlens_reads_the_int32_copy(launches):
    op = bwd().check_support()
    op.execute(**call(n=MANY, cu_seqlens=meta(MANY + 1, dtype=I64)), stream=4)
    (_, made), (_, prep) = launches.calls[:2]
    offsets = prep[5]
    assert offsets.dtype == I32 and offsets._base is op._offset_buffers[(None, 4)][0]
    assert made[0] is offsets and made[1]._base is op._table_buffers[(None, 4)][0]
    assert all(cu is offsets and t is made[1] for _, cu, t in tables(launches))


def test_sequence_table_not_made_while_capturing(launches):
    """A stream capturing a graph before the op has a table buffer: no allocation, no
    seq_table, the kernels scan cu_seqlens; a buffer made before the capture is used."""
    op = bwd().check_support()
    ws, a = workspace(op, n=MANY), call(n=MANY)
    launches.capturing = True
    op.execute(**a, workspace=ws, stream=7)
    assert [m for m, _ in launches.calls] == LAUNCHED
    assert all(cu is t is a["cu_seqlens"] for _, cu, t in tables(launches))
    assert kinds(launches) == ["launch"] * 5 and op._table_buffers == {}
    launches.capturing = False
    op.execute(**a, workspace=ws, stream=7)  # makes the buffer
    (buffer,) = op._table_buffers[(None, 7)]
    launches.capturing = True
    launches.calls.clear()
    launches.events.clear()
    op.execute(**a, workspace=ws, stream=7)
    assert [m for m, _ in launches.calls] == ["seq_table"] + LAUNCHED
    table = launches.calls[0][1][1]
    assert table._base is buffer and all(t is table for *_, t in tables(launches))
    assert kinds(launches) == ["launch"] * 6


# --- the workspace --------------------------------------------------------------------------------
def test_make_workspace_defaults_to_the_cuda_device(monkeypatch):
    """Without a device the workspace goes where execute() needs it (the CUDA device)."""
    made = []
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: made.append(kw["device"]))
    bwd().make_workspace(T, N)
    assert made and set(made) == {"cuda"}


def test_workspace_shapes():
    op = bwd()
    shapes = op.workspace_shapes(T, N)
    assert shapes == {"work16": (CHUNKS, HO, 64, 64), "work32": (CHUNKS, HO, 272),
                      "dstates": (CHUNKS, HO, V, K), "states": (CHUNKS, HO, V, K),
                      "dq_heads": (T, HO, K), "dk_heads": (T, HO, K)}  # v: no grouped heads
    assert op.workspace_shapes(0, 3)["work16"][0] == 3
    assert op.workspace_shapes(65, 2)["dq_heads"][0] == 65
    assert {n: op.workspace_dtype(n) for n in shapes} == {
        **{n: BF for n in ("work16", "dstates", "states", "dq_heads", "dk_heads")},
        "work32": F32}
    ws = op.make_workspace(T, N, device="meta")
    assert {n: (tuple(t.shape), t.dtype) for n, t in ws.items()} == {
        n: (shape, op.workspace_dtype(n)) for n, shape in shapes.items()}
    with pytest.raises(ValueError, match="total_tokens must be >= 0"):
        op.workspace_shapes(-1, 1)


@pytest.mark.parametrize("hq,hk,hv,head_grads", [
    (8, 8, 8, ()), (4, 4, 8, ()), (2, 2, 8, ("dq_heads", "dk_heads")),
    (2, 8, 8, ("dq_heads",)), (4, 8, 8, ()), (8, 8, 2, ("dv_heads",)), (8, 8, 4, ()),
    (8, 2, 2, ("dk_heads", "dv_heads")), (8, 4, 4, ())])
def test_only_groups_of_more_than_two_go_through_per_head_buffers(hq, hk, hv, head_grads):
    """The chunk kernel writes a gradient final when its input has a head per output head
    (one writer per row) or adds into it when two (gradients_added); only the others take
    a per-output-head buffer and the finishing kernel."""
    from precast.kernels.gdn_layout import gradients_added, gradients_in_place
    op = GdnBwdSm90(**samples(hq=hq, hk=hk, hv=hv)).check_support()
    shapes = op.workspace_shapes(T, N)
    assert tuple(n for n in bwd_module.HEAD_GRADS if n in shapes) == head_grads
    assert ("finish" in op._kernel_builders()) == bool(head_grads)
    ho = max(hq, hv)
    assert gradients_added(hq, hk, hv) == tuple(ho == 2 * h for h in (hq, hk, hv))
    assert gradients_in_place(hq, hk, hv) == tuple(ho <= 2 * h for h in (hq, hk, hv))


@pytest.mark.parametrize("reuse", [False, True])
def test_pairs_of_output_heads_add_into_zeroed_gradients(launches, reuse):
    """Two output heads per q / k head (HQ = HK = 4, HV = 8): no finishing kernel and no
    per-head buffers; dq and dk are zeroed on the side stream (forked after prepare, queued
    behind the states pass after state_grad's launch, joined before chunk_grad), which adds
    into them; dv is written in place."""
    kw = (dict(sample_initial_state=state(), sample_checkpoints=state(rows=CHUNKS, dtype=BF),
               checkpoint_every_n_tokens=64) if reuse else {})
    op = GdnBwdSm90(**samples(hq=4, hk=4), **kw).check_support()
    a = call(q=meta(T, 4, K), k=meta(T, 4, K), dq=meta(T, 4, K), dk=meta(T, 4, K))
    if reuse:
        a.update(initial_state=meta(N, HO, V, K, dtype=F32),
                 dinitial_state=meta(N, HO, V, K, dtype=F32),
                 checkpoints=meta(CHUNKS, HO, V, K), checkpoint_every_n_tokens=64)
    op.execute(**a, stream=5)
    side = 5 + SIDE_OFFSET
    states = [] if reuse else [("launch", "states")]
    events = [e for e in launches.events if e[0] in ("launch", "fork", "join", "zero")
              or e[:2] == ("stream", side) or e == ("end stream",)]
    assert events[events.index(("launch", "prepare")):] == [
        ("launch", "prepare"), ("fork", 5), *states, ("launch", "state_grad"),
        ("stream", side, None), ("zero", a["dq"]), ("zero", a["dk"]), ("end stream",),
        ("join", 5), ("launch", "chunk_grad")]
    cgrad = launches.calls[-1][1]
    assert same(cgrad[12:15], [a["dq"], a["dk"], a["dv"]])
    assert not any(name in key for key in op._workspaces for name in bwd_module.HEAD_GRADS)


def test_execute_with_a_workspace_allocates_nothing(launches):
    op = bwd().check_support()
    ws = workspace(op)
    launches.capturing = True  # also while the stream captures
    args = call()
    op.execute(**args, workspace=ws, stream=3)
    assert kinds(launches) == ["launch"] * 5 and op._workspaces == {}
    (_, prep), (_, states), (_, sgrad), (_, cgrad), _ = launches.calls
    assert same(prep[7:9], [ws["work16"], ws["work32"]])
    assert states[6] is None and states[10] is ws["states"]
    assert sgrad[8] is ws["dstates"] and cgrad[11] is ws["dstates"]
    assert same(cgrad[12:15], [ws["dq_heads"], ws["dk_heads"], args["dv"]])
    # reusing checkpoints, states may be left out
    ckpt = meta(CHUNKS, HO, V, K)
    del ws["states"]
    op = bwd(sample_checkpoints=state(rows=CHUNKS, dtype=BF),
             checkpoint_every_n_tokens=64).check_support()
    op.execute(**call(), workspace=ws, checkpoints=ckpt, checkpoint_every_n_tokens=64, stream=3)
    with pytest.raises(ValueError, match=r"workspace: lacks \['states'\]"):
        op.execute(**call(), workspace=ws, checkpoints=meta(T // 128 + N, HO, V, K),
                   checkpoint_every_n_tokens=128, stream=3)


def test_forward_workspace_skips_prepare(launches):
    """The factors a forward wrote (its workspace: work16, work32, the same shapes as the
    backward's) replace the prepare kernel."""
    op = bwd().check_support()
    forward = keeping_forward()
    shapes = op.workspace_shapes(T, N)
    names = ("work16", "work32")
    assert forward.workspace_shapes(T, N) == tuple(shapes[n] for n in names)
    factors = kept_factors(forward)
    a = call()
    op.execute(**a, forward_workspace=factors, stream=3)
    assert [mode for mode, _ in launches.calls] == LAUNCHED[1:]
    (_, states), (_, sgrad), (_, cgrad), _ = launches.calls
    assert same(states[2:4], factors) and same(sgrad[3:5], factors)
    assert same(cgrad[8:10], factors)
    assert not any(n in key for key in op._workspaces for n in names)
    # a workspace without them is complete
    ws = {n: t for n, t in workspace(op).items() if n not in names}
    op.execute(**a, workspace=ws, forward_workspace=list(factors), stream=3)
    assert launches.calls[-2][0] == "chunk_grad" and same(launches.calls[-2][1][8:10], factors)


FORWARD_WORKSPACE_RULES = [
    ("triple", lambda f, a: (*f, meta(CHUNKS, HO, 64, 64)), TypeError,
     r"forward_workspace: expected the pair \(work16, work32\) shaped "
     r"GdnFwdSm90.workspace_shapes\(T, N\), got tuple of 3"),
    ("work32-bf16", lambda f, a: (f[0], meta(*f[1].shape, dtype=BF)), TypeError,
     r"forward_workspace \(work32\): dtype bfloat16 is not supported; expected float32"),
    ("fewer-chunks", lambda f, a: (meta(CHUNKS - 1, *f[0].shape[1:]), *f[1:]), ValueError,
     r"forward_workspace \(work16\): extent 5 on axis 0"),
]


@pytest.mark.parametrize("make,exc,match", [r[1:] for r in FORWARD_WORKSPACE_RULES],
                         ids=[r[0] for r in FORWARD_WORKSPACE_RULES])
def test_execute_refuses_bad_forward_workspaces(launches, make, exc, match):
    op = bwd().check_support()
    a = call()
    factors = kept_factors(keeping_forward())
    with pytest.raises(exc, match=match):
        op.execute(**a, forward_workspace=make(factors, a), stream=1)
    assert launches.events == []


WORKSPACE_RULES = [
    ("not-a-dict", lambda ws: tuple(ws.values()), TypeError,
     "workspace: expected a dict name -> tensor"),
    ("missing", lambda ws: {n: t for n, t in ws.items() if n != "work16"}, ValueError,
     r"workspace: lacks \['work16'\]"),
    ("unknown", lambda ws: {**ws, "inv": meta(CHUNKS, HO, 64, 64)}, ValueError,
     r"workspace: unknown entries \['inv'\]"),
    ("dtype", lambda ws: {**ws, "dq_heads": meta(T, HO, K, dtype=F32)}, TypeError,
     r"workspace\['dq_heads'\]: dtype float32 is not supported; expected bfloat16"),
    ("rows", lambda ws: {**ws, "dstates": meta(CHUNKS - 1, HO, V, K)}, ValueError,
     r"workspace\['dstates'\]: extent 5 on axis 0"),
    ("padded", lambda ws: {**ws, "work16": meta(CHUNKS, HO, 64, 72)[..., :64]}, ValueError,
     r"workspace\['work16'\]: must be contiguous"),
]


@pytest.mark.parametrize("change,exc,match", [r[1:] for r in WORKSPACE_RULES],
                         ids=[r[0] for r in WORKSPACE_RULES])
def test_execute_refuses_bad_workspaces(launches, change, exc, match):
    op = bwd().check_support()
    with pytest.raises(exc, match=match):
        op.execute(**call(), workspace=change(workspace(op)), stream=1)
    assert launches.events == []


def test_own_workspace_per_stream_grown_and_reused(launches):
    op = bwd().check_support()
    op.execute(**call(), stream=7)
    first = dict(op._workspaces)
    op.execute(**call(t=T // 2, n=1), stream=7)  # smaller: views of the same buffers
    assert op._workspaces == first
    assert launches.calls[-1][1][2]._base is first[(None, 7, "dq_heads", "dk_heads")][0]
    op.execute(**call(t=4 * T), stream=7)  # more tokens and chunks: grown
    assert len(op._outgrown) == 3 and op._workspaces.keys() == first.keys()
    op.execute(**call(), stream=8)  # another stream: its own
    assert len(op._workspaces) == 6


def test_own_workspace_refused_while_capturing(launches):
    op = bwd().check_support()
    launches.capturing = True
    with pytest.raises(RuntimeError, match=r"^GdnBwdSm90\.execute: the stream is capturing a "
                       r"CUDA graph and this op has no workspace \['work16', .*\] of 6 rows "
                       r"for it; pass workspace= \(make_workspace\(128, 4\)\)"):
        op.execute(**call(), stream=7)
    assert launches.calls == [] and op._workspaces == {}
    launches.capturing = False
    op.execute(**call(), stream=7)
    launches.capturing = True
    op.execute(**call(), stream=7)  # made before the capture: reused
    assert len(launches.calls) == 10


# --- N == 0 and T == 0 ----------------------------------------------------------------------------
def test_no_sequence_writes_nothing(launches):
    op = bwd(sample_initial_state=state(), sample_dfinal=state()).check_support()
    empty = meta(0, HO, V, K, dtype=F32)
    op.execute(**call(t=0, n=0), initial_state=empty, dinitial_state=meta(0, HO, V, K, dtype=F32),
               dfinal=empty, stream=1)
    assert launches.events == [] and op._workspaces == {}


@pytest.fixture
def on_cpu(monkeypatch, launches):
    """The rules ask tensors for device "cpu": execute() takes CPU tensors (real memory:
    copies and overlaps). (The forward workspace's rule is gdn_fwd's.)"""
    for module, name in ((bwd_module, "check_gdn_inputs"), (bwd_module, "check_gdn_gradients"),
                         (bwd_module, "check_tensor"), (fwd_module, "check_tensor")):
        real = getattr(module, name)

        def on(*a, _real=real, **kw):  # samples (descriptors) still describe cuda tensors
            named = list(a) + list(kw.values()) + (list(a[1].values())
                                                   if isinstance(a[1], dict) else [])
            cpu = any(isinstance(t, torch.Tensor) for t in named)
            return _real(*a, **{**kw, "device": "cpu" if cpu else "cuda"})
        monkeypatch.setattr(module, name, on)
    launches.alloc_device = "cpu"
    return launches


def cpu_call(t, n, **kw):
    return {**{name: torch.zeros(x.shape, dtype=x.dtype) for name, x in call(t=t, n=n).items()},
            **kw}


def test_empty_tokens_initial_state_gradient_is_dfinal(on_cpu):
    op = bwd(sample_initial_state=state(dtype=BF), sample_dfinal=state()).check_support()
    dfinal = torch.randn(N, HO, V, K)
    ds0 = torch.full((N, HO, V, K), math.nan).to(BF)
    op.execute(**cpu_call(0, N), initial_state=torch.zeros(N, HO, V, K, dtype=BF),
               dinitial_state=ds0, dfinal=dfinal, stream=4)
    assert torch.equal(ds0, dfinal.to(BF)) and on_cpu.calls == []
    assert kinds(on_cpu) == ["stream", "copy", "end stream"] and op._workspaces == {}
    # without dfinal: zeros
    op = bwd(sample_initial_state=state()).check_support()
    ds0 = torch.full((N, HO, V, K), math.nan)
    op.execute(**cpu_call(0, N), initial_state=torch.zeros(N, HO, V, K), dinitial_state=ds0,
               stream=4)
    assert torch.equal(ds0, torch.zeros_like(ds0))


def test_gradients_may_not_alias(on_cpu):
    op = bwd().check_support()
    a = cpu_call(T, N)
    with pytest.raises(ValueError, match="dq overlaps q in memory"):
        op.execute(**{**a, "dq": a["q"]}, stream=1)
    with pytest.raises(ValueError, match="dq overlaps dk in memory"):
        op.execute(**{**a, "dk": a["dq"]}, stream=1)
    ws = workspace(op, device="cpu")
    inside = ws["dstates"].reshape(-1)[:T * HO * V].view(T, HO, V)
    with pytest.raises(ValueError, match=r"workspace\['dstates'\] overlaps do in memory"):
        op.execute(**{**a, "do": inside}, workspace=ws, stream=1)
    factors = keeping_forward().make_workspace(T, N, device="cpu")
    inside = factors[0].reshape(-1)[:T * HV * V].view(T, HV, V)
    with pytest.raises(ValueError, match=r"dv overlaps forward_workspace \(work16\) in memory"):
        op.execute(**{**a, "dv": inside}, forward_workspace=factors, stream=1)
    # dg and dbeta as column slices of one gradient buffer: fine
    gates = torch.zeros(T, 2 * HO)
    op.execute(**{**a, "dg": gates[:, :HO], "dbeta": gates[:, HO:]}, stream=1)
    assert [m for m, _ in on_cpu.calls] == LAUNCHED


def test_gradient_rules_on_real_tensors():
    """check_gdn_gradients on CPU tensors: a strided do (a view of a larger buffer) and
    strided gradients pass; cross-device ones fail."""
    named = {n: torch.zeros(x.shape, dtype=x.dtype) for n, x in call().items()}
    s = check_gdn_inputs(*(named[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")),
                         device="cpu")
    inputs = {n: named[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens")}
    grads = {n: named[n] for n in ("dq", "dk", "dv", "dg", "dbeta")} | {"dinitial_state": None}
    do = torch.zeros(T, HO, 2 * V, dtype=BF)[..., :V]
    check_gdn_gradients(s, inputs, do=do, gradients=grads, device="cpu")
    with pytest.raises(ValueError, match="do: tensor is on meta|dq is on meta"):
        check_gdn_gradients(s, inputs, do=do, gradients={**grads, "dq": meta(T, HQ, K)},
                            device="cpu")


# --- the allocating function and the custom op ----------------------------------------------------
def forward_inputs(t=T, n=N, **kw):
    a = call(t=t, n=n)
    return {**{name: a[name] for name in ("q", "k", "v", "g", "beta", "cu_seqlens", "do")}, **kw}


def test_allocating_function(no_compile):
    r = gated_delta_net_backward(**forward_inputs(), use_qk_l2norm_in_kernel=True, scale=0.5,
                                 stream=0)
    dq, dk, dv, dg, dbeta, ds0 = r
    a = forward_inputs()
    for grad, name in ((dq, "q"), (dk, "k"), (dv, "v"), (dg, "g"), (dbeta, "beta")):
        assert grad.shape == a[name].shape and grad.dtype == a[name].dtype
    assert ds0 is None and r.dq is dq
    assert [m for m, _ in no_compile.calls] == LAUNCHED
    assert same(no_compile.calls[-1][1][5:8], [dq, dk, dv])
    assert no_compile.calls[0][1][9] == 0.5
    (op,) = COMPILED_OPS._ops.values()
    assert op.static_config() == {**BASE_CONFIG, "use_qk_l2norm_in_kernel": True}
    # an initial state (io dtype), dfinal and reused checkpoints: another op
    s0 = meta(N, HO, V, K)
    r = gated_delta_net_backward(**forward_inputs(), initial_state=s0,
                                 dfinal=meta(N, HO, V, K, dtype=F32),
                                 checkpoints=meta(CHUNKS, HO, V, K), checkpoint_every_n_tokens=64,
                                 stream=0)
    assert r.dinitial_state.shape == s0.shape and r.dinitial_state.dtype == BF
    assert len(COMPILED_OPS._ops) == 2 and no_compile.calls[-4][0] == "prepare"


def test_allocating_functions_keep_and_reuse_the_forward_workspace(no_compile):
    """gated_delta_net(keep_workspace=True) writes the chunk factors and T into buffers it
    returns (not the op's own, which its next call reuses; the same compiled op);
    gated_delta_net_backward with them skips prepare."""
    a = forward_inputs()
    do = a.pop("do")
    r = precast.gated_delta_net(**a, use_qk_l2norm_in_kernel=True, keep_workspace=True,
                                stream=0)
    (_, prep), _ = no_compile.calls
    work16, work32 = r.workspace
    assert same(prep[7:9], r.workspace) and work16.shape == (CHUNKS, HO, 64, 64)
    fwd_op = [op for op in COMPILED_OPS._ops.values() if isinstance(op, GdnFwdSm90)]
    assert len(fwd_op) == 1 and fwd_op[0]._workspaces == {}
    assert precast.gated_delta_net(**a, use_qk_l2norm_in_kernel=True, stream=0).workspace is None
    no_compile.calls.clear()
    gated_delta_net_backward(**a, do=do, use_qk_l2norm_in_kernel=True,
                             forward_workspace=r.workspace, stream=0)
    assert [m for m, _ in no_compile.calls] == LAUNCHED[1:]
    assert same(no_compile.calls[2][1][8:10], r.workspace)


def test_allocating_function_copies_what_it_cannot_read(no_compile):
    """An expanded do (what o.sum().backward() gives) is copied; gradients are compact with
    their inputs' shapes even for strided inputs."""
    fused = meta(T, HQ * K + HK * K)
    q = fused[:, :HQ * K].unflatten(1, (HQ, K))
    do = meta(1, 1, 1).expand(T, HO, V)
    dq, *_ = gated_delta_net_backward(**forward_inputs(q=q, do=do), stream=0)
    prep, sgrad = no_compile.calls[0][1], no_compile.calls[2][1]
    assert prep[0] is q and sgrad[2] is not do and sgrad[2].is_contiguous()
    assert dq.shape == q.shape and dq.is_contiguous()
    with pytest.raises(NotImplementedError, match=r"^state_indices: the state pool is forward only"):
        gated_delta_net_backward(**forward_inputs(), state_indices=meta(N, dtype=I32),
                                 stream=0)


def test_custom_op_fake():
    a = forward_inputs()
    grads = torch.ops.precast.gated_delta_net_backward(
        *a.values(), None, None, None, None, None, False)
    assert [tuple(t.shape) for t in grads] == [
        (T, HQ, K), (T, HK, K), (T, HV, V), (T, HO), (T, HO), (0, HO, V, K)]
    s0 = meta(N, HO, V, K)
    grads = torch.ops.precast.gated_delta_net_backward(
        *a.values(), 0.5, s0, meta(N, HO, V, K, dtype=F32), meta(CHUNKS, HO, V, K), 64, True)
    assert grads[-1].shape == s0.shape and grads[-1].dtype == BF


@pytest.mark.parametrize("keep_workspace", ["unset", None, False, True])
def test_autograd_and_torch_compile_trace_through_the_fakes(keep_workspace):
    """On meta tensors the forward and backward custom ops run their fakes: loss.backward()
    through gated_delta_net gives every input a gradient of its shape and dtype, eagerly
    and under torch.compile(fullgraph=True), with the forward's workspace kept (the
    default) or not."""
    a = forward_inputs()
    do, dfinal = a.pop("do"), meta(N, HO, V, K, dtype=F32)
    cu = a.pop("cu_seqlens")
    kw = {} if keep_workspace == "unset" else {"keep_workspace": keep_workspace}

    def loss(q, k, v, g, beta, initial_state):
        o, s = precast.gated_delta_net(q, k, v, g, beta, cu, initial_state=initial_state,
                                       output_final_state=True, use_qk_l2norm_in_kernel=True,
                                       **kw)
        return (o.float() * do.float()).sum() + (s * dfinal).sum()
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        x = [t.clone().requires_grad_() for t in (*a.values(), meta(N, HO, V, K))]
        fn(*x).backward()
        assert all(t.grad.shape == t.shape and t.grad.dtype == t.dtype for t in x)


@pytest.mark.parametrize("keep_workspace,kept", [("unset", True), (None, True),
                                                 (True, True), (False, False)])
def test_autograd_keeps_the_forward_workspace_by_default(monkeypatch, keep_workspace, kept):
    """Under autograd keep_workspace=None (the default) asks the forward op for its workspace
    (keep_workspace=True in its arguments; the schema's own default stays False), saves
    the pair for the backward and hands it to the backward op, which then skips prepare;
    keep_workspace=False keeps nothing and the backward recomputes it."""
    handed = {}

    def recorder(name):
        real = getattr(torch.ops.precast, name)

        def record(*args):
            handed.setdefault(name, []).append(args)
            return real(*args)
        monkeypatch.setattr(torch.ops.precast, name, record)
    recorder("gated_delta_net")
    recorder("gated_delta_net_backward")
    a = forward_inputs()
    do = a.pop("do")
    x = {n: t if n == "cu_seqlens" else t.clone().requires_grad_() for n, t in a.items()}
    kw = {} if keep_workspace == "unset" else {"keep_workspace": keep_workspace}
    r = precast.gated_delta_net(**x, output_final_state=True, **kw)
    o, _ = r
    assert r.workspace is None  # a kept workspace goes to the backward, not the caller
    ((fwd_args,),) = handed["gated_delta_net"],
    assert len(fwd_args) == 15 and fwd_args[-1] is kept  # keep_workspace, resolved
    *_, work16, work32 = o.grad_fn.saved_tensors
    shapes = keeping_forward().workspace_shapes(T, N)
    if kept:
        assert [(tuple(t.shape), t.dtype) for t in (work16, work32)] == list(zip(
            shapes, (BF, F32)))
    else:
        assert work16 is None and work32 is None
    (o.float() * do.float()).sum().backward()
    ((bwd_args,),) = handed["gated_delta_net_backward"],
    assert len(bwd_args) == 15
    if kept:  # the forward's pair, as saved
        assert [tuple(t.shape) for t in bwd_args[-2:]] == list(shapes)
    else:  # no work16, work32: the backward recomputes them
        assert bwd_args[-2:] == (None, None)
    assert all(t.grad is not None for n, t in x.items() if n != "cu_seqlens")


def test_default_keep_workspace_is_resolved_by_the_wrapper_only():
    """The custom op's schema keeps an explicit bool (default False); gated_delta_net's
    keyword defaults to None."""
    import inspect
    schema = torch.ops.precast.gated_delta_net.default._schema
    (arg,) = [arg for arg in schema.arguments if arg.name == "keep_workspace"]
    assert str(arg.type) == "bool" and arg.default_value is False
    assert inspect.signature(precast.gated_delta_net).parameters[
        "keep_workspace"].default is None


# --- the kernels' fake arguments and the cross-compilation ----------------------------------------
@pytest.mark.compile
def test_kernel_builder_arguments():
    """Each mode's kernel and fake arguments as the kernels' signatures take them (no code
    is generated here)."""
    import cutlass
    pytest.importorskip("cutlass")
    op = GdnBwdSm90.from_config(dtype="float16", k_dim=64, v_dim=128, q_heads=2, k_heads=8,
                                v_heads=8, g_dtype="bfloat16", state_dtype="io",
                                use_qk_l2norm_in_kernel=True).check_support()
    built = {mode: build() for mode, build in op._kernel_builders().items()}
    _, made = built["seq_table"]  # (cu_seqlens, table, every, stream)
    assert len(made) == 4 and made[0].element_type == made[1].element_type == cutlass.Int32
    assert isinstance(made[2], cutlass.Int32)
    kernel, prep = built["prepare"]
    assert not kernel.store_wu and len(prep) == 11 and None not in prep
    assert prep[5].element_type == prep[6].element_type == cutlass.Int32  # cu_seqlens, table
    assert tuple(prep[7].shape[1:]) == (8, 64, 64) and prep[7].element_type == cutlass.Float16
    _, states = built["states"]
    assert [i for i, x in enumerate(states) if x is None] == [6, 8, 9]  # no o
    assert states[4].element_type == states[5].element_type == cutlass.Int32
    assert tuple(states[10].shape[1:]) == (8, 128, 64)
    assert states[10].element_type == cutlass.Float16
    assert states[7].element_type == cutlass.Float16  # the io initial state
    assert tuple(states[11].shape[1:]) == (8, 128) and len(states) == 14  # v
    _, sgrad = built["state_grad"]
    assert len(sgrad) == 11 and sgrad[7] is None  # no dfinal
    assert sgrad[5].element_type == sgrad[6].element_type == cutlass.Int32
    assert tuple(sgrad[2].shape[1:]) == (8, 128)  # do
    assert tuple(sgrad[3].shape[1:]) == (8, 64, 64)  # work16: the packed P
    assert tuple(sgrad[8].shape[1:]) == (8, 128, 64)  # dstates
    assert sgrad[9].element_type == cutlass.Float32
    _, cgrad = built["chunk_grad"]
    assert len(cgrad) == 19 and None not in cgrad
    assert cgrad[5].element_type == cgrad[6].element_type == cutlass.Int32
    assert [tuple(t.shape[1:]) for t in cgrad[12:15]] == [(8, 64), (8, 64), (8, 128)]
    # q is grouped (2 heads for 8 output heads): per output head; k and v have a head per
    # output head: written final; all in the io dtype
    assert [t.element_type for t in cgrad[12:15]] == [cutlass.Float16] * 3
    assert cgrad[15].element_type == cutlass.BFloat16
    assert cgrad[16].element_type == cutlass.Float32
    _, fin = built["finish"]
    assert len(fin) == 9 and fin[3] is None and fin[4] is None  # no dk_heads, dv_heads
    assert [tuple(t.shape[1:]) for t in fin[5:8]] == [(2, 64), (8, 64), (8, 128)]


@pytest.mark.compile
def test_every_backward_kernel_cross_compiles(tmp_path):
    """All five modes of one configuration (every optional tensor present) build for
    sm_90a into one cache entry."""
    op = GdnBwdSm90.from_config(state_dtype="float32", final_state_grad=True,
                                use_qk_l2norm_in_kernel=True,
                                beta_dtype="bfloat16").check_support()
    cache = ArtifactCache(tmp_path)
    op.compile(arch="sm_90a", cache=cache)
    assert op.is_compiled and sorted(op._kernels) == sorted(kernel_modes(op.shapes))
    ((_, manifest),) = list(cache.entries())
    assert set(manifest["kernels"]) == set(kernel_modes(op.shapes))
    assert manifest["key"]["op"] == "GdnBwdSm90" and manifest["key"]["config"] == \
        op.static_config()


@pytest.mark.compile
@pytest.mark.parametrize("k_dim,v_dim,heads,l2norm", [
    (128, 128, (2, 2, 8), True), (64, 64, (16, 4, 4), False), (64, 128, (4, 4, 16), True)])
def test_finish_kernel_cross_compiles(tmp_path, k_dim, v_dim, heads, l2norm):
    import cutlass.cute as cute
    op = GdnBwdSm90.from_config(k_dim=k_dim, v_dim=v_dim, q_heads=heads[0], k_heads=heads[1],
                                v_heads=heads[2], use_qk_l2norm_in_kernel=l2norm)
    kernel, args = op.check_support()._kernel_builders()["finish"]()
    cute.compile(kernel, *args, options="--enable-tvm-ffi --gpu-arch sm_90a")


# --- plans ----------------------------------------------------------------------------------------
def planned_configs(path):
    from precast.plan import load_plan
    return [GdnBwdSm90.from_config(**dict(e.config)).check_support().static_config()
            for e in load_plan(path) if e.op == "GdnBwdSm90"]


def test_gpu_tests_use_planned_configurations():
    from pathlib import Path

    from test_gdn_bwd_gpu import CONFIGS as GPU_CONFIGS
    planned = planned_configs(Path(__file__).parent / "gpu_plan.toml")
    assert len(planned) == len({tuple(sorted(c.items())) for c in planned})
    for name, config in GPU_CONFIGS.items():
        assert config in planned, name
    assert len(planned) == len(GPU_CONFIGS)


def test_default_plan_has_the_backward_of_every_planned_forward_shape():
    from precast.cli import DEFAULT_PLAN
    from precast.plan import load_plan
    planned = planned_configs(DEFAULT_PLAN)
    # forward configurations with every field filled in (checkpoint_dtype defaults)
    forward = [GdnFwdSm90.from_config(**dict(e.config)).check_support().static_config()
               for e in load_plan(DEFAULT_PLAN) if e.op == "GdnFwdSm90"]
    for cfg in forward:
        fields = {k: cfg[k] for k in FORWARD_FIELDS}
        for final_grad in (True, False):
            assert {**fields, "final_state_grad": final_grad} in planned, cfg


@pytest.mark.compile
@pytest.mark.parametrize("state_dtype,final_grad", [("none", False), ("none", True),
                                                     ("float32", False), ("io", True)])
def test_zero_state_tiles_follow_the_configuration(state_dtype, final_grad):
    """Without an initial state the state entering a sequence's first chunk is zero, and
    without dfinal so is dS' of its last: the chunk kernel then neither loads that tile
    nor issues the products that read it, the states pass writes no state for a one-chunk
    sequence, and state_grad makes no first-chunk step unless the initial state's gradient
    needs it."""
    op = GdnBwdSm90.from_config(state_dtype=state_dtype,
                                final_state_grad=final_grad).check_support()
    builders = op._kernel_builders()
    chunk, _ = builders["chunk_grad"]()
    states, _ = builders["states"]()
    state_grad, _ = builders["state_grad"]()
    assert chunk.zero_first_state == (state_dtype == "none") == states.zero_first
    assert chunk.zero_last_dstate == (not final_grad) == (not state_grad.final_grad)
    assert state_grad.init_grad == (state_dtype != "none")
    assert not states.final_state  # the states pass skips each sequence's last update
