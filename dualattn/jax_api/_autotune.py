"""The JAX side of opt-in autotuning: times flash tile candidates on the GPU.

`flash_autotune_fn(shapes, options)` is what `flash._triton_config` hands to the executor on a GPU;
the executor calls it with its candidates only on a cache miss with autotuning on and writes the
result to the file torch reads too.  Candidates run on synthetic inputs with the call's shapes and
features, each through a fresh `jax.jit` (the config is read when the function is traced), timed as
back-to-back calls + one block_until_ready (dualattn.autotune.median_ms).

The tuning runs in a fresh thread: the executor may ask while the caller's function is being traced
(jax.jit), and jax's trace state is per thread, so the timed calls there run eagerly on the device.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from .. import executor
from ..autotune import in_own_thread, median_ms, tune_flash
from ..kernels.flash import plan as flash_plan
from ..kernels.flash.plan import FlashConfig
from ..validation import FlashShapes
from . import flash
from .flash import flash_attention, flash_attention_varlen


def flash_autotune_fn(shapes: FlashShapes, options) -> Callable[[Sequence[FlashConfig]], Optional[FlashConfig]]:
    return functools.partial(_tune, shapes, options)


def _synthetic_call(shapes: FlashShapes, options, key):
    """(loss(q, k, v), (q, k, v)): one attention call with the shapes and features of the real one."""
    dtype = jnp.dtype(shapes.dtype)
    b, hq, hkv, sq, sk = shapes.batch, shapes.heads_q, shapes.heads_kv, shapes.seqlen_q, shapes.seqlen_k
    keys = iter(jax.random.split(key, 8))

    def randn(*shape, dt=dtype):
        return jax.random.normal(next(keys), shape, dt)

    lead_q, lead_k = ((shapes.total_q,), (shapes.total_k,)) if shapes.varlen else ((b, sq), (b, sk))
    q, k, v = randn(*lead_q, hq, shapes.head_dim), randn(*lead_k, hkv, shapes.head_dim), \
        randn(*lead_k, hkv, shapes.head_dim_v)
    kw = dict(softmax_scale=options.softmax_scale, logits_soft_cap=options.logits_soft_cap,
              sliding_window=(options.window_left, options.window_right), dropout_prob=options.dropout_prob,
              dropout_seed=0 if options.dropout_prob else None, backend="triton")
    if shapes.num_sinks:
        kw["softmax_aux"] = randn(*((hq, shapes.num_sinks) if shapes.sinks_per_head else (shapes.num_sinks,)),
                                  dt=jnp.float32)
    if shapes.varlen:
        lens = [shapes.total_q // b + (i < shapes.total_q % b) for i in range(b)]
        lens_k = [shapes.total_k // b + (i < shapes.total_k % b) for i in range(b)]
        cu_q = jnp.cumsum(jnp.array([0] + lens, jnp.int32)).astype(jnp.int32)
        cu_k = jnp.cumsum(jnp.array([0] + lens_k, jnp.int32)).astype(jnp.int32)
        return (lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, sq, sk, **kw)), (q, k, v)
    if shapes.has_bias:
        kw["bias"] = randn(1 if shapes.bias_bcast_batch else b, 1 if shapes.bias_bcast_head else hq, sq, sk)
    if shapes.has_mask:
        kw["attention_mask"] = jnp.ones((1 if shapes.mask_bcast_batch else b, 1 if shapes.mask_bcast_head else hq,
                                         sq, sk), jnp.bool_)
    if shapes.has_segments:
        kw.update(q_segment_ids=jnp.zeros((b, sq), jnp.int32), kv_segment_ids=jnp.zeros((b, sk), jnp.int32))
    return (lambda q, k, v: flash_attention(q, k, v, **kw)), (q, k, v)


def _tune(shapes: FlashShapes, options, candidates: Sequence[FlashConfig],
          timer: Callable[[Callable[[], object]], float] = None) -> Optional[FlashConfig]:
    """Best forward tile and best backward pair among the candidates (None: none of them ran)."""
    timer = timer or (lambda run: median_ms(run, jax.block_until_ready))
    return in_own_thread(lambda: _tune_here(shapes, options, candidates, timer))


def _tune_here(shapes, options, candidates, timer):
    call, (q, k, v) = _synthetic_call(shapes, options, jax.random.PRNGKey(0))
    dout = jnp.ones(jax.eval_shape(call, q, k, v).shape, q.dtype)

    def traced(fn):
        # A new function for every config: jax keeps one trace per function (across jit objects), and the
        # override is read while tracing.
        return jax.jit(lambda *args: fn(*args))

    def measure(config: FlashConfig, fn) -> float:
        with executor.override(config, algorithm="flash"):
            compiled = traced(fn)
            return timer(lambda: compiled(q, k, v))

    def backward(q, k, v):
        return jax.vjp(call, q, k, v)[1](dout)

    def plans(config: FlashConfig, which: str) -> list:
        """What tracing the call with `config` plans (jax plans while tracing: nothing runs)."""
        with flash_plan.recording() as planned, executor.override(config, algorithm="flash"):
            traced(call if which == "forward" else backward).lower(q, k, v)
        return planned

    return tune_flash(candidates, lambda c: measure(c, call), lambda c: measure(c, backward), plans=plans,
                      desc=f"dualattn autotune {shapes.seqlen_q}x{shapes.seqlen_k} d{shapes.head_dim}")


flash.autotune_fn_for = flash_autotune_fn
