"""Pure-XLA flash attention: chunked online softmax with a custom_vjp, O(S) memory both ways.

No Sq x Sk score matrix is ever built.  The forward walks query blocks (outer loop) and key blocks
(inner loop) keeping the running max m, the running sum l and an fp32 accumulator per row; it saves
only (out, lse).  The backward (FA2 style, delta = rowsum(dO * O) - dlse) walks the same tiles, recomputes
P = exp(s - lse) per tile and accumulates dQ per query block and dK/dV/dbias into carried buffers.

Blocks that do not divide the sequence are handled without padding: the last block is shifted back to
end at S (`start = min(b * block, S - block)`), and the rows/columns it shares with the previous block
are masked out where they would be counted twice ("duplicate" rows/columns below):

        keys:  0 ............................. Sk-1
        block: [ kb=0  ][ kb=1  ][ kb=2  ]
                                   [ kb=3  ]      <- last block, shifted; its columns < 3*bk are dropped

Masks and dropout come from `dualattn.jax_api.mask` (the jnp twin of the Triton kernels' rules), so every
backend masks and drops exactly the same entries:

    may_attend(b, h, i, j) = position_mask(q_pos[b, i], k_pos[b, j])      window / causal on positions
                             & q_seg[b, i] == kv_seg[b, j]                 packed documents / varlen
                             & attention_mask[b, h, i, j] != 0
    default positions: q_pos = i + (Sk - Sq), k_pos = j (bottom-right aligned)

Key blocks entirely outside the window are skipped: with default key positions the loop runs only over
the key-block range the query block can see (causal: about half the tiles); with explicit key positions
or segment ids each tile is tested (min/max ranges) and skipped through `lax.cond`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...options import FlashOptions
from .._vma import vary_like
from ...validation import check_flash_args, dtype_name, INT_DTYPES
from ..mask import (dropout_keep, exp_nonpositive, finish_rows, position_mask, score_unit, segment_ids_as_kernel_dtype,
                    sink_logsumexp, sink_probability, varlen_lengths, varlen_tokens)

__all__ = ["XlaConfig", "XlaGrads", "flash_attention_xla", "flash_attention_backward_xla",
           "flash_attention_varlen_xla"]

_NEG_INF = float("-inf")
_SINK_LAYOUTS = ("none", "head", "head_n", "shared")


@dataclasses.dataclass(frozen=True)
class XlaConfig:
    """Everything static about one call: the one nondiff argument of the custom_vjp core.

    sink_layout: "none"; "head" softmax_aux (Hq,); "head_n" (Hq, n); "shared" (n,) for all heads.
    """

    options: FlashOptions
    block_q: int = 512
    block_k: int = 512
    precision: Any = None          # passed to every einsum (None, a lax.Precision, a string or a pair)
    logits_dtype: Any = np.dtype(np.float32)   # accumulation dtype of the q.k product
    sink_layout: str = "none"

    def __post_init__(self):
        for name in ("block_q", "block_k"):
            b = getattr(self, name)
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ValueError(f"{name} must be a positive int, got {b!r}")
        if self.sink_layout not in _SINK_LAYOUTS:
            raise ValueError(f"sink_layout must be one of {_SINK_LAYOUTS}, got {self.sink_layout!r}")


class _Aux(NamedTuple):
    """Non-differentiable arrays of one call (None where absent). Shapes use the core's batch B."""

    attention_mask: Optional[jax.Array] = None   # (B or 1, Hq or 1, Sq, Sk) bool / int
    q_segment_ids: Optional[jax.Array] = None    # (B, Sq) int32
    kv_segment_ids: Optional[jax.Array] = None   # (B, Sk) int32
    q_positions: Optional[jax.Array] = None      # (B, Sq) int32
    kv_positions: Optional[jax.Array] = None     # (B, Sk) int32
    dropout_seed: Optional[jax.Array] = None     # () uint32; None: no dropout
    dropout_batch: Optional[jax.Array] = None    # (B, Sq) int32 batch index of the hash (varlen: sequence)
    dropout_row: Optional[jax.Array] = None      # (B, Sq) int32 row index of the hash (varlen: local i)
    dropout_col: Optional[jax.Array] = None      # (B, Sk) int32 column index of the hash (varlen: local j)


