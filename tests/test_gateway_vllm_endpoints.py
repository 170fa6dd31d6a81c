"""The endpoints vLLM serves beside OpenAI's usual ones, against a real gateway process and
the fake stages of test_gateway.py (one gateway for the module):

- /v1/responses through the official `openai` client (`client.responses.create`,
  `.stream`, `.retrieve`): the request reaches the stages as the chat conversation it stands
  for, the answer comes back as Responses output items (whole and as the Responses event
  stream), and a stored response is retrieved and continued by id.
- /score and /rerank (and their /v1 and Cohere /v2 paths) over raw HTTP, the stages
  answering each embedding request with a vector made from its text: each distinct text is
  asked for once, and the scores are the cosine similarities of those vectors, computed here
  the long way."""

from __future__ import annotations

import hashlib
import json
import math
from types import SimpleNamespace

import aiohttp
import numpy as np
import openai
import pytest

from common import keys
from common.errors import ApiError
from common.messages import ErrorReply, GenerateRequest, ReplyBatch, TextDelta
from services.gateway.scoring import check_scorable
from tests.e2e_fixtures import MODEL_NAME
from tests.test_gateway import (AUTH, CALLING, TOOLS, api, exact, fake_stages,  # noqa: F401
                                gateway, in_order, rdb, redis_at, url)

pytestmark = pytest.mark.anyio
FUNCTION_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # Responses' flat spelling


# --- /v1/responses ---------------------------------------------------------------------


async def test_create_retrieve_and_continue_a_stored_response(redis_at, api, rdb):
    async with fake_stages(redis_at, exact(["Hel", "lo"])) as seen:
        first = await api.responses.create(model=MODEL_NAME, input="Hi",
                                           instructions="Be brief.", max_output_tokens=5,
                                           temperature=0.5)
        second = await api.responses.create(model=MODEL_NAME, input="And again?",
                                            previous_response_id=first.id)
    assert first.id.startswith("resp_") and first.object == "response"
    assert first.status == "completed" and first.output_text == "Hello"
    assert first.output[0].type == "message" and first.output[0].role == "assistant"
    assert first.usage.input_tokens == 3 and first.usage.output_tokens == 2
    assert seen[0].messages == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"}]
    assert seen[0].params == {"max_tokens": 5, "temperature": 0.5}
    # the history, without the first call's instructions, then the new input
    assert seen[1].messages == [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"},
                                {"role": "user", "content": "And again?"}]
    assert second.previous_response_id == first.id
    got = await api.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    assert 0 < rdb.ttl(keys.stored_response(first.id)) <= 24 * 3600
    await api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(first.id)


async def test_a_client_may_replay_the_output_items_instead_of_storing(redis_at, api):
    """Clients that keep the conversation themselves (store: false) send earlier output
    items back as input, reasoning items included."""
    async with fake_stages(redis_at, exact(CALLING[:3])) as seen:
        first = await api.responses.create(model=MODEL_NAME, input="Hi", store=False)
        replay = [item.model_dump(exclude_none=True) for item in first.output]
        await api.responses.create(model=MODEL_NAME, store=False,
                                   input=[{"role": "user", "content": "Hi"}, *replay,
                                          {"role": "user", "content": "More?"}])
    assert [item["type"] for item in replay] == ["reasoning", "message"]
    assert seen[1].messages == [{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": [
                                    {"type": "text", "text": "Let me look."}]},
                                {"role": "user", "content": "More?"}]


async def test_a_length_cut_answer_is_incomplete_and_store_false_keeps_nothing(redis_at, api):
    async with fake_stages(redis_at, in_order(["a", "b"])):
        out = await api.responses.create(model=MODEL_NAME, input="Hi", store=False)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve(out.id)


