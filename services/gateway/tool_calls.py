"""Tool calls and reasoning in a completion's text: vLLM's --tool-call-parser and
--reasoning-parser, as pure functions of the text so far.

A streamed choice feeds its text to `OutputSplitter`, which says what may go out now:
reasoning (`<think>` models), content, and, at the end, the tool calls. Text that might be
the start of a marker is held back, as stop strings are; once a tool call's marker shows,
the rest is held until the choice finishes and is then parsed whole, so a client never
sees a half-written call as content. Whole (non-streamed) responses split the final text
the same way.

Parsers, by vLLM's names:
- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after optional content.
- `llama3_json` (Llama 3.1/3.2): the output is one JSON object `{"name": ...,
  "parameters": {...}}`, or several joined by `;`, optionally after `<|python_tag|>`.
Reasoning parsers: `deepseek_r1` (the prompt opened `<think>`: everything before
`</think>` is reasoning, all of it if the end never comes) and `qwen3` (reasoning only
between an explicit `<think>` and `</think>`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
HERMES_START = "<tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(slots=True)
class Piece:
    """What one step of a choice's text releases: `arguments` continue the call a named
    tool_choice opened (`opened`, on its first piece)."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)
    opened: ParsedCall | None = None
    arguments: str = ""


# --- whole texts ---------------------------------------------------------------------------

def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output; text that does not parse as calls stays
    content, as vLLM keeps it."""
    if parser == "hermes":
        return _hermes(text)
    return _llama3_json(text)


def _hermes(text: str) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = [_call(block.group(1), "arguments") for block in HERMES_BLOCK.finditer(text, start)]
    if not calls or None in calls:
        return text, []
    return text[:start] or None, calls  # type: ignore[return-value]


def _llama3_json(text: str) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    calls: list[ParsedCall] = []
    decoder, at = json.JSONDecoder(), 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        call = _call_of(value, "parameters")
        if call is None:
            return text, []
        calls.append(call)
        at = _skip(body, at, ";")
    return None, calls


def _skip(body: str, at: int, separator: str) -> int:
    while at < len(body) and (body[at].isspace() or body[at] == separator):
        at += 1
    return at


def _call(text: str, arguments_key: str) -> ParsedCall | None:
    try:
        return _call_of(json.loads(text), arguments_key)
    except ValueError:
        return None


def _call_of(value: Any, arguments_key: str) -> ParsedCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(value["name"], arguments)


def parse_required(text: str) -> tuple[str | None, list[ParsedCall]]:
    """tool_choice "required": the output is a JSON array of {"name", "parameters"}."""
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    calls = [_call_of(v, "parameters") for v in value] if isinstance(value, list) else []
    if not calls or None in calls:
        return text, []
    return None, calls  # type: ignore[return-value]


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON schema that makes a model's output a list of calls of these tools."""
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": tool["function"].get("parameters") or {"type": "object"}}}
        for tool in tools]}}


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished output."""
    if parser == "qwen3":
        start = text.find(THINK_START)
        end = text.find(THINK_END, start + 1)
        if start < 0 or end < 0:
            return None, text
        return text[start + len(THINK_START):end], text[:start] + text[end + len(THINK_END):]
    text = text.removeprefix(THINK_START)  # deepseek_r1: the template opened it
    end = text.find(THINK_END)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(THINK_END):]


# --- streams -------------------------------------------------------------------------------

@dataclass(slots=True)
class OutputSplitter:
    """One choice's text, released as reasoning, content and tool calls. `forced` is a
    tool_choice that leaves the model no choice: "required", or the name of the one
    function whose arguments the whole output is."""
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    forced: str | None = None
    text: str = ""  # everything so far
    released: int = 0  # how much of `text` went out
    thinking: bool = False  # between the reasoning's markers
    holding_calls: bool = False  # a tool call started: the rest waits for the finish

    def __post_init__(self) -> None:
        self.thinking = self.reasoning_parser == "deepseek_r1"

    def feed(self, new: str, finished: bool) -> Piece:
        self.text += new
        piece = Piece()
        if self.forced is not None:
            return self._forced(piece, finished)
        while True:
            before = self.released
            if self.thinking:
                self._release_reasoning(piece, finished)
            elif not self.holding_calls:
                self._release_content(piece, finished)
            if self.released == before:
                break
        if finished and self.holding_calls:
            content, piece.tool_calls = parse_tool_calls(
                self.tool_parser or "", self.text[self.released:])
            piece.content += content or ""
            self.released = len(self.text)
        return piece

    def _forced(self, piece: Piece, finished: bool) -> Piece:
        if self.forced == "required":
            if finished:
                piece.content, piece.tool_calls = parse_required(self.text)
                piece.content = piece.content or ""
            return piece
        if not self.holding_calls:  # the named call opens with the first piece
            self.holding_calls = True
            piece.opened = ParsedCall(self.forced or "", "")
        piece.arguments = self.text[self.released:]
        self.released = len(self.text)
        return piece

    def _release_reasoning(self, piece: Piece, finished: bool) -> None:
        rest = self.text[self.released:]
        if self.reasoning_parser == "deepseek_r1" and self.released == 0:
            if THINK_START.startswith(rest) and not finished:
                return  # maybe the opening marker, written again
            if rest.startswith(THINK_START):
                self.released += len(THINK_START)
                rest = rest[len(THINK_START):]
        end = rest.find(THINK_END)
        if end >= 0:
            piece.reasoning += rest[:end]
            self.released += end + len(THINK_END)
            self.thinking = False
            return
        keep = 0 if finished else _partial_marker(rest, THINK_END)
        piece.reasoning += rest[:len(rest) - keep]
        self.released += len(rest) - keep

    def _release_content(self, piece: Piece, finished: bool) -> None:
        rest = self.text[self.released:]
        if self._llama3_start(rest, finished):
            return
        markers = self._content_markers()
        starts = [(rest.find(m), m) for m in markers if m in rest]
        if starts:
            at, marker = min(starts)
            piece.content += rest[:at]
            self.released += at
            if marker == THINK_START:
                self.released += len(marker)
                self.thinking = True
            else:
                self.holding_calls = True
            return
        keep = 0 if finished else max((_partial_marker(rest, m) for m in markers), default=0)
        piece.content += rest[:len(rest) - keep]
        self.released += len(rest) - keep

    def _llama3_start(self, rest: str, finished: bool) -> bool:
        """Whether the output's start makes it Llama 3 tool calls, or may yet: then
        nothing is released now."""
        if self.tool_parser != "llama3_json" or self.released:
            return False
        head = rest.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            self.holding_calls = True
            return True
        return not finished and PYTHON_TAG.startswith(head)

    def _content_markers(self) -> list[str]:
        markers = []
        if self.reasoning_parser == "qwen3" and self.released == 0:
            markers.append(THINK_START)
        if self.tool_parser == "hermes":
            markers.append(HERMES_START)
        return markers


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
