"""Where NSA's forward spends its time, and a sweep of the block selection's two kernels on the GPU.

For each (T, group) of PROBLEMS (bf16, D = 128, Hkv = 4, block 64, 16 blocks, window 512):
* a torch.profiler kernel breakdown of one whole NSA forward (no gradients);
* kernels/nsa/plan.importance_tiles replaced per IMPORTANCE_VARIANTS entry (rows per program, pooled
  blocks per step, warps, stages): the importance kernel alone, timed on the compressed branch's own
  lse, its scores compared with the plan's and the top-k they give compared index for index;
* kernels/nsa/plan.topk_tiles replaced per TOPK_VARIANTS entry (rows per program, warps): the
  top-k kernel alone on the plan's scores, indices compared with the plan's.
--profile: only the kernel breakdowns, of one whole NSA forward and of one forward + backward.

    python benchmarks/tune_nsa_select.py OUT.json
    python benchmarks/tune_nsa_select.py --profile
    python benchmarks/tune_nsa_select.py --registers     (no GPU needed: ptxas's registers and spills of
                                                          the plan's importance, top-k and gate kernels)
"""
import json
import sys

import triton

from dualattn.kernels.launch import forget_plans
from dualattn.kernels.nsa import plan as nsa_plan

# (rows per program, pooled blocks per step, num_warps, num_stages); None: the plan's own
IMPORTANCE_VARIANTS = [None, (16, 64, 4, 2), (32, 64, 4, 2), (64, 64, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2),
                       (128, 32, 8, 2), (64, 128, 8, 2), (128, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)]
# (rows per program, num_warps); None: the plan's own
TOPK_VARIANTS = [None, (1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 4), (8, 4), (8, 8), (16, 8)]
PROBLEMS = ((65536, 16), (65536, 4), (8192, 16))   # (T, group)


def importance_of(variant, plan_tiles):
    if variant is None:
        return plan_tiles

    def tiles(shapes):
        rows, block_c, warps, stages = variant
        return nsa_plan.ImportanceTiles(max(1, rows // triton.next_power_of_2(shapes.group_size)), block_c, warps,
                                        stages)
    return tiles


def topk_of(variant, plan_tiles):
    return plan_tiles if variant is None else (lambda block_nb: variant)


def sweep(seqlen, group, profile_only=False, heads_kv=4, head_dim=128, block_size=64, count=16):
    import torch
    from torch.profiler import ProfilerActivity, profile
    import dualattn.torch_api as dt
    from dualattn.torch_api import _launch
    from dualattn.torch_api.nsa import _compressed
    gen = torch.Generator(device="cpu").manual_seed(0)
    heads_q = heads_kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_(profile_only)
    q, k, v = rand(1, seqlen, heads_q, head_dim), rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv,
                                                                                             head_dim)
    gates = [torch.rand(1, seqlen, heads_q, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    scale = head_dim ** -0.5

    def nsa_forward():
        return dt.native_sparse_attention(q, k, v, *gates, block_counts=count, block_size=block_size,
                                          window_size=512)
    def breakdown(what, fn, row_limit):
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"## T {seqlen} group {group}: one NSA {what}, kernels by CUDA time", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=row_limit), flush=True)
    breakdown("forward", nsa_forward, 16)
    if profile_only:
        dout = torch.randn(1, seqlen, heads_q, head_dim, generator=gen).to("cuda", torch.bfloat16)
        breakdown("forward + backward", lambda: torch.autograd.grad(nsa_forward(), (q, k, v), dout), 24)
        return []
    whole_ms = triton.testing.do_bench(nsa_forward, warmup=5, rep=50, return_mode="median")
    print(f"whole NSA forward {whole_ms:.2f} ms", flush=True)
    rows = [dict(seqlen=seqlen, group=group, kernel="whole forward", ms=whole_ms)]

    _, lse, k_cmp = _compressed(q, k, v, block_size, scale)
    lse = lse.float().contiguous()
    plan_importance, plan_topk = nsa_plan.importance_tiles, nsa_plan.topk_tiles

    def scores_of():
        launch = nsa_plan.plan_importance(1, seqlen, heads_q, heads_kv, head_dim, block_size, "bfloat16", scale)
        return launch, dict(query=q, k_cmp=k_cmp.contiguous(), lse=lse)

    def top_of(scores):
        launch = nsa_plan.plan_topk(seqlen * heads_kv, scores.shape[-1], count)
        return _launch.run(launch, dict(scores=scores))["indices"]

    launch, inputs = scores_of()
    ref_scores = _launch.run(launch, inputs)["scores"]
    ref_idx = top_of(ref_scores)
    finite = torch.isfinite(ref_scores)
    for variant in IMPORTANCE_VARIANTS:
        nsa_plan.importance_tiles = importance_of(variant, plan_importance)
        forget_plans()   # the memoised plans were built with the old one
        try:
            launch, inputs = scores_of()
            scores = _launch.run(launch, inputs)["scores"]
            torch.cuda.synchronize()
            same_inf = bool(torch.equal(torch.isfinite(scores), finite))
            diff = float((scores[finite] - ref_scores[finite]).abs().max())
            idx_equal = float((top_of(scores) == ref_idx).float().mean())
            ms = triton.testing.do_bench(lambda: _launch.run(launch, inputs), warmup=5, rep=50, return_mode="median")
        except Exception as e:  # a variant that fails to compile or launch is reported, not fatal
            ms, diff, same_inf, idx_equal = None, f"{type(e).__name__}: {e}"[:200], None, None
        rows.append(dict(seqlen=seqlen, group=group, kernel="importance", variant=variant, ms=ms,
                         max_score_diff=diff, same_infinities=same_inf, topk_equal_fraction=idx_equal))
        print(rows[-1], flush=True)
    nsa_plan.importance_tiles = plan_importance
    forget_plans()   # the memoised plans were built with the old one
    for variant in TOPK_VARIANTS:
        nsa_plan.topk_tiles = topk_of(variant, plan_topk)
        forget_plans()   # the memoised plans were built with the old one
        try:
            idx = top_of(ref_scores)
            torch.cuda.synchronize()
            equal = bool(torch.equal(idx, ref_idx))
            ms = triton.testing.do_bench(lambda: top_of(ref_scores), warmup=5, rep=50, return_mode="median")
        except Exception as e:
            ms, equal = None, f"{type(e).__name__}: {e}"[:200]
        rows.append(dict(seqlen=seqlen, group=group, kernel="topk", variant=variant, ms=ms, indices_equal=equal))
        print(rows[-1], flush=True)
    nsa_plan.topk_tiles = plan_topk
    forget_plans()   # the memoised plans were built with the old one
    return rows


