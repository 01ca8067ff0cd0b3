"""Kernels jax-triton cannot compile as our launch plans ask: Gluon kernels, and launches with a
register cap.

jax-triton 0.3.1 lowers every kernel the same way: it builds a Triton `ASTSource`, generates TTIR
and runs the TTIR -> TTGIR -> LLVM -> PTX passes itself, with warps, stages, CTAs and fp fusion as its
only options.  A Gluon kernel (`gluon.jit`, such as the one-pass backward in
kernels/flash/backward_gluon.py) is written at the TTGIR level: it needs a `GluonASTSource` and
Triton's Gluon pipeline, which `triton.compile` runs.  A launch with `max_registers` (Launch) needs
Triton's `maxnreg` option, which torch's launcher passes and jax-triton has no argument for.

`install` wraps jax-triton's `get_or_create_triton_kernel` so that, for Gluon functions and for the
variants `require_options` named, the PTX comes from `triton.compile` with the argument
specialisation jax-triton gives every kernel (pointers 16-byte aligned, ints equal to 1 made
constexprs, other scalars plain).  The kernel is then registered with jaxlib exactly as jax-triton
registers its own, through `triton_kernel_call_lib.TritonKernel`, so _scratch's fixes (DESC_SCRATCH,
the warp count of warp-specialised kernels) apply to it as well.  Every other kernel keeps
jax-triton's path.

`compile_kernel` is the part that needs no GPU: tests/jax/test_gluon_launch.py runs it on the CPU.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Dict, Optional, Sequence, Tuple

_DIVISIBILITY_16 = [["tt.divisibility", 16]]
_LOCK = threading.Lock()
_CACHE: Dict[tuple, object] = {}
# (kernel function, sorted constexprs, warps, stages) -> triton.compile options beyond those: filled by
# require_options when a launch is traced, read when jax-triton lowers it (later, inside jit).
_OPTIONS: Dict[tuple, Dict[str, object]] = {}


@dataclasses.dataclass(frozen=True)
class CompiledBinary:
    """What jaxlib's TritonKernel takes from a kernel compiled here, and the argument attributes
    jax-triton's lowering reads back (which array parameters are 16-byte aligned)."""

    name: str
    ptx: str
    ttgir: str
    shared_mem_bytes: int
    attrs: Dict[Tuple[int], list]


def is_gluon(fn) -> bool:
    from triton.experimental.gluon._runtime import GluonJITFunction
    return isinstance(fn, GluonJITFunction)


def specialisation(fn, arg_dtypes: Sequence[str], scalar_args, metaparams: dict):
    """(signature, constexprs, attrs) as jax-triton 0.3.1 specialises a call: `arg_dtypes` are the
    Triton types of all arguments in order ('*bf16', 'i32', 'fp32'), `scalar_args` the
    (index, type, value) of the scalars, `metaparams` the constexprs."""
    names = fn.arg_names
    signature = {names[i]: ty for i, ty in enumerate(arg_dtypes)}
    constexprs = dict(metaparams)
    constexprs.update({names[i]: 1 for i, _, value in scalar_args if value == 1})
    for name in constexprs:
        signature[name] = "constexpr"
    attrs = {(i,): _DIVISIBILITY_16 for i, ty in enumerate(arg_dtypes) if ty.startswith("*")}
    return {n: signature[n] for n in names}, constexprs, attrs


def _variant(fn, metaparams: dict, num_warps: int, num_stages: int) -> tuple:
    return fn, tuple(sorted(metaparams.items())), num_warps, num_stages


def require_options(fn, metaparams: dict, num_warps: int, num_stages: int, options: Dict[str, object]) -> None:
    """Compile this variant of `fn` (its constexprs, warps and stages) with triton.compile `options`
    (Launch.max_registers: {"maxnreg": n}) wherever jax-triton lowers it."""
    if options:
        with _LOCK:
            _OPTIONS[_variant(fn, metaparams, num_warps, num_stages)] = dict(options)


def compile_kernel(fn, arg_dtypes: Sequence[str], scalar_args, *, num_warps: int, num_stages: int, num_ctas: int,
                   compute_capability: int, enable_fp_fusion: bool, metaparams: dict,
                   options: Optional[Dict[str, object]] = None) -> CompiledBinary:
    """Compile a kernel call (Gluon or Triton) for a CUDA target as jax-triton would launch it, with
    `options` added to triton.compile's."""
    import triton
    import triton.compiler
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, constexprs, attrs = specialisation(fn, arg_dtypes, scalar_args, metaparams)
    source_type = GluonASTSource if is_gluon(fn) else triton.compiler.ASTSource
    source = source_type(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    opts = dict(num_warps=num_warps, num_stages=num_stages, num_ctas=num_ctas, enable_fp_fusion=enable_fp_fusion,
                **(options or {}))
    compiled = triton.compile(source, target=GPUTarget("cuda", compute_capability, 32), options=opts)
    return CompiledBinary(name=compiled.metadata.name, ptx=compiled.asm["ptx"], ttgir=compiled.asm["ttgir"],
                          shared_mem_bytes=compiled.metadata.shared, attrs=attrs)


def install(jax_triton) -> None:
    """Route jax-triton's kernel creation for Gluon functions and required options through
    `compile_kernel`.  Idempotent."""
    lib = jax_triton.triton_lib
    with _LOCK:
        if getattr(lib.get_or_create_triton_kernel, "_dualattn_compile", False):
            return
        original = lib.get_or_create_triton_kernel

        def get_or_create_triton_kernel(backend_init_func, platform, fn, arg_dtypes, scalar_args, *, num_warps,
                                        num_stages, num_ctas, compute_capability, enable_fp_fusion, metaparams,
                                        dump):
            num_warps = 4 if num_warps is None else num_warps
            num_stages = 3 if num_stages is None else num_stages
            with _LOCK:
                options = _OPTIONS.get(_variant(fn, metaparams, num_warps, num_stages))
            if not is_gluon(fn) and options is None:
                return original(backend_init_func, platform, fn, arg_dtypes, scalar_args, num_warps=num_warps,
                                num_stages=num_stages, num_ctas=num_ctas, compute_capability=compute_capability,
                                enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, dump=dump)
            if platform != "cuda":
                raise ValueError(f"{fn.__name__} is a Gluon kernel or needs {options}: NVIDIA GPUs only, not "
                                 f"{platform}")
            if compute_capability is None:
                compute_capability = lib.triton_kernel_call_lib.get_compute_capability(0)
            key = (fn, tuple(arg_dtypes), tuple((i, v == 1) for i, _, v in scalar_args),
                   tuple(sorted(metaparams.items())), num_warps, num_stages, num_ctas, compute_capability,
                   enable_fp_fusion, tuple(sorted((options or {}).items())))
            with _LOCK:
                entry = _CACHE.get(key)
            if entry is None:
                binary = compile_kernel(fn, arg_dtypes, scalar_args, num_warps=num_warps, num_stages=num_stages,
                                        num_ctas=num_ctas, compute_capability=compute_capability,
                                        enable_fp_fusion=enable_fp_fusion, metaparams=metaparams, options=options)
                kernel = lib.triton_kernel_call_lib.TritonKernel(binary.name, num_warps, num_ctas,
                                                                 binary.shared_mem_bytes, binary.ptx, binary.ttgir,
                                                                 compute_capability)
                entry = (kernel, binary.attrs)
                with _LOCK:
                    _CACHE[key] = entry
            return entry

        get_or_create_triton_kernel._dualattn_compile = True
        lib.get_or_create_triton_kernel = get_or_create_triton_kernel
