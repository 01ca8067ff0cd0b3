"""Every flash kernel variant once, small, forward and backward: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python benchmarks/sanitize.py --only specialised

Each case is a shape and option set that the launch plans send to one kernel family (portable with
each option, edges in the loop, TMA, warp-specialised grid / persistent / split band / band in the
loop, the Gluon forward, the one-pass backward, varlen with tables that run past the tensors,
block-sparse).  The script prints which launches ran (kernel and its variant flags), so the log shows
that every variant was covered, and exits 1 if an output is not finite.  `--only specialised` keeps the
warp-specialised and Gluon cases (racecheck instruments shared memory: slow).
"""
from __future__ import annotations

import argparse
import sys

import torch

import dualattn.torch_api as dt
from dualattn import SparseMask, masks
from dualattn.torch_api import _launch

# (name, specialised?, shapes and options) -- sizes chosen so plan.py picks the named variant on an H100.
CASES = [
    ("portable fp32 options", False, dict(b=2, s=200, h=4, hkv=2, d=80, dtype=torch.float32,
                                          opts=dict(causal=True, logits_soft_cap=20.0, softmax_aux="head"))),
    ("portable bias+mask+segments", False, dict(b=2, s=192, h=2, hkv=1, d=64, opts=dict(bias=True, mask=True,
                                                                                        segments=True))),
    ("portable dropout window", False, dict(b=1, s=300, h=2, hkv=2, d=128, opts=dict(
        sliding_window=(64, 16), dropout_prob=0.2, dropout_seed=7))),
    ("portable d256 sq!=sk", False, dict(b=1, s=130, sk=257, h=2, hkv=1, d=256, opts=dict(causal=True))),
    ("edges in loop (causal, short)", False, dict(b=1, s=1024, h=1, hkv=1, d=64, opts=dict(causal=True))),
    ("varlen as documents (one table), a table past the end", True, dict(
        varlen=[0, 100, 5000, 260], total=300, h=2, hkv=1, d=64, one_table=True, opts=dict(causal=True))),
    ("one-pass backward, documents", True, dict(b=1, s=4096, h=2, hkv=1, d=128, opts=dict(causal=True,
                                                                                         segments=500))),
    ("varlen with a table past the end", False, dict(varlen=[0, 100, 5000, 260], total=300, h=2, hkv=1, d=64,
                                                     opts=dict(causal=True))),
    ("block-sparse", False, dict(b=1, s=512, h=2, hkv=2, d=64, sparse=True)),
    ("warp-specialised grid (sinks)", True, dict(b=1, s=2048, h=2, hkv=2, d=128, opts=dict(softmax_aux="head"))),
    ("persistent + band in loop", True, dict(b=1, s=2048, h=16, hkv=16, d=128, opts=dict(causal=True,
                                                                                          softmax_aux="head"))),
    ("split band", True, dict(b=1, s=8192, h=1, hkv=1, d=128, opts=dict(causal=True, softmax_aux="head"))),
    ("gluon forward + two-pass ws backward", True, dict(b=1, s=2048, h=2, hkv=2, d=128, opts=dict(causal=True))),
    ("gluon forward + one-pass backward", True, dict(b=1, s=4096, h=2, hkv=1, d=128, opts=dict(causal=True))),
    ("one-pass persistent d64", True, dict(b=2, s=4096, h=4, hkv=4, d=64, opts=dict())),
    ("gluon forward + one-pass backward, window and sinks", True, dict(b=1, s=4096, h=2, hkv=1, d=128, opts=dict(
        causal=True, sliding_window=(700, 0), softmax_aux="head"))),
    ("gluon forward soft cap, causal window", True, dict(b=1, s=2048, h=2, hkv=1, d=128, opts=dict(
        sliding_window=(300, 0), logits_soft_cap=20.0))),
    ("one-pass backward soft cap, GQA", True, dict(b=1, s=4096, h=4, hkv=2, d=128, opts=dict(
        causal=True, logits_soft_cap=30.0))),
    ("gluon forward sinks, not causal", True, dict(b=1, s=2048, h=2, hkv=2, d=128, opts=dict(softmax_aux="head"))),
    ("gluon forward documents (segment ranges narrow the key tiles)", True, dict(b=1, s=2048, h=2, hkv=1, d=128,
                                                                                 opts=dict(causal=True, segments=500))),
    ("gluon forward bias (copied a tile ahead), ragged queries", True, dict(b=2, s=1000, sk=1104, h=2, hkv=1, d=128,
                                                                          opts=dict(causal=True, bias=True))),
    ("gluon forward bias and mask, d64", True, dict(b=2, s=1000, sk=1104, h=2, hkv=2, d=64, opts=dict(
        bias=True, mask=True, logits_soft_cap=20.0))),
    ("one-pass backward, bias without grad, ragged queries", True, dict(b=1, s=4000, sk=4096, h=2, hkv=1, d=128,
                                                                      opts=dict(causal=True, bias=True))),
    ("one-pass backward, bias and mask, d64", True, dict(b=1, s=4096, h=2, hkv=2, d=64, opts=dict(
        bias=True, mask=True, sliding_window=(500, 0)))),
    ("portable documents (single-id runs skip the compare)", False, dict(b=1, s=2048, h=2, hkv=2, d=80, opts=dict(
        causal=True, segments=500))),
    ("gluon block-sparse, 128 blocks, GQA (persistent one-pass)", True, dict(b=1, s=4096, h=4, hkv=2, d=128,
                                                                              sparse=True, block=128)),
    ("gluon block-sparse, 128 blocks, ragged (a program per key tile)", True, dict(b=1, s=4160, h=2, hkv=2, d=64,
                                                                                    sparse=True, block=128)),
    ("portable narrow q/k tile, fp32 block-sparse", False, dict(b=2, s=100, sk=7, h=4, hkv=2, d=16, dv=168,
                                                                 dtype=torch.float32, sparse=True)),
]


