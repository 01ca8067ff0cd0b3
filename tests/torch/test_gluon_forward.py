"""The Gluon forward (kernels/flash/forward_gluon.py, plan.gluon_forward).

Gluon has no interpreter: on the CPU these tests check which problems the plan sends to it and
that its variants compile for sm_90; the GPU tests check its numbers against the float64 reference
through the public torch API, and that the plan took it.  (JAX runs the same launch through
jax_api/_gluon.py: tests/parity compares the two frameworks bit for bit.)
"""
from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")

from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan, rules  # noqa: E402
from plan_spy import spy_chains, spy_kernels, spy_launches  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from test_one_pass import (ONE_PASS, WINDOW_CASES, check_gpu_case, gluon_problem,  # noqa: E402  (tests/torch on path)
                           scored_inputs)

GLUON_FWD = "flash_fwd_gluon_kernel"


@pytest.fixture(autouse=True)
def default_switches(monkeypatch):
    for name in (flash_plan.GLUON_FWD_ENV, flash_plan.PERSISTENT_ENV, "DUALATTN_WS"):
        set_switch(monkeypatch, name, None)


def _plan(gluon=True, k_strides=None, num_sms=132, hardware_tanh=False, **kwargs):
    shapes, options, strides, config = gluon_problem(strides=None if k_strides is None else {"key": k_strides},
                                                     **kwargs)
    return flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=gluon,
                                   num_sms=num_sms, hardware_tanh=hardware_tanh)


def test_plan_takes_the_gluon_forward():
    launch = _plan(causal=True)
    assert launch.kernel == GLUON_FWD and launch.then is None
    scalars, const = dict(launch.scalars), launch.constexpr_dict
    # 2 * 4 heads * 8 query tiles of 128, in pairs: 32 items, one program each (fewer than 132 SMs)
    assert scalars["num_work"] == 32 and launch.grid == (32, 1, 1)
    assert (const["CAUSAL"], const["EVEN_K"], const["GROUP_SIZE"]) == (True, True, 1)
    assert _plan(causal=True, num_sms=10).grid == (10, 1, 1)
    gqa = _plan(causal=True, sq=1000, sk=1300, hq=8, hkv=2, d=64)
    assert gqa.kernel == GLUON_FWD
    assert dict(gqa.scalars)["diag"] == 300 and gqa.constexpr_dict["GROUP_SIZE"] == 4
    assert not gqa.constexpr_dict["EVEN_K"]
    assert [o.name for o in gqa.results] == ["out", "lse"]
    full = _plan()
    assert full.kernel == GLUON_FWD and not full.constexpr_dict["CAUSAL"]
    assert dict(full.scalars)["num_work"] == 64   # non-causal: a query tile per item
    # sinks join after the loop; a causal sliding window (Mistral, GPT-OSS) narrows each tile's keys
    sinks = _plan(causal=True, sinks=True)
    assert sinks.kernel == GLUON_FWD and sinks.constexpr_dict["NUM_SINKS"] == 1 and "softmax_aux" in sinks.inputs
    window = _plan(sliding_window=(200, 0), sinks=True)
    assert window.kernel == GLUON_FWD
    assert (window.constexpr_dict["CAUSAL"], window.constexpr_dict["WINDOW"]) == (True, True)
    assert dict(window.scalars)["window_left"] == 200
    # the soft cap: the GPU's tanh on a GPU (16-bit inputs), the exp2 form otherwise (plan.softcap_mode)
    # bf16 and a cap of at most 50.6 (Gemma 2's 50): P against a fixed reference (plan.gluon_softcap)
    capped = _plan(causal=True, logits_soft_cap=30.0, hardware_tanh=True)
    assert capped.kernel == GLUON_FWD and capped.constexpr_dict["SOFTCAP"] == rules.SOFTCAP_MUFU_FIXED_MAX
    assert dict(capped.scalars)["softcap"] == 30.0
    assert _plan(logits_soft_cap=50.0, hardware_tanh=True).constexpr_dict["SOFTCAP"] == rules.SOFTCAP_MUFU_FIXED_MAX
    for running_max in (dict(logits_soft_cap=51.0), dict(logits_soft_cap=30.0, dtype="float16")):
        assert _plan(hardware_tanh=True, **running_max).constexpr_dict["SOFTCAP"] == rules.SOFTCAP_MUFU
    assert _plan(logits_soft_cap=30.0).constexpr_dict["SOFTCAP"] == rules.SOFTCAP_EXP2
    assert _plan(causal=True).constexpr_dict["SOFTCAP"] == rules.SOFTCAP_NONE
    # a bias and an attention mask: read per tile beside S, with their (batch, head, row) strides
    scored = _plan(causal=True, bias=True, mask=True, sq=1000, sk=1104)
    assert scored.kernel == GLUON_FWD and {"bias", "attention_mask"} <= set(scored.inputs)
    assert (scored.constexpr_dict["HAS_BIAS"], scored.constexpr_dict["HAS_MASK"]) == (True, True)
    assert dict(scored.scalars)["bias_stride_s"] == 1104 and dict(scored.scalars)["mask_stride_h"] == 1000 * 1104
    assert not _plan(causal=True).constexpr_dict["HAS_BIAS"]


def test_gluon_forward_copies_score_tiles_in_16_byte_pieces():
    """Bias and mask tiles are copied 8 elements at a time: Sk and the strides stepped by must be
    multiples of 8 (broadcast dimensions are not stepped by); otherwise the Triton forward."""
    assert _plan(bias=True, sk=1100).kernel == "flash_fwd_kernel"
    assert _plan(mask=True, sk=1100).kernel == "flash_fwd_kernel"
    shapes, options, strides, config = gluon_problem(b=2, hq=4, sk=1024, bias=True)
    for bias_strides, bcast, gluon in (((0, 1024 * 1024, 1024, 1), (True, False), True),
                                       ((4, 1024 * 1024, 1024, 1), (True, False), True),   # broadcast: any stride
                                       ((4 * 1024 * 1028, 1024 * 1028, 1028, 1), (False, False), False),
                                       ((4 * 1024 * 1032, 1024 * 1032, 1032, 1), (False, False), True)):
        s = dataclasses.replace(shapes, bias_bcast_batch=bcast[0], bias_bcast_head=bcast[1])
        launch = flash_plan.plan_forward(s, options, {**strides, "bias": bias_strides}, config=config,
                                         warp_specialize=True, gluon=True, num_sms=132)
        assert (launch.kernel == GLUON_FWD) == gluon, bias_strides


