"""Independent float64 reference of native sparse attention, built from the definitions (dense masks).

    selected_mask(block_indices, block_counts, block_size, T)          bool (B, Hkv, T, T)
    reference_selected(q, k, v, block_indices, block_counts, block_size, softmax_scale, cu_seqlens)
    reference_nsa(q, k, v, g_cmp, g_slc, g_swa, block_indices, block_counts, block_size, window_size,
                  softmax_scale, cu_seqlens) -> (out, block_indices used)
Everything is torch float64 on the CPU and differentiable (the tests take gradients with autograd).
Varlen (cu_seqlens, B = 1) runs each sequence on its own with positions from its start.
"""
from __future__ import annotations

import torch


def selected_mask(block_indices, block_counts, block_size: int, seqlen: int) -> torch.Tensor:
    """allowed[b, h, t, j]: j <= t and j's block is one of t's counted entries (each entry s < count,
    >= 0, <= t // block_size; duplicates are the same block)."""
    idx = torch.as_tensor(block_indices).long()
    b, t_len, hkv, slots = idx.shape
    if isinstance(block_counts, int):
        counts = torch.full((b, t_len, hkv), block_counts, dtype=torch.long)
    else:
        counts = torch.as_tensor(block_counts).long()
    t = torch.arange(t_len)
    entry_ok = (torch.arange(slots) < counts[..., None]) & (idx >= 0) & (idx <= (t // block_size)[None, :, None, None])
    n_blocks = -(-seqlen // block_size)
    block_sel = torch.zeros(b, t_len, hkv, n_blocks + 1, dtype=torch.bool)
    block_sel.scatter_(3, torch.where(entry_ok, idx, n_blocks), True)   # invalid entries go to a spare column
    key_block = torch.arange(seqlen) // block_size
    allowed = block_sel[..., key_block]                        # (B, T, Hkv, T)
    allowed = allowed & (torch.arange(seqlen)[None, :] <= t[:, None])[None, :, None, :]
    return allowed.permute(0, 2, 1, 3)


def _attend(q, k, v, allowed, scale):
    """q (B, T, Hq, D), k/v (B, Tk, Hkv, D), allowed (B, Hkv, T, Tk) -> (B, T, Hq, Dv); empty rows give 0."""
    group = q.shape[2] // k.shape[2]
    kk = k.repeat_interleave(group, dim=2)
    vv = v.repeat_interleave(group, dim=2)
    mask = allowed.repeat_interleave(group, dim=1)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    empty = ~mask.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(~mask, 0.0)
    return torch.einsum("bhts,bshd->bthd", p, vv), s


def _split(cu_seqlens, total):
    if cu_seqlens is None:
        return [(0, total)]
    cu = [int(c) for c in cu_seqlens]
    return list(zip(cu[:-1], cu[1:]))


def reference_selected(q, k, v, block_indices, block_counts=16, block_size=64, softmax_scale=None,
                       cu_seqlens=None):
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs = []
    for lo, hi in _split(cu_seqlens, q.shape[1]):
        counts = block_counts if isinstance(block_counts, int) else torch.as_tensor(block_counts)[:, lo:hi]
        allowed = selected_mask(torch.as_tensor(block_indices)[:, lo:hi], counts, block_size, hi - lo)
        outs.append(_attend(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], allowed, scale)[0])
    return torch.cat(outs, dim=1)


def _pool(x, block_size):
    n = x.shape[1] // block_size
    return x[:, :n * block_size].reshape(x.shape[0], n, block_size, *x.shape[2:]).mean(2)


def _compressed(q, k, v, block_size, scale):
    """Compressed branch of one sequence: (out, probabilities (B, Hq, T, n_complete_blocks))."""
    kc, vc = _pool(k, block_size), _pool(v, block_size)
    t = torch.arange(q.shape[1])
    visible = ((torch.arange(kc.shape[1]) + 1) * block_size - 1)[None, :] <= t[:, None]   # (T, Nc)
    allowed = visible[None, None].expand(q.shape[0], k.shape[2], -1, -1)
    out, s = _attend(q, kc, vc, allowed, scale)
    empty = ~torch.isfinite(s).any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(~torch.isfinite(s), 0.0)
    return out, p


def reference_topk(probs, heads_kv, seqlen, block_size, count):
    """Selection from compressed probabilities (B, Hq, T, Nc): per KV group, the probabilities summed over
    its heads, own block first, then the highest, ties to the lower index; -1 past the candidates."""
    b, hq, t_len, nc = probs.shape
    n_blocks = -(-seqlen // block_size)
    score = torch.zeros(b, heads_kv, t_len, n_blocks, dtype=torch.float64)
    score[..., :nc] = probs.detach().reshape(b, heads_kv, hq // heads_kv, t_len, nc).sum(2)
    t = torch.arange(t_len)
    own = t // block_size
    blocks = torch.arange(n_blocks)
    score = score.masked_fill(blocks[None, :] > own[:, None], float("-inf"))
    score[..., t, own] = float("inf")
    out = torch.full((b, t_len, heads_kv, count), -1, dtype=torch.long)
    for bi in range(b):
        for h in range(heads_kv):
            for ti in range(t_len):
                row = score[bi, h, ti].tolist()
                order = sorted(range(n_blocks), key=lambda c: (-row[c], c))
                chosen = [c for c in order if row[c] != float("-inf")][:count]
                out[bi, ti, h, :len(chosen)] = torch.tensor(chosen)
    return out


def reference_nsa(q, k, v, g_cmp=None, g_slc=None, g_swa=None, block_indices=None, block_counts=16,
                  block_size=64, window_size=0, softmax_scale=None, cu_seqlens=None):
    q, k, v = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs, used = [], []
    for lo, hi in _split(cu_seqlens, q.shape[1]):
        qs, ks, vs = q[:, lo:hi], k[:, lo:hi], v[:, lo:hi]
        o_cmp, probs = _compressed(qs, ks, vs, block_size, scale)
        if block_indices is None:
            assert isinstance(block_counts, int)
            idx = reference_topk(probs, k.shape[2], hi - lo, block_size, block_counts)
            counts = block_counts
        else:
            idx = torch.as_tensor(block_indices)[:, lo:hi]
            counts = block_counts if isinstance(block_counts, int) else torch.as_tensor(block_counts)[:, lo:hi]
        o_slc = _attend(qs, ks, vs, selected_mask(idx, counts, block_size, hi - lo), scale)[0]
        out = torch.zeros_like(o_slc)
        if g_cmp is not None:
            out = out + g_cmp[:, lo:hi, :, None].double() * o_cmp
        if g_slc is not None:
            out = out + g_slc[:, lo:hi, :, None].double() * o_slc
        if g_swa is not None and window_size > 0:
            t = torch.arange(hi - lo)
            d = t[:, None] - t[None, :]
            allowed = ((d >= 0) & (d <= window_size))[None, None].expand(q.shape[0], k.shape[2], -1, -1)
            out = out + g_swa[:, lo:hi, :, None].double() * _attend(qs, ks, vs, allowed, scale)[0]
        outs.append(out)
        used.append(idx)
    return torch.cat(outs, dim=1), torch.cat(used, dim=1)
