"""Which problems the Hopper kernels take: warp-specialised, persistent, Gluon, one-pass backward.

Each rule states what its kernel needs (16-bit inputs, TMA-legal strides, head dims, no per-element
option) and, for its thresholds, the reason behind them (docs/lessons.md, by title).
plan.py asks these rules while it assembles launches; they read only sizes, options, strides and
constexprs, and the developer switches that override them (dualattn/switches.py) arrive as `flag`.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ... import switches
from ...options import FlashOptions
from ...validation import FlashShapes
from ..launch import cdiv, next_pow2
from .tiles import SparseInfo, TileConfig, causal_window_keys

def tma_requested() -> bool:
    """Whether launchers ask for TMA tile loads in every kernel (the plan still checks each problem:
    _use_tma).  Opt-in with DUALATTN_TMA=1: pointer loads are already asynchronous once strides are
    proved aligned (docs/lessons.md, "TMA alone buys nothing")."""
    return switches.current().get("DUALATTN_TMA") == "1"


def warp_specialize_requested(arch: Optional[int]) -> bool:
    """Whether launchers allow the warp-specialised kernels on sm_<arch> (None: the CPU interpreter;
    warp_specialized_forward / _backward decide if a problem qualifies).  Default: on sm_90, where
    they were tuned (docs/lessons.md, "What Triton's warp specialisation accepts").  DUALATTN_WS=0 turns them off
    (both frameworks then run
    the portable kernels); DUALATTN_WS=1 allows them wherever descriptors work, the interpreter
    included (tests)."""
    flag = switches.current().get("DUALATTN_WS")
    return flag == "1" or (flag != "0" and arch == 90)


def gluon_allowed(arch: Optional[int], warp_specialize: bool) -> bool:
    """Whether a launcher may run the Gluon one-pass backward (plan_backward's `gluon`): it exists
    for sm_90 only (wgmma, setmaxnreg), and goes with the warp-specialised kernels (DUALATTN_WS=0
    turns both off).  `warp_specialize`: the launcher's warp_specialize flag for this call."""
    return warp_specialize and arch == 90


def _use_tma(requested: bool, shapes: FlashShapes, constexprs, max_width: int = 128) -> bool:
    """TMA tile loads (rules.row_tiles) where the launcher asked for them and a descriptor is
    legal: 16-byte aligned rows and head offsets (every stride a multiple of 16 elements; the
    launcher checks the base pointers) and tiles at most `max_width` wide: 128 for the Triton kernels, whose
    256-wide TMA tiles crash ptxas 3.6 (checked offline for sm_90); the Gluon forward passes 256."""
    const = dict(constexprs)
    return bool(requested) and const["STRIDES_ALIGNED"] and max(const["BLOCK_D"], const["BLOCK_DV"]) <= max_width


# The warp-specialised forward's tile.  Triton 3.6's Hopper pass specialises only 4-warp loops
# (8 warps compile unspecialised), and of the 4-warp tiles 128x128 with 2 stages is the only one free
# of miscompiles (128x64 with 3 stages returned NaN): docs/lessons.md, "What Triton's warp
# specialisation accepts".
WS_TILE = TileConfig(128, 128, 4, 2)   # square: SPLIT_BAND cuts bands by it
WS_MIN_KEY_WORK = 1 << 18   # seqlen_k * head dim


def warp_specialized_forward(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs) -> bool:
    """Whether the forward can run warp-specialised (`warp_specialize` launches): one TMA loop with
    no branch in its body over every unmasked key tile of the band (split_band says whether the
    masked edges then need a second launch, split_band_pays whether that is worth it).

    What _warp_specializable needs, and enough work per program to repay building five
    descriptors, Sk * D >= WS_MIN_KEY_WORK: below it the fixed set-up is not repaid
    (docs/lessons.md, "The work bar for warp-specialised launches").  A persistent launch sets up
    once per SM, so plan_forward lifts the work bar where persistent_forward holds."""
    return (_warp_specializable(shapes, sparse, constexprs)
            and shapes.seqlen_k * max(shapes.head_dim, shapes.head_dim_v) >= WS_MIN_KEY_WORK)


def _warp_specializable(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs, max_width: int = 128) -> bool:
    """What every warp-specialised kernel needs.  Ruled out: per-element options that read a tile
    beside the scores -- bias, mask, segments, dropout, explicit positions, block-sparse lists --
    and packed keys; 32-bit inputs; TMA-illegal strides or widths.  Needed: at least one full
    query tile and 16-byte-aligned lse rows (lse goes through TMA too).  The soft cap is only
    arithmetic on the scores, which the Triton kernels share with the portable ones (rules.logits
    and the backward's derivative); the Gluon kernels have it too (gluon_shared.capped_tanh)."""
    const = dict(constexprs)
    return (sparse is None and not shapes.varlen
            and shapes.seqlen_q >= WS_TILE.block_m and shapes.seqlen_q % 4 == 0
            and shapes.dtype in ("bfloat16", "float16") and _use_tma(True, shapes, constexprs, max_width)
            and not any(const[f] for f in ("HAS_BIAS", "HAS_MASK", "HAS_SEGMENTS", "HAS_DROPOUT", "HAS_POSITIONS")))


def _without_segments(constexprs, *others: str):
    """The constexprs as if there were no segment ids (nor the options named in `others`): the Gluon
    kernels take them (per-tile ranges narrow the loops, ids compared outside a tile's one-id run)
    where the Triton ones cannot."""
    dropped = ("HAS_SEGMENTS",) + others
    return tuple((name, False if name in dropped else value) for name, value in constexprs)


def split_band(shapes: FlashShapes, constexprs) -> bool:
    """Whether a warp-specialised forward leaves masked edge tiles (causal or window bands, a
    partial last key tile) to a second, portable launch (SPLIT_BAND).  The loop is bound by exp2 and
    its two GEMMs are too short to hide a branch-free mask on every tile, even the backward's
    three-operation band test; an `if` in the loop undoes the specialisation (docs/lessons.md, "Masks
    in the warp-specialised forward: split long bands")."""
    const = dict(constexprs)
    return const["HAS_LEFT"] or const["HAS_RIGHT"] or shapes.seqlen_k % WS_TILE.block_n != 0


# When a split band pays: the edges launch reads q, O, k and v again and writes O, a fixed cost that only the
# interior's gain on many visible keys at the wider head dims repays (docs/lessons.md, "Masks in the
# warp-specialised forward: split long bands").
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


# The edges launch of a split band: one or a few masked tiles per program.  It is bound by reading q, O, k, v
# again, and small tiles are still the fastest for it.  The band's interior is cut by WS_TILE (square)
# whatever this tile is.
WS_EDGES_TILE = TileConfig(64, 64, 4, 2)


# A causal or window band's masked edge tiles inside the portable kernels' one loop, behind a branch
# (EDGES_IN_LOOP), instead of in loops of their own: saves each program the edge loops' pipeline fill and
# drain, costs every tile bounds-checked loads and the test: it pays for short bands only, and without a band
# there is nothing to save (docs/lessons.md, "Short bands run their edges inside the one loop").
EDGES_IN_LOOP_MAX_KEYS = 2048


EDGES_IN_LOOP_ENV = "DUALATTN_EDGES_IN_LOOP"


def edges_in_loop(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], constexprs,
                  flag: Optional[str] = None, segment_skip: bool = False) -> bool:
    """Whether the portable kernels run their band's masked edges in the one loop (EDGES_IN_LOOP):
    causal or window bands of at most EDGES_IN_LOOP_MAX_KEYS keys.  Not with per-element masks
    (a mask, explicit positions), which mask every tile, nor block-sparse lists.  Segment ids only
    in launches that skip the compare inside documents (`segment_skip`: SEGMENT_SKIP), whose edge
    tiles then compare ids in the branch; documents bound the band by lengths the host does not know,
    so their launches take it at any length.
    flag: DUALATTN_EDGES_IN_LOOP, "0" / "1" turn it off / on for every band (A/B runs)."""
    const = dict(constexprs)
    if flag == "0" or sparse is not None or const["HAS_MASK"] or const["HAS_POSITIONS"]:
        return False
    if const["HAS_SEGMENTS"]:
        return segment_skip
    return ((const["HAS_LEFT"] or const["HAS_RIGHT"])
            and (flag == "1" or band_keys(shapes, options, constexprs) <= EDGES_IN_LOOP_MAX_KEYS))


