"""Ring attention: correctness against single-device flash_attention on the gathered sequence, and
per-GPU efficiency.

    python benchmarks/bench_ring.py --framework torch                 # world 1 (ring vs flash, one GPU)
    torchrun --nproc-per-node 4 benchmarks/bench_ring.py --framework torch
    python benchmarks/bench_ring.py --framework jax                   # shard_map over all local GPUs
    python benchmarks/bench_ring.py --plot                            # efficiency vs world size, from JSON
    torchrun --nproc-per-node 4 benchmarks/bench_ring.py --profile    # does the K/V transfer overlap compute?
    --quick: 8k tokens per GPU only (< 3 minutes on 1-4 H100s)
    --device cpu --quick: tiny shapes on CPU (gloo under torchrun / --cpu-devices N for jax), a dry run

bf16, D=128, GQA 32/8, B=1; cases causal zigzag and non-causal (contiguous); fwd and fwd+bwd.
Efficiency = ring throughput per GPU / single-GPU flash_attention throughput at the same per-GPU
work, throughput counted as attended (query, key) pairs per second (fwd 4*D flops a pair, bwd 2.5x):
non-causal, the baseline is flash with L queries against the S = W*L keys (exactly one GPU's ring
work); causal, flash causal over S (its per-pair rate; the ring's work per GPU is S^2 / 2W pairs).
JSON rows go to benchmarks/results/<date>_ring_<framework>_w<W>_<device>.json.

--profile: a few fwd+bwd calls of the first case under the framework's profiler (torch.profiler, or
jax.profiler's perfetto trace); from the GPU kernel intervals it reports how much of the NCCL
(send/recv) kernel time runs while a compute kernel runs, and how much compute time there is per
call with no transfer beside it.  Trace and summary go to <date>_ring_profile_<framework>_w<W>.*.

--per-step W [W ...] (torch, one GPU): what a W-GPU ring can reach.  Each of rank 0's steps (its
flash launches on a visiting shard plus the fp32 merge; backward: launches plus dQ/dK/dV
accumulation) is timed alone, with no transfer; their sum is the ring's time per call when every
transfer hides behind compute, and the efficiency from it is the ceiling for W GPUs.  Rows go to
<date>_ring_per_step_torch_<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import sys
import time

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
CASES = {"causal-zigzag": dict(causal=True, layout="zigzag"), "noncausal": dict(causal=False, layout="contiguous")}


def _args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, nargs="*", help="tokens per GPU (default 8192 16384 32768)")
    p.add_argument("--cases", nargs="*", choices=tuple(CASES), default=list(CASES))
    p.add_argument("--modes", nargs="*", choices=("fwd", "fwd+bwd"), default=["fwd", "fwd+bwd"])
    p.add_argument("--cpu-devices", type=int, default=2, help="jax on CPU: host devices to shard over")
    p.add_argument("--out", help="JSON path (default under benchmarks/results/)")
    p.add_argument("--plot", action="store_true", help="plot efficiency vs world size from the JSON results")
    p.add_argument("--profile", action="store_true", help="profile fwd+bwd of the first case (see above)")
    p.add_argument("--per-step", type=int, nargs="+", metavar="W",
                   help="torch, one GPU: time rank 0's ring steps for world sizes W (see above)")
    return p.parse_args()


def _shape(args):
    if args.device == "cpu":   # the interpreter: tiny
        return dict(heads_q=4, heads_kv=2, head_dim=16, dtype="float32")
    return dict(heads_q=32, heads_kv=8, head_dim=128, dtype="bfloat16")


def _tokens(args):
    if args.tokens:
        return args.tokens
    if args.device == "cpu":
        return [32]
    return [8192] if args.quick else [8192, 16384, 32768]


def _reps(args, tokens: int) -> int:
    """Timed calls: the same on every rank (the ring's transfers pair up across ranks), fewer for
    longer sequences (a 32k-per-GPU fwd+bwd call takes a good part of a second)."""
    if args.device == "cpu":
        return 3
    return 10 if args.quick else max(6, 30 * 8192 // tokens)


def _pairs(seq: int, causal: bool, queries: int = None) -> float:
    queries = seq if queries is None else queries
    return seq * (seq + 1) / 2 if causal else queries * seq


def _flops(pairs: float, head_dim: int, heads: int, mode: str) -> float:
    fwd = 4.0 * head_dim * pairs * heads
    return fwd * (3.5 if mode == "fwd+bwd" else 1.0)


def _rel(a, b) -> float:
    import numpy as np
    a, b = (x.detach().numpy() if hasattr(x, "detach") else x for x in (a, b))
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ----------------------------------------------------------------------------- torch


def _torch_run(args):
    import torch
    import torch.distributed as dist

    import dualattn
    from dualattn.torch_api import flash_attention, ring_attention

    if "RANK" not in os.environ:   # a plain python launch: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = _shape(args)
    dtype = getattr(torch, shape["dtype"])

    def timeit(fn, reps):
        if args.device == "cuda":
            # A fixed number of calls on every rank: the ring's P2P transfers pair up across ranks, so
            # a per-rank repeat count (do_bench estimates one from its own warm-up) deadlocks.
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps * 1e-3
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    if args.profile:
        return _torch_profile(args, rank, world, device, dtype, shape)
    rows = []
    for tokens in _tokens(args):
        seq = tokens * world
        for case in args.cases:
            opts = CASES[case]
            g = torch.Generator().manual_seed(0)
            mk = lambda h: torch.randn(1, seq, h, shape["head_dim"], generator=g).to(device, dtype)
            q, k, v = mk(shape["heads_q"]), mk(shape["heads_kv"]), mk(shape["heads_kv"])
            dout = mk(shape["heads_q"])
            perm = torch.as_tensor(dualattn.ring_permutation(seq, world, opts["layout"]), device=device)
            mine = perm.view(world, -1)[rank]
            ql, kl, vl, dl = (x[:, mine].contiguous() for x in (q, k, v, dout))
            for mode in args.modes:
                leaves = [x.clone().requires_grad_(mode != "fwd") for x in (ql, kl, vl)]

                def ring():
                    out = ring_attention(*leaves, causal=opts["causal"], layout=opts["layout"])
                    if mode != "fwd":
                        torch.autograd.grad(out, leaves, dl)
                    return out

                # correctness: the ring's shard of out (and grads) vs flash on the gathered sequence
                errors = {}
                if tokens == min(_tokens(args)):
                    full = [x.clone().requires_grad_(mode != "fwd") for x in (q, k, v)]
                    ref = flash_attention(*full, causal=opts["causal"])
                    out = ring_attention(*leaves, causal=opts["causal"], layout=opts["layout"])
                    errors["out"] = _rel(out.float().cpu(), ref[:, mine].float().cpu())
                    if mode != "fwd":
                        got = torch.autograd.grad(out, leaves, dl)
                        want = torch.autograd.grad(ref, full, dout)
                        for n, a, b in zip(("dq", "dk", "dv"), got, want):
                            errors[n] = _rel(a.float().cpu(), b[:, mine].float().cpu())
                    del full, ref
                t_ring = timeit(ring, _reps(args, tokens))
                # baseline on one GPU at the same per-GPU work
                if opts["causal"]:
                    base = [x.clone().requires_grad_(mode != "fwd") for x in (q, k, v)]
                    base_pairs, base_dout = _pairs(seq, True), dout
                else:
                    base = [ql.clone().requires_grad_(mode != "fwd"), k.clone().requires_grad_(mode != "fwd"),
                            v.clone().requires_grad_(mode != "fwd")]
                    base_pairs, base_dout = _pairs(seq, False, tokens), dl

                def flash():
                    out = flash_attention(*base, causal=opts["causal"])
                    if mode != "fwd":
                        torch.autograd.grad(out, base, base_dout)

                t_flash = timeit(flash, _reps(args, tokens))
                del base
                ring_pairs = _pairs(seq, opts["causal"]) / world
                rate_ring = _flops(ring_pairs, shape["head_dim"], shape["heads_q"], mode) / t_ring
                rate_flash = _flops(base_pairs, shape["head_dim"], shape["heads_q"], mode) / t_flash
                errs = torch.tensor([errors.get(n, 0.0) for n in ("out", "dq", "dk", "dv")], dtype=torch.float64,
                                    device=device if args.device == "cuda" else "cpu")
                times = torch.tensor([t_ring], dtype=torch.float64, device=errs.device)
                dist.all_reduce(errs, op=dist.ReduceOp.MAX)
                dist.all_reduce(times, op=dist.ReduceOp.MAX)   # the slowest rank sets the ring's time
                t_ring = float(times[0])
                rate_ring = _flops(ring_pairs, shape["head_dim"], shape["heads_q"], mode) / t_ring
                row = dict(framework="torch", world=world, tokens_per_gpu=tokens, case=case, mode=mode,
                           ring_ms=t_ring * 1e3, flash_ms=t_flash * 1e3, ring_tflops_per_gpu=rate_ring / 1e12,
                           flash_tflops=rate_flash / 1e12, efficiency=rate_ring / rate_flash,
                           max_rel_error={n: float(e) for n, e in zip(("out", "dq", "dk", "dv"), errs) if n in errors}
                           or None)
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    versions = dict(torch=torch.__version__)
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else platform.processor() or "cpu"
    if rank == 0:
        _write(args, rows, world, name, versions)
    dist.destroy_process_group()


def _torch_per_step(args):
    import torch

    from dualattn import ring as ring_rules
    from dualattn.options import FlashOptions
    from dualattn.torch_api import flash_attention
    from dualattn.torch_api import ring as torch_ring

    device = torch.device(args.device)
    shape = _shape(args)
    dtype = getattr(torch, shape["dtype"])
    hq, hkv, d = shape["heads_q"], shape["heads_kv"], shape["head_dim"]

    def timeit(fn):
        fn()
        if args.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=200) * 1e-3

    rows = []
    for tokens in _tokens(args):
        g = torch.Generator().manual_seed(0)
        mk = lambda *s: torch.randn(*s, generator=g).to(device, dtype)
        q, k, v, dout = mk(1, tokens, hq, d), mk(1, tokens, hkv, d), mk(1, tokens, hkv, d), mk(1, tokens, hq, d)
        out = mk(1, tokens, hq, d)
        lse = torch.randn(1, hq, tokens, generator=g).to(device) + 8.0
        dlse = torch.zeros_like(lse)
        for world in args.per_step:
            seq = world * tokens
            for case in args.cases:
                opts = CASES[case]
                options = FlashOptions.build(head_dim=d, causal=opts["causal"])
                schedule = ring_rules.ring_schedule(seq, world, opts["layout"], 0, options.window_left,
                                                    options.window_right)
                static = torch_ring._RingStatic(None, world, 0, schedule, len(schedule), options, hq)
                acc = torch.zeros(1, tokens, hq, d, dtype=torch.float32, device=device)
                acc_lse = torch.full((1, hq, tokens), float("-inf"), device=device)
                dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
                fwd = [timeit(lambda t=t: torch_ring.step_forward(static, t, q, None, [k, v], acc, acc_lse))
                       for t in range(len(schedule))]
                bwd = [timeit(lambda t=t: torch_ring.step_backward(static, t, q, None, [k, v], out, lse, dout,
                                                                   dlse, dq)) for t in range(len(schedule))]
                # the single-GPU baseline of bench_ring's efficiency, at the same per-GPU work
                if opts["causal"]:
                    base, base_dout, base_pairs = [mk(1, seq, h, d) for h in (hq, hkv, hkv)], mk(1, seq, hq, d), \
                        _pairs(seq, True)
                else:
                    base, base_dout, base_pairs = [q, mk(1, seq, hkv, d), mk(1, seq, hkv, d)], dout, \
                        _pairs(seq, False, tokens)
                for mode in args.modes:
                    leaves = [x.clone().requires_grad_(mode != "fwd") for x in base]

                    def flash():
                        o = flash_attention(*leaves, causal=opts["causal"])
                        if mode != "fwd":
                            torch.autograd.grad(o, leaves, base_dout)

                    t_flash = timeit(flash)
                    t_ring = sum(fwd) + (sum(bwd) if mode != "fwd" else 0.0)
                    work = lambda pairs, t: _flops(pairs, d, hq, mode) / t
                    row = dict(framework="torch", world=world, tokens_per_gpu=tokens, case=case, mode=mode,
                               step_fwd_ms=[t * 1e3 for t in fwd],
                               step_bwd_ms=[t * 1e3 for t in bwd] if mode != "fwd" else None,
                               blocks_per_step=[len(b) for b in schedule], ring_compute_ms=t_ring * 1e3,
                               flash_ms=t_flash * 1e3,
                               efficiency_ceiling=work(_pairs(seq, opts["causal"]) / world, t_ring)
                               / work(base_pairs, t_flash))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                del base, leaves
    args.framework = "torch"
    name = torch.cuda.get_device_name(device) if args.device == "cuda" else platform.processor() or "cpu"
    date = datetime.date.today().isoformat()
    args.out = args.out or os.path.join(RESULTS, f"{date}_ring_per_step_torch_{args.device}.json")
    _write(args, rows, 1, name, dict(torch=torch.__version__), benchmark="ring-per-step")


# ----------------------------------------------------------------------------- jax


def _jax_run(args):
    if args.device == "cpu":
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.cpu_devices}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    import dualattn
    import dualattn.jax_api as dj

    devices = jax.devices()
    world = len(devices)
    mesh = Mesh(np.array(devices), ("sp",))
    shape = _shape(args)
    dtype = jnp.dtype(shape["dtype"])
    backend = "triton"
    seq_spec = P(None, "sp")

    def timeit(fn, reps, *a):
        # Back to back, one wait per round; the best of three rounds after a round of warm-up.  After one
        # warm-up call and one round, the world-size-1 ring, timed first, measured 5-10% below the very
        # launch it runs (docs/lessons.md: "JAX timings need a warm-up round").
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            for _ in range(reps):
                res = fn(*a)
            jax.block_until_ready(res)
            times.append((time.perf_counter() - t0) / reps)
        return min(times[1:])

    if args.profile:
        return _jax_profile(args, mesh, world, dtype, shape)
    rows = []
    for tokens in _tokens(args):
        seq = tokens * world
        for case in args.cases:
            opts = CASES[case]
            rng = np.random.default_rng(0)
            mk = lambda h: jnp.asarray(rng.standard_normal((1, seq, h, shape["head_dim"]), np.float32), dtype)
            q, k, v = mk(shape["heads_q"]), mk(shape["heads_kv"]), mk(shape["heads_kv"])
            dout = mk(shape["heads_q"])
            perm = dualattn.ring_permutation(seq, world, opts["layout"])
            ql, kl, vl, dl = (x[:, perm] for x in (q, k, v, dout))   # sharded in layout order
            ring = jax.shard_map(lambda a, b, c: dj.ring_attention(a, b, c, axis_name="sp", causal=opts["causal"],
                                                                   layout=opts["layout"], backend=backend),
                                 mesh=mesh, in_specs=(seq_spec,) * 3, out_specs=seq_spec)
            flash = lambda a, b, c: dj.flash_attention(a, b, c, causal=opts["causal"], backend=backend)
            one = jax.devices()[0]
            if opts["causal"]:
                base_args, base_pairs, base_dout = (q, k, v), _pairs(seq, True), dout
            else:
                base_args, base_pairs, base_dout = (q[:, :tokens], k, v), _pairs(seq, False, tokens), dout[:, :tokens]
            base_args = tuple(jax.device_put(x, one) for x in base_args)
            base_dout = jax.device_put(base_dout, one)
            for mode in args.modes:
                if mode == "fwd":
                    ring_fn, flash_fn = jax.jit(ring), jax.jit(flash)
                    ring_in, flash_in = (ql, kl, vl), base_args
                else:
                    def vjp(f):
                        def run(a, b, c, d):
                            out, pull = jax.vjp(f, a, b, c)
                            return out, pull(d)
                        return jax.jit(run)
                    ring_fn, flash_fn = vjp(ring), vjp(flash)
                    ring_in, flash_in = (ql, kl, vl, dl), base_args + (base_dout,)
                errors = {}
                if tokens == min(_tokens(args)):
                    flat = (lambda r: (r,)) if mode == "fwd" else (lambda r: (r[0],) + tuple(r[1]))
                    ref_fn = jax.jit(flash) if mode == "fwd" else vjp(flash)
                    got = flat(ring_fn(*ring_in))
                    want = flat(ref_fn(*((q, k, v) if mode == "fwd" else (q, k, v, dout))))
                    for n, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                        errors[n] = _rel(np.asarray(a.astype(jnp.float32)), np.asarray(b[:, perm].astype(jnp.float32)))
                t_ring = timeit(ring_fn, _reps(args, tokens), *ring_in)
                t_flash = timeit(flash_fn, _reps(args, tokens), *flash_in)
                ring_pairs = _pairs(seq, opts["causal"]) / world
                rate_ring = _flops(ring_pairs, shape["head_dim"], shape["heads_q"], mode) / t_ring
                rate_flash = _flops(base_pairs, shape["head_dim"], shape["heads_q"], mode) / t_flash
                row = dict(framework="jax", world=world, tokens_per_gpu=tokens, case=case, mode=mode,
                           ring_ms=t_ring * 1e3, flash_ms=t_flash * 1e3, ring_tflops_per_gpu=rate_ring / 1e12,
                           flash_tflops=rate_flash / 1e12, efficiency=rate_ring / rate_flash,
                           max_rel_error=errors or None)
                rows.append(row)
                print(json.dumps(row), flush=True)
    _write(args, rows, world, devices[0].device_kind, dict(jax=jax.__version__))


# ----------------------------------------------------------------------------- profile


def _merged(intervals):
    out = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> float:
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap_summary(kernels, calls: int) -> dict:
    """kernels: (name, start_us, end_us) of one GPU.  NCCL kernels are the transfers, the rest compute.
    A send/recv kernel's time includes waiting for its peer, so `transfer_overlapped` says whether the
    transfers run beside compute; `compute_idle_per_call_us` is what the ring loses on this GPU."""
    comm = _merged([(a, b) for n, a, b in kernels if "nccl" in n.lower()])
    comp = _merged([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    if not comp:
        return dict(kernels=len(kernels))
    wall = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    both = _intersection(comm, comp)
    return dict(kernels=len(kernels), calls=calls, wall_per_call_us=wall / calls,
                compute_busy_per_call_us=_length(comp) / calls, transfer_busy_per_call_us=_length(comm) / calls,
                transfer_overlapped=both / _length(comm) if comm else None,
                transfer_alone_per_call_us=(_length(comm) - both) / calls,
                compute_idle_per_call_us=(wall - _length(comp)) / calls)


def _profile_path(args, world, ext):
    if args.out:
        return os.path.splitext(args.out)[0] + "." + ext
    date = datetime.date.today().isoformat()
    return os.path.join(RESULTS, f"{date}_ring_profile_{args.framework}_w{world}.{ext}")


def _write_profile(args, world, device_name, tokens, case, per_gpu):
    path = _profile_path(args, world, "json")
    with open(path, "w") as f:
        json.dump(dict(benchmark="ring-profile", date=datetime.date.today().isoformat(), device=device_name,
                       world=world, framework=args.framework, tokens_per_gpu=tokens, case=case, mode="fwd+bwd",
                       shape=_shape(args), per_gpu=per_gpu), f, indent=1)
    print(json.dumps(per_gpu, indent=1))
    print("wrote", path)


PROFILE_CALLS = 5


def _torch_profile(args, rank, world, device, dtype, shape):
    import gzip

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from dualattn.torch_api import ring_attention

    tokens, case = _tokens(args)[0], args.cases[0]
    opts = CASES[case]
    g = torch.Generator().manual_seed(rank)
    mk = lambda h: torch.randn(1, tokens, h, shape["head_dim"], generator=g).to(device, dtype)
    leaves = [x.requires_grad_() for x in (mk(shape["heads_q"]), mk(shape["heads_kv"]), mk(shape["heads_kv"]))]
    dl = mk(shape["heads_q"])

    def ring():
        out = ring_attention(*leaves, causal=opts["causal"], layout=opts["layout"])
        torch.autograd.grad(out, leaves, dl)

    for _ in range(3):
        ring()
    torch.cuda.synchronize()
    dist.barrier()
    # Two unrecorded calls first: the profiler's own start-up differs between ranks and would show
    # as peers waiting in their send/recv kernels.
    with profile(activities=[ProfilerActivity.CUDA],
                 schedule=torch.profiler.schedule(wait=1, warmup=1, active=PROFILE_CALLS)) as prof:
        for _ in range(PROFILE_CALLS + 2):
            ring()
            prof.step()
        torch.cuda.synchronize()
    trace = f"/tmp/ring_profile_rank{rank}.json"
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
               if e.get("cat") == "kernel" and e.get("ph") == "X"]
    summary = overlap_summary(kernels, PROFILE_CALLS)
    gathered = [None] * world
    dist.all_gather_object(gathered, summary)
    if rank == 0:
        with open(trace, "rb") as src, gzip.open(_profile_path(args, world, "trace.json.gz"), "wb") as dst:
            dst.write(src.read())
        _write_profile(args, world, torch.cuda.get_device_name(device), tokens, case,
                       {f"rank{r}": s for r, s in enumerate(gathered)})
    dist.destroy_process_group()


def _jax_profile(args, mesh, world, dtype, shape):
    import gzip
    import shutil
    import tempfile

    import jax
    import numpy as np

    import dualattn.jax_api as dj
    from jax.sharding import PartitionSpec as P

    tokens, case = _tokens(args)[0], args.cases[0]
    opts = CASES[case]
    rng = np.random.default_rng(0)
    seq = tokens * world
    mk = lambda h: jax.numpy.asarray(rng.standard_normal((1, seq, h, shape["head_dim"]), np.float32), dtype)
    q, k, v, dout = mk(shape["heads_q"]), mk(shape["heads_kv"]), mk(shape["heads_kv"]), mk(shape["heads_q"])
    ring = jax.shard_map(lambda a, b, c: dj.ring_attention(a, b, c, axis_name="sp", causal=opts["causal"],
                                                           layout=opts["layout"], backend="triton"),
                         mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp"))

    @jax.jit
    def step(a, b, c, d):
        out, pull = jax.vjp(ring, a, b, c)
        return out, pull(d)

    for _ in range(3):
        jax.block_until_ready(step(q, k, v, dout))
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir, create_perfetto_trace=True):
        for _ in range(PROFILE_CALLS):
            res = step(q, k, v, dout)
        jax.block_until_ready(res)
    traces = glob.glob(os.path.join(logdir, "**", "perfetto_trace.json.gz"), recursive=True)
    with gzip.open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    shutil.copy(traces[0], _profile_path(args, world, "trace.json.gz"))
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    per_gpu = {}
    for pid, pname in processes.items():
        if "GPU" not in pname:
            continue
        # Only the stream lines: the device's "XLA Ops"/"XLA Modules" lines span whole ops and modules.
        kernels = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e
                   and "Stream" in threads.get((pid, e.get("tid")), "")]
        per_gpu[pname] = overlap_summary(kernels, PROFILE_CALLS)
    _write_profile(args, world, jax.devices()[0].device_kind, tokens, case, per_gpu)


# ----------------------------------------------------------------------------- output


def _write(args, rows, world, device_name, versions, benchmark="ring"):
    import triton

    import dualattn
    versions = dict(versions, triton=triton.__version__, dualattn=dualattn.__version__, python=sys.version.split()[0])
    date = datetime.date.today().isoformat()
    path = args.out or os.path.join(RESULTS, f"{date}_ring_{args.framework}_w{world}_{args.device}"
                                    f"{'_quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(benchmark=benchmark, date=date, device=device_name, world=world, versions=versions,
                       shape=_shape(args), rows=rows), f, indent=1)
    print("wrote", path)


def _plot(args):
    rows = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*_ring_*.json"))):
        with open(path) as f:
            data = json.load(f)
        if data.get("benchmark") == "ring" and not data.get("xla_flags"):   # not profiles or flag trials
            rows += [dict(r, device=data["device"]) for r in data["rows"]]
    if not rows:
        print("no ring results under", RESULTS)
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = sorted({(r["framework"], r["case"], r["tokens_per_gpu"]) for r in rows if r["mode"] == mode})
        shapes = sorted({(case, tokens) for _, case, tokens in series})
        for fw, case, tokens in series:
            pts = sorted((r["world"], r["efficiency"]) for r in rows
                         if (r["framework"], r["case"], r["tokens_per_gpu"], r["mode"]) == (fw, case, tokens, mode))
            ax.plot(*zip(*pts), marker="o" if fw == "torch" else "s", ls="-" if fw == "torch" else "--",
                    color=f"C{shapes.index((case, tokens))}", label=f"{fw} {case} {tokens // 1024}k/GPU")
        ax.set_xticks(sorted({r["world"] for r in rows}))
        ax.set_title(f"{mode} ({rows[0]['device']})")
        ax.set_xlabel("GPUs (world size)")
        ax.set_ylabel("per-GPU efficiency vs single-GPU flash")
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.legend(fontsize=6)
    path = os.path.join(RESULTS, f"{datetime.date.today().isoformat()}_ring_efficiency.png")
    fig.savefig(path, dpi=150, bbox_inches="tight")
    print("wrote", path)


def main():
    args = _args()
    if args.plot:
        return _plot(args)
    if args.per_step:
        return _torch_per_step(args)
    return (_torch_run if args.framework == "torch" else _jax_run)(args)


if __name__ == "__main__":
    main()
