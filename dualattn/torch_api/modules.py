"""torch.nn modules over `dualattn.attention`."""
from __future__ import annotations

import numbers
from typing import Optional

import torch
from torch import nn

from ..module import Attention, MaskInfo, attention
from ..options import FlashOptions
from ..validation import check_flag

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

    forward(query (B, Sq, E) or unbatched (Sq, E), key=None (B, Sk, kdim), value=None (B, Sk, vdim),
    mask_info=None) -> (B, Sq, E) (unbatched: (Sq, E)).  key and value default to query (self-attention).

    The constructor checks what torch.nn.MultiheadAttention checks (positive sizes, embed_dim divisible
    by num_heads unless head_dim is given) and every other option, raising ValueError / TypeError
    naming the argument; forward checks the inputs' ranks and feature sizes the same way.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, kdim: Optional[int] = None, vdim: Optional[int] = None,
                 bias: bool = True, causal: bool = False, sliding_window=None, logits_soft_cap: Optional[float] = None,
                 softmax_scale: Optional[float] = None, num_sinks: int = 0, dropout: float = 0.0,
                 algorithm: str = "auto", device=None, dtype=None):
        super().__init__()
        sizes = dict(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     kdim=kdim, vdim=vdim, num_sinks=num_sinks)
        for name, size in sizes.items():
            if size is not None and (isinstance(size, bool) or not isinstance(size, numbers.Integral)):
                raise TypeError(f"{name} must be an int, got {type(size).__name__} {size!r}")
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} and "
                             f"num_heads={num_heads} instead")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        if head_dim is None:
            if embed_dim % num_heads:
                raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads}), or give "
                                 "head_dim explicitly")
            head_dim = embed_dim // num_heads
        for name, size in (("head_dim", head_dim), ("kdim", kdim), ("vdim", vdim)):
            if size is not None and size <= 0:
                raise ValueError(f"{name} must be greater than 0, got {size}")
        if num_sinks < 0:
            raise ValueError(f"num_sinks must be >= 0, got {num_sinks}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be a float in [0, 1), got {dropout!r}")
        bias, causal = check_flag("bias", bias), check_flag("causal", causal)
        # The options mean what they mean in flash_attention: bad ones raise here, not at the first forward.
        FlashOptions.build(head_dim=head_dim, softmax_scale=softmax_scale, causal=causal,
                           sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        Attention(algorithm)   # raises ValueError for an algorithm nothing registers
        factory = dict(device=device, dtype=dtype)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.causal, self.sliding_window, self.logits_soft_cap = causal, sliding_window, logits_soft_cap
        self.softmax_scale, self.dropout, self.algorithm = softmax_scale, dropout, algorithm
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(self.kdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(self.vdim, num_kv_heads * head_dim, bias=bias, **factory)
        self.o_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.sinks = nn.Parameter(torch.zeros(num_heads, num_sinks, **factory)) if num_sinks else None

    def _check_inputs(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        for name, t, width, size in (("query", query, self.embed_dim, "embed_dim"), ("key", key, self.kdim, "kdim"),
                                     ("value", value, self.vdim, "vdim")):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() not in (2, 3):
                raise ValueError(f"{name} must be 3-D (batch, seq_len, features) or 2-D unbatched (seq_len, "
                                 f"features), got shape {tuple(t.shape)}")
            if t.dim() != query.dim():
                raise ValueError(f"{name} must be {query.dim()}-D like query (batched and unbatched inputs do not "
                                 f"mix), got shape {tuple(t.shape)}")
            if t.shape[-1] != width:
                raise ValueError(f"{name} must have {size}={width} features in its last dim, got shape "
                                 f"{tuple(t.shape)}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree in all but the "
                             "last dim")
        if query.dim() == 3 and key.shape[0] != query.shape[0]:
            raise ValueError(f"key batch {key.shape[0]} must equal query batch {query.shape[0]}")

    def forward(self, query: Tensor, key: Optional[Tensor] = None, value: Optional[Tensor] = None, *,
                mask_info: Optional[MaskInfo] = None) -> Tensor:
        key = query if key is None else key
        value = key if value is None else value
        self._check_inputs(query, key, value)
        unbatched = query.dim() == 2
        if unbatched:   # as torch.nn.MultiheadAttention: (S, E) is one sequence
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        b, sq, _ = query.shape
        sk = key.shape[1]
        q = self.q_proj(query).view(b, sq, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(b, sk, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(b, sk, self.num_kv_heads, self.head_dim)
        dropout = self.dropout if self.training else 0.0
        out = attention(q, k, v, algorithm=self.algorithm, mask_info=mask_info, softmax_scale=self.softmax_scale,
                        causal=self.causal, sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap,
                        softmax_aux=self.sinks, dropout_prob=dropout)
        out = self.o_proj(out.reshape(b, sq, self.num_heads * self.head_dim))
        return out.squeeze(0) if unbatched else out

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}, algorithm={self.algorithm!r}")
