"""Native sparse attention (NSA) for torch: the selected branch on the shared Triton kernels
(kernels/nsa), the compressed and sliding branches on flash_attention (the compressed one
phase-folded, nsa.compressed_launches).

    token t, KV group h:   compressed  pooled blocks c with (c+1)*bs - 1 <= t
                           selected    keys j <= t in the blocks block_indices[t, h, :count]
                           sliding     keys t - window_size <= j <= t
    out = g_cmp * compressed + g_slc * selected + g_swa * sliding

Each kernel call is a torch.library custom op with a fake impl (nsa_pool, nsa_top_blocks, nsa_selected_fwd /
_bwd, nsa_gates / _bwd), so torch.compile(fullgraph=True) traces NSA as flash_attention's ops are traced;
autograd.Functions over them call the implementations directly in eager mode (flash.py's layering).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .. import nsa as checks
from ..kernels.nsa import plan as nsa_plan
from ..validation import dtype_name
from . import _launch
from .flash import _cpu_upcast, flash_attention, flash_attn_varlen_func, host_table, table_values

Tensor = torch.Tensor
# Tokens per chunk of the top-k: bounds its (tokens, Hkv, blocks) temporaries.
SELECT_CHUNK = 1024


def _op(name: str, impl):
    return torch.library.custom_op(f"dualattn::{name}", mutates_args=(), device_types=("cpu", "cuda"))(impl)


def _call(op, impl, *args):
    """The custom op while torch.compile traces (one opaque node, shaped by its fake impl); in eager mode
    its implementation, without the op dispatch's host time (as flash.py's _FlashAttention)."""
    return op(*args) if torch.compiler.is_compiling() else impl(*args)


def _selected_inputs(query, key, value, block_indices, block_counts, cu_seqlens):
    counts = block_counts if isinstance(block_counts, Tensor) else None
    return dict(query=_cpu_upcast(query.contiguous()), key=_cpu_upcast(key.contiguous()),
                value=_cpu_upcast(value.contiguous()), block_indices=block_indices.to(torch.int32).contiguous(),
                block_counts=None if counts is None else counts.to(torch.int32).contiguous(),
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.to(torch.int32).contiguous())


def inverted_index(selection_keys: Tensor, plan) -> dict:
    """The int32 index of the key-major passes (kernels/nsa/plan.py: BackwardPlan's dK / dV, KeyMajorForward's
    partials; `plan` gives buckets, chunk_entries and max_chunks): the selection
    entries sorted by bucket key, stably (in token order within a bucket), where each of the buckets'
    lists starts (key 0, entries that do not count, sorts first), and the lists' chunks."""
    keys, order = torch.sort(selection_keys.flatten(), stable=True)
    starts = torch.searchsorted(keys, torch.arange(1, plan.buckets + 2, dtype=keys.dtype, device=keys.device),
                                out_int32=True)
    chunks = (starts[1:] - starts[:-1] + plan.chunk_entries - 1) // plan.chunk_entries
    chunk_starts = torch.cat([starts.new_zeros(1), chunks.cumsum(0, dtype=torch.int32)])
    # Chunk p's bucket: the last whose chunks start at or before p (the bucket count past the last chunk).
    programs = torch.arange(plan.max_chunks, dtype=torch.int32, device=keys.device)
    chunk_buckets = torch.searchsorted(chunk_starts, programs, right=True, out_int32=True) - 1
    return dict(entry_order=order.to(torch.int32), bucket_starts=starts, chunk_buckets=chunk_buckets,
                chunk_starts=chunk_starts)


def _gate_arrays(outs, gates) -> dict:
    arrays = {}
    for i, (o, g) in enumerate(zip(outs, gates)):
        if o is not None:
            arrays[f"o{i}"], arrays[f"g{i}"] = _cpu_upcast(o.contiguous()), _cpu_upcast(g.contiguous())
    return arrays


