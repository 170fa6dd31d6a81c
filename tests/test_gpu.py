"""The engine on a GPU: Triton kernels inside whole models against transformers, CUDA graph
replay against eager execution, and the KV cache sized from gpu_memory_utilization without
the peak ever passing the budget. Skipped without CUDA (CI has none; the device script
runs them)."""

from __future__ import annotations

import gc
import shutil
import time

import pytest
import torch

from common.messages import LoRARequest
from common.model_files import resolve_model
from common.sampling_params import SamplingParams
from services import LLM
from services.demo import demo_model_path
from services.offline.engine import WORKER_PROCESS_ENV
from services.worker.cuda_graphs import GraphKey
from services.worker.layers.gemv_choice import GEMV_ENV
from tests.test_lora import ADAPTERS, make_adapter, merged_greedy, mixed_batch
from services.worker.layers.attention import Attention
from tests.test_kernels_triton import (MIXED_REQUESTS, AttentionShape, check_attention,
                                       check_write_kv)
from tests.tiny_models import TOKENIZER_DIR, make_tiny_model
from tests.tiny_models import model_in_this_process  # noqa: F401 (autouse)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village at the edge of a great forest,",
           "List three primary colors:"]


def tiny_prompts(lengths=(5, 40, 77, 1, 12, 3, 60, 9), seed: int = 2) -> list[list[int]]:
    """Token-id prompts inside the tiny models' vocabulary (their tokenizer's ids are not)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lengths]


def greedy(llm: LLM, prompts, max_tokens: int = 24) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral-window", "qwen2-window",
                                  "gemma2", "gemma3", "phi3", "mixtral", "qwen2_moe",
                                  "qwen3_moe"])
def test_tiny_models_on_gpu_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path, arch)
    # eager: some transformers versions' SDPA path drops Gemma 2's attention soft cap
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="eager").cuda().eval()
    llm = LLM(str(model_dir), dtype="float32", block_size=16, num_gpu_blocks_override=256,
              max_num_batched_tokens=32, max_num_seqs=8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 77, 12)]
    for prompt, ours in zip(prompts, greedy(llm, prompts, 16)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        assert ours == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_the_16_bit_gemv_gives_the_cublas_tokens(arch, tmp_path, monkeypatch):
    """A tiny fp16 model (qwen2: q/k/v biases; phi3: fused checkpoints) with every
    projection on the GEMV for decode steps of up to 16 rows (kernels/gemv.py, in the CUDA
    graphs) gives the greedy tokens of every projection on cuBLAS."""
    from services.worker.layers.linear import LinearBase

    model_dir = make_tiny_model(tmp_path, arch)
    prompts = tiny_prompts((5, 40, 77, 12))
    tokens = {}
    for choice, rows in (("gemv", range(1, 17)), ("cublas", range(0))):
        monkeypatch.setenv(GEMV_ENV, choice)
        llm = LLM(str(model_dir), dtype="float16", block_size=16, num_gpu_blocks_override=256,
                  max_num_batched_tokens=32, max_num_seqs=8)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)]
        assert linears and all(m.gemv_rows == rows for m in linears)
        # four requests (tensor cores), then one alone (the CUDA-core path)
        tokens[bool(rows)] = greedy(llm, prompts, 16) + greedy(llm, prompts[1:2], 16)
        del llm
        gc.collect()
    assert tokens[True] == tokens[False]


def test_the_worker_process_gives_the_in_process_tokens(tmp_path, monkeypatch):
    """HEADRACE_WORKER_PROCESS=1, and the default on a GPU: the executor in a worker
    process, with CUDA of its own, gives the tokens of the executor in this process, greedy
    and seeded."""
    model_dir = make_tiny_model(tmp_path, "llama")
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)] * 4
    tokens = {}
    for mode in ("0", "1", None):
        if mode is None:
            monkeypatch.delenv(WORKER_PROCESS_ENV)
        else:
            monkeypatch.setenv(WORKER_PROCESS_ENV, mode)
        with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=256) as llm:
            assert (llm.engine.executor is None) == (mode != "0")
            started = time.perf_counter()
            outputs = llm.generate(tiny_prompts(), params, use_tqdm=False)
            # the device's time on the steps comes back with their results, either way
            busy = llm.engine.scheduler.device_seconds
            assert 0 < busy < time.perf_counter() - started
        tokens[mode] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["1"] == tokens["0"] == tokens[None]


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_embeddings_on_gpu_match_transformers_beside_generation(pooling, tmp_path):
    """Pooled on the device over chunks, in steps that replay mixed graphs beside decodes,
    and copied back with the steps' tokens; the generation beside them is unchanged."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = make_tiny_model(tmp_path, "llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    llm = LLM(str(model_dir), dtype="float32", block_size=16, num_gpu_blocks_override=256,
              max_num_batched_tokens=32, max_num_seqs=8, pooling_type=pooling)
    assert llm.engine.runner.graphs is not None
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 40, 77, 1)]
    alone = greedy(llm, prompts, 16)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"g{i}", prompt, params)
        engine.add_embedding(f"e{i}", prompt)
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, torch.Tensor] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens.setdefault(delta.rid, []).extend(delta.token_ids)
            if delta.embedding is not None:
                embeddings[delta.rid] = torch.frombuffer(bytearray(delta.embedding),
                                                         dtype=torch.float32)
    assert [tokens[f"g{i}"] for i in range(len(prompts))] == alone
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            hidden = hf(torch.tensor([prompt], device="cuda"),
                        output_hidden_states=True).hidden_states[-1][0].cpu()
        expected = hidden[-1] if pooling == "LAST" else hidden.mean(0)
        torch.testing.assert_close(embeddings[f"e{i}"],
                                   torch.nn.functional.normalize(expected, dim=-1),
                                   atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def real_model(tmp_path_factory) -> str:
    """The demo model where its package is installed; else random weights at Qwen3-0.6B's
    shape (the device has no demo package), saved by transformers so both engines read the
    same safetensors."""
    try:
        return str(resolve_model(demo_model_path()))
    except FileNotFoundError:
        pass
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = TOKENIZER_DIR  # the Qwen3-0.6B shape, with its tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape),
                                             dtype=torch.float32)
    out = tmp_path_factory.mktemp("qwen3-random")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(shape / name, out / name)
    return str(out)


