"""PyTorch front end: torch.library ops + autograd over the shared Triton kernels."""
from .._extras import framework_missing

try:
    import torch  # noqa: F401
except ImportError as error:
    raise framework_missing(__name__, error) from error

from . import _autotune  # noqa: F401  (registers the autotuner with flash)
from .blocksparse import blocksparse_attention  # noqa: F401
from ..decode.torch import flash_attn_with_kvcache  # noqa: F401
from .flash import (dropout_keep_mask, flash_attention, flash_attn_varlen_func,  # noqa: F401
                    scaled_dot_product_attention)
from .modules import MultiheadAttention  # noqa: F401
from .nsa import apply_native_sparse_attention, native_sparse_attention  # noqa: F401
from .ring import ring_attention  # noqa: F401

__all__ = ["blocksparse_attention", "flash_attention", "flash_attn_varlen_func", "scaled_dot_product_attention",
           "dropout_keep_mask", "ring_attention", "MultiheadAttention", "apply_native_sparse_attention",
           "native_sparse_attention", "flash_attn_with_kvcache"]
