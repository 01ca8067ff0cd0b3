"""Native sparse attention, torch front end, against the float64 dense reference (tests/nsa_reference.py).

Every case checks the output and the gradients of query, key, value (and of the gates for the whole
NSA).  Indices are random, with padding (-1), duplicates, entries after the token's own block and
per-token counts; sequence lengths are not multiples of the block size.
"""
from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from dualattn import nsa as nsa_checks  # noqa: E402
from dualattn.kernels.nsa import plan as nsa_plan  # noqa: E402
from dualattn.torch_api import apply_native_sparse_attention, native_sparse_attention  # noqa: E402
from nsa_reference import reference_nsa, reference_selected, reference_topk  # noqa: E402
from reference import assert_close_rel  # noqa: E402

FP32_TOL = 1e-5
HALF_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def random_selection(gen, batch, seqlen, heads_kv, slots, block_size):
    """Indices in [-1, n_blocks + 1): padding, blocks after the own block, and a duplicated slot."""
    n_blocks = -(-seqlen // block_size)
    idx = torch.randint(-1, n_blocks + 1, (batch, seqlen, heads_kv, slots), generator=gen, dtype=torch.int32)
    if slots > 1:
        idx[..., -1] = idx[..., 0]
    counts = torch.randint(0, slots + 1, (batch, seqlen, heads_kv), generator=gen, dtype=torch.int32)
    return idx, counts


def qkv(gen, batch, seqlen, hq, hkv, d, dv=None, dtype=torch.float32, device="cpu"):
    shapes = ((batch, seqlen, hq, d), (batch, seqlen, hkv, d), (batch, seqlen, hkv, dv or d))
    return [torch.randn(s, generator=gen).to(device=device, dtype=dtype).requires_grad_() for s in shapes]


def check_selected(q, k, v, idx, counts, block_size, tol, cu_seqlens=None, scale=None):
    out = apply_native_sparse_attention(q, k, v, idx, counts, block_size, softmax_scale=scale, cu_seqlens=cu_seqlens)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v)]
    ref = reference_selected(*leaves, idx.cpu(), counts if isinstance(counts, int) else counts.cpu(), block_size,
                             scale, None if cu_seqlens is None else cu_seqlens.cpu())
    assert_close_rel(out, ref, tol, "out")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, leaves, dout.double().cpu())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close_rel(g, r, tol, name)


def force_loop(monkeypatch, loop):
    """Run the forward's query-major loop over selection entries ("entries") or over blocks ("scan"), or
    the key-major forward ("by_key"), whatever the plan would pick.  The dQ pass follows `scan`."""
    monkeypatch.setattr(nsa_plan, "scan_blocks", lambda shapes, t: loop == "scan")
    monkeypatch.setattr(nsa_plan, "key_major", lambda shapes: loop == "by_key")


# (group, seqlen, head_dim, head_dim_v, block_size, loop): every group size and every loop, D not a power
# of two, Dv != D, a ragged end; key-major with blocks of one key tile (held for the walk) and of two
# (fp32 tiles of 32 keys for blocks of 64: reloaded per step).
SELECTED_CASES = [
    (1, 56, 32, None, 16, "by_key"),
    (2, 72, 24, None, 16, "scan"),
    (2, 160, 16, None, 64, "by_key"),
    (4, 50, 16, 32, 32, "entries"),
    (4, 50, 16, 32, 32, "by_key"),
    (8, 48, 32, None, 16, "scan"),
    (8, 48, 24, None, 16, "by_key"),
    (16, 24, 16, None, 16, "entries"),
    (16, 40, 16, None, 16, "by_key"),
]


@pytest.mark.parametrize("group, seqlen, d, dv, block_size, loop", SELECTED_CASES)
def test_selected_branch(torch_gen, monkeypatch, group, seqlen, d, dv, block_size, loop):
    force_loop(monkeypatch, loop)
    heads_kv = 2 if group == 2 else 1
    q, k, v = qkv(torch_gen, 1, seqlen, group * heads_kv, heads_kv, d, dv)
    idx, counts = random_selection(torch_gen, 1, seqlen, heads_kv, 3, block_size)
    check_selected(q, k, v, idx, counts, block_size, FP32_TOL, scale=0.3)


def test_selected_branch_scalar_count_and_batch(torch_gen):
    q, k, v = qkv(torch_gen, 2, 40, 4, 2, 16)
    idx, _ = random_selection(torch_gen, 2, 40, 2, 3, 16)
    check_selected(q, k, v, idx, 2, 16, FP32_TOL)


@pytest.mark.parametrize("loop", ["scan", "by_key"])
def test_selected_branch_varlen(torch_gen, monkeypatch, loop):
    force_loop(monkeypatch, loop)
    cu = torch.tensor([0, 37, 40, 80], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 80, 2, 1, 16)
    idx, counts = random_selection(torch_gen, 1, 80, 1, 3, 16)
    check_selected(q, k, v, idx, counts, 16, FP32_TOL, cu_seqlens=cu)


@pytest.mark.parametrize("loop", ["scan", "by_key"])
def test_selected_branch_varlen_writes_every_row(torch_gen, monkeypatch, loop):
    """A table read on the host that covers every token (NsaShapes.rows_covered) skips the fill of out and
    lse: each loop must write every row itself, those of a token with nothing selected included.  Fresh
    buffers hold NaN here."""
    force_loop(monkeypatch, loop)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", poisoned)
    cu = torch.tensor([0, 37, 40, 80], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 80, 2, 1, 16)
    idx, counts = random_selection(torch_gen, 1, 80, 1, 3, 16)
    counts[0, 38] = 0   # a token with nothing selected
    check_selected(q, k, v, idx, counts, 16, FP32_TOL, cu_seqlens=cu)


