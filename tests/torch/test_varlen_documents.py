"""Varlen calls with one table run as segment ids (plan.varlen_as_documents): the ids kernel, the plan's
rule, and the numbers (the portable kernels in the interpreter with DUALATTN_VARLEN_DOCUMENTS=1; on an
sm_90 GPU the Gluon forward, by default)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.launch import row_major_strides  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from dualattn.torch_api import _launch, flash_attn_varlen_func  # noqa: E402
from dualattn.validation import FlashShapes  # noqa: E402
from plan_spy import spy_chains  # noqa: E402
from reference import assert_close_rel, reference_varlen  # noqa: E402

ROUTE = ["varlen_segment_ids_kernel", "segment_ranges_kernel"]


def model_ids(cu, total, max_seqlen, side):
    """With t the sequences starting at or before token p: 3t for a token of sequence t - 1 (cu[t - 1] <= p
    < cu[t], p - cu[t - 1] < max_seqlen), 3t + side (1 query, 2 key) for a token of none."""
    out = np.empty(total, np.int32)
    for p in range(total):
        t = int(np.searchsorted(cu, p, side="right"))
        inside = 0 < t < len(cu) and p - cu[t - 1] < max_seqlen
        out[p] = 3 * t if inside else 3 * t + side
    return out


def test_ids_kernel_matches_the_sequences():
    rng = np.random.default_rng(3)
    for _ in range(20):
        n = int(rng.integers(0, 12))
        lens = rng.integers(0, 40, n)
        total = max(1, int(lens.sum() + rng.integers(0, 20)))
        cu = np.minimum(int(rng.integers(0, 3)) + np.concatenate([[0], np.cumsum(lens)]), total).astype(np.int32)
        max_seqlen = int(rng.integers(1, 45))
        ids = _launch.run(flash_plan.plan_varlen_segment_ids(total, n, max_seqlen),
                          {"cu_seqlens_q": torch.from_numpy(cu)}, device="cpu")
        q_ids, k_ids = ids["q_segment_ids"][0].numpy(), ids["kv_segment_ids"][0].numpy()
        np.testing.assert_array_equal(q_ids, model_ids(cu, total, max_seqlen, 1))
        np.testing.assert_array_equal(k_ids, model_ids(cu, total, max_seqlen, 2))
        # rising along the pack (tight segment ranges), and a token of no sequence matches nothing
        assert (np.diff(q_ids) >= 0).all() and (np.diff(k_ids) >= 0).all()
        assert not np.isin(q_ids[q_ids % 3 != 0], k_ids).any()


def test_ids_keep_the_segment_ranges_to_each_tiles_own_documents():
    """A pack whose last sequence ends inside a tile, tokens past it, and a sequence cut at max_seqlen:
    each query tile's key tiles are those of its own sequences (the ids rise along the pack), not every
    earlier document, which a tail id below the others would make them."""
    from test_segment_ranges import expected_ranges
    cu = np.array([0, 101, 202, 303, 404, 505, 606], np.int32)
    total, max_seqlen = 650, 90
    ids = _launch.run(flash_plan.plan_varlen_segment_ids(total, len(cu) - 1, max_seqlen),
                      {"cu_seqlens_q": torch.from_numpy(cu)}, device="cpu")
    q_ids, k_ids = ids["q_segment_ids"][0].numpy(), ids["kv_segment_ids"][0].numpy()
    block = 32
    for t, (lo, hi, _, _) in enumerate(expected_ranges(q_ids, k_ids, block, block)):
        rows = np.arange(t * block, min((t + 1) * block, total))
        first_doc_start = cu[max(0, int(np.searchsorted(cu, rows[0], side="right")) - 1)]
        last = int(np.searchsorted(cu, rows[-1], side="right"))
        last_doc_end = cu[last] if last < len(cu) else total
        assert first_doc_start // block * block <= lo and hi <= -(-last_doc_end // block) * block, (t, lo, hi)


def _shapes(total=4096, max_seqlen=2048, seqs=2, d=128, sinks=0, total_k=None, max_seqlen_k=None):
    return FlashShapes(seqs, max_seqlen, max_seqlen_k or max_seqlen, 8, 2, d, d, "bfloat16", varlen=True,
                       total_q=total, total_k=total_k or total, num_sinks=sinks, sinks_per_head=bool(sinks))


def _plan(shapes=None, same_tables=True, gluon=True, backward=False, deterministic=False, **opts):
    shapes = shapes or _shapes()
    options = FlashOptions.build(head_dim=shapes.head_dim, **opts)
    strides = {n: row_major_strides((t, h, shapes.head_dim)) for n, t, h in
               (("query", shapes.total_q, 8), ("key", shapes.total_k, 2), ("value", shapes.total_k, 2),
                ("out", shapes.total_q, 8))}
    strides.update(cu_seqlens_q=(1,), cu_seqlens_k=(1,))
    plan = functools.partial(flash_plan.plan_backward, deterministic=True) if deterministic else \
        flash_plan.plan_backward if backward else flash_plan.plan_forward
    return plan(shapes, options, strides, config=flash_plan.default_config(shapes, interpret=False),
                warp_specialize=True, gluon=gluon, num_sms=132, same_tables=same_tables)


def test_plan_runs_one_table_as_segment_ids_on_the_gluon_forward(monkeypatch):
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, None)
    launch = _plan(causal=True)
    assert [one.kernel for one in launch.chain] == ROUTE + ["flash_fwd_gluon_kernel"]
    ids, ranges, gluon = launch.chain
    assert ranges.resume == flash_plan.VARLEN_IDS_RESUME and gluon.constexpr_dict["SEGMENTS"]
    assert dict(gluon.scalars)["seqlen_q"] == 4096 and dict(gluon.scalars)["diag"] == 0
    assert {o.name: o.shape for o in gluon.results} == {"out": (4096, 8, 128), "lse": (8, 4096)}
    assert dict(ids.scalars) == {"total": 4096, "num_seqs": 2, "max_seqlen": 2048}
    # not the same problem as one packed sequence, or no Gluon forward for it: the varlen kernels
    for why, kwargs in (("two tables", dict(same_tables=False)), ("no Gluon launcher", dict(gluon=False)),
                        ("dropout", dict(dropout_prob=0.1)), ("sinks", dict(shapes=_shapes(sinks=1))),
                        ("other max_seqlen_k", dict(shapes=_shapes(max_seqlen_k=1024))),
                        ("other total_k", dict(shapes=_shapes(total_k=4000))),
                        ("head dim 96", dict(shapes=_shapes(d=96))),
                        ("head dim 64: varlen is as fast", dict(shapes=_shapes(d=64))),
                        ("window with a right side", dict(sliding_window=(64, 64)))):
        assert [one.kernel for one in _plan(**kwargs).chain] == ["flash_fwd_kernel"], why
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "0")
    assert _plan(causal=True).kernel == "flash_fwd_kernel"


def test_plan_runs_the_backward_of_one_table_as_segment_ids_on_the_one_pass_kernel(monkeypatch):
    """plan.varlen_backward_as_documents: the ids launch, the key tiles' segment ranges, the one-pass backward; the
    gradients varlen-shaped; at every head dim the one-pass kernel takes (the forward's rule starts at D = 128)."""
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, None)
    for d in (128, 64, 96):
        plan = _plan(shapes=_shapes(d=d), backward=True, causal=True)
        assert [one.kernel for one in plan.dkdv.chain] == ROUTE + ["flash_bwd_one_pass_kernel"], d
        ids, ranges, one_pass = plan.dkdv.chain
        assert ranges.resume == flash_plan.VARLEN_IDS_RESUME and one_pass.constexpr_dict["SEGMENTS"]
        assert {o.name: o.shape for o in one_pass.results if o.name != "dq_accum"} == {
            "dkey": (4096, 2, d), "dvalue": (4096, 2, d)}
        assert [o.shape for o in plan.dq.results] == [(4096, 8, d)] and plan.dq.kernel == "flash_bwd_dq_convert_kernel"
    # the forward's terms (not the same problem), and no one-pass kernel (deterministic, no Gluon launcher, a
    # pack too short for it): the varlen kernels
    for why, kwargs in (("two tables", dict(same_tables=False)), ("no Gluon launcher", dict(gluon=False)),
                        ("dropout", dict(dropout_prob=0.1)), ("sinks", dict(shapes=_shapes(sinks=1))),
                        ("other max_seqlen_k", dict(shapes=_shapes(max_seqlen_k=1024))),
                        ("deterministic", dict(deterministic=True)),
                        ("short pack", dict(shapes=_shapes(total=1024, max_seqlen=512)))):
        assert _plan(backward=True, causal=True, **kwargs).dkdv.chain[0].kernel not in ROUTE, why
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "0")
    assert _plan(backward=True, causal=True).dkdv.chain[0].kernel not in ROUTE


