"""python -m dualattn.fuzz: a fixed-seed slice passes, and the fuzzer's checks can fail.

The slice is small (the Triton interpreter runs each configuration in about a second); release runs
are `python -m dualattn.fuzz --count 5000 --workers $(nproc)`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from dualattn.fuzz import check, draw, invalid, run
from dualattn.fuzz.__main__ import main
from dualattn.fuzz.inputs import make_inputs

CI_SEED, CI_COUNT = 2026, 24


def test_fixed_seed_slice_has_no_failures():
    summary = run.fuzz(CI_COUNT, seed=CI_SEED, device="cpu", log=None)
    assert summary["failures_count"] == 0, json.dumps(summary["failures"], indent=1)[:4000]
    kinds = {k for k in summary["counts"] if k in ("dense", "varlen", "blocksparse")}
    assert kinds == {"dense", "varlen", "blocksparse"} and summary["invalid"] > 0, summary["counts"]


def test_a_partial_run_names_the_configurations_it_ran():
    """Workers report configurations as they finish, so a stopped run's summary names its exact indices."""
    assert run.index_ranges([9, 3, 4, 5, 7, 8]) == [[3, 5], [7, 9]]
    summary = run.fuzz(4, seed=CI_SEED, device="cpu", start=10, invalid_fraction=1.0, log=None)
    assert summary["indices"] == [[10, 13]] and summary["invalid"] == 4


def test_the_package_tree_id_is_gits(tmp_path):
    """versions()["dualattn_tree"] is the git tree id of the package's files as they are on disk
    (run.source_tree_id): git's own on a tree with nested and empty directories, an executable file,
    a file and a directory whose names sort differently with git's trailing "/", and bytecode caches."""
    import os
    import subprocess
    root = tmp_path / "pkg"
    for rel, text in (("a.py", "x = 1\n"), ("a/b.py", ""), ("a/c/d.txt", "deep"), ("a-b.py", "y\n"),
                      ("run.sh", "#!/bin/sh\n"), ("__pycache__/a.cpython-311.pyc", "junk"), ("a/e.pyc", "junk")):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "empty").mkdir()
    os.chmod(root / "run.sh", 0o755)
    (tmp_path / ".gitignore").write_text("__pycache__/\n*.pyc\n")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], capture_output=True, text=True,  # noqa: E731
                                    check=True).stdout.strip()
    git("init", "-q")
    git("add", "-A")
    assert run.source_tree_id(str(root)) == git("write-tree", "--prefix=pkg/")
    (root / "a" / "b.py").write_text("changed")
    assert run.source_tree_id(str(root)) != git("write-tree", "--prefix=pkg/")
    assert run.versions()["dualattn_tree"] == run.source_tree_id(os.path.dirname(os.path.dirname(run.__file__)))


def _valid_index(kind: str, seed: int = CI_SEED) -> int:
    """The first index of `seed` that draws a small valid configuration of `kind`."""
    for i in range(10_000):
        c = draw.draw_config(seed, i, "cpu")
        if c["kind"] == kind and c["B"] * c["Hq"] <= 2 and 0 not in (c["Sq"], c["Sk"]) and not c["jax"]:
            return i
    raise AssertionError(f"no {kind} configuration drawn")


def test_draws_replay_exactly():
    for i in range(40):
        assert draw.draw_config(7, i, "cpu") == draw.draw_config(7, i, "cpu")
    i = _valid_index("dense", 7)
    c = draw.draw_config(7, i, "cpu")
    a, b = make_inputs(draw.rng_for(7, i, 1), c), make_inputs(draw.rng_for(7, i, 1), c)
    assert torch.equal(a.query, b.query) and torch.equal(a.dout, b.dout)


def test_a_wrong_result_is_reported(monkeypatch):
    """A front end that is off by 1% in the output (or in one gradient) is a failure naming it."""
    seed, i = CI_SEED, _valid_index("dense")
    real = check.run_torch

    def off(which):
        def broken(c, x, device):
            out, lse, grads = real(c, x, device)
            if which == "out":
                return out * 1.01, lse, grads
            return out, lse, dict(grads, value=grads["value"] * 1.01)
        return broken

    for which, name in (("out", "torch out"), ("dvalue", "torch dvalue")):
        monkeypatch.setattr(check, "run_torch", off(which))
        record = run.run_one(seed, i, "cpu")
        assert not record["ok"] and name in record["error"], record.get("error")
        assert record["replay"] == f"{seed}:{i}" and record["config"]["kind"] == "dense"


def test_nan_in_a_fully_masked_row_is_reported(monkeypatch):
    seed, i = CI_SEED, _valid_index("dense")
    real = check.run_torch

    def nan_row(c, x, device):
        out, lse, grads = real(c, x, device)
        out = out.clone()
        out[0, 0] = float("nan")
        return out, lse, grads

    monkeypatch.setattr(check, "run_torch", nan_row)
    record = run.run_one(seed, i, "cpu")
    assert not record["ok"] and "out" in record["error"]


