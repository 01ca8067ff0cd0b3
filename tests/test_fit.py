"""Launches that fit: portable kernels checked (compiled, no GPU needed) against a GPU's shared memory,
and made smaller where an option combination would not launch (kernels/flash/fit.py).

The random sample draws new option combinations on every run (its seed is in each failure message;
DUALATTN_TEST_SEED fixes it), so CI compiles a different slice of the option space for sm_90 and sm_80
each time.
"""
from __future__ import annotations

import os
import time
import types

import numpy as np
import pytest

pytest.importorskip("triton")

from dualattn.kernels.flash import fit  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.flash.plan import TileConfig  # noqa: E402
from dualattn.kernels.launch import row_major_strides  # noqa: E402
from test_compile import Variant  # noqa: E402


def test_smaller_tiles_shrink_to_the_minimum():
    tiles = list(fit.smaller_tiles(TileConfig(128, 64, 8, 3)))
    assert tiles[0] == TileConfig(128, 64, 8, 3) and [t.num_stages for t in tiles[:3]] == [3, 2, 1]
    assert tiles[-1].block_m == tiles[-1].block_n == fit.MIN_BLOCK and tiles[-1].num_stages == 1
    sizes = [t.block_m * t.block_n for t in tiles]
    assert sizes == sorted(sizes, reverse=True)
    assert all(t.num_warps >= 1 and t.block_m >= 16 * min(t.num_warps, t.block_m // 16) for t in tiles)


def _fitted(variant, arch):
    """Fit the variant's forward and backward for sm_<arch> the way the launchers do."""
    arrays, shapes, options = variant.problem()
    out = types.SimpleNamespace(shape=flash_plan.out_shape(shapes), dtype=variant.dtype)
    strides = {k: row_major_strides(a.shape) for k, a in {**arrays, "out": out}.items()}
    config = flash_plan.default_config(shapes, interpret=False, arch=arch, causal=options.causal,
                                      window_keys=flash_plan.causal_window_keys(options))
    dtypes = {k: a.dtype for k, a in arrays.items()}
    if variant.dropout:
        dtypes["dropout_seed"] = "int32"
    kw = dict(config=config, arch=arch, max_shared=fit.MAX_SHARED_BYTES[arch], dtypes=dtypes,
              warp_specialize=variant.ws and arch == 90, num_sms=132 if variant.ws else 0,
              gluon=variant.ws and arch == 90)
    fwd = fit.forward(shapes, options, strides, **kw)
    dtypes = {**dtypes, "out": variant.dtype, "dout": variant.dtype, "lse": "float32", "dlse": "float32"}
    bwd = fit.backward(shapes, options, strides, lse_grad=variant.lse_grad, **{**kw, "dtypes": dtypes})
    # (dq_accum: the one-pass backward's fp32 dQ, which its dq launch converts)
    return config, fwd, bwd, {**dtypes, "delta": "float32", "resume_out": variant.dtype, "resume_lse": "float32",
                              "segment_ranges": "int32", "dq_accum": "float32"}


def _assert_all_fit(variant, arch, why=""):
    config, fwd, bwd, dtypes = _fitted(variant, arch)
    for launch in (*fwd.chain, bwd.dkdv, bwd.dq):
        used = fit.shared_bytes(launch, dtypes, arch)
        assert used <= fit.MAX_SHARED_BYTES[arch], (f"{variant.name} on sm_{arch}: {launch.kernel} needs {used} bytes "
                                                    f"of shared memory{why}")
    return config, fwd, bwd


def test_an_option_combination_that_overflowed_now_fits():
    """D=128 with a mask and a soft cap: the tuned forward tile took 256 KB on sm_90 (227 KB allowed)."""
    variant = Variant("mask-softcap-d128-gqa-cross", d=128, mask="full", softcap=30.0, sq=384, sk=1500, hq=4, hkv=2)
    unfitted, _, dtypes = variant.build(90)
    assert fit.shared_bytes(unfitted, dtypes, 90) > fit.MAX_SHARED_BYTES[90]   # what failed to launch
    config, fwd, _ = _assert_all_fit(variant, 90)
    tile = fwd.constexpr_dict
    assert (tile["BLOCK_M"], tile["BLOCK_N"], fwd.num_stages) != (config.fwd.block_m, config.fwd.block_n,
                                                                  config.fwd.num_stages)


_HEAD_DIMS = (16, 32, 48, 64, 80, 96, 128, 160, 192, 256)
_OPTIONS = ("causal", "window", "softcap", "bias", "mask", "segments", "sinks", "dropout", "varlen")


def _random_variant(rng):
    options = set(rng.choice(_OPTIONS, size=rng.integers(1, 4), replace=False))
    if "varlen" in options:
        options -= {"bias", "mask", "segments"}   # not with varlen (validation rejects them)
    d = int(rng.choice(_HEAD_DIMS))
    hkv = int(rng.choice((1, 2, 4)))
    sq, sk = (int(x) for x in rng.integers(100, 2500, size=2))
    return Variant(
        "random-" + "-".join(sorted(options)) + f"-d{d}", dtype=str(rng.choice(("bfloat16", "float16", "float32"))),
        d=d, dv=int(rng.choice(_HEAD_DIMS)) if rng.random() < 0.2 else None, batch=2, sq=sq,
        sk=sq if "varlen" in options else sk, hq=hkv * int(rng.choice((1, 2, 4))), hkv=hkv,
        causal="causal" in options, window=(int(rng.integers(0, 600)), int(rng.integers(0, 100))) if "window" in options
        else None, softcap=30.0 if "softcap" in options else None, bias="full" if "bias" in options else None,
        mask=str(rng.choice(("full", "bcast"))) if "mask" in options else None, segments="segments" in options,
        sinks=("head", 1) if "sinks" in options else None, dropout=0.1 if "dropout" in options else 0.0,
        varlen="varlen" in options, lse_grad=bool(rng.random() < 0.5), ws=bool(rng.random() < 0.5))


def test_a_random_sample_of_option_combinations_fits_sm90_and_sm80():
    seed = int(os.environ.get("DUALATTN_TEST_SEED") or time.time())
    rng = np.random.default_rng(seed)
    for _ in range(2):
        variant = _random_variant(rng)
        for arch in (90, 80):
            _assert_all_fit(variant, arch, f" (DUALATTN_TEST_SEED={seed} reproduces this sample)")


def test_a_sample_on_the_one_pass_backward_is_checked_whole():
    """Padded head dims take the one-pass backward from 512 keys, which the random sample's lengths reach: its dq
    launch converts the fp32 dQ accumulator (dq_accum), whose dtype the check must be given."""
    variant = Variant("one-pass-d144-dropout", dtype="float16", d=144, sq=1024, sk=1024, hq=4, hkv=2, dropout=0.1,
                      ws=True)
    _, _, bwd = _assert_all_fit(variant, 90)
    assert (bwd.dkdv.kernel, bwd.dq.kernel) == ("flash_bwd_one_pass_kernel", "flash_bwd_dq_convert_kernel")


def test_a_layout_whose_blocks_cannot_fit_is_a_value_error_naming_it():
    """Block-sparse tiles are the layout's blocks: where even one stage does not fit (found by the GPU fuzz:
    float32, D=160, 64x64 blocks on sm_90), the plan says so before any launch, naming `layout`.  (Small here,
    against a small shared memory, to compile quickly.)"""
    from dualattn.options import FlashOptions
    from dualattn.validation import FlashShapes
    shapes = FlashShapes(1, 64, 64, 2, 2, 64, 64, "float32")
    options = FlashOptions.build(head_dim=64)
    sparse = flash_plan.SparseInfo(1, 2, 1, 1, 64, 64)
    strides = {n: row_major_strides((1, 64, 2, 64)) for n in ("query", "key", "value", "out")}
    dtypes = {**dict.fromkeys(("query", "key", "value"), "float32"), **dict.fromkeys(flash_plan.SPARSE_INPUTS, "int32")}
    config = flash_plan.default_config(shapes, interpret=False, arch=90)
    with pytest.raises(ValueError, match="layout: block-sparse tiles are the layout's 64x64 blocks"):
        fit.forward(shapes, options, strides, config=config, arch=90, max_shared=16384, dtypes=dtypes, sparse=sparse)


def test_wide_heads_with_a_bias_or_mask_take_the_small_portable_forward_tile():
    """Above D = 128 a bias or an attention mask gives the portable forward tiles.SCORED_WIDE_FWD_TILE (the tuned
    128 x 64 tile spilled kilobytes a thread there); D = 128, float32 and option-free problems keep theirs."""
    import dataclasses
    from dualattn.kernels.flash import tiles
    from dualattn.validation import FlashShapes

    def fwd(d, dtype="bfloat16", **scored):
        shapes = dataclasses.replace(FlashShapes(2, 4096, 4096, 8, 8, d, d, dtype), **scored)
        return flash_plan.default_config(shapes, interpret=False, arch=90).fwd
    for d in (256, 192, 144):
        assert fwd(d, has_bias=True) == fwd(d, has_mask=True) == tiles.SCORED_WIDE_FWD_TILE, d
        assert fwd(d) != tiles.SCORED_WIDE_FWD_TILE, d   # (the tuned sm90:d256 tile, 128 x 64)
    assert fwd(128, has_bias=True) == fwd(128) and fwd(256, "float32", has_mask=True) == fwd(256, "float32")
