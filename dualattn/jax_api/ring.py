"""Ring attention for JAX: the flash kernels composed over a `shard_map` axis.

Inside `jax.shard_map`, each device keeps its query shard; key/value shards (and their segment ids)
travel around the axis with `lax.ppermute`, the transfer of the next shard issued before the current
step's launches so XLA can overlap them.  The steps' launches are the static blocks of
`dualattn.ring.ring_schedule` (global positions through the kernels' diag_shift); a step whose blocks
differ between devices runs under `lax.switch` on the device's index, each branch with its own
static launches.  Partial results merge by their lse in fp32 (dualattn/ring.py).

Backward (custom_vjp): a second ring.  Each step's launches take the merged out and lse; dQ stays
home, dK/dV (fp32) travel with their K/V and reach their owner after the last step.  Memory per
device is O(S / devices).

A rank whose whole share is one launch (world size 1, or a window inside the rank's own shard:
`ring_rules.single_launch`) runs that flash launch alone, sinks included: flash_attention's numbers
and speed, with nothing merged.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Tuple

import jax
import jax.numpy as jnp
from jax import lax

from .. import ring as ring_rules
from ..options import FlashOptions
from ..validation import check_flag, check_flash_args
from . import flash
from ._vma import vary_like
from .mask import segment_ids_as_kernel_dtype

RING_BACKENDS = ("auto", "triton", "xla")


@dataclasses.dataclass(frozen=True)
class _RingStatic:
    """Everything static about one ring call: the nondiff argument of the custom_vjp core."""

    axis_name: Any
    world_size: int
    schedules: Tuple[Tuple[Tuple[ring_rules.RingBlock, ...], ...], ...]   # [rank][step] -> blocks
    steps: int                  # ring_rules.active_steps(schedules)
    options: FlashOptions
    backend: str                # "triton" or "xla"
    heads_q: int
    deterministic: bool = False  # flash backward without the one-pass kernel's dQ atomics


def _block_options(options: FlashOptions, block: ring_rules.RingBlock) -> FlashOptions:
    if block.masked:
        return options
    return dataclasses.replace(options, window_left=None, window_right=None)


def _triton_block(q, k, v, q_seg, kv_seg, options, block, deterministic=False, sinks=None):
    """(static, arrays) of the flash Triton launch of one block (dualattn.jax_api.flash internals)."""
    shapes = check_flash_args(q, k, v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_aux=sinks)
    options = _block_options(options, block)
    static = flash._Static(shapes, options, flash._triton_config(shapes, options, q), block.diag_shift, None,
                           **flash._descriptor_flags(q), deterministic=deterministic)
    return static, dict(query=q, key=k, value=v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_aux=sinks)


def _xla_positions(block, len_q, len_k):
    # The kernels' positions (row i at i + diag, column j at j): the same mask in the xla backend.
    if not block.masked:
        return None, None
    return jnp.arange(len_q, dtype=jnp.int32) + block.diag, jnp.arange(len_k, dtype=jnp.int32)


def _block_forward(static: _RingStatic, block, q, k, v, q_seg, kv_seg):
    """(out, lse) of one block, out in the input dtype, lse fp32."""
    if static.backend == "triton":
        st, arrays = _triton_block(q, k, v, q_seg, kv_seg, static.options, block, static.deterministic)
        return flash._forward(st, arrays)
    from .xla import flash_attention_xla
    qp, kp = _xla_positions(block, q.shape[1], k.shape[1])
    return flash_attention_xla(q, k, v, options=_block_options(static.options, block), q_segment_ids=q_seg,
                               kv_segment_ids=kv_seg, q_positions=qp, kv_positions=kp, return_lse=True)


def _block_backward(static: _RingStatic, block, q, k, v, q_seg, kv_seg, out, lse, dout, dlse):
    """(dq, dk, dv) of one block from the merged out / lse (P = exp(s - lse))."""
    if static.backend == "triton":
        st, arrays = _triton_block(q, k, v, q_seg, kv_seg, static.options, block, static.deterministic)
        grads = flash._backward(st, arrays, out, lse, dout, dlse, bias_grad=False)   # (a ring takes no bias)
        return grads["query"], grads["key"], grads["value"]
    from .xla import flash_attention_backward_xla
    qp, kp = _xla_positions(block, q.shape[1], k.shape[1])
    g = flash_attention_backward_xla(q, k, v, out, lse, dout, options=_block_options(static.options, block),
                                     dlse=dlse, q_segment_ids=q_seg, kv_segment_ids=kv_seg, q_positions=qp,
                                     kv_positions=kp)
    return g.dquery, g.dkey, g.dvalue


def _rows(x, block, keys: bool, axis: int = 1):
    start, stop = (block.kv_start, block.kv_stop) if keys else (block.q_start, block.q_stop)
    return None if x is None else lax.slice_in_dim(x, start, stop, axis=axis)


def _step_forward(static: _RingStatic, blocks, q, q_seg, kv, acc, lse):
    k, v, kv_seg = kv
    for b in blocks:
        out_b, lse_b = _block_forward(static, b, _rows(q, b, False), _rows(k, b, True), _rows(v, b, True),
                                      _rows(q_seg, b, False), _rows(kv_seg, b, True))
        acc_b, lse_new = ring_rules.merge_partial(jnp, _rows(acc, b, False), _rows(lse, b, False, 2),
                                                  out_b.astype(jnp.float32), lse_b)
        acc = lax.dynamic_update_slice_in_dim(acc, acc_b, b.q_start, axis=1)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_new, b.q_start, axis=2)
    return acc, lse


def _step_backward(static: _RingStatic, blocks, q, q_seg, kv, out, lse, dout, dlse):
    """fp32 (dq, dk, dv) of one step over the whole shards (zero where no block reaches)."""
    k, v, kv_seg = kv
    dq = jnp.zeros(q.shape, jnp.float32)
    dk, dv = jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for b in blocks:
        gq, gk, gv = _block_backward(static, b, _rows(q, b, False), _rows(k, b, True), _rows(v, b, True),
                                     _rows(q_seg, b, False), _rows(kv_seg, b, True), _rows(out, b, False),
                                     _rows(lse, b, False, 2), _rows(dout, b, False), _rows(dlse, b, False, 2))
        dq = lax.dynamic_update_slice_in_dim(dq, _rows(dq, b, False) + gq.astype(jnp.float32), b.q_start, 1)
        dk = lax.dynamic_update_slice_in_dim(dk, _rows(dk, b, True) + gk.astype(jnp.float32), b.kv_start, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, _rows(dv, b, True) + gv.astype(jnp.float32), b.kv_start, 1)
    return vary_like((dq, dk, dv), q, k)


def _per_rank(static: _RingStatic, t: int, step_fn, *operands):
    """step_fn(blocks, *operands) with this device's blocks of step t: directly where every device
    launches the same blocks, else under lax.switch on the device's index (one branch per distinct
    schedule, each with its own static launches)."""
    blocks = [static.schedules[r][t] for r in range(static.world_size)]
    distinct = list(dict.fromkeys(blocks))
    if len(distinct) == 1:
        return step_fn(distinct[0], *operands)
    table = jnp.asarray([distinct.index(b) for b in blocks], jnp.int32)
    index = table[lax.axis_index(static.axis_name)]
    return lax.switch(index, [functools.partial(step_fn, b) for b in distinct], *operands)


def _single_launch(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks):
    """(out, lse) of a single-launch ring: the block's differentiable flash call (the triton custom_vjp
    or the xla function), sinks joined by the kernel."""
    def launch(blocks, q, k, v, q_seg, kv_seg, sinks):
        (b,) = blocks
        k, v, kv_seg = _rows(k, b, True), _rows(v, b, True), _rows(kv_seg, b, True)
        if static.backend == "triton":
            return flash._flash_triton(*_triton_block(q, k, v, q_seg, kv_seg, static.options, b,
                                                      static.deterministic, sinks))
        from .xla import flash_attention_xla
        qp, kp = _xla_positions(b, q.shape[1], k.shape[1])
        return flash_attention_xla(q, k, v, options=_block_options(static.options, b), q_segment_ids=q_seg,
                                   kv_segment_ids=kv_seg, q_positions=qp, kv_positions=kp, softmax_aux=sinks,
                                   return_lse=True)
    return _per_rank(static, 0, launch, q, k, v, q_seg, kv_seg, sinks)


def _shift(static: _RingStatic, tree, by: int):
    """Each device's `tree` sent `by` places along the ring (to index + by)."""
    w = static.world_size
    if by % w == 0:
        return tree
    return lax.ppermute(tree, static.axis_name, perm=[(i, (i + by) % w) for i in range(w)])


