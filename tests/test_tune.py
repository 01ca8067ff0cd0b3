"""Autotuning that users can trust, on CPU with fake timing sources: the timing rule, the choice, the
shared cache and `python -m dualattn.tune` (tuning and --show)."""
from __future__ import annotations

import json

import pytest

from dualattn import autotune, executor as ex, tune
from dualattn.kernels.flash import plan
from dualattn.options import FlashOptions
from dualattn.validation import FlashShapes


def test_median_ms_warms_up_then_takes_the_median_of_rounds():
    now = [0.0]
    calls = []

    def run():
        calls.append(len(calls))
        # 1 ms a call, but the 2nd timed round is slow (a stray hiccup the median ignores)
        now[0] += 0.001 if not (30 <= len(calls) < 40) else 0.05
        return len(calls)

    syncs = []
    ms = autotune.median_ms(run, syncs.append, warmup_ms=5, rep_ms=100, rounds=5, clock=lambda: now[0])
    assert ms == pytest.approx(1.0)
    assert len(syncs) == 2 + 1 + 5          # compile, estimate, after warm-up, one per round
    assert len(calls) == 1 + 1 + 5 + 5 * 20   # 20 back-to-back calls per round


def test_best_of_skips_failing_candidates_and_prefers_the_first_on_ties():
    def measure(c):
        if c == "broken":
            raise RuntimeError("out of shared memory")
        return {"a": 2.0, "b": 1.0, "c": 1.0}[c]
    best, times = autotune.best_of(["a", "broken", "b", "c"], measure, show_progress=False)
    assert best == "b" and times[1] == float("inf")
    assert autotune.best_of(["broken"], measure, show_progress=False)[0] is None


def _tile(m):
    return plan.TileConfig(m, 32, 4, 2)


def test_tune_flash_combines_the_best_forward_and_backward():
    cands = [plan.FlashConfig(_tile(16), _tile(16), _tile(16)), plan.FlashConfig(_tile(64), _tile(32), _tile(32)),
             plan.FlashConfig(_tile(32), _tile(64), _tile(64))]
    fwd = {16: 3.0, 64: 1.0, 32: 2.0}
    bwd = {16: 3.0, 32: 2.0, 64: 1.0}
    best = autotune.tune_flash(cands, lambda c: fwd[c.fwd.block_m], lambda c: bwd[c.bwd_dkdv.block_m],
                               show_progress=False)
    assert best == plan.FlashConfig(_tile(64), _tile(64), _tile(64))


def test_tune_flash_times_once_the_configs_that_plan_alike():
    """A kernel that runs its own tiles (the Gluon forward) plans the same launches whatever the candidate's
    tile: those candidates are timed once; a plan that raises keeps its candidate."""
    cands = [plan.FlashConfig(_tile(m), _tile(m), _tile(m)) for m in (16, 32, 64, 128)]
    timed = []

    def measure(c):
        timed.append(c.fwd.block_m)
        return float(c.fwd.block_m)

    def plans(c, which):
        if which == "backward" and c.bwd_dkdv.block_m == 128:
            raise ValueError("does not fit")
        return "own tiles" if which == "forward" or c.bwd_dkdv.block_m <= 32 else c.bwd_dkdv

    best = autotune.tune_flash(cands, measure, lambda c: float(-c.bwd_dkdv.block_m), plans=plans,
                               show_progress=False)
    assert timed == [16] and best == plan.FlashConfig(_tile(16), _tile(128), _tile(128))
    assert autotune.distinct_plans([1, 2, 3, 4], lambda x: x % 2) == [1, 2]


def test_plans_are_recorded_memoised_or_not_by_the_innermost_recording():
    shapes = FlashShapes(1, 64, 64, 2, 2, 32, 32, "float32")
    options = FlashOptions.build(head_dim=32, causal=True)
    strides = {n: (64 * 2 * 32, 2 * 32, 32, 1) for n in ("query", "key", "value", "out")}
    config = plan.default_config(shapes, interpret=True)
    with plan.recording() as first:
        launch = plan.plan_forward(shapes, options, strides, config=config)
        with plan.recording() as inner:
            plan.plan_forward(shapes, options, strides, config=config)   # memoised: recorded all the same
        backward = plan.plan_backward(shapes, options, strides, config=config)
    assert first == [launch, backward] and inner == [launch]
    plan.plan_forward(shapes, options, strides, config=config)
    assert first == [launch, backward]


