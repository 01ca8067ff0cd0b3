"""Dropout on the Gluon kernels: the forward (forward_gluon.py) and the one-pass backward
(backward_gluon.py) drop the entries rules.dropout_keep drops, the hash every kernel applies.

On the CPU: which problems the plans send there, and that the variants compile for sm_90.  On the
GPU: forward, lse and gradients against the float64 reference, whose keep mask is the documented
hash computed in numpy (dualattn.testing.reference.dropout_keep_reference), and that the plans took
both Gluon kernels.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.launch import as_int32  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from plan_spy import spy_chains  # noqa: E402
from test_one_pass import gluon_problem  # noqa: E402  (tests/torch is on sys.path)

GLUON_FWD = "flash_fwd_gluon_kernel"
ONE_PASS = "flash_bwd_one_pass_kernel"


@pytest.fixture(autouse=True)
def default_switches(monkeypatch):
    for name in (flash_plan.GLUON_FWD_ENV, flash_plan.ONE_PASS_ENV, flash_plan.PERSISTENT_ENV, "DUALATTN_WS"):
        set_switch(monkeypatch, name, None)


def _plans(deterministic=False, **kwargs):
    shapes, options, strides, config = gluon_problem(**kwargs)
    forward = flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                      num_sms=132)
    backward = flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                        num_sms=132, deterministic=deterministic, bias_grad=False)
    return forward.chain[-1], backward.dkdv.chain[-1]


def test_plans_take_the_gluon_kernels_with_dropout():
    forward, backward = _plans(sq=4096, sk=4096, causal=True, dropout_prob=0.1)
    assert (forward.kernel, backward.kernel) == (GLUON_FWD, ONE_PASS)
    assert forward.constexpr_dict["DROPOUT"] and backward.constexpr_dict["DROPOUT"]
    for launch in (forward, backward):
        scalars = dict(launch.scalars)
        assert scalars["dropout_threshold"] == as_int32(round(0.1 * 2 ** 32)) and scalars["dropout_scale"] == 1 / 0.9
        assert "dropout_seed" in launch.inputs
    forward, backward = _plans(sq=4096, sk=4096)
    assert not forward.constexpr_dict["DROPOUT"] and not backward.constexpr_dict["DROPOUT"]
    # deterministic=True keeps the two-pass backward (the one-pass dQ adds partials in any order)
    assert _plans(sq=4096, sk=4096, dropout_prob=0.1, deterministic=True)[1].kernel != ONE_PASS


@pytest.mark.parametrize("d, causal, extra", [
    (128, True, {}), (64, False, {}), (128, False, dict(sliding_window=(300, 0), sinks=True)),
    (64, True, dict(segments=True, logits_soft_cap=30.0)), (64, True, dict(bias=True, mask=True)),
    (256, True, dict(segments=True))])
def test_gluon_dropout_compiles_for_sm90(d, causal, extra):
    forward, backward = _plans(d=d, sq=4096, sk=4096, causal=causal, dropout_prob=0.2, **extra)
    assert (forward.kernel, backward.kernel) == (GLUON_FWD, ONE_PASS)
    dtypes = {**dict.fromkeys(("query", "key", "value", "dout", "bias"), "bfloat16"), "softmax_aux": "float32",
              **dict.fromkeys(("q_segment_ids", "kv_segment_ids", "segment_ranges", "dropout_seed"), "int32"),
              "attention_mask": "int8", "lse": "float32", "delta": "float32"}
    for launch in (forward, backward):
        compiled = compile_check.compile_launch(launch, dtypes, arch=90)
        assert compiled.asm["cubin"][:4] == b"\x7fELF"
        # the hash's multiplies by lowbias32's constants (0x7FEB352D, 0x846CA68B)
        ptx = compiled.asm["ptx"]
        assert "2146121005" in ptx and ("-2073254261" in ptx or "2221713035" in ptx), launch.kernel


# ---- GPU: numbers against the float64 reference, through the public API ----

# (b, sq, sk, hq, hkv, d, options, dropout_prob)
GPU_CASES = {
    "d128-causal-gqa": (2, 1024, 1024, 4, 2, 128, dict(causal=True), 0.1),
    "d64-ragged": (1, 1000, 1104, 4, 4, 64, {}, 0.3),
    "d128-window-sinks-softcap": (1, 2048, 2048, 4, 2, 128, dict(sliding_window=(300, 0), logits_soft_cap=20.0,
                                                                 sinks=True), 0.2),
    # bottom-right causal, more queries than keys: rows 0-299 see nothing (O = 0, no NaN)
    "d128-causal-empty-rows": (1, 1300, 1024, 2, 1, 128, dict(causal=True), 0.5),
    "d64-causal-documents": (2, 1024, 1024, 4, 2, 64, dict(causal=True, documents=True), 0.15),
    # (at D = 128 a bias and a mask do not both fit beside the Gluon forward's tiles: fit.forward)
    "d64-bias-mask": (1, 1024, 1024, 4, 4, 64, dict(bias=True, mask=True), 0.25),
    # D = 256: the Gluon forward, the one-pass backward's 64-key tiles (its WIDE layout)
    "d256-causal-documents": (1, 1024, 1024, 4, 2, 256, dict(causal=True, documents=True), 0.2),
    # padded head dims (the next width's tiles)
    "d192-window": (1, 1024, 1024, 4, 2, 192, dict(sliding_window=(300, 0)), 0.1),
    "d96-causal": (2, 1024, 1024, 4, 4, 96, dict(causal=True), 0.2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_gluon_dropout(monkeypatch, seed, case):
    """Dropout on the Gluon forward and the one-pass backward (forced at these lengths), forward,
    lse and dQ, dK, dV against the float64 reference with the documented hash's keep mask."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, dropout_keep_reference, reference_attention
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    b, sq, sk, hq, hkv, d, opts, p = GPU_CASES[case]
    opts = dict(opts)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    if opts.pop("sinks", False):
        opts["softmax_aux"] = torch.randn(hq, device="cuda", generator=gen)
    if opts.pop("documents", False):
        ids = (torch.arange(sq, device="cuda") * 3 // sq)[None].expand(b, sq).contiguous()
        opts.update(q_segment_ids=ids, kv_segment_ids=ids)
    if opts.pop("bias", False):
        opts["bias"] = torch.randn(b, hq, sq, sk, device="cuda", generator=gen).to(torch.bfloat16)
    if opts.pop("mask", False):
        opts["attention_mask"] = torch.rand(1, hq, sq, sk, device="cuda", generator=gen) < 0.8
    dropout_seed = int(torch.randint(0, 2 ** 31 - 1, (1,), generator=gen, device="cuda"))
    keep = torch.from_numpy(dropout_keep_reference(dropout_seed, b, hq, sq, sk, p)).cuda()

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    forward, backward = spy_chains(monkeypatch), spy_chains(monkeypatch, "plan_backward")
    out, lse = flash_attention(*leaves, dropout_prob=p, dropout_seed=dropout_seed, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    assert [c[-1] for c in forward + backward] == [GLUON_FWD, ONE_PASS], (forward, backward)

    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, dropout_prob=p, dropout_keep=keep, **opts)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert not torch.isnan(out).any() and not any(torch.isnan(g).any() for g in grads)
    assert_close_rel(out, ref_out, 1e-2, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern (rows with nothing visible)"
    assert_close_rel(lse[finite], ref_lse[finite], 1e-2, "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, 1e-2, name)
    # the mask matters: without it the output is far off
    assert (out.double() - reference_attention(q.double(), k.double(), v.double(), **opts)[0]).abs().max() > 0.1


def test_a_threshold_of_one_is_no_constexpr():
    """p = 2.5e-10 would give a threshold of 1, which jax-triton turns into a constexpr that the
    kernels cannot bitcast: the threshold is 0 instead, and the launch compiles as jax-triton builds it."""
    from dualattn.options import dropout_threshold
    assert dropout_threshold(2.5e-10) == 0 and dropout_threshold(1e-9) == 4
    shapes, options, strides, config = gluon_problem(d=64, sq=256, sk=256, dropout_prob=2.5e-10)
    launch = flash_plan.plan_forward(shapes, options, strides, config=config).chain[-1]
    assert dict(launch.scalars)["dropout_threshold"] == 0
    compiled = compile_check.compile_launch(launch, {**dict.fromkeys(("query", "key", "value"), "bfloat16"),
                                                     "dropout_seed": "int32"}, arch=90, specialize="jax")
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
