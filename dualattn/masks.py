"""Block-map builders for block-sparse attention; combine with `|` (union) and `&` (intersection).

A builder is called as builder(batch, heads, seqlen_q, seqlen_k, block_q, block_k) and returns a
boolean block map (B or 1, H or 1, ceil(Sq/block_q), ceil(Sk/block_k)); a block is active if
any token pair inside it is allowed.  Token-level rules (causal, window, segments) are still
applied inside active blocks by the kernels, so builders only need to be conservative.
Positions follow flash_attention: query i sits at i + (Sk - Sq) (bottom-right alignment).
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .sparse import SparseMask, as_numpy, check_block_size


def _whole(name: str, value, minimum: int) -> int:
    """An int argument >= minimum (never a bool, a float or a string), named in the error."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class MaskBuilder:
    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name

    def __call__(self, batch, heads, seqlen_q, seqlen_k, block_q, block_k) -> np.ndarray:
        _whole("block_q", block_q, 1)
        _whole("block_k", block_k, 1)
        raw = self.fn(batch, heads, seqlen_q, seqlen_k, block_q, block_k)
        if raw is None or not 2 <= np.ndim(raw) <= 4:
            raise ValueError(f"mask_builder {self.name} must return a block map (B|1, H|1, n_q_blocks, n_k_blocks) "
                             f"(or its last 2 or 3 dims), got {type(raw).__name__} of shape {np.shape(raw)}")
        bm = np.asarray(raw, dtype=bool)
        while bm.ndim < 4:
            bm = bm[None]
        return bm

    def __or__(self, other):
        other = as_builder(other)
        return MaskBuilder(lambda *a: self(*a) | other(*a), f"({self.name} | {other.name})")

    def __and__(self, other):
        other = as_builder(other)
        return MaskBuilder(lambda *a: self(*a) & other(*a), f"({self.name} & {other.name})")

    def __repr__(self):
        return f"MaskBuilder({self.name})"


def as_builder(obj) -> MaskBuilder:
    if isinstance(obj, MaskBuilder):
        return obj
    if callable(obj):
        return MaskBuilder(obj, getattr(obj, "__name__", "callable"))
    raise TypeError(f"mask_builder must be a MaskBuilder or a callable returning a block map, got {type(obj)}")


def _band(seqlen_q, seqlen_k, block_q, block_k, left, right):
    """Blocks holding any pair with -left <= kpos - qpos <= right (None: unbounded)."""
    nq, nk = -(-seqlen_q // block_q), -(-seqlen_k // block_k)
    shift = seqlen_k - seqlen_q
    q_lo = np.arange(nq) * block_q + shift
    q_hi = np.minimum((np.arange(nq) + 1) * block_q, seqlen_q) - 1 + shift
    k_lo = np.arange(nk) * block_k
    k_hi = np.minimum((np.arange(nk) + 1) * block_k, seqlen_k) - 1
    ok = np.ones((nq, nk), dtype=bool)
    if right is not None:  # some pair with kpos <= qpos + right
        ok &= k_lo[None, :] <= q_hi[:, None] + right
    if left is not None:  # some pair with kpos >= qpos - left
        ok &= k_hi[None, :] >= q_lo[:, None] - left
    return ok


def causal() -> MaskBuilder:
    return MaskBuilder(lambda b, h, sq, sk, bq, bk: _band(sq, sk, bq, bk, None, 0), "causal")


def local(window) -> MaskBuilder:
    """Sliding window: int w -> (w, w) or (left, right), around the bottom-right diagonal."""
    if window is None or isinstance(window, (bool, str)) or np.ndim(window) not in (0, 1) or (
            np.ndim(window) == 1 and len(window) != 2):
        raise TypeError(f"local(window): window must be an int w or a (left, right) pair, got {window!r}")
    left, right = (window, window) if np.ndim(window) == 0 else window
    left = None if left is None else _whole("local(window): the left side", left, 0)
    right = None if right is None else _whole("local(window): the right side", right, 0)
    return MaskBuilder(lambda b, h, sq, sk, bq, bk: _band(sq, sk, bq, bk, left, right), f"local({window})")


def strided(stride: int) -> MaskBuilder:
    """Key block j is active for query block i when (i - j) % stride == 0 (block-level stride)."""
    stride = _whole("strided(stride): stride", stride, 1)

    def fn(b, h, sq, sk, bq, bk):
        nq, nk = -(-sq // bq), -(-sk // bk)
        return (np.arange(nq)[:, None] - np.arange(nk)[None, :]) % stride == 0
    return MaskBuilder(fn, f"strided({stride})")


def global_tokens(n: int) -> MaskBuilder:
    """The first n keys are seen by every query, and the first n queries see every key."""
    n = _whole("global_tokens(n): n", n, 0)

    def fn(b, h, sq, sk, bq, bk):
        nq, nk = -(-sq // bq), -(-sk // bk)
        ok = np.zeros((nq, nk), dtype=bool)
        ok[:, :-(-n // bk)] = n > 0
        ok[:-(-n // bq), :] = n > 0
        return ok
    return MaskBuilder(fn, f"global_tokens({n})")


def document(segment_ids) -> MaskBuilder:
    """Blocks where some query and key share a segment id; segment_ids (B, S) (self-attention)."""
    seg = as_numpy(segment_ids)
    if seg.ndim != 2:
        raise ValueError(f"segment_ids must be (batch, seq_len), got shape {seg.shape}")

    def fn(b, h, sq, sk, bq, bk):
        if seg.shape[1] != sq or sq != sk:
            raise ValueError(f"document(): segment_ids length {seg.shape[1]} must equal Sq = Sk ({sq}, {sk})")
        nq, nk = -(-sq // bq), -(-sk // bk)
        ids = np.unique(seg)
        # [B, n_ids, blocks]: which ids occur in each block
        qhas = np.zeros((seg.shape[0], ids.size, nq), dtype=bool)
        khas = np.zeros((seg.shape[0], ids.size, nk), dtype=bool)
        pos = np.searchsorted(ids, seg)
        for bi in range(seg.shape[0]):
            qhas[bi, pos[bi], np.arange(sq) // bq] = True
            khas[bi, pos[bi], np.arange(sk) // bk] = True
        return np.einsum("bip,biq->bpq", qhas, khas)[:, None]
    return MaskBuilder(fn, "document")


def resolve_layout(layout, mask_builder, *, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_q: int,
                   block_k: int) -> SparseMask:
    """The SparseMask of a blocksparse_attention call, from `layout` or `mask_builder`, checked."""
    if (layout is None) == (mask_builder is None):
        raise ValueError("blocksparse_attention needs exactly one of layout= (a SparseMask) or mask_builder=")
    if layout is None:
        check_block_size("block_q", block_q)
        check_block_size("block_k", block_k)
        block_map = as_builder(mask_builder)(batch, heads, seqlen_q, seqlen_k, block_q, block_k)
        layout = SparseMask.from_block_map(block_map, block_q, block_k)
    elif not isinstance(layout, SparseMask):
        raise TypeError(f"layout must be a dualattn.SparseMask (see SparseMask.from_block_map), got {type(layout)}")
    layout.check(batch, heads, seqlen_q, seqlen_k)
    return layout