# A persistent warp-specialised forward: one program per SM takes the grid's tiles in turn.  A specialised
# program's set-up (barriers, descriptors, the producer's first loads, the final TMA stores) then runs once
# per SM instead of once per tile, which pays where tiles are short (docs/lessons.md, "Persistent launches").
# Persistent programs take fixed shares of tiles where the grid's are dealt as SMs free up, and longer tiles
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
# most PERSISTENT_BWD_MAX_KEYS keys, whole-array descriptors: as in the forward, the saved set-up pays at
# short sequences and not at long ones (docs/lessons.md, "Persistent launches").
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
            and (shapes.batch == 1 or all(stride[f"stride_{x}b"] == n * stride[f"stride_{x}s"] for x, n in
            rows.items())))


WS_BAND_ENV = "DUALATTN_WS_BAND"


# Where a persistent forward runs a causal or window band whole in its one specialised loop by default: short
# bands at D=128 (docs/lessons.md, "Persistent launches"); at D=64 its loop is bound by exp2 (docs/lessons.md,
# "At D = 64 the forward is bound by exp2").
WS_BAND_MAX_KEYS = 2048
WS_BAND_MIN_HEAD_DIM = 128      # padded head dim (BLOCK_D / BLOCK_DV)


def ws_band_in_loop(shapes: FlashShapes, constexprs, persistent: bool, flag: Optional[str] = None) -> bool:
    """Whether a persistent warp-specialised forward runs a causal or window band whole in its one
    loop, position-masked on every tile (BAND_IN_LOOP, the backward's three-operation band test), in
    place of the split pair (split_band) or the portable kernel: at D=128 with at most
    WS_BAND_MAX_KEYS keys.  Needs every tile inside the sequences, so the test has no bounds checks:
    a persistent launch has that already (whole_array_tiles: Sq and Sk multiples of WS_TILE).  It paid
    only once the persistent programs built their descriptors once and took the tiles head-major in
    rounds of alternating direction; on a grid it lost (docs/lessons.md, "Persistent launches").
    flag: DUALATTN_WS_BAND, "0" /
    "1" turn it off / on whatever the head dim and keys (A/B runs)."""
    const = dict(constexprs)
    return (flag != "0" and persistent and (const["HAS_LEFT"] or const["HAS_RIGHT"])
            and (flag == "1" or (max(const["BLOCK_D"], const["BLOCK_DV"]) >= WS_BAND_MIN_HEAD_DIM
                                 and shapes.seqlen_k <= WS_BAND_MAX_KEYS)))


