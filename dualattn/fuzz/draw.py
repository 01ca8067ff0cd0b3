"""Random configurations: plain JSON-able dicts drawn from a generator seeded by (seed, index).

A configuration says everything a run needs (sizes, dtype, options, which front ends and backends
run it); the tensors are drawn afterwards from their own generator of the same (seed, index), so
`--replay SEED:INDEX` rebuilds a failing case exactly.

    draw_config(seed, index, device)  -> a valid configuration (kind dense / varlen / blocksparse)
                                         or an invalid one (kind "invalid": a valid base + one mutation)
"""
from __future__ import annotations

import types
from typing import Optional

import numpy as np

from .invalid import MUTATIONS

DTYPES = ("float32", "float16", "bfloat16")
# The Triton interpreter runs on CPU: B * Hq * Sq * Sk * (D + Dv) stays under this many multiply-adds,
# so a configuration runs (forward and backward) in about a second.
CPU_WORK = 2 ** 18
# and B * Hq (the interpreter runs each (batch, head) program in turn: ~0.35 s forward and backward)
CPU_PROGRAMS = 4
GPU_WORK = 2 ** 33
HEAD_DIMS = (16, 24, 32, 40, 48, 64, 72, 80, 96, 112, 128, 160, 192, 256)
INVALID_FRACTION = 0.25


