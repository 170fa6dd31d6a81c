"""End to end: a real `headrace serve` of the demo SmolLM2 (embedded Redis, worker,
scheduler, tokenizer, detokenizer and gateway as processes), driven by the official
`openai` client and aiohttp, started once for the module (tests/e2e_fixtures.py)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import AsyncIterator

import aiohttp
import anyio
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common import keys
from common.hops import STAGES
from common.model_files import resolve_model
from common.redis_server import find_redis_binary
from common.sampling_params import SamplingParams
from services.demo import demo_model_path
from services.offline.llm import LLM
from tests.conftest import run_command
from tests.e2e_fixtures import (API_KEY, MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_QUEUE_LEN,
                                MAX_REQUEST_BODY, MODEL_NAME, ServerProcess)
from tests.e2e_fixtures import served  # noqa: F401  (the module's server, a fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
USER = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "1, 2, 3, 5, 8, 13,",
           "Once upon a time, in a small village,"]
DESIGN_METRICS = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                  "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                  "time_to_first_token_seconds", "inter_token_latency_seconds",
                  "e2e_request_latency_seconds", "prefix_cache_queries_total",
                  "prefix_cache_hits_total", "stream_length", "stream_lag", "stream_pending",
                  "request_success_total"]
# vLLM's per-request histograms: a series each, with _bucket, _sum and _count samples
REQUEST_HISTOGRAMS = ["request_queue_time_seconds", "request_prefill_time_seconds",
                      "request_decode_time_seconds", "request_inference_time_seconds",
                      "request_time_per_output_token_seconds", "request_prompt_tokens",
                      "request_generation_tokens", "request_params_n",
                      "request_params_max_tokens"]


@pytest.fixture
async def api(served: ServerProcess, anyio_backend: str) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key=API_KEY,
                                  max_retries=0, timeout=60) as api:
        yield api


SHARD_0 = (("model_name", MODEL_NAME), ("shard", "0"))  # one shard: every series is shard 0's


async def metrics(url: str) -> dict[tuple[str, tuple], float]:
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as response:
            text = await response.text()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def until_idle(url: str, timeout_s: float = 15.0) -> dict[tuple[str, tuple], float]:
    """The metrics once nothing runs, waits or holds KV blocks (the scheduler publishes
    its stats every half second, and at once when a step ended requests)."""
    with anyio.fail_after(timeout_s):
        while True:
            samples = await metrics(url)
            if (samples.get(("headrace:num_requests_running", SHARD_0)) == 0
                    and samples.get(("headrace:num_requests_waiting", SHARD_0)) == 0
                    and samples.get(("headrace:kv_cache_usage_perc", SHARD_0)) == 0):
                return samples
            await anyio.sleep(0.2)


# --- generation ---------------------------------------------------------------------------

async def test_chat_knows_the_capital_of_france(api):
    out = await api.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=0,
                                            max_tokens=30)
    choice, = out.choices
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length") and out.model == MODEL_NAME
    assert out.usage.prompt_tokens > 10 and out.usage.completion_tokens >= 1


PERSON = {"type": "object", "additionalProperties": False, "required": ["city", "age"],
          "properties": {"city": {"enum": ["Paris", "Rome"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


async def test_structured_output_and_forced_tool_calls_through_the_openai_client(api):
    """response_format json_schema, guided_choice and a named tool through the real
    engine: the demo model's outputs follow them, greedy and sampled."""
    ask = [{"role": "user", "content": "Where does Ana live, and how old is she?"}]
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        out = await api.chat.completions.create(
            model=MODEL_NAME, messages=ask, max_tokens=40, **sampling,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": PERSON}})
        person = json.loads(out.choices[0].message.content)
        assert set(person) == {"city", "age"} and person["city"] in ("Paris", "Rome")
        out = await api.chat.completions.create(
            model=MODEL_NAME, messages=ask, max_tokens=5, **sampling,
            extra_body={"guided_choice": ["yes", "no"]})
        assert out.choices[0].message.content in ("yes", "no")
        out = await api.chat.completions.create(
            model=MODEL_NAME, messages=ask, max_tokens=40, **sampling,
            tools=[{"type": "function", "function": {"name": "save", "parameters": PERSON}}],
            tool_choice={"type": "function", "function": {"name": "save"}})
        call, = out.choices[0].message.tool_calls
        assert call.function.name == "save"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


async def token_id(served: ServerProcess, text: str) -> int:
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/tokenize",
                                json={"prompt": text, "add_special_tokens": False}) as response:
            token, = (await response.json())["tokens"]
    return token


