"""Pipeline parallelism on the CPU, gloo ranks in real processes: each stage builds and
loads only its layers (the first the embedding, the last the final norm and the LM head),
two stages' steps through their CUDA graphs' static buffers (run eagerly) compute the
whole model's logits, its KV cache holds its layers only, and greedy tokens and prompt
logprobs through the offline API equal one rank's at PP=2 and TP=2 x PP=2, through
chunked prefill, preemption and prefix caching, and with ngram or draft-model
speculation; served by the scheduler and worker shells over Redis, the stages keep two
steps in flight under a stream of requests. A killed stage under `headrace serve` is
tests/test_pipeline_parallel_serve.py."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
import torch

from common import keys
from common.bus import Bus
from common.config import ConfigError, EngineConfig, ServerConfig
from common.messages import AdmitRequest, DrainSteps, TokenBatch
from common.model_files import load_hf_config
from common.model_info import check_pipeline_parallel, resolve_engine
from common.sampling_params import SamplingParams
from common.service import ServiceContext
from common.token_columns import batch_items
from services import LLM
from services.scheduler.shell import SchedulerShell
from services.worker.cuda_graphs import StepGraphs
from services.worker.executor import Executor, PipelineExecutor, start_executor
from services.worker.layers import pipeline
from services.worker.layers.pipeline import PPStage, layer_partition
from services.worker.loader import load_model
from services.worker.models.llama import MissingLayer
from services.worker.shell import WorkerShell
from tests.test_models import PADDED_SPANS, Paged, padded_steps, token_ids
from tests.test_draft_model import draft_config, random_prompts
from tests.test_spec_decode import NGRAM, repetitive_prompts
from tests.test_tensor_parallel import count_reads
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
SAME_AS_ONE_RANK = 1e-5  # the largest prompt logprob difference to the single-rank model


# --- the split ---------------------------------------------------------------------------

def test_layers_split_evenly_with_the_remainder_before_the_last_stage(monkeypatch):
    """vLLM's split: the last stage, which also holds the LM head, gets the fewest."""
    assert layer_partition(32, 2) == [16, 16]
    assert layer_partition(3, 2) == [2, 1]
    assert layer_partition(10, 4) == [2, 3, 3, 2]
    assert layer_partition(3, 2, "1,2") == [1, 2]
    with pytest.raises(ValueError, match="VLLM_PP_LAYER_PARTITION='2,2' must list 2"):
        layer_partition(3, 2, "2,2")
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        layer_partition(2, 3)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    assert pipeline.stage_layers(3, 2, 1) == range(1, 3)


