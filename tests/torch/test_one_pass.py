"""The one-pass Gluon backward (kernels/flash/backward_gluon.py, plan.one_pass_backward).

Gluon has no interpreter: on the CPU these tests check which problems the plan sends to it and
that every variant compiles for sm_90 (the GPU tests then check its numbers against the float64
reference, through the public torch API, and that the plan took it: none can pass by never
running it).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.flash import rules  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402
from dualattn.kernels.launch import row_major_strides  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.validation import FlashShapes  # noqa: E402
from plan_spy import spy_chains, spy_kernels  # noqa: E402

ONE_PASS = "flash_bwd_one_pass_kernel"


@pytest.fixture(autouse=True)
def one_pass_at_any_length(monkeypatch):
    """DUALATTN_ONE_PASS=1: the one-pass kernel whatever the keys (plan.ONE_PASS_MIN_KEYS is a speed
    rule; these tests are about the kernel), unless a test says otherwise."""
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, None)


def gluon_problem(b=2, sq=1024, sk=1024, hq=4, hkv=4, d=128, dtype="bfloat16", strides=None, **opts):
    """(shapes, options, strides, config) of a plan for the Gluon kernels' tests (this file and
    test_gluon_forward.py); `strides` replaces some of the contiguous ones."""
    segments, bias, mask = (opts.pop(n, False) for n in ("segments", "bias", "mask"))
    shapes = FlashShapes(b, sq, sk, hq, hkv, d, d, dtype, num_sinks=1 if opts.pop("sinks", False) else 0,
                         sinks_per_head=True, has_bias=bias, has_mask=mask, has_segments=segments)
    options = FlashOptions.build(head_dim=d, **opts)
    contiguous = {n: row_major_strides((b, s, h, d)) for n, s, h in
                  (("query", sq, hq), ("key", sk, hkv), ("value", sk, hkv), ("out", sq, hq))}
    if segments:
        contiguous.update(q_segment_ids=(sq, 1), kv_segment_ids=(sk, 1))
    for name, present in (("bias", bias), ("attention_mask", mask)):   # (B, Hq, Sq, Sk)
        if present:
            contiguous[name] = row_major_strides((b, hq, sq, sk))
    return shapes, options, {**contiguous, **(strides or {})}, flash_plan.default_config(shapes, interpret=False)


def _plan(gluon=True, q_strides=None, num_sms=132, bias_grad=True, **kwargs):
    shapes, options, strides, config = gluon_problem(
        strides=None if q_strides is None else {"query": q_strides}, **kwargs)
    return flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True, gluon=gluon,
                                    num_sms=num_sms, bias_grad=bias_grad)


def test_plan_takes_the_one_pass_backward_where_it_applies():
    plan = _plan()
    assert (plan.dkdv.kernel, plan.dq.kernel) == (ONE_PASS, "flash_bwd_dq_convert_kernel")
    assert plan.dq.inputs == ("dq_accum",)
    assert [o.name for o in plan.dkdv.results] == ["dkey", "dvalue", "dq_accum"]
    # persistent: 64 work items (key tiles of 128 x batch * KV heads) over at most 132 programs
    assert plan.dkdv.grid == (64, 1, 1) and plan.dkdv.constexpr_dict["PERSISTENT"]
    assert dict(plan.dkdv.scalars)["num_work"] == 64
    assert _plan(num_sms=32).dkdv.grid == (32, 1, 1)
    causal = _plan(causal=True, sq=1000, sk=1200, hq=8, hkv=2, d=64, sinks=True)
    assert causal.dkdv.kernel == ONE_PASS
    const, scalars = causal.dkdv.constexpr_dict, dict(causal.dkdv.scalars)
    assert (const["CAUSAL"], const["GROUP_SIZE"], const["HEAD_DIM"]) == (True, 4, 64)
    assert scalars["diag"] == 200 and scalars["num_heads_kv"] == 2
    # Sq not a multiple of 64, Sk of 128: a program per work item, descriptors per (batch, head group)
    assert causal.dkdv.grid == (10, 4, 1) and not const["PERSISTENT"]


def test_plan_takes_the_wide_one_pass_backward_at_d256():
    """D = 256: 64 x 64 tiles, two stages whose buffers also stage dQ (DQ_BUFS = STAGES, one dS^T buffer);
    causal persistent items are pairs of key tiles as at D = 128."""
    plan = _plan(d=256, causal=True, hq=8, hkv=2)
    const = plan.dkdv.constexpr_dict
    assert plan.dkdv.kernel == ONE_PASS and const["HEAD_DIM"] == 256
    tile = tuple(const[n] for n in ("BLOCK_M", "BLOCK_N", "STAGES", "DQ_BUFS", "DS_BUFS"))
    assert tile == (64, 64, 2, 2, 1)
    assert const["PERSISTENT"] and dict(plan.dkdv.scalars)["num_work"] == 2 * 2 * (1024 // 64) // 2


@pytest.mark.parametrize("d, width, block_n", [(96, 128, 128), (80, 128, 128), (192, 256, 64), (144, 256, 64)])
def test_plan_pads_other_head_dims_on_the_one_pass_backward(d, width, block_n):
    """Multiples of 16 between the widths run the next width's tiles (hopper.gluon_tile_width), as the Gluon
    forward: BLOCK_D is the width, HEAD_DIM the head dim (the kernel's (rows, heads, dims) descriptors)."""
    const = _plan(d=d, causal=True, hq=8, hkv=2).dkdv.constexpr_dict
    assert (const["HEAD_DIM"], const["BLOCK_D"], const["BLOCK_N"]) == (d, width, block_n)
    assert _plan(d=d).dkdv.constexpr_dict["BLOCK_D"] == width


@pytest.mark.parametrize("why, kwargs", [
    ("no Gluon launcher (JAX, CPU)", dict(gluon=False)),
    ("head dim 72 (no tile width: not a multiple of 16)", dict(d=72)),
    ("fp32", dict(dtype="float32")),
    ("window with a right side", dict(sliding_window=(256, 256))),
    ("left window, not causal", dict(sliding_window=(256, None))),
    ("a bias that needs its gradient (dS goes out as dbias)", dict(bias=True)),
    ("a mask with Sk not a multiple of 8 (16-byte tile copies)", dict(mask=True, sk=1020)),
    ("lse rows not 16-byte aligned", dict(sq=1022, sk=1022)),
    ("GQA with query heads not side by side", dict(hq=8, hkv=2, q_strides=row_major_strides((2, 8, 1024, 128))[:1]
                                                   + (128, 1024 * 128, 1))),
])
def test_plan_keeps_the_two_pass_backward(why, kwargs):
    assert _plan(**kwargs).dkdv.kernel == "flash_bwd_dkdv_kernel", why


def test_one_pass_takes_the_soft_cap():
    """The soft cap on the one-pass kernel: the cap as a scalar, the tanh's form as SOFTCAP (the GPU's
    tanh.approx for 16-bit inputs on a GPU, as in the forward: plan.softcap_mode), and the variant
    compiles for sm_90 with the MUFU tanh in its PTX."""
    shapes, options, strides, config = gluon_problem(causal=True, hq=8, hkv=2, logits_soft_cap=30.0)
    plan = flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                    num_sms=132, hardware_tanh=True)
    assert plan.dkdv.kernel == ONE_PASS and plan.dkdv.constexpr_dict["SOFTCAP"] == rules.SOFTCAP_MUFU
    assert dict(plan.dkdv.scalars)["softcap"] == 30.0
    assert _plan(logits_soft_cap=30.0).dkdv.constexpr_dict["SOFTCAP"] == rules.SOFTCAP_EXP2
    assert _plan().dkdv.constexpr_dict["SOFTCAP"] == rules.SOFTCAP_NONE
    dtypes = dict.fromkeys(("query", "key", "value", "dout"), "bfloat16")
    dtypes.update(lse="float32", delta="float32")
    compiled = compile_check.compile_launch(plan.dkdv, dtypes, arch=90)
    assert "tanh.approx.f32" in compiled.asm["ptx"] and "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"]


