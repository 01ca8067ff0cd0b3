"""What the smoke tests share: they run where only one framework is installed (tests/reference.py and
tests/conftest.py need torch), so their float64 reference is NumPy's."""
from __future__ import annotations

import importlib
import importlib.util
import re

import numpy as np
import pytest


def attention_with_grads(query, key, value, dout, causal: bool):
    """out (B, Sq, H, D) and the gradients (dquery, dkey, dvalue) of sum(out * dout), all float64."""
    q, k, v, do = (np.asarray(x, dtype=np.float64).transpose(0, 2, 1, 3) for x in (query, key, value, dout))
    sq, sk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5
    s = q @ k.swapaxes(-1, -2) * scale                                            # [B, H, Sq, Sk]
    if causal:
        s = np.where(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + sk - sq, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dp = do @ v.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    grads = (ds @ k, ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ do)
    return (p @ v).transpose(0, 2, 1, 3), tuple(g.transpose(0, 2, 1, 3) for g in grads)


def relative_error(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def check_front_end_import(front_end: str, framework: str, extra: str) -> None:
    """`import front_end` works where `framework` is installed, and elsewhere raises an ImportError
    naming the extra that installs it."""
    if importlib.util.find_spec(framework) is not None:
        importlib.import_module(front_end)
        return
    with pytest.raises(ImportError, match=re.escape(f"pip install 'dualattn[{extra}]'")):
        importlib.import_module(front_end)
