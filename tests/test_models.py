"""Our models against transformers on the same weights: whole prompts, chunked prefill
through the paged cache, teacher-forced decodes, mixed varlen batches, and the demo SmolLM2
GGUF. Tensor parallelism is tests/test_tensor_parallel.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.model_files import load_hf_config, load_tokenizer, resolve_model
from common.model_info import resolve_engine
from services.demo import demo_model_path
from services.worker.cuda_graphs import (GraphKey, StepGraphs, attention_kinds, context_spans,
                                         decode_sizes, mixed_sizes)
from services.worker.layers.attention import AttentionMetadata, ForwardContext
from services.worker.loader import load_model, load_weights
from services.worker.models import CausalLM, kv_cache_shape, model_class
from tests.tiny_models import TINY_VOCAB, TOKENIZER_DIR, make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "mistral-window", "qwen2-window", "gemma2",
         "gemma3", "phi3"]
TOLERANCE = 1e-4
CPU = torch.device("cpu")
SHAPES = TOKENIZER_DIR.parent  # the real models' config.json files, without weights


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).norm() / ref.norm()).item()


class Paged:
    """A model with its own paged KV cache; block ids are handed out from a shuffled pool."""

    def __init__(self, model: CausalLM, hf_config, block_size: int, num_blocks: int = 64,
                 seed: int = 0, tp_size: int = 1) -> None:
        self.model, self.block_size = model, block_size
        shape = kv_cache_shape(hf_config, num_blocks, block_size, tp_size)
        self.kv_caches = [(torch.zeros(shape), torch.zeros(shape))
                          for _ in range(model.num_layers)]
        self.pool = list(range(num_blocks))
        random.Random(seed).shuffle(self.pool)

    def blocks(self, num_tokens: int) -> list[int]:
        return [self.pool.pop() for _ in range(-(-num_tokens // self.block_size))]

    @torch.no_grad()
    def step(self, chunks: list[tuple[list[int], list[int], int]]) -> list[torch.Tensor]:
        """One varlen forward of (block ids, new token ids, first position) per request;
        returns each request's logits."""
        input_ids, positions, attn = self.inputs(chunks)
        hidden = self.model(input_ids, positions, ForwardContext(attn, self.kv_caches))
        return self.logits(hidden, chunks)

    def logits(self, hidden: torch.Tensor, chunks) -> list[torch.Tensor]:
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32 and logits.shape[1] == self.model.vocab_size
        return list(logits.split([len(c[1]) for c in chunks]))

    def inputs(self, chunks: list[tuple[list[int], list[int], int]]
               ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids, positions, slots, seq_lens, query_start_loc = [], [], [], [], [0]
        for block_ids, tokens, start in chunks:
            pos = list(range(start, start + len(tokens)))
            input_ids += tokens
            positions += pos
            slots += [block_ids[p // bs] * bs + p % bs for p in pos]
            seq_lens.append(start + len(tokens))
            query_start_loc.append(query_start_loc[-1] + len(tokens))
        tables = torch.zeros(len(chunks), max(len(c[0]) for c in chunks), dtype=torch.int32)
        for r, (block_ids, _, _) in enumerate(chunks):
            tables[r, :len(block_ids)] = torch.tensor(block_ids)
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64), block_tables=tables,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_query_len=max(len(c[1]) for c in chunks), max_seq_len=max(seq_lens))
        return torch.tensor(input_ids), torch.tensor(positions), attn


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(seed)
                         ).tolist()


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    return ours_and_reference(request.param, tmp_path_factory)


