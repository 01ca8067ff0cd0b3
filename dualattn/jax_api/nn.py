"""Drop-ins for jax.nn and Flax: `dot_product_attention` (jax.nn's signature) and `make_attention_fn` /
`attention_fn` (Flax's attention_fn convention, for flax.linen.MultiHeadDotProductAttention and
flax.nnx.MultiHeadAttention).  Both run `jax_api.flash_attention`: fused, never an N x T x S
weights array, GQA without repeating K/V.
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp

from ..module import MaskInfo
from .flash import flash_attention

_IMPLEMENTATIONS = {None: "auto", "xla": "xla", "triton": "triton", "pallas": "pallas"}


def _window(seqlen_q: int, seqlen_k: int, is_causal: bool, local_window_size):
    """jax.nn's top-left-aligned (causal, local window) as flash_attention's bottom-right window
    (left, right), or None when a side would be negative (then a dense mask says it)."""
    if local_window_size is None:
        left, right = None, None
    elif isinstance(local_window_size, int):
        left, right = local_window_size, local_window_size
    else:
        left, right = local_window_size
    if is_causal:
        right = 0 if right is None else min(right, 0)
    shift = seqlen_k - seqlen_q      # top-left: query i at key position i; bottom-right: i + shift
    left = None if left is None else left + shift
    right = None if right is None else right - shift
    if left is not None and left < 0 or right is not None and right < 0:
        return None
    return left, right


def _dense_window_mask(seqlen_q: int, seqlen_k: int, is_causal: bool, local_window_size):
    i, j = jnp.arange(seqlen_q)[:, None], jnp.arange(seqlen_k)[None, :]
    ok = jnp.ones((seqlen_q, seqlen_k), bool)
    if local_window_size is not None:
        left, right = (local_window_size,) * 2 if isinstance(local_window_size, int) else local_window_size
        ok &= (j >= i - left) & (j <= i + right)
    if is_causal:
        ok &= j <= i
    return ok[None, None]


def _broadcast4(x, batch: int, heads: int, seqlen_q: int, seqlen_k: int, name: str):
    """A 4-D (B|1, N|1, T|1, S|1) mask or bias broadcast over T and S (the kernels take B and N as 1)."""
    x = jnp.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D, broadcastable to (B, N, T, S) = {(batch, heads, seqlen_q, seqlen_k)}, "
                         f"got shape {x.shape}")
    for dim, (have, want) in enumerate(zip(x.shape, (batch, heads, seqlen_q, seqlen_k))):
        if have not in (1, want):
            raise ValueError(f"{name} of shape {x.shape} does not broadcast to (B, N, T, S) = "
                             f"{(batch, heads, seqlen_q, seqlen_k)} (dim {dim})")
    return jnp.broadcast_to(x, x.shape[:2] + (seqlen_q, seqlen_k))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: Optional[float] = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual: bool = False):
    """jax.nn.dot_product_attention with the same signature and meaning, on dualattn's kernels.

    Args:
        query (B, T, N, H) or (T, N, H); key/value (B, S, K, H) or (S, K, H), N % K == 0.
        bias, mask: 4-D, broadcastable to (B, N, T, S); mask True = attend.
        scale: default H ** -0.5.  is_causal: top-left aligned, as jax.nn (j <= i).
        query_seq_lengths, key_value_seq_lengths: int (B,) valid lengths (right padding); padded
            query rows give zeros (jax's xla implementation gives the mean of the values there).
        local_window_size: int w or (left, right) around j = i, as jax.nn.
        implementation: None (dualattn's choice: triton on GPU, xla on CPU, pallas on TPU), "xla",
            "triton" or "pallas"; "cudnn" is jax's own and is rejected here.
        return_residual: also return the log-sum-exp, (B, T, N) float32.
    """
    if implementation not in _IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {sorted(k for k in _IMPLEMENTATIONS if k)} or None, got "
                         f"{implementation!r} (for cuDNN call jax.nn.dot_product_attention itself)")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    unbatched = query.ndim == 3
    if unbatched:
        if key.ndim != 3 or value.ndim != 3:
            raise ValueError(f"query is (T, N, H): key and value must be (S, K, H), got {key.shape}, {value.shape}")
        query, key, value = query[None], key[None], value[None]
    batch, seqlen_q, heads, _ = query.shape
    seqlen_k = key.shape[1]
    window = _window(seqlen_q, seqlen_k, is_causal, local_window_size)
    if window is None:   # not expressible around the bottom-right diagonal: a dense (T, S) mask
        extra = _dense_window_mask(seqlen_q, seqlen_k, is_causal, local_window_size)
        mask = extra if mask is None else jnp.logical_and(jnp.asarray(mask, bool), extra)
        window = (None, None)
    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = _broadcast4(mask, batch, heads, seqlen_q, seqlen_k, "mask")
    if bias is not None:
        kwargs["bias"] = _broadcast4(bias, batch, heads, seqlen_q, seqlen_k, "bias")
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
        q_len = jnp.full((batch,), seqlen_q, jnp.int32) if query_seq_lengths is None else query_seq_lengths
        kv_len = jnp.full((batch,), seqlen_k, jnp.int32) if key_value_seq_lengths is None else key_value_seq_lengths
        info = MaskInfo.from_lengths(q_len, kv_len, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        kwargs.update(q_segment_ids=info.q_segment_ids, kv_segment_ids=info.kv_segment_ids)
    result = flash_attention(query, key, value, softmax_scale=scale, sliding_window=window,
                             return_lse=return_residual, backend=_IMPLEMENTATIONS[implementation], **kwargs)
    if return_residual:
        out, lse = result
        lse = jnp.swapaxes(lse, 1, 2)     # (B, N, T) -> jax.nn's (B, T, N)
        return (out[0], lse[0]) if unbatched else (out, lse)
    return result[0] if unbatched else result


def make_attention_fn(*, backend: str = "auto", is_causal: bool = False, sliding_window=None,
                      logits_soft_cap: Optional[float] = None):
    """An `attention_fn` for flax.linen.MultiHeadDotProductAttention / flax.nnx.MultiHeadAttention.

    The returned function takes Flax's arguments: query (batch..., T, N, H), key/value (batch..., S, K, H)
    (GQA: K may divide N), bias / mask broadcastable to (batch..., N, T, S), dropout_rng, dropout_rate,
    broadcast_dropout, deterministic, dtype, precision, module, is_causal.  It honours: mask, bias,
    dropout (the kernels' counter-based mask, seeded from dropout_rng; needs broadcast_dropout=False,
    since the kernels draw one mask per (batch, head)), dtype (the inputs are cast to it), is_causal
    (nnx; or the factory's is_causal), precision None / DEFAULT / HIGHEST (accumulation is fp32 in
    every backend; HIGHEST is passed to the xla backend's dots).  It rejects sow_weights (module=) and
    custom einsums: the kernels never form the attention weights.
    """
    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                     dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None,
                     module=None, is_causal: bool = False, force_fp32_for_softmax: bool = False,
                     qk_attn_weights_einsum=None, attn_weights_value_einsum=None):
        if module is not None:
            raise ValueError("dualattn's attention_fn cannot sow attention weights (sow_weights=True): the kernels "
                             "never form them; use flax's dot_product_attention for that call")
        if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
            raise ValueError("dualattn's attention_fn takes no custom einsums (qk_attn_weights_einsum, "
                             "attn_weights_value_einsum): the kernels fuse both products")
        xla_options = None
        if precision is not None:
            name = str(getattr(precision, "name", precision)).upper()
            if name not in ("DEFAULT", "HIGHEST", "FLOAT32"):
                raise ValueError(f"precision {precision!r} is not supported: dualattn accumulates in fp32; pass None, "
                                 "DEFAULT or HIGHEST")
            if name != "DEFAULT":
                xla_options = {"precision": jax.lax.Precision.HIGHEST}
        if dtype is not None:
            query, key, value = (x.astype(dtype) for x in (query, key, value))
        batch_dims = query.shape[:-3]
        flat = int(math.prod(batch_dims))

        def flatten(x):
            return None if x is None else jnp.reshape(x, (flat,) + x.shape[len(batch_dims):])

        def flatten_broadcast(x):
            """(batch..., N|1, T|1, S|1), leading dims broadcastable, as (flat|1, N|1, T|1, S|1)."""
            if x is None:
                return None
            x = jnp.asarray(x)
            x = jnp.reshape(x, (1,) * (len(batch_dims) + 3 - x.ndim) + x.shape)   # Flax broadcasting
            if all(d == 1 for d in x.shape[:len(batch_dims)]):
                return jnp.reshape(x, (1,) + x.shape[len(batch_dims):])
            x = jnp.broadcast_to(x, batch_dims + x.shape[len(batch_dims):])
            return jnp.reshape(x, (flat,) + x.shape[len(batch_dims):])

        q, k, v = flatten(query), flatten(key), flatten(value)
        seqlen_q, heads, seqlen_k = q.shape[1], q.shape[2], k.shape[1]
        kwargs = {}
        if mask is not None:   # Flax masks are often float 0/1: nonzero attends
            mask = jnp.asarray(mask)
            mask = mask if mask.dtype == jnp.bool_ else mask != 0
            kwargs["attention_mask"] = _broadcast4(flatten_broadcast(mask), q.shape[0], heads, seqlen_q,
                                                   seqlen_k, "mask")
        if bias is not None:
            kwargs["bias"] = _broadcast4(flatten_broadcast(bias), q.shape[0], heads, seqlen_q, seqlen_k,
                                         "bias")
        if not deterministic and dropout_rate > 0.0:
            if broadcast_dropout:
                raise ValueError("dualattn draws an independent dropout mask per (batch, head); construct the "
                                 "attention module with broadcast_dropout=False")
            if dropout_rng is None:
                raise ValueError("dropout_rate > 0 with deterministic=False needs dropout_rng")
            kwargs.update(dropout_prob=float(dropout_rate),
                          dropout_seed=jax.random.randint(dropout_rng, (), 0, 2 ** 31 - 1, jnp.int32))
        causal = bool(is_causal or factory_causal)
        if causal and seqlen_q != seqlen_k:
            raise ValueError(f"is_causal with T={seqlen_q} != S={seqlen_k}: Flax's causal mask is top-left aligned, "
                             "dualattn's bottom-right; pass an explicit mask")
        # (triton and pallas run full-precision dots with fp32 accumulation: HIGHEST needs nothing there)
        out = flash_attention(q, k, v, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                              backend=backend, xla_options=xla_options if _resolved(backend) == "xla" else None,
                              **kwargs)
        return jnp.reshape(out, batch_dims + out.shape[1:])

    factory_causal = is_causal
    return attention_fn


def _resolved(backend: str) -> str:
    from .flash import _resolve_backend
    return _resolve_backend(backend)


attention_fn = make_attention_fn()
