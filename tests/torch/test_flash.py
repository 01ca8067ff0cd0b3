"""dualattn.torch_api.flash_attention / flash_attn_varlen_func vs the float64 reference (tests/reference.py).

CPU tensors run through Triton's interpreter: shapes stay small (seq <= 128, a few heads).
Every case checks the forward (out, lse) and the backward (dq, dk, dv, dbias, dsoftmax_aux) on fresh
random inputs; the reference sees exactly the (rounded) inputs the kernel sees, upcast to float64.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Optional

import pytest

torch = pytest.importorskip("torch")

from dualattn.torch_api import dropout_keep_mask, flash_attention, flash_attn_varlen_func  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from reference import (assert_close_rel, dropout_keep_reference, reference_attention,  # noqa: E402
                       reference_varlen)

# Tolerances: ||kernel - ref|| / ||ref||, reference in float64 on the same rounded inputs.
TOL_OUT = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
TOL_GRAD = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DT_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def sorted_segments(gen, batch, seqlen, n_docs):
    ids = torch.randint(0, n_docs, (batch, seqlen), generator=gen)
    return torch.sort(ids, dim=1).values.to(torch.int32)


# ------------------------------------------------------------------------------------------------
# Case description: sizes + a function building the extra options (tensors) from a generator.
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Case:
    B: int = 2
    Sq: int = 64
    Sk: int = 64
    Hq: int = 4
    Hkv: int = 4
    D: int = 32
    Dv: Optional[int] = None
    opts: dict = dataclasses.field(default_factory=dict)        # static options
    tensors: Optional[Callable] = None                          # (gen, case, dtype) -> dict of tensor options


def _bias(shape_fn, scale=1.0):
    def make(gen, c, dtype):
        return {"bias": randn(gen, *shape_fn(c), dtype=dtype, scale=scale)}
    return make


def _mask(shape_fn, dtype=torch.bool, p_keep=0.7, dead_rows=()):
    def make(gen, c, _):
        m = torch.rand(*shape_fn(c), generator=gen) < p_keep
        for r in dead_rows:
            m[..., r, :] = False
        return {"attention_mask": m.to(dtype)}
    return make


def _sinks(shape_fn):
    def make(gen, c, _):
        return {"softmax_aux": randn(gen, *shape_fn(c))}
    return make


def _segments(both=True, n_docs=3):
    def make(gen, c, _):
        out = {"q_segment_ids": sorted_segments(gen, c.B, c.Sq, n_docs)}
        if both:
            out["kv_segment_ids"] = sorted_segments(gen, c.B, c.Sk, n_docs)
        return out
    return make


def _all(*makers):
    def make(gen, c, dtype):
        out = {}
        for m in makers:
            out.update(m(gen, c, dtype))
        return out
    return make


FULL = lambda c: (c.B, c.Hq, c.Sq, c.Sk)  # noqa: E731

CASES = {
    "plain": Case(),
    "causal": Case(opts=dict(causal=True)),
    "causal_sq_lt_sk": Case(Sq=37, Sk=100, opts=dict(causal=True)),
    "causal_sq_gt_sk": Case(Sq=100, Sk=37, opts=dict(causal=True)),   # rows 0..62 fully masked
    "decode_gqa": Case(B=3, Sq=1, Sk=77, Hq=8, Hkv=2, opts=dict(causal=True)),
    "decode_noncausal": Case(Sq=1, Sk=50),
    "cross_sq_ne_sk": Case(Sq=48, Sk=80),
    "ragged": Case(B=1, Sq=45, Sk=83, Hq=2, Hkv=2),
    "window_int": Case(opts=dict(sliding_window=8)),
    "window_asym": Case(Sq=50, Sk=70, opts=dict(sliding_window=(5, 3))),
    "window_left_only": Case(opts=dict(sliding_window=(10, None))),
    "window_right_only_flashattn_minus1": Case(opts=dict(sliding_window=(-1, 4))),
    "causal_window_gqa": Case(Sq=96, Sk=96, Hq=8, Hkv=2, opts=dict(causal=True, sliding_window=16)),
    "causal_window_sq_gt_sk": Case(Sq=70, Sk=40, Hq=4, Hkv=2, opts=dict(causal=True, sliding_window=(7, 5))),
    "mqa": Case(Hq=4, Hkv=1),
    "scale": Case(opts=dict(softmax_scale=0.37)),
    "softcap": Case(opts=dict(logits_soft_cap=2.0, softmax_scale=0.5)),
    "sinks_per_head": Case(tensors=_sinks(lambda c: (c.Hq,))),
    "sinks_2d": Case(tensors=_sinks(lambda c: (c.Hq, 3))),
    "sinks_shared": Case(Hq=4, tensors=_sinks(lambda c: (2,))),
    "sinks_causal_gqa": Case(Hq=4, Hkv=2, opts=dict(causal=True), tensors=_sinks(lambda c: (c.Hq,))),
    "segments": Case(tensors=_segments(both=True)),
    "segments_one_given": Case(tensors=_segments(both=False)),
    "segments_cross": Case(Sq=40, Sk=72, tensors=_segments(both=True, n_docs=4)),
    "segments_sinks": Case(Sq=40, Sk=72, Hq=4, Hkv=2, tensors=_all(_segments(n_docs=4), _sinks(lambda c: (c.Hq, 2)))),
    "mask_full": Case(tensors=_mask(FULL)),
    "mask_bcast_1_1": Case(tensors=_mask(lambda c: (1, 1, c.Sq, c.Sk))),
    "mask_bcast_b_1": Case(tensors=_mask(lambda c: (c.B, 1, c.Sq, c.Sk))),
    "mask_int": Case(tensors=_mask(lambda c: (1, c.Hq, c.Sq, c.Sk), dtype=torch.int32)),
    "bias_full": Case(tensors=_bias(FULL)),
    "bias_bcast_1_h": Case(tensors=_bias(lambda c: (1, c.Hq, c.Sq, c.Sk))),
    "bias_bcast_b_1": Case(tensors=_bias(lambda c: (c.B, 1, c.Sq, c.Sk))),
    "bias_bcast_1_1": Case(Sq=33, Sk=57, tensors=_bias(lambda c: (1, 1, c.Sq, c.Sk))),
    "bias_fp32_any_dtype": Case(Hq=2, Hkv=2, tensors=lambda g, c, dt: {"bias": randn(g, c.B, c.Hq, c.Sq, c.Sk)}),
    "mask_bias_softcap": Case(Hq=4, Hkv=2, opts=dict(logits_soft_cap=3.0),
                              tensors=_all(_mask(FULL), _bias(FULL, scale=2.0))),
    "everything": Case(Sq=60, Sk=90, Hq=4, Hkv=2, opts=dict(causal=True, sliding_window=(40, 0), logits_soft_cap=4.0),
                       tensors=_all(_segments(n_docs=2), _mask(lambda c: (1, c.Hq, c.Sq, c.Sk), p_keep=0.8),
                                    _bias(lambda c: (c.B, 1, c.Sq, c.Sk)), _sinks(lambda c: (c.Hq, 2)))),
    "dv_ne_d": Case(D=32, Dv=64),
    "dv_lt_d": Case(D=64, Dv=16, Hq=2, Hkv=2),
    "hd16": Case(D=16),
    "hd80": Case(B=1, D=80, Sq=50, Sk=70, opts=dict(causal=True)),
    "hd96": Case(B=1, D=96, Hq=2, Hkv=1),
    "hd128": Case(B=1, D=128, Hq=2, Hkv=2, Sq=40, Sk=40),
    "hd256": Case(B=1, D=256, Hq=1, Hkv=1, Sq=24, Sk=33),
    "fully_masked_rows_mask": Case(tensors=_mask(FULL, dead_rows=(0, 5, 63))),
    "fully_masked_rows_sinks": Case(tensors=_all(_mask(FULL, dead_rows=(1, 30)), _sinks(lambda c: (c.Hq,)))),
    "seq_len_1": Case(Sq=1, Sk=1),
    "long_k_multi_block": Case(B=1, Hq=2, Hkv=1, Sq=16, Sk=300, opts=dict(sliding_window=(200, 0), causal=True)),
}

# The options combinations also run in half precision.
HALF_CASES = ["plain", "causal_sq_gt_sk", "decode_gqa", "causal_window_gqa", "softcap", "segments_sinks",
              "mask_bias_softcap", "bias_fp32_any_dtype", "everything", "hd80", "hd96", "fully_masked_rows_sinks", "ragged"]

PARAMS = ([pytest.param(name, torch.float32, id=f"{name}-fp32") for name in CASES]
          + [pytest.param(name, dt, id=f"{name}-{DT_ID[dt]}") for name in HALF_CASES
             for dt in (torch.float16, torch.bfloat16)])


def build_inputs(gen, c: Case, dtype):
    dv = c.Dv or c.D
    q = randn(gen, c.B, c.Sq, c.Hq, c.D, dtype=dtype)
    k = randn(gen, c.B, c.Sk, c.Hkv, c.D, dtype=dtype)
    v = randn(gen, c.B, c.Sk, c.Hkv, dv, dtype=dtype)
    tens = c.tensors(gen, c, dtype) if c.tensors else {}
    return q, k, v, tens


DIFF_TENSORS = ("bias", "softmax_aux")


def check_against_reference(q, k, v, tens, opts, gen, *, tol_out, tol_grad, varlen=None, dropout_keep=None,
                            grads=True, lse_cotangent=False):
    """Run the kernel (fwd + bwd) and the float64 reference on the same inputs and compare everything.
    lse_cotangent: the backward also takes a random cotangent of lse (a loss that uses both outputs)."""
    dtype = q.dtype
    leaves = {"query": q, "key": k, "value": v, **{n: t for n, t in tens.items() if n in DIFF_TENSORS}}
    kleaves = {n: t.detach().clone().requires_grad_(grads) for n, t in leaves.items()}
    rleaves = {n: t.detach().to(torch.float64).requires_grad_(grads) for n, t in leaves.items()}
    other = {n: t for n, t in tens.items() if n not in DIFF_TENSORS}

    kargs = {n: kleaves[n] for n in DIFF_TENSORS if n in kleaves}
    rargs = {n: rleaves[n] for n in DIFF_TENSORS if n in rleaves}
    if varlen is not None:
        cu_q, cu_k, mq, mk = varlen
        out, lse = flash_attn_varlen_func(kleaves["query"], kleaves["key"], kleaves["value"], cu_q, cu_k, mq, mk,
                                          return_lse=True, **opts, **other, **kargs)
        ropts = {n: o for n, o in opts.items() if n != "dropout_seed"}
        rout, rlse = reference_varlen(rleaves["query"], rleaves["key"], rleaves["value"], cu_q, cu_k,
                                      dropout_keep=dropout_keep, **ropts, **other, **rargs)
        assert lse.shape == (q.shape[1], q.shape[0]), lse.shape
    else:
        out, lse = flash_attention(kleaves["query"], kleaves["key"], kleaves["value"], return_lse=True,
                                   **opts, **other, **kargs)
        ropts = {n: o for n, o in opts.items() if n != "dropout_seed"}
        rout, rlse = reference_attention(rleaves["query"], rleaves["key"], rleaves["value"],
                                         dropout_keep=dropout_keep, **ropts, **other, **rargs)
        assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]), lse.shape
    assert out.dtype == dtype and out.shape == rout.shape, (out.dtype, out.shape, rout.shape)
    assert lse.dtype == torch.float32, lse.dtype
    errs = {"out": assert_close_rel(out, rout, tol_out, "out"),
            "lse": assert_close_rel(lse, rlse, 1e-5, "lse")}   # fp32 whatever the input dtype
    if not grads:
        return errs
    dout = randn(gen, *out.shape, dtype=dtype)
    names = list(kleaves)
    if lse_cotangent:
        dlse = randn(gen, *lse.shape)
        kg = torch.autograd.grad((out, lse), [kleaves[n] for n in names], (dout, dlse))
        rg = torch.autograd.grad((rout, rlse), [rleaves[n] for n in names],
                                 (dout.to(torch.float64), dlse.to(torch.float64)))
    else:
        kg = torch.autograd.grad(out, [kleaves[n] for n in names], dout)
        rg = torch.autograd.grad(rout, [rleaves[n] for n in names], dout.to(torch.float64))
    for n, a, b in zip(names, kg, rg):
        assert a.shape == kleaves[n].shape and a.dtype == kleaves[n].dtype, (n, a.shape, a.dtype)
        errs["d" + n] = assert_close_rel(a, b, tol_grad, "d" + n)
    return errs


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_flash_vs_reference(name, dtype, torch_gen):
    c = CASES[name]
    q, k, v, tens = build_inputs(torch_gen, c, dtype)
    check_against_reference(q, k, v, tens, dict(c.opts), torch_gen, tol_out=TOL_OUT[dtype], tol_grad=TOL_GRAD[dtype])


# The portable kernels run a causal or window band's masked edge tiles either inside their one loop,
# behind a branch (plan.edges_in_loop: every band these small problems have), or in loops of their own
# (bands wider than plan.EDGES_IN_LOOP_MAX_KEYS keys): both layouts, forward and backward, each checked
# to have run.
EDGE_CASES = {name: CASES[name] for name in ("causal", "causal_sq_lt_sk", "causal_sq_gt_sk", "window_asym",
                                              "window_left_only", "window_right_only_flashattn_minus1",
                                              "causal_window_gqa", "sinks_causal_gqa", "hd80", "long_k_multi_block")}
EDGE_CASES["causal_bias_softcap"] = Case(Sq=70, Sk=90, opts=dict(causal=True, logits_soft_cap=3.0), tensors=_bias(FULL))
# Long enough for unmasked interior tiles between the edges (the interpreter's tiles are 64 x 64).
EDGE_CASES["causal_interior"] = Case(B=1, Sq=256, Sk=256, Hq=2, Hkv=1, opts=dict(causal=True))
EDGE_CASES["window_interior_ragged"] = Case(B=1, Sq=300, Sk=330, Hq=2, Hkv=2, opts=dict(sliding_window=(70, 100)))


@pytest.fixture
def edge_layout_flags(monkeypatch, launch_flags):
    """edge_layout_flags(in_loop) -> the EDGES_IN_LOOP flags of every forward, dK/dV and dQ launch
    planned from then on, with the rule set to put every band's edges in the loop or in their own."""
    from dualattn.kernels.flash import hopper, plan as flash_plan

    def use(in_loop: bool) -> list:
        set_switch(monkeypatch, "DUALATTN_EDGES_IN_LOOP", None)
        monkeypatch.setattr(hopper, "EDGES_IN_LOOP_MAX_KEYS", 1 << 30 if in_loop else 0)
        flash_plan.forget_plans()   # memoised under the other rule
        return launch_flags("EDGES_IN_LOOP")
    yield use
    from dualattn.kernels.flash import plan as flash_plan
    flash_plan.forget_plans()


