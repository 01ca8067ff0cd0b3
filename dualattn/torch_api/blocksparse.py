"""Block-sparse attention for torch: the shared flash kernels walking a SparseMask's block lists."""
from __future__ import annotations

from typing import Optional

import torch

from ..masks import resolve_layout
from .flash import _call

Tensor = torch.Tensor


def blocksparse_attention(query: Tensor, key: Tensor, value: Tensor, *, layout=None, mask_builder=None,
                          block_q: int = 64, block_k: int = 64, causal: bool = False, sliding_window=None,
                          q_segment_ids: Optional[Tensor] = None, kv_segment_ids: Optional[Tensor] = None,
                          q_positions: Optional[Tensor] = None, kv_positions: Optional[Tensor] = None,
                          softmax_aux: Optional[Tensor] = None, logits_soft_cap: Optional[float] = None,
                          softmax_scale: Optional[float] = None, return_lse: bool = False,
                          deterministic: bool = False):
    """Attention over the active blocks of a layout only (BSHD, forward and backward).

    Args:
        layout: a dualattn.SparseMask (block map (B|1, H|1, ceil(Sq/block_q), ceil(Sk/block_k))),
            or mask_builder: a dualattn.masks builder (causal(), local(w), document(ids), ... | &)
            or any callable (batch, heads, Sq, Sk, block_q, block_k) -> block map.
        causal, sliding_window, q/kv_segment_ids: token-level rules applied inside active blocks;
        q_positions (B, Sq) / kv_positions (B, Sk): the positions the window compares (default
            i + Sk - Sq and j), e.g. global positions of a shard.
        softmax_aux, logits_soft_cap, softmax_scale, return_lse, deterministic: as flash_attention (128 x 128
            layouts on the H100 run the one-pass backward, whose dQ atomics vary in order run to run).
    The result equals dense attention under the token mask the layout and the rules imply.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(t.shape)}")
    b, sq, hq, _ = query.shape
    layout = resolve_layout(layout, mask_builder, batch=b, heads=hq, seqlen_q=sq, seqlen_k=key.shape[1],
                            block_q=block_q, block_k=block_k)
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=q_segment_ids,
                 kv_segment_ids=kv_segment_ids, attention_mask=None, bias=None, dropout_prob=0.0,
                 dropout_seed=None, return_lse=return_lse, sparse=layout, q_positions=q_positions,
                 kv_positions=kv_positions, deterministic=deterministic)
