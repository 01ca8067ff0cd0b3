"""Flash attention benchmark: dualattn (torch, jax) against its peers, in one process, on the same inputs.

    python -m dualattn.bench --heads 16 --head-dim 128 --tokens 16384 \\
        --seqlens 1024,2048,4096,8192,16384 --causal both --modes fwd,fwdbwd --systems all \\
        --out benchmarks/results/NAME.json --plot benchmarks/results/NAME.png
    python -m dualattn.bench --batch 2 --seqlen 8192          # one explicit shape
    python -m dualattn.bench --memory --seqlens 8192,16384,32768,65536,131072
    python -m dualattn.bench --cases options --quick --markdown   # every option: dualattn/bench/options.py

TFLOP/s = FLOPs / median time of triton.testing.do_bench; FLOPs fwd = 4*B*H*S*S*D (halved causal),
fwd+bwd = 3.5x fwd. Before timing, each system's forward is checked against fp32 torch SDPA (math) on
the same input; a system that fails to build or run is reported as "missing: <reason>", one whose
output is off by more than --tol as "wrong: err=..." (still timed).
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import sys
from datetime import datetime, timezone
from typing import Callable, List, Optional, Sequence

from . import report
from .report import MODES, Measurement, MemoryRecord, Shape
from .systems import DTYPES, SYSTEMS, Step, System, keep_env, make_inputs, reference_output, rel_error

DEFAULT_SEQLENS = (1024, 2048, 4096, 8192, 16384)
DEFAULT_MEMORY_SEQLENS = (8192, 16384, 32768, 65536, 131072)
CAUSAL_CHOICES = {"both": (False, True), "false": (False,), "true": (True,)}


# ---------------------------------------------------------------------------------------------
# Command line


def _int_list(text: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _str_list(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dualattn.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch: B = tokens // S (default 16384)")
    p.add_argument("--seqlens", type=_int_list, default=None,
                   help=f"default {','.join(map(str, DEFAULT_SEQLENS))}; "
                        f"with --memory {','.join(map(str, DEFAULT_MEMORY_SEQLENS))}")
    p.add_argument("--seqlen", type=int, default=None, help="one sequence length (same as --seqlens S)")
    p.add_argument("--batch", type=int, default=None, help="explicit batch size instead of tokens // S")
    p.add_argument("--causal", choices=sorted(CAUSAL_CHOICES), default="both")
    p.add_argument("--modes", type=_str_list, default=list(MODES), help="fwd,fwdbwd (default both)")
    p.add_argument("--systems", type=_str_list, default=None,
                   help="'all' or a comma list of " + ",".join(SYSTEMS)
                        + " (default all; with --memory dualattn-torch)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--min-ms", type=float, default=200.0, help="length of one timing round, ms")
    p.add_argument("--repeats", type=int, default=5, help="timing rounds per measurement (median taken)")
    p.add_argument("--tol", type=float, default=2e-2, help="relative-error bound of the correctness guard")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jax-ptxas", choices=("xla", "triton"), default="xla",
                   help="assembler of the jax path's Triton kernels: jaxlib's choice (default) or the ptxas "
                        "torch's Triton uses (dualattn.jax_api.use_triton_ptxas; same SASS in both frameworks)")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--memory", action="store_true",
                   help="peak memory of fwd+bwd instead of timings (B=1 unless --batch)")
    p.add_argument("--list-systems", action="store_true", help="print the system names and exit")
    p.add_argument("--from-json", help="no measuring: print the table of a results JSON (and --plot it)")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and resolve: adds `shapes` (list of Shape), `causals` (tuple of bool) and `system_keys`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seqlen is not None and args.seqlens is not None:
        parser.error("give --seqlen or --seqlens, not both")
    seqlens = ([args.seqlen] if args.seqlen is not None else args.seqlens
               or list(DEFAULT_MEMORY_SEQLENS if args.memory else DEFAULT_SEQLENS))
    for name in ("heads", "head_dim", "tokens", "batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not seqlens or min(seqlens) < 1:
        parser.error(f"sequence lengths must be >= 1, got {seqlens}")
    if args.batch is None and not args.memory and args.tokens < max(seqlens):
        parser.error(f"--tokens {args.tokens} is less than the sequence length {max(seqlens)}: "
                     "B = tokens // S would be 0 (raise --tokens or give --batch)")
    bad_modes = [m for m in args.modes if m not in MODES]
    if bad_modes or not args.modes:
        parser.error(f"--modes must be a comma list of {','.join(MODES)}, got {','.join(args.modes)}")
    keys = args.systems or (["dualattn-torch"] if args.memory else ["all"])
    args.system_keys = list(SYSTEMS) if keys == ["all"] else keys
    unknown = [k for k in args.system_keys if k not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {','.join(unknown)}; choose 'all' or from {','.join(SYSTEMS)}")
    args.shapes = [Shape(_batch(args, s), s, args.heads, args.head_dim) for s in seqlens]
    args.causals = CAUSAL_CHOICES[args.causal]
    return args


def _batch(args: argparse.Namespace, seqlen: int) -> int:
    if args.batch is not None:
        return args.batch
    return 1 if args.memory else args.tokens // seqlen


# ---------------------------------------------------------------------------------------------
# Measuring


def throughput_ms(step: Step, min_ms: float = 200.0, repeats: int = 5) -> float:
    """Milliseconds per call: the median over `repeats` rounds of (wall time of n back-to-back
    launches and one final wait) / n, with n chosen so a round lasts about `min_ms`.

    One method for every system of both frameworks.  triton.testing.do_bench brackets each call
    with CUDA events on torch's stream, which cannot see work jax runs on its own stream, so a jax
    call had to block inside the timed region and paid the host round trip every call (measured:
    jax-triton looked 0.68x torch on the identical kernel).  Launching back to back hides host
    dispatch behind the GPU as long as a call's GPU time exceeds its host time (true for every
    system from S = 1024 at 16k tokens).  L2 is not flushed between calls; for attention at these
    sizes the inputs (>= 32 MiB per tensor) do not stay in the 50 MiB L2 anyway.
    """
    import time
    step()  # compile, autotune, allocations
    t0 = time.perf_counter()
    step()
    one_ms = (time.perf_counter() - t0) * 1e3
    n = max(3, min(2000, int(min_ms / max(one_ms, 1e-3))))
    rounds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = step.launch()
        step.sync(out)
        rounds.append((time.perf_counter() - t0) * 1e3 / n)
        del out
    return sorted(rounds)[len(rounds) // 2]


def captured(fn: Callable[[], object]):
    """(graph, output) of one call of `fn` captured in a CUDA graph, after one warm-up call on a side stream
    (as torch.cuda.graphs asks); graph.replay() reruns it on whatever the captured inputs then hold."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return graph, output


