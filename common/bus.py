"""The Redis Streams bus that links the services.

Every entry carries plain fields beside its MessagePack body, so `redis-cli XRANGE
hr:requests - + COUNT 5` is readable (common/keys.py names every stream and key): `type`, `rid` or `n` (and `step`), `ts`, `body`.

Two ways to consume:
* `consume(...)`: the loop for stateless stages. The handler maps one message to its
  outputs; a read batch's outputs and the XACKs of its inputs go in one MULTI/EXEC, so a
  stage killed between the two neither loses nor duplicates anything (on a Redis Cluster,
  one per hash slot: common/redis_cluster.py says what that changes). Failures are retried, then
  moved to `hr:dead`; entries left pending by a dead consumer are claimed (XAUTOCLAIM),
  and at once where its process had named its connections after it and none is left.
* `read(...)` / `tail(...)` + `commit(...)`: for stateful consumers (scheduler, worker,
  gateway) that read several streams and batch their work.
* `set_alive` / `values` / `store` / `load`: the little shared state beside the streams
  (liveness keys, the running worker's announcement, the scheduler's stats).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import anyio
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ClusterDownError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys, messages
from common.log import get_logger
from common.redis_cluster import ClusterLanes, RedisCluster, cluster_client, is_cluster_url
from common.redis_lanes import Command, Lanes
from common.redis_sentinel import is_sentinel_url, sentinel_pool
from common.redis_urls import redacted

# A Redis Cluster between two slot maps (a master failing over) answers CLUSTERDOWN or
# TRYAGAIN for a second or two: an outage like an unreachable server, retried the same way.
UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, ClusterDownError, TryAgainError)
LAG_COUNT_LIMIT = 10_000
MAX_CONNECTIONS = 16
LANES = 4  # of MAX_CONNECTIONS, held for the hot calls (common/redis_lanes.py)
ORPHAN_CHECK_S = 0.5  # how often a consumer looks for dead consumers' pending entries

Output = tuple[str, Any]
Record = tuple[str, Mapping[str, str | bytes]]  # (stream, entry fields), ready for XADD
Handler = Callable[[Any], Awaitable[Sequence[Output] | None]]
# what a stage sends when it gives up on a message (its requests' errors), given the reason
GiveUp = Callable[[Any, str], Sequence[Output]]

log = get_logger(__name__)

# Redis < 7 does not report a group's lag: count the undelivered entries in pages, up to a
# limit, inside Redis so no entry crosses the wire.
_COUNT_AFTER = """
local n, start, limit = 0, '(' .. ARGV[1], tonumber(ARGV[2])
while true do
  local page = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', 1000)
  n = n + #page
  if #page < 1000 or n >= limit then return math.min(n, limit) end
  start = '(' .. page[#page][1]
end
"""


class BusUnavailable(RedisConnectionError):
    """Redis stayed unreachable for longer than the bus's retry time."""


@dataclass(frozen=True, slots=True)
class Entry:
    """One stream entry: `msg` is the decoded message; `group` is None for a plain read."""
    stream: str
    id: bytes
    fields: dict[bytes, bytes]
    msg: Any
    group: str | None = None


def entry_fields(msg: Any) -> dict[str, str | bytes]:
    return {**messages.plain_fields(msg), "ts": f"{time.time():.6f}",
            "body": messages.encode(msg)}


def encode_outputs(outputs: Sequence[Output]) -> list[Record]:
    return [(stream, entry_fields(msg)) for stream, msg in outputs]


def decode_entry(stream: str, entry_id: bytes, fields: dict[bytes, bytes],
                 group: str | None = None) -> Entry:
    if not fields:
        raise messages.MessageError("entry was trimmed before it was processed")
    if b"body" not in fields:
        raise messages.MessageError("entry has no body field")
    return Entry(stream, entry_id, fields, messages.decode(fields[b"body"]), group)


@dataclass(frozen=True, slots=True)
class Claim:
    entries: list[Entry]
    cursor: str  # where the next page starts; "0-0" when the pending list was walked
    trimmed: bool  # Redis 6.2 claims trimmed entries without their ids: re-read pending


@dataclass(slots=True)
class Backoff:
    first_s: float = 0.05
    max_s: float = 2.0
    delay_s: float = 0.0

    def next(self) -> float:
        self.delay_s = min(max(self.first_s, 2 * self.delay_s), self.max_s)
        return self.delay_s

    def reset(self) -> None:
        self.delay_s = 0.0


@dataclass(frozen=True, slots=True)
class ConsumerInfo:
    name: str
    pending: int
    idle_ms: int


@dataclass(frozen=True, slots=True)
class GroupInfo:
    name: str
    pending: int
    lag: int | None  # entries not yet delivered; counted up to LAG_COUNT_LIMIT on Redis < 7
    last_delivered_id: str
    consumers: list[ConsumerInfo] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StreamInfo:
    name: str
    length: int
    groups: list[GroupInfo] = field(default_factory=list)
    last_id: str = "0-0"  # of the last entry ever added; its first part is when, in ms


class Bus:
    """One Redis client and the stream operations of every service. `retry_timeout_s`
    bounds how long publish and commit keep retrying while Redis is unreachable."""

    def __init__(self, url: str, maxlen: int = 100_000, *, retry_timeout_s: float = 30.0,
                 max_backoff_s: float = 2.0, socket_timeout_s: float = 30.0,
                 max_connections: int = MAX_CONNECTIONS, name: str | None = None) -> None:
        if maxlen < 1:
            raise ValueError(f"maxlen must be positive, got {maxlen}")
        self.url = url
        self.name = name
        self.maxlen = maxlen
        self.retry_timeout_s = retry_timeout_s
        self.max_backoff_s = max_backoff_s
        self.socket_timeout_s = socket_timeout_s
        # Retries are ours (bounded in time, logged); redis-py's would hide an outage.
        tcp = {} if url.startswith("unix:") else {"socket_keepalive": True}
        if max_connections <= LANES:
            raise ValueError(f"max_connections must exceed the {LANES} lanes, "
                             f"got {max_connections}")
        options: dict[str, Any] = dict(
            decode_responses=False, retry=Retry(NoBackoff(), 0), client_name=name,
            socket_timeout=socket_timeout_s, socket_connect_timeout=5.0, **tcp)
        self.redis: aioredis.Redis | RedisCluster
        self.lanes: Lanes | ClusterLanes
        if is_cluster_url(url):
            self.redis = cluster_client(url, max_connections - LANES, options)
            self.lanes = ClusterLanes(self.redis, LANES)
        else:
            # Bounded pools that make a caller wait for a free connection: however many
            # requests a process serves, it holds at most `max_connections` (named in
            # CLIENT LIST), and a busy pool slows callers down instead of failing them.
            pool = (sentinel_pool(url, max_connections - LANES, socket_timeout_s, options)
                    if is_sentinel_url(url) else aioredis.BlockingConnectionPool.from_url(
                        url, max_connections=max_connections - LANES,
                        timeout=socket_timeout_s, **options))
            self.redis = aioredis.Redis.from_pool(pool)
            self.lanes = Lanes(pool.connection_class, pool.connection_kwargs, LANES)
        self._count_after = self.redis.register_script(_COUNT_AFTER)

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, value: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def close(self) -> None:
        await self.lanes.close()
        await self.redis.aclose()

    # --- writing ----------------------------------------------------------------------

    async def publish(self, stream: str, *msgs: Any) -> list[bytes]:
        return await self.publish_to([(stream, msg) for msg in msgs])

    async def publish_to(self, outputs: Sequence[Output]) -> list[bytes]:
        """XADD each (stream, message) in one transaction; returns the entry ids."""
        return await self.commit(outputs)

    async def commit(self, outputs: Sequence[Output], done: Sequence[Entry] = ()) -> list[bytes]:
        """Publish `outputs` and acknowledge `done` in one MULTI/EXEC, retrying while Redis
        is unreachable."""
        return await self.write(encode_outputs(outputs), done)

    async def ack(self, done: Sequence[Entry]) -> None:
        await self.write([], done)

    async def bury(self, dead: Sequence[tuple[Entry, str]],
                   answers: Sequence[Output] = ()) -> None:
        """Copy entries to hr:dead with the reason, and acknowledge those read in a group,
        with `answers` (the errors that end their requests) in the same transaction."""
        records = [(keys.DEAD, _dead_fields(entry, reason)) for entry, reason in dead]
        records += encode_outputs(answers)
        await self.write(records, [entry for entry, _ in dead if entry.group is not None])
        for entry, reason in dead:
            log.error("moved entry to the dead stream", stream=entry.stream,
                      id=entry.id.decode(), group=entry.group, reason=reason)

    async def write(self, records: Sequence[Record], done: Sequence[Entry]) -> list[bytes]:
        """`commit` for outputs already encoded."""
        if not records and not done:
            return []

        commands: list[Command] = [self._xadd(stream, fields) for stream, fields in records]
        commands += [("XACK", stream, group, *ids)
                     for (stream, group), ids in _ids_by_group(done).items()]

        async def attempt() -> list[bytes]:
            # all or nothing: a crash never acks what it did not publish
            replies = await self.lanes.transact(commands, self.socket_timeout_s)
            return replies[:len(records)]
        return await self._retrying("write", attempt)

    def _xadd(self, stream: str, fields: Mapping[str, str | bytes]) -> Command:
        command: list[str | bytes | int] = ["XADD", stream, "MAXLEN", "~", self.maxlen, "*"]
        for name, value in fields.items():
            command += (name, value)
        return command

    async def _retrying(self, what: str, operation: Callable[[], Awaitable[Any]]) -> Any:
        deadline = time.monotonic() + self.retry_timeout_s
        backoff = Backoff(max_s=self.max_backoff_s)
        while True:
            try:
                return await operation()
            except UNAVAILABLE as e:
                delay = backoff.next()
                if time.monotonic() + delay > deadline:
                    raise BusUnavailable(f"{what}: Redis at {redacted(self.url)} unreachable for "
                                         f"{self.retry_timeout_s}s: {e}") from e
                log.warning("redis unreachable, retrying", op=what, error=str(e),
                            retry_in_s=delay)
                await anyio.sleep(delay)

    # --- shared state ------------------------------------------------------------------

    async def set_alive(self, key: str, token: str, ttl_ms: int) -> bytes | None:
        """`key` holds `token` for `ttl_ms`: a heartbeat renews it, a crash lets it lapse.
        Returns what the key held before (None: it had lapsed, or never was)."""
        return await self.redis.set(key, token, px=ttl_ms, get=True)

    async def values(self, *names: str) -> list[bytes | None]:
        """The values of plain keys, None for a missing one (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(name)
            return list(await pipe.execute())

    async def store_blobs(self, blobs: Mapping[str, bytes], ttl_s: float) -> None:
        """Set each key to its bytes for `ttl_s` (one round trip)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for name, data in blobs.items():
                pipe.set(name, data, px=int(ttl_s * 1000))
            await pipe.execute()

    async def renew(self, names: Sequence[str], ttl_s: float) -> list[str]:
        """Give each key `ttl_s` more to live (one round trip); returns those that were
        gone."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.pexpire(name, int(ttl_s * 1000))
            found = await pipe.execute()
        return [name for name, ok in zip(names, found) if not ok]

    async def set_hash(self, key: str, fields: Mapping[str, str], ttl_ms: int) -> None:
        """Set `fields` of hash `key`; Redis drops it unless set again within `ttl_ms`."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping=dict(fields))
            pipe.pexpire(key, ttl_ms)
            await pipe.execute()

    async def hashes(self, match: str) -> dict[str, dict[str, str]]:
        """Every hash whose name matches `match`, with its fields (a SCAN, then HGETALLs)."""
        found: dict[str, dict[str, str]] = {}
        async for name in self.redis.scan_iter(match=match, _type="hash"):
            fields = await self.redis.hgetall(name)
            if fields:  # it lapsed between SCAN and HGETALL
                found[_text(name)] = {_text(k): _text(v) for k, v in fields.items()}
        return found

    async def store(self, key: str, msg: Any, ttl_s: float | None = None) -> None:
        """Set `key` to `msg`; with `ttl_s`, Redis drops it unless stored again by then."""
        await self.redis.set(key, messages.encode(msg),
                             px=None if ttl_s is None else int(ttl_s * 1000))

    async def load(self, key: str) -> Any | None:
        """The message stored at `key`; None if there is none or it does not decode."""
        return decode_value(key, (await self.values(key))[0])

    async def hash_items(self, key: str) -> dict[str, bytes]:
        return {field.decode(): value
                for field, value in (await self.redis.hgetall(key)).items()}

    async def hash_value(self, key: str, field: str) -> bytes | None:
        return await self.redis.hget(key, field)

    async def hash_set(self, key: str, field: str, value: str, only_new: bool = False) -> bool:
        """Set a hash field; with `only_new`, only where it is missing. True if it was set."""
        if only_new:
            return bool(await self.redis.hsetnx(key, field, value))
        await self.redis.hset(key, field, value)
        return True

    async def hash_delete(self, key: str, field: str) -> bool:
        """True if the field was there."""
        return bool(await self.redis.hdel(key, field))

    async def increment(self, key: str) -> int:
        return int(await self.redis.incr(key))

    async def forget(self, *names: str) -> None:
        """Delete keys or streams."""
        await self.redis.delete(*names)

    async def trim_before(self, stream: str, entry_id: bytes | str) -> None:
        """Drop a stream's entries older than `entry_id` (approximately, as Redis can)."""
        await self.redis.xtrim(stream, minid=entry_id, approximate=True)

    # --- reading ----------------------------------------------------------------------

    async def ensure_group(self, stream: str, group: str, start_id: str = "0") -> None:
        try:
            await self.redis.xgroup_create(stream, group, id=start_id, mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def read(self, group: str, consumer: str, streams: Mapping[str, str | bytes], *,
                   count: int | None = None, block_ms: int | None = None) -> list[Entry]:
        """XREADGROUP over several streams: id ">" for new entries, "0" for this
        consumer's pending ones. Groups that went missing are created again; entries that
        do not decode go to hr:dead and are not returned."""
        command = ("XREADGROUP", "GROUP", group, consumer)
        try:
            reply = await self._xread(command, streams, count, block_ms)
        except ResponseError as e:
            if not str(e).startswith("NOGROUP"):
                raise
            log.warning("consumer group missing, creating it", group=group,
                        streams=list(streams))
            for stream in streams:
                await self.ensure_group(stream, group)
            reply = await self._xread(command, streams, count, block_ms)
        return await self._decode_all(_flatten(reply), group)

    async def tail(self, streams: Mapping[str, str | bytes], *, count: int | None = None,
                   block_ms: int | None = None) -> list[Entry]:
        """XREAD without a group, for a stream only one process reads (a gateway's
        replies): pass the last id seen per stream, or "$" for what comes next."""
        reply = await self._xread(("XREAD",), streams, count, block_ms)
        return await self._decode_all(_flatten(reply), None)

    async def _xread(self, command: Command, streams: Mapping[str, str | bytes],
                     count: int | None, block_ms: int | None) -> Any:
        full = [*command, *(("COUNT", count) if count is not None else ()),
                *(("BLOCK", block_ms) if block_ms is not None else ()),
                "STREAMS", *streams.keys(), *streams.values()]
        timeout_s = self.socket_timeout_s + (block_ms or 0) / 1000
        return (await self.lanes.call([full], timeout_s))[0]

    async def claim_idle(self, stream: str, group: str, consumer: str, min_idle_ms: int,
                         count: int = 100, cursor: bytes | str = "0-0") -> Claim:
        """One page of XAUTOCLAIM: up to `count` entries of `group` idle longer than
        `min_idle_ms`, from `cursor` on; pass the returned cursor to go on ("0-0": done)."""
        cursor, items, *_ = await self.redis.xautoclaim(
            stream, group, consumer, min_idle_ms, start_id=cursor, count=count)
        raw = [(stream, entry_id, fields) for entry_id, fields in items if entry_id]
        trimmed = any(entry_id is None for entry_id, _ in items)
        return Claim(await self._decode_all(raw, group), _text(cursor), trimmed)

    async def orphaned(self, stream: str, group: str) -> list[str]:
        """The consumers of `group` that hold pending entries while no connection to Redis
        carries their name: their process died (a service names its connections after its
        consumer). None on a Redis Cluster, whose connections spread over its nodes."""
        if isinstance(self.redis, RedisCluster):
            return []
        summary = await self.redis.xpending(stream, group)
        holders = [_text(c["name"]) for c in summary["consumers"] or () if int(c["pending"])]
        if not holders:
            return []
        connected = {client.get("name") for client in await self.redis.client_list()}
        return [name for name in holders if name not in connected]

    async def claim_from(self, stream: str, group: str, consumer: str, orphan: str,
                         count: int) -> Claim:
        """Up to `count` of the entries `orphan` holds, claimed for `consumer` however
        short their idle time (XCLAIM)."""
        rows = await self.redis.xpending_range(stream, group, "-", "+", count,
                                               consumername=orphan)
        if not rows:
            return Claim([], "0-0", False)
        items = await self.redis.xclaim(stream, group, consumer, 0,
                                        [row["message_id"] for row in rows])
        raw = [(stream, entry_id, fields) for entry_id, fields in items if fields]
        return Claim(await self._decode_all(raw, group), "0-0", len(raw) < len(items))

    async def delivery_counts(self, stream: str, group: str,
                              ids: Sequence[bytes]) -> dict[bytes, int]:
        """How many times each pending entry has been delivered (XPENDING)."""
        if not ids:
            return {}
        async with self.redis.pipeline(transaction=False) as pipe:
            for entry_id in ids:
                pipe.xpending_range(stream, group, min=entry_id, max=entry_id, count=1)
            replies = await pipe.execute()
        return {row["message_id"]: row["times_delivered"] for rows in replies for row in rows}

    async def _decode_all(self, raw: Iterable[tuple[str, bytes, dict[bytes, bytes]]],
                          group: str | None) -> list[Entry]:
        entries, dead = [], []
        for stream, entry_id, fields in raw:
            try:
                entries.append(decode_entry(stream, entry_id, fields, group))
            except messages.MessageError as e:
                dead.append((Entry(stream, entry_id, fields, None, group), str(e)))
        if dead:
            await self.bury(dead, [answer for entry, reason in dead
                                   if (answer := unreadable_request(entry, reason))])
        return entries

    # --- the consumer loop ------------------------------------------------------------

    async def consume(self, stream: str, group: str, consumer: str, handler: Handler, *,
                      count: int = 16, block_ms: int = 1000, stop: anyio.Event | None = None,
                      min_idle_ms: int = 30_000, reclaim_every_s: float = 5.0,
                      max_deliveries: int = 5, on_dead: GiveUp | None = None) -> None:
        """Run `handler` on every entry of `stream` for `group` until `stop` is set.
        An entry moved to hr:dead (its handler failed `max_deliveries` times, or its
        consumers kept dying) sends what `on_dead(msg, reason)` gives: the error that
        ends each request it carried, so that no client waits for an answer never coming.

        `min_idle_ms` must exceed the longest time an entry waits in a live consumer
        (count x handler time), or a slow consumer's entries are claimed by another. When
        the bus's connections carry `consumer` as their name, the entries of a consumer
        with no connection left are claimed within ORPHAN_CHECK_S instead."""
        if block_ms >= self.socket_timeout_s * 1000:
            raise ValueError(f"block_ms ({block_ms}) must be below the socket timeout "
                             f"({self.socket_timeout_s * 1000:.0f} ms)")
        if max_deliveries < 1:
            raise ValueError(f"max_deliveries must be at least 1, got {max_deliveries}")
        loop = _ConsumeLoop(self, stream, group, consumer, handler, count, block_ms,
                            min_idle_ms, reclaim_every_s, max_deliveries, on_dead)
        stop = stop or anyio.Event()
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(loop.interrupt_read_on, stop)
            await loop.run(stop)
            tasks.cancel_scope.cancel()

    # --- introspection ----------------------------------------------------------------

    async def stream_infos(self, match: str = keys.PATTERN) -> list[StreamInfo]:
        """Length, groups (pending, lag, last delivered id) and consumers of each stream."""
        names = sorted({name async for name in self.redis.scan_iter(match=match,
                                                                   _type="stream")})
        infos = []
        for name in names:
            try:
                infos.append(await self._stream_info(name.decode()))
            except ResponseError:
                continue  # deleted between SCAN and XINFO
        return infos

    async def _stream_info(self, name: str) -> StreamInfo:
        stream = await self.redis.xinfo_stream(name)
        groups = [await self._group_info(name, row)
                  for row in await self.redis.xinfo_groups(name)]
        return StreamInfo(name, stream["length"], groups, _text(stream["last-generated-id"]))

    async def _group_info(self, stream: str, row: dict[str, Any]) -> GroupInfo:
        group, last_id = _text(row["name"]), _text(row["last-delivered-id"])
        lag = row.get("lag")
        if lag is None:
            lag = await self._count_after(keys=[stream], args=[last_id, LAG_COUNT_LIMIT])
        consumers = [ConsumerInfo(_text(c["name"]), c["pending"], c["idle"])
                     for c in await self.redis.xinfo_consumers(stream, group)]
        return GroupInfo(group, row["pending"], int(lag), last_id, consumers)


class _ConsumeLoop:
    """The state of one `Bus.consume` call."""

    def __init__(self, bus: Bus, stream: str, group: str, consumer: str, handler: Handler,
                 count: int, block_ms: int, min_idle_ms: int, reclaim_every_s: float,
                 max_deliveries: int, on_dead: GiveUp | None) -> None:
        self.bus, self.stream, self.group, self.consumer = bus, stream, group, consumer
        self.handler, self.on_dead = handler, on_dead
        self.count, self.block_ms = count, block_ms
        self.min_idle_ms, self.reclaim_every_s = min_idle_ms, reclaim_every_s
        self.max_deliveries = max_deliveries
        self.need_group = True
        self.read_pending = True  # on start and after a reconnect: our own pending first
        self.next_reclaim = 0.0
        self.claim_cursor = "0-0"
        # only a consumer that names its connections may judge others by theirs
        self.claims_orphans = bus.name == consumer
        self.next_orphan_check = 0.0
        self.read_scope = anyio.CancelScope()
        self.log = log.bind(stream=stream, group=group, consumer=consumer)

    async def interrupt_read_on(self, stop: anyio.Event) -> None:
        await stop.wait()
        self.read_scope.cancel()

    async def run(self, stop: anyio.Event) -> None:
        backoff = Backoff(max_s=self.bus.max_backoff_s)
        while not stop.is_set():
            try:
                await self._step(stop)
                backoff.reset()
            except UNAVAILABLE as e:
                self.read_pending = True
                delay = backoff.next()
                self.log.warning("redis unreachable, reconnecting", error=str(e),
                                 retry_in_s=delay)
                with anyio.move_on_after(delay):
                    await stop.wait()
            except ResponseError as e:
                if not str(e).startswith("NOGROUP"):
                    raise
                self.log.warning("consumer group missing, creating it")
                self.need_group = self.read_pending = True

    async def _step(self, stop: anyio.Event) -> None:
        if self.need_group:
            await self.bus.ensure_group(self.stream, self.group)
            self.need_group = False
        if time.monotonic() >= self.next_reclaim:
            await self._reclaim()
        if self.claims_orphans and time.monotonic() >= self.next_orphan_check:
            await self._claim_orphans()
        await self._process(await self._read(stop))

    async def _read(self, stop: anyio.Event) -> list[Entry]:
        if self.read_pending:
            self.read_pending = False
            return await self.bus.read(self.group, self.consumer, {self.stream: "0"})
        if stop.is_set():
            return []
        backlog = self.claim_cursor != "0-0"  # claimed pages are waiting: do not block
        with anyio.CancelScope() as self.read_scope:
            return await self.bus.read(self.group, self.consumer, {self.stream: ">"},
                                       count=self.count,
                                       block_ms=None if backlog else self._block_ms())
        return []  # stop was set while blocked

    def _block_ms(self) -> int:
        """Block no later than the next reclaim is due: on a quiet stream a read would
        otherwise hold a dead consumer's entries back for the whole block."""
        due = min(self.next_reclaim, self.next_orphan_check if self.claims_orphans
                  else math.inf)
        until_reclaim_ms = (due - time.monotonic()) * 1000
        return max(1, min(self.block_ms, math.ceil(until_reclaim_ms)))

    async def _reclaim(self) -> None:
        claim = await self.bus.claim_idle(self.stream, self.group, self.consumer,
                                          self.min_idle_ms, self.count, self.claim_cursor)
        # A backlog is claimed a page per step, between new reads, so no claimed entry
        # waits here long enough to look idle to another consumer.
        self.claim_cursor = claim.cursor
        more = claim.cursor != "0-0"
        self.next_reclaim = time.monotonic() + (0 if more else self.reclaim_every_s)
        self.read_pending |= claim.trimmed
        if claim.entries:
            self.log.info("claimed idle entries", n=len(claim.entries))
            await self._process_claimed(claim.entries)

    async def _claim_orphans(self) -> None:
        """Take over what a killed replica held without waiting `min_idle_ms`: its
        restart may take seconds (imports, a tokenizer load) while its clients wait."""
        self.next_orphan_check = time.monotonic() + ORPHAN_CHECK_S
        for orphan in await self.bus.orphaned(self.stream, self.group):
            claim = await self.bus.claim_from(self.stream, self.group, self.consumer,
                                              orphan, self.count)
            self.read_pending |= claim.trimmed
            if claim.entries:
                self.log.info("claimed a dead consumer's entries", dead=orphan,
                              n=len(claim.entries))
                self.next_orphan_check = 0.0  # it may hold more than a page
                await self._process_claimed(claim.entries)

    async def _process_claimed(self, entries: list[Entry]) -> None:
        counts = await self.bus.delivery_counts(self.stream, self.group,
                                                [e.id for e in entries])
        live = []
        for entry in entries:
            delivered = counts.get(entry.id, 0)
            if delivered > self.max_deliveries:
                await self._give_up(entry, f"delivered {delivered} times and never "
                                           "acknowledged (its consumers died?)")
            else:
                live.append(entry)
        await self._process(live)

    async def _process(self, entries: list[Entry]) -> None:
        """Handle a read batch, then commit every output and acknowledgement in one
        transaction: one round trip per batch, and a stage killed before it leaves the
        whole batch pending, to be handled again, never half of it."""
        records: list[Record] = []
        done: list[Entry] = []
        for entry in entries:
            try:
                records += encode_outputs(await self.handler(entry.msg) or ())
            except Exception as e:  # a failing handler must not stop the stage: retry, bury
                await self._failed(entry, e)
                continue
            done.append(entry)
        await self.bus.write(records, done)

    async def _failed(self, entry: Entry, error: Exception) -> None:
        self.log.error("handler failed", id=entry.id.decode(), type=entry.msg.TYPE,
                       exc_info=error)
        delivered = (await self.bus.delivery_counts(
            self.stream, self.group, [entry.id])).get(entry.id, 0)
        if delivered >= self.max_deliveries:
            await self._give_up(entry, f"{type(error).__name__}: {error} "
                                       f"(after {delivered} deliveries)")

    async def _give_up(self, entry: Entry, reason: str) -> None:
        await self.bus.bury([(entry, reason)])
        if self.on_dead is None:
            return
        try:
            await self.bus.publish_to(self.on_dead(entry.msg, reason))
        except Exception as e:  # the entry is in hr:dead either way; the stage goes on
            self.log.error("cannot end the requests of a dead entry", id=entry.id.decode(),
                           exc_info=e)


def unreadable_request(entry: Entry, reason: str) -> Output | None:
    """The error that ends the request of an entry no stage can read (a producer's bug, or
    a version skew between replicas), when its body still says whose request it is."""
    found = messages.requester(entry.fields.get(b"body", b""))
    if found is None:
        return None
    rid, reply_to = found
    stage = entry.group or "reading"
    return (keys.replies(reply_to),
            messages.ErrorReply(rid, 500, f"The {stage} stage could not read this request: "
                                          f"{reason}", "InternalServerError"))


def decode_value(key: str, raw: bytes | None) -> Any | None:
    """A stored message, or None (with a warning when it does not decode)."""
    if raw is None:
        return None
    try:
        return messages.decode(raw)
    except messages.MessageError as e:
        log.warning("unreadable value", key=key, error=str(e))
        return None


def _flatten(reply: Any) -> list[tuple[str, bytes, dict[bytes, bytes]]]:
    """XREAD(GROUP)'s raw reply, [[stream, [[id, [field, value, ...]], ...]], ...] (a map
    of the same in RESP3), as (stream, id, fields) triples; a trimmed entry has no fields."""
    pairs = reply.items() if isinstance(reply, dict) else (reply or [])
    return [(_text(stream), entry_id, dict(zip(flat[::2], flat[1::2])) if flat else {})
            for stream, items in pairs for entry_id, flat in items]


def _ids_by_group(done: Sequence[Entry]) -> dict[tuple[str, str], list[bytes]]:
    ids: dict[tuple[str, str], list[bytes]] = {}
    for entry in done:
        if entry.group is None:
            raise ValueError(f"entry {entry.id!r} of {entry.stream} was not read in a group")
        ids.setdefault((entry.stream, entry.group), []).append(entry.id)
    return ids


def _dead_fields(entry: Entry, reason: str) -> dict[bytes, bytes]:
    ours = {b"stream": entry.stream, b"id": entry.id, b"group": entry.group or "",
            b"reason": reason}
    return {**entry.fields, **{k: v if isinstance(v, bytes) else v.encode()
                               for k, v in ours.items()}}


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
