"""Pure-XLA block-sparse attention: online softmax over the active blocks of a SparseMask only.

The layout (a `dualattn.SparseMask`, numpy) is static: it is turned once into a `_Plan` of gathers and
closed over as constants.  A *row* is one (layout batch, layout head, query block) of the block map;
its data covers the batch / heads the layout broadcasts over (the "free" dims Fb, Fh, Fg):

    layout (1, 1, nq, nk):   rows = query blocks,             free = (B, Hkv, G)  (GQA: K/V not repeated)
    layout (B, 1, nq, nk):   rows = (batch, query block),     free = (1, Hkv, G)
    layout (1, Hq, nq, nk):  rows = (q head, query block),    free = (B, 1, 1)
    layout (B, Hq, nq, nk):  rows = (b, q head, query block), free = (1, 1, 1)

Each row visits its own list of key blocks (`kv_indices[..., :kv_counts]`).  Rows are grouped into at
most three buckets of similar count (power-of-two classes, busiest first, merged while the padding they
add stays small; a small layout is one bucket) and every bucket runs one `lax.scan` over key-block
*slots*: slot t of every row of the bucket gathers that row's t-th key block, all rows at once; slots
past a row's count are masked.  So the work is the active blocks plus a bounded padding (a skewed
layout such as global tokens does not pad every row to the busiest one), rows with no active block
cost nothing, and no (Sq, Sk) array is ever built: the largest intermediates are the per-slot tiles
(R, Fb, Fh, Fg, block_q, block_k).

    block map (nq=3, nk=4)        rows, slots          bucket 0 (count 3..4): row 2, slots 0..2
        k: 0 1 2 3                q0: [0]              bucket 1 (count 1..2): rows 0, 1, slot 0..1
    q0     1 0 0 0                q1: [0, 1]             (row 0's slot 1 is padding: masked)
    q1     1 1 0 0                q2: [0, 2, 3]
    q2     1 0 1 1

Inside an active block the token rules still apply (the same `position_mask` as every backend):

    may_attend(b, h, i, j) = block_map[b, h, i // block_q, j // block_k]     (only active blocks run)
                             & position_mask(q_pos[b, i], k_pos[b, j])       window / causal
                             & q_seg[b, i] == kv_seg[b, j]                   packed documents
                             & i < Sq & j < Sk                               ragged last blocks
    default positions: q_pos = i + (Sk - Sq), k_pos = j (bottom-right aligned)

Ragged sequences are padded up to whole blocks (less than one block of extra rows / columns); the
padding is masked and cropped.  The backward recomputes P per (row, slot) tile from the saved lse,
accumulates dQ per row and scatter-adds dK / dV into the key blocks the slot gathered from.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...options import FlashOptions
from ...sparse import SparseMask
from ...validation import check_flash_args
from ..mask import exp_nonpositive, finish_rows, position_mask, score_unit, sink_logsumexp, sink_probability
from .flash import (_NEG_INF, _Aux, _hashable_precision, _int_rows, _sink_grad_to_layout, _sink_layout,
                    _sink_matrix)

__all__ = ["BlocksparseXlaConfig", "blocksparse_attention_xla"]

# --------------------------------------------------------------------------------------------------
# static plan: rows, buckets, gathers (numpy, built once per (layout, problem size))
# --------------------------------------------------------------------------------------------------
_MAX_BUCKETS = 3           # at most this many scans (each is one more traced loop, fwd and bwd)
_PADDING_BUDGET = 0.25     # padded slots a merge of count classes may add, as a fraction of the active ones
_SMALL_WORK = 1 << 22      # logits of one padded bucket below which splitting is not worth a second loop


def _group_rows(counts: np.ndarray, active: np.ndarray, tile_elements: int):
    """Split the active rows into buckets (ascending row ids each), busiest first.

    Rows fall into power-of-two count classes (c in (2^(k-1), 2^k]); walking the classes from the
    busiest, a class joins the current bucket while the padding that adds stays within the budget,
    otherwise it opens a new bucket (the last allowed bucket takes everything left).  A layout whose
    single padded bucket is small runs as one bucket.
    """
    if active.size == 0:
        return []
    c = counts[active]
    total = int(c.sum())
    if active.size * int(c.max()) * tile_elements <= _SMALL_WORK:
        return [active]
    cls = np.ceil(np.log2(c)).astype(np.int64)
    groups, slots, waste = [], 0, 0
    for k in np.unique(cls)[::-1]:
        members = cls == k
        extra = int(members.sum()) * slots - int(c[members].sum())
        if groups and (waste + extra <= _PADDING_BUDGET * total or len(groups) == _MAX_BUCKETS):
            groups[-1] |= members
            waste += extra
        else:
            groups.append(members)
            slots = int(c[members].max())
            waste += int(members.sum()) * slots - int(c[members].sum())
    return [active[g] for g in groups]


@dataclasses.dataclass(frozen=True, eq=False)
class _Bucket:
    """Rows run together, padded to the same number of key-block slots.

    Index arrays broadcast to (R, Fb, Fh, Fg): indexing the (B, nq, bq, Hkv, G, ...) query blocks with
    [b, n, :, h, g] gives the rows' data (R, Fb, Fh, Fg, bq, ...).
    """

    rows: np.ndarray       # (R,) flat layout row ids ((lb * Lh) + lh) * nq + qb
    b: np.ndarray          # (R or 1, Fb, 1, 1) batch of the data
    h: np.ndarray          # (R or 1, 1, Fh, 1) kv head
    g: np.ndarray          # (R or 1, 1, 1, Fg) query head within the kv head's group
    n: np.ndarray          # (R, 1, 1, 1) query block
    kv_index: np.ndarray   # (slots, R) int32: the row's key block at each slot (0 past its count)
    kv_valid: np.ndarray   # (slots, R) bool: slot < the row's count


class _Plan:
    """The static schedule of one (layout, batch, heads, Sq, Sk).  Hashed and compared by identity."""

    def __init__(self, layout: SparseMask, batch: int, heads_q: int, heads_kv: int, seqlen_q: int,
                 seqlen_k: int):
        lb, lh, nq, nk = layout.shape
        group = heads_q // heads_kv
        self.batch, self.heads_q, self.heads_kv, self.group = batch, heads_q, heads_kv, group
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.block_q, self.block_k = layout.block_q, layout.block_k
        self.num_q_blocks, self.num_k_blocks = nq, nk
        self.layout_batch, self.layout_heads = lb, lh
        # free dims: what a row's data spans besides its own (batch, head) coordinates
        self.free = (batch if lb == 1 else 1, heads_kv if lh == 1 else 1, group if lh == 1 else 1)

        counts = layout.kv_counts.reshape(-1).astype(np.int64)            # [Lb * Lh * nq]
        indices = layout.kv_indices.reshape(lb * lh * nq, nk)
        active = np.flatnonzero(counts > 0)
        buckets = []
        for rows in _group_rows(counts, active, self.block_q * self.block_k * int(np.prod(self.free))):
            slots = int(counts[rows].max())
            r_lb, r_lh, r_q = np.unravel_index(rows, (lb, lh, nq))
            col = (slice(None),) + (None,) * 3
            b = r_lb[col] if lb > 1 else np.arange(batch)[None, :, None, None]
            if lh > 1:
                h, g = (r_lh // group)[col], (r_lh % group)[col]
            else:
                h, g = np.arange(heads_kv)[None, None, :, None], np.arange(group)[None, None, None, :]
            kv_index = np.ascontiguousarray(indices[rows, :slots].T.astype(np.int32))
            kv_valid = np.arange(slots)[:, None] < counts[rows][None, :]
            buckets.append(_Bucket(rows, b.astype(np.int32), h.astype(np.int32), g.astype(np.int32),
                                   r_q[col].astype(np.int32), kv_index, kv_valid))
        self.buckets: Tuple[_Bucket, ...] = tuple(buckets)
        # rows in layout order <- concatenation of the buckets' rows plus one "empty" row at the end
        total = sum(bk.rows.size for bk in buckets)
        self.inverse = np.full(lb * lh * nq, total, dtype=np.int32)
        offset = 0
        for bk in buckets:
            self.inverse[bk.rows] = offset + np.arange(bk.rows.size, dtype=np.int32)
            offset += bk.rows.size

    @property
    def padded_q(self) -> int:
        return self.num_q_blocks * self.block_q

    @property
    def padded_k(self) -> int:
        return self.num_k_blocks * self.block_k

    def from_rows(self, parts, fill, *, seq_major: bool):
        """Per-bucket row arrays (R, Fb, Fh, Fg, bq, *rest) -> (B, Hq, Sq_pad, *rest) or (B, Sq_pad, Hq, *rest).

        Rows with no active key block (in no bucket) get `fill`.
        """
        fb, fh, fg = self.free
        lb, lh, nq = self.layout_batch, self.layout_heads, self.num_q_blocks
        empty = jnp.full((1,) + parts[0].shape[1:], fill, parts[0].dtype)
        x = jnp.take(jnp.concatenate([*parts, empty], axis=0), self.inverse, axis=0)
        rest = x.shape[5:]
        x = x.reshape(lb, lh, nq, fb, fh, fg, self.block_q, *rest)
        tail = tuple(range(7, 7 + len(rest)))
        if seq_major:      # (Lb, Fb, nq, bq, Lh, Fh, Fg, ...) -> (B, Sq_pad, Hq, ...)
            x = x.transpose(0, 3, 2, 6, 1, 4, 5, *tail)
            return x.reshape(self.batch, self.padded_q, self.heads_q, *rest)
        x = x.transpose(0, 3, 1, 4, 5, 2, 6, *tail)   # (Lb, Fb, Lh, Fh, Fg, nq, bq, ...) -> (B, Hq, Sq_pad, ...)
        return x.reshape(self.batch, self.heads_q, self.padded_q, *rest)


@dataclasses.dataclass(frozen=True)
class BlocksparseXlaConfig:
    """Everything static about one call: the one nondiff argument of the custom_vjp core.

    plan is hashed by identity (it holds numpy arrays); the same layout object reuses its plan (cached
    in `SparseMask.device_cache`), so repeated calls hit the jit cache.
    """

    options: FlashOptions
    plan: _Plan
    precision: Any = None
    sink_layout: str = "none"   # as XlaConfig: "none", "head" (Hq,), "head_n" (Hq, n), "shared" (n,)


# --------------------------------------------------------------------------------------------------
# tiles: the one place that gathers key blocks, computes logits and applies the token rules
# --------------------------------------------------------------------------------------------------
class _Tokens:
    """Padded per-token arrays of one call, blocked: (B, n_blocks, block) int32 (None where absent)."""

    def __init__(self, plan: _Plan, aux: _Aux):
        def blocked(x, n, block, length):
            if x is None:
                return None
            return jnp.pad(x, ((0, 0), (0, n * block - length))).reshape(x.shape[0], n, block)

        nq, nk, bq, bk = plan.num_q_blocks, plan.num_k_blocks, plan.block_q, plan.block_k
        self.q_pos = blocked(aux.q_positions, nq, bq, plan.seqlen_q)
        self.k_pos = blocked(aux.kv_positions, nk, bk, plan.seqlen_k)
        self.q_seg = blocked(aux.q_segment_ids, nq, bq, plan.seqlen_q)
        self.k_seg = blocked(aux.kv_segment_ids, nk, bk, plan.seqlen_k)


def _row_tokens(plan: _Plan, bucket: _Bucket, tokens: _Tokens):
    """Query-side (valid, positions, segment ids) of a bucket's rows, each broadcastable to (R,Fb,Fh,Fg,bq,1)."""
    t = np.arange(plan.block_q)
    rows = bucket.n[..., None] * plan.block_q + t                       # [R, 1, 1, 1, bq]
    valid = (rows < plan.seqlen_q)[..., None]
    bb, nn = bucket.b[:, :, 0, 0], bucket.n[:, :, 0, 0]                  # [R|1, Fb], [R, 1]

    def gather(x):                                                       # (B, nq, bq) -> [R, Fb, 1, 1, bq, 1]
        return x[bb, nn][:, :, None, None, :, None]

    pos = (rows + plan.seqlen_k - plan.seqlen_q)[..., None] if tokens.q_pos is None else gather(tokens.q_pos)
    seg = None if tokens.q_seg is None else gather(tokens.q_seg)
    return valid, pos, seg


