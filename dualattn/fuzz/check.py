"""Run one valid configuration in every front end it draws and compare with the float64 reference.

Checked: out and lse (forward), the gradients of query, key, value, bias and softmax_aux (backward,
with a random cotangent of out and, when drawn, of lse), fully masked rows exactly 0, dropout
determinism (same seed, same output), and torch against jax's Triton launch.  A problem is an
AssertionError whose message names the check; any other exception is a failure too (run.py).
"""
from __future__ import annotations

import functools
import math
import time
from typing import Optional

import numpy as np
import torch

from ..testing.reference import dropout_keep_reference, reference_attention, reference_varlen, relative_error
from .inputs import Inputs, cu_seqlens

GRAD_LEAVES = ("query", "key", "value", "bias", "softmax_aux")

# ||kernel - reference|| / ||reference|| on the same rounded inputs (as tests/torch/test_flash.py; on a GPU
# fp32 dots run as 3xTF32, as tests/test_robustness.py allows; XLA and Pallas as tests/jax allow).
_TOL = {  # (out, grad, lse)
    ("cpu", "float32"): (1e-5, 2e-5, 1e-5), ("cpu", "float16"): (1e-2, 1e-2, 1e-5),
    ("cpu", "bfloat16"): (1e-2, 1e-2, 1e-5),
    ("cuda", "float32"): (1e-4, 2e-4, 1e-5), ("cuda", "float16"): (1e-2, 1e-2, 1e-5),
    ("cuda", "bfloat16"): (1e-2, 1e-2, 1e-5),
}
_JAX_XLA_TOL = {"float32": (1e-5, 2e-5, 1e-5), "float16": (2e-2, 3e-2, 1e-4), "bfloat16": (2e-2, 3e-2, 1e-4)}
_JAX_GPU_FP32_TOL = (2e-3, 5e-3, 1e-4)   # XLA's fp32 dots are TF32 on a GPU by default


def tolerances(device: str, dtype: str, backend: str = "triton"):
    if backend in ("xla", "pallas"):
        return _JAX_GPU_FP32_TOL if device == "cuda" and dtype == "float32" else _JAX_XLA_TOL[dtype]
    return _TOL[(device, dtype)]


def _close(name: str, actual, expected, tol: float, floor: float = 0.0) -> float:
    """Relative error of `actual`; it fails past `tol`, unless the absolute error is within `floor`
    (the rounding noise of a gradient that cancels to almost nothing: see gradient_floors)."""
    err = relative_error(actual, expected)
    if math.isfinite(err) and err > tol and floor > 0:
        norm = float(np.linalg.norm(np.asarray(_as_f64(expected))[np.isfinite(np.asarray(_as_f64(expected)))]))
        if err * norm <= tol * norm + floor:
            return err
    if not (math.isfinite(err) and err <= tol):
        raise AssertionError(f"{name}: relative error {err:.3e} > {tol:.1e}")
    return err


def _as_f64(x):
    return x.detach().double().cpu().numpy() if torch.is_tensor(x) else np.asarray(x, dtype=np.float64)