def assert_greedy_agrees(hf, prompt: list[int], ours: list[int]) -> None:
    """Each of our tokens is transformers' argmax given the same prefix, or within a
    rounding-sized logit of it (random weights leave near-ties that fp32 reduction order
    may break either way); teacher-forced, so one near-tie does not end the comparison."""
    ids = torch.tensor([prompt + ours], device="cuda")
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(ours, device="cuda")[:, None])[:, 0]
    gap = logits.max(dim=1).values - chosen
    assert gap.max().item() <= 1e-3 * logits.abs().max().item(), gap.tolist()


def test_real_model_on_gpu_matches_transformers_fp32(real_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(real_model, dtype=torch.float32).cuda().eval()
    tokenizer = AutoTokenizer.from_pretrained(real_model)
    llm = LLM(real_model, dtype="float32", num_gpu_blocks_override=512, max_model_len=2048)
    for prompt, ours in zip(PROMPTS, greedy(llm, PROMPTS)):
        assert_greedy_agrees(hf, tokenizer(prompt)["input_ids"], ours)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(real_model, dtype, monkeypatch):
    """In bf16 with every projection on cuBLAS (HEADRACE_GEMV=cublas), as eager steps have
    them, the graphs give eager's tokens exactly: their Triton GEMVs would round otherwise
    and break the random weights' ties otherwise (benchmarks/issue31-h200/pdl8)."""
    monkeypatch.setenv(GEMV_ENV, "cublas")
    kwargs = dict(dtype=dtype, num_gpu_blocks_override=512, max_num_seqs=16,
                  max_model_len=2048)
    graphs = LLM(real_model, **kwargs)
    assert graphs.engine.runner.graphs is not None
    eager = LLM(real_model, enforce_eager=True, **kwargs)
    assert eager.engine.runner.graphs is None
    prompts = PROMPTS * 3  # 12 requests: replays the 16-wide graph with padding rows
    assert greedy(graphs, prompts) == greedy(eager, prompts)


def test_short_contexts_replay_decode_graphs_split_for_them(real_model, monkeypatch):
    """A decode graph is captured for each context bound that changes how its attention
    splits (cuda_graphs.py): the batch-1 ladder starts at a bound that does not split and
    ends at max_model_len, each request alone replays the bound that holds its context,
    and the tokens are eager execution's (float32)."""
    kwargs = dict(dtype="float32", num_gpu_blocks_override=512, max_num_seqs=4,
                  max_model_len=2048)
    graphs = LLM(real_model, **kwargs)
    runner = graphs.engine.runner
    layer = next(m for m in runner.model.modules() if isinstance(m, Attention))
    k_cache = runner.kv_caches[layer.cache_index][0]
    spans = runner.graphs.decode_spans[1]
    assert spans[-1] == 2048
    assert layer.decode_splits(1, spans[0], k_cache) == 1 < layer.decode_splits(1, 2048, k_cache)
    replayed: list[GraphKey] = []
    run = runner.graphs.run
    monkeypatch.setattr(runner.graphs, "run",
                        lambda key, *args: replayed.append(key) or run(key, *args))
    prompts = tiny_prompts((5, 300, 700))
    ours = [greedy(graphs, [prompt])[0] for prompt in prompts]
    decodes = {key.span for key in replayed if not key.mixed}
    assert decodes == {next(s for s in spans if s >= len(p) + 24) for p in prompts}, spans
    eager = LLM(real_model, enforce_eager=True, **kwargs)
    assert ours == [greedy(eager, [prompt])[0] for prompt in prompts]


@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability()[0] < 9, reason="PDL is Hopper's")
def test_programmatic_dependent_launch_changes_no_token(real_model, monkeypatch):
    """PDL only lets a kernel start before the one it reads from has ended (kernels/pdl.py):
    bf16 decode graphs with every projection on the GEMV (the PDL kernels at every layer)
    give the same greedy tokens with it and without it."""
    import kernels.pdl

    monkeypatch.setenv(GEMV_ENV, "gemv")
    kwargs = dict(num_gpu_blocks_override=512, max_num_seqs=16, max_model_len=2048)
    tokens = []
    for enabled in (True, False):
        monkeypatch.setattr(kernels.pdl, "ENABLED", enabled)
        llm = LLM(real_model, **kwargs)
        tokens.append(greedy(llm, PROMPTS * 3))
        llm.close()
    assert tokens[0] == tokens[1]


