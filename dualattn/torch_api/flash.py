"""PyTorch front end of the shared flash kernels.

Layers, thin on purpose:
  flash_attention / flash_attn_varlen_func / scaled_dot_product_attention  (public; validate)
    -> _FlashAttention (autograd.Function) -> torch.ops.dualattn.flash_fwd / flash_bwd
       (torch.library custom ops + fake impls, so torch.compile(fullgraph=True) traces them;
       eager mode calls their implementations directly, skipping the Python op dispatch)
      -> kernels.flash.plan (launch plans shared with JAX) -> _launch.run (compiled or interpreted)
Static options cross the custom-op boundary as primitive fields of FlashOptions.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import numbers
import weakref
from typing import Optional, Tuple

import torch

from .. import executor
from ..kernels.flash import fit
from ..kernels.flash import plan as flash_plan
from ..kernels.launch import as_int32, max_shared_memory, sm_count
from ..options import FlashOptions
from ..validation import (MAX_HEAD_DIM, MIN_HEAD_DIM, check_cu_seqlens_values, check_dropout, check_flag,
                          check_flash_args, check_positions, segment_id_dtype)
from . import _launch

Tensor = torch.Tensor

_NONE = -1  # window side / sentinel for "unbounded" at the custom-op boundary

# (shapes, options, device) -> the executor's autotune_fn: set by _autotune.py, which times calls of
# this module's functions (so the dependency runs one way: _autotune -> flash).
autotune_fn_for = None


def _options(softmax_scale: float, window_left: int, window_right: int, logits_soft_cap: float,
             dropout_prob: float) -> FlashOptions:
    return FlashOptions(softmax_scale=softmax_scale,
                        window_left=None if window_left == _NONE else window_left,
                        window_right=None if window_right == _NONE else window_right,
                        logits_soft_cap=None if logits_soft_cap == 0.0 else logits_soft_cap,
                        dropout_prob=dropout_prob)


def _strides(arrays: dict) -> dict:
    return {name: tuple(t.stride()) for name, t in arrays.items() if t is not None}


def _cpu_upcast(t: Optional[Tensor]) -> Optional[Tensor]:
    # Triton's interpreter computes bf16 on raw integers (PLATFORM.md): upcast on CPU only.
    if t is not None and t.device.type == "cpu" and t.dtype == torch.bfloat16:
        return t.float()
    return t


_TENSOR_ARGS = ("query", "key", "value", "bias", "attention_mask", "q_segment_ids", "kv_segment_ids",
                "softmax_aux", "cu_seqlens_q", "cu_seqlens_k") + flash_plan.SPARSE_INPUTS + ("q_positions", "kv_positions")
_STATIC_ARGS = ("max_seqlen_q", "max_seqlen_k", "softmax_scale", "window_left", "window_right",
                "logits_soft_cap", "dropout_prob", "dropout_seed", "diag_shift", "sparse_block_q", "sparse_block_k",
                "sparse_contiguous", "deterministic")


def _sparse(kv_count, kv_index, q_order, q_count, q_index, k_order, block_q: int, block_k: int, contiguous: int):
    """The block-sparse layout of a call (None: dense); its lists are launch inputs (_arrays)."""
    if kv_count is None:
        return None
    lb, lh, nq, nk = kv_index.shape
    return flash_plan.SparseInfo(lb, lh, nq, nk, block_q, block_k, contiguous & 1 != 0, contiguous & 2 != 0)


_Resolved = collections.namedtuple("_Resolved", "shapes options config dropout_seed")


def _arrays(named: dict) -> dict:
    """The launch inputs of one op call: the tensors by kernel argument name (the dropout seed aside)."""
    a = _inputs(*(named[n] for n in _TENSOR_ARGS[:10]))
    if named[flash_plan.SPARSE_INPUTS[0]] is not None:
        a.update((n, named[n]) for n in flash_plan.SPARSE_INPUTS)
    a.update(q_positions=named["q_positions"], kv_positions=named["kv_positions"])
    return a


def _problem(named: dict, resolved: Optional[_Resolved] = None):
    """Launch inputs, sizes, options, block-sparse layout and tiles of one op call (fwd and bwd alike).

    `resolved`: what the forward resolved for this call (sizes, options, config, seed tensor), which
    eager backward passes back instead of validating and selecting again (host time, NOTES: "Fewer Python
    layers per call").
    """
    a = _arrays(named)
    sparse = _sparse(*(named[n] for n in flash_plan.SPARSE_INPUTS), named["sparse_block_q"],
                     named["sparse_block_k"], named["sparse_contiguous"])
    if resolved is None:
        shapes = _shapes(a, named["max_seqlen_q"], named["max_seqlen_k"])
        if _queries_covered(named):
            shapes = dataclasses.replace(shapes, queries_covered=True)
        options = _options(named["softmax_scale"], named["window_left"], named["window_right"],
                           named["logits_soft_cap"], named["dropout_prob"])
        device = named["query"].device
        resolved = _Resolved(shapes, options, _config(shapes, options, device),
                             _seed_tensor(named["dropout_prob"], named["dropout_seed"], device))
    a["dropout_seed"] = resolved.dropout_seed
    return a, sparse, resolved


def _inputs(query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux,
            cu_seqlens_q, cu_seqlens_k) -> dict:
    return {"query": _cpu_upcast(query), "key": _cpu_upcast(key), "value": _cpu_upcast(value),
            "bias": _cpu_upcast(bias), "attention_mask": attention_mask, "q_segment_ids": q_segment_ids,
            "kv_segment_ids": kv_segment_ids, "softmax_aux": softmax_aux,
            "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}


def _shapes(a: dict, max_seqlen_q: int, max_seqlen_k: int):
    varlen = a["cu_seqlens_q"] is not None
    return _checked(*(a[n] for n in _TENSOR_ARGS[:10]), max_seqlen_q=max_seqlen_q if varlen else None,
                    max_seqlen_k=max_seqlen_k if varlen else None)


_Meta = collections.namedtuple("_Meta", "shape dtype")


@functools.lru_cache(maxsize=512)
def _check_metadata(metas: tuple, max_seqlen_q, max_seqlen_k):
    return check_flash_args(*metas[:3], **dict(zip(_TENSOR_ARGS[3:10], metas[3:])), max_seqlen_q=max_seqlen_q,
                            max_seqlen_k=max_seqlen_k)


def _checked(query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux, cu_seqlens_q,
             cu_seqlens_k, *, max_seqlen_q, max_seqlen_k):
    """check_flash_args, memoised on what it reads (shapes and dtypes): a call validates and plans
    the same sizes three times (public function, forward op, backward op), ~10 us each."""
    tensors = (query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux, cu_seqlens_q,
               cu_seqlens_k)
    # Symbolic sizes (torch.compile, also in a fake impl run outside dynamo's trace) are not hashable.
    if torch.compiler.is_compiling() or any(isinstance(n, torch.SymInt) for t in tensors if t is not None
                                            for n in t.shape):
        return check_flash_args(*tensors[:3], **dict(zip(_TENSOR_ARGS[3:10], tensors[3:])),
                                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    metas = tuple(None if t is None else _Meta(tuple(t.shape), t.dtype) for t in tensors)
    return _check_metadata(metas, max_seqlen_q, max_seqlen_k)


@functools.lru_cache(maxsize=None)
def _gpu(index: int) -> Tuple[str, int]:
    """(name, arch as 90 / 80) of a CUDA device: fixed for the process, asked once."""
    major, minor = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), major * 10 + minor


def _config(shapes, options, device):
    # override -> memory -> disk cache (shared with jax) -> autotune (DUALATTN_AUTOTUNE=1) -> plan.default_config
    if device.type == "cpu":
        return executor.select_config("flash", platform="cpu", backend="triton-interpret", device_name="cpu",
                                      shapes=shapes, options=options)
    name, arch = _gpu(device.index if device.index is not None else torch.cuda.current_device())
    return executor.select_config("flash", platform="cuda", backend="triton", device_name=name, arch=arch,
                                  shapes=shapes, options=options,
                                  autotune_fn=autotune_fn_for(shapes, options, device) if autotune_fn_for else None)


def _descriptors(a: dict) -> bool:
    """Whether TMA descriptors can address these tensors: Hopper or later (or the CPU interpreter,
    which emulates them) and 16-byte-aligned bases (a view may not be)."""
    query = a["query"]
    if query.device.type == "cuda" and _gpu(query.device.index)[1] < 90:
        return False
    return all(a[n].data_ptr() % 16 == 0 for n in ("query", "key", "value", "out", "dout") if a.get(n) is not None)


def _tma(a: dict) -> bool:
    return flash_plan.tma_requested() and _descriptors(a)


def _warp_specialize(a: dict) -> bool:
    query = a["query"]
    arch = _gpu(query.device.index)[1] if query.is_cuda else None
    return flash_plan.warp_specialize_requested(arch) and _descriptors(a)


def _gluon(a: dict, warp_specialize: bool) -> bool:
    """Whether the plans may pick the Gluon (sm_90-only) one-pass backward: an sm_90 GPU where the
    warp-specialised kernels are allowed (`warp_specialize`, what _warp_specialize(a) gave)."""
    query = a["query"]
    return query.is_cuda and flash_plan.gluon_allowed(_gpu(query.device.index)[1], warp_specialize)


def _same_tables(a: dict) -> bool:
    """Whether a varlen call passed one table for queries and keys (the same tensor, or the same memory
    read alike), which plan.varlen_as_documents may run as segment ids."""
    cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_k")
    if cu_q is None or cu_k is None:
        return False
    return cu_q is cu_k or (cu_q.device == cu_k.device and cu_q.data_ptr() == cu_k.data_ptr()
                            and cu_q.shape == cu_k.shape and cu_q.stride() == cu_k.stride()
                            and cu_q.dtype == cu_k.dtype)


def _num_sms(a: dict) -> int:
    query = a["query"]
    return sm_count(query.device.index if query.is_cuda else None)


def _plan(plan_fn, fit_fn, a: dict, *args, **kwargs):
    """plan_fn's launches; on a GPU fit_fn's, whose portable launches are checked (compiled) against
    the device's shared memory and made smaller where they would not fit (kernels/flash/fit.py)."""
    query = a["query"]
    if not query.is_cuda:
        return plan_fn(*args, **kwargs)
    index = query.device.index if query.device.index is not None else torch.cuda.current_device()
    dtypes = {name: str(t.dtype).replace("torch.", "") for name, t in a.items() if t is not None}
    return fit_fn(*args, arch=_gpu(index)[1], max_shared=max_shared_memory(index), dtypes=dtypes,
                  specialize="torch", **kwargs)


def _seed_tensor(dropout_prob: float, dropout_seed: int, device) -> Optional[Tensor]:
    if dropout_prob == 0.0:
        return None
    # torch.full writes it on the device: torch.tensor([seed]) copies from pageable host memory, which
    # waits for the stream's earlier work, so every call with dropout stalled the host (a forward of
    # ~0.6 ms ran at 360 TFLOP/s where the kernel gives 450: benchmarks/NOTES.md, dropout).
    return torch.full((1,), as_int32(dropout_seed), dtype=torch.int32, device=device)


def _flash_fwd_impl(query: Tensor, key: Tensor, value: Tensor, bias: Optional[Tensor], attention_mask: Optional[Tensor],
              q_segment_ids: Optional[Tensor], kv_segment_ids: Optional[Tensor], softmax_aux: Optional[Tensor],
              cu_seqlens_q: Optional[Tensor], cu_seqlens_k: Optional[Tensor], sparse_kv_count: Optional[Tensor],
              sparse_kv_index: Optional[Tensor], sparse_q_order: Optional[Tensor], sparse_q_count: Optional[Tensor],
              sparse_q_index: Optional[Tensor], sparse_k_order: Optional[Tensor], q_positions: Optional[Tensor],
              kv_positions: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, logits_soft_cap: float,
              dropout_prob: float, dropout_seed: int, diag_shift: int, sparse_block_q: int,
              sparse_block_k: int, sparse_contiguous: int, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """Forward launch: (out, lse).  Inputs already validated and normalised by the public functions."""
    out, lse, _, _ = _forward(dict(locals()))
    return out, lse


class _CallPlan:
    """What one call signature (_call_key) resolves to: sizes, options, config (the dropout seed
    aside: it is per call), the block-sparse layout, the forward launch and, by what the backward
    adds to the key, its backward plans.  Built on a signature's first call and reused: resolving
    and planning again took ~2/3 of the forward's host time, and the GPU machine's host issued a
    forward in ~150 us against a 158 us kernel (D=128 causal S=1024; NOTES: "Fewer Python layers per call")."""

    __slots__ = ("resolved", "sparse", "forward", "out_shape", "out_zeroed", "backwards")

    def __init__(self, resolved: _Resolved, sparse, forward, out_shape):
        self.resolved, self.sparse, self.forward, self.out_shape = resolved, sparse, forward, out_shape
        self.out_zeroed = _out_zeroed(forward)
        self.backwards = {}


# _call_key(named) -> _CallPlan.  Cleared with the plans' own memo (flash_plan.forget_plans).
_CALL_PLANS: dict = {}
_CALL_PLANS_MAX = 1024   # a workload of many shapes starts over rather than grow without bound
flash_plan.on_forget_plans(_CALL_PLANS.clear)


def _tensor_key(t: Optional[Tensor]):
    # The 16-byte alignment of the base decides whether TMA descriptors may address it (_descriptors).
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


_KEYED_STATICS = tuple(n for n in _STATIC_ARGS if n != "dropout_seed")  # the seed is per call, not planned


def _call_key(named: dict) -> Optional[tuple]:
    """Everything a call's resolution and plans depend on besides tensor values: each tensor's
    metadata, the static arguments but the dropout seed, the developer switches (dualattn/switches.py)
    and the executor's state (a pinned config, its memory, its cache file, autotuning on or off).
    None while torch.compile traces (symbolic sizes).  Built on every call: ~16 us on a CPU core
    (most of it reading the executor's state) against ~35 us for resolving and
    planning again (benchmarks/host_front_end_cpu.py)."""
    if torch.compiler.is_compiling():
        return None
    return (tuple(map(_tensor_key, map(named.get, _TENSOR_ARGS))), tuple(map(named.get, _KEYED_STATICS)),
            _same_tables(named), _queries_covered(named), flash_plan.environment(),
            executor.default_executor().state("flash"))


def _out_zeroed(launch) -> bool:
    """Whether the forward's out must start as zeros: varlen rows in no sequence are written by no program
    (plan._forward_outputs), unless the call runs as documents (plan.varlen_as_documents), which writes every row."""
    return any(o.name == "out" and o.zeroed for one in launch.chain for o in one.outputs)


def _forward(named: dict):
    """(out, lse, what was resolved for the call, its _CallPlan or None): eager backward reuses both."""
    key = _call_key(named)
    call = _CALL_PLANS.get(key) if key is not None else None
    query = named["query"]
    if call is None:
        a, sparse, r = _problem(named)
        out = torch.empty(flash_plan.out_shape(r.shapes), dtype=a["query"].dtype, device=query.device)
        ws = _warp_specialize(a)
        launch = _plan(flash_plan.plan_forward, fit.forward, a, r.shapes, r.options, _strides({**a, "out": out}),
                       config=r.config, diag_shift=named["diag_shift"], sparse=sparse, tma=_tma(a),
                       warp_specialize=ws, num_sms=_num_sms(a), gluon=_gluon(a, ws), same_tables=_same_tables(a))
        if _out_zeroed(launch):
            out.zero_()
        if key is not None:
            if len(_CALL_PLANS) >= _CALL_PLANS_MAX:
                _CALL_PLANS.clear()
            call = _CALL_PLANS[key] = _CallPlan(r._replace(dropout_seed=None), sparse, launch, tuple(out.shape))
    else:
        a, r = _arrays(named), call.resolved
        if named["dropout_prob"] != 0.0:
            r = r._replace(dropout_seed=_seed_tensor(named["dropout_prob"], named["dropout_seed"], query.device))
        a["dropout_seed"] = r.dropout_seed
        launch = flash_plan.used(call.forward)
        out = (torch.zeros if call.out_zeroed else torch.empty)(call.out_shape, dtype=a["query"].dtype,
                                                                  device=query.device)
    res = _launch.run(launch, a, outputs={"out": out})
    return res["out"].to(query.dtype), res["lse"], r, call


flash_fwd = torch.library.custom_op("dualattn::flash_fwd", mutates_args=(), device_types=("cpu", "cuda"))(
    _flash_fwd_impl)


@flash_fwd.register_fake
def _(*args):
    named = dict(zip(_TENSOR_ARGS + _STATIC_ARGS, args))
    shapes = _shapes(_inputs(*(named[n] for n in _TENSOR_ARGS[:10])), named["max_seqlen_q"], named["max_seqlen_k"])
    lse_shape = (shapes.heads_q, shapes.total_q) if shapes.varlen else (shapes.batch, shapes.heads_q,
                                                                        shapes.seqlen_q)
    query = named["query"]
    return (query.new_empty(flash_plan.out_shape(shapes)),
            query.new_empty(lse_shape, dtype=torch.float32))


def _flash_bwd_impl(dout: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor], query: Tensor, key: Tensor,
                    value: Tensor,
              bias: Optional[Tensor], attention_mask: Optional[Tensor], q_segment_ids: Optional[Tensor],
              kv_segment_ids: Optional[Tensor], softmax_aux: Optional[Tensor], cu_seqlens_q: Optional[Tensor],
              cu_seqlens_k: Optional[Tensor], sparse_kv_count: Optional[Tensor], sparse_kv_index: Optional[Tensor],
              sparse_q_order: Optional[Tensor], sparse_q_count: Optional[Tensor], sparse_q_index: Optional[Tensor],
              sparse_k_order: Optional[Tensor], q_positions: Optional[Tensor], kv_positions: Optional[Tensor],
              max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, window_left: int, window_right: int, logits_soft_cap: float, dropout_prob: float,
              dropout_seed: int, diag_shift: int, sparse_block_q: int,
              sparse_block_k: int, sparse_contiguous: int,
              deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward launches: (dquery, dkey, dvalue, dbias, dsoftmax_aux); absent inputs get empty grads.
    dlse (None: zero) is the cotangent of the forward's lse."""
    named = {k: v for k, v in locals().items() if k not in ("dout", "out", "lse", "dlse")}
    return _backward(named, dout, out, lse, dlse)


def _backward(named: dict, dout: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
              resolved: Optional[_Resolved] = None, call: Optional[_CallPlan] = None, bias_grad: bool = True):
    """The backward launches; `resolved` and `call` as the forward of this call gave them (eager), or
    both None (the custom op: then the call's plan is looked up by its key).  bias_grad: a bias's
    gradient is wanted (otherwise dbias comes back empty, and no S x S gradient is written)."""
    if resolved is None:
        key = _call_key(named)
        call = _CALL_PLANS.get(key) if key is not None else None
        if call is not None:
            resolved = call.resolved._replace(dropout_seed=_seed_tensor(named["dropout_prob"], named["dropout_seed"],
                                                                        named["query"].device))
    a, sparse, r = _problem(named, resolved)
    shapes = r.shapes
    query, key, value, bias, softmax_aux = (named[n] for n in ("query", "key", "value", "bias", "softmax_aux"))
    # dO is read with O's strides (both contiguous BSHD / packed), dlse with lse's.
    a.update(out=_cpu_upcast(out).contiguous(), dout=_cpu_upcast(dout).to(a["query"].dtype).contiguous(),
             lse=lse.contiguous(), dlse=None if dlse is None else dlse.float().contiguous())
    # What the backward plan depends on beyond the call's key (a config pinned around the backward
    # included); lse and dlse are contiguous, of the sizes' shapes.
    backward_key = (r.config, dlse is not None, _tensor_key(a["out"]), _tensor_key(a["dout"]),
                    flash_plan.environment(), bias_grad)
    plan = call.backwards.get(backward_key) if call is not None else None
    if plan is not None:
        flash_plan.used(plan)
    else:
        ws = _warp_specialize(a)
        plan = _plan(flash_plan.plan_backward, fit.backward, a, shapes, r.options,
                     _strides({k: a[k] for k in a if k not in ("lse", "dlse")}),
                     config=r.config, diag_shift=named["diag_shift"], sparse=sparse,
                     tma=_tma(a), lse_grad=dlse is not None, warp_specialize=ws,
                     num_sms=_num_sms(a), gluon=_gluon(a, ws), deterministic=named["deterministic"],
                     bias_grad=bias_grad, same_tables=_same_tables(a))
        if call is not None:
            call.backwards[backward_key] = plan
    pre = _launch.run(plan.preprocess, a)
    a["delta"] = pre["delta"]
    grads = _launch.run(plan.dkdv, a)
    grads.update(_launch.run(plan.dq, {**a, **grads}))  # (the one-pass dq launch takes dkdv's dQ accumulator)
    dbias = grads.get("dbias")
    if bias is not None and bias_grad:
        dims = flash_plan.dbias_sum_dims(shapes)
        dbias = (dbias.sum(dim=dims, keepdim=True) if dims else dbias).to(bias.dtype)
    else:
        dbias = query.new_empty((0,))
    if softmax_aux is not None:
        view, dims = flash_plan.dsinks_partial_view(shapes, plan)
        dsinks = pre["dsinks_partial"].view(view).sum(dim=dims).reshape(softmax_aux.shape).to(softmax_aux.dtype)
    else:
        dsinks = query.new_empty((0,))
    return (grads["dquery"].to(query.dtype), grads["dkey"].to(key.dtype), grads["dvalue"].to(value.dtype),
            dbias, dsinks)


flash_bwd = torch.library.custom_op("dualattn::flash_bwd", mutates_args=(), device_types=("cpu", "cuda"))(
    _flash_bwd_impl)


@flash_bwd.register_fake
def _(dout, out, lse, dlse, query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux,
      *rest):
    return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
            torch.empty_like(bias) if bias is not None else query.new_empty((0,)),
            torch.empty_like(softmax_aux) if softmax_aux is not None else query.new_empty((0,)))


def _op_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output, *inputs[:len(_TENSOR_ARGS)])
    ctx.static = inputs[len(_TENSOR_ARGS):]


