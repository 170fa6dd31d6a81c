"""Pauses that hold up every request a process serves, logged as they happen: a garbage
collection or an event-loop iteration that ran long. The served p99 gap between tokens is
made of such pauses (benchmarks/README.md, issue 11), and a histogram cannot say which
process paused or why."""

from __future__ import annotations

import gc
import sys
import time
from collections import deque
from dataclasses import dataclass, field

import anyio

from common import keys
from common.bus import UNAVAILABLE, Bus
from common.log import get_logger

SLOW_COLLECTION_S = 0.02
LOOP_TICK_S = 0.01
SLOW_LOOP_S = 0.05
WINDOW_S = 10.0  # what `headrace queues` shows of each process: its stalls this recent
REPORT_S = 2.0

log = get_logger("headrace.stalls")


@dataclass
class Stalls:
    """A process's pauses of the last WINDOW_S, for others to see that it is slow (and
    not gone): the heartbeats run in threads, so a stalled loop no longer shows in them."""
    loop: deque[tuple[float, float]] = field(default_factory=deque)  # (when, seconds late)
    collections: deque[float] = field(default_factory=deque)  # when a slow one ended

    def note_loop(self, late_s: float, now: float) -> None:
        self.loop.append((now, late_s))

    def note_collection(self, now: float) -> None:
        self.collections.append(now)

    def summary(self, now: float) -> dict[str, str]:
        """The fields of the process's hr:health hash: worst loop stall (ms), loop stalls
        and slow collections, all within WINDOW_S of `now`."""
        while self.loop and self.loop[0][0] < now - WINDOW_S:
            self.loop.popleft()
        while self.collections and self.collections[0] < now - WINDOW_S:
            self.collections.popleft()
        worst = max((late for _, late in self.loop), default=0.0)
        return {"worst_stall_ms": f"{1000 * worst:.0f}", "stalls": str(len(self.loop)),
                "slow_collections": str(len(self.collections))}


RECENT = Stalls()


def watch_collections(slow_s: float = SLOW_COLLECTION_S) -> None:
    """Log every garbage collection of this process that takes longer than `slow_s`."""
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > slow_s:
            RECENT.note_collection(time.monotonic())
            # modules imported after the heap was frozen are walked by every collection
            log.warning("slow garbage collection", ms=round(1000 * took, 1),
                        generation=info["generation"], collected=info["collected"],
                        frozen=gc.get_freeze_count(), modules=len(sys.modules))
    gc.callbacks.append(timed)


async def watch_loop(tick_s: float = LOOP_TICK_S, slow_s: float = SLOW_LOOP_S) -> None:
    """Log whenever this event loop comes back to a `tick_s` sleep `slow_s` late: one of
    its callbacks held it that long."""
    while True:
        asked = time.perf_counter()
        await anyio.sleep(tick_s)
        late = time.perf_counter() - asked - tick_s
        if late > slow_s:
            RECENT.note_loop(late, time.monotonic())
            log.warning("event loop stalled", ms=round(1000 * late, 1))


async def report_stalls(bus: Bus, process: str, every_s: float = REPORT_S) -> None:
    """Keep hr:health:<process> at this process's RECENT stalls; it lapses soon after the
    process dies. A report that fails is skipped: the next one says the same."""
    key = keys.health(process)
    while True:
        try:
            await bus.set_hash(key, RECENT.summary(time.monotonic()),
                               ttl_ms=int(3000 * every_s))
        except UNAVAILABLE:
            pass
        await anyio.sleep(every_s)


async def processes_health(bus: Bus) -> dict[str, dict[str, str]]:
    """Every live process's latest report, by process name."""
    return {name.removeprefix(keys.health("")): fields
            for name, fields in (await bus.hashes(keys.HEALTH_PATTERN)).items()}