def test_greedy_decodes_sample_in_the_graphs_heads_as_eager_steps_do(real_model, monkeypatch):
    """Greedy decode steps sample in their decode graph's heads (12 requests: padding rows
    in the 16-wide graph), each at the narrowest head that holds its logprobs: none, 0
    and 1, up to 5, up to 20; 21 takes the sampler. Tokens and logprobs are eager
    execution's."""
    kwargs = dict(dtype="float32", num_gpu_blocks_override=512, max_num_seqs=16,
                  max_model_len=2048, max_logprobs=21)
    graphs = LLM(real_model, **kwargs)
    runner_graphs = graphs.engine.runner.graphs
    replayed: list[int] = []
    sample = runner_graphs.sample
    monkeypatch.setattr(runner_graphs, "sample",
                        lambda key, k: replayed.append(k) or sample(key, k))
    eager = LLM(real_model, enforce_eager=True, **kwargs)
    heads = {None: {0}, 0: {1}, 1: {1}, 2: {5}, 7: {20}, 21: set()}
    for logprobs, want_heads in heads.items():
        replayed.clear()
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                logprobs=logprobs)
        ours, want = (llm.generate(PROMPTS * 3, params, use_tqdm=False)
                      for llm in (graphs, eager))
        assert set(replayed) == want_heads
        for a, b in zip(ours, want):
            tokens = a.outputs[0].token_ids
            assert tokens == b.outputs[0].token_ids
            if logprobs is None:
                assert a.outputs[0].logprobs is None
                continue
            # the chosen token's entry: the others may swap places on a near-tie, the
            # graphs' sums not being the eager kernels' to the last bit
            for token, x, y in zip(tokens, a.outputs[0].logprobs, b.outputs[0].logprobs,
                                   strict=True):
                assert len(x) == len(y) and x[token].rank == y[token].rank == 1
                assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-3)