@pytest.mark.parametrize("in_loop", [True, False], ids=["edges-in-loop", "edge-loops"])
@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_band_edge_layouts_vs_reference(name, in_loop, edge_layout_flags, torch_gen):
    c = EDGE_CASES[name]
    flags = edge_layout_flags(in_loop)
    q, k, v, tens = build_inputs(torch_gen, c, torch.float32)
    check_against_reference(q, k, v, tens, dict(c.opts), torch_gen, tol_out=TOL_OUT[torch.float32],
                            tol_grad=TOL_GRAD[torch.float32])
    assert len(flags) == 3 and all(f == in_loop for f in flags), flags


# The lse output is differentiable: d lse_i / d s_ij = P_ij (cases without fully masked rows, whose
# -inf lse has no derivative in the reference).
LSE_CASES = ["causal_window_gqa", "causal_sq_lt_sk", "sinks_causal_gqa", "softcap", "bias_bcast_1_h",
             "mask_bias_softcap"]


@pytest.mark.parametrize("name", LSE_CASES)
def test_lse_cotangent_vs_reference(name, torch_gen):
    c = CASES[name]
    q, k, v, tens = build_inputs(torch_gen, c, torch.float32)
    check_against_reference(q, k, v, tens, dict(c.opts), torch_gen, tol_out=TOL_OUT[torch.float32],
                            tol_grad=TOL_GRAD[torch.float32], lse_cotangent=True)


