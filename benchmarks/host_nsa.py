"""Host time of the torch NSA forward against its device time, and the same forward replayed from a CUDA
graph: where the GPU idles between launches at short sequences (bf16, D 128, Hkv 4, block 64, 16 selected
blocks, window 512, bench_nsa.py's inputs, no gradients).

    python benchmarks/host_nsa.py [T GROUP ...]        (default: 8192 4 8192 16)
    python benchmarks/host_nsa.py --train [T GROUP ...]  a training step instead: forward and backward
                                                       (torch.autograd.grad of q, k, v and the gates), eager
                                                       and under torch.compile(fullgraph=True), default and
                                                       mode="reduce-overhead" (CUDA graphs)
    python benchmarks/host_nsa.py --varlen [T GROUP SEQUENCES ...]  the forward of SEQUENCES equal
                                                       sequences packed into T tokens (cu_seqlens) against
                                                       the same as a batch of SEQUENCES rows
    python benchmarks/host_nsa.py --varlen --kernels [...]  the same, and each kernel's device ms a call,
                                                       packed against batch (torch.profiler)
    python benchmarks/host_nsa.py --varlen --jax [...]  the same, and JAX's backend "triton" in the same run
                                                       (jitted, cu_seqlens a constant; back-to-back calls
                                                       and one wait)
    python benchmarks/host_nsa.py --varlen --train [...]  a training step (the forward and the gradients of
                                                       q, k, v and the gates), packed against batch

Per (T, group): the host's ms per call (30 back-to-back calls, before the wait), the wall ms per call,
the device ms per call (torch.profiler, kernels and copies), and the wall ms per replay of one captured
call.  The forward makes no host synchronisation (torch.cuda.set_sync_debug_mode finds none), so it
captures as it is.
"""
import sys
import time
import warnings
from typing import Tuple

import torch

import dualattn.torch_api as dt
from dualattn.bench.flash import captured, kernel_times


