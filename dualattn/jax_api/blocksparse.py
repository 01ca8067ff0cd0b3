"""Block-sparse attention for JAX: backend "triton" (the shared kernels) or "xla" (gathers active blocks)."""
from __future__ import annotations

from typing import Optional

from ..options import FlashOptions
from ..masks import resolve_layout
from ..validation import check_flag, check_flash_args
from .flash import _call, _resolve_backend, check_arrays


def blocksparse_attention(query, key, value, *, layout=None, mask_builder=None, block_q: int = 64,
                          block_k: int = 64, causal: bool = False, sliding_window=None, q_segment_ids=None,
                          kv_segment_ids=None, q_positions=None, kv_positions=None, softmax_aux=None,
                          logits_soft_cap: Optional[float] = None, softmax_scale: Optional[float] = None,
                          return_lse: bool = False, backend: str = "auto", deterministic: bool = False):
    """Attention over the active blocks of a layout only; same arguments as the torch front end.

    backend: "triton" (the shared Triton kernels; jax-triton on GPU, the interpreter on CPU),
    "xla" (gathers only the active blocks, never a dense Sq x Sk matrix), or "auto" (triton on
    GPU with jax-triton installed, xla elsewhere).  deterministic: as flash_attention (the triton
    backend's one-pass Hopper backward, which 128 x 128 layouts run, adds dQ with atomics).
    """
    check_arrays(query=query, key=key, value=value, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                 q_positions=q_positions, kv_positions=kv_positions, softmax_aux=softmax_aux)
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_len, heads, head_dim), got shape {tuple(x.shape)}")
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    deterministic = check_flag("deterministic", deterministic)
    b, sq, hq, _ = query.shape
    layout = resolve_layout(layout, mask_builder, batch=b, heads=hq, seqlen_q=sq, seqlen_k=key.shape[1],
                            block_q=block_q, block_k=block_k)
    backend = _resolve_backend(backend, query)
    if backend == "pallas":
        backend = "xla"  # no Pallas block-sparse kernel yet; the xla path runs everywhere
    if backend == "xla":
        from .xla import blocksparse_attention_xla
        shapes = check_flash_args(query, key, value, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                  softmax_aux=softmax_aux)
        options = FlashOptions.build(head_dim=shapes.head_dim, softmax_scale=softmax_scale, causal=causal,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        return blocksparse_attention_xla(query, key, value, layout=layout, options=options,
                                         q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                                         q_positions=q_positions, kv_positions=kv_positions,
                                         softmax_aux=softmax_aux, return_lse=return_lse)
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=q_segment_ids,
                 kv_segment_ids=kv_segment_ids, attention_mask=None, bias=None, dropout_prob=0.0, dropout_seed=None,
                 return_lse=return_lse, backend="triton", sparse=layout, q_positions=q_positions,
                 kv_positions=kv_positions, deterministic=deterministic)
