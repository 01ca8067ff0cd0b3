"""Run configurations (in worker processes), collect failures and a summary.

Every configuration is (seed, index): `run_one(seed, index, device)` redraws and reruns it anywhere,
which is what `--replay SEED:INDEX` does.
"""
from __future__ import annotations

import collections
import concurrent.futures
import datetime
import functools
import hashlib
import multiprocessing
import os
import platform
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional

from .draw import INVALID_FRACTION, draw_config, rng_for


# CUDA errors that leave the process's context unusable: every later launch in this worker fails
# with the same error, whatever its configuration.
STICKY_CUDA_ERRORS = ("illegal memory access", "misaligned address", "ILLEGAL_ADDRESS", "MISALIGNED_ADDRESS",
                      "illegal instruction", "unspecified launch failure", "device-side assert")
CHECKPOINT_SECONDS = 30
# Set in a worker process once a configuration hit one of them: the configuration's replay.
_context_lost_at: Optional[str] = None


def run_config(c: dict, seed: int, index: int, device: str) -> dict:
    """Run one drawn configuration: {"ok", "errors" | "error", "traceback"}; never raises.  After a
    configuration left this process's CUDA context unusable, later ones are not run: their record
    says so (`unchecked`), so that one crash is one failure, not a failure of every later
    configuration the worker takes."""
    global _context_lost_at
    start = time.perf_counter()
    record = {"index": index, "replay": f"{seed}:{index}"}
    if _context_lost_at is not None:
        record.update(ok=True, unchecked=f"not run: the worker's CUDA context was lost at {_context_lost_at}",
                      seconds=0.0)
        return record
    try:
        if c["kind"] == "invalid":
            from .invalid import run_invalid
            record["result"] = run_invalid(c, device)
        else:
            from .check import check_valid
            from .inputs import make_inputs
            record["stage_seconds"] = {}
            record["errors"] = check_valid(c, make_inputs(rng_for(seed, index, 1), c), device, record["stage_seconds"])
        record["ok"] = True
    except Exception as e:   # every exception is a finding: reported with the configuration that made it
        record.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-6000:],
                      config=c)
        if device == "cuda" and any(text in str(e) for text in STICKY_CUDA_ERRORS):
            _context_lost_at = record["replay"]
            record["context_lost"] = True
    record["seconds"] = time.perf_counter() - start
    return record


def run_one(seed: int, index: int, device: str, invalid_fraction: float = INVALID_FRACTION) -> dict:
    c = draw_config(seed, index, device, invalid_fraction)
    record = run_config(c, seed, index, device)
    record["config"] = c
    return record


def _worker_init():
    import torch
    torch.set_num_threads(1)   # one core per worker process


def _worker(args):
    return run_one(*args)


def features(c: dict) -> list:
    """The options a configuration exercises, for the per-option counts of the summary."""
    if c["kind"] == "invalid":
        return [f"invalid:{c['mutation']}", f"invalid-{c['framework']}"]
    f = [c["kind"], c["dtype"]] + [f"jax-{b}" for b in c["jax"]]
    f += [n for n in ("causal", "return_lse", "lse_cotangent") if c[n]]
    f += [n for n in ("sliding_window", "logits_soft_cap", "softmax_scale", "softmax_aux", "segments",
                      "attention_mask", "bias", "dropout_prob") if c.get(n) is not None]
    sinks = c.get("softmax_aux")
    if sinks and any(v in ("inf", "-inf") for v in sinks["values"]):
        f += [f"sinks{v}" for v in sorted({v for v in sinks["values"] if v in ("inf", "-inf")})]
    if c["Hq"] != c["Hkv"]:
        f.append("gqa")
    if c["Sq"] != c["Sk"]:
        f.append("sq!=sk")
    if c["D"] != c["Dv"]:
        f.append("dv!=d")
    if 0 in (c["B"], c["Sq"], c["Sk"]):
        f.append("empty-dim")
    if c["kind"] == "varlen":
        if 0 in c["lengths_q"] + c["lengths_k"]:
            f.append("varlen-zero-length")
        if c["tail_q"] or c["tail_k"]:
            f.append("varlen-tail")
    if c.get("attention_mask"):
        f.append(f"mask-{c['attention_mask']['dtype']}")
    if c.get("segments"):
        f.append(f"segments-{c['segments']['dtype']}")
    if c["kind"] == "blocksparse":
        f.append(f"layout-{c['layout']['builder']}")
    f.append(f"head_dim-{'small' if c['D'] <= 64 else 'large'}")
    return f