@dataclasses.dataclass(frozen=True)
class _Dims:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    block_q: int
    block_k: int

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def num_q_blocks(self) -> int:
        return -(-self.seqlen_q // self.block_q)

    @property
    def num_k_blocks(self) -> int:
        return -(-self.seqlen_k // self.block_k)


def _dims(cfg: XlaConfig, q, k, v) -> _Dims:
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    return _Dims(b, sq, sk, hq, hkv, d, v.shape[-1], max(1, min(cfg.block_q, sq)), max(1, min(cfg.block_k, sk)))


def _block_start(index, block, length):
    """First row of block `index`; the last block is shifted back so that it ends at `length`."""
    return jnp.minimum(index * block, length - block)


def _rows(x, start, size, axis):
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _add_rows(buf, update, start, axis):
    """buf[start:start+size] += update along `axis` (a read-add-write XLA does in place)."""
    old = lax.dynamic_slice_in_dim(buf, start, update.shape[axis], axis=axis)
    return lax.dynamic_update_slice_in_dim(buf, old + update.astype(buf.dtype), start, axis=axis)


def _map_tile(x, dims: _Dims, q_start, k_start):
    """Tile of a (B or 1, Hq or 1, Sq, Sk) map as (B or 1, Hkv or 1, G or 1, bq, bk)."""
    bq, bk = dims.block_q, dims.block_k
    tile = lax.dynamic_slice(x, (0, 0, q_start, k_start), (x.shape[0], x.shape[1], bq, bk))
    if x.shape[1] == dims.heads_q:
        return tile.reshape(x.shape[0], dims.heads_kv, dims.group, bq, bk)
    return tile.reshape(x.shape[0], 1, 1, bq, bk)


def _reduce_to_map(x, map_shape, dims: _Dims):
    """(B, Hkv, G, bq, bk) -> (Bm, Hm, bq, bk), summing over the map's broadcast batch/head dims."""
    bm, hm = map_shape[0], map_shape[1]
    if hm != dims.heads_q:
        x = x.sum(axis=(1, 2), keepdims=True)
    if bm != dims.batch:
        x = x.sum(axis=0, keepdims=True)
    return x.reshape(bm, hm, x.shape[-2], x.shape[-1])


def _positions(aux: _Aux, dims: _Dims, q_start, k_start):
    """Query (B|1, bq) and key (B|1, bk) positions of one tile."""
    bq, bk = dims.block_q, dims.block_k
    if aux.q_positions is None:
        qp = (q_start + (dims.seqlen_k - dims.seqlen_q) + jnp.arange(bq, dtype=jnp.int32))[None]
    else:
        qp = _rows(aux.q_positions, q_start, bq, 1)
    if aux.kv_positions is None:
        kp = (k_start + jnp.arange(bk, dtype=jnp.int32))[None]
    else:
        kp = _rows(aux.kv_positions, k_start, bk, 1)
    return qp, kp


def _tile_logits(cfg: XlaConfig, dims: _Dims, aux: _Aux, bias, q_tile, k_tile, q_start, k_start,
                 q_first, k_first, *, mask_duplicate_rows: bool, unit: float = 1.0):
    """Logits of one tile and where they may attend.

    q_tile (B, bq, Hkv, G, D), k_tile (B, bk, Hkv, D).  q_first / k_first: first row / column that
    belongs to this block (earlier ones are duplicates of the previous block when it was shifted).
    Returns s (B, Hkv, G, bq, bk) float32 after scale, bias and soft cap (not yet masked), the mask
    (broadcastable to s) and tanh(s_pre_cap / cap) for the backward (None without soft cap).
    unit: a factor the caller applies itself (score_unit): s is then q.k * scale / unit.
    """
    opts = cfg.options
    bq, bk = dims.block_q, dims.block_k
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q_tile, k_tile, precision=cfg.precision,
                   preferred_element_type=cfg.logits_dtype).astype(jnp.float32)
    if unit != opts.softmax_scale:
        s = s * opts.softmax_scale                                       # [B, Hkv, G, bq, bk]
    if bias is not None:
        s = s + _map_tile(bias, dims, q_start, k_start).astype(jnp.float32)
    tanh = None
    if opts.logits_soft_cap is not None:
        tanh = jnp.tanh(s / opts.logits_soft_cap)
        s = opts.logits_soft_cap * tanh

    rows = q_start + jnp.arange(bq, dtype=jnp.int32)
    cols = k_start + jnp.arange(bk, dtype=jnp.int32)
    qp, kp = _positions(aux, dims, q_start, k_start)
    ok = position_mask(qp[:, :, None], kp[:, None, :], opts)            # [B|1, bq, bk]
    ok = ok & (cols >= k_first)[None, None, :]
    if mask_duplicate_rows:
        ok = ok & (rows >= q_first)[None, :, None]
    if aux.q_segment_ids is not None:
        qs = _rows(aux.q_segment_ids, q_start, bq, 1)
        ks = _rows(aux.kv_segment_ids, k_start, bk, 1)
        ok = ok & (qs[:, :, None] == ks[:, None, :])
    ok = ok[:, None, None]                                               # [B|1, 1, 1, bq, bk]
    if aux.attention_mask is not None:
        ok = ok & (_map_tile(aux.attention_mask, dims, q_start, k_start) != 0)
    return s, ok, tanh


def _tile_dropout(cfg: XlaConfig, dims: _Dims, aux: _Aux, q_start, k_start):
    """keep / (1 - p) of one tile, (B, Hkv, G, bq, bk) float32; None without dropout."""
    if aux.dropout_seed is None:
        return None
    bq, bk = dims.block_q, dims.block_k
    if aux.dropout_batch is None:
        batch = jnp.arange(dims.batch, dtype=jnp.int32)[:, None, None, None, None]
    else:
        batch = _rows(aux.dropout_batch, q_start, bq, 1)[:, None, None, :, None]
    head = (jnp.arange(dims.heads_kv, dtype=jnp.int32)[:, None] * dims.group
            + jnp.arange(dims.group, dtype=jnp.int32)[None, :])[None, :, :, None, None]
    if aux.dropout_row is None:
        row = (q_start + jnp.arange(bq, dtype=jnp.int32))[:, None]
    else:
        row = _rows(aux.dropout_row, q_start, bq, 1)[:, None, None, :, None]
    if aux.dropout_col is None:
        col = k_start + jnp.arange(bk, dtype=jnp.int32)
    else:
        col = _rows(aux.dropout_col, k_start, bk, 1)[:, None, None, None, :]
    p = cfg.options.dropout_prob
    keep = dropout_keep(aux.dropout_seed, batch * dims.heads_q + head, row, col, p)
    return jnp.where(keep, jnp.float32(1.0 / (1.0 - p)), jnp.float32(0.0))


def _tile_may_be_active(cfg: XlaConfig, dims: _Dims, aux: _Aux, q_start, k_start):
    """Cheap necessary condition for a tile to hold any allowed entry (min/max ranges), or None."""
    opts = cfg.options
    bq, bk = dims.block_q, dims.block_k
    active = None

    def both(a, b):
        return b if a is None else a & b

    if opts.has_window and aux.kv_positions is not None:
        qp, kp = _positions(aux, dims, q_start, k_start)
        if opts.window_left is not None:
            active = both(active, kp.max() - qp.min() >= -opts.window_left)
        if opts.window_right is not None:
            active = both(active, kp.min() - qp.max() <= opts.window_right)
    if aux.q_segment_ids is not None:
        qs = _rows(aux.q_segment_ids, q_start, bq, 1)
        ks = _rows(aux.kv_segment_ids, k_start, bk, 1)
        active = both(active, (qs.max() >= ks.min()) & (ks.max() >= qs.min()))
    return active


def _k_block_loop(cfg: XlaConfig, dims: _Dims, aux: _Aux, q_start, step, init):
    """fori_loop of `step(kb, k_start, carry)` over the key blocks a query block may see."""
    opts = cfg.options
    bq, bk, nk = dims.block_q, dims.block_k, dims.num_k_blocks
    if nk == 0:                                          # Sk == 0: every row is fully masked
        return init
    lo, hi = 0, nk
    if opts.has_window and aux.kv_positions is None:    # key positions are j: a contiguous range
        if aux.q_positions is None:
            q_min = q_start + (dims.seqlen_k - dims.seqlen_q)
            q_max = q_min + bq - 1
        else:
            qp = _rows(aux.q_positions, q_start, bq, 1)
            q_min, q_max = qp.min(), qp.max()
        if opts.window_left is not None:
            lo = jnp.clip((q_min - opts.window_left) // bk, 0, nk)
        if opts.window_right is not None:
            hi = jnp.clip((q_max + opts.window_right) // bk + 1, 0, nk)

    def body(kb, carry):
        k_start = _block_start(kb, bk, dims.seqlen_k)
        active = _tile_may_be_active(cfg, dims, aux, q_start, k_start)
        if active is None:
            return step(kb, k_start, carry)
        return lax.cond(active, lambda c: step(kb, k_start, c), lambda c: c, carry)

    return lax.fori_loop(lo, hi, body, init)


def _sink_matrix(cfg: XlaConfig, softmax_aux, heads_q):
    """softmax_aux as (Hq, n) float32."""
    s = softmax_aux.astype(jnp.float32)
    if cfg.sink_layout == "head":
        return s[:, None]
    if cfg.sink_layout == "shared":
        return jnp.broadcast_to(s[None, :], (heads_q, s.shape[0]))
    return s


def _sink_grad_to_layout(cfg: XlaConfig, d_sinks, softmax_aux):
    if cfg.sink_layout == "head":
        d_sinks = d_sinks[:, 0]
    elif cfg.sink_layout == "shared":
        d_sinks = d_sinks.sum(axis=0)
    return d_sinks.astype(softmax_aux.dtype)


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------
def _forward(cfg: XlaConfig, query, key, value, bias, softmax_aux, aux: _Aux):
    """Returns out (B, Sq, Hq, Dv) in the query dtype and lse (B, Hq, Sq) float32."""
    dims = _dims(cfg, query, key, value)
    B, Sq, Hkv, G, Dv = dims.batch, dims.seqlen_q, dims.heads_kv, dims.group, dims.head_dim_v
    bq, bk = dims.block_q, dims.block_k
    q5 = query.reshape(B, Sq, Hkv, G, dims.head_dim)                     # GQA without repeating K/V
    unit = score_unit(cfg.options, bias is not None)
    sink_lse = None
    if softmax_aux is not None:
        sink_lse = sink_logsumexp(_sink_matrix(cfg, softmax_aux, dims.heads_q))
        sink_lse = sink_lse.reshape(1, Hkv, G, 1)

    def q_step(qb, carry):
        out, lse = carry
        q_start = _block_start(qb, bq, Sq)
        q_tile = _rows(q5, q_start, bq, 1)                               # [B, bq, Hkv, G, D]

        def k_step(kb, k_start, state):
            m, l, acc = state                                            # m: the running max, in `unit`s
            s, ok, _ = _tile_logits(cfg, dims, aux, bias, q_tile, _rows(key, k_start, bk, 1),
                                    q_start, k_start, q_start, kb * bk, mask_duplicate_rows=False, unit=unit)
            s = jnp.where(ok, s, _NEG_INF)
            m_new = jnp.maximum(m, s.max(axis=-1))                       # [B, Hkv, G, bq]
            m_ref = jnp.where(m_new == _NEG_INF, 0.0, m_new)             # no (-inf) - (-inf)
            p = exp_nonpositive((s - m_ref[..., None]) * unit)
            alpha = jnp.exp((m - m_ref) * unit)
            l = alpha * l + p.sum(axis=-1)
            drop = _tile_dropout(cfg, dims, aux, q_start, k_start)
            if drop is not None:
                p = p * drop
            v_tile = _rows(value, k_start, bk, 1)
            pv = jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(value.dtype), v_tile, precision=cfg.precision,
                            preferred_element_type=jnp.float32)
            return m_new, l, alpha[..., None] * acc + pv

        init = vary_like((jnp.full((B, Hkv, G, bq), _NEG_INF, jnp.float32), jnp.zeros((B, Hkv, G, bq), jnp.float32),
                          jnp.zeros((B, Hkv, G, bq, Dv), jnp.float32)), query, key, value)
        m, l, acc = _k_block_loop(cfg, dims, aux, q_start, k_step, init)
        lse_tile, norm = finish_rows(m * unit, l, sink_lse)
        o = (acc * norm[..., None]).astype(query.dtype)                  # [B, Hkv, G, bq, Dv]
        out = lax.dynamic_update_slice_in_dim(out, o.transpose(0, 3, 1, 2, 4), q_start, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_tile, q_start, axis=3)
        return out, lse

    init = vary_like((jnp.zeros((B, Sq, Hkv, G, Dv), query.dtype), jnp.zeros((B, Hkv, G, Sq), jnp.float32)),
                     query, key, value)
    # No rows (B or Sq of 0): nothing to loop over, and the tiles' id and position ranges
    # (_tile_may_be_active) would reduce empty arrays.
    out, lse = lax.fori_loop(0, dims.num_q_blocks, q_step, init) if B and Sq else init
    return out.reshape(B, Sq, dims.heads_q, Dv), lse.reshape(B, dims.heads_q, Sq)


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------
def _backward(cfg: XlaConfig, query, key, value, bias, softmax_aux, aux: _Aux, out, lse, dout, dlse):
    """Returns dquery, dkey, dvalue, dbias (None without bias), dsoftmax_aux (None without sinks)."""
    dims = _dims(cfg, query, key, value)
    B, Sq, Sk, Hq, Hkv, G = (dims.batch, dims.seqlen_q, dims.seqlen_k, dims.heads_q, dims.heads_kv,
                             dims.group)
    D, Dv, bq, bk = dims.head_dim, dims.head_dim_v, dims.block_q, dims.block_k
    scale = cfg.options.softmax_scale

    # dS = P * (dP - delta), delta = rowsum(dO * O) - dlse: the dlse term makes the lse output differentiable.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)                             # [B, Hq, Sq]
    # Fully masked rows (lse -inf): P = 0 anyway; a +inf sink's rows (lse +inf) keep it: P = exp(s - inf) = 0.
    lse_ref = jnp.where(lse == -jnp.inf, 0.0, lse)

    q5 = query.reshape(B, Sq, Hkv, G, D)
    do5 = dout.reshape(B, Sq, Hkv, G, Dv)
    lse4 = lse_ref.reshape(B, Hkv, G, Sq)
    delta4 = delta.reshape(B, Hkv, G, Sq)

    def q_step(qb, carry):
        dq, dk, dv, dbias = carry
        q_start = _block_start(qb, bq, Sq)
        q_tile = _rows(q5, q_start, bq, 1)                               # [B, bq, Hkv, G, D]
        do_tile = _rows(do5, q_start, bq, 1)                             # [B, bq, Hkv, G, Dv]
        lse_tile = _rows(lse4, q_start, bq, 3)[..., None]                # [B, Hkv, G, bq, 1]
        delta_tile = _rows(delta4, q_start, bq, 3)[..., None]

        def k_step(kb, k_start, state):
            dq_tile, dk, dv, dbias = state
            k_tile = _rows(key, k_start, bk, 1)
            v_tile = _rows(value, k_start, bk, 1)
            s, ok, tanh = _tile_logits(cfg, dims, aux, bias, q_tile, k_tile, q_start, k_start,
                                       qb * bq, kb * bk, mask_duplicate_rows=True)
            p = jnp.where(ok, exp_nonpositive(s - lse_tile), 0.0)        # [B, Hkv, G, bq, bk]
            dp = jnp.einsum("bqhgd,bkhd->bhgqk", do_tile, v_tile, precision=cfg.precision,
                            preferred_element_type=jnp.float32)
            drop = _tile_dropout(cfg, dims, aux, q_start, k_start)
            p_out = p if drop is None else p * drop
            if drop is not None:
                dp = dp * drop
            dv_tile = jnp.einsum("bhgqk,bqhgd->bkhd", p_out.astype(dout.dtype), do_tile,
                                 precision=cfg.precision, preferred_element_type=jnp.float32)
            ds = p * (dp - delta_tile)
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            if dbias is not None:
                dbias = lax.dynamic_update_slice(
                    dbias, lax.dynamic_slice(dbias, (0, 0, q_start, k_start), (*dbias.shape[:2], bq, bk))
                    + _reduce_to_map(ds, dbias.shape, dims).astype(dbias.dtype), (0, 0, q_start, k_start))
            ds = ds * scale
            dq_tile = dq_tile + jnp.einsum("bhgqk,bkhd->bqhgd", ds.astype(key.dtype), k_tile,
                                           precision=cfg.precision, preferred_element_type=jnp.float32)
            dk_tile = jnp.einsum("bhgqk,bqhgd->bkhd", ds.astype(query.dtype), q_tile,
                                 precision=cfg.precision, preferred_element_type=jnp.float32)
            return dq_tile, _add_rows(dk, dk_tile, k_start, 1), _add_rows(dv, dv_tile, k_start, 1), dbias

        init = vary_like((jnp.zeros((B, bq, Hkv, G, D), jnp.float32), dk, dv, dbias), query, key, value)
        dq_tile, dk, dv, dbias = _k_block_loop(cfg, dims, aux, q_start, k_step, init)
        return _add_rows(dq, dq_tile, q_start, 1), dk, dv, dbias

    init = vary_like((jnp.zeros((B, Sq, Hkv, G, D), jnp.float32), jnp.zeros((B, Sk, Hkv, D), jnp.float32),
                      jnp.zeros((B, Sk, Hkv, Dv), jnp.float32), None if bias is None else jnp.zeros_like(bias)),
                     query, key, value)
    dq, dk, dv, dbias = lax.fori_loop(0, dims.num_q_blocks, q_step, init) if B and Sq else init   # as _forward

    d_sinks = None
    if softmax_aux is not None:
        # d lse / d sink = p_sink = exp(sink - lse); out depends on the sinks only through lse.
        sinks = _sink_matrix(cfg, softmax_aux, Hq)                       # [Hq, n]
        p_sink = sink_probability(sinks[None, :, None, :], lse[..., None])   # [B, Hq, Sq, n]
        d_sinks = _sink_grad_to_layout(cfg, -jnp.einsum("bhqn,bhq->hn", p_sink, delta), softmax_aux)
    return (dq.reshape(B, Sq, Hq, D).astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype),
            dbias, d_sinks)


# --------------------------------------------------------------------------------------------------
# custom_vjp core: one static argument (cfg), primal and forward rule share `_forward`
# --------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_core(cfg: XlaConfig, query, key, value, bias, softmax_aux, aux: _Aux):
    return _forward(cfg, query, key, value, bias, softmax_aux, aux)


def _flash_core_fwd(cfg, query, key, value, bias, softmax_aux, aux):
    out, lse = _forward(cfg, query, key, value, bias, softmax_aux, aux)
    return (out, lse), (query, key, value, bias, softmax_aux, aux, out, lse)


def _flash_core_bwd(cfg, residuals, cotangents):
    query, key, value, bias, softmax_aux, aux, out, lse = residuals
    dout, dlse = cotangents
    grads = _backward(cfg, query, key, value, bias, softmax_aux, aux, out, lse, dout, dlse)
    return (*grads, None)                                                # no cotangents for masks/ids/seed


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)
_flash_core_jit = jax.jit(_flash_core, static_argnums=0)


