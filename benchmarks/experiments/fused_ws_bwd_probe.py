"""Does a one-pass backward pay once Triton warp-specialises it?  A probe, not a library kernel.

The two-pass backward (dK/dV, then dQ) runs 7 GEMMs per (query tile, key tile) pair where a
one-pass backward runs 5, adding each key tile's dS K into an fp32 dQ.  Step 16 timed that pass
without warp specialisation: +3% (D=128) and +6% (D=64) over the then two passes, register-bound.
Step 20 then made the two passes warp-specialised (+14-16% at D=128), but not at D=64, where the
backward is now furthest behind cuDNN (sweep13: ~0.77x, backward alone).  With specialisation the
consumer warpgroups get 232 registers (setmaxnreg); at D=64 dK, dV, the dQ share, S and dP fit.
Open question: can Triton's data partitioning split a 128-key program over two consumer
warpgroups when the dQ share contracts over those very keys?  The compile table says.

    python benchmarks/experiments/fused_ws_bwd_probe.py                   (GPU; prints TFLOP/s)
    python benchmarks/experiments/fused_ws_bwd_probe.py --compile-table   (no GPU; sm_90 + ptxas -v)

The timed one-pass figure includes zeroing the fp32 dQ and converting it to bf16 (torch ops), which
a library kernel would also pay.  Non-causal, no masks, S a multiple of the tiles.
"""
import itertools
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from ws_probe import head_offsets, head_rows  # run as a script: this folder is on sys.path

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def probe_fused(Q, K, V, DO, LSE, DELTA, DQ_ACC, DK, DV, seqlen, heads, sm_scale,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr):
    # BSHD contiguous; LSE/DELTA (B, H, S) fp32; DQ_ACC like Q but fp32 and zeroed.
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    base, stride = head_offsets(bh, heads, seqlen, D)
    qd, dod = head_rows(Q, base, seqlen, stride, BM, D), head_rows(DO, base, seqlen, stride, BM, D)
    kd, vd = head_rows(K, base, seqlen, stride, BN, D), head_rows(V, base, seqlen, stride, BN, D)
    dqd = head_rows(DQ_ACC, base, seqlen, stride, BM, D)
    row = bh.to(tl.int64) * seqlen
    lsed = tl.make_tensor_descriptor(LSE + row, shape=[seqlen], strides=[1], block_shape=[BM])
    deltad = tl.make_tensor_descriptor(DELTA + row, shape=[seqlen], strides=[1], block_shape=[BM])
    n0 = pid_n * BN
    k = kd.load([n0, 0])
    v = vd.load([n0, 0])
    c = sm_scale * LOG2E
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    for start in tl.range(0, seqlen, BM, warp_specialize=WS):
        q = qd.load([start, 0])
        do = dod.load([start, 0])
        lse2 = lsed.load([start]) * LOG2E
        delta = deltad.load([start])
        p_t = tl.math.exp2(tl.dot(k, q.T) * c - lse2[None, :])  # [BN, BM]
        dp_t = tl.dot(v, do.T)
        dv = tl.dot(p_t.to(tl.bfloat16), do, dv)
        ds_t = (p_t * (dp_t - delta[None, :])).to(tl.bfloat16)
        dk = tl.dot(ds_t, q, dk)
        dqd.atomic_add([start, 0], tl.dot(ds_t.T, k))  # this key tile's share: one bulk reduce
    head_rows(DK, base, seqlen, stride, BN, D).store([n0, 0], (dk * sm_scale).to(tl.bfloat16))
    head_rows(DV, base, seqlen, stride, BN, D).store([n0, 0], dv.to(tl.bfloat16))


# (D, BM, BN, warps, stages, WS): unspecialised references first (step 16's best tiles), then
# specialised tiles; a 128-key program splits its keys over two consumer warpgroups.
CONFIGS = ((64, 64, 64, 4, 3, False), (64, 64, 128, 8, 2, False),
           (64, 64, 128, 4, 2, True), (64, 64, 128, 4, 3, True), (64, 128, 128, 4, 2, True),
           (64, 32, 128, 4, 3, True), (64, 64, 64, 4, 3, True),
           (128, 64, 128, 8, 2, False), (128, 64, 128, 4, 2, True), (128, 32, 128, 4, 3, True))


