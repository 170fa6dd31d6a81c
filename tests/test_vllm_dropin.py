"""A vLLM deployment pointed at headrace (issue 33): the HTTP options of vLLM's server
(CORS, TLS, --root-path, request logs, logprob tokens as ids, prompt token details), the
`vllm:` metric names its dashboards and autoscalers read, and chat histories whose tool-call
turns have no content. Real gateway processes behind the fake stages of
tests/test_gateway.py, with real HTTP clients (aiohttp, and the official `openai` over its
httpx2)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import ssl
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx2
import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file
from transformers import AutoTokenizer

import torch
from common import keys, messages
from common.chat import render_chat
from common.config import ConfigError, EngineConfig, ServerConfig, stage_counts
from common.errors import ApiError
from common.messages import GenerateRequest, ReplyBatch, SchedulerStats, TextDelta, TokenLogprobs
from services.gateway.metrics import Metrics
from common.redis_server import EmbeddedRedis
from services import launcher
from services.demo import demo_model_path
from services.gateway.core import Call
from services.gateway.http_options import (ACCESS_LOGGER, ALL_METHODS, REQUEST_LOGGER,
                                           apply_log_levels, with_http_options)
from services.gateway.protocol import parse_job
from services.worker.loader import iter_safetensors
from services.worker.memory import plan_num_blocks
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serve_args, start_server
from tests.test_gateway import AUTH, fake_stages
from tests.text_fixtures import SMOLLM2_TOKENIZER_DIR

pytestmark = pytest.mark.anyio
ROOT = "/llm"
ORIGIN = "https://app.example"
# Every series that vLLM's published Grafana dashboard
# (examples/online_serving/prometheus_grafana/grafana.json) queries, and the one a KEDA
# rule on the queue reads: each must be in a scrape of /metrics, with its model_name.
DASHBOARD_SERIES = """
vllm:e2e_request_latency_seconds_bucket vllm:e2e_request_latency_seconds_sum
vllm:e2e_request_latency_seconds_count vllm:prompt_tokens_total vllm:generation_tokens_total
vllm:time_per_output_token_seconds_bucket vllm:time_per_output_token_seconds_sum
vllm:time_per_output_token_seconds_count vllm:num_requests_running vllm:num_requests_waiting
vllm:time_to_first_token_seconds_bucket vllm:time_to_first_token_seconds_sum
vllm:time_to_first_token_seconds_count vllm:gpu_cache_usage_perc
vllm:request_prompt_tokens_bucket vllm:request_generation_tokens_bucket
vllm:request_success_total vllm:request_queue_time_seconds_sum
vllm:request_prefill_time_seconds_sum vllm:request_decode_time_seconds_sum
vllm:request_max_num_generation_tokens_sum
""".split()
KEDA_SERIES = ["vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]


# --- one gateway with vLLM's HTTP options, behind the fake stages -------------------------

@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> Path:
    """A self-signed certificate for 127.0.0.1 (its own CA), its key beside it."""
    root = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(root / "key.pem"),
                    "-out", str(root / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return root / "cert.pem"


@dataclass
class Gateway:
    process: ServerProcess
    url: str  # https, without the root path
    tls: ssl.SSLContext  # a client context that trusts only the test's certificate


@pytest.fixture(scope="module")
def gateway(embedded_redis: EmbeddedRedis, tmp_path_factory, certificate) -> Iterator[Gateway]:
    client = embedded_redis.client()
    client.set(keys.alive_scheduler(), "fake")
    client.set(keys.alive_worker(), "fake")
    client.close()
    server = start_server(
        ["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
         "--served-model-name", MODEL_NAME, "--api-key", API_KEY,
         "--ssl-keyfile", str(certificate.parent / "key.pem"),
         "--ssl-certfile", str(certificate),
         "--allowed-origins", json.dumps([ORIGIN]), "--allowed-methods", '["GET", "POST"]',
         "--allowed-headers", '["authorization", "content-type"]', "--allow-credentials",
         "--root-path", ROOT, "--disable-log-requests", "--return-tokens-as-token-ids",
         "--enable-prompt-tokens-details", "--uvicorn-log-level", "debug",
         "--enable-request-id-headers"],
        tmp_path_factory.mktemp("gateway") / "gateway.log")
    up = Gateway(server, f"https://127.0.0.1:{server.port}",
                 ssl.create_default_context(cafile=str(certificate)))
    try:
        wait_until_up(up)
        yield up
    finally:
        assert not server.stop() and server.process.returncode == 0, server.log_tail()


def wait_until_up(gateway: Gateway) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if gateway.process.process.poll() is not None:
            raise RuntimeError(f"the gateway exited:\n{gateway.process.log_tail()}")
        try:
            with httpx2.Client(verify=gateway.tls) as client:
                if client.get(gateway.url + "/version", timeout=2).status_code == 200:
                    return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(gateway.process.log_tail())


def answer(req: GenerateRequest) -> list[ReplyBatch]:
    """Two tokens with logprobs (the chosen one and one alternative), stamped as the real
    stages stamp their replies, so that every per-request histogram is observed."""
    now = time.time()
    stamps = [now - 1.0, now - 0.99, now - 0.98, now - 0.9]
    entries = [TokenLogprobs([10 + seq, 99], [-0.5, -1.5], 1, [f"t{seq}", "alt"])
               for seq in range(2)]
    return [ReplyBatch([TextDelta(req.rid, 0, seq, f"t{seq}", [10 + seq], 3,
                                  "length" if seq == 1 else None, logprobs=[entries[seq]],
                                  request_stamps=stamps if seq == 0 else [],
                                  num_cached_tokens=2 if seq == 0 else 0)],
                       [now - 0.6 + 0.1 * seq, now - 0.59 + 0.1 * seq, now - 0.5 + 0.1 * seq,
                        now - 0.49 + 0.1 * seq, now - 0.48 + 0.1 * seq])
            for seq in range(2)]


@asynccontextmanager
async def openai_client(gateway: Gateway, base: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client over HTTPS, verifying the gateway's certificate."""
    async with httpx2.AsyncClient(verify=gateway.tls) as http, openai.AsyncOpenAI(
            base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=20,
            http_client=http) as client:
        yield client


