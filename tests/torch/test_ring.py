"""torch ring attention over gloo (CPU, 2 and 4 processes) and NCCL (GPU): output, lse and gradients of
q, k, v and sinks equal flash_attention on the gathered sequence and a float64 reference.

Each rank is its own process (python <script> rank world port), as torchrun would start them; the
script runs several cases per process group, so the interpreter's start-up is paid once.
"""
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import dualattn  # noqa: E402
from dualattn.torch_api import ring_attention  # noqa: E402

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    sys.path.insert(0, sys.argv[4])
    import dualattn
    from dualattn.torch_api import flash_attention, ring_attention
    from reference import assert_close_rel, reference_attention

    rank, world, port, device = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[5]
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    DTYPES = dict(float32=(torch.float32, 2e-5, 2e-4), bfloat16=(torch.bfloat16, 1e-2, 3e-2),
                  float16=(torch.float16, 2e-3, 1e-2))

    def check(case, layout, dtype, seq_len=32, heads=(4, 2), sinks=None, segments=False, **opts):
        dtype, tol_flash, tol_ref = DTYPES[dtype]
        g = torch.Generator().manual_seed(1234 + case)    # the same global inputs on every rank
        hq, hkv = heads
        q = torch.randn(2, seq_len, hq, 16, generator=g)
        k, v = (torch.randn(2, seq_len, hkv, 16, generator=g) for _ in range(2))
        dout = torch.randn(2, seq_len, hq, 16, generator=g)
        dlse = torch.randn(2, hq, seq_len, generator=g)
        s = None if sinks is None else torch.randn(sinks, generator=g)
        seg = None
        if segments:
            cut = torch.sort(torch.randint(1, seq_len, (2, 2), generator=g)).values
            seg = (torch.arange(seq_len)[None, :, None] >= cut[:, None, :]).sum(-1)
        perm = torch.as_tensor(dualattn.ring_permutation(seq_len, world, layout))
        mine = perm.view(world, -1)[rank]
        cast = lambda x: x.detach().to(device=device, dtype=dtype).clone()
        leaves = [cast(x[:, mine]).requires_grad_() for x in (q, k, v)]
        sink_leaf = None if s is None else s.to(device).requires_grad_()
        seg_shard = None if seg is None else seg[:, mine].to(device)
        out, lse = ring_attention(*leaves, layout=layout, softmax_aux=sink_leaf, q_segment_ids=seg_shard,
                                  return_lse=True, **opts)
        assert out.dtype == dtype and lse.dtype == torch.float32
        grads = torch.autograd.grad((out.float() * cast(dout[:, mine]).float()).sum() + (lse * dlse[:, :, mine].to(device)).sum(),
                                    leaves + ([sink_leaf] if s is not None else []))
        full = [cast(x).requires_grad_() for x in (q, k, v)]
        full_sinks = None if s is None else s.to(device).requires_grad_()
        ref_out, ref_lse = flash_attention(*full, softmax_aux=full_sinks, q_segment_ids=None if seg is None else seg.to(device),
                                           return_lse=True, **opts)
        ref_grads = torch.autograd.grad((ref_out.float() * cast(dout).float()).sum() + (ref_lse * dlse.to(device)).sum(),
                                        full + ([full_sinks] if s is not None else []))
        f64 = [x.double().requires_grad_() for x in (q, k, v)] + ([s.double().requires_grad_()] if s is not None else [])
        o64, l64 = reference_attention(*f64[:3], softmax_aux=f64[3] if s is not None else None, q_segment_ids=seg,
                                       **opts)
        g64 = torch.autograd.grad((o64 * dout.double()).sum() + (l64 * dlse.double()).sum(), f64)
        name = f"case {case} rank {rank}"
        if world == 1:   # one launch: flash_attention's own kernel, nothing merged
            assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), name + " world 1 is not flash's output"
        assert_close_rel(out, ref_out[:, mine], tol_flash, name + " out vs flash")
        assert_close_rel(lse, ref_lse[:, :, mine], tol_flash, name + " lse vs flash")
        assert_close_rel(out, o64[:, mine], tol_ref, name + " out vs f64")
        for n, got, want, w64 in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads, g64):
            if n != "dsinks":
                want, w64 = want[:, mine], w64[:, mine]
            # dsinks sums p_sink * (rowsum(dout * out) - dlse) over every row, with cancellation: in 16-bit
            # the rounding of out (once per implementation) moves it by several percent.
            widen = 8 if n == "dsinks" and dtype != torch.float32 else 1
            assert_close_rel(got, want, 4 * widen * tol_flash, f"{name} {n} vs flash")
            assert_close_rel(got, w64, 2 * widen * tol_ref, f"{name} {n} vs f64")

    for case, spec in enumerate(eval(sys.argv[6])):
        check(case, **spec)
    if world == 2 and device == "cpu":
        x = torch.randn(1, 3, 2, 16)     # 6 tokens over 2 ranks: zigzag needs a multiple of 4
        try:
            ring_attention(x, x, x, layout="zigzag")
        except ValueError as e:
            assert "multiple of" in str(e), e
        else:
            raise AssertionError("no error for a sequence zigzag cannot split")
        # arguments that differ between the ranks: the same ValueError on both, and the group stays usable
        x = torch.randn(1, 4, 2, 16)
        mismatched = [
            (dict(query=x.to(torch.bfloat16 if rank == 0 else torch.float32)),
             "query dtype differs across ranks: rank 0 bfloat16, rank 1 float32"),
            (dict(key=x[:, :2 + 2 * rank], value=x[:, :2 + 2 * rank]), "key shape differs across ranks: rank 0 (1, 2, 2, 16), rank 1 (1, 4, 2, 16)"),
            (dict(causal=rank == 0), "causal differs across ranks: rank 0 True, rank 1 False"),
            (dict(sliding_window=(20, 0) if rank else None), "sliding_window differs across ranks: rank 0 None, rank 1 (20, 0)"),
            (dict(softmax_aux=torch.zeros(2) if rank else None), "softmax_aux differs across ranks: rank 0 None, rank 1 a float32 tensor of shape (2,)"),
            (dict(key=x[:, :2], value=x[:, :2]), "same length"),   # the same on both ranks: the local check, on both
        ]
        for changed, message in mismatched:
            args = {**dict(query=x, key=x, value=x), **changed}
            try:
                ring_attention(args.pop("query"), args.pop("key"), args.pop("value"), **args)
            except ValueError as e:
                assert message in str(e), (message, str(e))
            else:
                raise AssertionError(f"no error for {message}")
    dist.destroy_process_group()
    print("OK", rank)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ring(tmp_path, world: int, cases: list, device: str = "cpu"):
    script = tmp_path / "ring_worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    # The workers import the dualattn this test imported (a checkout may shadow the installed one).
    root = os.path.dirname(os.path.dirname(os.path.abspath(dualattn.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), port, TESTS_DIR, device, repr(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    results = [p.communicate(timeout=900) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0 and f"OK {r}" in out, f"rank {r}:\n{out[-2000:]}\n{err[-4000:]}"


def test_ring_two_ranks_gloo(tmp_path):
    _run_ring(tmp_path, 2, [
        dict(layout="zigzag", dtype="float32", causal=True, sinks=(4,)),
        dict(layout="contiguous", dtype="float32", sliding_window=(5, 3), logits_soft_cap=2.0, sinks=(4, 2)),
        dict(layout="zigzag", dtype="bfloat16", segments=True, sinks=(3,), heads=(2, 2)),
        # every rank's share is one launch (the window stays in its own shard): sinks' gradient summed
        dict(layout="contiguous", dtype="float32", sliding_window=(0, 0), sinks=(4,)),
        # a causal window just past two zigzag chunks: one launch's run pairs cut by different edges
        dict(layout="zigzag", dtype="float32", causal=True, sliding_window=(20, 0), heads=(2, 1)),
    ])


def test_ring_world_one_gloo(tmp_path):
    _run_ring(tmp_path, 1, [dict(layout="zigzag", dtype="bfloat16", causal=True, sinks=(4,), logits_soft_cap=3.0)])


@pytest.mark.slow   # four interpreted processes on the CI's two cores: minutes
def test_ring_four_ranks_gloo(tmp_path):
    _run_ring(tmp_path, 4, [
        dict(layout="zigzag", dtype="float16", causal=True, sliding_window=6, heads=(4, 1)),
        dict(layout="contiguous", dtype="float32", causal=True, segments=True),
        dict(layout="zigzag", dtype="float32", causal=True, sliding_window=(20, 0), seq_len=64, heads=(2, 1)),
    ])


def test_ring_without_process_group_is_an_error():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(x, x, x)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
def test_ring_gpu_world_one_and_nccl(tmp_path):
    cases = [dict(layout="zigzag", dtype="bfloat16", causal=True, seq_len=512, heads=(8, 2), sinks=(8,)),
             dict(layout="contiguous", dtype="float16", seq_len=256, sliding_window=(64, 16))]
    _run_ring(tmp_path, 1, cases, device="cuda")
    if _gpus() >= 2:
        _run_ring(tmp_path, 2, cases, device="cuda")
