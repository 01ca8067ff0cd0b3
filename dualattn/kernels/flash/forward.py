"""Flash attention forward: O and the natural-log log-sum-exp (fp32), every SPEC option.

Grid: (cdiv(max Sq, BLOCK_M), batch * Hq).  One program owns one query tile of one
head and streams the key tiles that band_range says it can see: masked edge tiles and
unmasked interior tiles go through the same inner loop, specialised by POSITIONAL (or, with
EDGES_IN_LOOP, one loop with the mask behind a branch on edge tiles).
Layouts: element strides for (batch, seq, head); the head dimension is contiguous.
Varlen: batch strides are 0 and sequence starts come from CU_SEQLENS_*.
WARP_SPECIALIZE (Hopper; plan.warp_specialized_forward): one TMA loop that Triton splits
into a producer warp and consumer warpgroups, with TMA loads and stores.  It cannot hold masked
tiles, so with SPLIT_BAND (causal, windows) the band runs in two launches of this kernel: the
warp-specialised one over the unmasked interior of its SPLIT_BAND x SPLIT_BAND tiles, then a
portable one, on its own smaller tiles, over the masked edges that resumes the online softmax from
the O and lse the first stored (RESUME_O, RESUME_LSE; launch.Launch.then).
EDGES_IN_LOOP (portable; plan.edges_in_loop, short bands): the masked edge tiles run in the one
loop, masked behind a branch, instead of in loops of their own (rules.mask_band_edge).
PERSISTENT (warp-specialised; plan.persistent_forward, short keys): grid = (SMs,), and each program
takes the grid's tiles in turn (rules.program_tile), through descriptors over the whole arrays that
it builds once (rules.whole_tiles).  At D=128 with short keys (plan.ws_band_in_loop) it runs a causal
or window band whole in the specialised loop, masked on every tile (BAND_IN_LOOP).
"""
import triton
import triton.language as tl

from .rules import (FWD_INTS, LN2, LOG2E, aligned, band_range, dropout_keep, dropout_row_hash, key_tiles, load_bias,
                    load_ids, load_rows, load_tile, logits, loop_segment, mask_as_int8, mask_band_edge, own_tile_frame,
                    program_tile, reduce_max, reduce_sum, row_stats, row_tiles, segment_range, sequence_bounds,
                    tile_mask, tile_start, whole_stats, whole_tiles)


