"""Native sparse attention: argument checks shared by the torch and JAX front ends (framework-free).

Works on anything with `.shape` and `.dtype`, so both frameworks raise the same ValueError /
TypeError, naming the argument and the expected shape, before any kernel runs.
"""
from __future__ import annotations

import functools
import numbers
from typing import NamedTuple, Optional, Sequence

from .kernels.nsa.plan import NsaShapes
from .sparse import SparseMask
from .validation import FLOAT_DTYPES, INT_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM, check_cu_seqlens_values, dtype_name

BLOCK_SIZES = (16, 32, 64, 128, 256)


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if int(value) < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def check_qkv(query, key, value, cu_seqlens=None) -> tuple:
    """(batch, seqlen, Hq, Hkv, D, Dv, dtype) of BSHD query (B, T, Hq, D), key (B, T, Hkv, D), value (B, T, Hkv, Dv)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {_shape(x)}")
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype_name(x)}")
    b, t, hq, d = _shape(query)
    bk, tk, hkv, dk = _shape(key)
    if dtype_name(key) != dtype_name(query) or dtype_name(value) != dtype_name(query):
        raise TypeError(f"query, key and value must share one dtype, got {dtype_name(query)}, {dtype_name(key)}, "
                        f"{dtype_name(value)}")
    if (bk, tk) != (b, t) or dk != d:
        raise ValueError(f"key must have shape ({b}, {t}, Hkv, {d}) like query {_shape(query)}, got {_shape(key)}")
    if _shape(value)[:3] != (b, t, hkv):
        raise ValueError(f"value must have shape ({b}, {t}, {hkv}, Dv) like key {_shape(key)}, got {_shape(value)}")
    dv = _shape(value)[3]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    for name, dim in (("query", d), ("value", dv)):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {dim}")
    if cu_seqlens is not None:
        if len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"cu_seqlens must be 1-D (n_seqs + 1,), got shape {_shape(cu_seqlens)}")
        if dtype_name(cu_seqlens) not in INT_DTYPES:
            raise TypeError(f"cu_seqlens must be an integer array, got {dtype_name(cu_seqlens)}")
        if b != 1:
            raise ValueError(f"with cu_seqlens the inputs are packed: batch must be 1, got query {_shape(query)}")
    return b, t, hq, hkv, d, dv, dtype_name(query)


def check_block_size(block_size) -> int:
    block_size = _check_int("block_size", block_size, 1)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    return block_size


def check_selection(block_indices, block_counts, batch: int, seqlen: int, heads_kv: int) -> Optional[int]:
    """block_indices int (B, T, Hkv, S); block_counts an int >= 0 or int (B, T, Hkv).  Returns the
    scalar count, or None when block_counts is an array."""
    if len(block_indices.shape) != 4 or _shape(block_indices)[:3] != (batch, seqlen, heads_kv):
        raise ValueError(f"block_indices must have shape ({batch}, {seqlen}, {heads_kv}, S), got "
                         f"{_shape(block_indices)}")
    if dtype_name(block_indices) not in INT_DTYPES:
        raise TypeError(f"block_indices must be an integer array, got {dtype_name(block_indices)}")
    if _shape(block_indices)[3] < 1:
        raise ValueError(f"block_indices needs at least one entry per token, got shape {_shape(block_indices)}")
    if hasattr(block_counts, "shape") and hasattr(block_counts, "dtype") and len(block_counts.shape) > 0:
        if _shape(block_counts) != (batch, seqlen, heads_kv):
            raise ValueError(f"block_counts must be an int or have shape ({batch}, {seqlen}, {heads_kv}), got "
                             f"{_shape(block_counts)}")
        if dtype_name(block_counts) not in INT_DTYPES:
            raise TypeError(f"block_counts must be an integer array, got {dtype_name(block_counts)}")
        return None
    return _check_int("block_counts", block_counts, 0)


def varlen_bounds(cu_seqlens: Optional[Sequence[int]], total: int) -> tuple:
    """(sequences, longest) of a concrete cu_seqlens table, checked; (0, 0) without one.  A table only
    known on the device (traced) is passed as None with `sequences`: the longest is then `total`."""
    if cu_seqlens is None:
        return 0, 0
    cu = [int(c) for c in cu_seqlens]
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    check_cu_seqlens_values(cu, cu, total, total, max(longest, 0), max(longest, 0))
    return len(cu) - 1, max(longest, 1)


def selected_shapes(query, key, value, block_indices, block_counts, block_size, cu_seqlens=None,
                    cu_seqlens_values: Optional[Sequence[int]] = None) -> tuple:
    """(NsaShapes, scalar count or None) of an apply_native_sparse_attention call, checked.
    `cu_seqlens_values`: the table's values when the front end can read them (else the longest
    sequence is taken to be all tokens: the kernels clamp to each sequence's real bounds)."""
    b, t, hq, hkv, d, dv, dtype = check_qkv(query, key, value, cu_seqlens)
    block_size = check_block_size(block_size)
    count = check_selection(block_indices, block_counts, b, t, hkv)
    varlen = cu_seqlens is not None
    sequences, seqlen = 0, t
    if varlen:
        if cu_seqlens_values is not None:
            sequences, seqlen = varlen_bounds(cu_seqlens_values, t)
        else:
            sequences = int(cu_seqlens.shape[0]) - 1
    shapes = NsaShapes(batch=b, seqlen=seqlen, heads_q=hq, heads_kv=hkv, head_dim=d, head_dim_v=dv,
                       num_slots=_shape(block_indices)[3], block_size=block_size, dtype=dtype,
                       per_token_counts=count is None, varlen=varlen, sequences=sequences,
                       total=t if varlen else 0)
    return shapes, count


