"""/v1/responses through the official `openai` client (`client.responses.create`,
`.stream`, `.retrieve`) against a real gateway process and the fake stages of
test_gateway.py: the request reaches the stages as the chat conversation it stands for,
the answer comes back as Responses output items (whole and as the Responses event stream),
and a stored response is retrieved and continued by id."""

from __future__ import annotations

import json

import openai
import pytest

from common import keys
from tests.e2e_fixtures import MODEL_NAME
from tests.test_gateway import (CALLING, TOOLS, api, exact, fake_stages, gateway,  # noqa: F401
                                in_order, rdb, redis_at, url)

pytestmark = pytest.mark.anyio
FUNCTION_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]  # Responses' flat spelling


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