@pytest.mark.parametrize("d, extra, gluon", [
    (128, dict(bias="bfloat16"), True), (128, dict(mask=True), True), (128, dict(bias="float32"), False),
    (128, dict(bias="bfloat16", mask=True), False), (64, dict(bias="float32", mask=True), True),
    (256, dict(bias="float32"), True), (256, dict(bias="bfloat16", mask=True), True),
    (256, dict(bias="float32", mask=True), False), (96, dict(bias="bfloat16", mask=True), False)])
def test_fit_keeps_gluon_where_the_score_tiles_fit(d, extra, gluon):
    """Each compute warpgroup holds a tile of the bias and of the mask in shared memory: at D=128 one
    16-bit tile fits beside K, V, Q and O, a float32 one or both do not (fit.forward, from the
    compiled kernel, plans the Triton forward there); at D=64 everything fits; at D = 256 (64-key tiles)
    a float32 bias or a 16-bit bias and a mask fit, a float32 bias and a mask do not; D = 96 runs D = 128's."""
    from dualattn.kernels.flash import fit
    bias_dtype = extra.get("bias")
    shapes, options, strides, config = gluon_problem(d=d, causal=True, sq=1024, sk=1024, bias=bias_dtype is not None,
                                                     mask=extra.get("mask", False))
    dtypes = {**dict.fromkeys(("query", "key", "value"), "bfloat16"), "attention_mask": "int8",
              **({"bias": bias_dtype} if bias_dtype else {})}
    launch = fit.forward(shapes, options, strides, config=config, arch=90, max_shared=fit.MAX_SHARED_BYTES[90],
                         dtypes=dtypes, warp_specialize=True, gluon=True, num_sms=132)
    assert (launch.kernel == GLUON_FWD) == gluon, launch.kernel

def test_plan_takes_the_gluon_forward_for_documents():
    """Segment ids: the launch of the tiles' segment ranges (128-row query tiles over 128-wide key tiles,
    the Gluon tile), then the Gluon forward reading them."""
    launch = _plan(causal=True, segments=True, sq=2048, sk=2048)
    ranges, gluon = launch.chain
    assert (ranges.kernel, gluon.kernel) == ("segment_ranges_kernel", GLUON_FWD)
    assert (ranges.constexpr_dict["BLOCK_OWN"], ranges.constexpr_dict["BLOCK_OTHER"]) == (128, 128)
    assert ranges.grid == (16, 2, 1) and gluon.constexpr_dict["SEGMENTS"]
    assert dict(gluon.resume) == {"segment_ranges": "segment_ranges"}
    assert dict(gluon.scalars)["seg_stride_qb"] == 2048
    assert not _plan(causal=True).constexpr_dict["SEGMENTS"]


def test_plan_takes_the_gluon_forward_at_d256():
    """D = 256 (Gemma's heads): 64-key tiles (Q, two stages of K and V, O staged in Q's buffers:
    hopper.GLUON_FWD_TILES), with every option but a block-sparse layout (128 x 128 blocks); a bias's and a
    mask's copies span the 64 keys."""
    for extra in (dict(), dict(causal=True), dict(causal=True, logits_soft_cap=50.0, sinks=True),
                  dict(sliding_window=(1023, 0)), dict(causal=True, segments=True), dict(dropout_prob=0.1),
                  dict(bias=True), dict(causal=True, mask=True)):
        launch = _plan(d=256, hq=8, hkv=2, sq=4096, sk=4096, **extra)
        launch = launch.chain[-1] if launch.then is not None else launch
        assert launch.kernel == GLUON_FWD, extra
        const = launch.constexpr_dict
        assert (const["HEAD_DIM"], const["BLOCK_M"], const["BLOCK_N"], const["STAGES"]) == (256, 128, 64, 2), extra


def test_gluon_tile_width():
    """The tiles' width for each head dim: 64, 128 and 256 as they are, other multiples of 16 from 80 to 240 the
    next power of two; none below 64 or above 256, nor for dims whose rows TMA cannot take."""
    from dualattn.kernels.flash.hopper import gluon_tile_width
    assert [gluon_tile_width(d) for d in (64, 80, 96, 112, 128, 144, 192, 240, 256)] == \
        [64, 128, 128, 128, 128, 256, 256, 256, 256]
    assert [gluon_tile_width(d) for d in (16, 32, 48, 72, 100, 136, 272, 288, 512)] == [None] * 9


def test_plan_keys_the_short_window_rule_by_the_gluon_width():
    """D = 96 runs D = 128's tiles, so its short causal windows take D = 128's rule (the portable forward up to
    128 keys), as D = 128 does; longer ones the Gluon forward."""
    for d in (96, 128):
        assert _plan(d=d, sliding_window=(127, 0), sq=2048, sk=2048).kernel == "flash_fwd_kernel", d
        assert _plan(d=d, sliding_window=(500, 0), sq=2048, sk=2048).kernel == GLUON_FWD, d


@pytest.mark.parametrize("d, width", [(96, 128), (80, 128), (192, 256), (144, 256)])
def test_plan_pads_other_head_dims_on_the_gluon_forward(d, width):
    """Head dims between the tiles' widths (96, 192: multiples of 16) run the tiles of the next power of two
    (hopper.gluon_tile_width), the columns past D TMA's zeros; a bias and a mask too."""
    launch = _plan(d=d, causal=True, sinks=True, sq=2048, sk=2048)
    const = launch.constexpr_dict
    assert launch.kernel == GLUON_FWD and (const["HEAD_DIM"], const["BLOCK_D"]) == (d, width)
    assert const["BLOCK_N"] == flash_plan.GLUON_FWD_TILES[width][1]
    assert _plan(d=d, bias=True, mask=True, sq=2048, sk=2048).kernel == GLUON_FWD


def test_plan_keeps_the_triton_forward(monkeypatch):
    for kwargs in (dict(gluon=False), dict(d=100), dict(d=48),
                   dict(dtype="float32"),
                   dict(k_strides=(1024 * 4 * 256, 4 * 256, 256, 1))):  # key heads not side by side
        assert _plan(causal=True, **kwargs).kernel == "flash_fwd_kernel", kwargs
    for window in ((64, None), (64, 64), (None, 64)):   # windows other than causal or causal with a left side
        assert _plan(sliding_window=window).kernel == "flash_fwd_kernel", window
    set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "0")
    assert _plan(causal=True).kernel == "flash_fwd_kernel"
    assert _plan().kernel == "flash_fwd_kernel"