async def test_logit_bias_and_allowed_token_ids_steer_the_tokens(api, served):
    berlin, rome, madrid = [await token_id(served, city) for city in (" Berlin", " Rome",
                                                                       " Madrid")]
    out = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3,
                                       temperature=0, logit_bias={str(berlin): 100})
    assert out.choices[0].text == " Berlin" * 3
    out = await api.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=6, temperature=1.0, seed=3, logprobs=True,
        extra_body={"allowed_token_ids": [rome, madrid], "ignore_eos": True})
    tokens = [entry.token for entry in out.choices[0].logprobs.content]
    assert len(tokens) == 6 and set(tokens) <= {" Rome", " Madrid"}
    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                     logit_bias={"10000000": 5})
    assert "out of vocabulary" in info.value.message


async def test_greedy_outputs_equal_the_offline_llm(api):
    replies = await asyncio.gather(*[
        api.completions.create(model=MODEL_NAME, prompt=p, temperature=0, max_tokens=16,
                               extra_body={"ignore_eos": True}) for p in PROMPTS])
    llm = await anyio.to_thread.run_sync(lambda: LLM(
        demo_model_path(), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64))
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16,
                                                   ignore_eos=True), use_tqdm=False)
    assert [r.choices[0].text for r in replies] == [o.outputs[0].text for o in offline]
    assert [r.usage.prompt_tokens for r in replies] == [len(o.prompt_token_ids)
                                                        for o in offline]
    assert all(r.usage.completion_tokens == 16 for r in replies)


async def test_streamed_text_equals_the_whole_response(api):
    whole = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                         max_tokens=12)
    stream = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                          max_tokens=12, stream=True,
                                          stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


async def test_a_chat_stream_starts_with_the_role(api):
    stream = await api.chat.completions.create(model=MODEL_NAME, messages=USER, temperature=0,
                                               max_tokens=30, stream=True,
                                               stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[1:-1])
    assert "Paris" in text and chunks[-2].choices[0].finish_reason is not None
    assert chunks[-1].usage.completion_tokens >= 1 and all(c.id == chunks[0].id
                                                           for c in chunks)


async def test_n_and_seed_are_reproducible(api):
    params = dict(model=MODEL_NAME, prompt="Write a word:", n=2, temperature=1.0, seed=11,
                  max_tokens=8)
    first, second = [await api.completions.create(**params) for _ in range(2)]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage == second.usage
    two_prompts = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=2,
                                               temperature=0, max_tokens=4)
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3]
    assert two_prompts.choices[0].text == two_prompts.choices[1].text  # greedy: equal


async def test_logprobs(api):
    out = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], temperature=0,
                                       max_tokens=5, logprobs=2)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)
    for token, lp, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert top[token] == lp and lp == max(top.values())  # greedy took the likeliest
    chat = await api.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4,
                                             logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 3 for entry in content)