def test_selected_branch_backward_is_bitwise_reproducible(torch_gen):
    """Every dK / dV row comes from one program over a stably sorted list: two runs, the same bits."""
    q, k, v = qkv(torch_gen, 2, 96, 4, 2, 16)
    idx, counts = random_selection(torch_gen, 2, 96, 2, 4, 16)
    out = apply_native_sparse_attention(q, k, v, idx, counts, 16)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout)
    again = torch.autograd.grad(apply_native_sparse_attention(q, k, v, idx, counts, 16), (q, k, v), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_selected_branch_block_of_many_tokens_and_of_none(torch_gen):
    """Block 0 is named (twice) by all 128 tokens, more than one step of the key-major dK / dV
    pass; block 2 by none, so its keys get exactly zero gradients."""
    group, seqlen, block_size = 2, 128, 16
    q, k, v = qkv(torch_gen, 1, seqlen, group, 1, 16)
    assert seqlen > nsa_plan.dkv_tiles(nsa_plan.NsaShapes(1, seqlen, group, 1, 16, 16, 3, block_size, "float32",
                                                          False)).tokens
    own = torch.arange(seqlen, dtype=torch.int32) // block_size
    idx = torch.stack([torch.zeros_like(own), torch.where(own == 2, 1, own), torch.zeros_like(own)], -1)
    idx = idx[None, :, None, :].contiguous()
    check_selected(q, k, v, idx, 3, block_size, FP32_TOL)
    out = apply_native_sparse_attention(q, k, v, idx, 3, block_size)
    _, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    for grad in (dk, dv):
        assert torch.count_nonzero(grad[:, 2 * block_size:3 * block_size]) == 0
        assert torch.count_nonzero(grad[:, :block_size]) == grad[:, :block_size].numel()


@pytest.mark.parametrize("loop", ["scan", "by_key"])
def test_selected_branch_list_split_over_chunks(torch_gen, monkeypatch, loop):
    """Block 0 is named twice by every token, a 256-entry list cut into chunks of 7 entries (odd, so
    chunk edges fall between a token's two entries: the second must still be dropped); its partial
    dK, dV are summed by the reduction, and key-major its partial outputs merged per token.  Against
    the reference, and bitwise reproducible."""
    chunk = 7
    force_loop(monkeypatch, loop)
    monkeypatch.setattr(nsa_plan, "dkv_chunk", lambda shapes: chunk)
    monkeypatch.setattr(nsa_plan, "key_major_chunk", lambda shapes: chunk)
    group, seqlen, block_size = 2, 128, 16
    shapes = nsa_plan.NsaShapes(1, seqlen, group, 1, 16, 16, 3, block_size, "float32", False)
    plan = nsa_plan.plan_backward(shapes, 0.25, 3)
    assert plan.chunk_entries == chunk and plan.max_chunks >= 2 * seqlen // chunk
    q, k, v = qkv(torch_gen, 1, seqlen, group, 1, 16)
    own = torch.arange(seqlen, dtype=torch.int32) // block_size
    idx = torch.stack([torch.zeros_like(own), torch.zeros_like(own), torch.where(own == 2, 1, own)], -1)
    idx = idx[None, :, None, :].contiguous()
    check_selected(q, k, v, idx, 3, block_size, FP32_TOL)
    dout = torch.randn(1, seqlen, group, 16, generator=torch_gen)
    out = apply_native_sparse_attention(q, k, v, idx, 3, block_size)
    out_again = apply_native_sparse_attention(q, k, v, idx, 3, block_size)
    assert torch.equal(out, out_again)
    first = torch.autograd.grad(out, (q, k, v), dout)
    again = torch.autograd.grad(out_again, (q, k, v), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for grad in first[1:]:   # block 2: selected by nobody
        assert torch.count_nonzero(grad[:, 2 * block_size:3 * block_size]) == 0


@pytest.mark.parametrize("loop", ["scan", "by_key"])
def test_selected_branch_varlen_rows_outside_every_sequence(torch_gen, monkeypatch, loop):
    """Packed rows after the last sequence select nothing: zero output and gradients there, the rest as
    the reference of the sequences alone."""
    force_loop(monkeypatch, loop)
    cu = torch.tensor([0, 21, 60], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 72, 4, 2, 16)
    idx, counts = random_selection(torch_gen, 1, 72, 2, 3, 16)
    out = apply_native_sparse_attention(q, k, v, idx, counts, 16, cu_seqlens=cu)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    leaves = [x.detach()[:, :60].double().requires_grad_() for x in (q, k, v)]
    ref = reference_selected(*leaves, idx[:, :60], counts[:, :60], 16, None, cu)
    assert_close_rel(out[:, :60], ref, FP32_TOL, "out")
    assert torch.count_nonzero(out[:, 60:]) == 0
    for name, g, r in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(ref, leaves, dout[:, :60].double())):
        assert_close_rel(g[:, :60], r, FP32_TOL, name)
        assert torch.count_nonzero(g[:, 60:]) == 0, name


@pytest.mark.parametrize("dtype, loop", [(torch.bfloat16, "scan"), (torch.float16, "scan"),
                                         (torch.bfloat16, "by_key")])
def test_selected_branch_half(torch_gen, monkeypatch, dtype, loop):
    force_loop(monkeypatch, loop)
    q, k, v = qkv(torch_gen, 1, 64, 2, 1, 32, dtype=dtype)
    idx, counts = random_selection(torch_gen, 1, 64, 1, 2, 16)
    check_selected(q, k, v, idx, counts, 16, HALF_TOL[dtype])
    out = apply_native_sparse_attention(q, k, v, idx, counts, 16)
    assert out.dtype == dtype


@pytest.mark.parametrize("loop", ["scan", "by_key"])
def test_selected_branch_duplicates_count_once(torch_gen, monkeypatch, loop):
    """Naming a block twice is the same as naming it once (not a doubled weight).  Within an fp32 rounding:
    key-major, the entry kept may be the duplicate's, computed in another gathered tile, and the
    interpreter's matmul (NumPy's BLAS) can round a row differently with its tile."""
    force_loop(monkeypatch, loop)
    q, k, v = qkv(torch_gen, 1, 64, 2, 1, 16)
    once = torch.tensor([0, 3, -1, -1], dtype=torch.int32).expand(1, 64, 1, 4).contiguous()
    twice = torch.tensor([0, 3, 0, 3], dtype=torch.int32).expand(1, 64, 1, 4).contiguous()
    a = apply_native_sparse_attention(q, k, v, once, 4, 16)
    b = apply_native_sparse_attention(q, k, v, twice, 4, 16)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # A token before block 3 sees block 0 only; token 0 sees key 0 only.
    torch.testing.assert_close(a[0, 0], v[0, 0, 0].expand(2, 16), rtol=1e-6, atol=1e-6)


def _gates(gen, batch, seqlen, hq, which="csw"):
    return [torch.rand(batch, seqlen, hq, generator=gen).requires_grad_() if c in which else None for c in "csw"]


def check_nsa(q, k, v, gates, tol, **kw):
    out, used = native_sparse_attention(q, k, v, *gates, return_block_indices=True, **kw)
    leaves = [x.detach().double().requires_grad_() for x in (q, k, v)]
    gate_leaves = [None if g is None else g.detach().double().requires_grad_() for g in gates]
    ref, ref_used = reference_nsa(*leaves, *gate_leaves, **kw)
    if kw.get("block_indices") is None:
        assert torch.equal(used.long(), ref_used), "the selected blocks differ from the reference's top-k"
    assert_close_rel(out, ref, tol, "out")
    dout = torch.randn_like(out)
    inputs = [x for x in (q, k, v, *gates) if x is not None]
    ref_inputs = [x for x in (*leaves, *gate_leaves) if x is not None]
    names = ["dq", "dk", "dv"] + [f"d{n}" for n, g in zip(("g_cmp", "g_slc", "g_swa"), gates) if g is not None]
    for name, g, r in zip(names, torch.autograd.grad(out, inputs, dout),
                          torch.autograd.grad(ref, ref_inputs, dout.double())):
        assert_close_rel(g, r, tol, name)


@pytest.mark.parametrize("group, seqlen, block_size, count, window", [
    (2, 64, 16, 2, 8), pytest.param(4, 96, 32, 3, 20, marks=pytest.mark.slow)])
def test_native_sparse_attention(torch_gen, group, seqlen, block_size, count, window):
    q, k, v = qkv(torch_gen, 1, seqlen, group, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, 1, seqlen, group), FP32_TOL, block_counts=count, block_size=block_size,
              window_size=window)


