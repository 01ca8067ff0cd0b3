"""dualattn: one set of Triton attention kernels for PyTorch and JAX.

`import dualattn` needs neither torch nor jax; the front ends live in
`dualattn.torch_api` and `dualattn.jax_api` and import their framework on use.
"""
from .options import FlashOptions, canonical_window
from .sparse import SparseMask
from .ring import ring_permutation

__version__ = "0.1.0"

__all__ = ["FlashOptions", "SparseMask", "canonical_window", "flash_attention", "ring_permutation",
           "attention", "Attention", "MaskInfo", "__version__"]


def flash_attention(query, key, value, **kwargs):
    """Framework-agnostic entry: torch tensors in -> torch out, jax arrays in -> jax out."""
    from .interop import dispatch_flash_attention
    return dispatch_flash_attention(query, key, value, **kwargs)


def __getattr__(name):
    # The module entry (dualattn/module.py) on first use: `import dualattn` stays light.
    if name in ("attention", "Attention", "MaskInfo"):
        from . import module
        return getattr(module, name)
    raise AttributeError(f"module 'dualattn' has no attribute {name!r}")
