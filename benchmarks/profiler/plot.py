"""`headrace profile-plot`: stacked bars of where each profiled step's time goes.

    headrace profile-plot --json-trace profile.json --output-directory plots \\
        --plot-metric pct_cuda_time

One bar per phase (prefill, decode_1, ...). Two charts are written:
  DIR/modules_<metric>.png  stacked by module class: each module's own time (its range
                            minus the modules it called), summed over every layer, plus
                            the sampler and the rest of the engine step
  DIR/ops_<metric>.png      stacked by op category (GEMM, attention, norm, ...): CUDA
                            kernels for the cuda metrics, CPU ops (self time) for the cpu
                            metrics, sorted into categories by name
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)

from benchmarks.profiler.layerwise import (PYTHON_ROW, RUNTIME_CALL, ModelRow,  # noqa: E402
                                           PhaseStats)
from benchmarks.profiler.table import load_phases  # noqa: E402

METRICS = ("pct_cuda_time", "cuda_time_us", "pct_cpu_time", "cpu_time_us")
MAX_GROUPS = 12  # beyond these the smallest groups merge into "other", so a legend stays legible
# First match wins: attention before GEMM, since attention kernels contain matmuls.
CATEGORIES: list[tuple[str, re.Pattern[str]]] = [
    ("attention", re.compile(r"attention|attn|flash|sdpa|combine_splits")),
    ("kv cache write", re.compile(r"write_kv|reshape_and_cache")),
    ("gemm", re.compile(r"\b(mm|addmm|bmm|matmul|linear)\b|gemm|cutlass|cublas|nvjet|xmma")),
    ("norm", re.compile(r"norm|rsqrt")),
    ("activation", re.compile(r"silu|gelu|act_and_mul|sigmoid")),
    ("rotary", re.compile(r"rotary|rope|\b(cos|sin)\b")),
    ("sampling", re.compile(r"softmax|sort|topk|multinomial|argmax|exponential|cumsum|scan|"
                            r"distribution")),
    ("copy and index", re.compile(r"copy|\bcat\b|index|gather|scatter|fill|empty|zero|memcpy|"
                                  r"memset|clone|contiguous|embedding|\b(to|item|arange|resize_|"
                                  r"_local_scalar_dense|lift_fresh|scalar_tensor)\b")),
    ("views", re.compile(r"\b(as_strided_?|view|reshape|transpose|t|slice|select|unsqueeze|"
                         r"squeeze|expand|narrow|split|split_with_sizes|chunk|flatten|permute|"
                         r"alias|detach_?|unbind|resolve_conj|resolve_neg)\b")),
    ("elementwise", re.compile(r"elementwise|reduce|\b(add|mul|sub|div|pow|where|mean|sum|neg|"
                               r"exp|masked_fill|lt|le|gt|ge|eq|ne|max|min|maximum|minimum)_?\b|"
                               r"clamp")),
]


def category(name: str) -> str:
    if name == PYTHON_ROW:
        return "python"
    if RUNTIME_CALL.match(name):
        return "cuda runtime"
    lowered = name.lower()
    for label, pattern in CATEGORIES:
        if pattern.search(lowered):
            return label
    return "other"


def _device(metric: str) -> str:
    return "cuda" if "cuda" in metric else "cpu"


def _total(stats: PhaseStats, metric: str) -> float:
    return stats.cuda_time_us if _device(metric) == "cuda" else stats.cpu_time_us


def _scale(value_us: float, stats: PhaseStats, metric: str) -> float:
    """A time in us, as the metric wants it: us, or percent of the step's total."""
    if not metric.startswith("pct_"):
        return value_us
    total = _total(stats, metric)
    return 100.0 * value_us / total if total > 0 else 0.0


def module_groups(stats: PhaseStats, metric: str) -> dict[str, float]:
    """Each module's own time (minus its callees), summed by class name."""
    groups: dict[str, float] = {}
    key = f"{_device(metric)}_time_us"

    def add(rows: Iterable[ModelRow]) -> None:
        for row in rows:
            own = getattr(row, key) - sum(getattr(c, key) for c in row.children)
            name = row.module or row.path
            groups[name] = groups.get(name, 0.0) + max(0.0, own)
            add(row.children)
    add(stats.model)
    return {name: _scale(us, stats, metric) for name, us in groups.items()}


