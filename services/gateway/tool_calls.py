"""Tool calls and reasoning in a completion's text: vLLM's --tool-call-parser and
--reasoning-parser, as pure functions of the text so far.

A streamed choice feeds its text to `OutputSplitter`, which says what may go out now:
reasoning (`<think>` models), content, and tool calls. Text that might be the start of a
marker is held back, as stop strings are; once a tool call's marker shows, the rest is the
call section: the parser's `CallStream` reads it as it grows (each character once) and
sends each call as vLLM streams them, opened with its name, then its arguments in parts.
At the finish the section is parsed whole: what the stream has not sent yet goes out, and
a whole (non-streamed) response takes its calls from this parse. A section that does not
parse whole stays content, all of it, unless a call already went out.

Tool parsers, by vLLM's names:
- `hermes` (Hermes, Qwen2.5/Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks after optional content.
- `llama3_json` (Llama 3.1/3.2): the output is one JSON object `{"name": ...,
  "parameters": {...}}`, or several joined by `;`, optionally after `<|python_tag|>`.
- `mistral`: content, then `[TOOL_CALLS]` and a JSON list of {"name", "arguments"}
  (tokenizers before v11), or one `[TOOL_CALLS]name{...}` / `[TOOL_CALLS]name[ARGS]{...}`
  per call (v11 and later). Call ids are 9 letters and digits, which Mistral's templates
  require.
- `pythonic` (Llama 3.2/4 pythonic, ToolACE): the output is a Python list of calls,
  `[f(a=1, b="x"), g()]`, keyword arguments only (each once); read with `ast`, literals
  only; streamed an argument at a time.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=P>value</parameter>
  ...</function></tool_call>` blocks; a value is typed by the request's JSON schema of that
  parameter (integer, number, boolean, object, array; a string otherwise or without one).
- `deepseek_v3` (DeepSeek-V3, R1-0528): `<｜tool▁calls▁begin｜>`, then per call
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` and the arguments in a ```json fence,
  `<｜tool▁call▁end｜>`; then `<｜tool▁calls▁end｜>`.
Reasoning parsers (`REASONING_FORMATS`): `deepseek_r1` (the prompt opened `<think>`:
everything before `</think>` is reasoning, all of it if the end never comes), `qwen3`
(reasoning only between an explicit `<think>` and `</think>`) and `mistral` (Magistral: an
output that opens with `[THINK]` reasons up to `[/THINK]`, or to its end if that never
comes; the markers are special tokens, which the detokenizer then keeps); `deepseek_v3` is
deepseek_r1 for a request that asks for thinking, none otherwise (services/gateway/core.py
chooses).

More tool parsers come from `--tool-parser-plugin PATH`, a Python file that registers them:

    from services.gateway.tool_calls import ParsedCall, register_tool_parser

    @register_tool_parser("my_format", markers=("<call>",))
    def parse(text: str, tools: list[dict] | None) -> tuple[str | None, list[ParsedCall]]:
        ...  # (content before the calls or None, the calls); ([text], []) when none parse

`markers`: strings that open a call wherever they appear; `openers`: strings that make the
whole output calls when it starts with one (after whitespace). The stream holds text from
there to the finish and then calls `parse` on it, so `parse` must take a text that starts at
the marker as well as a whole output. `tools` is the request's tools (OpenAI's shape).
`--tool-call-parser my_format` then picks it; a name the server does not know stops
startup with the list of those it does. `stream=` may name a `CallStream` subclass that
reads the calls as they are written; without one, `ReparsedCalls` streams them by parsing
the growing section whole at each step (see it for what it sends, and when).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import re
import string
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from common.model_files import allow_torch
from services.gateway.json_text import CallObject, JsonText, Pairs, loads

HERMES_START = "<tool_call>"
HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
MISTRAL_START, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
MISTRAL_NAME = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*")
QWEN_FUNCTION_START = "<function="
QWEN_FUNCTION = re.compile(  # one left open ends where the next block or function starts
    r"<function=([^>\n]*)>(.*?)(?:</function>|(?=</tool_call>)|(?=<function=)|\Z)", re.DOTALL)
# \Z, not $: a value runs to its body's very end ($ would stop before a last line break)
QWEN_PARAMETER = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)
DEEPSEEK_CALLS_BEGIN, DEEPSEEK_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DEEPSEEK_CALL = re.compile(
    r"\s*<｜tool▁call▁begin｜>(?P<kind>[^<]*)<｜tool▁sep｜>(?P<name>[^\n<]*)\s*"
    r"```(?:json)?\s*(?P<arguments>.*?)\s*```\s*<｜tool▁call▁end｜>", re.DOTALL)
_LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


@dataclass(slots=True)
class CallDelta:
    """A streamed call's next part: its opening (`opened`: id and name) or more of its
    arguments' text."""
    index: int
    opened: ParsedCall | None = None
    arguments: str = ""


@dataclass(slots=True)
class Piece:
    """What one step of a choice's text releases: `calls`, the parser's calls as a stream
    sends them; at the finish `tool_calls`, the calls the whole text parses to (a whole
    response's). `arguments` continue the call a named tool_choice opened (`opened`, on
    its first piece)."""
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    tool_calls: list[ParsedCall] = field(default_factory=list)
    opened: ParsedCall | None = None
    arguments: str = ""



