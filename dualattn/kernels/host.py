"""Run a framework-neutral `Launch` on NumPy arrays through Triton's interpreter, without torch.

The JAX front end runs the interpreted kernels on CPU inside `jax.pure_callback`, which hands it
NumPy arrays; launching them from here needs neither torch nor a copy.  The kernel variant, grid
and tiles are the launch plan's, as in the torch launcher, so both front ends compute the same
numbers bit for bit on CPU (tests/parity).
"""
from __future__ import annotations

from typing import Dict

import numpy as np

from . import _interpret
from .launch import Launch

_DTYPES = {"float16": np.float16, "float32": np.float32, "int32": np.int32, "int8": np.int8}


class _HostArray:
    """A NumPy array as Triton's interpreter takes a kernel argument.

    The interpreter reads and writes memory through `data_ptr()` and types the pointer from
    `dtype` (NumPy dtypes map to Triton's: float32 -> *fp32).  Around each launch it copies every
    argument to the host and back through the torch methods below (GridExecutor's
    _init_args_hst / _restore_args_dev, the same in Triton 3.6 and 3.7); these buffers already are
    host memory, so each of those steps is the identity and the kernel works on the array itself.
    """

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray):
        self.array, self.dtype = array, array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> "_HostArray":
        return self

    def cpu(self) -> "_HostArray":
        return self

    def new_empty(self, *shape, **kwargs) -> "_HostArray":
        return self

    def set_(self, *view) -> "_HostArray":
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self):
        return self.array.shape

    def stride(self):
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def copy_(self, source) -> "_HostArray":
        return self


def _output_dtype(spec: str, arrays: Dict[str, np.ndarray]) -> np.dtype:
    return arrays[spec[5:]].dtype if spec.startswith("like:") else np.dtype(_DTYPES[spec])


def run(launch: Launch, arrays: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Run `launch` alone (not its `then`) on the named row-major input arrays; absent inputs get a
    dummy pointer.  Returns its results, in fresh arrays (every output allocated, zero-filled or
    filled where the plan says so).  bf16 is not taken: callers pass it as float32."""
    arrays = {name: np.ascontiguousarray(a) for name, a in arrays.items()}
    first = arrays[launch.inputs[0]]
    # The dummy is never read: its use is gated by a constexpr HAS_* flag.
    args = [_HostArray(arrays.get(name, first)) for name in launch.inputs]
    args += [value for _, value in launch.scalars]
    results = {}
    for output in launch.outputs:
        if output.scratch:  # descriptors the interpreter builds live in Python objects, not here
            args.append(_HostArray(first))
            continue
        dtype = _output_dtype(output.dtype, arrays)
        buffer = np.full(output.shape, output.fill, dtype) if output.zeroed else np.empty(output.shape, dtype)
        results[output.name] = buffer
        args.append(_HostArray(buffer))
    kernel = _interpret.kernel(launch.module, launch.kernel, interpret=True)
    with _interpret.LAUNCH_LOCK:
        kernel[launch.grid](*args, **launch.constexpr_dict, num_warps=launch.num_warps,
                            num_stages=launch.num_stages)
    return results