async def test_echo_returns_the_prompt_and_its_logprobs(api):
    out = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], echo=True,
                                       temperature=0, max_tokens=3, logprobs=1)
    choice = out.choices[0]
    assert choice.text.startswith(PROMPTS[0]) and len(choice.text) > len(PROMPTS[0])
    num_prompt = out.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None
    assert all(lp is not None for lp in choice.logprobs.token_logprobs[1:])
    assert "".join(choice.logprobs.tokens[:num_prompt]) == PROMPTS[0]
    one = await api.completions.create(model=MODEL_NAME, prompt=[9690], echo=True,
                                       temperature=0, max_tokens=2, logprobs=0)
    logprobs = one.choices[0].logprobs  # a one-token prompt's token is there, unscored
    assert len(logprobs.tokens) == 3 and logprobs.token_logprobs[0] is None
    assert one.choices[0].text.startswith(logprobs.tokens[0]) and logprobs.tokens[0]


async def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(api):
    prompt = "Cached tokens: " + " ".join(["the quick brown fox jumps over the lazy dog"] * 8)
    first, again = [await api.completions.create(model=MODEL_NAME, prompt=prompt,
                                                 temperature=0, max_tokens=1)
                    for _ in range(2)]
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert num_prompt - 16 <= cached < num_prompt  # every full block but the last token's


async def test_stop_strings_end_the_text_before_them(api):
    whole = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], temperature=0,
                                         max_tokens=20)
    stop = whole.choices[0].text.strip().split(",")[1] + ","  # e.g. " 34,"
    out = await api.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], temperature=0,
                                       max_tokens=20, stop=[stop])
    choice = out.choices[0]
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    assert stop not in choice.text and whole.choices[0].text.startswith(choice.text)
    assert out.usage.completion_tokens < 20


# --- embeddings ---------------------------------------------------------------------------

