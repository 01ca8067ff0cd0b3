"""JAX front end of flash attention: one public function, four backends.

backend="triton": jax.custom_vjp over the shared Triton kernels (dualattn/kernels/flash),
launched with the very launch plans the torch side uses (jax-triton on GPU, the
interpreter through pure_callback on CPU).  "xla" and "pallas" live in their folders;
"auto" picks triton on GPU (xla where jax-triton is not installed), pallas on TPU, xla elsewhere.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from .. import executor
from ..kernels.flash import fit
from ..kernels.flash import plan as flash_plan
from ..kernels.launch import as_int32, max_shared_memory, row_major_strides, sm_count
from ..options import FlashOptions
from ..sparse import sparse_info
from ..validation import (FlashShapes, check_cu_seqlens_values, check_dropout, check_flag, check_flash_args,
                          check_positions)
from . import _launch
from ._vma import vary_like
from .mask import sanitize_cu_seqlens, segment_ids_as_kernel_dtype, varlen_tokens

BACKENDS = ("auto", "triton", "xla", "pallas")
_TENSORS = ("query", "key", "value", "bias", "attention_mask", "q_segment_ids", "kv_segment_ids", "softmax_aux",
            "cu_seqlens_q", "cu_seqlens_k", "dropout_seed")


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call: the single nondiff argument of the custom_vjp core."""

    shapes: FlashShapes
    options: FlashOptions
    config: flash_plan.FlashConfig
    diag_shift: int = 0
    sparse: Optional[flash_plan.SparseInfo] = None  # block-sparse layout; its lists are in the arrays
    tma: bool = False               # plan flags, as the torch launcher sets them (_descriptor_flags)
    warp_specialize: bool = False
    gluon: bool = False             # may run the Gluon kernels (plan.gluon_allowed; _compile.py)
    num_sms: int = 0                # the GPU's SMs, for persistent launches (plan.persistent_forward, _backward)
    arch: int = 0                   # the GPU's compute capability (90, 80); 0: the CPU interpreter
    max_shared: int = 0             # its shared memory per block: portable launches are fitted to it (fit.py)
    deterministic: bool = False     # backward without the one-pass kernel's dQ atomics (plan.plan_backward)
    same_tables: bool = False       # varlen with one table for queries and keys (plan.varlen_as_documents, and
                                    # plan.varlen_backward_as_documents)


# (shapes, options) -> the executor's autotune_fn: set by _autotune.py, which times calls of this
# module's functions (so the dependency runs one way: _autotune -> flash).
autotune_fn_for = None


def _strides(arrays: dict) -> dict:
    return {n: row_major_strides(a.shape) for n, a in arrays.items() if a is not None}


def _plan(static: _Static, plan_fn, fit_fn, arrays: dict, *args, **kwargs):
    """plan_fn's launches; on a GPU fit_fn's, whose portable launches are checked (compiled) against the
    device's shared memory and made smaller where they would not fit (kernels/flash/fit.py)."""
    kwargs.update(config=static.config, diag_shift=static.diag_shift, sparse=static.sparse, tma=static.tma,
                  warp_specialize=static.warp_specialize, num_sms=static.num_sms, gluon=static.gluon)
    if not static.arch:
        return plan_fn(static.shapes, static.options, *args, **kwargs)
    dtypes = {name: jnp.dtype(a.dtype).name for name, a in arrays.items() if a is not None}
    return fit_fn(static.shapes, static.options, *args, arch=static.arch, max_shared=static.max_shared,
                  dtypes=dtypes, specialize="jax", **kwargs)


def _forward(static: _Static, arrays: dict):
    out_shape = flash_plan.out_shape(static.shapes)
    launch = _plan(static, flash_plan.plan_forward, fit.forward, arrays,
                   {**_strides(arrays), "out": row_major_strides(out_shape)}, same_tables=static.same_tables)
    res = _launch.run(launch, arrays)
    return vary_like((res["out"], res["lse"]), arrays["query"], arrays["key"], arrays["value"])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash_triton(static: _Static, arrays: dict):
    return _forward(static, arrays)


