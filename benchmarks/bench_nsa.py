"""Native sparse attention on the GPU: the whole NSA and its selected branch, next to dense causal
flash_attention and flash-linear-attention's parallel_nsa (where it imports), in one run.

    python benchmarks/bench_nsa.py                      H100, bf16, D=128, Hkv=4, group 16 and 4, block 64,
                                                        16 selected blocks, window 512, T = 8k..64k
    python benchmarks/bench_nsa.py --quick              T = 8k and 16k, fewer repetitions (< 3 min)
    python benchmarks/bench_nsa.py --jax                also dualattn.jax_api (backend triton, jit), and torch
                                                        timed the same way: back-to-back calls, one wait
    python benchmarks/bench_nsa.py --device cpu         a tiny dry run on the CPU interpreter (the script's plumbing)
Writes JSON under benchmarks/results/ (device, versions, date, every timing, speed-ups vs dense).
The selected branch is timed on the indices the whole NSA chose (its own top-k), so both see real selections.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time

import torch

import dualattn.torch_api as dt

HERE = os.path.dirname(os.path.abspath(__file__))


def _timer(device: str, quick: bool):
    if device == "cpu":
        def once(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return once
    import triton

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=5 if quick else 25, rep=20 if quick else 100, return_mode="median")
    return bench


def _fla_nsa():
    try:
        from fla.ops.nsa import parallel_nsa
        return parallel_nsa
    except Exception as e:  # not installed, or built for another torch / triton
        return f"{type(e).__name__}: {e}"


def _versions() -> dict:
    out = dict(python=platform.python_version(), torch=torch.__version__)
    for name in ("triton", "jax", "fla"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def _grad(fn, inputs, dout):
    return lambda: torch.autograd.grad(fn(), inputs, dout)


def _jax_cases(record, q, k, v, gates, dout, idx, opts, count, block_size, torch_fns, timing):
    """The whole NSA, NSA without the sliding branch and the selected branch through dualattn.jax_api
    (backend triton, jitted, the torch tensors shared through DLPack), and the same torch calls, all
    timed as n back-to-back calls and one wait (dualattn.bench.flash.throughput_ms: CUDA events on
    torch's stream do not see JAX's work; `timing`: its min_ms and repeats)."""
    import jax
    from dualattn import jax_api
    from dualattn.bench.flash import throughput_ms
    from dualattn.bench.systems import Step

    def share(t):
        return jax.dlpack.from_dlpack(t.detach().contiguous())
    jq, jk, jv, jd, jidx = map(share, (q, k, v, dout, idx))

    def back_to_back(step):
        return throughput_ms(step, **timing)
    jg = [share(g) for g in gates]
    no_window = dict(opts, window_size=0)
    fns = {"nsa": (lambda q, k, v, a, b, c: jax_api.native_sparse_attention(q, k, v, a, b, c, backend="triton",
                                                                           **opts), (jq, jk, jv, *jg)),
           "nsa-no-window": (lambda q, k, v, a, b: jax_api.native_sparse_attention(q, k, v, a, b, None,
                                                                                  backend="triton", **no_window),
                             (jq, jk, jv, jg[0], jg[1])),
           "nsa-selected": (lambda q, k, v: jax_api.apply_native_sparse_attention(q, k, v, jidx, count, block_size,
                                                                                 backend="triton"), (jq, jk, jv))}
    for name, (fn, args) in fns.items():
        fwd = jax.jit(fn)
        fwdbwd = jax.jit(lambda d, *a, fn=fn: jax.vjp(fn, *a)[1](d))
        for mode, step in (("fwd", lambda: fwd(*args)), ("fwdbwd", lambda: fwdbwd(jd, *args))):
            record(f"jax-dualattn-{name}", mode, Step(step, jax.block_until_ready), timer=back_to_back)
        torch_fwd, torch_fwdbwd = torch_fns[name]
        sync = (lambda _: torch.cuda.synchronize()) if q.is_cuda else (lambda _: None)
        for mode, torch_step in (("fwd", torch_fwd), ("fwdbwd", torch_fwdbwd)):
            record(f"torch-dualattn-{name}-back-to-back", mode, Step(torch_step, sync), timer=back_to_back)


def run_case(bench, device, dtype, seqlen, heads_kv, group, head_dim, block_size, count, window, fla,
             jax_too=False) -> list:
    hq = heads_kv * group
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    q, k, v = rand(1, seqlen, hq, head_dim), rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv, head_dim)
    gates = [torch.rand(1, seqlen, hq, generator=gen).to(device=device, dtype=dtype).requires_grad_() for _ in range(3)]
    dout = torch.randn(1, seqlen, hq, head_dim, generator=gen).to(device=device, dtype=dtype)
    opts = dict(block_counts=count, block_size=block_size, window_size=window)
    with torch.no_grad():
        _, idx = dt.native_sparse_attention(q, k, v, *gates, return_block_indices=True, **opts)
    rows = []

    def record(system, mode, fn, note=None, timer=None):
        try:
            ms = (timer or bench)(fn)
        except Exception as e:  # keep the run going: a failing system is reported, not fatal
            ms, note = None, f"{type(e).__name__}: {e}"[:300]
        rows.append(dict(seqlen=seqlen, group=group, heads_q=hq, heads_kv=heads_kv, system=system, mode=mode, ms=ms,
                         note=note))
        print(f"T={seqlen:6d} g={group:2d} {system:28s} {mode:6s} " + (f"{ms:9.3f} ms" if ms else "   failed")
              + (f"  {note}" if note else ""), flush=True)

    nsa = lambda: dt.native_sparse_attention(q, k, v, *gates, **opts)  # noqa: E731
    # fla's parallel_nsa takes its sliding branch from the flash-attn package: without it, NSA is
    # compared with the sliding branch off on both sides.
    no_window = dict(opts, window_size=0)
    nsa_nw = lambda: dt.native_sparse_attention(q, k, v, gates[0], gates[1], None, **no_window)  # noqa: E731
    selected = lambda: dt.apply_native_sparse_attention(q, k, v, idx, count, block_size)  # noqa: E731
    dense = lambda: dt.flash_attention(q, k, v, causal=True)  # noqa: E731
    for system, fn, inputs in (("dualattn-nsa", nsa, (q, k, v, *gates)),
                               ("dualattn-nsa-no-window", nsa_nw, (q, k, v, gates[0], gates[1])),
                               ("dualattn-nsa-selected", selected, (q, k, v)),
                               ("dualattn-flash-dense-causal", dense, (q, k, v))):
        with torch.no_grad():
            record(system, "fwd", fn)
        record(system, "fwdbwd", _grad(fn, inputs, dout))
    if callable(fla) and device == "cuda":
        kw = dict(block_size=block_size, window_size=window, scale=head_dim ** -0.5)
        fla_nsa = lambda: fla(q, k, v, gates[0], gates[1], gates[2], block_counts=count, **kw)  # noqa: E731
        fla_nw = lambda: fla(q, k, v, gates[0], gates[1], None, block_counts=count,  # noqa: E731
                             **dict(kw, window_size=0))
        fla_sel = lambda: fla(q, k, v, None, gates[1], None, block_indices=idx.long(), block_counts=count,  # noqa: E731
                              block_size=block_size, scale=head_dim ** -0.5)
        for system, fn, inputs in (("fla-parallel_nsa", fla_nsa, (q, k, v, *gates)),
                                   ("fla-parallel_nsa-no-window", fla_nw, (q, k, v, gates[0], gates[1])),
                                   ("fla-parallel_nsa-selected", fla_sel, (q, k, v, gates[1]))):
            with torch.no_grad():
                record(system, "fwd", fn)
            record(system, "fwdbwd", _grad(fn, inputs, dout))
    if jax_too:
        def no_grad(fn):
            def call():
                with torch.no_grad():
                    return fn()
            return call
        torch_fns = {"nsa": (no_grad(nsa), _grad(nsa, (q, k, v, *gates), dout)),
                     "nsa-no-window": (no_grad(nsa_nw), _grad(nsa_nw, (q, k, v, gates[0], gates[1]), dout)),
                     "nsa-selected": (no_grad(selected), _grad(selected, (q, k, v), dout))}
        timing = dict(min_ms=200.0, repeats=5) if device == "cuda" else dict(min_ms=1.0, repeats=1)
        _jax_cases(record, q, k, v, gates, dout, idx, opts, count, block_size, torch_fns, timing)
    return rows


def speedups(rows: list) -> list:
    """Per (T, group, mode): dense causal time / each system's time."""
    out = []
    dense = {(r["seqlen"], r["group"], r["mode"]): r["ms"] for r in rows
             if r["system"] == "dualattn-flash-dense-causal"}
    for r in rows:
        base = dense.get((r["seqlen"], r["group"], r["mode"]))
        if r["ms"] and base and r["system"] != "dualattn-flash-dense-causal":
            out.append(dict(seqlen=r["seqlen"], group=r["group"], mode=r["mode"], system=r["system"],
                            speedup_vs_dense=base / r["ms"]))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="T = 8k and 16k, fewer repetitions")
    ap.add_argument("--seqlens", type=int, nargs="*", help="override the sequence lengths")
    ap.add_argument("--groups", type=int, nargs="*", default=[16, 4])
    ap.add_argument("--jax", action="store_true", help="also dualattn.jax_api, both timed back to back")
    ap.add_argument("--out", help="JSON path (default benchmarks/results/<date>_<device>_nsa.json)")
    args = ap.parse_args(argv)
    if args.device == "cpu":   # the interpreter: tiny sizes, fp32, one timing each
        cfg = dict(dtype=torch.float32, heads_kv=1, head_dim=16, block_size=16, count=2, window=16)
        seqlens, groups = args.seqlens or [64], args.groups if args.groups != [16, 4] else [2]
    else:
        cfg = dict(dtype=torch.bfloat16, heads_kv=4, head_dim=128, block_size=64, count=16, window=512)
        seqlens = args.seqlens or ([8192, 16384] if args.quick else [8192, 16384, 32768, 65536])
        groups = args.groups
    bench = _timer(args.device, args.quick)
    fla = _fla_nsa()
    rows = []
    for group in groups:
        for seqlen in seqlens:
            rows += run_case(bench, args.device, seqlen=seqlen, group=group, fla=fla,
                             jax_too=args.jax, **cfg)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    result = dict(benchmark="nsa", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  device=device_name, versions=_versions(), quick=args.quick,
                  config={k: (str(v) if k == "dtype" else v) for k, v in cfg.items()}, seqlens=seqlens, groups=groups,
                  fla=None if callable(fla) else fla, results=rows, speedups=speedups(rows))
    out = args.out or os.path.join(HERE, "results", f"{datetime.date.today().isoformat()}_{args.device}_nsa"
                                   + ("_quick" if args.quick else "") + ".json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
