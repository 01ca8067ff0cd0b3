"""The "xla" JAX backend (dualattn.jax_api.xla) against the float64 reference (tests/reference.py).

Every case checks the output, the lse and all gradients (query, key, value, bias, softmax_aux).  Shapes
are small (CPU, 2 cores) and the block sizes deliberately do not divide the sequence lengths.
"""
from __future__ import annotations

import numpy as np
from jax_inputs import random_qkv, round_to  # noqa: E402
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dualattn.options import FlashOptions  # noqa: E402
from dualattn.jax_api.xla import (flash_attention_backward_xla, flash_attention_varlen_xla,  # noqa: E402
                                  flash_attention_xla)
from reference import (assert_close_rel, dropout_keep_reference, numpy_reference_with_grads,  # noqa: E402
                       reference_attention)

torch = pytest.importorskip("torch")

FP32_TOL = 1e-5
BF16_TOL = 2e-2
_OPTION_KEYS = ("softmax_scale", "causal", "sliding_window", "logits_soft_cap", "dropout_prob")
_DIFF = ("query", "key", "value", "bias", "softmax_aux")


_round, _qkv = round_to, random_qkv  # shared with the other JAX tests


def _check(rng, inputs, *, dtype=jnp.float32, tol=FP32_TOL, block_q=16, block_k=16, dropout_seed=None,
           **kwargs):
    """Forward + vjp of flash_attention_xla vs numpy_reference_with_grads; returns the jax results."""
    spec = {k: kwargs.pop(k) for k in _OPTION_KEYS if k in kwargs}
    q = inputs["query"]
    B, Sq, Hq, D = q.shape
    Sk = inputs["key"].shape[1]
    opts = FlashOptions.build(head_dim=D, **spec)
    diff_names = [n for n in _DIFF if inputs.get(n) is not None]
    diff = [jnp.asarray(inputs[n], dtype) for n in diff_names]
    other = {k: v for k, v in inputs.items() if k not in _DIFF}

    def f(*args):
        named = dict(zip(diff_names, args))
        return flash_attention_xla(named.pop("query"), named.pop("key"), named.pop("value"), options=opts,
                                   return_lse=True, block_q=block_q, block_k=block_k, precision="highest",
                                   dropout_seed=dropout_seed, **named, **other, **kwargs)

    def fwd_bwd(dout, *args):                  # one jit: one compile for forward and backward
        (out, lse), vjp = jax.vjp(f, *args)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    dout = _round(rng.standard_normal((B, Sq, Hq, inputs["value"].shape[-1])), dtype)
    out, lse, grads = jax.jit(fwd_bwd)(jnp.asarray(dout, dtype), *diff)
    assert out.dtype == dtype and out.shape == dout.shape
    assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, Sq)

    ref_opts = dict(spec, **other, **kwargs)
    if spec.get("dropout_prob", 0.0) > 0:
        ref_opts["dropout_keep"] = dropout_keep_reference(dropout_seed, B, Hq, Sq, Sk, spec["dropout_prob"])
    ref = numpy_reference_with_grads({n: inputs[n] for n in diff_names}, dout, **ref_opts)
    assert_close_rel(np.asarray(out, np.float32), ref["out"], tol, "out")
    assert_close_rel(np.asarray(lse), ref["lse"], tol, "lse")
    for name, g in zip(diff_names, grads):
        assert g.shape == inputs[name].shape and g.dtype == dtype, name
        assert_close_rel(np.asarray(g, np.float32), ref["d" + name], tol, "d" + name)
    return out, lse, dict(zip(diff_names, grads))


# --------------------------------------------------------------------------------------------------
# each option alone
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("Sq,Sk,bq,bk", [(37, 53, 16, 8), (53, 21, 8, 32)])
def test_plain(rng, Sq, Sk, bq, bk):
    _check(rng, _qkv(rng, 2, Sq, Sk, 2, 2, 16), block_q=bq, block_k=bk)


@pytest.mark.parametrize("Sq,Sk", [(19, 45), (45, 19)])   # Sq > Sk: leading rows fully masked
def test_causal(rng, Sq, Sk):
    _check(rng, _qkv(rng, 1, Sq, Sk, 2, 1, 16), causal=True, block_q=16, block_k=7)


