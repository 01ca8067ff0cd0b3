"""Smoke test of the `torch` extra: run by .ci/run in a fresh virtualenv with only `.[torch,test]`."""
from __future__ import annotations

import numpy as np
import pytest

import dualattn
from dualattn import SparseMask, masks
import dualattn.torch_api as dt
import torch
from smoke_common import attention_with_grads, check_front_end_import, relative_error

pytestmark = pytest.mark.smoke


def test_flash_forward_and_backward():
    rng = np.random.default_rng(11)
    q, k, v, dout = (rng.standard_normal((1, 48, 2, 16)).astype(np.float32) for _ in range(4))
    expected_out, expected_grads = attention_with_grads(q, k, v, dout, causal=True)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = dt.flash_attention(*leaves, causal=True)
    grads = torch.autograd.grad(out, leaves, torch.tensor(dout))
    assert relative_error(out.detach(), expected_out) < 1e-5
    for name, got, want in zip(("dquery", "dkey", "dvalue"), grads, expected_grads):
        assert relative_error(got, want) < 1e-5, name


def test_blocksparse_and_dispatcher():
    rng = np.random.default_rng(12)
    q, k, v = (torch.tensor(rng.standard_normal((1, 64, 2, 16)).astype(np.float32)) for _ in range(3))
    layout = SparseMask.from_block_map(masks.causal()(1, 2, 64, 64, 16, 16), 16, 16)
    out = dt.blocksparse_attention(q, k, v, layout=layout, causal=True)
    dense = dualattn.flash_attention(q, k, v, causal=True)
    assert isinstance(dense, torch.Tensor)
    expected = attention_with_grads(q, k, v, np.zeros(q.shape), causal=True)[0]
    assert relative_error(out, expected) < 1e-5
    assert relative_error(dense, expected) < 1e-5


def test_jax_front_end_names_its_extra():
    check_front_end_import("dualattn.jax_api", "jax", "jax")
