"""dualattn.interop: zero-copy DLPack between torch and jax, explicit copies, and the dispatcher.

Zero-copy is proven by equal data pointers (`t.data_ptr() == a.unsafe_buffer_pointer()`) and by
aliasing (a write through one side is seen by the other), as PLATFORM.md measured.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import dualattn  # noqa: E402
from dualattn import interop  # noqa: E402
from dualattn.interop import (  # noqa: E402
    InteropCopyWarning, TransferInfo, dispatch_flash_attention, jax_to_torch, torch_to_jax)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.int32]
DTYPE_IDS = [str(d).replace("torch.", "") for d in DTYPES]


def _enable_x64():
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # older jax
        from jax.experimental import enable_x64 as ctx
    return ctx(True)


def _random(shape, dtype, device="cpu"):
    if dtype == torch.bool:
        return torch.randn(shape, device=device) > 0
    if not dtype.is_floating_point:
        return torch.randint(-1000, 1000, shape, dtype=dtype, device=device)
    return torch.randn(shape, device=device).to(dtype)


def _make(layout, dtype, device="cpu"):
    """A BSHD tensor (2, 16, 3, 32) stored contiguously or as a BHSD buffer seen through permute."""
    if layout == "contiguous":
        return _random((2, 16, 3, 32), dtype, device)
    if layout == "permuted":  # compact, not row-major: strides (1536, 32, 512, 1)
        t = _random((2, 3, 16, 32), dtype, device).permute(0, 2, 1, 3)
        assert not t.is_contiguous()
        return t
    if layout == "transposed":  # 2-D, innermost stride not 1
        return _random((48, 64), dtype, device).t()
    raise AssertionError(layout)


def _np(x):
    """numpy copy of a torch tensor or jax array, bf16 widened to fp32 for comparison."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    x = np.asarray(x)
    return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


@pytest.fixture
def no_copy_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error", InteropCopyWarning)
        yield


# ----------------------------------------------------------------------------- torch -> jax


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_to_jax_zero_copy(dtype, layout, torch_gen, no_copy_warnings):
    t = _make(layout, dtype)
    a, info = torch_to_jax(t, return_info=True)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert isinstance(info, TransferInfo)
    assert info.zero_copy and info.reason is None and not info.detached
    assert info.direction == "torch->jax" and info.device == "cpu:0"
    assert a.shape == tuple(t.shape)
    assert str(a.dtype) == info.src_dtype == info.dst_dtype == DTYPE_IDS[DTYPES.index(dtype)]
    np.testing.assert_array_equal(_np(a), _np(t))


def test_torch_to_jax_plain_return_and_debug_log(caplog, torch_gen, no_copy_warnings):
    t = torch.randn(4, 8)
    with caplog.at_level(logging.DEBUG, logger="dualattn.interop"):
        a = torch_to_jax(t)
    assert isinstance(a, jax.Array)  # no info unless asked for
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    (rec,) = [r for r in caplog.records if r.name == "dualattn.interop"]
    assert rec.levelno == logging.DEBUG and "torch->jax zero-copy" in rec.getMessage()


@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
def test_torch_to_jax_aliases_the_torch_buffer(layout, torch_gen, no_copy_warnings):
    t = _make(layout, torch.float32)
    a = torch_to_jax(t)
    t[1, 2, 0, 5] = 1234.5  # write through torch before jax reads (np.asarray caches)
    t[0].mul_(-1)
    np.testing.assert_array_equal(_np(a), _np(t))
    assert float(a[1, 2, 0, 5]) == 1234.5


@pytest.mark.parametrize("make, why", [
    (lambda: torch.randn(5, 3)[1:], "not aligned to 64 bytes"),
    (lambda: torch.randn(4, 16, 8)[:, ::2], "non-compact strides"),
    (lambda: torch.randn(4, 1, 8).expand(4, 6, 8), "non-compact strides"),
    (lambda: torch.randn(6, 8, dtype=torch.complex64).conj(), "conjugate bit"),
], ids=["misaligned", "gapped", "broadcast", "conj"])
def test_torch_to_jax_explicit_copy(make, why, torch_gen):
    t = make()
    with pytest.warns(InteropCopyWarning, match=why):
        a, info = torch_to_jax(t, return_info=True)
    assert not info.zero_copy and why in info.reason
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.resolve_conj().numpy())
    with pytest.raises(BufferError, match=why):
        torch_to_jax(t, copy=False)


