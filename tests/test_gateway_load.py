"""A gateway under thousands of simultaneous streams holds a fixed, small number of Redis
connections (one reader of its replies, one writer of every call's requests, a few for
its watcher and routes, one for its heartbeat's thread), counted from Redis' own CLIENT LIST while the streams are open."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import anyio
import pytest

from common import keys
from common.bus import MAX_CONNECTIONS
from common.messages import GenerateRequest, ReplyBatch
from common.redis_server import EmbeddedRedis
from services.demo import demo_model_path
from tests.e2e_fixtures import MODEL_NAME, start_server
from tests.test_gateway import deltas, fake_stages

pytestmark = pytest.mark.anyio
STREAMS = 5000
HOLD_S = 3.0  # every stream stays open this long between its first and last reply
WAVE = 250  # streams started at a time, 50 ms apart: the last wave starts within 1 s


def held_open(texts: list[str]):
    """First token at once, the rest after HOLD_S: the streams are open together."""
    def script(req: GenerateRequest) -> list:
        items = deltas(req, texts)
        return [ReplyBatch(items[:1]), HOLD_S, ReplyBatch(items[1:])]
    return script


def gateway_connections(redis: EmbeddedRedis) -> int:
    client = redis.client()
    try:
        return sum(1 for c in client.client_list()
                   if c.get("name", "").startswith("gateway-load"))
    finally:
        client.close()


async def stream_one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[int, str]:
    body = {"model": MODEL_NAME, "prompt": f"p{i}", "stream": True}
    async with session.post(url + "/v1/completions", json=body) as response:
        text = "".join([line.decode() async for line in response.content])
        return response.status, text


async def test_thousands_of_streams_share_a_few_connections(embedded_redis, redis_url,
                                                            tmp_path):
    """`redis_url`: the session's Redis emptied first, so that the fake stages read only
    this test's requests (an earlier test may have left an Abort on hr:requests)."""
    rdb = embedded_redis.client()
    rdb.set(keys.alive_scheduler(), "fake")
    rdb.set(keys.alive_worker(), "fake")
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--served-model-name", MODEL_NAME, "--replica", "load",
                           "--max-queue-len", str(10 * STREAMS),
                           # the keep-alive timer runs from accept to a request's headers:
                           # 5000 clients on a loaded 2-core host take longer than 5 s to
                           # write theirs, and a cut connection is not what this test counts
                           "--timeout-keep-alive", "120"], tmp_path / "gateway.log")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
        peak = 0
        async with fake_stages(embedded_redis.url, held_open(["a", "b"])) as seen:
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=300)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
                calls = []
                for wave in range(0, STREAMS, WAVE):  # all open together, within HOLD_S
                    calls += [asyncio.ensure_future(stream_one(session, server.url, i))
                              for i in range(wave, wave + WAVE)]
                    # the other processes get the 2 cores between waves: 5000 connects
                    # at once starve this loop's own Redis connects past their timeout
                    await anyio.sleep(0.05)
                deadline = time.monotonic() + 240
                while not all(c.done() for c in calls) and time.monotonic() < deadline:
                    peak = max(peak, gateway_connections(embedded_redis))
                    await anyio.sleep(0.2)
                results = await asyncio.gather(*calls)
        assert len(seen) == STREAMS
        assert [s for s, _ in results].count(200) == STREAMS
        assert all(text.endswith("data: [DONE]\n\n") and '"a0"' in text and '"b0"' in text
                   for _, text in results)
        assert 2 <= peak <= MAX_CONNECTIONS + 1, peak  # + the heartbeat thread's own
        log = server.log_path.read_text()
        assert "Too many connections" not in log and "No connection available" not in log
    finally:
        server.stop()
        rdb.delete(keys.alive_scheduler(), keys.alive_worker(), keys.REQUESTS)
        rdb.close()
