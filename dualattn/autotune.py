"""Autotuning shared by the torch and JAX front ends: how candidates are timed and the best picked.

Framework-free.  The front ends supply the measurements (`torch_api/_autotune.py`,
`jax_api/_autotune.py`); the executor (`dualattn.executor`) decides when to tune and stores the
result in the one cache file both frameworks read, so a config tuned from torch serves jax.

Timing rules, so that a result can be trusted:
  * the first call (compilation, allocation) is never timed;
  * warm-up by time (`warmup_ms`), then `rounds` rounds of back-to-back calls followed by one
    synchronisation (`sync`), sized so that all rounds together take about `rep_ms`;
  * the median over rounds is reported (robust to a stray slow round); a candidate that raises
    (a tile that does not fit the device) is out (+inf).
On CUDA the torch side uses triton.testing.do_bench (CUDA events, L2 flush) with the same
warm-up and repeat times; JAX has no events, so `median_ms` times back-to-back calls + one
`block_until_ready`, which hides the host's dispatch gaps behind the device's queue.
"""
from __future__ import annotations

import math
import statistics
import sys
import threading
import time
from typing import Callable, Dict, Iterable, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")

WARMUP_MS = 25.0
REP_MS = 100.0
ROUNDS = 10


def progress(items: Iterable[T], *, desc: str, total: Optional[int] = None, enabled: bool = True) -> Iterable[T]:
    """`items` with a progress bar on stderr: tqdm when it is installed, else one line per item
    when stderr is a terminal; nothing when `enabled` is False."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _plain_progress(items, desc=desc, total=total)
    return tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr)


def _plain_progress(items, *, desc, total):
    items = list(items)
    total = len(items) if total is None else total
    show = sys.stderr.isatty()
    for i, item in enumerate(items):
        if show:
            print(f"\r{desc}: {i + 1}/{total}", end="", file=sys.stderr, flush=True)
        yield item
    if show:
        print(file=sys.stderr)


def median_ms(run: Callable[[], object], sync: Callable[[object], object], *, warmup_ms: float = WARMUP_MS,
              rep_ms: float = REP_MS, rounds: int = ROUNDS, clock: Callable[[], float] = time.perf_counter) -> float:
    """Milliseconds per call of `run`: the median over `rounds` rounds of back-to-back calls, each
    round closed by one `sync(last result)` (jax: block_until_ready; torch: cuda.synchronize).

    The first call is not timed (compilation); one timed call sizes the warm-up and the rounds.
    """
    sync(run())
    start = clock()
    sync(run())
    estimate = max(clock() - start, 1e-7) * 1e3
    for _ in range(max(1, int(warmup_ms / estimate))):
        result = run()
    sync(result)
    per_round = max(1, int(rep_ms / (estimate * rounds)))
    times = []
    for _ in range(rounds):
        start = clock()
        for _ in range(per_round):
            result = run()
        sync(result)
        times.append((clock() - start) * 1e3 / per_round)
    return statistics.median(times)


def _timed(measure: Callable[[T], float], candidate: T) -> float:
    try:
        ms = float(measure(candidate))
    except Exception:  # a tile that does not fit (shared memory, registers) is out
        return math.inf
    return ms if ms == ms else math.inf   # NaN counts as not run


def best_of(candidates: Sequence[T], measure: Callable[[T], float], *, desc: str = "dualattn autotune",
            show_progress: bool = True) -> Tuple[Optional[T], Dict[int, float]]:
    """(the candidate with the smallest measure(candidate) in ms, {index: ms}); None when every
    candidate raised.  Ties go to the earlier candidate (the heuristic default comes first)."""
    times = {i: _timed(measure, c) for i, c in progress(list(enumerate(candidates)), desc=desc,
                                                        total=len(candidates), enabled=show_progress)}
    best = min(times, key=lambda i: (times[i], i)) if times else None
    if best is None or times[best] == math.inf:
        return None, times
    return candidates[best], times


def tune_flash(candidates: Sequence, measure_forward: Callable, measure_backward: Callable, *,
               plans: Optional[Callable[[object, str], object]] = None, desc: str = "dualattn autotune",
               show_progress: bool = True):
    """The best flash config among `candidates` (FlashConfigs; the first is the heuristic default).

    Forward tiles are timed on the forward (`measure_forward(config)` with the candidate's forward
    tile and the default's backward tiles), (dK/dV, dQ) pairs on the backward
    (`measure_backward(config)`); the best of each is combined.  None when no forward or no
    backward candidate ran.  plans(config, "forward" | "backward"): what the call plans with that
    config (the front ends record it: kernels/flash/plan.recording); a candidate that plans what an
    earlier one did is not timed, as the Gluon and warp-specialised kernels run their own tiles.
    """
    from .kernels.flash.plan import FlashConfig
    base = candidates[0]
    fwd_tiles = list(dict.fromkeys(c.fwd for c in candidates))
    bwd_pairs = list(dict.fromkeys((c.bwd_dkdv, c.bwd_dq) for c in candidates))
    fwd_configs = [FlashConfig(t, base.bwd_dkdv, base.bwd_dq) for t in fwd_tiles]
    bwd_configs = [FlashConfig(base.fwd, dkdv, dq) for dkdv, dq in bwd_pairs]
    if plans is not None:
        fwd_configs = distinct_plans(fwd_configs, lambda c: plans(c, "forward"))
        bwd_configs = distinct_plans(bwd_configs, lambda c: plans(c, "backward"))
    fwd, _ = best_of(fwd_configs, measure_forward, desc=f"{desc} (forward)", show_progress=show_progress)
    bwd, _ = best_of(bwd_configs, measure_backward, desc=f"{desc} (backward)", show_progress=show_progress)
    if fwd is None or bwd is None:
        return None
    return FlashConfig(fwd.fwd, bwd.bwd_dkdv, bwd.bwd_dq)


def distinct_plans(configs: Sequence[T], plan_of: Callable[[T], object]) -> list:
    """`configs` less those whose plan_of(config) an earlier one has (compared with ==); a config whose
    plan_of raises is kept, for the timing to rule it out."""
    seen, kept = [], []
    for config in configs:
        try:
            planned = plan_of(config)
        except Exception:
            kept.append(config)
            continue
        if planned not in seen:
            seen.append(planned)
            kept.append(config)
    return kept


def in_own_thread(fn: Callable[[], T]) -> T:
    """fn() run in a fresh thread and waited for; its exception re-raised here.  The front ends tune
    there: torch calls the tuner from inside its forward op, where autograd is off for the calling
    thread, and JAX may call it while the caller is being traced."""
    result = {}

    def work():
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    thread = threading.Thread(target=work, name="dualattn-autotune")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
