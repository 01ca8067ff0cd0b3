"""Independent float64 references for the tests and the fuzz command (torch and numpy), not derived from the kernels.

Semantics follow docs/contract.md: scores s = (q . k) * scale, + bias, soft cap s = cap * tanh(s / cap), then
the mask (window / causal on positions, segments, attention_mask).  Sinks (softmax_aux) are extra
logits in each row's softmax denominator (not scaled, not capped, not masked) that add nothing to the
output.  Dropout multiplies the probabilities by keep / (1 - p); the lse is unaffected.  A row with no
allowed key yields output 0, lse -inf (with sinks: the sinks' logsumexp) and zero gradients, never NaN.
A +inf sink takes its head's rows whole: output 0, lse +inf; the +inf sinks of a head share each row
equally (d lse / d sink = 1 / their count), every other logit has probability 0.

    reference_attention(q, k, v, **opts)           dense BSHD -> (out (B,Sq,Hq,Dv), lse (B,Hq,Sq))
    reference_varlen(q, k, v, cu_q, cu_k, **opts)   packed     -> (out (total_q,Hq,Dv), lse (Hq,total_q))
    numpy_reference_with_grads(inputs, dout, **opts) numpy in / numpy out, with gradients (JAX tests)
    dropout_keep_reference(seed, B, H, Sq, Sk, p)  numpy uint32 twin of the documented dropout hash
"""
from __future__ import annotations

import numpy as np
import torch

from dualattn.options import canonical_window

__all__ = ["reference_attention", "reference_varlen", "numpy_reference_with_grads",
           "dropout_keep_reference", "relative_error", "assert_close_rel"]


def _f64(x):
    if x is None:
        return None
    if not torch.is_tensor(x):
        x = torch.as_tensor(np.asarray(x, dtype=np.float64))
    return x.to(torch.float64)


def _int(x):
    if x is None:
        return None
    if not torch.is_tensor(x):
        x = torch.as_tensor(np.asarray(x).astype(np.int64))
    return x.to(torch.int64)


def _sinks(softmax_aux, hq):
    """softmax_aux -> (1, Hq, 1, n) float64, or None."""
    if softmax_aux is None:
        return None
    s = _f64(softmax_aux)
    if s.dim() == 2:
        assert s.shape[0] == hq, s.shape
        return s[None, :, None, :]
    assert s.dim() == 1, s.shape
    if s.shape[0] == hq:                       # one sink per head
        return s[None, :, None, None]
    return s[None, None, None, :].expand(1, hq, 1, s.shape[0])   # n sinks shared by all heads


