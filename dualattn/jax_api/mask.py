"""The jnp twin of the Triton kernels' mask and dropout rules (dualattn/kernels/flash/rules.py).

Shared by the XLA path and the Pallas path so that every JAX backend masks and drops
exactly the entries the Triton kernels do.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ..options import FlashOptions, dropout_threshold
from ..validation import segment_id_dtype

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

    r = mix(mix(seed ^ bh * 0x27D4EB2F) ^ i); h = (r ^ j) * M1; h ^= h >> 15; h *= M2;
    keep iff h >= options.dropout_threshold(p).  All integer arguments broadcast; `row`/`col` are
    local positions inside the sequence.
    """
    u32 = jnp.uint32
    r = _mix32(jnp.asarray(seed).astype(u32) ^ (jnp.asarray(batch_head).astype(u32) * u32(_HEAD_MUL)))
    r = _mix32(r ^ jnp.asarray(row).astype(u32))
    h = (r ^ jnp.asarray(col).astype(u32)) * u32(_LOWBIAS_M1)
    h = (h ^ (h >> 15)) * u32(_LOWBIAS_M2)
    return h >= u32(dropout_threshold(dropout_prob))


def sanitize_cu_seqlens(cu_seqlens, total: int):
    """cu_seqlens made non-decreasing and clipped to [0, total]: what traced tables (checked on no host)
    are run as, so sequences never overlap or leave the packed buffer.  Valid tables are unchanged."""
    return jnp.clip(lax.cummax(cu_seqlens.astype(jnp.int32), axis=0), 0, total)


def varlen_tokens(cu_seqlens, total: int, max_seqlen: int):
    """Per packed token: (sequence index, index inside it, whether it belongs to a sequence).

    The jnp twin of rules.sequence_bounds on a sanitized table: sequence b holds tokens
    [cu[b], cu[b] + min(cu[b+1] - cu[b], max_seqlen)); tokens outside every sequence (past cu[-1], or
    past max_seqlen in a longer sequence) belong to none and get output 0, lse -inf.
    """
    cu = sanitize_cu_seqlens(cu_seqlens, total)
    t = jnp.arange(total, dtype=jnp.int32)
    n = cu.shape[0] - 1
    seq = jnp.clip(jnp.searchsorted(cu[1:], t, side="right"), 0, n - 1).astype(jnp.int32)
    local = t - cu[seq]
    inside = (t >= cu[0]) & (t < cu[-1]) & (local < max_seqlen)
    return seq, local, inside


def varlen_lengths(cu_seqlens, total: int, max_seqlen: int):
    """Per sequence, its length as the kernels run it (sanitized, at most max_seqlen)."""
    cu = sanitize_cu_seqlens(cu_seqlens, total)
    return jnp.minimum(cu[1:] - cu[:-1], max_seqlen)


def segment_ids_as_kernel_dtype(q_segment_ids, kv_segment_ids):
    """Both id arrays as one dtype that keeps which ids are equal (validation.segment_id_dtype): int32,
    or int64 where 64-bit or uint32 ids need it.  Without jax_enable_x64 there are no 64-bit arrays:
    uint32 ids are then reinterpreted as int32 bit for bit (equality kept)."""
    q_segment_ids, kv_segment_ids = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
    want = segment_id_dtype(q_segment_ids.dtype, kv_segment_ids.dtype)
    if want == "int64" and not jax.config.jax_enable_x64:
        want = "int32"

    def convert(ids):
        if ids.dtype == jnp.dtype(want):
            return ids
        if jnp.issubdtype(ids.dtype, jnp.unsignedinteger) and ids.dtype.itemsize == jnp.dtype(want).itemsize:
            return lax.bitcast_convert_type(ids, jnp.dtype(want))
        return ids.astype(want)
    return convert(q_segment_ids), convert(kv_segment_ids)


