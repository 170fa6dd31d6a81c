"""OpenAI's Responses API (/v1/responses) on the chat completions path. No I/O.

A Responses request becomes a chat completions body (its input items and the stored
history as chat messages, its instructions as the system message, its function tools as
chat tools, text.format as response_format), which `parse_job` validates as any chat call;
the finished chat answer becomes the Responses object, and a stream's chat deltas become
the Responses event sequence (response.created, output items, text and argument deltas,
response.completed).
"""

from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.errors import ApiError
from services.gateway.protocol import Job, Limits, parse_job, unknown_names
from services.gateway.request_bodies import (InputItem, ResponsesItemsRequest,
                                             ResponsesRequest, ResponsesToolChoice, validate)
from services.gateway.response_bodies import (ChatMessage, DeltaMessage, ResponseObject,
                                              ResponseUsage, Usage)

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}")  # what new_response_id makes
STORE_TTL_S = 24 * 3600.0  # how long a stored response can be retrieved or continued
# chat fields whose errors name the Responses field the client set
_RESPONSES_PARAM = {"max_completion_tokens": "max_output_tokens",
                    "max_tokens": "max_output_tokens", "response_format": "text",
                    "messages": "input"}
# Responses fields (OpenAI's and vLLM's) whose features this server does not have: what
# each asks for, and the values that ask for nothing beside null.
_UNSUPPORTED: dict[str, tuple[str, tuple[Any, ...]]] = {
    "background": ("background mode is", (False,)),
    "reasoning": ("'reasoning' options are", ()),
    "conversation": ("conversations are", ()),
    "prompt": ("prompt templates are", ()),
    "include": ("extra output ('include') is", ([],)),
    "max_tool_calls": ("a bound on tool calls is", ()),
    "top_logprobs": ("logprobs are", (0,)),
    "truncation": ("truncating the input is", ("disabled",)),
    "service_tier": ("service tiers are", ("auto", "default")),
    "request_id": ("a client's response id is", ()),
    "cache_salt": ("a salted prefix cache is", ()),
    "mm_processor_kwargs": ("processor options are", ())}


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def check_response_id(response_id: str, param: str | None = None) -> None:
    """A 404 for an id this server cannot have made (it also keeps client text out of
    Redis key names)."""
    if not RESPONSE_ID.fullmatch(response_id):
        raise ApiError(404, f"No response with id {response_id!r}: ids look like "
                            "'resp_' and 32 hex digits.", param)


@dataclass(slots=True)
class ResponsesCall:
    """One /v1/responses call: the chat job it runs, and what its answer is stored with."""
    request: ResponsesRequest
    job: Job
    conversation: list[dict[str, Any]]  # history and input as chat messages, no instructions
    id: str = field(default_factory=new_response_id)

    @property
    def store(self) -> bool:
        return self.request.store is not False


def parse_responses(body: Any) -> ResponsesRequest:
    if isinstance(body, dict):
        for name, (what, nothing) in _UNSUPPORTED.items():
            value = body.get(name)
            if value is not None and not any(value == ok and type(value) is type(ok)
                                             for ok in nothing):
                raise ApiError(400, f"{name!r}: {what} not supported by this server",
                               name)
    items = isinstance(body, dict) and isinstance(body.get("input"), list)
    req = validate(ResponsesItemsRequest if items else ResponsesRequest, body)
    if req.previous_response_id is not None:
        check_response_id(req.previous_response_id, "previous_response_id")
    return req


def responses_call(req: ResponsesRequest, history: list[dict[str, Any]],
                   limits: Limits = Limits()) -> ResponsesCall:
    """The chat job for `req` after `history` (the previous response's conversation)."""
    conversation = history + input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    try:
        job = parse_job(chat_body(req, system + conversation), chat=True, limits=limits)
    except ApiError as e:
        param = _RESPONSES_PARAM.get(e.param or "", e.param)
        message = re.sub(rf"\b{e.param}\b", param, e.message) if e.param else e.message
        raise ApiError(e.status, message, param, e.kind) from None
    job.ignored = [name for name in unknown_names(req) if name not in _UNSUPPORTED]
    return ResponsesCall(req, job, conversation)


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "stream": req.stream, "user": req.user,
        "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls,
        "priority": req.priority}
    if req.tools:
        body["tools"] = [{"type": "function",
                          "function": tool.model_dump(exclude_none=True, exclude={"type"})}
                         for tool in req.tools]
    choice = req.tool_choice
    body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                           if isinstance(choice, ResponsesToolChoice) else choice)
    form = req.text.format if req.text is not None else None
    if form is not None and form.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": form.name, "schema": form.schema_, "strict": form.strict}}
    return {name: value for name, value in body.items() if value is not None}


def input_messages(given: str | list[InputItem]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a function call joins the assistant message
    before it (or starts one), its output is a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        if item.type == "reasoning":
            continue
        if item.type == "message":
            messages.append(_message(item, i))
        elif item.type == "function_call":
            _need(item, i, "call_id", "name", "arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            _need(item, i, "call_id", "output")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": item.output})
    return messages


def _message(item: InputItem, i: int) -> dict[str, Any]:
    _need(item, i, "role", "content")
    role = "system" if item.role == "developer" else item.role
    content = item.content
    if isinstance(content, list):
        if any(part.type == "reasoning_text" for part in content):
            raise ApiError(400, f"'input[{i}].content' holds reasoning_text, which only a "
                                "reasoning item has", "input")
        content = [{"type": "text", "text": part.text} for part in content]
    return {"role": role, "content": content}


