"""Short causal sliding windows (GPT-OSS: 128 keys with a sink per head): which forward kernel and
tile, and where a fwd+bwd call's time goes.  The sweep behind hopper.short_window_forward and
tiles.SHORT_WINDOW_FWD_TILE (benchmarks/NOTES.md, "Short windows run the portable forward").

    python benchmarks/ab_short_windows.py            forward kernel time (profiler), B=2, S=8192, D=64 (H=32)
                                                     and 128 (H=16), windows 128..1024 and none: the Gluon
                                                     forward against the portable one, on the plan's tile
                                                     and on several pinned ones
    python benchmarks/ab_short_windows.py --fwdbwd   window 128 + sinks, D=64: torch and JAX fwd+bwd, wall time
                                                     (back-to-back calls) and each kernel's time, with the
                                                     portable forward and with the Gluon one
    python benchmarks/ab_short_windows.py --backward fwd+bwd kernel time (torch) of short windows with the
                                                     one-pass Gluon backward, the two-pass warp-specialised
                                                     one, and the two-pass portable one on several tiles
"""
import argparse
import contextlib

import torch

import dualattn.torch_api as dt
from dualattn import switches
from dualattn.bench.flash import kernel_times

B, S = 2, 8192


def forward_tiles():
    """The Gluon forward (DUALATTN_GLUON_FWD=1, which keeps short windows on it) against the portable one
    (DUALATTN_GLUON_FWD=0) on the tiles the plan picks and on each tile pinned through executor.override."""
    from dualattn import executor
    from dualattn.kernels.flash import tiles
    variants = {"gluon": (dict(DUALATTN_GLUON_FWD="1"), None), "portable_default": (dict(DUALATTN_GLUON_FWD="0"), None)}
    for tile in ((64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 3), (128, 128, 8, 3)):
        config = tiles.FlashConfig(tiles.TileConfig(*tile), tiles.TileConfig(64, 64, 4, 3),
                                   tiles.TileConfig(128, 64, 4, 3))
        variants["portable_" + "x".join(map(str, tile))] = (dict(DUALATTN_GLUON_FWD="0"), config)
    gen = torch.Generator().manual_seed(0)
    for D, H in ((64, 32), (128, 16)):
        q, k, v = (torch.randn(B, S, H, D, generator=gen).cuda().bfloat16() for _ in range(3))
        aux = torch.randn(H, generator=gen).cuda()
        for win in (128, 256, 512, 1024, None):
            for sinks in ((True, False) if win == 128 else (False,)):
                pairs = B * H * (sum(min(i + 1, win) for i in range(S)) if win else S * (S + 1) // 2)

                def fn():
                    return dt.flash_attention(q, k, v, causal=True, sliding_window=(win - 1, 0) if win else None,
                                              softmax_aux=aux if sinks else None)
                for rnd in range(2):
                    for name, (env, config) in variants.items():
                        if win is None and config is not None:
                            continue
                        pinned = executor.override(config, algorithm="flash") if config else contextlib.nullcontext()
                        with switches.override(**env), pinned, torch.no_grad():
                            table = kernel_times(fn, calls=20, width=60)
                        ms = sum(table.values())
                        print(f"D={D} win={win} sinks={sinks} round {rnd} {name:24s} {ms:7.4f} ms "
                              f"{4 * D * pairs / ms / 1e9:5.0f} TF/s {sorted(n[:24] for n in table)}", flush=True)


def fwdbwd():
    import jax
    import dualattn.jax_api as dj
    from dualattn.bench.flash import throughput_ms
    from dualattn.bench.systems import Step
    H, D = 32, 64
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
    aux = torch.randn(H, generator=gen).cuda().requires_grad_()
    dout = torch.randn_like(q)
    opts = dict(causal=True, sliding_window=(127, 0))

    def torch_step():
        return torch.autograd.grad(dt.flash_attention(q, k, v, softmax_aux=aux, **opts), (q, k, v, aux), dout)
    jq, jk, jv, jd, ja = (jax.dlpack.from_dlpack(t.detach()) for t in (q, k, v, dout, aux))
    for mode, env in (("portable fwd", {}), ("gluon fwd", dict(DUALATTN_GLUON_FWD="1"))):
        with switches.override(**env):
            def attention(q_, k_, v_, s_):
                return dj.flash_attention(q_, k_, v_, softmax_aux=s_, backend="triton", **opts)
            jax_step = jax.jit(lambda d, *a: jax.vjp(attention, *a)[1](d))
            for name, launch, sync in (("torch", torch_step, lambda _: torch.cuda.synchronize()),
                                       ("jax", lambda: jax_step(jd, jq, jk, jv, ja), jax.block_until_ready)):
                ms = throughput_ms(Step(launch, sync), min_ms=100, repeats=3)
                table = kernel_times(lambda: sync(launch()), calls=10, width=60)
                print(f"## {mode} {name}: wall {ms:.3f} ms/call, kernels {sum(table.values()):.3f} ms")
                for kname, kms in sorted(table.items(), key=lambda x: -x[1])[:8]:
                    print(f"   {kms:8.4f}  {kname}")


def backward_kernels():
    """Which backward for short windows: fwd+bwd kernel time (the forward is the same portable one in every
    variant), by backward kernel family and, for the portable two-pass one, by (dK/dV, dQ) tile."""
    from dualattn import executor
    from dualattn.kernels.flash import tiles
    gen = torch.Generator().manual_seed(0)
    variants = {"one-pass": ({}, None), "two-pass ws": (dict(DUALATTN_ONE_PASS="0"), None),
                "two-pass portable": (dict(DUALATTN_ONE_PASS="0", DUALATTN_WS="0"), None)}
    for dkdv, dq in (((64, 64, 4, 3), (64, 64, 4, 3)), ((32, 64, 4, 3), (64, 32, 4, 3)),
                     ((64, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 4, 3), (128, 32, 4, 3))):
        config = tiles.FlashConfig(tiles.SHORT_WINDOW_FWD_TILE, tiles.TileConfig(*dkdv), tiles.TileConfig(*dq))
        variants[f"two-pass portable {dkdv[:3]} {dq[:3]}"] = (dict(DUALATTN_ONE_PASS="0", DUALATTN_WS="0"), config)
    for D, H, win, sinks in ((64, 32, 128, True), (128, 16, 128, True), (64, 32, 512, False), (64, 32, 1024, False),
                             (128, 16, 256, False), (128, 16, 512, False), (128, 16, 1024, False)):
        q, k, v = (torch.randn(B, S, H, D, generator=gen).cuda().bfloat16().requires_grad_() for _ in range(3))
        aux = torch.randn(H, generator=gen).cuda().requires_grad_()
        dout = torch.randn_like(q)
        pairs = B * H * sum(min(i + 1, win) for i in range(S))

        def fn():
            out = dt.flash_attention(q, k, v, causal=True, sliding_window=(win - 1, 0),
                                     softmax_aux=aux if sinks else None)
            return torch.autograd.grad(out, (q, k, v, aux) if sinks else (q, k, v), dout)
        for rnd in range(2):
            for name, (env, config) in variants.items():
                pinned = executor.override(config, algorithm="flash") if config else contextlib.nullcontext()
                with switches.override(**env), pinned:
                    table = kernel_times(fn, calls=20, width=40)
                ms = sum(table.values())
                kernels = ", ".join(f"{n} {t:.4f}" for n, t in sorted(table.items(), key=lambda x: -x[1]))
                print(f"D={D} win={win} sinks={sinks} round {rnd} {name:44s} {ms:7.4f} ms "
                      f"{4 * 2.5 * D * pairs / ms / 1e9:5.0f} TF/s [{kernels}]", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fwdbwd", action="store_true")
    mode.add_argument("--backward", action="store_true")
    args = ap.parse_args()
    fwdbwd() if args.fwdbwd else backward_kernels() if args.backward else forward_tiles()