def kernel_times(fn: Callable[[], object], calls: int = 5, width: int = 70) -> dict:
    """{kernel name (first `width` characters): device ms per call} of `fn` over `calls` calls after one
    warm-up, from torch.profiler: CUPTI sees every kernel on the GPU, JAX's and XLA's included."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    table = collections.defaultdict(float)
    for e in prof.events():
        if e.device_time > 0:
            table[e.name[:width]] += e.device_time / calls / 1e3
    return dict(table)


def measure_system(system: System, inputs, ref, causal: bool, modes: Sequence[str], timer: Callable,
                   tol: float, step: Callable[[int], None] = lambda n: None) -> List[Measurement]:
    """Build the system, check its forward against `ref`, then time each mode. Never raises."""
    base = dict(system=system.key, **vars(inputs.shape), causal=causal)
    front = system.front
    with keep_env("TRITON_CACHE_DIR"):
        try:
            attn = system.build(inputs.shape, causal)
            fwd = front.make_step(attn, inputs, "fwd")
            err = rel_error(front.to_torch(fwd()), ref)
        except Exception as e:
            step(len(modes))
            return [Measurement(**report.missing(dict(base, mode=m), e)) for m in modes]
        rows = []
        for mode in modes:
            row = dict(base, mode=mode)
            try:
                run = fwd if mode == "fwd" else front.make_step(attn, inputs, mode)
                row.update(report.timed(inputs.shape, causal, mode, timer(run), err, tol))
            except Exception as e:
                row = report.missing(row, e)
            rows.append(Measurement(**row))
            step(1)
    return rows


def _free_memory() -> None:
    """Between systems: drop what the last one left (failed calls leave reference cycles) from the GPU."""
    import torch
    if torch.cuda.is_available():  # gc.collect costs ~0.3 s with torch loaded: only where memory matters
        gc.collect()
        torch.cuda.empty_cache()


def run_timing(args: argparse.Namespace, timer: Callable, device: str = "cuda",
               systems: Optional[Sequence[System]] = None,
               checkpoint: Callable[[List[Measurement]], None] = lambda records: None) -> List[Measurement]:
    """Every system on every shape; `checkpoint(records so far)` after each shape (a long run that
    is cut short keeps what it measured)."""
    systems = list(systems) if systems is not None else [SYSTEMS[k] for k in args.system_keys]
    total = len(args.shapes) * len(args.causals) * len(systems) * len(args.modes)
    records: List[Measurement] = []
    with report.progress(total, "bench") as bar:
        for shape in args.shapes:
            inputs = make_inputs(shape, args.dtype, args.seed, device)
            for causal in args.causals:
                ref = reference_output(inputs, causal)
                for system in systems:
                    bar.set_postfix_str(f"{system.key} B={shape.B} S={shape.S} {'causal' if causal else 'full'}")
                    records += measure_system(system, inputs, ref, causal, args.modes, timer, args.tol, bar.update)
                    _free_memory()
                del ref
            del inputs
            _free_memory()
            report.fill_ratios(records)
            checkpoint(records)
    return records


def measure_memory(system: System, shape: Shape, causal: bool, dtype: str, seed: int) -> MemoryRecord:
    """Peak torch.cuda.max_memory_allocated of one fwd+bwd (inputs included), against the ideal bytes."""
    import torch
    base = dict(system=system.key, **vars(shape), causal=causal)
    if system.front_end != "torch":
        return MemoryRecord(**report.missing(base, "memory mode measures torch allocations only"))
    _free_memory()
    start = torch.cuda.memory_allocated()
    try:
        with keep_env("TRITON_CACHE_DIR"):
            inputs = make_inputs(shape, dtype, seed)
            run = system.front.make_step(system.build(shape, causal), inputs, "fwdbwd")
            run()  # first call: compile and autotune outside the measured peak
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            run()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - start
    except Exception as e:
        return MemoryRecord(**report.missing(base, e))
    finally:
        inputs = run = None
        _free_memory()
    ideal = report.ideal_fwdbwd_bytes(shape, 2)
    return MemoryRecord(**base, peak_bytes=peak, ideal_bytes=ideal, ratio=peak / ideal)


def run_memory(args: argparse.Namespace) -> List[MemoryRecord]:
    systems = [SYSTEMS[k] for k in args.system_keys]
    cases = [(s, c, sy) for s in args.shapes for c in args.causals for sy in systems]
    records = []
    with report.progress(len(cases), "memory") as bar:
        for shape, causal, system in cases:
            bar.set_postfix_str(f"{system.key} S={shape.S} {'causal' if causal else 'full'}")
            records.append(measure_memory(system, shape, causal, args.dtype, args.seed))
            bar.update(1)
    return records


# ---------------------------------------------------------------------------------------------
# Run description and entry point


def versions() -> dict:
    found = {}
    for dist in ("torch", "triton", "jax", "jaxlib", "jax-triton", "dualattn"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = None
    import dualattn
    found["dualattn"] = dualattn.__version__  # the source tree that ran, installed or not
    plugins = {d.metadata["Name"]: d.version for d in importlib.metadata.distributions()
               if (d.metadata["Name"] or "").lower().replace("_", "-").startswith("jax-cuda")}
    return dict(found, **plugins)


def metadata(args: argparse.Namespace, argv: Sequence[str]) -> dict:
    import torch
    cuda = torch.cuda.is_available()
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "versions": versions(),
        "argv": list(argv),
        "settings": {"dtype": args.dtype, "round_ms": args.min_ms, "rounds": args.repeats, "tol": args.tol,
                     "seed": args.seed, "jax_ptxas": args.jax_ptxas,
                     "timing": "throughput_ms: n back-to-back calls + one wait, per call, median of rounds",
                     "flops": "fwd 4*B*H*S*S*D (causal /2); fwdbwd 3.5x fwd",
                     "reference_for_ratio": report.REFERENCE_SYSTEM},
        "systems": {k: SYSTEMS[k].label for k in args.system_keys},
    }


def require_cuda() -> None:
    """Exit with a clear message where no CUDA GPU is visible (the benchmark times GPU kernels only)."""
    try:
        import torch
    except ImportError as e:
        raise SystemExit(f"dualattn.bench needs PyTorch with CUDA ({e})") from None
    if not torch.cuda.is_available():
        raise SystemExit("dualattn.bench needs a CUDA GPU: torch.cuda.is_available() is False "
                         f"(torch {torch.__version__}). Run it on a GPU machine.")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.list_systems:
        for system in SYSTEMS.values():
            print(f"{system.key:22s} {system.label}")
        return 0
    if args.from_json:  # e.g. plot on a machine with matplotlib what a GPU machine measured
        meta, measurements, _ = report.load_json(args.from_json)
        keys = list(dict.fromkeys(r.system for r in measurements))
        print(report.format_table(measurements, keys))
        if args.plot:
            shape = measurements[0] if measurements else None
            title = f"{meta.get('device')}, H={shape.H}, D={shape.D}, {meta.get('date', '')[:10]}" if shape else ""
            print(report.plot(measurements, args.plot, title))
        return 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before anything imports jax
    require_cuda()
    if args.jax_ptxas == "triton":  # before any jax kernel is assembled
        import torch
        from dualattn.jax_api.ptxas import use_triton_ptxas
        major, minor = torch.cuda.get_device_capability()
        print(f"# jax path: Triton's ptxas ({use_triton_ptxas(major * 10 + minor)}) first on PATH")
    meta = metadata(args, argv)
    print(f"# {meta['device']}  {meta['date']}  " + " ".join(f"{k}={v}" for k, v in meta["versions"].items() if v))
    measurements, memory = [], []
    if args.memory:
        memory = run_memory(args)
        print(report.format_memory_table(memory, args.system_keys))
    else:
        def checkpoint(records):
            if args.out:
                report.write_json(args.out, meta, records)
        measurements = run_timing(args, timer=lambda step: throughput_ms(step, args.min_ms, args.repeats),
                                  checkpoint=checkpoint)
        print(report.format_table(measurements, args.system_keys))
    if args.out:
        report.write_json(args.out, meta, measurements, memory)
        print(f"results written to {args.out}")
    if args.plot:
        print(report.plot(measurements, args.plot, f"{meta['device']}, H={args.heads}, D={args.head_dim}, "
                                                   f"{args.dtype}") if measurements else "plot: timing runs only")
    return 0
