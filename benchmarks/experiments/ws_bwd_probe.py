"""Does Triton's warp specialisation pay for the attention backward on Hopper?  A probe.

Step 14/18's rule: Triton specialises (producer warp + consumer warpgroups, setmaxnreg) one
`tl.range(..., warp_specialize=True)` loop with 4 warps, all loads by TMA descriptor, stores
after it by descriptor.  These are our two backward passes cut to that shape (non-causal, no
masks, S a multiple of the tiles): dK/dV (a program per key tile, looping over query tiles) and
dQ (a program per query tile, looping over key tiles), with and without `warp_specialize`.

    python benchmarks/experiments/ws_bwd_probe.py                     (GPU; prints TFLOP/s)
    python benchmarks/experiments/ws_bwd_probe.py --compile-table     (no GPU; sm_90 compile + ptxas -v)
    python benchmarks/experiments/ws_bwd_probe.py --interpret-check   (no GPU; vs a float64 reference)
"""
import itertools
import os
import re
import subprocess
import sys
import tempfile

if "--interpret-check" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
import torch
import triton
import triton.language as tl

from ws_probe import head_offsets, head_rows  # run as a script: this folder is on sys.path

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def row_vec(X, bh, seqlen, BLOCK: tl.constexpr):
    """1-D TMA descriptor over head bh's fp32 (B, H, S) lse/delta row."""
    return tl.make_tensor_descriptor(X + bh.to(tl.int64) * seqlen, shape=[seqlen], strides=[1], block_shape=[BLOCK])


