"""Tile variants of the one-pass backward (dualattn/kernels/flash/backward_gluon.py) through dualattn's
torch backward, next to the two-pass backward and SDPA cuDNN's backward on the same inputs (H100).

A variant is name=BLOCK_M,BLOCK_N,STAGES,DQ_BUFS,DS_BUFS, one entry of hopper.ONE_PASS_TILES for the
head dim being timed; the one-pass kernel is planned at every length while this runs.  Each variant's
gradients are checked against the two-pass kernels' (deterministic, tested against float64) before it
is timed: a variant that does not compile, or is wrong, prints FAIL instead of a time.  16k tokens,
bf16, H=16 at D=128 and H=32 at D=64; wall time of torch.autograd.grad (CUDA events), median of
--repeats runs of --iters calls.

    python benchmarks/tune_one_pass.py --shapes 128:4096,64:16384 --causal both \
        --variants base=64,128,2,2,1 ds2=64,128,2,2,2 stages3=64,128,3,2,1
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dualattn.kernels.flash import hopper, plan as flash_plan
from dualattn.torch_api import flash_attention

_PLAN_TILES = dict(hopper.ONE_PASS_TILES)
_PLAN_KEYS = (hopper.ONE_PASS_MIN_KEYS, hopper.ONE_PASS_MIN_KEYS_WIDE_OR_PADDED, hopper.ONE_PASS_MAX_KEYS)


def parse_variant(text):
    name, spec = text.split("=")
    return name, tuple(int(x) for x in spec.split(","))


def plan_one_pass(tiles):
    """Plan the one-pass backward with `tiles` (hopper.ONE_PASS_TILES; {}: never, the two-pass kernels run)
    at every length; plans are memoised, so they are forgotten first."""
    hopper.ONE_PASS_TILES = tiles
    # (hopper.one_pass_backward reads them)
    hopper.ONE_PASS_MIN_KEYS, hopper.ONE_PASS_MIN_KEYS_WIDE_OR_PADDED, hopper.ONE_PASS_MAX_KEYS = 0, 0, 1 << 30
    flash_plan.forget_plans()


def backward_kernel(out, leaves, do) -> str:
    """The dK/dV kernel the backward of `out` plans (the one-pass kernel or the two-pass dK/dV one)."""
    with flash_plan.recording() as planned:
        torch.autograd.grad(out, leaves, do, retain_graph=True)
    return [p for p in planned if isinstance(p, flash_plan.BackwardPlan)][-1].dkdv.kernel


def wall_ms(fn, iters):
    """Mean wall ms per call of fn over `iters` back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_ms(fn, iters, repeats):
    fn()
    torch.cuda.synchronize()
    return statistics.median(wall_ms(fn, iters) for _ in range(repeats))


def backward_problems(shapes: str, causal: str):
    """(d, s, b, h, causal, q, k, v, do, backward flops) for each "d:s" of `shapes` and each causal
    setting of `causal` ("both", "true", "false"): 16k tokens, the sweep's head counts, bf16, seeded."""
    for item in shapes.split(","):
        d, s = (int(x) for x in item.split(":"))
        h = 16 * 128 // d
        b = max(1, 16384 // s)
        for c in {"both": (False, True), "true": (True,), "false": (False,)}[causal]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            yield d, s, b, h, c, q, k, v, do, 2.5 * 4 * b * h * s * s * d / (2 if c else 1)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:4096,64:4096", help="comma list of head_dim:seqlen")
    ap.add_argument("--causal", default="both", choices=("both", "true", "false"))
    ap.add_argument("--variants", nargs="+", default=[],
                    help="name=BLOCK_M,BLOCK_N,STAGES,DQ_BUFS,DS_BUFS (default: the plan's own tile)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    try:
        for d, s, b, h, causal, q, k, v, do, flops in backward_problems(args.shapes, args.causal):
            width = hopper.gluon_tile_width(d)   # (head dims between the widths run padded)
            variants = [parse_variant(v) for v in args.variants] or [("plan", _PLAN_TILES[width])]
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def backward(out):
                return lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)

            plan_one_pass({})
            out = flash_attention(*leaves, causal=causal)
            want = backward(out)()
            rows = [("two-pass", time_ms(backward(out), args.iters, args.repeats), "")]
            for name, tile in variants:
                plan_one_pass({**_PLAN_TILES, width: tile})
                try:
                    out = flash_attention(*leaves, causal=causal)
                    got = backward(out)()
                    errs = [rel_err(g, w) for g, w in zip(got, want)]
                    kernel = backward_kernel(out, leaves, do)
                    ok = (max(errs) < 1e-2 and all(torch.isfinite(g).all() for g in got)
                          and kernel == "flash_bwd_one_pass_kernel")
                    note = f"{kernel}, err dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs)
                except Exception as exc:  # a tile that does not compile or fit: report it, time the rest
                    ok, note = False, f"{type(exc).__name__}: {str(exc)[:120]}"
                ms = time_ms(backward(out), args.iters, args.repeats) if ok else float("nan")
                rows.append((name, ms, f"tile {tile} {note}" + ("" if ok else " FAIL")))
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
    finally:
        hopper.ONE_PASS_TILES = _PLAN_TILES
        hopper.ONE_PASS_MIN_KEYS, hopper.ONE_PASS_MIN_KEYS_WIDE_OR_PADDED, hopper.ONE_PASS_MAX_KEYS = _PLAN_KEYS
        flash_plan.forget_plans()


if __name__ == "__main__":
    main()