@pytest.mark.parametrize("window", [(9, 2), (None, 3)])
def test_sliding_window(rng, window):
    _check(rng, _qkv(rng, 1, 40, 47, 2, 2, 16), sliding_window=window, block_q=8, block_k=16)


def test_softmax_scale_and_head_dims(rng):
    """MQA (Hkv=1), Dv != D, explicit scale."""
    _check(rng, _qkv(rng, 2, 24, 33, 3, 1, 32, Dv=16), softmax_scale=0.3)


def test_soft_cap(rng):
    inputs = _qkv(rng, 1, 33, 33, 2, 2, 16)
    inputs["query"] *= 3.0
    _check(rng, inputs, logits_soft_cap=2.0)


@pytest.mark.parametrize("bias_shape", [(2, 4, 29, 35), (2, 1, 29, 35)])   # (1, Hq): test_mask_bias_softcap
def test_bias_broadcast(rng, bias_shape):
    inputs = _qkv(rng, 2, 29, 35, 4, 2, 16)
    inputs["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
    _check(rng, inputs, block_q=8, block_k=16)


@pytest.mark.parametrize("mask_shape", [(2, 4, 30, 30)])   # (B, 1) int: test_mask_bias_softcap
def test_attention_mask(rng, mask_shape):
    inputs = _qkv(rng, 2, 30, 30, 4, 4, 16)
    mask = rng.random(mask_shape) < 0.6
    mask[..., 3, :] = False                                              # a fully masked row
    inputs["attention_mask"] = mask
    _check(rng, inputs)


def test_segments(rng):
    inputs = _qkv(rng, 2, 41, 41, 2, 1, 16)
    seg = np.sort(rng.integers(0, 4, size=(2, 41)), axis=1).astype(np.int32)
    inputs["q_segment_ids"] = seg
    _check(rng, inputs, block_q=16, block_k=16)                           # kv_segment_ids defaults to q's


@pytest.mark.parametrize("sinks_shape", [(4, 3), (2,)])   # (Hq, n), shared (n,); (Hq,): bf16 test
def test_sinks(rng, sinks_shape):
    inputs = _qkv(rng, 2, 26, 31, 4, 2, 16)
    inputs["softmax_aux"] = rng.standard_normal(sinks_shape).astype(np.float32)
    _check(rng, inputs, causal=True, block_q=8, block_k=8)


def test_positions(rng):
    """Explicit (e.g. global ring) positions drive the window; per-tile cond skipping with kv_positions."""
    B, Sq, Sk = 2, 24, 40
    inputs = _qkv(rng, B, Sq, Sk, 2, 2, 16)
    inputs["q_positions"] = np.stack([rng.permutation(64)[:Sq] for _ in range(B)]).astype(np.int32)
    inputs["kv_positions"] = np.tile(np.arange(Sk, dtype=np.int32) * 2, (B, 1))
    _check(rng, inputs, sliding_window=(12, 4), block_q=8, block_k=8)
    inputs.pop("kv_positions")                                           # q positions only: range skipping
    _check(rng, inputs, causal=True, block_q=8, block_k=8)


@pytest.mark.parametrize("p", [0.3])
def test_dropout(rng, p):
    _check(rng, _qkv(rng, 2, 21, 27, 4, 2, 16), dropout_prob=p, dropout_seed=1234, block_q=8, block_k=16)


# --------------------------------------------------------------------------------------------------
# combinations
# --------------------------------------------------------------------------------------------------
def test_causal_window_gqa(rng):
    _check(rng, _qkv(rng, 2, 35, 50, 6, 2, 16), causal=True, sliding_window=(11, 11), block_q=16, block_k=8)


def test_segments_sinks_dropout(rng):
    inputs = _qkv(rng, 2, 33, 33, 4, 2, 16)
    seg = np.sort(rng.integers(0, 3, size=(2, 33)), axis=1).astype(np.int32)
    inputs.update(q_segment_ids=seg, kv_segment_ids=seg, softmax_aux=rng.standard_normal((4, 2)).astype(np.float32))
    _check(rng, inputs, causal=True, dropout_prob=0.2, dropout_seed=7, block_q=16, block_k=8)


def test_mask_bias_softcap(rng):
    inputs = _qkv(rng, 2, 29, 37, 4, 1, 16)
    inputs["bias"] = rng.standard_normal((1, 4, 29, 37)).astype(np.float32)
    mask = rng.random((2, 1, 29, 37)) < 0.7
    mask[1, 0, 5] = False
    inputs["attention_mask"] = mask.astype(np.int8)                       # integer masks: nonzero = attend
    _check(rng, inputs, logits_soft_cap=3.0, sliding_window=(15, 6), block_q=8, block_k=16)


def test_bf16_combined(rng):
    dt = jnp.bfloat16
    inputs = _qkv(rng, 2, 45, 45, 4, 2, 32, dtype=dt)
    inputs["bias"] = _round(rng.standard_normal((1, 4, 45, 45)), dt)
    inputs["softmax_aux"] = _round(rng.standard_normal((4,)), dt)
    _check(rng, inputs, dtype=dt, tol=BF16_TOL, causal=True, logits_soft_cap=4.0, block_q=16, block_k=16)


def test_bf16_gqa_window(rng):
    dt = jnp.bfloat16
    _check(rng, _qkv(rng, 1, 50, 64, 4, 2, 16, dtype=dt), dtype=dt, tol=BF16_TOL, sliding_window=(20, 3),
           block_q=16, block_k=32)


# --------------------------------------------------------------------------------------------------
# fully masked rows, lse gradient
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(rng, with_sinks):
    B, S, H, D = 1, 20, 2, 16
    inputs = _qkv(rng, B, S, S, H, H, D)
    mask = np.ones((B, 1, S, S), bool)
    mask[:, :, 4:9] = False
    inputs["attention_mask"] = mask
    if with_sinks:
        inputs["softmax_aux"] = rng.standard_normal((H, 2)).astype(np.float32)
    out, lse, grads = _check(rng, inputs, block_q=8, block_k=8)
    assert np.all(np.asarray(out)[:, 4:9] == 0)
    if with_sinks:
        sink_lse = np.log(np.exp(inputs["softmax_aux"].astype(np.float64)).sum(-1))
        np.testing.assert_allclose(np.asarray(lse)[0, :, 4:9], np.broadcast_to(sink_lse[:, None], (H, 5)),
                                   rtol=1e-6)
    else:
        assert np.all(np.isneginf(np.asarray(lse)[:, :, 4:9]))
    assert np.all(np.asarray(grads["query"])[:, 4:9] == 0)
    for g in grads.values():
        assert np.all(np.isfinite(np.asarray(g)))


def test_everything_masked_no_nan(rng):
    """Every row masked (causal with Sk = 0 visible keys is impossible; use segments that never match)."""
    inputs = _qkv(rng, 1, 16, 16, 2, 2, 16)
    opts = FlashOptions.build(head_dim=16)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))
    qs, ks = jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 16), jnp.int32)

    def loss(q, k, v):
        o, l = flash_attention_xla(q, k, v, options=opts, q_segment_ids=qs, kv_segment_ids=ks, return_lse=True,
                                   block_q=8, block_k=8)
        return o.sum() + jnp.where(jnp.isfinite(l), l, 0.0).sum()

    val, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    assert float(val) == 0.0
    for g in grads:
        assert np.all(np.asarray(g) == 0)


