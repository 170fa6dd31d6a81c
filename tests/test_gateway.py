"""The gateway process against a real Redis, with real HTTP clients (aiohttp and the
official `openai` package). Nothing runs behind it but what a test plays: `fake_stages`
keeps the liveness keys set and answers each request on hr:requests with scripted
replies (deltas out of order and twice, errors, silence), the way the tokenizer,
scheduler and detokenizer would."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import random
import re
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
import anyio
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from common import messages
from common import keys
from common.bus import Bus
from common.messages import (ErrorReply, GenerateRequest, ReplyBatch, SchedulerStats, TextDelta,
                             WorkerFailed)
from common.model_files import resolve_model
from common.redis_server import EmbeddedRedis
from services.demo import demo_model_path
from services.gateway.shell import WATCH_S
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, start_server

pytestmark = pytest.mark.anyio
MAX_QUEUE_LEN = 3
MAX_REQUEST_BODY = 4096
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HANG = "hang"  # a script step: the stages go silent for this request

Step = ReplyBatch | ErrorReply | float | str | list[ReplyBatch]
Script = Callable[[GenerateRequest], list[Step]]


@pytest.fixture(scope="module")
def gateway(embedded_redis: EmbeddedRedis, tmp_path_factory) -> Iterator[ServerProcess]:
    """A gateway that sees a live scheduler and worker from its first look on."""
    client = embedded_redis.client()
    client.set(keys.alive_scheduler(), "fake")
    client.set(keys.alive_worker(), "fake")
    root = tmp_path_factory.mktemp("gateway")
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
                           "--max-queue-len", str(MAX_QUEUE_LEN),
                           "--max-request-body", str(MAX_REQUEST_BODY),
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                           "--reasoning-parser", "qwen3"],
                          root / "gateway.log")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
    except BaseException:
        server.stop()
        raise
    yield server
    assert not server.stop() and server.process.returncode == 0, server.log_tail()
    assert not client.keys("hr:replies:*"), "the gateway left its reply stream behind"
    client.close()


@pytest.fixture
def url(gateway: ServerProcess, embedded_redis: EmbeddedRedis) -> str:
    """The gateway's URL, with the pipeline's streams empty. A test that deletes a
    liveness key sets it again and waits `until_admitting` before it ends."""
    client = embedded_redis.client()
    client.delete(keys.REQUESTS, keys.admit(), keys.control(), keys.scheduler_stats())
    client.close()
    return gateway.url


@pytest.fixture
def rdb(embedded_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    client = embedded_redis.client()
    yield client
    client.close()


@pytest.fixture
def redis_at(embedded_redis: EmbeddedRedis) -> str:
    """The URL of the gateway's Redis, for the fake stages."""
    return embedded_redis.url


