"""OpenAI request bodies -> what the gateway publishes (errors: common/errors.py).

The bodies' names, shapes and JSON types are the pydantic models' (request_bodies.py) to
check; value ranges are checked by building a SamplingParams (the validation the tokenizer
stage applies again with the model's defaults), so a bad value is a 400 before anything is
queued. Fields nobody defines are ignored and named in a warning, as vLLM does, so that
clients written for other servers work; OpenAI features this server does not have are
refused by name, so a client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from common.beam_search import BeamSearchParams
from common.chat import plain_conversation
from common.errors import ApiError
from common.sampling_params import MAX_N, SamplingError, SamplingParams, fits_int64
from common.structured_outputs import BACKENDS
from services.gateway.request_bodies import (ChatCompletionRequest, CompletionRequest,
                                             DetokenizeRequest, EmbeddingRequest,
                                             NamedToolChoice, SamplingFields,
                                             TokenizeRequest, validate)
from services.gateway.tool_calls import required_schema

# Known OpenAI and vLLM fields (vLLM's ChatCompletionRequest and CompletionRequest, 0.10 to
# 0.11 and after) whose features this server does not have: refused by name when they ask for
# something, never dropped. Each maps to the values that ask for nothing, which a client may
# send (as a serialized vLLM request does); null always asks for nothing.
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    name: () for name in (
        "suffix", "functions", "function_call", "audio", "modalities", "prediction",
        "reasoning_effort", "web_search_options",
        # vLLM's
        "prompt_embeds", "logits_processors", "cache_salt", "kv_transfer_params",
        "ec_transfer_params", "vllm_xargs", "mm_processor_kwargs", "media_io_kwargs",
        "documents", "chat_template", "structural_tag", "guided_whitespace_pattern",
        "logprob_token_ids", "repetition_detection", "stream_interval")}
_UNSUPPORTED |= {"continue_final_message": (False,), "return_token_ids": (False,),
                 "return_prompt_text": (False,), "return_token_offsets": (False,),
                 "return_mm_kwargs": (True,), "watermarking": (False,),
                 "routed_experts_prompt_start": (0,), "thinking_token_budget": (-1,),
                 # truncate_prompt_tokens keeps the last tokens: vLLM's "left"
                 "truncation_side": ("left",),
                 # the one backend (common/structured_outputs.py), per request or not
                 "guided_decoding_backend": BACKENDS}
# vLLM's embedding fields likewise (normalize: the server's --override-pooler-config's)
_EMBEDDING_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "normalize": (), "embed_dtype": ("float32",), "endianness": ("native",),
    "mm_processor_kwargs": (), "additional_data": ()}
# and of /score and /rerank: an activation is a cross-encoder's, which is refused
SCORING_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    name: () for name in ("mm_processor_kwargs", "activation", "use_activation", "softmax")}
# What a beam search honours (common/beam_search.py), beside the beam fields themselves.
_BEAM_PARAMS = {"n", "max_tokens", "temperature", "ignore_eos", "include_stop_str_in_output",
                "skip_special_tokens", "spaces_between_special_tokens", "logprobs", "stop"}
_SAMPLING_FIELDS = tuple(SamplingFields.model_fields)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}  # vLLM's older names -> structured_outputs' keys
COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions


@dataclass(slots=True)
class Job:
    """One API call: one or more prompts (completions) or one conversation (chat)."""
    chat: bool
    model: str | None  # None: the first served name
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # only what the client set
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # usage in every chunk, not only the last
    echo: bool = False
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: the endpoint's default
    truncate_prompt_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # for the chat template
    tool_choice: str = "none"  # "none", "auto", "required" or "function" (named)
    tool_name: str | None = None  # the function a named tool_choice calls
    parallel_tool_calls: bool = True  # false: at most one call comes back (the first)
    include_reasoning: bool = True
    priority: int = 0
    tokens_as_ids: bool = False  # logprob tokens read token_id:N
    prompt_tokens_details: bool = False  # usage has them (--enable-prompt-tokens-details)
    ignored: list[str] = field(default_factory=list)  # unknown fields, for the warning
    beam: BeamSearchParams | None = None  # use_beam_search: services/gateway/beam.py
    request_id: str | None = None  # the client's id for the response (vLLM's field)

    @property
    def n(self) -> int:
        return self.params.get("n", 1)

    @property
    def num_generated(self) -> int:
        """Completions generated per prompt: best_of (the n best are returned), or n."""
        return self.params.get("best_of") or self.n

    @property
    def logprobs(self) -> bool:
        return self.params.get("logprobs") is not None


@dataclass(slots=True)
class TokenizeJob:
    model: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    ignored: list[str] = field(default_factory=list)


@dataclass(slots=True)
class EmbeddingJob:
    """One /v1/embeddings call: a request per input."""
    model: str | None
    inputs: list[str | list[int]]
    encoding_format: str = "float"  # or "base64"
    dimensions: int | None = None
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = None
    ignored: list[str] = field(default_factory=list)
    request_id: str | None = None  # the client's id for the response (vLLM's field)
    priority: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    """What one call may ask for, beyond the body size: each bounds what the call makes
    every stage hold (ServerConfig's flags of the same names)."""
    max_prompts_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_length: int = 1024
    max_stop_token_ids: int = 1024
    max_n: int = MAX_N

    def check(self, job: Job) -> None:
        stop, stop_ids = job.params.get("stop", []), job.params.get("stop_token_ids") or []
        for name in ("n", "best_of"):
            n = job.params.get(name, 1)
            if isinstance(n, int) and n > self.max_n:  # a wrong type is SamplingParams'
                raise ApiError(400, f"{name!r} is {n}, more than --max-n {self.max_n}", name)
        within("prompt", len(job.prompts), self.max_prompts_per_request,
                "prompts", "max-prompts-per-request")
        within("stop", len(stop), self.max_stop_strings, "strings", "max-stop-strings")
        within("stop", max(map(len, stop), default=0), self.max_stop_length,
                "characters in a string", "max-stop-length")
        if isinstance(stop_ids, list):  # a wrong type is SamplingParams' to name
            within("stop_token_ids", len(stop_ids), self.max_stop_token_ids, "ids",
                    "max-stop-token-ids")


def within(param: str, count: int, bound: int, unit: str, flag: str) -> None:
    if count > bound:
        raise ApiError(400, f"'{param}' has {count} {unit}, more than --{flag} {bound}",
                       param)


def parse_job(body: Any, chat: bool, limits: Limits = Limits()) -> Job:
    refuse_unsupported(body)
    if chat:
        req = validate(ChatCompletionRequest, body)
        if req.echo:  # vLLM's chat echo: the last message's content repeated first
            raise ApiError(400, "'echo' is not supported for chat completions by this "
                                "server", "echo")
        job = Job(chat=True, model=req.model, messages=_messages(body),
                  add_generation_prompt=_given(req.add_generation_prompt, True),
                  chat_template_kwargs=req.chat_template_kwargs,
                  include_reasoning=_given(req.include_reasoning, True))
        _tool_choice(req, job)
    else:
        req = validate(CompletionRequest, body)
        job = Job(chat=False, model=req.model, prompts=_prompts(req.prompt),
                  echo=_given(req.echo, False))
    job.ignored = [name for name in unknown_names(req) if name not in _UNSUPPORTED]
    job.request_id = req.request_id
    job.add_special_tokens = req.add_special_tokens
    job.truncate_prompt_tokens = req.truncate_prompt_tokens
    job.params = _sampling_overrides(req, chat, job.echo)
    job.stream = _given(req.stream, False)
    if job.stream and req.prompt_logprobs is not None:
        raise ApiError(400, "'prompt_logprobs' is not available with 'stream' set to true",
                       "prompt_logprobs")
    if job.stream and (job.params.get("best_of") or 1) > job.n:
        raise ApiError(400, "'best_of' above 'n' is not available with 'stream' set to "
                            "true", "best_of")
    job.include_usage, job.continuous_usage = _usage_options(req, job.stream)
    job.priority = _given(req.priority, 0)
    job.tokens_as_ids = _given(req.return_tokens_as_token_ids, False)
    check_priority(job.priority)
    limits.check(job)
    try:
        checked = SamplingParams(**job.params)
    except SamplingError as e:
        raise ApiError(400, str(e), e.param) from None
    # the stages get the values checked: a JSON integer for a float parameter leaves as
    # the float SamplingParams made of it (one past 64 bits cannot cross the bus)
    job.params = {name: _plain(getattr(checked, name)) for name in job.params}
    job.beam = _beam_search(req, job)
    return job


def _beam_search(req: Any, job: Job) -> BeamSearchParams | None:
    """use_beam_search's settings (n beams), or None; a beam field without it, or a
    parameter a beam search does not honour beside it, is a 400 naming it."""
    if not req.use_beam_search:
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) not in (None, default):
                raise ApiError(400, f"{name!r} needs 'use_beam_search' set to true", name)
        return None
    refused = sorted(_client_name(req, name) for name in set(job.params) - _BEAM_PARAMS)
    if req.truncate_prompt_tokens is not None:
        refused.append("truncate_prompt_tokens")
    if refused:
        raise ApiError(400, f"{refused[0]!r} is not available with 'use_beam_search' (a beam "
                            f"search honours {', '.join(sorted(_BEAM_PARAMS))}, "
                            "length_penalty and early_stopping)", refused[0])
    try:
        return BeamSearchParams(
            beam_width=job.n, max_tokens=job.params.get("max_tokens") or 2**31 - 1,
            ignore_eos=job.params.get("ignore_eos", False),
            temperature=job.params.get("temperature", 0.0),
            length_penalty=_given(req.length_penalty, 1.0),
            include_stop_str_in_output=job.params.get("include_stop_str_in_output", False),
            early_stopping=_given(req.early_stopping, False),
            stop=tuple(job.params.get("stop", ())))
    except SamplingError as e:
        raise ApiError(400, str(e), e.param) from None


