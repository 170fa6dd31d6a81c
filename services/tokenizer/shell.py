"""The tokenizer process: hr:requests -> hr:admit (or an error to the gateway). Stateless;
any number of replicas share the consumer group, and a dead one's entries are reclaimed."""

from __future__ import annotations

from common.bus import ADMIT, REQUESTS, Output, replies_stream
from common.messages import GenerateRequest
from services.engine import load_model_info
from services.process import ServiceContext, run_service
from services.tokenizer.core import InputProcessor, RequestRejected

GROUP = "tokenizer"


def handler(processor: InputProcessor):
    async def handle(req: GenerateRequest) -> list[Output]:
        try:
            return [(ADMIT, processor.process(req))]
        except RequestRejected as e:
            return [(replies_stream(req.reply_to), e.reply(req.rid))]
    return handle


async def serve(ctx: ServiceContext) -> None:
    processor = load_model_info(ctx.engine).processor
    await ctx.bus.consume(REQUESTS, GROUP, ctx.consumer, handler(processor), stop=ctx.stop,
                           min_idle_ms=ctx.server.reclaim_idle_ms,
                           reclaim_every_s=min(5.0, ctx.server.reclaim_idle_ms / 2000))


def main(argv: list[str]) -> int:
    return run_service("tokenizer", argv, serve, __doc__ or "")