def client(url: str, key: str = API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


@pytest.fixture
async def api(url: str, anyio_backend: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with client(url) as api:
        yield api


# --- the fake stages ----------------------------------------------------------------------

def deltas(req: GenerateRequest, texts: list[str], n: int = 1,
           finish: str = "length") -> list[TextDelta]:
    """Completion i of `req` is texts with an "i" suffix, one token per text."""
    return [TextDelta(req.rid, i, seq, f"{text}{i}", [10 + seq], 3,
                      finish if seq == len(texts) - 1 else None)
            for i in range(n) for seq, text in enumerate(texts)]


def in_order(texts: list[str], n: int = 1) -> Script:
    return lambda req: [ReplyBatch(deltas(req, texts, n))]


def exact(texts: list[str], finish: str = "stop") -> Script:
    """One completion whose deltas are exactly `texts`, one token each."""
    return lambda req: [ReplyBatch([
        TextDelta(req.rid, 0, seq, text, [10 + seq], 3,
                  finish if seq == len(texts) - 1 else None)
        for seq, text in enumerate(texts)])]


def shuffled_twice(texts: list[str], n: int, seed: int = 0) -> Script:
    """Every delta twice, in random order, one per batch."""
    def script(req: GenerateRequest) -> list[Step]:
        items = deltas(req, texts, n) * 2
        random.Random(seed).shuffle(items)
        return [ReplyBatch([item]) for item in items]
    return script


async def play(bus: Bus, req: GenerateRequest, steps: list[Step]) -> None:
    for step in steps:
        if step == HANG:
            await anyio.sleep_forever()
        elif isinstance(step, float):
            await anyio.sleep(step)
        elif isinstance(step, list):  # one write: the gateway reads them all at once
            await bus.publish(keys.replies(req.reply_to), *step)
        else:
            await bus.publish(keys.replies(req.reply_to), step)


@asynccontextmanager
async def fake_stages(redis_url: str, script: Script) -> AsyncIterator[list[GenerateRequest]]:
    """Answer every request on hr:requests with `script(request)`; yields the requests
    seen."""
    seen: list[GenerateRequest] = []
    async with Bus(redis_url) as bus, anyio.create_task_group() as tasks:
        async def answer() -> None:
            while True:
                entries = await bus.read("tokenizer", "fake", {keys.REQUESTS: ">"}, count=16,
                                         block_ms=100)
                for entry in entries:
                    seen.append(entry.msg)
                    tasks.start_soon(play, bus, entry.msg, script(entry.msg))
                await bus.ack(entries)
        await bus.ensure_group(keys.REQUESTS, "tokenizer")
        tasks.start_soon(answer)
        yield seen
        tasks.cancel_scope.cancel()


async def aborted(redis_url: str, rids: set[str], timeout_s: float = 5.0) -> set[str]:
    """The rids of `rids` that an Abort on hr:control names, waiting up to `timeout_s`."""
    found: set[str] = set()
    async with Bus(redis_url) as bus:
        with anyio.move_on_after(timeout_s):
            while found != rids:
                entries = await bus.redis.xrange(keys.control())
                found = {messages.decode(fields[b"body"]).rid for _, fields in entries} & rids
                await anyio.sleep(0.05)
    return found


async def until_admitting(url: str, redis_at: str) -> None:
    """Wait until the gateway admits requests: it looks at the liveness keys and the queue
    depth a few times a second."""
    body = {"model": MODEL_NAME, "prompt": "hi"}
    async with fake_stages(redis_at, in_order(["a"])), aiohttp.ClientSession() as session:
        with anyio.fail_after(5):
            while True:
                async with session.post(url + "/v1/completions", json=body,
                                        headers=AUTH) as response:
                    if response.status == 200:
                        return
                await anyio.sleep(0.05)


@dataclass
class Sse:
    status: int
    headers: dict[str, str]
    events: list[str]


async def post_sse(url: str, path: str, body: dict) -> Sse:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=AUTH) as response:
            text = await response.text()
    if not response.headers["Content-Type"].startswith("text/event-stream"):
        return Sse(response.status, dict(response.headers), [text])  # an error, as JSON
    events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
    return Sse(response.status, dict(response.headers), events)


# --- without a backend ------------------------------------------------------------------

async def test_v1_routes_need_the_api_key(url):
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            async with session.get(url + "/v1/models", headers=headers) as response:
                assert response.status == 401
                error = (await response.json())["error"]
                assert error["type"] == "AuthenticationError" and error["code"] == 401
        for path in ("/health", "/version", "/metrics"):
            async with session.get(url + path) as response:
                assert response.status != 401
        async with session.post(url + "/tokenize", json={"prompt": "a"}) as response:
            assert response.status == 200
    async with client(url, key="nope") as api:
        with pytest.raises(openai.AuthenticationError):
            await api.completions.create(model=MODEL_NAME, prompt="hi")


async def test_models_and_version(url, api):
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == 8192 and models.data[0].owned_by == "headrace"
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/version") as response:
            assert await response.json() == {"version": importlib.metadata.version("headrace")}


async def test_an_unknown_model_is_404(url, rdb, api):
    with pytest.raises(openai.NotFoundError) as info:
        await api.completions.create(model="gpt-9", prompt="hi")
    assert "gpt-9" in info.value.message and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(model="gpt-9", messages=[{"role": "user",
                                                                   "content": "hi"}])
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/tokenize", json={"model": "x", "prompt": "a"}) as r:
            assert r.status == 404
    assert rdb.xlen(keys.REQUESTS) == 0


async def test_nothing_a_client_sends_names_a_redis_key(url, rdb):
    """Request ids and reply streams are the server's own (a uuid, the gateway's id):
    a client's header, model name or user field that spells another stream's name
    reaches no key, and the one request it makes goes to hr:requests only."""
    victim = "hr:replies:victim"
    headers = {**AUTH, "X-Request-Id": victim, "X-Gateway": victim}
    async with aiohttp.ClientSession() as session:
        for model in (victim, f"{MODEL_NAME}\r\n{victim}"):
            body = {"model": model, "prompt": "a", "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=body,
                                    headers=headers) as response:
                assert response.status == 404
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 1, "user": victim,
                "stream": True}
        with anyio.move_on_after(1):  # no stages behind this gateway: nothing answers
            await session.post(url + "/v1/completions", json=body, headers=headers)
    assert not rdb.exists(victim)
    (_, [(_, fields)]), = rdb.xread({keys.REQUESTS: "0"})
    request = messages.decode(fields[b"body"])
    assert request.rid.startswith("cmpl-") and victim not in request.rid
    assert victim not in request.reply_to


