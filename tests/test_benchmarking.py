"""The benchmark helpers shared by bench/ and `precast quickstart` (CPU; burst_ms on the GPU)."""
import importlib
import sys
from pathlib import Path

import pytest
import torch

from precast.benchmarking import gdn_inputs

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_module(name: str):
    """A module of bench/ (its scripts import each other as top-level modules)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def test_gdn_inputs_shapes_dtypes_and_offsets():
    lens = [5, 0, 1, 3]
    q, k, v, g, beta, cu = gdn_inputs(lens, qk_heads=2, v_heads=4, dim=16, device="cpu")
    assert q.shape == k.shape == (9, 2, 16) and v.shape == (9, 4, 16)
    assert g.shape == beta.shape == (9, 4)
    assert q.dtype == k.dtype == v.dtype == beta.dtype == torch.bfloat16
    assert g.dtype == torch.float32
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 5, 6, 9]
    assert bool((g < 0).all()) and bool(((beta > 0) & (beta <= 1)).all())  # log decays, gates
    assert all(t.abs().sum() > 0 for t in (q, k, v))  # never zeros


def test_gdn_inputs_follow_the_seed():
    a = gdn_inputs([7], 1, 1, dim=8, seed=3, device="cpu")
    b = gdn_inputs([7], 1, 1, dim=8, seed=3, device="cpu")
    c = gdn_inputs([7], 1, 1, dim=8, seed=4, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_dq_conversion_stats_knows_the_kernels_slice():
    """bench/dq_conversion_stats.py runs where the DSL is not installed, so it states the
    fused backward's dQ slice height itself: it must be the kernel's."""
    pytest.importorskip("cutlass")
    from precast.kernels.hstu_attention_bwd_sm90 import SLICE_ROWS
    assert bench_module("dq_conversion_stats").SLICE_ROWS == SLICE_ROWS


@pytest.mark.gpu
def test_burst_ms_times_each_launch_of_a_burst():
    """burst_ms: per-launch milliseconds of back-to-back calls, every call counted: a copy of
    256 MiB timed by burst_ms and by do_bench agree within a factor of two, and the callable
    ran rounds x (launches + 2 warm-ups) times."""
    from precast.benchmarking import burst_ms, do_bench
    a = torch.empty(256 << 20, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    calls = []

    def copy():
        calls.append(1)
        b.copy_(a)

    burst = burst_ms(copy, launches=4, rounds=3, rest_s=0.05)
    assert len(calls) == 3 * (4 + 2)
    assert torch.equal(a, b)
    sustained = do_bench(lambda: b.copy_(a))
    assert 0.5 * sustained < burst < 2 * sustained, (burst, sustained)


def test_ab_run_gives_each_leg_its_tree_and_cache(tmp_path):
    """bench/ab.py run: the command runs in each leg's tree with that tree first on
    PYTHONPATH and PRECAST_CACHE_DIR at the leg's cache, legs interleaved per round, lines
    prefixed by the leg; the exit status counts the failed commands."""
    import subprocess
    ab = BENCH / "ab.py"
    for leg in ("one", "two"):
        (tmp_path / leg).mkdir()
    show = ("import os, sys; print(os.getcwd(), os.environ['PYTHONPATH'].split(os.pathsep)[0], "
            "os.environ['PRECAST_CACHE_DIR']); sys.exit(os.path.basename(os.getcwd()) == 'two')")
    res = subprocess.run([sys.executable, str(ab), "run", "one", "two", "--rounds", "2",
                          "--root", str(tmp_path), "--", sys.executable, "-c", show],
                         capture_output=True, text=True)
    assert res.returncode == 2  # leg two fails in both rounds
    lines = res.stdout.splitlines()
    assert [l for l in lines if l.startswith("===")] == [
        "=== one round 1", "=== two round 1", "=== one round 2", "=== two round 2"]
    for leg in ("one", "two"):
        tree, cache = (tmp_path / leg).resolve(), (tmp_path / f"c_{leg}").resolve()
        assert lines.count(f"{leg}: {tree} {tree} {cache}") == 2
    bad = subprocess.run([sys.executable, str(ab), "run", "one", "--root", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "give the command after --" in bad.stderr


def test_sass_stats_hot_loop_finds_the_wgmma_loop_and_its_skipped_regions():
    """bench/sass_stats.py --loop: the smallest loop holding min_mma HGMMA (not a loop with
    fewer; a retry stub after EXIT that jumps back is not a loop), its body, and the forward
    branches in it over more than SKIPPED_REGION instructions."""
    sass_stats = bench_module("sass_stats")

    lines, addr = [], 0

    def emit(text):
        nonlocal addr
        lines.append(f"        /*{addr:04x}*/                   {text} ;")
        addr += 0x10
        return addr - 0x10

    emit("MOV R0, RZ")
    small = emit("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ")  # a loop with 1 HGMMA
    emit(f"@P0 BRA {small:#x}")
    top = emit("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ")
    emit("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24")
    branch = len(lines)
    emit("@!P1 BRA 0x0")  # patched below: over the 45 FFMAs
    for _ in range(45):
        emit("FFMA R1, R2, R3, R4")
    after = emit("MUFU.TANH R5, R6")
    lines[branch] = lines[branch].replace("0x0 ;", f"{after:#x} ;")
    end = emit(f"@P2 BRA {top:#x}")
    emit("EXIT")
    emit(f"BRA {top:#x}")  # a retry stub after the end: spans the EXIT, not a loop
    code = sass_stats.instructions("\n".join(lines))
    body, skipped = sass_stats.hot_loop(code, min_mma=2)
    assert (body[0][0], body[-1][0]) == (top, end)
    assert sum(sass_stats.opcode(t) == "HGMMA" for _, t in body) == 2
    assert skipped == [(top + 0x30, after, 45)]
    assert sass_stats.hot_loop(code, min_mma=3) is None


def test_recorded_launches_records_in_order_and_restores_the_kernels():
    """bench/common.recorded_launches (kernel_times and the group probe replay what it
    records): every launch of one execute, in order and with its arguments, none run, and
    the op's kernels are its own again afterwards, also when execute raises."""
    recorded_launches = bench_module("common").recorded_launches

    ran = []
    kernels = {"states": lambda *a: ran.append(("states", a)),
               "chunk_grad": lambda *a: ran.append(("chunk_grad", a))}
    real = dict(kernels)

    class Op:
        def _ready(self, device_index):
            assert device_index == 3
            return kernels

    def execute():
        kernels["chunk_grad"](1, "s0")
        kernels["states"](2, "s1")
        kernels["chunk_grad"](4, "s0")

    got = recorded_launches(Op(), 3, execute)
    assert [(m, a) for m, _, a in got] == [("chunk_grad", (1, "s0")), ("states", (2, "s1")),
                                          ("chunk_grad", (4, "s0"))]
    assert [f for _, f, _ in got] == [real["chunk_grad"], real["states"], real["chunk_grad"]]
    assert ran == [] and kernels == real

    def failing():
        kernels["states"](0, "s")
        raise RuntimeError("launch refused")

    with pytest.raises(RuntimeError, match="launch refused"):
        recorded_launches(Op(), 3, failing)
    assert kernels == real and ran == []
