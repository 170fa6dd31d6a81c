"""`headrace queues`: every hr:* stream with its length, consumer groups (pending, lag,
last delivered id) and consumers (pending, idle time); the streams every shard shares come
first (SHARD "-"), then each data-parallel shard's, shard by shard. Above them, every live
process with its event-loop stalls of the last few seconds: a slow stage shows as slow
here, where its heartbeat (in a thread) still says alive.

    headrace queues [--redis-url URL] [--run-dir DIR] [--watch [SECONDS]]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from common import keys
from common.bus import LAG_COUNT_LIMIT, UNAVAILABLE, Bus, StreamInfo
from common.log import configure_logging
from common.stalls import processes_health
from common.redis_server import SOCKET_NAME
from common.redis_urls import redacted

COLUMNS = ("SHARD", "STREAM", "LENGTH", "GROUP", "CONSUMER", "PENDING", "LAG", "IDLE", "LAST-DELIVERED")
PROCESS_COLUMNS = ("PROCESS", "WORST-STALL", "STALLS", "SLOW-GC", "STATE")
SLOW_MS = 1000  # a process whose loop stalled this long lately is marked slow (not gone)
CLEAR = "\x1b[H\x1b[2J"


@dataclass(frozen=True, slots=True)
class Snapshot:
    url: str
    taken_at: float
    streams: list[StreamInfo]
    health: dict[str, dict[str, str]] = field(default_factory=dict)  # process -> its stalls


async def take_snapshot(url: str) -> Snapshot:
    async with Bus(url) as bus:
        return Snapshot(url, time.time(), await bus.stream_infos(),
                        await processes_health(bus))


def format_table(snapshot: Snapshot) -> str:
    rows = [list(COLUMNS)]
    for stream in sorted(snapshot.streams, key=_by_shard):
        shard = keys.shard_of(stream.name)
        rows.append(["-" if shard is None else str(shard), stream.name, str(stream.length),
                     "", "", "", "", "", ""])
        for group in stream.groups:
            rows.append(["", "", "", group.name, "", str(group.pending), _lag(group.lag), "",
                         group.last_delivered_id])
            rows += [["", "", "", "", c.name, str(c.pending), "", f"{c.idle_ms / 1000:.1f}s",
                      ""] for c in group.consumers]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.taken_at))
    shards = sorted({s for s in map(keys.shard_of, (s.name for s in snapshot.streams))
                     if s is not None})
    header = (f"{redacted(snapshot.url)}  {when}  {len(snapshot.streams)} streams, "
              f"{len(shards)} shards")
    processes = format_processes(snapshot.health)
    if not snapshot.streams:
        return f"{header}\n{processes}(no hr:* streams yet)"
    return header + "\n" + processes + _aligned(rows)


def format_processes(health: dict[str, dict[str, str]]) -> str:
    """Each live process's event-loop stalls over the last WINDOW_S (common/stalls.py),
    then a blank line; nothing when no process reports."""
    if not health:
        return ""
    rows = [list(PROCESS_COLUMNS)]
    for process, fields in sorted(health.items()):
        worst = int(fields.get("worst_stall_ms", "0"))
        rows.append([process, f"{worst}ms", fields.get("stalls", "?"),
                     fields.get("slow_collections", "?"), "slow" if worst >= SLOW_MS else "ok"])
    return _aligned(rows) + "\n\n"


def _by_shard(stream: StreamInfo) -> tuple[int, str]:
    shard = keys.shard_of(stream.name)
    return (-1 if shard is None else shard, stream.name)


def _lag(lag: int | None) -> str:
    if lag is None:
        return "?"
    return f"{lag}+" if lag >= LAG_COUNT_LIMIT else str(lag)


def _aligned(rows: list[list[str]]) -> str:
    # Every column starts where its header does, so `cut` and scripts can slice it.
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def resolve_url(redis_url: str | None, run_dir: str) -> str:
    url = redis_url or os.environ.get("REDIS_URL")
    return url or f"unix://{Path(run_dir).absolute() / SOCKET_NAME}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="headrace queues", description=__doc__.split("\n\n")[0])
    parser.add_argument("--redis-url", default=None,
                        help="Redis to inspect [env REDIS_URL; default: the embedded one "
                             "in --run-dir]")
    parser.add_argument("--run-dir", default="run",
                        help="run directory of `headrace serve` (its redis.sock)")
    parser.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                        metavar="SECONDS", help="refresh every SECONDS (default 2) until Ctrl-C")
    args = parser.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        parser.error(f"--watch must be positive, got {args.watch}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_logging("queues", level="ERROR")
    url = resolve_url(args.redis_url, args.run_dir)
    try:
        while True:
            table = format_table(anyio.run(take_snapshot, url))
            print((CLEAR if args.watch else "") + table, flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except UNAVAILABLE as e:
        print(f"headrace queues: no Redis answers at {redacted(url)} ({e}); start "
              "`headrace serve`, or pass --redis-url / set REDIS_URL", file=sys.stderr)
        return 1
    except ValueError as e:  # redis-py's word for a malformed URL
        print(f"headrace queues: bad Redis URL {redacted(url)!r}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
