"""Is the torch path host-bound on this GPU machine, and where does its host time go?  At S <= 2048
the torch path's TFLOP/s can move between runs while the JAX path, on the same kernel, does not:
this separates the kernel's time from the host's.  Per case, three figures:

- gpu: kernel time per call (CUDA events around calls queued behind a torch.cuda._sleep, so the
  GPU runs them back to back whatever the host does);
- issue: host time per call to enqueue them (the GPU is asleep meanwhile: no back-pressure);
- b2b: the bench's own figure (wall time of n back-to-back calls and one wait, / n).

If issue >= gpu the call is host-bound and b2b ~ issue.  Then cProfile of the issuing of one
case.  Run the torch cases again after JAX has run a large jitted step in the process (the
sweep's order), to see whether JAX's runtime threads slow the torch host path.

    python benchmarks/host_issue.py
    python benchmarks/host_issue.py --gpt-oss   only GPT-OSS's sliding layer (B=2, S=8192, H=32, D=64, window
                                                128 with sinks) fwd+bwd, and cProfile of issuing it
"""
import cProfile
import gc
import os
import pstats
import statistics
import time

import torch

import dualattn.torch_api as dt
from dualattn.bench.systems import import_jax

CASES = [  # (label, B, S, H, D, causal, mode)
    ("d128 causal fwd S=1024", 16, 1024, 16, 128, True, "fwd"),
    ("d128 causal fwd S=2048", 8, 2048, 16, 128, True, "fwd"),
    ("d128 full fwd S=1024", 16, 1024, 16, 128, False, "fwd"),
    ("d128 causal fwdbwd S=1024", 16, 1024, 16, 128, True, "fwdbwd"),
    ("d64 causal fwdbwd S=1024", 16, 1024, 32, 64, True, "fwdbwd"),
]
SLEEP_CYCLES = int(6e8)  # ~0.3 s at the H100's clock: longer than issuing N calls
N = 100


def make(B, S, H, D, causal, mode, **options):
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if mode == "fwd":
        def call():
            with torch.no_grad():
                return dt.flash_attention(q, k, v, causal=causal, **options)
        return call
    leaves = [t.requires_grad_() for t in (q, k, v)] + [t for t in options.values() if getattr(t, "requires_grad", 0)]
    return lambda: torch.autograd.grad(dt.flash_attention(*leaves[:3], causal=causal, **options), leaves, do)


def gpt_oss():
    """GPT-OSS's sliding layers: the torch path's gpu / issue / b2b figures and where the issue time goes."""
    sinks = torch.randn(32, device="cuda").requires_grad_()
    call = make(2, 8192, 32, 64, True, "fwdbwd", sliding_window=(127, 0), softmax_aux=sinks)
    report("d64 window128 sinks fwdbwd", call)
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    profile.enable()
    for _ in range(N):
        call()
    profile.disable()
    torch.cuda.synchronize()
    print(f"-- cProfile, {N} calls (times inflated by the profiler)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


def behind_sleep(call, n=N):
    """(gpu us per call, host issue us per call, host issue / sleep)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t_sleep = time.perf_counter()
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    issue = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    slept = time.perf_counter() - t_sleep
    return start.elapsed_time(end) * 1e3 / n, issue * 1e6 / n, issue / slept


def issue_times(call, n=N, profiler=None) -> list:
    """Host ms to issue each of n calls, queued behind a sleeping GPU (nothing the GPU does holds them back): the
    median is the host's steady cost, the outliers its hiccups (benchmarks/gpu_idle.py).  `profiler`: a
    cProfile.Profile enabled around the issuing."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    if profiler is not None:
        profiler.enable()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    if profiler is not None:
        profiler.disable()
    torch.cuda.synchronize()
    return times


def back_to_back(call, n=N):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / n


def report(label, call, rounds=5):
    call(); call()
    rows = [behind_sleep(call) for _ in range(rounds)]
    b2b = [back_to_back(call) for _ in range(rounds)]
    gpu = statistics.median(r[0] for r in rows)
    issue = [r[1] for r in rows]
    worst = max(r[2] for r in rows)
    print(f"{label:28s} gpu {gpu:7.1f} us | issue median {statistics.median(issue):6.1f} "
          f"min {min(issue):6.1f} max {max(issue):6.1f} us (issue/sleep <= {worst:.2f}) | "
          f"b2b median {statistics.median(b2b):7.1f} min {min(b2b):7.1f} max {max(b2b):7.1f} us", flush=True)


def main():
    print(f"cpus {os.cpu_count()}, torch threads {torch.get_num_threads()}, "
          f"{open('/proc/cpuinfo').read().split('model name')[1].split(chr(10))[0].strip(': ')}", flush=True)
    calls = {c[0]: make(*c[1:]) for c in CASES}
    print("-- torch alone", flush=True)
    for label, call in calls.items():
        report(label, call)
    print("-- gc disabled", flush=True)
    gc.disable()
    for label in list(calls)[:2]:
        report(label, calls[label])
    gc.enable()

    print("-- after a JAX jitted fwd+bwd in this process (the sweep's order)", flush=True)
    jax = import_jax()
    from dualattn.jax_api import flash_attention as jfa
    x = jax.numpy.ones((2, 8192, 16, 128), jax.numpy.bfloat16)
    step = jax.jit(jax.grad(lambda q: jfa(q, q, q, causal=True).astype(jax.numpy.float32).sum()))
    for _ in range(20):
        step(x).block_until_ready()
    for label, call in calls.items():
        report(label, call)
    # the JAX path's own issue time on the S=2048 forward, for comparison (async dispatch)
    jq = jax.numpy.ones((8, 2048, 16, 128), jax.numpy.bfloat16)
    jf = jax.jit(lambda q: jfa(q, q, q, causal=True))
    jf(jq).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(N):
        out = jf(jq)
    issue = (time.perf_counter() - t0) * 1e6 / N
    out.block_until_ready()
    print(f"jax-triton causal fwd S=2048: issue {issue:.1f} us per call (GPU not asleep: may include waiting)")

    label = "d128 causal fwd S=2048"
    profile = cProfile.Profile()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    profile.enable()
    for _ in range(N):
        calls[label]()
    profile.disable()
    torch.cuda.synchronize()
    print(f"-- cProfile, {N} calls of {label} (times inflated by the profiler)")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    import sys
    gpt_oss() if "--gpt-oss" in sys.argv[1:] else main()