def check_gates(gates: dict, batch: int, seqlen: int, heads_q: int) -> None:
    """Gates g_cmp, g_slc, g_swa: None or float (B, T, Hq); at least one given."""
    if all(g is None for g in gates.values()):
        raise ValueError("native_sparse_attention needs at least one of g_cmp, g_slc, g_swa")
    for name, g in gates.items():
        if g is None:
            continue
        if _shape(g) != (batch, seqlen, heads_q):
            raise ValueError(f"{name} must have shape ({batch}, {seqlen}, {heads_q}), got {_shape(g)}")
        if dtype_name(g) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype_name(g)}")


def check_sliding_gate(g_swa, window_size: int) -> None:
    """A sliding gate needs a window: with window_size 0 the branch (and its gate) would be left out."""
    if g_swa is not None and window_size == 0:
        raise ValueError("g_swa is given but window_size is 0: the sliding-window branch needs window_size > 0 "
                         "(or leave g_swa None)")


class NativeArgs(NamedTuple):
    """native_sparse_attention's checked arguments, as both front ends use them."""
    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    block_size: int
    window_size: int
    scale: float
    need_selection: bool         # the selected branch runs, or its indices are returned
    count: Optional[int]         # blocks to select per token where the indices are computed here


def check_native(query, key, value, *, gates: dict, block_indices, block_counts, block_size, window_size,
                 softmax_scale, cu_seqlens, cu_values, return_block_indices) -> NativeArgs:
    """Checks of native_sparse_attention shared by the torch and JAX front ends (after their own type
    checks); cu_values: the cu_seqlens table's values where the host can read them, else None."""
    b, t, hq, hkv, d, _, _ = check_qkv(query, key, value, cu_seqlens)
    check_gates(gates, b, t, hq)
    block_size = check_block_size(block_size)
    window_size = _check_int("window_size", window_size, 0)
    check_sliding_gate(gates["g_swa"], window_size)
    scale = default_scale(d, softmax_scale)
    if cu_values is not None:
        varlen_bounds(cu_values, t)
    need_selection = gates["g_slc"] is not None or return_block_indices
    count = _check_int("block_counts", block_counts, 1) if block_indices is None and need_selection else None
    return NativeArgs(b, t, hq, hkv, d, block_size, window_size, scale, need_selection, count)