def test_lse_gradient(rng):
    """Gradients flow through the returned lse (ring attention merges partial results by lse)."""
    B, Sq, Sk, H, D = 1, 22, 30, 2, 16
    inputs = _qkv(rng, B, Sq, Sk, H, 1, D)
    sinks = rng.standard_normal((H,)).astype(np.float32)
    opts = FlashOptions.build(head_dim=D, causal=True)
    dout = rng.standard_normal((B, Sq, H, D)).astype(np.float32)
    dlse = rng.standard_normal((B, H, Sq)).astype(np.float32)

    def f(q, k, v, s):
        return flash_attention_xla(q, k, v, options=opts, softmax_aux=s, return_lse=True, block_q=8, block_k=8,
                                   precision="highest")

    args = [jnp.asarray(inputs[n]) for n in ("query", "key", "value")] + [jnp.asarray(sinks)]
    _, vjp = jax.vjp(f, *args)
    grads = vjp((jnp.asarray(dout), jnp.asarray(dlse)))

    leaves = [torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in args]
    o, l = reference_attention(*leaves[:3], softmax_aux=leaves[3], causal=True)
    f64 = torch.float64
    loss = (o * torch.as_tensor(dout, dtype=f64)).sum() + (l * torch.as_tensor(dlse, dtype=f64)).sum()
    ref = torch.autograd.grad(loss, leaves)
    for name, g, r in zip(("dquery", "dkey", "dvalue", "dsinks"), grads, ref):
        assert_close_rel(np.asarray(g), r.numpy(), FP32_TOL, name)


