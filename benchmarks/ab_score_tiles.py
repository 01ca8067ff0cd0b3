"""The Gluon forward's bias and mask tiles held once or twice per warpgroup (hopper.gluon_score_buffers):
forward kernel time (torch.profiler) of flash_attention with a (B, H, S, S) bool mask, a bf16 bias, both,
and neither, B = 2, S = 4096, D = 128 (H = 16) and 64 (H = 32), non-causal and causal.

    python benchmarks/ab_score_tiles.py [DxH ...]   other head dims and head counts, e.g. 256x8 96x16
"""
import sys

import torch
from score_option_times import B, S, SHAPES, score_cases

import dualattn.torch_api as dt
from dualattn.bench.flash import kernel_times
from dualattn.kernels.flash import plan


def main():
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; forward kernel ms, B={B}, S={S}")
    auto = plan.gluon_score_buffers
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [tuple(int(x) for x in arg.split("x")) for arg in sys.argv[1:]] or SHAPES
    for D, H in shapes:
        q, k, v, _, cases = score_cases(D, H, gen)
        for causal in (False, True):
            for name, kw in cases.items():
                row = []
                for label, rule in (("auto", auto), ("one", lambda shapes: 1)):
                    plan.gluon_score_buffers = rule
                    plan.forget_plans()
                    with torch.no_grad():
                        outs = []
                        for _ in range(2):   # the second round is printed: compiled and warm
                            table = kernel_times(lambda: outs.append(dt.flash_attention(q, k, v, causal=causal, **kw)),
                                                 calls=10, width=40)
                    row.append((label, sum(table.values()), sorted(table), outs[-1]))
                plan.gluon_score_buffers = auto
                same = torch.equal(row[0][3], row[1][3])
                times = "  ".join(f"{label} {ms:.4f} ms" for label, ms, _, _ in row)
                print(f"D={D} causal={causal} {name:10s} {times}  same output {same}  {row[0][2]}", flush=True)
    plan.forget_plans()


if __name__ == "__main__":
    main()
