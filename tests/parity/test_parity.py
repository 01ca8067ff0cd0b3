"""Parity: the same inputs through torch (triton), jax (triton / xla / pallas) and the float64 reference.

torch vs jax triton run the same kernel with the same launch plan, so they must agree to the
last bit (outputs, lse and every gradient), and dropout with one seed must drop the same entries.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualattn.jax_api as dj  # noqa: E402
import dualattn.torch_api as dt  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from reference import assert_close_rel, dropout_keep_reference, numpy_reference_with_grads, relative_error  # noqa: E402

# (name, shapes (B, Sq, Sk, Hq, Hkv, D), options): each combination users hit.
CASES = [
    ("causal_gqa_window", (2, 67, 67, 4, 2, 32), dict(causal=True, sliding_window=(20, 0))),
    ("segments_sinks", (1, 80, 80, 2, 2, 32), dict(segments=True, softmax_aux="per_head")),
    ("mask_bias_softcap", (1, 48, 72, 2, 1, 16), dict(attention_mask=True, bias=True, logits_soft_cap=5.0)),
    ("cross_decode_causal", (2, 1, 90, 4, 4, 64), dict(causal=True)),
]


def _inputs(rng, shapes, opts, dtype=np.float32):
    b, sq, sk, hq, hkv, d = shapes
    x = dict(query=rng.standard_normal((b, sq, hq, d)), key=rng.standard_normal((b, sk, hkv, d)),
             value=rng.standard_normal((b, sk, hkv, d)))
    x = {n: a.astype(dtype) for n, a in x.items()}
    kw = {k: v for k, v in opts.items() if k not in ("segments", "softmax_aux", "attention_mask", "bias")}
    if opts.get("segments"):
        seg = np.sort(rng.integers(0, 3, size=(b, sq)), axis=1).astype(np.int32)
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    if opts.get("softmax_aux"):
        x["softmax_aux"] = rng.standard_normal((hq,)).astype(np.float32)
    if opts.get("attention_mask"):
        kw["attention_mask"] = rng.random((b, 1, sq, sk)) > 0.3
    if opts.get("bias"):
        x["bias"] = rng.standard_normal((1, hq, sq, sk)).astype(np.float32)
    dout = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    return x, kw, dout


def _torch_run(x, kw, dout, dlse=None):
    leaves = {n: torch.tensor(a, requires_grad=True) for n, a in x.items()}
    extra = {k: torch.tensor(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}
    out, lse = dt.flash_attention(leaves["query"], leaves["key"], leaves["value"], bias=leaves.get("bias"),
                                  softmax_aux=leaves.get("softmax_aux"), return_lse=True, **extra)
    if dlse is None:
        grads = torch.autograd.grad(out, list(leaves.values()), torch.tensor(dout))
    else:
        grads = torch.autograd.grad((out, lse), list(leaves.values()), (torch.tensor(dout), torch.tensor(dlse)))
    res = {"out": out, "lse": lse, **{"d" + n: g for n, g in zip(leaves, grads)}}
    return {k: v.detach().numpy() for k, v in res.items()}


def _jax_run(x, kw, dout, backend, dlse=None):
    names = list(x)
    extra = {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in kw.items()}

    def f(*arrays):
        a = dict(zip(names, arrays))
        return dj.flash_attention(a["query"], a["key"], a["value"], bias=a.get("bias"),
                                  softmax_aux=a.get("softmax_aux"), return_lse=True, backend=backend, **extra)

    (out, lse), vjp = jax.vjp(jax.jit(f), *[jnp.asarray(x[n]) for n in names])
    grads = vjp((jnp.asarray(dout), jnp.zeros_like(lse) if dlse is None else jnp.asarray(dlse)))
    res = {"out": out, "lse": lse, **{"d" + n: g for n, g in zip(names, grads)}}
    return {k: np.asarray(v) for k, v in res.items()}


@pytest.mark.parametrize("name,shapes,opts", CASES, ids=[c[0] for c in CASES])
def test_torch_and_jax_triton_are_bitwise_equal_and_match_reference(name, shapes, opts, rng):
    x, kw, dout = _inputs(rng, shapes, opts)
    t = _torch_run(x, kw, dout)
    j = _jax_run(x, kw, dout, "triton")
    for key in t:
        np.testing.assert_array_equal(j[key], t[key], err_msg=f"{key}: torch and jax triton differ")
    ref = numpy_reference_with_grads(x, dout, **kw)
    for key in ("out", "dquery", "dkey", "dvalue", "dbias", "dsoftmax_aux"):
        if key in t:
            assert relative_error(t[key], ref[key]) < 2e-5, key
    finite = np.isfinite(ref["lse"])
    np.testing.assert_array_equal(np.isfinite(t["lse"]), finite)
    np.testing.assert_allclose(t["lse"][finite], ref["lse"][finite], rtol=1e-5, atol=1e-5)


def test_documents_on_tile_boundaries_bitwise_in_both_frameworks(rng):
    """Documents filling whole tiles: the tile pairs inside one document run the unmasked loop with no
    segment compare (segments.py's pure runs, a (batch, tiles, 4) launch output), the same bits from
    both launchers."""
    x, kw, dout = _inputs(rng, (1, 128, 128, 2, 1, 32), dict(causal=True))
    seg = np.repeat(np.array([[0, 1]], np.int32), 64, axis=1)
    kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    t = _torch_run(x, kw, dout)
    j = _jax_run(x, kw, dout, "triton")
    for key in t:
        np.testing.assert_array_equal(j[key], t[key], err_msg=f"{key}: torch and jax triton differ")
    ref = numpy_reference_with_grads(x, dout, **kw)
    for key in ("out", "dquery", "dkey", "dvalue"):
        assert relative_error(t[key], ref[key]) < 2e-5, key


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("name,shapes,opts", CASES, ids=[c[0] for c in CASES])
def test_jax_backends_agree_with_triton_and_reference(name, shapes, opts, backend, rng):
    pytest.importorskip(f"dualattn.jax_api.{backend}")
    x, kw, dout = _inputs(rng, shapes, opts)
    ref = numpy_reference_with_grads(x, dout, **kw)
    j = _jax_run(x, kw, dout, backend)
    for key in ("out", "dquery", "dkey", "dvalue", "dbias", "dsoftmax_aux"):
        if key in j:
            assert relative_error(j[key], ref[key]) < 1e-4, f"{backend} {key}"


@pytest.mark.parametrize("name,shapes,opts", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_lse_cotangent_same_in_torch_jax_triton_and_xla(name, shapes, opts, rng):
    """A loss on both outputs: the Triton path takes dlse (delta - dlse), bitwise alike in the two
    frameworks, and equal to the XLA path's (tested against the float64 reference in test_xla)."""
    x, kw, dout = _inputs(rng, shapes, opts)
    b, sq, _, hq, _, _ = shapes
    dlse = rng.standard_normal((b, hq, sq)).astype(np.float32)
    t = _torch_run(x, kw, dout, dlse)
    j = _jax_run(x, kw, dout, "triton", dlse)
    for key in t:
        np.testing.assert_array_equal(j[key], t[key], err_msg=f"{key}: torch and jax triton differ")
    xla = _jax_run(x, kw, dout, "xla", dlse)
    plain = _torch_run(x, kw, dout)
    for key in ("dquery", "dkey", "dsoftmax_aux", "dbias"):
        if key in t:
            assert relative_error(t[key], xla[key]) < 1e-4, key
            assert relative_error(t[key], plain[key]) > 1e-3, f"{key}: the lse cotangent changed nothing"


def test_jax_bias_nobody_differentiates_gets_no_dbias(rng, monkeypatch):
    """A bias closed over (an ALiBi or a fixed table) reaches the custom VJP unperturbed: the backward
    plans no dbias (plan_backward's bias_grad, as torch's bias without requires_grad), and dQ, dK, dV
    are those of the call that differentiates the bias too.  A grad of lse alone (a symbolic zero
    for the output) works as well."""
    from dualattn.kernels.flash import plan as flash_plan
    asked, real = [], flash_plan.plan_backward
    monkeypatch.setattr(flash_plan, "plan_backward", lambda *a, **k: asked.append(k["bias_grad"]) or real(*a, **k))
    q, k, v = (jnp.asarray(rng.standard_normal((1, 48, 2, 16)).astype(np.float32)) for _ in range(3))
    bias = jnp.asarray(rng.standard_normal((1, 2, 48, 48)).astype(np.float32))

    def attn(q, k, v, b):
        return dj.flash_attention(q, k, v, bias=b, causal=True, backend="triton")
    fixed = jax.grad(lambda *x: attn(*x, bias).sum(), argnums=(0, 1, 2))(q, k, v)
    learned = jax.grad(lambda *x: attn(*x).sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)
    assert asked == [False, True]
    for a, b in zip(fixed, learned[:3]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    dq = jax.grad(lambda q: dj.flash_attention(q, k, v, causal=True, backend="triton", return_lse=True)[1].sum())(q)
    assert dq.shape == q.shape and bool(jnp.isfinite(dq).all())


def test_dropout_drops_the_same_entries_in_torch_and_jax(rng):
    b, s, h, d, p, seed = 1, 64, 2, 32, 0.3, 1234
    x = {n: rng.standard_normal((b, s, h, d)).astype(np.float32) for n in ("query", "key", "value")}
    dout = rng.standard_normal((b, s, h, d)).astype(np.float32)
    kw = dict(dropout_prob=p, dropout_seed=seed)
    t = _torch_run(x, kw, dout)
    j = _jax_run(x, kw, dout, "triton")
    for key in t:
        np.testing.assert_array_equal(j[key], t[key], err_msg=key)
    keep = dropout_keep_reference(seed, b, h, s, s, p)
    ref = numpy_reference_with_grads(x, dout, dropout_prob=p, dropout_keep=keep)
    assert relative_error(t["out"], ref["out"]) < 2e-5
    assert relative_error(t["dquery"], ref["dquery"]) < 2e-5
    # the xla backend uses the jnp twin of the same hash
    pytest.importorskip("dualattn.jax_api.xla")
    jx = _jax_run(x, kw, dout, "xla")
    assert relative_error(jx["out"], ref["out"]) < 1e-4


def test_jax_triton_traced_seed_vmap_and_varlen(rng):
    b, s, h, d = 2, 40, 2, 16
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for _ in range(3))
    # a traced dropout seed under jit: two seeds, two masks; same seed, same output
    f = jax.jit(lambda q, k, v, seed: dj.flash_attention(q, k, v, dropout_prob=0.5, dropout_seed=seed,
                                                         backend="triton"))
    o1, o2, o3 = f(q, k, v, jnp.int32(1)), f(q, k, v, jnp.int32(2)), f(q, k, v, jnp.int32(1))
    assert not np.array_equal(o1, o2)
    np.testing.assert_array_equal(o1, o3)
    # vmap over an extra leading axis equals the per-element calls
    qs = jnp.stack([q, q * 0.5])
    vm = jax.vmap(lambda qq: dj.flash_attention(qq, k, v, causal=True, backend="triton"))(qs)
    np.testing.assert_array_equal(vm[1], dj.flash_attention(qs[1], k, v, causal=True, backend="triton"))
    # varlen through jax equals torch's varlen
    lens = [17, 40, 5]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    qp, kp, vp = (rng.standard_normal((cu[-1], h, d)).astype(np.float32) for _ in range(3))
    jo = dj.flash_attention_varlen(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(cu),
                                   jnp.asarray(cu), max(lens), max(lens), causal=True, backend="triton")
    to = dt.flash_attn_varlen_func(torch.tensor(qp), torch.tensor(kp), torch.tensor(vp), torch.tensor(cu),
                                   torch.tensor(cu), max(lens), max(lens), causal=True)
    np.testing.assert_array_equal(np.asarray(jo), to.numpy())


@pytest.mark.parametrize("tile_ids", [False, True], ids=["ids", "tile_ids"])
def test_varlen_one_table_as_segment_ids_is_the_same_in_both(rng, monkeypatch, tile_ids):
    """Varlen with one table run as segment ids (plan.varlen_as_documents and varlen_backward_as_documents;
    DUALATTN_VARLEN_DOCUMENTS=1 takes them through the interpreter): jax with the table traced under jit gives
    torch's numbers bit for bit, forward and gradients, and both match the varlen kernels.  `tile_ids`: the
    segment ranges from the key tiles' [min, max] ids, as on a pack longer than plan.TILE_IDS_FROM (made short)."""
    from dualattn.kernels.flash import plan as flash_plan
    if tile_ids:
        monkeypatch.setattr(flash_plan, "TILE_IDS_FROM", 16)
    h, d, lens = 2, 16, [17, 40, 0, 5]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    total = int(cu[-1]) + 6   # tokens past the last sequence
    qp, kp, vp, dop = (rng.standard_normal((total, h, d)).astype(np.float32) for _ in range(4))

    def both():
        def jax_loss(q, k, v, c):
            out, lse = dj.flash_attention_varlen(q, k, v, c, c, max(lens), max(lens), causal=True, return_lse=True,
                                                 backend="triton")
            return jnp.sum(out * jnp.asarray(dop)), (out, lse)
        (_, (jo, jl)), jg = jax.jit(jax.value_and_grad(jax_loss, argnums=(0, 1, 2), has_aux=True))(
            jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(cu))
        table = torch.tensor(cu)
        leaves = [torch.tensor(x, requires_grad=True) for x in (qp, kp, vp)]
        to, tl = dt.flash_attn_varlen_func(*leaves, table, table, max(lens), max(lens), causal=True,
                                           return_lse=True)
        tg = torch.autograd.grad(to, leaves, torch.tensor(dop))
        return (np.asarray(jo), np.asarray(jl), *map(np.asarray, jg)), (to.detach().numpy(), tl.detach().numpy(),
                                                                       *(g.numpy() for g in tg))

    chains, real = [], (flash_plan.plan_forward, flash_plan.plan_backward)

    def spy(which):
        def planned(*args, **kwargs):
            plan = real[which](*args, **kwargs)
            chains.append([one.kernel for one in (plan.dkdv if which else plan).chain])
            return plan
        return planned

    monkeypatch.setattr(flash_plan, "plan_forward", spy(0))
    monkeypatch.setattr(flash_plan, "plan_backward", spy(1))
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "1")
    jax_results, torch_results = both()
    # jax and torch both ran the forward and the backward as documents
    heads = [chain[0] for chain in chains]
    assert heads.count("varlen_segment_ids_kernel") == 4, chains
    assert all(("segment_tile_ids_kernel" in chain) == tile_ids for chain in chains), chains
    for name, j, t in zip(("out", "lse", "dq", "dk", "dv"), jax_results, torch_results):
        np.testing.assert_array_equal(j, t, err_msg=name)
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "0")
    varlen_results, _ = both()
    jl, vl = jax_results[1], varlen_results[1]
    assert np.array_equal(np.isneginf(jl), np.isneginf(vl))
    for name, j, v in zip(("out", "dq", "dk", "dv"), jax_results[:1] + jax_results[2:],
                          varlen_results[:1] + varlen_results[2:]):
        assert relative_error(j, v) < 1e-5, name