def _flash_triton_fwd(static: _Static, arrays: dict):
    """With symbolic zeros each array comes as a CustomVJPPrimal: its value, and whether anything
    differentiates it.  A bias nobody differentiates (an ALiBi or a fixed table closed over) then
    gets no dbias: the backward plans without it (plan_backward's bias_grad), which lets the one-pass
    kernel run.  That choice is static, so it rides in the residuals' structure: () or None."""
    values = {n: None if a is None else a.value for n, a in arrays.items()}
    bias = arrays.get("bias")
    out, lse = _forward(static, values)
    return (out, lse), (values, out, lse, () if bias is not None and bias.perturbed else None)


def _flash_triton_bwd(static: _Static, residuals, cotangents):
    arrays, out, lse, bias_grad = residuals
    dout, dlse = (jnp.zeros_like(x) if isinstance(c, SymbolicZero) else c for c, x in zip(cotangents, (out, lse)))
    return (_backward(static, arrays, out, lse, dout, dlse, bias_grad is not None),)


def _backward(static: _Static, arrays: dict, out, lse, dout, dlse, bias_grad: bool) -> dict:
    """The cotangent of each of `arrays` (None where it has none) from the forward's out and lse:
    the custom VJP's backward, and each step of the ring's (jax_api/ring.py).  bias_grad: whether
    dbias is wanted (plan_backward)."""
    shapes = static.shapes
    a = dict(arrays, out=out, dout=dout.astype(out.dtype), lse=lse, dlse=dlse.astype(jnp.float32))
    plan = _plan(static, flash_plan.plan_backward, fit.backward, a,
                 {**_strides(arrays), "out": row_major_strides(out.shape)}, lse_grad=True,
                 deterministic=static.deterministic, bias_grad=bias_grad, same_tables=static.same_tables)
    pre = _launch.run(plan.preprocess, a)
    a["delta"] = pre["delta"]
    grads = dict(_launch.run(plan.dkdv, a))
    grads.update(_launch.run(plan.dq, {**a, **grads}))
    cot = {n: None for n in arrays}
    cot.update(query=grads["dquery"], key=grads["dkey"], value=grads["dvalue"])
    if bias_grad:
        dims = flash_plan.dbias_sum_dims(shapes)
        dbias = grads["dbias"].sum(axis=dims, keepdims=True) if dims else grads["dbias"]
        cot["bias"] = dbias.astype(arrays["bias"].dtype)
    if arrays.get("softmax_aux") is not None:
        view, dims = flash_plan.dsinks_partial_view(shapes, plan)
        sinks = arrays["softmax_aux"]
        cot["softmax_aux"] = pre["dsinks_partial"].reshape(view).sum(axis=dims).reshape(sinks.shape).astype(
            sinks.dtype)
    return {n: None if g is None else vary_like(g, arrays[n]) for n, g in cot.items()}


_flash_triton.defvjp(_flash_triton_fwd, _flash_triton_bwd, symbolic_zeros=True)


def _seed_array(dropout_prob: float, dropout_seed):
    if dropout_prob == 0.0:
        return None
    if dropout_seed is None:
        raise ValueError("dropout_seed is required with dropout_prob > 0 in JAX (an int or an integer scalar "
                         "array, e.g. jax.random.randint(key, (), 0, 2**31 - 1))")
    if isinstance(dropout_seed, (int, np.integer)):
        return jnp.asarray([as_int32(int(dropout_seed))], dtype=jnp.int32)
    seed = jnp.asarray(dropout_seed)
    if seed.size != 1 or not jnp.issubdtype(seed.dtype, jnp.integer):
        raise TypeError(f"dropout_seed must be an int or an integer scalar array, got {seed.dtype}{seed.shape}")
    return jax.lax.bitcast_convert_type(seed.reshape(1).astype(jnp.uint32), jnp.int32)


def _positions(q_positions, kv_positions, shapes: FlashShapes):
    """Explicit token positions (block-sparse), the missing side filled with the default positions."""
    if q_positions is None and kv_positions is None:
        return None, None
    check_positions(q_positions, kv_positions, shapes.batch, shapes.seqlen_q, shapes.seqlen_k)
    if q_positions is None:
        q_positions = jnp.broadcast_to(jnp.arange(shapes.seqlen_q) + shapes.seqlen_k - shapes.seqlen_q,
                                       (shapes.batch, shapes.seqlen_q))
    if kv_positions is None:
        kv_positions = jnp.broadcast_to(jnp.arange(shapes.seqlen_k), (shapes.batch, shapes.seqlen_k))
    return q_positions.astype(jnp.int32), kv_positions.astype(jnp.int32)


