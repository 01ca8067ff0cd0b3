"""float64 NumPy reference of flash_attn_with_kvcache, written from the contract, not the kernels.

Sequence by sequence: rotate and write the new rows into (copies of) the caches, gather the keys of
logical rows [cache_leftpad, cache_seqlens + S_new), and run a plain softmax with the masks.
"""
from __future__ import annotations

import numpy as np


def _f64(x):
    if x is None:
        return None
    if hasattr(x, "detach"):   # torch
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def _ints(x, batch):
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.broadcast_to(np.asarray(x, dtype=np.int64).reshape(-1), (batch,))


def rotate(x, cos, sin, positions, interleaved: bool):
    """x (S, H, D) rotated at positions (S,) over the first 2 * cos.shape[1] dims."""
    half = cos.shape[1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x = x.copy()
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2].copy(), x[..., 1:2 * half:2].copy()
        x[..., 0:2 * half:2] = x1 * c - x2 * s
        x[..., 1:2 * half:2] = x1 * s + x2 * c
    else:
        x1, x2 = x[..., :half].copy(), x[..., half:2 * half].copy()
        x[..., :half] = x1 * c - x2 * s
        x[..., half:2 * half] = x1 * s + x2 * c
    return x


def kvcache_reference(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                      cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False,
                      window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None,
                      softmax_aux=None, num_splits=0):
    """(out (B, Sq, Hq, D), lse (B, Hq, Sq), k_cache after, v_cache after), float64 NumPy.
    (num_splits is taken for the signature's sake: a split changes no result.)"""
    q, kc, vc = _f64(q), _f64(k_cache).copy(), _f64(v_cache).copy()
    k, v, cos, sin = _f64(k), _f64(v), _f64(rotary_cos), _f64(rotary_sin)
    batch, sq, hq, d = q.shape
    hkv = kc.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    left, right = window_size
    if causal:
        right = 0
    local = causal or tuple(window_size) != (-1, -1)
    table = None if block_table is None else (block_table.detach().cpu().numpy() if hasattr(block_table, "detach")
                                              else np.asarray(block_table))
    page = kc.shape[1]
    capacity = page * table.shape[1] if table is not None else kc.shape[1]
    s_new = 0 if k is None else k.shape[1]
    seqlens = _ints(cache_seqlens, batch)
    if seqlens is None:
        seqlens = np.full((batch,), capacity)
    bidx = _ints(cache_batch_idx, batch)
    leftpad = _ints(cache_leftpad, batch)
    slopes = None if alibi_slopes is None else np.broadcast_to(_f64(alibi_slopes), (batch, hq))
    sinks = _f64(softmax_aux)
    if sinks is not None:
        sinks = sinks.reshape(hq, -1) if sinks.ndim == 2 or sinks.shape[0] == hq else np.broadcast_to(sinks, (hq,) + sinks.shape)

    def where(b, rows):   # (outer, inner) of logical rows of sequence b
        rows = np.asarray(rows)
        if table is not None:
            return table[b, rows // page], rows % page
        return np.full(rows.shape, b if bidx is None else bidx[b]), rows

    out = np.zeros((batch, sq, hq, d))
    lse = np.full((batch, hq, sq), -np.inf)
    for b in range(batch):
        n = int(seqlens[b])
        if k is not None:
            knew = k[b] if cos is None else rotate(k[b], cos, sin, n + np.arange(s_new), rotary_interleaved)
            o, i = where(b, n + np.arange(s_new))
            kc[o, i] = knew
            vc[o, i] = v[b]
        qb = q[b]
        if cos is not None:
            qpos_ro = n + (np.arange(sq) if local else np.zeros(sq, np.int64))
            qb = rotate(qb, cos, sin, qpos_ro, rotary_interleaved)
        kv_len = n + s_new
        first = 0 if leftpad is None else int(leftpad[b])
        cols = np.arange(first, kv_len)
        o, i = where(b, cols)
        keys, vals = kc[o, i], vc[o, i]                          # (L, Hkv, D)
        pos = kv_len - sq + np.arange(sq)
        for h in range(hq):
            s = qb[:, h] @ keys[:, h // group].T * scale          # (Sq, L)
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - slopes[b, h] * np.abs(pos[:, None] - cols[None, :])
            visible = np.ones(s.shape, bool)
            if left >= 0:
                visible &= cols[None, :] >= pos[:, None] - left
            if right >= 0:
                visible &= cols[None, :] <= pos[:, None] + right
            s = np.where(visible, s, -np.inf)
            extra = sinks[h] if sinks is not None else np.zeros(0)
            full = np.concatenate([s, np.broadcast_to(extra, (sq, extra.size))], axis=1)
            top = full.max(axis=1, initial=-np.inf)
            safe = np.where(np.isfinite(top), top, 0.0)
            w = np.exp(full - safe[:, None])
            total = w.sum(axis=1)
            with np.errstate(divide="ignore"):
                lse[b, h] = np.where(total > 0, safe + np.log(total), -np.inf)
            out[b, :, h] = np.where(total[:, None] > 0, w[:, :s.shape[1]] @ vals[:, h // group]
                                    / np.where(total > 0, total, 1.0)[:, None], 0.0)
    return out, lse, kc, vc
