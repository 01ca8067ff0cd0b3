"""A/B two source trees of dualattn on the GPU: the tree imported is the one PYTHONPATH names.

    git worktree add /tmp/base HEAD        # or a copy with one change applied
    for t in /tmp/base $PWD /tmp/base $PWD; do PYTHONPATH=$t python benchmarks/ab_trees.py $(basename $t) out_$(basename $t).json; done

Times the torch path's forward and forward+backward (do_bench medians, TFLOP/s) at D=128 (H=16) and
D=64 (H=32) (or the comma-separated fourth argument's head dims), 16k tokens, S = 2048 and 8192 (or the
comma-separated third argument), causal and not.  Alternate the trees: the spread between
rounds of one tree (a few % at S=2048) is the noise any difference must beat (benchmarks/NOTES.md).
"""
import json
import sys

import torch
import triton

import dualattn
import dualattn.torch_api as dt


def main(tag: str, out: str, seqlens=(2048, 8192), head_dims=(128, 64)):
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

                def fwd_bwd():
                    o = dt.flash_attention(q, k, v, causal=causal)
                    torch.autograd.grad(o, (q, k, v), do)

                with torch.no_grad():
                    f = triton.testing.do_bench(lambda: dt.flash_attention(q, k, v, causal=causal), warmup=25,
                                                rep=150, return_mode="median")
                g = triton.testing.do_bench(fwd_bwd, warmup=25, rep=150, return_mode="median")
                r = (round(flops / f / 1e9, 1), round(3.5 * flops / g / 1e9, 1))
                res[f"d{d} s{s} {'causal' if causal else 'full'}"] = r
                print(tag, f"d={d} s={s} causal={causal} fwd / fwd+bwd TFLOP/s", r, flush=True)
    with open(out, "w") as f:
        json.dump(dict(tree=tag, device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, tflops=res), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(tuple(int(x) for x in arg.split(",")) for arg in sys.argv[3:5]))
