"""Which assembler turns the Triton kernels' PTX into SASS on the JAX path.

torch's Triton assembles a kernel with the ptxas it bundles (CUDA 12.8 with Triton 3.6). jaxlib
hands the same PTX to the first `ptxas` on PATH, else to the CUDA toolkit's (possibly a newer
CUDA's): XLA's subprocess compilation searches PATH before the CUDA roots, and jaxlib's Triton
custom call takes no cubin. The two builds can give different SASS for the same PTX, and a kernel
then runs at another speed under JAX than under torch (docs/lessons.md, "The same PTX, another
assembler").

`use_triton_ptxas()` puts a small `ptxas` first on PATH that sends the PTX of dualattn's kernels
to Triton's ptxas and everything else, XLA's own kernels included, to the ptxas jaxlib would have
run anyway. (Triton's ptxas alone first on PATH is not enough: XLA's PTX asks for a newer PTX ISA
than CUDA 12.8 accepts.) It is opt-in, or DUALATTN_JAX_PTXAS=triton, applied at the
first Triton launch from JAX, because it changes PATH for the whole process.
"""
from __future__ import annotations

import atexit
import os
import shlex
import shutil
import tempfile
from typing import Iterable, Optional

ENV = "DUALATTN_JAX_PTXAS"   # "triton": use_triton_ptxas() at the first Triton launch; "xla" / unset: leave PATH
_PREFIX = "dualattn-ptxas-"  # the router's directory


def triton_ptxas(arch: int = 90) -> str:
    """The ptxas torch's Triton uses for sm_<arch> (Triton 3.6 and 3.7 alike)."""
    from triton.backends.nvidia.compiler import get_ptxas
    return get_ptxas(arch).path


def kernel_names() -> tuple:
    """The entry names of dualattn's Triton kernels (what the router looks for in a PTX file): every
    `*_kernel` JIT function of a module under dualattn/kernels (flash, nsa, ...)."""
    import importlib
    import pathlib

    import triton
    from .. import kernels
    root = pathlib.Path(kernels.__file__).parent
    names = set()
    for path in sorted(p for p in root.rglob("*.py") if p.name != "__init__.py"):
        module = importlib.import_module(".".join((kernels.__name__,) + path.relative_to(root).with_suffix("").parts))
        names.update(name for name, obj in vars(module).items()
                     if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"))
    return tuple(sorted(names))


def default_ptxas(path: Optional[str] = None) -> Optional[str]:
    """The ptxas jaxlib runs without us: the first on PATH, else XLA's CUDA roots (the CUDA
    toolkit, then the pip CUDA wheel next to jaxlib's plugin)."""
    path = path if path is not None else os.environ.get("PATH", "")
    # Not a router (ours, or one a parent process put on the PATH we inherited: it goes when it exits).
    path = os.pathsep.join(p for p in path.split(os.pathsep) if not os.path.basename(p).startswith(_PREFIX))
    found = shutil.which("ptxas", path=path)
    if found:
        return found
    roots = [os.environ.get("TF_CUDA_TOOLKIT_PATH"), "/usr/local/cuda", "/opt/cuda"]
    try:
        import nvidia   # the pip CUDA wheels' namespace package (nvidia/cu13/bin/ptxas, ...)
        roots += [os.path.join(p, sub) for p in nvidia.__path__ for sub in ("cu13", "cuda_nvcc")]
    except ImportError:
        pass
    for root in filter(None, roots):
        candidate = os.path.join(root, "bin", "ptxas")
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def write_router(directory: str, ours: str, theirs: str, names: Iterable[str]) -> str:
    """Write `directory`/ptxas: a POSIX shell script that runs Triton's ptxas ($TRITON_PTXAS_PATH if
    set, else `ours`) on a PTX file defining one of the entries `names`, and `theirs` on everything
    else (`--version` included, so XLA sees the version it would have seen). Returns its path."""
    pattern = r"\.entry (" + "|".join(sorted(names)) + r")\("
    # Triton's own choice, made again per call: TRITON_PTXAS_PATH when it names a program, else
    # `ours` (Triton's bundled one). torch.compile sets TRITON_PTXAS_PATH to torch's ptxas the first
    # time it compiles, after which Triton writes PTX for that ptxas (ISA 9.0, which the bundled
    # 12.8 rejects).
    script = ("#!/bin/sh\n"
              "# Written by dualattn.jax_api.ptxas: dualattn's Triton kernels go to Triton's ptxas, the rest to\n"
              "# the ptxas jaxlib would have run.\n"
              f'ours={shlex.quote(ours)}\n'
              'if [ -n "$TRITON_PTXAS_PATH" ] && [ -x "$TRITON_PTXAS_PATH" ]; then ours="$TRITON_PTXAS_PATH"; fi\n'
              'for arg in "$@"; do\n'
              f'  if [ -f "$arg" ] && grep -q -E {shlex.quote(pattern)} "$arg"; then exec "$ours" "$@"; fi\n'
              "done\n"
              f'exec {shlex.quote(theirs)} "$@"\n')
    path = os.path.join(directory, "ptxas")
    with open(path, "w") as f:
        f.write(script)
    os.chmod(path, 0o755)
    return path


_ROUTER_DIR: Optional[str] = None


def use_triton_ptxas(arch: int = 90) -> str:
    """Let jaxlib assemble dualattn's Triton kernels with Triton's own ptxas, as torch does, so both
    frameworks run the same SASS; other PTX keeps its assembler. Puts a router first on PATH and
    returns its path. Call it before the first GPU launch: jaxlib assembles each kernel once per
    process, and kernels already assembled keep their SASS."""
    global _ROUTER_DIR
    if _ROUTER_DIR is not None:
        return os.path.join(_ROUTER_DIR, "ptxas")
    theirs = default_ptxas()
    if theirs is None:
        raise RuntimeError("dualattn: no ptxas for XLA's own kernels was found (PATH, the CUDA toolkit, the pip "
                           "CUDA wheel); Triton's cannot assemble them")
    directory = tempfile.mkdtemp(prefix=_PREFIX)
    atexit.register(shutil.rmtree, directory, True)
    router = write_router(directory, triton_ptxas(arch), theirs, kernel_names())
    os.environ["PATH"] = os.pathsep.join([directory] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p])
    _ROUTER_DIR = directory
    return router


def apply_env(arch: int) -> None:
    """Honour DUALATTN_JAX_PTXAS (the JAX launcher calls this before its first Triton launch)."""
    from .. import switches
    value = switches.current().get(ENV) or ""
    choice = value.strip().lower()
    if choice == "triton":
        use_triton_ptxas(arch)
    elif choice not in ("", "xla"):
        raise ValueError(f"{ENV}={value!r}: expected 'triton' (Triton's ptxas for dualattn's kernels) "
                         "or 'xla' (jaxlib's choice, the default)")
