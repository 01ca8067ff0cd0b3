"""Native sparse attention: argument checks shared by the torch and JAX front ends (framework-free).

Works on anything with `.shape` and `.dtype`, so both frameworks raise the same ValueError /
TypeError, naming the argument and the expected shape, before any kernel runs.
"""
from __future__ import annotations

import functools
import numbers
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

from .kernels.nsa.plan import NsaShapes
from .validation import (FLOAT_DTYPES, INT_DTYPES, MAX_HEAD_DIM, MIN_HEAD_DIM, check_cu_seqlens_values, check_flag,
                         dtype_name)

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
                       total=t if varlen else 0,
                       rows_covered=varlen and cu_seqlens_values is not None and int(cu_seqlens_values[-1]) == t)
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
                 softmax_scale, cu_seqlens, cu_values, return_block_indices, deterministic) -> NativeArgs:
    """Checks of native_sparse_attention shared by the torch and JAX front ends (after their own type
    checks); cu_values: the cu_seqlens table's values where the host can read them, else None."""
    check_flag("deterministic", deterministic)
    b, t, hq, hkv, d, _, _ = check_qkv(query, key, value, cu_seqlens)
    check_gates(gates, b, t, hq)
    block_size = check_block_size(block_size)
    window_size = _check_int("window_size", window_size, 0)
    check_sliding_gate(gates["g_swa"], window_size)
    scale = default_scale(d, softmax_scale)
    if cu_values is not None:
        varlen_bounds(cu_values, t)
        # (The branches' outputs, concatenated per sequence, must cover every row of the gates.)
        if int(cu_values[-1]) != t:
            raise ValueError(f"cu_seqlens[-1] must be the {t} packed tokens for native_sparse_attention (every "
                             f"row in a sequence), got {int(cu_values[-1])}")
    need_selection = gates["g_slc"] is not None or return_block_indices
    count = _check_int("block_counts", block_counts, 1) if block_indices is None and need_selection else None
    if (gates["g_cmp"] is not None or count is not None) and block_size * hq > MAX_GRID_Y:
        raise ValueError(f"block_size * query heads must be at most {MAX_GRID_Y} for the compressed branch (its "
                         f"launch folds each block's tokens into the heads), got {block_size} * {hq}")
    return NativeArgs(b, t, hq, hkv, d, block_size, window_size, scale, need_selection, count)


def default_scale(head_dim: int, softmax_scale) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
    return float(softmax_scale)


# CUDA's limit on a grid's y axis, where the flash kernels' non-persistent grids hold batch * heads.
MAX_GRID_Y = 65535


