"""Kernel ms per call (torch.profiler), forward and forward + backward, of flash_attention with a (B, H, S, S)
bool mask (90% kept), a bf16 bias, both, a soft cap of 50 (Gemma 2's), and none of them: B = 2, S = 4096,
D = 128 (H = 16) and 64 (H = 32), non-causal and causal.  Prints the package it ran and a checksum of each
output, so that two source trees compare (PYTHONPATH=/tmp/base for the other).

    python benchmarks/score_option_times.py [CASE ...]   only these of mask, bias, bias+mask, softcap (and none)
"""
import sys

import torch

import dualattn
import dualattn.torch_api as dt
from dualattn.bench.flash import kernel_times

B, S = 2, 4096
SHAPES = ((128, 16), (64, 32))   # (D, H)


def score_cases(D: int, H: int, gen: torch.Generator):
    """(q, k, v, dO, {case name: flash_attention keyword arguments}) at head dim D with H heads."""
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    mask = torch.rand(B, H, S, S, device="cuda", generator=gen) < 0.9
    bias = torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, generator=gen)
    cases = {"none": {}, "mask": dict(attention_mask=mask), "bias": dict(bias=bias),
             "softcap": dict(logits_soft_cap=50.0)}
    if D == 64:
        cases["bias+mask"] = dict(bias=bias, attention_mask=mask)
    return q, k, v, do, cases


def main():
    print(dualattn.__file__, torch.cuda.get_device_name(), torch.__version__, flush=True)
    wanted = sys.argv[1:]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for D, H in SHAPES:
        q, k, v, do, cases = score_cases(D, H, gen)
        for causal in (False, True):
            for name, kw in cases.items():
                if wanted and name != "none" and name not in wanted:
                    continue
                with torch.no_grad():
                    for _ in range(2):   # the second round is printed: compiled and warm
                        fwd = kernel_times(lambda: dt.flash_attention(q, k, v, causal=causal, **kw), calls=10, width=40)
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                for _ in range(2):
                    both = kernel_times(lambda: torch.autograd.grad(dt.flash_attention(*leaves, causal=causal, **kw),
                                                                    leaves, do), calls=5, width=40)
                out = dt.flash_attention(q, k, v, causal=causal, **kw)
                print(f"D={D} causal={causal} {name:10s} fwd {sum(fwd.values()):.4f} ms  fwd+bwd "
                      f"{sum(both.values()):.4f} ms  checksum {out.float().sum().item():.6e}", flush=True)


if __name__ == "__main__":
    main()
