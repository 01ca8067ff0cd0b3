"""Pallas TPU backend (interpret mode on CPU) against the float64 reference: forward and every gradient."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from dualattn.options import FlashOptions  # noqa: E402
from dualattn.jax_api.pallas import BlockSizes, check_pallas_supported, flash_attention_pallas  # noqa: E402

reference = pytest.importorskip("reference")   # tests/reference.py (float64, torch autograd)
numpy_reference_with_grads = reference.numpy_reference_with_grads
assert_close_rel = reference.assert_close_rel

_OPTION_KEYS = ("softmax_scale", "causal", "sliding_window", "logits_soft_cap")
_TOL = {"float32": dict(out=2e-5, grad=5e-5), "bfloat16": dict(out=1.5e-2, grad=3e-2)}


def _inputs(rng, *, B, Sq, Sk, Hq, Hkv, D, Dv, bias_shape, mask_shape, segments, sinks_shape):
    x = lambda *s: rng.standard_normal(s).astype(np.float32)
    inp = dict(query=x(B, Sq, Hq, D), key=x(B, Sk, Hkv, D), value=x(B, Sk, Hkv, Dv))
    if bias_shape is not None:
        inp["bias"] = x(*bias_shape)
    if sinks_shape is not None:
        inp["softmax_aux"] = x(*sinks_shape) + 1.0
    if mask_shape is not None:
        inp["attention_mask"] = rng.random(mask_shape) < 0.7
    if segments:
        # a few documents per row, kv ids follow the same boundaries scaled to Sk
        cuts_q = np.sort(rng.integers(0, Sq, size=(B, 2)), axis=1)
        inp["q_segment_ids"] = (np.arange(Sq)[None, :, None] >= cuts_q[:, None, :]).sum(-1).astype(np.int32)
        cuts_k = (cuts_q * Sk) // Sq
        inp["kv_segment_ids"] = (np.arange(Sk)[None, :, None] >= cuts_k[:, None, :]).sum(-1).astype(np.int32)
    return inp


def _pallas(inp, dtype, block, opts, interpret=None, return_lse=True):
    """out, lse and the vjp closure of the Pallas backend on `inp` (numpy), cast to dtype."""
    D = inp["query"].shape[-1]
    options = FlashOptions.build(head_dim=D, **{k: v for k, v in opts.items() if k in _OPTION_KEYS})
    diff = {n: jnp.asarray(inp[n], dtype) for n in ("query", "key", "value", "bias", "softmax_aux") if n in inp}
    const = {n: jnp.asarray(inp[n]) for n in ("attention_mask", "q_segment_ids", "kv_segment_ids") if n in inp}

    def f(diff):
        return flash_attention_pallas(diff["query"], diff["key"], diff["value"], options=options,
                                      bias=diff.get("bias"), softmax_aux=diff.get("softmax_aux"), **const,
                                      block_q=block[0], block_k=block[1], interpret=interpret,
                                      return_lse=return_lse)
    (out, lse), vjp = jax.vjp(jax.jit(f), diff)
    return out, lse, vjp


def check_case(rng, *, B=1, Sq=64, Sk=64, Hq=2, Hkv=2, D=32, Dv=None, dtype="float32", block=(32, 32),
               bias_shape=None, mask_shape=None, segments=False, sinks_shape=None, interpret=None, **opts):
    """Forward (out, lse) and all gradients of sum(out * dout) against the float64 reference."""
    Dv = Dv or D
    inp = _inputs(rng, B=B, Sq=Sq, Sk=Sk, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, bias_shape=bias_shape,
                  mask_shape=mask_shape, segments=segments, sinks_shape=sinks_shape)
    dt = jnp.dtype(dtype)
    # the reference sees exactly the (rounded) values the kernel sees
    inp = {n: (np.asarray(jnp.asarray(a, dt).astype(jnp.float32)) if a.dtype == np.float32 else a)
           for n, a in inp.items()}
    dout = np.asarray(jnp.asarray(rng.standard_normal((B, Sq, Hq, Dv)), dt).astype(jnp.float32))

    out, lse, vjp = _pallas(inp, dt, block, opts, interpret)
    (grads,) = vjp((jnp.asarray(dout, dt), jnp.zeros_like(lse)))
    ref = numpy_reference_with_grads(inp, dout, **opts)

    assert out.dtype == dt and out.shape == (B, Sq, Hq, Dv)
    assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, Sq)
    tol = _TOL[dtype]
    assert_close_rel(np.asarray(out, np.float64), ref["out"], tol["out"], "out")
    assert_close_rel(np.asarray(lse, np.float64), ref["lse"], 1e-5 if dtype == "float32" else 5e-3, "lse")
    for name, g in grads.items():
        assert g.dtype == dt and g.shape == inp[name].shape, name
        assert_close_rel(np.asarray(g, np.float64), ref["d" + name], tol["grad"], "d" + name)
    return inp, out, lse, grads, ref


# --------------------------------------------------------------------------------------------------
# each option alone
# --------------------------------------------------------------------------------------------------

def test_plain(rng):
    check_case(rng, B=2)


def test_causal(rng):
    check_case(rng, causal=True)


def test_sliding_window(rng):
    check_case(rng, Sq=96, Sk=96, sliding_window=(20, 9))


def test_sliding_window_int_many_skipped_blocks(rng):
    check_case(rng, Sq=192, Sk=192, Hq=1, Hkv=1, sliding_window=12, block=(32, 32))


def test_gqa_mqa_softmax_scale(rng):
    check_case(rng, Hq=4, Hkv=1, softmax_scale=0.37)


def test_logits_soft_cap(rng):
    check_case(rng, logits_soft_cap=2.0, softmax_scale=1.0)


@pytest.mark.parametrize("bias_shape", [(1, 2, 48, 80), (2, 1, 48, 80)])
def test_bias_broadcast(rng, bias_shape):
    check_case(rng, B=2, Sq=48, Sk=80, bias_shape=bias_shape)


def test_attention_mask(rng):
    check_case(rng, B=2, mask_shape=(1, 2, 64, 64))


def test_attention_mask_int(rng):
    inp = _inputs(rng, B=1, Sq=32, Sk=32, Hq=2, Hkv=2, D=16, Dv=16, bias_shape=None,
                  mask_shape=(1, 2, 32, 32), segments=False, sinks_shape=None)
    as_int = dict(inp, attention_mask=inp["attention_mask"].astype(np.int32) * 3)
    out_b, _, _ = _pallas(inp, jnp.float32, (32, 32), {})
    out_i, _, _ = _pallas(as_int, jnp.float32, (32, 32), {})
    np.testing.assert_array_equal(np.asarray(out_b), np.asarray(out_i))


def test_segments(rng):
    check_case(rng, B=2, segments=True)


def test_segments_single_array_used_for_both(rng):
    inp = _inputs(rng, B=2, Sq=64, Sk=64, Hq=2, Hkv=2, D=16, Dv=16, bias_shape=None,
                  mask_shape=None, segments=True, sinks_shape=None)
    both = dict(inp, kv_segment_ids=inp["q_segment_ids"])
    only_q = {n: a for n, a in both.items() if n != "kv_segment_ids"}
    out_both, _, _ = _pallas(both, jnp.float32, (32, 32), {})
    out_q, _, _ = _pallas(only_q, jnp.float32, (32, 32), {})
    np.testing.assert_array_equal(np.asarray(out_both), np.asarray(out_q))


@pytest.mark.parametrize("sinks_shape", [(2, 3), (2,), (5,)], ids=["per-head-n", "per-head", "shared"])
def test_sinks(rng, sinks_shape):
    check_case(rng, sinks_shape=sinks_shape)


def test_value_head_dim_differs(rng):
    check_case(rng, D=32, Dv=48, Hq=4, Hkv=2)


# --------------------------------------------------------------------------------------------------
# combinations, Sq != Sk, ragged lengths
# --------------------------------------------------------------------------------------------------

def test_causal_window_gqa_ragged(rng):
    check_case(rng, Sq=100, Sk=100, Hq=4, Hkv=2, causal=True, sliding_window=(30, None))


def test_segments_sinks_causal(rng):
    check_case(rng, B=2, Sq=80, Sk=80, segments=True, sinks_shape=(2, 2), causal=True)


def test_mask_bias_softcap(rng):
    check_case(rng, B=2, Sq=50, Sk=70, bias_shape=(1, 1, 50, 70), mask_shape=(2, 1, 50, 70),
               logits_soft_cap=1.5)


@pytest.mark.parametrize("Sq,Sk", [(40, 96), (96, 40), (1, 77)])
def test_cross_lengths_causal(rng, Sq, Sk):
    # Sq > Sk with causal leaves the first Sq - Sk rows with no key at all (bottom-right alignment)
    check_case(rng, Sq=Sq, Sk=Sk, causal=True, block=(32, 32))


def test_cross_lengths_window_segments_gqa(rng):
    check_case(rng, B=2, Sq=72, Sk=136, Hq=4, Hkv=2, sliding_window=(24, 8), segments=True,
               block=(32, 64))


def test_default_blocks_clamped(rng):
    check_case(rng, Sq=30, Sk=50, causal=True, block=(128, 128))


# --------------------------------------------------------------------------------------------------
# bf16
# --------------------------------------------------------------------------------------------------

def test_bf16_causal_gqa(rng):
    check_case(rng, dtype="bfloat16", Sq=96, Sk=96, Hq=4, Hkv=2, causal=True)


def test_bf16_bias_sinks_softcap(rng):
    check_case(rng, dtype="bfloat16", bias_shape=(1, 2, 64, 64), sinks_shape=(2,), logits_soft_cap=3.0)


# --------------------------------------------------------------------------------------------------
# fully masked rows
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_sinks", [False, True])
def test_fully_masked_rows(rng, with_sinks):
    Sq = Sk = 64
    mask = rng.random((1, 2, Sq, Sk)) < 0.6
    mask[:, 0, 5] = False            # one row of head 0 masked entirely
    mask[:, :, 40:50] = False        # a band of rows in every head
    inp = _inputs(rng, B=1, Sq=Sq, Sk=Sk, Hq=2, Hkv=2, D=16, Dv=16, bias_shape=(1, 2, Sq, Sk),
                  mask_shape=None, segments=False, sinks_shape=(2,) if with_sinks else None)
    inp["attention_mask"] = mask
    dout = rng.standard_normal((1, Sq, 2, 16)).astype(np.float32)
    out, lse, vjp = _pallas(inp, jnp.float32, (32, 32), {})
    (grads,) = vjp((jnp.asarray(dout), jnp.zeros_like(lse)))
    ref = numpy_reference_with_grads(inp, dout)
    out, lse = np.asarray(out), np.asarray(lse)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(out[0, 40:50], 0.0)
    np.testing.assert_array_equal(out[0, 5, 0], 0.0)
    if with_sinks:
        np.testing.assert_allclose(lse[0, :, 45], inp["softmax_aux"], rtol=1e-6)
    else:
        assert np.all(lse[0, :, 40:50] == -np.inf) and lse[0, 0, 5] == -np.inf
    assert_close_rel(out, ref["out"], 2e-5, "out")
    assert_close_rel(lse, ref["lse"], 1e-5, "lse")
    for name, g in grads.items():
        g = np.asarray(g)
        assert np.isfinite(g).all(), name
        assert_close_rel(g, ref["d" + name], 5e-5, "d" + name)
    np.testing.assert_array_equal(np.asarray(grads["query"])[0, 40:50], 0.0)
    np.testing.assert_array_equal(np.asarray(grads["bias"])[0, :, 40:50], 0.0)


def test_no_key_at_all_in_window(rng):
    # window (0, 0) with Sq > Sk: rows whose diagonal falls before key 0 see nothing
    check_case(rng, Sq=64, Sk=16, Hq=2, Hkv=1, sliding_window=(0, 0), block=(32, 16))


# --------------------------------------------------------------------------------------------------
# blocks outside the band are never touched: NaN planted there must not reach the results
# --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("Sq,Sk,window,blocks", [
    (100, 100, (None, 0), (32, 32)), (40, 96, (16, 0), (16, 32)), (96, 40, (8, 3), (32, 16)),
    (64, 64, (0, None), (16, 16)), (77, 50, (5, 5), (32, 32)), (64, 16, (0, 0), (32, 16))])
def test_band_arithmetic(Sq, Sk, window, blocks):
    """_block_live is exact (some allowed pair <=> live); index maps fetch j itself for live blocks."""
    from dualattn.jax_api.pallas.flash import _Static, _block_live, _kv_block_in_band, _q_block_in_band
    options = FlashOptions(softmax_scale=1.0, window_left=window[0], window_right=window[1])
    st = _Static(options, BlockSizes(*blocks), Sq, Sk, True)
    bq, bk = blocks
    nq, nk = -(-Sq // bq), -(-Sk // bk)
    d = np.arange(Sk)[None, :] - (np.arange(Sq)[:, None] + Sk - Sq)
    allowed = np.ones_like(d, bool)
    if window[0] is not None:
        allowed &= d >= -window[0]
    if window[1] is not None:
        allowed &= d <= window[1]
    for i in range(nq):
        for j in range(nk):
            brute = allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any()
            assert bool(_block_live(st, i, j)) == brute, (i, j)
            kv_j, q_i = int(_kv_block_in_band(st, i, j, nk)), int(_q_block_in_band(st, j, i, nq))
            assert 0 <= kv_j < nk and 0 <= q_i < nq
            if brute:
                assert kv_j == j and q_i == i, (i, j)


def _nan_rows(x, rows):
    x = np.array(x)
    x[:, rows] = np.nan
    return jnp.asarray(x)


def test_forward_skips_blocks_outside_band(rng):
    S, D = 128, 16   # 4 x 4 blocks of 32; window (20, 0): q block 3 needs key blocks 2-3 only
    options = FlashOptions.build(head_dim=D, causal=True, sliding_window=(20, None))
    q, k, v = (rng.standard_normal((1, S, 1, D)).astype(np.float32) for _ in range(3))
    ref = numpy_reference_with_grads(dict(query=q, key=k, value=v), np.zeros_like(q),
                                     causal=True, sliding_window=(20, None))["out"]
    f = jax.jit(lambda q, k, v: flash_attention_pallas(q, k, v, options=options, block_q=32, block_k=32))
    out_left = np.asarray(f(q, _nan_rows(k, slice(0, 64)), _nan_rows(v, slice(0, 64))))
    assert_close_rel(out_left[:, 96:], ref[:, 96:], 2e-5, "out (left of band poisoned)")
    out_right = np.asarray(f(q, _nan_rows(k, slice(96, S)), _nan_rows(v, slice(96, S))))
    assert_close_rel(out_right[:, :96], ref[:, :96], 2e-5, "out (right of band poisoned)")


def test_backward_skips_blocks_outside_band(rng):
    S, D = 128, 16
    options = FlashOptions.build(head_dim=D, causal=True, sliding_window=(20, None))
    q, k, v, do = (rng.standard_normal((1, S, 1, D)).astype(np.float32) for _ in range(4))
    ref = numpy_reference_with_grads(dict(query=q, key=k, value=v), do, causal=True, sliding_window=(20, None))
    f = jax.jit(lambda q, k, v: flash_attention_pallas(q, k, v, options=options, block_q=32, block_k=32))
    poisoned = np.r_[0:32, 96:128]   # query blocks 0 and 3; key block 1 only meets query blocks 1-2
    _, vjp = jax.vjp(f, _nan_rows(q, poisoned), jnp.asarray(k), jnp.asarray(v))
    dq, dk, dv = (np.asarray(g) for g in vjp(_nan_rows(do, poisoned)))
    assert_close_rel(dk[:, 32:64], ref["dkey"][:, 32:64], 5e-5, "dkey")
    assert_close_rel(dv[:, 32:64], ref["dvalue"][:, 32:64], 5e-5, "dvalue")
    assert_close_rel(dq[:, 32:96], ref["dquery"][:, 32:96], 5e-5, "dquery")


# --------------------------------------------------------------------------------------------------
# jit / grad / lse gradient / interpreters
# --------------------------------------------------------------------------------------------------

def test_jit_grad_loss(rng):
    B, S, H, D = 1, 64, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.float32) for _ in range(3))
    aux = jnp.asarray(rng.standard_normal((H,)), jnp.float32)
    options = FlashOptions.build(head_dim=D, causal=True)

    @jax.jit
    def loss(q, k, v, aux):
        o = flash_attention_pallas(q, k, v, options=options, softmax_aux=aux, block_q=32, block_k=32)
        return jnp.sum(o ** 2)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, aux)
    o_ref = numpy_reference_with_grads(dict(query=q, key=k, value=v, softmax_aux=aux),
                                       np.zeros((B, S, H, D)), causal=True)["out"]
    ref = numpy_reference_with_grads(dict(query=q, key=k, value=v, softmax_aux=aux), 2 * o_ref, causal=True)
    for g, name in zip(grads, ("dquery", "dkey", "dvalue", "dsoftmax_aux")):
        assert_close_rel(np.asarray(g, np.float64), ref[name], 5e-5, name)


def test_lse_gradient(rng):
    """Cotangents on lse (ring attention merges partial results by lse) flow into q, k, bias, sinks."""
    torch = pytest.importorskip("torch")
    B, Sq, Sk, H, D = 1, 48, 64, 2, 16
    inp = _inputs(rng, B=B, Sq=Sq, Sk=Sk, Hq=H, Hkv=H, D=D, Dv=D, bias_shape=(1, H, Sq, Sk),
                  mask_shape=None, segments=False, sinks_shape=(H, 2))
    dout = rng.standard_normal((B, Sq, H, D))
    dlse = rng.standard_normal((B, H, Sq))
    out, lse, vjp = _pallas(inp, jnp.float32, (16, 32), dict(causal=True))
    (grads,) = vjp((jnp.asarray(dout, jnp.float32), jnp.asarray(dlse, jnp.float32)))

    leaves = {n: torch.tensor(inp[n], dtype=torch.float64, requires_grad=True) for n in grads}
    o_r, lse_r = reference.reference_attention(leaves["query"], leaves["key"], leaves["value"], causal=True,
                                               bias=leaves["bias"], softmax_aux=leaves["softmax_aux"])
    loss = (o_r * torch.tensor(dout)).sum() + (lse_r * torch.tensor(dlse)).sum()
    ref = torch.autograd.grad(loss, [leaves[n] for n in grads])
    for (name, g), r in zip(grads.items(), ref):
        assert_close_rel(np.asarray(g, np.float64), r.numpy(), 5e-5, "d" + name)


def test_constant_bias_and_lse_only_gradients(rng):
    """A bias that is not differentiated gets no dbias pass; a loss on lse alone (dout a symbolic zero)."""
    torch = pytest.importorskip("torch")
    B, S, H, D = 1, 32, 2, 16
    inp = _inputs(rng, B=B, Sq=S, Sk=S, Hq=H, Hkv=H, D=D, Dv=D, bias_shape=(1, 1, S, S),
                  mask_shape=None, segments=False, sinks_shape=None)
    q, k, v, bias = (jnp.asarray(inp[n]) for n in ("query", "key", "value", "bias"))
    options = FlashOptions.build(head_dim=D, causal=True)
    lse_of = lambda q, k: flash_attention_pallas(q, k, v, options=options, bias=bias, return_lse=True,
                                                 block_q=16, block_k=16)[1]
    grad = jax.jit(jax.grad(lambda q, k: jnp.sum(lse_of(q, k)), argnums=(0, 1)))
    assert "f32[1,2,32,32]" not in str(jax.make_jaxpr(grad)(q, k))   # no dbias output allocated
    dq, dk = grad(q, k)

    tq, tk = (torch.tensor(inp[n], dtype=torch.float64, requires_grad=True) for n in ("query", "key"))
    _, lse_r = reference.reference_attention(tq, tk, inp["value"], causal=True, bias=inp["bias"])
    rq, rk = torch.autograd.grad(lse_r.sum(), [tq, tk])
    assert_close_rel(np.asarray(dq, np.float64), rq.numpy(), 5e-5, "dquery")
    assert_close_rel(np.asarray(dk, np.float64), rk.numpy(), 5e-5, "dkey")


def test_tpu_faithful_interpreter(rng):
    """pltpu.InterpretParams: scratch starts as NaN and out-of-bounds reads raise."""
    check_case(rng, Sq=24, Sk=40, Hq=2, Hkv=1, D=16, causal=True, sliding_window=(12, None), segments=True,
               bias_shape=(1, 2, 24, 40), sinks_shape=(2,), block=(16, 16), interpret=pltpu.InterpretParams())


def test_force_tpu_interpret_mode(rng):
    inp = _inputs(rng, B=1, Sq=32, Sk=32, Hq=2, Hkv=2, D=16, Dv=16, bias_shape=None,
                  mask_shape=None, segments=False, sinks_shape=None)
    ref = numpy_reference_with_grads(inp, np.zeros((1, 32, 2, 16)), causal=True)
    with pltpu.force_tpu_interpret_mode():
        # interpret=False: the TPU path (tiling checks included) with the interpreter forced underneath
        out, _, _ = _pallas(inp, jnp.float32, (8, 32), dict(causal=True), interpret=False)
    assert_close_rel(np.asarray(out, np.float64), ref["out"], 2e-5, "out")


@pytest.mark.parametrize("dtype,S,D", [("bfloat16", 256, 128), ("float32", 200, 64)])
def test_lowers_for_tpu(dtype, S, D):
    """Forward and backward lower to Mosaic TPU custom calls (jax.export; no TPU needed).

    Catches Pallas-TPU lowering errors (block shapes, SMEM/VMEM use, unsupported ops) that the
    interpreter never sees; Mosaic's own compile still only runs on a TPU.
    """
    from jax import export
    H, Hkv = 4, 2
    sds = jax.ShapeDtypeStruct
    args = (sds((1, S, H, D), dtype), sds((1, S, Hkv, D), dtype), sds((1, S, Hkv, D), dtype),
            sds((1, H, S, S), jnp.float32), sds((1, 1, S, S), jnp.bool_), sds((1, S), jnp.int32),
            sds((H,), jnp.float32))
    options = FlashOptions.build(head_dim=D, causal=True, sliding_window=(64, None), logits_soft_cap=30.0)

    def f(q, k, v, bias, mask, seg, aux):
        return flash_attention_pallas(q, k, v, options=options, bias=bias, attention_mask=mask,
                                      q_segment_ids=seg, softmax_aux=aux, return_lse=True, interpret=False)

    def loss(*a):
        out, lse = f(*a)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse))

    for fn, n_kernels in ((f, 1), (jax.grad(loss, argnums=(0, 1, 2, 3, 6)), 3)):
        module = export.export(jax.jit(fn), platforms=["tpu"])(*args).mlir_module()
        assert module.count("tpu_custom_call") == n_kernels


def test_tpu_tiling_checked():
    q = jnp.zeros((1, 256, 1, 64), jnp.bfloat16)
    options = FlashOptions.build(head_dim=64)
    with pytest.raises(ValueError, match="block_k=64 must be a multiple of 128"):
        flash_attention_pallas(q, q, q, options=options, block_k=64, interpret=False)
    with pytest.raises(ValueError, match="block_q=24 must be a multiple of 16"):
        flash_attention_pallas(q, q, q, options=options, block_q=24, interpret=False)


def test_return_lse_false(rng):
    q = jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32)
    out = flash_attention_pallas(q, q, q, options=FlashOptions.build(head_dim=16))
    assert isinstance(out, jax.Array) and out.shape == (1, 16, 2, 16)


# --------------------------------------------------------------------------------------------------
# options it lacks, static arguments
# --------------------------------------------------------------------------------------------------

def test_unsupported_dropout():
    opts = FlashOptions.build(head_dim=16, dropout_prob=0.1)
    with pytest.raises(ValueError, match=r"dropout_prob.*'xla'.*'triton'"):
        check_pallas_supported(opts)
    q = jnp.zeros((1, 16, 1, 16))
    with pytest.raises(ValueError, match="dropout_prob"):
        flash_attention_pallas(q, q, q, options=opts, dropout_seed=1)


def test_unsupported_varlen():
    with pytest.raises(ValueError, match=r"varlen.*'xla'.*'triton'"):
        check_pallas_supported(FlashOptions.build(head_dim=16), varlen=True)
    check_pallas_supported(FlashOptions.build(head_dim=16, causal=True, sliding_window=4, logits_soft_cap=5.0))


@pytest.mark.parametrize("bad", [0, 12, -8, 8.0])
def test_block_sizes_checked(bad):
    with pytest.raises(ValueError, match="block_q"):
        BlockSizes(block_q=bad)
    assert hash(BlockSizes(64, 128)) == hash(BlockSizes(64, 128))
