"""Pure-Python half of the benchmark: FLOP/byte counts, records, ratios, table, JSON, plot, progress.

Nothing here imports torch or jax, so it is tested on any machine (tests/test_bench.py).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

REFERENCE_SYSTEM = "sdpa-cudnn"  # ratios are "TFLOP/s of this system / TFLOP/s of torch SDPA cuDNN"
BWD_OVER_FWD = 2.5  # backward counted as 2.5x the forward (PLATFORM.md, "Measuring")
MODES = ("fwd", "fwdbwd")


@dataclass(frozen=True)
class Shape:
    B: int
    S: int
    H: int
    D: int


def attention_flops(shape: Shape, causal: bool, mode: str) -> float:
    """FLOPs of one call: fwd = 4*B*H*Sq*Sk*D (halved when causal, Sq == Sk here); fwdbwd = 3.5x fwd."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    fwd = 4.0 * shape.B * shape.H * shape.S * shape.S * shape.D
    if causal:
        fwd /= 2
    return fwd * (1.0 + BWD_OVER_FWD if mode == "fwdbwd" else 1.0)


def ideal_fwdbwd_bytes(shape: Shape, elem_bytes: int = 2) -> int:
    """Bytes that fwd+bwd cannot avoid holding: q, k, v, o, do, dq, dk, dv and the fp32 lse."""
    tensor = shape.B * shape.S * shape.H * shape.D * elem_bytes
    return 8 * tensor + shape.B * shape.H * shape.S * 4


@dataclass
class Measurement:
    """One (system, shape, causal, mode) cell. status: ok | wrong (timed, output off) | missing."""
    system: str
    B: int
    S: int
    H: int
    D: int
    causal: bool
    mode: str
    status: str = "ok"
    ms: Optional[float] = None
    tflops: Optional[float] = None
    ratio_to_cudnn: Optional[float] = None
    err: Optional[float] = None
    note: Optional[str] = None  # "missing: <reason>" or "wrong: err=<e>"

    @property
    def shape(self) -> Shape:
        return Shape(self.B, self.S, self.H, self.D)

    @property
    def row_key(self):
        return (self.B, self.S, self.H, self.D, self.causal, self.mode)


@dataclass
class MemoryRecord:
    system: str
    B: int
    S: int
    H: int
    D: int
    causal: bool
    status: str = "ok"
    peak_bytes: Optional[int] = None
    ideal_bytes: Optional[int] = None
    ratio: Optional[float] = None
    note: Optional[str] = None


