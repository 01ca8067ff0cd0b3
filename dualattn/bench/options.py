"""Every flash option against the same shape without it, and against the best peer that expresses it.

    python -m dualattn.bench --cases options --quick --markdown --plot options.png  # every case on the GPU
    python -m dualattn.bench --cases softcap_causal,docs_varlen --jax --out run.json
    python -m dualattn.bench --cases softcap_causal --device cpu   # dry run: tiny shapes, interpreter
    python -m dualattn.bench --cases options --from-json run.json --plot run.png   # a run's table and plot again

One process, bf16, random-normal BSHD inputs. Each case runs dualattn torch (and with --jax the jitted
jax Triton path) and the peers that can express its option: torch SDPA (cuDNN, flash, efficient
backends), FlexAttention (torch.compile'd once per case: soft cap as a score_mod, causal / window /
documents as a block mask, sinks by rescaling the output with the returned lse), the same mask through
another dualattn entry point. Times are `dualattn.bench.flash.throughput_ms` (n back-to-back calls, one
wait, median of rounds), fwd and fwd+bwd (gradients of q, k, v).

Effective TFLOP/s count allowed (q, k) pairs only, counted exactly from each case's mask:
fwd 4*D*pairs, fwd+bwd 3.5x that. `ratio_to_base` = TFLOP/s / TFLOP/s of the same system on the
option-free case of the same shape and causality (the measure of issue #31's targets);
`ratio_to_peer` = dualattn / the fastest correct peer. Before timing, every system's forward is
compared with an fp32 reference (batch 0, first and last head, full rows); err >= --tol marks it
"wrong" (still timed); a system that cannot be built or run is recorded with its error, one whose
requirement is absent (no CUDA, a jax-only limit) as "unavailable".

--device cpu shrinks every case (B=1, S=64, H=2, D<=32, window 16, 8 documents of 8, blocks of 16),
runs dualattn through Triton's interpreter, times one call per mode and records the CUDA peers as
unavailable: it checks the script, not speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Dict, List, Optional

from . import report
from .flash import kernel_times, throughput_ms, versions
from .systems import FRONT_ENDS, import_jax, keep_env, make_inputs, rel_error

MODES = ("fwd", "fwdbwd")
SOFT_CAP, DROPOUT, DROPOUT_SEED, MASK_KEEP = 50.0, 0.1, 1234, 0.9


@dataclass(frozen=True)
class Case:
    """One shape and one set of options; `entry` is the dualattn function that takes them."""
    name: str
    B: int
    S: int
    H: int
    D: int
    causal: bool
    entry: str = "flash"  # flash | varlen | blocksparse
    soft_cap: Optional[float] = None
    sinks: bool = False
    window: Optional[int] = None  # left side; right side 0
    documents: int = 0  # equal documents packed into S, as segment ids (or cu_seqlens for varlen)
    dropout: float = 0.0
    bias: bool = False
    mask: bool = False  # random boolean attention_mask, MASK_KEEP of the pairs allowed
    block: int = 128  # block-sparse layout blocks

    @property
    def options(self) -> str:
        names = [self.entry if name == "entry" else name for name in OPTION_FIELDS
                 if getattr(self, name) != Case.__dataclass_fields__[name].default]
        return "+".join(names) or "none"

    def base(self) -> "Case":
        """The option-free case of the same shape and causality (one of CASES where there is one)."""
        plain = Case("", self.B, self.S, self.H, self.D, self.causal)
        return next((c for c in CASES if dataclasses.replace(c, name="") == plain), dataclasses.replace(
            plain, name=f"plain{'_causal' * self.causal}_b{self.B}_s{self.S}_h{self.H}_d{self.D}"))


OPTION_FIELDS = ("entry", "soft_cap", "sinks", "window", "documents", "dropout", "bias", "mask")


def _cases() -> List[Case]:
    cases = []
    for D, H in ((128, 16), (64, 32)):
        d = "" if D == 128 else f"_d{D}"
        for causal in (True, False):
            c = "_causal" if causal else ""
            cases += [Case(f"plain{c}{d}", 2, 8192, H, D, causal),
                      Case(f"softcap{c}{d}", 2, 8192, H, D, causal, soft_cap=SOFT_CAP)]
            if D == 128:
                cases.append(Case(f"sinks{c}", 2, 8192, H, D, causal, sinks=True))
        cases += [Case(f"docs{d}", 1, 16384, H, D, True, documents=8),
                  Case(f"docs_varlen{d}", 1, 16384, H, D, True, entry="varlen", documents=8)]
    cases += [Case("window_causal", 2, 8192, 16, 128, True, window=1024),
              Case("window_causal_d64", 2, 8192, 32, 64, True, window=1024),
              # GPT-OSS's sliding layers: a 128-token window with a sink per head
              Case("window_sinks_d64", 2, 8192, 32, 64, True, sinks=True, window=128),
              Case("plain_d256", 2, 4096, 8, 256, False),
              Case("plain_causal_d256", 2, 4096, 8, 256, True),
              # Gemma's heads: Gemma 2's soft cap, Gemma 3's 1024-token local windows
              Case("softcap_causal_d256", 2, 4096, 8, 256, True, soft_cap=SOFT_CAP),
              Case("window_causal_d256", 2, 8192, 8, 256, True, window=1024),
              Case("plain_d192", 2, 4096, 8, 192, False),
              Case("plain_causal_d192", 2, 4096, 8, 192, True),
              Case("plain_d96", 2, 4096, 16, 96, False),
              Case("plain_causal_d96", 2, 4096, 16, 96, True),
              Case("dropout", 2, 4096, 16, 128, False, dropout=DROPOUT),
              Case("dropout_causal", 2, 4096, 16, 128, True, dropout=DROPOUT),
              Case("dropout_d64", 2, 4096, 32, 64, False, dropout=DROPOUT),
              Case("bias", 2, 4096, 16, 128, False, bias=True),
              Case("mask", 2, 4096, 16, 128, False, mask=True),
              Case("bias_causal", 2, 4096, 16, 128, True, bias=True),
              Case("mask_causal", 2, 4096, 16, 128, True, mask=True),
              Case("bias_d64", 2, 4096, 32, 64, False, bias=True),
              Case("mask_d64", 2, 4096, 32, 64, False, mask=True),
              Case("mask_causal_d256", 2, 4096, 8, 256, True, mask=True),
              Case("bias_d256", 2, 4096, 8, 256, False, bias=True),
              Case("bias_causal_d192", 2, 4096, 8, 192, True, bias=True),
              Case("mask_d96", 2, 4096, 16, 96, False, mask=True),
              Case("blocksparse_window", 1, 16384, 16, 128, True, entry="blocksparse", window=1024)]
    return cases


CASES = _cases()


def shrink(case: Case) -> Case:
    """The CPU dry-run version of a case: interpreter-sized, same options."""
    return dataclasses.replace(case, B=1, S=64, H=2, D=min(case.D, 32), block=16,
                               window=16 if case.window else None)


# ---------------------------------------------------------------------------------------------
# Per-case tensors, the allowed-pair mask and the fp32 reference


@dataclass
class Problem:
    case: Case
    inputs: object  # dualattn.bench.systems.Inputs
    segments: Optional[object] = None  # (S,) int32 document id of each token
    sinks: Optional[object] = None  # (H,) fp32
    bias: Optional[object] = None  # (B, H, S, S) bf16
    mask: Optional[object] = None  # (B, H, S, S) bool
    layout: Optional[object] = None  # dualattn.SparseMask

    def allowed(self, b: int, h: int, r0: int, r1: int):
        """bool (r1 - r0, S): may query row i attend key j (batch b, head h)."""
        import torch
        c, dev = self.case, self.inputs.q.device
        i, j = torch.arange(r0, r1, device=dev)[:, None], torch.arange(c.S, device=dev)[None, :]
        ok = torch.ones(r1 - r0, c.S, dtype=torch.bool, device=dev)
        if c.causal:
            ok &= j <= i
        if c.window is not None:  # sliding_window=(window, 0)
            ok &= (i - j <= c.window) & (j <= i)
        if self.segments is not None:
            ok &= self.segments[r0:r1, None] == self.segments[None, :]
        if self.mask is not None:
            ok &= self.mask[b, h, r0:r1]
        return ok

    def pairs(self, rows: int = 1024) -> int:
        c = self.case
        heads = [(b, h) for b in range(c.B) for h in range(c.H)] if self.mask is not None else [(0, 0)]
        n = sum(int(self.allowed(b, h, r, min(r + rows, c.S)).sum()) for b, h in heads for r in range(0, c.S, rows))
        return n if self.mask is not None else n * c.B * c.H

    def flash_kwargs(self) -> dict:
        """flash_attention keywords of the case's options (the segment ids as (B, S) int32)."""
        c = self.case
        kw = dict(causal=c.causal, logits_soft_cap=c.soft_cap, softmax_aux=self.sinks, bias=self.bias,
                  attention_mask=self.mask, sliding_window=(c.window, 0) if c.window is not None else None)
        if self.segments is not None:
            kw["q_segment_ids"] = kw["kv_segment_ids"] = self.segments[None].expand(c.B, c.S).contiguous()
        if c.dropout:
            kw.update(dropout_prob=c.dropout, dropout_seed=DROPOUT_SEED)
        return {k: v for k, v in kw.items() if v is not None}

    def reference_heads(self, rows: int = 1024):
        """fp32 output of batch 0 at heads (0, H-1): {head: (S, D)}."""
        import torch
        from dualattn.torch_api import dropout_keep_mask
        c, (q, k, v) = self.case, (t[0].float() for t in (self.inputs.q, self.inputs.k, self.inputs.v))
        refs = {}
        for h in sorted({0, c.H - 1}):
            keep = dropout_keep_mask(DROPOUT_SEED, 1, h + 1, c.S, c.S, c.dropout, q.device)[0, h] if c.dropout else None
            out = torch.empty(c.S, c.D, device=q.device)
            for r0 in range(0, c.S, rows):
                r1 = min(r0 + rows, c.S)
                s = q[r0:r1, h] @ k[:, h].T * c.D ** -0.5
                if self.bias is not None:
                    s = s + self.bias[0, h, r0:r1].float()
                if c.soft_cap:
                    s = c.soft_cap * torch.tanh(s / c.soft_cap)
                s = s.masked_fill(~self.allowed(0, h, r0, r1), -math.inf)
                top = s.amax(-1, keepdim=True)
                if self.sinks is not None:
                    top = torch.maximum(top, self.sinks[h])
                top = torch.where(torch.isfinite(top), top, 0.0)
                p = torch.exp(s - top)
                den = p.sum(-1, keepdim=True) + (torch.exp(self.sinks[h] - top) if self.sinks is not None else 0)
                p = p / den.clamp_min(1e-30)
                if keep is not None:
                    p = p * keep[r0:r1] / (1 - c.dropout)
                out[r0:r1] = p @ v[:, h]
            refs[h] = out
        return refs