# --- TLS, --root-path ----------------------------------------------------------------------

async def test_https_round_trip_under_the_root_path_and_without_it(gateway, embedded_redis):
    async with fake_stages(embedded_redis.url, answer):
        for base in (gateway.url + ROOT, gateway.url):  # a proxy that keeps or strips it
            async with openai_client(gateway, base) as client:
                out = await client.completions.create(model=MODEL_NAME, prompt="p",
                                                      max_tokens=2)
                stream = await client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                    stream=True, max_tokens=2)
                texts = [c.choices[0].delta.content async for c in stream if c.choices]
                assert out.choices[0].text == "t0t1" and "".join(texts) == "t0t1"
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.url + ROOT + "/v1/models", ssl=gateway.tls) as r:
            assert r.status == 401  # the prefixed routes need the key too
        async with session.get(gateway.url + ROOT + "/health", ssl=gateway.tls) as r:
            assert r.status == 200
        async with session.get(gateway.url + "/elsewhere/v1/models", headers=AUTH,
                               ssl=gateway.tls) as r:
            assert r.status == 404
    with pytest.raises(httpx2.HTTPError):  # plain HTTP on the TLS port gets no answer
        async with httpx2.AsyncClient() as http:
            await http.get(f"http://127.0.0.1:{gateway.process.port}/version")
    # --uvicorn-log-level debug: an access line per HTTP request
    access = [r for r in gateway.process.log_records() if r.get("logger") == ACCESS_LOGGER]
    assert any(f"{ROOT}/v1/completions" in r["event"] for r in access)


async def test_the_openapi_document_names_the_root_path_as_its_server(gateway):
    """As FastAPI's root_path (vLLM's) writes it: a client generated from the document,
    fetched through the proxy or not, calls the routes under the prefix."""
    async with aiohttp.ClientSession() as session:
        for base in (gateway.url + ROOT, gateway.url):
            async with session.get(base + "/openapi.json", ssl=gateway.tls) as r:
                doc = await r.json()
                assert r.status == 200 and doc["servers"] == [{"url": ROOT}]
                assert "/v1/chat/completions" in doc["paths"]  # paths stay unprefixed


