"""The flash forward under Nsight Compute: `run CASE` is the workload (three warm calls, then one between
cudaProfilerStart and Stop), `summary DIR CASE...` reads the CSV pages ncu exported for each case and prints
its duration, warp-stall shares, executed instructions by opcode and the most-sampled instructions.

    for c in plain mask bias; do
      ncu --clock-control none --profile-from-start off --kernel-name regex:flash_fwd_gluon --launch-count 1 \\
          --set full -f -o prof/$c python benchmarks/ncu_forward.py run $c
      ncu -i prof/$c.ncu-rep --page details --csv > prof/${c}_details.csv
      ncu -i prof/$c.ncu-rep --page source --csv --print-source sass > prof/${c}_sass.csv
    done
    python benchmarks/ncu_forward.py summary prof plain mask bias

Cases: B = 2, H = 16, D = 128, bf16, S = 4096 (plain, mask (90% kept), bias, dropout 0.1) or S = 8192
(causal, window: causal with a (1023, 0) window); a `_causal` suffix makes the S = 4096 cases causal
(plain_causal, mask_causal, ...), a `_d64` suffix makes any case H = 32, D = 64.
"""
import collections
import csv
import os
import sys


def run(name: str) -> None:
    import torch

    import dualattn.torch_api as dt
    gen = torch.Generator(device="cuda").manual_seed(0)
    B, H, D, S = 2, 16, 128, 4096
    if name.endswith("_d64"):
        H, D = 32, 64
    base = name.removesuffix("_d64")
    causal = base in ("causal", "window") or base.endswith("_causal")
    S = 8192 if base in ("causal", "window") else S
    base = base.removesuffix("_causal")
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    kw = {"window": dict(sliding_window=(1023, 0)), "dropout": dict(dropout_prob=0.1, dropout_seed=1),
          "mask": dict(attention_mask=torch.rand(B, H, S, S, device="cuda", generator=gen) < 0.9),
          "bias": dict(bias=torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16, generator=gen))}.get(base, {})
    with torch.no_grad():
        for _ in range(3):
            dt.flash_attention(q, k, v, causal=causal, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        dt.flash_attention(q, k, v, causal=causal, **kw)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def _sass_rows(path: str):
    rows = list(csv.reader(open(path)))
    header = rows[1]
    return header, [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _opcode(source: str) -> str:
    words = source.split()
    if not words:
        return "?"
    return (words[1] if words[0].startswith("@") else words[0]).split(".")[0]


def summary(folder: str, cases) -> None:
    for case in cases:
        details = {r["Metric Name"]: f'{r["Metric Value"]} {r["Metric Unit"]}'
                   for r in csv.DictReader(open(os.path.join(folder, f"{case}_details.csv")))}
        header, rows = _sass_rows(os.path.join(folder, f"{case}_sass.csv"))
        stalls = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
        samples = sum(int(r["Warp Stall Sampling (All Samples)"] or 0) for r in rows)
        by_stall = collections.Counter({s[6:]: sum(int(r[s] or 0) for r in rows) for s in stalls})
        executed = collections.Counter()
        for r in rows:
            executed[_opcode(r["Source"])] += int(r["Instructions Executed"] or 0)
        print(f"== {case}: duration {details.get('Duration')}, registers {details.get('Registers Per Thread')}, "
              f"{sum(executed.values()) / 1e6:.1f}M warp instructions, {samples} samples")
        print("   stalls: " + ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in by_stall.most_common(8)))
        print("   executed: " + ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in executed.most_common(14)))
        top = sorted(rows, key=lambda r: -int(r["Warp Stall Sampling (All Samples)"] or 0))[:12]
        for r in top:
            reason = max(stalls, key=lambda s: int(r[s] or 0))[6:]
            print(f"   {int(r['Warp Stall Sampling (All Samples)']):7d} samples ({reason:12s}) "
                  f"x{r['Instructions Executed']:>8s}  {r['Source'].strip()[:70]}")


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2])
    else:
        summary(sys.argv[2], sys.argv[3:])
