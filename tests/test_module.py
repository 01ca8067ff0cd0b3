"""dualattn.attention / Attention / MaskInfo and the implementation registry (CPU, tiny shapes)."""
from __future__ import annotations

import numpy as np
import pytest

import dualattn
from dualattn import executor as ex
from dualattn import module as mod
from dualattn.kernels.flash import plan

torch = pytest.importorskip("torch")


def _qkv(gen, b=2, s=32, hq=4, hkv=2, d=16, grad=False):
    q = torch.randn(b, s, hq, d, generator=gen, requires_grad=grad)
    k = torch.randn(b, s, hkv, d, generator=gen, requires_grad=grad)
    v = torch.randn(b, s, hkv, d, generator=gen, requires_grad=grad)
    return q, k, v


def test_torch_in_torch_out_matches_flash_forward_and_backward(torch_gen):
    import dualattn.torch_api as dt
    q, k, v = _qkv(torch_gen, grad=True)
    out = dualattn.attention(q, k, v, causal=True, logits_soft_cap=5.0)
    ref = dt.flash_attention(q, k, v, causal=True, logits_soft_cap=5.0)
    assert isinstance(out, torch.Tensor) and torch.equal(out, ref)
    g = torch.randn_like(out, generator=None)
    got = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_jax_in_jax_out_and_mask_info_through_jit(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import dualattn.jax_api as dj
    q = jnp.asarray(rng.standard_normal((2, 32, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 32, 2, 16)), jnp.float32)
    info = dualattn.MaskInfo.from_lengths(jnp.array([32, 20]), seqlen_q=32)
    f = jax.jit(lambda q, k, info: dualattn.attention(q, k, k, causal=True, mask_info=info))
    out = f(q, k, info)
    assert isinstance(out, jax.Array)
    ref = dj.flash_attention(q, k, k, causal=True, q_segment_ids=info.q_segment_ids,
                             kv_segment_ids=info.kv_segment_ids)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6)
    assert float(jnp.abs(out[1, 20:]).max()) == 0.0   # padded query rows give zeros


def test_mixed_frameworks_and_unknown_algorithm_are_rejected(torch_gen):
    jnp = pytest.importorskip("jax.numpy")
    q, k, v = _qkv(torch_gen)
    with pytest.raises(TypeError, match="key"):
        dualattn.attention(q, jnp.asarray(k.numpy()), v)
    with pytest.raises(ValueError, match="algorithm"):
        dualattn.attention(q, k, v, algorithm="nope")


def test_missing_implementation_lists_the_registry(torch_gen, monkeypatch):
    q, k, v = _qkv(torch_gen)
    with pytest.raises(mod.NoImplementationError, match="registered: .*flash/torch/triton"):
        dualattn.attention(q, k, v, algorithm="flash", backend="pallas")
    # An entry whose module is absent from the install says so (ring / nsa before they land).
    monkeypatch.setitem(mod._IMPLEMENTATIONS, ("ring", "torch", "triton"), mod.Implementation(
        "ring", "torch", "triton", "dualattn.torch_api.no_such_module:ring_attention", mod._RING_ARGS))
    with pytest.raises(mod.NoImplementationError, match="no_such_module is not part of this install"):
        dualattn.attention(q, k, v, algorithm="ring")


def test_options_an_algorithm_does_not_take_are_rejected(torch_gen):
    q, k, v = _qkv(torch_gen)
    with pytest.raises(ValueError, match="'blocksparse' does not take bias"):
        dualattn.attention(q, k, v, algorithm="blocksparse", bias=torch.zeros(1, 1, 32, 32))
    info = dualattn.MaskInfo(layout=dualattn.SparseMask.from_block_map(np.ones((1, 1, 1, 1), bool), 32, 32))
    with pytest.raises(ValueError, match="mask_info.layout"):
        dualattn.attention(q, k, v, algorithm="flash", mask_info=info)
    with pytest.raises(ValueError, match="causal by definition"):
        mod._arguments(mod.get_implementation("nsa", "torch"), q, k, None, {**mod._DEFAULTS, "causal": False})


def test_padding_mask_info_equals_a_dense_mask(torch_gen):
    import dualattn.torch_api as dt
    q, k, v = _qkv(torch_gen)
    padding = torch.ones(2, 32, dtype=torch.bool)
    padding[1, 20:] = False
    info = dualattn.MaskInfo.from_padding(padding)
    out = dualattn.attention(q, k, v, causal=True, mask_info=info)
    dense = (padding[:, None, :, None] & padding[:, None, None, :])
    ref = dt.flash_attention(q, k, v, causal=True, attention_mask=dense)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    assert out[1, 20:].abs().max() == 0


