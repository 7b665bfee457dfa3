"""One LMSD forward (and backward) launch at the benchmark size, for ncu:

    ncu --clock-control none -k regex:Lmsd --section SpeedOfLight ... python bench/profile_lmsd.py
"""
import sys

import torch

from precast import hstu_lmsd_backward, hstu_lmsd_forward
from precast.benchmarking import lmsd_inputs

rows, dim = 1 << 20, int(sys.argv[1]) if len(sys.argv) > 1 else 512
x, u, w, b = lmsd_inputs(rows, dim)
y, mean, rstd, mask = hstu_lmsd_forward(x, u, w, b, 1e-5, 0.1, 1, True, True, True)
hstu_lmsd_backward(torch.randn_like(y), x, u, w, b, mean, rstd, mask, 0.1, True, True, True)
torch.cuda.synchronize()