async def test_unknown_ids_and_bad_fields_are_refused(api, rdb):
    for given in ("resp_" + "0" * 32, "hr:requests"):
        with pytest.raises(openai.NotFoundError) as info:
            await api.responses.create(model=MODEL_NAME, input="Hi",
                                       previous_response_id=given)
        assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve("resp_" + "1" * 32)
    with pytest.raises(openai.BadRequestError) as info:
        await api.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=0)
    assert info.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await api.responses.create(model=MODEL_NAME, input=[{"type": "function_call_output",
                                                             "output": "x"}])
    assert "call_id" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # images: this server reads text
        await api.responses.create(model=MODEL_NAME, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert info.value.body["param"] == "input" and "input[0]" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        await api.responses.create(model=MODEL_NAME, input="Hi", background=True)
    assert info.value.body["param"] == "background"
    assert rdb.xlen(keys.REQUESTS) == 0


async def test_tool_calls_whole_and_streamed_then_their_output_goes_back(redis_at, api):
    async with fake_stages(redis_at, exact(CALLING)) as seen:
        whole = await api.responses.create(model=MODEL_NAME, input="Weather in Paris?",
                                           tools=FUNCTION_TOOLS)
        async with api.responses.stream(model=MODEL_NAME, input="Weather in Paris?",
                                        tools=FUNCTION_TOOLS) as stream:
            events = [event async for event in stream]
            streamed = await stream.get_final_response()
        call = whole.output[-1]
        answer = await api.responses.create(
            model=MODEL_NAME, previous_response_id=whole.id, tools=FUNCTION_TOOLS,
            input=[{"type": "function_call_output", "call_id": call.call_id,
                    "output": "sunny"}])
    assert seen[0].tools == TOOLS
    for out in (whole, streamed):
        assert [item.type for item in out.output] == ["reasoning", "message", "function_call"]
        assert out.output[0].content[0].text == "Paris needs a look"
        assert out.output_text == "Let me look."
        assert out.output[2].name == "get_weather"
        assert json.loads(out.output[2].arguments) == {"city": "Paris"}
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.output_text.done" in kinds
    assert "response.function_call_arguments.delta" in kinds
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(len(events)))
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == "Let me look."
    assert [(m["role"], m.get("tool_call_id")) for m in seen[2].messages] == [
        ("user", None), ("assistant", None), ("tool", call.call_id)]
    assert seen[2].messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert answer.status == "completed"


async def test_input_items_and_a_json_schema_format_reach_the_stages(redis_at, api):
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    items = [{"role": "developer", "content": "Answer in JSON."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Give x."}]}]
    async with fake_stages(redis_at, exact(['{"x": ', '1}'])) as seen:
        out = await api.responses.create(
            model=MODEL_NAME, input=items,
            text={"format": {"type": "json_schema", "name": "x", "schema": schema}})
        stream = await api.responses.create(model=MODEL_NAME, input="Hi", stream=True)
        kinds = [event.type async for event in stream]
    assert seen[0].params["structured_outputs"] == {"json": schema}
    assert seen[0].messages == [{"role": "system", "content": "Answer in JSON."},
                                {"role": "user", "content": [{"type": "text",
                                                              "text": "Give x."}]}]
    assert json.loads(out.output_text) == {"x": 1}
    assert out.text.format.type == "json_schema"
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"


async def test_an_error_while_streaming_ends_with_error_and_response_failed(url, redis_at):
    def script(req: GenerateRequest) -> list:
        return [ReplyBatch([TextDelta(req.rid, 0, 0, "a", [10], 3)]), 0.1,
                ErrorReply(req.rid, 503, "The worker died.", "ServiceUnavailableError")]
    async with fake_stages(redis_at, script), aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/responses", headers=AUTH, json={
                "model": MODEL_NAME, "input": "Hi", "stream": True}) as response:
            text = await response.text()
    assert response.status == 200
    events = [(lines[0].removeprefix("event: "), json.loads(lines[1].removeprefix("data: ")))
              for lines in (event.split("\n") for event in text.split("\n\n") if event)]
    assert all(name == data["type"] for name, data in events)
    (error_name, error), (failed_name, failed) = events[-2:]
    assert (error_name, failed_name) == ("error", "response.failed")
    assert error["message"] == "The worker died." and error["code"] == "503"
    assert failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "The worker died."
    assert "".join(d["delta"] for n, d in events if n == "response.output_text.delta") == "a"


