"""dualattn.torch_api.scaled_dot_product_attention: a drop-in for torch.nn.functional.scaled_dot_product_attention.

BHSD layout, torch's own semantics (including is_causal, which torch aligns top-left when Sq != Sk);
compared against torch's SDPA run in float64 on the same rounded inputs.
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


def test_sdpa_gqa_requires_flag(torch_gen):
    q = torch.randn(1, 4, 16, 32, generator=torch_gen)
    k = torch.randn(1, 2, 16, 32, generator=torch_gen)
    with pytest.raises((ValueError, RuntimeError)):
        scaled_dot_product_attention(q, k, k)
