"""LoRA adapters end to end on CPU: PEFT's own adapters on a tiny model, several adapters
and the base model mixed in one batch, against transformers with each adapter merged by
PEFT (`merge_and_unload`), at one tensor-parallel rank and at two gloo ranks; each rank's
shards of an adapter; adapter checks; the worker's slots and host cache."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.config import ConfigError
from common.lora import AdapterError, read_adapter_config
from common.messages import LoRARequest
from common.sampling_params import SamplingParams
from services import LLM
from services.worker.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                           RowParallelLinear)
from services.worker.lora import LoRAAdapter, LoRABatch, load_adapter, wrap_model
from tests.test_embeddings import hf_embedding
from tests.test_tensor_parallel import as_rank
from tests.tiny_models import make_tiny_model

MAX_TOKENS = 8
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (rank, alpha, target modules, use_rslora): every module, attention only with rsLoRA, MLP
ADAPTERS = [(8, 16, ALL_MODULES, False), (4, 8, ["q_proj", "v_proj"], True),
            (16, 32, ["o_proj", "gate_proj", "up_proj", "down_proj"], False)]


def make_adapter(model_dir, out, seed: int, rank: int, alpha: int, modules: list[str],
                 rslora: bool) -> str:
    """A PEFT adapter with random A and B (init_lora_weights=False), saved by PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules, use_rslora=rslora,
                        init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(out)
    return str(out)


def merged_model(model_dir, adapter: str | None):
    """transformers' model with the adapter merged into its weights by PEFT."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def merged_greedy(model_dir, adapter: str | None, prompt: list[int]) -> list[int]:
    model = merged_model(model_dir, adapter)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    model_dir = make_tiny_model(root, request.param)
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(model_dir, root / f"a{i}", i, *spec))
                for i, spec in enumerate(ADAPTERS)]
    return model_dir, adapters


def mixed_batch(adapters: list[LoRARequest]) -> tuple[list[list[int]], list]:
    """Each adapter and the base model on two prompts, interleaved."""
    g = torch.Generator().manual_seed(0)
    loras = [*adapters, None] * 2
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist()
               for n in (5, 13, 9, 3, 17, 6, 11, 4)]
    return prompts, loras


@pytest.mark.parametrize("max_loras, max_cpu_loras", [(3, 3), (1, 1)])
def test_mixed_adapters_match_peft_merged_weights(tiny, max_loras, max_cpu_loras):
    """max_loras 3: every adapter and the base model in the same steps; 1: adapters take
    turns through one slot, each reloaded from disk as the host cache holds one."""
    model_dir, adapters = tiny
    prompts, loras = mixed_batch(adapters)
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=max_loras,
              max_cpu_loras=max_cpu_loras, max_lora_rank=16, num_gpu_blocks_override=64,
              block_size=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    got = [out.outputs[0].token_ids for out in outputs]
    want = [merged_greedy(model_dir, None if lora is None else lora.lora_path, prompt)
            for prompt, lora in zip(prompts, loras)]
    assert got == want
    base = [merged_greedy(model_dir, None, prompt) for prompt in prompts]
    # the adapters change the model, so the comparison above tells them apart
    assert sum(g != b for g, b in zip(got, base)) >= len(adapters)


def test_gemma_adapters_match_peft_merged_weights(tmp_path):
    """Gemma 2 names its projections as Llama does: its adapters run as they are (every
    module, attention only, MLP only, and the base model, mixed in one batch)."""
    model_dir = make_tiny_model(tmp_path, "gemma2")
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(model_dir, tmp_path / f"a{i}", i,
                                                         *spec))
                for i, spec in enumerate(ADAPTERS)]
    prompts, loras = mixed_batch(adapters)
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=16, num_gpu_blocks_override=64, block_size=4)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                   ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    got = [out.outputs[0].token_ids for out in outputs]
    models = {lora: merged_model(model_dir, None if lora is None else lora.lora_path)
              for lora in [None, *adapters]}  # each merged once

    @torch.no_grad()
    def greedy(lora, prompt: list[int]) -> list[int]:
        out = models[lora].generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist()
    assert got == [greedy(lora, prompt) for prompt, lora in zip(prompts, loras)]
    base = [greedy(None, prompt) for prompt in prompts]
    assert sum(g != b for g, b in zip(got, base)) >= len(adapters)


def test_phi3_refuses_lora_in_one_line(tmp_path):
    """Phi-3's adapters target its fused qkv_proj and gate_up_proj."""
    model_dir = make_tiny_model(tmp_path, "phi3")
    with pytest.raises(ConfigError, match="--enable-lora is not supported for "
                                          "Phi3ForCausalLM: its adapters target the fused "
                                          "qkv_proj and gate_up_proj"):
        LLM(str(model_dir), dtype="float32", enable_lora=True)


