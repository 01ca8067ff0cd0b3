"""Same kernel, two launchers: device time of the flash forward kernels launched by torch and
by JAX (jax-triton) on the same buffers, from the profiler (CUPTI sees both), alternating
rounds.  Tells a slower JAX figure in the sweep apart: the kernel (e.g. another ptxas build)
or the host and launch path.

    python benchmarks/jax_torch_kernel_time.py
"""
import jax
import torch
from torch.profiler import ProfilerActivity, profile

import dualattn.jax_api as dj
import dualattn.torch_api as dt

SHAPES = [(1, 16384, 32, 64), (2, 8192, 32, 64), (4, 4096, 32, 64), (1, 16384, 16, 128)]


def kernel_ms(fn, n=50):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if "flash_fwd" in e.name and e.device_time > 0]
    return sum(times) / n / 1e3, len(times) // n


for b, s, h, d in SHAPES:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    jq, jk, jv = (jax.dlpack.from_dlpack(t) for t in (q, k, v))
    jf = jax.jit(lambda a, b_, c: dj.flash_attention(a, b_, c, backend="triton"))
    paths = {"torch": lambda: dt.flash_attention(q, k, v),
             "jax": lambda: jf(jq, jk, jv).block_until_ready()}
    flops = 4 * b * h * s * s * d
    with torch.no_grad():
        for rnd in range(2):
            for name, fn in paths.items():
                kms, launches = kernel_ms(fn)
                print(f"B={b} S={s} H={h} D={d} round {rnd} {name:5s}: kernel {kms:.3f} ms "
                      f"({flops / kms / 1e9:.0f} TFLOP/s, {launches} launch/call)", flush=True)
