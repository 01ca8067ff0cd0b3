"""Host time per call of the torch path, next to SDPA, on a problem too small to keep the GPU busy.

    python benchmarks/host_overhead.py [--profile out.txt]

At B=1, S=128, H=2, D=64 each kernel runs for a few microseconds, so back-to-back calls are
limited by the Python/C++ work that issues them: the wall time per call is the host time.
--profile writes cProfile's top functions of dualattn's fwd+bwd (where that time goes);
--breakdown times the forward's layers one by one (public call, op implementation, planning,
launch of the cached compiled kernel, allocation), without the profiler's per-call inflation.
"""
import argparse
import cProfile
import io
import pstats
import time

import torch
import triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import dualattn.torch_api as dt


def per_call_us(fn, n=2000, blocks=5):
    """Host time per call: the fastest of `blocks` blocks of n // blocks back-to-back calls (this
    host's timings swing +-30% between blocks and processes; the minimum is the steadiest)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(blocks):
        t = time.perf_counter()
        for _ in range(n // blocks):
            fn()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / (n // blocks) * 1e6)
    return best


def causal_op_arguments(q, k, v) -> dict:
    """The torch op's named arguments for a causal forward of BSHD q, k, v,
    as the public function passes them."""
    from dualattn.torch_api import flash
    statics = dict(max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], softmax_scale=q.shape[-1] ** -0.5,
                   window_left=-1, window_right=0, logits_soft_cap=0.0, dropout_prob=0.0, dropout_seed=0,
                   diag_shift=0, sparse_block_q=0, sparse_block_k=0, sparse_contiguous=0)
    return {**dict.fromkeys(flash._TENSOR_ARGS), "query": q, "key": k, "value": v, **statics}


def breakdown(q, k, v):
    """Per-call host time of each layer of the causal forward (no grad)."""
    from dualattn.torch_api import _launch, flash
    from dualattn.kernels.flash import plan as flash_plan
    named = causal_op_arguments(q, k, v)
    op_args = [named[n] for n in flash._TENSOR_ARGS + flash._STATIC_ARGS]
    a, sparse, resolved = flash._problem(dict(named))
    shapes, options, config = resolved.shapes, resolved.options, resolved.config
    out = torch.empty(flash_plan.out_shape(shapes), dtype=q.dtype, device=q.device)
    strides = flash._strides({**a, "out": out})
    launch = flash_plan.plan_forward(shapes, options, strides, config=config, sparse=sparse)
    _launch.run(launch, a, outputs={"out": out})
    prep = _launch._prepared(launch, False)
    compiled, tail = next(iter(prep.variants.values()))
    first = a[launch.inputs[0]]
    largs = [a.get(n) if a.get(n) is not None else first for n in launch.inputs]
    largs += [value for _, value in launch.scalars] + [out, torch.empty(flash_plan._lse_shape(shapes), device="cuda")]
    largs += [first for o in launch.outputs if o.scratch]   # as _launch.run passes them
    stream = _launch._driver().get_current_stream(0)
    g = launch.grid
    hooks = triton.knobs.runtime

    def bare():
        meta = compiled.launch_metadata(g, stream, *largs, *tail)
        compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, meta,
                     hooks.launch_enter_hook, hooks.launch_exit_hook, *largs, *tail)
    fwd_out, lse = flash._flash_fwd_impl(*op_args)
    dout = torch.randn_like(fwd_out)

    def graph_fwd():
        with torch.enable_grad():
            return dt.flash_attention(q, k, v, causal=True)
    graph_out = graph_fwd()
    print(f"  {'autograd.grad on a kept graph':36s} "
          f"{per_call_us(lambda: torch.autograd.grad(graph_out, (q, k, v), dout, retain_graph=True)):7.1f} us")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            torch.autograd.grad(graph_out, (q, k, v), dout, retain_graph=True)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    with torch.no_grad():
        layers = {
            "public flash_attention": lambda: dt.flash_attention(q, k, v, causal=True),
            "public, grad enabled (graph kept)": lambda: graph_fwd(),
            "op implementation": lambda: flash._flash_fwd_impl(*op_args),
            "backward op implementation": lambda: flash._flash_bwd_impl(dout, fwd_out, lse, None, *op_args),
            "_problem (inputs, sizes, config)": lambda: flash._problem(dict(named)),
            "executor config": lambda: flash._config(shapes, options, q.device),
            "plan_forward (memoised)": lambda: flash_plan.plan_forward(shapes, options, strides, config=config,
                                                                       sparse=sparse),
            "_launch.run (args, alloc, launch)": lambda: _launch.run(launch, a, outputs={"out": out}),
            "_specialisation": lambda: _launch._specialisation(largs, prep.tensors, prep.ints),
            "bare CompiledKernel launch": bare,
            "torch.empty x2": lambda: (torch.empty(out.shape, dtype=q.dtype, device="cuda"),
                                       torch.empty((1, 2, 128), dtype=torch.float32, device="cuda")),
        }
        for name, fn in layers.items():
            print(f"  {name:36s} {per_call_us(fn):7.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile")
    ap.add_argument("--breakdown", action="store_true")
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
    if args.breakdown:
        breakdown(q, k, v)
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