# --------------------------------------------------------------------------------------------------
# entry points
# --------------------------------------------------------------------------------------------------
def _hashable_precision(precision):
    if isinstance(precision, list):
        return tuple(precision)
    return precision


_AUTO_TILE_ELEMENTS = 1 << 24   # auto blocks: about 64 MiB per float32 (B, Hq, bq, bk) tile array


def _resolve_block(block, batch_heads: int) -> int:
    """None -> the largest power of two in [128, 1024] whose square tile over all heads fits the budget.

    Measured on an H100 (bf16, B*H = 16, S = 16k): 1024 blocks run 2x faster than 512 and 4x faster than
    256 (each tile's kernels are memory-bound on the fp32 logits; fewer, larger tiles amortise launches).
    """
    if block is not None:
        return block
    side = math.isqrt(max(1, _AUTO_TILE_ELEMENTS // max(1, batch_heads)))
    return min(1024, max(128, 1 << (side.bit_length() - 1)))


def _sink_layout(softmax_aux, heads_q) -> str:
    if softmax_aux is None:
        return "none"
    if softmax_aux.ndim == 2:
        return "head_n"
    return "head" if softmax_aux.shape[0] == heads_q else "shared"


def _seed_u32(dropout_seed, options: FlashOptions):
    if options.dropout_prob == 0.0:
        return None
    if dropout_seed is None:
        raise ValueError("dropout_seed is required when dropout_prob > 0 (an int or a uint32/int32 scalar "
                         "array); a fixed default would drop the same entries on every call")
    if isinstance(dropout_seed, (int, np.integer)) and not isinstance(dropout_seed, bool):
        return jnp.asarray(np.uint32(int(dropout_seed) & 0xFFFFFFFF))
    seed = jnp.asarray(dropout_seed)
    if dtype_name(seed) not in INT_DTYPES:
        raise TypeError(f"dropout_seed must be an int or an integer scalar array, got {dtype_name(seed)}")
    if seed.shape != ():
        raise ValueError(f"dropout_seed must be a scalar (shape ()), got shape {tuple(seed.shape)}")
    return seed.astype(jnp.uint32)


def _int_rows(name, x, batch, length):
    """(B, S), (1, S) or (S,) integer array -> (B, S), int32 unless its values need 64 bits."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if dtype_name(x) not in INT_DTYPES:
        raise TypeError(f"{name} must be an integer array, got {dtype_name(x)}")
    if x.ndim not in (1, 2) or x.shape[-1] != length or (x.ndim == 2 and x.shape[0] not in (1, batch)):
        raise ValueError(f"{name} must have shape ({batch}, {length}), got {tuple(x.shape)}")
    x = jnp.broadcast_to(x.reshape(x.shape[0] if x.ndim == 2 else 1, length), (batch, length))   # no -1: S may be 0
    return x if x.dtype.itemsize == 8 else x.astype(jnp.int32)


def _prepare(query, key, value, options, bias, attention_mask, q_segment_ids, kv_segment_ids, q_positions,
             kv_positions, softmax_aux, dropout_seed, block_q, block_k, precision, logits_dtype):
    """Validate one dense call and split it into its static config and its non-differentiable arrays."""
    shapes = check_flash_args(query, key, value, bias=bias, attention_mask=attention_mask,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              softmax_aux=softmax_aux)
    B, Sq, Sk = shapes.batch, shapes.seqlen_q, shapes.seqlen_k
    if q_segment_ids is None:
        q_segment_ids = kv_segment_ids
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    if q_segment_ids is not None:
        q_segment_ids, kv_segment_ids = segment_ids_as_kernel_dtype(q_segment_ids, kv_segment_ids)
    aux = _Aux(attention_mask=attention_mask,
               q_segment_ids=_int_rows("q_segment_ids", q_segment_ids, B, Sq),
               kv_segment_ids=_int_rows("kv_segment_ids", kv_segment_ids, B, Sk),
               q_positions=_int_rows("q_positions", q_positions, B, Sq),
               kv_positions=_int_rows("kv_positions", kv_positions, B, Sk),
               dropout_seed=_seed_u32(dropout_seed, options))
    bh = B * shapes.heads_q
    cfg = XlaConfig(options=options, block_q=_resolve_block(block_q, bh), block_k=_resolve_block(block_k, bh),
                    precision=_hashable_precision(precision), logits_dtype=np.dtype(logits_dtype),
                    sink_layout=_sink_layout(softmax_aux, shapes.heads_q))
    return cfg, aux


def flash_attention_xla(query, key, value, *, options: FlashOptions, bias=None, attention_mask=None,
                        q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                        softmax_aux=None, dropout_seed=None, return_lse=False, block_q=512, block_k=512,
                        precision=None, logits_dtype=jnp.float32):
    """Flash attention in pure JAX/XLA (chunked online softmax), BSHD, O(S) memory forward and backward.

    Args:
      query: (B, Sq, Hq, D); key: (B, Sk, Hkv, D); value: (B, Sk, Hkv, Dv); Hq % Hkv == 0 (GQA/MQA).
      options: canonical static options (scale, window/causal, soft cap, dropout probability).
      bias: additive float (B or 1, Hq or 1, Sq, Sk), added after scaling and before the soft cap.
      attention_mask: bool/int (B or 1, Hq or 1, Sq, Sk), nonzero = may attend.
      q_segment_ids, kv_segment_ids: int (B, Sq) / (B, Sk); attend only where equal (one given: both).
      q_positions, kv_positions: int (B, Sq) / (B, Sk) (or (Sq,) / (Sk,)) positions for the window and
        causal rules; default i + (Sk - Sq) and j (bottom-right aligned).  Ring attention passes global
        positions here.
      softmax_aux: sinks, (Hq, n), (Hq,) or (n,) shared: extra logits in every row's denominator.
      dropout_seed: int or integer scalar array (traceable); required when options.dropout_prob > 0.
      return_lse: also return the float32 log-sum-exp (B, Hq, Sq), natural log, sinks included.
      block_q, block_k: tile sizes (clipped to the sequence lengths; need not divide them).  None picks
        them from B * Hq (a power of two in [128, 1024], about 64 MiB per fp32 tile array).
      precision: einsum precision; logits_dtype: accumulation dtype of q.k (float32 by default).

    Returns:
      out (B, Sq, Hq, Dv) in the query dtype, or (out, lse).  Differentiable w.r.t. query, key, value,
      bias and softmax_aux (and through lse); fully masked rows give 0, lse -inf, zero gradients.
    """
    cfg, aux = _prepare(query, key, value, options, bias, attention_mask, q_segment_ids, kv_segment_ids,
                        q_positions, kv_positions, softmax_aux, dropout_seed, block_q, block_k, precision,
                        logits_dtype)
    out, lse = _flash_core_jit(cfg, query, key, value, bias, softmax_aux, aux)
    return (out, lse) if return_lse else out


class XlaGrads(NamedTuple):
    dquery: jax.Array
    dkey: jax.Array
    dvalue: jax.Array
    dbias: Optional[jax.Array]          # None without bias; the bias' shape (broadcast dims summed)
    dsoftmax_aux: Optional[jax.Array]   # None without sinks; the sinks' shape


_backward_jit = jax.jit(_backward, static_argnums=0)


def flash_attention_backward_xla(query, key, value, out, lse, dout, *, options: FlashOptions, dlse=None,
                                 bias=None, attention_mask=None, q_segment_ids=None, kv_segment_ids=None,
                                 q_positions=None, kv_positions=None, softmax_aux=None, dropout_seed=None,
                                 block_q=512, block_k=512, precision=None, logits_dtype=jnp.float32) -> XlaGrads:
    """The backward pass alone, from given (out, lse): for callers that merge partial results.

    Ring attention runs `flash_attention_xla(..., return_lse=True)` per (query shard, key shard), merges
    the partial outputs by their lse, then calls this per shard pair with the *merged* out and lse
    (P = exp(s - lse), delta = rowsum(dout * out) - dlse).  With the call's own out and lse it returns
    exactly the custom_vjp gradients.  Arguments as in `flash_attention_xla`; dlse (B, Hq, Sq) optional.
    """
    cfg, aux = _prepare(query, key, value, options, bias, attention_mask, q_segment_ids, kv_segment_ids,
                        q_positions, kv_positions, softmax_aux, dropout_seed, block_q, block_k, precision,
                        logits_dtype)
    if dlse is None:
        dlse = jnp.zeros(lse.shape, jnp.float32)
    return XlaGrads(*_backward_jit(cfg, query, key, value, bias, softmax_aux, aux, out, lse, dout, dlse))


def flash_attention_varlen_xla(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               options: FlashOptions, softmax_aux=None, dropout_seed=None, return_lse=False,
                               block_q=512, block_k=512, precision=None, logits_dtype=jnp.float32):
    """Varlen (packed) flash attention in pure XLA, as `flash_attn_varlen_func`.

    query (total_q, Hq, D), key/value (total_k, Hkv, D/Dv), int32 cu_seqlens (n_seqs + 1,).  Runs as one
    batch of length total with segment ids = sequence index and per-sequence positions (bottom-right
    aligned per sequence: q_pos = i_local + len_k - len_q, k_pos = j_local); dropout hashes (sequence
    index, head, i_local, j_local).  Sequences are what the Triton kernels run (mask.varlen_tokens): a
    table is made non-decreasing and clipped to the packed tokens, each sequence cut at max_seqlen; tokens
    outside every sequence are fully masked (output 0, lse -inf).
    The other arguments are those of `flash_attention_xla`.

    Returns out (total_q, Hq, Dv), or (out, lse) with lse float32 (Hq, total_q).
    """
    check_flash_args(query, key, value, softmax_aux=softmax_aux, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    total_q, total_k = query.shape[0], key.shape[0]
    seq_q, i_local, in_q = varlen_tokens(cu_seqlens_q, total_q, max_seqlen_q)
    seq_k, j_local, in_k = varlen_tokens(cu_seqlens_k, total_k, max_seqlen_k)
    len_q = varlen_lengths(cu_seqlens_q, total_q, max_seqlen_q)
    len_k = varlen_lengths(cu_seqlens_k, total_k, max_seqlen_k)
    seed = _seed_u32(dropout_seed, options)
    aux = _Aux(q_segment_ids=jnp.where(in_q, seq_q, -1)[None],
               kv_segment_ids=jnp.where(in_k, seq_k, -2)[None],
               q_positions=(i_local + (len_k - len_q)[seq_q])[None],
               kv_positions=j_local[None],
               dropout_seed=seed,
               dropout_batch=None if seed is None else seq_q[None],
               dropout_row=None if seed is None else i_local[None],
               dropout_col=None if seed is None else j_local[None])
    hq = query.shape[1]
    cfg = XlaConfig(options=options, block_q=_resolve_block(block_q, hq), block_k=_resolve_block(block_k, hq),
                    precision=_hashable_precision(precision), logits_dtype=np.dtype(logits_dtype),
                    sink_layout=_sink_layout(softmax_aux, hq))
    out, lse = _flash_core_jit(cfg, query[None], key[None], value[None], None, softmax_aux, aux)
    if not return_lse:
        return out[0]
    # A token in no sequence is in no softmax, so its lse is -inf even with sinks (which join the rows
    # of sequences only), as in the Triton kernels; its lse cotangent then reaches nothing.
    return out[0], jnp.where(in_q[None, :], lse[0], -jnp.inf)
