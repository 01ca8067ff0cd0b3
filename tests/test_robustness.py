"""Hostile but valid inputs: no crash and no silent wrong answer, in every API and backend they touch.

Traced varlen tables that run past the packed tensors, integer widths (masks past 8 bits, ids past
32 bits), infinite sinks, rows in no varlen sequence, hand-made SparseMask lists, flags of the wrong
type, huge scales and windows, empty dimensions, and arguments of the wrong kind.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import dualattn.jax_api as dj
import dualattn.torch_api as dt
from dualattn import SparseMask, masks
from reference import assert_close_rel, reference_attention, reference_varlen

H, D = 2, 32
# The torch side runs on the GPU too (the jax side runs on jax's default device: the GPU there).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _tol(device):
    return 1e-5 if device == "cpu" else 1e-4   # fp32 on the GPU: 3xTF32 dots


# jax runs on its default device: on a GPU, XLA's fp32 dots are TF32 by default.
JAX_TOL = 1e-5 if jax.default_backend() == "cpu" else 2e-3


def _qkv(rng, b, sq, sk, hq=H, hkv=H, d=D):
    return (torch.from_numpy(rng.standard_normal((b, sq, hq, d)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((b, sk, hkv, d)).astype(np.float32)),
            torch.from_numpy(rng.standard_normal((b, sk, hkv, d)).astype(np.float32)))


def _jax(*tensors):
    return tuple(jnp.asarray(t.numpy()) for t in tensors)


# ----------------------------------------------------------------------------- varlen tables

# Tables no host checks (traced): past the packed tokens, decreasing, negative, longer than max_seqlen.
_BAD_TABLES = {"past-the-end": [0, 10, 5000, 20], "decreasing": [0, 30, 12, 40], "negative": [-50, 10, 20],
               "longer-than-max": [0, 30, 40]}


def _run_as_kernels_do(cu, total, max_seqlen):
    """The sequences a bad table runs as (jax_api.mask.varlen_tokens): non-decreasing, clipped, cut."""
    c = np.clip(np.maximum.accumulate(np.asarray(cu)), 0, total)
    return [(int(a), int(a + min(b - a, max_seqlen))) for a, b in zip(c[:-1], c[1:])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("table", list(_BAD_TABLES), ids=list(_BAD_TABLES))
def test_traced_cu_seqlens_never_leave_the_buffers(rng, table, device):
    total, max_seqlen = 40, 16
    q, k, v = (t[0].to(device) for t in _qkv(rng, 1, total, total))
    cu = torch.tensor(_BAD_TABLES[table], dtype=torch.int32, device=device)
    run = torch.compile(lambda q, k, v, c: dt.flash_attn_varlen_func(q, k, v, c, c, max_seqlen, max_seqlen,
                                                                   causal=True, return_lse=True), fullgraph=True)
    q.requires_grad_(True)
    out, lse = run(q, k, v, cu)
    out.sum().backward()
    # What it means: attention inside each sequence the kernels ran; 0 and lse -inf elsewhere.
    out, lse, grad = out.cpu(), lse.cpu(), q.grad.cpu()
    q, k, v, cu = q.detach().cpu(), k.cpu(), v.cpu(), cu.cpu()
    spans = _run_as_kernels_do(cu.tolist(), total, max_seqlen)
    want = torch.zeros_like(out, dtype=torch.float64)
    want_lse = torch.full(lse.shape, float("-inf"), dtype=torch.float64)
    covered = torch.zeros(total, dtype=torch.bool)
    for a, b in spans:
        if b > a:
            o, l = reference_attention(q[None, a:b], k[None, a:b], v[None, a:b], causal=True)
            want[a:b], want_lse[:, a:b], covered[a:b] = o[0], l[0], True
    assert_close_rel(out, want, _tol(device), "out")
    assert torch.equal(torch.isinf(lse), ~covered.expand_as(lse))
    assert torch.isfinite(grad).all() and not grad[~covered].any()
    # The same table traced by jax.jit, on the triton and xla backends.
    for backend in ("triton", "xla"):
        fn = jax.jit(lambda q, k, v, c: dj.flash_attention_varlen(q, k, v, c, c, max_seqlen, max_seqlen, causal=True,
                                                                 return_lse=True, backend=backend))
        out_j, lse_j = fn(*_jax(q, k, v), jnp.asarray(cu.numpy()))
        assert_close_rel(np.asarray(out_j), want, max(1e-4, JAX_TOL), f"jax {backend} out")
        assert np.array_equal(np.isinf(np.asarray(lse_j)), ~covered.expand_as(lse).numpy())


def test_traced_tables_of_both_sides_run_clamped_and_cut(rng):
    """Different traced query and key tables, each past its packed tokens or decreasing and with clipped
    sequences longer than its max_seqlen, under jax.jit: out, lse and the gradients are the float64
    reference on the tables as flash_attention_varlen's docstring defines them (_run_as_kernels_do on
    each side), causal aligned at the cut ends; 0, -inf and zero gradients for tokens in no sequence."""
    total_q, total_k, max_q, max_k = 40, 48, 12, 20
    cu_q, cu_k = [0, 30, 25, 90], [-3, 10, 44, 47]
    q, k, v = (torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)) for n in (total_q, total_k, total_k))
    dout = torch.from_numpy(rng.standard_normal((total_q, H, D)).astype(np.float32))
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    want = torch.zeros(total_q, H, D, dtype=torch.float64)
    want_lse = torch.full((H, total_q), float("-inf"), dtype=torch.float64)
    for (a, b), (c, d) in zip(_run_as_kernels_do(cu_q, total_q, max_q), _run_as_kernels_do(cu_k, total_k, max_k)):
        if b > a:
            o, l = reference_attention(leaves[0][None, a:b], leaves[1][None, c:d], leaves[2][None, c:d], causal=True)
            want = want.index_put((torch.arange(a, b),), torch.nan_to_num(o[0]))
            want_lse[:, a:b] = l[0].detach()
    want_grads = torch.autograd.grad((want * dout.double()).sum(), leaves)
    assert not want_lse.isinf().all(1).any() and want_lse.isinf().any()   # both kinds of rows
    for backend in ("triton", "xla"):
        def loss(q, k, v, cq, ck):
            out, lse = dj.flash_attention_varlen(q, k, v, cq, ck, max_q, max_k, causal=True, return_lse=True,
                                                 backend=backend)
            return (out * jnp.asarray(dout.numpy())).sum(), (out, lse)
        grads, (out, lse) = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(
            *_jax(q, k, v), jnp.asarray(cu_q, jnp.int32), jnp.asarray(cu_k, jnp.int32))
        assert_close_rel(np.asarray(out), want.detach(), JAX_TOL, f"{backend} out")
        lse = np.asarray(lse)
        assert np.array_equal(np.isinf(lse), want_lse.isinf().numpy()), backend
        finite = ~want_lse.isinf()
        assert_close_rel(lse[finite.numpy()], want_lse[finite], JAX_TOL, f"{backend} lse")
        for name, g, w in zip(("dq", "dk", "dv"), grads, want_grads):
            assert_close_rel(np.asarray(g), w, 1e-4, f"{backend} {name}")


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
def test_rows_past_the_last_sequence_are_zero(rng, with_sinks):
    """cu_seqlens[-1] < total is valid: the rows after it belong to no sequence, so no softmax: output
    0 and lse -inf even with sinks, and their lse cotangent reaches no gradient (dsinks)."""
    q, k, v = (t[0] for t in _qkv(rng, 1, 50, 50))
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    sinks = torch.tensor([0.3, -1.2]) if with_sinks else None
    dlse = torch.from_numpy(rng.standard_normal((H, 50)).astype(np.float32))
    extra = {} if sinks is None else {"softmax_aux": sinks}
    want, want_lse = reference_varlen(q, k, v, cu, cu, **extra)
    outs = {"torch": dt.flash_attn_varlen_func(q, k, v, cu, cu, 20, 20, return_lse=True, **extra)}
    dsinks = {}
    for backend in ("triton", "xla"):
        f = lambda q, s: dj.flash_attention_varlen(q, *_jax(k, v, cu, cu), 20, 20, return_lse=True,  # noqa: E731
                                                   backend=backend, softmax_aux=s)
        if sinks is None:
            outs[backend] = f(*_jax(q), None)
            continue
        outs[backend], vjp = jax.vjp(f, *_jax(q, sinks))
        dsinks[backend] = vjp((jnp.zeros(outs[backend][0].shape), jnp.asarray(dlse.numpy())))[1]
    for name, (out, lse) in outs.items():
        out, lse = np.asarray(out), np.asarray(lse)
        assert not out[30:].any(), name
        assert np.all(lse[:, 30:] == -np.inf), name
        assert_close_rel(out[:30], want[:30], JAX_TOL, name)
        assert_close_rel(lse[:, :30], want_lse[:, :30], JAX_TOL, f"{name} lse")
    if sinks is not None:
        s64 = sinks.double().requires_grad_(True)
        want_dsinks, = torch.autograd.grad(reference_varlen(q, k, v, cu, cu, softmax_aux=s64)[1],
                                           s64, dlse[:, :30].double())
        for name, g in dsinks.items():
            assert_close_rel(np.asarray(g), want_dsinks, 1e-4, f"{name} dsinks")


# ----------------------------------------------------------------------------- integer widths

@pytest.mark.parametrize("device", DEVICES)
def test_integer_mask_is_nonzero_not_truncated(rng, device):
    q, k, v = _qkv(rng, 1, 24, 40)
    mask = torch.from_numpy(rng.random((1, 1, 24, 40)) < 0.7)
    wide = mask.to(torch.int32) * 256        # 256 and 512 truncate to 0 in 8 bits
    wide[..., ::3] *= 2
    want = reference_attention(q, k, v, attention_mask=mask)[0]
    on = lambda *ts: tuple(t.to(device) for t in ts)   # noqa: E731
    assert_close_rel(dt.flash_attention(*on(q, k, v), attention_mask=wide.to(device)).cpu(), want, _tol(device),
                     "torch")
    for backend in ("triton", "xla", "pallas"):
        out = dj.flash_attention(*_jax(q, k, v), attention_mask=jnp.asarray(wide.numpy()), backend=backend)
        assert_close_rel(np.asarray(out), want, max(1e-4, JAX_TOL), backend)


def test_segment_ids_past_32_bits_stay_distinct(rng):
    q, k, v = _qkv(rng, 1, 32, 32)
    ids = torch.zeros(1, 32, dtype=torch.int64)
    ids[:, 16:] = 2 ** 32                    # equal to 0 in 32 bits
    want = reference_attention(q, k, v, q_segment_ids=ids)[0]
    assert_close_rel(dt.flash_attention(q, k, v, q_segment_ids=ids), want, 1e-5, "torch int64")
    big = torch.full((1, 32), 2 ** 63 - 1, dtype=torch.int64)
    big[:, 16:] = -1
    assert_close_rel(dt.flash_attention(q, k, v, q_segment_ids=big), want, 1e-5, "torch int64 extremes")
    # uint32 ids in jax (no 64-bit arrays without jax_enable_x64): 2**31 must not alias anything
    ids_u32 = jnp.asarray(np.where(np.arange(32) < 16, 0, 2 ** 31).astype(np.uint32)[None])
    for backend in ("triton", "xla", "pallas"):
        out = dj.flash_attention(*_jax(q, k, v), q_segment_ids=ids_u32, backend=backend)
        assert_close_rel(np.asarray(out), want, JAX_TOL, f"jax {backend} uint32")
    with jax.enable_x64(True):
        ids_64 = jnp.asarray(ids.numpy())
        for backend in ("xla", "pallas"):
            out = dj.flash_attention(*_jax(q, k, v), q_segment_ids=ids_64, backend=backend)
            assert_close_rel(np.asarray(out), want, JAX_TOL, f"jax {backend} int64")


# ----------------------------------------------------------------------------- infinite sinks

@pytest.mark.parametrize("value", [float("-inf"), float("inf")], ids=["minus-inf", "plus-inf"])
def test_infinite_sinks(rng, value):
    """A -inf sink joins nothing (as no sink); a +inf sink takes every row: output 0, lse +inf.
    Finite gradients either way (also with a finite sink beside it)."""
    q, k, v = _qkv(rng, 1, 24, 24)
    sinks = torch.tensor([[value, 0.5]] * H)    # (Hq, 2): each head has both
    q.requires_grad_(True)
    out, lse = dt.flash_attention(q, k, v, softmax_aux=sinks, causal=True, return_lse=True)
    (out.sum() + lse.clamp(-1e4, 1e4).sum()).backward()
    if value < 0:
        want, want_lse = reference_attention(q.detach(), k, v, softmax_aux=sinks[:, 1:], causal=True)
        assert_close_rel(out, want, 1e-5, "out")
        assert_close_rel(lse, want_lse, 1e-5, "lse")
    else:
        assert not out.any() and torch.all(lse == float("inf"))
    assert torch.isfinite(q.grad).all()
    qj, kj, vj = _jax(q.detach(), k, v)
    for backend in ("triton", "xla", "pallas"):
        def loss(q, s):
            o, l = dj.flash_attention(q, kj, vj, softmax_aux=s, causal=True, return_lse=True, backend=backend)
            return o.sum() + jnp.clip(l, -1e4, 1e4).sum(), (o, l)
        (g_q, g_s), (o, l) = jax.grad(loss, argnums=(0, 1), has_aux=True)(qj, jnp.asarray(sinks.numpy()))
        assert_close_rel(np.asarray(o), out.detach(), JAX_TOL, f"{backend} out")
        assert np.array_equal(np.asarray(l) == np.inf, (lse == float("inf")).numpy()), backend
        assert np.isfinite(np.asarray(g_q)).all() and np.isfinite(np.asarray(g_s)).all(), backend


@pytest.mark.parametrize("scale", [None, 500.0], ids=["default-scale", "scale-500"])
def test_plus_inf_sinks_share_the_lse_cotangent(rng, scale):
    """The +inf sinks of a head share its rows equally: with an lse cotangent dlse, each of m such
    sinks gets sum(dlse) / m, every other input 0 (docs/spec.md, sinks).  Heads with two +inf sinks,
    +inf beside -inf, and no infinite sink; fully masked rows (Sq > Sk, causal); a scale that puts
    the scores far past exp's range (the reference once gave NaN there)."""
    q, k, v = _qkv(rng, 1, 20, 12, hq=3, hkv=1)
    inf = float("inf")
    sinks = torch.tensor([[inf, inf, 0.3], [inf, -inf, 1.0], [0.2, -0.4, -inf]])
    dout = torch.from_numpy(rng.standard_normal((1, 20, 3, D)).astype(np.float32))
    dlse = torch.from_numpy(rng.standard_normal((1, 3, 20)).astype(np.float32))
    opts = dict(causal=True, softmax_scale=scale)
    leaves = [t.double().requires_grad_(True) for t in (q, k, v, sinks)]
    want_out, want_lse = reference_attention(*leaves[:3], softmax_aux=leaves[3], **opts)
    want = torch.autograd.grad((want_out, want_lse), leaves, (dout.double(), dlse.double()))
    total = dlse.double().sum(dim=-1)[0].tolist()                  # per head
    shares = torch.tensor([[total[0] / 2, total[0] / 2, 0.0], [total[1], 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(want[3][:2], shares, rtol=1e-12, atol=1e-12)
    assert not want_out[:, :, :2].any() and torch.isinf(want_lse[:, :2]).all()

    # At scale 500 the softmax of the finite head is nearly one-hot: dq and dk cancel to rounding noise.
    grad_tol = 1e-4 if scale is None else 1e-2
    got = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    out, lse = dt.flash_attention(*got[:3], softmax_aux=got[3], return_lse=True, **opts)
    grads = torch.autograd.grad((out, lse), got, (dout, dlse))
    assert_close_rel(out, want_out, 1e-5, "torch out")
    assert_close_rel(lse, want_lse, 1e-5, "torch lse")
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want):
        assert_close_rel(g[:, :, 2:] if name == "dq" else g, w[:, :, 2:] if name == "dq" else w, grad_tol,
                         f"torch {name}")
        if name == "dq":
            assert not g[:, :, :2].any(), "dq of saturated heads"
    qj, kj, vj, sj = _jax(q, k, v, sinks)
    for backend in ("triton", "xla", "pallas"):
        f = lambda *a: dj.flash_attention(*a[:3], softmax_aux=a[3], return_lse=True, backend=backend,  # noqa: E731
                                          **opts)
        (o, l), vjp = jax.vjp(f, qj, kj, vj, sj)
        assert_close_rel(np.asarray(o), want_out, JAX_TOL, f"{backend} out")
        assert np.array_equal(np.asarray(l) == np.inf, (want_lse == inf).numpy()), backend
        for name, g, w in zip(("dq", "dk", "dv", "dsinks"), vjp(_jax(dout, dlse)), want):
            assert_close_rel(np.asarray(g), w, grad_tol if jax.default_backend() == "cpu" else 2e-2,
                             f"{backend} {name}")


# Sinks with a NaN: (layout, sinks for Hq = 2, which heads turn NaN).
_NAN_SINKS = {"one-per-head": ([float("nan"), 0.5], [True, False]),
              "two-per-head": ([[0.3, -1.0], [float("nan"), 0.2]], [False, True]),
              "shared": ([float("nan")], [True, True])}


def _check_nan_sinks(out, lse, want, nan_heads, tol, name):
    """Every row of a head with a NaN sink is NaN (out and lse), as the float64 softmax gives; the other
    heads are the float64 reference."""
    out, lse, want = np.asarray(out, np.float64), np.asarray(lse), np.asarray(want)
    nan_heads = np.asarray(nan_heads)
    assert np.isnan(want[:, :, nan_heads]).all() and np.isfinite(want[:, :, ~nan_heads]).all()
    assert np.isnan(out[:, :, nan_heads]).all(), f"{name}: finite output in a head with a NaN sink"
    assert np.isnan(lse[:, nan_heads]).all(), f"{name}: finite lse in a head with a NaN sink"
    if (~nan_heads).any():
        assert not np.isnan(lse[:, ~nan_heads]).any(), name
        assert_close_rel(out[:, :, ~nan_heads], want[:, :, ~nan_heads], tol, name)


@pytest.mark.parametrize("layout", list(_NAN_SINKS))
def test_nan_sinks_propagate_in_every_backend(rng, layout):
    """A NaN sink is a NaN in its head's softmax denominator: every backend gives NaN rows there (none
    drops the sink, which would be a finite, wrong answer), the reference elsewhere.  Causal with more
    queries than keys: rows with no visible key are NaN too (the sink still joins them)."""
    sinks, nan_heads = _NAN_SINKS[layout]
    sinks = torch.tensor(sinks)
    q, k, v = _qkv(rng, 1, 24, 20)
    want = reference_attention(q, k, v, softmax_aux=sinks, causal=True)[0]
    out, lse = dt.flash_attention(q, k, v, softmax_aux=sinks, causal=True, return_lse=True)
    _check_nan_sinks(out, lse, want, nan_heads, 1e-5, "torch")
    qj, kj, vj, sj = _jax(q, k, v, sinks)
    for backend in ("triton", "xla", "pallas"):
        out, lse = dj.flash_attention(qj, kj, vj, softmax_aux=sj, causal=True, return_lse=True, backend=backend)
        _check_nan_sinks(out, lse, want, nan_heads, JAX_TOL, f"jax {backend}")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 100, 4, 64), (1, 1024, 4, 128)], ids=["portable", "large"])