def test_long_packs_of_short_sequences_take_the_one_pass_backward(monkeypatch):
    """hopper.ONE_PASS_MAX_KEYS caps the one-pass backward's fp32 dQ accumulator by the longest sequence: a pack
    of 64k tokens in sequences of 8k holds the accumulator of the same 8 x 8k as a batch, which takes the one-pass
    kernel, so the pack does too; a 64k-token sequence, alone or as a batch row, keeps the two-pass kernels."""
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, None)
    pack = _plan(shapes=_shapes(total=65536, max_seqlen=8192, seqs=8), backward=True, causal=True)
    assert pack.dkdv.chain[0].kernel == ROUTE[0] and pack.dkdv.chain[-1].kernel == "flash_bwd_one_pass_kernel"
    one = _plan(shapes=_shapes(total=65536, max_seqlen=65536, seqs=1), backward=True, causal=True)
    assert one.dkdv.chain[0].kernel not in ROUTE and one.dkdv.chain[-1].kernel != "flash_bwd_one_pass_kernel"
    for batch, seqlen, one_pass in ((8, 8192, True), (1, 65536, False)):
        shapes = FlashShapes(batch, seqlen, seqlen, 8, 2, 128, 128, "bfloat16")
        strides = {n: row_major_strides((batch, seqlen, h, 128)) for n, h in
                   (("query", 8), ("key", 2), ("value", 2), ("out", 8))}
        bwd = flash_plan.plan_backward(shapes, FlashOptions.build(head_dim=128, causal=True), strides,
                                       config=flash_plan.default_config(shapes, interpret=False),
                                       warp_specialize=True, gluon=True, num_sms=132)
        assert (bwd.dkdv.chain[-1].kernel == "flash_bwd_one_pass_kernel") == one_pass, (batch, seqlen)


