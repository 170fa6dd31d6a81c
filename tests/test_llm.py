"""The offline LLM API end to end on CPU, against transformers on the same weights.

The demo model (SmolLM2-135M-Instruct from its GGUF, float32) must reproduce transformers'
greedy tokens exactly, also with chunked prefill, shared prefixes served from the prefix
cache, and a KV cache so small that requests are preempted and recomputed.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.model_files import resolve_model
from common.sampling_params import SamplingParams
from services import LLM
from services.demo import demo_model_path
from services.worker.memory import kv_cache_bytes_per_block
from tests.tiny_models import make_tiny_model
from tests.tiny_models import model_in_this_process  # noqa: F401 (autouse)

MAX_TOKENS = 24
PROMPTS = [
    "Hi",
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    ",
    "List three primary colors:",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the village. Every morning he",
    "Translate to French: I would like a cup of coffee, please.",
    "Explain in one sentence why the sky is blue. The sky is blue because",
    "1, 2, 3, 5, 8, 13,",
]
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and never invent facts "
          "you do not know. If a question is ambiguous, say so. ")


@pytest.fixture(scope="module")
def demo():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = resolve_model(demo_model_path())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, AutoTokenizer.from_pretrained(model_dir), hf


@pytest.fixture(scope="module")
def llm(demo):
    return LLM(str(demo[0]), dtype="float32", num_gpu_blocks_override=512)


def hf_greedy(hf, prompt_ids: list[int], max_new: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, do_sample=False,
                          pad_token_id=hf.generation_config.eos_token_id)
    return out[0, len(prompt_ids):].tolist()


# transformers' greedy tokens of the demo model by prompt: four tests check the same prompts
# against them, and transformers' generation of each is the same every time
DEMO_GREEDY: dict[tuple[int, ...], list[int]] = {}


def demo_greedy(hf, prompt_ids: list[int]) -> list[int]:
    key = tuple(prompt_ids)
    if key not in DEMO_GREEDY:
        DEMO_GREEDY[key] = hf_greedy(hf, prompt_ids)
    return DEMO_GREEDY[key]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_greedy_matches(llm: LLM, demo, prompts: list[str]) -> None:
    _, tokenizer, hf = demo
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                           use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt)["input_ids"]
        assert output.prompt_token_ids == ids
        assert output.outputs[0].token_ids == demo_greedy(hf, ids), prompt


def test_greedy_matches_transformers(llm, demo):
    check_greedy_matches(llm, demo, PROMPTS)


def test_chunked_prefill_matches(demo):
    llm = LLM(str(demo[0]), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4,
              num_gpu_blocks_override=512)
    check_greedy_matches(llm, demo, PROMPTS)
    assert max(len(p) for p in PROMPTS) > 16  # the long prompt really was chunked


def test_prefix_caching_matches_and_hits(demo):
    llm = LLM(str(demo[0]), dtype="float32", num_gpu_blocks_override=512)
    prompts = [SYSTEM + question for question in PROMPTS[:5]]
    check_greedy_matches(llm, demo, prompts[:1])  # warms the cache with the shared prefix
    check_greedy_matches(llm, demo, prompts[1:])
    ids = [demo[1](p)["input_ids"] for p in prompts]
    expected = 0  # each prompt reuses the whole blocks it shares with any earlier one
    for i in range(1, len(ids)):
        shared = max(common_prefix(ids[j], ids[i]) for j in range(i))
        expected += min(shared, len(ids[i]) - 1) // 16 * 16
    assert expected >= 4 * 16
    assert llm.engine.scheduler.stats().prefix_cache_hits == expected


def test_preemption_recomputes_and_matches(demo):
    # 12 blocks of 16 tokens: not enough for nine requests at once
    llm = LLM(str(demo[0]), dtype="float32", num_gpu_blocks_override=12)
    check_greedy_matches(llm, demo, PROMPTS)
    assert llm.engine.scheduler.num_preemptions > 0


def test_chat_answers_paris(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_seed_001_example_runs_as_written(llm):
    prompts = ["Hello, my name is", "The president of the United States is",
               "Write a poem about China:", "Who won the world series in 2020?"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    outputs = llm.generate(prompts, sampling_params)
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason in ("length", "stop")
        assert 1 <= len(completion.token_ids) <= 16
        assert completion.finish_reason == "stop" or len(completion.token_ids) == 16


def test_same_seed_same_output_whatever_the_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = llm.generate([PROMPTS[2]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    crowd = llm.generate(PROMPTS[:5], [others, others, seeded, others, others],
                         use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=12)
    assert llm.generate([PROMPTS[2]], other_seed, use_tqdm=False)[0].outputs[0].token_ids \
        != alone


def test_n_completions_share_the_prompt_blocks(demo):
    llm = LLM(str(demo[0]), dtype="float32", num_gpu_blocks_override=512)
    prompt = PROMPTS[5]  # long enough to fill several blocks
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8),
                       use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seeds differ per sibling
    num_full_blocks = len(out.prompt_token_ids) // 16
    assert llm.engine.scheduler.stats().prefix_cache_hits == 2 * num_full_blocks * 16


def test_logprobs_match_transformers(llm, demo):
    _, tokenizer, hf = demo
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    ids = out.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    num_prompt = len(out.prompt_token_ids)
    for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[num_prompt - 1 + i]
        assert len(entry) == 3  # greedy: the chosen token is also the top one
        assert entry[token].rank == 1
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert list(entry) == top.indices.tolist()
        assert entry[token].decoded_token == tokenizer.decode([token])
    assert completion.cumulative_logprob == pytest.approx(
        sum(ref[num_prompt - 1 + i, t].item() for i, t in enumerate(completion.token_ids)),
        abs=1e-3)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == num_prompt
    for pos in range(1, num_prompt):
        token = out.prompt_token_ids[pos]
        entry = out.prompt_logprobs[pos]
        assert entry[token].logprob == pytest.approx(ref[pos - 1, token].item(), abs=1e-4)
        assert entry[token].rank == 1 + int((ref[pos - 1] > ref[pos - 1, token]).sum())
    one = llm.generate([[ids[0]]], params, use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # a one-token prompt: its token, unscored


def test_stop_strings_and_lengths(llm):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(chat, SamplingParams(temperature=0.0, stop=["Paris"]), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.text == "The capital of France is "
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "Paris")
    long = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=20,
                                         ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) == 40 and long.finish_reason == "length"


def test_kv_cache_is_sized_from_the_byte_budget(demo):
    llm = LLM(str(demo[0]), dtype="float32", kv_cache_memory=8 * 2**20)
    runner = llm.engine.runner
    per_block = kv_cache_bytes_per_block(runner.hf_config, 16, torch.float32)
    assert runner.num_blocks == 8 * 2**20 // per_block
    assert llm.engine.scheduler.config.num_blocks == runner.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_models_greedy_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, arch)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", max_num_batched_tokens=8, max_num_seqs=4,
              block_size=4, num_gpu_blocks_override=64)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 11, 25, 6)]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10,
                                                   ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_hf_overrides_reach_the_model_as_transformers_reads_them(tmp_path):
    """--hf-overrides (an object merged into an object), --rope-theta: the engine runs the
    config transformers runs with the same changes, and sizes the context from it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, "llama")
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters.update(factor=2.0, rope_theta=500.0)
    config.max_position_embeddings = 96
    hf = AutoModelForCausalLM.from_pretrained(model_dir, config=config,
                                              dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=64,
              hf_overrides='{"rope_scaling": {"factor": 2.0}, "max_position_embeddings": 96}',
              rope_theta=500.0)
    assert llm.engine.scheduler.config.max_model_len == 96
    assert llm.engine.runner.hf_config.rope_parameters["rope_type"] == "llama3"  # kept
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(prompt):].tolist()


def test_generation_config_gives_defaults_and_caps(tmp_path):
    model_dir = make_tiny_model(tmp_path, "llama",
                                generation={"temperature": 0.3, "top_k": 5,
                                            "max_new_tokens": 4})
    llm = LLM(str(model_dir), num_gpu_blocks_override=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.3, 5)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=50, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4  # max_new_tokens caps every request
    plain = LLM(str(model_dir), num_gpu_blocks_override=64, generation_config="vllm")
    assert plain.get_default_sampling_params().temperature == 1.0


def test_generate_command_prints_completions():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", demo_model_path(),
         "--prompt", "What is the capital of France?", "--chat", "--temperature", "0",
         "--max-tokens", "20", "--num-gpu-blocks-override", "64"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


def test_generate_command_rejects_bad_flags():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--model", demo_model_path(),
         "--prompt", "x", "--block-size", "7"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--block-size must be one of" in result.stderr and "got 7" in result.stderr
