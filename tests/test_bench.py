"""CPU smoke test of the benchmark's pure-Python parts: arguments, FLOPs, records, table, JSON, plot.

The GPU timings themselves run only on a GPU machine (`python -m dualattn.bench`); here fake systems
and a fake timer drive the same code paths on tiny CPU tensors.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dualattn.bench import report
from dualattn.bench.flash import main, measure_system, parse_args, run_timing
from dualattn.bench.report import Measurement, MemoryRecord, Shape
from dualattn.bench.systems import SYSTEMS, System


# ---------------------------------------------------------------------------------------------
# Arguments


def test_defaults_fix_tokens_per_batch():
    args = parse_args([])
    assert [(s.B, s.S) for s in args.shapes] == [(16, 1024), (8, 2048), (4, 4096), (2, 8192), (1, 16384)]
    assert {(s.H, s.D) for s in args.shapes} == {(16, 128)}
    assert args.causals == (False, True)
    assert args.modes == ["fwd", "fwdbwd"]
    assert args.system_keys == list(SYSTEMS)


def test_explicit_shape_and_lists():
    args = parse_args(["--batch", "2", "--seqlen", "8192", "--causal", "true", "--modes", "fwdbwd",
                       "--systems", "dualattn-torch,sdpa-cudnn"])
    assert args.shapes == [Shape(2, 8192, 16, 128)]
    assert args.causals == (True,)
    assert args.modes == ["fwdbwd"]
    assert args.system_keys == ["dualattn-torch", "sdpa-cudnn"]


def test_memory_mode_defaults():
    args = parse_args(["--memory"])
    assert [s.S for s in args.shapes] == [8192, 16384, 32768, 65536, 131072]
    assert {s.B for s in args.shapes} == {1}
    assert args.system_keys == ["dualattn-torch"]


@pytest.mark.parametrize("argv", [
    ["--systems", "dualattn-torch,nope"],
    ["--tokens", "1000", "--seqlens", "2048"],
    ["--seqlen", "1024", "--seqlens", "1024"],
    ["--modes", "fwd,bwd"],
    ["--seqlens", "1024,x"],
    ["--heads", "0"],
])
def test_bad_arguments_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# FLOPs, bytes, records


def test_attention_flops():
    shape = Shape(2, 8192, 16, 128)
    fwd = 4 * 2 * 16 * 8192 * 8192 * 128
    assert report.attention_flops(shape, False, "fwd") == fwd
    assert report.attention_flops(shape, True, "fwd") == fwd / 2
    assert report.attention_flops(shape, False, "fwdbwd") == 3.5 * fwd
    assert report.attention_flops(shape, True, "fwdbwd") == 1.75 * fwd
    with pytest.raises(ValueError, match="mode"):
        report.attention_flops(shape, False, "bwd")


def test_ideal_bytes():
    shape = Shape(1, 8192, 16, 128)
    assert report.ideal_fwdbwd_bytes(shape) == 8 * 8192 * 16 * 128 * 2 + 16 * 8192 * 4


def test_timed_marks_wrong_and_nan():
    shape = Shape(1, 4096, 16, 128)
    ok = report.timed(shape, False, "fwd", 1.0, 1e-3, 2e-2)
    assert ok["tflops"] == pytest.approx(4 * 16 * 4096 * 4096 * 128 / 1e-3 / 1e12)
    assert "status" not in ok
    wrong = report.timed(shape, False, "fwd", 1.0, 0.5, 2e-2)
    assert (wrong["status"], wrong["note"]) == ("wrong", "wrong: err=5.00e-01")
    assert report.timed(shape, False, "fwd", 1.0, float("nan"), 2e-2)["status"] == "wrong"


def test_describe_error_is_one_short_line():
    text = report.describe_error(RuntimeError("CUDA out of memory.\nTried to allocate " + "x" * 500))
    assert text == "RuntimeError: CUDA out of memory."
    assert len(report.describe_error(ValueError("y" * 1000))) == 240


def _fake_records():
    rows = []
    for mode, ms in (("fwd", 1.0), ("fwdbwd", 4.0)):
        shape = Shape(1, 4096, 16, 128)
        base = dict(B=1, S=4096, H=16, D=128, causal=False, mode=mode)
        rows.append(Measurement(system="sdpa-cudnn", **base, **report.timed(shape, False, mode, ms, 1e-3, 2e-2)))
        rows.append(Measurement(system="dualattn-torch", **base,
                                **report.timed(shape, False, mode, ms * 1.25, 0.5, 2e-2)))
        rows.append(Measurement(**report.missing(dict(system="jax-cudnn", **base), ImportError("no jax"))))
    report.fill_ratios(rows)
    return rows


def test_ratios_and_table():
    rows = _fake_records()
    assert [r.ratio_to_cudnn for r in rows if r.system == "dualattn-torch"] == [pytest.approx(0.8)] * 2
    assert all(r.ratio_to_cudnn is None for r in rows if r.system == "jax-cudnn")
    table = report.format_table(rows, ["dualattn-torch", "sdpa-cudnn", "jax-cudnn"])
    lines = table.splitlines()
    assert "dualattn-torch" in lines[1] and "jax-cudnn" in lines[1]
    assert "0.80x wrong[1]" in table and "1.00x" in table and "missing[2]" in table
    assert "[1] dualattn-torch: wrong: err=5.00e-01" in table
    assert "[2] jax-cudnn: missing: ImportError: no jax" in table
    assert len([line for line in lines if line.startswith("1  4096")]) == 2  # one row per mode


def test_memory_table():
    shape = Shape(1, 8192, 16, 128)
    ideal = report.ideal_fwdbwd_bytes(shape)
    base = dict(B=1, S=8192, H=16, D=128, causal=True)
    rows = [MemoryRecord(system="dualattn-torch", **base, peak_bytes=2 * ideal, ideal_bytes=ideal, ratio=2.0),
            MemoryRecord(**report.missing(dict(system="jax-xla", **base), "memory mode measures torch only"))]
    table = report.format_memory_table(rows)
    assert "2.00x" in table and "missing[1]" in table and "jax-xla: missing: memory mode" in table


def test_json_round_trip(tmp_path):
    rows = _fake_records()
    rows[0].err = float("nan")
    path = tmp_path / "sub" / "run.json"
    mem = [MemoryRecord(system="dualattn-torch", B=1, S=8192, H=16, D=128, causal=False, peak_bytes=10,
                        ideal_bytes=5, ratio=2.0)]
    report.write_json(str(path), {"device": "fake", "versions": {"torch": "x"}}, rows, mem)
    doc = json.loads(path.read_text())  # strict JSON: NaN became a string
    assert doc["meta"]["device"] == "fake"
    assert doc["measurements"][0]["err"] == "nan"
    assert {"system", "B", "S", "H", "D", "causal", "mode", "ms", "tflops", "ratio_to_cudnn", "note"} \
        <= set(doc["measurements"][0])
    meta, back, mem_back = report.load_json(str(path))
    assert [r.system for r in back] == [r.system for r in rows] and mem_back == mem
    assert back[2].note == "missing: ImportError: no jax"


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "plot.png"
    assert report.plot(_fake_records(), str(path), "fake") == f"plot written to {path}"
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.plot(_fake_records(), str(tmp_path / "p.png")).startswith("plot skipped: matplotlib")


def test_progress_fallback(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with report.progress(2, "bench") as bar:
        bar.set_postfix_str("sys S=1")
        bar.update(2)
    assert "bench [2/2] sys S=1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The measuring loop, with fake systems on CPU and a fake timer


def _math_attention(shape, causal):
    import torch.nn.functional as F

    def attn(q, k, v):
        t = lambda x: x.transpose(1, 2)  # noqa: E731
        return t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=causal))
    return attn


def _fails_to_build(shape, causal):
    raise ModuleNotFoundError("No module named 'peer'")


def _wrong(shape, causal):
    return lambda q, k, v: q


def _forward_only(shape, causal):
    def attn(q, k, v):
        if q.requires_grad:
            raise NotImplementedError("no backward")
        return _math_attention(shape, causal)(q, k, v)
    return attn


FAKES = [System("sdpa-cudnn", "math stand-in for the ratio reference", "torch", _math_attention),
         System("broken", "fails to build", "torch", _fails_to_build),
         System("wrong", "returns q", "torch", _wrong),
         System("fwd-only", "no backward", "torch", _forward_only)]


def test_run_timing_with_fakes():
    pytest.importorskip("torch")
    args = parse_args(["--heads", "2", "--head-dim", "16", "--tokens", "64", "--seqlens", "32,64"])
    timed_calls = []

    def timer(fn):
        timed_calls.append(fn())
        return 2.0

    rows = run_timing(args, timer, device="cpu", systems=FAKES)
    assert len(rows) == 2 * 2 * len(FAKES) * 2  # shapes x causal x systems x modes
    by = {(r.system, r.S, r.causal, r.mode): r for r in rows}
    ok = by[("sdpa-cudnn", 64, True, "fwdbwd")]
    assert (ok.status, ok.ratio_to_cudnn, ok.ms) == ("ok", 1.0, 2.0) and ok.err < 1e-2
    assert ok.tflops == pytest.approx(report.attention_flops(Shape(1, 64, 2, 16), True, "fwdbwd") / 2e-3 / 1e12)
    assert by[("broken", 32, False, "fwd")].note == "missing: ModuleNotFoundError: No module named 'peer'"
    wrong = by[("wrong", 32, False, "fwd")]
    assert wrong.status == "wrong" and wrong.tflops and wrong.note.startswith("wrong: err=")
    assert by[("fwd-only", 64, False, "fwd")].status == "ok"
    assert by[("fwd-only", 64, False, "fwdbwd")].note == "missing: NotImplementedError: no backward"
    grads = [c for c in timed_calls if isinstance(c, tuple)]
    assert grads and all(len(g) == 3 for g in grads)  # fwdbwd steps return dq, dk, dv


def test_measure_system_reports_progress():
    torch = pytest.importorskip("torch")
    from dualattn.bench.systems import make_inputs, reference_output
    inputs = make_inputs(Shape(1, 16, 2, 16), "bf16", 0, "cpu")
    assert inputs.q.dtype == torch.bfloat16 and inputs.q.abs().sum() > 0  # random normal, never zeros
    steps = []
    ref = reference_output(inputs, False)
    measure_system(FAKES[1], inputs, ref, False, ["fwd", "fwdbwd"], lambda fn: 1.0, 2e-2, steps.append)
    measure_system(FAKES[0], inputs, ref, False, ["fwd", "fwdbwd"], lambda fn: 1.0, 2e-2, steps.append)
    assert sum(steps) == 4


# ---------------------------------------------------------------------------------------------
# Entry point


def test_main_without_cuda_says_so(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["--seqlen", "1024", "--systems", "dualattn-torch"])


def test_list_systems(capsys):
    assert main(["--list-systems"]) == 0
    out = capsys.readouterr().out
    assert all(key in out for key in SYSTEMS)


def test_import_needs_no_framework():
    code = "import sys, dualattn.bench; print(sorted({'torch', 'jax', 'triton'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"



def test_throughput_timer_launches_back_to_back_and_waits_once():
    from dualattn.bench.flash import throughput_ms
    from dualattn.bench.systems import Step
    events = []
    step = Step(lambda: events.append("launch") or len(events), lambda out: events.append(("sync", out)))
    ms = throughput_ms(step, min_ms=1.0, repeats=3)
    assert ms >= 0.0
    # two blocking warm-up calls, then rounds of n launches each followed by exactly one wait
    rounds = events[4:]
    syncs = [i for i, e in enumerate(rounds) if isinstance(e, tuple)]
    assert len(syncs) == 3
    n = syncs[0]
    assert n >= 3 and all(e == "launch" for e in rounds[:n])
    assert rounds[syncs[0]] == ("sync", 4 + n)  # the wait gets the last launch's outputs


def test_from_json_prints_the_table_of_a_results_file(tmp_path, capsys):
    from dualattn.bench.flash import main
    shape = Shape(2, 64, 2, 16)
    rows = [Measurement(system="sdpa-cudnn", **vars(shape), causal=False, mode="fwd", ms=1.0, tflops=3.0,
                        status="ok", ratio_to_cudnn=1.0)]
    path = tmp_path / "r.json"
    report.write_json(str(path), {"device": "X", "date": "2026-11-22"}, rows)
    assert main(["--from-json", str(path)]) == 0
    assert "sdpa-cudnn" in capsys.readouterr().out
