"""`headrace bench soak`: its pure parts on made-up data (which child it kills next, which
processes it names, the growth rule across a restart, the gauges it reads), then a short
soak of a real `headrace serve` of the demo model.

The real run under `make test` is 20 s of traffic from 4 clients with a child killed every
7 s (a tokenizer, then a detokenizer), one tokenizer and one detokenizer replica so that the
server starts quickly on a 2-core machine; about 60 s in all when the machine is otherwise
idle. `make test-long` runs the same checks on 40 s of traffic with a kill every 15 s.
"""

from __future__ import annotations

import pytest

from benchmarks.bench.soak import metrics_gauges, process_label, redis_state, restart_target
from benchmarks.bench.soak_report import (MIB, Growth, Limits, Restart, Sample, Tally,
                                          rss_checks, verdicts)
from common import keys
from common.bus import Bus
from common.messages import Abort
from common.redis_cluster import plain_client
from tests.conftest import run_command

SOAK_TIMEOUT_S = 300


@pytest.mark.anyio
async def test_the_probe_reads_memory_and_every_streams_length(bus_url):
    async with Bus(bus_url) as bus:
        await bus.publish(keys.REQUESTS, Abort("a"), Abort("b"))
        await bus.publish(keys.steps(1), Abort("c"))
    client = plain_client(bus_url)
    try:
        used, streams = await redis_state(client)
    finally:
        await client.aclose()
    assert used is not None and used > 0
    assert streams == {keys.REQUESTS: 2, keys.steps(1): 1}


def test_restarts_go_through_the_services_and_their_replicas_in_turn():
    labels = ["launcher", "redis", "worker-0", "tokenizer-0", "tokenizer-1", "detokenizer-0",
              "gateway-0"]
    assert [restart_target(n, labels) for n in range(6)] == [
        "tokenizer-0", "detokenizer-0", "gateway-0", "tokenizer-1", "detokenizer-0",
        "gateway-0"]
    assert restart_target(0, ["worker-0"]) is None


def test_process_labels():
    cli = ["/venv/bin/python", "-m", "services.cli"]
    assert process_label([*cli, "serve", "model.gguf", "--port", "9"]) == "launcher"
    assert process_label([*cli, "tokenizer", "--model", "m", "--replica", "1"]) == "tokenizer-1"
    assert process_label([*cli, "worker", "--model", "m"]) == "worker-0"
    assert process_label(["/bin/redis-server unixsocket:/run/redis.sock"]) == "redis"
    assert process_label(["/usr/bin/python", "-m", "pytest"]) is None


def test_a_restarted_process_is_compared_with_itself_once_settled():
    def sample(t_s: float, pid: int, rss_mib: int) -> Sample:
        return Sample(t_s, "traffic", {"gateway-0": rss_mib * MIB}, {"gateway-0": pid})

    limits = Limits(Growth(0.10, 20 * MIB), 0.2, 2000)
    # killed at 100 s: the replacement loads (100 MiB), then stays at 400 MiB
    samples = [sample(0, 1, 600), sample(60, 1, 600), sample(120, 2, 100),
               *(sample(t, 2, 400) for t in range(180, 600, 60))]
    [growth] = rss_checks(samples, limits)
    assert growth.verdict == "PASS" and "at 4:00" in growth.text, growth.text
    samples.append(sample(600, 2, 500))  # past 10% + 20 MiB of 400 MiB
    assert rss_checks(samples, limits)[0].verdict == "FAIL"


def test_gauges_and_backlog_from_metrics():
    exposition = "\n".join([
        'headrace:num_requests_running{shard="0"} 2.0',
        'headrace:num_requests_running{shard="1"} 1.0',
        'headrace:num_requests_waiting{shard="0"} 1.0',
        'headrace:kv_cache_usage_perc{shard="0"} 0.25',
        'headrace:kv_cache_usage_perc{shard="1"} 0.5',
        'headrace:stream_pending{group="tokenizer",stream="hr:requests"} 3.0',
        'headrace:stream_lag{group="worker",stream="hr:{s0}:steps"} 4.0', ""])
    assert metrics_gauges(exposition) == {"running": 3.0, "waiting": 1.0,
                                          "kv_cache_usage": 0.5, "backlog": 7.0}
    assert metrics_gauges(None) == {}


def test_verdicts_fail_on_busy_idle_gauges_a_child_not_back_and_a_crash():
    first = Sample(0, "traffic", pids={"tokenizer-0": 7, "worker-0": 1})
    idle = Sample(60, "idle", pids={"worker-0": 2}, streams={"hr:requests": 5},
                  gauges={"running": 1.0, "waiting": 0.0, "kv_cache_usage": 0.1,
                          "backlog": 0.0})
    checks = verdicts([first, idle], [Restart(30, "tokenizer-0", 7)], Tally(),
                      Limits(Growth(0.1, 0), 0.2, 2000), exit_code=0)
    failed = [c.text for c in checks if c.verdict == "FAIL"]
    assert [t.split(":")[0] for t in failed] == [
        "requests succeeded", "gauges 0 when idle", "every killed child came back",
        "no process died on its own"], failed
    assert "worker-0 (pid 1, gone by 1:00)" in failed[-1]


# (traffic s, sample every s, kill every s, idle s): samples at 0, every, ... and one idle
SOAKS = [pytest.param((20, 4, 7, 5), id="quick"),
         pytest.param((40, 10, 15, 10), id="full", marks=pytest.mark.long)]


@pytest.mark.parametrize("soak", SOAKS)
def test_a_short_soak_of_headrace_serve(tmp_path, soak):
    """`make test` soaks for the quick run's 20 s, `make test-long` for 40 s."""
    duration_s, every_s, restart_s, idle_s = soak
    out = tmp_path / "soak"
    result = run_command("bench", "soak", "--out", str(out), "--duration-s", str(duration_s),
                         "--sample-every-s", str(every_s), "--restart-every-s", str(restart_s),
                         "--idle-s", str(idle_s), "--concurrency", "4", "--replicas", "1",
                         timeout=SOAK_TIMEOUT_S)
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    shown = f"{result.stdout}\n{result.stderr[-3000:]}\n{report}"
    assert result.returncode == 0, shown
    assert {"samples.csv", "report.md", "soak.png"} <= {p.name for p in out.iterdir()}, shown
    assert "PASS: gauges 0 when idle" in report, shown
    assert "PASS: requests succeeded" in report, shown
    assert "PASS: no 5xx" in report and "| all |" in report, shown
    assert "| tokenizer-0 |" in report, shown  # the first restart, in its table
    assert "| detokenizer-0 |" in report, shown  # and the second
    samples = len((out / "samples.csv").read_text().splitlines())
    assert samples >= 1 + duration_s // every_s + 1, shown  # header, 0 s .. < duration, idle
