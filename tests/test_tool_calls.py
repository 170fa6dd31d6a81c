"""The tool-call and reasoning parsers: whole texts as vLLM's parsers read them (outputs
in each model family's format, as its chat template has it write calls), and a stream split
anywhere releasing the same reasoning, content and calls; the plugin registry."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.config import TOOL_CALL_PARSERS, ConfigError, ServerConfig
from common.messages import TextDelta
from services.gateway import tool_calls
from services.gateway.core import Call, Parsers
from services.gateway.json_text import JsonText
from services.gateway.protocol import parse_job
from services.gateway.tool_calls import (TOOL_PARSERS, OutputSplitter, check_tool_parser,
                                         parse_tool_calls, split_reasoning)
from services.launcher import check_tool_parsers

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
    assert split_reasoning("mistral", "[THINK]plan[/THINK]answer") == ("plan", "answer")
    assert split_reasoning("mistral", "[THINK]still thinking") == ("still thinking", "")
    assert split_reasoning("mistral", "answer [THINK]x[/THINK]") == (
        None, "answer [THINK]x[/THINK]")  # only an output that opens with it reasons


MAGISTRAL = ("[THINK]The user wants Paris' weather; I have a tool.[/THINK]Let me check."
             '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}')


@pytest.mark.parametrize("skip, want", [(None, False), (True, True), (False, False)])
def test_mistral_reasoning_reads_magistral_and_keeps_its_special_tokens(skip, want):
    """--reasoning-parser mistral on a recorded Magistral-style output (reasoning, content,
    a call), fed a few characters at a time: [THINK] and [/THINK] are special tokens, so
    the detokenizer is told to keep them unless the client said otherwise."""
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}],
            **({} if skip is None else {"skip_special_tokens": skip})}
    call = Call(parse_job(body, True), "chatcmpl-m", "m", 1, 0.0,
                parsers=Parsers(None, "mistral"))
    assert call.requests("out", 0.0)[0].params.get("skip_special_tokens", True) is want
    pieces = [MAGISTRAL[k:k + 5] for k in range(0, len(MAGISTRAL), 5)]
    for seq, text in enumerate(pieces):
        call.offer(TextDelta("chatcmpl-m", 0, seq, text, [seq], 3,
                             "stop" if seq == len(pieces) - 1 else None))
    message = call.response().choices[0].message
    assert message.reasoning_content == "The user wants Paris' weather; I have a tool."
    assert message.content == 'Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


@pytest.mark.parametrize("kwargs, reasoning, content", [
    ({"thinking": True}, "plan", "answer"), ({"enable_thinking": True}, "plan", "answer"),
    ({"thinking": False}, None, "plan</think>answer"), (None, None, "plan</think>answer")])
def test_deepseek_v3_reasons_where_the_request_asks_for_thinking(kwargs, reasoning, content):
    """As vLLM's deepseek_v3: deepseek_r1's reading (the template opened <think>) where
    chat_template_kwargs ask for thinking, none otherwise. A stream's choices go through
    the same splitters."""
    assert ServerConfig(reasoning_parser="deepseek_v3").reasoning_parser == "deepseek_v3"
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": kwargs}
    call = Call(parse_job(body, True), "chatcmpl-x", "m", 1, 0.0,
                parsers=Parsers(None, "deepseek_v3"))
    for seq, (text, finish) in enumerate((("plan</th", None), ("ink>answer", "stop"))):
        call.offer(TextDelta("chatcmpl-x", 0, seq, text, [seq], 3, finish))
    message = call.response().choices[0].message
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert [s.reasoning_parser for s in call.splitters.values()] == \
        (["deepseek_r1"] if reasoning else [])


def streamed(splitter: OutputSplitter, text: str, cuts: list[int]):
    """(reasoning, content, the calls of the whole text, the calls a stream sends as
    (name, arguments)), from `text` fed in pieces cut at `cuts`."""
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [splitter.feed(text[a:b], finished=False) for a, b in zip(bounds, bounds[1:])]
    pieces.append(splitter.feed("", finished=True))
    return ("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces),
            [c for p in pieces for c in p.tool_calls],
            assembled([d for p in pieces for d in p.calls]))


def assembled(deltas) -> list[tuple[str, str]]:
    """The calls a client puts together from a stream's deltas, as vLLM sends them: a
    call opens once (index, id, name, no arguments yet), then its arguments come in
    non-empty parts; the calls one after another."""
    out: list[tuple[str, str]] = []
    for delta in deltas:
        if delta.opened is not None:
            assert delta.index == len(out) and delta.arguments == ""
            assert delta.opened.id and delta.opened.name and delta.opened.arguments == ""
            out.append((delta.opened.name, ""))
        else:
            assert delta.index == len(out) - 1 and delta.arguments
            out[-1] = (out[-1][0], out[-1][1] + delta.arguments)
    return out


def sent(parsed) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed]


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(0, 400), max_size=12),
       case=st.sampled_from([("hermes", None, HERMES),
                             ("hermes", "qwen3", "<think>hm <tool</think>" + HERMES),
                             ("hermes", None, "plain <tool text, no call"),
                             ("llama3_json", None, LLAMA),
                             ("llama3_json", None, "  <|python Paris."),
                             (None, "deepseek_r1", "a<th</think>b</thin"),
                             (None, "qwen3", "<thin"),
                             (None, "mistral", "[THINK]a [/THI b[/THINK]c [THINK]"),
                             (None, "mistral", "[THINK]unended [/THI"),
                             (None, "mistral", "[THIN no reasoning"),
                             ("mistral", "mistral", MAGISTRAL)]))
def test_a_stream_split_anywhere_releases_what_the_whole_text_parses_to(cuts, case):
    tool_parser, reasoning_parser, text = case
    reasoning, content, parsed, deltas = streamed(
        OutputSplitter(tool_parser, reasoning_parser), text, cuts)
    want_reasoning, rest = split_reasoning(reasoning_parser, text) if reasoning_parser \
        else (None, text)
    want_content, want_calls = parse_tool_calls(tool_parser, rest) if tool_parser \
        else (rest, [])
    assert reasoning == (want_reasoning or "")
    assert content == (want_content or "")
    assert calls(parsed) == calls(want_calls)
    assert deltas == sent(want_calls)  # the arguments' parts add up to the whole's, exactly


def test_content_before_a_call_streams_before_the_call_is_complete():
    splitter = OutputSplitter("hermes")
    assert splitter.feed("Let me look.<tool", False).content == "Let me look."
    assert splitter.feed('_call>{"name": "f", "arguments": {}}', False).content == ""
    last = splitter.feed("</tool_call>", True)
    assert last.content == "" and calls(last.tool_calls) == [("f", {})]


# --- the parsers of issue 33 ----------------------------------------------------------------

WEATHER = ("get_weather", {"city": "Paris"})
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
              '{"name": "now", "arguments": {}}]')
MISTRAL_V11 = 'Sure.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]now{}'
MISTRAL_ARGS = ('Let me check.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
                '[TOOL_CALLS]now[ARGS]{}')
PYTHONIC = ("[get_weather(city='Paris'), register(name='Jo \\'J\\' Doe', age=37, "
            "address={'city': 'Lyon', 'zip': '69001'}, role=None, ok=True, "
            "aliases=['Jo', \"Joe\"], score=-1.5)]")
QWEN_TOOLS = [{"type": "function", "function": {"name": "area", "parameters": {
    "type": "object", "properties": {
        "shape": {"type": "string"}, "dims": {"type": "object"},
        "precision": {"type": "integer"}, "scale": {"type": "number"},
        "exact": {"type": "boolean"}, "tags": {"type": "array"},
        "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "label": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
QWEN = ("I will compute it.\n<tool_call>\n<function=area>\n<parameter=shape>\ncircle\n"
        "</parameter>\n<parameter=dims>\n{\"radius\": 15.5}\n</parameter>\n"
        "<parameter=precision>\n3\n</parameter>\n<parameter=scale>\n2\n</parameter>\n"
        "<parameter=exact>\nFalse\n</parameter>\n<parameter=tags>\n['a', 'b']\n</parameter>\n"
        "<parameter=limit>\nnull\n</parameter>\n<parameter=label>\nnull\n</parameter>\n"
        "<parameter=note>\nline 1\nline 2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")
QWEN_AREA = ("area", {"shape": "circle", "dims": {"radius": 15.5}, "precision": 3, "scale": 2,
                      "exact": False, "tags": ["a", "b"], "limit": None, "label": "null",
                      "note": "line 1\nline 2"})
DEEPSEEK = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
            "get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>search_hotels\n```json\n"
            "{\"location\": \"Paris\", \"nights\": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")

RECORDED = [  # (parser, output, content, calls)
    ("mistral", MISTRAL_V3, None, [WEATHER, ("now", {})]),
    ("mistral", MISTRAL_V11, "Sure.", [WEATHER, ("now", {})]),
    ("mistral", MISTRAL_ARGS, "Let me check.", [WEATHER, ("now", {})]),
    # a detokenizer that puts spaces between special tokens
    ("mistral", '[TOOL_CALLS] get_weather [ARGS] {"city": "Paris"}', None, [WEATHER]),
    ("deepseek_v3", DEEPSEEK.replace("｜>", "｜> ").replace("<｜", " <｜"), "Let me check. ", [
        WEATHER, ("search_hotels", {"location": "Paris", "nights": 2})]),
    ("pythonic", PYTHONIC, None, [WEATHER, ("register", {
        "name": "Jo 'J' Doe", "age": 37, "address": {"city": "Lyon", "zip": "69001"},
        "role": None, "ok": True, "aliases": ["Jo", "Joe"], "score": -1.5})]),
    ("pythonic", " [now()]\n", None, [("now", {})]),
    ("qwen3_coder", QWEN, "I will compute it.\n", [QWEN_AREA, WEATHER]),
    ("qwen3_coder", "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>", None, [WEATHER]),  # no <tool_call> around it
    ("qwen3_coder", "<tool_call>\n<function=now>\n</tool_call>\n<tool_call><function="
                    "get_weather><parameter=city>Paris", None, [("now", {}), WEATHER]),  # unclosed
    ("deepseek_v3", DEEPSEEK, "Let me check.", [
        WEATHER, ("search_hotels", {"location": "Paris", "nights": 2})]),
    ("deepseek_v3", DEEPSEEK.removesuffix("<｜tool▁calls▁end｜>"), "Let me check.", [
        WEATHER, ("search_hotels", {"location": "Paris", "nights": 2})]),  # cut by EOS
]

MALFORMED = [  # (parser, output): each must come back whole, as content
    ("mistral", "Paris is sunny."),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Par'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]'),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS][1, 2]"),
    ("pythonic", "The list is [1, 2]."),
    ("pythonic", "[1, 2]"),
    ("pythonic", "[get_weather(city='Paris')"),
    ("pythonic", "[get_weather('Paris')]"),  # positional
    ("pythonic", "[get_weather(city=__import__('os').getcwd())]"),  # never evaluated
    ("pythonic", "[get_weather(city=CITY)]"),
    ("pythonic", "[get_weather(**{'city': 'Paris'})]"),
    ("pythonic", "[f(x=b'z')]"),  # bytes are not JSON
    ("pythonic", "[f(x=1e999)]"),  # nor is infinity
    ("pythonic", "[os.system(cmd='ls')]"),
    ("pythonic", "[get_weather(city='Paris', city='Lyon')]"),  # Python refuses it too
    ("qwen3_coder", "Use <tool_call> tags to call tools."),
    ("qwen3_coder", "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=>\n</function>\n</tool_call>"),
    ("deepseek_v3", "No tools needed."),
    ("deepseek_v3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                    "\n```json\n{\"city\": \"Paris\"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                    "{\"city\": \"Paris\"}\n```<｜tool▁calls▁end｜>"),
    ("deepseek_v3", DEEPSEEK.replace("<｜tool▁calls▁end｜>", "and then some")),
]


@pytest.mark.parametrize("parser, text, content, expected", RECORDED)
def test_recorded_outputs_parse_whole(parser, text, content, expected):
    got_content, parsed = parse_tool_calls(parser, text, QWEN_TOOLS)
    assert got_content == content
    assert calls(parsed) == expected
    assert len({c.id for c in parsed}) == len(parsed)


def test_mistral_call_ids_are_nine_letters_and_digits():
    """Mistral's chat templates refuse other ids in the history."""
    for text in (MISTRAL_V3, MISTRAL_V11, MISTRAL_ARGS):
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c.id)
                   for c in parse_tool_calls("mistral", text)[1])


