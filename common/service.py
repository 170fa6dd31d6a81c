"""What every service process shares: its command line, logging, the bus, its heartbeat
and a clean stop on SIGINT/SIGTERM. A service is `run_service(name, argv, body)` where
`body` is the async shell around its core."""

from __future__ import annotations

import argparse
import gc
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import redis
import redis.cluster

from common.bus import UNAVAILABLE, Bus
from common.config import (EngineConfig, ServerConfig, add_engine_args, add_server_args,
                           parse_configs)
from common.log import configure_logging, get_logger
from common.model_support import REFUSED_EXIT, UnsupportedModel, refusal_line
from common.redis_cluster import blocking_client
from common.redis_urls import RedisRefused, check_credentials, redacted
from common.stalls import report_stalls, watch_collections, watch_loop

HEARTBEAT_S = 1.0
ALIVE_TTL_MS = 4000
BEAT_LANES = 3  # see Beat
TAKEN_FOR_DEAD_EXIT = 3
LOAD_FAILED_EXIT = 4  # the launcher stops restarting a worker after a few of these in a row
REDIS_REFUSED_EXIT = 5  # Redis rejected the process's credentials (or its ACL user's rights)
GIL_SWITCH_S = 0.0005  # measured on the H100: one chat's ITL p50 1.76 ms at 5 ms, 1.63 at this


@dataclass(slots=True)
class ServiceContext:
    name: str
    replica: str
    engine: EngineConfig
    server: ServerConfig
    bus: Bus
    stop: anyio.Event

    @property
    def consumer(self) -> str:
        """Stable across restarts of one replica, so a restarted process re-reads the
        entries it left pending."""
        return f"{self.name}-{self.replica}"


Body = Callable[[ServiceContext], Awaitable[None]]
Check = Callable[[EngineConfig], object]


def service_parser(name: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"headrace {name}", description=description)
    parser.add_argument("--replica", default=None,
                        help="replica id, unique per process of a service (default: "
                             "hostname-pid)")
    add_engine_args(parser, positional_model=True)
    add_server_args(parser)
    return parser


def bus_url(server: ServerConfig) -> str:
    """--redis-url, else REDIS_URL, else the socket of the launcher's embedded Redis."""
    return (server.redis_url or os.environ.get("REDIS_URL")
            or f"unix://{Path(server.run_dir).resolve() / 'redis.sock'}")


def run_service(name: str, argv: list[str], body: Body, description: str = "",
                check: Check | None = None) -> int:
    """`check` vets the engine config before anything starts: an UnsupportedModel it
    raises ends the process with one line and REFUSED_EXIT."""
    args, engine, server = parse_configs(service_parser(name, description), argv)
    if check is not None:
        try:
            check(engine)
        except UnsupportedModel as e:
            print(refusal_line(e), file=sys.stderr)
            return REFUSED_EXIT
    try:  # before logging starts: wrong credentials end the process with this one line
        check_credentials(bus_url(server))
    except RedisRefused as e:
        print(f"headrace {name}: {e}", file=sys.stderr)
        return REDIS_REFUSED_EXIT
    replica = args.replica or f"{socket.gethostname()}-{os.getpid()}"
    configure_logging(name, replica)
    freeze_heap()
    watch_collections()
    # A thread that wants the GIL waits up to this long for a busy one to yield it (5 ms
    # by default): the worker's step thread would wait that long behind its Redis loop.
    sys.setswitchinterval(GIL_SWITCH_S)
    # uvloop: every stage is a loop of small socket reads and writes, and the Redis hops'
    # share of each token's latency is mostly the event loop's own overhead
    code = 0
    try:
        anyio.run(_serve, name, replica, engine, server, body,
                  backend_options={"use_uvloop": True})
    except* TakenForDead as group:
        get_logger("headrace.process").error("taken for dead by the other stages; exiting "
                                             "to be restarted", reason=str(first_leaf(group)))
        code = TAKEN_FOR_DEAD_EXIT
    except* ModelLoadFailed as group:
        get_logger("headrace.process").error("cannot load the model; exiting",
                                             reason=str(first_leaf(group)))
        code = LOAD_FAILED_EXIT
    return code


def first_leaf(group: BaseExceptionGroup) -> BaseException:
    """The first exception in a group that task groups nested (the worker's own task group
    inside the service's): its message, not "unhandled errors in a TaskGroup"."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


def freeze_heap() -> None:
    """Exempt every object alive now (the imported libraries, a loaded model or tokenizer)
    from garbage collection for good. Each full collection would otherwise walk them all:
    on the H100 that made every process pause 200-350 ms a dozen times in a 1000-request
    run, the whole of the served p99 gap between tokens. Called once the process is set
    up, before it serves."""
    gc.collect()
    gc.freeze()
    get_logger("headrace.process").info("heap frozen", frozen=gc.get_freeze_count(),
                                        tracked=len(gc.get_objects()),
                                        modules=len(sys.modules))


async def _serve(name: str, replica: str, engine: EngineConfig, server: ServerConfig,
                 body: Body) -> None:
    log = get_logger("headrace.process")
    async with Bus(bus_url(server), maxlen=server.stream_maxlen,
                   name=f"{name}-{replica}") as bus:
        ctx = ServiceContext(name, replica, engine, server, bus, anyio.Event())
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, ctx.stop)
            tg.start_soon(watch_loop)
            tg.start_soon(report_stalls, bus, f"{name}-{replica}")
            log.info("service starting", redis=redacted(bus.url))
            await body(ctx)
            tg.cancel_scope.cancel()
    log.info("service stopped")


async def _stop_on_signal(stop: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            stop.set()
            return


class TakenForDead(Exception):
    """This process's liveness key lapsed while it lived (it was stopped or stalled, or
    Redis lost the key), so the other stages ended its work."""


class ModelLoadFailed(Exception):
    """The worker could not load the model; the message is the cause's one line."""


