"""The warp-specialised kernels (plan.warp_specialized_forward / _backward): the default on sm_90
(both frameworks; JAX gives the same bits, tests/parity).

One TMA loop over every unmasked key tile, TMA stores, WS_TILE in place of the configured
forward tile; causal and window bands and a partial last key tile add a second, portable launch
over the masked edges that resumes from the first's O and lse (plan.split_band).  With more tiles
than SMs and short keys the forward runs persistent (plan.persistent_forward; opt-in with it, the
band whole in the specialised loop, plan.ws_band_in_loop), and so does the specialised backward
(plan.persistent_backward).  Checked against the float64 reference
(forward, lse, and gradients, which the portable backward computes from this forward's lse), on the CPU
interpreter (DUALATTN_WS=1; fp16, as the interpreter mis-reads bf16 descriptor loads) and on
the GPU.  Each test also checks the plan took the variant, so none can pass by never running it.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from dualattn.kernels.flash import hopper, plan as flash_plan  # noqa: E402
from dualattn.torch_api import flash_attention  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
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
    "softcap": dict(b=1, sq=128, sk=2048, hq=1, hkv=1, d=128, opts=dict(logits_soft_cap=5.0)),
}
@pytest.fixture
def split_every_band(monkeypatch):
    """Split every band the variant can take, whatever plan.split_band_pays says: these tests are
    about the two launches' numbers, on shapes small enough for the interpreter."""
    monkeypatch.setattr(hopper, "WS_SPLIT_MIN_KEYS", 0)
    monkeypatch.setattr(hopper, "WS_SPLIT_MIN_HEAD_DIM", 0)
    set_switch(monkeypatch, flash_plan.WS_BAND_ENV, "0")   # not the persistent band-in-loop forward instead
    flash_plan.forget_plans()   # memoised under the other rule
    yield
    flash_plan.forget_plans()


# Split bands: the interior warp-specialised, the masked edges in a second launch.
SPLIT_CASES = {
    "causal": dict(b=1, sq=1024, sk=2048, hq=2, hkv=2, d=128, opts=dict(causal=True)),
    "causal-gqa-sinks": dict(b=1, sq=384, sk=2048, hq=4, hkv=2, d=128, opts=dict(causal=True), sinks=True),
    # Bottom-right causal with more queries than keys: the first 300 rows see nothing.
    "causal-empty-rows": dict(b=1, sq=2348, sk=2048, hq=1, hkv=1, d=128, opts=dict(causal=True)),
    "window": dict(b=2, sq=2048, sk=2048, hq=1, hkv=1, d=128, opts=dict(sliding_window=(300, 200))),
    "ragged-keys": dict(b=1, sq=256, sk=2100, hq=1, hkv=1, d=128, opts={}),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_warp_specialized_forward_interpreted(case, monkeypatch, forward_plan_flags, seed):
    c = dict(CPU_CASES[case])
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    flags = forward_plan_flags("WARP_SPECIALIZE")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cpu", dtype=torch.float16, seed=seed, tol=2e-3, **c)
    assert flags and all(flags), flags


@pytest.mark.parametrize("case", sorted(SPLIT_CASES))
def test_split_band_forward_interpreted(case, monkeypatch, forward_plan_flags, split_every_band, seed):
    c = dict(SPLIT_CASES[case])
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    ws, split = forward_plan_flags("WARP_SPECIALIZE"), forward_plan_flags("SPLIT_BAND")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cpu", dtype=torch.float16, seed=seed, tol=2e-3, **c)
    assert ws and all(ws) and all(split), (ws, split)


def _forward_layout(forward_plan_flags):
    """Collects (WARP_SPECIALIZE, PERSISTENT, SPLIT_BAND) of every forward launch planned from then on."""
    names = ("WARP_SPECIALIZE", "PERSISTENT", "SPLIT_BAND")
    lists = [forward_plan_flags(n) for n in names]
    return lambda: list(zip(*lists))


# Persistent warp-specialised forwards (plan.persistent_forward): more tiles than SMs, each program
# looping over tiles; causal and window bands whole in the one loop where plan.ws_band_in_loop says
# (D=128, at most 2048 keys), and wherever DUALATTN_WS_BAND=1 forces it.  (case, environment):
# DUALATTN_NUM_SMS gives the interpreter an SM count.
BAND = {"DUALATTN_WS_BAND": "1"}
PERSISTENT_CASES = {
    "full": (dict(b=1, sq=512, sk=1024, hq=2, hkv=2, d=128, opts={}), {}),
    "d64-gqa-sinks": (dict(b=1, sq=256, sk=256, hq=4, hkv=2, d=64, opts={}, sinks=True), {}),
    "causal-gqa-sinks": (dict(b=1, sq=256, sk=384, hq=4, hkv=2, d=128, opts=dict(causal=True), sinks=True), BAND),
    # Bottom-right causal with more queries than keys: the first 128 rows see nothing.
    "causal-empty-rows": (dict(b=1, sq=384, sk=256, hq=2, hkv=2, d=128, opts=dict(causal=True)), BAND),
    "window": (dict(b=2, sq=256, sk=256, hq=1, hkv=1, d=128, opts=dict(sliding_window=(100, 20))), BAND),
    "d64-causal": (dict(b=1, sq=256, sk=256, hq=2, hkv=2, d=64, opts=dict(causal=True)), BAND),
}


def _check_persistent(case, env, monkeypatch, forward_plan_flags, **check):
    """The case against the reference, with the forward planned persistent and warp-specialised in one launch."""
    for name, value in env.items():
        set_switch(monkeypatch, name, value)
    layout = _forward_layout(forward_plan_flags)
    c = dict(case)
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), **check, **c)
    assert layout() == [(True, True, 0)], layout()