def segment_ranks(q_segment_ids, kv_segment_ids):
    """int32 ids that are equal exactly where the given ids are (dense ranks over both arrays): for
    kernels that compare 32-bit ids only (Pallas on TPU), whatever the ids' width."""
    q, kv = jnp.asarray(q_segment_ids), jnp.asarray(kv_segment_ids)
    if q.dtype.itemsize <= 4 and kv.dtype.itemsize <= 4 and not (
            jnp.issubdtype(q.dtype, jnp.unsignedinteger) and q.dtype.itemsize == 4 or
            jnp.issubdtype(kv.dtype, jnp.unsignedinteger) and kv.dtype.itemsize == 4):
        return q.astype(jnp.int32), kv.astype(jnp.int32)
    both = jnp.concatenate([q.reshape(-1), kv.reshape(-1)])
    order = jnp.argsort(both)
    ordered = both[order]
    rank_sorted = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                              (ordered[1:] != ordered[:-1]).astype(jnp.int32)]))
    ranks = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return ranks[:q.size].reshape(q.shape), ranks[q.size:].reshape(kv.shape)


def exp_nonpositive(x):
    """exp(x) for an x that is <= 0 in exact arithmetic: scores minus their running max, or minus the
    row's lse.  XLA contracts `s * scale - m` into a fused multiply-add whose unrounded product can
    exceed the rounded max by half an ulp: e**(ulp / 2), inf for scores past ~1e9.  Clamping at 0
    keeps every probability <= 1 (the Triton kernels' interpreter path needs no clamp: no fusion)."""
    return jnp.exp(jnp.minimum(x, 0.0))


def sink_probability(sinks, lse):
    """exp(sink - lse) with the infinite cases decided first, as the Triton backward does: a -inf
    sink has probability 0 (also in a fully masked row, lse -inf); in a row whose lse is +inf the
    +inf sinks along the last axis (one head's sinks; length 1 for a single or combined sink) share
    it equally, 1 / their count each.  Broadcasts."""
    posinf = sinks == jnp.inf
    shares = jnp.maximum(jnp.sum(posinf, axis=-1, keepdims=True), 1)
    diff = jnp.where(sinks == -jnp.inf, -jnp.inf, jnp.where(sinks == lse, 0.0, sinks - lse))
    return jnp.where(posinf & (lse == jnp.inf), 1.0 / shares, jnp.exp(diff))


@jax.custom_jvp
def sink_logsumexp(sinks):
    """logsumexp over the last axis of the sinks, whose gradient (their softmax) stays finite for
    infinite sinks (sink_probability's rules; jax.nn.logsumexp's is NaN for a +inf entry)."""
    return jax.nn.logsumexp(sinks, axis=-1)


@sink_logsumexp.defjvp
def _sink_logsumexp_jvp(primals, tangents):
    (sinks,), (d_sinks,) = primals, tangents
    lse = sink_logsumexp(sinks)
    return lse, jnp.sum(sink_probability(sinks, lse[..., None]) * d_sinks, axis=-1)


def score_unit(options: FlashOptions, has_bias: bool) -> float:
    """The factor a forward applies after subtracting the running max: softmax_scale for plain scores
    (no bias, no soft cap), whose max is then taken over q.k itself, else 1.  exp((qk - max qk) * scale)
    has no multiply before its subtraction for XLA to fuse (exp_nonpositive), so the largest entry of a
    row is exactly exp(0) = 1 at any scale, as in the Triton kernels (which fold the scale the same way)."""
    return options.softmax_scale if options.logits_soft_cap is None and not has_bias else 1.0


def finish_rows(m, l, sink_lse=None):
    """(lse, 1 / denominator) of rows from their running max m (scaled, -inf: nothing seen) and sum l,
    sinks' log-sum-exp included.  The normaliser is a quotient, not exp(m - lse): at scores past ~1e8
    m + log(l) rounds back to m and the difference would lose l.  Fully masked rows (l = 0) give
    lse -inf (or the sinks') and normaliser 0; a +inf sink gives lse +inf and normaliser 0; a NaN
    sink gives lse and normaliser NaN, seen or not, as the softmax's own arithmetic does."""
    seen = l > 0
    m_ref = jnp.where(seen, m, 0.0)
    lse = jnp.where(seen, m_ref + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    denominator = l
    if sink_lse is not None:
        lse = jnp.logaddexp(lse, sink_lse)
        denominator = l + jnp.where(seen, sink_probability(sink_lse, m_ref), 0.0)
    return lse, jnp.where(seen, 1.0 / jnp.where(seen, denominator, 1.0), jnp.where(jnp.isnan(lse), jnp.nan, 0.0))