def measure(seqlen: int, group: int, calls: int = 30) -> dict:
    gen = torch.Generator().manual_seed(0)
    heads_kv, head_dim = 4, 128
    hq = heads_kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = rand(1, seqlen, hq, head_dim), rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv, head_dim)
    gates = [torch.rand(1, seqlen, hq, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]

    def call():
        return dt.native_sparse_attention(q, k, v, *gates, block_counts=16, block_size=64, window_size=512)
    with torch.no_grad():
        for _ in range(3):
            call()
        syncs = _host_syncs(call)
        host_ms, wall_ms = _wall_ms(call, calls)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        device_ms = sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1e3
        graph, out = captured(call)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(out, call())
        start_replay = time.perf_counter()
        for _ in range(calls):
            graph.replay()
        torch.cuda.synchronize()
        replay_ms = 1e3 * (time.perf_counter() - start_replay) / calls
    return dict(seqlen=seqlen, group=group, host_ms=host_ms, wall_ms=wall_ms, device_ms=device_ms,
                graph_replay_ms=replay_ms, graph_output_equal=same, host_syncs=syncs)


def _host_syncs(fn) -> int:
    """The host synchronisations of one call of fn (torch.cuda.set_sync_debug_mode's warnings)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return len([w for w in caught if "synchroniz" in str(w.message)])


def _wall_ms(fn, calls: int) -> Tuple[float, float]:
    """(host ms, wall ms) per call of `calls` back-to-back calls of fn, after three warm ones."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return 1e3 * (issued - start) / calls, 1e3 * (time.perf_counter() - start) / calls


def measure_train(seqlen: int, group: int, calls: int = 30) -> dict:
    """A training step (forward, then the gradients of q, k, v and the three gates) eager and compiled."""
    gen = torch.Generator().manual_seed(0)
    heads_kv, head_dim = 4, 128
    hq = heads_kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    q, k, v = rand(1, seqlen, hq, head_dim), rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv, head_dim)
    gates = [torch.rand(1, seqlen, hq, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3)]
    dout = torch.randn(1, seqlen, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    inputs = (q, k, v, *gates)

    def nsa(q, k, v, g_cmp, g_slc, g_swa):
        return dt.native_sparse_attention(q, k, v, g_cmp, g_slc, g_swa, block_counts=16, block_size=64,
                                          window_size=512)

    def step(fn):   # (torch.compile traces the forward and, through AOTAutograd, its backward)
        return lambda: torch.autograd.grad(fn(*inputs), inputs, dout)

    row = dict(seqlen=seqlen, group=group)
    host, wall = _wall_ms(step(nsa), calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            step(nsa)()
        torch.cuda.synchronize()
    row.update(eager_host_ms=host, eager_wall_ms=wall,
               device_ms=sum(e.self_device_time_total for e in prof.key_averages()) / 10 / 1e3)
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        compiled = step(torch.compile(nsa, fullgraph=True, mode=mode))
        started = time.perf_counter()
        compiled()
        torch.cuda.synchronize()
        row[f"compile_{mode}_s"] = time.perf_counter() - started
        host, wall = _wall_ms(compiled, calls)
        row[f"compiled_{mode}_host_ms"], row[f"compiled_{mode}_wall_ms"] = host, wall
    return row


def measure_varlen(total: int, group: int, sequences: int, calls: int = 10, with_jax: bool = False,
                   kernels: bool = False, train: bool = False) -> dict:
    """The forward of `sequences` equal sequences packed into `total` tokens (cu_seqlens, on the GPU) against
    the same tokens as a batch of `sequences` rows: host and wall ms per call, and the host synchronisations
    of a call after the first (which reads the table's values).  `train`: a training step instead (torch)."""
    gen = torch.Generator().manual_seed(0)
    heads_kv, head_dim = 4, 128
    hq, each = heads_kv * group, total // sequences

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
    q, k, v = rand(1, total, hq, head_dim), rand(1, total, heads_kv, head_dim), rand(1, total, heads_kv, head_dim)
    gates = [torch.rand(1, total, hq, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]
    cu = torch.arange(0, total + 1, each, dtype=torch.int32, device="cuda")
    opts = dict(block_counts=16, block_size=64, window_size=512)

    def batched(x):
        return x.reshape(sequences, each, *x.shape[2:])
    row = dict(total=total, group=group, sequences=sequences)
    if train:
        inputs = [x.requires_grad_() for x in (q, k, v, *gates)]
        dout = rand(1, total, hq, head_dim)
        for name, fn in (("varlen", lambda: dt.native_sparse_attention(*inputs, cu_seqlens=cu, **opts)),
                         ("batch", lambda: dt.native_sparse_attention(*map(batched, inputs), **opts))):
            def step(fn=fn):
                return torch.autograd.grad(fn().reshape(dout.shape), inputs, dout)
            row[f"train_{name}_host_ms"], row[f"train_{name}_wall_ms"] = _wall_ms(step, calls)
            if kernels:
                row[f"{name}_kernel_ms"] = kernel_times(step)
        return row
    with torch.no_grad():
        packed = dt.native_sparse_attention(q, k, v, *gates, cu_seqlens=cu, **opts)
        batch = dt.native_sparse_attention(*map(batched, (q, k, v, *gates)), **opts)
        row["max_abs_diff"] = (packed.float() - batched(batch).reshape(packed.shape).float()).abs().max().item()
        row["varlen_host_syncs"] = _host_syncs(lambda: dt.native_sparse_attention(q, k, v, *gates, cu_seqlens=cu,
                                                                                  **opts))
        for name, fn in (("varlen", lambda: dt.native_sparse_attention(q, k, v, *gates, cu_seqlens=cu, **opts)),
                         ("batch", lambda: dt.native_sparse_attention(*map(batched, (q, k, v, *gates)), **opts))):
            row[f"{name}_host_ms"], row[f"{name}_wall_ms"] = _wall_ms(fn, calls)
            if kernels:
                row[f"{name}_kernel_ms"] = kernel_times(fn)
    if with_jax:
        row.update(_jax_varlen_ms(q, k, v, gates, cu, batched, opts, calls))
    return row


def _print_kernels(tables: dict) -> None:
    """Kernel by kernel, packed against batch, the largest first."""
    names = sorted(set(tables["varlen"]) | set(tables["batch"]),
                   key=lambda n: -max(tables["varlen"].get(n, 0), tables["batch"].get(n, 0)))
    print(f"  {'kernel':72s} {'packed':>8s} {'batch':>8s}")
    for n in names:
        print(f"  {n:72s} {tables['varlen'].get(n, 0):8.3f} {tables['batch'].get(n, 0):8.3f}")
    print(f"  {'total':72s} {sum(tables['varlen'].values()):8.3f} {sum(tables['batch'].values()):8.3f}", flush=True)


def _jax_varlen_ms(q, k, v, gates, cu, batched, opts, calls: int) -> dict:
    """JAX (backend "triton") on the same buffers: packed against batch, ms a call of back-to-back calls and
    one wait, and the largest difference from the batch."""
    import jax
    import numpy as np

    import dualattn.jax_api as dj
    as_jax = [jax.dlpack.from_dlpack(x) for x in (q, k, v, *gates)]
    cu_host = np.asarray(cu.cpu(), np.int32)
    packed = jax.jit(lambda *a: dj.native_sparse_attention(*a, backend="triton", cu_seqlens=cu_host, **opts))
    batch = jax.jit(lambda *a: dj.native_sparse_attention(*map(batched, a), backend="triton", **opts))
    row = {}
    outs = {}
    for name, fn in (("jax_varlen", packed), ("jax_batch", batch)):
        outs[name] = jax.block_until_ready(fn(*as_jax))
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*as_jax)
        jax.block_until_ready(out)
        row[f"{name}_wall_ms"] = 1e3 * (time.perf_counter() - start) / calls
    diff = np.abs(np.asarray(outs["jax_varlen"], np.float32)
                  - np.asarray(outs["jax_batch"], np.float32).reshape(outs["jax_varlen"].shape)).max()
    row["jax_max_abs_diff"] = float(diff)
    return row


def main(argv):
    train, varlen, with_jax, kernels = "--train" in argv, "--varlen" in argv, "--jax" in argv, "--kernels" in argv
    numbers = [int(a) for a in argv if not a.startswith("--")]
    print(f"# python benchmarks/host_nsa.py {' '.join(argv)}  ({torch.cuda.get_device_name()}, torch "
          f"{torch.__version__})")
    if varlen:
        numbers = numbers or [65536, 4, 8, 65536, 4, 64]
        for total, group, sequences in zip(numbers[::3], numbers[1::3], numbers[2::3]):
            row = measure_varlen(total, group, sequences, with_jax=with_jax, kernels=kernels, train=train)
            tables = {name: row.pop(f"{name}_kernel_ms") for name in ("varlen", "batch") if kernels}
            print(row, flush=True)
            if tables:
                _print_kernels(tables)
        return
    pairs = numbers or [8192, 4, 8192, 16]
    for seqlen, group in zip(pairs[::2], pairs[1::2]):
        print((measure_train if train else measure)(seqlen, group), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