def test_more_stages_than_layers_are_refused_before_any_rank_starts(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama")  # 2 layers
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 3 exceeds the model's 2"):
        LLM(str(model_dir), pipeline_parallel_size=3, device="cpu")


def test_a_vision_language_model_is_refused_stages():
    """Its encoder and image rows feed a whole model; stages of one are not built."""
    config = SimpleNamespace(num_hidden_layers=4, vision_config=SimpleNamespace())
    check_pipeline_parallel(config, 1)
    with pytest.raises(ConfigError, match="vision-language models run with "
                                          "--pipeline-parallel-size 1 only"):
        check_pipeline_parallel(config, 2)


# --- loading: one stage in this process --------------------------------------------------

def as_stage(monkeypatch: pytest.MonkeyPatch, index: int, size: int, layers: range) -> None:
    """The models built next, for the rest of the test, are stage `index` of `size`, with
    no process group."""
    monkeypatch.setattr(pipeline, "_BUILDING", ContextVar(
        "pp_stage", default=PPStage(index, size, layers, list(range(size)))))


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_stage_builds_and_reads_only_its_layers(arch, load_format, tmp_path, monkeypatch):
    """llama's LM head is its own; qwen3's is tied, so the last stage, without the
    embedding, loads its head from the embedding's tensor (dummy weights draw it so)."""
    model_dir = make_tiny_model(tmp_path, arch, num_hidden_layers=3)
    hf_config = load_hf_config(model_dir)
    config = EngineConfig(model=str(model_dir), dtype="float32", load_format=load_format)
    whole = dict(load_model(config, hf_config, CPU, torch.float32).named_parameters())
    read = count_reads(monkeypatch)

    as_stage(monkeypatch, 0, 2, range(0, 2))
    first = load_model(config, hf_config, CPU, torch.float32)
    params = dict(first.named_parameters())
    assert first.num_layers == 2 and isinstance(first.model.layers[2], MissingLayer)
    assert first.model.norm is None and not hasattr(first, "lm_head")
    assert not any(name.startswith(("model.layers.2.", "lm_head", "model.norm"))
                   for name in params)

    as_stage(monkeypatch, 1, 2, range(2, 3))
    last = load_model(config, hf_config, CPU, torch.float32)
    params |= dict(last.named_parameters())
    assert last.num_layers == 1 and last.model.embed_tokens is None
    assert all(isinstance(last.model.layers[i], MissingLayer) for i in (0, 1))
    head = "model.embed_tokens.weight" if arch == "qwen3" else "lm_head.weight"
    torch.testing.assert_close(last.lm_head.weight, whole[head], rtol=0, atol=0)
    for name, param in params.items():
        # a tied head is the whole model's embedding
        torch.testing.assert_close(param, whole.get(name, whole["model.embed_tokens.weight"]),
                                   rtol=0, atol=0)
    # every tensor once over the two stages, the tied embedding twice
    tied = whole["model.embed_tokens.weight"].numel() if arch == "qwen3" else 0
    if load_format == "auto":
        assert read["shards"] + read["whole"] == sum(p.numel() for p in whole.values()) + tied


@torch.no_grad()
def test_stage_steps_through_the_graph_buffers_give_the_whole_models_logits(tmp_path,
                                                                         monkeypatch):
    """What two stages' CUDA graphs replay, run eagerly on the CPU: each step copied into
    each stage's static buffers and padded to its graph's size (unused request slots, a
    padding tail, stale rows of a larger step before), the first stage's output rows (what
    it sends) loaded as the second's hidden-states input: the whole model's logits."""
    model_dir = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    hf_config = load_hf_config(model_dir)
    config = EngineConfig(model=str(model_dir), dtype="float32")
    whole = Paged(load_model(config, hf_config, CPU, torch.float32), hf_config, block_size=4)
    graphs = []
    for index, layers, receives in ((0, range(0, 2), None), (1, range(2, 3), torch.float32)):
        as_stage(monkeypatch, index, 2, layers)
        stage = Paged(load_model(config, hf_config, CPU, torch.float32), hf_config,
                      block_size=4)
        graphs.append(StepGraphs(stage.model, stage.kv_caches, max_num_seqs=4,
                                 max_num_batched_tokens=64, max_model_len=64, block_size=4,
                                 receives=receives))
        graphs[-1].decode_spans = PADDED_SPANS
    a, b, c = token_ids(30, seed=8), token_ids(9, seed=9), token_ids(5, seed=10)
    steps = padded_steps(whole, a, b, c)
    for chunks, key in steps:
        input_ids, positions, attn = whole.inputs(chunks)
        sent = None
        for stage_graphs in graphs:
            assert stage_graphs.key(attn, input_ids.shape[0]) == key
            stage_graphs.load(key, input_ids, positions, attn, sent)
            sent = stage_graphs.forward(key)[:input_ids.shape[0]]
        torch.testing.assert_close(graphs[1].model.compute_logits(sent),
                                   torch.cat(whole.step(chunks)), atol=1e-5, rtol=0)


# --- the offline API: rank processes -------------------------------------------------------

SHARED = token_ids(12, seed=99)  # three blocks of 4 every prompt starts with
PROMPTS = [SHARED + token_ids(n, seed=n) for n in (5, 17, 3, 28)]
# 16 blocks of 4 tokens hold 64; the four requests need 35 blocks at once, so requests are
# preempted and recomputed; prompts of up to 40 tokens go in chunks of 16
ENGINE = dict(device="cpu", seed=3, block_size=4, num_gpu_blocks_override=16,
              max_model_len=64, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True)
# requests with prompt logprobs compute every prompt token; the others take cached blocks
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                         prompt_logprobs=2 if i % 2 == 0 else None) for i in range(4)]


def generate_twice(model_dir: Path, **sizes) -> list:
    """Each prompt's greedy tokens and prompt logprobs, twice (the second time from the
    prefix cache), through preemptions and prefix cache hits."""
    with LLM(str(model_dir), **ENGINE, **sizes) as llm:
        steps = record_steps(llm.engine.executor)
        outputs = [o for _ in range(2) for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]
        stats = llm.engine.scheduler.stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        if sizes:
            check_first_stage(llm, sizes.get("tensor_parallel_size", 1))
            check_overlap(steps)
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outputs]


