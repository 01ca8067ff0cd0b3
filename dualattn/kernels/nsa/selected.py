"""NSA selected branch: attention over per-token lists of key blocks, forward and backward.

Token t of KV head h_kv attends key j iff j <= t and j's block (j // BLOCK_SIZE) is one of its
valid selections: entries s < count[t], >= 0 and <= t // BLOCK_SIZE of BLOCK_INDICES[b, t, h_kv, :]
(duplicates count once).  All query heads of a KV group share the selection.

Grid: (cdiv(max seqlen, TOKENS), batch * Hkv).  A program owns TOKENS consecutive tokens of one
KV group and all GROUP query heads of each, as BLOCK_M = TOKENS * GROUP_PAD rows
(row r = token r // GROUP_PAD, head r % GROUP_PAD; padding heads are masked):

    rows  t0:h0 t0:h1 .. t0:hG-1 [pad] | t1:h0 .. | ...      (TOKENS * GROUP_PAD >= 16)

so a selected K/V block is loaded once for the whole group, and for groups under 16 heads (the
tensor-core minimum) the rows are filled with more tokens instead of idle padding.  The program
walks the union of its tokens' selections: each distinct block once (the first entry that names
it), every row masked to the tokens that selected it (plan.py picks TOKENS).  With SCAN_BLOCKS
(short sequences, where a token has fewer blocks to its left than the program has entries) it
walks the blocks up to its last token's own block instead and skips those no row selected.

Backward, two passes and no atomics (plan.py says why):
* dQ (nsa_bwd_dq_kernel): the forward's programs and loop, dQ finished in registers; it also
  writes delta = rowsum(O * dO) and each selection entry's bucket (KV group, key block).
* dK / dV (nsa_bwd_dkv_kernel): key-major, one program per chunk of the tokens that selected a
  key block (in increasing order: the inverse of the selection, which the front ends build
  between the passes by a stable sort of the buckets), its fp32 partial dK, dV to a scratch slot
  of its own; then nsa_bwd_dkv_reduce_kernel sums each block's slots in order.  Each dK / dV row
  is written once, so the gradients are the same bits on every run.
Scores live in log2 units inside the kernels; the lse is stored in natural log, (B, T, Hq) fp32.
"""
import triton
import triton.language as tl

from ..flash.rules import LN2, LOG2E, aligned, load_tile, reduce_max, reduce_sum, sequence_bounds

NSA_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
            "stride_vh", "stride_ib", "stride_is", "stride_ih", "stride_cb", "stride_cs", "stride_ch",
            "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh", "seqlen", "total",
            "num_heads_kv", "block_count"]


@triton.jit
def kv_group(pid_bh, CU_SEQLENS, seqlen, total, num_heads_kv, IS_VARLEN: tl.constexpr):
    """(batch index in memory, KV head, sequence start, length) of KV group `pid_bh` = batch (varlen:
    sequence) * Hkv + KV head."""
    b = pid_bh // num_heads_kv
    h_kv = pid_bh % num_heads_kv
    start, _, seq_len, _ = sequence_bounds(b, CU_SEQLENS, CU_SEQLENS, seqlen, seqlen, total, total, IS_VARLEN)
    if IS_VARLEN:
        b = 0
    # (tl.cast: without varlen, b and start are constants here.)
    return tl.cast(b, tl.int64), h_kv, tl.cast(start, tl.int64), seq_len


