"""torch_api.MultiheadAttention against an eager reference; torch.compile(fullgraph=True) through the
new torch entry points (dualattn.attention, MultiheadAttention) with no graph break."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import dualattn  # noqa: E402
from dualattn.torch_api import MultiheadAttention  # noqa: E402


def _eager(m: MultiheadAttention, x):
    b, s, _ = x.shape
    q = m.q_proj(x).view(b, s, m.num_heads, m.head_dim).transpose(1, 2)
    k = m.k_proj(x).view(b, s, m.num_kv_heads, m.head_dim).transpose(1, 2)
    v = m.v_proj(x).view(b, s, m.num_kv_heads, m.head_dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=m.causal, enable_gqa=True)
    return m.o_proj(out.transpose(1, 2).reshape(b, s, -1))


def test_gqa_module_matches_eager_forward_and_backward(torch_gen):
    m = MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    x = torch.randn(2, 32, 64, generator=torch_gen)
    out, ref = m(x), _eager(m, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    got = torch.autograd.grad(out.square().sum(), list(m.parameters()))
    want = torch.autograd.grad(ref.square().sum(), list(m.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_bad_head_counts_are_rejected():
    with pytest.raises(ValueError, match="num_kv_heads"):
        MultiheadAttention(64, 4, num_kv_heads=3)


@pytest.mark.parametrize("args,kw,match", [
    ((30, 4), {}, "embed_dim .*divisible by num_heads"),
    ((0, 4), {}, "embed_dim and num_heads must be greater than 0"),
    ((64, 0), {}, "embed_dim and num_heads must be greater than 0"),
])
def test_constructor_checks_as_torch(args, kw, match):
    """What torch.nn.MultiheadAttention refuses is refused here, with a ValueError saying why."""
    with pytest.raises((ValueError, AssertionError)):
        torch.nn.MultiheadAttention(*args, **kw)
    with pytest.raises(ValueError, match=match):
        MultiheadAttention(*args, **kw)


@pytest.mark.parametrize("kw,error,match", [
    (dict(algorithm="bogus"), ValueError, "algorithm"),
    (dict(dropout=1.5), ValueError, "dropout"),
    (dict(sliding_window=-2), ValueError, "window"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale"),
    (dict(logits_soft_cap="3"), TypeError, "logits_soft_cap"),
    (dict(causal="yes"), TypeError, "causal"),
    (dict(head_dim=0), ValueError, "head_dim"),
    (dict(kdim=-1), ValueError, "kdim"),
    (dict(num_sinks=-1), ValueError, "num_sinks"),
    (dict(num_kv_heads=2.0), TypeError, "num_kv_heads"),
])
def test_bad_options_are_rejected_at_construction(kw, error, match):
    with pytest.raises(error, match=match):
        MultiheadAttention(64, 4, **kw)


def test_head_dim_given_lifts_divisibility():
    m = MultiheadAttention(30, 4, head_dim=16)
    assert m.q_proj.out_features == 64 and m.o_proj.out_features == 30


def test_unbatched_input_as_torch(torch_gen):
    """(S, E) is one sequence, as in torch.nn.MultiheadAttention: the batched result of x[None], squeezed."""
    assert torch.nn.MultiheadAttention(64, 4)(*(torch.randn(12, 64),) * 3)[0].shape == (12, 64)
    m = MultiheadAttention(64, 4, num_kv_heads=2, causal=True, kdim=48, vdim=40)
    x, kx, vx = torch.randn(20, 64), torch.randn(24, 48), torch.randn(24, 40)
    out = m(x, kx, vx)
    assert out.shape == (20, 64)
    torch.testing.assert_close(out, m(x[None], kx[None], vx[None])[0], atol=0, rtol=0)
    m = MultiheadAttention(64, 4, num_kv_heads=2, causal=True)
    torch.testing.assert_close(m(x), _eager(m, x[None])[0], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("shapes,match", [
    (((2, 16, 32),), "query must have embed_dim=64"),
    (((2, 16, 64), (2, 16, 32), (2, 16, 64)), "key must have kdim=64"),
    (((2, 16, 64), (2, 16, 64), (2, 16, 48)), "value must have vdim=64"),
    (((64,),), "query must be 3-D"),
    (((2, 2, 16, 64),), "query must be 3-D"),
    (((16, 64), (2, 16, 64), (2, 16, 64)), "key must be 2-D like query"),
    (((2, 16, 64), (2, 16, 64), (2, 12, 64)), "key .* and value .* must agree"),
    (((2, 16, 64), (3, 16, 64), (3, 16, 64)), "key batch 3 must equal query batch 2"),
])
def test_bad_inputs_name_the_argument(shapes, match, torch_gen):
    m = MultiheadAttention(64, 4)
    tensors = [torch.randn(s, generator=torch_gen) for s in shapes]
    with pytest.raises(ValueError, match=match):
        m(*tensors)


def test_compile_fullgraph_without_graph_breaks(torch_gen):
    m = MultiheadAttention(64, 4, num_kv_heads=2, causal=True, algorithm="flash")
    x = torch.randn(1, 32, 64, generator=torch_gen)

    def step(x):
        return m(x).square().sum()

    explained = torch._dynamo.explain(step)(x)
    assert explained.graph_break_count == 0, explained.break_reasons
    q = torch.randn(1, 32, 2, 16, generator=torch_gen)
    explained = torch._dynamo.explain(lambda q: dualattn.attention(q, q, q, causal=True, logits_soft_cap=3.0))(q)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x.requires_grad_(True)
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, step(x.detach()), atol=1e-5, rtol=1e-5)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_torch_export_forward_and_backward(torch_gen):
    """torch.export through flash_attention (with bias and sinks), MultiheadAttention and dualattn.attention:
    the exported program's outputs and gradients equal eager's (the forward op's own autograd formula)."""
    import dualattn.torch_api as dt

    class Flash(torch.nn.Module):
        def forward(self, q, k, v, bias, sinks):
            return dt.flash_attention(q, k, v, causal=True, bias=bias, softmax_aux=sinks)

    class Entry(torch.nn.Module):
        def forward(self, q, k, v):
            return dualattn.attention(q, k, v, algorithm="flash", causal=True)

    q, k, v = (torch.randn(1, 24, 4, 16, generator=torch_gen) for _ in range(3))
    cases = [(Flash(), (q, k, v, torch.randn(1, 4, 24, 24, generator=torch_gen), torch.randn(4, generator=torch_gen))),
             (Entry(), (q, k, v)),
             (MultiheadAttention(embed_dim=64, num_heads=4, num_kv_heads=2, causal=True),
              (torch.randn(1, 24, 64, generator=torch_gen),))]
    for module, args in cases:
        program = torch.export.export(module, args)
        grads = []
        for run in (program.module(), module):
            leaves = [a.clone().requires_grad_() for a in args]
            out = run(*leaves)
            out.square().sum().backward()
            grads.append([out.detach()] + [leaf.grad for leaf in leaves])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
