"""One-pass flash-attention backward in Gluon with explicit warp specialisation (FA3-style).  A probe.

Question: does one Gluon source compile for Hopper (sm_90a) under both Triton 3.6 and 3.7, and how
fast is a 5-GEMM one-pass backward there next to cuDNN?  Triton's automatic warp specialisation could
not compile a one-pass backward with a TMA-reduced dQ (fused_ws_bwd_probe.py); here the partitions,
barriers and the dQ bulk reduce are written out by hand.

Design (one CTA per (BN=128-key block, batch*head); it loops over all BM-row query blocks, BM=64 or 128):
  * "load" worker, 1 warp, 24 registers: TMA loads K, V once, then Q_i and dO_i into a STAGES-deep ring
    (separate ready barriers for Q and dO, so S^T = K Q^T can start before dO lands; one empty barrier).
  * "dq" worker, 1 warp, 24 registers: waits for the compute warps' fp32 dQ_i partial in shared memory,
    issues a TMA reduce-add (cp.reduce.async.bulk.tensor .add) into the fp32 dQ accumulator, frees the
    buffer (DQ_BUFS-deep ring).
  * default partition, 8 warps (two MMA warpgroups; each owns 64 of the 128 keys):
        S^T  = K Q_i^T           (wgmma, both operands in smem)
        dP^T = V dO_i^T          (wgmma, async, overlaps the exp2 of P^T)
        P^T  = exp2(S^T * scale*log2e - lse_i*log2e)
        dS^T = P^T * (dP^T - delta_i)
        dV  += P^T dO_i          (wgmma, A from registers)
        dK  += dS^T Q_i          (wgmma, A from registers)
        dQ_i = dS K              (wgmma, A = dS^T stored to smem and read transposed; N split over
                                  the two warpgroups)  -> smem -> dq worker
    dK (times scale) and dV are written once at the end.  dQ is scaled and cast by a torch op.
Constexpr options (second round, see VARIANTS):
  * CAUSAL (j <= i, Sq == Sk): key block n visits query blocks from the one holding row n*BN on; the first
    BN/BM of them straddle the diagonal and mask P^T (a separate MASK=True loop, the rest run unmasked).
    Grid (B*H, S/BN) so that every head's longest key blocks start first.
  * LSE_TMA: lse_i / delta_i ([1, BM] fp32 rows of (B*H, S) views) come by TMA with Q_i / dO_i on the same
    ready barriers, as in FA3, instead of 16 + 16 scalar global loads per thread per tile.
  * DQ_EARLY: dQ is issued before dK and only dV, dQ are waited for; the dK GEMM overlaps the dQ epilogue and
    the next tile's barrier waits and retires with the next S GEMM's wait; Q_i's ring slot is freed one tile
    later (after the next tile's dS barrier), hence STAGES >= 2 (3 preferred).
Triton 3.6 vs 3.7: the same source compiles under both.  Bridged: the partition barrier is
`gl.thread_barrier` in 3.6 and `gl.barrier` in 3.7; neither wraps the TMA reduce in Python, but both
GluonOpBuilders expose `create_async_tma_reduce(kind, desc, coords, smem)`, wrapped by `_tma_reduce_add`.
(Avoided rather than bridged: 3.6's warp_specialize returns a tuple of the default partition's results,
3.7 the value itself -- the default partition here returns nothing; mbarrier.expect's byte count is
positional because 3.7 renamed it bytes_per_cta.)

    python benchmarks/experiments/gluon_bwd_probe.py --compile --emulate --jax-triton   (no GPU)
    PYTHONPATH=/tmp/t36 python benchmarks/experiments/gluon_bwd_probe.py --compile ...    (Triton 3.6)
    python benchmarks/experiments/gluon_bwd_probe.py --check --bench                     (H100, < 4 min)
--compile: sm_90a compile of every variant + ptxas -v; --emulate: the tile loop's algebra in torch on the CPU;
--jax-triton: replays jax-triton 0.3.1's compile steps on the kernel; --check/--bench run each variant in a
child process (a deadlocked kernel is killed, the others go on).

Full or causal (top-left == bottom-right, Sq == Sk), S a multiple of both tiles, BN a multiple of BM,
D in {64, 128}, bf16, BSHD contiguous; lse (natural log) and delta = rowsum(dO*O) fp32 (B, H, S)
contiguous, precomputed by the driver.  --check and --bench run every variant full and causal; the bench
prints one table per D, one row per (S, causal), one column per variant, next to SDPA cuDNN.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

LOG2E = 1.4426950408889634

# Version bridges (Triton 3.6 <-> 3.7) and the wgmma layout: now in the library's one-pass kernel,
# which grew out of this probe (NOTES step 29).
from dualattn.kernels.flash.backward_gluon import _mma_layout, _partition_barrier, _tma_reduce_add  # noqa: E402


# ---------------------------------------------------------------------------------------------------
# Partitions
# ---------------------------------------------------------------------------------------------------
@gluon.jit
def _q_range(pid_n, seqlen, BM: gl.constexpr, BN: gl.constexpr, CAUSAL: gl.constexpr):
    """First query block and number of query blocks key block pid_n visits.  Causal (j <= i): query blocks
    from the one holding query row pid_n*BN on; the first BN // BM of them straddle the diagonal."""
    if CAUSAL:
        i_start = (pid_n * BN) // BM
    else:
        i_start = pid_n * 0
    return i_start, seqlen // BM - i_start


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_bufs, do_bufs, lse_bufs,
                    delta_bufs, kv_bar, q_ready, do_ready, qdo_empty, q_row0, kv_row, col, bh, i_start, n_local,
                    STAGES: gl.constexpr, LSE_TMA: gl.constexpr):
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [kv_row, col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [kv_row, col], kv_bar, v_smem)
    BM: gl.constexpr = q_desc.block_type.shape[0]
    # ring position j counts from 0 in every partition (the causal loop starts at query block i_start)
    for j in range(n_local):
        s = j % STAGES
        ph = (j // STAGES) & 1
        mbarrier.wait(qdo_empty.index(s), ph ^ 1)  # fresh barriers count as phase 1 complete
        m0 = (i_start + j) * BM
        row = q_row0 + m0
        if LSE_TMA:  # lse rides with Q (needed for P), delta with dO (needed for dS)
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + lse_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_bufs.index(s))
            tma.async_copy_global_to_shared(lse_desc, [bh, m0], q_ready.index(s), lse_bufs.index(s))
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes + delta_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(s), do_bufs.index(s))
            tma.async_copy_global_to_shared(delta_desc, [bh, m0], do_ready.index(s), delta_bufs.index(s))
        else:
            mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(s), q_bufs.index(s))
            mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(do_desc, [row, col], do_ready.index(s), do_bufs.index(s))


