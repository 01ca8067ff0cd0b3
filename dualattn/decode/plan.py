"""Decode over a KV cache: argument checks, static options and the launch plans (framework-free).

`check_args` reads shapes and dtypes only (any array type, or stand-ins with .shape / .dtype) and
returns a `DecodeShapes`; `DecodeOptions` holds the canonical user options.  `plan_attend` and
`plan_append` turn both into `Launch` descriptions (dualattn/kernels/launch.py) that the torch and the
JAX launchers both run, so the two front ends compile the identical kernel variant.

Cache strides, lengths and page counts are constexprs: a decode step's shapes are fixed for a model,
and jax-triton gives integer arguments no divisibility hints (PLATFORM.md, pitfall 3), so constexpr
strides are what lets both launchers vectorise the row loads alike.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Optional, Tuple

import numpy as np

import dualattn.kernels as _kernels_package
from ..kernels import _interpret
from ..kernels.launch import Launch, Output, cdiv, next_pow2, plan_memo, row_major_strides
from ..validation import FLOAT_DTYPES, dtype_name

KERNELS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernels")


def _register_kernels() -> None:
    """Make decode/kernels/ a source folder of `dualattn.kernels` and of its interpreted copy, so a
    Launch names its kernel module ("decode_attend") as flash's are named, for both launchers."""
    if KERNELS_DIR not in _kernels_package.__path__:
        _kernels_package.__path__.append(KERNELS_DIR)
    interpreted = sys.modules[_interpret.kernel("launch", "Launch", interpret=True).__module__.rpartition(".")[0]]
    if KERNELS_DIR not in interpreted.__path__:
        interpreted.__path__.append(KERNELS_DIR)


_register_kernels()

MODULES = ("decode_attend", "decode_combine", "decode_append")
# The most splits one combine program merges (its BLOCK_S).
MAX_SPLITS = 128
# The fewest keys worth a split of their own: below this a split's fixed cost (its q load, its partial
# write, its share of the combine) outweighs the parallelism it adds.
MIN_SPLIT_KEYS = 256


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """The static options of one call, canonical: causal is window (left, 0); -1 is unbounded."""
    softmax_scale: float
    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    rotary_interleaved: bool = True
    num_splits: int = 0
    causal: bool = False

    def __post_init__(self):
        left, right = self.window
        if left < -1 or right < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1: unbounded), got {self.window}")
        if not self.softcap >= 0.0:
            raise ValueError(f"softcap must be >= 0 (0: off), got {self.softcap}")
        if self.num_splits < 0:
            raise ValueError(f"num_splits must be >= 0 (0: chosen by the plan), got {self.num_splits}")

    @classmethod
    def make(cls, d: int, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             rotary_interleaved=True, num_splits=0) -> "DecodeOptions":
        try:
            left, right = (int(w) for w in window_size)
        except (TypeError, ValueError):
            raise ValueError(f"window_size must be a pair (left, right) of ints, got {window_size!r}") from None
        if causal:
            right = 0
        scale = float(d ** -0.5 if softmax_scale is None else softmax_scale)
        return cls(softmax_scale=scale, window=(left, right), softcap=float(softcap or 0.0),
                   rotary_interleaved=bool(rotary_interleaved), num_splits=int(num_splits or 0),
                   causal=bool(causal))

    @property
    def local(self) -> bool:
        """Causal or windowed: queries are rotated at successive positions (flash-attn's rule)."""
        return self.causal or self.window != (-1, -1)


@dataclasses.dataclass(frozen=True)
class DecodeShapes:
    """Sizes and layout of one call as the kernels see them."""
    batch: int
    sq: int
    hq: int
    hkv: int
    d: int
    s_new: int               # rows appended (0: no k / v)
    capacity: int            # rows a sequence may hold: S_cache, or max_pages * page_size
    b_cache: int             # dense: cache batch; paged: 1
    paged: bool
    page_size: int
    num_pages: int
    k_strides: Tuple[int, int, int]   # element strides of the cache's first three dims
    v_strides: Tuple[int, int, int]
    stride_bt: int
    has_seqlens: bool
    has_batch_idx: bool
    has_leftpad: bool
    alibi: Optional[str]     # None, "head" (Hq,) or "batch" (B, Hq)
    num_sinks: int
    sinks_per_head: bool
    rotary_dim: int          # 0: no rotary
    seqlen_ro: int


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _want(name: str, x, shape: tuple) -> None:
    if _shape(x) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {_shape(x)}")