def _gates_impl(o0: Tensor, o1: Optional[Tensor], o2: Optional[Tensor], g0: Tensor, g1: Optional[Tensor],
                g2: Optional[Tensor]) -> Tensor:
    """sum over the slots i holding a branch of g_i[..., None] * o_i, in o0's dtype (kernels/nsa/gates.py)."""
    arrays = _gate_arrays((o0, o1, o2), (g0, g1, g2))
    launch = nsa_plan.plan_gates(o0.shape[:-1].numel(), o0.shape[-1], len(arrays) // 2)
    return _launch.run(launch, arrays)["out"].view(o0.shape).to(o0.dtype)


def _gates_bwd_impl(dout: Tensor, o0: Tensor, o1: Optional[Tensor], o2: Optional[Tensor], g0: Tensor,
                    g1: Optional[Tensor], g2: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                          Tensor]:
    """(d o0, d o1, d o2, d g0, d g1, d g2), empty for an empty slot."""
    outs, gates = (o0, o1, o2), (g0, g1, g2)
    arrays = dict(_gate_arrays(outs, gates), dout=_cpu_upcast(dout.to(o0.dtype).contiguous()))
    branches = len(arrays) // 2
    grads = _launch.run(nsa_plan.plan_gates_backward(o0.shape[:-1].numel(), o0.shape[-1], branches), arrays)
    empty = o0.new_empty((0,))
    return (tuple(grads[f"do{i}"].view(o.shape).to(o.dtype) if i < branches else empty for i, o in enumerate(outs))
            + tuple(grads[f"dg{i}"].view(g.shape).to(g.dtype) if i < branches else empty
                    for i, g in enumerate(gates)))


nsa_gates = _op("nsa_gates", _gates_impl)
nsa_gates_bwd = _op("nsa_gates_bwd", _gates_bwd_impl)


@nsa_gates.register_fake
def _(o0, o1, o2, g0, g1, g2):
    return torch.empty_like(o0)


@nsa_gates_bwd.register_fake
def _(dout, o0, o1, o2, g0, g1, g2):
    return tuple(torch.empty_like(x) if x is not None else o0.new_empty((0,)) for x in (o0, o1, o2, g0, g1, g2))


class _GatedSum(torch.autograd.Function):
    """Sum over the branches given (o not None) of g[..., None] * o, in `dtype`, and its backward: one
    pass each (kernels/nsa/gates.py), where torch ran a multiply per branch and the adds.  The branches
    given fill slots 0, 1, 2 in order."""

    @staticmethod
    def forward(ctx, dtype, g_cmp, o_cmp, g_slc, o_slc, g_swa, o_swa):
        terms = [(g, o.to(dtype)) for g, o in ((g_cmp, o_cmp), (g_slc, o_slc), (g_swa, o_swa)) if o is not None]
        slots = terms + [(None, None)] * (3 - len(terms))
        outs, gates = [o for _, o in slots], [g for g, _ in slots]
        ctx.save_for_backward(*outs, *gates)
        ctx.present = tuple(o is not None for o in (o_cmp, o_slc, o_swa))
        return _call(nsa_gates, _gates_impl, *outs, *gates)

    @staticmethod
    def backward(ctx, dout):
        grads = _call(nsa_gates_bwd, _gates_bwd_impl, dout, *ctx.saved_tensors)
        result, slot = [None], 0
        for present in ctx.present:
            if present:
                result += [grads[3 + slot], grads[slot]]
                slot += 1
            else:
                result += [None, None]
        return tuple(result)


def _cat(parts: list, dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)   # (cat copies even one part)


def _selected_shapes(query, value, block_indices, block_counts, cu_seqlens, block_size: int, seqlen: int,
                     sequences: int, rows_covered: bool = False) -> nsa_plan.NsaShapes:
    """The NsaShapes nsa.selected_shapes gave, from the tensors and what a varlen table's values decide
    (the longest sequence, their number, whether they cover every token: they cross the custom ops'
    boundary as numbers)."""
    b, t, hq, d = query.shape
    varlen = cu_seqlens is not None
    return nsa_plan.NsaShapes(batch=b, seqlen=seqlen, heads_q=hq, heads_kv=value.shape[2], head_dim=d,
                              head_dim_v=value.shape[3], num_slots=block_indices.shape[3], block_size=block_size,
                              dtype=dtype_name(query), per_token_counts=block_counts is not None, varlen=varlen,
                              sequences=sequences, total=t if varlen else 0, rows_covered=rows_covered)


def _selected_fwd_impl(query: Tensor, key: Tensor, value: Tensor, block_indices: Tensor,
                       block_counts: Optional[Tensor], cu_seqlens: Optional[Tensor], block_size: int, seqlen: int,
                       sequences: int, softmax_scale: float, count: int, rows_covered: bool) -> Tuple[Tensor, Tensor]:
    """(out in the query's dtype, lse fp32 (B, T, Hq)) of the selected branch."""
    shapes = _selected_shapes(query, value, block_indices, block_counts, cu_seqlens, block_size, seqlen, sequences,
                              rows_covered)
    arrays = _selected_inputs(query, key, value, block_indices, block_counts, cu_seqlens)
    res = nsa_plan.run_forward(nsa_plan.plan_forward(shapes, softmax_scale, count), arrays, _launch.run,
                               inverted_index)
    return res["out"].to(query.dtype), res["lse"]


def _selected_bwd_impl(dout: Tensor, out: Tensor, lse: Tensor, query: Tensor, key: Tensor, value: Tensor,
                       block_indices: Tensor, block_counts: Optional[Tensor], cu_seqlens: Optional[Tensor],
                       block_size: int, seqlen: int, sequences: int, softmax_scale: float,
                       count: int, rows_covered: bool) -> Tuple[Tensor, Tensor, Tensor]:
    shapes = _selected_shapes(query, value, block_indices, block_counts, cu_seqlens, block_size, seqlen, sequences)
    arrays = _selected_inputs(query, key, value, block_indices, block_counts, cu_seqlens)
    arrays.update(out=_cpu_upcast(out.contiguous()), lse=lse)
    arrays["dout"] = _cpu_upcast(dout.contiguous()).to(arrays["out"].dtype)
    grads = nsa_plan.run_backward(nsa_plan.plan_backward(shapes, softmax_scale, count), arrays, _launch.run,
                                  inverted_index)
    return grads["dq"].to(query.dtype), grads["dk"].to(key.dtype), grads["dv"].to(value.dtype)


nsa_selected_fwd = _op("nsa_selected_fwd", _selected_fwd_impl)
nsa_selected_bwd = _op("nsa_selected_bwd", _selected_bwd_impl)


@nsa_selected_fwd.register_fake
def _(query, key, value, block_indices, block_counts, cu_seqlens, *statics):
    b, t, hq, _ = query.shape
    return query.new_empty((b, t, hq, value.shape[-1])), query.new_empty((b, t, hq), dtype=torch.float32)


@nsa_selected_bwd.register_fake
def _(dout, out, lse, query, key, value, *rest):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


class _SelectedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, block_indices, block_counts, cu_seqlens, statics: tuple):
        # Contiguous and int32 once, here: the backward reuses what is saved (no second copy of either).
        query, key, value = (x.contiguous() for x in (query, key, value))
        block_indices, block_counts, cu_seqlens = (None if x is None else x.to(torch.int32).contiguous()
                                                   for x in (block_indices, block_counts, cu_seqlens))
        out, lse = _call(nsa_selected_fwd, _selected_fwd_impl, query, key, value, block_indices, block_counts,
                         cu_seqlens, *statics)
        ctx.save_for_backward(query, key, value, out, lse, block_indices, block_counts, cu_seqlens)
        ctx.statics = statics
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, idx, counts, cu = ctx.saved_tensors
        dq, dk, dv = _call(nsa_selected_bwd, _selected_bwd_impl, dout, out, lse, q, k, v, idx, counts, cu,
                           *ctx.statics)
        return dq, dk, dv, None, None, None, None


