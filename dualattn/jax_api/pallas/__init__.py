"""Pallas TPU backend of `dualattn.jax_api.flash_attention` (interpret mode off-TPU)."""
from .flash import BlockSizes, check_pallas_supported, flash_attention_pallas, resolve_interpret

__all__ = ["BlockSizes", "check_pallas_supported", "flash_attention_pallas", "resolve_interpret"]