def compressed_batch_rows(heads_q: int, block_size: int) -> int:
    """Batch rows per compressed-branch launch: its folded launch has block_size * Hq heads a row
    (compressed_launches), and batch * heads may not pass MAX_GRID_Y (B = 16 at block 64, Hq 64 would)."""
    return max(1, MAX_GRID_Y // (block_size * heads_q))


class CompressedLaunches(NamedTuple):
    """The compressed branch of one sequence of T tokens as flash attention launches (compressed_launches)."""

    blocks: int   # n = T // block_size pooled blocks
    body: int     # n * block_size: the tokens of the whole blocks, run phase-folded
    tail: int     # T - body tokens after the last whole block: they see every pooled block


def compressed_launches(seqlen: int, block_size: int) -> CompressedLaunches:
    """How the compressed branch runs on the dense flash kernels (both front ends).

    Token t = i * bs + r (block i, phase r) sees pooled block c iff (c + 1) * bs - 1 <= t, that is
    c <= i - 1 for r < bs - 1 and c <= i for the block's last token.  Causal in the block index,
    not in t, so the body's queries are folded: query (B, n * bs, Hq, D) is read as (B, n, bs * Hq, D)
    (a reshape of contiguous rows; head r * Hq + h is token i * bs + r of head h) against the pooled
    keys tiled bs times over the heads (bs * Hkv heads, kept in the same GQA order) and cut to the
    first n - 1 blocks.  Bottom-right causal with n queries and n - 1 keys is then exactly c <= i - 1:
    one dense launch of n * bs queries that the fast kernels take, row 0 fully masked (zeros).  The
    blocks' last tokens (c <= i) run as a second launch, the strided rows bs - 1, 2 * bs - 1, ..
    against all n blocks, and replace their rows of the first; the tail tokens a third,
    non-causal.  The folded launch's backward runs one dK / dV program per (key tile, folded KV
    head), bs * Hkv heads instead of Hkv, and the tiled keys' gradients are summed back (docs/lessons.md,
    "NSA's compressed branch: phases folded into the heads")."""
    n = seqlen // block_size
    return CompressedLaunches(n, n * block_size, seqlen - n * block_size)


class PackedCompressed(NamedTuple):
    """The compressed branch of packed sequences as compressed_launches' three launches, each one call for all
    the sequences (packed_compressed).  Rows count tokens from the first sequence's start; tables are int32
    (sequences + 1,)."""

    body_rows: Optional[np.ndarray]   # the tokens of every sequence's whole blocks, in order (None: all tokens)
    tail_rows: np.ndarray             # the tokens after each sequence's last whole block
    order: Optional[np.ndarray]       # each token's row in body_rows + tail_rows (None: no tails)
    last_rows: np.ndarray             # the last token of every whole block
    fold_keys: np.ndarray             # the folded launch's key rows: block p's pooled row p - 1 (p at a first block)
    fold_q_ids: np.ndarray            # (1, blocks) int32 segment ids of the folded queries: 2s + 1 in sequence s
    fold_kv_ids: np.ndarray           # (1, blocks) of its keys: 2s + 1, 2s at each sequence's first block
    cu_blocks: np.ndarray             # pooled blocks (and folded query rows, and last rows) per sequence
    cu_tail: np.ndarray               # tail_rows per sequence
    max_blocks: int
    max_prev: int                     # the most pooled blocks a folded query row sees
    max_tail: int


def packed_compressed(cu_seqlens_values: Sequence[int], block_size: int) -> PackedCompressed:
    """_packed_layout (below), memoised: every NSA layer of a step packs the same sequences."""
    return _packed_layout(tuple(int(c) for c in cu_seqlens_values), int(block_size))


@functools.lru_cache(maxsize=64)
def _packed_layout(cu_seqlens_values: Tuple[int, ...], block_size: int) -> PackedCompressed:
    """The gathers, varlen tables and segment ids that run the compressed branch of packed sequences (the
    table's values, starting at 0) as compressed_launches runs one sequence, with one launch each for all of
    them: the bodies' tokens (gathered where tails sit between them) pooled as one sequence of whole blocks;
    folded against the tiled pooled keys shifted one block, as one packed sequence with segment ids
    (causal, so folded query block p sees key rows up to p: its sequence's blocks before it, and at
    its sequence's first block a key row whose id no query holds); each block's last token against its
    sequence's pooled keys (causal); the tails against them (not causal).  As documents the folded launch
    is one dense row that the Gluon forward takes, where a varlen one (the queries' and keys' tables
    differ) would run the portable kernel, and with more sequences than a varlen grid holds, launches per
    group of sequences joined by a copy.  A launch per sequence would cost host time per sequence
    (docs/lessons.md, "NSA over packed sequences: one launch for all, as documents")."""
    cu = np.asarray([int(c) for c in cu_seqlens_values], np.int64)
    lengths = cu[1:] - cu[:-1]
    blocks = lengths // block_size
    body, tail = blocks * block_size, lengths - blocks * block_size
    prev = np.maximum(blocks - 1, 0)

    def table(counts):
        return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)

    def runs(starts, counts) -> np.ndarray:   # concatenated aranges [start, start + count)
        if counts.sum() == 0:
            return np.zeros(0, np.int64)
        return np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts) + np.arange(counts.sum())
    cu_blocks = table(blocks)
    body_rows = runs(cu[:-1], body)
    tail_rows = runs(cu[:-1] + body, tail)
    tails = tail.sum() > 0
    order = None
    if tails:
        order = np.empty(int(cu[-1] - cu[0]), np.int64)
        order[np.concatenate([body_rows, tail_rows]) - cu[0]] = np.arange(len(body_rows) + len(tail_rows))
    # block i of sequence s ends at token cu[s] + (i + 1) * block_size - 1
    last_rows = (np.repeat(cu[:-1], blocks) + (np.arange(blocks.sum()) - np.repeat(cu_blocks[:-1], blocks) + 1)
                 * block_size - 1)
    # Ids rise along the pack (tight segment ranges); a first block's key row holds its own block, masked by id.
    first = np.zeros(int(cu_blocks[-1]), bool)
    first[cu_blocks[:-1][blocks > 0]] = True
    q_ids = (2 * np.repeat(np.arange(len(blocks)), blocks) + 1).astype(np.int32)
    return PackedCompressed(
        body_rows=body_rows - cu[0] if tails else None, tail_rows=tail_rows - cu[0], order=order,
        last_rows=last_rows - cu[0], fold_keys=np.arange(len(first)) - ~first, fold_q_ids=q_ids[None],
        fold_kv_ids=(q_ids - first)[None].astype(np.int32), cu_blocks=cu_blocks, cu_tail=table(tail),
        max_blocks=int(blocks.max(initial=0)), max_prev=int(prev.max(initial=0)), max_tail=int(tail.max(initial=0)))


def packed_sequences_per_launch(heads_q: int) -> int:
    """Sequences per launch of the packed compressed branch: its varlen launches (the tails', and the blocks'
    last tokens' where they do not run as documents) hold sequences * Hq programs on a grid's y axis."""
    return max(1, MAX_GRID_Y // heads_q)


def sequence_groups(cu_seqlens_values: Sequence[int], heads_q: int) -> List[Tuple[int, int]]:
    """[(first, end)] sequence indices of the compressed branch's packed launches: at most
    packed_sequences_per_launch sequences each."""
    n = len(cu_seqlens_values) - 1
    rows = packed_sequences_per_launch(heads_q)
    return [(i, min(i + rows, n)) for i in range(0, n, rows)]


def compressed_parts(cu_seqlens_values: Optional[Sequence[int]], total: int,
                     heads_q: int) -> List[Tuple[int, int, Optional[List[int]]]]:
    """[(lo, hi, table)] token ranges of the compressed branch's calls: the whole axis (table None) without
    varlen or for one sequence; else groups of packed sequences (sequence_groups), each with its table
    counted from lo (packed_compressed)."""
    if cu_seqlens_values is None:
        return [(0, total, None)]
    cu = [int(c) for c in cu_seqlens_values]
    if len(cu) == 2:
        return [(cu[0], cu[1], None)]
    return [(cu[first], cu[end], [c - cu[first] for c in cu[first:end + 1]])
            for first, end in sequence_groups(cu, heads_q)]


def sequences(cu_seqlens_values: Optional[Sequence[int]], total: int) -> list:
    """[(start, end)] of the packed sequences, or the whole axis."""
    if cu_seqlens_values is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens_values]
    return list(zip(cu[:-1], cu[1:]))
