"""Flash attention backward: delta preprocessing (+ dsinks), dK/dV (+ dbias), dQ.

Recomputes P = exp(S - lse) tile by tile from the forward's lse (FA2).  With the
natural-unit pre-cap scores z = qk * scale + bias and S = cap * tanh(z / cap):
    dP = dO V^T (dropout: times keep / (1 - p)),  dS = P (dP - delta),  delta = rowsum(dO * O) - dlse
    dZ = dS (1 - tanh^2)  -> dbias = dZ, dQ = scale dZ K, dK = scale dZ^T Q, dV = P_dropped^T dO
    dsink_n = -sum_i exp(sink_n - lse_i) delta_i   (+inf sinks: 1 / their count for exp(inf - inf))
dK/dV programs own one key tile of one KV head and loop over the query heads of its GQA
group, so no atomics are needed.  Tile ranges come from rules.band_range, as in forward.
WARP_SPECIALIZE (Hopper; plan.warp_specialized_backward): each kernel's loop warp-specialised, as
the forward's, with every load and store through TMA; a causal or window band runs whole in that
one loop, position-masked on every tile (BAND_IN_LOOP).  EDGES_IN_LOOP: as forward.py's.
PERSISTENT (warp-specialised; plan.persistent_backward): as forward.py's, for each kernel: grid =
(SMs,), each program takes the grid's tiles in turn through descriptors over the whole arrays.
"""
import triton
import triton.language as tl

from .rules import (BWD_DKDV_INTS, BWD_DQ_INTS, DROPOUT_MASK_INTS, LN2, LOG2E, PREPROCESS_INTS, aligned,
                    dropout_keep, dropout_row_hash, key_tiles, load_bias, load_ids, load_rows, load_stats,
                    load_tile, logits, loop_segment, mask_as_int8, mask_band_edge, own_tile_frame, program_tile,
                    query_range, reduce_sum, row_stats, row_tiles, rows_cols, segment_range, sequence_bounds, tile_mask,
                    tile_start, whole_stats, whole_tiles)


