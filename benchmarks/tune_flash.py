"""Sweep the flash kernels' tiles on the GPU and write the tuned table plan.default_config reads.

python benchmarks/tune_flash.py --out tuned.json   then   DUALATTN_FLASH_TUNED=tuned.json python -m dualattn.bench ...
Forward tiles are timed on the forward; backward tiles (dK/dV, dQ) on the backward alone, all with
the warp-specialised kernels off (DUALATTN_WS=0: they have fixed tiles).  Each problem also times
the default launch (warp-specialised where the plan takes it: 'default' rows of the log).
--seqlens below plan.SHORT_SEQ_BUCKETS' top write short-sequence keys (plan.tuned_key).
--compile-workers N first compiles every tile in N processes (Triton's disk cache), then times
them in one process: compiled one after another, ~200 variants dominate the run.
"""
import argparse
import json
import multiprocessing
import os
import time

import torch
import triton

import dualattn.torch_api as dt
from dualattn import switches
from dualattn.kernels.flash import plan as flash_plan

# (block_m, block_n, warps, stages); tiles that do not fit in shared memory are skipped.
FWD = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 2), (128, 64, 4, 3),
       (128, 64, 4, 4), (128, 128, 4, 2), (64, 64, 4, 4), (64, 128, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
        (32, 64, 4, 4)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2),
      (128, 32, 4, 4)]
# Head dims above 128: a 256-wide row takes twice the shared memory and registers per tile.
WIDE_FWD = [(128, 64, 8, 2), (128, 64, 8, 1), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 4, 2), (64, 64, 4, 2),
            (64, 64, 4, 3), (64, 64, 8, 2), (64, 32, 4, 3), (64, 32, 4, 2)]