# The one-pass backward (backward_gluon.py): (BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, DS_BUFS) by head dim.  Tiles
# and stages: the probe's fastest (docs/lessons.md, "Two passes in Triton, one pass only in Gluon").  DQ_BUFS 2
# pays at D=128; DS_BUFS 2 (the two warpgroups meet once per tile, not twice) pays at D=64 but not at D=128 (the
# dQ tile reaches its warp half a tile later); BLOCK_M 128 at D=64 spills (docs/lessons.md, "One-pass tile
# settings", tuned by benchmarks/tune_one_pass.py).
# 8 compute warps (two wgmma warpgroups) plus its load and dQ warps.  D=256: 64-key tiles, each warpgroup on half
# of dK's and dV's columns (at 128 keys dK and dV alone would take 256 registers a thread); the fp32 dQ tile is
# staged in each stage's Q and dO buffers, so DQ_BUFS = STAGES (backward_gluon's WIDE).
ONE_PASS_TILES = {64: (64, 128, 3, 2, 2), 128: (64, 128, 2, 2, 1), 256: (64, 64, 2, 2, 1)}
ONE_PASS_WARPS = 8
ONE_PASS_ENV = "DUALATTN_ONE_PASS"
# Least keys (Sk) from which the one-pass backward replaces the two-pass one: shorter problems do not repay its
# per-item set-up and the dQ accumulator's zero-fill and cast (docs/lessons.md, "When the one-pass backward
# runs"); causal runs persistent over pairs of key tiles (docs/lessons.md, "Equal work items for persistent
# causal kernels").
ONE_PASS_MIN_KEYS = 4096
# The same at D = 256, whose two-pass kernels are the portable ones, and at head dims padded to a width: there
# the one-pass kernel pays from far fewer keys (docs/lessons.md, "When the one-pass backward runs").
ONE_PASS_MIN_KEYS_WIDE_OR_PADDED = 512
# Most keys for it: its fp32 dQ accumulator adds about a quarter to the tensors a backward must hold
# (q, k, v, o, dO, dq, dk, dv, lse).  At the longest sequences memory binds, so there the two-pass
# kernels (no accumulator) run.
ONE_PASS_MAX_KEYS = 32768