def test_lse_only_gradient(torch_gen):
    q, k, v, tens = build_inputs(torch_gen, CASES["sinks_causal_gqa"], torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v, tens["softmax_aux"])]
    _, lse = flash_attention(q, k, v, causal=True, softmax_aux=leaves[3], return_lse=True)
    r64 = [t.detach().double().requires_grad_() for t in leaves]
    _, rlse = reference_attention(*r64[:3], causal=True, softmax_aux=r64[3])
    w = randn(torch_gen, *lse.shape)
    dq, dk, dv, dsinks = torch.autograd.grad((lse * w).sum(), leaves)
    assert torch.equal(dv, torch.zeros_like(dv))  # lse does not depend on v
    rq, rk, rsinks = torch.autograd.grad((rlse * w.double()).sum(), [r64[0], r64[1], r64[3]])
    for n, a, b in (("dq", dq, rq), ("dk", dk, rk), ("dsinks", dsinks, rsinks)):
        assert_close_rel(a, b, TOL_GRAD[torch.float32], n)


# ------------------------------------------------------------------------------------------------
# Fully masked rows: exact zeros, lse -inf (or the sinks' lse), zero and finite gradients.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no_sinks", "sinks"])
def test_fully_masked_rows_exact(with_sinks, torch_gen):
    B, S, H, D = 1, 40, 2, 32
    q = randn(torch_gen, B, S, H, D).requires_grad_()
    k = randn(torch_gen, B, S, H, D).requires_grad_()
    v = randn(torch_gen, B, S, H, D).requires_grad_()
    mask = torch.ones(B, H, S, S, dtype=torch.bool)
    dead = [0, 17, 39]
    mask[:, :, dead, :] = False
    mask[:, 1, 5, :] = False                         # dead in one head only
    aux = randn(torch_gen, H).requires_grad_() if with_sinks else None
    out, lse = flash_attention(q, k, v, attention_mask=mask, softmax_aux=aux, return_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, dead], torch.zeros_like(out[:, dead]))
    assert torch.equal(out[:, 5, 1], torch.zeros_like(out[:, 5, 1]))
    if with_sinks:
        torch.testing.assert_close(lse[:, :, dead], aux.detach()[None, :, None].expand(B, H, len(dead)))
    else:
        assert torch.all(lse[:, :, dead] == float("-inf")) and lse[0, 1, 5] == float("-inf")
        assert torch.isfinite(lse[0, 0, 5])
    grads = torch.autograd.grad(out, [q, k, v] + ([aux] if with_sinks else []), torch.randn_like(out))
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.equal(grads[0][:, dead], torch.zeros_like(grads[0][:, dead]))


