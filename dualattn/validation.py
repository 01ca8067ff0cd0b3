"""Argument checking shared by the torch and JAX front ends.

Works on anything with `.shape` and `.dtype` (torch tensors, jax arrays and tracers,
numpy arrays), so both frameworks raise the same `ValueError`/`TypeError`, naming the
argument and the expected shape, before any kernel launch.
"""
from __future__ import annotations

import dataclasses
import numbers
import operator
from typing import Any, Optional

FLOAT_DTYPES = ("float16", "bfloat16", "float32")
INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def dtype_name(x: Any) -> str:
    """'bfloat16' for torch.bfloat16, jnp.bfloat16, np.dtype('bfloat16') alike."""
    return str(getattr(x, "dtype", x)).replace("torch.", "")


def _shape(x) -> tuple:
    return tuple(int(s) for s in x.shape)


@dataclasses.dataclass(frozen=True)
class FlashShapes:
    """Problem sizes of one flash_attention call, as the kernels and launch plans see them.

    For varlen calls `batch` is the number of sequences, `seqlen_q`/`seqlen_k` are the
    max_seqlen bounds and `total_q`/`total_k` the packed token counts.
    """

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str
    varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    num_sinks: int = 0
    sinks_per_head: bool = False   # softmax_aux is (Hq, n) or (Hq,), not shared by all heads
    has_bias: bool = False
    bias_dtype: str = ""    # (what the kernels read per score; "" where unknown)
    bias_bcast_batch: bool = False
    bias_bcast_head: bool = False
    has_mask: bool = False
    mask_bcast_batch: bool = False
    mask_bcast_head: bool = False
    has_segments: bool = False
    # varlen: the host checked the tables and every packed query row lies in a sequence (cu_seqlens_q[-1]
    # == total_q), so the forward writes every row of out and lse and neither needs a fill beforehand.
    queries_covered: bool = False

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv


def _check_float(name, x, dtype=None):
    d = dtype_name(x)
    if d not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {d}")
    if dtype is not None and d != dtype:
        raise TypeError(f"{name} dtype {d} must match query dtype {dtype}")


def _check_4d_map(name, x, batch, heads, sq, sk):
    shape = _shape(x)
    ok = (len(shape) == 4 and shape[0] in (1, batch) and shape[1] in (1, heads)
          and shape[2] == sq and shape[3] == sk)
    if not ok:
        raise ValueError(f"{name} must have shape ({batch} or 1, {heads} or 1, {sq}, {sk}), got {shape}")
    return shape