def test_one_pass_off_with_env(monkeypatch):
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "0")
    assert _plan().dkdv.kernel == "flash_bwd_dkdv_kernel"


def test_one_pass_speed_rules(monkeypatch):
    """By default: from ONE_PASS_MIN_KEYS keys (4096; at D = 256 and padded head dims from
    ONE_PASS_MIN_KEYS_WIDE_OR_PADDED) to ONE_PASS_MAX_KEYS (32768: its fp32 dQ accumulator costs memory);
    non-causal persistent up to PERSISTENT_BWD_MAX_KEYS keys, causal persistent over pairs of key tiles
    wherever the key tiles pair up (DUALATTN_PERSISTENT=0 / 1 turns it off / on)."""
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, None)

    def layout(s, causal=False, sq=None):
        plan = _plan(b=1, sq=sq or s, sk=s, causal=causal)
        return plan.dkdv.kernel == ONE_PASS and (plan.dkdv.constexpr_dict["PERSISTENT"] and "persistent" or "grid")

    assert [layout(s) for s in (2048, 4096, 8192, 32768, 65536)] == [False, "persistent", "grid", "grid", False]
    assert [layout(s, causal=True) for s in (2048, 4096, 8192, 32768, 65536)] == [
        False, "persistent", "persistent", "persistent", False]
    assert layout(33 * 128, causal=True) == "grid"   # 33 key tiles: one would be left without a pair

    def one_pass(d, s):
        return _plan(b=1, sq=s, sk=s, d=d).dkdv.kernel == ONE_PASS

    # where the two-pass kernels are the portable ones (D = 256, padded head dims): from fewer keys
    assert [one_pass(256, s) for s in (256, 512)] == [False, True]
    assert [one_pass(192, s) for s in (256, 512)] == [False, True]
    assert [one_pass(96, s) for s in (256, 512, 2048)] == [False, True, True]
    assert [one_pass(128, s) for s in (1024, 2048)] == [False, False]
    assert layout(8192, causal=True, sq=4000) == "grid"   # a query tile would reach into the next batch
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "1")
    assert layout(8192) == "persistent"
    set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "0")
    assert [layout(4096), layout(8192, causal=True)] == ["grid", "grid"]