def one_pass_backward(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], strides,
                      constexprs, flag: Optional[str] = None, bias_grad: bool = True,
                      sequence_keys: int = 0) -> Optional[Tuple[int, int, int, int, int]]:
    """The one-pass backward's ONE_PASS_TILES entry where a problem qualifies, else None.

    What the Gluon kernels need (_warp_specializable: 16-bit inputs, TMA-legal strides, no
    per-element option, no packed varlen; the soft cap qualifies, a block-sparse layout of 128 x 128 blocks
    (sparse_on_gluon_tiles: each key tile walks its list of query blocks), and segment ids: the
    key tiles' segment ranges narrow their query tiles, as in the Gluon forward), head dims of 64, 128 or 256
    or padded to them as in the Gluon forward (gluon_tile_width; equal for K and V), a window only as causal or
    causal with a left side, and lse rows 16-byte aligned for TMA
    (Sq % 4 == 0, which _warp_specializable checks).  GQA reads a group's query heads as one row of G * D columns,
    so there query and out need head stride == head dim.  Sinks qualify: they change only lse and
    the preprocess's dsinks.  Where it pays and memory allows: ONE_PASS_MIN_KEYS (at D = 256 and padded head
    dims ONE_PASS_MIN_KEYS_WIDE_OR_PADDED) <= Sk and the longest sequence's keys <= ONE_PASS_MAX_KEYS: Sk, or
    `sequence_keys` for a pack of sequences of at most that many (a varlen call run as documents), whose
    accumulator is that of the same sequences as a batch.  A bias or an attention mask qualifies
    as in the Gluon forward (score_tiles_copyable; fit.backward checks the shared memory), a bias only where no dbias is
    wanted (bias_grad off: dS is not written out).  Dropout qualifies (the forward's hash, per tile).
    flag: DUALATTN_ONE_PASS, "0" / "1" turn it off /
    on whatever the keys (A/B runs, tests)."""
    width = gluon_tile_width(shapes.head_dim)
    tile = ONE_PASS_TILES.get(width)
    if flag == "0" or tile is None or shapes.head_dim_v != shapes.head_dim:
        return None
    min_keys = ONE_PASS_MIN_KEYS if shapes.head_dim in (64, 128) else ONE_PASS_MIN_KEYS_WIDE_OR_PADDED
    longest = sequence_keys or shapes.seqlen_k
    if flag != "1" and not (min_keys <= shapes.seqlen_k and longest <= ONE_PASS_MAX_KEYS):
        return None
    if options.window_right not in (None, 0) or (options.window_left is not None and options.window_right != 0):
        return None
    if not sparse_on_gluon_tiles(sparse):
        return None
    if sparse is not None and width == 256:
        return None   # (its 64-key tiles are not the layout's 128 x 128 blocks)
    if not _warp_specializable(shapes, None, _without_segments(constexprs, "HAS_BIAS", "HAS_MASK", "HAS_DROPOUT"),
                               max_width=width):
        return None
    if (shapes.has_bias and bias_grad) or not all(score_tiles_copyable(shapes, strides, name)
                                                  for name in ("bias", "attention_mask")):
        return None
    if shapes.group_size > 1 and any(strides[n][2] != shapes.head_dim for n in ("query", "out")):
        return None
    return tile