def test_native_sparse_attention_without_autograd_is_the_same(torch_gen):
    """Under torch.no_grad the compressed branch writes its blocks' last-token rows into the flash output in
    place (no backward holds it): the same bits as with autograd recording."""
    q, k, v = qkv(torch_gen, 1, 70, 2, 1, 16)
    gates = _gates(torch_gen, 1, 70, 2, "cs")
    with_graph = native_sparse_attention(q, k, v, *gates, block_counts=2, block_size=16)
    with torch.no_grad():
        without = native_sparse_attention(q, k, v, *gates, block_counts=2, block_size=16)
    assert with_graph.requires_grad and not without.requires_grad
    assert torch.equal(with_graph, without)


def _compiled_and_eager(backend, q, k, v, gates, **opts):
    """(eager out and gradients, torch.compile(fullgraph=True)'s) of the whole NSA."""
    def nsa(*args):
        return native_sparse_attention(*args, **opts)
    inputs = (q, k, v, *gates)
    results = []
    for fn in (nsa, torch.compile(nsa, backend=backend, fullgraph=True)):
        out = fn(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, torch.ones_like(out))))
    return results


def test_native_sparse_attention_torch_compile(torch_gen):
    """torch.compile(fullgraph=True) traces the whole NSA, forward and backward, through its custom ops
    (nsa_pool, nsa_top_blocks, nsa_selected_fwd / _bwd, nsa_gates / _bwd and flash's, shaped by their
    fakes): with aot_eager, eager mode's bits."""
    q, k, v = qkv(torch_gen, 1, 64, 4, 2, 16)
    eager, compiled = _compiled_and_eager("aot_eager", q, k, v, _gates(torch_gen, 1, 64, 4), block_counts=2,
                                          block_size=16, window_size=8)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), eager, compiled):
        assert torch.equal(a, b), name


def test_native_sparse_attention_given_indices_and_partial_gates(torch_gen):
    q, k, v = qkv(torch_gen, 1, 64, 2, 1, 16)
    idx, counts = random_selection(torch_gen, 1, 64, 1, 3, 16)
    check_nsa(q, k, v, _gates(torch_gen, 1, 64, 2, "cs"), FP32_TOL, block_indices=idx, block_counts=counts,
              block_size=16)


