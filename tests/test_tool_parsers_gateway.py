"""A gateway process whose tool parser comes from a --tool-parser-plugin file, through the
official `openai` client, with the fake stages of tests/test_gateway.py: the plugin's parser
reads the calls (typed by the request's tools, which reach it), streamed and whole;
parallel_tool_calls false keeps the first call; a parser whose markers are special tokens
has the detokenizer keep them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import openai
import pytest

from common import keys
from common.redis_server import EmbeddedRedis
from services.demo import demo_model_path
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, start_server
from tests.test_gateway import exact, fake_stages, streamed_message

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
'''
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("get_weather", "get_time")]
OUTPUT = ["Checking", " both.<", '<get_weather {"city": "Paris"}', '>><<get_time {"city"',
          ': "Oslo"}>>']
HI = [{"role": "user", "content": "Weather and time?"}]


@pytest.fixture(scope="module")
def plugin_gateway(embedded_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[ServerProcess]:
    client = embedded_redis.client()
    client.set(keys.alive_scheduler(), "fake")
    client.set(keys.alive_worker(), "fake")
    root = tmp_path_factory.mktemp("plugin_gateway")
    plugin = root / "angle_parser.py"
    plugin.write_text(PLUGIN)
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                           "--enable-auto-tool-choice", "--tool-parser-plugin", str(plugin),
                           "--tool-call-parser", "angle_calls"], root / "gateway.log")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
    except BaseException:
        server.stop()
        raise
    yield server
    assert not server.stop() and server.process.returncode == 0, server.log_tail()
    client.close()


@pytest.fixture
async def api(plugin_gateway: ServerProcess, embedded_redis: EmbeddedRedis,
              anyio_backend: str) -> AsyncIterator[openai.AsyncOpenAI]:
    client = embedded_redis.client()
    client.delete(keys.REQUESTS, keys.admit(), keys.control(), keys.scheduler_stats())
    client.close()
    async with openai.AsyncOpenAI(base_url=plugin_gateway.url + "/v1", api_key=API_KEY,
                                  max_retries=0, timeout=20) as api:
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