def test_mixed_graphs_give_the_eager_prompt_logprobs(real_model):
    """Prefills replay mixed graphs (padded request slots and tokens); every prompt token's
    logprob, read from the replay's hidden states, is the eager one's."""
    kwargs = dict(dtype="float32", num_gpu_blocks_override=512, max_num_seqs=16,
                  max_model_len=2048)
    graphs = LLM(real_model, **kwargs)
    assert graphs.engine.runner.graphs.sizes["mixed"][-1] == 512
    eager = LLM(real_model, enforce_eager=True, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    ours, want = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (graphs, eager))
    for a, b in zip(ours, want):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 4
        for token, x, y in zip(a.prompt_token_ids[1:], a.prompt_logprobs[1:],
                               b.prompt_logprobs[1:]):
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-3)
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_kv_cache_fills_the_memory_budget_and_peak_stays_inside(real_model):
    gc.collect()  # engines of earlier tests
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    llm = LLM(real_model, gpu_memory_utilization=0.3, max_num_seqs=32, max_model_len=2048)
    runner = llm.engine.runner
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in runner.kv_caches)
    assert kv_bytes > 0.15 * total  # the cache took most of what the weights left
    greedy(llm, PROMPTS * 8, 64)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_reserved() <= 0.3 * total


def test_sampler_takes_the_fused_kernel_for_temperature_alone():
    """Temperature-only rows go through the Triton Gumbel-max kernel with the engine's seed
    stream; a row with top_p or its own seed sends the step down the torch path."""
    import random

    from kernels.sampling import gumbel_argmax_ref, philox_uniform
    from services.worker.sampler import Sampler, SamplingRow

    logits = torch.randn(8, 151936, device="cuda", dtype=torch.bfloat16) * 3
    rows = [SamplingRow(SamplingParams(temperature=t), [], [], None)
            for t in (0.6, 1.0, 0.3, 1.2, 0.6, 0.9, 1.0, 0.5)]
    tokens = Sampler(torch.device("cuda"), seed=7).sample(logits, rows).token_ids
    key = random.Random(7).getrandbits(31)
    temperature = torch.tensor([r.params.temperature for r in rows], device="cuda")
    expected = gumbel_argmax_ref(logits, temperature, philox_uniform(8, 151936, key, "cuda"))
    assert torch.equal(tokens, expected)
    rows[3] = SamplingRow(SamplingParams(temperature=1.2, top_p=0.9), [], [], None)
    other = Sampler(torch.device("cuda"), seed=7).sample(logits, rows).token_ids
    assert not torch.equal(other, expected)  # the torch race draws other noise


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_lora_batch_in_cuda_graphs_matches_eager_and_peft(arch, tmp_path):
    """Three adapters and base rows in the same decode steps (the Triton LoRA kernels,
    replayed in graphs with padded rows) give eager execution's tokens and those of
    transformers with each adapter merged by PEFT."""
    model_dir = make_tiny_model(tmp_path, arch)
    adapters = [LoRARequest(f"a{i}", i + 1,
                            make_adapter(model_dir, tmp_path / f"a{i}", i, *spec))
                for i, spec in enumerate(ADAPTERS)]
    prompts, loras = mixed_batch(adapters)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = []
    for eager in (False, True):
        llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3,
                  max_lora_rank=16, enforce_eager=eager, block_size=16,
                  num_gpu_blocks_override=256, max_num_batched_tokens=32, max_num_seqs=8)
        assert (llm.engine.runner.graphs is None) == eager
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        results.append([o.outputs[0].token_ids for o in outputs])
        llm.engine.close()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert results[0] == results[1]
    assert results[0] == [merged_greedy(model_dir, lora and lora.lora_path, prompt)
                          for prompt, lora in zip(prompts, loras)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_ngram_speculation_with_cuda_graphs_gives_the_plain_greedy_tokens(arch, tmp_path):
    """Steps with drafts replay the mixed graphs (queries longer than one token); their
    greedy tokens are those of plain decoding with graphs, with drafts accepted."""
    model_dir = make_tiny_model(tmp_path, arch)
    g = torch.Generator().manual_seed(2)
    motifs = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 5, 7, 4)]
    prompts = [motif * reps for motif, reps in zip(motifs, (8, 5, 4, 6))]
    kwargs = dict(dtype="float32", block_size=16, num_gpu_blocks_override=256,
                  max_num_batched_tokens=64, max_num_seqs=8)
    plain = greedy(LLM(str(model_dir), **kwargs), prompts, 48)
    spec = LLM(str(model_dir), speculative_config={
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}, **kwargs)
    assert spec.engine.runner.graphs is not None
    assert greedy(spec, prompts, 48) == plain
    assert spec.engine.scheduler.spec.num_accepted_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_draft_model_with_cuda_graphs_gives_the_plain_greedy_tokens(arch, tmp_path):
    """The draft's sync and propose passes replay its own graphs: with the target's own
    weights as the draft nearly every draft is accepted (its KV follows the target's),
    and the tokens are plain decoding's, in graphs and eager alike."""
    model_dir = make_tiny_model(tmp_path, arch)
    prompts = tiny_prompts()
    kwargs = dict(dtype="float32", block_size=16, num_gpu_blocks_override=256,
                  max_num_batched_tokens=64, max_num_seqs=8)
    plain = greedy(LLM(str(model_dir), **kwargs), prompts, 32)
    draft = {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": 4}
    for eager in (False, True):
        spec = LLM(str(model_dir), speculative_config=draft, enforce_eager=eager, **kwargs)
        assert (spec.engine.runner.draft.graphs is None) == eager
        assert greedy(spec, prompts, 32) == plain
        stats = spec.engine.scheduler.spec
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0


# --- pipeline stages: each replays its own layers' graphs ---------------------------------

def one_gpu_reference(tmp_path) -> tuple[str, list, dict, list]:
    """A 4-layer tiny llama, prompts, the engine arguments the parallel runs share, and one
    GPU's greedy tokens (float32, where no near-tie flips between step shapes)."""
    model_dir = str(make_tiny_model(tmp_path, "llama", num_hidden_layers=4))
    prompts = tiny_prompts()
    kwargs = dict(dtype="float32", block_size=16, num_gpu_blocks_override=256,
                  max_num_batched_tokens=64, max_num_seqs=8)
    with LLM(model_dir, **kwargs) as one:
        return model_dir, prompts, kwargs, greedy(one, prompts, 32)

@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_stages_in_cuda_graphs_give_the_eager_and_one_gpu_tokens(tmp_path, monkeypatch):
    """PP=2 over NCCL, each stage replaying graphs of its own layers (the second with the
    hidden states received as a graph input; the sends and receives outside the graphs):
    the greedy tokens of the stages run eagerly and of one GPU, through chunked prefills
    (mixed graphs) and decodes; with a draft model (whole on the last stage, in graphs of
    its own) too; and the default's, whose stages run in the engine's worker process.
    float32, where no near-tie flips between one GPU's step shapes and the stages'
    micro-batches."""
    model_dir, prompts, kwargs, want = one_gpu_reference(tmp_path)
    monkeypatch.delenv(WORKER_PROCESS_ENV, raising=False)
    with LLM(model_dir, pipeline_parallel_size=2, **kwargs) as llm:
        assert llm.engine.executor is None  # on GPUs: in the worker process
        assert greedy(llm, prompts, 32) == want
    monkeypatch.setenv(WORKER_PROCESS_ENV, "0")  # the first stage's runner is read here
    for eager in (False, True):
        with LLM(model_dir, pipeline_parallel_size=2, enforce_eager=eager, **kwargs) as llm:
            runner = llm.engine.runner  # the first stage's
            assert (runner.graphs is None) == eager
            replayed: list[GraphKey] = []
            if not eager:
                replay = runner.graphs.run
                runner.graphs.run = lambda key, *args: replayed.append(key) or replay(key,
                                                                                      *args)
            assert greedy(llm, prompts, 32) == want
            assert eager or {key.mixed for key in replayed} == {False, True}
    draft = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 4}
    with LLM(model_dir, pipeline_parallel_size=2, speculative_config=draft, **kwargs) as llm:
        assert greedy(llm, prompts, 32) == want
        stats = llm.engine.scheduler.spec
        assert stats.num_accepted_tokens > 0.9 * stats.num_draft_tokens > 0


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_two_stages_of_two_ranks_in_cuda_graphs_give_one_gpus_tokens(tmp_path, monkeypatch):
    """TP=2 x PP=2 over NCCL on four GPUs, each stage a tensor-parallel pair replaying
    graphs of its own layers: one GPU's greedy tokens through chunked prefills and decodes
    (float32, as above)."""
    model_dir, prompts, kwargs, want = one_gpu_reference(tmp_path)
    monkeypatch.setenv(WORKER_PROCESS_ENV, "0")  # the first stage's runner is read here
    with LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, **kwargs) as llm:
        assert llm.engine.runner.graphs is not None
        assert greedy(llm, prompts, 32) == want


