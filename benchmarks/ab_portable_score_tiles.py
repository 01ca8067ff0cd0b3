"""The portable forward's tile with a bias or an attention mask, where the Gluon forward does not take them
(sm_80; a float32 bias with a mask at D = 256, a bias with a mask at D = 96 and 128, whose tiles do not fit its
shared memory): forward kernel time (torch.profiler) of flash_attention per tile, B = 2, S = 4096, bf16.
"auto" is the plan's own tile; every other output is compared with its.

    python benchmarks/ab_portable_score_tiles.py [--cases d256-f32bias-mask,...] [--tiles 64x64x8x2,...]
"""
import argparse
import dataclasses

import torch

import dualattn.torch_api as dt
from dualattn import executor, switches
from dualattn.bench.flash import kernel_times
from dualattn.kernels.flash import plan
from dualattn.kernels.flash.tiles import TileConfig

B, S = 2, 4096
# name -> (D, H, causal, bias dtype or None, mask, the Gluon forward off: as on sm_80)
CASES = {
    "d256-f32bias-mask": (256, 8, False, torch.float32, True, False),
    "d256-bias-no-gluon": (256, 8, False, torch.bfloat16, False, True),
    "d256-mask-causal-no-gluon": (256, 8, True, None, True, True),
    "d128-bias-mask": (128, 16, False, torch.bfloat16, True, False),
    "d96-bias-mask": (96, 16, False, torch.bfloat16, True, False),
}
TILES = "64x64x8x2,64x128x8x2,32x64x4x2,64x32x4x2"


def forward_ms(fn):
    with torch.no_grad():
        table = kernel_times(fn, calls=10, width=40)
    return sum(t for name, t in table.items() if "flash_fwd" in name), sorted(table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--tiles", default=TILES, help="block_m x block_n x warps x stages, comma-separated")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; forward kernel ms, B={B}, S={S}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.cases.split(","):
        d, h, causal, bias_dtype, with_mask, no_gluon = CASES[name]
        q, k, v = (torch.randn(B, S, h, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        kw = dict(causal=causal)
        if bias_dtype is not None:
            kw["bias"] = torch.randn(B, h, S, S, device="cuda", generator=gen).to(bias_dtype)
        if with_mask:
            kw["attention_mask"] = torch.rand(B, h, S, S, device="cuda", generator=gen) < 0.9
        switches.set_switches(DUALATTN_GLUON_FWD="0" if no_gluon else None)
        plan.forget_plans()
        outs = {}
        ms, kernels = forward_ms(lambda: outs.__setitem__("auto", dt.flash_attention(q, k, v, **kw)))
        print(f"{name:28s} auto        {ms:8.3f} ms  {kernels}", flush=True)
        base = plan.default_config(plan.FlashShapes(B, S, S, h, h, d, d, "bfloat16"), interpret=False, causal=causal)
        for spec in args.tiles.split(","):
            tile = TileConfig(*(int(x) for x in spec.split("x")))
            with executor.override(dataclasses.replace(base, fwd=tile), algorithm="flash"):
                try:
                    ms, kernels = forward_ms(lambda: outs.__setitem__(spec, dt.flash_attention(q, k, v, **kw)))
                except Exception as e:   # (a tile that does not fit is reported, not fatal)
                    print(f"{name:28s} {spec:11s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
            diff = (outs[spec].float() - outs["auto"].float()).abs().max().item()
            print(f"{name:28s} {spec:11s} {ms:8.3f} ms  max |diff| vs auto {diff:.2e}  {kernels}", flush=True)
    switches.set_switches(DUALATTN_GLUON_FWD=None)
    plan.forget_plans()


if __name__ == "__main__":
    main()
