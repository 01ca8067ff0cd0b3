"""Launch plans of the flash kernels: grids, scalars, constexprs, outputs, launch chains.

Framework-free and shared by the torch and JAX front ends, so both compile and launch the
identical kernel variants.  Inputs: FlashShapes (validated sizes), FlashOptions (static
options) and the element strides of the arrays (torch: tensor.stride(); JAX: row-major).
The tiles come from tiles.py (tuned tables, default_config); which problems the Hopper kernels
take, from hopper.py; this module assembles the launches (plan_forward, plan_backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
from typing import Dict, Optional, Tuple

from ... import switches
from ...options import FlashOptions, dropout_threshold
from ...validation import FlashShapes
# (forget_plans and on_forget_plans: re-exported, the name tests and tuning scripts use.)
from ..launch import Launch, Output, as_int32, cdiv, forget_plans, next_pow2, on_forget_plans, plan_memo  # noqa: F401
from ..launch import row_major_strides as _contiguous
from .hopper import (EDGES_IN_LOOP_ENV, GLUON_FWD_ENV, GLUON_FWD_TILES, GLUON_FWD_WARPS, ONE_PASS_ENV,  # noqa: F401
                     ONE_PASS_TILES, ONE_PASS_WARPS, PERSISTENT_ENV, WS_BAND_ENV, WS_DKDV_BANDED_OR_PERSISTENT_TILES,
                     WS_DKDV_TILES, WS_DQ_TILES, WS_EDGES_TILE, WS_TILE, _use_tma, _warp_specializable, edges_in_loop,
                     gluon_allowed, gluon_forward, gluon_load_first, gluon_score_buffers, gluon_tile_width,
                     one_pass_backward, one_pass_persistent, persistent_backward, persistent_forward,
                     short_window_backward, short_window_forward, split_band, split_band_pays, tma_requested,
                     warp_specialize_requested, warp_specialized_backward, warp_specialized_forward, whole_array_tiles,
                     ws_band_in_loop)
from . import rules
from .segments import RANGE_FIELDS, TILE_ID_FIELDS
from .tiles import (SHORT_SEQ_BUCKETS, TUNED, TUNED_FILE_ENV, FlashConfig, SparseInfo, TileConfig,  # noqa: F401
                    causal_window_keys, default_config, tuned_key)

FAST_TANH_ENV = "DUALATTN_FAST_TANH"   # "0": the soft cap's exp2 tanh on the GPU too (softcap_mode)

SPARSE_INPUTS = ("sparse_kv_count", "sparse_kv_index", "sparse_q_order", "sparse_q_count", "sparse_q_index",
                 "sparse_k_order")
FWD_INPUTS = ("query", "key", "value", "bias", "attention_mask", "q_segment_ids", "kv_segment_ids",
              "softmax_aux", "cu_seqlens_q", "cu_seqlens_k", "dropout_seed") + SPARSE_INPUTS + (
              "q_positions", "kv_positions", "segment_ranges")


BWD_INPUTS = FWD_INPUTS + ("out", "dout", "lse", "delta")

def _seq_strides(strides: Tuple[int, ...], varlen: bool) -> Tuple[int, int, int]:
    """(batch, seq, head) element strides of a BSHD or packed (total, H, D) array."""
    if varlen:
        return 0, strides[0], strides[1]
    return strides[0], strides[1], strides[2]


def _sparse_scalars(sparse: Optional[SparseInfo]):
    if sparse is None:
        return (("sparse_stride_b", 0), ("sparse_stride_h", 0), ("sparse_kstride_b", 0), ("sparse_kstride_h", 0),
                ("num_q_blocks", 0), ("num_k_blocks", 0))
    nq, nk = sparse.num_q_blocks, sparse.num_k_blocks
    per_batch, per_head = sparse.layout_batch > 1, sparse.layout_heads > 1
    return (("sparse_stride_b", sparse.layout_heads * nq if per_batch else 0), ("sparse_stride_h", nq if per_head else 0),
            ("sparse_kstride_b", sparse.layout_heads * nk if per_batch else 0),
            ("sparse_kstride_h", nk if per_head else 0), ("num_q_blocks", nq), ("num_k_blocks", nk))


def softcap_mode(shapes: FlashShapes, options: FlashOptions, hardware_tanh: bool,
                 env: switches.Switches = switches.Switches()) -> int:
    """The SOFTCAP constexpr (rules.capped_tanh): none; the GPU's tanh.approx for 16-bit inputs on a GPU
    (hardware_tanh: the launch runs on an NVIDIA GPU, not the interpreter), unless DUALATTN_FAST_TANH=0;
    else the exp2 form, accurate to fp32."""
    if options.logits_soft_cap is None:
        return rules.SOFTCAP_NONE
    if hardware_tanh and shapes.dtype in ("float16", "bfloat16") and env.get(FAST_TANH_ENV) != "0":
        return rules.SOFTCAP_MUFU
    return rules.SOFTCAP_EXP2


def head_blocks(head_dim: int, head_dim_v: int) -> Tuple[int, int]:
    """(BLOCK_D, BLOCK_DV): the q/k and v head dims padded to powers of two, but never a tile of 32
    columns or fewer narrower than the other's: Triton 3.6 miscompiles those portable kernels on
    sm_90 (docs/lessons.md, "Narrow head-dim tiles miscompile"; all found by the GPU fuzz):
    - narrow V: wrong outputs or illegal addresses at D = 20-72 with Dv = 16-32 and unaligned rows,
      and an out-of-range shared address in the fp32 block-sparse dK/dV at D = 128, Dv = 16;
    - narrow q/k: a misaligned 16-byte shared store in the fp32 block-sparse dQ at D = 16,
      Dv = 168 (the variant jax-triton compiles, which makes a scalar equal to 1 a constexpr).
    Such a tile is widened to min(the other, 64) columns; the kernels mask the padding
    (BLOCK_D != HEAD_DIM, BLOCK_DV != HEAD_DIM_V)."""
    block_d, block_dv = (max(16, next_pow2(d)) for d in (head_dim, head_dim_v))
    if block_dv <= 32 and block_dv < block_d:
        block_dv = min(block_d, 64)
    elif block_d <= 32 and block_d < block_dv:
        block_d = min(block_dv, 64)
    return block_d, block_dv


def _common_scalars(shapes: FlashShapes, options: FlashOptions, strides: Dict[str, Tuple[int, ...]],
                    diag_shift: int, sparse: Optional[SparseInfo] = None, softcap: int = 0):
    varlen = shapes.varlen
    qb, qs, qh = _seq_strides(strides["query"], varlen)
    kb, ks, kh = _seq_strides(strides["key"], varlen)
    vb, vs, vh = _seq_strides(strides["value"], varlen)
    ob, os_, oh = _seq_strides(strides["out"], varlen)
    if varlen:
        lse_b, lse_h = 0, shapes.total_q
    else:
        lse_b, lse_h = shapes.heads_q * shapes.seqlen_q, shapes.seqlen_q

    def map_strides(name, bcast_batch, bcast_head):
        if name not in strides:
            return 0, 0, 0
        sb, sh, ss, _ = strides[name]
        # Broadcast (size-1) batch/head dims read the same rows for every program.
        return (0 if bcast_batch else sb), (0 if bcast_head else sh), ss

    bias_b, bias_h, bias_s = map_strides("bias", shapes.bias_bcast_batch, shapes.bias_bcast_head)
    mask_b, mask_h, mask_s = map_strides("attention_mask", shapes.mask_bcast_batch, shapes.mask_bcast_head)
    seg_qb = strides["q_segment_ids"][0] if "q_segment_ids" in strides else 0
    seg_kb = strides["kv_segment_ids"][0] if "kv_segment_ids" in strides else 0
    p = options.dropout_prob
    scalars = (
        ("stride_qb", qb), ("stride_qs", qs), ("stride_qh", qh),
        ("stride_kb", kb), ("stride_ks", ks), ("stride_kh", kh),
        ("stride_vb", vb), ("stride_vs", vs), ("stride_vh", vh),
        ("stride_ob", ob), ("stride_os", os_), ("stride_oh", oh),
        ("stride_lse_b", lse_b), ("stride_lse_h", lse_h),
        ("bias_stride_b", bias_b), ("bias_stride_h", bias_h), ("bias_stride_s", bias_s),
        ("mask_stride_b", mask_b), ("mask_stride_h", mask_h), ("mask_stride_s", mask_s),
        ("seg_stride_qb", seg_qb), ("seg_stride_kb", seg_kb),
    ) + _sparse_scalars(sparse) + (
        ("pos_stride_qb", strides["q_positions"][0] if "q_positions" in strides else 0),
        ("pos_stride_kb", strides["kv_positions"][0] if "kv_positions" in strides else 0),
        ("seqlen_q", shapes.seqlen_q), ("seqlen_k", shapes.seqlen_k),
        # (varlen: the packed token counts every sequence bound is clamped to: rules.sequence_bounds)
        ("total_q", shapes.total_q), ("total_k", shapes.total_k),
        ("num_heads_q", shapes.heads_q), ("diag_shift", int(diag_shift)),
        ("window_left", options.window_left or 0), ("window_right", options.window_right or 0),
        ("sm_scale", float(options.softmax_scale)), ("softcap", float(options.logits_soft_cap or 1.0)),
        ("dropout_threshold", as_int32(dropout_threshold(p))),
        ("dropout_scale", 1.0 / (1.0 - p)),
    )
    # Every q/k/v/o stride divisible by 16 elements lets the kernels vectorise row loads.
    aligned = all(s % 16 == 0 for s in (qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os_, oh))
    block_d, block_dv = head_blocks(shapes.head_dim, shapes.head_dim_v)
    constexprs = (
        ("HEAD_DIM", shapes.head_dim), ("HEAD_DIM_V", shapes.head_dim_v),
        ("BLOCK_D", block_d), ("BLOCK_DV", block_dv),
        ("STRIDES_ALIGNED", aligned),
        ("HAS_LEFT", options.window_left is not None), ("HAS_RIGHT", options.window_right is not None),
        ("SOFTCAP", softcap), ("HAS_BIAS", shapes.has_bias),
        ("HAS_MASK", shapes.has_mask), ("HAS_SEGMENTS", shapes.has_segments),
        ("NUM_SINKS", shapes.num_sinks), ("BLOCK_SINKS", max(2, next_pow2(shapes.num_sinks))),
        ("HAS_DROPOUT", p > 0.0), ("IS_VARLEN", shapes.varlen),
        # fp32 inputs: 3xTF32 dots keep fp32 accuracy; 16-bit inputs ignore this.
        ("DOT_PRECISION", "tf32x3" if shapes.dtype == "float32" else "tf32"),
        ("BLOCK_SPARSE", sparse is not None),
        # Constexprs, not scalars: jax-triton turns any scalar equal to 1 into a constexpr, so
        # values that are often 1 must be constexprs for both launchers to compile one variant.
        ("GROUP_SIZE", shapes.group_size), ("SINKS_PER_HEAD", shapes.sinks_per_head),
        ("SPARSE_CONTIGUOUS", False),
        # Explicit positions replace i + diag / j in the window rule; only block-sparse launches
        # take them (band_range assumes the default positions).
        ("HAS_POSITIONS", "q_positions" in strides),
    )
    return scalars, constexprs


def _with_constexpr(constexprs, name, value):
    return tuple((k, value if k == name else v) for k, v in constexprs)


# Bytes of global scratch one program's tensor descriptors may take: 128 per descriptor.  Triton
# 3.6 and 3.7 give the warp-specialised forward 896, dQ 1024, dK/dV 1280 and the portable TMA
# kernels 256 (tests/jax/test_scratch.py checks each kernel against this bound).
DESC_SCRATCH_BYTES = 2048


def desc_scratch(grid: Tuple[int, int, int], descriptors: bool) -> Output:
    """The DESC_SCRATCH output: where the programs' descriptors go when the launcher cannot
    give Triton's global scratch (jax-triton; launch.Output.scratch)."""
    programs = grid[0] * grid[1] * grid[2] if descriptors else 0
    return Output("desc_scratch", (max(programs * DESC_SCRATCH_BYTES, 128),), "int8", scratch=True)


