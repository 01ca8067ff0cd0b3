"""Pre-tune flash launch configs for a list of shapes, or print the config cache.

    python -m dualattn.tune shapes.json                  # tune each shape (torch, cuda:0), store in the cache
    python -m dualattn.tune shapes.json --framework jax  # the same through the JAX front end
    python -m dualattn.tune shapes.json --force          # tune again even where the cache has an entry
    python -m dualattn.tune --show                       # print the cache (key, config, source, date)

shapes.json holds a JSON list of problems, one object each; only the first five keys are required:

    [{"batch": 4, "seqlen_q": 4096, "heads_q": 16, "head_dim": 128, "dtype": "bfloat16",
      "seqlen_k": 4096, "heads_kv": 16, "head_dim_v": 128, "causal": true, "sliding_window": null,
      "logits_soft_cap": null, "num_sinks": 0, "segments": false, "dropout_prob": 0.0}]

The results go to the one cache file both frameworks read (dualattn.executor.cache_path(), or
--cache-dir): a shape tuned from torch is used by jax and the other way round.  Configs are keyed by a
shape bucket (lengths and batch*heads rounded up to powers of two), so one entry serves nearby sizes.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

from . import executor
from .options import FlashOptions
from .validation import FlashShapes

_REQUIRED = ("batch", "seqlen_q", "heads_q", "head_dim", "dtype")
_KNOWN = _REQUIRED + ("seqlen_k", "heads_kv", "head_dim_v", "causal", "sliding_window", "logits_soft_cap",
                      "num_sinks", "sinks_per_head", "segments", "dropout_prob")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where configs are tuned: the executor's registry entry (platform, backend), the device's name
    and arch, and `autotune_fn(shapes, options) -> (candidates -> best config)` that times them."""

    platform: str
    backend: str
    device_name: str
    arch: int
    autotune_fn: Callable[[FlashShapes, FlashOptions], Callable[[Sequence[Any]], Any]]


def torch_target(device: str = "cuda") -> Target:
    import torch
    from .torch_api._autotune import flash_autotune_fn
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        raise SystemExit("dualattn.tune: tuning times kernels on a CUDA GPU; none is available to torch "
                         "(the CPU interpreter has one fixed config)")
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return Target("cuda", "triton", torch.cuda.get_device_name(index), major * 10 + minor,
                  lambda shapes, options: flash_autotune_fn(shapes, options, torch.device("cuda", index)))


def jax_target() -> Target:
    import jax
    from .jax_api import _launch
    from .jax_api._autotune import flash_autotune_fn
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        raise SystemExit("dualattn.tune: tuning times kernels on a CUDA GPU; jax sees none")
    return Target("cuda", "triton", gpus[0].device_kind, _launch.gpu_arch(), flash_autotune_fn)


def problem(spec: Dict[str, Any]):
    """(FlashShapes, FlashOptions) of one shapes.json entry; ValueError names a bad or missing key."""
    if not isinstance(spec, dict):
        raise ValueError(f"each shape must be a JSON object, got {spec!r}")
    missing = [k for k in _REQUIRED if k not in spec]
    unknown = sorted(set(spec) - set(_KNOWN))
    if missing or unknown:
        raise ValueError(f"shape {spec}: missing keys {missing}, unknown keys {unknown} (known: {list(_KNOWN)})")
    num_sinks = int(spec.get("num_sinks", 0))
    shapes = FlashShapes(batch=int(spec["batch"]), seqlen_q=int(spec["seqlen_q"]),
                         seqlen_k=int(spec.get("seqlen_k", spec["seqlen_q"])), heads_q=int(spec["heads_q"]),
                         heads_kv=int(spec.get("heads_kv", spec["heads_q"])), head_dim=int(spec["head_dim"]),
                         head_dim_v=int(spec.get("head_dim_v", spec["head_dim"])), dtype=str(spec["dtype"]),
                         num_sinks=num_sinks, sinks_per_head=bool(spec.get("sinks_per_head", num_sinks > 0)),
                         has_segments=bool(spec.get("segments", False)))
    window = spec.get("sliding_window")
    options = FlashOptions.build(head_dim=shapes.head_dim, causal=bool(spec.get("causal", False)),
                                 sliding_window=tuple(window) if isinstance(window, list) else window,
                                 logits_soft_cap=spec.get("logits_soft_cap"),
                                 dropout_prob=float(spec.get("dropout_prob", 0.0)))
    return shapes, options


