"""Gluon kernels and register-capped launches through jax-triton (jax_api/_compile.py), checked without
a GPU: the specialisation matches jax-triton's, the one-pass backward compiles to PTX that _scratch can
fix and jaxlib can launch, a capped NSA launch compiles with its cap, and the installed hook sends Gluon
functions and the variants `require_options` named, and only them, through triton.compile.

The GPU side (the JAX launch runs it and gives torch's gradients bit for bit) is in tests/parity.
"""
from __future__ import annotations

import types

import numpy as np
import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("jax")

from dualattn.jax_api import _compile, _launch, _scratch  # noqa: E402
from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.launch import row_major_strides  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.validation import FlashShapes  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402


def _one_pass_plan(monkeypatch, b=1, s=4096, hq=8, hkv=2, d=128, causal=True):
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    shapes = FlashShapes(b, s, s, hq, hkv, d, d, "bfloat16")
    strides = {n: row_major_strides((b, s, h, d)) for n, h in
               (("query", hq), ("key", hkv), ("value", hkv), ("out", hq))}
    plan = flash_plan.plan_backward(shapes, FlashOptions.build(head_dim=d, causal=causal), strides,
                                    config=flash_plan.default_config(shapes, interpret=False), warp_specialize=True,
                                    gluon=True, num_sms=132, lse_grad=True)
    assert plan.dkdv.kernel == "flash_bwd_one_pass_kernel"
    return plan


def _jax_triton_call(launch, dtypes):
    """(arg_dtypes, scalar_args) as jax-triton 0.3.1 hands them to get_or_create_triton_kernel for
    our launch (_launch._run_one): arrays, then the scalars at their positions, then the outputs."""
    signature, _, _ = compile_check.signature_of(launch, dtypes, specialize="none")
    names = list(signature)
    scalar_args = []
    for i, (name, value) in enumerate(launch.scalars, start=len(launch.inputs)):
        assert names[i] == name
        value = _launch._scalar(value)
        scalar_args.append((i, "fp32" if isinstance(value, np.float32) else signature[name], value))
    n_args = len(launch.inputs) + len(launch.scalars) + len(launch.outputs)
    return [signature[n] for n in names[:n_args]], tuple(scalar_args)


_DTYPES = dict.fromkeys(("query", "key", "value", "dout"), "bfloat16") | dict(lse="float32", delta="float32")


def test_specialisation_is_jax_tritons(monkeypatch):
    """The same signature, constexprs and pointer alignment compile_check mirrors for jax-triton
    (ints equal to 1 are constexprs whatever do_not_specialize says; B=1 here)."""
    launch = _one_pass_plan(monkeypatch).dkdv
    fn = compile_check.kernel_function(launch)
    arg_dtypes, scalar_args = _jax_triton_call(launch, _DTYPES)
    assert any(v == 1 for _, _, v in scalar_args)
    assert _compile.specialisation(fn, arg_dtypes, scalar_args, launch.constexpr_dict) == \
        compile_check.signature_of(launch, _DTYPES, fn, specialize="jax")


def test_one_pass_backward_compiles_as_jax_launches_it(monkeypatch):
    plan = _one_pass_plan(monkeypatch)
    launch = plan.dkdv
    fn = compile_check.kernel_function(launch)
    assert _compile.is_gluon(fn) and not _compile.is_gluon(compile_check.kernel_function(plan.dq))
    arg_dtypes, scalar_args = _jax_triton_call(launch, _DTYPES)
    binary = _compile.compile_kernel(fn, arg_dtypes, scalar_args, num_warps=launch.num_warps,
                                     num_stages=launch.num_stages, num_ctas=1, compute_capability=90,
                                     enable_fp_fusion=True, metaparams=launch.constexpr_dict)
    assert binary.name == launch.kernel and binary.shared_mem_bytes > 100_000
    # What _scratch.register keys the fixes on, and the fixes themselves.
    assert len(_scratch.entry_params(binary.ptx)[1]) == _scratch.ptx_param_count(launch)
    fixed = _scratch.redirect_global_scratch(binary.ptx)
    assert fixed != binary.ptx   # the kernel builds its descriptors in global scratch
    assert _scratch.launch_warps(fixed, launch.num_warps) == 12   # 8 compute warps + a warpgroup of workers
    # Every array argument (inputs and outputs) is declared 16-byte aligned: jax-triton reads these.
    arrays = [i for i, ty in enumerate(arg_dtypes) if ty.startswith("*")]
    assert sorted(binary.attrs) == [(i,) for i in arrays] and len(arrays) == len(launch.inputs) + len(launch.outputs)


