"""flash_attn_with_kvcache for torch: two torch.library custom ops over the decode kernels.

    dualattn::decode_append   new k / v into the caches in place (rotary on k), rotary on q;
                              mutates_args=(k_cache, v_cache)
    dualattn::decode_attend   split-KV attention (+ the combine) -> (out, lse)

Both have fake implementations, so torch.compile(fullgraph=True) traces a decode step; neither reads
a device value on the host (cache_seqlens, block_table, ... are checked on the host only when they
live there), so a step captures in a CUDA graph.  On CPU the kernels run in Triton's interpreter.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels.launch import sm_count
from . import plan as decode_plan
from .plan import DecodeOptions

Tensor = torch.Tensor


def _launcher():
    # Imported on first use: torch_api re-exports this module, so importing its launcher here at import
    # time would be circular.
    from ..torch_api import _launch
    return _launch


def _sms(device: torch.device) -> int:
    return 0 if device.type == "cpu" else sm_count(device.index)


def _options(d, softmax_scale, window_left, window_right, softcap, rotary_interleaved, num_splits, causal):
    return DecodeOptions(softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap,
                         rotary_interleaved=rotary_interleaved, num_splits=num_splits, causal=causal)


def _interpreted(t: Optional[Tensor]) -> Optional[Tensor]:
    # Triton's interpreter computes bf16 on raw integers (PLATFORM.md): fp32 on CPU, never on the GPU.
    if t is not None and t.device.type == "cpu" and t.dtype == torch.bfloat16:
        return t.float()
    return t


def _append_impl(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rotary_cos: Optional[Tensor],
                 rotary_sin: Optional[Tensor], cache_seqlens: Tensor, cache_batch_idx: Optional[Tensor],
                 block_table: Optional[Tensor], softmax_scale: float, window_left: int, window_right: int,
                 softcap: float, rotary_interleaved: bool, num_splits: int, causal: bool) -> Tensor:
    shapes = decode_plan.check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                    None, block_table, k_strides=k_cache.stride(), v_strides=v_cache.stride())
    options = _options(q.shape[-1], softmax_scale, window_left, window_right, softcap, rotary_interleaved,
                       num_splits, causal)
    launch = decode_plan.plan_append(shapes, options, True)
    widen = k_cache.device.type == "cpu" and k_cache.dtype == torch.bfloat16
    # bf16 on CPU: the interpreter writes fp32 copies of the caches (same strides), copied back exactly.
    kc = torch.empty_strided(k_cache.shape, k_cache.stride(), dtype=torch.float32).copy_(k_cache) if widen else k_cache
    vc = torch.empty_strided(v_cache.shape, v_cache.stride(), dtype=torch.float32).copy_(v_cache) if widen else v_cache
    arrays = dict(q=_interpreted(q.contiguous()), k=_interpreted(k.contiguous()), v=_interpreted(v.contiguous()),
                  rotary_cos=_interpreted(None if rotary_cos is None else rotary_cos.contiguous()),
                  rotary_sin=_interpreted(None if rotary_sin is None else rotary_sin.contiguous()),
                  cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, block_table=block_table)
    res = _launcher().run(launch, arrays, outputs={"k_out": kc, "v_out": vc})
    if widen:
        k_cache.copy_(kc)
        v_cache.copy_(vc)
    if shapes.rotary_dim == 0:
        return q.new_empty(0)
    return res["q_rot"].to(q.dtype)


def _attend_impl(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor],
                 cache_batch_idx: Optional[Tensor], cache_leftpad: Optional[Tensor], block_table: Optional[Tensor],
                 alibi_slopes: Optional[Tensor], softmax_aux: Optional[Tensor], s_new: int, softmax_scale: float,
                 window_left: int, window_right: int, softcap: float, rotary_interleaved: bool, num_splits: int,
                 causal: bool) -> Tuple[Tensor, Tensor]:
    shapes = decode_plan.check_args(q, k_cache, v_cache, None, None, None, None, cache_seqlens, cache_batch_idx,
                                    cache_leftpad, block_table, alibi_slopes, softmax_aux,
                                    k_strides=k_cache.stride(), v_strides=v_cache.stride())
    shapes = decode_plan.dataclasses.replace(shapes, s_new=s_new)
    options = _options(q.shape[-1], softmax_scale, window_left, window_right, softcap, rotary_interleaved,
                       num_splits, causal)
    launch = decode_plan.plan_attend(shapes, options, _sms(q.device))
    arrays = dict(q=_interpreted(q.contiguous()), k_cache=_interpreted(k_cache), v_cache=_interpreted(v_cache),
                  cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                  block_table=block_table, alibi_slopes=alibi_slopes,
                  softmax_aux=None if softmax_aux is None else _interpreted(softmax_aux.contiguous()))
    res = _launcher().run(launch, arrays)
    return res["out"].to(q.dtype), res["lse"]


decode_append = torch.library.custom_op("dualattn::decode_append", mutates_args=("k_cache", "v_cache"),
                                        device_types=("cpu", "cuda"))(_append_impl)
decode_attend = torch.library.custom_op("dualattn::decode_attend", mutates_args=(),
                                        device_types=("cpu", "cuda"))(_attend_impl)


@decode_append.register_fake
def _(q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, *rest):
    return torch.empty_like(q) if rotary_cos is not None else q.new_empty(0)


@decode_attend.register_fake
def _(q, k_cache, v_cache, *rest):
    b, sq, hq, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, hq, sq), dtype=torch.float32)


def _call(op, impl, *args):
    """The custom op while torch.compile traces; in eager mode its implementation, without the op
    dispatch's host time."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


