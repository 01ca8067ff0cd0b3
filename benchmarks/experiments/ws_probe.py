"""Does Triton's warp specialisation pay on Hopper?  A probe, not a library kernel.

Triton 3.6 warp-specialises (producer warp + consumer warpgroup, setmaxnreg) only a kernel's
single TMA-descriptor loop with 4 warps: compiled offline for sm_90, a second loop in the same
kernel crashes the NVGPUWarpSpecialization pass, and 8 warps compile unspecialised.  The
dualattn kernels run up to three loops (masked edge, interior, masked edge), so before
restructuring them this times the smallest attention forward that qualifies (non-causal,
no masks, S a multiple of the tiles) with and without `warp_specialize`, next to dualattn's
forward on the same inputs.

    python benchmarks/experiments/ws_probe.py      (writes nothing; prints TFLOP/s)
"""
import torch
import triton
import triton.language as tl

import dualattn.torch_api as dt


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


@triton.jit
def head_offsets(bh, heads, seqlen, D: tl.constexpr):
    """(element offset of head bh's first row, row stride) in a contiguous BSHD array (also used by
    fused_bwd_probe.py)."""
    return (bh // heads).to(tl.int64) * seqlen * heads * D + (bh % heads) * D, heads * D


@triton.jit
def head_rows(X, base, seqlen, stride, BLOCK: tl.constexpr, D: tl.constexpr):
    """TMA descriptor over one head's [seqlen, D] rows (also used by fused_bwd_probe.py)."""
    return tl.make_tensor_descriptor(X + base, shape=[seqlen, D], strides=[stride, 1], block_shape=[BLOCK, D])


@triton.jit
def probe_fwd(Q, K, V, O, seqlen, heads, sm_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              WS: tl.constexpr):
    # BSHD, contiguous: rows of one head are heads * D apart.
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base, stride = head_offsets(bh, heads, seqlen, D)
    qd, kd = head_rows(Q, base, seqlen, stride, BM, D), head_rows(K, base, seqlen, stride, BN, D)
    vd, od = head_rows(V, base, seqlen, stride, BN, D), head_rows(O, base, seqlen, stride, BM, D)
    q = qd.load([pid_m * BM, 0])
    c = sm_scale * 1.4426950408889634
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for start in tl.range(0, seqlen, BN, warp_specialize=WS):
        qk = tl.dot(q, kd.load([start, 0]).T)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
        p = tl.math.exp2(qk * c - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), vd.load([start, 0]), acc * alpha[:, None])
        m_i = m_new
    od.store([pid_m * BM, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def main():
    triton.set_allocator(_scratch)
    for d, h in ((128, 16), (64, 32)):
        for s in (4096, 8192):
            b = 16384 // s
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * h * s * s * d
            ref = dt.flash_attention(q, k, v)
            ms = triton.testing.do_bench(lambda: dt.flash_attention(q, k, v), warmup=25, rep=200, return_mode="median")
            print(f"d={d} s={s} dualattn fwd: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for bm, bn, warps, stages, ws in ((128, 64, 4, 2, False), (128, 64, 4, 2, True), (128, 64, 4, 3, True),
                                              (128, 128, 4, 2, True), (128, 128, 8, 3, False),
                                              (128, 64, 8, 3, False)):
                o = torch.empty_like(q)

                def run():
                    probe_fwd[(s // bm, b * h)](q, k, v, o, s, h, d ** -0.5, D=d, BM=bm, BN=bn, WS=ws,
                                                num_warps=warps, num_stages=stages)
                try:
                    run()
                    err = ((o.float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
                    print(f"  probe {bm}x{bn} warps={warps} stages={stages} ws={ws}: {flops / ms / 1e9:.0f} TFLOP/s "
                          f"(rel err {err:.1e})", flush=True)
                except Exception as e:  # a tile that does not fit, or a compiler failure, is reported
                    print(f"  probe {bm}x{bn} warps={warps} stages={stages} ws={ws}: failed {str(e)[:100]!r}",
                          flush=True)


if __name__ == "__main__":
    main()
