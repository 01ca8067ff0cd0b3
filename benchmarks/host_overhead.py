"""Host time per call of the torch path, next to SDPA, on a problem too small to keep the GPU busy.

    python benchmarks/host_overhead.py [--profile out.txt]

At B=1, S=128, H=2, D=64 each kernel runs for a few microseconds, so back-to-back calls are
limited by the Python/C++ work that issues them: the wall time per call is the host time.
--profile writes cProfile's top functions of dualattn's fwd+bwd (where that time goes).
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dualattn.torch_api as dt


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile")
    args = ap.parse_args()
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def fwd_bwd(f):
        def run():
            torch.autograd.grad(f(), (q, k, v), do)
        return run

    systems = {"dualattn": lambda: dt.flash_attention(q, k, v, causal=True)}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
        systems[name] = sdpa
    for name, f in systems.items():
        with torch.no_grad():
            fwd = per_call_us(f)
        both = per_call_us(fwd_bwd(f))
        print(f"{name:12s} host us/call: fwd {fwd:6.1f}   fwd+bwd {both:6.1f}", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        run = fwd_bwd(systems["dualattn"])
        prof.enable()
        for _ in range(500):
            run()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
        with open(args.profile, "w") as f:
            f.write(s.getvalue())
        print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
