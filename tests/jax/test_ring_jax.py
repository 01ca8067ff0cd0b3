"""jax ring attention inside shard_map over 4 CPU devices (and 2 of them): output, lse and gradients of
q, k, v and sinks equal flash_attention on the gathered sequence and a float64 reference, for the
triton and xla backends; bad input gives clear errors.

Runs in a subprocess: several CPU devices need XLA_FLAGS before jax is first imported.
"""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax")
import dualattn  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    sys.path.insert(0, sys.argv[1])
    import dualattn, dualattn.jax_api as dj
    from reference import assert_close_rel, numpy_reference_with_grads

    TOL = {"float32": (2e-5, 2e-4), "bfloat16": (1e-2, 3e-2)}

    def check(world, backend, layout, dtype, sinks=None, segments=False, heads=(4, 2), seq_len=32, **opts):
        rng = np.random.default_rng(7)
        hq, hkv = heads
        q = rng.standard_normal((2, seq_len, hq, 16)).astype(np.float32)
        k, v = (rng.standard_normal((2, seq_len, hkv, 16)).astype(np.float32) for _ in range(2))
        dout = rng.standard_normal((2, seq_len, hq, 16)).astype(np.float32)
        dlse = rng.standard_normal((2, hq, seq_len)).astype(np.float32)
        s = None if sinks is None else rng.standard_normal(sinks).astype(np.float32)
        seg = np.cumsum(rng.random((2, seq_len)) < 0.15, axis=1).astype(np.int32) if segments else None
        perm = dualattn.ring_permutation(seq_len, world, layout)
        inv = np.argsort(perm)
        mesh = Mesh(np.array(jax.devices()[:world]), ("sp",))
        seq = P(None, "sp")

        def ring(q, k, v, s, seg):
            return dj.ring_attention(q, k, v, axis_name="sp", layout=layout, backend=backend, softmax_aux=s,
                                     q_segment_ids=seg, return_lse=True, **opts)
        ring = jax.shard_map(ring, mesh=mesh, in_specs=(seq, seq, seq, P(), seq),
                             out_specs=(seq, P(None, None, "sp")))

        def loss(f, q, k, v, s):
            out, lse = f(q, k, v, s)
            return (out.astype(jnp.float32) * dout).sum() + (lse * dlse).sum(), (out, lse)

        def ring_global(q, k, v, s):   # shard in layout order, gather back
            out, lse = ring(q[:, perm], k[:, perm], v[:, perm], s, None if seg is None else jnp.asarray(seg)[:, perm])
            return out[:, inv], lse[:, :, inv]

        def flash(q, k, v, s):
            return dj.flash_attention(q, k, v, backend=backend, softmax_aux=s, q_segment_ids=seg, return_lse=True, **opts)

        dt = jnp.dtype(dtype)
        args = [jnp.asarray(x, dt) for x in (q, k, v)] + [None if s is None else jnp.asarray(s)]
        argnums = (0, 1, 2, 3) if s is not None else (0, 1, 2)
        results = {}
        for name, f in (("ring", ring_global), ("flash", flash)):
            grads, (out, lse) = jax.jit(jax.grad(lambda *a: loss(f, *a), argnums=argnums, has_aux=True))(*args)
            results[name] = dict(out=out, lse=lse, dquery=grads[0], dkey=grads[1], dvalue=grads[2],
                                 dsoftmax_aux=grads[3] if s is not None else None)
        inputs = dict(query=q, key=k, value=v, softmax_aux=s)
        ref = numpy_reference_with_grads({n: np.asarray(jnp.asarray(x, dt).astype(jnp.float32)) if x is not None and n != "softmax_aux" else x
                                          for n, x in inputs.items()}, dout, q_segment_ids=seg, **opts)
        tol_flash, tol_ref = TOL[dtype]
        tag = f"W={world} {backend} {layout} {dtype} {opts}"
        if world == 1:   # one launch: flash_attention's own kernel, nothing merged
            for n in ("out", "lse"):
                assert bool(jnp.array_equal(results["ring"][n], results["flash"][n])), tag + " world 1 " + n
        for n in ("out", "lse", "dquery", "dkey", "dvalue", "dsoftmax_aux"):
            if results["ring"][n] is None:
                continue
            widen = 8 if n == "dsoftmax_aux" and dtype != "float32" else 1   # see tests/torch/test_ring.py
            assert_close_rel(results["ring"][n], results["flash"][n], 4 * widen * tol_flash, tag + " " + n + " vs flash")
            if n in ("out", "lse"):
                assert_close_rel(results["ring"][n], ref[n], 2 * tol_ref, tag + " " + n + " vs f64")
        # gradients vs float64: the reference's are of sum(out * dout) alone
        grads = jax.jit(jax.grad(lambda *a: (ring_global(*a)[0].astype(jnp.float32) * dout).sum(), argnums=argnums))(*args)
        for n, g in zip(("dquery", "dkey", "dvalue", "dsoftmax_aux"), grads):
            widen = 8 if n == "dsoftmax_aux" and dtype != "float32" else 1
            assert_close_rel(g, ref[n], 2 * widen * tol_ref, tag + " " + n + " vs f64")

    CASES = {
        "xla": [dict(world=4, backend="xla", layout="zigzag", dtype="float32", causal=True, sliding_window=5,
                     heads=(4, 1)),
                dict(world=2, backend="xla", layout="zigzag", dtype="float32", segments=True, sinks=(4, 2)),
                dict(world=1, backend="xla", layout="zigzag", dtype="bfloat16", causal=True, sinks=(4,)),
                # every device's share is one launch (the window stays in its own shard)
                dict(world=4, backend="xla", layout="contiguous", dtype="float32", sliding_window=(0, 0),
                     sinks=(4,)),
                # a causal window just past two zigzag chunks: one launch's run pairs cut by different edges
                dict(world=4, backend="xla", layout="zigzag", dtype="float32", causal=True, sliding_window=(20, 0),
                     seq_len=64, heads=(2, 1))],
        "triton": [dict(world=4, backend="triton", layout="zigzag", dtype="float32", causal=True, sinks=(4,)),
                   dict(world=2, backend="triton", layout="contiguous", dtype="bfloat16", sliding_window=(6, 2),
                        logits_soft_cap=3.0, segments=True, sinks=(3,)),
                   dict(world=1, backend="triton", layout="zigzag", dtype="bfloat16", causal=True, sinks=(4,))],
        # one small case of the triton ring, forward and backward (the full set above is slow)
        "triton-one": [dict(world=2, backend="triton", layout="zigzag", dtype="float32", causal=True, heads=(2, 1),
                            seq_len=16)],
    }
    for spec in CASES[sys.argv[2]]:
        check(**spec)

    def precision_over_world_sizes():
        # Partials merge in fp32: a bf16 ring's error is one kernel rounding plus the final one at any
        # size, not one more per step (ring-flash-attention's complaint about bf16 accumulation).
        rng = np.random.default_rng(3)
        s = 256
        q, k, v = (jnp.asarray(rng.standard_normal((1, s, 2, 32)), jnp.bfloat16) for _ in range(3))
        q64, k64, v64 = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
        logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) / np.sqrt(32)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        want = np.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v64)
        errors = {}
        for world in (1, 2, 4):
            perm = dualattn.ring_permutation(s, world, "zigzag")
            mesh = Mesh(np.array(jax.devices()[:world]), ("sp",))
            f = jax.jit(jax.shard_map(lambda a, b, c: dj.ring_attention(a, b, c, axis_name="sp", backend="xla"),
                                      mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P(None, "sp")))
            got = np.asarray(f(q[:, perm], k[:, perm], v[:, perm])[:, np.argsort(perm)].astype(jnp.float32))
            errors[world] = np.abs(got - want).max() / np.abs(want).max()
        assert errors[4] <= 1.5 * errors[2] and errors[2] <= 3 * errors[1], errors
        print("precision", errors)

    def sinks_gradient_without_vma_checks():
        # Replicated sinks' gradient sums every device's rows once, with shard_map's checks on or off.
        rng = np.random.default_rng(5)
        q = jnp.asarray(rng.standard_normal((1, 32, 4, 16)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(2))
        sinks = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
        perm = dualattn.ring_permutation(32, 4, "zigzag")
        mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
        want = jax.grad(lambda s: (dj.flash_attention(q, k, v, causal=True, softmax_aux=s, backend="xla") ** 2).sum())(sinks)
        for check in (True, False):
            ring = jax.shard_map(lambda a, b, c, s: dj.ring_attention(a, b, c, axis_name="sp", causal=True, softmax_aux=s,
                                                                      backend="xla"),
                                 mesh=mesh, in_specs=(P(None, "sp"),) * 3 + (P(),), out_specs=P(None, "sp"),
                                 check_vma=check)
            got = jax.grad(lambda s: (ring(q[:, perm], k[:, perm], v[:, perm], s) ** 2).sum())(sinks)
            assert_close_rel(got, want, 1e-5, f"dsinks check_vma={check}")

    if sys.argv[2] == "xla":
        precision_over_world_sizes()
        sinks_gradient_without_vma_checks()

    # bad input: an unbound axis, a sequence zigzag cannot split
    x = jnp.zeros((1, 8, 2, 16))
    try:
        dj.ring_attention(x, x, x, axis_name="sp")
    except ValueError as e:
        assert "not bound" in str(e), e
    else:
        raise AssertionError("no error outside shard_map")
    mesh = Mesh(np.array(jax.devices()[:4]), ("sp",))
    bad = jax.shard_map(lambda a: dj.ring_attention(a, a, a, axis_name="sp"), mesh=mesh, in_specs=P(None, "sp"),
                        out_specs=P(None, "sp"))
    try:
        bad(jnp.zeros((1, 12, 2, 16)))     # 3 tokens per device: zigzag needs a multiple of 2 * 4
    except ValueError as e:
        assert "multiple of" in str(e), e
    else:
        raise AssertionError("no error for a sequence zigzag cannot split")
    print("OK")
""")


def _run(cases: str):
    root = os.path.dirname(os.path.dirname(os.path.abspath(dualattn.__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    env.pop("XLA_FLAGS", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT, TESTS_DIR, cases], capture_output=True, text=True, env=env,
                         timeout=1200)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stdout[-2000:] + res.stderr[-4000:]


def test_ring_attention_in_shard_map_xla():
    _run("xla")


@pytest.mark.slow   # the interpreted kernels under shard_map: minutes on two cores
def test_ring_attention_in_shard_map_triton():
    _run("triton")


def test_ring_attention_in_shard_map_triton_one_case():
    """Every CI run takes the triton ring's forward and backward through one small case."""
    _run("triton-one")
