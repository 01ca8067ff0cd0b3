"""The NSA selected-branch kernels compiled ahead of time for sm_90 and sm_80 (no GPU needed), from the
very launch plans the front ends run: both loops, small and large groups, D up to 256, every dtype; the
key-major forward and dQ pass (selection keys, partials, their merge or sum), the query-major dQ pass,
the key-major dK / dV chunk pass and its reduction, none with atomics."""
from __future__ import annotations

import re

import pytest

from dualattn.kernels import compile_check
from dualattn.kernels.nsa import plan as nsa_plan

MAX_SHARED = {90: 232448, 80: 166912}

# (dtype, D, group, block_size, slots, seqlen, scan, per-token counts, varlen)
VARIANTS = {
    "bf16-d128-g16-entries": ("bfloat16", 128, 16, 64, 16, 8192, False, False, False),
    "bf16-d128-g4-entries": ("bfloat16", 128, 4, 64, 16, 8192, False, True, False),
    "fp16-d64-g1-scan-varlen": ("float16", 64, 1, 32, 16, 256, True, True, True),
    "fp32-d256-g8-entries": ("float32", 256, 8, 128, 8, 4096, False, False, False),
}


def _launch(kernel, dtype, d, group, block_size, slots, seqlen, scan, per_token, varlen):
    shapes = nsa_plan.NsaShapes(batch=1 if varlen else 2, seqlen=seqlen, heads_q=2 * group, heads_kv=2, head_dim=d,
                                head_dim_v=d, num_slots=slots, block_size=block_size, dtype=dtype,
                                per_token_counts=per_token, varlen=varlen, sequences=3 if varlen else 0,
                                total=seqlen if varlen else 0)
    if kernel == "fwd":
        launch = nsa_plan.plan_forward(shapes, d ** -0.5, 0 if per_token else slots, scan=scan, by_key=False)
    elif kernel.startswith("fwd-"):
        by_key = nsa_plan.plan_forward(shapes, d ** -0.5, 0 if per_token else slots, by_key=True)
        launch = dict(zip(("fwd-keys", "fwd-partial", "fwd-merge"), (by_key.keys, *by_key.partial.chain)))[kernel]
    elif kernel.startswith("bwd-km-"):
        by_key = nsa_plan.plan_backward(shapes, d ** -0.5, 0 if per_token else slots, by_key=True)
        launch = dict(zip(("bwd-km-delta", "bwd-km-keys", "bwd-km-dq", "bwd-km-dq-sum"),
                          (*by_key.prepare, *by_key.dq.chain)))[kernel]
    else:
        backward = nsa_plan.plan_backward(shapes, d ** -0.5, 0 if per_token else slots, scan=scan, by_key=False)
        launch = dict(zip(("bwd-dq", "bwd-dkv", "bwd-dkv-reduce"), (backward.dq, *backward.dkdv.chain)))[kernel]
    dtypes = dict(query=dtype, key=dtype, value=dtype, out=dtype, dout=dtype, lse="float32",
                  block_indices="int32", block_counts="int32", cu_seqlens="int32", delta="float32",
                  entry_order="int32", bucket_starts="int32", chunk_buckets="int32", chunk_starts="int32",
                  dk_chunks="float32", dv_chunks="float32", part_o=dtype, part_lse="float32", part_dq=dtype)
    # (query, key, value: what the merge's out and the reduction's dk, dv are typed like; the chain's earlier inputs
    # at run time.)
    dtypes = {name: dtypes[name] for name in (*launch.inputs, "query", "key", "value")}
    if not per_token:
        dtypes.pop("block_counts", None)
    if not varlen:
        dtypes.pop("cu_seqlens", None)
    return launch, dtypes


FAST = {("bf16-d128-g16-entries", 90), ("fp16-d64-g1-scan-varlen", 80)}
# The kernels: query-major forward and backward, the key-major forward's and dQ's (fwd-*, bwd-km-*).
DOTS = ("fwd", "bwd-dq", "bwd-dkv", "fwd-partial", "bwd-km-dq")
NO_DOTS = ("bwd-dkv-reduce", "fwd-keys", "fwd-merge", "bwd-km-delta", "bwd-km-dq-sum")


@pytest.mark.parametrize("variant, kernel, arch", [
    pytest.param(v, k, a, id=f"sm{a}-{k}-{v}", marks=() if (v, a) in FAST else pytest.mark.slow)
    for v in VARIANTS for k in (*DOTS, *NO_DOTS) for a in (90, 80)])
def test_compile_nsa(variant, kernel, arch):
    launch, dtypes = _launch(kernel, *VARIANTS[variant])
    compiled = compile_check.compile_launch(launch, dtypes, arch=arch)
    ptx = compiled.asm["ptx"]
    assert f".entry {launch.kernel}(" in ptx and f".target sm_{arch}" in ptx
    assert kernel in NO_DOTS or "mma" in ptx, f"{variant}: no tensor-core MMA"
    assert compiled.metadata.shared <= MAX_SHARED[arch], f"{variant}: {compiled.metadata.shared} bytes of shared memory"
    assert not re.search(r"\b(red|atom)\.global", ptx), "no atomics: every gradient element is written once"


