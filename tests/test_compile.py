"""Ahead-of-time compilation of every flash kernel variant for sm_90 and sm_80, on CPU.

The interpreter never lowers to TTGIR/LLVM/PTX, so GPU-only failures (constexpr globals,
layouts, MMA shapes, shared memory, ptxas) would otherwise show up only on a GPU.  Each case
builds the Launch objects the front ends run (plan_forward / plan_backward / plan_dropout_mask
with the GPU tile config of that arch) and compiles them with `triton.compile`
(dualattn/kernels/compile_check.py), typed and specialised as a real launch.

Default tier: a covering set (every dtype, head dim and option appears on both archs, combined
into a few variants) -- a few minutes on 2 cores.  The sweep that isolates each option and each
(dtype, head dims) pair (~300 compiles, most of an hour) is marked slow; pyproject's addopts
deselect slow tests, so it runs only when asked: `pytest -m slow tests/test_compile.py`.
"""
from __future__ import annotations

import dataclasses
import types
from typing import Optional, Tuple

import pytest

triton = pytest.importorskip("triton")

from dualattn.kernels import compile_check  # noqa: E402
from dualattn.kernels.flash import fit  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.kernels.launch import row_major_strides  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.validation import check_flash_args  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402

ARCHS = (90, 80)
# cudaDevAttrMaxSharedMemoryPerBlockOptin: Triton's launcher raises OutOfResources above it.
MAX_SHARED = {80: 163 * 1024, 90: 227 * 1024}
KERNELS = ("fwd", "preprocess", "dkdv", "dq")
DOT_KERNELS = ("fwd", "dkdv", "dq")


