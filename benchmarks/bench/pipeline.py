"""The serving path as local processes: the services behind the gateway (or with it, so
that HTTP clients can drive it), and a client that drives them from the bus the way a
gateway does. Benchmarks use it to measure what the process hops and HTTP cost; tests use
it to check the services against the in-process engine."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import anyio
from redis.exceptions import RedisError

from common import keys
from common.bus import Bus
from common.config import EngineConfig, ServerConfig
from common.messages import ErrorReply, GenerateRequest, ReplyBatch, Routed
from common.net import free_port
from common.redis_server import EmbeddedRedis, spawn_child
from services.gateway import Choice
from services.launcher import child_specs, fresh_metrics_dir, sized_stages

CLIENT = "bench-client"


@dataclass(slots=True)
class Outcome:
    choices: dict[int, Choice] = field(default_factory=dict)
    error: ErrorReply | None = None
    finished_at: float = 0.0

    def done(self, n: int) -> bool:
        return self.error is not None or (
            len(self.choices) == n and all(c.finished for c in self.choices.values()))


During = Callable[[Bus, dict[str, Outcome]], Awaitable[None]]


def absorb(outcomes: dict[str, Outcome], msg: object) -> None:
    """Apply one reply; replies to other runs on the same stream, and the shard a request
    was routed to (Routed), are ignored."""
    if isinstance(msg, ErrorReply):
        if msg.rid in outcomes:
            outcomes[msg.rid].error = msg
        return
    if isinstance(msg, Routed):
        return
    assert isinstance(msg, ReplyBatch)
    for delta in msg.items:
        if delta.rid in outcomes:
            choices = outcomes[delta.rid].choices
            choices.setdefault(delta.index, Choice(delta.index)).offer(delta)


async def drive(url: str, requests: list[GenerateRequest], timeout: float = 600.0,
                during: During | None = None) -> dict[str, Outcome]:
    """Publish the requests (reply_to must be CLIENT) and collect every reply."""
    outcomes = {r.rid: Outcome() for r in requests}
    remaining = {r.rid: r.params.get("n", 1) for r in requests}
    async with Bus(url) as bus:
        last = (await bus.redis.xrevrange(keys.replies(CLIENT), count=1) or [(b"0",)])[0][0]
        await bus.publish(keys.REQUESTS, *requests)
        with anyio.fail_after(timeout):
            while remaining:
                try:
                    entries = await bus.tail({keys.replies(CLIENT): last}, count=1000,
                                             block_ms=100)
                except RedisError:  # Redis restarts or fails over: read again, as a gateway
                    entries = []
                    await anyio.sleep(0.1)
                for entry in entries:
                    last = entry.id
                    absorb(outcomes, entry.msg)
                now = time.monotonic()
                for rid in [r for r, n in remaining.items() if outcomes[r].done(n)]:
                    outcomes[rid].finished_at = now
                    del remaining[rid]
                if during is not None:
                    await during(bus, outcomes)
    return outcomes


class LocalPipeline:
    """Worker, scheduler, tokenizers and detokenizers as child processes, logging into
    `root`, on the Redis at `redis_url` or else an embedded one; with `gateway`, also the
    gateways (every child `headrace serve` runs), listening on a free port of 127.0.0.1
    (`http_url`)."""

    def __init__(self, root: Path, engine: EngineConfig, server: ServerConfig,
                 gateway: bool = False, redis_url: str | None = None) -> None:
        self.root = root
        self.gateway = gateway
        self.shards = engine.data_parallel_size
        # the stage counts not given, from the cores, as `serve` sizes them
        server = sized_stages(server, self.shards)
        if gateway:
            server = dataclasses.replace(server, host="127.0.0.1", port=free_port())
        self.http_url = f"http://{server.host}:{server.port}"
        self.redis: EmbeddedRedis | None = None
        if redis_url is None:
            self.redis = EmbeddedRedis(root / "run")
            self.redis.start()
            redis_url = self.redis.url
        self.url = redis_url
        specs = child_specs(engine, server, self.url, fresh_metrics_dir(root / "run"))
        self.children = {c.label: c for c in specs if gateway or c.name != "gateway"}
        for label in self.children:
            self.start(label)

    def start(self, label: str) -> None:
        child = self.children[label]
        log = open(self.root / f"{label}.log", "ab")
        child.process = spawn_child(child.argv, env=child.env, stdout=log, stderr=log)

    def kill(self, label: str) -> None:
        process = self.children[label].process
        assert process is not None
        process.send_signal(signal.SIGKILL)
        process.wait()

    async def wait_ready(self, timeout: float = 600.0) -> None:
        """Until every shard's worker and scheduler are alive and, with the gateway,
        /health says 200 (which it does once the gateway sees a shard alive)."""
        shards = range(self.shards)
        alive = [*map(keys.alive_worker, shards), *map(keys.alive_scheduler, shards)]
        with anyio.fail_after(timeout):
            async with Bus(self.url) as bus:
                while None in await bus.values(*alive):
                    self._check_alive()
                    await anyio.sleep(0.2)
            if self.gateway:
                async with aiohttp.ClientSession() as session:
                    while not await _healthy(session, self.http_url + "/health"):
                        self._check_alive()
                        await anyio.sleep(0.2)

    def stop(self) -> None:
        """SIGTERM to every child, then wait for each to exit (SIGKILL after 20 s), so
        that the worker's device memory is free when this returns."""
        processes = [c.process for c in self.children.values() if c.process is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.redis is not None:
            self.redis.stop()

    def loop_times(self) -> dict[str, float | int]:
        """The worker's and scheduler's loop clocks (common/timing.py), as each logged them
        when it stopped: `worker.submit_s`, `scheduler.update_s`, ... (after stop())."""
        times: dict[str, float | int] = {}
        for path in sorted(self.root.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                event = record.get("event", "") if isinstance(record, dict) else ""
                if event in ("worker loop times", "scheduler loop times"):
                    service = event.split()[0]
                    times |= {f"{service}.{k}": v for k, v in record.items()
                              if k == "loops" or k.endswith("_s")}
        return times

    def _check_alive(self) -> None:
        for label, child in self.children.items():
            if child.process is not None and child.process.poll() is not None:
                raise RuntimeError(f"{label} exited with {child.process.returncode}; see "
                                   f"{self.root / (label + '.log')}")


async def _healthy(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


