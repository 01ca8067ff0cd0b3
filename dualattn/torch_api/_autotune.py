"""The torch side of opt-in autotuning (autotune=True, DUALATTN_AUTOTUNE=1): times flash tile candidates on the GPU.

`flash_autotune_fn(shapes, options, device)` is what `_config` hands to `executor.select_config`; the
executor calls it with its candidate FlashConfigs only on a cache miss with autotuning on, and caches
the result in memory and in the file jax reads too.  Inputs are synthetic with the call's shapes and
features.  Forward tiles are timed on the forward, backward (dK/dV, dQ) pairs on the backward, so
the best of each is combined (as benchmarks/tune_flash.py does).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional, Sequence

import torch

from .. import executor
from ..autotune import REP_MS, WARMUP_MS, in_own_thread, tune_flash
from ..kernels.flash import plan as flash_plan
from ..kernels.flash.plan import FlashConfig
from ..validation import FlashShapes
from . import flash
from .flash import flash_attention, flash_attn_varlen_func


def _bench(fn: Callable[[], object]) -> float:
    """Median ms of fn on the GPU: CUDA events, an L2 flush between calls, warm-up and repeats by
    time (dualattn.autotune's WARMUP_MS / REP_MS; the first call, which compiles, is not timed)."""
    import triton.testing
    fn()
    return triton.testing.do_bench(fn, warmup=WARMUP_MS, rep=REP_MS, return_mode="median")


def flash_autotune_fn(shapes: FlashShapes, options, device) -> Callable[[Sequence[FlashConfig]], Optional[FlashConfig]]:
    return functools.partial(_tune, shapes, options, device)


def _synthetic_call(shapes: FlashShapes, options, device):
    """(run(), inputs that take gradients): one attention call with the shapes and features of the real one."""
    dtype = getattr(torch, shapes.dtype)
    b, hq, hkv, sq, sk = shapes.batch, shapes.heads_q, shapes.heads_kv, shapes.seqlen_q, shapes.seqlen_k

    def randn(*shape, dt=dtype, grad=True):
        return torch.randn(shape, dtype=dt, device=device).requires_grad_(grad)

    lead_q, lead_k = ((shapes.total_q,), (shapes.total_k,)) if shapes.varlen else ((b, sq), (b, sk))
    q, k, v = randn(*lead_q, hq, shapes.head_dim), randn(*lead_k, hkv, shapes.head_dim), \
        randn(*lead_k, hkv, shapes.head_dim_v)
    kw = dict(softmax_scale=options.softmax_scale, logits_soft_cap=options.logits_soft_cap,
              sliding_window=(-1 if options.window_left is None else options.window_left,
                              -1 if options.window_right is None else options.window_right),
              dropout_prob=options.dropout_prob, dropout_seed=0 if options.dropout_prob else None)
    if shapes.num_sinks:
        kw["softmax_aux"] = randn(*((hq, shapes.num_sinks) if shapes.sinks_per_head else (shapes.num_sinks,)),
                                  dt=torch.float32, grad=False)
    if shapes.varlen:
        def cu(total):
            lens = [total // b + (i < total % b) for i in range(b)]
            return torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32)
        cu_q, cu_k = cu(shapes.total_q), cu(shapes.total_k)
        return (lambda: flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, **kw)), (q, k, v)
    if shapes.has_bias:
        kw["bias"] = randn(1 if shapes.bias_bcast_batch else b, 1 if shapes.bias_bcast_head else hq, sq, sk,
                           grad=False)
    if shapes.has_mask:
        kw["attention_mask"] = torch.ones((1 if shapes.mask_bcast_batch else b, 1 if shapes.mask_bcast_head else hq,
                                           sq, sk), dtype=torch.bool, device=device)
    if shapes.has_segments:
        kw.update(q_segment_ids=torch.zeros((b, sq), dtype=torch.int32, device=device),
                  kv_segment_ids=torch.zeros((b, sk), dtype=torch.int32, device=device))
    return (lambda: flash_attention(q, k, v, **kw)), (q, k, v)


def _tune(shapes: FlashShapes, options, device, candidates: Sequence[FlashConfig],
          timer: Callable[[Callable[[], object]], float] = _bench) -> Optional[FlashConfig]:
    """Best forward tile and best backward pair among the candidates (None: none of them ran).

    Runs in a fresh thread: the executor calls this from inside the forward op, where the dispatcher
    has autograd off for the calling thread (torch.enable_grad does not bring it back), and the
    backward is timed through autograd like a user's call.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None  # no timing inside a CUDA graph capture: the heuristic config serves this call
    def work():
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return _tune_here(shapes, options, device, candidates, timer)
    return in_own_thread(work)


def _tune_here(shapes, options, device, candidates, timer):
    run, inputs = _synthetic_call(shapes, options, device)

    def measure_forward(config: FlashConfig) -> float:
        with torch.no_grad(), executor.override(config, algorithm="flash"):
            return timer(run)

    with executor.override(candidates[0], algorithm="flash"):
        dout = torch.randn_like(run())

    def measure_backward(config: FlashConfig) -> float:
        # The forward runs pinned too: its call keeps the config for its backward, which on CUDA runs on
        # autograd's own thread, where a config pinned in this one is not seen.
        with executor.override(config, algorithm="flash"):
            out = run()
            return timer(lambda: torch.autograd.grad(out, inputs, dout, retain_graph=True))

    def plans(config: FlashConfig, which: str) -> list:
        """What one untimed call with `config` plans (the first call, which compiles, is not timed anyway)."""
        with flash_plan.recording() as planned, executor.override(config, algorithm="flash"):
            if which == "forward":
                with torch.no_grad():
                    run()
            else:
                torch.autograd.grad(run(), inputs, dout)
        return planned

    return tune_flash(candidates, measure_forward, measure_backward, plans=plans,
                      desc=f"dualattn autotune {shapes.seqlen_q}x{shapes.seqlen_k} d{shapes.head_dim}")


flash.autotune_fn_for = flash_autotune_fn
