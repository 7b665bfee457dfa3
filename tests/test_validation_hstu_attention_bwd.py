"""Every check_support() and execute() rule of HSTUBwdSm90, its static configuration and
cache key, kernel modes (the configuration decides: deterministic=False with D <= 128 -- the
default -- runs the fused kernel with dQ reduced through an fp32 workspace, then dq_finish for
dense batches (jagged ones: a torch copy and memset); deterministic=True or D = 256 runs the
two (three at D = 256) kernels and ignores a workspace), the launch plan (compact numbering,
L2 pair groups, bounded by the workspace's sync words), the workspace (given: validated, its
first T_q rows passed as dq_acc and the rest as int32 sync words; the op's own: per device and
stream, grown, refused while capturing), the overlap rule it relies on (check_no_overlap /
_share_elements: disjoint views of one allocation are accepted), the allocating function and
the custom ops' fakes -- all on a CPU machine (ops are built from TensorDescs, meta or CPU
tensors; kernels are never built or loaded: execute()'s launches, stream contexts, copies and
memsets are stood in for and recorded)."""
import itertools
import math
import random
import sys
import types

import numpy as np
import pytest
import torch
from conftest import isolate_from_kernels, key_of, record_launches

import precast
from precast import HSTUBwdSm90, HSTUFwdSm90, TensorDesc, hstu_attention_backward
from precast.lifecycle import hstu_attention as fwd_module
from precast.lifecycle import hstu_attention_bwd as bwd_module
from precast.lifecycle import op as op_mod
from precast.lifecycle.hstu_attention import FLOAT32_MAX, WINDOW_CAP
from precast.lifecycle.hstu_attention_bwd import (L2_GROUP_BYTES, SYNC_EXTRA_WORDS,
                                                  SYNC_ROWS_PER, Launch, fixed_rows,
                                                  sync_group_capacity, sync_rows)
from precast.lifecycle.validation import (INT32_MAX, _share_elements, byte_range,
                                          check_no_overlap)
from precast.plan import expand
from precast.reference.hstu_attention import FUNC_PAD_COLUMNS

BF, FP, F32, I32, I64 = torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.int64
T, H, HKV, D, B = 64, 4, 2, 64, 4  # tokens (q and k), heads, kv heads, head dim, sequences
MAXS = T // B  # the smallest max_seqlen that B sequences of T tokens allow
L = T + FUNC_PAD_COLUMNS
WS = T + 1  # workspace rows for T query tokens: the fp32 dQ accumulator, one row of sync words
JAGGED = 1024  # max_seqlen of B sequences of T tokens in all: the compact numbering
BIG = 1 << 31  # Launch.plan's max_groups where it does not bind
FUSED_MODES = ("fused", "dq_finish")
COMPILED_OPS = sys.modules["precast.op_cache"]


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Nothing here may build or load kernels; the allocating function starts with no ops."""
    isolate_from_kernels(monkeypatch, tmp_path)


def desc(shape, dtype=BF, stride=None, alignment=16, device="cuda"):
    return TensorDesc(dtype, shape, stride, device, alignment)


def meta(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="meta")


SAMPLES = ("do", "q", "k", "v", "dq", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k", "func")
BASE = dict(do=desc((T, H, D)), q=desc((T, H, D)), k=desc((T, HKV, D)), v=desc((T, HKV, D)),
            dq=None, dk=None, dv=None, cu_seqlens_q=desc((B + 1,), I32),
            cu_seqlens_k=desc((B + 1,), I32), max_seqlen_q=MAXS, max_seqlen_k=MAXS)
FUNC = dict(func=desc((1, 3, L), I32), window_size=(-1, -1))


def bwd(**kw):
    """The op from BASE with some arguments replaced (None included)."""
    args = {**BASE, **kw}
    return HSTUBwdSm90(**{("sample_" + k if k in SAMPLES else k): v for k, v in args.items()})


def dims(head_dim, dtype=BF, t_q=T, t_k=T, heads=H, kv_heads=HKV):
    """do, q, k, v descriptors of another head dim / dtype."""
    return dict(do=desc((t_q, heads, head_dim), dtype), q=desc((t_q, heads, head_dim), dtype),
                k=desc((t_k, kv_heads, head_dim), dtype), v=desc((t_k, kv_heads, head_dim), dtype))


# --- valid configurations -------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [
    {}, dict(window_size=(-1, 0)), dict(window_size=(16, 0)), dict(window_size=(0, 0)),
    dict(window_size=[3, -1]), dict(window_size=(2**31 - 1, 2**31 - 1)),
    dict(alpha=-2.5, scaling_seqlen=7.0), dict(deterministic=True), FUNC,
    dict(func=desc((1, 1, L + 100), I32), window_size=(-1, -1)),
    dict(dq=desc((T, H, D)), dk=desc((T, HKV, D)), dv=desc((T, HKV, D))),  # given gradients
    dict(dq=desc((T, H, D), stride=(2 * H * D, D, 1)),                   # padded gradients
         dk=desc((T, HKV, D), stride=(2 * HKV * D, D, 1)),
         dv=desc((T, HKV, D), stride=(2 * HKV * D, D, 1))),
    dict(k=desc((T, 1, D)), v=desc((T, 1, D))),   # MQA
    dict(k=desc((T, H, D)), v=desc((T, H, D))),   # MHA
    dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D)), max_seqlen_k=2 * MAXS),  # T_k != T_q
    dict(max_seqlen_q=0, max_seqlen_k=0, **dims(D, t_q=0, t_k=0)),  # empty batch
    dict(cu_seqlens_q=desc((1,), I32), cu_seqlens_k=desc((1,), I32)),  # B = 0
])
def test_valid_configurations(kw):
    op = bwd(**kw).check_support()
    assert op._checked


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
@pytest.mark.parametrize("dtype", [BF, FP])
def test_supported_head_dims_and_dtypes(head_dim, dtype):
    op = bwd(**dims(head_dim, dtype)).check_support()
    assert op.head_dim == head_dim and op.dtype == dtype


def test_meta_samples_are_accepted():
    op = HSTUBwdSm90(meta(T, H, D), meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D),
                     meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D), meta(B + 1, dtype=I32),
                     meta(B + 1, dtype=I32), MAXS, MAXS).check_support()
    assert op.static_config()["num_kv_heads"] == HKV


def test_exported():
    assert precast.HSTUBwdSm90 is HSTUBwdSm90
    assert "HSTUBwdSm90" in precast.__all__
    assert callable(precast.hstu_attention_backward) and callable(precast.hstu_attention)
    assert "hstu_attention_backward" in precast.__all__ and "hstu_attention" in precast.__all__
    assert op_mod.OP_REGISTRY["HSTUBwdSm90"] is HSTUBwdSm90


def test_omitted_gradients_default_to_input_shapes():
    op = bwd(k=desc((2 * T, HKV, D), FP), v=desc((2 * T, HKV, D), FP),
             do=desc((T, H, D), FP), q=desc((T, H, D), stride=(2 * H * D, D, 1), dtype=FP),
             max_seqlen_k=2 * MAXS)
    assert op.dq == TensorDesc(FP, (T, H, D))  # compact, not q's padded strides
    assert op.dq.is_contiguous() and op.dq.stride == (H * D, D, 1)
    assert op.dk == TensorDesc(FP, (2 * T, HKV, D)) and op.dv == TensorDesc(FP, (2 * T, HKV, D))
    op.check_support()
    given = desc((T, H, D), stride=(H * D + 8, D, 1))
    assert bwd(dq=given).dq is given  # a given gradient descriptor is kept as is


def not_fused_modes(head_dim):
    return ("dq", "dkdv") if head_dim <= 128 else ("dq", "dk", "dv")


def test_fused_by_default_for_head_dims_up_to_128():
    """The default (deterministic=False) runs the fused kernel and takes a workspace for
    D <= 128; deterministic=True and D = 256 (no fused kernel) never do."""
    for head_dim, deterministic in itertools.product([32, 64, 128, 256], [False, True]):
        fused = not deterministic and head_dim <= 128
        modes = FUSED_MODES if fused else not_fused_modes(head_dim)
        op = bwd(**dims(head_dim), deterministic=deterministic)
        assert op.fused is fused, (head_dim, deterministic)
        assert op.kernel_modes() == modes
        assert op.workspace_shape(T) == ((WS, H, head_dim) if fused else (0,))
        assert op.workspace_shape(0) == ((1, H, head_dim) if fused else (0,))
        op = HSTUBwdSm90.from_config(head_dim=head_dim, deterministic=deterministic)
        assert op.check_support().fused is fused
        assert op.kernel_modes() == modes
    # deterministic defaults to False: the default op is fused
    assert bwd().fused and bwd().kernel_modes() == FUSED_MODES
    assert HSTUBwdSm90.from_config().check_support().fused


@pytest.mark.parametrize("head_dim,deterministic,modes", [
    (32, False, FUSED_MODES), (64, False, FUSED_MODES), (128, False, FUSED_MODES),
    (256, False, ("dq", "dk", "dv")),  # no fused kernel at D = 256
    (32, True, ("dq", "dkdv")), (64, True, ("dq", "dkdv")), (128, True, ("dq", "dkdv")),
    (256, True, ("dq", "dk", "dv")),
])
def test_kernel_modes(head_dim, deterministic, modes):
    op = bwd(**dims(head_dim), deterministic=deterministic)
    assert op.kernel_modes() == modes
    assert op.fused is (modes == FUSED_MODES)
    # dq_finish only finishes the fused kernel's dQ conversion
    assert ("dq_finish" in modes) is op.fused
    if not op.fused:
        assert modes == not_fused_modes(head_dim)
    assert fixed_rows(head_dim) == (128 if head_dim <= 128 else 64)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(H, HKV), (8, 1), (1, 1)])
def test_workspace_shape_when_fused(head_dim, heads, kv_heads):
    op = bwd(**dims(head_dim, heads=heads, kv_heads=kv_heads))
    assert op.fused
    # fp32 dQ of every query token, then one row of int32 sync words per 32768 tokens (and one)
    assert op.workspace_shape(T) == (T + 1, heads, head_dim)
    assert op.workspace_shape(0) == (1, heads, head_dim)
    assert op.workspace_shape(12345) == (12346, heads, head_dim)
    assert op.workspace_shape(INT32_MAX) == (INT32_MAX + 65536, heads, head_dim)
    shape = op.workspace_shape(np.int64(7))
    assert shape == (8, heads, head_dim) and all(type(x) is int for x in shape)


def test_sync_group_capacity():
    """Two words per group (arrivals, claims) and two more (the finisher's CTA count, the
    oldest group with unclaimed slices)."""
    assert SYNC_EXTRA_WORDS == 2
    for words in (32, 33, 128, 512, 1536, 10**6):
        groups = sync_group_capacity(words)
        assert 2 * groups + 2 <= words < 2 * (groups + 1) + 2, words


@pytest.mark.parametrize("total_q,rows", [
    (0, 1), (1, 2), (T, T + 1), (32767, 32768), (32768, 32770), (32769, 32771),
    (65535, 65537), (65536, 65539), (10**6, 10**6 + 31), (10**9, 10**9 + 30518),
    (INT32_MAX, INT32_MAX + 65536)])
def test_workspace_shape_values(total_q, rows):
    """T_q accumulator rows, then sync_rows(T_q) = 1 + T_q // 32768 rows of sync words."""
    assert SYNC_ROWS_PER == 32768
    assert sync_rows(total_q) == rows - total_q
    assert bwd().workspace_shape(total_q) == (rows, H, D)
    assert bwd(**dims(128, heads=8, kv_heads=1)).workspace_shape(total_q) == (rows, 8, 128)
    assert bwd(**dims(32, heads=1, kv_heads=1)).workspace_shape(total_q) == (rows, 1, 32)
    assert bwd(deterministic=True).workspace_shape(total_q) == (0,)


NOT_FUSED = [dict(deterministic=True), dict(dims(256)), dict(dims(256), deterministic=True),
             dict(dims(32), deterministic=True), dict(dims(128), deterministic=True)]


@pytest.mark.parametrize("kw", NOT_FUSED)
def test_workspace_shape_when_not_fused(kw):
    op = bwd(**kw)
    assert not op.fused
    assert op.workspace_shape(0) == op.workspace_shape(T) == op.workspace_shape(12345) == (0,)


@pytest.mark.parametrize("kw", [{}, dict(deterministic=True), dims(256)],
                         ids=["fused", "deterministic", "d256"])
@pytest.mark.parametrize("total_q,exc,match", [
    (-1, ValueError, "total_q must be >= 0, got -1"),
    (-(2**40), ValueError, "total_q must be >= 0"),
    (1.0, TypeError, "total_q must be an int, got float"),
    (True, TypeError, "total_q must be an int, got bool"),
    ("64", TypeError, "total_q must be an int, got str"),
    (None, TypeError, "total_q must be an int, got NoneType"),
])
def test_workspace_shape_validates_total_q(kw, total_q, exc, match):
    """Whether or not the op takes a workspace."""
    with pytest.raises(exc, match=match):
        bwd(**kw).workspace_shape(total_q)


def test_workspace_shape_needs_an_op_and_a_token_count():
    with pytest.raises(TypeError):
        bwd().workspace_shape()  # no default T_q
    with pytest.raises(TypeError):
        HSTUBwdSm90.workspace_shape(T)  # an instance method now: H and D come from the op


