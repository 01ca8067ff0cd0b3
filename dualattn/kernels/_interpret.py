"""A second, interpreted copy of the kernel modules, chosen per launch.

Triton decides at decoration time whether `@triton.jit` builds a compiled or an
interpreted kernel (TRITON_INTERPRET).  Users must not have to set that variable, so
we import this package a second time, under the name `_dualattn_interpreted`, with
TRITON_INTERPRET=1 set only for the duration of that import.  Both copies come from
the same source files; relative imports inside the package keep the interpreted
kernels calling interpreted helpers.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from types import ModuleType

# Triton itself must be imported (compiled mode) before TRITON_INTERPRET is set below,
# or its own library functions would be built as interpreted ones for every later user.
import triton  # noqa: F401
import triton.language  # noqa: F401

# Gluon too, before any interpreted launch.  While an interpreted kernel runs, Triton's interpreter
# patches triton.language's builtins, and its argument specialisation imports Gluon lazily on the
# first launch of a process; imported then, Gluon wraps the patched functions for good
# (gl.exp2 = builtin(tl.math.exp2)) and every Gluon kernel compiled later in the process fails
# ("Did you forget to add @triton.gluon.jit ?", Triton 3.7).
for _gluon in ("triton.experimental.gluon.language", "triton.experimental.gluon.nvidia.hopper"):
    try:
        importlib.import_module(_gluon)
    except ImportError:  # a Triton without that module: nothing of it to wrap
        pass

_PACKAGE = "_dualattn_interpreted"
_HERE = os.path.dirname(os.path.abspath(__file__))
_LOCK = threading.Lock()

# Triton's interpreter patches triton.language module-wide while a kernel runs, so two
# interpreted launches at once (jax's per-shard callbacks under shard_map run in parallel
# threads, torch and jax launches in threads of one process) corrupt each other: every
# interpreted launch holds this lock.
LAUNCH_LOCK = threading.Lock()


def _squeeze_scalars_to_index() -> None:
    """Triton 3.6's interpreter turns a scalar tensor into a Python int (a `range` bound, e.g. the
    kernels' `tl.range(lo, hi)`) with `int(array)` on its 1-element array, which NumPy >= 2.4
    refuses for arrays of more than 0 dimensions; Triton 3.7 squeezes the array first.  Do the
    same on 3.6 (`_patch_lang_tensor` is the function its launches call to patch tl.tensor)."""
    from triton.runtime import interpreter
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_scalars", False):
        return

    def patch_squeezing(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))
    patch_squeezing.squeezes_scalars = True
    interpreter._patch_lang_tensor = patch_squeezing


if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
    _squeeze_scalars_to_index()


def _import_interpreted(submodule: str) -> ModuleType:
    with _LOCK:
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            if _PACKAGE not in sys.modules:
                spec = importlib.util.spec_from_file_location(
                    _PACKAGE, os.path.join(_HERE, "__init__.py"), submodule_search_locations=[_HERE])
                pkg = importlib.util.module_from_spec(spec)
                sys.modules[_PACKAGE] = pkg
                spec.loader.exec_module(pkg)
            return importlib.import_module(f"{_PACKAGE}.{submodule}")
        finally:
            if old is None:
                os.environ.pop("TRITON_INTERPRET", None)
            else:
                os.environ["TRITON_INTERPRET"] = old


def kernel(submodule: str, name: str, *, interpret: bool):
    """The kernel `name` of `dualattn.kernels.<submodule>`, compiled or interpreted."""
    if interpret:
        module = _import_interpreted(submodule)
    else:
        module = importlib.import_module(f"{__package__}.{submodule}")
    return getattr(module, name)
