"""Split-KV decode attention over a dense or paged KV cache, GQA-packed.

Grid (NUM_SPLITS, B * HKV, row blocks).  A program owns KV head h of sequence b and BLOCK_M of its
G * SQ query rows (G = HQ / HKV query heads share the head: row r is query i = r // G of head
h * G + r % G), so each K/V tile is loaded once for the whole group.  The keys the block can see,
[lo, hi), are cut into NUM_SPLITS equal chunks of that sequence's own length (ragged batches keep
every split busy); a program runs the online softmax over its chunk and writes either the final
result (NUM_SPLITS = 1) or an fp32 partial (o normalised over the chunk, its lse) for
decode_combine.

Positions are absolute cache rows.  Query i sits at kv_len - SQ + i (bottom-right aligned); key j is
visible when first <= j < kv_len (first = cache_leftpad), j <= pos + WINDOW_RIGHT and
j >= pos - WINDOW_LEFT (-1: unbounded; causal is WINDOW_RIGHT = 0):

    SQ = 2, kv_len = 5, causal        1 1 1 1 0
                                      1 1 1 1 1

Scores: qk * scale -> soft cap (cap * tanh(s / cap)) -> ALiBi (- slope * |pos - j|) -> mask.
"""
import triton
import triton.language as tl

from .decode_combine import LN2, LOG2E, add_sinks
from .decode_rows import cache_rows, row_max, row_sum, sequence_bounds


@triton.jit
def decode_attend(Q, K_CACHE, V_CACHE, SEQLENS, BATCH_IDX, LEFTPAD, BLOCK_TABLE, ALIBI, SINKS,
                  sm_scale, softcap,
                  O, LSE,
                  BATCH: tl.constexpr, SQ: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, S_NEW: tl.constexpr, CAPACITY: tl.constexpr, B_CACHE: tl.constexpr,
                  PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_PAGES: tl.constexpr,
                  STRIDE_KB: tl.constexpr, STRIDE_KS: tl.constexpr, STRIDE_KH: tl.constexpr,
                  STRIDE_VB: tl.constexpr, STRIDE_VS: tl.constexpr, STRIDE_VH: tl.constexpr,
                  STRIDE_BT: tl.constexpr, ALIBI_STRIDE_B: tl.constexpr,
                  HAS_SEQLENS: tl.constexpr, HAS_BATCH_IDX: tl.constexpr, HAS_LEFTPAD: tl.constexpr,
                  HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr,
                  WINDOW_LEFT: tl.constexpr, WINDOW_RIGHT: tl.constexpr,
                  HAS_SINKS: tl.constexpr, NUM_SINKS: tl.constexpr, SINKS_PER_HEAD: tl.constexpr,
                  BLOCK_SINKS: tl.constexpr):
    """Q (BATCH, SQ, HQ, D) row-major; caches by element strides (last dim contiguous).  O, LSE:
    (NUM_SPLITS, BATCH, SQ, HQ, D) / (NUM_SPLITS, BATCH, HQ, SQ) fp32 partials when NUM_SPLITS > 1,
    else the results (BATCH, SQ, HQ, D) in Q's dtype / (BATCH, HQ, SQ) fp32."""
    G: tl.constexpr = HQ // HKV
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // HKV
    h = pid_bh % HKV

    n_cached, kv_len, first, b_cache = sequence_bounds(SEQLENS, BATCH_IDX, LEFTPAD, b, S_NEW, CAPACITY,
                                                       B_CACHE, HAS_SEQLENS, HAS_BATCH_IDX, HAS_LEFTPAD)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)     # packed rows of the group
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < G * SQ
    mask_d = offs_d < D
    i_q = tl.minimum(offs_m // G, SQ - 1)
    heads = h * G + offs_m % G
    q_rows = (b * SQ + i_q) * HQ + heads                  # [BLOCK_M]: Q's and O's row
    q = tl.load(Q + q_rows.to(tl.int64)[:, None] * D + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    pos = kv_len - SQ + i_q                               # [BLOCK_M] absolute query positions

    # The keys some row of this block may see, cut into this sequence's NUM_SPLITS chunks.
    i_first = (pid_m * BLOCK_M) // G
    i_last = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // G, SQ - 1)
    lo = first
    hi = kv_len
    if WINDOW_LEFT >= 0:
        lo = tl.maximum(lo, kv_len - SQ + i_first - WINDOW_LEFT)
    if WINDOW_RIGHT >= 0:
        hi = tl.minimum(hi, kv_len - SQ + i_last + WINDOW_RIGHT + 1)
    span = tl.maximum(hi - lo, 0)
    chunk = ((span + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = lo + pid_s * chunk
    end = tl.minimum(start + chunk, hi)

    if HAS_ALIBI:
        slope = tl.load(ALIBI + b * ALIBI_STRIDE_B + heads).to(tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, BLOCK_D), 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        outer, inner, _ = cache_rows(offs_n, b, b_cache, BLOCK_TABLE, STRIDE_BT, CAPACITY, PAGED, PAGE_SIZE,
                                     NUM_PAGES)
        k_off = outer * STRIDE_KB + inner * STRIDE_KS
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(K_CACHE + k_off[:, None] + h * STRIDE_KH + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k)) * sm_scale              # [BLOCK_M, BLOCK_N]
        if SOFTCAP:
            s = softcap * (1.0 - 2.0 / (tl.exp2(s * (2.0 * LOG2E / softcap)) + 1.0))
        if HAS_ALIBI:
            s -= slope[:, None] * tl.abs(pos[:, None] - offs_n[None, :]).to(tl.float32)
        visible = mask_n[None, :] & (offs_n[None, :] >= first)
        if WINDOW_LEFT >= 0:
            visible &= offs_n[None, :] >= pos[:, None] - WINDOW_LEFT
        if WINDOW_RIGHT >= 0:
            visible &= offs_n[None, :] <= pos[:, None] + WINDOW_RIGHT
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, row_max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: p = 0, not NaN
        p = tl.exp2((s - m_safe[:, None]) * LOG2E)
        alpha = tl.exp2((m_i - m_safe) * LOG2E)
        v_off = outer * STRIDE_VB + inner * STRIDE_VS
        v = tl.load(V_CACHE + v_off[:, None] + h * STRIDE_VH + offs_d[None, :], mask=kv_mask, other=0.0)
        l_i = l_i * alpha + row_sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)) * LN2, float("-inf"))
    if NUM_SPLITS == 1:
        if HAS_SINKS:
            out, lse = add_sinks(out, lse, SINKS, heads, NUM_SINKS, SINKS_PER_HEAD, BLOCK_SINKS)
    part = pid_s * (BATCH * SQ * HQ)
    tl.store(O + (part + q_rows).to(tl.int64)[:, None] * D + offs_d[None, :], out.to(O.dtype.element_ty),
             mask=mask_m[:, None] & mask_d[None, :])
    tl.store(LSE + part + (b * HQ + heads) * SQ + i_q, lse, mask=mask_m)