async def test_a_body_over_the_limit_is_413(url):
    body = {"model": MODEL_NAME, "prompt": "x" * MAX_REQUEST_BODY}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body, headers=AUTH) as response:
            assert response.status == 413
            error = (await response.json())["error"]
    assert error["code"] == 413 and str(MAX_REQUEST_BODY) in error["message"]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "temperature": -1},
     "temperature"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a", "top_p": "x"}, "top_p"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": []}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 10**8], "echo": True}, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "a",
                         "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user"}],
                              "tools": [{"type": "function"}]}, "tools"),
])
async def test_invalid_requests_are_400_and_queue_nothing(url, rdb, path, body, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, data=data, headers=AUTH) as response:
            assert response.status == 400
            error = (await response.json())["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param
    assert rdb.xlen(keys.REQUESTS) == 0


async def test_the_openai_client_sees_400s(api):
    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model=MODEL_NAME, prompt="a", temperature=-0.5)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError):
        await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "a"}], top_logprobs=3)


async def test_wrong_routes_answer_like_aiohttp_in_openai_json(url):
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/v1/nothing", headers=AUTH) as response:
            assert response.status == 404
            assert (await response.json())["error"]["code"] == 404
        async with session.get(url + "/v1/completions", headers=AUTH) as response:
            assert response.status == 405 and response.headers["Allow"] == "POST"
            assert (await response.json())["error"]["code"] == 405


async def test_health_needs_both_the_scheduler_and_the_worker(url, rdb, redis_at, gateway):
    async def health() -> int | None:
        return await anyio.to_thread.run_sync(gateway.status, "/health")

    assert await health() == 200
    rdb.delete(keys.alive_worker())
    assert await health() == 503
    rdb.delete(keys.alive_scheduler())
    assert await health() == 503
    rdb.set(keys.alive_worker(), "x")
    assert await health() == 503
    rdb.set(keys.alive_scheduler(), "x")
    assert await health() == 200
    await until_admitting(url, redis_at)


async def test_a_worker_that_cannot_load_ends_calls_with_its_reason(url, rdb, redis_at,
                                                                   gateway):
    """A call admitted while the worker loads ends with the worker's reason once the load
    fails (no worker would ever answer it); later calls and /health get it at once, until
    the failure goes."""
    failed = WorkerFailed("worker-0", "m", "SafetensorError: incomplete metadata", 2)
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    answers: list[tuple[int, dict]] = []
    rdb.delete(keys.alive_worker())  # loading: no live worker, no failure yet
    # the gateway looks at the keys every WATCH_S: let it see these (an earlier test's
    # new scheduler epoch would otherwise end the call as a scheduler restart)
    await anyio.sleep(4 * WATCH_S)

    async def post(session: aiohttp.ClientSession) -> None:
        async with session.post(url + "/v1/completions", json=body, headers=AUTH) as response:
            answers.append((response.status, await response.json()))

    try:
        async with fake_stages(redis_at, lambda req: [HANG]) as seen, \
                aiohttp.ClientSession() as session:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tasks:
                    tasks.start_soon(post, session)
                    while not seen:  # admitted and on its way to a worker
                        await anyio.sleep(0.05)
                    rdb.set(keys.worker_failed(), messages.encode(failed))
                await post(session)
        assert [status for status, _ in answers] == [503, 503]
        for _, answer in answers:
            assert answer["error"]["type"] == "ServiceUnavailableError"
            assert ("The worker of shard 0 cannot load the model (2 attempt(s) failed): "
                    "SafetensorError: incomplete metadata") == answer["error"]["message"]
        assert len(seen) == 1  # the second was refused before it was queued
        assert await anyio.to_thread.run_sync(gateway.status, "/health") == 503
    finally:
        rdb.delete(keys.worker_failed())
        rdb.set(keys.alive_worker(), "x")
    await until_admitting(url, redis_at)


