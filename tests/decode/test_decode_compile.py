"""The decode kernel variants compile for sm_90 and sm_80 (triton.compile on CPU, as a real launch
specialises them: kernels/compile_check.py), with the GPU tiles and split counts of the plans."""
from __future__ import annotations

import types

import pytest

pytest.importorskip("triton")

from dualattn.decode import plan as decode_plan  # noqa: E402
from dualattn.kernels import compile_check  # noqa: E402


def _array(shape, dtype):
    return types.SimpleNamespace(shape=tuple(shape), dtype=dtype)


def _shapes(dtype="bfloat16", paged=True, page_size=16, batch=8, hq=32, hkv=8, d=128, sq=1, s_new=1, rotary=True,
            extras=False):
    cache = (batch * 64 if paged else batch, page_size if paged else 1024, hkv, d)
    return decode_plan.check_args(
        _array((batch, sq, hq, d), dtype), _array(cache, dtype), _array(cache, dtype),
        _array((batch, s_new, hkv, d), dtype) if s_new else None,
        _array((batch, s_new, hkv, d), dtype) if s_new else None,
        _array((4096, d // 2), dtype) if rotary else None, _array((4096, d // 2), dtype) if rotary else None,
        _array((batch,), "int32"), None, _array((batch,), "int32") if extras else None,
        _array((batch, 64), "int32") if paged else None,
        _array((hq,), "float32") if extras else None, _array((hq, 2), "float32") if extras else None)


VARIANTS = [
    ("paged16-rotary", dict(), dict(causal=True)),
    ("dense-extras", dict(paged=False, extras=True, sq=4, s_new=4, rotary=False),
     dict(causal=True, window_size=(100, 0), softcap=30.0)),
    ("page1-fp16-d64-mqa", dict(dtype="float16", page_size=1, hkv=1, d=64, batch=1), dict()),
]


def _dtypes(shapes, dtype):
    """The dtypes of the arrays a call has (absent ones are launched with a dummy: left out)."""
    names = {n: dtype for n in ("q", "k_cache", "v_cache")}
    names.update(cache_seqlens="int32", o_part="float32", lse_part="float32")
    if shapes.s_new:
        names.update(k=dtype, v=dtype)
    if shapes.rotary_dim:
        names.update(rotary_cos=dtype, rotary_sin=dtype)
    if shapes.paged:
        names.update(block_table="int32")
    if shapes.has_leftpad:
        names.update(cache_leftpad="int32")
    if shapes.alibi:
        names.update(alibi_slopes="float32")
    if shapes.num_sinks:
        names.update(softmax_aux="float32")
    return names


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize("name,shape,opts", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_decode_kernels_compile(arch, name, shape, opts):
    shapes = _shapes(**shape)
    options = decode_plan.DecodeOptions.make(shapes.d, **opts)
    dtype = shape.get("dtype", "bfloat16")
    launches = decode_plan.plan_attend(shapes, options, 132).chain + (decode_plan.plan_append(shapes, options, True),)
    for launch in launches:
        compiled = compile_check.compile_launch(launch, _dtypes(shapes, dtype), arch=arch)
        assert compiled.asm["cubin"], f"{launch.kernel}: no cubin for sm_{arch}"
