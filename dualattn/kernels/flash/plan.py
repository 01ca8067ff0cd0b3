"""Launch plans of the flash kernels: grids, block sizes, warps, stages, specialisations.

Framework-free and shared by the torch and JAX front ends, so both compile and launch the
identical kernel variants.  Inputs: FlashShapes (validated sizes), FlashOptions (static
options) and the element strides of the arrays (torch: tensor.stride(); JAX: row-major).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Dict, Optional, Tuple

from ... import switches
from ...options import FlashOptions
from ...validation import FlashShapes
from ..launch import Launch, Output, as_int32, cdiv, next_pow2, row_major_strides as _contiguous

SPARSE_INPUTS = ("sparse_kv_count", "sparse_kv_index", "sparse_q_order", "sparse_q_count", "sparse_q_index",
                 "sparse_k_order")
FWD_INPUTS = ("query", "key", "value", "bias", "attention_mask", "q_segment_ids", "kv_segment_ids",
              "softmax_aux", "cu_seqlens_q", "cu_seqlens_k", "dropout_seed") + SPARSE_INPUTS + (
              "q_positions", "kv_positions", "segment_ranges")


@dataclasses.dataclass(frozen=True)
class SparseInfo:
    """The shape of a block-sparse layout (dualattn.SparseMask) as the kernels need it.

    Layout arrays are (layout_batch, layout_heads, n_blocks[, n_blocks]); a size-1 batch or
    head dim broadcasts.  The kernels' tiles are the layout's blocks.
    """

    layout_batch: int
    layout_heads: int
    num_q_blocks: int
    num_k_blocks: int
    block_q: int
    block_k: int
    kv_rows_contiguous: bool = False  # every query block's key blocks form one run (windows, documents)
    q_rows_contiguous: bool = False   # every key block's query blocks form one run

    def config(self, requested: Optional["FlashConfig"] = None) -> "FlashConfig":
        """The layout's blocks as every launch's tiles.  `requested`: a config whose pipeline depths
        cap these tiles' (fit.py lowers them where a variant would not fit the GPU's shared memory);
        its block sizes are ignored: a layout's blocks are its tiles."""
        big = max(self.block_q, self.block_k) >= 128
        t = TileConfig(self.block_q, self.block_k, 8 if big else 4, 2 if big else 3)
        if requested is None:
            return FlashConfig(t, t, t)
        return FlashConfig(*(dataclasses.replace(t, num_stages=min(t.num_stages, r.num_stages))
                             for r in (requested.fwd, requested.bwd_dkdv, requested.bwd_dq)))
BWD_INPUTS = FWD_INPUTS + ("out", "dout", "lse", "delta")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class FlashConfig:
    """Tiles of the three launches of one flash problem (what the executor selects)."""

    fwd: TileConfig
    bwd_dkdv: TileConfig   # fixed key tile block_n, iterated query tiles block_m
    bwd_dq: TileConfig


# Tiles measured best on the H100 by benchmarks/tune_flash.py (see benchmarks/NOTES.md), keyed by
# "sm<arch>:d<head-dim bucket>:<causal|full>" -> (fwd, dkdv, dq) as (block_m, block_n, warps, stages).
TUNED: Dict[str, Tuple[Tuple[int, int, int, int], ...]] = {
    # H100, 2026-11-22, 16k tokens at S=8192, H=16 (D=128) / 32 (D=64), bf16, after the loads
    # became software-pipelined (benchmarks/results/2026-11-22_h100_tune_pipelined.json).
    "sm90:d128:full": ((128, 128, 8, 3), (32, 64, 4, 4), (128, 64, 8, 3)),
    "sm90:d128:causal": ((128, 128, 8, 3), (64, 128, 8, 2), (128, 64, 8, 3)),
    "sm90:d64:full": ((64, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 3)),
    "sm90:d64:causal": ((64, 64, 4, 4), (64, 64, 4, 3), (128, 64, 4, 3)),
}
TUNED_FILE_ENV = "DUALATTN_FLASH_TUNED"  # a JSON file of the same table overrides it (switches.py)


@functools.lru_cache(maxsize=None)
def _tuned_table(path: Optional[str]) -> Dict[str, Tuple[Tuple[int, int, int, int], ...]]:
    table = dict(TUNED)
    if path:
        with open(path) as f:
            table.update({k: tuple(tuple(t) for t in v) for k, v in json.load(f).items()})
    return table


# Short sequences get their own rows where tuned ("...:s1024", "...:s2048": the longer of Sq and Sk
# up to that bound), since fewer key tiles per program change which tile wins.
SHORT_SEQ_BUCKETS = (1024, 2048)


def tuned_key(arch: int, head_dim: int, causal: bool, seqlen: Optional[int] = None) -> str:
    """The TUNED key; with `seqlen` (the longer of Sq and Sk) its short-sequence bucket, if any."""
    key = f"sm{arch}:d{next_pow2(head_dim)}:{'causal' if causal else 'full'}"
    bucket = next((b for b in SHORT_SEQ_BUCKETS if seqlen is not None and seqlen <= b), None)
    return key if bucket is None else f"{key}:s{bucket}"