async def test_tokenize_and_detokenize_use_the_model_tokenizer(url):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(demo_model_path()))
    chat = [{"role": "user", "content": "What is 2+2?"}]
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/tokenize", json={"model": MODEL_NAME,
                                                         "prompt": "Hello there"}) as r:
            body = await r.json()
        assert body == {"count": len(tokenizer.encode("Hello there")), "max_model_len": 8192,
                        "tokens": tokenizer.encode("Hello there")}
        async with session.post(url + "/tokenize", json={"messages": chat}) as r:
            tokens = (await r.json())["tokens"]
        assert tokens == tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False)
        async with session.post(url + "/detokenize", json={"tokens": tokens}) as r:
            assert (await r.json())["prompt"] == tokenizer.decode(tokens)
        async with session.post(url + "/detokenize", json={"tokens": [10**8]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"


async def test_a_queue_over_the_bound_is_503_with_retry_after(url, rdb, redis_at, api):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    for i in range(MAX_QUEUE_LEN + 1):  # tokenized requests no scheduler reads
        rdb.xadd(keys.admit(), {"type": "admit", "rid": f"stuck-{i}"})
    try:  # a failure here must not leave the next tests overloaded
        await expect_overloaded(url, redis_at, api, body)
    finally:
        rdb.delete(keys.admit())
    await until_admitting(url, redis_at)


async def expect_overloaded(url: str, redis_at: str, api: openai.AsyncOpenAI,
                            body: dict) -> None:
    async with fake_stages(redis_at, in_order(["a"])), aiohttp.ClientSession() as session:
        with anyio.fail_after(5):  # admitted (and answered) until the gateway sees the queue
            while True:
                async with session.post(url + "/v1/completions", json=body,
                                        headers=AUTH) as response:
                    answer = await response.json()
                if response.status == 503:
                    break
                assert response.status == 200
                await anyio.sleep(0.05)
        assert response.headers["Retry-After"] == "1"
        error = answer["error"]
        assert error["type"] == "ServiceUnavailableError"
        # the stuck ones, plus an answered request the fake tokenizer had not yet read
        # when the gateway last looked
        queued = re.search(r"(\d+) requests are queued", error["message"])
        assert queued and int(queued.group(1)) >= MAX_QUEUE_LEN + 1, error["message"]
        assert "--max-queue-len 3" in error["message"]
        with pytest.raises(openai.InternalServerError) as info:
            await api.completions.create(**body)
        assert info.value.status_code == 503


# --- with the fake stages -----------------------------------------------------------------

async def test_choices_are_assembled_once_and_in_order(redis_at, api):
    async with fake_stages(redis_at, shuffled_twice([" a", " b", " c"], n=2)) as seen:
        out = await api.completions.create(model=MODEL_NAME, prompt=["one", "two"], n=2,
                                           max_tokens=3, temperature=0.5, seed=4)
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == [
        (i, f" a{i % 2} b{i % 2} c{i % 2}", "length") for i in range(4)]
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 12
    assert out.model == MODEL_NAME and out.object == "text_completion"
    assert sorted(r.prompt for r in seen) == ["one", "two"]
    assert len({r.rid for r in seen}) == 2 and all(r.rid.startswith(out.id) for r in seen)
    assert all(r.params == {"n": 2, "max_tokens": 3, "temperature": 0.5, "seed": 4}
               and r.reply_to == seen[0].reply_to and r.arrival_time > 0 for r in seen)


async def test_vllm_style_requests_work_unchanged_through_the_openai_client(
        url, redis_at, api, gateway):
    """Fields nobody defines are ignored with a warning naming them; a text
    response_format is plain generation; completions default to 16 tokens; the responses
    carry the fields clients read; /ping answers as /health does."""
    async with fake_stages(redis_at, in_order(["Hel", "lo"])) as seen:
        text = await api.completions.create(
            model=MODEL_NAME, prompt="hi", extra_body={"max_new_tokens": 3, "zeta": [1]})
        chat = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "text"}, max_completion_tokens=2)
        with pytest.raises(openai.BadRequestError) as info:  # fcfs: no priority
            await api.completions.create(model=MODEL_NAME, prompt="hi",
                                         extra_body={"priority": 3})
        assert info.value.body["param"] == "priority"
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(model=MODEL_NAME, prompt="hi", stream=True,
                                         extra_body={"prompt_logprobs": 1})
        assert info.value.body["param"] == "prompt_logprobs"
    assert [r.params for r in seen] == [{"max_tokens": 16}, {"max_tokens": 2}]
    assert text.choices[0].text == "Hel0lo0"
    assert "ignored unknown request fields" in gateway.log_tail(200)
    assert "max_new_tokens" in gateway.log_tail(200)
    message = chat.choices[0].message
    assert (message.content, message.refusal, message.tool_calls) == ("Hel0lo0", None, [])
    assert chat.system_fingerprint == text.system_fingerprint
    assert chat.system_fingerprint.startswith("headrace-")
    async with aiohttp.ClientSession() as session:
        for method in (session.get, session.post):
            async with method(url + "/ping") as response:
                assert response.status == 200


