"""GdnFwdSm90 (precast/lifecycle/gdn_fwd.py) and gated_delta_net (precast/linear_attention.py)
on a CPU machine: static configuration and cache key, from_config, the kernel limits
(NotImplementedError), execute() against the op's configuration, its launches (kernels
stood in for and recorded), the per-sequence table (N > 32), the workspace (shapes, given,
the op's own per device and stream, refused while capturing), the N == 0 and T == 0 paths,
the allocating function and the custom op's fake; one cross-compilation test (marked
compile) builds every kernel.
Every host rule of a call itself is gdn_rules' (tests/test_validation_gdn.py)."""
import math
import sys
import types

import pytest
import torch
from conftest import isolate_from_kernels, key_of, record_launches

import precast
from precast import GdnFwdSm90, TensorDesc, gated_delta_net
from precast.lifecycle import gdn_fwd as gdn_module
from precast.lifecycle.cache import ArtifactCache
from precast.lifecycle.gdn_fwd import kernel_modes, readable_in_place
from precast.lifecycle.op import OP_REGISTRY
from precast.plan import OP_MODULES, expand

BF, FP, F32, F64, I32, I64 = (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                              torch.int32, torch.int64)
# Grouped v heads and K != V, so that every shape mix-up is visible.
T, N, HQ, HK, HV, K, V = 128, 4, 4, 4, 8, 64, 128
HO = max(HQ, HV)
CHUNKS = T // 64 + N  # workspace chunk rows
F = 64  # workspace columns: the packed block P (T and M)
COMPILED_OPS = sys.modules["precast.op_cache"]


@pytest.fixture(autouse=True)
def _isolated(request, monkeypatch, tmp_path):
    """Nothing here builds or loads kernels (but the compile test); no cached ops."""
    if request.node.get_closest_marker("compile") is None:
        isolate_from_kernels(monkeypatch, tmp_path)


def desc(shape, dtype=BF, stride=None, alignment=16):
    return TensorDesc(dtype, shape, stride, "cuda", alignment)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


def samples(t=T, n=N, hq=HQ, hk=HK, hv=HV, k=K, v=V, dtype=BF, g_dtype=F32, beta_dtype=F32,
            cu_dtype=I32):
    ho = max(hq, hv)
    return dict(sample_q=desc((t, hq, k), dtype), sample_k=desc((t, hk, k), dtype),
                sample_v=desc((t, hv, v), dtype), sample_g=desc((t, ho), g_dtype),
                sample_beta=desc((t, ho), beta_dtype), sample_cu_seqlens=desc((n + 1,), cu_dtype))


def gdn(**kw) -> GdnFwdSm90:
    """The base op with some constructor arguments replaced."""
    base = samples()
    return GdnFwdSm90(**{**base, **kw})


def state(rows=N, dtype=F32):
    return desc((rows, HO, V, K), dtype)


def call(t=T, n=N, dtype=BF, **kw):
    """execute() arguments (meta tensors) of the base configuration."""
    a = dict(q=meta(t, HQ, K, dtype=dtype), k=meta(t, HK, K, dtype=dtype),
             v=meta(t, HV, V, dtype=dtype), g=meta(t, HO, dtype=F32),
             beta=meta(t, HO, dtype=F32), cu_seqlens=meta(n + 1, dtype=I32),
             o=meta(t, HO, V, dtype=dtype))
    return {**a, **kw}


# --- registration -------------------------------------------------------------------------------
def test_exported_and_registered():
    assert precast.GdnFwdSm90 is GdnFwdSm90 and precast.gated_delta_net is gated_delta_net
    assert {"GdnFwdSm90", "gated_delta_net"} <= set(precast.__all__)
    assert OP_REGISTRY["GdnFwdSm90"] is GdnFwdSm90
    assert "precast.lifecycle.gdn_fwd" in OP_MODULES
    assert hasattr(torch.ops.precast, "gated_delta_net")
    assert GdnFwdSm90.supported_archs == ("sm_90a",)
    # every module the kernels' code comes from, the shared workspace layout included
    assert set(GdnFwdSm90.kernel_sources) == {
        "precast.kernels.gdn_chunk_sm90", "precast.kernels.gdn_recurrence_sm90",
        "precast.kernels.gdn_seq_table_sm90", "precast.kernels.gdn_layout",
        "precast.kernels.gdn_unpack_sm90", "precast.kernels.attention_sm90",
        "precast.kernels.tiling", "precast.kernels.fake"}


# --- static configuration and cache key ---------------------------------------------------------
STATIC_KEYS = {"dtype", "k_dim", "v_dim", "q_heads", "k_heads", "v_heads", "g_dtype",
               "beta_dtype", "state_dtype", "state_pool", "output_final_state",
               "use_qk_l2norm_in_kernel", "checkpoint_dtype"}
BASE_CONFIG = {"dtype": "bfloat16", "k_dim": K, "v_dim": V, "q_heads": HQ, "k_heads": HK,
               "v_heads": HV, "g_dtype": "float32", "beta_dtype": "float32",
               "state_dtype": "none", "state_pool": False, "output_final_state": False,
               "use_qk_l2norm_in_kernel": False, "checkpoint_dtype": "none"}


def test_static_config_reads_the_samples():
    assert gdn().static_config() == BASE_CONFIG
    op = gdn(sample_initial_state=state(dtype=BF), output_final_state=True,
             use_qk_l2norm_in_kernel=True, checkpoint_every_n_tokens=128,
             checkpoint_dtype=F32, **samples(g_dtype=BF, beta_dtype=FP))
    assert op.static_config() == {**BASE_CONFIG, "state_dtype": "io", "output_final_state": True,
                                  "use_qk_l2norm_in_kernel": True, "checkpoint_dtype": "float32",
                                  "g_dtype": "bfloat16", "beta_dtype": "float16"}
    pool = gdn(sample_initial_state=state(rows=9), sample_state_indices=desc((N,), I32))
    assert pool.static_config()["state_dtype"] == "float32" and pool.static_config()["state_pool"]
    # checkpoints default to the io dtype
    assert gdn(checkpoint_every_n_tokens=64).static_config()["checkpoint_dtype"] == "io"


STATIC_CHANGES = {
    "dtype": samples(dtype=FP),
    "k_dim": samples(k=128),
    "v_dim": samples(v=64),
    "q_heads": samples(hq=8, hk=8),  # HK follows HQ
    "k_heads": samples(hk=HV),
    "v_heads": samples(hv=HQ),
    "g_dtype": samples(g_dtype=BF),
    "beta_dtype": samples(beta_dtype=BF),
    "state_dtype": dict(sample_initial_state=state()),
    "output_final_state": dict(output_final_state=True),
    "use_qk_l2norm_in_kernel": dict(use_qk_l2norm_in_kernel=True),
    "checkpoint_dtype": dict(checkpoint_every_n_tokens=64),
}


@pytest.mark.parametrize("field", sorted(STATIC_CHANGES))
def test_cache_key_changes_with_each_static_field(fixed_sources, field):
    base, changed = gdn(), gdn(**STATIC_CHANGES[field])
    assert key_of(changed) != key_of(base)
    diff = {k for k, v in changed.static_config().items() if base.static_config()[k] != v}
    expected = {"q_heads", "k_heads"} if field == "q_heads" else {field}
    assert diff == expected


def test_cache_key_pool_and_state_dtypes(fixed_sources):
    plain = gdn(sample_initial_state=state())
    pool = gdn(sample_initial_state=state(rows=2 * N), sample_state_indices=desc((N,), I32))
    io = gdn(sample_initial_state=state(dtype=BF))
    assert len({key_of(plain), key_of(pool), key_of(io), key_of(gdn())}) == 4
    ckpt_io = gdn(checkpoint_every_n_tokens=64)
    ckpt_f32 = gdn(checkpoint_every_n_tokens=64, checkpoint_dtype=F32)
    assert key_of(ckpt_io) != key_of(ckpt_f32)
    assert key_of(ckpt_io) == key_of(gdn(checkpoint_every_n_tokens=64, checkpoint_dtype=BF))


@pytest.mark.parametrize("kw", [
    dict(scale=0.125), dict(scale=3.0), dict(batch_invariant=True),
    dict(**samples(t=4096, n=1)), dict(**samples(t=0, n=0)), dict(**samples(t=7, n=300)),
    dict(sample_q=desc((T, HQ, K), stride=(3 * HQ * K, K + 8, 1)),
         sample_g=desc((T, HO), F32, stride=(5 * HO, 1), alignment=4)),
])
def test_cache_key_ignores_runtime_values(fixed_sources, kw):
    assert key_of(gdn(**kw)) == key_of(gdn())