def test_ring_style_merge_and_backward(rng):
    """Key shards with global positions, merged by lse; the backward per shard from the merged out/lse."""
    B, S, H, D = 1, 32, 2, 16
    inputs = _qkv(rng, B, S, S, H, H, D)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))
    dout = jnp.asarray(rng.standard_normal((B, S, H, D)).astype(np.float32))
    opts = FlashOptions.build(head_dim=D, causal=True)
    kw = dict(options=opts, block_q=8, block_k=8, precision="highest", q_positions=jnp.arange(S)[None])
    halves = [slice(0, S // 2), slice(S // 2, S)]
    parts = [flash_attention_xla(q, k[:, h], v[:, h], kv_positions=jnp.arange(S)[None, h], return_lse=True, **kw)
             for h in halves]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * jnp.exp(l - lse).transpose(0, 2, 1)[..., None] for o, l in parts)
    full_out, full_vjp = jax.vjp(lambda q, k, v: flash_attention_xla(q, k, v, **kw), q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(full_out), rtol=1e-5, atol=1e-6)
    grads = [flash_attention_backward_xla(q, k[:, h], v[:, h], out, lse, dout, kv_positions=jnp.arange(S)[None, h],
                                          **kw) for h in halves]
    ref = full_vjp(dout)
    np.testing.assert_allclose(np.asarray(grads[0].dquery + grads[1].dquery), np.asarray(ref[0]), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(np.concatenate([g.dkey for g in grads], 1), np.asarray(ref[1]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([g.dvalue for g in grads], 1), np.asarray(ref[2]), rtol=1e-5,
                               atol=1e-6)


# --------------------------------------------------------------------------------------------------
# varlen
# --------------------------------------------------------------------------------------------------
def _check_varlen(rng, lens_q, lens_k, Hq, Hkv, D, *, block, dropout_seed=None, **kwargs):
    spec = {k: kwargs.pop(k) for k in _OPTION_KEYS if k in kwargs}
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = rng.standard_normal((tq, Hq, D)).astype(np.float32)
    k = rng.standard_normal((tk, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((tk, Hkv, D)).astype(np.float32)
    sinks = kwargs.pop("softmax_aux", None)
    opts = FlashOptions.build(head_dim=D, **spec)

    def f(q, k, v, s):
        return flash_attention_varlen_xla(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max(lens_q), max(lens_k),
                                          options=opts, softmax_aux=s, return_lse=True, block_q=block,
                                          precision="highest",
                                          block_k=block, dropout_seed=dropout_seed)

    (out, lse), vjp = jax.vjp(f, q, k, v, None if sinks is None else jnp.asarray(sinks))
    assert out.shape == (tq, Hq, D) and lse.shape == (Hq, tq)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = vjp((jnp.asarray(dout), jnp.zeros_like(lse)))
    ref_opts = dict(spec, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    if spec.get("dropout_prob", 0.0) > 0:
        ref_opts["dropout_keep"] = dropout_keep_reference(dropout_seed, len(lens_q), Hq, max(lens_q), max(lens_k),
                                                          spec["dropout_prob"])
    ref = numpy_reference_with_grads(dict(query=q, key=k, value=v, softmax_aux=sinks), dout, **ref_opts)
    assert_close_rel(np.asarray(out), ref["out"], FP32_TOL, "out")
    assert_close_rel(np.asarray(lse), ref["lse"], FP32_TOL, "lse")
    for name, g in zip(("dquery", "dkey", "dvalue", "dsoftmax_aux"), grads):
        if ref[name] is not None:
            assert_close_rel(np.asarray(g), ref[name], FP32_TOL, name)


def test_varlen_causal(rng):
    _check_varlen(rng, [7, 20, 0, 13], [7, 25, 4, 13], 4, 2, 16, block=8, causal=True)


def test_varlen_sinks_dropout_window(rng):
    _check_varlen(rng, [11, 3, 17], [9, 0, 17], 2, 2, 16, block=8, sliding_window=(5, 2),
                  softmax_aux=rng.standard_normal((2,)).astype(np.float32), dropout_prob=0.25, dropout_seed=99)


# --------------------------------------------------------------------------------------------------
# jit / grad / vmap, traced seed, errors
# --------------------------------------------------------------------------------------------------
def test_jit_grad_matches_eager(rng):
    inputs = _qkv(rng, 1, 24, 24, 2, 2, 16)
    bias = jnp.asarray(rng.standard_normal((1, 2, 24, 24)).astype(np.float32))
    opts = FlashOptions.build(head_dim=16, causal=True, logits_soft_cap=5.0)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))

    def loss(q, k, v, b):
        return (flash_attention_xla(q, k, v, bias=b, options=opts, block_q=8, block_k=16) ** 2).sum()

    eager = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, bias)
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_vmap(rng):
    """vmap over stacked problems, incl. batched q positions (batched loop bounds) and kv positions (cond)."""
    n, B, S, H, D = 3, 1, 20, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((n, B, S, H, D)).astype(np.float32)) for _ in range(3))
    qpos = jnp.asarray(np.stack([np.sort(rng.permutation(40)[:S]) for _ in range(n)])[:, None].astype(np.int32))
    kpos = jnp.asarray(np.stack([np.sort(rng.permutation(40)[:S]) for _ in range(n)])[:, None].astype(np.int32))
    opts = FlashOptions.build(head_dim=D, sliding_window=(6, 2))

    def f(q, k, v, qp, kp):
        return flash_attention_xla(q, k, v, options=opts, q_positions=qp, kv_positions=kp, block_q=8, block_k=8)

    def loss(q, k, v, qp, kp):
        return jnp.sum(f(q, k, v, qp, kp) * jnp.cos(q))

    grad = jax.grad(loss, argnums=(0, 1, 2))
    for use_kpos in (False, True):
        kp = kpos if use_kpos else None
        in_axes = (0, 0, 0, 0, 0 if use_kpos else None)
        batched, gb = jax.jit(jax.vmap(lambda *a: (f(*a), grad(*a)), in_axes=in_axes))(q, k, v, qpos, kp)
        single = jax.jit(lambda *a: (f(*a), grad(*a)))
        for i in range(n):
            out_i, g_i = single(q[i], k[i], v[i], qpos[i], kp[i] if use_kpos else None)
            np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(out_i), rtol=1e-5, atol=1e-6)
            for a, b in zip(gb, g_i):
                np.testing.assert_allclose(np.asarray(a[i]), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_traced_dropout_seed(rng):
    inputs = _qkv(rng, 1, 16, 16, 2, 2, 16)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))
    opts = FlashOptions.build(head_dim=16, dropout_prob=0.5)
    f = jax.jit(lambda s: flash_attention_xla(q, k, v, options=opts, dropout_seed=s, block_q=8, block_k=8))
    a = f(jnp.uint32(5))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(f(jnp.int32(5))))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(
        flash_attention_xla(q, k, v, options=opts, dropout_seed=5, block_q=8, block_k=8)))
    assert not np.allclose(np.asarray(a), np.asarray(f(jnp.uint32(6))))


