"""One-pass flash-attention backward for Hopper (sm_90), in Gluon with explicit warp specialisation.

The portable backward (backward.py) runs two kernels, dK/dV and dQ, each recomputing P: 7 GEMMs
per (query tile, key tile).  This kernel computes all three gradients in one pass, 5 GEMMs per tile,
as FA3 does: dQ partials are reduced into an fp32 buffer by bulk TMA reduce-adds instead of
recomputing P in a second kernel.  Triton's automatic warp specialisation cannot build this loop, so
the partitions are written out (docs/lessons.md, "Two passes in Triton, one pass only in Gluon"):

  * load warp (1 warp): TMA-loads K and V of its key tile once, then Q_i with lse_i and dO_i with
    delta_i into a STAGES-deep ring (separate ready barriers: S^T = K Q^T starts before dO lands).
  * dQ warp (1 warp): waits for the compute warps' fp32 dQ_i (already times the softmax scale) in
    shared memory and issues cp.reduce.async.bulk.tensor .add into the dQ accumulator.
  * compute (default partition, 8 warps = two wgmma warpgroups, 64 keys each, 240 registers):
        S^T  = K Q_i^T,  dP^T = V dO_i^T        (async wgmma, dP^T overlaps exp2 of P^T)
        P^T  = exp2(S^T * scale*log2e - lse_i*log2e)          (diagonal tiles masked)
        dS^T = P^T (dP^T - delta_i)
    (SOFTCAP: P^T = exp2(T * cap*log2e - lse_i*log2e) with T = tanh(S^T * scale / cap), and dS^T takes
    the cap's derivative 1 - T^2, folded into P^T once P^T has gone to the dV GEMM, so no extra tile
    stays live across the dP^T wait)
        dV  += P^T dO_i,  dQ_i = dS K,  dK += dS^T Q_i       (dK retires with the next tile's S)
    dK (times the scale) and dV are stored once at the end.  dQ_i needs both warpgroups' halves of
    dS^T, so they meet (a partition barrier) once dS^T is in shared memory.  DS_BUFS = 1: they meet
    again after the dQ_i store, which frees dS^T's buffer; DS_BUFS = 2: dS^T alternates between two
    buffers and dQ_i goes to the dQ warp at the next tile's meeting (faster at D=64, slower at D=128:
    hopper.ONE_PASS_TILES; docs/lessons.md, "One-pass tile settings").
  * D = 256 (WIDE): dK and dV of 64 keys per warpgroup would take 256 registers a thread, so a program owns
    64 keys and each warpgroup half of dK's, dV's and dQ_i's columns (and of S^T's and dP^T's query columns);
    P^T and dS^T meet in shared memory, and dQ_i is staged in the ring stage's own Q_i / dO_i buffers (_tile).

One program owns key tile `pid_n` of one KV head of one batch and loops over the query heads of its
GQA group (whose columns are adjacent: stride_qh == head dim) and their query tiles.  Rows past the
sequences read as zeros from TMA, so lengths need not be tile multiples: dO = 0 makes a query row's
contributions vanish; keys past the end would still get P = exp(-lse), so a partial last key tile runs
masked (EVEN_K off).  Causal (bottom-right, diag = Sk - Sq + diag_shift): a key tile visits query
tiles from the first that can see it; the ones straddling the diagonal are masked in a loop of their
own.  Segment ids (packed documents): the key tile's segment ranges (segments.py) narrow its
query tiles to those sharing an id, and tiles outside its one-id run compare ids in the masked loops.
Block-sparse (a layout of 128 x 128 blocks): a key tile walks its list of query blocks, two query
tiles each, and the rules above decide per tile whether it is masked (_work_item).
What qualifies, the tile and the launch: plan.one_pass_backward / plan_backward.

flash_bwd_dq_convert_kernel then casts the fp32 accumulator to dQ's dtype (a plain Triton kernel).
Runs only on sm_90 (wgmma, setmaxnreg); Gluon has no interpreter, so CPU tests compile it
(compile_check) and GPU tests check its numbers.  One source for Triton 3.6 and 3.7 (bridges below).
"""
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)
from triton._C.libtriton import ir

from .gluon_shared import (capped_tanh, copy_score_tile, load_rows, masked_bits, mma_layout, partition_barrier,
                           score_copy_layout, scores_landed)
from .rules import ONE_PASS_INTS, dropout_keep, dropout_row_hash, mask_as_int8