def tune_shapes(specs: List[Dict[str, Any]], target: Target, *, force: bool = False,
                ex: Optional[executor.Executor] = None) -> List[Dict[str, Any]]:
    """Tune every spec (skipping those already cached unless `force`); one result row per spec."""
    ex = ex or executor.default_executor()
    rows = []
    for spec in specs:
        shapes, options = problem(spec)
        where = dict(platform=target.platform, backend=target.backend, device_name=target.device_name,
                     arch=target.arch, shapes=shapes, options=options,
                     autotune_fn=target.autotune_fn(shapes, options))
        if force:
            config, source = ex.tune("flash", **where)
        else:
            config, source = ex.select_with_source("flash", autotune=True, **where)
        key = executor.cache_key("flash", platform=target.platform, backend=target.backend,
                                 device_name=target.device_name, shapes=shapes, options=options)
        entry = executor.get_kernel("flash", target.platform, target.backend)
        rows.append({"key": key, "config": entry.encode(config), "source": source})
    return rows


def show(path: Optional[str] = None, *, as_json: bool = False, out=None) -> None:
    """Print the cache file's entries (key, config, source, created) to `out` (default stdout)."""
    out = out or sys.stdout
    path = path or executor.cache_path()
    entries = executor.cached_entries(path)
    if as_json:
        json.dump(entries, out, indent=1, sort_keys=True)
        print(file=out)
        return
    print(f"{path}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}", file=out)
    for key in sorted(entries):
        record = entries[key]
        print(f"{key}\n    {json.dumps(record['config'], sort_keys=True)}  source={record.get('source', '?')}  "
              f"created={record.get('created', '?')}", file=out)


def main(argv: Optional[Sequence[str]] = None, *, target: Optional[Target] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dualattn.tune", description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="?", help="JSON file with a list of shapes to tune")
    parser.add_argument("--framework", choices=("torch", "jax"), default="torch", help="front end that times")
    parser.add_argument("--device", default="cuda", help="torch device to tune on (default cuda)")
    parser.add_argument("--cache-dir", help=f"cache directory (default: ${executor.CACHE_DIR_ENV} or "
                                            "~/.cache/dualattn)")
    parser.add_argument("--force", action="store_true", help="tune again where the cache has an entry")
    parser.add_argument("--show", action="store_true", help="print the cache (after tuning, if shapes are given)")
    parser.add_argument("--json", action="store_true", help="with --show: print the cache as JSON")
    args = parser.parse_args(argv)
    if args.shapes is None and not args.show:
        parser.error("give a shapes JSON file to tune, or --show")
    ex = executor.Executor(os.path.join(args.cache_dir, executor.CACHE_FILE)) if args.cache_dir else None
    # Tuning exists to fill the cache: a path that cannot hold it is an error here, not the warning that
    # the library's calls give (they run without it).
    cache_dir = os.path.dirname(ex.disk().path if ex else executor.cache_path())
    if os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
        parser.error(f"the cache directory {cache_dir} (--cache-dir or ${executor.CACHE_DIR_ENV}) is not a directory")
    if args.shapes is not None:
        with open(args.shapes) as f:
            specs = json.load(f)
        if not isinstance(specs, list):
            parser.error(f"{args.shapes} must hold a JSON list of shapes")
        for spec in specs:   # every spec checked before any tuning starts
            problem(spec)
        if target is None:
            target = torch_target(args.device) if args.framework == "torch" else jax_target()
        for row in tune_shapes(specs, target, force=args.force, ex=ex):
            print(f"{row['source']:>10}  {json.dumps(row['config'], sort_keys=True)}  {row['key']}")
    if args.show:
        show(ex.disk().path if ex else None, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
