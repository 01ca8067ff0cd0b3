"""Drop-ins for jax.nn and Flax: `dot_product_attention` (jax.nn's signature, result and errors) and
`make_attention_fn` / `attention_fn` (Flax's attention_fn convention, for
flax.linen.MultiHeadDotProductAttention and flax.nnx.MultiHeadAttention).

Both run `jax_api.flash_attention` (fused, never an N x T x S weights array, GQA without repeating
K/V) where the kernels can take the call, and otherwise the very computation they replace: jax's own
`jax.nn.dot_product_attention`, Flax's own `dot_product_attention`.  Where the kernels run, the result
is still the replaced function's:

    jax.nn / Flax semantics            flash_attention's              what the drop-ins do
    causal, window: top-left (j <= i)  bottom-right (j <= i + S - T)  shift the window, or a dense mask
    fully masked row: mean of values   zeros                          mean(v) on those rows
    residual: key dtype, no gradient   float32, differentiable        cast and stop_gradient
"""
from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..module import MaskInfo
from ..validation import MAX_HEAD_DIM, MIN_HEAD_DIM
from .flash import _resolve_backend, flash_attention

# jax's own function, captured when dualattn is imported: the exact computation for the calls the
# kernels cannot take, still jax's where jax.nn.dot_product_attention is patched to this module's.
_jax_attention = jax.nn.dot_product_attention

_IMPLEMENTATIONS = {None: "auto", "xla": "xla", "triton": "triton", "pallas": "pallas"}
_KERNEL_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
# jax.nn's fill for masked logits (-0.7 x float32's max); the lse of a fully masked row is this.
_LARGE_NEGATIVE = -0.7 * float(np.finfo(np.float32).max)


def _kernels_take(dtype, head_dim: int, head_dim_v: int) -> bool:
    return (jnp.dtype(dtype) in [jnp.dtype(d) for d in _KERNEL_DTYPES]
            and MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and MIN_HEAD_DIM <= head_dim_v <= MAX_HEAD_DIM)


def _window_sides(is_causal: bool, local_window_size):
    """(left, right) of jax.nn's top-left band i - left <= j <= i + right (None: unbounded)."""
    if local_window_size is None:
        left, right = None, None
    elif isinstance(local_window_size, (int, np.integer)):
        left, right = int(local_window_size), int(local_window_size)
    else:
        left, right = (int(w) for w in local_window_size)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _bottom_right_window(seqlen_q: int, seqlen_k: int, left, right):
    """The top-left band (left, right) as flash_attention's bottom-right window, or None when a side
    would be negative (then a dense mask says it)."""
    shift = seqlen_k - seqlen_q      # top-left: query i at key position i; bottom-right: i + shift
    left = None if left is None else left + shift
    right = None if right is None else right - shift
    if left is not None and left < 0 or right is not None and right < 0:
        return None
    return left, right


def _band_mask(seqlen_q: int, seqlen_k: int, left, right):
    """(T, S) bool: the top-left band i - left <= j <= i + right."""
    i, j = jnp.arange(seqlen_q)[:, None], jnp.arange(seqlen_k)[None, :]
    ok = jnp.ones((seqlen_q, seqlen_k), bool)
    if left is not None:
        ok &= j >= i - left
    if right is not None:
        ok &= j <= i + right
    return ok


def _band_kwargs(seqlen_q: int, seqlen_k: int, left, right, mask):
    """flash_attention's sliding_window for the top-left band, and the mask with the band folded in
    where the band has no bottom-right form."""
    window = _bottom_right_window(seqlen_q, seqlen_k, left, right)
    if window is None:
        band = _band_mask(seqlen_q, seqlen_k, left, right)[None, None]
        return (None, None), band if mask is None else jnp.logical_and(mask, band)
    return window, mask


def _empty_rows(seqlen_q: int, seqlen_k: int, left, right, mask=None, q_lengths=None, kv_lengths=None):
    """(B|1, N|1, T) bool: the query rows that may attend no key under the band, the 4-D mask and the
    lengths; None when no row can be empty (known without looking at any array)."""
    if mask is None and q_lengths is None and kv_lengths is None:
        i = np.arange(seqlen_q)
        lo = np.maximum(i - left if left is not None else 0, 0)
        hi = np.minimum(i + right if right is not None else seqlen_k - 1, seqlen_k - 1)
        if not (lo > hi).any():
            return None
        return jnp.asarray(lo > hi)[None, None]
    ok = _band_mask(seqlen_q, seqlen_k, left, right)[None, None]           # [1, 1, T, S]
    if mask is not None:
        ok = ok & mask
    if kv_lengths is not None:
        ok = ok & (jnp.arange(seqlen_k)[None, :] < kv_lengths[:, None])[:, None, None, :]
    if q_lengths is not None:
        ok = ok & (jnp.arange(seqlen_q)[None, :] < q_lengths[:, None])[:, None, :, None]
    return ~ok.any(axis=-1)


