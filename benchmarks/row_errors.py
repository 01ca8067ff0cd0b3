"""Where a kernel variant goes wrong: per-row errors of out, dQ, dK, dV against float64 (GPU, torch).

    python benchmarks/row_errors.py

Prints, per case, the largest relative error of each output and the rows above 2e-2 (their range
within a 128-row tile and the tiles they fall in).  A kernel variant that is wrong on some rows of
every tile (a warpgroup computing the wrong rows, a store that misses half a tile) shows as a band of
rows mod 128; edit the cases below to the shapes and options of the variant under suspicion.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference import reference_attention  # noqa: E402

from dualattn.torch_api import flash_attention  # noqa: E402


def report(name, got, want, row_dim):
    dims = tuple(d for d in range(got.dim()) if d != row_dim)
    err = (got.double() - want).abs().amax(dim=dims) / want.abs().amax()
    bad = (err > 2e-2).nonzero().flatten()
    line = f"  {name}: max rel {err.max().item():.2e}, {len(bad)} bad rows"
    if len(bad):
        line += (f" (rows mod 128 in [{(bad % 128).min().item()}, {(bad % 128).max().item()}],"
                 f" tiles {sorted(set((bad // 128).tolist()))[:12]})")
    print(line)


def run(sq, sk, d=128, heads=2, **opts):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, sq, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, sk, heads, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, **opts)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    print(f"Sq={sq} Sk={sk} D={d} {opts}")
    report("out", out, ref_out, 1)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        report(name, g, r, 1)


if __name__ == "__main__":
    run(2048, 2048, causal=True)
    run(2560, 2048, causal=True)
    run(4096, 4096, d=64, causal=True)
    run(2048, 4096, sliding_window=(700, 300))
    run(2048, 2048)
