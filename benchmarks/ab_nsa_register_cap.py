"""NSA's dK / dV pass with and without its register cap (plan.DKV_MAX_REGISTERS), in both front ends:
the device time of nsa_bwd_dkv_kernel and of the whole selected-branch fwd+bwd (torch.profiler), bf16,
D = 128, Hkv = 4, 16 blocks of 64, per group size.  The measurement behind the cap.

    python benchmarks/ab_nsa_register_cap.py [--seqlen 32768] [--groups 1 2 4 8 16]
    python benchmarks/ab_nsa_register_cap.py --registers    no GPU: (registers, spill bytes) that the installed
                                                            Triton's ptxas reports for sm_90a, D = 64 and 128, under
                                                            torch's and jax-triton's specialisation, uncapped and capped
"""
from __future__ import annotations

import argparse

from dualattn.kernels.launch import forget_plans
from dualattn.kernels.nsa import plan as nsa_plan

DKV = "nsa_bwd_dkv_kernel"


def registers(groups):
    import dataclasses

    import triton

    from dualattn.kernels import compile_check
    print(f"Triton {triton.__version__}: (registers, spill-store bytes), sm_90a, bf16, Hkv 4, 16 blocks of 64")
    print("D group warps | torch uncapped, jax uncapped | torch capped, jax capped")
    for d in (64, 128):
        for group in groups:
            shapes = nsa_plan.NsaShapes(batch=1, seqlen=65536, heads_q=4 * group, heads_kv=4, head_dim=d,
                                        head_dim_v=d, num_slots=16, block_size=64, dtype="bfloat16",
                                        per_token_counts=False, varlen=False)
            launch = nsa_plan.plan_backward(shapes, d ** -0.5, 16).dkdv.chain[0]
            dtypes = {n: "int32" if n in ("entry_order", "bucket_starts", "chunk_buckets", "chunk_starts") else
                      "float32" if n in ("lse", "delta") else "bfloat16" for n in launch.inputs if n != "cu_seqlens"}
            row = []
            for cap in (None, nsa_plan.DKV_MAX_REGISTERS):
                for spec in ("torch", "jax"):
                    compiled = compile_check.compile_launch(dataclasses.replace(launch, max_registers=cap), dtypes,
                                                            arch=90, specialize=spec)
                    row.append(compile_check.ptxas_usage(compiled, 90))
            print(f"{d:3d} {group:5d} {launch.num_warps:5d} | {row[0]}, {row[1]} | {row[2]}, {row[3]}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--groups", type=int, nargs="*", default=[1, 2, 4, 8, 16])
    ap.add_argument("--registers", action="store_true")
    args = ap.parse_args()
    if args.registers:
        return registers(args.groups)
    import jax
    import torch

    import dualattn.jax_api as dj
    import dualattn.torch_api as dt
    from dualattn.bench.flash import kernel_times
    heads_kv, head_dim, block_size, count = 4, 128, 64, 16
    cap = nsa_plan.DKV_MAX_REGISTERS
    print(f"torch {torch.__version__}, jax {jax.__version__}, {torch.cuda.get_device_name()}, T = {args.seqlen}")
    print(f"{'group':>5s} {'cap':>5s} {'front':>6s} {'dK/dV ms':>9s} {'fwd+bwd ms':>11s}")
    for group in args.groups:
        gen = torch.Generator().manual_seed(group)

        def rand(*shape):
            return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
        T, hq = args.seqlen, heads_kv * group
        q, k, v = rand(1, T, hq, head_dim), rand(1, T, heads_kv, head_dim), rand(1, T, heads_kv, head_dim)
        dout = torch.randn(1, T, hq, head_dim, generator=gen).to("cuda", torch.bfloat16)
        with torch.no_grad():
            _, idx = dt.native_sparse_attention(q, k, v, torch.ones_like(q[..., 0]), block_counts=count,
                                                block_size=block_size, return_block_indices=True)
        jq, jk, jv, jd, jidx = (jax.dlpack.from_dlpack(t.detach().contiguous()) for t in (q, k, v, dout, idx))
        grads = {}
        for capped in (True, False):
            nsa_plan.DKV_MAX_REGISTERS = cap if capped else None
            forget_plans()   # the memoised plans were built with the old one

            def jax_selected(q_, k_, v_):
                return dj.apply_native_sparse_attention(q_, k_, v_, jidx, count, block_size, backend="triton")
            jax_step = jax.jit(lambda d, *a: jax.vjp(jax_selected, *a)[1](d))   # traced anew per setting
            fronts = {
                "torch": lambda: torch.autograd.grad(dt.apply_native_sparse_attention(q, k, v, idx, count, block_size),
                                                     (q, k, v), dout),
                "jax": lambda: jax.block_until_ready(jax_step(jd, jq, jk, jv)),
            }
            for front, fn in fronts.items():
                for _ in range(2):   # the second round is the one printed: compiled and warm
                    table = kernel_times(fn, calls=5)
                dkv = sum(ms for name, ms in table.items() if name.startswith(DKV) and "reduce" not in name)
                print(f"{group:5d} {str(cap if capped else None):>5s} {front:>6s} {dkv:9.3f} "
                      f"{sum(table.values()):11.3f}", flush=True)
                out = fn()
                grads[(capped, front)] = [torch.as_tensor(x) if front == "torch" else torch.from_dlpack(x)
                                          for x in out]
        same = all(torch.equal(a, b) for a, b in zip(grads[(True, "torch")], grads[(False, "torch")]))
        jax_same = all(torch.equal(a, b) for a, b in zip(grads[(True, "torch")], grads[(True, "jax")]))
        print(f"group {group}: capped == uncapped gradients (torch) {same}; torch == jax (capped) {jax_same}")
    nsa_plan.DKV_MAX_REGISTERS = cap
    forget_plans()   # the memoised plans were built with the old one
    from dualattn.jax_api import _compile
    capped = sorted({key[0].__name__ for key in _compile._CACHE if ("maxnreg", cap) in key[-1]})
    print(f"kernels JAX compiled with maxnreg={cap}: {capped}")


if __name__ == "__main__":
    main()
