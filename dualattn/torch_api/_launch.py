"""Run a framework-neutral `Launch` on torch tensors (compiled on CUDA, interpreted on CPU)."""
from __future__ import annotations

import threading
from typing import Dict, Optional

import torch

from ..kernels import _interpret
from ..kernels.launch import Launch

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "int32": torch.int32, "int8": torch.int8}


# Triton's interpreter patches triton.language module-wide while a kernel runs, so two
# interpreted launches at once (jax's per-shard callbacks under shard_map run in parallel
# threads) corrupt each other: run them one at a time.
_INTERPRETER_LOCK = threading.Lock()


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
    kernel = _interpret.kernel(launch.module, launch.kernel, interpret=interpret)
    # The dummy is never read: its use is gated by a constexpr HAS_* flag.
    args = [arrays.get(name) if arrays.get(name) is not None else first for name in launch.inputs]
    args += [value for _, value in launch.scalars]
    outputs = dict(outputs or {})
    for out in launch.outputs:
        if out.name not in outputs:
            alloc = torch.zeros if out.zeroed else torch.empty
            outputs[out.name] = alloc(out.shape, dtype=output_dtype(out.dtype, arrays), device=device)
        args.append(outputs[out.name])
    with torch.cuda.device(device) if device.type == "cuda" else _INTERPRETER_LOCK:
        kernel[launch.grid](*args, **launch.constexpr_dict, num_warps=launch.num_warps,
                            num_stages=launch.num_stages)
    return outputs

