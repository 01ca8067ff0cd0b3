"""flax.nnx modules over dualattn's kernels."""
from __future__ import annotations

from flax import nnx

from .nn import make_attention_fn


class MultiHeadAttention(nnx.MultiHeadAttention):
    """flax.nnx.MultiHeadAttention with dualattn's attention (`jax_api.nn.make_attention_fn`).

    Takes every argument of nnx.MultiHeadAttention (num_kv_heads for GQA included) and gives its
    result; `backend`, `sliding_window` and `logits_soft_cap` configure the attention (see
    make_attention_fn), and an explicit `attention_fn=` still wins.  Dropout runs on the kernels with
    broadcast_dropout=False (one mask per batch and head); nnx's default broadcast_dropout=True draws
    nnx's own (T, S) mask in nnx's own computation.
    """

    def __init__(self, *args, backend: str = "auto", sliding_window=None, logits_soft_cap=None,
                 attention_fn=None, **kwargs):
        if attention_fn is None:
            attention_fn = make_attention_fn(backend=backend, sliding_window=sliding_window,
                                             logits_soft_cap=logits_soft_cap)
        super().__init__(*args, attention_fn=attention_fn, **kwargs)
