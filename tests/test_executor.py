"""The executor: config precedence, memory and disk caches, the shared cache file, keys, override.

Fast and CPU-only: autotuning is exercised with fake autotune functions / a fake timer.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

from dualattn import executor as ex
from dualattn.kernels.flash import plan
from dualattn.options import FlashOptions
from dualattn.validation import FlashShapes, check_flash_args

CUDA = dict(platform="cuda", backend="triton", device_name="NVIDIA H100 80GB HBM3", arch=90)
OPTS = FlashOptions.build(head_dim=128, causal=True)


def cfg(block_m: int) -> plan.FlashConfig:
    t = plan.TileConfig(block_m, 32, 4, 2)
    return plan.FlashConfig(t, t, t)


A, B, C, D = cfg(16), cfg(32), cfg(64), cfg(128)


def shapes(**kw) -> FlashShapes:
    base = dict(batch=2, seqlen_q=1000, seqlen_k=1000, heads_q=8, heads_kv=8, head_dim=128, head_dim_v=128,
                dtype="bfloat16")
    return FlashShapes(**{**base, **kw})


class Tuner:
    """A fake autotune_fn: records its candidates, returns a fixed config (or raises)."""

    def __init__(self, result=B, error=None):
        self.result, self.error, self.calls = result, error, []

    def __call__(self, candidates):
        self.calls.append(list(candidates))
        if self.error is not None:
            raise self.error
        return self.result


def select(executor, tuner=None, s=None, o=OPTS, **kw):
    where = {**CUDA, **kw}
    return executor.select_with_source("flash", shapes=s or shapes(), options=o, autotune_fn=tuner, **where)


def heuristic(s=None, o=OPTS):
    return plan.default_config(s or shapes(), interpret=False, arch=90, causal=o.causal)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(ex.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ex.AUTOTUNE_ENV, raising=False)
    ex.default_executor().clear_memory()
    yield tmp_path
    ex.default_executor().clear_memory()


def cache_file(d) -> str:
    return os.path.join(str(d), ex.CACHE_FILE)


# ----------------------------------------------------------------------------- precedence

def test_precedence_override_memory_disk_autotune_heuristics(cache_dir):
    e1, tuner = ex.Executor(), Tuner(B)
    assert select(e1) == (heuristic(), "heuristics")
    assert select(e1, tuner) == (heuristic(), "heuristics")       # autotune is opt-in
    assert not tuner.calls
    assert select(e1, tuner, autotune=True) == (B, "autotune")
    assert tuner.calls[0][0] == heuristic()                         # the default is always a candidate
    assert select(e1, tuner, autotune=True) == (B, "memory")
    assert len(tuner.calls) == 1

    e2 = ex.Executor()                                              # another process: disk, then memory
    assert select(e2, tuner, autotune=True) == (B, "disk")
    assert select(e2) == (B, "memory")
    ex.Executor().save("flash", shapes=shapes(), options=OPTS, config=A, **{k: CUDA[k] for k in
                                                                           ("platform", "backend", "device_name")})
    assert select(e2) == (B, "memory")                              # memory beats a newer disk entry
    assert select(ex.Executor(), tuner, autotune=True) == (A, "disk")  # disk beats autotune
    assert len(tuner.calls) == 1

    with ex.override(C):
        assert select(e2) == (C, "override")
        assert select(e2, override=D) == (D, "override")            # the argument beats the context
    assert select(e2, override=D) == (D, "override")
    assert select(e2) == (B, "memory")


def test_autotune_env_var_and_argument(cache_dir, monkeypatch):
    monkeypatch.setenv(ex.AUTOTUNE_ENV, "1")
    assert select(ex.Executor(), autotune=False, tuner=Tuner(B)) == (heuristic(), "heuristics")
    assert select(ex.Executor()) == (heuristic(), "heuristics")    # no autotune_fn (e.g. jax): heuristics
    assert select(ex.Executor(), Tuner(C)) == (C, "autotune")
    # The CPU interpreter entry has no candidate list: never autotuned.
    cpu = dict(platform="cpu", backend="triton-interpret", device_name="cpu", arch=0)
    expect = plan.default_config(shapes(), interpret=True)
    assert select(ex.Executor(), Tuner(D), **cpu) == (expect, "heuristics")


def test_candidates_and_heuristics_argument(cache_dir):
    tuner = Tuner(B)
    select(ex.Executor(), tuner, autotune=True, s=shapes(seqlen_q=40, seqlen_k=24))
    cands = tuner.calls[0]
    assert len(cands) == len(set(cands)) > 1
    for c in cands[1:]:
        assert c.fwd.block_m <= 64 and c.fwd.block_n <= 32 and c.bwd_dq.block_n <= 32
    got = ex.Executor().select("flash", shapes=shapes(), options=OPTS, heuristics=lambda s, o, arch: D, **CUDA)
    assert got == D


@pytest.mark.parametrize("result, error, warns", [(None, None, False), (B, RuntimeError("boom"), True),
                                                  ("not a config", None, True)])
def test_autotune_failure_falls_back_to_heuristics(cache_dir, result, error, warns):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert select(ex.Executor(), Tuner(result, error), autotune=True) == (heuristic(), "heuristics")
    assert any("autotun" in str(w.message) for w in caught) == warns
    assert not os.path.exists(cache_file(cache_dir))


# ----------------------------------------------------------------------------- memory and disk

def test_memory_hit_avoids_disk(cache_dir, monkeypatch):
    select(ex.Executor(), Tuner(B), autotune=True)
    e = ex.Executor()
    reads = []
    real_read = ex.ConfigCache._read
    monkeypatch.setattr(ex.ConfigCache, "_read", lambda self, **kw: reads.append(1) or real_read(self, **kw))
    assert select(e) == (B, "disk")
    assert len(reads) == 1

    def no_disk(*a, **kw):
        raise AssertionError("the disk was consulted")

    monkeypatch.setattr(ex.ConfigCache, "entries", no_disk)
    monkeypatch.setattr(ex.ConfigCache, "lookup", no_disk)
    assert select(e) == (B, "memory")


def test_disk_misses_reread_only_when_the_file_changes(cache_dir, monkeypatch):
    e = ex.Executor()
    ex.Executor().save("flash", shapes=shapes(seqlen_q=9000), options=OPTS, config=A, platform="cuda",
                       backend="triton", device_name=CUDA["device_name"])
    reads = []
    real_read = ex.ConfigCache._read
    monkeypatch.setattr(ex.ConfigCache, "_read", lambda self, **kw: reads.append(1) or real_read(self, **kw))
    for _ in range(3):
        assert select(e)[1] == "heuristics"   # a miss: one stat per call, one read per file version
    assert len(reads) == 1
    ex.Executor().save("flash", shapes=shapes(), options=OPTS, config=C, platform="cuda", backend="triton",
                       device_name=CUDA["device_name"])
    assert select(e) == (C, "disk")           # another process' write is seen without a restart


def test_disk_cache_shared_by_torch_and_jax_callers(cache_dir):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    kw = dict(bias=(1, 8, 1000, 1000), softmax_aux=(8, 2))
    t = {n: torch.zeros(s) for n, s in kw.items()}
    j = {n: jnp.zeros(s) for n, s in kw.items()}
    st = check_flash_args(torch.zeros(2, 1000, 8, 128, dtype=torch.bfloat16),
                          torch.zeros(2, 1000, 2, 128, dtype=torch.bfloat16),
                          torch.zeros(2, 1000, 2, 128, dtype=torch.bfloat16), **t)
    sj = check_flash_args(jnp.zeros((2, 1000, 8, 128), jnp.bfloat16), jnp.zeros((2, 1000, 2, 128), jnp.bfloat16),
                          jnp.zeros((2, 1000, 2, 128), jnp.bfloat16), **j)
    opts = FlashOptions.build(head_dim=128, causal=True, logits_soft_cap=30.0)
    where = dict(platform="cuda", backend="triton", device_name=CUDA["device_name"])
    assert ex.cache_key("flash", shapes=st, options=opts, **where) == \
        ex.cache_key("flash", shapes=sj, options=opts, **where)

    assert select(ex.Executor(), Tuner(B), s=st, o=opts, autotune=True) == (B, "autotune")   # "torch" tunes
    assert select(ex.Executor(), s=sj, o=opts) == (B, "disk")                               # "jax" reads it
    with open(cache_file(cache_dir)) as f:
        doc = json.load(f)
    assert doc["format"] == ex.FORMAT and doc["version"] == ex.FORMAT_VERSION
    (entry,) = doc["entries"].values()
    assert entry["config"] == {"fwd": [32, 32, 4, 2], "bwd_dkdv": [32, 32, 4, 2], "bwd_dq": [32, 32, 4, 2]}
    assert entry["source"] == "autotune"


def test_front_ends_select_through_the_executor(cache_dir):
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    from dualattn.jax_api import flash as jax_flash
    from dualattn.torch_api import flash as torch_flash
    st = check_flash_args(*(torch.zeros(1, 48, 2, 32) for _ in range(3)))
    qj = jnp.zeros((1, 48, 2, 32), jnp.float32)
    sj = check_flash_args(qj, qj, qj)
    opts = FlashOptions.build(head_dim=32)
    cpu = torch.device("cpu")
    default = plan.default_config(st, interpret=True)
    assert torch_flash._config(st, opts, cpu) == default == jax_flash._triton_config(sj, opts, qj)
    ex.Executor().save("flash", platform="cpu", backend="triton-interpret", device_name="cpu", shapes=st,
                       options=opts, config=C)   # e.g. written by another process
    assert torch_flash._config(st, opts, cpu) == C == jax_flash._triton_config(sj, opts, qj)
    with ex.override(D):
        assert torch_flash._config(st, opts, cpu) == D == jax_flash._triton_config(sj, opts, qj)


def test_atomic_write_leaves_no_partial_file(cache_dir, monkeypatch):
    where = dict(platform="cuda", backend="triton", device_name=CUDA["device_name"])
    ex.Executor().save("flash", shapes=shapes(seqlen_q=9000), options=OPTS, config=A, **where)
    path = cache_file(cache_dir)
    with open(path, "rb") as f:
        before = f.read()

    def broken_dump(obj, fp, **kw):
        fp.write('{"format": "dualattn-con')   # half a file, then the process "dies"
        raise RuntimeError("disk full")

    with monkeypatch.context() as m:
        m.setattr(json, "dump", broken_dump)
        with pytest.raises(RuntimeError, match="disk full"):
            ex.Executor().save("flash", shapes=shapes(), options=OPTS, config=B, **where)
        with pytest.warns(RuntimeWarning, match="could not save"):   # autotune still serves the process
            assert select(ex.Executor(), Tuner(B), autotune=True) == (B, "autotune")
    with open(path, "rb") as f:
        assert f.read() == before
    assert sorted(os.listdir(cache_dir)) == [ex.CACHE_FILE, ex.CACHE_FILE + ".lock"]   # no temp files left
    assert select(ex.Executor(), s=shapes(seqlen_q=9000)) == (A, "disk")


@pytest.mark.parametrize("text", ["{not json", "[]", '{"format": "dualattn-configs", "version": 99, "entries": {}}',
                                  '{"format": "dualattn-configs", "version": 1, "entries": []}',
                                  '{"format": "dualattn-configs", "version": 1, "entries": {"k": 3}}', ""])
def test_corrupt_file_is_ignored_with_a_warning_and_rebuilt(cache_dir, text):
    path = cache_file(cache_dir)
    with open(path, "w") as f:
        f.write(text)
    e = ex.Executor()
    with pytest.warns(RuntimeWarning, match=r"configs\.json"):
        assert select(e) == (heuristic(), "heuristics")
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # once per file version, not per call
        assert select(e) == (heuristic(), "heuristics")
        assert select(e, Tuner(B), autotune=True) == (B, "autotune")
    with open(path) as f:
        doc = json.load(f)
    assert doc["version"] == ex.FORMAT_VERSION and len(doc["entries"]) == 1
    assert select(ex.Executor()) == (B, "disk")


@pytest.mark.parametrize("blocked", ["dir-is-a-file", "file-is-a-dir"])
def test_unusable_cache_path_warns_once_and_runs_without_it(tmp_path, monkeypatch, blocked):
    """DUALATTN_CACHE_DIR naming a regular file (or configs.json a directory): one warning, then every
    call runs, autotune on or off, on configs kept in memory; nothing raises."""
    import torch
    import dualattn.torch_api as dt
    if blocked == "dir-is-a-file":
        target = tmp_path / "not-a-dir"
        target.write_text("")
    else:
        target = tmp_path
        (tmp_path / ex.CACHE_FILE).mkdir()
    monkeypatch.setenv(ex.CACHE_DIR_ENV, str(target))
    monkeypatch.delenv(ex.AUTOTUNE_ENV, raising=False)
    ex.default_executor().clear_memory()
    q = torch.randn(1, 16, 2, 16)
    want = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), q.double()) / 4.0, -1)
    want = torch.einsum("bhqk,bkhd->bqhd", want, q.double())
    with pytest.warns(RuntimeWarning, match="without the config cache"):
        out = dt.flash_attention(q, q, q)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    e = ex.Executor()
    with pytest.warns(RuntimeWarning, match="without the config cache"):
        assert select(e, Tuner(B), autotune=True) == (B, "autotune")   # saved in memory only
    with warnings.catch_warnings():
        warnings.simplefilter("error")      # once per path, not per call
        torch.testing.assert_close(dt.flash_attention(q, q, q), out)
        assert select(e, Tuner(C), autotune=True) == (B, "memory")


def test_tune_refuses_a_cache_dir_that_is_a_file(tmp_path, capsys):
    from dualattn import tune
    target = tmp_path / "not-a-dir"
    target.write_text("")
    with pytest.raises(SystemExit):
        tune.main(["--show", "--cache-dir", str(target)])
    assert "not a directory" in capsys.readouterr().err


def test_bad_entry_is_ignored_with_a_warning(cache_dir):
    where = dict(platform="cuda", backend="triton", device_name=CUDA["device_name"])
    key = ex.Executor().save("flash", shapes=shapes(), options=OPTS, config=A, **where)
    ex.Executor().save("flash", shapes=shapes(seqlen_q=9000), options=OPTS, config=C, **where)
    path = cache_file(cache_dir)
    with open(path) as f:
        doc = json.load(f)
    doc["entries"][key]["config"]["fwd"] = [24, 32, 4, 2]    # not a power of two
    with open(path, "w") as f:
        json.dump(doc, f)
    e = ex.Executor()
    with pytest.warns(RuntimeWarning, match="seqlen_q=1024"):
        assert select(e) == (heuristic(), "heuristics")
    assert select(e, s=shapes(seqlen_q=9000)) == (C, "disk")


def test_concurrent_writers_merge(cache_dir):
    where = dict(platform="cuda", backend="triton", device_name=CUDA["device_name"])
    e1, e2 = ex.Executor(), ex.Executor()
    assert select(e1)[1] == select(e2)[1] == "heuristics"   # both hold (empty) views of the file
    e1.save("flash", shapes=shapes(seqlen_q=100), options=OPTS, config=A, **where)
    e2.save("flash", shapes=shapes(seqlen_q=5000), options=OPTS, config=B, **where)
    e3 = ex.Executor()
    assert select(e3, s=shapes(seqlen_q=100)) == (A, "disk")
    assert select(e3, s=shapes(seqlen_q=5000)) == (B, "disk")


def test_concurrent_processes_merge(cache_dir):
    script = textwrap.dedent("""
        import sys
        from dualattn import executor as ex
        from dualattn.kernels.flash import plan
        from dualattn.options import FlashOptions
        from dualattn.validation import FlashShapes
        proc, path = int(sys.argv[1]), sys.argv[2]
        e = ex.Executor(path)
        t = plan.TileConfig(16, 16, 4, 1)
        for i in range(25):
            s = FlashShapes(1, 128, 128, 1, 1, 16 + i, 16, "float16")
            e.save("flash", platform="cuda", backend="triton", device_name=f"gpu{proc}", shapes=s,
                   options=FlashOptions(softmax_scale=1.0), config=plan.FlashConfig(t, t, t))
    """)
    path = cache_file(cache_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", script, str(p), path], env=env) for p in range(3)]
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    with open(path) as f:
        entries = json.load(f)["entries"]
    assert len(entries) == 75
    assert [n for n in os.listdir(cache_dir) if n.endswith(".tmp")] == []


# ----------------------------------------------------------------------------- keys

def key(s=None, o=OPTS, **where):
    return ex.cache_key("flash", shapes=s or shapes(), options=o,
                        **{"platform": "cuda", "backend": "triton", "device_name": CUDA["device_name"], **where})


def test_key_is_stable_within_a_shape_bucket():
    assert key() == key(shapes(seqlen_q=1024, seqlen_k=513)) == key(shapes(batch=4, heads_q=3, heads_kv=3))
    assert key(shapes(varlen=True, total_q=900, total_k=900)) == \
        key(shapes(varlen=True, total_q=3000, total_k=3000, seqlen_q=777))
    assert key(device_name=" NVIDIA H100 80GB HBM3 ") == key()


def test_key_changes_with_device_version_dtype_and_options(monkeypatch):
    base = key()
    variants = [
        key(device_name="NVIDIA A100-SXM4-80GB"), key(platform="cpu", backend="triton-interpret"),
        key(shapes(seqlen_q=1025)), key(shapes(seqlen_k=1025)), key(shapes(batch=3)),
        key(shapes(dtype="float16")), key(shapes(head_dim=96)), key(shapes(head_dim_v=64)),
        key(shapes(has_bias=True)), key(shapes(has_mask=True)), key(shapes(has_segments=True)),
        key(shapes(num_sinks=1)), key(shapes(num_sinks=2)),
        key(shapes(varlen=True, total_q=2000, total_k=2000)),
        key(o=FlashOptions.build(head_dim=128)), key(o=FlashOptions.build(head_dim=128, sliding_window=(64, 0))),
        key(o=FlashOptions.build(head_dim=128, causal=True, logits_soft_cap=50.0)),
        key(o=FlashOptions.build(head_dim=128, causal=True, dropout_prob=0.1)),
    ]
    assert len(set(variants + [base])) == len(variants) + 1
    assert key(o=FlashOptions.build(head_dim=128, causal=True, softmax_scale=0.3)) == base   # runtime scalar
    assert key(o=FlashOptions.build(head_dim=128, sliding_window=(64, 0))) == \
        key(o=FlashOptions.build(head_dim=128, sliding_window=(512, 0)))                     # presence only
    monkeypatch.setattr(ex, "triton_version", lambda: "9.9.9")
    assert key() != base and "triton=9.9.9" in key()


# ----------------------------------------------------------------------------- override and registry

def test_override_context_manager_is_thread_local_and_nests(cache_dir):
    e = ex.Executor()
    with ex.override(A):
        assert select(e)[0] == A
        with ex.override(B, algorithm="flash"), ex.override(C, algorithm="block_sparse"):
            assert select(e)[0] == B
            assert ex.current_override("block_sparse") == C
        seen = []
        thread = threading.Thread(target=lambda: seen.append(select(e)))
        thread.start()
        thread.join()
        assert seen == [(heuristic(), "heuristics")]
        with pytest.raises(KeyError):
            with ex.override(D):
                raise KeyError("x")
        assert select(e)[0] == A
    assert select(e) == (heuristic(), "heuristics")
    assert ex.current_override("flash") is None


def test_registry():
    assert {("flash", "cuda", "triton"), ("flash", "cpu", "triton-interpret")} <= set(ex.kernels())
    with pytest.raises(KeyError, match="flash/cuda/triton"):
        ex.get_kernel("flash", "rocm", "triton")
    with pytest.raises(ValueError, match="already registered"):
        ex.register(ex.get_kernel("flash", "cuda", "triton"))
    entry = ex.get_kernel("flash", "cuda", "triton")
    assert entry.decode(json.loads(json.dumps(entry.encode(B)))) == B
    for bad in ({"fwd": [32, 32, 4, 2]}, {n: [32, 32, 4] for n in ("fwd", "bwd_dkdv", "bwd_dq")},
                {n: [8, 32, 4, 2] for n in ("fwd", "bwd_dkdv", "bwd_dq")}, [1, 2, 3]):
        with pytest.raises(ValueError):
            entry.decode(bad)


def test_torch_autotune_from_inside_the_forward_op(cache_dir, monkeypatch):
    """The GPU path on the interpreter: _config autotunes inside flash_fwd, timing with a fake timer."""
    torch = pytest.importorskip("torch")
    import dataclasses
    import functools
    from dualattn.torch_api import _autotune
    from dualattn.torch_api import flash as torch_flash
    small, big = plan.TileConfig(16, 16, 4, 1), plan.TileConfig(32, 16, 4, 1)
    name = ("flash", "cpu", "triton-interpret")
    monkeypatch.setitem(ex._REGISTRY, name, dataclasses.replace(
        ex._REGISTRY[name], candidates=lambda s, o, arch: [plan.FlashConfig(small, small, small),
                                                          plan.FlashConfig(big, big, big)]))
    timed, sources = [], []

    def timer(fn):
        fn()   # runs the interpreted kernels with the pinned tiles
        c = ex.current_override("flash")
        timed.append(c)
        return 1.0 if c.fwd == big else 2.0 if c.bwd_dkdv == big else 3.0

    def config(shapes, options, device):   # torch_api.flash._config's CUDA branch, on the CPU
        got, source = ex.default_executor().select_with_source(
            "flash", platform="cpu", backend="triton-interpret", device_name="cpu", shapes=shapes, options=options,
            autotune_fn=functools.partial(_autotune._tune, shapes, options, device, timer=timer), autotune=True)
        sources.append(source)
        return got

    monkeypatch.setattr(torch_flash, "_config", config)
    q = torch.randn(1, 32, 2, 16, requires_grad=True)
    torch_flash.flash_attention(q, q, q, causal=True).sum().backward()
    assert q.grad is not None
    # The backward reuses the config its forward selected (or the override the tuner pins).
    assert [s for s in sources if s != "override"] == ["autotune"]
    assert len(timed) == 6   # forward tiles and backward pairs of (heuristic, small, big)
    best = plan.FlashConfig(big, big, big)
    assert select(ex.Executor(), platform="cpu", backend="triton-interpret", device_name="cpu",
                  s=check_flash_args(q, q, q), o=FlashOptions.build(head_dim=16, causal=True)) == (best, "disk")
