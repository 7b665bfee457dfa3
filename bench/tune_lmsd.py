"""Times LMSD kernel variants (vecs_per_thread, backward grid size, dropout on/off) at one
size, against the copy ceiling measured in the same run. Artifacts: bench/tune_plan.toml."""
from __future__ import annotations

import torch

from common import copy_bandwidth, do_bench, environment, lmsd_inputs, lmsd_traffic_bytes, write_json
from precast import HstuLmsdBwdSm90, HstuLmsdFwdSm90


def main(rows=1 << 20, dims=(512, 1024)):
    bw = copy_bandwidth()
    env = environment()
    print(f"{env['gpu']} {env['date']} copy {bw / 1e12:.2f} TB/s")
    out = []
    for d in dims:
        x, u, w, b = lmsd_inputs(rows, d)
        y = torch.empty(rows, 3 * d, device="cuda", dtype=torch.bfloat16)
        mean = torch.empty(rows, device="cuda")
        rstd = torch.empty_like(mean)
        mask = torch.empty(rows, d, device="cuda", dtype=torch.int8)
        p = 0.1
        for vpt in (1, 2):
            for cap in (0, 3, 5):
                op = HstuLmsdFwdSm90(x, u, w, b, y, mean, rstd, mask, dropout_ratio=p, concat_u=True,
                                     concat_x=True, vecs_per_thread=vpt, min_ctas_per_sm=cap).compile()
                ms = do_bench(lambda: op.execute(x, u, w, b, y, mean, rstd, mask, seed=1))
                nbytes = lmsd_traffic_bytes(rows, d, "fwd")
                r = nbytes / (ms * 1e-3) / bw
                print(f"fwd D={d} p={p} vpt={vpt} min_ctas={cap}: {ms:.3f} ms  {r:.3f} x copy")
                out.append(("fwd", d, p, vpt, cap, 0, ms, r))
        op = HstuLmsdFwdSm90(x, u, w, b, y, mean, rstd, mask, dropout_ratio=0.1, concat_u=True,
                             concat_x=True).compile()
        op.execute(x, u, w, b, y, mean, rstd, mask, seed=1)
        dy = torch.randn_like(y)
        dx, du, dw, db = torch.empty_like(x), torch.empty_like(u), torch.empty_like(w), torch.empty_like(b)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        for vpt, cap in ((v, c) for v in (1, 2) for c in (0, 3, 4)):
            op = HstuLmsdBwdSm90(dy, x, u, w, b, mean, rstd, mask, dx, du, dw, db, dropout_ratio=0.1,
                                 concat_u=True, concat_x=True, vecs_per_thread=vpt,
                                 min_ctas_per_sm=cap).compile()
            rpc = op.tiling.rows_per_cta
            for per_sm in sorted({2, 4, max(cap, 2)}):
                ws = torch.empty(sms * per_sm * rpc, 2, d, device="cuda")
                ms = do_bench(lambda: op.execute(dy, x, u, w, b, mean, rstd, mask, dx, du, dw, db, ws))
                nbytes = lmsd_traffic_bytes(rows, d, "bwd")
                r = nbytes / (ms * 1e-3) / bw
                print(f"bwd D={d} vpt={vpt} min_ctas={cap} grid/SM={per_sm}: {ms:.3f} ms  {r:.3f} x copy")
                out.append(("bwd", d, 0.1, vpt, cap, per_sm, ms, r))
        del x, u, y, dy, mask, dx, du
        torch.cuda.empty_cache()
    write_json("tune_lmsd.json", {"env": env, "copy_bandwidth": bw, "rows": out})


if __name__ == "__main__":
    main()
