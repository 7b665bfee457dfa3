"""The Gated DeltaNet forward's workspace layout: plain Python (neither cutlass nor torch),
so that the op's execute() sizes it where the compiler is not installed."""

CHUNK = 64


def workspace_shapes(total_tokens: int, num_seqs: int, heads: int, k_dim: int, v_dim: int):
    """(work16 shape, work32 shape) for a batch of T tokens in N sequences: one row block
    per (chunk, head), chunks bounded by T // 64 + N. work16 rows hold
    [Qd | Kd | W | U | M] (K, K, K, V and 64 columns); work32 holds G_L."""
    chunks = total_tokens // CHUNK + num_seqs
    return (chunks, heads, CHUNK, 3 * k_dim + v_dim + CHUNK), (chunks, heads)
