"""Ring layouts and schedules (dualattn/ring.py), framework-free: the blocks of every step, replayed
with the kernels' mask rule on local indices, must attend exactly the global mask, each pair once."""
import numpy as np
import pytest

import dualattn
from dualattn import ring


def _global_mask(seq_len, left, right):
    d = np.arange(seq_len)[None, :] - np.arange(seq_len)[:, None]   # kpos - qpos
    ok = np.ones((seq_len, seq_len), bool)
    if left is not None:
        ok &= d >= -left
    if right is not None:
        ok &= d <= right
    return ok


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_permutation(world, layout):
    seq_len = 8 * world
    perm = dualattn.ring_permutation(seq_len, world, layout)
    assert sorted(perm.tolist()) == list(range(seq_len))
    shard = seq_len // world
    for r in range(world):
        mine = perm[r * shard:(r + 1) * shard]
        if layout == "contiguous":
            assert mine.tolist() == list(range(r * shard, (r + 1) * shard))
        else:   # chunks r and 2W-1-r, in that order
            chunk = shard // 2
            assert mine.tolist() == list(range(r * chunk, (r + 1) * chunk)) + list(
                range((2 * world - 1 - r) * chunk, (2 * world - r) * chunk))
        runs = ring.shard_runs(seq_len, world, layout, r)
        assert np.concatenate([np.arange(u.position, u.position + u.length) for u in runs]).tolist() == mine.tolist()


def test_zigzag_balances_causal_work():
    world, seq_len = 4, 64
    perm = dualattn.ring_permutation(seq_len, world, "zigzag").reshape(world, -1)
    work = [int(sum(p + 1 for p in rows)) for rows in perm]     # keys each rank's queries see, causal
    assert len(set(work)) == 1
    contiguous = dualattn.ring_permutation(seq_len, world, "contiguous").reshape(world, -1)
    assert len({int(sum(p + 1 for p in rows)) for rows in contiguous}) == world


def _attended(seq_len, world, layout, left, right):
    """(S, S) counts of how often each global (query, key) pair is attended by the blocks of every
    rank's steps, each block replayed with the kernels' mask rule on its local indices."""
    perm = ring.ring_permutation(seq_len, world, layout).reshape(world, -1)
    seen = np.zeros((seq_len, seq_len), int)
    for rank in range(world):
        for t, blocks in enumerate(ring.ring_schedule(seq_len, world, layout, rank, left, right)):
            kv_positions = perm[(rank - t) % world]
            for b in blocks:
                ok = np.ones((b.q_stop - b.q_start, b.kv_stop - b.kv_start), bool)
                if b.masked:   # the kernels' rule: row i at i + diag, column j at j
                    d = np.arange(ok.shape[1])[None, :] - np.arange(ok.shape[0])[:, None] - b.diag
                    ok &= (d >= -left) if left is not None else True
                    ok &= (d <= right) if right is not None else True
                seen[np.ix_(perm[rank][b.q_start:b.q_stop], kv_positions[b.kv_start:b.kv_stop])] += ok
    return seen


def _assert_exact(seq_len, world, layout, left, right):
    seen = _attended(seq_len, world, layout, left, right)
    wrong = np.argwhere((seen > 1) | (seen.astype(bool) != _global_mask(seq_len, left, right)))
    if len(wrong):
        q, k = wrong[0]
        rank = int(np.flatnonzero(ring.ring_permutation(seq_len, world, layout) == q)[0]) // (seq_len // world)
        raise AssertionError(f"S={seq_len} W={world} {layout} window=({left}, {right}): {len(wrong)} wrong pairs, "
                             f"e.g. query {q} (rank {rank}) key {k} attended {seen[q, k]} times")


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, 0), (2, 5), (0, 0), (9, None)])
def test_schedule_attends_exactly_the_global_mask(world, layout, window):
    _assert_exact(12 * world, world, layout, *window)


# Zigzag chunks of 3 tokens: the shortest at which a window edge can cut two run pairs of one launch
# differently (a left edge through one, the causal edge through the other).
CHUNK = 3


@pytest.mark.parametrize("world", range(2, 9))
@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_schedule_is_exact_for_every_window_length(world, layout):
    # causal windows (w, 0), one-sided (w, None) and ones reaching one token ahead (w, 1): every w
    seq_len = 2 * CHUNK * world
    for left in [None, *range(seq_len + 1)]:
        for right in (0, None, 1):
            _assert_exact(seq_len, world, layout, left, right)


@pytest.mark.parametrize("world", [2, 3])
def test_schedule_is_exact_for_every_window(world):
    seq_len = 2 * CHUNK * world
    for left in [None, *range(seq_len + 1)]:
        for right in [None, *range(seq_len + 1)]:
            _assert_exact(seq_len, world, "zigzag", left, right)


@pytest.mark.parametrize("seq_len, left", [(64, 20), (128, 40), (128, 70), (128, 100)])
def test_schedule_is_exact_for_causal_windows_past_two_chunks(seq_len, left):
    _assert_exact(seq_len, 4, "zigzag", left, 0)


@pytest.mark.slow   # every (left, right) for every world size up to 8 and two chunk lengths: minutes
@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("chunk", [CHUNK, 4])
def test_schedule_is_exact_for_every_window_slow(world, layout, chunk):
    seq_len = 2 * chunk * world
    for left in [None, *range(seq_len + 1)]:
        for right in [None, *range(seq_len + 1)]:
            _assert_exact(seq_len, world, layout, left, right)


def test_fully_masked_steps_are_skipped():
    # contiguous causal: rank r computes steps 0..r only (shards from later ranks are all future)
    for rank in range(4):
        steps = ring.ring_schedule(32, 4, "contiguous", rank, None, 0)
        assert [bool(s) for s in steps] == [t <= rank for t in range(4)]
    # zigzag causal: one launch per step, unmasked except the own shard's
    for rank in range(4):
        steps = ring.ring_schedule(32, 4, "zigzag", rank, None, 0)
        assert all(len(s) == 1 for s in steps)
        assert steps[0][0].masked and not any(s[0].masked for s in steps[1:])
    # a narrow window: the ring stops after the steps any rank needs
    schedules = [ring.ring_schedule(64, 4, "contiguous", r, 3, 0) for r in range(4)]
    assert ring.active_steps(schedules) == 2


@pytest.mark.parametrize("seq_len, world, layout", [(6, 4, "contiguous"), (12, 4, "zigzag"), (6, 2, "zigzag")])
def test_indivisible_lengths_are_rejected(seq_len, world, layout):
    with pytest.raises(ValueError, match="multiple of"):
        dualattn.ring_permutation(seq_len, world, layout)


def test_unknown_layout_is_rejected():
    with pytest.raises(ValueError, match="layout"):
        dualattn.ring_permutation(8, 2, "striped")
