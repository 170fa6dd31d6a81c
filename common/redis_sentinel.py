"""The bus on one Redis master watched by Sentinel:
`--redis-url redis[s]+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]`.

The hosts are sentinels; SERVICE is the name they monitor the master under (`sentinel
monitor SERVICE ...`), and the credentials are the master's (and its replicas'). Sentinels
that want a password of their own (their `requirepass`, or an ACL user) get it from the
query options `sentinel_password` and `sentinel_username`. `rediss+sentinel://` speaks TLS
to the sentinels and to the master alike, with the ssl_* query options of rediss://
(common/redis_url_options.py). A connection asks the
sentinels for the master's address when it opens, so after a failover (the master killed,
or SENTINEL FAILOVER) the next connection finds the promoted replica: a call on the old
master fails as unreachable (or READONLY, once it is demoted) and the bus's retries
reconnect. As with a restart, writes the old master had acknowledged but not yet passed
to its replica are lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
import redis.asyncio as aioredis
import redis.retry
import redis.sentinel
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, RedisError

from common.redis_url_options import credentials, host_ports, query_options, tls_options

SCHEMES = ("redis+sentinel", "rediss+sentinel")
SHAPE = ("redis[s]+sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]/SERVICE[/DB]"
         "[?sentinel_username=...&sentinel_password=...&ssl_...=...]")
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")
SENTINEL_TIMEOUT_S = 2.0  # a sentinel that does not answer this soon is tried again
SENTINEL_RETRIES = 3  # then skipped


@dataclass(frozen=True, slots=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    tls: dict[str, Any] = field(default_factory=dict)  # redis-py's ssl arguments, or {}
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @property
    def credentials(self) -> dict[str, Any]:
        """The master's connection arguments."""
        return {"db": self.db, "username": self.username, "password": self.password,
                **self.tls}

    def sentinel_kwargs(self, retry: type[redis.retry.Retry | AsyncRetry]) -> dict[str, Any]:
        """A sentinel's connection arguments, for a client with this Retry class. A
        sentinel that refuses connections is skipped at once: redis-py's own retries wait
        between tries (back-off of 1 s and up), which made every connection wait 3.5 s
        behind one. The tries stay: a TLS handshake on a loaded host can outlast the
        timeout once, and a lookup that finds no sentinel fails the connection."""
        auth = {"username": self.sentinel_username, "password": self.sentinel_password}
        return {"socket_timeout": SENTINEL_TIMEOUT_S,
                "socket_connect_timeout": SENTINEL_TIMEOUT_S,
                "retry": retry(NoBackoff(), SENTINEL_RETRIES),
                **self.tls, **{k: v for k, v in auth.items() if v is not None}}


def is_sentinel_url(url: str) -> bool:
    return url.startswith(tuple(f"{scheme}://" for scheme in SCHEMES))


def sentinel_target(url: str) -> SentinelTarget:
    """What the URL names; a ValueError says what is wrong (without the password)."""
    parts = urlsplit(url)
    path = [p for p in parts.path.split("/") if p]
    if parts.scheme not in SCHEMES or not 1 <= len(path) <= 2 or (
            len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"a Sentinel URL is {SHAPE}")
    query = query_options(parts, SENTINEL_OPTIONS)
    return SentinelTarget(host_ports(parts, SHAPE), unquote(path[0]),
                          int(path[1]) if len(path) == 2 else 0, **credentials(parts),
                          tls=tls_options(parts, query),
                          sentinel_username=query.get("sentinel_username") or None,
                          sentinel_password=query.get("sentinel_password"))


class _BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Connections to whichever node the sentinels name master, and, like the bus's pool
    on a plain server, a caller waits for a free one instead of failing."""


def sentinel_pool(url: str, max_connections: int, timeout_s: float,
                  options: dict[str, Any]) -> SentinelConnectionPool:
    target = sentinel_target(url)
    manager = Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs(AsyncRetry))
    return _BlockingSentinelPool(target.service, manager, max_connections=max_connections,
                                 timeout=timeout_s, **target.credentials, **options)


def sentinel_client(url: str) -> aioredis.Redis:
    target = sentinel_target(url)
    return Sentinel(target.sentinels,
                    sentinel_kwargs=target.sentinel_kwargs(AsyncRetry)).master_for(
        target.service, **target.credentials)


def blocking_sentinel_client(url: str, options: dict[str, Any]) -> redis.Redis:
    target = sentinel_target(url)
    manager = redis.sentinel.Sentinel(target.sentinels,
                                      sentinel_kwargs=target.sentinel_kwargs(redis.retry.Retry))
    return manager.master_for(target.service, **target.credentials, **options)


def sentinel_refusal(url: str) -> RedisError | None:
    """What the sentinels answered when each that answers refused the URL's sentinel
    credentials, else None. redis-py skips a sentinel it cannot log in to as one that is
    down, so without this a wrong sentinel_password would look like an outage forever."""
    target = sentinel_target(url)
    refusal = None
    for host, port in target.sentinels:
        client = redis.Redis(host, port, **target.sentinel_kwargs(redis.retry.Retry))
        try:
            client.ping()
            return None
        except (AuthenticationError, NoPermissionError) as e:
            refusal = e
        except RedisError:
            continue  # down: another may answer
        finally:
            client.close()
    return refusal