def test_everything_masked_causal_sq_gt_sk():
    """Sq > Sk causal: the first Sq - Sk rows see no key at all."""
    g = torch.Generator().manual_seed(0)
    q = randn(g, 1, 20, 2, 16).requires_grad_()
    k = randn(g, 1, 4, 2, 16).requires_grad_()
    v = randn(g, 1, 4, 2, 16).requires_grad_()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out[:, :16], torch.zeros_like(out[:, :16]))
    assert torch.all(lse[:, :, :16] == float("-inf")) and torch.isfinite(lse[:, :, 16:]).all()
    dq, dk, dv = torch.autograd.grad(out, [q, k, v], torch.randn_like(out))
    assert torch.equal(dq[:, :16], torch.zeros_like(dq[:, :16]))
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))


# ------------------------------------------------------------------------------------------------
# return_lse and return types
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_ID.get)
def test_return_types(dtype, torch_gen):
    q = randn(torch_gen, 2, 24, 2, 32, dtype=dtype)
    k = randn(torch_gen, 2, 40, 1, 32, dtype=dtype)
    v = randn(torch_gen, 2, 40, 1, 48, dtype=dtype)
    out = flash_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 24, 2, 48) and out.dtype == dtype
    out2, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(out, out2)                     # deterministic without dropout
    assert lse.shape == (2, 2, 24) and lse.dtype == torch.float32
    with torch.no_grad():                             # inference mode works too
        torch.testing.assert_close(flash_attention(q, k, v), out, rtol=0, atol=0)


def test_grad_only_some_inputs(torch_gen):
    q = randn(torch_gen, 1, 32, 2, 32).requires_grad_()
    k = randn(torch_gen, 1, 32, 2, 32)
    v = randn(torch_gen, 1, 32, 2, 32).requires_grad_()
    out = flash_attention(q, k, v, causal=True)
    dq, dv = torch.autograd.grad(out, [q, v], torch.ones_like(out))
    qr, vr = q.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    ro, _ = reference_attention(qr, k.double(), vr, causal=True)
    rdq, rdv = torch.autograd.grad(ro, [qr, vr], torch.ones_like(ro))
    assert_close_rel(dq, rdq, 2e-5, "dq")
    assert_close_rel(dv, rdv, 2e-5, "dv")


# ------------------------------------------------------------------------------------------------
# Non-contiguous inputs (BHSD views, slices of a packed qkv tensor) run without a copy being required.
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["bhsd_view", "packed_qkv", "sliced_dim"])
def test_non_contiguous(layout, torch_gen):
    B, S, H, D = 2, 48, 2, 32
    if layout == "bhsd_view":
        base = [randn(torch_gen, B, H, S, D).requires_grad_() for _ in range(3)]
        q, k, v = (t.transpose(1, 2) for t in base)
    elif layout == "packed_qkv":
        base = [randn(torch_gen, B, S, 3, H, D).requires_grad_()]
        q, k, v = base[0].unbind(2)
    else:                                              # every other token: a gapped sequence stride
        base = [randn(torch_gen, B, 2 * S, H, D).requires_grad_() for _ in range(3)]
        q, k, v = (t[:, ::2] for t in base)
    assert not q.is_contiguous()
    out, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    ro, rl = reference_attention(qr, kr, vr, causal=True)
    assert_close_rel(out, ro, 1e-5, "out")
    assert_close_rel(lse, rl, 1e-5, "lse")
    dout = randn(torch_gen, *out.shape)
    gk = torch.autograd.grad(out, base, dout)
    rq, rk, rv = torch.autograd.grad(ro, [qr, kr, vr], dout.double())
    if layout == "bhsd_view":
        pairs = [(gk[0].transpose(1, 2), rq), (gk[1].transpose(1, 2), rk), (gk[2].transpose(1, 2), rv)]
    elif layout == "packed_qkv":
        pairs = [(gk[0][:, :, 0], rq), (gk[0][:, :, 1], rk), (gk[0][:, :, 2], rv)]
    else:
        pairs = [(gk[0][:, ::2], rq), (gk[1][:, ::2], rk), (gk[2][:, ::2], rv)]
        assert all(torch.equal(g[:, 1::2], torch.zeros_like(g[:, 1::2])) for g in gk)
    for name, (a, b) in zip(("dq", "dk", "dv"), pairs):
        assert_close_rel(a, b, 2e-5, name)


# ------------------------------------------------------------------------------------------------
# Varlen
# ------------------------------------------------------------------------------------------------
def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


VARLEN_CASES = {
    "plain": dict(lq=[17, 64, 5], lk=[17, 64, 5], Hq=2, Hkv=2, D=32, opts={}),
    "causal": dict(lq=[17, 64, 5], lk=[17, 64, 5], Hq=2, Hkv=2, D=32, opts=dict(causal=True)),
    "causal_ragged_cross": dict(lq=[9, 40, 1, 33], lk=[30, 40, 19, 20], Hq=4, Hkv=2, D=32, opts=dict(causal=True)),
    "window_gqa": dict(lq=[50, 23], lk=[70, 23], Hq=4, Hkv=1, D=64, opts=dict(sliding_window=(9, 2))),
    "sinks_softcap": dict(lq=[31, 12], lk=[31, 45], Hq=2, Hkv=2, D=32, opts=dict(logits_soft_cap=2.0, causal=True),
                          sinks=(2, 2)),
    "hd80_single": dict(lq=[77], lk=[77], Hq=2, Hkv=1, D=80, opts=dict(causal=True)),
    "empty_q_seq": dict(lq=[10, 0, 20], lk=[10, 15, 20], Hq=2, Hkv=2, D=32, opts=dict(causal=True)),
}


