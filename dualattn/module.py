"""One entry for every attention algorithm in both frameworks: `attention`, `Attention`, `MaskInfo`.

    out = dualattn.attention(q, k, v, causal=True)                       # torch in -> torch out
    out = dualattn.attention(q, k, v, mask_info=info, algorithm="auto")  # jax in -> jax out
    layer = dualattn.Attention(algorithm="flash", causal=True)           # the same, as a callable object

A call is dispatched through a registry keyed by (algorithm, platform, backend):

    algorithm  "flash" | "blocksparse" | "ring" | "nsa"    ("auto" picks flash or blocksparse, below)
    platform   "torch" | "jax"    the framework the inputs belong to (the front end places the work on
                                  their device: CUDA through compiled Triton, CPU through the interpreter)
    backend    torch: "triton"; jax: "triton" | "xla" | "pallas"  ("auto": the jax front end's choice)

Each entry names its function by module path and is imported on first use, so an algorithm whose
module is not part of this install fails with an error that says so, and a missing
(algorithm, platform, backend) lists what is registered.  Launch configs come from the executor
(`dualattn.executor`): `config=` pins one, then memory, the cache file shared by torch and jax,
autotuning (`autotune=True`) and the heuristics, in that order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import threading
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np

from . import executor
from .options import canonical_window
from .sparse import SparseMask, as_numpy
from .options import FlashOptions
from .validation import check_dropout, check_flag, dtype_name

# `auto` runs blocksparse when the mask leaves fewer than this fraction of the key blocks flash would
# visit active (flash already skips blocks outside the causal/window band and, with segment ids, outside
# each tile's span of shared id ranges: MaskInfo.block_density): below it, skipping blocks saves more
# than the block lists cost.
AUTO_BLOCKSPARSE_DENSITY = 0.5
# Tile of the layouts `auto` / `blocksparse` build from segment ids.
AUTO_BLOCK = 64

PLATFORMS = ("torch", "jax")
_JAX_BACKEND_ORDER = ("xla", "triton", "pallas")   # after the front end's own choice: xla runs anywhere


class NoImplementationError(LookupError):
    """No implementation is registered (or importable) for an (algorithm, platform, backend)."""


# ----------------------------------------------------------------------------- registry

# The common keyword arguments each algorithm's functions take (anything else a caller passes goes
# to the function as is: ring's axis_name / group, nsa's gates and block_size, ...).
_FLASH_ARGS = frozenset({"softmax_scale", "causal", "sliding_window", "logits_soft_cap", "softmax_aux",
                         "q_segment_ids", "kv_segment_ids", "attention_mask", "bias", "dropout_prob",
                         "dropout_seed", "return_lse"})
_BLOCKSPARSE_ARGS = frozenset({"layout", "softmax_scale", "causal", "sliding_window", "logits_soft_cap",
                               "softmax_aux", "q_segment_ids", "kv_segment_ids", "return_lse"})
_RING_ARGS = frozenset({"softmax_scale", "causal", "sliding_window", "logits_soft_cap", "softmax_aux",
                        "q_segment_ids", "kv_segment_ids", "return_lse"})
_NSA_ARGS = frozenset({"softmax_scale", "causal"})


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One registered implementation.

    target: "package.module:function", imported on first use.
    accepts: the common keyword arguments (mask fields and flash options) the function takes;
        passing another one to `attention` with this algorithm raises ValueError.
    config_algorithm: the executor entry whose configs `config=` pins (flash kernels: "flash").
    causal_only: the algorithm is causal by definition (nsa): causal=False is rejected, and the
        function is not passed `causal`.
    """

    algorithm: str
    platform: str
    backend: str
    target: str
    accepts: FrozenSet[str]
    config_algorithm: str = "flash"
    causal_only: bool = False

    @property
    def name(self) -> Tuple[str, str, str]:
        return self.algorithm, self.platform, self.backend

    def load(self) -> Callable:
        module_name, _, attr = self.target.partition(":")
        # A loaded module is read from sys.modules: torch.compile traces that, not import_module.
        module = sys.modules.get(module_name)
        fn = getattr(module, attr, None)
        if fn is not None:
            return fn
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise   # a dependency of the module is missing: its own message says which
            raise NoImplementationError(
                f"{'/'.join(self.name)} is registered to {self.target}, but the module {module_name} is not "
                f"part of this install of dualattn") from e
        fn = getattr(module, attr, None)
        if fn is None:
            raise NoImplementationError(
                f"{'/'.join(self.name)} is registered to {self.target}, but {module_name} has no {attr!r} in this "
                f"install of dualattn")
        return fn