# --- fp8 KV cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_cache_kernels_at_llama_8b_shape(cache_dtype):
    """32 query heads, 8 KV heads, head_dim 128, block 16: the fp8 write byte-equal to
    torch's, the attention over the fp8 cache (mixed prefill and decode batch with padding,
    then split-K decodes) against the torch twin reading the same cache and scales."""
    shape = AttentionShape(32, 8, 128, 16)
    check_write_kv(500, 8, 128, 16, torch.bfloat16, "cuda", cache_dtype)
    check_attention(shape, MIXED_REQUESTS, torch.bfloat16, "cuda", padding=2,
                    cache_dtype=cache_dtype)
    check_attention(shape, [(3000, 1), (17, 1), (900, 1)], torch.bfloat16, "cuda",
                    cache_dtype=cache_dtype, max_seq_len=8192)


def prompt_logprobs_of(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt token's logprob (after the first), all prompts concatenated."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return torch.tensor([lp[token].logprob for out in llm.generate(prompts, params,
                                                                   use_tqdm=False)
                         for token, lp in zip(out.prompt_token_ids[1:],
                                              out.prompt_logprobs[1:])])


@pytest.mark.parametrize("kv_cache_dtype, tolerance", [("fp8", 0.2), ("fp8_e5m2", 0.3)])
def test_fp8_cache_in_cuda_graphs_reads_as_eager_steps_do(kv_cache_dtype, tolerance, tmp_path):
    """Prefills replaying mixed graphs read the fp8 cache and its scales as eager steps
    do. Not token for token: the graphs' attention splits its sums differently, and a last
    bit moved can round a K/V value to the next fp8 step, so the two part at near-ties; the
    prompt logprobs agree far inside the fp8 cache's own error against the float32 cache
    (measured on the H100: 0.131 mean for e4m3 against the model's own dtype)."""
    model_dir = str(make_tiny_model(tmp_path, "llama"))
    kwargs = dict(num_gpu_blocks_override=256, max_num_seqs=8)
    graphs = LLM(model_dir, kv_cache_dtype=kv_cache_dtype, **kwargs)
    assert graphs.engine.runner.graphs is not None
    assert graphs.engine.runner.kv_caches[0][0].element_size() == 1
    prompts = tiny_prompts()
    ours = prompt_logprobs_of(graphs, prompts)
    eager = prompt_logprobs_of(LLM(model_dir, kv_cache_dtype=kv_cache_dtype,
                                   enforce_eager=True, **kwargs), prompts)
    exact = prompt_logprobs_of(LLM(model_dir, **kwargs), prompts)
    assert (ours - eager).abs().mean() < tolerance / 10
    assert (ours - exact).abs().mean() < tolerance