def test_plan_runs_short_windows_on_the_portable_forward(monkeypatch):
    """Causal windows of up to SHORT_WINDOW_KEYS[d] keys (GPT-OSS: 128 with sinks) run the portable forward,
    at D=128 on SHORT_WINDOW_FWD_TILE from the executor's heuristics; longer windows, other head dims, and
    windows with a per-element option or soft cap keep the Gluon forward, as does DUALATTN_GLUON_FWD=1."""
    from dualattn import executor
    from dualattn.kernels.flash import hopper, tiles

    def planned(d, window, **extra):
        shapes, options, strides, _ = gluon_problem(d=d, sq=2048, sk=2048, hq=8, hkv=2, sliding_window=window,
                                                    **extra)
        config = executor._flash_heuristics_cuda(shapes, options, 90)
        return flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                       num_sms=132).chain[-1]
    for d in (64, 128):
        keys = hopper.SHORT_WINDOW_KEYS[d]
        for window, extra in (((keys - 1, 0), {}), ((0, 0), dict(sinks=True)), ((keys // 2, 0), dict(sinks=True))):
            launch = planned(d, window, **extra)
            assert launch.kernel == "flash_fwd_kernel" and not launch.constexpr_dict["WARP_SPECIALIZE"], (d, window)
            assert launch.constexpr_dict["EDGES_IN_LOOP"]
            if d == 128 and window[0] < tiles.SHORT_WINDOW_TILE_KEYS:
                tile = tiles.SHORT_WINDOW_FWD_TILE
                assert (launch.constexpr_dict["BLOCK_M"], launch.constexpr_dict["BLOCK_N"], launch.num_warps,
                        launch.num_stages) == (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages)
        assert planned(d, (keys, 0)).kernel == GLUON_FWD, d
        for extra in (dict(bias=True), dict(mask=True), dict(logits_soft_cap=30.0)):
            assert planned(d, (keys - 1, 0), **extra).kernel == GLUON_FWD, (d, extra)
    assert planned(128, (63, 63)).kernel == "flash_fwd_kernel"    # not causal: never the Gluon forward
    set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "1")
    assert planned(64, (127, 0), sinks=True).kernel == GLUON_FWD


def test_plan_runs_short_windows_on_the_portable_backward(monkeypatch):
    """Causal windows of up to SHORT_WINDOW_BWD_KEYS[d] keys run the portable two-pass backward (up to
    SHORT_WINDOW_BWD_TILE_KEYS[d] on the SHORT_WINDOW_DKDV_TILE / DQ_TILE tiles), neither the one-pass kernel nor
    the warp-specialised one; longer
    windows and windows with a per-element option or soft cap keep the one-pass kernel, as does
    DUALATTN_ONE_PASS=1."""
    from dualattn import executor
    from dualattn.kernels.flash import hopper, tiles

    def planned(d, window, **extra):
        shapes, options, strides, _ = gluon_problem(d=d, sq=4096, sk=4096, hq=8, hkv=2, sliding_window=window,
                                                    **extra)   # (the one-pass kernel's fewest keys: 4096)
        config = executor._flash_heuristics_cuda(shapes, options, 90)
        return flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                        num_sms=132, bias_grad=False)
    for d in (64, 128):
        keys = hopper.SHORT_WINDOW_BWD_KEYS[d]
        for window, extra in (((keys - 1, 0), {}), ((0, 0), dict(sinks=True)), ((keys // 2, 0), dict(sinks=True))):
            plan = planned(d, window, **extra)
            assert (plan.dkdv.kernel, plan.dq.kernel) == ("flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"), (d, window)
            for launch, tile in ((plan.dkdv, tiles.SHORT_WINDOW_DKDV_TILE), (plan.dq, tiles.SHORT_WINDOW_DQ_TILE)):
                const = launch.constexpr_dict
                assert not const["WARP_SPECIALIZE"], (d, window)
                if window[0] < tiles.SHORT_WINDOW_BWD_TILE_KEYS[d]:
                    assert (const["BLOCK_M"], const["BLOCK_N"], launch.num_warps, launch.num_stages) == \
                        (tile.block_m, tile.block_n, tile.num_warps, tile.num_stages), (d, window, launch.kernel)
        assert planned(d, (keys, 0)).dkdv.kernel == ONE_PASS, d
        for extra in (dict(bias=True), dict(mask=True), dict(logits_soft_cap=30.0)):
            assert planned(d, (keys - 1, 0), **extra).dkdv.kernel == ONE_PASS, (d, extra)
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    assert planned(64, (127, 0), sinks=True).dkdv.kernel == ONE_PASS


@pytest.mark.parametrize("d, causal, hq, hkv, dtype, sk, extra", [
    (128, True, 4, 4, "bfloat16", 1024, {}), (128, False, 8, 2, "bfloat16", 1024, {}),
    (64, True, 8, 2, "float16", 1024, {}), (64, False, 4, 4, "bfloat16", 1000, {}),
    (128, True, 4, 2, "bfloat16", 1000, {}), (128, False, 4, 4, "bfloat16", 1024, dict(sinks=True)),
    (64, False, 4, 2, "bfloat16", 1000, dict(sliding_window=(200, 0), sinks=True)),
    (128, True, 4, 2, "bfloat16", 1024, dict(segments=True)), (64, False, 4, 4, "float16", 1000, dict(segments=True)),
    (128, True, 4, 2, "bfloat16", 1024, dict(logits_soft_cap=30.0, hardware_tanh=True)),
    (64, False, 4, 4, "bfloat16", 1000, dict(logits_soft_cap=30.0, sinks=True)),
    (128, True, 4, 2, "bfloat16", 1024, dict(bias=True)), (64, False, 4, 4, "float16", 1000, dict(mask=True)),
    (128, False, 4, 4, "bfloat16", 1000, dict(bias=True, mask=True, logits_soft_cap=30.0, hardware_tanh=True)),
    (64, True, 4, 2, "bfloat16", 1024, dict(bias=True, segments=True, sliding_window=(200, 0), sinks=True)),
    (256, False, 4, 2, "bfloat16", 1000, {}), (256, True, 4, 4, "float16", 1024, dict(sinks=True)),
    (256, True, 4, 2, "bfloat16", 1000, dict(logits_soft_cap=30.0, hardware_tanh=True, sliding_window=(300, 0))),
    (256, True, 4, 2, "bfloat16", 1024, dict(segments=True, dropout_prob=0.1)),
    (96, True, 4, 2, "bfloat16", 1000, dict(sinks=True, sliding_window=(300, 0))),
    (192, False, 4, 4, "float16", 1024, {})])
def test_gluon_forward_compiles_for_sm90(monkeypatch, d, causal, hq, hkv, dtype, sk, extra):
    """Two compute warpgroups of 240 registers and a load warp (its warpgroup at 24), O by TMA store,
    within sm_90's shared memory (at D = 256 O is staged in Q's buffers); the soft cap's tanh as the GPU's
    tanh.approx where the plan asks for it."""
    from dualattn.kernels.flash import fit
    set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "1")   # short windows too (hopper.short_window_forward)
    launch = _plan(d=d, causal=causal, hq=hq, hkv=hkv, dtype=dtype, sk=sk, **extra).chain[-1]
    const = launch.constexpr_dict
    assert launch.kernel == GLUON_FWD and const["EVEN_K"] == (sk % const["BLOCK_N"] == 0)
    compiled = compile_check.compile_launch(
        launch, {**dict.fromkeys(("query", "key", "value"), dtype), "softmax_aux": "float32",
                 **dict.fromkeys(("q_segment_ids", "kv_segment_ids", "segment_ranges", "dropout_seed"), "int32"),
                 "bias": "bfloat16", "attention_mask": "int8"}, arch=90)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 12
    if not (const["HAS_BIAS"] and const["HAS_MASK"] and d == 128):   # (those do not fit: fit.forward)
        assert compiled.metadata.shared <= fit.MAX_SHARED_BYTES[90]
    assert set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)) >= {("inc", "240"), ("dec", "24")}
    # O through a descriptor of (batch, seq, head * dim), clipped at Sq; padded head dims: (batch, seq, head, dim)
    assert f"cp.async.bulk.tensor.{3 if const['BLOCK_D'] == d else 4}d.global.shared" in ptx
    assert ("tanh.approx.f32" in ptx) == (launch.constexpr_dict["SOFTCAP"] in (rules.SOFTCAP_MUFU,
                                                                              rules.SOFTCAP_MUFU_FIXED_MAX))
    assert compiled.asm["cubin"][:4] == b"\x7fELF"


# ---- GPU: numbers against the float64 reference, through the public API ----

GPU_CASES = {
    "d128-causal": dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=128, opts=dict(causal=True)),
    "d64-causal-gqa": dict(b=1, sq=2048, sk=2048, hq=8, hkv=2, d=64, opts=dict(causal=True)),
    # lengths that are not tile multiples: rows past Sq are clipped, keys past Sk masked
    "d128-ragged": dict(b=2, sq=1000, sk=1100, hq=4, hkv=2, d=128, opts={}),
    "d64-ragged-causal": dict(b=1, sq=1000, sk=1000, hq=2, hkv=2, d=64, opts=dict(causal=True)),
    # bottom-right causal: more queries than keys (rows 0-299 see nothing: O = 0, lse = -inf) and fewer
    "d128-causal-empty-rows": dict(b=1, sq=1300, sk=1000, hq=2, hkv=1, d=128, opts=dict(causal=True)),
    "d64-causal-more-keys": dict(b=1, sq=512, sk=1300, hq=2, hkv=2, d=64, opts=dict(causal=True)),
    # few programs, several items each (barrier phases carried over; causal pairs, an odd tile count)
    "d128-causal-3-programs": dict(b=1, sq=896, sk=896, hq=2, hkv=2, d=128, opts=dict(causal=True), num_sms="3"),
    "d64-7-programs": dict(b=3, sq=512, sk=1024, hq=2, hkv=2, d=64, opts={}, num_sms="7"),
    "d128-fp16-scale": dict(b=1, sq=768, sk=2048, hq=2, hkv=2, d=128, opts=dict(causal=True, softmax_scale=0.05),
                            dtype=torch.float16),
    # sinks join after the loop
    "d128-causal-sinks": dict(b=2, sq=1024, sk=1024, hq=4, hkv=2, d=128, opts=dict(causal=True), sinks=True),
    "d64-sinks-ragged": dict(b=1, sq=1000, sk=1100, hq=4, hkv=4, d=64, opts={}, sinks=True),
    **WINDOW_CASES,
    "d128-window-3-programs": dict(b=1, sq=896, sk=896, hq=2, hkv=2, d=128, opts=dict(sliding_window=(100, 0)),
                                   num_sms="3"),
    # the soft cap (Gemma 2: 50 on the attention logits; a small cap makes the tanh matter)
    "d128-causal-softcap": dict(b=2, sq=2048, sk=2048, hq=4, hkv=2, d=128, opts=dict(causal=True,
                                                                                    logits_soft_cap=5.0)),
    "d64-softcap-sinks-ragged": dict(b=1, sq=1000, sk=1100, hq=4, hkv=4, d=64, opts=dict(logits_soft_cap=50.0),
                                     sinks=True),
    "d128-window-softcap": dict(b=1, sq=2048, sk=2048, hq=2, hkv=1, d=128, opts=dict(sliding_window=(300, 0),
                                                                                    logits_soft_cap=20.0)),
    # a cap above plan.SOFTCAP_FIXED_MAX_LOG2: the running row maximum
    "d128-causal-softcap-60": dict(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, opts=dict(causal=True,
                                                                                       logits_soft_cap=60.0)),
    # rows that see nothing under the soft cap (O = 0, lse = -inf)
    "d128-causal-softcap-empty-rows": dict(b=1, sq=1300, sk=1000, hq=2, hkv=1, d=128,
                                           opts=dict(causal=True, logits_soft_cap=10.0)),
    # D = 256: 64-key tiles, O staged in Q's buffers (the next item's Q waits for O's store)
    "d256-causal-gqa": dict(b=2, sq=1024, sk=1024, hq=4, hkv=2, d=256, opts=dict(causal=True)),
    "d256-ragged": dict(b=2, sq=1000, sk=1100, hq=2, hkv=2, d=256, opts={}),
    "d256-causal-3-programs": dict(b=1, sq=896, sk=896, hq=2, hkv=1, d=256, opts=dict(causal=True), num_sms="3"),
    "d256-causal-empty-rows-2-programs": dict(b=1, sq=1300, sk=1000, hq=2, hkv=1, d=256, opts=dict(causal=True),
                                              num_sms="2"),
    "d256-window-softcap-sinks": dict(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=256,
                                      opts=dict(sliding_window=(300, 0), logits_soft_cap=20.0), sinks=True),
    # head dims padded to the next tile width (the columns past D: TMA's zeros on loads, clipped on the store)
    "d96-causal-gqa-ragged": dict(b=2, sq=1000, sk=1100, hq=4, hkv=2, d=96, opts=dict(causal=True)),
    "d96-window-softcap-sinks-3-programs": dict(b=1, sq=896, sk=896, hq=2, hkv=1, d=96, num_sms="3", sinks=True,
                                                opts=dict(sliding_window=(200, 0), logits_soft_cap=20.0)),
    "d192-ragged": dict(b=2, sq=1000, sk=1100, hq=2, hkv=2, d=192, opts={}),
    "d192-causal-3-programs": dict(b=1, sq=896, sk=896, hq=4, hkv=2, d=192, opts=dict(causal=True), num_sms="3"),
    "d80-causal": dict(b=1, sq=1024, sk=1024, hq=4, hkv=4, d=80, opts=dict(causal=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_gluon_forward(case, monkeypatch, seed):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    kernels = spy_kernels(monkeypatch, "plan_forward")
    set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "1")   # short windows too (hopper.short_window_forward)
    check_gpu_case(monkeypatch, GPU_CASES[case], seed, {"persistent": flash_plan.PERSISTENT_ENV})
    assert kernels == [GLUON_FWD], kernels


def _wide_head_case(seed: int) -> dict:
    """A random case for the Gluon forward's wide and padded head dims (hopper.gluon_tile_width): any
    multiple of 16 from 80 to 256, GQA, ragged lengths (Sq a multiple of 4 from 128: the Gluon kernels' lse
    rows), causal or not, a causal window, the soft cap and sinks at random."""
    import random
    rng = random.Random(seed)
    d = rng.choice([80, 96, 112, 144, 160, 176, 192, 208, 224, 240, 256])
    hq, hkv = rng.choice([(2, 1), (4, 2), (4, 4), (6, 2), (8, 1)])
    opts = {"causal": rng.random() < 0.6}
    if opts["causal"] and rng.random() < 0.4:
        opts = {"sliding_window": (rng.randrange(16, 700), 0)}
    if rng.random() < 0.4:
        opts["logits_soft_cap"] = rng.choice([5.0, 20.0, 50.0])
    return dict(b=rng.choice([1, 2]), sq=4 * rng.randrange(32, 300), sk=rng.randrange(100, 1300), hq=hq, hkv=hkv,
                d=d, opts=opts, sinks=rng.random() < 0.3, dtype=rng.choice([torch.bfloat16, torch.float16]))


@pytest.mark.gpu
@pytest.mark.parametrize("draw", range(16))
def test_gpu_gluon_forward_wide_heads_at_random(monkeypatch, seed, draw):
    """Random wide and padded head-dim cases (_wide_head_case) on the Gluon forward against the float64
    reference, forward and backward (the backward its plan takes); the plan took the Gluon forward."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    kernels = spy_kernels(monkeypatch, "plan_forward")
    set_switch(monkeypatch, flash_plan.GLUON_FWD_ENV, "1")   # short windows too (hopper.short_window_forward)
    case = _wide_head_case(seed + draw)
    check_gpu_case(monkeypatch, case, seed, {})
    assert kernels == [GLUON_FWD], (case, kernels)


SHORT_WINDOW_GPU_CASES = {
    # GPT-OSS's sliding layers: window 128 with a sink per head, GQA; ragged lengths, more keys than queries
    "d64-window128-sinks-gqa": dict(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=64, opts=dict(sliding_window=(127, 0)),
                                    sinks=True),
    "d64-window1000-ragged": dict(b=1, sq=1000, sk=1100, hq=2, hkv=1, d=64, opts=dict(sliding_window=(999, 0))),
    "d128-window100-sinks-ragged": dict(b=1, sq=900, sk=1000, hq=4, hkv=4, d=128,
                                        opts=dict(sliding_window=(100, 0)), sinks=True),
    "d128-window-one-key": dict(b=1, sq=512, sk=512, hq=2, hkv=2, d=128, opts=dict(sliding_window=(0, 0))),
    # the Gluon forward, the portable backward on its short-window tiles
    "d128-window400-gqa-ragged": dict(b=1, sq=1000, sk=1100, hq=4, hkv=2, d=128, opts=dict(sliding_window=(399, 0))),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SHORT_WINDOW_GPU_CASES))
def test_gpu_short_windows_run_the_portable_kernels(case, monkeypatch, seed):
    """hopper.short_window_forward's and short_window_backward's cases on the GPU: the portable forward, and up
    to SHORT_WINDOW_BWD_KEYS the two-pass backward (test_plan_runs_short_windows_on_the_portable_backward: not
    warp-specialised), forward and backward against the float64 reference."""
    from dualattn.kernels.flash import hopper
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the rule chooses between sm_90 kernels")
    forward, backward = spy_kernels(monkeypatch, "plan_forward"), spy_kernels(monkeypatch, "plan_backward")
    case = SHORT_WINDOW_GPU_CASES[case]
    check_gpu_case(monkeypatch, case, seed, {})
    keys = case["opts"]["sliding_window"][0] + 1
    if keys <= hopper.SHORT_WINDOW_KEYS[case["d"]]:
        assert forward == ["flash_fwd_kernel"], forward
    if keys <= hopper.SHORT_WINDOW_BWD_KEYS[case["d"]]:
        assert backward == ["flash_bwd_dkdv_kernel"], backward


@pytest.mark.gpu
def test_gpu_gluon_forward_sink_values(monkeypatch, seed):
    """Sinks of -inf (switched off), +inf (take the row whole: O = 0, lse = +inf), several per head
    and shared by all heads, in the Gluon forward, against the float64 reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(1, 1024, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    per_head = torch.randn(4, 3, device="cuda", generator=gen)
    per_head[0] = float("-inf")
    per_head[1, 1] = float("inf")
    per_head[2, 0] = float("-inf")
    for sinks in (per_head, torch.randn(3, device="cuda", generator=gen) + 4.0):
        kernels = spy_kernels(monkeypatch, "plan_forward")
        out, lse = flash_attention(q, k, v, causal=True, softmax_aux=sinks, return_lse=True)
        assert kernels == [GLUON_FWD], kernels
        ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=True, softmax_aux=sinks)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        assert_close_rel(out, ref_out, 1e-2, "out")
        assert torch.equal(lse == float("inf"), ref_lse == float("inf"))
        finite = torch.isfinite(ref_lse)
        assert_close_rel(lse[finite], ref_lse[finite], 1e-2, "lse")


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [50.0, 2.0])
def test_gpu_gluon_forward_saturated_soft_cap(monkeypatch, seed, cap):
    """The soft cap's fixed reference (plan.gluon_softcap) at its extremes: rows whose every score saturates at
    -cap (uniform attention, P at its smallest), at +cap (P at its largest), and rows a mask leaves empty (O = 0,
    lse = -inf), against the float64 reference."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    gen = torch.Generator(device="cuda").manual_seed(seed)
    d, s = 128, 1024
    direction = torch.randn(d, device="cuda", generator=gen)
    direction /= direction.norm()
    k = (direction * 4.0 + 0.01 * torch.randn(1, s, 2, d, device="cuda", generator=gen)).bfloat16()
    sign = torch.where(torch.arange(s, device="cuda") % 3 == 0, 1.0, -1.0)[None, :, None, None]
    q = (sign * 1e3 * direction + torch.randn(1, s, 2, d, device="cuda", generator=gen)).bfloat16()
    v = torch.randn(1, s, 2, d, device="cuda", generator=gen).bfloat16()
    mask = torch.ones(1, 1, s, s, dtype=torch.bool, device="cuda")
    mask[..., 5::7, :] = False
    launches = spy_launches(monkeypatch, "plan_forward")
    out, lse = flash_attention(q, k, v, causal=True, logits_soft_cap=cap, attention_mask=mask, return_lse=True)
    assert [(one.kernel, one.constexpr_dict["SOFTCAP"]) for one in launches] == [
        (GLUON_FWD, rules.SOFTCAP_MUFU_FIXED_MAX)], launches
    ref_out, ref_lse = reference_attention(q.double(), k.double(), v.double(), causal=True, logits_soft_cap=cap,
                                           attention_mask=mask)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert_close_rel(out, ref_out, 1e-2, "out")
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert_close_rel(lse[finite], ref_lse[finite], 1e-2, "lse")


def _runs(*runs):
    """Segment ids as (id, length) runs."""
    return torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in runs])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("docs", ["tile-aligned", "ragged", "repeated-id", "wide-int64"])
def test_gpu_gluon_forward_documents(monkeypatch, seed, causal, docs):
    """Segment ids on the Gluon forward: each query tile visits its key tiles that share an id (the
    segment ranges), compares ids only outside its one-id run; documents aligned to the 128-row tiles
    or not, an id that comes back later (a wider range, compared), ids of 2**40 and more (int64).
    Against the float64 reference, forward and backward (the backward runs the portable kernels)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    ids = {"tile-aligned": _runs((0, 512), (1, 1024), (2, 512)),
           "ragged": _runs((0, 300), (1, 1000), (2, 517), (3, 231)),
           "repeated-id": _runs((0, 700), (1, 600), (0, 400), (2, 348)),
           "wide-int64": _runs((2 ** 40, 900), (2 ** 40 + 1, 1148))}[docs]
    s = len(ids)
    seg = ids[None].expand(2, s).contiguous().cuda()
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, s, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, s, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    chains = spy_chains(monkeypatch)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, causal=causal, q_segment_ids=seg, kv_segment_ids=seg, return_lse=True)
    assert chains == [["segment_ranges_kernel", GLUON_FWD]], chains
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = reference_attention(*ref_leaves, causal=causal, q_segment_ids=seg, kv_segment_ids=seg)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert not torch.isnan(out).any()
    assert_close_rel(out, ref_out, 1e-2, "out")
    assert_close_rel(lse, ref_lse, 1e-2, "lse")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, 1e-2, name)


