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
    with pytest.raises(ValueError, match="cudnn"):
        dot_product_attention(q, k, v, implementation="cudnn")


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
    dropout_mod = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=32, attention_fn=attention_fn,
                                                  dropout_rate=0.1)
    with pytest.raises(ValueError, match="broadcast_dropout=False"):
        dropout_mod.apply(params, x, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})


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
