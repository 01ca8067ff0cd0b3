"""Launch plan of the NSA selected-branch kernels (selected.py), shared by the torch and JAX front ends.

Loop order by group size.  For groups under 16 heads the forward and the dQ pass run key-major
(key_major.py: key block outer, the tokens that selected it gathered inner, partial results summed
per token; key_major says when: not on short sequences).  Otherwise a program's rows are all GROUP
query heads of a KV group for TOKENS consecutive tokens, and it walks the union of those tokens'
selected key blocks, each once:

* GROUP >= 16 (the tensor-core minimum of 16 rows): TOKENS = 1.  One token per program, its S
  blocks in order: the NSA paper's loop (query outer, selected blocks inner), no idle rows.
* GROUP < 16: TOKENS = 16 // GROUP_PAD.  The rows are filled with neighbouring tokens instead
  of padding heads (which would waste 16 / GROUP of every tensor-core op), and each block that
  several of them selected is loaded and multiplied once for all of them (FSA's point: for small
  groups, gather the queries that share a key block).  Neighbouring tokens' selections overlap
  heavily in trained models, so the union is close to S blocks; with no overlap at all the
  program does exactly the work that padding would have done, never more.

Backward: two passes, no atomics (BackwardPlan).
* dQ, key-major where the forward is (key_major.py: delta and the selection keys first, the inverted
  index below, then partial dQ per entry and their sum per token).  Otherwise:
* dQ: the forward's programs and loop (query-major), dQ finished in registers.  It also writes
  delta = rowsum(O * dO) and, per selection entry, its bucket (KV group, key block) + 1, or 0 for
  an entry that does not count (selection_tile's rule).
* The inverted index, built by the front ends between the passes (inverted_index in each): a
  stable sort of those int32 keys, the entries taken in block_indices' (b, t, h, slot) order.
  Within a bucket (fixed b, h) the entries then come in increasing token order, a duplicate
  entry next to its twin (the kernel drops an entry equal to the previous one); a search of the
  sorted keys gives where each bucket starts.  One sort of B * T * Hkv * S int32 per call.
  Buckets are numbered block-major (block * KV groups + KV group: selected.bucket), so the
  lists of block 0, the longest, come first.
* dK / dV: key-major, over chunks of the buckets' lists.  Each list is cut into chunks of at most
  dkv_chunk entries; one program per (chunk, BLOCK_N keys of its block) holds those keys' K, V
  and fp32 dK, dV in registers, walks its chunk TOKENS_KV tokens (all heads of each) at a time and
  writes its fp32 partial dK, dV to a scratch slot of its own (the chunk's number).  A reduction
  program per (KV group, key block [, BLOCK_N keys]) then sums the block's slots in chunk order
  and writes dK, dV once, in the inputs' dtype (zeros for a block nobody selected).  The front
  ends' chunk table (inverted_index) gives each program its bucket; the chunk count is bounded
  statically (max_chunks), and programs past the real count exit at once.

Why: the single pass that added every visited block's [BLOCK_N, D] dK, dV tile to fp32 buffers
with atomics spent most of the backward in those atomics, and its summation order changed from run
to run (docs/lessons.md, "NSA's backward: key-major dK / dV over chunked lists").  Now the backward is bitwise reproducible: the sort is stable, the chunks
are fixed by the list lengths alone, each chunk is walked in one fixed order, its partial sums are
added in chunk order, and every element is written by one program.

Load imbalance, and why chunks: early blocks are selected by many tokens (block 0 by nearly all of
them, a token's own block by the few tokens inside it), so whole lists differ in length by up to
the sequence length over the block size.  One program per list ran for the longest one alone (block
0's program walking every token of every head of the group).  Chunks bound every program's walk; the
chunk table lists block 0's chunks first, then block 1's, ..., so the long lists' chunks start first
and the short last chunks fill in behind them.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple, Union

from ..launch import Launch, Output, cdiv, next_pow2, plan_memo, row_major_strides

TENSOR_CORE_ROWS = 16
# Rows of a dK / dV step: TOKENS_KV tokens * GROUP_PAD heads.  32: with 64 rows, 16-bit D = 128 programs
# of 32 keys on 4 warps need too many registers (and 64 keys on 8 warps spilled at 64 rows).
DKV_ROWS = 32
# A 16-bit dK / dV program at D <= 128: 32 keys on 4 warps (dkv_tiles).
DKV_KEYS_16BIT = 32
DKV_WARPS_16BIT = 4
# Their register cap where a head is wider than 64: three programs of 4 warps an SM (65536 / (3 * 128) = 170,
# rounded down to ptxas's unit of 8).  Left to itself ptxas gives the same program more or fewer registers by
# Triton release and by whether an int argument equal to 1 (the lse's head stride) is a constant, which
# jax-triton makes it, and then two programs fit an SM (docs/lessons.md, "NSA's dK/dV: a register cap, not the
# assembler's choice").  Capped, both compile to the same occupancy.
DKV_MAX_REGISTERS = 168
FWD_INPUTS = ("query", "key", "value", "block_indices", "block_counts", "cu_seqlens")
BWD_INPUTS = ("query", "key", "value", "out", "dout", "lse", "block_indices", "block_counts", "cu_seqlens")
DKV_INPUTS = ("query", "key", "value", "dout", "lse", "delta", "entry_order", "bucket_starts", "chunk_buckets",
              "chunk_starts", "cu_seqlens")
DKV_REDUCE_INPUTS = ("dk_chunks", "dv_chunks", "chunk_starts", "cu_seqlens")
# A dK / dV program's walk: at most this many rows (list entries * GROUP_PAD), DKV_CHUNK_ROWS //
# DKV_ROWS = 128 steps, unless dkv_chunk needs longer chunks to bound the scratch.
DKV_CHUNK_ROWS = 4096
INT32_MAX = 2 ** 31 - 1


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
    # varlen: the host read the table and every packed token lies in a sequence (cu_seqlens[-1] == total),
    # so the forward writes every row of out and lse and neither needs a fill beforehand.
    rows_covered: bool = False

    @property
    def group_size(self) -> int:
        return self.heads_q // self.heads_kv


def _forward_outputs(shapes: NsaShapes, batch: int, rows: int) -> tuple:
    """out and lse of the selected forward.  Varlen rows in no sequence are written by no program: filled
    beforehand with 0 and lse -inf, unless the host knows there are none (shapes.rows_covered)."""
    fill = shapes.varlen and not shapes.rows_covered
    return (Output("out", (batch, rows, shapes.heads_q, shapes.head_dim_v), "like:query", zeroed=fill),
            Output("lse", lse_shape(shapes), "float32", zeroed=fill, fill=float("-inf")))


@dataclasses.dataclass(frozen=True)
class NsaTiles:
    group_pad: int   # query heads of a group, padded to a power of two
    tokens: int      # tokens gathered per program
    block_n: int     # keys per inner step (divides block_size)
    num_warps: int
    num_stages: int
    max_registers: Optional[int] = None   # Launch.max_registers

    @property
    def rows(self) -> int:
        return self.tokens * self.group_pad


def tiles(shapes: NsaShapes) -> NsaTiles:
    """Rows = TOKENS * GROUP_PAD >= 16 (module docstring); key steps of 32 keys (at most 64 where rows
    are more than 16 at D <= 128; 32 at D > 128, to keep the backward's [rows, D] and [keys, D] fp32
    tiles in registers).  At D <= 128, 16 rows (every group of at most 16 heads) run on one warp: one tensor-core
    tile's rows, no reduction across warps, and many programs per SM to hide the gathers' latency
    (docs/lessons.md, "NSA's warps per program"; the dQ pass runs these programs too)."""
    group_pad = next_pow2(shapes.group_size)
    tokens = max(1, TENSOR_CORE_ROWS // group_pad)
    big_d = max(shapes.head_dim, shapes.head_dim_v) > 128
    rows = tokens * group_pad
    block_n = min(shapes.block_size, 32 if big_d or rows == TENSOR_CORE_ROWS else 64)
    # fp32 at D > 128: a second pipeline stage of its [keys, D] fp32 tiles overflows sm_80's shared memory
    # (196 KiB for the backward; tests/test_nsa_compile.py).
    stages = 1 if big_d and shapes.dtype == "float32" else 2
    num_warps = 8 if rows >= 64 or big_d else 1 if rows == TENSOR_CORE_ROWS else 4
    return NsaTiles(group_pad, tokens, block_n, num_warps, stages)


def scan_blocks(shapes: NsaShapes, t: NsaTiles) -> bool:
    """Walk every key block up to the program's last own block instead of its selection entries
    when there are no more of those than entries (short sequences): no deduplication per step, and
    fewer steps."""
    return cdiv(shapes.seqlen, shapes.block_size) <= t.tokens * shapes.num_slots


STRIDE_NAMES = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_vb",
                "stride_vs", "stride_vh", "stride_ib", "stride_is", "stride_ih", "stride_cb", "stride_cs", "stride_ch",
                "stride_ob", "stride_os", "stride_oh", "stride_lb", "stride_ls", "stride_lh")


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
    return tuple(zip(STRIDE_NAMES, q + k + v + idx + cnt + o + lse)), (batch, rows)


# The dK / dV kernel's: no selection (its lists replace it), so no strides of the indices or counts.
DKV_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "qkvol") + (
    "seqlen", "total", "num_heads_kv", "kv_groups", "chunk_entries", "sm_scale")
DKV_CONSTEXPRS = ("HEAD_DIM", "HEAD_DIM_V", "BLOCK_D", "BLOCK_DV", "GROUP", "GROUP_PAD", "TOKENS", "NUM_SLOTS",
                  "BLOCK_SIZE", "BLOCK_N", "IS_VARLEN", "DOT_PRECISION", "STRIDES_ALIGNED")
# The reduction's: dK, dV strides (K's, V's) and where each KV group's sequence lies.
DKV_REDUCE_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "kv") + (
    "seqlen", "total", "num_heads_kv", "kv_groups", "sm_scale")
DKV_REDUCE_CONSTEXPRS = ("HEAD_DIM", "HEAD_DIM_V", "BLOCK_D", "BLOCK_DV", "BLOCK_SIZE", "BLOCK_N", "IS_VARLEN",
                         "STRIDES_ALIGNED")
# The key-major forward's (key_major.py): its selection keys and merge read the indices; its partial pass
# reads Q, K, V through the inverted index, as the dK / dV pass.
KEYS_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "ic") + (
    "seqlen", "total", "num_heads_kv", "block_count")
PARTIAL_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "qkv") + (
    "seqlen", "total", "num_heads_kv", "kv_groups", "chunk_entries", "sm_scale")
MERGE_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "icol") + (
    "seqlen", "total", "num_heads_kv", "block_count")
DQ_SUM_SCALARS = KEYS_SCALARS[:6] + tuple(n for n in STRIDE_NAMES if n[len("stride_")] == "q") + (
    "seqlen", "total", "num_heads_kv", "block_count", "sm_scale")
DELTA_SCALARS = tuple(n for n in STRIDE_NAMES if n[len("stride_")] in "ol") + ("seqlen", "total", "num_heads_kv")
# What the reduction takes on from the dK / dV launch.
DKV_RESUME = (("dk_chunks", "dk_chunks"), ("dv_chunks", "dv_chunks"))


def kv_groups(shapes: NsaShapes) -> int:
    """Programs' KV groups: batch (varlen: sequences) * Hkv."""
    return (shapes.sequences if shapes.varlen else shapes.batch) * shapes.heads_kv


