"""The error a front end raises when its framework is not installed: it names the extra that installs it."""
from __future__ import annotations

# front end -> (the framework, as users know it; the pyproject extra(s) that install it)
_EXTRAS = {
    "dualattn.jax_api": ("JAX", "'dualattn[jax]' (on a GPU: 'dualattn[jax-gpu]')"),
    "dualattn.torch_api": ("PyTorch", "'dualattn[torch]'"),
}


def framework_missing(front_end: str, error: ImportError) -> ImportError:
    """ImportError for `import <front_end>` without its framework; `error` is the framework's own."""
    framework, extra = _EXTRAS[front_end]
    return ImportError(f"{front_end} needs {framework}, which could not be imported ({error}): "
                       f"pip install {extra}")
