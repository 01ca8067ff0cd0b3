"""Documents as segment ids, one kernel choice switched on and off, fwd and fwd+bwd, 8 documents x 2048
tokens, S = 16384, D = 128 and 64, causal and not.

    python benchmarks/ab_documents.py edges      # portable forward: edge tiles in the one loop or not
    python benchmarks/ab_documents.py one-pass   # backward: the one-pass Gluon kernel or the two-pass

`edges` switches the Gluon forward off, so that the portable forward (sm_80, and head dims or windows
the Gluon kernel does not take) is what runs, and compares its edge tiles inside the one loop (the
default) against loops of their own (DUALATTN_EDGES_IN_LOOP=0).  `one-pass` compares the one-pass
backward (the default from 4096 keys on Hopper) against the two-pass one (DUALATTN_ONE_PASS=0).
`--seqlen` sets S (8 equal documents; S = 16000 leaves a partial last key tile).  Each setting is
timed twice, alternating, in one process (do_bench medians); effective TFLOP/s count
the allowed (causal, same-document) pairs only, as `python -m dualattn.bench --cases options` does.
"""
import argparse

import torch
import triton

import dualattn.torch_api as dt
from dualattn import switches
from dualattn.kernels.flash import plan

SWITCHES = {"edges": "DUALATTN_EDGES_IN_LOOP", "one-pass": "DUALATTN_ONE_PASS"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("switch", choices=sorted(SWITCHES))
    parser.add_argument("--seqlen", type=int, default=16384)
    args = parser.parse_args()
    if args.switch == "edges":
        switches.set_switches(DUALATTN_GLUON_FWD="0")
    for head_dim, heads in ((128, 16), (64, 32)):
        seqlen, docs = args.seqlen, 8
        q, k, v = (torch.randn(1, seqlen, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        seg = (torch.arange(seqlen, device="cuda", dtype=torch.int32) // (seqlen // docs))[None]
        for causal in (True, False):
            flops = 4 * docs * (seqlen // docs) ** 2 * (0.5 if causal else 1.0) * head_dim * heads

            def forward():
                return dt.flash_attention(q, k, v, causal=causal, q_segment_ids=seg, kv_segment_ids=seg)

            def forward_backward():
                torch.autograd.grad(forward(), (q, k, v), dout)

            for flag in (None, "0", None, "0"):
                switches.set_switches(**{SWITCHES[args.switch]: flag})
                plan.forget_plans()
                with torch.no_grad():
                    fwd = triton.testing.do_bench(forward, warmup=20, rep=200, return_mode="median")
                both = triton.testing.do_bench(forward_backward, warmup=10, rep=200, return_mode="median")
                print(f"D={head_dim} {'causal' if causal else 'full'} {args.switch} "
                      f"{'off' if flag == '0' else 'default'}: fwd {flops / fwd / 1e9:.0f}, "
                      f"fwd+bwd {3.5 * flops / both / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