async def test_vllm_request_options_reach_the_stages_and_usage_can_stream_continuously(
        url, redis_at, api):
    async with fake_stages(redis_at, in_order(["a", "b", "c"])) as seen:
        await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False},
                        "add_special_tokens": True, "truncate_prompt_tokens": 5})
        stream = await api.completions.create(
            model=MODEL_NAME, prompt="p", stream=True,
            extra_body={"stream_options": {"include_usage": True,
                                           "continuous_usage_stats": True}})
        chunks = [chunk async for chunk in stream]
    assert seen[0].chat_template_kwargs == {"enable_thinking": False}
    assert (seen[0].add_special_tokens, seen[0].truncate_prompt_tokens) == (True, 5)
    assert (seen[1].add_special_tokens, seen[1].truncate_prompt_tokens) == (None, None)
    counts = [c.usage.completion_tokens for c in chunks]  # every chunk has usage
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-2:] == [3, 3]
    assert not chunks[-1].choices and all(c.choices for c in chunks[:-1])


async def test_openapi_documents_the_bodies_the_gateway_takes_and_sends(url, redis_at, api):
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/openapi.json") as response:
            assert response.status == 200
            doc = await response.json()
    assert "servers" not in doc  # no --root-path: the routes are where the document is
    schemas = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    body_ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    fields = schemas[body_ref.rsplit("/", 1)[1]]["properties"]
    assert {"messages", "temperature", "top_k", "guided_json", "response_format",
            "max_completion_tokens"} <= set(fields)
    assert "text/event-stream" in chat["responses"]["200"]["content"]
    async with fake_stages(redis_at, in_order(["a"])):
        out = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}])
    documented = set(schemas["ChatCompletionResponse"]["properties"])
    assert set(out.model_dump(exclude_unset=True)) <= documented

    lora = doc["paths"]["/v1/load_lora_adapter"]["post"]
    assert "text/plain" in lora["responses"]["200"]["content"]


async def test_without_enable_lora_adapters_cannot_be_loaded(url, api):
    async with aiohttp.ClientSession(headers=AUTH) as session:
        for path, body in (("load_lora_adapter", {"lora_name": "a", "lora_path": "/a"}),
                           ("unload_lora_adapter", {"lora_name": "a"})):
            async with session.post(f"{url}/v1/{path}", json=body) as response:
                assert response.status == 400
                assert "--enable-lora" in (await response.json())["error"]["message"]
    with pytest.raises(openai.NotFoundError):  # an adapter's name is an unknown model
        await api.completions.create(model="a", prompt="p")
    assert [m.id for m in (await api.models.list()).data] == [MODEL_NAME]


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALLING = ["<think>Paris", " needs a look</think>", "Let me look.", "<tool_",
           'call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']