def test_auto_picks_blocksparse_where_flash_cannot_skip_and_flash_otherwise(torch_gen, monkeypatch):
    """Flash narrows each query tile to the key tiles between the first and the last whose ids meet its
    own (kernels/flash/segments.py), so documents packed in order run flash; interleaved ones, whose
    span flash must visit whole, run blocksparse."""
    monkeypatch.setattr(mod, "AUTO_BLOCK", 32)   # 32-token tiles keep the interpreted problem small
    q, k, v = _qkv(torch_gen, b=1, s=256, hq=2, hkv=2)
    in_order = dualattn.MaskInfo(q_segment_ids=torch.arange(256).div(32, rounding_mode="floor")[None])
    # four streams of 32-token blocks, interleaved: block j holds stream j % 4
    interleaved = dualattn.MaskInfo(q_segment_ids=torch.arange(256).div(32, rounding_mode="floor")[None] % 4)
    dense_info = dualattn.MaskInfo(q_segment_ids=torch.zeros(1, 256, dtype=torch.int64))
    # each query block's span is its own block: everything flash visits is active
    assert in_order.block_density(heads=2, seqlen_q=256, seqlen_k=256, causal=True) == pytest.approx(1.0)
    # not causal: each query block spans 5 key blocks (its stream's first to last), 2 of them its stream's
    assert interleaved.block_density(heads=2, seqlen_q=256, seqlen_k=256) == pytest.approx(0.4)
    assert mod.choose_algorithm(q, k, interleaved) == "blocksparse"
    for info in (in_order, dense_info):
        assert mod.choose_algorithm(q, k, info, causal=True) == "flash"
    assert mod.choose_algorithm(q, k, None) == "flash"
    ran = []
    real = mod.get_implementation
    monkeypatch.setattr(mod, "get_implementation", lambda a, p, b="auto": ran.append(a) or real(a, p, b))
    out = dualattn.attention(q, k, v, mask_info=interleaved)
    ref = dualattn.attention(q, k, v, mask_info=interleaved, algorithm="flash")
    assert ran == ["blocksparse", "flash"]
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_config_pins_the_launch_config_and_autotune_scopes(torch_gen, monkeypatch):
    q, k, v = _qkv(torch_gen)
    tile = plan.TileConfig(16, 16, 4, 1)
    pinned = plan.FlashConfig(tile, tile, tile)
    seen = []
    real = ex.Executor.select_with_source

    def spy(self, algorithm, **kw):
        got = real(self, algorithm, **kw)
        seen.append((got, ex._autotune_enabled(kw.get("autotune"))))
        return got
    monkeypatch.setattr(ex.Executor, "select_with_source", spy)
    monkeypatch.delenv(ex.AUTOTUNE_ENV, raising=False)
    dualattn.attention(q, k, v, config=ex._encode_flash(pinned), autotune=True)
    assert seen[-1] == ((pinned, "override"), True)
    dualattn.Attention("flash", causal=True)(q, k, v)
    assert seen[-1][0][1] != "override" and seen[-1][1] is False
    with pytest.raises(ValueError, match="config"):
        dualattn.attention(q, k, v, config={"fwd": [3, 3, 3, 3]})


def test_attention_object_keeps_its_settings(torch_gen):
    q, k, v = _qkv(torch_gen)
    layer = dualattn.Attention("flash", causal=True, sliding_window=(8, 0))
    torch.testing.assert_close(layer(q, k, v), dualattn.attention(q, k, v, causal=True, sliding_window=(8, 0)))
    torch.testing.assert_close(layer(q, k, v, sliding_window=None), dualattn.attention(q, k, v, causal=True))
    assert "flash" in repr(layer)