# Bias and attention mask on the Gluon forward: shapes (batch or 1, heads or 1), dtypes and the options
# they combine with.  (b, sq, sk, hq, hkv, d, options, bias (shape, dtype) or None, mask shape or None)
SCORED_CASES = {
    "d128-causal-bias-gqa": (2, 1024, 1024, 4, 2, 128, dict(causal=True), ((2, 4), torch.bfloat16), None),
    "d128-mask-ragged-q": (2, 1000, 1104, 4, 4, 128, {}, None, (2, 1)),
    "d128-fp16-bias-heads-shared-cross": (1, 512, 2048, 4, 4, 128, dict(softmax_scale=0.2),
                                          ((1, 1), torch.float16), None),
    "d64-fp32-bias-mask-softcap-sinks": (2, 768, 768, 4, 2, 64, dict(causal=True, logits_soft_cap=5.0),
                                         ((1, 4), torch.float32), (2, 4)),
    "d64-window-bias-documents": (2, 1024, 1024, 4, 4, 64, dict(sliding_window=(200, 0)),
                                  ((2, 1), torch.bfloat16), None),
    # two tiles in flight (hopper.gluon_score_buffers): over many key tiles, and over one (an empty commit group)
    "d128-causal-mask-gqa": (1, 1024, 1024, 8, 2, 128, dict(causal=True), None, (1, 8)),
    "d64-bias-mask-one-key-tile": (2, 256, 104, 4, 4, 64, {}, ((2, 4), torch.bfloat16), (2, 4)),
    # a 16-bit bias at D = 128 holds its second tiles in O's staging buffers: several items a program, an odd
    # count of key tiles (the last item's O store, then the next item's second tile, in the same buffer)
    "d128-bias-items-share-o-buffers": (1, 4096, 384, 16, 4, 128, {}, ((1, 16), torch.bfloat16), None),
    # D = 256's 64-key tiles (two in flight for a mask or a 16-bit bias alone, else one), and padded head dims
    # (192 on them, 96 on D = 128's)
    "d256-causal-mask-gqa-softcap": (1, 1024, 1024, 4, 2, 256, dict(causal=True, logits_soft_cap=20.0), None,
                                     (1, 4)),
    "d256-fp32-bias-ragged": (2, 1000, 1104, 2, 2, 256, {}, ((2, 1), torch.float32), None),
    "d256-bias-mask-window": (1, 1024, 1024, 4, 4, 256, dict(sliding_window=(300, 0)),
                              ((1, 4), torch.bfloat16), (1, 1)),
    "d192-causal-bias-mask-gqa": (2, 768, 768, 4, 2, 192, dict(causal=True), ((2, 4), torch.bfloat16), (2, 4)),
    "d96-mask-cross": (1, 512, 2048, 4, 4, 96, {}, None, (1, 4)),
    "d96-causal-fp16-bias-ragged": (2, 1000, 1000, 4, 2, 96, dict(causal=True), ((1, 4), torch.float16), None),
    # (the load warp as the default partition: hopper.gluon_load_first)
    "d128-causal-mask-window-ragged": (2, 1000, 1000, 4, 4, 128, dict(causal=True, sliding_window=(300, 0)), None,
                                       (2, 4)),
    "d96-causal-mask-cross": (1, 700, 1400, 4, 2, 96, dict(causal=True), None, (1, 4)),
}