def _fake_target(log):
    def autotune_fn(shapes, options):
        def pick(candidates):
            log.append(len(candidates))
            measure = lambda c: c.fwd.block_m * 1.0 + c.bwd_dkdv.block_n   # noqa: E731 - smallest tiles win
            return autotune.tune_flash(candidates, measure, measure, show_progress=False)
        return pick
    return tune.Target("cuda", "triton", "Fake GPU", 90, autotune_fn)


def test_cli_tunes_into_the_shared_cache_and_shows_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(ex.AUTOTUNE_ENV, raising=False)
    shapes = [{"batch": 2, "seqlen_q": 1024, "heads_q": 8, "head_dim": 128, "dtype": "bfloat16", "causal": True},
              {"batch": 1, "seqlen_q": 2048, "seqlen_k": 4096, "heads_q": 8, "heads_kv": 2, "head_dim": 64,
               "dtype": "float16", "sliding_window": [128, 0], "num_sinks": 1}]
    spec = tmp_path / "shapes.json"
    spec.write_text(json.dumps(shapes))
    log = []
    assert tune.main([str(spec), "--cache-dir", str(tmp_path)], target=_fake_target(log)) == 0
    assert len(log) == 2
    entries = json.loads((tmp_path / ex.CACHE_FILE).read_text())["entries"]
    assert len(entries) == 2 and all(e["source"] == "autotune" for e in entries.values())
    # What torch and jax launches of the first shape now select: the tuned config, from disk.
    shapes0, options0 = tune.problem(shapes[0])
    got, source = ex.Executor(str(tmp_path / ex.CACHE_FILE)).select_with_source(
        "flash", platform="cuda", backend="triton", device_name="Fake GPU", arch=90, shapes=shapes0, options=options0)
    key = ex.cache_key("flash", platform="cuda", backend="triton", device_name="Fake GPU", shapes=shapes0,
                       options=options0)
    assert source == "disk" and ex._encode_flash(got) == entries[key]["config"]
    # A second run finds them cached; --force tunes again.
    tune.main([str(spec), "--cache-dir", str(tmp_path)], target=_fake_target(log))
    assert len(log) == 2
    tune.main([str(spec), "--cache-dir", str(tmp_path), "--force"], target=_fake_target(log))
    assert len(log) == 4
    capsys.readouterr()
    tune.main(["--show", "--cache-dir", str(tmp_path)])
    shown = capsys.readouterr().out
    assert "2 entries" in shown and key in shown and "source=autotune" in shown


def test_cli_rejects_bad_shapes_before_tuning(tmp_path):
    spec = tmp_path / "shapes.json"
    spec.write_text(json.dumps([{"batch": 2, "seqlen_q": 64, "heads_q": 2, "dtype": "bfloat16", "bogus": 1}]))
    with pytest.raises(ValueError, match=r"missing keys \['head_dim'\], unknown keys \['bogus'\]"):
        tune.main([str(spec), "--cache-dir", str(tmp_path)], target=_fake_target([]))


def _tiny_problem():
    """(shapes, options, a small tile, a big one, the two candidates of one tile each) at 32 tokens."""
    shapes = FlashShapes(batch=1, seqlen_q=32, seqlen_k=32, heads_q=1, heads_kv=1, head_dim=16, head_dim_v=16,
                         dtype="float32")
    small, big = plan.TileConfig(16, 16, 4, 1), plan.TileConfig(32, 16, 4, 1)
    return (shapes, FlashOptions.build(head_dim=16, causal=True), small, big,
            [plan.FlashConfig(small, small, small), plan.FlashConfig(big, big, big)])