def ours_and_reference(arch: str, tmp_path_factory):
    """A tiny `arch` model: ours, its config, and transformers' logits of a prompt."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp_path_factory.mktemp(arch), arch)
    hf_config = load_hf_config(model_dir)
    ours = load_model(EngineConfig(model=str(model_dir), dtype="float32"), hf_config, CPU,
                      torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @torch.no_grad()
    def ref_logits(ids: list[int]) -> torch.Tensor:
        return ref(torch.tensor([ids])).logits[0].float()

    return ours, hf_config, ref_logits


def test_whole_prompt_prefill(tiny):
    model, hf_config, ref_logits = tiny
    paged = Paged(model, hf_config, block_size=4)
    ids = token_ids(37, seed=1)
    (logits,) = paged.step([(paged.blocks(37), ids, 0)])
    assert rel_err(logits, ref_logits(ids)) < TOLERANCE


def test_chunked_prefill_through_the_cache(tiny):
    model, hf_config, ref_logits = tiny
    paged = Paged(model, hf_config, block_size=16, seed=1)
    ids = token_ids(40, seed=2)
    blocks = paged.blocks(40)
    ref = ref_logits(ids)
    for start, end in [(0, 13), (13, 24), (24, 40)]:  # chunk edges inside blocks
        (logits,) = paged.step([(blocks, ids[start:end], start)])
        assert rel_err(logits, ref[start:end]) < TOLERANCE, (start, end)


def test_teacher_forced_decode(tiny):
    model, hf_config, ref_logits = tiny
    paged = Paged(model, hf_config, block_size=4, seed=2)
    ids = token_ids(22, seed=3)
    blocks = paged.blocks(22)
    ref = ref_logits(ids)
    (logits,) = paged.step([(blocks, ids[:6], 0)])
    assert rel_err(logits, ref[:6]) < TOLERANCE
    for pos in range(6, 22):
        (logits,) = paged.step([(blocks, ids[pos:pos + 1], pos)])
        assert rel_err(logits, ref[pos:pos + 1]) < TOLERANCE, pos


def test_varlen_batches_with_shared_prefix_blocks(tiny):
    model, hf_config, ref_logits = tiny
    paged = Paged(model, hf_config, block_size=4, seed=3)
    a, b, c = token_ids(12, seed=4), token_ids(29, seed=5), token_ids(9, seed=6)
    e = a[:8] + token_ids(7, seed=7)  # shares a's first two blocks
    blocks = {"a": paged.blocks(12), "b": paged.blocks(29), "c": paged.blocks(9)}
    blocks["e"] = blocks["a"][:2] + paged.blocks(7)
    ref = {name: ref_logits(ids) for name, ids in dict(a=a, b=b, c=c, e=e).items()}
    # e computes only its own tokens, reading the prefix a writes in this same step
    first = paged.step([(blocks["a"], a[:11], 0), (blocks["b"], b[:20], 0),
                        (blocks["e"], e[8:], 8), (blocks["c"], c[:5], 0)])
    for logits, (name, end) in zip(first, [("a", 11), ("b", 20), ("e", 15), ("c", 5)]):
        start = 8 if name == "e" else 0
        assert rel_err(logits, ref[name][start:end]) < TOLERANCE, name
    # then a decode, the rest of a prompt, and a one-token chunk, in one step
    second = paged.step([(blocks["c"], c[5:6], 5), (blocks["a"], a[11:], 11),
                         (blocks["b"], b[20:], 20)])
    for logits, (name, start, end) in zip(second, [("c", 5, 6), ("a", 11, 12),
                                                   ("b", 20, 29)]):
        assert rel_err(logits, ref[name][start:end]) < TOLERANCE, name



# decode graphs' context bounds as a GPU's attention could make them (the CPU's never splits:
# it has one bound a size)
PADDED_SPANS = {1: [16, 64], 2: [64], 4: [16, 32, 64]}


@torch.no_grad()
def padded_steps(paged: Paged, a: list[int], b: list[int], c: list[int]) -> list:
    """(chunks, the graph that replays them) of four steps over requests a (30 tokens), b
    (9) and c (5): two mixed, largest first, then two decodes, so that smaller steps see
    the rows a larger one left in the buffers. The decodes' contexts are 27 and 28 keys: the
    smallest of PADDED_SPANS' bounds that holds them."""
    blocks = {"a": paged.blocks(30), "b": paged.blocks(9), "c": paged.blocks(5)}
    return [
        ([(blocks["a"], a[:25], 0), (blocks["b"], b[:8], 0)], GraphKey(True, 48, 64)),
        ([(blocks["a"], a[25:26], 25), (blocks["b"], b[8:9], 8), (blocks["c"], c[:4], 0)],
         GraphKey(True, 16, 64)),
        ([(blocks["a"], a[26:27], 26), (blocks["b"], b[8:9], 8), (blocks["c"], c[4:5], 4)],
         GraphKey(False, 4, 32)),
        ([(blocks["a"], a[27:28], 27)], GraphKey(False, 1, 64)),
    ]


