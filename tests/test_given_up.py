"""A stage that gives up on a request ends it for the client: a real gateway process, a
real HTTP client, and the tokenizer's consumer loop with its own `given_up` around a
handler that fails on purpose. Before, the entry went to hr:dead and the client waited for
an answer that never came (issue 34's hostile run)."""

from __future__ import annotations

import aiohttp
import anyio
import msgpack
import pytest

from common import keys
from common.bus import Bus
from common.messages import (Abort, DetokItem, DetokParams, ErrorReply, GenerateRequest,
                             encode)
from common.token_columns import token_batch
from services.demo import demo_model_path
from services.detokenizer.shell import given_up as detokenizer_gave_up
from services.tokenizer.shell import GROUP, given_up
from tests.e2e_fixtures import MODEL_NAME, start_server

pytestmark = pytest.mark.anyio


async def test_a_request_the_tokenizer_gives_up_on_ends_with_its_reason(embedded_redis,
                                                                        tmp_path):
    rdb = embedded_redis.client()
    rdb.set(keys.alive_scheduler(), "fake")
    rdb.set(keys.alive_worker(), "fake")
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--served-model-name", MODEL_NAME], tmp_path / "gateway.log")
    tries = 0

    async def failing(req):
        nonlocal tries
        tries += 1
        raise RuntimeError("a template this tokenizer cannot render")
    try:
        server.wait_for("/version", (200,), timeout_s=120)
        async with Bus(embedded_redis.url) as bus, anyio.create_task_group() as tasks:
            stop = anyio.Event()
            tasks.start_soon(lambda: bus.consume(
                keys.REQUESTS, GROUP, "t1", failing, stop=stop, block_ms=100, min_idle_ms=50,
                reclaim_every_s=0.05, max_deliveries=3, on_dead=given_up))
            async with aiohttp.ClientSession() as session:
                with anyio.fail_after(30):
                    async with session.post(server.url + "/v1/completions", json={
                            "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}) as r:
                        status, body = r.status, await r.json()
            stop.set()
        assert status == 500, body
        message = body["error"]["message"]
        assert message.startswith("The tokenizer could not process this request: ")
        assert "a template this tokenizer cannot render" in message and "3 deliveries" in message
        assert tries == 3 and rdb.xlen(keys.DEAD) >= 1
    finally:
        server.stop()
        rdb.delete(keys.alive_scheduler(), keys.alive_worker(), keys.REQUESTS, keys.DEAD)
        rdb.close()


def test_a_batch_the_detokenizer_gives_up_on_ends_each_of_its_requests():
    params = DetokParams()
    items = [DetokItem(rid, index, gateway, 0, [5], [4], 1, params, 3)
             for rid, index, gateway in (("a", 0, "g1"), ("a", 1, "g1"), ("b", 0, "g2"))]
    outputs = detokenizer_gave_up(token_batch(3, items, shard=1), "KeyError: 7")
    assert outputs == [
        (keys.replies("g1"), ErrorReply("a", 500, "The detokenizer could not process this "
                                        "request's tokens: KeyError: 7", "InternalServerError")),
        (keys.control(1), Abort("a")),
        (keys.replies("g2"), ErrorReply("b", 500, "The detokenizer could not process this "
                                        "request's tokens: KeyError: 7", "InternalServerError")),
        (keys.control(1), Abort("b"))]


async def test_a_request_no_stage_can_read_ends_with_the_reason(embedded_redis):
    """A body that names its requester but does not decode as its type (a producer's bug,
    or replicas of two versions) ends that request; one that names nobody is only buried."""
    good = msgpack.unpackb(encode(GenerateRequest("r1", "gw1", {})))
    rdb = embedded_redis.client()
    try:
        async with Bus(embedded_redis.url) as bus:
            await bus.ensure_group(keys.REQUESTS, GROUP)
            rdb.xadd(keys.REQUESTS, {"body": msgpack.packb({**good, "params": "not a map"})})
            rdb.xadd(keys.REQUESTS, {"body": msgpack.packb({**good, "reply_to": 7})})
            rdb.xadd(keys.REQUESTS, {"body": b"\xc1 not msgpack"})
            assert await bus.read(GROUP, "t1", {keys.REQUESTS: ">"}, count=10) == []
            replies = await bus.tail({keys.replies("gw1"): "0"})
        assert [entry.msg.rid for entry in replies] == ["r1"]
        error = replies[0].msg
        assert isinstance(error, ErrorReply) and error.status == 500
        assert error.message.startswith("The tokenizer stage could not read this request: ")
        assert "dict" in error.message and "got str" in error.message
        assert rdb.xlen(keys.DEAD) == 3
        assert rdb.xpending(keys.REQUESTS, GROUP)["pending"] == 0
    finally:
        rdb.delete(keys.REQUESTS, keys.DEAD, keys.replies("gw1"))
        rdb.close()
