"""KV cache blocks, their free queue, and the prefix-cache index.

The free queue is a doubly linked list threaded through the blocks themselves, so a
prefix-cache hit can pull a free block out of the middle in O(1). Eviction order is the
queue order: blocks freed without a hash go to the front (reused first), hashed blocks to
the back (kept as long as possible, least recently freed evicted first).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    token_ids: tuple = ()  # tokens (and image hashes) behind block_hash, to confirm a hit
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1)."""

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head, self._tail = Block(-1), Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> Block:
        if self._len == 0:
            raise IndexError("no free blocks")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        assert block.prev is not None and block.next is not None, "block is not free"
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def append(self, block: Block) -> None:
        self._insert(block, self._tail.prev, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: Block) -> None:
        self._insert(block, self._head, self._head.next)  # type: ignore[arg-type]

    def _insert(self, block: Block, before: Block, after: Block) -> None:
        assert block.prev is None and block.next is None, "block is already free"
        block.prev, block.next = before, after
        before.next = after.prev = block
        self._len += 1

    def __iter__(self):
        block = self._head.next
        while block is not self._tail:
            assert block is not None
            yield block
            block = block.next


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        assert num_blocks > 0
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[int, Block] = {}  # block hash -> block holding it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def take(self, n: int) -> list[Block]:
        """n free blocks for a request, evicting whatever cached content they held."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        taken = [self.free_queue.popleft() for _ in range(n)]
        for block in taken:
            self._evict(block)
            block.ref_cnt = 1
        return taken

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:  # a hash collision is a miss
            return None
        return block

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on cache hits, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # identical content already cached in another block
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block

    def release(self, blocks: Iterable[Block]) -> None:
        """Drop one reference each; pass a request's blocks tail first, so that when they
        are all hashed the tail (least likely shared) is evicted before the head."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, ()
