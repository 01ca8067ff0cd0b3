"""Run a framework-neutral `Launch` on torch tensors (compiled on CUDA, interpreted on CPU)."""
from __future__ import annotations

import functools
import threading
from typing import Dict, Optional, Tuple

import torch
import triton
from triton.runtime import _allocation

from ..kernels import _interpret
from ..kernels.launch import Launch, compile_options

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "int32": torch.int32, "int8": torch.int8}


def _scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """Kernels that build TMA descriptors (rules.row_tiles) keep them in a global scratch
    buffer that Triton's launcher requests per launch through triton.set_allocator, which is
    unset by default.  Install a torch one unless the user set their own (it is a
    ContextVar: each thread starts unset)."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


class _Prepared:
    """What launching one `Launch` takes that does not change between calls, worked out on its
    first call: the kernel, the scalar arguments, the outputs' allocation, the constexpr values
    and, per specialisation, the CompiledKernel.  A steady workload sees the same few (memoised)
    plans, so each call only binds tensors and launches: re-reading the plan per launch would be
    host time that counts at short sequences (docs/lessons.md, "Fewer Python layers per call")."""

    __slots__ = ("launch", "kernel", "interpreted", "scalars", "outputs", "constexprs", "tensors", "ints",
                 "variants")

    def __init__(self, launch: Launch, interpret: bool):
        self.launch = launch
        self.kernel = _interpret.kernel(launch.module, launch.kernel, interpret=interpret)
        self.interpreted = interpret
        self.scalars = [value for _, value in launch.scalars]
        # (name, allocator, shape, dtype spec, scratch, placeholder) in signature order.
        self.outputs = tuple((o.name, _allocator(o), o.shape, o.dtype, o.scratch, o.placeholder)
                             for o in launch.outputs)
        self.constexprs = launch.constexpr_dict
        self.tensors = self.ints = None  # argument positions Triton specialises: set on the first launch
        self.variants = {}  # specialisation -> (CompiledKernel, constexpr values in signature order)

    def positions(self, args: list) -> None:
        # A launch's argument kinds are fixed: inputs and outputs are tensors (absent inputs get a
        # dummy tensor), scalars keep their python type.
        self.tensors = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.ints = tuple(p.num for p in self.kernel.params[:len(args)]
                          if not p.do_not_specialize and not p.is_constexpr and type(args[p.num]) is int)


def _allocator(output):
    """torch.empty, torch.zeros or a torch.full with the output's fill value."""
    if not output.zeroed:
        return torch.empty
    if output.fill == 0.0:
        return torch.zeros
    return functools.partial(torch.full, fill_value=output.fill)


# (launch, interpreted) -> its _Prepared record.  Keyed on the launch's value: the flash plans, memoised,
# find theirs by identity at once; plans built anew on every call (NSA's) find the record of an equal
# launch, where keying on id(launch) added a record, and a first launch through the JITFunction, per call.
_COMPILED: Dict[Tuple[Launch, bool], _Prepared] = {}
_COMPILED_LOCK = threading.Lock()


def _prepared(launch: Launch, interpret: bool) -> _Prepared:
    key = (launch, interpret)
    prep = _COMPILED.get(key)
    if prep is None:
        with _COMPILED_LOCK:
            prep = _COMPILED.setdefault(key, _Prepared(launch, interpret))
    return prep


def _specialisation(args: list, tensors: Tuple[int, ...], ints: Tuple[int, ...]) -> tuple:
    """What Triton's JITFunction specialises a compiled variant on: each tensor's dtype and
    16-byte alignment, and each int not in do_not_specialize being 1 or a multiple of 16."""
    return (tuple((args[i].dtype, args[i].data_ptr() % 16 == 0) for i in tensors)
            + tuple((args[i] == 1, args[i] % 16 == 0) for i in ints))