def test_causal_persistent_work_items_are_pairs_of_key_tiles():
    """Causal and persistent, a work item is two key tiles of one head (backward_gluon._work_item):
    half as many items as key tiles, so that every item holds the same work."""
    plan = _plan(b=2, sq=4096, sk=4096, hq=8, hkv=2, causal=True)
    key_tiles = 4096 // flash_plan.ONE_PASS_TILES[128][1] * 2 * 2
    assert plan.dkdv.constexpr_dict["PERSISTENT"]
    assert dict(plan.dkdv.scalars)["num_work"] == key_tiles // 2
    assert plan.dkdv.grid == (min(132, key_tiles // 2), 1, 1)


@pytest.mark.parametrize("d, extra", [(128, dict(bias=True)), (128, dict(mask=True)),
                                      (64, dict(bias=True, mask=True, causal=True, hq=8, hkv=2)),
                                      (256, dict(bias=True, mask=True, causal=True)),
                                      (96, dict(mask=True)), (192, dict(bias=True, causal=True, hq=8, hkv=2))])
def test_one_pass_takes_a_bias_without_grad_and_a_mask(d, extra):
    """A bias with no dbias wanted and an attention mask run on the one-pass kernel: their tiles are
    copied per query tile beside S^T (HAS_BIAS, HAS_MASK, the strides of the (batch, head, row)), and
    the variant compiles for sm_90."""
    plan = _plan(d=d, bias_grad=False, **extra)
    launch = plan.dkdv
    assert launch.kernel == ONE_PASS
    assert (launch.constexpr_dict["HAS_BIAS"], launch.constexpr_dict["HAS_MASK"]) == (
        extra.get("bias", False), extra.get("mask", False))
    assert {"bias", "attention_mask"} <= set(launch.inputs) and dict(launch.scalars)["bias_stride_s"] == (
        1024 if extra.get("bias") else 0)
    assert launch.constexpr_dict["HEAD_DIM"] == d
    dtypes = dict.fromkeys(("query", "key", "value", "dout"), "bfloat16")
    dtypes.update(lse="float32", delta="float32", bias="bfloat16", attention_mask="int8")
    compiled = compile_check.compile_launch(launch, dtypes, arch=90)
    assert "cp.async" in compiled.asm["ptx"] and compiled.asm["cubin"][:4] == b"\x7fELF"


def test_a_bool_mask_compiles_to_the_int8_masks_kernels():
    """JAX passes a bool attention mask as it is and torch views one as int8 (rules.mask_as_int8 reads
    the bytes): the Gluon forward, the one-pass backward and the portable dQ kernel compile to the same
    PTX for both, so neither front end converts the S x S tensor."""
    shapes, options, strides, config = gluon_problem(d=128, causal=True, mask=True)
    forward = flash_plan.plan_forward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                      num_sms=132)
    launches = [(forward.chain[-1], 90), (_plan(d=128, causal=True, mask=True).dkdv, 90),
                (_plan(d=64, mask=True, gluon=False).dq.chain[-1], 80)]
    assert [launch.kernel for launch, _ in launches] == ["flash_fwd_gluon_kernel", ONE_PASS, "flash_bwd_dq_kernel"]
    dtypes = dict.fromkeys(("query", "key", "value", "out", "dout"), "bfloat16")
    dtypes.update(lse="float32", delta="float32", softmax_aux="float32")
    for launch, arch in launches:
        ptx = [compile_check.compile_launch(launch, dict(dtypes, attention_mask=mask), arch=arch).asm["ptx"]
               for mask in ("int8", "bool")]
        assert ptx[0] == ptx[1], launch.kernel


@pytest.mark.parametrize("d, extra, one_pass", [
    (128, dict(bias="bfloat16"), True), (128, dict(mask=True), True), (128, dict(bias="float32"), False),
    (128, dict(bias="bfloat16", mask=True), False), (64, dict(bias="float32", mask=True), True),
    (256, dict(bias="float32"), True), (256, dict(bias="bfloat16", mask=True), True)])
def test_fit_keeps_the_one_pass_backward_where_the_score_tiles_fit(d, extra, one_pass):
    """The bias and mask tiles take shared memory beside K, V, Q, dO, dS and dQ: at D=128 one 16-bit
    tile fits, a float32 one or both do not (fit.backward then plans the two-pass kernels); at D=256 the
    64 x 64 tiles fit, a float32 bias with 1,684 bytes to spare."""
    from dualattn.kernels.flash import fit
    bias_dtype = extra.get("bias")
    shapes, options, strides, config = gluon_problem(d=d, causal=True, sq=1024, sk=1024, bias=bias_dtype is not None,
                                                     mask=extra.get("mask", False))
    dtypes = {**dict.fromkeys(("query", "key", "value", "dout"), "bfloat16"), "lse": "float32",
              "attention_mask": "int8", **({"bias": bias_dtype} if bias_dtype else {})}
    plan = fit.backward(shapes, options, strides, config=config, arch=90, max_shared=fit.MAX_SHARED_BYTES[90],
                        dtypes=dtypes, warp_specialize=True, gluon=True, num_sms=132, bias_grad=False)
    assert (plan.dkdv.kernel == ONE_PASS) == one_pass, plan.dkdv.kernel


@pytest.mark.parametrize("d, causal, hq, hkv, dtype, sq, window", [
    (128, False, 4, 4, "bfloat16", 1024, None), (128, True, 8, 2, "bfloat16", 1024, None),
    (64, False, 8, 2, "float16", 1024, None), (64, True, 4, 4, "bfloat16", 1024, None),
    (128, True, 4, 2, "bfloat16", 1000, None), (64, False, 4, 4, "bfloat16", 1000, None),
    (128, False, 4, 2, "bfloat16", 1024, (300, 0)), (256, True, 4, 2, "bfloat16", 1024, None),
    (256, False, 4, 4, "float16", 1000, (300, 0)), (192, True, 4, 2, "bfloat16", 1024, None),
    (96, False, 4, 4, "bfloat16", 1000, None)])
def test_one_pass_compiles_for_sm90(d, causal, hq, hkv, dtype, sq, window):
    """The Gluon kernel (persistent; per work item where Sq = 1000) and the dQ cast compile for
    sm_90 (GluonASTSource); the two worker warps take one more warpgroup next to the 8 compute warps
    and 24 registers, the compute warpgroups 240 (FA3's split)."""
    plan = _plan(d=d, causal=causal, hq=hq, hkv=hkv, dtype=dtype, sq=sq, sk=sq, sliding_window=window)
    assert plan.dkdv.constexpr_dict["PERSISTENT"] == (sq == 1024)
    assert plan.dkdv.constexpr_dict["WINDOW"] == (window is not None)
    dtypes = dict.fromkeys(("query", "key", "value", "dout"), dtype)
    dtypes.update(lse="float32", delta="float32")
    compiled = compile_check.compile_launch(plan.dkdv, dtypes, arch=90)
    ptx = compiled.asm["ptx"]
    assert compiled.metadata.num_warps == 12   # the two 1-warp workers take a warpgroup together
    assert set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)) >= {("inc", "240"), ("dec", "24")}
    assert "cp.reduce.async.bulk.tensor" in ptx   # dQ reduced by TMA, not atomics
    assert compiled.asm["cubin"][:4] == b"\x7fELF"
    convert = compile_check.compile_launch(plan.dq, {"dq_accum": "float32", "query": dtype}, arch=90)
    assert f".entry {plan.dq.kernel}(" in convert.asm["ptx"]