def test_jax_autotune_runs_from_inside_a_jit_trace(monkeypatch):
    """The executor may ask while the caller is being traced: the tuner's timed calls run in their own
    thread, on concrete arrays (the Triton kernels interpreted on CPU here, a fake timer)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from dualattn.jax_api import _autotune
    shapes, options, small, big, cands = _tiny_problem()
    timed = []

    def timer(run):
        with plan.recording() as planned:   # the first call traces, with the candidate's tiles
            out = jax.block_until_ready(run())
        assert not isinstance(out, jax.core.Tracer)
        timed.append(ex.current_override("flash"))
        fwd = [p for p in planned if not isinstance(p, plan.BackwardPlan)]
        assert fwd and fwd[0].constexpr_dict["BLOCK_M"] == timed[-1].fwd.block_m, (fwd, timed[-1])
        return 1.0 if timed[-1].fwd == big or timed[-1].bwd_dkdv == big else 2.0

    @jax.jit
    def traced(x):
        best = _autotune._tune(shapes, options, cands, timer=timer)
        timed.append(best)
        return x

    traced(jnp.zeros(()))
    assert timed[-1] == plan.FlashConfig(big, big, big) and len(timed) == 5


def test_torch_autotune_times_each_candidate_with_its_own_tiles(monkeypatch):
    """Each timed call launches the candidate's tiles (the Triton kernels interpreted on CPU, a fake timer),
    after the candidates' plans were asked for (tune_flash's plans=), also where the backward runs on
    another thread than the tuner's, as a CUDA backward does."""
    torch = pytest.importorskip("torch")
    from dualattn.torch_api import _autotune, _launch
    shapes, options, small, big, cands = _tiny_problem()
    launched, timed = [], []
    real_run = _launch.run

    def spy(launch, *args, **kwargs):
        if launch.kernel in ("flash_fwd_kernel", "flash_bwd_dkdv_kernel"):
            launched.append(launch.constexpr_dict["BLOCK_M"])
        return real_run(launch, *args, **kwargs)

    def timer(run):
        launched.clear()
        if torch.is_grad_enabled():   # a backward: on CUDA autograd runs it on a thread of its own
            autotune.in_own_thread(run)
        else:
            run()
        pinned = ex.current_override("flash")
        timed.append(launched[0])
        return 1.0 if pinned.fwd == big or pinned.bwd_dkdv == big else 2.0

    monkeypatch.setattr(_launch, "run", spy)
    best = _autotune._tune(shapes, options, torch.device("cpu"), cands, timer=timer)
    assert best == plan.FlashConfig(big, big, big)
    assert timed == [16, 32, 16, 32], timed


@pytest.mark.gpu
def test_gpu_autotune_times_the_gluon_forward_once(monkeypatch):
    """On sm_90 the Gluon forward runs its own tiles: every forward candidate plans the same launch and only
    the first is timed.  The one-pass backward's candidates differ only in the preprocess's tile."""
    torch = pytest.importorskip("torch")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    from dualattn.torch_api import _autotune
    shapes = FlashShapes(batch=1, seqlen_q=4096, seqlen_k=4096, heads_q=4, heads_kv=4, head_dim=128,
                         head_dim_v=128, dtype="bfloat16")
    options = FlashOptions.build(head_dim=128, causal=True)
    cands = [plan.default_config(shapes, interpret=False, arch=90, causal=True)]
    cands += [c for c in ex._flash_candidates_cuda(shapes, options, 90) if c not in cands]
    swept, real_best_of = [], autotune.best_of

    def spy(candidates, measure, **kwargs):
        swept.append(list(candidates))
        return real_best_of(candidates, measure, **kwargs)

    monkeypatch.setattr(autotune, "best_of", spy)
    best = _autotune._tune(shapes, options, torch.device("cuda"), cands, timer=lambda run: (run(), 1.0)[1])
    assert best is not None
    forward, backward = swept
    assert len({c.fwd for c in cands}) > 1 and forward == [cands[0]], forward
    assert len(backward) == len({c.bwd_dq.block_m for c in cands}), backward


def test_a_call_planned_before_still_reports_its_plans():
    """torch's front end memoises a call's plans (_CallPlan): reused, they are reported to the recording all
    the same, so the tuner sees what the base candidate plans after its first, untimed call."""
    torch = pytest.importorskip("torch")
    from dualattn import torch_api as dt
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))

    def call():
        out = dt.flash_attention(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    with plan.recording() as first:
        call()
    with plan.recording() as again:
        call()
    assert len(first) == 2 and isinstance(first[1], plan.BackwardPlan) and again == first


def test_one_thread_records_at_a_time_and_sees_plans_from_other_threads():
    """A recording takes the plans of every thread (torch's CUDA backward runs on autograd's), and a second
    thread's recording waits for the first to close, so two tuners never see each other's plans."""
    import threading
    shapes = FlashShapes(1, 64, 64, 2, 2, 32, 32, "float32")
    strides = {n: (64 * 2 * 32, 2 * 32, 32, 1) for n in ("query", "key", "value", "out")}
    config = plan.default_config(shapes, interpret=True)
    options = FlashOptions.build(head_dim=32)
    order, started = [], threading.Event()

    def other():
        started.set()
        with plan.recording() as theirs:
            order.append("other opened")
        order.append(list(theirs))

    with plan.recording() as mine:
        worker = threading.Thread(target=lambda: plan.plan_forward(shapes, options, strides, config=config))
        worker.start()
        worker.join()
        second = threading.Thread(target=other)
        second.start()
        started.wait()
        second.join(timeout=0.2)
        assert second.is_alive()   # waiting for this recording to close
        order.append("mine closed")
    second.join()
    assert len(mine) == 1 and order == ["mine closed", "other opened", []]
