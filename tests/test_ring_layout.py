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


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("window", [(None, None), (None, 0), (3, 0), (2, 5), (0, 0), (9, None)])
def test_schedule_attends_exactly_the_global_mask(world, layout, window):
    seq_len = 12 * world
    left, right = window
    want = _global_mask(seq_len, left, right)
    perm = ring.ring_permutation(seq_len, world, layout).reshape(world, -1)
    for rank in range(world):
        seen = np.zeros((len(perm[rank]), seq_len), int)
        for t, blocks in enumerate(ring.ring_schedule(seq_len, world, layout, rank, left, right)):
            kv_positions = perm[(rank - t) % world]
            for b in blocks:
                i = np.arange(b.q_stop - b.q_start)[:, None]
                j = np.arange(b.kv_stop - b.kv_start)[None, :]
                ok = np.ones((len(i), j.shape[1]), bool)
                if b.masked:   # the kernels' rule: row i at i + diag, column j at j
                    d = j - i - b.diag
                    ok &= (d >= -left) if left is not None else True
                    ok &= (d <= right) if right is not None else True
                cols = kv_positions[b.kv_start:b.kv_stop]
                seen[b.q_start:b.q_stop, cols] += ok
        assert seen.max() <= 1, "a pair attended twice"
        np.testing.assert_array_equal(seen.astype(bool), want[perm[rank]], err_msg=f"rank {rank}")


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
