"""Structured outputs end to end on the CPU: a tiny random-weight model through the offline
LLM and through the services (real processes on a real Redis), and the demo SmolLM2
answering a schema (slow). With random weights the mask alone makes outputs valid, so
every check below is the grammar's, under greedy and under seeded temperature sampling."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from benchmarks.bench.pipeline import CLIENT, LocalPipeline, drive
from common.config import EngineConfig, ServerConfig
from common.errors import ApiError
from common.messages import GenerateRequest
from common.sampling_params import SamplingParams
from services import LLM
from services.demo import demo_model_path
from tests.tiny_models import make_tiny_model
from tests.tiny_models import model_in_this_process  # noqa: F401 (autouse)

# A bounded string by pattern, not maxLength: xgrammar 0.2.8 lets raw control characters
# into a string with a length bound, which JSON forbids (mlc-ai/xgrammar issue 800, open);
# random weights do sample them.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]},
                                  "maxItems": 2}}}
REGEX = r"\d{3}-[a-z]{2,4}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= ("yes" | "no") " " [0-9] [0-9]? "."'
GRAMMAR_AS_REGEX = r"(yes|no) [0-9][0-9]?\."
SPECS: dict[str, dict[str, Any]] = {
    "json": {"json": SCHEMA}, "regex": {"regex": REGEX}, "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR}}
CHECKS: dict[str, Callable[[str], bool]] = {
    "json": lambda text: jsonschema.validate(json.loads(text), SCHEMA) is None,
    "regex": lambda text: re.fullmatch(REGEX, text) is not None,
    "choice": lambda text: text in CHOICES,
    "grammar": lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text) is not None}
SAMPLINGS: list[dict[str, Any]] = [{"temperature": 0.0}] + [
    {"temperature": 1.0, "seed": seed} for seed in range(3)]
PROMPT = [5, 6, 7, 8]
BLOCKS = 128


def structured_params(kind: str, **sampling: Any) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=SPECS[kind], **sampling)


def assert_follows(kind: str, text: str, finish_reason: str | None) -> None:
    assert finish_reason == "stop", (kind, text)
    assert CHECKS[kind](text), (kind, text)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(str(model), num_gpu_blocks_override=BLOCKS)


# --- the offline LLM ------------------------------------------------------------------------

def test_outputs_follow_their_grammars_greedy_and_sampled(llm):
    cases = [(kind, sampling) for kind in SPECS for sampling in SAMPLINGS]
    outputs = llm.generate([PROMPT] * len(cases),
                           [structured_params(kind, **sampling) for kind, sampling in cases],
                           use_tqdm=False)
    for (kind, _), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert_follows(kind, completion.text, completion.finish_reason)


def test_json_object_is_an_object(llm):
    params = [SamplingParams(max_tokens=60, structured_outputs={"json_object": True}, **s)
              for s in SAMPLINGS]
    outputs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params,
                                                  use_tqdm=False)]
    assert outputs[0].finish_reason == "stop"
    finished = [c for c in outputs if c.finish_reason == "stop"]
    # random weights may open a string and fill it past max_tokens: the finished ones count
    assert len(finished) >= 2 and all(isinstance(json.loads(c.text), dict) for c in finished)


def test_plain_requests_are_untouched_by_structured_neighbours(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=7, top_k=40, max_tokens=20, ignore_eos=True)]
    prompts = [[9, 10, 11], [12, 13, 14, 15]]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate([PROMPT, prompts[0], PROMPT, prompts[1]],
                         [structured_params("json", temperature=1.0, seed=1), plain[0],
                          structured_params("regex", temperature=0.0), plain[1]],
                         use_tqdm=False)
    for i, j in ((0, 1), (1, 3)):
        a, b = alone[i].outputs[0], mixed[j].outputs[0]
        assert (a.token_ids, a.text) == (b.token_ids, b.text)
    assert_follows("json", mixed[0].outputs[0].text, mixed[0].outputs[0].finish_reason)


def test_preemption_recomputes_the_grammar_state(model, llm):
    kinds = list(SPECS) * 2
    params = [structured_params(kind, temperature=0.0) for kind in kinds]
    prompts = [[20 + i, 21, 22, 23 + i] for i in range(len(kinds))]
    roomy = llm.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(model), num_gpu_blocks_override=14, block_size=4)
    squeezed = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    for kind, a, b in zip(kinds, roomy, squeezed):
        assert_follows(kind, b.outputs[0].text, b.outputs[0].finish_reason)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    # the worker drops a finished request's state, matcher and all, with the next plan
    tight.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    assert [s.matcher for s in tight.engine.runner.requests.values()] in ([], [None])


def test_each_of_n_completions_has_its_own_grammar_state(llm):
    output = llm.generate([PROMPT], structured_params("json", n=4, temperature=1.0, seed=3),
                          use_tqdm=False)[0]
    texts = [c.text for c in output.outputs]
    for completion in output.outputs:
        assert_follows("json", completion.text, completion.finish_reason)
    assert len(set(texts)) > 1


def test_logprobs_are_those_of_the_masked_distribution(llm):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=5,
                            structured_outputs={"regex": "[ab]"})
    completion = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    a, b = (tokenizer.convert_tokens_to_ids(c) for c in "ab")
    first = completion.logprobs[0]
    assert set(first) == {a, b} | {t for t, lp in first.items() if lp.logprob == -math.inf}
    assert math.isclose(math.exp(first[a].logprob) + math.exp(first[b].logprob), 1.0,
                        rel_tol=1e-4)
    assert completion.text in ("a", "b")


def test_min_tokens_and_ignore_eos_give_way_to_the_grammar(llm):
    params = [SamplingParams(temperature=0.0, max_tokens=30, min_tokens=6,
                             structured_outputs={"regex": "[0-9]{1,12}"}),
              SamplingParams(temperature=0.0, max_tokens=30, min_tokens=10,
                             structured_outputs={"choice": ["ab"]}),
              SamplingParams(temperature=1.0, seed=2, max_tokens=30, ignore_eos=True,
                             structured_outputs={"choice": CHOICES})]
    digits, ab, choice = (o.outputs[0] for o in llm.generate([PROMPT] * 3, params,
                                                             use_tqdm=False))
    assert re.fullmatch("[0-9]{6,12}", digits.text) and digits.finish_reason == "stop"
    assert (ab.text, ab.finish_reason) == ("ab", "stop")  # a grammar that can only end
    assert_follows("choice", choice.text, choice.finish_reason)


def test_a_bad_grammar_fails_the_call_and_leaves_the_engine_clean(llm):
    good = structured_params("regex", temperature=0.0)
    bad = SamplingParams(structured_outputs={"json": {"type": "objec"}})
    with pytest.raises(ApiError) as caught:
        llm.generate([PROMPT, PROMPT], [good, bad], use_tqdm=False)
    assert caught.value.status == 400 and caught.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished()
    again = llm.generate([PROMPT], good, use_tqdm=False)[0].outputs[0]
    assert_follows("regex", again.text, again.finish_reason)


# --- the services ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline(model: Path, tmp_path_factory) -> Iterator[LocalPipeline]:
    pipe = LocalPipeline(tmp_path_factory.mktemp("pipeline"),
                         EngineConfig(model=str(model), num_gpu_blocks_override=BLOCKS),
                         ServerConfig())
    yield pipe
    pipe.stop()


def request(rid: str, prompt: list[int], **params: Any) -> GenerateRequest:
    return GenerateRequest(rid, CLIENT, params, prompt_token_ids=prompt,
                           arrival_time=time.time())


@pytest.mark.anyio
async def test_services_follow_grammars_as_the_offline_engine_does(pipeline, llm):
    cases = [(kind, sampling) for kind in SPECS for sampling in SAMPLINGS[:2]]
    plain = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    requests = [request(f"s{i}", PROMPT, max_tokens=120, structured_outputs=SPECS[kind],
                        **sampling) for i, (kind, sampling) in enumerate(cases)]
    requests += [request(f"p{i}", [30 + i, 31, 32], **plain) for i in range(2)]
    await pipeline.wait_ready()
    outcomes = await drive(pipeline.url, requests, timeout=120)
    offline = llm.generate([PROMPT] * len(cases),
                           [structured_params(kind, **sampling) for kind, sampling in cases],
                           use_tqdm=False)
    for i, (kind, _) in enumerate(cases):
        choice = outcomes[f"s{i}"].choices[0]
        assert_follows(kind, choice.text, choice.finish_reason)
        assert choice.token_ids == offline[i].outputs[0].token_ids
    alone = llm.generate([[30 + i, 31, 32] for i in range(2)], SamplingParams(**plain),
                         use_tqdm=False)
    for i, output in enumerate(alone):
        choice = outcomes[f"p{i}"].choices[0]
        assert (choice.token_ids, choice.text) == (output.outputs[0].token_ids,
                                                   output.outputs[0].text)


@pytest.mark.anyio
async def test_a_bad_schema_is_an_error_for_that_request_only(pipeline):
    requests = [request("long", PROMPT, temperature=0.0, max_tokens=48, ignore_eos=True),
                request("bad", PROMPT, structured_outputs={"json": {"type": "objec"}}),
                request("worse", PROMPT, structured_outputs={"regex": 7}),
                request("fine", PROMPT, temperature=0.0, max_tokens=60,
                        structured_outputs=SPECS["choice"])]
    await pipeline.wait_ready()
    outcomes = await drive(pipeline.url, requests, timeout=120)
    for rid, words in (("bad", 'Unsupported type "objec"'), ("worse", "must be a non-empty")):
        error = outcomes[rid].error
        assert error is not None and error.status == 400, rid
        assert error.param == "structured_outputs" and words in error.message
    long = outcomes["long"].choices[0]
    assert long.finish_reason == "length" and len(long.token_ids) == 48
    fine = outcomes["fine"].choices[0]
    assert_follows("choice", fine.text, fine.finish_reason)


# --- a real model -------------------------------------------------------------------------

@pytest.mark.slow
def test_the_demo_model_answers_a_schema():
    llm = LLM(demo_model_path(), num_gpu_blocks_override=64, max_model_len=512)
    schema = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
              "properties": {"country": {"type": "string", "maxLength": 40},
                             "capital": {"type": "string", "maxLength": 40}}}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs={"json": schema})
    output = llm.chat([{"role": "user", "content": "Name the country France and its capital "
                                                   "as JSON."}], params, use_tqdm=False)[0]
    completion = output.outputs[0]
    assert completion.finish_reason == "stop"
    answer = json.loads(completion.text)
    jsonschema.validate(answer, schema)
    assert answer["country"].lower() == "france" and answer["capital"] == "Paris"
