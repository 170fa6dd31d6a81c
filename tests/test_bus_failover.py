"""The bus alone through a Redis Cluster failover (3 masters + 3 replicas, node timeout
1 s): the master of a shard's slot is killed with SIGKILL; writes sent while the cluster
is down are retried until the replica takes over, reads resume on it, and nothing the
replica had received is lost. The pipeline's promise is tests/test_cluster_failover.py's."""

from __future__ import annotations

import anyio
import pytest

from common import keys
from common.bus import UNAVAILABLE, Bus
from common.messages import Abort
from tests.redis_cluster import LocalCluster

pytestmark = pytest.mark.anyio
STREAM, GROUP = keys.steps(0), "g"


async def read_all(bus: Bus, n: int) -> list[str]:
    rids: list[str] = []
    with anyio.fail_after(30):
        while len(rids) < n:
            try:
                entries = await bus.read(GROUP, "c", {STREAM: ">"}, count=100, block_ms=100)
                await bus.ack(entries)
            except UNAVAILABLE:  # the slot map is still settling: as a stage's loop does
                await anyio.sleep(0.1)
                continue
            rids += [entry.msg.rid for entry in entries]
    return rids


async def test_the_bus_carries_on_through_a_cluster_failover(tmp_path):
    with LocalCluster(tmp_path, replicas=1, node_timeout_ms=1000) as cluster:
        async with Bus(cluster.url, retry_timeout_s=30.0, socket_timeout_s=5.0) as bus:
            await bus.ensure_group(STREAM, GROUP)
            await bus.publish(STREAM, *(Abort(f"before-{i}") for i in range(10)))
            assert await read_all(bus, 10) == [f"before-{i}" for i in range(10)]
            victim = cluster.master_of(STREAM)
            with cluster.client(victim) as master:
                assert master.wait(1, 5000) == 1  # the replica has it all before the kill

            cluster.kill(victim)
            await bus.publish(STREAM, *(Abort(f"during-{i}") for i in range(10)))
            promoted = await anyio.to_thread.run_sync(cluster.wait_failed_over, STREAM,
                                                      victim)
            assert await read_all(bus, 10) == [f"during-{i}" for i in range(10)]
            with cluster.client(promoted) as master:
                assert master.xlen(STREAM) == 20
                assert master.xpending(STREAM, GROUP)["pending"] == 0
