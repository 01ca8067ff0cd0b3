"""Native sparse attention (NSA) for JAX: backend "triton" (the shared kernels of kernels/nsa under a
custom_vjp; jax-triton on GPU, Triton's interpreter on CPU), "xla" (pure JAX) or "auto".

The compressed branch (phase-folded, nsa.compressed_launches) and the sliding branch run on
flash_attention, both with the same backend.  With "triton" the pooled keys and values and the gated sum
come from the shared kernels too (kernels/nsa/pool.py, gates.py), so that the chosen blocks and the
output are the torch front end's bits; "xla" computes them with jnp.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from .. import nsa as checks
from ..kernels.nsa import plan as nsa_plan
from . import _launch
from .flash import _resolve_backend, check_arrays, flash_attention, flash_attention_varlen

SELECT_CHUNK = 1024


@dataclasses.dataclass(frozen=True)
class _SelectedCall:
    """The static part of a selected-branch call: the one non-differentiable argument of the custom_vjp."""
    shapes: nsa_plan.NsaShapes
    softmax_scale: float
    block_count: int


def _int_inputs(block_indices, block_counts, cu_seqlens) -> dict:
    return dict(block_indices=block_indices.astype(jnp.int32),
                block_counts=None if block_counts is None else block_counts.astype(jnp.int32),
                cu_seqlens=None if cu_seqlens is None else cu_seqlens.astype(jnp.int32))


def _selected_forward(call: _SelectedCall, query, key, value, block_indices, block_counts, cu_seqlens):
    arrays = dict(query=query, key=key, value=value, **_int_inputs(block_indices, block_counts, cu_seqlens))
    res = nsa_plan.run_forward(nsa_plan.plan_forward(call.shapes, call.softmax_scale, call.block_count), arrays,
                               _launch.run, inverted_index)
    return res["out"], (query, key, value, res["out"], res["lse"], block_indices, block_counts, cu_seqlens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _selected(call: _SelectedCall, query, key, value, block_indices, block_counts, cu_seqlens):
    return _selected_forward(call, query, key, value, block_indices, block_counts, cu_seqlens)[0]


def inverted_index(selection_keys, plan) -> dict:
    """As the torch front end's (dualattn.torch_api.nsa.inverted_index): int32 throughout, since JAX
    has no int64 without x64 (plan.check_index_range bounds the keys); static shapes."""
    flat = selection_keys.reshape(-1)
    keys, order = jax.lax.sort((flat, jnp.arange(flat.shape[0], dtype=jnp.int32)), num_keys=1, is_stable=True)
    starts = jnp.searchsorted(keys, jnp.arange(1, plan.buckets + 2, dtype=keys.dtype)).astype(jnp.int32)
    chunks = (starts[1:] - starts[:-1] + plan.chunk_entries - 1) // plan.chunk_entries
    chunk_starts = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(chunks, dtype=jnp.int32)])
    programs = jnp.arange(plan.max_chunks, dtype=jnp.int32)
    chunk_buckets = (jnp.searchsorted(chunk_starts, programs, side="right") - 1).astype(jnp.int32)
    return dict(entry_order=order, bucket_starts=starts, chunk_buckets=chunk_buckets, chunk_starts=chunk_starts)


def _selected_backward(call: _SelectedCall, residuals, dout):
    query, key, value, out, lse, block_indices, block_counts, cu_seqlens = residuals
    arrays = dict(query=query, key=key, value=value, out=out, dout=dout.astype(out.dtype), lse=lse,
                  **_int_inputs(block_indices, block_counts, cu_seqlens))
    grads = nsa_plan.run_backward(nsa_plan.plan_backward(call.shapes, call.softmax_scale, call.block_count), arrays,
                                  _launch.run, inverted_index)
    return (grads["dq"], grads["dk"].astype(key.dtype), grads["dv"].astype(value.dtype), None, None, None)


_selected.defvjp(_selected_forward, _selected_backward)


def _concrete(x) -> Optional[list]:
    """The values of a concrete array (None for a tracer)."""
    if x is None or isinstance(x, jax.core.Tracer):
        return None
    return [int(v) for v in np.asarray(x)]


def _backend(backend: str) -> str:
    backend = _resolve_backend(backend)
    return "xla" if backend == "pallas" else backend   # no Pallas NSA kernel: the xla path runs everywhere


def apply_native_sparse_attention(query, key, value, block_indices, block_counts=16, block_size: int = 64,
                                  softmax_scale: Optional[float] = None, cu_seqlens=None, backend: str = "auto"):
    """NSA's selected branch; same arguments and result as the torch front end
    (dualattn.torch_api.apply_native_sparse_attention), plus backend "triton", "xla" or "auto"."""
    counts_array = block_counts if hasattr(block_counts, "shape") and len(block_counts.shape) else None
    check_arrays(query=query, key=key, value=value, block_indices=block_indices, block_counts=counts_array,
                 cu_seqlens=cu_seqlens)
    cu_values = _concrete(cu_seqlens)
    shapes, count = checks.selected_shapes(query, key, value, block_indices, block_counts, block_size, cu_seqlens,
                                           cu_values)
    scale = checks.default_scale(shapes.head_dim, softmax_scale)
    if _backend(backend) == "xla":
        from .xla import selected_attention_xla
        return selected_attention_xla(query, key, value, block_indices,
                                      counts_array if count is None else count, shapes.block_size, scale, cu_seqlens)
    return _selected(_SelectedCall(shapes, scale, count or 0), query, key, value, block_indices, counts_array,
                     cu_seqlens)


def _pool(x, block_size: int):
    n = x.shape[1] // block_size
    return x[:, :n * block_size].reshape(x.shape[0], n, block_size, *x.shape[2:]).astype(jnp.float32).mean(
        2).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _pool_kernel(key, value, block_size: int, seqlen: int):
    """The pooled keys and values of the whole blocks from the shared kernel (kernels/nsa/pool.py)."""
    b, _, hkv, d = key.shape
    launch = nsa_plan.plan_pool(b, seqlen, hkv, d, value.shape[-1], block_size)
    res = _launch.run(launch, dict(key=key, value=value))
    return res["k_cmp"], res["v_cmp"]


def _pool_kernel_fwd(key, value, block_size: int, seqlen: int):
    return _pool_kernel(key, value, block_size, seqlen), None


def _pool_kernel_bwd(block_size: int, seqlen: int, _, grads):
    """Each token of a whole block gets its block's gradient / block_size (in fp32, as the mean's), the
    tail tokens 0."""
    def spread(g):
        b, n, h, d = g.shape
        each = jnp.broadcast_to((g.astype(jnp.float32) / block_size).astype(g.dtype)[:, :, None],
                                (b, n, block_size, h, d)).reshape(b, n * block_size, h, d)
        return jnp.pad(each, ((0, 0), (0, seqlen - n * block_size), (0, 0), (0, 0)))
    return tuple(spread(g) for g in grads)


_pool_kernel.defvjp(_pool_kernel_fwd, _pool_kernel_bwd)


def _gate_arrays(gates, outs) -> dict:
    arrays = {}
    for i, (g, o) in enumerate(zip(gates, outs)):
        arrays[f"o{i}"], arrays[f"g{i}"] = o.reshape(-1, o.shape[-1]), g.reshape(-1)
    return arrays


@jax.custom_vjp
def _gates_kernel(gates: tuple, outs: tuple):
    """sum of g[..., None] * o over the branches from the shared kernel (kernels/nsa/gates.py)."""
    shape = outs[0].shape
    launch = nsa_plan.plan_gates(int(np.prod(shape[:-1])), shape[-1], len(outs))
    return _launch.run(launch, _gate_arrays(gates, outs))["out"].reshape(shape)


def _gates_kernel_fwd(gates: tuple, outs: tuple):
    return _gates_kernel(gates, outs), (gates, outs)


def _gates_kernel_bwd(res, dout):
    gates, outs = res
    shape = outs[0].shape
    launch = nsa_plan.plan_gates_backward(int(np.prod(shape[:-1])), shape[-1], len(outs))
    grads = _launch.run(launch, dict(_gate_arrays(gates, outs), dout=dout.reshape(-1, shape[-1])))
    return (tuple(grads[f"dg{i}"].reshape(g.shape) for i, g in enumerate(gates)),
            tuple(grads[f"do{i}"].reshape(o.shape) for i, o in enumerate(outs)))


_gates_kernel.defvjp(_gates_kernel_fwd, _gates_kernel_bwd)


def _gated_sum(dtype, backend: str, *terms):
    """Sum over the (gate, branch output) terms whose output is not None of gate[..., None] * output, in
    `dtype`: the shared kernel (triton), or jnp, which XLA fuses into one loop (xla)."""
    gates = tuple(g for g, o in terms if o is not None)
    outs = tuple(o.astype(dtype) for _, o in terms if o is not None)
    if backend == "triton":
        return _gates_kernel(gates, outs)
    out = None
    for g, o in zip(gates, outs):
        term = g.astype(dtype)[..., None] * o
        out = term if out is None else out + term
    return out


def _compressed(query, key, value, block_size: int, scale: float, backend: str, deterministic: bool):
    """Compressed branch of one sequence: (out, lse (B, Hq, T) or None, pooled keys or None), as the torch
    front end's: dense flash launches (nsa.compressed_launches says how)."""
    b, t, hq, _ = query.shape
    rows = checks.compressed_batch_rows(hq, block_size)
    if b > rows:
        parts = [_compressed(query[i:i + rows], key[i:i + rows], value[i:i + rows], block_size, scale, backend,
                             deterministic) for i in range(0, b, rows)]
        return tuple(None if p[0] is None else jnp.concatenate(p) for p in zip(*parts))
    n, body, tail = checks.compressed_launches(t, block_size)
    if n == 0:   # no complete block: no token sees any
        return jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype), None, None
    if backend == "triton":
        k_cmp, v_cmp = _pool_kernel(key, value, block_size, t)
    else:
        k_cmp, v_cmp = _pool(key, block_size), _pool(value, block_size)
    attend = functools.partial(flash_attention, softmax_scale=scale, return_lse=True, backend=backend,
                               deterministic=deterministic)
    if n > 1:
        def tiled(x):   # (B, n - 1, bs * H, D): the first n - 1 pooled blocks, once per phase
            return jnp.broadcast_to(x[:, :n - 1, None], (b, n - 1, block_size, *x.shape[2:])).reshape(
                b, n - 1, -1, x.shape[-1])
        out, lse = attend(query[:, :body].reshape(b, n, block_size * hq, -1), tiled(k_cmp), tiled(v_cmp), causal=True)
        out = out.reshape(b, body, hq, -1)
        lse = jnp.transpose(lse.reshape(b, block_size, hq, n), (0, 2, 3, 1)).reshape(b, hq, body)
    else:   # one block: only its last token sees it
        out = jnp.zeros((b, body, hq, value.shape[-1]), query.dtype)
        lse = jnp.full((b, hq, body), -jnp.inf, jnp.float32)
    o_last, lse_last = attend(query[:, block_size - 1:body:block_size], k_cmp, v_cmp, causal=True)
    out = out.at[:, block_size - 1::block_size].set(o_last)
    lse = lse.at[:, :, block_size - 1::block_size].set(lse_last)
    if tail:
        o_tail, lse_tail = attend(query[:, body:], k_cmp, v_cmp)
        out, lse = jnp.concatenate([out, o_tail], 1), jnp.concatenate([lse, lse_tail], 2)
    return out, lse, k_cmp