def transformers_embeddings(texts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """The prompts' ids and their last tokens' final hidden states (after the final norm),
    L2-normalized: the server's default pooling, by transformers on the same weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(demo_model_path())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [tokenizer(text)["input_ids"] for text in texts]
    with torch.no_grad():
        last = [hf(torch.tensor([i]), output_hidden_states=True).hidden_states[-1][0, -1]
                for i in ids]
    return ids, torch.nn.functional.normalize(torch.stack(last), dim=-1)


async def test_embeddings_through_the_openai_client_equal_transformers(api):
    texts = PROMPTS[:3]
    ids, expected = await anyio.to_thread.run_sync(transformers_embeddings, texts)
    greedy = dict(model=MODEL_NAME, prompt=PROMPTS[3], temperature=0, max_tokens=8,
                  extra_body={"ignore_eos": True})
    alone = await api.completions.create(**greedy)
    # beside a completion in the batch; the client asks for base64 unless told otherwise
    packed, floats, by_ids, mixed = await asyncio.gather(
        api.embeddings.create(model=MODEL_NAME, input=texts),
        api.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float"),
        api.embeddings.create(model=MODEL_NAME, input=ids),
        api.completions.create(**greedy))
    assert mixed.choices[0].text == alone.choices[0].text
    # the same numbers (up to the batch they were computed in), whichever the encoding
    torch.testing.assert_close(torch.tensor([d.embedding for d in packed.data]),
                               torch.tensor([d.embedding for d in floats.data]),
                               atol=1e-5, rtol=1e-5)
    for out in (floats, by_ids):
        assert out.object == "list" and out.model == MODEL_NAME and out.id.startswith("embd-")
        assert [d.index for d in out.data] == [0, 1, 2]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        got = torch.tensor([d.embedding for d in out.data])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    one = await api.embeddings.create(model=MODEL_NAME, input=texts[0], dimensions=576)
    assert len(one.data) == 1 and len(one.data[0].embedding) == 576


async def test_embedding_requests_that_cannot_be_answered_are_400s(api):
    cases = [({"input": ""}, "input", "'input' must be a non-empty string"),
             ({"input": ["Hi", ""]}, "input", "none of them empty"),
             ({"input": "Hi", "dimensions": 64}, "dimensions",
              "'dimensions' is 64, but this model's embeddings have 576 dimensions"),
             ({"input": "hello " * (MAX_MODEL_LEN + 50)}, "input",
              f"maximum context length is {MAX_MODEL_LEN} tokens")]
    for body, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await api.embeddings.create(model=MODEL_NAME, **body)
        assert info.value.body["param"] == param and words in info.value.message, body


async def test_responses_and_score_run_the_chat_and_embedding_paths(api, served):
    """Greedy, a Responses answer is the chat completion of the conversation it stands for
    (also continued by previous_response_id); a /v1/score is the cosine similarity of the
    /v1/embeddings vectors of its texts."""
    greedy = dict(model=MODEL_NAME, temperature=0)
    first = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": PROMPTS[0]}]
    chat = await api.chat.completions.create(messages=first, max_completion_tokens=8,
                                             **greedy)
    answer = await api.responses.create(instructions="Be brief.", input=PROMPTS[0],
                                        max_output_tokens=8, **greedy)
    assert answer.output_text and answer.output_text == chat.choices[0].message.content
    history = [first[1], {"role": "assistant", "content": answer.output_text},
               {"role": "user", "content": "And then?"}]
    chat = await api.chat.completions.create(messages=history, max_completion_tokens=6,
                                             **greedy)
    later = await api.responses.create(input="And then?", previous_response_id=answer.id,
                                       max_output_tokens=6, **greedy)
    assert later.output_text == chat.choices[0].message.content

    embedded = await api.embeddings.create(model=MODEL_NAME, input=PROMPTS[:3],
                                           encoding_format="float")
    vectors = torch.tensor([d.embedding for d in embedded.data], dtype=torch.float64)
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/v1/score", headers={
                "Authorization": f"Bearer {API_KEY}"}, json={
                "model": MODEL_NAME, "text_1": PROMPTS[0], "text_2": PROMPTS[1:3]}) as response:
            scored = await response.json()
    expected = torch.nn.functional.cosine_similarity(vectors[:1], vectors[1:]).tolist()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-4)


# --- errors through the pipeline ---------------------------------------------------------

async def test_a_prompt_longer_than_the_model_is_400_naming_both_numbers(api, served):
    prompt = "hello " * (MAX_MODEL_LEN + 50)
    async with aiohttp.ClientSession() as session:
        async with session.post(served.url + "/tokenize", json={"prompt": prompt}) as response:
            counted = await response.json()
    assert counted["max_model_len"] == MAX_MODEL_LEN and counted["count"] > MAX_MODEL_LEN
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await api.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                         stream=stream)
        message = info.value.message
        assert f"{MAX_MODEL_LEN} tokens" in message and f"{counted['count']} input" in message


async def test_client_errors(api, served):
    with pytest.raises(openai.BadRequestError) as info:
        await api.completions.create(model=MODEL_NAME, prompt="a", temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.NotFoundError):
        await api.chat.completions.create(model="gpt-x", messages=USER)
    async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="wrong",
                                  max_retries=0) as stranger:
        with pytest.raises(openai.AuthenticationError):
            await stranger.models.list()
    async with aiohttp.ClientSession() as session:
        body = {"model": MODEL_NAME, "prompt": "x" * MAX_REQUEST_BODY}
        async with session.post(served.url + "/v1/completions", json=body,
                                headers=AUTH) as response:
            assert response.status == 413
            assert (await response.json())["error"]["code"] == 413
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


async def probe_until(url: str, status: int, probe_timeout_s: float,
                      timeout_s: float = 60.0) -> tuple[dict[str, str], dict]:
    """POST one-token completions until one is answered with `status`: (headers, body). A
    probe not answered within `probe_timeout_s` (queued behind others) is abandoned, which
    aborts it."""
    probe = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1}
    patience = aiohttp.ClientTimeout(total=probe_timeout_s)
    async with aiohttp.ClientSession(timeout=patience) as session:
        with anyio.fail_after(timeout_s):
            while True:
                try:
                    async with session.post(url + "/v1/completions", headers=AUTH,
                                            json=probe) as response:
                        body = await response.json()
                    if response.status == status:
                        return dict(response.headers), body
                except asyncio.TimeoutError:
                    pass
                await anyio.sleep(0.1)


async def test_a_full_queue_is_503_with_retry_after(api, served):
    """More long requests than the batch holds: the rest wait, and past --max-queue-len
    waiting the gateway refuses new ones; the long ones are then abandoned."""
    long = dict(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=400,
                extra_body={"ignore_eos": True})

    async def occupy() -> None:
        try:
            await api.completions.create(**long)
        except openai.APIStatusError as e:  # came after the queue was full
            assert e.status_code == 503

    async with anyio.create_task_group() as load:
        for _ in range(MAX_NUM_SEQS + MAX_QUEUE_LEN + 4):
            load.start_soon(occupy)
        headers, body = await probe_until(served.url, 503, probe_timeout_s=2.0)
        load.cancel_scope.cancel()  # the clients leave: their requests are aborted
    assert headers["Retry-After"].isdigit()
    assert "--max-queue-len" in body["error"]["message"]
    await until_idle(served.url)
    await probe_until(served.url, 200, probe_timeout_s=30.0)  # admitted again


async def test_streaming_clients_that_leave_free_the_kv_cache(api, served):
    async def leave_after_three_chunks() -> None:
        stream = await api.chat.completions.create(
            model=MODEL_NAME, messages=USER, max_tokens=300, stream=True,
            extra_body={"ignore_eos": True})
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
        await stream.close()

    async with anyio.create_task_group() as burst:
        for _ in range(MAX_NUM_SEQS + 2):
            burst.start_soon(leave_after_three_chunks)
    samples = await until_idle(served.url)
    assert samples["headrace:generation_tokens_total", SHARD_0] > 0


# --- operations ---------------------------------------------------------------------------

async def test_metrics_carry_the_design_names(api, served):
    """vLLM's names under headrace:, every series labelled with the served model name; a
    request's phases observed once per completion, its n and max_tokens once."""
    before = await until_idle(served.url)
    await api.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2,
                                 extra_body={"ignore_eos": True})
    await api.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, n=2,
                                 extra_body={"ignore_eos": True})
    samples = await metrics(served.url)
    names = {name for name, _ in samples}
    for metric in DESIGN_METRICS:
        assert any(name.startswith("headrace:" + metric) for name in names), metric
    assert all(dict(labels)["model_name"] == MODEL_NAME for name, labels in samples
               if name.startswith("headrace:"))
    added = {name: samples.get((f"headrace:{name}", SHARD_0), 0.0)
             - before.get((f"headrace:{name}", SHARD_0), 0.0)
             for metric in REQUEST_HISTOGRAMS for name in (metric + "_count", metric + "_sum")}
    for phase in ("queue", "prefill", "decode", "inference"):  # three completions
        assert added[f"request_{phase}_time_seconds_count"] == 3, phase
        assert added[f"request_{phase}_time_seconds_sum"] >= 0, phase
    assert added["request_time_per_output_token_seconds_count"] == 3
    assert added["request_generation_tokens_sum"] == 2 + 2 * 3
    assert (added["request_params_n_count"], added["request_params_n_sum"]) == (2, 3)
    assert added["request_params_max_tokens_sum"] == 2 + 3
    assert added["request_prompt_tokens_count"] == 3
    samples = await until_idle(served.url)
    assert samples["headrace:prompt_tokens_total", SHARD_0] > 0
    assert sum(value for (name, _), value in samples.items()
               if name == "headrace:request_success_total") >= 1