def streamed_message(chunks) -> dict:
    """What a client assembles from chat chunks: content, reasoning, calls by index."""
    out = {"content": "", "reasoning": "", "calls": {}, "finish": None}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                entry = out["calls"].setdefault(call.index, {"id": None, "name": "",
                                                             "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            out["finish"] = choice.finish_reason or out["finish"]
    return out


async def test_tool_calls_and_reasoning_through_the_openai_client(redis_at, api):
    """--tool-call-parser hermes and --reasoning-parser qwen3: the reply's text becomes
    reasoning_content, content and tool_calls, whole and streamed."""
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [{
                   "id": "call_1", "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "user", "content": "And Paris?"}]
    async with fake_stages(redis_at, exact(CALLING)) as seen:
        out = await api.chat.completions.create(model=MODEL_NAME, messages=history,
                                                tools=TOOLS)
        stream = await api.chat.completions.create(model=MODEL_NAME, messages=history,
                                                   tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
    assert seen[0].tools == TOOLS and seen[0].messages == history
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    assert choice.message.reasoning_content == "Paris needs a look"
    call, = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    got = streamed_message(chunks)
    assert (got["content"], got["reasoning"], got["finish"]) == (
        "Let me look.", "Paris needs a look", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"})]


def one_per_step(texts: list[str], pause_s: float = 0.03) -> Script:
    """One completion whose deltas are `texts`, each in a step of its own, paused so that
    the gateway writes a chunk for each."""
    def script(req: GenerateRequest) -> list[Step]:
        steps: list[Step] = []
        for seq, text in enumerate(texts):
            steps += [ReplyBatch([TextDelta(req.rid, 0, seq, text, [10 + seq], 3, "stop"
                                            if seq == len(texts) - 1 else None)]), pause_s]
        return steps
    return script


async def test_tool_calls_stream_as_they_are_written(redis_at, api):
    """A hermes call streamed as vLLM streams one: a delta opens it (id, type, name, no
    arguments yet), its arguments follow as they are written, and they add up to the whole
    response's arguments exactly; the second call opens after the first is complete."""
    texts = ["Sure.<tool_call>", '\n{"name": "get_weather", ', '"arguments": {"ci', 'ty":',
             ' "Par', 'is"}}\n</tool_call><tool_call>{"name": "get_weather", "arg',
             'uments": {"city": "Oslo"}}', "</tool_call>"]
    hi = [{"role": "user", "content": "Paris and Oslo?"}]
    async with fake_stages(redis_at, one_per_step(texts)):
        whole = await api.chat.completions.create(model=MODEL_NAME, messages=hi, tools=TOOLS)
        stream = await api.chat.completions.create(model=MODEL_NAME, messages=hi,
                                                   tools=TOOLS, stream=True)
        chunks = [chunk async for chunk in stream]
    calls = [call for chunk in chunks for choice in chunk.choices
             for call in choice.delta.tool_calls or []]
    opening = calls[0].model_dump(exclude_none=True)
    assert opening["type"] == "function" and opening["id"].startswith("chatcmpl-tool-")
    assert opening["function"] == {"name": "get_weather", "arguments": ""}
    first = [c.function.arguments for c in calls[1:] if c.index == 0]
    assert len(first) >= 2 and "".join(first) == '{"city": "Paris"}'  # as the text came
    assert all(c.model_dump(exclude_none=True).keys() == {"index", "function"}
               and c.function.name is None for c in calls[1:] if c.id is None)
    assert [c.index for c in calls if c.id is not None] == [0, 1]
    got = streamed_message(chunks)
    assert (got["content"], got["finish"]) == ("Sure.", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert len(got["calls"]) == 2 and got["calls"][1]["arguments"] == '{"city": "Oslo"}'


async def test_required_tool_calls_come_whole_and_streamed_alike(redis_at, api):
    """tool_choice "required": the output is a JSON list of calls, read at the finish; a
    stream opens each call (id, name) and then sends its arguments."""
    output = ['[{"name": "get_weather", "parameters": {"city": ', '"Oslo"}}, {"name": ',
              '"get_weather", "parameters": {"city": "Rome"}}]']
    hi = [{"role": "user", "content": "Oslo and Rome?"}]
    async with fake_stages(redis_at, one_per_step(output)):
        whole = await api.chat.completions.create(model=MODEL_NAME, messages=hi, tools=TOOLS,
                                                  tool_choice="required")
        stream = await api.chat.completions.create(model=MODEL_NAME, messages=hi,
                                                   tools=TOOLS, tool_choice="required",
                                                   stream=True)
        chunks = [chunk async for chunk in stream]
    calls = [(c.function.name, c.function.arguments)
             for c in whole.choices[0].message.tool_calls]
    assert calls == [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]
    got = streamed_message(chunks)
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == calls
    assert got["finish"] == "tool_calls" and got["content"] == ""
    openings = [c for chunk in chunks for choice in chunk.choices
                for c in choice.delta.tool_calls or [] if c.id is not None]
    assert [c.function.arguments for c in openings] == ["", ""]


async def test_a_named_tool_choice_makes_the_output_the_call_arguments(redis_at, api):
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with fake_stages(redis_at, exact(['{"city": ', '"Oslo"}'])) as seen:
        out = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
            tool_choice=named)
        stream = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
            tool_choice=named, stream=True)
        chunks = [chunk async for chunk in stream]
        with pytest.raises(openai.BadRequestError) as info:
            await api.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                tool_choice={"type": "function", "function": {"name": "other"}})
    assert info.value.body["param"] == "tool_choice"
    schema = TOOLS[0]["function"]["parameters"]
    assert seen[0].params["structured_outputs"] == {"json": schema}
    message = out.choices[0].message
    assert message.content is None and message.tool_calls[0].function.name == "get_weather"
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    got = streamed_message(chunks)
    assert got["calls"][0]["name"] == "get_weather" and got["calls"][0]["id"]
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "Oslo"}
    assert got["content"] == ""


async def test_chat_messages_and_token_prompts_reach_the_stages(redis_at, api):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    async with fake_stages(redis_at, in_order(["Hel", "lo"])) as seen:
        out = await api.chat.completions.create(model=MODEL_NAME, messages=chat,
                                                max_completion_tokens=2)
        text = await api.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], echo=True)
    assert out.choices[0].message.content == "Hel0lo0" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.object == "chat.completion"
    assert seen[0].messages == chat and seen[0].params == {"max_tokens": 2}
    assert seen[1].prompt_token_ids == [1, 2, 3] and seen[1].prompt is None
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(demo_model_path()))
    assert text.choices[0].text == tokenizer.decode([1, 2, 3]) + "Hel0lo0"