# Rounding unit of the arithmetic a gradient runs in (P and dS are rounded to the input dtype before
# their matmuls; fp32 dots on a GPU are 3xTF32).
_EPS = {"float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}


def gradient_floors(c: dict, x: Inputs, device: str, backend: str = "triton") -> dict:
    """The rounding noise of each gradient (and the underflow of out), in absolute terms.

    dS = P * (dP - delta) cancels when the softmax is nearly one-hot (a huge softmax_scale): the exact
    dq and dk are then almost 0 and any finite arithmetic leaves noise of about
    eps * scale * |dO| * max|v| * max|k| (the size of the terms that cancel), which no relative
    tolerance can accept.  A gradient passes when its error is within tol * |ref| + this floor; a
    wrong gradient is off by about |ref| and still fails."""
    eps = _EPS[c["dtype"]]
    if device == "cuda" and c["dtype"] == "float32":
        eps = 2.0 ** -10 if backend in ("xla", "pallas") else 2.0 ** -21   # TF32 / 3xTF32 dots
    scale = c["softmax_scale"] or c["D"] ** -0.5
    norm = lambda t: float(t.double().norm()) if t is not None and t.numel() else 0.0  # noqa: E731
    rows = lambda t: float(t.double().norm(dim=-1).max()) if t.numel() else 0.0  # noqa: E731
    dout, dlse = norm(x.dout), norm(x.dlse)
    vmax, kmax, qmax = rows(x.value), rows(x.key), rows(x.query)
    keep = 1.0 / (1.0 - c["dropout_prob"]) if c.get("dropout_prob") else 1.0
    ds = keep * dout * vmax + dlse   # the size of the dS terms that cancel
    # out: a row whose every probability lies below the smallest normal number of the output dtype
    # is 0 or subnormal noise there, however small the reference's value (a lone key far below a sink
    # gives ~1e-108): within tiny * max|v| per row.
    tiny = float(torch.finfo(getattr(torch, c["dtype"])).tiny)
    out_rows = x.dout.numel() // max(1, x.dout.shape[-1])
    return {"query": eps * scale * ds * kmax, "key": eps * scale * ds * qmax, "value": eps * keep * dout,
            "bias": eps * ds, "softmax_aux": eps * ds, "out": tiny * keep * vmax * math.sqrt(out_rows)}


# ----------------------------------------------------------------------------- options and the reference

def call_options(c: dict) -> dict:
    """The static keyword arguments every front end takes for this configuration."""
    opts = dict(causal=c["causal"], sliding_window=None if c["sliding_window"] is None else tuple(c["sliding_window"])
                if isinstance(c["sliding_window"], list) else c["sliding_window"],
                logits_soft_cap=c["logits_soft_cap"], softmax_scale=c["softmax_scale"])
    if c.get("dropout_prob"):
        opts.update(dropout_prob=c["dropout_prob"], dropout_seed=c["dropout_seed"])
    return opts


def reference(c: dict, x: Inputs, device: str = "cpu"):
    """float64 (out, lse, grads by leaf name) of the configuration (+inf sinks: the reference's rule),
    on the CPU.  `device` "cuda": computed on the GPU (float64 there is exact IEEE arithmetic too, and a
    GPU-sized configuration's float64 attention takes tens of seconds on one CPU core)."""
    on = (lambda t: t.to(device) if torch.is_tensor(t) else t) if device == "cuda" else (lambda t: t)
    opts = call_options(c)
    opts.pop("dropout_seed", None)
    leaves = {"query": x.query, "key": x.key, "value": x.value}
    leaves.update({n: x.tensors[n] for n in ("bias", "softmax_aux") if n in x.tensors})
    others = {n: t for n, t in x.tensors.items() if n not in leaves and not n.startswith("cu_seqlens")}
    varlen = c["kind"] == "varlen"
    hq = c["Hq"]
    keep = None
    if c.get("dropout_prob"):
        if varlen:
            keep = torch.from_numpy(dropout_keep_reference(c["dropout_seed"], len(c["lengths_q"]), hq,
                                                           c["max_seqlen_q"], c["max_seqlen_k"], c["dropout_prob"]))
        else:
            keep = torch.from_numpy(dropout_keep_reference(c["dropout_seed"], c["B"], hq, c["Sq"], c["Sk"],
                                                           c["dropout_prob"]))
    if x.reference_mask is not None:
        others["attention_mask"] = x.reference_mask

    def run(leaf_values):
        f = {n: t for n, t in leaf_values.items()}
        if varlen:
            cq, ck = cu_seqlens(c["lengths_q"]), cu_seqlens(c["lengths_k"])
            out, lse = _reference_varlen_full(f.pop("query"), f.pop("key"), f.pop("value"), cq, ck, c,
                                              dropout_keep=keep, **opts, **f)
        else:
            out, lse = reference_attention(f.pop("query"), f.pop("key"), f.pop("value"), dropout_keep=keep,
                                           **opts, **others, **f)
        return out, lse

    others = {n: on(t) for n, t in others.items()}
    keep = on(keep)
    f64 = {n: on(t.detach().to(torch.float64)).requires_grad_(True) for n, t in leaves.items()}
    with torch.no_grad():
        out, lse = run({n: t.detach() for n, t in f64.items()})
    gout, glse = run(f64)
    pairs = [(gout, on(x.dout.to(torch.float64)))]
    if x.dlse is not None:
        pairs.append((glse, on(x.dlse.to(torch.float64))))
    pairs = [(o, d) for o, d in pairs if o.requires_grad]   # an empty output depends on nothing
    names = list(f64)
    grads = [None] * len(names)
    if pairs:
        outs, cots = zip(*pairs)
        grads = torch.autograd.grad(outs, [f64[n] for n in names], cots, allow_unused=True)
    grads = {n: torch.zeros_like(f64[n]) if g is None else g for n, g in zip(names, grads)}
    return out.detach().cpu(), lse.detach().cpu(), {n: g.detach().cpu() for n, g in grads.items()}


def _reference_varlen_full(q, k, v, cq, ck, c, **opts):
    """reference_varlen over the whole packed tensors: rows past cu_seqlens_q[-1] are in no sequence
    (output 0, lse -inf)."""
    out, lse = reference_varlen(q, k, v, cq, ck, **opts)
    tail = c["tail_q"]
    if tail:
        out = torch.cat([out, out.new_zeros((tail,) + tuple(out.shape[1:]))], dim=0)
        lse = torch.cat([lse, lse.new_full((lse.shape[0], tail), float("-inf"))], dim=1)
    return out, lse


# ----------------------------------------------------------------------------- the front ends

def run_torch(c: dict, x: Inputs, device: str):
    """(out, lse or None, grads by leaf name) of torch's front end on `device`."""
    from .. import torch_api as dt
    opts = call_options(c)
    leaves = {"query": x.query, "key": x.key, "value": x.value,
              **{n: x.tensors[n] for n in ("bias", "softmax_aux") if n in x.tensors}}
    leaves = {n: t.detach().to(device).requires_grad_(True) for n, t in leaves.items()}
    others = {n: t.to(device) for n, t in x.tensors.items() if n not in leaves}
    q, k, v = leaves["query"], leaves["key"], leaves["value"]
    extra = {n: leaves[n] for n in ("bias", "softmax_aux") if n in leaves}

    def call():
        if c["kind"] == "varlen":
            return dt.flash_attn_varlen_func(q, k, v, others["cu_seqlens_q"], others["cu_seqlens_k"],
                                             c["max_seqlen_q"], c["max_seqlen_k"], return_lse=c["return_lse"],
                                             **opts, **extra)
        if c["kind"] == "blocksparse":
            return dt.blocksparse_attention(q, k, v, layout=x.layout, return_lse=c["return_lse"], **opts, **others,
                                            **extra)
        return dt.flash_attention(q, k, v, return_lse=c["return_lse"], **opts, **others, **extra)

    res = call()
    out, lse = res if c["return_lse"] else (res, None)
    if c.get("dropout_prob"):
        with torch.no_grad():
            again = call()
        again = again[0] if c["return_lse"] else again
        if not torch.equal(again, out):
            raise AssertionError("torch dropout: the same seed gave a different output")
    outs, cots = [out], [x.dout.to(device)]
    if x.dlse is not None:
        outs.append(lse)
        cots.append(x.dlse.to(device))
    names = list(leaves)
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], cots, allow_unused=True)
    for n, g in zip(names, grads):
        if g is not None and (g.shape != leaves[n].shape or g.dtype != leaves[n].dtype):
            raise AssertionError(f"torch d{n}: shape/dtype {tuple(g.shape)} {g.dtype}, want "
                                 f"{tuple(leaves[n].shape)} {leaves[n].dtype}")
    return (out.detach().cpu(), None if lse is None else lse.detach().cpu(),
            {n: torch.zeros_like(leaves[n]).cpu() if g is None else g.cpu() for n, g in zip(names, grads)})