def test_compressed_branch_shorter_than_a_block_gives_zero_gradients(torch_gen):
    """With only the compressed gate and no whole block in the sequence, nobody sees a pooled block:
    out = 0, and q, k, v get zero gradients (as in JAX), not none; an inf in them stays out."""
    q, k, v = qkv(torch_gen, 1, 10, 2, 1, 16)
    with torch.no_grad():
        k[0, 3, 0, 0] = float("inf")
    g_cmp = torch.rand(1, 10, 2, generator=torch_gen).requires_grad_()
    out = native_sparse_attention(q, k, v, g_cmp, None, None, block_size=16)
    grads = torch.autograd.grad(out, (q, k, v, g_cmp), torch.randn_like(out))
    assert not out.any() and all(g is not None and not g.any() for g in grads)


def test_repeated_calls_add_no_launch_records(torch_gen):
    """NSA's plans are built anew on every call; equal launches share one launcher record (keyed on
    the launch's value), so a training loop does not add records, and first-launch work, per step."""
    from dualattn.torch_api import _launch
    q, k, v = qkv(torch_gen, 1, 64, 2, 1, 16)
    gates = _gates(torch_gen, 1, 64, 2)

    def step():
        out = native_sparse_attention(q, k, v, *gates, block_counts=2, block_size=16, window_size=8)
        torch.autograd.grad(out, (q, k, v, *gates), torch.ones_like(out))
    step()
    records = len(_launch._COMPILED)
    step()
    assert len(_launch._COMPILED) == records


def test_native_sparse_attention_varlen(torch_gen):
    cu = torch.tensor([0, 40, 45, 90], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 90, 2, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, 1, 90, 2), FP32_TOL, block_counts=2, block_size=16, window_size=10,
              cu_seqlens=cu)


@pytest.mark.parametrize("groups_of", [None, 2])
def test_native_sparse_attention_many_sequences(torch_gen, monkeypatch, groups_of):
    """Packed sequences run the compressed branch and the selection as one call each
    (nsa.packed_compressed): sequences shorter than a block, of whole blocks only, of one block and a
    tail, an empty one; with groups_of, the launches cut into groups of two sequences
    (nsa.sequence_groups).  Forward, chosen blocks and gradients against the reference."""
    if groups_of is not None:
        monkeypatch.setattr(nsa_checks, "packed_sequences_per_launch", lambda heads_q: groups_of)
    cu = torch.tensor([0, 10, 42, 58, 58, 80, 128], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 128, 2, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, 1, 128, 2), FP32_TOL, block_counts=2, block_size=16, window_size=10,
              cu_seqlens=cu)


def test_native_sparse_attention_packed_sequences_without_blocks(torch_gen):
    """No sequence holds a whole block: the compressed branch gives zeros, each token selects its own block."""
    cu = torch.tensor([0, 10, 25, 40], dtype=torch.int32)
    q, k, v = qkv(torch_gen, 1, 40, 2, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, 1, 40, 2, "cs"), FP32_TOL, block_counts=2, block_size=16, cu_seqlens=cu)


def test_top_k_ties_go_to_the_lower_block(torch_gen):
    """Zero queries give equal compressed probabilities: the own block, then the lowest blocks."""
    q = torch.zeros(1, 80, 2, 16)
    k, v = torch.randn(1, 80, 1, 16, generator=torch_gen), torch.randn(1, 80, 1, 16, generator=torch_gen)
    _, used = native_sparse_attention(q, k, v, g_slc=torch.ones(1, 80, 2), block_counts=3, block_size=16,
                                      return_block_indices=True)
    assert used[0, 79, 0].tolist() == [4, 0, 1]
    assert used[0, 20, 0].tolist() == [1, 0, -1]   # only two blocks at or before token 20's own
    assert used[0, 5, 0].tolist() == [0, -1, -1]


def test_top_k_matches_reference_on_probabilities():
    probs = torch.tensor([[[[0.1, 0.5, 0.5, 0.2, 0.0]] * 1]], dtype=torch.float64).expand(1, 1, 80, 5).contiguous()
    chosen = reference_topk(probs, 1, 80, 16, 3)
    assert chosen[0, 79, 0].tolist() == [4, 1, 2]


def _small(gen):
    return qkv(gen, 1, 32, 2, 1, 16) + [torch.zeros(1, 32, 1, 2, dtype=torch.int32)]


@pytest.mark.parametrize("change, error, words", [
    (dict(query=torch.zeros(1, 32, 3, 16), key=torch.zeros(1, 32, 2, 16), value=torch.zeros(1, 32, 2, 16)),
     ValueError, "multiple of key/value heads"),
    (dict(key=torch.zeros(1, 31, 1, 16)), ValueError, "key must have shape"),
    (dict(block_indices=torch.zeros(1, 32, 2, 2, dtype=torch.int32)), ValueError, "block_indices must have shape"),
    (dict(block_indices=torch.zeros(1, 32, 1, 2)), TypeError, "block_indices must be an integer"),
    (dict(block_counts=torch.zeros(1, 32, 2, dtype=torch.int32)), ValueError, "block_counts must be an int"),
    (dict(block_counts=-1), ValueError, "block_counts must be >= 0"),
    (dict(block_counts=2.0), TypeError, "block_counts must be an int"),
    (dict(block_size=48), ValueError, "block_size must be one of"),
    (dict(query=torch.zeros(1, 32, 2, 16, dtype=torch.float64)), TypeError, "query must be float16"),
    (dict(cu_seqlens=torch.tensor([0, 40], dtype=torch.int32)), ValueError, "cu_seqlens"),
    (dict(query=torch.zeros(1, 32, 2, 300), key=torch.zeros(1, 32, 1, 300)), ValueError, "head_dim"),
])
def test_bad_input(torch_gen, change, error, words):
    q, k, v, idx = _small(torch_gen)
    args = dict(query=q, key=k, value=v, block_indices=idx, block_counts=2, block_size=16)
    args.update(change)
    with pytest.raises(error, match=words):
        apply_native_sparse_attention(**args)


