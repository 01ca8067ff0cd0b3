"""The Gluon forward (dualattn/kernels/flash/forward_gluon.py) launched directly, outside the plan:
its error against float32 SDPA math on random inputs, and its kernel time next to dualattn's Triton
forward and SDPA cuDNN on the same inputs.  16k tokens, bf16, H100.

    python benchmarks/experiments/gluon_fwd_bench.py [--shapes 128:4096,64:4096] [--causal both] [--variants 128:2:1]
"""
import argparse
import math

import torch
import triton

from dualattn.kernels.flash.forward_gluon import flash_fwd_gluon_kernel
from dualattn.torch_api import _launch, flash_attention


def gluon_forward(q, k, v, causal, block_n=128, stages=2, programs=None, even_k=True):
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, sq, device=q.device, dtype=torch.float32)
    n_q_tiles = triton.cdiv(sq, 128)
    n_work = b * hq * (triton.cdiv(n_q_tiles, 2) if causal else n_q_tiles)  # causal: pairs of query tiles
    programs = programs or min(n_work, torch.cuda.get_device_properties(0).multi_processor_count)
    _launch._ensure_scratch_allocator()
    flash_fwd_gluon_kernel[(programs,)](
        q, k, v, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], lse.stride(0), lse.stride(1),
        b, sq, sk, hq, sk - sq, n_work, 1.0 / math.sqrt(d), out, lse, lse,
        HEAD_DIM=d, BLOCK_M=128, BLOCK_N=block_n, STAGES=stages, GROUP_SIZE=hq // hkv, CAUSAL=causal,
        EVEN_K=even_k and sk % block_n == 0, num_warps=4)
    return out, lse


def reference(q, k, v, causal):
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    if kf.shape[1] != qf.shape[1]:
        kf = kf.repeat_interleave(qf.shape[1] // kf.shape[1], 1)
        vf = vf.repeat_interleave(qf.shape[1] // vf.shape[1], 1)
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        keep = torch.arange(sk, device=q.device)[None, :] <= torch.arange(sq, device=q.device)[:, None] + (sk - sq)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return (p @ vf).transpose(1, 2), lse


def check(b, sq, sk, hq, hkv, d, causal, **kw):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    out, lse = gluon_forward(q, k, v, causal, **kw)
    ref_out, ref_lse = reference(q, k, v, causal)
    err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
    finite = torch.isfinite(ref_lse)
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item()
    lse_inf_ok = bool((lse[~finite] == float("-inf")).all()) and bool((out.float()[~finite.transpose(1, 2)] == 0).all())
    ok = err < 1e-2 and lse_err < 1e-2 and lse_inf_ok and bool(torch.isfinite(out).all())
    print(f"check b={b} sq={sq} sk={sk} hq={hq} hkv={hkv} d={d} causal={causal} {kw}: out rel err {err:.2e}, "
          f"lse max err {lse_err:.2e}, empty rows ok {lse_inf_ok} -> {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="128:1024,128:4096,128:16384,64:1024,64:4096,64:16384")
    ap.add_argument("--causal", default="both")
    ap.add_argument("--variants", default="128:2:1",
                    help="block_n:stages:even_k (0: the key bound stays in the mask), comma separated")
    ap.add_argument("--checks", type=int, default=1)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if args.checks:
        cases = [(2, 1024, 1024, 4, 4, 128, False), (2, 1024, 1024, 4, 4, 128, True), (1, 2048, 2048, 8, 2, 64, True),
                 (2, 1000, 1100, 4, 2, 128, False), (1, 1000, 1000, 2, 2, 64, True), (1, 1300, 1000, 2, 1, 128, True),
                 (1, 512, 1300, 2, 2, 64, True)]
        results = [check(*c) for c in cases] + [check(2, 1024, 1024, 4, 4, 128, True, programs=7),
                                                check(1, 896, 896, 2, 2, 128, True, programs=3)]
        print(f"checks: {sum(results)}/{len(results)} OK", flush=True)
    causals = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    variants = [tuple(int(x) for x in v.split(":")) for v in args.variants.split(",")]
    print("D      S  causal | variant (block_n, stages): gluon ms TFLOP/s | triton ms TFLOP/s | "
          "cudnn ms TFLOP/s | gluon/cudnn gluon/triton")
    for item in args.shapes.split(","):
        d, s = (int(x) for x in item.split(":"))
        h = 2048 // d
        b = 16384 // s
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        for causal in causals:
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            t_triton = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=causal), rep=200)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                t_cudnn = triton.testing.do_bench(
                    lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal), rep=200)
            for bn, stages, even_k in variants:
                t_gluon = triton.testing.do_bench(
                    lambda: gluon_forward(q, k, v, causal, block_n=bn, stages=stages, even_k=bool(even_k)), rep=200)
                tf = [flops / t / 1e9 for t in (t_gluon, t_triton, t_cudnn)]
                print(f"{d:<3} {s:6} {str(causal):>6} | {bn:3} {stages} {even_k}: {t_gluon:7.3f} {tf[0]:6.1f} | "
                      f"{t_triton:7.3f} {tf[1]:6.1f} | {t_cudnn:7.3f} {tf[2]:6.1f} | {t_cudnn / t_gluon:5.2f} "
                      f"{t_triton / t_gluon:5.2f}", flush=True)


if __name__ == "__main__":
    main()
