"""The gateway's reply stream, hr:replies:<gateway id>: one XREAD loop (no group, only this
gateway reads it) routes every text delta and error to the inbox of the call waiting for
its request id, with the stamps of the step that made it (the last: when the detokenizer
sent it), and notes the shard each request was routed to. Replies for requests no call waits
for any more (aborted, or tokens already in flight when a request finished) are dropped. The
stages a reply's stamps tell (common/hops.py) are observed here, once per step batch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence

import anyio
from redis.exceptions import RedisError

from common import keys
from common.bus import Backoff, Bus
from common.hops import request_stages, step_stages
from common.log import get_logger
from common.messages import ErrorReply, ReplyBatch, Routed, TextDelta
from services.gateway.metrics import Metrics

Reply = TextDelta | ErrorReply
Delivery = tuple[Reply, Sequence[float]]  # a reply, and its step's stamps (none: unknown)
Inbox = asyncio.Queue[Delivery]

READ_COUNT = 256
BLOCK_MS = 1000

log = get_logger(__name__)


class Replies:
    def __init__(self, bus: Bus, gateway_id: str, metrics: Metrics, num_shards: int = 1
                 ) -> None:
        self.bus, self.metrics, self.num_shards = bus, metrics, num_shards
        self.stream = keys.replies(gateway_id)
        self.inboxes: dict[str, Inbox] = {}
        self.shards: dict[str, int] = {}  # the shard of each open request routed so far
        self.last_id: bytes | str = "0-0"  # the stream is this gateway's: read it all
        self.closed = asyncio.Event()  # set whenever a call closes its inbox

    def open(self, rids: Iterable[str]) -> Inbox:
        inbox: Inbox = asyncio.Queue()
        for rid in rids:
            self.inboxes[rid] = inbox
        return inbox

    def close(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.inboxes.pop(rid, None)
            self.shards.pop(rid, None)
        self.closed.set()

    async def all_closed(self) -> None:
        """Return once no call waits for replies."""
        while self.inboxes:
            self.closed.clear()
            await self.closed.wait()

    def fail_all(self, error_for: Callable[[str], ErrorReply]) -> None:
        """End every call in flight with the error `error_for(rid)`."""
        for rid, inbox in self.inboxes.items():
            inbox.put_nowait((error_for(rid), ()))

    def shards_of(self, rid: str) -> list[int]:
        """Where a request may be: its shard, or any while it is not routed yet."""
        shard = self.shard_of(rid)
        return list(range(self.num_shards)) if shard is None else [shard]

    def shard_of(self, rid: str) -> int | None:
        return 0 if self.num_shards == 1 else self.shards.get(rid)

    def fail_shard(self, shard: int, error_for: Callable[[str], ErrorReply]) -> None:
        """End every call in flight on `shard` with the error `error_for(rid)`."""
        for rid, inbox in self.inboxes.items():
            if self.shard_of(rid) == shard:
                inbox.put_nowait((error_for(rid), ()))

    def route(self, msg: object) -> None:
        if isinstance(msg, ReplyBatch):
            self.metrics.observe_stages(step_stages(msg.stamps))
            for delta in msg.items:
                if delta.request_stamps:
                    self.metrics.observe_stages(request_stages(delta.request_stamps))
                self.deliver(delta, msg.stamps)
        elif isinstance(msg, ErrorReply):
            self.deliver(msg, ())
        elif isinstance(msg, Routed):
            if msg.rid in self.inboxes:
                self.shards[msg.rid] = msg.shard
        else:
            log.warning("unexpected message on the reply stream", type=getattr(msg, "TYPE", "?"))

    def deliver(self, reply: Reply, stamps: Sequence[float]) -> None:
        inbox = self.inboxes.get(reply.rid)
        if inbox is not None:
            inbox.put_nowait((reply, stamps))

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            try:
                entries = await self.bus.tail({self.stream: self.last_id}, count=READ_COUNT,
                                              block_ms=BLOCK_MS)
            except RedisError as e:  # never fatal: every open call waits on this loop
                delay = backoff.next()
                log.warning("cannot read replies, reading again soon", error=str(e),
                            retry_in_s=delay)
                await anyio.sleep(delay)
                continue
            backoff.reset()
            for entry in entries:
                self.last_id = entry.id
                self.route(entry.msg)

    async def trim(self) -> None:
        """Drop the entries already routed."""
        if self.last_id != "0-0":
            await self.bus.trim_before(self.stream, self.last_id)

    async def delete(self) -> None:
        await self.bus.forget(self.stream)


async def next_replies(inbox: Inbox) -> list[Delivery]:
    """Wait for one reply, then take every other one already there."""
    replies = [await inbox.get()]
    while not inbox.empty():
        replies.append(inbox.get_nowait())
    return replies
