"""Ring attention for torch: the flash kernels composed over a torch.distributed process group.

Each rank keeps its query shard; key/value shards (and their segment ids) travel to the next rank
with `dist.batch_isend_irecv`, the transfer of the next shard posted before the current step's
launches so that it overlaps them (NCCL runs it on its own stream; gloo in its threads).  The steps'
launches are the static blocks of `dualattn.ring.ring_schedule` for this rank (global positions
through the kernels' diag_shift), and partial results merge by their lse in fp32 (dualattn/ring.py),
exactly as the JAX ring does.

Backward (autograd.Function): a second ring.  Each step's launches take the merged out and lse; dQ
stays home, dK/dV (fp32) travel with their K/V and reach their owner after the last step.

A rank whose whole share is one launch (world size 1, or a window inside the rank's own shard:
`ring_rules.single_launch`) runs that flash launch alone, sinks included: flash_attention's numbers
and speed, with nothing merged.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import ring as ring_rules
from ..options import FlashOptions
from ..validation import check_flag
from . import flash

Tensor = torch.Tensor


@dataclasses.dataclass(frozen=True)
class _RingStatic:
    group: object
    world_size: int
    rank: int
    schedule: Tuple[Tuple[ring_rules.RingBlock, ...], ...]   # this rank's blocks, per step
    steps: int
    options: FlashOptions
    heads_q: int
    deterministic: bool = False
    single: bool = False     # ring_rules.single_launch: every rank's share is one flash launch


def _named(q, k, v, q_seg, kv_seg, options: FlashOptions, block: ring_rules.RingBlock,
           deterministic: bool = False, sinks: Optional[Tensor] = None) -> dict:
    """The flash op's arguments by name for one block (dualattn.torch_api.flash internals)."""
    if not block.masked:
        options = dataclasses.replace(options, window_left=None, window_right=None)
    named = dict.fromkeys(flash._TENSOR_ARGS)
    named.update(query=q, key=k, value=v, q_segment_ids=q_seg, kv_segment_ids=kv_seg, softmax_aux=sinks)
    side = (lambda w: flash._NONE if w is None else w)
    named.update(max_seqlen_q=q.shape[1], max_seqlen_k=k.shape[1], softmax_scale=options.softmax_scale,
                 window_left=side(options.window_left), window_right=side(options.window_right),
                 logits_soft_cap=options.logits_soft_cap or 0.0, dropout_prob=0.0, dropout_seed=0,
                 diag_shift=block.diag_shift, sparse_block_q=0, sparse_block_k=0, sparse_contiguous=0,
                 deterministic=deterministic)
    return named


def _rows(x: Optional[Tensor], block: ring_rules.RingBlock, keys: bool, dim: int = 1) -> Optional[Tensor]:
    if x is None:
        return None
    start, stop = (block.kv_start, block.kv_stop) if keys else (block.q_start, block.q_stop)
    return x.narrow(dim, start, stop - start)


def _exchange(static: _RingStatic, tensors: List[Tensor], by: int):
    """Post sends of `tensors` to the rank `by` places on and receives of theirs from `by` places back.
    Returns (receive buffers, requests); the buffers are valid after wait()."""
    if by % static.world_size == 0:
        return tensors, []
    to = dist.get_global_rank(static.group, (static.rank + by) % static.world_size)
    frm = dist.get_global_rank(static.group, (static.rank - by) % static.world_size)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, to, static.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, frm, static.group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _wait(requests) -> None:
    for r in requests:
        r.wait()


def _single_named(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks) -> dict:
    """The one launch of a single-launch ring (sinks joined by the kernel itself, as fp32: their
    gradient then reaches the group's all_reduce unrounded and is cast once)."""
    blk = static.schedule[0][0]
    return _named(q, _rows(k, blk, True), _rows(v, blk, True), q_seg, _rows(kv_seg, blk, True), static.options,
                  blk, static.deterministic, None if sinks is None else sinks.float())


