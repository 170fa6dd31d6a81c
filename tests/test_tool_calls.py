"""The tool-call and reasoning parsers: whole texts as vLLM's parsers read them, and a
stream split anywhere releasing the same reasoning, content and calls."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.tool_calls import (OutputSplitter, parse_tool_calls,
                                         split_reasoning)

HERMES = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
LLAMA = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "now", "parameters": {}}')


def calls(parsed) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed]


def test_hermes_blocks_after_content():
    content, parsed = parse_tool_calls("hermes", HERMES)
    assert content == "Let me look."
    assert calls(parsed) == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert len({c.id for c in parsed}) == 2 and parsed[0].id.startswith("chatcmpl-tool-")
    # a last block cut off by EOS before its closing tag still parses
    assert calls(parse_tool_calls("hermes", HERMES.removesuffix("\n</tool_call>"))[1])[1] \
        == ("now", {})


def test_llama3_json_calls_with_or_without_the_python_tag():
    assert calls(parse_tool_calls("llama3_json", LLAMA)[1]) == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    content, parsed = parse_tool_calls("llama3_json", ' {"name": "f", "parameters": {"x": 1}}')
    assert content is None and calls(parsed) == [("f", {"x": 1})]


@pytest.mark.parametrize("parser, text", [
    ("hermes", "no calls here"), ("hermes", "<tool_call>{not json</tool_call>"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),
    ("llama3_json", "Paris is the capital."), ("llama3_json", '{"name": "f", "param'),
    ("llama3_json", '{"no_name": 1}')])
def test_text_that_is_not_a_call_stays_content(parser, text):
    assert parse_tool_calls(parser, text) == (text, [])


def test_reasoning_splits():
    assert split_reasoning("deepseek_r1", "plan</think>answer") == ("plan", "answer")
    assert split_reasoning("deepseek_r1", "<think>plan</think>answer") == ("plan", "answer")
    assert split_reasoning("deepseek_r1", "still thinking") == ("still thinking", "")
    assert split_reasoning("qwen3", "<think>plan</think>answer") == ("plan", "answer")
    assert split_reasoning("qwen3", "no think") == (None, "no think")


def streamed(splitter: OutputSplitter, text: str, cuts: list[int]):
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [splitter.feed(text[a:b], finished=False) for a, b in zip(bounds, bounds[1:])]
    pieces.append(splitter.feed("", finished=True))
    return ("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces),
            [c for p in pieces for c in p.tool_calls])


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12),
       case=st.sampled_from([("hermes", None, HERMES),
                             ("hermes", "qwen3", "<think>hm <tool</think>" + HERMES),
                             ("hermes", None, "plain <tool text, no call"),
                             ("llama3_json", None, LLAMA),
                             ("llama3_json", None, "  <|python Paris."),
                             (None, "deepseek_r1", "a<th</think>b</thin"),
                             (None, "qwen3", "<thin")]))
def test_a_stream_split_anywhere_releases_what_the_whole_text_parses_to(cuts, case):
    tool_parser, reasoning_parser, text = case
    reasoning, content, parsed = streamed(OutputSplitter(tool_parser, reasoning_parser),
                                          text, cuts)
    want_reasoning, rest = split_reasoning(reasoning_parser, text) if reasoning_parser \
        else (None, text)
    want_content, want_calls = parse_tool_calls(tool_parser, rest) if tool_parser \
        else (rest, [])
    assert reasoning == (want_reasoning or "")
    assert content == (want_content or "")
    assert calls(parsed) == calls(want_calls)


def test_content_before_a_call_streams_before_the_call_is_complete():
    splitter = OutputSplitter("hermes")
    assert splitter.feed("Let me look.<tool", False).content == "Let me look."
    assert splitter.feed('_call>{"name": "f", "arguments": {}}', False).content == ""
    last = splitter.feed("</tool_call>", True)
    assert last.content == "" and calls(last.tool_calls) == [("f", {})]
