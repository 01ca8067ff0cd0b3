"""Where NSA's time goes in each front end: the device time of every kernel (and XLA op) of one call,
torch and JAX (backend triton, jitted) on the same tensors, from torch.profiler (CUPTI sees both).
Tells a slower JAX figure in bench_nsa.py apart: a kernel JAX runs that torch does not (or runs
slower), or time outside the kernels (host, launch gaps).

    python benchmarks/nsa_kernel_times.py                    T = 64k, group 16 (bench_nsa's shape)
    python benchmarks/nsa_kernel_times.py --seqlen 8192 --group 4
"""
from __future__ import annotations

import argparse

import jax
import torch

import dualattn.jax_api as dj
import dualattn.torch_api as dt
from dualattn.bench.flash import kernel_times


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=65536)
    ap.add_argument("--group", type=int, default=16)
    args = ap.parse_args()
    heads_kv, head_dim, block_size, count, window = 4, 128, 64, 16, 512
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    T, hq = args.seqlen, heads_kv * args.group
    q, k, v = rand(1, T, hq, head_dim), rand(1, T, heads_kv, head_dim), rand(1, T, heads_kv, head_dim)
    gates = [torch.rand(1, T, hq, generator=gen).to("cuda", torch.bfloat16).requires_grad_() for _ in range(3)]
    dout = torch.randn(1, T, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
    opts = dict(block_counts=count, block_size=block_size, window_size=window)
    with torch.no_grad():
        _, idx = dt.native_sparse_attention(q, k, v, *gates, return_block_indices=True, **opts)

    def share(t):
        return jax.dlpack.from_dlpack(t.detach().contiguous())
    jq, jk, jv, jd, jidx = map(share, (q, k, v, dout, idx))
    jg = [share(g) for g in gates]

    def jax_selected(q_, k_, v_):
        return dj.apply_native_sparse_attention(q_, k_, v_, jidx, count, block_size, backend="triton")

    def jax_nsa(q_, k_, v_, a, b, c):
        return dj.native_sparse_attention(q_, k_, v_, a, b, c, backend="triton", **opts)
    jax_selected_bwd = jax.jit(lambda d, *a: jax.vjp(jax_selected, *a)[1](d))
    jax_nsa_bwd = jax.jit(lambda d, *a: jax.vjp(jax_nsa, *a)[1](d))
    cases = {
        "selected fwd+bwd": (
            lambda: torch.autograd.grad(dt.apply_native_sparse_attention(q, k, v, idx, count, block_size),
                                        (q, k, v), dout),
            lambda: jax.block_until_ready(jax_selected_bwd(jd, jq, jk, jv))),
        "nsa fwd+bwd": (
            lambda: torch.autograd.grad(dt.native_sparse_attention(q, k, v, *gates, **opts), (q, k, v, *gates), dout),
            lambda: jax.block_until_ready(jax_nsa_bwd(jd, jq, jk, jv, *jg))),
    }
    for case, (torch_fn, jax_fn) in cases.items():
        tables = {"torch": kernel_times(torch_fn), "jax": kernel_times(jax_fn)}
        print(f"\n## T={T} group={args.group} {case}: device ms per call, by kernel")
        names = sorted(set(tables["torch"]) | set(tables["jax"]),
                       key=lambda n: -max(tables["torch"].get(n, 0), tables["jax"].get(n, 0)))
        print(f"{'kernel':72s} {'torch':>9s} {'jax':>9s}")
        for n in names:
            print(f"{n:72s} {tables['torch'].get(n, 0):9.3f} {tables['jax'].get(n, 0):9.3f}")
        print(f"{'total':72s} {sum(tables['torch'].values()):9.3f} {sum(tables['jax'].values()):9.3f}")


if __name__ == "__main__":
    main()