@pytest.fixture
def warp_specialize_everything(monkeypatch):
    """DUALATTN_WS=1 with the speed rules off (hopper.WS_MIN_KEY_WORK, split_band_pays): the
    interpreter's small problems take the warp-specialised kernels and split every band."""
    from dualattn.kernels.flash import hopper, plan as flash_plan
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    for rule in ("WS_MIN_KEY_WORK", "WS_SPLIT_MIN_KEYS", "WS_SPLIT_MIN_HEAD_DIM"):
        monkeypatch.setattr(hopper, rule, 0)
    flash_plan.forget_plans()   # memoised under the other rules
    yield flash_plan
    flash_plan.forget_plans()


@pytest.mark.parametrize("causal,num_sms", [(True, None), (False, None), (True, "2")],
                         ids=["causal-split", "full", "causal-persistent-band"])
def test_warp_specialized_kernels_bitwise_in_both_frameworks_interpreted(causal, num_sms, warp_specialize_everything,
                                                                         monkeypatch, rng):
    """The warp-specialised kernels chained by JAX's launcher (a split band's edges launch resumed
    from fresh buffers; torch resumes in place) give torch's bits, forward and backward
    (interpreter, fp16: it mis-reads bf16 descriptor loads).  On CPU both run the interpreter,
    which needs no global scratch: the DESC_SCRATCH fix is tested offline (tests/jax/test_scratch.py)
    and on the GPU (below).  With an SM count (DUALATTN_NUM_SMS, fewer than the 4 tiles) the causal
    forward runs persistent with its band in the loop (plan.ws_band_in_loop), in one launch; two
    programs take two rounds, the second in reverse (rules.program_tile)."""
    shapes, opts = (1, 256, 256, 2, 2, 128), dict(causal=causal)
    if num_sms is not None:
        set_switch(monkeypatch, "DUALATTN_NUM_SMS", num_sms)
    persistent = num_sms is not None
    plan = warp_specialize_everything
    launches, backwards, real_fwd, real_bwd = [], [], plan.plan_forward, plan.plan_backward
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plan, "plan_forward", lambda *a, **k: launches.append(real_fwd(*a, **k)) or launches[-1])
        m.setattr(plan, "plan_backward", lambda *a, **k: backwards.append(real_bwd(*a, **k)) or backwards[-1])
        x, kw, dout = _inputs(rng, shapes, opts, dtype=np.float16)
        t = _torch_run(x, kw, dout)
        j = _jax_run(x, kw, dout, "triton")
    assert launches and all(f.constexpr_dict["WARP_SPECIALIZE"] and f.constexpr_dict["PERSISTENT"] == persistent
                            and (f.then is not None) == (causal and not persistent) for f in launches)
    assert len(backwards) == 2 and all(b.dkdv.constexpr_dict["WARP_SPECIALIZE"] and b.dq.constexpr_dict["WARP_SPECIALIZE"]
                                       for b in backwards)
    for key in t:
        np.testing.assert_array_equal(j[key], t[key], err_msg=f"{key}: torch and jax triton differ")
    ref = numpy_reference_with_grads({n: a.astype(np.float64) for n, a in x.items()}, dout.astype(np.float64), **kw)
    assert relative_error(t["out"], ref["out"]) < 2e-3


