"""Which PTX the JAX path's ptxas router sends where (diagnosis of 'Unsupported .version 9.0').

    python benchmarks/experiments/ptxas_route_diag.py
"""
import os
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
from dualattn.jax_api import ptxas  # noqa: E402

work = tempfile.mkdtemp()
log = os.path.join(work, "route.log")


def logging_ptxas(name, real):
    path = os.path.join(work, name)
    with open(path, "w") as f:
        f.write('#!/bin/sh\nfor a in "$@"; do if [ -f "$a" ]; then '
                f'echo "{name}: $(grep -m1 "^.version" "$a") $(grep -m1 -o "entry [A-Za-z_0-9]*" "$a") $(wc -c < "$a")B" >> {log}; '
                f'fi; done\nexec {real} "$@"\n')
    os.chmod(path, 0o755)
    return path


theirs = ptxas.default_ptxas()
router_dir = os.path.join(work, "router")
os.mkdir(router_dir)
ptxas.write_router(router_dir, logging_ptxas("triton", ptxas.triton_ptxas(90)), logging_ptxas("default", theirs),
                   ptxas.kernel_names())
os.environ["PATH"] = router_dir + os.pathsep + os.environ["PATH"]
print("default ptxas:", theirs, "| triton ptxas:", ptxas.triton_ptxas(90))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import dualattn.jax_api as dj  # noqa: E402

for s, b, causal in [(1024, 2, False), (1024, 2, True), (8192, 1, False)]:
    q, k, v = (jax.random.normal(jax.random.PRNGKey(i), (b, s, 16, 128), jnp.bfloat16) for i in range(3))
    for mode in ("fwd", "fwdbwd"):
        try:
            if mode == "fwd":
                jax.block_until_ready(jax.jit(lambda a, b_, c: dj.flash_attention(a, b_, c, causal=causal,
                                                                                  backend="triton"))(q, k, v))
            else:
                jax.block_until_ready(jax.jit(jax.grad(lambda a: jnp.sum(dj.flash_attention(
                    a, k, v, causal=causal, backend="triton").astype(jnp.float32))))(q))
            status = "ok"
        except Exception as e:  # noqa: BLE001
            status = f"FAILED {str(e)[:160]}"
        print(f"S={s} causal={causal} {mode}: {status}", flush=True)
        if os.path.exists(log):
            print(open(log).read(), end="")
            os.remove(log)
sys.stdout.flush()
