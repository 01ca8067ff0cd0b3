"""flash_attn_with_kvcache on a CUDA GPU: bf16 against the float64 reference at decode sizes, a CUDA graph
of a decode step, torch.compile(fullgraph=True), and torch = JAX bit for bit through jax-triton."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualattn.decode.reference import kvcache_reference  # noqa: E402
from dualattn.torch_api import flash_attn_with_kvcache  # noqa: E402
from decode_cases import make_case  # noqa: E402
from reference import assert_close_rel  # noqa: E402

pytestmark = pytest.mark.gpu
FLOATS = ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin")


def _cuda(case: dict, dtype=torch.bfloat16) -> dict:
    return {n: torch.from_numpy(x).cuda().to(dtype if n in FLOATS else torch.from_numpy(x).dtype)
            for n, x in case.items()}


def _wide(t: dict) -> dict:
    return {n: x.double().cpu().numpy() if x.is_floating_point() else x.cpu().numpy() for n, x in t.items()}


@pytest.mark.parametrize("page_size", [None, 1, 16, 64, 256])
@pytest.mark.parametrize("sq", [1, 4])
def test_bf16_against_reference(seed, page_size, sq):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=4, sq=sq, hq=32, hkv=8, d=128, s_new=sq, capacity=2048, page_size=page_size,
                     rotary_dim=64, seqlens=[0, 1000, 2047 - sq, 517], alibi="head", sinks=(32,))
    t = _cuda(case)
    before = _wide(t)
    out, lse = flash_attn_with_kvcache(**t, causal=True, softcap=30.0, return_softmax_lse=True)
    ref_out, ref_lse, ref_k, ref_v = kvcache_reference(**before, causal=True, softcap=30.0)
    assert_close_rel(out, ref_out, 1e-2, "out")
    assert_close_rel(lse, ref_lse, 1e-3, "lse")
    k_after = t["k_cache"].double().cpu().numpy()
    changed = ref_k != before["k_cache"]
    assert np.array_equal(k_after[~changed], before["k_cache"][~changed])
    assert_close_rel(k_after[changed], ref_k[changed], 1e-2, "appended k")


def test_long_cache_splits(seed):
    """B = 1 over 64k keys: the plan splits the keys across the SMs; the combine merges them."""
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=1, sq=1, hq=32, hkv=8, d=128, capacity=65536, page_size=16, spare_pages=0)
    t = _cuda(case)
    out, lse = flash_attn_with_kvcache(**t, return_softmax_lse=True)
    ref_out, ref_lse, _, _ = kvcache_reference(**_wide(t))
    assert_close_rel(out, ref_out, 1e-2, "out")
    assert_close_rel(lse, ref_lse, 1e-3, "lse")


def test_cuda_graph_replays_with_new_lengths(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=8, sq=1, hq=32, hkv=8, d=128, s_new=1, capacity=4096, page_size=16,
                     rotary_dim=128, seqlens=[5] * 8)
    t = _cuda(case)
    eager = {n: x.clone() for n, x in t.items()}
    flash_attn_with_kvcache(**t, causal=True)          # compile outside the capture
    t["k_cache"].copy_(eager["k_cache"])
    t["v_cache"].copy_(eager["v_cache"])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(**t, causal=True)
    lengths = torch.tensor([0, 100, 4095, 17, 2048, 1, 3000, 999], dtype=torch.int32, device="cuda")
    t["cache_seqlens"].copy_(lengths)
    t["k_cache"].copy_(eager["k_cache"])
    t["v_cache"].copy_(eager["v_cache"])
    graph.replay()
    eager["cache_seqlens"] = lengths
    want = flash_attn_with_kvcache(**eager, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(t["k_cache"], eager["k_cache"])


def test_torch_compile_fullgraph(seed):
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=4, sq=1, hq=32, hkv=8, d=128, s_new=1, capacity=1024, page_size=16,
                     rotary_dim=64)
    t, eager = _cuda(case), _cuda(case)
    fn = torch.compile(flash_attn_with_kvcache, fullgraph=True)
    got = fn(**t, causal=True)
    want = flash_attn_with_kvcache(**eager, causal=True)
    assert torch.equal(got, want)
    assert torch.equal(t["k_cache"], eager["k_cache"])


def test_jax_triton_equals_torch_bitwise(seed):
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax_triton")
    import jax.numpy as jnp
    from dualattn.jax_api import flash_attn_with_kvcache as jax_fn
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    rng = np.random.default_rng(seed)
    case = make_case(rng, batch=2, sq=2, hq=32, hkv=8, d=128, s_new=2, capacity=8192, page_size=16,
                     rotary_dim=128, sinks=(32,))
    t = _cuda(case)
    a = {n: jnp.asarray(x).astype(jnp.bfloat16) if n in FLOATS else jnp.asarray(x) for n, x in case.items()}
    out_t, lse_t = flash_attn_with_kvcache(**t, causal=True, return_softmax_lse=True)
    step = jax.jit(lambda *xs: jax_fn(*xs[:5], xs[5], xs[6], cache_seqlens=xs[7], block_table=xs[8], causal=True,
                                      softmax_aux=xs[9], return_softmax_lse=True), donate_argnums=(1, 2))
    args = [a[n] for n in ("q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                           "block_table", "softmax_aux")]
    pointer = args[1].unsafe_buffer_pointer()
    out_j, lse_j, kc_j, _ = step(*args)
    assert kc_j.unsafe_buffer_pointer() == pointer, "the donated cache was copied"
    assert np.array_equal(out_t.float().cpu().numpy(), np.asarray(out_j.astype(jnp.float32)))
    assert np.array_equal(lse_t.cpu().numpy(), np.asarray(lse_j))
    assert np.array_equal(t["k_cache"].float().cpu().numpy(), np.asarray(kc_j.astype(jnp.float32)))