def test_cache_key_ignores_checkpoint_spacing_and_pool_rows(fixed_sources):
    assert key_of(gdn(checkpoint_every_n_tokens=64)) == key_of(
        gdn(checkpoint_every_n_tokens=4096))
    pools = {key_of(gdn(sample_initial_state=state(rows=rows),
                        sample_state_indices=desc((N,), I32))) for rows in (N, 3 * N, 1000)}
    assert len(pools) == 1


CONFIGS = [
    {}, dict(dtype="float16", k_dim=64, v_dim=64),
    dict(q_heads=4, k_heads=4, v_heads=16), dict(q_heads=16, k_heads=4, v_heads=4),
    dict(q_heads=2, k_heads=8, v_heads=8),
    dict(g_dtype="bfloat16", beta_dtype="float16"),
    dict(state_dtype="float32", output_final_state=True, use_qk_l2norm_in_kernel=True),
    dict(state_dtype="io", state_pool=True),
    dict(state_dtype="float32", state_pool=True, output_final_state=True),
    dict(checkpoint_dtype="io"), dict(checkpoint_dtype="float32", state_dtype="io"),
    dict(dtype="float16", k_dim=128, v_dim=64, q_heads=64),
    dict(output_final_state=True, checkpoint_dtype="float32"),
]


@pytest.mark.parametrize("config", CONFIGS)
def test_from_config_round_trip(config):
    op = GdnFwdSm90.from_config(**config).check_support()
    cfg = op.static_config()
    assert set(cfg) == STATIC_KEYS
    for key, value in config.items():
        assert cfg[key] == value
    if "k_heads" not in config:
        assert cfg["k_heads"] == cfg["v_heads"] == cfg["q_heads"]
    assert GdnFwdSm90.from_config(**cfg).static_config() == cfg
    (entry,) = expand({"name": "GdnFwdSm90", **cfg})
    assert dict(entry.config) == cfg
    split = ("recurrence_split",) if cfg["v_dim"] == 128 else ()
    assert tuple(op._kernel_builders()) == kernel_modes(cfg["v_dim"]) == (
        "seq_table", "prepare", "recurrence") + split


@pytest.mark.parametrize("config,exc,match", [
    (dict(state_dtype="bfloat16"), ValueError,
     "state_dtype must be one of 'none', 'float32', 'io'.*got 'bfloat16'"),
    (dict(checkpoint_dtype=None), ValueError, "checkpoint_dtype must be one of"),
    (dict(state_pool=True), ValueError, "state_pool=True needs state_dtype 'float32' or 'io'"),
    (dict(state_pool=1, state_dtype="io"), TypeError, "state_pool must be a bool, got int"),
    (dict(output_final_state="yes"), TypeError, "output_final_state must be a bool, got str"),
    (dict(k_dim=128.0), TypeError, "k_dim must be an int, got float"),
    (dict(q_heads=0), ValueError, "q_heads must be >= 1, got 0"),
    (dict(dtype="float8"), TypeError, "unknown dtype 'float8'"),
    (dict(g_dtype="int4"), TypeError, "unknown dtype 'int4'"),
])
def test_from_config_types(config, exc, match):
    with pytest.raises(exc, match=match):
        GdnFwdSm90.from_config(**config)


@pytest.mark.parametrize("config,exc,match", [
    (dict(k_dim=96), NotImplementedError, "head dim K = 96 is not supported"),
    (dict(dtype="float32"), TypeError, "q: dtype float32 is not supported"),
    (dict(q_heads=4, k_heads=2, v_heads=8), ValueError, "k: HK = 2 heads"),
    (dict(q_heads=3, v_heads=4), ValueError, "HQ and HV must be equal or one a multiple"),
    (dict(g_dtype="float64"), TypeError, "g: dtype float64 is not supported"),
])
def test_from_config_invalid_combinations(config, exc, match):
    with pytest.raises(exc, match=match):
        GdnFwdSm90.from_config(**config).check_support()


# --- what the kernels cannot do yet --------------------------------------------------------------
def test_split_recurrence_when_the_pairs_fill_at_most_half_the_sms(launches, monkeypatch):
    """N * HO = 32 (sequence, head) pairs: two CTAs each on a device of >= 64 SMs; V = 64
    has no split kernel. Either reads v with T (in work16 where W would be)."""
    op = gdn().check_support()
    for sms, mode in ((63, "recurrence"), (64, "recurrence_split"), (132, "recurrence_split")):
        monkeypatch.setattr(gdn_module, "sm_count", lambda index: sms)
        op.execute(**call(), stream=1)
        assert [m for m, _ in launches.calls[-2:]] == ["prepare", mode]
        (_, prep), (_, rec) = launches.calls[-2:]
        rec = after_qk(prep, rec)
        assert rec[:2] == (prep[7], prep[8])  # the same workspace either way
        assert rec[9] is prep[2]
    op64 = gdn(**samples(v=64)).check_support()
    op64.execute(**call(v=meta(T, HV, 64), o=meta(T, HO, 64)), stream=1)
    assert launches.calls[-1][0] == "recurrence"