def test_bad_gates(torch_gen):
    q, k, v, _ = _small(torch_gen)
    with pytest.raises(ValueError, match="at least one of g_cmp"):
        native_sparse_attention(q, k, v, block_size=16)
    with pytest.raises(ValueError, match="g_slc must have shape"):
        native_sparse_attention(q, k, v, g_slc=torch.ones(1, 32, 1), block_size=16)
    with pytest.raises(ValueError, match="window_size must be >= 0"):
        native_sparse_attention(q, k, v, g_swa=torch.ones(1, 32, 2), block_size=16, window_size=-1)
    with pytest.raises(ValueError, match="g_swa is given but window_size is 0"):
        native_sparse_attention(q, k, v, g_swa=torch.ones(1, 32, 2), block_size=16)
    with pytest.raises(TypeError, match="deterministic"):
        native_sparse_attention(q, k, v, g_cmp=torch.ones(1, 32, 2), block_size=16, deterministic="yes")
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] must be the 32 packed tokens"):
        native_sparse_attention(q, k, v, g_cmp=torch.ones(1, 32, 2), block_size=16,
                                cu_seqlens=torch.tensor([0, 16, 30], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("group, loop", [(1, "scan"), (4, "scan"), (16, "entries"), (1, "by_key"), (4, "by_key"),
                                         (8, "by_key")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_selected_branch_gpu(torch_gen, monkeypatch, group, loop, dtype):
    force_loop(monkeypatch, loop)
    seqlen, block_size = 1024, 64
    q, k, v = qkv(torch_gen, 1, seqlen, 2 * group, 2, 128, dtype=dtype, device="cuda")
    idx, counts = random_selection(torch_gen, 1, seqlen, 2, 16, block_size)
    check_selected(q, k, v, idx.cuda(), counts.cuda(), block_size, HALF_TOL[torch.bfloat16] if
                   dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("d, dv", [(40, 32), (24, 16), (72, 32)])
def test_selected_branch_narrow_values_gpu(torch_gen, d, dv):
    """Head dims whose rows are not 16-aligned with narrow V tiles: Triton 3.6 miscompiled the flash
    kernels there on sm_90 (NOTES: "Narrow head-dim tiles miscompile"); NSA's kernels
    pad V to their own tiles, checked here on the GPU against the reference."""
    seqlen, block_size = 512, 32
    q, k, v = qkv(torch_gen, 1, seqlen, 8, 2, d, dv, dtype=torch.bfloat16, device="cuda")
    idx, counts = random_selection(torch_gen, 1, seqlen, 2, 8, block_size)
    check_selected(q, k, v, idx.cuda(), counts.cuda(), block_size, HALF_TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("group, loop", [(4, "scan"), (16, "entries"), (4, "by_key")])
def test_selected_branch_split_lists_gpu(torch_gen, monkeypatch, group, loop):
    """Compiled chunk and reduction kernels: block 0 in nearly every token's selection, its list cut
    into many chunks of 37 entries (the default chunks hold whole lists at 1k tokens), in the
    backward and, key-major, in the forward; against the reference, and bitwise reproducible."""
    force_loop(monkeypatch, loop)
    monkeypatch.setattr(nsa_plan, "dkv_chunk", lambda shapes: 37)
    monkeypatch.setattr(nsa_plan, "key_major_chunk", lambda shapes: 37)
    seqlen, block_size = 1024, 64
    q, k, v = qkv(torch_gen, 1, seqlen, 2 * group, 2, 128, dtype=torch.bfloat16, device="cuda")
    idx, counts = random_selection(torch_gen, 1, seqlen, 2, 16, block_size)
    idx[..., 1] = 0
    idx, counts = idx.cuda(), counts.cuda()
    check_selected(q, k, v, idx, counts, block_size, HALF_TOL[torch.bfloat16])
    out = apply_native_sparse_attention(q, k, v, idx, counts, block_size)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout)
    out_again = apply_native_sparse_attention(q, k, v, idx, counts, block_size)
    assert torch.equal(out, out_again)
    again = torch.autograd.grad(out_again, (q, k, v), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 16])
def test_native_sparse_attention_cuda_graph_gpu(torch_gen, group):
    """The forward makes no host synchronisation, so it captures in a CUDA graph as it is (what takes the
    host's launch work out of short sequences): a replay on new inputs gives the eager output."""
    seqlen = 2048
    q, k, v = [x.detach().to("cuda", torch.bfloat16) for x in qkv(torch_gen, 1, seqlen, 4 * group, 4, 128)]
    gates = [g.detach().to("cuda", torch.bfloat16) for g in _gates(torch_gen, 1, seqlen, 4 * group)]

    def call():
        return native_sparse_attention(q, k, v, *gates, block_counts=8, block_size=64, window_size=256)
    from dualattn.bench.flash import captured
    with torch.no_grad():
        graph, out = captured(call)
        for x in (q, k, v, *gates):
            x.copy_(torch.randn(x.shape, generator=torch_gen).to(x))
        graph.replay()
        assert torch.equal(out, call())


@pytest.mark.gpu
def test_native_sparse_attention_deterministic_gpu(torch_gen):
    """deterministic=True: the same gradients bit for bit, at 4096 tokens in bf16, where the sliding branch's
    flash backward would otherwise run the one-pass Hopper kernel and its dQ atomics."""
    seqlen, group = 4096, 4
    q, k, v = [x.detach().to("cuda", torch.bfloat16).requires_grad_() for x in qkv(torch_gen, 1, seqlen, group, 1, 128)]
    gates = [g.detach().to("cuda", torch.bfloat16).requires_grad_() for g in _gates(torch_gen, 1, seqlen, group)]
    dout = torch.randn(1, seqlen, group, 128, generator=torch_gen).to("cuda", torch.bfloat16)

    def grads():
        out = native_sparse_attention(q, k, v, *gates, block_counts=4, block_size=64, window_size=512,
                                      deterministic=True)
        return torch.autograd.grad(out, (q, k, v, *gates), dout)
    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 16])
@pytest.mark.parametrize("dtype, seqlen", [(torch.float32, 1024), (torch.bfloat16, 1000)])
def test_native_sparse_attention_gpu(torch_gen, group, dtype, seqlen):
    """fp32 (TF32x3 dots) and bf16, where the compressed branch's folded launch runs on the fast flash
    kernels; 1000 tokens leave a tail after the last whole block."""
    q, k, v = [x.detach().cuda().requires_grad_() for x in qkv(torch_gen, 1, seqlen, group, 1, 128, dtype=dtype)]
    gates = [g.detach().to("cuda", dtype).requires_grad_() for g in _gates(torch_gen, 1, seqlen, group)]
    out, used = native_sparse_attention(q, k, v, *gates, block_counts=8, block_size=64, window_size=128,
                                        return_block_indices=True)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, *gates)]
    ref, _ = reference_nsa(*leaves[:3], *leaves[3:], block_indices=used.cpu(), block_counts=8, block_size=64,
                           window_size=128)
    tol = 1e-4 if dtype == torch.float32 else HALF_TOL[dtype]
    assert_close_rel(out, ref, tol, "out")
    dout = torch.randn_like(out)
    for name, g, r in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"),
                          torch.autograd.grad(out, (q, k, v, *gates), dout),
                          torch.autograd.grad(ref, leaves, dout.double().cpu())):
        assert_close_rel(g, r, tol, name)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [4, 16])