_IMPLEMENTATIONS: Dict[Tuple[str, str, str], Implementation] = {}
_LOCK = threading.Lock()


def register_implementation(algorithm: str, platform: str, backend: str, target: str, accepts, *,
                            config_algorithm: str = "flash", causal_only: bool = False,
                            replace: bool = False) -> Implementation:
    """Register `target` ("module:function") as the implementation of (algorithm, platform, backend)."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    impl = Implementation(algorithm, platform, backend, target, frozenset(accepts), config_algorithm, causal_only)
    with _LOCK:
        if impl.name in _IMPLEMENTATIONS and not replace:
            raise ValueError(f"{'/'.join(impl.name)} is already registered (pass replace=True to swap it)")
        _IMPLEMENTATIONS[impl.name] = impl
    return impl


def register_algorithm(algorithm: str, *, torch: Optional[str], jax: Optional[str], accepts,
                       jax_backends=("triton", "xla"), **kwargs) -> None:
    """One algorithm in both frameworks: torch's function on backend "triton", jax's on each of
    `jax_backends` (the jax function takes `backend=`)."""
    if torch is not None:
        register_implementation(algorithm, "torch", "triton", torch, accepts, **kwargs)
    for backend in jax_backends if jax is not None else ():
        register_implementation(algorithm, "jax", backend, jax, accepts, **kwargs)


def implementations() -> List[Tuple[str, str, str]]:
    """The registered (algorithm, platform, backend) names."""
    return sorted(_IMPLEMENTATIONS)


def _registered_text() -> str:
    return ", ".join("/".join(k) for k in implementations())


def get_implementation(algorithm: str, platform: str, backend: str = "auto") -> Implementation:
    """The implementation for (algorithm, platform, backend); backend "auto": torch "triton", jax the
    jax front end's choice for its default device when registered, else the first registered of
    xla, triton, pallas."""
    if backend == "auto":
        if platform == "jax":
            from .jax_api.flash import _resolve_backend
            order = (_resolve_backend("auto"),) + _JAX_BACKEND_ORDER
        else:
            order = ("triton",)
        for b in order:
            if (algorithm, platform, b) in _IMPLEMENTATIONS:
                return _IMPLEMENTATIONS[(algorithm, platform, b)]
    elif (algorithm, platform, backend) in _IMPLEMENTATIONS:
        return _IMPLEMENTATIONS[(algorithm, platform, backend)]
    raise NoImplementationError(f"no attention implementation registered for algorithm={algorithm!r}, "
                                f"platform={platform!r}, backend={backend!r}; registered: {_registered_text()}")


# Each algorithm is one registration.  ring and nsa resolve through their front-end packages, so they
# work as soon as dualattn.torch_api / dualattn.jax_api export them.
register_algorithm("flash", torch="dualattn.torch_api.flash:flash_attention",
                   jax="dualattn.jax_api.flash:flash_attention", accepts=_FLASH_ARGS,
                   jax_backends=("triton", "xla", "pallas"))
register_algorithm("blocksparse", torch="dualattn.torch_api.blocksparse:blocksparse_attention",
                   jax="dualattn.jax_api.blocksparse:blocksparse_attention", accepts=_BLOCKSPARSE_ARGS)
register_algorithm("ring", torch="dualattn.torch_api:ring_attention", jax="dualattn.jax_api:ring_attention",
                   accepts=_RING_ARGS)
register_algorithm("nsa", torch="dualattn.torch_api:native_sparse_attention",
                   jax="dualattn.jax_api:native_sparse_attention", accepts=_NSA_ARGS, config_algorithm="nsa",
                   causal_only=True)

ALGORITHMS = ("auto", "flash", "blocksparse", "ring", "nsa")


# ----------------------------------------------------------------------------- MaskInfo

def _is_symbolic(x) -> bool:
    """Whether x's values are unknown on the host now (a jax tracer, or torch.compile tracing)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return bool(torch.compiler.is_compiling())
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def _where(cond, a: int, b: int):
    """where(cond, a, b) as int32 in cond's framework."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(cond, torch.Tensor):
        return torch.where(cond.bool(), a, b).to(torch.int32)
    import jax.numpy as jnp
    return jnp.where(jnp.asarray(cond).astype(bool), a, b).astype(jnp.int32)


def _check_mask_array(name: str, x, expected: str, *, ndim: int, kinds: str) -> None:
    """x is a torch tensor or a jax / numpy array of `ndim` dims whose dtype is bool ("b"), unsigned
    ("u") or signed ("i") integer, among `kinds`; the errors name `name`."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be a torch tensor or a jax / numpy array {expected}, got {type(x).__name__}")
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must be {expected}, got shape {tuple(x.shape)}")
    dtype = dtype_name(x)
    kind = "b" if dtype == "bool" else "u" if dtype.startswith("uint") else "i" if dtype.startswith("int") else ""
    if kind not in kinds or not kind:
        want = " or ".join({"b": "bool", "u": "unsigned", "i": "signed"}[k] for k in kinds) + " integers"
        want = "bool or integers" if kinds == "bui" else want
        raise TypeError(f"{name} must be {want}, got {dtype}")