def _lse_shape(shapes: FlashShapes):
    if shapes.varlen:
        return (shapes.heads_q, shapes.total_q)
    return (shapes.batch, shapes.heads_q, shapes.seqlen_q)


def _input_shapes(shapes: FlashShapes) -> Tuple[Tuple[int, ...], ...]:
    """The shapes of query, key and value (and of their gradients): packed (total, heads, dim) for varlen."""
    if shapes.varlen:
        q = (shapes.total_q, shapes.heads_q, shapes.head_dim)
        k = (shapes.total_k, shapes.heads_kv, shapes.head_dim)
    else:
        q = (shapes.batch, shapes.seqlen_q, shapes.heads_q, shapes.head_dim)
        k = (shapes.batch, shapes.seqlen_k, shapes.heads_kv, shapes.head_dim)
    return q, k, k[:-1] + (shapes.head_dim_v,)


def out_shape(shapes: FlashShapes):
    if shapes.varlen:
        return (shapes.total_q, shapes.heads_q, shapes.head_dim_v)
    return (shapes.batch, shapes.seqlen_q, shapes.heads_q, shapes.head_dim_v)


# The open recordings, innermost last.  Process-wide, not per thread: torch runs a CUDA backward on its
# autograd engine's own thread.  One thread records at a time (_RECORDER, held through the block), so that
# two tuners never see each other's plans; plans of other threads' calls may still land in a recording,
# which only makes it differ from the others (a candidate timed, never one skipped).
_RECORDINGS: list = []
_RECORDINGS_LOCK = threading.Lock()
_RECORDER = threading.RLock()


@contextlib.contextmanager
def recording():
    """The plans plan_forward and plan_backward return inside the block (in any thread), in order: a list
    filled as they are asked for, memoised or not (a launcher that reuses a plan it memoised itself reports
    it with `used`); nested, the innermost gets them.  The autotuner times candidate configs that plan the
    same launches once: the Gluon and warp-specialised kernels run their own tiles whatever the config's
    (dualattn.autotune.tune_flash).  A second thread's recording waits for this one to close, so nothing
    inside the block may wait for a thread that records (a tuner's: no autotuning in the block)."""
    plans = []
    with _RECORDER:
        with _RECORDINGS_LOCK:
            _RECORDINGS.append(plans)
        try:
            yield plans
        finally:
            with _RECORDINGS_LOCK:
                del _RECORDINGS[next(i for i, p in enumerate(_RECORDINGS) if p is plans)]


