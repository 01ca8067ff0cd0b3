"""Flash-attention forward for Hopper (sm_90), in Gluon with explicit warp specialisation (FA3's).

The Triton forward (forward.py) leaves the schedule to the compiler's warp specialisation.  Here
the partitions are written out, as in FA3:

  * load warp (1 warp): TMA-loads the program's query tile (two 64-row halves) and streams K and V
    tiles through a STAGES-deep ring (separate ready barriers: S = Q K^T starts before V lands;
    separate empty barriers: K_j is given back once S_j is computed, so K_{j+STAGES} arrives
    during the softmax rather than after P_j V_j, which left every S GEMM waiting on a load).
  * two compute warpgroups (the default partition and a worker, 4 warps each; or, LOAD_FIRST, both workers of 240
    registers with the load warp the default partition: hopper.gluon_load_first), each owning one 64-row half of
    the query tile: independent instruction streams, so one's
    softmax (exp2 on the SFU) overlaps the other's wgmma.  Within a warpgroup the loop is software
    pipelined: S_{j+1} = Q K_{j+1}^T and O += P_j V_j are issued together, and the softmax of
    S_{j+1} runs as soon as S_{j+1} is back, with O += P_j V_j still on the tensor cores.  No
    ping-pong barriers between the warpgroups (FA3 has them): ordering their GEMM issues by
    mbarrier turns was 1-10% slower (NOTES: "No ping-pong between the warpgroups").

Persistent: one program per SM takes work items w = pid, pid + programs, ... (_fwd_item: one query
tile, or causal, a long and a short one) through descriptors over the whole arrays, built once
(plan: heads side by side, batches end to end).  Rows past a sequence's end belong to the next
batch (or TMA's zero padding): keys there are masked, query rows there are not stored.
Causal is bottom-right (query row m sees key n iff n <= m + diag, diag = Sk - Sq + shift).
Fully masked rows give O = 0 and lse = -inf.  A bias and an attention mask are copied per warpgroup
into shared memory SCORE_BUFS key tiles ahead (_fetch_next_scores; the plan holds two where they fit:
hopper.gluon_score_buffers) and read where the softmax uses them.  A
block-sparse layout of 128 x 128 blocks: each query tile walks its list of key blocks (_fwd_item).
What qualifies and the tiles: plan.gluon_forward.
Runs only on sm_90 (wgmma, setmaxnreg); Gluon has no interpreter, so CPU tests compile it
(compile_check) and GPU tests check its numbers.
"""
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .gluon_shared import (capped_tanh, copy_score_tile, load_rows, masked_scores, mma_layout, partition_barrier,
                           score_copy_layout, scores_landed)
from .rules import (GLUON_FWD_INTS, SOFTCAP_MUFU_FIXED_MAX, SOFTCAP_P_MAX_LOG2, dropout_keep, dropout_row_hash,
                    mask_as_int8)

# (rules' names, as constexprs the kernels read)
SOFTCAP_FIXED = gl.constexpr(SOFTCAP_MUFU_FIXED_MAX)
P_MAX_LOG2 = gl.constexpr(SOFTCAP_P_MAX_LOG2)

# SPARSE: no layout, a block-sparse layout's lists, or a layout whose every row is one run of blocks.
SPARSE_LISTS = gl.constexpr(1)
SPARSE_RUNS = gl.constexpr(2)