def compile_table():
    """Compile each config for sm_90 with the installed Triton: specialised?  registers, spills."""
    from triton.backends.compiler import GPUTarget
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    div16 = [["tt.divisibility", 16]]
    print(f"triton {triton.__version__}\n  D  BM  BN warps st ws -> spec nw regs spill(st/ld B) smem KB", flush=True)
    for d, bm, bn, warps, st, ws in CONFIGS:
        sig = {name: ("*fp32" if name in ("LSE", "DELTA", "DQ_ACC") else "*bf16") for name in probe_fused.arg_names[:9]}
        sig.update(seqlen="i32", heads="i32", sm_scale="fp32", **dict.fromkeys(("D", "BM", "BN", "WS"), "constexpr"))
        attrs = {(i,): div16 for i in range(11)}
        src = triton.compiler.ASTSource(probe_fused, sig, dict(D=d, BM=bm, BN=bn, WS=ws), attrs)
        tag = f"{d:3d} {bm:3d} {bn:3d} {warps:5d} {st:2d} {str(ws)[0]:2s}"
        try:
            ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=st))
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ck.asm["ptx"]), f.flush()
                log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                     capture_output=True, text=True).stderr
            regs, = re.search(r"Used (\d+) registers", log).groups()
            spill = "/".join(re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
            spec = "yes" if "setmaxnreg" in ck.asm["ptx"] else "no"
            reduces = ck.asm["ptx"].count("cp.reduce.async.bulk.tensor")
            print(f"{tag} -> {spec:4s} {ck.metadata.num_warps:2d} {regs:>4s} {spill:>10s} "
                  f"{ck.metadata.shared / 1024:6.0f}  bulk reduces in PTX: {reduces}", flush=True)
        except Exception as e:  # a crash of a compiler pass is a result
            print(f"{tag} -> FAILED {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:100]}", flush=True)


def main():
    import dualattn.torch_api as dt
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for d, h in ((64, 32), (128, 16)):
        for s in (4096, 16384):
            b = 16384 // s
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            gemm = 2 * b * h * s * s * d  # one S x S x D GEMM; the backward is counted as 5 of them
            out, lse = dt.flash_attention(q, k, v, return_lse=True)
            ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=25, rep=200, return_mode="median")
            print(f"d={d} s={s} dualattn backward (two passes): {5 * gemm / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)",
                  flush=True)
            qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o_cudnn = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
            ms = triton.testing.do_bench(
                lambda: torch.autograd.grad(o_cudnn, (qt, kt, vt), do.transpose(1, 2), retain_graph=True),
                warmup=25, rep=200, return_mode="median")
            print(f"d={d} s={s} SDPA cuDNN backward: {5 * gemm / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)", flush=True)
            lse = lse.detach().float().contiguous()
            delta = (out.detach().float() * do.float()).sum(-1).transpose(1, 2).contiguous()
            q, k, v = (t.detach() for t in (q, k, v))
            for cd, bm, bn, warps, stages, ws in CONFIGS:
                if cd != d:
                    continue
                tag = f"  one pass {bm}x{bn} warps={warps} stages={stages} ws={ws}"
                dq_acc = torch.empty(q.shape, device="cuda", dtype=torch.float32)
                dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))

                def run():
                    dq_acc.zero_()
                    probe_fused[(s // bn, b * h)](q, k, v, do, lse, delta, dq_acc, dk, dv, s, h, d ** -0.5,
                                                  D=d, BM=bm, BN=bn, WS=ws, num_warps=warps, num_stages=stages)
                    return (dq_acc * d ** -0.5).to(torch.bfloat16)
                try:
                    dq = run()
                    errs = [((a.float() - r.float()).norm() / r.float().norm()).item() for a, r in zip((dq, dk, dv), ref)]
                    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                    print(f"{tag}: {5 * gemm / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms; rel err dq/dk/dv vs dualattn "
                          + "/".join(f"{e:.1e}" for e in errs) + ("" if max(errs) < 2e-2 else " BAD") + ")", flush=True)
                except Exception as e:  # a tile that does not fit, or a compiler failure, is reported
                    print(f"{tag}: failed {str(e)[:100]!r}", flush=True)


if __name__ == "__main__":
    {"--compile-table": compile_table}.get(sys.argv[-1], main)()
