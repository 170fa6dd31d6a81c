"""The OpenAI and vLLM response bodies as pydantic models: what the gateway sends and what
/openapi.json documents.

The gateway builds them from values it made itself, so they are built without validation
(`model_construct`) and serialized by pydantic-core. A field that vLLM sends only when it
was asked for (prompt_logprobs) is left out while None; every other null is sent, since
clients read `usage: null` and `logprobs: null`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "abort", "tool_calls"] | None
StopReason = str | int | None
_OMIT_NONE: Any = Field(default=None, exclude_if=lambda value: value is None)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# --- logprobs ---------------------------------------------------------------------------

class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]  # vLLM's: per position, by token id


# --- completions ------------------------------------------------------------------------

class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None
    prompt_logprobs: PromptLogprobs | None = _OMIT_NONE


class _Envelope(BaseModel):
    id: str
    created: int
    model: str
    system_fingerprint: str
    usage: Usage | None = None


class CompletionResponse(_Envelope):
    """A completions response, and (with one choice's news) a streamed chunk."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


# --- chat -------------------------------------------------------------------------------

class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] = []
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = _OMIT_NONE


class FunctionCallDelta(BaseModel):
    name: str | None = _OMIT_NONE
    arguments: str | None = _OMIT_NONE


class ToolCallDelta(BaseModel):
    """A streamed tool call: its first delta has the id, type and name, later ones more
    of the arguments' text."""
    index: int
    id: str | None = _OMIT_NONE
    type: Literal["function"] | None = _OMIT_NONE
    function: FunctionCallDelta | None = _OMIT_NONE


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = _OMIT_NONE
    content: str | None = _OMIT_NONE
    reasoning_content: str | None = _OMIT_NONE
    tool_calls: list[ToolCallDelta] | None = _OMIT_NONE


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason = None
    stop_reason: StopReason = None


class ChatCompletionChunk(_Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


# --- the other endpoints ------------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # "base64": the little-endian float32 bytes, as OpenAI's


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    index: int
    document: dict[str, str] | None = _OMIT_NONE  # {"text": ...} with return_documents
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens
    output_tokens: int
    output_tokens_details: dict[str, int]  # reasoning_tokens
    total_tokens: int


class ResponseObject(BaseModel):
    """OpenAI's Responses object. `output` holds its items (message, reasoning,
    function_call) as OpenAI spells them."""
    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = []
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = {}
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] = {}
    user: str | None = None
    output: list[dict[str, Any]] = []
    usage: ResponseUsage | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def to_json(body: BaseModel) -> bytes:
    return body.__pydantic_serializer__.to_json(body)


def to_dict(body: BaseModel) -> dict[str, Any]:
    return body.model_dump(mode="json")