def _check_tensors(**tensors):
    ref = tensors["query"]
    for name, t in tensors.items():
        if t is None or name == "block_counts" and not isinstance(t, Tensor):   # an int: checks.check_selection
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != ref.device and not (name == "cu_seqlens" and t.device.type == "cpu"):
            raise ValueError(f"{name} is on {t.device} but query is on {ref.device}: all tensors must share one "
                             f"device (cu_seqlens may also be on the CPU)")


def _cu_values(cu_seqlens: Optional[Tensor]):
    """cu_seqlens' values: read from the device once per table (flash.table_values), or from the CPU."""
    return None if cu_seqlens is None else table_values(cu_seqlens)


def _on_device(cu_seqlens: Optional[Tensor], cu_values, device: torch.device) -> Optional[Tensor]:
    """The checked table on the inputs' device: a CPU table's copy, made once per values."""
    if cu_seqlens is None or cu_seqlens.device == device:
        return cu_seqlens
    return _device_table(tuple(cu_values), device)


@functools.lru_cache(maxsize=64)
def _device_table(cu: Tuple[int, ...], device: torch.device) -> Tensor:
    return host_table(cu, device)


def apply_native_sparse_attention(query: Tensor, key: Tensor, value: Tensor, block_indices: Tensor,
                                  block_counts=16, block_size: int = 64, softmax_scale: Optional[float] = None,
                                  cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """NSA's selected branch: each token attends the key blocks its KV group selected (BSHD, GQA).

    Args:
        query (B, T, Hq, D); key (B, T, Hkv, D); value (B, T, Hkv, Dv): fp16, bf16 or fp32, Hq % Hkv == 0.
        block_indices: int (B, T, Hkv, S), the key blocks (of block_size tokens) each token attends,
            shared by the query heads of a KV group.  Entries past the count, negative, or after the
            token's own block are ignored; a block named twice counts once.
        block_counts: int, or int (B, T, Hkv): how many of the S entries count.
        block_size: 16, 32, 64, 128 or 256.
        softmax_scale: defaults to D ** -0.5.
        cu_seqlens: int (n_seqs + 1,) for packed sequences (B = 1); indices count from each sequence's start.
            The front end reads its values on the host: a CUDA table once (a synchronisation; again only
            after an in-place change), a CPU table (as a data loader makes it) with no synchronisation.
    Token t attends key j iff j <= t and j // block_size is selected:

        keys    [blk 0 ][blk 1 ][blk 2 ][blk 3 ]
        t=50    [######]........[##.....]            (selected {0, 2}, block 3 ignored, causal in 2)

    Returns (B, T, Hq, Dv) in the query's dtype; a token with nothing selected gets 0.
    """
    _check_tensors(query=query, key=key, value=value, block_indices=block_indices, block_counts=block_counts,
                   cu_seqlens=cu_seqlens)
    return _selected(query, key, value, block_indices, block_counts, block_size, softmax_scale, cu_seqlens,
                     _cu_values(cu_seqlens))


def _selected(query, key, value, block_indices, block_counts, block_size, softmax_scale, cu_seqlens, cu_values):
    """apply_native_sparse_attention after its type checks, with cu_seqlens' values read once by the caller."""
    shapes, count = checks.selected_shapes(query, key, value, block_indices, block_counts, block_size,
                                           cu_seqlens, cu_values)
    cu_seqlens = _on_device(cu_seqlens, cu_values, query.device)
    scale = checks.default_scale(shapes.head_dim, softmax_scale)
    counts = None if count is not None else block_counts
    statics = (shapes.block_size, shapes.seqlen, shapes.sequences, scale, count or 0, shapes.rows_covered)
    return _SelectedAttention.apply(query, key, value, block_indices, counts, cu_seqlens, statics)


def _pool_impl(key: Tensor, value: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """The pooled keys and values of the whole blocks (kernels/nsa/pool.py: one launch for both)."""
    b, t, hkv, d = key.shape
    res = _launch.run(nsa_plan.plan_pool(b, t, hkv, d, value.shape[-1], block_size),
                      dict(key=_cpu_upcast(key.contiguous()), value=_cpu_upcast(value.contiguous())))
    return res["k_cmp"].to(key.dtype), res["v_cmp"].to(value.dtype)


nsa_pool = _op("nsa_pool", _pool_impl)


@nsa_pool.register_fake
def _(key, value, block_size):
    n = key.shape[1] // block_size
    return tuple(x.new_empty((x.shape[0], n, *x.shape[2:])) for x in (key, value))


class _Pool(torch.autograd.Function):
    """nsa_pool and its backward: each token of a whole block gets its block's gradient / block_size (in
    fp32, as a mean's), the tail tokens 0."""

    @staticmethod
    def forward(ctx, key, value, block_size):
        ctx.block_size, ctx.seqlen = block_size, key.shape[1]
        return _call(nsa_pool, _pool_impl, key, value, block_size)

    @staticmethod
    def backward(ctx, dk_cmp, dv_cmp):
        def spread(g):
            b, n, h, d = g.shape
            each = (g.float() / ctx.block_size).to(g.dtype)[:, :, None].expand(b, n, ctx.block_size, h, d)
            return torch.nn.functional.pad(each.reshape(b, n * ctx.block_size, h, d),
                                           (0, 0, 0, 0, 0, ctx.seqlen - n * ctx.block_size))
        return spread(dk_cmp), spread(dv_cmp), None


def _compressed(query, key, value, block_size: int, scale: float, deterministic: bool):
    """Compressed branch of one sequence: (out (B, T, Hq, Dv), lse (B, Hq, T) or None, pooled keys), as
    dense flash launches (nsa.compressed_launches says how)."""
    b, t, hq, _ = query.shape
    rows = checks.compressed_batch_rows(hq, block_size)
    if b > rows:   # (split, not slices: see _token_parts)
        parts = [_compressed(*part, block_size, scale, deterministic)
                 for part in zip(*(torch.split(x, rows) for x in (query, key, value)))]
        return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))
    n, body, tail = checks.compressed_launches(t, block_size)
    if n == 0:   # no complete block: no token sees any
        return _unseen(query, key, value), None, None
    k_cmp, v_cmp = _Pool.apply(key, value, block_size)
    attend = functools.partial(flash_attention, softmax_scale=scale, return_lse=True, deterministic=deterministic)
    # (split, not slices: see _token_parts)
    q_body, q_tail = torch.split(query, [body, tail], dim=1) if tail else (query, None)
    if n > 1:
        def tiled(x):   # (B, n - 1, bs * H, D): the first n - 1 pooled blocks, once per phase
            return x[:, :n - 1, None].expand(b, n - 1, block_size, *x.shape[2:]).reshape(b, n - 1, -1, x.shape[-1])
        out, lse = attend(q_body.reshape(b, n, block_size * hq, -1), tiled(k_cmp), tiled(v_cmp), causal=True)
        out = out.reshape(b, body, hq, -1)
        lse = lse.view(b, block_size, hq, n).permute(0, 2, 3, 1).reshape(b, hq, body)
    else:   # one block: only its last token sees it
        out = query.new_zeros(b, body, hq, value.shape[-1])
        lse = torch.full((b, hq, body), float("-inf"), device=query.device)
    if tail:
        o_tail, lse_tail = attend(q_tail, k_cmp, v_cmp)
        out, lse = torch.cat([out, o_tail], 1), torch.cat([lse, lse_tail], 2)
    last = torch.arange(block_size - 1, body, block_size, device=query.device)
    o_last, lse_last = attend(query[:, block_size - 1:body:block_size], k_cmp, v_cmp, causal=True)
    return _rows_replaced(out, 1, last, o_last), _rows_replaced(lse, 2, last, lse_last), k_cmp