# --- CORS ----------------------------------------------------------------------------------

async def test_configured_cors_allows_only_its_origins_methods_and_headers(
        gateway, embedded_redis):
    ok = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
          "Access-Control-Request-Headers": "Authorization"}
    async with aiohttp.ClientSession() as session:
        async with session.options(gateway.url + ROOT + "/v1/chat/completions", headers=ok,
                                   ssl=gateway.tls) as r:
            assert r.status == 200
            assert r.headers["Access-Control-Allow-Origin"] == ORIGIN  # never * with them
            assert r.headers["Access-Control-Allow-Credentials"] == "true"
            assert r.headers["Access-Control-Allow-Methods"] == "GET, POST"
            assert r.headers["Access-Control-Allow-Headers"] == "Authorization"
        for change, refused in (({"Origin": "https://evil.example"}, "origin"),
                                ({"Access-Control-Request-Method": "DELETE"}, "method"),
                                ({"Access-Control-Request-Headers": "x-secret"}, "headers")):
            async with session.options(gateway.url + "/v1/models", headers={**ok, **change},
                                       ssl=gateway.tls) as r:
                assert r.status == 400 and refused in await r.text()
        async with session.get(gateway.url + "/v1/models", ssl=gateway.tls,
                               headers={**AUTH, "Origin": "https://evil.example"}) as r:
            assert r.status == 200 and "Access-Control-Allow-Origin" not in r.headers
        async with fake_stages(embedded_redis.url, answer):
            async with session.post(gateway.url + "/v1/completions", ssl=gateway.tls,
                                    json={"prompt": "p", "stream": True},
                                    headers={**AUTH, "Origin": ORIGIN}) as r:
                assert r.status == 200 and (await r.text()).endswith("data: [DONE]\n\n")
                assert r.headers["Access-Control-Allow-Origin"] == ORIGIN  # a stream too
                assert r.headers["Vary"] == "Origin"


async def test_default_cors_lets_any_origin_call():
    """vLLM's defaults (["*"], no credentials), on an app of one route."""
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")
    app = web.Application()
    app.router.add_post("/v1/x", hello)
    preflight = {"Origin": "https://any.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "x-anything"}
    async with TestClient(TestServer(with_http_options(app, ServerConfig()))) as client:
        r = await client.options("/v1/x", headers=preflight)
        assert r.status == 200
        assert r.headers["Access-Control-Allow-Origin"] == "*"
        assert r.headers["Access-Control-Allow-Methods"] == ", ".join(ALL_METHODS)
        assert r.headers["Access-Control-Allow-Headers"] == "x-anything"
        assert "Access-Control-Allow-Credentials" not in r.headers
        r = await client.post("/v1/x", headers={"Origin": "https://any.example"})
        assert await r.text() == "hi" and r.headers["Access-Control-Allow-Origin"] == "*"
        r = await client.post("/v1/x")  # no Origin: no CORS headers
        assert "Access-Control-Allow-Origin" not in r.headers
        r = await client.options("/v1/x")  # not a preflight: the route has no OPTIONS
        assert r.status == 405


# --- client certificates required: the launcher's readiness ---------------------------------

def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def client_ca(tmp_path_factory) -> Path:
    """A CA (ca.pem) and a client certificate it signed (client.pem, client.key)."""
    root = tmp_path_factory.mktemp("client_ca")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", str(root / "ca.key"), "-out", str(root / "ca.pem"),
            "-days", "1", "-subj", "/CN=test clients CA")
    openssl("req", *ec, "-keyout", str(root / "client.key"), "-out", str(root / "client.csr"),
            "-subj", "/CN=a client")
    openssl("x509", "-req", "-in", str(root / "client.csr"), "-CA", str(root / "ca.pem"),
            "-CAkey", str(root / "ca.key"), "-CAcreateserial", "-days", "1",
            "-out", str(root / "client.pem"))
    return root