def describe_error(exc: BaseException, limit: int = 240) -> str:
    """`Type: first line of the message`, short enough for a table footnote."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def missing(base: dict, exc_or_reason) -> dict:
    reason = exc_or_reason if isinstance(exc_or_reason, str) else describe_error(exc_or_reason)
    return dict(base, status="missing", note=f"missing: {reason}")


def timed(shape: Shape, causal: bool, mode: str, ms: float, err: Optional[float], tol: float) -> dict:
    """Fields of a timed cell; a correctness failure (err >= tol, or NaN) is kept but marked wrong."""
    fields = dict(ms=ms, tflops=attention_flops(shape, causal, mode) / (ms * 1e-3) / 1e12, err=err)
    if err is not None and not err < tol:
        fields.update(status="wrong", note=f"wrong: err={err:.2e}")
    return fields


def fill_ratios(records: Sequence[Measurement], reference: str = REFERENCE_SYSTEM) -> None:
    """Set ratio_to_cudnn = tflops / tflops of `reference` in the same (shape, causal, mode) row."""
    ref = {r.row_key: r.tflops for r in records if r.system == reference and r.tflops}
    for r in records:
        base = ref.get(r.row_key)
        r.ratio_to_cudnn = r.tflops / base if (r.tflops and base) else None


# ---------------------------------------------------------------------------------------------
# Table


def _grid(header: List[str], rows: List[List[str]], n_left: int) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]

    def line(cells):
        left = "  ".join(c.rjust(w) for c, w in zip(cells[:n_left], widths))
        right = " | ".join(c.rjust(w) for c, w in zip(cells[n_left:], widths[n_left:]))
        return f"{left} | {right}"

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule] + [line(r) for r in rows])


class _Footnotes:
    def __init__(self):
        self.notes: List[str] = []

    def mark(self, system: str, note: str) -> str:
        text = f"{system}: {note}"
        if text not in self.notes:
            self.notes.append(text)
        return f"[{self.notes.index(text) + 1}]"

    def render(self) -> str:
        return "\n".join(f"  [{i}] {n}" for i, n in enumerate(self.notes, 1))


def _ordered_unique(items: Iterable) -> list:
    return list(dict.fromkeys(items))


def _timing_cell(r: Optional[Measurement], notes: _Footnotes) -> str:
    if r is None:
        return "-"
    if r.status == "missing":
        return "missing" + notes.mark(r.system, r.note)
    cell = f"{r.tflops:.1f}"
    if r.ratio_to_cudnn is not None:
        cell += f" {r.ratio_to_cudnn:.2f}x"
    if r.status == "wrong":
        cell += " wrong" + notes.mark(r.system, r.note)
    return cell


def format_table(records: Sequence[Measurement], systems: Optional[Sequence[str]] = None) -> str:
    """Rows per (shape, causal, mode); one column per system: 'TFLOP/s ratio-to-cuDNN'."""
    systems = list(systems) if systems else _ordered_unique(r.system for r in records)
    cells = {(r.row_key, r.system): r for r in records}
    notes = _Footnotes()
    rows = []
    for key in _ordered_unique(r.row_key for r in records):
        B, S, H, D, causal, mode = key
        left = [str(B), str(S), str(H), str(D), "yes" if causal else "no", mode]
        rows.append(left + [_timing_cell(cells.get((key, s)), notes) for s in systems])
    header = ["B", "S", "H", "D", "causal", "mode"] + list(systems)
    title = f"TFLOP/s (median) and ratio to {REFERENCE_SYSTEM}"
    text = title + "\n" + _grid(header, rows, 6)
    return text + ("\n" + notes.render() if notes.notes else "")


def _memory_cell(r: Optional[MemoryRecord], notes: _Footnotes) -> str:
    if r is None:
        return "-"
    if r.status != "ok":
        return r.status + notes.mark(r.system, r.note)
    return f"{r.peak_bytes / 2**30:.2f} GiB {r.ratio:.2f}x"


def format_memory_table(records: Sequence[MemoryRecord], systems: Optional[Sequence[str]] = None) -> str:
    """Rows per (shape, causal): ideal bytes, then per system the peak and peak / ideal."""
    systems = list(systems) if systems else _ordered_unique(r.system for r in records)
    key = lambda r: (r.B, r.S, r.H, r.D, r.causal)  # noqa: E731
    cells = {(key(r), r.system): r for r in records}
    notes = _Footnotes()
    rows = []
    for k in _ordered_unique(key(r) for r in records):
        shape = Shape(*k[:4])
        left = [str(x) for x in k[:4]] + ["yes" if k[4] else "no",
                                          f"{ideal_fwdbwd_bytes(shape) / 2**30:.2f} GiB"]
        rows.append(left + [_memory_cell(cells.get((k, s)), notes) for s in systems])
    header = ["B", "S", "H", "D", "causal", "ideal"] + list(systems)
    title = "fwd+bwd peak torch.cuda.max_memory_allocated and ratio to the ideal (q,k,v,o,do,dq,dk,dv,lse)"
    text = title + "\n" + _grid(header, rows, 6)
    return text + ("\n" + notes.render() if notes.notes else "")


# ---------------------------------------------------------------------------------------------
# JSON and plot


def _finite(row: dict) -> dict:
    # strict JSON has no NaN/inf (a NaN output gives err=nan): write those as strings
    return {k: (repr(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def write_json(path: str, meta: dict, measurements: Sequence = (), memory: Sequence = ()) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"meta": meta,
           "measurements": [_finite(dataclasses.asdict(r)) for r in measurements],
           "memory": [_finite(dataclasses.asdict(r)) for r in memory]}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, allow_nan=False, default=str)
        f.write("\n")
    os.replace(tmp, path)


def load_json(path: str):
    """Back from write_json: (meta, [Measurement], [MemoryRecord])."""
    with open(path) as f:
        doc = json.load(f)
    return (doc["meta"], [Measurement(**r) for r in doc.get("measurements", [])],
            [MemoryRecord(**r) for r in doc.get("memory", [])])


def plot(records: Sequence[Measurement], path: str, title: str = "") -> str:
    """TFLOP/s vs sequence length, one line per system, one panel per (causal, mode).

    Returns a line that says what was written (or why nothing was)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"plot skipped: matplotlib is not importable ({e})"
    timed_records = [r for r in records if r.tflops]
    if not timed_records:
        return "plot skipped: no timed measurements"
    causals = _ordered_unique(r.causal for r in records)
    modes = _ordered_unique(r.mode for r in records)
    systems = _ordered_unique(r.system for r in records)
    fig, axes = plt.subplots(len(causals), len(modes), figsize=(5.5 * len(modes), 3.8 * len(causals) + 0.8),
                             squeeze=False)
    legend = {}
    for row, causal in zip(axes, causals):
        for ax, mode in zip(row, modes):
            for system in systems:
                pts = sorted((r.S, r.tflops) for r in timed_records
                             if r.system == system and r.causal == causal and r.mode == mode)
                if pts:
                    legend[system], = ax.plot(*zip(*pts), marker="o", label=system)
            seqlens = sorted({r.S for r in records})
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [str(s) for s in seqlens])
            ax.set_xlabel("sequence length")
            ax.set_ylabel("TFLOP/s")
            ax.set_ylim(bottom=0)
            ax.set_title(f"{'causal' if causal else 'non-causal'}, {mode}")
            ax.grid(True, alpha=0.3)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=min(len(legend), 5), fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------------------------
# Progress


class _Counter:
    """Stand-in for tqdm: one '[i/n] what' line per step on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.what = total, desc, 0, ""

    def set_postfix_str(self, what: str) -> None:
        self.what = what

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"{self.desc} [{self.n}/{self.total}] {self.what}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def progress(total: int, desc: str = "bench"):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
