"""JSON text read as it arrives, for streaming tool calls: `JsonText` rewrites one value's
text into what `json.dumps(json.loads(text), ensure_ascii=False)` would write, piece by
piece, so a call's arguments can go out before the model finished writing them and still
add up to what the whole text parses to. `CallObject` reads a call written as one JSON
object (`{"name": ..., "arguments": {...}}`), opening the call once its name is read.

Both read forward only (each character once) and check only what they must to rewrite;
the whole text's parse at the finish stays the judge of whether calls were written."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

_SPACE = " \t\r\n"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_SCALAR_FIRST = "-0123456789tfnNI"  # numbers, true, false, null, NaN, Infinity
_SCALAR_RUN = re.compile(r'[^\s{}\[\]:,"]+')
_HIGH_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}")


class Pairs(dict):
    """A JSON object that keeps a repeated key as written: `json.loads(...,
    object_pairs_hook=Pairs)` then `json.dumps` writes what `JsonText` streams (a lookup
    sees the last value, as with a plain dict)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs

    def items(self):  # type: ignore[override]  # json's encoder writes these
        return self.pairs


def loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=Pairs)


class JsonText:
    """One JSON value's text in, its canonical text out (`, ` and `: ` separators, no other
    space, strings with only JSON's required escapes, numbers as Python writes them)."""

    __slots__ = ("depth", "in_string", "escape", "scalar", "done", "failed")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = ""  # an escape sequence read in part
        self.scalar = ""  # a number or literal read in part
        self.done = self.failed = False

    def feed(self, text: str, at: int) -> tuple[str, int]:
        """Read `text` from `at` until the value ends or the text does: (the canonical
        text of what was read, where reading stopped)."""
        out: list[str] = []
        while at < len(text) and not (self.done or self.failed):
            if self.in_string:
                at = self._string(text, at, out)
            elif self.scalar or text[at] not in _SPACE + '{}[]:,"':
                at = self._scalar(text, at, out)
            else:
                self._structure(text[at], out)
                at += 1
        return "".join(out), at

    def _structure(self, c: str, out: list[str]) -> None:
        if c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            self.failed = self.depth < 0
            self.done = self.depth == 0
        elif c == '"':
            self.in_string = True
        elif c in _SPACE:
            return
        elif self.depth == 0:  # `,` or `:` where a value should start
            self.failed = True
        out.append({":": ": ", ",": ", "}.get(c, c))

    def _scalar(self, text: str, at: int, out: list[str]) -> int:
        if not self.scalar and text[at] not in _SCALAR_FIRST:
            self.failed = True  # no number or literal starts so
            return at
        run = _SCALAR_RUN.match(text, at)
        if run is not None:
            self.scalar += run.group()
            return run.end()
        try:  # a delimiter ends it
            out.append(json.dumps(json.loads(self.scalar), ensure_ascii=False))
        except ValueError:
            self.failed = True
        self.scalar = ""
        self.done = self.depth == 0
        return at

    def _string(self, text: str, at: int, out: list[str]) -> int:
        if self.escape:
            return self._escape(text, at, out)
        run = _STRING_RUN.match(text, at)
        if run is not None:
            out.append(encode_basestring(run.group())[1:-1])
            return run.end()
        c = text[at]
        if c == '"':
            out.append(c)
            self.in_string = False
            self.done = self.depth == 0
        elif c == "\\":
            self.escape = c
        else:
            self.failed = True  # a raw control character: not JSON
        return at + 1

    def _escape(self, text: str, at: int, out: list[str]) -> int:
        """`\\n`, `\\u00e9`, or a surrogate pair's two escapes, which decode to one
        character: a high surrogate waits for what follows it."""
        e, c = self.escape, text[at]
        if len(e) >= 6 and _HIGH_SURROGATE.fullmatch(e[:6]) and (
                (len(e) == 6 and c != "\\") or (len(e) == 7 and c != "u")):
            self._decode(e[:6], out)  # a lone high surrogate; c is read again
            self.escape = e[6:]
            return at
        e += c
        if (len(e) == 2 and c != "u") or len(e) == 12 or (
                len(e) == 6 and not _HIGH_SURROGATE.fullmatch(e)):
            self._decode(e, out)
            self.escape = ""
        else:
            self.escape = e
        return at + 1

    def _decode(self, escape: str, out: list[str]) -> None:
        try:
            out.append(encode_basestring(json.loads(f'"{escape}"'))[1:-1])
        except ValueError:
            self.failed = True