_TENSORS = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
            "cache_leftpad", "block_table", "alibi_slopes", "softmax_aux")


def _host(t) -> Optional[object]:
    """The values of a host-resident index tensor (or an int), for the host's checks; None elsewhere (no sync)."""
    if t is None or isinstance(t, int):
        return t
    return t.numpy() if t.device.type == "cpu" and not torch.compiler.is_compiling() else None


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            softmax_aux=None):
    """Attention of a few new query rows over a KV cache, dense or paged; flash-attn's signature and meaning.

    If k and v are given, they are written into k_cache / v_cache in place at rows cache_seqlens[b] ..
    cache_seqlens[b] + S_new - 1 (rotated by rotary_cos / rotary_sin first, if given), then attended.

    Args:
        q: (B, Sq, Hq, D) fp16 / bf16 / fp32.
        k_cache, v_cache: (B_cache, S_cache, Hkv, D) dense, or (num_pages, page_size, Hkv, D) with
            block_table: logical row r of sequence b lives in page block_table[b, r // page_size],
            row r % page_size.  Any page_size >= 1.  Hq must be a multiple of Hkv (GQA / MQA).
        k, v: (B, S_new, Hkv, D) new rows, or None.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2); k rotated at cache_seqlens + j; q at
            cache_seqlens + i when causal or windowed, else at cache_seqlens.
        cache_seqlens: (B,) int32 or an int: rows already in the cache (None: the whole capacity).
        cache_batch_idx: (B,) int32: the dense cache batch of each sequence.
        cache_leftpad: (B,) int32: the first cache row of each sequence.
        block_table: (B, max_pages) int32.
        softmax_scale: default D ** -0.5.
        causal: bottom-right aligned; query i sits at position cache_seqlens + S_new - Sq + i:
                Sq = 2, 5 keys      1 1 1 1 0
                                    1 1 1 1 1
        window_size: (left, right), -1 unbounded: keys pos - left ..= pos + right.
        softcap: > 0: scores become softcap * tanh(scores / softcap).
        rotary_interleaved: pairs (2i, 2i + 1) if True, else (i, i + rotary_dim / 2) (GPT-NeoX).
        alibi_slopes: (Hq,) or (B, Hq) fp32: - slope * |pos - j| added after the soft cap.
        num_splits: key splits per sequence (0: the plan chooses from the shape and the SM count).
        return_softmax_lse: also return lse (B, Hq, Sq) fp32, natural log, including sinks.
        softmax_aux: sinks, (Hq, n), (Hq,) or (n,): logits in every row's denominator only.

    Returns:
        out (B, Sq, Hq, D) in q's dtype, and lse if return_softmax_lse.  Rows with no visible key give
        out 0 and lse -inf (with sinks: the sinks' log-sum-exp).

    Values the host holds (CPU tensors, ints) are checked (ValueError naming the argument); values on
    the device are not read (no synchronisation) and are clamped in the kernels instead: no load or
    store ever leaves the caches.
    """
    given = dict(zip(_TENSORS, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                cache_leftpad, block_table, alibi_slopes, softmax_aux)))
    for name, t in given.items():
        if t is None or (name == "cache_seqlens" and isinstance(t, int)):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: all tensors must be on one device")
    shapes = decode_plan.check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, block_table, alibi_slopes, softmax_aux,
                                    k_strides=k_cache.stride(), v_strides=v_cache.stride())
    decode_plan.check_values(shapes, _host(cache_seqlens), _host(block_table), _host(cache_batch_idx),
                             _host(cache_leftpad))
    options = DecodeOptions.make(q.shape[-1], softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                 num_splits)
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    statics = (options.softmax_scale, options.window[0], options.window[1], options.softcap,
               options.rotary_interleaved, options.num_splits, options.causal)
    if k is not None:
        q_rot = _call(decode_append, _append_impl, q, k, v, k_cache, v_cache, rotary_cos, rotary_sin, cache_seqlens,
                      cache_batch_idx, block_table, *statics)
        if rotary_cos is not None:
            q = q_rot
    out, lse = _call(decode_attend, _attend_impl, q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                     block_table, None if alibi_slopes is None else alibi_slopes.contiguous(), softmax_aux,
                     shapes.s_new, *statics)
    return (out, lse) if return_softmax_lse else out