@triton.jit
def probe_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, seqlen, heads, sm_scale,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr):
    # Key-major: one program per key tile of one head; LSE (natural log) and DELTA are (B, H, S).
    n0 = tl.program_id(0) * BN
    bh = tl.program_id(1)
    base, stride = head_offsets(bh, heads, seqlen, D)
    kd, vd = head_rows(K, base, seqlen, stride, BN, D), head_rows(V, base, seqlen, stride, BN, D)
    qd, dod = head_rows(Q, base, seqlen, stride, BM, D), head_rows(DO, base, seqlen, stride, BM, D)
    ld, dd = row_vec(LSE, bh, seqlen, BM), row_vec(DELTA, bh, seqlen, BM)
    k, v = kd.load([n0, 0]), vd.load([n0, 0])
    c = sm_scale * LOG2E
    dk, dv = tl.zeros([BN, D], tl.float32), tl.zeros([BN, D], tl.float32)
    for start in tl.range(0, seqlen, BM, warp_specialize=WS):
        q, do = qd.load([start, 0]), dod.load([start, 0])
        p_t = tl.math.exp2(tl.dot(k, q.T) * c - (ld.load([start]) * LOG2E)[None, :])  # [BN, BM]
        dv = tl.dot(p_t.to(q.dtype), do, dv)
        dp_t = tl.dot(v, do.T)
        ds_t = (p_t * (dp_t - dd.load([start])[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
    head_rows(DK, base, seqlen, stride, BN, D).store([n0, 0], (dk * sm_scale).to(DK.dtype.element_ty))
    head_rows(DV, base, seqlen, stride, BN, D).store([n0, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def probe_dq(Q, K, V, DO, LSE, DELTA, DQ, seqlen, heads, sm_scale,
             D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr):
    # Query-major: one program per query tile of one head.
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    base, stride = head_offsets(bh, heads, seqlen, D)
    kd, vd = head_rows(K, base, seqlen, stride, BN, D), head_rows(V, base, seqlen, stride, BN, D)
    q = head_rows(Q, base, seqlen, stride, BM, D).load([m0, 0])
    do = head_rows(DO, base, seqlen, stride, BM, D).load([m0, 0])
    lse2 = row_vec(LSE, bh, seqlen, BM).load([m0]) * LOG2E
    delta = row_vec(DELTA, bh, seqlen, BM).load([m0])
    c = sm_scale * LOG2E
    dq = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, seqlen, BN, warp_specialize=WS):
        k = kd.load([start, 0])
        p = tl.math.exp2(tl.dot(q, k.T) * c - lse2[:, None])  # [BM, BN]
        dp = tl.dot(do, vd.load([start, 0]).T)
        ds = (p * (dp - delta[:, None])).to(q.dtype)
        dq = tl.dot(ds, k, dq)
    head_rows(DQ, base, seqlen, stride, BM, D).store([m0, 0], (dq * sm_scale).to(DQ.dtype.element_ty))


def launch(kernel, q, k, v, do, lse, delta, outs, bm, bn, ws, warps, stages):
    b, s, h, d = q.shape
    grid = (s // (bn if kernel is probe_dkdv else bm), b * h)
    kernel[grid](q, k, v, do, lse, delta, *outs, s, h, d ** -0.5, D=d, BM=bm, BN=bn, WS=ws,
                 num_warps=warps, num_stages=stages)


def compile_table():
    """Compile both probes for sm_90 with the installed Triton; specialised? registers, spills."""
    from triton.backends.compiler import GPUTarget
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    div16 = [["tt.divisibility", 16]]
    print(f"triton {triton.__version__}\nkernel  D   BM  BN  warps st ws  -> spec  nw regs spill(st/ld B) smem KB",
          flush=True)
    for kernel, d, bm, bn, st, (warps, ws) in itertools.product(
            (probe_dkdv, probe_dq), (128, 64), (64, 128), (64, 128), (2, 3), ((4, True), (4, False), (8, False))):
        n_ptr = 8 if kernel is probe_dkdv else 7
        sig = {name: ("*fp32" if name in ("LSE", "DELTA") else "*bf16") for name in kernel.arg_names[:n_ptr]}
        sig.update(seqlen="i32", heads="i32", sm_scale="fp32", **dict.fromkeys(("D", "BM", "BN", "WS"), "constexpr"))
        attrs = {(i,): div16 for i in range(n_ptr + 2)}  # as torch's launcher: pointers, seqlen and heads % 16
        src = triton.compiler.ASTSource(kernel, sig, dict(D=d, BM=bm, BN=bn, WS=ws), attrs)
        tag = f"{kernel.__name__[6:]:5s} {d:3d} {bm:3d} {bn:3d} {warps:5d} {st:2d} {str(ws)[0]:2s}"
        try:
            ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=st))
            ptx = ck.asm["ptx"]
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                f.write(ptx), f.flush()
                log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                     capture_output=True, text=True).stderr
            regs, = re.search(r"Used (\d+) registers", log).groups()
            spill = "/".join(re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups())
            # Specialised: both consumer partitions get the same ops, on their own 64 rows of a 128-row
            # tile ("split") or on the same 64 rows ("dup": redundant work, each stores the whole tile).
            noise = r"%arg\d+|async_task_id = array<i32: \d+>|loc\([^)]*\)|#loc\d*"  # differs between copies
            parts = {re.sub(noise, "", p.split("warp_return")[0])
                     for p in re.split(r"\n    partition\d+\(", ck.asm["ttgir"])[1:]}
            spec = ("dup" if len(parts) == 1 else "split") if "setmaxnreg" in ptx else "no"
            print(f"{tag} -> {spec:5s} {ck.metadata.num_warps:2d} {regs:>4s} {spill:>10s} "
                  f"{ck.metadata.shared / 1024:6.0f}", flush=True)
        except Exception as e:  # a crash of a compiler pass is a result
            print(f"{tag} -> FAILED {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:90]}", flush=True)


def reference_bwd(q, k, v, do):
    """float64 attention backward over BSHD tensors: (dq, dk, dv, lse, delta)."""
    q, k, v, do = (t.double().transpose(1, 2) for t in (q, k, v, do))
    scale = q.shape[-1] ** -0.5
    s = q @ k.transpose(-1, -2) * scale
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    delta = (do * (p @ v)).sum(-1)
    ds = p * (do @ v.transpose(-1, -2) - delta[..., None])
    grads = (ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do)
    return [g.transpose(1, 2) for g in grads] + [lse.float(), delta.float()]


def rel(a, r):
    return ((a.double() - r.double()).norm() / r.double().norm()).item()


def interpret_check():
    """Both probes under TRITON_INTERPRET (CPU; fp16: bf16 descriptor loads come out as garbage there)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, 256, 2, 64, dtype=torch.float16) for _ in range(4))
    dq_r, dk_r, dv_r, lse, delta = reference_bwd(q, k, v, do)
    for (bm, bn), ws in itertools.product(((64, 128), (128, 64), (64, 64)), (False, True)):
        dq, dk, dv = (torch.full_like(q, float("nan")) for _ in range(3))
        launch(probe_dkdv, q, k, v, do, lse, delta, (dk, dv), bm, bn, ws, 4, 2)
        launch(probe_dq, q, k, v, do, lse, delta, (dq,), bm, bn, ws, 4, 2)
        errs = [rel(a, r) for a, r in ((dq, dq_r), (dk, dk_r), (dv, dv_r))]
        print(f"interpret {bm}x{bn} ws={ws}: rel err dq/dk/dv " + "/".join(f"{e:.1e}" for e in errs)
              + ("" if all(e <= 2e-2 for e in errs) else "  BAD"), flush=True)


# (BM, BN, warps, stages, WS) per (kernel, D), from --compile-table (Triton 3.6/3.7, sm_90): the first two
# are unspecialised references (dualattn's tuned tile in plan.TUNED, then an 8-warp tile), then the
# specialised tiles whose own tile (dK/dV: BN, dQ: BM) is 128 rows, split 64/64 over the two consumer
# warpgroups; at D=128 the last is a 64-row control, where both consumers do the same work ("dup").
CONFIGS = {
    ("dkdv", 128): ((32, 64, 4, 4, 0), (64, 128, 8, 2, 0), (64, 128, 4, 2, 1), (64, 128, 4, 3, 1), (128, 128, 4, 2, 1),
                    (64, 64, 4, 2, 1)),
    ("dkdv", 64): ((32, 128, 4, 3, 0), (64, 128, 8, 2, 0), (64, 128, 4, 2, 1), (64, 128, 4, 3, 1), (128, 128, 4, 2, 1),
                   (128, 128, 4, 3, 1)),
    ("dq", 128): ((128, 64, 8, 3, 0), (128, 128, 8, 2, 0), (128, 64, 4, 2, 1), (128, 64, 4, 3, 1), (128, 128, 4, 2, 1),
                  (64, 64, 4, 2, 1)),
    ("dq", 64): ((64, 64, 4, 3, 0), (128, 64, 8, 3, 0), (128, 64, 4, 2, 1), (128, 64, 4, 3, 1), (128, 128, 4, 2, 1),
                 (128, 128, 4, 3, 1)),
}


def main():
    import dualattn.torch_api as dt
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for d, h in ((128, 16), (64, 32)):
        for s in (4096, 8192):
            b = 16384 // s
            q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            out, lse = dt.flash_attention(q, k, v, return_lse=True)
            ref = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
            ms = triton.testing.do_bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                                         warmup=25, rep=100, return_mode="median")
            gemm = 2 * b * h * s * s * d  # FLOPs of one S x S x D GEMM; the forward is 2, the backward 2.5x that
            print(f"d={d} s={s} dualattn backward (two passes): {5 * gemm / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms)",
                  flush=True)
            lse = lse.detach().float().contiguous()
            delta = (out.detach().float() * do.float()).sum(-1).transpose(1, 2).contiguous()
            q, k, v = (t.detach() for t in (q, k, v))
            best = {}
            for name, kernel, n_gemm in (("dkdv", probe_dkdv, 4), ("dq", probe_dq, 3)):
                for bm, bn, warps, stages, ws in CONFIGS[name, d]:
                    outs = tuple(torch.full_like(q, float("nan")) for _ in range(2 if name == "dkdv" else 1))
                    refs = ref[1:] if name == "dkdv" else ref[:1]
                    tag, ws = f"  {name:4s} {bm}x{bn} warps={warps} stages={stages} ws={bool(ws)}", bool(ws)
                    try:
                        def run():
                            launch(kernel, q, k, v, do, lse, delta, outs, bm, bn, ws, warps, stages)
                        run()
                        errs = [rel(a.float(), r.float()) for a, r in zip(outs, refs)]
                        ok = all(e <= 2e-2 for e in errs)
                        ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                        if ok:
                            best[name] = min(best.get(name, (ms, tag)), (ms, tag))
                        print(f"{tag}: {n_gemm * gemm / ms / 1e9:.0f} TFLOP/s ({ms:.3f} ms; rel err vs dualattn "
                              + "/".join(f"{e:.1e}" for e in errs) + ("" if ok else " BAD") + ")", flush=True)
                    except Exception as e:  # a tile that does not fit, or a compiler failure, is reported
                        print(f"{tag}: failed {str(e)[:100]!r}", flush=True)
            if len(best) == 2:  # the fastest correct dK/dV and dQ together, without the delta pass
                ms = best["dkdv"][0] + best["dq"][0]
                print(f"  best pair: {5 * gemm / ms / 1e9:.0f} TFLOP/s at 2.5x forward FLOPs ({ms:.3f} ms): "
                      f"{best['dkdv'][1].strip()} + {best['dq'][1].strip()}", flush=True)


if __name__ == "__main__":
    {"--compile-table": compile_table, "--interpret-check": interpret_check}.get(sys.argv[-1], main)()