@pytest.mark.parametrize("name,dtype", [pytest.param(n, torch.float32, id=f"{n}-fp32") for n in VARLEN_CASES]
                         + [pytest.param("causal_ragged_cross", dt, id=f"causal_ragged_cross-{DT_ID[dt]}")
                            for dt in (torch.float16, torch.bfloat16)])
def test_varlen_vs_reference(name, dtype, torch_gen):
    c = VARLEN_CASES[name]
    lq, lk = c["lq"], c["lk"]
    q = randn(torch_gen, sum(lq), c["Hq"], c["D"], dtype=dtype)
    k = randn(torch_gen, sum(lk), c["Hkv"], c["D"], dtype=dtype)
    v = randn(torch_gen, sum(lk), c["Hkv"], c["D"], dtype=dtype)
    tens = {"softmax_aux": randn(torch_gen, *c["sinks"])} if "sinks" in c else {}
    varlen = (_cu(lq), _cu(lk), max(lq), max(lk))
    check_against_reference(q, k, v, tens, dict(c["opts"]), torch_gen, tol_out=TOL_OUT[dtype],
                            tol_grad=TOL_GRAD[dtype], varlen=varlen)


@pytest.mark.parametrize("name", ["window_gqa", "sinks_softcap"])
def test_varlen_lse_cotangent_vs_reference(name, torch_gen):
    c = VARLEN_CASES[name]
    lq, lk = c["lq"], c["lk"]
    q = randn(torch_gen, sum(lq), c["Hq"], c["D"])
    k = randn(torch_gen, sum(lk), c["Hkv"], c["D"])
    v = randn(torch_gen, sum(lk), c["Hkv"], c["D"])
    tens = {"softmax_aux": randn(torch_gen, *c["sinks"])} if "sinks" in c else {}
    check_against_reference(q, k, v, tens, dict(c["opts"]), torch_gen, tol_out=TOL_OUT[torch.float32],
                            tol_grad=TOL_GRAD[torch.float32], varlen=(_cu(lq), _cu(lk), max(lq), max(lk)),
                            lse_cotangent=True)


def test_varlen_matches_dense_per_sequence(torch_gen):
    """Packing changes nothing: each packed sequence equals a dense call on it alone."""
    lq, lk = [13, 40], [29, 40]
    q = randn(torch_gen, sum(lq), 2, 32)
    k = randn(torch_gen, sum(lk), 2, 32)
    v = randn(torch_gen, sum(lk), 2, 32)
    cq, ck = _cu(lq), _cu(lk)
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True)
    for i in range(2):
        o, l = flash_attention(q[cq[i]:cq[i + 1]][None], k[ck[i]:ck[i + 1]][None], v[ck[i]:ck[i + 1]][None],
                               causal=True, return_lse=True)
        assert_close_rel(out[cq[i]:cq[i + 1]], o[0], 1e-6, f"out seq {i}")
        assert_close_rel(lse[:, cq[i]:cq[i + 1]], l[0], 1e-6, f"lse seq {i}")


@pytest.mark.parametrize("covered", [True, False])
def test_varlen_rows_written_without_a_fill(monkeypatch, torch_gen, covered):
    """Tables the host checked that put every query row in a sequence (FlashShapes.queries_covered) skip the
    fill of out and lse: the kernels must then write every row, those of a sequence with no keys and the
    causal rows that see none included.  Fresh buffers hold NaN here.  Not covered (rows past
    cu_seqlens_q[-1]): those rows still get 0 and lse -inf."""
    from dualattn.torch_api import flash as torch_flash
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    lq, lk = [9, 40, 3, 0, 33], [30, 0, 19, 5, 20]
    extra = 0 if covered else 6
    q = randn(torch_gen, sum(lq) + extra, 2, 32)
    k, v = randn(torch_gen, sum(lk), 1, 32), randn(torch_gen, sum(lk), 1, 32)
    cq, ck = _cu(lq), _cu(lk)
    check_against_reference(q[:sum(lq)], k, v, {}, dict(causal=True), torch_gen, tol_out=TOL_OUT[torch.float32],
                            tol_grad=TOL_GRAD[torch.float32], varlen=(cq, ck, max(lq), max(lk)))
    out, lse = flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), causal=True, return_lse=True)
    assert [c.out_zeroed for c in torch_flash._CALL_PLANS.values()][-1] is not covered
    assert not out[:sum(lq)].isnan().any() and not lse[:, :sum(lq)].isnan().any()
    assert torch.equal(out[sum(lq):], torch.zeros_like(out[sum(lq):]))
    assert (lse[:, sum(lq):] == float("-inf")).all()


# ------------------------------------------------------------------------------------------------
# Dropout
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed_value,shape,p", [
    (0, (1, 1, 16, 16), 0.5),
    (1234, (2, 3, 37, 53), 0.1),
    (2**31 + 12345, (3, 2, 5, 130), 0.9),
    (2**32 - 1, (1, 4, 64, 1), 0.25),
])
def test_dropout_mask_matches_hash_reference(seed_value, shape, p):
    keep = dropout_keep_mask(seed_value, *shape, p)
    assert keep.dtype == torch.bool and tuple(keep.shape) == shape
    ref = dropout_keep_reference(seed_value, *shape, p)
    mismatches = int((keep.cpu().numpy() != ref).sum())
    assert mismatches == 0, f"{mismatches} of {ref.size} keep bits differ from the documented hash"


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keep_fraction(p):
    B, H, S = 2, 4, 128
    keep = dropout_keep_mask(7, B, H, S, S, p)
    n = keep.numel()
    frac = keep.float().mean().item()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(frac - (1 - p)) < 5 * sigma, (frac, 1 - p, sigma)
    # no structure: each (b, h) slice keeps about the same fraction, rows differ from each other
    per_bh = keep.float().mean(dim=(2, 3))
    assert (per_bh - (1 - p)).abs().max() < 6 * (p * (1 - p) / (S * S)) ** 0.5
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1]) and not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0], keep[1, 0])
    # no correlation between neighbours detectable at this size: along keys (the hash's per-entry
    # part), along queries and heads (16M entries show lag-2 and lag-6 ones of ~0.001 along keys)
    z = keep.double() - keep.double().mean()
    for a, b in ((z[..., :-1], z[..., 1:]), (z[..., :-2], z[..., 2:]), (z[..., :-8], z[..., 8:]),
                 (z[:, :, :-1], z[:, :, 1:]), (z[:, :-1], z[:, 1:])):
        corr = float((a * b).mean() / z.var())
        assert abs(corr) < 5 / a.numel() ** 0.5, corr


