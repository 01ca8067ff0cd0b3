"""Replay a fuzz configuration in Triton's interpreter with every memory access checked.

    python benchmarks/interpreter_bounds.py 20261128:570 --from benchmarks/results/2026-11-26_h200_gpu_fuzz_s20261128_450.json
    python benchmarks/interpreter_bounds.py 7:12 --framework torch       # a CPU-drawn configuration

Every load and store of every launch (forward and backward) is checked lane by lane: an active lane
must lie inside one of the launch's array arguments and be aligned to its element size.  A GPU crash
that this check passes (an illegal or misaligned address) is then not the kernels' index arithmetic
but the compiled code or the launch.  `--from` takes the configuration from a fuzz summary's failures
(a GPU-drawn configuration differs from the one the CPU would draw for the same key).  The launch
plans are the interpreter's (tiles and stages may differ from the GPU's; addresses do not depend on
the pipelining).  Exit status 1 when an access was outside or misaligned.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from anywhere

import triton.runtime.interpreter as interpreter  # noqa: E402

_buffers: list = []           # (first byte, end) of the running launch's array arguments
_kernel = ["?"]
findings = collections.Counter()
first_address: dict = {}


def _track_launches():
    run = interpreter.GridExecutor.__call__

    def call(self, *args, **kwargs):
        _kernel[0] = self.fn.__name__
        _buffers.clear()
        for a in list(args) + list(kwargs.values()):
            if hasattr(a, "data_ptr") and hasattr(a, "untyped_storage"):
                storage = a.untyped_storage()
                size = storage.array.nbytes if hasattr(storage, "array") else storage.nbytes()
                _buffers.append((storage.data_ptr(), storage.data_ptr() + size))
        return run(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = call


def _check(kind: str, ptrs, mask) -> None:
    addresses = np.asarray(ptrs.data).astype(np.int64)
    active = np.broadcast_to(np.asarray(mask.data), addresses.shape).astype(bool)
    addresses = addresses[active]
    if not addresses.size:
        return
    size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
    inside = np.zeros(addresses.shape, bool)
    for lo, hi in _buffers:
        inside |= (addresses >= lo) & (addresses + size <= hi)
    for what, bad in (("misaligned", addresses % size != 0), ("outside every argument", ~inside)):
        if bad.any():
            key = (_kernel[0], kind, what)
            findings[key] += int(bad.sum())
            first_address.setdefault(key, hex(int(addresses[bad][0])))


def _check_accesses():
    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def checked_load(self, ptrs, mask, other, *args):
        _check("load", ptrs, mask)
        return load(self, ptrs, mask, other, *args)

    def checked_store(self, ptrs, value, mask, *args):
        _check("store", ptrs, mask)
        return store(self, ptrs, value, mask, *args)

    builder.create_masked_load, builder.create_masked_store = checked_load, checked_store


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("replay", metavar="SEED:INDEX")
    ap.add_argument("--from", dest="summary", help="a fuzz summary JSON whose failures hold the configuration")
    ap.add_argument("--framework", choices=("jax", "torch"), default="jax")
    args = ap.parse_args(argv)
    seed, index = (int(x) for x in args.replay.split(":"))
    if args.framework == "jax":
        import jax
        jax.config.update("jax_platforms", "cpu")
    from dualattn.fuzz.check import run_jax, run_torch
    from dualattn.fuzz.draw import draw_config
    from dualattn.fuzz.inputs import make_inputs
    from dualattn.fuzz.run import rng_for
    if args.summary:
        with open(args.summary) as f:
            c = next(x["config"] for x in json.load(f)["failures"] if x["replay"] == args.replay)
    else:
        c = draw_config(seed, index, "cpu", 0.25)
    if c["kind"] == "invalid":
        print("an invalid configuration: nothing is launched")
        return 0
    _track_launches()
    _check_accesses()
    x = make_inputs(rng_for(seed, index, 1), c)
    run_jax(c, x, "triton") if args.framework == "jax" else run_torch(c, x, "cpu")
    if not findings:
        print(f"{args.replay} ({args.framework}): every load and store inside an argument and aligned")
        return 0
    for key, n in findings.items():
        print(f"{args.replay} ({args.framework}): {key[0]} {key[1]} {key[2]}: {n} lanes, first at {first_address[key]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
