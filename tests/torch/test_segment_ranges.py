"""Segment ids: the per-tile ranges of kernels/flash/segments.py and the kernels that run on them.

Tile pairs inside one document run the unmasked interior loop with no segment compare, so a run of
"pure" tiles that is too wide would silently drop the compare on pairs of different documents:
the ranges are checked against a numpy model of the rule and the property they must hold, and the
kernels against the float64 reference on documents whose ends fall on and off tile boundaries,
unsorted and repeated ids, partial last tiles and rows whose id no key holds.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import dualattn.executor as ex  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.torch_api import _launch, flash_attention  # noqa: E402
from dualattn.validation import check_flash_args  # noqa: E402
from reference import assert_close_rel, reference_attention  # noqa: E402

# Own tiles of 64 rows against other-axis tiles of 32 in every launch (forward and dQ own query
# tiles, dK/dV key tiles), so a 64-row tile meets two 32-row tiles that may differ.
TILES = flash_plan.FlashConfig(flash_plan.TileConfig(64, 32, 4, 1), flash_plan.TileConfig(32, 64, 4, 1),
                               flash_plan.TileConfig(64, 32, 4, 1))


def runs(*pieces):
    """Ids from (id, length) runs."""
    return np.concatenate([np.full(n, i, np.int32) for i, n in pieces])


# (q ids, kv ids): documents on tile boundaries, off them with partial last tiles, ids repeating in
# runs (unsorted: only the first run of pure tiles is unmasked), keys of a different length, and a
# query document (id 1) that no key holds.
DOCS = {
    "aligned": (runs((0, 64), (1, 64), (2, 128)),) * 2,
    "unaligned_partial": (runs((0, 37), (1, 91), (2, 102)),) * 2,
    "repeated": (runs((0, 64), (1, 64), (0, 64), (1, 32), (0, 32)),) * 2,
    "cross": (runs((1, 64), (2, 128)), runs((0, 64), (1, 64), (2, 128))),
    "absent": (runs((0, 64), (1, 64), (2, 128)), runs((0, 64), (3, 64), (2, 128))),
}


def expected_ranges(own, other, block_own, block_other):
    """numpy model of segments.py: per own tile (first, end) of the other tiles sharing an id range,
    and (first, end) of the first run of whole other tiles holding only the whole own tile's one id."""
    out = []
    for t0 in range(0, len(own), block_own):
        ids = own[t0:t0 + block_own]
        shared = [u0 for u0 in range(0, len(other), block_other)
                  if other[u0:u0 + block_other].max() >= ids.min() and other[u0:u0 + block_other].min() <= ids.max()]
        lo, hi = (shared[0], shared[-1] + block_other) if shared else (0, 0)
        pure = []
        if len(ids) == block_own and ids.min() == ids.max():
            for u0 in range(0, len(other), block_other):
                tile = other[u0:u0 + block_other]
                is_pure = len(tile) == block_other and (tile == ids[0]).all()
                if is_pure and (not pure or pure[-1] == u0 - block_other):
                    pure.append(u0)
                elif pure:
                    break
        plo, phi = (pure[0], pure[-1] + block_other) if pure else (0, 0)
        out.append((lo, hi, plo, phi))
    return np.array(out, np.int32)


def ranges_launches(q_ids, kv_ids):
    """The segment-range launches the forward, dK/dV and dQ plans start with, for TILES."""
    sq, sk = len(q_ids), len(kv_ids)
    q = torch.zeros(1, sq, 1, 16)
    k = torch.zeros(1, sk, 1, 16)
    qs, ks = torch.from_numpy(q_ids[None]), torch.from_numpy(kv_ids[None])
    shapes = check_flash_args(q, k, k, q_segment_ids=qs, kv_segment_ids=ks)
    strides = dict(query=q.stride(), key=k.stride(), value=k.stride(), out=q.stride(),
                   q_segment_ids=qs.stride(), kv_segment_ids=ks.stride())
    options = FlashOptions.build(head_dim=16, causal=True)
    fwd = flash_plan.plan_forward(shapes, options, strides, config=TILES)
    bwd = flash_plan.plan_backward(shapes, options, strides, config=TILES)
    return {"fwd": fwd, "dkdv": bwd.dkdv, "dq": bwd.dq}, {"q_segment_ids": qs, "kv_segment_ids": ks}, shapes