@gluon.jit
def _dq_partition(dq_desc, dq_bufs, dq_ready, dq_empty, q_row0, col, i_start, n_local, DQ_BUFS: gl.constexpr):
    BM: gl.constexpr = dq_desc.block_type.shape[0]
    for j in range(n_local):
        b = j % DQ_BUFS
        ph = (j // DQ_BUFS) & 1
        mbarrier.wait(dq_ready.index(b), ph)
        _tma_reduce_add(dq_desc, [q_row0 + (i_start + j) * BM, col], dq_bufs.index(b))
        tma.store_wait(0)  # the smem tile has been read: the buffer may be reused
        mbarrier.arrive(dq_empty.index(b), count=1)
    tma.store_wait(0)


@gluon.jit
def _bwd_tile(j, m0, n0, dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, q_ready,
              do_ready, qdo_empty, dq_ready, dq_empty, LSE, DELTA, lse_row0, qk_scale, zero_s, zero_dq,
              BM: gl.constexpr, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr,
              NUM_WARPS: gl.constexpr, MASK: gl.constexpr, LSE_TMA: gl.constexpr, DQ_EARLY: gl.constexpr):
    """One (key block, query block m0) tile; j is the ring position.  MASK: the tile straddles the diagonal."""
    s_layout: gl.constexpr = _mma_layout(BN, BM, NUM_WARPS)
    kv_layout: gl.constexpr = _mma_layout(BN, D, NUM_WARPS)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    s = j % STAGES
    ph = (j // STAGES) & 1
    q_buf = q_bufs.index(s)
    do_buf = do_bufs.index(s)
    if not LSE_TMA:
        offs_m = gl.arange(0, BM, layout=col_layout)
        lse = gl.load(LSE + lse_row0 + m0 + offs_m) * 1.4426950408889634
        delta = gl.load(DELTA + lse_row0 + m0 + offs_m)

    mbarrier.wait(q_ready.index(s), ph)
    st = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    mbarrier.wait(do_ready.index(s), ph)
    dpt = warpgroup_mma(v_smem, do_buf.permute((1, 0)), zero_s, use_acc=False, is_async=True)
    if LSE_TMA:
        lse = lse_bufs.index(s)._reinterpret(gl.float32, [BM], vec_layout).load(col_layout) * 1.4426950408889634
    # DQ_EARLY: the previous tile's dK GEMM is still in flight here; this wait retires it too (in order)
    st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if MASK:  # S^T[key n, query m]: keep n <= m
        keys = n0 + gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        qs = m0 + gl.arange(0, BM, layout=col_layout)
        pt = gl.where(gl.expand_dims(keys, 1) <= gl.expand_dims(qs, 0), pt, 0.0)
    pt16 = pt.to(gl.bfloat16)
    dv = warpgroup_mma(gl.convert_layout(pt16, a_layout), do_buf, dv, is_async=True)
    if LSE_TMA:
        delta = delta_bufs.index(s)._reinterpret(gl.float32, [BM], vec_layout).load(col_layout)
    dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
    dst16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(gl.bfloat16)
    ds_smem.store(dst16)
    fence_async_shared()
    _partition_barrier()  # both warpgroups' halves of dS^T are in smem before either reads all of it
    if DQ_EARLY:
        # Both warpgroups are past their S-wait, so the previous tile's dK GEMM (last reader of its Q) is done.
        mbarrier.arrive(qdo_empty.index((j + STAGES - 1) % STAGES), count=1, pred=j > 0)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
        dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_buf, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv, dq))  # dK stays in flight
    else:
        dk = warpgroup_mma(gl.convert_layout(dst16, a_layout), q_buf, dk, is_async=True)
        dq = warpgroup_mma(ds_smem.permute((1, 0)), k_smem, zero_dq, use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))

    b = j % DQ_BUFS
    mbarrier.wait(dq_empty.index(b), ((j // DQ_BUFS) & 1) ^ 1)
    dq_bufs.index(b).store(dq)
    fence_async_shared()
    # After this barrier every warp's dQ wgmma of this tile is done: dS^T smem is free (and, without
    # DQ_EARLY, Q_i/dO_i too).
    _partition_barrier()
    mbarrier.arrive(dq_ready.index(b), count=1)
    if not DQ_EARLY:
        mbarrier.arrive(qdo_empty.index(s), count=1)
    return dk, dv


@gluon.jit
def _compute_partition(k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, kv_bar, q_ready,
                       do_ready, qdo_empty, dq_ready, dq_empty, LSE, DELTA, DK, DV, lse_row0, kv_row, n0, col,
                       row_stride, i_start, n_local, qk_scale, sm_scale, BM: gl.constexpr, BN: gl.constexpr,
                       D: gl.constexpr, STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, NUM_WARPS: gl.constexpr,
                       CAUSAL: gl.constexpr, LSE_TMA: gl.constexpr, DQ_EARLY: gl.constexpr):
    s_layout: gl.constexpr = _mma_layout(BN, BM, NUM_WARPS)    # S^T, dP^T: [BN, BM]
    kv_layout: gl.constexpr = _mma_layout(BN, D, NUM_WARPS)    # dK, dV:   [BN, D]
    dq_layout: gl.constexpr = _mma_layout(BM, D, NUM_WARPS)    # dQ_i:     [BM, D]

    dk = gl.zeros([BN, D], gl.float32, kv_layout)
    dv = gl.zeros([BN, D], gl.float32, kv_layout)
    zero_s = gl.zeros([BN, BM], gl.float32, s_layout)
    zero_dq = gl.zeros([BM, D], gl.float32, dq_layout)
    if DQ_EARLY:  # dK is carried across tiles as an in-flight wgmma accumulator
        dk = warpgroup_mma_init(dk)
    mbarrier.wait(kv_bar, 0)
    j0 = 0
    if CAUSAL:  # the BN // BM query blocks on the diagonal, masked
        for j in range(BN // BM):
            dk, dv = _bwd_tile(j, (i_start + j) * BM, n0, dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs,
                               ds_smem, dq_bufs, q_ready, do_ready, qdo_empty, dq_ready, dq_empty, LSE, DELTA, lse_row0,
                               qk_scale, zero_s, zero_dq, BM, BN, D, STAGES, DQ_BUFS, NUM_WARPS, True, LSE_TMA,
                               DQ_EARLY)
        j0 = BN // BM
    for j in range(j0, n_local):
        dk, dv = _bwd_tile(j, (i_start + j) * BM, n0, dk, dv, k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs,
                           ds_smem, dq_bufs, q_ready, do_ready, qdo_empty, dq_ready, dq_empty, LSE, DELTA, lse_row0,
                           qk_scale, zero_s, zero_dq, BM, BN, D, STAGES, DQ_BUFS, NUM_WARPS, False, LSE_TMA, DQ_EARLY)
    if DQ_EARLY:
        dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk, ))

    rows = kv_row + gl.arange(0, BN, layout=gl.SliceLayout(1, kv_layout))
    cols = col + gl.arange(0, D, layout=gl.SliceLayout(0, kv_layout))
    offs = gl.expand_dims(rows.to(gl.int64) * row_stride, 1) + gl.expand_dims(cols, 0)
    gl.store(DK + offs, (dk * sm_scale).to(gl.bfloat16))
    gl.store(DV + offs, dv.to(gl.bfloat16))


@gluon.jit
def gluon_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, lse_desc, delta_desc, DK, DV, LSE, DELTA, seqlen, heads,
                     qk_scale, sm_scale, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                     DQ_BUFS: gl.constexpr, NUM_WARPS: gl.constexpr, CAUSAL: gl.constexpr, LSE_TMA: gl.constexpr,
                     DQ_EARLY: gl.constexpr):
    # q/k/v/do descriptors: bf16 views (B*S, H*D), blocks [BM|BN, D]; dq_desc: fp32 (B*S, H*D), [BM, D];
    # lse/delta descriptors: fp32 (B*H, S), blocks [1, BM], unswizzled (used only with LSE_TMA).
    if CAUSAL:  # grid (B*H, S/BN): all heads' longest key blocks (pid_n = 0: every query block) go first
        bh = gl.program_id(0)
        pid_n = gl.program_id(1)
    else:       # grid (S/BN, B*H): the CTAs of one head run together and share its Q/dO stream in L2
        pid_n = gl.program_id(0)
        bh = gl.program_id(1)
    batch = bh // heads
    head = bh % heads
    q_row0 = batch * seqlen
    n0 = pid_n * BN
    kv_row = q_row0 + n0
    col = head * D
    i_start, n_local = _q_range(pid_n, seqlen, BM, BN, CAUSAL)
    lse_row0 = bh.to(gl.int64) * seqlen

    k_smem = gl.allocate_shared_memory(k_desc.dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, v_desc.block_type.shape, v_desc.layout)
    q_bufs = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_bufs = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    if LSE_TMA:
        lse_bufs = gl.allocate_shared_memory(lse_desc.dtype, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
        delta_bufs = gl.allocate_shared_memory(delta_desc.dtype, [STAGES] + delta_desc.block_type.shape,
                                               delta_desc.layout)
    else:  # placeholders, never touched
        lse_bufs = q_bufs
        delta_bufs = do_bufs
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16)
    ds_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BM], ds_layout)
    dq_bufs = gl.allocate_shared_memory(dq_desc.dtype, [DQ_BUFS] + dq_desc.block_type.shape, dq_desc.layout)

    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for j in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(j), count=1)
        mbarrier.init(do_ready.index(j), count=1)
        mbarrier.init(qdo_empty.index(j), count=1)
    for j in gl.static_range(DQ_BUFS):
        mbarrier.init(dq_ready.index(j), count=1)
        mbarrier.init(dq_empty.index(j), count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_compute_partition, (k_smem, v_smem, q_bufs, do_bufs, lse_bufs, delta_bufs, ds_smem, dq_bufs, kv_bar, q_ready,
                              do_ready, qdo_empty, dq_ready, dq_empty, LSE, DELTA, DK, DV, lse_row0, kv_row, n0, col,
                              heads * D, i_start, n_local, qk_scale, sm_scale, BM, BN, D, STAGES, DQ_BUFS, NUM_WARPS,
                              CAUSAL, LSE_TMA, DQ_EARLY)),
        (_load_partition, (q_desc, k_desc, v_desc, do_desc, lse_desc, delta_desc, k_smem, v_smem, q_bufs, do_bufs,
                           lse_bufs, delta_bufs, kv_bar, q_ready, do_ready, qdo_empty, q_row0, kv_row, col, bh, i_start,
                           n_local, STAGES, LSE_TMA)),
        (_dq_partition, (dq_desc, dq_bufs, dq_ready, dq_empty, q_row0, col, i_start, n_local, DQ_BUFS)),
    ], [1, 1], [24, 24])


