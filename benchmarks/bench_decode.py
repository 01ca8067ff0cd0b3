"""Decode over a KV cache on one GPU: dualattn's flash_attn_with_kvcache (dense and paged) against torch SDPA
at one query row and FlexAttention, in one process on the same inputs.

bf16, Hq 32 / Hkv 8, D 128, one query row per sequence, every sequence the full cache length.  Bandwidth =
K and V bytes read (2 * B * L * Hkv * D * 2) / median time (triton.testing.do_bench).  Writes
benchmarks/results/decode_<device>.json (or --out) and prints a table.

    python benchmarks/bench_decode.py [--out PATH] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton

from dualattn.torch_api import flash_attn_with_kvcache

HQ, HKV, D = 32, 8, 128
BATCHES = (1, 8, 64)
LENGTHS = (1024, 4096, 8192, 32768, 131072)
MAX_TOKENS = 64 * 32768          # B * L cap: two layouts of K and V must fit beside the peers' copies
PEAK_TBS = {"H100": 3.35, "H200": 4.8}


def _peak(name: str):
    return next((v for k, v in PEAK_TBS.items() if k in name), None)


def _time_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def _systems(b: int, length: int):
    """(name, callable) per system; each callable runs one decode call over the same K/V values."""
    g = torch.Generator(device="cuda").manual_seed(b * 7 + length)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, length, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    seqlens = torch.full((b,), length, dtype=torch.int32, device="cuda")
    yield "dualattn dense", lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
    page = 16
    pages = length // page
    perm = torch.randperm(b * pages, device="cuda", generator=g).int()
    table = perm.view(b, pages)
    k_pages = torch.empty(b * pages, page, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_pages = torch.empty_like(k_pages)
    k_pages[table.long().view(-1)] = k.view(b * pages, page, HKV, D)
    v_pages[table.long().view(-1)] = v.view(b * pages, page, HKV, D)
    yield "dualattn paged16", lambda: flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=seqlens,
                                                              block_table=table)
    del k_pages, v_pages
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # BHSD views, no copy
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for label, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION),
                           ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)
        yield label, sdpa
    yield "flex", lambda: _flex()(qh, kh, vh, enable_gqa=True)


_FLEX = []


def _flex():
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


def _host_issue_us() -> dict:
    """Host time a call (no sync between calls) and the kernel time of its CUDA graph, B = 1, 8k."""
    q = torch.randn(1, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8192, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((1,), 8192, dtype=torch.int32, device="cuda")
    call = lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)  # noqa: E731
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return {"host_us_per_call": host, "eager_us": _time_us(call), "graph_replay_us": _time_us(graph.replay)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="B = 64 at 8k and B = 1 at 128k only")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    peak = _peak(name)
    rows = []
    shapes = [(b, n) for b in BATCHES for n in LENGTHS if b * n <= MAX_TOKENS]
    if args.quick:
        shapes = [(64, 8192), (1, 131072)]
    for b, length in shapes:
        kv_bytes = 2 * b * length * HKV * D * 2
        for system, fn in _systems(b, length):
            try:
                fn()
                us = _time_us(fn)
                error = None
            except Exception as e:    # a peer that does not take this shape
                us, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            tbs = kv_bytes / (us * 1e-6) / 1e12 if us else None
            rows.append(dict(system=system, batch=b, cache=length, us=us, tb_s=tbs,
                             frac_peak=(tbs / peak if tbs and peak else None), error=error))
            print(f"{system:18s} B={b:3d} L={length:6d}  " +
                  (f"{us:9.1f} us  {tbs:5.2f} TB/s" + (f"  {tbs / peak:5.1%}" if peak else "") if us else error),
                  flush=True)
        torch.cuda.empty_cache()
    host = _host_issue_us()
    print(json.dumps(host))
    result = dict(device=name, peak_tb_s=peak, hq=HQ, hkv=HKV, d=D, dtype="bfloat16", rows=rows, host=host,
                  torch=torch.__version__, triton=triton.__version__)
    tag = "h200" if "H200" in name else "h100" if "H100" in name else name.replace(" ", "_").lower()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"decode_{tag}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