async def test_streams_send_chunks_then_usage_then_done(url, redis_at, api):
    async with fake_stages(redis_at, shuffled_twice([" x", " y"], n=2, seed=3)):
        stream = await api.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], n=2, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        sse = await post_sse(url, "/v1/completions", {"model": MODEL_NAME, "prompt": "p",
                                                      "stream": True})
    roles = [c.choices[0].delta.role for c in chunks[:2]]
    assert roles == ["assistant", "assistant"]
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in chunks[2:-1]:
        choice, = chunk.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finishes[choice.index] = choice.finish_reason
    assert texts == {0: " x0 y0", 1: " x1 y1"} and finishes == {0: "length", 1: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert sse.status == 200 and sse.headers["Content-Type"].startswith("text/event-stream")
    assert sse.events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in sse.events[:-1]) == " x0 y0"


async def test_a_chunk_per_engine_step_coalesced_only_when_behind(url, redis_at):
    texts = [" a", " b", " c", " d"]
    body = {"model": MODEL_NAME, "prompt": "p", "stream": True}

    def one_per_step(req: GenerateRequest) -> list[Step]:
        return [step for delta in deltas(req, texts) for step in (ReplyBatch([delta]), 0.05)]

    def all_at_once(req: GenerateRequest) -> list[Step]:
        return [[ReplyBatch([delta]) for delta in deltas(req, texts)]]

    for script, expected in ((one_per_step, [" a0", " b0", " c0", " d0"]),
                             (all_at_once, [" a0 b0 c0 d0"])):
        async with fake_stages(redis_at, script):
            sse = await post_sse(url, "/v1/completions", body)
        chunks = [json.loads(e)["choices"] for e in sse.events[:-1]]
        assert [c[0]["text"] for c in chunks if c] == expected


async def test_the_first_reply_decides_the_status_also_for_a_stream(url, redis_at, api):
    too_long = ("This model's maximum context length is 8192 tokens. However, your request "
                "has 9000 input tokens.")
    rejected = lambda req: [ErrorReply(req.rid, 400, too_long, param="prompt")]
    async with fake_stages(redis_at, rejected):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                await api.completions.create(model=MODEL_NAME, prompt="x" * 20,
                                                     stream=stream)
            assert "8192" in info.value.message and "9000" in info.value.message
        sse = await post_sse(url, "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}],
            "stream": True})
    assert sse.status == 400 and json.loads(sse.events[0])["error"]["param"] == "prompt"


async def test_one_failing_prompt_fails_the_call_and_aborts_the_others(redis_at, api):
    def script(req: GenerateRequest) -> list[Step]:
        if req.prompt == "bad":
            return [0.2, ErrorReply(req.rid, 400, "no")]
        return [ReplyBatch(deltas(req, ["a", "b"])[:1]), HANG]
    async with fake_stages(redis_at, script) as seen:
        with pytest.raises(openai.BadRequestError):
            await api.completions.create(model=MODEL_NAME, prompt=["good", "bad"])
        good = next(r.rid for r in seen if r.prompt == "good")
        assert await aborted(redis_at, {good}) == {good}


async def test_an_error_after_the_headers_is_an_error_event_then_done(url, redis_at, api):
    def script(req: GenerateRequest) -> list[Step]:
        first = deltas(req, ["a", "b", "c"])[:2]
        return [ReplyBatch(first), 0.1, ErrorReply(req.rid, 503, "The worker died.",
                                                   "ServiceUnavailableError")]
    async with fake_stages(redis_at, script):
        sse = await post_sse(url, "/v1/completions", {"model": MODEL_NAME, "prompt": "p",
                                                      "stream": True})
        with pytest.raises(openai.APIError) as info:
            stream = await api.completions.create(model=MODEL_NAME, prompt="p",
                                                          stream=True)
            async for _ in stream:
                pass
    assert sse.status == 200 and sse.events[-1] == "[DONE]"
    assert json.loads(sse.events[-2])["error"] == {
        "message": "The worker died.", "type": "ServiceUnavailableError", "param": None,
        "code": 503}
    assert "".join(json.loads(e)["choices"][0]["text"] for e in sse.events[:-2]) == "a0b0"
    assert "worker died" in info.value.message


