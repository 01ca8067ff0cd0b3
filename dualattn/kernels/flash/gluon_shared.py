"""Gluon helpers both Hopper kernels use (forward_gluon.py, backward_gluon.py): wgmma layouts, the
partition barrier, the soft cap's tanh, and the bias / attention-mask tiles (copied into shared
memory by cp.async, applied to the scores by integer operations).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# Triton 3.6 names the partition-wide barrier `thread_barrier`, 3.7 `barrier`.
partition_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# The bits of float32 -inf, as an int32.
NEG_INF_BITS = gl.constexpr(-8388608)


@gluon.constexpr_function
def mma_layout(M, N, num_warps):
    """wgmma accumulator layout of an [M, N] tile: warps along M first (16 rows each), then N."""
    wm = min(num_warps, max(M // 16, 1))
    wn = num_warps // wm
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[wm, wn], instr_shape=[16, N // wn, 16])


@gluon.jit
def load_rows(desc, row, head, bar, buf, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr):
    """TMA-load the box's rows from `row` on, of head `head`, into buf.  BLOCK_D > HEAD_DIM (D = 96, 192): the
    descriptor is (rows, heads, dims), so the tile's columns past HEAD_DIM are TMA's zeros, not the next head's."""
    if BLOCK_D == HEAD_DIM:
        tma.async_copy_global_to_shared(desc, [row, head * HEAD_DIM], bar, buf)
    else:
        tma.async_copy_global_to_shared(desc, [row, head, 0], bar,
                                        buf._reinterpret(buf.dtype, [buf.shape[0], 1, BLOCK_D], desc.layout))


@gluon.jit
def capped_tanh(x, SOFTCAP: gl.constexpr):
    """tanh(x), as rules.capped_tanh (the Triton kernels' soft cap; the same two forms, the same
    numbers): SOFTCAP 2 or 3, the GPU's tanh.approx.f32; 1, the exp2 form, accurate to fp32."""
    if SOFTCAP >= 2:
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=gl.float32, is_pure=True,
                                         pack=1)
    else:
        return 1.0 - 2.0 / (gl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


@gluon.constexpr_function
def score_copy_layout(BN, num_warps):
    """A copy layout of [rows, BN] score tiles (copy_score_tile) over `num_warps` warps: 8 consecutive elements a
    thread (16-byte copies of a 16-bit bias, L1 bypassed), a warp's lanes across a row's BN keys, so that each
    warp's requests cover whole sectors."""
    return gl.BlockedLayout([1, 8], [32 // (BN // 8), BN // 8], [num_warps, 1], [1, 0])


@gluon.jit
def copy_score_tile(buf, ROW, rows, stride, row_ok, n0, seqlen_k, BN: gl.constexpr, LAYOUT: gl.constexpr):
    """Start copying keys n0.. of some rows of a per-score tensor (bias, attention mask) into `buf`
    (cp.async, zeros outside the sequences): row i starts at ROW + rows[i] * stride; LAYOUT spreads the
    copy over the partition's threads, runs of 8 or more consecutive elements each.  Issued once the
    previous tile has read `buf`, it lands during the next GEMMs, with no registers holding it (a TMA
    ring would not fit beside the kernels' tiles).  The plans make the rows' offsets and Sk multiples
    of 8 elements (16-byte copies of a 16-bit bias: hopper.score_tiles_copyable).

    The row offsets are recomputed at each copy, from `rows` passed through an opaque move: computed
    once, they were a thread's several values held through the key loop, which ptxas spilled and
    reloaded before every copy (docs/lessons.md, "Score tiles: row offsets, not spills")."""
    rows = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [rows], dtype=gl.int32, is_pure=False, pack=1)
    keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, LAYOUT))
    ptrs = ROW + (gl.expand_dims(gl.multiple_of(rows * stride, [8]), 1) + gl.expand_dims(keys, 0))
    ok = gl.max_constancy(gl.expand_dims(row_ok, 1) & gl.expand_dims(keys < seqlen_k, 0), [1, 8])
    async_copy.async_copy_global_to_shared(buf, ptrs, mask=ok)


@gluon.jit
def scores_landed(IN_FLIGHT: gl.constexpr = 0):
    """The tiles the partition's threads copied (cp.async) are there for all of them: each thread's
    copies done but for its IN_FLIGHT youngest commit groups (later tiles'), then a partition barrier
    (each copied parts that others read)."""
    async_copy.wait_group(IN_FLIGHT)
    partition_barrier()


@gluon.constexpr_function
def mask_pairs_layout(HM, BN):
    """The layout of a [HM, BN // 2] int16 view of a [HM, BN] byte mask tile in which each thread holds the
    pairs of adjacent keys it holds of S (mma_layout(HM, BN, 4): per thread, rows r and r + 8, keys 2q, 2q + 1
    and their steps of 8): joined with a second tile of this layout as the pairs' second halves, and
    reshaped, it is S's layout register for register, so no layout conversion moves data."""
    reg = [[8, 0]] + [[0, 4 << i] for i in range((BN // 8).bit_length() - 1)]
    return gl.DistributedLinearLayout(reg_bases=reg, lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
                                      warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HM, BN // 2])


@gluon.jit
def masked_scores(s, mask_buf, HM: gl.constexpr, BN: gl.constexpr):
    """s ([HM, BN], mma_layout) where the attention-mask tile in `mask_buf` is 1, -inf where it is 0 (the
    launchers pass masks of 0 and 1): min(s, +inf or -inf).  The tile is read as int16 pairs of adjacent
    keys, as each thread holds them, and a pair's bounds are its bit 0 and bit 8 moved to the sign and
    xored with the bits of -inf: a shift and a logic op a score, with no byte extracted (read byte by
    byte it is a byte extract, a shift and an xor a score, which the exp2-bound forward at D = 64 feels:
    docs/lessons.md, "Mask pairs")."""
    gl.static_assert(HM == 64, "mask_pairs_layout: four warps of 16 rows")
    w = mask_buf._reinterpret(gl.int16, [HM, BN // 2], gl.SwizzledSharedLayout(8, 1, 8, [1, 0]))
    w = w.load(mask_pairs_layout(HM, BN)).to(gl.int32)
    first = (w << 31) ^ NEG_INF_BITS
    second = ((w << 23) & -2147483648) ^ NEG_INF_BITS
    bounds = gl.reshape(gl.join(first, second), [HM, BN]).to(gl.float32, bitcast=True)
    return gl.minimum(s, gl.convert_layout(bounds, s.type.layout))


@gluon.jit
def masked_bits(x, keep, FILL_BITS: gl.constexpr):
    """x where `keep` is 1, the float whose bits are FILL_BITS where it is 0 (the launchers pass masks
    of 0 and 1), by integer operations on x's bits.  Written as a select on `keep != 0`, LLVM packs
    each thread's 64 predicates into bit masks and out again (docs/lessons.md, "Mask pairs")."""
    keep_all = -(keep.to(gl.int32))   # -1 where keep is 1, 0 where it is 0
    bits = x.to(gl.int32, bitcast=True) & keep_all
    if FILL_BITS != 0:
        bits = bits | (~keep_all & FILL_BITS)
    return bits.to(gl.float32, bitcast=True)