def default_config(shapes: FlashShapes, *, interpret: bool, arch: int = 90, causal: bool = False) -> FlashConfig:
    """Tiles per (platform, head dim, causal): the tuned table first, then heuristics."""
    d = max(next_pow2(shapes.head_dim), next_pow2(shapes.head_dim_v))
    if interpret:
        # The interpreter pays per tile op, not per element: big tiles, no pipelining.
        t = TileConfig(64, 64, 4, 1)
        return FlashConfig(t, t, t)
    table = _tuned_table(switches.current().get(TUNED_FILE_ENV))
    tuned = table.get(tuned_key(arch, d, causal, max(shapes.seqlen_q, shapes.seqlen_k)),
                      table.get(tuned_key(arch, d, causal)))
    if shapes.dtype == "float32" and d > 64:
        # fp32 tiles take twice the shared memory (and 3xTF32 more): sized with
        # dualattn.kernels.compile_check to fit sm_80 (163 KB) and sm_90 (227 KB).
        if d <= 128:
            fwd, dkdv, dq = TileConfig(64, 32, 4, 2), TileConfig(64, 32, 4, 2), TileConfig(32, 64, 4, 2)
        else:
            fwd, dkdv, dq = TileConfig(32, 32, 4, 1), TileConfig(16, 32, 4, 1), TileConfig(16, 32, 4, 1)
    elif tuned is not None:  # tuned on 16-bit inputs
        fwd, dkdv, dq = (TileConfig(*t) for t in tuned)
    else:
        if d <= 64:
            fwd = TileConfig(128, 64, 4, 3)
        elif d <= 128:
            fwd = TileConfig(128, 64, 8, 3)
        else:
            fwd = TileConfig(64, 32, 4, 2)
        if d <= 128:
            dkdv = TileConfig(32, 128, 4, 3)
            dq = TileConfig(128, 32, 4, 3)
        else:
            dkdv = TileConfig(32, 64, 4, 2)
            dq = TileConfig(64, 32, 4, 2)
    if shapes.seqlen_q <= 64 or shapes.seqlen_k <= 64:
        # Decode-like shapes: don't waste most of a 128-row tile.
        def small(t):
            return TileConfig(min(t.block_m, max(16, next_pow2(shapes.seqlen_q))),
                              min(t.block_n, max(16, next_pow2(shapes.seqlen_k))), min(t.num_warps, 4), t.num_stages)
        fwd, dkdv, dq = small(fwd), small(dkdv), small(dq)
    return FlashConfig(fwd, dkdv, dq)


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