def _want_int32(name: str, x) -> None:
    if dtype_name(x) != "int32":
        raise TypeError(f"{name} must be int32, got {dtype_name(x)}")


def check_args(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
               cache_batch_idx=None, cache_leftpad=None, block_table=None, alibi_slopes=None, softmax_aux=None,
               k_strides=None, v_strides=None) -> DecodeShapes:
    """Shapes and dtypes of a call, or ValueError / TypeError naming the argument.  `cache_seqlens`
    may be a python int.  k_strides / v_strides: the caches' element strides (row-major if None)."""
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if len(_shape(x)) != 4:
            raise ValueError(f"{name} must be 4-D, got shape {_shape(x)}")
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype_name(x)}")
    batch, sq, hq, d = _shape(q)
    outer, rows, hkv, dk = _shape(k_cache)
    if sq < 1:
        raise ValueError(f"q must hold at least one query row, got shape {_shape(q)}")
    if dk != d:
        raise ValueError(f"k_cache head dim {dk} must equal q's {d}")
    _want("v_cache", v_cache, _shape(k_cache))
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if dtype_name(x) != dtype_name(q):
            raise TypeError(f"{name} dtype {dtype_name(x)} must equal q's {dtype_name(q)}")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of k_cache heads ({hkv})")
    if not 16 <= d <= 256:
        raise ValueError(f"head dim must be in 16..256, got {d}")
    paged = block_table is not None
    if paged:
        if len(_shape(block_table)) != 2 or _shape(block_table)[0] != batch:
            raise ValueError(f"block_table must have shape ({batch}, max_pages), got {_shape(block_table)}")
        _want_int32("block_table", block_table)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx cannot be combined with block_table (a paged cache is indexed "
                             "through the table)")
        capacity = _shape(block_table)[1] * rows
    else:
        capacity = rows
    s_new = 0
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together")
    if k is not None:
        s_new = _shape(k)[1] if len(_shape(k)) == 4 else -1
        _want("k", k, (batch, s_new, hkv, d))
        _want("v", v, (batch, s_new, hkv, d))
        for name, x in (("k", k), ("v", v)):
            if dtype_name(x) != dtype_name(k_cache):
                raise TypeError(f"{name} dtype {dtype_name(x)} must equal k_cache's {dtype_name(k_cache)}")
        if cache_seqlens is None:
            raise ValueError("cache_seqlens must be given with k and v (where the new rows go)")
        if s_new > capacity:
            raise ValueError(f"k holds {s_new} new rows, more than the cache's capacity {capacity}")
    if cache_seqlens is not None and not isinstance(cache_seqlens, (int, np.integer)):
        _want("cache_seqlens", cache_seqlens, (batch,))
        _want_int32("cache_seqlens", cache_seqlens)
    for name, x in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if x is not None:
            _want(name, x, (batch,))
            _want_int32(name, x)
    if cache_batch_idx is None and not paged and outer != batch:
        raise ValueError(f"k_cache batch {outer} must equal q's {batch} (or pass cache_batch_idx)")
    rotary_dim = seqlen_ro = 0
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        if k is None:
            raise ValueError("rotary_cos / rotary_sin need k and v (rotary applies to the new keys)")
        if len(_shape(rotary_cos)) != 2:
            raise ValueError(f"rotary_cos must be 2-D (seqlen_ro, rotary_dim / 2), got {_shape(rotary_cos)}")
        seqlen_ro, half = _shape(rotary_cos)
        _want("rotary_sin", rotary_sin, (seqlen_ro, half))
        rotary_dim = 2 * half
        if not (0 < rotary_dim <= d) or rotary_dim % 16:
            raise ValueError(f"rotary_dim (2 * rotary_cos.shape[1] = {rotary_dim}) must be a multiple of 16 "
                             f"in 16..{d}")
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if dtype_name(x) not in FLOAT_DTYPES:
                raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype_name(x)}")
    alibi = None
    if alibi_slopes is not None:
        if _shape(alibi_slopes) == (hq,):
            alibi = "head"
        elif _shape(alibi_slopes) == (batch, hq):
            alibi = "batch"
        else:
            raise ValueError(f"alibi_slopes must have shape ({hq},) or ({batch}, {hq}), got {_shape(alibi_slopes)}")
        if dtype_name(alibi_slopes) != "float32":
            raise TypeError(f"alibi_slopes must be float32, got {dtype_name(alibi_slopes)}")
    num_sinks, per_head = 0, False
    if softmax_aux is not None:
        ss = _shape(softmax_aux)
        if dtype_name(softmax_aux) not in FLOAT_DTYPES:
            raise TypeError(f"softmax_aux must be one of {FLOAT_DTYPES}, got {dtype_name(softmax_aux)}")
        if len(ss) == 2 and ss[0] == hq and ss[1] >= 1:
            num_sinks, per_head = ss[1], True
        elif len(ss) == 1 and ss[0] >= 1:
            per_head = ss[0] == hq
            num_sinks = 1 if per_head else ss[0]
        else:
            raise ValueError(f"softmax_aux must have shape ({hq}, n), ({hq},) or (n,), got {ss}")
    k_strides = tuple(k_strides or row_major_strides(_shape(k_cache)))
    v_strides = tuple(v_strides or row_major_strides(_shape(v_cache)))
    for name, st in (("k_cache", k_strides), ("v_cache", v_strides)):
        if st[3] != 1:
            raise ValueError(f"{name} must have a contiguous last dimension, got strides {st}")
    return DecodeShapes(
        batch=batch, sq=sq, hq=hq, hkv=hkv, d=d, s_new=s_new, capacity=capacity,
        b_cache=1 if paged else outer, paged=paged, page_size=rows if paged else capacity,
        num_pages=outer if paged else 1, k_strides=k_strides[:3], v_strides=v_strides[:3],
        stride_bt=_shape(block_table)[1] if paged else 0, has_seqlens=cache_seqlens is not None,
        has_batch_idx=cache_batch_idx is not None, has_leftpad=cache_leftpad is not None, alibi=alibi,
        num_sinks=num_sinks, sinks_per_head=per_head, rotary_dim=rotary_dim, seqlen_ro=seqlen_ro)