def rng_for(seed: int, index: int, stream: int) -> np.random.Generator:
    """The generator of one (seed, index): stream 0 draws the configuration, 1 its tensors."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(index), stream])


def _chance(rng, p: float) -> bool:
    return bool(rng.random() < p)


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def _length(rng, high: int) -> int:
    """A length in [1, high], log-uniform, so short and long both come up (mostly not powers of two)."""
    return int(min(high, max(1, round(np.exp(rng.uniform(0.0, np.log(high + 1)))))))


def _window(rng, sk: int):
    r = rng.random()
    if r < 0.35:
        return int(rng.integers(0, sk + 2))
    if r < 0.95:
        side = lambda: _pick(rng, [None, -1, int(rng.integers(0, sk + 2)), int(rng.integers(0, 8))])  # noqa: E731
        return [side(), side()]
    return [int(2 ** 40), 0]   # wider than int32: unbounded


def _sinks(rng, hq: int):
    shape = _pick(rng, [[hq], [hq, int(rng.integers(1, 4))], [_pick(rng, [1, 2, 3, 5])]])
    if shape == [1] and hq == 1:
        shape = [2]
    n = int(np.prod(shape))
    values = (rng.standard_normal(n) * 2.0).tolist()
    special = None
    if _chance(rng, 0.2):
        special = _pick(rng, ["-inf", "+inf", "-inf", "mixed"])
        for i in range(n):
            if special == "mixed" and _chance(rng, 0.5):
                values[i] = _pick(rng, [float("-inf"), float("inf")])
            elif special != "mixed" and _chance(rng, 0.6):
                values[i] = float(special)
    return {"shape": shape, "values": [repr(float(x)) for x in values]}   # repr: JSON has no inf


def _sizes(rng, device: str, kind: str) -> dict:
    cpu = device == "cpu"
    hkv = _pick(rng, [1, 1, 2] if cpu else [1, 2, 4, 8])
    hq = hkv * _pick(rng, [1, 1, 2, 3] if cpu else [1, 2, 4])
    d = _pick(rng, HEAD_DIMS[:9] if cpu and _chance(rng, 0.8) else HEAD_DIMS)
    if _chance(rng, 0.15):
        d = int(rng.integers(16, 257))   # any size in [16, 256]
    dv = d if _chance(rng, 0.75) else _pick(rng, [16, 32, 48, 64, 96, 128, int(rng.integers(16, 257))])
    b = _pick(rng, [1, 1, 2] if cpu else [1, 2, 4])
    max_len = 256 if cpu else 4096
    sq, sk = _length(rng, max_len), _length(rng, max_len)
    if _chance(rng, 0.3):
        sk = sq
    while cpu and b * hq > CPU_PROGRAMS:
        if b > 1:
            b -= 1
        else:
            hq = hkv = hkv if hkv * 2 <= hq else hkv // 2 or 1
    budget = CPU_WORK if cpu else GPU_WORK
    while b * hq * sq * sk * (d + dv) > budget:   # shrink the longest side until the work fits
        if sq >= sk and sq > 1:
            sq = max(1, sq * 2 // 3)
        elif sk > 1:
            sk = max(1, sk * 2 // 3)
        elif hq > 1:
            hq, hkv = hkv, hkv
        else:
            d = dv = 16
    if kind == "dense" and _chance(rng, 0.02):
        b, sq, sk = _pick(rng, [(0, sq, sk), (b, 0, sk), (b, sq, 0)])   # empty dimensions
    return dict(B=b, Sq=sq, Sk=sk, Hq=hq, Hkv=hkv, D=d, Dv=dv)


def _varlen(rng, c: dict, device: str) -> dict:
    n = int(rng.integers(1, 5))
    cap_q, cap_k = max(1, c["Sq"] // n + 1), max(1, c["Sk"] // n + 1)
    lq = [0 if _chance(rng, 0.15) else int(rng.integers(1, cap_q + 1)) for _ in range(n)]
    lk = [0 if _chance(rng, 0.1) else int(rng.integers(1, cap_k + 1)) for _ in range(n)]
    tail_q = int(rng.integers(1, 9)) if _chance(rng, 0.3) else 0   # tokens past cu_seqlens[-1]: in no sequence
    tail_k = int(rng.integers(1, 9)) if _chance(rng, 0.3) else 0
    slack = lambda: int(rng.integers(0, 5)) if _chance(rng, 0.3) else 0  # noqa: E731
    return dict(lengths_q=lq, lengths_k=lk, tail_q=tail_q, tail_k=tail_k,
                max_seqlen_q=max(1, max(lq) + slack()), max_seqlen_k=max(1, max(lk) + slack()))


def _layout(rng, c: dict, device: str) -> dict:
    blocks = [16, 32, 64] if device == "cpu" else [64, 128]
    bq, bk = _pick(rng, blocks), _pick(rng, blocks)
    lb = _pick(rng, [1, c["B"]])
    lh = _pick(rng, [1, c["Hq"]])
    builder = _pick(rng, ["random", "random", "causal", "local", "strided", "global", "union"])
    return dict(block_q=bq, block_k=bk, layout_batch=lb, layout_heads=lh, builder=builder,
                density=float(rng.uniform(0.1, 0.9)), window=int(rng.integers(0, 3 * max(bq, bk))),
                stride=int(rng.integers(1, 4)), global_n=int(rng.integers(0, 2 * bk)))


def layout_fits(c: dict, arch: Optional[int] = None, max_shared: Optional[int] = None) -> bool:
    """Whether the drawn layout's blocks launch on sm_<arch> in `max_shared` bytes (default: this
    GPU's): asked of the launchers' own check, kernels/flash/fit.py (which raises the ValueError naming
    `layout` where they do not), with stand-ins of the configuration's arrays.  Compiles, needs no GPU."""
    from ..kernels.flash import fit
    from ..kernels.flash import plan as flash_plan
    from ..kernels.launch import max_shared_memory, row_major_strides
    from ..options import FlashOptions
    from ..validation import check_flash_args
    if arch is None:
        import triton
        arch = int(triton.runtime.driver.active.get_current_target().arch)
    if max_shared is None:
        max_shared = max_shared_memory(0)
    array = lambda shape, dtype: types.SimpleNamespace(shape=tuple(shape), dtype=dtype)  # noqa: E731
    b, sq, sk, dtype = c["B"], c["Sq"], c["Sk"], c["dtype"]
    arrays = {"query": array((b, sq, c["Hq"], c["D"]), dtype), "key": array((b, sk, c["Hkv"], c["D"]), dtype),
              "value": array((b, sk, c["Hkv"], c["Dv"]), dtype)}
    if c.get("segments"):
        arrays["q_segment_ids"] = array((b, sq), c["segments"]["dtype"])
        arrays["kv_segment_ids"] = array((b, sk), c["segments"]["dtype"])
    if c.get("softmax_aux"):
        arrays["softmax_aux"] = array(c["softmax_aux"]["shape"], "float32")
    shapes = check_flash_args(**arrays)
    window = c["sliding_window"]
    options = FlashOptions.build(head_dim=c["D"], softmax_scale=c["softmax_scale"], causal=c["causal"],
                                 sliding_window=tuple(window) if isinstance(window, list) else window,
                                 logits_soft_cap=c["logits_soft_cap"])
    lay = c["layout"]
    bq, bk = lay["block_q"], lay["block_k"]
    sparse = flash_plan.SparseInfo(lay["layout_batch"], lay["layout_heads"], -(-sq // bq), -(-sk // bk), bq, bk)
    out = array(flash_plan.out_shape(shapes), dtype)
    strides = {name: row_major_strides(a.shape) for name, a in {**arrays, "out": out}.items()}
    dtypes = {**{name: a.dtype for name, a in arrays.items()}, **{name: "int32" for name in flash_plan.SPARSE_INPUTS}}
    kw = dict(config=sparse.config(), arch=arch, max_shared=max_shared, sparse=sparse)
    try:
        fit.forward(shapes, options, strides, dtypes=dtypes, **kw)
        fit.backward(shapes, options, strides, lse_grad=c["lse_cotangent"],
                     dtypes={**dtypes, "out": dtype, "dout": dtype, "lse": "float32", "dlse": "float32"}, **kw)
    except ValueError as e:
        if "layout" not in str(e):
            raise
        return False
    return True


def fitted_layout(c: dict, **device) -> dict:
    """c with layout blocks (halved, the larger first, down to 32) or a dtype (bfloat16) that the GPU's
    shared memory holds, as the library's error for a layout that does not fit suggests; then down to
    16.  `device`: layout_fits' arch and max_shared."""
    c = dict(c, layout=dict(c["layout"]))
    lay = c["layout"]
    for smallest in (32, 16):
        while not layout_fits(c, **device):
            big = "block_q" if lay["block_q"] >= lay["block_k"] else "block_k"
            if lay[big] > smallest:
                lay[big] //= 2
            elif c["dtype"] == "float32":
                c["dtype"] = "bfloat16"
            else:
                break
        else:
            return c
    raise RuntimeError(f"no layout of 16x16 blocks fits: {c}")


def _jax_backends(rng, c: dict, device: str) -> list:
    cpu = device == "cpu"
    # Interpreted Triton through jax costs ~1 s a configuration and XLA compiles each new shape (~2 s),
    # Pallas interprets (~5 s): on CPU each runs on a sample.  On the GPU every new kernel variant
    # compiles, once for torch and again for jax-triton (H200 host: torch 15 s, jax triton 17 s,
    # xla 5 s a configuration), so jax runs on a third of them; GPU tests check torch == jax bitwise.
    odds = {"triton": 0.08 if cpu else 0.35, "xla": 0.05 if cpu else 0.15, "pallas": 0.01 if cpu else 0.0}
    if c["kind"] == "blocksparse":
        odds["pallas"] = 0.0
    if c["kind"] == "varlen" or c.get("dropout_prob"):
        odds["pallas"] = 0.0   # check_pallas_supported: neither varlen nor dropout
    return [name for name, p in odds.items() if _chance(rng, p)]


def draw_valid(rng: np.random.Generator, device: str) -> dict:
    kind = _pick(rng, ["dense"] * 6 + ["varlen"] * 2 + ["blocksparse"] * 2)
    c = dict(kind=kind, dtype=_pick(rng, DTYPES), **_sizes(rng, device, kind))
    c["causal"] = _chance(rng, 0.4)
    c["sliding_window"] = _window(rng, max(c["Sk"], 1)) if _chance(rng, 0.3) else None
    c["logits_soft_cap"] = float(rng.uniform(0.5, 30.0)) if _chance(rng, 0.25) else None
    c["softmax_scale"] = (None if _chance(rng, 0.6) else
                          float(_pick(rng, [rng.uniform(0.02, 1.5), rng.uniform(0.02, 1.5), 10.0 ** rng.uniform(1, 3)])))
    c["softmax_aux"] = _sinks(rng, c["Hq"]) if _chance(rng, 0.3) else None
    c["return_lse"] = _chance(rng, 0.5)
    c["lse_cotangent"] = c["return_lse"] and _chance(rng, 0.5)
    if kind in ("dense", "blocksparse") and _chance(rng, 0.3):
        one = c["Sq"] == c["Sk"] and _chance(rng, 0.3)
        c["segments"] = dict(given="q_only" if one else "both", dtype=_pick(rng, ["int32", "int64", "int64"]),
                             n_docs=int(rng.integers(1, 5)), sorted=_chance(rng, 0.7), wide=_chance(rng, 0.3))
    if kind == "dense":
        if _chance(rng, 0.25):
            c["attention_mask"] = dict(dtype=_pick(rng, ["bool", "bool", "int8", "uint8", "int32", "int64"]),
                                       batch=_pick(rng, [1, c["B"]]), heads=_pick(rng, [1, c["Hq"]]),
                                       keep=float(rng.uniform(0.2, 0.95)), dead_rows=_chance(rng, 0.3))
        if _chance(rng, 0.25):
            c["bias"] = dict(dtype=_pick(rng, ["float32", c["dtype"]]), batch=_pick(rng, [1, c["B"]]),
                             heads=_pick(rng, [1, c["Hq"]]), scale=float(rng.uniform(0.1, 3.0)))
    if kind in ("dense", "varlen") and _chance(rng, 0.15):
        c["dropout_prob"] = float(rng.uniform(0.05, 0.6))
        c["dropout_seed"] = int(rng.integers(0, 2 ** 32))
    if kind == "varlen":
        c.update(_varlen(rng, c, device))
    if kind == "blocksparse":
        c["layout"] = _layout(rng, c, device)
    c["jax"] = _jax_backends(rng, c, device)
    if kind == "blocksparse" and device == "cuda":
        c = fitted_layout(c)   # a valid configuration the library accepts (no draw from rng: replays hold)
    return c


def draw_config(seed: int, index: int, device: str, invalid_fraction: float = INVALID_FRACTION) -> dict:
    rng = rng_for(seed, index, 0)
    if _chance(rng, invalid_fraction):
        name = _pick(rng, sorted(MUTATIONS))
        return dict(kind="invalid", mutation=name, variant=int(rng.integers(0, 1 << 30)),
                    framework=_pick(rng, MUTATIONS[name].frameworks))
    return draw_valid(rng, device)