# --- /score and /rerank ------------------------------------------------------------------

DIM = 8


def vector(text: str) -> list[float]:
    """A text's made-up embedding: 8 numbers in [-1, 1) from its hash."""
    digest = hashlib.sha256(text.encode()).digest()
    return [b / 128 - 1 for b in digest[:DIM]]


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def embed_script(req: GenerateRequest) -> list:
    assert req.embed and req.prompt is not None
    return [ReplyBatch([TextDelta(req.rid, 0, 0, "", [], len(req.prompt.split()), "stop",
                                  embedding=np.asarray(vector(req.prompt), "<f4").tobytes())])]


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url + path, json=body, headers=AUTH) as response:
            return response.status, await response.json()


async def test_score_one_to_many_and_pairwise(url, redis_at):
    docs = ["Paris is in France.", "Brasilia is in Brazil.", "Paris is in France."]
    async with fake_stages(redis_at, embed_script) as seen:
        status, one = await post(url, "/score", {"model": MODEL_NAME, "text_1": "France?",
                                                 "text_2": docs})
        status_v1, pairwise = await post(url, "/v1/score", {
            "text_1": ["a b", "c"], "text_2": ["c", "a b"]})
    assert (status, status_v1) == (200, 200)
    assert sorted(r.prompt for r in seen[:3]) == sorted({"France?", *docs})  # once each
    assert one["object"] == "list" and one["id"].startswith("score-")
    assert one["model"] == MODEL_NAME
    assert [d["index"] for d in one["data"]] == [0, 1, 2]
    assert all(d["object"] == "score" for d in one["data"])
    expected = [cosine(vector("France?"), vector(d)) for d in docs]
    assert [d["score"] for d in one["data"]] == pytest.approx(expected, abs=1e-6)
    assert one["usage"] == {"prompt_tokens": 1 + 4 + 4, "total_tokens": 9}
    same = cosine(vector("a b"), vector("c"))
    assert [d["score"] for d in pairwise["data"]] == pytest.approx([same, same], abs=1e-6)


async def test_rerank_orders_documents_by_similarity(url, redis_at):
    docs = [f"document number {i}" for i in range(5)]
    query = "which document?"
    expected = sorted(range(5), key=lambda i: -cosine(vector(query), vector(docs[i])))
    async with fake_stages(redis_at, embed_script):
        results = {}
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            status, results[path] = await post(url, path, {
                "model": MODEL_NAME, "query": query,
                "documents": docs[:2] + [{"text": d} for d in docs[2:]], "top_n": 3})
            assert status == 200, results[path]
        _, bare = await post(url, "/rerank", {"query": query, "documents": docs,
                                              "return_documents": False})
    got = results["/v1/rerank"]
    assert got["id"].startswith("rerank-") and got["model"] == MODEL_NAME
    assert [r["index"] for r in got["results"]] == expected[:3]
    for r in got["results"]:
        assert r["document"] == {"text": docs[r["index"]]}
        assert r["relevance_score"] == pytest.approx(
            cosine(vector(query), vector(docs[r["index"]])), abs=1e-6)
    assert got["usage"] == {"total_tokens": 2 + 5 * 3}
    assert [r["index"] for r in bare["results"]] == expected
    assert all("document" not in r for r in bare["results"])


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
])
async def test_bad_score_and_rerank_bodies_are_400(url, rdb, path, body, param):
    status, error = await post(url, path, body)
    assert status == 400 and error["error"]["param"] == param, error
    assert rdb.xlen("hr:requests") == 0


def test_cross_encoders_are_refused_with_the_reason():
    check_scorable(SimpleNamespace(architectures=["Qwen2ForCausalLM"]), "/score")
    check_scorable(SimpleNamespace(), "/score")
    with pytest.raises(ApiError, match="cross-encoder") as info:
        check_scorable(SimpleNamespace(architectures=["XLMRobertaForSequenceClassification"]),
                       "/rerank")
    assert info.value.status == 400 and "XLMRobertaForSequenceClassification" in \
        info.value.message