def _compressed_packed(query, key, value, cu: list, block_size: int, scale: float, backend: str,
                       deterministic: bool):
    """Compressed branch of packed sequences (query (1, T, Hq, D) holding them, cu their table from 0), as
    the torch front end's _compressed_packed: one launch each for all of them (nsa.packed_compressed).
    (out (1, T, Hq, Dv), lse (1, Hq, T) or None, pooled keys or None, the pooled blocks' table)."""
    lay = checks.packed_compressed(cu, block_size)
    (t, hq, d), dv = query.shape[1:], value.shape[-1]
    cu_blocks, n = jnp.asarray(lay.cu_blocks), int(lay.cu_blocks[-1])
    if n == 0:   # no sequence has a whole block
        return jnp.zeros((*query.shape[:3], dv), query.dtype), None, None, cu_blocks
    q, k, v = query[0], key[0], value[0]
    q_body, k_body, v_body = (q, k, v) if lay.body_rows is None else (x[lay.body_rows] for x in (q, k, v))
    k_cmp, v_cmp = _pool_kernel(k_body[None], v_body[None], block_size, n * block_size)
    attend = functools.partial(flash_attention_varlen, softmax_scale=scale, return_lse=True, backend=backend,
                               deterministic=deterministic)
    if lay.max_prev > 0:
        def tiled(x):   # (1, blocks, bs * H, D): the pooled blocks shifted one block, once per phase
            x = x[0, lay.fold_keys]
            return jnp.broadcast_to(x[:, None], (n, block_size, *x.shape[1:])).reshape(1, n, -1, x.shape[-1])
        out, lse = flash_attention(q_body.reshape(1, n, block_size * hq, d), tiled(k_cmp), tiled(v_cmp),
                                   causal=True, q_segment_ids=jnp.asarray(lay.fold_q_ids),
                                   kv_segment_ids=jnp.asarray(lay.fold_kv_ids), softmax_scale=scale,
                                   return_lse=True, backend=backend, deterministic=deterministic)
        out = out.reshape(n * block_size, hq, dv)
        lse = jnp.transpose(lse.reshape(block_size, hq, n), (1, 2, 0)).reshape(hq, n * block_size)
    else:   # one block a sequence at most: only its last token sees it
        out = jnp.zeros((n * block_size, hq, dv), query.dtype)
        lse = jnp.full((hq, n * block_size), -jnp.inf, jnp.float32)
    if lay.order is not None:
        o_tail, lse_tail = attend(q[lay.tail_rows], k_cmp[0], v_cmp[0], jnp.asarray(lay.cu_tail), cu_blocks,
                                  lay.max_tail, lay.max_blocks)
        out = jnp.concatenate([out, o_tail])[lay.order]
        lse = jnp.concatenate([lse, lse_tail], 1)[:, lay.order]
    o_last, lse_last = attend(q[lay.last_rows], k_cmp[0], v_cmp[0], cu_blocks, cu_blocks, lay.max_blocks,
                              lay.max_blocks, causal=True)
    out, lse = out.at[lay.last_rows].set(o_last), lse.at[:, lay.last_rows].set(lse_last)
    return out[None], lse[None], k_cmp, cu_blocks