@pytest.mark.parametrize("dtype, jax_dtype", [
    (torch.int64, "int32"), (torch.float64, "float32"), (torch.complex128, "complex64")])
def test_torch_to_jax_64bit_downcasts_explicitly(dtype, jax_dtype, torch_gen):
    t = (torch.randn(3, 5, dtype=torch.float64) * 100).to(dtype)
    with pytest.warns(InteropCopyWarning, match="jax_enable_x64 is off"):
        a, info = torch_to_jax(t, return_info=True)
    assert str(a.dtype) == info.dst_dtype == jax_dtype and info.src_dtype == str(dtype)[6:]
    assert not info.zero_copy
    np.testing.assert_allclose(np.asarray(a), t.numpy(), rtol=1e-6)
    with pytest.raises(BufferError):
        torch_to_jax(t, copy=False)


def test_torch_to_jax_64bit_zero_copy_under_x64(torch_gen, no_copy_warnings):
    t = torch.arange(10, dtype=torch.int64) * (1 << 40)
    with _enable_x64():
        a, info = torch_to_jax(t, return_info=True)
        assert info.zero_copy and str(a.dtype) == "int64"
        assert a.unsafe_buffer_pointer() == t.data_ptr()
        np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_torch_to_jax_copy_true_is_a_quiet_independent_copy(torch_gen, no_copy_warnings):
    t = torch.randn(4, 8)
    a, info = torch_to_jax(t, copy=True, return_info=True)
    assert not info.zero_copy and info.reason == "copy=True requested"
    assert a.unsafe_buffer_pointer() != t.data_ptr()
    expected = t.numpy().copy()
    t.zero_()
    np.testing.assert_array_equal(np.asarray(a), expected)


@pytest.mark.parametrize("non_leaf", [False, True])
def test_torch_to_jax_detaches_requires_grad(non_leaf, torch_gen, no_copy_warnings):
    leaf = torch.randn(4, 8, requires_grad=True)
    t = leaf * 2 if non_leaf else leaf
    a, info = torch_to_jax(t, return_info=True)
    assert info.detached and info.zero_copy
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())
    assert t.requires_grad  # the caller's tensor is untouched


@pytest.mark.parametrize("shape", [(), (0, 3), (4, 1, 8)], ids=["scalar", "empty", "unit-dim"])
def test_torch_to_jax_degenerate_shapes(shape, torch_gen, no_copy_warnings):
    t = torch.randn(shape)
    a, info = torch_to_jax(t, return_info=True)
    assert info.zero_copy and a.shape == shape
    np.testing.assert_array_equal(np.asarray(a), t.numpy())


def test_torch_to_jax_unit_dim_with_odd_stride_is_compact(torch_gen, no_copy_warnings):
    t = torch.randn(4, 8).as_strided((4, 1, 8), (8, 1000, 1))
    a, info = torch_to_jax(t, return_info=True)
    assert info.zero_copy and a.unsafe_buffer_pointer() == t.data_ptr()


def test_torch_to_jax_rejects_non_tensors():
    with pytest.raises(TypeError, match="torch.Tensor"):
        torch_to_jax(np.zeros(3))
    with pytest.raises(TypeError, match="strided"):
        torch_to_jax(torch.eye(3).to_sparse())


# ----------------------------------------------------------------------------- jax -> torch


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_jax_to_torch_zero_copy(dtype, torch_gen, no_copy_warnings):
    a = torch_to_jax(_random((2, 16, 3, 32), dtype).clone())
    a = a + a if dtype != torch.bool else ~a  # a jax-owned buffer, not one borrowed from torch
    t, info = jax_to_torch(a, return_info=True)
    assert t.data_ptr() == a.unsafe_buffer_pointer()
    assert info.zero_copy and info.reason is None and info.direction == "jax->torch"
    assert t.dtype == dtype and t.device.type == "cpu" and info.device == "cpu"
    assert not t.requires_grad and t.is_contiguous()
    np.testing.assert_array_equal(_np(t), _np(a))