def check_values(shapes: DecodeShapes, cache_seqlens=None, block_table=None, cache_batch_idx=None,
                 cache_leftpad=None) -> None:
    """The checks of values the host holds (numpy arrays or ints; None: not on the host, so left to
    the kernels' clamps): ValueError naming the argument."""
    if cache_seqlens is not None:
        n = np.asarray(cache_seqlens).reshape(-1)
        if n.size and (n.min() < 0 or n.max() + shapes.s_new > shapes.capacity):
            bad = int(n.max()) if n.max() + shapes.s_new > shapes.capacity else int(n.min())
            raise ValueError(f"cache_seqlens + new rows ({bad} + {shapes.s_new}) must lie in [0, {shapes.capacity}], "
                             "the cache's capacity")
    if block_table is not None:
        t = np.asarray(block_table)
        if t.size and (t.min() < 0 or t.max() >= shapes.num_pages):
            raise ValueError(f"block_table entries must lie in [0, {shapes.num_pages}) (num_pages), got "
                             f"[{int(t.min())}, {int(t.max())}]")
    if cache_batch_idx is not None:
        t = np.asarray(cache_batch_idx)
        if t.size and (t.min() < 0 or t.max() >= shapes.b_cache):
            raise ValueError(f"cache_batch_idx entries must lie in [0, {shapes.b_cache}), got "
                             f"[{int(t.min())}, {int(t.max())}]")
    if cache_leftpad is not None:
        t = np.asarray(cache_leftpad)
        if t.size and t.min() < 0:
            raise ValueError(f"cache_leftpad entries must be >= 0, got {int(t.min())}")


@dataclasses.dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int


