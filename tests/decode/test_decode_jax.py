"""flash_attn_with_kvcache in JAX (triton on the CPU interpreter, xla) against the float64 reference, and
bit for bit against torch on the triton backend."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from dualattn.jax_api import flash_attn_with_kvcache  # noqa: E402
from decode_cases import check, make_case  # noqa: E402


def _run(case: dict, backend: str, **opts):
    a = {n: jnp.asarray(x) for n, x in case.items()}
    res = flash_attn_with_kvcache(**a, return_softmax_lse=True, backend=backend, **opts)
    if "k" in case:
        out, lse, kc, vc = res
    else:
        (out, lse), kc, vc = res, a["k_cache"], a["v_cache"]
    return (np.asarray(out), np.asarray(lse)), (np.asarray(kc), np.asarray(vc))


CASES = [
    (dict(batch=3, sq=2, hq=8, hkv=2, s_new=2, capacity=64, seqlens=[0, 20, 62]), dict(causal=True)),
    (dict(batch=2, sq=3, hq=4, hkv=1, s_new=3, capacity=48, page_size=16, rotary_dim=16),
     dict(causal=True, rotary_interleaved=False)),
    (dict(batch=2, sq=2, hq=4, hkv=2, s_new=1, capacity=40, page_size=1, alibi="batch", sinks=(4, 2)),
     dict(window_size=(6, 0), softcap=3.0)),
    (dict(batch=2, sq=1, hq=4, hkv=2, capacity=40, leftpad=True, batch_idx=True, sinks=(3,)), dict(num_splits=2)),
]


@pytest.mark.parametrize("backend", ["triton", "xla"])
@pytest.mark.parametrize("index", range(len(CASES)))
def test_against_reference(seed, backend, index):
    shape, opts = CASES[index]
    case = make_case(np.random.default_rng(seed), **shape)
    result, caches = _run(case, backend, **opts)
    check(case, result, caches, opts)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_equals_jax_bitwise(seed, dtype):
    torch = pytest.importorskip("torch")
    from dualattn.torch_api import flash_attn_with_kvcache as torch_fn
    case = make_case(np.random.default_rng(seed), batch=2, sq=2, hq=8, hkv=2, s_new=2, capacity=64, page_size=16,
                     rotary_dim=32, alibi="head", sinks=(8,))
    opts = dict(causal=True, softcap=4.0, num_splits=3)
    floats = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin")
    t = {n: torch.from_numpy(x) for n, x in case.items()}
    a = {n: jnp.asarray(x) for n, x in case.items()}
    for n in floats:
        t[n] = t[n].to(getattr(torch, dtype))
        a[n] = a[n].astype(dtype)
    out_t, lse_t = torch_fn(**t, return_softmax_lse=True, **opts)
    out_j, lse_j, kc_j, vc_j = flash_attn_with_kvcache(**a, return_softmax_lse=True, backend="triton", **opts)
    as_np = (lambda x: x.float().numpy())
    assert np.array_equal(as_np(out_t), np.asarray(out_j.astype(jnp.float32)))
    assert np.array_equal(lse_t.numpy(), np.asarray(lse_j))
    assert np.array_equal(as_np(t["k_cache"]), np.asarray(kc_j.astype(jnp.float32)))
    assert np.array_equal(as_np(t["v_cache"]), np.asarray(vc_j.astype(jnp.float32)))


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_jit_with_donated_caches(seed, backend):
    case = make_case(np.random.default_rng(seed), batch=2, sq=1, hq=4, hkv=2, s_new=1, capacity=32, page_size=8,
                     rotary_dim=16)
    opts = dict(causal=True)

    def step(q, k_cache, v_cache, k, v, cache_seqlens, block_table, rotary_cos, rotary_sin):
        return flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens=cache_seqlens,
                                       block_table=block_table, return_softmax_lse=True, backend=backend, **opts)

    names = ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens", "block_table", "rotary_cos", "rotary_sin")
    args = [jnp.asarray(case[n]) for n in names]
    jitted = jax.jit(step, donate_argnums=(1, 2))
    hlo = jitted.lower(*args).as_text()
    assert hlo.count("tf.aliasing_output") == 2 or "jax.buffer_donor" in hlo
    out, lse, kc, vc = jitted(*args)
    check(case, (np.asarray(out), np.asarray(lse)), (np.asarray(kc), np.asarray(vc)), opts)


def test_traced_garbage_is_clamped(seed):
    """Under jit the host cannot read cache_seqlens or block_table: out-of-range values are clamped by
    the kernels and the scatter drops rows it cannot place; the call neither fails nor writes outside."""
    case = make_case(np.random.default_rng(seed), batch=3, sq=1, hq=4, hkv=2, s_new=1, capacity=32, page_size=8)
    seqlens = jnp.asarray([-5, 10 ** 6, 31], jnp.int32)
    table = np.array(case["block_table"])
    table[0, 0], table[1, -1] = -3, 10 ** 5
    fn = jax.jit(lambda *a: flash_attn_with_kvcache(*a[:5], cache_seqlens=a[5], block_table=a[6], causal=True))
    out, kc, vc = fn(*(jnp.asarray(case[n]) for n in ("q", "k_cache", "v_cache", "k", "v")), seqlens, jnp.asarray(table))
    assert np.isfinite(np.asarray(out)).all()
    # Sequence 0 (seqlens -5 -> 0) writes its row 0 to page table[0, 0] = -3: dropped; sequence 1's
    # (past the capacity) is dropped; sequence 2 writes row 31 of its last page.
    changed = np.nonzero(np.any(np.asarray(kc) != case["k_cache"], axis=(1, 2, 3)))[0]
    assert list(changed) == [case["block_table"][2, 3]]


def test_bad_input(seed):
    case = make_case(np.random.default_rng(seed), batch=2, s_new=1, capacity=32, page_size=8)
    a = {n: jnp.asarray(x) for n, x in case.items()}
    bad = np.array(case["block_table"])
    bad[0, 1] = 999
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(**dict(a, block_table=bad))
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(**dict(a, cache_seqlens=np.array([32, 0], np.int32)))
    with pytest.raises(TypeError, match="v_cache"):
        flash_attn_with_kvcache(**dict(a, v_cache=a["v_cache"].astype(jnp.float16)))
    with pytest.raises(ValueError, match="backend"):
        flash_attn_with_kvcache(**a, backend="pallas")