def test_qwen3_coder_values_stay_text_without_a_schema():
    content, parsed = parse_tool_calls("qwen3_coder", QWEN, None)
    assert calls(parsed)[0][1]["precision"] == "3" and calls(parsed)[0][1]["exact"] == "False"
    bad = QWEN.replace("\n3\n</parameter>", "\nthree\n</parameter>")
    assert calls(parse_tool_calls("qwen3_coder", bad, QWEN_TOOLS)[1])[0][1]["precision"] \
        == "three"  # not an integer: the text, as vLLM falls back


@pytest.mark.parametrize("parser, text, content, expected",
                         [case for case in RECORDED if case[2] is not None])
def test_content_before_the_calls_streams_before_they_finish(parser, text, content, expected):
    splitter = OutputSplitter(parser, tools=QWEN_TOOLS)
    first = splitter.feed(text, finished=False)
    assert first.content == content and first.tool_calls == []
    last = splitter.feed("", finished=True)
    assert last.content == "" and calls(last.tool_calls) == expected


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_outputs_stay_content(parser, text):
    assert parse_tool_calls(parser, text, QWEN_TOOLS) == (text, [])


LLAMA_ODD = ('{"parameters": {"q": "caf\\u00e9 \\ud83d\\ude00", "n": 1.50, "e": 2E3}, '
             '"name": "search"};{"name": "now"} ; {"name": "say", "arguments": "{\\"a\\": 1}"}')
