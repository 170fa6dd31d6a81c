"""Which data-parallel shard a request goes to (the core; the tokenizer shell feeds it the
shards' published figures and sends the request where it says).

Prefix affinity: the first full KV blocks of the prompt (up to PREFIX_BLOCKS) are hashed,
and the shards are ranked by rendezvous hashing of that key, so requests that share a
system prompt go to the shard where that prefix is cached, and a shard that goes away
moves only its own prefixes. Balance: the preferred shard loses the request to the least
loaded one when it has more than `slack_tokens` (one step's token budget) more prompt
tokens waiting. A prompt shorter than a block has no prefix worth keeping: it goes to the
least loaded shard.

Stale figures: each scheduler publishes its figures every half second. Between two
readings the router adds the prompt tokens it has sent to a shard itself, so a burst does
not all land on the shard that looked idlest; other tokenizer replicas' sends show up at
the next reading, and the slack absorbs them. A shard whose figures have not changed for
STALE_S, or whose scheduler's or worker's liveness key is gone, gets no new requests. With no shard
live at all (the whole backend is starting or restarting), requests go where affinity says
and wait in that shard's admission stream as they would with one shard.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass

from common.messages import SchedulerStats

PREFIX_BLOCKS = 4
STALE_S = 3.0


@dataclass(slots=True)
class ShardLoad:
    waiting_tokens: int = 0
    kv_cache_usage: float = 0.0
    published: float | None = None  # the figures' own time stamp, to tell a new reading
    seen_at: float = -math.inf  # when a new reading last arrived (the router's clock)
    alive: bool = False
    routed_tokens: int = 0  # sent by this router since that reading

    @property
    def tokens(self) -> int:
        return self.waiting_tokens + self.routed_tokens


class Router:
    def __init__(self, num_shards: int, block_size: int, slack_tokens: int,
                 policy: str = "prefix") -> None:
        self.loads = [ShardLoad() for _ in range(num_shards)]
        self.block_size, self.slack_tokens, self.policy = block_size, slack_tokens, policy
        self.turn = 0

    def observe(self, shard: int, alive: bool, stats: SchedulerStats | None,
                now: float) -> None:
        """A reading of one shard: whether its scheduler and worker are alive, and its
        latest figures."""
        load = self.loads[shard]
        load.alive = alive
        if stats is not None and stats.ts != load.published:
            load.waiting_tokens, load.kv_cache_usage = stats.waiting_tokens, stats.kv_cache_usage
            load.published, load.seen_at, load.routed_tokens = stats.ts, now, 0

    def live(self, now: float) -> list[int]:
        return [shard for shard, load in enumerate(self.loads)
                if load.alive and now - load.seen_at <= STALE_S]

    def route(self, token_ids: list[int], now: float) -> int:
        shards = self.live(now) or list(range(len(self.loads)))
        if self.policy == "round_robin":
            self.turn += 1
            shard = shards[self.turn % len(shards)]
        else:
            shard = self._by_prefix(token_ids, shards)
        self.loads[shard].routed_tokens += len(token_ids)
        return shard

    def _by_prefix(self, token_ids: list[int], shards: list[int]) -> int:
        least = min(shards, key=lambda s: (self.loads[s].tokens, self.loads[s].kv_cache_usage))
        key = prefix_key(token_ids, self.block_size)
        if key is None:
            return least
        preferred = max(shards, key=lambda s: _digest(key + s.to_bytes(4, "little")))
        if self.loads[preferred].tokens > self.loads[least].tokens + self.slack_tokens:
            return least
        return preferred


def prefix_key(token_ids: list[int], block_size: int) -> bytes | None:
    """The hash of the prompt's first full KV blocks, PREFIX_BLOCKS at most; None when the
    prompt does not fill one."""
    blocks = min(PREFIX_BLOCKS, len(token_ids) // block_size)
    if blocks == 0:
        return None
    return _digest(array("q", token_ids[:blocks * block_size]).tobytes()).to_bytes(8, "little")


def _digest(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
