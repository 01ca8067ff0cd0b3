"""JAX front end: backend="triton" (the shared Triton kernels), "xla", "pallas", "auto"."""
from .flash import BACKENDS, flash_attention, flash_attention_varlen  # noqa: F401

__all__ = ["flash_attention", "flash_attention_varlen", "BACKENDS"]
