"""Developer switches: A/B toggles of the kernel choices, read once from the environment at import.

Users need none of them.  What users choose is an argument: `deterministic=True` for a
reproducible backward, `autotune=` and the executor's cache file for configs (dualattn/executor.py:
`Executor(path)`, `DUALATTN_CACHE_DIR`, `DUALATTN_AUTOTUNE`).  These switches exist to measure one
kernel family against another and to run a family outside the range its speed rules give it (the
tests do, in the interpreter).  Each is "0" (off), "1" (on whatever the speed rules say) or unset
(the plans' rules decide), unless its line says otherwise:

    DUALATTN_WS             warp-specialised (and Gluon) kernels; on by default on sm_90 only
                            (plan.warp_specialize_requested); "1" also in the interpreter
    DUALATTN_TMA            TMA tile loads in the portable kernels; off by default (no faster
                            than pointer loads: docs/lessons.md, "TMA alone buys nothing")
    DUALATTN_PERSISTENT     persistent launches (plan.persistent_forward, persistent_backward,
                            one_pass_persistent)
    DUALATTN_WS_BAND        the warp-specialised forward's band inside its loop (plan.ws_band_in_loop)
    DUALATTN_EDGES_IN_LOOP  the portable kernels' masked band edges inside the one loop
                            (plan.edges_in_loop)
    DUALATTN_GLUON_FWD      the Gluon forward (plan.gluon_forward); "1" also for the short causal
                            windows the portable forward runs (hopper.short_window_forward)
    DUALATTN_ONE_PASS       the one-pass Gluon backward (plan.one_pass_backward); "1" also for the short
                            causal windows the portable backward runs (hopper.short_window_backward)
    DUALATTN_NUM_SMS        an SM count in place of the device's (persistent launches in the
                            interpreter, or with fewer programs than SMs)
    DUALATTN_FLASH_TUNED    a JSON tile table that overrides plan.TUNED (benchmarks/tune_flash.py)
    DUALATTN_JAX_PTXAS      "triton": the JAX launcher assembles with Triton's ptxas
                            (jax_api/ptxas.py)
    DUALATTN_FAST_TANH      "0": 16-bit soft-capped launches on a GPU use the exp2 tanh, not the
                            hardware tanh.approx (plan.softcap_mode)
    DUALATTN_VARLEN_DOCUMENTS  varlen calls with one table run as segment ids
                            (plan.varlen_as_documents); "1" also where the Gluon forward would
                            not take them (the portable kernels: the interpreter)

Read once: a plan depends on them, and the launchers' memo of planned calls keys on `current()`,
one hashable value, instead of reading a dozen variables per call.  Tests and benchmarks change them
within a process with `override(...)`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Optional, Tuple

VARIABLES = ("DUALATTN_WS", "DUALATTN_TMA", "DUALATTN_PERSISTENT", "DUALATTN_WS_BAND", "DUALATTN_EDGES_IN_LOOP",
             "DUALATTN_GLUON_FWD", "DUALATTN_ONE_PASS", "DUALATTN_NUM_SMS", "DUALATTN_FLASH_TUNED",
             "DUALATTN_JAX_PTXAS", "DUALATTN_FAST_TANH", "DUALATTN_VARLEN_DOCUMENTS")


@dataclasses.dataclass(frozen=True)
class Switches:
    """The switches' values: (variable, value) for each one that is set."""

    values: Tuple[Tuple[str, str], ...] = ()

    def get(self, name: str) -> Optional[str]:
        if name not in VARIABLES:
            raise KeyError(f"{name} is not a dualattn switch; the switches: {', '.join(VARIABLES)}")
        return dict(self.values).get(name)

    def replace(self, **changes: Optional[str]) -> "Switches":
        """These switches with `changes` (variable=value; None unsets it)."""
        for name in changes:
            self.get(name)
        values = {**dict(self.values), **changes}
        return Switches(tuple(sorted((k, str(v)) for k, v in values.items() if v is not None)))


def from_environment(environ=os.environ) -> Switches:
    return Switches(tuple((name, environ[name]) for name in VARIABLES if environ.get(name)))


_current = from_environment()


def current() -> Switches:
    return _current


@contextlib.contextmanager
def override(**changes: Optional[str]):
    """`with override(DUALATTN_WS="0"):` the switches with these changes (None unsets one)."""
    global _current
    saved = _current
    _current = saved.replace(**changes)
    try:
        yield _current
    finally:
        _current = saved


def set_switches(**changes: Optional[str]) -> None:
    """Change switches for the rest of the process (benchmark scripts; None unsets one)."""
    global _current
    _current = _current.replace(**changes)


def set_for_test(monkeypatch, name: str, value: Optional[str]) -> None:
    """Change one switch until pytest's `monkeypatch` undoes it (None unsets it)."""
    import sys
    monkeypatch.setattr(sys.modules[__name__], "_current", _current.replace(**{name: value}))