@gluon.constexpr_function
def mask_copy_layout(BN):
    """How one warpgroup copies a [64, BN] tile of the mask: 32 bytes of a row a thread (two of the buffer's 16-byte
    swizzle units, so two shared-memory destinations a row where half a row took four, held through the key loop:
    NOTES, "A causal mask at D = 128: the load warp as the default partition"), BN // 32 threads a row, 1 or 2 row
    offsets where the bias's layout (gluon_shared.score_copy_layout) has eight; copied like the mask, the bias's
    half-sector requests ran it 1.2-1.8x slower (NOTES: "Score tiles: row offsets, not spills")."""
    return gl.BlockedLayout([1, 32], [32 // (BN // 32), BN // 32], [4, 1], [1, 0])


@gluon.jit
def _fwd_item(w, sub, seqlen_q, seqlen_k, num_heads_q, diag, window_left, SEGMENT_RANGES, sparse, BM: gl.constexpr,
              BN: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              SEGMENTS: gl.constexpr, SPARSE: gl.constexpr):
    """Query tile `sub` of work item w: whether it exists, its batch, query head, KV head, first
    query row, the key tiles to visit [n_first, n_tiles), and which of those need no mask: tiles
    [n_left_full, n_full).  One head's items are consecutive, so programs taking items in turn work
    side by side on its K and V (L2).  Non-causal: an item is one query tile.  Causal: an item is a
    pair of query tiles, t from the end and t from the start (the middle one alone when the count is
    odd): every item then has as many key tiles to visit, and programs taking items in turn finish
    together (with a window, every tile but the first few visits as many anyway).  WINDOW (causal
    only): row m also needs key n >= m + diag - window_left.  SEGMENTS: the tile's segment ranges
    (segments.py, for BM-row query tiles and BN-wide key tiles) narrow its key tiles to those sharing an
    id with it, and its unmasked ones to the run whose ids all equal its one id.
    SPARSE: the key tiles are those of the tile's row of a block-sparse layout (blocks of BM x BN):
    `sparse` = (counts, lists, tile order, layout batch stride, layout head stride, list length).
    An item is a pair of query tiles, the t-th busiest and the t-th least busy in the layout's order,
    so items do about equal work whatever the layout (dealt round-robin from a busiest-first order,
    programs whose turns fell on the busy tiles of every head took 1.5x the mean: documents);
    [n_first, n_tiles) index the list (_key_tile), and a listed tile is unmasked only inside
    [n_left_full, n_full) as the rules above place it (the layout is the caller's: a tile outside the
    band is masked whole).  SPARSE == SPARSE_RUNS: every row's blocks are one run (windows,
    documents), so [n_first, n_tiles) are the key tiles themselves, from the list's first entry, and no
    other index is read.  Returns also the list (unused unless SPARSE)."""
    n_q_tiles = gl.cdiv(seqlen_q, BM)
    LIST = sparse[1]
    if SPARSE:
        n_pairs = gl.cdiv(n_q_tiles, 2)
        bh = w // n_pairs
        pair = w % n_pairs
        layout_row = (bh // num_heads_q) * sparse[3] + (bh % num_heads_q) * sparse[4]
        t = gl.load(sparse[2] + layout_row + gl.where(sub == 0, pair, n_q_tiles - 1 - pair))
        valid = (sub == 0) | (pair != n_q_tiles - 1 - pair)
    elif CAUSAL:
        n_pairs = gl.cdiv(n_q_tiles, 2)
        bh = w // n_pairs
        pair = w % n_pairs
        t = n_q_tiles - 1 - pair
        if sub == 1:
            t = pair
        valid = (sub == 0) | (pair != n_q_tiles - 1 - pair)
    else:
        bh = w // n_q_tiles
        t = w % n_q_tiles
        valid = sub == 0
    m0 = t * BM
    batch = bh // num_heads_q
    head = bh % num_heads_q
    n_first = m0 * 0
    n_left_full = m0 * 0
    if CAUSAL:
        n_end = gl.minimum(gl.maximum(m0 + BM + diag, 0), seqlen_k)  # keys < n_end are seen by some row
        n_tiles = gl.cdiv(n_end, BN)
        n_full = gl.minimum(gl.maximum(m0 + diag + 1, 0), seqlen_k) // BN  # seen by every row of the tile
        if WINDOW:
            # keys from the first row's window start on are seen by some row; from the last row's, by all
            n_first = gl.minimum(gl.maximum(m0 + diag - window_left, 0) // BN, n_tiles)
            n_left_full = gl.cdiv(gl.maximum(m0 + BM - 1 + diag - window_left, 0), BN)
    else:
        n_tiles = gl.cdiv(seqlen_k, BN)
        n_full = seqlen_k // BN
    if SEGMENTS:
        ranges = SEGMENT_RANGES + (batch.to(gl.int64) * n_q_tiles + t) * 4
        n_first = gl.minimum(gl.maximum(n_first, gl.load(ranges) // BN), n_tiles)
        n_tiles = gl.maximum(gl.minimum(n_tiles, gl.cdiv(gl.load(ranges + 1), BN)), n_first)
        n_left_full = gl.maximum(n_left_full, gl.load(ranges + 2) // BN)
        n_full = gl.minimum(n_full, gl.load(ranges + 3) // BN)
    if SPARSE:
        n_first = m0 * 0
        n_tiles = gl.load(sparse[0] + layout_row + t)
        LIST = sparse[1] + (layout_row + t).to(gl.int64) * sparse[5]
        if SPARSE == SPARSE_RUNS:
            n_first = gl.load(LIST)
            n_tiles += n_first
    return valid, batch, head, head // GROUP, m0, n_first, n_tiles, n_left_full, n_full, LIST


@gluon.jit
def _key_tile(i, n_first, LIST, SPARSE: gl.constexpr):
    """The i-th key tile of an item (_fwd_item): n_first + i, or SPARSE_LISTS, its list's i-th entry."""
    if SPARSE == SPARSE_LISTS:
        return gl.load(LIST + i)
    else:
        return n_first + i


@gluon.jit
def _fwd_load(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
              w_first, w_end, w_step, seqlen_q, seqlen_k, num_heads_q, diag, window_left, SEGMENT_RANGES, sparse,
              HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              STAGES: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr,
              SEGMENTS: gl.constexpr, SPARSE: gl.constexpr):
    HM: gl.constexpr = BM // 2
    SUBS: gl.constexpr = 2 if CAUSAL or SPARSE else 1
    r = 0     # key tiles so far, counted alike in every partition
    tile = 0  # query tiles so far
    for w in range(w_first, w_end, w_step):
        for sub in range(SUBS):
            valid, batch, head, kv_head, m0, n_first, n_tiles, _, _, LIST = _fwd_item(
                w, sub, seqlen_q, seqlen_k, num_heads_q, diag, window_left, SEGMENT_RANGES, sparse, BM, BN, GROUP,
                CAUSAL, WINDOW, SEGMENTS, SPARSE)
            if valid:
                q_row = batch * seqlen_q + m0
                k_row = batch * seqlen_k
                # Both halves' last S GEMMs of the previous tile are done with Q (O_IN_Q: both O stores have
                # read it; fresh: passes).
                mbarrier.wait(q_empty, (tile & 1) ^ 1)
                mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
                load_rows(q_desc, q_row, head, q_ready, q_bufs.index(0), HEAD_DIM, BLOCK_D)
                load_rows(q_desc, q_row + HM, head, q_ready, q_bufs.index(1), HEAD_DIM, BLOCK_D)
                for i in range(n_first, n_tiles):
                    j = _key_tile(i, 0, LIST, SPARSE)
                    s = r % STAGES
                    mbarrier.wait(k_empty.index(s), ((r // STAGES) & 1) ^ 1)
                    mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
                    load_rows(k_desc, k_row + j * BN, kv_head, k_ready.index(s), k_bufs.index(s), HEAD_DIM, BLOCK_D)
                    mbarrier.wait(v_empty.index(s), ((r // STAGES) & 1) ^ 1)
                    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
                    load_rows(v_desc, k_row + j * BN, kv_head, v_ready.index(s), v_bufs.index(s), HEAD_DIM, BLOCK_D)
                    r += 1
                tile += 1


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, n0, rows, seqlen_k, diag, window_left, masked, q_ids, KSEG_ROW, cap_in,
             bias_buf, bias_in, mask_buf, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, BN: gl.constexpr,
             EVEN_K: gl.constexpr,
             SEGMENTS: gl.constexpr, SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr):
    """Online softmax of one S tile: (P, new row max, new row sum, the factor rescaling old O). Row maxima are kept in
    the exp2 domain (times qk_scale), so P = exp2(S * qk_scale - m) is one FMA per element.  HAS_BIAS: the bias
    tile joins S in S's own units (bias_in = 1 / scale), one FMA, so that the scale applied after it gives S *
    scale + bias.  SOFTCAP: S becomes tanh(S * scale / cap) first (cap_in = scale / cap), and the caller's qk_scale
    is cap * log2 e, so that FMA gives cap * tanh(.) in log2 units (rules.logits' constants, finite for every legal
    scale and cap); SOFTCAP_FIXED: those scores, bounded by the cap, are taken against the fixed reference m_i
    (_fwd_tile) with no row maximum and no factor (the one returned is unused).  HAS_MASK: where the attention
    mask's tile is 0, S is -inf (after the cap).  The bias and mask tiles are read from shared memory where they
    are used, so no registers hold them across the GEMMs (loaded a tile ahead into registers, they spilled)."""
    if HAS_BIAS:
        s = s + bias_buf.load(s.type.layout).to(gl.float32) * bias_in
    if SOFTCAP != 0:
        s = capped_tanh(s * cap_in, SOFTCAP)
    # The branch stays in the loop even where it is never taken (non-causal, Sk a multiple of BN):
    # without it ptxas schedules the loop worse, 10-24% slower (NOTES: "The never-taken branch stays").  EVEN_K
    # (no tile
    # reaches past the keys) drops the key bound from the causal mask, where it made ptxas spill.
    if masked:
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        if CAUSAL:
            ok = gl.expand_dims(keys, 0) <= gl.expand_dims(rows + diag, 1)
            if WINDOW:
                ok = ok & (gl.expand_dims(keys, 0) >= gl.expand_dims(rows + diag - window_left, 1))
            if not EVEN_K:
                ok = ok & gl.expand_dims(keys < seqlen_k, 0)
        else:
            ok = gl.expand_dims(keys < seqlen_k, 0)
        if SEGMENTS:   # tiles outside the tile's one-id run: keys of another document are masked
            k_ids = gl.load(KSEG_ROW + keys, mask=keys < seqlen_k, other=-1)
            ok = ok & (gl.expand_dims(q_ids, 1) == gl.expand_dims(k_ids, 0))
        s = gl.where(ok, s, float("-inf"))
    if HAS_MASK:
        s = masked_scores(s, mask_buf, s.shape[0], BN)
    if SOFTCAP == SOFTCAP_FIXED:   # m_i is the fixed reference (_fwd_tile); nothing to rescale
        m_new = m_i
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_i, 1))
        alpha = m_i
        l_new = l_i + gl.sum(p, axis=1)
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: P = 0, not NaN
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        l_new = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_new, alpha


@gluon.jit
def _dropped(p, row_hash, n0, threshold, BN: gl.constexpr):
    """P with the entries dropout drops zeroed: keys n0.. of rows whose hashes are row_hash."""
    keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, p.type.layout))
    return gl.where(dropout_keep(row_hash, keys, threshold), p, 0.0)


@gluon.jit
def _fetch_next_scores(bias_buf, BIAS_ROW, bias_rows, mask_buf, MASK_ROW, mask_rows, rows_ok, n0, seqlen_k,
                       BN: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr):
    """Start copying keys n0.. of one query half's rows of the bias and of the mask into their buffers
    (gluon_shared.copy_score_tile), one commit group: issued once the previous tile's softmax has read
    them, they land during the next S and P V GEMMs."""
    bias_ok, mask_ok = rows_ok
    if HAS_BIAS:
        copy_score_tile(bias_buf, BIAS_ROW, bias_rows[0], bias_rows[1], bias_ok, n0, seqlen_k, BN,
                        score_copy_layout(BN, 4))
    if HAS_MASK:
        copy_score_tile(mask_buf, MASK_ROW, mask_rows[0], mask_rows[1], mask_ok, n0, seqlen_k, BN,
                        mask_copy_layout(BN))
    if HAS_BIAS or HAS_MASK:
        async_copy.commit_group()


@gluon.jit
def _no_scores(HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr):
    """An empty commit group where no tile is left to copy, so that every key tile has one group and
    scores_landed waits for the same count of younger groups throughout."""
    if HAS_BIAS or HAS_MASK:
        async_copy.commit_group()


@gluon.jit
def _fwd_tile(m0, n_first, n_tiles, n_left_full, n_full, LIST, r, tile, q_smem, k_bufs, v_bufs, q_ready, q_empty,
              k_ready, v_ready, k_empty, v_empty, seqlen_q, seqlen_k, diag, window_left, qk_scale, QSEG_ROW, KSEG_ROW,
              cap_in, BIAS_ROW, bias_stride_s, bias_in, bias_ring, MASK_ROW, mask_stride_s, mask_ring, dropout,
              HALF: gl.constexpr, BLOCK_D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, WINDOW: gl.constexpr, EVEN_K: gl.constexpr, SEGMENTS: gl.constexpr,
              SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr, SPARSE: gl.constexpr,
              DROPOUT: gl.constexpr, SCORE_BUFS: gl.constexpr, O_SCORES: gl.constexpr, O_IN_Q: gl.constexpr):
    """One warpgroup's half of one query tile, over key tiles [n_first, n_tiles) (SPARSE: LIST's first
    n_tiles; _key_tile) (ring positions r on):
    (O unnormalised, row max, row sum, its rows).  BIAS_ROW, MASK_ROW: the (batch, head)'s
    (Sq, Sk) bias and attention mask (HAS_BIAS, HAS_MASK).  DROPOUT: `dropout` = (seed, batch * Hq +
    head, threshold); P V takes the probabilities rules.dropout_keep keeps (the hash every kernel
    applies), the row sums count them all, and the caller scales O by 1 / (1 - p).  bias_ring, mask_ring:
    both warpgroups' tiles, SCORE_BUFS each (this one's HALF, HALF + 2); key tile i's are copied
    into tile HALF + 2 * (i % SCORE_BUFS), SCORE_BUFS key tiles ahead, one
    commit group per key tile (empty past the last), so that key tile i's have landed once all but the
    SCORE_BUFS - 1 youngest groups have.  O_IN_Q: Q's buffer is O's staging buffer, so Q is given back
    (q_empty) by the caller once O's store has read it, not here after the last S GEMM."""
    HM: gl.constexpr = BM // 2
    RING0: gl.constexpr = HALF
    s_layout: gl.constexpr = mma_layout(HM, BN, 4)        # S, P: [HM, BN]
    o_layout: gl.constexpr = mma_layout(HM, BLOCK_D, 4)   # O: [HM, D] (D padded to BLOCK_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    zero_s = gl.zeros([HM, BN], gl.float32, s_layout)
    rows = m0 + HALF * HM + gl.arange(0, HM, layout=row_s)
    row_hash = 0
    if DROPOUT:
        row_hash = dropout_row_hash(dropout[0], dropout[1], rows)
    q_ids = 0
    if SEGMENTS:
        q_ids = gl.load(QSEG_ROW + rows, mask=rows < seqlen_q, other=-2)
    # The half's first row as a scalar pointer, its rows as 32-bit offsets from it (plan: 64 rows of
    # the tensors span less than 2**31 elements): held through the loop, 64-bit offsets spilled.
    half_row0 = m0 + HALF * HM
    bias_copy_rows = gl.arange(0, HM, layout=gl.SliceLayout(1, score_copy_layout(BN, 4)))
    mask_copy_rows = gl.arange(0, HM, layout=gl.SliceLayout(1, mask_copy_layout(BN)))
    copy_rows_ok = (bias_copy_rows < seqlen_q - half_row0, mask_copy_rows < seqlen_q - half_row0)
    BIAS_ROW = BIAS_ROW + gl.multiple_of(half_row0.to(gl.int64) * bias_stride_s, [8])
    MASK_ROW = MASK_ROW + gl.multiple_of(half_row0.to(gl.int64) * mask_stride_s, [8])
    bias_rows = (bias_copy_rows, bias_stride_s)   # (rows, stride): copy_score_tile
    mask_rows = (mask_copy_rows, mask_stride_s)
    FIXED_MAX: gl.constexpr = SOFTCAP == SOFTCAP_FIXED
    if FIXED_MAX:
        # Capped scores lie in [-K, K], K = cap log2 e = qk_scale: P = exp2(score - max(K - P_MAX_LOG2, 0)) stays
        # within [2^-(2K - P_MAX_LOG2), 2^P_MAX_LOG2], normal in bf16 and fp32 for the caps plan.gluon_softcap
        # admits; no rescaling of O.
        m_i = gl.full([HM], 0.0, gl.float32, row_s) + gl.maximum(qk_scale - P_MAX_LOG2, 0.0)
    else:
        m_i = gl.full([HM], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([HM], gl.float32, row_s)
    acc = gl.zeros([HM, BLOCK_D], gl.float32, o_layout)
    mbarrier.wait(q_ready, tile & 1)
    count = n_tiles - n_first
    if count > 0:
        j = _key_tile(0, n_first, LIST, SPARSE)
        _fetch_next_scores(bias_ring.index(RING0), BIAS_ROW, bias_rows, mask_ring.index(RING0), MASK_ROW,
                           mask_rows, copy_rows_ok, j * BN, seqlen_k, BN, HAS_BIAS, HAS_MASK)
        if SCORE_BUFS == 2:
            if count > 1:
                if O_SCORES:   # the second tile is O's staging buffer: the last item's O store has read it
                    tma.store_wait(0)
                    partition_barrier()
                _fetch_next_scores(bias_ring.index(RING0 + 2), BIAS_ROW, bias_rows, mask_ring.index(RING0 + 2),
                                   MASK_ROW, mask_rows, copy_rows_ok, _key_tile(1, n_first, LIST, SPARSE) * BN,
                                   seqlen_k, BN, HAS_BIAS, HAS_MASK)
            else:
                _no_scores(HAS_BIAS, HAS_MASK)
        # Prologue: S_0 and its softmax.
        st = r % STAGES
        mbarrier.wait(k_ready.index(st), (r // STAGES) & 1)
        s = warpgroup_mma(q_smem, k_bufs.index(st).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        mbarrier.arrive(k_empty.index(st), count=1)
        if not O_IN_Q:
            mbarrier.arrive(q_empty, count=1, pred=count == 1)  # the last S GEMM has read Q
        if HAS_BIAS or HAS_MASK:
            scores_landed(SCORE_BUFS - 1)
        p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j * BN, rows, seqlen_k, diag, window_left,
                                       (j < n_left_full) | (j >= n_full), q_ids, KSEG_ROW, cap_in,
                                       bias_ring.index(RING0), bias_in, mask_ring.index(RING0), CAUSAL, WINDOW, BN,
                                       EVEN_K, SEGMENTS, SOFTCAP, HAS_BIAS, HAS_MASK)
        if DROPOUT:
            p = _dropped(p, row_hash, j * BN, dropout[2], BN)
        if HAS_BIAS or HAS_MASK:
            partition_barrier()   # every thread has read the tiles: copy the next ones in
            if count > SCORE_BUFS:
                _fetch_next_scores(bias_ring.index(RING0), BIAS_ROW, bias_rows, mask_ring.index(RING0), MASK_ROW,
                                   mask_rows, copy_rows_ok, _key_tile(SCORE_BUFS, n_first, LIST, SPARSE) * BN,
                                   seqlen_k, BN, HAS_BIAS, HAS_MASK)
            else:
                _no_scores(HAS_BIAS, HAS_MASK)
        for i in range(1, count):
            j = _key_tile(i, n_first, LIST, SPARSE)
            rn = r + i
            sn = rn % STAGES
            sp = (rn - 1) % STAGES
            mbarrier.wait(k_ready.index(sn), (rn // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_bufs.index(sn).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            # O_{j-1} = alpha O_{j-2} + P_{j-1} V_{j-1}: the rescale runs while S_j is on the tensor cores
            if not FIXED_MAX:
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            mbarrier.wait(v_ready.index(sp), ((rn - 1) // STAGES) & 1)
            acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(sp), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S_j back, P_{j-1} V_{j-1} in flight
            # K_j is read: the load warp may fetch K_{j+STAGES} during this softmax, not after P V.
            mbarrier.arrive(k_empty.index(sn), count=1)
            if not O_IN_Q:
                mbarrier.arrive(q_empty, count=1, pred=i == count - 1)
            if HAS_BIAS or HAS_MASK:
                scores_landed(SCORE_BUFS - 1)
            b = RING0 + 2 * (i % SCORE_BUFS)
            p, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale, j * BN, rows, seqlen_k, diag, window_left,
                                          (j < n_left_full) | (j >= n_full), q_ids, KSEG_ROW, cap_in,
                                          bias_ring.index(b), bias_in, mask_ring.index(b), CAUSAL, WINDOW, BN,
                                          EVEN_K, SEGMENTS, SOFTCAP, HAS_BIAS, HAS_MASK)
            if DROPOUT:
                p = _dropped(p, row_hash, j * BN, dropout[2], BN)
            if HAS_BIAS or HAS_MASK:
                partition_barrier()
                if i + SCORE_BUFS < count:
                    _fetch_next_scores(bias_ring.index(b), BIAS_ROW, bias_rows, mask_ring.index(b), MASK_ROW,
                                       mask_rows, copy_rows_ok, _key_tile(i + SCORE_BUFS, n_first, LIST, SPARSE) * BN,
                                       seqlen_k, BN, HAS_BIAS, HAS_MASK)
                else:
                    _no_scores(HAS_BIAS, HAS_MASK)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(v_empty.index(sp), count=1)
        rl = r + count - 1
        sl = rl % STAGES
        if not FIXED_MAX:
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        mbarrier.wait(v_ready.index(sl), (rl // STAGES) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_bufs.index(sl), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(v_empty.index(sl), count=1)
    elif not O_IN_Q:
        mbarrier.arrive(q_empty, count=1)  # nothing visible from this tile: Q unused
    return acc, m_i, l_i, rows


@gluon.jit
def _join_sinks(acc, m_i, l_i, SINKS, head, NUM_SINKS: gl.constexpr, SINKS_PER_HEAD: gl.constexpr):
    """The sink logits joined to a finished row's online softmax (their terms in the denominator,
    nothing in O): (acc, m_i, l_i) rescaled, and whether a sink of +inf takes the whole softmax
    (O = 0, lse = +inf).  Sinks of -inf join nothing; a NaN sink makes l NaN (the maximum keeps NaN,
    so `finite` holds and the sum takes it), and the row's O and lse with it.  After the loop rather
    than before it (the portable kernels start from the sinks): the loop stays the option-free one."""
    base = head * NUM_SINKS if SINKS_PER_HEAD else 0
    sink_max = float("-inf")
    for j in gl.static_range(NUM_SINKS):
        sink_max = gl.maximum(sink_max, gl.load(SINKS + base + j).to(gl.float32) * 1.4426950408889634,
                              propagate_nan=tl.PropagateNan.ALL)
    finite = (sink_max != float("-inf")) & (sink_max != float("inf"))
    sink_ref = gl.where(finite, sink_max, 0.0)
    sink_sum = 0.0
    for j in gl.static_range(NUM_SINKS):
        sink_sum += gl.exp2(gl.load(SINKS + base + j).to(gl.float32) * 1.4426950408889634 - sink_ref)
    m_new = gl.where(finite, gl.maximum(m_i, sink_ref), m_i)
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = gl.exp2(m_i - m_shift)
    l_new = l_i * alpha + gl.where(finite, sink_sum * gl.exp2(sink_ref - m_shift), 0.0)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout)), 1)
    return acc, m_new, l_new, sink_max == float("inf")


@gluon.jit
def _fwd_compute(q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                 o_desc, LSE, SINKS, stride_lse_b, stride_lse_h, w_first, w_end, w_step, seqlen_q, seqlen_k,
                 num_heads_q, diag, window_left, qk_scale, QSEG, KSEG, SEGMENT_RANGES, sparse, seg_stride_qb,
                 seg_stride_kb,
                 cap_in, BIAS, bias_strides, bias_in, bias_bufs, MASK, mask_strides, mask_bufs, DROPOUT_SEED,
                 dropout_threshold, dropout_scale, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                 BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                 WINDOW: gl.constexpr, EVEN_K: gl.constexpr, NUM_SINKS: gl.constexpr,
                 SINKS_PER_HEAD: gl.constexpr, SEGMENTS: gl.constexpr, SOFTCAP: gl.constexpr,
                 HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr, SPARSE: gl.constexpr, DROPOUT: gl.constexpr,
                 SCORE_BUFS: gl.constexpr, O_SCORES: gl.constexpr, O_IN_Q: gl.constexpr):
    HM: gl.constexpr = BM // 2
    SUBS: gl.constexpr = 2 if CAUSAL or SPARSE else 1
    o_layout: gl.constexpr = mma_layout(HM, BLOCK_D, 4)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_bufs.dtype
    q_smem = q_bufs.index(HALF)
    o_smem = o_bufs.index(HALF + (2 if O_SCORES else 0))   # (O_SCORES: the bias ring's second tiles; O_IN_Q: Q's)
    dropout_seed = 0
    if DROPOUT:
        dropout_seed = gl.load(DROPOUT_SEED)
    r = 0
    tile = 0
    for w in range(w_first, w_end, w_step):
        for sub in range(SUBS):
            valid, batch, head, kv_head, m0, n_first, n_tiles, n_left_full, n_full, LIST = _fwd_item(
                w, sub, seqlen_q, seqlen_k, num_heads_q, diag, window_left, SEGMENT_RANGES, sparse, BM, BN, GROUP,
                CAUSAL, WINDOW, SEGMENTS, SPARSE)
            if valid:
                b64 = batch.to(gl.int64)
                h64 = head.to(gl.int64)
                bias_head = BIAS + gl.multiple_of(b64 * bias_strides[0] + h64 * bias_strides[1], [8])
                mask_head = MASK + gl.multiple_of(b64 * mask_strides[0] + h64 * mask_strides[1], [8])
                acc, m_i, l_i, rows = _fwd_tile(m0, n_first, n_tiles, n_left_full, n_full, LIST, r, tile, q_smem,
                                                k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                                                seqlen_q, seqlen_k, diag, window_left, qk_scale,
                                                QSEG + b64 * seg_stride_qb, KSEG + b64 * seg_stride_kb, cap_in,
                                                bias_head, bias_strides[2], bias_in,
                                                bias_bufs, mask_head, mask_strides[2], mask_bufs,
                                                (dropout_seed, batch * num_heads_q + head, dropout_threshold), HALF,
                                                BLOCK_D, BM, BN, STAGES, CAUSAL, WINDOW, EVEN_K, SEGMENTS, SOFTCAP,
                                                HAS_BIAS, HAS_MASK, SPARSE, DROPOUT, SCORE_BUFS, O_SCORES, O_IN_Q)
                r += n_tiles - n_first
                tile += 1
                if NUM_SINKS > 0:
                    acc, m_i, l_i, saturated = _join_sinks(acc, m_i, l_i, SINKS, head, NUM_SINKS, SINKS_PER_HEAD)
                # O = acc / l and lse = ln(sum exp) (rows with nothing visible: l = 0, O = 0, lse = -inf;
                # `!= 0` rather than `> 0` so that a NaN l, from a NaN sink, reaches O and lse).
                l_o = gl.convert_layout(l_i, row_o)
                if DROPOUT:   # the kept entries scaled by 1 / (1 - p) here, once per row
                    out = acc * gl.expand_dims(dropout_scale / gl.where(l_o != 0.0, l_o, 1.0), 1)
                else:
                    out = acc / gl.expand_dims(gl.where(l_o != 0.0, l_o, 1.0), 1)
                if NUM_SINKS > 0:
                    out = gl.where(saturated, 0.0, out)
                # O leaves through shared memory and a TMA store (a tensor of pointers would spill):
                # the descriptor is (batch, seq, head * dim), so rows past Sq are clipped, not
                # written into the next batch.  The previous tile's store must have read o_smem.
                tma.store_wait(0)
                o_smem.store(out.to(dtype))
                fence_async_shared()
                partition_barrier()
                if BLOCK_D == HEAD_DIM:
                    tma.async_copy_shared_to_global(o_desc, [batch, m0 + HALF * HM, head * HEAD_DIM],
                                                    o_smem._reinterpret(dtype, [1, HM, HEAD_DIM], o_desc.layout))
                else:   # (batch, seq, head, dim): the columns past HEAD_DIM are not written
                    tma.async_copy_shared_to_global(o_desc, [batch, m0 + HALF * HM, head, 0],
                                                    o_smem._reinterpret(dtype, [1, HM, 1, BLOCK_D], o_desc.layout))
                if O_IN_Q:   # the store has read Q's buffer: the load warp may fetch the next item's Q
                    tma.store_wait(0)
                    partition_barrier()   # every warp's part of the store (one thread arrives)
                    mbarrier.arrive(q_empty, count=1)
                lse = gl.where(l_i != 0.0, (m_i + gl.log2(l_i)) * 0.6931471805599453, float("-inf"))
                if NUM_SINKS > 0:
                    lse = gl.where(saturated, float("inf"), lse)
                gl.store(LSE + batch.to(gl.int64) * stride_lse_b + head * stride_lse_h + rows, lse,
                         mask=rows < seqlen_q)
    tma.store_wait(0)


# _fwd_partition's roles: the compute warpgroups of query rows 0-63 and 64-127 of a tile, and the load warp.
LOAD_ROLE = gl.constexpr(2)


@gluon.constexpr_function
def _partition_role(slot, load_first):
    """The role of warp_specialize's slot (0: the default partition): the two compute warpgroups then the load warp,
    or with load_first (hopper.gluon_load_first) the load warp first."""
    return (slot + 2 * bool(load_first)) % 3


@gluon.jit
def _fwd_partition(shared, ROLE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BM: gl.constexpr,
                   BN: gl.constexpr, STAGES: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                   WINDOW: gl.constexpr, EVEN_K: gl.constexpr, NUM_SINKS: gl.constexpr, SINKS_PER_HEAD: gl.constexpr,
                   SEGMENTS: gl.constexpr, SOFTCAP: gl.constexpr, HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr,
                   SPARSE: gl.constexpr, DROPOUT: gl.constexpr, SCORE_BUFS: gl.constexpr, O_SCORES: gl.constexpr,
                   O_IN_Q: gl.constexpr):
    """One partition of the forward: ROLE 0 or 1 a compute warpgroup (_fwd_compute's HALF), LOAD_ROLE the load
    warp (_fwd_load); `shared` holds the kernel's values they take."""
    (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, q_desc, k_desc,
     v_desc, LSE, SINKS, stride_lse_b, stride_lse_h, w_first, num_work, w_step, seqlen_q, seqlen_k, num_heads_q, diag,
     window_left, qk_scale, QSEG, KSEG, SEGMENT_RANGES, sparse, seg_stride_qb, seg_stride_kb, cap_in, BIAS,
     bias_strides, bias_in, bias_bufs, MASK, mask_strides, mask_bufs, DROPOUT_SEED, dropout_threshold,
     dropout_scale) = shared
    if ROLE == LOAD_ROLE:
        _fwd_load(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
                  w_first, num_work, w_step, seqlen_q, seqlen_k, num_heads_q, diag, window_left, SEGMENT_RANGES, sparse,
                  HEAD_DIM, BLOCK_D, BM, BN, STAGES, GROUP, CAUSAL, WINDOW, SEGMENTS, SPARSE)
    else:
        _fwd_compute(q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, LSE,
                     SINKS, stride_lse_b, stride_lse_h, w_first, num_work, w_step, seqlen_q, seqlen_k, num_heads_q,
                     diag, window_left, qk_scale, QSEG, KSEG, SEGMENT_RANGES, sparse, seg_stride_qb, seg_stride_kb,
                     cap_in, BIAS, bias_strides, bias_in, bias_bufs, MASK, mask_strides, mask_bufs, DROPOUT_SEED,
                     dropout_threshold, dropout_scale, ROLE, HEAD_DIM, BLOCK_D, BM, BN, STAGES, GROUP, CAUSAL, WINDOW,
                     EVEN_K, NUM_SINKS, SINKS_PER_HEAD, SEGMENTS, SOFTCAP, HAS_BIAS, HAS_MASK, SPARSE, DROPOUT,
                     SCORE_BUFS, O_SCORES, O_IN_Q)


@gluon.jit(do_not_specialize=GLUON_FWD_INTS)
def flash_fwd_gluon_kernel(
    Q, K, V, SINKS, QSEG, KSEG, SEGMENT_RANGES, BIAS, MASK, SPARSE_KV_COUNT, SPARSE_KV_INDEX, SPARSE_Q_ORDER,
    DROPOUT_SEED, stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh, stride_lse_b, stride_lse_h,
    batch, seqlen_q, seqlen_k, num_heads_q, diag, window_left, num_work, sm_scale, seg_stride_qb, seg_stride_kb,
    softcap, bias_stride_b, bias_stride_h, bias_stride_s, mask_stride_b, mask_stride_h, mask_stride_s,
    sparse_stride_b, sparse_stride_h, num_k_blocks, dropout_threshold, dropout_scale,
    OUT, LSE, DESC_SCRATCH,
    HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, GROUP_SIZE: gl.constexpr, CAUSAL: gl.constexpr, WINDOW: gl.constexpr, EVEN_K: gl.constexpr,
    NUM_SINKS: gl.constexpr, SINKS_PER_HEAD: gl.constexpr, SEGMENTS: gl.constexpr, SOFTCAP: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_MASK: gl.constexpr, SPARSE: gl.constexpr, DROPOUT: gl.constexpr,
    SCORE_BUFS: gl.constexpr, LOAD_FIRST: gl.constexpr,
):
    # Grid: (programs,), each taking items w = pid, pid + programs, ... < num_work (_fwd_item).
    # The descriptors cover whole arrays, (batch, seq) rows by (head, dim) columns: heads side by
    # side (stride_qh == HEAD_DIM) and batches end to end (plan.gluon_forward).  DESC_SCRATCH:
    # where jax-triton launches keep the descriptors (jax_api/_scratch.py).  SPARSE (SPARSE_LISTS or
    # SPARSE_RUNS; 0: none): a block-sparse layout of BLOCK_M x BLOCK_N blocks (dualattn.SparseMask's
    # key-block lists, _fwd_item).  DROPOUT: DROPOUT_SEED holds the seed (int32, shape (1,)), and an entry is
    # dropped where rules.dropout_keep says (the hash every kernel and the mask kernel apply).  BLOCK_D: the
    # tiles' width, HEAD_DIM padded to a power of two; where it is wider (D = 96, 192) the descriptors are
    # (rows, heads, dims), which TMA fills past HEAD_DIM with zeros on loads and clips on the store.
    dtype: gl.constexpr = Q.dtype.element_ty
    HM: gl.constexpr = BLOCK_M // 2
    MASK = mask_as_int8(MASK)   # (a bool mask's bytes)
    q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HM, BLOCK_D], dtype)
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], dtype)
    num_heads_kv = num_heads_q // GROUP_SIZE
    if BLOCK_D == HEAD_DIM:
        o_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HM, HEAD_DIM], dtype)
        q_desc = tma.make_tensor_descriptor(Q, [batch * seqlen_q, num_heads_q * HEAD_DIM], [stride_qs, 1],
                                            [HM, HEAD_DIM], q_layout)
        k_desc = tma.make_tensor_descriptor(K, [batch * seqlen_k, num_heads_kv * HEAD_DIM], [stride_ks, 1],
                                            [BLOCK_N, HEAD_DIM], kv_layout)
        v_desc = tma.make_tensor_descriptor(V, [batch * seqlen_k, num_heads_kv * HEAD_DIM], [stride_vs, 1],
                                            [BLOCK_N, HEAD_DIM], kv_layout)
        o_desc = tma.make_tensor_descriptor(OUT, [batch, seqlen_q, num_heads_q * HEAD_DIM],
                                            [stride_ob, stride_os, 1], [1, HM, HEAD_DIM], o_layout)
    else:
        q3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HM, 1, BLOCK_D], dtype)
        kv3_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 1, BLOCK_D], dtype)
        o4_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([1, HM, 1, BLOCK_D], dtype)
        q_desc = tma.make_tensor_descriptor(Q, [batch * seqlen_q, num_heads_q, HEAD_DIM], [stride_qs, HEAD_DIM, 1],
                                            [HM, 1, BLOCK_D], q3_layout)
        k_desc = tma.make_tensor_descriptor(K, [batch * seqlen_k, num_heads_kv, HEAD_DIM], [stride_ks, HEAD_DIM, 1],
                                            [BLOCK_N, 1, BLOCK_D], kv3_layout)
        v_desc = tma.make_tensor_descriptor(V, [batch * seqlen_k, num_heads_kv, HEAD_DIM], [stride_vs, HEAD_DIM, 1],
                                            [BLOCK_N, 1, BLOCK_D], kv3_layout)
        o_desc = tma.make_tensor_descriptor(OUT, [batch, seqlen_q, num_heads_q, HEAD_DIM],
                                            [stride_ob, stride_os, HEAD_DIM, 1], [1, HM, 1, BLOCK_D], o4_layout)
    q_bufs = gl.allocate_shared_memory(dtype, [2, HM, BLOCK_D], q_layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_D], kv_layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per compute warpgroup
    for j in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(j), count=1)
        mbarrier.init(v_ready.index(j), count=1)
        mbarrier.init(k_empty.index(j), count=2)  # one arrival per compute warpgroup
        mbarrier.init(v_empty.index(j), count=2)
    fence_async_shared()

    w_first = gl.program_id(0)
    w_step = gl.num_programs(0)
    qk_scale = sm_scale * 1.4426950408889634
    # The soft cap's constants, folded into one multiply before the tanh and the exp2 FMA's after it (as
    # rules.logits): cap * tanh(qk * scale / cap) in log2 units.
    cap_in = sm_scale / softcap
    if SOFTCAP != 0:
        qk_scale = softcap * 1.4426950408889634
    bias_in = 1.0 / sm_scale   # (the bias is added in S's units: _softmax)
    # Each compute warpgroup's SCORE_BUFS tiles of the bias and of the mask (a token buffer where absent),
    # rows swizzled in 16-byte units so that S's layout reads them without bank conflicts.
    bias_ty: gl.constexpr = BIAS.dtype.element_ty
    mask_ty: gl.constexpr = MASK.dtype.element_ty
    bias_tile: gl.constexpr = [2 * SCORE_BUFS, HM, BLOCK_N] if HAS_BIAS else [2 * SCORE_BUFS, 8, 8]
    mask_tile: gl.constexpr = [2 * SCORE_BUFS, HM, BLOCK_N] if HAS_MASK else [2 * SCORE_BUFS, 8, 8]
    bias_bufs = gl.allocate_shared_memory(bias_ty, bias_tile, gl.SwizzledSharedLayout(
        128 // bias_ty.primitive_bitwidth, 1, 8, [1, 0]))
    # O_SCORES: a 16-bit bias whose tiles are O's size (the 128-wide tiles) holds its second tiles in O's staging
    # buffers, idle through the key loop, so that two fit (hopper.gluon_score_buffers).
    O_SCORES: gl.constexpr = (HAS_BIAS and SCORE_BUFS == 2 and BLOCK_D == BLOCK_N
                              and bias_ty.primitive_bitwidth == 16)
    # O_IN_Q: at D = 256 Q, two stages of K and V and O's own buffers would take 256 KB; O is staged in Q's
    # buffers instead, and the next item's Q waits for O's store (hopper.GLUON_FWD_TILES).
    O_IN_Q: gl.constexpr = BLOCK_D > 128
    if O_SCORES:
        o_bufs = bias_bufs._reinterpret(dtype, [2 * SCORE_BUFS, HM, BLOCK_D], q_layout)
    elif O_IN_Q:
        o_bufs = q_bufs
    else:
        o_bufs = gl.allocate_shared_memory(dtype, [2, HM, BLOCK_D], q_layout)
    mask_bufs = gl.allocate_shared_memory(mask_ty, mask_tile, gl.SwizzledSharedLayout(
        128 // mask_ty.primitive_bitwidth, 1, 8, [1, 0]))
    bias_strides = (bias_stride_b, bias_stride_h, bias_stride_s)
    mask_strides = (mask_stride_b, mask_stride_h, mask_stride_s)
    sparse = (SPARSE_KV_COUNT, SPARSE_KV_INDEX, SPARSE_Q_ORDER, sparse_stride_b, sparse_stride_h, num_k_blocks)
    # The partitions' runtime arguments, one tuple (a variable may hold values, not constexprs).
    shared = (q_bufs, k_bufs, v_bufs, o_bufs, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, o_desc, q_desc,
              k_desc, v_desc, LSE, SINKS, stride_lse_b, stride_lse_h, w_first, num_work, w_step, seqlen_q, seqlen_k,
              num_heads_q, diag, window_left, qk_scale, QSEG, KSEG, SEGMENT_RANGES, sparse, seg_stride_qb,
              seg_stride_kb, cap_in, BIAS, bias_strides, bias_in, bias_bufs, MASK, mask_strides, mask_bufs,
              DROPOUT_SEED, dropout_threshold, dropout_scale)
    # Slot 0 is the default partition (the kernel's 4 warps), slots 1 and 2 workers: _fwd_partition's roles.
    gl.warp_specialize([
        (_fwd_partition, (shared, _partition_role(0, LOAD_FIRST), HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                          STAGES, GROUP_SIZE, CAUSAL, WINDOW, EVEN_K, NUM_SINKS, SINKS_PER_HEAD, SEGMENTS, SOFTCAP,
                          HAS_BIAS, HAS_MASK, SPARSE, DROPOUT, SCORE_BUFS, O_SCORES, O_IN_Q)),
        (_fwd_partition, (shared, _partition_role(1, LOAD_FIRST), HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                          STAGES, GROUP_SIZE, CAUSAL, WINDOW, EVEN_K, NUM_SINKS, SINKS_PER_HEAD, SEGMENTS, SOFTCAP,
                          HAS_BIAS, HAS_MASK, SPARSE, DROPOUT, SCORE_BUFS, O_SCORES, O_IN_Q)),
        (_fwd_partition, (shared, _partition_role(2, LOAD_FIRST), HEAD_DIM, BLOCK_D, BLOCK_M, BLOCK_N,
                          STAGES, GROUP_SIZE, CAUSAL, WINDOW, EVEN_K, NUM_SINKS, SINKS_PER_HEAD, SEGMENTS, SOFTCAP,
                          HAS_BIAS, HAS_MASK, SPARSE, DROPOUT, SCORE_BUFS, O_SCORES, O_IN_Q)),
    ], [4, 4] if LOAD_FIRST else [4, 1], [240, 240] if LOAD_FIRST else [240, 24])
