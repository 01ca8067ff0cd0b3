"""Which tiles packed documents make visible: per-tile ranges from segment ids, computed on the device.

With segment ids a query attends only keys of its own segment, yet the band of a causal or unbounded
mask spans every document before it.  This kernel gives each tile the tiles of the other axis that
share an id range with it, so the attention kernels visit only those (rules.segment_range): for
documents packed in order, each query tile sees its own document's key tiles, not the whole causal
triangle.  The ranges hold for any ids (unsorted ones give wider ranges, never narrower): a tile
outside a range holds no pair with equal ids, since its ids' [min, max] misses the own tile's.

It also gives each tile a run of other-axis tiles where no id needs comparing: when the own tile
lies whole inside its sequence and holds one id s, the first contiguous run of other tiles that lie
whole inside theirs and hold only s.  Every pair of such tiles has equal ids, so the kernels run
them in the unmasked interior loop (rules.segment_range), with no segment compare.  The run is
conservative: a tile holding another id, or reaching past its sequence, ends it (for unsorted ids
the later runs are left to the masked loops), and a tile holding several ids has none.

Grid (own tiles, batch); computed once per launch's tile sizes, per batch (the ids are per batch,
shared by every head).  RANGES[b, tile] = (first other position, end position, pure start, pure end),
multiples of BLOCK_OTHER; (0, 0) for either range when it is empty.

Every own tile reads the whole other axis, so the work grows with the square of the sequence: read
id by id, on long packs it takes longer than the attention of short packed documents.  On
a long other axis (plan.segment_ranges_first) a first launch gives each other tile its [min, max]
ids (segment_tile_ids_kernel) and the ranges are read from those, BLOCK_OTHER times fewer values;
the ranges are the same either way.
"""
import triton
import triton.language as tl

SEGMENT_RANGE_INTS = ["seg_stride_qb", "seg_stride_kb", "seqlen_q", "seqlen_k", "num_tiles"]
# Ints per tile in RANGES (plan.segment_ranges_first sizes the output with it).
RANGE_FIELDS = tl.constexpr(4)
# Ints per other tile in TILE_IDS: its (min, max) id.
TILE_ID_FIELDS = tl.constexpr(2)


@triton.jit
def _lowest(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)   # (tl.min calls a jit function the interpreter
                                                               # cannot run from here)