def used(planned):
    """Report a plan to the innermost open recording, if any; returns the plan."""
    if _RECORDINGS:
        with _RECORDINGS_LOCK:
            if _RECORDINGS:
                _RECORDINGS[-1].append(planned)
    return planned


def _memoised(plan_fn):
    """Plans are pure functions of hashable descriptions: build each one once per process.
    (Re-planning costs host time per call, which counts at short sequences.)"""
    cached = plan_memo(
        lambda shapes, options, strides, config, diag_shift, sparse, flags: plan_fn(
            shapes, options, dict(strides), config=config, diag_shift=diag_shift, sparse=sparse, **dict(flags)))

    @functools.wraps(plan_fn)
    def plan(shapes, options, strides, *, config, diag_shift=0, sparse=None, **flags):
        frozen = tuple(sorted((k, tuple(v)) for k, v in strides.items()))
        # (The switches the plans read are part of the key.)
        flags["env"] = switches.current()
        return used(cached(shapes, options, frozen, config, int(diag_shift), sparse, tuple(sorted(flags.items()))))
    return plan


# Capped scores lie in [-cap, cap]: the Gluon forward takes them against a fixed reference, max(K - 56, 0) in log2
# units with K = cap * log2 e (56: rules.SOFTCAP_P_MAX_LOG2), instead of a running row maximum (no row max, no
# rescaling of O per key tile).  Every P is then in [2^-(2K - 56), 2^56].  The largest leaves the row sums below 2^87
# for 2^31 keys and O's accumulator finite for |V| * Sk < 2^72; the smallest, at most 2^-90 for K <= 73 (cap <= 50.6,
# which Gemma 2's 50 meets), leaves the products P * V normal in fp32 for |V| >= 2^-36.  Not fp16, whose P (the P V
# GEMM's operand) overflows past 2^16.
SOFTCAP_FIXED_MAX_LOG2 = (90.0 + rules.SOFTCAP_P_MAX_LOG2) / 2


def gluon_softcap(shapes: FlashShapes, options: FlashOptions, softcap: int) -> int:
    """The Gluon forward's SOFTCAP constexpr: softcap_mode's, or SOFTCAP_MUFU_FIXED_MAX where the cap bounds P."""
    if (softcap == rules.SOFTCAP_MUFU and shapes.dtype == "bfloat16"
            and options.logits_soft_cap * math.log2(math.e) <= SOFTCAP_FIXED_MAX_LOG2):
        return rules.SOFTCAP_MUFU_FIXED_MAX
    return softcap


def _gluon_forward_launch(shapes: FlashShapes, options: FlashOptions, scalar: dict, diag_shift: int,
                          num_sms: int, softcap: int, sparse: Optional[SparseInfo]) -> Launch:
    """The Gluon forward: persistent, a program per SM (at most one per work item: a query tile, or
    causal or block-sparse, a pair of them); with segment ids, after the launch of its tiles' segment ranges.
    Block-sparse: the layout's lists (its blocks are the tiles: hopper.sparse_on_gluon_tiles)."""
    block_d = gluon_tile_width(shapes.head_dim)
    block_m, block_n, stages = GLUON_FWD_TILES[block_d]
    causal = options.window_right == 0   # (gluon_forward: a window_left only with it)
    q_tiles = cdiv(shapes.seqlen_q, block_m)
    num_work = shapes.batch * shapes.heads_q * (cdiv(q_tiles, 2) if causal or sparse is not None else q_tiles)
    grid = (max(1, min(num_sms or num_work, num_work)), 1, 1)
    segments = shapes.has_segments
    main = Launch(
        module="flash.forward_gluon", kernel="flash_fwd_gluon_kernel", grid=grid,
        inputs=("query", "key", "value", "softmax_aux", "q_segment_ids", "kv_segment_ids", "segment_ranges", "bias",
                "attention_mask", "sparse_kv_count", "sparse_kv_index", "sparse_q_order", "dropout_seed"),
        scalars=tuple((k, scalar[k]) for k in ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks",
                                               "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_ob",
                                               "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h"))
        + (("batch", shapes.batch), ("seqlen_q", shapes.seqlen_q), ("seqlen_k", shapes.seqlen_k),
           ("num_heads_q", shapes.heads_q), ("diag", shapes.seqlen_k - shapes.seqlen_q + int(diag_shift)),
           ("window_left", options.window_left or 0), ("num_work", num_work),
           ("sm_scale", float(options.softmax_scale)), ("seg_stride_qb", scalar["seg_stride_qb"]),
           ("seg_stride_kb", scalar["seg_stride_kb"]), ("softcap", scalar["softcap"]))
        + tuple((k, scalar[k]) for k in ("bias_stride_b", "bias_stride_h", "bias_stride_s", "mask_stride_b",
                                         "mask_stride_h", "mask_stride_s", "sparse_stride_b", "sparse_stride_h",
                                         "num_k_blocks", "dropout_threshold", "dropout_scale")),
        outputs=(Output("out", out_shape(shapes), "like:query"), Output("lse", _lse_shape(shapes), "float32"),
                 desc_scratch(grid, True)),
        constexprs=(("HEAD_DIM", shapes.head_dim), ("BLOCK_D", block_d), ("BLOCK_M", block_m), ("BLOCK_N", block_n),
                    ("STAGES", stages),
                    ("GROUP_SIZE", shapes.group_size), ("CAUSAL", causal),
                    ("WINDOW", options.window_left is not None), ("EVEN_K", shapes.seqlen_k % block_n == 0),
                    ("NUM_SINKS", shapes.num_sinks), ("SINKS_PER_HEAD", shapes.sinks_per_head),
                    ("SEGMENTS", segments), ("SOFTCAP", gluon_softcap(shapes, options, softcap)),
                    ("HAS_BIAS", shapes.has_bias), ("HAS_MASK", shapes.has_mask),
                    # forward_gluon's SPARSE_LISTS / SPARSE_RUNS
                    ("SPARSE", 0 if sparse is None else 2 if sparse.kv_rows_contiguous else 1),
                    ("DROPOUT", options.dropout_prob > 0.0), ("SCORE_BUFS", gluon_score_buffers(shapes)),
                    ("LOAD_FIRST", gluon_load_first(shapes, causal))),
        num_warps=GLUON_FWD_WARPS, num_stages=1, resume=SEGMENT_RESUME if segments else ())
    # (the ranges of query tiles of block_m rows over key tiles of block_n: _fwd_item reads them)
    return segment_ranges_first(main, shapes, scalar, block_m, block_n, True) if segments else main


def environment() -> switches.Switches:
    """The switches now (dualattn/switches.py): part of the key of a launcher's memo of planned calls,
    as they decide what planning a launch gives (here and in what launchers ask before planning:
    tma_requested, warp_specialize_requested, sm_count, the tuned table)."""
    return switches.current()