def _common_scalars(shapes: FlashShapes, options: FlashOptions, strides: Dict[str, Tuple[int, ...]],
                    diag_shift: int, sparse: Optional[SparseInfo] = None):
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
        ("dropout_threshold", int(round(p * (1 << 24)))),
        ("dropout_scale", 1.0 / (1.0 - p)),
    )
    # Every q/k/v/o stride divisible by 16 elements lets the kernels vectorise row loads.
    aligned = all(s % 16 == 0 for s in (qb, qs, qh, kb, ks, kh, vb, vs, vh, ob, os_, oh))
    constexprs = (
        ("HEAD_DIM", shapes.head_dim), ("HEAD_DIM_V", shapes.head_dim_v),
        ("BLOCK_D", max(16, next_pow2(shapes.head_dim))), ("BLOCK_DV", max(16, next_pow2(shapes.head_dim_v))),
        ("STRIDES_ALIGNED", aligned),
        ("HAS_LEFT", options.window_left is not None), ("HAS_RIGHT", options.window_right is not None),
        ("HAS_SOFTCAP", options.logits_soft_cap is not None), ("HAS_BIAS", shapes.has_bias),
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


def tma_requested() -> bool:
    """Whether launchers ask for TMA tile loads in every kernel (the plan still checks each problem:
    _use_tma).  Opt-in with DUALATTN_TMA=1: on the H100 with Triton 3.6 they measured no faster
    than pointer loads (benchmarks/NOTES.md step 13)."""
    return switches.current().get("DUALATTN_TMA") == "1"


def warp_specialize_requested(arch: Optional[int]) -> bool:
    """Whether launchers allow the warp-specialised kernels on sm_<arch> (None: the CPU interpreter;
    warp_specialized_forward / _backward decide if a problem qualifies).  Default: on sm_90, where
    they were tuned (NOTES steps 18-22).  DUALATTN_WS=0 turns them off (both frameworks then run
    the portable kernels); DUALATTN_WS=1 allows them wherever descriptors work, the interpreter
    included (tests)."""
    flag = switches.current().get("DUALATTN_WS")
    return flag == "1" or (flag != "0" and arch == 90)


def gluon_allowed(arch: Optional[int], warp_specialize: bool) -> bool:
    """Whether a launcher may run the Gluon one-pass backward (plan_backward's `gluon`): it exists
    for sm_90 only (wgmma, setmaxnreg), and goes with the warp-specialised kernels (DUALATTN_WS=0
    turns both off).  `warp_specialize`: the launcher's warp_specialize flag for this call."""
    return warp_specialize and arch == 90


def _use_tma(requested: bool, shapes: FlashShapes, constexprs) -> bool:
    """TMA tile loads (rules.row_tiles) where the launcher asked for them and a descriptor is
    legal: 16-byte aligned rows and head offsets (every stride a multiple of 16 elements; the
    launcher checks the base pointers) and tiles at most 128 wide (ptxas 3.6 crashes on
    256-wide TMA tiles, checked offline for sm_90)."""
    const = dict(constexprs)
    return bool(requested) and const["STRIDES_ALIGNED"] and max(const["BLOCK_D"], const["BLOCK_DV"]) <= 128


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


def out_shape(shapes: FlashShapes):
    if shapes.varlen:
        return (shapes.total_q, shapes.heads_q, shapes.head_dim_v)
    return (shapes.batch, shapes.seqlen_q, shapes.heads_q, shapes.head_dim_v)


_PLAN_CACHES = []


_FORGET_HOOKS = []


def forget_plans() -> None:
    """Drop every memoised plan (after changing one of this module's rule constants, e.g. in tests),
    and what launchers memoise from plans (on_forget_plans)."""
    for cache in _PLAN_CACHES:
        cache.cache_clear()
    for hook in _FORGET_HOOKS:
        hook()


def on_forget_plans(hook) -> None:
    """Call `hook()` from forget_plans: for a launcher's own memo of planned calls."""
    _FORGET_HOOKS.append(hook)


def _memoised(plan_fn):
    """Plans are pure functions of hashable descriptions: build each one once per process.
    (Re-planning cost ~10-30 us of host time per call, which counts at short sequences.)"""
    cached = functools.lru_cache(maxsize=1024)(
        lambda shapes, options, strides, config, diag_shift, sparse, flags: plan_fn(
            shapes, options, dict(strides), config=config, diag_shift=diag_shift, sparse=sparse, **dict(flags)))

    @functools.wraps(plan_fn)
    def plan(shapes, options, strides, *, config, diag_shift=0, sparse=None, **flags):
        frozen = tuple(sorted((k, tuple(v)) for k, v in strides.items()))
        # (The switches the plans read are part of the key.)
        flags["env"] = switches.current()
        return cached(shapes, options, frozen, config, int(diag_shift), sparse,
                      tuple(sorted(flags.items())))
    _PLAN_CACHES.append(cached)
    return plan


# The warp-specialised forward's tile.  Triton 3.6's Hopper pass specialises only 4-warp loops
# (8 warps compile unspecialised), and of the probed 4-warp tiles 128x128 with 2 stages was the
# fastest and the only one free of miscompiles (128x64 with 3 stages returned NaN):
# benchmarks/NOTES.md steps 14 and 18.
WS_TILE = TileConfig(128, 128, 4, 2)   # square: SPLIT_BAND cuts bands by it
WS_MIN_KEY_WORK = 1 << 18   # seqlen_k * head dim


def warp_specialized_forward(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs) -> bool:
    """Whether the forward can run warp-specialised (`warp_specialize` launches): one TMA loop with
    no branch in its body over every unmasked key tile of the band (split_band says whether the
    masked edges then need a second launch, split_band_pays whether that is worth it).

    What _warp_specializable needs, and enough work per program to repay building five
    descriptors, Sk * D >= WS_MIN_KEY_WORK (in the session-6 sweep, against the same kernel
    without it: D=64 lost 18% at S=1024 and 5% at S=2048, won 4-7% from S=4096; D=128 won 6% at
    S=2048 and 4% at S=1024, left out as noise).  A persistent launch sets up once per SM, so
    plan_forward lifts the work bar where persistent_forward holds."""
    return (_warp_specializable(shapes, sparse, constexprs)
            and shapes.seqlen_k * max(shapes.head_dim, shapes.head_dim_v) >= WS_MIN_KEY_WORK)


def _warp_specializable(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs) -> bool:
    """What every warp-specialised kernel needs.  Ruled out: per-element options -- bias, mask,
    segments, soft cap, dropout, explicit positions, block-sparse lists -- and packed keys; 32-bit
    inputs; TMA-illegal strides or widths.  Needed: at least one full query tile and
    16-byte-aligned lse rows (lse goes through TMA too)."""
    const = dict(constexprs)
    return (sparse is None and not shapes.varlen
            and shapes.seqlen_q >= WS_TILE.block_m and shapes.seqlen_q % 4 == 0
            and shapes.dtype in ("bfloat16", "float16") and _use_tma(True, shapes, constexprs)
            and not any(const[f] for f in ("HAS_BIAS", "HAS_MASK", "HAS_SEGMENTS", "HAS_SOFTCAP", "HAS_DROPOUT",
                                           "HAS_POSITIONS")))


def split_band(shapes: FlashShapes, constexprs) -> bool:
    """Whether a warp-specialised forward leaves masked edge tiles (causal or window bands, a
    partial last key tile) to a second, portable launch (SPLIT_BAND).  A mask applied branch-free
    to every tile inside the one loop measured equal at D=128 and 23% slower at D=64 (NOTES step
    18), and slower still with the backward's three-operation band test (step 21: -4 to -8% at
    D=128, -20 to -27% at D=64; experiments/ws_band_in_loop_fwd.patch); an `if` in the loop undoes
    the specialisation."""
    const = dict(constexprs)
    return const["HAS_LEFT"] or const["HAS_RIGHT"] or shapes.seqlen_k % WS_TILE.block_n != 0


# When a split band pays: the edges launch reads q, O, k and v again and writes O (~0.14 ms per
# 16k tokens of 16 heads at D=128 on the H100) against the interior's ~12%.  Measured (NOTES step
# 19, causal): D=128 +3% at S=8192 and +7% at S=16384, -5% at S=4096; D=64 -16% to 0%.
WS_SPLIT_MIN_KEYS = 8192        # keys the last query row of a tile can see
WS_SPLIT_MIN_HEAD_DIM = 128     # padded head dim (BLOCK_D / BLOCK_DV)


def band_keys(shapes: FlashShapes, options: FlashOptions, constexprs) -> int:
    """A bound on the keys one query row can see and on the queries one key can see."""
    const = dict(constexprs)
    longest = max(shapes.seqlen_q, shapes.seqlen_k)
    return min(longest, (options.window_left if const["HAS_LEFT"] else longest)
               + (options.window_right if const["HAS_RIGHT"] else longest) + 1)


def split_band_pays(shapes: FlashShapes, options: FlashOptions, constexprs) -> bool:
    const = dict(constexprs)
    return (max(const["BLOCK_D"], const["BLOCK_DV"]) >= WS_SPLIT_MIN_HEAD_DIM
            and min(shapes.seqlen_k, band_keys(shapes, options, constexprs)) >= WS_SPLIT_MIN_KEYS)


# The edges launch of a split band: one or a few masked tiles per program.  It is bound by reading
# q, O, k, v again, but small tiles still measured fastest (64x64/4 warps 0.142 ms, 128x128/8 warps
# 0.180 ms per 16k tokens at D=128; NOTES step 19).  The band's interior is cut by WS_TILE
# (square) whatever this tile is.
WS_EDGES_TILE = TileConfig(64, 64, 4, 2)


# A causal or window band's masked edge tiles inside the portable kernels' one loop, behind a
# branch (EDGES_IN_LOOP), instead of in loops of their own: saves each program the edge loops'
# pipeline fill and drain, costs every tile bounds-checked loads and the test.  Kernel times (CUDA
# graphs, NOTES step 24), causal forward / fwd+bwd: +14% / +7% at D=128 S=1024, +6% / +1.5% at 2048,
# D=64 +11% / +10% and +4% / +6.5%; at S=4096 within +-1%, at D=64 S=8192 -1.5% / -2%.  Without a
# band (nothing to save) the D=64 backward lost 4-7%.
EDGES_IN_LOOP_MAX_KEYS = 2048


EDGES_IN_LOOP_ENV = "DUALATTN_EDGES_IN_LOOP"


def edges_in_loop(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], constexprs,
                  flag: Optional[str] = None) -> bool:
    """Whether the portable kernels run their band's masked edges in the one loop (EDGES_IN_LOOP):
    causal or window bands of at most EDGES_IN_LOOP_MAX_KEYS keys.  Not with per-element masks
    (segments, a mask, explicit positions), which mask every tile, nor block-sparse lists.
    flag: DUALATTN_EDGES_IN_LOOP, "0" / "1" turn it off / on for every band (A/B runs)."""
    const = dict(constexprs)
    return (flag != "0" and sparse is None and (const["HAS_LEFT"] or const["HAS_RIGHT"])
            and not any(const[f] for f in ("HAS_MASK", "HAS_SEGMENTS", "HAS_POSITIONS"))
            and (flag == "1" or band_keys(shapes, options, constexprs) <= EDGES_IN_LOOP_MAX_KEYS))


