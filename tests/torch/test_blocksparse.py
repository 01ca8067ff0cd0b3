"""Block-sparse attention through the shared Triton kernels vs dense float64 attention
under the token mask the layout and the token rules imply; torch vs jax parity."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dualattn.torch_api as dt  # noqa: E402
from dualattn import SparseMask, masks  # noqa: E402
from reference import reference_attention, relative_error  # noqa: E402


def _token_mask(block_map, block_q, block_k, sq, sk):
    return np.repeat(np.repeat(block_map, block_q, -2), block_k, -1)[..., :sq, :sk]


def _check(q, k, v, layout, tol, **rules):
    leaves = [q, k, v] + ([rules["softmax_aux"]] if rules.get("softmax_aux") is not None else [])
    out, lse = dt.blocksparse_attention(q, k, v, layout=layout, return_lse=True, **rules)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref_rules = dict(rules, softmax_aux=ref_leaves[3] if len(leaves) > 3 else None)
    mask = torch.tensor(_token_mask(layout.block_map, layout.block_q, layout.block_k, q.shape[1], k.shape[1]))
    ref, ref_lse = reference_attention(*ref_leaves[:3], attention_mask=mask, **ref_rules)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), [out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().float().numpy(), b.detach().numpy()) < tol, name
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], atol=1e-4)


def _qkv(b, sq, sk, hq, hkv, d, dtype=torch.float32):
    return (torch.randn(b, sq, hq, d, dtype=dtype, requires_grad=True),
            torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=True),
            torch.randn(b, sk, hkv, d, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("per_head", [False, True])
def test_random_layouts_with_empty_rows_ragged_blocks_and_gqa(rng, per_head):
    b, sq, sk, hq, hkv, d, blk = 2, 150, 130, 4, 2, 32, 32
    nq, nk = -(-sq // blk), -(-sk // blk)
    block_map = rng.random((b if per_head else 1, hq if per_head else 1, nq, nk)) > 0.5
    block_map[..., 0, :] = False  # a query block with no key block: rows give 0, lse -inf
    layout = SparseMask.from_block_map(block_map, blk, blk)
    torch.manual_seed(int(rng.integers(1 << 30)))
    _check(*_qkv(b, sq, sk, hq, hkv, d), layout, 2e-5)


@pytest.mark.parametrize("name,builder,rules", [
    ("causal_local", masks.causal() & masks.local((40, 0)), dict(causal=True, sliding_window=(40, 0))),
    ("strided_or_global", masks.strided(2) | masks.global_tokens(20), dict()),
    ("causal_softcap_sinks", masks.causal(), dict(causal=True, logits_soft_cap=4.0, softmax_aux="sinks")),
])
def test_builder_layouts_with_token_rules(rng, name, builder, rules):
    b, s, hq, hkv, d, blk = 1, 160, 2, 1, 32, 32
    torch.manual_seed(int(rng.integers(1 << 30)))
    if rules.get("softmax_aux") == "sinks":
        rules = dict(rules, softmax_aux=torch.randn(hq, 2, requires_grad=True))
    layout = SparseMask.from_block_map(builder(b, hq, s, s, blk, blk), blk, blk)
    _check(*_qkv(b, s, s, hq, hkv, d), layout, 2e-5, **rules)


def test_document_layout_with_segment_ids(rng):
    b, s, h, d, blk = 1, 192, 2, 16, 32
    seg = torch.tensor(np.repeat([0, 1, 2], [50, 90, 52])[None], dtype=torch.int32)
    layout = SparseMask.from_block_map((masks.document(seg) & masks.causal())(b, h, s, s, blk, blk), blk, blk)
    assert layout.density < 0.6
    torch.manual_seed(int(rng.integers(1 << 30)))
    _check(*_qkv(b, s, s, h, h, d), layout, 2e-5, causal=True, q_segment_ids=seg, kv_segment_ids=seg)


def test_bf16_and_mask_builder_argument(rng):
    torch.manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _qkv(1, 128, 128, 2, 2, 64, torch.bfloat16)
    out = dt.blocksparse_attention(q, k, v, mask_builder=masks.causal(), block_q=32, block_k=32, causal=True)
    ref = dt.flash_attention(q, k, v, causal=True)  # a causal layout with causal rules is dense causal
    assert relative_error(out.detach().float().numpy(), ref.detach().float().numpy()) < 1e-2


def test_bad_layouts_raise_before_launch():
    q, k, v = _qkv(1, 100, 100, 2, 2, 16)
    with pytest.raises(ValueError, match="blocks"):
        dt.blocksparse_attention(q, k, v, layout=SparseMask.from_block_map(np.ones((1, 1, 3, 4), bool), 32, 32))
    with pytest.raises(ValueError, match="batch/head"):
        dt.blocksparse_attention(q, k, v, layout=SparseMask.from_block_map(np.ones((1, 3, 4, 4), bool), 32, 32))
    with pytest.raises(ValueError, match="exactly one"):
        dt.blocksparse_attention(q, k, v)
    with pytest.raises(TypeError, match="SparseMask"):
        dt.blocksparse_attention(q, k, v, layout=np.ones((1, 1, 4, 4), bool))
    with pytest.raises(ValueError, match="power of two"):
        SparseMask.from_block_map(np.ones((1, 1, 4, 4), bool), 48, 32)


def test_jax_triton_blocksparse_is_bitwise_equal_to_torch(rng):
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import dualattn.jax_api as dj
    b, s, hq, hkv, d, blk = 1, 96, 2, 1, 32, 32
    block_map = masks.causal()(b, hq, s, s, blk, blk) & (rng.random((1, hq, 3, 3)) > 0.3)
    layout = SparseMask.from_block_map(block_map, blk, blk)
    torch.manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _qkv(b, s, s, hq, hkv, d)
    out = dt.blocksparse_attention(q, k, v, layout=layout, causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    f = jax.jit(lambda a, b_, c: dj.blocksparse_attention(a, b_, c, layout=layout, causal=True, backend="triton"))
    jout, vjp = jax.vjp(f, *(jnp.asarray(x.detach().numpy()) for x in (q, k, v)))
    for a, t in zip([jout, *vjp(jnp.asarray(dout.numpy()))], [out, *grads]):
        np.testing.assert_array_equal(np.asarray(a), t.detach().numpy())


def test_jax_triton_layout_serves_a_jitted_forward_then_a_jitted_gradient(rng):
    """The layout's block lists are cached as concrete jax arrays: cached from inside the first trace,
    they escaped into the next one (UnexpectedTracerError)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import dualattn.jax_api as dj
    layout = SparseMask.from_block_map(masks.causal()(1, 1, 64, 64, 32, 32), 32, 32)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 64, 2, 16)).astype(np.float32)) for _ in range(3))

    def attn(a, b_, c):
        return dj.blocksparse_attention(a, b_, c, layout=layout, causal=True, backend="triton")
    out = jax.jit(attn)(q, k, v)
    dq = jax.jit(jax.grad(lambda a, b_, c: (attn(a, b_, c) * out).sum()))(q, k, v)
    assert out.shape == dq.shape == q.shape and bool(jnp.isfinite(dq).all())