def test_one_adapter_for_every_prompt_and_the_prefix_cache(tiny):
    model_dir, adapters = tiny
    prompt = list(range(3, 40))
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, num_gpu_blocks_override=64,
              block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters[0])
    # the same prompt again, under another adapter: nothing of the first's KV is reused
    second = llm.generate([prompt], params, use_tqdm=False, lora_request=adapters[1])
    assert first[0].outputs[0].token_ids == merged_greedy(model_dir, adapters[0].lora_path,
                                                          prompt)
    assert second[0].outputs[0].token_ids == merged_greedy(model_dir, adapters[1].lora_path,
                                                           prompt)


def test_embeddings_under_mixed_adapters_match_peft_merged_weights(tiny):
    """LLM.embed with an adapter (or none) per prompt, pooled as by default (the last
    token's, normalized)."""
    model_dir, adapters = tiny
    prompts, loras = mixed_batch(adapters)
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=3,
              max_lora_rank=16, num_gpu_blocks_override=64, block_size=4)
    got = torch.tensor([out.outputs.embedding for out in
                        llm.embed(prompts, use_tqdm=False, lora_request=loras)])
    want = torch.stack([hf_embedding(merged_model(model_dir, lora and lora.lora_path),
                                     prompt, "LAST", True)
                        for prompt, lora in zip(prompts, loras)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = torch.tensor([out.outputs.embedding for out in llm.embed(prompts, use_tqdm=False)])
    changed = (got - base).abs().amax(dim=1) > 1e-3
    assert changed.tolist() == [lora is not None for lora in loras]


def test_adapters_are_checked(tiny, tmp_path):
    model_dir, adapters = tiny
    with pytest.raises(AdapterError, match="rank 16 is above --max-lora-rank 8"):
        read_adapter_config(adapters[2].lora_path, 8)
    with pytest.raises(AdapterError, match="cannot read adapter_config.json"):
        read_adapter_config(str(tmp_path), 16)
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((Path(adapters[0].lora_path) / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(AdapterError, match="use_dora not supported"):
        read_adapter_config(str(dora), 16)
    plain = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16)
    with pytest.raises(ConfigError, match="LoRA is off"):
        plain.generate([[5, 6]], use_tqdm=False, lora_request=adapters[0])
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
              num_gpu_blocks_override=16)
    with pytest.raises(AdapterError, match="above --max-lora-rank 8"):
        llm.generate([[5, 6]], use_tqdm=False, lora_request=adapters[2])
    clash = LoRARequest("other", adapters[0].lora_int_id, adapters[1].lora_path)
    with pytest.raises(ValueError, match="each adapter needs its own lora_int_id"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, lora_request=[adapters[0], clash])


def test_slots_and_host_cache_are_least_recently_used(tiny):
    model_dir, (a, b, c) = tiny
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2,
              num_gpu_blocks_override=16)
    lora = llm.engine.runner.lora
    lora.prepare([a, None, b], np.array([2, 1, 3]))
    slots = lora.batch.token_slots
    assert slots[:6].tolist() == [0, 0, -1, 1, 1, 1] and (slots[6:] == -1).all()
    lora.prepare([c, b], np.array([1, 1]))  # a is the least recently used: c takes its slot
    assert dict(lora.slot_of) == {b.lora_int_id: 1, c.lora_int_id: 0}
    assert list(lora.loaded) == [b.lora_int_id, c.lora_int_id]  # two in host memory
    assert (slots[2:] == -1).all()
    lora.prepare([b], np.array([1]))
    # c is now the least recently used, but this step needs it: b's slot goes to a
    lora.prepare([a, c], np.array([1, 1]))
    assert dict(lora.slot_of) == {c.lora_int_id: 0, a.lora_int_id: 1}
    # the slot holds a's weights, rank 8 zero-padded to 16, and its scaling
    saved = load_file(f"{a.lora_path}/adapter_model.safetensors")
    q_a = next(t for name, t in saved.items() if "layers.1.self_attn.q_proj.lora_A" in name)
    module = lora.layers[1][0]  # layer 1's qkv_proj
    assert torch.equal(module.lora_a[0, 1, :8], q_a)  # slice 0 (q), slot 1
    assert not module.lora_a[0, 1, 8:].any()
    assert lora.batch.scaling[1].item() == 16 / 8


def test_adapter_weights_are_checked_against_the_model(tiny):
    model_dir, (a, _, _) = tiny
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, num_gpu_blocks_override=16)
    shapes = llm.engine.runner.lora.shapes
    cpu = torch.device("cpu")
    wider = {key: (out + 1, inp) for key, (out, inp) in shapes.items()}
    with pytest.raises(AdapterError, match="is it this model's adapter"):
        load_adapter(a, 16, wider, cpu, torch.float32)
    one_layer = {key: shape for key, shape in shapes.items() if key[0] == 0}
    with pytest.raises(AdapterError, match="names layer 1, the model has 1"):
        load_adapter(a, 16, one_layer, cpu, torch.float32)
    adapter = load_adapter(a, 16, shapes, cpu, torch.float32)
    assert len(adapter.weights) == 2 * len(ALL_MODULES) and adapter.scaling == 2.0


