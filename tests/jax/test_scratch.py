"""The PTX fixes that let jax-triton launch the descriptor-building kernels (jax_api/_scratch.py),
checked offline on the PTX Triton emits for them with JAX's specialisation (sm_90, no GPU).

The GPU side (these launches give torch's numbers bit for bit) is in tests/parity.
"""
from __future__ import annotations

import re
import subprocess
import types

import pytest

triton = pytest.importorskip("triton")

import test_compile as tc  # noqa: E402  (tests/ is on sys.path: its conftest)
from dualattn.jax_api import _scratch  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402

# The warp-specialised forward and backward (on a grid and persistent), and a portable TMA forward.
CASES = [pytest.param(tc.WS_FAST[0], "fwd", id="ws-fwd"), pytest.param(tc.WS_BWD[3], "dkdv", id="ws-dkdv-causal"),
         pytest.param(tc.WS_BWD[0], "dq", id="ws-dq"), pytest.param(tc.TMA_FAST[0], "fwd", id="tma-fwd"),
         # Persistent: a program per SM builds its descriptors once, over the whole arrays.
         pytest.param(tc.WS_FAST[3], "fwd", id="ws-fwd-persistent"),
         pytest.param(tc.WS_BWD[7], "dkdv", id="ws-dkdv-persistent-causal"),
         pytest.param(tc.WS_BWD[6], "dq", id="ws-dq-persistent")]


def _compiled(variant, kernel):
    launch, dtypes = variant.launch(kernel, 90)
    assert launch.outputs[-1].scratch and launch.outputs[-1].shape[0] >= (
        launch.grid[0] * launch.grid[1] * flash_plan.DESC_SCRATCH_BYTES)
    compiled = tc._compile(launch, dtypes, 90, "jax", variant.name)
    return launch, compiled


def _reads(ptx, param):
    return len(re.findall(rf"ld\.param\.\w+\s+%\w+,\s*\[{param}\]", ptx))


@pytest.mark.parametrize("variant, kernel", CASES)
def test_scratch_reads_move_to_desc_scratch(variant, kernel, tmp_path):
    launch, compiled = _compiled(variant, kernel)
    ptx = compiled.asm["ptx"]
    assert 0 < compiled.metadata.global_scratch_size <= flash_plan.DESC_SCRATCH_BYTES
    name, params = _scratch.entry_params(ptx)
    assert name == launch.kernel and len(params) == _scratch.ptx_param_count(launch)   # what register() keys on
    desc, hidden = params[-3], params[-2]
    assert _reads(ptx, hidden) >= 1 and _reads(ptx, desc) == 0   # the kernel ignores DESC_SCRATCH

    fixed = _scratch.redirect_global_scratch(ptx)
    assert _reads(fixed, hidden) == 0 and _reads(fixed, desc) == _reads(ptx, hidden)
    # Nothing else changed, and the result still assembles.
    assert fixed.replace(f"[{desc}]", f"[{hidden}]") == ptx
    src = tmp_path / "fixed.ptx"
    src.write_text(fixed)
    ptxas = triton.backends.nvidia.compiler.get_ptxas(90).path
    subprocess.run([ptxas, "-arch=sm_90a", str(src), "-o", str(tmp_path / "fixed.cubin")], check=True,
                   capture_output=True)

    # Warp specialisation adds warps: the launch must bring what the PTX requires.
    assert _scratch.launch_warps(fixed, launch.num_warps) == compiled.metadata.num_warps
    if launch.constexpr_dict["WARP_SPECIALIZE"]:
        assert compiled.metadata.num_warps > launch.num_warps


def test_kernels_without_descriptors_are_left_alone():
    launch, dtypes = tc.FAST[0].launch("fwd", 90)
    assert not launch.constexpr_dict["TMA"] and launch.outputs[-1].shape == (128,)
    ptx = tc._compile(launch, dtypes, 90, "jax", "portable").asm["ptx"]
    assert _scratch.redirect_global_scratch(ptx) == ptx
    assert _scratch.launch_warps(ptx, launch.num_warps) == launch.num_warps


def test_a_kernel_that_reads_its_last_parameter_is_refused():
    ptx = (".visible .entry k(\n.param .u64 .ptr .global .align 1 k_param_0,\n"
           ".param .u64 .ptr .global .align 1 k_param_1,\n.param .u64 .ptr .global .align 1 k_param_2\n)\n"
           ".reqntid 384\n{\nld.param.b64 %rd1, [k_param_0];\nld.param.b64 %rd2, [k_param_1];\n}\n")
    with pytest.raises(ValueError, match="last parameter"):
        _scratch.redirect_global_scratch(ptx)
    assert _scratch.launch_warps(ptx, 4) == 12


def test_register_fixes_only_registered_kernels():
    made = []
    library = types.SimpleNamespace(TritonKernel=lambda *args: made.append(args), other=object())
    jax_triton = types.SimpleNamespace(triton_lib=types.SimpleNamespace(triton_kernel_call_lib=library))
    ptx = (".visible .entry mine(\n.param .u64 mine_param_0,\n.param .u64 mine_param_1,\n"
           ".param .u64 mine_param_2\n)\n.reqntid 384, 1, 1\n{\nld.param.u64 %rd1, [mine_param_1];\n}\n")
    _scratch.register(jax_triton, "mine", 3)
    _scratch.register(jax_triton, "mine", 3)   # idempotent: one wrapper
    wrapped = jax_triton.triton_lib.triton_kernel_call_lib
    assert wrapped.other is library.other and wrapped._library is library
    wrapped.TritonKernel("mine", 4, 1, 1000, ptx, "ttir", 90)
    wrapped.TritonKernel("theirs", 4, 1, 1000, ptx.replace("mine", "theirs"), "ttir", 90)
    four = ptx.replace(".param .u64 mine_param_2\n", ".param .u64 mine_param_2,\n.param .u64 mine_param_3\n")
    wrapped.TritonKernel("mine", 4, 1, 1000, four, "ttir", 90)   # same name, other parameter count
    assert made[0][1] == 12 and "[mine_param_0]" in made[0][4] and "[mine_param_1]" not in made[0][4]
    assert made[1] == ("theirs", 4, 1, 1000, ptx.replace("mine", "theirs"), "ttir", 90)
    assert made[2] == ("mine", 4, 1, 1000, four, "ttir", 90)