def _dropout_inputs(gen, B=2, S=48, Hq=4, Hkv=2, D=32, dtype=torch.float32):
    return (randn(gen, B, S, Hq, D, dtype=dtype), randn(gen, B, S, Hkv, D, dtype=dtype),
            randn(gen, B, S, Hkv, D, dtype=dtype))


def test_dropout_determinism(torch_gen):
    q, k, v = _dropout_inputs(torch_gen)
    a = flash_attention(q, k, v, dropout_prob=0.3, dropout_seed=42)
    b = flash_attention(q, k, v, dropout_prob=0.3, dropout_seed=42)
    c = flash_attention(q, k, v, dropout_prob=0.3, dropout_seed=43)
    d = flash_attention(q, k, v)
    assert torch.equal(a, b), "same seed must give the same output"
    assert not torch.equal(a, c), "different seeds must give different outputs"
    assert not torch.equal(a, d)


def test_dropout_default_seed_is_not_fixed(torch_gen):
    """dropout_seed=None draws a fresh seed: two calls drop different entries (no fixed default seed)."""
    q, k, v = _dropout_inputs(torch_gen)
    a = flash_attention(q, k, v, dropout_prob=0.3)
    b = flash_attention(q, k, v, dropout_prob=0.3)
    assert not torch.equal(a, b)


def test_dropout_default_seed_backward_consistent(torch_gen):
    """Backward uses the forward's mask even when the seed was drawn: out is linear in v, so
    sum(out * dout) == sum(dv * v) exactly up to rounding."""
    q, k, v = _dropout_inputs(torch_gen)
    v.requires_grad_()
    out = flash_attention(q, k, v, dropout_prob=0.4, causal=True)
    dout = randn(torch_gen, *out.shape)
    (dv,) = torch.autograd.grad(out, [v], dout)
    lhs = (out.double() * dout.double()).sum().item()
    rhs = (dv.double() * v.detach().double()).sum().item()
    assert abs(lhs - rhs) <= 1e-4 * (abs(lhs) + 1.0), (lhs, rhs)


@pytest.mark.parametrize("name,dtype,p", [
    ("plain", torch.float32, 0.2),
    ("causal_gqa", torch.float32, 0.5),
    ("segments_sinks_bias", torch.float32, 0.3),
    ("causal_gqa", torch.float16, 0.3),
    ("causal_gqa", torch.bfloat16, 0.3),
])
def test_dropout_vs_reference(name, dtype, p, torch_gen):
    B, S, Sk, Hq, Hkv, D = 2, 40, 56, 4, 2, 32
    q = randn(torch_gen, B, S, Hq, D, dtype=dtype)
    k = randn(torch_gen, B, Sk, Hkv, D, dtype=dtype)
    v = randn(torch_gen, B, Sk, Hkv, D, dtype=dtype)
    opts, tens = {}, {}
    if name == "causal_gqa":
        opts["causal"] = True
    if name == "segments_sinks_bias":
        tens = dict(q_segment_ids=sorted_segments(torch_gen, B, S, 2), kv_segment_ids=sorted_segments(torch_gen, B, Sk, 2),
                    softmax_aux=randn(torch_gen, Hq), bias=randn(torch_gen, 1, Hq, S, Sk, dtype=dtype))
    seed_value = int(torch.randint(0, 2**31 - 1, (1,), generator=torch_gen))
    keep = torch.from_numpy(dropout_keep_reference(seed_value, B, Hq, S, Sk, p))   # the documented hash
    opts.update(dropout_prob=p, dropout_seed=seed_value)
    check_against_reference(q, k, v, tens, opts, torch_gen, tol_out=TOL_OUT[dtype], tol_grad=TOL_GRAD[dtype],
                            dropout_keep=keep)


def test_dropout_vs_reference_with_kernel_keep_mask(torch_gen):
    """The mask dropout_keep_mask reports is the one the attention kernels apply."""
    B, S, Hq, Hkv, D, p, seed_value = 2, 40, 2, 1, 32, 0.35, 2024
    q, k, v = randn(torch_gen, B, S, Hq, D), randn(torch_gen, B, S, Hkv, D), randn(torch_gen, B, S, Hkv, D)
    keep = dropout_keep_mask(seed_value, B, Hq, S, S, p)
    check_against_reference(q, k, v, {}, dict(causal=True, dropout_prob=p, dropout_seed=seed_value), torch_gen,
                            tol_out=1e-5, tol_grad=2e-5, dropout_keep=keep)


def test_dropout_varlen_vs_reference(torch_gen):
    lq, lk = [21, 48, 7], [33, 48, 12]
    Hq, Hkv, D, p = 2, 1, 32, 0.25
    q = randn(torch_gen, sum(lq), Hq, D)
    k = randn(torch_gen, sum(lk), Hkv, D)
    v = randn(torch_gen, sum(lk), Hkv, D)
    seed_value = 99
    keep = dropout_keep_reference(seed_value, len(lq), Hq, max(lq), max(lk), p)   # batch index = sequence index
    check_against_reference(q, k, v, {}, dict(causal=True, dropout_prob=p, dropout_seed=seed_value), torch_gen,
                            tol_out=1e-5, tol_grad=2e-5, varlen=(_cu(lq), _cu(lk), max(lq), max(lk)),
                            dropout_keep=keep)


