"""Block-map builders (dualattn.masks) and SparseMask (dualattn.sparse): numpy only, fast.

Every builder is checked against a brute-force token-level definition: a block is active iff some
(real, not padded) token pair inside it is allowed.  Positions are bottom-right aligned as in
flash_attention: query i sits at i + (Sk - Sq), key j at j.
"""
from __future__ import annotations

import numpy as np
import pytest

from dualattn import masks
from dualattn.sparse import SparseMask

SIZES = [(64, 64, 16, 16), (50, 90, 16, 32), (90, 37, 32, 16), (5, 70, 16, 16), (33, 33, 64, 16)]


def blocks_of(allowed: np.ndarray, bq: int, bk: int) -> np.ndarray:
    """Token map (..., Sq, Sk) -> block map (..., nq, nk): any allowed pair in the block."""
    *lead, sq, sk = allowed.shape
    nq, nk = -(-sq // bq), -(-sk // bk)
    pad = np.zeros((*lead, nq * bq, nk * bk), bool)
    pad[..., :sq, :sk] = allowed
    return pad.reshape(*lead, nq, bq, nk, bk).any(axis=(-3, -1))


def diff(sq, sk):
    """kpos - qpos, (Sq, Sk)."""
    return np.arange(sk)[None, :] - (np.arange(sq)[:, None] + sk - sq)


def token_window(sq, sk, left, right):
    d = diff(sq, sk)
    ok = np.ones((sq, sk), bool)
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    return ok


def token_global(sq, sk, n):
    return (np.arange(sq)[:, None] < n) | (np.arange(sk)[None, :] < n)


def build(builder, sq, sk, bq, bk, batch=2, heads=3):
    bm = builder(batch, heads, sq, sk, bq, bk)
    assert bm.dtype == np.bool_ and bm.ndim == 4
    assert bm.shape[-2:] == (-(-sq // bq), -(-sk // bk))
    return bm


# --------------------------------------------------------------------------------------------------
# builders vs brute force
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sq,sk,bq,bk", SIZES)
@pytest.mark.parametrize("name,builder,left,right", [
    ("causal", masks.causal(), None, 0),
    ("local(7)", masks.local(7), 7, 7),
    ("local((20, 0))", masks.local((20, 0)), 20, 0),
    ("local((0, 13))", masks.local((0, 13)), 0, 13),
    ("local((None, 3))", masks.local((None, 3)), None, 3),
    ("local((40, None))", masks.local((40, None)), 40, None),
])
def test_band_builders(sq, sk, bq, bk, name, builder, left, right):
    bm = build(builder, sq, sk, bq, bk)
    np.testing.assert_array_equal(bm[0, 0], blocks_of(token_window(sq, sk, left, right), bq, bk), err_msg=name)


@pytest.mark.parametrize("sq,sk,bq,bk", SIZES)
@pytest.mark.parametrize("n", [0, 1, 16, 20, 100])
def test_global_tokens(sq, sk, bq, bk, n):
    bm = build(masks.global_tokens(n), sq, sk, bq, bk)
    np.testing.assert_array_equal(bm[0, 0], blocks_of(token_global(sq, sk, n), bq, bk))


@pytest.mark.parametrize("sq,sk,bq,bk", SIZES)
@pytest.mark.parametrize("stride", [1, 2, 3])
def test_strided(sq, sk, bq, bk, stride):
    bm = build(masks.strided(stride), sq, sk, bq, bk)[0, 0]
    want = np.array([[(i - j) % stride == 0 for j in range(bm.shape[1])] for i in range(bm.shape[0])])
    np.testing.assert_array_equal(bm, want)


@pytest.mark.parametrize("s,bq,bk", [(64, 16, 16), (75, 16, 32), (40, 64, 16)])
def test_document(rng, s, bq, bk):
    seg = np.sort(rng.integers(0, 5, size=(3, s)), axis=1)
    seg[1] = rng.integers(0, 3, size=s)                                   # unsorted ids are fine too
    bm = build(masks.document(seg), s, s, bq, bk, batch=3)
    assert bm.shape[:2] == (3, 1)                                         # per batch, shared by heads
    allowed = seg[:, :, None] == seg[:, None, :]
    np.testing.assert_array_equal(bm[:, 0], blocks_of(allowed, bq, bk))


@pytest.mark.parametrize("sq,sk,bq,bk", SIZES)
def test_union_and_intersection(sq, sk, bq, bk):
    a, b = masks.causal(), masks.global_tokens(20)
    ta, tb = token_window(sq, sk, None, 0), token_global(sq, sk, 20)
    union = build(a | b, sq, sk, bq, bk)[0, 0]
    inter = build(a & b, sq, sk, bq, bk)[0, 0]
    ba, bb = build(a, sq, sk, bq, bk)[0, 0], build(b, sq, sk, bq, bk)[0, 0]
    np.testing.assert_array_equal(union, ba | bb)
    np.testing.assert_array_equal(union, blocks_of(ta | tb, bq, bk))     # union is exact at token level
    np.testing.assert_array_equal(inter, ba & bb)                         # intersection is block-level:
    assert not (blocks_of(ta & tb, bq, bk) & ~inter).any()                # conservative for the token rules
    three = build(masks.causal() & masks.local((24, 0)) | masks.global_tokens(8), sq, sk, bq, bk)[0, 0]
    np.testing.assert_array_equal(
        three, (ba & build(masks.local((24, 0)), sq, sk, bq, bk)[0, 0]) | build(masks.global_tokens(8), sq, sk,
                                                                                 bq, bk)[0, 0])
    assert "causal" in repr(a | b) and "global_tokens(20)" in repr(a | b)


def test_callables_as_builders():
    def diag(b, h, sq, sk, bq, bk):                                       # 2-D block map
        return np.eye(-(-sq // bq), -(-sk // bk), dtype=bool)

    def per_head(b, h, sq, sk, bq, bk):                                   # 3-D: (H, nq, nk)
        nq, nk = -(-sq // bq), -(-sk // bk)
        out = np.zeros((h, nq, nk), np.int32)
        out[np.arange(h), 0, np.arange(h) % nk] = 1
        return out

    builder = masks.as_builder(diag)
    bm = build(builder, 64, 64, 16, 16)
    assert bm.shape == (1, 1, 4, 4) and np.array_equal(bm[0, 0], np.eye(4, dtype=bool))
    assert builder.name == "diag" and masks.as_builder(builder) is builder
    bm = build(masks.as_builder(per_head), 64, 64, 16, 16)
    assert bm.shape == (1, 3, 4, 4) and bm.dtype == np.bool_ and bm.sum() == 3
    union = build(masks.global_tokens(1) | diag, 64, 64, 16, 16)[0, 0]   # a plain callable on the right
    np.testing.assert_array_equal(union, np.eye(4, dtype=bool) | build(masks.global_tokens(1), 64, 64, 16, 16)[0, 0])
    inter = build(masks.causal() & per_head, 64, 64, 16, 16)              # broadcasting (1,1) & (1,H)
    assert inter.shape == (1, 3, 4, 4)
    with pytest.raises(TypeError, match="mask_builder"):
        masks.as_builder(3)
    with pytest.raises(TypeError, match="mask_builder"):
        masks.causal() | np.ones((4, 4), bool)


@pytest.mark.parametrize("make,err,match", [
    (lambda: masks.local(-1), ValueError, "window"),
    (lambda: masks.local((3, -2)), ValueError, "window"),
    (lambda: masks.strided(0), ValueError, "stride"),
    (lambda: masks.global_tokens(-1), ValueError, "global_tokens"),
    (lambda: masks.document(np.zeros(8, np.int32)), ValueError, "segment_ids"),
])
def test_builder_errors(make, err, match):
    with pytest.raises(err, match=match):
        make()


def test_document_length_mismatch():
    builder = masks.document(np.zeros((1, 32), np.int32))
    with pytest.raises(ValueError, match="segment_ids length"):
        builder(1, 1, 48, 48, 16, 16)
    with pytest.raises(ValueError, match="Sq = Sk"):
        builder(1, 1, 32, 48, 16, 16)


# --------------------------------------------------------------------------------------------------
# SparseMask
# --------------------------------------------------------------------------------------------------
def _random_map(rng, shape=(2, 3, 7, 9)):
    bm = rng.random(shape) < 0.4
    bm[0, 0, 2] = False                                                   # empty row
    bm[1, 2, :, 4] = False                                                # empty column
    bm[0, 1] = True                                                       # full head
    return bm


def test_from_block_map_numpy_round_trip(rng):
    bm = _random_map(rng)
    layout = SparseMask.from_block_map(bm, 16, 32)
    out = layout.to_block_map()
    assert out.dtype == np.bool_ and np.array_equal(out, bm)
    out[...] = False                                                      # a copy: the layout is unchanged
    assert np.array_equal(layout.to_block_map(), bm)
    assert (layout.block_q, layout.block_k) == (16, 32) and layout.shape == (2, 3, 7, 9)
    assert layout.density == pytest.approx(layout.block_map.mean())


def test_from_block_map_does_not_alias_input(rng):
    bm = _random_map(rng)
    layout = SparseMask.from_block_map(bm, 16, 16)
    bm[...] = False
    assert layout.to_block_map().sum() == layout.kv_counts.sum() > 0


def test_from_block_map_int_is_nonzero(rng):
    vals = rng.integers(0, 3, size=(1, 1, 4, 5))
    layout = SparseMask.from_block_map(vals, 16, 16)
    np.testing.assert_array_equal(layout.to_block_map(), vals != 0)


def test_from_block_map_torch(rng):
    torch = pytest.importorskip("torch")
    bm = _random_map(rng)
    layout = SparseMask.from_block_map(torch.from_numpy(bm), 64, 64)
    np.testing.assert_array_equal(layout.to_block_map(), bm)
    assert isinstance(layout.to_block_map(), np.ndarray)


def test_from_block_map_jax(rng):
    jnp = pytest.importorskip("jax.numpy")
    bm = _random_map(rng)
    layout = SparseMask.from_block_map(jnp.asarray(bm), 16, 16)
    np.testing.assert_array_equal(layout.to_block_map(), bm)
    assert isinstance(layout.to_block_map(), np.ndarray)


def test_packed_lists(rng):
    bm = _random_map(rng)
    layout = SparseMask.from_block_map(bm, 16, 16)
    lb, lh, nq, nk = bm.shape
    for name, arr, shape in (("kv_counts", layout.kv_counts, (lb, lh, nq)),
                             ("kv_indices", layout.kv_indices, (lb, lh, nq, nk)),
                             ("q_counts", layout.q_counts, (lb, lh, nk)),
                             ("q_indices", layout.q_indices, (lb, lh, nk, nq)),
                             ("q_order", layout.q_order, (lb, lh, nq)),
                             ("k_order", layout.k_order, (lb, lh, nk))):
        assert arr.shape == shape and arr.dtype == np.int32, name
    for b in range(lb):
        for h in range(lh):
            for i in range(nq):   # kv lists: ascending, complete
                c = layout.kv_counts[b, h, i]
                np.testing.assert_array_equal(layout.kv_indices[b, h, i, :c], np.flatnonzero(bm[b, h, i]))
            for j in range(nk):   # q lists: the transpose
                c = layout.q_counts[b, h, j]
                np.testing.assert_array_equal(layout.q_indices[b, h, j, :c], np.flatnonzero(bm[b, h, :, j]))
            for order, counts in ((layout.q_order[b, h], layout.kv_counts[b, h]),
                                  (layout.k_order[b, h], layout.q_counts[b, h])):
                assert sorted(order.tolist()) == list(range(counts.size))    # a permutation
                assert np.all(np.diff(counts[order]) <= 0)                   # busiest first
    assert layout.kv_counts[0, 0, 2] == 0 and layout.q_counts[1, 2, 4] == 0
    assert layout.kv_counts.sum() == layout.q_counts.sum() == bm.sum()
    arrays = layout.arrays()
    assert set(arrays) == {"sparse_kv_count", "sparse_kv_index", "sparse_q_order", "sparse_q_count",
                           "sparse_q_index", "sparse_k_order"}
    assert arrays["sparse_kv_index"] is layout.kv_indices


def test_builder_layout_lists():
    """A causal layout: row i lists key blocks 0..i; column j lists query blocks j..nq-1."""
    layout = SparseMask.from_block_map(masks.causal()(1, 1, 128, 128, 32, 32), 32, 32)
    np.testing.assert_array_equal(layout.kv_counts[0, 0], [1, 2, 3, 4])
    np.testing.assert_array_equal(layout.kv_indices[0, 0, 3], [0, 1, 2, 3])
    np.testing.assert_array_equal(layout.q_counts[0, 0], [4, 3, 2, 1])
    np.testing.assert_array_equal(layout.q_indices[0, 0, 1, :3], [1, 2, 3])
    np.testing.assert_array_equal(layout.q_order[0, 0], [3, 2, 1, 0])
    np.testing.assert_array_equal(layout.k_order[0, 0], [0, 1, 2, 3])


@pytest.mark.parametrize("block_q,block_k", [(48, 16), (16, 8), (0, 16), (16, -16), (16, 16.0), (True, 16)])
def test_bad_block_sizes(block_q, block_k):
    """Sizes that are not powers of two >= 16 raise ValueError; a float or a bool TypeError; each names
    the argument."""
    name = "block_q" if type(block_q) is not int or block_q != 16 else "block_k"
    error = TypeError if isinstance(block_q, (bool, float)) or isinstance(block_k, float) else ValueError
    with pytest.raises(error, match=name):
        SparseMask.from_block_map(np.ones((1, 1, 2, 2), bool), block_q, block_k)


@pytest.mark.parametrize("block_q,block_k", [(0, 16), (16, 0), (-32, 16), (16, 24), (16.0, 16)])
def test_blocksparse_block_sizes_are_checked_before_the_builder_runs(block_q, block_k):
    """blocksparse_attention with a mask_builder: a block size of 0 or less (once a ZeroDivisionError from
    inside the builder), not a power of two, or a float is an error naming the argument, in both front
    ends; so is a builder called directly with a block size below 1."""
    import jax.numpy as jnp
    import torch
    import dualattn.jax_api as dj
    import dualattn.torch_api as dt
    name = "block_q" if type(block_q) is not int or block_q != 16 else "block_k"
    error = TypeError if isinstance(block_q, float) else ValueError
    t, x = torch.ones(1, 32, 1, 16), jnp.ones((1, 32, 1, 16))
    with pytest.raises(error, match=name):
        dt.blocksparse_attention(t, t, t, mask_builder=masks.causal(), block_q=block_q, block_k=block_k)
    with pytest.raises(error, match=name):
        dj.blocksparse_attention(x, x, x, mask_builder=masks.local(4), block_q=block_q, block_k=block_k,
                                 backend="xla")
    if block_q <= 0 or block_k <= 0:
        with pytest.raises(ValueError, match=name):
            masks.causal()(1, 1, 32, 32, block_q, block_k)


@pytest.mark.parametrize("call,error,name", [
    (lambda: masks.local(-1), ValueError, "left"), (lambda: masks.local((2, -3)), ValueError, "right"),
    (lambda: masks.local(1.5), TypeError, "left"), (lambda: masks.local((1, 2, 3)), TypeError, "window"),
    (lambda: masks.strided(0), ValueError, "stride"), (lambda: masks.strided("2"), TypeError, "stride"),
    (lambda: masks.global_tokens(-1), ValueError, "n"), (lambda: masks.global_tokens(2.0), TypeError, "n")])
def test_builder_arguments_are_checked(call, error, name):
    with pytest.raises(error, match=name):
        call()


@pytest.mark.parametrize("shape", [(2, 2), (1, 2, 2), (1, 1, 1, 2, 2)])
def test_bad_rank(shape):
    with pytest.raises(ValueError, match="4-D"):
        SparseMask.from_block_map(np.ones(shape, bool), 16, 16)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.complex64])
def test_bad_dtype(dtype):
    with pytest.raises(TypeError, match="boolean"):
        SparseMask.from_block_map(np.ones((1, 1, 2, 2), dtype), 16, 16)


def test_check():
    layout = SparseMask.from_block_map(np.ones((2, 1, 3, 4), bool), 16, 32)
    layout.check(2, 8, 40, 100)                      # ceil(40/16) = 3, ceil(100/32) = 4
    layout.check(2, 1, 33, 97)
    SparseMask.from_block_map(np.ones((1, 1, 3, 4), bool), 16, 32).check(5, 7, 48, 128)
    with pytest.raises(ValueError, match="batch/head"):
        layout.check(3, 8, 40, 100)                  # batch dim 2 is neither 1 nor 3
    with pytest.raises(ValueError, match="batch/head"):
        SparseMask.from_block_map(np.ones((1, 4, 3, 4), bool), 16, 32).check(2, 8, 40, 100)
    with pytest.raises(ValueError, match="3x4 blocks"):
        layout.check(2, 8, 49, 100)                  # needs 4 query blocks
    with pytest.raises(ValueError, match="3x4 blocks"):
        layout.check(2, 8, 40, 96)                   # needs 3 key blocks
    with pytest.raises(ValueError, match="3x4 blocks"):
        layout.check(2, 8, 40, 129)
