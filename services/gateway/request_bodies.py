"""The OpenAI and vLLM request bodies as pydantic models: what the gateway validates and
what /openapi.json documents.

Bodies are validated strictly as JSON: "2" or 1.5 where an integer is wanted, or true where
a number is, is a 400 naming the field, since clients send JSON types as written. Value
ranges are SamplingParams' to check (protocol.py builds one), so one rule holds for the
HTTP API, the tokenizer stage and the offline API. Fields no model defines stay in
`model_extra`, for the gateway's warning; null means "not set" throughout.

The sampling fields are derived from SamplingParams' own fields (the one list of sampling
parameters); the others are OpenAI's spellings (max_tokens beside chat's
max_completion_tokens, completions' integer logprobs, chat's boolean one).
"""

from __future__ import annotations

import types
import typing
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, create_model
from pydantic_core import PydanticCustomError

from common.errors import ApiError
from common.sampling_params import CLIENT_PARAMS, SamplingParams

MAX_TOKEN_ID = 2**31  # token ids travel as packed int32
STRICT = ConfigDict(strict=True, extra="allow")
EXPLAINED = "explained"  # the type of an error whose message is ours, whole


def explained(message: str) -> WrapValidator:
    """A field whose wrong value gets `message`, not pydantic's list of every way a union
    failed."""
    def validate(value: Any, handler: Any) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError(EXPLAINED, message) from None
    return WrapValidator(validate)


TokenId = Annotated[int, Field(ge=0, lt=MAX_TOKEN_ID)]
Prompt = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    explained("'prompt' must be a string, a non-empty list of strings, a list of token ids "
              f"or a list of token-id lists (token ids are integers in [0, {MAX_TOKEN_ID}))")]
Stop = Annotated[str | list[str], explained("'stop' must be a string or a list of strings")]
EmbeddingInput = Annotated[
    str | list[str] | list[TokenId] | list[list[TokenId]],
    explained("'input' must be a string, a list of strings, a list of token ids or a list "
              f"of token-id lists (token ids are integers in [0, {MAX_TOKEN_ID}))")]


# --- sampling ---------------------------------------------------------------------------

_READ_APART = {"max_tokens", "logprobs", "stop"}  # spelled per endpoint, below
_JSON_TYPES: dict[Any, Any] = {int: int, float: float, bool: bool, str: str,
                               tuple: list, dict: dict}


def _json_type(hint: Any) -> Any:
    """The JSON type a client sends for a SamplingParams field of type `hint`: a tuple
    arrives as a list, a dict keyed by token ids as an object keyed by their strings."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None:
        return _JSON_TYPES[hint]
    if origin is dict:  # a JSON object's keys are strings
        return dict[str, args[1]]  # type: ignore[valid-type]
    return _JSON_TYPES[origin][args[0]]


_HINTS = typing.get_type_hints(SamplingParams)
SamplingFields: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "SamplingFields", __config__=STRICT,
    **{name: (_json_type(_HINTS[name]) | None, None)
       for name in CLIENT_PARAMS if name not in _READ_APART})


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Generation(SamplingFields):  # type: ignore[misc, valid-type]
    """What both generation endpoints take."""
    model: str | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    stop: Stop | None = None
    priority: int | None = None
    user: str | None = None  # OpenAI's: read by nothing here, as by vLLM
    session_id: str | None = None  # vLLM's: names a conversation for routing; likewise
    response_format: ResponseFormat | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's older spellings of structured output (`structured_outputs` is the field)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # protocol.py takes the one there is
    # vLLM's beam search (services/gateway/beam.py): n beams
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    early_stopping: bool | None = None
    request_id: str | None = None  # vLLM's: the response's id (after its prefix)
    echo: bool | None = None  # chat's is refused when true (protocol.py)


class CompletionRequest(_Generation):
    prompt: Prompt
    logprobs: int | None = None


# --- chat -------------------------------------------------------------------------------

class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class RequestFunctionCall(BaseModel):
    model_config = STRICT
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients an object


class RequestToolCall(BaseModel):
    model_config = STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: RequestFunctionCall


class ImageURL(BaseModel):
    model_config = STRICT
    url: str
    detail: Literal["auto", "low", "high"] = "auto"


class ImageURLPart(BaseModel):
    """An image (a vision-language model's tokenizer stage loads it: services/tokenizer/
    media.py); the URL alone or OpenAI's object."""
    model_config = STRICT
    type: Literal["image_url"]
    image_url: str | ImageURL


class VideoURL(BaseModel):
    model_config = STRICT
    url: str


class VideoURLPart(BaseModel):
    """A video (a vision-language model's tokenizer stage decodes it and samples its
    frames: common/media.py); the URL alone or vLLM's object."""
    model_config = STRICT
    type: Literal["video_url"]
    video_url: str | VideoURL