# A persistent warp-specialised forward: one program per SM takes the grid's tiles in turn.  A
# specialised program's set-up (barriers, descriptors, the producer's first loads, the final TMA
# stores) then runs once per SM instead of once per tile, which pays where tiles are short: kernel
# time against the grid, 16k tokens, non-causal forward (NOTES step 25): D=128 +17% at S=1024, +7%
# at 2048, +2% at 4096, 0 at 8192, -1.5% at 16384; D=64 +8%, +5%, +1.5%, -2%, -3%.  Persistent
# programs take fixed shares of tiles where the grid's are dealt as SMs free up, and longer tiles
# leave less set-up to save.
PERSISTENT_MAX_KEYS = 4096
PERSISTENT_ENV = "DUALATTN_PERSISTENT"


def persistent_forward(shapes: FlashShapes, num_sms: int, flag: Optional[str] = None) -> bool:
    """Whether a warp-specialised forward (WS_TILE) would run persistent (PERSISTENT): the launcher
    gave the GPU's SM count (num_sms > 0), there are more tiles than SMs, and at most
    PERSISTENT_MAX_KEYS keys.  The portable kernels keep the grid (which also packs varlen tiles).
    flag: DUALATTN_PERSISTENT, "0" / "1" turn it off / on whatever the keys (A/B runs)."""
    tiles = cdiv(shapes.seqlen_q, WS_TILE.block_m) * shapes.batch * shapes.heads_q
    return (flag != "0" and num_sms > 0 and tiles > num_sms
            and (flag == "1" or shapes.seqlen_k <= PERSISTENT_MAX_KEYS))


# The warp-specialised backward kernels run persistent too: more 128-row tiles than SMs in each, at
# most PERSISTENT_BWD_MAX_KEYS keys, whole-array descriptors.  Kernel time against the grid (NOTES
# step 27), backward alone: D=128 non-causal +15% at S=1024, +8.5% at 2048, +3% at 4096; causal
# +12% at 2048, 0 at 4096; D=64 causal (dK/dV) +8.5% at 4096.  With every length persistent
# (DUALATTN_PERSISTENT=1): 0 non-causal and -5% causal at S=8192.
PERSISTENT_BWD_MAX_KEYS = 4096


def persistent_backward(shapes: FlashShapes, tiles: int, num_sms: int, flag: Optional[str] = None) -> bool:
    """Whether the warp-specialised backward kernels, `tiles` grid tiles in the smaller, run
    persistent: as persistent_forward, with PERSISTENT_BWD_MAX_KEYS."""
    return (flag != "0" and num_sms > 0 and tiles > num_sms
            and (flag == "1" or shapes.seqlen_k <= PERSISTENT_BWD_MAX_KEYS))


def whole_array_tiles(shapes: FlashShapes, scalars, constexprs) -> bool:
    """Whether a persistent forward's descriptors can each cover a whole operand as one matrix
    (rules.whole_tiles): every operand's batches end to end (batch stride = rows * row stride),
    only full tiles, and unpadded head dims, so no tile reaches into another batch or head."""
    stride, const = dict(scalars), dict(constexprs)
    rows = {"q": shapes.seqlen_q, "k": shapes.seqlen_k, "v": shapes.seqlen_k, "o": shapes.seqlen_q}
    return (not shapes.varlen and shapes.seqlen_q % WS_TILE.block_m == 0 and shapes.seqlen_k % WS_TILE.block_n == 0
            and const["BLOCK_D"] == const["HEAD_DIM"] and const["BLOCK_DV"] == const["HEAD_DIM_V"]
            and (shapes.batch == 1 or all(stride[f"stride_{x}b"] == n * stride[f"stride_{x}s"] for x, n in rows.items())))


WS_BAND_ENV = "DUALATTN_WS_BAND"


# Where a persistent forward runs a causal or window band whole in its one specialised loop by
# default (kernel time against the portable one-loop band, 16k tokens, causal; NOTES step 26): D=128
# +15% at S=1024, +5% at 2048, -1% at 4096; D=64 -12 to -18% (its loop is bound by exp2: step 21).
WS_BAND_MAX_KEYS = 2048
WS_BAND_MIN_HEAD_DIM = 128      # padded head dim (BLOCK_D / BLOCK_DV)


def ws_band_in_loop(shapes: FlashShapes, constexprs, persistent: bool, flag: Optional[str] = None) -> bool:
    """Whether a persistent warp-specialised forward runs a causal or window band whole in its one
    loop, position-masked on every tile (BAND_IN_LOOP, the backward's three-operation band test), in
    place of the split pair (split_band) or the portable kernel: at D=128 with at most
    WS_BAND_MAX_KEYS keys.  Needs every tile inside the sequences, so the test has no bounds checks:
    a persistent launch has that already (whole_array_tiles: Sq and Sk multiples of WS_TILE).  It paid only once the persistent programs built their
    descriptors once and took the tiles head-major in rounds of alternating direction (NOTES step
    26); on a grid it lost (step 21).  flag: DUALATTN_WS_BAND, "0" / "1" turn it off / on whatever
    the head dim and keys (A/B runs)."""
    const = dict(constexprs)
    return (flag != "0" and persistent and (const["HAS_LEFT"] or const["HAS_RIGHT"])
            and (flag == "1" or (max(const["BLOCK_D"], const["BLOCK_DV"]) >= WS_BAND_MIN_HEAD_DIM
                                 and shapes.seqlen_k <= WS_BAND_MAX_KEYS)))


