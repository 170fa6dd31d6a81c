"""Assembling a choice from text deltas, and OpenAI's response and chunk shapes.

Deltas of one choice may arrive out of order or twice (detokenizer replicas run in
parallel and a reclaimed entry is handled again); `Choice.offer` applies them once, in
`seq` order, and ignores anything after the finish (tokens already in flight when a stop
string ended the completion).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.messages import TextDelta, TokenLogprobs
from services.gateway.response_bodies import (ChatChoice, ChatChunkChoice,
                                              ChatCompletionChunk, ChatCompletionResponse,
                                              ChatLogprobs, ChatMessage, CompletionChoice,
                                              CompletionLogprobs, CompletionResponse,
                                              DeltaMessage, PromptLogprob, PromptLogprobs,
                                              FunctionCall, FunctionCallDelta,
                                              PromptTokensDetails, TokenLogprob, ToolCall,
                                              ToolCallDelta, TopLogprob, Usage)
from services.gateway.tool_calls import ParsedCall
from services.gateway.version import VERSION

Body = CompletionResponse | ChatCompletionResponse | ChatCompletionChunk

MIN_LOGPROB = -9999.0  # stands for -inf, which JSON cannot carry
# What OpenAI's clients log to tell backends apart: this server's build.
SYSTEM_FINGERPRINT = f"headrace-{VERSION}"


@dataclass(slots=True)
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    early: dict[int, TextDelta] = field(default_factory=dict)  # by seq, not yet applicable

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_seq(self) -> int:
        """`seq` counts the output tokens before a delta's own."""
        return len(self.token_ids)

    def offer(self, delta: TextDelta) -> list[TextDelta]:
        """The deltas that became applicable, in order (possibly none). Every delta carries
        at least one token: one without has no place in the `seq` order."""
        if self.finished or delta.seq < self.next_seq or not delta.token_ids:
            return []
        self.early[delta.seq] = delta
        ready = []
        while not self.finished and self.next_seq in self.early:
            current = self.early.pop(self.next_seq)
            self._apply(current)
            ready.append(current)
        if self.finished:
            self.early.clear()
        return ready

    def settle(self, delta: TextDelta) -> None:
        """Apply a whole completion at once (a beam search's), even one without tokens."""
        self.early.clear()
        self._apply(delta)

    def _apply(self, delta: TextDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.num_prompt_tokens = delta.num_prompt_tokens
        if delta.prompt_logprobs:
            self.prompt_logprobs = list(delta.prompt_logprobs)
        if delta.seq == 0:
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = 0
          ) -> Usage:
    """cached_tokens None: no prompt_tokens_details (vLLM's default)."""
    details = (None if cached_tokens is None
               else PromptTokensDetails.model_construct(cached_tokens=cached_tokens))
    return Usage.model_construct(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


# --- logprobs -------------------------------------------------------------------------

def completion_logprobs(entries: list[TokenLogprobs | None], offset: int,
                        unscored_text: str = "", as_ids: bool = False) -> CompletionLogprobs:
    """The completions API's logprobs object for tokens whose text starts at `offset`. A
    None entry is the first prompt token, which has no logprob: it reads `unscored_text`
    with null logprobs, as an echoed prompt's first token does. `as_ids`: tokens read
    token_id:N (--return-tokens-as-token-ids)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entry in entries:
        offsets.append(offset)
        if entry is None:
            tokens.append(unscored_text)
            token_logprobs.append(None)
            top.append(None)
        else:
            texts = token_texts(entry, as_ids)
            tokens.append(texts[0])
            token_logprobs.append(finite(entry.logprobs[0]))
            row: dict[str, float] = {}
            for text, lp in zip(texts, entry.logprobs):  # the chosen token, then the top-k
                row.setdefault(text, finite(lp))
            top.append(row)
        offset += len(tokens[-1])
    return CompletionLogprobs.model_construct(tokens=tokens, token_logprobs=token_logprobs,
                                              top_logprobs=top, text_offset=offsets)


def logprobs_text_length(logprobs: CompletionLogprobs) -> int:
    """How far a completions logprobs object moves the text offset."""
    return sum(map(len, logprobs.tokens))


def chat_logprobs(entries: list[TokenLogprobs], as_ids: bool = False) -> ChatLogprobs:
    """`as_ids`: tokens read token_id:N; their bytes stay the text's, as in vLLM."""
    content = []
    for entry in entries:
        texts, names = token_texts(entry), token_texts(entry, as_ids)
        top = [TopLogprob.model_construct(token=name, logprob=finite(lp),
                                          bytes=list(text.encode()))
               for name, text, lp in zip(names[1:], texts[1:], entry.logprobs[1:])]
        content.append(TokenLogprob.model_construct(
            token=names[0], logprob=finite(entry.logprobs[0]),
            bytes=list(texts[0].encode()), top_logprobs=top))
    return ChatLogprobs.model_construct(content=content)


def prompt_logprobs(entries: list[TokenLogprobs | None]) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt position, token id -> logprob, rank, text."""
    rows: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            rows.append(None)
            continue
        ranks = [entry.rank, *range(1, len(entry.token_ids))]
        row: dict[str, PromptLogprob] = {}
        for token_id, lp, rank, text in zip(entry.token_ids, entry.logprobs, ranks,
                                            token_texts(entry)):
            row.setdefault(str(token_id), PromptLogprob.model_construct(
                logprob=finite(lp), rank=rank, decoded_token=text))
        rows.append(row)
    return rows


def token_texts(entry: TokenLogprobs, as_ids: bool = False) -> list[str]:
    if entry.texts and not as_ids:
        return list(entry.texts)
    return [f"token_id:{t}" for t in entry.token_ids]


def finite(value: float) -> float:
    return max(value, MIN_LOGPROB)


# --- shapes ---------------------------------------------------------------------------

def completion_choice(index: int, text: str, logprobs: CompletionLogprobs | None,
                      finish_reason: str | None, stop_reason: str | int | None,
                      prompt_rows: PromptLogprobs | None = None) -> CompletionChoice:
    return CompletionChoice.model_construct(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason,
        stop_reason=stop_reason, prompt_logprobs=prompt_rows)


def chat_choice(index: int, text: str, logprobs: ChatLogprobs | None,
                finish_reason: str | None, stop_reason: str | int | None) -> ChatChoice:
    message = ChatMessage.model_construct(content=text)
    return ChatChoice.model_construct(index=index, message=message, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=stop_reason)


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall.model_construct(id=call.id, function=FunctionCall.model_construct(
        name=call.name, arguments=call.arguments))


def tool_call_delta(index: int, call: ParsedCall, arguments: str) -> ToolCallDelta:
    """A call's first streamed delta: its id, type, name and the arguments so far."""
    return ToolCallDelta.model_construct(
        index=index, id=call.id, type="function",
        function=FunctionCallDelta.model_construct(name=call.name, arguments=arguments))


def arguments_delta(index: int, arguments: str) -> ToolCallDelta:
    """More of a streamed call's arguments."""
    return ToolCallDelta.model_construct(
        index=index, function=FunctionCallDelta.model_construct(arguments=arguments))


def chat_delta(index: int, delta: DeltaMessage, logprobs: ChatLogprobs | None = None,
               finish_reason: str | None = None, stop_reason: str | int | None = None
               ) -> ChatChunkChoice:
    return ChatChunkChoice.model_construct(index=index, delta=delta, logprobs=logprobs,
                                           finish_reason=finish_reason,
                                           stop_reason=stop_reason)


def envelope(rid: str, chat: bool, created: int, model: str, choices: list[Any],
             stream: bool, usage_counts: Usage | None = None) -> Body:
    """A response (stream False) or a chunk, whose usage is null but in the last."""
    if not chat:
        kind: type[Body] = CompletionResponse
    else:
        kind = ChatCompletionChunk if stream else ChatCompletionResponse
    return kind.model_construct(id=rid, created=created, model=model,
                                system_fingerprint=SYSTEM_FINGERPRINT, choices=choices,
                                usage=usage_counts)
