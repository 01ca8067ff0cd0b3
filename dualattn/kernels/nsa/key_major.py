"""NSA selected branch, key-major: key block outer, the queries that selected it gathered inner (the FSA
paper's loop), for the forward and the dQ pass of groups with fewer query heads than a tensor-core tile
has rows (plan.key_major says when).

The query-major programs (selected.nsa_fwd_kernel, nsa_bwd_dq_kernel) read each token's S selected K/V
blocks: the same B * T * Hkv * S blocks of BLOCK_SIZE * (D + Dv) elements whatever the group size, so a
small group pays the bytes of a large one for a fraction of its work (docs/lessons.md, "NSA's selected
branch for small groups: key-major").  Here each (KV group, key block) is read
once per chunk of the tokens that selected it, and the bytes that move are per selection entry: the
entry's GROUP query rows in, its GROUP partial result rows out, and those back in for their sum.

Forward, three launches and a sort:
* nsa_selection_keys_kernel: each selection entry's bucket (KV group, key block) + 1, 0 for an entry
  that does not count (selection_tile's rule; the query-major dQ pass writes the same keys).
* The front ends sort those keys into the inverted index (inverted_index in each, as for the dK / dV
  pass) and cut each bucket's list into chunks.
* nsa_fwd_partial_kernel: one program per chunk holds the block's K, V and walks its entries, TOKENS
  at a time with all GROUP heads of each as rows:

      rows  e0:h0 .. e0:hG-1 [pad] | e1:h0 .. | ...      (e = list entry, TOKENS * GROUP_PAD rows)

  and writes each row's attention over the block alone: the normalised partial output (inputs'
  dtype) and its lse (fp32, log2 units), at the entry's place: PART_O (entries, GROUP, Dv),
  PART_LSE (entries, GROUP), entries numbered as block_indices' elements.
* nsa_fwd_merge_kernel: per token and KV group, the lse-weighted sum of its entries' partials in
  slot order (an entry that does not count, or names a block an earlier slot named, left out),
  written as O and the lse (natural log), as the query-major kernel writes them.

dQ pass: nsa_bwd_delta_kernel (delta = rowsum(O * dO)) and the selection keys, the sort (shared with
the dK / dV pass that follows), nsa_bwd_dq_partial_kernel (the same walk: each entry's dS K over its
block, in the inputs' dtype) and nsa_bwd_dq_sum_kernel (per token, its entries' partials in slot order,
in fp32, times the scale).

Partials in the inputs' dtype: each is rounded once before a sum of at most S in fp32, as the
output itself is rounded once; the scratch is entries * GROUP * (Dv + D) elements
(plan.key_major_scratch_bytes), 4.3 GB for the forward's at T = 64k, Hkv = 4, group 4, S = 16,
D = 128 in bf16.  No atomics and a fixed order: the same bits on every run.
"""
import triton
import triton.language as tl

from ..flash.rules import LN2, LOG2E, aligned, load_tile, reduce_max, reduce_sum
from .selected import (entry_token, gradient_rows, group_rows, head_base, kv_group, lse_offsets, probs_and_score_grads,
                       program_rows, selection_keys, selection_tile, softmax_step)

KEYS_INTS = ["stride_ib", "stride_is", "stride_ih", "stride_cb", "stride_cs", "stride_ch", "seqlen", "total",
             "num_heads_kv", "block_count"]
PARTIAL_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                "stride_vs", "stride_vh", "seqlen", "total", "num_heads_kv", "kv_groups", "chunk_entries"]
DQ_PARTIAL_INTS = PARTIAL_INTS[:9] + ["stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh"] + \
    PARTIAL_INTS[9:]
MERGE_INTS = KEYS_INTS[:6] + ["stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh"] + \
    KEYS_INTS[6:]
DQ_SUM_INTS = KEYS_INTS[:6] + ["stride_qb", "stride_qs", "stride_qh"] + KEYS_INTS[6:]
DELTA_INTS = ["stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh", "seqlen", "total",
              "num_heads_kv"]