def test_native_sparse_attention_many_sequences_gpu(torch_gen, group):
    """Packed sequences on the varlen flash kernels and the varlen importance kernel (nsa.packed_compressed):
    one shorter than a block, one of exactly one block, tails; bf16, against the reference on the blocks
    chosen, forward and gradients."""
    cu = torch.tensor([0, 40, 300, 812, 876, 1536], dtype=torch.int32, device="cuda")
    seqlen, dtype = 1536, torch.bfloat16
    q, k, v = [x.detach().to("cuda", dtype).requires_grad_() for x in qkv(torch_gen, 1, seqlen, 4 * group, 4, 128)]
    gates = [g.detach().to("cuda", dtype).requires_grad_() for g in _gates(torch_gen, 1, seqlen, 4 * group)]
    opts = dict(block_counts=8, block_size=64, window_size=128, cu_seqlens=cu)
    out, used = native_sparse_attention(q, k, v, *gates, return_block_indices=True, **opts)
    # The front end reads cu_seqlens' values on the host: a CUDA table once (flash.table_values: the call
    # above read it), again once replaced or changed in place, a CPU table with no synchronisation; the
    # tables made from those values are checked from them (flash.host_table), never read back.
    def host_syncs(table):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                warnings.simplefilter("always")
                again = native_sparse_attention(q, k, v, *gates, **dict(opts, cu_seqlens=table))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert torch.equal(again, out.detach())
        return [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert host_syncs(cu) == []
    assert len(host_syncs(cu.clone())) == 1
    assert host_syncs(cu.cpu()) == []
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, *gates)]
    ref, _ = reference_nsa(*leaves[:3], *leaves[3:], block_indices=used.cpu(), **dict(opts, cu_seqlens=cu.cpu()))
    assert_close_rel(out, ref, HALF_TOL[dtype], "out")
    dout = torch.randn_like(out)
    for name, g, r in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"),
                          torch.autograd.grad(out, (q, k, v, *gates), dout),
                          torch.autograd.grad(ref, leaves, dout.double().cpu())):
        assert_close_rel(g, r, HALF_TOL[dtype], name)


@pytest.mark.gpu
def test_compressed_branch_in_batch_slices_gpu(torch_gen):
    """Batch * folded heads past CUDA's grid-y limit on the GPU: 17 rows of 64 * 64 folded heads in fp32,
    whose flash grids put batch * heads on y (69632 > 65535), run as batch slices; output, gradients and
    the chosen blocks as the reference's."""
    import dualattn.nsa as checks
    assert checks.compressed_batch_rows(64, 64) < 17
    q, k, v = [x.detach().cuda().requires_grad_() for x in qkv(torch_gen, 17, 128, 64, 4, 32)]
    gates = [g.detach().cuda().requires_grad_() for g in _gates(torch_gen, 17, 128, 64, "cs")[:2]]
    out, used = native_sparse_attention(q, k, v, *gates, block_counts=2, block_size=64, return_block_indices=True)
    leaves = [x.detach().double().cpu().requires_grad_() for x in (q, k, v, *gates)]
    ref, ref_used = reference_nsa(*leaves, block_counts=2, block_size=64)
    assert torch.equal(used.cpu().long(), ref_used)
    assert_close_rel(out, ref, 1e-4, "out")
    dout = torch.randn_like(out)
    for name, g, r in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc"), torch.autograd.grad(out, (q, k, v, *gates), dout),
                          torch.autograd.grad(ref, leaves, dout.double().cpu())):
        assert_close_rel(g, r, 1e-4, name)