WIDE_DKDV = [(64, 32, 4, 2), (128, 32, 8, 2), (64, 32, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (32, 32, 4, 3),
             (32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (64, 128, 8, 1)]
WIDE_DQ = [(64, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2),
           (64, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 1)]


def tile_lists(head_dim):
    """(fwd, dK/dV, dQ) candidate tiles for a head dim."""
    return (WIDE_FWD, WIDE_DKDV, WIDE_DQ) if head_dim > 128 else (FWD, DKDV, DQ)


def _with(fwd, dkdv, dq):
    cfg = flash_plan.FlashConfig(flash_plan.TileConfig(*fwd), flash_plan.TileConfig(*dkdv),
                                 flash_plan.TileConfig(*dq))
    flash_plan.default_config = lambda *a, **k: cfg  # the front ends look it up at call time
    flash_plan.forget_plans()   # and memoise each call's plan: planned again with these tiles


COMPILE_ONLY = False  # set in --compile-workers processes: run each tile once, time nothing


def _time(fn):
    try:
        if COMPILE_ONLY:
            fn()
            torch.cuda.synchronize()
            return 1.0
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as e:  # a tile that does not fit (shared memory) is skipped, and said so
        print("  skip:", repr(e)[:120], flush=True)
        return float("inf")


def tune(head_dim, heads, seqlen, batch, causal, log, backward=True, part=None):
    """Best (fwd, dkdv, dq) tiles of one problem.  part=(i, n): compile only every n-th tile from i."""
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    fwd_tiles, dkdv_tiles, dq_tiles = tile_lists(head_dim)
    mine = (lambda tiles: tiles[part[0]::part[1]] or tiles[:1]) if part else (lambda tiles: tiles)
    problem = dict(d=head_dim, s=seqlen, causal=causal)
    if part is None:  # the default launch, warp-specialised where the plan takes it
        flash_plan.default_config = _heuristics
        flash_plan.forget_plans()
        switches.set_switches(DUALATTN_WS=None)
        _report(log, "fwd", "default", flops, _time_fwd(None, q, k, v, causal), problem)
        _report(log, "bwd", "default", 2.5 * flops, _time_bwd(None, None, None, q, k, v, do, causal), problem)
    switches.set_switches(DUALATTN_WS="0")   # the tiles tuned here: portable kernels
    best_fwd = min(mine(fwd_tiles), key=lambda c: _report(log, "fwd", c, flops, _time_fwd(c, q, k, v, causal),
                                                          problem))
    if not backward:
        return best_fwd, dkdv_tiles[0], dq_tiles[0]
    best_dkdv = min(mine(dkdv_tiles), key=lambda c: _report(
        log, "dkdv", c, 2.5 * flops, _time_bwd(best_fwd, c, dq_tiles[0], q, k, v, do, causal), problem))
    best_dq = min(mine(dq_tiles), key=lambda c: _report(log, "dq", c, 2.5 * flops,
                                                  _time_bwd(best_fwd, best_dkdv, c, q, k, v, do, causal), problem))
    return best_fwd, best_dkdv, best_dq


_heuristics = flash_plan.default_config


def _time_fwd(c, q, k, v, causal):
    if c is not None:
        _, dkdv_tiles, dq_tiles = tile_lists(q.shape[-1])
        _with(c, dkdv_tiles[0], dq_tiles[0])
    with torch.no_grad():
        return _time(lambda: dt.flash_attention(q, k, v, causal=causal))


def _time_bwd(fwd, dkdv, dq, q, k, v, do, causal):
    if fwd is not None:
        _with(fwd, dkdv, dq)
    out = dt.flash_attention(q, k, v, causal=causal)
    return _time(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))


def _report(log, what, c, flops, ms, problem):
    tf = flops / (ms * 1e-3) / 1e12 if ms != float("inf") else 0.0
    log.append(dict(kernel=what, config=c, ms=ms, tflops=tf, **problem))
    if not COMPILE_ONLY:
        print(f"  {what:6s} {c} {tf:7.1f} TFLOP/s", flush=True)
    return ms


def _problems(args):
    for d in (int(x) for x in args.head_dims.split(",")):
        for seqlen in (int(x) for x in args.seqlens.split(",")):
            for causal in {"both": (False, True), "full": (False,), "causal": (True,)}[args.causal]:
                yield d, seqlen, causal


def _compile_part(args, i, n):
    global COMPILE_ONLY
    COMPILE_ONLY = True
    for d, seqlen, causal in _problems(args):
        tune(d, 16 if d >= 128 else 32, seqlen, args.tokens // seqlen, causal, [],
             backward=not args.forward_only, part=(i, n))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--seqlens", default="8192")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--forward-only", action="store_true", help="tune the forward tiles only")
    ap.add_argument("--compile-workers", type=int, default=0)
    ap.add_argument("--causal", choices=("both", "full", "causal"), default="both", help="which problems to tune")
    args = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    keys = [flash_plan.tuned_key(arch, d, causal, seqlen) for d, seqlen, causal in _problems(args)]
    if len(set(keys)) != len(keys):
        raise SystemExit("--seqlens: two lengths share a table key (one per short bucket, one above: "
                         f"plan.SHORT_SEQ_BUCKETS = {flash_plan.SHORT_SEQ_BUCKETS})")
    if args.compile_workers:
        ctx = multiprocessing.get_context("spawn")
        t0 = time.time()
        with ctx.Pool(args.compile_workers) as pool:
            pool.starmap(_compile_part, [(args, i, args.compile_workers) for i in range(args.compile_workers)])
        print(f"compiled in {time.time() - t0:.0f} s", flush=True)
    table, log = {}, []
    t0 = time.time()
    for d, seqlen, causal in _problems(args):
        print(f"d={d} S={seqlen} causal={causal}", flush=True)
        best = tune(d, 16 if d >= 128 else 32, seqlen, args.tokens // seqlen, causal, log,
                    backward=not args.forward_only)
        table[flash_plan.tuned_key(arch, d, causal, seqlen)] = best
        print(f"  best {best}", flush=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.splitext(args.out)[0] + "_log.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       tma=flash_plan.tma_requested(),
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=time.time() - t0,
                       measurements=log), f, indent=1)
    print(json.dumps(table))
