"""The throughput benchmark's HTTP path against a scripted OpenAI-compatible server in the
test's event loop: what it sends (the workload's prompts as token ids, lengths and
sampling, streamed with usage, all at once), that it counts tokens by the usage numbers,
and that any failed request (an HTTP error, an error chunk, fewer tokens than asked) ends
the run with the first failure. `headrace bench throughput --path http` against the real
gateway is in test_bench_engine.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from benchmarks.bench.throughput import drive_http
from benchmarks.bench.workloads import fixed_workload
from tests.e2e_fixtures import write_event

pytestmark = pytest.mark.anyio
HOLD_S = 0.2  # each stream stays open this long before its first token


@dataclass
class ScriptedServer:
    """Streams `max_tokens` one-token chunks with empty text (as a dummy model's tokens
    often decode) and the usage; `misbehave` maps an arrival index to another answer."""
    misbehave: dict[int, str] = field(default_factory=dict)
    bodies: list[dict] = field(default_factory=list)
    open_streams: int = 0
    most_open: int = 0

    async def completions(self, request: web.Request) -> web.StreamResponse:
        index = len(self.bodies)
        body = await request.json()
        self.bodies.append(body)
        if self.misbehave.get(index) == "http-500":
            return web.json_response({"error": {"message": "planned failure"}}, status=500)
        self.open_streams += 1
        self.most_open = max(self.most_open, self.open_streams)
        try:
            await asyncio.sleep(HOLD_S)
            return await self.stream(request, index, body["max_tokens"])
        finally:
            self.open_streams -= 1

    async def stream(self, request: web.Request, index: int, max_tokens: int
                     ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        sent = max_tokens - 1 if self.misbehave.get(index) == "short" else max_tokens
        for i in range(sent):
            finish = "length" if i == sent - 1 else None
            await write_event(response, {"choices": [{"index": 0, "text": "", "logprobs": None,
                                                "finish_reason": finish}], "usage": None})
        if self.misbehave.get(index) == "error-chunk":
            await write_event(response, {"error": {"message": "worker died", "code": 500}})
        else:
            await write_event(response, {"choices": [], "usage": {
                "prompt_tokens": 3, "completion_tokens": sent, "total_tokens": 3 + sent}})
        await response.write(b"data: [DONE]\n\n")
        return response

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "scripted"}]})



Serve = Callable[..., Awaitable[tuple[ScriptedServer, str]]]


@pytest.fixture
async def scripted() -> AsyncIterator[Serve]:
    """`await scripted(**settings)`: a ScriptedServer listening, and its URL."""
    runners: list[web.AppRunner] = []

    async def start(**settings) -> tuple[ScriptedServer, str]:
        server = ScriptedServer(**settings)
        app = web.Application()
        app.router.add_post("/v1/completions", server.completions)
        app.router.add_get("/v1/models", server.models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return server, f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_sends_the_workload_at_once_and_counts_usage_tokens(scripted):
    server, url = await scripted()
    workload = fixed_workload("f", 12, prompt_len=9, output_len=5, vocab_size=50)
    tokens, seconds = await drive_http(url, workload)
    assert tokens == workload.output_tokens  # by the usage numbers: the text was empty
    assert server.most_open == 12  # no connection-pool cap: all open together
    # one hold and the chunks: the requests ran side by side, not one after another
    assert HOLD_S <= seconds < 2 * HOLD_S
    by_prompt = {tuple(b["prompt"]): b for b in server.bodies}
    assert set(by_prompt) == {tuple(p) for p in workload.prompts}
    for prompt, params in zip(workload.prompts, workload.params):
        body = by_prompt[tuple(prompt)]
        assert body["model"] == "scripted" and body["max_tokens"] == params.max_tokens
        assert body["temperature"] == params.temperature and body["ignore_eos"] is True
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("kind", "message"), [
    ("http-500", "HTTP 500: {\"error\": {\"message\": \"planned failure\""),
    ("error-chunk", "worker died"),
    ("short", "4 of 5 tokens"),
])
async def test_a_failed_request_fails_the_run_with_the_first_error(scripted, kind, message):
    server, url = await scripted(misbehave={2: kind, 4: kind})
    workload = fixed_workload("f", 6, prompt_len=4, output_len=5, vocab_size=50)
    with pytest.raises(RuntimeError) as failure:
        await drive_http(url, workload)
    assert "2 of 6 HTTP requests failed" in str(failure.value)
    assert message in str(failure.value)
