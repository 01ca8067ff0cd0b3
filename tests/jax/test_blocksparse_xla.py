"""Block-sparse attention, XLA path (dualattn.jax_api.xla.blocksparse_attention_xla), against the float64
dense reference (tests/reference.py) under the token mask the layout implies:

    token_mask[b, h, i, j] = block_map[b, h, i // block_q, j // block_k]   (then the token rules)

Every case checks the output, the lse and all gradients (query, key, value, softmax_aux).  Sequence
lengths are deliberately not multiples of the block sizes, and Sq != Sk in most cases.
"""
from __future__ import annotations

import numpy as np
from jax_inputs import random_qkv, round_to  # noqa: E402
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

from dualattn import masks  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.sparse import SparseMask  # noqa: E402
from dualattn.jax_api.xla import blocksparse_attention_xla  # noqa: E402
from dualattn.jax_api.xla import blocksparse as blocksparse_module  # noqa: E402
from dualattn.jax_api.xla.blocksparse import _plan_for  # noqa: E402
from reference import assert_close_rel, numpy_reference_with_grads, reference_attention  # noqa: E402

FP32_TOL = 1e-5
BF16_TOL = 2e-2
_OPTION_KEYS = ("softmax_scale", "causal", "sliding_window", "logits_soft_cap")
_DIFF = ("query", "key", "value", "softmax_aux")


_round, _qkv = round_to, random_qkv  # shared with the other JAX tests


def token_mask(layout: SparseMask, Sq: int, Sk: int) -> np.ndarray:
    """The block map expanded to tokens, (Lb, Lh, Sq, Sk), cropped at the ragged ends."""
    bm = layout.to_block_map()
    return np.repeat(np.repeat(bm, layout.block_q, axis=2), layout.block_k, axis=3)[:, :, :Sq, :Sk]


def from_builder(builder, B, H, Sq, Sk, block_q, block_k) -> SparseMask:
    return SparseMask.from_block_map(builder(B, H, Sq, Sk, block_q, block_k), block_q, block_k)


@pytest.fixture
def split_buckets(monkeypatch):
    """Plans split rows into count buckets even for these small layouts (as they do for large ones)."""
    monkeypatch.setattr(blocksparse_module, "_SMALL_WORK", 0)


def num_buckets(layout, B, Hq, Hkv, Sq, Sk) -> int:
    return len(_plan_for(layout, B, Hq, Hkv, Sq, Sk).buckets)


def _check(rng, layout, inputs, *, dtype=jnp.float32, tol=FP32_TOL, **kwargs):
    """Forward + vjp (under one jit) vs numpy_reference_with_grads; returns (out, lse, grads, ref)."""
    spec = {k: kwargs.pop(k) for k in _OPTION_KEYS if k in kwargs}
    B, Sq, Hq, D = inputs["query"].shape
    Sk = inputs["key"].shape[1]
    opts = FlashOptions.build(head_dim=D, **spec)
    diff_names = [n for n in _DIFF if inputs.get(n) is not None]
    diff = [jnp.asarray(inputs[n], dtype) for n in diff_names]

    def f(*args):
        named = dict(zip(diff_names, args))
        return blocksparse_attention_xla(named.pop("query"), named.pop("key"), named.pop("value"), layout=layout,
                                         options=opts, return_lse=True, precision="highest", **named, **kwargs)

    def fwd_bwd(dout, *args):
        (out, lse), vjp = jax.vjp(f, *args)
        return out, lse, vjp((dout, jnp.zeros_like(lse)))

    dout = _round(rng.standard_normal((B, Sq, Hq, inputs["value"].shape[-1])), dtype)
    out, lse, grads = jax.jit(fwd_bwd)(jnp.asarray(dout, dtype), *diff)
    assert out.dtype == dtype and out.shape == dout.shape
    assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, Sq)

    ref = numpy_reference_with_grads({n: inputs[n] for n in diff_names}, dout,
                                     attention_mask=token_mask(layout, Sq, Sk), **spec, **kwargs)
    assert_close_rel(np.asarray(out, np.float32), ref["out"], tol, "out")
    assert_close_rel(np.asarray(lse), ref["lse"], tol, "lse")
    grads = dict(zip(diff_names, grads))
    for name, g in grads.items():
        assert g.shape == inputs[name].shape and g.dtype == dtype, name
        assert_close_rel(np.asarray(g, np.float32), ref["d" + name], tol, "d" + name)
    return out, lse, grads, ref