def _to_jax(t: torch.Tensor):
    import jax.numpy as jnp
    if t.dtype == torch.bfloat16:
        return jnp.asarray(t.float().numpy(), dtype=jnp.bfloat16)
    return jnp.asarray(t.numpy())


def _jax_segment_ids(x: Inputs) -> dict:
    ids = [x.tensors.get("q_segment_ids"), x.tensors.get("kv_segment_ids")]
    if ids[0] is None:
        return {}
    import jax.numpy as jnp
    flat = np.concatenate([i.numpy().astype(np.int64).ravel() for i in ids if i is not None])
    _, ranks = np.unique(flat, return_inverse=True)
    q = ranks[:ids[0].numel()].reshape(ids[0].shape).astype(np.int32)
    out = {"q_segment_ids": jnp.asarray(q)}
    if ids[1] is not None:
        out["kv_segment_ids"] = jnp.asarray(ranks[ids[0].numel():].reshape(ids[1].shape).astype(np.int32))
    return out


def run_jax(c: dict, x: Inputs, backend: str):
    """(out, lse or None, grads by leaf name) of jax's front end with `backend`, as float32/64 numpy."""
    import jax
    import jax.numpy as jnp

    from .. import jax_api as dj
    opts = call_options(c)
    leaves = {"query": x.query, "key": x.key, "value": x.value,
              **{n: x.tensors[n] for n in ("bias", "softmax_aux") if n in x.tensors}}
    jleaves = {n: _to_jax(t) for n, t in leaves.items()}
    others = _jax_segment_ids(x)
    if "attention_mask" in x.tensors:
        m = x.tensors["attention_mask"]
        others["attention_mask"] = jnp.asarray((m.to(torch.int32) if m.dtype == torch.int64 else m).numpy())
    names = list(jleaves)

    def f(*vals):
        kw = dict(zip(names, vals))
        q, k, v = kw.pop("query"), kw.pop("key"), kw.pop("value")
        if c["kind"] == "varlen":
            res = dj.flash_attention_varlen(q, k, v, jnp.asarray(x.tensors["cu_seqlens_q"].numpy()),
                                            jnp.asarray(x.tensors["cu_seqlens_k"].numpy()), c["max_seqlen_q"],
                                            c["max_seqlen_k"], return_lse=True, backend=backend, **opts, **kw)
        elif c["kind"] == "blocksparse":
            res = dj.blocksparse_attention(q, k, v, layout=x.layout, return_lse=True, backend=backend, **opts,
                                           **others, **kw)
        else:
            res = dj.flash_attention(q, k, v, return_lse=True, backend=backend, **opts, **others, **kw)
        return res

    (out, lse), vjp = jax.vjp(f, *(jleaves[n] for n in names))
    dlse = jnp.zeros(lse.shape, jnp.float32) if x.dlse is None else jnp.asarray(x.dlse.numpy())
    grads = vjp((_to_jax(x.dout), dlse))
    as_np = lambda a: np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a)  # noqa: E731
    return as_np(out), as_np(lse), {n: as_np(g) for n, g in zip(names, grads)}


