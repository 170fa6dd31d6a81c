"""Speculative decoding with a draft model end to end on tiny random-weight models (CPU):
the same tokens as without it for greedy requests, the same distribution for random ones,
and a draft with the target's own weights accepted almost always (which only holds while
the draft's KV cache follows every step's tokens and positions)."""

from __future__ import annotations

import json

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.messages import AdmitRequest, StepResult
from common.model_info import resolve_engine
from common.sampling_params import SamplingParams
from common.speculative import SpeculativeConfig
from services import LLM
from services.scheduler.core import Scheduler, SchedulerConfig
from tests.test_spec_decode import (assert_same_distribution, engine,
                                    second_tokens_without_and_with)
from tests.tiny_models import make_tiny_model


def draft_config(model_dir, k: int = 3) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


def random_prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 500, (length,), generator=g).tolist()
            for length in (5, 11, 17, 23)[:n]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny llama target and a smaller llama draft of other random weights."""
    base = tmp_path_factory.mktemp("draft-models")
    target = make_tiny_model(base / "target", "llama")
    other = make_tiny_model(base / "draft", "llama", seed=7, num_hidden_layers=1,
                            hidden_size=32, intermediate_size=64)
    return target, other


# --- config ---------------------------------------------------------------------------

def test_config_both_forms():
    explicit = EngineConfig(speculative_config=json.dumps(draft_config("d", 4))).speculative()
    assert explicit == SpeculativeConfig(4, method="draft_model", model="d")
    inferred = EngineConfig(speculative_config=json.dumps(
        {"model": "d", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}))
    assert inferred.speculative() == SpeculativeConfig(2, method="draft_model", model="d")
    older = EngineConfig(speculative_config=json.dumps({"model": "d"}),
                         num_speculative_tokens=5)
    assert older.speculative() == SpeculativeConfig(5, method="draft_model", model="d")


@pytest.mark.parametrize("value, extra, words", [
    ({"model": "d", "num_speculative_tokens": 3}, {"tensor_parallel_size": 2},
     "tensor-parallel-size 1 only"),
    ({"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, {},
     "draft_tensor_parallel_size must be 1"),
    ({"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}, {}, "unknown"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, {}, "model"),
    ({"model": "d"}, {}, "num_speculative_tokens"),
    ({"method": "eagle", "model": "d", "num_speculative_tokens": 3}, {}, "not supported"),
])
def test_config_refusals(value, extra, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(speculative_config=json.dumps(value), **extra)


def test_refuses_a_draft_of_another_vocabulary(tmp_path, models):
    target, _ = models
    other = make_tiny_model(tmp_path, "llama", vocab_size=256)
    config = EngineConfig(model=str(target), speculative_config=json.dumps(draft_config(other)))
    with pytest.raises(ConfigError, match="vocabulary of 256 tokens, the target 512"):
        resolve_engine(config)


# --- scheduler ------------------------------------------------------------------------

def test_scheduler_places_the_workers_proposals_with_lookahead_slots():
    spec = SpeculativeConfig(3, method="draft_model", model="d")
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=256, block_size=4, num_blocks=16,
                                      speculative=spec))
    sched.add_request(AdmitRequest("r", "gw", [5, 6, 7, 8], SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True)))
    prefill = sched.schedule()
    # 4 prompt tokens fill one block; the 3 lookahead slots of the draft need a second
    assert len(prefill.new[0].block_ids) == 2
    sched.update(StepResult(prefill.step, ["r#0"], [100], num_draft_tokens=[3],
                            draft_token_ids=[7, 8, 9]))
    verify = sched.schedule()
    assert verify.num_scheduled_tokens == [4] and verify.draft_token_ids == [7, 8, 9]
    # one draft accepted, then the worker's next proposal: max_tokens leaves room for 1
    sched.update(StepResult(verify.step, ["r#0"], [7, 50], num_tokens=[2],
                            num_draft_tokens=[3], draft_token_ids=[1, 2, 3]))
    last = sched.schedule()
    assert last.num_computed_tokens == [6] and last.draft_token_ids == [1]
    assert sched.spec.num_draft_tokens == 3 and sched.spec.num_accepted_tokens == 1


# --- end to end -------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def plain_tokens(models):
    return greedy_tokens(engine(models[0]), random_prompts())


def test_same_weights_draft_is_accepted_and_changes_nothing(models, plain_tokens):
    target, _ = models
    llm = engine(target, speculative_config=draft_config(target))
    assert greedy_tokens(llm, random_prompts()) == plain_tokens
    stats = llm.engine.scheduler.spec
    assert stats.num_drafts > 0
    # float rounding between a batched draft pass and the target's may flip a near-tie
    assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens


def test_other_draft_changes_nothing(models, plain_tokens):
    target, other = models
    llm = engine(target, speculative_config=draft_config(other))
    assert greedy_tokens(llm, random_prompts()) == plain_tokens
    stats = llm.engine.scheduler.spec
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens


def test_chunked_prefill_and_preemption(models, plain_tokens):
    """A small token budget chunks the prompts and few blocks preempt requests: the draft's
    KV is recomputed with the target's, so same-weights drafts are still accepted."""
    target, _ = models
    llm = engine(target, speculative_config=draft_config(target, 4),
                 max_num_batched_tokens=8, num_gpu_blocks_override=14)
    assert greedy_tokens(llm, random_prompts()) == plain_tokens
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.spec.num_accepted_tokens > 0.9 * scheduler.spec.num_draft_tokens


def test_random_sampling_distribution_equals_without_speculation(models):
    """The second token of a continuation (the first a verified draft can give) over many
    seeds, with and without a draft model: two-sample chi-square as in test_spec_decode.
    The draft is the target itself, so its greedy drafts are the target's likeliest
    tokens, which the rejection sampler must not favour."""
    target, _ = models
    base, spec = second_tokens_without_and_with(
        target, random_prompts(1)[0], 600, speculative_config=draft_config(target, 1))
    assert_same_distribution(base, spec)


@pytest.mark.slow
def test_serve_with_a_draft_model_answers_as_offline_without_it(tmp_path, models):
    """`headrace serve` with --speculative-config whose draft is the target itself: a
    greedy completion through the openai client equals the offline text without drafts."""
    import openai

    from tests.e2e_fixtures import API_KEY, MODEL_NAME, serving, tiny_serve_args

    target, _ = models
    prompt = random_prompts(1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected = engine(target).generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    spec = json.dumps(draft_config(target))
    args = tiny_serve_args(target, tmp_path / "run", "--speculative-config", spec)
    with serving(args, tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120)
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                               temperature=0.0, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == 16
