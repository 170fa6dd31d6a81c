"""The scheduler's commits written behind its loop (services/scheduler/commits.py), against
a real Redis: order, what one write carries, acknowledgements, the bound on what waits,
and a write that fails."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import pytest
from anyio.abc import TaskGroup
from redis.exceptions import ResponseError

from common.bus import Bus, Entry
from common.messages import Abort
from services.scheduler.commits import CommitQueue

STREAM, GROUP = "test:out", "g"


class HeldWrites:
    """Stands in for bus.write: each write waits until the test lets it through, and the
    records of every write are kept."""

    def __init__(self, bus: Bus) -> None:
        self.bus, self.write = bus, bus.write
        self.writes: list[list[str]] = []
        self.gate = anyio.Event()

    async def __call__(self, records, done=()):
        self.writes.append([fields["rid"] for _, fields in records])
        await self.gate.wait()
        return await self.write(records, done)


@dataclass
class Writer:
    bus: Bus
    held: HeldWrites
    commits: CommitQueue
    tg: TaskGroup


@asynccontextmanager
async def held_writer(redis_url: str, monkeypatch, max_queued: int = 8
                      ) -> AsyncIterator[Writer]:
    """A CommitQueue whose writer runs, each of its writes held until the test allows."""
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        held = HeldWrites(bus)
        monkeypatch.setattr(bus, "write", held)
        commits = CommitQueue(bus, max_queued)
        tg.start_soon(commits.run)
        yield Writer(bus, held, commits, tg)
        tg.cancel_scope.cancel()


def abort(rid: str) -> tuple[str, Abort]:
    return (STREAM, Abort(rid))


async def stream_rids(bus: Bus) -> list[str]:
    return [entry.msg.rid for entry in await bus.tail({STREAM: "0"})]


@pytest.mark.anyio
async def test_commits_queued_during_a_write_leave_together_in_order(redis_url, monkeypatch):
    async with held_writer(redis_url, monkeypatch) as w:
        await w.commits.put([abort("a")])  # the writer takes it at once
        assert w.held.writes == [["a"]]
        await w.commits.put([abort("b")])
        await w.commits.put([abort("c"), abort("d")])
        w.held.gate.set()
        with anyio.fail_after(5):
            await w.commits.flush()
        assert w.held.writes == [["a"], ["b", "c", "d"]]
        assert await stream_rids(w.bus) == ["a", "b", "c", "d"]


@pytest.mark.anyio
async def test_an_entry_is_acknowledged_with_the_commit_that_answers_it(redis_url, monkeypatch):
    async with held_writer(redis_url, monkeypatch) as w:
        await w.bus.ensure_group("test:in", GROUP)
        w.held.gate.set()  # the test's own publish goes through the held write too
        await w.bus.publish_to([("test:in", Abort("x"))])
        read: list[Entry] = await w.bus.read(GROUP, "c", {"test:in": ">"}, count=10)
        w.held.gate = anyio.Event()
        await w.commits.put([abort("answer")], done=read)
        assert (await w.bus.redis.xpending("test:in", GROUP))["pending"] == 1  # not yet
        w.held.gate.set()
        with anyio.fail_after(5):
            await w.commits.flush()
        assert (await w.bus.redis.xpending("test:in", GROUP))["pending"] == 0
        assert await stream_rids(w.bus) == ["answer"]


@pytest.mark.anyio
async def test_put_waits_while_the_queue_is_full(redis_url, monkeypatch):
    async with held_writer(redis_url, monkeypatch, max_queued=2) as w:
        await w.commits.put([abort("a")])  # being written, held
        await w.commits.put([abort("b")])
        await w.commits.put([abort("c")])  # two queued behind the write: full
        third = anyio.Event()

        async def put_third() -> None:
            await w.commits.put([abort("d")])
            third.set()
        w.tg.start_soon(put_third)
        with anyio.move_on_after(0.2):
            await third.wait()
        assert not third.is_set()
        w.held.gate.set()
        with anyio.fail_after(5):
            await third.wait()
            await w.commits.flush()
        assert await stream_rids(w.bus) == ["a", "b", "c", "d"]


@pytest.mark.anyio
async def test_a_write_that_fails_raises_in_the_writer(redis_url):
    async with Bus(redis_url) as bus:
        await bus.redis.set(STREAM, b"not a stream")  # XADD to it is refused
        commits = CommitQueue(bus)
        with pytest.raises(ExceptionGroup) as raised:
            async with anyio.create_task_group() as tg:
                tg.start_soon(commits.run)
                await commits.put([abort("a")])
                with anyio.fail_after(5):
                    await anyio.sleep_forever()
        assert raised.group_contains(ResponseError, match="WRONGTYPE")


@pytest.mark.anyio
async def test_nothing_to_commit_writes_nothing(redis_url, monkeypatch):
    async with held_writer(redis_url, monkeypatch) as w:
        await w.commits.put([], done=[])
        with anyio.fail_after(1):
            await w.commits.flush()
        assert w.held.writes == []
