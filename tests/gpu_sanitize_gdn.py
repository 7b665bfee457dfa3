"""A small Gated DeltaNet forward for compute-sanitizer (run on the GPU host, from
precompiled artifacts of tests/gpu_plan.toml's bf16 K = V = 128, 4-head, l2norm entry):

    compute-sanitizer --tool memcheck --report-api-errors no python tests/gpu_sanitize_gdn.py [BATCH ...]

Ragged lengths with empty and one-token sequences and a partial last chunk, then 40 such
sequences (more than 32: the kernels read the per-sequence table): batches "ragged" and
"many", both unless named. Each result is checked against the float64 recurrence so a
silent wrong answer fails too."""
import sys

import torch

from precast import gated_delta_net
from precast.reference.gated_delta_net import gdn_recurrent_reference, rms_error_ratio
from precast.reference.offsets import offsets_from_lengths

# Also the backward script's batches (tests/gpu_sanitize_gdn_bwd.py).
# "many": 40 sequences, more than 32, so the kernels read the per-sequence table
BATCHES = {"ragged": [70, 0, 1, 64, 5], "many": [3, 0, 1, 64, 70] * 8}
H, K, V = 4, 128, 128


def inputs(lens):
    """q, k, v, gate, beta, cu_seqlens of one batch, and the generator that made them (the
    backward script draws its cotangents from it next)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    T = sum(lens)
    q, k = (torch.randn(T, H, K, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(T, H, V, device="cuda", generator=g).bfloat16()
    gate = -0.05 * torch.rand(T, H, device="cuda", generator=g)
    beta = torch.rand(T, H, device="cuda", generator=g)
    cu = offsets_from_lengths(lens, device="cuda")
    return (q, k, v, gate, beta, cu), g


def chosen_batches(names) -> dict:
    """The batches named on the command line (all when none): racecheck of the backward
    over both takes minutes, "ragged" alone well under one."""
    unknown = [n for n in names if n not in BATCHES]
    if unknown:
        raise SystemExit(f"unknown batch {unknown[0]!r}; choose from {', '.join(BATCHES)}")
    return {n: BATCHES[n] for n in (names or BATCHES)}


def main(names=()) -> int:
    failures = []
    for what, lens in chosen_batches(list(names)).items():
        (q, k, v, gate, beta, cu), _ = inputs(lens)
        o, final = gated_delta_net(q, k, v, gate, beta, cu, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True)
        torch.cuda.synchronize()
        ref = gdn_recurrent_reference(q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True)
        for name, got, want in (("o", o, ref["o"]),
                                ("final state", final, ref["final_state"])):
            ratio = rms_error_ratio(got, want)
            print(f"{what}: {name}: RMS error ratio {ratio:.3g}", flush=True)
            if not ratio < 2e-2:
                failures.append(f"{what}: {name}")
    print("all ok" if not failures else "FAILED: " + ", ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
