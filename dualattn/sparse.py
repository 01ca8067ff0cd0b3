"""SparseMask: a block-sparse attention layout, framework-neutral (numpy), built once, reused.

A boolean block map (B or 1, H or 1, n_q_blocks, n_k_blocks) plus the compressed lists the
kernels iterate:
    kv_counts (Lb, Lh, nq), kv_indices (Lb, Lh, nq, nk)  active key blocks per query block (fwd, dQ)
    q_counts  (Lb, Lh, nk), q_indices  (Lb, Lh, nk, nq)  active query blocks per key block (dK/dV)
    q_order   (Lb, Lh, nq), k_order    (Lb, Lh, nk)      programs' work order, busiest first
Lists are left-packed and ascending; the tail past the count is never read.  Scheduling the
busiest query blocks first (the seed's apply_load_balance) keeps a skewed layout from
leaving the GPU idle at the tail.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Dict

import numpy as np


def as_numpy(x) -> np.ndarray:
    """numpy view of a numpy / torch / jax array (host copy for device arrays)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def _pack(active: np.ndarray):
    """Left-packed ascending indices of True entries along the last axis, and their counts."""
    counts = active.sum(-1).astype(np.int32)
    n = active.shape[-1]
    # Stable sort of "inactive" keys puts active indices first, in ascending order.
    order = np.argsort(~active, axis=-1, kind="stable").astype(np.int32)
    idx = np.where(np.arange(n) < counts[..., None], order, 0).astype(np.int32)
    return counts, idx


def _runs(counts: np.ndarray, indices: np.ndarray) -> bool:
    n = indices.shape[-1]
    expected = indices[..., :1] + np.arange(n)
    return bool(np.all((indices == expected) | (np.arange(n) >= counts[..., None])))


def check_block_size(name: str, block) -> int:
    """A layout's tile size: a power of two >= 16 (what the kernels tile by), given as an int."""
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool):
        raise TypeError(f"{name} must be an int (a power of two >= 16), got {type(block).__name__} {block!r}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {block!r}")
    return int(block)