def _block_scores(query, k_cmp, lse, heads_kv: int, block_size: int, scale: float, cu=None, cu_blocks=None):
    """(B, T, Hkv, blocks) top-k scores from the shared kernel (kernels/nsa/importance.py); packed sequences:
    cu their table's values, cu_blocks _compressed_packed's."""
    b, t, hq, d = query.shape
    if k_cmp is None:   # no complete block: only the own blocks have a score
        k_cmp = jnp.zeros((b, 1, heads_kv, d), query.dtype)
        lse = jnp.full((b, hq, t), -jnp.inf, jnp.float32)
    arrays = dict(query=query, k_cmp=k_cmp, lse=lse.astype(jnp.float32))
    if cu is None:
        launch = nsa_plan.plan_importance(b, t, hq, heads_kv, d, block_size, str(query.dtype), scale)
    else:
        longest = max(hi - lo for lo, hi in zip(cu[:-1], cu[1:]))
        launch = nsa_plan.plan_importance(b, longest, hq, heads_kv, d, block_size, str(query.dtype), scale,
                                          sequences=len(cu) - 1, total=t, pooled=k_cmp.shape[1])
        arrays.update(cu_seqlens=jnp.asarray(cu, jnp.int32), cu_cmp=cu_blocks)
    return _launch.run(launch, arrays)["scores"]