@pytest.mark.parametrize("case", sorted(PERSISTENT_CASES))
def test_persistent_forward_interpreted(case, monkeypatch, forward_plan_flags, seed):
    c, env = PERSISTENT_CASES[case]
    _check_persistent(c, {"DUALATTN_WS": "1", "DUALATTN_NUM_SMS": "3", **env}, monkeypatch, forward_plan_flags,
                      device="cpu", dtype=torch.float16, seed=seed, tol=2e-3)


def test_persistent_forward_rules(monkeypatch):
    """Persistent only with more tiles than SMs; bands in the loop only with whole tiles."""
    from test_compile import Variant
    set_switch(monkeypatch, flash_plan.WS_BAND_ENV, None)
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, None)

    def layout(**kw):
        launch = Variant("v", ws=True, **kw).launch("fwd", 90)[0]
        c = launch.constexpr_dict
        return c["WARP_SPECIALIZE"], c["PERSISTENT"], c["SPLIT_BAND"], launch.then is not None

    s1024 = dict(sq=1024, sk=1024, batch=2, hq=16)   # 256 tiles of 128 rows
    assert layout(**s1024, num_sms=256) == (False, False, 0, False)      # no more tiles than SMs: as before
    assert layout(**s1024, num_sms=100) == (True, True, 0, False)        # more: persistent even below WS_MIN_KEY_WORK
    assert layout(**s1024, d=64, num_sms=100) == (True, True, 0, False)
    assert layout(sq=1000, sk=1024, batch=2, hq=16, num_sms=100)[:2] == (False, False)  # partial query tile
    assert layout(**s1024, d=80, num_sms=100)[:2] == (False, False)      # padded head dim: no whole-array tiles
    assert layout(**s1024, causal=True, num_sms=100) == (True, True, 0, False)   # D=128 band: in the loop
    assert layout(**s1024, d=64, causal=True, num_sms=100)[:2] == (False, False)  # D=64 band: portable
    assert layout(sq=4096, sk=4096, batch=1, hq=16, causal=True, num_sms=100)[:2] == (False, False)  # > 2048 keys
    assert layout(sq=1024, sk=8192, batch=2, hq=16, num_sms=100) == (True, False, 0, False)  # long: the grid
    set_switch(monkeypatch, flash_plan.WS_BAND_ENV, "1")
    assert layout(**s1024, d=64, causal=True, num_sms=100) == (True, True, 0, False)  # forced: band in the loop
    ragged = dict(sq=1024, sk=1000, batch=2, hq=16, causal=True, num_sms=100)
    assert layout(**ragged)[:2] == (False, False)                        # partial key tile: no band in the loop
    set_switch(monkeypatch, flash_plan.WS_BAND_ENV, "0")
    assert layout(**s1024, causal=True, num_sms=100)[:2] == (False, False)   # off: the portable forward
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "0")
    assert layout(**s1024, num_sms=100)[:2] == (False, False)            # as before persistence


