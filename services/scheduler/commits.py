"""The scheduler's commits, written behind its loop.

A commit (plans, token batches, error replies, with the acknowledgements of the entries
they answer) is a Redis round trip, and on a loaded server the round trip, not the
encoding, is most of it: 3.1 s of a run's 8.8 s of scheduler loop on an H200 host at four
replicas of the detokenizer-bound workload (benchmarks/issue31-h200, sixth session,
lease F), where encoding a token costs about 0.7 us. While the loop waited for those
replies it planned nothing, and the worker waited for plans.

So the loop encodes a commit and queues it here, and goes on to its next read. One writer
sends the commits in the order they were queued: each write carries everything queued
while the one before it was out, in one MULTI/EXEC, so each stream's entries (the steps,
a request's token batches) keep the order they were made in. An entry is still
acknowledged only in the transaction that publishes what answers it: a scheduler that
dies with commits queued leaves those entries pending, and its next incarnation reads
them again. A write that fails for good (Redis gone past the bus's retry time) raises in
the writer, which ends the service as a failed commit in the loop did.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from common.bus import Bus, Entry, Output, Record, encode_outputs

# Commits queued before `put` waits for the writer: a loop that outruns Redis slows down
# to it instead of holding ever more encoded batches.
MAX_QUEUED = 8


class CommitQueue:
    def __init__(self, bus: Bus, max_queued: int = MAX_QUEUED) -> None:
        self.bus = bus
        self.max_queued = max_queued
        self._queued: deque[tuple[list[Record], list[Entry]]] = deque()
        self._wake = asyncio.Event()  # something is queued
        self._room = asyncio.Event()  # the writer took what was queued
        self._idle = asyncio.Event()  # nothing queued or being written
        self._idle.set()

    async def put(self, outputs: Sequence[Output], done: Sequence[Entry] = ()) -> None:
        """Encode and queue a commit, then yield once so that an idle writer sends it
        now, while the caller goes on computing."""
        if not outputs and not done:
            return
        while len(self._queued) >= self.max_queued:
            self._room.clear()
            await self._room.wait()
        self._queued.append((encode_outputs(outputs), list(done)))
        self._idle.clear()
        self._wake.set()
        await asyncio.sleep(0)

    async def flush(self) -> None:
        """Wait until every queued commit is written."""
        await self._idle.wait()

    async def run(self) -> None:
        """The writer: runs until cancelled; a write that fails for good raises."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            records: list[Record] = []
            done: list[Entry] = []
            while self._queued:
                more_records, more_done = self._queued.popleft()
                records += more_records
                done += more_done
            self._room.set()
            await self.bus.write(records, done)
            if not self._queued:
                self._idle.set()
