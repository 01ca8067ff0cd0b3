"""Where the torch path's fwd+bwd host time goes when the graph is fresh each call (B=1, S=128).

    python benchmarks/experiments/host_split.py

host_overhead.py measured fwd+bwd ~0.84-0.98 ms per call while the forward with grad (~0.2-0.29
ms) and autograd.grad on a kept graph (~0.29 ms) add up to ~0.5 ms.  This times the two halves
inside one loop, a custom Function that does nothing (the autograd engine's own cost on CUDA),
and SDPA, so the missing time can be placed.
"""
import threading
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


def split_us(forward, q, k, v, do, n=2000):
    """(forward, backward) host time per call, timed inside one fwd+bwd loop."""
    tf = tb = 0.0
    for i in range(n + 50):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        torch.autograd.grad(out, (q, k, v), do)
        t2 = time.perf_counter()
        if i >= 50:
            tf += t1 - t0
            tb += t2 - t1
    torch.cuda.synchronize()
    return tf / n * 1e6, tb / n * 1e6


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return q.new_empty(q.shape)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout


def main():
    q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)

    systems = {"dualattn": lambda: dt.flash_attention(q, k, v, causal=True), "sdpa-cudnn": sdpa,
               "empty Function": lambda: _Nothing.apply(q, k, v)}
    for name, f in systems.items():
        fwd, bwd = split_us(f, q, k, v, do)
        both = per_call_us(lambda: torch.autograd.grad(f(), (q, k, v), do))
        print(f"{name:16s} fwd {fwd:6.1f}  bwd {bwd:6.1f}  (sum {fwd + bwd:6.1f})  fwd+bwd loop {both:6.1f} us",
              flush=True)
    print("autograd backward thread:", end=" ")
    seen = []

    class _Where(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q):
            return q.clone()

        @staticmethod
        def backward(ctx, d):
            seen.append(threading.current_thread().name)
            return d
    torch.autograd.grad(_Where.apply(q), q, do)
    print(seen, "main" if seen[0] == threading.main_thread().name else "worker")


if __name__ == "__main__":
    main()