STREAM_CASES = ([(parser, text) for parser, text, _, _ in RECORDED] + MALFORMED
                + [("pythonic", "  [no"), ("mistral", "a [TOOL_CALL"),
                   ("deepseek_v3", "x<｜tool▁calls▁be")]
                + [("hermes", HERMES), ("llama3_json", LLAMA), ("llama3_json", LLAMA_ODD)])
# Malformed outputs whose fault shows only after a call's name and arguments began: a
# stream has sent the call by then and cannot take it back (as vLLM's cannot); the whole
# response has them as content.
FOUND_OUT_LATE = {
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Par',  # cut short
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}',  # list unclosed
    "[get_weather(city='Paris')",  # likewise
    "[get_weather(city='Paris', city='Lyon')]",  # its first argument went out
    MALFORMED[-3][1],  # a brace missing before the fence
    MALFORMED[-1][1],  # text after the calls
}


@settings(max_examples=500, deadline=None)
@given(cuts=st.lists(st.integers(0, 900), max_size=16), case=st.sampled_from(STREAM_CASES),
       think=st.booleans())
def test_new_parsers_streamed_in_any_chunks_match_the_whole_text(cuts, case, think):
    parser, text = case
    reasoning_parser = "qwen3" if think else None
    output = "<think>plan [f()] <tool_call></think>" + text if think else text
    reasoning, content, parsed, deltas = streamed(
        OutputSplitter(parser, reasoning_parser, tools=QWEN_TOOLS), output, cuts)
    want_content, want_calls = parse_tool_calls(parser, text, QWEN_TOOLS)
    assert reasoning == ("plan [f()] <tool_call>" if think else "")
    if text in FOUND_OUT_LATE and deltas:
        assert want_calls == [] and parsed == []
        assert text.startswith(content) and all(name in text for name, _ in deltas)
        return
    assert content == (want_content or "")
    assert calls(parsed) == calls(want_calls)
    assert deltas == sent(want_calls)  # the arguments' parts add up to the whole's, exactly


