"""A bf16 ring's error against float64, by ring size, on CPU host devices (jax, xla backend).

    python benchmarks/ring_precision.py            # S = 1024, seeds 0-2, W = 1, 2, 4, 8

Prints max |out - ref| / max |ref| per seed, mask and W (docs/ring.md "Numerics").
"""
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

import dualattn  # noqa: E402
import dualattn.jax_api as dj  # noqa: E402

S, H, D, WORLDS = 1024, 2, 64, (1, 2, 4, 8)
for seed in range(3):
    rng = np.random.default_rng(seed)
    q, k, v = (jnp.asarray(rng.standard_normal((1, S, H, D)), jnp.bfloat16) for _ in range(3))
    q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    for causal in (False, True):
        s = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(D)
        if causal:
            s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        ref = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)
        errors = []
        for w in WORLDS:
            perm = dualattn.ring_permutation(S, w, "zigzag")
            mesh = Mesh(np.array(jax.devices()[:w]), ("sp",))
            f = jax.jit(jax.shard_map(lambda a, b, c: dj.ring_attention(a, b, c, axis_name="sp", backend="xla",
                                                                        causal=causal),
                                      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
            out = np.asarray(f(q[:, perm], k[:, perm], v[:, perm])[:, np.argsort(perm)].astype(jnp.float32))
            errors.append(np.abs(out - ref).max() / np.abs(ref).max())
        print(f"seed {seed} {'causal' if causal else 'full  '} " + " ".join(f"W={w}: {e:.2e}" for w, e in zip(WORLDS, errors)))