@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Bulk TMA reduce-add of the shared tile `src` into global memory at `coord`.  Neither Triton
    3.6 nor 3.7 wraps ttng.async_tma_reduce in Python; both builders take (kind, descriptor,
    coords, smem).  Completion is tracked like a TMA store's (tma.store_wait)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _query_tiles(n0, seqlen_q, diag, window_left, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW: gl.constexpr):
    """(first query tile, query tiles to visit, how many of them straddle the diagonal, where the
    tiles straddling the window's far edge begin) for the key tile at n0: of the tiles visited,
    [0, n_mask) and [n_tail, n_local) are masked.  Causal: query row m sees key n iff n <= m + diag;
    WINDOW (causal only): and n >= m + diag - window_left."""
    n_tiles = gl.cdiv(seqlen_q, BM)
    if CAUSAL:
        i_start = gl.maximum(n0 - diag, 0) // BM
        # tiles from i_full on see every key of the tile: i_full * BM >= n0 + BN - 1 - diag
        i_full = gl.cdiv(gl.maximum(n0 + BN - 1 - diag, 0), BM)
        i_end = n_tiles
        i_tail = n_tiles
        if WINDOW:
            # rows after n0 + BN - 1 - diag + window_left see none of the tile's keys; rows after
            # n0 - diag + window_left miss some of them
            last = n0 + BN - 1 - diag + window_left
            i_end = gl.where(last >= 0, gl.minimum(gl.maximum(last, 0) // BM + 1, n_tiles), 0)
            edge = n0 - diag + window_left - BM + 1
            i_tail = gl.where(edge >= 0, gl.maximum(edge, 0) // BM + 1, 0)
        n_local = gl.maximum(i_end - i_start, 0)
        n_mask = gl.minimum(gl.maximum(i_full - i_start, 0), n_local)
        n_tail = gl.minimum(gl.maximum(i_tail - i_start, n_mask), n_local)
    else:
        i_start = n0 * 0
        n_local = n_tiles
        n_mask = n0 * 0
        n_tail = n_local
    return i_start, n_local, n_mask, n_tail


@gluon.jit
def _item_count(w_first, w_end, w_step, PAIRED: gl.constexpr):
    """How many key tiles this program visits: two per work item where they are paired (_work_item)."""
    return gl.cdiv(w_end - w_first, w_step) * (2 if PAIRED else 1)


@gluon.jit
def _work_item(i, w_first, w_step, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse,
               BM: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
               PERSISTENT: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr):
    """The i-th key tile this program visits.  Work items w = w_first, w_first + w_step, ... are
    (batch * KV heads + KV head) * key tiles + key tile (one head's key tiles in a row), except
    causal and persistent: there item w is a pair of key tiles of one head, p and n - 1 - p (the
    plan makes the key tiles even): causal, key tile p sees the queries from its diagonal on, so
    the pair sees as many query tiles whatever p (2n + 2 of 64 rows, square and tile-aligned).
    Every item is the same work, so programs dealt items round-robin finish together.  Returns the
    tile's batch, KV head, first key, the descriptor coordinates of its first query row and key row,
    of its query-head group's first column and its KV head's, of its first lse row, and its query
    tiles (_query_tiles).
    PERSISTENT: descriptors over whole arrays, (batch, head) in the coordinates; else over this
    item's (batch, head group) alone.  Of its n_local query tiles from i_start, [plain_lo, plain_hi)
    need no mask.
    SEGMENTS: the key tile's segment ranges (segments.py, key tiles of BN over query tiles of BM)
    narrow its query tiles to those sharing an id with it, and its unmasked ones to the run whose ids
    all equal its one id; the others compare ids.
    SPARSE_BLOCK_Q (a block-sparse layout of SPARSE_BLOCK_Q x BN blocks; 0: none): key tiles in the
    layout's order (busiest first) of the group's first query head, persistent in pairs, the p-th
    busiest with the p-th least busy (forward_gluon._fwd_item: why); each query head then visits
    its list (_sparse_query_tiles), and the rules above only say which of those tiles need no mask.
    `sparse` = (counts, lists, key-tile order, layout batch stride, layout head stride, list
    length).  Returns also the layout row of the group's first query head."""
    n_key_tiles = gl.cdiv(seqlen_k, BN)
    sparse_row = n_key_tiles * 0
    if SPARSE_BLOCK_Q > 0:
        if PERSISTENT:
            w = w_first + (i // 2) * w_step
            n_pairs = n_key_tiles // 2
            bh = w // n_pairs
            p = w % n_pairs
            position = p + (i % 2) * (n_key_tiles - 1 - 2 * p)
        else:
            w = w_first + i * w_step
            bh = w // n_key_tiles
            position = w % n_key_tiles
        sparse_row = (bh // num_heads_kv) * sparse[3] + (bh % num_heads_kv) * GROUP * sparse[4]
        kt = gl.load(sparse[2] + sparse_row + position)
        sparse_row += kt
        n0 = kt * BN
    elif CAUSAL and PERSISTENT:
        w = w_first + (i // 2) * w_step
        n_pairs = n_key_tiles // 2
        bh = w // n_pairs
        p = w % n_pairs
        n0 = (p + (i % 2) * (n_key_tiles - 1 - 2 * p)) * BN   # the long tile first
    else:
        w = w_first + i * w_step
        bh = w // n_key_tiles
        n0 = (w % n_key_tiles) * BN
    batch = bh // num_heads_kv
    kv_head = bh % num_heads_kv
    i_start, n_local, n_mask, n_tail = _query_tiles(n0, seqlen_q, diag, window_left, BM, BN, CAUSAL, WINDOW)
    plain_lo = n_mask
    plain_hi = n_tail
    if SEGMENTS:
        ranges = SEGMENT_RANGES + (batch.to(gl.int64) * n_key_tiles + n0 // BN) * 4
        first = gl.maximum(i_start, gl.load(ranges) // BM)
        end = gl.maximum(gl.minimum(i_start + n_local, gl.cdiv(gl.load(ranges + 1), BM)), first)
        # the band's unmasked tiles [i_start + n_mask, i_start + n_tail), cut to the pure run
        pure_first = gl.maximum(i_start + n_mask, gl.load(ranges + 2) // BM)
        pure_end = gl.minimum(i_start + n_tail, gl.load(ranges + 3) // BM)
        n_local = end - first
        plain_lo = gl.minimum(gl.maximum(pure_first - first, 0), n_local)
        plain_hi = gl.minimum(gl.maximum(pure_end - first, plain_lo), n_local)
        i_start = first
    if PERSISTENT:
        q_row = batch * seqlen_q
        k_row = batch * seqlen_k + n0
        q_col = kv_head * (GROUP * HEAD_DIM)
        k_col = kv_head * HEAD_DIM
        lse_row = bh * GROUP
    else:
        q_row = n0 * 0
        k_row = n0
        q_col = n0 * 0
        k_col = n0 * 0
        lse_row = n0 * 0
    return batch, kv_head, n0, q_row, k_row, q_col, k_col, lse_row, i_start, n_local, plain_lo, plain_hi, sparse_row


@gluon.jit
def _sparse_query_tiles(sparse, sparse_row, g, BM: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr,
                        SPARSE_RUNS: gl.constexpr):
    """(query tiles to visit, the layout's list, the first query tile) for query head g of a key tile's
    group (_work_item's layout row): each listed block is SPARSE_BLOCK_Q // BM query tiles
    (_query_tile).  SPARSE_RUNS: every row of the layout is one run of blocks (windows, documents),
    so the first is all _query_tile needs."""
    row = sparse_row + g * sparse[4]
    LIST = sparse[1] + row.to(gl.int64) * sparse[5]
    first = row * 0
    if SPARSE_RUNS:
        first = gl.load(LIST) * (SPARSE_BLOCK_Q // BM)
    return gl.load(sparse[0] + row) * (SPARSE_BLOCK_Q // BM), LIST, first


@gluon.jit
def _query_tile(j, first, LIST, BM: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr, SPARSE_RUNS: gl.constexpr):
    """The j-th query tile a key tile visits: first + j (dense: first is the band's first tile), or
    block-sparse lists, the j-th of its list's blocks' tiles."""
    if SPARSE_BLOCK_Q > 0 and not SPARSE_RUNS:
        R: gl.constexpr = SPARSE_BLOCK_Q // BM
        return gl.load(LIST + j // R) * R + j % R
    else:
        return first + j


@gluon.jit
def _stage_tile(q_bufs, do_bufs, s, DO: gl.constexpr, dtype: gl.constexpr, BM: gl.constexpr,
                BLOCK_D: gl.constexpr, WIDE: gl.constexpr):
    """Q_i (DO false) or dO_i (DO true) of ring stage s.  WIDE: a half of the stage's fp32 [BM, D] buffer,
    which then stages the tile's dQ_i (_tile), so q_bufs is that buffer (do_bufs too)."""
    if WIDE:
        pair = q_bufs.index(s)._reinterpret(dtype, [2, BM, BLOCK_D],
                                            gl.NVMMASharedLayout.get_default_for([BM, BLOCK_D], dtype))
        return pair.index(1 if DO else 0)
    elif DO:
        return do_bufs.index(s)
    else:
        return q_bufs.index(s)


@gluon.jit
def _load_stage(desc, row, col, bar, q_bufs, do_bufs, s, DO: gl.constexpr, dtype: gl.constexpr, HEAD_DIM: gl.constexpr,
                BLOCK_D: gl.constexpr, BM: gl.constexpr, WIDE: gl.constexpr):
    """TMA-load Q_i (DO false) or dO_i into ring stage s (_stage_tile) where the tiles are WIDE or padded.  (The
    D = 64 and 128 kernels index their buffers in place: a call there reorders their SASS.)"""
    buf = _stage_tile(q_bufs, do_bufs, s, DO, dtype, BM, BLOCK_D, WIDE)
    if BLOCK_D == HEAD_DIM:
        tma.async_copy_global_to_shared(desc, [row, col], bar, buf)
    else:
        load_rows(desc, row, col // HEAD_DIM, bar, buf, HEAD_DIM, BLOCK_D)


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_bufs, do_bufs,
                    lse_bufs, delta_bufs, kv_ready, kv_empty, q_ready, do_ready, qdo_empty, w_first, w_end, w_step,
                    seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse, HEAD_DIM: gl.constexpr,
                    BLOCK_D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                    GROUP: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, WINDOW: gl.constexpr,
                    SEGMENTS: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr, SPARSE_RUNS: gl.constexpr):
    WIDE: gl.constexpr = BLOCK_D > 128
    r = 0  # ring position: tiles so far, counted alike in every partition
    for i in range(_item_count(w_first, w_end, w_step, PERSISTENT and (CAUSAL or SPARSE_BLOCK_Q > 0))):
        _, _, _, q_row, k_row, q_col, k_col, lse_row, i_start, n_local, _, _, sparse_row = _work_item(
            i, w_first, w_step, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse, BM, BN,
            GROUP, HEAD_DIM, CAUSAL, PERSISTENT, WINDOW, SEGMENTS, SPARSE_BLOCK_Q)
        mbarrier.wait(kv_empty, (i & 1) ^ 1)  # the previous key tile's K, V are read (fresh: passes)
        mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        if BLOCK_D == HEAD_DIM:
            tma.async_copy_global_to_shared(k_desc, [k_row, k_col], kv_ready, k_smem)
            tma.async_copy_global_to_shared(v_desc, [k_row, k_col], kv_ready, v_smem)
        else:
            load_rows(k_desc, k_row, k_col // HEAD_DIM, kv_ready, k_smem, HEAD_DIM, BLOCK_D)
            load_rows(v_desc, k_row, k_col // HEAD_DIM, kv_ready, v_smem, HEAD_DIM, BLOCK_D)
        LIST = sparse[1]
        first = i_start
        for g in range(GROUP):
            if SPARSE_BLOCK_Q > 0:
                n_local, LIST, first = _sparse_query_tiles(sparse, sparse_row, g, BM, SPARSE_BLOCK_Q, SPARSE_RUNS)
            for j in range(n_local):
                s = r % STAGES
                mbarrier.wait(qdo_empty.index(s), ((r // STAGES) & 1) ^ 1)
                m0 = _query_tile(j, first, LIST, BM, SPARSE_BLOCK_Q, SPARSE_RUNS) * BM
                # lse rides with Q (needed for P), delta with dO (needed for dS)
                mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
                if WIDE or BLOCK_D != HEAD_DIM:
                    _load_stage(q_desc, q_row + m0, q_col + g * HEAD_DIM, q_ready.index(s), q_bufs, do_bufs, s, False,
                                k_smem.dtype, HEAD_DIM, BLOCK_D, BM, WIDE)
                else:
                    tma.async_copy_global_to_shared(q_desc, [q_row + m0, q_col + g * HEAD_DIM], q_ready.index(s),
                                                    q_bufs.index(s))
                tma.async_copy_global_to_shared(lse_desc, [lse_row + g, m0], q_ready.index(s), lse_bufs.index(s))
                mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
                if WIDE or BLOCK_D != HEAD_DIM:
                    _load_stage(do_desc, q_row + m0, q_col + g * HEAD_DIM, do_ready.index(s), q_bufs, do_bufs, s, True,
                                k_smem.dtype, HEAD_DIM, BLOCK_D, BM, WIDE)
                else:
                    tma.async_copy_global_to_shared(do_desc, [q_row + m0, q_col + g * HEAD_DIM], do_ready.index(s),
                                                    do_bufs.index(s))
                tma.async_copy_global_to_shared(delta_desc, [lse_row + g, m0], do_ready.index(s),
                                                delta_bufs.index(s))
                r += 1


@gluon.jit
def _dq_partition(dq_desc, dq_bufs, dq_ready, dq_empty, w_first, w_end, w_step, seqlen_q, seqlen_k, num_heads_kv,
                  diag, window_left, SEGMENT_RANGES, sparse, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                  BM: gl.constexpr, BN: gl.constexpr, DQ_BUFS: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                  PERSISTENT: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr,
                  SPARSE_RUNS: gl.constexpr):
    r = 0
    for i in range(_item_count(w_first, w_end, w_step, PERSISTENT and (CAUSAL or SPARSE_BLOCK_Q > 0))):
        _, _, _, q_row, _, q_col, _, _, i_start, n_local, _, _, sparse_row = _work_item(
            i, w_first, w_step, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse, BM, BN,
            GROUP, HEAD_DIM, CAUSAL, PERSISTENT, WINDOW, SEGMENTS, SPARSE_BLOCK_Q)
        LIST = sparse[1]
        first = i_start
        for g in range(GROUP):
            if SPARSE_BLOCK_Q > 0:
                n_local, LIST, first = _sparse_query_tiles(sparse, sparse_row, g, BM, SPARSE_BLOCK_Q, SPARSE_RUNS)
            for j in range(n_local):
                b = r % DQ_BUFS
                mbarrier.wait(dq_ready.index(b), (r // DQ_BUFS) & 1)
                m0 = _query_tile(j, first, LIST, BM, SPARSE_BLOCK_Q, SPARSE_RUNS) * BM
                if BLOCK_D == HEAD_DIM:
                    _tma_reduce_add(dq_desc, [q_row + m0, q_col + g * HEAD_DIM], dq_bufs.index(b))
                else:   # (rows, heads, dims): the reduce skips the columns past HEAD_DIM
                    _tma_reduce_add(dq_desc, [q_row + m0, q_col // HEAD_DIM + g, 0],
                                    dq_bufs.index(b)._reinterpret(gl.float32, [BM, 1, BLOCK_D], dq_desc.layout))
                tma.store_wait(0)  # the shared tile has been read: its buffer may be refilled
                mbarrier.arrive(dq_empty.index(b), count=1)
                r += 1
    tma.store_wait(0)


@gluon.jit
def _fetch_next_scores(bias_buf, BIAS_HEAD, mask_buf, MASK_HEAD, bias_stride_s, mask_stride_s, m0, n0, seqlen_q,
                       seqlen_k, BM: gl.constexpr, BN: gl.constexpr, NUM_WARPS: gl.constexpr,
                       HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr):
    """Start copying the [BM, BN] tiles at (m0, n0) of the bias and the mask (rows = queries) into
    their buffers, one commit group (gluon_shared.copy_score_tile): runs of 8 keys a thread, a warp's lanes
    across a row's BN keys."""
    layout: gl.constexpr = score_copy_layout(BN, NUM_WARPS)
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    rows_ok = rows < seqlen_q - m0
    if HAS_BIAS:
        copy_score_tile(bias_buf, BIAS_HEAD + gl.multiple_of(m0.to(gl.int64) * bias_stride_s, [8]), rows,
                        bias_stride_s, rows_ok, n0, seqlen_k, BN, layout)
    if HAS_MASK:
        copy_score_tile(mask_buf, MASK_HEAD + gl.multiple_of(m0.to(gl.int64) * mask_stride_s, [8]), rows,
                        mask_stride_s, rows_ok, n0, seqlen_k, BN, layout)
    async_copy.commit_group()


@gluon.jit
def _tile(r, r_first, m0, n0, masked, diag, window_left, dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs,
          ds_smem, dq_bufs, q_ready, do_ready, qdo_empty, dq_ready, dq_empty, qk_scale, sm_scale, zero_s, zero_dq,
          seqlen_q, seqlen_k, k_ids, QSEG_ROW, cap_in, BIAS_HEAD, bias_stride_s, bias_in, bias_buf, MASK_HEAD,
          mask_stride_s, mask_buf, dropout, BLOCK_D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
          STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, NUM_WARPS: gl.constexpr, MASK: gl.constexpr,
          DS_BUFS: gl.constexpr, WINDOW: gl.constexpr, CAUSAL: gl.constexpr, SEGMENTS: gl.constexpr,
          SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr, DROPOUT: gl.constexpr):
    """One (key tile, query tile m0) step at ring position r.  MASK (and at run time `masked`, which
    the block-sparse loop decides per tile): the tile straddles the diagonal
    or, WINDOW, the window's far edge, or, SEGMENTS, lies outside the key tile's one-id run (then
    the keys' ids k_ids and the queries' ids, from QSEG_ROW, are compared).  SOFTCAP: the scores are
    capped (cap_in = scale / cap; qk_scale is then cap * log2 e), as in the Gluon forward.
    HAS_BIAS, HAS_MASK: the (query head's) bias and attention mask tiles, copied into bias_buf and
    mask_buf while S^T is computed, join as in the Gluon forward (gluon_shared.copy_score_tile): the
    bias in S's units (bias_in = 1 / scale) before the cap, the mask (0 / 1) zeroing P^T.
    DROPOUT: `dropout` = (seed, batch * Hq + query head, threshold, 1 / (1 - p)): dV takes the kept
    probabilities (rules.dropout_keep, the forward's hash; the caller scales dV by 1 / (1 - p)), and
    dS = P (dP - delta) takes dP only where kept, times 1 / (1 - p).  Which entries are kept rides in
    P^T's sign bit from the dV GEMM to dS (P >= 0), so no mask tile stays live across the dP^T wait.
    WIDE (D > 128: 64 keys, two warpgroups on each half of dK's, dV's and dQ_i's columns): each warpgroup
    computes half of S^T's and dP^T's query columns, so dS^T and P^T go to shared memory (ds_smem's two
    buffers) and the three GEMMs read them from there once both halves are in.  The tile ends with every GEMM
    done in both warpgroups: dQ_i, scaled, is then staged in the stage's own buffer (dq_bufs is q_bufs:
    _stage_tile), and the dQ warp gives the stage back to the load warp after its reduce-add (dq_empty is
    qdo_empty).  At D = 256 the fp32 dQ_i tile (64 KB) fits nowhere else beside K, V and two stages."""
    WIDE: gl.constexpr = BLOCK_D > 128
    s_layout: gl.constexpr = mma_layout(BN, BM, NUM_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout(BN, BLOCK_D, NUM_WARPS),
                                                 k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    dtype: gl.constexpr = k_smem.dtype
    s = r % STAGES
    ph = (r // STAGES) & 1
    q_buf = _stage_tile(q_bufs, do_bufs, s, False, dtype, BM, BLOCK_D, WIDE)
    do_buf = _stage_tile(q_bufs, do_bufs, s, True, dtype, BM, BLOCK_D, WIDE)

    if HAS_BIAS or HAS_MASK:   # (every warp read the previous tile's before that tile's barrier)
        _fetch_next_scores(bias_buf, BIAS_HEAD, mask_buf, MASK_HEAD, bias_stride_s, mask_stride_s, m0, n0,
                           seqlen_q, seqlen_k, BM, BN, NUM_WARPS, HAS_BIAS, HAS_MASK)
    mbarrier.wait(q_ready.index(s), ph)
    st = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpt = warpgroup_mma(v_smem, do_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    lse = lse_bufs.index(s)._reinterpret(gl.float32, [BM], vec_layout).load(col_layout) * 1.4426950408889634
    # The previous tile's dK GEMM is still in flight here; this wait retires it too (in order).
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    if HAS_BIAS or HAS_MASK:
        scores_landed()
    if HAS_BIAS:
        st = st + bias_buf.permute((1, 0)).load(s_layout).to(gl.float32) * bias_in
    if SOFTCAP != 0:
        tt = capped_tanh(st * cap_in, SOFTCAP)
        pt = gl.exp2(tt * qk_scale - gl.expand_dims(lse, 0))
    else:
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if MASK:  # S^T[key n, query m]: masked before any use (lse may be inf there)
        if masked:
            keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
            rows = m0 + gl.arange(0, BM, layout=col_layout)
            # keys past the end (a partial last key tile; TMA reads them as zeros, so P = exp(-lse) there)
            ok = gl.expand_dims(keys < seqlen_k, 1) & gl.expand_dims(rows < seqlen_q, 0)
            if CAUSAL:   # keep n <= m + diag
                queries = rows + diag
                ok = ok & (gl.expand_dims(keys, 1) <= gl.expand_dims(queries, 0))
                if WINDOW:
                    ok = ok & (gl.expand_dims(keys, 1) >= gl.expand_dims(queries - window_left, 0))
            if SEGMENTS:
                q_ids = gl.load(QSEG_ROW + rows, mask=rows < seqlen_q, other=-2)
                ok = ok & (gl.expand_dims(k_ids, 1) == gl.expand_dims(q_ids, 0))
            pt = gl.where(ok, pt, 0.0)
    if HAS_MASK:   # (lse may be -inf in a row the mask hides whole: P^T is inf there, before this)
        pt = masked_bits(pt, mask_buf.permute((1, 0)).load(s_layout), 0)
    if DROPOUT:   # dropped entries: -P^T
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        row_hash = dropout_row_hash(dropout[0], dropout[1], m0 + gl.arange(0, BM, layout=col_layout))
        pt = gl.where(dropout_keep(row_hash, keys, dropout[2], True), pt, -pt)
        pt16 = gl.maximum(pt, 0.0).to(dtype)
    else:
        pt16 = pt.to(dtype)
    if WIDE:
        pt_buf = ds_smem.index(1)
        pt_buf.store(pt16)
    else:
        dv = warpgroup_mma(gl.convert_layout(pt16, a_layout), do_buf, dv, is_async=True)
    if SOFTCAP != 0:   # dS = P (dP - delta) (1 - T^2): T's registers are free once this is folded in
        pt = pt * (1.0 - tt * tt)
    delta = delta_bufs.index(s)._reinterpret(gl.float32, [BM], vec_layout).load(col_layout)
    dpt = warpgroup_mma_wait(num_outstanding=0 if WIDE else 1, deps=(dpt, ))
    if DROPOUT:   # (a dropped entry of P = 0 is -0.0: its dS is 0 whichever dP it takes)
        dst16 = (gl.abs(pt) * (gl.where(pt < 0.0, 0.0, dpt * dropout[3]) - gl.expand_dims(delta, 0))).to(dtype)
    else:
        dst16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
    ds_buf = ds_smem.index(r % DS_BUFS)
    ds_buf.store(dst16)
    fence_async_shared()
    partition_barrier()  # both warpgroups' halves of dS^T are in shared memory before either reads it all
    if WIDE:   # (the previous tile's GEMMs, which read P^T's and dS^T's buffers, ended before its last barrier)
        dv = warpgroup_mma(pt_buf, do_buf, dv, is_async=True)
        dk = warpgroup_mma(ds_buf, q_buf, dk, is_async=True)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, dq))
        partition_barrier()   # every GEMM of the tile has read Q_i and dO_i: their buffer takes dQ_i
        dq_bufs.index(s).store(dq * sm_scale)
        fence_async_shared()
        partition_barrier()
        mbarrier.arrive(dq_ready.index(s), count=1)
    else:
        # Both warpgroups are past their S wait, so the previous tile's dK GEMM (its Q's last reader) is done.
        mbarrier.arrive(qdo_empty.index((r + STAGES - 1) % STAGES), count=1, pred=r > 0)
        if DS_BUFS == 2:
            # ... and past the previous tile's dQ store: hand that to the dQ warp.
            mbarrier.arrive(dq_ready.index((r + DQ_BUFS - 1) % DQ_BUFS), count=1, pred=r > r_first)
        dq = warpgroup_mma(ds_buf.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_buf, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))  # dK stays in flight

        b = r % DQ_BUFS
        mbarrier.wait(dq_empty.index(b), ((r // DQ_BUFS) & 1) ^ 1)
        dq_bufs.index(b).store(dq * sm_scale)
        fence_async_shared()
        if DS_BUFS == 1:
            partition_barrier()  # every warp's dQ GEMM of this tile is done: dS^T's buffer (and K) are free
            mbarrier.arrive(dq_ready.index(b), count=1)
    return dk, dv


@gluon.jit
def _compute_partition(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, kv_ready, kv_empty,
                       q_ready, do_ready, qdo_empty, dq_ready, dq_empty, DK, DV, stride_dkb, stride_dks, stride_dkh,
                       stride_dvb, stride_dvs, stride_dvh, w_first, w_end, w_step, seqlen_q, seqlen_k, num_heads_kv,
                       diag, window_left, qk_scale, sm_scale, QSEG, KSEG, SEGMENT_RANGES, sparse, seg_stride_qb,
                       seg_stride_kb, cap_in, BIAS, bias_strides, bias_in, bias_buf, MASK, mask_strides, mask_buf,
                       DROPOUT_SEED, dropout_threshold, dropout_scale, HEAD_DIM: gl.constexpr,
                       BLOCK_D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                       DQ_BUFS: gl.constexpr, GROUP: gl.constexpr,
                       NUM_WARPS: gl.constexpr, CAUSAL: gl.constexpr, PERSISTENT: gl.constexpr, DS_BUFS: gl.constexpr,
                       WINDOW: gl.constexpr, SEGMENTS: gl.constexpr, SOFTCAP: gl.constexpr, EVEN_K: gl.constexpr,
                       HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr, SPARSE_BLOCK_Q: gl.constexpr,
                       SPARSE_RUNS: gl.constexpr, DROPOUT: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(BN, BM, NUM_WARPS)         # S^T, dP^T: [BN, BM]
    kv_layout: gl.constexpr = mma_layout(BN, BLOCK_D, NUM_WARPS)  # dK, dV: [BN, D] (D padded to BLOCK_D)
    dq_layout: gl.constexpr = mma_layout(BM, BLOCK_D, NUM_WARPS)  # dQ_i: [BM, D]
    zero_s = gl.zeros([BN, BM], gl.float32, s_layout)
    zero_dq = gl.zeros([BM, BLOCK_D], gl.float32, dq_layout)
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
    cols = gl.expand_dims(gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, kv_layout)), 0)
    dropout_seed = 0
    if DROPOUT:
        dropout_seed = gl.load(DROPOUT_SEED)
    r = 0
    for i in range(_item_count(w_first, w_end, w_step, PERSISTENT and (CAUSAL or SPARSE_BLOCK_Q > 0))):
        batch, kv_head, n0, _, _, _, _, _, i_start, n_local, plain_lo, plain_hi, sparse_row = _work_item(
            i, w_first, w_step, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse, BM, BN,
            GROUP, HEAD_DIM, CAUSAL, PERSISTENT, WINDOW, SEGMENTS, SPARSE_BLOCK_Q)
        k_ids = 0
        qseg_row = QSEG
        if SEGMENTS:   # the key tile's ids, one per row of S^T (past the keys: -1, the queries' padding -2)
            keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
            k_ids = gl.load(KSEG + batch.to(gl.int64) * seg_stride_kb + keys, mask=keys < seqlen_k, other=-1)
            qseg_row = QSEG + batch.to(gl.int64) * seg_stride_qb
        if BLOCK_D > 128:   # (WIDE: every tile retires its dK GEMM, _tile)
            dk = gl.zeros([BN, BLOCK_D], gl.float32, kv_layout)
        else:
            dk = warpgroup_mma_init(gl.zeros([BN, BLOCK_D], gl.float32, kv_layout))  # an in-flight wgmma accumulator
        dv = gl.zeros([BN, BLOCK_D], gl.float32, kv_layout)
        r_first = r
        mbarrier.wait(kv_ready, i & 1)
        if not EVEN_K:
            # a partial last key tile: every query tile masked, so that its keys past the end (zeros from
            # TMA, P = exp(-lse) there: an inf dS in 16 bits where lse is very negative) count for nothing
            partial = n0 + BN > seqlen_k
            plain_lo = gl.where(partial, 0, plain_lo)
            plain_hi = gl.where(partial, 0, plain_hi)
        for g in range(GROUP):
            head = (kv_head * GROUP + g).to(gl.int64)
            bias_head = BIAS + gl.multiple_of(batch.to(gl.int64) * bias_strides[0] + head * bias_strides[1], [8])
            mask_head = MASK + gl.multiple_of(batch.to(gl.int64) * mask_strides[0] + head * mask_strides[1], [8])
            dropout = (dropout_seed, batch * (num_heads_kv * GROUP) + kv_head * GROUP + g, dropout_threshold,
                       dropout_scale)
            if SPARSE_BLOCK_Q > 0:
                # the listed query tiles: unmasked only inside the rules' unmasked run (_work_item)
                n_visit, LIST, first = _sparse_query_tiles(sparse, sparse_row, g, BM, SPARSE_BLOCK_Q, SPARSE_RUNS)
                for j in range(n_visit):
                    t = _query_tile(j, first, LIST, BM, SPARSE_BLOCK_Q, SPARSE_RUNS)
                    dk, dv = _tile(r, r_first, t * BM, n0, (t < i_start + plain_lo) | (t >= i_start + plain_hi), diag,
                                   window_left, dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem,
                                   dq_bufs, q_ready, do_ready, qdo_empty, dq_ready, dq_empty, qk_scale, sm_scale,
                                   zero_s, zero_dq, seqlen_q, seqlen_k, k_ids, qseg_row, cap_in, bias_head,
                                   bias_strides[2], bias_in, bias_buf, mask_head, mask_strides[2], mask_buf, dropout,
                                   BLOCK_D, BM, BN, STAGES, DQ_BUFS, NUM_WARPS, True, DS_BUFS, WINDOW, CAUSAL,
                                   SEGMENTS, SOFTCAP, HAS_BIAS, HAS_MASK, DROPOUT)
                    r += 1
            else:
                # masked tiles (the diagonal; with segment ids, also those outside the key tile's one-id run),
                # unmasked ones, masked ones (the window's far edge; segment ids; a partial key tile's):
                # _work_item's bounds
                if CAUSAL or SEGMENTS:
                    for j in range(plain_lo):
                        dk, dv = _tile(r, r_first, (i_start + j) * BM, n0, True, diag, window_left, dk, dv, k_smem,
                                       v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, q_ready,
                                       do_ready, qdo_empty, dq_ready, dq_empty, qk_scale, sm_scale, zero_s, zero_dq,
                                       seqlen_q, seqlen_k, k_ids, qseg_row, cap_in, bias_head, bias_strides[2], bias_in,
                                       bias_buf, mask_head, mask_strides[2], mask_buf, dropout, BLOCK_D, BM, BN,
                                       STAGES, DQ_BUFS, NUM_WARPS, True, DS_BUFS, WINDOW, CAUSAL, SEGMENTS, SOFTCAP,
                                       HAS_BIAS, HAS_MASK, DROPOUT)
                        r += 1
                for j in range(plain_lo, plain_hi):
                    dk, dv = _tile(r, r_first, (i_start + j) * BM, n0, True, diag, window_left, dk, dv, k_smem, v_smem,
                                   q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, q_ready, do_ready,
                                   qdo_empty, dq_ready, dq_empty, qk_scale, sm_scale, zero_s, zero_dq, seqlen_q,
                                   seqlen_k, k_ids, qseg_row, cap_in, bias_head, bias_strides[2], bias_in, bias_buf,
                                   mask_head, mask_strides[2], mask_buf, dropout, BLOCK_D, BM, BN, STAGES, DQ_BUFS,
                                   NUM_WARPS, False, DS_BUFS, WINDOW, CAUSAL, SEGMENTS, SOFTCAP, HAS_BIAS, HAS_MASK,
                                   DROPOUT)
                    r += 1
                if WINDOW or SEGMENTS or not EVEN_K:
                    for j in range(plain_hi, n_local):
                        dk, dv = _tile(r, r_first, (i_start + j) * BM, n0, True, diag, window_left, dk, dv, k_smem,
                                       v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, q_ready,
                                       do_ready, qdo_empty, dq_ready, dq_empty, qk_scale, sm_scale, zero_s, zero_dq,
                                       seqlen_q, seqlen_k, k_ids, qseg_row, cap_in, bias_head, bias_strides[2], bias_in,
                                       bias_buf, mask_head, mask_strides[2], mask_buf, dropout, BLOCK_D, BM, BN,
                                       STAGES, DQ_BUFS, NUM_WARPS, True, DS_BUFS, WINDOW, CAUSAL, SEGMENTS, SOFTCAP,
                                       HAS_BIAS, HAS_MASK, DROPOUT)
                        r += 1
        if DS_BUFS == 2:
            # The key tile's last dQ store is done in both warpgroups, and every read of K and V.
            partition_barrier()
            mbarrier.arrive(dq_ready.index((r + DQ_BUFS - 1) % DQ_BUFS), count=1, pred=r > r_first)
        # Every read of K and V is done (the last tile's barrier): the load warp may refill them.
        mbarrier.arrive(kv_empty, count=1)
        if BLOCK_D <= 128:
            dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))
        in_bounds = gl.expand_dims(n0 + rows < seqlen_k, 1) & (cols < HEAD_DIM)
        key_rows = gl.expand_dims((n0 + rows).to(gl.int64), 1)
        b64 = batch.to(gl.int64)
        gl.store(DK + b64 * stride_dkb + kv_head * stride_dkh + key_rows * stride_dks + cols,
                 (dk * sm_scale).to(DK.dtype.element_ty), mask=in_bounds)
        if DROPOUT:   # dV took the kept probabilities unscaled (_tile)
            dv = dv * dropout_scale
        gl.store(DV + b64 * stride_dvb + kv_head * stride_dvh + key_rows * stride_dvs + cols,
                 dv.to(DV.dtype.element_ty), mask=in_bounds)


@gluon.jit(do_not_specialize=ONE_PASS_INTS)
def flash_bwd_one_pass_kernel(
    Q, K, V, DO, LSE, DELTA, QSEG, KSEG, SEGMENT_RANGES, BIAS, MASK, SPARSE_Q_COUNT, SPARSE_Q_INDEX, SPARSE_K_ORDER,
    DROPOUT_SEED, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, stride_dqb, stride_dqs, stride_dqh,
    batch, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, num_work, sm_scale, seg_stride_qb, seg_stride_kb,
    softcap, bias_stride_b, bias_stride_h, bias_stride_s, mask_stride_b, mask_stride_h, mask_stride_s,
    sparse_kstride_b, sparse_kstride_h, num_q_blocks, dropout_threshold, dropout_scale,
    DK, DV, DQ_ACCUM, DESC_SCRATCH,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, GROUP_SIZE: gl.constexpr, NUM_WARPS: gl.constexpr,
    CAUSAL: gl.constexpr,
    PERSISTENT: gl.constexpr, DS_BUFS: gl.constexpr, WINDOW: gl.constexpr, SEGMENTS: gl.constexpr,
    SOFTCAP: gl.constexpr, EVEN_K: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr,
    SPARSE_BLOCK_Q: gl.constexpr, SPARSE_RUNS: gl.constexpr, DROPOUT: gl.constexpr,
):
    # Grid: (key tiles, batch * KV heads), one program per work item (_work_item), so that one head's
    # key tiles run side by side and stream the same Q / dO tiles through L2 (heads first, nothing is
    # shared).  PERSISTENT: (programs,), each takes items w = pid, pid +
    # programs, ... < num_work (causal: pairs of key tiles of equal total work) and builds its
    # descriptors once, over whole arrays (plan: Sq, Sk tile multiples, (batch, seq) rows and heads
    # side by side), where a program per item builds its seven again (docs/lessons.md, "Persistent launches").
    # DESC_SCRATCH: where jax-triton launches keep the descriptors (jax_api/_scratch.py); Triton's
    # launcher brings its own scratch.  SPARSE_BLOCK_Q: a block-sparse layout of SPARSE_BLOCK_Q x BLOCK_N
    # blocks (dualattn.SparseMask's query-block lists, _work_item), 0 where there is none; SPARSE_RUNS:
    # its every key block's query blocks are one run (_sparse_query_tiles).  DROPOUT: DROPOUT_SEED holds the
    # seed (int32, shape (1,)); the forward's entries are dropped (_tile).  BLOCK_D: the tiles' width, HEAD_DIM
    # or, for head dims between the widths (96, 192), the next one (plan: hopper.gluon_tile_width).
    dtype: gl.constexpr = Q.dtype.element_ty
    MASK = mask_as_int8(MASK)   # (a bool mask's bytes)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    dq_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_D], gl.float32)
    vec_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    heads_q = num_heads_kv * GROUP_SIZE
    if PERSISTENT:
        w_first = gl.program_id(0)
        w_end = num_work
        w_step = gl.num_programs(0)
        q_rows = batch * seqlen_q
        k_rows = batch * seqlen_k
        lse_rows = batch * heads_q
        q_cols = heads_q * HEAD_DIM
        k_cols = num_heads_kv * HEAD_DIM
        q_base = 0
        o_base = 0
        k_base = 0
        v_base = 0
        dq_base = 0
        lse_base = 0
    else:
        w_first = gl.program_id(1) * gl.num_programs(0) + gl.program_id(0)
        w_end = w_first + 1
        w_step = 1
        b64 = (gl.program_id(1) // num_heads_kv).to(gl.int64)
        kv_head = gl.program_id(1) % num_heads_kv
        q_head = kv_head * GROUP_SIZE
        q_rows = seqlen_q
        k_rows = seqlen_k
        lse_rows = GROUP_SIZE
        q_cols = GROUP_SIZE * HEAD_DIM  # the group's query heads side by side (stride_qh == HEAD_DIM)
        k_cols = HEAD_DIM
        q_base = b64 * stride_qb + q_head * stride_qh
        o_base = b64 * stride_ob + q_head * stride_oh
        k_base = b64 * stride_kb + kv_head * stride_kh
        v_base = b64 * stride_vb + kv_head * stride_vh
        dq_base = b64 * stride_dqb + q_head * stride_dqh
        lse_base = b64 * stride_lse_b + q_head * stride_lse_h
    if BLOCK_D == HEAD_DIM:
        q_desc = tma.make_tensor_descriptor(Q + q_base, [q_rows, q_cols], [stride_qs, 1], [BLOCK_M, HEAD_DIM], q_layout)
        do_desc = tma.make_tensor_descriptor(DO + o_base, [q_rows, q_cols], [stride_os, 1], [BLOCK_M, HEAD_DIM],
                                             q_layout)
        dq_desc = tma.make_tensor_descriptor(DQ_ACCUM + dq_base, [q_rows, q_cols], [stride_dqs, 1],
                                             [BLOCK_M, HEAD_DIM], dq_layout)
        k_desc = tma.make_tensor_descriptor(K + k_base, [k_rows, k_cols], [stride_ks, 1], [BLOCK_N, HEAD_DIM],
                                            kv_layout)
        v_desc = tma.make_tensor_descriptor(V + v_base, [k_rows, k_cols], [stride_vs, 1], [BLOCK_N, HEAD_DIM],
                                            kv_layout)
    else:
        # (rows, heads, dims): a tile's columns past HEAD_DIM are TMA's zeros on loads and skipped by dQ's
        # reduce-adds (gluon_shared.load_rows), so they add nothing to S, dP or dQ; dK and dV's stores leave them out
        q3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, BLOCK_D], dtype)
        kv3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 1, BLOCK_D], dtype)
        dq3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, 1, BLOCK_D], gl.float32)
        q_heads = q_cols // HEAD_DIM
        k_heads = k_cols // HEAD_DIM
        q_desc = tma.make_tensor_descriptor(Q + q_base, [q_rows, q_heads, HEAD_DIM], [stride_qs, stride_qh, 1],
                                            [BLOCK_M, 1, BLOCK_D], q3_layout)
        do_desc = tma.make_tensor_descriptor(DO + o_base, [q_rows, q_heads, HEAD_DIM], [stride_os, stride_oh, 1],
                                             [BLOCK_M, 1, BLOCK_D], q3_layout)
        dq_desc = tma.make_tensor_descriptor(DQ_ACCUM + dq_base, [q_rows, q_heads, HEAD_DIM],
                                             [stride_dqs, stride_dqh, 1], [BLOCK_M, 1, BLOCK_D], dq3_layout)
        k_desc = tma.make_tensor_descriptor(K + k_base, [k_rows, k_heads, HEAD_DIM], [stride_ks, stride_kh, 1],
                                            [BLOCK_N, 1, BLOCK_D], kv3_layout)
        v_desc = tma.make_tensor_descriptor(V + v_base, [k_rows, k_heads, HEAD_DIM], [stride_vs, stride_vh, 1],
                                            [BLOCK_N, 1, BLOCK_D], kv3_layout)
    lse_desc = tma.make_tensor_descriptor(LSE + lse_base, [lse_rows, seqlen_q], [stride_lse_h, 1], [1, BLOCK_M],
                                          vec_layout)
    delta_desc = tma.make_tensor_descriptor(DELTA + lse_base, [lse_rows, seqlen_q], [stride_lse_h, 1], [1, BLOCK_M],
                                            vec_layout)

    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_D], kv_layout)
    # WIDE (D > 128, 64-key tiles): K, V (64 KB) and two stages of Q and dO (128 KB) leave no room for an fp32
    # dQ_i tile (64 KB), so each stage's Q_i and dO_i are the halves of one fp32 tile that stages dQ_i (_tile).
    WIDE: gl.constexpr = BLOCK_D > 128
    gl.static_assert(not WIDE or (DS_BUFS == 1 and DQ_BUFS == STAGES), "WIDE: dQ_i staged in the Q and dO stages")
    if WIDE:
        q_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M, BLOCK_D], dq_layout)
        do_bufs = q_bufs
    else:
        q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
        do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_D], q_layout)
    lse_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], vec_layout)
    delta_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, 1, BLOCK_M], vec_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2 if WIDE else DS_BUFS, BLOCK_N, BLOCK_M], ds_layout)
    if WIDE:
        dq_bufs = q_bufs
    else:
        dq_bufs = gl.allocate_shared_memory(gl.float32, [DQ_BUFS, BLOCK_M, BLOCK_D], dq_layout)

    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    if WIDE:   # the dQ warp's reduce-add is the stage's last reader (_tile)
        dq_empty = qdo_empty
    else:
        dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    mbarrier.init(kv_empty, count=1)
    for j in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(j), count=1)
        mbarrier.init(do_ready.index(j), count=1)
        mbarrier.init(qdo_empty.index(j), count=1)
    for j in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_ready.index(j), count=1)
        if not WIDE:
            mbarrier.init(dq_empty.index(j), count=1)
    fence_async_shared()

    qk_scale = sm_scale * 1.4426950408889634
    # The soft cap's constants, as the Gluon forward's: cap * tanh(qk * scale / cap) in log2 units.
    cap_in = sm_scale / softcap
    if SOFTCAP != 0:
        qk_scale = softcap * 1.4426950408889634
    # A bias and an attention mask (with no dbias to write: plan.one_pass_backward): a tile of each per
    # query tile, rows swizzled in 16-byte units (a token buffer where absent).
    bias_in = 1.0 / sm_scale
    bias_strides = (bias_stride_b, bias_stride_h, bias_stride_s)
    mask_strides = (mask_stride_b, mask_stride_h, mask_stride_s)
    bias_ty: gl.constexpr = BIAS.dtype.element_ty
    mask_ty: gl.constexpr = MASK.dtype.element_ty
    bias_buf = gl.allocate_shared_memory(bias_ty, [BLOCK_M, BLOCK_N] if HAS_BIAS else [8, 8], gl.SwizzledSharedLayout(
        128 // bias_ty.primitive_bitwidth, 1, 8, [1, 0]))
    mask_buf = gl.allocate_shared_memory(mask_ty, [BLOCK_M, BLOCK_N] if HAS_MASK else [8, 8], gl.SwizzledSharedLayout(
        128 // mask_ty.primitive_bitwidth, 1, 8, [1, 0]))
    sparse = (SPARSE_Q_COUNT, SPARSE_Q_INDEX, SPARSE_K_ORDER, sparse_kstride_b, sparse_kstride_h, num_q_blocks)
    gl.warp_specialize([
        (_compute_partition, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, kv_ready,
                              kv_empty, q_ready, do_ready, qdo_empty, dq_ready, dq_empty, DK, DV, stride_dkb,
                              stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh, w_first, w_end, w_step,
                              seqlen_q, seqlen_k, num_heads_kv, diag, window_left, qk_scale, sm_scale, QSEG, KSEG,
                              SEGMENT_RANGES, sparse, seg_stride_qb, seg_stride_kb, cap_in, BIAS, bias_strides, bias_in,
                              bias_buf, MASK, mask_strides, mask_buf, DROPOUT_SEED, dropout_threshold, dropout_scale,
                              HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, GROUP_SIZE, NUM_WARPS, CAUSAL,
                              PERSISTENT, DS_BUFS, WINDOW, SEGMENTS, SOFTCAP, EVEN_K, HAS_BIAS, HAS_MASK,
                              SPARSE_BLOCK_Q, SPARSE_RUNS, DROPOUT)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_bufs, do_bufs,
                           lse_bufs, delta_bufs, kv_ready, kv_empty, q_ready, do_ready, qdo_empty, w_first, w_end,
                           w_step, seqlen_q, seqlen_k, num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse,
                           HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N, STAGES, GROUP_SIZE, CAUSAL, PERSISTENT, WINDOW,
                           SEGMENTS, SPARSE_BLOCK_Q, SPARSE_RUNS)),
        (_dq_partition, (dq_desc, dq_bufs, dq_ready, dq_empty, w_first, w_end, w_step, seqlen_q, seqlen_k,
                         num_heads_kv, diag, window_left, SEGMENT_RANGES, sparse, HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                         DQ_BUFS, GROUP_SIZE, CAUSAL, PERSISTENT, WINDOW, SEGMENTS, SPARSE_BLOCK_Q, SPARSE_RUNS)),
    ], [1, 1], [24, 24])


@triton.jit
def flash_bwd_dq_convert_kernel(DQ_ACCUM, numel, DQUERY, BLOCK: tl.constexpr):
    """dQ = the fp32 accumulator (already scaled) cast to dQ's dtype; both contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < numel
    tl.store(DQUERY + offs, tl.load(DQ_ACCUM + offs, mask=keep).to(DQUERY.dtype.element_ty), mask=keep)