# ---------------------------------------------------------------------------------------------------
# Variants and host side
# ---------------------------------------------------------------------------------------------------
# (D, BM, BN, STAGES, DQ_BUFS, LSE_TMA, DQ_EARLY).  8 warps in the default partition plus two 1-warp
# workers = 3 warpgroups (.reqntid 384); Triton derives `.maxnreg 168` itself from the requested worker
# registers (168 * 384 = 24 * 128 + 240 * 256: the compute warpgroups setmaxnreg to 240, FA3's 240/240/24
# split).  CAUSAL is a third constexpr, chosen per launch (every variant runs both ways).
#   LSE_TMA:  lse / delta of a query block come by TMA with Q / dO into the ring (FA3) instead of
#             16 + 16 scalar global loads per thread per tile; the compute warps read them from smem.
#   DQ_EARLY: issue dQ before dK and wait only for dV, dQ; the dK GEMM overlaps the dQ epilogue
#             (smem store, barrier) and the next tile's waits, and is retired by the next S wait; the
#             ring slot of Q_i is then freed one tile later, so it wants STAGES >= 3.
# Most informative first: --check/--bench stop starting variants when their time budget is spent.
VARIANTS = (
    (64, 64, 128, 2, 2, False, False),    # v0: the first run's best D=64 (baseline)
    (128, 64, 128, 2, 1, False, False),   # v1: the first run's best D=128 at S >= 2048 (baseline)
    (64, 64, 128, 3, 2, True, True),      # v2: D=64, TMA'd lse/delta + early dQ
    (128, 64, 128, 3, 1, True, True),     # v3: D=128, TMA'd lse/delta + early dQ
    (128, 64, 128, 2, 1, True, True),     # v4: D=128, as v3 with 2 stages (36 KiB less smem, shorter prefetch)
    (64, 64, 128, 3, 2, True, False),     # v5: D=64, TMA'd lse/delta only (isolates LSE_TMA against v2)
    (64, 128, 128, 2, 1, True, True),     # v6: D=64, FA3's 128 x 128 tile (spills 428 B -> ~76 B with lse/delta in smem)
)
NUM_WARPS = 8