def _op_backward(ctx, dout, dlse):
    out, lse, *tensors = ctx.saved_tensors
    dq, dk, dv, dbias, dsinks = flash_bwd(dout, out, lse, dlse, *tensors, *ctx.static)
    named = dict(zip(_TENSOR_ARGS, tensors))
    grads = dict(query=dq, key=dk, value=dv, bias=dbias if named["bias"] is not None else None,
                 softmax_aux=dsinks if named["softmax_aux"] is not None else None)
    return tuple(grads.get(n) for n in _TENSOR_ARGS) + (None,) * len(_STATIC_ARGS)


# Autograd of the forward op itself, for graphs that hold the op rather than _FlashAttention
# (torch.export's programs).  Eager calls and torch.compile go through _FlashAttention, which calls the
# op with gradients off, so this formula is not on their path.
flash_fwd.register_autograd(_op_backward, setup_context=_op_setup_context)


# The inputs autograd differentiates; the other tensors and the statics travel packed in two
# tuples, because Function.apply's cost grows with its argument count (~16 us of host time for
# the 30 flat arguments, measured on CPU).
_GRAD_ARGS = ("query", "key", "value", "bias", "softmax_aux")
_OTHER_TENSOR_ARGS = tuple(n for n in _TENSOR_ARGS if n not in _GRAD_ARGS)