# The one-pass backward (backward_gluon.py): (BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, DS_BUFS) by head
# dim.  Tiles and stages: the probe's fastest (benchmarks/experiments/gluon_bwd_probe.py, NOTES
# step 28).  Backward time, 16k tokens (experiments/one_pass_variants.py, NOTES step 32): D=128
# DQ_BUFS 2 (was 1) +2-3% non-causal, 0 causal; DS_BUFS 2 (the two warpgroups meet once per tile,
# not twice) +1-5% at D=64 but 6-20% slower at D=128 (the dQ tile reaches its warp half a tile
# later); BLOCK_M 128 at D=64 5-10% slower (spills).  8 compute warps (two wgmma warpgroups) plus
# its load and dQ warps.
ONE_PASS_TILES = {64: (64, 128, 3, 2, 2), 128: (64, 128, 2, 2, 1)}
ONE_PASS_WARPS = 8
ONE_PASS_ENV = "DUALATTN_ONE_PASS"
# Least keys (Sk) from which the one-pass backward replaces the two-pass one.
# fwd+bwd against the two-pass kernels, 16k tokens (NOTES step 29): non-causal D=128 -16% at S=1024,
# -3% at 2048, +1% at 4096, +7 / +10% at 8192 / 16384 (D=64 -12%, -4%, +1%, +4%, +8%).  Causal
# runs persistent over pairs of key tiles since step 32; backward alone against the two-pass
# kernels: D=128 -11% at S=2048, +3% at 4096; D=64 -1% at 2048, +4% at 4096.  Short problems lose
# the dQ accumulator's zero-fill and cast (~0.1 ms per 16k tokens).
ONE_PASS_MIN_KEYS = 4096
# Most keys for it: its fp32 dQ accumulator raises fwd+bwd peak memory from 1.01x to 1.25x the
# tensors a backward must hold (q, k, v, o, dO, dq, dk, dv, lse; `..._memory15.json`, B=1 H=16
# D=128, S = 8192 ... 131072).  At the longest sequences memory binds, so there the two-pass kernels
# (no accumulator) run.
ONE_PASS_MAX_KEYS = 32768


def one_pass_backward(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], strides,
                      constexprs, flag: Optional[str] = None) -> Optional[Tuple[int, int, int, int, int]]:
    """The one-pass backward's ONE_PASS_TILES entry where a problem qualifies, else None.

    What the warp-specialised kernels need (_warp_specializable: 16-bit inputs, TMA-legal strides, no
    per-element option, no block-sparse list, no packed varlen), head dims of 64 or 128 (equal for
    K and V), no window other than causal, and lse rows 16-byte aligned for TMA (Sq % 4 == 0,
    which _warp_specializable checks).  GQA reads a group's query heads as one row of G * D columns,
    so there query and out need head stride == head dim.  Sinks qualify: they change only lse and
    the preprocess's dsinks.  Where it pays and memory allows: ONE_PASS_MIN_KEYS <= Sk <=
    ONE_PASS_MAX_KEYS.  flag: DUALATTN_ONE_PASS, "0" / "1" turn it off / on whatever the keys (A/B
    runs, tests)."""
    tile = ONE_PASS_TILES.get(shapes.head_dim)
    if flag == "0" or tile is None or shapes.head_dim_v != shapes.head_dim:
        return None
    if flag != "1" and not ONE_PASS_MIN_KEYS <= shapes.seqlen_k <= ONE_PASS_MAX_KEYS:
        return None
    if options.window_left is not None or options.window_right not in (None, 0) or not _warp_specializable(
            shapes, sparse, constexprs):
        return None
    if shapes.group_size > 1 and any(strides[n][2] != shapes.head_dim for n in ("query", "out")):
        return None
    return tile


# The Gluon forward (forward_gluon.py): (BLOCK_M, BLOCK_N, STAGES); two 64-row compute warpgroups,
# 4 warps each.  Against the Triton forward (benchmarks/experiments/gluon_fwd_bench.py, kernel time,
# 16k tokens, S = 1024-16384, NOTES step 31): D=128 non-causal +9-15%, causal +26-38%; D=64
# non-causal +2-4%, causal +6-17%.  (STAGES = 3 at D=64 gained nothing.)
GLUON_FWD_TILE = (128, 128, 2)
GLUON_FWD_WARPS = 4
GLUON_FWD_ENV = "DUALATTN_GLUON_FWD"


def gluon_forward(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], strides, constexprs,
                  flag: Optional[str] = None) -> bool:
    """Whether the forward runs the Gluon kernel (launchers that can run Gluon on sm_90 only).

    What the warp-specialised kernels need (_warp_specializable), head dims of 64 or 128 (equal
    for K and V), no sinks and no window other than causal; descriptors over whole arrays, so in
    query, key and value the heads side by side and the batches end to end, and out's heads side
    by side.  flag: DUALATTN_GLUON_FWD, "0" turns it off (A/B runs, tests)."""
    if flag == "0" or shapes.head_dim not in (64, 128) or shapes.head_dim_v != shapes.head_dim:
        return False
    if options.window_left is not None or options.window_right not in (None, 0) or shapes.num_sinks:
        return False
    if not _warp_specializable(shapes, sparse, constexprs):
        return False
    return strides["out"][2] == shapes.head_dim and whole_array_rows(shapes, strides, ("query", "key", "value"))


def whole_array_rows(shapes: FlashShapes, strides, names) -> bool:
    """Whether each of `names` (query, key, value, out) reads as one (batch * seq, heads * head dim)
    matrix, as the Gluon kernels' whole-array descriptors take it: heads side by side (head stride ==
    head dim) and batches end to end (batch stride == seq * seq stride)."""
    rows = {"query": shapes.seqlen_q, "key": shapes.seqlen_k, "value": shapes.seqlen_k, "out": shapes.seqlen_q}
    return all(strides[n][2] == shapes.head_dim and (shapes.batch == 1 or strides[n][0] == rows[n] * strides[n][1])
               for n in names)


def _gluon_forward_launch(shapes: FlashShapes, options: FlashOptions, scalar: dict, diag_shift: int,
                          num_sms: int) -> Launch:
    """The Gluon forward: persistent, a program per SM (at most one per work item: a query tile, or
    causal, a pair of them)."""
    block_m, block_n, stages = GLUON_FWD_TILE
    causal = options.window_right == 0
    q_tiles = cdiv(shapes.seqlen_q, block_m)
    num_work = shapes.batch * shapes.heads_q * (cdiv(q_tiles, 2) if causal else q_tiles)
    grid = (max(1, min(num_sms or num_work, num_work)), 1, 1)
    return Launch(
        module="flash.forward_gluon", kernel="flash_fwd_gluon_kernel", grid=grid,
        inputs=("query", "key", "value"),
        scalars=tuple((k, scalar[k]) for k in ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks",
                                               "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_ob",
                                               "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h"))
        + (("batch", shapes.batch), ("seqlen_q", shapes.seqlen_q), ("seqlen_k", shapes.seqlen_k),
           ("num_heads_q", shapes.heads_q), ("diag", shapes.seqlen_k - shapes.seqlen_q + int(diag_shift)),
           ("num_work", num_work), ("sm_scale", float(options.softmax_scale))),
        outputs=(Output("out", out_shape(shapes), "like:query"), Output("lse", _lse_shape(shapes), "float32"),
                 desc_scratch(grid, True)),
        constexprs=(("HEAD_DIM", shapes.head_dim), ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("STAGES", stages),
                    ("GROUP_SIZE", shapes.group_size), ("CAUSAL", causal),
                    ("EVEN_K", shapes.seqlen_k % block_n == 0)),
        num_warps=GLUON_FWD_WARPS, num_stages=1)


