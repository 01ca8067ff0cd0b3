"""python -m dualattn.fuzz --count N [--device cpu|cuda] [--seed S] [--workers W] [--out results.json]
                          [--replay SEED:INDEX]

Random valid configurations checked against the float64 reference (forward and backward, torch and
jax), random invalid ones checked to raise a ValueError/TypeError naming the argument before any
launch.  Every failure prints the SEED:INDEX that replays it.  Exit status 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .draw import INVALID_FRACTION
from .run import fuzz, run_one


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dualattn.fuzz", description=__doc__.split("\n\n")[1])
    p.add_argument("--count", type=int, default=100, help="configurations to run")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where torch runs (jax runs on its default device); cpu keeps interpreter-sized problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start", type=int, default=0, help="first configuration index")
    p.add_argument("--workers", type=int, default=1, help="worker processes (one configuration at a time each)")
    p.add_argument("--invalid-fraction", type=float, default=INVALID_FRACTION,
                   help="share of invalid configurations")
    p.add_argument("--out", help="write the JSON summary here")
    p.add_argument("--replay", metavar="SEED:INDEX", help="rerun one configuration and print everything about it")
    args = p.parse_args(argv)

    if args.replay:
        seed, index = (int(x) for x in args.replay.split(":"))
        r = run_one(seed, index, args.device, args.invalid_fraction)
        print(json.dumps(r["config"], indent=1))
        if r["ok"]:
            print("ok", json.dumps(r.get("errors") or r.get("result")))
            return 0
        print(r["traceback"])
        return 1

    if args.device == "cuda":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # torch and jax share the GPU
    def write(summary: dict) -> None:
        # Whole files only: a run killed mid-write keeps its previous checkpoint.
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    s = fuzz(args.count, seed=args.seed, device=args.device, workers=args.workers, start=args.start,
             invalid_fraction=args.invalid_fraction, checkpoint=write if args.out else None)
    print(f"{s['configurations']} configurations ({s['valid']} valid, {s['invalid']} invalid) on {s['device_name']}: "
          f"{s['failures_count']} failures"
          + (f", {s['unchecked_count']} not run after a lost CUDA context" if s["unchecked_count"] else "")
          + f", {s['wall_seconds']} s, {s['configs_per_second']} configs/s "
          f"({args.workers} workers; {s['mean_config_seconds']} s per configuration and worker)")
    if args.out:
        write(s)
        print(f"wrote {args.out}")
    return 1 if s["failures_count"] else 0


if __name__ == "__main__":
    sys.exit(main())
