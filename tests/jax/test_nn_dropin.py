"""jax_api.dot_product_attention against jax.nn.dot_product_attention itself: the same outputs,
gradients, residual and errors for every argument jax.nn takes, on the kernels (xla and the Triton
interpreter) where they can take the call and through jax's own computation where they cannot."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy

from dualattn.jax_api import dot_product_attention  # noqa: E402
from dualattn.jax_api import nn as dnn  # noqa: E402

BACKENDS = ["xla", "triton"]


def _qkv(rng, b=2, t=24, s=24, n=4, k=2, h=16, dtype=jnp.float32):
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return f(b, t, n, h), f(b, s, k, h), f(b, s, k, h)


def _both(rng, q, k, v, impl, atol=2e-5, **kw):
    """Output and the vjp of a random cotangent, ours against jax.nn's."""
    ours = lambda q, k, v: dot_product_attention(q, k, v, implementation=impl, **kw)  # noqa: E731
    theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)  # noqa: E731
    out, vjp = jax.vjp(ours, q, k, v)
    ref, vjp_ref = jax.vjp(theirs, q, k, v)
    np.testing.assert_allclose(out, ref, atol=atol)
    cot = jnp.asarray(rng.standard_normal(ref.shape), ref.dtype)
    for g, g_ref in zip(vjp(cot), vjp_ref(cot)):
        np.testing.assert_allclose(g, g_ref, atol=atol * 5)
    return out, ref


@pytest.mark.parametrize("impl", BACKENDS)
def test_residual_has_the_key_dtype_and_no_gradient(rng, impl):
    q, k, v = _qkv(rng, dtype=jnp.bfloat16)
    out, lse = dot_product_attention(q, k, v, is_causal=True, implementation=impl, return_residual=True)
    ref, ref_lse = jax.nn.dot_product_attention(q, k, v, is_causal=True, return_residual=True)
    assert lse.dtype == ref_lse.dtype == jnp.bfloat16 and lse.shape == ref_lse.shape == (2, 24, 4)
    np.testing.assert_allclose(np.float32(lse), np.float32(ref_lse), atol=3e-2)
    # a bf16 cotangent for the residual is accepted, and the residual adds nothing to the gradient
    f = lambda q: dot_product_attention(q, k, v, is_causal=True, implementation=impl,  # noqa: E731
                                        return_residual=True)
    _, vjp = jax.vjp(f, q)
    dout = jnp.asarray(rng.standard_normal(out.shape), jnp.bfloat16)
    (with_lse,), (without,) = vjp((dout, jnp.ones_like(lse))), vjp((dout, jnp.zeros_like(lse)))
    np.testing.assert_array_equal(np.float32(with_lse), np.float32(without))
    assert np.abs(np.float32(without)).max() > 0


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("shape", [(24,), (24, 24), (1, 1, 24), (2, 1, 1, 24)])
def test_masks_and_biases_of_rank_below_four(rng, impl, shape):
    q, k, v = _qkv(rng)
    mask = jnp.asarray(rng.random(shape) < 0.6)
    bias = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    _both(rng, q, k, v, impl, mask=mask, bias=bias)


@pytest.mark.parametrize("impl", BACKENDS)
def test_fully_masked_rows_give_the_mean_of_the_values(rng, impl):
    q, k, v = _qkv(rng, t=8, s=16)
    mask = jnp.asarray(rng.random((2, 4, 8, 16)) < 0.5).at[:, :, 3].set(False).at[1, 2, 5].set(False)
    out, ref = _both(rng, q, k, v, impl, mask=mask)
    group_mean = np.repeat(np.asarray(v).mean(axis=1), 2, axis=1)      # (B, N, H): kv head n // 2
    np.testing.assert_allclose(out[:, 3], group_mean, atol=1e-6)
    np.testing.assert_allclose(out[1, 5, 2], group_mean[1, 2], atol=1e-6)
    _, lse = dot_product_attention(q, k, v, mask=mask, implementation=impl, return_residual=True)
    _, ref_lse = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)