def _tag(v):
    d, bm, bn, st, dqb, lt, de = v
    return (f"D={d:3d} BM={bm:3d} BN={bn} st={st} dqb={dqb}" + (" lseTMA" if lt else "")
            + (" dqEarly" if de else ""))


def _layouts(d, bm, bn):
    bf16 = gl.NVMMASharedLayout.get_default_for([bm, d], gl.bfloat16)
    kv = gl.NVMMASharedLayout.get_default_for([bn, d], gl.bfloat16)
    f32 = gl.NVMMASharedLayout.get_default_for([bm, d], gl.float32)
    vec = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)  # lse/delta [1, BM] rows
    return bf16, kv, f32, vec


def _constexprs(v, causal=False):
    d, bm, bn, st, dqb, lt, de = v
    return dict(D=d, BM=bm, BN=bn, STAGES=st, DQ_BUFS=dqb, NUM_WARPS=NUM_WARPS, CAUSAL=causal, LSE_TMA=lt,
                DQ_EARLY=de)


def compile_offline(v, causal=False):
    """triton.compile of the Gluon kernel for sm_90 on a CPU-only machine (GluonASTSource, not ASTSource)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    d, bm, bn = v[:3]
    qlay, kvlay, f32lay, veclay = _layouts(d, bm, bn)
    desc = lambda dt, block, lay: f"tensordesc<{dt}{list(block)},{lay!r}>"  # what the launcher's specialiser emits
    sig = dict(q_desc=desc("bf16", [bm, d], qlay), k_desc=desc("bf16", [bn, d], kvlay),
               v_desc=desc("bf16", [bn, d], kvlay), do_desc=desc("bf16", [bm, d], qlay),
               dq_desc=desc("fp32", [bm, d], f32lay), lse_desc=desc("fp32", [1, bm], veclay),
               delta_desc=desc("fp32", [1, bm], veclay), DK="*bf16", DV="*bf16", LSE="*fp32", DELTA="*fp32",
               seqlen="i32", heads="i32", qk_scale="fp32", sm_scale="fp32")
    cx = _constexprs(v, causal)
    sig.update(dict.fromkeys(cx, "constexpr"))
    div16 = [["tt.divisibility", 16]]
    names = list(gluon_bwd_kernel.arg_names)
    attrs = {(names.index(n), ): div16 for n in ("DK", "DV", "LSE", "DELTA")}
    src = GluonASTSource(gluon_bwd_kernel, {n: sig[n] for n in names}, cx, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NUM_WARPS))


def ptxas_stats(ptx):
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"], capture_output=True, text=True)
    log = out.stdout + out.stderr
    if out.returncode:
        return f"ptxas failed: {log.strip().splitlines()[-1][:200]}"
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    warns = sorted(set(re.sub(r"^.*?warning\s*:\s*", "", ln).strip()[:160] for ln in log.splitlines()
                       if "warning" in ln.lower()))
    return (f"ptxas regs(kernel-wide cap) {regs.group(1) if regs else '?'}, spills st/ld "
            f"{'/'.join(spill.groups()) if spill else '?'} B, stack {stack.group(1) if stack else '?'} B"
            + "".join(f"\n      ptxas WARNING: {w}" for w in warns))


def cmd_compile():
    cache = tempfile.TemporaryDirectory(prefix="gluon_bwd_probe_cache_")  # compile for real, not from a cache
    saved = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = cache.name
    try:
        _compile_all()
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
        cache.cleanup()


def _compile_all():
    print(f"triton {triton.__version__} ({os.path.dirname(triton.__file__)}), target cuda sm_90a, "
          f"{NUM_WARPS} compute warps + load warp + dq warp", flush=True)
    n_ok = 0
    for v in VARIANTS:
        for causal in (False, True):
            tag = f"{_tag(v)} {'causal' if causal else 'full  '}"
            t0 = time.time()
            try:
                ck = compile_offline(v, causal)
            except Exception as e:
                lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
                print(f"{tag}: FAILED {type(e).__name__}: " + " | ".join(lines[:6])[:600], flush=True)
                continue
            n_ok += 1
            ptx = ck.asm["ptx"]
            setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
            directives = " ".join(ln.strip() for ln in ptx.splitlines() if re.match(r"\s*\.(reqntid|maxnreg)\b", ln))
            counts = {k: ptx.count(p) for k, p in (("wgmma", "wgmma.mma_async"), ("tma_load", "cp.async.bulk.tensor"),
                                                     ("tma_reduce", "cp.reduce.async.bulk.tensor"),
                                                     ("bar.sync", "bar.sync"), ("ld.global", "ld.global"))}
            print(f"{tag}: OK {time.time() - t0:.1f}s smem {ck.metadata.shared / 1024:.1f} KiB "
                  f"warps {ck.metadata.num_warps} [{directives}] setmaxnreg {setmaxnreg} PTX {counts}", flush=True)
            print(f"    {ptxas_stats(ptx)}", flush=True)
    print(f"{n_ok}/{2 * len(VARIANTS)} (variant, causal) kernels compiled", flush=True)
    launch_path_check()


def launch_path_check():
    """The signature the JIT launcher would build (its binder run on CPU tensors and host TensorDescriptors)
    must equal the hand-written one of compile_offline; then compile that.  Internal APIs: best effort."""
    try:
        import torch
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
        from triton.experimental.gluon._runtime import GluonASTSource
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        var = VARIANTS[3]
        d = var[0]
        b, s, h = 2, 1024, 4
        q, k, v, do = (torch.zeros(b, s, h, d, dtype=torch.bfloat16) for _ in range(4))
        lse, delta = torch.zeros(b, h, s), torch.zeros(b, h, s)
        descs = _descs(var, q, k, v, do, torch.zeros(b, s, h, d), lse, delta)
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        fn = gluon_bwd_kernel
        kw = dict(**_constexprs(var, True), num_warps=NUM_WARPS)
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        bound, spec, options = binder(*descs, k, v, lse, delta, s, h, 0.1, 0.1, **kw)
        options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
        mine = compile_offline(var, True).src.signature
        same = all(signature[n] == mine[n] for n in mine)
        ck = triton.compile(GluonASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
        print(f"launch path ({_tag(var)} causal): JIT binder signature {'==' if same else '!='} offline signature; compiled, "
              f"TMA boxes {[m['block_size'] for m in ck.metadata.tensordesc_meta]}", flush=True)
    except Exception as e:
        print(f"launch path check: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)


# ---------------------------------- GPU side ----------------------------------
# Each variant runs in its own subprocess (`--worker I`): a kernel that deadlocks on its mbarriers
# would hang the CUDA context for good; the parent kills the child after WORKER_TIMEOUT_S and goes on.
WORKER_TIMEOUT_S = 75     # backstop; a launch that does not finish in HANG_S is reported by the worker itself
HANG_S = 10
GPU_BUDGET_S = 180        # the variants' share of the < 4 min a --check --bench run may take
BENCH_SHAPES = [(d, h, s) for d, h in ((64, 32), (128, 16)) for s in (1024, 2048, 4096, 8192)]  # B = 16384 // S


def _descs(var, q, k, v_, do, dq_acc, lse, delta):
    """Host TMA descriptors: bf16/fp32 (B*S, H*D) views of BSHD tensors, lse/delta as (B*H, S)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    d, bm, bn = var[:3]
    b, s, h, _ = q.shape
    qlay, kvlay, f32lay, veclay = _layouts(d, bm, bn)
    two_d = lambda t: t.view(b * s, h * d)
    return (TensorDescriptor.from_tensor(two_d(q), [bm, d], qlay),
            TensorDescriptor.from_tensor(two_d(k), [bn, d], kvlay),
            TensorDescriptor.from_tensor(two_d(v_), [bn, d], kvlay),
            TensorDescriptor.from_tensor(two_d(do), [bm, d], qlay),
            TensorDescriptor.from_tensor(two_d(dq_acc), [bm, d], f32lay),
            TensorDescriptor.from_tensor(lse.view(b * h, s), [1, bm], veclay),
            TensorDescriptor.from_tensor(delta.view(b * h, s), [1, bm], veclay))


