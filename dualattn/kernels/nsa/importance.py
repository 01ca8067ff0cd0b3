"""NSA block importance: the compressed-branch probabilities summed over a KV group's heads, per token
and key block, for the top-k selection (not differentiated).

    scores[b, t, h_kv, c] = sum over the group's heads of exp(q_t . kc_c * scale - lse_t)   c visible to t
                          = +inf                                                             c = t's own block
                          = -inf                                                             c after t's own block

with kc_c the pooled key of block c (visible to t iff (c + 1) * block_size - 1 <= t) and lse the
compressed branch's (natural log, (B, Hq, T)).  Fused: the (T, Hq, blocks) probabilities never
reach memory, only the (T, Hkv, blocks) sums.  The rows are the selected-branch kernels' (a
program owns a KV group's heads for TOKENS tokens), so the group sum is a reduction over a tile axis.
IS_VARLEN: packed sequences (B = 1; grid axis 1 = sequence * Hkv), t counted from each sequence's
start (CU_SEQLENS), its pooled keys from row CU_CMP[sequence] of K_CMP; rows past the sequence's
blocks are -inf.
"""
import triton
import triton.language as tl

from ..flash.rules import LOG2E, reduce_max
from .selected import group_rows, head_base, program_rows

IMPORTANCE_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_lb",
                   "stride_lh", "stride_ls", "stride_sb", "stride_ss", "stride_sh", "seqlen", "total", "num_heads_kv",
                   "num_blocks"]