def test_int64_cu_seqlens_run_from_an_int32_copy_on_the_stream(launches):
    """int64 offsets: converted on the launch stream into an int32 buffer the op keeps per
    (device, stream), made once and reused; both kernels read it; the values are never
    read on the host."""
    op = gdn(**samples(cu_dtype=I64)).check_support()
    cu64 = meta(N + 1, dtype=I64)
    op.execute(**call(cu_seqlens=cu64), stream=4)
    (_, prep), (_, rec) = launches.calls
    offsets = prep[5]
    assert offsets.dtype == I32 and tuple(offsets.shape) == (N + 1,)
    assert prep[6] is offsets and same(after_qk(prep, rec)[2:4], [offsets, offsets])
    (buffer,) = op._offset_buffers[(None, 4)]
    assert offsets._base is buffer
    assert ("empty", (N + 1,), I32) in launches.events
    copies = [e for e in launches.events if e[0] == "copy"]
    assert copies and copies[-1][1] is offsets and copies[-1][2] is cu64
    assert kinds(launches).index("copy") < kinds(launches).index("launch")
    # the next call on the stream reuses the buffer; fewer sequences use its first rows
    launches.events.clear()
    op.execute(**call(t=T // 2, n=N - 1, cu_seqlens=meta(N, dtype=I64)), stream=4)
    assert "empty" not in kinds(launches) and op._offset_buffers[(None, 4)][0] is buffer
    assert tuple(launches.calls[-1][1][4].shape) == (N,)
    # int32 offsets are passed as they are
    op32 = gdn().check_support()
    a = call()
    op32.execute(**a, stream=4)
    assert launches.calls[-1][1][4] is a["cu_seqlens"] and op32._offset_buffers == {}


def test_int64_cu_seqlens_buffer_not_made_while_capturing(launches):
    op = gdn(**samples(cu_dtype=I64)).check_support()
    launches.capturing = True
    with pytest.raises(RuntimeError, match="no int32 buffer of 5 offsets for int64 cu_seqlens"):
        op.execute(**call(cu_seqlens=meta(N + 1, dtype=I64)),
                   workspace=tuple(meta(*shape, dtype=dt) for shape, dt in
                                   zip(op.workspace_shapes(T, N), (BF, F32))), stream=2)
    assert launches.calls == []


def test_at_most_65535_sequences():
    gdn(**samples(t=0, n=65535)).check_support()
    with pytest.raises(NotImplementedError, match="N = 65536 sequences; the recurrence kernel "
                       "takes at most 65535"):
        gdn(**samples(t=0, n=65536)).check_support()


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_head_offsets_fit_32_bits(name):
    heads = {"q": HQ, "k": HK, "v": HV}[name]
    dim = V if name == "v" else K
    stride = 2**30  # 2^31 - 1 < (heads - 1) * 2^30 + dim
    wide = desc((T, heads, dim), stride=(dim, stride, 1))
    with pytest.raises(NotImplementedError, match=rf"{name}: the head stride {stride} puts the "
                       r"last head \d+ elements from the first; the kernels take at most "
                       r"2\^31 - 1 \(32-bit head offsets\)"):
        gdn(**{f"sample_{name}": wide}).check_support()
    # just inside the limit
    fits = (2**31 - 1 - dim) // (heads - 1) // 8 * 8
    gdn(**{f"sample_{name}": desc((T, heads, dim), stride=(dim, fits, 1))}).check_support()


@pytest.mark.parametrize("kw,exc,match", [
    # the dtype rules the kernels rely on are gdn_rules' (TypeError)
    (dict(sample_initial_state=state(dtype=FP)), TypeError,
     "initial_state: dtype float16 is not supported; expected float32 or bfloat16"),
    (dict(sample_initial_state=state(dtype=F64)), TypeError, "initial_state: dtype float64"),
    (dict(sample_initial_state=state(rows=8, dtype=FP), sample_state_indices=desc((N,), I32)),
     TypeError, "initial_state: dtype float16"),
    (dict(checkpoint_every_n_tokens=64, checkpoint_dtype=FP), TypeError,
     "checkpoint_dtype: float16 is not supported"),
    (dict(checkpoint_every_n_tokens=96), ValueError, "multiple of the chunk size 64"),
    (dict(checkpoint_dtype=F32), ValueError, "checkpoint_dtype is given but "
     "checkpoint_every_n_tokens is None"),
    (dict(scale=-1.0), ValueError, "scale must be positive"),
    (dict(batch_invariant=1), TypeError, "batch_invariant must be a bool"),
])
def test_sample_rules_are_gdn_rules(kw, exc, match):
    with pytest.raises(exc, match=match):
        gdn(**kw).check_support()


def test_final_state_must_be_float32():
    op = gdn(output_final_state=True).check_support()
    with pytest.raises(TypeError, match="final_state: dtype bfloat16 is not supported; "
                       "expected float32"):
        op.execute(**call(), final_state=meta(N, HO, V, K), stream=1)


# --- execute: the call against the op's configuration ---------------------------------------------
@pytest.mark.parametrize("changes,exc,match", [
    (dict(q=meta(T, 2 * HQ, K), k=meta(T, 2 * HK, K)), ValueError,
     r"q_heads = 8 \(q heads HQ\) but this op is compiled for q_heads = 4; make another "
     r"GdnFwdSm90"),
    (dict(v=meta(T, 2 * HV, V), o=meta(T, 2 * HO, V), g=meta(T, 2 * HO, dtype=F32),
          beta=meta(T, 2 * HO, dtype=F32)), ValueError, "v_heads = 16"),
    (dict(g=meta(T, HO)), TypeError, r"g_dtype = 'bfloat16' \(g dtype\) but this op is "
     "compiled for g_dtype = 'float32'"),
    (dict(beta=meta(T, HO, dtype=FP)), TypeError, "beta_dtype = 'float16'"),
    (dict(initial_state=meta(N, HO, V, K, dtype=F32)), ValueError,
     r"state_dtype = 'float32' \(initial_state dtype \('none': no initial_state\)\) but this op "
     "is compiled for state_dtype = 'none'"),
    (dict(q=meta(T, HQ, K, dtype=FP), k=meta(T, HK, K, dtype=FP), v=meta(T, HV, V, dtype=FP),
          o=meta(T, HO, V, dtype=FP)), TypeError, "dtype = 'float16'"),
    (dict(o=None), ValueError, "o is required"),
    (dict(o=meta(T, HO, K)), ValueError, r"o: shape \[128, 8, 64\] does not match"),
    (dict(final_state=meta(N, HO, V, K, dtype=F32)), ValueError,
     "final_state is given but output_final_state is False"),
    (dict(checkpoint_every_n_tokens=64), ValueError, "checkpoint_dtype = 'io'"),
])
def test_execute_refuses_a_call_of_another_configuration(launches, changes, exc, match):
    op = gdn().check_support()
    with pytest.raises(exc, match=match):
        op.execute(**call(**changes), stream=1)
    assert launches.events == []


def test_execute_requires_the_outputs_the_op_writes(launches):
    op = gdn(output_final_state=True).check_support()
    with pytest.raises(ValueError, match=r"final_state is required: this op writes the final "
                       r"state \(output_final_state=True\)"):
        op.execute(**call(), stream=1)
    op = gdn(checkpoint_every_n_tokens=64).check_support()
    with pytest.raises(ValueError, match="checkpoints is required"):
        op.execute(**call(), stream=1)
    op = gdn(sample_initial_state=state()).check_support()
    with pytest.raises(ValueError, match=r"state_dtype = 'none'.*compiled for state_dtype = "
                       "'float32'"):
        op.execute(**call(), stream=1)
    pool = gdn(sample_initial_state=state(rows=8), sample_state_indices=desc((N,), I32))
    with pytest.raises(ValueError, match=r"state_pool = False \(state_indices given"):
        pool.check_support().execute(**call(), initial_state=meta(N, HO, V, K, dtype=F32),
                                     stream=1)
    assert launches.events == []


def test_execute_checks_first_when_unchecked(launches):
    op = gdn(scale=math.nan)
    with pytest.raises(ValueError, match="scale must be finite"):
        op.execute(**call(), stream=1)
    assert launches.events == []


# --- execute: launches (kernels stood in for) -----------------------------------------------------
@pytest.fixture
def launches(monkeypatch):
    """conftest.record_launches for GdnFwdSm90 (its workspace is made by torch.empty), on
    a device of 16 SMs: N * HO = 32 (sequence, head) pairs take the one-CTA recurrence."""
    monkeypatch.setattr(gdn_module, "sm_count", lambda index: 16)
    return record_launches(monkeypatch, gdn_module, lambda op: kernel_modes(op.shapes.V),
                           "empty")

def kinds(rec):
    return [e[0] for e in rec.events]


def same(a, b) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def after_qk(prep, rec):
    """The recurrence's arguments after its leading q, k (the prepare launch's own)."""
    assert rec[0] is prep[0] and rec[1] is prep[1]
    return rec[2:]


def test_execute_launches_prepare_then_recurrence(launches):
    op = gdn(use_qk_l2norm_in_kernel=True).check_support()
    a = call()
    op.execute(**a, stream=7)
    assert [mode for mode, _ in launches.calls] == ["prepare", "recurrence"]
    (_, prep), (_, rec) = launches.calls
    rec = after_qk(prep, rec)
    work16, work32 = op._workspaces[(None, 7)]  # (device index, stream): meta has no index
    assert tuple(work16.shape) == (CHUNKS, HO, 64, F) and work16.dtype == BF
    assert tuple(work32.shape) == (CHUNKS, HO, 272) and work32.dtype == F32
    # prepare(q, k, v, g, beta, cu_seqlens, table, work16, work32, scale, stream); N <= 32
    # sequences: no table (cu_seqlens stands in)
    assert len(prep) == 11
    assert same(prep[:7], [a[n] for n in ("q", "k", "v", "g", "beta", "cu_seqlens",
                                          "cu_seqlens")])
    assert prep[7]._base is work16 and prep[8]._base is work32
    assert prep[9:] == (1 / math.sqrt(K), 7)
    # recurrence(q, k, work16, work32, cu_seqlens, table, o, state0, state_indices, final,
    # ckpt, v, n, stream), after q and k (v with T, which prepare left in work16 where W
    # would be)
    assert len(rec) == 12
    assert same(rec[:5], [prep[7], prep[8], a["cu_seqlens"], a["cu_seqlens"], a["o"]])
    assert rec[5:9] == (None,) * 4 and rec[9] is a["v"]
    assert rec[10:] == (0, 7)
    # the workspace made once, uninitialized (prepare writes what the recurrence reads), on
    # the launch stream, after asking whether it captures
    assert launches.events == [("stream", 7, None), ("empty", (CHUNKS, HO, 64, F), BF),
                               ("empty", (CHUNKS, HO, 272), F32), ("end stream",),
                               ("launch", "prepare"), ("launch", "recurrence")]
    assert launches.capture_queries == [7] and launches.ready == [None]
    assert op._table_buffers == {}


def test_execute_passes_every_state_tensor(launches):
    n = 128
    rows = T // n + N
    op = gdn(sample_initial_state=state(dtype=BF), output_final_state=True,
             checkpoint_every_n_tokens=n, checkpoint_dtype=F32).check_support()
    s0, fin, ckpt = (meta(N, HO, V, K), meta(N, HO, V, K, dtype=F32),
                     meta(rows, HO, V, K, dtype=F32))
    op.execute(**call(), initial_state=s0, final_state=fin, checkpoints=ckpt, stream=3)
    (_, prep), (_, rec) = launches.calls
    rec = after_qk(prep, rec)
    assert same(rec[5:9], [s0, None, fin, ckpt]) and rec[9] is prep[2]  # v
    assert rec[10:] == (n, 3)
    # n is a runtime value: another spacing, same op
    ckpt64 = meta(T // 64 + N, HO, V, K, dtype=F32)
    op.execute(**call(), initial_state=s0, final_state=fin, checkpoints=ckpt64, stream=3,
               checkpoint_every_n_tokens=64)
    assert launches.calls[-1][1][10] is ckpt64 and launches.calls[-1][1][12] == 64
    with pytest.raises(ValueError, match="checkpoints: shape"):  # rows follow this call's n
        op.execute(**call(), initial_state=s0, final_state=fin, checkpoints=ckpt, stream=3,
                   checkpoint_every_n_tokens=64)


def test_execute_state_pool_in_place(launches):
    op = gdn(sample_initial_state=state(rows=10), sample_state_indices=desc((N,), I32))
    pool, idx = meta(10, HO, V, K, dtype=F32), meta(N, dtype=I32)
    op.check_support().execute(**call(), initial_state=pool, state_indices=idx, stream=2)
    (_, prep), (_, rec) = launches.calls
    rec = after_qk(prep, rec)
    assert same(rec[5:9], [pool, idx, None, None])


def test_execute_scale_is_a_runtime_value(launches):
    op = gdn(scale=0.5).check_support()
    op.execute(**call(), stream=1)
    op.execute(**call(), stream=1, scale=0.25)
    op.execute(**call(), stream=1)
    assert [c[9] for m, c in launches.calls if m == "prepare"] == [0.5, 0.25, 0.5]
    gdn().check_support().execute(**call(), stream=1)
    assert launches.calls[-2][1][9] == 1 / math.sqrt(K)  # default: 1 / sqrt(K)


def test_execute_runtime_batches_and_strided_views(launches):
    op = gdn().check_support()
    fused = meta(3 * T, HQ * K + HK * K + HV * V + 2 * HO * 2)  # one projection, padded rows
    t = 3 * T
    q = fused[:, :HQ * K].unflatten(1, (HQ, K))
    k = fused[:, HQ * K:(HQ + HK) * K].unflatten(1, (HK, K))
    v = fused[:, (HQ + HK) * K:(HQ + HK) * K + HV * V].unflatten(1, (HV, V))
    gates = meta(t, 2 * HO, dtype=F32)
    a = call(t=t, n=17, q=q, k=k, v=v, g=gates[:, :HO], beta=gates[:, HO:])
    op.execute(**a, stream=5)
    (_, prep), (_, rec) = launches.calls
    rec = after_qk(prep, rec)
    assert same(prep[:5], [q, k, v, a["g"], a["beta"]])
    assert prep[6] is a["cu_seqlens"] and rec[3] is a["cu_seqlens"]  # 17 sequences: no table
    assert tuple(prep[7].shape) == (t // 64 + 17, HO, 64, F)


def test_workspace_shapes_delegate_to_the_kernel_module():
    from precast.kernels.gdn_layout import workspace_shapes
    op = gdn()
    assert op.workspace_shapes(T, N) == ((CHUNKS, HO, 64, F), (CHUNKS, HO, 272))
    for t, n in [(0, 0), (0, 3), (63, 1), (64, 1), (65, 2), (10**6, 1000)]:
        assert op.workspace_shapes(t, n) == workspace_shapes(t, n, HO, K, V)
        assert op.workspace_shapes(t, n)[0][0] == t // 64 + n
    with pytest.raises(ValueError, match="total_tokens must be >= 0"):
        op.workspace_shapes(-1, 1)
    with pytest.raises(TypeError, match="num_seqs must be an int"):
        op.workspace_shapes(1, 1.0)


def test_execute_with_a_workspace_allocates_nothing(launches):
    op = gdn().check_support()
    s16, s32 = op.workspace_shapes(T, N)
    ws = (meta(*s16), meta(*s32, dtype=F32))
    op.execute(**call(), stream=3, workspace=ws)
    (_, prep), (_, rec) = launches.calls
    rec = after_qk(prep, rec)
    assert prep[7] is ws[0] and prep[8] is ws[1] and rec[0] is ws[0] and rec[1] is ws[1]
    assert kinds(launches) == ["launch", "launch"]
    assert op._workspaces == {} and launches.capture_queries == []
    # also while the stream captures, and as a list
    launches.capturing = True
    op.execute(**call(), stream=3, workspace=list(ws))
    assert launches.calls[-1][1][2] is ws[0] and op._workspaces == {}
    assert launches.capture_queries == []


def test_make_workspace_defaults_to_the_cuda_device(monkeypatch):
    """Without a device the workspace goes where execute() needs it (the CUDA device), not
    to torch's default (the CPU), which execute would refuse."""
    made = []
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: made.append(kw["device"]))
    gdn().make_workspace(T, N)
    assert made == ["cuda", "cuda"]


def test_the_workspace_is_the_pair_a_backward_reuses(launches):
    """The workspace (work16 = T and M packed, work32 = the factor rows) is all a backward needs of
    stage 1 (GdnBwdSm90.execute(forward_workspace=...)): a pair, no third tensor."""
    op = gdn().check_support()
    shapes = op.workspace_shapes(T, N)
    assert shapes == ((CHUNKS, HO, 64, F), (CHUNKS, HO, 272))
    assert op.workspace_dtypes() == (BF, F32)
    ws = op.make_workspace(T, N, device="meta")
    assert [(tuple(t.shape), t.dtype) for t in ws] == list(zip(shapes, (BF, F32)))
    with pytest.raises(TypeError, match=r"workspace: expected the pair \(work16, work32\) "
                       r".* got tuple of 3"):
        op.execute(**call(), stream=3, workspace=ws + (meta(CHUNKS, HO, 64, 64),))
    with pytest.raises(TypeError, match="unexpected keyword argument 'store_inverse'"):
        gdn(store_inverse=True)


WORKSPACE_RULES = [
    ("not-a-pair", lambda s16, s32: meta(*s16), TypeError,
     r"workspace: expected the pair \(work16, work32\) shaped "
     r"GdnFwdSm90.workspace_shapes\(T, N\), "
     r"got Tensor$"),
    ("three", lambda s16, s32: (meta(*s16), meta(*s32, dtype=F32), None), TypeError,
     "workspace: expected the pair .* got tuple of 3"),
    ("work16-fp32", lambda s16, s32: (meta(*s16, dtype=F32), meta(*s32, dtype=F32)), TypeError,
     r"workspace \(work16\): dtype float32 is not supported; expected bfloat16"),
    ("work32-bf16", lambda s16, s32: (meta(*s16), meta(*s32)), TypeError,
     r"workspace \(work32\): dtype bfloat16 is not supported; expected float32"),
    ("fewer-chunks", lambda s16, s32: (meta(s16[0] - 1, *s16[1:]), meta(*s32, dtype=F32)),
     ValueError, r"workspace \(work16\): extent 5 on axis 0 does not match"),
    ("more-chunks", lambda s16, s32: (meta(*s16), meta(s32[0] + 1, *s32[1:], dtype=F32)),
     ValueError, r"workspace \(work32\): extent 7 on axis 0"),
    ("padded", lambda s16, s32: (meta(*s16[:3], F + 8)[..., :F], meta(*s32, dtype=F32)),
     ValueError, r"workspace \(work16\): must be contiguous"),
    ("cpu", lambda s16, s32: (torch.empty(s16, dtype=BF), meta(*s32, dtype=F32)), ValueError,
     r"workspace \(work16\): tensor is on cpu"),
]


@pytest.mark.parametrize("make,exc,match", [r[1:] for r in WORKSPACE_RULES],
                         ids=[r[0] for r in WORKSPACE_RULES])
def test_execute_refuses_bad_workspaces(launches, make, exc, match):
    op = gdn().check_support()
    with pytest.raises(exc, match=match):
        op.execute(**call(), stream=1, workspace=make(*op.workspace_shapes(T, N)))
    assert launches.events == [] and op._workspaces == {}


def test_own_workspace_per_stream_grown_and_reused(launches):
    op = gdn().check_support()
    op.execute(**call(), stream=7)
    small = op._workspaces[(None, 7)]
    op.execute(**call(t=T // 2, n=1), stream=7)  # fewer chunks: views of the same pair
    assert op._workspaces[(None, 7)] is small
    assert launches.calls[-1][1][2]._base is small[0]
    assert tuple(launches.calls[-1][1][2].shape)[0] == T // 2 // 64 + 1
    assert launches.capture_queries == [7]
    op.execute(**call(t=4 * T, n=N), stream=7)  # more: grown (at least doubled)
    big = op._workspaces[(None, 7)]
    assert big is not small and big[0].shape[0] == 2 * CHUNKS == big[1].shape[0]
    assert op._outgrown == [small]  # kept alive for graphs captured with it
    assert launches.calls[-1][1][2]._base is big[0]
    op.execute(**call(), stream=8)  # another stream: its own
    assert set(op._workspaces) == {(None, 7), (None, 8)}
    assert op._workspaces[(None, 8)][0] is not big[0]
    events = launches.events
    made_on = [events[i - 1][1] for i, e in enumerate(events)
               if e[0] == "empty" and events[i - 1][0] == "stream"]
    assert made_on == [7, 7, 8]


def test_own_workspace_is_made_on_the_ops_device(launches):
    op = gdn().check_support()
    view16, view32 = op._own_workspace(1, 99, T, N)
    assert launches.alloc_devices == ["cuda:1", "cuda:1"]
    assert launches.events[0] == ("stream", 99, 1)
    assert view16._base is op._workspaces[(1, 99)][0]


def test_own_workspace_refused_while_capturing(launches):
    op = gdn().check_support()
    launches.capturing = True
    with pytest.raises(RuntimeError, match=r"^GdnFwdSm90\.execute: the stream is capturing a "
                       r"CUDA graph and this op has no workspace of 6 chunk rows for it; pass "
                       r"workspace= \(make_workspace\(128, 4\)\)"):
        op.execute(**call(), stream=7)
    assert launches.calls == [] and op._workspaces == {} and "empty" not in kinds(launches)
    launches.capturing = False
    op.execute(**call(), stream=7)
    ws = op._workspaces[(None, 7)]
    launches.capturing = True
    op.execute(**call(), stream=7)  # made before the capture: reused
    assert launches.calls[-1][1][2]._base is ws[0]
    with pytest.raises(RuntimeError, match="no workspace of 8 chunk rows"):  # not grown
        op.execute(**call(t=2 * T), stream=7)
    assert op._workspaces[(None, 7)] is ws and kinds(launches).count("empty") == 2


# --- the per-sequence table (gdn_fwd.sequence_table) ----------------------------------------------
MANY = gdn_module.TABLE_MIN_SEQS + 8  # 40 sequences: more than the scans' one warp step
TABLE = 2 * (MANY + 1)  # its int32 entries


def given_workspace(op, t=T, n=N):
    """A workspace made by the real torch (``launches`` records the module's allocations)."""
    return tuple(meta(*shape, dtype=dtype) for shape, dtype in
                 zip(op.workspace_shapes(t, n), op.workspace_dtypes()))


@pytest.mark.parametrize("n", [None, 128])
def test_more_than_32_sequences_get_the_sequence_table(launches, n):
    """N = 40: seq_table(cu_seqlens, table, every, stream) runs first, into an int32 buffer
    of 2 (N + 1) the op makes on the stream and keeps per (device, stream); both kernels
    take the table right after cu_seqlens. every: the checkpoint spacing, 0 without."""
    op = gdn(checkpoint_every_n_tokens=n).check_support()
    a = call(n=MANY, **({} if n is None else dict(checkpoints=meta(T // n + MANY, HO, V, K))))
    op.execute(**a, stream=7)
    assert [m for m, _ in launches.calls] == ["seq_table", "prepare", "recurrence"]
    (_, made), (_, prep), (_, rec) = launches.calls
    (buffer,) = op._table_buffers[(None, 7)]
    table = made[1]
    assert made[0] is a["cu_seqlens"] and made[2:] == (n or 0, 7)
    assert table._base is buffer and table.dtype == I32 and tuple(table.shape) == (TABLE,)
    assert same(prep[5:7], [a["cu_seqlens"], table])
    assert same(after_qk(prep, rec)[2:4], [a["cu_seqlens"], table])
    assert launches.events[-6:] == [("stream", 7, None), ("empty", (TABLE,), I32),
                                    ("end stream",), ("launch", "seq_table"),
                                    ("launch", "prepare"), ("launch", "recurrence")]
    # the next call on the stream reuses the buffer
    launches.events.clear()
    op.execute(**a, stream=7)
    assert kinds(launches) == ["launch"] * 3 and op._table_buffers[(None, 7)][0] is buffer
    (_, made), (_, prep), (_, rec) = launches.calls[-3:]
    assert made[1]._base is buffer and prep[6] is made[1] and rec[5] is made[1]


def test_32_sequences_scan_cu_seqlens(launches):
    """N = TABLE_MIN_SEQS: no seq_table launch; cu_seqlens stands in for the table."""
    op = gdn().check_support()
    a = call(n=gdn_module.TABLE_MIN_SEQS)
    op.execute(**a, stream=7)
    assert [m for m, _ in launches.calls] == ["prepare", "recurrence"]
    (_, prep), (_, rec) = launches.calls
    cu = a["cu_seqlens"]
    assert same(prep[5:7], [cu, cu]) and same(after_qk(prep, rec)[2:4], [cu, cu])
    assert op._table_buffers == {} and kinds(launches).count("empty") == 2  # the workspace


def test_sequence_table_of_int64_cu_seqlens_reads_the_int32_copy(launches):
    op = gdn(**samples(cu_dtype=I64)).check_support()
    cu64 = meta(MANY + 1, dtype=I64)
    op.execute(**call(n=MANY, cu_seqlens=cu64), stream=4)
    (_, made), (_, prep), (_, rec) = launches.calls
    offsets = prep[5]
    assert offsets.dtype == I32 and offsets._base is op._offset_buffers[(None, 4)][0]
    assert made[0] is offsets and made[1]._base is op._table_buffers[(None, 4)][0]
    assert prep[6] is made[1] and same(after_qk(prep, rec)[2:4], [offsets, made[1]])


def test_sequence_table_not_made_while_capturing(launches):
    """A stream capturing a graph before the op has a table buffer big enough: no
    allocation, no seq_table, the kernels scan cu_seqlens; one made before the capture is
    used."""
    op = gdn().check_support()
    ws = given_workspace(op, n=MANY)
    a = call(n=MANY)
    launches.capturing = True
    op.execute(**a, workspace=ws, stream=7)
    assert [m for m, _ in launches.calls] == ["prepare", "recurrence"]
    (_, prep), (_, rec) = launches.calls
    assert prep[6] is a["cu_seqlens"] and rec[5] is a["cu_seqlens"]
    assert kinds(launches) == ["launch"] * 2 and op._table_buffers == {}
    assert launches.capture_queries == [7]
    launches.capturing = False
    op.execute(**a, workspace=ws, stream=7)  # makes the buffer
    (buffer,) = op._table_buffers[(None, 7)]
    assert ("empty", (TABLE,), I32) in launches.events
    launches.capturing = True
    launches.calls.clear()
    launches.events.clear()
    op.execute(**a, workspace=ws, stream=7)
    assert [m for m, _ in launches.calls] == ["seq_table", "prepare", "recurrence"]
    table = launches.calls[0][1][1]
    assert table._base is buffer and launches.calls[1][1][6] is table
    assert launches.calls[2][1][5] is table and kinds(launches) == ["launch"] * 3
    # more sequences than the buffer holds: not grown while capturing
    launches.calls.clear()
    more = call(n=2 * MANY)
    op.execute(**more, workspace=given_workspace(op, n=2 * MANY), stream=7)
    assert [m for m, _ in launches.calls] == ["prepare", "recurrence"]
    assert launches.calls[0][1][6] is more["cu_seqlens"]
    assert op._table_buffers[(None, 7)][0] is buffer and "empty" not in kinds(launches)


# --- N == 0 and T == 0 ----------------------------------------------------------------------------
def test_no_sequence_writes_nothing(launches):
    op = gdn(output_final_state=True).check_support()
    op.execute(**call(t=0, n=0), final_state=meta(0, HO, V, K, dtype=F32), stream=1)
    assert launches.events == [] and op._workspaces == {} and launches.ready == [None]


@pytest.fixture
def on_cpu(monkeypatch, launches):
    """gdn_rules and the workspace rule ask tensors for device "cpu" instead of "cuda", so
    that execute() takes CPU tensors (real memory: copies and overlaps)."""
    real_rules, real_tensor = gdn_module.check_gdn_inputs, gdn_module.check_tensor
    def rules(q, *a, **kw):  # samples (descriptors) still describe cuda tensors
        return real_rules(q, *a, **kw, device="cpu" if isinstance(q, torch.Tensor) else "cuda")
    monkeypatch.setattr(gdn_module, "check_gdn_inputs", rules)
    monkeypatch.setattr(gdn_module, "check_tensor",
                        lambda *a, **kw: real_tensor(*a, **{**kw, "device": "cpu"}))
    launches.alloc_device = "cpu"
    return launches


def cpu_call(t, n, **kw):
    return {name: torch.zeros(x.shape, dtype=x.dtype) for name, x in call(t=t, n=n).items()}


def test_empty_tokens_final_state_without_initial_state_is_zero(on_cpu):
    op = gdn(output_final_state=True).check_support()
    final = torch.full((N, HO, V, K), math.nan)
    op.execute(**cpu_call(0, N), final_state=final, stream=4)
    assert torch.equal(final, torch.zeros(N, HO, V, K))
    assert kinds(on_cpu) == ["stream", "zero", "end stream"] and on_cpu.calls == []
    assert op._workspaces == {}


def test_empty_tokens_final_state_is_the_initial_state(on_cpu):
    op = gdn(sample_initial_state=state(dtype=BF), output_final_state=True).check_support()
    s0 = torch.randn(N, HO, V, K).to(BF)
    final = torch.full((N, HO, V, K), math.nan)
    op.execute(**cpu_call(0, N), initial_state=s0, final_state=final, stream=4)
    assert torch.equal(final, s0.float()) and on_cpu.calls == []
    assert on_cpu.events[0] == ("stream", 4, None) and on_cpu.events[1][0] == "copy"


def test_empty_tokens_pool(on_cpu):
    op = gdn(sample_initial_state=state(rows=10), sample_state_indices=desc((N,), I32),
             output_final_state=True).check_support()
    pool = torch.randn(10, HO, V, K)
    before = pool.clone()
    idx = torch.tensor([7, 0, 3, 9], dtype=I32)
    final = torch.full((N, HO, V, K), math.nan)
    op.execute(**cpu_call(0, N), initial_state=pool, state_indices=idx, final_state=final,
               stream=4)
    assert torch.equal(final, pool[idx.long()]) and torch.equal(pool, before)
    assert on_cpu.calls == []
    # without a final state: nothing at all (the pool rows already hold the final states)
    op = gdn(sample_initial_state=state(rows=10), sample_state_indices=desc((N,), I32))
    op.check_support().execute(**cpu_call(0, N), initial_state=pool, state_indices=idx,
                               stream=4)
    assert kinds(on_cpu).count("copy") == 1 and torch.equal(pool, before)


def test_empty_tokens_checkpoints_untouched(on_cpu):
    op = gdn(checkpoint_every_n_tokens=64).check_support()
    ckpt = torch.full((N, HO, V, K), 3.0).to(BF)  # T // 64 + N rows, none of them real
    op.execute(**cpu_call(0, N), checkpoints=ckpt, stream=4)
    assert on_cpu.events == [] and bool((ckpt == 3).all())


def test_workspace_may_not_alias_anything(on_cpu):
    op = gdn().check_support()
    a = cpu_call(T, N)
    s16, s32 = op.workspace_shapes(T, N)
    big = torch.zeros(math.prod(s16) + T * HO * V, dtype=BF)
    work16 = big[:math.prod(s16)].view(s16)
    with pytest.raises(ValueError, match=r"workspace \(work16\) overlaps o in memory"):
        op.execute(**{**a, "o": big[math.prod(s16) - 8:][:T * HO * V].view(T, HO, V)},
                   workspace=(work16, torch.zeros(s32)), stream=1)
    work32 = torch.zeros(math.prod(s32) + T * HO)
    g = work32[:T * HO].view(T, HO)
    with pytest.raises(ValueError, match=r"workspace \(work32\) overlaps g in memory"):
        op.execute(**{**a, "g": g}, workspace=(work16, work32[:math.prod(s32)].view(s32)),
                   stream=1)
    # disjoint parts of one buffer are fine
    op.execute(**{**a, "o": big[math.prod(s16):].view(T, HO, V)},
               workspace=(work16, torch.zeros(s32)), stream=1)
    assert [m for m, _ in on_cpu.calls] == ["prepare", "recurrence"]


# --- the allocating function and the custom op ----------------------------------------------------
def inputs(t=T, n=N, **kw):
    a = call(t=t, n=n)
    del a["o"]
    return {**a, **kw}


def test_allocating_function(no_compile):
    r = gated_delta_net(**inputs(), stream=0)
    o, final = r
    assert r.o is o and r["final_state"] is final is None and r.checkpoints is None
    assert tuple(o.shape) == (T, HO, V) and o.dtype == BF
    (_, prep), (_, rec) = no_compile.calls
    rec = after_qk(prep, rec)
    assert rec[4] is o and prep[9] == 1 / math.sqrt(K)
    (op,) = COMPILED_OPS._ops.values()
    assert op.static_config() == BASE_CONFIG
    # runtime values reuse the op; the scale default is not the first call's scale
    gated_delta_net(**inputs(t=3 * T, n=7), scale=0.5, stream=0)
    gated_delta_net(**inputs(), stream=0)
    assert len(COMPILED_OPS._ops) == 1
    assert [c[9] for m, c in no_compile.calls if m == "prepare"] == [1 / math.sqrt(K), 0.5,
                                                                      1 / math.sqrt(K)]
    # static values make another op
    r = gated_delta_net(**inputs(), output_final_state=True, use_qk_l2norm_in_kernel=True,
                        checkpoint_every_n_tokens=128, checkpoint_dtype=F32,
                        initial_state=meta(N, HO, V, K), stream=0)
    assert len(COMPILED_OPS._ops) == 2
    o, final = r
    assert tuple(final.shape) == (N, HO, V, K) and final.dtype == F32
    assert tuple(r.checkpoints.shape) == (T // 128 + N, HO, V, K) and r.checkpoints.dtype == F32
    rec = after_qk(no_compile.calls[-2][1], no_compile.calls[-1][1])
    assert same(rec[4:9], [o, rec[5], None, final, r.checkpoints]) and rec[10] == 128
    # checkpoints default to the io dtype
    r = gated_delta_net(**inputs(), checkpoint_every_n_tokens=64, stream=0)
    assert r.checkpoints.dtype == BF and r.checkpoints.shape[0] == CHUNKS


def test_allocating_function_reads_views_in_place_and_copies_the_rest(no_compile):
    fused = meta(T, HQ * K + HK * K + HV * V)
    q = fused[:, :HQ * K].unflatten(1, (HQ, K))
    k = fused[:, HQ * K:(HQ + HK) * K].unflatten(1, (HK, K))
    v_t = meta(T, V, HV).transpose(1, 2)  # V not contiguous: unreadable
    gates = meta(T, HO, 2, dtype=F32)  # g and beta interleaved: column stride 2
    cu = meta(2 * (N + 1), dtype=I32)[::2]  # strided offsets
    gated_delta_net(q, k, v_t, gates[..., 0], gates[..., 1], cu, stream=0)
    (_, prep), _ = no_compile.calls
    assert prep[0] is q and prep[1] is k
    for i, given in ((2, v_t), (3, gates[..., 0]), (5, cu)):
        assert prep[i] is not given and prep[i].is_contiguous()
        assert prep[i].shape == given.shape and prep[i].dtype == given.dtype
    assert prep[6] is prep[5]  # the copy of cu_seqlens stands in for the table
    assert readable_in_place("tokens", q) and not readable_in_place("tokens", v_t)
    assert readable_in_place("gate", meta(T, 2 * HO, dtype=F32)[:, HO:])
    assert not readable_in_place("offsets", cu)
    assert readable_in_place("state", meta(N, HO, V, K + 4, dtype=F32)[..., :K])
    assert not readable_in_place("state", meta(N, HO, K, V, dtype=F32).transpose(2, 3))
    with pytest.raises(ValueError, match="unknown role 'weights'"):
        readable_in_place("weights", q)


def test_allocating_function_pool_written_back_when_copied(no_compile):
    pool = meta(10, HO, K, V, dtype=F32).transpose(2, 3)  # K not contiguous: a copy runs
    idx = meta(N, dtype=I32)
    gated_delta_net(**inputs(), initial_state=pool, state_indices=idx, stream=0)
    rec = after_qk(no_compile.calls[-2][1], no_compile.calls[-1][1])
    assert rec[5] is not pool and rec[5].is_contiguous() and rec[6] is idx
    copies = [e for e in no_compile.events if e[0] == "copy"]
    assert copies[-1][1] is pool and copies[-1][2] is rec[5]  # after the launches
    assert kinds(no_compile)[-1] == "copy" and kinds(no_compile)[-2] == "launch"
    # a readable pool is updated in place: no copy
    no_compile.events.clear()
    pool = meta(10, HO, V, K, dtype=F32)
    gated_delta_net(**inputs(), initial_state=pool, state_indices=idx, stream=0)
    assert no_compile.calls[-1][1][7] is pool and "copy" not in kinds(no_compile)


@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta", "initial_state"])
def test_allocating_function_differentiates_through_the_custom_op(no_compile, name):
    """An input requiring grad (grad mode on) takes torch.ops.precast.gated_delta_net, whose
    autograd formula is the backward op (on meta tensors both run their fakes: no launch);
    under no_grad the function launches as before. A state pool is refused: forward only."""
    a = inputs(initial_state=meta(N, HO, V, K, dtype=F32))
    a[name] = a[name].clone().requires_grad_()
    o, final = gated_delta_net(**a, output_final_state=True, stream=0)
    assert o.grad_fn is not None and final.grad_fn is not None and no_compile.calls == []
    (o.float().sum() + final.sum()).backward()
    grad = a[name].grad
    assert grad.shape == a[name].shape and grad.dtype == a[name].dtype
    with torch.no_grad():
        gated_delta_net(**a, stream=0)
    assert [m for m, _ in no_compile.calls] == ["prepare", "recurrence"]
    with pytest.raises(NotImplementedError, match=f"{name} require.*state pool "
                       r"\(state_indices\) is forward only"):
        pool = meta(9, HO, V, K, dtype=F32).requires_grad_(name == "initial_state")
        gated_delta_net(**{**a, "initial_state": pool}, state_indices=meta(N, dtype=I32),
                        stream=0)


def test_allocating_function_takes_int64_offsets(no_compile):
    cu64 = meta(N + 1, dtype=I64)
    gated_delta_net(**inputs(cu_seqlens=cu64), stream=0)
    (_, prep), (_, rec) = no_compile.calls
    assert prep[5].dtype == I32 and prep[6] is prep[5]
    assert same(after_qk(prep, rec)[2:4], [prep[5], prep[5]])
    assert any(e[0] == "copy" and e[2] is cu64 for e in no_compile.events)


@pytest.mark.parametrize("value,kind", [(1, "int"), (0, "int"), ("yes", "str"),
                                        (torch.tensor(True), "Tensor")])
def test_allocating_function_keep_workspace_rules(no_compile, value, kind):
    """keep_workspace is None, True or False (a numpy bool too); True keeps the factors for
    a backward, which a state pool has not."""
    with pytest.raises(TypeError, match=f"^keep_workspace must be a bool or None, got {kind}$"):
        gated_delta_net(**inputs(), keep_workspace=value, stream=0)
    with pytest.raises(ValueError, match=r"state pool \(state_indices\) has no backward: "
                       "leave keep_workspace None or pass False"):
        gated_delta_net(**inputs(), initial_state=meta(9, HO, V, K, dtype=F32),
                        state_indices=meta(N, dtype=I32), keep_workspace=True, stream=0)
    assert no_compile.calls == []


@pytest.mark.parametrize("keep", ["unset", None, False])
def test_allocating_function_keeps_no_workspace_by_default_outside_autograd(no_compile, keep):
    """Outside autograd (no input requires grad, or grad mode is off) the default keeps
    nothing: .workspace is None and the forward writes the op's own workspace, as False;
    with a state pool too (no ValueError: only an explicit True asks for a backward)."""
    kw = {} if keep == "unset" else {"keep_workspace": keep}
    q = meta(T, HQ, K).requires_grad_()
    pool = meta(9, HO, V, K, dtype=F32)
    runs = [dict(inputs(), **kw), dict(inputs(), **kw, initial_state=pool,
                                       state_indices=meta(N, dtype=I32))]
    for a in runs:
        assert gated_delta_net(**a, stream=0).workspace is None
    with torch.no_grad():  # q requires grad, but no graph is recorded
        assert gated_delta_net(**{**runs[0], "q": q}, stream=0).workspace is None
    assert [m for m, _ in no_compile.calls] == ["prepare", "recurrence"] * 3
    ops = list(COMPILED_OPS._ops.values())
    assert len(ops) == 2 and all(op._workspaces for op in ops)  # their own, not kept ones
    prepares = [c for m, c in no_compile.calls if m == "prepare"]
    (own,) = ops[0]._workspaces.values()
    assert same([t._base for t in prepares[0][7:9]], own)  # views of the op's own pair
    # keep_workspace=True returns them (and numpy's bool is a bool)
    import numpy as np
    r = gated_delta_net(**inputs(), keep_workspace=np.bool_(True), stream=0)
    assert r.workspace is not None and same(no_compile.calls[-2][1][7:9], r.workspace)


def test_allocating_function_validates(no_compile):
    with pytest.raises(ValueError, match="q: tensor is on cpu"):
        gated_delta_net(**inputs(q=torch.zeros(T, HQ, K, dtype=BF)), stream=0)
    with pytest.raises(NotImplementedError, match="head dim K = 96"):
        gated_delta_net(**inputs(q=meta(T, HQ, 96), k=meta(T, HK, 96)), stream=0)
    with pytest.raises(ValueError, match="checkpoint_dtype is given but"):
        gated_delta_net(**inputs(), checkpoint_dtype=F32, stream=0)
    assert COMPILED_OPS._ops == {} and no_compile.calls == []  # nothing invalid is cached


def custom_op_args(t=T, n=N, **kw):
    a = inputs(t=t, n=n)
    return dict(q=a["q"], k=a["k"], v=a["v"], g=a["g"], beta=a["beta"],
                cu_seqlens=a["cu_seqlens"], scale=None, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False,
                checkpoint_every_n_tokens=None, checkpoint_dtype=None, state_indices=None,
                batch_invariant=False) | kw


def test_custom_op_fake_on_meta_tensors():
    o, final, ckpt, *kept = torch.ops.precast.gated_delta_net(*custom_op_args().values())
    assert tuple(o.shape) == (T, HO, V) and o.dtype == BF and o.device.type == "meta"
    assert tuple(final.shape) == (0, HO, V, K) and tuple(ckpt.shape) == (0, HO, V, K)
    assert [tuple(t.shape) for t in kept] == [(0, HO, V, K)] * 2  # no workspace kept
    o, final, ckpt, *_ = torch.ops.precast.gated_delta_net(*custom_op_args(
        t=3 * T, n=5, output_final_state=True, checkpoint_every_n_tokens=128,
        initial_state=meta(5, HO, V, K, dtype=F32)).values())
    assert tuple(o.shape) == (3 * T, HO, V)
    assert tuple(final.shape) == (5, HO, V, K) and final.dtype == F32
    assert tuple(ckpt.shape) == (3 * T // 128 + 5, HO, V, K) and ckpt.dtype == BF
    _, _, ckpt, *_ = torch.ops.precast.gated_delta_net(*custom_op_args(
        checkpoint_every_n_tokens=64, checkpoint_dtype=F32).values())
    assert tuple(ckpt.shape) == (CHUNKS, HO, V, K) and ckpt.dtype == F32
    # the kept workspace: work16 and work32, as GdnFwdSm90's
    *_, work16, work32 = torch.ops.precast.gated_delta_net(*custom_op_args(
        keep_workspace=True).values())
    assert [(tuple(t.shape), t.dtype) for t in (work16, work32)] == list(zip(
        gdn().workspace_shapes(T, N), (BF, F32)))


def test_custom_op_fake_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(T, 16, 64, dtype=FP), torch.empty(T, 4, 64, dtype=FP)
        v = torch.empty(T, 4, 128, dtype=FP)
        g, beta = torch.empty(T, 16), torch.empty(T, 16, dtype=FP)
        cu = torch.empty(N + 1, dtype=I32)
        o, final, ckpt, *kept = torch.ops.precast.gated_delta_net(
            q, k, v, g, beta, cu, 0.1, None, True, True, 64, None, None, True, True)
    assert tuple(o.shape) == (T, 16, 128) and o.dtype == FP
    assert tuple(final.shape) == (N, 16, 128, 64) and final.dtype == F32
    assert tuple(ckpt.shape) == (T // 64 + N, 16, 128, 64) and ckpt.dtype == FP
    assert [tuple(t.shape) for t in kept] == [(T // 64 + N, 16, 64, 64),
                                              (T // 64 + N, 16, 272)]


def test_custom_op_schemas():
    """gated_delta_net is functional (an autograd formula needs it); the pool op declares
    the pool mutated."""
    schema = str(torch.ops.precast.gated_delta_net.default._schema)
    assert "!" not in schema and schema.endswith(
        "bool keep_workspace=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
    schema = str(torch.ops.precast.gated_delta_net_pool.default._schema)
    assert "Tensor(a7!) pool" in schema and schema.endswith("-> (Tensor, Tensor)")
    with pytest.raises(NotImplementedError, match="use torch.ops.precast.gated_delta_net_pool"):
        torch.ops.precast.gated_delta_net(*custom_op_args(state_indices=meta(N, dtype=I32))
                                          .values())


def test_pool_custom_op_fake():
    a = custom_op_args()
    o, final = torch.ops.precast.gated_delta_net_pool(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], None,
        meta(9, HO, V, K, dtype=F32), meta(N, dtype=I32), True, True, False)
    assert tuple(o.shape) == (T, HO, V) and tuple(final.shape) == (N, HO, V, K)
    _, final = torch.ops.precast.gated_delta_net_pool(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"], 0.5,
        meta(9, HO, V, K, dtype=F32), meta(N, dtype=I32), False, False, False)
    assert tuple(final.shape) == (0, HO, V, K)


# --- the kernel builders --------------------------------------------------------------------------
@pytest.fixture
def stub_kernels(monkeypatch):
    pytest.importorskip("cutlass")
    made = []

    def kernel_class(name):
        def init(self, *args, **kwargs):
            made.append((name, args) + ((kwargs,) if kwargs else ()))
        return type(name, (), {"__init__": init})

    chunk = types.ModuleType("precast.kernels.gdn_chunk_sm90")
    chunk.GdnChunkPrepareSm90 = kernel_class("prepare")
    recurrence = types.ModuleType("precast.kernels.gdn_recurrence_sm90")
    recurrence.GdnChunkRecurrenceSm90 = kernel_class("recurrence")
    monkeypatch.setitem(sys.modules, chunk.__name__, chunk)
    monkeypatch.setitem(sys.modules, recurrence.__name__, recurrence)
    return made


@pytest.mark.compile  # (builds fake tensors: needs cutlass, generates no code)
@pytest.mark.parametrize("config,none_args", [
    ({}, (5, 6, 7, 8)),
    (dict(state_dtype="float32", output_final_state=True), (6, 8)),
    (dict(state_dtype="io", state_pool=True), (7, 8)),
    (dict(checkpoint_dtype="float32", state_dtype="io", output_final_state=True), (6,)),
])
def test_kernel_builder_arguments(stub_kernels, config, none_args):
    import cutlass
    op = GdnFwdSm90.from_config(dtype="float16", k_dim=64, v_dim=128, q_heads=2, k_heads=8,
                                v_heads=8, g_dtype="bfloat16", use_qk_l2norm_in_kernel=True,
                                **config).check_support()
    s = op.shapes
    builders = op._kernel_builders()
    kernel, prep = builders["prepare"]()
    assert stub_kernels[-1] == ("prepare", (cutlass.Float16, 64, 128, 2, 8, 8, True,
                                            cutlass.BFloat16, cutlass.Float32),
                                {"store_wu": False})
    assert len(prep) == 11 and None not in prep
    q, k, v, g, beta, cu, table, work16, work32 = prep[:9]
    assert cu.element_type == table.element_type == cutlass.Int32
    assert tuple(q.shape[1:]) == (2, 64) and tuple(k.shape[1:]) == (8, 64)
    assert tuple(v.shape[1:]) == (8, 128) and q.stride[2] == 1
    assert q.shape[0] is k.shape[0] is v.shape[0] is g.shape[0] is beta.shape[0]
    assert g.element_type == cutlass.BFloat16 and beta.element_type == cutlass.Float32
    assert g.shape[1] == beta.shape[1] == 8 and g.stride[1] == 1
    assert tuple(work16.shape[1:]) == (8, 64, 64)  # T and M packed
    assert work16.element_type == cutlass.Float16 and work32.element_type == cutlass.Float32
    assert work16.shape[0] is work32.shape[0] and tuple(work32.shape[1:]) == (8, 272)
    assert isinstance(prep[9], cutlass.Float32)
    kernel, rec = builders["recurrence"]()
    assert [tuple(t.shape[1:]) for t in rec[:2]] == [(2, 64), (8, 64)]  # q, k
    rec = rec[2:]
    flags = (config.get("state_dtype", "none") != "none", config.get("state_pool", False),
             config.get("output_final_state", False), config.get("checkpoint_dtype", "none")
             != "none")
    assert stub_kernels[-1] == ("recurrence", (cutlass.Float16, 64, 128, 2, 8, 8) + flags,
                                dict(v_splits=1, states_only=False, from_checkpoints=False))
    assert len(rec) == 12
    assert tuple(i for i, x in enumerate(rec) if x is None) == none_args
    assert rec[2].element_type == rec[3].element_type == cutlass.Int32  # cu_seqlens, table
    assert tuple(rec[4].shape[1:]) == (8, 128)  # o
    states = {5: s.state_dtype, 7: F32, 8: s.checkpoint_dtype}
    for i, dtype in states.items():
        if rec[i] is not None:
            assert tuple(rec[i].shape[1:]) == (8, 128, 64) and rec[i].stride[3] == 1
            assert rec[i].element_type == {F32: cutlass.Float32, FP: cutlass.Float16}[dtype]
    assert isinstance(rec[10], cutlass.Int32)


@pytest.mark.compile
def test_both_kernels_cross_compile(tmp_path):
    """The sequence table, prepare, recurrence and the split recurrence of one
    configuration (every optional tensor present, V = 128) build for sm_90a and land in one
    cache entry."""
    op = GdnFwdSm90.from_config(state_dtype="float32", output_final_state=True,
                                use_qk_l2norm_in_kernel=True, checkpoint_dtype="float32",
                                beta_dtype="bfloat16").check_support()
    cache = ArtifactCache(tmp_path)
    op.compile(arch="sm_90a", cache=cache)
    assert op.is_compiled and sorted(op._kernels) == ["prepare", "recurrence",
                                                        "recurrence_split", "seq_table"]
    ((_, manifest),) = list(cache.entries())
    assert set(manifest["kernels"]) == {"seq_table", "prepare", "recurrence",
                                        "recurrence_split"}
    assert manifest["key"]["op"] == "GdnFwdSm90" and manifest["key"]["arch"] == "sm_90a"
    assert manifest["key"]["config"] == op.static_config()


# --- plans, and the reference's measures the GPU tests and the benchmark use ------------------------
def planned_configs(path):
    from precast.plan import load_plan
    return [GdnFwdSm90.from_config(**dict(e.config)).check_support().static_config()
            for e in load_plan(path) if e.op == "GdnFwdSm90"]


def test_gpu_tests_use_planned_configurations():
    """The forward's GPU tests and the backward's (its FORWARD_CONFIGS, one of them for the
    backward's sanitizer script) run planned configurations, and nothing planned goes
    unused."""
    from pathlib import Path

    from test_gdn_bwd_gpu import FORWARD_CONFIGS
    from test_gdn_fwd_gpu import CONFIGS
    planned = planned_configs(Path(__file__).parent / "gpu_plan.toml")
    assert len(planned) == len({tuple(sorted(c.items())) for c in planned})  # no duplicates
    used = {**CONFIGS, **FORWARD_CONFIGS}
    for name, config in used.items():
        assert config in planned, name
    assert len(planned) == len(used)


def test_default_plan_has_the_issue_shapes():
    from precast.cli import DEFAULT_PLAN
    planned = planned_configs(DEFAULT_PLAN)
    issue = {**BASE_CONFIG, "k_dim": 128, "v_dim": 128, "q_heads": 64, "k_heads": 64,
             "v_heads": 64, "beta_dtype": "bfloat16", "use_qk_l2norm_in_kernel": True,
             "output_final_state": True}
    grouped = {**issue, "q_heads": 16, "k_heads": 16}  # the bench's 32k-token GVA case
    backward_shape = {**grouped, "v_heads": 32}  # the backward issue's 32k-token case
    assert issue in planned and grouped in planned and backward_shape in planned
    # training: fp32 checkpoints for the backward at the 64-head and the 32k-token shapes
    for shape in (issue, backward_shape):
        assert {**shape, "checkpoint_dtype": "float32"} in planned
        # keep_workspace=True with the chunk states
        assert {**shape, "checkpoint_dtype": "io"} in planned
    assert len(planned) == 8


def test_reference_measures():
    from precast.reference.gated_delta_net import chunk_flops, forward_flops, rms_error_ratio
    assert chunk_flops(128, 128) == 11_534_336  # ~11.5 MFLOP per chunk and head
    assert chunk_flops(64, 64) == 2 * 64 * 64 * 320 + 6 * 64 * 64 * 64
    assert forward_flops([8192] * 4, 64, 128, 128) == 512 * 64 * 11_534_336  # ~378 GFLOP
    assert forward_flops([65, 0, 1], 2, 64, 128) == 3 * 2 * chunk_flops(64, 128)
    want = torch.tensor([3.0, -4.0])
    assert rms_error_ratio(want, want) == 0.0
    assert rms_error_ratio(want * 1.01, want) == pytest.approx(0.01)
    assert rms_error_ratio(torch.zeros(2), torch.zeros(2)) == 0.0
    assert rms_error_ratio(torch.zeros(0), torch.zeros(0)) == 0.0
    assert rms_error_ratio(torch.ones(2), torch.zeros(2)) == math.inf
