"""ngram speculative decoding end to end on tiny random-weight models (CPU): the same
tokens as without it for greedy requests, the same distribution for random ones."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from common.speculative import NgramIndex
from services import LLM
from tests.tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


def repetitive_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    motifs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 7, 4)]
    return [motif * reps for motif, reps in zip(motifs, (6, 4, 3, 5))]


def engine(model_dir, **extra) -> LLM:
    args = dict(dtype="float32", max_num_batched_tokens=32, max_num_seqs=4, block_size=4,
                num_gpu_blocks_override=128)
    return LLM(str(model_dir), **{**args, **extra})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_outputs_equal_without_speculation(tmp_path, arch):
    model_dir = make_tiny_model(tmp_path, arch)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = repetitive_prompts()
    plain = engine(model_dir).generate(prompts, params, use_tqdm=False)
    spec = engine(model_dir, speculative_config=NGRAM)
    outputs = spec.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    stats = spec.engine.scheduler.spec
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0


def test_random_sampling_distribution_equals_without_speculation(tmp_path, monkeypatch):
    """The second token of a continuation (the first that a verified draft can give), over
    many seeds, with and without speculation: the two histograms agree within a bound that
    a correct sampler exceeds with negligible probability. A random-weight model's samples
    at temperature 1 rarely repeat the prompt, so here the proposer drafts the target's
    own most likely token (drafts the rejection sampler must not favour)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def most_likely(index: NgramIndex, k: int, min_n: int, max_n: int) -> list[int]:
        with torch.no_grad():
            return [int(hf(torch.tensor([index.tokens])).logits[0, -1].argmax())]

    monkeypatch.setattr(NgramIndex, "propose", most_likely)  # the plain run proposes nothing
    base, spec = second_tokens_without_and_with(model_dir, repetitive_prompts()[0], 1500,
                                                speculative_config=NGRAM)
    assert_same_distribution(base, spec)


def second_tokens_without_and_with(model_dir, prompt: list[int], n: int, **spec_engine
                                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The second token of n seeded continuations at temperature 1 (top 5), without and
    with speculation (whose drafts must be both accepted and rejected)."""
    params = [SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True, seed=s)
              for s in range(n)]

    def second_tokens(llm: LLM) -> torch.Tensor:
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        return torch.tensor([o.outputs[0].token_ids[1] for o in outs])

    large = dict(max_num_seqs=64, max_num_batched_tokens=2048, num_gpu_blocks_override=2048)
    base = second_tokens(engine(model_dir, **large))
    spec_llm = engine(model_dir, **large, **spec_engine)
    spec = second_tokens(spec_llm)
    stats = spec_llm.engine.scheduler.spec
    assert stats.num_drafts >= n and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    return base, spec


def assert_same_distribution(base: torch.Tensor, spec: torch.Tensor) -> None:
    """Two-sample chi-square with df = categories - 1: a correct sampler stays below
    df + 8 sqrt(2 df) (eight standard deviations) with negligible probability of failing."""
    vocab = int(max(base.max(), spec.max())) + 1
    c0 = torch.bincount(base, minlength=vocab).double()
    c1 = torch.bincount(spec, minlength=vocab).double()
    seen = (c0 + c1) > 0
    chi2 = float(((c0 - c1)[seen] ** 2 / (c0 + c1)[seen]).sum())
    df = int(seen.sum()) - 1
    assert chi2 < df + 8 * (2 * df) ** 0.5


@pytest.mark.slow
def test_serve_with_ngram_and_an_fp8_cache_counts_drafts_in_metrics(tmp_path):
    """`headrace serve --kv-cache-dtype fp8 --speculative-config <ngram>`: a greedy
    completion of a repeating prompt through the openai client equals the offline fp8
    engine's without speculation, and /metrics counts the drafts and their acceptances."""
    import json

    import anyio
    import openai

    from tests.e2e_fixtures import API_KEY, MODEL_NAME, serving, tiny_serve_args
    from tests.test_e2e import SHARD_0, metrics

    model_dir = make_tiny_model(tmp_path, "llama")
    prompt = repetitive_prompts()[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    fp8 = engine(model_dir, kv_cache_dtype="fp8")
    expected = fp8.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    args = tiny_serve_args(model_dir, tmp_path / "run", "--dtype", "float32",
                           "--kv-cache-dtype", "fp8", "--speculative-config", json.dumps(NGRAM))
    with serving(args, tmp_path / "serve.log") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, timeout=120)
        completion = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                               temperature=0.0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected

        async def counted() -> dict:
            with anyio.fail_after(15):
                while True:
                    samples = await metrics(server.url)
                    if samples.get(("headrace:spec_decode_num_drafts_total", SHARD_0)):
                        return samples
                    await anyio.sleep(0.2)

        samples = anyio.run(counted)
    drafted = samples[("headrace:spec_decode_num_draft_tokens_total", SHARD_0)]
    accepted = samples[("headrace:spec_decode_num_accepted_tokens_total", SHARD_0)]
    assert 0 < accepted <= drafted