# The Gluon forward (forward_gluon.py): (BLOCK_M, BLOCK_N, STAGES) by head dim; two 64-row compute warpgroups,
# 4 warps each.  (STAGES = 3 at D=64 gains nothing: docs/lessons.md, "At D = 64 the forward is bound by exp2".)
# D=256: Q (64 KB) and two stages of 64-key K and V tiles (128 KB), O staged in Q's buffers (forward_gluon's
# O_IN_Q; docs/lessons.md, "D = 256: O staged in Q's buffers"); a warpgroup holds O in 128 registers a thread and
# S in 32.
GLUON_FWD_TILES = {64: (128, 128, 2), 128: (128, 128, 2), 256: (128, 64, 2)}


def gluon_tile_width(head_dim: int) -> Optional[int]:
    """The Gluon kernels' tile width (BLOCK_D) for a head dim, or None: the dim itself where GLUON_FWD_TILES has
    it; for other multiples of 16 from 80 to 240 (96, 192; the strides _use_tma takes) the next power of two,
    whose columns past the head dim TMA fills with zeros (descriptors of (rows, heads, dims) in both kernels)."""
    if head_dim in GLUON_FWD_TILES:
        return head_dim
    width = next_pow2(head_dim)
    return width if head_dim % 16 == 0 and 64 < head_dim and width in GLUON_FWD_TILES else None


GLUON_FWD_WARPS = 4
# Its bias and mask tiles each compute warpgroup keeps in flight (forward_gluon._fwd_tile): two where they fit, so
# that a key tile's copy is issued a whole key tile before its softmax reads it, not one S GEMM before.  What fits
# beside Q, O and two stages of K and V, in bytes per score of one tile held twice, by tile width: at 128 one byte
# (a mask alone; a 16-bit bias holds its second tiles in O's staging buffers), at 64 three (a 16-bit bias and a
# mask), at 256 (64-key tiles, O staged in Q's buffers) two (a 16-bit bias or a mask).  docs/lessons.md, "Bias and
# mask tiles: copied ahead into shared memory".
GLUON_SCORE_BYTES_TWICE = {64: 3, 128: 1, 256: 2}


def gluon_score_buffers(shapes: FlashShapes) -> int:
    """How many bias and mask tiles the Gluon forward's warpgroups hold (SCORE_BUFS): 2 where both fit twice
    (GLUON_SCORE_BYTES_TWICE, by the tiles' width: gluon_tile_width), or for a 16-bit bias alone on the
    128-wide tiles, whose second tiles are O's staging buffers (forward_gluon's O_SCORES); else 1.  A bias of
    unknown dtype counts as float32."""
    bias_bytes = 2 if shapes.bias_dtype in ("bfloat16", "float16") else 4
    width = gluon_tile_width(shapes.head_dim)
    o_sized = width is not None and GLUON_FWD_TILES[width][1] == width   # (O_SCORES: BLOCK_D == BLOCK_N)
    if o_sized and shapes.has_bias and not shapes.has_mask and bias_bytes == 2:
        return 2
    per_score = bias_bytes * shapes.has_bias + shapes.has_mask
    return 2 if 0 < per_score <= GLUON_SCORE_BYTES_TWICE.get(width, 0) else 1
def gluon_load_first(shapes: FlashShapes, causal: bool) -> bool:
    """Whether the Gluon forward's load warp is its default partition and both compute warpgroups are workers of 240
    registers (forward_gluon's LOAD_FIRST), rather than the first compute warpgroup the default with what the
    others leave (232).  Only for a causal mask on the 128-wide tiles, whose key loop at 232 registers reloads
    spilled ones on every key tile; in the other variants the order cleared no loop, and dropout's loops spilled
    with it (docs/lessons.md, "A causal mask at D = 128: the load warp as the default partition")."""
    return shapes.has_mask and causal and gluon_tile_width(shapes.head_dim) == 128