def test_steps_padded_into_the_graph_buffers_compute_the_same(tiny):
    """What a CUDA graph replays, run eagerly on the CPU: each step copied into the static
    buffers and padded to its graph's size (unused request slots, a padding tail of
    tokens, stale rows left by a larger step) gives the unpadded step's logits. A decode
    takes the smallest context bound of its size that holds its longest context."""
    model, hf_config, ref_logits = tiny
    paged = Paged(model, hf_config, block_size=4, seed=4)
    graphs = StepGraphs(model, paged.kv_caches, max_num_seqs=4, max_num_batched_tokens=64,
                        max_model_len=64, block_size=4)
    assert graphs.sizes == {"decode": [1, 2, 4], "mixed": [16, 32, 48, 64]}
    assert graphs.decode_spans == {1: [64], 2: [64], 4: [64]}
    graphs.decode_spans = PADDED_SPANS
    a, b, c = token_ids(30, seed=8), token_ids(9, seed=9), token_ids(5, seed=10)
    ref = {name: ref_logits(ids) for name, ids in dict(a=a, b=b, c=c).items()}
    steps = padded_steps(paged, a, b, c)
    names_of = ["ab", "abc", "abc", "a"]
    for (chunks, key), names in zip(steps, names_of):
        input_ids, positions, attn = paged.inputs(chunks)
        assert graphs.key(attn, input_ids.shape[0]) == key
        graphs.load(key, input_ids, positions, attn)
        hidden = graphs.forward(key)[:input_ids.shape[0]]
        for logits, name, (_, tokens, start) in zip(paged.logits(hidden, chunks), names,
                                                     chunks):
            want = ref[name][start:start + len(tokens)]
            assert rel_err(logits, want) < TOLERANCE, (key, name)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_greedy_logits_give_compute_logits_tokens_without_the_float_copy(arch, tmp_path):
    """The decode graphs' heads read greedy_logits: the lm_head's bf16 logits, whose
    float32 values are compute_logits's exactly; Gemma 2's soft cap follows its lm_head,
    so there they are compute_logits's float32 ones."""
    model_dir = make_tiny_model(tmp_path, arch)
    resolved = resolve_engine(EngineConfig(model=str(model_dir), dtype="bfloat16"))
    model = load_model(resolved.config, resolved.hf_config, CPU, torch.bfloat16, model_dir)
    hidden = torch.randn(5, resolved.hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        greedy, logits = model.greedy_logits(hidden), model.compute_logits(hidden)
    capped = arch == "gemma2"
    assert model.float_logits_only == capped
    assert greedy.dtype == (torch.float32 if capped else torch.bfloat16)
    assert torch.equal(greedy.float(), logits) and logits.dtype == torch.float32
    assert torch.equal(greedy.argmax(dim=-1), logits.argmax(dim=-1))


def test_decode_graph_bounds_split_by_each_kind_of_attention(tmp_path):
    """Gemma 2's layers alternate a window of 8 keys with none: the graphs' bounds are
    chosen over one layer of each kind, with its own K cache and the model's dtype."""
    model_dir = make_tiny_model(tmp_path, "gemma2")
    resolved = resolve_engine(EngineConfig(model=str(model_dir), dtype="bfloat16"))
    model = load_model(resolved.config, resolved.hf_config, CPU, torch.bfloat16, model_dir)
    paged = Paged(model, resolved.hf_config, block_size=4)
    kinds = attention_kinds(model, paged.kv_caches)
    assert sorted(layer.sliding_window or 0 for layer, _ in kinds) == [0, 8]
    assert all(k_cache is paged.kv_caches[layer.cache_index][0] for layer, k_cache in kinds)
    # the queries' dtype, which picks the attention's tiles, is the model's
    assert all(layer.q_dtype == torch.bfloat16 for layer, _ in kinds)


@pytest.mark.parametrize("arch,windows", [("gemma2", [8, None, 8, None]),
                                          ("mistral-window", [8, 8])])
def test_disable_sliding_window_attends_to_all_and_caps_the_length(arch, windows, tmp_path):
    """As vLLM's flag: no layer keeps a window, and max_model_len is the smallest one."""
    model_dir = make_tiny_model(tmp_path, arch)
    for disable, want_windows, want_len in [(False, windows, 512),
                                            (True, [None] * len(windows), 8)]:
        config = EngineConfig(model=str(model_dir), dtype="float32",
                              disable_sliding_window=disable)
        resolved = resolve_engine(config)
        assert resolved.config.max_model_len == want_len
        model = load_model(resolved.config, resolved.hf_config, CPU, torch.float32,
                           resolved.model_dir)
        assert [layer.self_attn.attn.sliding_window
                for layer in model.model.layers] == want_windows
    with pytest.raises(ConfigError, match="--max-model-len 9 is longer"):
        resolve_engine(EngineConfig(model=str(model_dir), max_model_len=9,
                                    disable_sliding_window=True))


@pytest.mark.parametrize("shape,windows,scale,soft_caps", [
    ("gemma-2-2b-shape", [4096, None], 256 ** -0.5, (50.0, 30.0)),
    ("gemma-2-9b-shape", [4096, None], 256 ** -0.5, (50.0, 30.0)),
    ("phi-3-mini-4k-shape", [2047, 2047], 96 ** -0.5, (None, None))])
def test_real_configs_take_transformers_checkpoints(shape, windows, scale, soft_caps):
    """Built on the meta device from the real config.json, our model takes every tensor of
    transformers' model of that config, by name and shape (Phi-3's fused ones included),
    and misses none; each layer's window, scale and caps are the config's."""
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(SHAPES / shape)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf_config)
        ours = model_class(hf_config)(hf_config)
    load_weights(ours, ref.state_dict().items())
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in ref.parameters())
    attns = [layer.self_attn.attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attns] == windows * (len(attns) // 2)
    assert all(a.scale == pytest.approx(scale) for a in attns)
    assert (attns[0].soft_cap, getattr(ours, "final_soft_cap", None)) == soft_caps


def test_graph_ladders():
    assert decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    # a decode's splits as kernels/triton_attention.split_count makes them: as many as fill
    # `wanted` programs, none under 128 keys of the bound; a second kind of layer (a
    # window of 300 keys) splits only what it walks
    def splits(wanted: int, bound: int) -> tuple[int, int]:
        return (min(wanted, -(-bound // 128)), min(wanted, -(-min(bound, 300) // 128)))
    assert context_spans(lambda bound: splits(33, bound), 2048) == [128, 256, 512, 1024, 2048]
    assert context_spans(lambda bound: splits(33, bound), 3000) == [128, 256, 512, 1024,
                                                                    2048, 3000]
    assert context_spans(lambda bound: splits(4, bound), 40960) == [128, 256, 40960]
    assert context_spans(lambda bound: splits(1, bound), 2048) == [2048]
    assert context_spans(lambda bound: splits(33, bound), 100) == [100]
    assert mixed_sizes(512) == [16, 32, 48, 64, 96, 144, 208, 304, 448, 512]
    assert mixed_sizes(8) == [8]


# --- the demo model ----------------------------------------------------------------------

@pytest.fixture(scope="session")
def demo_dir() -> Path:
    # the default cache: the first run converts the GGUF (~20 s), later runs reuse it
    return resolve_model(demo_model_path())


@pytest.mark.slow
def test_demo_gguf_prefill_matches_transformers_and_answers(demo_dir):
    from transformers import AutoModelForCausalLM

    hf_config = load_hf_config(demo_dir)
    tokenizer = load_tokenizer(demo_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    model = load_model(EngineConfig(model=str(demo_dir)), hf_config, CPU, torch.float32,
                       demo_dir)
    ref = AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    paged = Paged(model, hf_config, block_size=16)
    blocks = paged.blocks(len(ids) + 16)
    (logits,) = paged.step([(blocks, ids, 0)])
    assert rel_err(logits, expected) < TOLERANCE
    answer = []
    for _ in range(12):  # greedy decode through the paged cache
        answer.append(int(logits[-1].argmax()))
        if answer[-1] == hf_config.eos_token_id:
            break
        (logits,) = paged.step([(blocks, answer[-1:], len(ids) + len(answer) - 1)])
    text = tokenizer.decode(answer, skip_special_tokens=True)
    assert text.strip() == "The capital of France is Paris."


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen2_moe"])
def test_sublayer_ends_leave_split_sums_to_the_norm_after_them(arch, tmp_path):
    """o_proj and a dense MLP's down_proj feed a norm alone (this layer's, the next one's or
    the model's), which adds up a split K's partial sums (kernels/norm.py): on one rank they
    may leave them to it. Not Gemma's, whose sublayers reduce to norms of their own, nor a
    MoE block's shared expert, whose output is added to the routed one's."""
    model_dir = make_tiny_model(tmp_path, arch)
    hf_config = load_hf_config(model_dir)
    model = load_model(EngineConfig(model=str(model_dir), dtype="float32"), hf_config, CPU,
                       torch.float32)
    leaving = {name.split(".", 3)[-1] for name, module in model.named_modules()
               if getattr(module, "parts_to_norm", False)}
    expected = {"llama": {"self_attn.o_proj", "mlp.down_proj"}, "gemma2": set(),
                "qwen2_moe": {"self_attn.o_proj"}}[arch]
    assert leaving == expected
    shared = [module for name, module in model.named_modules()
              if name.endswith("shared_expert.down_proj")]
    assert all(not module.parts_to_norm for module in shared)
    assert len(shared) == (hf_config.num_hidden_layers if arch == "qwen2_moe" else 0)
