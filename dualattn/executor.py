"""Kernel registry and launch-config selection, shared by the torch and JAX front ends.

Framework-free (no torch/jax import; triton only to read its version).  Every launch asks

    select_config("flash", platform="cuda", backend="triton", device_name=..., arch=90,
                  shapes=shapes, options=options, autotune_fn=...)

and gets a config (for flash: `plan.FlashConfig`) from the first of

    1. override      the `override=` argument, then `with override(cfg):` of this thread
    2. memory        this process' cache (filled by 3 and 4)
    3. disk          one JSON file shared by torch and jax, by all processes of this user:
                     $DUALATTN_CACHE_DIR/configs.json, else ~/.cache/dualattn/configs.json
    4. autotune      opt-in (autotune=True or DUALATTN_AUTOTUNE=1) and only when the caller gives an
                     `autotune_fn(candidates) -> best` that times them; the result goes to 2 and 3
    5. heuristics    the registry entry's function (for flash: plan.default_config, looked up at
                     call time); never cached, so a changed tuned table takes effect at once

The cache key names the kernel (algorithm/platform/backend), the device name, the triton version,
a shape bucket (sequence lengths and batch*heads rounded up to powers of two, exact head dims),
the dtype and the static options that select a compiled variant (`flash_key_fields`).  A torch
launch and a jax launch of the same problem on the same GPU build the same key, so a config tuned
from torch is used by jax.

File format (version 1):

    {"format": "dualattn-configs", "version": 1,
     "entries": {"<key>": {"config": {"fwd": [128, 128, 8, 3], "bwd_dkdv": [...], "bwd_dq": [...]},
                           "source": "autotune", "created": "2026-11-23T10:00:00Z"}}}

Writes hold an advisory lock (POSIX), re-read the file, merge the new entry in and replace the file
atomically (temp file in the same directory, fsync, os.replace): concurrent writers keep each
other's entries and readers never see a partial file.  A corrupt file is ignored with a warning
and rebuilt by the next write.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import tempfile
import threading
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .kernels.flash import plan as _flash_plan
from .kernels.launch import next_pow2

FORMAT = "dualattn-configs"
FORMAT_VERSION = 1
CACHE_DIR_ENV = "DUALATTN_CACHE_DIR"
AUTOTUNE_ENV = "DUALATTN_AUTOTUNE"
CACHE_FILE = "configs.json"

KeyFields = Tuple[Tuple[str, object], ...]


# ----------------------------------------------------------------------------- registry

@dataclasses.dataclass(frozen=True)
class KernelEntry:
    """How to pick configs for one kernel family on one (platform, backend).

    heuristics(shapes, options, arch) -> config: the fallback (cheap, deterministic).
    key_fields(shapes, options) -> ((name, value), ...): the shape bucket and static options.
    encode(config) -> JSON-able nested lists/dicts; decode(data) -> config (raises on bad data).
    candidates(shapes, options, arch) -> configs to autotune over; None: never autotuned.
    """

    algorithm: str
    platform: str
    backend: str
    heuristics: Callable[[Any, Any, int], Any]
    key_fields: Callable[[Any, Any], KeyFields]
    encode: Callable[[Any], Any]
    decode: Callable[[Any], Any]
    candidates: Optional[Callable[[Any, Any, int], Sequence[Any]]] = None

    @property
    def name(self) -> Tuple[str, str, str]:
        return self.algorithm, self.platform, self.backend


_REGISTRY: Dict[Tuple[str, str, str], KernelEntry] = {}
_REGISTRY_LOCK = threading.Lock()


def register(entry: KernelEntry, *, replace: bool = False) -> KernelEntry:
    """Add a kernel entry; registering a taken (algorithm, platform, backend) needs replace=True."""
    with _REGISTRY_LOCK:
        if entry.name in _REGISTRY and not replace:
            raise ValueError(f"kernel {entry.name} is already registered (pass replace=True to swap it)")
        _REGISTRY[entry.name] = entry
    return entry


def get_kernel(algorithm: str, platform: str, backend: str) -> KernelEntry:
    try:
        return _REGISTRY[(algorithm, platform, backend)]
    except KeyError:
        known = ", ".join("/".join(k) for k in sorted(_REGISTRY))
        raise KeyError(f"no kernel registered for {algorithm}/{platform}/{backend}; registered: {known}") from None


def kernels() -> List[Tuple[str, str, str]]:
    """The registered (algorithm, platform, backend) names."""
    return sorted(_REGISTRY)


# ----------------------------------------------------------------------------- keys

@functools.lru_cache(maxsize=None)
def triton_version() -> str:
    try:
        import triton
        return str(triton.__version__)
    except Exception:  # no triton: the key still works, it just says so
        return "none"


def flash_key_fields(shapes, options) -> KeyFields:
    """Shape bucket and variant-selecting static options of one flash call (FlashShapes, FlashOptions).

    Sequence lengths (the max_seqlen bounds for varlen) and batch*query-heads are rounded up to the
    next power of two; head dims are exact (they are constexprs).  Window sizes only count by their
    presence, as in the kernels' HAS_LEFT / HAS_RIGHT specialisations.
    """
    return (
        ("dtype", shapes.dtype),
        ("seqlen_q", next_pow2(shapes.seqlen_q)),
        ("seqlen_k", next_pow2(shapes.seqlen_k)),
        ("batch_heads", next_pow2(shapes.batch * shapes.heads_q)),
        ("head_dim", shapes.head_dim),
        ("head_dim_v", shapes.head_dim_v),
        ("causal", options.causal),
        ("window_left", options.window_left is not None),
        ("window_right", options.window_right is not None),
        ("softcap", options.logits_soft_cap is not None),
        ("bias", shapes.has_bias),
        ("mask", shapes.has_mask),
        ("segments", shapes.has_segments),
        ("sinks", shapes.num_sinks),
        ("dropout", options.dropout_prob > 0.0),
        ("varlen", shapes.varlen),
    )


def _field(value) -> str:
    return str(int(value)) if isinstance(value, bool) else str(value)


@functools.lru_cache(maxsize=4096)
def _cache_key(entry: KernelEntry, device_name: str, triton: str, shapes, options) -> str:
    fields = entry.key_fields(shapes, options)
    return "|".join(("/".join(entry.name), f"device={device_name.strip()}", f"triton={triton}",
                     *(f"{k}={_field(v)}" for k, v in fields)))


def cache_key(algorithm: str, *, platform: str, backend: str, device_name: str, shapes, options) -> str:
    """The string under which a config is cached in memory and on disk.

    e.g. 'flash/cuda/triton|device=NVIDIA H100 80GB HBM3|triton=3.7.1|dtype=bfloat16|seqlen_q=8192|...'
    """
    return _cache_key(get_kernel(algorithm, platform, backend), device_name, triton_version(), shapes, options)


# ----------------------------------------------------------------------------- override

_local = threading.local()


@contextlib.contextmanager
def override(config, *, algorithm: Optional[str] = None):
    """Pin the config every select_config call of this thread returns (tests, benchmarks, tuning).

    algorithm: only pin that algorithm's selections (None: all).  Nests; the innermost wins.
    Under jax.jit the config is chosen when the function is traced, so pin it around the first call.
    """
    stack = _local.__dict__.setdefault("stack", [])
    stack.append((algorithm, config))
    try:
        yield config
    finally:
        stack.pop()


def current_override(algorithm: str):
    """The config pinned by `override` for `algorithm` in this thread, or None."""
    for alg, config in reversed(getattr(_local, "stack", ())):
        if alg is None or alg == algorithm:
            return config
    return None


# ----------------------------------------------------------------------------- disk cache

def cache_path() -> str:
    """$DUALATTN_CACHE_DIR/configs.json, else ~/.cache/dualattn/configs.json (the environment is
    read at each call; the path is built once per value: every launch asks, NOTES: "Fewer Python layers per
    call")."""
    return _cache_path(os.environ.get(CACHE_DIR_ENV), os.environ.get("HOME"))


@functools.lru_cache(maxsize=16)
def _cache_path(cache_dir: Optional[str], home: Optional[str]) -> str:
    root = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "dualattn")
    return os.path.join(root, CACHE_FILE)