@pytest.mark.parametrize("layout", ["one-per-head", "two-per-head"])
def test_gpu_nan_sinks_propagate(rng, shape, layout):
    """On the GPU: the portable forward and, at 1024 tokens and d = 128 in bf16 on sm_90, the Gluon
    forward (which joins the sinks after its loop) give NaN in the heads with a NaN sink."""
    b, s, hq, d = shape
    dtype = torch.float32 if s < 1000 else torch.bfloat16
    sinks, nan_heads = _NAN_SINKS[layout]
    sinks = torch.tensor(sinks * (hq // 2), device="cuda")
    nan_heads = nan_heads * (hq // 2)
    q, k, v = (torch.from_numpy(rng.standard_normal((b, s, hq, d)).astype(np.float32)).to("cuda", dtype)
               for _ in range(3))
    want = reference_attention(q.cpu(), k.cpu(), v.cpu(), softmax_aux=sinks.cpu(), causal=True)[0]
    out, lse = dt.flash_attention(q, k, v, softmax_aux=sinks, causal=True, return_lse=True)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _check_nan_sinks(out.float().cpu(), lse.cpu(), want, nan_heads, tol, "torch cuda")
    qj, kj, vj, sj = _jax(q.float().cpu(), k.float().cpu(), v.float().cpu(), sinks.cpu())
    out, lse = dj.flash_attention(qj, kj, vj, softmax_aux=sj, causal=True, return_lse=True, backend="triton")
    _check_nan_sinks(out, lse, want, nan_heads, 2e-3, "jax triton")


# ----------------------------------------------------------------------------- huge values

@pytest.mark.parametrize("case", ["scale-1e30", "query-1e20"])
def test_huge_scores_stay_finite_in_every_backend(rng, case):
    q, k, v = _qkv(rng, 1, 32, 32)
    scale = 1e30 if case == "scale-1e30" else None
    if case == "query-1e20":
        q[0, 3, 0, 0] = 1e20
    ref, ref_lse = dt.flash_attention(q, k, v, softmax_scale=scale, return_lse=True)
    want, want_lse = reference_attention(q, k, v, softmax_scale=scale)
    assert_close_rel(ref, want, 1e-5, "torch")
    for backend in ("triton", "xla", "pallas"):
        out, lse = dj.flash_attention(*_jax(q, k, v), softmax_scale=scale, return_lse=True, backend=backend)
        assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all(), backend
        assert_close_rel(np.asarray(out), want, JAX_TOL, backend)
        assert_close_rel(np.asarray(lse), want_lse, JAX_TOL / 10, backend)


def test_window_wider_than_int32_is_unbounded(rng):
    q, k, v = _qkv(rng, 1, 16, 24)
    want = dt.flash_attention(q, k, v, causal=True)
    assert torch.equal(dt.flash_attention(q, k, v, sliding_window=(2 ** 40, 0)), want)
    for backend in ("triton", "xla", "pallas"):
        out = dj.flash_attention(*_jax(q, k, v), sliding_window=(2 ** 40, 0), backend=backend)
        assert_close_rel(np.asarray(out), want, JAX_TOL, backend)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("empty", ["batch", "queries", "keys"])
def test_empty_dimensions_in_every_backend(empty, device):
    # On a GPU, jax-triton passed the empty grid of an empty batch or query axis to CUDA, which
    # rejects it (found by the GPU fuzz): such launches now run no program.
    b, sq, sk = {"batch": (0, 8, 8), "queries": (1, 0, 8), "keys": (1, 8, 0)}[empty]
    q, k, v = jnp.ones((b, sq, H, D)), jnp.ones((b, sk, H, D)), jnp.ones((b, sk, H, D))
    # With segment ids too: the xla path's tile skipping once reduced the empty batch's ids.
    ids = dict(q_segment_ids=jnp.zeros((b, sq), jnp.int32), kv_segment_ids=jnp.zeros((b, sk), jnp.int32))
    bias = dict(bias=jnp.ones((1, 1, sq, sk)))
    for backend in ("triton", "xla") + (("pallas",) if device == "cpu" else ()):
        for extra in ({}, ids, bias):
            f = lambda q, k, v: dj.flash_attention(q, k, v, return_lse=True, backend=backend, **extra)  # noqa: E731
            (out, lse), vjp = jax.vjp(f, q, k, v)
            assert out.shape == (b, sq, H, D) and not np.asarray(out).any(), backend
            assert np.all(np.asarray(lse) == -np.inf), backend
            grads = vjp((jnp.ones_like(out), jnp.zeros_like(lse)))
            for g, x in zip(grads, (q, k, v)):
                assert g.shape == x.shape and not np.asarray(g).any(), backend
    out = dt.flash_attention(*(torch.ones(x.shape, device=device) for x in (q, k, v)))
    assert out.shape == (b, sq, H, D) and not out.any()


# ----------------------------------------------------------------------------- what is rejected, and how

def test_flags_must_be_bools():
    q = torch.ones(1, 8, 1, 16)
    calls = {
        "torch causal": lambda: dt.flash_attention(q, q, q, causal="False"),
        "torch return_lse": lambda: dt.flash_attention(q, q, q, return_lse="yes"),
        "torch varlen causal": lambda: dt.flash_attn_varlen_func(q[0], q[0], q[0], torch.tensor([0, 8], dtype=torch.int32),
                                                                 torch.tensor([0, 8], dtype=torch.int32), 8, 8, causal=1),
        "torch sdpa is_causal": lambda: dt.scaled_dot_product_attention(q, q, q, is_causal="True"),
        "torch blocksparse causal": lambda: dt.blocksparse_attention(q, q, q, mask_builder=masks.causal(), block_q=16,
                                                                    block_k=16, causal="no"),
        "jax causal": lambda: dj.flash_attention(jnp.ones((1, 8, 1, 16)), jnp.ones((1, 8, 1, 16)),
                                                 jnp.ones((1, 8, 1, 16)), causal="False", backend="xla"),
        "jax blocksparse return_lse": lambda: dj.blocksparse_attention(
            jnp.ones((1, 16, 1, 16)), jnp.ones((1, 16, 1, 16)), jnp.ones((1, 16, 1, 16)), block_q=16, block_k=16,
            mask_builder=masks.causal(), return_lse=None, backend="xla"),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match=name.split()[-1]):
            call()
    for seed in (True, "1", 1.5):
        with pytest.raises(TypeError, match="dropout_seed"):
            dt.flash_attention(q, q, q, dropout_prob=0.1, dropout_seed=seed)


def test_wrong_kinds_of_argument_name_the_argument():
    x, t = jnp.ones((1, 8, 1, 16)), torch.ones(1, 8, 1, 16)
    cases = {
        "query": lambda: dj.flash_attention([[[[1.0] * 16]]], x, x),
        "key": lambda: dj.flash_attention(x, t, x, backend="xla"),
        "cu_seqlens_q": lambda: dj.flash_attention_varlen(x[0], x[0], x[0], [0, 8], jnp.asarray([0, 8], jnp.int32), 8, 8),
        "value": lambda: dj.blocksparse_attention(x, x, None, mask_builder=masks.causal(), block_q=16, block_k=16),
        "window": lambda: masks.local(None),
    }
    for name, call in cases.items():
        with pytest.raises(TypeError, match=name):
            call()
    with pytest.raises(TypeError, match="key"):
        dt.blocksparse_attention(t, None, t, mask_builder=masks.causal(), block_q=16, block_k=16)


def test_hand_made_sparse_lists_are_checked():
    layout = SparseMask.from_block_map(np.random.default_rng(0).random((1, 2, 4, 4)) < 0.5, 32, 32)
    bad = {"kv_indices": np.full_like(layout.kv_indices, 7), "kv_counts": layout.kv_counts + 9,
           "q_order": np.zeros_like(layout.q_order), "q_indices": -np.ones_like(layout.q_indices),
           "k_order": layout.k_order[..., :2]}
    for field, value in bad.items():
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(layout, **{field: value})


def test_empty_batch_with_sinks_backward():
    """B = 0 with sinks: empty gradients and zero dsinks, no division by the empty batch."""
    q = torch.zeros(0, 8, 2, 16, requires_grad=True)
    sinks = torch.zeros(2, requires_grad=True)
    dt.flash_attention(q, q, q, softmax_aux=sinks).sum().backward()
    assert q.grad.shape == q.shape and torch.equal(sinks.grad, torch.zeros(2))


def test_float_options_must_be_numbers():
    """A string scale or cap is rejected naming the argument (float() would parse "0.5", or fail
    with a message naming nothing); found by python -m dualattn.fuzz."""
    q, x = torch.ones(1, 8, 1, 16), jnp.ones((1, 8, 1, 16))
    for name, value in (("softmax_scale", "0.5"), ("softmax_scale", [0.5]), ("logits_soft_cap", "30"),
                        ("logits_soft_cap", True)):
        with pytest.raises(TypeError, match=name):
            dt.flash_attention(q, q, q, **{name: value})
        with pytest.raises(TypeError, match=name):
            dj.flash_attention(x, x, x, backend="xla", **{name: value})


def test_max_seqlen_and_builder_results_of_the_wrong_kind():
    """max_seqlen "32" or 32.0 was read by int(); a mask builder returning None became a 1 x 1 layout:
    both now name the argument (found by scanning the invalid-input surfaces)."""
    q, cu = torch.ones(32, 1, 16), torch.tensor([0, 32], dtype=torch.int32)
    x, cu_j = jnp.ones((32, 1, 16)), jnp.asarray([0, 32], jnp.int32)
    for value in ("32", 32.0, True):
        with pytest.raises(TypeError, match="max_seqlen_q"):
            dt.flash_attn_varlen_func(q, q, q, cu, cu, value, 32)
        with pytest.raises(TypeError, match="max_seqlen_k"):
            dj.flash_attention_varlen(x, x, x, cu_j, cu_j, 32, value, backend="xla")
    assert dt.flash_attn_varlen_func(q, q, q, cu, cu, np.int64(32), 32).shape == q.shape
    with pytest.raises(ValueError, match="mask_builder"):
        dt.blocksparse_attention(q[None], q[None], q[None], mask_builder=lambda *a: None, block_q=16, block_k=16)