@_memoised
def plan_forward(shapes: FlashShapes, options: FlashOptions, strides: Dict[str, Tuple[int, ...]], *,
                 config: FlashConfig, diag_shift: int = 0, sparse: Optional[SparseInfo] = None,
                 tma: bool = False, warp_specialize: bool = False, num_sms: int = 0, gluon: bool = False,
                 hardware_tanh: bool = False, same_tables: bool = False,
                 env: switches.Switches = switches.Switches()) -> Launch:
    """The forward launch.  `strides` holds the element strides of the given arrays and of 'out'.

    The dropout seed is an input array (int32, shape (1,)), so JAX can pass a traced seed.
    With `sparse`, the kernels walk the layout's block lists (inputs SPARSE_INPUTS) and the
    tiles are the layout's blocks.  `warp_specialize`: the launcher can build TMA descriptors on
    an sm_90 GPU and allows the warp-specialised variant, which eligible problems then take with
    WS_TILE in place of config.fwd; where split_band, the returned launch's `then` finishes the
    masked edges, resuming from its out and lse (FWD_RESUME).  `num_sms`: the GPU's SM count, for
    a persistent warp-specialised launch (persistent_forward; 0: never persistent).  `gluon`: as
    plan_backward's; problems gluon_forward accepts then get the Gluon forward.  `hardware_tanh`: the
    launch runs on an NVIDIA GPU (fit.py plans every GPU launch): the soft cap may use its tanh
    (softcap_mode).  `same_tables`: a varlen call passed one table for queries and keys, which
    varlen_as_documents may then run as segment ids.
    """
    if same_tables:
        documents = varlen_as_documents(shapes, options, strides, config=config, diag_shift=diag_shift,
                                        sparse=sparse, tma=tma, warp_specialize=warp_specialize, num_sms=num_sms,
                                        gluon=gluon, hardware_tanh=hardware_tanh, env=env)
        if documents is not None:
            return documents
    config = sparse.config(config) if sparse is not None else config
    scalars, constexprs = _common_scalars(shapes, options, strides, diag_shift, sparse,
                                          softcap_mode(shapes, options, hardware_tanh, env))
    switch = env
    # Short causal windows: the portable kernel's grid of small tiles beats both Hopper forwards
    # (DUALATTN_GLUON_FWD=1 keeps them on the Gluon forward: its tests).
    hopper = (sparse is not None or switch.get(GLUON_FWD_ENV) == "1"
              or not short_window_forward(shapes, options, constexprs))
    if gluon and hopper and gluon_forward(shapes, options, sparse, strides, constexprs, switch.get(GLUON_FWD_ENV)):
        return _gluon_forward_launch(shapes, options, dict(scalars), diag_shift, num_sms, dict(constexprs)["SOFTCAP"],
                                     sparse)
    persistent = (persistent_forward(shapes, num_sms, switch.get(PERSISTENT_ENV))   # if warp-specialised
                  and whole_array_tiles(shapes, scalars, constexprs))
    ws = hopper and warp_specialize and (warp_specialized_forward(shapes, sparse, constexprs) or (
        persistent and _warp_specializable(shapes, sparse, constexprs)))
    split = ws and split_band(shapes, constexprs)
    if split and ws_band_in_loop(shapes, constexprs, persistent, switch.get(WS_BAND_ENV)):
        split = False
    elif split and not split_band_pays(shapes, options, constexprs):
        ws = split = False
    if sparse is not None:
        constexprs = _with_constexpr(constexprs, "SPARSE_CONTIGUOUS", sparse.kv_rows_contiguous)

    def launch(t: TileConfig, tma_loads: bool, warp_specialized: bool, then: Optional[Launch] = None) -> Launch:
        grid = (cdiv(shapes.seqlen_q, t.block_m), shapes.batch * shapes.heads_q, 1)
        persistent_launch = warp_specialized and persistent
        num_work = grid[0] * grid[1] if persistent_launch else 0
        if persistent_launch:
            grid = (num_sms, 1, 1)
        skip = segment_skip(shapes, sparse, warp_specialized)
        main = Launch(
            module="flash.forward", kernel="flash_fwd_kernel", grid=grid,
            inputs=FWD_INPUTS + tuple(name for name, _ in FWD_RESUME), scalars=scalars + (("num_work", num_work),),
            outputs=(*_forward_outputs(shapes), desc_scratch(grid, tma_loads)),
            constexprs=constexprs + (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("TMA", tma_loads),
                                     ("WARP_SPECIALIZE", warp_specialized),
                                     ("SPLIT_BAND", WS_TILE.block_m if split else 0),
                                     ("EDGES_IN_LOOP", not (warp_specialized or split) and edges_in_loop(
                                         shapes, options, sparse, constexprs, switch.get(EDGES_IN_LOOP_ENV), skip)),
                                     ("PERSISTENT", persistent_launch), ("SEGMENT_SKIP", skip)),
            num_warps=t.num_warps, num_stages=t.num_stages, then=then,
            resume=FWD_RESUME if split and not warp_specialized else SEGMENT_RESUME if skip else ())
        return segment_ranges_first(main, shapes, dict(scalars), t.block_m, t.block_n, True) if skip else main

    if ws:
        return launch(WS_TILE, True, True, then=launch(WS_EDGES_TILE, False, False) if split else None)
    # ptxas 3.6 crashes (segfault) on 2-stage TMA forward tiles (128x128/8 warps, 128x64/4
    # warps; docs/lessons.md, "TMA alone buys nothing").
    return launch(config.fwd, _use_tma(tma, shapes, constexprs) and config.fwd.num_stages != 2, False)


# "0": varlen never runs as segment ids; "1": wherever it may, also without the Gluon forward (the portable
# kernels with segment ids: tests on the CPU interpreter, A/B runs).
VARLEN_DOCUMENTS_ENV = "DUALATTN_VARLEN_DOCUMENTS"
# What the first launch of a varlen call run as documents resumes from the ids launch (the later ones find the ids
# among their inputs).
VARLEN_IDS_RESUME = (("q_segment_ids", "q_segment_ids"), ("kv_segment_ids", "kv_segment_ids"))


def _one_table_as_documents(shapes: FlashShapes, options: FlashOptions, strides, sparse: Optional[SparseInfo],
                            flag: Optional[str]):
    """(the dense problem, its strides): a varlen call whose queries and keys share one table, as one packed
    sequence with segment ids; None where it is not the same problem (varlen_as_documents)."""
    if (flag == "0" or not shapes.varlen or sparse is not None or options.dropout_prob > 0.0 or shapes.num_sinks
            or shapes.total_q != shapes.total_k or shapes.seqlen_q != shapes.seqlen_k):
        return None
    total = shapes.total_q
    dense = dataclasses.replace(shapes, batch=1, seqlen_q=total, seqlen_k=total, varlen=False, total_q=0,
                                total_k=0, has_segments=True)
    dense_strides = {name: (total * s[0],) + tuple(s) for name, s in strides.items()
                     if name in ("query", "key", "value", "out")}
    dense_strides.update(q_segment_ids=(total, 1), kv_segment_ids=(total, 1))
    return dense, dense_strides