def test_fp8_calculate_kv_scales_then_graphs(tmp_path):
    """The first real step runs eagerly and sets every layer's scales; later steps replay
    graphs that read them: the tokens equal an eager engine's with the same calculation."""
    model_dir = str(make_tiny_model(tmp_path, "llama"))
    kwargs = dict(num_gpu_blocks_override=256, max_num_seqs=8, kv_cache_dtype="fp8",
                  calculate_kv_scales=True)
    graphs = LLM(model_dir, **kwargs)
    prompts = tiny_prompts(seed=3)
    ours = greedy(graphs, prompts)
    assert not graphs.engine.runner.scales_pending
    scales = [m.k_scale.item() for m in graphs.engine.runner.model.modules()
              if isinstance(m, Attention)]
    assert scales and all(0 < s != 1.0 for s in scales)
    assert ours == greedy(LLM(model_dir, enforce_eager=True, **kwargs), prompts)


# --- vision-language models: their steps without image rows replay the graphs ------------

VL_GRAPH_TOKENS = 8


def vl_requests(image_token: str) -> list:
    """An image, then a long text tail (a 16-token budget leaves chunks of text alone, which
    replay mixed graphs), two images, and text alone."""
    from tests.test_vision_language import chat, random_image

    return [{"prompt": chat(f"{image_token}Describe the picture in a few words, please, and "
                            "then count to five."),
             "multi_modal_data": {"image": [random_image(1)]}},
            {"prompt": chat(f"A {image_token} or {image_token}?"),
             "multi_modal_data": {"image": [random_image(2), random_image(3, (84, 56))]}},
            chat("Only text here, and a little more of it.")]


