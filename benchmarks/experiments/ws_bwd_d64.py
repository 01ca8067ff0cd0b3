"""Does a warp-specialised backward pay at D=64 with other tiles, or with a band, than step 20
tried?  Backward time (autograd.grad on a kept graph) of the torch path at D=64, 16k tokens,
H=32, for the portable kernels and warp-specialised dK/dV and dQ tiles set through
plan.WS_DKDV_TILES / plan.WS_DQ_TILES.  Rounds alternate the variants.

    PYTHONPATH=$PWD python benchmarks/experiments/ws_bwd_d64.py

(benchmarks/results/2026-11-23_h100_ws_bwd_d64.log; NOTES step 23.)
"""
import torch
import triton

import dualattn.torch_api as dt
from dualattn.kernels.flash import plan as flash_plan

# name: (dK/dV tile, dQ tile), None = portable
VARIANTS = {"portable": (None, None), "dkdv 64x128/4/2": ((64, 128, 4, 2), None),
            "dkdv 64x128/4/3": ((64, 128, 4, 3), None), "dkdv 128x128/4/2": ((128, 128, 4, 2), None),
            "+dq 128x128/4/2": ((64, 128, 4, 2), (128, 128, 4, 2)), "+dq 128x64/4/2": ((64, 128, 4, 2), (128, 64, 4, 2)),
            "+dq 128x64/4/3": ((64, 128, 4, 2), (128, 64, 4, 3))}
H, D = 32, 64

for s in (4096, 16384):
    b = 16384 // s
    q, k, v, do = (torch.randn(b, s, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4))
    for causal in (False, True):
        flops = 2.5 * 4 * b * H * s * s * D / (2 if causal else 1)
        ref = None
        for rnd in range(2):
            for name, tiles in VARIANTS.items():
                dkdv, dq = tiles
                for table, tile in ((flash_plan.WS_DKDV_TILES, dkdv), (flash_plan.WS_DKDV_BANDED_OR_PERSISTENT_TILES, dkdv),
                                    (flash_plan.WS_DQ_TILES, dq)):
                    table.pop(64, None)
                    if tile is not None:
                        table[64] = flash_plan.TileConfig(*tile)
                flash_plan.forget_plans()
                seen = []
                real = flash_plan.plan_backward

                def spy(*a, **kw):
                    p = real(*a, **kw)
                    seen.append((p.dkdv.constexpr_dict["WARP_SPECIALIZE"], p.dq.constexpr_dict["WARP_SPECIALIZE"]))
                    return p
                flash_plan.plan_backward = spy
                out = dt.flash_attention(q, k, v, causal=causal)
                grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                flash_plan.plan_backward = real
                if ref is None:
                    ref = grads
                err = max(((g.float() - r.float()).norm() / r.float().norm()).item() for g, r in zip(grads, ref))
                ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                             warmup=10, rep=300, return_mode="median")
                print(f"S={s} causal={int(causal)} round {rnd} {name:17s} ws(dkdv,dq)={seen[-1]!s:13s} bwd {ms:.3f} ms "
                      f"{flops / ms / 1e9:.0f} TFLOP/s  rel.diff vs portable {err:.1e}", flush=True)
