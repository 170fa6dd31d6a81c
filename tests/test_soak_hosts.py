"""The parts of the simulated hosts that need no namespace: one `headrace serve` per host
(vLLM's --data-parallel-start-rank / --data-parallel-size-local), a cluster none of whose
nodes answers, and what `headrace bench soak --hosts` concludes from a greedy text and a
failure's time. The hosts
themselves are tests/test_hosts.py (long)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis.asyncio.cluster import NodesManager

from benchmarks.bench.hosts import why_no_namespaces
from benchmarks.bench.soak_hosts import (DUPLICATED, GRACE_S, WRONG_TEXT, Fault, HostTally,
                                         reason_of, text_outcome)
from benchmarks.bench.soak_report import CLIENT_ERROR, INVALID, OK, STREAM_ERROR
from common.bus import UNAVAILABLE, Bus, BusUnavailable
from common.config import ConfigError, EngineConfig, ServerConfig
from common.net import free_port
from common.messages import Abort
from common.redis_cluster import ClusterUnreachable, blocking_client, cluster_client
from services.launcher import check_local_shards, child_specs
from tests.conftest import run_command
from tests.tiny_models import make_tiny_model


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def host_specs(start: int, local: int | None, size: int = 3) -> list[tuple[str, str, str]]:
    engine = EngineConfig(model="m", device="cpu", data_parallel_size=size)
    server = ServerConfig(data_parallel_start_rank=start, data_parallel_size_local=local,
                          api_server_count=1, tokenizer_replicas=2, detokenizer_replicas=1)
    check_local_shards(engine, server)
    return [(c.name, flag(c.argv, "--replica"), flag(c.argv, "--shard")
             if "--shard" in c.argv else "") for c in child_specs(engine, server, "redis://x",
                                                                 Path("/tmp/metrics"))]


def test_one_host_runs_its_shards_and_its_stages_take_replica_ids_of_their_own():
    assert host_specs(1, 1) == [
        ("worker", "1", "1"), ("scheduler", "1", "1"), ("tokenizer", "1.0", ""),
        ("tokenizer", "1.1", ""), ("detokenizer", "1.0", ""), ("gateway", "1.0", "")]
    assert [s for s in host_specs(0, 2) if s[0] == "worker"] == [("worker", "0", "0"),
                                                                ("worker", "1", "1")]


def test_a_serve_of_every_shard_keeps_its_plain_replica_ids():
    assert ("tokenizer", "1", "") in host_specs(0, None)
    assert ("worker", "2", "2") in host_specs(0, None)


@pytest.mark.parametrize("start, local", [(3, None), (2, 2), (0, 4)])
def test_shards_past_the_data_parallel_size_are_refused(start, local):
    with pytest.raises(ConfigError, match="--data-parallel-size 3"):
        host_specs(start, local)


def test_a_greedy_text_given_twice_in_part_is_a_duplicate_else_wrong():
    assert text_outcome(" the cat sat", " the cat sat") == OK
    assert text_outcome(" the cat cat sat", " the cat sat") == DUPLICATED
    assert text_outcome(" the cat sat sat", " the cat sat") == DUPLICATED
    assert text_outcome(" the dog sat", " the cat sat") == WRONG_TEXT
    assert text_outcome(" the cat", " the cat sat") == WRONG_TEXT  # cut short


def test_failures_are_counted_by_reason_and_judged_by_the_faults_they_fall_in():
    tally = HostTally()
    tally.add("completion", OK, "", 1.0)
    tally.add(INVALID, CLIENT_ERROR, "400", 2.0)  # what an invalid call must get
    tally.add("chat-stream", STREAM_ERROR, "host 1: shard 1 lost (request 17)", 30.0)
    tally.add("completion", STREAM_ERROR, "host 1: shard 1 lost (request 18)", 31.0)
    assert tally.failed_at == [30.0, 31.0]
    assert tally.reasons == {"stream-error: host #: shard # lost (request #)": 2}
    assert reason_of("timeout", "cmpl-0b6c2d611c6b4dcd") == "timeout: cmpl-#"
    fault = Fault(25.0, "host-killed", 1, healed_s=45.0, back_after_s=100.0)
    assert fault.covers(30.0) and fault.covers(145.0 + GRACE_S)  # loading until 145
    assert not fault.covers(24.0) and not fault.covers(146.0 + GRACE_S)
    assert Fault(25.0, "link-cut", 0, healed_s=45.0).covers(1e6)  # never back


@pytest.mark.anyio
async def test_a_cluster_no_node_of_which_answers_is_a_connection_error_the_bus_retries():
    """A host cut off from every node: redis-py's RedisClusterException would escape every
    `except RedisError` (and kill a heartbeat thread for good)."""
    client = cluster_client(f"redis+cluster://127.0.0.1:{free_port()}", 2, {})
    try:
        with pytest.raises(ClusterUnreachable, match="cannot be connected"):
            await client.initialize()
        assert issubclass(ClusterUnreachable, UNAVAILABLE)
        assert type(client.nodes_manager) is NodesManager  # redis-py's own, not patched
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_a_bus_cut_off_from_its_cluster_retries_its_writes_and_reports_its_reads():
    """Through the bus's own calls: a write is retried as an outage until the bus gives
    up (BusUnavailable), and a read of keys (a pipeline) and a command raise a connection
    error that the callers' `except RedisError` report, not a RedisClusterException."""
    async with Bus(f"redis+cluster://127.0.0.1:{free_port()}", retry_timeout_s=0.3,
                   max_backoff_s=0.05) as bus:
        with pytest.raises(BusUnavailable, match="cannot be connected"):
            await bus.publish("hr:{s0}:admit", Abort("r"))
        with pytest.raises(ClusterUnreachable):
            await bus.values("hr:{s0}:a", "hr:{s0}:b")
        with pytest.raises(ClusterUnreachable):
            await bus.forget("hr:{s0}:a")


def test_a_heartbeats_blocking_cluster_client_cut_off_raises_a_connection_error():
    """The heartbeat thread's client reads the slot map as it is made."""
    with pytest.raises(ClusterUnreachable, match="cannot be connected"):
        blocking_client(f"redis+cluster://127.0.0.1:{free_port()}", "beat", timeout_s=0.5)


@pytest.mark.long
def test_a_short_soak_across_two_hosts(tmp_path):
    """Two minutes of traffic on two simulated hosts of a tiny model, a fault every 40 s:
    the soak passes its own checks (no duplicate, failures only around the faults, every
    host back, memory bounded) and writes its report and plot."""
    if (reason := why_no_namespaces()) is not None:
        pytest.skip(f"no simulated hosts on this machine: {reason}")
    model = make_tiny_model(tmp_path, "llama", vocab_size=151936)
    out = tmp_path / "soak"
    result = run_command("bench", "soak", "--hosts", "2", "--model", str(model),
                         "--out", str(out), "--duration-s", "120", "--concurrency", "4",
                         "--fault-every-s", "40", "--sample-every-s", "20", "--idle-s", "15",
                         "--max-tokens", "16", timeout=900)
    report = (out / "report.md").read_text() if (out / "report.md").exists() else ""
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:], report)
    assert "PASS: no duplicated delivery (0 seen)" in report
    assert "## Faults" in report and (out / "soak.png").stat().st_size > 0
