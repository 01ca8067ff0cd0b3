"""Ahead-of-time compilation of a `Launch` for a CUDA target, without a GPU (CI).

`triton.compile` builds TTIR -> TTGIR -> LLVM -> PTX -> cubin on a CPU-only machine, so
CI can catch the GPU-only compile errors (layouts, shared memory, MMA shapes, ptxas) that
the interpreter never sees.  The ASTSource is built from the very `Launch` the front ends
run, with the argument specialisation a real launch gets:

* pointers: typed from the array dtypes; an absent optional input is launched with the
  launch's first input as a dummy pointer (torch_api/_launch.py), so it is typed like it.
  Every pointer gets 16-byte divisibility (torch: allocator-aligned tensors; jax-triton
  assumes it for every array).
* scalars: python ints are i32 (i64 outside the int32 range), floats fp32.
  `specialize` picks the launcher to mirror:
  - "torch" (Triton's JITFunction): an int equal to 1 becomes a constexpr and an int
    divisible by 16 gets tt.divisibility=16, except for parameters listed in the kernel's
    `do_not_specialize` (plain i32); pointers get divisibility 16 unless listed in
    `do_not_specialize_on_alignment`.
  - "jax" (jax-triton 0.3.1): every int equal to 1 becomes a constexpr -- jax-triton ignores
    `do_not_specialize` -- other ints stay plain i32; every pointer gets divisibility 16.
  - "none": plain i32 scalars, no attributes at all.

Framework-free: imports triton only.
"""
from __future__ import annotations

import importlib
from typing import Dict, Optional, Tuple

from .launch import Launch, compile_options

