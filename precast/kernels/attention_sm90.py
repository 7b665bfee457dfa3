"""Pieces shared by the SM90 kernels (HSTU attention forward and backward, Gated DeltaNet):
layout views of wgmma accumulators and of transposed shared-memory tiles, TMA tile copies,
a warp prefix sum, the wgmma issue loop, and the per-thread bit masks that zero hidden
scores of packed 16-bit operands, and the TMA pipelines every kernel's producer warp
feeds."""
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Int32, Uint32, Uint64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup


def select_modes(t: cute.Tensor, modes) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def tma_pipeline(barriers, stages: int, tx_bytes: int, consumer_threads: int):
    """A TMA pipeline of ``stages`` stages over the mbarriers at ``barriers``: one producer
    thread arms a stage with ``tx_bytes``, the ``consumer_threads`` (whole warps) release
    it. The caller fences the barriers' init and syncs the CTA (deferred)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers, num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(
            pipeline.Agent.Thread, consumer_threads // cute.arch.WARP_SIZE),
        tx_count=tx_bytes, defer_sync=True)


def acc_mn_layout(acc_layout: cute.Layout) -> cute.Layout:
    """wgmma accumulator ((2 cols, 2 rows, N/8), M, N) viewed as (rows, cols)."""
    s, d = acc_layout.shape, acc_layout.stride
    return cute.make_layout(((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
                            stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])))


def acc_as_operand_a(acc_layout: cute.Layout) -> cute.Layout:
    """Accumulator registers ((2, 2, N/8), M, N) read as a 16-bit A operand
    ((2, 2, 2), M, (N/16, N)): two 8-column groups make one k16 slice."""
    s, d = acc_layout.shape, acc_layout.stride
    groups = s[0][2]
    return cute.make_layout(((s[0][0], s[0][1], 2), s[1], (groups // 2, s[2])),
                            stride=((d[0][0], d[0][1], d[0][2]), d[1],
                                    (d[0][2] * 2, d[2])))


@cute.jit
def warp_inclusive_sum(value):
    """Inclusive prefix sum of ``value`` over the lanes of a warp (every lane takes part)."""
    lane = cute.arch.lane_idx()
    for d in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(value, 1 << d)
        if lane >= (1 << d):
            value = value + up
    return value


@cute.jit
def find_in_sequences(index: Int32, mCuSeqlens, num_batches: Int32, unit: cutlass.Constexpr):
    """(sequence b, index less the units of the sequences before b, b's unit count) of the
    index-th unit, sequence b having ceil(len_b / unit) units (tiles, chunks): the whole
    warp scans the sequences 32 at a time; b == num_batches past the last unit."""
    lane = cute.arch.lane_idx()
    batch = num_batches
    local = Int32(0)
    count_of = Int32(0)
    group = Int32(0)
    base = Int32(0)
    searching = num_batches > 0
    while searching:
        b = group + lane
        count = Int32(0)
        if b < num_batches:
            count = (mCuSeqlens[b + 1] - mCuSeqlens[b] + unit - 1) // unit
        ends = warp_inclusive_sum(count)
        total = cute.arch.shuffle_sync(ends, 31)
        if index < base + total:
            owner = cute.arch.popc(cute.arch.vote_ballot_sync(index >= base + ends))
            local = index - base - cute.arch.shuffle_sync(ends - count, owner)
            count_of = cute.arch.shuffle_sync(count, owner)
            batch = group + owner
            searching = False
        else:
            base = base + total
            group = group + 32
            if group >= num_batches:
                searching = False
    return batch, local, count_of


@cute.jit
def store_stmatrix(vals, tiled_mma, tile, tidx: Int32):
    """A warpgroup's 16-bit fragment ``vals``, in the order of ``tiled_mma``'s accumulator,
    into the shared-memory tile ``tile`` by stmatrix (eight elements a thread per
    instruction). ``tidx``: the thread's index in the tiled MMA."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), vals.element_type)
    st = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    cute.copy(atom, st.retile(vals), st.partition_D(tile))


def row_vectors(sRows: cute.Tensor, wg_tidx: Int32):
    """A warpgroup's (rows, D) 16-bit tile ``sRows`` as 16-byte vectors, each row's vectors
    on consecutive threads (128 threads; ``wg_tidx`` the thread's index in the warpgroup):
    (the copy atom, the thread's slice of the tiled copy)."""
    dtype = sRows.element_type
    vec = 128 // dtype.width
    per_row = cute.size(sRows, mode=[1]) // vec
    copy_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    rows_copy = cute.make_tiled_copy_tv(
        copy_atom, cute.make_ordered_layout((128 // per_row, per_row), order=(1, 0)),
        cute.make_layout((1, vec)))
    return copy_atom, rows_copy.get_slice(wg_tidx)


@cute.jit
def copy_rows_out(sRows: cute.Tensor, gRows: cute.Tensor, first_row: Int32, limit: Int32,
                  wg_tidx: Int32):
    """A warpgroup's staged (rows, D) 16-bit tile ``sRows`` -> ``gRows`` as coalesced 16-byte
    stores (128 threads; ``wg_tidx`` the thread's index in the warpgroup). Row r is written
    only when first_row + r < limit: rows past a sequence's end belong to the next one."""
    copy_atom, thr = row_vectors(sRows, wg_tidx)
    t_s = thr.partition_S(sRows)
    t_g = thr.partition_D(gRows)
    t_c = thr.partition_S(cute.make_identity_tensor(sRows.shape))
    staged = cute.make_rmem_tensor_like(t_s)
    cute.autovec_copy(t_s, staged)
    for m in cutlass.range_constexpr(cute.size(t_s.shape[1])):
        if first_row + t_c[0, m, 0][0] < limit:
            cute.copy(copy_atom, staged[None, m, None], t_g[None, m, None])


@cute.jit
def load_ldmatrix(tiled_mma, tile, vals, tidx: Int32):
    """store_stmatrix's inverse: the shared-memory tile ``tile`` into the 16-bit fragment
    ``vals`` (in the order of ``tiled_mma``'s accumulator) by ldmatrix."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), vals.element_type)
    ld = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    cute.copy(atom, ld.partition_S(tile), ld.retile(vals))


@cute.jit
def wgmma(tiled_mma, acc, tCrA, tCrB, accumulate, k_blocks: cutlass.Constexpr = None):
    """acc (+)= A B over the k-blocks of the fragments (the first ``k_blocks`` of them when
    given), issued as one wgmma group (not waited for). ``accumulate``: a Python bool, or a
    dynamic Boolean (then the first k-block's scale-d predicate)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: its ACCUMULATE flag is mutated
    blocks = cute.size(tCrA.shape[2]) if const_expr(k_blocks is None) else k_blocks
    for k in cutlass.range_constexpr(blocks):
        atom.set(warpgroup.Field.ACCUMULATE, accumulate if const_expr(k == 0) else True)
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
    warpgroup.commit_group()


def transposed(s: cute.Tensor, rows: int, cols: int) -> cute.Tensor:
    """A (rows, cols, stages) shared-memory tile viewed (cols, rows, stages): a K-major
    tile read as an MN-major wgmma operand (the tile's row extent must be ``rows``)."""
    stages = cute.size(s, mode=[2])
    return cute.composition(s, cute.make_ordered_layout((cols, rows, stages), order=(1, 0, 2)))


@cute.jit
def tma_load_tile(atom, g, s, stage, bar):
    """TMA copy of the 2-D global tile ``g`` into stage ``stage`` of the shared-memory tile
    ``s`` (rows, cols, stages), completing on mbarrier ``bar``. The whole warp calls it:
    the copy elects its issuing lane itself."""
    t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                     cute.group_modes(g, 0, 2))
    cute.copy(atom, t_g, t_s[None, stage], tma_bar_ptr=bar)


@cute.jit
def tma_store_tile(atom, s, g):
    """TMA copy of stage 0 of the shared-memory tile ``s`` to the 2-D global tile ``g``
    (not committed: the caller commits the bulk group). The whole warp calls it."""
    t_s, t_g = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(s, 0, 2),
                                     cute.group_modes(g, 0, 2))
    cute.copy(atom, t_s[None, 0], t_g)


@cute.jit
def advanced(state):
    # A new state one stage on; assigning it (rather than mutating in place) carries the
    # state out of dynamic branches.
    nxt = state.clone()
    nxt.advance()
    return nxt


def pair_mask_steps(groups: int):
    """How and_keep_bits makes the AND masks of a row's packed 16-bit pairs from its keep
    word (bits 2 g and 2 g + 1: the two columns of pair g): four (lo_shift, hi_shift,
    pairs) steps, pairs a list of (g, selector), such that prmt(keep << lo_shift,
    keep << hi_shift, selector) is 0xFFFF in its low half when bit 2 g is set and in its
    high half when bit 2 g + 1 is. With g = s + 4 t, step s's shifts put bit 2 g on the top
    bit of byte t of the first word and bit 2 g + 1 on the top bit of byte t of the second;
    the selector takes bytes (t, t, 4 + t, 4 + t) in sign mode, which spreads each top bit
    over its byte (one prmt and one AND per pair instead of a shift, two multiplies, an or
    and an AND)."""
    assert groups % 4 == 0, groups
    return [(7 - 2 * s, 6 - 2 * s,
             [(s + 4 * t, (8 | t) * 0x11 | (8 | (4 + t)) * 0x1100) for t in range(groups // 4)])
            for s in range(4)]


class AttentionTileOps:
    """Mixin of the kernel classes. Uses ``self.mask_width`` (columns of a masked score
    tile), ``self.left_bounded``, ``self.right_bounded`` and ``self.func_intervals``.

    A thread's scores of one tile are 2 rows h x (mask_width / 8) column pairs g: the 16-bit
    register pair h + 2 g packs columns first + 8 g + {0, 1} of row h, which are bits 2 g and
    2 g + 1 of that row's keep mask."""

    def init_attention(self, dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                       window_left_bounded: bool, window_right_bounded: bool,
                       func_intervals: int):
        """The configuration fields both attention kernels take."""
        assert num_heads % num_kv_heads == 0
        assert func_intervals == 0 or func_intervals % 2 == 1
        self.dtype = dtype
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.left_bounded = window_left_bounded
        self.right_bounded = window_right_bounded
        self.func_intervals = func_intervals

    @cute.jit
    def gemm(self, tiled_mma, acc, tCrA, tCrB, accumulate: cutlass.Constexpr):
        wgmma(tiled_mma, acc, tCrA, tCrB, accumulate)

    @cute.jit
    def hides_any(self, q0: Int32, q1: Int32, k0: Int32, k1: Int32, len_q, len_k: Int32,
                  off: Int32, window_left: Int32, window_right: Int32) -> Boolean:
        """Whether the mask may hide a pair of (local) queries q0 .. q1 and keys k0 .. k1:
        query i sees key j when i + off - left <= j <= i + off + right, j < len_k and, unless
        len_q is None, i < len_q; func intervals may hide any pair."""
        masked = k1 >= len_k
        if const_expr(len_q is not None):
            masked = masked or q1 >= len_q
        if const_expr(self.func_intervals > 0):
            masked = Boolean(True)
        if const_expr(self.right_bounded):
            masked = masked or k1 > q0 + off + window_right
        if const_expr(self.left_bounded):
            masked = masked or q1 + off - window_left > k0
        return masked

    @cute.jit
    def cols_below(self, limit: Int32, first: Int32) -> Uint32:
        """Bits of this thread's columns (first + 8 g + e) that are < limit."""
        rel = cutlass.min(cutlass.max(limit - first, 0), self.mask_width)
        count = 2 * (rel >> 3) + cutlass.min(rel & 7, 2)
        return Uint32((Uint64(1) << Uint64(count)) - Uint64(1))

    @cute.jit
    def keys_seen_by_query(self, i: Int32, first: Int32, func, r: cutlass.Constexpr,
                           len_k: Int32, off: Int32, window_left: Int32,
                           window_right: Int32) -> Uint32:
        """Keep bits of local query row i over key columns first + 8 g + e (window edges,
        the sequence end, func intervals from ``func[r, :]``)."""
        keep = self.cols_below(len_k, first)
        if const_expr(self.right_bounded):
            keep = keep & self.cols_below(i + off + window_right + 1, first)
        if const_expr(self.left_bounded):
            keep = keep & ~self.cols_below(i + off - window_left, first)
        if const_expr(self.func_intervals > 0):
            union = self.cols_below(func[r, 0], first)
            for t in cutlass.range_constexpr(1, self.func_intervals, 2):
                union = union | (self.cols_below(func[r, t + 1], first)
                                 & ~self.cols_below(func[r, t], first))
            keep = keep & union
        return keep

    @cute.jit
    def and_keep_bits(self, regs, h: cutlass.Constexpr, keep: Uint32):
        """Zeroes row h's hidden columns of packed 16-bit registers (bitwise: exact zeros
        whatever the scores were): each pair's AND mask by one prmt (pair_mask_steps)."""
        pairs = cute.recast_tensor(regs, Uint32)
        for lo_shift, hi_shift, pair_selectors in pair_mask_steps(self.mask_width // 8):
            shifted = [keep << Uint32(lo_shift), keep << Uint32(hi_shift)]
            for g, selector in pair_selectors:
                mask = cute.arch.inline_ptx(
                    f"prmt.b32 {{$w0}}, {{$r0}}, {{$r1}}, {selector:#x};",
                    write_only_types=[Uint32], read_only_args=shifted)
                pairs[h + 2 * g] = pairs[h + 2 * g] & mask
