"""The torch front end's memo of planned calls (torch_api.flash._CallPlan): a call signature is
resolved and planned once, and anything that could change its plan (sizes, strides, alignment,
options, environment switches, the executor's state) plans again.  On the CPU interpreter."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import dualattn.torch_api as dt  # noqa: E402
from dualattn import executor as ex  # noqa: E402
from dualattn.kernels.flash import plan as flash_plan  # noqa: E402
from dualattn.options import FlashOptions  # noqa: E402
from dualattn.validation import check_flash_args  # noqa: E402
from dualattn.switches import set_for_test as set_switch  # noqa: E402

SHAPE = (1, 48, 2, 32)


@pytest.fixture
def plans(monkeypatch, tmp_path):
    """The configs of every forward / backward plan made from then on (an empty executor memory and
    cache file, so the heuristics answer unless a test says otherwise)."""
    monkeypatch.setenv(ex.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(ex.AUTOTUNE_ENV, raising=False)
    ex.default_executor().clear_memory()
    made = {"forward": [], "backward": []}
    for kind in made:
        real = getattr(flash_plan, f"plan_{kind}")

        def spy(*args, _real=real, _made=made[kind], **kwargs):
            _made.append(kwargs["config"])
            return _real(*args, **kwargs)
        monkeypatch.setattr(flash_plan, f"plan_{kind}", spy)
    yield made
    ex.default_executor().clear_memory()


def qkv(gen, shape=SHAPE):
    return tuple(torch.randn(shape, generator=gen) for _ in range(3))


def test_a_signature_is_planned_once_and_new_values_reuse_it(plans, torch_gen):
    q, k, v = qkv(torch_gen)
    first = dt.flash_attention(q, k, v, causal=True)
    again = dt.flash_attention(q, k, v, causal=True)
    q2, k2, v2 = qkv(torch_gen)
    other = dt.flash_attention(q2, k2, v2, causal=True)
    assert len(plans["forward"]) == 1
    assert torch.equal(first, again) and not torch.allclose(first, other)
    flash_plan.forget_plans()   # the memo is dropped with the plans: planned afresh, same numbers
    assert torch.equal(dt.flash_attention(q2, k2, v2, causal=True), other)
    assert len(plans["forward"]) == 2


def test_sizes_strides_alignment_and_options_plan_again(plans, torch_gen):
    q, k, v = qkv(torch_gen)
    dt.flash_attention(q, k, v)
    dt.flash_attention(q, k, v, causal=True)                           # options
    dt.flash_attention(q[:, :40], k[:, :40], v[:, :40])                # sizes (views of the same memory)
    wide = torch.randn(1, 48, 2, 64, generator=torch_gen)
    dt.flash_attention(wide[..., :32], k, v)                           # strides
    flat = torch.randn(q.numel() + 1, generator=torch_gen)
    dt.flash_attention(flat[1:].view(SHAPE), k, v)                     # a base off 16 bytes
    assert len(plans["forward"]) == 5
    dt.flash_attention(flat[1:].view(SHAPE), k, v)
    dt.flash_attention(q, k, v)
    assert len(plans["forward"]) == 5


def test_environment_switches_and_executor_state_plan_again(plans, torch_gen, monkeypatch):
    q, k, v = qkv(torch_gen)
    heuristic = flash_plan.default_config(check_flash_args(q, k, v), interpret=True, causal=True)
    dt.flash_attention(q, k, v, causal=True)
    set_switch(monkeypatch, flash_plan.EDGES_IN_LOOP_ENV, "0")
    dt.flash_attention(q, k, v, causal=True)
    assert plans["forward"] == [heuristic, heuristic]

    pinned = flash_plan.FlashConfig(*(flash_plan.TileConfig(32, 32, 4, 1),) * 3)
    with ex.override(pinned):
        dt.flash_attention(q, k, v, causal=True)
    dt.flash_attention(q, k, v, causal=True)           # the override is gone: the memoised plan again
    assert plans["forward"] == [heuristic, heuristic, pinned]

    saved = flash_plan.FlashConfig(*(flash_plan.TileConfig(16, 16, 4, 1),) * 3)
    ex.Executor().save("flash", platform="cpu", backend="triton-interpret", device_name="cpu",
                       shapes=check_flash_args(q, k, v), options=FlashOptions.build(head_dim=32, causal=True),
                       config=saved)                   # e.g. another process's autotuning: the file changed
    dt.flash_attention(q, k, v, causal=True)
    assert plans["forward"][-1] == saved


def test_dropout_draws_a_fresh_mask_per_call_from_one_plan(plans, torch_gen):
    q, k, v = qkv(torch_gen)
    a, b = (dt.flash_attention(q, k, v, dropout_prob=0.5) for _ in range(2))
    c, d = (dt.flash_attention(q, k, v, dropout_prob=0.5, dropout_seed=7) for _ in range(2))
    assert len(plans["forward"]) == 1
    assert not torch.equal(a, b) and torch.equal(c, d)


def test_backward_planned_once_per_signature_and_per_lse_use(plans, torch_gen):
    q, k, v = (t.requires_grad_() for t in qkv(torch_gen))
    cot = torch.randn(SHAPE, generator=torch_gen)
    grads = [torch.autograd.grad(dt.flash_attention(q, k, v, causal=True), (q, k, v), cot) for _ in range(2)]
    assert len(plans["forward"]) == 1 and len(plans["backward"]) == 1
    assert all(torch.equal(x, y) for x, y in zip(*grads))
    out, lse = dt.flash_attention(q, k, v, causal=True, return_lse=True)
    torch.autograd.grad((out * cot).sum() + lse.sum(), (q, k, v))   # lse's cotangent: another backward
    assert len(plans["forward"]) == 1 and len(plans["backward"]) == 2


def test_forward_without_gradients_skips_autograd(plans, torch_gen):
    q, k, v = (t.requires_grad_() for t in qkv(torch_gen))
    with torch.no_grad():
        plain = dt.flash_attention(q, k, v, causal=True)
    tracked = dt.flash_attention(q, k, v, causal=True)
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())


def test_varlen_tables_are_read_on_the_host_once(monkeypatch):
    """Reading a CUDA table's values synchronises with the GPU: a cu_seqlens table is read on its first
    call, not on the next layers' calls, and again once it changes in place or is replaced; a bad table
    still raises before any launch."""
    q = torch.randn(24, 2, 16)
    cu = torch.tensor([0, 9, 24], dtype=torch.int32)
    reads = _count_reads(monkeypatch)
    for _ in range(3):
        dt.flash_attn_varlen_func(q, q, q, cu, cu, 15, 15, causal=True)
    assert len(reads) == 1
    dt.flash_attn_varlen_func(q, q, q, cu, cu, 16, 16, causal=True)   # other maxima: checked, not read
    assert len(reads) == 1
    fresh = cu.clone()
    dt.flash_attn_varlen_func(q, q, q, fresh, fresh, 15, 15, causal=True)
    assert len(reads) == 2
    fresh[1] = 30   # in place: its version moves on
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        dt.flash_attn_varlen_func(q, q, q, fresh, fresh, 15, 15, causal=True)
    assert len(reads) == 3
    with torch.inference_mode():   # no version counter to trust: read on every call
        served = torch.tensor([0, 9, 24], dtype=torch.int32)
        for _ in range(2):
            dt.flash_attn_varlen_func(q, q, q, served, served, 15, 15, causal=True)
    assert len(reads) == 5


def test_host_made_tables_are_never_read(monkeypatch):
    """flash.host_table's tables carry their values: the varlen flash checks them from those, and a table
    freed leaves the registry (no stale entry for a later tensor at the same address)."""
    from dualattn.torch_api import flash as torch_flash
    q = torch.randn(24, 2, 16)
    reads = _count_reads(monkeypatch)
    table = torch_flash.host_table([0, 9, 24], "cpu")
    dt.flash_attn_varlen_func(q, q, q, table, table, 15, 15, causal=True)
    assert reads == [] and torch_flash.table_values(table) == (0, 9, 24)
    key = id(table)
    del table
    assert key not in torch_flash._TABLE_VALUES


def _count_reads(monkeypatch) -> list:
    """The host reads of integer tables (Tensor.tolist) from now on."""
    reads, real = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    return reads
