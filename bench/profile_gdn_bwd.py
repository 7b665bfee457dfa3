"""One Gated DeltaNet backward (gated_delta_net_backward: every kernel once) at a
bench_gdn_bwd case, for ncu:

    ncu --clock-control none -k regex:GdnStateGrad --section WarpStateStats ... \
        python bench/profile_gdn_bwd.py [CASE]
"""
import sys

import torch

from bench_gdn_bwd import CASES, make_inputs

from precast import gated_delta_net_backward

q, k, v, g, beta, cu, do = make_inputs(*CASES[sys.argv[1] if len(sys.argv) > 1
                                                else "1x32768-hv32"])
gated_delta_net_backward(q, k, v, g, beta, cu, do, use_qk_l2norm_in_kernel=True)
torch.cuda.synchronize()