def _gpu_inputs(seed, b, s, h, d):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]


def _gpu_both(tensors, causal, **options):
    """(torch's, jax's) out, dq, dk, dv on the same device buffers (jax reads them through DLPack,
    tensor options too)."""
    tq, tk, tv, tdo = tensors
    leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
    to = dt.flash_attention(*leaves, causal=causal, **options)
    tg = torch.autograd.grad(to, leaves, tdo)
    jax_options = {n: jax.dlpack.from_dlpack(v.detach()) if isinstance(v, torch.Tensor) else v
                   for n, v in options.items()}
    jo, vjp = jax.vjp(jax.jit(lambda a, b_, c: dj.flash_attention(a, b_, c, causal=causal, backend="triton",
                                                                   **jax_options)),
                      *(jax.dlpack.from_dlpack(t) for t in (tq, tk, tv)))
    jg = vjp(jax.dlpack.from_dlpack(tdo))
    return [t.detach() for t in (to, *tg)], [torch.from_dlpack(a) for a in (jo, *jg)]


def _assert_same_bits(torch_results, jax_results, one_pass: bool):
    """out, dq, dk, dv bitwise equal in both frameworks; dQ of the one-pass kernel within one bf16 step.
    That kernel adds each key tile's dQ into fp32 by TMA reductions, in whatever order the programs
    reach them (as FA3): run to run, in either framework, a few sums round the other way, rarely."""
    for name, a, ref in zip(("out", "dq", "dk", "dv"), jax_results, torch_results):
        same = a.view(torch.int16) == ref.view(torch.int16)
        if name == "dq" and one_pass:
            step = ref.float().abs() * 2.0 ** -7 + 1e-6
            assert bool(((a.float() - ref.float()).abs() <= step).all()) and int((~same).sum()) < same.numel() // 1000
            continue
        assert bool(same.all()), f"{name}: {int((~same).sum())} elements differ"


