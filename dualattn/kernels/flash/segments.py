"""Which tiles packed documents make visible: per-tile ranges from segment ids, computed on the device.

With segment ids a query attends only keys of its own segment, yet the band of a causal or unbounded
mask spans every document before it.  This kernel gives each tile the tiles of the other axis that
share an id range with it, so the attention kernels visit only those (rules.segment_range): for
documents packed in order, each query tile sees its own document's key tiles, not the whole causal
triangle.  The ranges hold for any ids (unsorted ones give wider ranges, never narrower): a tile
outside a range holds no pair with equal ids, since its ids' [min, max] misses the own tile's.

Grid (own tiles, batch); computed once per launch's tile sizes, per batch (the ids are per batch,
shared by every head).  RANGES[b, tile] = (first other position, end position), multiples of
BLOCK_OTHER; (0, 0) when no tile shares an id.
"""
import triton
import triton.language as tl

SEGMENT_RANGE_INTS = ["seg_stride_qb", "seg_stride_kb", "seqlen_q", "seqlen_k", "num_tiles"]


@triton.jit
def _id_range(ROW, start, length, BLOCK: tl.constexpr):
    """(min, max) of ids[start:start + BLOCK] inside the sequence (start < length)."""
    offs = start + tl.arange(0, BLOCK)
    ids = tl.load(ROW + offs, mask=offs < length, other=0)
    ids = tl.where(offs < length, ids, tl.load(ROW + start))   # out-of-sequence lanes repeat a real id
    return tl.reduce(ids, 0, tl.standard._elementwise_min), tl.reduce(ids, 0, tl.standard._elementwise_max)


@triton.jit(do_not_specialize=SEGMENT_RANGE_INTS)
def segment_ranges_kernel(QSEG, KSEG, seg_stride_qb, seg_stride_kb, seqlen_q, seqlen_k, num_tiles, RANGES,
                          BLOCK_OWN: tl.constexpr, BLOCK_OTHER: tl.constexpr, OWN_IS_QUERY: tl.constexpr):
    tile = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    if OWN_IS_QUERY:
        OWN, OTHER, own_len, other_len = QSEG + b * seg_stride_qb, KSEG + b * seg_stride_kb, seqlen_q, seqlen_k
    else:
        OWN, OTHER, own_len, other_len = KSEG + b * seg_stride_kb, QSEG + b * seg_stride_qb, seqlen_k, seqlen_q
    lo = other_len
    hi = 0
    if tile * BLOCK_OWN < own_len:
        own_min, own_max = _id_range(OWN, tile * BLOCK_OWN, own_len, BLOCK_OWN)
        for start in range(0, other_len, BLOCK_OTHER):
            other_min, other_max = _id_range(OTHER, start, other_len, BLOCK_OTHER)
            shared = (other_max >= own_min) & (other_min <= own_max)
            lo = tl.where(shared, tl.minimum(lo, start), lo)
            hi = tl.where(shared, start + BLOCK_OTHER, hi)
    lo = tl.where(hi > 0, lo, 0)
    out = RANGES + (b * num_tiles + tile) * 2
    tl.store(out, lo)
    tl.store(out + 1, hi)