def _parse(text: str) -> Dict[str, dict]:
    """The entries of a cache file; ValueError says why a file is not one."""
    doc = json.loads(text)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT!r} file")
    if doc.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {doc.get('version')!r}, expected {FORMAT_VERSION}")
    entries = doc.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(k, str) and isinstance(v, dict) and "config" in v
                                                for k, v in entries.items()):
        raise ValueError("'entries' must map key strings to {'config': ...} objects")
    return entries


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive advisory lock on path + '.lock' (POSIX; elsewhere atomic replace alone)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    with open(path + ".lock", "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _write_atomic(path: str, doc: dict) -> None:
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix=".configs.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class ConfigCache:
    """The on-disk cache file: raw (encoded) entries by key.

    Reads are memoised on the file's (mtime, size, inode), so a lookup that misses costs one stat;
    a corrupt file warns once per version of the file.  A path that cannot hold the file (its
    directory is a regular file, the file a directory, no permission) warns once and the cache runs
    empty: every call still runs, on configs from memory, autotuning or the heuristics.
    """

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._stamp = None
        self._entries: Dict[str, dict] = {}
        self._unusable = False

    def _cannot_use(self, error: OSError) -> None:
        if not self._unusable:
            self._unusable = True
            warnings.warn(f"dualattn: running without the config cache {self.path} ({error}); set "
                          f"{CACHE_DIR_ENV} to a directory to keep configs across processes", RuntimeWarning,
                          stacklevel=5)

    def stamp(self):
        """The file's (mtime, size, inode), None when missing or unusable: changes with every write."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        except OSError as e:   # NotADirectoryError, PermissionError, ...
            self._cannot_use(e)
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _read(self, *, warn: bool = True) -> Dict[str, dict]:
        """The file's entries ({} when missing, unusable or corrupt; corrupt warns)."""
        try:
            with open(self.path) as f:
                text = f.read()
        except FileNotFoundError:
            return {}
        except OSError as e:   # IsADirectoryError, PermissionError, ...
            self._cannot_use(e)
            return {}
        try:
            return _parse(text)
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            if warn:
                warnings.warn(f"dualattn: ignoring the config cache {self.path} ({e}); it is rebuilt on the "
                              "next write", RuntimeWarning, stacklevel=4)
            return {}

    def entries(self) -> Dict[str, dict]:
        """All entries on disk now (memoised while the file is unchanged)."""
        stamp = self.stamp()
        with self._lock:
            if stamp != self._stamp:
                self._entries = self._read() if stamp is not None else {}
                self._stamp = stamp
            return self._entries

    def lookup(self, key: str) -> Optional[dict]:
        return self.entries().get(key)

    def store(self, key: str, record: dict) -> None:
        """Merge one entry into the file: lock, re-read, replace atomically (nothing, after one warning,
        where the path cannot hold the file)."""
        try:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with self._lock, _locked(self.path):
                entries = dict(self._read(warn=False))  # corrupt: already warned on read, now rebuilt
                entries[key] = record
                _write_atomic(self.path, {"format": FORMAT, "version": FORMAT_VERSION, "entries": entries})
                self._stamp, self._entries = self.stamp(), entries
        except OSError as e:
            self._cannot_use(e)


# ----------------------------------------------------------------------------- executor

def _autotune_enabled(autotune: Optional[bool]) -> bool:
    if autotune is not None:
        return bool(autotune)
    scoped = getattr(_local, "autotune", ())
    if scoped:
        return scoped[-1]
    return os.environ.get(AUTOTUNE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def autotuning(enabled: bool = True):
    """Turn autotuning on (or off) for every select_config call of this thread that does not pass
    `autotune=` itself: what `dualattn.attention(..., autotune=True)` wraps its call in.  Nests; the
    innermost wins; it takes precedence over DUALATTN_AUTOTUNE."""
    stack = _local.__dict__.setdefault("autotune", [])
    stack.append(bool(enabled))
    try:
        yield
    finally:
        stack.pop()


class Executor:
    """Config selection with an in-memory cache in front of one on-disk cache.

    path: the cache file; None follows cache_path() (the environment) at every call.
    """

    def __init__(self, path: Optional[str] = None):
        self._path = path
        self._memory: Dict[str, Any] = {}
        self._files: Dict[str, ConfigCache] = {}
        self._lock = threading.Lock()
        self._bad_entries = set()
        self._generation = 0   # bumped by every change to _memory (state())

    def disk(self) -> ConfigCache:
        path = self._path or cache_path()
        with self._lock:
            cache = self._files.get(path)
            if cache is None:
                cache = self._files[path] = ConfigCache(path)
            return cache

    def clear_memory(self) -> None:
        with self._lock:
            self._memory.clear()
            self._generation += 1

    def _remember(self, key: str, config) -> None:
        with self._lock:
            self._memory[key] = config
            self._generation += 1

    def state(self, algorithm: str) -> tuple:
        """What `select` for `algorithm` depends on besides its arguments: a config pinned in this
        thread, this executor's memory (a counter of its changes), the cache file's version (mtime,
        size, inode; one stat) and whether autotuning is on.  Launchers that memoise selected
        configs per call signature key them on it, so any change selects again."""
        return current_override(algorithm), self._generation, self.disk().stamp(), _autotune_enabled(None)

    def _from_disk(self, entry: KernelEntry, key: str):
        disk = self.disk()
        record = disk.lookup(key)
        if record is None:
            return None
        try:
            return entry.decode(record["config"])
        except (TypeError, ValueError, KeyError) as e:
            if (disk.path, key) not in self._bad_entries:
                self._bad_entries.add((disk.path, key))
                warnings.warn(f"dualattn: ignoring the entry {key!r} of the config cache {disk.path} ({e})",
                              RuntimeWarning, stacklevel=4)
            return None

    def save(self, algorithm: str, *, platform: str, backend: str, device_name: str, shapes, options, config,
             source: str = "manual") -> str:
        """Cache `config` in memory and on disk under its key (returned)."""
        entry = get_kernel(algorithm, platform, backend)
        encoded = entry.encode(config)
        if entry.decode(encoded) != config:
            raise ValueError(f"{config!r} does not survive encoding as {encoded!r}")
        key = _cache_key(entry, device_name, triton_version(), shapes, options)
        self._remember(key, config)
        created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.disk().store(key, {"config": encoded, "source": source, "created": created})
        return key

    def select_with_source(self, algorithm: str, *, platform: str, backend: str, device_name: str, arch: int = 0,
                           shapes, options, autotune_fn: Optional[Callable[[Sequence[Any]], Any]] = None,
                           override=None, autotune: Optional[bool] = None,
                           heuristics: Optional[Callable[[Any, Any, int], Any]] = None) -> Tuple[Any, str]:
        """`select_config`, also saying where the config came from:
        'override' | 'memory' | 'disk' | 'autotune' | 'heuristics'."""
        entry = get_kernel(algorithm, platform, backend)
        if override is None:
            override = current_override(algorithm)
        if override is not None:
            return override, "override"
        key = _cache_key(entry, device_name, triton_version(), shapes, options)
        with self._lock:
            config = self._memory.get(key)
        if config is not None:
            return config, "memory"
        config = self._from_disk(entry, key)
        if config is not None:
            self._remember(key, config)
            return config, "disk"
        heuristics = heuristics or entry.heuristics
        if autotune_fn is not None and entry.candidates is not None and _autotune_enabled(autotune):
            config = self._autotune(entry, key, autotune_fn, heuristics, shapes, options, arch,
                                    dict(platform=platform, backend=backend, device_name=device_name))
            if config is not None:
                return config, "autotune"
        return heuristics(shapes, options, arch), "heuristics"

    def _autotune(self, entry, key, autotune_fn, heuristics, shapes, options, arch, where):
        # The heuristic config is always a candidate: tuning never picks worse than the default.
        candidates = [heuristics(shapes, options, arch)]
        for c in entry.candidates(shapes, options, arch):
            if c not in candidates:
                candidates.append(c)
        try:
            best = autotune_fn(candidates)
        except Exception as e:
            warnings.warn(f"dualattn: autotuning {key} failed ({e!r}); using the heuristic config",
                          RuntimeWarning, stacklevel=4)
            return None
        if best is None:
            return None
        try:
            valid = entry.decode(entry.encode(best)) == best
        except Exception:
            valid = False
        if not valid:
            warnings.warn(f"dualattn: autotune_fn returned {best!r}, not a {entry.algorithm} config; using the "
                          "heuristic config", RuntimeWarning, stacklevel=4)
            return None
        self._remember(key, best)
        try:
            self.save(entry.algorithm, shapes=shapes, options=options, config=best, source="autotune", **where)
        except Exception as e:  # persisting is best effort: the config still serves this process
            warnings.warn(f"dualattn: could not save the autotuned config to {self.disk().path} ({e!r})",
                          RuntimeWarning, stacklevel=4)
        return best

    def tune(self, algorithm: str, *, platform: str, backend: str, device_name: str, arch: int = 0, shapes, options,
             autotune_fn: Callable[[Sequence[Any]], Any],
             heuristics: Optional[Callable[[Any, Any, int], Any]] = None) -> Tuple[Any, str]:
        """Autotune now, whatever the caches hold, and store the result (memory and disk):
        (config, 'autotune'), or (the heuristic config, 'heuristics') when tuning failed or the
        entry has no candidates.  What `python -m dualattn.tune --force` runs."""
        entry = get_kernel(algorithm, platform, backend)
        heuristics = heuristics or entry.heuristics
        if entry.candidates is not None:
            key = _cache_key(entry, device_name, triton_version(), shapes, options)
            config = self._autotune(entry, key, autotune_fn, heuristics, shapes, options, arch,
                                    dict(platform=platform, backend=backend, device_name=device_name))
            if config is not None:
                return config, "autotune"
        return heuristics(shapes, options, arch), "heuristics"

    def select(self, algorithm: str, **kwargs):
        """See `select_config`."""
        return self.select_with_source(algorithm, **kwargs)[0]


_DEFAULT = Executor()


def cached_entries(path: Optional[str] = None) -> Dict[str, dict]:
    """The entries of the cache file (`path`, default cache_path()): key -> {"config", "source", "created"}."""
    return dict(ConfigCache(path or cache_path()).entries())


def decode_config(algorithm: str, config, *, platform: str = "cuda", backend: str = "triton"):
    """`config` as the registry entry's config type: returned as is when it already is one, decoded
    when it is the JSON form the cache file holds (e.g. {"fwd": [...], "bwd_dkdv": [...], "bwd_dq": [...]})."""
    entry = get_kernel(algorithm, platform, backend)
    try:
        if entry.decode(entry.encode(config)) == config:
            return config
    except Exception:  # not the config type itself: try it as the encoded form
        pass
    try:
        return entry.decode(config)
    except (TypeError, ValueError, KeyError) as e:
        raise ValueError(f"config must be a {algorithm} config or its JSON form: {e}") from None


def default_executor() -> Executor:
    """The process-wide executor the front ends use."""
    return _DEFAULT


def select_config(algorithm: str, *, platform: str, backend: str, device_name: str, arch: int = 0, shapes, options,
                  autotune_fn: Optional[Callable[[Sequence[Any]], Any]] = None, override=None,
                  autotune: Optional[bool] = None, heuristics: Optional[Callable[[Any, Any, int], Any]] = None):
    """The launch config of one call: override → memory → disk → autotune (opt-in) → heuristics.

    Args:
        algorithm, platform, backend: the registry entry, e.g. ("flash", "cuda", "triton") or
            ("flash", "cpu", "triton-interpret").
        device_name: torch.cuda.get_device_name / jax device_kind ("cpu" on the CPU).
        arch: compute capability as 90 / 80 (what the heuristics key tuned tiles on).
        shapes, options: FlashShapes and FlashOptions (for flash).
        autotune_fn: candidates -> best config, timing them on the device (framework code).
        override: return this config, whatever the caches say.
        autotune: True / False; None reads DUALATTN_AUTOTUNE=1.
        heuristics: replaces the entry's heuristics(shapes, options, arch) for this call.

    Returns:
        The config (for flash a FlashConfig).
    """
    return _DEFAULT.select(algorithm, platform=platform, backend=backend, device_name=device_name, arch=arch,
                           shapes=shapes, options=options, autotune_fn=autotune_fn, override=override,
                           autotune=autotune, heuristics=heuristics)


# ----------------------------------------------------------------------------- flash entries

_FLASH_TILES = ("fwd", "bwd_dkdv", "bwd_dq")


def _encode_flash(config) -> dict:
    return {name: list(dataclasses.astuple(getattr(config, name))) for name in _FLASH_TILES}


def _decode_flash(data):
    FlashConfig, TileConfig = _flash_plan.FlashConfig, _flash_plan.TileConfig
    if not isinstance(data, dict) or sorted(data) != sorted(_FLASH_TILES):
        raise ValueError(f"a flash config needs exactly the tiles {_FLASH_TILES}, got {data!r}")
    tiles = []
    for name in _FLASH_TILES:
        t = data[name]
        ok = (isinstance(t, list) and len(t) == 4 and all(type(v) is int and v > 0 for v in t)
              and all(v == next_pow2(v) for v in t[:3]) and min(t[:2]) >= 16)
        if not ok:
            raise ValueError(f"{name} must be [block_m, block_n, num_warps, num_stages] (powers of two, "
                             f"blocks >= 16), got {t!r}")
        tiles.append(TileConfig(*t))
    return FlashConfig(*tiles)


# default_config is looked up at each call: benchmarks/tune_flash.py patches it.
def _flash_heuristics_cpu(shapes, options, arch):
    return _flash_plan.default_config(shapes, interpret=True)


def _flash_heuristics_cuda(shapes, options, arch):
    return _flash_plan.default_config(shapes, interpret=False, arch=arch, causal=options.causal,
                                      window_keys=_flash_plan.causal_window_keys(options))


# Autotune search space (block_m, block_n, warps, stages), as benchmarks/tune_flash.py sweeps it.
_FWD_TILES = {128: ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)),
              256: ((64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2))}
