"""One writer for a whole process: whatever its coroutines publish during one turn of the
event loop leaves in one Redis round trip, on one connection, however many requests are in
flight. A caller waits until its entries are written (or the write failed for good)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from typing import Any

from common.bus import Bus, Output, Record, encode_outputs
from common.log import get_logger

MAX_BATCH = 4096  # records per round trip; the rest go in the next one

log = get_logger(__name__)


class Outbox:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._waiting: deque[tuple[list[Record], asyncio.Future[None]]] = deque()
        self._wake = asyncio.Event()

    async def publish(self, stream: str, *msgs: Any) -> None:
        await self.publish_to([(stream, msg) for msg in msgs])

    async def publish_to(self, outputs: Sequence[Output]) -> None:
        """Queue the entries (encoded here, so a bad message fails its own caller) and
        wait for the writer to commit them."""
        done = asyncio.get_running_loop().create_future()
        self._waiting.append((encode_outputs(outputs), done))
        self._wake.set()
        await done

    async def run(self) -> None:
        """The writer: wakes on the first queued entry, sends everything queued by then."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch = self._take()
            if self._waiting:
                self._wake.set()
            try:
                await self.bus.write([r for records, _ in batch for r in records], [])
            except Exception as e:  # the callers hear of it; the writer goes on
                log.error("publishing failed", entries=len(batch), error=str(e))
                _settle(batch, e)
            else:
                _settle(batch, None)

    def _take(self) -> list[tuple[list[Record], asyncio.Future[None]]]:
        batch, size = [], 0
        while self._waiting and (not batch or size + len(self._waiting[0][0]) <= MAX_BATCH):
            batch.append(self._waiting.popleft())
            size += len(batch[-1][0])
        return batch


def _settle(batch: list[tuple[list[Record], asyncio.Future[None]]],
            error: Exception | None) -> None:
    for _, done in batch:
        if done.done():  # its caller was cancelled (client gone)
            continue
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