@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    """Where a model writes its reasoning: between `start` and `end`. `opened`: the prompt
    wrote `start` (the output may write it again); `leading`: only an output that opens
    with `start` reasons, and one that never ends it reasons to the finish (otherwise
    `start` is looked for in the first text released, and an unended one is content).
    `special_tokens`: the markers are special tokens, which the detokenizer must keep."""
    start: str
    end: str
    opened: bool = False
    leading: bool = False
    special_tokens: bool = False


THINK = ("<think>", "</think>")
REASONING_FORMATS = {"deepseek_r1": ReasoningFormat(*THINK, opened=True),
                     "qwen3": ReasoningFormat(*THINK),
                     "mistral": ReasoningFormat("[THINK]", "[/THINK]", leading=True,
                                                special_tokens=True)}

# --- the registry ---------------------------------------------------------------------------

Tools = list[dict[str, Any]] | None
Parse = Callable[[str, Tools], tuple[str | None, list[ParsedCall]]]


@dataclass(frozen=True, slots=True)
class ToolParser:
    """One model family's way of writing calls: `parse` reads a finished text, `markers`
    and `openers` (see the module's docstring) tell the stream where calls begin.
    `special_tokens`: the markers are special tokens, which the detokenizer must keep."""
    name: str
    parse: Parse
    markers: tuple[str, ...] = ()
    openers: tuple[str, ...] = ()
    special_tokens: bool = False
    stream: type[CallStream] | None = None


TOOL_PARSERS: dict[str, ToolParser] = {}
_loaded_plugins: set[Path] = set()


def register_tool_parser(name: str, *, markers: tuple[str, ...] = (),
                         openers: tuple[str, ...] = (), special_tokens: bool = False,
                         stream: type[CallStream] | None = None
                         ) -> Callable[[Parse], Parse]:
    """A decorator that makes `parse` the tool parser `name` (replacing one of that name,
    as vLLM's registry does). `stream` reads its calls as they are written; without one
    `ReparsedCalls` streams them with `parse`."""
    if not name or not (markers or openers) or "" in (*markers, *openers):
        raise ValueError(f"tool parser {name!r}: give a name and at least one non-empty "
                         "marker or opener (where its calls begin)")

    def register(parse: Parse) -> Parse:
        TOOL_PARSERS[name] = ToolParser(name, parse, tuple(markers), tuple(openers),
                                        special_tokens, stream)
        return parse
    return register


def load_tool_parser_plugin(path: str) -> None:
    """Run a --tool-parser-plugin file once; its register_tool_parser calls add parsers."""
    file = Path(path).resolve()
    if file in _loaded_plugins:
        return
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin: no such file {path!r}")
    spec = importlib.util.spec_from_file_location(f"headrace_tool_parser_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin: {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    allow_torch()  # the gateway started without it; a plugin may import it
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the plugin's own error, named, instead of a traceback
        del sys.modules[spec.name]
        raise ValueError(f"--tool-parser-plugin {path!r} failed: "
                         f"{type(e).__name__}: {e}") from e
    _loaded_plugins.add(file)


def check_tool_parser(name: str | None, plugin: str | None = None) -> None:
    """Load the plugin, if any, and refuse a parser name nobody registered: at startup,
    not at a request's end."""
    if plugin is not None:
        load_tool_parser_plugin(plugin)
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not a known tool parser; known: "
                         f"{sorted(TOOL_PARSERS)} (--tool-parser-plugin registers more)")


def tool_parser(name: str) -> ToolParser:
    check_tool_parser(name)
    return TOOL_PARSERS[name]


# --- calls as they are written ---------------------------------------------------------------