@pytest.mark.gpu
def test_native_sparse_attention_torch_compile_gpu(torch_gen):
    """Inductor, fullgraph, on the GPU (bf16, 1000 tokens): eager mode's output bits (the kernels are the
    custom ops; inductor compiles only the glue between them, copies and reshapes), gradients within bf16
    rounding (inductor may add the branches' parts of a gradient in one rounding, eager in three)."""
    q, k, v = [x.detach().cuda().requires_grad_() for x in qkv(torch_gen, 1, 1000, 8, 2, 128, dtype=torch.bfloat16)]
    gates = [g.detach().to("cuda", torch.bfloat16).requires_grad_() for g in _gates(torch_gen, 1, 1000, 8)]
    eager, compiled = _compiled_and_eager("inductor", q, k, v, gates, block_counts=8, block_size=64,
                                          window_size=128, deterministic=True)
    assert torch.equal(eager[0], compiled[0])
    for name, a, b in zip(("dq", "dk", "dv", "dg_cmp", "dg_slc", "dg_swa"), eager[1:], compiled[1:]):
        assert_close_rel(b, a, 1e-2, name)


@pytest.mark.gpu
@pytest.mark.parametrize("present", ["csw", "sw", "c"])
def test_gated_sum_gpu(torch_gen, present):
    """The gated sum of the branches and its backward (kernels/nsa/gates.py) in bf16, at a head dim
    that is not a power of two, with an fp32 gate beside bf16 ones, against float64."""
    from dualattn.torch_api.nsa import _GatedSum
    shape = (2, 300, 6, 96)
    terms = []
    for c in "csw":
        if c not in present:
            terms += [None, None]
            continue
        gate_dtype = torch.float32 if c == "s" else torch.bfloat16
        terms += [torch.rand(shape[:-1], generator=torch_gen).to("cuda", gate_dtype).requires_grad_(),
                  torch.randn(shape, generator=torch_gen).to("cuda", torch.bfloat16).requires_grad_()]
    out = _GatedSum.apply(torch.bfloat16, *terms)
    given = [x for x in terms if x is not None]
    leaves = [x.detach().double().requires_grad_() for x in given]
    ref = sum(g[..., None] * o for g, o in zip(leaves[::2], leaves[1::2]))
    assert out.dtype == torch.bfloat16
    assert_close_rel(out, ref, 1e-2, "out")
    dout = torch.randn(shape, generator=torch_gen).to("cuda", torch.bfloat16)
    for x, g, r in zip(given, torch.autograd.grad(out, given, dout), torch.autograd.grad(ref, leaves, dout.double())):
        assert g.dtype == x.dtype
        assert_close_rel(g, r, 1e-2, "gradient")


def test_top_k_lowest_ties(torch_gen):
    """Many ties, +inf and -inf: the k largest by decreasing value, ties to the lower index."""
    from dualattn.torch_api.nsa import top_k_lowest_ties
    score = torch.randint(0, 4, (50, 12), generator=torch_gen).float()
    score[score == 0] = float("-inf")
    score[:, 5] = float("inf")
    got = top_k_lowest_ties(score, 6)
    for row, idx in zip(score.tolist(), got.tolist()):
        assert idx == sorted(range(12), key=lambda c: (-row[c], c))[:6]


