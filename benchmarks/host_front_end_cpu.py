"""The torch front end's host time per call with the kernels stubbed out (no launch, no
interpreter), planned as on an H100 (warp specialisation and Gluon allowed, 132 SMs): what the
Python around a launch costs, on any machine (CPU is enough).  A regression check for the
front end's per-call work: validation, config selection, planning, the memo of planned calls.

    python benchmarks/host_front_end_cpu.py [causal 0|1 [cProfile sort key]]
"""
import cProfile
import pstats
import sys
import time

import torch

import dualattn.torch_api as dt
from dualattn.kernels import _interpret
from dualattn.torch_api import flash as front


class _NoKernel:
    params = []
    arg_names = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


_interpret.kernel = lambda *args, **kwargs: _NoKernel()
front._warp_specialize = lambda a: True
front._gluon = lambda a, ws: True
front._num_sms = lambda a: 132
front._cpu_upcast = lambda t: t  # the CPU path's bf16 -> fp32 copies are not the GPU path's work

B, S, H, D = 1, 1024, 16, 128
q, k, v = (torch.randn(B, S, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
for causal in (False, True):
    with torch.no_grad():
        def forward():
            return dt.flash_attention(q, k, v, causal=causal)
        for _ in range(20):
            forward()
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            forward()
        print(f"causal={causal} forward host time {(time.perf_counter() - t0) / n * 1e6:.1f} us per call")
if len(sys.argv) > 1:
    causal = sys.argv[1] == "1"
    with torch.no_grad():
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            dt.flash_attention(q, k, v, causal=causal)
        profile.disable()
    pstats.Stats(profile).sort_stats(sys.argv[2] if len(sys.argv) > 2 else "tottime").print_stats(40)
