"""The stage-1 workspace contract of the Gated DeltaNet forward kernels
(precast/reference/gdn_workspace.py): stage 2's per-chunk updates, written in its transposed
form (S^T in, Delta^T = U^T - S^T W^T, O^T = S^T Q^T diag(q_f) + Delta^T M^T,
S^T = exp(G_L) S^T + Delta^T diag(k_f) K, with the raw q and k rows), applied to the reference
workspace reproduce the token-by-token recurrence in float64: o, the final state and the
checkpoints. CPU only."""
import pytest
import torch

from precast.reference.gated_delta_net import CHUNK_SIZE, gdn_recurrent_reference
from precast.reference.gdn_workspace import (gdn_chunk_workspace_reference, pack_work16,
                                            unpack_work16)
from precast.reference.offsets import offsets_from_lengths

C = CHUNK_SIZE


def stage2_emulated(work, factors, q, k, lens, s0, K, V):
    """Stage 2 in torch: per sequence, per chunk, the transposed updates (q, k with their
    heads expanded to HO)."""
    HO = s0.shape[1]
    o = work.new_zeros((sum(lens), HO, V))
    final = torch.empty_like(s0)
    checkpoints = []
    p = start = 0
    for b, length in enumerate(lens):
        st = s0[b].clone()  # [HO, V, K] = S^T
        chunks = -(-length // C)
        for c in range(chunks):
            checkpoints.append(st.clone())
            w = work[p + c]
            w_, u, m = w[..., :K], w[..., K:K + V], w[..., K + V:]
            q_f, k_f, g_last = (factors[p + c, :, :C], factors[p + c, :, C:2 * C],
                                factors[p + c, :, 2 * C])
            rows = min(length - c * C, C)
            first = start + c * C
            qc, kc = (x.new_zeros((C, HO, K)) for x in (q, k))  # past the end: zeros
            qc[:rows], kc[:rows] = q[first:first + rows], k[first:first + rows]
            qc, kc = qc.movedim(1, 0), kc.movedim(1, 0)  # [HO, C, K]
            delta_t = u.transpose(-1, -2) - st @ w_.transpose(-1, -2)
            o_t = (st @ qc.transpose(-1, -2)) * q_f[:, None, :] + delta_t @ m.transpose(-1, -2)
            st = torch.exp(g_last)[:, None, None] * st + (delta_t * k_f[:, None, :]) @ kc
            o[start + c * C:start + c * C + rows] = o_t[..., :rows].movedim(-1, 0)
        final[b] = st
        p += chunks
        start += length
    return o, final, torch.stack(checkpoints) if checkpoints else None


@pytest.mark.parametrize("lens,hq,hv,k_dim,v_dim,l2norm", [
    ([130, 1, 0, 64, 65], 2, 4, 64, 32, True),
    ([7] * 5 + [1] * 3, 4, 2, 32, 64, False),
    ([200], 1, 1, 16, 16, True),
])
def test_stage2_on_the_workspace_reproduces_the_recurrence(lens, hq, hv, k_dim, v_dim, l2norm):
    g = torch.Generator().manual_seed(len(lens))
    T, HO = sum(lens), max(hq, hv)
    f64 = dict(dtype=torch.float64)
    cu = offsets_from_lengths(lens)
    q = torch.randn(T, hq, k_dim, generator=g, **f64)
    k = torch.randn(T, hq, k_dim, generator=g, **f64)
    v = torch.randn(T, hv, v_dim, generator=g, **f64)
    gate = -0.1 * torch.rand(T, HO, generator=g, **f64)
    beta = torch.rand(T, HO, generator=g, **f64)
    s0 = 0.1 * torch.randn(len(lens), HO, v_dim, k_dim, generator=g, **f64)
    ref = gdn_recurrent_reference(q, k, v, gate, beta, cu, initial_state=s0,
                                  use_qk_l2norm_in_kernel=l2norm, checkpoint_every_n_tokens=C)
    work, factors = gdn_chunk_workspace_reference(q, k, v, gate, beta, cu,
                                                  use_qk_l2norm_in_kernel=l2norm,
                                                  compute_dtype=torch.float64)
    assert work.shape == (T // C + len(lens), HO, C, k_dim + v_dim + C)
    assert factors.shape == (T // C + len(lens), HO, 2 * C + 1)
    chunks = sum(-(-n // C) for n in lens)
    assert torch.count_nonzero(work[chunks:]) == 0
    assert torch.count_nonzero(factors[chunks:]) == 0
    qe, ke = (x.repeat_interleave(HO // x.shape[1], dim=1) for x in (q, k))
    o, final, checkpoints = stage2_emulated(work, factors, qe, ke, lens, s0, k_dim, v_dim)
    torch.testing.assert_close(o, ref["o"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, ref["final_state"], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(checkpoints, ref["checkpoints"], rtol=1e-10, atol=1e-10)


def test_rows_past_a_sequence_end_are_zero():
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(70, 1, 16, generator=g) for _ in range(2))
    v = torch.randn(70, 1, 8, generator=g)
    gate, beta = -torch.rand(70, 1, generator=g), torch.rand(70, 1, generator=g)
    cu = torch.tensor([0, 70], dtype=torch.int32)
    work, factors = gdn_chunk_workspace_reference(q, k, v, gate, beta, cu)
    assert torch.count_nonzero(work[1, :, 6:]) == 0  # chunk 1 holds rows 64..69 only
    assert torch.count_nonzero(work[1, :, :6]) > 0
    for part in (factors[1, :, :64], factors[1, :, 64:128]):  # q_f, k_f
        assert torch.count_nonzero(part[:, 6:]) == 0 and torch.count_nonzero(part[:, :6]) == 6
    torch.testing.assert_close(factors[1, 0, 128], gate[64:, 0].sum())  # G_L


@pytest.mark.parametrize("lens,hq,hv,l2norm", [([130, 1, 0, 64, 65], 2, 4, True),
                                               ([7] * 3 + [1], 4, 2, False)])
def test_inverse_and_its_scales_make_w_and_u(lens, hq, hv, l2norm):
    """What stage 1 writes for the recurrence and the backward: T and [t_w | t_u] give the
    contract's W = T diag(t_w) K and U = T diag(t_u) V with the raw k and v rows; past a
    sequence's end T has identity rows and both scales are zero."""
    g = torch.Generator().manual_seed(3)
    T, HO, K, V = sum(lens), max(hq, hv), 32, 16
    f64 = dict(dtype=torch.float64)
    cu = offsets_from_lengths(lens)
    q, k = (torch.randn(T, hq, K, generator=g, **f64) for _ in range(2))
    v = torch.randn(T, hv, V, generator=g, **f64)
    gate, beta = -0.1 * torch.rand(T, HO, generator=g, **f64), torch.rand(T, HO, generator=g, **f64)
    work, factors, inv, scales = gdn_chunk_workspace_reference(
        q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=l2norm, compute_dtype=torch.float64,
        with_inverse=True)
    assert inv.shape == (T // C + len(lens), HO, C, C) and scales.shape[2] == 2 * C
    same, _ = gdn_chunk_workspace_reference(q, k, v, gate, beta, cu,
                                            use_qk_l2norm_in_kernel=l2norm,
                                            compute_dtype=torch.float64)
    assert torch.equal(same, work)
    ke, ve = (x.repeat_interleave(HO // x.shape[1], dim=1) for x in (k, v))
    p = start = 0
    for length in lens:
        for c in range(-(-length // C)):
            rows = min(length - c * C, C)
            kc, vc = (x.new_zeros((C, HO, x.shape[2])) for x in (ke, ve))
            kc[:rows] = ke[start + c * C:start + c * C + rows]
            vc[:rows] = ve[start + c * C:start + c * C + rows]
            t_w, t_u = scales[p, :, :C], scales[p, :, C:]
            w = inv[p] @ (t_w[..., None] * kc.movedim(1, 0))
            u = inv[p] @ (t_u[..., None] * vc.movedim(1, 0))
            torch.testing.assert_close(w, work[p, ..., :K], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(u, work[p, ..., K:K + V], rtol=1e-10, atol=1e-10)
            assert torch.count_nonzero(scales[p, :, rows:C]) == 0
            assert torch.equal(inv[p, :, rows:, rows:], torch.eye(C - rows, **f64).expand(
                HO, -1, -1)) and torch.count_nonzero(inv[p, :, rows:, :rows]) == 0
            p += 1
        start += length
    chunks = sum(-(-n // C) for n in lens)
    assert torch.count_nonzero(inv[chunks:]) == 0 and torch.count_nonzero(scales[chunks:]) == 0


def test_packed_block_holds_t_and_m_and_unpacks_exactly():
    """work16's packed block (gdn_layout): M's lower triangle with its diagonal, T's strict
    lower triangle transposed above it; unpacking gives T (unit diagonal) and M back
    bitwise, including identity rows of T and zero rows of M past a sequence's end."""
    g = torch.Generator().manual_seed(4)
    lens = [70, 1, 64]
    T, HO, K, V = sum(lens), 2, 32, 16
    cu = offsets_from_lengths(lens)
    q, k = (torch.randn(T, HO, K, generator=g) for _ in range(2))
    v = torch.randn(T, HO, V, generator=g)
    gate, beta = -0.1 * torch.rand(T, HO, generator=g), torch.rand(T, HO, generator=g)
    work, _, inv, _ = gdn_chunk_workspace_reference(q, k, v, gate, beta, cu,
                                                    with_inverse=True)
    m = work[..., K + V:]
    chunks = sum(-(-n // C) for n in lens)
    t, m = inv[:chunks], m[:chunks]
    packed = pack_work16(t, m)
    assert packed.shape == t.shape
    i, j = torch.meshgrid(torch.arange(C), torch.arange(C), indexing="ij")
    assert torch.equal(packed[..., i >= j], m[..., i >= j])
    assert torch.equal(packed[..., i < j], t.transpose(-1, -2)[..., i < j])
    t2, m2 = unpack_work16(packed)
    assert torch.equal(t2, t) and torch.equal(m2, m)
    # chunk 1 holds rows 64..69 of the first sequence: identity rows of T past them
    eye_rows = torch.eye(C)[6:]
    assert torch.equal(t2[1, :, 6:], eye_rows.expand(HO, -1, -1))