def record_steps(executor: Executor) -> list[tuple[int, set[str], dict[int, set[str]]]]:
    """Per submit: its step, its requests, and the steps whose results it returned, with
    the requests that sampled in each."""
    steps = []
    submit = executor.submit

    def recorded(plan):
        results = submit(plan)
        steps.append((plan.step, set(plan.req_ids),
                      {r.step: set(r.req_ids) for r in results}))
        return results
    executor.submit = recorded
    return steps


def check_overlap(steps: list[tuple[int, set[str], dict[int, set[str]]]]) -> None:
    """Two stages hold the two steps launched before a submit's own, three in flight
    (common/pipeline.py): many submits return the step two before their own, none of
    whose sampling requests is in their own (the next chunk of a prompt may be). Not
    most: the tests' small KV caches often seat fewer requests than three steps need."""
    overlapped = [(req_ids, done[step - 2]) for step, req_ids, done in steps
                  if list(done) == [step - 2]]
    assert len(overlapped) > len(steps) // 4, steps
    for req_ids, sampled_before in overlapped:
        assert not req_ids & sampled_before, steps


def check_first_stage(llm: LLM, tp: int) -> None:
    """Rank 0 is the first stage's: its layers and their KV cache only, every further rank
    a follower process."""
    executor = llm.engine.executor
    assert isinstance(executor, PipelineExecutor)
    assert len(executor.followers.processes) == 2 * tp - 1
    runner = executor.runner
    model = runner.model
    assert runner.stage.is_first and model.model.norm is None
    assert len(runner.kv_caches) == model.num_layers == len(model.model.own_layers)
    assert model.num_layers < len(model.model.layers)


def assert_same(got: list, want: list) -> None:
    for (tokens, prompt_lps), (want_tokens, want_lps) in zip(got, want, strict=True):
        assert tokens == want_tokens
        if want_lps is None:
            assert prompt_lps is None
            continue
        assert len(prompt_lps) == len(want_lps)
        for position, expected in zip(prompt_lps[1:], want_lps[1:]):
            assert position.keys() == expected.keys()
            for token, logprob in position.items():
                assert abs(logprob.logprob - expected[token].logprob) <= SAME_AS_ONE_RANK
                assert logprob.rank == expected[token].rank


@pytest.mark.parametrize("arch,layers", [("llama", 3), ("qwen3", 2)])
def test_stages_give_one_ranks_tokens_and_prompt_logprobs(arch, layers, tmp_path):
    """PP=2 (llama's 3 layers split 2 + 1) and TP=2 x PP=2, against one rank: the same
    tokens and prompt logprobs, with three steps in flight most of the time."""
    model_dir = make_tiny_model(tmp_path, arch, num_hidden_layers=layers)
    want = generate_twice(model_dir)
    for sizes in (dict(pipeline_parallel_size=2),
                  dict(tensor_parallel_size=2, pipeline_parallel_size=2)):
        assert_same(generate_twice(model_dir, **sizes), want)


def test_an_uneven_split_from_the_environment_gives_one_ranks_tokens(tmp_path, monkeypatch):
    """VLLM_PP_LAYER_PARTITION=1,2: the follower (the last stage) reads it too."""
    model_dir = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    want = generate_twice(model_dir)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "1,2")
    with LLM(str(model_dir), **ENGINE, pipeline_parallel_size=2) as llm:
        assert llm.engine.runner.model.num_layers == 1
        outputs = [o for _ in range(2) for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)]
    assert_same([(o.outputs[0].token_ids, o.prompt_logprobs) for o in outputs], want)


def speculated_tokens(model_dir: Path, prompts: list[list[int]], stages: int,
                      speculative_config: dict) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(model_dir), device="cpu", dtype="float32", max_num_batched_tokens=32,
             max_num_seqs=4, block_size=4, num_gpu_blocks_override=128,
             speculative_config=speculative_config, pipeline_parallel_size=stages) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        stats = llm.engine.scheduler.spec
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
        assert stages == 1 or llm.engine.runner.draft is None  # the first stage's
    return [o.outputs[0].token_ids for o in outputs]


def test_ngram_speculation_at_two_stages_gives_one_ranks_tokens(tmp_path):
    """The last stage verifies the drafts the plan carries (every stage computes them);
    the other stages append the accepted tokens it broadcasts."""
    model_dir = make_tiny_model(tmp_path, "llama")
    assert (speculated_tokens(model_dir, repetitive_prompts(), 2, NGRAM)
            == speculated_tokens(model_dir, repetitive_prompts(), 1, NGRAM))