def hf_vl_greedy(hf, processor, request, ids: list[int]) -> list[int]:
    """transformers' greedy tokens (on the CPU), recomputing the whole sequence each step."""
    images = request["multi_modal_data"]["image"] if isinstance(request, dict) else []
    extra = {}
    if images:
        processed = processor(images=images, return_tensors="pt")
        extra = {"pixel_values": processed["pixel_values"]}
        if "image_grid_thw" in processed:
            extra["image_grid_thw"] = processed["image_grid_thw"]
    seq = list(ids)
    with torch.no_grad():
        for _ in range(VL_GRAPH_TOKENS):
            input_ids = torch.tensor([seq])
            if "image_grid_thw" in extra:
                extra["mm_token_type_ids"] = (input_ids == hf.config.image_token_id).int()
            seq.append(int(hf(input_ids=input_ids, **extra).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "llava"])
def test_vl_graphs_give_the_eager_and_transformers_tokens(arch, tmp_path):
    """A vision-language model captures the graphs after its memory profile; its steps
    with image rows run eagerly, the others (decodes, text chunks; Qwen2-VL's at M-RoPE
    collapsed to 1-D positions) replay: the greedy tokens equal the eager engine's and
    transformers'."""
    from transformers import AutoModelForImageTextToText

    from tests.tiny_models import make_tiny_llava, make_tiny_vl_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = str(make_tiny_llava(tmp_path) if arch == "llava"
                    else make_tiny_vl_model(tmp_path, arch))
    requests = vl_requests("<|image_pad|>" if arch == "llava"
                           else "<|vision_start|><|image_pad|><|vision_end|>")
    params = SamplingParams(temperature=0.0, max_tokens=VL_GRAPH_TOKENS, ignore_eos=True)
    kwargs = dict(dtype="float32", block_size=16, max_num_batched_tokens=16, max_num_seqs=4)
    gc.collect()  # engines of earlier tests: the profile's peak would count them
    # the cache sized by the memory profile (its encoder pass included), then the capture
    graphs = LLM(model_dir, kv_cache_memory=64 * 2**20, **kwargs)
    runner = graphs.engine.runner
    assert runner.graphs is not None
    replayed: list[GraphKey] = []
    replay = runner.graphs.run
    runner.graphs.run = lambda key, *args: replayed.append(key) or replay(key, *args)
    outs = graphs.generate(requests, params, use_tqdm=False)
    ours = [o.outputs[0].token_ids for o in outs]
    assert any(not key.mixed for key in replayed) and any(key.mixed for key in replayed)
    eager = LLM(model_dir, enforce_eager=True, num_gpu_blocks_override=256, **kwargs)
    assert eager.engine.runner.graphs is None
    assert ours == [o.outputs[0].token_ids
                    for o in eager.generate(requests, params, use_tqdm=False)]
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    processor = graphs.engine.processor.images.image_processor
    for request, out in zip(requests, outs):
        assert out.outputs[0].token_ids == hf_vl_greedy(hf, processor, request,
                                                        out.prompt_token_ids)