def from_tile_ids(head, shapes, monkeypatch):
    """The launches segment_ranges_first makes where the other axis is longer than TILE_IDS_FROM ids (made short
    here, and SEGMENT_CHUNK with it: two 32-row tiles a tile-ids program): the other tiles' [min, max] ids
    first, then the ranges from them."""
    c = head.constexpr_dict
    monkeypatch.setattr(flash_plan, "TILE_IDS_FROM", 64)
    monkeypatch.setattr(flash_plan, "SEGMENT_CHUNK", 64)
    chain = flash_plan.segment_ranges_first(head.then, shapes, dict(head.scalars), c["BLOCK_OWN"], c["BLOCK_OTHER"],
                                            c["OWN_IS_QUERY"])
    assert chain.kernel == "segment_tile_ids_kernel" and chain.constexpr_dict["TILES"] == 2
    assert chain.then.constexpr_dict["FROM_TILE_IDS"] and chain.then.then is head.then
    return chain


def random_docs(seed):
    """(q ids, kv ids) of random runs: lengths 1-150, ids from a few (so they repeat, unsorted), 256 + a few
    tokens; queries and keys the same ids or independent ones."""
    rng = np.random.default_rng(seed)

    def ids(n):
        pieces, total = [], 0
        while total < n:
            length = int(rng.integers(1, 150))
            pieces.append((int(rng.integers(0, 4)), length))
            total += length
        return runs(*pieces)[:n]
    q = ids(256 + int(rng.integers(0, 40)))
    return (q, q) if seed % 2 else (q, ids(256 + int(rng.integers(0, 40))))


@pytest.mark.parametrize("source, chunk_tiles", [("ids", None), ("ids", 1), ("ids", 4), ("tile_ids", None),
                                                 ("tile_ids", 4)],
                         ids=["plan", "chunk1", "chunk4", "tile_ids-plan", "tile_ids-chunk4"])
@pytest.mark.parametrize("docs", ["unaligned_partial", "repeated", "cross", "absent", "random0", "random1",
                                  "random2", "random3"])
def test_ranges_kernel_gives_the_first_pure_run(docs, chunk_tiles, source, monkeypatch):
    """The kernel reads the other axis CHUNK_TILES tiles at a time: the plan's chunk (the whole axis here), and
    chunks of one and of four tiles, so that runs and ranges cross chunk boundaries (the last chunk of four
    reaches past the sequence where the tile count is not a multiple of four); from the ids themselves, or
    from the other tiles' [min, max] ids, as on a long other axis."""
    q_ids, kv_ids = random_docs(int(docs[6:])) if docs.startswith("random") else DOCS[docs]
    launches, arrays, shapes = ranges_launches(q_ids, kv_ids)
    pure_runs = 0
    for name, head in launches.items():
        assert head.kernel == "segment_ranges_kernel" and head.then.constexpr_dict["SEGMENT_SKIP"], name
        assert not head.constexpr_dict["FROM_TILE_IDS"]   # (an other axis of one chunk)
        first = from_tile_ids(head, shapes, monkeypatch) if source == "tile_ids" else None
        head = first.then if first else head
        if chunk_tiles:
            head = dataclasses.replace(head, constexprs=tuple(
                (k, chunk_tiles if k == "CHUNK_TILES" else v) for k, v in head.constexprs))
        c = head.constexpr_dict
        own, other = (q_ids, kv_ids) if c["OWN_IS_QUERY"] else (kv_ids, q_ids)
        head = dataclasses.replace(head, then=None)
        got = _launch.run(dataclasses.replace(first, then=head) if first else head, arrays)["segment_ranges"]
        got = got[0].numpy()
        want = expected_ranges(own, other, c["BLOCK_OWN"], c["BLOCK_OTHER"])
        np.testing.assert_array_equal(got, want, err_msg=name)
        # What the kernels rely on: every pair of a tile in the pure run with the own tile has equal ids,
        # inside both sequences; every pair of a tile outside [first, end) has different ids.
        for t, (lo, hi, plo, phi) in enumerate(got):
            mine = own[t * c["BLOCK_OWN"]:(t + 1) * c["BLOCK_OWN"]]
            assert plo == phi or (lo <= plo < phi <= hi and phi <= len(other) and len(mine) == c["BLOCK_OWN"])
            assert (other[plo:phi][None, :] == mine[:, None]).all(), (name, t)
            outside = np.concatenate([other[:lo], other[hi:]])
            assert not np.isin(outside, mine).any(), (name, t)
        pure_runs += int((got[:, 3] > got[:, 2]).sum())
    assert pure_runs > 0 or docs.startswith("random")   # (the fixed cases exercise the unmasked path)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("docs", list(DOCS))