GLUON_FWD_ENV = "DUALATTN_GLUON_FWD"
# Block-sparse layouts the Gluon kernels walk: (block_q, block_k), sparse_on_gluon_tiles.
GLUON_SPARSE_BLOCKS = (128, 128)


def gluon_forward(shapes: FlashShapes, options: FlashOptions, sparse: Optional[SparseInfo], strides, constexprs,
                  flag: Optional[str] = None) -> bool:
    """Whether the forward runs the Gluon kernel (launchers that can run Gluon on sm_90 only).

    What the warp-specialised kernels need (_warp_specializable), head dims of 64, 128 or 256 and those
    gluon_tile_width pads (equal for K and V; other than 64 and 128 without a block-sparse layout), a window only
    as causal or
    causal with a left side (sliding windows: Mistral, GPT-OSS), sinks of any count (joined after the
    loop), segment ids (packed documents, not varlen: _warp_specializable), the soft cap (the Triton
    kernels' tanh, softcap_mode), a bias and an attention mask (any broadcast over batch and heads),
    dropout (rules.dropout_keep, the hash every kernel applies); descriptors over whole arrays, so in
    query, key and value the heads side by side and the batches end to end, and out's heads side
    by side.  A block-sparse layout whose blocks are the kernel's tiles (sparse_on_gluon_tiles): each
    query tile walks its list of key blocks.  flag: DUALATTN_GLUON_FWD, "0" turns it off (A/B runs, tests)."""
    width = gluon_tile_width(shapes.head_dim)
    if flag == "0" or width is None or shapes.head_dim_v != shapes.head_dim:
        return False
    # Block-sparse layouts only on the tiles they were written for (128 x 128): not D = 256's 64-key tiles, nor
    # padded head dims.  A bias and a mask take every width (their copies span BLOCK_N keys).
    if (GLUON_FWD_TILES[width][1] != 128 or width != shapes.head_dim) and sparse is not None:
        return False
    if options.window_right not in (None, 0) or (options.window_left is not None and options.window_right != 0):
        return False
    if not sparse_on_gluon_tiles(sparse):
        return False
    # Segment ids: each query tile's key tiles narrowed by its segment ranges (plan.segment_ranges_first), ids
    # compared on the tiles outside its one-id run.  A bias and an attention mask: read per tile beside S.
    if not _warp_specializable(shapes, None, _without_segments(constexprs, "HAS_BIAS", "HAS_MASK", "HAS_DROPOUT"),
                               max_width=max(GLUON_FWD_TILES)):
        return False
    if not all(score_tiles_copyable(shapes, strides, name) for name in ("bias", "attention_mask")):
        return False
    return strides["out"][2] == shapes.head_dim and whole_array_rows(shapes, strides, ("query", "key", "value"))


# Causal sliding windows of at most this many keys a row, by head dim, run the forward on the portable kernel
# (its tiles: tiles.default_config), not the Gluon one.  A window's query tile reads few key tiles, so the
# Gluon forward's fixed cost per work item (docs/lessons.md, "Short items pay a fixed cost per work item")
# dominates, where the portable grid of 64 x 64 tiles runs several programs per SM that hide each other's set-up
# (docs/lessons.md, "Short windows run the portable kernels").
SHORT_WINDOW_KEYS = {64: 1024, 128: 128}
# The same for the backward: the portable two-pass kernels (on tiles.SHORT_WINDOW_DKDV_TILE / DQ_TILE) instead of
# the one-pass Gluon one or the warp-specialised two-pass one: their per-item cost dominates a short window's
# key tiles too (docs/lessons.md, "Short windows run the portable kernels").
SHORT_WINDOW_BWD_KEYS = {64: 512, 128: 512}


