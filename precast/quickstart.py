"""``precast quickstart``: build the default plan; on a GPU also check and time the ops."""
from __future__ import annotations

import sys
from pathlib import Path


def _check_and_time() -> None:
    import torch

    from .benchmarking import copy_bandwidth, do_bench, lmsd_inputs, lmsd_traffic_bytes
    from .hstu_lmsd import hstu_lmsd_backward, hstu_lmsd_forward
    from .reference.lmsd import lmsd_backward_reference, lmsd_forward_reference

    bw = copy_bandwidth(0.5)
    print(f"\n{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'op':<22}{'D':>6}{'rows':>9}{'ms':>9}{'TB/s':>7}{'x copy':>8}{'max rel err':>13}")
    rows, p = 1 << 18, 0.1
    for dim in (256, 512, 1024):
        x, u, w, b = lmsd_inputs(rows, dim)
        fwd = hstu_lmsd_forward(x, u, w, b, 1e-5, p, 7, True, True, True)
        ref = lmsd_forward_reference(x, u, w, b, 1e-5, p, 7, True, True, True, mask=fwd.mask_tensor)
        err_f = ((fwd.y_tensor.float() - ref[0]).norm() / ref[0].norm()).item()
        ms_f = do_bench(lambda: hstu_lmsd_forward(x, u, w, b, 1e-5, p, 7, True, True, True,
                                                  y_tensor=fwd[0], mean_tensor=fwd[1],
                                                  rstd_tensor=fwd[2], mask_tensor=fwd[3]))
        dy = torch.randn_like(fwd.y_tensor)
        bwd = hstu_lmsd_backward(dy, x, u, w, b, fwd[1], fwd[2], fwd[3], p, True, True, True)
        ref_b = lmsd_backward_reference(dy, x, u, w, b, fwd[1], fwd[2], fwd[3], p, True, True, True)
        err_b = max(((g.float() - r).norm() / r.norm()).item() for g, r in zip(bwd, ref_b))
        ms_b = do_bench(lambda: hstu_lmsd_backward(dy, x, u, w, b, fwd[1], fwd[2], fwd[3], p, True,
                                                   True, True, dx_tensor=bwd[0], du_tensor=bwd[1],
                                                   dweight_tensor=bwd[2], dbias_tensor=bwd[3]))
        for name, ms, nbytes, err in (
                ("hstu_lmsd_forward", ms_f, lmsd_traffic_bytes(rows, dim, "fwd"), err_f),
                ("hstu_lmsd_backward", ms_b, lmsd_traffic_bytes(rows, dim, "bwd"), err_b)):
            rate = nbytes / (ms * 1e-3)
            print(f"{name:<22}{dim:>6}{rows:>9}{ms:>9.3f}{rate / 1e12:>7.2f}{rate / bw:>8.2f}"
                  f"{err:>13.1e}")