def _block_named(static: _RingStatic, blk: ring_rules.RingBlock, q, q_seg, kv) -> dict:
    return _named(_rows(q, blk, False), _rows(kv[0], blk, True), _rows(kv[1], blk, True), _rows(q_seg, blk, False),
                  _rows(kv[2] if len(kv) > 2 else None, blk, True), static.options, blk, static.deterministic)


def step_forward(static: _RingStatic, t: int, q, q_seg, kv: List[Tensor], acc: Tensor, lse: Tensor) -> None:
    """Step t's launches on the visiting shard kv = [k, v(, kv_seg)], merged into the fp32 acc / lse in
    place (also timed alone by benchmarks/bench_ring.py --per-step)."""
    for blk in static.schedule[t]:
        out_b, lse_b, _, _ = flash._forward(_block_named(static, blk, q, q_seg, kv))
        rows = slice(blk.q_start, blk.q_stop)
        acc[:, rows], lse[:, :, rows] = ring_rules.merge_partial(torch, acc[:, rows], lse[:, :, rows],
                                                                 out_b.float(), lse_b)


def step_backward(static: _RingStatic, t: int, q, q_seg, kv: List[Tensor], out, lse, dout, dlse,
                  dq: Tensor) -> Tuple[Tensor, Tensor]:
    """Step t's backward launches from the merged out / lse: dQ added into the fp32 dq in place; returns
    the visiting shard's fp32 (dK, dV) of this step."""
    gk = torch.zeros(kv[0].shape, dtype=torch.float32, device=kv[0].device)
    gv = torch.zeros(kv[1].shape, dtype=torch.float32, device=kv[1].device)
    for blk in static.schedule[t]:
        bq, bk, bv, _, _ = flash._backward(_block_named(static, blk, q, q_seg, kv), _rows(dout, blk, False),
                                           _rows(out, blk, False), _rows(lse, blk, False, 2),
                                           _rows(dlse, blk, False, 2))
        dq[:, blk.q_start:blk.q_stop] += bq.float()
        gk[:, blk.kv_start:blk.kv_stop] += bk.float()
        gv[:, blk.kv_start:blk.kv_stop] += bv.float()
    return gk, gv


def _ring_forward(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks):
    if static.single:
        out, lse, _, _ = flash._forward(_single_named(static, q, k, v, q_seg, kv_seg, sinks))
        return out, lse
    b, s, hq, _ = q.shape
    acc = q.new_zeros((b, s, hq, v.shape[-1]), dtype=torch.float32)
    lse = q.new_full((b, hq, s), float("-inf"), dtype=torch.float32)
    kv = [k, v] + ([kv_seg] if kv_seg is not None else [])
    for t in range(static.steps):
        # The next shard's transfer first: it depends on nothing this step computes.
        nxt, requests = _exchange(static, kv, 1) if t + 1 < static.steps else (None, [])
        step_forward(static, t, q, q_seg, kv, acc, lse)
        _wait(requests)
        kv = nxt
    if sinks is not None:
        acc, lse = ring_rules.add_sinks(torch, acc, lse, ring_rules.sinks_lse(torch, sinks.float(), hq))
    return acc.to(q.dtype), lse


def _single_backward(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks, out, lse, dout, dlse):
    blk = static.schedule[0][0]
    dq, bk, bv, _, dsinks = flash._backward(_single_named(static, q, k, v, q_seg, kv_seg, sinks), dout, out, lse,
                                            dlse)
    dk, dv = bk, bv
    if (blk.kv_start, blk.kv_stop) != (0, k.shape[1]):
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dk[:, blk.kv_start:blk.kv_stop], dv[:, blk.kv_start:blk.kv_stop] = bk, bv
    if sinks is None:
        dsinks = None
    else:
        if static.world_size > 1:
            dist.all_reduce(dsinks, group=static.group)   # sinks are replicated: one gradient for every rank's rows
        dsinks = dsinks.to(sinks.dtype)
    return dq, dk, dv, dsinks


