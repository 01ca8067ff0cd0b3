"""The whole NSA forward under Nsight Compute: `run T GROUP` is the workload (bf16, D 128, Hkv 4, block 64,
16 selected blocks, window 512, the inputs of bench_nsa.py; three warm calls, then one between
cudaProfilerStart and Stop).  What bounds each kernel: its duration next to the share of the peak it drew
from DRAM, L2 and the SMs.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy -f -o prof/nsa python benchmarks/ncu_nsa.py run 65536 16
    ncu -i prof/nsa.ncu-rep --page details --csv > prof/nsa_details.csv
    python benchmarks/ncu_nsa.py summary prof/nsa_details.csv
"""
import collections
import csv
import sys

METRICS = ["Duration", "DRAM Throughput", "L2 Cache Throughput", "L1/TEX Cache Throughput", "Compute (SM) Throughput",
           "Memory Throughput", "L2 Hit Rate", "Achieved Occupancy", "Registers Per Thread", "Block Size", "Grid Size"]


def run(seqlen: int, group: int) -> None:
    import torch

    import dualattn.torch_api as dt
    gen = torch.Generator().manual_seed(0)
    heads_kv, head_dim = 4, 128
    hq = heads_kv * group

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
    q, k, v = rand(1, seqlen, hq, head_dim), rand(1, seqlen, heads_kv, head_dim), rand(1, seqlen, heads_kv, head_dim)
    gates = [torch.rand(1, seqlen, hq, generator=gen).to(device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        def call():
            return dt.native_sparse_attention(q, k, v, *gates, block_counts=16, block_size=64, window_size=512)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()


def summary(path: str) -> None:
    """One line per kernel launch: its name and METRICS, as ncu's details page gives them."""
    launches = collections.OrderedDict()
    for r in csv.DictReader(open(path)):
        key = (r["ID"], r["Kernel Name"])
        launches.setdefault(key, {})[r["Metric Name"]] = f'{r["Metric Value"]} {r["Metric Unit"]}'.strip()
    for (launch, name), metrics in launches.items():
        print(f"== {launch} {name[:60]}")
        print("   " + ", ".join(f"{m}: {metrics[m]}" for m in METRICS if m in metrics))


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(int(sys.argv[2]), int(sys.argv[3]))
    else:
        summary(sys.argv[2])