def test_plan_holds_score_tiles_twice_where_they_fit():
    """hopper.gluon_score_buffers: two bias / mask tiles per warpgroup where both fit twice beside the
    forward's other buffers (a mask alone at D = 128; a 16-bit bias and a mask at D = 64), or where a 16-bit
    bias alone at D = 128 keeps its second tiles in O's staging buffers, a 16-bit bias or a mask at D = 256,
    else one; the plan passes it as SCORE_BUFS."""
    from dualattn.kernels.flash import hopper

    def bufs(d, bias=None, mask=False):
        shapes, options, strides, config = gluon_problem(d=d, bias=bias is not None, mask=mask)
        shapes = dataclasses.replace(shapes, bias_dtype=bias or "")
        launch = flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                         num_sms=132)
        assert launch.kernel == GLUON_FWD
        assert launch.constexpr_dict["SCORE_BUFS"] == hopper.gluon_score_buffers(shapes)
        return launch.constexpr_dict["SCORE_BUFS"]
    assert [bufs(128, mask=True), bufs(128, "bfloat16"), bufs(128, "float16"), bufs(128, "bfloat16", True),
            bufs(128)] == [2, 2, 2, 1, 1]
    assert [bufs(64, "bfloat16", True), bufs(64, "float16"), bufs(64, "float32"), bufs(64, mask=True)] == [2, 2, 1, 2]
    # by the tiles' width: D = 96 as 128, D = 192 as 256 (64-key tiles: a 16-bit bias or a mask twice)
    assert [bufs(96, mask=True), bufs(96, "bfloat16"), bufs(96, "bfloat16", True)] == [2, 2, 1]
    assert [bufs(d, *args) for d in (256, 192) for args in ((None, True), ("bfloat16",), ("bfloat16", True),
                                                            ("float32",))] == [2, 2, 1, 1] * 2


