"""Zero-copy exchange of tensors between PyTorch and JAX, and the framework dispatcher.

    torch_to_jax(t, *, copy=None, return_info=False)   torch.Tensor -> jax.Array
    jax_to_torch(a, *, copy=None, return_info=False)   jax.Array    -> torch.Tensor
    dispatch_flash_attention(query, key, value, **kw)  behind `dualattn.flash_attention`

Both conversions go through DLPack and share memory whenever the memory allows it (the
same data pointer, on CPU and on CUDA; a CUDA tensor lands on the jax device of the same
ordinal). When it does not, they copy *explicitly* — the copy is decided here, before the
buffer is handed over, never silently inside the framework:

    torch -> jax copies when                          | reason string in TransferInfo
    ---------------------------------------------------+---------------------------------
    strides are gapped or broadcast (t[:, ::2], expand)| "non-compact strides ..."
    CPU data pointer not 64-byte aligned (t[1:])        | "data pointer ... not aligned ..."
    64-bit dtype while jax_enable_x64 is off            | "int64 -> int32 (jax_enable_x64 is off)"
    conjugate / negative view bit is set                | "conjugate bit set"
    copy=True was passed                                | "copy=True requested"

Compact permuted layouts (e.g. a BHSD view of a BSHD tensor, ``t.permute(0, 2, 1, 3)``)
are *not* gapped: they go through without a copy, with the same strides.

The `copy` argument follows the array-API / DLPack meaning:
``copy=None`` shares when it can and copies otherwise (with an `InteropCopyWarning`),
``copy=True`` always copies (no warning: it was asked for), ``copy=False`` never copies and
raises `BufferError` when sharing is impossible.

How to know which one happened — the result stays a plain array/tensor, and:

* ``return_info=True`` returns ``(result, TransferInfo)``; ``info.zero_copy`` is measured
  (pointer equality of source and result), not predicted, so a copy made by the framework
  behind our back would still be reported.
* every transfer logs one DEBUG line on the ``"dualattn.interop"`` logger (the `TransferInfo`
  as text, e.g. ``torch->jax zero-copy: bfloat16[2, 16, 3, 32] on cpu:0, 6144 B``);
* an unrequested copy also emits `InteropCopyWarning` (silence it with
  ``warnings.filterwarnings("ignore", category=InteropCopyWarning)``).

A tensor that requires grad is detached (the jax array is outside torch's autograd graph);
``info.detached`` says so. Aliasing is real both ways: writing into the torch source is
visible in the jax array, and writing into a tensor from `jax_to_torch` changes the jax array
(which jax assumes immutable — only do that if you own the array). On CUDA the DLPack stream
protocol orders the consumer's stream after work already queued on the producer's at
conversion time; writes queued later are not ordered (synchronise before reading across).

jax -> torch copies only for packed sub-byte dtypes (int4 -> int8, ...) or copy=True; arrays
spanning several devices and tracers are rejected rather than copied.

`import dualattn.interop` needs neither torch nor jax; each function imports the
framework(s) it needs and raises an ImportError naming the missing one.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
import warnings
from typing import Optional, Tuple

__all__ = [
    "torch_to_jax",
    "jax_to_torch",
    "TransferInfo",
    "InteropCopyWarning",
    "dispatch_flash_attention",
]

logger = logging.getLogger("dualattn.interop")

# Alignment XLA asks of an imported buffer's data pointer, per torch device type. The CPU
# client refuses (copy=False) or silently copies (copy=None) pointers that are not 64-byte
# aligned ("... is not aligned to 64 bytes"). The GPU client takes any element-aligned pointer
# (measured on an H100 with jax 0.11.2: offsets of 4..512 bytes from a torch allocation all
# came back zero-copy), so a CUDA t[1:] is shared, not copied.
_JAX_ALIGNMENT = {"cpu": 64, "cuda": 1}

# torch device type -> jax platform whose client imports DLPack buffers from it.
_JAX_PLATFORM = {"cpu": "cpu", "cuda": "gpu"}

# Packed sub-byte integers have no DLPack code; they widen losslessly to one byte.
_JAX_WIDEN_FOR_TORCH = {"int2": "int8", "int4": "int8", "uint2": "uint8", "uint4": "uint8"}


class InteropCopyWarning(UserWarning):
    """A torch<->jax conversion had to copy the data although sharing was asked for (copy=None)."""


@dataclasses.dataclass(frozen=True)
class TransferInfo:
    """What one `torch_to_jax` / `jax_to_torch` call did (returned when ``return_info=True``).

    Attributes:
      direction: ``"torch->jax"`` or ``"jax->torch"``.
      zero_copy: True iff the result shares the source's memory (equal data pointers).
      reason: why a copy was made (None when ``zero_copy``).
      detached: True if a torch tensor that requires grad was detached first.
      src_dtype, dst_dtype: dtype names, e.g. ``"bfloat16"``; they differ after a downcast.
      device: device of the result: the jax device as ``"cpu:0"`` / ``"gpu:0"`` (torch->jax),
        the torch device as ``"cpu"`` / ``"cuda:0"`` (jax->torch).
      shape: shape of the result.
      nbytes: size of the source data in bytes (what a copy moved).
    """

    direction: str
    zero_copy: bool
    reason: Optional[str]
    detached: bool
    src_dtype: str
    dst_dtype: str
    device: str
    shape: Tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        how = "zero-copy" if self.zero_copy else f"COPY ({self.reason})"
        dt = self.src_dtype if self.src_dtype == self.dst_dtype else f"{self.src_dtype}->{self.dst_dtype}"
        extra = ", detached" if self.detached else ""
        return f"{self.direction} {how}: {dt}{list(self.shape)} on {self.device}, {self.nbytes} B{extra}"


# ----------------------------------------------------------------------------- imports


def _import_torch(what: str):
    try:
        import torch
    except ImportError as e:  # pragma: no cover - exercised in a subprocess test
        raise ImportError(
            f"dualattn.interop.{what} needs PyTorch, which is not installed: "
            "pip install 'dualattn[torch]' (or torch itself)") from e
    return torch


def _import_jax(what: str):
    try:
        import jax
        import jax.dlpack  # noqa: F401  (a submodule, not always imported by `import jax`)
    except ImportError as e:  # pragma: no cover - exercised in a subprocess test
        raise ImportError(
            f"dualattn.interop.{what} needs JAX, which is not installed: "
            "pip install 'dualattn[jax]' (or jax[cuda12] on a GPU machine)") from e
    return jax


# ----------------------------------------------------------------------------- torch -> jax


def _torch_dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def _is_compact(shape, strides) -> bool:
    """True iff the elements tile one dense block in some dimension order (no gaps, no broadcast).

    This is what XLA accepts from DLPack: a transposition of a row-major buffer. Dimensions
    of size 1 carry no layout information and are ignored; an empty tensor is trivially compact.
    """
    if any(s == 0 for s in shape):
        return True
    dims = sorted(((st, sz) for sz, st in zip(shape, strides) if sz != 1), reverse=True)
    expected = 1
    for st, sz in reversed(dims):  # innermost (smallest stride) first
        if st != expected:
            return False
        expected *= sz
    return True


def _jax_target_dtype(jax, torch, dtype):
    """The torch dtype jax will store `dtype` as (64-bit types shrink unless jax_enable_x64)."""
    name = _torch_dtype_name(dtype)
    if name not in ("int64", "uint64", "float64", "complex128"):
        return dtype
    import numpy as np
    canon = np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(name))).name
    return getattr(torch, canon)


def _copy_reason_torch(t, target_dtype) -> Optional[str]:
    """Why `t` cannot be shared with jax as is (None: it can)."""
    if target_dtype != t.dtype:
        return (f"{_torch_dtype_name(t.dtype)} -> {_torch_dtype_name(target_dtype)} "
                "(jax_enable_x64 is off)")
    if t.is_conj():
        return "conjugate bit set"
    if t.is_neg():
        return "negative bit set"
    if not (t.is_contiguous() or _is_compact(t.shape, t.stride())):
        return f"non-compact strides {tuple(t.stride())} for shape {tuple(t.shape)} (gapped or broadcast)"
    align = _JAX_ALIGNMENT.get(t.device.type, 1)
    if t.numel() and t.data_ptr() % align:
        return (f"data pointer 0x{t.data_ptr():x} not aligned to {align} bytes "
                f"(storage offset {t.storage_offset()})")
    return None


def _check_jax_backend(jax, t) -> None:
    platform = _JAX_PLATFORM.get(t.device.type)
    if platform is None:
        raise TypeError(f"torch_to_jax: tensors on {t.device} are not supported (cpu and cuda are)")
    if platform == "cpu":  # jax always has its CPU client
        return
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        devices = []
    if not devices:
        raise RuntimeError(
            f"torch_to_jax: the tensor is on {t.device} but JAX has no {platform} backend "
            f"(jax.devices() = {jax.devices()}); install a matching jaxlib, e.g. jax[cuda12]")


def _check_options(fn: str, copy, return_info) -> Tuple[Optional[bool], bool]:
    """copy: None or a bool; return_info: a bool (a string such as "yes" or "False" would be read by
    truthiness, and copy="no" would copy)."""
    if copy is not None and type(copy).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{fn}: copy must be None, True or False, got {type(copy).__name__} {copy!r}")
    if type(return_info).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{fn}: return_info must be a bool, got {type(return_info).__name__} {return_info!r}")
    return None if copy is None else bool(copy), bool(return_info)


def torch_to_jax(t, *, copy: Optional[bool] = None, return_info: bool = False):
    """Share a torch tensor with JAX through DLPack; copy explicitly only when unavoidable.

    Args:
      t: a strided ``torch.Tensor`` on CPU or CUDA (any dtype jax knows, bf16 and bool
        included). If it requires grad it is detached, not rejected.
      copy: ``None`` (default): share if possible, else copy and warn with
        `InteropCopyWarning`. ``True``: always copy (a fresh, row-major jax buffer).
        ``False``: never copy; raise `BufferError` if sharing is impossible.
      return_info: also return a `TransferInfo` saying what happened.

    Returns:
      A ``jax.Array`` with the tensor's shape, on the jax device matching ``t.device``
      (cuda:i -> the jax GPU with local hardware id i); with ``return_info``,
      ``(array, TransferInfo)``. A shared array aliases ``t``: later writes into ``t`` show
      through, so do not write into ``t`` while jax still uses the array.

    Raises:
      TypeError: not a strided torch tensor, or on an unsupported device.
      BufferError: ``copy=False`` and the memory cannot be shared.
      ImportError: torch or jax is not installed.
    """
    copy, return_info = _check_options("torch_to_jax", copy, return_info)
    torch = _import_torch("torch_to_jax")
    jax = _import_jax("torch_to_jax")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torch_to_jax expects a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise TypeError(f"torch_to_jax: only dense strided tensors are supported, got layout {t.layout}")
    _check_jax_backend(jax, t)

    detached = t.requires_grad
    if detached:
        t = t.detach()
    src = t
    target_dtype = _jax_target_dtype(jax, torch, t.dtype)
    reason = _copy_reason_torch(t, target_dtype)
    if reason is not None and copy is False:
        raise BufferError(f"torch_to_jax(copy=False): cannot share memory: {reason}")
    if copy:
        reason = "copy=True requested"
    if reason is not None:
        # A fresh row-major buffer from torch's allocator (64-byte aligned on CPU, 512 on CUDA)
        # that jax then takes without a second copy. `.to(copy=True)` also resolves conj/neg bits.
        t = t.resolve_conj().resolve_neg().to(
            dtype=target_dtype, memory_format=torch.contiguous_format, copy=True)

    out = jax.dlpack.from_dlpack(t)
    shared = _shares(src.data_ptr(), out, src.numel())
    if reason is None and not shared:  # the framework copied although we predicted it would not
        reason = "copied inside jax.dlpack.from_dlpack"
    if not (return_info or reason or logger.isEnabledFor(logging.DEBUG)):
        return out  # the common zero-copy case: no record to build
    info = TransferInfo(
        direction="torch->jax", zero_copy=shared, reason=None if shared else reason,
        detached=detached, src_dtype=_torch_dtype_name(src.dtype), dst_dtype=out.dtype.name,
        device=_jax_device_name(out), shape=tuple(out.shape), nbytes=src.numel() * src.element_size())
    _report(info, requested=bool(copy))
    return (out, info) if return_info else out


def _jax_device_name(a) -> str:
    d = next(iter(a.devices()))
    return f"{d.platform}:{d.id}"   # "cpu:0", "gpu:0"


def _shares(src_ptr: int, jax_array, numel: int) -> bool:
    if numel == 0:  # an empty buffer has no meaningful address; nothing was copied
        return True
    try:
        return jax_array.unsafe_buffer_pointer() == src_ptr
    except Exception:  # pragma: no cover - e.g. a platform without buffer pointers
        return False


# ----------------------------------------------------------------------------- jax -> torch


def jax_to_torch(a, *, copy: Optional[bool] = None, return_info: bool = False):
    """Share a jax array with PyTorch through DLPack; copy explicitly only when unavoidable.

    Args:
      a: a concrete ``jax.Array`` on one device (CPU or GPU). Tracers (inside ``jit``/``grad``)
        are rejected: use ``jax.pure_callback`` to reach torch from traced code.
      copy: ``None`` (default): share if possible, else copy and warn. ``True``: always copy.
        ``False``: never copy; raise `BufferError` if sharing is impossible.
      return_info: also return a `TransferInfo` saying what happened.

    Returns:
      A ``torch.Tensor`` (``requires_grad=False``) on the matching torch device, with jax's
      strides; with ``return_info``, ``(tensor, TransferInfo)``. A shared tensor aliases the
      jax buffer, which jax treats as immutable: writing into the tensor changes the array.

    Raises:
      TypeError: not a jax array, a tracer, or a dtype torch cannot represent.
      ValueError: the array spans several devices (convert its ``addressable_shards``).
      BufferError: ``copy=False`` and the memory cannot be shared.
      ImportError: torch or jax is not installed.
    """
    copy, return_info = _check_options("jax_to_torch", copy, return_info)
    jax = _import_jax("jax_to_torch")
    torch = _import_torch("jax_to_torch")
    if isinstance(a, jax.core.Tracer):
        raise TypeError(
            "jax_to_torch got a traced value (inside jit/grad/vmap); torch can only see concrete "
            "arrays: call torch from jax.pure_callback instead")
    if not isinstance(a, jax.Array):
        raise TypeError(f"jax_to_torch expects a jax.Array, got {type(a).__name__}")
    devices = a.devices()
    if len(devices) != 1:
        raise ValueError(
            f"jax_to_torch: the array spans {len(devices)} devices ({a.sharding}); convert "
            "one shard at a time: [jax_to_torch(s.data) for s in a.addressable_shards]")

    reason = None
    widened = _widen_for_torch(a.dtype)
    if widened is not None:
        src_dtype = a.dtype.name
        reason = f"{src_dtype} -> {widened} (no DLPack/torch dtype for {src_dtype})"
    if reason is not None and copy is False:
        raise BufferError(f"jax_to_torch(copy=False): cannot share memory: {reason}")
    src = a
    if widened is not None:
        a = a.astype(widened)
    try:
        out = torch.from_dlpack(a)
    except (BufferError, RuntimeError, TypeError) as e:
        raise TypeError(f"jax_to_torch: cannot export a {src.dtype.name} array of shape {a.shape} "
                        f"on {next(iter(devices))} to torch: {e}") from e
    if copy:
        reason = "copy=True requested"
        out = out.clone()
    shared = out.numel() == 0 or out.data_ptr() == _jax_pointer(src)
    if reason is None and not shared:
        reason = "copied inside torch.from_dlpack"
    if not (return_info or reason or logger.isEnabledFor(logging.DEBUG)):
        return out  # the common zero-copy case: no record to build
    info = TransferInfo(
        direction="jax->torch", zero_copy=shared, reason=None if shared else reason,
        detached=False, src_dtype=src.dtype.name, dst_dtype=_torch_dtype_name(out.dtype),
        device=str(out.device), shape=tuple(out.shape), nbytes=int(src.nbytes))
    _report(info, requested=bool(copy))
    return (out, info) if return_info else out


@functools.lru_cache(maxsize=None)
def _widen_for_torch(dtype) -> Optional[str]:
    return _JAX_WIDEN_FOR_TORCH.get(dtype.name)


def _jax_pointer(a) -> Optional[int]:
    try:
        return a.unsafe_buffer_pointer()
    except Exception:  # pragma: no cover
        return None


def _report(info: TransferInfo, *, requested: bool) -> None:
    logger.debug("%s", info)
    if not info.zero_copy and not requested:
        # stacklevel 3: the user's call of torch_to_jax / jax_to_torch.
        warnings.warn(f"dualattn.interop: {info}", InteropCopyWarning, stacklevel=3)


# ----------------------------------------------------------------------------- dispatch

_FRONT_ENDS = {"torch": "dualattn.torch_api", "jax": "dualattn.jax_api"}


def _framework_of(x) -> Optional[str]:
    """'torch', 'jax' or None, without importing a framework that is not loaded yet.

    A value of a framework that was never imported cannot be one of its arrays, so looking
    only at `sys.modules` is exact. jax tracers count as jax (isinstance(tracer, jax.Array)).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, getattr(jax, "Array", ())):
        return "jax"
    return None