# --- tensor parallelism -----------------------------------------------------------------

def run(model_dir, adapters, size: int, prompts, loras, stages: int = 1):
    """Greedy tokens and their logprobs at `size` ranks (of each of `stages` stages)."""
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=len(adapters),
              max_lora_rank=16, num_gpu_blocks_override=64, block_size=4,
              tensor_parallel_size=size, pipeline_parallel_size=stages, device="cpu")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True, logprobs=0),
                               use_tqdm=False, lora_request=loras)
    finally:
        llm.engine.close()
    tokens = [out.outputs[0].token_ids for out in outputs]
    logprobs = [[step[token].logprob for step, token in zip(out.outputs[0].logprobs, ids)]
                for out, ids in zip(outputs, tokens)]
    return tokens, torch.tensor(logprobs)


def test_two_ranks_with_mixed_adapters_give_one_ranks_tokens(tiny):
    """Column-parallel layers hold their rows of B, row-parallel ones their columns of A:
    two gloo ranks, every adapter and the base model in one batch, equal one rank and the
    merged weights."""
    model_dir, adapters = tiny
    prompts, loras = mixed_batch(adapters)
    two, two_logprobs = run(model_dir, adapters, 2, prompts, loras)
    one, one_logprobs = run(model_dir, adapters, 1, prompts, loras)
    assert two == one
    torch.testing.assert_close(two_logprobs, one_logprobs, atol=1e-4, rtol=0)
    assert two == [merged_greedy(model_dir, None if lora is None else lora.lora_path, prompt)
                   for prompt, lora in zip(prompts, loras)]


def test_two_stages_with_mixed_adapters_give_one_ranks_tokens(tiny):
    """Each stage wraps and loads the adapters' weights of its own layers only; every
    adapter and the base model in one batch at PP=2 equal one rank (llama: qwen3 adds
    nothing stages do differently)."""
    model_dir, adapters = tiny
    if "qwen3" in str(model_dir):
        pytest.skip("one architecture is enough for the split")
    prompts, loras = mixed_batch(adapters)
    staged, staged_logprobs = run(model_dir, adapters, 1, prompts, loras, stages=2)
    one, one_logprobs = run(model_dir, adapters, 1, prompts, loras)
    assert staged == one
    torch.testing.assert_close(staged_logprobs, one_logprobs, atol=1e-4, rtol=0)


