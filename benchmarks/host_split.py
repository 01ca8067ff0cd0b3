"""Where the torch path's host time goes in one GPT-OSS sliding layer (B = 2, S = 8192, H = 32, D = 64, window
128 with sinks) fwd+bwd: calls issued behind a sleeping GPU, the front end's functions wrapped with wall-clock
timers (no cProfile, whose overhead inflates small calls).  The rest of a call is autograd's.

    python benchmarks/host_split.py
"""
import collections
import functools
import time

import torch

import dualattn.torch_api as dt
from dualattn.torch_api import _launch, flash

TOTAL = collections.defaultdict(float)
COUNT = collections.Counter()
N = 50


def timed(module, name: str, label: str = None) -> None:
    """Replace module.name by a wrapper adding its wall time to TOTAL[label]."""
    fn, label = getattr(module, name), label or name

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL[label] += time.perf_counter() - t0
            COUNT[label] += 1
    setattr(module, name, wrapper)


def main():
    for name in ("_backward", "_forward", "_problem", "_call"):
        timed(flash, name)
    timed(_launch, "_launch_cached")
    timed(_launch, "run", "launch.run")
    B, S, H, D = 2, 8192, 32, 64
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sinks = torch.randn(H, device="cuda").requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sinks]

    def call():
        out = dt.flash_attention(*leaves[:3], causal=True, sliding_window=(127, 0), softmax_aux=sinks)
        return torch.autograd.grad(out, leaves, do)
    for _ in range(5):
        call()
    for round_ in range(2):
        TOTAL.clear()
        COUNT.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(int(6e8))   # the GPU asleep: no back-pressure on the host
        t0 = time.perf_counter()
        for _ in range(N):
            call()
        total = time.perf_counter() - t0
        torch.cuda.synchronize()
        print(f"round {round_}: fwd+bwd issue {1e6 * total / N:.1f} us/call")
        for label in sorted(TOTAL, key=lambda x: -TOTAL[x]):
            print(f"   {label:16s} {1e6 * TOTAL[label] / N:8.1f} us/call  ({COUNT[label] // N} calls each)")
    print([p.launch.kernel for p in _launch._COMPILED.values()])


if __name__ == "__main__":
    main()