# (dtype, D, group) of the importance kernels --registers compiles
REGISTER_SHAPES = [("bfloat16", 128, 16), ("bfloat16", 128, 4), ("bfloat16", 128, 2), ("bfloat16", 128, 1),
                   ("float32", 128, 16), ("float32", 128, 1), ("float32", 256, 8), ("bfloat16", 256, 16),
                   ("bfloat16", 256, 1), ("float16", 64, 2), ("float16", 64, 32)]


def registers():
    from dualattn.kernels import compile_check
    print("# python benchmarks/tune_nsa_select.py --registers (T 8192, Hkv 4, block 64; sm_90, sm_80)")

    def usage(launch, dtypes):
        return "  ".join("sm_%d %d registers, %d bytes spilled" % ((arch,) + compile_check.ptxas_usage(
            compile_check.compile_launch(launch, dtypes, arch=arch), arch)) for arch in (90, 80))
    for dtype, d, group in REGISTER_SHAPES:
        launch = nsa_plan.plan_importance(1, 8192, 4 * group, 4, d, 64, dtype, d ** -0.5)
        print(f"importance {dtype:8s} D {d:3d} group {group:2d} tokens {launch.constexpr_dict['TOKENS']:3d}  "
              + usage(launch, dict(query=dtype, k_cmp=dtype, lse="float32")), flush=True)
    for blocks in (128, 1024, 4096, 32768):
        launch = nsa_plan.plan_topk(4 * 65536, blocks, 16)
        print(f"top-k {blocks:5d} blocks, {launch.num_warps:2d} warps  " + usage(launch, dict(scores="float32")),
              flush=True)
    for backward in (False, True):
        launch = (nsa_plan.plan_gates_backward if backward else nsa_plan.plan_gates)(1 << 20, 128, 3)
        dtypes = {**{f"o{i}": "bfloat16" for i in range(3)}, **{f"g{i}": "bfloat16" for i in range(3)}}
        dtypes.update(dict(dout="bfloat16") if backward else {})
        print(f"gates{' backward' if backward else ''}, 3 branches, D 128  " + usage(launch, dtypes), flush=True)


def main(out_path):
    if out_path == "--registers":
        return registers()
    import torch
    rows = []
    for seqlen, group in PROBLEMS:
        rows += sweep(seqlen, group, profile_only=out_path == "--profile")
        torch.cuda.empty_cache()
    if out_path == "--profile":
        return
    with open(out_path, "w") as f:
        json.dump(dict(command="python benchmarks/tune_nsa_select.py " + out_path, device=torch.cuda.get_device_name(),
                       versions=dict(torch=torch.__version__, triton=triton.__version__),
                       importance_variant_fields="(rows per program, pooled blocks per step, num_warps, num_stages)",
                       topk_variant_fields="(rows per program, num_warps)", none="the plan's tiles",
                       rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[-1])
