"""The Gated DeltaNet forward's workspace layout: plain Python (neither cutlass nor torch),
so that the op's execute() sizes it where the compiler is not installed.

Per (chunk, output head), what precast/reference/gdn_workspace.py computes: work16 holds
one packed 64 x 64 block P (the io dtype) of the two triangular matrices stage 1 makes,
M (the scaled, gated, causal Q K^T, diagonal included) and T = (I + A)^-1 (unit lower
triangular):

    P[i, j] = M[i, j]  (j <= i),      P[i, j] = T[j, i]  (j > i; T's unit diagonal implied)

(pack_work16 / unpack_work16 there). Every reader splits P back into T and M in shared
memory (kernels/gdn_unpack_sm90.py): 8 KB per (chunk, head) instead of 16 for both
tiles, written by stage 1 and read by the recurrence and by each of the backward's
kernels. T's column scales make W and U, which no kernel of the ops forms in memory.
work32 holds two factor rows of FACTOR_COLS floats each (padded so that each starts
32-byte aligned): [q_f | k_f | G_L] (64, 64, 1), then [t_w | t_u] (64, 64) (the fused
kernel, which keeps its factors in shared memory, writes neither): the column scales of T
that make the scaled inverses Tw = T diag(t_w), t_w = beta gamma r_k, and Tu = T diag(t_u),
t_u = beta (W = Tw K and U = Tu V with the raw k and v rows). The backward reads T and
these scales instead of W and U: 8 KB of P and 0.5 KB of scales per (chunk, head) instead
of 32 KB."""

CHUNK = 64
WORK16_COLS = CHUNK  # the packed block P
Q_FACTORS, K_FACTORS, G_LAST = 0, CHUNK, 2 * CHUNK  # columns of the first factor row
W_FACTORS, U_FACTORS = 0, CHUNK  # columns of the second
FACTOR_COLS = 2 * CHUNK + 8
FACTOR_ROWS = 2


def workspace_shapes(total_tokens: int, num_seqs: int, heads: int, k_dim: int, v_dim: int):
    """(work16 shape, work32 shape) for a batch of T tokens in N sequences: one row block
    per (chunk, head), chunks bounded by T // 64 + N. The forward's workspace is all the
    backward needs of stage 1 (its own prepare writes the same)."""
    chunks = total_tokens // CHUNK + num_seqs
    return ((chunks, heads, CHUNK, WORK16_COLS), (chunks, heads, FACTOR_ROWS * FACTOR_COLS))


# The largest group of output heads per input head whose gradient the chunk kernel still
# writes into the input's gradient itself: with one output head each row has one writer;
# with two, each adds its part into a zeroed gradient (hardware bf16 / fp16 adds), and two
# adds into zero give the same bits in either order, so the result stays reproducible.
# Larger groups go through per-output-head buffers summed in a fixed order by the finishing
# kernel (three adds in varying order would not be).
ADDED_GROUP = 2


def head_groups(q_heads: int, k_heads: int, v_heads: int) -> tuple:
    """Output heads per input head of q, k and v (HO = max(HQ, HV) over each's heads)."""
    heads = max(q_heads, v_heads)
    return tuple(heads // h for h in (q_heads, k_heads, v_heads))


def gradients_in_place(q_heads: int, k_heads: int, v_heads: int) -> tuple:
    """Per gradient (dq, dk, dv): whether the backward's chunk kernel writes it into the
    input's gradient itself (a group of at most ADDED_GROUP output heads per input head);
    otherwise it writes io-dtype gradients per output head and a finishing kernel sums each
    group."""
    return tuple(g <= ADDED_GROUP for g in head_groups(q_heads, k_heads, v_heads))


def gradients_added(q_heads: int, k_heads: int, v_heads: int) -> tuple:
    """Per gradient (dq, dk, dv): whether the chunk kernel adds into it (ADDED_GROUP output
    heads per input head: the gradient must be zero before the kernel runs)."""
    return tuple(g == ADDED_GROUP for g in head_groups(q_heads, k_heads, v_heads))