def _token_parts(x: Tensor, parts: list) -> tuple:
    """x's (B, hi - lo, ...) token ranges of `parts` ([(lo, hi, table)], nsa.compressed_parts), which tile the
    axis (check_native: cu_seqlens runs from 0 to the packed length): x itself for one, else torch.split's
    views, whose backward writes the parts' gradients into one tensor once.  A slice's backward fills a zero
    tensor of x's size and copies its part in, and autograd then adds those tensors, per part (1 GB each for
    q at T = 64k, Hq = 64)."""
    if len(parts) == 1:
        return (x,)
    return torch.split(x, [hi - lo for lo, hi, _ in parts], dim=1)


def _unseen(query, key, value) -> Tensor:
    """The compressed output where no token sees a pooled block: zeros that autograd links to q, k and v, so
    their gradients are zeros (as in JAX), not missing; `where` passes no inf or NaN of theirs."""
    none = torch.zeros((), dtype=torch.bool, device=query.device)
    linked = sum(torch.where(none, x, 0).sum() for x in (query, key, value))
    return linked.expand(*query.shape[:3], value.shape[-1]).to(query.dtype)


@functools.lru_cache(maxsize=64)
def _packed_rows(cu: Tuple[int, ...], block_size: int, device: torch.device) -> dict:
    """nsa.packed_compressed's index arrays on `device` (int64) and its tables and cu_seqlens (int32,
    flash.host_table: checked from their values, so the varlen flash calls do not read them back), made
    once per table: every NSA layer of a step packs the same sequences.  Never written."""
    lay = checks.packed_compressed(cu, block_size)
    arrays = {"cu_seqlens": _device_table(cu, device)}
    for name in ("body_rows", "tail_rows", "order", "last_rows", "fold_keys", "fold_q_ids", "fold_kv_ids"):
        a = getattr(lay, name)
        arrays[name] = None if a is None else torch.from_numpy(a).to(device, non_blocking=True)
    for name in ("cu_blocks", "cu_tail"):
        arrays[name] = host_table(getattr(lay, name).tolist(), device)
    return arrays


