"""Benchmarks of dualattn against its peers: `python -m dualattn.bench --help`.

Importing this package needs neither a GPU nor jax; torch, triton and jax are imported when a run starts.
"""
from .flash import main, parse_args  # noqa: F401

__all__ = ["main", "parse_args"]
