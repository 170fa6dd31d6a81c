"""The tokenizer core: a client request in, a validated, tokenized AdmitRequest out.

It applies the chat template, tokenizes, checks lengths against max_model_len, resolves
sampling values (client over generation config over SamplingParams defaults) and fills in
the EOS ids. Anything wrong with the request raises RequestRejected, which the shell turns
into an ErrorReply; nothing invalid reaches the scheduler.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jinja2

from common.messages import AdmitRequest, ErrorReply, GenerateRequest
from common.sampling_params import SamplingError, SamplingParams
from services.tokenizer.defaults import SamplingDefaults

# Set by this stage from the model, never by a client.
INTERNAL_PARAMS = frozenset({"eos_token_ids"})
CLIENT_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams)) - INTERNAL_PARAMS


class RequestRejected(Exception):
    """A request this stage refuses; the client gets `status` and an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def reply(self, rid: str) -> ErrorReply:
        return ErrorReply(rid, self.status, self.message, self.kind, self.param)


class InputProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, defaults: SamplingDefaults,
                 max_logprobs: int, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.defaults = defaults
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def process(self, req: GenerateRequest) -> AdmitRequest:
        check_client_params(req.params)
        ids = self.prompt_ids(req.prompt, req.prompt_token_ids, req.messages,
                              req.add_generation_prompt)
        with sampling_checks():
            params = self.defaults.params_for(req.params)
        requested = req.params.get("max_tokens")
        if requested is not None:
            self._check_fits(len(ids), requested)
        return self._admit(req.rid, req.reply_to, ids, params, req.arrival_time, req.priority)

    def admit(self, rid: str, reply_to: str, prompt_token_ids: list[int],
              params: SamplingParams, arrival_time: float = 0.0, priority: int = 0
              ) -> AdmitRequest:
        """Checks and resolves an already-built SamplingParams (the offline API path)."""
        ids = list(prompt_token_ids)
        self._check_token_ids(ids)
        if params.max_tokens is not None:
            self._check_fits(len(ids), params.max_tokens)
        with sampling_checks():
            params = params.replace(max_tokens=self.defaults.cap(params.max_tokens))
        return self._admit(rid, reply_to, ids, params, arrival_time, priority)

    def prompt_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                   messages: list[dict] | None, add_generation_prompt: bool = True
                   ) -> list[int]:
        given = [name for name, value in (("prompt", prompt),
                                          ("prompt_token_ids", prompt_token_ids),
                                          ("messages", messages)) if value is not None]
        if len(given) != 1:
            raise RequestRejected("Give exactly one of prompt, prompt_token_ids and messages; "
                                  f"got {', '.join(given) or 'none'}.",
                                  param=given[-1] if given else "prompt")
        if messages is not None:
            ids = self._chat_ids(messages, add_generation_prompt)
        elif prompt is not None:
            ids = self._text_ids(prompt)
        else:
            ids = list(prompt_token_ids or [])
        self._check_token_ids(ids)
        return ids

    # --- prompts ----------------------------------------------------------------------

    def _text_ids(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise RequestRejected(f"prompt must be a string, got {type(prompt).__name__}",
                                  param="prompt")
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        conversation = plain_conversation(messages)
        try:
            ids = self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tokenize=True,
                return_dict=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
            raise RequestRejected(f"The chat template failed on these messages: {e}",
                                  param="messages") from None
        return list(ids)

    def _check_token_ids(self, ids: list[int]) -> None:
        if not ids:
            raise RequestRejected("The prompt cannot be empty.", param="prompt")
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestRejected(f"Token id {bad!r} is out of vocabulary: token ids must be "
                                  f"integers in [0, {self.vocab_size}).",
                                  param="prompt_token_ids")
        if len(ids) >= self.max_model_len:  # not one token of room left to generate
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, your request has {len(ids)} input tokens, which leaves no room "
                "for output tokens. Please reduce the length of the input.", param="prompt")

    # --- sampling ---------------------------------------------------------------------

    def _check_fits(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt + max_tokens} tokens ({num_prompt} in "
                f"the input, {max_tokens} in max_tokens). Please reduce the length of the "
                "input or max_tokens.", param="max_tokens")

    def _admit(self, rid: str, reply_to: str, ids: list[int], params: SamplingParams,
               arrival_time: float, priority: int) -> AdmitRequest:
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        with sampling_checks():
            params = params.replace(max_tokens=max_tokens, eos_token_ids=self.eos_token_ids)
            params.check_logprobs(self.max_logprobs)
        return AdmitRequest(rid, reply_to, ids, params, arrival_time, priority)


@contextmanager
def sampling_checks() -> Iterator[None]:
    try:
        yield
    except SamplingError as e:
        raise RequestRejected(str(e), param=e.param) from None


# --- client parameters ----------------------------------------------------------------

_PARAM_TYPES = typing.get_type_hints(SamplingParams)


def check_client_params(params: dict[str, Any]) -> None:
    """Names and JSON types of the client's sampling values; ranges are SamplingParams'."""
    for name, value in params.items():
        if name not in CLIENT_PARAMS:
            raise RequestRejected(f"Unknown sampling parameter {name!r}.", param=name)
        if not accepts(_PARAM_TYPES[name], value):
            raise RequestRejected(f"{name} must be {describe(_PARAM_TYPES[name])}, got "
                                  f"{value!r}.", param=name)


def accepts(hint: Any, value: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(accepts(arg, value) for arg in typing.get_args(hint))
    if origin is tuple:  # SamplingParams takes one item or a sequence of them
        item = typing.get_args(hint)[0]
        items = [value] if accepts(item, value) else value
        return isinstance(items, (list, tuple)) and all(accepts(item, v) for v in items)
    if hint is type(None):
        return value is None
    if isinstance(value, bool):  # a JSON true is not a number
        return hint is bool
    return isinstance(value, (int, float) if hint is float else hint)


def describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return f"{describe(typing.get_args(hint)[0])} or a list of them"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            type(None): "null"}[hint]


# --- chat messages --------------------------------------------------------------------

def plain_conversation(messages: Any) -> list[dict[str, Any]]:
    """Messages whose content is one string, as templates written for strings expect;
    OpenAI-style lists of text parts are joined with newlines."""
    if not isinstance(messages, list) or not messages:
        raise RequestRejected("messages must be a non-empty list.", param="messages")
    return [plain_message(m, i) for i, m in enumerate(messages)]


def plain_message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestRejected(f"messages[{i}] must be an object with a string role.",
                              param="messages")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return {**message, "content": "\n".join(p["text"] for p in content)}
    raise RequestRejected(f"messages[{i}].content must be a string or a list of text parts "
                          "(this server takes text only).", param="messages")
