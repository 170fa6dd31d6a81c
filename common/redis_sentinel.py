"""The bus on one Redis master watched by Sentinel:
`--redis-url redis+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`.

The hosts are sentinels; SERVICE is the name they monitor the master under (`sentinel
monitor SERVICE ...`), and the credentials are the master's. A connection asks the
sentinels for the master's address when it opens, so after a failover (the master killed,
or SENTINEL FAILOVER) the next connection finds the promoted replica: a call on the old
master fails as unreachable (or READONLY, once it is demoted) and the bus's retries
reconnect. As with a restart, writes the old master had acknowledged but not yet passed
to its replica are lost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
import redis.sentinel
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

SCHEME = "redis+sentinel"
SENTINEL_TIMEOUT_S = 2.0  # a sentinel that does not answer this soon is skipped


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def credentials(self) -> dict[str, Any]:
        return {"db": self.db, "username": self.username, "password": self.password}


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def sentinel_target(url: str) -> SentinelTarget:
    parts = urlsplit(url)
    shape = f"{SCHEME}://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
    path = [p for p in parts.path.split("/") if p]
    if parts.scheme != SCHEME or parts.query or not 1 <= len(path) <= 2 or (
            len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"a Sentinel URL is {shape}, got {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    sentinels = []
    for address in hosts.split(","):
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"sentinel {address!r} is not HOST:PORT in {shape}")
        sentinels.append((host, int(port)))
    user, colon, secret = userinfo.partition(":")
    return SentinelTarget(sentinels, unquote(path[0]), int(path[1]) if len(path) == 2 else 0,
                          unquote(user) or None, unquote(secret) if colon else None)


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Connections to whichever node the sentinels name master, and, like the bus's pool
    on a plain server, a caller waits for a free one instead of failing."""


def sentinel_pool(url: str, max_connections: int, timeout_s: float,
                  options: dict[str, Any]) -> SentinelConnectionPool:
    target = sentinel_target(url)
    manager = Sentinel(target.sentinels, sentinel_kwargs={
        "socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S})
    return _BlockingSentinelPool(target.service, manager, max_connections=max_connections,
                                 timeout=timeout_s, **target.credentials, **options)


def sentinel_client(url: str) -> aioredis.Redis:
    target = sentinel_target(url)
    return Sentinel(target.sentinels).master_for(target.service, **target.credentials)


def blocking_sentinel_client(url: str, options: dict[str, Any]) -> redis.Redis:
    target = sentinel_target(url)
    manager = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs={
        "socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S})
    return manager.master_for(target.service, **target.credentials, **options)
