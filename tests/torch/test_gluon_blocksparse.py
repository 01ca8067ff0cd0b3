"""Block-sparse layouts on the Gluon kernels (hopper.sparse_on_gluon_tiles): a layout of 128 x 128
blocks runs the Gluon forward, each query tile walking its list of key blocks, and the one-pass
backward, each key tile walking its list of query blocks (two 64-row tiles each).

Gluon has no interpreter: on the CPU these tests check the plans and that the variants compile for
sm_90; the GPU tests check the numbers against the float64 reference under the token mask the layout
and the token rules imply, and that the plans took the Gluon kernels.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualattn import SparseMask, masks  # noqa: E402
from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.flash.tiles import SparseInfo  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from plan_spy import spy_chains  # noqa: E402
from test_blocksparse import _token_mask  # noqa: E402  (tests/torch is on sys.path)
from test_one_pass import gluon_problem  # noqa: E402

GLUON_FWD = "flash_fwd_gluon_kernel"
ONE_PASS = "flash_bwd_one_pass_kernel"
INT_INPUTS = ("q_segment_ids", "kv_segment_ids", "segment_ranges", "sparse_kv_count", "sparse_kv_index",
              "sparse_q_order", "sparse_q_count", "sparse_q_index", "sparse_k_order")


@pytest.fixture(autouse=True)
def one_pass_at_any_length(monkeypatch):
    """The one-pass backward whatever the keys (plan.ONE_PASS_MIN_KEYS is a speed rule)."""
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    for name in (flash_plan.GLUON_FWD_ENV, flash_plan.PERSISTENT_ENV):
        set_switch(monkeypatch, name, None)


def _plans(block=128, per_head=True, runs=False, **kwargs):
    """(forward, backward) plans for a layout of `block` x `block` blocks (`runs`: every row one run)."""
    shapes, options, strides, config = gluon_problem(**kwargs)
    sparse = SparseInfo(1, shapes.heads_q if per_head else 1, -(-shapes.seqlen_q // block),
                        -(-shapes.seqlen_k // block), block, block, runs, runs)
    flags = dict(config=config, warp_specialize=True, gluon=True, num_sms=132, sparse=sparse)
    return (flash_plan.plan_forward(shapes, options, strides, **flags),
            flash_plan.plan_backward(shapes, options, strides, bias_grad=False, **flags))


def test_plans_walk_128_blocks_on_the_gluon_kernels():
    forward, backward = _plans(causal=True, b=2, sq=2048, sk=2048, hq=4, hkv=2)
    assert forward.kernel == GLUON_FWD and forward.constexpr_dict["SPARSE"] == 1   # forward_gluon.SPARSE_LISTS
    assert {"sparse_kv_count", "sparse_kv_index", "sparse_q_order"} <= set(forward.inputs)
    # pairs of query tiles (the busiest with the least busy): 2 * 4 heads * 16 tiles / 2
    assert dict(forward.scalars)["num_work"] == 64 and dict(forward.scalars)["sparse_stride_h"] == 16
    one_pass = backward.dkdv
    assert one_pass.kernel == ONE_PASS and one_pass.constexpr_dict["SPARSE_BLOCK_Q"] == 128
    assert not one_pass.constexpr_dict["SPARSE_RUNS"]
    # rows that are runs of blocks (windows, documents): no list read past the first entry
    forward, backward = _plans(causal=True, runs=True)
    assert forward.constexpr_dict["SPARSE"] == 2 and backward.dkdv.constexpr_dict["SPARSE_RUNS"]
    assert {"sparse_q_count", "sparse_q_index", "sparse_k_order"} <= set(one_pass.inputs)
    # persistent over pairs of key tiles: 2 * 2 KV heads * 16 / 2
    assert one_pass.constexpr_dict["PERSISTENT"] and dict(one_pass.scalars)["num_work"] == 32
    assert _plans(sq=2048, sk=1024)[1].dkdv.constexpr_dict["PERSISTENT"]   # not causal: pairs all the same
    # a layout's last query block past Sq (a multiple of 64, not of 128), or an odd number of key tiles:
    # a program per key tile (whose descriptors end at Sq)
    for sq, sk in ((1984, 2048), (2048, 1920)):
        _, one_pass = _plans(sq=sq, sk=sk)
        assert one_pass.dkdv.kernel == ONE_PASS and not one_pass.dkdv.constexpr_dict["PERSISTENT"], (sq, sk)
    # other blocks: the portable kernels
    forward, backward = _plans(block=64, causal=True)
    assert forward.kernel == "flash_fwd_kernel" and backward.dkdv.kernel == "flash_bwd_dkdv_kernel"
    # deterministic=True: no dQ atomics, the two-pass backward
    shapes, options, strides, config = gluon_problem(causal=True)
    deterministic = flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True,
                                             gluon=True, num_sms=132, bias_grad=False, deterministic=True,
                                             sparse=SparseInfo(1, 1, 8, 8, 128, 128))
    assert deterministic.dkdv.kernel != ONE_PASS


def test_blocksparse_takes_deterministic_in_both_frameworks():
    """`deterministic=` as flash_attention's (the CPU interpreter's backward is deterministic either way)."""
    import dualattn.torch_api as dt
    q, k, v = (torch.randn(1, 64, 2, 16, requires_grad=True) for _ in range(3))
    layout = SparseMask.from_block_map(masks.causal()(1, 2, 64, 64, 32, 32), 32, 32)
    out = dt.blocksparse_attention(q, k, v, layout=layout, causal=True, deterministic=True)
    torch.testing.assert_close(out, dt.blocksparse_attention(q, k, v, layout=layout, causal=True))
    with pytest.raises(TypeError, match="deterministic"):
        dt.blocksparse_attention(q, k, v, layout=layout, deterministic="yes")
    jax = pytest.importorskip("jax")
    import dualattn.jax_api as dj
    with pytest.raises(TypeError, match="deterministic"):
        dj.blocksparse_attention(*(jax.numpy.asarray(x.detach().numpy()) for x in (q, k, v)), layout=layout,
                                 backend="xla", deterministic="yes")


@pytest.mark.parametrize("d, kwargs", [
    (128, dict(causal=True, hq=4, hkv=2)), (64, dict(segments=True, sk=1000)),
    (128, dict(sliding_window=(300, 0), sinks=True, logits_soft_cap=30.0, runs=True))])
def test_gluon_blocksparse_compiles_for_sm90(d, kwargs):
    forward, backward = _plans(d=d, **kwargs)
    dtypes = {**dict.fromkeys(("query", "key", "value", "dout"), "bfloat16"), "softmax_aux": "float32",
              "lse": "float32", "delta": "float32", **dict.fromkeys(INT_INPUTS, "int32")}
    for launch, kernel in ((forward.chain[-1], GLUON_FWD), (backward.dkdv.chain[-1], ONE_PASS)):
        assert launch.kernel == kernel
        compiled = compile_check.compile_launch(launch, dtypes, arch=90)
        assert compiled.asm["cubin"][:4] == b"\x7fELF"


# ---- GPU: numbers against the float64 reference, through the public API ----

def _runs(*runs):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in runs])[None]


# name: (b, s_q, s_k, hq, hkv, d, block map builder (b, h, sq, sk) -> bool blocks, token rules)
GPU_CASES = {
    # a random layout per head with an empty query block (rows give 0, lse -inf), GQA
    "random-per-head-gqa": (2, 2048, 2048, 4, 2, 128, "random", {}),
    "causal-layout-d64": (1, 2048, 2048, 4, 4, 64, masks.causal(), dict(causal=True)),
    # a window the layout and the rule both state; ragged lengths (a partial last key tile, no persistent
    # backward), sinks
    "window-ragged-sinks": (1, 2000, 2000, 4, 2, 128, masks.causal() & masks.local((300, 0)),
                            dict(causal=True, sliding_window=(300, 0), softmax_aux="sinks")),
    # documents: the layout's blocks, ids compared where a block holds two documents
    "documents-softcap": (1, 2048, 2048, 2, 2, 128, "documents", dict(causal=True, logits_soft_cap=20.0)),
    # strided / BigBird-like: a layout that is not one run of blocks per row; fewer queries than keys
    "strided-global-more-keys": (1, 1024, 2048, 2, 2, 64, masks.strided(3) | masks.global_tokens(128), {}),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_gluon_blocksparse(case, monkeypatch, seed):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on sm_90 only")
    import dualattn.torch_api as dt
    from reference import assert_close_rel, reference_attention
    b, sq, sk, hq, hkv, d, builder, rules = GPU_CASES[case]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    rules = dict(rules)
    if rules.get("softmax_aux") == "sinks":
        rules["softmax_aux"] = torch.randn(hq, device="cuda", generator=gen)
    nq, nk = -(-sq // 128), -(-sk // 128)
    if builder == "random":
        block_map = rng.random((b, hq, nq, nk)) < 0.4
        block_map[0, 1, 3] = False
    elif builder == "documents":
        ids = _runs((0, 700), (1, 900), (2, 448)).to("cuda")
        rules.update(q_segment_ids=ids, kv_segment_ids=ids)
        block_map = (masks.document(ids.cpu()) & masks.causal())(b, hq, sq, sk, 128, 128)
    else:
        block_map = builder(b, hq, sq, sk, 128, 128)
    layout = SparseMask.from_block_map(block_map, 128, 128)
    forward_chains = spy_chains(monkeypatch)
    backward_chains = spy_chains(monkeypatch, "plan_backward")
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out, lse = dt.blocksparse_attention(*leaves, layout=layout, return_lse=True, **rules)
    grads = torch.autograd.grad(out, leaves, dout)
    assert forward_chains and forward_chains[-1][-1] == GLUON_FWD, forward_chains
    assert [c[-1] for c in backward_chains] == [ONE_PASS], backward_chains

    mask = torch.tensor(_token_mask(layout.block_map, 128, 128, sq, sk), device="cuda")
    ref_leaves = [x.detach().double().requires_grad_() for x in leaves]
    ref, ref_lse = reference_attention(*ref_leaves, attention_mask=mask, **rules)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.double())
    assert not torch.isnan(out).any() and not any(torch.isnan(g).any() for g in grads)
    for name, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert_close_rel(a, r, 1e-2, name)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    assert_close_rel(lse[finite], ref_lse[finite], 1e-2, "lse")
