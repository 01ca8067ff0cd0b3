"""A/B two source trees of dualattn on the GPU (or two settings of one): the tree imported is the one
PYTHONPATH names, the setting what the environment says.

    git worktree add /tmp/base HEAD        # or a copy with one change applied
    for t in /tmp/base $PWD /tmp/base $PWD; do PYTHONPATH=$t python benchmarks/ab_trees.py $(basename $t) out_$(basename $t).json; done
    for e in 0 1 0 1; do DUALATTN_EDGES_IN_LOOP=$e python benchmarks/ab_trees.py e$e e$e.json 1024,2048 128,64 --kernel-time; done
    python benchmarks/ab_trees.py rule0 rule0.json 1024 128 --kernel-time WS_MIN_KEY_WORK=0
    python benchmarks/ab_trees.py dq64 dq64.json 2048 64 --kernel-time "WS_DQ_TILES[64]=128x128x4x2"

Times the torch path's forward and forward+backward (TFLOP/s) at D=128 (H=16) and D=64 (H=32) (or the
comma-separated fourth argument's head dims), 16k tokens, S = 2048 and 8192 (or the comma-separated
third argument), causal and not.  Default: do_bench medians of back-to-back calls, host time included.
--kernel-time: CUDA-graph replays (do_bench_cudagraph), so the torch path's host time (as long as the
kernels at S=1024) can neither mask nor fake a difference; it also prints the backward (the
difference).  NAME=VALUE sets an integer constant of dualattn.kernels.flash.plan first (a rule's
threshold); TABLE[D]=BMxBNxWARPSxSTAGES one entry of a tile table.  Alternate the trees: the spread
between rounds of one tree is the noise any difference must beat (benchmarks/NOTES.md).
"""
import json
import sys

import torch
import triton

import dualattn
import dualattn.torch_api as dt
from dualattn.kernels.flash import hopper, plan as flash_plan


def _time(fn, kernel_time):
    if not kernel_time:
        return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median")
    fn()   # compile outside the graph
    return triton.testing.do_bench_cudagraph(fn, rep=100)


def main(tag: str, out: str, seqlens=(2048, 8192), head_dims=(128, 64), kernel_time=False):
    print(tag, dualattn.__file__, flush=True)
    res = {}
    for d in head_dims:
        h = 16 * 128 // d
        for s in seqlens:
            b = 16384 // s
            for causal in (False, True):
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                           for _ in range(3))
                do = torch.randn_like(q)
                flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)

                def fwd():
                    with torch.no_grad():
                        dt.flash_attention(q, k, v, causal=causal)

                def fwd_bwd():
                    o = dt.flash_attention(q, k, v, causal=causal)
                    torch.autograd.grad(o, (q, k, v), do)

                f, g = _time(fwd, kernel_time), _time(fwd_bwd, kernel_time)
                r = (round(flops / f / 1e9, 1), round(3.5 * flops / g / 1e9, 1))
                if kernel_time:
                    r += (round(2.5 * flops / (g - f) / 1e9, 1),)
                res[f"d{d} s{s} {'causal' if causal else 'full'}"] = r
                print(tag, f"d={d} s={s} causal={causal} fwd / fwd+bwd{' / bwd' if kernel_time else ''} TFLOP/s", r,
                      flush=True)
    with open(out, "w") as f:
        json.dump(dict(tree=tag, device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, kernel_time=kernel_time, tflops=res), f, indent=1)


if __name__ == "__main__":
    args = sys.argv[1:]
    for patch in (a for a in args if "=" in a):
        name, value = patch.split("=")
        if "[" in name:   # TABLE[head_dim]=BMxBNxWARPSxSTAGES: one tile of a plan table (e.g. WS_DQ_TILES)
            table, key = name.rstrip("]").split("[")
            assert isinstance(getattr(hopper, table, None), dict), f"no table {table} in dualattn.kernels.flash.hopper"
            getattr(hopper, table)[int(key)] = flash_plan.TileConfig(*(int(x) for x in value.split("x")))
            continue
        assert isinstance(getattr(hopper, name, None), int), f"no int constant {name} in dualattn.kernels.flash.hopper"
        setattr(hopper, name, int(value))
    positional = [a for a in args if "=" not in a and not a.startswith("--")]
    main(positional[0], positional[1], *(tuple(int(x) for x in arg.split(",")) for arg in positional[2:4]),
         kernel_time="--kernel-time" in args)