def _client_name(req: Any, param: str) -> str:
    """The field the client sent for a parameter: structured_outputs comes of several."""
    if param != "structured_outputs":
        return param
    for name in ("structured_outputs", "response_format", *_GUIDED, "tool_choice"):
        if getattr(req, name, None) is not None:
            return name
    return param


def _plain(value: Any) -> Any:
    """JSON's form: a list for a tuple, string keys (logit_bias' ids) for a dict."""
    if isinstance(value, dict):
        return {str(key): item for key, item in value.items()}
    return list(value) if isinstance(value, tuple) else value


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def parse_tokenize(body: Any) -> TokenizeJob:
    req = validate(TokenizeRequest, body)
    job = TokenizeJob(req.model, ignored=unknown_names(req),
                      chat_template_kwargs=req.chat_template_kwargs)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    if req.messages is not None:
        job.messages = _messages(body)
        job.add_generation_prompt = _given(req.add_generation_prompt, True)
        job.add_special_tokens = _given(req.add_special_tokens, False)
    else:
        job.prompt = req.prompt
        job.add_special_tokens = _given(req.add_special_tokens, True)
    return job


def parse_embedding(body: Any, limits: Limits = Limits()) -> EmbeddingJob:
    refuse_unsupported(body, _EMBEDDING_UNSUPPORTED)
    req = validate(EmbeddingRequest, body)
    job = EmbeddingJob(req.model, _inputs(req.input),
                       encoding_format=_given(req.encoding_format, "float"),
                       dimensions=req.dimensions, add_special_tokens=req.add_special_tokens,
                       truncate_prompt_tokens=req.truncate_prompt_tokens,
                       ignored=[name for name in unknown_names(req)
                                if name not in _EMBEDDING_UNSUPPORTED],
                       request_id=req.request_id, priority=_given(req.priority, 0))
    check_priority(job.priority)
    within("input", len(job.inputs), limits.max_prompts_per_request, "inputs",
            "max-prompts-per-request")
    return job


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    req = validate(DetokenizeRequest, body)
    return req.model, req.tokens


