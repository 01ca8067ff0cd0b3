"""Real sizes on a CUDA GPU (skipped without one): flash_attention fwd + bwd vs torch's SDPA math backend in fp32.

The reference sees the same rounded (bf16/fp16) inputs upcast to fp32; the math backend is exact enough
(fp32 accumulation, no tf32: we switch it off) to judge a 1e-2 bf16 tolerance.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from dualattn.torch_api import flash_attention, flash_attn_varlen_func  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from reference import assert_close_rel  # noqa: E402

pytestmark = pytest.mark.gpu


def _math_sdpa(q, k, v, **kw):
    """torch SDPA math backend, BSHD in / out, fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out.transpose(1, 2)


def _bottom_right_causal(sq, sk, device):
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(sk - sq)


def _check(B, S, Sk, Hq, Hkv, D, dtype, causal, tol=1e-2, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(B, S, Hq, D, device="cuda", dtype=dtype, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, causal=causal)
    gk = torch.autograd.grad(out, leaves, dout)
    torch.cuda.synchronize()

    rleaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    mask = _bottom_right_causal(S, Sk, "cuda") if causal else None
    ref = _math_sdpa(*rleaves, attn_mask=mask, enable_gqa=Hq != Hkv)
    rg = torch.autograd.grad(ref, rleaves, dout.float())
    assert out.dtype == dtype
    assert_close_rel(out, ref, tol, "out")
    for name, a, b in zip(("dq", "dk", "dv"), gk, rg):
        assert_close_rel(a, b, tol, name)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("S", [1024, 4096])
def test_gpu_bf16_fwd_bwd(S, D, causal):
    _check(B=2, S=S, Sk=S, Hq=8, Hkv=8, D=D, dtype=torch.bfloat16, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_bf16_8k(D, causal):
    _check(B=1, S=8192, Sk=8192, Hq=4, Hkv=4, D=D, dtype=torch.bfloat16, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_gqa_cross_causal(dtype):
    _check(B=2, S=1000, Sk=3000, Hq=16, Hkv=4, D=128, dtype=dtype, causal=True)


def test_gpu_decode():
    _check(B=8, S=1, Sk=4099, Hq=16, Hkv=2, D=128, dtype=torch.bfloat16, causal=True)


def test_gpu_head_dim_96_ragged():
    _check(B=1, S=1999, Sk=1999, Hq=4, Hkv=2, D=96, dtype=torch.bfloat16, causal=True)


def test_gpu_fp32_tf32_tolerance():
    _check(B=1, S=2048, Sk=2048, Hq=4, Hkv=4, D=64, dtype=torch.float32, causal=True, tol=3e-4)


def test_gpu_varlen_bf16():
    lengths = [1, 700, 2048, 3000, 129]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    T, H, D = sum(lengths), 8, 128
    gen = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, dout = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu, cu, max(lengths), max(lengths), causal=True)
    gk = torch.autograd.grad(out, leaves, dout)
    for i, n in enumerate(lengths):
        s, e = int(cu[i]), int(cu[i + 1])
        rl = [t[s:e][None].detach().float().requires_grad_() for t in (q, k, v)]
        ref = _math_sdpa(*rl, attn_mask=_bottom_right_causal(n, n, "cuda"))
        rg = torch.autograd.grad(ref, rl, dout[s:e][None].float())
        assert_close_rel(out[s:e], ref[0], 1e-2, f"out seq {i}")
        for name, a, b in zip(("dq", "dk", "dv"), gk, rg):
            assert_close_rel(a[s:e], b[0], 1e-2, f"{name} seq {i}")


def test_gpu_cached_launch_keeps_variants_apart(monkeypatch):
    # After its first launch a plan's compiled kernel is called directly (torch_api/_launch.py),
    # keyed on what Triton specialises on: a base pointer off 16-byte alignment must get its own
    # variant (the aligned one would fault or read wrong rows), and repeated calls the same bits.
    # (Without warp specialisation, which a misaligned base cannot take: the same tiles both ways.)
    set_switch(monkeypatch, "DUALATTN_WS", "0")
    from dualattn.torch_api import _launch
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 512, 4, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    first = flash_attention(q, k, v, causal=True)
    again = flash_attention(q, k, v, causal=True)
    assert torch.equal(first, again)
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=torch.bfloat16)
    q_off = buf[1:].view_as(q)  # 2 bytes past an aligned base
    q_off.copy_(q)
    assert q_off.data_ptr() % 16 != 0
    for _ in range(2):
        assert torch.equal(flash_attention(q_off, k, v, causal=True), first)
    variants = [prep.variants for prep in _launch._COMPILED.values() if prep.launch.kernel == "flash_fwd_kernel"]
    assert any(len(specs) >= 2 for specs in variants), "aligned and misaligned queries shared one variant"