def test_documents_forward_backward(docs, causal, torch_gen):
    q_ids, kv_ids = DOCS[docs]
    sq, sk = len(q_ids), len(kv_ids)
    q = torch.randn(1, sq, 2, 32, generator=torch_gen, requires_grad=True)
    k = torch.randn(1, sk, 1, 32, generator=torch_gen, requires_grad=True)
    v = torch.randn(1, sk, 1, 32, generator=torch_gen, requires_grad=True)
    dout = torch.randn(1, sq, 2, 32, generator=torch_gen)
    ids = dict(q_segment_ids=torch.from_numpy(q_ids[None]), kv_segment_ids=torch.from_numpy(kv_ids[None]))
    with ex.override(TILES, algorithm="flash"):
        out, lse = flash_attention(q, k, v, causal=causal, return_lse=True, **ids)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rout, rlse = reference_attention(*ref, causal=causal, **ids)
    rgrads = torch.autograd.grad(rout, ref, dout.double())
    assert_close_rel(out, rout, 1e-5, "out")
    assert_close_rel(lse, rlse, 1e-5, "lse")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close_rel(g, rg, 2e-5, name)
    if docs == "absent":   # id 1's queries see no key: output 0, lse -inf, gradients 0
        dead = torch.from_numpy(q_ids == 1)
        assert torch.equal(out[0, dead], torch.zeros_like(out[0, dead]))
        assert torch.isneginf(lse[0][:, dead]).all()
        assert torch.equal(grads[0][0, dead], torch.zeros_like(grads[0][0, dead]))
        assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_documents_on_the_gpu(head_dim, causal, torch_gen):
    """The GPU's tuned tiles: documents of ragged lengths, a repeated id and a partial last tile, bf16."""
    ids = runs((0, 1000), (1, 1536), (2, 517), (0, 700), (3, 333))
    s = len(ids)
    q, k, v = (torch.randn(1, s, 4, head_dim, generator=torch_gen).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, s, 4, head_dim, generator=torch_gen).to("cuda", torch.bfloat16)
    seg = torch.from_numpy(ids[None]).cuda()
    out = flash_attention(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    rout, _ = reference_attention(*ref, causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    rgrads = torch.autograd.grad(rout, ref, dout.double())
    assert_close_rel(out, rout, 1e-2, "out")
    for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close_rel(g, rg, 1e-2, name)


@pytest.mark.gpu
def test_long_packs_take_the_tile_ids_on_the_gpu(monkeypatch, torch_gen):
    """Past plan.TILE_IDS_FROM ids the ranges come from the other tiles' [min, max] ids (segment_tile_ids_kernel):
    the same output and gradients, bit for bit, as with the ranges reduced from the ids themselves, on the GPU's
    tiles: 20k tokens of ragged documents with a repeated id (segment ids), and the same pack as one varlen table
    (run as documents where the Gluon kernels take it)."""
    from dualattn.torch_api import flash_attn_varlen_func
    from plan_spy import spy_chains
    lens = [3000, 517, 2048, 4100, 1, 777, 5000, 1333, 3555]
    ids = runs(*((i % 7, n) for i, n in enumerate(lens)))   # (ids 0 and 1 come back, unsorted)
    s = len(ids)
    q, k, v = (torch.randn(1, s, 8, 128, generator=torch_gen).to("cuda", torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, s, 8, 128, generator=torch_gen).to("cuda", torch.bfloat16)
    seg = torch.from_numpy(ids[None]).cuda()
    table = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")

    def both():
        out = flash_attention(q, k, v, causal=True, q_segment_ids=seg, kv_segment_ids=seg)
        packed = [t[0] for t in (q, k, v)]
        varlen = flash_attn_varlen_func(*packed, table, table, max(lens), max(lens), causal=True)
        return (out, varlen, *torch.autograd.grad((out, varlen), (q, k, v), (dout, dout[0])))

    chains = spy_chains(monkeypatch)
    backward_chains = spy_chains(monkeypatch, "plan_backward")
    from_tile_ids = both()
    assert sum("segment_tile_ids_kernel" in chain for chain in chains) >= 2, chains   # ids and the varlen table
    assert any("segment_tile_ids_kernel" in chain for chain in backward_chains), backward_chains
    monkeypatch.setattr(flash_plan, "TILE_IDS_FROM", 1 << 30)
    flash_plan.forget_plans()
    planned = len(chains)
    from_ids = both()
    assert len(chains) > planned and not any("segment_tile_ids_kernel" in chain for chain in chains[planned:])
    for name, a, b in zip(("out", "varlen out", "dq", "dk", "dv"), from_tile_ids, from_ids):
        if name == "dq":   # the one-pass kernel's TMA reductions add in the order programs reach them: a few
            # sums round the other way from run to run (tests/parity's _assert_same_bits)
            assert bool(((a.float() - b.float()).abs() <= b.float().abs() * 2.0 ** -7 + 1e-6).all()), name
            assert int((a != b).sum()) < a.numel() // 1000, name
            continue
        assert torch.equal(a, b), name
