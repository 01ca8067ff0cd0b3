"""flash_attn_with_kvcache (torch, CPU interpreter) against the float64 reference."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualattn.torch_api import flash_attn_with_kvcache  # noqa: E402
from decode_cases import check, make_case  # noqa: E402


def _run(case: dict, **opts):
    t = {n: torch.from_numpy(np.array(x)) for n, x in case.items()}
    out, lse = flash_attn_with_kvcache(**t, return_softmax_lse=True, **opts)
    return (out.numpy(), lse.numpy()), (t["k_cache"].numpy(), t["v_cache"].numpy())


def _check(case, tol=2e-5, **opts):
    result, caches = _run(case, **opts)
    check(case, result, caches, opts, tol)


def test_dense_ragged_append(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=4, sq=2, hq=8, hkv=2, s_new=2, capacity=96, seqlens=[0, 17, 94, 61])
    _check(case, causal=True)


def test_no_append_whole_cache_and_splits(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, hq=4, hkv=4, capacity=80, seqlens=[80, 0])
    _check(case, num_splits=3)
    del case["cache_seqlens"]           # the whole capacity
    _check(case, num_splits=1)


@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_paged(seed, page_size):
    rng = np.random.default_rng(seed)
    capacity = max(2 * page_size, 48)
    case = make_case(rng, batch=3, sq=1, hq=4, hkv=2, s_new=1, capacity=capacity, page_size=page_size,
                     seqlens=[0, capacity // 2 + 3, capacity - 1])
    _check(case, causal=True)


@pytest.mark.parametrize("group,sq", [(1, 1), (2, 3), (4, 8), (8, 2), (16, 1), (16, 5)])
def test_gqa_and_query_lengths(seed, group, sq):
    rng = np.random.default_rng(seed)
    hkv = 1 if group == 16 else 2
    case = make_case(rng, batch=2, sq=sq, hq=group * hkv, hkv=hkv, s_new=sq, capacity=64, page_size=16)
    _check(case, causal=True)


@pytest.mark.parametrize("opts,extra", [
    (dict(window_size=(9, 0)), {}),
    (dict(window_size=(5, 3)), dict(leftpad=True)),
    (dict(softcap=2.5, causal=True), dict(alibi="head")),
    (dict(causal=True), dict(alibi="batch", batch_idx=True)),
    (dict(causal=True), dict(sinks=(4, 3))),
    (dict(), dict(sinks=(4,))),
    (dict(window_size=(4, 1)), dict(sinks=(2,))),
])
def test_options(seed, opts, extra):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=3, sq=3, hq=4, hkv=2, s_new=2, capacity=72, seqlens=[0, 30, 70], **extra)
    _check(case, softmax_scale=0.3, **opts)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_rotary(seed, interleaved, causal):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=2, hq=4, hkv=2, d=48, s_new=2, capacity=64, page_size=16, rotary_dim=32)
    _check(case, causal=causal, rotary_interleaved=interleaved)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(seed, dtype):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=1, hq=8, hkv=2, d=64, s_new=1, capacity=64, rotary_dim=16)
    t = {n: torch.from_numpy(x) for n, x in case.items()}
    half = getattr(torch, dtype)
    for n in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin"):
        t[n] = t[n].to(half)
    before = t["k_cache"].clone()
    out, lse = flash_attn_with_kvcache(**t, causal=True, return_softmax_lse=True)
    wide = {n: (x.double().numpy() if x.is_floating_point() else x.numpy()) for n, x in t.items()}
    wide["k_cache"], wide["v_cache"] = before.double().numpy(), wide["v_cache"]
    from dualattn.decode.reference import kvcache_reference
    ref_out, ref_lse, ref_k, _ = kvcache_reference(**wide, causal=True)
    from reference import assert_close_rel
    assert out.dtype == half
    assert_close_rel(out.double(), ref_out, 2e-2, "out")
    assert_close_rel(lse, ref_lse, 1e-2, "lse")
    assert_close_rel(t["k_cache"].double(), ref_k, 1e-2, "k_cache")


def test_empty_rows_zero_and_sinks_lse(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=1, hq=2, hkv=2, capacity=32, seqlens=[0, 5])
    (out, lse), _ = _run(case)
    assert np.all(out[0] == 0) and np.all(np.isneginf(lse[0]))
    case["softmax_aux"] = np.array([0.5, -1.0], np.float32)
    (out, lse), _ = _run(case)
    assert np.all(out[0] == 0) and np.allclose(lse[0, :, 0], [0.5, -1.0])


def test_strided_cache_view(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=1, hq=4, hkv=2, s_new=1, capacity=40)
    big_k = torch.randn(2, 40, 3, 32)
    big_v = torch.randn(2, 40, 3, 32)
    big_k[:, :, :2] = torch.from_numpy(case["k_cache"])
    big_v[:, :, :2] = torch.from_numpy(case["v_cache"])
    kc, vc = big_k[:, :, :2], big_v[:, :, :2]          # gapped head stride
    spare = big_k[:, :, 2].clone()
    t = {n: torch.from_numpy(x) for n, x in case.items() if n not in ("k_cache", "v_cache")}
    out, lse = flash_attn_with_kvcache(k_cache=kc, v_cache=vc, **t, causal=True, return_softmax_lse=True)
    check(case, (out.numpy(), lse.numpy()), (kc.numpy(), vc.numpy()), dict(causal=True))
    assert torch.equal(big_k[:, :, 2], spare)


def _tensors(case):
    return {n: torch.from_numpy(x) for n, x in case.items()}


def test_bad_input_names_the_argument(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, s_new=1, capacity=32, page_size=8)
    t = _tensors(case)
    bad = dict(t, block_table=t["block_table"].clone())
    bad["block_table"][1, 0] = 10 ** 4
    with pytest.raises(ValueError, match="block_table"):
        flash_attn_with_kvcache(**bad)
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(**dict(t, cache_seqlens=torch.tensor([0, 32], dtype=torch.int32)))
    with pytest.raises(TypeError, match="k_cache"):
        flash_attn_with_kvcache(**dict(t, k_cache=t["k_cache"].half()))
    with pytest.raises(TypeError, match="cache_seqlens"):
        flash_attn_with_kvcache(**dict(t, cache_seqlens=t["cache_seqlens"].long()))
    with pytest.raises(ValueError, match="k_cache"):
        flash_attn_with_kvcache(**dict(t, k_cache=t["k_cache"].to("meta")))
    with pytest.raises(ValueError, match="q heads"):
        flash_attn_with_kvcache(**dict(t, q=torch.randn(2, 1, 3, 32)))
    with pytest.raises(ValueError, match="cache_batch_idx"):
        flash_attn_with_kvcache(**dict(t, cache_batch_idx=torch.zeros(2, dtype=torch.int32)))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_with_kvcache(**t, window_size=(-2, 0))
    with pytest.raises(ValueError, match="rotary_dim"):
        flash_attn_with_kvcache(**t, rotary_cos=torch.randn(32, 4), rotary_sin=torch.randn(32, 4))


def test_garbage_device_values_stay_inside_the_cache(seed):
    """Values the host does not check (as on the GPU): the kernels clamp them.  The caches are views
    into buffers with poisoned guard pages on both sides, which must come back untouched."""
    from dualattn.decode import torch as decode_torch
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=3, sq=2, hq=4, hkv=2, s_new=2, capacity=32, page_size=8, rotary_dim=16)
    t = _tensors(case)
    guard = torch.full((2,) + t["k_cache"].shape[1:], 1e30)
    k_buf = torch.cat([guard, t["k_cache"], guard])
    v_buf = torch.cat([guard, t["v_cache"], guard])
    kc, vc = k_buf[2:-2], v_buf[2:-2]
    seqlens = torch.tensor([-7, 10 ** 6, 31], dtype=torch.int32)
    table = t["block_table"].clone()
    table[0, 0], table[1, -1], table[2, 1] = -3, 10 ** 5, 2 ** 31 - 1
    statics = (0.2, -1, 0, 0.0, True, 2, True)
    q_rot = decode_torch._append_impl(t["q"], t["k"], t["v"], kc, vc, t["rotary_cos"], t["rotary_sin"], seqlens,
                                      None, table, *statics)
    out, lse = decode_torch._attend_impl(q_rot, kc, vc, seqlens, None, torch.tensor([5, -2, 40], dtype=torch.int32),
                                         table, None, None, 2, *statics)
    assert torch.isfinite(out).all()
    for buf in (k_buf, v_buf):
        assert torch.equal(buf[:2], guard) and torch.equal(buf[-2:], guard)


def test_torch_compile_fullgraph(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=1, hq=4, hkv=2, s_new=1, capacity=32, page_size=8, rotary_dim=16)
    eager, compiled = _tensors(case), _tensors(case)
    fn = torch.compile(flash_attn_with_kvcache, fullgraph=True, backend="aot_eager")
    ref = flash_attn_with_kvcache(**eager, causal=True)
    got = fn(**compiled, causal=True)
    assert torch.equal(got, ref)
    assert torch.equal(compiled["k_cache"], eager["k_cache"]) and torch.equal(compiled["v_cache"], eager["v_cache"])


@pytest.mark.slow
@pytest.mark.parametrize("page_size", list(range(1, 33)))
def test_page_size_sweep(seed, page_size):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=2, hq=4, hkv=2, s_new=2, capacity=64, page_size=page_size)
    _check(case, causal=True)
