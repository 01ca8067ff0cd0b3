"""Write docs/performance.md from the results kept in benchmarks/results/.

    python benchmarks/performance.py            # rewrite docs/performance.md
    python benchmarks/performance.py --check    # exit 1 if docs/performance.md is not what the JSON gives

Every table in docs/performance.md comes from one JSON file listed in `SECTIONS`, beside the command that
measured it; nothing in that page is typed by hand.  To add a measurement: run its command with `--out
benchmarks/results/<date>_<device>_<what>.json`, add a section here, and rerun this script.  Runs on any
machine (no GPU, no torch): it only reads JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
PAGE = os.path.join(ROOT, "docs", "performance.md")


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _num(x, fmt="{:.0f}") -> str:
    return "–" if x is None else fmt.format(x)


def _meta_line(data: dict) -> str:
    meta = data.get("meta") or data
    versions = meta.get("versions") or {k: meta[k] for k in ("torch", "triton") if k in meta}
    ver = ", ".join(f"{k} {v}" for k, v in versions.items() if v and k not in ("dualattn", "python"))
    return f"{meta.get('device', '?')}, {str(meta.get('date', '?'))[:10]}" + (f"; {ver}" if ver else "")


def flash_sweep(data: dict) -> str:
    """TFLOP/s per system (rows: S, causal, mode) with the ratio to cuDNN."""
    rows = [r for r in data["measurements"] if r["status"] == "ok"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    keys = list(dict.fromkeys((r["S"], r["causal"], r["mode"]) for r in rows))
    cell = {(r["S"], r["causal"], r["mode"], r["system"]): r for r in rows}
    out = ["| S | causal | mode | " + " | ".join(systems) + " |", "|---|---|---|" + "---|" * len(systems)]
    for s, causal, mode in keys:
        cells = []
        for system in systems:
            r = cell.get((s, causal, mode, system))
            ratio = r and r.get("ratio_to_cudnn")
            cells.append("–" if r is None else f"{r['tflops']:.0f}" + (f" ({ratio:.2f})" if ratio and system != "sdpa-cudnn" else ""))
        out.append(f"| {s} | {'yes' if causal else 'no'} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def flash_memory(data: dict) -> str:
    out = ["| S | causal | peak / ideal bytes |", "|---|---|---|"]
    for r in data["memory"]:
        if r["system"] == "dualattn-torch" and r["status"] == "ok":
            out.append(f"| {r['S']} | {'yes' if r['causal'] else 'no'} | {r['ratio']:.2f} |")
    return "\n".join(out)


def options(data: dict) -> str:
    """Effective TFLOP/s fwd / fwd+bwd of each case, its ratio to the option-free shape, the best peer."""
    rows = data["rows"]
    out = ["| case | options | dualattn torch | ÷ option-free | JAX | best peer |", "|---|---|---|---|---|---|"]

    def pair(sel, field="tflops", fmt="{:.0f}"):
        vals = [next((r.get(field) for r in sel if r["mode"] == m), None) for m in ("fwd", "fwdbwd")]
        return " / ".join(_num(v, fmt) for v in vals)

    for case in dict.fromkeys(r["case"] for r in rows):
        sel = [r for r in rows if r["case"] == case]
        ours = [r for r in sel if r["system"] == "dualattn-torch"]
        jax = [r for r in sel if r["system"] == "dualattn-jax-triton"]
        peers = [r for r in sel if not r["system"].startswith("dualattn") and r["status"] == "ok" and r.get("tflops")]
        best = max(peers, key=lambda r: r["tflops"], default=None)
        best_cell = f"{best['system']} {pair([r for r in peers if r['system'] == best['system']])}" if best else "–"
        out.append(f"| {case} | {sel[0]['options']} | {pair(ours)} | {pair(ours, 'ratio_to_base', '{:.2f}')} | "
                   f"{pair(jax) if jax else '–'} | {best_cell} |")
    return "\n".join(out)


def blocksparse(data: dict) -> str:
    rows = data["results"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    cell = {(r["case"], r["system"], r["mode"]): r.get("effective_tflops") for r in rows}
    out = ["| layout | " + " | ".join(systems) + " |", "|---|" + "---|" * len(systems)]
    for case in cases:
        out.append(f"| {case} | " + " | ".join(
            f"{_num(cell.get((case, s, 'fwd')))} / {_num(cell.get((case, s, 'fwdbwd')))}" for s in systems) + " |")
    return "\n".join(out)


def nsa(data: dict) -> str:
    rows = data["results"]
    systems = list(dict.fromkeys(r["system"] for r in rows))
    keys = list(dict.fromkeys((r["seqlen"], r["group"]) for r in rows))
    cell = {(r["seqlen"], r["group"], r["system"], r["mode"]): r.get("ms") for r in rows}
    out = ["| T | group | " + " | ".join(systems) + " |", "|---|---|" + "---|" * len(systems)]
    for t, g in keys:
        out.append(f"| {t} | {g} | " + " | ".join(
            f"{_num(cell.get((t, g, s, 'fwd')), '{:.2f}')} / {_num(cell.get((t, g, s, 'fwdbwd')), '{:.2f}')}"
            for s in systems) + " |")
    return "\n".join(out)


def ring(data: dict) -> str:
    out = ["| world | tokens per GPU | case | mode | ring ms | flash ms (whole sequence, one GPU) | efficiency |",
           "|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['world']} | {r['tokens_per_gpu']} | {r['case']} | {r['mode']} | {_num(r.get('ring_ms'), '{:.2f}')} | "
                   f"{_num(r.get('flash_ms'), '{:.2f}')} | {_num(r.get('efficiency'), '{:.2f}')} |")
    return "\n".join(out)


def ring_steps(data: dict) -> str:
    out = ["| world | case | mode | steps' compute ms | flash ms | efficiency ceiling |", "|---|---|---|---|---|---|"]
    for r in data["rows"]:
        out.append(f"| {r['world']} | {r['case']} | {r['mode']} | {_num(r.get('ring_compute_ms'), '{:.2f}')} | "
                   f"{_num(r.get('flash_ms'), '{:.2f}')} | {_num(r.get('efficiency_ceiling'), '{:.2f}')} |")
    return "\n".join(out)


@dataclasses.dataclass(frozen=True)
class Section:
    title: str
    file: str
    render: Callable[[dict], str]
    command: str = ""     # where the JSON does not record its own argv
    about: str = ""
    plot: str = ""


SECTIONS: List[Section] = [
    Section("Dense attention, D = 128 (TFLOP/s, ratio to cuDNN)", "2026-11-24_h100_sweep20_d128.json", flash_sweep,
            about="16k tokens per batch (B = 16384 / S), H = 16, bf16; FLOPs 4·B·H·S²·D, halved when causal; "
                  "fwd+bwd counts 3.5× the forward.", plot="2026-11-24_h100_sweep20_d128.png"),
    Section("Dense attention, D = 64", "2026-11-24_h100_sweep20_d64.json", flash_sweep,
            about="H = 32, otherwise as above.", plot="2026-11-24_h100_sweep20_d64.png"),
    Section("Peak memory of forward + backward", "2026-11-24_h100_memory20.json", flash_memory,
            about="B = 1, H = 16, D = 128; the ideal counts q, k, v, o, dO, dq, dk, dv and the lse."),
    Section("Options: sinks and windows", "2026-11-26_h200_options_gluon_sinks_window.json", options,
            about="Effective TFLOP/s over allowed pairs, fwd / fwd+bwd; ÷ option-free is the ratio to the same "
                  "shape without the option in the same run."),
    Section("Options: GPT-OSS short window with sinks", "2026-11-27_h200_options_short_windows_backward.json", options),
    Section("Options: soft cap", "2026-11-28_h200_options_softcap_docs.json", options),
    Section("Options: dropout", "2026-11-27_h200_options_dropout_gluon.json", options),
    Section("Options: packed documents and varlen", "2026-11-28_h200_options_docs.json", options),
    Section("Options: packed documents, torch alone in the process", "2026-11-28_h200_options_docs_torch_only.json",
            options),
    Section("Options: padded head dims (96, 192)", "2026-11-27_h200_options_padded_one_pass.json", options),
    Section("Options: D = 256", "2026-11-27_h200_options_d256_one_pass.json", options),
    Section("Options: bias and mask", "2026-11-28_h200_options_scored_d128_d64.json", options),
    Section("Options: bias and mask at D = 96–256, two score tiles in flight", "2026-11-28_h200_options_scored_two_tiles.json",
            options),
    Section("Options: masks, the load warp first", "2026-11-28_h200_options_mask_load_first.json", options),
    Section("Block-sparse layouts (effective TFLOP/s fwd / fwd+bwd)", "2026-11-28_h200_blocksparse.json", blocksparse,
            "python benchmarks/bench_blocksparse.py --out FILE",
            "B = 1, H = 16, S = 16384, D = 128, bf16, 128 × 128 blocks."),
    Section("Native sparse attention, group 16 (ms fwd / fwd+bwd)", "2026-11-29_h200_nsa_group16_pool_kernel.json", nsa,
            "python benchmarks/bench_nsa.py --seqlens 8192 65536 --groups 16 --jax --out FILE",
            "bf16, D 128, Hkv 4, block 64, 16 blocks, window 512."),
    Section("Native sparse attention, group 4", "2026-11-29_h200_nsa_group4_pool_kernel.json", nsa,
            "python benchmarks/bench_nsa.py --seqlens 8192 65536 --groups 4 --jax --out FILE"),
    Section("Native sparse attention, 16k and 32k", "2026-11-29_h200_nsa_16k_32k.json", nsa,
            "python benchmarks/bench_nsa.py --seqlens 16384 32768 --groups 16 4 --jax --out FILE"),
    Section("Ring attention, torch, 2 GPUs", "2026-11-26_ring_torch_w2_cuda.json", ring,
            "torchrun --nproc-per-node 2 benchmarks/bench_ring.py --tokens 8192 16384 --out FILE",
            "bf16, D 128, GQA 32 / 8; efficiency = attended pairs per second per GPU ÷ single-GPU flash_attention."),
    Section("Ring attention, torch, 4 GPUs", "2026-11-26_ring_torch_w4_cuda.json", ring,
            "torchrun --nproc-per-node 4 benchmarks/bench_ring.py --tokens 8192 16384 32768 --out FILE",
            plot="2026-11-26_ring_efficiency.png"),
    Section("Ring attention, JAX, 2 GPUs", "2026-11-26_ring_jax_w2_cuda.json", ring,
            "python benchmarks/bench_ring.py --framework jax --tokens 8192 16384 --out FILE"),
    Section("Ring attention, JAX, 4 GPUs", "2026-11-26_ring_jax_w4_cuda.json", ring,
            "python benchmarks/bench_ring.py --framework jax --tokens 8192 16384 32768 --out FILE"),
    Section("Ring attention at world size 1, torch", "2026-11-26_ring_torch_w1_cuda.json", ring,
            "python benchmarks/bench_ring.py --framework torch --tokens 8192 16384 --out FILE"),
    Section("Ring attention at world size 1, JAX", "2026-11-26_ring_jax_w1_cuda.json", ring,
            "python benchmarks/bench_ring.py --framework jax --tokens 8192 16384 --out FILE"),
    Section("Ring steps timed alone on one GPU (the compute's ceiling)", "2026-11-26_ring_per_step_torch_cuda.json",
            ring_steps, "python benchmarks/bench_ring.py --per-step 2 4 8 --tokens 8192 --out FILE"),
]

HEADER = """# Performance

