"""flash_attn_with_kvcache for JAX, functional: the updated caches are returned, not written in place.

backend="triton": the decode kernels (GPU: jax-triton; CPU: Triton's interpreter in a pure_callback),
from the same Launch plans as torch, so both frameworks compute the same bits.  The new rows reach the
caches through an XLA scatter (`.at[outer, inner].set`), which under `jit` with donated caches updates
them in place: no copy of the cache per step.  backend="xla": the same semantics in plain jnp.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels.launch import sm_count
from . import plan as decode_plan
from .plan import DecodeOptions, DecodeShapes

BACKENDS = ("triton", "xla")
_INPUT_NAMES = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx",
                "cache_leftpad", "block_table", "alibi_slopes", "softmax_aux")


def _on_gpu(x) -> bool:
    try:
        return all(d.platform == "gpu" for d in x.devices())
    except Exception:   # a tracer: where computations go by default
        return jax.default_backend() == "gpu"


def _host(x):
    """The values of x where the host holds them without a device transfer (ints, NumPy, concrete CPU
    arrays); None otherwise, leaving the check to the kernels' clamps."""
    if x is None or isinstance(x, (int, np.integer, np.ndarray)):
        return x
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x) if all(d.platform == "cpu" for d in x.devices()) else None
    except Exception:
        return None


def _rotated(x, cos, sin, positions, interleaved: bool):
    """x (B, S, H, D) rotated at positions (B, S) over the first 2 * cos.shape[1] dims, in fp32."""
    half = cos.shape[1]
    positions = jnp.clip(positions, 0, cos.shape[0] - 1)
    c = cos.astype(jnp.float32)[positions][:, :, None, :]
    s = sin.astype(jnp.float32)[positions][:, :, None, :]
    xf = x.astype(jnp.float32)
    rot, rest = xf[..., :2 * half], xf[..., 2 * half:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = jnp.stack([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).reshape(rot.shape)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1)
    return jnp.concatenate([rot, rest], axis=-1).astype(x.dtype)


def _kv_bounds(shapes: DecodeShapes, seqlens, leftpad):
    """(rows cached, keys, first key) per sequence, clamped as the kernels clamp (decode_rows.py)."""
    b = shapes.batch
    if seqlens is None:
        n = jnp.full((b,), shapes.capacity - shapes.s_new, jnp.int32)
    else:
        n = jnp.clip(jnp.asarray(seqlens, jnp.int32), 0, shapes.capacity)
    kv_len = jnp.minimum(n + shapes.s_new, shapes.capacity)
    first = jnp.zeros((b,), jnp.int32) if leftpad is None else jnp.clip(leftpad, 0, kv_len)
    return n, kv_len, first


def _attend_xla(shapes: DecodeShapes, options: DecodeOptions, q, k_cache, v_cache, seqlens, batch_idx, leftpad,
                block_table, alibi, sinks):
    s = shapes
    g = s.hq // s.hkv
    if s.paged:
        pages = jnp.clip(block_table, 0, s.num_pages - 1)
        keys = k_cache[pages].reshape(s.batch, s.capacity, s.hkv, s.d)
        values = v_cache[pages].reshape(s.batch, s.capacity, s.hkv, s.d)
    else:
        rows = jnp.arange(s.batch) if batch_idx is None else jnp.clip(batch_idx, 0, s.b_cache - 1)
        keys, values = k_cache[rows], v_cache[rows]
    _, kv_len, first = _kv_bounds(s, seqlens, leftpad)
    qg = q.astype(jnp.float32).reshape(s.batch, s.sq, s.hkv, g, s.d)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, keys.astype(jnp.float32)) * options.softmax_scale
    if options.softcap > 0:
        scores = options.softcap * jnp.tanh(scores / options.softcap)
    pos = (kv_len[:, None] - s.sq + jnp.arange(s.sq)[None, :])[:, None, None, :, None]   # (B, 1, 1, Sq, 1)
    cols = jnp.arange(s.capacity)[None, None, None, None, :]
    if alibi is not None:
        slopes = jnp.broadcast_to(alibi.astype(jnp.float32), (s.batch, s.hq)).reshape(s.batch, s.hkv, g, 1, 1)
        scores = scores - slopes * jnp.abs(pos - cols).astype(jnp.float32)
    visible = (cols < kv_len[:, None, None, None, None]) & (cols >= first[:, None, None, None, None])
    left, right = options.window
    if left >= 0:
        visible &= cols >= pos - left
    if right >= 0:
        visible &= cols <= pos + right
    scores = jnp.where(visible, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1)
    if sinks is not None:
        sk = sinks.astype(jnp.float32).reshape(s.hq, -1) if (sinks.ndim == 2 or sinks.shape[0] == s.hq) else \
            jnp.broadcast_to(sinks.astype(jnp.float32), (s.hq, sinks.shape[0]))
        sk = sk.reshape(1, s.hkv, g, 1, -1)
        top = jnp.maximum(top, jnp.max(sk, axis=-1))
    safe = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(scores - safe[..., None])
    total = jnp.sum(p, axis=-1)
    if sinks is not None:
        total = total + jnp.sum(jnp.exp(sk - safe[..., None]), axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p, values.astype(jnp.float32))
    denom = jnp.where(total > 0, total, 1.0)
    out = out / jnp.moveaxis(denom, 3, 1)[..., None]
    lse = jnp.where(total > 0, safe + jnp.log(denom), -jnp.inf)
    return out.reshape(s.batch, s.sq, s.hq, s.d).astype(q.dtype), lse.reshape(s.batch, s.hq, s.sq)