class Beat:
    """Renews a liveness key from threads of its own over connections of their own, so the
    key outlives event-loop stalls (a gateway with thousands of streams on a loaded 2-core
    host stalls for seconds) and lapses only when the whole process stops or dies. `taken`
    names the value found where this process's own was expected, or the error that kept
    the key from being renewed for its whole TTL.

    BEAT_LANES lanes, each a thread with a TCP connection, take turns a period apart
    divided among them: on a lossy link a segment lost twice holds its connection through
    two retransmission timeouts (a SET took 5.7 s at 10% loss and 200 ms each way, on a 4 s
    TTL), and the key lapses only when every lane's connection stalls at once. Two lanes
    did so in the long suite's lossy-link hosts test (2026-11-29: a scheduler's key lapsed
    and the healthy host's gateway ended a request queued on it); three need one more
    stall at the same time."""

    def __init__(self, url: str, key: str, value: str, name: str | None) -> None:
        # A SET that a lost segment delays still renews the key if it lands within the
        # TTL; giving up sooner only adds a new connection's handshake on the same link.
        timeout_s = ALIVE_TTL_MS / 1000 - HEARTBEAT_S
        clients = [blocking_client(url, name, timeout_s) for _ in range(BEAT_LANES)]
        self.key, self.value = key, value
        self.stopping = threading.Event()
        self.taken: str | None = None
        self.held = False  # some lane has set the key: from then on it holds our value
        self.renewed = time.monotonic()  # the key's last renewal (or the beat's start)
        self.lanes = [threading.Thread(target=self.run, args=(client, n / BEAT_LANES),
                                       name=f"heartbeat {key} {n}", daemon=True)
                      for n, client in enumerate(clients)]

    def start(self) -> None:
        for lane in self.lanes:
            lane.start()

    def stop(self) -> None:
        self.stopping.set()
        for lane in self.lanes:
            lane.join()

    def run(self, client: redis.Redis | redis.cluster.RedisCluster, phase: float) -> None:
        """One lane: a SET begun every HEARTBEAT_S from `phase` of a period on, the next at
        once after one that was slow or failed."""
        try:
            if self.stopping.wait(phase * HEARTBEAT_S):
                return
            while self.taken is None:
                began = time.monotonic()
                try:
                    before = client.set(self.key, self.value, px=ALIVE_TTL_MS, get=True)
                except UNAVAILABLE as e:  # the same classes in redis-py's blocking client
                    self._missed(e)  # Redis restarting, or a slow link: another lane may land
                except Exception as e:  # a thread dead of it would let the key lapse unsaid
                    self._failed(e)
                else:
                    if self.held and before != self.value.encode():
                        self.taken = f"{self.key} was {before!r}, not this process's " \
                                     f"{self.value!r}"
                    self._renewed()
                if self.stopping.wait(max(0.0, began + HEARTBEAT_S - time.monotonic())):
                    return
        finally:
            client.close()

    def _renewed(self) -> None:
        """A renewal, and a warning where the key came within half its TTL of lapsing: a
        slow link or a stalled Redis shows in the log before the other stages see a gap."""
        now = time.monotonic()
        if (unrenewed_ms := (now - self.renewed) * 1000) > ALIVE_TTL_MS / 2:
            get_logger("headrace.process").warning("heartbeat late", key=self.key,
                                                   unrenewed_ms=round(unrenewed_ms))
        self.held, self.renewed = True, max(self.renewed, now)

    def _missed(self, error: Exception) -> None:
        get_logger("headrace.process").warning(
            "heartbeat missed", key=self.key, error=f"{type(error).__name__}: {error}",
            unrenewed_ms=round((time.monotonic() - self.renewed) * 1000))

    def _failed(self, error: Exception) -> None:
        """An error the beat does not expect (Redis refusing the SET: out of memory, a
        read-only replica, an ACL change; or a bug) is logged, and the beat tries again
        on its own period while the key may still live: a slower retry would let a short
        fault lapse it. Once the key has gone unrenewed for its whole TTL, the other stages
        have written this process off, so it ends as taken for dead, to be restarted."""
        unrenewed_ms = (time.monotonic() - self.renewed) * 1000
        get_logger("headrace.process").error("heartbeat failed", key=self.key,
                                             unrenewed_ms=round(unrenewed_ms), exc_info=error)
        if unrenewed_ms >= ALIVE_TTL_MS:
            self.taken = (f"{self.key} not renewed for {unrenewed_ms:.0f} ms: "
                          f"{type(error).__name__}: {error}")


async def heartbeat(bus: Bus, key: str, value: str, stop: anyio.Event) -> None:
    """Keep `key` alive while this process is; it expires ALIVE_TTL_MS after a crash.

    Finding the key lapsed or taken by another process raises TakenForDead: the process
    exits to be restarted afresh, since what it holds (a KV cache, running requests) was
    already written off by the others and cannot be trusted to match theirs. With the
    beat in threads, that happens only when the process was stopped (SIGSTOP, a frozen
    VM), Redis lost the key or refused to renew it for a whole TTL (Beat._failed), never
    because its event loop was late."""
    beat = Beat(bus.url, key, value, bus.name)
    beat.start()
    try:
        while not stop.is_set() and beat.taken is None:
            with anyio.move_on_after(HEARTBEAT_S):
                await stop.wait()
        if beat.taken is not None:
            raise TakenForDead(beat.taken)
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(beat.stop)
            try:
                await bus.forget(key)
            except UNAVAILABLE:
                pass
