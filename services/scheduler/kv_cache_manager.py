"""Which KV blocks each request holds, and the prefix cache over them.

A full block's hash chains its parent's hash and its own token ids, so equal hashes mean
equal prefixes (confirmed against the token ids on a hit). Only blocks whose tokens are
all known are hashed: a block holding a not-yet-sampled token never is.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.block_pool import Block, BlockPool
from services.scheduler.request import Request

_ROOT_HASH = 0x9E3779B97F4A7C15  # parent hash of a request's first block


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found cached


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks of a request already cached
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, ())]

    def computed_blocks(self, req: Request) -> list[Block]:
        """The longest cached prefix of the request's known tokens, in whole blocks, leaving
        at least the last token to compute (its logits are needed to sample)."""
        if not self.enable_caching or req.params.prompt_logprobs is not None or req.embed:
            return []  # prompt logprobs and mean pooling need every position computed
        self._extend_hashes(req)
        max_blocks = (req.num_known_tokens - 1) // self.block_size
        hits: list[Block] = []
        for i, block_hash in enumerate(req.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, self._block_tokens(req, i))
            if block is None:
                break
            hits.append(block)
        return hits

    def holds(self, req: Request, num_slots: int) -> bool:
        """Whether the request's blocks already hold its first `num_slots` tokens and none
        of those blocks waits to be cached: a decode step's usual case, which allocates
        nothing (allocate's first branch without its calls: about 5% off planning,
        benchmarks/scheduler-cpu/s13)."""
        return self._has_room(req, num_slots) and not self._fills_a_block(req, num_slots)

    def allocate(self, req: Request, num_new_tokens: int, computed: list[Block] | None = None,
                 num_lookahead_tokens: int = 0) -> list[Block] | None:
        """Blocks so the request can hold `num_new_tokens` more tokens past its computed
        ones (plus `computed` cache hits, given on first schedule), and
        `num_lookahead_tokens` slots after them (a draft model's proposals write there).
        None if they do not fit; the newly allocated blocks otherwise."""
        if computed is None:
            slots = req.num_computed_tokens + num_new_tokens
            if self._has_room(req, slots + num_lookahead_tokens):
                # the common decode step: the blocks it holds have room
                self._cache_full_blocks(req, slots)
                return []
        first_schedule, computed = computed is not None, computed or []
        held = self.req_blocks.setdefault(req.req_id, [])
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        num_slots = num_computed + num_new_tokens + num_lookahead_tokens
        need = -(-num_slots // self.block_size) - len(held) - len(computed)
        evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if need > self.pool.num_free - evictable_hits:
            if not held:
                del self.req_blocks[req.req_id]
            return None
        self.pool.touch(computed)
        held.extend(computed)
        new = self.pool.take(max(need, 0))
        held.extend(new)
        self._cache_full_blocks(req, num_computed + num_new_tokens)
        if first_schedule and self.enable_caching:
            self.stats.queries += req.num_known_tokens
            self.stats.hits += len(computed) * self.block_size
        return new

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.req_id, [])
        self.num_hashed.pop(req.req_id, None)
        self.pool.release(reversed(blocks))

    def _has_room(self, req: Request, num_slots: int) -> bool:
        """Whether the blocks the request holds have room for its first `num_slots`."""
        held = self.req_blocks.get(req.req_id)
        return held is not None and num_slots <= len(held) * self.block_size

    def _fills_a_block(self, req: Request, num_slots: int) -> bool:
        """Whether its first `num_slots` fill a block not cached yet (with caching on)."""
        return (self.enable_caching
                and num_slots // self.block_size > self.num_hashed.get(req.req_id, 0))

    def _cache_full_blocks(self, req: Request, num_computed_after: int) -> None:
        if not self._fills_a_block(req, num_computed_after):  # the common decode step
            return
        start = self.num_hashed.get(req.req_id, 0)
        full = min(num_computed_after, req.num_known_tokens) // self.block_size  # known only
        if full <= start:
            return
        self._extend_hashes(req)
        blocks = self.req_blocks[req.req_id]
        for i in range(start, full):
            self.pool.cache(blocks[i], req.block_hashes[i], self._block_tokens(req, i))
        self.num_hashed[req.req_id] = full

    def _extend_hashes(self, req: Request) -> None:
        for i in range(len(req.block_hashes), req.num_known_tokens // self.block_size):
            parent = req.block_hashes[i - 1] if i else _root_hash(req)
            req.block_hashes.append(hash((parent, self._block_tokens(req, i))))

    def _block_tokens(self, req: Request, i: int) -> tuple:
        """The block's token ids, then the hashes of the images whose placeholders it
        holds: equal placeholders of different images are different KV."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        tokens = tuple(req.token_slice(start, end))
        images = tuple(image.hash for image in req.images
                       if image.offset < end and image.offset + image.length > start)
        return tokens + images if images else tokens


def _root_hash(req: Request) -> int:
    """The chain of a request under an adapter starts elsewhere: its KV differs from the
    base model's (and every other adapter's) for the same tokens."""
    return _ROOT_HASH if req.lora is None else hash((_ROOT_HASH, req.lora.lora_int_id))