@pytest.mark.parametrize("impl", BACKENDS)
def test_sequence_lengths_pad_queries_with_zeros(rng, impl):
    q, k, v = _qkv(rng, t=16, s=20)
    q_len, kv_len = jnp.array([16, 9], jnp.int32), jnp.array([0, 13], jnp.int32)   # batch 0: no key at all
    kw = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len, is_causal=True)
    out, _ = _both(rng, q, k, v, impl, **kw)
    assert np.all(np.asarray(out[1, 9:]) == 0)
    np.testing.assert_allclose(out[0, 0], np.repeat(np.asarray(v[0]).mean(0), 2, axis=0), atol=1e-6)
    _, lse = dot_product_attention(q, k, v, implementation=impl, return_residual=True, **kw)
    _, ref_lse = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("t,s,kw", [(24, 24, dict(local_window_size=3)),
                                    (16, 24, dict(local_window_size=(2, 5), is_causal=True)),
                                    (24, 16, dict(is_causal=True)),
                                    (16, 24, dict(is_causal=True)),
                                    (24, 24, dict(local_window_size=(-1, 4)))])
def test_causal_and_local_window_are_top_left(rng, impl, t, s, kw):
    q, k, v = _qkv(rng, t=t, s=s)
    _both(rng, q, k, v, impl, **kw)


def test_unbatched_inputs_and_scale(rng):
    q, k, v = _qkv(rng, b=1)
    kw = dict(scale=0.3, is_causal=True)
    out, ref = _both(rng, q[0], k[0], v[0], "xla", **kw)
    assert out.shape == ref.shape == (24, 4, 16)
    out, lse = dot_product_attention(q[0], k[0], v[0], return_residual=True, **kw)
    assert lse.shape == (24, 4)


@pytest.mark.parametrize("dtype,h", [(jnp.float32, 8), (jnp.float64, 16)])
def test_calls_the_kernels_cannot_take_run_jax_itself(rng, monkeypatch, dtype, h):
    calls = []
    monkeypatch.setattr(dnn, "flash_attention", lambda *a, **k: calls.append(a))
    with jax.enable_x64(dtype == jnp.float64):
        q, k, v = _qkv(rng, h=h, dtype=dtype)
        mask = jnp.arange(24) < 20
        out = dot_product_attention(q, k, v, mask=mask, is_causal=True)
        ref = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, ref)
    assert not calls


def test_kernel_dtypes_and_head_dims_run_the_kernels(rng, monkeypatch):
    calls = []
    real = dnn.flash_attention
    monkeypatch.setattr(dnn, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype in (jnp.float16, jnp.bfloat16, jnp.float32):
        q, k, v = _qkv(rng, dtype=dtype)
        dot_product_attention(q, k, v)
    assert len(calls) == 3


@pytest.mark.parametrize("kwargs,name", [
    (dict(query_seq_lengths=jnp.array([3, 4, 5], jnp.int32)), "query_seq_lengths"),
    (dict(key_value_seq_lengths=jnp.array([3.0, 4.0])), "key_value_seq_lengths"),
    (dict(mask=jnp.ones((24, 24), jnp.int32)), "mask"),
    (dict(mask=jnp.ones((2, 3, 24, 24), bool)), "mask"),
    (dict(bias=jnp.ones((1, 1, 1, 1, 24))), "bias"),
    (dict(implementation="flash"), "implementation"),
])
def test_errors_name_the_argument_the_user_passed(rng, kwargs, name):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=name):
        dot_product_attention(q, k, v, **kwargs)


def test_errors_for_mismatched_arrays(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="value"):
        dot_product_attention(q, k, v[:, :5])
    with pytest.raises(ValueError, match="query"):
        dot_product_attention(q.astype(jnp.bfloat16), k, v)
    with pytest.raises(ValueError, match="multiple"):
        dot_product_attention(q[:, :, :3], k, v)