def _named(query, key, value, bias, softmax_aux, other_tensors: tuple, statics: tuple) -> dict:
    """The op's arguments by name, from the packed form _FlashAttention.apply takes."""
    named = dict(zip(_OTHER_TENSOR_ARGS, other_tensors))
    named.update(query=query, key=key, value=value, bias=bias, softmax_aux=softmax_aux)
    named.update(zip(_STATIC_ARGS, statics))
    return named


class _FlashAttention(torch.autograd.Function):
    """Autograd over the two custom ops (as flash-attn does).  Not flash_fwd.register_autograd:
    its generated forward re-binds all 30 schema arguments on every call (torch._library.utils.
    fill_defaults, ~0.35 ms of host time per call measured), which dominated short sequences.

    While torch.compile traces, the custom ops (one opaque node each, fake impls for shapes); in
    eager mode their implementations directly: the Python custom-op dispatch cost ~0.1 ms per
    call (measured), as much as the whole forward kernel at S = 1024, and the backward reuses what
    the forward resolved (sizes, options, config)."""

    @staticmethod
    def forward(ctx, query, key, value, bias, softmax_aux, other_tensors: tuple, statics: tuple):
        named = _named(query, key, value, bias, softmax_aux, other_tensors, statics)
        if torch.compiler.is_compiling():
            out, lse = flash_fwd(*(named[n] for n in _TENSOR_ARGS), *statics)
            ctx.resolved = ctx.call = None
        else:
            out, lse, ctx.resolved, ctx.call = _forward(named)
        ctx.save_for_backward(out, lse, *(named[n] for n in _TENSOR_ARGS))
        ctx.static = statics
        # No zero-filled dlse when only out is used (an allocation, a memset and a load less).
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        out, lse, *tensors = ctx.saved_tensors
        named = dict(zip(_TENSOR_ARGS, tensors))
        if dout is None and dlse is None:
            return (None,) * 7
        if dout is None:  # only lse was used
            dout = torch.zeros_like(out)
        if torch.compiler.is_compiling():
            dq, dk, dv, dbias, dsinks = flash_bwd(dout, out, lse, dlse, *tensors, *ctx.static)
        else:
            named.update(zip(_STATIC_ARGS, ctx.static))
            resolved = ctx.resolved
            override = executor.current_override("flash")
            # Tiles pinned around the backward: seen where the backward runs in the pinning thread (a CPU
            # backward); a CUDA backward runs on autograd's own thread and keeps the forward's config.
            if override is not None:
                resolved = resolved._replace(config=override)
            dq, dk, dv, dbias, dsinks = _backward(named, dout, out, lse, dlse, resolved, ctx.call,
                                                  bias_grad=ctx.needs_input_grad[3])
        return (dq, dk, dv, dbias if named["bias"] is not None and ctx.needs_input_grad[3] else None,
                dsinks if named["softmax_aux"] is not None else None, None, None)