def _invalid_config(name: str, framework: str = "torch") -> dict:
    return dict(kind="invalid", mutation=name, variant=3, framework=framework)


def test_invalid_calls_that_pass_or_launch_are_reported(monkeypatch):
    """A mutation that leaves the call valid is caught (no error), and so is an error raised only
    after a kernel was launched (the spies), and an error that does not name the argument."""
    def harmless(rng, fw, device):
        c = invalid._Call(rng, fw, device)
        return c, "query"

    monkeypatch.setitem(invalid.MUTATIONS, "harmless", invalid.Mutation(harmless))
    record = run.run_config(_invalid_config("harmless"), 0, 0, "cpu")
    assert not record["ok"] and "launched before rejecting" in record["error"], record["error"]

    def unnamed(rng, fw, device):
        def call():
            raise ValueError("bad input")
        return call, "softmax_scale"

    monkeypatch.setitem(invalid.MUTATIONS, "unnamed", invalid.Mutation(unnamed))
    record = run.run_config(_invalid_config("unnamed"), 0, 0, "cpu")
    assert not record["ok"] and "does not name 'softmax_scale'" in record["error"]

    def silent(rng, fw, device):
        return (lambda: None), "causal"

    monkeypatch.setitem(invalid.MUTATIONS, "silent", invalid.Mutation(silent))
    record = run.run_config(_invalid_config("silent"), 0, 0, "cpu")
    assert not record["ok"] and "no error raised" in record["error"]


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_every_mutation_is_rejected_before_launch(framework):
    """Each registered mutation, a few variants each: ValueError/TypeError naming the argument."""
    for name, m in sorted(invalid.MUTATIONS.items()):
        if framework not in m.frameworks:
            continue
        for variant in range(3):
            c = dict(kind="invalid", mutation=name, variant=variant, framework=framework)
            record = run.run_config(c, 0, 0, "cpu")
            assert record["ok"], (name, variant, record.get("error"))


def test_replay_command_prints_the_configuration(capsys):
    i = next(i for i in range(100) if draw.draw_config(CI_SEED, i, "cpu")["kind"] == "invalid")
    assert main(["--replay", f"{CI_SEED}:{i}"]) == 0
    printed = capsys.readouterr().out
    assert '"kind": "invalid"' in printed and printed.rstrip().splitlines()[-1].startswith("ok")


def test_features_count_options():
    c = draw.draw_config(CI_SEED, _valid_index("varlen"), "cpu")
    f = run.features(c)
    assert "varlen" in f and c["dtype"] in f
    assert np.all([isinstance(x, str) for x in f])


@pytest.mark.parametrize("index", [1342, 365, 1305, 1963, 1820, 2221])
def test_former_failures_replay_clean(index):
    """Configurations of seed 20261126 that exposed bugs: two +inf sinks with an lse cotangent (1342),
    a +inf sink at softmax_scale 318 (365: the reference gave NaN), varlen rows in no sequence with
    sinks on xla (1305), an empty batch with segment ids on xla (1963), a lone key far below a
    sink whose probability underflows (1820: out ~1e-108 in the reference, 0 in bf16), and an
    "int64" cu_seqlens that JAX without x64 silently made int32, so nothing was invalid (2221)."""
    record = run.run_one(20261126, index, "cpu")
    assert record["ok"], record.get("traceback", record.get("error"))


def _blocksparse_config(dtype="float32", d=160, block_q=128, block_k=64) -> dict:
    return dict(kind="blocksparse", dtype=dtype, B=1, Sq=200, Sk=300, Hq=2, Hkv=1, D=d, Dv=d, causal=False,
                sliding_window=None, logits_soft_cap=None, softmax_scale=None, softmax_aux=None, return_lse=True,
                lse_cotangent=True, jax=[], layout=dict(block_q=block_q, block_k=block_k, layout_batch=1,
                                                        layout_heads=2, builder="random", density=0.5, window=10,
                                                        stride=1, global_n=3))


def test_gpu_layout_check_is_the_librarys():
    """float32 blocks of 128x64 at head dim 160 do not fit sm_90 (the library raises its ValueError
    naming `layout`): the draw's check says so, compiling as the launchers do (no GPU needed)."""
    from dualattn.kernels.flash import fit
    assert not draw.layout_fits(_blocksparse_config(), arch=90, max_shared=fit.MAX_SHARED_BYTES[90])