def _top_blocks(query, k_cmp, lse, heads_kv: int, block_size: int, count: int, scale: float, backend: str,
                cu=None, cu_blocks=None):
    """As the torch front end's: own block first, then the highest summed probabilities, ties to the
    lower index (lax.top_k's order); -1 where fewer blocks exist.  Not differentiated.  The scores come
    from the shared kernel (triton) or from jnp (xla).  Packed sequences (triton): cu and cu_blocks as
    _block_scores takes them."""
    query, k_cmp, lse = jax.lax.stop_gradient((query, k_cmp, lse))
    b, t, hq, d = query.shape
    hkv = heads_kv
    if backend == "triton":   # (packed sequences: a row holds the longest sequence's blocks)
        scores = _block_scores(query, k_cmp, lse, heads_kv, block_size, scale, cu, cu_blocks)
        n_blocks = scores.shape[-1]
        take = min(count, n_blocks)
        topk = nsa_plan.plan_topk(b * t * hkv, n_blocks, count, None if cu is not None else (t, hkv, block_size))
        if topk is not None:
            return _launch.run(topk, dict(scores=scores))["indices"].reshape(b, t, hkv, count)
        chosen = []
        for lo in range(0, t, SELECT_CHUNK):
            ranked, order = jax.lax.top_k(scores[:, lo:lo + SELECT_CHUNK], take)
            chosen.append(jnp.where(ranked == -jnp.inf, -1, order).astype(jnp.int32))
        return _pad_slots(jnp.concatenate(chosen, axis=1), count)
    n_cmp = 0 if k_cmp is None else k_cmp.shape[1]
    n_blocks = -(-t // block_size)
    take = min(count, n_blocks)
    chosen = []
    for lo in range(0, t, SELECT_CHUNK):
        hi = min(t, lo + SELECT_CHUNK)
        pos = jnp.arange(lo, hi)
        score = jnp.zeros((b, hi - lo, hkv, n_blocks), jnp.float32)
        if n_cmp:
            q = query[:, lo:hi].astype(jnp.float32).reshape(b, hi - lo, hkv, hq // hkv, d)
            s = jnp.einsum("bthgd,bchd->bthgc", q, k_cmp.astype(jnp.float32)) * scale
            row_lse = jnp.transpose(lse[:, :, lo:hi].reshape(b, hkv, hq // hkv, hi - lo), (0, 3, 1, 2))
            visible = ((jnp.arange(n_cmp) + 1) * block_size - 1) <= pos[:, None]
            p = jnp.where(visible[None, :, None, None, :], jnp.exp(s - row_lse[..., None]), 0.0)
            score = score.at[..., :n_cmp].set(p.sum(3))
        own = pos // block_size
        blocks = jnp.arange(n_blocks)
        score = jnp.where((blocks[None, :] > own[:, None])[None, :, None, :], -jnp.inf, score)
        score = jnp.where((blocks[None, :] == own[:, None])[None, :, None, :], jnp.inf, score)
        ranked, order = jax.lax.top_k(score, take)
        chosen.append(jnp.where(ranked == -jnp.inf, -1, order).astype(jnp.int32))
    return _pad_slots(jnp.concatenate(chosen, axis=1), count)


def _pad_slots(chosen, count: int):
    """-1 in the slots past the number of blocks a sequence has."""
    return jnp.pad(chosen, [(0, 0)] * 3 + [(0, count - chosen.shape[-1])], constant_values=-1)


def native_sparse_attention(query, key, value, g_cmp=None, g_slc=None, g_swa=None, block_indices=None,
                            block_counts=16, block_size: int = 64, window_size: int = 0,
                            softmax_scale: Optional[float] = None, cu_seqlens=None, return_block_indices: bool = False,
                            backend: str = "auto", deterministic: bool = False):
    """Native sparse attention; same arguments and result as the torch front end
    (dualattn.torch_api.native_sparse_attention, deterministic= included), plus backend "triton", "xla" or
    "auto".

    With cu_seqlens, the compressed branch and the selection are laid out from the table's values (triton:
    one launch each for all the sequences, nsa.packed_compressed; xla: per sequence), so they need a
    concrete array, not a traced one; the selected and sliding branches take it traced.
    """
    counts_array = block_counts if hasattr(block_counts, "shape") and len(block_counts.shape) else None
    check_arrays(query=query, key=key, value=value, g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa,
                 block_indices=block_indices, block_counts=counts_array, cu_seqlens=cu_seqlens)
    cu_values = _concrete(cu_seqlens)
    _, t, _, hkv, _, block_size, window_size, scale, need_selection, count = checks.check_native(
        query, key, value, gates=dict(g_cmp=g_cmp, g_slc=g_slc, g_swa=g_swa), block_indices=block_indices,
        block_counts=block_counts, block_size=block_size, window_size=window_size, softmax_scale=softmax_scale,
        cu_seqlens=cu_seqlens, cu_values=cu_values, return_block_indices=return_block_indices,
        deterministic=deterministic)
    backend = _backend(backend)
    if cu_seqlens is not None and cu_values is None and (g_cmp is not None or block_indices is None):
        raise ValueError("cu_seqlens must be a concrete array (not traced) for the compressed branch and the "
                         "selection, which are laid out from its values")
    o_cmp = o_slc = o_swa = None
    if g_cmp is not None or (block_indices is None and need_selection):
        outs, chosen = [], []
        # (triton: packed sequences one launch each, as torch; xla: per sequence)
        parts = (checks.compressed_parts(cu_values, t, query.shape[2]) if backend == "triton"
                 else [(lo, hi, None) for lo, hi in checks.sequences(cu_values, t)])
        for lo, hi, cu in parts:
            part = query[:, lo:hi], key[:, lo:hi], value[:, lo:hi]
            if cu is None:
                o, lse, k_cmp = _compressed(*part, block_size, scale, backend, deterministic)
                cu_blocks = None
            else:
                o, lse, k_cmp, cu_blocks = _compressed_packed(*part, cu, block_size, scale, backend, deterministic)
            outs.append(o)
            if block_indices is None and need_selection:
                chosen.append(_top_blocks(part[0], k_cmp, lse, hkv, block_size, count, scale, backend, cu, cu_blocks))
        if g_cmp is not None:
            o_cmp = jnp.concatenate(outs, axis=1)
        if chosen:
            block_indices = jnp.concatenate(chosen, axis=1)
    if g_slc is not None:
        o_slc = apply_native_sparse_attention(query, key, value, block_indices, block_counts, block_size, scale,
                                              cu_seqlens, backend)
    if g_swa is not None:   # (check_native: a sliding gate comes with a window)
        if cu_seqlens is None:
            o_swa = flash_attention(query, key, value, causal=True, sliding_window=(window_size, 0),
                                    softmax_scale=scale, backend=backend, deterministic=deterministic)
        else:
            longest = t if cu_values is None else max(hi - lo for lo, hi in checks.sequences(cu_values, t))
            o_swa = flash_attention_varlen(query[0], key[0], value[0], cu_seqlens, cu_seqlens, longest, longest,
                                           causal=True, sliding_window=(window_size, 0), softmax_scale=scale,
                                           backend=backend, deterministic=deterministic)[None]
    out = _gated_sum(query.dtype, backend, (g_cmp, o_cmp), (g_slc, o_slc), (g_swa, o_swa))
    return (out, block_indices) if return_block_indices else out
