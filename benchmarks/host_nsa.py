"""Host time of the torch NSA forward against its device time, and the same forward replayed from a CUDA
graph: where the GPU idles between launches at short sequences (bf16, D 128, Hkv 4, block 64, 16 selected
blocks, window 512, bench_nsa.py's inputs, no gradients).

    python benchmarks/host_nsa.py [T GROUP ...]        (default: 8192 4 8192 16)

Per (T, group): the host's ms per call (30 back-to-back calls, before the wait), the wall ms per call,
the device ms per call (torch.profiler, kernels and copies), and the wall ms per replay of one captured
call.  The forward makes no host synchronisation (torch.cuda.set_sync_debug_mode finds none), so it
captures as it is.
"""
import sys
import time
import warnings

import torch

import dualattn.torch_api as dt
from dualattn.bench.flash import captured


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
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as syncs:
            warnings.simplefilter("always")
            call()
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            call()
        issued = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
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
    return dict(seqlen=seqlen, group=group, host_ms=1e3 * (issued - start) / calls,
                wall_ms=1e3 * (done - start) / calls, device_ms=device_ms, graph_replay_ms=replay_ms,
                graph_output_equal=same, host_syncs=len([w for w in syncs if "synchroniz" in str(w.message)]))


def main(argv):
    pairs = [int(a) for a in argv] or [8192, 4, 8192, 16]
    print(f"# python benchmarks/host_nsa.py {' '.join(argv)}  ({torch.cuda.get_device_name()}, torch "
          f"{torch.__version__})")
    for seqlen, group in zip(pairs[::2], pairs[1::2]):
        print(measure(seqlen, group), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
