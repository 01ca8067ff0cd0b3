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


def test_narrow_head_dim_tiles_are_widened():
    """plan.head_blocks: a tile of 32 columns or fewer narrower than the other operand's is widened to
    min(the other, 64), V's or q/k's; equal or wide tiles stay powers of two of their head dims."""
    from dualattn.kernels.flash.plan import head_blocks
    assert head_blocks(128, 16) == (128, 64) and head_blocks(40, 32) == (64, 64) and head_blocks(24, 16) == (32, 32)
    assert head_blocks(16, 168) == (64, 256) and head_blocks(16, 32) == (32, 32) and head_blocks(32, 256) == (64, 256)
    assert head_blocks(16, 16) == (16, 16) and head_blocks(192, 160) == (256, 256) and head_blocks(48, 112) == (64, 128)


# A V tile of 32 columns or fewer narrower than q/k's: Triton 3.6 miscompiled these portable kernels on
# sm_90 (wrong outputs, illegal addresses; GPU fuzz seeds 20261127:621 with unaligned rows, 20261128:418
# in fp32 with D = 128).  plan.head_blocks widens such V tiles (and narrow q/k tiles: 20261128:570,
# tests/test_fuzz.py); the interpreter never saw the problem.
@pytest.mark.gpu
@pytest.mark.parametrize("d,dv,dtype", [(24, 16, "bfloat16"), (20, 16, "bfloat16"), (40, 16, "bfloat16"),
                                        (40, 24, "bfloat16"), (40, 32, "bfloat16"), (56, 32, "bfloat16"),
                                        (72, 32, "bfloat16"), (72, 16, "bfloat16"), (128, 16, "bfloat16"),
                                        (128, 16, "float32"), (64, 32, "float32"), (128, 32, "float16")])
def test_narrow_value_tiles_on_the_gpu(d, dv, dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(d * 100 + dv)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda", getattr(torch, dtype)).requires_grad_()  # noqa: E731
    q, k, v = mk(2, 42, 16, d), mk(2, 411, 4, d), mk(2, 411, 4, dv)
    out = dt.flash_attention(q, k, v)
    dout = torch.randn(out.shape, generator=g).to("cuda", getattr(torch, dtype))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    for a, r in zip([out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().float().cpu().numpy(), r.detach().numpy()) < 2e-2


@pytest.mark.gpu
def test_narrow_value_tiles_block_sparse_fp32_on_the_gpu():
    """After the GPU fuzz's 20261128:418: fp32 block-sparse, D = 128, Dv = 16, three tokens, causal with
    a window, soft cap and sinks; its dK/dV launch read out-of-range shared memory.  (Its 128x64 blocks
    fit sm_90's shared memory only with the narrow V tile, so the widened one now asks for smaller
    blocks with a ValueError naming `layout`: the blocks here are halved, as the fuzz's draw does.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from dualattn import SparseMask, masks
    g = torch.Generator().manual_seed(418)
    mk = lambda *s: torch.randn(*s, generator=g).to("cuda").requires_grad_()  # noqa: E731
    q, k, v = mk(4, 3, 4, 128), mk(4, 3, 2, 128), mk(4, 3, 2, 16)
    sinks = torch.randn(4, generator=g).cuda()
    layout = SparseMask.from_block_map(masks.local(107)(4, 1, 3, 3, 64, 32), 64, 32)
    opts = dict(causal=True, sliding_window=3, logits_soft_cap=3.16, softmax_scale=0.3, softmax_aux=sinks)
    out = dt.blocksparse_attention(q, k, v, layout=layout, **opts)
    dout = torch.randn(out.shape, generator=g).cuda()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref, _ = reference_attention(*leaves, **{**opts, "softmax_aux": sinks.cpu()})
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    for a, r in zip([out, *grads], [ref, *ref_grads]):
        assert relative_error(a.detach().cpu().numpy(), r.detach().numpy()) < 1e-3