def _launch_cached(prep: _Prepared, args: list, device: torch.device) -> None:
    """Launch through the JITFunction the first time per specialisation; then call its
    CompiledKernel directly.  JITFunction.run binds and specialises the ~90 arguments again on
    every call, host time that counts at short sequences (benchmarks/host_overhead.py).  The
    call below is the one JITFunction.run ends with (Triton 3.6 and 3.7)."""
    launch = prep.launch
    if prep.tensors is None:
        prep.positions(args)
    spec = _specialisation(args, prep.tensors, prep.ints)
    hit = prep.variants.get(spec)
    if hit is None:
        compiled = prep.kernel[launch.grid](*args, **prep.constexprs, num_warps=launch.num_warps,
                                            num_stages=launch.num_stages, **compile_options(launch))
        prep.variants[spec] = (compiled, [prep.constexprs[name] for name in prep.kernel.arg_names[len(args):]])
        return
    compiled, tail = hit
    stream = _driver().get_current_stream(device.index)
    runtime = triton.knobs.runtime
    enter_hook = runtime.launch_enter_hook
    # launch_metadata only builds the hooks' argument: None without hooks (Triton 3.6 and 3.7).
    meta = None if enter_hook is None else compiled.launch_metadata(launch.grid, stream, *args, *tail)
    g0, g1, g2 = launch.grid
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, meta, enter_hook,
                 runtime.launch_exit_hook, *args, *tail)


def _driver():
    return triton.runtime.driver.active


@functools.lru_cache(maxsize=None)
def _dummy(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One element of `dtype` on `device`, passed for every placeholder output (never written or
    read, so sharing it is safe on any stream); of the output's dtype, so the compiled variant is
    the one a real buffer would get."""
    return torch.empty(1, dtype=dtype, device=device)


def output_dtype(spec: str, arrays: Dict[str, torch.Tensor]) -> torch.dtype:
    return arrays[spec[5:]].dtype if spec.startswith("like:") else _DTYPES[spec]


def run(launch: Launch, arrays: Dict[str, Optional[torch.Tensor]],
        outputs: Optional[Dict[str, torch.Tensor]] = None, device=None) -> Dict[str, torch.Tensor]:
    """Launch `launch` with the named input tensors; absent inputs get a dummy pointer.

    Outputs are allocated here (zero-filled where the plan says so) unless preallocated
    tensors are passed in `outputs`.
    """
    first = arrays[launch.inputs[0]] if launch.inputs else None
    device = torch.device(device) if device is not None else first.device
    interpret = device.type == "cpu"
    prep = _prepared(launch, interpret)
    # The dummy is never read: its use is gated by a constexpr HAS_* flag.
    args = [arrays.get(name) for name in launch.inputs]
    args = [first if a is None else a for a in args]
    args += prep.scalars
    outputs = dict(outputs) if outputs else {}
    for name, alloc, shape, dtype, scratch, placeholder in prep.outputs:
        if scratch:  # Triton's launcher passes its own global scratch (_ensure_scratch_allocator)
            args.append(first)
            continue
        out = outputs.get(name)
        if out is None:
            dtype = output_dtype(dtype, arrays)
            # (Interpreted launches allocate every output: the JAX interpreter path returns them.)
            out = outputs[name] = (_dummy(dtype, device) if placeholder and not interpret
                                   else alloc(shape, dtype=dtype, device=device))
        args.append(out)
    if interpret:
        with _interpret.LAUNCH_LOCK:
            prep.kernel[launch.grid](*args, **prep.constexprs, num_warps=launch.num_warps,
                                     num_stages=launch.num_stages)
    else:
        # (Cheaper than telling which kernels build descriptors: TMA, warp-specialised, Gluon.)
        _ensure_scratch_allocator()
        if device.index == torch.cuda.current_device():
            _launch_cached(prep, args, device)
        else:
            with torch.cuda.device(device):
                _launch_cached(prep, args, device)
    if launch.then is not None:  # in place: its resumed inputs are the outputs it writes
        resumed = {name: outputs[result] for name, result in launch.then.resume}
        return run(launch.then, {**arrays, **resumed}, outputs, device)
    return outputs
