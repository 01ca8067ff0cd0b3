"""dualattn.torch_api.scaled_dot_product_attention: a drop-in for torch.nn.functional.scaled_dot_product_attention.

BHSD layout, torch's own semantics (including is_causal, which torch aligns top-left when Sq != Sk);
compared against torch's SDPA run in float64 on the same rounded inputs.  Every call torch accepts is
accepted (any batch rank, any head dim, broadcast masks and heads), with torch's result; what torch
rejects raises (RuntimeError, as torch's, that is also a ValueError / TypeError naming the argument).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from dualattn.torch_api import scaled_dot_product_attention  # noqa: E402
from reference import assert_close_rel  # noqa: E402

TOL = {torch.float32: (1e-5, 2e-5), torch.float16: (1e-2, 1e-2), torch.bfloat16: (1e-2, 1e-2)}


def _run(gen, dtype, B, Hq, Hkv, Sq, Sk, D, mask_kind=None, **kw):
    q = torch.randn(B, Hq, Sq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, generator=gen).to(dtype)
    mask = None
    if mask_kind == "bool_2d":
        mask = torch.rand(Sq, Sk, generator=gen) < 0.7
        mask[:, 0] = True                                   # no fully masked rows: torch gives NaN there
    elif mask_kind == "bool_4d":
        mask = torch.rand(B, 1, Sq, Sk, generator=gen) < 0.7
        mask[..., 0] = True
    elif mask_kind == "float_4d":
        mask = torch.randn(B, Hq, Sq, Sk, generator=gen).to(dtype)
    elif mask_kind == "float_bcast":
        mask = torch.randn(1, Hq, 1, Sk, generator=gen).to(dtype)   # broadcast over rows (a padding bias)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rleaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    args = [mask] if mask is None or mask.dtype == torch.bool else [mask.clone().requires_grad_()]
    rargs = [mask] if mask is None or mask.dtype == torch.bool else [mask.detach().double().requires_grad_()]
    out = scaled_dot_product_attention(*leaves, attn_mask=args[0], **kw)
    ref = F.scaled_dot_product_attention(*rleaves, attn_mask=rargs[0], **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    tol_o, tol_g = TOL[dtype]
    assert_close_rel(out, ref, tol_o, "out")
    dout = torch.randn(out.shape, generator=gen).to(dtype)
    diff = leaves + ([args[0]] if args[0] is not None and args[0].requires_grad else [])
    rdiff = rleaves + ([rargs[0]] if rargs[0] is not None and rargs[0].requires_grad else [])
    g = torch.autograd.grad(out, diff, dout)
    rg = torch.autograd.grad(ref, rdiff, dout.double())
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), g, rg):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        assert_close_rel(a, b, tol_g, name)


CASES = {
    "plain": dict(B=2, Hq=2, Hkv=2, Sq=48, Sk=48, D=32),
    "causal_square": dict(B=2, Hq=2, Hkv=2, Sq=48, Sk=48, D=32, is_causal=True),
    "causal_sq_lt_sk_top_left": dict(B=1, Hq=2, Hkv=2, Sq=20, Sk=50, D=32, is_causal=True),
    "causal_sq_gt_sk_top_left": dict(B=1, Hq=2, Hkv=2, Sq=50, Sk=20, D=32, is_causal=True),
    "scale": dict(B=1, Hq=2, Hkv=2, Sq=30, Sk=40, D=64, scale=0.2),
    "gqa": dict(B=1, Hq=4, Hkv=2, Sq=33, Sk=33, D=32, enable_gqa=True, is_causal=True),
    "mask_bool_2d": dict(B=2, Hq=2, Hkv=2, Sq=40, Sk=56, D=32, mask_kind="bool_2d"),
    "mask_bool_4d": dict(B=2, Hq=2, Hkv=2, Sq=40, Sk=40, D=32, mask_kind="bool_4d"),
    "mask_float_4d": dict(B=2, Hq=2, Hkv=2, Sq=40, Sk=40, D=32, mask_kind="float_4d"),
    "mask_float_bcast": dict(B=2, Hq=2, Hkv=2, Sq=24, Sk=40, D=32, mask_kind="float_bcast"),
    "hd80": dict(B=1, Hq=2, Hkv=2, Sq=40, Sk=40, D=80, is_causal=True),
}


@pytest.mark.parametrize("name,dtype", [pytest.param(n, torch.float32, id=f"{n}-fp32") for n in CASES]
                         + [pytest.param(n, dt, id=f"{n}-{str(dt)[6:]}") for n in ("causal_square", "gqa")
                            for dt in (torch.float16, torch.bfloat16)])
def test_sdpa_matches_torch(name, dtype, torch_gen):
    _run(torch_gen, dtype, **CASES[name])


def test_sdpa_dropout_runs(torch_gen):
    q, k, v = (torch.randn(1, 2, 32, 32, generator=torch_gen) for _ in range(3))
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    b = scaled_dot_product_attention(q, k, v)
    assert a.shape == b.shape and torch.isfinite(a).all() and not torch.equal(a, b)


def test_sdpa_bhsd_non_contiguous(torch_gen):
    """A BSHD tensor viewed as BHSD (the usual `x.view(B, S, H, D).transpose(1, 2)`) works."""
    q, k, v = (torch.randn(2, 40, 2, 32, generator=torch_gen).transpose(1, 2) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_close_rel(out, ref, 1e-5, "out")


def _compare(q, k, v, attn_mask=None, tol=(1e-5, 2e-5), **kw):
    """Output and gradients (query, key, value and a float mask) against torch's SDPA in float64."""
    float_mask = attn_mask is not None and attn_mask.is_floating_point()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([attn_mask.clone().requires_grad_()]
                                                                if float_mask else [])
    rleaves = [t.detach().double().requires_grad_() for t in leaves]
    mask, rmask = (leaves[3], rleaves[3]) if float_mask else (attn_mask, attn_mask)
    out = scaled_dot_product_attention(*leaves[:3], attn_mask=mask, **kw)
    ref = F.scaled_dot_product_attention(*rleaves[:3], attn_mask=rmask, **kw)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert out.is_contiguous() or not q.is_contiguous()
    assert_close_rel(out, ref, tol[0], "out")
    dout = torch.randn(out.shape, dtype=out.dtype)
    for name, a, b in zip(("dq", "dk", "dv", "dmask"), torch.autograd.grad(out, leaves, dout),
                          torch.autograd.grad(ref, rleaves, dout.double())):
        assert a.shape == b.shape, (name, a.shape, b.shape)
        if b.abs().max() < 1e-12:   # a mask constant along each row: its gradient is exactly 0
            assert a.abs().max() < 1e-4, name
        else:
            assert_close_rel(a, b, tol[1], name)
    return out