@pytest.mark.parametrize("layout", ["contiguous", "permuted", "transposed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_round_trip_keeps_pointer_and_strides(dtype, layout, torch_gen, no_copy_warnings):
    t = _make(layout, dtype)
    back = jax_to_torch(torch_to_jax(t))
    assert back.data_ptr() == t.data_ptr()
    assert back.shape == t.shape and back.dtype == t.dtype
    np.testing.assert_array_equal(_np(back), _np(t))


def test_jax_to_torch_aliases_the_jax_buffer(no_copy_warnings):
    a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4) * 2
    t = jax_to_torch(a)
    t[1, 2] = -7.0  # aliasing is real: jax arrays are immutable only by convention here
    got = np.asarray(a)
    assert got[1, 2] == -7.0 and got[0, 1] == 2.0


def test_jax_to_torch_copy_true(no_copy_warnings):
    a = jnp.ones((3, 4), jnp.bfloat16) * 3
    t, info = jax_to_torch(a, copy=True, return_info=True)
    assert not info.zero_copy and info.reason == "copy=True requested"
    assert t.data_ptr() != a.unsafe_buffer_pointer()
    t.zero_()
    assert float(a[0, 0]) == 3.0


def test_jax_to_torch_widens_int4_explicitly():
    a = jnp.array([-8, -1, 0, 7], dtype=jnp.int4)
    with pytest.warns(InteropCopyWarning, match="int4 -> int8"):
        t, info = jax_to_torch(a, return_info=True)
    assert t.dtype == torch.int8 and t.tolist() == [-8, -1, 0, 7] and not info.zero_copy
    with pytest.raises(BufferError):
        jax_to_torch(a, copy=False)


def test_jax_to_torch_rejects_tracers_and_non_arrays():
    with pytest.raises(TypeError, match="traced"):
        jax.jit(jax_to_torch)(jnp.ones(3))
    with pytest.raises(TypeError, match="jax.Array"):
        jax_to_torch(torch.ones(3))


# ----------------------------------------------------------------------------- import hygiene


def test_import_needs_neither_framework():
    """`import dualattn.interop` works with torch and jax blocked; use gives a clear ImportError."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(dualattn.__file__)))
    code = (
        "import sys\n"
        "sys.modules['torch'] = None; sys.modules['jax'] = None\n"
        "import dualattn, dualattn.interop as io\n"
        "for f, word in ((io.torch_to_jax, 'PyTorch'), (io.jax_to_torch, 'JAX')):\n"
        "    try:\n"
        "        f(object())\n"
        "    except ImportError as e:\n"
        "        assert word in str(e) and 'pip install' in str(e), e\n"
        "    else:\n"
        "        raise SystemExit('no ImportError')\n"
        "try:\n"
        "    dualattn.flash_attention(1, 2, 3)\n"
        "except TypeError as e:\n"
        "    assert 'query' in str(e), e\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr


# ----------------------------------------------------------------------------- dispatcher


@pytest.fixture
def fake_front_ends(monkeypatch):
    """Replace both front ends by recorders, so routing is tested without the kernels."""
    calls = []

    def make(name):
        def flash_attention(query, key, value, **kwargs):
            calls.append((name, query, key, value, kwargs))
            out = (name, "out")
            return (out, (name, "lse")) if kwargs.get("return_lse") else out
        mod = types.ModuleType(f"dualattn.{name}_api")
        mod.flash_attention = flash_attention
        monkeypatch.setitem(sys.modules, f"dualattn.{name}_api", mod)

    make("torch")
    make("jax")
    return calls


@pytest.mark.parametrize("entry", [dispatch_flash_attention, dualattn.flash_attention],
                         ids=["dispatch", "dualattn.flash_attention"])
def test_dispatch_routes_torch(entry, fake_front_ends):
    q, k, v = (torch.randn(1, 4, 2, 16) for _ in range(3))
    assert entry(q, k, v, causal=True) == ("torch", "out")
    ((name, q2, k2, v2, kwargs),) = fake_front_ends
    assert name == "torch" and q2 is q and k2 is k and v2 is v and kwargs == {"causal": True}


@pytest.mark.parametrize("entry", [dispatch_flash_attention, dualattn.flash_attention],
                         ids=["dispatch", "dualattn.flash_attention"])
def test_dispatch_routes_jax(entry, fake_front_ends):
    q, k, v = (jnp.ones((1, 4, 2, 16)) for _ in range(3))
    bias = jnp.zeros((1, 2, 4, 4))
    assert entry(q, k, v, bias=bias, sliding_window=(2, 0)) == ("jax", "out")
    ((name, *_, kwargs),) = fake_front_ends
    assert name == "jax" and kwargs["bias"] is bias and kwargs["sliding_window"] == (2, 0)


def test_dispatch_return_lse_tuple_passthrough(fake_front_ends):
    q = torch.randn(1, 4, 2, 16)
    assert dispatch_flash_attention(q, q, q, return_lse=True) == (("torch", "out"), ("torch", "lse"))
    qj = jnp.ones((1, 4, 2, 16))
    assert dispatch_flash_attention(qj, qj, qj, return_lse=True) == (("jax", "out"), ("jax", "lse"))


def test_dispatch_routes_jax_tracers(fake_front_ends):
    def f(q, k, v):
        dispatch_flash_attention(q, k, v)
        return q

    jax.jit(f)(*(jnp.ones((1, 4, 2, 16)) for _ in range(3)))
    assert [c[0] for c in fake_front_ends] == ["jax"]


def test_dispatch_rejects_mixed_frameworks(fake_front_ends):
    qt = torch.randn(1, 4, 2, 16)
    qj = jnp.ones((1, 4, 2, 16))
    with pytest.raises(TypeError, match=r"query is a torch array but key \(jax\) is not"):
        dispatch_flash_attention(qt, qj, qt)
    with pytest.raises(TypeError, match=r"key \(torch\), value \(torch\) are not.*torch_to_jax"):
        dispatch_flash_attention(qj, qt, qt)
    with pytest.raises(TypeError, match=r"bias \(jax\)"):
        dispatch_flash_attention(qt, qt, qt, bias=jnp.zeros((1, 2, 4, 4)))
    with pytest.raises(TypeError, match="query must be a torch.Tensor or a jax.Array"):
        dispatch_flash_attention(np.ones((1, 4, 2, 16)), qt, qt)
    assert fake_front_ends == []  # nothing reached a front end


# ----------------------------------------------------------------------------- CUDA


def _jax_gpu_or_skip():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        pytest.skip("jax has no GPU backend")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "permuted"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.bool],
                         ids=["bfloat16", "float16", "float32", "bool"])
def test_cuda_zero_copy_both_ways(dtype, layout, no_copy_warnings):
    gpus = _jax_gpu_or_skip()
    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    t = _make(layout, dtype, device=dev)
    a, info = torch_to_jax(t, return_info=True)
    assert info.zero_copy and a.unsafe_buffer_pointer() == t.data_ptr()
    (jdev,) = a.devices()
    assert jdev.platform == "gpu" and jdev.local_hardware_id == dev.index and jdev in gpus
    np.testing.assert_array_equal(_np(a), _np(t))

    t.fill_(True if dtype == torch.bool else 3)  # torch writes on its stream; jax reads after
    torch.cuda.synchronize(dev)
    assert bool((a == (True if dtype == torch.bool else 3)).all())

    b = ~a if dtype == torch.bool else a * 2  # a jax-owned device buffer (and no cached host copy)
    u, info = jax_to_torch(b, return_info=True)
    assert info.zero_copy and u.data_ptr() == b.unsafe_buffer_pointer()
    assert u.device == dev and info.device == str(dev) and u.dtype == dtype
    np.testing.assert_array_equal(_np(u), _np(b))

    back = jax_to_torch(torch_to_jax(t))
    assert back.data_ptr() == t.data_ptr() and back.stride() == t.stride()


@pytest.mark.gpu
def test_cuda_offset_view_is_shared_and_gapped_view_copied():
    _jax_gpu_or_skip()
    t = torch.randn(64, 3, device="cuda")
    # XLA's GPU client, unlike the CPU one, takes pointers that are only element-aligned.
    with warnings.catch_warnings():
        warnings.simplefilter("error", InteropCopyWarning)
        a, info = torch_to_jax(t[1:], return_info=True)
    assert info.zero_copy and a.unsafe_buffer_pointer() == t[1:].data_ptr()
    np.testing.assert_array_equal(np.asarray(a), t[1:].cpu().numpy())
    with pytest.warns(InteropCopyWarning, match="non-compact"):
        a, info = torch_to_jax(t[:, ::2], return_info=True)
    assert not info.zero_copy and info.device.startswith("gpu:")
    np.testing.assert_array_equal(np.asarray(a), t[:, ::2].cpu().numpy())


@pytest.mark.parametrize("value", ["yes", "False", 1, 0.0])
def test_copy_and_return_info_must_be_bools(value):
    """copy="no" would copy and return_info="False" return a pair, read by truthiness: rejected, naming
    the argument, in both directions."""
    t, a = torch.ones(4), jnp.ones(4)
    for convert, x in ((torch_to_jax, t), (jax_to_torch, a)):
        with pytest.raises(TypeError, match="copy"):
            convert(x, copy=value)
        with pytest.raises(TypeError, match="return_info"):
            convert(x, return_info=value)
    assert jax_to_torch(a, copy=np.bool_(False)).shape == (4,)