def _ring_forward(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks):
    b, s, hq, _ = q.shape
    acc = vary_like(jnp.zeros((b, s, hq, v.shape[-1]), jnp.float32), q, k)
    lse = vary_like(jnp.full((b, hq, s), -jnp.inf, jnp.float32), q, k)
    kv = (k, v, kv_seg)
    for t in range(static.steps):
        # The next shard's transfer first: it depends on nothing this step computes.
        kv_next = _shift(static, kv, 1) if t + 1 < static.steps else None
        acc, lse = _per_rank(static, t, functools.partial(_step_forward, static), q, q_seg, kv, acc, lse)
        kv = kv_next
    if sinks is not None:
        acc, lse = ring_rules.add_sinks(jnp, acc, lse, ring_rules.sinks_lse(jnp, sinks.astype(jnp.float32), hq))
    return acc.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks):
    return _ring_forward(static, q, k, v, q_seg, kv_seg, sinks)


def _ring_fwd(static, q, k, v, q_seg, kv_seg, sinks):
    out, lse = _ring_forward(static, q, k, v, q_seg, kv_seg, sinks)
    return (out, lse), (q, k, v, q_seg, kv_seg, sinks, out, lse)


def _ring_bwd(static, residuals, cotangents):
    q, k, v, q_seg, kv_seg, sinks, out, lse = residuals
    dout, dlse = cotangents
    dout, dlse = dout.astype(out.dtype), dlse.astype(jnp.float32)
    dq = vary_like(jnp.zeros(q.shape, jnp.float32), q)
    dk = vary_like(jnp.zeros(k.shape, jnp.float32), k)
    dv = vary_like(jnp.zeros(v.shape, jnp.float32), v)
    kv = (k, v, kv_seg)
    for t in range(static.steps):
        last = t + 1 == static.steps
        kv_next = None if last else _shift(static, kv, 1)
        gq, gk, gv = _per_rank(static, t, functools.partial(_step_backward, static), q, q_seg, kv, out, lse, dout,
                               dlse)
        dq = dq + gq
        # dK/dV travel with their K/V; after the last step they go straight home.
        dk, dv = _shift(static, (dk + gk, dv + gv), 1 if not last else static.world_size - static.steps + 1)
        kv = kv_next
    dsinks = None
    if sinks is not None:
        delta = jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32), axis=-1).transpose(0, 2, 1) - dlse
        dsinks = ring_rules.sinks_grad(jnp, sinks.astype(jnp.float32), static.heads_q, lse, delta)
        # (This device's rows' share: ring_attention made replicated sinks vary over the axis, and
        # shard_map's transpose of that sums the shares.)
        dsinks = vary_like(dsinks, sinks).astype(sinks.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, dsinks


_ring.defvjp(_ring_fwd, _ring_bwd)


def _world_size(axis_name) -> int:
    try:
        return int(lax.axis_size(axis_name))
    except NameError as e:
        raise ValueError(f"axis_name {axis_name!r} is not bound: call ring_attention inside jax.shard_map over "
                         f"a mesh with that axis, the sequence dim sharded over it") from e


def _resolve_backend(backend: str) -> str:
    if backend not in RING_BACKENDS:
        raise ValueError(f"backend must be one of {RING_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if jax.default_backend() == "gpu" else "xla"
    return backend


def ring_attention(query, key, value, *, axis_name, causal: bool = False, sliding_window=None,
                   softmax_scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
                   softmax_aux=None, q_segment_ids=None, kv_segment_ids=None, layout: str = "zigzag",
                   backend: str = "auto", return_lse: bool = False, deterministic: bool = False):
    """Ring attention over a `shard_map` axis: this device's shard of a longer sequence.

    Call inside `jax.shard_map` with the sequence dim of query/key/value (and segment ids) sharded
    over `axis_name` in `layout` order (`dualattn.ring_permutation`: shard a global array with
    x[:, perm] before sharding).  Every option means what it means in `flash_attention` on the
    gathered sequence: masks use the global positions.

    Args:
        query: (B, L, Hq, D); key / value: (B, L, Hkv, D / Dv), L = S / devices, Hq % Hkv == 0.
        axis_name: the shard_map mesh axis the sequence is sharded over.
        causal, sliding_window, softmax_scale, logits_soft_cap: as flash_attention.
        softmax_aux: sinks, (Hq, n), (Hq,) or shared (n,), replicated over the axis; joined once.
        q_segment_ids, kv_segment_ids: int (B, L) shards of the global ids (one given: both).
        layout: "zigzag" (default; equal causal work per device) or "contiguous".
        backend: "triton" (the shared flash kernels), "xla", "auto" (triton on GPU, else xla).
        return_lse: also return this shard's float32 lse (B, Hq, L), sinks included.
        deterministic: bitwise reproducible gradients (each step's flash backward without the one-pass
            kernel's dQ atomics), as flash_attention's.

    Returns:
        out (B, L, Hq, Dv) in query's dtype, or (out, lse).
    """
    flash.check_arrays(query=query, key=key, value=value, q_segment_ids=q_segment_ids,
                       kv_segment_ids=kv_segment_ids, softmax_aux=softmax_aux)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    deterministic = check_flag("deterministic", deterministic)
    shapes = check_flash_args(query, key, value, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                              softmax_aux=softmax_aux)
    if shapes.seqlen_q != shapes.seqlen_k:
        raise ValueError(f"query and key shards must have the same length (the same sequence sharded over "
                         f"{axis_name!r}), got {shapes.seqlen_q} and {shapes.seqlen_k}")
    options = FlashOptions.build(head_dim=shapes.head_dim, softmax_scale=softmax_scale, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    backend = _resolve_backend(backend)
    world = _world_size(axis_name)
    ring_rules.check_layout(layout, shapes.seqlen_q * world, world)
    schedules = tuple(ring_rules.ring_schedule(shapes.seqlen_q * world, world, layout, r, options.window_left,
                                               options.window_right) for r in range(world))
    static = _RingStatic(axis_name, world, schedules, ring_rules.active_steps(schedules), options, backend,
                         shapes.heads_q, deterministic)
    if q_segment_ids is not None or kv_segment_ids is not None:
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        q_segment_ids, kv_segment_ids = segment_ids_as_kernel_dtype(q_segment_ids, kv_segment_ids)
    if softmax_aux is not None:
        # Replicated sinks join every device's rows: as a value varying over the axis, their gradient is
        # summed over the devices by the transpose (pvary's psum; with check_vma off, shard_map's own).
        softmax_aux = vary_like(softmax_aux, query)
    run = _single_launch if ring_rules.single_launch(schedules, shapes.seqlen_q) else _ring
    out, lse = run(static, query, key, value, q_segment_ids, kv_segment_ids, softmax_aux)
    return (out, lse) if return_lse else out
