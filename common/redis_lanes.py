"""Held Redis connections for the bus's hot calls: XADD, XACK and XREAD(GROUP).

Every hop of a request crosses these calls, so their cost is paid several times per token.
redis-py's client and pipeline wrap each call in layers a hop does not need: a pool check
that the connection is clean (a socket read per call), a task per socket timeout, a
transaction object, response callbacks. On the H100 host they doubled a one-entry hop
(ping-pong of two hops: 538-733 us p50 through the client, 324-333 us here). A lane keeps
redis-py's own connection, command packer and hiredis reply parser, and drops the rest:
commands go out packed in one write, replies are read raw, and one timer bounds the call.

A lane that fails or is cancelled in the middle of a call may hold a half-read reply, so it
is disconnected (and reconnects on its next call) instead of being handed out again.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

from redis.asyncio.connection import AbstractConnection as Connection
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

Command = Sequence[str | bytes | int]


class Lanes:
    """Up to `count` held connections made like the pool's; a caller waits for a free one,
    so a busy process slows down instead of opening more."""

    def __init__(self, connection_class: type[Connection], connection_kwargs: dict[str, Any],
                 count: int) -> None:
        kwargs = {**connection_kwargs, "socket_timeout": None}  # our timer bounds calls
        self._all = [connection_class(**kwargs) for _ in range(count)]
        self._free: asyncio.Queue[Any] = asyncio.Queue()
        for conn in self._all:
            self._free.put_nowait(conn)

    async def call(self, commands: Sequence[Command], timeout_s: float) -> list[Any]:
        """Send `commands` in one write and return their raw replies; an error reply
        raises ResponseError."""
        conn = await self._free.get()
        try:
            async with asyncio.timeout(timeout_s):
                if not conn.is_connected:
                    await conn.connect()
                await conn.send_packed_command(conn.pack_commands(commands),
                                               check_health=False)
                replies = [await conn.read_response(timeout=math.inf) for _ in commands]
        except BaseException as e:
            await conn.disconnect(nowait=True)  # never hand out a half-read reply
            if isinstance(e, TimeoutError):
                raise RedisTimeoutError(f"no reply from Redis in {timeout_s:.1f}s") from e
            raise
        finally:
            self._free.put_nowait(conn)
        for reply in replies:
            _raise_error(reply)
        return replies

    async def transact(self, commands: Sequence[Command], timeout_s: float) -> list[Any]:
        """Run `commands` all or nothing (one MULTI/EXEC) and return their replies."""
        if len(commands) == 1:
            return await self.call(commands, timeout_s)
        return (await self.call([("MULTI",), *commands, ("EXEC",)], timeout_s))[-1]

    async def close(self) -> None:
        for conn in self._all:
            await conn.disconnect(nowait=True)


def _raise_error(reply: Any) -> None:
    """Error replies arrive as exception objects, at the top or inside an EXEC's list."""
    if isinstance(reply, ResponseError):
        raise reply
    if isinstance(reply, list):
        for item in reply:
            if isinstance(item, ResponseError):
                raise item
