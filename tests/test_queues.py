"""`headrace queues`: the snapshot of streams, groups and consumers, and the real command's
table, on a single Redis and on a Redis Cluster (whose streams are spread over its masters)."""

from __future__ import annotations

import random

import anyio
import pytest

from common import keys
from common.bus import Bus
from common.messages import Abort
from common.stalls import WINDOW_S, Stalls
from services.queues import COLUMNS, Snapshot, format_table, take_snapshot
from tests.conftest import run_command


async def fill_streams(url: str, rng: random.Random) -> dict[str, int]:
    """hr:requests: 30 entries; group tok read 12 of them (tok-0 acked 3 of its 7,
    tok-1 holds 5); group audit read nothing. Shard 10's steps: 4 entries, no group; shard
    2's results: 2 entries."""
    async with Bus(url) as bus:
        await bus.publish("hr:requests", *[Abort(f"r{rng.randrange(10**6)}") for _ in range(30)])
        await bus.publish(keys.steps(10), *[Abort(f"s{i}") for i in range(4)])
        await bus.publish(keys.results(2), *[Abort(f"t{i}") for i in range(2)])
        await bus.ensure_group("hr:requests", "tok")
        await bus.ensure_group("hr:requests", "audit")
        first = await bus.read("tok", "tok-0", {"hr:requests": ">"}, count=7)
        await bus.read("tok", "tok-1", {"hr:requests": ">"}, count=5)
        await bus.ack(first[:3])
        await bus.redis.set("hr:not-a-stream", "x")
    return {"tok-0": 4, "tok-1": 5}


def parse_table(text: str) -> list[dict[str, str]]:
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SHARD"))
    starts = [lines[header].index(name) for name in COLUMNS] + [None]
    return [{name: line[starts[i]:starts[i + 1]].strip() for i, name in enumerate(COLUMNS)}
            for line in lines[header + 1:]]


@pytest.mark.anyio
async def test_snapshot_reports_length_pending_lag_and_consumers(bus_url):
    await fill_streams(bus_url, random.Random(0))
    snapshot = await take_snapshot(bus_url)
    streams = {s.name: s for s in snapshot.streams}
    assert sorted(streams) == sorted(["hr:requests", keys.steps(10), keys.results(2)])
    requests = streams["hr:requests"]
    assert requests.length == 30 and streams[keys.steps(10)].groups == []
    groups = {g.name: g for g in requests.groups}
    assert (groups["tok"].pending, groups["tok"].lag) == (9, 18)
    assert (groups["audit"].pending, groups["audit"].lag) == (0, 30)
    assert groups["audit"].last_delivered_id == "0-0"
    assert {c.name: c.pending for c in groups["tok"].consumers} == {"tok-0": 4, "tok-1": 5}
    assert all(c.idle_ms >= 0 for c in groups["tok"].consumers)


def test_the_table_has_one_row_per_stream_group_and_consumer(bus_url):
    anyio.run(fill_streams, bus_url, random.Random(1))
    snapshot = anyio.run(take_snapshot, bus_url)
    table = format_table(snapshot)
    assert "3 streams, 2 shards" in table.splitlines()[0]
    rows = parse_table(table)
    # the shared streams, then shard by shard (2 before 10, which a name sort would swap)
    assert [(r["SHARD"], r["STREAM"]) for r in rows if r["STREAM"]] == [
        ("-", "hr:requests"), ("2", keys.results(2)), ("10", keys.steps(10))]
    assert [r["GROUP"] for r in rows if r["GROUP"]] == ["audit", "tok"]
    assert format_table(Snapshot("unix:///x", 0.0, [])).endswith("(no hr:* streams yet)")


def test_the_command_prints_groups_pending_lag_and_consumers(bus_url):
    pending = anyio.run(fill_streams, bus_url, random.Random(2))
    result = run_command("queues", REDIS_URL=bus_url)
    assert result.returncode == 0, result.stderr
    rows = parse_table(result.stdout)
    stream_rows = {r["STREAM"]: r for r in rows if r["STREAM"]}
    assert stream_rows["hr:requests"]["LENGTH"] == "30"
    assert stream_rows[keys.steps(10)]["LENGTH"] == "4"
    assert stream_rows[keys.steps(10)]["SHARD"] == "10"
    tok = next(r for r in rows if r["GROUP"] == "tok")
    assert (tok["PENDING"], tok["LAG"]) == ("9", "18")
    assert tok["LAST-DELIVERED"].count("-") == 1
    consumers = {r["CONSUMER"]: r for r in rows if r["CONSUMER"]}
    assert {name: int(r["PENDING"]) for name, r in consumers.items()} == pending
    assert all(r["IDLE"].endswith("s") for r in consumers.values())


def test_the_command_explains_when_no_redis_answers(tmp_path):
    result = run_command("queues", "--run-dir", str(tmp_path), REDIS_URL="")
    assert result.returncode == 1
    assert "no Redis answers" in result.stderr and str(tmp_path) in result.stderr
    assert "Traceback" not in result.stderr


def test_stalls_are_counted_over_the_last_window_only():
    stalls = Stalls()
    stalls.note_loop(1.5, now=100.0)
    stalls.note_loop(0.2, now=105.0)
    stalls.note_collection(now=106.0)
    assert stalls.summary(now=107.0) == {"worst_stall_ms": "1500", "stalls": "2",
                                         "slow_collections": "1"}
    # 1.5 s ago by more than WINDOW_S: only the 0.2 s stall and the collection remain
    assert stalls.summary(now=100.0 + WINDOW_S + 1) == {
        "worst_stall_ms": "200", "stalls": "1", "slow_collections": "1"}
    assert stalls.summary(now=200.0)["stalls"] == "0"


@pytest.mark.anyio
async def test_a_slow_process_is_marked_slow_and_a_gone_one_vanishes(bus_url):
    async with Bus(bus_url) as bus:
        await bus.set_hash(keys.health("worker-a"), {"worst_stall_ms": "1800", "stalls": "3",
                                                     "slow_collections": "0"}, ttl_ms=400)
        await bus.set_hash(keys.health("gateway-b"), {"worst_stall_ms": "60", "stalls": "1",
                                                      "slow_collections": "2"}, ttl_ms=60_000)
        await fill_streams(bus_url, random.Random(2))
        table = format_table(await take_snapshot(bus_url))
        rows = {line.split()[0]: line.split() for line in table.splitlines()
                if line.startswith(("worker-a", "gateway-b"))}
        assert rows == {"worker-a": ["worker-a", "1800ms", "3", "0", "slow"],
                        "gateway-b": ["gateway-b", "60ms", "1", "2", "ok"]}
        assert len(parse_table(table)) > 3  # the stream table still parses below it
        await anyio.sleep(0.6)
        assert set((await take_snapshot(bus_url)).health) == {"gateway-b"}