# ----------------------------------------------------------------------------- public API

def _check_devices(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    ref = devices.get("query")
    for name, dev in devices.items():
        if dev != ref:
            raise ValueError(f"{name} is on {dev} but query is on {ref}: all tensors must share one device")
    if ref is not None and ref.type not in ("cpu", "cuda"):
        raise ValueError(f"query is on {ref}: dualattn runs on CUDA GPUs and (interpreted) on CPU")


def _last_dim_contiguous(t: Optional[Tensor]) -> Optional[Tensor]:
    # Kernels take element strides for every dim but the last, which must be dense.
    if t is None or t.stride(-1) == 1:
        return t
    return t.contiguous()


def _normalise(query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux):
    query, key, value, bias = map(_last_dim_contiguous, (query, key, value, bias))
    if attention_mask is not None:
        # The kernels read int8 0 / 1 (the Gluon forward masks S by integer operations on that): a bool
        # mask is viewed as int8 in place (same bytes, no copy of an S x S tensor per call); any integer
        # mask becomes (mask != 0) first, never truncated (256 -> 0).
        if attention_mask.dtype != torch.bool:
            attention_mask = attention_mask != 0
        attention_mask = _last_dim_contiguous(attention_mask.view(torch.int8))
    if q_segment_ids is not None or kv_segment_ids is not None:
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        width = getattr(torch, segment_id_dtype(q_segment_ids.dtype, kv_segment_ids.dtype))
        q_segment_ids, kv_segment_ids = (_segment_ids(ids, width) for ids in (q_segment_ids, kv_segment_ids))
    if softmax_aux is not None:
        softmax_aux = softmax_aux.contiguous()
    return query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux


def _segment_ids(ids: Tensor, width: torch.dtype) -> Tensor:
    """Segment ids as `width` (validation.segment_id_dtype) without changing which ids are equal."""
    if ids.dtype == torch.uint64:   # bit for bit: equality is kept
        ids = ids.view(torch.int64)
    return ids.to(width).contiguous()


def _capturing(t: Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# The host values of cu_seqlens tables, by id: a weak reference whose callback drops the entry when the table
# is freed, the values, and the version counter they were read at (None: a table made by host_table, which
# nothing writes).  Reading a CUDA table on the host synchronises with the GPU, and every attention layer of
# a packed batch passes the same table: read once, a table is read again only once it changes in place
# (torch ops bump its version counter), so a training step syncs once, not once per layer (a per-call sync
# cost the docs_varlen benchmark a quarter of its forward speed against jax, which never reads the tables).
_TABLE_VALUES: dict = {}


def _remember(table: Tensor, values: tuple, version: Optional[int]) -> None:
    key = id(table)

    def forget(ref, key=key):
        if _TABLE_VALUES.get(key, (None,))[0] is ref:
            del _TABLE_VALUES[key]
    _TABLE_VALUES[key] = (weakref.ref(table, forget), values, version)


def host_table(values, device) -> Tensor:
    """An int32 cu_seqlens table on `device` holding `values` (python ints), whose values table_values
    knows without reading the device copy back (NSA's packed compressed branch makes its tables on the
    host)."""
    values = tuple(int(v) for v in values)
    table = torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)
    _remember(table, values, None)
    return table


def _known_values(table: Tensor) -> Optional[tuple]:
    """table_values' values of `table` if they are known without reading it, else None."""
    seen = _TABLE_VALUES.get(id(table))
    if seen is not None and seen[0]() is table and (seen[2] is None or seen[2] == table._version):
        return seen[1]
    return None


def table_values(table: Tensor) -> tuple:
    """The values of an integer table (cu_seqlens) as python ints: read once (from a CUDA tensor, a
    synchronisation) and then remembered until the table is freed or changed in place.  Tensors made under
    torch.inference_mode keep no version counter: read on every call."""
    known = _known_values(table)
    if known is not None:
        return known
    values = tuple(table.tolist())
    if not table.is_inference():
        _remember(table, values, table._version)
    return values


@functools.lru_cache(maxsize=256)
def _check_values(values_q: tuple, values_k: tuple, limits: tuple) -> bool:
    """check_cu_seqlens_values once per distinct pair (a failing check raises, and is not cached): whether
    every query row lies in a sequence."""
    return check_cu_seqlens_values(list(values_q), list(values_k), *limits)


def _check_tables(cu_q: Tensor, cu_k: Tensor, shapes) -> None:
    limits = (shapes.total_q, shapes.total_k, shapes.seqlen_q, shapes.seqlen_k)
    values_q = table_values(cu_q)
    _check_values(values_q, values_q if cu_k is cu_q else table_values(cu_k), limits)


def _queries_covered(named: dict) -> bool:
    """Whether a varlen call's tables are known on the host (_check_tables read them, or host_table made
    them), pass the checks and put every query row in a sequence: then no out or lse row is left to a fill
    (FlashShapes.queries_covered).  Never reads a table."""
    cu_q, cu_k = named.get("cu_seqlens_q"), named.get("cu_seqlens_k")
    if cu_q is None or cu_k is None or torch.compiler.is_compiling():
        return False
    values_q, values_k = _known_values(cu_q), _known_values(cu_k)
    if values_q is None or values_k is None:
        return False
    limits = (named["query"].shape[0], named["key"].shape[0], named["max_seqlen_q"], named["max_seqlen_k"])
    try:
        return _check_values(values_q, values_k, limits)
    except ValueError:
        return False


def _sanitized_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """The torch twin of jax_api.mask.sanitize_cu_seqlens: non-decreasing, clipped to [0, total]."""
    return torch.cummax(cu_seqlens, 0).values.clamp(0, total).to(torch.int32)


def _resolve_seed(dropout_prob: float, dropout_seed: Optional[int]) -> int:
    if dropout_prob == 0.0:
        return 0
    if dropout_seed is None:
        # A fresh mask per call, reproducible under torch.manual_seed.
        return int(torch.randint(0, 2 ** 31 - 1, (), device="cpu").item())
    return int(dropout_seed)


def _call(query, key, value, *, softmax_scale, causal, sliding_window, logits_soft_cap, softmax_aux,
          q_segment_ids, kv_segment_ids, attention_mask, bias, dropout_prob, dropout_seed, return_lse,
          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, diag_shift=0, sparse=None,
          q_positions=None, kv_positions=None, deterministic=False):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    # torch.use_deterministic_algorithms(True) asks for it too, as for torch's own kernels.
    deterministic = check_flag("deterministic", deterministic) or torch.are_deterministic_algorithms_enabled()
    _check_devices(query=query, key=key, value=value, bias=bias, attention_mask=attention_mask,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_aux=softmax_aux,
                   cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    check_dropout(dropout_prob, dropout_seed)
    shapes = _checked(query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux,
                      cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if shapes.varlen:
        if not torch.compiler.is_compiling() and not _capturing(cu_seqlens_q):
            # A device->host copy of the (small) tables: a sync on CUDA, so once per table
            # (_check_tables) and skipped where it cannot happen (torch.compile graphs, CUDA-graph capture).
            _check_tables(cu_seqlens_q, cu_seqlens_k, shapes)
        else:
            # Unchecked tables run made non-decreasing and clipped to the packed tokens, so sequences
            # never overlap; the kernels clamp every bound anyway (rules.sequence_bounds).
            same = cu_seqlens_q is cu_seqlens_k and shapes.total_q == shapes.total_k
            cu_seqlens_q = _sanitized_cu_seqlens(cu_seqlens_q, shapes.total_q)
            # (one table stays one: plan.varlen_as_documents)
            cu_seqlens_k = cu_seqlens_q if same else _sanitized_cu_seqlens(cu_seqlens_k, shapes.total_k)
    options = FlashOptions.build(head_dim=shapes.head_dim, softmax_scale=softmax_scale, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                 dropout_prob=dropout_prob)
    (query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids,
     softmax_aux) = _normalise(query, key, value, bias, attention_mask, q_segment_ids, kv_segment_ids, softmax_aux)
    sparse_tensors, block_q, block_k, contiguous = (None,) * 6, 0, 0, 0
    if sparse is not None:  # a dualattn.SparseMask, validated by the block-sparse front end
        sparse_tensors = _sparse_tensors(sparse, query.device)
        block_q, block_k = sparse.block_q, sparse.block_k
        contiguous = int(sparse.kv_rows_contiguous) | 2 * int(sparse.q_rows_contiguous)  # bit flags
    other_tensors = (attention_mask, q_segment_ids, kv_segment_ids, cu_seqlens_q, cu_seqlens_k, *sparse_tensors,
                     *_positions(q_positions, kv_positions, shapes, query.device))   # as _OTHER_TENSOR_ARGS
    statics = (shapes.seqlen_q, shapes.seqlen_k, options.softmax_scale,
               _NONE if options.window_left is None else options.window_left,
               _NONE if options.window_right is None else options.window_right,
               options.logits_soft_cap or 0.0, options.dropout_prob, _resolve_seed(dropout_prob, dropout_seed),
               int(diag_shift), block_q, block_k, contiguous, deterministic)   # as _STATIC_ARGS
    grads = (query, key, value, bias, softmax_aux)   # as _GRAD_ARGS
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and
                                         any(t is not None and t.requires_grad for t in grads)):
        out, lse = _FlashAttention.apply(*grads, other_tensors, statics)
    else:  # nothing to differentiate: the forward alone, without autograd's Function machinery
        out, lse, _, _ = _forward(_named(*grads, other_tensors, statics))
    return (out, lse) if return_lse else out


def _positions(q_positions, kv_positions, shapes, device) -> tuple:
    """Explicit token positions (block-sparse), the missing side filled with the default positions."""
    if q_positions is None and kv_positions is None:
        return None, None
    check_positions(q_positions, kv_positions, shapes.batch, shapes.seqlen_q, shapes.seqlen_k)
    if q_positions is None:
        q_positions = (torch.arange(shapes.seqlen_q, device=device) + shapes.seqlen_k - shapes.seqlen_q).expand(
            shapes.batch, -1)
    if kv_positions is None:
        kv_positions = torch.arange(shapes.seqlen_k, device=device).expand(shapes.batch, -1)
    return q_positions.to(torch.int32).contiguous(), kv_positions.to(torch.int32).contiguous()


def _sparse_tensors(layout, device) -> tuple:
    """The layout's block lists on `device`, uploaded once and cached on the layout."""
    key = ("torch", str(device))
    if key not in layout.device_cache:
        arrays = layout.arrays()
        layout.device_cache[key] = tuple(torch.as_tensor(arrays[n], device=device)
                                         for n in flash_plan.SPARSE_INPUTS)
    return layout.device_cache[key]


def flash_attention(query: Tensor, key: Tensor, value: Tensor, *, softmax_scale: Optional[float] = None,
                    causal: bool = False, sliding_window=None, logits_soft_cap: Optional[float] = None,
                    softmax_aux: Optional[Tensor] = None, q_segment_ids: Optional[Tensor] = None,
                    kv_segment_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                    bias: Optional[Tensor] = None, dropout_prob: float = 0.0, dropout_seed: Optional[int] = None,
                    return_lse: bool = False, deterministic: bool = False):
    """Flash attention over BSHD tensors, forward and backward through the shared Triton kernels.

    Args:
        query: (B, Sq, Hq, D); key: (B, Sk, Hkv, D); value: (B, Sk, Hkv, Dv). fp16, bf16 or fp32;
            Hq a multiple of Hkv (GQA/MQA); D, Dv in [16, 256]. Any strides with a dense last dim.
        softmax_scale: defaults to D ** -0.5.
        causal: query i attends key j iff j <= i + (Sk - Sq) (bottom-right aligned)::

                Sq=2, Sk=5, causal       Sq=5, Sk=2, causal (rows 0-2 see nothing -> 0)
                  1 1 1 1 0                0 0
                  1 1 1 1 1                0 0
                                           0 0
                                           1 0
                                           1 1
        sliding_window: int w or (left, right): i + (Sk-Sq) - left <= j <= i + (Sk-Sq) + right.
        logits_soft_cap: scores -> cap * tanh(scores / cap) (after scale and bias).
        softmax_aux: attention sinks, (Hq, n), (Hq,) or shared (n,); differentiable.
        q_segment_ids, kv_segment_ids: int (B, Sq) / (B, Sk); attend only within equal ids.
        attention_mask: bool/int (B|1, Hq|1, Sq, Sk), True = may attend.
        bias: float (B|1, Hq|1, Sq, Sk), added after scaling; differentiable.
        dropout_prob, dropout_seed: dropout on the probabilities; the mask is a pure function of
            (seed, b, h, i, j). seed None draws one from torch's default generator.
        return_lse: also return the float32 log-sum-exp (B, Hq, Sq), differentiable.
        deterministic: a backward whose gradients are bitwise reproducible run to run.  The one-pass
            Hopper backward adds dQ tiles with atomics (order varies); deterministic=True takes the
            two-pass kernels instead (about 10% slower backward at long sequences).  Also on under
            torch.use_deterministic_algorithms(True).

    Returns:
        out (B, Sq, Hq, Dv) in query's dtype, or (out, lse). Fully masked rows give 0 (lse -inf).
    """
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=q_segment_ids,
                 kv_segment_ids=kv_segment_ids, attention_mask=attention_mask, bias=bias,
                 dropout_prob=dropout_prob, dropout_seed=dropout_seed, return_lse=return_lse,
                 deterministic=deterministic)


def flash_attn_varlen_func(query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: Optional[float] = None,
                           causal: bool = False, sliding_window=None, logits_soft_cap: Optional[float] = None,
                           softmax_aux: Optional[Tensor] = None, dropout_prob: float = 0.0,
                           dropout_seed: Optional[int] = None, return_lse: bool = False,
                           deterministic: bool = False):
    """Packed variable-length attention, as flash-attn's flash_attn_varlen_func.

    query (total_q, Hq, D), key/value (total_k, Hkv, D/Dv); cu_seqlens_* int32 (n_seqs + 1,)
    cumulative lengths. Each sequence is attended independently, with its own bottom-right
    causal alignment. Returns out (total_q, Hq, Dv) [and lse (Hq, total_q)].  deterministic: as
    flash_attention's.
    """
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be an int32 torch.Tensor, got {type(cu).__name__}")
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=None,
                 kv_segment_ids=None, attention_mask=None, bias=None, dropout_prob=dropout_prob,
                 dropout_seed=dropout_seed, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                 deterministic=deterministic)