async def test_metrics_running_and_waiting_read_zero_as_soon_as_requests_end(api, served):
    """The scheduler publishes its figures at once after a step that ended requests (not
    only every half second): the scrape right after the last answer counts none running."""
    await until_idle(served.url)
    for _ in range(3):
        await asyncio.gather(*(api.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
            for prompt in PROMPTS))
        samples = await until_idle(served.url, timeout_s=0.3)  # publishing lags 0.5 s
        assert samples["headrace:num_requests_running", SHARD_0] == 0


def stage_totals(samples: dict[tuple[str, tuple], float]) -> dict[str, tuple[float, float]]:
    """(count, sum) of headrace:stage_seconds per stage."""
    totals: dict[str, list[float]] = {stage: [0.0, 0.0] for stage in STAGES}
    for (name, labels), value in samples.items():
        if name in ("headrace:stage_seconds_count", "headrace:stage_seconds_sum"):
            totals[dict(labels)["stage"]][name.endswith("_sum")] = value
    return {stage: (count, total) for stage, (count, total) in totals.items()}


async def test_stage_histograms_account_for_a_streamed_request(api, served):
    before = stage_totals(await until_idle(served.url))
    sent = time.monotonic()
    stream = await api.completions.create(model=MODEL_NAME, prompt="The river", max_tokens=5,
                                          stream=True, extra_body={"ignore_eos": True})
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.monotonic() - sent
    after = stage_totals(await metrics(served.url))
    counts = {stage: after[stage][0] - before[stage][0] for stage in STAGES}
    seconds = {stage: after[stage][1] - before[stage][1] for stage in STAGES}
    for stage in ("gateway_to_tokenizer", "tokenizer", "admit_to_plan"):
        assert counts[stage] == 1, (stage, counts)  # once per request
    for stage in ("plan_to_worker", "step", "result_to_detokenizer", "detokenizer"):
        assert counts[stage] == 5, (stage, counts)  # once per step that sampled a token
    assert 1 <= counts["detokenizer_to_client"] <= 5, counts
    assert all(value >= 0 for value in seconds.values()), seconds
    # the request's way in happened before its first token reached this client
    assert ttft is not None
    way_in = sum(seconds[s] for s in ("gateway_to_tokenizer", "tokenizer", "admit_to_plan"))
    assert 0 < way_in < ttft, (way_in, ttft)
    assert seconds["step"] > 0, seconds