# ------------------------------------------------------------------------------------------------
# Finite differences (the kernels have no fp64 path: fp32 with loose tolerances, tiny shapes)
# ------------------------------------------------------------------------------------------------
def test_gradcheck_fp32_fast_mode(torch_gen):
    B, S, Hq, Hkv, D = 1, 6, 2, 1, 16
    q = randn(torch_gen, B, S, Hq, D).requires_grad_()
    k = randn(torch_gen, B, S + 2, Hkv, D).requires_grad_()
    v = randn(torch_gen, B, S + 2, Hkv, D).requires_grad_()
    bias = randn(torch_gen, 1, Hq, S, S + 2).requires_grad_()
    aux = randn(torch_gen, Hq).requires_grad_()

    def f(q, k, v, bias, aux):
        return flash_attention(q, k, v, bias=bias, softmax_aux=aux, causal=True, logits_soft_cap=3.0)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*double precision.*")   # fp32 on purpose: no fp64 kernels
        assert torch.autograd.gradcheck(f, (q, k, v, bias, aux), eps=2e-3, atol=3e-3, rtol=2e-2,
                                        fast_mode=True, nondet_tol=1e-6)


def test_directional_derivatives_fp32(torch_gen):
    """Central differences of L = sum(out * w) along random directions vs <grad, u>, every differentiable input."""
    B, S, Hq, Hkv, D = 1, 12, 2, 2, 16
    x = dict(query=randn(torch_gen, B, S, Hq, D), key=randn(torch_gen, B, S, Hkv, D),
             value=randn(torch_gen, B, S, Hkv, D), bias=randn(torch_gen, B, Hq, S, S),
             softmax_aux=randn(torch_gen, Hq, 2))
    seg = torch.tensor([[0] * 5 + [1] * 7], dtype=torch.int32)
    opts = dict(logits_soft_cap=2.5, sliding_window=(6, 2), q_segment_ids=seg)
    w = randn(torch_gen, B, S, Hq, D)

    def loss(**kw):
        return (flash_attention(**kw, **opts).double() * w.double()).sum()

    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    grads = torch.autograd.grad(loss(**leaves), list(leaves.values()))
    eps = 1e-2
    for (n, t), g in zip(x.items(), grads):
        u = randn(torch_gen, *t.shape)
        u = u / u.norm()
        plus = loss(**{**x, n: t + eps * u}).item()
        minus = loss(**{**x, n: t - eps * u}).item()
        fd = (plus - minus) / (2 * eps)
        an = (g.double() * u.double()).sum().item()
        assert abs(fd - an) <= 2e-3 * max(1.0, abs(an)), (n, fd, an)


# ------------------------------------------------------------------------------------------------
# torch.compile
# ------------------------------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self, d_model=64, heads=2, kv_heads=1):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, d_model // heads
        self.q = torch.nn.Linear(d_model, heads * self.d)
        self.kv = torch.nn.Linear(d_model, 2 * kv_heads * self.d)
        self.sinks = torch.nn.Parameter(torch.zeros(heads))

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.d)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.d).unbind(2)
        o = flash_attention(q, k, v, causal=True, softmax_aux=self.sinks)
        return o.reshape(B, S, -1)


