"""The stage-scaling figures (benchmarks/gpu/stage_scaling.sh): requests/s of the
tokenizer-bound and detokenizer-bound workloads against the replica count, beside the
0.8 x N goal (issue 31 item 6), as a PNG and a markdown table.

    python -m benchmarks.bench.scaling_plot RESULTS_DIR    # writes scaling.png, scaling.md

It reads `bench serve --save-result` files named {tok,detok}-N.json (N the tokenizer and
detokenizer replicas) and, where present, the CPU seconds each server process used over the
same run (`{tok,detok}-N-cpu.json`, benchmarks/bench/proc_cpu.py) and nvidia-smi's GPU
utilization samples (`{tok,detok}-N-gpu.csv`: timestamp, percent), of which those inside
the run count. Which stage bounds a run shows in the busiest roles: a process near one core
is saturated; a GPU near 100% is the bound. Where the server counts its GPU's time on the
steps (`device_busy_s`, headrace:device_busy_seconds_total), the table gives its share of
the run, and the requests/s the GPU alone would allow at that time per request: the
ceiling that no count of replicas can pass. Where the CPU diff has the whole machine's
busy and stolen seconds, the table gives them as cores: the same work took twice the CPU
seconds on one lease's host as on another's.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

GOAL = 0.8  # of linear scaling, up to 4 replicas
WORKLOADS = {  # file prefix -> (title, the server stages its replicas serve)
    "tok": ("tokenizer-bound", ("gateway_to_tokenizer", "tokenizer")),
    "detok": ("detokenizer-bound", ("result_to_detokenizer", "detokenizer")),
}
RESULT_NAME = re.compile(r"^(tok|detok)-(\d+)\.json$")
NVIDIA_SMI_TIME = "%Y/%m/%d %H:%M:%S.%f"  # its timestamp field, in local time


@dataclass(frozen=True, slots=True)
class RoleLoad:
    """The cores one role's processes kept busy over a run."""
    role: str
    processes: int
    cores: float  # of all of them
    most: float  # of the busiest one


@dataclass(frozen=True, slots=True)
class Point:
    replicas: int
    requests_per_s: float
    completed: int
    failed: int
    stages: dict[str, dict]  # stage -> bench serve's StageStats fields
    roles: list[RoleLoad]  # busiest first
    client_cores: float | None
    gpu_percent: float | None  # nvidia-smi's utilization, mean over the run
    device_busy_s: float | None = None  # the server's GPU time on steps over the run
    duration_s: float = 0.0
    host: dict | None = None  # proc_cpu's whole-machine busy_s and steal_s

    @property
    def busy_share(self) -> float | None:
        return None if self.device_busy_s is None or not self.duration_s \
            else self.device_busy_s / self.duration_s

    @property
    def gpu_bound(self) -> float | None:
        """The requests/s of a GPU that never waited: completed over its busy seconds."""
        return None if not self.device_busy_s else self.completed / self.device_busy_s


def role_loads(processes: list[dict], seconds: float) -> list[RoleLoad]:
    """proc_cpu's rows grouped by role, the role with the busiest process first."""
    by_role: dict[str, list[float]] = {}
    for p in processes:
        by_role.setdefault(p["role"], []).append(p["cpu_s"] / seconds)
    loads = [RoleLoad(role, len(c), sum(c), max(c)) for role, c in by_role.items()]
    return sorted(loads, key=lambda r: -r.most)


def gpu_percent(csv: Path, start: float, end: float) -> float | None:
    """Mean of the samples taken between start and end (Unix seconds)."""
    if not csv.exists():
        return None
    samples = []
    for line in csv.read_text().splitlines():
        try:
            stamp, percent = (field.strip() for field in line.split(","))
            at = datetime.strptime(stamp, NVIDIA_SMI_TIME).timestamp()
            if start <= at <= end:
                samples.append(float(percent))
        except ValueError:  # a header, a cut-off last line, "[N/A]"
            continue
    return sum(samples) / len(samples) if samples else None