def _mean_rows(out, value, empty):
    """out with each empty row (B|1, N|1, T) replaced by the mean of the values of its KV head: what a
    softmax over uniformly masked logits gives (jax.nn, Flax); the gradient goes to value only."""
    batch, seqlen_q, heads, _ = out.shape
    mean = jnp.mean(value.astype(jnp.float32), axis=1)                        # [B, K, Dv]
    mean = jnp.repeat(mean, heads // value.shape[2], axis=1)[:, None].astype(out.dtype)   # [B, 1, N, Dv]
    return jnp.where(jnp.swapaxes(empty, 1, 2)[..., None], mean, out)


def _ensure_4d(x):
    x = jnp.asarray(x)
    return jnp.reshape(x, (1,) * (4 - x.ndim) + x.shape) if x.ndim < 4 else x


def _check_shape_dtype(x, shape, dtype, name: str) -> None:
    """jax.nn's checks, naming the argument as the user passed it."""
    if x is None:
        return
    if x.ndim != len(shape):
        raise ValueError(f"{name} must have {len(shape)} dims, got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise ValueError(f"{name} dtype must be {jnp.dtype(dtype).name}, got {x.dtype}")
    if any(want != -1 and have != want for have, want in zip(x.shape, shape)):
        raise ValueError(f"{name} shape must be {tuple(shape)} (-1: any), got {tuple(x.shape)}")


def _broadcast4(x, batch: int, heads: int, seqlen_q: int, seqlen_k: int, name: str):
    """A 4-D (B|1, N|1, T|1, S|1) mask or bias broadcast over T and S (the kernels take B and N as 1)."""
    for dim, (have, want) in enumerate(zip(x.shape, (batch, heads, seqlen_q, seqlen_k))):
        if have not in (1, want):
            raise ValueError(f"{name} of shape {tuple(x.shape)} does not broadcast to (B, N, T, S) = "
                             f"{(batch, heads, seqlen_q, seqlen_k)} (dim {dim})")
    return jnp.broadcast_to(x, x.shape[:2] + (seqlen_q, seqlen_k))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: Optional[float] = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size=None, implementation=None, return_residual: bool = False):
    """jax.nn.dot_product_attention with the same signature, result, gradients and errors.

    Args:
        query (B, T, N, H) or (T, N, H); key/value (B, S, K, H) or (S, K, H), N % K == 0, one dtype.
        bias, mask: rank <= 4 (leading dims added), broadcastable to (B, N, T, S); mask bool, True =
            attend.  A row no key may attend gives the mean of the values, as jax.nn.
        scale: default H ** -0.5.  is_causal: top-left aligned, as jax.nn (j <= i).
        query_seq_lengths, key_value_seq_lengths: int32 (B,) valid lengths (right padding); padded
            query rows give zeros, as jax.nn.
        local_window_size: int w or (left, right): query i attends i - left <= j <= i + right.
        implementation: None (dualattn's choice: triton on GPU, xla on CPU, pallas on TPU), "xla",
            "triton", "pallas" (dualattn's backends), or "cudnn" (jax's own cuDNN call).
        return_residual: also return the log-sum-exp (B, T, N) in the key's dtype, without gradient.

    Float64 inputs and head dims outside 16..256, which the kernels do not take, run jax's own XLA
    implementation.
    """
    if implementation not in _IMPLEMENTATIONS and implementation != "cudnn":
        raise ValueError(f"implementation must be one of {sorted(k for k in _IMPLEMENTATIONS if k) + ['cudnn']} "
                         f"or None, got {implementation!r}")
    call = dict(bias=bias, mask=mask, scale=scale, is_causal=is_causal, query_seq_lengths=query_seq_lengths,
                key_value_seq_lengths=key_value_seq_lengths, local_window_size=local_window_size,
                return_residual=return_residual)
    if implementation == "cudnn":
        return _jax_attention(query, key, value, implementation="cudnn", **call)
    out_shape = jnp.shape(query)
    q, k, v = _ensure_4d(query), _ensure_4d(key), _ensure_4d(value)
    bias4 = None if bias is None else _ensure_4d(bias)
    mask4 = None if mask is None else _ensure_4d(mask)
    q_len = None if query_seq_lengths is None else jnp.asarray(query_seq_lengths)
    kv_len = None if key_value_seq_lengths is None else jnp.asarray(key_value_seq_lengths)
    if k.ndim != 4:
        raise ValueError(f"key must be (B, S, K, H) or (S, K, H), got shape {tuple(jnp.shape(key))}")
    batch, seqlen_k, heads_kv, head_dim = k.shape
    _check_shape_dtype(v, [batch, seqlen_k, heads_kv, head_dim], k.dtype, "value")
    _check_shape_dtype(q, [batch, -1, -1, head_dim], k.dtype, "query")
    _check_shape_dtype(mask4, [-1] * 4, np.dtype(bool), "mask")
    _check_shape_dtype(bias4, [-1] * 4, None, "bias")
    _check_shape_dtype(q_len, [batch], np.dtype(np.int32), "query_seq_lengths")
    _check_shape_dtype(kv_len, [batch], np.dtype(np.int32), "key_value_seq_lengths")
    seqlen_q, heads = q.shape[1], q.shape[2]
    if heads % heads_kv:
        raise ValueError(f"query heads ({heads}) must be a multiple of key/value heads ({heads_kv})")
    if not _kernels_take(k.dtype, head_dim, head_dim):
        return _jax_attention(query, key, value, implementation="xla", **call)

    left, right = _window_sides(is_causal, local_window_size)
    if mask4 is not None:
        mask4 = _broadcast4(mask4, batch, heads, seqlen_q, seqlen_k, "mask")
    empty = _empty_rows(seqlen_q, seqlen_k, left, right, mask4, q_len, kv_len)
    window, kernel_mask = _band_kwargs(seqlen_q, seqlen_k, left, right, mask4)
    kwargs = {}
    if kernel_mask is not None:
        kwargs["attention_mask"] = kernel_mask
    if bias4 is not None:
        bias4 = bias4 if jnp.dtype(bias4.dtype) in [jnp.dtype(d) for d in _KERNEL_DTYPES] else bias4.astype(
            jnp.float32)
        kwargs["bias"] = _broadcast4(bias4, batch, heads, seqlen_q, seqlen_k, "bias")
    if q_len is not None or kv_len is not None:
        info = MaskInfo.from_lengths(jnp.full((batch,), seqlen_q, jnp.int32) if q_len is None else q_len,
                                     jnp.full((batch,), seqlen_k, jnp.int32) if kv_len is None else kv_len,
                                     seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        kwargs.update(q_segment_ids=info.q_segment_ids, kv_segment_ids=info.kv_segment_ids)
    out = flash_attention(q, k, v, softmax_scale=scale, sliding_window=window, return_lse=return_residual,
                          backend=_IMPLEMENTATIONS[implementation], **kwargs)
    out, lse = out if return_residual else (out, None)
    if empty is not None:
        out = _mean_rows(out, v, empty)
    if q_len is not None:   # jax.nn zeroes the padded query rows
        out = jnp.where((jnp.arange(seqlen_q)[None, :] < q_len[:, None])[:, :, None, None], out, 0).astype(out.dtype)
    out = jnp.reshape(out, out_shape)
    if not return_residual:
        return out
    if empty is not None:
        lse = jnp.where(empty, _LARGE_NEGATIVE, lse)
    lse = jax.lax.stop_gradient(jnp.swapaxes(lse, 1, 2).astype(k.dtype))    # (B, N, T) -> jax.nn's (B, T, N)
    return out, jnp.reshape(lse, out_shape[:-1])


# -- Flax ---------------------------------------------------------------------------------------------

_SIMPLE_PRECISIONS = ("DEFAULT", "HIGH", "HIGHEST", "BFLOAT16", "TENSORFLOAT32", "FLOAT32", "FASTEST")


def _precision_name(precision) -> Optional[str]:
    """The lax.Precision name of a precision given as None, an enum, a string or a pair of one value;
    None for anything else (a DotAlgorithm, a mixed pair)."""
    if precision is None:
        return "DEFAULT"
    if isinstance(precision, (tuple, list)):
        names = {_precision_name(p) for p in precision}
        return names.pop() if len(names) == 1 else None
    name = str(getattr(precision, "name", precision)).upper()
    return name if name in _SIMPLE_PRECISIONS else None


def _check_flax_shapes(query, key, value) -> None:
    """Flax's shape rules as ValueErrors naming the arguments."""
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(f"query, key and value must have the same rank, got {query.ndim}, {key.ndim}, {value.ndim}")
    if query.ndim < 3:
        raise ValueError(f"query must be (batch..., T, N, H), got shape {tuple(query.shape)}")
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"query, key and value batch dims must match, got shapes {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if key.shape[-3] != value.shape[-3]:
        raise ValueError(f"key and value lengths must match, got {key.shape[-3]} and {value.shape[-3]}")
    if query.shape[-1] != key.shape[-1]:
        raise ValueError(f"query and key depths must match, got {query.shape[-1]} and {key.shape[-1]}")
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(f"key and value heads must match, got {key.shape[-2]} and {value.shape[-2]}")
    if query.shape[-2] % key.shape[-2]:
        raise ValueError(f"query heads ({query.shape[-2]}) must be a multiple of key heads ({key.shape[-2]})")


def _and_mask(mask, band):
    """A Flax mask (nonzero = attend, any rank) and a (T, S) band, as one bool mask."""
    if mask is None:
        return band
    mask = jnp.asarray(mask) != 0
    ndim = max(mask.ndim, 2)
    return jnp.logical_and(jnp.reshape(mask, (1,) * (ndim - mask.ndim) + mask.shape),
                           jnp.reshape(band, (1,) * (ndim - 2) + band.shape))


def _flax_attention(query, key, value, *, is_causal, promote_dtype, linen_only: dict, **kwargs):
    """Flax's own dot_product_attention: linen's for a linen module to sow into or linen's own keywords
    (its einsums, force_fp32_for_softmax), nnx's otherwise (it also takes GQA, is_causal and
    promote_dtype).  Imported from their defining modules, which stay Flax's where the public names
    flax.linen.dot_product_attention / flax.nnx.dot_product_attention are patched to the adapter."""
    from flax import linen
    module = kwargs.get("module")
    if isinstance(module, linen.Module) or any(v not in (None, False) for v in linen_only.values()):
        from flax.linen import attention as flax_attention
        if is_causal:
            kwargs["mask"] = _and_mask(kwargs.get("mask"), jnp.tril(jnp.ones((query.shape[-3], key.shape[-3]), bool)))
        if promote_dtype is not None:
            query, key, value = promote_dtype((query, key, value), dtype=kwargs.get("dtype"))
        return flax_attention.dot_product_attention(query, key, value, **kwargs, **linen_only)
    from flax.nnx.nn import attention as flax_attention
    extra = {} if promote_dtype is None else {"promote_dtype": promote_dtype}
    return flax_attention.dot_product_attention(query, key, value, is_causal=is_causal, **kwargs, **extra)


def make_attention_fn(*, backend: str = "auto", is_causal: bool = False, sliding_window=None,
                      logits_soft_cap: Optional[float] = None):
    """An `attention_fn` for flax.linen.MultiHeadDotProductAttention / flax.nnx.MultiHeadAttention.

    The returned function takes the arguments of Flax's dot_product_attention (linen's and nnx's):
    query (batch..., T, N, H), key/value (batch..., S, K, H) (GQA: K may divide N), bias / mask
    broadcastable to (batch..., N, T, S) (mask nonzero = attend), broadcast_dropout, dropout_rng,
    dropout_rate, deterministic, dtype, precision, module, is_causal, force_fp32_for_softmax,
    einsum_dot_general, qk_attn_weights_einsum, attn_weights_value_einsum, promote_dtype — and gives
    Flax's result: top-left causal mask, the mean of the values on a row no key may attend.

    The kernels run the call when its dtype is fp16/bf16/fp32, head dims lie in 16..256, precision is
    a lax.Precision (the kernels accumulate in fp32 and run fp32 dots at fp32 accuracy; the xla
    backend passes it to its dots), nothing is sown (module=None), no einsum is given, and dropout
    is off or drawn per (batch, head) (broadcast_dropout=False: the kernels' counter-based mask,
    seeded from dropout_rng).  Every other call runs Flax's own dot_product_attention, exact, so
    Flax's default broadcast_dropout=True draws Flax's one (T, S) mask, whatever the backend.

    Factory options: backend (flash_attention's); is_causal, as the call's; sliding_window, int w or
    (left, right): query i attends i - left <= j <= i + right (top-left, as jax.nn's
    local_window_size); logits_soft_cap (kernels only: a call the kernels cannot take raises).
    """
    factory_causal = is_causal

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True, dropout_rng=None,
                     dropout_rate: float = 0.0, deterministic: bool = False, dtype=None, precision=None,
                     module=None, is_causal: bool = False, force_fp32_for_softmax: bool = False,
                     einsum_dot_general=None, qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                     promote_dtype=None):
        query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
        _check_flax_shapes(query, key, value)
        causal = bool(is_causal or factory_causal)
        batch_dims = query.shape[:-3]
        flat = int(math.prod(batch_dims))
        if promote_dtype is not None:
            compute = promote_dtype((query, key, value), dtype=dtype)[0].dtype
        else:
            compute = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
        dropout = not deterministic and dropout_rate > 0.0
        linen_only = dict(force_fp32_for_softmax=force_fp32_for_softmax, einsum_dot_general=einsum_dot_general,
                          qk_attn_weights_einsum=qk_attn_weights_einsum,
                          attn_weights_value_einsum=attn_weights_value_einsum)
        precision_name = _precision_name(precision)
        if (module is not None or einsum_dot_general is not None or qk_attn_weights_einsum is not None
                or attn_weights_value_einsum is not None or precision_name is None
                or not _kernels_take(compute, query.shape[-1], value.shape[-1])
                or dropout and broadcast_dropout and flat * query.shape[-2] > 1):
            if logits_soft_cap is not None:
                raise ValueError(f"logits_soft_cap={logits_soft_cap} needs the kernels, which cannot take this call "
                                 f"(dtype {jnp.dtype(compute).name}, head dims {query.shape[-1]}/{value.shape[-1]}"
                                 f", module={module!r}, precision={precision!r}, broadcast dropout, or an einsum) "
                                 "and Flax's dot_product_attention has no soft cap")
            if sliding_window is not None:
                left, right = _window_sides(False, sliding_window)
                mask = _and_mask(mask, _band_mask(query.shape[-3], key.shape[-3], left, right))
            return _flax_attention(query, key, value, is_causal=causal, promote_dtype=promote_dtype,
                                   linen_only=linen_only, bias=bias, mask=mask, broadcast_dropout=broadcast_dropout,
                                   dropout_rng=dropout_rng, dropout_rate=dropout_rate, deterministic=deterministic,
                                   dtype=dtype, precision=precision, module=module)
        if dropout and dropout_rng is None:
            raise ValueError("dropout_rate > 0 with deterministic=False needs dropout_rng")
        query, key, value = (x.astype(compute) for x in (query, key, value))

        def flatten(x):
            return jnp.reshape(x, (flat,) + x.shape[len(batch_dims):])

        def flatten_broadcast(x, name):
            """(batch..., N|1, T|1, S|1), leading dims broadcastable, as (flat|1, N|1, T|1, S|1)."""
            x = jnp.asarray(x)
            if x.ndim > len(batch_dims) + 3:
                raise ValueError(f"{name} of shape {tuple(x.shape)} has more dims than (batch..., N, T, S)")
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
            mask = _broadcast4(flatten_broadcast(mask if mask.dtype == jnp.bool_ else mask != 0, "mask"), flat,
                               heads, seqlen_q, seqlen_k, "mask")
        if bias is not None:
            kwargs["bias"] = _broadcast4(flatten_broadcast(bias, "bias").astype(compute), flat, heads, seqlen_q,
                                         seqlen_k, "bias")
        if dropout:
            kwargs.update(dropout_prob=float(dropout_rate),
                          dropout_seed=jax.random.randint(dropout_rng, (), 0, 2 ** 31 - 1, jnp.int32))
        left, right = _window_sides(causal, sliding_window)
        empty = _empty_rows(seqlen_q, seqlen_k, left, right, mask)
        window, mask = _band_kwargs(seqlen_q, seqlen_k, left, right, mask)
        if mask is not None:
            kwargs["attention_mask"] = mask
        run = backend
        xla_options = None
        if precision_name not in ("DEFAULT", "BFLOAT16", "FASTEST"):
            # The triton kernels run fp32 inputs at fp32 accuracy (3 x tf32) already; a Pallas TPU kernel
            # would run them at bf16, so the xla backend takes those, with the precision on its dots.
            run = "xla" if _resolve_backend(backend, q) == "pallas" and compute == jnp.float32 else backend
            xla_options = {"precision": precision}
        out = flash_attention(q, k, v, sliding_window=window, logits_soft_cap=logits_soft_cap, backend=run,
                              xla_options=xla_options if _resolve_backend(run, q) == "xla" else None, **kwargs)
        if empty is not None:
            out = _mean_rows(out, v, empty)
        return jnp.reshape(out, batch_dims + out.shape[1:])

    return attention_fn


attention_fn = make_attention_fn()
