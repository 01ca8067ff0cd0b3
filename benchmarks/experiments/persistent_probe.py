"""Does a persistent forward pay on Hopper with Triton?  A probe, not a library kernel.

Issue 5 lists persistent scheduling among Hopper's tools.  FA3's gain from it comes from
overlap: while the consumer warpgroups finish one tile (normalise, store O), the producer
already loads the next tile's q, k, v.  Triton can only give that overlap if it warp-specialises
the *outer* (tile) loop; a persistent kernel whose inner loop alone is specialised only saves
the CTA launches.  This times, on the smallest forward that qualifies (no masks but an optional
causal band masked on every tile in the loop, S a multiple of the tiles, BSHD contiguous):

  grid      one program per (query tile, head), heaviest (last) query tiles first
  persist   min(tiles, programs_per_sm * SMs) programs striding over the same tile order
            (longest first: a greedy LPT schedule for causal)
with warp specialisation on the inner (key) loop, on the outer (tile) loop, or off.

    python benchmarks/experiments/persistent_probe.py                   (GPU; prints TFLOP/s)
    python benchmarks/experiments/persistent_probe.py --compile-table   (no GPU; sm_90: specialised? regs)
    python benchmarks/experiments/persistent_probe.py --interpret-check (no GPU; vs a float64 reference)
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

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _attend(qd, kd, vd, od, Q, K, V, O, LSE, tile, n_m, bh_count, heads, seqlen, c, D: tl.constexpr, BM: tl.constexpr,
            BN: tl.constexpr, CAUSAL: tl.constexpr, INNER_WS: tl.constexpr, PER_TILE: tl.constexpr,
            STORE_LSE: tl.constexpr):
    # Tile order: every head's last query tile first (the longest causal rows), then the one before.
    m0 = (n_m - 1 - tile // bh_count) * BM
    bh = tile % bh_count
    if PER_TILE:
        # As the library kernel does (session 11): descriptors over this head's [S, D], built per tile.
        base = (bh // heads) * seqlen * heads * D + (bh % heads) * D
        qd = tl.make_tensor_descriptor(Q + base, shape=[seqlen, D], strides=[heads * D, 1], block_shape=[BM, D])
        kd = tl.make_tensor_descriptor(K + base, shape=[seqlen, D], strides=[heads * D, 1], block_shape=[BN, D])
        vd = tl.make_tensor_descriptor(V + base, shape=[seqlen, D], strides=[heads * D, 1], block_shape=[BN, D])
        od = tl.make_tensor_descriptor(O + base, shape=[seqlen, D], strides=[heads * D, 1], block_shape=[BM, D])
        row0 = 0
        col = 0
    else:
        row0 = (bh // heads) * seqlen  # descriptors see BSHD as [B * S, H * D]
        col = (bh % heads) * D
    q = qd.load([row0 + m0, col])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    hi = m0 + BM if CAUSAL else seqlen
    offs_m = m0 + tl.arange(0, BM)
    for start in tl.range(0, hi, BN, warp_specialize=INNER_WS):
        qk = tl.dot(q, kd.load([row0 + start, col]).T)
        if CAUSAL:
            qk = tl.where(offs_m[:, None] >= start + tl.arange(0, BN)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * c)
        p = tl.math.exp2(qk * c - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), vd.load([row0 + start, col]), acc * alpha[:, None])
        m_i = m_new
    od.store([row0 + m0, col], (acc / l_i[:, None]).to(q.dtype))
    if STORE_LSE:
        # lse through a 1-D descriptor over this head's row (as the library kernel stores it).
        ld = tl.make_tensor_descriptor(LSE + bh * seqlen, shape=[seqlen], strides=[1], block_shape=[BM])
        ld.store([m0], m_i + tl.log2(l_i))


@triton.jit
def probe_fwd(Q, K, V, O, LSE, seqlen, heads, batch, sm_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              CAUSAL: tl.constexpr, PERSISTENT: tl.constexpr, OUTER_WS: tl.constexpr, INNER_WS: tl.constexpr,
              PER_TILE: tl.constexpr = False, STORE_LSE: tl.constexpr = False):
    rows, cols = batch * seqlen, heads * D
    qd = tl.make_tensor_descriptor(Q, shape=[rows, cols], strides=[cols, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K, shape=[rows, cols], strides=[cols, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V, shape=[rows, cols], strides=[cols, 1], block_shape=[BN, D])
    od = tl.make_tensor_descriptor(O, shape=[rows, cols], strides=[cols, 1], block_shape=[BM, D])
    n_m = seqlen // BM
    c = sm_scale * LOG2E
    if PERSISTENT:
        for tile in tl.range(tl.program_id(0), n_m * batch * heads, tl.num_programs(0), warp_specialize=OUTER_WS):
            _attend(qd, kd, vd, od, Q, K, V, O, LSE, tile, n_m, batch * heads, heads, seqlen, c, D, BM, BN, CAUSAL,
                    INNER_WS, PER_TILE, STORE_LSE)
    else:
        _attend(qd, kd, vd, od, Q, K, V, O, LSE, tl.program_id(0), n_m, batch * heads, heads, seqlen, c, D, BM, BN,
                CAUSAL, INNER_WS, PER_TILE, STORE_LSE)


def launch(q, o, cfg, causal, programs, per_tile=False, store_lse=False):
    b, s, h, d = q.shape
    bm, bn, warps, stages, mode = cfg
    lse = torch.empty(b * h * s, device=q.device, dtype=torch.float32)
    persistent = mode.startswith("persist")
    tiles = (s // bm) * b * h
    grid = (min(tiles, programs) if persistent else tiles,)
    probe_fwd[grid](q, q, q, o, lse, s, h, b, d ** -0.5, D=d, BM=bm, BN=bn, CAUSAL=causal, PERSISTENT=persistent,
                    OUTER_WS=mode.endswith("outer-ws"), INNER_WS=mode.endswith("inner-ws"),
                    PER_TILE=per_tile, STORE_LSE=store_lse, num_warps=warps, num_stages=stages)


# (BM, BN, warps, stages, mode): mode = grid|persist + -inner-ws|-outer-ws|-no-ws.
MODES = ("grid-no-ws", "grid-inner-ws", "persist-no-ws", "persist-inner-ws", "persist-outer-ws")
TILES = {128: ((128, 128, 4, 2), (128, 64, 8, 3), (128, 64, 4, 3)), 64: ((128, 128, 4, 3), (128, 64, 4, 3))}


def compile_table():
    from triton.backends.compiler import GPUTarget
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    div16 = [["tt.divisibility", 16]]
    print(f"triton {triton.__version__}\n D  causal tile            mode              -> spec regs spill smemKB", flush=True)
    for d, causal, mode in itertools.product((128, 64), (False, True), MODES):
        for bm, bn, warps, stages in TILES[d]:
            sig = {n: "*bf16" for n in ("Q", "K", "V", "O")}
            sig["LSE"] = "*fp32"
            sig.update(seqlen="i32", heads="i32", batch="i32", sm_scale="fp32")
            consts = dict(D=d, BM=bm, BN=bn, CAUSAL=causal, PERSISTENT=mode.startswith("persist"),
                          OUTER_WS=mode.endswith("outer-ws"), INNER_WS=mode.endswith("inner-ws"))
            sig.update(dict.fromkeys(consts, "constexpr"))
            src = triton.compiler.ASTSource(probe_fwd, sig, consts, {(i,): div16 for i in range(6)})
            tag = f"{d:3d} {str(causal)[0]:5s} {bm}x{bn}/{warps}w/{stages}s  {mode:17s}"
            try:
                ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                    options=dict(num_warps=warps, num_stages=stages))
                with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
                    f.write(ck.asm["ptx"]), f.flush()
                    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                                         capture_output=True, text=True).stderr
                regs, = re.search(r"Used (\d+) registers", log).groups()
                spill = re.search(r"(\d+) bytes spill stores", log).group(1)
                spec = "yes" if "setmaxnreg" in ck.asm["ptx"] else "no"
                print(f"{tag} -> {spec:4s} {regs:>4s} {spill:>5s} {ck.metadata.shared / 1024:6.0f}", flush=True)
            except Exception as e:  # a crash of a compiler pass is a result
                print(f"{tag} -> FAILED {type(e).__name__}: {(str(e).strip().splitlines() or [''])[-1][:80]}",
                      flush=True)


def reference(q, causal):
    x = q.double().transpose(1, 2)
    s = x @ x.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ x).transpose(1, 2)


def rel(a, r):
    return ((a.double() - r.double()).norm() / r.double().norm()).item()


def interpret_check():
    """Every mode under TRITON_INTERPRET (CPU; fp16: bf16 descriptor loads come out as garbage there)."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8))
    torch.manual_seed(0)
    q = torch.randn(2, 256, 2, 64, dtype=torch.float16)
    for causal, mode in itertools.product((False, True), MODES):
        o = torch.full_like(q, float("nan"))
        launch(q, o, (64, 64, 4, 2, mode), causal, programs=3)
        err = rel(o, reference(q, causal))
        print(f"interpret causal={causal} {mode}: rel err {err:.1e}" + ("" if err < 2e-2 else "  BAD"), flush=True)