@triton.jit(do_not_specialize=IMPORTANCE_INTS)
def nsa_importance_kernel(
    Q, K_CMP, LSE, CU_SEQLENS, CU_CMP,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_lb, stride_lh, stride_ls,
    stride_sb, stride_ss, stride_sh, seqlen, total, num_heads_kv, num_blocks, sm_scale,
    SCORES,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_C: tl.constexpr, DOT_PRECISION: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if IS_VARLEN:   # the sequence's pooled keys start at its row of the pooled blocks' table
        cmp_start = tl.load(CU_CMP + tl.program_id(1) // num_heads_kv).to(tl.int64)
    else:
        cmp_start = start
    num_cmp = seq_len // BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
    lse = tl.load(LSE + b * stride_lb + h_rows * stride_lh + (start + t_rows) * stride_ls, mask=row_ok,
                  other=float("-inf"))
    # +inf for a padded row and for one that sees no pooled block yet (lse -inf): exp2(s - inf) = 0,
    # so such rows add nothing to the group sums without a mask.
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    K_HEAD = head_base(K_CMP, b, cmp_start, h_kv, stride_kb, stride_ks, stride_kh)
    t_tok = t0 + tl.arange(0, TOKENS)
    own = (t_tok // BLOCK_SIZE)[:, None]
    tok_ok = (t_tok < seq_len)[:, None]
    S_ROWS = SCORES + b * stride_sb + (start + t_tok)[:, None] * stride_ss + h_kv * stride_sh
    qk_scale = sm_scale * LOG2E
    # Three ranges of pooled blocks: whole tiles before every row's own block (visible to all: no
    # mask, so the loop pipelines), the tiles up to the last row's own block (visibility, +inf for
    # the own block, -inf after it), and the rest of the row (-inf, no scores to compute).
    # (Varlen: a program past a shorter sequence's end runs no loop.)
    live = t0 < seq_len
    c_open = tl.where(live, (t0 // BLOCK_SIZE) // BLOCK_C * BLOCK_C, 0)
    c_end = tl.where(live, (tl.minimum(t0 + TOKENS, seq_len) - 1) // BLOCK_SIZE + 1, 0)
    c_rest = tl.where(live, (c_end + BLOCK_C - 1) // BLOCK_C * BLOCK_C, num_blocks)
    for c0 in tl.range(0, c_open, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        kc = tl.load(K_HEAD + offs_c[:, None] * stride_ks + offs_d[None, :], mask=offs_d[None, :] < HEAD_DIM,
                     other=0.0)
        p = tl.exp2(tl.dot(q, tl.trans(kc), input_precision=DOT_PRECISION) * qk_scale - lse2[:, None])
        tl.store(S_ROWS + offs_c[None, :], group_sum(p, TOKENS, GROUP_PAD, BLOCK_C), mask=tok_ok)
    for c0 in tl.range(c_open, c_end, BLOCK_C, num_stages=1):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        kc = tl.load(K_HEAD + offs_c[:, None] * stride_ks + offs_d[None, :],
                     mask=(offs_c[:, None] < num_cmp) & (offs_d[None, :] < HEAD_DIM), other=0.0)
        s = tl.dot(q, tl.trans(kc), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_C]
        visible = (offs_c[None, :] + 1) * BLOCK_SIZE - 1 <= t_rows[:, None]
        imp = group_sum(tl.where(visible, tl.exp2(s * qk_scale - lse2[:, None]), 0.0), TOKENS, GROUP_PAD, BLOCK_C)
        imp = tl.where(offs_c[None, :] == own, float("inf"), tl.where(offs_c[None, :] > own, float("-inf"), imp))
        tl.store(S_ROWS + offs_c[None, :], imp, mask=tok_ok & (offs_c[None, :] < num_blocks))
    for c0 in tl.range(c_rest, num_blocks, BLOCK_C, num_stages=1):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        tl.store(S_ROWS + offs_c[None, :], tl.full([TOKENS, BLOCK_C], float("-inf"), tl.float32),
                 mask=tok_ok & (offs_c[None, :] < num_blocks))


@triton.jit
def group_sum(p, TOKENS: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """[TOKENS, BLOCK_C] the sums over each token's GROUP_PAD rows of p [TOKENS * GROUP_PAD, BLOCK_C]."""
    return tl.reduce(tl.reshape(p, [TOKENS, GROUP_PAD, BLOCK_C]), 1, tl.standard._sum_combine)


@triton.jit
def top_entries(SCORES, rows64, row_ok, num_blocks, COUNT: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
                WIDTH: tl.constexpr):
    """[ROWS, BLOCK_SLOTS] the indices of the COUNT largest of the rows' first WIDTH scores, by decreasing
    score, ties to the lower index, -1 once only -inf entries are left.  COUNT rounds of (max, lowest
    index holding it, take it out) over the row held in registers: COUNT is small (16 in the paper)
    next to a sort of every row."""
    offs_c = tl.arange(0, WIDTH)
    offs_s = tl.arange(0, BLOCK_SLOTS)
    s = tl.load(SCORES + rows64[:, None] * num_blocks + offs_c[None, :],
                mask=row_ok[:, None] & (offs_c[None, :] < num_blocks), other=float("-inf"))
    chosen = tl.full([rows64.shape[0], BLOCK_SLOTS], -1, tl.int32)
    for slot in tl.range(0, COUNT):
        best = reduce_max(s, 1)
        first = tl.reduce(tl.where(s == best[:, None], offs_c[None, :], WIDTH), 1, tl.standard._elementwise_min)
        chosen = tl.where(offs_s[None, :] == slot, tl.where(best == float("-inf"), -1, first)[:, None], chosen)
        s = tl.where(offs_c[None, :] == first[:, None], float("-inf"), s)
    return chosen


@triton.jit(do_not_specialize=["rows", "num_blocks", "seqlen", "heads_kv"])
def nsa_topk_kernel(
    SCORES, rows, num_blocks, seqlen, heads_kv, INDICES,
    COUNT: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_NB: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, CAUSAL_ROWS: tl.constexpr,
):
    """Per row of SCORES (rows, num_blocks) fp32: the indices of its COUNT largest entries, by
    decreasing score, ties to the lower index, -1 once only -inf entries are left; INDICES
    (rows, COUNT) int32 (top_entries).  The importance scores are +inf for the own block and -inf
    past it, so the own block comes first and no block after it is chosen.  CAUSAL_ROWS: the rows are
    the importance scores' (B, seqlen, heads_kv) and each is -inf past its token's own block
    (t // BLOCK_SIZE), so a program reads only its rows' widest prefix, a half, quarter or eighth of
    BLOCK_NB where that covers it: the same indices for a third less work over a causal sequence."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_s = tl.arange(0, BLOCK_SLOTS)
    row_ok = offs_r < rows
    rows64 = offs_r.to(tl.int64)
    if CAUSAL_ROWS and BLOCK_NB >= 128:
        width = reduce_max(tl.where(row_ok, (offs_r // heads_kv) % seqlen // BLOCK_SIZE + 1, 0), 0)
        if width <= BLOCK_NB // 8:
            chosen = top_entries(SCORES, rows64, row_ok, num_blocks, COUNT, BLOCK_SLOTS, BLOCK_NB // 8)
        elif width <= BLOCK_NB // 4:
            chosen = top_entries(SCORES, rows64, row_ok, num_blocks, COUNT, BLOCK_SLOTS, BLOCK_NB // 4)
        elif width <= BLOCK_NB // 2:
            chosen = top_entries(SCORES, rows64, row_ok, num_blocks, COUNT, BLOCK_SLOTS, BLOCK_NB // 2)
        else:
            chosen = top_entries(SCORES, rows64, row_ok, num_blocks, COUNT, BLOCK_SLOTS, BLOCK_NB)
    else:
        chosen = top_entries(SCORES, rows64, row_ok, num_blocks, COUNT, BLOCK_SLOTS, BLOCK_NB)
    tl.store(INDICES + rows64[:, None] * COUNT + offs_s[None, :], chosen,
             mask=row_ok[:, None] & (offs_s[None, :] < COUNT))
