"""The warp-specialised forward (plan.warp_specialized_forward): torch's default on sm_90.

One TMA loop over every key tile (unmasked problems only), TMA stores, WS_TILE in place of
the configured forward tile.  Checked against the float64 reference (forward, lse,
and gradients, which the portable backward computes from this forward's lse), on the CPU
interpreter (DUALATTN_WS=1; fp16, as the interpreter mis-reads bf16 descriptor loads) and on
the GPU.  Each test also checks the plan took the variant, so none can pass by never running it.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualattn.torch_api import flash_attention  # noqa: E402
from reference import assert_close_rel, reference_attention  # noqa: E402


def _check_against_reference(b, sq, sk, hq, hkv, d, opts, *, device, dtype, seed, tol, sinks=False):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    dout = torch.randn(b, sq, hq, d, device=device, dtype=dtype, generator=gen)
    extra = dict(opts)
    if sinks:
        extra["softmax_aux"] = torch.randn(hq, device=device, dtype=torch.float32, generator=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, return_lse=True, **extra)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, **extra)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert not torch.isnan(out).any()
    assert_close_rel(out, ref_out, tol, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern (rows with nothing visible)"
    assert_close_rel(lse[finite], ref_lse[finite], tol, "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, tol, name)


# (Sk * D >= 2**18: below that the plan keeps the portable kernel, plan.WS_MIN_KEY_WORK.)
CPU_CASES = {
    "full": dict(b=1, sq=128, sk=4096, hq=1, hkv=1, d=64, opts={}),
    "gqa-sinks-ragged-q": dict(b=1, sq=200, sk=2048, hq=4, hkv=2, d=128, opts={}, sinks=True),
    "cross-more-queries": dict(b=1, sq=260, sk=2048, hq=1, hkv=1, d=128, opts=dict(softmax_scale=0.3)),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_warp_specialized_forward_interpreted(case, monkeypatch, forward_plan_flags, seed):
    c = dict(CPU_CASES[case])
    monkeypatch.setenv("DUALATTN_WS", "1")
    flags = forward_plan_flags("WARP_SPECIALIZE")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cpu", dtype=torch.float16, seed=seed, tol=2e-3, **c)
    assert flags and all(flags), flags


def test_warp_specialize_off_by_default_on_cpu_and_with_ws_0(monkeypatch, forward_plan_flags):
    flags = forward_plan_flags("WARP_SPECIALIZE")
    q = torch.randn(1, 2048, 1, 128, dtype=torch.float16)
    monkeypatch.delenv("DUALATTN_WS", raising=False)
    flash_attention(q, q, q)
    monkeypatch.setenv("DUALATTN_WS", "0")
    flash_attention(q, q, q)
    monkeypatch.setenv("DUALATTN_WS", "1")
    flash_attention(q, q, q)
    assert flags == [False, False, True]


def test_misaligned_base_keeps_the_portable_forward(monkeypatch, forward_plan_flags):
    monkeypatch.setenv("DUALATTN_WS", "1")
    flags = forward_plan_flags("WARP_SPECIALIZE")
    buf = torch.randn(2048 * 128 + 2, dtype=torch.float16)
    q = buf[2:].view(1, 2048, 1, 128)
    flash_attention(q, q, q)
    assert flags == [False]


GPU_CASES = {
    "d128": dict(b=2, sq=4096, sk=4096, hq=8, hkv=8, d=128, opts={}),
    "d64-gqa-cross": dict(b=1, sq=1000, sk=4096, hq=8, hkv=2, d=64, opts={}),
    "d96-sinks-ragged-q": dict(b=1, sq=2004, sk=4096, hq=4, hkv=4, d=96, opts={}, sinks=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_warp_specialized_forward(case, monkeypatch, forward_plan_flags, seed):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised forward is chosen on sm_90 only (where it was tuned)")
    c = dict(GPU_CASES[case])
    monkeypatch.delenv("DUALATTN_WS", raising=False)   # the default
    flags = forward_plan_flags("WARP_SPECIALIZE")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cuda", dtype=torch.bfloat16, seed=seed, tol=1e-2, **c)
    assert flags and all(flags), flags
