"""The tokenizer process: hr:requests -> a shard's admissions (or an error to the
gateway). Stateless but for its view of the shards' load; any number of replicas share the
consumer group, and a dead one's entries are reclaimed. With several data-parallel shards
it picks each request's shard (services/tokenizer/routing.py) and tells the gateway which."""

from __future__ import annotations

import dataclasses
import time

import anyio
from redis.exceptions import RedisError

from common import keys
from common.bus import Bus, Output, decode_value
from common.chat import chat_image_urls, chat_video_urls
from common.errors import ApiError
from common.image_blobs import IMAGE_TTL_S, detach_pixels
from common.log import get_logger
from common.messages import ErrorReply, GenerateRequest, Routed
from common.model_info import load_model_info
from common.service import ServiceContext, freeze_heap, run_service
from common.structured_outputs import xgrammar_loaded
from services.tokenizer.core import InputProcessor
from services.tokenizer.routing import Router

GROUP = "tokenizer"
WATCH_S = 0.25

log = get_logger("headrace.tokenizer")


def handler(processor: InputProcessor, router: Router, bus: Bus,
            ttl_s: float = IMAGE_TTL_S):
    sharded = len(router.loads) > 1

    async def handle(req: GenerateRequest) -> list[Output]:
        received = time.time()
        light = not xgrammar_loaded()
        try:
            if req.messages is not None and (chat_image_urls(req.messages)
                                             or chat_video_urls(req.messages)):
                # fetching, decoding and resizing media would hold the event loop for long
                admit = await anyio.to_thread.run_sync(processor.process, req)
            else:
                admit = processor.process(req)
        except ApiError as e:
            return [(keys.replies(req.reply_to), e.reply(req.rid))]
        finally:
            if light and xgrammar_loaded():  # the first structured request brought it in
                freeze_heap()
        if admit.images:
            admit = await detach_pixels(bus, admit, ttl_s)
        stamps = [req.arrival_time, received, time.time()]
        admit = dataclasses.replace(admit, stamps=stamps)
        if not sharded:
            return [(keys.admit(), admit)]
        shard = router.route(admit.prompt_token_ids, time.monotonic())
        return [(keys.admit(shard), admit),
                (keys.replies(req.reply_to), Routed(req.rid, shard))]
    return handle


def given_up(req: GenerateRequest, reason: str) -> list[Output]:
    """The request's error when the tokenizer gives up on it (Bus.consume's on_dead)."""
    return [(keys.replies(req.reply_to),
             ErrorReply(req.rid, 500, f"The tokenizer could not process this request: "
                                      f"{reason}", "InternalServerError"))]


async def watch_shards(bus: Bus, router: Router, stop: anyio.Event) -> None:
    """Every shard's liveness keys (its scheduler's and its worker's) and figures, a few
    times a second: a shard whose worker died gets nothing new from the moment its own
    scheduler can tell."""
    shards = range(len(router.loads))
    n = len(shards)
    stats_keys = [keys.scheduler_stats(s) for s in shards]
    while not stop.is_set():
        try:
            values = await bus.values(*map(keys.alive_scheduler, shards),
                                      *map(keys.alive_worker, shards), *stats_keys)
        except RedisError as e:  # the figures go stale; routing goes on from them
            log.warning("cannot read the shards' figures", error=str(e))
        else:
            now = time.monotonic()
            for s in shards:
                alive = values[s] is not None and values[n + s] is not None
                router.observe(s, alive, decode_value(stats_keys[s], values[2 * n + s]), now)
        await anyio.sleep(WATCH_S)


async def serve(ctx: ServiceContext) -> None:
    info = load_model_info(ctx.engine, torch_free=True)
    processor = InputProcessor.from_info(info)
    config = info.config
    assert config.max_num_batched_tokens is not None
    router = Router(config.data_parallel_size, config.block_size,
                    config.max_num_batched_tokens, ctx.server.data_parallel_routing)
    freeze_heap()
    async with anyio.create_task_group() as tasks:
        if config.data_parallel_size > 1:
            tasks.start_soon(watch_shards, ctx.bus, router, ctx.stop)
        await ctx.bus.consume(keys.REQUESTS, GROUP, ctx.consumer,
                              handler(processor, router, ctx.bus, ctx.server.image_ttl),
                              stop=ctx.stop, min_idle_ms=ctx.server.reclaim_idle_ms,
                              reclaim_every_s=min(5.0, ctx.server.reclaim_idle_ms / 2000),
                              on_dead=given_up)
        tasks.cancel_scope.cancel()


def main(argv: list[str]) -> int:
    return run_service("tokenizer", argv, serve, __doc__ or "")