def _array(shape, dtype):
    """Stand-in for an array: check_flash_args and the plans read only .shape and .dtype."""
    return types.SimpleNamespace(shape=tuple(shape), dtype=dtype)


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    dtype: str = "bfloat16"
    d: int = 128
    dv: Optional[int] = None
    batch: int = 2
    sq: int = 128
    sk: int = 128
    hq: int = 4
    hkv: int = 4
    causal: bool = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    softcap: Optional[float] = None
    bias: Optional[str] = None          # "bcast" (1, 1, Sq, Sk) or "full" (B, Hq, Sq, Sk)
    bias_dtype: Optional[str] = None    # default: the query dtype
    mask: Optional[str] = None          # "bcast" / "full", int8 as the front ends pass it
    segments: bool = False
    sinks: Optional[Tuple[str, int]] = None   # ("head", n) or ("shared", n)
    sinks_dtype: Optional[str] = None
    dropout: float = 0.0
    varlen: bool = False
    sparse: Optional[Tuple[int, int]] = None  # block-sparse layout (block_q, block_k), one per head
    tma: bool = False                   # ask for TMA tile loads, as the torch launcher does on sm_90
    lse_grad: bool = False              # the backward takes an lse cotangent (always, from JAX)
    ws: bool = False                    # allow the warp-specialised kernels, as the launchers do on sm_90
    num_sms: int = 0                    # the GPU's SMs as the launchers pass them (persistent launches)
    hardware_tanh: bool = True          # as every GPU launch is planned (fit.py): 16-bit soft caps take tanh.approx
    fitted: bool = False                # planned through fit.py, as the launchers plan (the slow tier)

    def inputs(self):
        """(stand-ins for the arrays a front end passes, max_seqlen_q, max_seqlen_k)."""
        dv = self.d if self.dv is None else self.dv
        arrays = {}
        if self.varlen:
            lens = [self.sq, self.sq // 2 + 3, self.sq // 3]   # max_seqlen first
            total = sum(lens)
            arrays["query"] = _array((total, self.hq, self.d), self.dtype)
            arrays["key"] = _array((total, self.hkv, self.d), self.dtype)
            arrays["value"] = _array((total, self.hkv, dv), self.dtype)
            arrays["cu_seqlens_q"] = arrays["cu_seqlens_k"] = _array((len(lens) + 1,), "int32")
            max_q, max_k = self.sq, self.sq
        else:
            arrays["query"] = _array((self.batch, self.sq, self.hq, self.d), self.dtype)
            arrays["key"] = _array((self.batch, self.sk, self.hkv, self.d), self.dtype)
            arrays["value"] = _array((self.batch, self.sk, self.hkv, dv), self.dtype)
            max_q = max_k = None
        maps = {"bcast": (1, 1, self.sq, self.sk), "full": (self.batch, self.hq, self.sq, self.sk)}
        if self.bias:
            arrays["bias"] = _array(maps[self.bias], self.bias_dtype or self.dtype)
        if self.mask:
            arrays["attention_mask"] = _array(maps[self.mask], "int8")
        if self.segments:
            arrays["q_segment_ids"] = _array((self.batch, self.sq), "int32")
            arrays["kv_segment_ids"] = _array((self.batch, self.sk), "int32")
        if self.sinks:
            kind, n = self.sinks
            shape = ((self.hq,) if n == 1 else (self.hq, n)) if kind == "head" else (n,)
            arrays["softmax_aux"] = _array(shape, self.sinks_dtype or self.dtype)
        return arrays, max_q, max_k

    def problem(self):
        """(arrays, FlashShapes, FlashOptions) of this variant."""
        arrays, max_q, max_k = self.inputs()
        shapes = check_flash_args(arrays["query"], arrays["key"], arrays["value"],
                                  **{k: v for k, v in arrays.items() if k not in ("query", "key", "value")},
                                  max_seqlen_q=max_q, max_seqlen_k=max_k)
        if self.sinks:
            assert shapes.sinks_per_head == (self.sinks[0] == "head") and shapes.num_sinks == self.sinks[1]
        options = FlashOptions.build(head_dim=self.d, causal=self.causal, sliding_window=self.window,
                                     logits_soft_cap=self.softcap, dropout_prob=self.dropout)
        return arrays, shapes, options

    def build(self, arch: int):
        """(forward Launch, BackwardPlan, input dtypes) as a GPU launch on sm_<arch> would get them.  `fitted`: planned
        through fit.py, as the launchers plan, so that a tile too large for the arch's shared memory is the smaller
        one a launch would run (the default tier's variants fit their planned tiles, and skip fit's compiles)."""
        arrays, shapes, options = self.problem()
        out = _array(flash_plan.out_shape(shapes), self.dtype)
        strides = {k: row_major_strides(a.shape) for k, a in {**arrays, "out": out}.items()}
        # What executor.select_config falls back to on a GPU without cached or autotuned tiles.
        config = flash_plan.default_config(shapes, interpret=False, arch=arch, causal=options.causal,
                                          window_keys=flash_plan.causal_window_keys(options))
        extra, dtypes = {}, {k: a.dtype for k, a in arrays.items()}
        if self.sparse:
            bq, bk = self.sparse
            nq, nk = -(-self.sq // bq), -(-self.sk // bk)
            extra["sparse"] = flash_plan.SparseInfo(1, self.hq, nq, nk, bq, bk)
            dtypes.update({name: "int32" for name in flash_plan.SPARSE_INPUTS})
        dtypes.update(out=self.dtype, dout=self.dtype, lse="float32", delta="float32",
                      resume_out=self.dtype, resume_lse="float32",   # a split band's edges launch
                      segment_ranges="int32", segment_tile_ids="int32")   # (segments.py)
        if self.lse_grad:
            dtypes["dlse"] = "float32"
        if self.dropout > 0:
            dtypes["dropout_seed"] = "int32"   # (1,) int32 array, so JAX can trace the seed
        launch = dict(config=config, tma=self.tma, warp_specialize=self.ws, num_sms=self.num_sms,
                      hardware_tanh=self.hardware_tanh, **extra)
        if self.fitted:
            launch.update(arch=arch, max_shared=fit.MAX_SHARED_BYTES[arch], dtypes=dtypes)
        fwd = (fit.forward if self.fitted else flash_plan.plan_forward)(shapes, options, strides, **launch)
        bwd = (fit.backward if self.fitted else flash_plan.plan_backward)(shapes, options, strides,
                                                                          lse_grad=self.lse_grad, **launch)
        return fwd, bwd, dtypes

    def launch(self, kernel: str, arch: int, head: bool = False):
        """The flash launch `kernel` of this variant (head=True: the first launch of its chain, e.g. the
        segment ranges it resumes from) and the input dtypes."""
        fwd, bwd, dtypes = self.build(arch)
        chain = {"fwd": fwd, "preprocess": bwd.preprocess, "dkdv": bwd.dkdv, "dq": bwd.dq}[kernel]
        return chain if head else next(x for x in chain.chain if x.module.startswith("flash.backward")
                                       or x.module.startswith("flash.forward")), dtypes


# ---- default tier: every dtype, head dim and option on both archs, combined ----
FAST = (
    Variant("bf16-d128"),
    Variant("fp16-d64-gqa-causal-softcap-bcastbias-sinks1-dlse", dtype="float16", d=64, hq=4, hkv=2, causal=True,
            softcap=30.0, bias="bcast", bias_dtype="float32", sinks=("head", 1), lse_grad=True),
    Variant("fp32-d80-window-mask-segments-sharedsinks3-dropout", dtype="float32", d=80, window=(16, 8),
            mask="full", segments=True, sinks=("shared", 3), dropout=0.1),
    Variant("bf16-d256-dv128-leftwindow-fullbias-bcastmask-dropout", d=256, dv=128,
            window=(32, None), bias="full", mask="bcast", dropout=0.2),
    Variant("bf16-d128-dv64-varlen-gqa-causal-sinks3-dropout", d=128, dv=64, hq=8, hkv=2, causal=True,
            sinks=("head", 3), sinks_dtype="float32", dropout=0.1, varlen=True),
    Variant("fp16-d128-decode-mqa-causal-dlse", dtype="float16", sq=1, sk=100, hq=4, hkv=1, causal=True,
            lse_grad=True),
    Variant("bf16-d128-blocksparse128-causal", sq=256, sk=256, causal=True, sparse=(128, 128)),
    # Bands wider than plan.EDGES_IN_LOOP_MAX_KEYS: masked edges in loops of their own (the rest, in the loop).
    Variant("bf16-d128-causal-wideband", sq=4096, sk=4096, causal=True),
    Variant("fp16-d64-gqa-leftwindow-softcap-bcastbias-wideband", dtype="float16", d=64, hq=4, hkv=2, sq=4096, sk=4096,
            window=(3000, 0), softcap=30.0, bias="bcast"),
    # the soft cap's exp2 tanh, as DUALATTN_FAST_TANH=0 runs it on a GPU
    Variant("bf16-d128-causal-softcap-exp2", causal=True, softcap=30.0, hardware_tanh=False),
    # a short causal window (GPT-OSS-like): the portable forward on tiles.SHORT_WINDOW_FWD_TILE, on sm_90 too
    Variant("bf16-d128-gqa-shortwindow-sinks1", sq=512, sk=512, hq=8, hkv=2, window=(100, 0), sinks=("head", 1),
            ws=True, num_sms=132, tma=True),
)

# ---- slow tier: each option alone (bf16, D=128), and each (dtype, head dims) with no option ----
_OPTIONS = (
    dict(causal=True), dict(window=(32, None)), dict(window=(32, 16)), dict(softcap=30.0),
    dict(bias="bcast"), dict(bias="full"), dict(mask="full"), dict(mask="bcast"), dict(segments=True),
    dict(sinks=("head", 1)), dict(sinks=("head", 3)), dict(sinks=("shared", 1)), dict(sinks=("shared", 3)),
    dict(dropout=0.1), dict(varlen=True), dict(hq=8, hkv=2), dict(hq=4, hkv=1), dict(sq=100, sk=300),
    dict(sq=1, sk=100), dict(sparse=(64, 64)), dict(sparse=(128, 64), dtype="float16"),
)


def _opt_name(o):
    return "-".join(f"{k}={v}" for k, v in o.items() if k != "dtype").replace(" ", "")


SLOW = tuple(Variant(f"{o.get('dtype', 'bfloat16')}-d128-{_opt_name(o)}", fitted=True, **o) for o in _OPTIONS) + tuple(
    Variant(f"{dt}-d{d}" + (f"-dv{dv}" if dv else ""), dtype=dt, d=d, dv=dv, fitted=True)
    for dt in ("bfloat16", "float16", "float32")
    for d, dv in ((64, None), (128, None), (80, None), (256, None), (128, 64), (64, 256)))


def _cases(variants):
    return [pytest.param(v, k, arch, id=f"sm{arch}-{k}-{v.name}")
            for arch in ARCHS for v in variants for k in KERNELS]


def _compile(launch, dtypes, arch, specialize, what):
    try:
        return compile_check.compile_launch(launch, dtypes, arch=arch, specialize=specialize)
    except Exception as e:  # name the variant and the root cause; the chained traceback has the rest
        root = e
        while root.__cause__ is not None:
            root = root.__cause__
        raise AssertionError(f"{what}: {launch.kernel} failed to compile for sm_{arch} "
                             f"({type(root).__name__}): {root}") from e


def _check_binary(compiled, launch, arch, what):
    ptx = compiled.asm["ptx"]
    assert f".entry {launch.kernel}(" in ptx, f"{what}: no .entry {launch.kernel} in the PTX"
    assert f".target sm_{arch}" in ptx, f"{what}: PTX not targeting sm_{arch}"
    cubin = compiled.asm["cubin"]
    assert isinstance(cubin, bytes) and cubin[:4] == b"\x7fELF", f"{what}: no cubin"
    if launch.constexpr_dict.get("WARP_SPECIALIZE"):
        # Warp specialisation adds the producer (and, Triton 3.7, more) warps to the block.
        assert compiled.metadata.num_warps > launch.num_warps
    else:
        assert compiled.metadata.num_warps == launch.num_warps
    shared = compiled.metadata.shared
    assert shared <= MAX_SHARED[arch], (f"{what}: {launch.kernel} needs {shared} bytes of shared memory, "
                                        f"sm_{arch} allows {MAX_SHARED[arch]} (launch would raise OutOfResources)")
    return ptx


def _run_case(variant, kernel, arch, specialize="torch"):
    launch, dtypes = variant.launch(kernel, arch)
    what = f"{variant.name} [{specialize} specialisation]"
    compiled = _compile(launch, dtypes, arch, specialize, what)
    ptx = _check_binary(compiled, launch, arch, what)
    if kernel in DOT_KERNELS:
        assert "mma" in ptx, f"{what}: {launch.kernel} on sm_{arch} uses no tensor-core MMA"
    return launch, ptx


@pytest.mark.parametrize("variant, kernel, arch", _cases(FAST))
def test_compile(variant, kernel, arch):
    _run_case(variant, kernel, arch)


@pytest.mark.slow
@pytest.mark.parametrize("variant, kernel, arch", _cases(SLOW))
def test_compile_sweep(variant, kernel, arch):
    _run_case(variant, kernel, arch)


def test_segment_ranges_run_first_and_compile():
    """With segment ids the forward, dK/dV and dQ each start from their own tiles' segment ranges."""
    variant = FAST[2]
    assert variant.segments
    for kernel in DOT_KERNELS:
        for arch in ARCHS:
            head, dtypes = variant.launch(kernel, arch, head=True)
            main, _ = variant.launch(kernel, arch)
            assert head.kernel == "segment_ranges_kernel" and head.then is main
            assert main.constexpr_dict["SEGMENT_SKIP"] and dict(main.resume) == {"segment_ranges": "segment_ranges"}
            own = main.constexpr_dict["BLOCK_N" if kernel == "dkdv" else "BLOCK_M"]
            assert head.constexpr_dict["BLOCK_OWN"] == own and not head.constexpr_dict["FROM_TILE_IDS"]
            _check_binary(_compile(head, dtypes, arch, "torch", variant.name), head, arch, variant.name)


def test_long_segment_ranges_start_from_tile_ids_and_compile():
    """Past plan.TILE_IDS_FROM other-axis ids the ranges launch reads the other tiles' [min, max] ids, which a
    launch before it computes (segments.segment_tile_ids_kernel); both compile for either arch."""
    variant = Variant("bf16-d128-causal-segments-long", causal=True, segments=True, sq=32768, sk=32768)
    for kernel in DOT_KERNELS:
        for arch in ARCHS:
            head, dtypes = variant.launch(kernel, arch, head=True)
            ranges = head.then
            assert head.kernel == "segment_tile_ids_kernel" and ranges.kernel == "segment_ranges_kernel"
            assert ranges.constexpr_dict["FROM_TILE_IDS"] and dict(ranges.resume) == {
                "segment_tile_ids": "segment_tile_ids"}
            assert head.constexpr_dict["BLOCK"] == ranges.constexpr_dict["BLOCK_OTHER"]
            for one in (head, ranges):
                _check_binary(_compile(one, dtypes, arch, "torch", variant.name), one, arch, variant.name)


def test_hopper_forward_uses_wgmma():
    """The sm_90 bf16 forward with 128-row tiles must use Hopper's warpgroup MMA, not mma.sync."""
    launch, ptx = _run_case(FAST[0], "fwd", 90)
    assert launch.constexpr_dict["BLOCK_M"] >= 64
    assert "wgmma.mma_async" in ptx, "sm_90 bf16 forward fell back to mma.sync"


def test_edges_in_loop_rule(monkeypatch):
    """The portable kernels run a causal or window band's masked edges in their one loop up to
    plan.EDGES_IN_LOOP_MAX_KEYS keys of band; not with a mask or block-sparse lists; with segment ids
    (SEGMENT_SKIP: the edge tiles compare ids) at any length; never in warp-specialised launches."""
    set_switch(monkeypatch, "DUALATTN_EDGES_IN_LOOP", None)
    for v, expected in ((Variant("causal-2048", causal=True, sq=2048, sk=2048), True),
                        (Variant("causal-4096", causal=True, sq=4096, sk=4096), False),
                        (Variant("no-band", sq=1024, sk=1024), False),
                        (Variant("narrow-window-long", window=(1000, 0), sq=16384, sk=16384), True),
                        (Variant("segments", segments=True, causal=True), True),
                        (Variant("segments-long-no-band", segments=True, sq=8192, sk=8192), True),
                        (Variant("mask", mask="full", causal=True), False),
                        (Variant("blocksparse", sq=256, sk=256, causal=True, sparse=(128, 128)), False)):
        for kernel in ("fwd", "dkdv", "dq"):
            want = expected.get(kernel, False) if isinstance(expected, dict) else expected
            assert v.launch(kernel, 90)[0].constexpr_dict["EDGES_IN_LOOP"] == want, (v.name, kernel)
    for kernel in ("fwd", "dkdv", "dq"):
        launch = Variant("ws-causal", causal=True, sq=2048, sk=2048, ws=True).launch(kernel, 90)[0]
        assert launch.constexpr_dict["WARP_SPECIALIZE"] == (kernel != "fwd"), kernel   # fwd: split does not pay
        assert launch.constexpr_dict["EDGES_IN_LOOP"] == (kernel == "fwd"), kernel
    # The id compare in the edge branch compiles (the other variants' compiles: FAST, SLOW).
    for kernel in ("fwd", "dkdv", "dq"):
        _run_case(Variant("bf16-d64-causal-segments-edges", d=64, causal=True, segments=True), kernel, 90)
    split = Variant("ws-split", causal=True, sq=2048, sk=8192, ws=True).launch("fwd", 90)[0]
    assert split.then is not None and not split.constexpr_dict["EDGES_IN_LOOP"]
    assert not split.then.constexpr_dict["EDGES_IN_LOOP"]


# TMA tile loads: what the launchers compile on Hopper with DUALATTN_TMA=1 (sm_90 only).
TMA_FAST = (
    Variant("tma-bf16-d128-causal", causal=True, tma=True),
    Variant("tma-fp16-d64-gqa-window-softcap-bias-sinks", dtype="float16", d=64, hq=4, hkv=2, window=(16, 8),
            softcap=30.0, bias="bcast", sinks=("head", 1), tma=True),
    Variant("tma-bf16-d128-dv64-varlen-gqa-causal-dropout", d=128, dv=64, hq=8, hkv=2, causal=True, dropout=0.1,
            varlen=True, tma=True),
    Variant("tma-bf16-d128-blocksparse128-causal", sq=256, sk=256, causal=True, sparse=(128, 128), tma=True),
)


# The block-sparse forward runs 2-stage tiles, which the plan keeps on pointer loads (ptxas 3.6 crashed
# on 2-stage TMA forwards): see test_plan_refuses_tma_where_illegal.
@pytest.mark.parametrize("variant, kernel", [pytest.param(v, k, id=f"{k}-{v.name}") for v in TMA_FAST
                                             for k in DOT_KERNELS if not (v.sparse and k == "fwd")])
def test_compile_tma(variant, kernel):
    """Each loop's tiles arrive by TMA bulk copies (no cp.async left in the loops that take them)."""
    launch, ptx = _run_case(variant, kernel, 90)
    assert launch.constexpr_dict["TMA"], f"{variant.name}: the plan refused TMA"
    assert "cp.async.bulk.tensor" in ptx, f"{variant.name}: {launch.kernel} issues no TMA copy"


# The warp-specialised forward (sm_90): one TMA loop that Triton splits into a producer
# warp and a consumer warpgroup with their own register budgets (setmaxnreg).
WS_FAST = (
    Variant("ws-bf16-d128", sq=256, sk=2048, ws=True),
    Variant("ws-fp16-d64-gqa-cross-sinks", dtype="float16", d=64, hq=4, hkv=2, sq=200, sk=4096, sinks=("head", 1),
            ws=True),
    Variant("ws-bf16-d96-dv64", d=96, dv=64, sq=128, sk=4096, ws=True),
    # Persistent (more tiles than SMs): each program loops over tiles around the specialised loop.
    Variant("ws-persistent-bf16-d128", sq=1024, sk=2048, ws=True, num_sms=7),
    Variant("ws-persistent-fp16-d64-gqa-sinks", dtype="float16", d=64, hq=4, hkv=2, sq=512, sk=4096,
            sinks=("head", 1), ws=True, num_sms=3),
    # The soft cap is arithmetic on the scores: the Triton warp-specialised kernels take it (not Gluon).
    Variant("ws-bf16-d128-softcap", sq=256, sk=4096, softcap=50.0, ws=True),
)


@pytest.mark.parametrize("variant", WS_FAST, ids=lambda v: v.name)
def test_compile_warp_specialized_forward(variant):
    launch, ptx = _run_case(variant, "fwd", 90)
    assert launch.constexpr_dict["WARP_SPECIALIZE"] and launch.constexpr_dict["TMA"], variant.name
    assert (launch.num_warps, launch.num_stages) == (4, 2)
    assert "setmaxnreg" in ptx, f"{variant.name}: the forward loop was not warp-specialised"
    assert "cp.async.bulk.tensor" in ptx
    assert launch.constexpr_dict["PERSISTENT"] == (variant.num_sms > 0), variant.name
    if variant.num_sms:
        assert launch.grid == (variant.num_sms, 1, 1)
        assert dict(launch.scalars)["num_work"] == (variant.sq // 128) * variant.batch * variant.hq


# The warp-specialised backward (sm_90): dK/dV and dQ loops split like the forward's.
WS_BWD = (
    Variant("ws-bwd-bf16-d128", sq=2048, sk=2048, ws=True),
    Variant("ws-bwd-fp16-d80-sinks-dlse", dtype="float16", d=80, sq=4096, sk=4096, sinks=("head", 1), lse_grad=True,
            ws=True),
    Variant("ws-bwd-bf16-d96-dv64", d=96, dv=64, sq=4096, sk=4096, ws=True),
    # Bands run whole in the one loop, masked on every tile.
    Variant("ws-bwd-bf16-d128-causal", sq=2048, sk=2048, causal=True, ws=True),
    Variant("ws-bwd-fp16-d128-window-cross", dtype="float16", sq=2048, sk=4096, window=(1000, 300), ws=True),
    # D=64 specialises dK/dV only, with a band or persistent (plan.WS_DKDV_BANDED_OR_PERSISTENT_TILES).
    Variant("ws-bwd-bf16-d64-causal", d=64, sq=4096, sk=4096, causal=True, ws=True),
    # Persistent (more tiles than SMs, plan.persistent_backward): a loop over tiles around each specialised loop.
    Variant("ws-bwd-persistent-bf16-d128", sq=2048, sk=2048, ws=True, num_sms=7),
    Variant("ws-bwd-persistent-fp16-d128-causal-sinks", dtype="float16", sq=2048, sk=2048, causal=True,
            sinks=("head", 1), lse_grad=True, ws=True, num_sms=3),
    Variant("ws-bwd-persistent-bf16-d64-causal", d=64, sq=4096, sk=4096, causal=True, ws=True, num_sms=5),
    Variant("ws-bwd-bf16-d128-causal-softcap", sq=2048, sk=2048, causal=True, softcap=50.0, ws=True),
)


@pytest.mark.parametrize("variant, kernel", [pytest.param(v, k, id=f"{k}-{v.name}") for v in WS_BWD
                                             for k in (("dkdv",) if v.d == 64 else ("dkdv", "dq"))])
def test_compile_warp_specialized_backward(variant, kernel):
    launch, dtypes = variant.launch(kernel, 90)
    const = launch.constexpr_dict
    assert const["WARP_SPECIALIZE"] and const["TMA"], variant.name
    ptx = _run_case(variant, kernel, 90)[1]
    assert "setmaxnreg" in ptx, f"{variant.name}: the {kernel} loop was not warp-specialised"
    assert "cp.async.bulk.tensor" in ptx
    assert const["PERSISTENT"] == (variant.num_sms > 0), variant.name
    if variant.num_sms:
        assert launch.grid == (variant.num_sms, 1, 1)
        tiles = (variant.sk // 128) * variant.hkv if kernel == "dkdv" else (variant.sq // 128) * variant.hq
        assert dict(launch.scalars)["num_work"] == tiles * variant.batch


def test_plan_keeps_the_portable_backward_where_one_loop_cannot_do():
    long = dict(sq=4096, sk=4096, ws=True)
    assert Variant("eligible", **long).launch("dkdv", 90)[0].constexpr_dict["WARP_SPECIALIZE"]
    assert Variant("causal", causal=True, **long).launch("dkdv", 90)[0].constexpr_dict["WARP_SPECIALIZE"]
    d64_causal = Variant("d64-causal", d=64, causal=True, **long)
    assert d64_causal.launch("dkdv", 90)[0].constexpr_dict["WARP_SPECIALIZE"]
    assert not d64_causal.launch("dq", 90)[0].constexpr_dict["WARP_SPECIALIZE"]
    for v in (Variant("ragged-q", sq=4000, sk=4096, ws=True),
              Variant("ragged-k", sq=4096, sk=4000, ws=True), Variant("few-queries", sq=512, sk=4096, ws=True),
              Variant("d64-causal-2048", d=64, causal=True, sq=2048, sk=2048, ws=True),
              Variant("gqa", hq=4, hkv=2, **long), Variant("dropout", dropout=0.1, **long),
              Variant("d64", d=64, **long), Variant("not-asked", sq=4096, sk=4096)):
        assert not v.launch("dkdv", 90)[0].constexpr_dict["WARP_SPECIALIZE"], v.name
    # D=128 without a band from S=1024 (plan.WS_BWD_MIN_WORK), below the forward's WS_MIN_KEY_WORK;
    # a causal band keeps the forward's bar.
    short = Variant("d128-1024", sq=1024, sk=1024, ws=True)
    assert [short.launch(k, 90)[0].constexpr_dict["WARP_SPECIALIZE"] for k in ("fwd", "dkdv", "dq")] == [
        False, True, True]
    short_causal = Variant("d128-1024-causal", sq=1024, sk=1024, causal=True, ws=True)
    assert not any(short_causal.launch(k, 90)[0].constexpr_dict["WARP_SPECIALIZE"] for k in ("dkdv", "dq"))
    # GQA: dQ has no group loop, so it still qualifies.
    assert Variant("gqa", hq=4, hkv=2, **long).launch("dq", 90)[0].constexpr_dict["WARP_SPECIALIZE"]


# Split bands: the warp-specialised launch over the unmasked interior, then a portable launch over
# the masked edges (plan.split_band).
WS_SPLIT = (
    Variant("ws-split-bf16-d128-causal", sq=2048, sk=8192, causal=True, ws=True),
    Variant("ws-split-fp16-d128-gqa-window-sinks", dtype="float16", hq=4, hkv=2, sq=1024, sk=16384,
            window=(9000, 0), sinks=("head", 1), ws=True),
    Variant("ws-split-bf16-d96-ragged-keys", d=96, sq=256, sk=8200, ws=True),
)


@pytest.mark.parametrize("variant", WS_SPLIT, ids=lambda v: v.name)
def test_compile_split_band_forward(variant):
    launch, dtypes = variant.launch("fwd", 90)
    interior, edges = launch.chain
    cut = interior.constexpr_dict["SPLIT_BAND"]
    assert cut == interior.constexpr_dict["BLOCK_M"] == interior.constexpr_dict["BLOCK_N"], variant.name
    assert edges.constexpr_dict["SPLIT_BAND"] == cut, "both launches must cut the band by the same tiles"
    assert not edges.constexpr_dict["WARP_SPECIALIZE"]
    assert cut % edges.constexpr_dict["BLOCK_M"] == 0 and cut % edges.constexpr_dict["BLOCK_N"] == 0
    ptx = _run_case(variant, "fwd", 90)[1]
    assert "setmaxnreg" in ptx, f"{variant.name}: the interior loop was not warp-specialised"
    compiled = _compile(edges, dtypes, 90, "torch", variant.name + " (edges)")
    assert "mma" in _check_binary(compiled, edges, 90, variant.name + " (edges)")


def test_plan_keeps_the_portable_forward_where_one_loop_cannot_do():
    """Packed keys, per-element options and 32-bit inputs keep the three-segment kernel (masks and
    ragged keys split the band instead)."""
    long = dict(sq=256, sk=4096, ws=True)   # enough keys for the variant, unless something else rules it out
    assert Variant("eligible", **long).launch("fwd", 90)[0].constexpr_dict["WARP_SPECIALIZE"]
    assert Variant("eligible", **long).launch("fwd", 90)[0].then is None
    # Masked edges go to a second launch where that pays (plan.split_band_pays): D=128, >= 8192 keys.
    for v in (Variant("ragged-keys", sq=256, sk=8200, ws=True), Variant("causal", causal=True, sq=256, sk=8192,
                                                                        ws=True),
              Variant("window", window=(6000, 3000), sq=256, sk=8192, ws=True)):
        assert v.launch("fwd", 90)[0].then is not None, v.name
    for v in (Variant("causal-short", causal=True, **long), Variant("window-narrow", window=(4000, 0), sq=256,
                                                                    sk=16384, ws=True),
              Variant("causal-d64", causal=True, d=64, sq=256, sk=16384, ws=True)):
        launch = v.launch("fwd", 90)[0]
        assert launch.then is None and not launch.constexpr_dict["WARP_SPECIALIZE"], v.name
    for v in (Variant("varlen", varlen=True, sq=4096, ws=True),
              Variant("lse-rows-off-16-bytes", sq=254, sk=4096, ws=True),
              Variant("few-keys-per-program", d=64, sq=256, sk=2048, ws=True),
              Variant("bias", bias="bcast", **long), Variant("dropout", dropout=0.1, **long),
              Variant("fp32", dtype="float32", d=64, **long),
              Variant("short-q", sq=64, sk=4096, ws=True), Variant("not-asked", sq=256, sk=4096)):
        assert not v.launch("fwd", 90)[0].constexpr_dict["WARP_SPECIALIZE"], v.name


def test_plan_refuses_tma_where_illegal():
    # A head stride of 40 elements (80 bytes) is not 16-element aligned; 256-wide tiles crash ptxas 3.6.
    assert not Variant("d40", d=40, tma=True).launch("fwd", 90)[0].constexpr_dict["TMA"]
    assert not Variant("d256", d=256, tma=True).launch("dq", 90)[0].constexpr_dict["TMA"]
    assert not Variant("no-ask", d=128).launch("fwd", 90)[0].constexpr_dict["TMA"]
    assert not TMA_FAST[-1].launch("fwd", 90)[0].constexpr_dict["TMA"]  # 2-stage forward tiles


# jax-triton 0.3.1 ignores do_not_specialize and turns every int argument equal to 1 into a
# constexpr: group_size=1 (no GQA) and seqlen_q=1 (decode) compile a different variant there.
JAX_CASES = [pytest.param(v, k, 90, id=f"sm90-{k}-{v.name}")
             for v, kernels in ((FAST[0], ("fwd", "dkdv")), (FAST[5], KERNELS)) for k in kernels]


def _jax_case(variant, kernel, arch):
    launch, dtypes = variant.launch(kernel, arch)
    sig, _, _ = compile_check.signature_of(launch, dtypes, specialize="jax")
    ones = [n for n, v in launch.scalars if v == 1]   # jax-triton: ints and floats alike
    assert all(sig[n] == "constexpr" for n in ones)
    _run_case(variant, kernel, arch, specialize="jax")


@pytest.mark.parametrize("variant, kernel, arch", JAX_CASES)
def test_compile_jax_specialisation(variant, kernel, arch):
    _jax_case(variant, kernel, arch)


@pytest.mark.slow
@pytest.mark.parametrize("variant, kernel, arch", _cases(FAST))
def test_compile_jax_specialisation_sweep(variant, kernel, arch):
    _jax_case(variant, kernel, arch)


@pytest.mark.parametrize("variant", FAST, ids=lambda v: v.name)
def test_every_int_argument_is_unspecialised(variant):
    """torch's launcher specialises an int argument on its value (== 1, divisible by 16) unless
    the kernel lists it in do_not_specialize; jax-triton cannot.  A missing entry compiles two
    variants of one kernel, and their layouts (so reduction orders) differ: that is how the
    preprocess kernel once gave torch and jax different last bits of delta, dQ and dK on the H100."""
    fwd, bwd, _ = variant.build(90)
    mask = flash_plan.plan_dropout_mask(2, 4, 128, 128, 0.1, 7)
    for launch in (fwd, bwd.preprocess, bwd.dkdv, bwd.dq, mask):
        fn = compile_check.kernel_function(launch)
        first = len(launch.inputs)
        for i, (name, value) in enumerate(launch.scalars):
            param = fn.params[first + i]
            assert param.name == name
            if isinstance(value, int):
                assert param.do_not_specialize, f"{launch.kernel}: int argument {name!r} is specialised by torch"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(2, 4, 128, 128), (1, 3, 100, 37), (1, 1, 1, 16)], ids=str)
def test_compile_dropout_mask(shape, arch):
    batch, heads, sq, sk = shape
    launch = flash_plan.plan_dropout_mask(batch, heads, sq, sk, 0.1, 1234)
    what = f"dropout mask {shape}"
    compiled = _compile(launch, {}, arch, "torch", what)
    _check_binary(compiled, launch, arch, what)


# ---- the signature is what Triton's own launcher would build (no compilation; cheap) ----
def _jit_signature(launch, dtypes, arch=90):
    """(signature, constexprs by name, non-empty attrs) from JITFunction's own binder, as a torch launch."""
    try:
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature
        from triton.backends.compiler import GPUTarget
    except ImportError as e:  # internal API: skip rather than fail on another Triton version
        pytest.skip(f"Triton internals moved: {e}")
    fn = compile_check.kernel_function(launch)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    dummy = dtypes[launch.inputs[0]] if launch.inputs else None

    def ptr(dtype):  # a 16-byte-aligned device array, as torch's allocator returns
        return types.SimpleNamespace(data_ptr=lambda: 256, dtype=compile_check.triton_type(dtype))

    out_dtype = lambda spec: dtypes.get(spec[5:], dummy) if spec.startswith("like:") else spec
    args = ([ptr(dtypes.get(n, dummy)) for n in launch.inputs] + [v for _, v in launch.scalars]
            + [ptr(dummy if o.scratch else out_dtype(o.dtype)) for o in launch.outputs])   # torch: a dummy
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps, num_stages=launch.num_stages)
    bound, spec, options = binder(*args, **kwargs)
    _, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, spec, options)
    names = list(fn.arg_names)
    return (dict(signature), {names[k[0]]: v for k, v in constexprs.items()},
            {k: v for k, v in attrs.items() if v})