def _inputs(case, device):
    c = dict(case)
    dtype = c.get("dtype", torch.bfloat16)
    opts = dict(c.get("opts", {}))
    h, hkv, d = c["h"], c["hkv"], c["d"]
    if "varlen" in c:
        q = torch.randn(c["total"], h, d, device=device, dtype=dtype)
        k, v = (torch.randn(c["total"], hkv, d, device=device, dtype=dtype) for _ in range(2))
        return (q, k, v), opts, torch.tensor(c["varlen"], dtype=torch.int32, device=device)
    b, s = c["b"], c["s"]
    sk = c.get("sk", s)
    q = torch.randn(b, s, h, d, device=device, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=device, dtype=dtype)
    v = torch.randn(b, sk, hkv, c.get("dv", d), device=device, dtype=dtype)
    if opts.pop("bias", False):
        opts["bias"] = torch.randn(b, 1, s, sk, device=device, dtype=dtype)
    if opts.pop("mask", False):
        opts["attention_mask"] = torch.rand(1, h, s, sk, device=device) < 0.8
    segments = opts.pop("segments", False)
    if segments:   # documents of `segments` tokens (True: 50)
        opts["q_segment_ids"] = (torch.arange(s, device=device) // (50 if segments is True else segments)).expand(b, s)
    if opts.get("softmax_aux") == "head":
        opts["softmax_aux"] = torch.randn(h, device=device)
    return (q, k, v), opts, None


LAUNCHED: list = []   # "kernel {flags}" of every launch of the running case (main's spy fills it)


def run_case(name, case, device, repeat: int = 1) -> bool:
    """Whether out and the gradients are finite; with repeat > 1, also whether every rerun on the same
    inputs gives them bitwise equal (dQ only where the two-pass backward ran: the one-pass dQ is a sum of
    atomics in varying order)."""
    torch.manual_seed(0)
    first = _run_once(case, device)
    finite = all(bool(torch.isfinite(x).all()) for x in first.values())
    if not finite:
        print("      non-finite: " + ", ".join(n for n, x in first.items() if not bool(torch.isfinite(x).all())))
    for _ in range(repeat - 1):
        torch.manual_seed(0)
        again = _run_once(case, device)
        differ = [n for n, x in again.items() if not torch.equal(x, first[n]) and not (
            n == "dq" and any("one_pass" in line for line in LAUNCHED))]
        if differ:
            print("      rerun differs: " + ", ".join(differ))
            return False
    return finite


def _run_once(case, device) -> dict:
    (q, k, v), opts, cu = _inputs(case, device)
    for t in (q, k, v):
        t.requires_grad_(True)
    if cu is not None:
        # Traced tables are checked by no host: compile so that the kernels clamp them themselves.
        # Two tables (the same values) keep the varlen kernels; one table may run as segment ids
        # (plan.varlen_as_documents).
        other = (lambda cu: cu) if case.get("one_table") else (lambda cu: cu + 0)
        fn = torch.compile(lambda q, k, v, cu: dt.flash_attn_varlen_func(q, k, v, cu, other(cu), 256, 256, **opts),
                           fullgraph=True)
        out = fn(q, k, v, cu)
    elif case.get("sparse"):
        block = case.get("block") or (64 if q.shape[1] > 100 else 32)
        layout = SparseMask.from_block_map((masks.causal() & masks.local(128))(1, 1, q.shape[1], k.shape[1], block,
                                                                               block), block, block)
        out = dt.blocksparse_attention(q, k, v, layout=layout, causal=True)
    else:
        out = dt.flash_attention(q, k, v, **opts)
    out.float().square().sum().backward()
    if q.is_cuda:
        torch.cuda.synchronize()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("all", "specialised", "portable"), default="all")
    parser.add_argument("--name", default="", help="only the cases whose name contains this")
    parser.add_argument("--device", default="cuda", help="cpu runs the cases through the interpreter (a dry run)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each case this many times and check the reruns bitwise equal (races)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    launched = LAUNCHED
    real_run = _launch.run

    def spy(launch, *a, **kw):
        flags = {n: v for n, v in launch.constexprs if n in (
            "WARP_SPECIALIZE", "PERSISTENT", "SPLIT_BAND", "EDGES_IN_LOOP", "TMA", "BLOCK_SPARSE", "IS_VARLEN",
            "CAUSAL", "WINDOW", "SEGMENT_SKIP", "HAS_DROPOUT", "HAS_BIAS", "HAS_MASK", "HAS_SEGMENTS", "SOFTCAP", "NUM_SINKS") and v}
        launched.append(f"{launch.kernel} {flags}")
        return real_run(launch, *a, **kw)

    _launch.run = spy
    bad = 0
    for name, specialised, case in CASES:
        if args.only == "specialised" and not specialised or args.only == "portable" and specialised:
            continue
        if args.name not in name:
            continue
        del launched[:]
        finite = run_case(name, case, args.device, args.repeat)
        bad += not finite
        print(f"{'ok ' if finite else 'NON-FINITE or UNSTABLE'} {name}")
        for line in dict.fromkeys(launched):
            print(f"      {line}")
    print(f"{bad} case(s) with non-finite outputs" + (f" or reruns that differ ({args.repeat} runs each)"
                                                        if args.repeat > 1 else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
