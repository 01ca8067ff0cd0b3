"""NSA's selected branch in pure JAX (the "xla" backend): each token's selected key blocks gathered,
chunk by chunk over tokens, differentiated by JAX (the gathers' transposes are scatter-adds).

Memory per chunk: (B, chunk, Hkv, S * block_size, D) gathered keys and values, never a T x T matrix.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 256


def token_starts(cu_seqlens, total: int):
    """Start of each packed token's sequence, (total,): 0 without cu_seqlens."""
    if cu_seqlens is None:
        return jnp.zeros((total,), jnp.int32)
    tokens = jnp.arange(total, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens.astype(jnp.int32), tokens, side="right") - 1
    return cu_seqlens.astype(jnp.int32)[jnp.clip(seq, 0, cu_seqlens.shape[0] - 2)]


def counted_entries(block_indices, block_counts, local_pos, block_size: int):
    """(B, T, Hkv, S) bool: the entries that count, each distinct block once (its first entry)."""
    idx = block_indices.astype(jnp.int32)
    slots = jnp.arange(idx.shape[-1])
    counts = jnp.asarray(block_counts, jnp.int32)
    counts = counts[..., None] if counts.ndim else counts
    ok = (slots < counts) & (idx >= 0) & (idx <= (local_pos // block_size)[None, :, None, None])
    earlier = slots[:, None] > slots[None, :]                       # [s, s'] : s' before s
    dup = ((idx[..., :, None] == idx[..., None, :]) & ok[..., None, :] & earlier).any(-1)
    return ok & ~dup


def selected_attention_xla(query, key, value, block_indices, block_counts, block_size: int, softmax_scale: float,
                           cu_seqlens=None):
    """Same arguments and result as apply_native_sparse_attention (query (B, T, Hq, D) etc.)."""
    b, t, hq, d = query.shape
    hkv, dv = key.shape[2], value.shape[-1]
    group, slots = hq // hkv, block_indices.shape[-1]
    starts = token_starts(cu_seqlens, t)                             # (T,)
    local = jnp.arange(t, dtype=jnp.int32) - starts
    entries = counted_entries(block_indices, block_counts, local, block_size)
    offs = jnp.arange(block_size, dtype=jnp.int32)
    key_local = jnp.maximum(block_indices.astype(jnp.int32), 0)[..., None] * block_size + offs   # (B,T,Hkv,S,bs)
    key_ok = entries[..., None] & (key_local <= local[None, :, None, None, None])
    key_pos = jnp.clip(starts[None, :, None, None, None] + key_local, 0, t - 1)
    chunk = min(CHUNK, t)
    pad = -t % chunk
    n_chunks = (t + pad) // chunk

    def split(x):   # (B, T, ...) -> (n_chunks, B, chunk, ...)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n_chunks, chunk, *x.shape[2:]), 1, 0)

    heads = jnp.arange(hkv)[None, None, :, None]

    def one_chunk(args):
        q, pos, ok = args                                  # (B, C, Hq, D), (B, C, Hkv, S, bs) x2
        pos = pos.reshape(b, chunk, hkv, slots * block_size)
        ok = ok.reshape(b, chunk, hkv, slots * block_size)
        batch = jnp.arange(b)[:, None, None, None]
        k = key[batch, pos, heads].astype(jnp.float32)    # (B, C, Hkv, S*bs, D)
        v = value[batch, pos, heads].astype(jnp.float32)
        qg = q.reshape(b, chunk, hkv, group, d).astype(jnp.float32)
        s = jnp.einsum("bchgd,bchkd->bchgk", qg, k) * softmax_scale
        s = jnp.where(ok[:, :, :, None, :], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.where(ok[:, :, :, None, :], jnp.exp(s - m), 0.0)
        l = p.sum(-1, keepdims=True)
        o = jnp.einsum("bchgk,bchkd->bchgd", p / jnp.where(l > 0, l, 1.0), v)
        return o.reshape(b, chunk, hq, dv)

    chunks = (split(query), split(key_pos), split(key_ok))
    if n_chunks == 1:
        out = one_chunk(tuple(x[0] for x in chunks))[None]
    else:   # rematerialised in the backward: a chunk's gathered keys are not kept for all chunks
        out = jax.lax.map(jax.checkpoint(one_chunk), chunks)
    out = jnp.moveaxis(out, 0, 1).reshape(b, n_chunks * chunk, hq, dv)[:, :t]
    return out.astype(query.dtype)
