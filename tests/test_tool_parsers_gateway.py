"""A gateway process whose tool parser comes from a --tool-parser-plugin file, through the
official `openai` client, with the fake stages of tests/test_gateway.py: the plugin's parser
reads the calls (typed by the request's tools, which reach it), streamed and whole;
parallel_tool_calls false keeps the first call; a parser whose markers are special tokens
has the detokenizer keep them."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import openai
import pytest

from common import keys
from common.redis_server import EmbeddedRedis
from services.demo import demo_model_path
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, start_server
from services.gateway.tool_calls import OutputSplitter, load_tool_parser_plugin
from tests.test_gateway import exact, fake_stages, one_per_step, streamed_message

pytestmark = pytest.mark.anyio

PLUGIN = '''
import json, re
from services.gateway.tool_calls import ParsedCall, register_tool_parser

@register_tool_parser("angle_calls", markers=("<<",), special_tokens=True)
def parse(text, tools):
    """<<name {json}>> calls; a name that is not among the request's tools is no call."""
    start = text.find("<<")
    names = {t["function"]["name"] for t in tools or []}
    found = re.findall(r"<<(\\w+) (.*?)>>", text[start:])
    if start < 0 or not found or any(name not in names for name, _ in found):
        return text, []
    return text[:start] or None, [ParsedCall(n, json.dumps(json.loads(a))) for n, a in found]

@register_tool_parser("angle_partial", markers=("<<",))
def parse_partial(text, tools):
    """<<name {json}>> calls, the last one possibly unclosed: its arguments completed as a
    partial-JSON parser completes them (closing a string and the object, else {})."""
    start = text.find("<<")
    if start < 0:
        return text, []
    calls = []
    for name, arguments in re.findall(r"<<(\w+) ?(.*?)(?:>>|$)", text[start:], re.DOTALL):
        for end in ("", "}", '"}'):
            try:
                value = json.loads(arguments + end)
                break
            except ValueError:
                value = {}
        calls.append(ParsedCall(name, json.dumps(value)))
    return text[:start] or None, calls