def _spy_backward(monkeypatch, *names) -> list:
    """For every backward planned from then on, (dK/dV's, dQ's) constexpr `names`: each kernel's
    value for one name, its tuple of values for several."""
    flags, real = [], flash_plan.plan_backward
    # The two-pass kernels: on sm_90 the one-pass Gluon backward would replace them (test_one_pass.py).
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "0")

    def spy(*args, **kwargs):
        plan = real(*args, **kwargs)
        values = [tuple(k.constexpr_dict[n] for n in names) for k in (plan.dkdv, plan.dq)]
        flags.append(tuple(v[0] if len(names) == 1 else v for v in values))
        return plan

    monkeypatch.setattr(flash_plan, "plan_backward", spy)
    return flags


@pytest.fixture
def backward_plan_flags(monkeypatch):
    """The (dK/dV, dQ) WARP_SPECIALIZE flags of every backward planned from then on."""
    return _spy_backward(monkeypatch, "WARP_SPECIALIZE")


@pytest.fixture
def specialise_small_problems(monkeypatch):
    """Let the interpreter's small problems take the warp-specialised kernels (plan.WS_MIN_KEY_WORK
    is a speed rule, not a correctness one)."""
    monkeypatch.setattr(hopper, "WS_MIN_KEY_WORK", 0)
    flash_plan.forget_plans()   # memoised under the other rule
    yield
    flash_plan.forget_plans()


# The warp-specialised backward: (case, (dK/dV, dQ) warp-specialised).
BWD_CASES = {
    "d128": (dict(b=2, sq=256, sk=512, hq=2, hkv=2, d=128, opts={}), (True, True)),
    "d80-sinks": (dict(b=1, sq=256, sk=256, hq=2, hkv=2, d=80, opts=dict(softmax_scale=0.2), sinks=True),
                  (True, True)),
    "d96-cross-gqa": (dict(b=1, sq=384, sk=128, hq=4, hkv=2, d=96, opts={}), (False, True)),
    "d128-causal-softcap": (dict(b=1, sq=256, sk=256, hq=2, hkv=2, d=128, opts=dict(causal=True, logits_soft_cap=5.0)),
                            (True, True)),
    "d64": (dict(b=1, sq=256, sk=256, hq=1, hkv=1, d=64, opts={}), (False, False)),   # plan.WS_DKDV_TILES
    "d64-causal": (dict(b=1, sq=256, sk=256, hq=2, hkv=2, d=64, opts=dict(causal=True)), (True, False)),
    # Head dims padded to 64 take the D=64 tiles (plan.WS_DKDV_BANDED_OR_PERSISTENT_TILES: by padded width).
    "d48-causal": (dict(b=1, sq=256, sk=256, hq=1, hkv=1, d=48, opts=dict(causal=True)), (True, False)),
    # Bands run whole in the one loop, position-masked on every tile.
    "causal": (dict(b=1, sq=512, sk=512, hq=2, hkv=2, d=128, opts=dict(causal=True)), (True, True)),
    # Bottom-right causal with more queries than keys: the first 128 rows see nothing.
    "causal-empty-rows-sinks": (dict(b=1, sq=384, sk=256, hq=2, hkv=2, d=128, opts=dict(causal=True), sinks=True),
                                (True, True)),
    "window-cross-gqa": (dict(b=1, sq=256, sk=512, hq=4, hkv=2, d=128, opts=dict(sliding_window=(150, 40))),
                         (False, True)),
}


@pytest.mark.parametrize("case", sorted(BWD_CASES))
def test_warp_specialized_backward_interpreted(case, monkeypatch, backward_plan_flags, specialise_small_problems,
                                               seed):
    c, want = dict(BWD_CASES[case][0]), BWD_CASES[case][1]
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cpu", dtype=torch.float16, seed=seed, tol=2e-3, **c)
    assert backward_plan_flags == [want], backward_plan_flags


