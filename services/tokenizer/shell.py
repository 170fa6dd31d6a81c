"""The tokenizer process: hr:requests -> the shard's admissions (or an error to the
gateway). Stateless; any number of replicas share the consumer group, and a dead one's
entries are reclaimed."""

from __future__ import annotations

import dataclasses
import time

from common import keys
from common.bus import Output
from common.errors import ApiError
from common.messages import GenerateRequest
from common.model_info import load_model_info
from common.service import ServiceContext, freeze_heap, run_service
from services.tokenizer.core import InputProcessor

GROUP = "tokenizer"


def handler(processor: InputProcessor):
    async def handle(req: GenerateRequest) -> list[Output]:
        received = time.time()
        try:
            admit = processor.process(req)
        except ApiError as e:
            return [(keys.replies(req.reply_to), e.reply(req.rid))]
        stamps = [req.arrival_time, received, time.time()]
        return [(keys.admit(), dataclasses.replace(admit, stamps=stamps))]
    return handle


async def serve(ctx: ServiceContext) -> None:
    processor = InputProcessor.from_info(load_model_info(ctx.engine))
    freeze_heap()
    await ctx.bus.consume(keys.REQUESTS, GROUP, ctx.consumer, handler(processor),
                          stop=ctx.stop, min_idle_ms=ctx.server.reclaim_idle_ms,
                          reclaim_every_s=min(5.0, ctx.server.reclaim_idle_ms / 2000))


def main(argv: list[str]) -> int:
    return run_service("tokenizer", argv, serve, __doc__ or "")