@pytest.mark.parametrize("variant", FAST, ids=lambda v: v.name)
def test_signature_matches_triton_launcher(variant):
    fwd, bwd, dtypes = variant.build(90)
    for launch in (fwd, bwd.preprocess, bwd.dkdv, bwd.dq):
        try:
            expected = _jit_signature(launch, dtypes)
        except (AttributeError, TypeError) as e:
            pytest.skip(f"Triton internals differ: {e}")
        got = compile_check.signature_of(launch, dtypes, specialize="torch")
        assert got[0] == expected[0], launch.kernel
        assert got[1] == expected[1], launch.kernel
        assert got[2] == expected[2], launch.kernel


def test_plan_kernel_mismatch_is_reported():
    fwd, _, dtypes = FAST[0].build(90)
    broken = dataclasses.replace(fwd, scalars=fwd.scalars[1:])
    with pytest.raises(ValueError, match="flash_fwd_kernel"):
        compile_check.signature_of(broken, dtypes)


def test_softcap_mode_per_launch(monkeypatch):
    """16-bit soft caps on a GPU take the hardware tanh; fp32, the interpreter and the switch take exp2."""
    from dualattn.kernels.flash import rules
    mode = lambda v: v.launch("fwd", 90)[0].constexpr_dict["SOFTCAP"]  # noqa: E731
    assert mode(Variant("bf16", softcap=30.0)) == rules.SOFTCAP_MUFU
    assert mode(Variant("fp32", dtype="float32", softcap=30.0)) == rules.SOFTCAP_EXP2
    assert mode(Variant("interp", softcap=30.0, hardware_tanh=False)) == rules.SOFTCAP_EXP2
    assert mode(Variant("none")) == rules.SOFTCAP_NONE
    set_switch(monkeypatch, "DUALATTN_FAST_TANH", "0")
    assert mode(Variant("bf16-switch-off", softcap=30.0)) == rules.SOFTCAP_EXP2
    monkeypatch.undo()
    assert Variant("ws", sq=256, sk=4096, softcap=50.0, ws=True).launch("fwd", 90)[0].constexpr_dict["SOFTCAP"] == \
        rules.SOFTCAP_MUFU
