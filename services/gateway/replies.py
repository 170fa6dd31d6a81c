"""The gateway's reply stream, hr:replies:<gateway id>: one XREAD loop (no group, only this
gateway reads it) routes every text delta and error to the inbox of the call waiting for
its request id. Replies for requests no call waits for any more (aborted, or tokens
already in flight when a request finished) are dropped."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

import anyio
from redis.exceptions import RedisError

from common import keys
from common.bus import Backoff, Bus
from common.log import get_logger
from common.messages import ErrorReply, ReplyBatch, TextDelta

Reply = TextDelta | ErrorReply
Inbox = asyncio.Queue[Reply]

READ_COUNT = 256
BLOCK_MS = 1000

log = get_logger(__name__)


class Replies:
    def __init__(self, bus: Bus, gateway_id: str) -> None:
        self.bus = bus
        self.stream = keys.replies(gateway_id)
        self.inboxes: dict[str, Inbox] = {}
        self.last_id: bytes | str = "0-0"  # the stream is this gateway's: read it all

    def open(self, rids: Iterable[str]) -> Inbox:
        inbox: Inbox = asyncio.Queue()
        for rid in rids:
            self.inboxes[rid] = inbox
        return inbox

    def close(self, rids: Iterable[str]) -> None:
        for rid in rids:
            self.inboxes.pop(rid, None)

    def fail_all(self, error_for: Callable[[str], ErrorReply]) -> None:
        """End every call in flight with the error `error_for(rid)`."""
        for rid, inbox in self.inboxes.items():
            inbox.put_nowait(error_for(rid))

    def route(self, msg: object) -> None:
        if isinstance(msg, ReplyBatch):
            replies: list[Reply] = list(msg.items)
        elif isinstance(msg, ErrorReply):
            replies = [msg]
        else:
            log.warning("unexpected message on the reply stream", type=getattr(msg, "TYPE", "?"))
            return
        for reply in replies:
            inbox = self.inboxes.get(reply.rid)
            if inbox is not None:
                inbox.put_nowait(reply)

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


async def next_replies(inbox: Inbox) -> list[Reply]:
    """Wait for one reply, then take every other one already there."""
    replies = [await inbox.get()]
    while not inbox.empty():
        replies.append(inbox.get_nowait())
    return replies
