"""Sweep the flash kernels' tiles on the GPU and write the tuned table plan.default_config reads.

python benchmarks/tune_flash.py --out tuned.json   then   DUALATTN_FLASH_TUNED=tuned.json python -m dualattn.bench ...
Forward tiles are timed on the forward; backward tiles (dK/dV, dQ) on the backward alone.
"""
import argparse
import json
import os
import time

import torch
import triton

import dualattn.torch_api as dt
from dualattn.kernels.flash import plan as flash_plan

# (block_m, block_n, warps, stages); tiles that do not fit in shared memory are skipped.
FWD = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 2), (128, 64, 4, 3),
       (128, 64, 4, 4), (128, 128, 4, 2), (64, 64, 4, 4), (64, 128, 4, 3)]
DKDV = [(64, 128, 8, 2), (64, 128, 8, 3), (64, 128, 4, 2), (32, 128, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2),
        (32, 64, 4, 4)]
DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 4, 2),
      (128, 32, 4, 4)]


def _with(fwd, dkdv, dq):
    cfg = flash_plan.FlashConfig(flash_plan.TileConfig(*fwd), flash_plan.TileConfig(*dkdv),
                                 flash_plan.TileConfig(*dq))
    flash_plan.default_config = lambda *a, **k: cfg  # the front ends look it up at call time


def _time(fn):
    try:
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
    except Exception as e:  # a tile that does not fit (shared memory) is skipped, and said so
        print("  skip:", repr(e)[:120], flush=True)
        return float("inf")


def tune(head_dim, heads, seqlen, batch, causal, log, backward=True):
    q, k, v = (torch.randn(batch, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    flops = 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)
    best_fwd = min(FWD, key=lambda c: _report(log, "fwd", c, flops, _time_fwd(c, q, k, v, causal)))
    if not backward:
        return best_fwd, DKDV[0], DQ[0]
    best_dkdv = min(DKDV, key=lambda c: _report(log, "dkdv", c, 2.5 * flops,
                                                _time_bwd(best_fwd, c, DQ[0], q, k, v, do, causal)))
    best_dq = min(DQ, key=lambda c: _report(log, "dq", c, 2.5 * flops,
                                            _time_bwd(best_fwd, best_dkdv, c, q, k, v, do, causal)))
    return best_fwd, best_dkdv, best_dq


def _time_fwd(c, q, k, v, causal):
    _with(c, DKDV[0], DQ[0])
    with torch.no_grad():
        return _time(lambda: dt.flash_attention(q, k, v, causal=causal))


def _time_bwd(fwd, dkdv, dq, q, k, v, do, causal):
    _with(fwd, dkdv, dq)
    out = dt.flash_attention(q, k, v, causal=causal)
    return _time(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True))


def _report(log, what, c, flops, ms):
    tf = flops / (ms * 1e-3) / 1e12 if ms != float("inf") else 0.0
    log.append(dict(kernel=what, config=c, ms=ms, tflops=tf))
    print(f"  {what:5s} {c} {tf:7.1f} TFLOP/s", flush=True)
    return ms


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--forward-only", action="store_true", help="tune the forward tiles only")
    args = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = major * 10 + minor
    table, log = {}, []
    t0 = time.time()
    for d in (int(x) for x in args.head_dims.split(",")):
        for causal in (False, True):
            print(f"d={d} causal={causal}", flush=True)
            best = tune(d, 16 if d >= 128 else 32, args.seqlen, args.tokens // args.seqlen, causal, log,
                        backward=not args.forward_only)
            table[flash_plan.tuned_key(arch, d, causal)] = best
            print(f"  best {best}", flush=True)
    with open(args.out, "w") as f:
        json.dump(table, f, indent=1)
    with open(os.path.splitext(args.out)[0] + "_log.json", "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                       tma=os.environ.get("DUALATTN_TMA", "1") != "0",
                       date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=time.time() - t0,
                       measurements=log), f, indent=1)
    print(json.dumps(table))
