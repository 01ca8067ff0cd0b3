"""Head dims that are not powers of two and D != Dv, forward and backward, vs float64."""
import pytest

torch = pytest.importorskip("torch")

import dualattn.torch_api as dt  # noqa: E402
from reference import reference_attention, relative_error  # noqa: E402


@pytest.mark.parametrize("d,dv", [(192, 192), (192, 160), (48, 112)])
def test_padded_head_dims(d, dv, torch_gen):
    q = torch.randn(1, 40, 2, d, generator=torch_gen, requires_grad=True)
    k = torch.randn(1, 33, 1, d, generator=torch_gen, requires_grad=True)
    v = torch.randn(1, 33, 1, dv, generator=torch_gen, requires_grad=True)
    out = dt.flash_attention(q, k, v, causal=True)
    assert out.shape == (1, 40, 2, dv)
    dout = torch.randn(out.shape, generator=torch_gen)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double())
    for a, r in zip([out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().numpy(), r.detach().numpy()) < 2e-5
