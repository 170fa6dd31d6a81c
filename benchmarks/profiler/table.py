"""`headrace profile-table`: print one table of one phase of a saved profile.

    headrace profile-table --json-trace profile.json --phase prefill --table summary
    headrace profile-table --json-trace profile.json --phase decode_1 --table model

The same formatting prints the tables of `headrace profile` and writes its CSV files.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.profiler.layerwise import ModelRow, PhaseStats

NAME_WIDTH = 64
MODEL_COLUMNS = ["name", "module", "cuda_time_us", "pct_cuda_time", "cpu_time_us",
                 "pct_cpu_time", "invocations"]
SUMMARY_COLUMNS = ["name", "kind", "cuda_time_us", "pct_cuda_time", "cpu_time_us",
                   "pct_cpu_time", "invocations"]


def display_name(row: ModelRow, parent: ModelRow | None) -> str:
    """A module's path relative to its caller's ("layers.0" under "model"), or its whole
    path when it is shared from elsewhere; the model itself by its class."""
    if not row.path:
        return row.module
    if parent is not None and parent.path and row.path.startswith(parent.path + "."):
        return row.path[len(parent.path) + 1:]
    return row.path


def model_rows(stats: PhaseStats) -> Iterator[tuple[int, ModelRow, str]]:
    """(depth, row, display name) of every model table row, callers before callees."""
    def walk(rows: list[ModelRow], parent: ModelRow | None, depth: int
             ) -> Iterator[tuple[int, ModelRow, str]]:
        for row in rows:
            yield depth, row, display_name(row, parent)
            yield from walk(row.children, row, depth + 1)
    return walk(stats.model, None, 0)


def _pct(part: float, total: float) -> float:
    return 100.0 * part / total if total > 0 else 0.0


def model_table(stats: PhaseStats) -> tuple[list[str], list[list[str]]]:
    rows = [[_clip("  " * depth + name), row.module, f"{row.cuda_time_us:.2f}",
             f"{_pct(row.cuda_time_us, stats.cuda_time_us):.2f}", f"{row.cpu_time_us:.2f}",
             f"{_pct(row.cpu_time_us, stats.cpu_time_us):.2f}", str(row.invocations)]
            for depth, row, name in model_rows(stats)]
    return MODEL_COLUMNS, rows


def summary_table(stats: PhaseStats) -> tuple[list[str], list[list[str]]]:
    rows = [[_clip(r.name), r.kind, f"{r.cuda_time_us:.2f}", f"{r.pct_cuda_time:.2f}",
             f"{r.cpu_time_us:.2f}", f"{r.pct_cpu_time:.2f}", str(r.invocations)]
            for r in stats.summary]
    return SUMMARY_COLUMNS, rows


def _clip(name: str) -> str:
    return name if len(name) <= NAME_WIDTH else name[:NAME_WIDTH - 3] + "..."


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    """Left-aligned text columns, right-aligned numbers, a rule under the header."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    numeric = [bool(rows) and all(_is_number(r[i]) for r in rows) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(cells, widths, numeric)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def format_phase_table(stats: PhaseStats, table: str) -> str:
    return format_table(*(model_table(stats) if table == "model" else summary_table(stats)))


def write_model_csv(stats: PhaseStats, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["depth", "path"] + MODEL_COLUMNS[1:])
        for depth, row, _ in model_rows(stats):
            writer.writerow([depth, row.path or row.module, row.module, row.cuda_time_us,
                             _pct(row.cuda_time_us, stats.cuda_time_us), row.cpu_time_us,
                             _pct(row.cpu_time_us, stats.cpu_time_us), row.invocations])


def write_summary_csv(stats: PhaseStats, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(SUMMARY_COLUMNS)
        for r in stats.summary:
            writer.writerow([r.name, r.kind, r.cuda_time_us, r.pct_cuda_time, r.cpu_time_us,
                             r.pct_cpu_time, r.invocations])


def load_phases(path: Path) -> dict[str, PhaseStats]:
    """The phases of a `headrace profile --json` file, in step order."""
    data = json.loads(path.read_text())
    return {name: PhaseStats.from_dict(value) for name, value in data.items()
            if name != "context"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace profile-table", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-trace", type=Path, required=True,
                        help="a JSON file written by `headrace profile --json`")
    parser.add_argument("--phase", default="prefill",
                        help="the step to show: prefill, decode_1, decode_2, ... "
                             "(default prefill)")
    parser.add_argument("--table", choices=("summary", "model"), default="summary",
                        help="summary: time per CUDA kernel and per CPU op; model: time per "
                             "nn.Module, nested as called (default summary)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    phases = load_phases(args.json_trace)
    if args.phase not in phases:
        print(f"headrace profile-table: no phase {args.phase!r} in {args.json_trace}; it has "
              f"{', '.join(phases)}", file=sys.stderr)
        return 2
    print(format_phase_table(phases[args.phase], args.table))
    return 0