def _qkv(gen, q_shape, k_shape, dv=None, dtype=torch.float32):
    v_shape = k_shape[:-1] + (dv or k_shape[-1],)
    return [torch.randn(s, generator=gen).to(dtype) for s in (q_shape, k_shape, v_shape)]


@pytest.mark.parametrize("q_shape,k_shape,kw", [
    ((20, 16), (24, 16), {}),                                     # no batch dims
    ((3, 20, 16), (3, 24, 16), dict(is_causal=True)),             # one batch dim
    ((2, 2, 3, 20, 16), (2, 2, 3, 24, 16), {}),                   # three batch dims
    ((4, 20, 16), (2, 24, 16), dict(enable_gqa=True)),            # GQA over a 3-D call
    ((2, 1, 4, 20, 16), (2, 1, 2, 24, 16), dict(enable_gqa=True, is_causal=True)),
    ((2, 4, 20, 16), (2, 1, 24, 16), {}),                         # one key head, broadcast (no flag)
    ((1, 2, 20, 8), (1, 2, 24, 8), {}),                           # head dim 8: below the kernels' 16
    ((1, 2, 20, 300), (1, 2, 24, 300), {}),                       # head dim 300: above their 256
    ((2, 3, 20, 16), (1, 3, 24, 16), {}),                         # batch broadcast (torch's own path)
])
def test_sdpa_any_batch_rank_and_head_dim(q_shape, k_shape, kw, torch_gen):
    _compare(*_qkv(torch_gen, q_shape, k_shape), **kw)


def test_sdpa_value_head_dim_differs_and_kv_heads_differ_under_gqa(torch_gen):
    _compare(*_qkv(torch_gen, (1, 2, 20, 16), (1, 2, 24, 16), dv=40), is_causal=True)
    q, k, _ = _qkv(torch_gen, (1, 4, 20, 16), (1, 2, 24, 16))
    _compare(q, k, torch.randn(1, 1, 24, 16, generator=torch_gen), enable_gqa=True)


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 20, 24), (1, 2, 1, 20, 1), (3, 20, 24), (20, 1), (1, 24)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_sdpa_masks_broadcast_as_in_torch(mask_shape, kind, torch_gen):
    q, k, v = _qkv(torch_gen, (2, 2, 3, 20, 16), (2, 2, 3, 24, 16))
    if kind == "bool":
        mask = torch.rand(mask_shape, generator=torch_gen) < 0.7
        mask[..., 0] = True
    else:
        mask = torch.randn(mask_shape, generator=torch_gen)
    _compare(q, k, v, mask)


def test_sdpa_fully_masked_rows_give_zero_as_torch(torch_gen):
    """torch gives 0 (not NaN) for a row with no key to attend, under a bool mask and a float mask of -inf."""
    q, k, v = _qkv(torch_gen, (1, 2, 20, 16), (1, 2, 30, 16))
    keep = torch.rand(20, 30, generator=torch_gen) < 0.6
    keep[:, 0], keep[3] = True, False
    bias = torch.randn(20, 30, generator=torch_gen).masked_fill(~keep, float("-inf"))
    for mask in (keep, bias):
        out = _compare(q, k, v, mask)
        assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
        torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert torch.equal(torch_out[:, :, 3], out[:, :, 3])