def _need(item: InputItem, i: int, *names: str) -> None:
    for name in names:
        if getattr(item, name) is None:
            raise ApiError(400, f"'input[{i}].{name}' is required for an item of type "
                                f"{item.type!r}", "input")


# --- the answer ------------------------------------------------------------------------

def message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": "msg_" + uuid.uuid4().hex, "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def reasoning_item(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call_id,
            "name": name, "arguments": arguments, "status": "completed"}


def output_items(message: ChatMessage) -> list[dict[str, Any]]:
    """A whole chat answer as output items: reasoning, text, then the calls."""
    items = [reasoning_item(message.reasoning_content)] if message.reasoning_content else []
    if message.content or not message.tool_calls:
        items.append(message_item(message.content or ""))
    items += [function_call_item(c.id, c.function.name, c.function.arguments)
              for c in message.tool_calls]
    return items


def answered_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The answer as the chat message a later turn's history holds (reasoning dropped, as
    chat templates drop past reasoning)."""
    text = "".join(part["text"] for item in items if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


def response_usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    return ResponseUsage(input_tokens=usage.prompt_tokens,
                         input_tokens_details={"cached_tokens": cached},
                         output_tokens=usage.completion_tokens,
                         output_tokens_details={"reasoning_tokens": 0},
                         total_tokens=usage.total_tokens)


def response_object(call: ResponsesCall, model: str, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: Usage | None = None,
                    finish_reason: str | None = None) -> ResponseObject:
    req = call.request
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    if status == "completed" and incomplete is not None:
        status = "incomplete"
    choice = req.tool_choice
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {}
    return ResponseObject(
        id=call.id, created_at=created_at, model=model, status=status,
        incomplete_details=incomplete, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p,
        tools=[tool.model_dump(exclude_none=True) for tool in req.tools or []],
        tool_choice=(choice.model_dump() if isinstance(choice, ResponsesToolChoice)
                     else choice or ("auto" if req.tools else "none")),
        parallel_tool_calls=req.parallel_tool_calls is not False,
        text=text or {"format": {"type": "text"}},
        previous_response_id=req.previous_response_id, store=call.store,
        metadata=req.metadata or {}, user=req.user, output=output,
        usage=response_usage(usage))


# --- streaming -------------------------------------------------------------------------

class ResponseEvents:
    """A stream's events from the chat deltas: an item opens when its kind of text first
    comes (reasoning, message text, a call) and closes when another kind does or the
    answer ends. `items` is the output as streamed, for response.completed."""

    def __init__(self, call: ResponsesCall, model: str, created_at: int) -> None:
        self.call, self.model, self.created_at = call, model, created_at
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        body = response_object(self.call, self.model, self.created_at, "in_progress", [])
        snapshot = body.model_dump(mode="json")
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def feed(self, delta: DeltaMessage) -> list[dict[str, Any]]:
        events = []
        if delta.reasoning_content:
            events += self._text("reasoning", delta.reasoning_content)
        if delta.content:
            events += self._text("message", delta.content)
        for call in delta.tool_calls or []:
            function = call.function
            if call.id is not None:
                events += self._close()
                events += self._add(function_call_item(call.id, function.name or "", ""))
            if function is not None and function.arguments and self.open is not None:
                self.open["arguments"] += function.arguments
                events.append(self._event("response.function_call_arguments.delta",
                                          **self._where(), delta=function.arguments))
        return events

    def completed(self, usage: Usage | None, finish_reason: str | None
                  ) -> list[dict[str, Any]]:
        events = self._close()
        if not self.items:  # nothing came: an empty message, as a whole answer has
            events += self._text("message", "") + self._close()
        body = response_object(self.call, self.model, self.created_at, "completed",
                               self.items, usage, finish_reason)
        kind = "response.completed" if body.status == "completed" else "response.incomplete"
        return events + [self._event(kind, response=body.model_dump(mode="json"))]

    def failed(self, error: ApiError) -> list[dict[str, Any]]:
        """An error event, then response.failed with what had come (as OpenAI ends a
        stream that fails)."""
        body = response_object(self.call, self.model, self.created_at, "failed", self.items)
        body.error = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                      "message": error.message}
        return [self._event("error", code=str(error.status), message=error.message,
                            param=error.param),
                self._event("response.failed", response=body.model_dump(mode="json"))]

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self.open = item
        shown = copy.deepcopy({**item, "status": "in_progress"})  # the item grows later
        return [self._event("response.output_item.added", output_index=len(self.items) - 1,
                            item=shown)]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close()
            item = message_item("") if kind == "message" else reasoning_item("")
            part = item["content"][0]
            item["content"] = []
            events += self._add(item)
            item["content"].append(part)
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=dict(part)))
        assert self.open is not None
        self.open["content"][0]["text"] += text
        name = ("response.output_text.delta" if kind == "message"
                else "response.reasoning_text.delta")
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(self._event(name, **self._where(), content_index=0, delta=text,
                                  **extra))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item = self.open
        if item is None:
            return []
        where = self._where()
        events = []
        if item["type"] == "function_call":
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = ("response.output_text.done" if item["type"] == "message"
                    else "response.reasoning_text.done")
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(self._event(done, **where, content_index=0, text=part["text"],
                                      **extra))
            events.append(self._event("response.content_part.done", **where,
                                      content_index=0, part=dict(part)))
        events.append(self._event("response.output_item.done",
                                  output_index=where["output_index"], item=dict(item)))
        self.open = None
        return events