def test_with_client_certificates_required_the_launcher_sees_readiness_without_one(
        embedded_redis, tmp_path, certificate, client_ca):
    """--ssl-cert-reqs 2: the gateway refuses a /health without a client certificate (the
    launcher's own check, which has none), so the launcher reads what /health reads: the
    port taking connections and a shard's scheduler and worker alive in Redis."""
    tls = {"ssl_keyfile": str(certificate.parent / "key.pem"),
           "ssl_certfile": str(certificate), "ssl_ca_certs": str(client_ca / "ca.pem")}
    redis = embedded_redis.client()
    redis.set(keys.alive_scheduler(), "fake")
    redis.set(keys.alive_worker(), "fake")
    server = start_server(["gateway", demo_model_path(), "--redis-url", embedded_redis.url,
                           "--ssl-keyfile", tls["ssl_keyfile"], "--ssl-certfile",
                           tls["ssl_certfile"], "--ssl-ca-certs", tls["ssl_ca_certs"],
                           "--ssl-cert-reqs", "2"], tmp_path / "gateway.log")
    config = ServerConfig(host="127.0.0.1", port=server.port, ssl_cert_reqs=2, **tls)
    readiness = launcher.Readiness(config, embedded_redis.url)
    try:
        mutual = ssl.create_default_context(cafile=str(certificate))
        mutual.load_cert_chain(str(client_ca / "client.pem"), str(client_ca / "client.key"))
        wait_until_up(Gateway(server, readiness.url, mutual))
        assert not launcher._healthy(readiness.url + "/health")  # refused: no certificate
        assert readiness.ready()
        redis.delete(keys.alive_worker())  # /health would say 503 now; so does readiness
        assert not readiness.ready()
        redis.set(keys.alive_worker(), "fake")
        assert readiness.ready()
        assert not launcher.Readiness(config, "redis://127.0.0.1:1").ready()  # no Redis
    finally:
        assert not server.stop(), server.log_tail()
        redis.close()
    assert not readiness.ready()  # nothing listens on the port


def test_serve_with_client_certificates_required_says_serving(tmp_path, certificate,
                                                               client_ca):
    """The whole pipeline behind a gateway that requires client certificates: the
    launcher's "serving" line comes, and a client with a certificate is served."""
    server = start_server([*serve_args(tmp_path / "run"), "--ssl-keyfile",
                           str(certificate.parent / "key.pem"), "--ssl-certfile",
                           str(certificate), "--ssl-ca-certs", str(client_ca / "ca.pem"),
                           "--ssl-cert-reqs", "2"], tmp_path / "serve.log")
    try:
        deadline = time.monotonic() + 180
        while not any(r.get("event") == "serving" for r in server.log_records()):
            assert server.process.poll() is None and time.monotonic() < deadline, \
                server.log_tail()
            time.sleep(0.5)
        mutual = ssl.create_default_context(cafile=str(certificate))
        mutual.load_cert_chain(str(client_ca / "client.pem"), str(client_ca / "client.key"))
        with httpx2.Client(verify=mutual) as client:
            health = client.get(f"https://127.0.0.1:{server.port}/health", timeout=5)
        assert health.status_code == 200 and health.json()["status"] == "ok"
        stages, = [r for r in server.log_records() if r.get("event") == "stages"]
        counts = stage_counts(len(os.sched_getaffinity(0)))  # no stage flags: all sized
        assert (stages["gateways"], stages["tokenizers"], stages["detokenizers"]) == (
            counts["api_server_count"], counts["tokenizer_replicas"],
            counts["detokenizer_replicas"])
        assert len(stages["from_cores"]) == 3
    finally:
        assert not server.stop(), server.log_tail()


# --- logprob tokens, usage details, request logs ------------------------------------------