# --- fields ---------------------------------------------------------------------------

def refuse_unsupported(body: Any, table: dict[str, tuple[Any, ...]] = _UNSUPPORTED) -> None:
    """A 400 for the first field of `table` whose value asks for something."""
    if not isinstance(body, dict):
        return  # the models name what is wrong with it
    for name in table.keys() & body.keys():
        value = body[name]
        if value is not None and not any(value == ok and type(value) is type(ok)
                                         for ok in table[name]):
            allowed = "".join(f" or {ok!r}" for ok in table[name])
            raise ApiError(400, f"{name!r} is not supported by this server (null{allowed} "
                                f"only), got {value!r}"[:300], name)


def check_priority(priority: int) -> None:
    if not fits_int64(priority):  # the bus carries 64 bits
        raise ApiError(400, f"priority must be a 64-bit integer, got {priority}", "priority")


def unknown_names(req: BaseModel) -> list[str]:
    """The fields no model defines (sorted), to be ignored."""
    return sorted(name for name, value in (req.model_extra or {}).items()
                  if value is not None)


def _sampling_overrides(req: Any, chat: bool, echo: bool) -> dict[str, Any]:
    params = {name: value for name in _SAMPLING_FIELDS
              if (value := getattr(req, name)) is not None}
    max_tokens = req.max_completion_tokens if chat else None
    if max_tokens is None:
        max_tokens = req.max_tokens
    if max_tokens is None and not chat:
        max_tokens = COMPLETION_MAX_TOKENS
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if req.stop:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    logprobs = _chat_logprobs(req) if chat else _completion_logprobs(req.logprobs, echo)
    for name, value in logprobs.items():
        params.setdefault(name, value)  # an explicit prompt_logprobs wins over echo's
    structured = _structured_outputs(req, _forced_calls_schema(req) if chat else None)
    if structured is not None:
        params["structured_outputs"] = structured
    return params


