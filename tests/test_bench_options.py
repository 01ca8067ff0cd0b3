"""CPU dry run of `python -m dualattn.bench --cases ...` (dualattn/bench/options.py): cases, exact pair
counts, the correctness guard, the JSON, the plot."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from dualattn.bench import options as bench_options  # noqa: E402


def _case(name):
    return bench_options.shrink(next(c for c in bench_options.CASES if c.name == name))


def test_pairs_are_counted_exactly():
    docs = bench_options.make_problem(_case("docs"), 0, "cpu")  # 8 causal documents of 8 tokens, H=2
    assert docs.pairs() == 2 * 8 * (8 * 9 // 2)
    window = bench_options.make_problem(_case("window_causal"), 0, "cpu")  # j in [i - 16, i]
    assert window.pairs() == 2 * sum(min(i + 1, 17) for i in range(64))
    mask = bench_options.make_problem(_case("mask"), 0, "cpu")
    assert mask.pairs() == int(mask.mask.sum())


def test_reference_sees_a_missing_option():
    from dualattn.torch_api import flash_attention
    p = bench_options.make_problem(_case("sinks_causal"), 0, "cpu")
    refs = p.reference_heads()
    with_sinks = flash_attention(p.inputs.q, p.inputs.k, p.inputs.v, **p.flash_kwargs())
    without = flash_attention(p.inputs.q, p.inputs.k, p.inputs.v, causal=True)
    err = lambda out: max(bench_options.rel_error(out[0, :, h], ref) for h, ref in refs.items())  # noqa: E731
    assert err(with_sinks) < 2e-2 < err(without)


def test_cpu_dry_run_writes_the_json(tmp_path, capsys):
    out = tmp_path / "options.json"
    assert bench_options.main(["--device", "cpu", "--cases", "sinks_causal,docs_varlen", "--out", str(out),
                               "--markdown"]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["device"] == "cpu" and {"torch", "triton", "jax"} <= set(doc["meta"]["versions"])
    assert doc["meta"]["bases"]["docs_varlen"] == "plain_causal_b1_s16384_h16_d128"
    rows = {(r["case"], r["system"], r["mode"]): r for r in doc["rows"]}
    assert {c for c, _, _ in rows} == {"plain_causal", "sinks_causal", "plain_causal_b1_s16384_h16_d128",
                                       "docs_varlen"}
    for mode in ("fwd", "fwdbwd"):
        ours = rows[("sinks_causal", "dualattn-torch", mode)]
        assert ours["status"] == "ok" and ours["err"] < 2e-2 and ours["tflops"] > 0 and ours["ratio_to_base"] > 0
        assert rows[("plain_causal", "dualattn-torch", mode)]["ratio_to_base"] == 1.0
        assert rows[("docs_varlen", "flex", mode)]["status"] == "unavailable"
    assert rows[("docs_varlen", "dualattn-torch", "fwd")]["pairs"] == 8 * (8 * 9 // 2) * 2
    table = capsys.readouterr().out
    assert "| sinks_causal | sinks |" in table and "| docs_varlen | varlen+documents |" in table


def test_unknown_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        bench_options.parse_args(["--cases", "plain,nope"])
    assert info.value.code == 2 and "nope" in capsys.readouterr().err


def test_cpu_dry_run_times_jax_with_a_bias_and_a_mask(tmp_path):
    """The JAX step takes the S x S tensors as arguments of the jitted call (JaxFrontEnd's array_kwargs)
    and checks against the same reference as torch."""
    pytest.importorskip("jax")
    out = tmp_path / "options.json"
    assert bench_options.main(["--device", "cpu", "--jax", "--cases", "bias,mask", "--out", str(out)]) == 0
    rows = {(r["case"], r["system"], r["mode"]): r for r in json.loads(out.read_text())["rows"]}
    for case in ("bias", "mask"):
        for mode in ("fwd", "fwdbwd"):
            jax_row = rows[(case, "dualattn-jax-triton", mode)]
            assert jax_row["status"] == "ok" and jax_row["err"] < 2e-2 and jax_row["tflops"] > 0, jax_row


def test_the_package_entry_point_runs_the_options_cases(tmp_path):
    """`python -m dualattn.bench --cases ...` is the options benchmark; --from-json redraws a run's plot."""
    out, png = tmp_path / "options.json", tmp_path / "options.png"
    run = subprocess.run([sys.executable, "-m", "dualattn.bench", "--device", "cpu", "--cases", "softcap_causal",
                          "--out", str(out), "--markdown"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "| softcap_causal | soft_cap |" in run.stdout
    assert {r["case"] for r in json.loads(out.read_text())["rows"]} == {"plain_causal", "softcap_causal"}
    pytest.importorskip("matplotlib")
    assert bench_options.main(["--from-json", str(out), "--plot", str(png)]) == 0
    assert png.stat().st_size > 0