def test_gpu_draw_shrinks_layouts_until_they_fit(monkeypatch):
    """Blocks halve (the larger first, block_q on a tie) down to 32, then float32 becomes bfloat16, then down to 16;
    every blocksparse configuration drawn for cuda is one the check accepts."""
    def fits_when(limit, dtypes=("bfloat16",)):
        def fits(c, **_):
            return c["layout"]["block_q"] * c["layout"]["block_k"] <= limit or c["dtype"] in dtypes
        return fits

    monkeypatch.setattr(draw, "layout_fits", fits_when(64 * 32, dtypes=()))
    c = draw.fitted_layout(_blocksparse_config())
    assert (c["layout"]["block_q"], c["layout"]["block_k"], c["dtype"]) == (32, 64, "float32")
    monkeypatch.setattr(draw, "layout_fits", fits_when(16 * 16))
    c = draw.fitted_layout(_blocksparse_config())
    assert (c["layout"]["block_q"], c["layout"]["block_k"], c["dtype"]) == (32, 32, "bfloat16")
    monkeypatch.setattr(draw, "layout_fits", fits_when(16 * 16, dtypes=()))
    c = draw.fitted_layout(_blocksparse_config())
    assert (c["layout"]["block_q"], c["layout"]["block_k"], c["dtype"]) == (16, 16, "bfloat16")

    checked = []
    monkeypatch.setattr(draw, "layout_fits", lambda c, **_: checked.append(c) or c["layout"]["block_q"] <= 64)
    drawn = [draw.draw_config(7, i, "cuda") for i in range(60)]
    sparse = [c for c in drawn if c["kind"] == "blocksparse"]
    assert sparse and all(c["layout"]["block_q"] <= 64 for c in sparse)
    assert all(c["kind"] == "blocksparse" for c in checked)


def test_a_lost_cuda_context_is_one_failure(monkeypatch):
    """A configuration whose error leaves the worker's CUDA context unusable is the failure; the
    configurations that worker takes afterwards are reported unchecked, not as failures of their own."""
    def crash(c, x, device, seconds=None):
        raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    import dualattn.fuzz.check as check
    monkeypatch.setattr(check, "check_valid", crash)
    monkeypatch.setattr(run, "_context_lost_at", None)
    configs = {i: run.draw_config(5, i, "cpu", 0.0) for i in range(3)}   # (drawing for cuda asks the GPU)
    valid = sorted(configs)
    records = [dict(run.run_config(configs[i], 5, i, "cuda"), config=configs[i]) for i in valid]
    assert not records[0]["ok"] and records[0]["context_lost"]
    assert all(r.get("unchecked") == f"not run: the worker's CUDA context was lost at 5:{valid[0]}" for r in records[1:])
    summary = run.summary(records, seed=5, device="cpu", start=0, wall=1.0, workers=1, invalid_fraction=0.0)
    assert summary["failures_count"] == 1 and summary["unchecked_count"] == 2
    assert summary["configurations"] == 1
    monkeypatch.setattr(run, "_context_lost_at", None)
    # on the CPU the same error text is an ordinary failure: nothing is skipped after it
    assert not run.run_config(configs[1], 5, 1, "cpu")["ok"]
    assert run._context_lost_at is None


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_sample_of_option_combinations():
    """At least 300 random valid option combinations at GPU sizes (every option, head dims 16-256, GQA,
    Sq != Sk, ragged varlen, block-sparse), forward and backward against the float64 reference on the
    device, torch and a sample of jax: the fuzz, drawn afresh each run (seed in the message).  About
    ten minutes on a 16-core H100/H200 host: `pytest -m "gpu and slow" tests/test_fuzz.py`."""
    import os
    seed = int(os.environ.get("DUALATTN_TEST_SEED", np.random.SeedSequence().entropy % 2**31))
    summary = run.fuzz(320, seed=seed, device="cuda", workers=max(1, (os.cpu_count() or 2) - 2),
                       invalid_fraction=0.0, log=None)
    where = f" (python -m dualattn.fuzz --device cuda --seed {seed} --count 320 --invalid-fraction 0 reproduces it)"
    assert summary["failures_count"] == 0, json.dumps(summary["failures"], indent=1)[:4000] + where
    assert summary["unchecked_count"] == 0 and summary["valid"] >= 300, where


@pytest.mark.gpu
def test_gpu_narrow_query_key_tile_replays_clean():
    """The GPU fuzz's 20261128:570 (fp32 block-sparse, D = 16, Dv = 168, causal, segment ids) at 100
    queries: jax-triton compiles the scalar num_k_blocks = 1 as a constexpr, and that dQ variant wrote
    shared memory at a misaligned address (memcheck) with the 16-column q/k tile; plan.head_blocks
    widens it.  Torch, jax-triton and the float64 reference on the device."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    c = {**draw.draw_config(20261128, 570, "cuda"), "Sq": 100}
    assert (c["kind"], c["dtype"], c["D"], c["Dv"], c["jax"]) == ("blocksparse", "float32", 16, 168, ["triton"])
    errors = check.check_valid(c, make_inputs(draw.rng_for(20261128, 570, 1), c), "cuda")
    assert set(errors) == {"torch", "jax-triton", "torch-vs-jax"}, errors