def _sparse_arrays(layout) -> dict:
    """The layout's block lists as jax arrays, made once per layout, and concrete even when the first
    call is being traced: a traced array cached here escaped into the next trace (a jitted forward,
    then a jitted gradient with the same layout: UnexpectedTracerError)."""
    if "jax" not in layout.device_cache:
        with jax.ensure_compile_time_eval():
            layout.device_cache["jax"] = {n: jnp.asarray(a) for n, a in layout.arrays().items()}
    return layout.device_cache["jax"]


def check_arrays(**arrays) -> None:
    """TypeError naming the argument unless each given array is a jax array or a numpy array: a list
    or a torch tensor would otherwise fail deep inside tracing (dualattn.interop.torch_to_jax moves a
    torch tensor over without a copy)."""
    for name, x in arrays.items():
        if x is None and name not in ("query", "key", "value") or isinstance(x, (jax.Array, np.ndarray)):
            continue
        hint = " (dualattn.interop.torch_to_jax converts it without a copy)" if type(x).__module__.startswith(
            "torch") else ""
        raise TypeError(f"{name} must be a jax array, got {type(x).__module__}.{type(x).__name__}{hint}")


def _resolve_backend(backend: str, query=None) -> str:
    """The backend that runs: "auto" resolved to one this install can run; ImportError naming the extra
    to install where "triton" cannot run (on a GPU it needs jax-triton; on CPU the interpreter needs
    nothing more), raised before anything is traced."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = {"gpu": "triton", "tpu": "pallas"}.get(jax.default_backend(), "xla")
        if backend == "triton" and not _launch.jax_triton_available():
            return "xla"
        return backend
    if backend == "triton" and not _launch.jax_triton_available() and _launch._on_gpu(query):
        raise ImportError("backend='triton' launches the kernels on a GPU through jax-triton, which is not "
                          "installed: pip install 'dualattn[jax-gpu]' (or use backend='xla')")
    return backend


def _descriptor_flags(query) -> dict:
    """The plans' tma / warp_specialize flags.  XLA's buffers are 16-byte aligned, as descriptors
    need; the descriptors live in the launch's DESC_SCRATCH buffer (_scratch.py)."""
    arch = _launch.gpu_arch() if _launch._on_gpu(query) else None
    descriptors = arch is None or arch >= 90
    warp_specialize = flash_plan.warp_specialize_requested(arch) and descriptors
    return dict(tma=flash_plan.tma_requested() and descriptors, warp_specialize=warp_specialize,
                gluon=flash_plan.gluon_allowed(arch, warp_specialize),
                num_sms=sm_count(0 if arch is not None else None), arch=arch or 0,
                max_shared=max_shared_memory(0) if arch is not None else 0)


def _triton_config(shapes: FlashShapes, options: FlashOptions, query) -> flash_plan.FlashConfig:
    # override -> memory -> disk cache (shared with torch) -> autotune (opt-in) -> plan.default_config
    if _launch._on_gpu(query):
        return executor.select_config("flash", platform="cuda", backend="triton",
                                      device_name=jax.devices("gpu")[0].device_kind, arch=_launch.gpu_arch(),
                                      shapes=shapes, options=options,
                                      autotune_fn=autotune_fn_for(shapes, options) if autotune_fn_for else None)
    return executor.select_config("flash", platform="cpu", backend="triton-interpret", device_name="cpu",
                                  shapes=shapes, options=options)


