"""Ring attention, framework-free: layouts, the per-step schedule, the log-sum-exp merge.

The sequence is sharded over W ranks; rank r keeps its query shard and sees every key/value shard
once as they travel around the ring (step t: the shard of rank (r - t) mod W).  Each shard is a few
contiguous runs of global positions (`shard_runs`), so every (query run, key run) pair is plain
attention with a constant position offset, which the flash kernels take as `diag_shift`: no position
arrays, and the kernels keep their band skipping and unmasked fast paths.  A step becomes a few
`RingBlock`s (`ring_schedule`): pairs fully masked for the options (causal, window) are not launched
at all, pairs fully visible run without masks, and runs whose masks coincide share one launch.

Layouts (`ring_permutation`), W = 2 ranks, S = 8:

    contiguous   rank 0: 0 1 2 3    rank 1: 4 5 6 7
    zigzag       rank 0: 0 1 6 7    rank 1: 2 3 4 5      (chunks r and 2W-1-r: equal causal work)

Merge rule (fp32, never rounded between steps): partial results (o_a, lse_a), (o_b, lse_b) over
disjoint key sets combine as

    lse = logaddexp(lse_a, lse_b),   o = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

(-inf rows stay 0 and -inf).  Sinks join once, after the last step: lse_final = logaddexp(lse,
logsumexp(sinks)), o_final = o * exp(lse - lse_final).  Their gradient is computed once from the
merged rows, d sink_n = sum over rows of exp(sink_n - lse_final) * (dlse - rowsum(dout * out)),
while each step's backward launch takes the merged lse (which includes the sinks) and no sinks.

The array helpers take the array namespace `xp` (torch or jax.numpy), so both front ends run the
very same arithmetic.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import numpy as np

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str, seq_len: int, world_size: int) -> None:
    """ValueError unless `layout` is known and seq_len splits evenly for it over world_size ranks."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not isinstance(world_size, (int, np.integer)) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    parts = 2 * world_size if layout == "zigzag" else world_size
    if seq_len < 0 or seq_len % parts:
        raise ValueError(f"layout={layout!r}: the sequence length {seq_len} must be a multiple of "
                         f"{'2 * world_size' if layout == 'zigzag' else 'world_size'} = {parts}")


def ring_permutation(seq_len: int, world_size: int, layout: str = "zigzag") -> np.ndarray:
    """Global positions in rank-major order: rank r holds perm[r*L:(r+1)*L], L = seq_len / world_size.

    "contiguous": arange(seq_len).  "zigzag": the sequence cut into 2W equal chunks, rank r holds
    chunks r and 2W-1-r, in that order, so every rank does the same causal work.  Shard a global
    array with x[:, perm] (then split the sequence dim into W equal parts); gather back with
    out_global[:, perm] = out_sharded.
    """
    check_layout(layout, seq_len, world_size)
    if layout == "contiguous":
        return np.arange(seq_len, dtype=np.int64)
    chunk = seq_len // (2 * world_size)
    order = [c for r in range(world_size) for c in (r, 2 * world_size - 1 - r)]
    return np.concatenate([np.arange(c * chunk, (c + 1) * chunk, dtype=np.int64) for c in order])


@dataclasses.dataclass(frozen=True)
class Run:
    """A contiguous piece of a shard: local rows [local, local + length) hold global positions
    [position, position + length)."""

    local: int
    position: int
    length: int


def shard_runs(seq_len: int, world_size: int, layout: str, rank: int) -> Tuple[Run, ...]:
    """The contiguous runs of rank's shard, in local order."""
    check_layout(layout, seq_len, world_size)
    shard = seq_len // world_size
    if layout == "contiguous":
        return (Run(0, rank * shard, shard),)
    chunk = shard // 2
    return (Run(0, rank * chunk, chunk), Run(chunk, (2 * world_size - 1 - rank) * chunk, chunk))


SKIP, FULL, PARTIAL = "skip", "full", "partial"


def _diagonals(offset: int, len_q: int, len_k: int, left: Optional[int],
               right: Optional[int]) -> Optional[Tuple[int, int]]:
    """The diagonals d = b - a (inclusive range) of a query run (rows a) and key run (columns b) with
    kpos - qpos = offset + b - a that the window -left <= kpos - qpos <= right lets attend, or None.

    Every diagonal of the rectangle, -(len_q - 1) .. len_k - 1, holds at least one pair, so this range
    is the pair's whole mask: two views of a pair attend the same tokens exactly when it is equal."""
    lo, hi = -(len_q - 1), len_k - 1
    if left is not None:
        lo = max(lo, -left - offset)
    if right is not None:
        hi = min(hi, right - offset)
    return (lo, hi) if len_q and len_k and lo <= hi else None


