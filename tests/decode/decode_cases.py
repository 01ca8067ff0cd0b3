"""Random decode problems for the decode tests: dense or paged caches (with pages no sequence owns),
ragged lengths, and the comparison of out, lse and the caches after the call with the float64 reference."""
from __future__ import annotations

import numpy as np

from dualattn.decode.reference import kvcache_reference
from reference import assert_close_rel


def make_case(rng, *, batch=2, sq=1, hq=4, hkv=2, d=32, s_new=0, seqlens=None, capacity=64, page_size=None,
              spare_pages=3, rotary_dim=0, seqlen_ro=None, leftpad=False, batch_idx=False, alibi=None, sinks=None,
              dtype=np.float32):
    """A dict of NumPy inputs for flash_attn_with_kvcache (and `page_table_owned`, the pages in use)."""
    if seqlens is None:
        seqlens = rng.integers(0, capacity - s_new + 1, size=batch)
    seqlens = np.asarray(seqlens, np.int32)
    case = dict(q=rng.standard_normal((batch, sq, hq, d)).astype(dtype))
    if page_size is None:
        b_cache = batch + 2 if batch_idx else batch
        shape = (b_cache, capacity, hkv, d)
    else:
        max_pages = -(-capacity // page_size)
        num_pages = batch * max_pages + spare_pages
        order = rng.permutation(num_pages).astype(np.int32)
        case["block_table"] = order[:batch * max_pages].reshape(batch, max_pages)
        shape = (num_pages, page_size, hkv, d)
    case["k_cache"] = rng.standard_normal(shape).astype(dtype)
    case["v_cache"] = rng.standard_normal(shape).astype(dtype)
    case["cache_seqlens"] = seqlens
    if s_new:
        case["k"] = rng.standard_normal((batch, s_new, hkv, d)).astype(dtype)
        case["v"] = rng.standard_normal((batch, s_new, hkv, d)).astype(dtype)
    if rotary_dim:
        angle = rng.uniform(0, 2 * np.pi, size=(seqlen_ro or capacity, rotary_dim // 2))
        case["rotary_cos"], case["rotary_sin"] = np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)
    if leftpad:
        case["cache_leftpad"] = np.array([rng.integers(0, n + 1) for n in seqlens], np.int32)
    if batch_idx:
        case["cache_batch_idx"] = rng.permutation(batch + 2)[:batch].astype(np.int32)
    if alibi == "head":
        case["alibi_slopes"] = rng.uniform(0, 0.5, size=(hq,)).astype(np.float32)
    elif alibi == "batch":
        case["alibi_slopes"] = rng.uniform(0, 0.5, size=(batch, hq)).astype(np.float32)
    if sinks is not None:
        case["softmax_aux"] = rng.standard_normal(sinks).astype(np.float32)
    return case


def check(case: dict, result, caches_after, opts: dict, tol: float = 2e-5, cache_tol: float = 1e-6):
    """out / lse against the reference; the caches after the call: appended rows as the reference's,
    every other row bit for bit as before."""
    out, lse = result
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**case, **opts)
    assert_close_rel(np.asarray(out, np.float64), ref_out, tol, "out")
    assert_close_rel(np.asarray(lse, np.float64), ref_lse, tol, "lse")
    for name, after, ref in (("k_cache", caches_after[0], ref_k), ("v_cache", caches_after[1], ref_v)):
        after = np.asarray(after, np.float64)
        before = case[name].astype(np.float64)
        changed = ref != before
        assert np.array_equal(after[~changed], before[~changed]), f"{name}: rows outside the append changed"
        if changed.any():
            assert_close_rel(after[changed], ref[changed], cache_tol, f"{name} appended rows")