async def test_logprob_tokens_as_ids_usage_details_and_no_request_lines(
        gateway, embedded_redis):
    async with fake_stages(embedded_redis.url, answer), \
            openai_client(gateway, gateway.url) as client:
        chat = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            logprobs=True, top_logprobs=1)
        text = await client.completions.create(model=MODEL_NAME, prompt="p", max_tokens=2,
                                               logprobs=1)
    first = chat.choices[0].logprobs.content[0]
    assert (first.token, first.top_logprobs[0].token) == ("token_id:10", "token_id:99")
    assert first.bytes == list(b"t0")  # the bytes stay the text's, as in vLLM
    assert text.choices[0].logprobs.tokens == ["token_id:10", "token_id:11"]
    assert text.choices[0].logprobs.top_logprobs[0] == {"token_id:10": -0.5,
                                                        "token_id:99": -1.5}
    assert chat.usage.prompt_tokens_details.cached_tokens == 2
    records = gateway.process.log_records()
    events = {r["event"] for r in records if r.get("rid") in (chat.id, text.id)}
    assert not events & {"request queued", "request finished"}
    assert any(r["event"] == "gateway listening" and r["log_requests"] is False
               and r["url"].startswith("https://") for r in records)


def test_a_request_may_ask_for_token_ids_itself():
    """Without the server flag (the gateway ORs it in), as vLLM's request field."""
    for asked, tokens in ((None, ["t0"]), (True, ["token_id:10"])):
        body = {"prompt": "p", "logprobs": 0, "return_tokens_as_token_ids": asked}
        call = Call(parse_job(body, False), "cmpl-x", "m", 1, 0.0)
        call.offer(TextDelta("cmpl-x", 0, 0, "t0", [10], 3, "length", logprobs=[
            TokenLogprobs([10], [-0.5], 1, ["t0"])]))
        assert call.response().choices[0].logprobs.tokens == tokens


# --- request ids --------------------------------------------------------------------------

def answer_or_embed(req: GenerateRequest) -> list[ReplyBatch]:
    if req.embed:
        vector = torch.tensor([1.0, 0.0], dtype=torch.float32).numpy().tobytes()
        return [ReplyBatch([TextDelta(req.rid, 0, 0, "", [], 3, "stop", embedding=vector)])]
    return answer(req)


async def test_a_clients_request_id_names_its_response_and_comes_back_in_the_header(
        gateway, embedded_redis):
    """As vLLM's: the response id is the prefix and X-Request-Id, else the body's
    request_id; --enable-request-id-headers echoes X-Request-Id (or a fresh id). Two
    calls with the same id run side by side, each answered in full."""
    chat_body = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                     max_tokens=2)
    async with fake_stages(embedded_redis.url, answer_or_embed) as seen, \
            openai_client(gateway, gateway.url) as client:
        chat = await client.chat.completions.create(**chat_body,
                                                    extra_body={"request_id": "mine"})
        raw = await client.completions.with_raw_response.create(
            model=MODEL_NAME, prompt="p", max_tokens=2, extra_body={"request_id": "body"},
            extra_headers={"X-Request-Id": "header"})
        twins = await asyncio.gather(*(client.completions.create(
            model=MODEL_NAME, prompt="p", max_tokens=2, extra_body={"request_id": "same"})
            for _ in range(2)))
        stream = await client.chat.completions.create(**chat_body, stream=True,
                                                      extra_body={"request_id": "s"})
        chunk_ids = {chunk.id async for chunk in stream}
        plain = await client.embeddings.with_raw_response.create(
            model=MODEL_NAME, input=["a", "b"], extra_body={"request_id": "e"})
    assert chat.id == "chatcmpl-mine" and chunk_ids == {"chatcmpl-s"}
    assert raw.parse().id == "cmpl-header" and raw.headers["X-Request-Id"] == "header"
    assert [t.id for t in twins] == ["cmpl-same"] * 2
    assert [t.choices[0].text for t in twins] == ["t0t1"] * 2
    assert plain.parse().id == "embd-e" and len(plain.parse().data) == 2
    assert re.fullmatch("[0-9a-f]{32}", plain.headers["X-Request-Id"])  # none given: fresh
    rids = [req.rid for req in seen]
    assert len(rids) == len(set(rids)) == 7  # the bus's ids stay unique


# --- vllm: metric names --------------------------------------------------------------------