def test_operators_see_the_consumer_groups(served):
    socket = served.run_dir / "redis.sock"
    cli = subprocess.run([find_redis_binary("redis-cli"), "-s", str(socket), "XINFO", "GROUPS",
                          "hr:requests"], capture_output=True, text=True, timeout=30)
    assert cli.returncode == 0 and "tokenizer" in cli.stdout, cli.stdout + cli.stderr
    queues = run_command("queues", "--redis-url", f"unix://{socket}")
    assert queues.returncode == 0, queues.stderr
    for stream, group in (("hr:requests", "tokenizer"), (keys.admit(), "scheduler"),
                          ("hr:detok", "detokenizer")):
        assert stream in queues.stdout and group in queues.stdout
    # every process reports its recent stalls: a slow one would show "slow" in its row
    processes = [line.split()[0] for line in queues.stdout.splitlines()[1:]
                 if line.split()[-1:] in (["ok"], ["slow"])]
    for stage in ("gateway", "tokenizer", "scheduler", "worker", "detokenizer"):
        assert any(p.startswith(f"{stage}-") for p in processes), queues.stdout
    # and so does /metrics, process by process
    scraped = anyio.run(metrics, served.url)
    stalled = {dict(labels)["process"] for name, labels in scraped
               if name == "headrace:process_worst_stall_seconds"}
    for stage in ("gateway", "tokenizer", "scheduler", "worker", "detokenizer"):
        assert any(p.startswith(f"{stage}-") for p in stalled), stalled


def test_the_gateway_logs_each_request_with_its_rid(served):
    records = [r for r in served.log_records() if r.get("service") == "gateway"]
    finished = [r for r in records if r.get("event") == "request finished"]
    assert finished and all(r["rid"].startswith(("cmpl-", "chatcmpl-", "embd-", "score-",
                                                 "rerank-"))
                            for r in finished)
    assert any(r.get("event") == "client disconnected" for r in records)