'''
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]
OUTPUT = ["Checking", " both.<", '<get_weather {"city": "Paris"}', '>><<get_time {"city"',
          ': "Oslo"}>>']
HI = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def plugin_file(tmp_path_factory) -> Path:
    plugin = tmp_path_factory.mktemp("plugin") / "angle_parser.py"
    plugin.write_text(PLUGIN)
    return plugin


@contextmanager
def plugin_gateway(redis: EmbeddedRedis, plugin: Path, parser: str) -> Iterator[ServerProcess]:
    client = redis.client()
    client.set(keys.alive_scheduler(), "fake")
    client.set(keys.alive_worker(), "fake")
    server = start_server(["gateway", demo_model_path(), "--redis-url", redis.url,
                           "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                           "--enable-auto-tool-choice", "--tool-parser-plugin", str(plugin),
                           "--tool-call-parser", parser], plugin.parent / f"{parser}.log")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
    except BaseException:
        server.stop()
        raise
    yield server
    assert not server.stop() and server.process.returncode == 0, server.log_tail()
    client.close()


@asynccontextmanager
async def client_of(server: ServerProcess, redis: EmbeddedRedis
                    ) -> AsyncIterator[openai.AsyncOpenAI]:
    client = redis.client()
    client.delete(keys.REQUESTS, keys.admit(), keys.control(), keys.scheduler_stats())
    client.close()
    async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY,
                                  max_retries=0, timeout=20) as api:
        yield api


@pytest.fixture(scope="module")
def angle_gateway(embedded_redis: EmbeddedRedis, plugin_file: Path) -> Iterator[ServerProcess]:
    with plugin_gateway(embedded_redis, plugin_file, "angle_calls") as server:
        yield server


@pytest.fixture
async def api(angle_gateway: ServerProcess, embedded_redis: EmbeddedRedis,
              anyio_backend: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client_of(angle_gateway, embedded_redis) as api:
        yield api


async def test_a_plugin_parser_serves_calls_whole_and_streamed(embedded_redis, api):
    async with fake_stages(embedded_redis.url, exact(OUTPUT)) as seen:
        whole = await api.chat.completions.create(model=MODEL_NAME, messages=HI, tools=TOOLS)
        stream = await api.chat.completions.create(model=MODEL_NAME, messages=HI, tools=TOOLS,
                                                   stream=True)
        chunks = [chunk async for chunk in stream]
        single = await api.chat.completions.create(model=MODEL_NAME, messages=HI, tools=TOOLS,
                                                   parallel_tool_calls=False)
        single_stream = await api.chat.completions.create(
            model=MODEL_NAME, messages=HI, tools=TOOLS, parallel_tool_calls=False, stream=True)
        single_chunks = [chunk async for chunk in single_stream]
        unknown = await api.chat.completions.create(  # get_time is not among these tools
            model=MODEL_NAME, messages=HI, tools=TOOLS[:1])
        plain = await api.chat.completions.create(model=MODEL_NAME, messages=HI)
    both = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking both."
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == both
    got = streamed_message(chunks)
    assert (got["content"], got["finish"]) == ("Checking both.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == both
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in single.choices[0].message.tool_calls] == both[:1]
    assert [(c["name"], json.loads(c["arguments"]))
            for c in streamed_message(single_chunks)["calls"].values()] == both[:1]
    assert unknown.choices[0].message.tool_calls == []
    assert unknown.choices[0].message.content == "".join(OUTPUT)
    assert plain.choices[0].message.content == "".join(OUTPUT)  # no tools: no parsing
    # the parser's markers are special tokens: kept for it, only when it parses
    assert [req.params.get("skip_special_tokens") for req in seen] == [
        False, False, False, False, False, None]
    assert seen[0].tools == TOOLS


# --- a plugin without a reader: its calls streamed by parsing the growing text -----------

PARTIAL = ["Sure.", "<<", "get", "_wea", "ther", ' {"', "ci", 'ty": "', "Pa", "r", "is",
           '"}>', "><<get_time", ' {"city": "Os', 'lo"}', ">>"]


def streamed_calls(splitter: OutputSplitter, texts: list[str]) -> list[list]:
    """Each step's call deltas as (index, name or None, arguments)."""
    steps = []
    for k, text in enumerate(texts):
        piece = splitter.feed(text, k == len(texts) - 1)
        steps.append([(d.index, d.opened.name if d.opened else None, d.arguments)
                      for d in piece.calls])
    return steps


def test_reparsed_calls_never_send_what_a_later_parse_contradicts(plugin_file):
    load_tool_parser_plugin(str(plugin_file))
    whole = "".join(PARTIAL)
    rng = random.Random(0)
    for _ in range(30):  # random token boundaries
        cuts = sorted(rng.sample(range(1, len(whole)), rng.randint(5, 25)))
        texts = [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)])]
        splitter = OutputSplitter("angle_partial", tools=TOOLS)
        sent: dict[int, str] = {}
        for step in streamed_calls(splitter, texts):
            for index, _, arguments in step:
                sent[index] = sent.get(index, "") + arguments
        assert sent == {0: '{"city": "Paris"}', 1: '{"city": "Oslo"}'}, texts


async def test_a_plugin_without_a_reader_streams_arguments_as_they_grow(embedded_redis,
                                                                       plugin_file):
    with plugin_gateway(embedded_redis, plugin_file, "angle_partial") as server:
        async with client_of(server, embedded_redis) as api, \
                fake_stages(embedded_redis.url, one_per_step(PARTIAL)):
            whole = await api.chat.completions.create(model=MODEL_NAME, messages=HI,
                                                      tools=TOOLS)
            stream = await api.chat.completions.create(model=MODEL_NAME, messages=HI,
                                                       tools=TOOLS, stream=True)
            chunks = [chunk async for chunk in stream]
    deltas = [(k, call) for k, chunk in enumerate(chunks) for choice in chunk.choices
              for call in choice.delta.tool_calls or []]
    first = [call.function.arguments for _, call in deltas if call.index == 0 and not call.id]
    assert len(first) >= 3  # the arguments in parts, as they were written
    opened = [(k, call.function.name) for k, call in deltas if call.id]
    assert [name for _, name in opened] == ["get_weather", "get_time"]
    assert opened[0][0] < len(chunks) - 3  # the first call opened long before the end
    got = streamed_message(chunks)
    assert (got["content"], got["finish"]) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