_BWD_TILES = {128: (((32, 128, 4, 3), (128, 32, 4, 3)), ((64, 128, 8, 2), (128, 64, 8, 2)),
                    ((64, 128, 8, 3), (128, 64, 8, 2)), ((64, 64, 4, 3), (64, 64, 4, 3))),
              256: (((32, 64, 4, 2), (64, 32, 4, 2)), ((32, 32, 4, 2), (32, 32, 4, 2)))}


def _flash_candidates_cuda(shapes, options, arch):
    """Forward tiles x backward (dK/dV, dQ) pairs; tiles clamped to short sequences, duplicates dropped."""
    FlashConfig, TileConfig = _flash_plan.FlashConfig, _flash_plan.TileConfig
    d = 128 if max(next_pow2(shapes.head_dim), next_pow2(shapes.head_dim_v)) <= 128 else 256
    max_m, max_n = max(16, next_pow2(shapes.seqlen_q)), max(16, next_pow2(shapes.seqlen_k))

    def tile(t):
        return TileConfig(min(t[0], max_m), min(t[1], max_n), t[2], t[3])

    out = []
    for fwd in _FWD_TILES[d]:
        for dkdv, dq in _BWD_TILES[d]:
            c = FlashConfig(tile(fwd), tile(dkdv), tile(dq))
            if c not in out:
                out.append(c)
    return tuple(out)


register(KernelEntry("flash", "cuda", "triton", heuristics=_flash_heuristics_cuda, key_fields=flash_key_fields,
                     encode=_encode_flash, decode=_decode_flash, candidates=_flash_candidates_cuda))
register(KernelEntry("flash", "cpu", "triton-interpret", heuristics=_flash_heuristics_cpu,
                     key_fields=flash_key_fields, encode=_encode_flash, decode=_decode_flash))