# --------------------------------------------------------------------------------------------------
# random block maps: broadcast / per-batch / per-head layouts, empty rows, ragged blocks, Sq != Sk
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout_dims,extra", [
    ((1, 1), dict(causal=True)),                          # shared layout, GQA shares the gathered K/V
    ((2, 1), dict(logits_soft_cap=2.0)),                  # per batch
    ((1, 4), dict(softmax_aux=(4, 2))),                   # per query head (differs inside a GQA group)
    ((2, 4), dict(sliding_window=(20, 5), softmax_scale=0.3, softmax_aux=(4,))),
])
def test_random_layout(rng, monkeypatch, layout_dims, extra):
    B, Sq, Sk, Hq, Hkv, D, bq, bk = 2, 40, 72, 4, 2, 16, 16, 32
    if layout_dims[1] > 1:
        monkeypatch.setattr(blocksparse_module, "_SMALL_WORK", 0)        # several buckets
    inputs = _qkv(rng, B, Sq, Sk, Hq, Hkv, D, Dv=32)
    extra = dict(extra)
    if "softmax_aux" in extra:
        inputs["softmax_aux"] = rng.standard_normal(extra.pop("softmax_aux")).astype(np.float32)
    bm = rng.random(layout_dims + (3, 3)) < 0.5
    bm[..., 1, :] = False                                  # a query block with no active key block
    bm[..., 2, 2] = True                                   # the ragged corner block is exercised
    layout = SparseMask.from_block_map(bm, bq, bk)
    out, lse, grads, ref = _check(rng, layout, inputs, **extra)
    # empty query block: output 0, lse -inf or the sinks' lse, zero (finite) gradients
    assert np.all(np.asarray(out)[:, bq:2 * bq] == 0)
    assert np.all(np.asarray(grads["query"])[:, bq:2 * bq] == 0)
    if "softmax_aux" not in inputs:
        assert np.all(np.asarray(lse)[:, :, bq:2 * bq] == -np.inf)
    for g in grads.values():
        assert np.isfinite(np.asarray(g)).all()


def test_decode_short_query(rng):
    """Sq < block_q (one ragged query block) and MQA, causal, bottom-right aligned."""
    inputs = _qkv(rng, 1, 5, 70, 3, 1, 16)
    layout = SparseMask.from_block_map(np.array([[[[1, 0, 1, 1, 1]]]], bool), 16, 16)
    _check(rng, layout, inputs, causal=True)