# --- the launch plan: compact numbering and L2 pair groups ----------------------------------------
def l2_pair_group(head_dim, tiles, pairs):
    """The (sequence, head) pairs of about L2_GROUP_BYTES of streamed data: 8 bytes per
    element of a pair's fixed tiles (fp32 dQ and two 16-bit tiles)."""
    return max(min(L2_GROUP_BYTES // (fixed_rows(head_dim) * head_dim * 8) // tiles, pairs), 1)


@pytest.mark.parametrize("args,plan", [
    # (head_dim, heads, total_fixed, batch, max_fixed, max_groups) -> (compact, pair_group)
    ((64, HKV, T, B, MAXS, BIG), (0, 8)),      # one tile per sequence: dense, one group
    ((64, H, T, B, MAXS, BIG), (0, 16)),
    ((64, HKV, T, B, JAGGED, BIG), (1, 8)),    # 8 tiles per sequence, T / 128 + B = 4 exist
    # causal 16 x 4096, H_kv = 8: dense, 128 tiles of 128 x 128 per 16 MB group: 4 pairs
    ((128, 8, 16 * 4096, 16, 4096, BIG), (0, 4)),
    ((64, 8, 16 * 4096, 16, 4096, BIG), (0, 8)),    # 256 tiles of 128 x 64
    ((32, 8, 16 * 4096, 16, 4096, BIG), (0, 16)),   # 512 tiles of 128 x 32
    ((256, 8, 16 * 4096, 16, 4096, BIG), (0, 2)),   # 64-row tiles: 128 of 64 x 256, 64 each
    # one sequence longer than a group's budget: one pair a group
    ((128, 2, 65536, 1, 65536, BIG), (0, 1)),
    # the compact rule at its boundary: (T // 128 + B) x 2 <= tiles x B; 4 x 4 tiles
    ((64, 1, 639, 4, 512, BIG), (1, 4)),     # (4 + 4) x 2 = 16 <= 16
    ((64, 1, 640, 4, 512, BIG), (0, 4)),     # (5 + 4) x 2 = 18 > 16
    ((256, 1, 319, 4, 256, BIG), (1, 4)),    # 64-row tiles: (4 + 4) x 2 <= 4 x 4
    ((256, 1, 320, 4, 256, BIG), (0, 4)),
    # max_seqlen 0 (no rows): one tile; B = 0 (execute launches nothing then)
    ((64, 2, 0, 4, 0, BIG), (0, 8)),
    ((64, 2, 0, 0, 0, BIG), (1, 2)),
    # many short sequences: never compact (2 B > B), groups as large as the budget allows
    ((128, 1, 100, 100000, 1, BIG), (0, 128)),
    # ... unless that makes more groups than max_groups: ceil(pairs / max_groups) pairs each
    ((128, 1, 100, 100000, 1, 63), (0, 1588)),   # ceil(100000 / 63)
    ((128, 2, 65536, 1, 65536, 1), (0, 2)),      # one group
    ((128, 2, 65536, 1, 65536, 2), (0, 1)),      # the L2 choice already fits
    ((64, 3, 3 * 4096, 3, 4096, 4), (0, 8)),     # 9 pairs, L2 choice 256 // 32 = 8
    ((64, 3, 3 * 65536, 3, 65536, 4), (0, 3)),   # L2 choice 1 (9 groups), ceil(9 / 4) = 3
])
def test_launch_plan_values(args, plan):
    assert Launch.plan(*args) == plan
    assert Launch.plan(*args).compact in (0, 1)
    assert type(Launch.plan(*args).pair_group) is int


def test_launch_plan_rules():
    """Launch.plan against its rule for many shapes: rows = 128 at D <= 128 else 64,
    tiles = max(ceil(max_fixed / rows), 1), pairs = heads x max(B, 1); compact when
    (total_fixed // rows + B) x 2 <= tiles x max(B, 1); pair_group the L2 choice, raised to
    ceil(pairs / max_groups) when that makes more groups than max_groups."""
    rng = random.Random(0)
    bound = 0
    for _ in range(4000):
        head_dim = rng.choice([32, 64, 128, 256])
        heads = rng.choice([1, 2, 3, 4, 8, 16])
        batch = rng.choice([0, 1, 2, 3, 7, 16, 100, 1000, 50000])
        max_fixed = rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 1000, 4096, 65536, 10**6])
        total_fixed = rng.randint(0, max_fixed * batch) if batch else 0
        max_groups = rng.choice([1, 2, 15, 63, 127, 1000, BIG])
        plan = Launch.plan(head_dim, heads, total_fixed, batch, max_fixed, max_groups)
        rows = fixed_rows(head_dim)
        assert rows == (128 if head_dim <= 128 else 64)
        tiles = max(-(-max_fixed // rows), 1)
        pairs = heads * max(batch, 1)
        assert plan.compact == int((total_fixed // rows + batch) * 2 <= tiles * max(batch, 1))
        chosen = l2_pair_group(head_dim, tiles, pairs)
        groups = -(-pairs // chosen)
        if groups <= max_groups:
            assert plan.pair_group == chosen
        else:
            assert plan.pair_group == -(-pairs // max_groups) > chosen
            bound += 1
        assert 1 <= plan.pair_group <= pairs
        assert plan.groups(heads, batch) == -(-pairs // plan.pair_group) <= max_groups
        # every group but the last is full: pair_group x (groups - 1) < pairs
        assert plan.pair_group * (plan.groups(heads, batch) - 1) < pairs
    assert bound > 100  # the bound was exercised


def test_launch_groups():
    assert Launch(0, 8).groups(HKV, B) == 1
    assert Launch(0, 3).groups(HKV, B) == 3   # 8 pairs: 3 + 3 + 2
    assert Launch(0, 1).groups(H, B) == 16
    assert Launch(1, 5).groups(2, 0) == 1     # B = 0 counts as one sequence
    assert Launch(0, 1588).groups(1, 100000) == 63
    assert Launch(0, 1587).groups(1, 100000) == 64
    assert Launch(0, 4) == (0, 4) and Launch(0, 4)._fields == ("compact", "pair_group")


# --- every rule -----------------------------------------------------------------------------------
RULES = [
    # (id, bwd kwargs, exception, message fragment)
    # required tensors
    ("do-missing", dict(do=None), ValueError, "do and q are required"),
    ("q-missing", dict(q=None), ValueError, "do and q are required"),
    ("k-missing", dict(k=None), ValueError, "k and v are required"),
    ("v-missing", dict(v=None), ValueError, "k and v are required"),
    # dtypes
    ("q-dtype-fp32", dict(q=desc((T, H, D), F32)), TypeError,
     "q: dtype float32 is not supported; expected bfloat16 or float16"),
    ("all-fp32", dims(D, F32), TypeError, "q: dtype float32 is not supported"),
    ("do-dtype", dict(do=desc((T, H, D), FP)), TypeError,
     "do: dtype float16 is not supported; expected bfloat16"),
    ("dq-dtype", dict(dq=desc((T, H, D), FP)), TypeError,
     "dq: dtype float16 is not supported; expected bfloat16"),
    ("dq-dtype-fp32", dict(dq=desc((T, H, D), F32)), TypeError, "dq: dtype float32"),
    ("dk-dtype", dict(dk=desc((T, HKV, D), FP)), TypeError,
     "dk: dtype float16 is not supported; expected bfloat16"),
    ("dv-dtype", dict(dv=desc((T, HKV, D), F32)), TypeError, "dv: dtype float32"),
    ("k-dtype", dict(k=desc((T, HKV, D), FP)), TypeError, "k: dtype float16"),
    ("v-dtype", dict(v=desc((T, HKV, D), FP)), TypeError, "v: dtype float16"),
    # head dim and heads
    ("D-96", dims(96), NotImplementedError,
     "q: head dim D = 96 is not supported; expected one of 32, 64, 128, 256"),
    ("D-16", dims(16), NotImplementedError, "head dim D = 16"),
    ("D-512", dims(512), NotImplementedError, "head dim D = 512"),
    ("H-0", dims(D, heads=0), ValueError, r"q: needs at least one head, got shape \[64, 0, 64\]"),
    ("kv-heads-not-dividing", dict(k=desc((T, 3, D)), v=desc((T, 3, D))), ValueError,
     "k: H_kv = 3 key/value heads must be >= 1 and divide the H = 4 query heads"),
    ("kv-heads-above-H", dict(k=desc((T, 8, D)), v=desc((T, 8, D))), ValueError, "H_kv = 8"),
    ("kv-heads-0", dict(k=desc((T, 0, D)), v=desc((T, 0, D))), ValueError, "k: H_kv = 0"),
    ("k-head-dim", dict(k=desc((T, HKV, 32))), ValueError,
     r"k: extent 32 on axis 2 does not match \(\*, \*, 64\)"),
    ("do-heads", dict(do=desc((T, HKV, D))), ValueError,
     r"do: extent 2 on axis 1 does not match \(\*, 4, 64\)"),
    ("dq-heads", dict(dq=desc((T, 2 * H, D))), ValueError, r"dq: extent 8 on axis 1"),
    ("dq-head-dim", dict(dq=desc((T, H, 2 * D))), ValueError, "dq: extent 128 on axis 2"),
    ("v-heads", dict(v=desc((T, 1, D))), ValueError,
     r"v: extent 1 on axis 1 does not match \(\*, 2, 64\)"),
    ("dk-heads", dict(dk=desc((T, H, D))), ValueError,
     r"dk: extent 4 on axis 1 does not match \(\*, 2, 64\)"),
    ("dv-head-dim", dict(dv=desc((T, HKV, 32))), ValueError, "dv: extent 32 on axis 2"),
    ("do-rank", dict(do=desc((T, H * D))), ValueError, "do: expected a rank-3"),
    ("dk-rank", dict(dk=desc((T, HKV, D, 1))), ValueError, "dk: expected a rank-3"),
    # token counts
    ("do-tokens", dict(do=desc((T - 1, H, D))), ValueError, "do: has 63 tokens but q has 64"),
    ("dq-tokens", dict(dq=desc((T + 8, H, D))), ValueError, "dq: has 72 tokens but q has 64"),
    ("v-tokens", dict(v=desc((T - 1, HKV, D))), ValueError, "v: has 63 tokens but k has 64"),
    ("dk-tokens", dict(dk=desc((T - 1, HKV, D))), ValueError, "dk: has 63 tokens but k has 64"),
    ("dv-tokens", dict(dv=desc((2 * T, HKV, D))), ValueError, "dv: has 128 tokens but k has 64"),
    ("dk-tokens-of-q", dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D)),
                            dk=desc((T, HKV, D)), max_seqlen_k=2 * MAXS),
     ValueError, "dk: has 64 tokens but k has 128"),
    # layouts of the gradients
    ("dq-last-stride", dict(dq=desc((T, H, D), stride=(2 * H * D, 2 * D, 2))), ValueError,
     r"dq: the last dimension must be contiguous \(stride 1\)"),
    ("dk-token-stride-multiple", dict(dk=desc((T, HKV, D), stride=(HKV * D + 4, D, 1))),
     ValueError, "dk: axis-0 stride 132 must be a multiple of 8"),
    ("dv-alignment", dict(dv=desc((T, HKV, D), alignment=8)), ValueError,
     "dv: base address is 8-byte aligned; 16-byte alignment is required"),
    ("do-alignment", dict(do=desc((T, H, D), alignment=4)), ValueError,
     "do: base address is 4-byte"),
    ("dq-heads-overlap", dict(dq=desc((T, H, D), stride=(H * D, D // 2, 1))), ValueError,
     "dq: axis-1 stride 32 is smaller than the 64 elements spanned by the faster axes"),
    ("dk-broadcast", dict(dk=desc((T, HKV, D), stride=(0, D, 1))), ValueError,
     "dk: axis-0 stride 0 is smaller than"),
    ("dv-on-cpu", dict(dv=desc((T, HKV, D), device="cpu")), ValueError,
     "dv: tensor is on cpu; expected a cuda tensor"),
    # cu_seqlens
    ("cu_q-dtype", dict(cu_seqlens_q=desc((B + 1,), I64)), TypeError,
     "cu_seqlens_q: dtype int64 is not supported; expected int32"),
    ("cu_k-dtype", dict(cu_seqlens_k=desc((B + 1,), I64)), TypeError,
     "cu_seqlens_k: dtype int64 is not supported; expected int32"),
    ("cu_q-rank", dict(cu_seqlens_q=desc((1, B + 1), I32)), ValueError,
     r"cu_seqlens_q: expected a rank-1 tensor of shape \(\*\)"),
    ("cu_q-empty", dict(cu_seqlens_q=desc((0,), I32), cu_seqlens_k=desc((0,), I32)), ValueError,
     r"cu_seqlens_q: needs B \+ 1 >= 1 entries"),
    ("cu_k-length", dict(cu_seqlens_k=desc((B + 2,), I32)), ValueError,
     r"cu_seqlens_k: has 6 entries but cu_seqlens_q has 5; both hold B \+ 1 offsets"),
    ("cu_q-length", dict(cu_seqlens_q=desc((B,), I32)), ValueError,
     "cu_seqlens_k: has 5 entries but cu_seqlens_q has 4"),
    ("cu_k-strided", dict(cu_seqlens_k=desc((B + 1,), I32, stride=(2,))), ValueError,
     "cu_seqlens_k: the last dimension must be contiguous"),
    # arbitrary masks
    ("func-n-even", dict(FUNC, func=desc((1, 2, L), I32)), ValueError,
     r"func_tensor: n = 2 rows; expected a positive odd n \(F0, then \[F1, F2\)"),
    ("func-n-zero", dict(FUNC, func=desc((1, 0, L), I32)), ValueError, "func_tensor: n = 0 rows"),
    ("func-columns", dict(FUNC, func=desc((1, 3, L - 1), I32)), ValueError,
     rf"func_tensor: L = {L - 1} columns; at least T_q \+ 256 = {L} are required"),
    ("func-columns-for-more-q", dict(FUNC, **dims(D, t_q=2 * T), max_seqlen_q=2 * MAXS,
                                     max_seqlen_k=2 * MAXS),
     ValueError, rf"func_tensor: L = {L} columns; at least T_q \+ 256 = {2 * T + 256}"),
    ("func-dtype", dict(FUNC, func=desc((1, 3, L), I64)), TypeError,
     "func_tensor: dtype int64 is not supported; expected int32"),
    ("func-rank", dict(FUNC, func=desc((3, L), I32)), ValueError,
     r"func_tensor: expected a rank-3 tensor of shape \(1, \*, \*\)"),
    ("func-padded", dict(FUNC, func=desc((1, 3, L), I32, stride=(3 * (L + 8), L + 8, 1))),
     ValueError, "func_tensor: must be contiguous"),
    ("func-with-causal", dict(func=FUNC["func"], window_size=(-1, 0)), ValueError,
     r"func_tensor \(arbitrary mask\) cannot be combined with a window mask: window_size must "
     r"be \(-1, -1\), got \(-1, 0\)"),
    ("func-with-local", dict(func=FUNC["func"], window_size=(4, 4)), ValueError,
     r"got \(4, 4\)"),
    ("func-with-left", dict(func=FUNC["func"], window_size=(8, -1)), ValueError,
     r"got \(8, -1\)"),
    # window
    ("window-below-minus-one", dict(window_size=(-2, 0)), ValueError,
     r"window_size left must be >= -1 \(-1 = unbounded\), got -2"),
    ("window-right-below-minus-one", dict(window_size=(0, -5)), ValueError,
     "window_size right must be >= -1"),
    ("window-int32", dict(window_size=(2**31, 0)), ValueError,
     r"window_size left = 2147483648 must be <= 2\^31 - 1"),
    ("window-right-int32", dict(window_size=(-1, 2**31)), ValueError,
     r"window_size right = 2147483648 must be <= 2\^31 - 1"),
    ("window-float", dict(window_size=(0, 1.5)), ValueError,
     "window_size right must be an int >= -1, got 1.5"),
    ("window-not-a-pair", dict(window_size=(0,)), ValueError,
     r"window_size must be a pair \(left, right\)"),
    # max_seqlen
    ("max_q-above-max_k", dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max_q-too-small", dict(max_seqlen_q=MAXS - 1), ValueError,
     "max_seqlen_q = 15 is too small: 4 sequences hold T_q = 64 tokens"),
    ("max_k-too-small", dict(k=desc((2 * T, HKV, D)), v=desc((2 * T, HKV, D))), ValueError,
     "max_seqlen_k = 16 is too small: 4 sequences hold T_k = 128 tokens"),
    ("max_q-zero-with-tokens", dict(max_seqlen_q=0), ValueError, "max_seqlen_q = 0 is too small"),
    ("max_q-negative", dict(max_seqlen_q=-1), ValueError, "max_seqlen_q must be >= 0, got -1"),
    ("max_k-negative", dict(max_seqlen_k=-5), ValueError, "max_seqlen_k must be >= 0, got -5"),
    ("max_q-float", dict(max_seqlen_q=16.0), TypeError, "max_seqlen_q must be an int, got float"),
    ("max_k-bool", dict(max_seqlen_k=True), TypeError, "max_seqlen_k must be an int, got bool"),
    ("max_k-int32", dict(max_seqlen_k=2**31), ValueError, "max_seqlen_k must be <= 2147483647"),
    # H x ceil(max(max_q, max_k) / rows) x B work tiles fit in int32; rows = 128 for D <= 128
    ("work-tiles-D64", dict(max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((33,), I32),
                            cu_seqlens_k=desc((33,), I32)), ValueError,
     r"max_seqlen_k = 2147483647: H x ceil\(max_seqlen_k / 128\) x B = 2147483648 work tiles "
     r"exceed 2\^31 - 1"),
    # ... and 64 for D = 256
    ("work-tiles-D256", dict(dims(256), max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((17,), I32),
                             cu_seqlens_k=desc((17,), I32)), ValueError,
     r"max_seqlen_k = 2147483647: H x ceil\(max_seqlen_k / 64\) x B = 2147483648 work tiles "
     r"exceed"),
    # alpha and scaling_seqlen
    ("alpha-nan", dict(alpha=math.nan), ValueError, "alpha must be finite, got nan"),
    ("alpha-inf", dict(alpha=math.inf), ValueError, "alpha must be finite, got inf"),
    ("alpha-str", dict(alpha="1"), TypeError, "alpha must be a real number, got str"),
    ("alpha-half-overflow", dict(alpha=1e39), ValueError, "alpha / 2 overflows float32"),
    ("scaling-zero", dict(scaling_seqlen=0), ValueError, "scaling_seqlen must be positive, got 0"),
    ("scaling-negative", dict(scaling_seqlen=-16.0), ValueError,
     "scaling_seqlen must be positive"),
    ("scaling-nan", dict(scaling_seqlen=math.nan), ValueError, "scaling_seqlen must be finite"),
    ("scaling-inverse-overflow", dict(scaling_seqlen=1e-39), ValueError,
     "1 / scaling_seqlen overflows float32"),
    ("alpha-over-scaling-overflow", dict(alpha=3e38, scaling_seqlen=1e-3), ValueError,
     r"alpha / scaling_seqlen = 3(\.\d*)?e\+41 overflows float32"),
    ("negative-alpha-over-scaling-overflow", dict(alpha=-3e38, scaling_seqlen=0.5), ValueError,
     "alpha / scaling_seqlen = -6e\\+38 overflows float32"),
    # an empty batch: the default scaling_seqlen is 1, alpha / 2 fits but alpha does not
    ("alpha-over-default-scaling", dict(alpha=3.4e38 * 1.001, max_seqlen_q=0, max_seqlen_k=0,
                                        **dims(D, t_q=0, t_k=0)),
     ValueError, "alpha / scaling_seqlen = .* overflows float32"),
    # deterministic
    ("deterministic-int", dict(deterministic=1), TypeError,
     "deterministic must be a bool, got int"),
    ("deterministic-none", dict(deterministic=None), TypeError,
     "deterministic must be a bool, got NoneType"),
]


@pytest.mark.parametrize("kw,exc,match", [r[1:] for r in RULES], ids=[r[0] for r in RULES])
def test_rule(kw, exc, match):
    op = bwd(**kw)
    with pytest.raises(exc, match=match):
        op.check_support()
    assert not op._checked


def test_work_tiles_at_the_limit_are_accepted():
    bwd(max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((32,), I32),
        cu_seqlens_k=desc((32,), I32)).check_support()          # 4 x 2^24 x 31 < 2^31
    bwd(**dims(256), max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((16,), I32),
        cu_seqlens_k=desc((16,), I32)).check_support()          # 4 x 2^25 x 15 < 2^31


def test_work_tiles_message_names_max_seqlen_q_when_it_is_the_larger():
    """(The work tiles are checked before max_seqlen_q <= max_seqlen_k.)"""
    op = bwd(max_seqlen_q=INT32_MAX, max_seqlen_k=MAXS, cu_seqlens_q=desc((33,), I32),
             cu_seqlens_k=desc((33,), I32))
    with pytest.raises(ValueError, match=r"^max_seqlen_q = 2147483647: H x ceil\(max_seqlen_q / "
                                         r"128\) x B = 2147483648 work tiles exceed"):
        op.check_support()
    # a tie names max_seqlen_k
    op = bwd(max_seqlen_q=INT32_MAX, max_seqlen_k=INT32_MAX, cu_seqlens_q=desc((33,), I32),
             cu_seqlens_k=desc((33,), I32))
    with pytest.raises(ValueError, match=r"^max_seqlen_k = 2147483647: H x ceil\(max_seqlen_k"):
        op.check_support()


def test_scalar_product_limit_is_backward_only():
    """The forward takes alpha / 2 and 1 / scaling_seqlen separately; the backward also needs
    alpha / scaling_seqlen in float32."""
    fwd = HSTUFwdSm90(desc((T, H, D)), desc((T, HKV, D)), desc((T, HKV, D)), None,
                      desc((B + 1,), I32), desc((B + 1,), I32), MAXS, MAXS, alpha=3e38,
                      scaling_seqlen=1e-3)
    fwd.check_support()
    with pytest.raises(ValueError, match="alpha / scaling_seqlen = .* overflows float32"):
        bwd(alpha=3e38, scaling_seqlen=1e-3).check_support()
    # right at the limit is fine
    op = bwd(alpha=FLOAT32_MAX, scaling_seqlen=1.0).check_support()
    assert op._kernel_scalars(None, None, MAXS) == (FLOAT32_MAX / 2, FLOAT32_MAX, 1.0)


def test_kernel_scalars():
    op = bwd(alpha=0.5).check_support()
    assert op._kernel_scalars(None, None, MAXS) == (0.25, 0.5 / MAXS, 1 / MAXS)
    assert op._kernel_scalars(-4.0, 8.0, MAXS) == (-2.0, -0.5, 0.125)
    assert bwd(scaling_seqlen=10.0)._kernel_scalars(None, None, 99) == (0.5, 0.1, 0.1)
    assert op._kernel_scalars(None, None, 0) == (0.25, 0.5, 1.0)  # max_seqlen_q = 0


def test_compile_checks_first():
    op = bwd(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.compile(arch="sm_90a")
    assert not op.is_compiled
    with pytest.raises(NotImplementedError, match="HSTUBwdSm90 has kernels for sm_90a, not sm_80"):
        bwd().compile(arch="sm_80")


# --- the overlap rule: check_no_overlap and _share_elements -----------------------------------
def test_share_elements_equal_strides():
    x = torch.empty(T, H, 128, dtype=BF)
    assert not _share_elements(x[..., :64], x[..., 64:])     # column halves: disjoint
    assert not _share_elements(x[..., 64:], x[..., :64])     # either order
    assert _share_elements(x[..., :64], x[..., 32:96])       # overlapping columns
    assert _share_elements(x[..., 32:96], x[..., :64])
    assert _share_elements(x, x)
    assert not _share_elements(x[:T // 2], x[T // 2:])       # token halves
    assert _share_elements(x[:T // 2 + 1], x[T // 2:])       # one shared token
    kv = torch.empty(T, 2, H, D, dtype=BF)
    assert not _share_elements(kv[:, 0], kv[:, 1])           # interleaved dk, dv
    assert _share_elements(kv[:, 0], kv[:, 0])


def test_share_elements_different_shapes_same_strides():
    x = torch.empty(T, H, 128, dtype=BF)
    a, b = x[:10, :, :64], x[:, :, 64:]
    assert a.stride() == b.stride() and a.shape != b.shape
    assert not _share_elements(a, b) and not _share_elements(b, a)
    assert _share_elements(x[:10, :, :64], x[5:20, :, :32])  # tokens 5..9, columns 0..31
    assert not _share_elements(x[:, :2, :64], x[:, 2:, :32])  # other heads
    assert _share_elements(x[:, :3, :64], x[:, 2:, :32])      # head 2 in both
    assert not _share_elements(x[:10, :, :64], x[10:12, :, 32:40])  # later tokens only


def test_share_elements_is_conservative_otherwise():
    x = torch.empty(4, 128, dtype=BF)
    a = x[:, :64]
    # b reads only columns 64..127 (disjoint from a) but with other strides: counted as shared
    b = x.as_strided((4, 2, 32), (128, 32, 1), storage_offset=64)
    assert a.stride() != b.stride()
    assert _share_elements(a, b)
    # another element size
    assert _share_elements(a, x.view(torch.int32)[:, 32:])
    # broadcast (stride 0) views
    row = torch.empty(1, 64, dtype=BF)
    assert _share_elements(row.expand(4, 64), row.expand(4, 64))


def test_share_elements_gives_up_conservatively():
    """The bounded search answers True when it runs out of budget."""
    x = torch.empty(40000, dtype=BF)
    a = x.as_strided((64, 64), (8 * 64 + 8, 8), storage_offset=0)
    b = x.as_strided((64, 64), (8 * 64 + 8, 8), storage_offset=4)  # odd column: never shared
    from precast.lifecycle import validation
    assert not validation._offset_reachable(4, [(520, -63, 63), (8, -63, 63)], [4096])
    assert validation._offset_reachable(4, [(520, -63, 63), (8, -63, 63)], [0])
    assert not _share_elements(a, b)


def test_share_elements_is_exact_for_equal_strides():
    """Random equally strided views of one buffer against the brute-force element sets."""
    rng = random.Random(0)
    buf = torch.empty(4096, dtype=BF)
    checked = shared = 0
    for _ in range(1500):
        rank = rng.randint(1, 3)
        stride = tuple(rng.choice([1, 2, 3, 5, 8, 16, 24, 64, 100]) for _ in range(rank))
        shapes = [tuple(rng.randint(1, 5) for _ in range(rank)) for _ in range(2)]
        starts = [rng.randint(0, 200) for _ in range(2)]
        if any(o + 1 + sum((e - 1) * st for e, st in zip(sh, stride)) > buf.numel()
               for sh, o in zip(shapes, starts)):
            continue
        a, b = (buf.as_strided(sh, stride, o) for sh, o in zip(shapes, starts))
        elements = [{o + sum(i * st for i, st in zip(idx, stride))
                     for idx in itertools.product(*(range(e) for e in sh))}
                    for sh, o in zip(shapes, starts)]
        truth = bool(elements[0] & elements[1])
        assert _share_elements(a, b) == truth == _share_elements(b, a), (shapes, stride, starts)
        checked += 1
        shared += truth
    assert checked > 1000 and 0 < shared < checked


def test_check_no_overlap():
    kv = torch.empty(T, 2, H, D, dtype=BF)
    dk, dv = kv[:, 0], kv[:, 1]
    check_no_overlap([("dk", dk), ("dv", dv)], [])
    with pytest.raises(ValueError, match="dk overlaps dv in memory; outputs must not alias each "
                                         "other or the inputs"):
        check_no_overlap([("dk", dk), ("dv", dk)], [])
    x = torch.empty(T, H, 128, dtype=BF)
    check_no_overlap([("a", x[..., :64])], [("b", x[..., 64:])])
    with pytest.raises(ValueError, match="a overlaps b in memory"):
        check_no_overlap([("a", x[..., :64])], [("b", x[..., 32:96])])
    # inputs may alias each other; None and meta tensors never overlap anything
    check_no_overlap([("o", x[..., 64:])], [("i", x[..., :64]), ("j", x[..., :64]), ("n", None),
                                           ("m", meta(T, H, 128))])
    assert byte_range(meta(T, H, D)) is None
    # different strides with overlapping byte ranges: conservatively refused
    with pytest.raises(ValueError, match="a overlaps b"):
        check_no_overlap([("a", x[..., :64])],
                         [("b", x.as_strided((T, H, 2, 32), (H * 128, 128, 32, 1), 64))])
    # different strides, disjoint byte ranges: fine
    y = torch.empty(2 * T * H * 128, dtype=BF)
    check_no_overlap([("a", y[:T * H * 128].view(T, H, 128))],
                     [("b", y[T * H * 128:].view(T * H, 128)[:, :64])])


def relations(**kw):
    """CPU tensors for the relation rule: dq, dk, dv and the inputs, each its own buffer."""
    named = dict(do=torch.empty(T, H, D, dtype=BF), q=torch.empty(T, H, D, dtype=BF),
                 k=torch.empty(T, HKV, D, dtype=BF), v=torch.empty(T, HKV, D, dtype=BF),
                 dq=torch.empty(T, H, D, dtype=BF), dk=torch.empty(T, HKV, D, dtype=BF),
                 dv=torch.empty(T, HKV, D, dtype=BF), cu_seqlens_q=torch.zeros(B + 1, dtype=I32),
                 cu_seqlens_k=torch.zeros(B + 1, dtype=I32), func_tensor=None)
    return {**named, **kw}


def test_relations_accept_disjoint_views_of_one_buffer():
    """check_support and execute share this rule; on a CPU machine the per-tensor rules reject
    CPU tensors first, so the relation rule is called directly."""
    HSTUBwdSm90._check_relations(relations())
    kv = torch.empty(T, 2, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(dk=kv[:, 0], dv=kv[:, 1]))
    # dq, dk, dv as column slices of one (T, H + 2 H_kv, D) gradient buffer
    g = torch.empty(T, H + 2 * HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(dq=g[:, :H], dk=g[:, H:H + HKV], dv=g[:, H + HKV:]))
    # dk, dv beside k, v in one (T, 4, H_kv, D) buffer
    kvg = torch.empty(T, 4, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(k=kvg[:, 0], v=kvg[:, 1], dk=kvg[:, 2], dv=kvg[:, 3]))
    # inputs may alias each other (k = v)
    k = torch.empty(T, HKV, D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(k=k, v=k))
    # column halves of one (T, H, 128) buffer
    x = torch.empty(T, H, 2 * D, dtype=BF)
    HSTUBwdSm90._check_relations(relations(q=x[..., :D], dq=x[..., D:]))


@pytest.mark.parametrize("change,match", [
    (lambda r: dict(dv=r["dk"]), "dk overlaps dv in memory"),
    (lambda r: dict(dq=r["q"]), "dq overlaps q in memory; outputs must not alias"),
    (lambda r: dict(dq=r["do"]), "dq overlaps do in memory"),
    (lambda r: dict(dk=r["k"]), "dk overlaps k in memory"),
    (lambda r: dict(dv=r["v"]), "dv overlaps v in memory"),
    (lambda r: dict(dv=r["k"]), "dv overlaps k in memory"),
    (lambda r: dict(dk=r["dq"][:, :HKV]), "dq overlaps dk in memory"),
    (lambda r: dict(cu_seqlens_q=r["dv"].view(-1).view(I32)[:B + 1]), "dv overlaps cu_seqlens_q"),
    (lambda r: dict(func_tensor=r["dq"].view(-1).view(I32)[:8]), "dq overlaps func_tensor"),
])
def test_relations_refuse_aliasing_outputs(change, match):
    named = relations()
    with pytest.raises(ValueError, match=match):
        HSTUBwdSm90._check_relations({**named, **change(named)})


def test_relations_refuse_overlapping_views():
    kv = torch.empty(T, 2, HKV, D, dtype=BF)
    with pytest.raises(ValueError, match="dk overlaps dv in memory"):
        HSTUBwdSm90._check_relations(relations(dk=kv[:, 0], dv=kv[:, 0]))
    x = torch.empty(T, H, 2 * D, dtype=BF)
    with pytest.raises(ValueError, match="dq overlaps q in memory"):
        HSTUBwdSm90._check_relations(relations(q=x[..., :D], dq=x[..., D // 2:D // 2 + D]))
    buf = torch.empty(2 * T, HKV, D, dtype=BF)
    with pytest.raises(ValueError, match="dk overlaps k in memory"):  # one shared token
        HSTUBwdSm90._check_relations(relations(k=buf[:T], dk=buf[T - 1:2 * T - 1]))


def test_relations_one_device():
    with pytest.raises(ValueError, match="dq is on meta but do is on cpu; all tensors must be "
                                         "on one device"):
        HSTUBwdSm90._check_relations(relations(dq=meta(T, H, D)))


# --- static configuration and cache key -----------------------------------------------------------
STATIC_KEYS = {"dtype", "head_dim", "num_heads", "num_kv_heads", "window_left_bounded",
               "window_right_bounded", "func_intervals", "deterministic"}


def test_static_config_reads_the_samples():
    assert bwd().static_config() == {
        "dtype": "bfloat16", "head_dim": D, "num_heads": H, "num_kv_heads": HKV,
        "window_left_bounded": False, "window_right_bounded": False, "func_intervals": 0,
        "deterministic": False}
    assert set(bwd().static_config()) == STATIC_KEYS
    cfg = bwd(window_size=(7, 0), deterministic=True).static_config()
    assert cfg["window_left_bounded"] is True and cfg["window_right_bounded"] is True
    assert cfg["deterministic"] is True
    assert bwd(**FUNC).static_config()["func_intervals"] == 3
    cfg = bwd(**dims(256, FP, heads=8, kv_heads=1)).static_config()
    assert (cfg["dtype"], cfg["head_dim"], cfg["num_heads"], cfg["num_kv_heads"]) == (
        "float16", 256, 8, 1)


@pytest.mark.parametrize("config", [
    {}, dict(dtype="float16", head_dim=32), dict(head_dim=256),
    dict(head_dim=256, num_heads=8, num_kv_heads=1), dict(num_kv_heads=1),
    dict(window_left_bounded=True), dict(window_left_bounded=True, window_right_bounded=False),
    dict(window_right_bounded=False, func_intervals=1),
    dict(window_right_bounded=False, func_intervals=3), dict(deterministic=True),
    dict(dtype="float16", head_dim=256, deterministic=True, window_right_bounded=False,
         func_intervals=3),
])
def test_from_config_round_trip(config):
    op = HSTUBwdSm90.from_config(**config).check_support()
    cfg = op.static_config()
    assert set(cfg) == STATIC_KEYS
    for key, value in config.items():
        assert cfg[key] == value
    assert HSTUBwdSm90.from_config(**cfg).static_config() == cfg
    (entry,) = expand({"name": "HSTUBwdSm90", **cfg})
    assert dict(entry.config) == cfg
    if cfg["head_dim"] == 256:
        assert op.kernel_modes() == ("dq", "dk", "dv") and not op.fused
    elif cfg["deterministic"]:
        assert op.kernel_modes() == ("dq", "dkdv") and not op.fused
    else:
        assert op.kernel_modes() == FUSED_MODES and op.fused


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_left_bounded=1), TypeError, "window_left_bounded must be a bool, got int"),
    (dict(deterministic=1), TypeError, "deterministic must be a bool, got int"),
    (dict(deterministic="yes"), TypeError, "deterministic must be a bool, got str"),
    (dict(func_intervals=1.0), TypeError, "func_intervals must be an int, got float"),
    (dict(func_intervals=-1), ValueError, "func_intervals must be >= 0, got -1"),
    (dict(dtype="float8"), TypeError, "unknown dtype 'float8'"),
])
def test_from_config_types(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUBwdSm90.from_config(**config)


@pytest.mark.parametrize("config,exc,match", [
    (dict(window_right_bounded=False, func_intervals=2), ValueError, "n = 2 rows"),
    (dict(func_intervals=3), ValueError, "cannot be combined with a window mask"),
    (dict(num_heads=4, num_kv_heads=3), ValueError, "H_kv = 3"),
    (dict(head_dim=80), NotImplementedError, "head dim D = 80"),
    (dict(dtype="float32"), TypeError, "q: dtype float32 is not supported"),
])
def test_from_config_invalid_combinations(config, exc, match):
    with pytest.raises(exc, match=match):
        HSTUBwdSm90.from_config(**config).check_support()


STATIC_CHANGES = {
    "dtype": dims(D, FP),
    "head_dim": dims(128),
    "num_heads": dict(do=desc((T, 2 * H, D)), q=desc((T, 2 * H, D))),
    "num_kv_heads": dict(k=desc((T, 1, D)), v=desc((T, 1, D))),
    "window_left_bounded": dict(window_size=(8, -1)),
    "window_right_bounded": dict(window_size=(-1, 0)),
    "func_intervals": FUNC,
    "deterministic": dict(deterministic=True),
}


@pytest.mark.parametrize("field", sorted(STATIC_CHANGES))
def test_cache_key_changes_with_each_static_field(fixed_sources, field):
    base, changed = bwd(), bwd(**STATIC_CHANGES[field])
    assert key_of(changed) != key_of(base)
    diff = {k for k, v in changed.static_config().items() if base.static_config()[k] != v}
    assert diff == {field}


def test_cache_key_differs_from_the_forward(fixed_sources):
    fwd = HSTUFwdSm90(desc((T, H, D)), desc((T, HKV, D)), desc((T, HKV, D)), None,
                      desc((B + 1,), I32), desc((B + 1,), I32), MAXS, MAXS)
    assert key_of(fwd) != key_of(bwd())


@pytest.mark.parametrize("kw", [
    dict(alpha=0.125), dict(alpha=-3.0), dict(scaling_seqlen=1000.0), dict(scaling_seqlen=1e-3),
    dict(max_seqlen_q=32, max_seqlen_k=64),
    dict(dims(D, t_q=4 * T, t_k=2 * T), max_seqlen_q=64, max_seqlen_k=64),
    dict(cu_seqlens_q=desc((2,), I32), cu_seqlens_k=desc((2,), I32), max_seqlen_q=T,
         max_seqlen_k=T),
    dict(q=desc((T, H, D), stride=(2 * H * D, D + 8, 1)),
         k=desc((T, HKV, D), stride=(D, T * D, 1))),
    dict(dq=desc((T, H, D), alignment=256), dk=desc((T, HKV, D), stride=(2 * HKV * D, D, 1))),
])
def test_cache_key_ignores_runtime_values(fixed_sources, kw):
    assert key_of(bwd(**kw)) == key_of(bwd())


@pytest.mark.parametrize("windows", [[(64, 0), (128, 0)], [(-1, 0), (-1, 7), (-1, 2**31 - 1)],
                                     [(0, 0), (5, 3), (100, 0)], [(3, -1), (0, -1)],
                                     [(-1, -1)]])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cache_key_ignores_window_values(fixed_sources, windows, deterministic):
    keys = {key_of(bwd(window_size=w, deterministic=deterministic)) for w in windows}
    assert len(keys) == 1


def test_cache_key_window_boundedness_and_determinism(fixed_sources):
    assert key_of(bwd(window_size=(64, 0))) == key_of(bwd(window_size=(128, 0)))
    assert key_of(bwd(window_size=(64, 0))) != key_of(bwd(window_size=(-1, 0)))
    assert key_of(bwd(window_size=(64, 0))) != key_of(bwd(window_size=(64, -1)))
    assert key_of(bwd(deterministic=True)) != key_of(bwd(deterministic=False))
    assert key_of(bwd(window_size=(64, 0), deterministic=True)) == key_of(
        bwd(window_size=(128, 0), deterministic=True, alpha=2.0, scaling_seqlen=3.0,
            max_seqlen_q=MAXS * 2, max_seqlen_k=MAXS * 4))


def test_func_intervals_are_static(fixed_sources):
    one = bwd(func=desc((1, 1, L), I32), window_size=(-1, -1))
    three = bwd(**FUNC)
    longer = bwd(func=desc((1, 3, 2 * L), I32), window_size=(-1, -1))
    assert key_of(one) != key_of(three) == key_of(longer)


# --- execute --------------------------------------------------------------------------------------
def meta_args(t_q=T, t_k=T, batch=B, heads=H, kv_heads=HKV, head_dim=D, dtype=BF):
    q_like = lambda: meta(t_q, heads, head_dim, dtype=dtype)  # noqa: E731
    kv_like = lambda: meta(t_k, kv_heads, head_dim, dtype=dtype)  # noqa: E731
    return dict(do=q_like(), q=q_like(), k=kv_like(), v=kv_like(), dq=q_like(), dk=kv_like(),
                dv=kv_like(), cu_seqlens_q=meta(batch + 1, dtype=I32),
                cu_seqlens_k=meta(batch + 1, dtype=I32))


EXECUTE_RULES = [
    # (id, bwd kwargs, changes to meta_args(), exception, match)
    ("do-missing", {}, dict(do=None), ValueError, "do is required"),
    ("dq-missing", {}, dict(dq=None), ValueError, "dq is required"),
    ("dk-missing", {}, dict(dk=None), ValueError, "dk is required"),
    ("dv-missing", {}, dict(dv=None), ValueError, "dv is required"),
    ("k-missing", {}, dict(k=None), ValueError, "k and v are required"),
    ("v-missing", {}, dict(v=None), ValueError, "k and v are required"),
    ("q-missing", {}, dict(q=None), TypeError, "expected a torch.Tensor or TensorDesc"),
    ("heads", {}, dict(q=meta(T, 2 * H, D)), ValueError,
     r"q: extent 8 on axis 1 does not match \(\*, 4, 64\)"),
    ("do-dtype", {}, dict(do=meta(T, H, D, dtype=FP)), TypeError,
     "do: dtype float16 is not supported; expected bfloat16"),
    ("dk-dtype", {}, dict(dk=meta(T, HKV, D, dtype=F32)), TypeError, "dk: dtype float32"),
    ("do-tokens", {}, dict(do=meta(T + 8, H, D)), ValueError, "do: has 72 tokens but q has 64"),
    ("dq-tokens", {}, dict(dq=meta(T - 8, H, D)), ValueError, "dq: has 56 tokens but q has 64"),
    ("dk-tokens", {}, dict(dk=meta(T + 8, HKV, D)), ValueError, "dk: has 72 tokens but k has 64"),
    ("dv-tokens", {}, dict(dv=meta(T + 8, HKV, D)), ValueError, "dv: has 72 tokens but k has 64"),
    ("dv-heads", {}, dict(dv=meta(T, H, D)), ValueError, r"dv: extent 4 on axis 1"),
    ("dq-last-dim-strided", {}, dict(dq=meta(T, H, 2 * D)[:, :, ::2]), ValueError,
     "dq: the last dimension must be contiguous"),
    ("dk-head-stride", {}, dict(dk=meta(T, HKV, D + 4)[:, :, :D]), ValueError,
     "dk: axis-1 stride 68 must be a multiple of 8"),
    ("cu-lengths", {}, dict(cu_seqlens_k=meta(B + 2, dtype=I32)), ValueError,
     "cu_seqlens_k: has 6 entries but cu_seqlens_q has 5"),
    ("cu-dtype", {}, dict(cu_seqlens_q=meta(B + 1, dtype=I64)), TypeError,
     "cu_seqlens_q: dtype int64"),
    ("cpu", {}, dict(dv=torch.zeros(T, HKV, D, dtype=BF)), ValueError, "dv: tensor is on cpu"),
    ("func-given", {}, dict(func_tensor=meta(1, 3, L, dtype=I32)), ValueError,
     "func_tensor must be None: this op applies no arbitrary mask"),
    ("func-missing", FUNC, {}, ValueError,
     r"func_tensor \(1, 3, L\) is required: this op applies an arbitrary mask"),
    ("func-n", FUNC, dict(func_tensor=meta(1, 5, L, dtype=I32)), ValueError,
     r"func_tensor: extent 5 on axis 1 does not match \(1, 3, \*\)"),
    ("func-columns", FUNC, dict(func_tensor=meta(1, 3, L - 1, dtype=I32)), ValueError,
     rf"func_tensor: L = {L - 1} columns; at least T_q \+ 256 = {L}"),
    ("max-seqlen-override", {}, dict(max_seqlen_q=MAXS + 1), ValueError,
     "max_seqlen_q = 17 must be <= max_seqlen_k = 16"),
    ("max-seqlen-for-more-tokens", {}, dict(meta_args(t_q=2 * T)), ValueError,
     "max_seqlen_q = 16 is too small: 4 sequences hold T_q = 128 tokens"),
    ("max-seqlen-k-for-more-tokens", {}, dict(meta_args(t_k=2 * T)), ValueError,
     "max_seqlen_k = 16 is too small: 4 sequences hold T_k = 128 tokens"),
    ("max-seqlen-negative", {}, dict(max_seqlen_k=-1), ValueError, "max_seqlen_k must be >= 0"),
    ("alpha-override", {}, dict(alpha=math.inf), ValueError, "alpha must be finite"),
    ("scaling-override", {}, dict(scaling_seqlen=0.0), ValueError,
     "scaling_seqlen must be positive"),
    ("alpha-over-scaling-override", {}, dict(alpha=3e38, scaling_seqlen=1e-3), ValueError,
     "alpha / scaling_seqlen = .* overflows float32"),
]


@pytest.mark.parametrize("op_kw,changes,exc,match", [r[1:] for r in EXECUTE_RULES],
                         ids=[r[0] for r in EXECUTE_RULES])
def test_execute_refuses(op_kw, changes, exc, match):
    op = bwd(**op_kw).check_support()
    with pytest.raises(exc, match=match):
        op.execute(**{**meta_args(), **changes})


@pytest.fixture
def launches(monkeypatch):
    """conftest.record_launches for HSTUBwdSm90 (its workspace is made by torch.zeros)."""
    return record_launches(monkeypatch, bwd_module, lambda op: op.kernel_modes(), "zeros")

# The arguments of every backward kernel (HstuAttentionBackwardSm90) and of dq_finish
# (DqFinishSm90), in order.
KERNEL_ARGS = ("q", "k", "v", "do", "grad_a", "grad_b", "dq_acc", "dq", "sync", "cu_seqlens_q",
               "cu_seqlens_k", "func", "longest", "compact", "convert", "pair_group",
               "max_seqlen_q",
               "left", "right", "half_alpha", "scale_ds", "scale_p", "stream")
FINISH_ARGS = ("dq_acc", "dq", "sync", "cu_seqlens_q", "pair_group", "max_seqlen_q", "stream")
SCALARS = KERNEL_ARGS[KERNEL_ARGS.index("longest"):]


def named_args(mode, call):
    """A recorded launch's arguments by name (and exactly as many as the kernel takes)."""
    names = FINISH_ARGS if mode == "dq_finish" else KERNEL_ARGS
    assert len(call) == len(names), (mode, len(call))
    return dict(zip(names, call))


def launched(rec):
    """[(mode, arguments by name)] of the recorded launches."""
    return [(mode, named_args(mode, call)) for mode, call in rec.calls]


def scalars(args):
    return tuple(args[n] for n in SCALARS)


def word_rows(t, ws):
    """(first, end): the rows of the float32 (rows, H, D) buffer ws whose bytes the int32
    words t are (a compact view of whole rows), else None."""
    row = ws.shape[1] * ws.shape[2] * 4
    if not isinstance(t, torch.Tensor) or t.dtype != I32 or t.dim() != 1 \
            or not t.is_contiguous() or t.device != ws.device \
            or t.untyped_storage().data_ptr() != ws.untyped_storage().data_ptr():
        return None
    offset, size = t.data_ptr() - ws.data_ptr(), t.numel() * 4
    if offset < 0 or offset % row or size % row or offset + size > ws.shape[0] * row:
        return None
    return offset // row, (offset + size) // row


def is_dq_acc(t, ws, t_q):
    """t is the accumulator: the first t_q rows of the workspace ws."""
    return (t.dtype == F32 and tuple(t.shape) == (t_q,) + tuple(ws.shape[1:])
            and t.stride() == ws.stride() and t.data_ptr() == ws.data_ptr()
            and t.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr())


def trace(rec, **named):
    """rec.events with each tensor replaced by its name in ``named``, 'name[:n]' for a view
    of the first n rows of a named tensor, or 'name[a:b] words' for the int32 sync words over
    its rows a..b-1."""
    def name(t):
        for key, u in named.items():
            if t is u:
                return key
        for key, u in named.items():
            if isinstance(u, torch.Tensor) and t._base is u and t.data_ptr() == u.data_ptr() \
                    and t.stride() == u.stride():
                return f"{key}[:{t.shape[0]}]"
        for key, u in named.items():
            if isinstance(u, torch.Tensor) and u.dtype == F32 and u.dim() == 3 \
                    and word_rows(t, u) is not None:
                return "{}[{}:{}] words".format(key, *word_rows(t, u))
        return f"unnamed {tuple(t.shape)}"
    return [tuple(name(x) if isinstance(x, torch.Tensor) else x for x in e) for e in rec.events]


def kinds(rec):
    return [e[0] for e in rec.events]


def finish_like_the_kernel(args):
    """dq_finish's effect (the fused kernel converts some slices, dq_finish the rest; here
    all): dq = the accumulator, then the accumulator and the sync words zero. (Not through
    copy_ / zero_: those events are the host's.)"""
    dq_acc, dq, sync = args[:3]
    dq[...] = dq_acc
    dq_acc.fill_(0.0)
    sync.fill_(0)


def test_execute_launch_arguments_not_fused(launches):
    """deterministic=True (D <= 128): the dq and the dkdv kernel."""
    op = bwd(window_size=(16, 0), alpha=0.5, deterministic=True).check_support()
    assert not op.fused
    a = meta_args()
    op.execute(**a, stream=7)
    assert [mode for mode, _ in launches.calls] == ["dq", "dkdv"]
    (_, dq_call), (_, dkdv_call) = launched(launches)
    inputs = ("q", "k", "v", "do")
    assert all(dq_call[n] is a[n] and dkdv_call[n] is a[n] for n in inputs)
    assert dq_call["grad_a"] is a["dq"] and dq_call["grad_b"] is None
    assert dkdv_call["grad_a"] is a["dk"] and dkdv_call["grad_b"] is a["dv"]
    # no accumulator, no dq for a conversion, no sync words
    assert all(call[n] is None for call in (dq_call, dkdv_call)
               for n in ("dq_acc", "dq", "sync", "func"))
    assert all(call["cu_seqlens_q"] is a["cu_seqlens_q"]
               and call["cu_seqlens_k"] is a["cu_seqlens_k"] for call in (dq_call, dkdv_call))
    # longest, compact, pair_group, max_seqlen_q, left, right, alpha / 2,
    # alpha / scaling_seqlen, 1 / scaling_seqlen, stream. B = 4 sequences of one 128-row tile
    # each: dense numbering; every (sequence, head) pair in one L2 group (H x B = 16 pairs
    # with the queries fixed, H_kv x B = 8 with the keys fixed).
    assert scalars(dq_call) == (MAXS, 0, 0, 16, MAXS, 16, 0, 0.25, 0.5 / MAXS, 1 / MAXS, 7)
    assert scalars(dkdv_call) == (MAXS, 0, 0, 8, MAXS, 16, 0, 0.25, 0.5 / MAXS, 1 / MAXS, 7)
    assert (dq_call["compact"], dq_call["pair_group"]) == Launch.plan(D, H, T, B, MAXS, BIG)
    assert (dkdv_call["compact"], dkdv_call["pair_group"]) == Launch.plan(D, HKV, T, B, MAXS,
                                                                          BIG)
    # the kernels write dq themselves: no workspace, no copy, no memset
    assert kinds(launches) == ["launch", "launch"]
    assert op._workspaces == {} and launches.capture_queries == []
    # runtime values: another batch, alpha, scaling and max_seqlen, without a new op
    launches.calls.clear()
    op.execute(**meta_args(t_q=3 * T, t_k=5 * T, batch=2 * B), stream=7, alpha=-3.0,
               scaling_seqlen=4.0, max_seqlen_q=40, max_seqlen_k=80)
    (_, dq_call), (_, dkdv_call) = launched(launches)
    assert scalars(dq_call) == (40, 0, 0, 32, 40, 16, 0, -1.5, -0.75, 0.25, 7)    # dq: max_q
    assert scalars(dkdv_call) == (80, 0, 0, 16, 40, 16, 0, -1.5, -0.75, 0.25, 7)  # dk, dv: max_k
    # a jagged batch (4 sequences of 64 tokens in all, max_seqlen 1024: 8 tiles per head and
    # sequence, at most one of them with rows): compact numbering, for each kernel
    launches.calls.clear()
    op.execute(**a, stream=7, max_seqlen_q=JAGGED, max_seqlen_k=JAGGED)
    (_, dq_call), (_, dkdv_call) = launched(launches)
    assert scalars(dq_call)[:5] == (JAGGED, 1, 0, 16, JAGGED)
    assert scalars(dkdv_call)[:5] == (JAGGED, 1, 0, 8, JAGGED)
    assert kinds(launches) == ["launch"] * 6  # no torch pass in any of the three calls


def test_execute_launch_arguments_fused(launches):
    """The default (deterministic=False, D <= 128), a dense batch: the fused kernel, then
    dq_finish with the same accumulator, dq, sync words and L2 groups (a local window wide
    enough for the kernel to convert: 640 + 128 = MIN_CONVERT_STREAM_ROWS)."""
    op = bwd(window_size=(640, 0), alpha=0.5).check_support()
    assert op.fused
    a = meta_args()
    op.execute(**a, stream=7)
    assert [mode for mode, _ in launches.calls] == ["fused", "dq_finish"]
    (_, call), (_, finish) = launched(launches)
    assert all(call[n] is a[n] for n in ("q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"))
    assert call["grad_a"] is a["dk"] and call["grad_b"] is a["dv"] and call["func"] is None
    assert call["dq"] is a["dq"]  # the kernel converts dQ slices into dq itself
    ws = op._workspaces[(None, 7)]  # (device index, stream): meta tensors have no index
    assert ws.dtype == F32 and tuple(ws.shape) == (WS, H, D) and ws.is_contiguous()
    # the first T_q rows: the accumulator; the row after: H x D int32 sync words
    assert call["dq_acc"]._base is ws and is_dq_acc(call["dq_acc"], ws, T)
    assert word_rows(call["sync"], ws) == (T, WS) and call["sync"].numel() == H * D
    # key tiles fixed: max_k; dense; H_kv x B = 8 pairs in one L2 group; max_seqlen_q
    assert scalars(call) == (MAXS, 0, 1, 8, MAXS, 640, 0, 0.25, 0.5 / MAXS, 1 / MAXS, 7)
    assert (call["compact"], call["pair_group"]) == Launch.plan(
        D, HKV, T, B, MAXS, sync_group_capacity(H * D))
    # dq_finish: the rest of the conversion, with what the fused kernel had
    assert finish["dq_acc"] is call["dq_acc"] and finish["dq"] is a["dq"]
    assert finish["sync"] is call["sync"] and finish["cu_seqlens_q"] is a["cu_seqlens_q"]
    assert (finish["pair_group"], finish["max_seqlen_q"], finish["stream"]) == (8, MAXS, 7)
    # made zeroed on the stream; then the two kernels and no torch pass (dq_finish converts)
    assert trace(launches, ws=ws, **a) == [
        ("stream", 7, None), ("zeros", (WS, H, D), F32), ("end stream",),
        ("launch", "fused"), ("launch", "dq_finish")]
    # runtime values: the fused kernel takes max_seqlen_k, and max_seqlen_q for the slices
    launches.calls.clear()
    b = meta_args(t_q=3 * T, t_k=5 * T, batch=2 * B)
    op.execute(**b, stream=7, alpha=-3.0, scaling_seqlen=4.0, max_seqlen_q=40, max_seqlen_k=80)
    (_, call), (_, finish) = launched(launches)
    assert call["grad_a"] is b["dk"] and call["grad_b"] is b["dv"] and call["dq"] is b["dq"]
    ws = op._workspaces[(None, 7)]  # grown to 3 T + 1 rows
    assert is_dq_acc(call["dq_acc"], ws, 3 * T) and word_rows(call["sync"], ws) == (3 * T,
                                                                                   3 * T + 1)
    assert scalars(call) == (80, 0, 1, 16, 40, 640, 0, -1.5, -0.75, 0.25, 7)
    assert finish["dq_acc"] is call["dq_acc"] and finish["dq"] is b["dq"]
    assert finish["sync"] is call["sync"]
    assert (finish["pair_group"], finish["max_seqlen_q"], finish["stream"]) == (16, 40, 7)


@pytest.mark.parametrize("window,converts", [
    ((-1, 0), True), ((-1, -1), True), ((0, -1), True), ((5000, 3), True),
    ((640, 0), True), ((639, 0), False), ((320, 320), True), ((320, 319), False),
    ((16, 0), False), ((0, 0), False), ((256, 0), False)])
def test_converts_in_kernel(window, converts):
    """The fused kernel converts dQ itself behind dense numbering unless the window is
    bounded on both sides and narrow: left + right + 128 < MIN_CONVERT_STREAM_ROWS = 768
    (the key tile's rows at D <= 128); jagged batches never."""
    assert bwd_module.MIN_CONVERT_STREAM_ROWS == 768
    dense, jagged = Launch(0, 8), Launch(1, 8)
    for head_dim in (32, 64, 128):
        assert bwd_module.converts_in_kernel(dense, window, head_dim) is converts
        assert bwd_module.converts_in_kernel(jagged, window, head_dim) is False


@pytest.mark.parametrize("given", [True, False], ids=["given-workspace", "own-workspace"])
def test_execute_fused_narrow_window_converts_with_torch(launches, given):
    """A dense batch under a narrow local window (16, 0): the fused kernel told not to
    convert (convert = 0), then dq <- accumulator and a memset of it on the stream; no
    dq_finish."""
    op = bwd(window_size=(16, 0)).check_support()
    a = meta_args()
    ws = meta(*op.workspace_shape(T), dtype=F32) if given else None
    op.execute(**a, stream=7, workspace=ws)
    ws = ws if given else op._workspaces[(None, 7)]
    ((mode, call),) = launched(launches)
    assert mode == "fused" and (call["compact"], call["convert"]) == (0, 0)
    assert call["dq"] is a["dq"] and is_dq_acc(call["dq_acc"], ws, T)
    made = [] if given else [("stream", 7, None), ("zeros", (WS, H, D), F32), ("end stream",)]
    assert trace(launches, ws=ws, **a) == made + [
        ("launch", "fused"),
        ("stream", 7, None), ("copy", "dq", f"ws[:{T}]"), ("zero", f"ws[:{T}]"),
        ("end stream",)]


@pytest.mark.parametrize("given", [True, False], ids=["given-workspace", "own-workspace"])
def test_execute_fused_jagged_batch_converts_with_torch(launches, given):
    """A jagged batch (compact numbering: no L2 groups for the kernel's idle warps to convert
    behind): the fused kernel, then dq <- accumulator and a memset of it on the stream; no
    dq_finish. A dense batch: dq_finish, no torch pass."""
    op = bwd().check_support()
    a = meta_args()
    ws = meta(*op.workspace_shape(T), dtype=F32) if given else None
    op.execute(**a, stream=7, workspace=ws, max_seqlen_q=JAGGED, max_seqlen_k=JAGGED)
    ws = ws if given else op._workspaces[(None, 7)]
    ((mode, call),) = launched(launches)
    assert mode == "fused"
    # 8 tiles per head and sequence, at most one with rows: (0 + 4) x 2 <= 8 x 4
    assert (call["compact"], call["convert"], call["pair_group"]) == (1, 0, 8)
    assert (call["longest"], call["max_seqlen_q"]) == (JAGGED, JAGGED)
    assert call["dq"] is a["dq"] and is_dq_acc(call["dq_acc"], ws, T)
    assert word_rows(call["sync"], ws) == (T, WS)  # passed, but only dense numbering uses it
    made = [] if given else [("stream", 7, None), ("zeros", (WS, H, D), F32), ("end stream",)]
    assert trace(launches, ws=ws, **a) == made + [
        ("launch", "fused"),
        ("stream", 7, None), ("copy", "dq", f"ws[:{T}]"), ("zero", f"ws[:{T}]"),
        ("end stream",)]
    # the same op, a dense batch: dq_finish and no copy
    launches.events.clear()
    launches.calls.clear()
    op.execute(**a, stream=7, workspace=ws if given else None)
    assert [mode for mode, _ in launches.calls] == ["fused", "dq_finish"]
    assert launched(launches)[0][1]["compact"] == 0
    assert trace(launches, ws=ws, **a) == [("launch", "fused"), ("launch", "dq_finish")]


def test_execute_fused_with_a_workspace(launches):
    op = bwd().check_support()
    assert op.fused
    a = meta_args()
    ws = meta(*op.workspace_shape(T), dtype=F32)
    op.execute(**a, stream=3, workspace=ws)
    (mode, call), (_, finish) = launched(launches)
    assert mode == "fused" and call["dq_acc"]._base is ws and is_dq_acc(call["dq_acc"], ws, T)
    assert word_rows(call["sync"], ws) == (T, WS)
    assert call["grad_a"] is a["dk"] and call["grad_b"] is a["dv"] and call["dq"] is a["dq"]
    assert finish["dq_acc"] is call["dq_acc"] and finish["sync"] is call["sync"]
    assert trace(launches, ws=ws, **a) == [("launch", "fused"), ("launch", "dq_finish")]
    # nothing allocated, no capture query: a given workspace also serves while capturing
    assert op._workspaces == {} and launches.capture_queries == []
    launches.capturing = True
    op.execute(**a, stream=3, workspace=ws)
    assert launches.calls[-2][1][6]._base is ws and launches.calls[-1][1][0]._base is ws
    assert op._workspaces == {} and launches.capture_queries == []
    # sized for this call's T_q
    ws3 = meta(3 * T + 1, H, D, dtype=F32)
    op.execute(**meta_args(t_q=3 * T), stream=3, workspace=ws3, max_seqlen_q=3 * MAXS,
               max_seqlen_k=3 * MAXS)
    (_, call), (_, finish) = launched(launches)[-2:]
    assert is_dq_acc(call["dq_acc"], ws3, 3 * T) and finish["dq_acc"] is call["dq_acc"]
    assert word_rows(call["sync"], ws3) == (3 * T, 3 * T + 1) and finish["sync"] is call["sync"]


def test_execute_sync_words_hold_every_group(launches):
    """The fused kernel keeps two int32 words per L2 group and two more in the rows after the
    accumulator: for many batches (T_q, B, max_seqlen, H, H_kv, D), execute never plans more
    groups than the sync words of workspace_shape(T_q) hold (2 x groups + 2 <= words, words =
    sync_rows(T_q) x H x D), raising pair_group where the L2 choice would; dq_finish (dense
    batches) gets the same groups."""
    ops = {}
    cases = bound = dense = 0
    for t_q, batch, max_seqlen, (heads, kv_heads), head_dim in itertools.product(
            [1, 100, 32767, 32768, 65535, 10**6], [1, 7, 1000, 100000, 10**6],
            [None, 4096, 65536], [(1, 1), (4, 2), (16, 1), (8, 8)], [32, 64, 128]):
        if max_seqlen is None:  # the shortest allowed: most sequences full (dense)
            max_seqlen = max(-(-t_q // batch), 1)
        tiles = -(-max_seqlen // fixed_rows(head_dim))
        if max_seqlen * batch < t_q or heads * tiles * batch > INT32_MAX:
            continue
        key = (heads, kv_heads, head_dim)
        if key not in ops:
            ops[key] = bwd(**dims(head_dim, heads=heads, kv_heads=kv_heads)).check_support()
        op = ops[key]
        ws = meta(*op.workspace_shape(t_q), dtype=F32)
        launches.calls.clear()
        op.execute(**meta_args(t_q=t_q, t_k=t_q, batch=batch, heads=heads, kv_heads=kv_heads,
                               head_dim=head_dim),
                   stream=1, workspace=ws, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)
        calls = launched(launches)
        mode, call = calls[0]
        assert mode == "fused"
        words = call["sync"].numel()
        assert words == sync_rows(t_q) * heads * head_dim
        assert word_rows(call["sync"], ws) == (t_q, ws.shape[0])
        plan = Launch(call["compact"], call["pair_group"])
        assert plan == Launch.plan(head_dim, kv_heads, t_q, batch, max_seqlen,
                                   sync_group_capacity(words))
        groups = plan.groups(kv_heads, batch)
        assert groups == -(-kv_heads * batch // plan.pair_group)
        assert 2 * groups + SYNC_EXTRA_WORDS <= words, (t_q, batch, max_seqlen, key, plan)
        chosen = l2_pair_group(head_dim, tiles, kv_heads * batch)
        assert plan.pair_group >= chosen  # the bound only makes groups larger
        bound += plan.pair_group > chosen
        if plan.compact:
            assert len(calls) == 1
        else:
            ((finish_mode, finish),) = calls[1:]
            assert finish_mode == "dq_finish" and finish["pair_group"] == plan.pair_group
            assert finish["sync"] is call["sync"] and finish["max_seqlen_q"] == max_seqlen
            dense += 1
        cases += 1
    assert cases > 500 and bound > 10 and 0 < dense < cases


WORKSPACE_RULES = [
    # (id, workspace for meta_args() with the default (fused) op, exception, match);
    # workspace_shape(64) = (65, 4, 64)
    ("dtype-bf16", meta(WS, H, D), TypeError,
     "workspace: dtype bfloat16 is not supported; expected float32"),
    ("dtype-fp64", meta(WS, H, D, dtype=torch.float64), TypeError, "workspace: dtype float64"),
    ("dtype-int32", meta(WS, H, D, dtype=I32), TypeError, "workspace: dtype int32"),
    ("more-tokens", meta(T + 8, H, D, dtype=F32), ValueError,
     r"workspace: extent 72 on axis 0 does not match \(65, 4, 64\)"),
    ("fewer-tokens", meta(T - 8, H, D, dtype=F32), ValueError,
     r"workspace: extent 56 on axis 0 does not match \(65, 4, 64\)"),
    # the accumulator alone (the shape before the sync words): no room for them
    ("no-sync-rows", meta(T, H, D, dtype=F32), ValueError,
     r"workspace: extent 64 on axis 0 does not match \(65, 4, 64\)"),
    ("kv-heads", meta(WS, HKV, D, dtype=F32), ValueError,
     r"workspace: extent 2 on axis 1 does not match \(65, 4, 64\)"),
    ("head-dim", meta(WS, H, 2 * D, dtype=F32), ValueError, "workspace: extent 128 on axis 2"),
    ("flat", meta(WS * H * D, dtype=F32), ValueError,
     r"workspace: expected a rank-3 tensor of shape \(65, 4, 64\)"),
    ("not-fused-shape", meta(0, dtype=F32), ValueError, "workspace: expected a rank-3 tensor"),
    ("padded-heads", meta(WS, H, 2 * D, dtype=F32)[..., :D], ValueError,
     r"workspace: must be contiguous \(strides \[256, 64, 1\]\), got strides \[512, 128, 1\]"),
    ("padded-tokens", meta(WS, H + 1, D, dtype=F32)[:, :H], ValueError,
     r"workspace: must be contiguous \(strides \[256, 64, 1\]\), got strides \[320, 64, 1\]"),
    ("heads-major", meta(H, WS, D, dtype=F32).transpose(0, 1), ValueError,
     "workspace: must be contiguous"),
    ("broadcast-tokens", meta(1, H, D, dtype=F32).expand(WS, H, D), ValueError,
     r"workspace: must be contiguous \(strides \[256, 64, 1\]\), got strides \[0, 64, 1\]"),
    ("last-dim-strided", meta(WS, H, 2 * D, dtype=F32)[..., ::2], ValueError,
     r"workspace: the last dimension must be contiguous \(stride 1\)"),
    ("4-byte-aligned", meta(WS * H * D + 1, dtype=F32)[1:].view(WS, H, D), ValueError,
     "workspace: base address is 4-byte aligned; 16-byte alignment is required"),
    ("8-byte-aligned", meta(WS * H * D + 2, dtype=F32)[2:].view(WS, H, D), ValueError,
     "workspace: base address is 8-byte aligned"),
    ("cpu", torch.zeros(WS, H, D, dtype=F32), ValueError,
     "workspace: tensor is on cpu; expected a cuda tensor"),
    ("not-a-tensor", [[0.0]], TypeError, "expected a torch.Tensor or TensorDesc, got list"),
]


@pytest.mark.parametrize("workspace,exc,match", [r[1:] for r in WORKSPACE_RULES],
                         ids=[r[0] for r in WORKSPACE_RULES])
def test_execute_refuses_bad_workspaces(launches, workspace, exc, match):
    op = bwd().check_support()
    with pytest.raises(exc, match=match):
        op.execute(**meta_args(), stream=1, workspace=workspace)
    # refused before anything runs, and not replaced by an own workspace
    assert launches.events == [] and op._workspaces == {}


def test_execute_workspace_is_sized_for_this_calls_t_q(launches):
    op = bwd().check_support()
    with pytest.raises(ValueError, match=r"workspace: extent 65 on axis 0 does not match "
                                         r"\(129, 4, 64\)"):
        op.execute(**meta_args(t_q=2 * T), stream=1, workspace=meta(WS, H, D, dtype=F32),
                   max_seqlen_q=2 * MAXS, max_seqlen_k=2 * MAXS)
    assert launches.events == []
    # (16-byte aligned offsets into a larger buffer are fine)
    ws = meta(WS * H * D + 4, dtype=F32)[4:].view(WS, H, D)
    op.execute(**meta_args(), stream=1, workspace=ws)
    (_, call), (_, finish) = launched(launches)
    assert is_dq_acc(call["dq_acc"], ws, T) and word_rows(call["sync"], ws) == (T, WS)
    assert finish["dq_acc"] is call["dq_acc"] and finish["sync"] is call["sync"]


@pytest.mark.parametrize("kw,modes", [
    (dict(deterministic=True), ("dq", "dkdv")),
    (dict(dims(128), deterministic=True), ("dq", "dkdv")),
    (dims(256), ("dq", "dk", "dv")),  # never fused at D = 256
    (dict(dims(256), deterministic=True), ("dq", "dk", "dv")),
], ids=["deterministic", "d128-deterministic", "d256", "d256-deterministic"])
@pytest.mark.parametrize("workspace", [meta(T, H, D, dtype=F32), meta(3, dtype=BF),
                                       torch.zeros(T, H, D, dtype=F32)],
                         ids=["fused-shape", "invalid", "cpu"])
def test_execute_ignores_the_workspace_when_not_fused(launches, kw, modes, workspace):
    op = bwd(**kw).check_support()
    assert not op.fused
    op.execute(**meta_args(head_dim=op.head_dim), stream=2, workspace=workspace)
    assert tuple(mode for mode, _ in launches.calls) == modes
    assert all(call[n] is None for _, call in launched(launches) for n in ("dq_acc", "dq", "sync"))
    assert kinds(launches) == ["launch"] * len(modes)  # no copy, no memset
    assert op._workspaces == {} and launches.capture_queries == []


# --- the op's own workspace -----------------------------------------------------------------------
def test_own_workspace_made_on_first_use_then_reused(launches):
    op = bwd().check_support()
    assert op._workspaces == {}
    op.execute(**meta_args(), stream=7)
    ws = op._workspaces[(None, 7)]
    assert list(op._workspaces) == [(None, 7)]
    assert ws.dtype == F32 and tuple(ws.shape) == (WS, H, D) == op.workspace_shape(T)
    assert launches.capture_queries == [7]  # asked before allocating
    # again, and with fewer query tokens: the same buffer (a view of its first rows), no new
    # allocation and no capture query
    launches.events.clear()
    launches.calls.clear()
    a = meta_args()
    op.execute(**a, stream=7)
    b = meta_args(t_q=T // 2)
    op.execute(**b, stream=7)
    assert list(op._workspaces) == [(None, 7)] and op._workspaces[(None, 7)] is ws
    (_, first), (_, first_finish), (_, second), (_, second_finish) = launched(launches)
    assert first["dq_acc"]._base is ws and is_dq_acc(first["dq_acc"], ws, T)
    assert second["dq_acc"]._base is ws and is_dq_acc(second["dq_acc"], ws, T // 2)
    # the sync words follow this call's accumulator: rows T / 2 .. T / 2 + 1 - 1
    assert word_rows(first["sync"], ws) == (T, WS)
    assert word_rows(second["sync"], ws) == (T // 2, T // 2 + 1)
    assert first_finish["sync"] is first["sync"] and second_finish["sync"] is second["sync"]
    assert launches.capture_queries == [7]
    assert trace(launches, ws=ws, dq=a["dq"], dq_b=b["dq"]) == [
        ("launch", "fused"), ("launch", "dq_finish"),
        ("launch", "fused"), ("launch", "dq_finish")]
    # a jagged batch with fewer tokens: the torch conversion of the first T / 2 rows
    launches.events.clear()
    op.execute(**b, stream=7, max_seqlen_q=JAGGED, max_seqlen_k=JAGGED)
    half = f"ws[:{T // 2}]"
    assert trace(launches, ws=ws, dq_b=b["dq"]) == [
        ("launch", "fused"), ("stream", 7, None), ("copy", "dq_b", half), ("zero", half),
        ("end stream",)]


def test_own_workspace_grows_with_t_q(launches):
    op = bwd().check_support()
    op.execute(**meta_args(), stream=7)
    small = op._workspaces[(None, 7)]
    op.execute(**meta_args(t_q=2 * T), stream=7, max_seqlen_q=2 * MAXS, max_seqlen_k=2 * MAXS)
    big = op._workspaces[(None, 7)]
    assert big is not small and list(op._workspaces) == [(None, 7)]
    # remade with max(rows, twice as many): 2 x 65 rows for 2 T + 1
    assert tuple(big.shape) == (2 * WS, H, D) and big.dtype == F32
    (_, call), (_, finish) = launched(launches)[-2:]
    assert call["dq_acc"]._base is big and is_dq_acc(call["dq_acc"], big, 2 * T)
    assert word_rows(call["sync"], big) == (2 * T, 2 * T + 1) and finish["sync"] is call["sync"]
    assert [e[1] for e in launches.events if e[0] == "zeros"] == [(WS, H, D), (2 * WS, H, D)]
    assert launches.capture_queries == [7, 7]
    # fewer tokens again: the grown one serves
    op.execute(**meta_args(), stream=7)
    assert op._workspaces[(None, 7)] is big
    (_, call), _ = launched(launches)[-2:]
    assert call["dq_acc"]._base is big and is_dq_acc(call["dq_acc"], big, T)
    assert word_rows(call["sync"], big) == (T, WS)
    assert kinds(launches).count("zeros") == 2 and launches.capture_queries == [7, 7]


def test_own_workspace_per_stream(launches):
    op = bwd().check_support()
    op.execute(**meta_args(), stream=7)
    op.execute(**meta_args(), stream=8)
    op.execute(**meta_args(), stream=7)
    assert set(op._workspaces) == {(None, 7), (None, 8)}
    ws7, ws8 = op._workspaces[(None, 7)], op._workspaces[(None, 8)]
    assert ws7 is not ws8
    assert [mode for mode, _ in launches.calls] == list(FUSED_MODES) * 3
    fused = [call for mode, call in launched(launches) if mode == "fused"]
    finish = [call for mode, call in launched(launches) if mode == "dq_finish"]
    for call, done, ws, stream in zip(fused, finish, (ws7, ws8, ws7), (7, 8, 7)):
        assert call["dq_acc"]._base is ws and word_rows(call["sync"], ws) == (T, WS)
        assert done["sync"] is call["sync"] and call["stream"] == done["stream"] == stream
    # each made in its own stream's order
    events = launches.events
    made_on = [events[i - 1][1] for i, e in enumerate(events) if e[0] == "zeros"]
    assert made_on == [7, 8]
    # and separate ops keep separate workspaces
    other = bwd().check_support()
    other.execute(**meta_args(), stream=7)
    assert other._workspaces[(None, 7)] is not ws7


def test_own_workspace_is_made_on_the_ops_device_in_stream_order(launches):
    op = bwd(**dims(128, heads=8, kv_heads=1)).check_support()
    view = op._own_workspace(1, 99, 40)
    ws = op._workspaces[(1, 99)]
    # workspace_shape(40): 40 accumulator rows and one of sync words
    assert view._base is ws and tuple(view.shape) == (41, 8, 128) == op.workspace_shape(40)
    assert launches.alloc_devices == ["cuda:1"]
    assert launches.events == [("stream", 99, 1), ("zeros", (41, 8, 128), F32), ("end stream",)]
    assert launches.capture_queries == [99]
    assert op._own_workspace(1, 99, 40)._base is ws
    assert op._own_workspace(1, 99, 0).shape[0] == 1  # the sync words still
    assert launches.alloc_devices == ["cuda:1"]  # reused
    op._own_workspace(0, 99, 40)  # another device: its own
    assert launches.alloc_devices == ["cuda:1", "cuda:0"]
    assert set(op._workspaces) == {(1, 99), (0, 99)}


def test_own_workspace_refused_while_capturing(launches):
    op = bwd().check_support()
    launches.capturing = True
    with pytest.raises(RuntimeError, match=r"^HSTUBwdSm90\.execute: the stream is capturing a "
                       r"CUDA graph and this op has no workspace of 64 rows for it; pass "
                       r"workspace= \(float32, shape workspace_shape\(64\), zeroed\)"):
        op.execute(**meta_args(), stream=7)
    assert launches.calls == [] and op._workspaces == {} and launches.capture_queries == [7]
    assert "zeros" not in kinds(launches)
    # made before the capture: reused while capturing ...
    launches.capturing = False
    op.execute(**meta_args(), stream=7)
    ws = op._workspaces[(None, 7)]
    launches.capturing = True
    op.execute(**meta_args(t_q=T // 2), stream=7)
    op.execute(**meta_args(), stream=7)
    assert [mode for mode, _ in launches.calls] == list(FUSED_MODES) * 3
    assert all(call["dq_acc"]._base is ws for mode, call in launched(launches)
               if mode == "fused")
    # ... but not grown (the old buffer stays)
    with pytest.raises(RuntimeError, match="capturing a CUDA graph.*no workspace of 128 rows"):
        op.execute(**meta_args(t_q=2 * T), stream=7, max_seqlen_q=2 * MAXS,
                   max_seqlen_k=2 * MAXS)
    assert op._workspaces[(None, 7)] is ws and len(launches.calls) == 6
    # another capturing stream has none yet
    with pytest.raises(RuntimeError, match="workspace"):
        op.execute(**meta_args(), stream=8)
    assert set(op._workspaces) == {(None, 7)}
    assert kinds(launches).count("zeros") == 1
    # a given workspace needs no own one
    ws8 = meta(*op.workspace_shape(T), dtype=F32)
    op.execute(**meta_args(), stream=8, workspace=ws8)
    (_, call), (_, finish) = launched(launches)[-2:]
    assert call["dq_acc"]._base is ws8 and finish["sync"] is call["sync"]
    assert word_rows(call["sync"], ws8) == (T, WS) and set(op._workspaces) == {(None, 7)}


def test_own_workspace_not_needed_when_not_fused(launches):
    launches.capturing = True  # would refuse to allocate
    for kw in [dict(deterministic=True), dict(dims(32), deterministic=True), dims(256),
               dict(dims(256), deterministic=True)]:
        op = bwd(**kw).check_support()
        assert not op.fused
        op.execute(**meta_args(head_dim=op.head_dim), stream=7)
        assert op._workspaces == {}
    assert launches.capture_queries == [] and "zeros" not in kinds(launches)


# --- execute on CPU memory: the copy, the zeroing and the overlap rule on real addresses ----------
@pytest.fixture
def on_cpu(monkeypatch, launches):
    """The per-tensor rules (check_tensor, as both op modules call it) ask tensors for device
    "cpu" instead of "cuda" (descriptors still describe cuda tensors), so that execute() takes
    CPU tensors; everything else is unchanged. The op's own workspace is made on the CPU."""
    real = bwd_module.check_tensor

    def check_tensor(name, t, *args, device="cuda", **kw):
        return real(name, t, *args, device="cpu" if isinstance(t, torch.Tensor) else device, **kw)
    monkeypatch.setattr(fwd_module, "check_tensor", check_tensor)
    monkeypatch.setattr(bwd_module, "check_tensor", check_tensor)
    launches.alloc_device = "cpu"
    return launches


def cpu_args(t_q=T, t_k=T, batch=B):
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(BF)  # noqa: E731
    nan = lambda *shape: torch.full(shape, math.nan, dtype=BF)  # noqa: E731
    return dict(do=rand(t_q, H, D), q=rand(t_q, H, D), k=rand(t_k, HKV, D), v=rand(t_k, HKV, D),
                dq=nan(t_q, H, D), dk=nan(t_k, HKV, D), dv=nan(t_k, HKV, D),
                cu_seqlens_q=torch.zeros(batch + 1, dtype=I32),
                cu_seqlens_k=torch.zeros(batch + 1, dtype=I32))


@pytest.mark.parametrize("jagged", [False, True], ids=["dense", "jagged"])
@pytest.mark.parametrize("given", [True, False], ids=["given-workspace", "own-workspace"])
def test_execute_fused_converts_the_workspace_into_dq_and_leaves_it_zero(on_cpu, given, jagged):
    """Jagged batches: the host's copy and memset convert the accumulator (real tensors here).
    Dense batches: dq_finish does (stood in for), with the accumulator, dq and the sync words
    the fused kernel had; the host adds no torch pass that would overwrite dq after it."""
    op = bwd().check_support()
    assert op.fused
    a = cpu_args()
    lengths = dict(max_seqlen_q=JAGGED, max_seqlen_k=JAGGED) if jagged else {}
    contribution = torch.randn(T, H, D, generator=torch.Generator().manual_seed(1))
    seen = []

    def fused(args):  # what the kernel leaves: dK, dV written, dQ reduce-added (fp32)
        call = named_args("fused", args)
        seen.append((call["dq_acc"], call["sync"]))
        assert call["dq_acc"].dtype == F32 and tuple(call["dq_acc"].shape) == (T, H, D)
        assert call["sync"].dtype == I32 and call["sync"].numel() == H * D
        # zero before every launch, the sync words too
        assert not call["dq_acc"].any() and not call["sync"].any()
        assert call["compact"] == int(jagged) and call["dq"] is a["dq"]
        call["dq_acc"] += contribution
        if not jagged:
            call["sync"][0] = 8  # an arrival count: dq_finish clears it
        call["grad_a"].fill_(1.0)
        call["grad_b"].fill_(2.0)

    def finish(args):
        assert not jagged
        assert args[0] is seen[-1][0] and args[2] is seen[-1][1] and args[2][0] == 8
        finish_like_the_kernel(args)
    on_cpu.effects["fused"] = fused
    on_cpu.effects["dq_finish"] = finish
    ws = torch.zeros(op.workspace_shape(T), dtype=F32) if given else None
    for _ in range(3):  # each execute leaves the workspace zero for the next
        a["dq"].fill_(math.nan)
        op.execute(**a, stream=1, workspace=ws, **lengths)
        assert torch.equal(a["dq"], contribution.to(BF))
        assert torch.equal(a["dk"], torch.ones(T, HKV, D, dtype=BF))
        assert torch.equal(a["dv"], torch.full((T, HKV, D), 2.0, dtype=BF))
        assert not seen[-1][0].any() and not seen[-1][1].any()
    modes = ["fused"] if jagged else list(FUSED_MODES)
    assert [mode for mode, _ in on_cpu.calls] == modes * 3
    host = ["stream", "copy", "zero", "end stream"] if jagged else []
    made = [] if given else ["stream", "zeros", "end stream"]  # the own workspace, once
    assert kinds(on_cpu) == made + (["launch"] * len(modes) + host) * 3
    if given:
        assert all(is_dq_acc(acc, ws, T) and word_rows(sync, ws) == (T, WS) for acc, sync in seen)
        assert op._workspaces == {} and not ws.any()
    else:
        own = op._workspaces[(None, 1)]
        assert own.device.type == "cpu" and all(acc._base is own for acc, _ in seen)
        assert all(word_rows(sync, own) == (T, WS) for _, sync in seen)
        assert kinds(on_cpu).count("zeros") == 1 and not own.any()


@pytest.mark.parametrize("jagged", [False, True], ids=["dense", "jagged"])
def test_execute_fused_workspace_rows_beyond_t_q_stay_untouched(on_cpu, jagged):
    """The own workspace grown for more tokens: a call with fewer uses (and zeroes) only its
    first rows, with its sync words in the row right after them."""
    op = bwd().check_support()
    lengths = dict(max_seqlen_q=JAGGED, max_seqlen_k=JAGGED) if jagged else {}
    on_cpu.effects["fused"] = lambda args: args[6].add_(1.0)
    on_cpu.effects["dq_finish"] = finish_like_the_kernel
    op.execute(**cpu_args(t_q=2 * T), stream=1,
               **(lengths or dict(max_seqlen_q=2 * MAXS, max_seqlen_k=2 * MAXS)))
    own = op._workspaces[(None, 1)]
    own[T + 1:].fill_(7.0)  # rows the next call must not touch
    a = cpu_args()
    op.execute(**a, stream=1, **lengths)
    assert tuple(own.shape) == (2 * T + 1, H, D) and not own[:T + 1].any()
    assert torch.equal(own[T + 1:], torch.full((T, H, D), 7.0))
    assert torch.equal(a["dq"], torch.ones(T, H, D, dtype=BF))
    call = named_args("fused", on_cpu.calls[-1 if jagged else -2][1])
    assert is_dq_acc(call["dq_acc"], own, T) and word_rows(call["sync"], own) == (T, WS)


def overlapping(name, dtype, shape, at=0):
    """A float32 workspace_shape(T) = (T + 1, H, D) workspace at the start of a larger buffer
    and a tensor ``name`` over the buffer's bytes from row ``at`` on."""
    buf = torch.zeros(WS + T, H, D, dtype=F32)
    count = math.prod(shape)
    return buf[:WS], buf[at:].reshape(-1).view(dtype)[:count].view(shape)


@pytest.mark.parametrize("name,dtype,shape,at,match", [
    ("dq", BF, (T, H, D), 0, "dq overlaps workspace in memory; outputs must not alias"),
    ("dk", BF, (T, HKV, D), 0, "dk overlaps workspace in memory"),
    ("dv", BF, (T, HKV, D), 0, "dv overlaps workspace in memory"),
    ("q", BF, (T, H, D), 0, "workspace overlaps q in memory"),
    ("do", BF, (T, H, D), 0, "workspace overlaps do in memory"),
    ("k", BF, (T, HKV, D), 0, "workspace overlaps k in memory"),
    ("cu_seqlens_q", I32, (B + 1,), 0, "workspace overlaps cu_seqlens_q in memory"),
    # the sync words (the row after the accumulator's T rows) are written too
    ("dq", BF, (T, H, D), T, "dq overlaps workspace in memory"),
    ("cu_seqlens_q", I32, (B + 1,), T, "workspace overlaps cu_seqlens_q in memory"),
])
def test_execute_refuses_a_workspace_overlapping(on_cpu, name, dtype, shape, at, match):
    op = bwd().check_support()
    ws, alias = overlapping(name, dtype, shape, at)
    with pytest.raises(ValueError, match=match):
        op.execute(**{**cpu_args(), name: alias}, stream=1, workspace=ws)
    assert on_cpu.events == [] and op._workspaces == {}


def test_execute_accepts_a_workspace_beside_the_gradients_in_one_buffer(on_cpu):
    op = bwd().check_support()
    buf = torch.zeros((WS + T) * H * D, dtype=F32)
    ws = buf[:WS * H * D].view(WS, H, D)
    dq = buf[WS * H * D:].view(BF)[:T * H * D].view(T, H, D)  # the bytes right after it
    a = {**cpu_args(), "dq": dq}
    on_cpu.effects["fused"] = lambda args: args[6].fill_(3.0)
    on_cpu.effects["dq_finish"] = finish_like_the_kernel
    op.execute(**a, stream=1, workspace=ws)
    (_, call), (_, finish) = launched(on_cpu)
    assert is_dq_acc(call["dq_acc"], ws, T) and word_rows(call["sync"], ws) == (T, WS)
    assert call["dq"] is dq and finish["dq"] is dq
    assert torch.equal(dq, torch.full((T, H, D), 3.0, dtype=BF)) and not ws.any()


def test_execute_not_fused_ignores_an_overlapping_workspace(on_cpu):
    op = bwd(deterministic=True).check_support()
    assert not op.fused
    a = cpu_args()
    ws, alias = overlapping("dq", BF, (T, H, D))
    ws.fill_(5.0)
    op.execute(**{**a, "dq": alias}, stream=1, workspace=ws)
    assert [mode for mode, _ in on_cpu.calls] == ["dq", "dkdv"]
    assert all(call[6] is None for _, call in on_cpu.calls)
    assert kinds(on_cpu) == ["launch", "launch"]
    # nothing copied out of or zeroed the workspace
    assert torch.equal(ws, torch.full((WS, H, D), 5.0))


@pytest.mark.parametrize("deterministic", [False, True])
def test_execute_head_dim_256_runs_three_kernels(launches, deterministic):
    a = meta_args(head_dim=256)
    op = bwd(**dims(256), deterministic=deterministic).check_support()
    assert not op.fused
    op.execute(**a, stream=1)
    assert [mode for mode, _ in launches.calls] == ["dq", "dk", "dv"]
    calls = dict(launched(launches))
    assert calls["dq"]["grad_a"] is a["dq"] and calls["dq"]["grad_b"] is None
    assert calls["dk"]["grad_a"] is a["dk"] and calls["dk"]["grad_b"] is None
    assert calls["dv"]["grad_a"] is None and calls["dv"]["grad_b"] is a["dv"]
    assert all(call[n] is None for call in calls.values() for n in ("dq_acc", "dq", "sync"))
    # 64-row tiles at D = 256: one per sequence, dense; 256 tiles of 64 x 256 per L2 group
    # hold every pair (H x B = 16 with the queries fixed, H_kv x B = 8 with the keys fixed)
    assert scalars(calls["dq"])[:5] == (MAXS, 0, 0, 16, MAXS)
    assert scalars(calls["dk"])[:5] == scalars(calls["dv"])[:5] == (MAXS, 0, 0, 8, MAXS)
    assert kinds(launches) == ["launch"] * 3 and op._workspaces == {}


@pytest.mark.parametrize("deterministic", [False, True])
def test_execute_writes_disjoint_views_in_place(launches, deterministic):
    kv = meta(T, 2, HKV, D)
    a = {**meta_args(), "dk": kv[:, 0], "dv": kv[:, 1]}
    op = HSTUBwdSm90(*(a[n] for n in ("do", "q", "k", "v", "dq", "dk", "dv", "cu_seqlens_q",
                                      "cu_seqlens_k")), MAXS, MAXS,
                     deterministic=deterministic).check_support()
    op.execute(**a, stream=0)
    calls = dict(launched(launches))
    assert list(calls) == (["dq", "dkdv"] if deterministic else list(FUSED_MODES))
    call = calls["dkdv" if deterministic else "fused"]
    assert call["grad_a"] is a["dk"] and call["grad_b"] is a["dv"]
    if not deterministic:
        assert call["dq"] is calls["dq_finish"]["dq"] is a["dq"]


@pytest.mark.parametrize("deterministic", [False, True])
def test_execute_caps_wide_windows_and_passes_func(launches, deterministic):
    fused = not deterministic
    bwd(window_size=(2**31 - 1, 2**30 + 5), deterministic=deterministic).check_support().execute(
        **meta_args(), stream=1)
    kernels = [call for mode, call in launched(launches) if mode != "dq_finish"]
    assert len(kernels) == (1 if fused else 2)
    assert all((call["left"], call["right"]) == (WINDOW_CAP, WINDOW_CAP) for call in kernels)
    launches.calls.clear()
    func = meta(1, 3, 2 * L, dtype=I32)  # wider than needed is fine
    bwd(**FUNC, deterministic=deterministic).check_support().execute(
        **meta_args(), func_tensor=func, stream=3)
    assert [m for m, _ in launches.calls] == (list(FUSED_MODES) if fused else ["dq", "dkdv"])
    kernels = [call for mode, call in launched(launches) if mode != "dq_finish"]
    assert all(call["func"] is func for call in kernels)
    assert all((call["left"], call["right"]) == (-1, -1) for call in kernels)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("args,max_q,max_k", [
    (meta_args(t_q=0, t_k=0), 0, 0),
    (meta_args(t_q=0, t_k=T), 0, MAXS),     # dk, dv must still be written (zeros)
    (meta_args(t_q=T, t_k=0), MAXS, MAXS),  # dq must still be written (zeros)
])
def test_execute_empty_tokens_zero_every_gradient(launches, args, max_q, max_k, deterministic):
    op = bwd(deterministic=deterministic).check_support()
    assert op.fused is not deterministic
    op.execute(**args, stream=5, max_seqlen_q=max_q, max_seqlen_k=max_k)
    # no kernel and no workspace: a memset on the stream
    assert trace(launches, **args) == [("stream", 5, None), ("zero", "dq"), ("zero", "dk"),
                                       ("zero", "dv"), ("end stream",)]
    assert op._workspaces == {} and launches.capture_queries == []
    # a given workspace (validated for T_q when fused, else ignored) is left alone
    launches.events.clear()
    ws = meta(args["q"].shape[0] + 1, H, D, dtype=F32)
    op.execute(**args, stream=5, max_seqlen_q=max_q, max_seqlen_k=max_k, workspace=ws)
    assert trace(launches, ws=ws, **args) == [("stream", 5, None), ("zero", "dq"),
                                              ("zero", "dk"), ("zero", "dv"), ("end stream",)]


@pytest.mark.parametrize("deterministic", [False, True])
def test_execute_no_sequence_writes_nothing(launches, deterministic):
    op = bwd(deterministic=deterministic).check_support()
    assert op.fused is not deterministic
    op.execute(**meta_args(batch=0), stream=0)
    assert launches.events == [] and op._workspaces == {}


def test_execute_checks_first_when_unchecked(launches):
    op = bwd(alpha=math.nan)
    with pytest.raises(ValueError, match="alpha must be finite"):
        op.execute(**meta_args(), stream=0)
    assert launches.events == [] and op._workspaces == {}


# --- the kernel builder (fake arguments of the fixed kernel interface) ----------------------------
@pytest.fixture
def stub_kernel(monkeypatch):
    pytest.importorskip("cutlass")
    made = []

    class Kernel:
        def __init__(self, *args):
            made.append(args)

    class Finish:
        def __init__(self, *args):
            made.append(("dq_finish",) + args)

    module = types.ModuleType("precast.kernels.hstu_attention_bwd_sm90")
    module.HstuAttentionBackwardSm90 = Kernel
    module.DqFinishSm90 = Finish
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return made


@pytest.mark.parametrize("config,none_args", [
    # None at 4/5 (grad_a/grad_b unused), 6, 7, 8 (dq_acc, dq, sync: fused only),
    # 11 (func_tensor); dq_finish takes no None
    ({}, {"fused": (11,), "dq_finish": ()}),  # the default: fused
    (dict(deterministic=True), {"dq": (5, 6, 7, 8, 11), "dkdv": (6, 7, 8, 11)}),
    (dict(head_dim=32, num_kv_heads=1, deterministic=True),
     {"dq": (5, 6, 7, 8, 11), "dkdv": (6, 7, 8, 11)}),
    (dict(head_dim=32, num_kv_heads=1), {"fused": (11,), "dq_finish": ()}),
    (dict(head_dim=256, num_kv_heads=1), {"dq": (5, 6, 7, 8, 11), "dk": (5, 6, 7, 8, 11),
                                          "dv": (4, 6, 7, 8, 11)}),
    (dict(head_dim=256, deterministic=True), {"dq": (5, 6, 7, 8, 11), "dk": (5, 6, 7, 8, 11),
                                              "dv": (4, 6, 7, 8, 11)}),
    (dict(window_right_bounded=False, func_intervals=3, num_kv_heads=2),
     {"fused": (), "dq_finish": ()}),
    (dict(window_right_bounded=False, func_intervals=3, num_kv_heads=2, deterministic=True),
     {"dq": (5, 6, 7, 8), "dkdv": (6, 7, 8)}),
])
def test_kernel_builder_arguments(stub_kernel, config, none_args):
    import cutlass
    op = HSTUBwdSm90.from_config(dtype="float16", **config).check_support()
    builders = op._kernel_builders()
    assert tuple(builders) == op.kernel_modes() == tuple(none_args)
    cfg = op.static_config()
    h, h_kv, d = 4, cfg["num_kv_heads"], cfg["head_dim"]
    for mode, build in builders.items():
        kernel, args = build()
        assert tuple(i for i, a in enumerate(args) if a is None) == none_args[mode]
        if mode == "dq_finish":  # DqFinishSm90(H, H_kv)
            assert stub_kernel[-1] == ("dq_finish", h, h_kv)
            assert len(args) == len(FINISH_ARGS)
            dq_acc, dq, sync, cu_seqlens_q = args[:4]
            assert dq_acc.element_type == cutlass.Float32 and tuple(dq_acc.stride) == (h * d,
                                                                                       d, 1)
            assert dq_acc.shape[0] is dq.shape[0] and tuple(dq_acc.shape[1:]) == (h, d)
            assert dq.element_type == cutlass.Float16 and tuple(dq.shape[1:]) == (h, d)
            assert sync.element_type == cutlass.Int32 and len(sync.shape) == 1
            assert cu_seqlens_q.element_type == cutlass.Int32
            # pair_group, max_seqlen_q (Int32), the stream
            assert [type(x) for x in args[4:6]] == [cutlass.Int32] * 2
            assert args[6] is not None and not isinstance(args[6], cutlass.Int32)
            continue
        assert stub_kernel[-1] == (cutlass.Float16, d, h, h_kv, cfg["window_left_bounded"],
                                   cfg["window_right_bounded"], cfg["func_intervals"], mode)
        assert len(args) == len(KERNEL_ARGS)
        q, k, v, do = args[:4]
        assert tuple(q.shape[1:]) == (h, d) and q.stride[2] == 1
        assert tuple(k.shape[1:]) == (h_kv, d)
        assert q.shape[0] is do.shape[0] and k.shape[0] is v.shape[0]  # one T_q, one T_k
        assert args[9].shape[0] is args[10].shape[0]  # B + 1 entries in both cu_seqlens
        grads = [g for g in args[4:6] if g is not None]
        expected_tokens = q.shape[0] if mode == "dq" else k.shape[0]
        assert all(g.shape[0] is expected_tokens for g in grads)
        assert all(g.element_type == cutlass.Float16 for g in grads)
        if mode == "fused":
            # dk, dv; the compact fp32 (T_q, H, D) dQ accumulator, dq, the int32 sync words
            assert len(grads) == 2 and tuple(grads[0].shape[1:]) == (h_kv, d)
            dq_acc, dq, sync = args[6:9]
            assert dq_acc.element_type == cutlass.Float32
            assert dq_acc.shape[0] is q.shape[0] and tuple(dq_acc.shape[1:]) == (h, d)
            assert tuple(dq_acc.stride) == (h * d, d, 1)
            assert dq.shape[0] is q.shape[0] and tuple(dq.shape[1:]) == (h, d)
            assert dq.element_type == cutlass.Float16
            assert sync.element_type == cutlass.Int32 and len(sync.shape) == 1
        if cfg["func_intervals"]:
            assert tuple(args[11].shape[:2]) == (1, 3) and args[11].stride[2] == 1
        # longest, compact, pair_group, max_seqlen_q, left, right (Int32), alpha / 2,
        # scale_ds, scale_p (Float32), the stream
        assert [type(x) for x in args[12:21]] == [cutlass.Int32] * 6 + [cutlass.Float32] * 3
        assert args[21] is not None and not isinstance(args[21], (cutlass.Int32, cutlass.Float32))


# --- the allocating function and the custom ops ---------------------------------------------------
def backward_args(**kw):
    a = meta_args()
    for name in ("dq", "dk", "dv"):
        del a[name]
    return {**a, "max_seqlen_q": MAXS, "max_seqlen_k": MAXS, "stream": 0, **kw}


def test_allocating_backward_deterministic(no_compile):
    r = hstu_attention_backward(**backward_args(alpha=2.0, deterministic=True))
    dq, dk, dv = r
    assert r.dq_tensor is dq and r["dk_tensor"] is dk and r.dv_tensor is dv
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, HKV, D)
    assert dq.dtype == dk.dtype == dv.dtype == BF
    # deterministic: the two kernels, dq written by its own, no workspace, no copy
    assert [m for m, _ in no_compile.calls] == ["dq", "dkdv"]
    (_, dq_call), (_, dkdv_call) = launched(no_compile)
    assert dq_call["grad_a"] is dq and dq_call["grad_b"] is None and dq_call["dq_acc"] is None
    assert dkdv_call["grad_a"] is dk and dkdv_call["grad_b"] is dv
    assert all(call[n] is None for call in (dq_call, dkdv_call) for n in ("dq_acc", "dq", "sync"))
    assert scalars(dq_call)[:7] == (MAXS, 0, 0, 16, MAXS, -1, 0)  # causal by default
    assert kinds(no_compile) == ["launch", "launch"]
    (op,) = COMPILED_OPS._ops.values()
    assert not op.fused and op._workspaces == {} and no_compile.capture_queries == []
    # runtime values reuse the op
    no_compile.calls.clear()
    r = hstu_attention_backward(**backward_args(alpha=0.5, scaling_seqlen=2.0,
                                                deterministic=True))
    assert len(COMPILED_OPS._ops) == 1
    assert [m for m, _ in no_compile.calls] == ["dq", "dkdv"]
    assert no_compile.calls[0][1][4] is r.dq_tensor and no_compile.calls[0][1][6] is None
    assert "zeros" not in kinds(no_compile) and "copy" not in kinds(no_compile)
    # deterministic is static: the default (not deterministic) is a second op, fused
    no_compile.calls.clear()
    hstu_attention_backward(**backward_args())
    assert len(COMPILED_OPS._ops) == 2
    assert [m for m, _ in no_compile.calls] == list(FUSED_MODES)
    # supplied gradient buffers (dk, dv split from one packed buffer) are written in place
    kv = meta(T, 2, HKV, D)
    r = hstu_attention_backward(**backward_args(deterministic=True), dk_tensor=kv[:, 0],
                                dv_tensor=kv[:, 1])
    assert no_compile.calls[-1][0] == "dkdv"
    dk, dv = no_compile.calls[-1][1][4:6]
    assert dk is r.dk_tensor and dv is r.dv_tensor
    assert dk.shape == dv.shape == (T, HKV, D) and dk.stride() == kv[:, 0].stride()


def test_allocating_backward_fused(no_compile):
    r = hstu_attention_backward(**backward_args(alpha=2.0))
    dq, dk, dv = r
    assert r.dq_tensor is dq and r["dk_tensor"] is dk and r.dv_tensor is dv
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, HKV, D)
    assert dq.dtype == dk.dtype == dv.dtype == BF
    # not deterministic by default: the fused kernel, dq through the op's own workspace and
    # dq_finish (a dense batch)
    assert [m for m, _ in no_compile.calls] == list(FUSED_MODES)
    (_, call), (_, finish) = launched(no_compile)
    assert call["grad_a"] is dk and call["grad_b"] is dv and call["dq"] is dq
    (op,) = COMPILED_OPS._ops.values()
    ws = op._workspaces[(None, 0)]
    assert tuple(ws.shape) == (WS, H, D) and ws.dtype == F32
    assert call["dq_acc"]._base is ws and is_dq_acc(call["dq_acc"], ws, T)
    assert word_rows(call["sync"], ws) == (T, WS)
    assert scalars(call)[:7] == (MAXS, 0, 1, 8, MAXS, -1, 0)  # causal by default
    assert finish["dq_acc"] is call["dq_acc"] and finish["dq"] is dq
    assert finish["sync"] is call["sync"] and finish["pair_group"] == call["pair_group"]
    assert "copy" not in kinds(no_compile)  # dq_finish converts
    # a jagged batch: the torch copy instead of dq_finish
    no_compile.calls.clear()
    r = hstu_attention_backward(**backward_args(max_seqlen_q=JAGGED, max_seqlen_k=JAGGED))
    assert [m for m, _ in no_compile.calls] == ["fused"]
    assert no_compile.calls[0][1][13] == 1  # compact
    copies = [e for e in no_compile.events if e[0] == "copy"]
    assert len(copies) == 1 and copies[0][1] is r.dq_tensor and copies[0][2]._base is ws
    # runtime values reuse the op (and its workspace); deterministic is static
    hstu_attention_backward(**backward_args(alpha=0.5, scaling_seqlen=2.0))
    assert len(COMPILED_OPS._ops) == 1 and no_compile.calls[-2][1][6]._base is ws
    assert [e[0] for e in no_compile.events].count("zeros") == 1
    no_compile.calls.clear()
    r = hstu_attention_backward(**backward_args(deterministic=True))
    assert len(COMPILED_OPS._ops) == 2
    assert [m for m, _ in no_compile.calls] == ["dq", "dkdv"]
    assert no_compile.calls[0][1][4] is r.dq_tensor and no_compile.calls[0][1][6] is None
    # supplied gradient buffers (dk, dv split from one packed buffer) are written in place
    kv = meta(T, 2, HKV, D)
    r = hstu_attention_backward(**backward_args(), dk_tensor=kv[:, 0], dv_tensor=kv[:, 1])
    assert [m for m, _ in no_compile.calls[-2:]] == list(FUSED_MODES)
    dk, dv = no_compile.calls[-2][1][4:6]
    assert dk is r.dk_tensor and dv is r.dv_tensor
    assert dk.shape == dv.shape == (T, HKV, D) and dk.stride() == kv[:, 0].stride()


def test_allocating_backward_validates(no_compile):
    with pytest.raises(ValueError, match="q: tensor is on cpu"):
        hstu_attention_backward(**backward_args(q=torch.zeros(T, H, D, dtype=BF)))
    with pytest.raises(NotImplementedError, match="head dim D = 48"):
        hstu_attention_backward(**backward_args(q=meta(T, H, 48), do=meta(T, H, 48)))
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        hstu_attention_backward(**backward_args(window_size=(-3, 0)))
    with pytest.raises(ValueError, match="dk: has 72 tokens but k has 64"):
        hstu_attention_backward(**backward_args(), dk_tensor=meta(T + 8, HKV, D))
    assert COMPILED_OPS._ops == {}  # nothing invalid is cached


def test_custom_ops_are_registered():
    assert hasattr(torch.ops.precast, "hstu_attention")
    assert hasattr(torch.ops.precast, "hstu_attention_bwd")
    assert hasattr(torch.ops.precast, "hstu_attention_fwd")


@pytest.mark.parametrize("kv_heads", [HKV, H, 1])
def test_custom_op_fakes_give_shapes(kv_heads):
    q, do = meta(T, H, D), meta(T, H, D)
    k, v = meta(2 * T, kv_heads, D), meta(2 * T, kv_heads, D)
    cu = meta(B + 1, dtype=I32)
    o = torch.ops.precast.hstu_attention(q, k, v, cu, cu, MAXS, 2 * MAXS, None, -1, 0, 1.0,
                                         None, False)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device.type == "meta"
    dq, dk, dv = torch.ops.precast.hstu_attention_bwd(do, q, k, v, cu, cu, MAXS, 2 * MAXS, None,
                                                      -1, 0, 1.0, None, True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == BF
    assert {t.device.type for t in (dq, dk, dv)} == {"meta"}


def test_custom_op_autograd_reaches_the_backward_fake():
    q, k, v = (t.requires_grad_() for t in (meta(T, H, D), meta(T, HKV, D), meta(T, HKV, D)))
    cu = meta(B + 1, dtype=I32)
    o = precast.hstu_attention(q, k, v, cu, cu, MAXS, MAXS, window_size=(-1, -1), alpha=0.5,
                               deterministic=True)
    assert o.shape == (T, H, D) and o.requires_grad
    o.backward(meta(T, H, D))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


def test_custom_op_fakes_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, do = torch.empty(T, H, D, dtype=BF), torch.empty(T, H, D, dtype=BF)
        k, v = torch.empty(T, HKV, D, dtype=BF), torch.empty(T, HKV, D, dtype=BF)
        cu = torch.empty(B + 1, dtype=I32)
        dq, dk, dv = torch.ops.precast.hstu_attention_bwd(do, q, k, v, cu, cu, MAXS, MAXS, None,
                                                          -1, 0, 1.0, None, False)
        o = torch.ops.precast.hstu_attention(q, k, v, cu, cu, MAXS, MAXS, None, -1, 0, 1.0,
                                             None, False)
    assert dq.shape == (T, H, D) and dk.shape == dv.shape == (T, HKV, D) and o.shape == (T, H, D)