def _front_end(framework: str):
    """The `flash_attention` of `dualattn.<framework>_api`, imported on first use."""
    return importlib.import_module(_FRONT_ENDS[framework]).flash_attention


def dispatch_flash_attention(query, key, value, **kwargs):
    """Route `dualattn.flash_attention` to the front end of the inputs' framework.

    torch tensors in -> `dualattn.torch_api.flash_attention` -> torch out;
    jax arrays (or tracers) in -> `dualattn.jax_api.flash_attention` -> jax out.
    Keyword arguments (including ``return_lse=True``, whose tuple comes back as is) are
    passed through unchanged; the front end validates them.

    Raises:
      TypeError: ``query`` is neither a torch tensor nor a jax array, or the arguments mix
        frameworks (every array argument, keyword ones too, must belong to query's framework;
        convert with `torch_to_jax` / `jax_to_torch`).
    """
    framework = framework_of_arguments("dualattn.flash_attention", query, {"key": key, "value": value, **kwargs})
    return _front_end(framework)(query, key, value, **kwargs)


def framework_of_arguments(caller: str, query, named: dict) -> str:
    """'torch' or 'jax': the framework of `query`, which every array in `named` must share.

    Raises:
      TypeError: ``query`` is neither a torch tensor nor a jax array, or an argument in `named`
        belongs to the other framework (naming it and the conversion to use).
    """
    framework = _framework_of(query)
    if framework is None:
        raise TypeError(
            f"{caller}: query must be a torch.Tensor or a jax.Array, "
            f"got {type(query).__module__}.{type(query).__qualname__}")
    foreign = []
    for name, x in named.items():   # (a plain loop: torch.compile traces it without a graph break)
        fw = _framework_of(x)
        if fw is not None and fw != framework:
            foreign.append(f"{name} ({fw})")
    if foreign:
        other = "jax_to_torch" if framework == "torch" else "torch_to_jax"
        raise TypeError(
            f"{caller}: query is a {framework} array but "
            f"{', '.join(foreign)} {'is' if len(foreign) == 1 else 'are'} not; "
            f"all array arguments must belong to one framework (convert with "
            f"dualattn.interop.{other})")
    return framework