def _short_window(shapes: FlashShapes, options: FlashOptions, constexprs, keys_by_head_dim, width: int) -> bool:
    const = dict(constexprs)
    keys = causal_window_keys(options)
    return (keys is not None and shapes.head_dim == shapes.head_dim_v
            and keys <= keys_by_head_dim.get(width, 0) and not const["SOFTCAP"]
            and not any(const[f] for f in ("HAS_BIAS", "HAS_MASK", "HAS_SEGMENTS", "HAS_DROPOUT", "HAS_POSITIONS")))


def short_window_forward(shapes: FlashShapes, options: FlashOptions, constexprs) -> bool:
    """Whether the forward runs a causal sliding window of at most SHORT_WINDOW_KEYS[head dim] keys on the
    portable kernel.  Only with the options it was measured with (sinks, GQA): a bias, mask, segment ids,
    dropout or soft cap keep the Hopper kernels' rules.  A head dim the Gluon forward pads (96) takes the rule
    of its tiles' width (gluon_tile_width)."""
    return _short_window(shapes, options, constexprs, SHORT_WINDOW_KEYS,
                         gluon_tile_width(shapes.head_dim) or shapes.head_dim)


def short_window_backward(shapes: FlashShapes, options: FlashOptions, constexprs) -> bool:
    """Whether the backward runs a causal sliding window of at most SHORT_WINDOW_BWD_KEYS[head dim] keys on the
    portable two-pass kernels; the same options as short_window_forward."""
    return _short_window(shapes, options, constexprs, SHORT_WINDOW_BWD_KEYS, shapes.head_dim)


def sparse_on_gluon_tiles(sparse: Optional[SparseInfo]) -> bool:
    """Whether the Gluon kernels can walk a block-sparse layout: blocks of 128 x 128 (FlexAttention's
    default), the Gluon forward's tile, whose query blocks the one-pass backward splits into two of
    its 64-row tiles.  True where there is no layout."""
    return sparse is None or (sparse.block_q, sparse.block_k) == GLUON_SPARSE_BLOCKS


def score_tiles_copyable(shapes: FlashShapes, strides, name: str) -> bool:
    """Whether the Gluon forward can copy tiles of `name` (bias, attention_mask: (B|1, Hq|1, Sq, Sk))
    in 16-byte pieces (gluon_shared.copy_score_tile): every stride it steps by and Sk multiples of 8
    elements, and 64 rows within 2**31 elements (32-bit row offsets).  True where it is absent.
    (Whether its tiles then fit in shared memory is fit.forward's check, on the compiled kernel.)"""
    if name not in strides:
        return True
    bcast = {"bias": (shapes.bias_bcast_batch, shapes.bias_bcast_head),
             "attention_mask": (shapes.mask_bcast_batch, shapes.mask_bcast_head)}[name]
    batch, head, row, col = strides[name]
    steps = [row] + [s for s, broadcast in zip((batch, head), bcast) if not broadcast]
    return col == 1 and shapes.seqlen_k % 8 == 0 and all(s % 8 == 0 for s in steps) and 64 * row < 2 ** 31


def whole_array_rows(shapes: FlashShapes, strides, names) -> bool:
    """Whether each of `names` (query, key, value, out) reads as one (batch * seq, heads * head dim)
    matrix, as the Gluon kernels' whole-array descriptors take it: heads side by side (head stride ==
    head dim) and batches end to end (batch stride == seq * seq stride)."""
    rows = {"query": shapes.seqlen_q, "key": shapes.seqlen_k, "value": shapes.seqlen_k, "out": shapes.seqlen_q}
    return all(strides[n][2] == shapes.head_dim and (shapes.batch == 1 or strides[n][0] == rows[n] * strides[n][1])
               for n in names)