def test_errors(rng):
    inputs = _qkv(rng, 1, 16, 16, 2, 2, 16)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))
    with pytest.raises(ValueError, match="dropout_seed"):
        flash_attention_xla(q, k, v, options=FlashOptions.build(head_dim=16, dropout_prob=0.1))
    with pytest.raises(ValueError, match="block_q"):
        flash_attention_xla(q, k, v, options=FlashOptions.build(head_dim=16), block_q=0)
    with pytest.raises(ValueError, match="q_positions"):
        flash_attention_xla(q, k, v, options=FlashOptions.build(head_dim=16), q_positions=jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="dropout_seed"):
        flash_attention_xla(q, k, v, options=FlashOptions.build(head_dim=16, dropout_prob=0.1),
                            dropout_seed=jnp.zeros((2,), jnp.uint32))
    with pytest.raises(ValueError, match="bias"):
        flash_attention_xla(q, k, v, options=FlashOptions.build(head_dim=16), bias=jnp.zeros((1, 2, 16, 15)))


# --------------------------------------------------------------------------------------------------
# O(S) memory: no Sq x Sk intermediate anywhere
# --------------------------------------------------------------------------------------------------
def _all_avals(jaxpr):
    from jax.extend import core as jcore
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield eqn.primitive.name, var.aval
        for param in eqn.params.values():
            for p in (param if isinstance(param, (tuple, list)) else (param,)):
                if isinstance(p, jcore.ClosedJaxpr):
                    yield from _all_avals(p.jaxpr)
                elif isinstance(p, jcore.Jaxpr):
                    yield from _all_avals(p)