Generated by `python benchmarks/performance.py` from the JSON files in `benchmarks/results/`; do not edit by
hand. Each table names its file, the command that measured it (`FILE` is that file) and the machine.
Every system in a table ran in one process on the same inputs; compare ratios within one table, since
run-to-run spread is several percent. How the benchmark measures: [benchmarks/README.md](../benchmarks/README.md).
"""


def _command(section: Section, data: dict) -> str:
    """The command that measured a file: the argv the benchmark recorded in it, else the section's own."""
    argv = (data.get("meta") or {}).get("argv")
    if not argv:
        return section.command
    words, skip = [], None
    for word in argv:
        if skip:
            words.append(skip)
            skip = None
        elif word in ("--out", "--plot"):
            words.append(word)
            skip = "FILE" if word == "--out" else "PNG"
        elif word != "--markdown":
            words.append(word)
    return "python -m dualattn.bench " + " ".join(words)


def render() -> str:
    parts = [HEADER]
    for s in SECTIONS:
        data = _load(s.file)
        parts.append(f"## {s.title}\n")
        parts.append(f"{_meta_line(data)}. File `benchmarks/results/{s.file}`; command `{_command(s, data)}`."
                     + (f" {s.about}" if s.about else "") + "\n")
        parts.append(s.render(data) + "\n")
        if s.plot:
            parts.append(f"![{s.title}](../benchmarks/results/{s.plot})\n")
    files = {s.file for s in SECTIONS} | {s.plot for s in SECTIONS if s.plot}
    stray = sorted(set(os.listdir(RESULTS)) - files)
    if stray:
        raise SystemExit(f"benchmarks/results/ holds files no table shows: {stray}; add a section or remove them")
    return "\n".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with docs/performance.md instead of writing it")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        with open(PAGE) as f:
            same = f.read() == text
        print("docs/performance.md is up to date" if same else "docs/performance.md differs: rerun the script")
        return 0 if same else 1
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(PAGE, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
