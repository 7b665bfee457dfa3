"""ptxas must not serialize the HSTU attention kernel's wgmma (it only warns, and the kernel
then runs 20-30 % slower): a representative set of variants through bench/ptxas_report.py.
Needs a local ptxas (any CUDA toolkit); skipped without one."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

ptxas_report = pytest.importorskip("ptxas_report")

VARIANTS = [  # every head dim, every mask family, paged, MQA
    ("head_dim=32,", "window_left_bounded=True", "window_right_bounded=True"),
    ("head_dim=64,", "window_left_bounded=False", "window_right_bounded=True", "float16"),
    ("head_dim=128,", "window_left_bounded=False", "window_right_bounded=False", "bfloat16",
     "num_kv_heads=4"),
    ("head_dim=128,", "func_intervals=3", "bfloat16"),
    ("head_dim=256,", "window_left_bounded=True", "window_right_bounded=False", "bfloat16"),
    ("head_dim=256,", "paged=True", "num_kv_heads=1", "bfloat16"),
]


def _ptxas():
    try:
        return ptxas_report.find_ptxas(None)
    except SystemExit:
        return None


@pytest.mark.compile
@pytest.mark.skipif(_ptxas() is None, reason="no local ptxas")
@pytest.mark.parametrize("needles", VARIANTS, ids=lambda n: "-".join(n).replace(",", ""))
def test_attention_wgmma_is_not_serialized(needles):
    entries = [e for e in ptxas_report.load_plan(ptxas_report.DEFAULT_PLAN)
               if e.op == "HSTUFwdSm90" and all(n in e.describe() + "," for n in needles)]
    assert entries, needles
    ptxs = ptxas_report.compile_ptx(entries[0], ptxas_report.DUMP_DIR)
    assert ptxs
    verdict = ptxas_report.ptxas_verdict(_ptxas(), ptxs[0])
    assert not verdict["error"], verdict["error"][:2000]
    assert verdict["serialized"] == [], verdict["serialized"]
    assert verdict["spill_bytes"] == 0
    assert 0 < verdict["registers"] <= 255


BACKWARD_VARIANTS = [  # (needles, fused): every head dim, masks, GQA, both paths
    # fused (the default: not deterministic, D <= 128): the fused kernel and dq_finish
    (("head_dim=32,", "window_left_bounded=True", "window_right_bounded=True"), True),
    (("head_dim=64,", "window_left_bounded=False", "window_right_bounded=True",
      "dtype=float16"), True),  # not "float16": "bfloat16" contains it
    (("head_dim=64,", "window_left_bounded=False", "window_right_bounded=True", "bfloat16",
      "num_kv_heads=4"), True),
    (("head_dim=128,", "func_intervals=3", "bfloat16"), True),
    (("head_dim=128,", "num_kv_heads=1", "window_right_bounded=True"), True),
    (("head_dim=128,", "window_left_bounded=False", "window_right_bounded=False", "bfloat16",
      "num_kv_heads=4"), True),
    # two kernels (deterministic=True; the plan has it causal, bf16, 4 heads, D = 64 and 128)
    (("deterministic=True", "head_dim=64,", "window_left_bounded=False",
      "window_right_bounded=True", "bfloat16", "num_kv_heads=4"), False),
    (("deterministic=True", "head_dim=128,", "window_left_bounded=False",
      "window_right_bounded=True", "bfloat16", "num_kv_heads=4"), False),
    # three kernels: D = 256 is never fused
    (("head_dim=256,", "window_left_bounded=False", "window_right_bounded=True",
      "bfloat16"), False),
]
# Backward variants spill a little and never serialize wgmma: 4-60 bytes for the plain masks,
# up to 160 for func masks and GQA (the fused kernel issues the next tile's S and dP before
# staging dQ, so three accumulators are live together). More means the register budget broke.
BACKWARD_SPILL_LIMIT = 192


@pytest.mark.compile
@pytest.mark.skipif(_ptxas() is None, reason="no local ptxas")
@pytest.mark.parametrize("needles,fused", BACKWARD_VARIANTS,
                         ids=lambda v: "-".join(v).replace(",", "") if isinstance(v, tuple)
                         else ("fused" if v else "two-kernel"))
def test_attention_backward_wgmma_is_not_serialized(needles, fused):
    from precast import HSTUBwdSm90
    # the configuration picks the path: deterministic entries only where a needle asks
    entries = [e for e in ptxas_report.load_plan(ptxas_report.DEFAULT_PLAN)
               if e.op == "HSTUBwdSm90" and all(n in e.describe() + "," for n in needles)
               and ("deterministic=True" in e.describe()) == ("deterministic=True" in needles)]
    assert entries, needles
    assert HSTUBwdSm90.from_config(**dict(entries[0].config)).fused is fused, needles
    ptxs = ptxas_report.compile_ptx(entries[0], ptxas_report.DUMP_DIR)
    # fused: the fused kernel, then dq_finish (the rest of the dQ conversion)
    expected = 2 if fused else (3 if "head_dim=256," in needles else 2)
    assert len(ptxs) == expected
    assert [p.parent.name for p in ptxs] == list(
        HSTUBwdSm90.from_config(**dict(entries[0].config)).kernel_modes())
    for ptx in ptxs:
        verdict = ptxas_report.ptxas_verdict(_ptxas(), ptx)
        assert not verdict["error"], verdict["error"][:2000]
        assert verdict["serialized"] == [], verdict["serialized"]
        assert verdict["spill_bytes"] <= BACKWARD_SPILL_LIMIT, verdict["spill_bytes"]
        assert 0 < verdict["registers"] <= 255


GDN_FORWARD_VARIANTS = [  # the recurrence's o leaves behind the next chunk's first products
    ("dtype=bfloat16", "state_dtype=none", "use_qk_l2norm_in_kernel=True", "k_heads=4,"),
    # fp16 with an initial state: its split recurrence serialized with the o store there
    ("dtype=float16", "state_dtype=float32", "k_heads=4,"),
    # io checkpoints beside o: the most registers live
    ("checkpoint_dtype=io", "dtype=bfloat16", "state_dtype=float32", "k_heads=4,"),
]


@pytest.mark.compile
@pytest.mark.skipif(_ptxas() is None, reason="no local ptxas")
@pytest.mark.parametrize("needles", GDN_FORWARD_VARIANTS, ids=lambda n: "-".join(n))
def test_gdn_forward_wgmma_is_not_serialized(needles):
    entries = [e for e in ptxas_report.load_plan(ptxas_report.DEFAULT_PLAN)
               if e.op == "GdnFwdSm90" and all(n in e.describe() + "," for n in needles)]
    assert entries, needles
    ptxs = ptxas_report.compile_ptx(entries[0], ptxas_report.DUMP_DIR)
    names = [p.parent.name for p in ptxs]
    assert "recurrence" in names and "recurrence_split" in names, names
    for ptx in ptxs:
        verdict = ptxas_report.ptxas_verdict(_ptxas(), ptx)
        assert not verdict["error"], verdict["error"][:2000]
        assert verdict["serialized"] == [], (ptx.parent.name, verdict["serialized"])
        assert 0 < verdict["registers"] <= 255
