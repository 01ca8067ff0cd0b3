"""Tiles of the flash launches: the tuned tables and how a problem's config is chosen.

default_config gives a problem's (fwd, dK/dV, dQ) tiles: the tuned table first
(benchmarks/tune_flash.py), then heuristics by head dim and dtype.  The executor (dualattn/executor.py)
asks it last, after an override, its caches and autotuning; fit.py may then lower stages or tiles
where a variant would not fit the device's shared memory.  The Hopper kernels' fixed tiles live
with the rules that choose those kernels (hopper.py).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Dict, Optional, Tuple

from ... import switches
from ...validation import FlashShapes
from ..launch import next_pow2

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


# Tiles tuned by benchmarks/tune_flash.py (docs/lessons.md, "The tuned tiles"), keyed by
# "sm<arch>:d<head-dim bucket>:<causal|full>" -> (fwd, dkdv, dq) as (block_m, block_n, warps, stages).
TUNED: Dict[str, Tuple[Tuple[int, int, int, int], ...]] = {
    # Tuned at S=8192, bf16, on option-free problems (the loads software-pipelined).
    "sm90:d128:full": ((128, 128, 8, 3), (32, 64, 4, 4), (128, 64, 8, 3)),
    "sm90:d128:causal": ((128, 128, 8, 3), (64, 128, 8, 2), (128, 64, 8, 3)),
    "sm90:d64:full": ((64, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 3)),
    "sm90:d64:causal": ((64, 64, 4, 4), (64, 64, 4, 3), (128, 64, 4, 3)),
    # D=256 (and 192, padded to it), tuned at S=4096, bf16: the heuristic's 32-row backward tiles leave the
    # tensor cores idle.
    "sm90:d256:full": ((128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 3)),
    "sm90:d256:causal": ((128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 3)),
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


# A causal sliding window of at most SHORT_WINDOW_TILE_KEYS keys a row (GPT-OSS's 128-token layers): the
# portable forward on 64 x 64 tiles, whose query tile reads three key tiles of which two thirds are in the
# window, where a 128 x 128 tile reads two of which half are; it beats both the tuned 128 x 128 tile and the Gluon
# kernel there (docs/lessons.md, "Short windows run the portable kernels").  (At D=64 the tuned forward tile is
# 64 x 64 already.)
SHORT_WINDOW_TILE_KEYS = 128
SHORT_WINDOW_FWD_TILE = TileConfig(64, 64, 4, 3)
# The portable two-pass backward of short windows (hopper.short_window_backward): 32-row dK / dV and 32-key dQ
# steps, for windows of at most SHORT_WINDOW_BWD_TILE_KEYS keys by padded head dim: there they beat the tuned
# causal tiles and 64 x 64 ones, at D=64 only up to 128 keys (docs/lessons.md, "Short windows run the portable
# kernels").
SHORT_WINDOW_DKDV_TILE = TileConfig(32, 64, 4, 3)
SHORT_WINDOW_DQ_TILE = TileConfig(64, 32, 4, 3)
SHORT_WINDOW_BWD_TILE_KEYS = {64: 128, 128: 512}
# The portable forward with a bias or an attention mask at head dims above 128 on sm_90 (the Gluon forward takes
# them where its score tiles fit; this serves a float32 bias with a mask at D = 144-256, and launchers without
# Gluon): the tuned 128 x 64 tile spills kilobytes a thread beside the score tile, 64 x 32 on 4 warps far less
# (the heuristic tile where nothing is tuned, as on sm_80).  At D = 96 and 128 the plan's own tile (shrunk by fit
# to 64 x 128 / 8 warps) stays fastest (docs/lessons.md, "The tuned tiles").
SCORED_WIDE_FWD_TILE = TileConfig(64, 32, 4, 2)


def causal_window_keys(options) -> Optional[int]:
    """The keys a query row sees under a causal sliding window (window_left + 1); None without one."""
    return options.window_left + 1 if options.window_right == 0 and options.window_left is not None else None


def default_config(shapes: FlashShapes, *, interpret: bool, arch: int = 90, causal: bool = False,
                   window_keys: Optional[int] = None) -> FlashConfig:
    """Tiles per (platform, head dim, causal): the tuned table first, then heuristics.  `window_keys`:
    causal_window_keys of the call (short windows get the SHORT_WINDOW_* tiles)."""
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
    if (shapes.has_bias or shapes.has_mask) and d > 128 and shapes.dtype != "float32":
        fwd = SCORED_WIDE_FWD_TILE
    short = window_keys is not None and shapes.dtype != "float32"
    if short and d <= 128 and window_keys <= SHORT_WINDOW_TILE_KEYS:
        fwd = SHORT_WINDOW_FWD_TILE
    if short and window_keys <= SHORT_WINDOW_BWD_TILE_KEYS.get(d, 0):
        dkdv, dq = SHORT_WINDOW_DKDV_TILE, SHORT_WINDOW_DQ_TILE
    if shapes.seqlen_q <= 64 or shapes.seqlen_k <= 64:
        # Decode-like shapes: don't waste most of a 128-row tile.
        def small(t):
            return TileConfig(min(t.block_m, max(16, next_pow2(shapes.seqlen_q))),
                              min(t.block_n, max(16, next_pow2(shapes.seqlen_k))), min(t.num_warps, 4), t.num_stages)
        fwd, dkdv, dq = small(fwd), small(dkdv), small(dq)
    return FlashConfig(fwd, dkdv, dq)


