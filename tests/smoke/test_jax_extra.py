"""Smoke test of the `jax` extra: run by .ci/run in a fresh virtualenv with only `.[jax,test]`."""
from __future__ import annotations

import numpy as np
import pytest

import dualattn
from dualattn import SparseMask, masks
import dualattn.jax_api as dj
import jax
import jax.numpy as jnp
from smoke_common import attention_with_grads, check_front_end_import, relative_error

pytestmark = pytest.mark.smoke


def _inputs(seed: int, shape=(1, 48, 2, 16)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]


@pytest.mark.parametrize("backend", ["triton", "xla", "auto"])
def test_flash_forward_and_backward(backend):
    q, k, v, dout = _inputs(len(backend))
    expected_out, expected_grads = attention_with_grads(q, k, v, dout, causal=True)

    def loss(q, k, v):
        return (dj.flash_attention(q, k, v, causal=True, backend=backend) * dout).sum()

    out = dj.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True, backend=backend)
    grads = jax.grad(loss, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    assert relative_error(out, expected_out) < 1e-5
    for name, got, want in zip(("dquery", "dkey", "dvalue"), grads, expected_grads):
        assert relative_error(got, want) < 1e-5, name


def test_blocksparse_triton_and_dispatcher():
    q, k, v, _ = _inputs(7, (1, 64, 2, 16))
    layout = SparseMask.from_block_map(masks.causal()(1, 2, 64, 64, 16, 16), 16, 16)
    out = dj.blocksparse_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), layout=layout, causal=True,
                                   backend="triton")
    dense = dualattn.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), causal=True)
    assert isinstance(dense, jax.Array)
    expected = attention_with_grads(q, k, v, np.zeros_like(q), causal=True)[0]
    assert relative_error(out, expected) < 1e-5
    assert relative_error(dense, expected) < 1e-5


def test_torch_front_end_names_its_extra():
    check_front_end_import("dualattn.torch_api", "torch", "torch")
