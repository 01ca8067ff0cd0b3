"""Why do the torch and jax-triton launches of one kernel differ on the GPU?

python benchmarks/diag_jax_triton.py --out DIR
python benchmarks/diag_jax_triton.py --out DIR --case nsa     NSA's selected-branch dK/dV kernel

Runs the causal forward (B=2, S=4096, H=8, D=128, bf16) through both front ends on the
same bits (torch -> jax by DLPack), counts differing output bits, then compares what each
side handed to the GPU (with --case nsa: the selected branch's forward and backward, T=16k, group 16,
and the dK/dV kernel's code): Triton's cache (torch) against JAX_TRITON_DUMP_DIR (jax-triton),
PTX first, then SASS of the jax PTX assembled by Triton's own ptxas and by the ptxas that
jaxlib finds.  Writes diag.json and the diffs under DIR.
"""
import argparse
import difflib
import glob
import json
import os
import shutil
import subprocess
import sys


def _sha(path):
    import hashlib
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _ptxas_candidates():
    import triton
    found = {"triton": os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")}
    for root in sys.path:
        for p in glob.glob(os.path.join(root, "nvidia", "cuda_nvcc", "bin", "ptxas")):
            found.setdefault("pip_cuda_nvcc", p)
    if shutil.which("ptxas"):
        found["PATH"] = shutil.which("ptxas")
    for p in glob.glob("/usr/local/cuda*/bin/ptxas"):
        found.setdefault("usr_local_" + p.split("/")[3], p)
    return found


def _version(exe):
    try:
        return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    except Exception as exc:  # a broken candidate is a finding, not a failure
        return f"error: {exc}"


def _sass(ptxas, ptx, out_dir, tag):
    import triton
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cubin = os.path.join(out_dir, f"{tag}.cubin")
    r = subprocess.run([ptxas, "-lineinfo", "-v", "--gpu-name=sm_90a", ptx, "-o", cubin], capture_output=True,
                       text=True)
    if r.returncode:
        return {"error": r.stderr[-400:]}
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
    lines = [ln.split(";")[0].split("*/")[-1].strip() for ln in sass.splitlines() if "/*" in ln and ";" in ln]
    with open(os.path.join(out_dir, f"{tag}.sass"), "w") as f:
        f.write("\n".join(lines))
    return {"sha": _sha(cubin), "n_instr": len(lines), "regs": r.stderr.split("Used")[-1][:60].strip(),
            "ffma": sum("FFMA" in x for x in lines), "fmul": sum("FMUL" in x for x in lines)}


def _flash_case(report):
    import torch
    import triton.testing
    import jax
    import dualattn.torch_api as dt
    import dualattn.jax_api as dj
    g = torch.Generator(device="cuda").manual_seed(0)
    b, s, h, d = 2, 4096, 8, 128
    tq, tk, tv = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    jq, jk, jv = (jax.dlpack.from_dlpack(t) for t in (tq, tk, tv))
    for causal in (True, False):
        to = dt.flash_attention(tq, tk, tv, causal=causal)
        f = jax.jit(lambda a, b_, c: dj.flash_attention(a, b_, c, causal=causal, backend="triton"))
        jo = f(jq, jk, jv).block_until_ready()
        jo_t = torch.from_dlpack(jo)
        diff = (jo_t.view(torch.int16) != to.view(torch.int16))
        ms_t = triton.testing.do_bench(lambda: dt.flash_attention(tq, tk, tv, causal=causal), return_mode="median")
        ms_j = triton.testing.do_bench(lambda: f(jq, jk, jv).block_until_ready(), return_mode="median")
        report[f"causal={causal}"] = {"differing_elements": int(diff.sum()), "of": diff.numel(),
                                      "max_abs": float((jo_t.float() - to.float()).abs().max()),
                                      "ms_torch": ms_t, "ms_jax": ms_j, "jax_over_torch_speed": ms_t / ms_j}


def _nsa_case(report, seqlen=16384, group=16, heads_kv=4, head_dim=128, count=16, block_size=64):
    import torch
    import triton.testing
    import jax
    import dualattn.torch_api as dt
    import dualattn.jax_api as dj
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    q = rand(1, seqlen, heads_kv * group, head_dim)
    k, v = rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv, head_dim)
    dout = torch.randn(1, seqlen, heads_kv * group, head_dim, generator=gen).to("cuda", torch.bfloat16)
    idx = torch.randint(0, seqlen // block_size, (1, seqlen, heads_kv, count), generator=gen).to("cuda", torch.int32)
    jq, jk, jv, jd, jidx = (jax.dlpack.from_dlpack(t.detach().contiguous()) for t in (q, k, v, dout, idx))

    def jax_selected(a, b, c):
        return dj.apply_native_sparse_attention(a, b, c, jidx, count, block_size, backend="triton")
    jbwd = jax.jit(lambda d, *a: jax.vjp(jax_selected, *a)[1](d))
    tbwd = lambda: torch.autograd.grad(dt.apply_native_sparse_attention(q, k, v, idx, count, block_size),  # noqa: E731
                                       (q, k, v), dout)
    grads_t, grads_j = tbwd(), jax.block_until_ready(jbwd(jd, jq, jk, jv))
    for name, gt, gj in zip(("dq", "dk", "dv"), grads_t, grads_j):
        gj = torch.from_dlpack(gj)
        report[name] = {"differing_elements": int((gj.view(torch.int16) != gt.view(torch.int16)).sum()),
                        "max_abs": float((gj.float() - gt.float()).abs().max())}
    report["ms_torch"] = triton.testing.do_bench(tbwd, return_mode="median")
    report["ms_jax"] = triton.testing.do_bench(lambda: jax.block_until_ready(jbwd(jd, jq, jk, jv)),
                                               return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", choices=("flash", "nsa"), default="flash")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = os.path.join(out, "torch_cache")
    os.environ["JAX_TRITON_DUMP_DIR"] = os.path.join(out, "jt_dump")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import torch

    report = {"ptxas": {k: {"path": p, "version": _version(p)} for k, p in _ptxas_candidates().items()}}
    if args.case == "flash":
        _flash_case(report)
        kernel = "flash_fwd_kernel"
    else:
        _nsa_case(report)
        kernel = "nsa_bwd_dkv_kernel"
    torch.cuda.synchronize()

    torch_ptx = sorted(glob.glob(os.path.join(out, "torch_cache", "*", f"{kernel}.ptx")))
    jax_ptx = sorted(glob.glob(os.path.join(out, "jt_dump", "*", f"{kernel}.ptx")))
    report["torch_ptx"], report["jax_ptx"] = torch_ptx, jax_ptx
    pairs = []
    for tp in torch_ptx:
        for jp in jax_ptx:
            a, b_ = open(tp).read().splitlines(), open(jp).read().splitlines()
            delta = [ln for ln in difflib.unified_diff(a, b_, lineterm="", n=0) if ln[:1] in "+-"]
            pairs.append({"torch": tp, "jax": jp, "diff_lines": len(delta)})
            with open(os.path.join(out, f"ptx_diff_{len(pairs)}.txt"), "w") as fh:
                fh.write("\n".join(delta[:400]))
    report["ptx_pairs"] = pairs
    sass = {}
    for i, tp in enumerate(torch_ptx):
        cub = tp[:-4] + ".cubin"
        sass[f"torch_cache_{i}"] = {"sha": _sha(cub)} if os.path.exists(cub) else {}
        for tag, exe in _ptxas_candidates().items():
            sass[f"torch_ptx_{i}_{tag}"] = _sass(exe, tp, out, f"torch{i}_{tag}")
    for i, jp in enumerate(jax_ptx):
        for tag, exe in _ptxas_candidates().items():
            sass[f"jax_ptx_{i}_{tag}"] = _sass(exe, jp, out, f"jax{i}_{tag}")
    report["sass"] = sass
    for cfg in glob.glob(os.path.join(out, "jt_dump", "*", "config")):
        report.setdefault("jt_configs", []).append(open(cfg).read()[-3000:])
    with open(os.path.join(out, "diag.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "jt_configs"}, indent=1))


if __name__ == "__main__":
    main()