def make_launcher(v, q, k, v_, do, lse, delta, causal=False):
    """Returns run() -> (dq bf16, dk, dv).  Inputs BSHD bf16 contiguous; lse/delta (B, H, S) fp32 contiguous."""
    import torch
    d, bm, bn, st, _, _, dq_early = v
    b, s, h, dd = q.shape
    assert dd == d and s % bm == 0 and s % bn == 0 and bn % bm == 0
    assert st >= 2 or not dq_early  # DQ_EARLY frees a ring slot one tile late: 1 stage would deadlock
    assert lse.is_contiguous() and delta.is_contiguous()
    dq_acc = torch.zeros(b, s, h, d, device=q.device, dtype=torch.float32)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v_, float("nan"))
    descs = _descs(v, q, k, v_, do, dq_acc, lse, delta)
    scale = d ** -0.5
    grid = (b * h, s // bn) if causal else (s // bn, b * h)
    cx = _constexprs(v, causal)

    def run():
        dq_acc.zero_()
        gluon_bwd_kernel[grid](*descs, dk, dv, lse, delta, s, h, scale * LOG2E, scale, **cx, num_warps=NUM_WARPS)
        return (dq_acc * scale).to(torch.bfloat16), dk, dv

    return run


def reference(q, k, v, do, causal=False):
    """float64 softmax attention backward; returns (dq, dk, dv, o bf16, lse fp32 (B, H, S))."""
    import torch
    scale = q.shape[-1] ** -0.5
    qd, kd, vd, dod = (t.double().transpose(1, 2) for t in (q, k, v, do))  # B H S D
    sc = qd @ kd.transpose(-1, -2) * scale
    if causal:
        s = q.shape[1]
        sc = sc.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(sc, -1)
    p = torch.exp(sc - lse[..., None])
    o = p @ vd
    dp = dod @ vd.transpose(-1, -2)
    ds = p * (dp - (dod * o).sum(-1, keepdim=True))
    dq, dk, dv = ds @ kd * scale, ds.transpose(-1, -2) @ qd * scale, p.transpose(-1, -2) @ dod
    back = lambda t: t.transpose(1, 2).contiguous()
    return back(dq), back(dk), back(dv), back(o).to(torch.bfloat16), lse.float().contiguous()


def _inputs(b, s, h, d, device, seed=0):
    import torch
    g = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4)]