# numpy/torch/jax dtype names -> Triton pointer element types
_TRITON_TYPES = {
    "bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}
_DIVISIBILITY_16 = [["tt.divisibility", 16]]
SPECIALIZATIONS = ("torch", "jax", "none")


def triton_type(dtype_name: str) -> str:
    """'bfloat16' (or 'torch.bfloat16') -> 'bf16'."""
    name = str(dtype_name).replace("torch.", "")
    try:
        return _TRITON_TYPES[name]
    except KeyError:
        raise TypeError(f"no Triton pointer type for dtype {dtype_name!r}") from None


def kernel_function(launch: Launch, package: str = "dualattn.kernels"):
    """The compiled-mode @triton.jit function a launch runs."""
    return getattr(importlib.import_module(f"{package}.{launch.module}"), launch.kernel)


def _scalar(value, specialize: str, param):
    """(signature type, attrs or None, constexpr value or None) of one scalar argument."""
    if isinstance(value, bool):
        raise TypeError(f"bool scalar {value!r}: launch plans pass bools as constexprs")
    if isinstance(value, int):
        by_value = specialize == "jax" or (specialize == "torch" and not param.do_not_specialize)
        if by_value and value == 1:
            return "constexpr", None, 1
        ty = "i32" if -(1 << 31) <= value < (1 << 31) else "i64"
        divisible = (specialize == "torch" and not param.do_not_specialize
                     and not param.do_not_specialize_on_alignment and value % 16 == 0)
        return ty, (_DIVISIBILITY_16 if divisible else None), None
    if isinstance(value, float):
        if specialize == "jax" and value == 1:   # jax-triton compares every scalar with 1, floats too
            return "constexpr", None, 1
        return "fp32", None, None  # the launchers pass float32 (jax: np.float32; torch: fp32)
    raise TypeError(f"unsupported scalar {value!r} of type {type(value).__name__}")


def signature_of(launch: Launch, dtypes: Dict[str, str], fn=None, *, specialize: str = "torch"
                 ) -> Tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the ASTSource for `launch`.

    `dtypes` maps the launch's input names to dtype names ('bfloat16', 'int32', ...); an
    input missing from it is absent and typed like the launch's first input.  Checks that
    the plan's argument names and count line up with the kernel's parameters.
    """
    if specialize not in SPECIALIZATIONS:
        raise ValueError(f"specialize must be one of {SPECIALIZATIONS}, got {specialize!r}")
    fn = kernel_function(launch) if fn is None else fn
    names = list(fn.arg_names)
    constexpr_params = [p.name for p in fn.params if p.is_constexpr]
    if not launch.inputs:
        dummy = None
    else:
        if launch.inputs[0] not in dtypes:
            raise ValueError(f"{launch.kernel}: the first input {launch.inputs[0]!r} must be given "
                             "(absent inputs are launched with it as a dummy pointer)")
        dummy = dtypes[launch.inputs[0]]

    def out_dtype(spec: str) -> str:
        if spec.startswith("like:"):
            src = spec[5:]
            return dtypes.get(src, dummy) if src in launch.inputs else dtypes[src]
        return spec

    first_scalar = len(launch.inputs)
    n_runtime = first_scalar + len(launch.scalars) + len(launch.outputs)
    if n_runtime + len(launch.constexprs) != len(names):
        raise ValueError(f"{launch.kernel}: the plan passes {n_runtime} arguments and {len(launch.constexprs)} "
                         f"constexprs, the kernel takes {len(names)} parameters")
    scalar_names = [n for n, _ in launch.scalars]
    kernel_scalars = names[first_scalar:first_scalar + len(scalar_names)]
    if kernel_scalars != scalar_names:
        bad = [(p, k) for p, k in zip(scalar_names, kernel_scalars) if p != k]
        raise ValueError(f"{launch.kernel}: plan scalars do not match kernel parameters (plan, kernel): {bad}")
    if set(dict(launch.constexprs)) != set(names[n_runtime:]) or set(names[n_runtime:]) != set(constexpr_params):
        raise ValueError(f"{launch.kernel}: plan constexprs {sorted(dict(launch.constexprs))} != kernel "
                         f"constexpr parameters {sorted(constexpr_params)}")
    positional = ([("*" + triton_type(dtypes.get(n, dummy)), None, None) for n in launch.inputs]
                  + [_scalar(v, specialize, fn.params[first_scalar + i]) for i, (_, v) in enumerate(launch.scalars)]
                  + [("*" + triton_type(dummy if o.scratch and specialize == "torch" else out_dtype(o.dtype)),
                      None, None) for o in launch.outputs])   # torch passes a dummy for scratch outputs

    signature, constexprs, attrs = {}, {}, {}
    for i, (ty, attr, const) in enumerate(positional):
        name = names[i]
        signature[name] = ty
        if ty.startswith("*"):
            if specialize == "jax" or (specialize == "torch" and not fn.params[i].do_not_specialize_on_alignment
                                       and not fn.params[i].do_not_specialize):
                attrs[(i,)] = _DIVISIBILITY_16
        elif ty == "constexpr":
            constexprs[name] = const
        elif attr is not None:
            attrs[(i,)] = attr
    for name, value in launch.constexprs:
        signature[name] = "constexpr"
        constexprs[name] = value
    # ASTSource wants the signature in parameter order.
    signature = {n: signature[n] for n in names}
    return signature, constexprs, attrs


def ast_source(launch: Launch, dtypes: Dict[str, str], *, specialize: str = "torch", fn=None):
    """The kernel's source as triton.compile takes it: a GluonASTSource for Gluon kernels."""
    import triton.compiler
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    fn = kernel_function(launch) if fn is None else fn
    signature, constexprs, attrs = signature_of(launch, dtypes, fn, specialize=specialize)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource
    return source(fn, signature=signature, constexprs=constexprs, attrs=attrs)


def compile_launch(launch: Launch, dtypes: Dict[str, str], *, arch: int = 90, specialize: str = "torch",
                   options: Optional[dict] = None):
    """Compile `launch` for sm_<arch> (CUDA, warp size 32); returns Triton's CompiledKernel.

    `.asm['ptx']` holds the PTX and `.asm['cubin']` the ptxas output.
    """
    import triton
    from triton.backends.compiler import GPUTarget

    opts = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, **compile_options(launch)}
    opts.update(options or {})
    return triton.compile(ast_source(launch, dtypes, specialize=specialize),
                          target=GPUTarget("cuda", int(arch), 32), options=opts)


def ptxas_usage(compiled, arch: int = 90) -> Tuple[int, int]:
    """(registers a thread, spill-store bytes) that Triton's own ptxas (the one it compiles with, as
    jax_api/ptxas.triton_ptxas finds it) reports (-v) for a compile_launch result's PTX, assembled
    for sm_<arch> (sm_90a for 90)."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas
    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(compiled.asm["ptx"])
        log = subprocess.run([ptxas, "--gpu-name", f"sm_{arch}{'a' if arch == 90 else ''}", "-v", src, "-o",
                              os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    return int(re.findall(r"Used (\d+) registers", log)[0]), int(re.findall(r"(\d+) bytes spill stores", log)[0])
