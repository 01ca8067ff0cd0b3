"""Does a one-pass backward with dQ reduced by TMA pay on Hopper?  A probe, not a library kernel.

dualattn's backward runs two passes (dK/dV, then dQ): 7 GEMMs per tile pair where FA2/FA3 run
5 by adding each key tile's dS K into an fp32 dQ.  NOTES step 9 built that with `tl.atomic_add`
and lost: Triton 3.6 emits one scalar `atom.global.add.f32` per element.  A tensor
descriptor's `atomic_add` lowers instead to one bulk `cp.reduce.async.bulk.tensor` per tile
(what FA3 does), issued from shared memory.  This times the smallest one-pass backward
(non-causal, no masks, S a multiple of the tiles) with that reduction, and with the pointer
atomics, next to dualattn's backward on the same inputs.

    python benchmarks/experiments/fused_bwd_probe.py      (writes nothing; prints TFLOP/s)
"""
import sys

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

import dualattn.torch_api as dt
from ws_probe import head_offsets, head_rows  # run as a script: this folder is on sys.path

LOG2E = tl.constexpr(1.4426950408889634)


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton.jit
def probe_bwd(Q, K, V, DO, LSE, DELTA, DQ_ACC, DK, DV, seqlen, heads, sm_scale,
              D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, TMA_REDUCE: tl.constexpr):
    # BSHD, contiguous: rows of one head are heads * D apart; LSE/DELTA are (B, H, S).
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    base, stride = head_offsets(bh, heads, seqlen, D)
    kd, vd = head_rows(K, base, seqlen, stride, BN, D), head_rows(V, base, seqlen, stride, BN, D)
    qd, dod = head_rows(Q, base, seqlen, stride, BM, D), head_rows(DO, base, seqlen, stride, BM, D)
    dqd = head_rows(DQ_ACC, base, seqlen, stride, BM, D)
    n0 = pid_n * BN
    k = kd.load([n0, 0])
    v = vd.load([n0, 0])
    c = sm_scale * LOG2E
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    row = bh.to(tl.int64) * seqlen
    offs_d = tl.arange(0, D)
    for start in range(0, seqlen, BM):
        offs_m = start + tl.arange(0, BM)
        q = qd.load([start, 0])
        do = dod.load([start, 0])
        lse2 = tl.load(LSE + row + offs_m) * LOG2E
        delta = tl.load(DELTA + row + offs_m)
        p_t = tl.math.exp2(tl.dot(k, q.T) * c - lse2[None, :])  # [BN, BM]
        dp_t = tl.dot(v, do.T)
        dv = tl.dot(p_t.to(tl.bfloat16), do, dv)
        ds_t = (p_t * (dp_t - delta[None, :])).to(tl.bfloat16)
        dk = tl.dot(ds_t, q, dk)
        dq = tl.dot(ds_t.T, k)  # [BM, D], this key tile's share
        if TMA_REDUCE:
            dqd.atomic_add([start, 0], dq)
        else:
            tl.atomic_add(DQ_ACC + base + offs_m[:, None] * stride + offs_d[None, :], dq, sem="relaxed")
    offs_n = n0 + tl.arange(0, BN)
    out = base + offs_n[:, None] * stride + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(tl.bfloat16))
    tl.store(DV + out, dv.to(tl.bfloat16))


# (BM, BN, warps, stages); offline ptxas (sm_90, D=128): 255 registers with <= 164 B of spills, except
# 32x64 (244, none).  32x128/4, 64x128/4 and 128x128/8 spilled 0.9-2.2 KB and are left out.
TILES = ((64, 128, 8, 2), (64, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 3))


def main():
    triton.set_allocator(_scratch)
    shapes = [(128, 16), (64, 32)] if len(sys.argv) < 2 else [(int(sys.argv[1]), 2048 // int(sys.argv[1]))]
    for d, h in shapes:
        for s in (8192,):
            b = 16384 // s
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            flops = 2.5 * 4 * b * h * s * s * d
            out, lse = dt.flash_attention(q, k, v, return_lse=True)
            ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=25, rep=200, return_mode="median")
            print(f"d={d} s={s} dualattn backward (two passes): {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o_cudnn = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
            do_t = do.transpose(1, 2)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(o_cudnn, (qt, kt, vt), do_t, retain_graph=True),
                                         warmup=25, rep=200, return_mode="median")
            print(f"d={d} s={s} SDPA cuDNN backward: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            lse = lse.detach().contiguous()
            delta = (out.detach().float() * do.float()).sum(-1).transpose(1, 2).contiguous()
            scale = d ** -0.5
            for tma in (True, False):
                for bm, bn, warps, stages in TILES:
                    dq_acc = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
                    dk, dv = torch.empty_like(k), torch.empty_like(v)

                    def run():
                        dq_acc.zero_()
                        probe_bwd[(s // bn, b * h)](q, k, v, do, lse, delta, dq_acc, dk, dv, s, h, scale,
                                                    D=d, BM=bm, BN=bn, TMA_REDUCE=tma,
                                                    num_warps=warps, num_stages=stages)
                        return (dq_acc * scale).to(torch.bfloat16)
                    try:
                        dq = run()
                        errs = [((a.float() - r.float()).norm() / r.float().norm()).item()
                                for a, r in zip((dq, dk, dv), ref)]
                        ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                        print(f"  one pass {bm}x{bn} warps={warps} stages={stages} tma_reduce={tma}: "
                              f"{flops / ms / 1e9:.0f} TFLOP/s (rel err dq/dk/dv vs dualattn "
                              + "/".join(f"{e:.1e}" for e in errs) + ")", flush=True)
                    except Exception as e:  # a tile that does not fit, or a compiler failure, is reported
                        print(f"  one pass {bm}x{bn} warps={warps} stages={stages} tma_reduce={tma}: "
                              f"failed {str(e)[:100]!r}", flush=True)


if __name__ == "__main__":
    main()