def environment() -> switches.Switches:
    """The switches now (dualattn/switches.py): part of the key of a launcher's memo of planned calls,
    as they decide what planning a launch gives (here and in what launchers ask before planning:
    tma_requested, warp_specialize_requested, sm_count, the tuned table)."""
    return switches.current()


@_memoised
def plan_forward(shapes: FlashShapes, options: FlashOptions, strides: Dict[str, Tuple[int, ...]], *,
                 config: FlashConfig, diag_shift: int = 0, sparse: Optional[SparseInfo] = None,
                 tma: bool = False, warp_specialize: bool = False, num_sms: int = 0, gluon: bool = False,
                 env: switches.Switches = switches.Switches()) -> Launch:
    """The forward launch.  `strides` holds the element strides of the given arrays and of 'out'.

    The dropout seed is an input array (int32, shape (1,)), so JAX can pass a traced seed.
    With `sparse`, the kernels walk the layout's block lists (inputs SPARSE_INPUTS) and the
    tiles are the layout's blocks.  `warp_specialize`: the launcher can build TMA descriptors on
    an sm_90 GPU and allows the warp-specialised variant, which eligible problems then take with
    WS_TILE in place of config.fwd; where split_band, the returned launch's `then` finishes the
    masked edges, resuming from its out and lse (FWD_RESUME).  `num_sms`: the GPU's SM count, for
    a persistent warp-specialised launch (persistent_forward; 0: never persistent).  `gluon`: as
    plan_backward's; problems gluon_forward accepts then get the Gluon forward.
    """
    config = sparse.config(config) if sparse is not None else config
    scalars, constexprs = _common_scalars(shapes, options, strides, diag_shift, sparse)
    switch = env
    if gluon and gluon_forward(shapes, options, sparse, strides, constexprs, switch.get(GLUON_FWD_ENV)):
        return _gluon_forward_launch(shapes, options, dict(scalars), diag_shift, num_sms)
    persistent = (persistent_forward(shapes, num_sms, switch.get(PERSISTENT_ENV))   # if warp-specialised
                  and whole_array_tiles(shapes, scalars, constexprs))
    ws = warp_specialize and (warp_specialized_forward(shapes, sparse, constexprs) or (
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
                                         shapes, options, sparse, constexprs, switch.get(EDGES_IN_LOOP_ENV))),
                                     ("PERSISTENT", persistent_launch), ("SEGMENT_SKIP", skip)),
            num_warps=t.num_warps, num_stages=t.num_stages, then=then,
            resume=FWD_RESUME if split and not warp_specialized else SEGMENT_RESUME if skip else ())
        return segment_ranges_first(main, shapes, dict(scalars), t.block_m, t.block_n, True) if skip else main

    if ws:
        return launch(WS_TILE, True, True, then=launch(WS_EDGES_TILE, False, False) if split else None)
    # ptxas 3.6 crashed (segfault) on 2-stage TMA forward tiles (128x128/8 warps, 128x64/4
    # warps; benchmarks/results/2026-11-22_h100_tune_tma_fwd.log).
    return launch(config.fwd, _use_tma(tma, shapes, constexprs) and config.fwd.num_stages != 2, False)


def _forward_outputs(shapes: FlashShapes) -> Tuple[Output, Output]:
    """out and lse.  Varlen rows in no sequence (past cu_seqlens[-1], or past max_seqlen_q in a sequence
    a traced table made longer) are written by no program: filled beforehand with 0 and lse -inf."""
    return (Output("out", out_shape(shapes), "like:query", zeroed=shapes.varlen),
            Output("lse", _lse_shape(shapes), "float32", zeroed=shapes.varlen, fill=float("-inf")))


BWD_KERNEL_INPUTS = FWD_INPUTS + ("dout", "lse", "delta")
# What a launch resumes from the per-tile segment ranges its head launch computed (segments.py).
SEGMENT_RESUME = (("segment_ranges", "segment_ranges"),)


def segment_skip(shapes: FlashShapes, sparse: Optional[SparseInfo], warp_specialized: bool) -> bool:
    """Whether a launch visits only the tiles that share segment ids with its own (SEGMENT_SKIP): every
    portable dense launch with segment ids.  (Block-sparse launches walk their layout's lists.)"""
    return shapes.has_segments and sparse is None and not warp_specialized


def segment_ranges_first(main: Launch, shapes: FlashShapes, scalar: dict, block_own: int, block_other: int,
                         own_is_query: bool) -> Launch:
    """`main` preceded by the launch computing its per-tile segment ranges (segments.py), for its tiles:
    own tiles of block_own rows (queries in the forward and dQ, keys in dK/dV), iterated ones of block_other."""
    n_tiles = cdiv(shapes.seqlen_q if own_is_query else shapes.seqlen_k, block_own)
    return Launch(
        module="flash.segments", kernel="segment_ranges_kernel", grid=(n_tiles, shapes.batch, 1),
        inputs=("q_segment_ids", "kv_segment_ids"),
        scalars=tuple((k, scalar[k]) for k in ("seg_stride_qb", "seg_stride_kb", "seqlen_q", "seqlen_k"))
        + (("num_tiles", n_tiles),),
        outputs=(Output("segment_ranges", (shapes.batch, n_tiles, 2), "int32"),),
        constexprs=(("BLOCK_OWN", block_own), ("BLOCK_OTHER", block_other), ("OWN_IS_QUERY", own_is_query)),
        num_warps=4, num_stages=1, then=main)
# What a SPLIT_BAND edges launch resumes from: the interior launch's out and lse.
FWD_RESUME = (("resume_out", "out"), ("resume_lse", "lse"))

