"""Where the GPU waits during back-to-back torch calls of an options case: the wall time per call against the GPU's
busy time, and each idle gap between two kernels, named by the kernel that ends it and by whether the host had
launched that kernel before the GPU went idle (no: the host was late) or not (the GPU waited on something else).
Blocking CUDA runtime calls (synchronisations, pageable copies) are listed with their time per call, and the host's
time to issue a call with the GPU asleep (no back-pressure): a call is host-bound where that exceeds its GPU time.

    python benchmarks/gpu_idle.py docs_varlen,docs [fwd|fwdbwd] [--profile]   (--profile: cProfile of issuing the calls)

torch.profiler records host ops, runtime calls and kernels of `CALLS` back-to-back calls of the same step that
`python -m dualattn.bench --cases ...` times; the trace's correlation ids tie each kernel to its launch.
"""
import collections
import cProfile
import gc
import json
import os
import pstats
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

from dualattn.bench.flash import throughput_ms
from dualattn.bench.options import CASES, dualattn_torch, make_problem
from dualattn.bench.systems import TorchFrontEnd
from host_issue import issue_times   # (benchmarks/, the script's folder, is on sys.path)

CALLS = 20
GPU_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")
BLOCKING = ("Synchronize", "cudaMemcpy ", "cudaMemcpy2D ", "cudaStreamWaitEvent")


def trace_events(step) -> list:
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = None
        for _ in range(CALLS):
            out = step.launch()
        step.sync(out)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def issue_report(step, label: str) -> None:
    times = sorted(issue_times(step.launch))
    median = times[len(times) // 2]
    slow = [t for t in times if t > 2 * median]
    print(f"  host ms to issue a call, GPU asleep{label}: median {median:.4f}, p90 {times[int(len(times) * 0.9)]:.4f}, "
          f"mean {sum(times) / len(times):.4f}, max {times[-1]:.4f}; {len(slow)} of {len(times)} calls over twice "
          f"the median, {sum(slow) - len(slow) * median:.2f} ms beyond it", flush=True)


def idle_report(events: list) -> None:
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    span = gpu[-1]["ts"] + gpu[-1]["dur"] - gpu[0]["ts"]
    busy = sum(e["dur"] for e in gpu)
    print(f"  GPU span {span / CALLS / 1e3:.4f} ms a call, busy {busy / CALLS / 1e3:.4f}, "
          f"idle {(span - busy) / CALLS / 1e3:.4f} ({len(gpu) / CALLS:.1f} GPU ops a call)")
    gaps = collections.defaultdict(lambda: [0.0, 0])  # (next op, host late) -> [idle us, count]
    end = gpu[0]["ts"] + gpu[0]["dur"]
    for e in gpu[1:]:
        idle = e["ts"] - end
        if idle > 0.5:
            launch = launches.get(e.get("args", {}).get("correlation"))
            late = launch is not None and launch["ts"] > end
            row = gaps[(e["name"][:60], late)]
            row[0] += idle
            row[1] += 1
        end = max(end, e["ts"] + e["dur"])
    print(f"  {'idle us/call':>12} {'gaps':>5}  {'host late':>9}  next GPU op")
    for (name, late), (idle, count) in sorted(gaps.items(), key=lambda kv: -kv[1][0]):
        print(f"  {idle / CALLS:12.1f} {count:5d}  {'yes' if late else 'no':>9}  {name}")
    blocking = collections.Counter()
    for e in events:
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and any(b in e["name"] + " " for b in BLOCKING):
            blocking[e["name"]] += e.get("dur", 0)
    for name, us in blocking.most_common():
        print(f"  blocking runtime call {name}: {us / CALLS:.1f} us a call")
    ops = collections.Counter()
    for e in events:
        if e.get("cat") == "cpu_op":
            ops[e["name"]] += e.get("dur", 0)
    print("  host ops, us a call (inclusive):", ", ".join(f"{n} {us / CALLS:.0f}" for n, us in ops.most_common(8)))


def main():
    by_name = {c.name: c for c in CASES}
    profiled = "--profile" in sys.argv
    argv = [a for a in sys.argv if a != "--profile"]
    modes = argv[2].split(",") if len(argv) > 2 else ["fwd", "fwdbwd"]
    for name in argv[1].split(","):
        p = make_problem(by_name[name], seed=0, device="cuda")
        for mode in modes:
            step = TorchFrontEnd.make_step(dualattn_torch(p), p.inputs, mode)
            print(f"== {name} {mode}", flush=True)
            idle_report(trace_events(step))
            print(f"  wall ms a call, back to back (the bench's figure): {throughput_ms(step):.4f}", flush=True)
            issue_report(step, "")
            gc.disable()
            try:
                issue_report(step, " (gc off)")
            finally:
                gc.enable()
            if profiled:
                profiler = cProfile.Profile()
                issue_times(step.launch, CALLS, profiler)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    main()
