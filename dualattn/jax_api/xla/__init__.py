"""The "xla" backend: pure-JAX chunked online-softmax flash attention (custom_vjp, O(S) memory)."""
from .blocksparse import BlocksparseXlaConfig, blocksparse_attention_xla
from .flash import (XlaConfig, XlaGrads, flash_attention_backward_xla, flash_attention_varlen_xla,
                    flash_attention_xla)
from .nsa import selected_attention_xla

__all__ = ["XlaConfig", "XlaGrads", "flash_attention_xla", "flash_attention_backward_xla",
           "flash_attention_varlen_xla", "BlocksparseXlaConfig", "blocksparse_attention_xla"]
__all__ += ["selected_attention_xla"]