def _kind(seen: Optional[Tuple[int, int]], len_q: int, len_k: int) -> str:
    """SKIP, FULL or PARTIAL for a run pair's attended diagonals `seen` (from `_diagonals`)."""
    if seen is None:
        return SKIP
    return FULL if seen == (-(len_q - 1), len_k - 1) else PARTIAL


def _visibility(offset: int, len_q: int, len_k: int, left: Optional[int], right: Optional[int]) -> str:
    """Whether the window lets a run pair (as in `_diagonals`) attend none (SKIP), all (FULL) or some
    (PARTIAL) of its pairs."""
    return _kind(_diagonals(offset, len_q, len_k, left, right), len_q, len_k)


@dataclasses.dataclass(frozen=True)
class RingBlock:
    """One flash launch of a step: local query rows [q_start, q_stop) against local rows
    [kv_start, kv_stop) of the visiting key/value shard.

    masked=False: every pair attends (launched with no window and no causal mask).  masked=True:
    launched with the call's window and `diag_shift`, under which the kernel's positions
    (row i at i + diag, column j at j, diag = Sk - Sq + diag_shift) give exactly the global mask.
    """

    q_start: int
    q_stop: int
    kv_start: int
    kv_stop: int
    masked: bool
    diag_shift: int = 0

    @property
    def diag(self) -> int:
        """Row i's kernel position offset: i + diag is compared with column j."""
        return (self.kv_stop - self.kv_start) - (self.q_stop - self.q_start) + self.diag_shift


def _block(q_runs, kv_runs, left, right) -> Optional[RingBlock]:
    """One launch covering the given adjacent runs, or None if no single launch computes exactly
    their attention (it would attend a pair the global mask forbids, or miss one)."""
    q_start, q_stop = q_runs[0].local, q_runs[-1].local + q_runs[-1].length
    kv_start, kv_stop = kv_runs[0].local, kv_runs[-1].local + kv_runs[-1].length
    pairs = [(qr, kr, _diagonals(kr.position - qr.position, qr.length, kr.length, left, right))
             for qr in q_runs for kr in kv_runs]
    kinds = [_kind(seen, qr.length, kr.length) for qr, kr, seen in pairs]
    if all(k == SKIP for k in kinds):
        return None
    if all(k == FULL for k in kinds):
        return RingBlock(q_start, q_stop, kv_start, kv_stop, False)

    # The kernel sees kpos - qpos = (kv local - kv_start) - (q local - q_start) - diag.  A diag is exact
    # when every pair attends under it the diagonals it attends globally.  Equal visibility classes are
    # not enough: two PARTIAL pairs cut by different window edges (the left bound, the causal one) have
    # different masks.  A PARTIAL pair's window edge moves with diag, so only its own diag is exact and
    # the first partial pair's is the one candidate; without one (FULL and SKIP pairs together) every
    # pair's own diag is tried.
    def own_diag(qr, kr):
        return (kr.local - kv_start) - (qr.local - q_start) - (kr.position - qr.position)

    partial = [(qr, kr) for (qr, kr, _), k in zip(pairs, kinds) if k == PARTIAL]
    candidates = [own_diag(*partial[0])] if partial else dict.fromkeys(own_diag(qr, kr) for qr, kr, _ in pairs)
    for diag in candidates:
        if all(_diagonals((kr.local - kv_start) - (qr.local - q_start) - diag, qr.length, kr.length, left, right)
               == seen for qr, kr, seen in pairs):
            shift = diag - ((kv_stop - kv_start) - (q_stop - q_start))
            return RingBlock(q_start, q_stop, kv_start, kv_stop, True, shift)
    return None


def step_blocks(q_runs: Tuple[Run, ...], kv_runs: Tuple[Run, ...], window_left: Optional[int],
                window_right: Optional[int]) -> Tuple[RingBlock, ...]:
    """The fewest launches that compute one (query shard, key shard) step exactly: the whole pair in
    one launch if its mask allows, else one per key run or per query run, else one per run pair.
    Fully masked pairs are left out (an empty tuple: the step is skipped)."""
    left, right = window_left, window_right
    whole = _block(q_runs, kv_runs, left, right)
    if whole is not None:
        return (whole,)
    single = {(i, j): _block((q,), (k,), left, right) for i, q in enumerate(q_runs) for j, k in enumerate(kv_runs)}
    if all(b is None for b in single.values()):
        return ()

    def launches(qs, ks):   # runs qs x ks in one launch, else one per run pair
        b = _block(tuple(q_runs[i] for i in qs), tuple(kv_runs[j] for j in ks), left, right)
        return (b,) if b is not None else tuple(single[i, j] for i in qs for j in ks if single[i, j] is not None)

    every_q, every_k = range(len(q_runs)), range(len(kv_runs))
    candidates = [sum((launches(every_q, (j,)) for j in every_k), ()),
                  sum((launches((i,), every_k) for i in every_q), ()),
                  tuple(b for b in single.values() if b is not None)]
    return min(candidates, key=len)