# The persistent warp-specialised backward (plan.persistent_backward): more 128-row tiles than SMs in
# both kernels (DUALATTN_NUM_SMS=3: every program takes several tiles, bands in rounds of alternating
# direction), no work bar.  (case, (dK/dV, dQ) (warp-specialised, persistent)).
PERSISTENT_BWD_CASES = {
    "d128-batches": (dict(b=2, sq=256, sk=512, hq=2, hkv=2, d=128, opts={}), ((True, True), (True, True))),
    "causal-sinks": (dict(b=1, sq=512, sk=512, hq=2, hkv=2, d=128, opts=dict(causal=True), sinks=True),
                     ((True, True), (True, True))),
    # Bottom-right causal with more queries than keys: the first 128 rows see nothing.
    "causal-empty-rows": (dict(b=1, sq=384, sk=256, hq=2, hkv=2, d=128, opts=dict(causal=True)),
                          ((True, True), (True, True))),
    "window-batches": (dict(b=2, sq=256, sk=256, hq=2, hkv=2, d=128, opts=dict(sliding_window=(100, 20))),
                       ((True, True), (True, True))),
    "d64-causal": (dict(b=1, sq=256, sk=512, hq=2, hkv=2, d=64, opts=dict(causal=True)),
                   ((True, True), (False, False))),
    "d64": (dict(b=2, sq=256, sk=256, hq=2, hkv=2, d=64, opts={}), ((True, True), (False, False))),
    # GQA: dQ alone specialised (batches: K/V rows at b * Sk, columns by KV head).
    "gqa-batches": (dict(b=2, sq=512, sk=256, hq=4, hkv=2, d=128, opts={}), ((False, False), (True, True))),
    # A padded head dim (96 -> 128) cannot take whole-array descriptors; not persistent, so the
    # work bar stands: portable, as on a grid.
    "d96-padded": (dict(b=1, sq=512, sk=512, hq=2, hkv=2, d=96, opts={}), ((False, False), (False, False))),
}


def _check_persistent_backward(case, monkeypatch, **check):
    """The case against the reference with DUALATTN_NUM_SMS=3, checking each backward kernel's
    (warp-specialised, persistent) layout."""
    c, want = dict(PERSISTENT_BWD_CASES[case][0]), PERSISTENT_BWD_CASES[case][1]
    set_switch(monkeypatch, "DUALATTN_NUM_SMS", "3")
    layouts = _spy_backward(monkeypatch, "WARP_SPECIALIZE", "PERSISTENT")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), **check, **c)
    assert layouts == [want], layouts


@pytest.mark.parametrize("case", sorted(PERSISTENT_BWD_CASES))
def test_persistent_backward_interpreted(case, monkeypatch, seed):
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    _check_persistent_backward(case, monkeypatch, device="cpu", dtype=torch.float16, seed=seed, tol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(PERSISTENT_BWD_CASES))
def test_gpu_persistent_backward(case, monkeypatch, seed):
    """The same small cases on the H100, with 3 persistent programs (the GPU's own SM count:
    test_gpu_persistent_backward_at_size)."""
    _require_sm90()
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    _check_persistent_backward(case, monkeypatch, device="cuda", dtype=torch.bfloat16, seed=seed, tol=1e-2)


# Persistent backwards with the GPU's own SM count (132 programs on an H100, a partial last round):
# (B, S, H, D, causal), 256 tiles a kernel.
GPU_PERSISTENT_BWD_AT_SIZE = [(2, 2048, 8, 128, False), (2, 2048, 8, 128, True), (2, 2048, 8, 64, False)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_PERSISTENT_BWD_AT_SIZE, ids=lambda c: f"b{c[0]}-s{c[1]}-h{c[2]}-d{c[3]}-c{int(c[4])}")
def test_gpu_persistent_backward_at_size(case, monkeypatch, seed):
    _require_sm90()
    b, s, h, d, causal = case
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    set_switch(monkeypatch, "DUALATTN_NUM_SMS", None)
    layouts = _spy_backward(monkeypatch, "WARP_SPECIALIZE", "PERSISTENT")
    _check_against_reference(b, s, s, h, h, d, dict(causal=causal), device="cuda", dtype=torch.bfloat16, seed=seed,
                             tol=1e-2)
    assert layouts == [((True, True), (True, True) if d == 128 else (False, False))], layouts


