"""Triton helpers that define what attention computes: masks, band ranges, logits, dropout.

Every kernel (flash forward/backward, and the later block-sparse, ring and NSA kernels)
calls these, so the rules exist once.  Their jnp twin is dualattn/jax_api/mask.py.

Positions: query row i sits at qpos = i + diag, key column j at kpos = j, where
diag = (Sk - Sq) + diag_shift (bottom-right alignment; ring attention shifts it).
Row i may attend column j iff  -window_left <= j - i - diag <= window_right.
Scores live in log2 units inside the kernels (exp2 is the fast path).
"""
import triton
import triton.language as tl

from .segments import RANGE_FIELDS

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def band_range(t0, fixed_limit, other_limit, offset, lo_width, hi_width,
               T: tl.constexpr, U: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """Tiles of the other axis that a fixed tile [t0, t0+T) touches, split by masking need.

    The other axis index u is allowed for fixed index t iff
        t + offset - lo_width <= u <= t + offset + hi_width  and 0 <= u < other_limit.
    Returns (start, full_start, full_end, end): iterate [start, full_start) and
    [full_end, end) with the position mask, [full_start, full_end) without it.  Tiles
    entirely outside the band are never visited.  All divisions act on values >= 0
    (C and Python disagree on negative floor division).
    """
    start = 0
    end = other_limit
    if HAS_LO:
        start = tl.maximum(t0 + offset - lo_width, 0)
        start = (start // U) * U
    if HAS_HI:
        end = tl.minimum(t0 + T + offset + hi_width, other_limit)
    end = tl.maximum(end, start)
    # A tile u0 needs no position mask iff every pair of the two tiles is in the band
    # and both tiles lie inside their sequences.
    full_start = start
    if HAS_LO:
        first_full = tl.maximum(t0 + T - 1 + offset - lo_width, 0)
        full_start = tl.maximum(((first_full + U - 1) // U) * U, start)
    full_start = tl.minimum(full_start, end)
    last_full = other_limit - U
    if HAS_HI:
        last_full = tl.minimum(last_full, t0 + offset + hi_width - U + 1)
    full_end = tl.where(last_full >= 0, (tl.maximum(last_full, 0) // U + 1) * U, 0)
    full_end = tl.where(t0 + T <= fixed_limit, full_end, 0)
    full_end = tl.minimum(tl.maximum(full_end, full_start), end)
    return start, full_start, full_end, end


@triton.jit
def key_tiles(m0, tile, layout_row, SPARSE_KV_COUNT, SPARSE_KV_INDEX, num_k_blocks, seqlen_q, seqlen_k, diag,
              window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, BLOCK_SPARSE: tl.constexpr):
    """What the query tile at m0 loops over (forward and dQ): (start, full_start, full_end, end, BLOCK_LIST).

    Dense: key positions of the band, split at full_start / full_end into masked edges and an
    unmasked interior.  Block-sparse: indices into the tile's list of active key blocks (row
    `layout_row + tile` of the layout), all position-masked: the layout is user-given.
    """
    if BLOCK_SPARSE:
        row = layout_row + tile
        n_active = tl.load(SPARSE_KV_COUNT + row)
        start, full_start, full_end, end = 0, n_active, n_active, n_active
        BLOCK_LIST = SPARSE_KV_INDEX + row * num_k_blocks
    else:
        start, full_start, full_end, end = band_range(m0, seqlen_q, seqlen_k, diag, window_left, window_right,
                                                      BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
        BLOCK_LIST = SPARSE_KV_INDEX  # unused
    return start, full_start, full_end, end, BLOCK_LIST


@triton.jit
def segment_range(SEGMENT_RANGES, b, tile, num_tiles, start, full_start, full_end, end, SKIP: tl.constexpr):
    """The band's tiles narrowed to those sharing segment ids with this tile, and its unmasked interior
    narrowed to the tiles whose ids all equal this tile's one id (segments.py computed both ranges per
    batch and tile: positions, multiples of the other axis' tile).

    With SKIP the interior [full_start, full_end) is the tiles both in the band's unmasked interior
    (every pair in the band, both tiles inside their sequences: band_range) and in the pure run, where
    every pair has equal ids: loop segment 1 runs them with neither the position mask nor the segment
    compare.  It stays one contiguous range inside [start, end) (empty: full_start == full_end), so
    loop segments 0 and 2 cover the rest of the band, where positions and ids are both compared
    (the kernels compile segment 1 without HAS_SEGMENTS when SKIP)."""
    if SKIP:
        row = SEGMENT_RANGES + (b.to(tl.int64) * num_tiles + tile) * RANGE_FIELDS
        start = tl.maximum(start, tl.load(row))
        end = tl.maximum(tl.minimum(end, tl.load(row + 1)), start)
        full_start = tl.minimum(tl.maximum(full_start, start), end)
        full_end = tl.minimum(tl.maximum(full_end, full_start), end)
        pure_start = tl.load(row + 2)
        pure_end = tl.load(row + 3)
        full_start = tl.minimum(tl.maximum(full_start, pure_start), full_end)
        full_end = tl.maximum(tl.minimum(full_end, pure_end), full_start)
    return start, full_start, full_end, end


@triton.jit
def loop_segment(segment: tl.constexpr, start, full_start, full_end, end, ONE_LOOP: tl.constexpr = False):
    """[lo, hi) of loop segment 0, 1, 2: the masked leading edge, the unmasked interior, the masked
    trailing edge (segment 1 alone compiles without position masks, and with SEGMENT_SKIP without the
    segment compare: segment_range).  ONE_LOOP: segment 1 is the
    whole band [start, end), for callers that compile no other segment (masking every tile, or the
    edge tiles behind a branch: EDGES_IN_LOOP)."""
    lo = start if segment == 0 else (full_start if segment == 1 else full_end)
    hi = full_start if segment == 0 else (full_end if segment == 1 else end)
    if ONE_LOOP:
        lo, hi = start, end
    return lo, hi


@triton.jit
def query_range(n0, seqlen_q, seqlen_k, diag, window_left, window_right,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Query tiles for the key tile at n0 (dK/dV): the same band seen from the key side."""
    return band_range(n0, seqlen_k, seqlen_q, -diag, window_right, window_left,
                      BLOCK_N, BLOCK_M, HAS_RIGHT, HAS_LEFT)


@triton.jit
def own_tile_frame(t0, offs, limit, diag, BLOCK: tl.constexpr, KEYS: tl.constexpr, RELATIVE: tl.constexpr):
    """(indices, sequence length, diag) of a program's own tile [t0, t0 + BLOCK) as tile_mask takes them.

    RELATIVE (warp-specialised loops): indices from 0, with t0 folded into the length and the
    diagonal -- the same mask, since key j = t0 + r is in row i's band iff r - i - (diag - t0) is
    (query i = t0 + r: j - r - (diag + t0)).  Triton 3.6 splits such a loop's 128-row tile over two
    consumer warpgroups and gives the second both a range from 64 and t0 + 64 (the offset it
    applies to the tile's TMA coordinate t0), so `t0 + tl.arange` masked rows 64-127 as rows
    128-191 there (H100; NOTES: "Masks in the warp-specialised backward: minimal, in the loop, relative")."""
    if RELATIVE:
        offs = tl.arange(0, BLOCK)
        limit = limit - t0
        diag = diag - t0 if KEYS else diag + t0
    return offs, limit, diag


@triton.jit
def rows_cols(offs_m, offs_n, TRANSPOSED: tl.constexpr):
    """Broadcastable query / key index grids of a tile: [M, 1] x [1, N], or [1, M] x [N, 1]
    when the tile is stored key-major (dK/dV compute S^T = K Q^T so no register transposes)."""
    if TRANSPOSED:
        mi = offs_m[None, :]
        nj = offs_n[:, None]
    else:
        mi = offs_m[:, None]
        nj = offs_n[None, :]
    return mi, nj


@triton.jit
def mask_as_int8(MASK):
    """The attention mask's pointer, read as int8 0 / 1 (the Gluon kernels mask by integer operations on
    it: gluon_shared.masked_bits).  torch passes a bool mask viewed as int8, jax its bool array (XLA
    stores a bool as one byte, 0 or 1): neither front end converts the S x S tensor per call."""
    if MASK.dtype.element_ty == tl.int1:
        return MASK.to(tl.pointer_type(tl.int8), bitcast=True)
    else:
        return MASK


@triton.jit
def tile_mask(offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
              q_seg, MASK_ROW, k_seg, mask_stride_s, q_pos, k_pos,
              POSITIONAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
              HAS_SEGMENTS: tl.constexpr, HAS_MASK: tl.constexpr, TRANSPOSED: tl.constexpr,
              HAS_POSITIONS: tl.constexpr, IN_BOUNDS: tl.constexpr = False):
    """Boolean tile: may query offs_m attend key offs_n ([M, N], or [N, M] if TRANSPOSED).

    POSITIONAL=False is the fast path for tiles that band_range proved full; segment ids
    (unless the caller passes HAS_SEGMENTS off for tiles of one id: segment_range) and the user
    mask still apply there.  MASK_ROW points at mask[b, h, 0, 0].  With
    HAS_POSITIONS the window compares the given positions (q_pos, k_pos tiles) instead of
    i + diag and j (block-sparse layouts, where every tile is POSITIONAL).  IN_BOUNDS: the
    caller knows both tiles lie inside their sequences (warp-specialised backward loops, which
    mask every tile: each full-tile operation saved counts there).
    """
    mi, nj = rows_cols(offs_m, offs_n, TRANSPOSED)
    ok = (mi >= 0) & (nj >= 0)   # all true, in the tile's shape
    if POSITIONAL:
        if HAS_POSITIONS:
            qp, kp = rows_cols(q_pos, k_pos, TRANSPOSED)
            d = kp - qp
        else:
            d = (nj - diag) - mi   # (diag on the vector: one full-tile operation fewer)
        # In bounds, the band test alone (callers pass IN_BOUNDS with a causal or window band).
        if not IN_BOUNDS:
            ok = ok & (mi < seqlen_q) & (nj < seqlen_k)
        if HAS_LEFT:
            left = d >= -window_left
            ok = left if IN_BOUNDS else ok & left
        if HAS_RIGHT:
            right = d <= window_right
            ok = right if IN_BOUNDS and not HAS_LEFT else ok & right
    if HAS_SEGMENTS:
        qs, ks = rows_cols(q_seg, k_seg, TRANSPOSED)
        ok = ok & (qs == ks)
    if HAS_MASK:
        user = tl.load(MASK_ROW + mi.to(tl.int64) * mask_stride_s + nj,
                       mask=(mi < seqlen_q) & (nj < seqlen_k), other=0)
        ok = ok & (user != 0)
    return ok


@triton.jit
def mask_band_edge(s, edge, offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
                   HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, TRANSPOSED: tl.constexpr,
                   own_seg=0, OTHER_SEG_ROW=0, HAS_SEGMENTS: tl.constexpr = False):
    """Scores s with the position mask applied if `edge` (a runtime flag: the tile lies outside
    band_range's unmasked [full_start, full_end)).  For EDGES_IN_LOOP kernels, whose one loop runs
    the whole band: a branch outside warp-specialised loops costs less than the separate edge
    loops, each with its own pipeline fill (NOTES: "Short bands run their edges inside the one loop").
    HAS_SEGMENTS (with SEGMENT_SKIP: every tile outside the interior may cross a document boundary):
    the edge tiles also compare segment ids.  `own_seg` are the ids of the program's own tile (queries
    in the forward and dQ, keys when TRANSPOSED: dK/dV), loaded once; the iterated tile's are loaded
    here from OTHER_SEG_ROW, on edge tiles only."""
    if edge:
        if TRANSPOSED:
            q_seg = load_ids(OTHER_SEG_ROW, offs_m, seqlen_q, -2, HAS_SEGMENTS)
            k_seg = own_seg
        else:
            q_seg = own_seg
            k_seg = load_ids(OTHER_SEG_ROW, offs_n, seqlen_k, -1, HAS_SEGMENTS)
        ok = tile_mask(offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
                       q_seg, 0, k_seg, 0, 0, 0, True, HAS_LEFT, HAS_RIGHT, HAS_SEGMENTS, False, TRANSPOSED, False)
        s = tl.where(ok, s, float("-inf"))
    return s


@triton.jit
def load_ids(ROW, offs, limit, other, HAS: tl.constexpr):
    """Per-token ids of a tile (segment ids, positions), or 0 when the feature is off."""
    ids = 0
    if HAS:
        ids = tl.load(ROW + offs, mask=offs < limit, other=other)
    return ids


@triton.jit
def load_bias(BIAS_ROW, offs_m, offs_n, bias_stride_s, seqlen_q, seqlen_k, TRANSPOSED: tl.constexpr):
    mi, nj = rows_cols(offs_m, offs_n, TRANSPOSED)
    return tl.load(BIAS_ROW + mi.to(tl.int64) * bias_stride_s + nj,
                   mask=(mi < seqlen_q) & (nj < seqlen_k), other=0.0).to(tl.float32)


# SOFTCAP constexpr: how the scores are capped.  SOFTCAP_MUFU_FIXED_MAX (the Gluon forward only): the MUFU tanh,
# and the capped scores, bounded by the cap, taken against a fixed reference instead of a running row maximum
# (plan.gluon_softcap): P = exp2(s - max(K - SOFTCAP_P_MAX_LOG2, 0)) for capped scores s in [-K, K] (log2 units),
# so no P exceeds 2^SOFTCAP_P_MAX_LOG2.
SOFTCAP_NONE, SOFTCAP_EXP2, SOFTCAP_MUFU, SOFTCAP_MUFU_FIXED_MAX = 0, 1, 2, 3
SOFTCAP_P_MAX_LOG2 = 56.0


@triton.jit
def capped_tanh(x, SOFTCAP: tl.constexpr):
    """tanh(x).  SOFTCAP_MUFU: the GPU's tanh.approx.f32, one MUFU operation (relative error about
    2^-11: a capped score is off by up to cap * 2^-11, which is bf16's rounding of P at cap 8 and 2.4%
    of P at cap 50; FA3 caps with it too).  SOFTCAP_EXP2: 1 - 2 / (2^(2x log2 e) + 1),
    an ex2 and an approximate reciprocal, accurate to fp32 rounding, saturating cleanly at +-1; the
    interpreter (no inline PTX), fp32 inputs and other GPUs run it."""
    if SOFTCAP >= 2:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def logits(qk, bias, sm_scale, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """Scores in log2 units: ((qk * scale + bias) -> cap * tanh(. / cap)) * log2(e).

    The soft cap's constants are folded into one multiply before and one after the tanh (the scalar
    divisions run once per program): a per-score division is a MUFU reciprocal, and MUFU throughput
    is what bounds a capped kernel (benchmarks/NOTES.md)."""
    if SOFTCAP:
        if HAS_BIAS:
            x = (qk * sm_scale + bias) * (1.0 / softcap)
        else:
            x = qk * (sm_scale / softcap)
        s = capped_tanh(x, SOFTCAP) * (softcap * LOG2E)
    elif HAS_BIAS:
        s = (qk * sm_scale + bias) * LOG2E
    else:
        s = qk * (sm_scale * LOG2E)
    return s


@triton.jit
def mix32(x):
    """lowbias32 finaliser; x is uint32 and all arithmetic wraps."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def dropout_row_hash(seed, batch_head, offs_m):
    """Per-row part of the dropout hash: mix(mix(seed ^ bh * 0x27D4EB2F) ^ i)."""
    h = seed.to(tl.uint32, bitcast=True) ^ (batch_head.to(tl.uint32) * 0x27D4EB2F)
    h = mix32(h)
    return mix32(h ^ offs_m.to(tl.uint32))


@triton.jit
def dropout_keep(row_hash, offs_n, threshold, TRANSPOSED: tl.constexpr = False):
    """Keep-mask tile: a pure function of (seed, b*H + h, i, j), whatever the launcher or orientation.
    Per entry, h = (row_hash ^ j) * M1, h ^= h >> 15, h *= M2 (lowbias32's constants), kept iff
    h >= threshold (options.dropout_threshold, passed as the int32 of its bits).  Four integer
    operations and two multiplies: the per-entry part bounds the Gluon forward with dropout (NOTES:
    "Dropout: the hash per entry").  lowbias32's xor-shifts before the first multiply and after the
    last were left out: the first turns r ^ j into r' ^ (j ^ (j >> 16)), a row constant xored with a
    bijection of j, as r ^ j already is; the last changes bits below the top 16 only."""
    rows, cols = rows_cols(row_hash, offs_n.to(tl.uint32), TRANSPOSED)
    h = (rows ^ cols) * 0x7FEB352D
    h = (h ^ (h >> 15)) * 0x846CA68B
    return h >= threshold.to(tl.uint32, bitcast=True)


@triton.jit
def load_tile(ptrs, offs_r, row_limit, offs_c, col_limit, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a [R, C] tile, predicating only the dimensions that can run out of bounds."""
    if CHECK_ROWS and CHECK_COLS:
        x = tl.load(ptrs, mask=(offs_r[:, None] < row_limit) & (offs_c[None, :] < col_limit), other=0.0)
    elif CHECK_ROWS:
        x = tl.load(ptrs, mask=offs_r[:, None] < row_limit, other=0.0)
    elif CHECK_COLS:
        x = tl.load(ptrs, mask=offs_c[None, :] < col_limit, other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def row_tiles(HEAD, n_rows, stride_s, N_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
              TMA: tl.constexpr):
    """What an inner loop reads one head's [rows, N_COLS] tiles from: the head's base pointer,
    or with TMA a tensor-memory-accelerator descriptor built in the kernel.  A descriptor
    zero-fills rows past n_rows and columns past N_COLS in hardware (no predicates), and the
    software pipeliner turns its loads into asynchronous bulk copies (Hopper and later).
    Needs 16-byte-aligned base and row stride: the launch plan checks.  The descriptor lives in
    Triton's global scratch, which jax-triton's launches get from DESC_SCRATCH (jax_api/_scratch.py)."""
    if TMA:
        return tl.make_tensor_descriptor(HEAD, shape=[n_rows, N_COLS], strides=[stride_s, 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_COLS])
    else:
        return HEAD


@triton.jit
def whole_tiles(BASE, n_rows, n_heads, stride_s, stride_h, N_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr):
    """A TMA descriptor over a whole [batch, rows, heads, N_COLS] operand, seen as a
    [batch * rows, heads * stride_h] matrix (tile of batch b, head h at row b * rows + start,
    column h * stride_h), for persistent programs to build once: each build is a fenced write to
    global scratch, and per tile it cost the persistent probe 8% at causal S=1024
    (NOTES: "Persistent launches").  Legal where plan.whole_array_tiles holds: batches end to end
    (batch stride = rows * row stride), rows a multiple of BLOCK_ROWS and N_COLS == BLOCK_COLS, so
    no tile reaches into another batch or head.  (Not a rank-4 [batch, rows, heads, cols]
    descriptor: Triton 3.7's warp specialisation splits a tile's rows over two consumer
    warpgroups and fails on the reshape from [1, rows, 1, cols].)"""
    return tl.make_tensor_descriptor(BASE, shape=[n_rows, (n_heads - 1) * stride_h + N_COLS],
                                     strides=[stride_s, 1], block_shape=[BLOCK_ROWS, BLOCK_COLS])


@triton.jit
def whole_stats(STATS, n_batch, stride_b, stride_h, n_heads, n_rows, BLOCK: tl.constexpr):
    """A 1-D TMA descriptor over a whole (batch, heads, rows) fp32 statistics buffer (lse, delta)
    for persistent programs (whole_tiles' companion): head h of batch b starts at b * stride_b +
    h * stride_h."""
    return row_stats(STATS, (n_batch - 1) * stride_b + (n_heads - 1) * stride_h + n_rows, BLOCK, True)


@triton.jit
def load_rows(TILES, start, offs_r, stride_s, row_limit, offs_c, col_limit, CHECK_ROWS: tl.constexpr,
              CHECK_COLS: tl.constexpr, TMA: tl.constexpr, row0=0, col0=0):
    """The [R, C] tile of rows start + offs_r from what row_tiles returned (offs_r starts at start);
    row0, col0: where the head starts in whole_tiles' matrix."""
    if TMA:
        return TILES.load([row0 + start, col0])
    else:
        return load_tile(TILES + offs_r[:, None] * stride_s + offs_c[None, :], offs_r, row_limit, offs_c,
                         col_limit, CHECK_ROWS, CHECK_COLS)


@triton.jit
def row_stats(HEAD, n_rows, BLOCK: tl.constexpr, DESCRIPTOR: tl.constexpr):
    """What a head's per-row fp32 statistics (lse, delta) are read or written through: its pointer,
    or a 1-D TMA descriptor (warp-specialised kernels; the row start must be 16-byte aligned)."""
    if DESCRIPTOR:
        return tl.make_tensor_descriptor(HEAD, shape=[n_rows], strides=[1], block_shape=[BLOCK])
    else:
        return HEAD


@triton.jit
def load_stats(STATS, start, offs, n_rows, DESCRIPTOR: tl.constexpr):
    """Rows start + offs of what row_stats returned (0 past n_rows)."""
    if DESCRIPTOR:
        return STATS.load([start])
    else:
        return tl.load(STATS + offs, mask=offs < n_rows, other=0.0)


# Reductions through the builtin tl.reduce with triton's own combine functions: tl.sum /
# tl.max are @jit library functions that the per-launch interpreter (kernels/_interpret.py)
# cannot call, while tl.reduce is a builtin; and the interpreter has numpy fast paths for
# exactly these two combine functions (anything else runs element by element in Python).
# On the GPU this is the same code as tl.sum / tl.max.
@triton.jit
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


# Integer arguments are never specialised by value (divisible-by-16, == 1): jax-triton cannot
# do it, so torch launches don't either and both compile the identical kernel variant.  The
# launch plan proves stride alignment instead and the kernels state it (STRIDES_ALIGNED,
# see `aligned`).
COMMON_INTS = [
    "stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
    "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h", "bias_stride_b",
    "bias_stride_h", "bias_stride_s", "mask_stride_b", "mask_stride_h", "mask_stride_s", "seg_stride_qb",
    "seg_stride_kb", "seqlen_q", "seqlen_k", "total_q", "total_k", "num_heads_q", "diag_shift",
    "window_left", "window_right", "dropout_threshold", "sparse_stride_b", "sparse_stride_h", "sparse_kstride_b",
    "sparse_kstride_h", "num_q_blocks", "num_k_blocks", "pos_stride_qb", "pos_stride_kb",
]
FWD_INTS = COMMON_INTS + ["num_work"]
BWD_DKDV_INTS = COMMON_INTS + ["stride_dkb", "stride_dks", "stride_dkh", "stride_dvb", "stride_dvs", "stride_dvh",
                               "dbias_stride_b", "dbias_stride_h", "dbias_stride_s", "num_work"]
BWD_DQ_INTS = COMMON_INTS + ["stride_dqb", "stride_dqs", "stride_dqh", "num_work"]
PREPROCESS_INTS = ["stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h", "seqlen_q", "total_q",
                   "num_heads_q"]
DROPOUT_MASK_INTS = ["seqlen_q", "seqlen_k", "num_heads", "dropout_seed", "dropout_threshold"]
ONE_PASS_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
                 "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h", "stride_dkb",
                 "stride_dks", "stride_dkh", "stride_dvb", "stride_dvs", "stride_dvh", "stride_dqb", "stride_dqs",
                 "stride_dqh", "batch", "seqlen_q", "seqlen_k", "num_heads_kv", "diag", "window_left", "num_work",
                 "seg_stride_qb", "seg_stride_kb", "bias_stride_b", "bias_stride_h", "bias_stride_s", "mask_stride_b",
                 "mask_stride_h", "mask_stride_s", "sparse_kstride_b", "sparse_kstride_h", "num_q_blocks",
                 "dropout_threshold"]
GLUON_FWD_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                  "stride_vs", "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h",
                  "batch", "seqlen_q", "seqlen_k", "num_heads_q", "diag", "window_left", "num_work",
                  "seg_stride_qb", "seg_stride_kb", "bias_stride_b", "bias_stride_h", "bias_stride_s", "mask_stride_b",
                  "mask_stride_h", "mask_stride_s", "sparse_stride_b", "sparse_stride_h", "num_k_blocks",
                  "dropout_threshold"]


@triton.jit
def aligned(stride_b, stride_s, stride_h, ALIGNED: tl.constexpr):
    """Declare (batch, seq, head) strides divisible by 16 elements when the launch plan proved it,
    so row loads vectorise and the software pipeliner turns them into cp.async copies (it
    refuses loads whose row stride it cannot prove 16-aligned: measured, no pipelining at
    all without this).  torch and jax launches compile the same hints.

    Why not tl.multiple_of: on a kernel argument it annotates nothing (an argument has no
    defining op to carry the attribute), so Triton's axis analysis never sees it.  Rounding
    down to a multiple of 16 is a no-op on the aligned values the plan passes, and the
    analysis derives the divisibility from the multiply.
    """
    if ALIGNED:
        stride_b = (stride_b >> 4) * 16
        stride_s = (stride_s >> 4) * 16
        stride_h = (stride_h >> 4) * 16
    return stride_b, stride_s, stride_h


@triton.jit
def sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k, total_q, total_k, IS_VARLEN: tl.constexpr):
    """(q_start, k_start, seqlen_q, seqlen_k) of sequence b: packed offsets for varlen, else 0.

    Varlen tables may be traced values no host ever checked, so every bound is clamped to the
    buffers: a sequence is [cu[b], cu[b+1]) clipped to [0, total) (empty if reversed) and at most
    max_seqlen long (the seqlen arguments, which size the grid).  Rows outside every clamped
    sequence are left to the launcher's fill (0, lse -inf): no read or write leaves the buffers,
    whatever the values.
    """
    q_start = 0
    k_start = 0
    if IS_VARLEN:
        q_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b), 0), total_q)
        q_end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b + 1), q_start), total_q)
        seqlen_q = tl.minimum(q_end - q_start, seqlen_q)
        k_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b), 0), total_k)
        k_end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b + 1), k_start), total_k)
        seqlen_k = tl.minimum(k_end - k_start, seqlen_k)
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def program_tile(num_heads, ORDER, order_stride_b, order_stride_h, BLOCK_SPARSE: tl.constexpr,
                 UNEVEN: tl.constexpr, HEAVY_LAST: tl.constexpr, SCHEDULE_HEADS: tl.constexpr = 4,
                 work=0, num_work=0, num_tiles=0, PERSISTENT: tl.constexpr = False):
    """(tile, batch, head, layout row) of this program; grid = (tiles, batch * heads).  PERSISTENT:
    of work item `work` of num_work = num_tiles * batch * heads, which persistent programs take in
    turn, each striding by the number of programs.

    Load balance: block-sparse launches take their tiles busiest-first from the layout's
    ORDER (which may broadcast over batch and heads).  Dense launches whose tiles do UNEVEN
    work (a one-sided window: causal) run busiest-first within groups of SCHEDULE_HEADS
    heads: blocks are dispatched in order of (x + y * grid_x), and that index is read
    tile-major inside each group (the group's busiest tiles first; HEAVY_LAST when the last
    tiles are the busiest, as causal query tiles are).  The final wave then holds short
    programs instead of the last heads' long ones, while the programs in flight still share
    a few heads' K/V in L2 (tile-major over all heads re-read K/V from DRAM: 40% slower at
    S=2048, NOTES: "Causal grids: busiest tiles first, within groups of four heads").  Even work keeps
    head-major order.  Persistent
    programs take UNEVEN work head-major in rounds of alternating direction (below; the grouped
    order, whose lengths repeat every group, dealt some programs only the long tiles: -23% at
    S=4096, and tile-major over all heads lost L2 sharing: NOTES: "Persistent launches").
    """
    if PERSISTENT:
        n_tiles = num_tiles
        if UNEVEN and not BLOCK_SPARSE:
            # Head-major (the programs in flight share a few heads' K/V in L2), in rounds of one
            # item per program that alternate direction: a program that drew a long tile in one
            # round draws a short one in the next, so every program's share evens out over a few
            # rounds.  (A last partial round keeps its direction, to stay inside num_work.)
            programs = tl.num_programs(0)
            round_ = work // programs
            backward = (round_ % 2 == 1) & ((round_ + 1) * programs <= num_work)
            work = tl.where(backward, round_ * programs + programs - 1 - work % programs, work)
        tile = work % n_tiles
        pid_bh = work // n_tiles
        if UNEVEN and HEAVY_LAST and not BLOCK_SPARSE:
            tile = n_tiles - 1 - tile
    else:
        tile = tl.program_id(0)
        pid_bh = tl.program_id(1)
        n_tiles = tl.num_programs(0)
        n_bh = tl.num_programs(1)
        if UNEVEN and not BLOCK_SPARSE:
            dispatched = pid_bh * n_tiles + tile
            first_bh = dispatched // (SCHEDULE_HEADS * n_tiles) * SCHEDULE_HEADS
            group_heads = tl.minimum(n_bh - first_bh, SCHEDULE_HEADS)
            within = dispatched - first_bh * n_tiles
            tile = within // group_heads
            pid_bh = first_bh + within % group_heads
            if HEAVY_LAST:
                tile = n_tiles - 1 - tile
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    layout_row = 0
    if BLOCK_SPARSE:
        layout_row = b.to(tl.int64) * order_stride_b + h * order_stride_h
        tile = tl.load(ORDER + layout_row + tile)
    return tile, b, h, layout_row


@triton.jit
def tile_start(it, BLOCK_LIST, first_block, BLOCK: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
               SPARSE_CONTIGUOUS: tl.constexpr):
    """Start of the tile an inner loop visits at step `it`.

    Dense loops step through positions, so `it` is the start.  Block-sparse loops step
    through the block list; a layout whose rows are runs of blocks needs only the first
    (no dependent index load inside the loop).
    """
    if BLOCK_SPARSE:
        if SPARSE_CONTIGUOUS:
            start = (first_block + it) * BLOCK
        else:
            start = tl.load(BLOCK_LIST + it) * BLOCK
    else:
        start = it
    return tl.multiple_of(start, BLOCK)