@pytest.mark.gpu
def test_gpu_blocksparse_sliding_window_at_size():
    s, h, d, blk, window = 4096, 8, 128, 128, 512
    q, k, v = (torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    layout = SparseMask.from_block_map((masks.causal() & masks.local((window, 0)))(1, h, s, s, blk, blk), blk, blk)
    out = dt.blocksparse_attention(q, k, v, layout=layout, causal=True, sliding_window=(window, 0))
    dense = dt.flash_attention(q, k, v, causal=True, sliding_window=(window, 0))
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v), dout)
    gd = torch.autograd.grad(dense, (q, k, v), dout)
    for a, r in zip([out, *g], [dense, *gd]):
        assert ((a.float() - r.float()).norm() / r.float().norm()).item() < 1e-2


def test_explicit_positions_shift_the_window_like_a_shard(rng):
    """Keys of a shard that starts 64 tokens later: global positions in, same as the full problem."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import dualattn.jax_api as dj
    b, s, h, d, blk, shift = 1, 96, 2, 32, 32, 64
    torch.manual_seed(int(rng.integers(1 << 30)))
    q, k, v = _qkv(b, s, s, h, h, d)
    q_pos = torch.arange(s)[None] + shift  # queries sit 64 tokens after the keys
    kv_pos = torch.arange(s)[None]
    layout = SparseMask.from_block_map(np.ones((1, 1, 3, 3), bool), blk, blk)
    rules = dict(causal=True, sliding_window=(80, 0))
    out = dt.blocksparse_attention(q, k, v, layout=layout, q_positions=q_pos, kv_positions=kv_pos, **rules)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*ref_leaves, q_positions=q_pos, kv_positions=kv_pos, **rules)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    for a, r in zip([out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().numpy(), r.detach().numpy()) < 2e-5
    # the same through jax: triton (bitwise with torch) and xla
    args = [jnp.asarray(x.detach().numpy()) for x in (q, k, v)]
    for backend in ("triton", "xla"):
        jo = dj.blocksparse_attention(*args, layout=layout, q_positions=jnp.asarray(q_pos.numpy()),
                                      kv_positions=jnp.asarray(kv_pos.numpy()), backend=backend, **rules)
        assert relative_error(np.asarray(jo), ref.detach().numpy()) < 1e-4, backend
    with pytest.raises(ValueError, match="q_positions"):
        dt.blocksparse_attention(q, k, v, layout=layout, q_positions=torch.arange(5)[None])