@triton.jit(do_not_specialize=KEYS_INTS)
def nsa_selection_keys_kernel(
    BLOCK_INDICES, BLOCK_COUNTS, CU_SEQLENS,
    stride_ib, stride_is, stride_ih, stride_cb, stride_cs, stride_ch,
    seqlen, total, num_heads_kv, block_count,
    SELECTION_KEYS,
    TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # Grid (cdiv(seqlen, TOKENS), KV groups); SELECTION_KEYS has block_indices' strides.
    b, h_kv, start, seq_len = kv_group(tl.program_id(1), CU_SEQLENS, seqlen, total, num_heads_kv, IS_VARLEN)
    t_rows = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    IDX_HEAD = head_base(BLOCK_INDICES, b, start, h_kv, stride_ib, stride_is, stride_ih)
    COUNT_HEAD = head_base(BLOCK_COUNTS, b, start, h_kv, stride_cb, stride_cs, stride_ch)
    selected = selection_tile(IDX_HEAD, COUNT_HEAD, t_rows, seq_len, stride_is, stride_cs, block_count,
                              NUM_SLOTS, BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS)
    offs_s = tl.arange(0, BLOCK_SLOTS)
    KEYS_HEAD = head_base(SELECTION_KEYS, b, start, h_kv, stride_ib, stride_is, stride_ih)
    tl.store(KEYS_HEAD + t_rows[:, None] * stride_is + offs_s[None, :],
             selection_keys(selected, tl.program_id(1), tl.num_programs(1)),
             mask=(t_rows < seq_len)[:, None] & (offs_s[None, :] < NUM_SLOTS))


@triton.jit
def chunk_bucket(CHUNK_BUCKETS, CU_SEQLENS, seqlen, total, num_heads_kv, kv_groups, BLOCK_SIZE: tl.constexpr,
                 IS_VARLEN: tl.constexpr):
    """(bucket, batch index in memory, KV head, sequence start, length, block's first key) of the chunk of
    program axis 0 = chunk.  Past the last chunk the bucket is the bucket count, whose block lies past
    every sequence's end: no key (and no list: BUCKET_STARTS is not read for it)."""
    bucket_id = tl.load(CHUNK_BUCKETS + tl.program_id(0))
    b, h_kv, start, seq_len = kv_group(bucket_id % kv_groups, CU_SEQLENS, seqlen, total, num_heads_kv, IS_VARLEN)
    return bucket_id, b, h_kv, start, seq_len, (bucket_id // kv_groups) * BLOCK_SIZE


@triton.jit
def chunk_span(BUCKET_STARTS, CHUNK_STARTS, bucket_id, chunk_entries):
    """[first, last): the list entries of this program's chunk (as selected.nsa_bwd_dkv_kernel's)."""
    first = tl.load(BUCKET_STARTS + bucket_id) + (tl.program_id(0) - tl.load(CHUNK_STARTS + bucket_id)) * chunk_entries
    return first, tl.minimum(first + chunk_entries, tl.load(BUCKET_STARTS + bucket_id + 1))


@triton.jit
def chunk_rows(ENTRY_ORDER, step, last, h_kv, start, seqlen, total, num_heads_kv, TOKENS: tl.constexpr,
               GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, NUM_SLOTS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(entry, token, query head, head in group, valid) of the rows of list entries step .. step + TOKENS - 1."""
    offs_r = tl.arange(0, TOKENS * GROUP_PAD)
    e = step + offs_r // GROUP_PAD
    listed = e < last
    entry = tl.load(ENTRY_ORDER + e, mask=listed, other=0)
    t_rows = entry_token(entry, num_heads_kv * NUM_SLOTS, total if IS_VARLEN else seqlen, start)
    g_rows = offs_r % GROUP_PAD
    return entry, t_rows, h_kv * GROUP + g_rows, g_rows, listed & (g_rows < GROUP)


@triton.jit(do_not_specialize=PARTIAL_INTS)
def nsa_fwd_partial_kernel(
    Q, K, V, ENTRY_ORDER, BUCKET_STARTS, CHUNK_BUCKETS, CHUNK_STARTS, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    seqlen, total, num_heads_kv, kv_groups, chunk_entries, sm_scale,
    PART_O, PART_LSE,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    # Grid (max_chunks,): chunk p walks entries [first, last) of its bucket's list (chunk_span).
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    bucket_id, b, h_kv, start, seq_len, block_start = chunk_bucket(CHUNK_BUCKETS, CU_SEQLENS, seqlen, total,
                                                                   num_heads_kv, kv_groups, BLOCK_SIZE, IS_VARLEN)
    if block_start < seq_len:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        K_HEAD = head_base(K, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        V_HEAD = head_base(V, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        if BLOCK_N == BLOCK_SIZE:   # the whole block stays in registers for the walk
            k, v = block_tile(K_HEAD, V_HEAD, block_start, seq_len, stride_ks, stride_vs, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                              BLOCK_DV, BLOCK_N)
        first, last = chunk_span(BUCKET_STARTS, CHUNK_STARTS, bucket_id, chunk_entries)
        qk_scale = sm_scale * LOG2E
        for step in tl.range(first, last, TOKENS):
            entry, t_rows, h_rows, g_rows, row_ok = chunk_rows(ENTRY_ORDER, step, last, h_kv, start, seqlen, total,
                                                               num_heads_kv, TOKENS, GROUP, GROUP_PAD, NUM_SLOTS,
                                                               IS_VARLEN)
            q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM,
                                        BLOCK_D)
            q = tl.load(Q + q_offs, mask=q_mask, other=0.0)  # [TOKENS * GROUP_PAD, BLOCK_D]
            m_i = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
            l_i = tl.full([TOKENS * GROUP_PAD], 0.0, tl.float32)
            acc = tl.full([TOKENS * GROUP_PAD, BLOCK_DV], 0.0, tl.float32)
            for sub in tl.range(0, BLOCK_SIZE, BLOCK_N):
                if BLOCK_N < BLOCK_SIZE:
                    k, v = block_tile(K_HEAD, V_HEAD, block_start + sub, seq_len, stride_ks, stride_vs, HEAD_DIM,
                                      HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N)
                ok = (block_start + sub + tl.arange(0, BLOCK_N))[None, :] <= t_rows[:, None]
                m_i, l_i, acc = softmax_step(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION)
            # Every listed row sees its block's first key (the block is at or before its own), so l > 0.
            l_safe = tl.where(l_i > 0.0, l_i, 1.0)
            part = entry.to(tl.int64) * GROUP + g_rows   # [rows]
            tl.store(PART_O + part[:, None] * HEAD_DIM_V + offs_dv[None, :],
                     (acc / l_safe[:, None]).to(PART_O.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
            tl.store(PART_LSE + part, m_i + tl.log2(l_safe), mask=row_ok)


@triton.jit
def block_tile(K_HEAD, V_HEAD, first_key, seq_len, stride_ks, stride_vs, HEAD_DIM: tl.constexpr,
               HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """K [BLOCK_N, BLOCK_D] and V [BLOCK_N, BLOCK_DV] of keys first_key .. first_key + BLOCK_N - 1."""
    offs_n = first_key + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = load_tile(K_HEAD + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_len, offs_d, HEAD_DIM, True,
                  BLOCK_D != HEAD_DIM)
    v = load_tile(V_HEAD + offs_n[:, None] * stride_vs + offs_dv[None, :], offs_n, seq_len, offs_dv, HEAD_DIM_V,
                  True, BLOCK_DV != HEAD_DIM_V)
    return k, v


@triton.jit(do_not_specialize=DQ_PARTIAL_INTS)
def nsa_bwd_dq_partial_kernel(
    Q, K, V, DOUT, LSE, DELTA, ENTRY_ORDER, BUCKET_STARTS, CHUNK_BUCKETS, CHUNK_STARTS, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv, kv_groups, chunk_entries, sm_scale,
    PART_DQ,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    # The dQ pass key-major, as nsa_fwd_partial_kernel's walk: each entry's rows get dS K over the block
    # alone (unscaled), PART_DQ (entries, GROUP, D); nsa_bwd_dq_sum_kernel sums them per token.  DOUT has
    # O's strides, DELTA the lse's.
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    bucket_id, b, h_kv, start, seq_len, block_start = chunk_bucket(CHUNK_BUCKETS, CU_SEQLENS, seqlen, total,
                                                                   num_heads_kv, kv_groups, BLOCK_SIZE, IS_VARLEN)
    if block_start < seq_len:
        offs_d = tl.arange(0, BLOCK_D)
        K_HEAD = head_base(K, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        V_HEAD = head_base(V, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        if BLOCK_N == BLOCK_SIZE:
            k, v = block_tile(K_HEAD, V_HEAD, block_start, seq_len, stride_ks, stride_vs, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                              BLOCK_DV, BLOCK_N)
        first, last = chunk_span(BUCKET_STARTS, CHUNK_STARTS, bucket_id, chunk_entries)
        qk_scale = sm_scale * LOG2E
        for step in tl.range(first, last, TOKENS):
            entry, t_rows, h_rows, g_rows, row_ok = chunk_rows(ENTRY_ORDER, step, last, h_kv, start, seqlen, total,
                                                               num_heads_kv, TOKENS, GROUP, GROUP_PAD, NUM_SLOTS,
                                                               IS_VARLEN)
            q, do, lse2, delta = gradient_rows(Q, DOUT, LSE, DELTA, b, start, t_rows, h_rows, row_ok, stride_qb,
                                               stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb,
                                               stride_ls, stride_lh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
            dq = tl.full([TOKENS * GROUP_PAD, BLOCK_D], 0.0, tl.float32)
            for sub in tl.range(0, BLOCK_SIZE, BLOCK_N):
                if BLOCK_N < BLOCK_SIZE:
                    k, v = block_tile(K_HEAD, V_HEAD, block_start + sub, seq_len, stride_ks, stride_vs, HEAD_DIM,
                                      HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N)
                ok = row_ok[:, None] & ((block_start + sub + tl.arange(0, BLOCK_N))[None, :] <= t_rows[:, None])
                p, ds = probs_and_score_grads(q, k, v, do, lse2, delta, ok, qk_scale, False, DOT_PRECISION)
                dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
            part = entry.to(tl.int64) * GROUP + g_rows
            tl.store(PART_DQ + part[:, None] * HEAD_DIM + offs_d[None, :], dq.to(PART_DQ.dtype.element_ty),
                     mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def token_entries(BLOCK_INDICES, BLOCK_COUNTS, b, start, seq_len, h_kv, t_rows, h_rows, row_ok, stride_ib, stride_is,
                  stride_ih, stride_cb, stride_cs, stride_ch, seqlen, total, num_heads_kv, block_count,
                  GROUP: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(selection tile, entry number of each row token's slot 0, head in group) of a merge or sum
    program's rows.  Entries are numbered as block_indices' elements, ((b * rows + row) * Hkv + h_kv) * S
    + slot."""
    IDX_HEAD = head_base(BLOCK_INDICES, b, start, h_kv, stride_ib, stride_is, stride_ih)
    COUNT_HEAD = head_base(BLOCK_COUNTS, b, start, h_kv, stride_cb, stride_cs, stride_ch)
    selected = selection_tile(IDX_HEAD, COUNT_HEAD, t_rows, seq_len, stride_is, stride_cs, block_count, NUM_SLOTS,
                              BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS)
    rows_in_memory = total if IS_VARLEN else seqlen
    entry0 = ((b * rows_in_memory + start + tl.where(row_ok, t_rows, 0)) * num_heads_kv + h_kv) * NUM_SLOTS
    return selected, entry0, h_rows - h_kv * GROUP


@triton.jit
def slot_part(selected, slot, row_ok, entry0, g_rows, GROUP: tl.constexpr):
    """(use, part) of selection slot `slot` for each row: whether its entry counts and names no block an
    earlier slot named (a duplicate counts once), and the row of the entry's partial results."""
    offs_s = tl.arange(0, selected.shape[1])
    block = reduce_max(tl.where(offs_s[None, :] == slot, selected, -1), 1)   # [rows], -1: does not count
    named_before = reduce_max(tl.where((offs_s[None, :] < slot) & (selected == block[:, None]), 1, 0), 1) > 0
    return row_ok & (block >= 0) & (named_before == 0), (entry0 + slot) * GROUP + g_rows


@triton.jit(do_not_specialize=MERGE_INTS)
def nsa_fwd_merge_kernel(
    BLOCK_INDICES, BLOCK_COUNTS, CU_SEQLENS, PART_O, PART_LSE,
    stride_ib, stride_is, stride_ih, stride_cb, stride_cs, stride_ch,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv, block_count,
    O, LSE,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    # Grid (cdiv(seqlen, TOKENS), KV groups), rows as the query-major forward's (program_rows).
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if t0 < seq_len:
        selected, entry0, g_rows = token_entries(
            BLOCK_INDICES, BLOCK_COUNTS, b, start, seq_len, h_kv, t_rows, h_rows, row_ok, stride_ib, stride_is,
            stride_ih, stride_cb, stride_cs, stride_ch, seqlen, total, num_heads_kv, block_count, GROUP, NUM_SLOTS,
            BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS, IS_VARLEN)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_i = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.full([TOKENS * GROUP_PAD], 0.0, tl.float32)
        acc = tl.full([TOKENS * GROUP_PAD, BLOCK_DV], 0.0, tl.float32)
        for slot in tl.range(0, NUM_SLOTS):
            use, part = slot_part(selected, slot, row_ok, entry0, g_rows, GROUP)
            lse_part = tl.load(PART_LSE + part, mask=use, other=float("-inf"))
            o_part = tl.load(PART_O + part[:, None] * HEAD_DIM_V + offs_dv[None, :],
                             mask=use[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0).to(tl.float32)
            m_new = tl.maximum(m_i, lse_part)
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            weight = tl.exp2(lse_part - m_shift)
            l_i = l_i * alpha + weight
            acc = acc * alpha[:, None] + o_part * weight[:, None]
            m_i = m_new
        # A token with nothing selected (or a padding row) gives 0 and lse -inf, as the query-major kernel.
        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        o_offs, o_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_ob, stride_os, stride_oh, HEAD_DIM_V,
                                    BLOCK_DV)
        tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=o_mask)
        tl.store(LSE + lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh), lse, mask=row_ok)


@triton.jit(do_not_specialize=DQ_SUM_INTS)
def nsa_bwd_dq_sum_kernel(
    BLOCK_INDICES, BLOCK_COUNTS, CU_SEQLENS, PART_DQ,
    stride_ib, stride_is, stride_ih, stride_cb, stride_cs, stride_ch, stride_qb, stride_qs, stride_qh,
    seqlen, total, num_heads_kv, block_count, sm_scale,
    DQ,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    # Grid (cdiv(seqlen, TOKENS), KV groups): dQ = sm_scale * the sum of each token's partial dQ in slot
    # order (the merge's entries: slot_part), in fp32.
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if t0 < seq_len:
        selected, entry0, g_rows = token_entries(
            BLOCK_INDICES, BLOCK_COUNTS, b, start, seq_len, h_kv, t_rows, h_rows, row_ok, stride_ib, stride_is,
            stride_ih, stride_cb, stride_cs, stride_ch, seqlen, total, num_heads_kv, block_count, GROUP, NUM_SLOTS,
            BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS, IS_VARLEN)
        offs_d = tl.arange(0, BLOCK_D)
        dq = tl.full([TOKENS * GROUP_PAD, BLOCK_D], 0.0, tl.float32)
        for slot in tl.range(0, NUM_SLOTS):
            use, part = slot_part(selected, slot, row_ok, entry0, g_rows, GROUP)
            dq += tl.load(PART_DQ + part[:, None] * HEAD_DIM + offs_d[None, :],
                          mask=use[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0).to(tl.float32)
        q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM,
                                    BLOCK_D)
        tl.store(DQ + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


@triton.jit(do_not_specialize=DELTA_INTS)
def nsa_bwd_delta_kernel(
    OUT, DOUT, CU_SEQLENS,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv,
    DELTA,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr, IS_VARLEN: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    # Grid (cdiv(seqlen, TOKENS), KV groups): delta = rowsum(O * dO) (the lse's strides; DOUT has O's),
    # which the query-major dQ pass computes itself.
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if t0 < seq_len:
        o_offs, o_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_ob, stride_os, stride_oh, HEAD_DIM_V,
                                    BLOCK_DV)
        o = tl.load(OUT + o_offs, mask=o_mask, other=0.0).to(tl.float32)
        do = tl.load(DOUT + o_offs, mask=o_mask, other=0.0).to(tl.float32)
        tl.store(DELTA + lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh), reduce_sum(o * do, 1),
                 mask=row_ok)
