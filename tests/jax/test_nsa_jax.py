"""Native sparse attention, JAX front end (backends "triton" and "xla"), against the float64 dense
reference (tests/nsa_reference.py), and torch-vs-JAX parity of the shared kernels."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
import jax.numpy as jnp  # noqa: E402

from dualattn import jax_api, torch_api  # noqa: E402
from nsa_reference import reference_nsa, reference_selected  # noqa: E402
from reference import assert_close_rel  # noqa: E402

FP32_TOL = 1e-5


def _inputs(rng, seqlen, hq, hkv, d, slots, block_size, batch=1):
    q, k, v = (rng.standard_normal(s).astype(np.float32)
               for s in ((batch, seqlen, hq, d), (batch, seqlen, hkv, d), (batch, seqlen, hkv, d)))
    n_blocks = -(-seqlen // block_size)
    idx = rng.integers(-1, n_blocks + 1, (batch, seqlen, hkv, slots)).astype(np.int32)
    idx[..., -1] = idx[..., 0]   # a duplicate in every row
    counts = rng.integers(0, slots + 1, (batch, seqlen, hkv)).astype(np.int32)
    return q, k, v, idx, counts


def _check(fn, ref_fn, arrays, rng, tol=FP32_TOL):
    """Output and gradients of fn(*arrays) (jax) against ref_fn(*float64 torch leaves)."""
    out, vjp = jax.vjp(fn, *map(jnp.asarray, arrays))
    leaves = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    ref = ref_fn(*leaves)
    assert_close_rel(np.asarray(out), ref.detach(), tol, "out")
    dout = rng.standard_normal(out.shape).astype(np.float32)
    grads = vjp(jnp.asarray(dout))
    for i, (g, r) in enumerate(zip(grads, torch.autograd.grad(ref, leaves, torch.tensor(dout, dtype=torch.float64)))):
        assert_close_rel(np.asarray(g), r, tol, f"grad {i}")


def _force_key_major(monkeypatch, by_key):
    from dualattn.kernels.nsa import plan as nsa_plan
    monkeypatch.setattr(nsa_plan, "key_major", lambda shapes: by_key)


@pytest.mark.parametrize("backend, group, seqlen, block_size, by_key", [
    ("xla", 8, 40, 32, False), ("triton", 4, 48, 16, False), ("triton", 2, 72, 16, True)])
def test_selected_branch(rng, monkeypatch, backend, group, seqlen, block_size, by_key):
    _force_key_major(monkeypatch, by_key)
    q, k, v, idx, counts = _inputs(rng, seqlen, group, 1, 16, 3, block_size)
    _check(lambda q, k, v: jax_api.apply_native_sparse_attention(q, k, v, jnp.asarray(idx), jnp.asarray(counts),
                                                                 block_size, backend=backend),
           lambda q, k, v: reference_selected(q, k, v, torch.tensor(idx), torch.tensor(counts), block_size),
           (q, k, v), rng)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_selected_branch_varlen(rng, backend):
    cu = np.array([0, 30, 34, 64], np.int32)
    q, k, v, idx, counts = _inputs(rng, 64, 2, 1, 16, 2, 16)
    _check(lambda q, k, v: jax_api.apply_native_sparse_attention(q, k, v, jnp.asarray(idx), 2, 16,
                                                                 cu_seqlens=jnp.asarray(cu), backend=backend),
           lambda q, k, v: reference_selected(q, k, v, torch.tensor(idx), 2, 16, cu_seqlens=cu), (q, k, v), rng)


@pytest.mark.parametrize("backend", ["xla", "triton"])
def test_native_sparse_attention(rng, backend):
    seqlen, group, block_size = 64, 2, 16
    q, k, v, _, _ = _inputs(rng, seqlen, group, 1, 16, 2, block_size)
    gates = [rng.random((1, seqlen, group)).astype(np.float32) for _ in range(3)]
    opts = dict(block_counts=2, block_size=block_size, window_size=8)
    _, used = jax_api.native_sparse_attention(*map(jnp.asarray, (q, k, v, *gates)), return_block_indices=True,
                                              backend=backend, **opts)
    leaves = [torch.tensor(a, dtype=torch.float64) for a in (q, k, v, *gates)]
    assert np.array_equal(np.asarray(used), reference_nsa(*leaves, **opts)[1].numpy())
    _check(lambda *a: jax_api.native_sparse_attention(*a, backend=backend, **opts),
           lambda *a: reference_nsa(*a, **opts)[0], (q, k, v, *gates), rng)


def test_native_sparse_attention_many_sequences_triton(rng):
    """Packed sequences through one launch each (nsa.packed_compressed): one shorter than a block, an
    empty one, whole blocks only, tails; chosen blocks, output and gradients against the reference."""
    cu = np.array([0, 10, 42, 58, 58, 80, 128], np.int32)
    q, k, v, _, _ = _inputs(rng, 128, 2, 1, 16, 2, 16)
    gates = [rng.random((1, 128, 2)).astype(np.float32) for _ in range(3)]
    opts = dict(block_counts=2, block_size=16, window_size=10)
    _, used = jax_api.native_sparse_attention(*map(jnp.asarray, (q, k, v, *gates)), cu_seqlens=jnp.asarray(cu),
                                              return_block_indices=True, backend="triton", **opts)
    leaves = [torch.tensor(a, dtype=torch.float64) for a in (q, k, v, *gates)]
    assert np.array_equal(np.asarray(used), reference_nsa(*leaves, cu_seqlens=cu, **opts)[1].numpy())
    _check(lambda *a: jax_api.native_sparse_attention(*a, cu_seqlens=jnp.asarray(cu), backend="triton", **opts),
           lambda *a: reference_nsa(*a, cu_seqlens=cu, **opts)[0], (q, k, v, *gates), rng)


@pytest.mark.slow
def test_native_sparse_attention_varlen_xla(rng):
    cu = np.array([0, 40, 45, 80], np.int32)
    q, k, v, _, _ = _inputs(rng, 80, 2, 1, 16, 2, 16)
    gates = [rng.random((1, 80, 2)).astype(np.float32) for _ in range(3)]
    opts = dict(block_counts=2, block_size=16, window_size=10)
    # fp32 matmuls at full precision: jax's default on a GPU is TF32 (~1e-4 relative here).
    with jax.default_matmul_precision("highest"):
        _check(lambda *a: jax_api.native_sparse_attention(*a, cu_seqlens=jnp.asarray(cu), backend="xla", **opts),
               lambda *a: reference_nsa(*a, cu_seqlens=cu, **opts)[0], (q, k, v, *gates), rng)


@pytest.mark.parametrize("by_key", [False, True])
def test_torch_jax_parity(rng, monkeypatch, by_key):
    """The same interpreted kernels from both front ends (the selected branch query- or key-major; the
    whole NSA's pooled blocks, flash launches, top-k and gated sum): identical outputs and block choices."""
    _force_key_major(monkeypatch, by_key)
    q, k, v, idx, counts = _inputs(rng, 48, 4, 2, 16, 3, 16)
    gates = [rng.random((1, 48, 4)).astype(np.float32) for _ in range(2)]
    got_jax = jax_api.apply_native_sparse_attention(*map(jnp.asarray, (q, k, v, idx, counts)), block_size=16,
                                                    backend="triton")
    got_torch = torch_api.apply_native_sparse_attention(*map(torch.from_numpy, (q, k, v, idx, counts)), block_size=16)
    np.testing.assert_array_equal(np.asarray(got_jax), got_torch.numpy())
    opts = dict(block_counts=2, block_size=16)
    out_j, used_j = jax_api.native_sparse_attention(*map(jnp.asarray, (q, k, v, *gates)), return_block_indices=True,
                                                    backend="triton", **opts)
    out_t, used_t = torch_api.native_sparse_attention(*map(torch.from_numpy, (q, k, v, *gates)),
                                                      return_block_indices=True, **opts)
    np.testing.assert_array_equal(np.asarray(used_j), used_t.numpy())
    np.testing.assert_array_equal(np.asarray(out_j), out_t.numpy())


def test_torch_jax_parity_packed_sequences(rng):
    """Packed sequences: both front ends run each compressed launch once for all of them
    (nsa.packed_compressed); the interpreted kernels give both the same blocks and outputs, bit for bit."""
    cu = np.array([0, 10, 42, 58, 58, 80, 128], np.int32)
    q, k, v, _, _ = _inputs(rng, 128, 4, 2, 16, 2, 16)
    gates = [rng.random((1, 128, 4)).astype(np.float32) for _ in range(3)]
    opts = dict(block_counts=2, block_size=16, window_size=10, return_block_indices=True)
    out_j, used_j = jax_api.native_sparse_attention(*map(jnp.asarray, (q, k, v, *gates)), cu_seqlens=jnp.asarray(cu),
                                                    backend="triton", **opts)
    out_t, used_t = torch_api.native_sparse_attention(*map(torch.from_numpy, (q, k, v, *gates)),
                                                      cu_seqlens=torch.from_numpy(cu), **opts)
    np.testing.assert_array_equal(np.asarray(used_j), used_t.numpy())
    np.testing.assert_array_equal(np.asarray(out_j), out_t.numpy())


@pytest.mark.parametrize("chunk", [None, 5])
def test_torch_jax_gradient_parity(rng, monkeypatch, chunk):
    """Both front ends build the inverted index and its chunk table (torch.sort / lax.sort) and run
    the same interpreted backward kernels: the same gradient bits, also with lists cut into chunks
    of 5 entries (partial dK, dV summed by the reduction)."""
    if chunk is not None:
        from dualattn.kernels.nsa import plan as nsa_plan
        monkeypatch.setattr(nsa_plan, "dkv_chunk", lambda shapes: chunk)
    q, k, v, idx, counts = _inputs(rng, 48, 4, 2, 16, 3, 16)
    dout = rng.standard_normal((1, 48, 4, 16)).astype(np.float32)
    _, vjp = jax.vjp(lambda q, k, v: jax_api.apply_native_sparse_attention(
        q, k, v, jnp.asarray(idx), jnp.asarray(counts), block_size=16, backend="triton"), *map(jnp.asarray, (q, k, v)))
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    out = torch_api.apply_native_sparse_attention(*leaves, torch.from_numpy(idx), torch.from_numpy(counts),
                                                  block_size=16)
    for g_jax, g_torch in zip(vjp(jnp.asarray(dout)), torch.autograd.grad(out, leaves, torch.from_numpy(dout))):
        np.testing.assert_array_equal(np.asarray(g_jax), g_torch.numpy())


def test_bad_input(rng):
    q, k, v, idx, _ = _inputs(rng, 32, 2, 1, 16, 2, 16)
    with pytest.raises(ValueError, match="block_indices must have shape"):
        jax_api.apply_native_sparse_attention(q, k, v, idx[:, :, :, :, None], backend="xla")
    with pytest.raises(ValueError, match="block_size must be one of"):
        jax_api.apply_native_sparse_attention(q, k, v, idx, block_size=24, backend="xla")
    with pytest.raises(TypeError, match="block_indices must be a jax array"):
        jax_api.apply_native_sparse_attention(q, k, v, idx.tolist(), backend="xla")
    with pytest.raises(ValueError, match="at least one of g_cmp"):
        jax_api.native_sparse_attention(q, k, v, block_size=16)
    with pytest.raises(ValueError, match="backend must be one of"):
        jax_api.native_sparse_attention(q, k, v, g_cmp=np.ones((1, 32, 2), np.float32), block_size=16,
                                        backend="cuda")
    with pytest.raises(TypeError, match="deterministic"):
        jax_api.native_sparse_attention(q, k, v, g_cmp=np.ones((1, 32, 2), np.float32), block_size=16,
                                        deterministic=1)


def test_compressed_branch_in_batch_slices(rng, monkeypatch):
    """As the torch front end's: a batch slice a launch past the (here lowered) grid limit."""
    import dualattn.nsa as checks
    monkeypatch.setattr(checks, "MAX_GRID_Y", 40)
    q, k, v = (rng.standard_normal((2, 40, h, 16)).astype(np.float32) for h in (2, 1, 1))
    gates = [rng.random((2, 40, 2)).astype(np.float32) for _ in range(2)]
    opts = dict(block_counts=2, block_size=16)
    _check(lambda *a: jax_api.native_sparse_attention(*a, backend="xla", **opts),
           lambda *a: reference_nsa(*a, **opts)[0], (q, k, v, *gates), rng)


@pytest.mark.parametrize("seqlen", [70, 20])
def test_compressed_branch_launches(rng, seqlen):
    """The compressed branch's launches (nsa.compressed_launches): several blocks and a tail, one block
    and a tail."""
    block_size = 16
    q, k, v, _, _ = _inputs(rng, seqlen, 2, 1, 16, 2, block_size)
    gates = [rng.random((1, seqlen, 2)).astype(np.float32) for _ in range(2)]
    opts = dict(block_counts=2, block_size=block_size)
    _check(lambda *a: jax_api.native_sparse_attention(*a, backend="xla", **opts),
           lambda *a: reference_nsa(*a, **opts)[0], (q, k, v, *gates), rng)


