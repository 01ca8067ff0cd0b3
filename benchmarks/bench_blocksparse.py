"""Block-sparse attention on the GPU: dualattn vs dense causal flash vs FlexAttention, same masks, one run.

python benchmarks/bench_blocksparse.py --out results.json     (B=1, H=16, S=16384, D=128, bf16)
Effective TFLOP/s count only the allowed (unmasked) query-key pairs: 4*D*H*pairs (fwd), x3.5 fwd+bwd.
Cases: a causal window, packed documents and a BigBird-like layout (window, global and strided
blocks).  "dualattn-blocksparse" is what a call runs (128 x 128 blocks: the Gluon kernels on sm_90);
"dualattn-blocksparse-portable" the same call with the Gluon kernels switched off (A/B);
"dualattn-flash" the same mask through flash_attention where its options state it (window, documents).
Each row gives the wall time of back-to-back calls (do_bench) and the kernel time: calls queued behind a
sleeping GPU, so that the host's time to issue them does not count (a forward of ~0.3 ms is close to
the torch path's host time; docs/lessons.md, "Time short problems by kernel time").
"""
import argparse
import json
import os
import time

import numpy as np
import torch
import triton
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dualattn.torch_api as dt
from dualattn import SparseMask, masks, switches


def _bench(fn, calls=10, rounds=3):
    """(wall ms per call of back-to-back calls, kernel ms per call: calls queued behind a sleeping GPU)."""
    wall = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    kernel = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e8))   # ~0.1 s: longer than issuing the calls
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        kernel.append(start.elapsed_time(end) / calls)
    return wall, float(np.median(kernel))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=128)
    args = ap.parse_args()
    S, H, D, BLK = args.seqlen, args.heads, args.head_dim, args.block
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    flex = torch.compile(flex_attention)
    window, n_docs = 1024, 8
    seg = torch.arange(S, device="cuda") // (S // n_docs)
    i = np.arange(S)
    bigbird = masks.local((3 * BLK, 3 * BLK)) | masks.global_tokens(2 * BLK) | masks.strided(16)
    bigbird_map = bigbird(1, 1, S, S, BLK, BLK)[0, 0]
    bigbird_blocks = torch.tensor(bigbird_map, device="cuda")
    cases = {
        "causal_window1024": dict(
            builder=masks.causal() & masks.local((window, 0)), kw=dict(causal=True, sliding_window=(window, 0)),
            mask_mod=lambda b, h, qi, ki: (ki <= qi) & (qi - ki <= window),
            pairs=int(np.minimum(i + 1, window + 1).sum())),
        "documents8x2048_causal": dict(
            builder=masks.document(seg[None].cpu()) & masks.causal(),
            kw=dict(causal=True, q_segment_ids=seg[None].int(), kv_segment_ids=seg[None].int()),
            mask_mod=lambda b, h, qi, ki: (ki <= qi) & (seg[qi] == seg[ki]),
            pairs=n_docs * (S // n_docs) * (S // n_docs + 1) // 2),
        "bigbird_window_global_strided": dict(
            builder=bigbird, kw={},
            mask_mod=lambda b, h, qi, ki: bigbird_blocks[qi // BLK, ki // BLK],
            pairs=int(bigbird_map.sum()) * BLK * BLK, dense=False),
    }
    results = []

    def record(case, system, mode, times, pairs, err=None, note=None):
        ms, kernel_ms = times
        flops = 4 * D * H * pairs * (3.5 if mode == "fwdbwd" else 1.0)
        results.append(dict(case=case, system=system, mode=mode, ms=ms, effective_tflops=flops / ms / 1e9,
                            kernel_ms=kernel_ms, kernel_effective_tflops=flops / kernel_ms / 1e9,
                            pairs=pairs, density=pairs / S / S, rel_err_vs_flex=err, note=note))
        print(f"{case:24s} {system:29s} {mode:6s} {ms:7.3f} ms {flops / ms / 1e9:6.1f} eff TFLOP/s | kernel "
              f"{kernel_ms:7.3f} ms {flops / kernel_ms / 1e9:6.1f}"
              + (f"  err={err:.1e}" if err is not None else "") + (f"  {note}" if note else ""), flush=True)

    dense_pairs = S * (S + 1) // 2
    with torch.no_grad():
        record("dense_causal", "dualattn-flash", "fwd", _bench(lambda: dt.flash_attention(q, k, v, causal=True)),
               dense_pairs)
    out = dt.flash_attention(q, k, v, causal=True)
    record("dense_causal", "dualattn-flash", "fwdbwd",
           _bench(lambda: torch.autograd.grad(dt.flash_attention(q, k, v, causal=True), (q, k, v), do)), dense_pairs)
    for name, c in cases.items():
        t0 = time.time()
        layout = SparseMask.from_block_map(c["builder"](1, H, S, S, BLK, BLK), BLK, BLK)
        build_ms = (time.time() - t0) * 1e3
        bmask = create_block_mask(c["mask_mod"], None, None, S, S, device="cuda", BLOCK_SIZE=BLK)
        ref = flex(qt, kt, vt, block_mask=bmask).transpose(1, 2)
        ours = dt.blocksparse_attention(q, k, v, layout=layout, **c["kw"])
        err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
        for system, off in (("dualattn-blocksparse", {}),
                            ("dualattn-blocksparse-portable", dict(DUALATTN_GLUON_FWD="0", DUALATTN_ONE_PASS="0"))):
            with switches.override(**off):
                with torch.no_grad():
                    record(name, system, "fwd",
                           _bench(lambda: dt.blocksparse_attention(q, k, v, layout=layout, **c["kw"])), c["pairs"],
                           err if not off else None, f"layout density {layout.density:.3f}, built in {build_ms:.0f} ms")
                record(name, system, "fwdbwd",
                       _bench(lambda: torch.autograd.grad(dt.blocksparse_attention(q, k, v, layout=layout, **c["kw"]),
                                                          (q, k, v), do)), c["pairs"])
        if c.get("dense", True):
            with torch.no_grad():
                record(name, "dualattn-flash", "fwd", _bench(lambda: dt.flash_attention(q, k, v, **c["kw"])),
                       c["pairs"])
            record(name, "dualattn-flash", "fwdbwd",
                   _bench(lambda: torch.autograd.grad(dt.flash_attention(q, k, v, **c["kw"]), (q, k, v), do)),
                   c["pairs"])
        with torch.no_grad():
            record(name, "flex", "fwd", _bench(lambda: flex(qt, kt, vt, block_mask=bmask)), c["pairs"])
        record(name, "flex", "fwdbwd",
               _bench(lambda: torch.autograd.grad(flex(qt, kt, vt, block_mask=bmask), (qt, kt, vt),
                                                  do.transpose(1, 2))), c["pairs"])
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), B=1, H=H, S=S, D=D, block=BLK)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