def test_sdpa_causal_with_mask_raises_as_torch(torch_gen):
    """torch's SDPA documents that attn_mask and is_causal exclude each other (its math path raises; its
    CPU fused kernel happens to combine them)."""
    q, k, v = _qkv(torch_gen, (1, 2, 20, 16), (1, 2, 30, 16))
    bias = torch.randn(20, 30, generator=torch_gen)
    with pytest.raises(RuntimeError):   # the math path: taken for a mask that requires grad
        F.scaled_dot_product_attention(q, k, v, attn_mask=bias.requires_grad_(), is_causal=True)
    with pytest.raises(ValueError, match="attn_mask and is_causal") as info:
        scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)
    assert isinstance(info.value, RuntimeError)


def test_sdpa_float32_mask_with_half_query(torch_gen):
    q, k, v = _qkv(torch_gen, (1, 2, 20, 16), (1, 2, 24, 16), dtype=torch.float16)
    _compare(q, k, v, torch.randn(1, 2, 20, 24, generator=torch_gen), tol=(1e-2, 1e-2))


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_sdpa_any_scale(scale, torch_gen):
    _compare(*_qkv(torch_gen, (1, 2, 20, 16), (1, 2, 24, 16)), scale=scale)


def test_sdpa_output_layout_follows_query(torch_gen):
    """Contiguous for contiguous (B, H, S, D) inputs; the (B, S, H, D)-transposed layout for such a view,
    as torch's own CPU kernels return them."""
    q, k, v = _qkv(torch_gen, (2, 3, 20, 16), (2, 3, 24, 16))
    assert scaled_dot_product_attention(q, k, v).is_contiguous()
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    out = scaled_dot_product_attention(qt, k, v)
    assert out.transpose(1, 2).is_contiguous()
    assert_close_rel(out, F.scaled_dot_product_attention(q.double(), k.double(), v.double()), 1e-5, "out")


def test_sdpa_dropout_scales_kept_probabilities(torch_gen):
    """Uniform attention over ones: each row is (kept keys / Sk) / (1 - p), which averages to 1;
    dropout_p = 1 drops everything (0, as torch), and torch.manual_seed replays the same mask."""
    q, v = torch.zeros(2, 2, 64, 16), torch.ones(2, 2, 64, 16)
    p = 0.3
    torch.manual_seed(1)
    out = scaled_dot_product_attention(q, q, v, dropout_p=p)
    torch.manual_seed(1)
    assert torch.equal(out, scaled_dot_product_attention(q, q, v, dropout_p=p))
    kept = (out[..., 0] * (1 - p) * 64).round()     # whole numbers of kept keys per row
    torch.testing.assert_close(out[..., 0], kept / 64 / (1 - p))
    assert abs(out.mean().item() - 1.0) < 0.03 and (kept < 64).all()
    assert torch.equal(scaled_dot_product_attention(q, q, v, dropout_p=1.0), torch.zeros_like(v))


@pytest.mark.parametrize("mask,error", [
    (torch.ones(20, 24, dtype=torch.int32), TypeError),
    (torch.ones(20, 24, dtype=torch.uint8), TypeError),
    (torch.zeros(20, 24, dtype=torch.float64), TypeError),     # neither float32 nor query's dtype
    (torch.zeros(20, 23), ValueError),
    (torch.zeros(2, 1, 2, 20, 24), ValueError),                # more dims than the scores
])
def test_sdpa_bad_masks_raise_as_torch(mask, error, torch_gen):
    q, k, v = _qkv(torch_gen, (1, 2, 20, 16), (1, 2, 24, 16))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with pytest.raises(error, match="attn_mask") as info:
        scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert isinstance(info.value, RuntimeError)


def test_sdpa_fallback_under_patched_torch(torch_gen, monkeypatch):
    """With torch's name patched to this drop-in, a call the kernels cannot take still runs torch's own code."""
    monkeypatch.setattr(F, "scaled_dot_product_attention", scaled_dot_product_attention)
    q, k, v = _qkv(torch_gen, (1, 2, 20, 8), (1, 2, 24, 8))
    out = F.scaled_dot_product_attention(q, k, v)
    ref = torch._C._nn.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert_close_rel(out, ref, 1e-5, "out")


def test_sdpa_gqa_requires_flag(torch_gen):
    q = torch.randn(1, 4, 16, 32, generator=torch_gen)
    k = torch.randn(1, 2, 16, 32, generator=torch_gen)
    with pytest.raises((ValueError, RuntimeError)):
        scaled_dot_product_attention(q, k, k)
