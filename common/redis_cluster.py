"""The bus on a Redis Cluster: `--redis-url redis+cluster://HOST:PORT[,HOST:PORT...]`, or
with TLS and an ACL user `rediss+cluster://USER:PASSWORD@HOST:PORT,...?ssl_ca_certs=...`
(common/redis_url_options.py: the same options as rediss://, for every node).

Any of the listed nodes is enough to start; the client learns the others from it. A key
lives in one hash slot, served by one master, and a transaction may only touch keys of one
slot. The names in common/keys.py put all of one shard's keys in one slot (`hr:{s0}:...`),
so a scheduler reads its admissions, control messages and results in one XREADGROUP, and a
worker commits its results with their acknowledgements atomically.

A stage whose outputs go to other slots than its inputs (a tokenizer: `hr:requests` in,
`hr:{s0}:admit` out) cannot commit both in one transaction. Its write becomes one
transaction per slot, the acknowledgements last: a crash between them leaves the inputs
pending, and they are handled again. The bus is at-least-once there instead of exactly once,
and the receivers drop what they have seen: the scheduler a request id it has admitted
lately, the gateway a text delta whose `seq` it has passed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis
import redis.cluster
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import (AskError, AuthenticationError, ClusterDownError,
                              NoPermissionError, RedisClusterException, TryAgainError)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from common.redis_lanes import Command, Lanes
from common.redis_sentinel import (blocking_sentinel_client, is_sentinel_url,
                                   sentinel_client)
from common.redis_url_options import credentials, host_ports, query_options, tls_options

SCHEMES = ("redis+cluster", "rediss+cluster")
SHAPE = "redis[s]+cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...][?ssl_...=...]"
_REDIRECTED = (AskError, ClusterDownError, TryAgainError)  # MovedError is an AskError
_REFUSED = (AuthenticationError, NoPermissionError)


class ClusterUnsettled(RedisConnectionError):
    """A slot's master is failing over or moving; retry after a pause."""


class ClusterUnreachable(RedisConnectionError):
    """No node of the cluster answers: this host is cut off from all of them."""


NO_NODE = "Redis Cluster cannot be connected"  # redis-py's words for that


@contextmanager
def unreachable_as_connection_error() -> Iterator[None]:
    """redis-py raises a RedisClusterException, which is no RedisError, when no node
    answers its slot-map query (a host whose link is down): make it a connection error,
    which the bus, the heartbeat threads and every `except RedisError` already retry or
    report. Other RedisClusterExceptions (a node not in cluster mode) stay as they are,
    and so does one whose nodes answered with a refusal of the credentials: no retry
    mends those (common/redis_urls.py reports them)."""
    try:
        yield
    except RedisClusterException as e:
        if str(e).startswith(NO_NODE) and not isinstance(e.__cause__, _REFUSED):
            raise ClusterUnreachable(str(e)) from e
        raise


class _Cluster(RedisCluster):
    """The async client reads the slot map in `initialize`, which every command and
    pipeline goes through first, and again after a node is lost."""

    async def initialize(self, *args: Any, **kwargs: Any) -> RedisCluster:
        with unreachable_as_connection_error():
            return await super().initialize(*args, **kwargs)


