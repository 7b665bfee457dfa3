"""Every kernel of the default plan and of the GPU test plan cross-compiles for sm_90a on a
machine without a GPU (the slowest CPU test: about 230 kernels, LMSD, HSTU attention and the
Gated DeltaNet forward and backward)."""
import io
import time
import warnings
from pathlib import Path

import pytest

from precast.cli import DEFAULT_PLAN
from precast.lifecycle.cache import ArtifactCache
from precast.lifecycle.gdn_bwd import GdnBwdSm90
from precast.lifecycle.gdn_bwd import kernel_modes as backward_modes
from precast.lifecycle.gdn_fwd import kernel_modes
from precast.plan import build_entry, load_plan, precompile

GPU_PLAN = Path(__file__).parent / "gpu_plan.toml"


@pytest.mark.compile
def test_all_planned_kernels_cross_compile(tmp_path_factory):
    entries = list(dict.fromkeys(load_plan(DEFAULT_PLAN) + load_plan(GPU_PLAN)))
    assert len(entries) > 24  # the GPU plan adds to the default plan
    root = tmp_path_factory.mktemp("cross-compile")
    log = io.StringIO()
    start = time.perf_counter()
    results = precompile(entries, arch="sm_90a", cache_dir=str(root), jobs=2, stream=log)
    elapsed = time.perf_counter() - start
    print(f"\ncross-compiled {len(entries)} plan entries in {elapsed:.1f} s")
    assert sorted(e.describe() for e, _ in results) == sorted(e.describe() for e in entries)
    failures = [f"{e.describe()}: {type(r).__name__}: {r}" for e, r in results
                if not isinstance(r, float)]
    assert not failures, "\n".join(failures)
    assert all(r > 0 for _, r in results)
    assert f"precompiling {len(entries)} kernels for sm_90a with 2 processes" in log.getvalue()
    # one valid artifact per entry, each with the kernels its op builds
    listed = list(ArtifactCache(root).entries())
    assert len(listed) == len(entries)
    for _, manifest in listed:
        kernels = set(manifest["kernels"])
        key = manifest["key"]
        if key["op"] == "HSTUBwdSm90":
            # fused by default at D <= 128 (the fused kernel and dq_finish, the rest of its dQ
            # conversion); deterministic: dQ and dK/dV apart; D = 256 (never fused) splits dK
            # and dV into two kernels
            cfg = key["config"]
            expected = ({"dq", "dk", "dv"} if cfg["head_dim"] > 128
                        else {"dq", "dkdv"} if cfg["deterministic"] else {"fused", "dq_finish"})
        elif key["op"] == "GdnFwdSm90":  # the split recurrence exists at V = 128
            expected = set(kernel_modes(key["config"]["v_dim"]))
        elif key["op"] == "GdnBwdSm90":
            op = GdnBwdSm90.from_config(**key["config"]).check_support()
            expected = set(backward_modes(op.shapes))
        else:
            expected = {"HstuLmsdFwdSm90": {"fwd"}, "HstuLmsdBwdSm90": {"rows", "reduce"},
                        "HSTUFwdSm90": {"fwd", "order"}}[key["op"]]
        assert kernels == expected, manifest["key"]
        assert manifest["key"]["arch"] == "sm_90a"
    assert not list(root.rglob(".tmp-*"))


@pytest.mark.compile
def test_kernels_use_no_deprecated_dsl_api(tmp_path):
    """A DSL release removes what an earlier one deprecated: tracing one kernel family of
    each op (in this process, so its warnings reach us) warns of no deprecated DSL API."""
    first = {}
    for entry in load_plan(DEFAULT_PLAN):
        first.setdefault(entry.op, entry)
    assert len(first) == 6
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for entry in first.values():
            assert build_entry(entry, "sm_90a", str(tmp_path)) > 0
    assert len(list(ArtifactCache(tmp_path).entries())) == len(first)  # all were traced
    deprecated = {str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)}
    assert not deprecated, "\n".join(sorted(deprecated))


def test_backward_sync_words_are_the_kernels():
    """The lifecycle sizes the fused backward's sync words (it cannot import the kernels: a
    GPU host has no DSL), the kernels lay them out: the same words beside the groups'."""
    from precast.kernels import hstu_attention_bwd_sm90 as kernel
    from precast.lifecycle.hstu_attention_bwd import SYNC_EXTRA_WORDS, sync_group_capacity
    assert kernel.SYNC_EXTRA_WORDS == SYNC_EXTRA_WORDS
    for groups in (1, 7, 1000):
        words = kernel.extra_at(groups, kernel.SYNC_EXTRA_WORDS)
        assert words == 2 * groups + SYNC_EXTRA_WORDS and sync_group_capacity(words) == groups


def test_workspace_layout_is_the_kernels():
    """The lifecycle sizes the scheduler workspaces (it cannot import the kernels): the
    counter's words and the sequence order's room after them are the kernels'."""
    from precast.kernels import scheduler, sequence_order_sm90
    from precast.lifecycle.hstu_attention import ORDER_MAX_SEQUENCES, WORKSPACE_SHAPE
    from precast.lifecycle.launch import SCHEDULER_COUNTER_SHAPE
    assert SCHEDULER_COUNTER_SHAPE == (scheduler.COUNTER_WORDS,)
    assert ORDER_MAX_SEQUENCES == sequence_order_sm90.MAX_SEQUENCES
    assert WORKSPACE_SHAPE == (scheduler.COUNTER_WORDS + sequence_order_sm90.MAX_SEQUENCES,)