HIDDEN, HEAD_DIM, HEADS, INTER, RANK = 32, 8, 4, 48, 4


def tp_layer(monkeypatch, rank: int, size: int, kv_heads: int) -> list:
    """One decoder layer's projections at rank `rank` of `size`, base weights zero (the
    outputs are the adapters' deltas alone), wrapped with two slots."""
    as_rank(monkeypatch, rank, size)
    attn = SimpleNamespace(qkv_proj=QKVParallelLinear(HIDDEN, HEAD_DIM, HEADS, kv_heads),
                           o_proj=RowParallelLinear(HEADS * HEAD_DIM, HIDDEN,
                                                    reduce_results=False))
    mlp = SimpleNamespace(gate_up_proj=MergedColumnParallelLinear(HIDDEN, [INTER] * 2),
                          down_proj=RowParallelLinear(INTER, HIDDEN, reduce_results=False))
    for base in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        base.weight.data.zero_()
    batch = LoRABatch(token_slots=torch.tensor([0, -1, 1, 0, 1], dtype=torch.int32),
                      scaling=torch.tensor([2.0, 0.5]))
    model = SimpleNamespace(model=SimpleNamespace(layers=[SimpleNamespace(self_attn=attn,
                                                                          mlp=mlp)]))
    return wrap_model(model, batch, max_loras=2, max_rank=RANK, dtype=torch.float32)[0]


@pytest.mark.parametrize("kv_heads", [2, 1])  # 1: both ranks hold the one KV head
def test_each_ranks_shards_of_an_adapter_give_its_part_of_the_delta(monkeypatch, kv_heads):
    """Column-parallel: each rank's output slice of a module is that slice of the whole
    delta (q by heads, k/v by KV heads, gate and up apart). Row-parallel: the ranks'
    partial sums add up to the whole delta, scaled once."""
    g = torch.Generator().manual_seed(0)
    whole = tp_layer(monkeypatch, 0, 1, kv_heads)
    shapes = {name: shape for module in whole for name, shape in module.shapes().items()}
    adapters = [{name: (torch.randn(RANK, inp, generator=g),
                        torch.randn(out, RANK, generator=g))
                 for name, (out, inp) in shapes.items()} for _ in range(2)]
    x = {name: torch.randn(5, width, generator=g)
         for name, width in (("column", HIDDEN), ("o_proj", HEADS * HEAD_DIM),
                             ("down_proj", INTER))}
    slots, scaling = [0, -1, 1, 0, 1], [2.0, 0.5]

    def want(name: str, inputs: torch.Tensor) -> torch.Tensor:
        rows = [torch.zeros(shapes[name][0]) if s < 0 else
                scaling[s] * (inputs[t] @ adapters[s][name][0].T) @ adapters[s][name][1].T
                for t, s in enumerate(slots)]
        return torch.stack(rows)
    sums = {"o_proj": 0, "down_proj": 0}
    for rank in range(2):
        for module in tp_layer(monkeypatch, rank, 2, kv_heads):
            for slot, weights in enumerate(adapters):
                shards = {(0, name): module.shard(name, *weights[name])
                          for name in module.slices}
                module.write_slot(slot, LoRAAdapter(slot + 1, scaling[slot], shards), 0)
            assert module.shapes() == {name: shapes[name] for name in module.slices}
            if module.row_parallel:
                (name,) = module.slices
                cols = module.in_features
                sums[name] = sums[name] + module(x[name][:, rank * cols:(rank + 1) * cols])
                continue
            y = module(x["column"])
            for name, shard in module.slices.items():
                rows = slice(shard.index * shard.size, (shard.index + 1) * shard.size)
                torch.testing.assert_close(y[:, shard.offset:shard.offset + shard.size],
                                           want(name, x["column"])[:, rows])
    for name, total in sums.items():
        torch.testing.assert_close(total, want(name, x[name]))