def choose_tiles(shapes: DecodeShapes, options: DecodeOptions, sms: int) -> Tiles:
    """Tiles and the split count from (B, Hkv, rows per program, capacity, page size, SMs).

    One program per (split, sequence, KV head, row block).  Decode streams the cache once, so what
    counts is enough programs in flight to keep HBM busy: about four per SM.  A sequence's keys are
    split until B * Hkv * row blocks * splits reaches that, never into chunks under MIN_SPLIT_KEYS.
    `sms` = 0 (the interpreter) plans as for a 4-SM device, so CPU tests split too."""
    rows = (shapes.hq // shapes.hkv) * shapes.sq
    block_m = min(64, max(16, next_pow2(rows)))
    interpret = sms == 0
    block_n = 64 if (interpret or shapes.d <= 128) else 32
    programs = shapes.batch * shapes.hkv * cdiv(rows, block_m)
    if options.num_splits > 0:
        splits = options.num_splits
    else:
        splits = cdiv(4 * (sms or 4), programs)
    splits = max(1, min(splits, MAX_SPLITS, cdiv(shapes.capacity, MIN_SPLIT_KEYS if sms else block_n)))
    return Tiles(block_m=block_m, block_n=block_n, num_splits=splits, num_warps=4, num_stages=1 if interpret else 3)


def _sinks_constexprs(shapes: DecodeShapes) -> tuple:
    return (("HAS_SINKS", shapes.num_sinks > 0), ("NUM_SINKS", max(shapes.num_sinks, 1)),
            ("SINKS_PER_HEAD", shapes.sinks_per_head), ("BLOCK_SINKS", next_pow2(max(shapes.num_sinks, 1))))


ATTEND_INPUTS = ("q", "k_cache", "v_cache", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                 "alibi_slopes", "softmax_aux")


@plan_memo
def plan_attend(shapes: DecodeShapes, options: DecodeOptions, sms: int) -> Launch:
    """The attention launch (and, with more than one split, the combine it hands its partials to).
    Results: out (B, Sq, Hq, D) like q, lse (B, Hq, Sq) fp32."""
    tiles = choose_tiles(shapes, options, sms)
    s = shapes
    splits = tiles.num_splits
    out = Output("out", (s.batch, s.sq, s.hq, s.d), "like:q")
    lse = Output("lse", (s.batch, s.hq, s.sq), "float32")
    if splits > 1:
        outputs = (Output("o_part", (splits, s.batch, s.sq, s.hq, s.d), "float32"),
                   Output("lse_part", (splits, s.batch, s.hq, s.sq), "float32"))
    else:
        outputs = (out, lse)
    rows = (s.hq // s.hkv) * s.sq
    constexprs = (
        ("BATCH", s.batch), ("SQ", s.sq), ("HQ", s.hq), ("HKV", s.hkv), ("D", s.d), ("BLOCK_D", max(16, next_pow2(s.d))),
        ("BLOCK_M", tiles.block_m), ("BLOCK_N", tiles.block_n), ("NUM_SPLITS", splits), ("S_NEW", s.s_new),
        ("CAPACITY", s.capacity), ("B_CACHE", s.b_cache), ("PAGED", s.paged), ("PAGE_SIZE", s.page_size),
        ("NUM_PAGES", s.num_pages),
        ("STRIDE_KB", s.k_strides[0]), ("STRIDE_KS", s.k_strides[1]), ("STRIDE_KH", s.k_strides[2]),
        ("STRIDE_VB", s.v_strides[0]), ("STRIDE_VS", s.v_strides[1]), ("STRIDE_VH", s.v_strides[2]),
        ("STRIDE_BT", s.stride_bt), ("ALIBI_STRIDE_B", s.hq if s.alibi == "batch" else 0),
        ("HAS_SEQLENS", s.has_seqlens), ("HAS_BATCH_IDX", s.has_batch_idx), ("HAS_LEFTPAD", s.has_leftpad),
        ("HAS_ALIBI", s.alibi is not None), ("SOFTCAP", options.softcap > 0),
        ("WINDOW_LEFT", options.window[0]), ("WINDOW_RIGHT", options.window[1]),
    ) + _sinks_constexprs(s)
    combine = None
    if splits > 1:
        combine = Launch(
            module="decode_combine", kernel="decode_combine", grid=(s.batch * s.sq * s.hq, 1, 1),
            inputs=("o_part", "lse_part", "softmax_aux"), scalars=(), outputs=(out, lse),
            constexprs=(("ROWS", s.batch * s.sq * s.hq), ("HQ", s.hq), ("SQ", s.sq), ("D", s.d),
                        ("NUM_SPLITS", splits), ("BLOCK_S", next_pow2(splits)), ("BLOCK_D", max(16, next_pow2(s.d))))
            + _sinks_constexprs(s),
            num_warps=1 if s.d <= 64 else 2, num_stages=1,
            resume=(("o_part", "o_part"), ("lse_part", "lse_part")))
    return Launch(
        module="decode_attend", kernel="decode_attend", grid=(splits, s.batch * s.hkv, cdiv(rows, tiles.block_m)),
        inputs=ATTEND_INPUTS, scalars=(("sm_scale", options.softmax_scale), ("softcap", options.softcap or 1.0)),
        outputs=outputs, constexprs=constexprs, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        then=combine)


APPEND_INPUTS = ("q", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "block_table")


@plan_memo
def plan_append(shapes: DecodeShapes, options: DecodeOptions, in_place: bool) -> Launch:
    """The append (and rotary) launch.  in_place: outputs k_out / v_out are the caches themselves (the
    caller passes them preallocated); else k_out is the compact rotated rows (B, S_new, Hkv, D).
    q_rot (like q) is written only with rotary."""
    s = shapes
    rotary = s.rotary_dim > 0
    if in_place:
        k_out = Output("k_out", (s.num_pages if s.paged else s.b_cache, s.page_size, s.hkv, s.d), "like:k")
        v_out = Output("v_out", k_out.shape, "like:v")
    else:
        k_out = Output("k_out", (s.batch, s.s_new, s.hkv, s.d), "like:k")
        v_out = Output("v_out", (1,), "like:v", placeholder=True)
    q_rot = Output("q_rot", (s.batch, s.sq, s.hq, s.d) if rotary else (1,), "like:q", placeholder=not rotary)
    constexprs = (
        ("SQ", s.sq), ("HQ", s.hq), ("HKV", s.hkv), ("D", s.d), ("BLOCK_D", max(16, next_pow2(s.d))),
        ("BLOCK_HQ", next_pow2(s.hq)), ("BLOCK_HKV", next_pow2(s.hkv)), ("S_NEW", s.s_new),
        ("CAPACITY", s.capacity), ("B_CACHE", s.b_cache), ("PAGED", s.paged), ("PAGE_SIZE", s.page_size),
        ("NUM_PAGES", s.num_pages),
        ("STRIDE_KB", s.k_strides[0]), ("STRIDE_KS", s.k_strides[1]), ("STRIDE_KH", s.k_strides[2]),
        ("STRIDE_VB", s.v_strides[0]), ("STRIDE_VS", s.v_strides[1]), ("STRIDE_VH", s.v_strides[2]),
        ("STRIDE_BT", s.stride_bt), ("HAS_BATCH_IDX", s.has_batch_idx), ("IN_PLACE", bool(in_place)),
        ("ROTARY", rotary), ("ROTARY_DIM", max(s.rotary_dim, 2)), ("INTERLEAVED", options.rotary_interleaved),
        ("SEQLEN_RO", max(s.seqlen_ro, 1)), ("Q_STEP", options.local),
    )
    rows = max(s.s_new, s.sq if rotary else 0)
    return Launch(module="decode_append", kernel="decode_append", grid=(s.batch, rows, 1), inputs=APPEND_INPUTS,
                  scalars=(), outputs=(q_rot, k_out, v_out), constexprs=constexprs,
                  num_warps=4 if s.hq * s.d >= 2048 else 1, num_stages=1)


def append_rows(shapes: DecodeShapes, cache_seqlens, block_table=None, cache_batch_idx=None, xp=np):
    """(outer, inner) cache indices, each (B, S_new), that the new rows go to, with the kernels' clamps
    (decode_rows.py); a dropped row (past the capacity, or a page entry out of range) gets outer =
    the cache's first dim, out of bounds, for a scatter that drops it.  `xp`: numpy or jax.numpy."""
    s = shapes
    n_outer = s.num_pages if s.paged else s.b_cache
    n = xp.clip(xp.asarray(cache_seqlens, dtype=xp.int32).reshape(-1) * xp.ones((s.batch,), xp.int32), 0,
                s.capacity)
    pos = n[:, None] + xp.arange(s.s_new, dtype=xp.int32)[None, :]                 # (B, S_new)
    keep = pos < s.capacity
    rows = xp.minimum(pos, s.capacity - 1)
    if s.paged:
        outer = xp.take_along_axis(xp.asarray(block_table), rows // s.page_size, axis=1)
        keep = keep & (outer >= 0) & (outer < s.num_pages)
        inner = rows % s.page_size
    else:
        if cache_batch_idx is None:
            batch = xp.arange(s.batch, dtype=xp.int32)
        else:
            batch = xp.clip(xp.asarray(cache_batch_idx), 0, s.b_cache - 1)
        outer = batch[:, None] * xp.ones_like(rows)
        inner = rows
    return xp.where(keep, outer, n_outer), inner