def _delta(o, do):
    return (o.float() * do.float()).sum(-1).transpose(1, 2).contiguous()


def _lse_and_o(q, k, v, causal):
    """fp32 natural-log lse (B, H, S) of the scaled scores and O (bf16), one head at a time (bench inputs)."""
    import torch
    b, s, h, d = q.shape
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    o = torch.empty_like(q)
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1) if causal else None
    for hh in range(h):
        sc = torch.einsum("bsd,btd->bst", q[:, :, hh].float(), k[:, :, hh].float()) * d ** -0.5
        if causal:
            sc.masked_fill_(mask, float("-inf"))
        lse[:, hh] = torch.logsumexp(sc, -1)
        o[:, :, hh] = (torch.exp(sc - lse[:, hh, :, None]) @ v[:, :, hh].float()).to(q.dtype)
        del sc
    return lse, o


def _finish_or_die(tag, timeout=HANG_S):
    """Wait for the GPU with a deadline: a kernel stuck on an mbarrier would block synchronize() forever."""
    import torch
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > timeout:
            _emit(kind="hang", where=tag, seconds=timeout)
            os._exit(3)
        time.sleep(0.005)


def _rel_errs(got, ref):
    return [((g.double() - r).abs().max() / r.abs().max()).item() for g, r in zip(got, ref)]


def _time_ms(fn, iters=30, warmup=5):
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z))
    times.sort()
    return times[len(times) // 2]


def _emit(**kw):
    import json
    print("RESULT " + json.dumps(kw), flush=True)


def worker(idx, check, bench):
    """One variant, in a child process: correctness (B=2, H=4, S=1024; full and causal) and/or timings."""
    import torch
    var = VARIANTS[idx]
    d = var[0]
    if check:
        for causal in (False, True):
            try:
                q, k, v, do = _inputs(2, 1024, 4, d, "cuda")
                rdq, rdk, rdv, o, lse = reference(q, k, v, do, causal)
                t0 = time.time()
                got = make_launcher(var, q, k, v, do, lse, _delta(o, do), causal)()
                _finish_or_die(f"check causal={causal}")
                errs = _rel_errs(got, (rdq, rdk, rdv))
                _emit(kind="check", variant=idx, causal=causal, errs=errs, first_call_s=time.time() - t0)
            except Exception as e:
                _emit(kind="check", variant=idx, causal=causal, error=f"{type(e).__name__}: {str(e).strip()[:400]}")
                traceback.print_exc(limit=3)
    if bench:
        for dd, h, s in BENCH_SHAPES:
            if dd != d:
                continue
            b = 16384 // s
            q, k, v, do = _inputs(b, s, h, d, "cuda")
            for causal in (False, True):
                try:
                    lse, o = _lse_and_o(q, k, v, causal)
                    delta = _delta(o, do)
                    run = make_launcher(var, q, k, v, do, lse, delta, causal)
                    torch.cuda.synchronize()
                    run()
                    _finish_or_die(f"bench S={s} causal={causal}")
                    ms = _time_ms(run)
                    _emit(kind="bench", variant=idx, D=d, S=s, B=b, H=h, causal=causal, ms=ms)
                except Exception as e:
                    _emit(kind="bench", variant=idx, D=d, S=s, B=b, H=h, causal=causal,
                          error=f"{type(e).__name__}: {str(e).strip()[:300]}")
                finally:
                    torch.cuda.empty_cache()
            # torch's rowsum(dO*O), which cuDNN's backward does itself: one number per (D, S) for the notes
            if idx == min(i for i, vv in enumerate(VARIANTS) if vv[0] == d):
                _emit(kind="delta_ms", D=d, S=s, ms=_time_ms(lambda: _delta(o, do)))


def _flops(b, h, s, d, causal=False):
    return 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)


