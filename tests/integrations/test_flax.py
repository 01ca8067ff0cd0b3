"""jax_api.dot_product_attention (jax.nn's signature) and the Flax attention_fn / nnx module against
jax's and Flax's own attention; jit, grad, vmap, remat and scan through the jax entry points."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

import dualattn  # noqa: E402
from dualattn.jax_api import dot_product_attention  # noqa: E402


def _qkv(rng, b=2, t=32, s=32, n=4, k=2, h=16):
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return f(b, t, n, h), f(b, s, k, h), f(b, s, k, h)


@pytest.mark.parametrize("kw", [dict(is_causal=True, local_window_size=5), dict(mask="mask", bias="bias")])
def test_dot_product_attention_matches_jax_nn(rng, kw):
    q, k, v = _qkv(rng)
    if "mask" in kw:
        kw = dict(mask=jnp.asarray(rng.random((2, 1, 32, 32)) < 0.7), bias=jnp.asarray(rng.standard_normal((1, 4, 32, 32)), jnp.float32))
    np.testing.assert_allclose(dot_product_attention(q, k, v, **kw), jax.nn.dot_product_attention(q, k, v, **kw),
                               atol=2e-6)
    g = jax.jit(jax.grad(lambda q: (dot_product_attention(q, k, v, **kw) ** 2).sum()))(q)
    g_ref = jax.jit(jax.grad(lambda q: (jax.nn.dot_product_attention(q, k, v, **kw) ** 2).sum()))(q)
    np.testing.assert_allclose(g, g_ref, atol=2e-5)


def test_dot_product_attention_lengths_cross_causal_and_residual(rng):
    q, k, v = _qkv(rng, t=20)
    out = dot_product_attention(q, k, v, is_causal=True)   # T < S: jax's top-left diagonal
    np.testing.assert_allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-6)
    q, k, v = _qkv(rng)
    lens = jnp.array([32, 20])
    out, lse = dot_product_attention(q, k, v, query_seq_lengths=lens, key_value_seq_lengths=lens,
                                     return_residual=True)
    ref, ref_lse = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=lens, key_value_seq_lengths=lens,
                                                return_residual=True)
    np.testing.assert_allclose(out[1, :20], ref[1, :20], atol=2e-6)
    np.testing.assert_allclose(lse[1, :20], ref_lse[1, :20], atol=2e-5)
    with pytest.raises(ValueError, match="implementation"):
        dot_product_attention(q, k, v, implementation="flash")


def test_jit_grad_vmap_remat_scan_through_the_entry_points(rng):
    q, k, v = _qkv(rng)
    layer = dualattn.Attention("flash", causal=True)

    def loss(q):
        return (dot_product_attention(q, k, v, is_causal=True) * layer(q, k, v)).sum()

    g = jax.jit(jax.grad(jax.checkpoint(loss)))(q)
    g_ref = jax.grad(lambda q: (jax.nn.dot_product_attention(q, k, v, is_causal=True) ** 2).sum())(q)
    np.testing.assert_allclose(g, g_ref, atol=5e-5)
    per_example = jax.vmap(lambda q, k, v: dot_product_attention(q, k, v, is_causal=True))(q, k, v)  # (T, N, H) each
    np.testing.assert_allclose(per_example, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=2e-6)

    def body(x, _):   # layers under lax.scan, the same attention each step
        return dot_product_attention(x, x[:, :, :2], x[:, :, :2], is_causal=True), None
    out, _ = jax.jit(lambda x: jax.lax.scan(body, x, None, length=2))(q)
    ref = q
    for _ in range(2):
        ref = jax.nn.dot_product_attention(ref, ref[:, :, :2], ref[:, :, :2], is_causal=True)
    np.testing.assert_allclose(out, ref, atol=1e-5)


def test_flax_linen_attention_fn_matches_flax(rng):
    nn = pytest.importorskip("flax.linen")
    from dualattn.jax_api.nn import attention_fn
    x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
    ref_mod = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32)
    our_mod = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, attention_fn=attention_fn)
    params = ref_mod.init(jax.random.PRNGKey(0), x)
    mask = nn.combine_masks(nn.make_causal_mask(jnp.ones((2, 16))),
                            nn.make_attention_mask(jnp.arange(16)[None] < jnp.array([[16], [10]]),
                                                   jnp.arange(16)[None] < jnp.array([[16], [10]])))
    out = our_mod.apply(params, x, mask=mask)
    ref = ref_mod.apply(params, x, mask=mask)
    np.testing.assert_allclose(out[0], ref[0], atol=2e-6)
    np.testing.assert_allclose(out[1, :10], ref[1, :10], atol=2e-6)
    g = jax.jit(jax.grad(lambda p: (our_mod.apply(p, x, mask=mask)[:, :10] ** 2).sum()))(params)
    g_ref = jax.jit(jax.grad(lambda p: (ref_mod.apply(p, x, mask=mask)[:, :10] ** 2).sum()))(params)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=5e-5)


def test_nnx_module_gqa_matches_flax(rng):
    nnx = pytest.importorskip("flax.nnx")
    from dualattn.jax_api.nnx import MultiHeadAttention
    x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
    kw = dict(num_heads=4, in_features=32, qkv_features=64, num_kv_heads=2, decode=False)
    ref = nnx.MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    ours = MultiHeadAttention(**kw, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(ours(x, is_causal=True), ref(x, is_causal=True), atol=2e-6)
    g = nnx.jit(nnx.grad(lambda m: (m(x, is_causal=True) ** 2).sum()))(ours)
    g_ref = nnx.jit(nnx.grad(lambda m: (m(x, is_causal=True) ** 2).sum()))(ref)
    for a, b in zip(jax.tree_util.tree_leaves(nnx.state(g)), jax.tree_util.tree_leaves(nnx.state(g_ref))):
        np.testing.assert_allclose(a, b, atol=5e-5)


def _flax_qkv(rng, shape_q, shape_kv, dtype=jnp.float32):
    f = lambda shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return f(shape_q), f(shape_kv), f(shape_kv)


def _spy(monkeypatch):
    from dualattn.jax_api import nn as dnn
    calls, real = [], dnn.flash_attention
    monkeypatch.setattr(dnn, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_attention_fn_on_the_kernels_matches_flax(rng, monkeypatch, backend):
    """Batch dims, float masks with fully masked rows (mean of the values, as Flax), bias, Precision.HIGH,
    top-left is_causal with T != S, GQA: the kernels run, with Flax's result and gradients."""
    nnx = pytest.importorskip("flax.nnx")
    from dualattn.jax_api.nn import make_attention_fn
    fn = make_attention_fn(backend=backend)
    calls = _spy(monkeypatch)
    q, k, v = _flax_qkv(rng, (2, 3, 8, 4, 16), (2, 3, 12, 2, 16))
    mask = jnp.asarray(rng.random((2, 3, 1, 8, 12)) < 0.6, jnp.float32).at[:, 1, :, 2].set(0.0)
    bias = jnp.asarray(rng.standard_normal((1, 4, 8, 12)), jnp.float32)
    kw = dict(mask=mask, bias=bias, precision=jax.lax.Precision.HIGH, is_causal=True)
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kw), q, k, v)
    ref, vjp_ref = jax.vjp(lambda q, k, v: nnx.dot_product_attention(q, k, v, **kw), q, k, v)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(out[:, 1, 2], np.repeat(np.asarray(v[:, 1]).mean(1), 2, axis=1), atol=1e-6)
    cot = jnp.asarray(rng.standard_normal(ref.shape), jnp.float32)
    for g, g_ref in zip(vjp(cot), vjp_ref(cot)):
        np.testing.assert_allclose(g, g_ref, atol=1e-4)
    assert calls


