"""OpenAI request bodies -> what the gateway publishes (errors: common/errors.py).

Only names, shapes and JSON types are checked here; value ranges are checked by building a
SamplingParams (the validation the tokenizer stage applies again with the model's
defaults), so a bad value is a 400 before anything is queued. Fields nobody defines are
ignored and named in a warning, as vLLM does, so that clients written for other servers
work; OpenAI and vLLM features this server does not have yet are refused by name, so a
client never silently gets something other than what it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.chat import plain_conversation
from common.errors import ApiError
from common.sampling_params import (CLIENT_PARAMS, MAX_N, SamplingError, SamplingParams,
                                    check_json_type, fits_int64, json_kinds)

MAX_TOKEN_ID = 2**31  # token ids travel as packed int32


# Sampling parameters whose request field has their name and meaning, with their JSON
# types; the others are spelled differently by OpenAI's API (max_tokens beside chat's
# max_completion_tokens, logprobs, a stop string or list) and are read below.
_READ_APART = {"max_tokens", "logprobs", "stop"}
_SAMPLING_FIELDS = {name: json_kinds(name) for name in CLIENT_PARAMS if name not in _READ_APART}
_COMMON_FIELDS = {*_SAMPLING_FIELDS, "model", "stream", "stream_options", "max_tokens",
                  "stop", "logprobs", "priority", "user", "response_format"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs",
                                 "add_generation_prompt"}
# Known OpenAI fields whose features this server does not have.
_UNSUPPORTED = {"suffix", "best_of", "logit_bias", "tools", "tool_choice", "functions",
                "function_call", "parallel_tool_calls", "audio", "modalities",
                "prediction", "reasoning_effort", "web_search_options", "guided_json",
                "guided_regex", "guided_choice", "guided_grammar", "allowed_token_ids",
                "truncate_prompt_tokens", "chat_template_kwargs", "include_reasoning"}
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
    echo: bool = False
    add_generation_prompt: bool = True
    priority: int = 0
    ignored: list[str] = field(default_factory=list)  # unknown fields, for the warning

    @property
    def n(self) -> int:
        return self.params.get("n", 1)

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
    ignored: list[str] = field(default_factory=list)


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
        n = job.params.get("n", 1)
        if isinstance(n, int) and n > self.max_n:  # a wrong type is SamplingParams' to name
            raise ApiError(400, f"'n' is {n}, more than --max-n {self.max_n}", "n")
        _within("prompt", len(job.prompts), self.max_prompts_per_request,
                "prompts", "max-prompts-per-request")
        _within("stop", len(stop), self.max_stop_strings, "strings", "max-stop-strings")
        _within("stop", max(map(len, stop), default=0), self.max_stop_length,
                "characters in a string", "max-stop-length")
        if isinstance(stop_ids, list):  # a wrong type is SamplingParams' to name
            _within("stop_token_ids", len(stop_ids), self.max_stop_token_ids, "ids",
                    "max-stop-token-ids")


def _within(param: str, count: int, bound: int, unit: str, flag: str) -> None:
    if count > bound:
        raise ApiError(400, f"'{param}' has {count} {unit}, more than --{flag} {bound}",
                       param)


def parse_job(body: Any, chat: bool, limits: Limits = Limits()) -> Job:
    body = _object(body)
    job = Job(chat=chat, model=_typed(body, "model", str),
              ignored=_unknown_names(body, _CHAT_FIELDS if chat else _COMPLETION_FIELDS))
    _check_response_format(body)
    if chat:
        job.messages = _messages(body)
        job.add_generation_prompt = _typed(body, "add_generation_prompt", bool, True)
    else:
        job.prompts = _prompts(body)
        job.echo = _typed(body, "echo", bool, False)
    job.params = _sampling_overrides(body, chat, job.echo)
    job.stream = _typed(body, "stream", bool, False)
    if job.stream and _typed(body, "prompt_logprobs", int) is not None:
        raise ApiError(400, "'prompt_logprobs' is not available with 'stream' set to true",
                       "prompt_logprobs")
    job.include_usage = _include_usage(body, job.stream)
    job.priority = _typed(body, "priority", int, 0)
    if not fits_int64(job.priority):
        raise ApiError(400, f"priority must be a 64-bit integer, got {job.priority}",
                       "priority")
    limits.check(job)
    try:
        checked = SamplingParams(**job.params)
    except SamplingError as e:
        raise ApiError(400, str(e), e.param) from None
    # the stages get the values checked: a JSON integer for a float parameter leaves as
    # the float SamplingParams made of it (one past 64 bits cannot cross the bus)
    job.params = {name: _plain(getattr(checked, name)) for name in job.params}
    return job


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def parse_tokenize(body: Any) -> TokenizeJob:
    body = _object(body)
    job = TokenizeJob(_typed(body, "model", str), ignored=_unknown_names(
        body, {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"}))
    if ("prompt" in body) == ("messages" in body):
        raise ApiError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
    if "messages" in body:
        job.messages = _messages(body)
        job.add_generation_prompt = _typed(body, "add_generation_prompt", bool, True)
        job.add_special_tokens = _typed(body, "add_special_tokens", bool, False)
    else:
        job.prompt = _typed(body, "prompt", str)
        if job.prompt is None:
            raise ApiError(400, "'prompt' must be a string", "prompt")
        job.add_special_tokens = _typed(body, "add_special_tokens", bool, True)
    return job


def parse_detokenize(body: Any) -> tuple[str | None, list[int]]:
    body = _object(body)
    _unknown_names(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not (isinstance(tokens, list) and all(_is_token_id(t) for t in tokens)):
        raise ApiError(400, f"'tokens' must be a list of token ids (integers in [0, "
                            f"{MAX_TOKEN_ID}))", "tokens")
    return _typed(body, "model", str), tokens


# --- fields ---------------------------------------------------------------------------

def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def _unknown_names(body: dict[str, Any], known: set[str]) -> list[str]:
    """The fields of `body` this endpoint does not know (sorted), to be ignored; a feature
    it lacks is refused instead."""
    unknown = []
    for name, value in body.items():
        if value is None:
            continue  # clients send null for "not set"
        if name in _UNSUPPORTED:
            raise ApiError(400, f"{name!r} is not supported by this server", name)
        if name not in known:
            unknown.append(name)
    return sorted(unknown)


def _check_response_format(body: dict[str, Any]) -> None:
    response_format = _typed(body, "response_format", dict)
    if response_format is not None and response_format.get("type") != "text":
        raise ApiError(400, f"'response_format' of type {response_format.get('type')!r} is "
                            "not supported by this server (only 'text')", "response_format")


def _sampling_overrides(body: dict[str, Any], chat: bool, echo: bool) -> dict[str, Any]:
    params = {name: body[name] for name, kinds in _SAMPLING_FIELDS.items()
              if _typed(body, name, kinds) is not None}
    max_tokens = _typed(body, "max_completion_tokens", int) if chat else None
    if max_tokens is None:
        max_tokens = _typed(body, "max_tokens", int)
    if max_tokens is None and not chat:
        max_tokens = COMPLETION_MAX_TOKENS
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    stop = _stop(body)
    if stop:
        params["stop"] = stop
    logprobs = _chat_logprobs(body) if chat else _completion_logprobs(body, echo)
    for name, value in logprobs.items():
        params.setdefault(name, value)  # an explicit prompt_logprobs wins over echo's
    return params


def _stop(body: dict[str, Any]) -> list[str]:
    stop = _typed(body, "stop", (str, list))
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings", "stop")
    return stop


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    wanted = _typed(body, "logprobs", bool, False)
    top = _typed(body, "top_logprobs", int)
    if top is not None and not wanted:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    if top is not None and top < 0:
        raise ApiError(400, f"'top_logprobs' must be non-negative, got {top}", "top_logprobs")
    return {"logprobs": top or 0} if wanted else {}


def _completion_logprobs(body: dict[str, Any], echo: bool) -> dict[str, Any]:
    count = _typed(body, "logprobs", int)
    if count is None:
        return {}
    if echo:  # echoed prompt tokens carry their logprobs too
        return {"logprobs": count, "prompt_logprobs": count}
    return {"logprobs": count}


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = _typed(body, "stream_options", dict)
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream' set to true",
                       "stream_options")
    unknown = set(options) - {"include_usage"}
    if unknown:
        raise ApiError(400, f"unknown stream option {sorted(unknown)[0]!r}", "stream_options")
    return _typed(options, "include_usage", bool, False)


def _prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if _is_token_list(prompt):
            return [list(prompt)]
        if all(_is_token_list(p) for p in prompt):
            return [list(p) for p in prompt]
    raise ApiError(400, "'prompt' must be a string, a non-empty list of strings, a list of "
                        f"token ids or a list of token-id lists (token ids are integers in "
                        f"[0, {MAX_TOKEN_ID}))", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    plain_conversation(messages)  # the tokenizer stage's rules: both agree on a message
    return messages


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_TOKEN_ID


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_is_token_id(t) for t in value)


def _typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...],
           default: Any = None) -> Any:
    """body[name] if it has one of the JSON types `kinds`; `default` if absent or null."""
    value = body.get(name)
    if value is None:
        return default
    try:
        check_json_type(name, value, kinds if isinstance(kinds, tuple) else (kinds,))
    except SamplingError as e:
        raise ApiError(400, str(e), name) from None
    return value
