"""The gateway core of one /v1/embeddings call: a request per input, the embedding each
answers with (one TextDelta, its float32 bytes from the worker), and the response. No I/O:
the shell feeds it replies and writes what it returns.
"""

from __future__ import annotations

import base64

import numpy as np

from common.errors import ApiError
from common.messages import ErrorReply, GenerateRequest, LoRARequest, TextDelta
from services.gateway.core import request_ids
from services.gateway.protocol import EmbeddingJob
from services.gateway.response_bodies import (EmbeddingData, EmbeddingResponse,
                                              EmbeddingUsage)


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    """vLLM's rule for a model not trained for matryoshka embeddings: only its own size."""
    if dimensions is not None and dimensions != hidden_size:
        raise ApiError(400, f"'dimensions' is {dimensions}, but this model's embeddings have "
                            f"{hidden_size} dimensions and it does not support matryoshka "
                            f"representation; leave 'dimensions' out or give {hidden_size}",
                       "dimensions")


def encoded(data: bytes, encoding_format: str) -> list[float] | str:
    """An embedding as the client asked: numbers, or base64 of the little-endian float32
    bytes (what OpenAI's clients ask for and decode)."""
    if encoding_format == "base64":
        return base64.b64encode(data).decode()
    return np.frombuffer(data, "<f4").tolist()


class EmbeddingCall:
    def __init__(self, job: EmbeddingJob, call_id: str, model: str, created: int,
                 lora: LoRARequest | None = None, response_id: str | None = None) -> None:
        """`call_id` names its requests on the bus (unique); `response_id` is the id the
        client sees (default call_id)."""
        self.job, self.id, self.model, self.created = job, call_id, model, created
        self.response_id = response_id or call_id
        self.lora = lora  # the adapter `model` names, None: the base model
        self.rids = request_ids(call_id, len(job.inputs))
        self.answers: dict[str, tuple[bytes, int]] = {}  # rid: (embedding, prompt tokens)
        self.error: ApiError | None = None

    @property
    def done(self) -> bool:
        return self.error is not None or len(self.answers) == len(self.rids)

    def unfinished_rids(self) -> list[str]:
        return [rid for rid in self.rids if rid not in self.answers]

    def requests(self, reply_to: str, arrival_time: float) -> list[GenerateRequest]:
        job = self.job
        common = dict(reply_to=reply_to, params={}, arrival_time=arrival_time,
                      add_special_tokens=job.add_special_tokens,
                      truncate_prompt_tokens=job.truncate_prompt_tokens, embed=True,
                      lora=self.lora, priority=job.priority)
        return [GenerateRequest(rid, prompt=given, **common) if isinstance(given, str)
                else GenerateRequest(rid, prompt_token_ids=given, **common)
                for rid, given in zip(self.rids, job.inputs)]

    def offer(self, msg: TextDelta | ErrorReply) -> TextDelta | None:
        """Apply one reply; returns it when it is a request's embedding, seen first now. The
        first error of a request not answered yet ends the call."""
        if msg.rid not in self.rids or msg.rid in self.answers:
            return None
        if isinstance(msg, ErrorReply):
            if self.error is None:
                self.error = ApiError(msg.status, msg.message, msg.param, msg.kind)
            return None
        if msg.embedding is None:
            return None
        self.answers[msg.rid] = (msg.embedding, msg.num_prompt_tokens)
        return msg

    def embeddings(self) -> list[bytes]:
        """Each input's embedding (float32 bytes), in input order, once done."""
        return [self.answers[rid][0] for rid in self.rids]

    def prompt_tokens(self) -> int:
        return sum(tokens for _, tokens in self.answers.values())

    def response(self) -> EmbeddingResponse:
        data = [EmbeddingData.model_construct(
                    index=i, embedding=encoded(self.answers[rid][0], self.job.encoding_format))
                for i, rid in enumerate(self.rids)]
        tokens = self.prompt_tokens()
        return EmbeddingResponse.model_construct(
            id=self.response_id, created=self.created, model=self.model, data=data,
            usage=EmbeddingUsage.model_construct(prompt_tokens=tokens, total_tokens=tokens))