async def test_vllm_dashboard_and_keda_series_are_in_the_scrape(gateway, embedded_redis):
    rdb = embedded_redis.client()
    rdb.set(keys.scheduler_stats(), messages.encode(SchedulerStats(
        num_running=2, num_waiting=7, kv_cache_usage=0.5, num_preemptions=0,
        prefix_cache_queries=0, prefix_cache_hits=0, prompt_tokens=30,
        generation_tokens=20)))
    rdb.close()
    async with fake_stages(embedded_redis.url, answer), \
            openai_client(gateway, gateway.url) as client:
        await client.completions.create(model=MODEL_NAME, prompt="p", max_tokens=2)
    async with aiohttp.ClientSession() as session:
        async with session.get(gateway.url + ROOT + "/metrics", ssl=gateway.tls) as response:
            text = await response.text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    names = {name for name, _ in samples}
    assert sorted(set(DASHBOARD_SERIES + KEDA_SERIES) - names) == []
    shard_0 = (("model_name", MODEL_NAME), ("shard", "0"))  # the labels stay
    assert samples["vllm:num_requests_waiting", shard_0] == 7
    assert samples["vllm:gpu_cache_usage_perc", shard_0] == 0.5
    # beside, not instead: the same values under both names; headrace's own stay its own
    for name, labels in list(samples):
        if name.startswith("vllm:") and not name.startswith(("vllm:gpu_cache",
                                                             "vllm:time_per_output")):
            assert samples["headrace:" + name.removeprefix("vllm:"), labels] \
                == samples[name, labels]
    assert not any(n.startswith(("vllm:stage_", "vllm:stream_")) for n in names)
    assert any(n.startswith("headrace:stage_seconds") for n in names)


def test_vllm_aliases_copy_their_series_exactly():
    metrics = Metrics("m")
    metrics.set_scheduler_stats({0: SchedulerStats(1, 2, 0.75, 0, 0, 0, 5, 6),
                                 1: SchedulerStats(3, 4, 0.25, 0, 0, 0, 7, 8)})
    for shard, seconds in (("0", 0.01), ("1", 0.2)):
        metrics.observe(metrics.inter_token_latency, shard, seconds)
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for alias, name in (("vllm:gpu_cache_usage_perc", "headrace:kv_cache_usage_perc"),
                        ("vllm:time_per_output_token_seconds",
                         "headrace:inter_token_latency_seconds")):
        ours = [(s.name.removeprefix(name), s.labels, s.value) for s in families[name].samples]
        theirs = [(s.name.removeprefix(alias), s.labels, s.value)
                  for s in families[alias].samples]
        assert ours == theirs and families[alias].type == families[name].type
        assert {s.labels["shard"] for s in families[alias].samples} == {"0", "1"}


# --- chat history: a tool-call turn without content ---------------------------------------

TEMPLATE = "{% for m in messages %}{{ m['role'] }}:{{ m['content'] + '' }};{% endfor %}"


@pytest.mark.parametrize("turn", [{"content": None}, {}], ids=["null", "absent"])
def test_a_tool_call_turn_reaches_the_template_with_a_content_key(turn):
    """As vLLM renders it for templates that take strings: an empty content (transformers
    drops a None-valued key before the template sees it)."""
    tokenizer = AutoTokenizer.from_pretrained(str(SMOLLM2_TOKENIZER_DIR))
    tokenizer.chat_template = TEMPLATE
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "tool_calls": [call], **turn},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    assert render_chat(tokenizer, history, False) == "user:weather?;assistant:;tool:sunny;"
    # the template itself fails where the key is missing, as the issue saw
    with pytest.raises(Exception):
        tokenizer.apply_chat_template([{"role": "assistant", "tool_calls": [call]}],
                                      tokenize=False)
    with pytest.raises(ApiError):
        render_chat(tokenizer, [{"role": "assistant", "content": 3}], False)


# --- --use-tqdm-on-load --------------------------------------------------------------------

@pytest.mark.parametrize("progress", [True, False])
def test_loading_shows_a_progress_bar_unless_told_not_to(tmp_path, capsys, progress):
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, tmp_path / "model.safetensors")
    names = [name for name, _ in iter_safetensors(tmp_path, progress)]
    assert names == ["a", "b"]
    assert ("Loading weights" in capsys.readouterr().err) is progress