def cudnn_side(check, bench):
    """SDPA cuDNN backward in the parent process: error yardstick and timings (full and causal)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    out_rows = {}
    if check:
        for d in (64, 128):
            for causal in (False, True):
                try:
                    q, k, v, do = _inputs(2, 1024, 4, d, "cuda")
                    rdq, rdk, rdv, _, _ = reference(q, k, v, do, causal)
                    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    got = [t.transpose(1, 2) for t in torch.autograd.grad(out, (qt, kt, vt), do.transpose(1, 2))]
                    e = _rel_errs(got, (rdq, rdk, rdv))
                    print(f"  {'SDPA cuDNN (yardstick)':44s} D={d:3d} {'causal' if causal else 'full  '}: "
                          f"dq {e[0]:.2e} dk {e[1]:.2e} dv {e[2]:.2e}", flush=True)
                except Exception as e:
                    print(f"  D={d:3d} causal={causal} SDPA cuDNN: FAILED {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
    if bench:
        for d, h, s in BENCH_SHAPES:
            b = 16384 // s
            for causal in (False, True):
                try:
                    q, k, v, do = _inputs(b, s, h, d, "cuda")
                    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    dot = do.transpose(1, 2)
                    ms = _time_ms(lambda: torch.autograd.grad(out, (qt, kt, vt), dot, retain_graph=True))
                    out_rows[(d, s, causal)] = _flops(b, h, s, d, causal) / ms / 1e9
                except Exception as e:
                    print(f"  D={d} S={s} causal={causal} SDPA cuDNN: FAILED {type(e).__name__}: {str(e)[:200]}",
                          flush=True)
                finally:
                    torch.cuda.empty_cache()
    return out_rows


def cmd_gpu(check, bench):
    import json
    import torch
    print(f"GPU run: triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    for i, var in enumerate(VARIANTS):
        print(f"  v{i}: {_tag(var)}", flush=True)
    if check:
        print("--check: B=2 H=4 S=1024; max|err| / max|ref| against a float64 reference (bf16: <~1e-2 expected)",
              flush=True)
    results = []
    t_start = time.time()
    for idx, var in enumerate(VARIANTS):
        name = f"v{idx} {_tag(var)}"
        left = GPU_BUDGET_S - (time.time() - t_start)
        if left < 20:
            print(f"  {name}: skipped (time budget of {GPU_BUDGET_S}s for the variants spent)", flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", str(idx)] + (["--check"] if check else []) + \
              (["--bench"] if bench else [])
        t0 = time.time()
        try:
            timeout = min(WORKER_TIMEOUT_S, left)
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            text, status = proc.stdout + "\n" + proc.stderr, f"exit {proc.returncode}"
        except subprocess.TimeoutExpired as e:
            text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status = f"KILLED after {timeout:.0f}s (hang, or too slow for the time budget)"
        mine = []
        for ln in text.splitlines():
            if ln.startswith("RESULT "):
                try:
                    mine.append(json.loads(ln[7:]))
                except ValueError:
                    print(f"  unparsable worker line: {ln[:200]}", flush=True)
        results += mine
        for r in mine:
            if r["kind"] == "hang":
                print(f"  {name}: HANG in {r['where']} (no completion after {r['seconds']}s; "
                      "mbarrier deadlock?) -- worker killed", flush=True)
            if r["kind"] == "check":
                mode = "causal" if r["causal"] else "full  "
                if "error" in r:
                    print(f"  {name:44s} {mode}: FAILED {r['error']}", flush=True)
                else:
                    e = r["errs"]
                    bad = any(not (x <= 1e-2) for x in e)
                    print(f"  {name:44s} {mode}: dq {e[0]:.2e} dk {e[1]:.2e} dv {e[2]:.2e}  {'BAD' if bad else 'ok'}"
                          f"  (first call incl. JIT {r['first_call_s']:.1f}s)", flush=True)
        if status != "exit 0" or not mine:
            others = [ln for ln in text.splitlines() if not ln.startswith("RESULT ")]
            print(f"  {name}: worker {status} ({time.time() - t0:.0f}s); last output:\n    "
                  + "\n    ".join(others[-8:]), flush=True)
        else:
            print(f"  {name}: worker done in {time.time() - t0:.0f}s", flush=True)
    cudnn = cudnn_side(check, bench)
    if not bench:
        return
    print("\n--bench: B*S = 16384, H=32 (D=64) / H=16 (D=128); TFLOP/s with FLOPs = 2.5 * 4*B*H*S^2*D (halved for\n"
          "causal); median of 30 CUDA-event timings after 5 warm-ups.  vN = zero fp32 dQ + Gluon kernel + dQ\n"
          "scale/cast, lse and delta given; cuDNN's backward computes its own delta (its cost: the delta column,\n"
          "in % of the best variant's time).  best = best variant of the row.", flush=True)
    table, delta_ms = {}, {}
    for r in results:
        if r["kind"] == "delta_ms":
            delta_ms[(r["D"], r["S"])] = r["ms"]
        if r["kind"] == "bench":
            if "error" in r:
                print(f"  D={r['D']} S={r['S']} causal={r['causal']} v{r['variant']}: FAILED {r['error']}", flush=True)
                continue
            row = table.setdefault((r["D"], r["S"], r["causal"]), {})
            row[f"v{r['variant']}"] = (_flops(r["B"], r["H"], r["S"], r["D"], r["causal"]) / r["ms"] / 1e9, r["ms"])
    for key, val in cudnn.items():
        table.setdefault(key, {})["cuDNN"] = (val, None)
    for d in (64, 128):
        vcols = [f"v{i}" for i, vv in enumerate(VARIANTS) if vv[0] == d]
        keys = sorted(k for k in table if k[0] == d)
        if not keys:
            continue
        print(f"\n    D     S causal     cuDNN" + "".join(f"{c:>8s}" for c in vcols) + "    best  best/cuDNN  delta%",
              flush=True)
        for key in keys:
            row = table[key]
            got = {c: row[c] for c in vcols if c in row}
            best = max(got, key=lambda c: got[c][0]) if got else None
            cu = row.get("cuDNN", (None, None))[0]
            dl = delta_ms.get(key[:2])
            line = f"  {key[0]:3d} {key[1]:5d} {'yes' if key[2] else 'no ':>6s} " + \
                   (f"{cu:9.0f}" if cu else f"{'-':>9s}") + \
                   "".join(f"{got[c][0]:8.0f}" if c in got else f"{'-':>8s}" for c in vcols)
            if best:
                line += f"{best:>8s}" + (f"{got[best][0] / cu:12.2f}" if cu else f"{'-':>12s}") + \
                        (f"{100 * dl / got[best][1]:8.0f}" if dl else f"{'-':>8s}")
            print(line, flush=True)


def cmd_emulate():
    """CPU: the kernel's tile loop in torch (same transposes, exp2 folding, causal start block and diagonal mask,
    bf16 roundings of P^T and dS^T, fp32 dQ reduction) against the float64 reference.  Checks the algebra,
    not the Gluon code."""
    import torch
    for d in (64, 128):
        for causal in (False, True):
            b, s, h, bm, bn = 1, 512, 2, 64, 128
            q, k, v, do = _inputs(b, s, h, d, "cpu")
            rdq, rdk, rdv, o, lse = reference(q, k, v, do, causal)
            delta = _delta(o, do)
            scale = d ** -0.5
            dq_acc = torch.zeros(b, s, h, d)
            dk, dv = torch.empty(b, s, h, d), torch.empty(b, s, h, d)
            f = lambda t: t.float()
            for bb in range(b):
                for hh in range(h):
                    for n0 in range(0, s, bn):
                        kt, vt = k[bb, n0:n0 + bn, hh], v[bb, n0:n0 + bn, hh]
                        dk_acc, dv_acc = torch.zeros(bn, d), torch.zeros(bn, d)
                        i_start = n0 // bm if causal else 0          # _q_range
                        for j in range(s // bm - i_start):
                            m0 = (i_start + j) * bm
                            qt, dot = q[bb, m0:m0 + bm, hh], do[bb, m0:m0 + bm, hh]
                            st = f(kt) @ f(qt).T
                            pt = torch.exp2(st * (scale * LOG2E) - lse[bb, hh, m0:m0 + bm][None, :] * LOG2E)
                            if causal and j < bn // bm:              # MASK tiles: keep key <= query
                                keys = torch.arange(n0, n0 + bn)[:, None]
                                qs = torch.arange(m0, m0 + bm)[None, :]
                                pt = torch.where(keys <= qs, pt, torch.zeros(()))
                            dpt = f(vt) @ f(dot).T
                            pt16 = pt.bfloat16()
                            dv_acc += f(pt16) @ f(dot)
                            ds16 = (pt * (dpt - delta[bb, hh, m0:m0 + bm][None, :])).bfloat16()
                            dk_acc += f(ds16) @ f(qt)
                            dq_acc[bb, m0:m0 + bm, hh] += f(ds16).T @ f(kt)
                        dk[bb, n0:n0 + bn, hh] = (dk_acc * scale).bfloat16().float()
                        dv[bb, n0:n0 + bn, hh] = dv_acc.bfloat16().float()
            e = _rel_errs(((dq_acc * scale).bfloat16(), dk, dv), (rdq, rdk, rdv))
            print(f"  emulated tile loop D={d:3d} {'causal' if causal else 'full  '} (B={b} H={h} S={s}): "
                  f"max|err|/max|ref| dq {e[0]:.2e} dk {e[1]:.2e} dv {e[2]:.2e}", flush=True)


def jax_triton_replay():
    """jax-triton 0.3.1 (triton_lib.get_or_create_triton_kernel) compiles a kernel as
    code_generator.ast_to_ttir(fn, compiler.ASTSource(...)) then backend.make_ttir -> make_ttgir -> make_llir
    -> make_ptx.  Replay those steps on the Gluon kernel (with the probe's own signature, descriptors
    included, which jax-triton could not even express) to see where they stop."""
    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import code_generator, compiler
    from triton.compiler.compiler import make_backend
    var = VARIANTS[1]
    fn = gluon_bwd_kernel
    sig = dict(compile_offline(var).src.signature)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    options = backend.parse_options({"num_warps": NUM_WARPS, "num_stages": 3, "num_ctas": 1, "debug": False,
                                     "enable_fp_fusion": True})
    ctx = libtriton.ir.context()
    libtriton.ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    print(f"jax-triton 0.3.1 compile path replayed on the Gluon kernel (triton {triton.__version__}); "
          f"isinstance(kernel, triton.JITFunction) = {isinstance(fn, triton.JITFunction)}", flush=True)
    err = tempfile.TemporaryFile("w+")   # MLIR prints its diagnostics on fd 2: catch them
    sys.stderr.flush()
    fd2 = os.dup(2)
    os.dup2(err.fileno(), 2)
    try:
        code_generator.ast_to_ttir(fn, compiler.ASTSource(fn, constexprs=_constexprs(var), signature=sig, attrs={}),
                                   options=options, codegen_fns=backend.get_codegen_implementation(options),
                                   context=ctx, module_map=backend.get_module_map())
        outcome = "OK (unexpected)"
    except Exception as e:
        outcome = f"FAILED {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}"
    finally:
        os.dup2(fd2, 2)
        os.close(fd2)
    err.seek(0)
    diags = sorted(set(re.sub(r"^.*?error: ", "", ln).split(": ")[-1].strip() for ln in err if "error:" in ln))
    print(f"  ast_to_ttir(ASTSource): {outcome}", flush=True)
    for dgn in diags[:3]:
        print(f"    diagnostic: {dgn[:200]}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true", help="offline sm_90a compile of every variant (no GPU)")
    ap.add_argument("--emulate", action="store_true", help="CPU: the tile loop's algebra in torch vs float64")
    ap.add_argument("--jax-triton", action="store_true", help="CPU: replay jax-triton 0.3.1's compile steps")
    ap.add_argument("--check", action="store_true", help="GPU: dq/dk/dv vs a float64 reference")
    ap.add_argument("--bench", action="store_true", help="GPU: TFLOP/s vs SDPA cuDNN backward")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.check, args.bench)
        return 0
    if not (args.compile or args.emulate or args.jax_triton or args.check or args.bench):
        ap.print_help()
        return 2
    t0 = time.time()
    if args.compile:
        cmd_compile()
    if args.emulate:
        cmd_emulate()
    if args.jax_triton:
        jax_triton_replay()
    if args.check or args.bench:
        try:
            cmd_gpu(args.check, args.bench)
        except Exception:
            traceback.print_exc()
    print(f"total {time.time() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
