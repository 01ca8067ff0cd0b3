"""One framework installed: each front end works without the other framework, and says which extra to
install when its own is missing.  A framework's absence is simulated in a fresh process
(sys.modules[name] = None makes every `import name` fail); tests/smoke runs the same in real installs."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from reference import assert_close_rel, numpy_reference_with_grads

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_without(framework: str, body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh Python where `import <framework>` fails, as in an install without it."""
    script = f"import sys\nsys.modules[{framework!r}] = None\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=_REPO, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("front_end, framework, extra", [("dualattn.jax_api", "jax", "jax"),
                                                         ("dualattn.torch_api", "torch", "torch")])
def test_front_end_without_its_framework_names_the_extra(front_end, framework, extra):
    result = _run_without(framework, f"""
        import dualattn
        try:
            import {front_end}
        except ImportError as error:
            print(error)
        """)
    assert result.returncode == 0, result.stderr
    assert f"pip install 'dualattn[{extra}]'" in result.stdout, result.stdout


def test_jax_triton_on_cpu_without_torch(rng, tmp_path):
    """The interpreter route of backend="triton", flash and block-sparse, forward and backward."""
    q, k, v, dout = (rng.standard_normal((1, 40, 2, 16)).astype(np.float32) for _ in range(4))
    np.savez(tmp_path / "inputs.npz", q=q, k=k, v=v, dout=dout)
    result = _run_without("torch", f"""
        import jax, jax.numpy as jnp, numpy as np
        import dualattn.jax_api as dj
        from dualattn import SparseMask, masks
        x = np.load({str(tmp_path / "inputs.npz")!r})
        q, k, v, dout = (jnp.asarray(x[n]) for n in ("q", "k", "v", "dout"))
        loss = lambda q, k, v: (dj.flash_attention(q, k, v, causal=True, backend="triton") * dout).sum()
        layout = SparseMask.from_block_map(masks.causal()(1, 2, 40, 40, 16, 16), 16, 16)
        np.savez({str(tmp_path / "outputs.npz")!r},
                 out=dj.flash_attention(q, k, v, causal=True, backend="triton"),
                 sparse=dj.blocksparse_attention(q, k, v, layout=layout, causal=True, backend="triton"),
                 **dict(zip(("dquery", "dkey", "dvalue"), jax.grad(loss, argnums=(0, 1, 2))(q, k, v))))
        """)
    assert result.returncode == 0, result.stderr
    got = np.load(tmp_path / "outputs.npz")
    want = numpy_reference_with_grads(dict(query=q, key=k, value=v), dout, causal=True)
    for name in ("out", "dquery", "dkey", "dvalue"):
        assert_close_rel(got[name], want[name], 1e-5, name)
    assert_close_rel(got["sparse"], want["out"], 1e-5, "sparse")


def test_auto_never_picks_a_route_the_install_cannot_run(monkeypatch):
    jax = pytest.importorskip("jax")
    from dualattn.jax_api import _launch, flash

    monkeypatch.setattr(_launch, "jax_triton_available", lambda: False)
    query = jax.numpy.zeros((1, 8, 1, 16))
    assert flash._resolve_backend("triton", query) == "triton"  # CPU: the interpreter needs no extra
    assert flash._resolve_backend("auto", query) == "xla"
    # A GPU without jax-triton: auto takes xla, and triton names the extra before anything is traced.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(_launch, "_on_gpu", lambda x: True)
    assert flash._resolve_backend("auto", query) == "xla"
    with pytest.raises(ImportError, match=r"pip install 'dualattn\[jax-gpu\]'"):
        flash._resolve_backend("triton", query)