def test_persistent_backward_rule(monkeypatch):
    """Persistent where the specialised kernels have more tiles than SMs and at most
    PERSISTENT_BWD_MAX_KEYS keys; the work bar then drops (S=1024 causal specialises).
    DUALATTN_PERSISTENT=0 / 1 turns it off / on whatever the keys."""
    from test_compile import Variant

    def layout(sq, causal, num_sms):
        _, bwd, _ = Variant("rule", sq=sq, sk=sq, causal=causal, ws=True, num_sms=num_sms).build(90)
        return tuple((k.constexpr_dict["WARP_SPECIALIZE"], k.constexpr_dict["PERSISTENT"]) for k in (bwd.dkdv, bwd.dq))

    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "0")
    assert layout(1024, True, 10) == ((False, False), (False, False))    # the work bar again
    assert layout(4096, False, 10) == ((True, False), (True, False))
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "1")
    assert layout(8192, True, 10) == ((True, True), (True, True))
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, None)
    # (Variant: B=2, H=4, so S=1024 has 64 tiles a kernel.)
    for sq, causal, num_sms, want in ((1024, True, 10, (True, True)), (1024, True, 0, (False, False)),
                                      (1024, True, 64, (False, False)), (8192, False, 10, (True, False)),
                                      (4096, False, 10, (True, True))):
        _, bwd, _ = Variant("rule", sq=sq, sk=sq, causal=causal, ws=True, num_sms=num_sms).build(90)
        got = (bwd.dq.constexpr_dict["WARP_SPECIALIZE"], bwd.dq.constexpr_dict["PERSISTENT"])
        assert got == want, (sq, causal, num_sms, got)
        assert bwd.dkdv.constexpr_dict["PERSISTENT"] == want[1]


def test_warp_specialize_off_by_default_on_cpu_and_with_ws_0(monkeypatch, forward_plan_flags):
    flags = forward_plan_flags("WARP_SPECIALIZE")
    q = torch.randn(1, 2048, 1, 128, dtype=torch.float16)
    set_switch(monkeypatch, "DUALATTN_WS", None)
    flash_attention(q, q, q)
    set_switch(monkeypatch, "DUALATTN_WS", "0")
    flash_attention(q, q, q)
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    flash_attention(q, q, q)
    assert flags == [False, False, True]


def test_misaligned_base_keeps_the_portable_forward(monkeypatch, forward_plan_flags):
    set_switch(monkeypatch, "DUALATTN_WS", "1")
    flags = forward_plan_flags("WARP_SPECIALIZE")
    buf = torch.randn(2048 * 128 + 2, dtype=torch.float16)
    q = buf[2:].view(1, 2048, 1, 128)
    flash_attention(q, q, q)
    assert flags == [False]


def _require_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the warp-specialised kernels are chosen on sm_90 only (where they were tuned)")


GPU_CASES = {
    "d128": dict(b=2, sq=4096, sk=4096, hq=8, hkv=8, d=128, opts={}),
    "d64-gqa-cross": dict(b=1, sq=1000, sk=4096, hq=8, hkv=2, d=64, opts={}),
    "d96-sinks-ragged-q": dict(b=1, sq=2004, sk=4096, hq=4, hkv=4, d=96, opts={}, sinks=True),
    "d128-softcap": dict(b=2, sq=4096, sk=4096, hq=8, hkv=8, d=128, opts=dict(logits_soft_cap=20.0)),
}
GPU_SPLIT_CASES = {
    "causal-d128": dict(b=2, sq=4096, sk=4096, hq=8, hkv=8, d=128, opts=dict(causal=True)),
    "causal-d64-gqa-cross": dict(b=1, sq=1000, sk=4096, hq=8, hkv=2, d=64, opts=dict(causal=True)),
    "window-d128-sinks": dict(b=1, sq=2048, sk=4096, hq=4, hkv=4, d=128, opts=dict(sliding_window=(700, 0)),
                              sinks=True),
    "ragged-keys-d96": dict(b=1, sq=1000, sk=4000, hq=4, hkv=4, d=96, opts={}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_warp_specialized_forward(case, monkeypatch, forward_plan_flags, seed):
    _require_sm90()
    c = dict(GPU_CASES[case])
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    flags = forward_plan_flags("WARP_SPECIALIZE")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cuda", dtype=torch.bfloat16, seed=seed, tol=1e-2, **c)
    assert flags and all(flags), flags


GPU_PERSISTENT_CASES = {   # (case, environment)
    "d128-s1024": (dict(b=4, sq=1024, sk=1024, hq=16, hkv=16, d=128, opts={}), {}),
    "d64-gqa-sinks-s2048": (dict(b=2, sq=2048, sk=2048, hq=16, hkv=4, d=64, opts={}, sinks=True), {}),
    "causal-d128-s1024": (dict(b=4, sq=1024, sk=1024, hq=16, hkv=16, d=128, opts=dict(causal=True)), BAND),
    "causal-gqa-sinks-d128": (dict(b=2, sq=2048, sk=2048, hq=8, hkv=2, d=128, opts=dict(causal=True), sinks=True),
                              BAND),
    # Bottom-right causal with more queries than keys: the first 256 rows see nothing.
    "causal-empty-rows-d128": (dict(b=1, sq=2304, sk=2048, hq=8, hkv=8, d=128, opts=dict(causal=True)), BAND),
    "window-d128-cross": (dict(b=1, sq=2048, sk=4096, hq=16, hkv=16, d=128, opts=dict(sliding_window=(700, 300))),
                          BAND),
    "causal-d64": (dict(b=2, sq=2048, sk=2048, hq=16, hkv=16, d=64, opts=dict(causal=True)), BAND),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_PERSISTENT_CASES))
def test_gpu_persistent_forward(case, monkeypatch, forward_plan_flags, seed):
    _require_sm90()
    c, env = GPU_PERSISTENT_CASES[case]
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    _check_persistent(c, env, monkeypatch, forward_plan_flags, device="cuda", dtype=torch.bfloat16, seed=seed,
                      tol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_SPLIT_CASES))