async def test_a_client_that_leaves_aborts_its_requests(url, redis_at, api):
    started = lambda req: [ReplyBatch(deltas(req, ["a", "b", "c"])[:2]), HANG]
    async with fake_stages(redis_at, started) as seen:
        stream = await api.completions.create(model=MODEL_NAME, prompt="p",
                                                      stream=True)
        async for _ in stream:
            break
        await stream.close()
        timeout = aiohttp.ClientTimeout(total=0.5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            with pytest.raises(asyncio.TimeoutError):
                await session.post(url + "/v1/chat/completions", headers=AUTH, json={
                    "model": MODEL_NAME, "messages": [{"role": "user", "content": "a"}]})
        rids = {r.rid for r in seen}
        assert len(rids) == 2 and await aborted(redis_at, rids) == rids


async def test_requests_end_with_503_when_the_scheduler_goes_away(url, rdb, redis_at, api):
    started = lambda req: [ReplyBatch(deltas(req, ["a", "b"])[:1]), HANG]
    async with fake_stages(redis_at, started) as seen:
        async with anyio.create_task_group() as tasks:
            results: dict[str, object] = {}

            async def plain() -> None:
                try:
                    await api.completions.create(model=MODEL_NAME, prompt="p")
                except openai.APIStatusError as e:
                    results["plain"] = e.status_code

            async def streamed() -> None:
                results["stream"] = await post_sse(url, "/v1/completions", {
                    "model": MODEL_NAME, "prompt": "p", "stream": True})

            tasks.start_soon(plain)
            tasks.start_soon(streamed)
            with anyio.fail_after(5):
                while len(seen) < 2:
                    await anyio.sleep(0.05)
            rdb.delete(keys.alive_scheduler())
            with anyio.fail_after(5):  # the watcher sees it within a fraction of a second
                while len(results) < 2:
                    await anyio.sleep(0.05)
        rids = {r.rid for r in seen}
        assert await aborted(redis_at, rids) == rids
        with pytest.raises(openai.InternalServerError) as info:  # new requests are refused
            await api.completions.create(model=MODEL_NAME, prompt="p")
        assert info.value.response.headers["Retry-After"] == "1"
        assert "scheduler is not running" in info.value.message
    rdb.set(keys.alive_scheduler(), "back")
    await until_admitting(url, redis_at)
    assert results["plain"] == 503
    sse = results["stream"]
    assert sse.status == 200 and sse.events[-1] == "[DONE]"
    assert json.loads(sse.events[-2])["error"]["code"] == 503


SHARD_0 = (("model_name", MODEL_NAME), ("shard", "0"))


async def test_metrics_carry_the_scheduler_stats_streams_and_latencies(url, rdb, redis_at,
                                                                        gateway, api):
    rdb.set(keys.scheduler_stats(), messages.encode(SchedulerStats(
        num_running=3, num_waiting=1, kv_cache_usage=0.25, num_preemptions=2,
        prefix_cache_queries=10, prefix_cache_hits=4, prompt_tokens=100,
        generation_tokens=50)))
    async with fake_stages(redis_at, in_order(["a", "b"])):
        out = await api.completions.create(model=MODEL_NAME, prompt="p")
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            text = await response.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples["headrace:num_requests_running", SHARD_0] == 3
    assert samples["headrace:num_requests_waiting", SHARD_0] == 1
    assert samples["headrace:kv_cache_usage_perc", SHARD_0] == 0.25
    assert samples["headrace:num_preemptions_total", SHARD_0] == 2
    assert samples["headrace:request_success_total",
                   (("finished_reason", "length"), *SHARD_0)] >= 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "request_prompt_tokens",
                 "request_generation_tokens", "request_params_n", "request_params_max_tokens"):
        assert samples[f"headrace:{name}_count", SHARD_0] >= 1
    # the fake stages do not stamp their replies: no phase is timed
    assert not any(name.startswith("headrace:request_queue_time") for name, _ in samples)
    model = ("model_name", MODEL_NAME)
    assert samples["headrace:stream_length", (model, ("stream", keys.REQUESTS))] >= 1
    assert ("headrace:stream_lag",
            (("group", "tokenizer"), model, ("stream", keys.REQUESTS))) in samples
    finished = [r for r in gateway.log_records() if r.get("rid") == out.id]
    assert [r["event"] for r in finished] == ["request queued", "request finished"]
    assert finished[-1]["completion_tokens"] == 2 and finished[-1]["service"] == "gateway"