@triton.jit
def _fwd_inner(acc, l_i, m_i, q, q_seg, q_pos, row_hash, offs_m, lo, hi, full_lo, full_hi, BLOCK_LIST,
               K_TILES, V_TILES, k_row0, k_col0, v_col0, BIAS_ROW, MASK_ROW, KSEG_ROW, KPOS_ROW,
               stride_ks, stride_vs, bias_stride_s, mask_stride_s,
               seqlen_q, seqlen_k, diag, window_left, window_right,
               sm_scale, softcap, dropout_threshold, dropout_scale,
               POSITIONAL: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr,
               HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
               SPARSE_CONTIGUOUS: tl.constexpr, HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr,
               WARP_SPECIALIZE: tl.constexpr, EDGES_IN_LOOP: tl.constexpr):
    # Dense: [lo, hi) are key positions, stepped by BLOCK_N.  Block-sparse: [lo, hi) index
    # BLOCK_LIST, the active key blocks of this query block.  EDGES_IN_LOOP: [lo, hi) is the
    # whole band and only tiles outside [full_lo, full_hi) take the position mask, in a branch.
    # k_row0, k_col0, v_col0: where the head starts in whole-array descriptors (rules.whole_tiles), or 0.
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    first_block = tl.load(BLOCK_LIST) if BLOCK_SPARSE and SPARSE_CONTIGUOUS else 0
    for it in tl.range(lo, hi, 1 if BLOCK_SPARSE else BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tile_start(it, BLOCK_LIST, first_block, BLOCK_N, BLOCK_SPARSE, SPARSE_CONTIGUOUS)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        # Interior tiles lie inside the sequence, so only head-dim padding needs a mask.
        k = load_rows(K_TILES, start_n, offs_n, stride_ks, seqlen_k, offs_d, HEAD_DIM, POSITIONAL,
                      BLOCK_D != HEAD_DIM, TMA, k_row0, k_col0)  # [BLOCK_N, BLOCK_D]
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        if HAS_BIAS or SOFTCAP or (POSITIONAL and not (EDGES_IN_LOOP or WARP_SPECIALIZE)):
            bias = 0.0
            if HAS_BIAS:
                bias = load_bias(BIAS_ROW, offs_m, offs_n, bias_stride_s, seqlen_q, seqlen_k, False)
            s = logits(qk, bias, sm_scale, softcap, HAS_BIAS, SOFTCAP)
            s_scale = 1.0
        else:
            # Plain scores: scale the row max instead (scale > 0), so the exponent below is one
            # FMA per element instead of a multiply and a subtract.  (Position-masked loops keep
            # the multiply: folded there, the block-sparse window forward measured 35% slower,
            # NOTES: "The exponent as one FMA, on unmasked tiles only"; EDGES_IN_LOOP's edge tiles and the
            # warp-specialised
            # band loop fold it, -inf * scale staying -inf.)
            s = qk
            s_scale = sm_scale * LOG2E
        k_seg = load_ids(KSEG_ROW, offs_n, seqlen_k, -1, HAS_SEGMENTS and not EDGES_IN_LOOP)
        k_pos = load_ids(KPOS_ROW, offs_n, seqlen_k, 0, HAS_POSITIONS)
        if EDGES_IN_LOOP:
            # (with segments, SEGMENT_SKIP: the interior [full_lo, full_hi) is one document)
            s = mask_band_edge(s, (start_n < full_lo) | (start_n >= full_hi), offs_m, offs_n, seqlen_q, seqlen_k,
                               diag, window_left, window_right, HAS_LEFT, HAS_RIGHT, False, q_seg, KSEG_ROW,
                               HAS_SEGMENTS)
        elif POSITIONAL or HAS_SEGMENTS or HAS_MASK:
            ok = tile_mask(offs_m, offs_n, seqlen_q, seqlen_k, diag, window_left, window_right,
                           q_seg, MASK_ROW, k_seg, mask_stride_s, q_pos, k_pos,
                           POSITIONAL, HAS_LEFT, HAS_RIGHT, HAS_SEGMENTS, HAS_MASK, False, HAS_POSITIONS,
                           WARP_SPECIALIZE)  # (a warp-specialised band loop's tiles lie inside: plan)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, reduce_max(s, 1) * s_scale)
        # A row with nothing visible yet keeps m = -inf; shift by 0 instead to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s * s_scale - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + reduce_sum(p, 1)
        acc = acc * alpha[:, None]
        if HAS_DROPOUT:
            keep = dropout_keep(row_hash, offs_n, dropout_threshold, False)
            p = tl.where(keep, p * dropout_scale, 0.0)
        v = load_rows(V_TILES, start_n, offs_n, stride_vs, seqlen_k, offs_dv, HEAD_DIM_V, POSITIONAL,
                      BLOCK_DV != HEAD_DIM_V, TMA, k_row0, v_col0)  # [BLOCK_N, BLOCK_DV]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=FWD_INTS)
def flash_fwd_kernel(
    Q, K, V, BIAS, MASK, QSEG, KSEG, SINKS, CU_SEQLENS_Q, CU_SEQLENS_K, DROPOUT_SEED,
    SPARSE_KV_COUNT, SPARSE_KV_INDEX, SPARSE_Q_ORDER, SPARSE_Q_COUNT, SPARSE_Q_INDEX, SPARSE_K_ORDER, QPOS, KPOS,
    SEGMENT_RANGES,
    RESUME_O, RESUME_LSE,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    bias_stride_b, bias_stride_h, bias_stride_s, mask_stride_b, mask_stride_h, mask_stride_s,
    seg_stride_qb, seg_stride_kb,
    sparse_stride_b, sparse_stride_h, sparse_kstride_b, sparse_kstride_h, num_q_blocks, num_k_blocks,
    pos_stride_qb, pos_stride_kb,
    seqlen_q, seqlen_k, total_q, total_k, num_heads_q, diag_shift, window_left, window_right,
    sm_scale, softcap, dropout_threshold, dropout_scale, num_work,
    O, LSE, DESC_SCRATCH,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STRIDES_ALIGNED: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_SEGMENTS: tl.constexpr, NUM_SINKS: tl.constexpr, BLOCK_SINKS: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_SPARSE: tl.constexpr,
    GROUP_SIZE: tl.constexpr, SINKS_PER_HEAD: tl.constexpr, SPARSE_CONTIGUOUS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SPLIT_BAND: tl.constexpr,
    EDGES_IN_LOOP: tl.constexpr, PERSISTENT: tl.constexpr, SEGMENT_SKIP: tl.constexpr,
):
    # EDGES_IN_LOOP's branch masks positions, and segment ids where the interior is one document
    # (SEGMENT_SKIP), on dense bands (plan.edges_in_loop).
    tl.static_assert(not (EDGES_IN_LOOP and (HAS_MASK or (HAS_SEGMENTS and not SEGMENT_SKIP) or HAS_POSITIONS
                                             or BLOCK_SPARSE or WARP_SPECIALIZE or SPLIT_BAND)))
    stride_qb, stride_qs, stride_qh = aligned(stride_qb, stride_qs, stride_qh, STRIDES_ALIGNED)
    stride_kb, stride_ks, stride_kh = aligned(stride_kb, stride_ks, stride_kh, STRIDES_ALIGNED)
    stride_vb, stride_vs, stride_vh = aligned(stride_vb, stride_vs, stride_vh, STRIDES_ALIGNED)
    stride_ob, stride_os, stride_oh = aligned(stride_ob, stride_os, stride_oh, STRIDES_ALIGNED)
    num_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M   # per head (max Sq when varlen)
    # PERSISTENT (plan.persistent_forward): a program per SM takes the grid's tiles in turn, so
    # each SM sets up a warp-specialised program once instead of once per tile.  Otherwise the
    # loop runs once, for this program's tile (a one-trip loop, folded away by the compiler).
    # (Inline, not a helper: a @jit function's return values become tensors, constants included,
    # and then the grid's kernels no longer compile to the same code.)
    if PERSISTENT:
        work_begin, work_end, work_step = tl.program_id(0), num_work, tl.num_programs(0)
        # Its descriptors cover the whole arrays and are built once, here (rules.whole_tiles; a
        # persistent launch is never varlen, so batch b's rows start at b * seqlen).
        n_batch = num_work // (num_tiles * num_heads_q)
        Q_ALL = whole_tiles(Q, n_batch * seqlen_q, num_heads_q, stride_qs, stride_qh, HEAD_DIM, BLOCK_M, BLOCK_D)
        K_ALL = whole_tiles(K, n_batch * seqlen_k, num_heads_q // GROUP_SIZE, stride_ks, stride_kh, HEAD_DIM, BLOCK_N,
                            BLOCK_D)
        V_ALL = whole_tiles(V, n_batch * seqlen_k, num_heads_q // GROUP_SIZE, stride_vs, stride_vh, HEAD_DIM_V,
                            BLOCK_N, BLOCK_DV)
        O_ALL = whole_tiles(O, n_batch * seqlen_q, num_heads_q, stride_os, stride_oh, HEAD_DIM_V, BLOCK_M, BLOCK_DV)
        LSE_ALL = whole_stats(LSE, n_batch, stride_lse_b, stride_lse_h, num_heads_q, seqlen_q, BLOCK_M)
    else:
        work_begin, work_end, work_step = 0, 1, 1
    for work in tl.range(work_begin, work_end, work_step):
        pid_m, b, h, layout_q = program_tile(num_heads_q, SPARSE_Q_ORDER, sparse_stride_b, sparse_stride_h,
                                             BLOCK_SPARSE, HAS_LEFT != HAS_RIGHT, HAS_RIGHT, 4, work, num_work,
                                             num_tiles, PERSISTENT)
        pid_bh = b * num_heads_q + h
        h_kv = h // GROUP_SIZE
        # (This tile's batch's lengths under new names: a loop may not retype the kernel's arguments.)
        q_start, k_start, q_len, k_len = sequence_bounds(b, CU_SEQLENS_Q, CU_SEQLENS_K, seqlen_q, seqlen_k,
                                                         total_q, total_k, IS_VARLEN)
        m0 = pid_m * BLOCK_M
        # A packed (varlen) grid has tiles past a sequence's end.  (The warp-specialised variant
        # has no such test: Triton 3.6's pass fails on a branch around its loop, and its grid,
        # never packed, has no tile past the end.)
        if WARP_SPECIALIZE:
            in_sequence = True
        else:
            in_sequence = m0 < q_len
        if in_sequence:
            diag = k_len - q_len + diag_shift

            offs_m = m0 + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, BLOCK_D)
            offs_dv = tl.arange(0, BLOCK_DV)
            b64 = b.to(tl.int64)
            Q_HEAD = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
            K_HEAD = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + h_kv * stride_kh
            V_HEAD = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + h_kv * stride_vh
            # The warp-specialised loop wants every tile from a descriptor, q included (a pointer load
            # before it fails the pass as well).
            if PERSISTENT:
                Q_TILES, K_TILES, V_TILES = Q_ALL, K_ALL, V_ALL
                q_row0, q_col0 = b * seqlen_q, h * stride_qh
                k_row0, k_col0, v_col0 = b * seqlen_k, h_kv * stride_kh, h_kv * stride_vh
            else:
                Q_TILES = row_tiles(Q_HEAD, q_len, stride_qs, HEAD_DIM, BLOCK_M, BLOCK_D, WARP_SPECIALIZE)
                K_TILES = row_tiles(K_HEAD, k_len, stride_ks, HEAD_DIM, BLOCK_N, BLOCK_D, TMA)
                V_TILES = row_tiles(V_HEAD, k_len, stride_vs, HEAD_DIM_V, BLOCK_N, BLOCK_DV, TMA)
                q_row0, q_col0, k_row0, k_col0, v_col0 = 0, 0, 0, 0, 0
            q = load_rows(Q_TILES, m0, offs_m, stride_qs, q_len, offs_d, HEAD_DIM, True, BLOCK_D != HEAD_DIM,
                          WARP_SPECIALIZE, q_row0, q_col0)

            BIAS_ROW = BIAS + b64 * bias_stride_b + h * bias_stride_h
            MASK_ROW = mask_as_int8(MASK) + b64 * mask_stride_b + h * mask_stride_h
            KSEG_ROW = KSEG + b64 * seg_stride_kb
            q_seg = load_ids(QSEG + b64 * seg_stride_qb, offs_m, q_len, -2, HAS_SEGMENTS)
            q_pos = load_ids(QPOS + b64 * pos_stride_qb, offs_m, q_len, 0, HAS_POSITIONS)
            row_hash = 0
            if HAS_DROPOUT:
                # The seed is read from memory so JAX can pass a traced value.
                row_hash = dropout_row_hash(tl.load(DROPOUT_SEED), pid_bh, offs_m)

            if SPLIT_BAND and not WARP_SPECIALIZE:
                # The edges launch: resume from the interior's normalised O and natural lse (sinks
                # included there), laid out as O and LSE: the very same buffers from torch (in place),
                # the interior launch's results from JAX.  State m = lse in log2 units with l = 1 gives
                # the same O and lse.
                O_HEAD = RESUME_O + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
                LSE_HEAD = RESUME_LSE + b64 * stride_lse_b + h * stride_lse_h + q_start
                lse0 = tl.load(LSE_HEAD + offs_m, mask=offs_m < q_len, other=float("-inf"))
                # A row whose lse is +inf (an infinite sink took it whole) stays so: `saturated` below.
                saturated = lse0 == float("inf")
                seen = (lse0 != float("-inf")) & (lse0 != float("inf"))
                m_i = tl.where(seen, lse0 * LOG2E, float("-inf"))
                l_i = tl.where(seen, 1.0, 0.0)
                acc = tl.load(O_HEAD + offs_m[:, None] * stride_os + offs_dv[None, :],
                              mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < HEAD_DIM_V),
                              other=0.0).to(tl.float32)
            elif NUM_SINKS > 0:
                # Sinks join every row's denominator: start the online softmax from them.  Sinks of -inf
                # join nothing; a sink of +inf takes the whole softmax (output 0, lse +inf: `saturated`,
                # applied after the loop, which meanwhile runs as if there were no such sink).  A NaN sink
                # makes every row of its head NaN, as the softmax's own arithmetic does: the max drops NaN,
                # so the sum of the NaN entries (0 for the others) puts it back into m and l.
                offs_s = tl.arange(0, BLOCK_SINKS)
                sinks = tl.load(SINKS + (h * NUM_SINKS if SINKS_PER_HEAD else 0) + offs_s, mask=offs_s < NUM_SINKS,
                                other=float("-inf")).to(tl.float32) * LOG2E
                sink_max = reduce_max(sinks, 0) + reduce_sum(tl.where(sinks == sinks, 0.0, sinks), 0)
                finite = (sink_max != float("-inf")) & (sink_max != float("inf"))
                sink_ref = tl.where(finite, sink_max, 0.0)
                saturated = (tl.full([BLOCK_M], 0.0, tl.float32) + sink_max) == float("inf")
                m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.where(finite, sink_max, float("-inf"))
                l_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.where(
                    finite, reduce_sum(tl.exp2(sinks - sink_ref), 0), 0.0)
                acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
            else:
                m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
                l_i = tl.full([BLOCK_M], 0.0, tl.float32)
                acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)

            start, full_start, full_end, end, BLOCK_LIST = key_tiles(
                m0, pid_m, layout_q, SPARSE_KV_COUNT, SPARSE_KV_INDEX, num_k_blocks, q_len, k_len, diag,
                window_left, window_right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, BLOCK_SPARSE)
            start, full_start, full_end, end = segment_range(SEGMENT_RANGES, b, pid_m, num_tiles, start, full_start,
                                                             full_end, end, SEGMENT_SKIP)
            if SPLIT_BAND and not WARP_SPECIALIZE:
                # The edges launch runs smaller tiles than the interior's (SPLIT_BAND square): its band
                # minus that interior.  The interior is visible to every row, so it lies inside this
                # band; its ends are multiples of SPLIT_BAND, so no edge tile overlaps it.
                _, cut_lo, cut_hi, _ = band_range((m0 // SPLIT_BAND) * SPLIT_BAND, q_len, k_len, diag,
                                                  window_left, window_right, SPLIT_BAND, SPLIT_BAND, HAS_LEFT,
                                                  HAS_RIGHT)
                full_start = tl.minimum(tl.maximum(cut_lo, start), end)
                full_end = tl.minimum(tl.maximum(cut_hi, full_start), end)
            # Warp-specialised with a causal or window band and no split (plan.ws_band_in_loop): the
            # whole band in the one loop, position-masked on every tile (own_tile_frame: why relative).
            BAND_IN_LOOP: tl.constexpr = WARP_SPECIALIZE and not SPLIT_BAND and (HAS_LEFT or HAS_RIGHT)
            mask_offs_m, mask_seqlen_q, mask_diag = own_tile_frame(m0, offs_m, q_len, diag, BLOCK_M, False,
                                                                   BAND_IN_LOOP)
            for segment in tl.static_range(3):
                # Warp-specialised (Hopper, TMA; plan.warp_specialized_forward): Triton 3.6 specialises
                # a kernel's only loop, so only segment 1 compiles: the whole band, or with SPLIT_BAND the
                # unmasked interior (the edges launch then runs segments 0 and 2).  EDGES_IN_LOOP: segment
                # 1 alone, over the whole band.
                if ((segment == 1) == WARP_SPECIALIZE or not (WARP_SPECIALIZE or SPLIT_BAND)) and (
                        segment == 1 or not EDGES_IN_LOOP):
                    lo, hi = loop_segment(segment, start, full_start, full_end, end,
                                          (WARP_SPECIALIZE and not SPLIT_BAND) or EDGES_IN_LOOP)
                    acc, l_i, m_i = _fwd_inner(
                        acc, l_i, m_i, q, q_seg, q_pos, row_hash, mask_offs_m, lo, hi, full_start, full_end,
                        BLOCK_LIST,
                        K_TILES, V_TILES, k_row0, k_col0, v_col0, BIAS_ROW, MASK_ROW, KSEG_ROW, KPOS + b64 * pos_stride_kb,
                        stride_ks, stride_vs, bias_stride_s, mask_stride_s,
                        mask_seqlen_q, k_len, mask_diag, window_left, window_right,
                        sm_scale, softcap, dropout_threshold, dropout_scale,
                        segment != 1 or EDGES_IN_LOOP or BAND_IN_LOOP, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_N,
                        HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_BIAS, HAS_MASK,
                        # (rules.segment_range; EDGES_IN_LOOP: its edge tiles compare ids)
                        HAS_SEGMENTS and (EDGES_IN_LOOP or not (SEGMENT_SKIP and segment == 1)),
                        HAS_DROPOUT, DOT_PRECISION,
                        BLOCK_SPARSE, SPARSE_CONTIGUOUS, HAS_POSITIONS, TMA, WARP_SPECIALIZE, EDGES_IN_LOOP)

            # Fully masked rows (l == 0, no sinks) give output 0 and lse -inf.
            empty = l_i == 0.0
            out = acc / tl.where(empty, 1.0, l_i)[:, None]
            lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
            if NUM_SINKS > 0 or (SPLIT_BAND and not WARP_SPECIALIZE):
                out = tl.where(saturated[:, None], 0.0, out)
                lse = tl.where(saturated, float("inf"), lse)
            O_HEAD = O + b64 * stride_ob + q_start.to(tl.int64) * stride_os + h * stride_oh
            # After a warp-specialised loop only TMA stores write every row (pointer stores left rows
            # 64-127 of each tile unwritten on the H100 with Triton 3.6: NOTES: "What Triton's warp
            # specialisation accepts").
            if PERSISTENT:
                O_ALL.store([q_row0 + m0, h * stride_oh], out.to(O.dtype.element_ty))
            elif WARP_SPECIALIZE:
                row_tiles(O_HEAD, q_len, stride_os, HEAD_DIM_V, BLOCK_M, BLOCK_DV, True).store(
                    [m0, 0], out.to(O.dtype.element_ty))
            else:
                tl.store(O_HEAD + offs_m[:, None] * stride_os + offs_dv[None, :], out.to(O.dtype.element_ty),
                         mask=(offs_m[:, None] < q_len) & (offs_dv[None, :] < HEAD_DIM_V))
            LSE_HEAD = LSE + b64 * stride_lse_b + h * stride_lse_h + q_start
            if PERSISTENT:
                LSE_ALL.store([b * stride_lse_b + h * stride_lse_h + m0], lse)
            elif WARP_SPECIALIZE:
                row_stats(LSE_HEAD, q_len, BLOCK_M, True).store([m0], lse)
            else:
                tl.store(LSE_HEAD + offs_m, lse, mask=offs_m < q_len)