def _compressed_packed(query, key, value, cu: list, block_size: int, scale: float, deterministic: bool):
    """Compressed branch of packed sequences (query (1, T, Hq, D) holding them, cu their table from 0):
    (out (1, T, Hq, Dv), lse (1, Hq, T) or None, pooled keys (1, blocks, Hkv, D) or None, the pooled
    blocks' table), as _compressed's launches, each one call for every sequence: the folded one with
    segment ids, the others varlen (nsa.packed_compressed)."""
    lay = checks.packed_compressed(cu, block_size)
    device, (t, hq, d), dv = query.device, query.shape[1:], value.shape[-1]
    rows = _packed_rows(tuple(cu), block_size, device)
    cu_blocks, n = rows["cu_blocks"], int(lay.cu_blocks[-1])
    if n == 0:   # no sequence has a whole block
        return _unseen(query, key, value), None, None, cu_blocks
    # squeeze, not [0]: the backward of a select allocates a zero tensor of the input's size and copies the
    # gradient into it (two passes over 1 GB for q at T = 64k, Hq = 64), where a squeeze's is a view
    q, k, v = query.squeeze(0), key.squeeze(0), value.squeeze(0)
    if lay.body_rows is not None:
        body = rows["body_rows"]
        qb, kb, vb = q[body], k[body], v[body]
    else:
        qb, kb, vb = q, k, v
    k_cmp, v_cmp = _Pool.apply(kb[None], vb[None], block_size)
    attend = functools.partial(flash_attn_varlen_func, softmax_scale=scale, return_lse=True,
                               deterministic=deterministic)
    if lay.max_prev > 0:
        keys = rows["fold_keys"]

        def tiled(x):   # (1, blocks, bs * H, D): the pooled blocks shifted one block, once per phase
            x = x[0, keys]
            return x[:, None].expand(n, block_size, *x.shape[1:]).reshape(1, n, -1, x.shape[-1])
        out, lse = flash_attention(qb.reshape(1, n, block_size * hq, d), tiled(k_cmp), tiled(v_cmp), causal=True,
                                   q_segment_ids=rows["fold_q_ids"], kv_segment_ids=rows["fold_kv_ids"],
                                   softmax_scale=scale, return_lse=True, deterministic=deterministic)
        out = out.reshape(n * block_size, hq, dv)
        lse = lse.view(block_size, hq, n).permute(1, 2, 0).reshape(hq, n * block_size)
    else:   # one block a sequence at most: only its last token sees it
        out = query.new_zeros(n * block_size, hq, dv)
        lse = torch.full((hq, n * block_size), float("-inf"), device=device)
    if lay.order is not None:
        tail, order = rows["tail_rows"], rows["order"]
        o_tail, lse_tail = attend(q[tail], k_cmp[0], v_cmp[0], rows["cu_tail"], cu_blocks, lay.max_tail,
                                  lay.max_blocks)
        out, lse = torch.cat([out, o_tail])[order], torch.cat([lse, lse_tail], 1)[:, order]
    last = rows["last_rows"]
    o_last, lse_last = attend(q[last], k_cmp[0], v_cmp[0], cu_blocks, cu_blocks, lay.max_blocks, lay.max_blocks,
                              causal=True)
    out, lse = _rows_replaced(out, 0, last, o_last), _rows_replaced(lse, 1, last, lse_last)
    return out[None], lse[None], k_cmp, cu_blocks


