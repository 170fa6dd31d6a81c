"""Pauses that hold up every request a process serves, logged as they happen: a garbage
collection or an event-loop iteration that ran long. The served p99 gap between tokens is
made of such pauses (benchmarks/README.md, issue 11), and a histogram cannot say which
process paused or why."""

from __future__ import annotations

import gc
import sys
import time

import anyio

from common.log import get_logger

SLOW_COLLECTION_S = 0.02
LOOP_TICK_S = 0.01
SLOW_LOOP_S = 0.05

log = get_logger("headrace.stalls")


def watch_collections(slow_s: float = SLOW_COLLECTION_S) -> None:
    """Log every garbage collection of this process that takes longer than `slow_s`."""
    started = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > slow_s:
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
            log.warning("event loop stalled", ms=round(1000 * late, 1))