def load_points(results: Path) -> dict[str, list[Point]]:
    """Each workload's runs, by replica count."""
    points: dict[str, list[Point]] = {kind: [] for kind in WORKLOADS}
    for path in sorted(results.iterdir()):
        match = RESULT_NAME.match(path.name)
        if match is None:
            continue
        data = json.loads(path.read_text())
        cpu = path.with_name(path.stem + "-cpu.json")
        usage = json.loads(cpu.read_text()) if cpu.exists() else {}
        summary = data["summary"]
        start = data.get("started_at", 0.0)
        points[match[1]].append(Point(
            int(match[2]), summary["request_throughput"], summary["completed"],
            summary["failed"], {s["stage"]: s for s in data.get("server_stages", [])},
            # the snapshots bracket the client's start-up too, while the server idles:
            # the run's own duration is the time the CPU seconds were spent in
            role_loads(usage.get("processes", []), summary["duration_s"]),
            data.get("client_cores"),
            gpu_percent(path.with_name(path.stem + "-gpu.csv"), start,
                        start + summary["duration_s"]),
            data.get("device_busy_s"), summary["duration_s"], usage.get("host")))
    return {kind: sorted(p, key=lambda p: p.replicas) for kind, p in points.items() if p}


def speedup(points: list[Point], point: Point) -> float | None:
    """Over the one-replica run (None without one)."""
    base = next((p for p in points if p.replicas == 1), None)
    return point.requests_per_s / base.requests_per_s if base and base.requests_per_s else None


def stage_cell(stats: dict | None) -> str:
    return "-" if stats is None else f"{stats['mean_ms']:.2f} / {stats['p90_ms']:.2f}"


def roles_cell(point: Point, top: int = 3) -> str:
    """The busiest roles: `tokenizer 0.95`, or `tokenizer x2 1.80 (max 0.95)`."""
    return ", ".join(
        f"{r.role} {r.cores:.2f}" if r.processes == 1 else
        f"{r.role} x{r.processes} {r.cores:.2f} (max {r.most:.2f})"
        for r in point.roles[:top]) or "-"


def host_cell(point: Point) -> str:
    """The machine's busy and stolen cores over the run: `9.8 / 0.4`."""
    if point.host is None or not point.duration_s:
        return "-"
    return (f"{point.host['busy_s'] / point.duration_s:.1f} / "
            f"{point.host['steal_s'] / point.duration_s:.1f}")


def table(points: dict[str, list[Point]]) -> str:
    lines = []
    for kind, runs in points.items():
        title, stages = WORKLOADS[kind]
        lines += [f"### {title}", "",
                  "| replicas | requests/s | speed-up | goal (0.8 x N) | "
                  + " | ".join(f"{s} mean / p90 ms" for s in stages)
                  + " | failed | busiest roles (cores) | client cores | GPU % | GPU busy % "
                  "| GPU-bound requests/s | host busy / stolen cores |",
                  "|---:|---:|---:|---:|" + "---:|" * len(stages)
                  + "---:|---|---:|---:|---:|---:|---:|"]
        for p in runs:
            gain = speedup(runs, p)
            client = "-" if p.client_cores is None else f"{p.client_cores:.2f}"
            gpu = "-" if p.gpu_percent is None else f"{p.gpu_percent:.0f}"
            busy = "-" if p.busy_share is None else f"{100 * p.busy_share:.0f}"
            bound = "-" if p.gpu_bound is None else f"{p.gpu_bound:.1f}"
            lines.append(
                f"| {p.replicas} | {p.requests_per_s:.1f} | "
                + ("-" if gain is None else f"{gain:.2f}x") + f" | {GOAL * p.replicas:.1f}x | "
                + " | ".join(stage_cell(p.stages.get(s)) for s in stages)
                + f" | {p.failed} | {roles_cell(p)} | {client} | {gpu} | {busy} | {bound} "
                + f"| {host_cell(p)} |")
        lines.append("")
    return "\n".join(lines)


def plot(points: dict[str, list[Point]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(points), figsize=(5.5 * len(points), 4.2), squeeze=False)
    for ax, (kind, runs) in zip(axes[0], points.items()):
        replicas = [p.replicas for p in runs]
        ax.plot(replicas, [p.requests_per_s for p in runs], "o-", label="measured")
        base = next((p.requests_per_s for p in runs if p.replicas == 1), None)
        if base is not None:
            ax.plot(replicas, [GOAL * n * base for n in replicas], "--", color="gray",
                    label="0.8 x N x (1 replica)")
        bounds = [(p.replicas, p.gpu_bound) for p in runs if p.gpu_bound is not None]
        if bounds:
            ax.plot(*zip(*bounds), ":", color="tab:red", label="GPU-bound (never waiting)")
        ax.set_title(WORKLOADS[kind][0])
        ax.set_xlabel("tokenizer and detokenizer replicas")
        ax.set_ylabel("requests/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(replicas, [str(n) for n in replicas])
        ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    results = Path(argv[0])
    points = load_points(results)
    if not points:
        print(f"no {{tok,detok}}-N.json results in {results}", file=sys.stderr)
        return 1
    (results / "scaling.md").write_text(table(points))
    plot(points, results / "scaling.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
