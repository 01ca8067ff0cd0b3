"""The float64 references the tests compare against: they live in dualattn.testing.reference, so the
installed fuzz command (python -m dualattn.fuzz) uses the very same ones."""
from dualattn.testing.reference import (assert_close_rel, dropout_keep_reference,  # noqa: F401
                                        numpy_reference_with_grads, reference_attention, reference_varlen,
                                        relative_error)
