"""torch.nn modules over `dualattn.attention`."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..module import MaskInfo, attention

Tensor = torch.Tensor


class MultiheadAttention(nn.Module):
    """Multi-head attention with q/k/v/o projections over dualattn's kernels (batch first, no rotary).

    Args:
        embed_dim: model width E (the input and output feature size).
        num_heads: query heads Hq.
        num_kv_heads: key/value heads Hkv (GQA / MQA; default Hq); Hq % Hkv == 0.
        head_dim: per-head size D (default E // Hq).
        kdim, vdim: feature sizes of the key / value inputs (cross-attention; default E).
        bias: biases on the four projections.
        causal, sliding_window, logits_soft_cap, softmax_scale: as flash_attention.
        num_sinks: learnable attention sinks per query head (softmax_aux (Hq, n)); 0: none.
        dropout: dropout on the attention probabilities while training.
        algorithm: the dualattn.attention algorithm ("auto", "flash", "blocksparse", ...).

    forward(query (B, Sq, E), key=None (B, Sk, kdim), value=None (B, Sk, vdim), mask_info=None)
    -> (B, Sq, E).  key and value default to query (self-attention).
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 bias: bool = True, causal: bool = False, sliding_window=None, logits_soft_cap: Optional[float] = None,
                 softmax_scale: Optional[float] = None, num_sinks: int = 0, dropout: float = 0.0,
                 algorithm: str = "auto", device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        head_dim = embed_dim // num_heads if head_dim is None else head_dim
        if head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {head_dim} (embed_dim {embed_dim}, num_heads {num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        factory = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.causal, self.sliding_window, self.logits_soft_cap = causal, sliding_window, logits_soft_cap
        self.softmax_scale, self.dropout, self.algorithm = softmax_scale, dropout, algorithm
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(kdim or embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(vdim or embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, num_sinks, **factory)) if num_sinks else None

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None, *,
                mask_info: Optional[MaskInfo] = None) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        b, sq, _ = query.shape
        sk = key.shape[1]
        q = self.q_proj(query).view(b, sq, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(b, sk, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(b, sk, self.num_kv_heads, self.head_dim)
        dropout = self.dropout if self.training else 0.0
        out = attention(q, k, v, algorithm=self.algorithm, mask_info=mask_info, softmax_scale=self.softmax_scale,
                        causal=self.causal, sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                        softmax_aux=self.sinks, dropout_prob=dropout)
        return self.o_proj(out.reshape(b, sq, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, algorithm={self.algorithm!r}")
