"""HF transformers: `register()` adds "dualattn" to transformers.AttentionInterface.

    import dualattn.integrations.transformers as dt_hf
    dt_hf.register()
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="dualattn")

Every model that calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]` (Llama, Qwen, Mistral,
Gemma-2/3, GPT-OSS, ...) then runs dualattn's flash kernels, honouring what the model passes:
    is_causal (else module.is_causal)  -> causal (bottom-right aligned: decoding with a cache works)
    sliding_window w                   -> window (w - 1, 0) when causal, (w - 1, w - 1) otherwise, as HF's
                                          flash-attention path and its masks count it
    softcap                            -> logits_soft_cap;  scaling -> softmax_scale
    s_aux (GPT-OSS sinks)              -> softmax_aux;  dropout -> dropout_prob
    padding                            -> segment ids (MaskInfo.from_padding): the mask function
                                          registered with it is HF's flash-attention one, which hands
                                          over the (B, Sk) padding mask (None without padding), never
                                          an Sq x Sk mask
    packed sequences, batch 1          -> segment ids from position_ids restarting (no mask given)
A 4-D mask (a caller's own, or one another mask function built) is the whole pattern, as eager and
sdpa read it (no causal or window added): bool as a dense attention_mask, float as the additive bias it
is, whatever its values (-1e9, dtype min, -inf, or soft biases).  A query row masked at every key gives
0, as HF's sdpa path gives it (eager averages the values there).  output_attentions=True is rejected:
the kernels never form the attention weights.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..module import MaskInfo, attention

NAME = "dualattn"


def _mask_info(attention_mask: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor,
               position_ids: Optional[torch.Tensor]) -> Tuple[Optional[MaskInfo], Optional[torch.Tensor]]:
    """(mask_info, bias) for one call: padding and packing as segment ids, a 4-D bool mask as a dense
    attention_mask, a 4-D float mask as the additive bias it is (whatever its values)."""
    sq, sk = query.shape[1], key.shape[1]
    if attention_mask is None:
        if position_ids is not None and query.shape[0] == 1 and sq == sk and position_ids.shape[-1] == sq:
            # Packed documents: a document starts where the position does not continue the previous one.
            pos = position_ids.reshape(1, sq)
            starts = torch.ones_like(pos, dtype=torch.int32)
            starts[:, 1:] = (pos[:, 1:] != pos[:, :-1] + 1).to(torch.int32)
            return MaskInfo(q_segment_ids=torch.cumsum(starts, dim=1, dtype=torch.int32)), None
        return None, None
    if attention_mask.dim() == 2:       # (B, Sk) padding, as HF's flash-attention mask function gives it
        return MaskInfo.from_padding(attention_mask[:, -sk:], seqlen_q=sq), None
    if attention_mask.dim() == 4:       # (B or 1, 1 or H, Sq, >= Sk): its first Sk columns, as eager reads it
        mask = attention_mask[..., :sk]
        if mask.dtype == torch.bool:
            return MaskInfo(attention_mask=mask), None
        if not mask.is_floating_point():
            raise TypeError(f"a 4-D attention_mask must be bool (True = attend) or an additive float mask, "
                            f"got {mask.dtype}")
        return None, mask
    raise ValueError(f"attention_mask must be a (batch, kv_len) padding mask or a 4-D mask, got shape "
                     f"{tuple(attention_mask.shape)}")


def dualattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                               value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                               scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                               softcap: Optional[float] = None, is_causal: Optional[bool] = None,
                               s_aux: Optional[torch.Tensor] = None, **kwargs):
    """The AttentionInterface function: query (B, Hq, Sq, D), key/value (B, Hkv, Sk, D) ->
    (out (B, Sq, Hq, D), None)."""
    if kwargs.get("output_attentions", False):
        raise ValueError("attn_implementation='dualattn' does not return attention weights "
                         "(output_attentions=True); use attn_implementation='eager' for them")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    window = None
    if sliding_window is not None and sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else sliding_window - 1)
    if attention_mask is not None and attention_mask.dim() == 4:
        # A 4-D mask is the whole pattern, as eager and sdpa apply it: no causal or window on top.
        causal, window = False, None
    mask_info, bias = _mask_info(attention_mask, q, k, kwargs.get("position_ids"))
    out = attention(q, k, v, algorithm="flash", mask_info=mask_info, softmax_scale=scaling, causal=causal,
                    sliding_window=window, logits_soft_cap=softcap or None, softmax_aux=s_aux, bias=bias,
                    dropout_prob=float(dropout) if module.training else 0.0)
    return out, None


def register(name: str = NAME) -> str:
    """Register dualattn with transformers' AttentionInterface and AttentionMaskInterface under `name`
    (idempotent); returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    AttentionInterface.register(name, dualattn_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