# Warp-specialised backward tiles (4-warp loops, as the forward's), by padded head dim, from the
# probe (benchmarks/experiments/ws_bwd_probe.py, NOTES step 20): the tile a program owns must be
# 128 rows, which the pass splits over two consumer warpgroups (64-row ones ran both on the same
# rows: half speed).  D=64: the specialised dQ loses to the portable one (probe; and in ours by
# 3-16%, NOTES step 23; persistent, by 5-9%, step 27), and the specialised dK/dV gains on a grid
# only where a causal or window band masks tiles, which cost the portable kernel more: +4-12%
# there, -4 to +5% unmasked (steps 20, 23).  Persistent, it also gains unmasked: +6-8% (step 27).
WS_DKDV_TILES = {128: TileConfig(64, 128, 4, 2)}
WS_DKDV_BANDED_OR_PERSISTENT_TILES = {**WS_DKDV_TILES, 64: TileConfig(64, 128, 4, 2)}
WS_DQ_TILES = {128: TileConfig(128, 128, 4, 2)}
# A lower bar than WS_MIN_KEY_WORK for the least Sq * D and Sk * D (D: the larger head dim, unpadded)
# at which the specialised backward of problems without a band pays, by padded head dim.  Kernel
# times (CUDA graphs, NOTES step 24) with the rule off at S=1024: D=128 non-causal backward +9%,
# causal -1% (so bands keep WS_MIN_KEY_WORK); D=64's banded dK/dV -10% (and -3% at S=2048).
WS_BWD_MIN_WORK = {128: 1 << 17}


def warp_specialized_backward(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs, persistent: bool = False
                              ) -> Tuple[Optional[TileConfig], Optional[TileConfig]]:
    """The warp-specialised (dK/dV, dQ) tiles where the backward can take them (None: portable).

    What every specialised kernel needs (_warp_specializable), with every tile of both loops inside
    the sequences: Sq and Sk multiples of 128; enough work per program, Sq * D and Sk * D at least
    WS_MIN_KEY_WORK (without a band, WS_BWD_MIN_WORK's bar for the width where lower); and for dK/dV
    one query head per KV head,
    since its GQA loop over the group's heads would be a second loop.  A causal or window band runs
    whole in the one loop, position-masked on every tile (backward.py).  `persistent`: the kernels
    would run persistent (persistent_backward), which drops the work bar: the bar kept short
    programs off the per-program set-up that persistence pays once per SM (kernel time at S=1024,
    NOTES step 27: causal backward +23% at D=128, +7% at D=64, non-causal D=128 +2%), and lets
    D=64 dK/dV specialise without a band (WS_DKDV_BANDED_OR_PERSISTENT_TILES)."""
    const = dict(constexprs)
    width = max(const["BLOCK_D"], const["BLOCK_DV"])
    banded = const["HAS_LEFT"] or const["HAS_RIGHT"]
    min_work = WS_MIN_KEY_WORK if banded else min(WS_MIN_KEY_WORK, WS_BWD_MIN_WORK.get(width, WS_MIN_KEY_WORK))
    if persistent:
        min_work = 0
    if not (_warp_specializable(shapes, sparse, constexprs)
            and shapes.seqlen_q % WS_TILE.block_m == 0 and shapes.seqlen_k % WS_TILE.block_n == 0
            and min(shapes.seqlen_q, shapes.seqlen_k) * max(shapes.head_dim, shapes.head_dim_v) >= min_work):
        return None, None
    dkdv_tiles = WS_DKDV_BANDED_OR_PERSISTENT_TILES if banded or persistent else WS_DKDV_TILES
    return (dkdv_tiles.get(width) if shapes.group_size == 1 else None), WS_DQ_TILES.get(width)


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
                  gluon: bool = False, deterministic: bool = False,
                  env: switches.Switches = switches.Switches()) -> BackwardPlan:
    """The three backward launches.  `strides` must include 'out' (also used for dout).

    lse_grad: the launcher passes 'dlse', the cotangent of the forward's lse (laid out like lse).
    warp_specialize: as plan_forward's; eligible kernels take the tiles warp_specialized_backward
    gives in place of config's.  num_sms: as plan_forward's (persistent_backward).
    gluon: the launcher runs Gluon kernels on an sm_90 GPU (torch; jax-triton 0.3.1 cannot compile
    them); problems one_pass_backward accepts then get the one-pass backward: `dkdv` computes dK,
    dV and an fp32 dQ accumulator ('dq_accum'), which `dq` takes as input and casts.  Launchers
    pass dkdv's results to dq.
    deterministic: no one-pass backward (its dQ tiles meet in fp32 atomics, in varying order); the
    two-pass kernels write every gradient tile from one program, so reruns are bitwise equal.
    """
    config = sparse.config(config) if sparse is not None else config
    scalars, constexprs = _common_scalars(shapes, options, strides, diag_shift, sparse)
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
        # torch, allocated: host time that counts at short sequences (NOTES steps 17 and 28).
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

    q_shape = (shapes.total_q, shapes.heads_q, shapes.head_dim) if varlen else \
        (shapes.batch, shapes.seqlen_q, shapes.heads_q, shapes.head_dim)
    k_shape = (shapes.total_k, shapes.heads_kv, shapes.head_dim) if varlen else \
        (shapes.batch, shapes.seqlen_k, shapes.heads_kv, shapes.head_dim)
    v_shape = k_shape[:-1] + (shapes.head_dim_v,)
    one_pass = one_pass_backward(shapes, options, sparse, strides, constexprs,
                                 env.get(ONE_PASS_ENV)) if gluon and not deterministic else None
    if one_pass is not None:
        dkdv, dq = _one_pass_launches(shapes, options, scalar, strides, q_shape, k_shape, v_shape, diag_shift,
                                      one_pass, num_sms, env.get(PERSISTENT_ENV))
        return BackwardPlan(preprocess, dkdv, dq, shapes.batch * shapes.heads_q * n_m_blocks)
    dbias_shape = (shapes.batch, shapes.heads_q, shapes.seqlen_q, shapes.seqlen_k) if shapes.has_bias else (1,)
    dbias_strides = _contiguous(dbias_shape)[:3] if shapes.has_bias else (0, 0, 0)

    use_tma = _use_tma(tma, shapes, constexprs)
    # Both specialised kernels own 128-row tiles (WS_DKDV_TILES' keys, WS_DQ_TILES' queries).
    ws_tiles = min(cdiv(shapes.seqlen_k, WS_TILE.block_n) * shapes.heads_kv,
                   cdiv(shapes.seqlen_q, WS_TILE.block_m) * shapes.heads_q) * shapes.batch
    persistent = (warp_specialize and whole_array_tiles(shapes, scalars, constexprs)
                  and persistent_backward(shapes, ws_tiles, num_sms, env.get(PERSISTENT_ENV)))
    ws_dkdv, ws_dq = (warp_specialized_backward(shapes, sparse, constexprs, persistent) if warp_specialize
                      else (None, None))
    edges = edges_in_loop(shapes, options, sparse, constexprs, env.get(EDGES_IN_LOOP_ENV))

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
                 Output("dbias", dbias_shape, "float32", zeroed=shapes.has_bias, placeholder=not shapes.has_bias),
                 desc_scratch(grid, use_tma or bool(ws_dkdv))),
        constexprs=constexprs + (("BLOCK_M", t.block_m), ("BLOCK_N", t.block_n), ("TMA", use_tma or bool(ws_dkdv)),
                                 ("WARP_SPECIALIZE", bool(ws_dkdv)), ("EDGES_IN_LOOP", not ws_dkdv and edges),
                                 ("PERSISTENT", dkdv_persistent), ("SEGMENT_SKIP", skip)),
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