def _call(query, key, value, *, softmax_scale, causal, sliding_window, logits_soft_cap, softmax_aux, q_segment_ids,
          kv_segment_ids, attention_mask, bias, dropout_prob, dropout_seed, return_lse, backend,
          cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, diag_shift=0, xla_options=None,
          sparse=None, q_positions=None, kv_positions=None, deterministic=False):
    check_arrays(query=query, key=key, value=value, bias=bias, attention_mask=attention_mask,
                 q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_aux=softmax_aux,
                 cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, q_positions=q_positions,
                 kv_positions=kv_positions)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    deterministic = check_flag("deterministic", deterministic)
    check_dropout(dropout_prob, dropout_seed)
    shapes = check_flash_args(query, key, value, bias=bias, attention_mask=attention_mask,
                              q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, softmax_aux=softmax_aux,
                              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    options = FlashOptions.build(head_dim=shapes.head_dim, softmax_scale=softmax_scale, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                 dropout_prob=dropout_prob)
    same_tables = False
    if shapes.varlen:
        if not any(isinstance(c, jax.core.Tracer) for c in (cu_seqlens_q, cu_seqlens_k)):
            covered = check_cu_seqlens_values(np.asarray(cu_seqlens_q).tolist(), np.asarray(cu_seqlens_k).tolist(),
                                              shapes.total_q, shapes.total_k, shapes.seqlen_q, shapes.seqlen_k)
            shapes = dataclasses.replace(shapes, queries_covered=covered)
        # Traced tables are checked by no host: run them as made non-decreasing and clipped to the packed
        # tokens (a no-op on checked ones), so sequences never overlap (mask.varlen_tokens).  One table
        # stays one (plan.varlen_as_documents).
        same_tables = cu_seqlens_q is cu_seqlens_k and shapes.total_q == shapes.total_k
        cu_seqlens_q = sanitize_cu_seqlens(jnp.asarray(cu_seqlens_q), shapes.total_q)
        cu_seqlens_k = cu_seqlens_q if same_tables else sanitize_cu_seqlens(jnp.asarray(cu_seqlens_k),
                                                                            shapes.total_k)
    backend = _resolve_backend(backend, query)
    if q_segment_ids is not None or kv_segment_ids is not None:
        q_segment_ids = kv_segment_ids if q_segment_ids is None else q_segment_ids
        kv_segment_ids = q_segment_ids if kv_segment_ids is None else kv_segment_ids
        q_segment_ids, kv_segment_ids = segment_ids_as_kernel_dtype(q_segment_ids, kv_segment_ids)
    if backend == "triton":
        if attention_mask is not None and attention_mask.dtype != jnp.bool_:
            attention_mask = attention_mask != 0   # 0 / 1 as the kernels read it, never truncated (256 -> 0)
        # A bool mask goes to the kernels as it is (rules.mask_as_int8 reads its bytes): no int8 copy of
        # the S x S tensor per call (benchmarks/NOTES.md: "JAX passes a bool mask as it is").
        arrays = dict(query=query, key=key, value=value, bias=bias, attention_mask=attention_mask,
                      q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      softmax_aux=softmax_aux, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                      dropout_seed=_seed_array(dropout_prob, dropout_seed))
        arrays.update(zip(("q_positions", "kv_positions"), _positions(q_positions, kv_positions, shapes)))
        info = None
        if sparse is not None:  # a dualattn.SparseMask, validated by the block-sparse front end
            arrays.update(_sparse_arrays(sparse))
            info = sparse_info(sparse)
        static = _Static(shapes, options, _triton_config(shapes, options, query), int(diag_shift), info,
                         **_descriptor_flags(query), deterministic=deterministic,
                         same_tables=same_tables)
        out, lse = _flash_triton(static, arrays)
        if shapes.varlen and return_lse and not shapes.queries_covered:
            # Rows in no sequence are written by no program; out was zero-filled, lse is masked here
            # (jax-triton can only zero-fill: plan._forward_outputs).
            inside = varlen_tokens(cu_seqlens_q, shapes.total_q, shapes.seqlen_q)[2]
            lse = jnp.where(inside[None, :], lse, -jnp.inf)
        return (out, lse) if return_lse else out
    if diag_shift:
        raise ValueError(f"diag_shift is only supported by the triton backend, not {backend!r}")
    common = dict(options=options, bias=bias, attention_mask=attention_mask, q_segment_ids=q_segment_ids,
                  kv_segment_ids=kv_segment_ids, softmax_aux=softmax_aux, return_lse=return_lse)
    if backend == "pallas" and 0 in (shapes.batch, shapes.seqlen_q, shapes.seqlen_k):
        backend = "xla"   # nothing to compute (an empty output, or every row fully masked): no TPU grid
    if backend == "xla":
        from . import xla
        extra = dict(xla_options or {})
        if cu_seqlens_q is not None:
            for name in ("bias", "attention_mask", "q_segment_ids", "kv_segment_ids"):
                common.pop(name)
            return xla.flash_attention_varlen_xla(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                  max_seqlen_k, dropout_seed=dropout_seed, **common, **extra)
        return xla.flash_attention_xla(query, key, value, dropout_seed=dropout_seed, **common, **extra)
    from . import pallas
    if cu_seqlens_q is not None:
        raise ValueError("varlen (cu_seqlens) is not supported by the pallas backend; use backend='triton' or 'xla'")
    pallas.check_pallas_supported(options)
    return pallas.flash_attention_pallas(query, key, value, dropout_seed=dropout_seed, **common)


def flash_attention(query, key, value, *, softmax_scale: Optional[float] = None, causal: bool = False,
                    sliding_window=None, logits_soft_cap: Optional[float] = None, softmax_aux=None,
                    q_segment_ids=None, kv_segment_ids=None, attention_mask=None, bias=None,
                    dropout_prob: float = 0.0, dropout_seed=None, return_lse: bool = False,
                    backend: str = "auto", xla_options: Optional[dict] = None, deterministic: bool = False):
    """Flash attention over BSHD jax arrays; same arguments and meaning as the torch front end.

    Args:
        query: (B, Sq, Hq, D); key: (B, Sk, Hkv, D); value: (B, Sk, Hkv, Dv). fp16/bf16/fp32, Hq % Hkv == 0.
        causal: bottom-right aligned (query i sees key j iff j <= i + Sk - Sq), as flash-attn >= 2.1.
        sliding_window: int w or (left, right) around the same diagonal.
        logits_soft_cap, softmax_aux (sinks), q/kv_segment_ids, attention_mask, bias: see SPEC.md.
        dropout_prob, dropout_seed: the seed (int or traced integer scalar) is required with dropout;
            with the same seed the torch and jax launches of the Triton kernel drop the same entries.
        return_lse: also return the float32 log-sum-exp (B, Hq, Sq).
        backend: "triton" | "xla" | "pallas" | "auto" (triton on GPU, pallas on TPU, xla on CPU; xla on a
            GPU without jax-triton, the `jax-gpu` extra, which backend="triton" needs there).
        xla_options: extra keywords for the xla backend (block_q, block_k, precision, logits_dtype).
        deterministic: bitwise reproducible gradients.  The triton backend's one-pass Hopper backward
            adds dQ tiles with atomics; deterministic=True takes the two-pass kernels.  The xla and
            pallas backends are deterministic already.

    Returns:
        out (B, Sq, Hq, Dv) in query's dtype, or (out, lse). Fully masked rows give 0 (lse -inf).
    """
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=q_segment_ids,
                 kv_segment_ids=kv_segment_ids, attention_mask=attention_mask, bias=bias,
                 dropout_prob=dropout_prob, dropout_seed=dropout_seed, return_lse=return_lse, backend=backend,
                 xla_options=xla_options, deterministic=deterministic)