def num_buckets(shapes: NsaShapes) -> int:
    """Lists of the inverted index: one per (key block, KV group), block-major (selected.bucket)."""
    return kv_groups(shapes) * cdiv(shapes.seqlen, shapes.block_size)


def num_entries(shapes: NsaShapes) -> int:
    """Selection entries: B * T * Hkv * S (varlen: every packed row's)."""
    _, (batch, rows) = _strides(shapes)
    return batch * rows * shapes.heads_kv * shapes.num_slots


def dkv_chunk(shapes: NsaShapes) -> int:
    """List entries per dK / dV program (plan_backward): DKV_CHUNK_ROWS rows' worth, and at least
    S * block_size, a bucket's mean list length (entries / buckets), so that only lists longer than
    the mean are split and the chunk count (max_chunks) stays within twice the buckets: the scratch
    within twice fp32 dK, dV.  (At 128 steps a chunk at group 16 would be 256 entries: at T = 64k,
    S = 16, block 64, Hkv = 4, D = 128 a 1.3 GB scratch; this way 512 steps and 0.54 GB, a walk still
    short against the whole pass's steps per SM.)  A multiple of the kernel's TOKENS_KV, so only a list's last step is
    partial."""
    tokens = dkv_tiles(shapes).tokens
    entries = max(DKV_CHUNK_ROWS // next_pow2(shapes.group_size), shapes.num_slots * shapes.block_size)
    return cdiv(entries, tokens) * tokens


def max_chunks(shapes: NsaShapes, chunk: int) -> int:
    """A static bound on the chunks of all lists: sum over buckets of cdiv(count, chunk) <=
    entries // chunk + buckets."""
    return num_entries(shapes) // chunk + num_buckets(shapes)


def dkv_scratch_bytes(shapes: NsaShapes) -> int:
    """The fp32 partial dK, dV of every chunk: max_chunks * block_size * (D + Dv) * 4 bytes, i.e.
    (B * T * Hkv * S // dkv_chunk + B * Hkv * cdiv(T, block_size)) * block_size * (D + Dv) * 4:
    at most about twice fp32 dK, dV (dkv_chunk).  T = 65536, S = 16, block 64, Hkv = 4, D = Dv =
    128, B = 1: 8192 slots of 64 KiB, 537 MB."""
    return max_chunks(shapes, dkv_chunk(shapes)) * shapes.block_size * (shapes.head_dim + shapes.head_dim_v) * 4


def check_index_range(shapes: NsaShapes) -> None:
    """The backward's bucket keys and entry numbers are int32 (JAX has no int64 without x64)."""
    entries = num_entries(shapes)
    if max(entries, num_buckets(shapes) + 1) > INT32_MAX:
        raise ValueError(f"block_indices has {entries} entries in {num_buckets(shapes)} (KV group, block) lists: the "
                         f"backward numbers them in int32, at most {INT32_MAX}")


def _scalars_and_constexprs(shapes: NsaShapes, softmax_scale: float, block_count: int, scan: Optional[bool]):
    t = tiles(shapes)
    strides, _ = _strides(shapes)
    scalars = strides + (
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
        ("SCAN_BLOCKS", scan_blocks(shapes, t) if scan is None else bool(scan)),
        # Every q/k/v/o stride divisible by 16 elements: the kernels' row loads vectorise (rules.aligned).
        ("STRIDES_ALIGNED", all(value % 16 == 0 for name, value in strides if name[len("stride_")] in "qkvo")))
    grid = (cdiv(shapes.seqlen, t.tokens), kv_groups(shapes), 1)
    return t, scalars, constexprs, grid


def lse_shape(shapes: NsaShapes) -> Tuple[int, int, int]:
    _, (batch, rows) = _strides(shapes)
    return (batch, rows, shapes.heads_q)


@plan_memo
def plan_forward(shapes: NsaShapes, softmax_scale: float, block_count: int, scan: Optional[bool] = None,
                 by_key: Optional[bool] = None) -> Union[Launch, KeyMajorForward]:
    """The query-major launch, or with `by_key` (None: key_major decides) the key-major launches.
    `scan`: force the query-major SCAN_BLOCKS loop on or off (None: scan_blocks decides).
    Outputs out (like query, (B, T, Hq, Dv)) and lse (fp32 (B, T, Hq), natural log).  Varlen
    rows past the last sequence are written by no program: both are filled beforehand."""
    t, scalars, constexprs, grid = _scalars_and_constexprs(shapes, softmax_scale, block_count, scan)
    if key_major(shapes) and not scan if by_key is None else by_key:
        return _plan_key_major(shapes, scalars, constexprs, grid)
    _, (batch, rows) = _strides(shapes)
    return Launch(
        module="nsa.selected", kernel="nsa_fwd_kernel", grid=grid, inputs=FWD_INPUTS, scalars=scalars,
        outputs=_forward_outputs(shapes, batch, rows),
        constexprs=constexprs, num_warps=t.num_warps, num_stages=t.num_stages)


# The key-major forward (key_major.py): rows of a step, and a chunk's walk in rows (a program per chunk
# reloads the block's K, V once, so chunks only need to be long against that and short against imbalance).
KEY_MAJOR_ROWS = 64
KEY_MAJOR_CHUNK_ROWS = 2048
# Rows of a selection-keys program (tokens) and of a merge program (tokens * GROUP_PAD), the merge's warps
# and pipeline stages.  Merge rows 128 on 4 warps rather than 64: more loads in flight (ptxas spills a little at
# D = 128); stages change nothing (the slot loop's loads are not pipelined), and 8 warps are slower
# (docs/lessons.md, "NSA's selected branch for small groups: key-major").
KEYS_TOKENS = 64
MERGE_ROWS = 128
MERGE_WARPS = 4
MERGE_STAGES = 1
KEYS_INPUTS = ("block_indices", "block_counts", "cu_seqlens")
PARTIAL_INPUTS = ("query", "key", "value", "entry_order", "bucket_starts", "chunk_buckets", "chunk_starts",
                  "cu_seqlens")
MERGE_INPUTS = ("block_indices", "block_counts", "cu_seqlens", "part_o", "part_lse")
DQ_SUM_INPUTS = ("block_indices", "block_counts", "cu_seqlens", "part_dq")
DELTA_INPUTS = ("out", "dout", "cu_seqlens")
PARTIAL_CONSTEXPRS = DKV_CONSTEXPRS
KEYS_CONSTEXPRS = ("TOKENS", "NUM_SLOTS", "BLOCK_SLOTS", "BLOCK_SIZE", "PER_TOKEN_COUNTS", "IS_VARLEN")
MERGE_CONSTEXPRS = ("HEAD_DIM_V", "BLOCK_DV", "GROUP", "GROUP_PAD", "TOKENS", "NUM_SLOTS", "BLOCK_SLOTS",
                    "BLOCK_SIZE", "PER_TOKEN_COUNTS", "IS_VARLEN", "STRIDES_ALIGNED")
DQ_SUM_CONSTEXPRS = ("HEAD_DIM", "BLOCK_D") + MERGE_CONSTEXPRS[2:]
DELTA_CONSTEXPRS = ("HEAD_DIM_V", "BLOCK_DV", "GROUP", "GROUP_PAD", "TOKENS", "IS_VARLEN", "STRIDES_ALIGNED")


def key_major_tiles(shapes: NsaShapes) -> NsaTiles:
    """The key-major partial programs (forward and dQ) on 4 warps: KEY_MAJOR_ROWS rows (tokens * GROUP_PAD) and
    64-key tiles, halved at D > 128 and again in fp32 (fp32 D = 256 at 32 rows and keys spilled 45 KB),
    so that q, K, V and the fp32 output tile fit the registers.  A block of at most one tile stays in
    registers for the walk; larger blocks are walked in tiles, reloaded per step.  64 rows on 4 warps
    with 3 stages beat 128 rows on 8 warps, 32 rows, and 8 warps (timed on the forward's partials,
    which the dQ partials follow)."""
    group_pad = next_pow2(shapes.group_size)
    big_d = max(shapes.head_dim, shapes.head_dim_v) > 128
    fp32 = shapes.dtype == "float32"
    rows = KEY_MAJOR_ROWS >> (int(big_d) + int(fp32))
    return NsaTiles(group_pad, max(1, rows // group_pad), min(shapes.block_size, rows), 4, 1 if big_d or fp32 else 3)


def merge_tokens(shapes: NsaShapes) -> int:
    """Tokens of a merge program: MERGE_ROWS rows (tokens * GROUP_PAD), half at Dv > 128."""
    rows = MERGE_ROWS // 2 if shapes.head_dim_v > 128 else MERGE_ROWS
    return max(1, rows // next_pow2(shapes.group_size))


def key_major(shapes: NsaShapes) -> bool:
    """Whether the forward runs key-major (key_major.py): for groups of fewer heads than a tensor-core
    tile's rows, wherever the query-major programs would walk selection entries rather than scan
    blocks (short sequences: there its sort, merge and extra launches cost more than they save, a few
    kernels' worth of GPU time behind the host's launches).  At group 16 the partial outputs move as
    many bytes as the K / V blocks they save, so from a tensor-core tile's rows the query-major
    programs stay.  The dQ pass follows the same rule (plan_backward).  docs/lessons.md, "NSA's
    selected branch for small groups: key-major"."""
    return shapes.group_size < TENSOR_CORE_ROWS and not scan_blocks(shapes, tiles(shapes))


def key_major_chunk(shapes: NsaShapes) -> int:
    """List entries per partial program: KEY_MAJOR_CHUNK_ROWS rows' worth, a multiple of its TOKENS."""
    t = key_major_tiles(shapes)
    return cdiv(max(1, KEY_MAJOR_CHUNK_ROWS // t.group_pad), t.tokens) * t.tokens


def key_major_scratch_bytes(shapes: NsaShapes, backward: bool = False) -> int:
    """The key-major forward's partial outputs and lse of every selection entry, entries * GROUP *
    (Dv * itemsize + 4), or the dQ pass's partial dQ, entries * GROUP * D * itemsize."""
    itemsize = 4 if shapes.dtype == "float32" else 2
    per_row = shapes.head_dim * itemsize if backward else shapes.head_dim_v * itemsize + 4
    return num_entries(shapes) * shapes.group_size * per_row


@dataclasses.dataclass(frozen=True)
class KeyMajorForward:
    """The key-major forward's launches.  Launchers run `keys`, build the inverted index from its
    selection_keys (inverted_index in each front end, with this plan's buckets, chunk_entries and
    max_chunks, as for BackwardPlan), then `partial` (which runs the merge after it, `then`); the merge
    outputs out and lse as plan_forward's query-major launch does."""
    keys: Launch
    partial: Launch
    buckets: int
    chunk_entries: int
    max_chunks: int


def _plan_key_major(shapes: NsaShapes, scalars: tuple, constexprs: tuple, grid: tuple) -> KeyMajorForward:
    check_index_range(shapes)
    _, (batch, rows) = _strides(shapes)
    t = key_major_tiles(shapes)
    chunk = key_major_chunk(shapes)
    chunks = max_chunks(shapes, chunk)
    scalar = dict(scalars, kv_groups=kv_groups(shapes), chunk_entries=chunk)
    const = dict(constexprs)
    merge = Launch(
        module="nsa.key_major", kernel="nsa_fwd_merge_kernel",
        grid=(cdiv(shapes.seqlen, merge_tokens(shapes)), kv_groups(shapes), 1), inputs=MERGE_INPUTS,
        scalars=_pick(MERGE_SCALARS, scalar),
        outputs=_forward_outputs(shapes, batch, rows),
        constexprs=_pick(MERGE_CONSTEXPRS, dict(const, TOKENS=merge_tokens(shapes))), num_warps=MERGE_WARPS,
        num_stages=MERGE_STAGES, resume=(("part_o", "part_o"), ("part_lse", "part_lse")))
    entries = num_entries(shapes)
    partial = Launch(
        module="nsa.key_major", kernel="nsa_fwd_partial_kernel", grid=(chunks, 1, 1), inputs=PARTIAL_INPUTS,
        scalars=_pick(PARTIAL_SCALARS, scalar),
        outputs=(Output("part_o", (entries, shapes.group_size, shapes.head_dim_v), "like:query"),
                 Output("part_lse", (entries, shapes.group_size), "float32")),
        constexprs=_pick(PARTIAL_CONSTEXPRS, dict(const, TOKENS=t.tokens, BLOCK_N=t.block_n)),
        num_warps=t.num_warps, num_stages=t.num_stages, then=merge)
    return KeyMajorForward(_keys_launch(shapes, scalar, const), partial, num_buckets(shapes), chunk, chunks)


def _pick(names, values: dict) -> tuple:
    return tuple((n, values[n]) for n in names)


def _keys_launch(shapes: NsaShapes, scalar: dict, const: dict) -> Launch:
    """Each selection entry's bucket key (key_major.nsa_selection_keys_kernel)."""
    _, (batch, rows) = _strides(shapes)
    return Launch(
        module="nsa.key_major", kernel="nsa_selection_keys_kernel",
        grid=(cdiv(shapes.seqlen, KEYS_TOKENS), kv_groups(shapes), 1), inputs=KEYS_INPUTS,
        scalars=_pick(KEYS_SCALARS, scalar),
        outputs=(Output("selection_keys", (batch, rows, shapes.heads_kv, shapes.num_slots), "int32",
                        zeroed=shapes.varlen),),
        constexprs=_pick(KEYS_CONSTEXPRS, dict(const, TOKENS=KEYS_TOKENS)), num_warps=4, num_stages=1)


def _key_major_dq(shapes: NsaShapes, scalar: dict, const: dict) -> Tuple[Tuple[Launch, Launch], Launch]:
    """The key-major dQ pass: (delta, selection keys), run before the inverted index, and the partial dQ
    launch (its sum runs after it, `then`), run with it."""
    _, (batch, rows) = _strides(shapes)
    t = key_major_tiles(shapes)
    tokens = merge_tokens(shapes)
    row_grid = (cdiv(shapes.seqlen, tokens), kv_groups(shapes), 1)
    delta = Launch(
        module="nsa.key_major", kernel="nsa_bwd_delta_kernel", grid=row_grid, inputs=DELTA_INPUTS,
        scalars=_pick(DELTA_SCALARS, scalar), outputs=(Output("delta", lse_shape(shapes), "float32"),),
        constexprs=_pick(DELTA_CONSTEXPRS, dict(const, TOKENS=tokens)), num_warps=MERGE_WARPS, num_stages=1)
    total = Launch(
        module="nsa.key_major", kernel="nsa_bwd_dq_sum_kernel", grid=row_grid, inputs=DQ_SUM_INPUTS,
        scalars=_pick(DQ_SUM_SCALARS, scalar),
        outputs=(Output("dq", (batch, rows, shapes.heads_q, shapes.head_dim), "like:query", zeroed=shapes.varlen),),
        constexprs=_pick(DQ_SUM_CONSTEXPRS, dict(const, TOKENS=tokens)), num_warps=MERGE_WARPS, num_stages=1,
        resume=(("part_dq", "part_dq"),))
    partial = Launch(
        module="nsa.key_major", kernel="nsa_bwd_dq_partial_kernel", grid=(scalar["max_chunks"], 1, 1),
        inputs=DKV_INPUTS, scalars=_pick(DKV_SCALARS, scalar),
        outputs=(Output("part_dq", (num_entries(shapes), shapes.group_size, shapes.head_dim), "like:query"),),
        constexprs=_pick(DKV_CONSTEXPRS, dict(const, TOKENS=t.tokens, BLOCK_N=t.block_n)),
        num_warps=t.num_warps, num_stages=t.num_stages, then=total)
    return (delta, _keys_launch(shapes, scalar, const)), partial


def dkv_tiles(shapes: NsaShapes) -> NsaTiles:
    """The dK / dV pass's tiles: `tokens` = TOKENS_KV tokens per step (DKV_ROWS rows), `block_n` keys
    per program.  16-bit at D <= 128: 32 keys on 4 warps, whose warps each hold a quarter of a step's
    [32 keys, 32 rows] S^T tile (on 8 warps a step's tile is split too thin: docs/lessons.md, "NSA's warps
    per program"); K, V and fp32 dK, dV of 32 keys then fit the registers (64 keys on 4 warps spill), and
    heads wider than 64 are capped at DKV_MAX_REGISTERS so that three programs fit an SM.  Otherwise
    64 keys on 8 warps, at D > 128 32 (16 in fp32), so its K, V and fp32 dK, dV fit the registers
    (fp32 D = 256 with 32 keys: ptxas keeps 32 registers and spills 8.7 KiB; with 16: 288 bytes; on
    4 warps it spills kilobytes)."""
    group_pad = next_pow2(shapes.group_size)
    big_d = max(shapes.head_dim, shapes.head_dim_v) > 128
    fp32 = shapes.dtype == "float32"
    tokens = max(1, DKV_ROWS // group_pad)
    if not big_d and not fp32:
        wide = max(shapes.head_dim, shapes.head_dim_v) > 64
        return NsaTiles(group_pad, tokens, min(shapes.block_size, DKV_KEYS_16BIT), DKV_WARPS_16BIT, 2,
                        DKV_MAX_REGISTERS if wide else None)
    block_n = min(shapes.block_size, (16 if fp32 else 32) if big_d else 64)
    # fp32 at D > 128: one stage (sm_80's shared memory, as tiles()).
    stages = 1 if big_d and fp32 else 2
    return NsaTiles(group_pad, tokens, block_n, 8, stages)


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The backward launches.  Launchers run `before_index` (the query-major dQ pass, or key-major the
    delta and selection-keys launches), build the inverted index from its selection_keys
    (inverted_index in each front end, module docstring), then `with_index` (key-major dQ partials and
    their sum, then `dkdv`, which runs its reduction after it, `then`) with delta.  The index, all int32:
      entry_order (entries,): the entries' flat indices in block_indices, sorted stably by bucket key;
      bucket_starts (buckets + 1,): where each bucket's entries start, past the entries of key 0;
      chunk_starts (buckets + 1,): where each bucket's chunks start in the chunk table, bucket i
          having cdiv(its entries, chunk_entries) chunks;
      chunk_buckets (max_chunks,): each chunk's bucket, in bucket order, `buckets` past the last."""
    dq: Launch
    dkdv: Launch
    buckets: int
    chunk_entries: int
    max_chunks: int
    prepare: Tuple[Launch, ...] = ()   # key-major: delta and selection keys; empty: dq runs first

    @property
    def before_index(self) -> Tuple[Launch, ...]:
        return self.prepare or (self.dq,)

    @property
    def with_index(self) -> Tuple[Launch, ...]:
        return (self.dq, self.dkdv) if self.prepare else (self.dkdv,)


@plan_memo
def plan_backward(shapes: NsaShapes, softmax_scale: float, block_count: int, scan: Optional[bool] = None,
                  by_key: Optional[bool] = None) -> BackwardPlan:
    """Query-major, dq outputs dq (like query), delta (fp32, like lse) and selection_keys (int32, like
    block_indices); key-major (`by_key`, None: key_major decides, as for the forward) the prepare
    launches output delta and selection_keys, and dq, with the index, its partials part_dq (like query,
    (entries, GROUP, D)) and from their sum dq.  dkdv takes delta and the inverted index and outputs
    dk_chunks, dv_chunks (fp32 (max_chunks, block_size, D / Dv), the scratch) and, from its reduction,
    dk, dv (like key, value).  Varlen rows past the last sequence are written by no program: dq, dk, dv
    are zeroed and selection_keys are 0 (no bucket) there."""
    check_index_range(shapes)
    t, scalars, constexprs, grid = _scalars_and_constexprs(shapes, softmax_scale, block_count, scan)
    _, (batch, rows) = _strides(shapes)
    dq = Launch(
        module="nsa.selected", kernel="nsa_bwd_dq_kernel", grid=grid, inputs=BWD_INPUTS, scalars=scalars,
        outputs=(Output("dq", (batch, rows, shapes.heads_q, shapes.head_dim), "like:query", zeroed=shapes.varlen),
                 Output("delta", lse_shape(shapes), "float32"),
                 Output("selection_keys", (batch, rows, shapes.heads_kv, shapes.num_slots), "int32",
                        zeroed=shapes.varlen)),
        constexprs=constexprs, num_warps=t.num_warps, num_stages=t.num_stages)
    kv = dkv_tiles(shapes)
    chunk = dkv_chunk(shapes)
    chunks = max_chunks(shapes, chunk)
    subs = shapes.block_size // kv.block_n
    scalar = dict(scalars, kv_groups=kv_groups(shapes), chunk_entries=chunk)
    const = dict(constexprs, TOKENS=kv.tokens, BLOCK_N=kv.block_n)
    prepare = ()
    if key_major(shapes) and not scan if by_key is None else by_key:
        prepare, dq = _key_major_dq(shapes, dict(scalar, max_chunks=chunks), dict(constexprs))
    reduce = Launch(
        module="nsa.selected", kernel="nsa_bwd_dkv_reduce_kernel", grid=(num_buckets(shapes) * subs, 1, 1),
        inputs=DKV_REDUCE_INPUTS, scalars=tuple((n, scalar[n]) for n in DKV_REDUCE_SCALARS),
        outputs=(Output("dk", (batch, rows, shapes.heads_kv, shapes.head_dim), "like:key", zeroed=shapes.varlen),
                 Output("dv", (batch, rows, shapes.heads_kv, shapes.head_dim_v), "like:value", zeroed=shapes.varlen)),
        constexprs=tuple((n, const[n]) for n in DKV_REDUCE_CONSTEXPRS), num_warps=8, num_stages=1,
        resume=DKV_RESUME)
    dkdv = Launch(
        module="nsa.selected", kernel="nsa_bwd_dkv_kernel", grid=(chunks * subs, 1, 1),
        inputs=DKV_INPUTS, scalars=tuple((n, scalar[n]) for n in DKV_SCALARS),
        outputs=(Output("dk_chunks", (chunks, shapes.block_size, shapes.head_dim), "float32"),
                 Output("dv_chunks", (chunks, shapes.block_size, shapes.head_dim_v), "float32")),
        constexprs=tuple((n, const[n]) for n in DKV_CONSTEXPRS),
        num_warps=kv.num_warps, num_stages=kv.num_stages, max_registers=kv.max_registers, then=reduce)
    return BackwardPlan(dq, dkdv, num_buckets(shapes), chunk, chunks, prepare)


@dataclasses.dataclass(frozen=True)
class ImportanceTiles:
    tokens: int    # tokens per program (all GROUP_PAD heads of each are its rows)
    block_c: int   # pooled blocks per step
    num_warps: int
    num_stages: int


# Rows of an importance program (importance_tiles), by input.
IMPORTANCE_ROWS = 128        # 16-bit, D <= 128
IMPORTANCE_ROWS_WIDE = 64    # 16-bit, D > 128
IMPORTANCE_ROWS_FP32 = 16    # fp32: three dots a step (tf32x3) hold more registers
# At most this many tokens a program: its [tokens, blocks] score tile grows with them (group 1 with
# 128 tokens spilled 100 bytes on sm_80).
IMPORTANCE_MAX_TOKENS = 32


def importance_tiles(shapes: NsaShapes) -> ImportanceTiles:
    """The importance kernel's tiles: 128 rows (tokens x the group's padded heads, at most 32 tokens)
    on 4 warps for 16-bit inputs at D <= 128, 64 rows at D > 128, 16 for fp32; 64 pooled blocks a step.
    Each program reads the pooled keys up to its last token's block, so rows are what divides that
    traffic, and 128 rows give the same scores to the bit as 16 (docs/lessons.md, "NSA's importance
    scores: three loops, not a branch per tile"; benchmarks/tune_nsa_select.py).  For groups of up to 16
    heads these tiles assemble without spills for sm_90 and sm_80 (ptxas -v), except fp32 at D = 256,
    which spills at any row count; larger groups (more rows than the target) can spill."""
    if shapes.dtype == "float32":
        rows = IMPORTANCE_ROWS_FP32
    else:
        rows = IMPORTANCE_ROWS_WIDE if shapes.head_dim > 128 else IMPORTANCE_ROWS
    tokens = max(1, min(IMPORTANCE_MAX_TOKENS, rows // next_pow2(shapes.group_size)))
    return ImportanceTiles(tokens, 64, 4, 2)


# Elements of a pool step (a [rows, D] tile): 64 registers a thread on 4 warps.
POOL_STEP_ELEMENTS = 8192


@plan_memo
def plan_pool(batch: int, seqlen: int, heads_kv: int, head_dim: int, head_dim_v: int, block_size: int) -> Launch:
    """The compressed branch's pooled keys and values (pool.py): inputs key (B, T, Hkv, D) and value
    (B, T, Hkv, Dv), contiguous; outputs k_cmp (B, T // block_size, Hkv, D) and v_cmp alike, in the inputs'
    dtypes.  One program per (batch, KV head, whole block)."""
    n_cmp = seqlen // block_size
    block_d, block_dv = max(16, next_pow2(head_dim)), max(16, next_pow2(head_dim_v))
    strides = (row_major_strides((batch, seqlen, heads_kv, head_dim))[:3]
               + row_major_strides((batch, seqlen, heads_kv, head_dim_v))[:3]
               + row_major_strides((batch, n_cmp, heads_kv, head_dim))[:3]
               + row_major_strides((batch, n_cmp, heads_kv, head_dim_v))[:3])
    names = ("stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_cb", "stride_cs",
             "stride_ch", "stride_pb", "stride_ps", "stride_ph")
    return Launch(
        module="nsa.pool", kernel="nsa_pool_kernel", grid=(batch * heads_kv * n_cmp, 1, 1), inputs=("key", "value"),
        scalars=tuple(zip(names, strides)) + (("num_heads", heads_kv), ("num_cmp", n_cmp)),
        outputs=(Output("k_cmp", (batch, n_cmp, heads_kv, head_dim), "like:key"),
                 Output("v_cmp", (batch, n_cmp, heads_kv, head_dim_v), "like:value")),
        constexprs=(("HEAD_DIM", head_dim), ("HEAD_DIM_V", head_dim_v), ("BLOCK_D", block_d), ("BLOCK_DV", block_dv),
                    ("BLOCK_SIZE", block_size),
                    ("ROWS", max(1, min(block_size, POOL_STEP_ELEMENTS // max(block_d, block_dv))))),
        num_warps=4, num_stages=1)


@plan_memo
def plan_importance(batch: int, seqlen: int, heads_q: int, heads_kv: int, head_dim: int, block_size: int,
                    dtype: str, softmax_scale: float, sequences: int = 0, total: int = 0,
                    pooled: int = 0) -> Launch:
    """The top-k scores (importance.py): inputs query (B, T, Hq, D), k_cmp (B, T // block_size, Hkv, D)
    and the compressed branch's lse (B, Hq, T) fp32, all contiguous; output scores fp32 (B, T, Hkv,
    cdiv(T, block_size)).  Varlen (`sequences` > 0): B = 1, `total` packed tokens of sequences of at
    most `seqlen`, inputs cu_seqlens and cu_cmp (int32, sequences + 1: where each sequence's rows of
    the `pooled` rows of k_cmp start); query (1, total, Hq, D), lse (1, Hq, total), scores (1, total,
    Hkv, cdiv(seqlen, block_size))."""
    shapes = NsaShapes(batch=batch, seqlen=seqlen, heads_q=heads_q, heads_kv=heads_kv, head_dim=head_dim,
                       head_dim_v=head_dim, num_slots=1, block_size=block_size, dtype=dtype, per_token_counts=False)
    t = importance_tiles(shapes)
    rows = total if sequences else seqlen
    n_cmp = pooled if sequences else seqlen // block_size
    n_blocks = cdiv(seqlen, block_size)
    strides = (row_major_strides((batch, rows, heads_q, head_dim))[:3]
               + row_major_strides((batch, max(n_cmp, 1), heads_kv, head_dim))[:3]
               + row_major_strides((batch, heads_q, rows))
               + row_major_strides((batch, rows, heads_kv, n_blocks))[:3])
    names = ("stride_qb", "stride_qs", "stride_qh", "stride_kb", "stride_ks", "stride_kh", "stride_lb", "stride_lh",
             "stride_ls", "stride_sb", "stride_ss", "stride_sh")
    return Launch(
        module="nsa.importance", kernel="nsa_importance_kernel",
        grid=(cdiv(seqlen, t.tokens), (sequences or batch) * heads_kv, 1),
        inputs=("query", "k_cmp", "lse", "cu_seqlens", "cu_cmp"),
        scalars=tuple(zip(names, strides)) + (("seqlen", seqlen), ("total", total), ("num_heads_kv", heads_kv),
                                              ("num_blocks", n_blocks), ("sm_scale", float(softmax_scale))),
        # (Varlen rows in no sequence are written by no program: -inf, so the top-k chooses nothing there.)
        outputs=(Output("scores", (batch, rows, heads_kv, n_blocks), "float32", zeroed=sequences > 0,
                        fill=float("-inf")),),
        constexprs=(("HEAD_DIM", head_dim), ("BLOCK_D", max(16, next_pow2(head_dim))), ("GROUP", heads_q // heads_kv),
                    ("GROUP_PAD", next_pow2(heads_q // heads_kv)), ("TOKENS", t.tokens), ("BLOCK_SIZE", block_size),
                    ("BLOCK_C", t.block_c), ("DOT_PRECISION", "tf32x3" if dtype == "float32" else "tf32"),
                    ("IS_VARLEN", sequences > 0)),
        num_warps=t.num_warps, num_stages=t.num_stages)


# The top-k kernel holds a whole score row in registers: up to this many blocks (T = 2M tokens at
# block 64).  Longer rows take the front ends' framework top-k.
TOPK_MAX_BLOCKS = 32768


def topk_tiles(block_nb: int) -> Tuple[int, int]:
    """(rows per program, num_warps) of the top-k kernel for rows of block_nb (a power of two) scores:
    2048 scores a warp (64 registers a thread), rows on one warp while they fit, so that a round's
    maximum and first index are warp shuffles, not a reduction across warps through shared memory
    (tune_nsa_select.py).  At most 4 rows, the most the sweep timed, where 4 rows on a warp beat the
    4-warp tile."""
    return max(1, min(4, 2048 // block_nb)), max(1, block_nb // 2048)


@plan_memo
def plan_topk(rows: int, num_blocks: int, count: int, causal_rows: Optional[Tuple[int, int, int]] = None
              ) -> Optional[Launch]:
    """The selection from the importance scores (importance.nsa_topk_kernel): input scores fp32
    (rows, num_blocks) contiguous, output indices int32 (rows, count).  causal_rows: (seqlen, heads_kv,
    block_size) where the rows are the importance scores' (B, seqlen, heads_kv), each -inf past its
    token's own block, so that programs read only that prefix.  None past TOPK_MAX_BLOCKS."""
    block_nb = max(16, next_pow2(num_blocks))
    if block_nb > TOPK_MAX_BLOCKS:
        return None
    rows_per_program, num_warps = topk_tiles(block_nb)
    seqlen, heads_kv, block_size = causal_rows or (1, 1, 1)
    return Launch(
        module="nsa.importance", kernel="nsa_topk_kernel", grid=(cdiv(rows, rows_per_program), 1, 1),
        inputs=("scores",), scalars=(("rows", rows), ("num_blocks", num_blocks), ("seqlen", seqlen),
                                     ("heads_kv", heads_kv)),
        outputs=(Output("indices", (rows, count), "int32"),),
        constexprs=(("COUNT", count), ("BLOCK_SLOTS", max(2, next_pow2(count))), ("BLOCK_NB", block_nb),
                    ("ROWS", rows_per_program), ("BLOCK_SIZE", block_size), ("CAUSAL_ROWS", causal_rows is not None)),
        num_warps=num_warps, num_stages=1)


# Rows of the gated sum's programs: 4096 elements at D = 128 on 4 warps.
GATE_ROWS = 32
GATE_SLOTS = 3


def _gate_common(rows: int, head_dim: int, branches: int) -> Tuple[tuple, tuple]:
    if not 1 <= branches <= GATE_SLOTS:
        raise ValueError(f"branches must be 1 to {GATE_SLOTS}, got {branches}")
    return (("rows", rows),), (("HEAD_DIM", head_dim), ("BLOCK_D", max(16, next_pow2(head_dim))), ("ROWS", GATE_ROWS),
                               ("BRANCHES", branches))


@plan_memo
def plan_gates(rows: int, head_dim: int, branches: int) -> Launch:
    """NSA's gated sum (gates.nsa_gate_kernel) of `branches` terms: inputs o<i> (rows, head_dim) and g<i>
    (rows,) for i < branches, contiguous; output out (rows, head_dim) in o's dtype."""
    scalars, constexprs = _gate_common(rows, head_dim, branches)
    return Launch(
        module="nsa.gates", kernel="nsa_gate_kernel", grid=(cdiv(rows, GATE_ROWS), 1, 1),
        inputs=tuple(f"o{i}" for i in range(GATE_SLOTS)) + tuple(f"g{i}" for i in range(GATE_SLOTS)), scalars=scalars,
        outputs=(Output("out", (rows, head_dim), "like:o0"),), constexprs=constexprs, num_warps=4, num_stages=1)


@plan_memo
def plan_gates_backward(rows: int, head_dim: int, branches: int) -> Launch:
    """Backward of plan_gates (gates.nsa_gate_bwd_kernel): input dout (rows, head_dim) beside plan_gates'
    inputs; outputs do<i> like o<i> and dg<i> (rows,) like g<i>, for i < branches."""
    scalars, constexprs = _gate_common(rows, head_dim, branches)
    used = range(branches)
    outputs = tuple(Output(f"do{i}", (rows, head_dim) if i in used else (1,), f"like:o{i}" if i in used else "float32",
                           placeholder=i not in used) for i in range(GATE_SLOTS))
    outputs += tuple(Output(f"dg{i}", (rows,) if i in used else (1,), f"like:g{i}" if i in used else "float32",
                            placeholder=i not in used) for i in range(GATE_SLOTS))
    return Launch(
        module="nsa.gates", kernel="nsa_gate_bwd_kernel", grid=(cdiv(rows, GATE_ROWS), 1, 1),
        inputs=("dout",) + tuple(f"o{i}" for i in range(GATE_SLOTS)) + tuple(f"g{i}" for i in range(GATE_SLOTS)),
        scalars=scalars, outputs=outputs, constexprs=constexprs, num_warps=4, num_stages=1)


def run_forward(plan, arrays: dict, run, index) -> dict:
    """The selected branch's forward with a front end's launcher `run(launch, arrays) -> results` and
    inverted index `index(selection_keys, plan) -> arrays`: the query-major launch, or key-major its
    selection keys, their index, then the partials and their merge."""
    if isinstance(plan, KeyMajorForward):
        keys = run(plan.keys, arrays)["selection_keys"]
        return run(plan.partial, dict(arrays, **index(keys, plan)))
    return run(plan, arrays)


def run_backward(plan: BackwardPlan, arrays: dict, run, index) -> dict:
    """The selected branch's backward, as run_forward: plan.before_index, the inverted index of their
    selection keys, then plan.with_index (each launch sees the earlier ones' results)."""
    grads = {}
    for launch in plan.before_index:
        grads.update(run(launch, dict(arrays, **grads)))
    found = index(grads["selection_keys"], plan)
    for launch in plan.with_index:
        grads.update(run(launch, dict(arrays, **found, **grads)))
    return grads