class _SDPAArgumentError(ValueError, RuntimeError):
    """A bad scaled_dot_product_attention argument: a ValueError naming it, and a RuntimeError as
    torch's SDPA raises for the same input, so code catching either keeps working."""


class _SDPATypeError(TypeError, RuntimeError):
    """A scaled_dot_product_attention argument of a dtype torch's SDPA rejects (TypeError and RuntimeError)."""


# torch's own SDPA (the C function F.scaled_dot_product_attention binds), for the calls the kernels
# cannot take: still torch's even where F.scaled_dot_product_attention is patched to this module's.
_torch_sdpa = torch._C._nn.scaled_dot_product_attention

_SDPA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _sdpa_mask(attn_mask: Tensor, query: Tensor, key: Tensor, enable_gqa: bool) -> Tensor:
    """attn_mask checked as torch's SDPA checks it and broadcast (a view) to the scores' shape
    (*batch, Sq, Sk): batch is query's and key's leading dims broadcast (under GQA, query's heads)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise _SDPATypeError(f"attn_mask must be bool (True = attend), float32 or query's dtype {query.dtype} "
                             f"(an additive bias), as in torch's SDPA; got {attn_mask.dtype}")
    key_batch = key.shape[:-2]
    if enable_gqa and query.dim() > 2 and key.dim() > 2:
        key_batch = key_batch[:-1] + query.shape[-3:-2]
    try:
        scores = torch.broadcast_shapes(query.shape[:-2], key_batch)
    except RuntimeError:
        return attn_mask  # query and key do not broadcast: torch's SDPA reports that
    target = (*scores, query.shape[-2], key.shape[-2])
    shape = tuple(attn_mask.shape)
    if not 2 <= len(shape) <= len(target) or any(m not in (1, t) for m, t in zip(shape[::-1], target[::-1])):
        raise _SDPAArgumentError(f"attn_mask of shape {shape} does not broadcast to the attention scores' shape "
                                 f"{target} (*batch, query seq_len, key seq_len)")
    return attn_mask.expand(target)


def _sdpa_mask_4d(attn_mask: Tensor) -> Tensor:
    """A mask broadcast to (*batch, H, Sq, Sk) as (B or 1, H or 1, Sq, Sk): broadcast batch and head
    dims narrowed back to 1, so neither the kernels nor a copy ever see the full expansion."""
    lead = range(attn_mask.dim() - 3)
    if all(attn_mask.stride(d) == 0 for d in lead):
        for d in lead:
            attn_mask = attn_mask.narrow(d, 0, 1)
    if attn_mask.dim() > 2 and attn_mask.stride(-3) == 0:
        attn_mask = attn_mask.narrow(-3, 0, 1)
    return _as_bhsd(attn_mask)


def _sdpa_fallback(query: Tensor, key: Tensor, value: Tensor, dropout_p, scale) -> Optional[str]:
    """Why the kernels cannot take this scaled_dot_product_attention call (None: they can)."""
    if query.is_nested or key.is_nested or value.is_nested:
        return "nested tensors"
    if not query.dim() == key.dim() == value.dim() >= 2:
        return "query, key and value of different ranks (broadcast) or below 2-D"
    if not query.dtype == key.dtype == value.dtype or query.dtype not in _SDPA_DTYPES:
        return f"dtypes {query.dtype}, {key.dtype}, {value.dtype} (kernels: one of fp16, bf16, fp32)"
    if not query.device == key.device == value.device or query.device.type not in ("cpu", "cuda"):
        return f"devices {query.device}, {key.device}, {value.device}"
    if query.shape[:-3] != key.shape[:-3] or key.shape[:-1] != value.shape[:-1]:
        return "batch dims that broadcast, or key and value of different heads or lengths"
    if query.numel() == 0 or key.numel() == 0 or value.numel() == 0:
        return "empty tensors"
    if query.dim() > 2 and query.shape[-3] % key.shape[-3]:
        return f"query heads {query.shape[-3]} not a multiple of key/value heads {key.shape[-3]}"
    d, dv = query.shape[-1], value.shape[-1]
    if key.shape[-1] != d or not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM and MIN_HEAD_DIM <= dv <= MAX_HEAD_DIM):
        return f"head dims {d} / {dv} (kernels: {MIN_HEAD_DIM}..{MAX_HEAD_DIM})"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        return f"dropout_p {dropout_p!r} (kernels: [0, 1))"
    if scale is not None and not (isinstance(scale, numbers.Real) and 0.0 < scale < math.inf):
        return f"scale {scale!r} (kernels: finite, positive)"
    return None


def _as_bhsd(t: Tensor) -> Tensor:
    """(*batch, [H,] S, E) as a 4-D (B, H, S, E) view (a copy only where the batch dims cannot merge)."""
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    return t.reshape(-1, *t.shape[-3:])


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """Drop-in for torch.nn.functional.scaled_dot_product_attention: same arguments, result and errors.

    Args:
        query (*batch, Hq, Sq, E), key (*batch, Hkv, Sk, E), value (*batch, Hkv, Sk, Ev): any number of
            leading batch dims (also none: 2-D (S, E) inputs).  Hkv may differ from Hq when enable_gqa
            (query head h uses key/value head h // (Hq / Hkv)) or when Hkv is 1 (broadcast).
        attn_mask: bool (True = attend) or an additive float bias (float32 or query's dtype; -inf
            masks), broadcastable to (*batch, Hq, Sq, Sk); differentiable.  Other dtypes raise, as in torch.
        dropout_p: dropout on the attention probabilities (a fresh mask per call, drawn from torch's RNG).
        is_causal: query i attends key j iff j <= i (top-left aligned, as torch's); not with attn_mask::

                Sq=2, Sk=5       Sq=5, Sk=2
                  1 0 0 0 0        1 0
                  1 1 0 0 0        1 1
                                   1 1 ...
        scale: defaults to E ** -0.5.

    Returns:
        (*batch, Hq, Sq, Ev) in query's dtype: contiguous, or in the BSHD-transposed layout when query
        is itself such a view (as torch's CPU kernels return it).  Rows with nothing to attend give 0.

    The shared kernels run what they can take (fp16/bf16/fp32, head dims 16..256, equal batch dims,
    dropout_p < 1, positive scale); every other call torch accepts runs torch's own SDPA, so no call
    torch takes is refused.  Bad arguments raise errors that are RuntimeErrors, as torch's, and
    also ValueError / TypeError naming the argument.
    """
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise _SDPAArgumentError(f"{name} must be at least 2-D (..., seq_len, head_dim), got shape "
                                     f"{tuple(t.shape)}")
    is_causal, enable_gqa = check_flag("is_causal", is_causal), check_flag("enable_gqa", enable_gqa)
    if attn_mask is not None:
        if is_causal:
            raise _SDPAArgumentError("attn_mask and is_causal=True cannot both be given (as torch's SDPA documents "
                                     "it); fold the causal mask into attn_mask")
        attn_mask = _sdpa_mask(attn_mask, query, key, enable_gqa)
    # Without enable_gqa torch broadcasts the head dims: the kernels take only a single key/value head.
    broadcast_heads = (not enable_gqa and query.dim() > 2 and key.dim() > 2
                       and key.shape[-3] not in (1, query.shape[-3]))
    if broadcast_heads or _sdpa_fallback(query, key, value, dropout_p, scale) is not None:
        return _torch_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                           scale=scale, enable_gqa=enable_gqa)
    sq, sk = query.shape[-2], key.shape[-2]
    q4, k4, v4 = _as_bhsd(query), _as_bhsd(key), _as_bhsd(value)
    bias = mask = None
    if attn_mask is not None:   # (*batch, Hq, Sq, Sk) -> (B or 1, Hq or 1, Sq, Sk)
        m4 = _sdpa_mask_4d(attn_mask)
        mask, bias = (m4, None) if m4.dtype == torch.bool else (None, m4)
    out = _call(q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2), softmax_scale=scale,
                causal=is_causal, sliding_window=None, logits_soft_cap=None, softmax_aux=None,
                q_segment_ids=None, kv_segment_ids=None, attention_mask=mask, bias=bias, dropout_prob=dropout_p,
                dropout_seed=None, return_lse=False, diag_shift=(sq - sk) if is_causal else 0).transpose(1, 2)
    if not q4.transpose(1, 2).is_contiguous():
        out = out.contiguous()  # the kernels write BSHD; torch returns query's layout
    return out.reshape(*query.shape[:-1], value.shape[-1])


def dropout_keep_mask(seed: int, batch: int, heads: int, seqlen_q: int, seqlen_k: int, dropout_prob: float,
                      device="cpu") -> Tensor:
    """The boolean (B, H, Sq, Sk) keep-mask the kernels draw for this seed (for tests and debugging)."""
    launch = flash_plan.plan_dropout_mask(batch, heads, seqlen_q, seqlen_k, dropout_prob, seed)
    return _launch.run(launch, {}, device=device)["keep"].bool()