def flash_attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, *,
                           softmax_scale: Optional[float] = None, causal: bool = False, sliding_window=None,
                           logits_soft_cap: Optional[float] = None, softmax_aux=None, dropout_prob: float = 0.0,
                           dropout_seed=None, return_lse: bool = False, backend: str = "auto",
                           xla_options: Optional[dict] = None, deterministic: bool = False):
    """Packed variable-length attention: (total, H, D) arrays, int32 cu_seqlens (n_seqs + 1,).

    Returns out (total_q, Hq, Dv) [and lse (Hq, total_q)].  max_seqlen_* must be static ints.
    deterministic: as flash_attention's.

    Concrete tables are checked on the host (ValueError).  Traced ones (under jit) cannot be, and run
    as follows, on each side with its own total and max_seqlen: c = clip(cummax(cu), 0, total)
    (non-decreasing, clipped to the packed tokens), and sequence b is the tokens
    [c[b], c[b] + min(c[b+1] - c[b], max_seqlen)): the first max_seqlen tokens of the clipped
    sequence.  Query sequence b attends key sequence b under the usual rules (causal aligned at
    their clipped ends).  Tokens in no sequence (before c[0], from c[-1], or past max_seqlen in a
    longer sequence) give output 0, lse -inf and zero gradients; no kernel reads or writes outside
    the packed arrays, whatever the table holds.
    """
    return _call(query, key, value, softmax_scale=softmax_scale, causal=causal, sliding_window=sliding_window,
                 logits_soft_cap=logits_soft_cap, softmax_aux=softmax_aux, q_segment_ids=None, kv_segment_ids=None,
                 attention_mask=None, bias=None, dropout_prob=dropout_prob, dropout_seed=dropout_seed,
                 return_lse=return_lse, backend=backend, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, xla_options=xla_options,
                 deterministic=deterministic)