def test_calls_the_kernels_cannot_take_run_flax_itself(rng, monkeypatch):
    """Head dim 8, float64, sow_weights, linen's einsum_dot_general and einsums, Precision pairs: Flax's own
    dot_product_attention runs them, exactly."""
    nn = pytest.importorskip("flax.linen")
    from dualattn.jax_api.nn import attention_fn
    calls = _spy(monkeypatch)
    q, k, v = _flax_qkv(rng, (2, 6, 2, 8), (2, 6, 2, 8))
    nnx = pytest.importorskip("flax.nnx")
    np.testing.assert_array_equal(attention_fn(q, k, v), nnx.dot_product_attention(q, k, v))
    np.testing.assert_array_equal(attention_fn(q, k, v, einsum_dot_general=jax.lax.dot_general),
                                  nn.dot_product_attention(q, k, v, einsum_dot_general=jax.lax.dot_general))
    with pytest.raises(ValueError, match="together"):   # linen's own rule for its einsums
        attention_fn(q, k, v, qk_attn_weights_einsum=lambda *a: jnp.einsum(*a))
    with jax.enable_x64(True):
        q64, k64, v64 = _flax_qkv(rng, (2, 6, 2, 16), (2, 6, 2, 16), jnp.float64)
        out = attention_fn(q64, k64, v64, mask=jnp.tril(jnp.ones((6, 6))))
        assert out.dtype == jnp.float64
        np.testing.assert_array_equal(out, nnx.dot_product_attention(q64, k64, v64, mask=jnp.tril(jnp.ones((6, 6)))))
    assert not calls
    x = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)
    mod = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, attention_fn=attention_fn)
    params = mod.init(jax.random.PRNGKey(0), x)
    _, state = mod.apply(params, x, sow_weights=True, mutable=["intermediates"])
    assert state["intermediates"]["attention_weights"][0].shape == (2, 2, 6, 6)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_broadcast_dropout_is_flax_s_mask_on_every_backend(rng, backend):
    """Flax's default broadcast_dropout=True: one (T, S) mask over batch and heads, Flax's own draw."""
    nnx = pytest.importorskip("flax.nnx")
    from dualattn.jax_api.nn import make_attention_fn
    fn = make_attention_fn(backend=backend)
    q, k, v = _flax_qkv(rng, (2, 8, 2, 16), (2, 8, 2, 16))
    kw = dict(dropout_rate=0.5, dropout_rng=jax.random.PRNGKey(3), deterministic=False)
    np.testing.assert_allclose(fn(q, k, v, **kw), nnx.dot_product_attention(q, k, v, **kw), atol=1e-6)


