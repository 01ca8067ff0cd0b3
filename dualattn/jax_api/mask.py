"""The jnp twin of the Triton kernels' mask and dropout rules (dualattn/kernels/flash/rules.py).

Shared by the XLA path and the Pallas path so that every JAX backend masks and drops
exactly the entries the Triton kernels do.
"""
from __future__ import annotations

import jax.numpy as jnp

from ..options import FlashOptions

_LOWBIAS_M1 = 0x7FEB352D
_LOWBIAS_M2 = 0x846CA68B
_HEAD_MUL = 0x27D4EB2F


def position_mask(q_pos, k_pos, opts: FlashOptions):
    """True where query position q_pos may attend key position k_pos (broadcasting).

    Positions are global: by default q_pos = i + (Sk - Sq), k_pos = j (bottom-right alignment).
    """
    d = k_pos - q_pos
    ok = jnp.ones(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), dtype=bool)
    if opts.window_left is not None:
        ok = ok & (d >= -opts.window_left)
    if opts.window_right is not None:
        ok = ok & (d <= opts.window_right)
    return ok


def _mix32(x):
    """lowbias32 integer finaliser on uint32 (wrapping arithmetic)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_LOWBIAS_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_LOWBIAS_M2)
    x = x ^ (x >> 16)
    return x


def dropout_keep(seed, batch_head, row, col, dropout_prob: float):
    """Keep-mask of dropout: a pure function of (seed, b * Hq + h, i, j), identical to the Triton kernels.

    hash = mix(mix(mix(seed ^ bh * 0x27D4EB2F) ^ i) ^ j); keep iff (hash >> 8) >= round(p * 2**24).
    All integer arguments broadcast; `row`/`col` are local positions inside the sequence.
    """
    u32 = jnp.uint32
    h = _mix32(jnp.asarray(seed).astype(u32) ^ (jnp.asarray(batch_head).astype(u32) * u32(_HEAD_MUL)))
    h = _mix32(h ^ jnp.asarray(row).astype(u32))
    h = _mix32(h ^ jnp.asarray(col).astype(u32))
    return (h >> 8) >= u32(dropout_threshold(dropout_prob))


def dropout_threshold(dropout_prob: float) -> int:
    """The 24-bit integer threshold shared with the Triton kernels."""
    return int(round(float(dropout_prob) * (1 << 24)))