ARGUMENTS_STREAM = [("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL_V3),
                    ("mistral", MISTRAL_ARGS), ("deepseek_v3", DEEPSEEK), ("qwen3_coder", QWEN)]


@pytest.mark.parametrize("parser, text", ARGUMENTS_STREAM + [("pythonic", PYTHONIC)])
def test_calls_stream_as_they_are_written(parser, text):
    """Fed a character at a time, a call opens before the output ends and its arguments
    follow in parts (JSON as it comes, qwen3_coder's string values as they come and typed
    ones each whole; pythonic an argument at a time, its values being Python literals),
    before the next call opens."""
    splitter = OutputSplitter(parser, tools=QWEN_TOOLS)
    arrivals = [(at, d) for at, c in enumerate(text) for d in splitter.feed(c, False).calls]
    last = splitter.feed("", True).calls
    opens = [at for at, d in arrivals if d.opened is not None]
    parts = [[d.arguments for _, d in arrivals if d.index == i and d.arguments]
             for i in range(2)]
    assert len(opens) == 2 and len(last) <= 1
    whole = parse_tool_calls(parser, text, QWEN_TOOLS)[1]
    if parser == "pythonic":  # {"city": "Paris" then }; the second call's 7 arguments
        assert len(parts[0]) == 2 and len(parts[1]) == 8
        assert "".join(parts[1]) == whole[1].arguments
    else:
        assert len(parts[0]) >= 3
    assert "".join(parts[0]) == whole[0].arguments


def test_a_long_call_streams_reading_each_character_once(monkeypatch):
    """A character at a time, the JSON reader sees each character once: no delta
    re-reads the text so far (which would make a long call quadratic)."""
    read: list[int] = []
    feed = JsonText.feed

    def counted(self, text, at):
        out, end = feed(self, text, at)
        read.append(end - at)
        return out, end
    monkeypatch.setattr(JsonText, "feed", counted)
    value = "Paris " * 4000
    for parser, text in (
            ("hermes", f'<tool_call>{{"name": "f", "arguments": {{"s": "{value}"}}}}'),
            ("mistral", f'[TOOL_CALLS]f[ARGS]{{"s": "{value}"}}'),
            ("deepseek_v3", DEEPSEEK.replace('"Paris"', f'"{value}"'))):
        read.clear()
        splitter = OutputSplitter(parser)
        deltas = [d for c in text for d in splitter.feed(c, False).calls]
        deltas += splitter.feed("", True).calls
        assert len(read) > len(value) and sum(read) < len(text)
        assert "".join(d.arguments for d in deltas if d.index == 0) == \
            json.dumps({"s" if parser != "deepseek_v3" else "city": value})


@settings(max_examples=300, deadline=None)
@given(value=st.lists(st.sampled_from(["a", "\n", "<", "</", "</parameter", "<parameter=x>",
                                       "</tool_call>", "é", '"', "\\", " "]),
                      max_size=12).map("".join),
       cuts=st.lists(st.integers(0, 200), max_size=12), closed=st.booleans())
def test_qwen3_coder_string_values_stream_as_the_whole_parse_reads_them(value, cuts, closed):
    """Line breaks at a value's ends dropped, tags that end it (or only look like it)
    told apart across any cut, escapes as json.dumps writes them."""
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>" + value
            + ("</parameter>\n</function>\n</tool_call>" if closed else ""))
    _, want = parse_tool_calls("qwen3_coder", text, QWEN_TOOLS)
    _, _, parsed, deltas = streamed(OutputSplitter("qwen3_coder", tools=QWEN_TOOLS), text,
                                    cuts)
    assert deltas == sent(want) == sent(parsed)


