"""Drop-in use of dualattn from other libraries: `dualattn.integrations.transformers.register()`."""