def _gather_blocks(bucket: _Bucket, x4, kb):
    """Key blocks of one slot: x4 (B, nk, bk, Hkv, Dx), kb (R,) -> (R, Fb, Fh, bk, Dx)."""
    return x4[bucket.b[..., 0], kb[:, None, None], :, bucket.h[..., 0]]


def _tile_logits(cfg: BlocksparseXlaConfig, bucket: _Bucket, q_rows, row_tok, tokens: _Tokens, k_blk, kb,
                 valid_slot, unit: float = 1.0):
    """Logits of one slot for all rows of a bucket and where they may attend.

    q_rows (R, Fb, Fh, Fg, bq, D), k_blk (R, Fb, Fh, bk, D), kb / valid_slot (R,).
    Returns s (R, Fb, Fh, Fg, bq, bk) float32 after scale and soft cap (unmasked), the mask
    (broadcastable to s) and tanh(s_pre_cap / cap) for the backward (None without soft cap).
    unit: a factor the caller applies itself (mask.score_unit): s is then q.k * scale / unit.
    """
    opts, plan = cfg.options, cfg.plan
    s = jnp.einsum("rbhgqd,rbhkd->rbhgqk", q_rows, k_blk, precision=cfg.precision,
                   preferred_element_type=jnp.float32)
    if unit != opts.softmax_scale:
        s = s * opts.softmax_scale
    tanh = None
    if opts.logits_soft_cap is not None:
        tanh = jnp.tanh(s / opts.logits_soft_cap)
        s = opts.logits_soft_cap * tanh

    row_valid, q_pos, q_seg = row_tok
    cols = kb[:, None] * plan.block_k + jnp.arange(plan.block_k, dtype=jnp.int32)      # [R, bk]
    ok = (valid_slot[:, None] & (cols < plan.seqlen_k))[:, None, None, None, None, :]  # [R, 1, 1, 1, 1, bk]
    ok = ok & row_valid
    bb = bucket.b[:, :, 0, 0]

    def gather(x):                                                       # (B, nk, bk) -> [R, Fb, 1, 1, 1, bk]
        return x[bb, kb[:, None]][:, :, None, None, None, :]

    if opts.has_window:
        k_pos = cols[:, None, None, None, None, :] if tokens.k_pos is None else gather(tokens.k_pos)
        ok = ok & position_mask(q_pos, k_pos, opts)
    if q_seg is not None:
        ok = ok & (q_seg == gather(tokens.k_seg))
    return s, ok, tanh


