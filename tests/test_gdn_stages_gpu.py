"""The two Gated DeltaNet forward kernels one at a time, on the GPU, from precompiled
artifacts (configurations of tests/gpu_plan.toml), so that a wrong result is placed in one
stage: stage 1 ("prepare") against the reference workspace
(precast/reference/gdn_workspace.py), and stage 2 ("recurrence") fed with that reference
workspace instead of stage 1's output, against the float64 recurrence. Outputs are poisoned
with NaN first; every written element is checked."""
import pytest
import torch

from precast import GdnBwdSm90, GdnFwdSm90
from precast.reference.gated_delta_net import (CHUNK_SIZE, gdn_recurrent_reference,
                                               rms_error_ratio)
from precast.reference.gdn_workspace import (gdn_chunk_workspace_reference, pack_work16,
                                            unpack_work16)
from precast.reference.offsets import offsets_from_lengths

pytestmark = pytest.mark.gpu
DEV = "cuda"
C = CHUNK_SIZE
LENS = [497, 16, 1, 480, 0, 253]
H, K, V = 4, 128, 128


def batch(lens, dtype=torch.bfloat16, seed=0, k_dim=K, v_dim=V):
    g = torch.Generator(device=DEV).manual_seed(seed)
    T = sum(lens)
    q, k = (torch.randn(T, H, k_dim, device=DEV, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(T, H, v_dim, device=DEV, generator=g).to(dtype)
    gate = -0.05 * torch.rand(T, H, device=DEV, generator=g)
    beta = torch.rand(T, H, device=DEV, generator=g)
    cu = offsets_from_lengths(lens, device=DEV)
    return q, k, v, gate, beta, cu


def compiled_op(q, k, v, gate, beta, cu):
    return GdnFwdSm90(q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True,
                      output_final_state=True).check_support().compile()


def rel_err(got, want):
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@pytest.mark.parametrize("kind", ["forward", "backward", "forward, K = V = 64"])
def test_stage1_matches_the_reference(kind):
    """Stage 1 (the forward's artifact and the backward's: the same kernel) against the
    reference workspace: T = (I + A)^-1 and M in work16 (the packed P), both factor rows
    ([q_f | k_f | G_L] and [t_w | t_u]) in work32. At K = 64 the dead q and k tiles are too
    small for A and M, which get their own tile (a code path of its own)."""
    dk = dv = 64 if kind.endswith("64") else K
    q, k, v, gate, beta, cu = batch(LENS, k_dim=dk, v_dim=dv)
    if kind == "forward":
        op = compiled_op(q, k, v, gate, beta, cu)
        s16, s32 = op.workspace_shapes(q.shape[0], len(LENS))
    elif kind.endswith("64"):  # test_gdn_fwd_gpu's "bf16-d64-io-state"
        op = GdnFwdSm90.from_config(
            dtype="bfloat16", k_dim=dk, v_dim=dv, q_heads=H, k_heads=H, v_heads=H,
            g_dtype="float32", beta_dtype="float32", state_dtype="io",
            output_final_state=True, use_qk_l2norm_in_kernel=True)
        s16, s32 = op.workspace_shapes(q.shape[0], len(LENS))
    else:  # tests/gpu_plan.toml's entries (test_gdn_bwd_gpu's "bf16")
        op = GdnBwdSm90.from_config(
            dtype="bfloat16", k_dim=K, v_dim=V, q_heads=H, k_heads=H, v_heads=H,
            g_dtype="float32", beta_dtype="float32", use_qk_l2norm_in_kernel=True,
            state_dtype="none", final_state_grad=True, checkpoint_dtype="none")
        shapes = op.workspace_shapes(q.shape[0], len(LENS))
        s16, s32 = shapes["work16"], shapes["work32"]
    prepare = op.check_support().compile()._ready(0)["prepare"]
    work, factors, inv, scales = gdn_chunk_workspace_reference(
        q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True, with_inverse=True)
    work16 = torch.full(s16, float("nan"), dtype=q.dtype, device=DEV)
    work32 = torch.full(s32, float("nan"), device=DEV)
    prepare(q, k, v, gate, beta, cu, cu, work16, work32, dk ** -0.5,
            torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    chunks = sum(-(-n // C) for n in LENS)
    F = s32[-1] // 2  # a factor row's padded length
    got_p = work16[:chunks]
    got_f, got_s = work32[:chunks, :, :2 * C + 1], work32[:chunks, :, F:F + 2 * C]
    for name, got in (("P", got_p), ("factors", got_f), ("scales", got_s)):
        assert not torch.isnan(got).any(), name
    got_t, got_m = unpack_work16(got_p)
    for name, got, want in (("T", got_t, inv), ("M", got_m, work[..., dk + dv:])):
        err = rel_err(got, want[:chunks])
        assert err < 2e-2, f"{name}: max|got - want| / max|want| = {err:.3g}"
    torch.testing.assert_close(got_f, factors[:chunks], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_s, scales[:chunks], rtol=1e-4, atol=1e-5)


def recurrence_on_the_reference_workspace(mode, q, k, v, gate, beta, cu):
    """Stage 2 kernel ``mode`` of the batch's op, fed the reference workspace as stage 1
    lays it out (T and M packed; the factor rows padded as gdn_layout says, the scales in the
    second): NaN-poisoned (o, final state)."""
    op = compiled_op(q, k, v, gate, beta, cu)
    work, factors, inv, scales = gdn_chunk_workspace_reference(
        q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True, with_inverse=True)
    _, s32 = op.workspace_shapes(q.shape[0], len(LENS))
    work32 = torch.zeros(s32, device=DEV)
    work32[..., :2 * C + 1] = factors
    F = s32[-1] // 2
    work = pack_work16(inv, work[..., K + V:])  # P from T and [W | U | M]'s M
    work32[..., F:F + 2 * C] = scales
    o = torch.full((sum(LENS), H, V), float("nan"), dtype=q.dtype, device=DEV)
    final = torch.full((len(LENS), H, V, K), float("nan"), device=DEV)
    op._ready(0)[mode](q, k, work.to(q.dtype), work32, cu, cu, o, None, None, final, None,
                       v, 0, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return o, final


def test_stage2_on_the_reference_workspace_matches_the_recurrence():
    q, k, v, gate, beta, cu = batch(LENS, seed=1)
    o, final = recurrence_on_the_reference_workspace("recurrence", q, k, v, gate, beta, cu)
    ref = gdn_recurrent_reference(q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True)
    assert not torch.isnan(o).any() and not torch.isnan(final).any()
    for name, got, want in (("o", o, ref["o"]), ("final state", final, ref["final_state"])):
        ratio = rms_error_ratio(got, want)
        assert ratio < 2e-2, f"{name}: RMS error ratio {ratio:.3g}"


def test_split_recurrence_equals_one_cta_per_sequence_and_head():
    """Stage 2 with two CTAs per (sequence, head) (64 state rows each) is bitwise the
    one-CTA kernel: every row's arithmetic is the same."""
    batch_ = batch(LENS, seed=2)
    o1, f1 = recurrence_on_the_reference_workspace("recurrence", *batch_)
    o2, f2 = recurrence_on_the_reference_workspace("recurrence_split", *batch_)
    assert not torch.isnan(o2).any() and not torch.isnan(f2).any()
    assert torch.equal(o1, o2) and torch.equal(f1, f2)
