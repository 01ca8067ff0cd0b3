"""First GPU check: correctness of the shared kernels at real sizes, and a quick timing.

python benchmarks/gpu_smoke.py [--out DIR]   (H100; writes smoke.json)
"""
import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import torch  # noqa: E402
import triton  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import dualattn.torch_api as dt  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def reference(q, k, v, causal, window=None, cap=None, sinks=None, bias=None):
    """fp32 math on the GPU (BSHD in), bottom-right masks, to check the kernels at size."""
    B, Sq, H, D = q.shape
    Sk, G = k.shape[1], H // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k.repeat_interleave(G, 2), v.repeat_interleave(G, 2)))
    s = (qf @ kf.transpose(-1, -2)) * D ** -0.5
    if bias is not None:
        s = s + bias.float()
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(Sq, device=q.device)[:, None] + Sk - Sq
    j = torch.arange(Sk, device=q.device)[None, :]
    ok = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        ok &= j <= i
    if window is not None:
        ok &= (j >= i - window[0]) & (j <= i + window[1])
    s = s.masked_fill(~ok, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.float().view(1, H, 1, 1).expand(B, H, Sq, 1)], -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :Sk]
    return (p @ vf).transpose(1, 2)


def check(results):
    torch.manual_seed(0)
    cases = [
        dict(B=2, S=2048, H=16, Hkv=16, D=128, causal=False),
        dict(B=2, S=2048, H=16, Hkv=16, D=128, causal=True),
        dict(B=2, S=1000, H=8, Hkv=2, D=64, causal=True, window=(256, 0)),
        dict(B=1, S=1537, H=8, Hkv=8, D=96, causal=True, cap=30.0, sinks=True),
        dict(B=2, S=1024, H=4, Hkv=4, D=80, causal=False, bias=True),
        dict(B=1, S=4096, H=4, Hkv=1, D=256, causal=True),
    ]
    for c in cases:
        q = torch.randn(c["B"], c["S"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(c["B"], c["S"], c["Hkv"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(c["B"], c["S"], c["Hkv"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        sinks = torch.randn(c["H"], device="cuda", requires_grad=True) if c.get("sinks") else None
        bias = torch.randn(1, c["H"], c["S"], c["S"], device="cuda", requires_grad=True) if c.get("bias") else None
        leaves = [x for x in (q, k, v, sinks, bias) if x is not None]
        out = dt.flash_attention(q, k, v, causal=c["causal"], sliding_window=c.get("window"),
                                 logits_soft_cap=c.get("cap"), softmax_aux=sinks, bias=bias)
        do = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, do)
        ref = reference(q, k, v, c["causal"], c.get("window"), c.get("cap"), sinks, bias)
        rgrads = torch.autograd.grad(ref, leaves, do.float())
        errs = [rel(out, ref)] + [rel(a, b) for a, b in zip(grads, rgrads)]
        ok = all(e < 2e-2 for e in errs) and all(torch.isfinite(g).all() for g in grads)
        results.append(dict(case=c, errors=errs, ok=bool(ok)))
        print(f"check {c}: {' '.join(f'{e:.1e}' for e in errs)} {'OK' if ok else 'FAIL'}", flush=True)


def tflops(ms, B, H, S, D, causal, mode):
    f = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * (3.5 if mode == "fwdbwd" else 1.0) / (ms * 1e-3) / 1e12


def bench(results, B=2, S=8192, H=16, D=128):
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    systems = {
        "dualattn": lambda causal: dt.flash_attention(q, k, v, causal=causal),
        "sdpa_flash": lambda causal: _sdpa(SDPBackend.FLASH_ATTENTION, qt, kt, vt, causal),
        "sdpa_cudnn": lambda causal: _sdpa(SDPBackend.CUDNN_ATTENTION, qt, kt, vt, causal),
    }
    for causal in (False, True):
        for name, fn in systems.items():
            for mode in ("fwd", "fwdbwd"):
                if mode == "fwd":
                    run = lambda: fn(causal)
                else:
                    def run():
                        o = fn(causal)
                        o.backward(do if o.shape == do.shape else do.transpose(1, 2))
                try:
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    t = tflops(ms, B, H, S, D, causal, mode)
                except Exception as e:  # report, don't hide
                    ms, t = None, f"error: {e!r}"[:200]
                results.append(dict(system=name, causal=causal, mode=mode, ms=ms, tflops=t, B=B, S=S, H=H, D=D))
                print(f"bench {name:11s} causal={causal!s:5s} {mode:6s} {t if isinstance(t, str) else f'{t:7.1f}'}",
                      flush=True)


def _sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def jax_check(results):
    import numpy as np
    import jax
    import jax.numpy as jnp
    import dualattn.jax_api as dj
    rng = np.random.default_rng(0)
    B, S, H, D = 2, 2048, 8, 128
    q, k, v, do = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(4))
    tq, tk, tv = (torch.tensor(x, device="cuda", dtype=torch.bfloat16, requires_grad=True) for x in (q, k, v))
    tout = dt.flash_attention(tq, tk, tv, causal=True)
    tgrads = torch.autograd.grad(tout, [tq, tk, tv], torch.tensor(do, device="cuda", dtype=torch.bfloat16))
    jq, jk, jv, jdo = (jnp.asarray(x, dtype=jnp.bfloat16) for x in (q, k, v, do))
    f = jax.jit(lambda q, k, v: dj.flash_attention(q, k, v, causal=True, backend="triton"))
    jout, vjp = jax.vjp(f, jq, jk, jv)
    jgrads = vjp(jdo)
    same = [bool(np.array_equal(np.asarray(a.astype(jnp.float32)), b.detach().float().cpu().numpy()))
            for a, b in zip([jout, *jgrads], [tout, *tgrads])]
    results.append(dict(jax_vs_torch_bitwise=same))
    print("jax triton vs torch bitwise equal (out, dq, dk, dv):", same, flush=True)
    for causal in (False, True):
        Bb, Sb, Hb, Db = 2, 8192, 16, 128
        x = [jnp.asarray(rng.standard_normal((Bb, Sb, Hb, Db)), dtype=jnp.bfloat16) for _ in range(4)]
        fwd = jax.jit(lambda q, k, v: dj.flash_attention(q, k, v, causal=causal, backend="triton"))
        fb = jax.jit(lambda q, k, v, d: jax.vjp(lambda a, b, c: dj.flash_attention(a, b, c, causal=causal,
                                                                                  backend="triton"), q, k, v)[1](d))
        for mode, fn in (("fwd", lambda: fwd(*x[:3]).block_until_ready()),
                         ("fwdbwd", lambda: jax.block_until_ready(fb(*x)))):
            ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            t = tflops(ms, Bb, Hb, Sb, Db, causal, mode)
            results.append(dict(system="dualattn_jax", causal=causal, mode=mode, ms=ms, tflops=t))
            print(f"bench dualattn_jax causal={causal!s:5s} {mode:6s} {t:7.1f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-jax", action="store_true")
    args = ap.parse_args()
    results = []
    t0 = time.time()
    check(results)
    bench(results)
    if not args.skip_jax:
        try:
            jax_check(results)
        except Exception as e:
            import traceback
            traceback.print_exc()
            results.append(dict(jax_error=repr(e)))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), seconds=time.time() - t0)
    with open(os.path.join(args.out, "smoke.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    print(json.dumps(meta))