@pytest.mark.parametrize("arch, dtype, group, d, packed", [
    (90, "bfloat16", 16, 128, False), (90, "bfloat16", 4, 128, True),
    pytest.param(80, "float16", 2, 128, False, marks=pytest.mark.slow),
    pytest.param(90, "float32", 8, 256, False, marks=pytest.mark.slow),
    pytest.param(80, "bfloat16", 1, 256, True, marks=pytest.mark.slow)])
def test_compile_nsa_importance(arch, dtype, group, d, packed):
    """packed: the varlen variant (8 sequences of at most 8192 tokens, 1024 pooled blocks in all)."""
    varlen = dict(sequences=8, total=65536, pooled=1024) if packed else {}
    launch = nsa_plan.plan_importance(1, 8192, 4 * group, 4, d, 64, dtype, d ** -0.5, **varlen)
    compiled = compile_check.compile_launch(launch, dict(query=dtype, k_cmp=dtype, lse="float32", cu_seqlens="int32",
                                                         cu_cmp="int32"), arch=arch)
    assert "mma" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= MAX_SHARED[arch]


@pytest.mark.parametrize("dtype, d, group, arch", [("bfloat16", 128, 1, 80), ("bfloat16", 128, 16, 90),
                                                   pytest.param("float32", 128, 1, 80, marks=pytest.mark.slow)])
def test_importance_tiles_fit_the_registers(dtype, d, group, arch):
    """The plan's importance programs (up to 128 rows, 32 tokens) assemble without spilling: 128 tokens
    a program (group 1) spilled on sm_80 (nsa.plan.importance_tiles)."""
    launch = nsa_plan.plan_importance(1, 8192, 4 * group, 4, d, 64, dtype, d ** -0.5)
    compiled = compile_check.compile_launch(launch, dict(query=dtype, k_cmp=dtype, lse="float32"), arch=arch)
    registers, spilled = compile_check.ptxas_usage(compiled, arch)
    assert spilled == 0, f"{registers} registers, {spilled} bytes spilled"


@pytest.mark.parametrize("num_blocks, arch", [(1024, 90), pytest.param(32768, 80, marks=pytest.mark.slow)])
def test_compile_nsa_top_k(num_blocks, arch):
    """The top-k kernel at T = 64k (block 64) and at its widest rows, reading causal prefixes as NSA runs it,
    without spilling its score row."""
    launch = nsa_plan.plan_topk(4 * 65536, num_blocks, 16, (num_blocks * 64, 4, 64))
    compiled = compile_check.compile_launch(launch, dict(scores="float32"), arch=arch)
    assert f".entry {launch.kernel}(" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= MAX_SHARED[arch]
    assert ".local" not in compiled.asm["ptx"], "the score row spills to local memory"


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("arch, dtype, d, branches", [
    (90, "bfloat16", 128, 3), pytest.param(80, "float16", 256, 1, marks=pytest.mark.slow)])
def test_compile_nsa_gates(arch, dtype, d, branches, backward):
    """The gated sum and its backward, every branch slot, and one branch at the widest head."""
    plan = nsa_plan.plan_gates_backward if backward else nsa_plan.plan_gates
    launch = plan(4 * 65536 * 16, d, branches)
    dtypes = {**{f"o{i}": dtype for i in range(branches)}, **{f"g{i}": "float32" for i in range(branches)}}
    if backward:
        dtypes["dout"] = dtype
    compiled = compile_check.compile_launch(launch, dtypes, arch=arch)
    assert f".entry {launch.kernel}(" in compiled.asm["ptx"]
    assert ".local" not in compiled.asm["ptx"]


@pytest.mark.parametrize("arch, dtype, d, dv, block_size", [(90, "bfloat16", 128, 128, 64),
                                                             (80, "float32", 256, 192, 256)])
def test_compile_nsa_pool(arch, dtype, d, dv, block_size):
    """The pooled keys and values at T = 64k: block 64 at D = 128, and the widest block and head (fp32,
    summed 32 rows a step) without spills."""
    launch = nsa_plan.plan_pool(2, 65536, 4, d, dv, block_size)
    compiled = compile_check.compile_launch(launch, dict(key=dtype, value=dtype), arch=arch)
    assert f".entry {launch.kernel}(" in compiled.asm["ptx"]
    assert ".local" not in compiled.asm["ptx"]


@pytest.mark.parametrize("spec", ["torch", "jax"])
def test_dkv_register_cap_fits_three_programs_an_sm(spec):
    """16-bit dK / dV programs with heads wider than 64 carry plan.DKV_MAX_REGISTERS into their PTX
    (.maxnreg) under both launchers' specialisations, and ptxas keeps them within it: three programs
    of 4 warps an SM (docs/lessons.md, "NSA's dK/dV: a register cap, not the assembler's choice").  D = 64
    is not capped."""
    launch, dtypes = _launch("bwd-dkv", *VARIANTS["bf16-d128-g16-entries"])
    assert launch.max_registers == nsa_plan.DKV_MAX_REGISTERS and launch.num_warps == 4
    assert 3 * launch.max_registers * 32 * launch.num_warps <= 65536
    compiled = compile_check.compile_launch(launch, dtypes, arch=90, specialize=spec)
    assert f".maxnreg {launch.max_registers}" in compiled.asm["ptx"]
    registers, spilled = compile_check.ptxas_usage(compiled, 90)
    assert registers <= launch.max_registers and spilled == 0, (registers, spilled)
    narrow, _ = _launch("bwd-dkv", "bfloat16", 64, 16, 64, 16, 8192, False, False, False)
    assert narrow.max_registers is None