# --- --kv-cache-memory-bytes ---------------------------------------------------------------

GIB = 2**30


class ProfiledRunner:
    """A runner on a device whose memory readings the test sets (no GPU here)."""
    device = torch.device("cuda")

    def __init__(self) -> None:
        self.profiled = False

    def profile_run(self) -> None:
        self.profiled = True

    def graph_head_bytes(self) -> int:
        return GIB // 2


@pytest.fixture
def device_memory(monkeypatch):
    """80 GiB: 10 of weights, a 12 GiB peak with the activations, 1 GiB outside torch."""
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: 10 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 12 * GIB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (67 * GIB, 80 * GIB))


def test_kv_cache_memory_bytes_sizes_the_cache_instead_of_the_utilization(device_memory):
    per_block = 2**20
    config = EngineConfig(model="m", max_model_len=64, enforce_eager=True,
                          gpu_memory_utilization=0.5, kv_cache_memory=30 * GIB)
    runner = ProfiledRunner()
    assert plan_num_blocks(config, runner, per_block) == 30 * GIB // per_block
    assert runner.profiled  # the profile still checks the fit
    by_fraction = EngineConfig(model="m", max_model_len=64, enforce_eager=True)
    assert plan_num_blocks(by_fraction, ProfiledRunner(), per_block) \
        == (int(80 * GIB * 0.9) - 12 * GIB - GIB) // per_block
    too_big = EngineConfig(model="m", max_model_len=64, enforce_eager=True,
                           kv_cache_memory=68 * GIB)
    with pytest.raises(MemoryError, match="--kv-cache-memory-bytes .* does not fit"):
        plan_num_blocks(too_big, ProfiledRunner(), per_block)


def test_cuda_graphs_reserve_their_scaled_activations_and_their_heads_logits(device_memory):
    """2 GiB of profiled activations over 8,192 tokens scale to 128 MiB for graphs of 512;
    beside them the workspaces' 256 MiB and the sampling heads' logits (half a GiB here)."""
    per_block = 2**20
    config = EngineConfig(model="m", max_model_len=64, max_num_batched_tokens=8192,
                          max_num_seqs=256)
    graphs = 128 * 2**20 + 256 * 2**20 + GIB // 2
    assert plan_num_blocks(config, ProfiledRunner(), per_block) \
        == (int(80 * GIB * 0.9) - 12 * GIB - GIB - graphs) // per_block


def test_serve_refuses_a_certificate_it_cannot_load(tmp_path, certificate):
    """Before any child starts (services/launcher.py main), in one line."""
    launcher.check_tls(ServerConfig(ssl_keyfile=str(certificate.parent / "key.pem"),
                                    ssl_certfile=str(certificate)))
    for key, cert in ((tmp_path / "none.pem", tmp_path / "none.pem"),
                      (certificate, certificate)):  # no key in it
        with pytest.raises(ConfigError, match="--ssl-certfile"):
            launcher.check_tls(ServerConfig(ssl_keyfile=str(key), ssl_certfile=str(cert)))


def test_log_levels_follow_the_flags():
    root, requests = logging.getLogger(), logging.getLogger(REQUEST_LOGGER)
    saved = root.level, requests.level
    try:
        assert apply_log_levels(ServerConfig()) is None and root.level == saved[0]
        assert apply_log_levels(ServerConfig(uvicorn_log_level="trace")) is not None
        assert root.level == logging.DEBUG
        assert apply_log_levels(ServerConfig(uvicorn_log_level="debug",
                                             disable_uvicorn_access_log=True)) is None
        apply_log_levels(ServerConfig(uvicorn_log_level="error", disable_log_requests=True))
        assert (root.level, requests.level) == (logging.ERROR, logging.WARNING)
        assert ServerConfig(enable_log_requests=True).logs_requests
        assert not ServerConfig(enable_log_requests=False).logs_requests
    finally:
        root.setLevel(saved[0])
        requests.setLevel(saved[1])