# --------------------------------------------------------------------------------------------------
# forward
# --------------------------------------------------------------------------------------------------
def _pad_seq(x, length):
    return jnp.pad(x, ((0, 0), (0, length - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def _blocks(plan: _Plan, query, key, value):
    """query (B, nq, bq, Hkv, G, D); key / value (B, nk, bk, Hkv, D / Dv), zero-padded to whole blocks."""
    B, Hkv, G = plan.batch, plan.heads_kv, plan.group
    q = _pad_seq(query, plan.padded_q).reshape(B, plan.num_q_blocks, plan.block_q, Hkv, G, query.shape[-1])
    k = _pad_seq(key, plan.padded_k).reshape(B, plan.num_k_blocks, plan.block_k, Hkv, key.shape[-1])
    v = _pad_seq(value, plan.padded_k).reshape(B, plan.num_k_blocks, plan.block_k, Hkv, value.shape[-1])
    return q, k, v


def _rows_of(bucket: _Bucket, x6):
    """(B, nq, bq, Hkv, G, ...) -> the bucket's rows (R, Fb, Fh, Fg, bq, ...)."""
    return x6[bucket.b, bucket.n, :, bucket.h, bucket.g]


def _forward(cfg: BlocksparseXlaConfig, query, key, value, softmax_aux, aux: _Aux):
    """Returns out (B, Sq, Hq, Dv) in the query dtype and lse (B, Hq, Sq) float32."""
    plan = cfg.plan
    B, Sq, Hq, Dv = plan.batch, plan.seqlen_q, plan.heads_q, value.shape[-1]
    q6, k5, v5 = _blocks(plan, query, key, value)
    tokens = _Tokens(plan, aux)
    unit = score_unit(cfg.options, has_bias=False)

    ms, ls, accs = [], [], []
    for bucket in plan.buckets:
        q_rows = _rows_of(bucket, q6)                                     # [R, Fb, Fh, Fg, bq, D]
        row_tok = _row_tokens(plan, bucket, tokens)

        def slot(state, xs, bucket=bucket, q_rows=q_rows, row_tok=row_tok):
            m, l, acc = state
            kb, valid = xs
            s, ok, _ = _tile_logits(cfg, bucket, q_rows, row_tok, tokens, _gather_blocks(bucket, k5, kb), kb,
                                    valid, unit)
            s = jnp.where(ok, s, _NEG_INF)                                # [R, Fb, Fh, Fg, bq, bk]
            m_new = jnp.maximum(m, s.max(axis=-1))                        # in `unit`s
            m_ref = jnp.where(m_new == _NEG_INF, 0.0, m_new)              # no (-inf) - (-inf)
            p = exp_nonpositive((s - m_ref[..., None]) * unit)
            alpha = jnp.exp((m - m_ref) * unit)
            v_blk = _gather_blocks(bucket, v5, kb)                        # [R, Fb, Fh, bk, Dv]
            pv = jnp.einsum("rbhgqk,rbhkd->rbhgqd", p.astype(value.dtype), v_blk, precision=cfg.precision,
                            preferred_element_type=jnp.float32)
            return (m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv), None

        rows_shape = q_rows.shape[:-1]
        init = (jnp.full(rows_shape, _NEG_INF, jnp.float32), jnp.zeros(rows_shape, jnp.float32),
                jnp.zeros(rows_shape + (Dv,), jnp.float32))
        (m, l, acc), _ = lax.scan(slot, init, (bucket.kv_index, bucket.kv_valid))
        ms.append(m), ls.append(l), accs.append(acc)

    if plan.buckets:
        m = plan.from_rows(ms, _NEG_INF, seq_major=False)[:, :, :Sq]     # [B, Hq, Sq]
        l = plan.from_rows(ls, 0.0, seq_major=False)[:, :, :Sq]
        acc = plan.from_rows(accs, 0.0, seq_major=True)[:, :Sq]          # [B, Sq, Hq, Dv]
    else:                                                                 # no active block: all rows empty
        m = jnp.full((B, Hq, Sq), _NEG_INF, jnp.float32)
        l = jnp.zeros((B, Hq, Sq), jnp.float32)
        acc = jnp.zeros((B, Sq, Hq, Dv), jnp.float32)

    sink_lse = None
    if softmax_aux is not None:
        sink_lse = sink_logsumexp(_sink_matrix(cfg, softmax_aux, Hq))[None, :, None]   # [1, Hq, 1]
    lse, norm = finish_rows(m * unit, l, sink_lse)                        # [B, Hq, Sq] each
    out = (acc * norm.transpose(0, 2, 1)[..., None]).astype(query.dtype)
    return out, lse


# --------------------------------------------------------------------------------------------------
# backward
# --------------------------------------------------------------------------------------------------
def _backward(cfg: BlocksparseXlaConfig, query, key, value, softmax_aux, aux: _Aux, out, lse, dout, dlse):
    """Returns dquery, dkey, dvalue, dsoftmax_aux (None without sinks)."""
    plan = cfg.plan
    B, Sq, Sk, Hq, Hkv, G = (plan.batch, plan.seqlen_q, plan.seqlen_k, plan.heads_q, plan.heads_kv,
                             plan.group)
    D, Dv, nq, bq = query.shape[-1], value.shape[-1], plan.num_q_blocks, plan.block_q
    scale = cfg.options.softmax_scale

    # dS = P * (dP - delta), delta = rowsum(dO * O) - dlse: the dlse term makes the lse output differentiable.
    delta = jnp.einsum("bqhd,bqhd->bhq", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - dlse.astype(jnp.float32)                              # [B, Hq, Sq]
    # Fully masked rows (lse -inf): P = 0 anyway; a +inf sink's rows (lse +inf) keep it: P = exp(s - inf) = 0.
    lse_ref = jnp.where(lse == -jnp.inf, 0.0, lse)

    q6, k5, v5 = _blocks(plan, query, key, value)
    do6 = _pad_seq(dout, plan.padded_q).reshape(B, nq, bq, Hkv, G, Dv)

    def per_row(x):                                                        # (B, Hq, Sq) -> (B, nq, bq, Hkv, G)
        return _pad_seq(x.transpose(0, 2, 1), plan.padded_q).reshape(B, nq, bq, Hkv, G)

    lse6, delta6 = per_row(lse_ref), per_row(delta)
    tokens = _Tokens(plan, aux)

    dk = jnp.zeros(k5.shape, jnp.float32)
    dv = jnp.zeros(v5.shape, jnp.float32)
    dqs = []
    for bucket in plan.buckets:
        q_rows, do_rows = _rows_of(bucket, q6), _rows_of(bucket, do6)     # [R, Fb, Fh, Fg, bq, D / Dv]
        lse_rows = _rows_of(bucket, lse6)[..., None]                      # [R, Fb, Fh, Fg, bq, 1]
        delta_rows = _rows_of(bucket, delta6)[..., None]
        row_tok = _row_tokens(plan, bucket, tokens)
        bb, hh = bucket.b[..., 0], bucket.h[..., 0]                       # [R|1, Fb, 1], [R|1, 1, Fh]

        def slot(state, xs, bucket=bucket, q_rows=q_rows, do_rows=do_rows, lse_rows=lse_rows,
                 delta_rows=delta_rows, row_tok=row_tok, bb=bb, hh=hh):
            dq_rows, dk, dv = state
            kb, valid = xs
            k_blk, v_blk = _gather_blocks(bucket, k5, kb), _gather_blocks(bucket, v5, kb)
            s, ok, tanh = _tile_logits(cfg, bucket, q_rows, row_tok, tokens, k_blk, kb, valid)
            p = jnp.where(ok, exp_nonpositive(s - lse_rows), 0.0)                 # [R, Fb, Fh, Fg, bq, bk]
            dp = jnp.einsum("rbhgqd,rbhkd->rbhgqk", do_rows, v_blk, precision=cfg.precision,
                            preferred_element_type=jnp.float32)
            dv_blk = jnp.einsum("rbhgqk,rbhgqd->rbhkd", p.astype(dout.dtype), do_rows, precision=cfg.precision,
                                preferred_element_type=jnp.float32)
            ds = p * (dp - delta_rows)
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            ds = ds * scale
            dq_rows = dq_rows + jnp.einsum("rbhgqk,rbhkd->rbhgqd", ds.astype(key.dtype), k_blk,
                                           precision=cfg.precision, preferred_element_type=jnp.float32)
            dk_blk = jnp.einsum("rbhgqk,rbhgqd->rbhkd", ds.astype(query.dtype), q_rows, precision=cfg.precision,
                                preferred_element_type=jnp.float32)
            # rows sharing a key block (other query blocks, or query heads of one GQA group) add up here
            at = (bb, kb[:, None, None], slice(None), hh)
            return (dq_rows, dk.at[at].add(dk_blk), dv.at[at].add(dv_blk)), None

        init = (jnp.zeros(q_rows.shape, jnp.float32), dk, dv)
        (dq_rows, dk, dv), _ = lax.scan(slot, init, (bucket.kv_index, bucket.kv_valid))
        dqs.append(dq_rows)

    if plan.buckets:
        dq = plan.from_rows(dqs, 0.0, seq_major=True)[:, :Sq]            # [B, Sq, Hq, D]
    else:
        dq = jnp.zeros((B, Sq, Hq, D), jnp.float32)
    dk = dk.reshape(B, plan.padded_k, Hkv, D)[:, :Sk]
    dv = dv.reshape(B, plan.padded_k, Hkv, Dv)[:, :Sk]

    d_sinks = None
    if softmax_aux is not None:
        # d lse / d sink = p_sink = exp(sink - lse); out depends on the sinks only through lse.
        sinks = _sink_matrix(cfg, softmax_aux, Hq)                        # [Hq, n]
        p_sink = sink_probability(sinks[None, :, None, :], lse[..., None])  # [B, Hq, Sq, n]
        d_sinks = _sink_grad_to_layout(cfg, -jnp.einsum("bhqn,bhq->hn", p_sink, delta), softmax_aux)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype), d_sinks


# --------------------------------------------------------------------------------------------------
# custom_vjp core: one static argument (cfg), primal and forward rule share `_forward`
# --------------------------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocksparse_core(cfg: BlocksparseXlaConfig, query, key, value, softmax_aux, aux: _Aux):
    return _forward(cfg, query, key, value, softmax_aux, aux)


def _blocksparse_core_fwd(cfg, query, key, value, softmax_aux, aux):
    out, lse = _forward(cfg, query, key, value, softmax_aux, aux)
    return (out, lse), (query, key, value, softmax_aux, aux, out, lse)


def _blocksparse_core_bwd(cfg, residuals, cotangents):
    query, key, value, softmax_aux, aux, out, lse = residuals
    dout, dlse = cotangents
    return (*_backward(cfg, query, key, value, softmax_aux, aux, out, lse, dout, dlse), None)


_blocksparse_core.defvjp(_blocksparse_core_fwd, _blocksparse_core_bwd)
_blocksparse_core_jit = jax.jit(_blocksparse_core, static_argnums=0)


# --------------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------------
def _plan_for(layout: SparseMask, batch, heads_q, heads_kv, seqlen_q, seqlen_k) -> _Plan:
    """The layout's plan for this problem size, built once and cached on the layout (same plan: jit cache hit)."""
    key = ("xla_blocksparse_plan", batch, heads_q, heads_kv, seqlen_q, seqlen_k)
    plan = layout.device_cache.get(key)
    if plan is None:
        plan = layout.device_cache[key] = _Plan(layout, batch, heads_q, heads_kv, seqlen_q, seqlen_k)
    return plan


def blocksparse_attention_xla(query, key, value, *, layout: SparseMask, options: FlashOptions,
                              q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                              softmax_aux=None, return_lse=False, precision=None):
    """Block-sparse attention in pure JAX/XLA, BSHD: only the layout's active blocks are computed.

    Args:
      query: (B, Sq, Hq, D); key: (B, Sk, Hkv, D); value: (B, Sk, Hkv, Dv); Hq % Hkv == 0 (GQA/MQA).
      layout: a `dualattn.SparseMask` with block map (B or 1, Hq or 1, ceil(Sq/block_q), ceil(Sk/block_k));
        per-head layouts are per *query* head.  Sq and Sk need not be multiples of the block sizes.
      options: canonical static options (scale, window/causal, soft cap); applied inside active blocks.
        dropout_prob must be 0.
      q_segment_ids, kv_segment_ids: int (B, Sq) / (B, Sk); attend only where equal (one given: both).
      q_positions, kv_positions: int (B, Sq) / (B, Sk) (or (Sq,) / (Sk,)) positions for the window and
        causal rules; default i + (Sk - Sq) and j (bottom-right aligned).
      softmax_aux: sinks, (Hq, n), (Hq,) or (n,) shared: extra logits in every row's denominator.
      return_lse: also return the float32 log-sum-exp (B, Hq, Sq), natural log, sinks included.
      precision: einsum precision (None, a lax.Precision or a string).

    Returns:
      out (B, Sq, Hq, Dv) in the query dtype, or (out, lse).  Equal to dense attention under the token
      mask "block active & token rules".  Differentiable w.r.t. query, key, value and softmax_aux (and
      through lse); rows with nothing to attend (e.g. a query block with no active key block) give 0,
      lse -inf (with sinks: the sinks' logsumexp) and zero gradients.
    """
    if not isinstance(layout, SparseMask):
        raise TypeError(f"layout must be a dualattn.SparseMask, got {type(layout).__name__}")
    if not isinstance(options, FlashOptions):
        raise TypeError(f"options must be a FlashOptions, got {type(options).__name__}")
    if options.dropout_prob != 0.0:
        raise ValueError(f"blocksparse_attention_xla does not support dropout, got dropout_prob="
                         f"{options.dropout_prob}")
    shapes = check_flash_args(query, key, value, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              softmax_aux=softmax_aux)
    B, Sq, Sk, Hq, Hkv = shapes.batch, shapes.seqlen_q, shapes.seqlen_k, shapes.heads_q, shapes.heads_kv
    layout.check(B, Hq, Sq, Sk)
    if q_segment_ids is None:
        q_segment_ids = kv_segment_ids
    if kv_segment_ids is None:
        kv_segment_ids = q_segment_ids
    aux = _Aux(q_segment_ids=_int_rows("q_segment_ids", q_segment_ids, B, Sq),
               kv_segment_ids=_int_rows("kv_segment_ids", kv_segment_ids, B, Sk),
               q_positions=_int_rows("q_positions", q_positions, B, Sq),
               kv_positions=_int_rows("kv_positions", kv_positions, B, Sk))
    cfg = BlocksparseXlaConfig(options=options, plan=_plan_for(layout, B, Hq, Hkv, Sq, Sk),
                               precision=_hashable_precision(precision),
                               sink_layout=_sink_layout(softmax_aux, Hq))
    out, lse = _blocksparse_core_jit(cfg, query, key, value, softmax_aux, aux)
    return (out, lse) if return_lse else out