def _check_and_time_attention() -> None:
    import math

    import torch

    from .benchmarking import do_bench, matmul_rate
    from .hstu_attention import hstu_attention_backward, hstu_attention_forward
    from .reference.offsets import offsets_from_lengths
    from .reference.hstu_attention import (BACKWARD_FLOPS_FACTOR, attention_flops,
                                           hstu_attention_backward_reference,
                                           hstu_attention_reference)

    def batch(lens, d=128, heads=4):
        cu = offsets_from_lengths(lens, device="cuda")
        q, k, v = (torch.randn(sum(lens), heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        return q, k, v, cu

    mm = matmul_rate()
    print(f"\ntorch bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    print(f"{'op':<24}{'case':>22}{'us':>9}{'TFLOP/s':>9}{'x matmul':>9}{'max rel err':>13}")
    lens = [497, 16, 1, 480, 0, 253]  # ragged, with empty and 1-token sequences
    q, k, v, cu = batch(lens)
    alpha = 1 / math.sqrt(128)
    o = hstu_attention_forward(q, k, v, cu, cu, max(lens), max(lens), alpha=alpha).o_tensor
    ref = hstu_attention_reference(q, k, v, cu, cu, max(lens), max(lens), alpha=alpha)
    err = ((o.float() - ref).abs().max() / ref.abs().max()).item()
    do = torch.randn_like(q)
    grads = hstu_attention_backward(do, q, k, v, cu, cu, max(lens), max(lens), alpha=alpha)
    refs = hstu_attention_backward_reference(do, q, k, v, cu, cu, max(lens), max(lens),
                                             alpha=alpha)
    err_bwd = max(((g.float() - r).abs().max() / r.abs().max()).item()
                  for g, r in zip(grads, refs))
    seqlen = 4096
    q, k, v, cu = batch([seqlen] * 16)
    out, do = torch.empty_like(q), torch.randn_like(q)
    buffers = dict(dq_tensor=torch.empty_like(q), dk_tensor=torch.empty_like(k),
                   dv_tensor=torch.empty_like(v))
    flops = attention_flops(cu.cpu(), cu.cpu(), 4, 128, (-1, 0))
    case = "causal 16 x 4096, D 128"
    ms = do_bench(lambda: hstu_attention_forward(q, k, v, cu, cu, seqlen, seqlen, o_tensor=out))
    rate = flops / (ms * 1e-3)
    print(f"{'hstu_attention_forward':<24}{case:>22}{ms * 1e3:>9.1f}"
          f"{rate / 1e12:>9.1f}{rate / mm:>9.2f}{err:>13.1e}")
    ms = do_bench(lambda: hstu_attention_backward(do, q, k, v, cu, cu, seqlen, seqlen,
                                                  **buffers))
    rate = BACKWARD_FLOPS_FACTOR * flops / (ms * 1e-3)
    print(f"{'hstu_attention_backward':<24}{case:>22}{ms * 1e3:>9.1f}"
          f"{rate / 1e12:>9.1f}{rate / mm:>9.2f}{err_bwd:>13.1e}")


def _check_and_time_gdn() -> None:
    import torch

    from .benchmarking import do_bench, gdn_inputs
    from .linear_attention import gated_delta_net, gated_delta_net_backward
    from .reference.gated_delta_net import (forward_flops, gdn_recurrent_reference,
                                            rms_error_ratio)
    from .reference.gdn_backward import gdn_chunked_backward_reference

    heads, dim = 64, 128  # the default plan's Gated DeltaNet entries

    def batch(lens):
        """gdn_inputs with an output gradient."""
        q, k, v, g, beta, cu = gdn_inputs(lens, heads, heads, dim)
        return q, k, v, g, beta, cu, torch.randn_like(v)

    print(f"\n{'op':<26}{'case':>22}{'us':>9}{'M tokens/s':>11}{'TFLOP/s':>9}"
          f"{'rms err ratio':>15}")
    options = dict(use_qk_l2norm_in_kernel=True)
    lens = [497, 16, 1, 480, 0, 253]  # ragged, with empty and 1-token sequences
    q, k, v, g, beta, cu, do = batch(lens)
    o, _ = gated_delta_net(q, k, v, g, beta, cu, output_final_state=True, **options)
    err_f = rms_error_ratio(o, gdn_recurrent_reference(q, k, v, g, beta, cu, **options)["o"])
    grads = gated_delta_net_backward(q, k, v, g, beta, cu, do, **options)
    refs = gdn_chunked_backward_reference(q, k, v, g, beta, cu, do, **options)
    err_b = max(rms_error_ratio(got, refs[name])
                for name, got in zip(("dq", "dk", "dv", "dg", "dbeta"), grads))
    seqs, seqlen = 4, 8192
    q, k, v, g, beta, cu, do = batch([seqlen] * seqs)
    case = f"{seqs} x {seqlen}, {heads} heads"
    flops = forward_flops([seqlen] * seqs, heads, dim, dim)
    fwd_us = do_bench(lambda: gated_delta_net(q, k, v, g, beta, cu, output_final_state=True,
                                              **options)) * 1e3
    bwd_us = do_bench(lambda: gated_delta_net_backward(q, k, v, g, beta, cu, do,
                                                       **options)) * 1e3
    tokens = seqs * seqlen
    for name, us, rate, err in (
            ("gated_delta_net", fwd_us, f"{flops / (fwd_us * 1e-6) / 1e12:>9.1f}", err_f),
            ("gated_delta_net_backward", bwd_us, f"{'':>9}", err_b)):
        print(f"{name:<26}{case:>22}{us:>9.1f}{tokens / us:>11.2f}{rate}{err:>15.1e}")


def run(plan: Path, arch=None, jobs=None) -> int:
    from .lifecycle.arch import device_arch
    from .lifecycle.cache import default_cache_dir, dsl_available
    from .plan import load_plan, precompile

    gpu = device_arch()
    entries = load_plan(plan)
    if dsl_available():
        if gpu is None and arch is None:
            arch = "sm_90a"
        results = precompile(entries, arch=arch, jobs=jobs)
        failed = [e for e, r in results if isinstance(r, Exception)]
        print(f"built {len(results) - len(failed)} of {len(results)} kernels from {plan} for "
              f"{arch or gpu} into {default_cache_dir()}")
        for entry in failed:
            print(f"  FAILED {entry.describe()}")
        if failed:
            return 1
    else:
        print("nvidia-cutlass-dsl is not installed: using precompiled artifacts from "
              f"{default_cache_dir()}")
    if gpu is None:
        print("no GPU here: copy the cache folder to a GPU host (or set PRECAST_CACHE_DIR there) "
              "and run `precast quickstart` on it to check and time the ops")
        return 0
    if gpu != "sm_90a":
        print(f"this GPU is {gpu}; precast's kernels are built for sm_90a (Hopper)")
        return 1
    _check_and_time()
    _check_and_time_attention()
    _check_and_time_gdn()
    return 0


if __name__ == "__main__":
    sys.exit(run(Path(__file__).parent / "plans" / "default.toml"))