def test_plan_runs_the_load_warp_first_for_causal_masks_on_128_wide_tiles():
    """hopper.gluon_load_first: the load warp is the default partition (LOAD_FIRST) for a causal mask at D = 96-128,
    and for nothing else."""
    def load_first(d, causal, mask=False, bias=False):
        launch = _plan(d=d, causal=causal, mask=mask, bias=bias)
        assert launch.kernel == GLUON_FWD
        return launch.constexpr_dict["LOAD_FIRST"]
    assert [load_first(128, True, mask=True), load_first(96, True, mask=True)] == [True, True]
    assert [load_first(128, False, mask=True), load_first(128, True, bias=True), load_first(128, True),
            load_first(64, True, mask=True), load_first(256, True, mask=True)] == [False] * 5


def test_load_warp_first_spills_less_for_the_causal_mask(monkeypatch):
    """The causal masked forward at D = 128 with the load warp as the default partition (both compute warpgroups
    240-register workers) spills less than with the first compute warpgroup as the default, whose key loop then
    reloads spilled registers on every key tile (NOTES: "The causal mask at D = 128 spills in one warpgroup's
    loop"); both orders compile within sm_90's shared memory."""
    dtypes = {**dict.fromkeys(("query", "key", "value", "out"), "bfloat16"), "lse": "float32", "attention_mask": "int8"}
    spills = {}
    for first in (True, False):
        monkeypatch.setattr(flash_plan, "gluon_load_first", lambda shapes, causal, first=first: first)
        flash_plan.forget_plans()
        launch = _plan(d=128, causal=True, mask=True, sq=4096, sk=4096)
        assert launch.kernel == GLUON_FWD and launch.constexpr_dict["LOAD_FIRST"] == first
        compiled = compile_check.compile_launch(launch, dtypes, arch=90)
        assert compiled.metadata.shared <= 232448
        spills[first] = compile_check.ptxas_usage(compiled, 90)[1]
    flash_plan.forget_plans()
    assert spills[True] < spills[False], spills


