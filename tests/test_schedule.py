"""The order in which flash programs take their (tile, batch*head) work: rules.program_tile.

Blocks are dispatched in order x + y * grid_x.  Uneven (causal-like) launches must still cover
every work item exactly once, hand out the busiest tiles first inside groups of a few heads, and
keep each dispatch group within those heads (their K/V stay in L2).  Run through Triton's
interpreter, so no GPU is needed.
"""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from dualattn.kernels import _interpret  # noqa: E402

GROUP = 4  # program_tile's default SCHEDULE_HEADS
program_tile = None  # the interpreted helper (the interpreter resolves a kernel's callees as module globals)


@pytest.fixture(scope="module")
def probe():
    global program_tile
    program_tile = _interpret._import_interpreted("flash.rules").program_tile
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")  # read when @triton.jit decorates

    @triton.jit
    def probe_kernel(OUT, UNEVEN: tl.constexpr, HEAVY_LAST: tl.constexpr):
        tile, b, h, _ = program_tile(1, OUT, 0, 0, False, UNEVEN, HEAVY_LAST)
        tl.store(OUT + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), tile * tl.num_programs(1) + b)

    mp.undo()

    def run(n_tiles, n_bh, uneven, heavy_last):
        out = torch.full((n_bh * n_tiles,), -1, dtype=torch.int32)
        probe_kernel[(n_tiles, n_bh, 1)](out, UNEVEN=uneven, HEAVY_LAST=heavy_last)
        work = out.numpy()  # indexed by dispatch order
        return work // n_bh, work % n_bh  # (tile, batch*head) per dispatch slot
    return run


@pytest.mark.parametrize("n_tiles,n_bh", [(1, 1), (5, 7), (3, 2), (8, 4), (6, 9)])
@pytest.mark.parametrize("heavy_last", [False, True])
def test_uneven_order_covers_each_item_once_busiest_first_within_head_groups(probe, n_tiles, n_bh, heavy_last):
    tile, bh = probe(n_tiles, n_bh, True, heavy_last)
    assert sorted(zip(tile.tolist(), bh.tolist())) == [(t, b) for t in range(n_tiles) for b in range(n_bh)]
    for start in range(0, n_bh, GROUP):
        slots = slice(start * n_tiles, min(n_bh, start + GROUP) * n_tiles)
        assert set(bh[slots].tolist()) == set(range(start, min(n_bh, start + GROUP)))
        busiest_first = -tile[slots] if heavy_last else tile[slots]
        assert np.all(np.diff(busiest_first) >= 0)


def test_even_order_is_head_major(probe):
    tile, bh = probe(5, 7, False, False)
    assert tile.tolist() == list(range(5)) * 7
    assert bh.tolist() == [b for b in range(7) for _ in range(5)]