@pytest.mark.parametrize("rows, blocks, count", [(50, 12, 6), (7, 40, 16), (5, 3, 4)])
def test_top_k_kernel(torch_gen, rows, blocks, count):
    """The shared top-k kernel: many ties, +inf and -inf; by decreasing value, ties to the lower index,
    -1 once only -inf entries are left (fewer blocks than slots included)."""
    from dualattn.torch_api import _launch
    score = torch.randint(0, 4, (rows, blocks), generator=torch_gen).float()
    score[score == 0] = float("-inf")
    score[:, blocks // 2] = float("inf")
    got = _launch.run(nsa_plan.plan_topk(rows, blocks, count), dict(scores=score))["indices"]
    for row, idx in zip(score.tolist(), got.tolist()):
        want = [c for c in sorted(range(blocks), key=lambda c: (-row[c], c)) if row[c] != float("-inf")][:count]
        assert idx == want + [-1] * (count - len(want))


def test_top_k_kernel_reads_causal_prefixes(torch_gen):
    """causal_rows: (B, seqlen, Hkv) rows that are -inf past their token's own block, as the importance
    scores are; programs read the eighth, quarter, half or whole of the row their tokens need (here 16,
    32, 64 and 128 of 128 blocks, over two sequences): the same indices as the kernel reading whole rows."""
    from dualattn.torch_api import _launch
    batch, seqlen, heads_kv, block_size, count = 2, 256, 1, 2, 5
    blocks = seqlen // block_size
    score = torch.randint(0, 3, (batch, seqlen, heads_kv, blocks), generator=torch_gen).float()
    own = (torch.arange(seqlen) // block_size)[None, :, None, None]
    column = torch.arange(blocks)[None, None, None, :]
    score = torch.where(column > own, float("-inf"), torch.where(column == own, float("inf"), score)).view(-1, blocks)
    whole = _launch.run(nsa_plan.plan_topk(score.shape[0], blocks, count), dict(scores=score))["indices"]
    launch = nsa_plan.plan_topk(score.shape[0], blocks, count, (seqlen, heads_kv, block_size))
    assert torch.equal(_launch.run(launch, dict(scores=score))["indices"], whole)
    assert whole[-1].tolist()[0] == blocks - 1 and whole[2].tolist() == [1, 0, -1, -1, -1]


def test_compressed_branch_in_batch_slices(torch_gen, monkeypatch):
    """Batch * folded heads past CUDA's grid y limit: the compressed branch runs a batch slice a launch
    (nsa.compressed_batch_rows; the limit lowered here so that 2 rows of 16 * 2 heads split); and past it
    with one row, a ValueError before any launch."""
    import dualattn.nsa as checks
    monkeypatch.setattr(checks, "MAX_GRID_Y", 40)
    assert checks.compressed_batch_rows(2, 16) == 1
    q, k, v = qkv(torch_gen, 2, 40, 2, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, 2, 40, 2, "cs"), FP32_TOL, block_counts=2, block_size=16)
    monkeypatch.setattr(checks, "MAX_GRID_Y", 16)
    with pytest.raises(ValueError, match="block_size \\* query heads must be at most 16"):
        native_sparse_attention(q, k, v, g_cmp=torch.ones(1, 40, 2).expand(2, 40, 2), block_size=16)


def _full_size_copies(out, leaf) -> list:
    """The autograd nodes under `out` whose backward writes a zero tensor of `leaf`'s size and copies one part
    of its gradient in (a select, or a contiguous slice): a pass over the whole of q per part, where a view
    or torch.split's backward costs none.  (A strided slice, the blocks' last tokens, has no cheaper form.)"""
    found, seen, stack = [], set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name in ("SelectBackward0", "SliceBackward0") and \
                tuple(node._saved_self_sym_sizes) == tuple(leaf.shape) and getattr(node, "_saved_step", 1) == 1:
            found.append(name)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def test_query_gradient_takes_no_per_part_copies(torch_gen, monkeypatch):
    """The compressed branch's parts (batch slices past the grid limit, the tail after the whole blocks, packed
    sequences) take q as views or torch.split's parts, never as slices or selects, whose backward fills a zero
    q per part and adds them (1 GB a pass at T = 64k, Hq = 64)."""
    import dualattn.nsa as checks
    monkeypatch.setattr(checks, "MAX_GRID_Y", 40)
    q, k, v = (x.requires_grad_() for x in qkv(torch_gen, 2, 40, 2, 1, 16))
    gates = _gates(torch_gen, 2, 40, 2, "csw")
    assert _full_size_copies(native_sparse_attention(q, k, v, *gates, block_counts=2, block_size=16,
                                                     window_size=8), q) == []
    packed = [x[:1].detach().requires_grad_() for x in (q, k, v, *gates)]
    out = native_sparse_attention(*packed, block_counts=2, block_size=16, window_size=8,
                                  cu_seqlens=torch.tensor([0, 21, 40], dtype=torch.int32))
    assert _full_size_copies(out, packed[0]) == []


@pytest.mark.parametrize("batch, seqlen", [(2, 150), (1, 20), (1, 32)])
def test_compressed_branch_launches(torch_gen, batch, seqlen):
    """The compressed branch's three launches (nsa.compressed_launches): phase-folded whole blocks, the
    blocks' last tokens, the tail; with a tail and several blocks, with one block and a tail, with
    two blocks and no tail.  Output, gradients and the chosen blocks as the reference's."""
    q, k, v = qkv(torch_gen, batch, seqlen, 2, 1, 16)
    check_nsa(q, k, v, _gates(torch_gen, batch, seqlen, 2, "cs"), FP32_TOL, block_counts=3, block_size=16)




@pytest.mark.parametrize("block_size, d, dv, seqlen", [(64, 256, 128, 150), (16, 24, 40, 37)])
def test_pool_kernel(torch_gen, block_size, d, dv, seqlen):
    """The compressed branch's pooled keys and values (kernels/nsa/pool.py; at D = 256 summed 32 rows a
    step, D = 24 and 40 padded) and their gradients, against the float64 mean of each whole block; the
    tail's tokens get no gradient."""
    from dualattn.torch_api.nsa import _Pool
    k, v = (torch.randn(2, seqlen, 3, width, generator=torch_gen).requires_grad_() for width in (d, dv))
    pooled = _Pool.apply(k, v, block_size)
    n = seqlen // block_size
    leaves = [x.detach().double().requires_grad_() for x in (k, v)]
    ref = [x[:, :n * block_size].unflatten(1, (n, block_size)).mean(2) for x in leaves]
    for name, got, want in zip(("k_cmp", "v_cmp"), pooled, ref):
        assert_close_rel(got, want, 1e-6, name)
    douts = [torch.randn(p.shape, generator=torch_gen) for p in pooled]
    for name, g, r in zip(("dk", "dv"), torch.autograd.grad(pooled, (k, v), douts),
                          torch.autograd.grad(ref, leaves, [x.double() for x in douts])):
        assert_close_rel(g, r, 1e-6, name)
        assert not g[:, n * block_size:].any()