def _varlen_shaped(head: Launch, shapes: FlashShapes, ids_first: bool) -> Launch:
    """A dense documents chain made the varlen call's: out, lse and the gradients varlen-shaped (the same
    memory: batch 1 of the packed length); with ids_first, after the ids launch, which its first launch
    resumes (VARLEN_IDS_RESUME)."""
    varlen_shape = dict(zip(("out", "lse", "dquery", "dkey", "dvalue"),
                            (out_shape(shapes), _lse_shape(shapes)) + _input_shapes(shapes)))
    tail = None
    for one in reversed(head.chain):   # rebuilt from the end
        outputs = tuple(dataclasses.replace(o, shape=varlen_shape[o.name]) if o.name in varlen_shape else o
                        for o in one.outputs)
        # (the chain's first launch, which reads the ids: the later ones find them among its inputs)
        resume = one.resume + VARLEN_IDS_RESUME if ids_first and one is head else one.resume
        tail = dataclasses.replace(one, outputs=outputs, then=tail, resume=resume)
    if not ids_first:
        return tail
    return dataclasses.replace(plan_varlen_segment_ids(shapes.total_q, shapes.batch, shapes.seqlen_q), then=tail)


def varlen_as_documents(shapes: FlashShapes, options: FlashOptions, strides, *, env: switches.Switches,
                        sparse: Optional[SparseInfo] = None, **plan_kwargs) -> Optional[Launch]:
    """A varlen forward whose queries and keys share one table, run as one packed sequence with segment
    ids: the Gluon forward takes segment ids (narrowing each tile's keys to its document) where it
    takes no varlen.  The same problem exactly: one table of the same packed length and max_seqlen on
    both sides makes every sequence's bottom-right causal diagonal its top-left one and bounds it alike
    (rules.sequence_bounds: a token past max_seqlen in its sequence, or in none, belongs to no
    document; the ids rise along the pack, so the segment ranges stay tight: varlen_segment_ids_kernel);
    no dropout, whose mask depends on the batch row; no sinks,
    which would give a row in no sequence their lse where varlen gives -inf (docs/spec.md).  Returns
    the chain (the ids launch, then the dense plan with segment ids, its out and lse the varlen call's),
    or None where that plan would not take the Gluon forward (unless DUALATTN_VARLEN_DOCUMENTS=1).
    varlen_backward_as_documents is the backward's rule: it takes this out and lse as they are."""
    flag = env.get(VARLEN_DOCUMENTS_ENV)
    problem = _one_table_as_documents(shapes, options, strides, sparse, flag)
    # Below D = 128 the Gluon forward does not repay the two launches that make the ids and ranges
    # (docs/lessons.md, "Varlen with one table as documents").  Wider heads, which the Gluon forward
    # also takes, were not measured here: they keep the varlen kernels.
    if problem is None or (shapes.head_dim != 128 and flag != "1"):
        return None
    dense, dense_strides = problem
    main = plan_forward(dense, options, dense_strides, env=env, **plan_kwargs)
    chain = main.chain
    if chain[0].module != "flash.segments" or (chain[-1].kernel != "flash_fwd_gluon_kernel" and flag != "1"):
        return None
    return _varlen_shaped(main, shapes, ids_first=True)


def varlen_backward_as_documents(shapes: FlashShapes, options: FlashOptions, strides, *, env: switches.Switches,
                                 sparse: Optional[SparseInfo] = None, **plan_kwargs) -> Optional["BackwardPlan"]:
    """The backward of a varlen call with one table, on the same terms as varlen_as_documents, where the dense
    documents plan takes the one-pass backward (which takes segment ids and no varlen) or
    DUALATTN_VARLEN_DOCUMENTS=1: the ids launch heads the dK/dV chain (the dQ launches find the ids among its
    results), the gradients come back varlen-shaped.  Tokens in no sequence attend nothing and nothing attends
    them, so their gradients are the zeros the varlen kernels leave.  Whatever ran the forward, out and lse
    are the same arrays.  Every head dim: the one-pass backward of documents beats the two-pass varlen
    kernels at D = 64 as at 128 (docs/lessons.md, "Varlen with one table as documents")."""
    flag = env.get(VARLEN_DOCUMENTS_ENV)
    problem = _one_table_as_documents(shapes, options, strides, sparse, flag)
    # (no one-pass kernel without a Gluon launcher, or with deterministic: then the dense plan is not made)
    if problem is None or (flag != "1" and (not plan_kwargs.get("gluon") or plan_kwargs.get("deterministic"))):
        return None
    dense, dense_strides = problem
    # (the one-pass rule's memory cap counts the longest sequence, as for the same sequences as a batch)
    plan = plan_backward(dense, options, dense_strides, env=env, sequence_keys=shapes.seqlen_k, **plan_kwargs)
    if plan.dkdv.chain[-1].kernel != "flash_bwd_one_pass_kernel" and flag != "1":
        return None
    # (the dense preprocess reads out, dO and lse as the varlen one would: batch 1 of the packed length)
    return dataclasses.replace(plan, dkdv=_varlen_shaped(plan.dkdv, shapes, ids_first=True),
                               dq=_varlen_shaped(plan.dq, shapes, ids_first=False))


def plan_varlen_segment_ids(total: int, num_seqs: int, max_seqlen: int) -> Launch:
    """The launch giving each packed token its sequence as a segment id (segments.varlen_segment_ids_kernel)."""
    block = 1024
    return Launch(
        module="flash.segments", kernel="varlen_segment_ids_kernel", grid=(max(1, cdiv(total, block)), 1, 1),
        inputs=("cu_seqlens_q",), scalars=(("total", total), ("num_seqs", num_seqs), ("max_seqlen", max_seqlen)),
        outputs=(Output("q_segment_ids", (1, total), "int32"), Output("kv_segment_ids", (1, total), "int32")),
        constexprs=(("BLOCK", block), ("SEARCH_STEPS", max(1, math.ceil(math.log2(num_seqs + 2))))),
        num_warps=4, num_stages=1)


def _forward_outputs(shapes: FlashShapes) -> Tuple[Output, Output]:
    """out and lse.  Varlen rows in no sequence (past cu_seqlens[-1], or past max_seqlen_q in a sequence
    a traced table made longer) are written by no program: filled beforehand with 0 and lse -inf, unless
    the host knows there are none (shapes.queries_covered)."""
    fill = shapes.varlen and not shapes.queries_covered
    return (Output("out", out_shape(shapes), "like:query", zeroed=fill),
            Output("lse", _lse_shape(shapes), "float32", zeroed=fill, fill=float("-inf")))


BWD_KERNEL_INPUTS = FWD_INPUTS + ("dout", "lse", "delta")
# What a launch resumes from the per-tile segment ranges its head launch computed (segments.py).
SEGMENT_RESUME = (("segment_ranges", "segment_ranges"),)


def segment_skip(shapes: FlashShapes, sparse: Optional[SparseInfo], warp_specialized: bool) -> bool:
    """Whether a launch visits only the tiles that share segment ids with its own, and runs the tile pairs
    inside one document without the segment compare (SEGMENT_SKIP): every portable dense launch with
    segment ids.  (Block-sparse launches walk their layout's lists.)"""
    return shapes.has_segments and sparse is None and not warp_specialized


