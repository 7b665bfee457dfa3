"""One Gated DeltaNet backward (gated_delta_net_backward: every kernel once) at a
bench_gdn_bwd case, for ncu:

    ncu --clock-control none -k regex:GdnStateGrad --section WarpStateStats ... \
        python bench/profile_gdn_bwd.py [CASE]

or, with ``--timeline``, the GPU's own timeline of the backward that autograd runs (the
forward's workspace kept): each kernel's start and end in microseconds from the first
kernel's start, and its stream, for the median of a few backwards (torch.profiler, CUPTI).
It shows what the stage times alone (bench_gdn_bwd --stages) cannot: how the kernels on
the side stream overlap and what the phases cost together.

    python bench/profile_gdn_bwd.py [CASE] --timeline
"""
import argparse
import statistics

import torch

from bench_gdn_bwd import CASES, make_inputs, pair

from precast import gated_delta_net_backward


def kernel_events(prof):
    """[(name, stream, start_ns, end_ns)] of the GPU kernels a torch.profiler recorded."""
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA or e.duration_ns() <= 0:
            continue
        out.append((e.name(), e.device_resource_id(), e.start_ns(),
                    e.start_ns() + e.duration_ns()))
    return sorted(out, key=lambda x: x[2])


def short(name: str) -> str:
    for key in ("GdnStateGrad", "GdnChunkGrad", "GdnChunkRecurrence", "GdnChunkPrepare",
                "GdnSeqTable", "GdnGradFinish", "fill", "copy", "zero"):
        if key.lower() in name.lower():
            return key
    return name[:40]


def timeline(inputs, rounds: int = 7) -> None:
    _, bwd, _ = pair(inputs, dict(keep_workspace=True),  # bench_gdn_bwd's kept backward
                     lambda r: dict(forward_workspace=r.workspace))
    for _ in range(2):
        bwd()
    torch.cuda.synchronize()
    runs = []
    for _ in range(rounds):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            bwd()
            torch.cuda.synchronize()
        runs.append(kernel_events(prof))
    spans = [(ev[-1][3] - ev[0][2]) / 1e3 for ev in runs]
    med = sorted(range(rounds), key=lambda i: spans[i])[rounds // 2]
    events = runs[med]
    t0 = events[0][2]
    print(f"backward span {spans[med]:.1f} us (median of {rounds}; min {min(spans):.1f}, "
          f"max {max(spans):.1f})")
    for name, stream, start, end in events:
        print(f"  stream {stream:>3}  {short(name):>16}  {(start - t0) / 1e3:8.1f} -> "
              f"{(end - t0) / 1e3:8.1f} us  ({(end - start) / 1e3:7.1f})")
    print("  spans over rounds: " + " ".join(f"{s:.0f}" for s in spans)
          + f"  (stdev {statistics.pstdev(spans):.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("case", nargs="?", default="1x32768-hv32", choices=sorted(CASES))
    ap.add_argument("--timeline", action="store_true")
    args = ap.parse_args()
    inputs = make_inputs(*CASES[args.case])
    if args.timeline:
        timeline(inputs)
        return
    q, k, v, g, beta, cu, do = inputs
    gated_delta_net_backward(q, k, v, g, beta, cu, do, use_qk_l2norm_in_kernel=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