def check_flash_args(query, key, value, *, bias=None, attention_mask=None, q_segment_ids=None,
                     kv_segment_ids=None, softmax_aux=None, cu_seqlens_q=None, cu_seqlens_k=None,
                     max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None) -> FlashShapes:
    """Validate the tensors of a flash_attention call and return its sizes.

    Dense: query (B, Sq, Hq, D), key (B, Sk, Hkv, D), value (B, Sk, Hkv, Dv).
    Varlen (cu_seqlens given): query (total_q, Hq, D), key/value (total_k, Hkv, D/Dv).
    """
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    rank = 3 if varlen else 4
    layout = "(total, heads, head_dim)" if varlen else "(batch, seq_len, heads, head_dim)"
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(x.shape) != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {_shape(x)}")
    _check_float("query", query)
    dtype = dtype_name(query)
    _check_float("key", key, dtype)
    _check_float("value", value, dtype)
    qs, ks, vs = _shape(query), _shape(key), _shape(value)
    hq, d = qs[-2], qs[-1]
    hkv, dk = ks[-2], ks[-1]
    if ks[:-1] != vs[:-1]:
        raise ValueError(f"key {ks} and value {vs} must agree in all but the last dimension")
    if dk != d:
        raise ValueError(f"key head_dim {dk} must equal query head_dim {d}")
    dv = vs[-1]
    for name, dim in (("query/key head_dim", d), ("value head_dim", dv)):
        if not MIN_HEAD_DIM <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {dim}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hkv} (GQA/MQA)")

    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if len(cu.shape) != 1 or cu.shape[0] < 2:
                raise ValueError(f"{name} must be 1-D (n_seqs + 1,), got shape {_shape(cu)}")
            if dtype_name(cu) != "int32":
                raise TypeError(f"{name} must be int32, got {dtype_name(cu)}")
        if cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0]:
            raise ValueError(f"cu_seqlens_q {_shape(cu_seqlens_q)} and cu_seqlens_k {_shape(cu_seqlens_k)} "
                             "must have the same length (n_seqs + 1)")
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if m is None:
                raise ValueError(f"{name} must be a positive int for varlen inputs, got None")
            try:   # an int or what stands for one (numpy ints); never a float, a string or a bool
                if type(m).__name__ in ("bool", "bool_"):
                    raise TypeError
                index = operator.index(m)
            except TypeError:
                raise TypeError(f"{name} must be an int, got {type(m).__name__} {m!r}") from None
            if index < 1:
                raise ValueError(f"{name} must be a positive int for varlen inputs, got {m!r}")
        for name, x in (("bias", bias), ("attention_mask", attention_mask),
                        ("q_segment_ids", q_segment_ids), ("kv_segment_ids", kv_segment_ids)):
            if x is not None:
                raise ValueError(f"{name} is not supported with varlen (cu_seqlens) inputs")
        batch, sq, sk = int(cu_seqlens_q.shape[0]) - 1, int(max_seqlen_q), int(max_seqlen_k)
        total_q, total_k = qs[0], ks[0]
    else:
        if max_seqlen_q is not None or max_seqlen_k is not None:
            raise ValueError("max_seqlen_q/max_seqlen_k are only meaningful with cu_seqlens_q/cu_seqlens_k")
        batch, sq, sk = qs[0], qs[1], ks[1]
        if ks[0] != batch:
            raise ValueError(f"key batch {ks[0]} must equal query batch {batch}")
        total_q = total_k = 0

    info = dict(batch=batch, seqlen_q=sq, seqlen_k=sk, heads_q=hq, heads_kv=hkv, head_dim=d,
                head_dim_v=dv, dtype=dtype, varlen=varlen, total_q=total_q, total_k=total_k)

    if bias is not None:
        _check_float("bias", bias)
        bs = _check_4d_map("bias", bias, batch, hq, sq, sk)
        info.update(has_bias=True, bias_dtype=dtype_name(bias), bias_bcast_batch=bs[0] == 1 and batch != 1,
                    bias_bcast_head=bs[1] == 1 and hq != 1)
    if attention_mask is not None:
        md = dtype_name(attention_mask)
        if md != "bool" and md not in INT_DTYPES:
            raise TypeError(f"attention_mask must be bool or an integer dtype, got {md}")
        ms = _check_4d_map("attention_mask", attention_mask, batch, hq, sq, sk)
        info.update(has_mask=True, mask_bcast_batch=ms[0] == 1 and batch != 1,
                    mask_bcast_head=ms[1] == 1 and hq != 1)
    if q_segment_ids is not None or kv_segment_ids is not None:
        if q_segment_ids is None or kv_segment_ids is None:
            if sq != sk:
                raise ValueError("q_segment_ids and kv_segment_ids must both be given when Sq != Sk "
                                 f"(Sq={sq}, Sk={sk})")
        for name, ids, s in (("q_segment_ids", q_segment_ids, sq), ("kv_segment_ids", kv_segment_ids, sk)):
            if ids is None:
                continue
            if dtype_name(ids) not in INT_DTYPES:
                raise TypeError(f"{name} must be an integer array, got {dtype_name(ids)}")
            if _shape(ids) != (batch, s):
                raise ValueError(f"{name} must have shape ({batch}, {s}), got {_shape(ids)}")
        info.update(has_segments=True)
    if softmax_aux is not None:
        _check_float("softmax_aux", softmax_aux)
        ss = _shape(softmax_aux)
        if len(ss) == 2:
            if ss[0] != hq or ss[1] < 1:
                raise ValueError(f"softmax_aux must have shape ({hq}, n), ({hq},) or (n,), got {ss}")
            info.update(num_sinks=ss[1], sinks_per_head=True)
        elif len(ss) == 1 and ss[0] >= 1:
            per_head = ss[0] == hq
            info.update(num_sinks=1 if per_head else ss[0], sinks_per_head=per_head)
        else:
            raise ValueError(f"softmax_aux must have shape ({hq}, n), ({hq},) or (n,), got {ss}")
    return FlashShapes(**info)