def test_a_draft_model_at_two_stages_gives_one_ranks_tokens(tmp_path):
    """The last stage holds the whole draft (its KV cache too) and returns its proposals
    with the step's result; the first stage holds none. The draft is the target itself,
    so its proposals are accepted (a stage's share of it would propose other tokens)."""
    target = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    draft = draft_config(target)
    assert (speculated_tokens(target, random_prompts(), 2, draft)
            == speculated_tokens(target, random_prompts(), 1, draft))


def embed(model_dir: Path, **sizes) -> torch.Tensor:
    with LLM(str(model_dir), device="cpu", seed=3, pooling_type="MEAN",
             max_num_batched_tokens=16, max_num_seqs=4, **sizes) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outputs])


def test_embeddings_at_two_stages_are_one_ranks(tmp_path):
    """The last stage pools its final hidden states over the prompts' chunks."""
    model_dir = make_tiny_model(tmp_path, "llama")
    torch.testing.assert_close(embed(model_dir, pipeline_parallel_size=2), embed(model_dir),
                               atol=SAME_AS_ONE_RANK, rtol=0)


# --- served: the scheduler and worker shells over Redis ------------------------------------

STREAMED = [token_ids(n, seed=40 + n) for n in (4, 9, 6, 3, 12, 5, 7, 8)]
STREAMED_PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


async def serve_stream(config: EngineConfig, executor: Executor, redis_url: str
                       ) -> tuple[dict[str, list[int]], int]:
    """The worker and scheduler shells of one shard in this process; the requests arrive
    one every 20 ms, as a gateway's would. Returns each request's tokens as the scheduler
    sent them to the detokenizers, and how many drains it sent the worker."""
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(STREAMED))}
    finished: set[str] = set()
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.redis.flushall()  # an earlier shard's streams and keys
        stop = anyio.Event()
        tg.start_soon(WorkerShell(ServiceContext("worker", "0", config, ServerConfig(), bus,
                                                 stop), executor).run)
        with anyio.fail_after(30):
            while await bus.load(keys.worker_ready()) is None:
                await anyio.sleep(0.05)
        tg.start_soon(SchedulerShell(ServiceContext("scheduler", "0", config, ServerConfig(),
                                                    bus, stop), config).run)
        for i, prompt in enumerate(STREAMED):
            await bus.publish(keys.admit(), AdmitRequest(f"r{i}", "gw", prompt,
                                                         STREAMED_PARAMS))
            await anyio.sleep(0.02)
        last = "0"
        with anyio.fail_after(120):
            while len(finished) < len(STREAMED):
                for entry in await bus.tail({keys.DETOK: last}, count=100, block_ms=100):
                    last = entry.id
                    assert isinstance(entry.msg, TokenBatch)
                    for item in batch_items(entry.msg):
                        tokens[item.rid] += item.new_token_ids
                        if item.finish_reason is not None:
                            finished.add(item.rid)
        orders = await bus.tail({keys.steps(): "0"}, count=100_000)
        stop.set()
        tg.cancel_scope.cancel()
    return tokens, sum(isinstance(entry.msg, DrainSteps) for entry in orders)


@dataclass(slots=True)
class Served:
    tokens: dict[str, list[int]]  # by request
    drains: int  # DrainSteps the scheduler sent
    steps: list  # record_steps's
    handed_back: int = 0  # flushes that returned steps


def serve_sized(model_dir: Path, redis_url: str, stages: int) -> Served:
    resolved = resolve_engine(EngineConfig(model=str(model_dir), device="cpu", seed=3,
                                           pipeline_parallel_size=stages))
    executor = start_executor(resolved)
    try:
        served = Served({}, 0, record_steps(executor))
        flush = executor.flush

        def counted() -> list:
            results = flush()
            served.handed_back += bool(results)
            return results
        executor.flush = counted
        served.tokens, served.drains = anyio.run(serve_stream, resolved.config, executor,
                                                 redis_url)
        return served
    finally:
        executor.close()


def test_served_stages_keep_three_steps_in_flight_under_a_stream_of_requests(tmp_path,
                                                                           redis_url):
    """An inbox empty for a moment (the next plan still on its way over Redis) does not
    make the stages hand back their steps: they do so only when the scheduler sends a
    drain (and once as the worker stops), most submits return the step two before their
    own, as offline, and the tokens are the served single rank's."""
    model_dir = make_tiny_model(tmp_path, "llama")
    want = serve_sized(model_dir, redis_url, 1).tokens
    served = serve_sized(model_dir, redis_url, 2)
    assert served.tokens == want
    assert all(len(t) == STREAMED_PARAMS.max_tokens for t in want.values())
    assert 0 < served.handed_back <= served.drains + 1, served
    check_overlap(served.steps)
