"""flash_attention inside jax.shard_map, per shard: forward and gradients equal the unsharded call.

Runs in a subprocess: two CPU devices need XLA_FLAGS before jax is first imported, and this
test process has imported jax already.  On CPU the triton backend's kernels run interpreted in
one pure_callback per shard (in parallel threads, which dualattn serialises around Triton's
interpreter).
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import dualattn.jax_api as dj

    assert len(jax.devices()) == 2
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((4, 40, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((4, 40, 2, 16)), jnp.float32) for _ in range(2))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    for backend in ("triton", "xla"):
        attend = lambda a, b, c: dj.flash_attention(a, b, c, causal=True, backend=backend)
        sharded = jax.jit(jax.shard_map(attend, mesh=mesh, in_specs=(P("data"),) * 3, out_specs=P("data")))
        out = sharded(q, k, v)
        assert out.sharding.spec == P("data"), out.sharding
        np.testing.assert_allclose(np.asarray(out), np.asarray(attend(q, k, v)), rtol=1e-6, atol=1e-6)
        loss = lambda f: (lambda a, b, c: (f(a, b, c) * jnp.cos(a)).sum())
        got = jax.grad(loss(sharded), argnums=(0, 1, 2))(q, k, v)
        want = jax.grad(loss(attend), argnums=(0, 1, 2))(q, k, v)
        for name, g, w in zip("qkv", got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5, err_msg=backend + " d" + name)
    print("OK")
""")


def test_flash_attention_inside_shard_map_matches_unsharded():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-2000:] + res.stderr[-4000:]
