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


# Unaligned rows (odd head dims) with a V tile of 32 columns or fewer narrower than q/k's: Triton 3.6
# miscompiled these portable kernels on sm_90 (wrong outputs, illegal addresses; GPU fuzz seed
# 20261127:621).  plan.value_block widens such V tiles; the interpreter never saw the problem.
@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(24, 16), (20, 16), (40, 16), (40, 24), (40, 32), (56, 32), (72, 32), (72, 16)])
def test_narrow_value_tiles_on_the_gpu(d, dv):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(d * 100 + dv)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", torch.bfloat16).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 42, 16, d), mk(2, 411, 4, d), mk(2, 411, 4, dv)
    out = dt.flash_attention(q, k, v)
    dout = torch.randn(out.shape, generator=g).to("cuda", torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    for a, r in zip([out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().float().cpu().numpy(), r.detach().numpy()) < 2e-2
