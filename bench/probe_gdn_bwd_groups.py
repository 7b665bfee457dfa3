"""Probe (timing only): does the kept Gated DeltaNet backward at 4 x 8192, 64 heads, gain
when its batch is cut into groups of sequences and the groups are software-pipelined on
two streams, so that one group's chunk_grad (latency-bound, about half the copy bandwidth)
runs beside the next group's states / state_grad phase (bandwidth-bound)?

    python bench/probe_gdn_bwd_groups.py

Each group's kernel launches are recorded from one GdnBwdSm90.execute (with the forward's
kept workspace, as autograd runs it) and replayed on streams of this script's choosing:
"serial" starts group i once group i-1 is done, "pipelined" once group i-1's phase is
done. Session 49 (H100): one group 4657 us, 2 groups serial 5128 / pipelined 4684, 4
groups 5271 / 5203: no gain (bench/RESULTS.md "Session 49").
"""
from __future__ import annotations

import sys

import torch

from bench_gdn_bwd import make_inputs
from common import do_bench, recorded_launches

from precast import GdnBwdSm90, gated_delta_net

BATCH, SEQLEN, HEADS = 4, 8192, 64
# the modes one execute launches here (no prepare: the forward's workspace is kept; no
# finish: a head per head), the sequence table first
MODES = ("seq_table", "states", "states_split", "state_grad", "state_grad_split",
         "chunk_grad")


def make_group(inputs, lo: int, hi: int) -> dict:
    """Sequences [lo, hi) of ``inputs``: their token rows (views), int32 cu_seqlens, the
    forward's kept workspace, a backward op with its own workspace and gradients."""
    q, k, v, g, beta, _, do = inputs
    t0, t1 = lo * SEQLEN, hi * SEQLEN
    xs = [t[t0:t1] for t in (q, k, v, g, beta)]
    cu = torch.arange(0, t1 - t0 + 1, SEQLEN, device="cuda", dtype=torch.int32)
    kept = gated_delta_net(*xs, cu, use_qk_l2norm_in_kernel=True, output_final_state=True,
                           keep_workspace=True).workspace
    op = GdnBwdSm90(*xs, cu, do[t0:t1], use_qk_l2norm_in_kernel=True).check_support()
    workspace = op.make_workspace(t1 - t0, hi - lo, device="cuda")
    grads = [torch.empty_like(t) for t in xs]
    return dict(op=op, execute=lambda stream=None: op.execute(
        *xs, cu, do[t0:t1], *grads, workspace=workspace, forward_workspace=kept,
        stream=stream))


def launch(launches, stream, *prefixes) -> None:
    """The recorded launches whose mode starts with one of ``prefixes``, on ``stream``."""
    for mode, fn, args in launches:
        if mode.startswith(prefixes):
            fn(*(args[:-1] + (stream.cuda_stream,)))


def after(stream, *events) -> None:
    for e in events:
        if e is not None:
            stream.wait_event(e)


def mark(stream):
    e = torch.cuda.Event()
    e.record(stream)
    return e


def schedule(recorded, pipelined: bool, streams) -> None:
    """Every group's backward on the streams: per group the states pass on a side stream
    beside state_grad, joined before chunk_grad (as execute does)."""
    start = mark(torch.cuda.current_stream())
    phase = done = None
    ends = []
    for i, launches in enumerate(recorded):
        main, side = streams[i % 2]
        for s in (main, side):
            after(s, start, phase if pipelined else done)
        launch(launches, main, "seq_table")
        after(side, mark(main))
        launch(launches, side, "states")
        launch(launches, main, "state_grad")
        after(main, mark(side))
        phase = mark(main)
        launch(launches, main, "chunk_grad")
        done = mark(main)
        ends.append(done)
    after(torch.cuda.current_stream(), *ends)


def main() -> int:
    inputs = make_inputs(BATCH, SEQLEN, HEADS, HEADS)
    streams = [(torch.cuda.Stream(), torch.cuda.Stream()) for _ in range(2)]
    print(f"{torch.cuda.get_device_name()}: kept backward, {BATCH} x {SEQLEN}, {HEADS} heads",
          flush=True)
    whole = make_group(inputs, 0, BATCH)
    results = {"execute, one group": do_bench(whole["execute"]) * 1e3}
    for n in (1, 2, 4):
        per = BATCH // n
        groups = [make_group(inputs, i * per, (i + 1) * per) for i in range(n)]
        recorded = []
        for i, gr in enumerate(groups):  # each on its own stream's buffers
            stream = streams[i % 2][0]
            with torch.cuda.stream(stream):
                recorded.append(recorded_launches(
                    gr["op"], stream.device.index,
                    lambda: gr["execute"](stream.cuda_stream)))
            modes = [m for m, _, _ in recorded[-1]]
            assert set(modes) <= set(MODES), f"launches this probe does not schedule: {modes}"
        for pipelined in ((False,) if n == 1 else (False, True)):
            name = f"{n} group{'s' * (n > 1)} {'pipelined' if pipelined else 'serial'}"
            results[name] = do_bench(lambda: schedule(recorded, pipelined, streams)) * 1e3
        del groups, recorded
    for name, us in results.items():
        print(f"{name:>22}: {us:8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
