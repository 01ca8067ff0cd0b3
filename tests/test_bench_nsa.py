"""CPU dry run of benchmarks/bench_nsa.py: every system of both front ends times, and the JSON holds them."""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("jax")

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "bench_nsa.py"
_spec = importlib.util.spec_from_file_location("bench_nsa", _PATH)
bench_nsa = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_nsa)


def test_dry_run_times_torch_and_jax(tmp_path):
    out = tmp_path / "nsa.json"
    bench_nsa.main(["--device", "cpu", "--jax", "--seqlens", "32", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    timed = {(r["system"], r["mode"]) for r in rows if r["ms"]}
    for name in ("nsa", "nsa-no-window", "nsa-selected"):
        for mode in ("fwd", "fwdbwd"):
            assert (f"jax-dualattn-{name}", mode) in timed
            assert (f"torch-dualattn-{name}-back-to-back", mode) in timed
            assert (f"dualattn-{name}", mode) in timed