# Warp-specialised backward tiles (4-warp loops, as the forward's), by padded head dim (docs/lessons.md, "The
# warp-specialised backward's tiles"): the tile a program owns must be 128 rows, which the pass splits over two
# consumer warpgroups (64-row ones ran both on the same rows).  D=64: the specialised dQ loses to the portable
# one, grid or persistent, and the specialised dK/dV gains on a grid only where a causal or window band masks
# tiles, which cost the portable kernel more; persistent, it also gains unmasked.
WS_DKDV_TILES = {128: TileConfig(64, 128, 4, 2)}
WS_DKDV_BANDED_OR_PERSISTENT_TILES = {**WS_DKDV_TILES, 64: TileConfig(64, 128, 4, 2)}
WS_DQ_TILES = {128: TileConfig(128, 128, 4, 2)}
# A lower bar than WS_MIN_KEY_WORK for the least Sq * D and Sk * D (D: the larger head dim, unpadded) at which
# the specialised backward of problems without a band pays, by padded head dim: at D=128 the unbanded backward
# repays its set-up on fewer keys; bands keep WS_MIN_KEY_WORK (docs/lessons.md, "The work bar for
# warp-specialised launches").
WS_BWD_MIN_WORK = {128: 1 << 17}


def warp_specialized_backward(shapes: FlashShapes, sparse: Optional[SparseInfo], constexprs, persistent:
bool = False
                              ) -> Tuple[Optional[TileConfig], Optional[TileConfig]]:
    """The warp-specialised (dK/dV, dQ) tiles where the backward can take them (None: portable).

    What every specialised kernel needs (_warp_specializable), with every tile of both loops inside
    the sequences: Sq and Sk multiples of 128; enough work per program, Sq * D and Sk * D at least
    WS_MIN_KEY_WORK (without a band, WS_BWD_MIN_WORK's bar for the width where lower); and for dK/dV
    one query head per KV head,
    since its GQA loop over the group's heads would be a second loop.  A causal or window band runs
    whole in the one loop, position-masked on every tile (backward.py).  `persistent`: the kernels
    would run persistent (persistent_backward), which drops the work bar: the bar kept short
    programs off the per-program set-up that persistence pays once per SM (docs/lessons.md, "The work
    bar for warp-specialised launches"), and lets
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


def one_pass_persistent(shapes: FlashShapes, options: FlashOptions, strides, tile: Tuple[int, ...],
                        flag: Optional[str] = None, sparse: Optional[SparseInfo] = None) -> bool:
    """Whether the one-pass kernel runs persistent (a program per SM, work items dealt round-robin).

    Non-causal it pays where items are short (a program per item spends a fixed time building its
    descriptors: docs/lessons.md, "Persistent launches"); so, as the two-pass kernels, up to
    PERSISTENT_BWD_MAX_KEYS keys.  Causal items are pairs of key tiles, every pair the same work
    (backward_gluon._work_item), at every length: dealt round-robin one key tile each, unequal, the
    programs drift apart (docs/lessons.md, "Equal work items for persistent causal kernels").  So
    causal needs an even number of key tiles.  Needs
    descriptors over whole arrays as (batch * seq, heads * head dim) matrices: Sq and Sk tile
    multiples (no tile reaches into the next batch), and in query, key, value and out the heads
    side by side (head stride == head dim) and the batches end to end (batch stride == seq * seq
    stride).  Block-sparse: items are pairs of key tiles too (the busiest with the least busy), at every
    length, where the layout's query blocks (two query tiles each) end at Sq: a listed block's second
    tile would otherwise reach into the next batch.  flag: DUALATTN_PERSISTENT, "0" / "1" turn it off /
    on wherever the descriptors allow (A/B runs, tests)."""
    block_m, block_n = tile[:2]
    paired = options.window_right == 0 or sparse is not None
    # causal or block-sparse: items are pairs of key tiles (backward_gluon._work_item), so an even number
    rows = sparse.block_q if sparse is not None else block_m
    if flag == "0" or shapes.seqlen_q % rows or shapes.seqlen_k % (2 * block_n if paired else block_n):
        return False
    if flag != "1" and not paired and shapes.seqlen_k > PERSISTENT_BWD_MAX_KEYS:
        return False
    return whole_array_rows(shapes, strides, ("query", "key", "value", "out"))


