"""The tensors of a valid configuration, drawn from its own generator, and the mask the reference sees.

Everything is made on the host in torch (the dtype rounding done once), so the kernels, the float64
reference and the jax front end all see the very same values.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np
import torch

from .. import SparseMask, masks


@dataclasses.dataclass
class Inputs:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    tensors: dict            # the other tensor arguments of the call (bias, softmax_aux, masks, ids, ...)
    dout: torch.Tensor
    dlse: Optional[torch.Tensor]
    layout: Optional[SparseMask] = None
    reference_mask: Optional[torch.Tensor] = None   # blocksparse: the token mask its blocks imply


def _randn(rng, shape, dtype, scale=1.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale).astype(np.float32)).to(getattr(torch, dtype))


def cu_seqlens(lengths) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def sink_values(c: dict) -> Optional[torch.Tensor]:
    s = c.get("softmax_aux")
    if s is None:
        return None
    return torch.tensor([float(x) for x in s["values"]], dtype=torch.float32).reshape(s["shape"])


def _segment_ids(rng, c: dict, batch: int, length: int) -> torch.Tensor:
    s = c["segments"]
    ids = rng.integers(0, s["n_docs"], (batch, length))
    if s["sorted"]:
        ids = np.sort(ids, axis=1)
    if s["wide"] and s["dtype"] == "int64":
        ids = ids * (2 ** 32) - 2 ** 40   # equal modulo 2**32: narrowing would merge documents
    return torch.from_numpy(ids.astype(np.int64)).to(getattr(torch, s["dtype"]))


def _attention_mask(rng, c: dict) -> torch.Tensor:
    m = c["attention_mask"]
    allowed = rng.random((m["batch"], m["heads"], c["Sq"], c["Sk"])) < m["keep"]
    if m["dead_rows"] and c["Sq"]:
        allowed[..., rng.integers(0, c["Sq"], max(1, c["Sq"] // 8)), :] = False   # fully masked rows
    if m["dtype"] == "bool":
        return torch.from_numpy(allowed)
    # Nonzero = may attend; wide dtypes get values that truncate to 0 in 8 bits.
    hi = {"int8": 127, "uint8": 255, "int32": 4, "int64": 4}[m["dtype"]]
    values = rng.integers(1, hi + 1, allowed.shape)
    if m["dtype"] in ("int32", "int64"):
        values = values * 256
    return torch.from_numpy(np.where(allowed, values, 0)).to(getattr(torch, m["dtype"]))


def _block_map(rng, c: dict) -> np.ndarray:
    lay = c["layout"]
    bq, bk = lay["block_q"], lay["block_k"]
    nq, nk = -(-c["Sq"] // bq), -(-c["Sk"] // bk)
    shape = (lay["layout_batch"], lay["layout_heads"], nq, nk)
    builder = {"causal": masks.causal(), "local": masks.local(lay["window"]), "strided": masks.strided(lay["stride"]),
               "global": masks.global_tokens(lay["global_n"]),
               "union": masks.local(lay["window"]) | masks.global_tokens(lay["global_n"])}.get(lay["builder"])
    if builder is None:
        return rng.random(shape) < lay["density"]
    return np.broadcast_to(np.asarray(builder(lay["layout_batch"], lay["layout_heads"], c["Sq"], c["Sk"], bq, bk)),
                           shape).copy()


def make_inputs(rng: np.random.Generator, c: dict) -> Inputs:
    dtype = c["dtype"]
    if c["kind"] == "varlen":
        total_q = sum(c["lengths_q"]) + c["tail_q"]
        total_k = sum(c["lengths_k"]) + c["tail_k"]
        qshape, kshape = (total_q, c["Hq"]), (total_k, c["Hkv"])
    else:
        qshape, kshape = (c["B"], c["Sq"], c["Hq"]), (c["B"], c["Sk"], c["Hkv"])
    query = _randn(rng, qshape + (c["D"],), dtype)
    key = _randn(rng, kshape + (c["D"],), dtype)
    value = _randn(rng, kshape + (c["Dv"],), dtype)
    t = {}
    sinks = sink_values(c)
    if sinks is not None:
        t["softmax_aux"] = sinks
    if c.get("segments"):
        t["q_segment_ids"] = _segment_ids(rng, c, c["B"], c["Sq"])
        if c["segments"]["given"] == "both":
            t["kv_segment_ids"] = _segment_ids(rng, c, c["B"], c["Sk"])
    if c.get("attention_mask"):
        t["attention_mask"] = _attention_mask(rng, c)
    if c.get("bias"):
        b = c["bias"]
        t["bias"] = _randn(rng, (b["batch"], b["heads"], c["Sq"], c["Sk"]), b["dtype"], b["scale"])
    if c["kind"] == "varlen":
        t["cu_seqlens_q"], t["cu_seqlens_k"] = cu_seqlens(c["lengths_q"]), cu_seqlens(c["lengths_k"])
    out_shape = qshape + (c["Dv"],)
    dout = _randn(rng, out_shape, dtype)
    lse_shape = (c["Hq"], qshape[0]) if c["kind"] == "varlen" else (c["B"], c["Hq"], c["Sq"])
    dlse = _randn(rng, lse_shape, "float32") if c["lse_cotangent"] else None
    inputs = Inputs(query, key, value, t, dout, dlse)
    if c["kind"] == "blocksparse":
        lay = c["layout"]
        bm = _block_map(rng, c)
        inputs.layout = SparseMask.from_block_map(bm, lay["block_q"], lay["block_k"])
        token = np.repeat(np.repeat(bm, lay["block_q"], axis=2), lay["block_k"], axis=3)[..., :c["Sq"], :c["Sk"]]
        inputs.reference_mask = torch.from_numpy(np.ascontiguousarray(token))
    return inputs