def test_per_head_dropout_runs_the_kernels_with_one_mask_on_every_backend(rng, monkeypatch):
    """broadcast_dropout=False: the kernels' counter-based mask, the same on the xla and triton backends,
    a different one for another dropout_rng, none when deterministic."""
    from dualattn.jax_api.nn import make_attention_fn
    calls = _spy(monkeypatch)
    q, k, v = _flax_qkv(rng, (2, 16, 2, 16), (2, 16, 2, 16))
    kw = dict(dropout_rate=0.3, broadcast_dropout=False, deterministic=False)
    outs = [make_attention_fn(backend=b)(q, k, v, dropout_rng=jax.random.PRNGKey(r), **kw)
            for b, r in (("xla", 0), ("triton", 0), ("xla", 1))]
    np.testing.assert_allclose(outs[0], outs[1], atol=2e-5)
    assert np.abs(np.asarray(outs[0] - outs[2])).max() > 1e-2
    np.testing.assert_allclose(make_attention_fn()(q, k, v, dropout_rng=jax.random.PRNGKey(0), dropout_rate=0.3,
                                                   deterministic=True), make_attention_fn()(q, k, v), atol=0)
    assert len(calls) == 5


@pytest.mark.parametrize("shapes,match", [
    (((2, 8, 2, 16), (8, 2, 16), (8, 2, 16)), "same rank"),
    (((2, 8, 2, 16), (3, 8, 2, 16), (3, 8, 2, 16)), "batch dims"),
    (((2, 8, 2, 16), (2, 8, 2, 16), (2, 7, 2, 16)), "lengths must match"),
    (((2, 8, 2, 16), (2, 8, 2, 12), (2, 8, 2, 16)), "depths must match"),
    (((2, 8, 5, 16), (2, 8, 2, 16), (2, 8, 2, 16)), "multiple"),
])
def test_attention_fn_shape_errors_name_the_arguments(shapes, match):
    from dualattn.jax_api.nn import attention_fn
    with pytest.raises(ValueError, match=match):
        attention_fn(*(jnp.ones(s) for s in shapes))
