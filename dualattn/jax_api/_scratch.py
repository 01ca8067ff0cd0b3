"""What jax-triton's launches lack for kernels that build TMA descriptors: global scratch and
the warp count of warp-specialised kernels.

1. `tl.make_tensor_descriptor` writes each program's descriptors to Triton's global scratch, a
   hidden pointer parameter after the kernel's own (then a second, for profiling).  Triton's
   launcher allocates it; jaxlib passes a null pointer (jaxlib/gpu/triton_kernels.cc: TMA "we do
   not use yet", b/381242007), so the kernel would fault.
2. Warp specialisation adds warps (a producer, more consumer warpgroups) and the PTX requires
   that many threads (`.reqntid`), but jax-triton registers the kernel with the num_warps it
   compiled with, and the launch fails.

Our descriptor-building kernels take a last pointer parameter, DESC_SCRATCH, that the JAX
launcher fills with an output buffer of grid x plan.DESC_SCRATCH_BYTES (launch.Output.scratch).
When jax-triton hands such a kernel's PTX to jaxlib, `fix_kernel` makes it read its scratch base
from DESC_SCRATCH instead of the hidden parameter and registers the thread count the PTX asks
for.  Both are rewrites of the PTX text; tests/jax/test_scratch.py checks them on Triton's PTX
offline, and the GPU tests compare these launches with torch's bit for bit.
"""
from __future__ import annotations

import re
import threading
from typing import Dict, Set, Tuple

# Kernels whose last own parameter is DESC_SCRATCH, by name, with the PTX parameter counts their
# launches compile to (registered by the launcher as it launches them): a kernel of another
# library that shares a name but not a count is left alone.
_SCRATCH_KERNELS: Dict[str, Set[int]] = {}
_LOCK = threading.Lock()

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(([^)]*)\)")
_REQNTID = re.compile(r"\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?")


def entry_params(ptx: str) -> Tuple[str, list]:
    """(kernel name, its parameter names in order) from the PTX's .entry."""
    match = _ENTRY.search(ptx)
    if match is None:
        raise ValueError("no .entry in the PTX")
    name = match.group(1)
    return name, re.findall(rf"\b{name}_param_\d+\b", match.group(2))


def ptx_param_count(launch) -> int:
    """The parameters of `launch`'s kernel as jax-triton compiles it: arrays, outputs and scalars,
    less the scalars equal to 1 (jax-triton makes those constexprs), plus Triton's two scratch
    pointers."""
    ones = sum(1 for _, value in launch.scalars if value == 1)
    return len(launch.inputs) + len(launch.scalars) - ones + len(launch.outputs) + 2


def redirect_global_scratch(ptx: str) -> str:
    """The PTX with the hidden global-scratch parameter's reads taken from the kernel's last own
    parameter (DESC_SCRATCH) instead; unchanged if the kernel reads no global scratch."""
    name, params = entry_params(ptx)
    if len(params) < 3:
        raise ValueError(f"{name}: expected DESC_SCRATCH and Triton's two scratch parameters, "
                         f"the PTX has {len(params)} parameters")
    desc_scratch, hidden = params[-3], params[-2]   # [..., DESC_SCRATCH, global scratch, profile scratch]
    if f"[{hidden}]" not in ptx:
        return ptx
    if f"[{desc_scratch}]" in ptx:
        raise ValueError(f"{name}: its last parameter is read by the kernel; a DESC_SCRATCH "
                         "parameter must be left to the launcher")
    return ptx.replace(f"[{hidden}]", f"[{desc_scratch}]")


def launch_warps(ptx: str, compiled_warps: int) -> int:
    """The warps a launch of this PTX must have: its .reqntid (warp specialisation adds warps to
    those it was compiled with), else compiled_warps."""
    match = _REQNTID.search(ptx)
    if match is None:
        return compiled_warps
    threads = 1
    for g in match.groups():
        threads *= int(g or 1)
    return threads // 32


class _KernelLibrary:
    """jaxlib's gpu_triton module, with TritonKernel fixed for the registered kernels."""

    def __init__(self, library):
        self._library = library

    def __getattr__(self, name):
        return getattr(self._library, name)

    def TritonKernel(self, name, num_warps, num_ctas, shared_mem_bytes, ptx, *rest):  # noqa: N802
        # jax-triton 0.3.1 passes (name, num_warps, num_ctas, shared_mem_bytes, ptx, ttir, compute_capability).
        if len(entry_params(ptx)[1]) in _SCRATCH_KERNELS.get(name, ()):
            ptx = redirect_global_scratch(ptx)
            num_warps = launch_warps(ptx, num_warps)
        return self._library.TritonKernel(name, num_warps, num_ctas, shared_mem_bytes, ptx, *rest)


def register(jax_triton, kernel_name: str, n_params: int) -> None:
    """Fix `kernel_name`'s launches through jax-triton whose PTX has `n_params` parameters: its own
    (DESC_SCRATCH last) and Triton's two scratch pointers.  Idempotent."""
    with _LOCK:
        _SCRATCH_KERNELS.setdefault(kernel_name, set()).add(n_params)
        lib = jax_triton.triton_lib
        if not isinstance(lib.triton_kernel_call_lib, _KernelLibrary):
            lib.triton_kernel_call_lib = _KernelLibrary(lib.triton_kernel_call_lib)