def _tool_choice(req: ChatCompletionRequest, job: Job) -> None:
    """OpenAI's default: "auto" with tools, "none" without. "required" and a named
    function constrain the output to calls (structured output, below)."""
    tools = [tool.model_dump(exclude_none=True) for tool in req.tools or []]
    choice = req.tool_choice or ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise ApiError(400, "'tool_choice' needs 'tools'", "tool_choice")
    job.tools = tools or None
    job.parallel_tool_calls = req.parallel_tool_calls is not False
    if isinstance(choice, str):
        job.tool_choice = choice
        return
    names = [tool["function"]["name"] for tool in tools]
    if choice.function.name not in names:
        raise ApiError(400, f"'tool_choice' names {choice.function.name!r}, which is not "
                            f"among the tools ({', '.join(map(repr, names))})", "tool_choice")
    job.tool_choice, job.tool_name = "function", choice.function.name


def _forced_calls_schema(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The schema a tool_choice of "required" or of one function puts on the output."""
    choice, tools = req.tool_choice, [t.model_dump() for t in req.tools or []]
    if choice == "required" and tools:
        return required_schema(tools, single=req.parallel_tool_calls is False)
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t["function"]["name"] == choice.function.name]
        return named[0]["function"]["parameters"] or {"type": "object"} if named else None
    return None


def _structured_outputs(req: Any, calls_schema: dict[str, Any] | None
                        ) -> dict[str, Any] | None:
    """OpenAI's response_format, vLLM's guided_* fields and a tool_choice that forces
    calls, as SamplingParams' structured_outputs; at most one way of asking."""
    asked: dict[str, dict[str, Any]] = {}
    if calls_schema is not None:
        asked["tool_choice"] = {"json": calls_schema}
    if req.structured_outputs is not None:
        asked["structured_outputs"] = req.structured_outputs
    for name, key in _GUIDED.items():
        if getattr(req, name) is not None:
            asked[name] = {key: getattr(req, name)}
    form = req.response_format
    if form is not None and form.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif form is not None and form.type == "json_schema":
        if form.json_schema is None or form.json_schema.schema_ is None:
            raise ApiError(400, "'response_format' of type 'json_schema' needs "
                                "'json_schema.schema'", "response_format")
        asked["response_format"] = {"json": form.json_schema.schema_}
    if len(asked) > 1:
        raise ApiError(400, f"give one way of structuring the output, not "
                            f"{' and '.join(map(repr, asked))}", next(iter(asked)))
    return next(iter(asked.values()), None)


def _chat_logprobs(req: ChatCompletionRequest) -> dict[str, Any]:
    wanted, top = _given(req.logprobs, False), req.top_logprobs
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    if top is not None and top < 0:
        raise ApiError(400, f"'top_logprobs' must be non-negative, got {top}", "top_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def _completion_logprobs(count: int | None, echo: bool) -> dict[str, Any]:
    if count is None:
        return {}
    if echo:  # echoed prompt tokens carry their logprobs too
        return {"logprobs": count, "prompt_logprobs": count}
    return {"logprobs": count}


def _usage_options(req: Any, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats)."""
    options = req.stream_options
    if options is None:
        return False, False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream' set to true",
                       "stream_options")
    include = _given(options.include_usage, False)
    return include, include and _given(options.continuous_usage_stats, False)


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    if prompt and all(prompt):  # no empty string or token list
        return prompt
    raise ApiError(400, "'prompt' must be a string, a non-empty list of strings, a list of "
                        "token ids or a list of token-id lists, none of them empty", "prompt")


def _inputs(given: str | list[Any]) -> list[str | list[int]]:
    """One input for a string or a list of token ids, one each for a list of them."""
    single = isinstance(given, str) or (given and isinstance(given[0], int))
    inputs = [given] if single else given
    if inputs and all(inputs):
        return inputs
    raise ApiError(400, "'input' must be a non-empty string, a list of token ids, or a "
                        "non-empty list of either, none of them empty", "input")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The conversation as the client sent it (the tokenizer stage renders it); the
    models checked its shape."""
    messages = body["messages"]
    plain_conversation(messages)  # the tokenizer stage's rules: both agree on a message
    return messages
