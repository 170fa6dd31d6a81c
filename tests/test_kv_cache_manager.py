"""Block pool and KV cache manager: free-queue order, prefix caching, and a randomized
state machine that checks no block leaks or is handed to two writers."""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.sampling_params import SamplingParams
from services.scheduler.block_pool import Block, BlockPool, FreeBlockQueue
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request

BS = 4


def make_request(req_id: str, prompt: list[int], **params) -> Request:
    return Request(req_id, req_id, 0, "gw", list(prompt), SamplingParams(**params))


def test_free_queue_supports_removal_from_the_middle():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.appendleft(blocks[2])
    assert [b.block_id for b in queue] == [2, 0, 1, 3, 4]
    assert queue.popleft() is blocks[2]
    queue.remove(blocks[4])
    queue.append(blocks[4])
    assert [b.block_id for b in queue] == [0, 1, 3, 4] and len(queue) == 4


def test_freed_hashed_blocks_are_evicted_last_and_tail_first():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.take(3)
    pool.cache(a, 1, (1,))
    pool.cache(b, 2, (2,))
    pool.release(reversed([a, b, c]))  # a request's blocks, tail first
    # c had no hash: reused first; then the hashed ones, tail (b) before head (a)
    assert [blk.block_id for blk in pool.free_queue] == [c.block_id, 3, b.block_id, a.block_id]
    pool.take(3)
    assert pool.lookup(2, (2,)) is None and pool.lookup(1, (1,)) is a


def test_prefix_hit_is_confirmed_against_token_ids():
    pool = BlockPool(2, enable_caching=True)
    (block,) = pool.take(1)
    pool.cache(block, 42, (1, 2, 3, 4))
    assert pool.lookup(42, (1, 2, 3, 4)) is block
    assert pool.lookup(42, (9, 9, 9, 9)) is None  # same hash, other tokens: a miss


def test_a_decode_that_fills_no_block_needs_nothing_and_one_that_does_is_cached():
    """holds: the scheduler's shortcut past allocate. True only where allocate would return
    no blocks and cache none: within the held blocks, short of a block to hash."""
    for caching in (True, False):
        kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=caching)
        req = make_request("a", list(range(6)))
        assert not kv.holds(req, 1)  # holds no blocks yet
        assert kv.allocate(req, 6, kv.computed_blocks(req)) is not None  # 2 blocks, 1 full
        req.num_computed_tokens = 6
        req.output_token_ids += [7, 8]  # the 7th and 8th tokens: the second block fills
        assert kv.holds(req, 7) and not kv.holds(req, 9)  # past the held blocks
        assert kv.holds(req, 8) is not caching  # its filled block waits to be hashed
        if caching:
            assert kv.allocate(req, 2) == []  # room: it caches the block instead
            assert kv.num_hashed["a"] == 2 and kv.holds(req, 8)


def test_shared_prefix_is_reused_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    first = make_request("a", list(range(12)))
    assert kv.allocate(first, 12, kv.computed_blocks(first)) is not None
    # identical prompt: 3 full blocks cached, but the last token must be recomputed
    again = make_request("b", list(range(12)))
    hits = kv.computed_blocks(again)
    assert len(hits) == 2
    longer = make_request("c", list(range(12)) + [99, 98])
    assert [b.block_id for b in kv.computed_blocks(longer)] == kv.block_ids("a")[:3]
    kv.allocate(longer, 2, kv.computed_blocks(longer))
    assert kv.block_ids("c")[:3] == kv.block_ids("a")[:3]
    assert kv.stats.hits == 12 and kv.stats.queries == 26


def test_prompt_logprobs_requests_skip_the_cache():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_caching=True)
    kv.allocate(make_request("a", list(range(12))), 12, [])
    assert kv.computed_blocks(make_request("b", list(range(13)), prompt_logprobs=1)) == []


def test_allocation_fails_cleanly_when_full():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(20)))
    assert kv.allocate(req, 20, []) is None
    assert kv.pool.num_free == 3 and "a" not in kv.req_blocks


class KVMachine(RuleBasedStateMachine):
    """Random allocate / decode / finish / preempt / cache-hit sequences."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(num_blocks=24, block_size=BS, enable_caching=True)
        self.live: dict[str, Request] = {}
        self.counter = 0
        self.prefixes = [[random.Random(s).randrange(50) for _ in range(10)] for s in range(3)]

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(0, 49), max_size=9))
    def admit(self, prefix: int, tail: list[int]) -> None:
        self.counter += 1
        req = make_request(f"r{self.counter}", self.prefixes[prefix] + tail)
        computed = self.kv.computed_blocks(req)
        assert len(computed) * BS < req.num_known_tokens
        need = req.num_known_tokens - len(computed) * BS
        if self.kv.allocate(req, need, computed) is not None:
            req.num_computed_tokens = req.num_known_tokens
            self.live[req.req_id] = req

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        req = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        req.output_token_ids.append(data.draw(st.integers(0, 49)))
        if self.kv.allocate(req, 1) is not None:
            req.num_computed_tokens += 1
        else:  # the engine would preempt: drop everything the request holds
            req.output_token_ids.pop()
            self.kv.free(req)
            del self.live[req.req_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req_id = data.draw(st.sampled_from(sorted(self.live)))
        self.kv.free(self.live.pop(req_id))

    @invariant()
    def blocks_are_accounted_for(self) -> None:
        holders: dict[int, int] = {}
        for req_id, req in self.live.items():
            ids = self.kv.block_ids(req_id)
            assert len(ids) * BS >= req.num_computed_tokens  # every computed token has a slot
            assert len(set(ids)) == len(ids)
            for block_id in ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.kv.pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
            if block.ref_cnt > 1:  # only immutable (hashed, full) blocks are shared
                assert block.block_hash is not None
        free_ids = {b.block_id for b in self.kv.pool.free_queue}
        assert free_ids == {b.block_id for b in self.kv.pool.blocks if b.ref_cnt == 0}
        for block_hash, block in self.kv.pool.cached.items():
            assert block.block_hash == block_hash

    def teardown(self) -> None:
        for req in self.live.values():
            self.kv.free(req)
        assert self.kv.usage == 0.0
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


KVMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVMachine = KVMachine.TestCase
