"""The JAX path's assembler choice (dualattn/jax_api/ptxas.py): a ptxas router first on PATH that
sends dualattn's kernels to Triton's ptxas and everything else to the ptxas jaxlib would have run."""
import os
import subprocess
import sys
import textwrap

import pytest

from dualattn.jax_api import ptxas
from dualattn.switches import set_for_test as set_switch  # noqa: E402


def _fake_ptxas(path, name, log):  # records "<name> <args>" in log
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{log}"\n')
    path.chmod(0o755)
    return str(path)


@pytest.fixture
def router(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_PTXAS_PATH", raising=False)
    log = tmp_path / "calls.log"
    ours = _fake_ptxas(tmp_path / "triton-ptxas", "triton", log)
    theirs = _fake_ptxas(tmp_path / "xla-ptxas", "xla", log)
    (tmp_path / "router").mkdir()
    return ptxas.write_router(str(tmp_path / "router"), ours, theirs, ptxas.kernel_names()), log


@pytest.mark.parametrize("entry, expected", [("flash_fwd_kernel", "triton"), ("flash_bwd_dq_kernel", "triton"),
                                             ("dropout_mask_kernel", "triton"), ("loop_add_fusion", "xla"),
                                             ("flash_fwd_kernel_of_someone_else", "xla")])
def test_router_sends_our_kernels_to_tritons_ptxas(router, tmp_path, entry, expected):
    script, log = router
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(f".version 8.7\n.target sm_90a\n.visible .entry {entry}(\n\t.param .u64 a\n)\n{{\n\tret;\n}}\n")
    subprocess.run([script, str(ptx), "-o", str(tmp_path / "k.cubin"), "-arch=sm_90a"], check=True)
    assert log.read_text().split()[0] == expected
    assert f"{ptx} -o" in log.read_text()   # the arguments pass through unchanged


def test_router_follows_triton_ptxas_path(router, tmp_path, monkeypatch):
    """torch.compile sets TRITON_PTXAS_PATH (to torch's ptxas) and Triton then writes PTX for that
    assembler: the router must pick the same one, as Triton does, or a valid path only."""
    script, log = router
    ptx = tmp_path / "kernel.ptx"
    ptx.write_text(".version 9.0\n.visible .entry flash_fwd_kernel(\n)\n{\n}\n")
    other = _fake_ptxas(tmp_path / "torch-ptxas", "torch", log)
    for value, expected in ((other, "torch"), (str(tmp_path / "missing"), "triton")):
        monkeypatch.setenv("TRITON_PTXAS_PATH", value)
        log.write_text("")
        subprocess.run([script, str(ptx)], check=True)
        assert log.read_text().split()[0] == expected


def test_router_asks_the_default_ptxas_for_its_version(router):
    script, log = router
    subprocess.run([script, "--version"], check=True)
    assert log.read_text() == "xla --version\n"


def test_kernel_names_are_the_launched_kernels():
    from dualattn.kernels.flash import plan
    names = ptxas.kernel_names()
    assert {"flash_fwd_kernel", "flash_bwd_preprocess_kernel", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel",
            "dropout_mask_kernel", "flash_fwd_gluon_kernel", "flash_bwd_one_pass_kernel",
            "flash_bwd_dq_convert_kernel"} <= set(names)
    assert plan.plan_dropout_mask(1, 1, 8, 8, 0.5, 0).kernel in names
    # every algorithm's kernels, not only flash's: NSA's dK/dV ran 25% slower under jaxlib's ptxas
    assert {"nsa_fwd_kernel", "nsa_bwd_dq_kernel", "nsa_bwd_dkv_kernel", "nsa_importance_kernel", "nsa_topk_kernel",
            "nsa_fwd_partial_kernel", "nsa_fwd_merge_kernel", "nsa_bwd_dq_partial_kernel", "nsa_bwd_dq_sum_kernel",
            "nsa_gate_kernel", "segment_ranges_kernel", "varlen_segment_ids_kernel"} <= set(names)


def test_default_ptxas_skips_routers(tmp_path, monkeypatch):
    real = tmp_path / "cuda" / "bin"
    real.mkdir(parents=True)
    _fake_ptxas(real / "ptxas", "real", tmp_path / "log")
    stale = tmp_path / (ptxas._PREFIX + "x")
    stale.mkdir()
    _fake_ptxas(stale / "ptxas", "router", tmp_path / "log")
    assert ptxas.default_ptxas(os.pathsep.join([str(stale), str(real)])) == str(real / "ptxas")


def test_use_triton_ptxas_puts_a_router_first(monkeypatch, tmp_path):
    real = tmp_path / "bin"
    real.mkdir()
    _fake_ptxas(real / "ptxas", "real", tmp_path / "log")
    monkeypatch.setenv("PATH", os.pathsep.join([str(real), "/usr/bin"]))
    monkeypatch.setattr(ptxas, "_ROUTER_DIR", None)
    router = ptxas.use_triton_ptxas(90)
    assert os.environ["PATH"].split(os.pathsep)[:2] == [os.path.dirname(router), str(real)]
    text = open(router).read()
    assert ptxas.triton_ptxas(90) in text and str(real / "ptxas") in text
    assert ptxas.use_triton_ptxas(90) == router and os.environ["PATH"].count(os.path.dirname(router)) == 1


@pytest.mark.parametrize("value, routed", [(None, False), ("xla", False), ("Triton", True)])
def test_env_choice(monkeypatch, tmp_path, value, routed):
    real = tmp_path / "bin"
    real.mkdir()
    _fake_ptxas(real / "ptxas", "real", tmp_path / "log")
    monkeypatch.setenv("PATH", str(real))
    monkeypatch.setattr(ptxas, "_ROUTER_DIR", None)
    set_switch(monkeypatch, ptxas.ENV, value)
    ptxas.apply_env(90)
    head = os.environ["PATH"].split(os.pathsep)[0]
    assert os.path.basename(head).startswith(ptxas._PREFIX) == routed


def test_env_rejects_unknown_value(monkeypatch):
    set_switch(monkeypatch, ptxas.ENV, "cuda13")
    with pytest.raises(ValueError, match=ptxas.ENV):
        ptxas.apply_env(90)


# A causal call whose jit also holds XLA's own kernels (the mask arithmetic, the sum): those must
# still assemble (Triton's ptxas alone first on PATH rejected XLA's PTX ISA 9.0).
_GPU_SCRIPT = textwrap.dedent("""
    import os, torch, jax, jax.numpy as jnp
    import dualattn.jax_api as dj, dualattn.torch_api as dt
    q, k, v = (torch.randn(1, 512, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = dt.flash_attention(q, k, v, causal=True)
    step = jax.jit(lambda a, b, c: (dj.flash_attention(a, b, c, causal=True, backend="triton"),
                                    jnp.sum(jnp.sin(a.astype(jnp.float32)))))
    out, extra = step(*(jax.dlpack.from_dlpack(t) for t in (q, k, v)))
    grads = jax.grad(lambda a: jnp.sum(dj.flash_attention(a, jax.dlpack.from_dlpack(k), jax.dlpack.from_dlpack(v),
                                                          causal=True, backend="triton").astype(jnp.float32)))(
        jax.dlpack.from_dlpack(q))
    print("PATH0", os.environ["PATH"].split(os.pathsep)[0])
    print("SAME", torch.equal(torch.from_dlpack(out), ref), bool(jnp.isfinite(extra)), bool(jnp.isfinite(grads).all()))
""")


@pytest.mark.gpu
def test_gpu_jax_kernels_assembled_by_tritons_ptxas(tmp_path):
    """The premise (jaxlib runs the first `ptxas` on PATH: a logging wrapper there sees our kernel),
    then DUALATTN_JAX_PTXAS=triton: the router goes first, XLA's own kernels still assemble, and
    the results stay torch's bit for bit."""
    log = tmp_path / "calls.log"
    wrapper = tmp_path / "bin" / "ptxas"
    wrapper.parent.mkdir()
    real = ptxas.default_ptxas()
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ -f "$a" ] && grep -m1 -oE "flash_fwd_(gluon_)?kernel" "$a" >> "{log}"; '
                       f'done\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PATH=f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop(ptxas.ENV, None)
    run = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "SAME True True True" in run.stdout
    assert log.exists() and "flash_fwd_" in log.read_text(), "jaxlib did not run the first ptxas on PATH"

    env[ptxas.ENV] = "triton"
    run = subprocess.run([sys.executable, "-c", _GPU_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"PATH0 {tmp_path}" not in run.stdout and ptxas._PREFIX in run.stdout
    assert "SAME True True True" in run.stdout