def main():
    import dualattn.torch_api as dt
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqlens = [int(x) for x in os.environ.get("PROBE_SEQLENS", "1024,2048,4096").split(",")]
    for d, h in ((128, 16), (64, 32)):
        for s, causal in itertools.product(seqlens, (False, True)):
            b = 16384 // s
            q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
            flops = 4 * b * h * s * s * d // (2 if causal else 1)
            ref = dt.flash_attention(q, q, q, causal=causal)
            ms = triton.testing.do_bench_cudagraph(lambda: dt.flash_attention(q, q, q, causal=causal), rep=100)
            print(f"d={d} s={s} causal={causal} dualattn fwd: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
            for (bm, bn, warps, stages), mode in itertools.product(TILES[d], MODES):
                for per_sm in ((1, 2) if mode.startswith("persist") else (0,)):
                    o = torch.full_like(q, float("nan"))
                    tag = f"  {bm}x{bn}/{warps}w/{stages}s {mode:17s}" + (f" x{per_sm}/SM" if per_sm else "      ")

                    def run():
                        launch(q, o, (bm, bn, warps, stages, mode), causal, per_sm * sms)
                    try:
                        run()
                        err = rel(o, ref)
                        ms = triton.testing.do_bench_cudagraph(run, rep=100)
                        print(f"{tag}: {flops / ms / 1e9:.0f} TFLOP/s (rel err vs dualattn {err:.1e}"
                              + ("" if err < 2e-2 else " BAD") + ")", flush=True)
                    except Exception as e:  # a tile that does not fit, or a compiler failure, is reported
                        print(f"{tag}: failed {str(e)[:100]!r}", flush=True)


def bisect():
    """Session 12: which of the library kernel's habits costs the persistent causal forward?  The
    probe's 128x128/4-warp persistent kernel (inner loop specialised) with descriptors built per
    tile over one head (PER_TILE) and an lse store through a 1-D descriptor (STORE_LSE), next to
    dualattn's default plan and its opt-in band in the persistent loop (DUALATTN_WS_BAND=1)."""
    import dualattn.torch_api as dt
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seqlens = [int(x) for x in os.environ.get("PROBE_SEQLENS", "1024,2048,4096").split(",")]
    d, h = 128, 16
    for s, causal in itertools.product(seqlens, (True, False)):
        b = 16384 // s
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * b * h * s * s * d // (2 if causal else 1)
        ref = dt.flash_attention(q, q, q, causal=causal)
        for band in ("0", "1"):
            os.environ["DUALATTN_WS_BAND"] = band
            ms = triton.testing.do_bench_cudagraph(lambda: dt.flash_attention(q, q, q, causal=causal), rep=100)
            print(f"d={d} s={s} causal={causal} dualattn fwd WS_BAND={band}: {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        os.environ["DUALATTN_WS_BAND"] = "0"
        for per_tile, store_lse in itertools.product((False, True), (False, True)):
            o = torch.full_like(q, float("nan"))

            def run():
                launch(q, o, (128, 128, 4, 2, "persist-inner-ws"), causal, sms, per_tile, store_lse)
            run()
            err = rel(o, ref)
            ms = triton.testing.do_bench_cudagraph(run, rep=100)
            print(f"  probe per_tile={per_tile:d} store_lse={store_lse:d}: {flops / ms / 1e9:.0f} TFLOP/s "
                  f"(rel err {err:.1e}{'' if err < 2e-2 else ' BAD'})", flush=True)


if __name__ == "__main__":
    {"--compile-table": compile_table, "--interpret-check": interpret_check, "--bisect": bisect}.get(
        sys.argv[-1], main)()
