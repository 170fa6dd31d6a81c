"""How `run_service` sets up a stage's process before its body serves, seen from inside a
real process: the heap of imports frozen out of garbage collection, uvloop, and a short
GIL switch interval; and the heartbeat that keeps a stage's liveness key."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import anyio
import redis
import structlog

from common import service
from common.bus import Bus
from common.service import (ALIVE_TTL_MS, GIL_SWITCH_S, HEARTBEAT_S, TakenForDead, first_leaf,
                            heartbeat)

BODY = """
import asyncio, gc, json, sys
from common.service import run_service

async def body(ctx):
    print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                      "loop": type(asyncio.get_running_loop()).__module__,
                      "switch": sys.getswitchinterval()}))

sys.exit(run_service("probe", sys.argv[1:], body))
"""


def test_a_stage_serves_with_its_setup_heap_frozen_on_uvloop(redis_url):
    done = subprocess.run([sys.executable, "-c", BODY, "some-model", "--redis-url", redis_url],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # the imports (torch-free here, still tens of thousands of objects) are frozen, and
    # collections walk only what was made since
    assert seen["frozen"] > 10_000 and seen["tracked"] < seen["frozen"] / 2
    assert seen["loop"].startswith("uvloop")
    assert seen["switch"] == GIL_SWITCH_S


def test_a_heartbeat_that_finds_its_key_lapsed_takes_the_process_for_dead(redis_url):
    """Another stage that saw the key lapse has ended this process's work: carrying on
    would serve from state no one shares, so the heartbeat raises (the process exits)."""
    async def scenario() -> list[BaseException]:
        raised: list[BaseException] = []
        async with Bus(redis_url) as bus:
            try:
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(heartbeat, bus, "hr:test:alive", "me", anyio.Event())
                    await anyio.sleep(0.1)
                    assert (await bus.values("hr:test:alive")) == [b"me"]
                    await bus.forget("hr:test:alive")  # as if it expired while we slept
                    await anyio.sleep(HEARTBEAT_S * 2)
            except* TakenForDead as group:
                raised += group.exceptions
        return raised
    assert anyio.run(scenario), "the heartbeat went on"


def test_a_heartbeat_outlives_an_event_loop_stall_longer_than_its_ttl(redis_url):
    """A busy gateway's loop stalls for seconds on a loaded host: its key must not lapse
    (the other stages would end its streams) and it must not take itself for dead."""
    async def scenario() -> list[bytes | None]:
        seen: list[bytes | None] = []
        async with Bus(redis_url) as bus, anyio.create_task_group() as tasks:
            stop = anyio.Event()
            tasks.start_soon(heartbeat, bus, "hr:test:stall", "me", stop)
            await anyio.sleep(0.1)
            watcher = redis.Redis.from_url(redis_url)
            started = time.monotonic()
            while time.monotonic() - started < ALIVE_TTL_MS / 1000 + 1.5:
                time.sleep(0.25)  # the loop is blocked; only the beat's thread runs
                seen.append(watcher.get("hr:test:stall"))
            watcher.close()
            await anyio.sleep(HEARTBEAT_S * 1.5)  # the loop looks at the beat again
            seen.append((await bus.values("hr:test:stall"))[0])
            stop.set()
        return seen
    seen = anyio.run(scenario)
    assert seen and all(value == b"me" for value in seen), seen


def refusing_clients(monkeypatch, faults: int | None) -> None:
    """Beats whose SET Redis refuses `faults` times (None: always), as an out-of-memory
    Redis does; a short beat and TTL keep the tests quick."""
    monkeypatch.setattr(service, "HEARTBEAT_S", 0.05)
    monkeypatch.setattr(service, "ALIVE_TTL_MS", 400)
    make, refused = service.blocking_client, [0]  # counted over every lane's client

    def refusing(*args, **kwargs):
        client = make(*args, **kwargs)
        real_set = client.set

        def set_(*a, **kw):
            if faults is None or refused[0] < faults:
                refused[0] += 1
                raise redis.ResponseError("OOM command not allowed when used memory > "
                                          "'maxmemory'")
            return real_set(*a, **kw)
        client.set = set_
        return client
    monkeypatch.setattr(service, "blocking_client", refusing)


def beat_failures(logs: list[dict]) -> list[dict]:
    return [line for line in logs if line["event"] == "heartbeat failed"]


def test_a_heartbeat_logs_an_unexpected_error_and_beats_on(redis_url, monkeypatch):
    """Two refused SETs, well within the key's TTL: each is logged with its exception,
    and the beat goes on holding the key instead of its thread dying in silence."""
    refusing_clients(monkeypatch, faults=2)

    async def scenario() -> bytes | None:
        async with Bus(redis_url) as bus, anyio.create_task_group() as tasks:
            stop = anyio.Event()
            tasks.start_soon(heartbeat, bus, "hr:test:refused", "me", stop)
            await anyio.sleep(0.6)  # past the TTL: only a beat that went on holds the key
            value, = await bus.values("hr:test:refused")
            stop.set()
        return value
    with structlog.testing.capture_logs() as logs:
        assert anyio.run(scenario) == b"me"
    failures = beat_failures(logs)
    assert len(failures) == 2 and failures[0]["log_level"] == "error"
    assert isinstance(failures[0]["exc_info"], redis.ResponseError)


def test_a_heartbeat_refused_for_its_whole_ttl_takes_the_process_for_dead(
        redis_url, monkeypatch):
    """The key has lapsed and the other stages have ended this process's work: it exits
    (TAKEN_FOR_DEAD_EXIT) to be restarted, rather than live on unseen."""
    refusing_clients(monkeypatch, faults=None)

    async def scenario() -> list[BaseException]:
        raised: list[BaseException] = []
        async with Bus(redis_url) as bus:
            with anyio.fail_after(5):
                try:
                    async with anyio.create_task_group() as tasks:
                        tasks.start_soon(heartbeat, bus, "hr:test:refused", "me",
                                         anyio.Event())
                except* TakenForDead as group:
                    raised += group.exceptions
        return raised
    with structlog.testing.capture_logs() as logs:
        raised = anyio.run(scenario)
    assert len(raised) == 1 and "not renewed" in str(raised[0]) and "OOM" in str(raised[0])
    failures = beat_failures(logs)  # each one logged, until the TTL had passed
    assert len(failures) > 1 and failures[-1]["unrenewed_ms"] >= 400 > failures[0]["unrenewed_ms"]


def test_the_exit_line_names_the_reason_inside_nested_task_groups():
    """The worker's task group inside the service's wraps a TakenForDead twice: the log
    line says why the process was taken for dead, not "unhandled errors in a TaskGroup"."""
    nested = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [
        TakenForDead("hr:{s1}:alive:worker was None")])])
    assert str(first_leaf(nested)) == "hr:{s1}:alive:worker was None"
