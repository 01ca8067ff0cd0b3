"""Where the one-pass backward's time goes: per-kernel CUDA time of dualattn's torch backward with the
one-pass Gluon kernel and with the two-pass kernels (DUALATTN_ONE_PASS=0), next to the probe's kernel
(gluon_bwd_probe.py, host descriptors) on the same inputs.  16k tokens, bf16, H100.

    python benchmarks/experiments/one_pass_profile.py [--shapes 128:1024,128:4096,64:1024] [--causal both]
"""
import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def kernel_times(fn, iters=10):
    """{kernel name: mean CUDA ms per call of fn} and the mean wall ms per call (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count >= iters:
            times[e.key[:60]] = t / iters / 1000
    return times, wall_ms(fn, iters)


def wall_ms(fn, iters):
    """Mean wall ms per call of fn over `iters` back-to-back calls (CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def backward_problems(shapes: str, causal: str):
    """(d, s, b, h, causal, q, k, v, do, backward flops) for each "d:s" of `shapes` and each causal
    setting of `causal` ("both", "true", "false"): 16k tokens, 16 heads at D=128 and 32 at D=64
    (the sweep's shapes), bf16, seeded."""
    for item in shapes.split(","):
        d, s = (int(x) for x in item.split(":"))
        h = 16 if d == 128 else 32
        b = 16384 // s
        for c in {"both": (False, True), "true": (True,), "false": (False,)}[causal]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                           for _ in range(4))
            yield d, s, b, h, c, q, k, v, do, 2.5 * 4 * b * h * s * s * d / (2 if c else 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:1024,128:4096,64:1024,64:8192")
    ap.add_argument("--causal", default="both")
    args = ap.parse_args()
    from dualattn.torch_api import flash_attention
    import gluon_bwd_probe as probe
    probe_variant = {128: probe.VARIANTS[4], 64: probe.VARIANTS[2]}
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for d, s, b, h, causal, q, k, v, do, flops in backward_problems(args.shapes, args.causal):
        rows = {}
        for name, flag in (("one-pass", "1"), ("two-pass", "0")):
            os.environ["DUALATTN_ONE_PASS"] = flag
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out = flash_attention(*leaves, causal=causal)
            rows[name] = kernel_times(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
        lse, o = probe._lse_and_o(q, k, v, causal)
        run = probe.make_launcher(probe_variant[d], q, k, v, do, lse, probe._delta(o, do), causal)
        rows["probe"] = kernel_times(run)
        print(f"\nD={d} S={s} B={b} H={h} causal={causal}: backward, TFLOP/s from the wall time", flush=True)
        for name, (times, wall) in rows.items():
            print(f"  {name:9s} wall {wall:7.3f} ms  {flops / wall / 1e9:6.0f} TFLOP/s  kernels "
                  f"{sum(times.values()):7.3f} ms", flush=True)
            for kname, ms in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"      {ms:7.3f} ms  {kname}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
