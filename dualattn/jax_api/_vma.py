"""shard_map's varying-manual-axes types, for values dualattn creates itself.

Inside `jax.shard_map` every value carries the mesh axes it varies over.  Arrays made from
constants (loop-carry inits, jnp.zeros) vary over none, and kernel outputs (jax-triton custom
calls, pure_callback) come back without the annotation, while the values they meet vary like
the inputs.  JAX then rejects loop carries whose types change, and treats an unannotated output
as replicated (its cotangent gets summed over the mesh: wrong gradients).  These helpers give
such values the axes of the inputs.  Outside shard_map every set is empty and they do nothing.
"""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Mesh axes `x` varies over (the aval field moved between jax releases)."""
    aval = jax.typeof(x)
    for path in (("vma",), ("mat", "varying"), ("manual_axis_type", "varying")):
        value = aval
        try:
            for name in path:
                value = getattr(value, name)
        except AttributeError:
            continue
        return frozenset(value)
    return frozenset()


def vary_like(tree, *refs):
    """`tree` with every array leaf varying over the union of the axes the `refs` vary over."""
    axes = frozenset().union(*(varying_axes(r) for r in refs if r is not None))
    if not axes:
        return tree

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing:
            return x
        pcast = getattr(jax.lax, "pcast", None)
        return pcast(x, missing, to="varying") if pcast is not None else jax.lax.pvary(x, missing)
    return jax.tree_util.tree_map(cast, tree)
