"""Is the torch path host-bound at S=1024?  Kernel time (CUDA graph, profiler) against back-to-back
wall time and host issue time per call, next to the JAX path, for the causal D=128 forward.

    PYTHONPATH=$PWD python benchmarks/experiments/host_bound_check.py

(benchmarks/results/2026-11-22_h100_host_bound_s1024.log; NOTES step 21.)
"""
import torch, triton, time
import dualattn.torch_api as dt
from dualattn.kernels.flash import plan as fp
B, S, H, D = 16, 1024, 16, 128
q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
flops = 4 * B * H * S * S * D / 2
seen = []
real = fp.plan_forward
def spy(*a, **kw):
    l = real(*a, **kw); seen.append((l.grid, l.constexpr_dict["BLOCK_M"], l.constexpr_dict["BLOCK_N"], l.num_warps, l.num_stages, l.constexpr_dict["WARP_SPECIALIZE"])); return l
fp.plan_forward = spy
with torch.no_grad():
    f = lambda: dt.flash_attention(q, k, v, causal=True)
    f(); print("plan", seen[-1])
    t_b2b = triton.testing.do_bench(f, warmup=50, rep=300, return_mode="median")
    t_graph = triton.testing.do_bench_cudagraph(f, rep=300, return_mode="median")
    torch.cuda.synchronize(); n = 500; t0 = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - t0) / n * 1e3; torch.cuda.synchronize()
    print(f"torch causal fwd: back-to-back {t_b2b:.3f} ms ({flops/t_b2b/1e9:.0f} TFLOP/s), cuda graph {t_graph:.3f} ms ({flops/t_graph/1e9:.0f}), host issue {host:.3f} ms/call")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(20): f()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=6))
import jax, jax.numpy as jnp
import dualattn.jax_api as dj
qj, kj, vj = (jnp.asarray(x.float().cpu().numpy(), dtype=jnp.bfloat16) for x in (q, k, v))
g = jax.jit(lambda a, b, c: dj.flash_attention(a, b, c, causal=True))
g(qj, kj, vj).block_until_ready()
for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(200): o = g(qj, kj, vj)
    o.block_until_ready(); tj = (time.perf_counter() - t0) / 200 * 1e3
    print(f"jax causal fwd back-to-back {tj:.3f} ms ({flops/tj/1e9:.0f} TFLOP/s)")