class CallStream:
    """Reads a call section as the model writes it (from its marker on) and says what of
    its calls is certain: a call opens once its name is read, its arguments follow as they
    grow. Each character is read once (`at` only moves forward); the subclass's `_step`
    reads what it can in its `state` and says whether it moved. A section that stops
    reading as calls is left to the whole text's parse at the finish."""

    def __init__(self, start: int, tools: Tools = None) -> None:
        self.at = start
        self.tools = tools
        self.state = "start"
        self.stopped = False
        self.sent: list[list[str]] = []  # by call: the arguments' parts sent
        self.scanned = start  # no marker being looked for starts before this
        self.json: JsonText | None = None  # arguments being read
        self.object: CallObject | None = None  # a call being read
        self.out: list[CallDelta] = []

    def read(self, text: str) -> list[CallDelta]:
        """The new parts of the calls in the output `text` (all of it so far)."""
        while not self.stopped and self._step(text):
            pass
        out, self.out = self.out, []
        return out

    def _step(self, text: str) -> bool:
        raise NotImplementedError

    def new_id(self) -> str:
        return ParsedCall("", "").id

    def _open(self, name: str) -> None:
        self.sent.append([])
        self.out.append(CallDelta(len(self.sent) - 1, ParsedCall(name, "", self.new_id())))

    def _arguments(self, part: str) -> None:
        if part:
            self.sent[-1].append(part)
            self.out.append(CallDelta(len(self.sent) - 1, arguments=part))

    def _stop(self) -> bool:
        self.stopped = True
        return False

    def _space(self, text: str, also: str = "") -> bool:
        """Skip white space (and `also`): whether a character follows."""
        while self.at < len(text) and (text[self.at].isspace() or text[self.at] in also):
            self.at += 1
        return self.at < len(text)

    def _literal(self, text: str, literal: str) -> bool | None:
        """Consume `literal` where reading is: True, False if something else is there,
        None if the text so far may yet be it."""
        if text.startswith(literal, self.at):
            self.at += len(literal)
            return True
        return None if literal.startswith(text[self.at:]) else False

    def _find(self, text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
        """The first of `markers` from where reading is, looking at each character once."""
        since = max(self.at, self.scanned)
        found = [(at, m) for m in markers if (at := text.find(m, since)) >= 0]
        if found:
            return min(found)
        self.scanned = max(since, len(text) - max(map(len, markers)) + 1)
        return None

    def _read_json(self, text: str) -> bool:
        """Stream the arguments' JSON; True once it ended."""
        assert self.json is not None
        part, self.at = self.json.feed(text, self.at)
        self._arguments(part)
        if self.json.failed:
            return self._stop()
        done, self.json = self.json.done, None if self.json.done else self.json
        return done

    def _open_json_arguments(self, text: str) -> bool:
        """The call named self.name opens at a JSON object of arguments (after spaces);
        anything else ends the section."""
        if not self._space(text):
            return False
        if text[self.at] != "{":
            return self._stop()
        self._open(self.name)
        self.json = JsonText()
        return True

    def _read_object(self, text: str) -> bool:
        """Stream a call written as one JSON object; True once it ended."""
        assert self.object is not None
        events, self.at = self.object.feed(text, self.at)
        for kind, value in events:
            self._open(value) if kind == "open" else self._arguments(value)
        if self.object.failed:
            return self._stop()
        done, self.object = self.object.done, None if self.object.done else self.object
        return done


class ReparsedCalls(CallStream):
    """The calls of a parser that has no reader of its own, read by parsing the growing
    section whole with its `parse` at each step (`at` stays at the marker). A call opens
    once its name is certain: a later call follows it, or two parses in a row name it
    alike. Its arguments go out as far as they are certain: all of them once a later call
    follows; for the last call, what two parses in a row agree on, short of trailing
    closers (`"`, `}`, `]`, white space), which a parser that completes partial JSON adds
    and the next token may move. A parse that renames a call or rewrites arguments already
    sent ends the streaming; the finish's parse sends what remains."""

    CLOSERS = '"}] \t\r\n'

    def __init__(self, start: int, tools: Tools, parse: Parse) -> None:
        super().__init__(start, tools)
        self.parse = parse
        self.names: list[str] = []  # of the calls opened
        self.previous: list[ParsedCall] = []  # the last parse's calls
        self.parsed_to = -1  # the length of the text the last parse read

    def read(self, text: str) -> list[CallDelta]:
        if self.stopped or len(text) == self.parsed_to:
            return []
        self.parsed_to = len(text)
        try:
            calls = self.parse(text[self.at:], self.tools)[1]
        except Exception:  # a plugin's parser may not take a partial text: wait for more
            calls = []
        previous, self.previous = self.previous, calls
        for i, call in enumerate(calls):
            closed = i < len(calls) - 1
            before = previous[i] if i < len(previous) else None
            if i == len(self.names):
                if not closed and (before is None or before.name != call.name):
                    break  # the name may yet grow
                self.names.append(call.name)
                self._open(call.name)
            if not self._send_arguments(i, call, closed, before):
                self.stopped = True
                break
        out, self.out = self.out, []
        return out

    def _send_arguments(self, i: int, call: ParsedCall, closed: bool,
                        before: ParsedCall | None) -> bool:
        """Send what is certain of call i's arguments; False: the parse contradicts what
        went out."""
        sent = "".join(self.sent[i])
        if call.name != self.names[i] or not call.arguments.startswith(sent):
            return False
        certain = call.arguments
        if not closed:
            agreed = _common_prefix(certain, before.arguments if before is not None else "")
            certain = agreed.rstrip(self.CLOSERS)
        if len(certain) > len(sent):
            self.sent[i].append(certain[len(sent):])
            self.out.append(CallDelta(i, arguments=certain[len(sent):]))
        return True


def _common_prefix(a: str, b: str) -> str:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return a[:size]


# --- whole texts ---------------------------------------------------------------------------

def parse_tool_calls(parser: str, text: str, tools: Tools = None
                     ) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output; text that does not parse as calls stays
    content, as vLLM keeps it."""
    return tool_parser(parser).parse(text, tools)


class HermesCalls(CallStream):
    """`<tool_call>`, a call object, (`</tool_call>` and anything up to the next)."""

    def _step(self, text: str) -> bool:
        if self.object is not None:
            return self._read_object(text)
        if self.state == "start":
            found = self._find(text, (HERMES_START,))
            if found is None:
                return False
            self.at, self.state = found[0] + len(HERMES_START), "call"
            return True
        if not self._space(text):
            return False
        if text[self.at] != "{":
            return self._stop()
        self.object, self.state = CallObject(("arguments",)), "start"
        return True


@register_tool_parser("hermes", markers=(HERMES_START,), stream=HermesCalls)
def _hermes(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = [_call(block.group(1), "arguments") for block in HERMES_BLOCK.finditer(text, start)]
    if not calls or None in calls:
        return text, []
    return text[:start] or None, calls  # type: ignore[return-value]


class Llama3Calls(CallStream):
    """(`<|python_tag|>`), call objects joined by `;`."""

    def _step(self, text: str) -> bool:
        if self.object is not None:
            return self._read_object(text)
        if self.state == "start":
            if not self._space(text):
                return False
            tag = self._literal(text, PYTHON_TAG)
            if tag is None:
                return False
            self.state = "call"
            return True
        if not self._space(text, ";" if self.sent else ""):
            return False
        if text[self.at] != "{":
            return self._stop()
        self.object = CallObject(("parameters", "arguments"))
        return True


@register_tool_parser("llama3_json", openers=("{", PYTHON_TAG), stream=Llama3Calls)
def _llama3_json(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).lstrip()
    if not body.startswith("{"):
        return text, []
    calls: list[ParsedCall] = []
    decoder, at = json.JSONDecoder(object_pairs_hook=Pairs), 0
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


class MistralCalls(CallStream):
    """`[TOOL_CALLS]` and a JSON list of call objects (or one), or per call
    `[TOOL_CALLS]name([ARGS]){...}`."""
    name = ""

    def new_id(self) -> str:
        return _mistral_id()

    def _step(self, text: str) -> bool:
        if self.object is not None:
            if not self._read_object(text):
                return False
            self.state = "list_next" if self.state == "list" else "end"
            return True
        if self.json is not None:
            if not self._read_json(text):
                return False
            self.state = "next"
            return True
        return getattr(self, f"_{self.state}")(text)

    def _start(self, text: str) -> bool:
        self.at += len(MISTRAL_START)
        self.state = "first"
        return True

    def _first(self, text: str) -> bool:
        if not self._space(text):
            return False
        if text[self.at] == "{":
            self.object, self.state = CallObject(("arguments",)), "single"
        elif text[self.at] == "[":
            self.at += 1
            self.state = "list_item"
        else:
            self.state = "name"
        return True

    def _list_item(self, text: str) -> bool:
        if not self._space(text):
            return False
        if text[self.at] != "{":
            return self._stop()
        self.object, self.state = CallObject(("arguments",)), "list"
        return True

    def _list_next(self, text: str) -> bool:
        if not self._space(text):
            return False
        if text[self.at] != ",":
            return self._stop()  # `]`: the list ended
        self.at += 1
        self.state = "list_item"
        return True

    def _name(self, text: str) -> bool:
        if not self._space(text):
            return False
        name = MISTRAL_NAME.match(text, self.at)
        if name is None or not name.group(1):
            return self._stop()
        if name.end() == len(text):
            return False  # the name may go on
        self.name, self.at, self.state = name.group(1), name.end(), "args_marker"
        return True

    def _args_marker(self, text: str) -> bool:
        if self._literal(text, MISTRAL_ARGS) is None:
            return False
        self.state = "args"
        return True

    def _args(self, text: str) -> bool:
        return self._open_json_arguments(text)

    def _next(self, text: str) -> bool:
        if not self._space(text):
            return False
        marker = self._literal(text, MISTRAL_START)
        if marker is None:
            return False
        if not marker:
            return self._stop()
        self.state = "name"
        return True

    def _end(self, text: str) -> bool:
        return self._stop()



@register_tool_parser("mistral", markers=(MISTRAL_START,), special_tokens=True,
                      stream=MistralCalls)
def _mistral(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(MISTRAL_START)
    if start < 0:
        return text, []
    body = text[start + len(MISTRAL_START):]
    if body.lstrip().startswith(("[", "{")):  # before v11: one JSON list of calls
        calls = _json_calls(body.strip())
    else:
        calls = [_mistral_call(part) for part in body.split(MISTRAL_START)]
    if not calls or None in calls:
        return text, []
    return text[:start] or None, [ParsedCall(c.name, c.arguments, _mistral_id())
                                  for c in calls]  # type: ignore[union-attr]


def _json_calls(body: str) -> list[ParsedCall | None]:
    try:
        value = loads(body)
    except ValueError:
        return []
    return [_call_of(v, "arguments") for v in (value if isinstance(value, list) else [value])]


def _mistral_call(part: str) -> ParsedCall | None:
    """`name{...}` or `name[ARGS]{...}`: the name, then one JSON object."""
    name = MISTRAL_NAME.match(part)
    if name is None:
        return None
    rest = part[name.end():].removeprefix(MISTRAL_ARGS)
    return _arguments_object(name.group(1), rest)


def _arguments_object(name: str, text: str) -> ParsedCall | None:
    try:
        value = loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return ParsedCall(name, json.dumps(value, ensure_ascii=False))


def _mistral_id() -> str:
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


class PythonicCalls(CallStream):
    """`[f(a=1), g()]`: a call opens with its first keyword argument (or its closing
    parenthesis), and each argument goes out once its value is complete, as json.dumps
    writes it into the arguments' object (the values are Python literals, read whole)."""
    name = ""
    arg_start = depth = 0
    quote = ""
    keys: list[str]

    def _step(self, text: str) -> bool:
        if self.state == "name":
            return self._name(text)
        if self.state == "args":
            return self._argument(text)
        if not self._space(text):
            return False
        c = text[self.at]
        if self.state == "start" and c == "[":
            self.at += 1
            self.state = "next"
        elif self.state == "next" and c not in ",]":
            self.arg_start, self.state = self.at, "name"
        elif self.state == "after" and c == ",":
            self.at += 1
            self.state = "next"
        else:  # the list's end, or not a list of calls
            return self._stop()
        return True

    def _name(self, text: str) -> bool:
        """The function's name, up to its parenthesis: a plain identifier."""
        while self.at < len(text) and (text[self.at].isalnum() or text[self.at] == "_"):
            self.at += 1
        if self.at == len(text):
            return False
        self.name = text[self.arg_start:self.at]
        if text[self.at] != "(" or not self.name.isidentifier():
            return self._stop()
        self.at += 1
        self.arg_start, self.depth, self.keys, self.state = self.at, 0, [], "args"
        return True

    def _argument(self, text: str) -> bool:
        """Read up to the argument's end (a comma or the call's closing parenthesis),
        past strings and brackets."""
        while self.at < len(text):
            c = text[self.at]
            if self.quote:
                if c == "\\":
                    if self.at + 1 == len(text):
                        return False
                    self.at += 2
                    continue
                ahead = text[self.at:self.at + len(self.quote)]
                if len(ahead) < len(self.quote) and self.quote.startswith(ahead):
                    return False  # maybe a triple quote's end
                if ahead == self.quote:
                    self.at += len(self.quote) - 1
                    self.quote = ""
            elif c in "'\"":
                rest = text[self.at:self.at + 3]
                if rest != c * 3 and rest == c * len(rest):
                    return False  # '' or a triple quote's start
                self.quote = c * 3 if rest == c * 3 else c
                self.at += len(self.quote) - 1
            elif c in ",)" and self.depth == 0:
                return self._argument_ended(text[self.arg_start:self.at], c == ")")
            elif c in "([{":
                self.depth += 1
            elif c in ")]}":
                if self.depth == 0:
                    return self._stop()
                self.depth -= 1
            self.at += 1
        return False

    def _argument_ended(self, source: str, last: bool) -> bool:
        self.at += 1
        if source.strip() or not last:
            pair = _python_keyword(source)
            if pair is None or pair[0] in self.keys:
                return self._stop()
            if not self.keys:
                self._open(self.name)
            self._arguments(("{" if not self.keys else ", ") + pair[1])
            self.keys.append(pair[0])
        if not last:
            self.arg_start = self.at
            return True
        if not self.keys:
            self._open(self.name)
        self._arguments("}" if self.keys else "{}")
        self.state = "after"
        return True


def _python_keyword(source: str) -> tuple[str, str] | None:
    """`key=literal` as (key, its `"key": value` in JSON), or None."""
    try:
        call = _python_call(ast.parse(f"f({source})", mode="eval").body)
    except _LITERAL_ERRORS:
        return None
    if call is None or call.arguments == "{}":
        return None
    key, = json.loads(call.arguments)
    return key, call.arguments[1:-1]


@register_tool_parser("pythonic", openers=("[",), stream=PythonicCalls)
def _pythonic(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    body = text.strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except _LITERAL_ERRORS:
        return text, []
    calls = [_python_call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
    if not calls or None in calls:
        return text, []
    return None, calls  # type: ignore[return-value]


def _python_call(node: ast.expr) -> ParsedCall | None:
    """`f(a=1, b="x")`: keyword arguments whose values are literals, nothing evaluated."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    try:
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords
                     if kw.arg is not None}
        if len(arguments) != len(node.keywords):
            return None  # a **spread, or a keyword given twice (Python refuses it)
        return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False,
                                                   allow_nan=False))
    except _LITERAL_ERRORS:  # a name, an expression, bytes, a set, inf: not JSON
        return None


class Qwen3CoderCalls(CallStream):
    """`<function=NAME>`, `<parameter=KEY>value</parameter>`s, `</function>`: a call opens
    with its name; a string parameter (by the tools' schema, or without one) streams as it
    is written, a typed one goes out once its value ends (typing needs all of it)."""
    FUNCTION_ENDS = ("</function>", "</tool_call>", QWEN_FUNCTION_START)
    VALUE_ENDS = ("</parameter>", "<parameter=", *FUNCTION_ENDS)
    function = key = ""
    value_start = 0
    written = 0  # parameters of the open call
    as_text = False  # the value being read is a string
    sent_to = -1  # how much of a string value went out; -1: not begun

    def _step(self, text: str) -> bool:
        return getattr(self, f"_{self.state}")(text)

    def _start(self, text: str) -> bool:
        found = self._find(text, (QWEN_FUNCTION_START,))
        if found is None:
            return False
        self.at, self.state = found[0] + len(QWEN_FUNCTION_START), "name"
        return True

    def _name(self, text: str) -> bool:
        name = self._up_to_bracket(text)
        if name is None:
            return False
        if not name:
            return self._stop()
        self._open(name)
        self.function, self.written, self.state = name, 0, "body"
        return True

    def _up_to_bracket(self, text: str) -> str | None:
        """A tag's name up to its `>` (stops reading at a line break: no tag)."""
        found = self._find(text, (">", "\n"))
        if found is None:
            return None
        if found[1] == "\n":
            self._stop()
            return None
        name, self.at = text[self.at:found[0]].strip(), found[0] + 1
        return name

    def _body(self, text: str) -> bool:
        found = self._find(text, ("<parameter=", *self.FUNCTION_ENDS))
        if found is None:
            return False
        at, marker = found
        if marker == "<parameter=":
            self.at, self.state = at + len(marker), "key"
            return True
        self._arguments("}" if self.written else "{}")
        self.at = at + len(marker) if marker == "</function>" else at
        self.state = "start"
        return True

    def _key(self, text: str) -> bool:
        key = self._up_to_bracket(text)
        if key is None:
            return False
        self.key, self.value_start, self.state = key, self.at, "value"
        schema = _parameter_schemas(self.tools, self.function).get(key)
        self.as_text, self.sent_to = _schema_type(schema) in (None, "string"), -1
        return True

    def _value(self, text: str) -> bool:
        found = self._find(text, self.VALUE_ENDS)
        if self.as_text:
            self._text_value(text, found)
        if found is None:
            return False
        at, marker = found
        if not self.as_text:
            value = text[self.value_start:at].removeprefix("\n").removesuffix("\n")
            schema = _parameter_schemas(self.tools, self.function).get(self.key)
            self._arguments(self._key_text() + json.dumps(_typed(value, schema),
                                                          ensure_ascii=False))
        self.written += 1
        self.at = at + len(marker) if marker == "</parameter>" else at
        self.state = "body"
        return True

    def _key_text(self) -> str:
        return ("{" if not self.written else ", ") + json.dumps(self.key, ensure_ascii=False) \
            + ": "

    def _text_value(self, text: str, found: tuple[int, str] | None) -> None:
        """Send what is certain of a string value: not its first and last line break
        (the whole parse drops them) nor what may begin the tag that ends it."""
        end = len(text) if found is None else found[0]
        if self.sent_to < 0:
            if found is None and end == self.value_start:
                return  # a line break may yet come first
            if text.startswith("\n", self.value_start) and self.value_start < end:
                self.value_start += 1
            self._arguments(self._key_text() + '"')
            self.sent_to = self.value_start
        if found is None:
            tail = text[max(self.sent_to, end - 12):]
            end -= max(_partial_marker(tail, marker) for marker in self.VALUE_ENDS)
        if end > self.sent_to and text[end - 1] == "\n":
            end -= 1
        if end > self.sent_to:
            self._arguments(encode_basestring(text[self.sent_to:end])[1:-1])
            self.sent_to = end
        if found is not None:
            self._arguments('"')


@register_tool_parser("qwen3_coder", markers=(HERMES_START, QWEN_FUNCTION_START),
                      stream=Qwen3CoderCalls)
def _qwen3_coder(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    starts = [at for at in (text.find(HERMES_START), text.find(QWEN_FUNCTION_START)) if at >= 0]
    if not starts:
        return text, []
    start = min(starts)
    functions = list(QWEN_FUNCTION.finditer(text, start))
    if not functions or len(functions) < text.count(HERMES_START, start):
        return text, []  # a <tool_call> without a function
    calls = [_qwen_call(f.group(1).strip(), f.group(2), tools) for f in functions]
    if None in calls:
        return text, []
    return text[:start] or None, calls  # type: ignore[return-value]


def _qwen_call(name: str, body: str, tools: Tools) -> ParsedCall | None:
    if not name:
        return None
    schemas = _parameter_schemas(tools, name)
    arguments = []  # a parameter written twice stays twice, as a stream sent it
    for parameter in QWEN_PARAMETER.finditer(body):
        key = parameter.group(1).strip()
        value = parameter.group(2).removeprefix("\n").removesuffix("\n")
        arguments.append((key, _typed(value, schemas.get(key))))
    return ParsedCall(name, json.dumps(Pairs(arguments), ensure_ascii=False))


def _parameter_schemas(tools: Tools, name: str) -> dict[str, Any]:
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _typed(value: str, schema: Any) -> Any:
    """A parameter's text as its schema's type; the text itself where it does not read
    as one (or there is no schema), as vLLM falls back."""
    kind = _schema_type(schema)
    if kind in (None, "string"):
        return value
    bare = value.strip()
    if bare.lower() == "null":
        return None
    try:
        if kind == "integer":
            return int(bare)
        if kind in ("number", "float"):
            return int(bare) if re.fullmatch(r"-?\d+", bare) else float(bare)
        if kind == "boolean":
            return {"true": True, "false": False}[bare.lower()]
    except (ValueError, KeyError):
        return value
    try:  # object, array and the rest: JSON, else a Python literal
        return json.loads(bare)
    except ValueError:
        pass
    try:
        literal = ast.literal_eval(bare)
        json.dumps(literal, allow_nan=False)
        return literal
    except _LITERAL_ERRORS:
        return value


def _schema_type(schema: Any) -> str | None:
    """The first non-null type a schema allows (`type`, a list of types, or anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return None
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [kinds]:
        if isinstance(kind, str) and kind != "null":
            return kind
    for option in (*schema.get("anyOf", ()), *schema.get("oneOf", ())):
        if (kind := _schema_type(option)) is not None:
            return kind
    return None


class DeepSeekV3Calls(CallStream):
    """`<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`, a ```json fence around the
    arguments, `<｜tool▁call▁end｜>`, per call."""
    name = ""

    def _step(self, text: str) -> bool:
        if self.json is not None:
            if not self._read_json(text):
                return False
            self.state = "fence_end"
            return True
        return getattr(self, f"_{self.state}")(text)

    def _start(self, text: str) -> bool:
        self.at += len(DEEPSEEK_CALLS_BEGIN)
        self.state = "call"
        return True

    def _marker(self, text: str, marker: str, state: str) -> bool:
        """Skip space, then `marker`, then go on in `state`."""
        if not self._space(text):
            return False
        found = self._literal(text, marker)
        if not found:
            return False if found is None else self._stop()
        self.state = state
        return True

    def _call(self, text: str) -> bool:
        return self._marker(text, "<｜tool▁call▁begin｜>", "kind")

    def _kind(self, text: str) -> bool:
        found = self._find(text, ("<｜tool▁sep｜>",))
        if found is None:
            return False
        kind, self.at = text[self.at:found[0]], found[0] + len(found[1])
        if kind.strip() != "function" or "<" in kind:
            return self._stop()
        self.state = "name"
        return True

    def _name(self, text: str) -> bool:
        found = self._find(text, ("\n", "<"))
        if found is None:
            return False
        self.name, self.at = text[self.at:found[0]].strip(), found[0]
        self.state = "fence"
        return True if self.name else self._stop()

    def _fence(self, text: str) -> bool:
        return self._marker(text, "```", "language")

    def _language(self, text: str) -> bool:
        if self._literal(text, "json") is None:
            return False
        self.state = "object"
        return True

    def _object(self, text: str) -> bool:
        return self._open_json_arguments(text)

    def _fence_end(self, text: str) -> bool:
        return self._marker(text, "```", "call_end")

    def _call_end(self, text: str) -> bool:
        return self._marker(text, "<｜tool▁call▁end｜>", "call")


@register_tool_parser("deepseek_v3", markers=(DEEPSEEK_CALLS_BEGIN,), special_tokens=True,
                      stream=DeepSeekV3Calls)
def _deepseek_v3(text: str, tools: Tools = None) -> tuple[str | None, list[ParsedCall]]:
    start = text.find(DEEPSEEK_CALLS_BEGIN)
    if start < 0:
        return text, []
    at, calls = start + len(DEEPSEEK_CALLS_BEGIN), []
    while (match := DEEPSEEK_CALL.match(text, at)) is not None:
        call = (_arguments_object(match["name"].strip(), match["arguments"])
                if match["kind"].strip() == "function" and match["name"].strip() else None)
        if call is None:
            return text, []
        calls.append(call)
        at = match.end()
    rest = text[at:].strip()
    if not calls or (rest and not rest.startswith(DEEPSEEK_CALLS_END)):
        return text, []  # the end marker may be missing (cut by EOS), not other text
    return text[:start] or None, calls


def _skip(body: str, at: int, separator: str) -> int:
    while at < len(body) and (body[at].isspace() or body[at] == separator):
        at += 1
    return at


def _call(text: str, arguments_key: str) -> ParsedCall | None:
    try:
        return _call_of(loads(text), arguments_key)
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


def required_schema(tools: list[dict[str, Any]], single: bool = False) -> dict[str, Any]:
    """The JSON schema that makes a model's output a list of calls of these tools (one call
    with `single`: parallel_tool_calls false)."""
    most = {"maxItems": 1} if single else {}
    return {"type": "array", "minItems": 1, **most, "items": {"anyOf": [
        {"type": "object", "required": ["name", "parameters"], "properties": {
            "name": {"type": "string", "enum": [tool["function"]["name"]]},
            "parameters": tool["function"].get("parameters") or {"type": "object"}}}
        for tool in tools]}}


def split_reasoning(parser: str, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished output."""
    form = REASONING_FORMATS[parser]
    if form.opened or form.leading:
        if form.leading and not text.startswith(form.start):
            return None, text
        text = text.removeprefix(form.start)
        reasoning, ended, content = text.partition(form.end)
        return reasoning, content
    start = text.find(form.start)
    end = text.find(form.end, start + 1)
    if start < 0 or end < 0:
        return None, text
    return text[start + len(form.start):end], text[:start] + text[end + len(form.end):]


# --- streams -------------------------------------------------------------------------------

@dataclass(slots=True)
class OutputSplitter:
    """One choice's text, released as reasoning, content and tool calls. `forced` is a
    tool_choice that leaves the model no choice: "required", or the name of the one
    function whose arguments the whole output is. `tools` are the request's (some parsers
    type arguments by them); `single_call` keeps only the first call
    (parallel_tool_calls false, as vLLM does)."""
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    forced: str | None = None
    tools: Tools = None
    single_call: bool = False
    text: str = ""  # everything so far
    released: int = 0  # how much of `text` went out
    content_from: int = 0  # where the content starts: after a leading reasoning
    thinking: bool = False  # between the reasoning's markers
    holding_calls: bool = False  # a tool call started: the rest is calls (or, if they
    # never parse, content at the finish)
    opens_content: bool = False  # the reasoning under way came first
    form: ReasoningFormat | None = None  # the reasoning parser's
    parser: ToolParser | None = None
    stream: CallStream | None = None  # the calls as they are written

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            self.form = REASONING_FORMATS[self.reasoning_parser]
            self.thinking = self.opens_content = self.form.opened
        if self.tool_parser is not None:
            self.parser = tool_parser(self.tool_parser)

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
        if not self.holding_calls or self.parser is None:
            return piece
        if self.stream is None and not finished:
            self.stream = (self.parser.stream(self.released, self.tools)
                           if self.parser.stream is not None
                           else ReparsedCalls(self.released, self.tools, self.parser.parse))
        if self.stream is not None:
            piece.calls = [d for d in self.stream.read(self.text)
                           if not self.single_call or d.index == 0]
        if finished:
            self._finish_calls(piece)
        return piece

    def _finish_calls(self, piece: Piece) -> None:
        """The whole call section parsed: a whole response's calls, and what the stream
        has not sent of them. A section that does not parse is content, as long as no call
        went out; calls sent stay as sent (a stream cannot take them back)."""
        assert self.parser is not None
        content, calls = self.parser.parse(self.text[self.released:], self.tools)
        calls = self._kept(calls)
        self.released = len(self.text)
        sent = self.stream.sent if self.stream is not None else []
        if not calls and sent:
            return
        piece.content += content or ""
        piece.tool_calls = calls
        piece.calls += self._rest_of(calls, sent)

    @staticmethod
    def _rest_of(calls: list[ParsedCall], sent: list[list[str]]) -> list[CallDelta]:
        rest = []
        for i, call in enumerate(calls):
            if i >= len(sent):
                rest.append(CallDelta(i, ParsedCall(call.name, "", call.id)))
                streamed = ""
            else:
                streamed = "".join(sent[i])
            if call.arguments.startswith(streamed) and len(call.arguments) > len(streamed):
                rest.append(CallDelta(i, arguments=call.arguments[len(streamed):]))
        return rest

    def _kept(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        return calls[:1] if self.single_call else calls

    def _forced(self, piece: Piece, finished: bool) -> Piece:
        if self.forced == "required":
            if finished:
                content, calls = parse_required(self.text)
                piece.content, piece.tool_calls = content or "", self._kept(calls)
                piece.calls = self._rest_of(piece.tool_calls, [])
            return piece
        if not self.holding_calls:  # the named call opens with the first piece
            self.holding_calls = True
            piece.opened = ParsedCall(self.forced or "", "")
        piece.arguments = self.text[self.released:]
        self.released = len(self.text)
        return piece

    def _release_reasoning(self, piece: Piece, finished: bool) -> None:
        rest, form = self.text[self.released:], self.form
        assert form is not None
        if form.opened and self.released == 0:
            if form.start.startswith(rest) and not finished:
                return  # maybe the opening marker, written again
            if rest.startswith(form.start):
                self.released += len(form.start)
                rest = rest[len(form.start):]
        end = rest.find(form.end)
        if end >= 0:
            piece.reasoning += rest[:end]
            self.released += end + len(form.end)
            self.thinking = False
            if self.opens_content:
                self.content_from = self.released
            return
        keep = 0 if finished else _partial_marker(rest, form.end)
        piece.reasoning += rest[:len(rest) - keep]
        self.released += len(rest) - keep

    def _release_content(self, piece: Piece, finished: bool) -> None:
        rest = self.text[self.released:]
        if self._opened_by_reasoning(rest, finished) or self._opened_by_calls(rest, finished):
            return
        markers = self._content_markers()
        starts = [(rest.find(m), m) for m in markers if m in rest]
        if starts:
            at, marker = min(starts)
            piece.content += rest[:at]
            self.released += at
            if self.form is not None and marker == self.form.start:
                # a reasoning that opens the content: the content starts after it
                self.opens_content = at == 0 and self.released == self.content_from
                self.released += len(marker)
                self.thinking = True
            else:
                self.holding_calls = True
            return
        keep = 0 if finished else max((_partial_marker(rest, m) for m in markers), default=0)
        piece.content += rest[:len(rest) - keep]
        self.released += len(rest) - keep

    def _opened_by_reasoning(self, rest: str, finished: bool) -> bool:
        """Whether the output opens with a leading reasoning's start ([THINK]): then the
        reasoning starts; or may yet: then nothing is released now."""
        form = self.form
        if form is None or not form.leading or self.released != 0:
            return False
        if rest.startswith(form.start):
            self.released = len(form.start)
            self.thinking = self.opens_content = True
            return True
        return not finished and form.start.startswith(rest)

    def _opened_by_calls(self, rest: str, finished: bool) -> bool:
        """Whether the content's start makes it calls (a parser's openers: `{` of Llama 3,
        `[` of pythonic), or may yet: then nothing is released now."""
        openers = self.parser.openers if self.parser is not None else ()
        if not openers or self.released != self.content_from:
            return False
        head = rest.lstrip()
        if head.startswith(openers):
            self.holding_calls = True
            return True
        return not finished and any(opener.startswith(head) for opener in openers)

    def _content_markers(self) -> list[str]:
        markers = []
        form = self.form
        if form is not None and not (form.opened or form.leading) and self.released == 0:
            markers.append(form.start)
        if self.parser is not None:
            markers += self.parser.markers
        return markers


def _partial_marker(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