def op_groups(stats: PhaseStats, metric: str) -> dict[str, float]:
    """Kernel times (cuda metrics) or op self times (cpu metrics) by category."""
    groups: dict[str, float] = {}
    kinds = ("kernel",) if _device(metric) == "cuda" else ("op", "python")
    key = f"{_device(metric)}_time_us"
    for row in stats.summary:
        if row.kind in kinds:
            label = category(row.name)
            groups[label] = groups.get(label, 0.0) + getattr(row, key)
    return {name: _scale(us, stats, metric) for name, us in groups.items()}


def stack(phases: dict[str, PhaseStats], metric: str, by: str
          ) -> tuple[list[str], dict[str, dict[str, float]]]:
    """(group names, largest first, at most MAX_GROUPS, then "other"; per phase: group ->
    value). Groups are ordered by their sum over the phases."""
    grouping = module_groups if by == "modules" else op_groups
    values = {name: grouping(stats, metric) for name, stats in phases.items()}
    sums: dict[str, float] = {}
    for groups in values.values():
        for group, value in groups.items():
            sums[group] = sums.get(group, 0.0) + value
    order = [g for g in sorted(sums, key=sums.__getitem__, reverse=True) if sums[g] > 0]
    if len(order) > MAX_GROUPS:
        kept = set(order[:MAX_GROUPS - 1])
        for phase, groups in values.items():
            other = sum(v for g, v in groups.items() if g not in kept)
            values[phase] = {g: v for g, v in groups.items() if g in kept} | {"other": other}
        order = order[:MAX_GROUPS - 1] + ["other"]
    return order, values


def y_label(metric: str) -> str:
    device = "CUDA" if _device(metric) == "cuda" else "CPU"
    return f"% of the step's {device} time" if metric.startswith("pct_") \
        else f"{device} time (us)"


def phase_label(name: str, stats: PhaseStats) -> str:
    return f"{name}\n{stats.num_running_requests} req\n{stats.num_tokens} tok"


def draw(phases: dict[str, PhaseStats], metric: str, by: str, title: str, path: Path) -> None:
    order, values = stack(phases, metric, by)
    names = list(phases)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.9 * len(names)), 6.0))
    colors = plt.get_cmap("tab20").colors
    bottoms = [0.0] * len(names)
    for i, group in enumerate(order):
        heights = [values[n].get(group, 0.0) for n in names]
        ax.bar(range(len(names)), heights, bottom=bottoms, label=group,
               color=colors[i % len(colors)], width=0.7)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    ax.set_xticks(range(len(names)), [phase_label(n, phases[n]) for n in names], fontsize=8)
    ax.set_ylabel(y_label(metric))
    fig.suptitle(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def chart_title(context: dict, metric: str, by: str) -> str:
    engine = context.get("engine", {})
    model = Path(str(engine.get("model", "model"))).name
    device = context.get("cuda_devices") or []
    where = device[0]["name"] if device and _device(metric) == "cuda" else context.get(
        "device", "")
    basis = "module class" if by == "modules" else "op category"
    return (f"{model} on {where}, batch {context.get('batch_size')}, prompt "
            f"{context.get('prompt_len')}\n{metric} by {basis}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace profile-plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-trace", type=Path, required=True,
                        help="a JSON file written by `headrace profile --json`")
    parser.add_argument("--output-directory", type=Path, required=True,
                        help="where the PNG charts are written (created if missing)")
    parser.add_argument("--plot-metric", choices=METRICS, default="pct_cuda_time",
                        help="what a bar's height is: percent of the step's CUDA or CPU time, "
                             "or that time in microseconds (default pct_cuda_time; on a CPU "
                             "profile use pct_cpu_time or cpu_time_us)")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    phases = load_phases(args.json_trace)
    context = json.loads(args.json_trace.read_text()).get("context", {})
    if _device(args.plot_metric) == "cuda" and not any(s.cuda_time_us for s in phases.values()):
        print(f"headrace profile-plot: {args.json_trace} has no CUDA time (a CPU profile); "
              "use --plot-metric pct_cpu_time or cpu_time_us", file=sys.stderr)
        return 2
    args.output_directory.mkdir(parents=True, exist_ok=True)
    for by in ("modules", "ops"):
        path = args.output_directory / f"{by}_{args.plot_metric}.png"
        draw(phases, args.plot_metric, by, chart_title(context, args.plot_metric, by), path)
        print(f"wrote {path}")
    return 0