def _compile_check(backend):
    torch.manual_seed(0)
    m = _Block()
    x = torch.randn(2, 32, 64)
    eager = m(x)
    ge = torch.autograd.grad(eager.square().sum(), list(m.parameters()))
    cm = torch.compile(m, fullgraph=True, backend=backend)
    out = cm(x)
    gc = torch.autograd.grad(out.square().sum(), list(m.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_torch_compile_fullgraph_aot_eager():
    torch._dynamo.reset()
    _compile_check("aot_eager")


def test_torch_compile_fullgraph_inductor():   # ~12 s with a cold inductor cache on 2 cores
    torch._dynamo.reset()
    _compile_check("inductor")


# ------------------------------------------------------------------------------------------------
# Bad inputs raise ValueError/TypeError naming the argument, before any kernel runs
# ------------------------------------------------------------------------------------------------
def _good():
    return dict(query=torch.randn(2, 16, 4, 32), key=torch.randn(2, 24, 2, 32), value=torch.randn(2, 24, 2, 32))


BAD_INPUTS = {
    "query_rank3": (lambda a: a.update(query=a["query"][0]), ValueError, "query"),
    "key_rank5": (lambda a: a.update(key=a["key"][None]), ValueError, "key"),
    "heads_not_multiple": (lambda a: a.update(key=torch.randn(2, 24, 3, 32), value=torch.randn(2, 24, 3, 32)),
                           ValueError, "heads"),
    "kv_heads_mismatch": (lambda a: a.update(value=torch.randn(2, 24, 1, 32)), ValueError, "value"),
    "batch_mismatch": (lambda a: a.update(key=torch.randn(3, 24, 2, 32), value=torch.randn(3, 24, 2, 32)),
                       ValueError, "batch"),
    "head_dim_mismatch": (lambda a: a.update(key=torch.randn(2, 24, 2, 64)), ValueError, "head_dim"),
    "head_dim_too_small": (lambda a: a.update(query=torch.randn(2, 16, 4, 8), key=torch.randn(2, 24, 2, 8),
                                              value=torch.randn(2, 24, 2, 8)), ValueError, "head_dim"),
    "dtype_float64": (lambda a: a.update(query=a["query"].double()), TypeError, "query"),
    "dtype_int": (lambda a: a.update(value=torch.ones(2, 24, 2, 32, dtype=torch.int32)), TypeError, "value"),
    "dtype_mixed": (lambda a: a.update(key=a["key"].half()), TypeError, "key"),
    "mask_wrong_shape": (lambda a: a.update(attention_mask=torch.ones(2, 4, 16, 16, dtype=torch.bool)),
                         ValueError, "attention_mask"),
    "mask_wrong_heads": (lambda a: a.update(attention_mask=torch.ones(1, 2, 16, 24, dtype=torch.bool)),
                         ValueError, "attention_mask"),
    "mask_float": (lambda a: a.update(attention_mask=torch.ones(1, 1, 16, 24)), TypeError, "attention_mask"),
    "bias_wrong_shape": (lambda a: a.update(bias=torch.randn(2, 4, 24, 16)), ValueError, "bias"),
    "bias_rank3": (lambda a: a.update(bias=torch.randn(4, 16, 24)), ValueError, "bias"),
    "negative_window": (lambda a: a.update(sliding_window=-3), ValueError, "sliding_window"),
    "negative_window_pair": (lambda a: a.update(sliding_window=(4, -2)), ValueError, "sliding_window"),
    "window_bad_type": (lambda a: a.update(sliding_window=2.5), TypeError, "sliding_window"),
    "dropout_one": (lambda a: a.update(dropout_prob=1.0), ValueError, "dropout"),
    "dropout_negative": (lambda a: a.update(dropout_prob=-0.1), ValueError, "dropout"),
    "soft_cap_negative": (lambda a: a.update(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    "scale_zero": (lambda a: a.update(softmax_scale=0.0), ValueError, "softmax_scale"),
    "sinks_wrong_shape": (lambda a: a.update(softmax_aux=torch.randn(3, 2)), ValueError, "softmax_aux"),
    "segments_wrong_shape": (lambda a: a.update(q_segment_ids=torch.zeros(2, 15, dtype=torch.int32),
                                                kv_segment_ids=torch.zeros(2, 24, dtype=torch.int32)),
                             ValueError, "q_segment_ids"),
    "segments_float": (lambda a: a.update(q_segment_ids=torch.zeros(2, 16), kv_segment_ids=torch.zeros(2, 24)),
                       TypeError, "segment_ids"),
    "segments_one_given_cross": (lambda a: a.update(q_segment_ids=torch.zeros(2, 16, dtype=torch.int32)),
                                 ValueError, "segment_ids"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs(case):
    a = _good()
    mutate, exc, word = BAD_INPUTS[case]
    mutate(a)
    with pytest.raises(exc, match=word):
        flash_attention(**a)


VARLEN_BAD = {
    "cu_len_mismatch": (dict(cu_seqlens_k=torch.tensor([0, 10, 20, 30], dtype=torch.int32)), ValueError, "cu_seqlens"),
    "cu_int64": (dict(cu_seqlens_q=torch.tensor([0, 10, 20], dtype=torch.int64)), TypeError, "cu_seqlens_q"),
    "cu_2d": (dict(cu_seqlens_q=torch.tensor([[0, 10, 20]], dtype=torch.int32)), ValueError, "cu_seqlens_q"),
    "query_rank4": (dict(q=torch.randn(1, 20, 2, 32)), ValueError, "query"),
}


@pytest.mark.parametrize("case", list(VARLEN_BAD))
def test_varlen_bad_inputs(case):
    a = dict(q=torch.randn(20, 2, 32), k=torch.randn(20, 2, 32), v=torch.randn(20, 2, 32),
             cu_seqlens_q=torch.tensor([0, 10, 20], dtype=torch.int32),
             cu_seqlens_k=torch.tensor([0, 8, 20], dtype=torch.int32), max_seqlen_q=10, max_seqlen_k=12)
    upd, exc, word = VARLEN_BAD[case]
    a.update(upd)
    with pytest.raises(exc, match=word):
        flash_attn_varlen_func(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("cu_seqlens_q"), a.pop("cu_seqlens_k"),
                               a.pop("max_seqlen_q"), a.pop("max_seqlen_k"), **a)


# The values of cu_seqlens disagree with the packed tensors / max_seqlen.  Unchecked, the kernel reads out of
# bounds (on CPU this has crashed the interpreter with a segfault), so each case runs in a subprocess: a crash
# is reported as a failure instead of killing the test session.
VARLEN_BAD_VALUES = {
    "cu_total_mismatch": ("cu_q = torch.tensor([0, 10, 25], dtype=torch.int32)", "cu_seqlens_q"),
    "cu_decreasing": ("cu_k = torch.tensor([0, 12, 8], dtype=torch.int32)", "cu_seqlens_k"),
    "cu_not_starting_at_0": ("cu_k = torch.tensor([4, 8, 20], dtype=torch.int32)", "cu_seqlens_k"),
    "max_seqlen_too_small": ("mq = 5", "max_seqlen_q"),
}

_VARLEN_BAD_SCRIPT = """
import sys, torch
from dualattn.torch_api import flash_attn_varlen_func
q, k, v = torch.randn(20, 2, 32), torch.randn(20, 2, 32), torch.randn(20, 2, 32)
cu_q = torch.tensor([0, 10, 20], dtype=torch.int32)
cu_k = torch.tensor([0, 8, 20], dtype=torch.int32)
mq, mk = 10, 12
{update}
try:
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk)
except ValueError as e:
    print("ValueError:", e)
    sys.exit(0 if {word!r} in str(e) else 3)
print("did not raise")
sys.exit(2)
"""


@pytest.mark.parametrize("case", list(VARLEN_BAD_VALUES))
def test_varlen_bad_cu_seqlens_values(case):
    import subprocess
    import sys
    update, word = VARLEN_BAD_VALUES[case]
    r = subprocess.run([sys.executable, "-c", _VARLEN_BAD_SCRIPT.format(update=update, word=word)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (f"expected ValueError naming {word!r}; exit code {r.returncode} "
                               f"(2: did not raise, 3: message lacks the name, <0: crashed)\n"
                               f"{r.stdout[-2000:]}{r.stderr[-2000:]}")


def test_bias_without_grad_writes_no_dbias(monkeypatch):
    """A bias that needs no gradient: the dK/dV launch stores no dS and no S x S float32 dbias is
    allocated and zero-filled (plan_backward's bias_grad); dQ, dK, dV are the same either way, and a
    bias that needs its gradient still gets it."""
    from dualattn.kernels.flash import plan as flash_plan
    planned, real = [], flash_plan.plan_backward

    def spy(*args, **kwargs):
        planned.append(real(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(flash_plan, "plan_backward", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 64, 2, 32, generator=gen) for _ in range(4))
    bias = torch.randn(1, 2, 64, 64, generator=gen)
    grads = {}
    for wants_dbias in (False, True):
        b = bias.clone().requires_grad_(wants_dbias)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, bias=b, causal=True)
        grads[wants_dbias] = torch.autograd.grad(out, leaves + ([b] if wants_dbias else []), dout)
        dkdv = planned[-1].dkdv
        assert dkdv.constexpr_dict["STORE_DBIAS"] == wants_dbias
        assert next(o for o in dkdv.outputs if o.name == "dbias").placeholder == (not wants_dbias)
    for a, b in zip(grads[False], grads[True][:3]):
        assert torch.equal(a, b)
    ref_bias = bias.double().requires_grad_()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, bias=ref_bias, causal=True)
    assert_close_rel(grads[True][3], torch.autograd.grad(ref_out, ref_bias, dout.double())[0], 1e-4, "dbias")