def one_pass_persistent(shapes: FlashShapes, options: FlashOptions, strides, tile: Tuple[int, ...],
                        flag: Optional[str] = None) -> bool:
    """Whether the one-pass kernel runs persistent (a program per SM, work items dealt round-robin).

    Non-causal it pays where items are short: kernel time at 16k tokens, S=1024 (NOTES step 29):
    0.93 -> 0.85 ms at D=128, 1.27 -> 1.05 ms at D=64 (a program per item spent ~10 us building
    its descriptors); so, as the two-pass kernels, up to PERSISTENT_BWD_MAX_KEYS keys.  Causal
    items are pairs of key tiles, every pair the same work (backward_gluon._work_item), at every
    length: backward time against a program per key tile (NOTES step 32) D=128 +6% at S=2048, +5%
    at 4096, +1% at 16384; D=64 +17%, +13%, 0.  (Dealt round-robin one key tile each, unequal, the
    programs drifted apart: step 29.)  So causal needs an even number of key tiles.  Needs
    descriptors over whole arrays as (batch * seq, heads * head dim) matrices: Sq and Sk tile
    multiples (no tile reaches into the next batch), and in query, key, value and out the heads
    side by side (head stride == head dim) and the batches end to end (batch stride == seq * seq
    stride).  flag: DUALATTN_PERSISTENT, "0" / "1" turn it off / on wherever the descriptors allow
    (A/B runs, tests)."""
    block_m, block_n = tile[:2]
    causal = options.window_right == 0
    # causal: items are pairs of key tiles (backward_gluon._work_item), so an even number of them
    if flag == "0" or shapes.seqlen_q % block_m or shapes.seqlen_k % (2 * block_n if causal else block_n):
        return False
    if flag != "1" and not causal and shapes.seqlen_k > PERSISTENT_BWD_MAX_KEYS:
        return False
    return whole_array_rows(shapes, strides, ("query", "key", "value", "out"))


def _one_pass_launches(shapes: FlashShapes, options: FlashOptions, scalar: dict, strides, q_shape, k_shape, v_shape,
                       diag_shift: int, tile: Tuple[int, ...], num_sms: int,
                       persistent_flag: Optional[str]) -> Tuple[Launch, Launch]:
    """The one-pass kernel (dK, dV and an fp32 dQ accumulator) and the launch casting dQ; persistent
    where one_pass_persistent."""
    block_m, block_n, stages, dq_bufs, ds_bufs = tile
    grid = (cdiv(shapes.seqlen_k, block_n), shapes.batch * shapes.heads_kv, 1)
    num_work = grid[0] * grid[1]
    persistent = num_sms > 0 and one_pass_persistent(shapes, options, strides, tile, persistent_flag)
    if persistent:
        if options.window_right == 0:
            num_work //= 2   # pairs of key tiles (backward_gluon._work_item)
        grid = (min(num_sms, num_work), 1, 1)
    grads = {name: _seq_strides(_contiguous(shape), False) for name, shape in
             (("dk", k_shape), ("dv", v_shape), ("dq", q_shape))}
    one_pass = Launch(
        module="flash.backward_gluon", kernel="flash_bwd_one_pass_kernel", grid=grid,
        inputs=("query", "key", "value", "dout", "lse", "delta"),
        scalars=tuple((k, scalar[k]) for k in ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks",
                                               "stride_kh", "stride_vb", "stride_vs", "stride_vh"))
        + tuple((k, scalar[k]) for k in ("stride_ob", "stride_os", "stride_oh", "stride_lse_b", "stride_lse_h"))
        + tuple((f"stride_{g}{x}", v) for g in ("dk", "dv", "dq") for x, v in zip("bsh", grads[g]))
        + (("batch", shapes.batch), ("seqlen_q", shapes.seqlen_q), ("seqlen_k", shapes.seqlen_k),
           ("num_heads_kv", shapes.heads_kv), ("diag", shapes.seqlen_k - shapes.seqlen_q + int(diag_shift)),
           ("num_work", num_work), ("sm_scale", float(options.softmax_scale))),
        outputs=(Output("dkey", k_shape, "like:key"), Output("dvalue", v_shape, "like:value"),
                 Output("dq_accum", q_shape, "float32", zeroed=True), desc_scratch(grid, True)),
        constexprs=(("HEAD_DIM", shapes.head_dim), ("BLOCK_M", block_m), ("BLOCK_N", block_n), ("STAGES", stages),
                    ("DQ_BUFS", dq_bufs), ("GROUP_SIZE", shapes.group_size), ("NUM_WARPS", ONE_PASS_WARPS),
                    ("CAUSAL", options.window_right == 0), ("PERSISTENT", persistent), ("DS_BUFS", ds_bufs)),
        num_warps=ONE_PASS_WARPS, num_stages=1)
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
                 ("dropout_threshold", int(round(dropout_prob * (1 << 24))))),
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