@triton.jit
def program_rows(CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS: tl.constexpr, GROUP: tl.constexpr,
                 GROUP_PAD: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(batch index in memory, KV head, sequence start, length, first token, row tokens, row heads,
    row valid) of this program.  Row tokens are positions inside the sequence; heads are query heads."""
    b, h_kv, start, seq_len = kv_group(tl.program_id(1), CU_SEQLENS, seqlen, total, num_heads_kv, IS_VARLEN)
    t0 = tl.program_id(0) * TOKENS
    offs_r = tl.arange(0, TOKENS * GROUP_PAD)
    t_rows = t0 + offs_r // GROUP_PAD
    g_rows = offs_r % GROUP_PAD
    row_ok = (g_rows < GROUP) & (t_rows < seq_len)
    return b, h_kv, start, seq_len, t0, t_rows, h_kv * GROUP + g_rows, row_ok


@triton.jit
def head_base(BASE, b, start, h, stride_b, stride_s, stride_h):
    """Where head h of batch b's sequence (starting at row `start`) begins."""
    return BASE + b * stride_b + start * stride_s + h * stride_h


@triton.jit
def group_rows(b, start, t_rows, h_rows, row_ok, stride_b, stride_s, stride_h, N_COLS: tl.constexpr,
               BLOCK_COLS: tl.constexpr):
    """(element offsets, mask) of the program's [BLOCK_M, BLOCK_COLS] rows (token t_rows, head h_rows)."""
    offs_c = tl.arange(0, BLOCK_COLS)
    rows = b * stride_b + (start + t_rows) * stride_s + h_rows * stride_h
    return rows[:, None] + offs_c[None, :], row_ok[:, None] & (offs_c[None, :] < N_COLS)


@triton.jit
def selection_tile(IDX_HEAD, COUNT_HEAD, t_rows, seq_len, stride_is, stride_cs, block_count,
                   NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   PER_TOKEN_COUNTS: tl.constexpr):
    """[BLOCK_M, BLOCK_SLOTS] the selected blocks of each row's token, -1 where an entry does not
    count (past the count, negative, after the token's own block, or a token past the end)."""
    offs_s = tl.arange(0, BLOCK_SLOTS)
    in_seq = t_rows < seq_len
    t_safe = tl.where(in_seq, t_rows, 0)
    idx = tl.load(IDX_HEAD + t_safe[:, None] * stride_is + offs_s[None, :],
                  mask=in_seq[:, None] & (offs_s[None, :] < NUM_SLOTS), other=-1)
    if PER_TOKEN_COUNTS:
        count = tl.load(COUNT_HEAD + t_safe * stride_cs, mask=in_seq, other=0)
    else:
        count = tl.where(in_seq, block_count, 0)
    ok = (offs_s[None, :] < count[:, None]) & (idx >= 0) & (idx <= (t_safe // BLOCK_SIZE)[:, None])
    return tl.where(ok, idx, -1)


@triton.jit
def selection_steps(t0, seq_len, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    SCAN_BLOCKS: tl.constexpr):
    """How many steps the program's loop takes: one per selection entry of its tokens, or with
    SCAN_BLOCKS one per key block up to its last token's own block (plan.scan_blocks)."""
    if SCAN_BLOCKS:
        return (tl.minimum(t0 + TOKENS, seq_len) - 1) // BLOCK_SIZE + 1
    else:
        return TOKENS * NUM_SLOTS


@triton.jit
def selection_step(step, IDX_HEAD, COUNT_HEAD, selected, t0, seq_len, stride_is, stride_cs, block_count,
                   NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, PER_TOKEN_COUNTS: tl.constexpr, SCAN_BLOCKS: tl.constexpr):
    """(block, visit, row_selected) of loop step `step`: row_selected [BLOCK_M] marks the rows whose
    token selected `block`, and `visit` says whether the program computes it at this step.

    SCAN_BLOCKS: step = block, visited iff some row selected it.  Otherwise step = entry (token
    t0 + step // NUM_SLOTS, slot step % NUM_SLOTS) of the program's selections, visited iff it
    counts and no earlier entry of the program names the same block: each distinct block once.
    """
    if SCAN_BLOCKS:
        block = step
        row_selected = tl.reduce(tl.where(selected == block, 1, 0), 1, tl.standard._elementwise_max) > 0
        visit = tl.reduce(row_selected.to(tl.int32), 0, tl.standard._elementwise_max) > 0
    else:
        i = step // NUM_SLOTS
        slot = step % NUM_SLOTS
        t = t0 + i
        in_seq = t < seq_len
        t_safe = tl.where(in_seq, t, 0)
        block = tl.load(IDX_HEAD + t_safe * stride_is + slot)
        if PER_TOKEN_COUNTS:
            count = tl.load(COUNT_HEAD + t_safe * stride_cs)
        else:
            count = block_count
        counts = in_seq & (slot < count) & (block >= 0) & (block <= t_safe // BLOCK_SIZE)
        offs_r = tl.arange(0, selected.shape[0])
        offs_s = tl.arange(0, BLOCK_SLOTS)
        tok_r = (offs_r // GROUP_PAD)[:, None]
        earlier = (tok_r < i) | ((tok_r == i) & (offs_s[None, :] < slot))   # [BLOCK_M, BLOCK_SLOTS]
        hit = selected == block
        seen = tl.reduce(tl.where(hit & earlier, 1, 0), None, tl.standard._elementwise_max)
        row_selected = tl.reduce(tl.where(hit, 1, 0), 1, tl.standard._elementwise_max) > 0
        visit = counts & (seen == 0)
    return block, visit, row_selected


@triton.jit
def softmax_step(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax (log2 units): scores where `ok`, the running row maximum m_i,
    sum l_i and unnormalised output acc updated.  A row with nothing visible yet keeps m = -inf."""
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, keys]
    s = tl.where(ok, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, reduce_max(s, 1))
    # Shift by 0 where the maximum is still -inf, to avoid inf - inf.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + reduce_sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=NSA_INTS)
def nsa_fwd_kernel(
    Q, K, V, BLOCK_INDICES, BLOCK_COUNTS, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_cb, stride_cs, stride_ch,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv, block_count, sm_scale,
    O, LSE,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if t0 < seq_len:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM,
                                    BLOCK_D)
        q = tl.load(Q + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        K_HEAD = head_base(K, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        V_HEAD = head_base(V, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        IDX_HEAD = head_base(BLOCK_INDICES, b, start, h_kv, stride_ib, stride_is, stride_ih)
        COUNT_HEAD = head_base(BLOCK_COUNTS, b, start, h_kv, stride_cb, stride_cs, stride_ch)
        selected = selection_tile(IDX_HEAD, COUNT_HEAD, t_rows, seq_len, stride_is, stride_cs, block_count,
                                  NUM_SLOTS, BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS)
        qk_scale = sm_scale * LOG2E
        m_i = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.full([TOKENS * GROUP_PAD], 0.0, tl.float32)
        acc = tl.full([TOKENS * GROUP_PAD, BLOCK_DV], 0.0, tl.float32)
        for step in tl.range(0, selection_steps(t0, seq_len, TOKENS, NUM_SLOTS, BLOCK_SIZE, SCAN_BLOCKS)):
            block, visit, row_selected = selection_step(step, IDX_HEAD, COUNT_HEAD, selected, t0, seq_len,
                                                        stride_is, stride_cs, block_count, NUM_SLOTS, BLOCK_SLOTS,
                                                        GROUP_PAD, BLOCK_SIZE, PER_TOKEN_COUNTS, SCAN_BLOCKS)
            if visit:
                for sub in tl.range(0, BLOCK_SIZE, BLOCK_N):
                    offs_n = block * BLOCK_SIZE + sub + tl.arange(0, BLOCK_N)
                    k = load_tile(K_HEAD + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_len, offs_d,
                                  HEAD_DIM, True, BLOCK_D != HEAD_DIM)  # [BLOCK_N, BLOCK_D]
                    v = load_tile(V_HEAD + offs_n[:, None] * stride_vs + offs_dv[None, :], offs_n, seq_len, offs_dv,
                                  HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)  # [BLOCK_N, BLOCK_DV]
                    ok = row_selected[:, None] & (offs_n[None, :] <= t_rows[:, None])
                    m_i, l_i, acc = softmax_step(q, k, v, ok, m_i, l_i, acc, qk_scale, DOT_PRECISION)
        # A row that selected nothing (or a padding row) gives 0 and lse -inf, never NaN.
        seen = l_i > 0.0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
        o_offs, o_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_ob, stride_os, stride_oh, HEAD_DIM_V,
                                    BLOCK_DV)
        tl.store(O + o_offs, out.to(O.dtype.element_ty), mask=o_mask)
        tl.store(LSE + lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh), lse, mask=row_ok)


@triton.jit
def lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh):
    """Element offsets of the rows' lse (and delta, which shares its strides)."""
    return b * stride_lb + (start + t_rows) * stride_ls + h_rows * stride_lh


@triton.jit
def bucket(pid_bh, block, kv_groups):
    """The inverted index's list of key block `block` of KV group pid_bh, block-major (plan.num_buckets):
    the chunk table, in bucket order, lists the blocks most tokens select first."""
    return block * kv_groups + pid_bh


@triton.jit
def selection_keys(selected, kv_group_id, kv_groups):
    """Bucket keys of a selection tile (selection_tile): bucket + 1, or 0 where an entry does not count."""
    return tl.where(selected >= 0, bucket(kv_group_id, selected, kv_groups) + 1, 0)


@triton.jit
def bucket_keys(bucket_id, kv_groups, CU_SEQLENS, seqlen, total, num_heads_kv, BLOCK_SIZE: tl.constexpr,
                BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(batch index in memory, KV head, sequence start, length, keys, whether any key is in the
    sequence) of the BLOCK_N keys of program axis 0 = bucket_id * SUBS + sub, sub-block `sub` of
    bucket_id's key block.  A bucket_id of the bucket count (the chunk table past its last chunk)
    names a block past every sequence's end: no key."""
    block = bucket_id // kv_groups
    b, h_kv, start, seq_len = kv_group(bucket_id % kv_groups, CU_SEQLENS, seqlen, total, num_heads_kv, IS_VARLEN)
    first = block * BLOCK_SIZE + (tl.program_id(0) % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N
    return b, h_kv, start, seq_len, first + tl.arange(0, BLOCK_N), first < seq_len


@triton.jit
def chunk_slot(CHUNKS, chunk, N_COLS: tl.constexpr, BLOCK_COLS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """(pointers, column mask) of this program's [BLOCK_N, BLOCK_COLS] rows of scratch slot `chunk`,
    a (BLOCK_SIZE, N_COLS) fp32 partial dK or dV of one chunk (program axis 0 = .. * SUBS + sub)."""
    rows = tl.cast(chunk, tl.int64) * BLOCK_SIZE + (tl.program_id(0) % (BLOCK_SIZE // BLOCK_N)) * BLOCK_N \
        + tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_COLS)
    return CHUNKS + rows[:, None] * N_COLS + offs_c[None, :], offs_c[None, :] < N_COLS


@triton.jit
def probs_and_score_grads(q, k, v, do, lse2, delta, ok, qk_scale, KEY_MAJOR: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    """The probabilities p, recomputed from the lse (log2 units), and the score gradient
    ds = p * (dO V^T - delta), both 0 where not `ok`: [rows, keys], or with KEY_MAJOR their
    transposes [keys, rows] (`ok` shaped alike), which are the dK / dV dots' left operands as they
    come out of the MMA (no transpose through shared memory)."""
    if KEY_MAJOR:
        qk = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        p = tl.where(ok, tl.exp2(qk * qk_scale - lse2[None, :]), 0.0)
        dp = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[None, :])
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        p = tl.where(ok, tl.exp2(qk * qk_scale - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
    return p, ds


@triton.jit
def log2_lse(LSE, offs, row_ok):
    """The rows' lse in log2 units; 0 for a row without keys (every p of it is masked)."""
    lse = tl.load(LSE + offs, mask=row_ok, other=float("-inf"))
    return tl.where(lse == float("-inf"), 0.0, lse * LOG2E)


@triton.jit(do_not_specialize=NSA_INTS)
def nsa_bwd_dq_kernel(
    Q, K, V, OUT, DOUT, LSE, BLOCK_INDICES, BLOCK_COUNTS, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ib, stride_is, stride_ih, stride_cb, stride_cs, stride_ch,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv, block_count, sm_scale,
    DQ, DELTA, SELECTION_KEYS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_SLOTS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PER_TOKEN_COUNTS: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SCAN_BLOCKS: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    # Query-major, over the forward's loop: dQ (Q's strides) is finished in registers.  It also
    # writes what the key-major dK / dV pass reads: delta = rowsum(O * dO) (the lse's strides) and
    # SELECTION_KEYS (the indices' strides), each entry's bucket KV group * blocks + block + 1, or 0
    # for an entry that does not count.  OUT and DOUT share O's strides.
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    b, h_kv, start, seq_len, t0, t_rows, h_rows, row_ok = program_rows(
        CU_SEQLENS, seqlen, total, num_heads_kv, TOKENS, GROUP, GROUP_PAD, IS_VARLEN)
    if t0 < seq_len:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM,
                                    BLOCK_D)
        q = tl.load(Q + q_offs, mask=q_mask, other=0.0)  # [BLOCK_M, BLOCK_D]
        o_offs, o_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_ob, stride_os, stride_oh,
                                    HEAD_DIM_V, BLOCK_DV)
        o = tl.load(OUT + o_offs, mask=o_mask, other=0.0)
        # (dO shares O's strides: the front ends pass it contiguous.)
        do = tl.load(DOUT + o_offs, mask=o_mask, other=0.0)  # [BLOCK_M, BLOCK_DV]
        delta = reduce_sum(o.to(tl.float32) * do.to(tl.float32), 1)  # [BLOCK_M]
        l_offs = lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh)
        tl.store(DELTA + l_offs, delta, mask=row_ok)
        lse2 = log2_lse(LSE, l_offs, row_ok)
        K_HEAD = head_base(K, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        V_HEAD = head_base(V, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        IDX_HEAD = head_base(BLOCK_INDICES, b, start, h_kv, stride_ib, stride_is, stride_ih)
        COUNT_HEAD = head_base(BLOCK_COUNTS, b, start, h_kv, stride_cb, stride_cs, stride_ch)
        selected = selection_tile(IDX_HEAD, COUNT_HEAD, t_rows, seq_len, stride_is, stride_cs, block_count,
                                  NUM_SLOTS, BLOCK_SLOTS, BLOCK_SIZE, PER_TOKEN_COUNTS)
        # One row per token (its group's first head) writes the token's bucket keys.
        offs_s = tl.arange(0, BLOCK_SLOTS)
        keys = selection_keys(selected, tl.program_id(1), tl.num_programs(1))
        key_rows = row_ok & (h_rows % GROUP == 0)
        KEYS_HEAD = head_base(SELECTION_KEYS, b, start, h_kv, stride_ib, stride_is, stride_ih)
        tl.store(KEYS_HEAD + t_rows[:, None] * stride_is + offs_s[None, :], keys,
                 mask=key_rows[:, None] & (offs_s[None, :] < NUM_SLOTS))
        qk_scale = sm_scale * LOG2E
        dq = tl.full([TOKENS * GROUP_PAD, BLOCK_D], 0.0, tl.float32)
        for step in tl.range(0, selection_steps(t0, seq_len, TOKENS, NUM_SLOTS, BLOCK_SIZE, SCAN_BLOCKS)):
            block, visit, row_selected = selection_step(step, IDX_HEAD, COUNT_HEAD, selected, t0, seq_len,
                                                        stride_is, stride_cs, block_count, NUM_SLOTS, BLOCK_SLOTS,
                                                        GROUP_PAD, BLOCK_SIZE, PER_TOKEN_COUNTS, SCAN_BLOCKS)
            if visit:
                for sub in tl.range(0, BLOCK_SIZE, BLOCK_N):
                    offs_n = block * BLOCK_SIZE + sub + tl.arange(0, BLOCK_N)
                    k = load_tile(K_HEAD + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_len, offs_d,
                                  HEAD_DIM, True, BLOCK_D != HEAD_DIM)  # [BLOCK_N, BLOCK_D]
                    v = load_tile(V_HEAD + offs_n[:, None] * stride_vs + offs_dv[None, :], offs_n, seq_len, offs_dv,
                                  HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V)  # [BLOCK_N, BLOCK_DV]
                    ok = row_selected[:, None] & (offs_n[None, :] <= t_rows[:, None]) & row_ok[:, None]
                    p, ds = probs_and_score_grads(q, k, v, do, lse2, delta, ok, qk_scale, False, DOT_PRECISION)
                    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
        tl.store(DQ + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=q_mask)


DKV_INTS = ["stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
            "stride_vh", "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh", "seqlen",
            "total", "num_heads_kv", "kv_groups", "chunk_entries"]
DKV_REDUCE_INTS = ["stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "seqlen", "total",
                   "num_heads_kv", "kv_groups"]


@triton.jit
def listed_tokens(ENTRY_ORDER, e, listed, entries_per_row, rows_in_memory, start):
    """Tokens (positions in their sequence) of inverted-index entries e: an entry is the flat index
    of a selection entry (batch, row, KV head, slot) in block_indices."""
    return entry_token(tl.load(ENTRY_ORDER + e, mask=listed, other=0), entries_per_row, rows_in_memory, start)


@triton.jit
def entry_token(entry, entries_per_row, rows_in_memory, start):
    """The token (position in its sequence) of selection entry number `entry` (block_indices' flat index)."""
    # (int32: row numbers are below the int32 entry numbers, plan.check_index_range.)
    return (entry // entries_per_row) % rows_in_memory - start.to(tl.int32)


@triton.jit
def gradient_rows(Q, DOUT, LSE, DELTA, b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, stride_ob,
                  stride_os, stride_oh, stride_lb, stride_ls, stride_lh, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """What a key-major backward step gathers for its rows (token t_rows, head h_rows): q [rows, BLOCK_D],
    dO [rows, BLOCK_DV] (O's strides), the lse in log2 units and delta (the lse's strides)."""
    q_offs, q_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_qb, stride_qs, stride_qh, HEAD_DIM, BLOCK_D)
    q = tl.load(Q + q_offs, mask=q_mask, other=0.0)
    do_offs, do_mask = group_rows(b, start, t_rows, h_rows, row_ok, stride_ob, stride_os, stride_oh, HEAD_DIM_V,
                                  BLOCK_DV)
    do = tl.load(DOUT + do_offs, mask=do_mask, other=0.0)
    l_offs = lse_offsets(b, start, t_rows, h_rows, stride_lb, stride_ls, stride_lh)
    return q, do, log2_lse(LSE, l_offs, row_ok), tl.load(DELTA + l_offs, mask=row_ok, other=0.0)


@triton.jit(do_not_specialize=DKV_INTS)
def nsa_bwd_dkv_kernel(
    Q, K, V, DOUT, LSE, DELTA, ENTRY_ORDER, BUCKET_STARTS, CHUNK_BUCKETS, CHUNK_STARTS, CU_SEQLENS,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_lh,
    seqlen, total, num_heads_kv, kv_groups, chunk_entries, sm_scale,
    DK_CHUNKS, DV_CHUNKS,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOKENS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr,
):
    # Key-major partial dK / dV.  Grid (chunks * BLOCK_SIZE // BLOCK_N,): a program owns BLOCK_N
    # keys of the block of its chunk's bucket (CHUNK_BUCKETS[chunk]), in registers with their fp32
    # dK, dV, and walks the chunk: list entries [first, last) of the bucket's
    # ENTRY_ORDER[BUCKET_STARTS[bucket]:BUCKET_STARTS[bucket + 1]] (increasing token order),
    # first = the list's start + (chunk - CHUNK_STARTS[bucket]) * chunk_entries, TOKENS at a time,
    # all GROUP heads of each as rows:
    #
    #     rows  e0:h0 .. e0:hG-1 [pad] | e1:h0 .. | ...      (e = list entry, TOKENS * GROUP_PAD rows)
    #
    # It writes its fp32 dK (unscaled), dV to slot `chunk` of DK_CHUNKS, DV_CHUNKS
    # (chunks, BLOCK_SIZE, HEAD_DIM / HEAD_DIM_V); nsa_bwd_dkv_reduce_kernel sums them.  DOUT has
    # O's strides, DELTA the lse's.
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    chunk = tl.program_id(0) // (BLOCK_SIZE // BLOCK_N)
    bucket_id = tl.load(CHUNK_BUCKETS + chunk)
    b, h_kv, start, seq_len, offs_n, has_keys = bucket_keys(bucket_id, kv_groups, CU_SEQLENS, seqlen, total,
                                                            num_heads_kv, BLOCK_SIZE, BLOCK_N, IS_VARLEN)
    if has_keys:
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        K_HEAD = head_base(K, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        V_HEAD = head_base(V, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        k = load_tile(K_HEAD + offs_n[:, None] * stride_ks + offs_d[None, :], offs_n, seq_len, offs_d, HEAD_DIM, True,
                      BLOCK_D != HEAD_DIM)  # [BLOCK_N, BLOCK_D]
        v = load_tile(V_HEAD + offs_n[:, None] * stride_vs + offs_dv[None, :], offs_n, seq_len, offs_dv, HEAD_DIM_V,
                      True, BLOCK_DV != HEAD_DIM_V)  # [BLOCK_N, BLOCK_DV]
        dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
        # The list's start, not the chunk's: the duplicate rule below looks back across chunk edges.
        lo = tl.load(BUCKET_STARTS + bucket_id)
        first = lo + (chunk - tl.load(CHUNK_STARTS + bucket_id)) * chunk_entries
        last = tl.minimum(first + chunk_entries, tl.load(BUCKET_STARTS + bucket_id + 1))
        offs_r = tl.arange(0, TOKENS * GROUP_PAD)
        g_rows = offs_r % GROUP_PAD
        h_rows = h_kv * GROUP + g_rows
        entries_per_row = num_heads_kv * NUM_SLOTS
        rows_in_memory = total if IS_VARLEN else seqlen
        qk_scale = sm_scale * LOG2E
        for step in tl.range(first, last, TOKENS):
            e = step + offs_r // GROUP_PAD
            listed = e < last
            t_rows = listed_tokens(ENTRY_ORDER, e, listed, entries_per_row, rows_in_memory, start)
            # A token that names the block in two slots is listed twice, side by side: count it once.
            t_prev = listed_tokens(ENTRY_ORDER, e - 1, listed & (e > lo), entries_per_row, rows_in_memory, start)
            row_ok = listed & (g_rows < GROUP) & ((e == lo) | (t_prev != t_rows))
            q, do, lse2, delta = gradient_rows(Q, DOUT, LSE, DELTA, b, start, t_rows, h_rows, row_ok, stride_qb,
                                               stride_qs, stride_qh, stride_ob, stride_os, stride_oh, stride_lb,
                                               stride_ls, stride_lh, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV)
            ok = row_ok[None, :] & (offs_n[:, None] <= t_rows[None, :])  # [BLOCK_N, TOKENS * GROUP_PAD]
            p_t, ds_t = probs_and_score_grads(q, k, v, do, lse2, delta, ok, qk_scale, True, DOT_PRECISION)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
        dk_ptrs, dk_cols = chunk_slot(DK_CHUNKS, chunk, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N)
        tl.store(dk_ptrs, dk, mask=dk_cols)
        dv_ptrs, dv_cols = chunk_slot(DV_CHUNKS, chunk, HEAD_DIM_V, BLOCK_DV, BLOCK_SIZE, BLOCK_N)
        tl.store(dv_ptrs, dv, mask=dv_cols)


@triton.jit(do_not_specialize=DKV_REDUCE_INTS)
def nsa_bwd_dkv_reduce_kernel(
    DK_CHUNKS, DV_CHUNKS, CHUNK_STARTS, CU_SEQLENS,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    seqlen, total, num_heads_kv, kv_groups, sm_scale,
    DK, DV,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IS_VARLEN: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
):
    # Grid (buckets * BLOCK_SIZE // BLOCK_N,): BLOCK_N keys of one bucket's block.  Sums the partial
    # dK, dV of the bucket's chunks, slots CHUNK_STARTS[bucket] .. CHUNK_STARTS[bucket + 1] - 1, in
    # that order (fp32; none: zeros), and writes them once in DK's, DV's dtype (K's, V's strides).
    tl.static_assert(BLOCK_SIZE % BLOCK_N == 0)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    bucket_id = tl.program_id(0) // (BLOCK_SIZE // BLOCK_N)
    b, h_kv, start, seq_len, offs_n, has_keys = bucket_keys(bucket_id, kv_groups, CU_SEQLENS, seqlen, total,
                                                            num_heads_kv, BLOCK_SIZE, BLOCK_N, IS_VARLEN)
    if has_keys:
        dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
        dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
        for chunk in tl.range(tl.load(CHUNK_STARTS + bucket_id), tl.load(CHUNK_STARTS + bucket_id + 1)):
            dk_ptrs, dk_cols = chunk_slot(DK_CHUNKS, chunk, HEAD_DIM, BLOCK_D, BLOCK_SIZE, BLOCK_N)
            dk += tl.load(dk_ptrs, mask=dk_cols, other=0.0)
            dv_ptrs, dv_cols = chunk_slot(DV_CHUNKS, chunk, HEAD_DIM_V, BLOCK_DV, BLOCK_SIZE, BLOCK_N)
            dv += tl.load(dv_ptrs, mask=dv_cols, other=0.0)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        key_rows = (offs_n < seq_len)[:, None]
        DK_HEAD = head_base(DK, b, start, h_kv, stride_kb, stride_ks, stride_kh)
        DV_HEAD = head_base(DV, b, start, h_kv, stride_vb, stride_vs, stride_vh)
        tl.store(DK_HEAD + offs_n[:, None] * stride_ks + offs_d[None, :], (dk * sm_scale).to(DK.dtype.element_ty),
                 mask=key_rows & (offs_d[None, :] < HEAD_DIM))
        tl.store(DV_HEAD + offs_n[:, None] * stride_vs + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                 mask=key_rows & (offs_dv[None, :] < HEAD_DIM_V))