class _BlockingCluster(redis.cluster.RedisCluster):
    """The blocking client reads the slot map when it is made and within a command."""

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        with unreachable_as_connection_error():
            return super().execute_command(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class ClusterTarget:
    nodes: list[tuple[str, int]]
    options: dict[str, Any]  # the ACL user and TLS, the same for every node


def is_cluster_url(url: str) -> bool:
    return url.startswith(tuple(f"{scheme}://" for scheme in SCHEMES))


def cluster_target(url: str) -> ClusterTarget:
    """What `redis[s]+cluster://[USER:PASSWORD@]HOST:PORT,...[?ssl_...]` names; a
    ValueError says what is wrong (without the password)."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES or parts.path.strip("/"):
        raise ValueError(f"a cluster URL is {SHAPE}")
    options = tls_options(parts, query_options(parts)) | {
        k: v for k, v in credentials(parts).items() if v is not None}
    return ClusterTarget(host_ports(parts, SHAPE), options)


def cluster_addresses(url: str) -> list[tuple[str, int]]:
    """The (host, port) of each node the URL names."""
    return cluster_target(url).nodes


def startup_nodes(url: str) -> list[ClusterNode]:
    return [ClusterNode(host, port) for host, port in cluster_addresses(url)]


def cluster_client(url: str, max_connections: int, options: dict[str, Any]) -> RedisCluster:
    """A redis-py cluster client for the bus's less frequent calls; `max_connections` is
    per node."""
    return _Cluster(startup_nodes=startup_nodes(url), max_connections=max_connections,
                    **cluster_target(url).options, **options)


def plain_client(url: str) -> aioredis.Redis | RedisCluster:
    """A redis-py client of a server or of a cluster, for tools that inspect it."""
    if is_cluster_url(url):
        return RedisCluster(startup_nodes=startup_nodes(url), **cluster_target(url).options)
    if is_sentinel_url(url):
        return sentinel_client(url)
    return aioredis.from_url(url)


def blocking_client(url: str, name: str | None,
                    timeout_s: float) -> redis.Redis | redis.cluster.RedisCluster:
    """A blocking redis-py client of a server or of a cluster, for a thread of its own.
    A command fails after `timeout_s`, once: redis-py's own default would retry it ten
    times with backoff (a timed-out SET took 15 s with a 1 s timeout), hidden from the
    caller, whose retries keep to a schedule of their own (a heartbeat's TTL)."""
    options: dict[str, Any] = dict(client_name=name, socket_timeout=timeout_s,
                                   socket_connect_timeout=timeout_s,
                                   retry=Retry(NoBackoff(), 0))
    if is_cluster_url(url):
        nodes = [redis.cluster.ClusterNode(host, port) for host, port in cluster_addresses(url)]
        with unreachable_as_connection_error():
            return _BlockingCluster(startup_nodes=nodes, **cluster_target(url).options,
                                    **options)
    if is_sentinel_url(url):
        return blocking_sentinel_client(url, options)
    return redis.Redis.from_url(url, **options)


async def used_memory(client: aioredis.Redis | RedisCluster) -> int:
    """The bytes Redis holds: on a cluster, the sum over its masters."""
    if isinstance(client, RedisCluster):
        infos = await client.info("memory", target_nodes=RedisCluster.PRIMARIES)
        return sum(int(info["used_memory"]) for info in infos.values())
    return int((await client.info("memory"))["used_memory"])


def command_keys(command: Command) -> Sequence[str | bytes | int]:
    """The keys of the bus's raw commands: XADD, XACK (the first argument) and
    XREAD / XREADGROUP (the first half of what follows STREAMS)."""
    name = str(command[0]).upper()
    if name in ("XREAD", "XREADGROUP"):
        streams = list(command[[str(a).upper() for a in command].index("STREAMS") + 1:])
        return streams[:len(streams) // 2]
    return command[1:2]


def slot_of(command: Command) -> int:
    slots = {key_slot(_bytes(key)) for key in command_keys(command)}
    if len(slots) != 1:
        raise ValueError(f"{command[0]} over keys of {len(slots)} hash slots; on a Redis "
                         "Cluster one read takes streams of one slot (one shard's {sN} tag)")
    return slots.pop()


class ClusterLanes:
    """`Lanes` to each master, picked by the hash slot of a call's keys. Like `Lanes`,
    `call` sends its commands in one write and `transact` runs them all or nothing, but
    only within one slot: see the module's note."""

    def __init__(self, client: RedisCluster, per_node: int) -> None:
        self.client = client
        self.per_node = per_node
        self._lanes: dict[str, Lanes] = {}
        self._refresh = False

    async def call(self, commands: Sequence[Command], timeout_s: float) -> list[Any]:
        slots = {slot_of(command) for command in commands}
        if len(slots) != 1:
            raise ValueError(f"one call over {len(slots)} hash slots")
        return await self._on_slot(slots.pop(), commands, timeout_s, transact=False)

    async def transact(self, commands: Sequence[Command], timeout_s: float) -> list[Any]:
        by_slot: dict[int, list[int]] = {}
        for i, command in enumerate(commands):
            by_slot.setdefault(slot_of(command), []).append(i)
        # acknowledgements last: an entry is acked only once its outputs are all in
        order = sorted(by_slot.items(),
                       key=lambda item: any(commands[i][0] == "XACK" for i in item[1]))
        replies: list[Any] = [None] * len(commands)
        for slot, indices in order:
            done = await self._on_slot(slot, [commands[i] for i in indices], timeout_s,
                                       transact=True)
            for i, reply in zip(indices, done):
                replies[i] = reply
        return replies

    async def close(self) -> None:
        for lanes in self._lanes.values():
            await lanes.close()

    async def _on_slot(self, slot: int, commands: Sequence[Command], timeout_s: float, *,
                       transact: bool) -> list[Any]:
        """Send to the slot's master; after a redirection (a slot moved, a failover) read
        the slot map again and retry once. Still redirected, the cluster is between two
        maps (a failover under way): that is an outage the caller's retries wait out."""
        try:
            return await self._send(slot, commands, timeout_s, transact)
        except _REDIRECTED:
            self._refresh = True
        try:
            return await self._send(slot, commands, timeout_s, transact)
        except _REDIRECTED as e:
            self._refresh = True
            raise ClusterUnsettled(f"hash slot {slot}: {e}") from e

    async def _send(self, slot: int, commands: Sequence[Command], timeout_s: float,
                    transact: bool) -> list[Any]:
        lanes = await self._lanes_of(slot)
        try:
            if transact:
                return await lanes.transact(commands, timeout_s)
            return await lanes.call(commands, timeout_s)
        except (RedisConnectionError, RedisTimeoutError):
            self._refresh = True  # the node may be gone; the bus's retry comes back here
            raise

    async def _lanes_of(self, slot: int) -> Lanes:
        await self.client.initialize()  # reads the slot map once
        if self._refresh:
            with unreachable_as_connection_error():
                await self.client.nodes_manager.initialize()
            self._refresh = False
        node = self.client.nodes_manager.get_node_from_slot(slot)
        if node.name not in self._lanes:
            self._lanes[node.name] = Lanes(node.connection_class, node.connection_kwargs,
                                           self.per_node)
        return self._lanes[node.name]


def _bytes(key: str | bytes | int) -> bytes:
    return key if isinstance(key, bytes) else str(key).encode()