@pytest.mark.parametrize("case", ["causal", "bias_free_everything", "varlen"])
def test_jaxpr_has_no_score_matrix(case):
    B, S, H, D = 1, 1024, 2, 16
    opts = FlashOptions.build(head_dim=D, causal=True, logits_soft_cap=10.0,
                              dropout_prob=0.1 if case != "causal" else 0.0)
    x = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32)
    if case == "varlen":
        x = jax.ShapeDtypeStruct((S, H, D), jnp.float32)
        cu = jnp.asarray([0, 300, 700, S], jnp.int32)

        def loss(q, k, v):
            return flash_attention_varlen_xla(q, k, v, cu, cu, 400, 400, options=opts, dropout_seed=3,
                                              softmax_aux=jnp.zeros((H,)), block_q=128, block_k=128).sum()
    else:
        extra = {}
        if case == "bias_free_everything":
            seg = jnp.zeros((B, S), jnp.int32)
            extra = dict(q_segment_ids=seg, q_positions=jnp.arange(S)[None], kv_positions=jnp.arange(S)[None],
                         softmax_aux=jnp.zeros((H, 2)), dropout_seed=1)

        def loss(q, k, v):
            o, l = flash_attention_xla(q, k, v, options=opts, return_lse=True, block_q=128, block_k=128, **extra)
            return o.sum() + l.sum()

    closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x, x, x)
    sizes = [(name, aval.shape) for name, aval in _all_avals(closed.jaxpr)
             if hasattr(aval, "shape") and int(np.prod(aval.shape, dtype=np.int64)) >= S * S]
    assert not sizes, f"S x S intermediates found: {sizes[:5]}"


def test_compiled_temp_memory_is_linear():
    """XLA's own temp allocation of fwd+bwd grows ~linearly with S and stays far below one S x S matrix."""
    H, D = 2, 32
    opts = FlashOptions.build(head_dim=D, causal=True)

    def temp_bytes(S):
        x = jax.ShapeDtypeStruct((1, S, H, D), jnp.float32)

        def loss(q, k, v):
            return flash_attention_xla(q, k, v, options=opts, block_q=256, block_k=256).sum()
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        analysis = compiled.memory_analysis()
        if analysis is None:
            pytest.skip("memory_analysis unavailable on this backend")
        return analysis.temp_size_in_bytes

    t1, t2 = temp_bytes(2048), temp_bytes(4096)
    assert t2 < 4096 * 4096 * 4 / 8, (t1, t2)          # one fp32 S x S matrix per head would be 64 MiB each
    assert t2 < 2.5 * t1, (t1, t2)                     # quadratic growth would be 4x


def test_auto_block_sizes():
    from dualattn.jax_api.xla.flash import _resolve_block
    assert _resolve_block(64, 1) == 64
    assert _resolve_block(None, 16) == 1024          # B * Hq = 16: 1024 x 1024 tiles
    assert _resolve_block(None, 256) == 256
    assert _resolve_block(None, 1 << 20) == 128