def _launcher():
    # Imported on first use: jax_api re-exports this module, so importing its launcher here at import
    # time would be circular.
    from ..jax_api import _launch
    return _launch


def _sms(x) -> int:
    return sm_count(0) if _on_gpu(x) else 0


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False,
                            softmax_aux=None, backend="triton"):
    """Attention of a few new query rows over a KV cache, dense or paged; flash-attn's arguments and
    meaning (dualattn.torch_api.flash_attn_with_kvcache documents each), functional.

    Returns out (B, Sq, Hq, D) [, lse (B, Hq, Sq) fp32 if return_softmax_lse], then, when k / v are
    given, the updated k_cache and v_cache:

        out, k_cache, v_cache = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=n)

    Under jax.jit with the caches donated (donate_argnums) the update happens in place.
    backend: "triton" (the shared kernels) or "xla" (plain jnp).  Values the host holds (ints, NumPy,
    concrete CPU arrays) are checked; traced or device values are clamped in the kernels."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    given = dict(zip(_INPUT_NAMES, (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                    cache_leftpad, block_table, alibi_slopes, softmax_aux)))
    for name, x in given.items():
        if x is not None and not (name == "cache_seqlens" and isinstance(x, (int, np.integer))) \
                and not hasattr(x, "shape"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    shapes = decode_plan.check_args(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                                    cache_leftpad, block_table, alibi_slopes, softmax_aux)
    decode_plan.check_values(shapes, _host(cache_seqlens), _host(block_table), _host(cache_batch_idx),
                             _host(cache_leftpad))
    options = DecodeOptions.make(q.shape[-1], softmax_scale, causal, window_size, softcap, rotary_interleaved,
                                 num_splits)
    batch = q.shape[0]
    if isinstance(cache_seqlens, (int, np.integer)):
        cache_seqlens = jnp.full((batch,), int(cache_seqlens), jnp.int32)
    arrays = {n: (None if x is None else jnp.asarray(x)) for n, x in given.items()}
    arrays["cache_seqlens"] = cache_seqlens if cache_seqlens is None else jnp.asarray(cache_seqlens)
    if k is not None:
        k_rows = arrays["k"]
        if shapes.rotary_dim:
            if backend == "triton":
                res = _launcher().run(decode_plan.plan_append(shapes, options, False),
                                  {n: arrays[n] for n in decode_plan.APPEND_INPUTS if arrays[n] is not None})
                arrays["q"], k_rows = res["q_rot"], res["k_out"]
            else:
                n = jnp.clip(arrays["cache_seqlens"], 0, shapes.capacity)[:, None]
                q_pos = n + (jnp.arange(shapes.sq)[None, :] if options.local else 0) * jnp.ones((1, shapes.sq), jnp.int32)
                k_pos = n + jnp.arange(shapes.s_new)[None, :]
                arrays["q"] = _rotated(arrays["q"], arrays["rotary_cos"], arrays["rotary_sin"], q_pos,
                                       options.rotary_interleaved)
                k_rows = _rotated(k_rows, arrays["rotary_cos"], arrays["rotary_sin"], k_pos, options.rotary_interleaved)
        outer, inner = decode_plan.append_rows(shapes, arrays["cache_seqlens"], arrays["block_table"],
                                               arrays["cache_batch_idx"], xp=jnp)
        arrays["k_cache"] = arrays["k_cache"].at[outer, inner].set(k_rows.astype(k_cache.dtype), mode="drop")
        arrays["v_cache"] = arrays["v_cache"].at[outer, inner].set(arrays["v"].astype(v_cache.dtype), mode="drop")
    if backend == "triton":
        attend_shapes = dataclasses.replace(shapes, rotary_dim=0, seqlen_ro=0)
        launch = decode_plan.plan_attend(attend_shapes, options, _sms(arrays["q"]))
        res = _launcher().run(launch, {n: arrays[n] for n in decode_plan.ATTEND_INPUTS if arrays[n] is not None})
        out, lse = res["out"], res["lse"]
    else:
        out, lse = _attend_xla(shapes, options, arrays["q"], arrays["k_cache"], arrays["v_cache"],
                               arrays["cache_seqlens"], arrays["cache_batch_idx"], arrays["cache_leftpad"],
                               arrays["block_table"], arrays["alibi_slopes"], arrays["softmax_aux"])
    result = (out, lse) if return_softmax_lse else (out,)
    if k is not None:
        result += (arrays["k_cache"], arrays["v_cache"])
    return result[0] if len(result) == 1 else result