@triton.jit(do_not_specialize=PREPROCESS_INTS)
def flash_bwd_preprocess_kernel(
    O, DO, LSE, DLSE, SINKS, CU_SEQLENS_Q,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    seqlen_q, total_q, num_heads_q,
    DELTA, DSINKS_PARTIAL,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
    NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr, IS_VARLEN: tl.constexpr, SINKS_PER_HEAD: tl.constexpr,
    STRIDES_ALIGNED: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    # The row sums' order follows the load layout, which follows what the compiler knows of
    # the strides: specialising them per launcher (torch does, jax-triton cannot) gave delta,
    # hence dQ and dK, different last bits in the two frameworks.
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    q_start, _, seqlen_q, _ = sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_Q, seqlen_q, seqlen_q, total_q,
                                              total_q, IS_VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= seqlen_q:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    base = b.to(tl.int64) * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
    ptrs = base + offs_m[:, None] * stride_os + offs_dv[None, :]
    o = load_tile(O + ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V).to(tl.float32)
    do = load_tile(DO + ptrs, offs_m, seqlen_q, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V).to(tl.float32)
    delta = reduce_sum(o * do, 1)  # [BLOCK_M]
    lse_row = b.to(tl.int64) * stride_lse_b + h * stride_lse_h + q_start
    if HAS_DLSE:
        # d lse_i / d s_ij = P_ij, so an lse cotangent adds P_ij dlse_i to dS_ij = P_ij (dP_ij - delta_i):
        # it is delta shifted by -dlse (the sinks' gradient below takes the same shift).
        delta -= tl.load(DLSE + lse_row + offs_m, mask=offs_m < seqlen_q, other=0.0)
    tl.store(DELTA + lse_row + offs_m, delta, mask=offs_m < seqlen_q)
    if NUM_SINKS > 0:
        lse = tl.load(LSE + lse_row + offs_m, mask=offs_m < seqlen_q, other=float("inf"))
        offs_s = tl.arange(0, BLOCK_SINKS)
        sinks = tl.load(SINKS + (h * NUM_SINKS if SINKS_PER_HEAD else 0) + offs_s, mask=offs_s < NUM_SINKS, other=0.0).to(tl.float32)
        # exp(sink - lse), with the infinite cases decided first: a -inf sink has probability 0 (also in a
        # row whose lse is -inf); the +inf sinks of a head share its rows (lse +inf: the forward's
        # `saturated`) equally, 1 / their count each, the limit of equal sinks growing without bound.
        posinf = sinks == float("inf")
        n_posinf = reduce_sum(posinf.to(tl.float32), 0)
        diff = sinks[None, :] - lse[:, None]
        diff = tl.where(sinks[None, :] == float("-inf"), float("-inf"),
                        tl.where(sinks[None, :] == lse[:, None], 0.0, diff))
        p_sink = tl.exp2(diff * LOG2E)  # [BLOCK_M, BLOCK_SINKS]
        p_sink = tl.where(posinf[None, :] & (lse[:, None] == float("inf")), 1.0 / tl.maximum(n_posinf, 1.0), p_sink)
        dsinks = reduce_sum(-p_sink * delta[:, None], 0)
        # Deterministic: one partial row per program, summed by the front end.
        out = (pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m) * NUM_SINKS
        tl.store(DSINKS_PARTIAL + out + offs_s, dsinks, mask=offs_s < NUM_SINKS)


@triton.jit
def _probabilities(qk, offs_m, offs_n, lse, q_seg, k_seg, q_pos, k_pos, BIAS_ROW, MASK_ROW,
                   bias_stride_s, mask_stride_s, seqlen_q, seqlen_k, diag, window_left, window_right,
                   sm_scale, softcap, POSITIONAL: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                   HAS_SEGMENTS: tl.constexpr, TRANSPOSED: tl.constexpr, HAS_POSITIONS: tl.constexpr,
                   IN_BOUNDS: tl.constexpr, edge, EDGES_IN_LOOP: tl.constexpr, OTHER_SEG_ROW):
    """Recompute probabilities and the soft-cap derivative 1 - tanh^2 from the raw q.k tile.

    The tile is [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] (key-major) when TRANSPOSED.
    EDGES_IN_LOOP: position-masked iff `edge` (rules.mask_band_edge), and with segment ids also
    id-compared there: the own tile's ids are given (k_seg when TRANSPOSED, else q_seg), the
    iterated tile's read from OTHER_SEG_ROW on edge tiles only.
    """
    bias = 0.0
    if HAS_BIAS:
        bias = load_bias(BIAS_ROW, offs_m, offs_n, bias_stride_s, seqlen_q, seqlen_k, TRANSPOSED)
    s = logits(qk, bias, sm_scale, softcap, HAS_BIAS, SOFTCAP)
    cap_grad = 1.0
    if SOFTCAP:
        t = s * (LN2 / softcap)  # tanh(z / cap), read back from the capped score
        cap_grad = 1.0 - t * t
    if EDGES_IN_LOOP:
        own_seg = q_seg
        if TRANSPOSED:
            own_seg = k_seg
        s = mask_band_edge(s, edge, offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
                           HAS_LEFT, HAS_RIGHT, TRANSPOSED, own_seg, OTHER_SEG_ROW, HAS_SEGMENTS)
    elif POSITIONAL or HAS_SEGMENTS or HAS_MASK:
        ok = tile_mask(offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
                       q_seg, MASK_ROW, k_seg, mask_stride_s, q_pos, k_pos,
                       POSITIONAL, HAS_LEFT, HAS_RIGHT, HAS_SEGMENTS, HAS_MASK, TRANSPOSED, HAS_POSITIONS, IN_BOUNDS)
        s = tl.where(ok, s, float("-inf"))
    # lse = -inf marks a fully masked row: every s there is -inf too, so P = 0.
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    lse2, _ = rows_cols(lse2, offs_n, TRANSPOSED)
    p = tl.exp2(s - lse2)
    return p, cap_grad


@triton.jit
def _score_grads(x, y, dx, dy, offs_m, offs_n, lse, q_seg, k_seg, q_pos, k_pos, row_hash, BIAS_ROW, MASK_ROW,
                 bias_stride_s, mask_stride_s, seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap,
                 dropout_threshold, dropout_scale, POSITIONAL: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr,
                 HAS_SEGMENTS: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 TRANSPOSED: tl.constexpr, HAS_POSITIONS: tl.constexpr, IN_BOUNDS: tl.constexpr,
                 edge, EDGES_IN_LOOP: tl.constexpr, OTHER_SEG_ROW):
    """One tile's probabilities P (as dropout keeps them, for dV), dP and the soft-cap factor.

    Query-major [BLOCK_M, BLOCK_N] from x, dx = q, dO and y, dy = k, v (dQ); key-major
    [BLOCK_N, BLOCK_M] from x, dx = k, v and y, dy = q, dO when TRANSPOSED (dK/dV).
    Returns (p, p_dropped, dp, cap_grad); dZ = p (dp - delta) cap_grad.
    """
    p, cap_grad = _probabilities(tl.dot(x, tl.trans(y), input_precision=DOT_PRECISION), offs_m, offs_n, lse,
                                 q_seg, k_seg, q_pos, k_pos, BIAS_ROW, MASK_ROW, bias_stride_s, mask_stride_s,
                                 seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap, POSITIONAL,
                                 HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK, HAS_SEGMENTS, TRANSPOSED,
                                 HAS_POSITIONS, IN_BOUNDS, edge, EDGES_IN_LOOP, OTHER_SEG_ROW)
    dp = tl.dot(dx, tl.trans(dy), input_precision=DOT_PRECISION)
    p_dropped = p
    if HAS_DROPOUT:
        keep = dropout_keep(row_hash, offs_n, dropout_threshold, TRANSPOSED)
        p_dropped = tl.where(keep, p * dropout_scale, 0.0)
        dp = tl.where(keep, dp * dropout_scale, 0.0)
    return p, p_dropped, dp, cap_grad


@triton.jit
def _dkdv_inner(dk, dv, k, v, k_seg, k_pos, offs_n, lo, hi, full_lo, full_hi, BLOCK_LIST, batch_head,
                Q_TILES, DO_TILES, LSE_HEAD, DELTA_HEAD, q_row0, q_col0, o_col0, stats0, BIAS_ROW, MASK_ROW, QSEG_ROW, QPOS_ROW, DBIAS_ROW,
                stride_qs, stride_os, bias_stride_s, mask_stride_s, dbias_stride_s,
                seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap,
                dropout_seed, dropout_threshold, dropout_scale,
                POSITIONAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
                SPARSE_CONTIGUOUS: tl.constexpr, HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr,
                WARP_SPECIALIZE: tl.constexpr, EDGES_IN_LOOP: tl.constexpr, STORE_DBIAS: tl.constexpr):
    # Key-major tiles ([BLOCK_N, BLOCK_M]): P^T and dS^T come out of the dots in the layout
    # the dV and dK products consume, with no register transposes.  [lo, hi) are query
    # positions (dense) or indices into BLOCK_LIST, the active query blocks (block-sparse).
    # q_row0, q_col0, o_col0, stats0: where the head starts in whole-array descriptors
    # (rules.whole_tiles; stats0 in the lse/delta buffers), or 0.
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    first_block = tl.load(BLOCK_LIST) if BLOCK_SPARSE and SPARSE_CONTIGUOUS else 0
    for it in tl.range(lo, hi, 1 if BLOCK_SPARSE else BLOCK_M, warp_specialize=WARP_SPECIALIZE):
        start_m = tile_start(it, BLOCK_LIST, first_block, BLOCK_M, BLOCK_SPARSE, SPARSE_CONTIGUOUS)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_rows(Q_TILES, start_m, offs_m, stride_qs, seqlen_q, offs_d, HEAD_DIM, POSITIONAL,
                      BLOCK_D != HEAD_DIM, TMA, q_row0, q_col0)  # [BLOCK_M, BLOCK_D]
        do = load_rows(DO_TILES, start_m, offs_m, stride_os, seqlen_q, offs_dv, HEAD_DIM_V, POSITIONAL,
                       BLOCK_DV != HEAD_DIM_V, TMA, q_row0, o_col0)  # [BLOCK_M, BLOCK_DV]
        in_rows = offs_m < seqlen_q
        lse = load_stats(LSE_HEAD, stats0 + start_m, offs_m, seqlen_q, WARP_SPECIALIZE)
        delta = load_stats(DELTA_HEAD, stats0 + start_m, offs_m, seqlen_q, WARP_SPECIALIZE)
        # (EDGES_IN_LOOP: read on edge tiles only, rules.mask_band_edge)
        q_seg = load_ids(QSEG_ROW, offs_m, seqlen_q, -2, HAS_SEGMENTS and not EDGES_IN_LOOP)
        q_pos = load_ids(QPOS_ROW, offs_m, seqlen_q, 0, HAS_POSITIONS)
        row_hash = dropout_row_hash(dropout_seed, batch_head, offs_m) if HAS_DROPOUT else 0
        p_t, p_dropped, dp_t, cap_grad = _score_grads(  # [BLOCK_N, BLOCK_M] each
            k, q, v, do, offs_m, offs_n, lse, q_seg, k_seg, q_pos, k_pos, row_hash, BIAS_ROW, MASK_ROW,
            bias_stride_s, mask_stride_s, seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap,
            dropout_threshold, dropout_scale, POSITIONAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK,
            HAS_SEGMENTS, HAS_DROPOUT, DOT_PRECISION, True, HAS_POSITIONS, WARP_SPECIALIZE,  # (plan: tiles inside)
            ((start_m < full_lo) | (start_m >= full_hi)) if EDGES_IN_LOOP else False, EDGES_IN_LOOP, QSEG_ROW)
        dv = tl.dot(p_dropped.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dz_t = p_t * (dp_t - delta[None, :]) * cap_grad  # [BLOCK_N, BLOCK_M]
        if STORE_DBIAS:
            tl.store(DBIAS_ROW + offs_m[None, :].to(tl.int64) * dbias_stride_s + offs_n[:, None], dz_t,
                     mask=in_rows[None, :] & (offs_n[:, None] < seqlen_k))
        dk = tl.dot(dz_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit(do_not_specialize=BWD_DKDV_INTS)
def flash_bwd_dkdv_kernel(
    Q, K, V, BIAS, MASK, QSEG, KSEG, SINKS, CU_SEQLENS_Q, CU_SEQLENS_K, DROPOUT_SEED,
    SPARSE_KV_COUNT, SPARSE_KV_INDEX, SPARSE_Q_ORDER, SPARSE_Q_COUNT, SPARSE_Q_INDEX, SPARSE_K_ORDER, QPOS, KPOS,
    SEGMENT_RANGES,
    DO, LSE, DELTA,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    bias_stride_b, bias_stride_h, bias_stride_s, mask_stride_b, mask_stride_h, mask_stride_s,
    seg_stride_qb, seg_stride_kb,
    sparse_stride_b, sparse_stride_h, sparse_kstride_b, sparse_kstride_h, num_q_blocks, num_k_blocks,
    pos_stride_qb, pos_stride_kb,
    seqlen_q, seqlen_k, total_q, total_k, num_heads_q, diag_shift, window_left, window_right,
    sm_scale, softcap, dropout_threshold, dropout_scale,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    dbias_stride_b, dbias_stride_h, dbias_stride_s, num_work,
    DK, DV, DBIAS, DESC_SCRATCH,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SINKS_PER_HEAD: tl.constexpr, SPARSE_CONTIGUOUS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EDGES_IN_LOOP: tl.constexpr,
    PERSISTENT: tl.constexpr, SEGMENT_SKIP: tl.constexpr, STORE_DBIAS: tl.constexpr,
):
    # STORE_DBIAS: dS goes out as dbias (a bias that needs its gradient: plan_backward's bias_grad).
    # EDGES_IN_LOOP's branch masks positions, and segment ids where the interior is one document
    # (SEGMENT_SKIP), on dense bands (plan.edges_in_loop).
    tl.static_assert(not (EDGES_IN_LOOP and (HAS_MASK or (HAS_SEGMENTS and not SEGMENT_SKIP) or HAS_POSITIONS
                                             or BLOCK_SPARSE or WARP_SPECIALIZE)))
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    num_heads_kv = num_heads_q // GROUP_SIZE
    num_tiles = (seqlen_k + BLOCK_N - 1) // BLOCK_N   # per KV head (max Sk when varlen)
    # PERSISTENT: as the forward's (forward.py), one query head per KV head (the plan's rule).
    if PERSISTENT:
        work_begin, work_end, work_step = tl.program_id(0), num_work, tl.num_programs(0)
        n_batch = num_work // (num_tiles * num_heads_kv)
        Q_ALL = whole_tiles(Q, n_batch * seqlen_q, num_heads_q, stride_qs, stride_qh, HEAD_DIM, BLOCK_M, BLOCK_D)
        DO_ALL = whole_tiles(DO, n_batch * seqlen_q, num_heads_q, stride_os, stride_oh, HEAD_DIM_V, BLOCK_M, BLOCK_DV)
        K_ALL = whole_tiles(K, n_batch * seqlen_k, num_heads_kv, stride_ks, stride_kh, HEAD_DIM, BLOCK_N, BLOCK_D)
        V_ALL = whole_tiles(V, n_batch * seqlen_k, num_heads_kv, stride_vs, stride_vh, HEAD_DIM_V, BLOCK_N, BLOCK_DV)
        DK_ALL = whole_tiles(DK, n_batch * seqlen_k, num_heads_kv, stride_dks, stride_dkh, HEAD_DIM, BLOCK_N, BLOCK_D)
        DV_ALL = whole_tiles(DV, n_batch * seqlen_k, num_heads_kv, stride_dvs, stride_dvh, HEAD_DIM_V, BLOCK_N,
                             BLOCK_DV)
        LSE_ALL = whole_stats(LSE, n_batch, stride_lse_b, stride_lse_h, num_heads_q, seqlen_q, BLOCK_M)
        DELTA_ALL = whole_stats(DELTA, n_batch, stride_lse_b, stride_lse_h, num_heads_q, seqlen_q, BLOCK_M)
    else:
        work_begin, work_end, work_step = 0, 1, 1
    dropout_seed = 0
    if HAS_DROPOUT:
        dropout_seed = tl.load(DROPOUT_SEED)
    for work in tl.range(work_begin, work_end, work_step, num_stages=1):
        # Key tiles busiest-first, as ordered for the group's first query head.  Dense: causal
        # key tiles see fewer queries the later they are; with only a left window bound the last
        # key tiles see the most.
        pid_n, b, h_kv, _ = program_tile(num_heads_kv, SPARSE_K_ORDER, sparse_kstride_b, sparse_kstride_h * GROUP_SIZE,
                                         BLOCK_SPARSE, HAS_LEFT != HAS_RIGHT, HAS_LEFT, 4, work, num_work, num_tiles,
                                         PERSISTENT)
        # (This tile's batch's lengths under new names: a loop may not retype the kernel's arguments.)
        q_start, k_start, q_len, k_len = sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k,
                                                         total_q, total_k, IS_VARLEN)
        n0 = pid_n * BLOCK_N
        if WARP_SPECIALIZE:  # (no test around a warp-specialised loop: see forward.py)
            in_sequence = True
        else:
            in_sequence = n0 < k_len
        if in_sequence:
            diag = k_len - q_len + diag_shift
            BAND_IN_LOOP: tl.constexpr = WARP_SPECIALIZE and (HAS_LEFT or HAS_RIGHT)  # see flash_bwd_dq_kernel
            offs_n = n0 + tl.arange(0, BLOCK_N)
            offs_d = tl.arange(0, BLOCK_D)
            offs_dv = tl.arange(0, BLOCK_DV)
            b64 = b.to(tl.int64)
            k_row = b64 * stride_kb + k_start.to(tl.int64) * stride_ks + h_kv * stride_kh
            v_row = b64 * stride_vb + k_start.to(tl.int64) * stride_vs + h_kv * stride_vh
            # (A warp-specialised loop wants every tile from a descriptor, these included.)
            if PERSISTENT:
                K_TILES, V_TILES = K_ALL, V_ALL
                k_row0, k_col0, v_col0 = b * seqlen_k, h_kv * stride_kh, h_kv * stride_vh
            else:
                K_TILES = row_tiles(K + k_row, k_len, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, WARP_SPECIALIZE)
                V_TILES = row_tiles(V + v_row, k_len, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, WARP_SPECIALIZE)
                k_row0, k_col0, v_col0 = 0, 0, 0
            k = load_rows(K_TILES, n0, offs_n, stride_ks, k_len, offs_d, HEAD_DIM, True, BLOCK_D != HEAD_DIM,
                          WARP_SPECIALIZE, k_row0, k_col0)  # [BLOCK_N, BLOCK_D]
            v = load_rows(V_TILES, n0, offs_n, stride_vs, k_len, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V,
                          WARP_SPECIALIZE, k_row0, v_col0)  # [BLOCK_N, BLOCK_DV]
            k_seg = load_ids(KSEG + b64 * seg_stride_kb, offs_n, k_len, -1, HAS_SEGMENTS)
            k_pos = load_ids(KPOS + b64 * pos_stride_kb, offs_n, k_len, 0, HAS_POSITIONS)
            dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
            dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
            if not BLOCK_SPARSE:
                start, full_start, full_end, end = query_range(n0, q_len, k_len, diag, window_left, window_right,
                                                               BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
                start, full_start, full_end, end = segment_range(SEGMENT_RANGES, b, pid_n, num_tiles, start,
                                                                 full_start, full_end, end, SEGMENT_SKIP)
                BLOCK_LIST = SPARSE_Q_INDEX  # unused
            mask_offs_n, mask_seqlen_k, mask_diag = own_tile_frame(n0, offs_n, k_len, diag, BLOCK_N, True,
                                                                   BAND_IN_LOOP)
            for g in range(0, GROUP_SIZE):
                h = h_kv * GROUP_SIZE + g
                if BLOCK_SPARSE:
                    # The whole list of this head's active query blocks, position-masked.
                    layout_k = b64 * sparse_kstride_b + h * sparse_kstride_h + pid_n
                    n_active = tl.load(SPARSE_Q_COUNT + layout_k)
                    start, full_start, full_end, end = 0, n_active, n_active, n_active
                    BLOCK_LIST = SPARSE_Q_INDEX + layout_k * num_q_blocks
                batch_head = b * num_heads_q + h
                if PERSISTENT:
                    Q_TILES, DO_TILES, LSE_HEAD, DELTA_HEAD = Q_ALL, DO_ALL, LSE_ALL, DELTA_ALL
                    q_row0, q_col0, o_col0 = b * seqlen_q, h * stride_qh, h * stride_oh
                    stats0 = b * stride_lse_b + h * stride_lse_h
                else:
                    Q_TILES = row_tiles(Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh,
                                        q_len, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, TMA)
                    DO_TILES = row_tiles(DO + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh,
                                         q_len, stride_os, HEAD_DIM_V, BLOCK_M, BLOCK_DV, TMA)
                    LSE_HEAD = row_stats(LSE + b64 * stride_lse_b + h * stride_lse_h + q_start, q_len, BLOCK_M,
                                         WARP_SPECIALIZE)
                    DELTA_HEAD = row_stats(DELTA + b64 * stride_lse_b + h * stride_lse_h + q_start, q_len, BLOCK_M,
                                           WARP_SPECIALIZE)  # same layout as LSE
                    q_row0, q_col0, o_col0, stats0 = 0, 0, 0, 0
                BIAS_ROW = BIAS + b64 * bias_stride_b + h * bias_stride_h
                MASK_ROW = mask_as_int8(MASK) + b64 * mask_stride_b + h * mask_stride_h
                DBIAS_ROW = DBIAS + b64 * dbias_stride_b + h * dbias_stride_h
                QSEG_ROW = QSEG + b64 * seg_stride_qb
                for segment in tl.static_range(3):
                    # Warp-specialised: one loop over the whole band (every tile inside the sequences:
                    # plan's rule), position-masked on every tile when the band has edges.  EDGES_IN_LOOP
                    # (portable): one loop too, the mask on edge tiles only.
                    if segment == 1 or not (WARP_SPECIALIZE or EDGES_IN_LOOP):
                        lo, hi = loop_segment(segment, start, full_start, full_end, end,
                                              WARP_SPECIALIZE or EDGES_IN_LOOP)
                        dk, dv = _dkdv_inner(
                            dk, dv, k, v, k_seg, k_pos, mask_offs_n, lo, hi, full_start, full_end, BLOCK_LIST,
                            batch_head, Q_TILES, DO_TILES, LSE_HEAD, DELTA_HEAD, q_row0, q_col0, o_col0, stats0,
                            BIAS_ROW, MASK_ROW, QSEG_ROW, QPOS + b64 * pos_stride_qb, DBIAS_ROW,
                            stride_qs, stride_os, bias_stride_s, mask_stride_s, dbias_stride_s,
                            q_len, mask_seqlen_k, mask_diag, window_left, window_right, sm_scale, softcap,
                            dropout_seed, dropout_threshold, dropout_scale,
                            segment != 1 or BAND_IN_LOOP or EDGES_IN_LOOP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
                            BLOCK_M, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK,
                            # (rules.segment_range; EDGES_IN_LOOP: its edge tiles compare ids)
                            HAS_SEGMENTS and (EDGES_IN_LOOP or not (SEGMENT_SKIP and segment == 1)), HAS_DROPOUT,
                            DOT_PRECISION, BLOCK_SPARSE, SPARSE_CONTIGUOUS, HAS_POSITIONS, TMA, WARP_SPECIALIZE,
                            EDGES_IN_LOOP, STORE_DBIAS)
            dk = dk * sm_scale
            dk_row = b64 * stride_dkb + k_start.to(tl.int64) * stride_dks + h_kv * stride_dkh
            dv_row = b64 * stride_dvb + k_start.to(tl.int64) * stride_dvs + h_kv * stride_dvh
            if PERSISTENT:
                DK_ALL.store([k_row0 + n0, h_kv * stride_dkh], dk.to(DK.dtype.element_ty))
                DV_ALL.store([k_row0 + n0, h_kv * stride_dvh], dv.to(DV.dtype.element_ty))
            elif WARP_SPECIALIZE:  # (pointer stores after such a loop miss rows: forward.py)
                row_tiles(DK + dk_row, k_len, stride_dks, HEAD_DIM, BLOCK_N, BLOCK_D, True).store(
                    [n0, 0], dk.to(DK.dtype.element_ty))
                row_tiles(DV + dv_row, k_len, stride_dvs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, True).store(
                    [n0, 0], dv.to(DV.dtype.element_ty))
            else:
                tl.store(DK + dk_row + offs_n[:, None] * stride_dks + offs_d[None, :], dk.to(DK.dtype.element_ty),
                         mask=(offs_n[:, None] < k_len) & (offs_d[None, :] < HEAD_DIM))
                tl.store(DV + dv_row + offs_n[:, None] * stride_dvs + offs_dv[None, :], dv.to(DV.dtype.element_ty),
                         mask=(offs_n[:, None] < k_len) & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dq_inner(dq, q, do, lse, delta, q_seg, q_pos, row_hash, offs_m, lo, hi, full_lo, full_hi, BLOCK_LIST,
              K_TILES, V_TILES, k_row0, k_col0, v_col0, BIAS_ROW, MASK_ROW, KSEG_ROW, KPOS_ROW,
              stride_ks, stride_vs, bias_stride_s, mask_stride_s,
              seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap,
              dropout_threshold, dropout_scale,
              POSITIONAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
              SPARSE_CONTIGUOUS: tl.constexpr, HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr,
              WARP_SPECIALIZE: tl.constexpr, EDGES_IN_LOOP: tl.constexpr):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    first_block = tl.load(BLOCK_LIST) if BLOCK_SPARSE and SPARSE_CONTIGUOUS else 0
    for it in tl.range(lo, hi, 1 if BLOCK_SPARSE else BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tile_start(it, BLOCK_LIST, first_block, BLOCK_N, BLOCK_SPARSE, SPARSE_CONTIGUOUS)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = load_rows(K_TILES, start_n, offs_n, stride_ks, seqlen_k, offs_d, HEAD_DIM, POSITIONAL,
                      BLOCK_D != HEAD_DIM, TMA, k_row0, k_col0)  # [BLOCK_N, BLOCK_D]
        v = load_rows(V_TILES, start_n, offs_n, stride_vs, seqlen_k, offs_dv, HEAD_DIM_V, POSITIONAL,
                      BLOCK_DV != HEAD_DIM_V, TMA, k_row0, v_col0)  # [BLOCK_N, BLOCK_DV]
        # (EDGES_IN_LOOP: read on edge tiles only, rules.mask_band_edge)
        k_seg = load_ids(KSEG_ROW, offs_n, seqlen_k, -1, HAS_SEGMENTS and not EDGES_IN_LOOP)
        k_pos = load_ids(KPOS_ROW, offs_n, seqlen_k, 0, HAS_POSITIONS)
        p, _, dp, cap_grad = _score_grads(  # [BLOCK_M, BLOCK_N] each
            q, k, do, v, offs_m, offs_n, lse, q_seg, k_seg, q_pos, k_pos, row_hash, BIAS_ROW, MASK_ROW,
            bias_stride_s, mask_stride_s, seqlen_q, seqlen_k, diag, window_left, window_right, sm_scale, softcap,
            dropout_threshold, dropout_scale, POSITIONAL, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK,
            HAS_SEGMENTS, HAS_DROPOUT, DOT_PRECISION, False, HAS_POSITIONS, WARP_SPECIALIZE,  # (plan: tiles inside)
            ((start_n < full_lo) | (start_n >= full_hi)) if EDGES_IN_LOOP else False, EDGES_IN_LOOP, KSEG_ROW)
        dz = p * (dp - delta[:, None]) * cap_grad
        dq = tl.dot(dz.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=BWD_DQ_INTS)
def flash_bwd_dq_kernel(
    Q, K, V, BIAS, MASK, QSEG, KSEG, SINKS, CU_SEQLENS_Q, CU_SEQLENS_K, DROPOUT_SEED,
    SPARSE_KV_COUNT, SPARSE_KV_INDEX, SPARSE_Q_ORDER, SPARSE_Q_COUNT, SPARSE_Q_INDEX, SPARSE_K_ORDER, QPOS, KPOS,
    SEGMENT_RANGES,
    DO, LSE, DELTA,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    bias_stride_b, bias_stride_h, bias_stride_s, mask_stride_b, mask_stride_h, mask_stride_s,
    seg_stride_qb, seg_stride_kb,
    sparse_stride_b, sparse_stride_h, sparse_kstride_b, sparse_kstride_h, num_q_blocks, num_k_blocks,
    pos_stride_qb, pos_stride_kb,
    seqlen_q, seqlen_k, total_q, total_k, num_heads_q, diag_shift, window_left, window_right,
    sm_scale, softcap, dropout_threshold, dropout_scale,
    stride_dqb, stride_dqs, stride_dqh, num_work,
    DQ, DESC_SCRATCH,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SINKS_PER_HEAD: tl.constexpr, SPARSE_CONTIGUOUS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, EDGES_IN_LOOP: tl.constexpr,
    PERSISTENT: tl.constexpr, SEGMENT_SKIP: tl.constexpr,
):
    # EDGES_IN_LOOP's branch masks positions, and segment ids where the interior is one document
    # (SEGMENT_SKIP), on dense bands (plan.edges_in_loop).
    tl.static_assert(not (EDGES_IN_LOOP and (HAS_MASK or (HAS_SEGMENTS and not SEGMENT_SKIP) or HAS_POSITIONS
                                             or BLOCK_SPARSE or WARP_SPECIALIZE)))
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    num_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M   # per head (max Sq when varlen)
    # PERSISTENT: as the forward's (forward.py): a program per SM takes the grid's tiles in turn,
    # through descriptors over the whole arrays built once; otherwise a one-trip loop.
    if PERSISTENT:
        work_begin, work_end, work_step = tl.program_id(0), num_work, tl.num_programs(0)
        n_batch = num_work // (num_tiles * num_heads_q)
        Q_ALL = whole_tiles(Q, n_batch * seqlen_q, num_heads_q, stride_qs, stride_qh, HEAD_DIM, BLOCK_M, BLOCK_D)
        DO_ALL = whole_tiles(DO, n_batch * seqlen_q, num_heads_q, stride_os, stride_oh, HEAD_DIM_V, BLOCK_M, BLOCK_DV)
        DQ_ALL = whole_tiles(DQ, n_batch * seqlen_q, num_heads_q, stride_dqs, stride_dqh, HEAD_DIM, BLOCK_M, BLOCK_D)
        K_ALL = whole_tiles(K, n_batch * seqlen_k, num_heads_q // GROUP_SIZE, stride_ks, stride_kh, HEAD_DIM, BLOCK_N,
                            BLOCK_D)
        V_ALL = whole_tiles(V, n_batch * seqlen_k, num_heads_q // GROUP_SIZE, stride_vs, stride_vh, HEAD_DIM_V,
                            BLOCK_N, BLOCK_DV)
        LSE_ALL = whole_stats(LSE, n_batch, stride_lse_b, stride_lse_h, num_heads_q, seqlen_q, BLOCK_M)
        DELTA_ALL = whole_stats(DELTA, n_batch, stride_lse_b, stride_lse_h, num_heads_q, seqlen_q, BLOCK_M)
    else:
        work_begin, work_end, work_step = 0, 1, 1
    for work in tl.range(work_begin, work_end, work_step, num_stages=1):
        pid_m, b, h, layout_q = program_tile(num_heads_q, SPARSE_Q_ORDER, sparse_stride_b, sparse_stride_h,
                                             BLOCK_SPARSE, HAS_LEFT != HAS_RIGHT, HAS_RIGHT, 4, work, num_work,
                                             num_tiles, PERSISTENT)
        pid_bh = b * num_heads_q + h
        h_kv = h // GROUP_SIZE
        # (This tile's batch's lengths under new names: a loop may not retype the kernel's arguments.)
        q_start, k_start, q_len, k_len = sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k,
                                                         total_q, total_k, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        if WARP_SPECIALIZE:  # (no test around a warp-specialised loop: see forward.py)
            in_sequence = True
        else:
            in_sequence = m0 < q_len
        if in_sequence:
            diag = k_len - q_len + diag_shift
            # A warp-specialised loop holds no branch, so a causal or window band runs in it whole with
            # the position mask on every tile: the backward's five GEMMs per tile hide the extra selects
            # (the forward's two do not, so the forward splits the band instead: docs/lessons.md, "Masks
            # in the warp-specialised forward: split long bands").
            BAND_IN_LOOP: tl.constexpr = WARP_SPECIALIZE and (HAS_LEFT or HAS_RIGHT)
            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_dv = tl.arange(0, BLOCK_DV)
            b64 = b.to(tl.int64)
            q_row = b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
            o_row = b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
            lse_row = b64 * stride_lse_b + h * stride_lse_h + q_start
            # (A warp-specialised loop wants every tile from a descriptor, these included.)
            if PERSISTENT:
                Q_TILES, DO_TILES, K_TILES, V_TILES = Q_ALL, DO_ALL, K_ALL, V_ALL
                LSE_HEAD, DELTA_HEAD = LSE_ALL, DELTA_ALL
                q_row0, stats0 = b * seqlen_q, b * stride_lse_b + h * stride_lse_h
                k_row0, k_col0, v_col0 = b * seqlen_k, h_kv * stride_kh, h_kv * stride_vh
                q_col0, o_col0 = h * stride_qh, h * stride_oh
            else:
                Q_TILES = row_tiles(Q + q_row, q_len, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, WARP_SPECIALIZE)
                DO_TILES = row_tiles(DO + o_row, q_len, stride_os, HEAD_DIM_V, BLOCK_M, BLOCK_DV, WARP_SPECIALIZE)
                K_TILES = row_tiles(K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + h_kv * stride_kh, k_len,
                                    stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
                V_TILES = row_tiles(V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + h_kv * stride_vh, k_len,
                                    stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, TMA)
                LSE_HEAD = row_stats(LSE + lse_row, q_len, BLOCK_M, WARP_SPECIALIZE)
                DELTA_HEAD = row_stats(DELTA + lse_row, q_len, BLOCK_M, WARP_SPECIALIZE)
                q_row0, stats0, k_row0, k_col0, v_col0, q_col0, o_col0 = 0, 0, 0, 0, 0, 0, 0
            q = load_rows(Q_TILES, m0, offs_m, stride_qs, q_len, offs_d, HEAD_DIM, True, BLOCK_D != HEAD_DIM,
                          WARP_SPECIALIZE, q_row0, q_col0)  # [BLOCK_M, BLOCK_D]
            do = load_rows(DO_TILES, m0, offs_m, stride_os, q_len, offs_dv, HEAD_DIM_V, True, BLOCK_DV != HEAD_DIM_V,
                           WARP_SPECIALIZE, q_row0, o_col0)  # [BLOCK_M, BLOCK_DV]
            lse = load_stats(LSE_HEAD, stats0 + m0, offs_m, q_len, WARP_SPECIALIZE)
            delta = load_stats(DELTA_HEAD, stats0 + m0, offs_m, q_len, WARP_SPECIALIZE)
            q_seg = load_ids(QSEG + b64 * seg_stride_qb, offs_m, q_len, -2, HAS_SEGMENTS)
            q_pos = load_ids(QPOS + b64 * pos_stride_qb, offs_m, q_len, 0, HAS_POSITIONS)
            row_hash = 0
            if HAS_DROPOUT:
                row_hash = dropout_row_hash(tl.load(DROPOUT_SEED), pid_bh, offs_m)
            BIAS_ROW = BIAS + b64 * bias_stride_b + h * bias_stride_h
            MASK_ROW = mask_as_int8(MASK) + b64 * mask_stride_b + h * mask_stride_h
            KSEG_ROW = KSEG + b64 * seg_stride_kb
            dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
            start, full_start, full_end, end, BLOCK_LIST = key_tiles(
                m0, pid_m, layout_q, SPARSE_KV_COUNT, SPARSE_KV_INDEX, num_k_blocks, q_len, k_len, diag,
                window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE)
            start, full_start, full_end, end = segment_range(SEGMENT_RANGES, b, pid_m, num_tiles, start, full_start,
                                                             full_end, end, SEGMENT_SKIP)
            mask_offs_m, mask_seqlen_q, mask_diag = own_tile_frame(m0, offs_m, q_len, diag, BLOCK_M, False,
                                                                   BAND_IN_LOOP)
            for segment in tl.static_range(3):
                if segment == 1 or not (WARP_SPECIALIZE or EDGES_IN_LOOP):
                    lo, hi = loop_segment(segment, start, full_start, full_end, end, WARP_SPECIALIZE or EDGES_IN_LOOP)
                    dq = _dq_inner(dq, q, do, lse, delta, q_seg, q_pos, row_hash, mask_offs_m, lo, hi, full_start,
                                   full_end, BLOCK_LIST,
                                   K_TILES, V_TILES, k_row0, k_col0, v_col0, BIAS_ROW, MASK_ROW, KSEG_ROW,
                                   KPOS + b64 * pos_stride_kb,
                                   stride_ks, stride_vs, bias_stride_s, mask_stride_s,
                                   mask_seqlen_q, k_len, mask_diag, window_left, window_right, sm_scale, softcap,
                                   dropout_threshold, dropout_scale,
                                   segment != 1 or BAND_IN_LOOP or EDGES_IN_LOOP, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                                   BLOCK_DV, BLOCK_N, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK,
                                   # (rules.segment_range; EDGES_IN_LOOP: its edge tiles compare ids)
                                   HAS_SEGMENTS and (EDGES_IN_LOOP or not (SEGMENT_SKIP and segment == 1)),
                                   HAS_DROPOUT, DOT_PRECISION, BLOCK_SPARSE, SPARSE_CONTIGUOUS,
                                   HAS_POSITIONS, TMA, WARP_SPECIALIZE, EDGES_IN_LOOP)
            dq = dq * sm_scale
            dq_row = b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs + h * stride_dqh
            if PERSISTENT:
                DQ_ALL.store([q_row0 + m0, h * stride_dqh], dq.to(DQ.dtype.element_ty))
            elif WARP_SPECIALIZE:
                row_tiles(DQ + dq_row, q_len, stride_dqs, HEAD_DIM, BLOCK_M, BLOCK_D, True).store(
                    [m0, 0], dq.to(DQ.dtype.element_ty))
            else:
                tl.store(DQ + dq_row + offs_m[:, None] * stride_dqs + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                         mask=(offs_m[:, None] < q_len) & (offs_d[None, :] < HEAD_DIM))


@triton.jit(do_not_specialize=DROPOUT_MASK_INTS)
def dropout_mask_kernel(seqlen_q, seqlen_k, num_heads, dropout_seed, dropout_threshold, KEEP,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Materialise the keep-mask the attention kernels use (tests and debugging)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_hash = dropout_row_hash(dropout_seed, pid_bh, offs_m)
    base = pid_bh.to(tl.int64) * seqlen_q * seqlen_k
    for start_n in range(0, seqlen_k, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        keep = dropout_keep(row_hash, offs_n, dropout_threshold)
        tl.store(KEEP + base + offs_m[:, None].to(tl.int64) * seqlen_k + offs_n[None, :], keep.to(tl.int8),
                 mask=(offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k))
