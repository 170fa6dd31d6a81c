"""`headrace bench bus`: what one hop through the bus costs.

Round trip: this process publishes a request on bench:ping and waits for its echo on
bench:pong; a child process consumes bench:ping through `Bus.consume` (one MULTI/EXEC of
XADD + XACK per entry) and publishes the echo. So one round trip is two hops and the
consume loop's commit, the path every stateless stage takes. With --idle-ms, each round
trip follows that long a pause, as a lone request finds the stages: on a VM, waking a
process (and Redis) whose CPU went idle costs more than the hop's own work.
Publish throughput: batches of step plans of 64 decoding requests, published in one
transaction each, as the scheduler does.

    headrace bench bus [--redis-url URL] [--iterations N] [--idle-ms MS] [--batch N]
                       [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np

from common import messages
from common.bus import Bus
from common.log import configure_logging
from common.messages import CachedRequest, GenerateRequest, StepPlan
from common.redis_server import EmbeddedRedis, spawn_child

PING, PONG, BULK = "bench:ping", "bench:pong", "bench:bulk"
GROUP = "bench"
PLAN_REQUESTS = 64
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class RoundTrip:
    iterations: int
    warmup: int
    idle_ms: float  # the pause before each round trip
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    max_ms: float


@dataclass(frozen=True, slots=True)
class PublishRate:
    batch: int
    batches: int
    message_bytes: int
    messages_per_s: float
    mb_per_s: float


def ping_message(rng: random.Random, i: int) -> GenerateRequest:
    """A chat request of a few hundred bytes, as the gateway sends it."""
    words = " ".join(f"w{rng.randrange(5000)}" for _ in range(40))
    return GenerateRequest(f"chatcmpl-{i:08d}-{rng.getrandbits(64):016x}", "gw-bench",
                           {"temperature": 0.7, "max_tokens": 256},
                           messages=[{"role": "user", "content": words}],
                           arrival_time=time.time())


def decode_plan(rng: random.Random, step: int) -> StepPlan:
    """A steady-state decode step: 64 running requests, one token each, a few new blocks."""
    req_ids = [f"chatcmpl-{rng.getrandbits(64):016x}-0" for _ in range(PLAN_REQUESTS)]
    return StepPlan(step, req_ids, [1] * PLAN_REQUESTS,
                    [rng.randrange(100, 4000) for _ in req_ids],
                    cached=[CachedRequest(rid, [rng.randrange(20000)]) for rid in req_ids[:4]])


def percentiles(samples_s: list[float], warmup: int, idle_ms: float) -> RoundTrip:
    ms = np.asarray(samples_s) * 1000
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return RoundTrip(len(ms), warmup, idle_ms, float(p50), float(p90), float(p99),
                     float(ms.mean()), float(ms.max()))


async def measure_round_trips(bus: Bus, echo: subprocess.Popen[bytes], iterations: int,
                              warmup: int, idle_ms: float = 0.0) -> RoundTrip:
    rng = random.Random(0)
    last_id: bytes | str = "0"
    samples = []
    for i in range(warmup + iterations):
        msg = ping_message(rng, i)
        if idle_ms:
            await anyio.sleep(idle_ms / 1000)
        start = time.perf_counter()
        await bus.publish(PING, msg)
        entries = await bus.tail({PONG: last_id}, count=1, block_ms=10_000)
        elapsed = time.perf_counter() - start
        if not entries:
            raise RuntimeError(f"no echo within 10 s (echo process exit code: {echo.poll()})")
        if entries[0].msg.rid != msg.rid:
            raise RuntimeError(f"echo out of order: sent {msg.rid}, got {entries[0].msg.rid}")
        last_id = entries[0].id
        if i >= warmup:
            samples.append(elapsed)
    return percentiles(samples, warmup, idle_ms)


async def measure_publish_rate(bus: Bus, batch: int, batches: int) -> PublishRate:
    rng = random.Random(1)
    plans = [decode_plan(rng, step) for step in range(batch)]
    await bus.publish(BULK, *plans)  # warm-up
    start = time.perf_counter()
    for _ in range(batches):
        await bus.publish(BULK, *plans)
    elapsed = time.perf_counter() - start
    size = int(np.mean([len(messages.encode(p)) for p in plans]))
    rate = batch * batches / elapsed
    return PublishRate(batch, batches, size, rate, rate * size / 1e6)


def start_echo(url: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HEADRACE_LOG_LEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return spawn_child([sys.executable, "-m", "services.cli", "bench", "bus", "--echo", url],
                       env=env)


def stop_echo(echo: subprocess.Popen[bytes]) -> None:
    echo.terminate()
    try:
        echo.wait(10)
    except subprocess.TimeoutExpired:
        echo.kill()
        echo.wait()


async def run_bench(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with Bus(url) as bus:
        await bus.redis.delete(PING, PONG, BULK)
        await bus.ensure_group(PING, GROUP)
        echo = start_echo(url)
        try:
            round_trip = await measure_round_trips(bus, echo, args.iterations, args.warmup,
                                                   args.idle_ms)
        finally:
            stop_echo(echo)
        publish = await measure_publish_rate(bus, args.batch, args.batches)
        info = await bus.redis.info("server")
        await bus.redis.delete(PING, PONG, BULK)
    return {"machine": machine(info, url), "round_trip": asdict(round_trip),
            "publish": asdict(publish)}


async def echo_forever(url: str) -> None:
    """The child: consume bench:ping, publish each message to bench:pong, until SIGTERM."""
    stop = anyio.Event()

    async def echo(msg: Any) -> list[tuple[str, Any]]:
        return [(PONG, msg)]

    async def stop_on_signal() -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for _ in signals:
                stop.set()
                return

    async with Bus(url) as bus, anyio.create_task_group() as tasks:
        tasks.start_soon(stop_on_signal)
        await bus.consume(PING, GROUP, "echo", echo, stop=stop)
        tasks.cancel_scope.cancel()


def machine(redis_info: dict[str, Any], url: str) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "redis_version": redis_info.get("redis_version"),
        "redis_transport": "unix socket" if url.startswith("unix:") else "tcp",
    }


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def format_report(report: dict[str, Any]) -> str:
    m, rt, pub = report["machine"], report["round_trip"], report["publish"]
    return "\n".join([
        f"machine: {m['cpu']} x{m['cores']}, Python {m['python']}, "
        f"redis {m['redis_version']} over {m['redis_transport']}",
        "",
        f"round trip (publish -> consume -> publish -> read), {rt['iterations']} iterations "
        f"after {rt['warmup']} warm-up, each after {rt['idle_ms']:g} ms idle:",
        f"  p50   {rt['p50_ms']:8.3f} ms",
        f"  p90   {rt['p90_ms']:8.3f} ms",
        f"  p99   {rt['p99_ms']:8.3f} ms",
        f"  mean  {rt['mean_ms']:8.3f} ms",
        f"  max   {rt['max_ms']:8.3f} ms",
        "",
        f"publish, batches of {pub['batch']} step plans of {PLAN_REQUESTS} requests "
        f"({pub['message_bytes']} bytes each), {pub['batches']} batches:",
        f"  {pub['messages_per_s']:12,.0f} messages/s",
        f"  {pub['mb_per_s']:12,.1f} MB/s",
    ])


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="headrace bench bus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="Redis to measure (default: an embedded one on a unix socket)")
    parser.add_argument("--iterations", type=int, default=2000, help="timed round trips")
    parser.add_argument("--warmup", type=int, default=200, help="untimed round trips first")
    parser.add_argument("--idle-ms", type=float, default=0.0,
                        help="pause before each round trip, as a lone request finds the "
                             "stages (default 0: back to back)")
    parser.add_argument("--batch", type=int, default=100, help="messages per publish")
    parser.add_argument("--batches", type=int, default=200, help="timed publishes")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--echo", metavar="URL", help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)
    for name in ("iterations", "batch", "batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be non-negative, got {args.warmup}")
    if not 0 <= args.idle_ms <= 10_000:
        parser.error(f"--idle-ms must be in [0, 10000], got {args.idle_ms}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.echo:
        configure_logging("bench-echo")
        anyio.run(echo_forever, args.echo)
        return 0
    configure_logging("bench", level="WARNING")
    with tempfile.TemporaryDirectory(prefix="headrace-bench-") as run_dir:
        if args.redis_url:
            report = anyio.run(run_bench, args.redis_url, args)
        else:
            with EmbeddedRedis(run_dir) as server:
                report = anyio.run(run_bench, server.url, args)
    report["command"] = "headrace bench bus " + " ".join(argv)
    print(format_report(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
