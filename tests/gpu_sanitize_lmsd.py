"""A small LMSD forward + backward for compute-sanitizer (run on the GPU host):

    compute-sanitizer --tool memcheck python tests/gpu_sanitize_lmsd.py

The last two sizes have more row blocks than the forward's CTAs take by number, so its
CTAs also claim blocks from the scheduler counter.
"""
import torch

from precast import hstu_lmsd_backward, hstu_lmsd_forward

for n, d in ((37, 520), (5, 4096), (3, 8), (1, 512), (8000, 512), (3001, 4096)):
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    u = torch.randn_like(x)
    w, b = torch.randn(d, device="cuda", dtype=torch.bfloat16), torch.randn(d, device="cuda", dtype=torch.bfloat16)
    y, mean, rstd, mask = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.1, 3, True, True, True)
    grads = hstu_lmsd_backward(torch.randn_like(y), x, u, w, b, mean, rstd, mask, 0.1, True, True, True)
    torch.cuda.synchronize()
    print(n, d, "ok", float(grads[0].float().abs().sum()))