# ----------------------------------------------------------------------------- the checks

def _zero_rows(name: str, out, lse) -> None:
    """Rows the reference gives lse -inf (no key, no sink) must be exactly 0 (never NaN)."""
    lse = lse.detach().cpu() if torch.is_tensor(lse) else torch.from_numpy(np.array(lse))
    out = out.detach().float().cpu() if torch.is_tensor(out) else torch.from_numpy(np.array(out, dtype=np.float32))
    dead = torch.isneginf(lse)
    if not dead.any():
        return
    # lse (B, H, S) or (H, total); out (B, S, H, D) or (total, H, D)
    rows = dead.permute(0, 2, 1) if dead.dim() == 3 else dead.transpose(0, 1)
    if out[rows].abs().sum() != 0 or torch.isnan(out[rows]).any():
        raise AssertionError(f"{name}: fully masked rows are not 0")


def compare(name: str, got, want, tols, c: dict, x: Inputs, floors: dict) -> dict:
    """Errors by quantity; AssertionError on the first one past its tolerance."""
    tol_out, tol_grad, tol_lse = tols
    out, lse, grads = got
    r_out, r_lse, r_grads = want
    errs = {"out": _close(f"{name} out", out, r_out, tol_out, floors["out"])}
    if lse is not None:
        errs["lse"] = _close(f"{name} lse", lse, r_lse, tol_lse)
    _zero_rows(name, out, r_lse)
    for n, g in grads.items():
        errs["d" + n] = _close(f"{name} d{n}", g, r_grads[n], tol_grad, floors[n])
    return errs


