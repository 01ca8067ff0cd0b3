"""Random attention inputs for the JAX tests, rounded to the dtype under test so the float64
reference sees exactly the values the kernel sees."""
import jax.numpy as jnp
import numpy as np


def round_to(x, dtype):
    """numpy float32 -> values exactly representable in dtype."""
    return np.array(jnp.asarray(x, dtype).astype(jnp.float32))


def random_qkv(rng, B, Sq, Sk, Hq, Hkv, D, Dv=None, dtype=jnp.float32):
    Dv = D if Dv is None else Dv
    return dict(query=round_to(rng.standard_normal((B, Sq, Hq, D)), dtype),
                key=round_to(rng.standard_normal((B, Sk, Hkv, D)), dtype),
                value=round_to(rng.standard_normal((B, Sk, Hkv, Dv)), dtype))
