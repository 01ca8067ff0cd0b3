"""Where a case's GPU time goes: each kernel's ms per call (torch.profiler) of the torch path's forward and
forward + backward, for cases of `python -m dualattn.bench --cases options`, next to the option-free case of
the same shape.  Launch-count and zero-fill / cast costs show up as rows of their own; each row gives the kernel's
ms per forward and per forward + backward (0 where the forward does not run it).

    python benchmarks/kernel_breakdown.py docs,window_causal,blocksparse_window
"""
import sys

import torch

from dualattn.bench.flash import kernel_times
from dualattn.bench.options import CASES, dualattn_torch, make_problem


def breakdown(case) -> None:
    p = make_problem(case, seed=0, device="cuda")
    attn = dualattn_torch(p)
    q, k, v = p.inputs.q, p.inputs.k, p.inputs.v
    do = torch.randn_like(q)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    with torch.no_grad():
        fwd = kernel_times(lambda: attn(q, k, v), calls=10)
    both = kernel_times(lambda: torch.autograd.grad(attn(*leaves), leaves, do), calls=10)
    print(f"== {case.name} ({case.options}, B={case.B} S={case.S} H={case.H} D={case.D} causal={case.causal}): "
          f"fwd {sum(fwd.values()):.4f} ms, fwd+bwd {sum(both.values()):.4f} ms", flush=True)
    print(f"  {'fwd ms':>8}  {'fwd+bwd':>8}  kernel")
    for name, ms in sorted(both.items(), key=lambda kv: -kv[1]):
        print(f"  {fwd[name] if name in fwd else 0.0:8.4f}  {ms:8.4f}  {name}")


def main():
    by_name = {c.name: c for c in CASES}
    for name in sys.argv[1].split(","):
        case = by_name[name]
        breakdown(case)
        breakdown(case.base())


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    main()
