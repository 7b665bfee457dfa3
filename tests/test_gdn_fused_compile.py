"""The fused one-kernel Gated DeltaNet forward (precast/kernels/gdn_fwd_sm90.py) is not used
by the op yet (it is next in line once the two-stage kernels are validated on a GPU): keep it
cross-compiling for sm_90a, with the fake arguments the op builds for the two stages."""
import pytest
import torch

from precast.lifecycle import gdn_fwd
from precast.lifecycle.gdn_fwd import GdnFwdSm90


@pytest.mark.compile
@pytest.mark.parametrize("k_dim,v_dim,state", [(128, 128, "float32"), (64, 64, "none")])
def test_fused_kernel_cross_compiles(k_dim, v_dim, state):
    import cutlass
    import cutlass.cute as cute
    from precast.kernels.fake import fake_stream, fake_tokens, scalar
    from precast.kernels.gdn_fwd_sm90 import GdnForwardSm90
    op = GdnFwdSm90.from_config(k_dim=k_dim, v_dim=v_dim, state_dtype=state,
                                output_final_state=True, checkpoint_dtype="float32",
                                use_qk_l2norm_in_kernel=True).check_support()
    s = op.shapes
    io = cutlass.BFloat16
    kernel = GdnForwardSm90(io, s.K, s.V, s.HQ, s.HK, s.HV, True, cutlass.Float32,
                            cutlass.Float32, s.state_dtype is not None, False, True, True)
    tokens = cute.sym_int()
    args = (fake_tokens(io, tokens, s.HQ, s.K), fake_tokens(io, tokens, s.HK, s.K),
            fake_tokens(io, tokens, s.HV, s.V), gdn_fwd._fake_gate(torch.float32, tokens, s.HO),
            gdn_fwd._fake_gate(torch.float32, tokens, s.HO), gdn_fwd._fake_offsets(),
            fake_tokens(io, tokens, s.HO, s.V),
            None if s.state_dtype is None else gdn_fwd._fake_state(s.state_dtype, s), None,
            gdn_fwd._fake_state(torch.float32, s), gdn_fwd._fake_state(torch.float32, s),
            scalar(cutlass.Float32, 1.0), scalar(cutlass.Int32, 64), fake_stream())
    compiled = cute.compile(kernel, *args, options="--enable-tvm-ffi --gpu-arch sm_90a")
    assert compiled is not None