def test_mask_pairs_reach_the_scores_layout_without_shared_memory():
    """gluon_shared.masked_scores reads the mask tile as int16 pairs in mask_pairs_layout and joins their
    bounds into S's layout: a conversion that moves no data, so the masked forward stores to shared memory
    exactly where the plain one does (its mask reaches shared memory by cp.async, not st.shared)."""
    dtypes = {**dict.fromkeys(("query", "key", "value", "out"), "bfloat16"), "lse": "float32", "attention_mask": "int8"}
    stores = []
    for mask in (True, False):
        launch = _plan(d=128, mask=mask)
        assert launch.kernel == GLUON_FWD
        stores.append(compile_check.compile_launch(launch, dtypes, arch=90).asm["ptx"].count("st.shared"))
    assert stores[0] == stores[1], stores


def test_bias_second_tiles_in_o_buffers_fit_shared_memory(monkeypatch):
    """A 16-bit bias at D = 128 holds two tiles per warpgroup, the second in O's staging buffer (O_SCORES):
    the compiled variant takes no more shared memory than one tile did, within sm_90's 227 KB."""
    shapes, options, strides, config = gluon_problem(d=128, causal=True, bias=True)
    shapes = dataclasses.replace(shapes, bias_dtype="bfloat16")
    dtypes = {**dict.fromkeys(("query", "key", "value", "bias"), "bfloat16"), "lse": "float32"}
    sizes = {}
    for bufs in (2, 1):
        monkeypatch.setattr(flash_plan, "gluon_score_buffers", lambda s, bufs=bufs: bufs)
        flash_plan.forget_plans()
        launch = flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                         num_sms=132)
        assert launch.kernel == GLUON_FWD and launch.constexpr_dict["SCORE_BUFS"] == bufs
        sizes[bufs] = compile_check.compile_launch(launch, dtypes, arch=90).metadata.shared
    flash_plan.forget_plans()
    assert sizes[2] == sizes[1] <= 232448, sizes


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SCORED_CASES))
def test_gpu_gluon_forward_bias_and_mask(monkeypatch, seed, case):
    """The bias joins S before the cap and the mask after it, tiles copied a key tile ahead; masked
    rows (a query that sees no key) give O = 0 and lse = -inf.  Against the float64 reference,
    forward and backward (the bias here wants its gradient, so cases with one run the portable backward, which
    writes dbias; mask-only cases may run the one-pass backward)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    _check_scored_case(monkeypatch, seed, SCORED_CASES[case], documents=case.endswith("documents"))


def _scored_wide_case(seed: int):
    """A random SCORED_CASES-like case at the head dims the fixed cases leave out (80-240 but 96 and 192): a
    bias (16-bit or float32, broadcast or not) and / or a mask, GQA, ragged lengths, causal or not; and whether
    the Gluon forward's tiles fit it (on the 128-wide tiles a 16-bit bias or a mask, on the 256-wide ones
    anything but a float32 bias with a mask)."""
    import random
    rng = random.Random(seed)
    d = rng.choice([80, 112, 144, 160, 176, 208, 224, 240])
    b = rng.choice([1, 2])
    hq, hkv = rng.choice([(2, 1), (4, 2), (4, 4)])
    bias_spec = rng.choice([None, ((b, hq), torch.bfloat16), ((1, hq), torch.float32), ((b, 1), torch.float16)])
    mask_shape = rng.choice([None, (b, hq), (1, 1)]) if bias_spec else rng.choice([(b, hq), (1, hq)])
    f32_bias = bias_spec is not None and bias_spec[1] == torch.float32
    fits = (not (f32_bias or (bias_spec and mask_shape))) if d < 128 else not (f32_bias and mask_shape)
    spec = (b, 4 * rng.randrange(32, 200), 8 * rng.randrange(26, 150), hq, hkv, d, {"causal": rng.random() < 0.5},
            bias_spec, mask_shape)
    return spec, fits


@pytest.mark.gpu
@pytest.mark.parametrize("draw", range(8))
def test_gpu_gluon_forward_bias_and_mask_wide_heads_at_random(monkeypatch, seed, draw):
    """_scored_wide_case's random cases against the float64 reference: the Gluon forward where its tiles fit, the
    portable one where they do not."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon forward is a kernel for sm_90 only")
    spec, fits = _scored_wide_case(seed + draw)
    _check_scored_case(monkeypatch, seed, spec, forward=GLUON_FWD if fits else "flash_fwd_kernel")