def test_json_arguments_stream_as_json_dumps_writes_them():
    """Space, escapes and numbers as the whole text's parse writes them, a repeated key
    kept (in both), a string of arguments as its contents."""
    text = ('<tool_call>{"name": "f", "arguments": { "s":"a\\"b\\/\\u00e9\\n",'
            '"n" : [1.0, -0, 1e2, true, null],"n": {}}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": "{\\"x\\": 1}"}</tool_call>')
    _, _, parsed, deltas = streamed(OutputSplitter("hermes"), text, list(range(len(text))))
    assert deltas == sent(parsed) == [
        ("f", '{"s": "a\\"b/é\\n", "n": [1.0, 0, 100.0, true, null], "n": {}}'),
        ("g", '{"x": 1}')]


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("mistral", MISTRAL_ARGS),
                                          ("pythonic", PYTHONIC), ("qwen3_coder", QWEN),
                                          ("deepseek_v3", DEEPSEEK)])
def test_parallel_tool_calls_false_keeps_the_first_call(parser, text):
    whole = OutputSplitter(parser, tools=QWEN_TOOLS, single_call=True).feed(text, True)
    _, all_calls = parse_tool_calls(parser, text, QWEN_TOOLS)
    assert len(all_calls) == 2 and calls(whole.tool_calls) == calls(all_calls[:1])
    _, _, parsed, deltas = streamed(
        OutputSplitter(parser, tools=QWEN_TOOLS, single_call=True), text, [3, 17, 40])
    assert calls(parsed) == calls(all_calls[:1]) and deltas == sent(all_calls[:1])
    required = OutputSplitter(forced="required", single_call=True).feed(
        '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]', True)
    assert calls(required.tool_calls) == [("a", {})]