# Ids the segment-range kernel reads at once (a chunk of other-axis tiles whose ranges it reduces together), over
# SEGMENT_WARPS warps: 32 ids a thread (no spills on sm_90; a smaller chunk at 8 warps spilled).  An other axis
# longer than TILE_IDS_FROM ids is first reduced to its tiles' [min, max] ids (segments.segment_tile_ids_kernel,
# a chunk a program), which the ranges kernel then reads TILE_IDS_CHUNK tiles at a time.
SEGMENT_CHUNK = 8192
SEGMENT_WARPS = 8
TILE_IDS_FROM = 16384
TILE_IDS_CHUNK = 1024
# What the segment-ranges launch resumes from the tile-ids launch before it.
TILE_IDS_RESUME = (("segment_tile_ids", "segment_tile_ids"),)


def segment_ranges_first(main: Launch, shapes: FlashShapes, scalar: dict, block_own: int, block_other: int,
                         own_is_query: bool) -> Launch:
    """`main` preceded by the launch computing its per-tile segment ranges (segments.py: the tiles sharing
    an id, and the run of tiles holding only the own tile's one id), for its tiles: own tiles of block_own
    rows (queries in the forward and dQ, keys in dK/dV), iterated ones of block_other; and, where the other
    axis is longer than TILE_IDS_FROM ids, by the launch reducing its tiles to their [min, max] ids."""
    own_len, other_len = (shapes.seqlen_q, shapes.seqlen_k) if own_is_query else (shapes.seqlen_k, shapes.seqlen_q)
    n_tiles = cdiv(own_len, block_own)
    from_tile_ids = other_len > TILE_IDS_FROM
    ranges = Launch(
        module="flash.segments", kernel="segment_ranges_kernel", grid=(n_tiles, shapes.batch, 1),
        inputs=("q_segment_ids", "kv_segment_ids", "segment_tile_ids"),
        scalars=tuple((k, scalar[k]) for k in ("seg_stride_qb", "seg_stride_kb", "seqlen_q", "seqlen_k"))
        + (("num_tiles", n_tiles),),
        outputs=(Output("segment_ranges", (shapes.batch, n_tiles, RANGE_FIELDS.value), "int32"),),
        constexprs=(("BLOCK_OWN", block_own), ("BLOCK_OTHER", block_other), ("OWN_IS_QUERY", own_is_query),
                    ("CHUNK_TILES", TILE_IDS_CHUNK if from_tile_ids else max(1, SEGMENT_CHUNK // block_other)),
                    ("FROM_TILE_IDS", from_tile_ids)),
        num_warps=SEGMENT_WARPS, num_stages=1, then=main, resume=TILE_IDS_RESUME if from_tile_ids else ())
    if not from_tile_ids:
        return ranges
    other_tiles, per_program = cdiv(other_len, block_other), max(1, SEGMENT_CHUNK // block_other)
    return Launch(
        module="flash.segments", kernel="segment_tile_ids_kernel",
        grid=(cdiv(other_tiles, per_program), shapes.batch, 1),
        inputs=("kv_segment_ids" if own_is_query else "q_segment_ids",),
        scalars=(("seg_stride_b", scalar["seg_stride_kb" if own_is_query else "seg_stride_qb"]),
                 ("length", other_len), ("num_tiles", other_tiles)),
        outputs=(Output("segment_tile_ids", (shapes.batch, other_tiles, TILE_ID_FIELDS.value), "int32"),),
        constexprs=(("BLOCK", block_other), ("TILES", per_program)),
        num_warps=SEGMENT_WARPS, num_stages=1, then=ranges)
# What a SPLIT_BAND edges launch resumes from: the interior launch's out and lse.
FWD_RESUME = (("resume_out", "out"), ("resume_lse", "lse"))

@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    preprocess: Launch   # delta = rowsum(dO * O) and per-block dsinks partial sums
    dkdv: Launch
    dq: Launch
    dsinks_blocks: int   # rows of partial dsinks to sum: batch * Hq * query tiles


@_memoised
def plan_backward(shapes: FlashShapes, options: FlashOptions, strides: Dict[str, Tuple[int, ...]], *,
                  config: FlashConfig, diag_shift: int = 0, sparse: Optional[SparseInfo] = None,
                  tma: bool = False, lse_grad: bool = False, warp_specialize: bool = False, num_sms: int = 0,
                  gluon: bool = False, deterministic: bool = False, hardware_tanh: bool = False,
                  bias_grad: bool = True, same_tables: bool = False, sequence_keys: int = 0,
                  env: switches.Switches = switches.Switches()) -> BackwardPlan:
    """The three backward launches.  `strides` must include 'out' (also used for dout).

    lse_grad: the launcher passes 'dlse', the cotangent of the forward's lse (laid out like lse).
    warp_specialize: as plan_forward's; eligible kernels take the tiles warp_specialized_backward
    gives in place of config's.  num_sms: as plan_forward's (persistent_backward).
    gluon: the launcher runs Gluon kernels on an sm_90 GPU (torch, and JAX through jax_api/_compile.py:
    gluon_allowed); problems one_pass_backward accepts then get the one-pass backward: `dkdv` computes dK,
    dV and an fp32 dQ accumulator ('dq_accum'), which `dq` takes as input and casts.  Launchers
    pass dkdv's results to dq.
    deterministic: no one-pass backward (its dQ tiles meet in fp32 atomics, in varying order); the
    two-pass kernels write every gradient tile from one program, so reruns are bitwise equal.
    hardware_tanh: as plan_forward's.
    bias_grad: the caller wants dbias (a bias that needs its gradient).  Without it no (B, Hq, Sq, Sk)
    float32 dbias is zero-filled and written: 4 bytes per score, twice.
    same_tables: as plan_forward's (varlen_backward_as_documents).
    sequence_keys: the problem is a pack of sequences of at most this many keys (varlen_backward_as_documents),
    which the one-pass rule's memory cap counts (hopper.one_pass_backward).
    """
    if same_tables:
        documents = varlen_backward_as_documents(
            shapes, options, strides, config=config, diag_shift=diag_shift, sparse=sparse, tma=tma,
            lse_grad=lse_grad, warp_specialize=warp_specialize, num_sms=num_sms, gluon=gluon,
            deterministic=deterministic, hardware_tanh=hardware_tanh, bias_grad=bias_grad, env=env)
        if documents is not None:
            return documents
    config = sparse.config(config) if sparse is not None else config
    scalars, constexprs = _common_scalars(shapes, options, strides, diag_shift, sparse,
                                          softcap_mode(shapes, options, hardware_tanh, env))
    scalar = dict(scalars)
    varlen = shapes.varlen
    const = dict(constexprs)
    lse_shape = _lse_shape(shapes)

    pre_m = config.bwd_dq.block_m
    n_m_blocks = cdiv(shapes.seqlen_q, pre_m)
    num_sinks = shapes.num_sinks
    preprocess = Launch(
        module="flash.backward", kernel="flash_bwd_preprocess_kernel",
        grid=(n_m_blocks, shapes.batch * shapes.heads_q, 1),
        inputs=("out", "dout", "lse", "dlse", "softmax_aux", "cu_seqlens_q"),
        scalars=tuple((k, scalar[k]) for k in ("stride_ob", "stride_os", "stride_oh", "stride_lse_b",
                                                "stride_lse_h", "seqlen_q", "total_q", "num_heads_q")),
        # Placeholders the kernels never write (no sinks, no bias) are neither zero-filled nor, in
        # torch, allocated: host time that counts at short sequences (docs/lessons.md, "Fewer Python layers
        # per call").
        outputs=(Output("delta", lse_shape, "float32"),
                 Output("dsinks_partial", (shapes.batch * shapes.heads_q * n_m_blocks, max(1, num_sinks)),
                        "float32", zeroed=num_sinks > 0, placeholder=num_sinks == 0)),
        constexprs=(("HEAD_DIM_V", shapes.head_dim_v), ("BLOCK_DV", const["BLOCK_DV"]), ("BLOCK_M", pre_m),
                    ("NUM_SINKS", num_sinks), ("BLOCK_SINKS", const["BLOCK_SINKS"]), ("IS_VARLEN", varlen),
                    ("SINKS_PER_HEAD", shapes.sinks_per_head), ("STRIDES_ALIGNED", const["STRIDES_ALIGNED"]),
                    ("HAS_DLSE", lse_grad)),
        num_warps=4, num_stages=1)

    def grad_strides(name, shape):
        s = _contiguous(shape)
        return _seq_strides(s, varlen)

    q_shape, k_shape, v_shape = _input_shapes(shapes)
    # Short causal windows: the portable two-pass kernels beat both Hopper backwards (DUALATTN_ONE_PASS=1 keeps
    # them on the one-pass kernel: its tests).
    hopper = sparse is not None or env.get(ONE_PASS_ENV) == "1" or not short_window_backward(shapes, options,
                                                                                            constexprs)
    one_pass = one_pass_backward(shapes, options, sparse, strides, constexprs, env.get(ONE_PASS_ENV),
                                 bias_grad, sequence_keys) if gluon and hopper and not deterministic else None
    if one_pass is not None:
        dkdv, dq = _one_pass_launches(shapes, options, scalar, strides, q_shape, k_shape, v_shape, diag_shift,
                                      one_pass, num_sms, env.get(PERSISTENT_ENV), const["SOFTCAP"], sparse)
        return BackwardPlan(preprocess, dkdv, dq, shapes.batch * shapes.heads_q * n_m_blocks)
    store_dbias = shapes.has_bias and bias_grad
    dbias_shape = (shapes.batch, shapes.heads_q, shapes.seqlen_q, shapes.seqlen_k) if store_dbias else (1,)
    dbias_strides = _contiguous(dbias_shape)[:3] if store_dbias else (0, 0, 0)

    use_tma = _use_tma(tma, shapes, constexprs)
    # Both specialised kernels own 128-row tiles (WS_DKDV_TILES' keys, WS_DQ_TILES' queries).
    ws_tiles = min(cdiv(shapes.seqlen_k, WS_TILE.block_n) * shapes.heads_kv,
                   cdiv(shapes.seqlen_q, WS_TILE.block_m) * shapes.heads_q) * shapes.batch
    persistent = (warp_specialize and whole_array_tiles(shapes, scalars, constexprs)
                  and persistent_backward(shapes, ws_tiles, num_sms, env.get(PERSISTENT_ENV)))
    ws_dkdv, ws_dq = (warp_specialized_backward(shapes, sparse, constexprs, persistent) if warp_specialize and hopper
                      else (None, None))
    # (segment ids: the portable launches skip the compare inside documents, so their edges may go in the loop)
    edges = edges_in_loop(shapes, options, sparse, constexprs, env.get(EDGES_IN_LOOP_ENV),
                          segment_skip(shapes, sparse, False))

    def persistent_grid(grid, t: TileConfig, warp_specialized: bool):
        """(grid, num_work, persistent) of a backward kernel: a program per SM where specialised,
        its tiles whole (whole_array_tiles checked WS_TILE's; a patched tile table may differ)."""
        whole_tile = shapes.seqlen_q % t.block_m == 0 and shapes.seqlen_k % t.block_n == 0
        if warp_specialized and persistent and whole_tile:
            return (num_sms, 1, 1), grid[0] * grid[1], True
        return grid, 0, False

    if sparse is not None:
        constexprs = _with_constexpr(constexprs, "SPARSE_CONTIGUOUS", sparse.q_rows_contiguous)
    t = ws_dkdv or config.bwd_dkdv
    grid, num_work, dkdv_persistent = persistent_grid(
        (cdiv(shapes.seqlen_k, t.block_n), shapes.batch * shapes.heads_kv, 1), t, bool(ws_dkdv))
    skip = segment_skip(shapes, sparse, bool(ws_dkdv))
    dkdv = Launch(
        module="flash.backward", kernel="flash_bwd_dkdv_kernel", grid=grid,
        inputs=BWD_KERNEL_INPUTS,
        scalars=scalars + tuple(zip(("stride_dkb", "stride_dks", "stride_dkh"), grad_strides("dk", k_shape)))
        + tuple(zip(("stride_dvb", "stride_dvs", "stride_dvh"), grad_strides("dv", v_shape)))
        + tuple(zip(("dbias_stride_b", "dbias_stride_h", "dbias_stride_s"), dbias_strides)) + (("num_work", num_work),),
        # (varlen: rows in no sequence get zero gradients, as _forward_outputs' rows get zero output)
        outputs=(Output("dkey", k_shape, "like:key", zeroed=varlen),
                 Output("dvalue", v_shape, "like:value", zeroed=varlen),
                 Output("dbias", dbias_shape, "float32", zeroed=store_dbias, placeholder=not store_dbias),
                 desc_scratch(grid, use_tma or bool(ws_dkdv))),
        constexprs=constexprs + (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("TMA", use_tma or bool(ws_dkdv)),
                                 ("WARP_SPECIALIZE", bool(ws_dkdv)), ("EDGES_IN_LOOP", not ws_dkdv and edges),
                                 ("PERSISTENT", dkdv_persistent), ("SEGMENT_SKIP", skip), ("STORE_DBIAS", store_dbias)),
        num_warps=t.num_warps, num_stages=t.num_stages, resume=SEGMENT_RESUME if skip else ())
    if skip:
        dkdv = segment_ranges_first(dkdv, shapes, scalar, t.block_n, t.block_m, False)

    if sparse is not None:
        constexprs = _with_constexpr(constexprs, "SPARSE_CONTIGUOUS", sparse.kv_rows_contiguous)
    t = ws_dq or config.bwd_dq
    grid, num_work, dq_persistent = persistent_grid(
        (cdiv(shapes.seqlen_q, t.block_m), shapes.batch * shapes.heads_q, 1), t, bool(ws_dq))
    skip = segment_skip(shapes, sparse, bool(ws_dq))
    dq = Launch(
        module="flash.backward", kernel="flash_bwd_dq_kernel", grid=grid,
        inputs=BWD_KERNEL_INPUTS,
        scalars=scalars + tuple(zip(("stride_dqb", "stride_dqs", "stride_dqh"), grad_strides("dq", q_shape)))
        + (("num_work", num_work),),
        outputs=(Output("dquery", q_shape, "like:query", zeroed=varlen), desc_scratch(grid, use_tma or bool(ws_dq))),
        constexprs=constexprs + (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("TMA", use_tma or bool(ws_dq)),
                                 ("WARP_SPECIALIZE", bool(ws_dq)), ("EDGES_IN_LOOP", not ws_dq and edges),
                                 ("PERSISTENT", dq_persistent), ("SEGMENT_SKIP", skip)),
        num_warps=t.num_warps, num_stages=t.num_stages, resume=SEGMENT_RESUME if skip else ())
    if skip:
        dq = segment_ranges_first(dq, shapes, scalar, t.block_m, t.block_n, True)
    return BackwardPlan(preprocess, dkdv, dq, shapes.batch * shapes.heads_q * n_m_blocks)


def _one_pass_launches(shapes: FlashShapes, options: FlashOptions, scalar: dict, strides, q_shape, k_shape, v_shape,
                       diag_shift: int, tile: Tuple[int, ...], num_sms: int,
                       persistent_flag: Optional[str], softcap: int,
                       sparse: Optional[SparseInfo]) -> Tuple[Launch, Launch]:
    """The one-pass kernel (dK, dV and an fp32 dQ accumulator) and the launch casting dQ; persistent
    where one_pass_persistent; with segment ids, after the launch of its key tiles' segment ranges.
    softcap: the SOFTCAP constexpr (softcap_mode).  Block-sparse: the layout's query-block lists."""
    block_m, block_n, stages, dq_bufs, ds_bufs = tile
    grid = (cdiv(shapes.seqlen_k, block_n), shapes.batch * shapes.heads_kv, 1)
    num_work = grid[0] * grid[1]
    persistent = num_sms > 0 and one_pass_persistent(shapes, options, strides, tile, persistent_flag, sparse)
    if persistent:
        if options.window_right == 0 or sparse is not None:
            num_work //= 2   # pairs of key tiles (backward_gluon._work_item)
        grid = (min(num_sms, num_work), 1, 1)
    grads = {name: _seq_strides(_contiguous(shape), False) for name, shape in
             (("dk", k_shape), ("dv", v_shape), ("dq", q_shape))}
    one_pass = Launch(
        module="flash.backward_gluon", kernel="flash_bwd_one_pass_kernel", grid=grid,
        inputs=("query", "key", "value", "dout", "lse", "delta", "q_segment_ids", "kv_segment_ids", "segment_ranges",
                "bias", "attention_mask", "sparse_q_count", "sparse_q_index", "sparse_k_order", "dropout_seed"),
        scalars=tuple((k, scalar[k]) for k in ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks",
                                               "stride_kh", "stride_vb", "stride_vs", "stride_vh"))
        + tuple((k, scalar[k]) for k in ("stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h"))
        + tuple((f"stride_{g}{x}", v) for g in ("dk", "dv", "dq") for x, v in zip("bsh", grads[g]))
        + (("batch", shapes.batch), ("seqlen_q", shapes.seqlen_q), ("seqlen_k", shapes.seqlen_k),
           ("num_heads_kv", shapes.heads_kv), ("diag", shapes.seqlen_k - shapes.seqlen_q + int(diag_shift)),
           ("window_left", options.window_left or 0), ("num_work", num_work),
           ("sm_scale", float(options.softmax_scale)), ("seg_stride_qb", scalar["seg_stride_qb"]),
           ("seg_stride_kb", scalar["seg_stride_kb"]), ("softcap", scalar["softcap"]))
        + tuple((k, scalar[k]) for k in ("bias_stride_b", "bias_stride_h", "bias_stride_s", "mask_stride_b",
                                         "mask_stride_h", "mask_stride_s", "sparse_kstride_b", "sparse_kstride_h",
                                         "num_q_blocks", "dropout_threshold", "dropout_scale")),
        outputs=(Output("dkey", k_shape, "like:key"), Output("dvalue", v_shape, "like:value"),
                 Output("dq_accum", q_shape, "float32", zeroed=True), desc_scratch(grid, True)),
        constexprs=(("HEAD_DIM", shapes.head_dim), ("BLOCK_D", gluon_tile_width(shapes.head_dim)), ("BLOCK_M", block_m),
                    ("BLOCK_N", block_n), ("STAGES", stages),
                    ("DQ_BUFS", dq_bufs), ("GROUP_SIZE", shapes.group_size), ("NUM_WARPS", ONE_PASS_WARPS),
                    ("CAUSAL", options.window_right == 0), ("PERSISTENT", persistent), ("DS_BUFS", ds_bufs),
                    ("WINDOW", options.window_left is not None), ("SEGMENTS", shapes.has_segments),
                    ("SOFTCAP", softcap), ("EVEN_K", shapes.seqlen_k % block_n == 0), ("HAS_BIAS", shapes.has_bias),
                    ("HAS_MASK", shapes.has_mask), ("SPARSE_BLOCK_Q", sparse.block_q if sparse is not None else 0),
                    ("SPARSE_RUNS", sparse is not None and sparse.q_rows_contiguous),
                    ("DROPOUT", options.dropout_prob > 0.0)),
        num_warps=ONE_PASS_WARPS, num_stages=1, resume=SEGMENT_RESUME if shapes.has_segments else ())
    if shapes.has_segments:   # (the ranges of key tiles of block_n over query tiles of block_m: _work_item)
        one_pass = segment_ranges_first(one_pass, shapes, scalar, block_n, block_m, False)
    numel = 1
    for n in q_shape:
        numel *= n
    block = 2048
    convert = Launch(
        module="flash.backward_gluon", kernel="flash_bwd_dq_convert_kernel", grid=(cdiv(numel, block), 1, 1),
        inputs=("dq_accum",), scalars=(("numel", numel),), outputs=(Output("dquery", q_shape, "like:query"),),
        constexprs=(("BLOCK", block),), num_warps=4, num_stages=1)
    return one_pass, convert


def plan_dropout_mask(batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_prob: float,
                      dropout_seed: int) -> Launch:
    block = 32
    return Launch(
        module="flash.backward", kernel="dropout_mask_kernel",
        grid=(cdiv(seqlen_q, block), batch * heads, 1), inputs=(),
        scalars=(("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k), ("num_heads", heads),
                 ("dropout_seed", as_int32(dropout_seed)),
                 ("dropout_threshold", as_int32(dropout_threshold(dropout_prob)))),
        outputs=(Output("keep", (batch, heads, seqlen_q, seqlen_k), "int8"),),
        constexprs=(("BLOCK_M", block), ("BLOCK_N", block)), num_warps=4, num_stages=1)


def dbias_sum_dims(shapes: FlashShapes) -> Tuple[int, ...]:
    """Axes of the full (B, Hq, Sq, Sk) dbias to sum so it matches a broadcast bias."""
    return tuple(d for d, bcast in ((0, shapes.bias_bcast_batch), (1, shapes.heads_q != 1 and shapes.bias_bcast_head))
                 if bcast)


def dsinks_partial_view(shapes: FlashShapes, plan: "BackwardPlan") -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """(shape to view the partial dsinks as, axes to sum) giving (Hq, n), or (n,) for shared sinks."""
    n_blocks = plan.dsinks_blocks // max(1, shapes.batch * shapes.heads_q)   # (B = 0: no blocks, dsinks 0)
    view = (shapes.batch, shapes.heads_q, n_blocks, max(1, shapes.num_sinks))
    return view, ((0, 2) if shapes.sinks_per_head else (0, 1, 2))