def default_scale(head_dim: int, softmax_scale) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


# The compressed branch's queries are cut into pieces that become batch rows of their own
# (compressed_folds): enough flash dK / dV programs for the GPU, pieces of at least this many queries.
COMPRESSED_PROGRAMS = 512
FOLD_MIN_QUERIES = 512


def compressed_folds(batch: int, seqlen: int, heads_kv: int, num_cmp: int) -> int:
    """How many pieces the compressed branch cuts its queries into.  Its keys are only T / block_size
    pooled blocks and the flash backward runs one dK / dV program per (key tile, batch row, KV
    head): at T = 64k, Hkv = 4 that is 64 programs walking all 64k queries each, on a GPU of 132
    SMs.  Each piece becomes a batch row of its own (the pooled keys are copied per piece, and the
    copies' gradients add up), which multiplies the programs; pieces of at least FOLD_MIN_QUERIES
    queries keep those copies small.  At T = 8k, group 16 (H200, bf16, D = 128, Hkv = 4, block 64) the
    branch's fwd + bwd took 5.6 ms in pieces of 4096 (2 pieces: 16 dK / dV programs), 3.6 in pieces
    of 512; at group 4 it went from 3.2 to 3.6 ms; at 64k (8 pieces either way) 27 ms, and 25.4 in 32
    pieces (benchmarks/tune_nsa_select.py --folds, results/2026-11-27_h200_nsa_folds.json)."""
    key_tiles = -(-num_cmp // 64)
    want = -(-COMPRESSED_PROGRAMS // (key_tiles * batch * heads_kv))
    return max(1, min(want, seqlen // FOLD_MIN_QUERIES))


def compressed_blocks(folds: int, piece: int, block_size: int):
    """Block-map builder of the compressed branch: (query tile, pooled-key tile) pairs where some
    query sees some pooled block, query t seeing block c iff (c + 1) * block_size - 1 <= t (the key
    position of a pooled block is its last token); batch row r holds queries
    (r % folds) * piece + [0, piece).  Skips the half of the T x T / block_size rectangle that the
    causal rule masks."""
    def build(batch, heads, seqlen_q, seqlen_k, block_q, block_k):
        import numpy as np
        start = (np.arange(batch) % folds) * piece
        last_query = start[:, None] + np.minimum((np.arange(-(-seqlen_q // block_q)) + 1) * block_q, piece) - 1
        first_key = (np.arange(-(-seqlen_k // block_k)) * block_k + 1) * block_size - 1
        return (first_key[None, None, :] <= last_query[:, :, None])[:, None]
    return build


# The compressed branch's block-sparse tiles (blocksparse_attention's default block_q, block_k).
COMPRESSED_BLOCK = 64


@functools.lru_cache(maxsize=64)
def compressed_layout(batch: int, folds: int, piece: int, num_cmp: int, block_size: int) -> SparseMask:
    """The compressed branch's SparseMask (compressed_blocks' map over batch * folds rows of `piece`
    queries and num_cmp pooled keys), built once per shape.  Passing the builder instead rebuilt the
    map in numpy and uploaded its lists on every call: host time, and a copy from pageable host
    memory, which waits for the stream's earlier work, in every call.  The layout keeps its device
    copies (SparseMask.device_cache)."""
    block_map = compressed_blocks(folds, piece, block_size)(batch * folds, 1, piece, num_cmp, COMPRESSED_BLOCK,
                                                            COMPRESSED_BLOCK)
    return SparseMask.from_block_map(block_map, COMPRESSED_BLOCK, COMPRESSED_BLOCK)


def sequences(cu_seqlens_values: Optional[Sequence[int]], total: int) -> list:
    """[(start, end)] of the packed sequences, or the whole axis."""
    if cu_seqlens_values is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens_values]
    return list(zip(cu[:-1], cu[1:]))