class _FiniteStandIn(torch.autograd.Function):
    """+inf entries replaced by a finite value in the forward; the gradient passes unchanged (the
    derivative of the limit in which those entries grow without bound)."""

    @staticmethod
    def forward(ctx, x, value):
        return torch.where(torch.isposinf(x), value, x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _saturating_sinks(sinks, scores):
    """Sinks with +inf entries stood in by a finite logit far above every finite score and sink, and
    the (1, Hq, 1, 1) heads they saturate (None when none).  Then exp(score - lse) underflows to
    exactly 0, the +inf sinks of a head share its rows equally (1 / their count each, also in the
    gradient), and adding +inf to the lse of those heads gives the contract's lse +inf."""
    posinf = torch.isposinf(sinks.detach())
    if not posinf.any():
        return sinks, None
    values = torch.cat([scores.detach().flatten(), sinks.detach().flatten()])
    top = values[torch.isfinite(values)].abs().max().item() if torch.isfinite(values).any() else 0.0
    return _FiniteStandIn.apply(sinks, 2.0 * top + 1e4), posinf.any(dim=-1, keepdim=True)


def reference_attention(q, k, v, *, softmax_scale=None, causal=False, sliding_window=None,
                        logits_soft_cap=None, softmax_aux=None, q_segment_ids=None, kv_segment_ids=None,
                        attention_mask=None, bias=None, dropout_prob=0.0, dropout_keep=None,
                        q_positions=None, kv_positions=None):
    """Dense BSHD float64 attention.

    q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) torch tensors (or numpy arrays); they are upcast to
    float64 keeping the autograd graph.  dropout_keep: bool (B,Hq,Sq,Sk) (e.g. from
    dropout_keep_reference), required when dropout_prob > 0.
    Returns (out (B,Sq,Hq,Dv) float64, lse (B,Hq,Sq) float64).
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    assert k.shape[0] == B and v.shape[:3] == k.shape[:3] and Hq % Hkv == 0
    group = Hq // Hkv
    dev = q.device
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)

    qh = q.permute(0, 2, 1, 3)                                      # [B, Hq, Sq, D]
    kh = k.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)      # [B, Hq, Sk, D]
    vh = v.repeat_interleave(group, dim=2).permute(0, 2, 1, 3)      # [B, Hq, Sk, Dv]
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale              # [B, Hq, Sq, Sk]
    if bias is not None:
        s = s + _f64(bias).to(dev)
    if logits_soft_cap is not None and float(logits_soft_cap) != 0.0:
        cap = float(logits_soft_cap)
        s = cap * torch.tanh(s / cap)

    # --- mask -------------------------------------------------------------------------------
    left, right = canonical_window(sliding_window, causal)
    if q_positions is None:
        qpos = (torch.arange(Sq, device=dev) + (Sk - Sq))[None, :].expand(B, Sq)
    else:
        qpos = _int(q_positions).to(dev).expand(B, Sq)
    if kv_positions is None:
        kpos = torch.arange(Sk, device=dev)[None, :].expand(B, Sk)
    else:
        kpos = _int(kv_positions).to(dev).expand(B, Sk)
    d = kpos[:, None, :] - qpos[:, :, None]                          # [B, Sq, Sk]
    allowed = torch.ones(B, Sq, Sk, dtype=torch.bool, device=dev)
    if left is not None:
        allowed &= d >= -left
    if right is not None:
        allowed &= d <= right
    if q_segment_ids is not None or kv_segment_ids is not None:
        qs = _int(q_segment_ids if q_segment_ids is not None else kv_segment_ids).to(dev)
        ks = _int(kv_segment_ids if kv_segment_ids is not None else q_segment_ids).to(dev)
        allowed &= qs[:, :, None] == ks[:, None, :]
    allowed = allowed[:, None].expand(B, Hq, Sq, Sk)
    if attention_mask is not None:
        m = attention_mask if torch.is_tensor(attention_mask) else torch.as_tensor(np.asarray(attention_mask))
        allowed = allowed & (m.to(dev) != 0).expand(B, Hq, Sq, Sk)

    # --- softmax with sinks, NaN-free for fully masked rows ---------------------------------------
    sinks = _sinks(softmax_aux, Hq)
    neg = torch.tensor(float("-inf"), dtype=torch.float64, device=dev)
    masked = torch.where(allowed, s, neg)
    saturated = None
    if sinks is not None:
        sinks, saturated = _saturating_sinks(sinks.to(dev), masked)
    row_max = (masked.amax(dim=-1, keepdim=True) if Sk else                       # [B, Hq, Sq, 1]
               masked.new_full(masked.shape[:-1] + (1,), float("-inf")))
    if sinks is not None:
        row_max = torch.maximum(row_max, sinks.detach().amax(dim=-1, keepdim=True))
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    s_safe = torch.where(allowed, s, row_max)                                   # no inf - inf
    p = torch.where(allowed, torch.exp(s_safe - row_max), torch.zeros_like(s))
    den = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        den = den + torch.exp(sinks - row_max).sum(dim=-1, keepdim=True)
    empty = den <= 0
    den_safe = torch.where(empty, torch.ones_like(den), den)
    p = p / den_safe
    lse = torch.where(empty, neg, torch.log(den_safe) + row_max)
    if saturated is not None:   # +inf, with d lse / d lse_finite = 1 for the sinks' gradient
        lse = lse + torch.where(saturated, float("inf"), 0.0)
    lse = lse.squeeze(-1)                                                       # [B, Hq, Sq]

    if dropout_prob and float(dropout_prob) > 0.0:
        if dropout_keep is None:
            raise ValueError("dropout_keep (B, Hq, Sq, Sk) is required when dropout_prob > 0")
        keep = dropout_keep if torch.is_tensor(dropout_keep) else torch.as_tensor(np.asarray(dropout_keep))
        p = p * (keep.to(dev).to(torch.float64) / (1.0 - float(dropout_prob)))

    out = torch.matmul(p, vh).permute(0, 2, 1, 3)                               # [B, Sq, Hq, Dv]
    return out, lse


def reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **opts):
    """Packed varlen reference: q (total_q,Hq,D), k/v (total_k,Hkv,D/Dv), int cumulative lengths.

    Each sequence is attended independently with its own bottom-right alignment.  A dropout_keep
    option is (n_seqs, Hq, >= max_seqlen_q, >= max_seqlen_k) (dropout batch index = sequence index).
    Returns (out (total_q, Hq, Dv) float64, lse (Hq, total_q) float64).
    """
    opts = dict(opts)
    opts.pop("max_seqlen_q", None)
    opts.pop("max_seqlen_k", None)
    keep = opts.pop("dropout_keep", None)
    cq = [int(x) for x in (cu_seqlens_q.tolist() if hasattr(cu_seqlens_q, "tolist") else cu_seqlens_q)]
    ck = [int(x) for x in (cu_seqlens_k.tolist() if hasattr(cu_seqlens_k, "tolist") else cu_seqlens_k)]
    assert len(cq) == len(ck)
    q, k, v = _f64(q), _f64(k), _f64(v)
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qi = q[cq[i]:cq[i + 1]][None]
        ki = k[ck[i]:ck[i + 1]][None]
        vi = v[ck[i]:ck[i + 1]][None]
        sq, sk = qi.shape[1], ki.shape[1]
        if sq == 0:
            continue
        extra = {}
        if keep is not None:
            kk = keep if torch.is_tensor(keep) else torch.as_tensor(np.asarray(keep))
            extra["dropout_keep"] = kk[i:i + 1, :, :sq, :sk]
        o, l = reference_attention(qi, ki, vi, **opts, **extra)
        outs.append(o[0])
        lses.append(l[0])
    if not outs:   # every query sequence is empty
        return q.new_zeros((0, q.shape[1], v.shape[-1])), q.new_zeros((q.shape[1], 0))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


_DIFF_KEYS = ("query", "key", "value", "bias", "softmax_aux")


def numpy_reference_with_grads(inputs: dict, dout, **opts) -> dict:
    """float64 reference with gradients, numpy in / numpy out (for the JAX tests).

    inputs: dict with query, key, value and optionally bias, softmax_aux (differentiable) and any other
    option (segment ids, attention_mask, dropout_keep, cu_seqlens_q/k, ...) that is merged into opts.
    If cu_seqlens_q/cu_seqlens_k are present the inputs are packed varlen tensors.
    Returns dict(out, lse, dquery, dkey, dvalue, dbias, dsoftmax_aux) as float64 numpy arrays (gradients
    of sum(out * dout)); dbias / dsoftmax_aux are None when not given.
    """
    opts = dict(opts)
    leaves = {}
    for name, x in inputs.items():
        if name in _DIFF_KEYS:
            if x is None:
                continue
            leaves[name] = torch.tensor(np.asarray(x, dtype=np.float64), requires_grad=True)
        else:
            opts[name] = x
    cu_q = opts.pop("cu_seqlens_q", None)
    cu_k = opts.pop("cu_seqlens_k", None)
    extra = {n: leaves[n] for n in ("bias", "softmax_aux") if n in leaves}
    if cu_q is not None:
        out, lse = reference_varlen(leaves["query"], leaves["key"], leaves["value"],
                                    np.asarray(cu_q), np.asarray(cu_k), **opts, **extra)
    else:
        out, lse = reference_attention(leaves["query"], leaves["key"], leaves["value"], **opts, **extra)
    do = torch.tensor(np.asarray(dout, dtype=np.float64))
    names = list(leaves)
    grads = torch.autograd.grad((out * do).sum(), [leaves[n] for n in names], allow_unused=True)
    res = dict(out=out.detach().numpy(), lse=lse.detach().numpy(), dbias=None, dsoftmax_aux=None)
    for n, g in zip(names, grads):
        res["d" + n] = (np.zeros(leaves[n].shape) if g is None else g.numpy())
    return res


# --- dropout hash: independent numpy uint32 implementation -----------------------------------------
_M1, _M2, _HEAD_MUL = np.uint32(0x7FEB352D), np.uint32(0x846CA68B), np.uint32(0x27D4EB2F)


def _lowbias32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint32)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint32(16))
        x = (x * _M1).astype(np.uint32)
        x = x ^ (x >> np.uint32(15))
        x = (x * _M2).astype(np.uint32)
        x = x ^ (x >> np.uint32(16))
    return x


def dropout_keep_reference(seed, batch, heads, seqlen_q, seqlen_k, dropout_prob) -> np.ndarray:
    """Keep mask (B, H, Sq, Sk) bool of the documented hash (dualattn/kernels/flash/rules.py):

    r = mix(mix(seed ^ (b*H + h) * 0x27D4EB2F) ^ i); x = (r ^ j) * M1; x ^= x >> 15; x *= M2;
    keep iff x >= min(round(p * 2**32), 2**32 - 1), a threshold of 1 taken as 0.
    """
    seed = np.uint32(int(seed) & 0xFFFFFFFF)
    bh = np.arange(batch * heads, dtype=np.uint64).astype(np.uint32).reshape(batch, heads, 1, 1)
    i = np.arange(seqlen_q, dtype=np.uint32).reshape(1, 1, seqlen_q, 1)
    j = np.arange(seqlen_k, dtype=np.uint32).reshape(1, 1, 1, seqlen_k)
    with np.errstate(over="ignore"):
        r = _lowbias32(seed ^ (bh * _HEAD_MUL).astype(np.uint32))
        r = _lowbias32(r ^ i)
        x = ((r ^ j) * _M1).astype(np.uint32)
        x = ((x ^ (x >> np.uint32(15))) * _M2).astype(np.uint32)
    threshold = min(int(round(float(dropout_prob) * 2 ** 32)), 2 ** 32 - 1)
    return x >= np.uint32(0 if threshold == 1 else threshold)


def relative_error(a, b) -> float:
    """||a - b|| / ||b|| in float64 over the finite entries of b.

    NaN anywhere gives inf (so it never passes); an infinite entry of b (e.g. lse -inf of a fully
    masked row) must be matched exactly by a, else inf.
    """
    a = a.detach().to(torch.float64).cpu() if torch.is_tensor(a) else torch.as_tensor(np.asarray(a, np.float64))
    b = b.detach().to(torch.float64).cpu() if torch.is_tensor(b) else torch.as_tensor(np.asarray(b, np.float64))
    assert a.shape == b.shape, f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    fin = torch.isfinite(b)
    if not torch.equal(a[~fin], b[~fin]) or not torch.isfinite(a[fin]).all():
        return float("inf")
    a, b = a[fin], b[fin]
    nb = torch.linalg.vector_norm(b).item()
    diff = torch.linalg.vector_norm(a - b).item()
    if nb == 0.0:
        return diff
    return diff / nb


def assert_close_rel(actual, expected, tol: float, name: str = "value") -> float:
    """Assert relative_error(actual, expected) <= tol (NaN never passes); returns the error."""
    err = relative_error(actual, expected)
    assert np.isfinite(err) and err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"
    return err