@dataclasses.dataclass(frozen=True, eq=False)
class SparseMask:
    block_map: np.ndarray
    block_q: int
    block_k: int
    kv_counts: np.ndarray
    kv_indices: np.ndarray
    q_counts: np.ndarray
    q_indices: np.ndarray
    q_order: np.ndarray
    k_order: np.ndarray
    # Per-framework device copies of the lists, made on first use and reused across calls.
    device_cache: Dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self):
        """Check lists given directly (not built by from_block_map): the kernels index K/V, the layout
        and their own programs with these values, so one out of range would read out of bounds."""
        bm = np.asarray(self.block_map)
        if bm.ndim != 4 or bm.dtype != np.bool_:
            raise ValueError(f"block_map must be a 4-D boolean array, got shape {bm.shape} and dtype {bm.dtype}")
        lb, lh, nq, nk = bm.shape
        check_block_size("block_q", self.block_q)
        check_block_size("block_k", self.block_k)
        for counts, indices, order, rows, cols, what in (
                ("kv_counts", "kv_indices", "q_order", nq, nk, "key blocks per query block"),
                ("q_counts", "q_indices", "k_order", nk, nq, "query blocks per key block")):
            c, i, o = (np.asarray(getattr(self, n)) for n in (counts, indices, order))
            for name, x, shape in ((counts, c, (lb, lh, rows)), (indices, i, (lb, lh, rows, cols)),
                                   (order, o, (lb, lh, rows))):
                if x.shape != shape or not np.issubdtype(x.dtype, np.integer):
                    raise ValueError(f"{name} must be an integer array of shape {shape} ({what}), got "
                                     f"{x.dtype}{x.shape}")
            if np.any((c < 0) | (c > cols)):
                raise ValueError(f"{counts} must lie in [0, {cols}], got values in [{c.min()}, {c.max()}]")
            used = np.arange(cols) < c[..., None]
            if np.any(used & ((i < 0) | (i >= cols))):
                bad = i[used & ((i < 0) | (i >= cols))]
                raise ValueError(f"{indices} holds block indices outside [0, {cols}) within the counts: {bad[:8]}")
            if np.any(np.sort(o, axis=-1) != np.arange(rows)):
                raise ValueError(f"{order} must be a permutation of range({rows}) along its last axis")

    @classmethod
    def from_block_map(cls, block_map, block_q: int, block_k: int) -> "SparseMask":
        check_block_size("block_q", block_q)
        check_block_size("block_k", block_k)
        bm = as_numpy(block_map)
        if bm.ndim != 4:
            raise ValueError(f"block_map must be 4-D (B or 1, H or 1, n_q_blocks, n_k_blocks), got shape {bm.shape}")
        if bm.dtype != np.bool_:
            if not np.issubdtype(bm.dtype, np.integer):
                raise TypeError(f"block_map must be boolean (or 0/1 integers), got {bm.dtype}")
            bm = bm != 0
        bm = np.array(bm, dtype=bool, order="C")  # a copy: later edits of the caller's map can't desync the lists
        kv_counts, kv_indices = _pack(bm)
        q_counts, q_indices = _pack(np.swapaxes(bm, -1, -2))
        q_order = np.argsort(-kv_counts, axis=-1, kind="stable").astype(np.int32)
        k_order = np.argsort(-q_counts, axis=-1, kind="stable").astype(np.int32)
        return cls(bm, int(block_q), int(block_k), kv_counts, kv_indices, q_counts, q_indices, q_order, k_order)

    # Cached: every call reads them (the plans key on them), and checking the lists took ~100 us of
    # host time per call at S = 16384 (1 x 1 x 128 x 128 blocks), against a ~300 us forward kernel.
    @functools.cached_property
    def kv_rows_contiguous(self) -> bool:
        """Every query block's active key blocks form one run (sliding windows, causal documents)."""
        return _runs(self.kv_counts, self.kv_indices)

    @functools.cached_property
    def q_rows_contiguous(self) -> bool:
        return _runs(self.q_counts, self.q_indices)

    def to_block_map(self) -> np.ndarray:
        return self.block_map.copy()

    @property
    def shape(self):
        return self.block_map.shape

    @property
    def density(self) -> float:
        return float(self.block_map.mean())

    def check(self, batch: int, heads: int, seqlen_q: int, seqlen_k: int) -> None:
        """Raise ValueError unless this layout fits a (batch, heads, Sq, Sk) problem."""
        lb, lh, nq, nk = self.block_map.shape
        want_q, want_k = -(-seqlen_q // self.block_q), -(-seqlen_k // self.block_k)
        if lb not in (1, batch) or lh not in (1, heads):
            raise ValueError(f"layout block map has shape {self.block_map.shape}: its batch/head dims must be "
                             f"1 or ({batch}, {heads})")
        if (nq, nk) != (want_q, want_k):
            raise ValueError(f"layout has {nq}x{nk} blocks but Sq={seqlen_q}, Sk={seqlen_k} with block_q="
                             f"{self.block_q}, block_k={self.block_k} need {want_q}x{want_k}")

    def arrays(self) -> Dict[str, np.ndarray]:
        """The kernel inputs, by the launch plans' names."""
        return {"sparse_kv_count": self.kv_counts, "sparse_kv_index": self.kv_indices,
                "sparse_q_order": self.q_order, "sparse_q_count": self.q_counts,
                "sparse_q_index": self.q_indices, "sparse_k_order": self.k_order}


def sparse_info(layout: SparseMask):
    from .kernels.flash.plan import SparseInfo
    lb, lh, nq, nk = layout.block_map.shape
    return SparseInfo(lb, lh, nq, nk, layout.block_q, layout.block_k, layout.kv_rows_contiguous,
                      layout.q_rows_contiguous)
