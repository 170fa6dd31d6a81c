"""The gateway's public entry points: what code outside the services (benchmarks/) may
use, imported from `services.gateway`. The modules behind them may change shape; these
names and signatures are what tests/test_architecture.py lets the tools see."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from common.messages import TextDelta
from services.gateway.core import Call
from services.gateway.protocol import Job, parse_job
from services.gateway.request_bodies import ChatCompletionRequest, CompletionRequest, validate
from services.gateway.response_bodies import to_json
from services.gateway.responses import Choice

__all__ = ["Choice", "Job", "chunk_writer", "parse_job", "validate_body"]


def validate_body(body: Any, chat: bool) -> Any:
    """The request model's validation alone, the first part of `parse_job`: the chat or
    completion model built from `body` (an ApiError, a 400, when it does not fit)."""
    return validate(ChatCompletionRequest if chat else CompletionRequest, body)


def chunk_writer(job: Job, call_id: str, model: str) -> Callable[[TextDelta], list[bytes]]:
    """What the gateway does with each reply delta of a streamed call: apply it to the
    call and serialize the chunks it releases (the JSON of each SSE event)."""
    call = Call(job, call_id, model, 0, 0.0)

    def write(delta: TextDelta) -> list[bytes]:
        return [to_json(body) for body in call.chunks(call.offer(delta))]
    return write
