"""Decode over a KV cache (flash_attn_with_kvcache), dense and paged, in torch and JAX.

    kernels/      the Triton sources: split-KV attention, the combine, the append (+ rotary)
    plan.py       argument checks, DecodeOptions, tiles and split count, the Launch descriptions
    reference.py  float64 NumPy reference (tests)
    torch.py      torch.library custom ops  -> dualattn.torch_api.flash_attn_with_kvcache
    jax.py        functional JAX (triton / xla backends) -> dualattn.jax_api.flash_attn_with_kvcache

Importing this package imports neither torch nor jax.
"""