def _default_plans(shapes_bshd, causal, num_sms):
    """(forward, dQ) launches the Triton plans give on sm_90 with num_sms SMs (both launchers ask
    the same; the Gluon kernels off), built as the offline compile tests build them."""
    import test_compile   # tests/ is on sys.path (its conftest)
    b, s, h, d = shapes_bshd
    fwd, bwd, _ = test_compile.Variant("default", batch=b, sq=s, sk=s, hq=h, hkv=h, d=d, causal=causal,
                                       lse_grad=True, ws=True, num_sms=num_sms).build(90)
    return fwd, bwd.dq


# (B, S, H, D, causal, (forward warp-specialised, split band, dQ warp-specialised, forward persistent)
# on an H100 (132 SMs) with the Gluon kernels off; the causal S=2048 forward runs its band in the
# persistent loop)
GPU_CASES = [(2, 4096, 8, 128, False, (True, False, True, True)), (2, 4096, 8, 64, False, (True, False, False, True)),
             (2, 2048, 8, 128, True, (True, False, True, True)), (1, 8192, 4, 128, True, (True, True, True, False))]


# The kernels each GPU parity case runs: the portable ones (DUALATTN_WS=0); or on sm_90 the Triton
# warp-specialised forward (the Gluon forward off) with the two-pass warp-specialised backward; or
# the Gluon forward (the default) with the one-pass Gluon backward (forced: the default picks the
# backward by length, plan.ONE_PASS_MIN_KEYS).
BACKWARDS = {"portable": {"DUALATTN_WS": "0", "DUALATTN_ONE_PASS": None, "DUALATTN_GLUON_FWD": None},
             "two-pass": {"DUALATTN_WS": None, "DUALATTN_ONE_PASS": "0", "DUALATTN_GLUON_FWD": "0"},
             "one-pass": {"DUALATTN_WS": None, "DUALATTN_ONE_PASS": "1", "DUALATTN_GLUON_FWD": None}}


