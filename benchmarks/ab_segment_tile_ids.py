"""Packed documents' segment ranges from the other tiles' [min, max] ids (segments.segment_tile_ids_kernel, what
plan.segment_ranges_first runs past plan.TILE_IDS_FROM ids) against ranges reduced by every own tile from every id
of the other axis, fwd and fwd+bwd.

    python benchmarks/ab_segment_tile_ids.py                       # 16k, 64k, 128k tokens; 1k and 8k documents
    python benchmarks/ab_segment_tile_ids.py --totals 65536 --docs 1024

Each pack is causal, bf16, Hq = Hkv = 16, D = 128, equal documents, called with segment ids and as one varlen
table (run as documents: plan.varlen_as_documents).  Per setting: do_bench medians (ms) of the forward and of
fwd+bwd, and the device time (torch.profiler) of the segment kernels (flash.segments: the varlen ids, the tile
ids, the ranges) in one fwd+bwd.  The two settings alternate, twice each, in one process, whatever the
default for the pack's length.
"""
import argparse

import torch
import triton

import dualattn.torch_api as dt
from dualattn.kernels.flash import plan

SEGMENT_KERNELS = ("varlen_segment_ids_kernel", "segment_tile_ids_kernel", "segment_ranges_kernel")


def segment_ms(step) -> float:
    """Device ms of the segment kernels in one call of `step` (after a warm call)."""
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.key in SEGMENT_KERNELS) / 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--totals", type=int, nargs="+", default=[16384, 65536, 131072])
    parser.add_argument("--docs", type=int, nargs="+", default=[1024, 8192], help="document lengths")
    args = parser.parse_args()
    heads, head_dim, default_from = 16, 128, plan.TILE_IDS_FROM
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for total in args.totals:
        q, k, v = (torch.randn(total, heads, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        for doc in args.docs:
            if doc > total:
                continue
            seg = (torch.arange(total, device="cuda", dtype=torch.int32) // doc)[None]
            table = torch.arange(0, total + 1, doc, device="cuda", dtype=torch.int32)
            calls = {
                "segment ids": lambda: dt.flash_attention(q[None], k[None], v[None], causal=True, q_segment_ids=seg,
                                                          kv_segment_ids=seg),
                "varlen": lambda: dt.flash_attn_varlen_func(q, k, v, table, table, doc, doc, causal=True),
            }
            for entry, call in calls.items():
                for tile_ids_from in (0, 1 << 30) * 2:
                    plan.TILE_IDS_FROM = tile_ids_from
                    plan.forget_plans()
                    with torch.no_grad():
                        fwd = triton.testing.do_bench(call, warmup=10, rep=100, return_mode="median")

                    def step():
                        torch.autograd.grad(call(), (q, k, v), dout.view_as(q) if entry == "varlen" else dout[None])
                    both = triton.testing.do_bench(step, warmup=5, rep=100, return_mode="median")
                    setting = "tile ids" if tile_ids_from < 1 << 30 else "ids     "
                    print(f"{total:>7} tokens, documents of {doc:>5}, {entry:<11} {setting}: fwd {fwd:.3f} ms, "
                          f"fwd+bwd {both:.3f} ms, segment kernels {segment_ms(step):.3f} ms a fwd+bwd", flush=True)
                plan.TILE_IDS_FROM = default_from
                plan.forget_plans()


if __name__ == "__main__":
    main()