@pytest.mark.parametrize("d, causal, hq, hkv, sq, sk", [(128, True, 8, 2, 4096, 4096), (64, False, 4, 4, 1000, 1024)])
def test_one_pass_takes_segment_ids(d, causal, hq, hkv, sq, sk):
    """Segment ids: the one-pass kernel after the launch of its key tiles' segment ranges (keys of
    BLOCK_N own, queries of BLOCK_M iterated), and it compiles for sm_90."""
    plan = _plan(d=d, causal=causal, hq=hq, hkv=hkv, sq=sq, sk=sk, segments=True)
    ranges, one_pass = plan.dkdv.chain
    assert (ranges.kernel, one_pass.kernel, plan.dq.kernel) == (
        "segment_ranges_kernel", ONE_PASS, "flash_bwd_dq_convert_kernel")
    block_m, block_n = flash_plan.ONE_PASS_TILES[d][:2]
    assert ranges.constexpr_dict == {"BLOCK_OWN": block_n, "BLOCK_OTHER": block_m, "OWN_IS_QUERY": False,
                                     "CHUNK_TILES": flash_plan.SEGMENT_CHUNK // block_m, "FROM_TILE_IDS": False}
    assert ranges.grid == (-(-sk // block_n), 2, 1)
    assert one_pass.constexpr_dict["SEGMENTS"] and one_pass.resume == (("segment_ranges", "segment_ranges"),)
    assert not _plan(d=d, causal=causal, hq=hq, hkv=hkv, sq=sq, sk=sk).dkdv.constexpr_dict["SEGMENTS"]
    dtypes = dict.fromkeys(("query", "key", "value", "dout"), "bfloat16")
    dtypes.update(lse="float32", delta="float32", q_segment_ids="int32", kv_segment_ids="int32",
                  segment_ranges="int32")
    compiled = compile_check.compile_launch(one_pass, dtypes, arch=90)
    assert "cp.reduce.async.bulk.tensor" in compiled.asm["ptx"] and compiled.asm["cubin"][:4] == b"\x7fELF"


@pytest.mark.parametrize("segments", [False, True])
def test_a_partial_last_key_tile_runs_masked(segments):
    """Keys past a partial last key tile read as zeros from TMA, where P would be exp(-lse): EVEN_K off
    masks every query tile of that key tile by position (and a caller's query id -1 cannot meet the
    keys' padding id); the variant compiles for sm_90."""
    assert _plan(sq=1024, sk=1280, segments=segments).dkdv.chain[-1].constexpr_dict["EVEN_K"]
    one_pass = _plan(sq=1000, sk=1300, segments=segments).dkdv.chain[-1]
    assert one_pass.kernel == ONE_PASS and not one_pass.constexpr_dict["EVEN_K"]
    dtypes = dict.fromkeys(("query", "key", "value", "dout"), "bfloat16")
    dtypes.update(lse="float32", delta="float32", q_segment_ids="int32", kv_segment_ids="int32",
                  segment_ranges="int32")
    assert compile_check.compile_launch(one_pass, dtypes, arch=90).asm["cubin"][:4] == b"\x7fELF"


def _cdiv(a, b):
    return -(-a // b)


def one_pass_query_tiles(n0, sq, sk, causal, window_left, ranges, bm=64, bn=128):
    """A transcription of backward_gluon._query_tiles and _work_item's narrowing (diag = Sk - Sq):
    (the query tiles a key tile at n0 visits, those of them that run unmasked)."""
    diag, n_tiles = sk - sq, _cdiv(sq, bm)
    if causal:
        i_start = max(n0 - diag, 0) // bm
        i_full = _cdiv(max(n0 + bn - 1 - diag, 0), bm)
        i_end = i_tail = n_tiles
        if window_left is not None:
            last = n0 + bn - 1 - diag + window_left
            i_end = min(max(last, 0) // bm + 1, n_tiles) if last >= 0 else 0
            edge = n0 - diag + window_left - bm + 1
            i_tail = max(edge, 0) // bm + 1 if edge >= 0 else 0
        n_local = max(i_end - i_start, 0)
        n_mask = min(max(i_full - i_start, 0), n_local)
        n_tail = min(max(i_tail - i_start, n_mask), n_local)
    else:
        i_start, n_local, n_mask, n_tail = 0, n_tiles, 0, n_tiles
    plain_lo, plain_hi = n_mask, n_tail
    if ranges is not None:
        lo, hi, pure_lo, pure_hi = (int(x) for x in ranges)
        first = max(i_start, lo // bm)
        end = max(min(i_start + n_local, _cdiv(hi, bm)), first)
        pure_first, pure_end = max(i_start + n_mask, pure_lo // bm), min(i_start + n_tail, pure_hi // bm)
        n_local = end - first
        plain_lo = min(max(pure_first - first, 0), n_local)
        plain_hi = min(max(pure_end - first, plain_lo), n_local)
        i_start = first
    return set(range(i_start, i_start + n_local)), set(range(i_start + plain_lo, i_start + plain_hi))


@pytest.mark.parametrize("causal, window_left", [(False, None), (True, None), (True, 150)])
def test_one_pass_segment_tiles_cover_every_pair_and_mask_every_boundary(causal, window_left):
    """The key tiles' segment ranges (segments.py, modelled in test_segment_ranges.py) as the one-pass
    kernel uses them: every query tile holding a pair the key tile may attend is visited, and every
    tile it runs unmasked holds only pairs it may attend (same id, causal, window).  Documents on and
    off the tiles, repeated ids, Sq != Sk, a query id no key holds, random runs."""
    from test_segment_ranges import DOCS, expected_ranges, runs
    rng = np.random.default_rng(7)
    layouts = list(DOCS.values()) + [
        (runs((0, 300), (1, 340)), runs((0, 300), (1, 340))),
        (runs((5, 64), (6, 300), (5, 236)), runs((5, 64), (6, 300), (5, 236))),
        (runs((0, 200), (2, 100), (1, 400)), runs((0, 260), (1, 500)))]
    for _ in range(12):
        ids = np.repeat(rng.integers(0, 4, 6), rng.integers(20, 260, 6)).astype(np.int32)
        layouts.append((ids, ids))
    bm, bn = flash_plan.ONE_PASS_TILES[128][:2]
    for q_ids, kv_ids in layouts:
        sq, sk = len(q_ids), len(kv_ids)
        rows, cols = np.arange(sq)[:, None], np.arange(sk)[None, :]
        allowed = q_ids[:, None] == kv_ids[None, :]
        if causal:
            allowed &= cols <= rows + (sk - sq)
            if window_left is not None:
                allowed &= cols >= rows + (sk - sq) - window_left
        key_ranges = expected_ranges(kv_ids, q_ids, bn, bm)
        for t, n0 in enumerate(range(0, sk, bn)):
            visited, plain = one_pass_query_tiles(n0, sq, sk, causal, window_left, key_ranges[t], bm, bn)
            for i in range(_cdiv(sq, bm)):
                block = allowed[i * bm:(i + 1) * bm, n0:n0 + bn]
                assert not block.any() or i in visited, (q_ids, n0, i)
                assert i not in plain or block.all(), (q_ids, n0, i)


# ---- GPU: numbers against the float64 reference, through the public API ----

def _require_sm90():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the one-pass backward is a Gluon kernel for sm_90 only")


# Causal sliding windows, for both Gluon kernels (test_gluon_forward.py too): tiles masked at both ends
# of the band (the diagonal, the window's far edge), windows not tile multiples, rows with nothing
# visible, a window of one key, few persistent programs.
WINDOW_CASES = {
    "d128-window-gqa-sinks": dict(b=2, sq=2048, sk=2048, hq=8, hkv=2, d=128, opts=dict(sliding_window=(300, 0)),
                                  sinks=True),
    "d64-window-ragged": dict(b=1, sq=1000, sk=1100, hq=2, hkv=1, d=64, opts=dict(sliding_window=(257, 0))),
    "d128-window-empty-rows": dict(b=1, sq=1300, sk=1000, hq=2, hkv=2, d=128, opts=dict(sliding_window=(128, 0))),
    "d64-window-one-key": dict(b=1, sq=512, sk=512, hq=2, hkv=2, d=64, opts=dict(sliding_window=(0, 0))),
    "d128-window-7-programs": dict(b=1, sq=1024, sk=1024, hq=4, hkv=2, d=128, opts=dict(sliding_window=(200, 0)),
                                   num_sms="7", persistent="1"),
}

GPU_CASES = {
    "d128": dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=128, opts={}),
    "d64-causal": dict(b=2, sq=2048, sk=2048, hq=4, hkv=4, d=64, opts=dict(causal=True)),
    "d128-causal-gqa-sinks": dict(b=1, sq=1024, sk=1024, hq=8, hkv=2, d=128, opts=dict(causal=True), sinks=True),
    # lengths that are not tile multiples: TMA pads rows past the end with zeros
    "d64-ragged-gqa": dict(b=2, sq=1000, sk=1100, hq=6, hkv=2, d=64, opts={}),
    "d128-ragged-causal": dict(b=1, sq=1000, sk=1000, hq=2, hkv=2, d=128, opts=dict(causal=True)),
    # bottom-right causal: more keys than queries, and more queries than keys (rows 0-299 see nothing)
    "d128-causal-more-keys": dict(b=1, sq=512, sk=1300, hq=2, hkv=2, d=128, opts=dict(causal=True)),
    "d64-causal-empty-rows": dict(b=1, sq=1300, sk=1000, hq=2, hkv=1, d=64, opts=dict(causal=True)),
    # causal persistent items are pairs of key tiles: here with the diagonal shifted (Sk > Sq)
    "d64-causal-pairs-more-keys": dict(b=2, sq=768, sk=1024, hq=4, hkv=2, d=64, opts=dict(causal=True)),
    # persistent with few programs: each takes several work items (barrier phases carried over)
    "d128-causal-gqa-7-programs": dict(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=128, opts=dict(causal=True), sinks=True,
                                       num_sms="7", persistent="1"),
    "d64-7-programs": dict(b=3, sq=512, sk=1024, hq=2, hkv=2, d=64, opts={}, num_sms="7"),
    "d128-fp16-scale": dict(b=1, sq=768, sk=2048, hq=2, hkv=2, d=128, opts=dict(softmax_scale=0.05),
                            dtype=torch.float16),
    # the soft cap (the GPU's tanh.approx): causal with GQA, ragged, with a window and sinks, a cap small
    # enough to saturate many scores
    "d128-causal-softcap-gqa": dict(b=2, sq=2048, sk=2048, hq=8, hkv=2, d=128,
                                    opts=dict(causal=True, logits_soft_cap=30.0)),
    "d64-softcap-ragged": dict(b=2, sq=1000, sk=1100, hq=4, hkv=2, d=64, opts=dict(logits_soft_cap=5.0)),
    "d128-window-softcap-sinks": dict(b=1, sq=2048, sk=2048, hq=4, hkv=2, d=128, sinks=True,
                                      opts=dict(sliding_window=(300, 0), logits_soft_cap=20.0)),
    # D = 256 (WIDE: 64-key tiles, the warpgroups on halves of the columns, dQ staged in the Q / dO stages)
    "d256": dict(b=2, sq=1024, sk=1024, hq=4, hkv=4, d=256, opts={}),
    "d256-causal-gqa-sinks-ragged": dict(b=1, sq=1000, sk=1100, hq=6, hkv=2, d=256, opts=dict(causal=True),
                                         sinks=True),
    "d256-causal-gqa-7-programs": dict(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=256, opts=dict(causal=True),
                                       num_sms="7", persistent="1"),
    "d256-window-softcap-fp16": dict(b=1, sq=2048, sk=2048, hq=4, hkv=2, d=256, dtype=torch.float16,
                                     opts=dict(sliding_window=(300, 0), logits_soft_cap=20.0)),
    # head dims padded to the tiles' width ((rows, heads, dims) descriptors: zeros past D, dQ's reduce clipped)
    "d192-causal-gqa": dict(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=192, opts=dict(causal=True)),
    "d192-ragged-softcap-sinks": dict(b=1, sq=1000, sk=1100, hq=4, hkv=4, d=192, sinks=True,
                                      opts=dict(logits_soft_cap=20.0)),
    "d96": dict(b=2, sq=1024, sk=1024, hq=4, hkv=4, d=96, opts={}),
    "d96-causal-gqa-7-programs": dict(b=2, sq=1024, sk=1024, hq=8, hkv=2, d=96, opts=dict(causal=True),
                                      num_sms="7", persistent="1"),
    "d80-window-ragged": dict(b=1, sq=1000, sk=1100, hq=2, hkv=1, d=80, opts=dict(sliding_window=(257, 0))),
    **WINDOW_CASES,
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_one_pass_backward(case, monkeypatch, seed):
    _require_sm90()
    set_switch(monkeypatch, "DUALATTN_WS", None)
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")   # short windows too (hopper.short_window_backward)
    kernels = spy_kernels(monkeypatch)
    check_gpu_case(monkeypatch, GPU_CASES[case], seed, {"persistent": flash_plan.PERSISTENT_ENV})
    assert kernels == [ONE_PASS], kernels


@pytest.mark.gpu
@pytest.mark.parametrize("draw", range(16))
def test_gpu_one_pass_wide_heads_at_random(monkeypatch, seed, draw):
    """test_gluon_forward's random wide and padded head dims (80-256, GQA, ragged, causal, windows, soft cap,
    sinks, fp16 / bf16) on the one-pass backward, forced at these lengths, against the float64 reference."""
    _require_sm90()
    from test_gluon_forward import _wide_head_case
    set_switch(monkeypatch, "DUALATTN_WS", None)
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    kernels = spy_kernels(monkeypatch)
    case = _wide_head_case(seed + 1000 + draw)
    check_gpu_case(monkeypatch, case, seed, {})
    assert kernels == [ONE_PASS], (case, kernels)


def check_gpu_case(monkeypatch, case: dict, seed, env: dict):
    """One GPU_CASES entry against the float64 reference through the public torch API: `num_sms`
    sets DUALATTN_NUM_SMS, and each key of `env` present in the case sets that variable."""
    from test_warp_specialize import _check_against_reference   # tests/torch is on sys.path (rootdir conftest)
    c = dict(case)
    dtype = c.pop("dtype", torch.bfloat16)
    for key, name in {"num_sms": "DUALATTN_NUM_SMS", **env}.items():
        if key in c:
            set_switch(monkeypatch, name, c.pop(key))
    _check_against_reference(c.pop("b"), c.pop("sq"), c.pop("sk"), c.pop("hq"), c.pop("hkv"), c.pop("d"),
                             c.pop("opts"), device="cuda", dtype=dtype, seed=seed, tol=1e-2, **c)


def scored_inputs(b, sq, sk, hq, hkv, d, opts, bias_spec, mask_shape, seed, documents=False, dtype=None,
                  device="cuda"):
    """(q, k, v, dout, flash_attention options) of a bias / mask case (here and test_gluon_forward.py):
    bias_spec is ((batch or 1, heads or 1), dtype) or None; a mask hides one row whole (batch 0,
    head 0, query 5) and a band of keys (64-199) from the last batch and head; a soft cap brings
    sinks, `documents` three segments."""
    dtype = dtype or torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(b, sq, hq, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(b, sk, hkv, d, device=device, dtype=dtype, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    extra = dict(opts)
    if "logits_soft_cap" in opts:
        extra["softmax_aux"] = torch.randn(hq, device=device, generator=gen)
    if documents:
        ids = (torch.arange(sq, device=device) * 3 // sq)[None].expand(b, sq).contiguous()
        extra.update(q_segment_ids=ids, kv_segment_ids=ids)
    if bias_spec:
        (bb, bh), bias_dtype = bias_spec
        extra["bias"] = (2.0 * torch.randn(bb, bh, sq, sk, device=device, generator=gen)).to(bias_dtype)
    if mask_shape:
        mask = torch.rand(*mask_shape, sq, sk, device=device, generator=gen) < 0.7
        mask[0, 0, 5] = False              # a row that sees nothing
        mask[-1, -1, :, 64:200] = False    # a band of keys nobody sees
        extra["attention_mask"] = mask
    return q, k, v, dout, extra


# (b, sq, sk, hq, hkv, d, options, bias (batch or 1, heads or 1) or None, mask shape or None)
SCORED_CASES = {
    "d128-causal-bias-gqa": (2, 1024, 1024, 4, 2, 128, dict(causal=True), (2, 4), None),
    "d128-mask-ragged": (2, 1000, 1104, 4, 4, 128, {}, None, (2, 1)),
    "d64-bias-mask-softcap-sinks": (1, 1024, 1024, 4, 2, 64, dict(causal=True, logits_soft_cap=5.0), (1, 1), (1, 4)),
    "d64-window-mask-documents": (2, 1024, 1024, 4, 4, 64, dict(sliding_window=(200, 0)), None, (1, 4)),
    # D = 256: 64 x 64 tiles of each, warpgroups on halves of the queries
    "d256-causal-mask-gqa-softcap": (1, 1024, 1024, 4, 2, 256, dict(causal=True, logits_soft_cap=20.0), None,
                                     (1, 4)),
    "d256-bias-mask-ragged": (2, 1000, 1104, 2, 2, 256, {}, (2, 1), (2, 1)),
    # padded head dims: 192 on D = 256's tiles, 96 on D = 128's
    "d192-causal-bias-mask-gqa": (2, 768, 768, 4, 2, 192, dict(causal=True), (1, 4), (2, 4)),
    "d96-mask-ragged": (2, 1000, 1104, 4, 4, 96, {}, None, (2, 1)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(SCORED_CASES))
def test_gpu_one_pass_bias_and_mask(monkeypatch, seed, case):
    """A bias that needs no gradient and an attention mask on the one-pass backward: dQ, dK, dV against
    the float64 reference, a row that sees nothing (zero gradients, no NaN) and a band of keys that
    nobody sees."""
    _require_sm90()
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, "1")
    b, sq, sk, hq, hkv, d, opts, bias_shape, mask_shape = SCORED_CASES[case]
    q, k, v, dout, extra = scored_inputs(b, sq, sk, hq, hkv, d, opts, bias_shape and (bias_shape, torch.bfloat16),
                                         mask_shape, seed, documents=case.endswith("documents"))
    chains = spy_chains(monkeypatch, "plan_backward")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **extra)
    grads = torch.autograd.grad(out, leaves, dout)
    assert [c[-1] for c in chains] == [ONE_PASS], chains   # (segment ids: their ranges' launch first)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, **extra)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(g).any(), name
        assert_close_rel(g, r, 1e-2, name)
    if mask_shape:   # the row that sees nothing: no gradient reaches its query
        assert (grads[0][0, 5, 0] == 0).all()


@pytest.mark.gpu
def test_gpu_one_pass_matches_two_pass(monkeypatch, seed):
    """Gradients of the one-pass and two-pass backwards agree to bf16 rounding (same forward)."""
    _require_sm90()
    from dualattn.torch_api import flash_attention
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    kernels = spy_kernels(monkeypatch)
    grads = {}
    for flag in ("1", "0"):
        set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, flag)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal=True)
        grads[flag] = torch.autograd.grad(out, leaves, do)
    assert kernels == [ONE_PASS, "flash_bwd_dkdv_kernel"]
    for a, b in zip(grads["1"], grads["0"]):
        assert not torch.isnan(a).any()
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


def _runs(*runs):
    """Segment ids as (id, length) runs."""
    return torch.cat([torch.full((n,), i, dtype=torch.int64) for i, n in runs])


DOCUMENTS = {
    "tile-aligned": (_runs((0, 512), (1, 1024), (2, 512)), None),
    "ragged": (_runs((0, 300), (1, 1000), (2, 517), (3, 231)), None),
    "repeated-id": (_runs((0, 700), (1, 600), (0, 400), (2, 348)), None),
    "wide-int64": (_runs((2 ** 40, 900), (2 ** 40 + 1, 1148)), None),
    # cross attention: Sq != Sk, other runs on each side, query id 7 in no key (rows with nothing visible)
    "cross": (_runs((0, 200), (7, 100), (1, 700)), _runs((0, 500), (1, 600), (2, 200))),
    # queries padded with id -1, the keys' padding id inside the kernel (int32 ids reach it as they are;
    # int64 ones become ranks), keys past a partial last tile
    "query-padding-minus-one": (_runs((0, 600), (-1, 424)).int(), _runs((0, 1000)).int()),
}


@pytest.mark.gpu
@pytest.mark.parametrize("d, docs, causal, programs", [
    (128, "tile-aligned", True, None), (128, "tile-aligned", False, None), (128, "ragged", True, None),
    (128, "ragged", False, None), (128, "repeated-id", True, None), (128, "repeated-id", False, None),
    (128, "wide-int64", True, "7"), (64, "ragged", True, None), (64, "ragged", False, "7"), (64, "cross", False, None),
    (128, "cross", True, None), (128, "query-padding-minus-one", False, None), (256, "ragged", True, None),
    (256, "repeated-id", False, "7"), (192, "ragged", True, None), (96, "cross", False, None)])
def test_gpu_one_pass_documents(monkeypatch, seed, d, docs, causal, programs):
    """Segment ids on the one-pass backward: each key tile visits the query tiles sharing an id with
    it (its segment ranges), compares ids outside its one-id run.  Documents aligned to the tiles or
    not, an id that comes back (a wider range, compared), int64 ids past 2**32, cross attention with
    a query id no key has, persistent programs taking several key tiles.  Against float64."""
    _require_sm90()
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    if programs:
        set_switch(monkeypatch, "DUALATTN_NUM_SMS", programs)
        set_switch(monkeypatch, flash_plan.PERSISTENT_ENV, "1")
    q_ids, kv_ids = DOCUMENTS[docs]
    kv_ids = q_ids if kv_ids is None else kv_ids
    sq, sk = len(q_ids), len(kv_ids)
    q_seg, kv_seg = (ids[None].expand(2, len(ids)).contiguous().cuda() for ids in (q_ids, kv_ids))
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(2, sq, 4, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(2, sk, 2, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    dout = torch.randn_like(q)
    chains, real_plan = [], flash_plan.plan_backward

    def spy(*args, **kwargs):
        planned = real_plan(*args, **kwargs)
        chains.append([launch.kernel for launch in planned.dkdv.chain])
        return planned

    monkeypatch.setattr(flash_plan, "plan_backward", spy)
    opts = dict(causal=causal, q_segment_ids=q_seg, kv_segment_ids=kv_seg)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*leaves, **opts)
    grads = torch.autograd.grad(out, leaves, dout)
    assert chains == [["segment_ranges_kernel", ONE_PASS]], chains
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves, **opts)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.double())
    assert_close_rel(out, ref_out, 1e-2, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(g).any(), name
        assert_close_rel(g, r, 1e-2, name)


_COMPILE_AFTER_INTERPRETING = """
import torch
import dualattn.torch_api as dt
from dualattn.kernels import compile_check
from test_one_pass import _plan

q, k, v = (torch.randn(1, 48, 2, 32) for _ in range(3))
dt.flash_attention(q, k, v, causal=True)   # the process's first launch: interpreted
plan = _plan(d=64, hq=8, hkv=2, dtype="float16")
dtypes = dict.fromkeys(("query", "key", "value", "dout"), "float16")
compile_check.compile_launch(plan.dkdv, {**dtypes, "lse": "float32", "delta": "float32"}, arch=90)
print("compiled")
"""


def test_gluon_compiles_after_an_interpreted_launch(tmp_path):
    """A process whose first launch is interpreted still compiles Gluon kernels.  Triton's
    interpreter imports Gluon lazily during its first launch, while triton.language's builtins are
    patched; Gluon then wrapped the patched functions and every later Gluon compile in the process
    failed (kernels/_interpret.py imports Gluon first).  A fresh process and an empty Triton cache,
    so that neither an earlier test nor a cached kernel hides it."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), flash_plan.ONE_PASS_ENV: "1",
           "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _COMPILE_AFTER_INTERPRETING], cwd=here, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_deterministic_takes_the_two_pass_backward():
    """deterministic=True: no one-pass backward (its dQ tiles meet in atomics), even where it applies."""
    shapes, options, strides, config = gluon_problem()
    plan = flash_plan.plan_backward(shapes, options, strides, config=config, warp_specialize=True, gluon=True,
                                    num_sms=132, deterministic=True)
    assert plan.dkdv.kernel != ONE_PASS and "dq_accum" not in plan.dq.inputs


def _planned_deterministic(monkeypatch) -> list:
    """The `deterministic` every plan_backward call gets from then on."""
    seen, real = [], flash_plan.plan_backward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)
    monkeypatch.setattr(flash_plan, "plan_backward", spy)
    return seen


def test_deterministic_reaches_the_backward_plan(monkeypatch):
    """Both front ends hand `deterministic` (and torch's use_deterministic_algorithms) to the plan."""
    import jax
    import jax.numpy as jnp
    from dualattn import jax_api
    from dualattn.torch_api import flash_attention
    seen = _planned_deterministic(monkeypatch)
    q, k, v = (torch.randn(1, 32, 2, 16, requires_grad=True) for _ in range(3))
    for flag in (False, True):
        flash_attention(q, k, v, causal=True, deterministic=flag).sum().backward()
    torch.use_deterministic_algorithms(True)
    try:   # (another length: the True call's plan above would be reused)
        flash_attention(*(t[:, :16] for t in (q, k, v)), causal=True).sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
    qj, kj, vj = (jnp.asarray(t.detach().numpy()) for t in (q, k, v))
    for flag in (False, True):
        jax.grad(lambda x: jax_api.flash_attention(x, kj, vj, causal=True, backend="triton",
                                                   deterministic=flag).sum())(qj)
    assert seen == [False, True, True, False, True]
    with pytest.raises(TypeError, match="deterministic"):
        flash_attention(q, k, v, deterministic="yes")


@pytest.mark.gpu
def test_gpu_deterministic_gradients_are_bitwise_reproducible(monkeypatch, seed):
    """Where the one-pass backward would run, deterministic=True gives the same bits twice (torch and jax)."""
    _require_sm90()
    import jax
    import jax.numpy as jnp
    from dualattn import jax_api
    from dualattn.torch_api import flash_attention
    set_switch(monkeypatch, flash_plan.ONE_PASS_ENV, None)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(1, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    kernels = spy_kernels(monkeypatch)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        runs.append(torch.autograd.grad(flash_attention(*leaves, deterministic=True), leaves, do))
    assert ONE_PASS not in kernels and kernels, kernels
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    qj, kj, vj, doj = (jnp.asarray(t.float().cpu().numpy(), dtype=jnp.bfloat16) for t in (q, k, v, do))
    grad = jax.jit(jax.grad(lambda *x: (jax_api.flash_attention(*x, backend="triton", deterministic=True)
                                        .astype(jnp.float32) * doj).sum(), argnums=(0, 1, 2)))
    first, second = grad(qj, kj, vj), grad(qj, kj, vj)
    for a, b in zip(first, second):
        assert bool((a == b).all())



@pytest.mark.gpu
def test_gpu_partial_key_tile_with_very_negative_lse_fp16(monkeypatch):
    """fp16, every score far below zero (lse about -25) and a partial last key tile: the keys past the
    end would get P = exp(-lse) (~1e11), an inf dS in fp16 and a NaN dQ, unless masked (EVEN_K off)."""
    _require_sm90()
    from dualattn.torch_api import flash_attention
    from reference import assert_close_rel, reference_attention
    kernels = spy_kernels(monkeypatch)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = 2.0 + 0.1 * torch.randn(1, 1024, 2, 64, device="cuda", generator=gen)
    k = -2.0 + 0.1 * torch.randn(1, 1100, 2, 64, device="cuda", generator=gen)
    v = torch.randn(1, 1100, 2, 64, device="cuda", generator=gen)
    dout = torch.randn_like(q)
    leaves = [t.half().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*leaves, return_lse=True)
    grads = torch.autograd.grad(out, leaves, dout.half())
    assert kernels == [ONE_PASS] and float(lse.detach().max()) < -15.0
    ref_leaves = [t.half().double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = reference_attention(*ref_leaves)
    ref_grads = torch.autograd.grad(ref_out, ref_leaves, dout.half().double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert torch.isfinite(g).all(), name
        assert_close_rel(g, r, 1e-2, name)