@triton.jit
def _highest(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _id_ranges(ROW, starts, length, BLOCK: tl.constexpr):
    """Per tile starting at `starts` (a vector): (min, max) of its ids inside the sequence.  Out-of-sequence
    lanes repeat the tile's first id; tiles starting at or past `length` give (0, 0) and must be masked."""
    offs = starts[:, None] + tl.arange(0, BLOCK)[None, :]
    first = tl.load(ROW + starts, mask=starts < length, other=0)
    ids = tl.load(ROW + offs, mask=offs < length, other=0)
    ids = tl.where(offs < length, ids, first[:, None])
    return _lowest(ids, 1), _highest(ids, 1)


@triton.jit(do_not_specialize=SEGMENT_RANGE_INTS)
def segment_ranges_kernel(QSEG, KSEG, TILE_IDS, seg_stride_qb, seg_stride_kb, seqlen_q, seqlen_k, num_tiles,
                          RANGES, BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr, OWN_IS_QUERY: tl.constexpr,
                          CHUNK_TILES: tl.constexpr, FROM_TILE_IDS: tl.constexpr):
    """One program per own tile; the other axis is read CHUNK_TILES tiles at a time, each chunk's tiles reduced
    together (a loop over single tiles is a chain of dependent loads: docs/lessons.md, "Segment ids bound the
    band by per-tile id ranges").  FROM_TILE_IDS:
    each other tile's [min, max] ids are read from TILE_IDS (segment_tile_ids_kernel) rather than reduced
    from its ids."""
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if OWN_IS_QUERY:
        OWN, OTHER, own_len, other_len = QSEG + b * seg_stride_qb, KSEG + b * seg_stride_kb, seqlen_q, seqlen_k
    else:
        OWN, OTHER, own_len, other_len = KSEG + b * seg_stride_kb, QSEG + b * seg_stride_qb, seqlen_k, seqlen_q
    NONE: tl.constexpr = 2**31 - 1   # "no tile" in the chunks' min-reductions
    lo = other_len
    hi = 0
    pure_lo = 0
    pure_hi = 0
    if tile * BLOCK_OWN < own_len:
        own_start = tl.full([1], 0, tl.int32) + tile * BLOCK_OWN
        own_min, own_max = _id_ranges(OWN, own_start, own_len, BLOCK_OWN)
        own_min = _lowest(own_min, 0)
        own_max = _highest(own_max, 0)
        # One id on every lane, and every lane inside the sequence (padding lanes never look pure).
        own_pure = (own_min == own_max) & ((tile + 1) * BLOCK_OWN <= own_len)
        run_closed = 0
        for first in range(0, other_len, CHUNK_TILES * BLOCK_OTHER):
            starts = first + tl.arange(0, CHUNK_TILES) * BLOCK_OTHER
            inside = starts < other_len
            if FROM_TILE_IDS:
                other_tiles = (other_len + BLOCK_OTHER - 1) // BLOCK_OTHER   # (tl.cdiv: see _lowest)
                tiles = TILE_IDS + (b * other_tiles + starts // BLOCK_OTHER) * TILE_ID_FIELDS
                other_min = tl.load(tiles, mask=inside, other=0)
                other_max = tl.load(tiles + 1, mask=inside, other=0)
            else:
                other_min, other_max = _id_ranges(OTHER, starts, other_len, BLOCK_OTHER)
            shared = inside & (other_max >= own_min) & (other_min <= own_max)
            lo = tl.minimum(lo, _lowest(tl.where(shared, starts, NONE), 0))
            hi = tl.maximum(hi, _highest(tl.where(shared, starts + BLOCK_OTHER, 0), 0))
            # The first run of whole tiles holding only the own tile's id: it starts at the first such tile
            # and ends at the first tile after it that is not one (a tile past the sequence is not one).
            pure = own_pure & (other_min == own_min) & (other_max == own_min) & (starts + BLOCK_OTHER <= other_len)
            started = pure_hi > pure_lo
            first_pure = _lowest(tl.where(pure, starts, NONE), 0)
            active = (run_closed == 0) & (started | (first_pure < NONE))
            run_start = tl.where(started, pure_lo, first_pure)
            first_break = _lowest(tl.where(~pure & (starts >= run_start), starts, NONE), 0)
            pure_lo = tl.where(active & ~started, first_pure, pure_lo)
            pure_hi = tl.where(active, tl.where(first_break < NONE, first_break,
                                                first + CHUNK_TILES * BLOCK_OTHER), pure_hi)
            run_closed = tl.where(active & (first_break < NONE), 1, run_closed)
    lo = tl.where(hi > 0, lo, 0)
    out = RANGES + (b * num_tiles + tile) * RANGE_FIELDS
    tl.store(out, lo)
    tl.store(out + 1, hi)
    tl.store(out + 2, pure_lo)
    tl.store(out + 3, pure_hi)


@triton.jit(do_not_specialize=["seg_stride_b", "length", "num_tiles"])
def segment_tile_ids_kernel(SEG, seg_stride_b, length, num_tiles, TILE_IDS, BLOCK: tl.constexpr,
                            TILES: tl.constexpr):
    """TILE_IDS[b, tile] = the (min, max) of the tile's ids inside the sequence, for tiles of BLOCK ids, TILES
    tiles a program: what segment_ranges_kernel reduces a tile to when it reads the ids themselves."""
    tiles = tl.program_id(0) * TILES + tl.arange(0, TILES)
    b = tl.program_id(1).to(tl.int64)
    lowest, highest = _id_ranges(SEG + b * seg_stride_b, tiles * BLOCK, length, BLOCK)
    out = TILE_IDS + (b * num_tiles + tiles) * TILE_ID_FIELDS
    tl.store(out, lowest, mask=tiles < num_tiles)
    tl.store(out + 1, highest, mask=tiles < num_tiles)


@triton.jit(do_not_specialize=["total", "num_seqs", "max_seqlen"])
def varlen_segment_ids_kernel(CU_SEQLENS, total, num_seqs, max_seqlen, Q_IDS, K_IDS, BLOCK: tl.constexpr,
                              SEARCH_STEPS: tl.constexpr):
    """Varlen tables as segment ids (plan.varlen_as_documents).  With t the number of sequences that start
    at or before packed token p: a token of sequence s = t - 1 (cu[s] <= p < cu[s + 1], and p - cu[s] <
    max_seqlen: the kernels' sequence_bounds) gets id 3t on both sides; a token of no sequence gets
    3t + 1 as a query and 3t + 2 as a key, ids no other token has, so it attends nothing and nothing
    attends it (output 0, lse -inf, as the varlen kernels leave such rows).  The ids rise along the
    pack, so every tile's [min, max] id range stays within its own documents and the segment ranges
    stay tight (an id below the others, a tile of tail tokens holding -1, would widen its tile's range
    to every earlier document).  All ids are >= 0: the kernels' padding ids (-1, -2) never match one.
    The table is read clipped to [0, total] (front ends make traced tables non-decreasing first); t is
    found by a binary search over [0, num_seqs + 1] (SEARCH_STEPS >= log2(num_seqs + 2))."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.full([BLOCK], 0, tl.int32)        # t = 0: before the first sequence
    hi = tl.full([BLOCK], 0, tl.int32) + num_seqs + 1
    for _ in tl.static_range(SEARCH_STEPS):   # the largest t with t == 0 or cu[t - 1] <= p
        active = lo < hi
        mid = (lo + hi + 1) // 2              # in (lo, hi] while active
        start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + mid - 1, mask=active, other=0), 0), total)
        below = active & (start <= offs)
        lo = tl.where(below, mid, lo)
        hi = tl.where(active & ~below, mid - 1, hi)
    seq = lo - 1
    first = tl.minimum(tl.maximum(tl.load(CU_SEQLENS + tl.maximum(seq, 0)), 0), total)
    inside = (seq >= 0) & (seq < num_seqs) & (offs - first < max_seqlen)
    keep = offs < total
    tl.store(Q_IDS + offs, tl.where(inside, 3 * lo, 3 * lo + 1), mask=keep)
    tl.store(K_IDS + offs, tl.where(inside, 3 * lo, 3 * lo + 2), mask=keep)