def _length(name: str, value) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return int(value)


def _check_lengths(name: str, lengths, maximum: int, maximum_name: str) -> None:
    """Per-sequence lengths: int (B,), each in [0, maximum] where the values are known now."""
    _check_mask_array(name, lengths, "(B,)", ndim=1, kinds="ui")
    if _is_symbolic(lengths):
        return
    values = as_numpy(lengths)
    bad = values[(values < 0) | (values > maximum)]
    if bad.size:
        raise ValueError(f"MaskInfo.from_lengths: {name} must lie in [0, {maximum_name} = {maximum}], got "
                         f"{bad[:8].tolist()}")


def _segment_block_map(q_ids: np.ndarray, kv_ids: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """(B, 1, nq, nk): blocks holding some query and key with equal segment ids."""
    batch, sq = q_ids.shape
    sk = kv_ids.shape[1]
    ids, inverse = np.unique(np.concatenate([q_ids, kv_ids], axis=1), return_inverse=True)
    inverse = inverse.reshape(batch, sq + sk)
    nq, nk = -(-sq // block_q), -(-sk // block_k)
    q_has = np.zeros((batch, ids.size, nq), dtype=bool)   # [B, ids, q blocks]
    k_has = np.zeros((batch, ids.size, nk), dtype=bool)   # [B, ids, k blocks]
    rows = np.arange(batch)[:, None]
    q_has[rows, inverse[:, :sq], np.arange(sq)[None] // block_q] = True
    k_has[rows, inverse[:, sq:], np.arange(sk)[None] // block_k] = True
    return np.einsum("bip,biq->bpq", q_has, k_has)[:, None]


def _block_id_ranges(ids: np.ndarray, block: int):
    """(min, max) id of each block of `block` tokens, (B, n) each (a partial last block: its own ids)."""
    batch, s = ids.shape
    n = -(-s // block)
    padded = np.concatenate([ids, np.repeat(ids[:, -1:], n * block - s, axis=1)], axis=1).reshape(batch, n, block)
    return padded.min(-1), padded.max(-1)


def _segment_span_map(q_ids: np.ndarray, kv_ids: np.ndarray, block_q: int, block_k: int) -> np.ndarray:
    """(B, 1, nq, nk): the key blocks flash visits for each query block with segment ids, before the
    causal/window band: from the first to the last key block whose id range meets the query block's
    (kernels/flash/segments.py: the per-tile ranges every flash kernel narrows its loop to)."""
    q_min, q_max = _block_id_ranges(q_ids, block_q)
    k_min, k_max = _block_id_ranges(kv_ids, block_k)
    meets = (k_max[:, None, :] >= q_min[:, :, None]) & (k_min[:, None, :] <= q_max[:, :, None])
    nk = meets.shape[-1]
    first = np.where(meets.any(-1), meets.argmax(-1), nk)
    last = nk - 1 - meets[..., ::-1].argmax(-1)
    cols = np.arange(nk)
    return ((cols >= first[..., None]) & (cols <= last[..., None]))[:, None]


class MaskInfo:
    """Which (query, key) pairs may attend, built once per batch and shared by every layer.

    Holds any of
        attention_mask  bool/int (B|1, H|1, Sq, Sk), True = may attend          (flash)
        q_segment_ids, kv_segment_ids  int (B, Sq) / (B, Sk): attend within equal ids; one given
                        serves both (Sq == Sk)                                  (flash, blocksparse, ring)
        layout          a dualattn.SparseMask: only its active blocks are computed  (blocksparse)
    in the framework of the attention inputs.  Each algorithm takes the fields it understands and
    rejects the others with a ValueError naming them (a field is never dropped silently).

    Padding is best given as segment ids (`from_padding`, `from_lengths`): the kernels then skip
    padded keys by comparing ids, without an Sq x Sk mask in memory.  Padded query rows attend nothing
    and give zeros.

    With algorithm="auto", `attention` runs blocksparse when a layout is given, or when the segment
    ids leave fewer than AUTO_BLOCKSPARSE_DENSITY (0.5) of the key blocks flash would visit (the
    causal/window band) active, at AUTO_BLOCK (64) token tiles — packed short documents, heavy
    padding; the layout it builds for that is cached here, per shape and mask options.  Under
    jax.jit or torch.compile the ids' values are unknown when the choice is made, so auto then
    runs flash unless a layout is given.
    """

    def __init__(self, attention_mask=None, q_segment_ids=None, kv_segment_ids=None, layout: Optional[SparseMask] = None):
        if layout is not None and not isinstance(layout, SparseMask):
            raise TypeError(f"layout must be a dualattn.SparseMask (SparseMask.from_block_map), got {type(layout)}")
        if q_segment_ids is None and kv_segment_ids is not None or q_segment_ids is not None and kv_segment_ids is None:
            q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
            kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        self.attention_mask = attention_mask
        self.q_segment_ids = q_segment_ids
        self.kv_segment_ids = kv_segment_ids
        self.layout = layout
        # What the user gave for the query / key ids, named in errors (from_padding, from_lengths).
        self._sources: Tuple[str, str] = ("mask_info.q_segment_ids", "mask_info.kv_segment_ids")
        self._layouts: Dict[tuple, Optional[SparseMask]] = {}
        self._densities: Dict[tuple, Optional[float]] = {}   # block_density per arguments: the ids read once
        _register_pytree()

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_padding(cls, padding_mask, *, seqlen_q: Optional[int] = None, layout: Optional[SparseMask] = None):
        """From a (B, Sk) padding mask (True / 1 = a real token), as HF tokenizers return it.

        Keys are the Sk positions; queries the last `seqlen_q` of them (default all: self-attention;
        fewer: decoding with a cache).  Padded keys get id -1, padded queries -2, real tokens 0, so
        real queries see only real keys and padded queries nothing.
        """
        _check_mask_array("padding_mask", padding_mask, "(B, Sk)", ndim=2, kinds="bui")
        seqlen_k = padding_mask.shape[1]
        seqlen_q = seqlen_k if seqlen_q is None else _length("seqlen_q", seqlen_q)
        if seqlen_q > seqlen_k:
            raise ValueError(f"MaskInfo.from_padding: seqlen_q ({seqlen_q}) must be <= the padding_mask's length "
                             f"Sk ({seqlen_k}): the queries are the last seqlen_q key positions")
        info = cls(q_segment_ids=_where(padding_mask[:, seqlen_k - seqlen_q:], 0, -2),
                   kv_segment_ids=_where(padding_mask, 0, -1), layout=layout)
        info._sources = ("MaskInfo.from_padding(padding_mask)",) * 2
        return info

    @classmethod
    def from_lengths(cls, q_lengths, kv_lengths=None, *, seqlen_q: int, seqlen_k: Optional[int] = None):
        """From per-sequence valid lengths (B,) (right padding): position t is real iff t < length.
        Lengths are ints in [0, seqlen_q] / [0, seqlen_k] (checked where their values are known now,
        not under jax.jit or torch.compile)."""
        seqlen_q = _length("seqlen_q", seqlen_q)
        seqlen_k = seqlen_q if seqlen_k is None else _length("seqlen_k", seqlen_k)
        _check_lengths("q_lengths", q_lengths, seqlen_q, "seqlen_q")
        if kv_lengths is None:
            kv_lengths = q_lengths
            if seqlen_k != seqlen_q:
                _check_lengths("q_lengths (the key lengths too, with no kv_lengths)", q_lengths, seqlen_k, "seqlen_k")
        else:
            _check_lengths("kv_lengths", kv_lengths, seqlen_k, "seqlen_k")
            if kv_lengths.shape[0] != q_lengths.shape[0]:
                raise ValueError(f"MaskInfo.from_lengths: kv_lengths has batch {kv_lengths.shape[0]} but q_lengths "
                                 f"has {q_lengths.shape[0]}")

        def ids(lengths, n: int, pad: int):
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(lengths, torch.Tensor):
                pos = torch.arange(n, device=lengths.device)[None, :]
                return _where(pos < lengths.reshape(-1, 1), 0, pad)
            import jax.numpy as jnp
            return _where(jnp.arange(n)[None, :] < jnp.asarray(lengths).reshape(-1, 1), 0, pad)

        info = cls(q_segment_ids=ids(q_lengths, seqlen_q, -2), kv_segment_ids=ids(kv_lengths, seqlen_k, -1))
        info._sources = ("MaskInfo.from_lengths(q_lengths)",
                         "MaskInfo.from_lengths(kv_lengths)" if kv_lengths is not q_lengths
                         else "MaskInfo.from_lengths(q_lengths)")
        return info

    # -- what algorithms read ---------------------------------------------------------------------

    def fields(self) -> Dict[str, Any]:
        """The given fields by the keyword names the front ends take."""
        given = {"attention_mask": self.attention_mask, "q_segment_ids": self.q_segment_ids,
                 "kv_segment_ids": self.kv_segment_ids, "layout": self.layout}
        return {k: v for k, v in given.items() if v is not None}

    def segment_layout(self, *, heads: int, seqlen_q: int, seqlen_k: int, causal: bool, sliding_window=None,
                       block: Optional[int] = None) -> Optional[SparseMask]:
        """The layout of blocks the segment ids (and the causal/window band) leave active, or None when
        there are no segment ids or their values are not known now (traced).  Cached per arguments."""
        if self.q_segment_ids is None or _is_symbolic(self.q_segment_ids) or _is_symbolic(self.kv_segment_ids):
            return None
        block = block or AUTO_BLOCK
        key = _arguments_key(heads, seqlen_q, seqlen_k, causal, sliding_window, block)
        if key not in self._layouts:
            q_ids, kv_ids = as_numpy(self.q_segment_ids), as_numpy(self.kv_segment_ids)
            if q_ids.shape[1] != seqlen_q or kv_ids.shape[1] != seqlen_k:
                raise ValueError(f"{self._sources[0]} / {self._sources[1]} give lengths ({q_ids.shape[1]}, "
                                 f"{kv_ids.shape[1]}) but the query and key have ({seqlen_q}, {seqlen_k})")
            block_map = _segment_block_map(q_ids, kv_ids, block, block) & _band_map(seqlen_q, seqlen_k, causal,
                                                                                   sliding_window, block)
            self._layouts[key] = SparseMask.from_block_map(block_map, block, block)
        return self._layouts[key]

    def block_density(self, *, heads: int, seqlen_q: int, seqlen_k: int, causal: bool = False,
                      sliding_window=None, block: Optional[int] = None) -> Optional[float]:
        """Active blocks of the layout (given, or built from the segment ids) over the blocks flash
        would visit: those the causal/window band touches, and with segment ids only those inside
        each query block's span of key blocks with a shared id range (_segment_span_map); None when
        it cannot be known now.  Cached per arguments, as the layout is: reading the ids is a device
        to host copy, which every call of `auto` would otherwise make."""
        key = _arguments_key(heads, seqlen_q, seqlen_k, causal, sliding_window, block or AUTO_BLOCK)
        density = self._densities.get(key)
        if density is None:
            density = self._block_density(heads, seqlen_q, seqlen_k, causal, sliding_window, block)
            if density is not None:   # (None: the ids are traced now; a later call may know them)
                self._densities[key] = density
        return density

    def _block_density(self, heads, seqlen_q, seqlen_k, causal, sliding_window, block) -> Optional[float]:
        layout = self.layout or self.segment_layout(heads=heads, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                                                    causal=causal, sliding_window=sliding_window, block=block)
        if layout is None:
            return None
        visited = np.broadcast_to(_band_map(seqlen_q, seqlen_k, causal, sliding_window, layout.block_q,
                                            layout.block_k), layout.block_map.shape)
        if self.q_segment_ids is not None and not _is_symbolic(self.q_segment_ids) \
                and not _is_symbolic(self.kv_segment_ids):
            visited = visited & _segment_span_map(as_numpy(self.q_segment_ids), as_numpy(self.kv_segment_ids),
                                                  layout.block_q, layout.block_k)
        return float((layout.block_map & visited).sum()) / max(float(visited.sum()), 1.0)

    def __repr__(self):
        parts = [f"{k}={getattr(v, 'shape', v)!r}" if k != "layout" else f"layout={v.shape}"
                 for k, v in self.fields().items()]
        return f"MaskInfo({', '.join(parts)})"


def _arguments_key(heads, seqlen_q, seqlen_k, causal, sliding_window, block) -> tuple:
    """What a MaskInfo's cached layout and density depend on (a window given as a list made hashable)."""
    window = tuple(sliding_window) if isinstance(sliding_window, list) else sliding_window
    return heads, seqlen_q, seqlen_k, causal, window, block


def _band_map(seqlen_q: int, seqlen_k: int, causal: bool, sliding_window, block_q: int, block_k: Optional[int] = None):
    from .masks import _band
    left, right = canonical_window(sliding_window, bool(causal))
    return _band(seqlen_q, seqlen_k, block_q, block_k or block_q, left, right)[None, None]


_PYTREE_REGISTERED = False


def _register_pytree() -> None:
    """MaskInfo as a jax pytree (its arrays are leaves, the layout static), so it can be an argument
    of a jitted function; registered once, when jax is loaded."""
    global _PYTREE_REGISTERED
    if _PYTREE_REGISTERED or "jax" not in sys.modules:
        return
    import jax

    def flatten(info):
        return (info.attention_mask, info.q_segment_ids, info.kv_segment_ids), (info.layout, info._sources)

    def unflatten(static, children):
        info = MaskInfo.__new__(MaskInfo)
        info.attention_mask, info.q_segment_ids, info.kv_segment_ids = children
        (info.layout, info._sources), info._layouts, info._densities = static, {}, {}
        return info

    with _LOCK:
        if not _PYTREE_REGISTERED:
            jax.tree_util.register_pytree_node(MaskInfo, flatten, unflatten)
            _PYTREE_REGISTERED = True


# ----------------------------------------------------------------------------- dispatch

def choose_algorithm(query, key, mask_info: Optional[MaskInfo], *, causal=None, sliding_window=None) -> str:
    """What algorithm="auto" runs: "blocksparse" when mask_info has a layout, or when its segment ids
    leave fewer than AUTO_BLOCKSPARSE_DENSITY of the blocks flash would visit active and nothing
    blocksparse cannot take (a dense attention_mask) is given; "flash" otherwise."""
    if mask_info is None:
        return "flash"
    if mask_info.layout is not None:
        return "blocksparse"
    if mask_info.attention_mask is not None:
        return "flash"
    density = mask_info.block_density(heads=query.shape[2], seqlen_q=query.shape[1], seqlen_k=key.shape[1],
                                      causal=bool(causal), sliding_window=sliding_window)
    return "blocksparse" if density is not None and density < AUTO_BLOCKSPARSE_DENSITY else "flash"


@contextlib.contextmanager
def _executor_scope(impl: Implementation, config, autotune: Optional[bool]):
    with contextlib.ExitStack() as stack:
        if config is not None:
            if impl.config_algorithm == "flash":
                config = executor.decode_config("flash", config)
            stack.enter_context(executor.override(config, algorithm=impl.config_algorithm))
        if autotune is not None:
            stack.enter_context(executor.autotuning(autotune))
        yield


def attention(query, key, value, *, algorithm: str = "auto", mask_info: Optional[MaskInfo] = None,
              softmax_scale: Optional[float] = None, causal: Optional[bool] = None, sliding_window=None,
              logits_soft_cap: Optional[float] = None, softmax_aux=None, bias=None, dropout_prob: float = 0.0,
              dropout_seed=None, return_lse: bool = False, backend: str = "auto", config=None,
              autotune: bool = False, **algorithm_kwargs):
    """Attention over BSHD inputs by any registered algorithm: torch in -> torch out, jax in -> jax out.

    Args:
        query (B, Sq, Hq, D), key (B, Sk, Hkv, D), value (B, Sk, Hkv, Dv): torch tensors or jax arrays.
        algorithm: "flash", "blocksparse", "ring", "nsa" or "auto": blocksparse when mask_info holds a
            layout, or when its segment ids leave fewer than AUTO_BLOCKSPARSE_DENSITY = 0.5 of the
            key blocks flash would visit (the causal / window band, 64x64 tiles) active; flash
            otherwise (always under jax.jit / torch.compile without a layout: the ids' values are
            unknown when the choice is made).
        mask_info: a MaskInfo (attention_mask, segment ids, SparseMask layout); each algorithm takes
            the fields it understands and rejects the others.  blocksparse without a layout builds
            one from the segment ids and the causal / window band.
        softmax_scale, causal, sliding_window, logits_soft_cap, softmax_aux, bias, dropout_prob,
            dropout_seed, return_lse: as flash_attention (SPEC.md); an option the algorithm does
            not take raises ValueError.  causal=None: the algorithm's default (False; nsa: causal).
        backend: jax "triton" | "xla" | "pallas" | "auto"; torch "triton" | "auto".
        config: pin the launch config (a FlashConfig or its JSON form from the cache file).
        autotune: True: on a cache miss, time the candidate configs on the GPU and store the best in
            the cache file both frameworks read; False (default): never.
        **algorithm_kwargs: passed to the algorithm's function as they are (ring: axis_name / group,
            layout="zigzag"; nsa: g_cmp, g_slc, g_swa, block_size, block_counts, window_size, ...).

    Returns:
        What the algorithm's function returns: out (B, Sq, Hq, Dv), or (out, lse) with return_lse.

    Raises:
        NoImplementationError: nothing registered for (algorithm, framework, backend); the message
            lists what is.
        ValueError / TypeError: an argument the algorithm does not take, or a bad argument.
    """
    from .interop import framework_of_arguments
    if mask_info is not None and not isinstance(mask_info, MaskInfo):
        raise TypeError(f"mask_info must be a dualattn.MaskInfo, got {type(mask_info).__name__}")
    _check_options(algorithm, backend, autotune, dict(
        softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        dropout_prob=dropout_prob, dropout_seed=dropout_seed, return_lse=return_lse))
    if mask_info is not None:
        _check_segment_ids(mask_info, query, key)
    arrays = dict(key=key, value=value, softmax_aux=softmax_aux, bias=bias,
                  **(mask_info.fields() if mask_info is not None else {}))
    arrays.pop("layout", None)
    platform = framework_of_arguments("dualattn.attention", query, arrays)
    if algorithm == "auto":
        algorithm = choose_algorithm(query, key, mask_info, causal=causal, sliding_window=sliding_window)
    impl = get_implementation(algorithm, platform, backend)
    kwargs = _arguments(impl, query, key, mask_info, dict(
        softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux, bias=bias, dropout_prob=dropout_prob, dropout_seed=dropout_seed,
        return_lse=return_lse))
    if platform == "jax":
        kwargs["backend"] = impl.backend
    clash = sorted(set(kwargs) & set(algorithm_kwargs))
    if clash:
        raise TypeError(f"dualattn.attention: {clash} given twice (as algorithm keyword arguments too)")
    fn = impl.load()
    with _executor_scope(impl, config, autotune):
        return fn(query, key, value, **kwargs, **algorithm_kwargs)


def _check_options(algorithm, backend, autotune, options: dict) -> None:
    """The options `attention` and `Attention` take, checked before any dispatch: bools are bools (a
    string such as "yes" or "False" would be read by truthiness), numbers numbers, names known
    strings; the window, soft cap, scale and dropout as flash_attention checks them."""
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a str, got {type(algorithm).__name__} {algorithm!r}")
    if algorithm not in ALGORITHMS and algorithm not in {name[0] for name in _IMPLEMENTATIONS}:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__} {backend!r}")
    check_flag("autotune", autotune)
    causal = options.get("causal")
    if causal is not None:
        check_flag("causal", causal)
    if "return_lse" in options:
        check_flag("return_lse", options["return_lse"])
    check_dropout(options.get("dropout_prob", 0.0), options.get("dropout_seed"))
    FlashOptions.build(head_dim=1, softmax_scale=options.get("softmax_scale"), causal=bool(causal),
                       sliding_window=options.get("sliding_window"), logits_soft_cap=options.get("logits_soft_cap"), dropout_prob=options.get("dropout_prob", 0.0))


def _check_segment_ids(info: MaskInfo, query, key) -> None:
    """mask_info's segment ids against the query (B, Sq) and key (B, Sk), the errors naming what the user
    gave (a padding mask, lengths or the ids themselves)."""
    if info.q_segment_ids is None:
        return
    for ids, source, role, x in ((info.q_segment_ids, info._sources[0], "query", query),
                                 (info.kv_segment_ids, info._sources[1], "key", key)):
        want = (x.shape[0], x.shape[1]) if len(getattr(x, "shape", ())) == 4 else None
        shape = tuple(getattr(ids, "shape", ()))
        if want is not None and shape != want:
            raise ValueError(f"{source} gives {role} ids of shape {shape}, but the {role} (B, S, H, D) = "
                             f"{tuple(x.shape)} needs (B, S) = {want}")


_DEFAULTS = dict(softmax_scale=None, causal=None, sliding_window=None, logits_soft_cap=None, softmax_aux=None,
                 bias=None, dropout_prob=0.0, dropout_seed=None, return_lse=False)


def _arguments(impl: Implementation, query, key, mask_info: Optional[MaskInfo], options: dict) -> dict:
    """The common keyword arguments of impl's function: the options that differ from their defaults
    and the mask fields, each checked against what the algorithm takes."""
    given = {}
    for name, value in options.items():   # (identity tests: values may be arrays)
        if value is None or value is _DEFAULTS[name] or name == "dropout_prob" and value == 0.0:
            continue
        given[name] = value   # (types and ranges: _check_options)
    if impl.causal_only:
        if given.pop("causal", True) is not True:
            raise ValueError(f"algorithm {impl.algorithm!r} is causal by definition; causal=False is not supported")
    fields = mask_info.fields() if mask_info is not None else {}
    if impl.algorithm == "blocksparse" and "layout" not in fields:
        layout = mask_info.segment_layout(heads=query.shape[2], seqlen_q=query.shape[1], seqlen_k=key.shape[1],
                                          causal=bool(options["causal"]),
                                          sliding_window=options["sliding_window"]) if mask_info else None
        if layout is None:   # no ids to build one from: the causal / window band
            band = _band_map(query.shape[1], key.shape[1], bool(options["causal"]), options["sliding_window"],
                             AUTO_BLOCK)
            layout = SparseMask.from_block_map(band, AUTO_BLOCK, AUTO_BLOCK)   # (read at call time: tests shrink it)
        fields["layout"] = layout
    given.update(fields)
    unsupported = sorted(k for k in given if k not in impl.accepts)
    if unsupported:
        where = ["mask_info." + k if k in fields else k for k in unsupported]
        raise ValueError(f"algorithm {impl.algorithm!r} does not take {', '.join(where)}; it takes "
                         f"{sorted(impl.accepts)} (and mask_info fields among them)")
    return given


class Attention:
    """`attention` with fixed settings, callable on torch tensors and jax arrays alike.

        layer = dualattn.Attention(algorithm="auto", causal=True, autotune=True)
        out = layer(q, k, v, mask_info=info)      # per-call keywords override the fixed ones

    Holds no parameters (the projections belong to the model: torch_api.MultiheadAttention,
    jax_api.nnx.MultiHeadAttention); safe to share between layers, threads and frameworks.
    """

    def __init__(self, algorithm: str = "auto", *, autotune: bool = False, config=None,
                 backend: str = "auto", **defaults):
        _check_options(algorithm, backend, autotune, {k: v for k, v in defaults.items() if k in _DEFAULTS})
        self.algorithm, self.autotune, self.config, self.backend = algorithm, autotune, config, backend
        self.defaults = dict(defaults)

    def __call__(self, query, key, value, mask_info: Optional[MaskInfo] = None, **kwargs):
        call = dict(algorithm=self.algorithm, backend=self.backend, config=self.config, autotune=self.autotune,
                    **self.defaults)
        call.update(kwargs)
        return attention(query, key, value, mask_info=mask_info, **call)

    def __repr__(self):
        extra = "".join(f", {k}={v!r}" for k, v in self.defaults.items())
        return f"Attention(algorithm={self.algorithm!r}, autotune={self.autotune!r}, backend={self.backend!r}{extra})"
