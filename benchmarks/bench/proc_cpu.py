"""Which process bounds a run: the CPU seconds each of headrace's processes (and Redis)
used between two snapshots taken around it; over the run's duration, a process near 1.0
core is saturated (each is one asyncio loop), and when none is, the bound is elsewhere (the
GPU, or waiting on one another). The benchmark client reports its own share:
`client_cores` in bench serve's --save-result.

    python -m benchmarks.bench.proc_cpu snapshot before.json [ROOT_PID]
    ...the run...
    python -m benchmarks.bench.proc_cpu diff before.json after.json   # prints the diff JSON

With ROOT_PID (the `headrace serve` launcher), only that process and its descendants count,
not another server's on the same host. The diff also gives the whole machine's CPU seconds
busy and those stolen by the hypervisor (`host`, from /proc/stat): the same work took
twice the CPU seconds on one H200 lease as on another, and steal is what a guest sees of
a contended host.

Linux only: it reads /proc/stat and /proc/<pid>/stat and cmdline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
ROLES = (("redis-server", "redis"),
         ("services.cli gateway", "gateway"), ("services.cli tokenizer", "tokenizer"),
         ("services.cli detokenizer", "detokenizer"), ("services.cli scheduler", "scheduler"),
         ("services.cli worker", "worker"), ("services.cli serve", "launcher"))


def role_of(cmdline: str) -> str | None:
    return next((role for marker, role in ROLES if marker in cmdline), None)


def stat_fields(pid: str) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, ..."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2:].split()


def cpu_seconds(pid: str) -> float:
    """utime + stime of the process (its threads included)."""
    fields = stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def descends(pid: str, root: str, parents: dict[str, str]) -> bool:
    while pid in parents and pid != root:
        pid = parents[pid]
    return pid == root


def host_ticks() -> list[int]:
    """/proc/stat's machine-wide line: user, nice, system, idle, iowait, irq, softirq,
    steal, ... ticks."""
    first = Path("/proc/stat").read_text().splitlines()[0]
    return [int(field) for field in first.split()[1:]]


def host_use(before: list[int], after: list[int]) -> dict:
    """The CPU seconds the whole machine spent busy (user, nice, system, irq, softirq)
    and those the hypervisor stole from it, between two host_ticks()."""
    spent = [b - a for a, b in zip(before, after)]
    busy = spent[0] + spent[1] + spent[2] + spent[5] + spent[6]
    steal = spent[7] if len(spent) > 7 else 0
    return {"busy_s": round(busy / TICKS_PER_S, 2), "steal_s": round(steal / TICKS_PER_S, 2)}


def snapshot(root: str | None = None) -> dict:
    """{"time": wall seconds, "host": host_ticks(), "processes": {pid: [role, cpu
    seconds]}} of the processes with a role (under `root`, where given)."""
    parents, found = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[pid] = stat_fields(pid)[1]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            role = role_of(cmdline)
            if role is not None:
                found[pid] = [role, cpu_seconds(pid)]
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
    if root is not None:
        found = {pid: row for pid, row in found.items() if descends(pid, root, parents)}
    return {"time": time.time(), "host": host_ticks(), "processes": found}


def cpu_used(before: dict, after: dict) -> list[dict]:
    """Per process alive at both snapshots, busiest first: its role and CPU seconds."""
    rows = []
    for pid, (role, seconds) in after["processes"].items():
        if pid not in before["processes"]:
            continue
        start = before["processes"][pid][1]
        rows.append({"pid": int(pid), "role": role, "cpu_s": round(seconds - start, 3)})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "snapshot":
        Path(argv[1]).write_text(json.dumps(snapshot(*argv[2:])))
        return 0
    if len(argv) == 3 and argv[0] == "diff":
        before, after = (json.loads(Path(a).read_text()) for a in argv[1:])
        print(json.dumps({"wall_s": round(after["time"] - before["time"], 3),
                          "host": host_use(before["host"], after["host"]),
                          "processes": cpu_used(before, after)}, indent=1))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