def _check_scored_case(monkeypatch, seed, spec, documents=False, forward=GLUON_FWD):
    """Run one bias / mask case (SCORED_CASES' form) forward and backward against the float64 reference; the
    forward's last launch was `forward`."""
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    b, sq, sk, hq, hkv, d, opts, bias_spec, mask_shape = spec
    dtype = bias_spec[1] if bias_spec and bias_spec[1] == torch.float16 else torch.bfloat16
    q, k, v, dout, extra = scored_inputs(b, sq, sk, hq, hkv, d, opts, bias_spec, mask_shape, seed,
                                         documents=documents, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    if bias_spec:
        extra["bias"].requires_grad_()
    chains = spy_chains(monkeypatch)
    out, lse = flash_attention(*leaves, return_lse=True, **extra)
    assert chains[-1][-1] == forward, (spec, chains)
    grad_leaves = leaves + ([extra["bias"]] if bias_spec else [])
    grads = torch.autograd.grad(out, grad_leaves, dout)
    ref_extra = dict(extra)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    if bias_spec:
        ref_extra["bias"] = extra["bias"].detach().double().requires_grad_()
    ref_out, ref_lse = reference_attention(*ref_leaves, **ref_extra)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves + ([ref_extra["bias"]] if bias_spec else []), dout.double())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close_rel(out, ref_out, 1e-2, "out")
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "lse -inf pattern (rows with nothing visible)"
    assert_close_rel(lse[finite], ref_lse[finite], 1e-2, "lse")
    if mask_shape:   # (with sinks the row's lse is theirs)
        assert (out[0, 5, 0] == 0).all() and ("softmax_aux" in extra or lse[0, 0, 5] == float("-inf"))
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close_rel(g, r, 2e-2 if name == "dbias" else 1e-2, name)


@pytest.mark.gpu
def test_gpu_scored_wide_heads_that_do_not_fit_run_the_small_portable_tile(monkeypatch, seed):
    """A float32 bias with a mask at D = 256 does not fit the Gluon forward's shared memory: the portable forward
    runs it on tiles.SCORED_WIDE_FWD_TILE; against the float64 reference, forward and backward."""
    from dualattn.kernels.flash import tiles
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    planned, real = [], flash_plan.plan_forward
    monkeypatch.setattr(flash_plan, "plan_forward", lambda *a, **k: planned.append(real(*a, **k)) or planned[-1])
    q, k, v, dout, extra = scored_inputs(2, 600, 704, 2, 2, 256, dict(causal=True), ((2, 1), torch.float32), (1, 2),
                                         seed)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **extra)
    last = planned[-1].chain[-1]
    assert last.kernel == "flash_fwd_kernel"
    assert (last.constexpr_dict["BLOCK_M"], last.constexpr_dict["BLOCK_N"], last.num_warps) == (
        tiles.SCORED_WIDE_FWD_TILE.block_m, tiles.SCORED_WIDE_FWD_TILE.block_n, tiles.SCORED_WIDE_FWD_TILE.num_warps)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, **extra)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert not torch.isnan(out).any()
    assert_close_rel(out, ref_out, 1e-2, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, 1e-2, name)


def test_fit_compiles_the_gluon_forward_once_for_every_length(monkeypatch):
    """The shared-memory check of a Gluon launch with a bias does not depend on the sequence lengths:
    one compile serves them all (each takes seconds of host time)."""
    from dualattn.kernels.flash import fit
    compiles = []
    real = fit.compile_check.compile_launch
    monkeypatch.setattr(fit.compile_check, "compile_launch", lambda *a, **k: compiles.append(1) or real(*a, **k))
    fit._shared_bytes.cache_clear()
    dtypes = {**dict.fromkeys(("query", "key", "value"), "bfloat16"), "bias": "bfloat16"}
    for seqlen in (1024, 2048, 3072):
        shapes, options, strides, config = gluon_problem(d=64, causal=True, sq=seqlen, sk=seqlen, bias=True)
        launch = fit.forward(shapes, options, strides, config=config, arch=90, max_shared=fit.MAX_SHARED_BYTES[90],
                             dtypes=dtypes, warp_specialize=True, gluon=True, num_sms=132)
        assert launch.kernel == GLUON_FWD
    assert len(compiles) == 1