@pytest.mark.gpu
@pytest.mark.parametrize("backward", list(BACKWARDS))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"b{c[0]}-s{c[1]}-h{c[2]}-d{c[3]}-causal{int(c[4])}")
def test_gpu_torch_and_jax_triton_bitwise_at_size(monkeypatch, backward, case):
    """The very same bits in both frameworks, on torch tensors handed to jax through DLPack: with
    the portable kernels; on sm_90 with the Triton warp-specialised kernels (JAX's descriptors in
    DESC_SCRATCH, jax_api/_scratch.py), the split causal band among them (JAX resumes the edges
    launch from fresh buffers, torch in place); and with the Gluon kernels, which reach JAX
    through jax_api/_compile.py (the one-pass dQ is the one result that is not bitwise
    reproducible, below)."""
    for name, value in BACKWARDS[backward].items():
        set_switch(monkeypatch, name, value)
    one_pass = backward == "one-pass" and torch.cuda.get_device_capability() == (9, 0)
    b, s, h, d, causal, expected = case
    if backward == "two-pass" and torch.cuda.get_device_capability()[0] == 9:
        fwd, dq = _default_plans((b, s, h, d), causal, torch.cuda.get_device_properties(0).multi_processor_count)
        got = (fwd.constexpr_dict["WARP_SPECIALIZE"], fwd.then is not None, dq.constexpr_dict["WARP_SPECIALIZE"],
               fwd.constexpr_dict["PERSISTENT"])
        assert got == expected
    from plan_spy import spy_kernels
    backward_kernels = spy_kernels(monkeypatch)
    forward_kernels = spy_kernels(monkeypatch, "plan_forward")
    t, j = _gpu_both(_gpu_inputs(0, b, s, h, d), causal)
    _assert_same_bits(t, j, one_pass)
    # torch's and JAX's backward plans (JAX may plan twice: trace and lowering) chose alike
    assert len(backward_kernels) >= 2 and all((k == "flash_bwd_one_pass_kernel") == one_pass for k in backward_kernels)
    assert len(forward_kernels) >= 2 and all((k == "flash_fwd_gluon_kernel") == one_pass for k in forward_kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("d, options", [(128, dict(logits_soft_cap=30.0)),
                                        (128, dict(dropout_prob=0.2, dropout_seed=1234)), (256, {}),
                                        (256, dict(logits_soft_cap=30.0, dropout_prob=0.1, dropout_seed=7)),
                                        (192, {}), (96, dict(logits_soft_cap=30.0))],
                         ids=["softcap", "dropout", "d256", "d256-softcap-dropout", "d192", "d96-softcap"])
def test_gpu_options_on_the_gluon_kernels_are_the_same_in_both(monkeypatch, d, options):
    """The soft cap (the GPU's tanh.approx) and dropout on the Gluon forward and the one-pass backward, and
    D = 256 (the one-pass kernel's 64-key tiles), 192 and 96 (padded to the tiles' width): the same out, dK and
    dV bits in both frameworks, dQ within the one-pass kernel's reduction order."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    for name, value in BACKWARDS["one-pass"].items():
        set_switch(monkeypatch, name, value)
    from plan_spy import spy_kernels
    backward_kernels = spy_kernels(monkeypatch)
    forward_kernels = spy_kernels(monkeypatch, "plan_forward")
    t, j = _gpu_both(_gpu_inputs(1, 1, 4096, 8 if d <= 128 else 4, d), True, **options)
    _assert_same_bits(t, j, one_pass=True)
    assert backward_kernels and set(backward_kernels) == {"flash_bwd_one_pass_kernel"}, backward_kernels
    assert forward_kernels and set(forward_kernels) == {"flash_fwd_gluon_kernel"}, forward_kernels


@pytest.mark.gpu
def test_gpu_long_documents_are_the_same_in_both(monkeypatch):
    """Segment ids over 20k tokens, past plan.TILE_IDS_FROM: each launch's segment ranges come from the other
    tiles' [min, max] ids, a launch of their own that JAX runs into fresh buffers and torch in place; the same
    out, dK and dV bits in both frameworks, dQ within the one-pass kernel's reduction order."""
    from plan_spy import spy_chains
    chains = spy_chains(monkeypatch)
    lens = (3000, 517, 2048, 4100, 1, 777, 5000, 1333, 3555)
    ids = np.concatenate([np.full(n, i % 7, np.int32) for i, n in enumerate(lens)])[None]
    seg = torch.from_numpy(ids).cuda()
    t, j = _gpu_both(_gpu_inputs(4, 1, ids.shape[1], 4, 128), True, q_segment_ids=seg, kv_segment_ids=seg)
    _assert_same_bits(t, j, one_pass=torch.cuda.get_device_capability() == (9, 0))
    assert chains and all(chain[0] == "segment_tile_ids_kernel" for chain in chains), chains


@pytest.mark.gpu
@pytest.mark.parametrize("d, options", [(256, {}), (256, dict(logits_soft_cap=30.0, sliding_window=(1000, 0))),
                                        (192, {}), (96, dict(logits_soft_cap=30.0))],
                         ids=["d256", "d256-gemma", "d192", "d96-softcap"])
def test_gpu_wide_heads_on_the_gluon_forward_are_the_same_in_both(monkeypatch, d, options):
    """D = 256 on the Gluon forward (64-key tiles, O staged in Q's buffers), 192 and 96 padded to its tiles,
    with the two-pass backward (deterministic=True; the one-pass one: the options test above): the same
    out, dQ, dK and dV bits in both frameworks."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward runs on sm_90 only")
    from plan_spy import spy_kernels
    forward_kernels = spy_kernels(monkeypatch, "plan_forward")
    t, j = _gpu_both(_gpu_inputs(2, 1, 2048, 4, d), True, deterministic=True, **options)
    _assert_same_bits(t, j, one_pass=False)
    assert forward_kernels and set(forward_kernels) == {"flash_fwd_gluon_kernel"}, forward_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, bias, with_mask", [(128, True, "learned", False), (128, True, "fixed", False),
                                                        (64, False, "fixed", True), (128, False, None, True),
                                                        (256, True, "fixed", True), (192, False, None, True),
                                                        (96, True, "fixed", False)])
def test_gpu_bias_and_mask_on_the_gluon_kernels_are_the_same_in_both(monkeypatch, d, causal, bias, with_mask):
    """A bias and an attention mask on the Gluon forward, and on the one-pass backward where no dbias is
    wanted: the same bits in both frameworks.  A "fixed" bias is one nothing differentiates (torch: no
    requires_grad; JAX: closed over, so the custom VJP sees it unperturbed); a "learned" one runs the
    portable backward in both, which writes dbias, compared too."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    from plan_spy import spy_chains, spy_kernels
    chains = spy_chains(monkeypatch)
    backward_kernels = spy_kernels(monkeypatch)
    tensors = _gpu_inputs(3, 2, 4096, 4, d)
    gen = torch.Generator(device="cuda").manual_seed(4)
    options = {}
    if with_mask:
        options["attention_mask"] = torch.rand(2, 1, 4096, 4096, device="cuda", generator=gen) < 0.8
    if bias is None or bias == "fixed":
        if bias == "fixed":
            options["bias"] = torch.randn(2, 4, 4096, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        t, j = _gpu_both(tensors, causal, **options)
        _assert_same_bits(t, j, one_pass=True)
    else:
        tb = torch.randn(2, 4, 4096, 4096, device="cuda", generator=gen).to(torch.bfloat16)
        leaves = [x.detach().requires_grad_() for x in (*tensors[:3], tb)]
        to = dt.flash_attention(*leaves[:3], bias=leaves[3], causal=causal, **options)
        t = [to.detach(), *(g.detach() for g in torch.autograd.grad(to, leaves, tensors[3]))]
        jo, vjp = jax.vjp(jax.jit(lambda a, b_, c, e: dj.flash_attention(a, b_, c, bias=e, causal=causal,
                                                                          backend="triton")),
                          *(jax.dlpack.from_dlpack(x) for x in (*tensors[:3], tb)))
        j = [torch.from_dlpack(a) for a in (jo, *vjp(jax.dlpack.from_dlpack(tensors[3])))]
        _assert_same_bits(t[:4], j[:4], one_pass=False)
        assert torch.equal(t[4].view(torch.int16), j[4].view(torch.int16)), "dbias"
    one_pass = bias != "learned"
    assert chains and {c[-1] for c in chains} == {"flash_fwd_gluon_kernel"}, chains
    assert set(backward_kernels) == {"flash_bwd_one_pass_kernel" if one_pass else "flash_bwd_dkdv_kernel"}


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_gpu_blocksparse_on_the_gluon_kernels_is_the_same_in_both(monkeypatch, causal):
    """A layout of 128 x 128 blocks on the Gluon forward and the one-pass backward: the same out, dK
    and dV bits in both frameworks, dQ within the one-pass kernel's reduction order."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    from dualattn import SparseMask, masks
    from plan_spy import spy_chains, spy_kernels
    for name, value in BACKWARDS["one-pass"].items():
        set_switch(monkeypatch, name, value)
    chains = spy_chains(monkeypatch)
    backward_kernels = spy_kernels(monkeypatch)
    s, h = 4096, 4
    builder = (masks.causal() & masks.local((1024, 0))) if causal else (masks.strided(4) | masks.global_tokens(256))
    layout = SparseMask.from_block_map(builder(1, h, s, s, 128, 128), 128, 128)
    tq, tk, tv, tdo = _gpu_inputs(5, 1, s, h, 128)
    rules = dict(causal=True, sliding_window=(1024, 0)) if causal else {}
    leaves = [t.detach().requires_grad_() for t in (tq, tk, tv)]
    to = dt.blocksparse_attention(*leaves, layout=layout, **rules)
    t = [to.detach(), *(g.detach() for g in torch.autograd.grad(to, leaves, tdo))]
    jo, vjp = jax.vjp(jax.jit(lambda a, b_, c: dj.blocksparse_attention(a, b_, c, layout=layout, backend="triton",
                                                                         **rules)),
                      *(jax.dlpack.from_dlpack(x) for x in (tq, tk, tv)))
    j = [torch.from_dlpack(a) for a in (jo, *vjp(jax.dlpack.from_dlpack(tdo)))]
    _assert_same_bits(t, j, one_pass=True)
    assert chains and {c[-1] for c in chains} == {"flash_fwd_gluon_kernel"}, chains
    assert backward_kernels and set(backward_kernels) == {"flash_bwd_one_pass_kernel"}, backward_kernels


@pytest.mark.gpu
@pytest.mark.parametrize("group, packed", [(4, False), (16, False), (4, True)])
def test_gpu_native_sparse_attention_is_the_same_in_both(group, packed):
    """NSA through both front ends on torch's buffers (bf16, 1000 tokens: a tail after the last whole block):
    the chosen blocks, the output and the gates' gradients bitwise equal; q, k, v's gradients sum three
    branches' parts, which each framework's autodiff adds in its own order, so those agree to bf16 rounding.
    deterministic=True: the flash backwards add no atomics.  packed: three packed sequences, which both run
    through the varlen flash kernels in one launch each (nsa.packed_compressed)."""
    gen = torch.Generator(device="cuda").manual_seed(group)
    seqlen, heads_kv, head_dim = 1000, 2, 128
    heads_q = heads_kv * group

    def rand(*shape, uniform=False):
        x = torch.rand(*shape, device="cuda", generator=gen) if uniform else torch.randn(*shape, device="cuda",
                                                                                         generator=gen)
        return x.to(torch.bfloat16)
    inputs = [rand(1, seqlen, h, head_dim) for h in (heads_q, heads_kv, heads_kv)]
    inputs += [rand(1, seqlen, heads_q, uniform=True) for _ in range(3)]
    dout = rand(1, seqlen, heads_q, head_dim)
    opts = dict(block_counts=8, block_size=64, window_size=128, deterministic=True)
    cu = [0, 40, 300, 1000] if packed else None
    leaves = [x.detach().requires_grad_() for x in inputs]
    t_out, t_idx = dt.native_sparse_attention(*leaves, return_block_indices=True, **opts, cu_seqlens=None if cu is None
                                              else torch.tensor(cu, dtype=torch.int32, device="cuda"))
    if cu is not None:   # (a constant of the jitted functions: JAX's compressed branch reads its values)
        opts["cu_seqlens"] = np.asarray(cu, np.int32)
    t_grads = torch.autograd.grad(t_out, leaves, dout)
    as_jax = [jax.dlpack.from_dlpack(x) for x in inputs]
    j_idx = jax.jit(lambda *a: dj.native_sparse_attention(*a, backend="triton", return_block_indices=True,
                                                          **opts)[1])(*as_jax)
    j_out, vjp = jax.vjp(jax.jit(lambda *a: dj.native_sparse_attention(*a, backend="triton", **opts)), *as_jax)
    j_grads = [torch.from_dlpack(g) for g in vjp(jax.dlpack.from_dlpack(dout))]
    assert torch.equal(torch.from_dlpack(j_idx), t_idx)
    assert torch.equal(torch.from_dlpack(j_out).view(torch.int16), t_out.view(torch.int16))
    for name, j, t in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), j_grads, t_grads):
        if name.startswith("dg"):
            assert torch.equal(j.view(torch.int16), t.view(torch.int16)), name
        else:
            assert_close_rel(j, t, 1e-2, name)