@dataclass(slots=True)
class CallObject:
    """A call as one JSON object: `{"name": "f", "arguments": {...}}` (any key order,
    other keys skipped). `feed` returns events: ("open", name) once the name is read, then
    ("arguments", text) as the arguments stream; arguments written before the name wait for
    it. The first of `argument_keys` present gives the arguments: canonical JSON, or a JSON
    string's contents (held until it ends); `{}` when there is none."""
    argument_keys: tuple[str, ...]
    state: str = "open"  # open, key, colon, value, next; done or failed at the end
    value: JsonText | None = None  # the key or value being read
    read: str = ""  # its canonical text so far (not kept for arguments that stream)
    streaming: bool = False  # the value being read is the arguments, streaming
    key: str = ""
    name: str | None = None
    arguments_key: str | None = None
    waiting: list[str] = field(default_factory=list)  # arguments before the name

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "failed"

    def feed(self, text: str, at: int) -> tuple[list[tuple[str, str]], int]:
        events: list[tuple[str, str]] = []
        while at < len(text) and self.state not in ("done", "failed"):
            if self.value is not None:
                at = self._read_value(text, at, events)
            elif text[at] in _SPACE:
                at += 1
            else:
                self._punctuation(text[at], events)
                at += 1
        return events, at

    def _punctuation(self, c: str, events: list[tuple[str, str]]) -> None:
        expected = {"open": "{", "key": '"}', "colon": ":", "next": ",}"}[self.state]
        if c not in expected:
            self.state = "failed"
        elif c == "}":
            self._close(events)
        elif c in "{,":
            self.state = "key"
        else:  # the opening quote of a key, or the colon before a value
            self.value, self.read = JsonText(), ""
            if c == '"':
                self.value.in_string = True
                self.read = c

    def _read_value(self, text: str, at: int, events: list[tuple[str, str]]) -> int:
        value = self.value
        assert value is not None
        piece, at = value.feed(text, at)
        if value.failed:
            self.state = "failed"
            return at
        if (self.state != "key" and not self.read and piece[:1] not in ("", '"')
                and self._is_arguments()):
            self.streaming = True  # arguments that are not a string go out as they come
        if self.streaming:
            self._arguments(piece, events)
        else:
            self.read += piece
        if not value.done:
            return at
        if self.state == "key":
            self.key, self.value, self.state = json.loads(self.read), None, "colon"
            return at
        if not self.streaming and self._is_arguments():
            self._arguments(json.loads(self.read), events)
        self._value_read(events)
        return at

    def _is_arguments(self) -> bool:
        if self.arguments_key is None and self.key in self.argument_keys:
            self.arguments_key = self.key
        return self.key == self.arguments_key and self.key != ""

    def _value_read(self, events: list[tuple[str, str]]) -> None:
        if self.key == "name":
            name = json.loads(self.read)
            if not isinstance(name, str):
                self.state = "failed"
                return
            self.name = name
            events.append(("open", name))
            events += [("arguments", part) for part in self.waiting]
            self.waiting.clear()
        self.value, self.read, self.key, self.state = None, "", "", "next"
        self.streaming = False

    def _arguments(self, part: str, events: list[tuple[str, str]]) -> None:
        if not part:
            return
        if self.name is None:
            self.waiting.append(part)
        else:
            events.append(("arguments", part))

    def _close(self, events: list[tuple[str, str]]) -> None:
        if self.name is None:
            self.state = "failed"
            return
        if self.arguments_key is None:
            events.append(("arguments", "{}"))
        self.state = "done"