def segment_id_dtype(*dtypes) -> str:
    """The dtype segment ids run as in the kernels: "int32" when every given dtype's values fit it
    exactly, else "int64" (int64, uint32, uint64 ids: the kernels compare 64-bit ids rather than
    narrow them, so ids 0 and 2**32 stay different).  uint64 ids are reinterpreted as int64 bit for
    bit, which keeps equality."""
    names = {dtype_name(d) for d in dtypes if d is not None}
    return "int64" if names & {"int64", "uint32", "uint64"} else "int32"


def check_flag(name: str, value) -> bool:
    """A boolean option (causal, return_lse, ...): a bool or a numpy bool, never a string or a number,
    which would be read by truthiness (causal="False" would run causal)."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def check_dropout(dropout_prob, dropout_seed):
    if isinstance(dropout_prob, (bool, str)) or not isinstance(dropout_prob, numbers.Real):
        raise TypeError(f"dropout_prob must be a float, got {type(dropout_prob).__name__} {dropout_prob!r}")
    if not 0.0 <= float(dropout_prob) < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1), got {dropout_prob}")
    if dropout_seed is None or isinstance(dropout_seed, numbers.Integral) and not isinstance(dropout_seed, bool):
        return
    if hasattr(dropout_seed, "shape") and hasattr(dropout_seed, "dtype") and dtype_name(dropout_seed) != "bool":
        return  # an array (a traced jax seed): its dtype and shape are checked by the front end
    raise TypeError(f"dropout_seed must be an int or None, got {type(dropout_seed).__name__} {dropout_seed!r}")


def check_cu_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                            max_seqlen_k: int) -> None:
    """Check the values of concrete cu_seqlens (python/numpy sequences) before any launch.

    Called by the front ends whenever the values are known on the host (not for traced JAX
    values or inside torch.compile): a bad table would make the kernels read out of bounds.
    Returns whether every query row lies in a sequence (FlashShapes.queries_covered).
    """
    for name, cu, total, max_len, max_name in (
            ("cu_seqlens_q", list(cu_seqlens_q), total_q, max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", list(cu_seqlens_k), total_k, max_seqlen_k, "max_seqlen_k")):
        if cu[0] != 0:
            raise ValueError(f"{name} must start at 0, got {cu[0]}")
        lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {cu}")
        if cu[-1] > total:
            raise ValueError(f"{name}[-1] = {cu[-1]} exceeds the {total} packed tokens of the "
                             f"{'query' if name.endswith('q') else 'key/value'} tensor")
        if lengths and max(lengths) > int(max_len):
            raise ValueError(f"{max_name} = {max_len} is smaller than the longest sequence ({max(lengths)})")
    return int(cu_seqlens_q[-1]) == total_q


def check_positions(q_positions, kv_positions, batch: int, seqlen_q: int, seqlen_k: int) -> None:
    """q_positions (B, Sq) / kv_positions (B, Sk) integer arrays; either may be None (default positions)."""
    for name, pos, s in (("q_positions", q_positions, seqlen_q), ("kv_positions", kv_positions, seqlen_k)):
        if pos is None:
            continue
        if dtype_name(pos) not in INT_DTYPES:
            raise TypeError(f"{name} must be an integer array, got {dtype_name(pos)}")
        if _shape(pos) != (batch, s):
            raise ValueError(f"{name} must have shape ({batch}, {s}), got {_shape(pos)}")