# Not `explained`: that costs a Python call per message; api_error words its failures.
Content = str | list[TextPart | ImageURLPart | VideoURLPart]
CONTENT_ERROR = "must be a string or a list of text, video_url and image_url parts"


class RequestMessage(BaseModel):
    model_config = STRICT
    role: str
    content: Content | None = None
    name: str | None = None
    tool_calls: list[RequestToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[RequestMessage], Field(min_length=1)]
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = None  # vLLM's: false drops reasoning_content
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# --- the other endpoints ------------------------------------------------------------------

class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[RequestMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(BaseModel):
    """OpenAI's /v1/embeddings body, with vLLM's truncate_prompt_tokens and
    add_special_tokens."""
    model_config = STRICT
    model: str | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None  # only the model's own size: none is matryoshka-trained
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    add_special_tokens: bool | None = None
    request_id: str | None = None  # vLLM's: the response's id (after its prefix)
    priority: int | None = None  # vLLM's, as in chat


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: Annotated[list[TokenId], explained(
        f"'tokens' must be a list of token ids (integers in [0, {MAX_TOKEN_ID}))")]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body: a PEFT directory served under a model name."""
    model_config = STRICT
    lora_name: Annotated[str, Field(min_length=1)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body: the adapter's name, or its id."""
    model_config = STRICT
    lora_name: Annotated[str, Field(min_length=1)] | None = None
    lora_int_id: int | None = None


class ScoreRequest(BaseModel):
    """vLLM's /score body: text_1 against each of text_2 (one to many), or pairwise."""
    model_config = STRICT
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None
    priority: int | None = None  # vLLM's, as in chat


class RerankDocument(BaseModel):
    model_config = STRICT
    text: str


class RerankRequest(BaseModel):
    """vLLM's /rerank body (Jina's and Cohere's): documents ordered by relevance to the
    query, the top_n first (0 or none: all)."""
    model_config = STRICT
    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: Annotated[int, Field(ge=0)] | None = None
    return_documents: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    user: str | None = None
    priority: int | None = None  # vLLM's, as in chat


# --- the Responses API --------------------------------------------------------------------

class InputText(BaseModel):
    """A text part of an input message: input_text, output_text in a replayed reply, or
    reasoning_text in a replayed reasoning item."""
    model_config = STRICT
    type: Literal["input_text", "output_text", "reasoning_text"]
    text: str


class InputItem(BaseModel):
    """One item of a Responses `input`: a message (`type` "message" or left out), a
    function call the model made, its output (function_call_output), or a reasoning item
    that a client replays from an earlier output (dropped, as chat templates drop past
    reasoning)."""
    model_config = STRICT
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputText] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(BaseModel):
    """A Responses function tool: the chat API's function definition, flattened."""
    model_config = STRICT
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = STRICT
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's /v1/responses body: what this server takes of it (text in and out, function
    tools, structured output, a stored history)."""
    model_config = STRICT
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    priority: int | None = None  # vLLM's, as in chat


class ResponsesItemsRequest(ResponsesRequest):
    """A Responses body whose input is a list of items: validated as such, so that a wrong
    item is named (rather than the union's "not a string")."""
    input: list[InputItem]


# --- errors -------------------------------------------------------------------------------

_KINDS = {"int_type": "an integer", "float_type": "a number", "bool_type": "a boolean",
          "string_type": "a string", "list_type": "a list", "dict_type": "an object",
          "model_type": "an object", "model_attributes_type": "an object"}
_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               list: "a list", dict: "an object", type(None): "null"}


def validate(model: type[BaseModel], body: Any) -> Any:
    """`body` as `model`, or a 400 naming the first field that is wrong (its top-level
    name is OpenAI's `param`)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise api_error(e) from None


def api_error(error: ValidationError) -> ApiError:
    first = error.errors(include_url=False)[0]
    loc = first["loc"]
    if not loc:
        return ApiError(400, "the request body must be a JSON object")
    where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}"
                    for part in loc).lstrip(".")
    if first["type"] == EXPLAINED:
        message = first["msg"]
    elif len(loc) > 3 and loc[0] == "messages" and loc[2] == "content":
        message = f"'messages[{loc[1]}].content' {CONTENT_ERROR}"
    elif first["type"] == "missing":
        message = f"'{where}' is required"
    elif first["type"] in _KINDS:
        got = _JSON_NAMES.get(type(first["input"]), type(first["input"]).__name__)
        message = f"'{where}' must be {_KINDS[first['type']]}, got {got}"
    else:
        message = f"'{where}': {first['msg']}"
    return ApiError(400, message, str(loc[0]))