def test_empty_layout_with_sinks(rng):
    """No active block at all: every row is fully masked; the sinks still get their gradient."""
    B, Sq, Sk, H = 2, 20, 33, 2
    inputs = _qkv(rng, B, Sq, Sk, H, H, 16)
    inputs["softmax_aux"] = rng.standard_normal((3,)).astype(np.float32)
    layout = SparseMask.from_block_map(np.zeros((1, 1, 2, 3), bool), 16, 16)
    out, lse, grads, _ = _check(rng, layout, inputs)
    assert np.all(np.asarray(out) == 0) and np.all(np.asarray(grads["query"]) == 0)
    np.testing.assert_allclose(np.asarray(lse), np.full((B, H, Sq), np.log(np.exp(inputs["softmax_aux"]).sum())),
                               rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# builder layouts with their token rules
# --------------------------------------------------------------------------------------------------
def test_causal_builder(rng, split_buckets):
    B, Sq, Sk, Hq, Hkv = 1, 90, 130, 4, 2
    layout = from_builder(masks.causal(), B, Hq, Sq, Sk, 16, 16)
    assert num_buckets(layout, B, Hq, Hkv, Sq, Sk) == 3                 # counts 4..9: (9), (8..5), (4)
    _check(rng, layout, _qkv(rng, B, Sq, Sk, Hq, Hkv, 16), causal=True)


def test_local_builder_bf16(rng):
    dt = jnp.bfloat16
    B, Sq, Sk, H = 2, 56, 70, 2
    layout = from_builder(masks.local(20), B, H, Sq, Sk, 16, 16)
    assert layout.density < 1.0
    _check(rng, layout, _qkv(rng, B, Sq, Sk, H, H, 32, dtype=dt), dtype=dt, tol=BF16_TOL, sliding_window=20)


def test_causal_and_local_builder(rng):
    B, S, H = 1, 100, 2
    layout = from_builder(masks.causal() & masks.local((24, 0)), B, H, S, S, 16, 16)
    inputs = _qkv(rng, B, S, S, H, 1, 16)
    inputs["query"] *= 2.0
    _check(rng, layout, inputs, causal=True, sliding_window=(24, 0), logits_soft_cap=3.0)


def test_document_builder(rng):
    B, S, H = 2, 75, 2
    seg = np.sort(rng.integers(0, 5, size=(B, S)), axis=1).astype(np.int32)
    layout = from_builder(masks.document(seg), B, H, S, S, 16, 16)
    assert layout.shape[:2] == (B, 1)
    _check(rng, layout, _qkv(rng, B, S, S, H, H, 16), q_segment_ids=seg, causal=True)


def test_strided_or_global_builder(rng, split_buckets):
    B, Sq, Sk, Hq, Hkv = 1, 90, 90, 2, 1
    layout = from_builder(masks.strided(3) | masks.global_tokens(20), B, Hq, Sq, Sk, 16, 16)
    assert num_buckets(layout, B, Hq, Hkv, Sq, Sk) == 2                 # the global rows run apart
    inputs = _qkv(rng, B, Sq, Sk, Hq, Hkv, 16)
    inputs["softmax_aux"] = rng.standard_normal((2,)).astype(np.float32)   # (n,) sinks, n == Hq: per head
    _check(rng, layout, inputs)


# --------------------------------------------------------------------------------------------------
# explicit positions; gradient through lse
# --------------------------------------------------------------------------------------------------
def test_positions_and_lse_gradient(rng):
    """q_positions / kv_positions override the default alignment; d(lse) flows into q, k, v and the sinks."""
    B, Sq, Sk, Hq, Hkv, D = 2, 24, 40, 2, 1, 16
    inputs = _qkv(rng, B, Sq, Sk, Hq, Hkv, D)
    inputs["softmax_aux"] = rng.standard_normal((Hq, 2)).astype(np.float32)
    rules = dict(q_positions=np.stack([np.sort(rng.permutation(64)[:Sq]) for _ in range(B)]).astype(np.int32),
                 kv_positions=np.tile(np.arange(Sk, dtype=np.int32) * 2, (B, 1)))
    layout = SparseMask.from_block_map(rng.random((B, Hq, 2, 3)) < 0.7, 16, 16)
    opts = FlashOptions.build(head_dim=D, sliding_window=(30, 6))
    dout = rng.standard_normal((B, Sq, Hq, D))
    w = rng.standard_normal((B, Hq, Sq))

    # loss = sum(out * dout) + sum(w * lse) (sinks: lse finite everywhere), against the torch float64 graph
    def loss(q, k, v, a):
        out, lse = blocksparse_attention_xla(q, k, v, layout=layout, options=opts, softmax_aux=a, return_lse=True,
                                             precision="highest", **rules)
        return (out * dout).sum() + (w * lse).sum()

    names = ("query", "key", "value", "softmax_aux")
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(*(jnp.asarray(inputs[n]) for n in names))
    leaves = [torch.tensor(inputs[n], dtype=torch.float64, requires_grad=True) for n in names]
    out, lse = reference_attention(*leaves[:3], softmax_aux=leaves[3], sliding_window=(30, 6),
                                   attention_mask=token_mask(layout, Sq, Sk), **rules)
    ref_loss = (out * torch.tensor(dout)).sum() + (torch.tensor(w) * lse).sum()
    ref_loss.backward()
    np.testing.assert_allclose(float(value), ref_loss.item(), rtol=1e-5)
    for name, g, leaf in zip(names, grads, leaves):
        assert_close_rel(np.asarray(g), leaf.grad.numpy(), FP32_TOL, "d" + name)


# --------------------------------------------------------------------------------------------------
# only active blocks: no dense (Sq, Sk) array, bounded padding, the plan is reused
# --------------------------------------------------------------------------------------------------
def _jaxpr_shapes(jaxpr):
    """Shapes of every value produced anywhere in a (closed) jaxpr, sub-jaxprs included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (tuple, list)) else (param,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from _jaxpr_shapes(sub)


def _largest(fn, *args) -> int:
    return max(int(np.prod(s)) for s in _jaxpr_shapes(jax.make_jaxpr(fn)(*args)))


def test_no_dense_score_matrix():
    B, S, H, D = 1, 1024, 1, 16
    layout = from_builder(masks.causal() & masks.local(128), B, H, S, S, 64, 64)
    opts = FlashOptions.build(head_dim=D, causal=True, sliding_window=128)
    q = jnp.ones((B, S, H, D), jnp.float32)

    def loss(q, k, v):
        out, lse = blocksparse_attention_xla(q, k, v, layout=layout, options=opts, return_lse=True)
        return out.sum() + jnp.where(jnp.isfinite(lse), lse, 0.0).sum()

    fwd_bwd = jax.value_and_grad(loss, argnums=(0, 1, 2))
    assert _largest(fwd_bwd, q, q, q) < S * S
    # the scan does see what a dense implementation builds
    assert _largest(lambda q, k, v: jax.nn.dot_product_attention(q, k, v).sum(), q, q, q) >= S * S


def test_plan_work_and_reuse():
    """Buckets cover exactly the active rows; padded slots stay within 2x the active blocks."""
    B, S, H = 2, 1000, 4
    for builder in (masks.causal(), masks.strided(4) | masks.global_tokens(64), masks.local((100, 0))):
        layout = from_builder(builder, B, H, S, S, 32, 32)
        plan = _plan_for(layout, B, H, 2, S, S)
        assert _plan_for(layout, B, H, 2, S, S) is plan                  # cached on the layout: jit cache hit
        counts = layout.kv_counts.reshape(-1)
        rows = np.concatenate([b.rows for b in plan.buckets])
        np.testing.assert_array_equal(np.sort(rows), np.flatnonzero(counts > 0))
        padded = sum(b.kv_valid.size for b in plan.buckets)
        assert all(b.kv_valid.sum() == counts[b.rows].sum() for b in plan.buckets)
        assert padded <= 2 * counts.sum(), (builder, padded, counts.sum())
        lists = layout.kv_indices.reshape(counts.size, -1)
        for b in plan.buckets:   # the gathered key blocks are each row's active list, in order
            for r, row in enumerate(b.rows):
                np.testing.assert_array_equal(b.kv_index[:counts[row], r], lists[row, :counts[row]])


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_map_shape,block_k,match", [
    ((1, 1, 3, 3), 16, "blocks"),       # Sq=40, Sk=50 with 16x16 blocks need 3x4 blocks
    ((1, 1, 2, 4), 16, "blocks"),
    ((1, 1, 3, 4), 32, "blocks"),       # block_k=32: 3x2
    ((3, 1, 3, 4), 16, "batch/head"),   # batch 3 for B=2
    ((1, 2, 3, 4), 16, "batch/head"),   # per kv head: layouts are per query head (Hq=4)
])
def test_bad_layout(rng, block_map_shape, block_k, match):
    inputs = _qkv(rng, 2, 40, 50, 4, 2, 16)
    layout = SparseMask.from_block_map(np.ones(block_map_shape, bool), 16, block_k)
    with pytest.raises(ValueError, match=match):
        blocksparse_attention_xla(*(jnp.asarray(inputs[n]) for n in ("query", "key", "value")), layout=layout,
                                  options=FlashOptions.build(head_dim=16))


def test_bad_arguments(rng):
    inputs = _qkv(rng, 1, 16, 16, 2, 2, 16)
    q, k, v = (jnp.asarray(inputs[n]) for n in ("query", "key", "value"))
    layout = SparseMask.from_block_map(np.ones((1, 1, 1, 1), bool), 16, 16)
    opts = FlashOptions.build(head_dim=16)
    with pytest.raises(TypeError, match="SparseMask"):
        blocksparse_attention_xla(q, k, v, layout=np.ones((1, 1, 1, 1), bool), options=opts)
    with pytest.raises(ValueError, match="dropout"):
        blocksparse_attention_xla(q, k, v, layout=layout, options=FlashOptions.build(head_dim=16, dropout_prob=0.1))
    with pytest.raises(ValueError, match="q_segment_ids"):
        blocksparse_attention_xla(q, k, v, layout=layout, options=opts, q_segment_ids=np.zeros((1, 15), np.int32))
    with pytest.raises(ValueError, match="key/value heads"):
        blocksparse_attention_xla(q, k[:, :, :1].repeat(3, axis=2), v[:, :, :1].repeat(3, axis=2), layout=layout,
                                  options=opts)