def logit_noise(c: dict, x: Inputs, device: str, backend: str = "triton") -> float:
    """Relative error of the probabilities that fp32 scores carry: a score s = scale * q.k is off by
    about eps * scale * |q| |k|, so P (and out, dV, dQ, dK) by that much relative.  Negligible at
    usual scales (< 1e-6), it dominates with a huge softmax_scale, where it is added to the tolerances."""
    eps = 2.0 ** -24 if device == "cpu" else (2.0 ** -11 if backend in ("xla", "pallas") else 2.0 ** -21)
    scale = c["softmax_scale"] or c["D"] ** -0.5
    rows = lambda t: float(t.double().norm(dim=-1).max()) if t.numel() else 0.0  # noqa: E731
    noise = 4.0 * eps * scale * rows(x.query) * rows(x.key)
    if device == "cuda" and backend == "triton" and c["logits_soft_cap"] and c["dtype"] != "float32":
        # 16-bit soft caps on a GPU run the hardware tanh.approx (error about 2^-11 of the cap)
        noise += 2.0 ** -10 * c["logits_soft_cap"]
    return noise


def _loosened(tols, noise: float):
    return tuple(t + noise for t in tols)


@functools.lru_cache(maxsize=None)
def available_jax_backends(device: str) -> tuple:
    """The jax backends that can run beside torch on `device`: none without jax; with --device cuda,
    the Triton one only where jax itself runs on the GPU with jax-triton installed."""
    try:
        import jax
    except ImportError:
        return ()
    if device == "cpu" or jax.default_backend() != "gpu":
        return ("triton", "xla", "pallas") if jax.default_backend() == "cpu" else ("xla",)
    from ..jax_api import _launch   # imports jax-triton the way the front end does (TRITON_CACHE_DIR kept)
    return ("triton", "xla") if _launch.jax_triton_available() else ("xla",)


def check_valid(c: dict, x: Inputs, device: str, seconds: Optional[dict] = None) -> dict:
    """Run and check one valid configuration; returns the relative errors by front end and quantity.
    `seconds` (if given) receives the time of each stage: reference, torch, jax-<backend>."""
    seconds = {} if seconds is None else seconds
    clock = time.perf_counter()

    def lap(stage):
        nonlocal clock
        now = time.perf_counter()
        seconds[stage] = round(now - clock, 3)
        clock = now

    want = reference(c, x, device)
    floors = gradient_floors(c, x, device)
    lap("reference")
    errors = {}
    got_torch = run_torch(c, x, device)
    lap("torch")
    errors["torch"] = compare("torch", got_torch, want,
                              _loosened(tolerances(device, c["dtype"]), logit_noise(c, x, device)), c, x, floors)
    for backend in c["jax"]:
        if backend not in available_jax_backends(device):
            errors[f"jax-{backend}"] = "not available"
            continue
        got = run_jax(c, x, backend)
        lap(f"jax-{backend}")
        tols = _loosened(tolerances(device, c["dtype"], backend), logit_noise(c, x, device, backend))
        lse = got[1] if c["return_lse"] else None
        errors[f"jax-{backend}"] = compare(f"jax {backend}", (got[0], lse, got[2]), want, tols, c, x,
                                           gradient_floors(c, x, device, backend))
        if backend == "triton":   # the same kernels from both frameworks
            errors["torch-vs-jax"] = _close("torch vs jax triton out", got_torch[0], got[0], tols[0])
    return errors
