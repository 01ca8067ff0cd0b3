"""Where the time of a split-band forward goes (plan.split_band): each launch of the chain alone.

    python benchmarks/split_band.py [out.json]

Causal forward, bf16, 16k tokens, D=128 (H=16) and D=64 (H=32): the portable kernel (what
DUALATTN_WS=0 runs), the warp-specialised interior launch alone, the portable edges launch alone,
and the chain, as do_bench medians (ms) and TFLOP/s of the whole causal problem; then the edges
launch on other tiles (block_m, block_n, warps, stages) than plan.WS_EDGES_TILE.
"""
import dataclasses
import json
import sys

import torch
import triton

from dualattn.kernels.flash import plan as flash_plan
from dualattn.kernels.launch import cdiv

EDGE_TILES = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2))
from dualattn.torch_api import _launch, flash
from host_overhead import causal_op_arguments  # run as a script: this folder is on sys.path


def _plans(q, k, v):
    a, sparse, r = flash._problem(causal_op_arguments(q, k, v))
    out = torch.empty(flash_plan.out_shape(r.shapes), dtype=q.dtype, device=q.device)
    strides = flash._strides({**a, "out": out})
    portable = flash_plan.plan_forward(r.shapes, r.options, strides, config=r.config)
    split = flash_plan.plan_forward(r.shapes, r.options, strides, config=r.config, warp_specialize=True)
    return a, out, portable, split


def main(path=None):
    res = []
    for d, h in ((128, 16), (64, 32)):
        for s in (4096, 16384):
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            a, out, portable, split = _plans(q, k, v)
            assert split.then is not None
            outs = _launch.run(split, a, outputs={"out": out})
            interior = dataclasses.replace(split, then=None)
            # The edges launch resumes from its RESUME_* inputs (Launch.resume): here, in place.
            a = {**a, **{name: outs[result] for name, result in split.then.resume}}
            runs = {"portable": lambda: _launch.run(portable, a, outputs=outs),
                    "interior": lambda: _launch.run(interior, a, outputs=outs),
                    "edges": lambda: _launch.run(split.then, a, outputs=outs),
                    "chain": lambda: _launch.run(split, a, outputs=outs)}
            for bm, bn, warps, stages in EDGE_TILES:
                tile = dict(split.then.constexprs, BLOCK_M=bm, BLOCK_N=bn)
                edges = dataclasses.replace(split.then, constexprs=tuple(tile.items()), num_warps=warps,
                                            num_stages=stages, grid=(cdiv(s, bm),) + split.then.grid[1:])
                runs[f"edges {bm}x{bn}/{warps}/{stages}"] = lambda e=edges: _launch.run(e, a, outputs=outs)
            flops = 2 * b * h * s * s * d
            row = {"d": d, "s": s}
            for name, fn in runs.items():
                ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
                row[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
            print(json.dumps(row), flush=True)
            res.append(row)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": res}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:])