def _ring_backward(static: _RingStatic, q, k, v, q_seg, kv_seg, sinks, out, lse, dout, dlse):
    if static.single:
        return _single_backward(static, q, k, v, q_seg, kv_seg, sinks, out, lse, dout, dlse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    kv = [k, v] + ([kv_seg] if kv_seg is not None else [])
    grads_in_flight: list = []
    for t in range(static.steps):
        last = t + 1 == static.steps
        nxt, requests = (None, []) if last else _exchange(static, kv, 1)
        gk, gv = step_backward(static, t, q, q_seg, kv, out, lse, dout, dlse, dq)
        _wait(grads_in_flight)   # the visiting shard's dK/dV so far, from the previous rank
        dk, dv = dk + gk, dv + gv
        # dK/dV travel with their K/V; after the last step they go straight home.
        (dk, dv), grads_in_flight = _exchange(static, [dk, dv], 1 if not last else
                                              static.world_size - static.steps + 1)
        _wait(requests)
        kv = nxt
    _wait(grads_in_flight)
    dsinks = None
    if sinks is not None:
        delta = (out.float() * dout.float()).sum(-1).transpose(1, 2) - dlse
        dsinks = ring_rules.sinks_grad(torch, sinks.float(), static.heads_q, lse, delta)
        # Sinks are replicated over the group: every rank's rows contribute to their one gradient.
        dist.all_reduce(dsinks, group=static.group)
        dsinks = dsinks.to(sinks.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dsinks


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, softmax_aux, q_segment_ids, kv_segment_ids, static: _RingStatic):
        out, lse = _ring_forward(static, query, key, value, q_segment_ids, kv_segment_ids, softmax_aux)
        ctx.save_for_backward(query, key, value, softmax_aux, q_segment_ids, kv_segment_ids, out, lse)
        ctx.static = static
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, q_seg, kv_seg, out, lse = ctx.saved_tensors
        dq, dk, dv, dsinks = _ring_backward(ctx.static, q, k, v, q_seg, kv_seg, sinks, out, lse,
                                            dout.to(out.dtype).contiguous(), dlse.float().contiguous())
        return dq, dk, dv, dsinks, None, None, None


def _group_rank(group) -> Tuple[object, int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("ring_attention needs torch.distributed initialised (dist.init_process_group, e.g. "
                         "under torchrun: NCCL on GPU, gloo on CPU)")
    group = dist.group.WORLD if group is None else group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, world, rank


def _described(x) -> dict:
    """What of an argument every rank must agree on: a tensor's dtype, shape and device type, or the
    repr of any other value (field "")."""
    if isinstance(x, torch.Tensor):
        return dict(dtype=str(x.dtype).removeprefix("torch."), shape=tuple(x.shape), device=x.device.type)
    return {"": repr(x)}


def _check_same_on_every_rank(group, world: int, **arguments) -> None:
    """ValueError, the same on every rank, unless every rank of `group` passed the same dtypes, shapes
    and device types of its tensors and the same options.  Ranks that disagree would post transfers of
    different sizes (or schedules with different steps) and fail or hang inside the backend, each
    rank differently; one all_gather of the arguments' metadata, before any rank checks or launches
    anything alone, turns that into one error everywhere."""
    if world == 1:
        return
    every = [None] * world
    dist.all_gather_object(every, {name: _described(x) for name, x in arguments.items()}, group=group)
    for name in arguments:
        described = [rank_args[name] for rank_args in every]
        if any(d.keys() != described[0].keys() for d in described):   # a tensor on some ranks only
            described = [{"": d.get("", f"a {d.get('dtype')} tensor of shape {d.get('shape')}")} for d in described]
        for field in described[0]:
            values = [d[field] for d in described]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r} {v}" for r, v in enumerate(values) if r == 0 or v != values[0])
                raise ValueError(f"{name}{' ' + field if field else ''} differs across ranks: {shown} (every rank "
                                 f"of the group must pass its shard of the same call)")


def ring_attention(query: Tensor, key: Tensor, value: Tensor, *, group=None, causal: bool = False,
                   sliding_window=None, softmax_scale: Optional[float] = None,
                   logits_soft_cap: Optional[float] = None, softmax_aux: Optional[Tensor] = None,
                   q_segment_ids: Optional[Tensor] = None, kv_segment_ids: Optional[Tensor] = None,
                   layout: str = "zigzag", return_lse: bool = False, deterministic: bool = False):
    """Ring attention over a torch.distributed group: this rank's shard of a longer sequence.

    Every rank of `group` calls it with its shard, the sequence sharded in `layout` order
    (`dualattn.ring_permutation`: rank r holds x[:, perm[r*L:(r+1)*L]]).  Every option means what it
    means in `flash_attention` on the gathered sequence: masks use the global positions.  Every rank
    passes tensors of the same dtypes, shapes and device type and the same options: one all_gather of
    that metadata per call (a host round trip) checks it first, and any difference is the same
    ValueError on every rank.

    Args:
        query: (B, L, Hq, D); key / value: (B, L, Hkv, D / Dv), L = S / world size, Hq % Hkv == 0.
        group: the process group (None: the default group).
        causal, sliding_window, softmax_scale, logits_soft_cap: as flash_attention.
        softmax_aux: sinks, (Hq, n), (Hq,) or shared (n,), the same on every rank; joined once, and
            its gradient is the whole sequence's (summed over the group) on every rank.
        q_segment_ids, kv_segment_ids: int (B, L) shards of the global ids (one given: both).
        layout: "zigzag" (default; equal causal work per rank) or "contiguous".
        return_lse: also return this shard's float32 lse (B, Hq, L), sinks included.
        deterministic: bitwise reproducible gradients (each step's flash backward without the one-pass
            kernel's dQ atomics), as flash_attention's.
            Also on under torch.use_deterministic_algorithms(True).

    Returns:
        out (B, L, Hq, Dv) in query's dtype, or (out, lse).
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    group, world, rank = _group_rank(group)
    # First, so that every check below sees the same arguments on every rank and fails on all alike.
    _check_same_on_every_rank(group, world, query=query, key=key, value=value, softmax_aux=softmax_aux,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, causal=causal,
                              sliding_window=sliding_window, softmax_scale=softmax_scale,
                              logits_soft_cap=logits_soft_cap, layout=layout)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    deterministic = check_flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    flash._check_devices(query=query, key=key, value=value, softmax_aux=softmax_aux, q_segment_ids=q_segment_ids,
                         kv_segment_ids=kv_segment_ids)
    shapes = flash._checked(query, key, value, None, None, q_segment_ids, kv_segment_ids, softmax_aux, None, None,
                            max_seqlen_q=None, max_seqlen_k=None)
    if shapes.seqlen_q != shapes.seqlen_k:
        raise ValueError(f"query and key shards must have the same length (the same sequence sharded over the "
                         f"group), got {shapes.seqlen_q} and {shapes.seqlen_k}")
    options = FlashOptions.build(head_dim=shapes.head_dim, softmax_scale=softmax_scale, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    ring_rules.check_layout(layout, shapes.seqlen_q * world, world)
    schedules = [ring_rules.ring_schedule(shapes.seqlen_q * world, world, layout, r, options.window_left,
                                          options.window_right) for r in range(world)]
    static = _RingStatic(group, world, rank, schedules[rank], ring_rules.active_steps(schedules), options,
                         shapes.heads_q, deterministic, ring_rules.single_launch(schedules, shapes.seqlen_q))
    query, key, value, _, _, q_segment_ids, kv_segment_ids, softmax_aux = flash._normalise(
        query, key, value, None, None, q_segment_ids, kv_segment_ids, softmax_aux)
    key, value = key.contiguous(), value.contiguous()   # sent as they are
    out, lse = _RingAttention.apply(query, key, value, softmax_aux, q_segment_ids, kv_segment_ids, static)
    return (out, lse) if return_lse else out
