"""Randomised checking of the attention front ends: `python -m dualattn.fuzz --count N`.

    draw.py     random valid and invalid configurations, from (seed, index)
    inputs.py   the tensors of a valid configuration
    check.py    run torch and jax on it and compare with the float64 reference (dualattn.testing)
    invalid.py  the mutations that make a call invalid, and the no-launch spies
    run.py      worker processes, failures, the JSON summary
"""
from .draw import draw_config  # noqa: F401
from .run import fuzz, run_config, run_one  # noqa: F401
