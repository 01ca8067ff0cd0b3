"""Shared test fixtures: gpu skipping, fresh random inputs per test, relative-error checks.

Markers `gpu` and `slow` are declared in pyproject.toml; this file only implements the gpu skip.
"""
from __future__ import annotations

import os
import sys
import zlib

import numpy as np
import pytest
from dualattn.switches import set_for_test as set_switch  # noqa: E402

# tests/reference.py is imported as `reference` from every test folder, whatever the import mode.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from reference import assert_close_rel  # noqa: E402


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken CUDA install is "no GPU" for the test suite
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda unavailable or torch not installed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _fresh_plans():
    """Each test plans its launches afresh.  Launchers memoise planned calls per signature (the torch
    front end's _CallPlan), so a test that spies on flash_plan.plan_forward / plan_backward would
    otherwise see nothing for a signature an earlier test in the same worker already ran."""
    from dualattn.kernels.flash import plan as flash_plan
    flash_plan.forget_plans()
    yield


@pytest.fixture
def seed(request) -> int:
    """A per-test seed: different for every test id, reproducible from run to run.

    Set DUALATTN_TEST_SEED to shift every seed (fresh inputs for a whole run).
    """
    base = int(os.environ.get("DUALATTN_TEST_SEED", "0"))
    return (zlib.crc32(request.node.nodeid.encode()) + base) & 0x7FFFFFFF


@pytest.fixture
def rng(seed) -> np.random.Generator:
    """numpy Generator seeded per test (see `seed`)."""
    return np.random.default_rng(seed)


@pytest.fixture
def torch_gen(seed):
    """torch.Generator (CPU) seeded per test; also seeds torch's global RNG for convenience."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(seed)
    g = torch.Generator()
    g.manual_seed(seed)
    return g


@pytest.fixture
def assert_rel():
    """Fixture form of `assert_close_rel` (for tests in folders that cannot import conftest)."""
    return assert_close_rel


@pytest.fixture
def forward_plan_flags(monkeypatch):
    """forward_plan_flags(name) -> a list that collects the constexpr `name` (e.g. "TMA") of every
    forward launch planned from then on, so a test can check which variant actually ran."""
    def spy_on(name: str) -> list:
        from dualattn.kernels.flash import plan as flash_plan
        flags, real = [], flash_plan.plan_forward
        # The Triton forward's flags: not the Gluon forward's (tests/torch/test_gluon_forward.py).
        set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "0")

        def spy(*args, **kwargs):
            launch = real(*args, **kwargs)
            flags.append(launch.constexpr_dict[name])
            return launch

        monkeypatch.setattr(flash_plan, "plan_forward", spy)
        return flags
    return spy_on


@pytest.fixture
def launch_flags(monkeypatch, forward_plan_flags):
    """launch_flags(name) -> forward_plan_flags(name), extended by the constexpr `name` of the
    dK/dV and dQ launches of every backward planned from then on."""
    def spy_on(name: str) -> list:
        from dualattn.kernels.flash import plan as flash_plan
        flags, real = forward_plan_flags(name), flash_plan.plan_backward
        # The two-pass kernels' flags: not the one-pass Gluon backward (tests/torch/test_one_pass.py).
        set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "0")

        def spy(*args, **kwargs):
            plan = real(*args, **kwargs)
            flags.extend((plan.dkdv.constexpr_dict[name], plan.dq.constexpr_dict[name]))
            return plan

        monkeypatch.setattr(flash_plan, "plan_backward", spy)
        return flags
    return spy_on
