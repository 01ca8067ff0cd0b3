"""Sweep of the NSA dK / dV pass's tiles on the GPU: kernels/nsa/plan.dkv_tiles replaced per variant
(keys per program, rows per step, warps, stages), the selected branch's fwd + bwd timed on the indices
its own NSA chose (bf16, D = 128, Hkv = 4, block 64, 16 blocks), dK / dV compared with the plan's, and
a torch.profiler kernel breakdown of one fwd + bwd at T = 64k.  --registers (no GPU needed): each
variant compiled for sm_90 and sm_80 at the shapes of tests/test_nsa_compile.py, with ptxas's
registers and spill stores.

    python benchmarks/tune_nsa_dkv.py OUT.json
    python benchmarks/tune_nsa_dkv.py --registers

`results/2026-11-27_h200_nsa_dkv_sweep.*` ran the timing when the plan's tiles were 64 keys, 32 rows,
8 warps (the variant None there; VARIANTS now names those tiles too); the plan now takes 32 keys, 32
rows on 4 warps (kernels/nsa/plan.dkv_tiles).
"""
import json
import os
import sys

import triton

from dualattn.kernels import compile_check
from dualattn.kernels.launch import forget_plans
from dualattn.kernels.nsa import plan as nsa_plan

# (keys per program, rows per step, num_warps, num_stages); None: the plan's own
VARIANTS = [None, (64, 32, 8, 2), (32, 64, 4, 2), (32, 64, 8, 2), (32, 32, 4, 2), (64, 32, 8, 3), (32, 128, 8, 2),
            (64, 64, 8, 2), (32, 64, 4, 3), (64, 32, 4, 2)]
PROBLEMS = ((65536, 16), (65536, 4), (8192, 16))   # (T, group)
REGISTER_VARIANTS = [None, (64, 32, 8, 2), (64, 32, 4, 2), (32, 64, 4, 2)]


def tiles_of(variant, plan_tiles):
    if variant is None:
        return plan_tiles
    block_n, rows, warps, stages = variant

    def tiles(shapes):
        t = plan_tiles(shapes)
        return nsa_plan.NsaTiles(t.group_pad, max(1, rows // t.group_pad), min(block_n, shapes.block_size), warps,
                                 stages)
    return tiles


def sweep(seqlen, group, plan_tiles, heads_kv=4, head_dim=128):
    import torch
    from torch.profiler import ProfilerActivity, profile
    import dualattn.torch_api as dt
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    q, k, v = rand(1, seqlen, heads_kv * group, head_dim), rand(1, seqlen, heads_kv, head_dim), \
        rand(1, seqlen, heads_kv, head_dim)
    gates = [torch.rand(1, seqlen, heads_kv * group, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    dout = torch.randn(1, seqlen, heads_kv * group, head_dim, generator=gen).to("cuda", torch.bfloat16)
    with torch.no_grad():
        _, idx = dt.native_sparse_attention(q, k, v, *gates, block_counts=16, block_size=64, window_size=512,
                                            return_block_indices=True)

    def fwdbwd():
        return torch.autograd.grad(dt.apply_native_sparse_attention(q, k, v, idx, 16, 64), (q, k, v), dout)
    rows, ref = [], None
    for variant in VARIANTS:
        nsa_plan.dkv_tiles = tiles_of(variant, plan_tiles)
        forget_plans()   # the memoised plans were built with the old one
        try:
            grads = fwdbwd()
            torch.cuda.synchronize()
            diff = 0.0 if ref is None else max(float((a.float() - b.float()).abs().max())
                                               for a, b in zip(grads[1:], ref[1:]))
            ref = grads if ref is None else ref
            ms = triton.testing.do_bench(fwdbwd, warmup=5, rep=30, return_mode="median")
        except Exception as e:  # a variant that fails to compile or launch is reported, not fatal
            ms, diff = None, f"{type(e).__name__}: {e}"[:200]
        rows.append(dict(seqlen=seqlen, group=group, variant=variant, fwdbwd_ms=ms, max_dkdv_diff_vs_default=diff))
        print(rows[-1], flush=True)
    nsa_plan.dkv_tiles = plan_tiles
    forget_plans()   # the memoised plans were built with the old one
    if seqlen == 65536:
        fwdbwd()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwdbwd()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    return rows


def registers(plan_tiles):
    """ptxas's registers and spill stores of each variant's dK / dV kernel, for sm_90 and sm_80."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from test_nsa_compile import VARIANTS as SHAPES, _launch
    print("# python benchmarks/tune_nsa_dkv.py --registers (variant: keys, rows, warps, stages; None: the plan's)")
    for variant in REGISTER_VARIANTS:
        nsa_plan.dkv_tiles = tiles_of(variant, plan_tiles)
        forget_plans()   # the memoised plans were built with the old one
        for name, shape in SHAPES.items():
            for arch in (90, 80):
                launch, dtypes = _launch("bwd-dkv", *shape)
                regs, spills = compile_check.ptxas_usage(compile_check.compile_launch(launch, dtypes, arch=arch), arch)
                print(f"{str(variant):16s} {name:26s} sm_{arch} keys {launch.constexpr_dict['BLOCK_N']:3d} "
                      f"warps {launch.num_warps} registers {regs} spill stores {spills} bytes", flush=True)
    nsa_plan.dkv_tiles = plan_tiles
    forget_plans()   # the memoised plans were built with the old one


def main(out_path):
    plan_tiles = nsa_plan.dkv_tiles
    if out_path == "--registers":
        return registers(plan_tiles)
    import torch
    rows = []
    for seqlen, group in PROBLEMS:
        rows += sweep(seqlen, group, plan_tiles)
        torch.cuda.empty_cache()
    with open(out_path, "w") as f:
        json.dump(dict(command="python benchmarks/tune_nsa_dkv.py " + out_path, device=torch.cuda.get_device_name(),
                       versions=dict(torch=torch.__version__, triton=triton.__version__),
                       variant_fields="(block_n keys per program, rows per step, num_warps, num_stages); "
                                      "None = the plan's tiles",
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