def test_gpu_split_band_forward(case, monkeypatch, forward_plan_flags, split_every_band, seed):
    _require_sm90()
    c = dict(GPU_SPLIT_CASES[case])
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    ws, split = forward_plan_flags("WARP_SPECIALIZE"), forward_plan_flags("SPLIT_BAND")
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cuda", dtype=torch.bfloat16, seed=seed, tol=1e-2, **c)
    assert ws and all(ws) and all(split), (ws, split)


GPU_BWD_CASES = {   # (case, (dK/dV, dQ) warp-specialised)
    "d80": (dict(b=1, sq=4096, sk=4096, hq=8, hkv=8, d=80, opts={}), (True, True)),
    "d128-gqa-cross-sinks": (dict(b=1, sq=2048, sk=4096, hq=8, hkv=2, d=128, opts={}, sinks=True), (False, True)),
    "d128": (dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=128, opts=dict(softmax_scale=0.05)), (True, True)),
    "causal-d128": (dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=128, opts=dict(causal=True)), (True, True)),
    "causal-d128-softcap": (dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=128, opts=dict(causal=True,
                                                                                    logits_soft_cap=20.0)),
                            (True, True)),
    "causal-empty-rows-d128-sinks": (dict(b=1, sq=2560, sk=2048, hq=4, hkv=4, d=128, opts=dict(causal=True),
                                          sinks=True), (True, True)),
    "window-d128-cross": (dict(b=1, sq=2048, sk=4096, hq=4, hkv=4, d=128, opts=dict(sliding_window=(700, 300))),
                          (True, True)),
    # D=64: dK/dV alone specialises, with a band or persistent (plan.WS_DKDV_BANDED_OR_PERSISTENT_TILES);
    # "d64" has 128 tiles a kernel, fewer than the H100's 132 SMs, so it runs on a grid, unspecialised.
    "causal-d64": (dict(b=2, sq=4096, sk=4096, hq=4, hkv=4, d=64, opts=dict(causal=True)), (True, False)),
    # (a window above hopper.SHORT_WINDOW_BWD_KEYS: shorter ones run the portable two-pass backward)
    "window-d64-empty-rows": (dict(b=1, sq=4352, sk=4096, hq=2, hkv=2, d=64, opts=dict(sliding_window=(700, 0))),
                              (True, False)),
    "d64": (dict(b=1, sq=4096, sk=4096, hq=4, hkv=4, d=64, opts={}), (False, False)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_BWD_CASES))
def test_gpu_warp_specialized_backward(case, monkeypatch, backward_plan_flags, seed):
    _require_sm90()
    c, want = dict(GPU_BWD_CASES[case][0]), GPU_BWD_CASES[case][1]
    set_switch(monkeypatch, "DUALATTN_WS", None)   # the default
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cuda", dtype=torch.bfloat16, seed=seed, tol=1e-2, **c)
    assert backward_plan_flags == [want], backward_plan_flags
