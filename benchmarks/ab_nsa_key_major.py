"""NSA's selected branch, query-major (selected.nsa_fwd_kernel, nsa_bwd_dq_kernel) against key-major
(key_major.py: the forward and the dQ pass), per group size and sequence length, on the selections the
whole NSA chose: the median ms (triton.testing.do_bench) of the forward and of fwd + bwd both ways,
the key-major forward kernels' device times (torch.profiler), the largest differences between the two
outputs and dQ, and torch against JAX.  H100 / H200, bf16, D = 128, Hkv = 4, 16 blocks of 64.  The
measurement behind plan.key_major.

    python benchmarks/ab_nsa_key_major.py [--seqlens 8192 65536] [--groups 1 2 4 8 16] [--jax]
    python benchmarks/ab_nsa_key_major.py --sweep [--seqlens 65536] [--groups 4 8]
                        the key-major forward's kernel ms per tile variant: partial programs' (rows, warps,
                        stages) with the merge as planned, then merge programs' (rows, warps, stages)
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

import dualattn.torch_api as dt
from dualattn.bench.flash import kernel_times
from dualattn.kernels.launch import forget_plans
from dualattn.kernels.nsa import plan as nsa_plan

HEADS_KV, HEAD_DIM, BLOCK_SIZE, COUNT = 4, 128, 64, 16


def patch(*names, values=None):
    """Set nsa_plan's `names` (one: patch(name, value); several: values=) and drop the memoised plans
    (kernels/launch.plan_memo), which the old ones built."""
    if values is None:
        names, values = names[:1], names[1:]
    for name, value in zip(names, values):
        setattr(nsa_plan, name, value)
    forget_plans()


PARTIAL_VARIANTS = [(64, 4, 2), (64, 4, 3), (128, 8, 2), (32, 4, 2), (64, 8, 2)]
MERGE_VARIANTS = [(64, 4, 1), (64, 4, 2), (64, 4, 3), (128, 8, 2), (32, 4, 2), (128, 4, 2)]


def sweep(selected, shapes) -> dict:
    """{variant: device ms of its kernel} for the partial and the merge tiles (module docstring)."""
    tiles, merge = nsa_plan.key_major_tiles, (nsa_plan.MERGE_ROWS, nsa_plan.MERGE_WARPS, nsa_plan.MERGE_STAGES)
    patch("key_major", lambda shapes: True)
    result = {}

    def kernel_ms(name):
        with torch.no_grad():
            return sum(ms for n, ms in kernel_times(selected, calls=5).items() if n.startswith(name))
    for rows, warps, stages in PARTIAL_VARIANTS:
        t = tiles(shapes)
        patch("key_major_tiles", lambda s, r=rows, w=warps, st=stages: nsa_plan.NsaTiles(
            t.group_pad, max(1, r // t.group_pad), t.block_n, w, st))
        result[f"partial rows {rows} warps {warps} stages {stages}"] = kernel_ms("nsa_fwd_partial_kernel")
    patch("key_major_tiles", tiles)
    for variant in MERGE_VARIANTS:
        patch("MERGE_ROWS", "MERGE_WARPS", "MERGE_STAGES", values=variant)
        result["merge rows {} warps {} stages {}".format(*variant)] = kernel_ms("nsa_fwd_merge_kernel")
    patch("MERGE_ROWS", "MERGE_WARPS", "MERGE_STAGES", values=merge)
    return {k: round(v, 3) for k, v in result.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="*", default=[8192, 32768, 65536])
    ap.add_argument("--groups", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--jax", action="store_true", help="also the JAX front end's key-major output, against torch's")
    ap.add_argument("--sweep", action="store_true", help="key-major tile variants instead of the A/B")
    ap.add_argument("--out", help="JSON path for the rows")
    args = ap.parse_args()
    chosen = nsa_plan.key_major
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    rows = []
    for seqlen in args.seqlens:
        for group in args.groups:
            gen = torch.Generator().manual_seed(group)

            def rand(*shape):
                return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16)
            hq = HEADS_KV * group
            q, k, v = rand(1, seqlen, hq, HEAD_DIM), rand(1, seqlen, HEADS_KV, HEAD_DIM), rand(1, seqlen, HEADS_KV,
                                                                                               HEAD_DIM)
            with torch.no_grad():
                _, idx = dt.native_sparse_attention(q, k, v, torch.ones_like(q[..., 0]), block_counts=COUNT,
                                                    block_size=BLOCK_SIZE, return_block_indices=True)

            def selected():
                return dt.apply_native_sparse_attention(q, k, v, idx, COUNT, BLOCK_SIZE)
            shapes = nsa_plan.NsaShapes(1, seqlen, hq, HEADS_KV, HEAD_DIM, HEAD_DIM, COUNT, BLOCK_SIZE, "bfloat16",
                                        False)
            row = dict(seqlen=seqlen, group=group, default_key_major=chosen(shapes))
            if args.sweep:
                row["sweep"] = sweep(selected, shapes)
                patch("key_major", chosen)
                print(json.dumps(row), flush=True)
                rows.append(row)
                continue
            outs, dqs = {}, {}
            leaves = [x.requires_grad_() for x in (q, k, v)]
            dout = torch.randn_like(q)

            def fwdbwd():
                return torch.autograd.grad(selected(), leaves, dout)
            for by_key in (False, True):
                patch("key_major", lambda shapes, by_key=by_key: by_key)
                name = "key_major" if by_key else "query_major"
                dqs[name] = fwdbwd()[0]
                row[f"{name}_fwdbwd_ms"] = triton.testing.do_bench(fwdbwd, warmup=5, rep=30, return_mode="median")
                with torch.no_grad():
                    outs[name] = selected()
                    row[f"{name}_ms"] = triton.testing.do_bench(selected, warmup=10, rep=50, return_mode="median")
                    if by_key:
                        table = kernel_times(selected, calls=3)
                        row["key_major_kernels"] = {n: round(ms, 3) for n, ms in sorted(table.items(),
                                                                                        key=lambda x: -x[1])[:6]}
            patch("key_major", chosen)
            row["max_abs_diff"] = (outs["key_major"].float() - outs["query_major"].float()).abs().max().item()
            row["dq_max_abs_diff"] = (dqs["key_major"].float() - dqs["query_major"].float()).abs().max().item()
            row["speedup"] = row["query_major_ms"] / row["key_major_ms"]
            row["fwdbwd_speedup"] = row["query_major_fwdbwd_ms"] / row["key_major_fwdbwd_ms"]
            if args.jax:
                import jax

                import dualattn.jax_api as dj
                patch("key_major", lambda shapes: True)
                jq, jk, jv, jidx = (jax.dlpack.from_dlpack(t.detach().contiguous()) for t in (q, k, v, idx))
                jout = dj.apply_native_sparse_attention(jq, jk, jv, jidx, COUNT, BLOCK_SIZE, backend="triton")
                row["jax_equals_torch"] = bool(torch.equal(torch.from_dlpack(jout), outs["key_major"]))
                patch("key_major", chosen)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del q, k, v, idx, outs, dqs, leaves, dout
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
