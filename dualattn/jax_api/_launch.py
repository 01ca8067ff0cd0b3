"""Run a framework-neutral `Launch` on jax arrays.

GPU: `jax_triton.triton_call` on the compiled kernel (imported lazily: jax_triton refuses
to import on a CPU-only jaxlib; the `jax-gpu` extra installs it).  CPU: the interpreted kernel,
inside `jax.pure_callback`, on the NumPy arrays the callback receives (kernels/host.py; no
torch needed).  Both consume the same Launch, so they run the same kernel variant with the same
grid and tiles.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import Dict, Optional

import jax
import jax.numpy as jnp
import numpy as np

from ..kernels import _interpret, host
from ..kernels.launch import Launch, compile_options
from . import _compile, _scratch, ptxas

_DTYPES = {"float16": jnp.float16, "bfloat16": jnp.bfloat16, "float32": jnp.float32, "int32": jnp.int32,
           "int8": jnp.int8}


def _out_dtype(spec: str, arrays: Dict[str, jax.Array]):
    return arrays[spec[5:]].dtype if spec.startswith("like:") else _DTYPES[spec]


def _on_gpu(x) -> bool:
    try:
        return all(d.platform == "gpu" for d in x.devices())
    except Exception:  # a tracer: ask where computations go by default
        return jax.default_backend() == "gpu"


@functools.lru_cache(maxsize=None)
def gpu_arch() -> int:
    """Compute capability of the first GPU as 90 / 80 (what the launch plans key tiles on)."""
    cc = getattr(jax.devices("gpu")[0], "compute_capability", "9.0")
    major, minor = str(cc).split(".")[:2]
    return int(major) * 10 + int(minor)


@functools.lru_cache(maxsize=None)
def jax_triton_available() -> bool:
    """Whether jax-triton is installed (the `jax-gpu` extra): the GPU route needs it, the CPU one does not."""
    return importlib.util.find_spec("jax_triton") is not None


@functools.lru_cache(maxsize=None)
def _import_jax_triton():
    # jax_triton sets TRITON_CACHE_DIR="" on import, which breaks torch's Triton launches
    # in the same process (PLATFORM.md pitfall 1): restore it.
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    # Before the first launch is traced, so before jaxlib assembles any of our kernels.
    ptxas.apply_env(gpu_arch())
    _compile.install(jax_triton)
    return jax_triton


def _scalar(value):
    # jax-triton types python floats as fp64 (pitfall 2): the kernels take fp32.
    return np.float32(value) if isinstance(value, float) else int(value)


def run(launch: Launch, arrays: Dict[str, Optional[jax.Array]]) -> Dict[str, jax.Array]:
    """Launch with the named input arrays (absent ones get a dummy pointer); returns the outputs."""
    return _run_sequential_vmap(launch, {n: a for n, a in arrays.items() if a is not None})


def _types(outputs, arrays: Dict[str, jax.Array]):
    return [jax.ShapeDtypeStruct(o.shape, _out_dtype(o.dtype, arrays)) for o in outputs]


def _run(launch: Launch, arrays: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    results = _run_one(launch, arrays)
    if launch.then is not None:  # into fresh buffers: it reads what it resumes from its own inputs
        resumed = {name: results[result] for name, result in launch.then.resume}
        results.update(_run(launch.then, {**arrays, **resumed}))
    return results


def _run_one(launch: Launch, arrays: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    first = next(iter(arrays.values()))
    if 0 in launch.grid:
        # No program runs (an empty batch, no queries): the outputs hold what they hold before a launch.
        # (CUDA rejects an empty grid, which Triton's own launcher skips but jax-triton passes on.)
        return {o.name: jnp.full(o.shape, o.fill if o.zeroed else 0, _out_dtype(o.dtype, arrays))
                for o in launch.results}
    if _on_gpu(first):
        jt = _import_jax_triton()
        kernel = _interpret.kernel(launch.module, launch.kernel, interpret=False)
        dummy = arrays[launch.inputs[0]] if launch.inputs[0] in arrays else first
        args = [arrays.get(name, dummy) for name in launch.inputs] + [_scalar(v) for _, v in launch.scalars]
        if any(o.scratch for o in launch.outputs):
            _scratch.register(jt, launch.kernel, _scratch.ptx_param_count(launch))
        zeroed = tuple(i for i, o in enumerate(launch.outputs) if o.zeroed)  # must be hashable
        _compile.require_options(kernel, launch.constexpr_dict, launch.num_warps, launch.num_stages,
                                 compile_options(launch))
        outs = jt.triton_call(*args, kernel=kernel, out_shape=_types(launch.outputs, arrays), grid=launch.grid,
                              num_warps=launch.num_warps, num_stages=launch.num_stages,
                              zeroed_outputs=zeroed, **launch.constexpr_dict)
        outs = [x for o, x in zip(launch.outputs, outs) if not o.scratch]
    else:
        names = list(arrays)
        out_types = _types(launch.results, arrays)
        outs = jax.pure_callback(_HostLaunch(launch, names, [t.dtype for t in out_types]), out_types,
                                 *[arrays[n] for n in names], vmap_method="sequential")
    return {o.name: x for o, x in zip(launch.results, outs)}


def _run_sequential_vmap(launch: Launch, arrays: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
    # Under jax.vmap the launch (fixed grid and shapes) runs once per vmapped element.
    names = list(arrays)

    @jax.custom_batching.sequential_vmap
    def call(*values):
        return _run(launch, dict(zip(names, values)))

    return call(*[arrays[n] for n in names])


class _HostLaunch:
    """The pure_callback body: the interpreted kernel on the host buffers, as NumPy arrays."""

    def __init__(self, launch: Launch, names, out_dtypes):
        # One launch: _run runs the chain, one callback per launch.
        self.launch, self.names, self.out_dtypes = dataclasses.replace(launch, then=None), names, out_dtypes

    def __call__(self, *values):
        arrays = {}
        for name, value in zip(self.names, values):
            array = np.asarray(value)
            # The interpreter computes bf16 on raw integers: upcast on the CPU path only.
            arrays[name] = array.astype(np.float32) if array.dtype == jnp.bfloat16 else array
        results = host.run(self.launch, arrays)
        return tuple(results[o.name].astype(np.dtype(want), copy=False)
                     for o, want in zip(self.launch.results, self.out_dtypes))
