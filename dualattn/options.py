"""Static attention options, canonicalised once and shared by every front end.

`FlashOptions` is frozen and hashable: it is the one static argument of the JAX
custom_vjp core, and it is flattened to primitive fields at the torch.library
boundary.  All mask rules are expressed through it:

    query row i may attend key column j  iff  (with d = kpos(j) - qpos(i))
        window_left  is None or d >= -window_left
        window_right is None or d <=  window_right

where by default qpos(i) = i + (Sk - Sq) and kpos(j) = j (bottom-right alignment,
as in flash-attn >= 2.1).  `causal=True` is exactly `window_right = 0`:

    causal, Sq=2, Sk=5          window (1, 0), Sq=Sk=4
        k: 0 1 2 3 4                k: 0 1 2 3
    q0     1 1 1 1 0            q0     1 0 0 0
    q1     1 1 1 1 1            q1     1 1 0 0
                                q2     0 1 1 0
                                q3     0 0 1 1
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional, Tuple, Union

Window = Union[None, int, Tuple[Optional[int], Optional[int]]]


def dropout_threshold(dropout_prob: float) -> int:
    """The 32-bit threshold of the dropout hash (kernels/flash/rules.dropout_keep): an entry is kept
    iff its hash, uniform on [0, 2**32), is >= round(p * 2**32) (at most 2**32 - 1).  A threshold of
    1 (p below 3.5e-10) is taken as 0, keeping everything: jax-triton turns an int argument equal to
    1 into a constexpr, which the kernels cannot bitcast."""
    threshold = min(int(round(float(dropout_prob) * (1 << 32))), (1 << 32) - 1)
    return 0 if threshold == 1 else threshold


@dataclasses.dataclass(frozen=True)
class FlashOptions:
    """Canonical static options of one attention call (no tensors)."""

    softmax_scale: float
    window_left: Optional[int] = None   # None: unbounded to the left
    window_right: Optional[int] = None  # None: unbounded to the right; 0: causal
    logits_soft_cap: Optional[float] = None
    dropout_prob: float = 0.0

    def __post_init__(self):
        if not (self.softmax_scale > 0 and math.isfinite(self.softmax_scale)):
            raise ValueError(f"softmax_scale must be a finite positive float, got {self.softmax_scale}")
        for name in ("window_left", "window_right"):
            w = getattr(self, name)
            if w is not None and (not isinstance(w, int) or w < 0):
                raise ValueError(f"sliding_window: {name} must be a non-negative int or None, got {w!r}")
        cap = self.logits_soft_cap
        if cap is not None and not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"logits_soft_cap must be a finite positive float or None, got {cap}")
        if not (0.0 <= self.dropout_prob < 1.0):
            raise ValueError(f"dropout_prob must be in [0, 1), got {self.dropout_prob}")

    @property
    def causal(self) -> bool:
        return self.window_right == 0

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @classmethod
    def build(cls, *, head_dim: int, softmax_scale=None, causal=False, sliding_window: Window = None,
              logits_soft_cap=None, dropout_prob=0.0) -> "FlashOptions":
        """Canonicalise user-facing options (the public keyword names) into FlashOptions."""
        scale = head_dim ** -0.5 if softmax_scale is None else _real("softmax_scale", softmax_scale)
        left, right = canonical_window(sliding_window, causal)
        cap = None if logits_soft_cap is None else _real("logits_soft_cap", logits_soft_cap)
        cap = None if cap == 0.0 else cap
        return cls(softmax_scale=scale, window_left=left, window_right=right,
                   logits_soft_cap=cap, dropout_prob=float(dropout_prob))


def _real(name: str, value) -> float:
    """A float option given as a number (a python, numpy or 0-d array scalar), never a string, which
    float() would parse ("0.5") or reject without naming the argument."""
    if isinstance(value, (str, bytes, bool)) or type(value).__name__ == "bool_":
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a float, got {type(value).__name__} {value!r}") from e


# A window side this wide or wider reaches past any sequence the int32 positions of the kernels can
# index: it is unbounded (and a wider int could not be passed to an int32 kernel argument).
UNBOUNDED_WINDOW = 2 ** 31 - 1


def _is_int(w) -> bool:
    return isinstance(w, numbers.Integral) and not isinstance(w, bool) and type(w).__name__ != "bool_"


def canonical_window(sliding_window: Window, causal: bool) -> Tuple[Optional[int], Optional[int]]:
    """int w -> (w, w); (l, r) kept (a negative side or None means unbounded); causal forces right = 0.
    A side of UNBOUNDED_WINDOW or more is unbounded."""
    if sliding_window is None:
        left, right = None, None
    elif _is_int(sliding_window):
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {sliding_window}")
        left, right = int(sliding_window), int(sliding_window)
    elif isinstance(sliding_window, (tuple, list)) and len(sliding_window) == 2:
        left, right = sliding_window
        for side, w in (("left", left), ("right", right)):
            if w is not None and not _is_int(w):
                raise TypeError(f"sliding_window {side} must be an int or None, got {w!r}")
        # flash-attn spells "unbounded" as -1; any other negative is an error.
        if left is not None and left < -1 or right is not None and right < -1:
            raise ValueError(f"sliding_window sides must be >= 0 (or -1/None for unbounded), got {sliding_window}")
        left = None if left is None or left < 0 else int(left)
        right = None if right is None or right < 0 else int(right)
    else:
        raise TypeError(f"sliding_window must be None, an int or a (left, right) pair, got {sliding_window!r}")
    left = None if left is not None and left >= UNBOUNDED_WINDOW else left
    right = None if right is not None and right >= UNBOUNDED_WINDOW else right
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right
