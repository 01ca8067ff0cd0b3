"""TMA tile loads (rules.row_tiles) against pointer loads: the same kernel, the same bits.

Both launchers ask for TMA with DUALATTN_TMA=1 (Hopper and the interpreter; plan.tma_requested).
Both variants must give bit-identical outputs and gradients (only how tiles reach shared memory
differs), including where TMA's hardware zero-fill replaces the pointer path's predicates:
ragged sequence ends, head dims below the tile width, varlen sequences, GQA, block-sparse.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualattn import SparseMask, masks  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.torch_api import blocksparse_attention, flash_attention, flash_attn_varlen_func  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402


def _grads(fn, inputs, dout):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out.detach()] + [g.detach() for g in torch.autograd.grad(out, leaves, dout)]


def _tma_flags(monkeypatch, fn, inputs, dout):
    """Run with TMA allowed, then with DUALATTN_TMA=0; return both results and the TMA flags
    the plans carried (so a test cannot pass by never taking the TMA path)."""
    flags = []
    real_fwd, real_bwd = flash_plan.plan_forward, flash_plan.plan_backward

    def fwd(*a, **k):
        launch = real_fwd(*a, **k)
        flags.append(launch.constexpr_dict["TMA"])
        return launch

    def bwd(*a, **k):
        plan = real_bwd(*a, **k)
        flags.append(plan.dkdv.constexpr_dict["TMA"] and plan.dq.constexpr_dict["TMA"])
        return plan

    monkeypatch.setattr(flash_plan, "plan_forward", fwd)
    monkeypatch.setattr(flash_plan, "plan_backward", bwd)
    set_switch(monkeypatch, "DUALATTN_WS", "0")   # the same forward tiles in both runs (test_warp_specialize.py)
    set_switch(monkeypatch, "DUALATTN_TMA", "1")
    with_tma = _grads(fn, inputs, dout)
    set_switch(monkeypatch, "DUALATTN_TMA", "0")
    without = _grads(fn, inputs, dout)
    return with_tma, without, flags


def _assert_same_bits(with_tma, without, flags, forward_tma=True):
    assert flags == [forward_tma, True, False, False], flags
    for name, a, b in zip(("out", "dq", "dk", "dv"), with_tma, without):
        assert torch.equal(a, b), f"{name}: max diff {float((a.float() - b.float()).abs().max())}"


def _randn(*shape, device="cpu", dtype=torch.float32, gen=None):
    return torch.randn(*shape, device=device, dtype=dtype, generator=gen)


CPU_CASES = {
    "ragged-causal-gqa": dict(sq=77, sk=130, hq=4, hkv=2, d=48, opts=dict(causal=True)),
    "window-softcap": dict(sq=96, sk=96, hq=2, hkv=2, d=32, opts=dict(sliding_window=(20, 3), logits_soft_cap=5.0)),
    "bias-sinks": dict(sq=65, sk=65, hq=2, hkv=1, d=16, opts=dict(causal=True), bias=True, sinks=True),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_tma_matches_pointer_loads_interpreted(case, monkeypatch):
    c = CPU_CASES[case]
    gen = torch.Generator().manual_seed(7)
    q = _randn(2, c["sq"], c["hq"], c["d"], gen=gen)
    k, v = (_randn(2, c["sk"], c["hkv"], c["d"], gen=gen) for _ in range(2))
    dout = _randn(2, c["sq"], c["hq"], c["d"], gen=gen)
    extra = dict(c["opts"])
    if c.get("bias"):
        extra["bias"] = _randn(1, c["hq"], c["sq"], c["sk"], gen=gen)
    if c.get("sinks"):
        extra["softmax_aux"] = _randn(c["hq"], 2, gen=gen)
    _assert_same_bits(*_tma_flags(monkeypatch, lambda a, b, d: flash_attention(a, b, d, **extra), (q, k, v), dout))


def test_tma_matches_pointer_loads_varlen_interpreted(monkeypatch):
    lens = [5, 70, 33]
    cu = torch.tensor([0, 5, 75, 108], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    q, k, v, dout = (_randn(108, 2, 32, gen=gen) for _ in range(4))
    fn = lambda a, b, d: flash_attn_varlen_func(a, b, d, cu, cu, max(lens), max(lens), causal=True)  # noqa: E731
    _assert_same_bits(*_tma_flags(monkeypatch, fn, (q, k, v), dout))


def test_tma_is_opt_in(monkeypatch, forward_plan_flags):
    flags = forward_plan_flags("TMA")
    set_switch(monkeypatch, "DUALATTN_TMA", None)
    q = torch.randn(1, 32, 2, 16)
    flash_attention(q, q, q)
    set_switch(monkeypatch, "DUALATTN_TMA", "1")
    flash_attention(q, q, q)
    assert flags == [False, True]


def test_misaligned_base_takes_pointer_loads(monkeypatch, forward_plan_flags):
    # A view starting 2 elements in is not 16-byte aligned: TMA would fault, so the plan must not use it.
    set_switch(monkeypatch, "DUALATTN_TMA", "1")
    flags = forward_plan_flags("TMA")
    buf = torch.randn(2 * 32 * 2 * 16 + 2)
    q = buf[2:].view(2, 32, 2, 16)
    flash_attention(q, q, q)
    assert flags == [False]


GPU_CASES = {
    "d128-causal-ragged": dict(b=2, sq=4000, sk=4000, hq=8, hkv=8, d=128, opts=dict(causal=True)),
    "d64-full": dict(b=2, sq=4096, sk=4096, hq=8, hkv=8, d=64, opts={}),
    "d96-gqa-cross": dict(b=1, sq=1000, sk=3001, hq=8, hkv=2, d=96, opts=dict(causal=True)),
    "window-dropout": dict(b=1, sq=2048, sk=2048, hq=4, hkv=4, d=128,
                           opts=dict(sliding_window=(256, 0), dropout_prob=0.1, dropout_seed=5)),
    "fp32": dict(b=1, sq=1024, sk=1024, hq=4, hkv=4, d=64, opts=dict(causal=True), dtype=torch.float32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_tma_matches_pointer_loads(case, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90 or later; older GPUs always take pointer loads")
    c = GPU_CASES[case]
    dtype = c.get("dtype", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(11)
    q = _randn(c["b"], c["sq"], c["hq"], c["d"], device="cuda", dtype=dtype, gen=gen)
    k, v = (_randn(c["b"], c["sk"], c["hkv"], c["d"], device="cuda", dtype=dtype, gen=gen) for _ in range(2))
    dout = _randn(c["b"], c["sq"], c["hq"], c["d"], device="cuda", dtype=dtype, gen=gen)
    fn = lambda a, b, d: flash_attention(a, b, d, **c["opts"])  # noqa: E731
    _assert_same_bits(*_tma_flags(monkeypatch, fn, (q, k, v), dout))


@pytest.mark.gpu
def test_gpu_tma_block_sparse_matches_pointer_loads(monkeypatch):
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("TMA needs sm_90 or later; older GPUs always take pointer loads")
    gen = torch.Generator(device="cuda").manual_seed(2)
    q, k, v, dout = (_randn(1, 2048, 4, 128, device="cuda", dtype=torch.bfloat16, gen=gen) for _ in range(4))
    layout = SparseMask.from_block_map((masks.causal() & masks.local((512, 0)))(1, 4, 2048, 2048, 128, 128), 128, 128)
    fn = lambda a, b, d: blocksparse_attention(a, b, d, layout=layout, causal=True, sliding_window=(512, 0))  # noqa: E731
    # The block-sparse forward runs 2-stage tiles, which the plan keeps on pointer loads (ptxas 3.6).
    _assert_same_bits(*_tma_flags(monkeypatch, fn, (q, k, v), dout), forward_tma=False)