def versions() -> dict:
    """Package versions, the dualattn commit and the id of the package's files: read once per process
    (every checkpoint's summary carries them, and both read the working tree)."""
    return dict(_versions())


def source_tree_id(root: str) -> str:
    """The git tree id of the directory `root` as it is on disk (bytecode caches left out, as
    .gitignore leaves them): `git rev-parse <commit>:dualattn` names the commit whose package it is.
    A copied checkout whose .git is stale still records the code that ran (its `git describe` names
    the stale HEAD)."""
    entries = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name == "__pycache__" or name.endswith(".pyc"):
            continue
        if os.path.isdir(path):
            if not os.listdir(path):
                continue   # git keeps no empty directories
            mode, sha = b"40000", bytes.fromhex(source_tree_id(path))
        else:
            with open(path, "rb") as f:
                data = f.read()
            mode = b"100755" if os.access(path, os.X_OK) else b"100644"
            sha = hashlib.sha1(b"blob %d\0" % len(data) + data).digest()
        # git orders a tree's entries by name, a directory's as if it ended in "/"
        entries.append((name.encode() + (b"/" if mode == b"40000" else b""), mode, name.encode(), sha))
    body = b"".join(mode + b" " + name + b"\0" + sha for _, mode, name, sha in sorted(entries))
    return hashlib.sha1(b"tree %d\0" % len(body) + body).hexdigest()


@functools.lru_cache(maxsize=1)
def _versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "jax", "jaxlib", "triton", "numpy"):
        try:
            out[name] = __import__(name).__version__
        except Exception:   # not installed: recorded as absent
            out[name] = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        # "-dirty" when the files differ from the commit (a copied working tree, local edits)
        out["dualattn_commit"] = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=40"],
                                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:   # not a git checkout
        out["dualattn_commit"] = None
    out["dualattn_tree"] = source_tree_id(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return out


def device_name(device: str) -> str:
    if device == "cuda":
        import torch
        return torch.cuda.get_device_name(0)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def fuzz(count: int, *, seed: int, device: str, workers: int = 1, start: int = 0,
         invalid_fraction: float = INVALID_FRACTION, log: Optional[Callable[[str], None]] = print,
         checkpoint: Optional[Callable[[dict], None]] = None) -> dict:
    """Run configurations start .. start+count-1 of `seed`; returns the summary (JSON-able).
    Workers report configurations as they finish (one slow compile does not hold back the others'
    results).  `checkpoint` receives the summary so far every 50 configurations and every
    CHECKPOINT_SECONDS, so a run stopped early keeps what it finished; the summary's `indices` name
    exactly which configurations those are."""
    log = log or (lambda _: None)
    t0 = last_checkpoint = time.time()
    jobs = [(seed, i, device, invalid_fraction) for i in range(start, start + count)]
    records = []

    def note(r):
        nonlocal last_checkpoint
        records.append(r)
        if r.get("unchecked"):
            log(f"UNCHECKED {r['replay']}: {r['unchecked']}")
        elif not r["ok"]:
            log(f"FAIL {r['replay']} ({r['config']['kind']}): {r['error']}\n  config: {r['config']}\n"
                f"  replay: python -m dualattn.fuzz --replay {r['replay']} --device {device}")
        every_50 = len(records) % 50 == 0 or len(records) == count
        if every_50:
            rate = len(records) / (time.time() - t0)
            log(f"{len(records)}/{count} configurations, {sum(not x['ok'] for x in records)} failures, "
                f"{rate:.2f} configs/s")
        due = every_50 or time.time() - last_checkpoint >= CHECKPOINT_SECONDS
        if checkpoint is not None and due and len(records) < count:
            last_checkpoint = time.time()
            try:
                checkpoint(dict(summary(records, seed=seed, device=device, start=start, wall=time.time() - t0,
                                        workers=workers, invalid_fraction=invalid_fraction), partial=True))
            except OSError as e:   # a full disk costs the checkpoint, not the run
                log(f"checkpoint not written: {e}")

    if workers <= 1:
        for job in jobs:
            note(run_one(*job))
    else:
        ctx = multiprocessing.get_context("spawn")   # no framework state forked into the workers
        with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init) as pool:
            for done in concurrent.futures.as_completed([pool.submit(_worker, job) for job in jobs]):
                note(done.result())
    wall = time.time() - t0
    return summary(records, seed=seed, device=device, start=start, wall=wall, workers=workers,
                   invalid_fraction=invalid_fraction)


