"""A/B of one-pass backward variants (dualattn/kernels/flash/backward_gluon.py) through dualattn's torch
backward: the tile (plan.ONE_PASS_TILES: BLOCK_M, BLOCK_N, STAGES, DQ_BUFS, DS_BUFS) and the launch
layout, next to the two-pass backward and SDPA cuDNN's backward on the same inputs.  Every variant's
gradients are checked against the two-pass kernels' (deterministic, tested against float64) before it
is timed.  16k tokens, bf16, H100.  Wall time of torch.autograd.grad (CUDA events), median of
--repeats runs of --iters calls.

    python benchmarks/experiments/one_pass_variants.py --shapes 128:4096,128:16384 --causal both \
        --variants base=64,128,2,2,1 grid=64,128,2,2,1,GRID [...]

A variant is name=BLOCK_M,BLOCK_N,STAGES,DQ_BUFS,DS_BUFS[,GRID|PERSISTENT] (GRID: DUALATTN_PERSISTENT=0,
a program per key tile; PERSISTENT: DUALATTN_PERSISTENT=1, persistent whatever the keys).  (NOTES step
32's runs named two kernel switches since folded or dropped: ONE_BARRIER is DS_BUFS=2, REVERSE visited
query tiles last first.)
"""
import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dualattn.kernels.flash import plan as flash_plan
from dualattn.torch_api import flash_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from one_pass_profile import backward_problems, wall_ms  # noqa: E402


def parse_variant(text):
    name, spec = text.split("=")
    fields = spec.split(",")
    flags = fields[5:]
    return name, tuple(int(x) for x in fields[:5]), "0" if "GRID" in flags else "1" if "PERSISTENT" in flags else None


def use_variant(d, tile, persistent):
    """Plan the one-pass kernel with `tile` at head dim d, DUALATTN_PERSISTENT=`persistent` ("0": a
    program per key tile, "1": persistent, None: the plan's rule; plans are memoised, so they are
    forgotten first); records the launch grid."""
    flash_plan.ONE_PASS_TILES = {**flash_plan.ONE_PASS_TILES, d: tile}
    if persistent is None:
        os.environ.pop(flash_plan.PERSISTENT_ENV, None)
    else:
        os.environ[flash_plan.PERSISTENT_ENV] = persistent

    def launches(*args, **kwargs):
        one_pass, convert = _real_launches(*args, **kwargs)
        use_variant.grid = one_pass.grid
        return one_pass, convert

    flash_plan._one_pass_launches = launches
    flash_plan.forget_plans()


_real_launches = flash_plan._one_pass_launches


def time_ms(fn, iters, repeats):
    fn()
    torch.cuda.synchronize()
    return statistics.median(wall_ms(fn, iters) for _ in range(repeats))


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:4096,64:4096")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--variants", nargs="+", required=True)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--two-pass", type=int, default=1)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for d, s, b, h, causal, q, k, v, do, flops in backward_problems(args.shapes, args.causal):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        rows = []

        def backward(out):
            return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

        os.environ["DUALATTN_ONE_PASS"] = "0"
        flash_plan.forget_plans()
        out = flash_attention(*leaves, causal=causal)
        want = backward(out)()
        if args.two_pass:
            rows.append(("two-pass", time_ms(backward(out), args.iters, args.repeats), ""))
        os.environ["DUALATTN_ONE_PASS"] = "1"
        for name, tile, persistent in variants:
            use_variant(d, tile, persistent)
            out = flash_attention(*leaves, causal=causal)
            got = backward(out)()
            errs = [rel_err(g, w) for g, w in zip(got, want)]
            ok = max(errs) < 1e-2 and all(torch.isfinite(g).all() for g in got)
            ms = time_ms(backward(out), args.iters, args.repeats) if ok else float("nan")
            rows.append((name, ms, f"tile {tile} grid {use_variant.grid} err dq/dk/dv "
                         + "/".join(f"{e:.1e}" for e in errs) + ("" if ok else " FAIL")))
        qt, kt, vt = (x.transpose(1, 2).detach().clone().requires_grad_() for x in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
            dot = do.transpose(1, 2)
            cudnn = time_ms(lambda: torch.autograd.grad(ref, (qt, kt, vt), dot, retain_graph=True),
                            args.iters, args.repeats)
        print(f"\nD={d} S={s} B={b} H={h} causal={causal}: backward ms, x cuDNN ({cudnn:.3f} ms)", flush=True)
        for name, ms, note in rows:
            print(f"  {name:12s} {ms:7.3f} ms {flops / ms / 1e9:6.0f} TFLOP/s  {cudnn / ms:5.3f}x cuDNN  {note}",
                  flush=True)
        del out, ref
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
