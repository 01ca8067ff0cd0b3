"""The merge of split-KV partial results, and the sinks both the merge and an unsplit launch add.

Split s of a query row holds o_s (normalised over its keys) and lse_s (natural log); the row's result
is  lse = log sum_s exp(lse_s),  o = sum_s exp(lse_s - lse) o_s,  all in fp32.  A split with no key
has lse_s = -inf and weighs nothing; a row with no key at all gives o = 0, lse = -inf.  Sinks join the
denominator last:  lse' = logaddexp(lse, lse_sinks),  o' = o exp(lse - lse').
"""
import triton
import triton.language as tl

from .decode_rows import row_max, row_sum

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def add_sinks(out, lse, SINKS, heads, NUM_SINKS: tl.constexpr, SINKS_PER_HEAD: tl.constexpr,
              BLOCK_SINKS: tl.constexpr):
    """(out, lse) with the sinks of `heads` ([R] query heads) joining the softmax; out [R, D], lse [R]."""
    offs_j = tl.arange(0, BLOCK_SINKS)
    if SINKS_PER_HEAD:
        ptrs = SINKS + heads[:, None] * NUM_SINKS + offs_j[None, :]
    else:
        ptrs = SINKS + heads[:, None] * 0 + offs_j[None, :]
    logits = tl.load(ptrs, mask=(offs_j < NUM_SINKS)[None, :], other=float("-inf")).to(tl.float32)  # [R, S]
    top = row_max(logits, 1)
    sink_lse = top + tl.log2(row_sum(tl.exp2((logits - top[:, None]) * LOG2E), 1)) * LN2
    both = tl.maximum(lse, sink_lse)
    total = both + tl.log2(tl.exp2((lse - both) * LOG2E) + tl.exp2((sink_lse - both) * LOG2E)) * LN2
    return out * tl.exp2((lse - total) * LOG2E)[:, None], total


@triton.jit
def decode_combine(O_PART, LSE_PART, SINKS,
                   OUT, LSE,
                   ROWS: tl.constexpr, HQ: tl.constexpr, SQ: tl.constexpr, D: tl.constexpr,
                   NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                   HAS_SINKS: tl.constexpr, NUM_SINKS: tl.constexpr, SINKS_PER_HEAD: tl.constexpr,
                   BLOCK_SINKS: tl.constexpr):
    """One program per query row (b, i, head): O_PART (NUM_SPLITS, B, SQ, HQ, D) and LSE_PART
    (NUM_SPLITS, B, HQ, SQ) fp32 -> OUT (B, SQ, HQ, D) and LSE (B, HQ, SQ)."""
    row = tl.program_id(0)             # = (b * SQ + i) * HQ + head: OUT's row
    head = row % HQ
    i = (row // HQ) % SQ
    b = row // (HQ * SQ)
    lse_row = (b * HQ + head) * SQ + i
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse_s = tl.load(LSE_PART + offs_s * ROWS + lse_row, mask=mask_s, other=float("-inf"))   # [BLOCK_S]
    o_s = tl.load(O_PART + (offs_s[:, None] * ROWS + row) * D + offs_d[None, :],
                  mask=mask_s[:, None] & (offs_d < D)[None, :], other=0.0)                  # [BLOCK_S, BLOCK_D]
    top = row_max(lse_s, 0)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    w = tl.exp2((lse_s - top_safe) * LOG2E)
    total = row_sum(w, 0)
    out = row_sum(w[:, None] * o_s, 0) / tl.where(total > 0, total, 1.0)                      # [BLOCK_D]
    lse = tl.where(total > 0, top_safe + tl.log2(tl.where(total > 0, total, 1.0)) * LN2, float("-inf"))
    out2 = out[None, :]
    lse2 = tl.full((1,), 0.0, tl.float32) + lse
    if HAS_SINKS:
        out2, lse2 = add_sinks(out2, lse2, SINKS, tl.full((1,), 0, tl.int32) + head, NUM_SINKS,
                               SINKS_PER_HEAD, BLOCK_SINKS)
    tl.store(OUT + row * D + offs_d[None, :], out2.to(OUT.dtype.element_ty), mask=(offs_d < D)[None, :])
    tl.store(LSE + lse_row + tl.arange(0, 1), lse2)