def _mean_stages(records: list) -> dict:
    """Mean seconds per stage (reference, torch, jax-<backend>) over the valid configurations running it."""
    totals, counts = collections.Counter(), collections.Counter()
    for r in records:
        for stage, t in (r.get("stage_seconds") or {}).items():
            totals[stage] += t
            counts[stage] += 1
    return {stage: round(totals[stage] / counts[stage], 3) for stage in sorted(totals)}


def index_ranges(indices) -> list:
    """[[first, last], ...]: the sorted indices as inclusive runs (a partial run's exact coverage)."""
    runs = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def summary(records: list, *, seed: int, device: str, start: int, wall: float, workers: int,
            invalid_fraction: float) -> dict:
    unchecked = [r for r in records if r.get("unchecked")]
    records = [r for r in records if not r.get("unchecked")]
    counts = collections.Counter()
    worst = collections.defaultdict(float)   # the largest relative error seen, by front end / quantity / dtype
    for r in records:
        counts.update(features(r["config"]))
        for front, errs in (r.get("errors") or {}).items():
            if isinstance(errs, str):   # a jax backend this machine lacks
                counts[f"{front} {errs}"] += 1
            elif isinstance(errs, dict):
                for q, e in errs.items():
                    key = f"{front}/{q}/{r['config']['dtype']}"
                    worst[key] = max(worst[key], e)
            else:
                key = f"{front}/{r['config']['dtype']}"
                worst[key] = max(worst[key], errs)
    failures = [{k: r[k] for k in ("replay", "error", "traceback", "config")} for r in records if not r["ok"]]
    valid = sum(r["config"]["kind"] != "invalid" for r in records)
    return {
        "command": "python -m dualattn.fuzz " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "device_name": device_name(device), "versions": versions(),
        "seed": seed, "start": start, "configurations": len(records), "valid": valid,
        "indices": index_ranges(r["index"] for r in records),
        # configurations a worker did not run after a crash lost its CUDA context (failures name the crash)
        "unchecked_count": len(unchecked), "unchecked": [r["replay"] for r in unchecked],
        "invalid": len(records) - valid, "invalid_fraction": invalid_fraction,
        "failures_count": len(failures), "workers": workers, "wall_seconds": round(wall, 1),
        "configs_per_second": round(len(records) / wall, 3) if wall else None,
        "mean_config_seconds": round(sum(r["seconds"] for r in records) / max(1, len(records)), 3),
        "mean_stage_seconds": _mean_stages(records),
        "counts": dict(sorted(counts.items())),
        "max_relative_error": {k: float(f"{v:.3e}") for k, v in sorted(worst.items())},
        "slowest": [{"replay": r["replay"], "seconds": round(r["seconds"], 2), "kind": r["config"]["kind"]}
                    for r in sorted(records, key=lambda r: -r["seconds"])[:10]],
        "failures": failures,
    }