def ring_schedule(seq_len: int, world_size: int, layout: str, rank: int, window_left: Optional[int] = None,
                  window_right: Optional[int] = None) -> Tuple[Tuple[RingBlock, ...], ...]:
    """Per step t (the key/value shard of rank (rank - t) mod W visiting), the blocks to launch.
    window_left / window_right as FlashOptions (causal: right = 0)."""
    q_runs = shard_runs(seq_len, world_size, layout, rank)
    return tuple(step_blocks(q_runs, shard_runs(seq_len, world_size, layout, (rank - t) % world_size),
                             window_left, window_right) for t in range(world_size))


def active_steps(schedules) -> int:
    """How many ring steps any rank computes: steps past the last one with work on some rank are
    never run (a narrow window), and their key/value shards never travel."""
    last = 0
    for schedule in schedules:
        for t, blocks in enumerate(schedule):
            if blocks:
                last = max(last, t + 1)
    return max(last, 1)


def single_launch(schedules, shard_len: int) -> bool:
    """Whether every rank's whole share is one launch over all its query rows in the first step (world
    size 1, or a window that never leaves the rank's own shard).  The ring is then that flash launch
    itself: its output, lse and gradients are the kernel's, with no merge and no fp32 round trip."""
    if active_steps(schedules) != 1:
        return False
    return all(len(s[0]) == 1 and (s[0][0].q_start, s[0][0].q_stop) == (0, shard_len) for s in schedules)


# ----------------------------------------------------------------------------- the merge, on arrays


def _safe(xp, lse):
    """lse with -inf replaced by 0, so that exp(x - lse) of -inf rows is 0, never NaN."""
    return xp.where(lse == -float("inf"), xp.zeros_like(lse), lse)


def _row_weights(xp, w):
    """(B, H, S) -> (B, S, H, 1), to scale outputs laid out BSHD."""
    return xp.swapaxes(w, 1, 2)[..., None]


def merge_partial(xp, out, lse, out_part, lse_part):
    """Merge a partial (out_part, lse_part) into the running (out, lse), all fp32: out (B, S, H, Dv),
    lse (B, H, S).  Rows where both are empty (-inf) stay 0 / -inf."""
    new = xp.logaddexp(lse, lse_part)
    ref = _safe(xp, new)
    out = out * _row_weights(xp, xp.exp(lse - ref)) + out_part * _row_weights(xp, xp.exp(lse_part - ref))
    return out, new


def sinks_lse(xp, softmax_aux, heads_q: int):
    """logsumexp of the sinks each query head sees, (Hq,): softmax_aux fp32 (Hq, n), (Hq,) or shared (n,)."""
    s = softmax_aux
    if len(s.shape) == 1:
        s = s[:, None] if s.shape[0] == heads_q else s[None, :]
    m = getattr(s, "amax", s.max)(-1)   # torch's max(dim) is a (values, indices) pair
    ref = xp.where((m == float("inf")) | (m == -float("inf")), xp.zeros_like(m), m)
    lse = xp.log(xp.exp(s - ref[:, None]).sum(-1)) + ref
    lse = xp.where(m == float("inf"), m, lse)   # a +inf sink takes the whole softmax
    return xp.broadcast_to(lse, (heads_q,))   # shared sinks: the same for every head (on lse's device)


def add_sinks(xp, out, lse, sink_lse):
    """The sinks joined once into the merged (out, lse): sink_lse (Hq,) from sinks_lse."""
    final = xp.logaddexp(lse, sink_lse[None, :, None])
    ref = _safe(xp, final)
    w = xp.where(final == float("inf"), xp.zeros_like(final), xp.exp(lse - ref))
    return out * _row_weights(xp, w), final


def sinks_grad(xp, softmax_aux, heads_q: int, lse, delta):
    """d softmax_aux from the merged rows: lse (B, Hq, S) with the sinks, delta = rowsum(dout * out) - dlse
    (B, Hq, S), both fp32.  Returns fp32 in softmax_aux's shape."""
    s = softmax_aux
    per_head = len(s.shape) == 2 or s.shape[0] == heads_q
    s2 = s if len(s.shape) == 2 else (s[:, None] if per_head else s[None, :])
    sink = s2[None, :, None, :]                      # (1, Hq|1, 1, n)
    row = lse[..., None]                             # (B, Hq, S, 1)
    diff = xp.where(sink == -float("inf"), xp.full_like(sink - row, -float("inf")),
                    xp.where(sink == row, xp.zeros_like(sink - row), sink - row))
    grad = -(xp.exp(diff) * delta[..., None])        # (B, Hq, S, n)
    grad = grad.sum(0).sum(1)                        # (Hq, n)
    if not per_head:
        grad = grad.sum(0)
    return grad.reshape(s.shape)
