"""New k / v rows into the cache, rotary embedding on k and q: one program per (sequence, row).

Program (b, t): new row t < S_NEW of sequence b goes to cache row n_cached + t (n_cached =
cache_seqlens[b], clamped), k rotated at that position.  With ROTARY, query row t < SQ is rotated at
n_cached + t (Q_STEP: causal or windowed calls) or at n_cached (flash-attn's rule for the others).

Rotary over the first ROTARY_DIM dims, angles cos / sin (SEQLEN_RO, ROTARY_DIM / 2), in fp32:
    INTERLEAVED   pairs (2i, 2i + 1)            x'[2i] = x[2i] cos_i - x[2i+1] sin_i
    otherwise     pairs (i, i + ROTARY_DIM / 2)  (GPT-NeoX)

IN_PLACE: rows go straight into the caches (K_OUT, V_OUT are the caches; dense or paged addressing);
a row past the capacity or in a page entry out of range is dropped.  Otherwise K_OUT is a compact
(B, S_NEW, HKV, D) buffer of the rotated rows, which the caller scatters itself (JAX: an XLA update
that aliases a donated cache) and V_OUT is not written.
"""
import triton
import triton.language as tl

from .decode_rows import cache_rows, sequence_bounds


@triton.jit
def _rotated(X, rows, offs_d, mask, COS, SIN, pos, D: tl.constexpr, ROTARY_DIM: tl.constexpr,
             INTERLEAVED: tl.constexpr, SEQLEN_RO: tl.constexpr):
    """The rows X + rows[:, None] + offs_d[None, :], rotated at position `pos`, fp32 [R, BLOCK_D]."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    x = tl.load(X + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if INTERLEAVED:
        partner = offs_d ^ 1
        angle = offs_d // 2
        sign = tl.where(offs_d % 2 == 0, -1.0, 1.0)
    else:
        partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        angle = offs_d % HALF
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
    rotary = offs_d < ROTARY_DIM
    partner = tl.where(rotary, partner, offs_d)
    x_p = tl.load(X + rows[:, None] + partner[None, :], mask=mask & rotary[None, :], other=0.0).to(tl.float32)
    at = tl.minimum(tl.maximum(pos, 0), SEQLEN_RO - 1).to(tl.int64) * HALF + angle
    cos = tl.load(COS + at, mask=rotary, other=1.0).to(tl.float32)
    sin = tl.load(SIN + at, mask=rotary, other=0.0).to(tl.float32)
    return x * cos[None, :] + x_p * (sign * sin)[None, :]


@triton.jit
def decode_append(Q, K, V, COS, SIN, SEQLENS, BATCH_IDX, BLOCK_TABLE,
                  Q_OUT, K_OUT, V_OUT,
                  SQ: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, S_NEW: tl.constexpr, CAPACITY: tl.constexpr,
                  B_CACHE: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_PAGES: tl.constexpr,
                  STRIDE_KB: tl.constexpr, STRIDE_KS: tl.constexpr, STRIDE_KH: tl.constexpr,
                  STRIDE_VB: tl.constexpr, STRIDE_VS: tl.constexpr, STRIDE_VH: tl.constexpr,
                  STRIDE_BT: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, IN_PLACE: tl.constexpr,
                  ROTARY: tl.constexpr, ROTARY_DIM: tl.constexpr, INTERLEAVED: tl.constexpr,
                  SEQLEN_RO: tl.constexpr, Q_STEP: tl.constexpr):
    """Q (B, SQ, HQ, D), K / V (B, S_NEW, HKV, D) row-major; Q_OUT like Q (written under ROTARY)."""
    b = tl.program_id(0)
    t = tl.program_id(1)
    n_cached, _, _, b_cache = sequence_bounds(SEQLENS, BATCH_IDX, SEQLENS, b, S_NEW, CAPACITY, B_CACHE,
                                              True, HAS_BATCH_IDX, False)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    if t < S_NEW:
        offs_h = tl.arange(0, BLOCK_HKV)
        mask = (offs_h < HKV)[:, None] & mask_d[None, :]
        src = ((b * S_NEW + t) * HKV + offs_h).to(tl.int64) * D       # [BLOCK_HKV]
        if ROTARY:
            k = _rotated(K, src, offs_d, mask, COS, SIN, n_cached + t, D, ROTARY_DIM, INTERLEAVED, SEQLEN_RO)
        else:
            k = tl.load(K + src[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if IN_PLACE:
            v = tl.load(V + src[:, None] + offs_d[None, :], mask=mask, other=0.0)
            row = n_cached + t
            outer, inner, valid = cache_rows(row, b, b_cache, BLOCK_TABLE, STRIDE_BT, CAPACITY, PAGED,
                                             PAGE_SIZE, NUM_PAGES)
            keep = mask & valid & (row < CAPACITY)
            k_dst = outer * STRIDE_KB + inner * STRIDE_KS + offs_h[:, None] * STRIDE_KH + offs_d[None, :]
            v_dst = outer * STRIDE_VB + inner * STRIDE_VS + offs_h[:, None] * STRIDE_VH + offs_d[None, :]
            tl.store(K_OUT + k_dst, k.to(K_OUT.dtype.element_ty), mask=keep)
            tl.store(V_OUT + v_dst, v.to(V_OUT.dtype.element_ty), mask=keep)
        else:
            tl.store(K_OUT + src[:, None] + offs_d[None, :], k.to(K_OUT.dtype.element_ty), mask=mask)
    if ROTARY:
        if t < SQ:
            offs_h = tl.arange(0, BLOCK_HQ)
            mask = (offs_h < HQ)[:, None] & mask_d[None, :]
            src = ((b * SQ + t) * HQ + offs_h).to(tl.int64) * D
            at = n_cached + t if Q_STEP else n_cached
            q = _rotated(Q, src, offs_d, mask, COS, SIN, at, D, ROTARY_DIM, INTERLEAVED, SEQLEN_RO)
            tl.store(Q_OUT + src[:, None] + offs_d[None, :], q.to(Q_OUT.dtype.element_ty), mask=mask)
