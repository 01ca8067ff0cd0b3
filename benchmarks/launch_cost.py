"""The pieces of one torch launch's host time (torch_api/_launch.py), per kernel of a GPT-OSS sliding layer's
fwd+bwd, each repeated behind a sleeping GPU: the specialisation key, Triton's launcher with tensors and with
raw pointers, the whole cached launch, the tensors' data_ptr calls, an allocation.

    python benchmarks/launch_cost.py
"""
import time

import torch

import dualattn.torch_api as dt
from dualattn.torch_api import _launch

N = 200


def bench(label: str, fn) -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(3e8))
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    us = (time.perf_counter() - t0) / N * 1e6
    torch.cuda.synchronize()
    print(f"   {label:40s} {us:7.1f} us")


def main():
    B, S, H, D = 2, 8192, 32, 64
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    sinks = torch.randn(H, device="cuda").requires_grad_()
    leaves = [t.requires_grad_() for t in (q, k, v)] + [sinks]
    launches = {}
    cached = _launch._launch_cached

    def spy(prep, args, device):
        launches[prep.launch.kernel] = (prep, list(args), device)
        return cached(prep, args, device)
    _launch._launch_cached = spy
    for _ in range(3):
        out = dt.flash_attention(*leaves[:3], causal=True, sliding_window=(127, 0), softmax_aux=sinks)
        torch.autograd.grad(out, leaves, do)
    _launch._launch_cached = cached
    torch.cuda.synchronize()
    for name, (prep, args, device) in launches.items():
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        print(f"{name}: {len(args)} args, {len(tensors)} tensors, {len(prep.variants)} variants")
        compiled, tail = prep.variants[_launch._specialisation(args, prep.tensors, prep.ints)]
        stream = _launch._driver().get_current_stream(device.index)
        grid = prep.launch.grid
        ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]

        def run(arguments):
            compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *arguments,
                         *tail)
        bench("_specialisation", lambda: _launch._specialisation(args, prep.tensors, prep.ints))
        bench("get_current_stream", lambda: _launch._driver().get_current_stream(device.index))
        bench("compiled.run (tensors)", lambda: run(args))
        bench("compiled.run (ints for pointers)", lambda: run(ptrs))
        bench("_launch_cached", lambda: _launch._launch_cached(prep, args, device))
        bench("data_ptr x tensors", lambda: [t.data_ptr() for t in tensors])
        bench("torch.empty(1MB) x1", lambda: torch.empty(1 << 20, device="cuda"))
        bench("current_device", lambda: torch.cuda.current_device())


if __name__ == "__main__":
    main()