def test_options_of_attention_and_Attention_are_checked(torch_gen):
    """Bools must be bools (causal="yes" once ran causal), names strings among those registered, and
    the window, soft cap, scale and dropout are checked as flash_attention checks them, by
    dualattn.attention before any dispatch and by dualattn.Attention when it is made."""
    q, k, v = _qkv(torch_gen)
    bad = [(dict(causal="yes"), TypeError, "causal"), (dict(causal=1), TypeError, "causal"),
           (dict(return_lse="no"), TypeError, "return_lse"), (dict(autotune="yes"), TypeError, "autotune"),
           (dict(sliding_window=-2), ValueError, "sliding_window"), (dict(sliding_window=1.5), TypeError,
                                                                    "sliding_window"),
           (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"), (dict(logits_soft_cap="3"), TypeError,
                                                                         "logits_soft_cap"),
           (dict(softmax_scale="0.5"), TypeError, "softmax_scale"), (dict(softmax_scale=0.0), ValueError,
                                                                    "softmax_scale"),
           (dict(dropout_prob=1.0), ValueError, "dropout_prob"), (dict(dropout_prob="0.1"), TypeError,
                                                                 "dropout_prob"),
           (dict(algorithm=1), TypeError, "algorithm"), (dict(algorithm="flsh"), ValueError, "algorithm"),
           (dict(backend=None), TypeError, "backend")]
    for kwargs, error, name in bad:
        with pytest.raises(error, match=name):
            dualattn.attention(q, k, v, **kwargs)
        algorithm = kwargs.pop("algorithm", "auto")
        with pytest.raises(error, match=name):
            dualattn.Attention(algorithm, **kwargs)
    # numpy bools are bools; the checked call still runs
    out = dualattn.attention(q, k, v, causal=np.bool_(True), autotune=False)
    assert torch.equal(out, dualattn.attention(q, k, v, causal=True))


def test_mask_info_constructors_check_their_arguments():
    """from_padding: a (B, Sk) bool or integer mask, seqlen_q <= Sk; from_lengths: int (B,) lengths in
    [0, seqlen]; each error names the argument the user passed."""
    pad = torch.ones(2, 16, dtype=torch.bool)
    bad = [(lambda: dualattn.MaskInfo.from_padding(pad.float()), TypeError, "padding_mask"),
           (lambda: dualattn.MaskInfo.from_padding(pad[None]), ValueError, "padding_mask"),
           (lambda: dualattn.MaskInfo.from_padding(pad[0]), ValueError, "padding_mask"),
           (lambda: dualattn.MaskInfo.from_padding([[True, False]]), TypeError, "padding_mask"),
           (lambda: dualattn.MaskInfo.from_padding(pad, seqlen_q=17), ValueError, "seqlen_q"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([-1, 5]), seqlen_q=16), ValueError, "q_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([17, 5]), seqlen_q=16), ValueError, "q_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([4, 5]), torch.tensor([3, 9]), seqlen_q=16,
                                                   seqlen_k=8), ValueError, "kv_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([4, 5]), torch.tensor([3]), seqlen_q=16),
            ValueError, "kv_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([4.0, 5.0]), seqlen_q=16), TypeError, "q_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([[4, 5]]), seqlen_q=16), ValueError, "q_lengths"),
           (lambda: dualattn.MaskInfo.from_lengths(torch.tensor([4, 5]), seqlen_q="16"), TypeError, "seqlen_q")]
    for call, error, name in bad:
        with pytest.raises(error, match=name):
            call()
    # the edges are valid: no real token, every token real; an int mask
    info = dualattn.MaskInfo.from_lengths(torch.tensor([0, 16]), seqlen_q=16)
    assert info.q_segment_ids[0].eq(-2).all() and info.kv_segment_ids[1].eq(0).all()
    assert torch.equal(dualattn.MaskInfo.from_padding(pad.int()).kv_segment_ids, torch.zeros(2, 16, dtype=torch.int32))


def test_mask_info_of_the_wrong_shape_names_what_the_user_gave(torch_gen):
    """A padding mask or lengths made for other shapes than the call's: the error names
    from_padding(padding_mask) / from_lengths(q_lengths), not the q_segment_ids built from them."""
    q, k, v = _qkv(torch_gen, b=2, s=32)
    cases = [(dualattn.MaskInfo.from_padding(torch.ones(2, 40, dtype=torch.bool)), r"from_padding\(padding_mask\)"),
             (dualattn.MaskInfo.from_padding(torch.ones(3, 32, dtype=torch.bool)), r"from_padding\(padding_mask\)"),
             (dualattn.MaskInfo.from_lengths(torch.tensor([3, 4, 5]), seqlen_q=32), r"from_lengths\(q_lengths\)"),
             (dualattn.MaskInfo.from_lengths(torch.tensor([3, 4]), torch.tensor([3, 4]), seqlen_q=32, seqlen_k=16),
              r"from_lengths\(kv_lengths\)"),
             (dualattn.MaskInfo(q_segment_ids=torch.zeros(32, dtype=torch.int32)), r"mask_info\.q_segment_ids")]
    for info, name in cases:
        for algorithm in ("auto", "flash", "blocksparse"):
            with pytest.raises(ValueError, match=name):
                dualattn.attention(q, k, v, mask_info=info, algorithm=algorithm)