# (table, packed tokens): an empty sequence, tokens past the last sequence
TABLES = [([0, 50, 50, 140, 200], 220), ([0, 0, 90, 90, 150], 150), ([0, 64, 128, 192, 256], 256)]


@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal=False), dict(sliding_window=(20, 0)),
                                  dict(causal=True, logits_soft_cap=5.0)], ids=["causal", "full", "window", "softcap"])
def test_one_table_as_segment_ids_matches_varlen(monkeypatch, seed, opts):
    """Through the portable kernels (DUALATTN_VARLEN_DOCUMENTS=1): forward, lse (-inf on rows in no
    sequence) and gradients (zero on tokens in no sequence) against the float64 varlen reference; the backward
    runs as documents too (the dense dK/dV kernel after the ids and its ranges)."""
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "1")
    chains = spy_chains(monkeypatch)
    backward_chains = spy_chains(monkeypatch, "plan_backward")
    gen = torch.Generator().manual_seed(seed)
    for cu, total in TABLES:
        table = torch.tensor(cu, dtype=torch.int32)
        q = torch.randn(total, 4, 32, generator=gen)
        k, v = (torch.randn(total, 2, 32, generator=gen) for _ in range(2))
        dout = torch.randn(total, 4, 32, generator=gen)
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attn_varlen_func(*leaves, table, table, longest, longest, return_lse=True, **opts)
        grads = torch.autograd.grad(out, leaves, dout)
        assert chains[-1] == ROUTE + ["flash_fwd_kernel"], chains
        assert backward_chains[-1] == ROUTE + ["flash_bwd_dkdv_kernel"], backward_chains
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference_varlen(*ref_leaves, table, table, **opts)
        ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout[:cu[-1]].double())
        n = cu[-1]
        assert_close_rel(out[:n], ref_out, 1e-4, "out")
        assert (out[n:] == 0).all() and torch.isneginf(lse[:, n:]).all()
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[:, :n]), finite)
        assert_close_rel(lse[:, :n][finite], ref_lse[finite], 1e-4, "lse")
        for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
            assert_close_rel(g, r, 1e-4, name)


# (table, packed tokens): a short pack; one longer than hopper.ONE_PASS_MAX_KEYS of sequences within it (the
# one-pass backward's memory cap counts the longest sequence), whose segment ranges come from tile ids
PACKS = {"short": ([0, 3000, 4300, 4300, 4817, 5011], 5100),
         "long": ([0, 12000, 20500, 20500, 31017, 38000, 40500], 40600)}


@pytest.mark.gpu
@pytest.mark.parametrize("d, causal, pack, window", [(128, True, "short", None), (64, True, "short", None),
                                                     (128, False, "short", None), (128, True, "long", None),
                                                     (128, True, "long", 512)])
def test_gpu_one_table_runs_on_the_gluon_forward(monkeypatch, seed, d, causal, pack, window):
    """On sm_90 (the forward by default from D = 128, the backward at every head dim): packed documents of ragged
    lengths, an empty one, the last ending inside a tile and tokens past it, against the float64 varlen reference,
    forward and backward (the one-pass kernel). The long pack with a window is NSA's sliding branch over packed
    sequences."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    # D = 64 runs as documents only when asked (plan.varlen_as_documents); the kernels are the same
    set_switch(monkeypatch, flash_plan.VARLEN_DOCUMENTS_ENV, "1" if d < 128 else None)
    chains = spy_chains(monkeypatch)
    backward_chains = spy_chains(monkeypatch, "plan_backward")
    cu, total = PACKS[pack]
    longest = max(b - a for a, b in zip(cu, cu[1:]))
    table = torch.tensor(cu, dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads = 8 if pack == "short" else 4
    q = torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(total, 2, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    opts = dict(causal=causal) if window is None else dict(sliding_window=(window, 0))
    out, lse = flash_attn_varlen_func(*leaves, table, table, longest, longest, return_lse=True, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    route = ROUTE if pack == "short" else [ROUTE[0], "segment_tile_ids_kernel", ROUTE[1]]
    assert chains[-1] == route + ["flash_fwd_gluon_kernel"], chains
    assert backward_chains[-1] == route + ["flash_bwd_one_pass_kernel"], backward_chains
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_varlen(*ref_leaves, table, table, **opts)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout[:cu[-1]].double())
    assert (out[cu[-1]:] == 0).all() and torch.isneginf(lse[:, cu[-1]:]).all()
    assert_close_rel(out[:cu[-1]], ref_out, 1e-2, "out")
    assert_close_rel(lse[:, :cu[-1]], ref_lse, 1e-2, "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, 1e-2, name)