def make_problem(case: Case, seed: int, device: str) -> Problem:
    import torch
    from dualattn import SparseMask, masks
    inputs = make_inputs(report.Shape(case.B, case.S, case.H, case.D), "bf16", seed, device)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    p = Problem(case, inputs)
    if case.documents:
        p.segments = torch.arange(case.S, device=device, dtype=torch.int32) // (case.S // case.documents)
    if case.sinks:
        p.sinks = torch.randn(case.H, generator=gen, device=device, dtype=torch.float32)
    dense = (case.B, case.H, case.S, case.S)
    if case.bias:
        p.bias = torch.randn(dense, generator=gen, device=device, dtype=torch.bfloat16)
    if case.mask:
        p.mask = torch.rand(dense, generator=gen, device=device) < MASK_KEEP
    if case.entry == "blocksparse":
        builder = masks.causal() & masks.local((case.window, 0))
        p.layout = SparseMask.from_block_map(builder(1, 1, case.S, case.S, case.block, case.block),
                                             case.block, case.block)
    return p


# ---------------------------------------------------------------------------------------------
# Systems: key -> (front end, attn(q, k, v) BSHD -> BSHD), or a string saying why unavailable


def _bhsd(t):
    return t.transpose(1, 2)


def dualattn_torch(p: Problem) -> Callable:
    from dualattn import torch_api as dt
    c, kw = p.case, p.flash_kwargs()
    if c.entry == "varlen":
        import torch
        cu = torch.arange(0, c.B * c.S + 1, c.S // c.documents, dtype=torch.int32, device=p.inputs.q.device)

        def attn(q, k, v):
            packed = (t.reshape(c.B * c.S, c.H, c.D) for t in (q, k, v))
            return dt.flash_attn_varlen_func(*packed, cu, cu, c.S // c.documents, c.S // c.documents, causal=c.causal,
                                             logits_soft_cap=c.soft_cap, softmax_aux=p.sinks).view(c.B, c.S, c.H, c.D)
        return attn
    if c.entry == "blocksparse":
        return lambda q, k, v: dt.blocksparse_attention(q, k, v, layout=p.layout, **kw)
    return lambda q, k, v: dt.flash_attention(q, k, v, **kw)


def dualattn_jax(p: Problem):
    c = p.case
    jax = import_jax()
    from dualattn import jax_api
    kw = {k: (jax.dlpack.from_dlpack(v) if hasattr(v, "__dlpack__") else v) for k, v in p.flash_kwargs().items()}
    if c.bias or c.mask:
        # The S x S tensors are arguments of the jitted step (JaxFrontEnd: array_kwargs), not constants
        # of its closure; nothing differentiates them, as with the torch path's bias.
        arrays = {name: kw.pop(name) for name in ("bias", "attention_mask") if name in kw}

        def attn(q, k, v, **given):
            return jax_api.flash_attention(q, k, v, backend="triton", **kw, **given)
        attn.array_kwargs = arrays
        return attn
    if c.entry == "varlen":
        cu = jax.numpy.arange(0, c.B * c.S + 1, c.S // c.documents, dtype=jax.numpy.int32)
        n = c.S // c.documents

        def attn(q, k, v):
            packed = (t.reshape(c.B * c.S, c.H, c.D) for t in (q, k, v))
            return jax_api.flash_attention_varlen(*packed, cu, cu, n, n, causal=c.causal, logits_soft_cap=c.soft_cap,
                                                  softmax_aux=kw.get("softmax_aux"),
                                                  backend="triton").reshape(c.B, c.S, c.H, c.D)
        return attn
    if c.entry == "blocksparse":
        return lambda q, k, v: jax_api.blocksparse_attention(q, k, v, layout=p.layout, **kw)
    return lambda q, k, v: jax_api.flash_attention(q, k, v, backend="triton", **kw)


def sdpa(backend: str, p: Problem, attn_mask=None) -> Callable:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    chosen, c = getattr(SDPBackend, backend), p.case

    def attn(q, k, v):
        with sdpa_kernel(chosen):
            return _bhsd(F.scaled_dot_product_attention(_bhsd(q), _bhsd(k), _bhsd(v), attn_mask=attn_mask,
                                                        dropout_p=c.dropout, is_causal=c.causal))
    return attn


def flex(p: Problem) -> Callable:
    """FlexAttention with the case's mask as a block mask, soft cap as a score_mod, sinks through the lse."""
    import torch
    from torch.nn.attention import flex_attention as fa
    from .systems import _compiled_flex
    c, seg, run = p.case, p.segments, _compiled_flex()
    mods = ([lambda b, h, qi, ki: ki <= qi] if c.causal else []) + \
        ([lambda b, h, qi, ki: qi - ki <= c.window] if c.window is not None else []) + \
        ([lambda b, h, qi, ki: seg[qi] == seg[ki]] if seg is not None else [])
    block_mask = fa.create_block_mask(fa.and_masks(*mods), None, None, c.S, c.S, device="cuda",
                                      BLOCK_SIZE=c.block) if mods else None
    score_mod = (lambda s, b, h, qi, ki: c.soft_cap * torch.tanh(s / c.soft_cap)) if c.soft_cap else None
    if p.sinks is None:
        return lambda q, k, v: _bhsd(run(_bhsd(q), _bhsd(k), _bhsd(v), score_mod=score_mod, block_mask=block_mask))
    sinks = p.sinks[None, :, None]

    def attn(q, k, v):  # softmax over keys + sink = softmax over keys * sigmoid(lse - sink)
        out, aux = run(_bhsd(q), _bhsd(k), _bhsd(v), score_mod=score_mod, block_mask=block_mask,
                       return_aux=fa.AuxRequest(lse=True))
        return _bhsd(out * torch.sigmoid(aux.lse - sinks)[..., None].to(out.dtype))
    return attn


def systems_for(p: Problem, with_jax: bool) -> Dict[str, tuple]:
    """{key: (front end, builder () -> attn, or reason unavailable)} for the case: dualattn first, then peers."""
    c, cuda = p.case, p.inputs.q.device.type == "cuda"
    found = {"dualattn-torch": ("torch", lambda: dualattn_torch(p))}
    if with_jax:
        found["dualattn-jax-triton"] = ("jax", lambda: dualattn_jax(p))
    if c.entry == "blocksparse":
        found["dualattn-torch-window"] = ("torch", lambda: dualattn_torch(dataclasses.replace(
            p, case=dataclasses.replace(c, entry="flash"), layout=None)))
    peers: Dict[str, Callable] = {}
    masked = c.bias or c.mask
    if c.options == "none" or c.dropout:
        peers.update({f"sdpa-{n.split('_')[0].lower()}": (lambda n=n: sdpa(n, p)) for n in
                      ("CUDNN_ATTENTION", "FLASH_ATTENTION") + ("EFFICIENT_ATTENTION",) * bool(c.dropout)})
    elif masked and not c.causal:
        peers.update({f"sdpa-{n.split('_')[0].lower()}": (lambda n=n: sdpa(n, p, p.bias if c.bias else p.mask))
                      for n in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION")})
    elif not masked:
        peers["flex"] = lambda: flex(p)
    for key, build in peers.items():
        found[key] = ("torch", build if cuda else (lambda: "unavailable: needs CUDA"))
    return found


# ---------------------------------------------------------------------------------------------
# Measuring


def one_call_ms(step) -> float:
    """The dry run's timer: one call (the interpreter's time says nothing about a GPU)."""
    t0 = time.perf_counter()
    step()
    return (time.perf_counter() - t0) * 1e3


def measure(p: Problem, key: str, front_end: str, build: Callable, refs: dict, pairs: int, timer: Callable,
            tol: float, kernels: bool = False) -> List[dict]:
    """Rows (one per mode) of one system on one case. Never raises: failures become the rows' notes.
    `kernels`: dualattn's rows also get the kernels' own time per call (torch.profiler: kernel_ms)."""
    c = p.case
    base = dict(case=c.name, options=c.options, system=key, B=c.B, S=c.S, H=c.H, D=c.D, causal=c.causal,
                pairs=pairs, density=pairs / (c.B * c.H * c.S * c.S), status="ok", ms=None, tflops=None,
                ratio_to_base=None, ratio_to_peer=None, kernel_ms=None, kernel_tflops=None,
                kernel_ratio_to_base=None, err=None, note=None)
    front = FRONT_ENDS[front_end]
    with keep_env("TRITON_CACHE_DIR"):
        try:
            attn = build()
            if isinstance(attn, str):
                return [dict(base, mode=m, status="unavailable", note=attn) for m in MODES]
            fwd = front.make_step(attn, p.inputs, "fwd")
            out = front.to_torch(fwd())
            if c.dropout and not key.startswith("dualattn"):
                base["note"] = "not checked: its own dropout draws"
            else:
                base["err"] = max(rel_error(out[0, :, h], ref) for h, ref in refs.items())
                if not base["err"] < tol:
                    base.update(status="wrong", note=f"wrong: err={base['err']:.2e}")
        except Exception as e:
            return [dict(base, mode=m, status="error", note=f"error: {report.describe_error(e)}") for m in MODES]
        rows = []
        for mode in MODES:
            row = dict(base, mode=mode)
            try:
                step = fwd if mode == "fwd" else front.make_step(attn, p.inputs, mode)
                flops = 4 * c.D * pairs * (3.5 if mode == "fwdbwd" else 1)
                ms = timer(step)
                row.update(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
                if kernels and key.startswith("dualattn"):   # the GPU's own time: what the host adds is the rest
                    kernel_ms = sum(kernel_times(step, calls=5).values())
                    row.update(kernel_ms=kernel_ms, kernel_tflops=flops / (kernel_ms * 1e-3) / 1e12)
            except Exception as e:
                row.update(status="error", note=f"error: {report.describe_error(e)}")
            rows.append(row)
        return rows


def run_case(case: Case, args, timer: Callable) -> List[dict]:
    p = make_problem(case, args.seed, args.device)
    refs, pairs = p.reference_heads(), p.pairs()
    rows = []
    for key, (front_end, build) in systems_for(p, args.jax).items():
        print(f"# {case.name}: {key}", file=sys.stderr, flush=True)
        rows += measure(p, key, front_end, build, refs, pairs, timer, args.tol, kernels=args.device == "cuda")
        if args.device == "cuda":  # gc.collect costs ~0.3 s with torch loaded: only where memory matters
            import torch
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def fill_ratios(rows: List[dict], bases: Dict[str, str]) -> None:
    """ratio_to_base (same system, option-free case of the same shape) and ratio_to_peer (fastest correct peer)."""
    tflops = {(r["case"], r["system"], r["mode"]): r["tflops"] for r in rows if r["status"] == "ok"}
    kernel = {(r["case"], r["system"], r["mode"]): r.get("kernel_tflops") for r in rows if r["status"] == "ok"}
    for r in rows:
        if r["tflops"] is None:
            continue
        own = tflops.get((bases[r["case"]], r["system"], r["mode"]))
        r["ratio_to_base"] = r["tflops"] / own if own else None
        own_kernel = kernel.get((bases[r["case"]], r["system"], r["mode"]))
        if r.get("kernel_tflops") and own_kernel:
            r["kernel_ratio_to_base"] = r["kernel_tflops"] / own_kernel
        peers = [t for (case, system, mode), t in tflops.items()
                 if case == r["case"] and mode == r["mode"] and not system.startswith("dualattn")]
        if r["system"].startswith("dualattn") and peers:
            r["ratio_to_peer"] = r["tflops"] / max(peers)


def markdown(rows: List[dict]) -> str:
    """One line per case as in issue #31: TFLOP/s fwd / fwd+bwd, ratios to the option-free case and the peer."""
    def pair(sel, field="tflops", fmt="{:.3g}"):
        vals = [next((r.get(field) for r in sel if r["mode"] == m), None) for m in MODES]
        return " / ".join("-" if v is None else fmt.format(v) for v in vals)

    lines = ["| case | options | dualattn | ÷ option-free | kernels ÷ option-free | best peer | dualattn ÷ peer | jax |",
             "|---|---|---|---|---|---|---|---|"]
    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        ours = [r for r in sel if r["system"] == "dualattn-torch"]
        peers = [r for r in sel if not r["system"].startswith("dualattn") and r["status"] == "ok"]
        best = max(peers, key=lambda r: r["tflops"] if r["mode"] == "fwdbwd" else 0, default=None)
        best_rows = [r for r in peers if best and r["system"] == best["system"]]
        notes = "; ".join(sorted({f"{r['system']}: {r['note']}" for r in sel if r["status"] in ("error", "wrong")}))
        jax = [r for r in sel if r["system"] == "dualattn-jax-triton"]
        lines.append(f"| {case} | {sel[0]['options']} | {pair(ours)} | {pair(ours, 'ratio_to_base', '{:.2f}x')} | "
                     f"{pair(ours, 'kernel_ratio_to_base', '{:.2f}x')} | "
                     + (f"{best['system']} {pair(best_rows)}" if best else "-")
                     + f" | {pair(ours, 'ratio_to_peer', '{:.2f}x')} | {pair(jax) if jax else ''} |"
                     + (f" {notes}" if notes else ""))
    return "\n".join(lines)


def plot(rows: List[dict], path: str, title: str = "") -> str:
    """Bars per case with an option: dualattn's ratio to the option-free case (issue #31's measure) and to
    the fastest peer, fwd and fwd+bwd. Returns a line that says what was written (or why nothing was)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"plot skipped: matplotlib is not importable ({e})"
    ours = [r for r in rows if r["system"] == "dualattn-torch" and r["options"] != "none" and r["tflops"]]
    cases = list(dict.fromkeys(r["case"] for r in ours))
    if not cases:
        return "plot skipped: no timed case with an option"
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.32 * len(cases) + 1.6), sharey=True)
    for ax, field, label in ((axes[0], "ratio_to_base", "÷ the same shape without the option"),
                             (axes[1], "ratio_to_peer", "÷ the fastest peer")):
        for k, mode in enumerate(MODES):
            vals = {r["case"]: r[field] for r in ours if r["mode"] == mode and r[field] is not None}
            ys = [i + (k - 0.5) * 0.4 for i, c in enumerate(cases) if c in vals]
            ax.barh(ys, [vals[c] for c in cases if c in vals], height=0.4,
                    label="fwd" if mode == "fwd" else "fwd+bwd")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xlabel(label)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(cases)), cases, fontsize=8)
    axes[0].invert_yaxis()
    axes[0].legend(loc="lower right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--cases", default="options",
                    help="'options' (or 'all': every case) or a comma list of: " + ",".join(c.name for c in CASES))
    ap.add_argument("--quick", action="store_true", help="shorter timing rounds (50 ms x 3 instead of 200 ms x 5)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--jax", action="store_true", help="also dualattn.jax_api (backend='triton', jit)")
    ap.add_argument("--tol", type=float, default=2e-2, help="relative-error bound of the correctness guard")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="JSON path (default benchmarks/results/<date>_<device>_options.json)")
    ap.add_argument("--markdown", action="store_true", help="print the results as a markdown table")
    ap.add_argument("--plot", help="write a PNG of the ratios to the option-free case and to the peer (matplotlib)")
    ap.add_argument("--from-json", help="no measuring: print the table of a results JSON (and --plot it)")
    args = ap.parse_args(argv)
    by_name = {c.name: c for c in CASES}
    every = args.cases in ("options", "all")
    names = list(by_name) if every else [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        ap.error(f"unknown case(s) {','.join(unknown)}; choose 'all' or from {','.join(by_name)}")
    pairs = [(by_name[n].base(), by_name[n]) for n in names]  # (option-free case, case)
    if args.device == "cpu":
        pairs = [(shrink(base), shrink(case)) for base, case in pairs]
    # the option-free cases run first, so every ratio_to_base finds its denominator
    args.run_cases = list(dict.fromkeys([base for base, _ in pairs] + [case for _, case in pairs]))
    args.bases = dict({base.name: base.name for base, _ in pairs}, **{case.name: base.name for base, case in pairs})
    return args


def device_slug(name: str) -> str:
    found = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name.lower())
    return found.group(1) if found else re.sub(r"\W+", "-", name.lower()).strip("-")


def main(argv=None) -> int:
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before anything imports jax
    args = parse_args(argv)
    if args.from_json:  # e.g. plot on a machine with matplotlib what a GPU machine measured
        import json
        with open(args.from_json) as f:
            doc = json.load(f)
        print(markdown(doc["rows"]))
        if args.plot:
            print(plot(doc["rows"], args.plot, doc["meta"]["device"]))
        return 0
    import torch
    import triton
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: torch.cuda.is_available() is False (use --device cpu for a dry run)")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    date = datetime.now(timezone.utc)
    results = "benchmarks/results" if os.path.isdir("benchmarks/results") else "."   # (the repository's root)
    out_path = args.out or os.path.join(results, f"{date:%Y-%m-%d}_{device_slug(device)}_options.json")
    if args.device == "cpu":
        timer = one_call_ms
    else:
        timer = (lambda step: throughput_ms(step, 50.0, 3)) if args.quick else (lambda step: throughput_ms(step))
    meta = dict(device=device, date=date.isoformat(timespec="seconds"), argv=list(sys.argv[1:] if argv is None
                else argv), versions=dict(versions(), torch=torch.__version__, triton=triton.__version__),
                settings=dict(dtype="bf16", quick=args.quick, tol=args.tol, seed=args.seed, soft_cap=SOFT_CAP,
                              dropout=DROPOUT, mask_keep=MASK_KEEP,
                              flops="4*D*allowed pairs (fwd), 3.5x fwd+bwd",
                              timing="one call" if args.device == "cpu" else "throughput_ms median"))
    meta["bases"] = bases = args.bases
    rows: List[dict] = []
    for case in args.run_cases:
        rows += run_case(case, args, timer)
        fill_ratios(rows, bases)
        write_json(out_path, meta, rows)  # after every case: a run cut short keeps what it measured
    if args.markdown:
        print(markdown(rows))
    if args.plot:
        print(plot(rows, args.plot, f"{device}, bf16, {date:%Y-%m-%d}"))
    print(f"results written to {out_path}")
    return 0


def write_json(path: str, meta: dict, rows: List[dict]) -> None:
    import json
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(meta=meta, rows=[report._finite(r) for r in rows]), f, indent=1, allow_nan=False)
        f.write("\n")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    raise SystemExit(main())