def _rows_replaced(x: Tensor, dim: int, index: Tensor, rows: Tensor) -> Tensor:
    """x with `rows` at `index` along dim: in place unless autograd holds x (flash_attention's backward
    saves its output), which spares a copy of the whole branch output (1 GB at T = 64k, Hq = 64, bf16)."""
    return x.index_copy(dim, index, rows) if x.requires_grad else x.index_copy_(dim, index, rows)


def top_k_lowest_ties(score: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries of `score` along its last axis, by decreasing value, ties to
    the lower index.  torch.topk leaves the order of ties open (and torch.sort of every row costs
    ~log(n) passes more): take the k-th largest value, every entry above it and the lowest-indexed
    entries equal to it, then order those k by a stable sort."""
    n = score.shape[-1]
    kth = torch.topk(score, k, dim=-1).values[..., -1:]
    above = score > kth
    tied = score == kth
    chosen = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    positions = torch.arange(n, device=score.device).expand_as(score)
    index = torch.topk(torch.where(chosen, positions, n), k, dim=-1, largest=False).values   # ascending
    order = torch.sort(score.gather(-1, index), dim=-1, descending=True, stable=True).indices
    return index.gather(-1, order)


def _top_blocks_impl(query: Tensor, k_cmp: Optional[Tensor], lse: Optional[Tensor], heads_kv: int, block_size: int,
                     count: int, softmax_scale: float, cu_seqlens: Optional[Tensor] = None,
                     cu_blocks: Optional[Tensor] = None, longest: int = 0) -> Tensor:
    """Per token and KV group: the own block first, then the blocks of highest compressed probability
    summed over the group's heads (kernels/nsa/importance.py), ties to the lower index; -1 where fewer
    blocks exist.  int32 (B, T, Hkv, count).  Packed sequences: cu_seqlens their table, cu_blocks
    _compressed_packed's, longest the longest sequence; k_cmp and lse _compressed_packed's."""
    b, t, hq, d = query.shape
    if k_cmp is None:   # no complete block: only the own blocks have a score
        k_cmp = query.new_zeros(b, 1, heads_kv, d)
        lse = torch.full((b, hq, t), float("-inf"), device=query.device)
    if cu_seqlens is None:
        launch = nsa_plan.plan_importance(b, t, hq, heads_kv, d, block_size, dtype_name(query), softmax_scale)
        causal_rows = (t, heads_kv, block_size)
    else:   # (rows are -inf past their own block, but their token's position is not the row's: full rows)
        launch = nsa_plan.plan_importance(b, longest, hq, heads_kv, d, block_size, dtype_name(query), softmax_scale,
                                          sequences=cu_seqlens.shape[0] - 1, total=t, pooled=k_cmp.shape[1])
        causal_rows = None
    scores = _launch.run(launch, dict(query=_cpu_upcast(query.contiguous()), k_cmp=_cpu_upcast(k_cmp.contiguous()),
                                      lse=lse.float().contiguous(), cu_seqlens=cu_seqlens,
                                      cu_cmp=cu_blocks))["scores"]
    n_blocks = scores.shape[-1]
    topk = nsa_plan.plan_topk(b * t * heads_kv, n_blocks, count, causal_rows)
    if topk is not None:
        return _launch.run(topk, dict(scores=scores))["indices"].view(b, t, heads_kv, count)
    take = min(count, n_blocks)
    out = torch.full((b, t, heads_kv, count), -1, dtype=torch.int32, device=query.device)
    for lo in range(0, t, SELECT_CHUNK):   # bounds top_k_lowest_ties' temporaries
        chunk = scores[:, lo:lo + SELECT_CHUNK]
        index = top_k_lowest_ties(chunk, take)
        out[:, lo:lo + SELECT_CHUNK, :, :take] = torch.where(chunk.gather(-1, index) == float("-inf"), -1,
                                                             index).to(torch.int32)
    return out


nsa_top_blocks = _op("nsa_top_blocks", _top_blocks_impl)


@nsa_top_blocks.register_fake
def _(query, k_cmp, lse, heads_kv, block_size, count, softmax_scale, cu_seqlens=None, cu_blocks=None, longest=0):
    return query.new_empty((*query.shape[:2], heads_kv, count), dtype=torch.int32)


@torch.no_grad()
def _top_blocks(query, k_cmp, lse, heads_kv: int, block_size: int, count: int, scale: float, cu_seqlens=None,
                cu_blocks=None, longest: int = 0) -> Tensor:
    """The chosen blocks (_top_blocks_impl); not differentiated."""
    return _call(nsa_top_blocks, _top_blocks_impl, query, k_cmp, lse, heads_kv, block_size, count, scale,
                 cu_seqlens, cu_blocks, longest)


def native_sparse_attention(query: Tensor, key: Tensor, value: Tensor, g_cmp: Optional[Tensor] = None,
                            g_slc: Optional[Tensor] = None, g_swa: Optional[Tensor] = None,
                            block_indices: Optional[Tensor] = None, block_counts=16, block_size: int = 64,
                            window_size: int = 0, softmax_scale: Optional[float] = None,
                            cu_seqlens: Optional[Tensor] = None, return_block_indices: bool = False,
                            deterministic: bool = False):
    """Native sparse attention: gated sum of the compressed, selected and sliding-window branches.

    Args:
        query (B, T, Hq, D), key (B, T, Hkv, D), value (B, T, Hkv, Dv): as apply_native_sparse_attention.
        g_cmp, g_slc, g_swa: gates (B, T, Hq) of the branches; a branch whose gate is None is left out.
        block_indices: int (B, T, Hkv, S), or None to select from the compressed scores: per token and
            KV group the compressed probabilities summed over the group's heads, the token's own block
            always, then the top block_counts (an int then), ties to the lower index.
        block_counts, block_size, softmax_scale, cu_seqlens: as apply_native_sparse_attention.
        window_size: the sliding branch's keys t - window_size <= j <= t (0: no sliding branch).
        return_block_indices: also return the (B, T, Hkv, S) indices the selected branch used.
        deterministic: the compressed and sliding branches' flash backward without the one-pass
            Hopper kernel's dQ atomics (flash_attention's flag; also under
            torch.use_deterministic_algorithms(True)): bitwise reproducible gradients.  The selected
            branch has no atomics.
    Compressed branch: attention over the mean of each block's keys / values; token t sees pooled
    block c iff (c + 1) * block_size - 1 <= t.  Gradients reach query, key, value and every gate
    (not through the top-k choice).
    """
    _check_tensors(query=query, key=key, value=value, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa,
                   block_indices=block_indices, block_counts=block_counts, cu_seqlens=cu_seqlens)
    cu_values = _cu_values(cu_seqlens)
    _, t, _, hkv, _, block_size, window_size, scale, need_selection, count = checks.check_native(
        query, key, value, gates=dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa), block_indices=block_indices,
        block_counts=block_counts, block_size=block_size, window_size=window_size, softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens, cu_values=cu_values, return_block_indices=return_block_indices,
        deterministic=deterministic)
    cu_seqlens = _on_device(cu_seqlens, cu_values, query.device)
    o_cmp = o_slc = o_swa = None
    if g_cmp is not None or (block_indices is None and need_selection):
        outs, chosen = [], []
        parts = checks.compressed_parts(cu_values, t, query.shape[2])
        for (_, _, cu), *part in zip(parts, *(_token_parts(x, parts) for x in (query, key, value))):
            if cu is None:
                o, lse, k_cmp = _compressed(*part, block_size, scale, deterministic)
                cu_seqs = cu_blocks = None
            else:
                o, lse, k_cmp, cu_blocks = _compressed_packed(*part, cu, block_size, scale, deterministic)
                cu_seqs = _packed_rows(tuple(cu), block_size, query.device)["cu_seqlens"]
            outs.append(o)
            if block_indices is None and need_selection:
                chosen.append(_top_blocks(part[0], k_cmp, lse, hkv, block_size, count, scale, cu_seqs, cu_blocks,
                                          max(b - a for a, b in zip(cu[:-1], cu[1:])) if cu else 0))
        if g_cmp is not None:
            o_cmp = _cat(outs, 1)
        if chosen:
            block_indices = _cat(chosen, 1)
    if g_slc is not None:
        o_slc = _selected(query, key, value, block_indices, block_counts, block_size, scale, cu_seqlens, cu_values)
    if g_swa is not None:   # (check_native: a sliding gate comes with a window)
        if cu_seqlens is None:
            o_swa = flash_attention(query, key, value, causal=True, sliding_window=(window_size, 0),
                                    softmax_scale=scale, deterministic=deterministic)
        else:
            longest = max(hi - lo for lo, hi in checks.sequences(cu_values, t))
            o_swa = flash_attn_varlen_func(query.squeeze(0), key.squeeze(0), value.squeeze(0), cu_seqlens,
                                           cu_seqlens, longest, longest, causal=True,
                                           sliding_window=(window_size, 0), softmax_scale=scale,
                                           deterministic=deterministic)[None]
    out = _GatedSum.apply(query.dtype, g_cmp, o_cmp, g_slc, o_slc, g_swa, o_swa)
    return (out, block_indices) if return_block_indices else out