class _FakeKernelLibrary:
    def __init__(self):
        self.kernels = []

    def TritonKernel(self, *args):  # noqa: N802
        self.kernels.append(args)
        return ("kernel", args[0])

    def get_compute_capability(self, device):
        return 90


def test_install_routes_gluon_functions_and_required_options_only(monkeypatch):
    plan = _one_pass_plan(monkeypatch)
    gluon_fn, triton_fn = (compile_check.kernel_function(x) for x in (plan.dkdv, plan.dq))
    original_calls, compiled = [], []

    def original(*args, **kwargs):
        original_calls.append(args[2])
        return "jax-triton's kernel", {}

    def fake_compile(fn, arg_dtypes, scalar_args, **kwargs):
        compiled.append((fn, kwargs))
        return _compile.CompiledBinary(fn.__name__, "ptx", "ttgir", 1234, {(0,): [["tt.divisibility", 16]]})

    library = _FakeKernelLibrary()
    lib = types.SimpleNamespace(get_or_create_triton_kernel=original, triton_kernel_call_lib=library)
    jax_triton = types.SimpleNamespace(triton_lib=lib)
    monkeypatch.setattr(_compile, "compile_kernel", fake_compile)
    monkeypatch.setattr(_compile, "_CACHE", {})
    monkeypatch.setattr(_compile, "_OPTIONS", {})
    _compile.install(jax_triton)
    hook = lib.get_or_create_triton_kernel
    _compile.install(jax_triton)
    assert lib.get_or_create_triton_kernel is hook   # idempotent

    kwargs = dict(num_warps=8, num_stages=2, num_ctas=1, compute_capability=None, enable_fp_fusion=True,
                  metaparams={"BLOCK_M": 64}, dump=False)
    assert hook(None, "cuda", triton_fn, ["*fp32"], (), **kwargs) == ("jax-triton's kernel", {})
    assert original_calls == [triton_fn] and not compiled

    kernel, attrs = hook(None, "cuda", gluon_fn, ["*bf16", "i32"], ((1, "i32", 7),), **kwargs)
    assert kernel == ("kernel", gluon_fn.__name__) and attrs == {(0,): [["tt.divisibility", 16]]}
    assert library.kernels == [(gluon_fn.__name__, 8, 1, 1234, "ptx", "ttgir", 90)]
    assert compiled[0][1]["compute_capability"] == 90
    # Cached: another call with another int (not 1) reuses the kernel; an int equal to 1 is a new variant.
    hook(None, "cuda", gluon_fn, ["*bf16", "i32"], ((1, "i32", 9),), **kwargs)
    assert len(compiled) == 1
    hook(None, "cuda", gluon_fn, ["*bf16", "i32"], ((1, "i32", 1),), **kwargs)
    assert len(compiled) == 2
    with pytest.raises(ValueError, match="NVIDIA GPUs only"):
        hook(None, "rocm", gluon_fn, ["*bf16", "i32"], ((1, "i32", 7),), **kwargs)
    assert all(c[1]["options"] is None for c in compiled)
    # A Triton kernel's variant with required options goes through triton.compile with them; its other
    # variants (other constexprs, warps) keep jax-triton's path.
    _compile.require_options(triton_fn, {"BLOCK_M": 64}, 8, 2, {"maxnreg": 168})
    hook(None, "cuda", triton_fn, ["*fp32"], (), **kwargs)
    assert compiled[-1][0] is triton_fn and compiled[-1][1]["options"] == {"maxnreg": 168}
    hook(None, "cuda", triton_fn, ["*fp32"], (), **dict(kwargs, metaparams={"BLOCK_M": 128}))
    hook(None, "cuda", triton_fn, ["*fp32"], (), **dict(kwargs, num_warps=4))
    assert original_calls == [triton_fn] * 3 and len(compiled) == 3
