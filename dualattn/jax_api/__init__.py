"""JAX front end: backend="triton" (the shared Triton kernels), "xla", "pallas", "auto"."""
from .._extras import framework_missing

try:
    import jax  # noqa: F401
except ImportError as error:
    raise framework_missing(__name__, error) from error

from . import _autotune  # noqa: F401  (registers the autotuner with flash)
from .blocksparse import blocksparse_attention  # noqa: F401
from ..decode.jax import flash_attn_with_kvcache  # noqa: F401
from .flash import BACKENDS, flash_attention, flash_attention_varlen  # noqa: F401
from .nn import dot_product_attention  # noqa: F401
from .nsa import apply_native_sparse_attention, native_sparse_attention  # noqa: F401
from .ptxas import use_triton_ptxas  # noqa: F401
from .ring import ring_attention  # noqa: F401

__all__ = ["blocksparse_attention", "flash_attention", "flash_attention_varlen", "BACKENDS", "use_triton_ptxas",
           "ring_attention", "dot_product_attention", "apply_native_sparse_attention", "native_sparse_attention",
           "flash_attn_with_kvcache"]
