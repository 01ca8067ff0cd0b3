"""Launch plan of the NSA selected-branch kernels (selected.py), shared by the torch and JAX front ends.

Loop order by group size.  A program's rows are all GROUP query heads of a KV group for TOKENS
consecutive tokens, and it walks the union of those tokens' selected key blocks, each once:

* GROUP >= 16 (the tensor-core minimum of 16 rows): TOKENS = 1.  One token per program, its S
  blocks in order: the NSA paper's loop (query outer, selected blocks inner), no idle rows.
* GROUP < 16: TOKENS = 16 // GROUP_PAD.  The rows are filled with neighbouring tokens instead
  of padding heads (which would waste 16 / GROUP of every tensor-core op), and each block that
  several of them selected is loaded and multiplied once for all of them (FSA's point: for small
  groups, gather the queries that share a key block).  Neighbouring tokens' selections overlap
  heavily in trained models, so the union is close to S blocks; with no overlap at all the
  program does exactly the work that padding would have done, never more.

Backward dK / dV: atomics.  A program adds each visited block's dK, dV tile (fp32) to zeroed
buffers; dQ is finished in registers in the same pass (one read of Q, dO, O, K, V per visit).
The deterministic alternative, a key-major pass, needs the inverse of the selection (for every
key block, the tokens that selected it: a sort of B * T * Hkv * S entries per call) and is
badly load-balanced (block 0 and the early blocks are selected by almost every token, a token's
own block by few).  Atomics need neither; the price is a summation order that varies from run to
run in the last bits of dK / dV.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

from ..launch import Launch, Output, cdiv, next_pow2, row_major_strides

TENSOR_CORE_ROWS = 16
FWD_INPUTS = ("query", "key", "value", "block_indices", "block_counts", "cu_seqlens")
BWD_INPUTS = ("query", "key", "value", "out", "dout", "lse", "block_indices", "block_counts", "cu_seqlens")


@dataclasses.dataclass(frozen=True)
class NsaShapes:
    """Sizes of one selected-branch call.  Arrays are contiguous BSHD: query (B, T, Hq, D), key
    (B, T, Hkv, D), value (B, T, Hkv, Dv), block_indices int32 (B, T, Hkv, S), block_counts int32
    (B, T, Hkv) when per_token_counts.  Varlen: B = 1 in memory, `sequences` packed sequences of
    at most `seqlen` tokens, `total` tokens in all."""

    batch: int
    seqlen: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    num_slots: int
    block_size: int
    dtype: str
    per_token_counts: bool
    varlen: bool = False
    sequences: int = 0
    total: int = 0

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv


@dataclasses.dataclass(frozen=True)
class NsaTiles:
    group_pad: int   # query heads of a group, padded to a power of two
    tokens: int      # tokens gathered per program
    block_n: int     # keys per inner step (divides block_size)
    num_warps: int
    num_stages: int

    @property
    def rows(self) -> int:
        return self.tokens * self.group_pad


def tiles(shapes: NsaShapes) -> NsaTiles:
    """Rows = TOKENS * GROUP_PAD >= 16 (module docstring); key steps of at most 64 keys (32 at D > 128,
    to keep the backward's [rows, D] and [keys, D] fp32 tiles in registers)."""
    group_pad = next_pow2(shapes.group_size)
    tokens = max(1, TENSOR_CORE_ROWS // group_pad)
    big_d = max(shapes.head_dim, shapes.head_dim_v) > 128
    block_n = min(shapes.block_size, 32 if big_d else 64)
    rows = tokens * group_pad
    # fp32 at D > 128: a second pipeline stage of its [keys, D] fp32 tiles overflows sm_80's shared memory
    # (196 KiB for the backward; tests/test_nsa_compile.py).
    stages = 1 if big_d and shapes.dtype == "float32" else 2
    return NsaTiles(group_pad, tokens, block_n, 8 if rows >= 64 or big_d else 4, stages)


def scan_blocks(shapes: NsaShapes, t: NsaTiles) -> bool:
    """Walk every key block up to the program's last own block instead of its selection entries
    when there are no more of those than entries (short sequences): no deduplication per step, and
    fewer steps."""
    return cdiv(shapes.seqlen, shapes.block_size) <= t.tokens * shapes.num_slots


def _strides(shapes: NsaShapes):
    rows = shapes.total if shapes.varlen else shapes.seqlen
    batch = 1 if shapes.varlen else shapes.batch
    q = row_major_strides((batch, rows, shapes.heads_q, shapes.head_dim))[:3]
    k = row_major_strides((batch, rows, shapes.heads_kv, shapes.head_dim))[:3]
    v = row_major_strides((batch, rows, shapes.heads_kv, shapes.head_dim_v))[:3]
    idx = row_major_strides((batch, rows, shapes.heads_kv, shapes.num_slots))[:3]
    cnt = row_major_strides((batch, rows, shapes.heads_kv)) if shapes.per_token_counts else (0, 0, 0)
    o = row_major_strides((batch, rows, shapes.heads_q, shapes.head_dim_v))[:3]
    lse = row_major_strides((batch, rows, shapes.heads_q))
    return q + k + v + idx + cnt + o + lse, (batch, rows)


def _scalars_and_constexprs(shapes: NsaShapes, softmax_scale: float, block_count: int, scan: Optional[bool]):
    t = tiles(shapes)
    strides, _ = _strides(shapes)
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs",
             "stride_vh", "stride_ib", "stride_is", "stride_ih", "stride_cb", "stride_cs", "stride_ch",
             "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh")
    scalars = tuple(zip(names, strides)) + (
        ("seqlen", shapes.seqlen), ("total", shapes.total), ("num_heads_kv", shapes.heads_kv),
        ("block_count", int(block_count)), ("sm_scale", float(softmax_scale)))
    constexprs = (
        ("HEAD_DIM", shapes.head_dim), ("HEAD_DIM_V", shapes.head_dim_v),
        ("BLOCK_D", max(16, next_pow2(shapes.head_dim))), ("BLOCK_DV", max(16, next_pow2(shapes.head_dim_v))),
        ("GROUP", shapes.group_size), ("GROUP_PAD", t.group_pad), ("TOKENS", t.tokens),
        ("NUM_SLOTS", shapes.num_slots), ("BLOCK_SLOTS", next_pow2(shapes.num_slots)),
        ("BLOCK_SIZE", shapes.block_size), ("BLOCK_N", t.block_n),
        ("PER_TOKEN_COUNTS", shapes.per_token_counts), ("IS_VARLEN", shapes.varlen),
        ("DOT_PRECISION", "tf32x3" if shapes.dtype == "float32" else "tf32"),
        ("SCAN_BLOCKS", scan_blocks(shapes, t) if scan is None else bool(scan)))
    grid = (cdiv(shapes.seqlen, t.tokens), (shapes.sequences if shapes.varlen else shapes.batch) * shapes.heads_kv, 1)
    return t, scalars, constexprs, grid


def lse_shape(shapes: NsaShapes) -> Tuple[int, int, int]:
    _, (batch, rows) = _strides(shapes)
    return (batch, rows, shapes.heads_q)


def plan_forward(shapes: NsaShapes, softmax_scale: float, block_count: int,
                 scan: Optional[bool] = None) -> Launch:
    """`scan`: force the SCAN_BLOCKS loop on or off (None: scan_blocks decides).
    Outputs out (like query, (B, T, Hq, Dv)) and lse (fp32 (B, T, Hq), natural log).  Varlen
    rows past the last sequence are written by no program: both are filled beforehand."""
    t, scalars, constexprs, grid = _scalars_and_constexprs(shapes, softmax_scale, block_count, scan)
    _, (batch, rows) = _strides(shapes)
    return Launch(
        module="nsa.selected", kernel="nsa_fwd_kernel", grid=grid, inputs=FWD_INPUTS, scalars=scalars,
        outputs=(Output("out", (batch, rows, shapes.heads_q, shapes.head_dim_v), "like:query", zeroed=shapes.varlen),
                 Output("lse", lse_shape(shapes), "float32", zeroed=shapes.varlen, fill=float("-inf"))),
        constexprs=constexprs, num_warps=t.num_warps, num_stages=t.num_stages)


def plan_backward(shapes: NsaShapes, softmax_scale: float, block_count: int,
                  scan: Optional[bool] = None) -> Launch:
    """Outputs dq (like query), dk and dv in fp32 (zeroed: accumulated by atomics); the front ends
    cast dk, dv to the inputs' dtype."""
    t, scalars, constexprs, grid = _scalars_and_constexprs(shapes, softmax_scale, block_count, scan)
    _, (batch, rows) = _strides(shapes)
    return Launch(
        module="nsa.selected", kernel="nsa_bwd_kernel", grid=grid, inputs=BWD_INPUTS, scalars=scalars,
        outputs=(Output("dq", (batch, rows, shapes.heads_q, shapes.head_dim), "like:query", zeroed=shapes.varlen),
                 Output("dk", (batch, rows, shapes.heads_kv, shapes.head_dim), "float32", zeroed=True),
                 Output("dv", (batch, rows, shapes.heads_kv, shapes.head_dim_v), "float32", zeroed=True)),
        constexprs=constexprs, num_warps=t.num_warps, num_stages=t.num_stages)


IMPORTANCE_BLOCK_C = 64


def plan_importance(batch: int, seqlen: int, heads_q: int, heads_kv: int, head_dim: int, block_size: int,
                    dtype: str, softmax_scale: float) -> Launch:
    """The top-k scores of one (unpacked) sequence batch (importance.py): inputs query (B, T, Hq, D),
    k_cmp (B, T // block_size, Hkv, D) and the compressed branch's lse (B, Hq, T) fp32, all contiguous;
    output scores fp32 (B, T, Hkv, cdiv(T, block_size))."""
    shapes = NsaShapes(batch=batch, seqlen=seqlen, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       head_dim_v=head_dim, num_slots=1, block_size=block_size, dtype=dtype, per_token_counts=False)
    t = tiles(shapes)
    n_cmp, n_blocks = seqlen // block_size, cdiv(seqlen, block_size)
    strides = (row_major_strides((batch, seqlen, heads_q, head_dim))[:3]
               + row_major_strides((batch, max(n_cmp, 1), heads_kv, head_dim))[:3]
               + row_major_strides((batch, heads_q, seqlen))
               + row_major_strides((batch, seqlen, heads_kv, n_blocks))[:3])
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_lb", "stride_lh",
             "stride_ls", "stride_sb", "stride_ss", "stride_sh")
    return Launch(
        module="nsa.importance", kernel="nsa_importance_kernel",
        grid=(cdiv(seqlen, t.tokens), batch * heads_kv, 1), inputs=("query", "k_cmp", "lse"),
        scalars=tuple(zip(names, strides)) + (("seqlen", seqlen), ("num_heads_kv", heads_kv), ("num_cmp", n_cmp),
                                              ("num_blocks", n_blocks), ("sm_scale", float(softmax_scale))),
        outputs=(Output("scores", (batch, seqlen, heads_kv, n_blocks), "float32"),),
        constexprs=(("HEAD_DIM", head_dim), ("BLOCK_D", max(16, next_pow2(head_dim))), ("GROUP", heads_q // heads_kv),
                    ("GROUP_PAD", t.group_pad), ("TOKENS", t.tokens), ("BLOCK_SIZE", block_size),
                    ("BLOCK_C", IMPORTANCE_BLOCK_C),
                    ("DOT_PRECISION", "tf32x3" if dtype == "float32" else "tf32")),
        num_warps=4, num_stages=2)