# --- the registry and --tool-parser-plugin ----------------------------------------------------

PLUGIN = """
import json, re
from services.gateway.tool_calls import ParsedCall, register_tool_parser

@register_tool_parser("angle_calls", markers=("<<",))
def parse(text, tools):
    start = text.find("<<")
    names = {t["function"]["name"] for t in tools or []}
    found = re.findall(r"<<(\\w+) (.*?)>>", text[start:])
    if start < 0 or not found or any(name not in names for name, _ in found):
        return text, []
    return text[:start] or None, [ParsedCall(n, json.dumps(json.loads(a))) for n, a in found]
"""


@pytest.fixture
def registry(monkeypatch):
    """The registry as it is, restored after the test (a plugin adds to it)."""
    monkeypatch.setattr(tool_calls, "TOOL_PARSERS", dict(TOOL_PARSERS))
    monkeypatch.setattr(tool_calls, "_loaded_plugins", set())
    return tool_calls


def test_the_config_lists_the_built_in_parsers():
    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS)


def test_a_plugin_registers_a_parser_that_streams_like_the_built_in_ones(registry, tmp_path):
    plugin = tmp_path / "my_parsers.py"
    plugin.write_text(PLUGIN)
    with pytest.raises(ValueError, match=r"'angle_calls' is not a known tool parser; known: "
                                         r"\['deepseek_v3', 'hermes', 'llama3_json'"):
        check_tool_parser("angle_calls")
    check_tool_parser("angle_calls", str(plugin))
    check_tool_parser("angle_calls", str(plugin))  # loaded once
    text = 'Looking.<<get_weather {"city": "Paris"}>><<area {"shape": "square"}>>'
    assert calls(parse_tool_calls("angle_calls", text, QWEN_TOOLS)[1]) == [
        WEATHER, ("area", {"shape": "square"})]
    reasoning, content, parsed, deltas = streamed(
        OutputSplitter("angle_calls", tools=QWEN_TOOLS), text, [5, 9, 10, 30])
    assert content == "Looking." and calls(parsed) == [WEATHER, ("area", {"shape": "square"})]
    assert deltas == sent(parsed)  # no stream of its own: each call whole at the finish
    assert parse_tool_calls("angle_calls", text, None) == (text, [])  # the plugin's rule


def test_bad_plugins_and_names_are_refused_at_startup(registry, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('no such model family')\n")
    with pytest.raises(ValueError, match="--tool-parser-plugin .*broken.py.* failed: "
                                         "RuntimeError: no such model family"):
        check_tool_parser("x", str(broken))
    with pytest.raises(ValueError, match="no such file"):
        check_tool_parser("x", str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="at least one non-empty marker"):
        tool_calls.register_tool_parser("nothing")
    empty = tmp_path / "empty.py"
    empty.write_text("")
    server = ServerConfig(enable_auto_tool_choice=True, tool_call_parser="angle_calls",
                          tool_parser_plugin=str(empty))  # the name is checked on load
    with pytest.raises(ConfigError, match=r"'angle_calls' is not a known tool parser; known: "
                                          r"\['deepseek_v3', 'hermes', 'llama3_json', "
                                          r"'mistral', 'pythonic', 'qwen3_coder'\]"):
        check_tool_parsers(server)
    with pytest.raises(ConfigError, match=r"--tool-call-parser must be one of \['hermes', "
                                          r"'llama3_json', 'mistral', 'pythonic'"):
        ServerConfig(tool_call_parser="angle_calls")
    with pytest.raises(ConfigError, match="--tool-parser-plugin: no such file"):
        ServerConfig(tool_call_parser="x", tool_parser_plugin=str(tmp_path / "missing.py"))
    for name in TOOL_CALL_PARSERS:
        check_tool_parsers(ServerConfig(enable_auto_tool_choice=True, tool_call_parser=name))
