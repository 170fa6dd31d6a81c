"""The bus on a master watched by Sentinel (`redis+sentinel://`): real redis-servers (a
master, its replica, a sentinel); the master is killed with SIGKILL and the bus, the
heartbeat's blocking client and the inspecting client all carry on against the promoted
replica, with no entry lost that the replica had received."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest

from common.bus import Bus
from common.config import ConfigError, ServerConfig
from common.messages import Abort
from common.redis_cluster import blocking_client, plain_client
from common.redis_sentinel import sentinel_target
from tests.redis_sentinel import LocalSentinel

pytestmark = pytest.mark.anyio
STREAM, GROUP = "hr:sentinel-test", "g"


@pytest.fixture
def sentinel(tmp_path) -> Iterator[LocalSentinel]:
    with LocalSentinel(tmp_path) as deployment:
        yield deployment


async def read_all(bus: Bus, n: int) -> list[str]:
    rids: list[str] = []
    with anyio.fail_after(30):
        while len(rids) < n:
            entries = await bus.read(GROUP, "c", {STREAM: ">"}, count=100, block_ms=100)
            await bus.ack(entries)
            rids += [entry.msg.rid for entry in entries]
    return rids


async def test_the_bus_carries_on_through_a_sentinel_failover(sentinel):
    async with Bus(sentinel.url, retry_timeout_s=30.0, socket_timeout_s=5.0) as bus:
        await bus.ensure_group(STREAM, GROUP)
        await bus.publish(STREAM, *(Abort(f"before-{i}") for i in range(10)))
        assert await read_all(bus, 10) == [f"before-{i}" for i in range(10)]
        with sentinel.client(sentinel.master()) as master:
            assert master.wait(1, 5000) == 1  # the replica has it all before the kill

        dead = sentinel.kill_master()
        # written while the sentinel has not yet promoted the replica: the bus retries
        await bus.publish(STREAM, *(Abort(f"during-{i}") for i in range(10)))
        promoted = await anyio.to_thread.run_sync(sentinel.wait_failed_over, dead)
        assert promoted == sentinel.replica_port
        assert await read_all(bus, 10) == [f"during-{i}" for i in range(10)]
        with sentinel.client(promoted) as master:
            assert master.xlen(STREAM) == 20  # nothing acknowledged before the kill lost
            assert master.xpending(STREAM, GROUP)["pending"] == 0

    beat = blocking_client(sentinel.url, "beat", timeout_s=1.0)  # the heartbeat's client
    try:
        assert beat.set("hr:alive:x", "1", px=1000)
    finally:
        beat.close()
    inspecting = plain_client(sentinel.url)
    try:
        assert await inspecting.xlen(STREAM) == 20
    finally:
        await inspecting.aclose()


def test_sentinel_urls_are_parsed_and_bad_ones_refused():
    target = sentinel_target("redis+sentinel://app:s%40cret@h1:26379,h2:26380/mymaster/2")
    assert target.sentinels == [("h1", 26379), ("h2", 26380)]
    assert (target.service, target.db, target.username, target.password) == \
        ("mymaster", 2, "app", "s@cret")
    for bad in ("redis+sentinel://h1:26379", "redis+sentinel://h1/mymaster",
                "redis+sentinel://h1:26379/mymaster/x", "redis+sentinel://h1:26379/m/0?x=1"):
        with pytest.raises(ConfigError, match="--redis-url"):
            ServerConfig(redis_url=bad)
