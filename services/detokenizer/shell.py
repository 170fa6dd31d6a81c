"""The detokenizer process: hr:detok -> text deltas to each request's gateway, and an abort
to the scheduler when a stop string ends a completion. Stateless: every item carries its
context, so any replica takes any step's batch."""

from __future__ import annotations

import time

from common import keys
from common.bus import Output
from common.messages import Abort, ErrorReply, ReplyBatch, TextDelta, TokenBatch
from common.model_files import load_tokenizer, resolve_model, transformers_without_torch
from common.service import ServiceContext, freeze_heap, run_service
from services.detokenizer.core import Detokenizer

GROUP = "detokenizer"
# Steps read at once. A read batch's replies go out together when all are done, and one
# step of 256 requests takes a few ms: at the default 16 a reply waited up to 80 ms on the
# H100 behind the steps read with it. Two keep the commit's cost shared.
READ_COUNT = 2
# A replica that stalls or dies leaves its steps pending; another takes them over once they
# have waited this long. Short, because a live replica holds a step for milliseconds, and
# safe, because a step handled twice is harmless: the gateway applies each choice's deltas
# once, in order (services/gateway/responses.py).
CLAIM_IDLE_MS = 500
CLAIM_EVERY_S = 0.1


def handler(detokenizer: Detokenizer):
    async def handle(batch: TokenBatch) -> list[Output]:
        received = time.time()
        by_gateway: dict[str, list[TextDelta]] = {}
        outputs: list[Output] = []
        for item in detokenizer.items_of(batch):
            delta, abort = detokenizer.process(item)
            by_gateway.setdefault(item.reply_to, []).append(delta)
            if abort is not None:
                outputs.append((keys.control(batch.shard), abort))
        stamps = [*batch.stamps, received, time.time()] if batch.stamps else []
        return [(keys.replies(gateway), ReplyBatch(deltas, stamps))
                for gateway, deltas in by_gateway.items()] + outputs
    return handle


def given_up(batch: TokenBatch, reason: str) -> list[Output]:
    """When the detokenizer gives up on a batch (Bus.consume's on_dead), each request in
    it ends with the reason, and the scheduler stops generating for it."""
    rids = dict(zip(batch.rids, batch.reply_to))
    message = f"The detokenizer could not process this request's tokens: {reason}"
    return [output for rid, reply_to in rids.items() for output in (
        (keys.replies(reply_to), ErrorReply(rid, 500, message, "InternalServerError")),
        (keys.control(batch.shard), Abort(rid)))]


async def serve(ctx: ServiceContext) -> None:
    model_dir = resolve_model(ctx.engine.model, ctx.engine.load_format,
                              gguf_weights=False)  # the tokenizer only
    transformers_without_torch(model_dir, ctx.engine.trust_remote_code)
    detokenizer = Detokenizer(load_tokenizer(model_dir, ctx.engine.tokenizer))
    freeze_heap()
    await ctx.bus.consume(keys.DETOK, GROUP, ctx.consumer, handler(detokenizer),
                          count=READ_COUNT, stop=ctx.stop,
                          min_idle_ms=CLAIM_IDLE_MS, reclaim_every_s=CLAIM_EVERY_S,
                          on_dead=given_up)


def main(argv: list[str]) -> int:
    return run_service("detokenizer", argv, serve, __doc__ or "")
