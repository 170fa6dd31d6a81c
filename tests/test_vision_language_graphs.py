"""CUDA graphs for vision-language models' steps without image rows, checked on the CPU:
M-RoPE at three equal positions is 1-D RoPE (the text path's logits and KV cache, exactly
as the M-RoPE path's), the per-step choice between a replay and an eager step, and whole
generations whose text steps go through the graphs' static buffers (padded as a replay
would be) against transformers and the eager engine. The replays themselves are
tests/test_gpu.py's (-k vl_graphs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import EngineConfig
from common.messages import ImageInput
from common.model_files import load_hf_config
from common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.worker.cuda_graphs import GraphKey, StepGraphs
from services.worker.images import mrope_positions_of_step
from services.worker.inputs import StepInputs
from services.worker.layers.attention import AttentionMetadata, ForwardContext
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner, replays_graph
from services.worker.models.qwen2_vl import mrope_positions
from tests.test_models import Paged, token_ids
from tests.test_vision_language import IMAGE, MAX_TOKENS, chat, check_against_reference, \
    random_image
from tests.tiny_models import make_tiny_llava, make_tiny_vl_model
from tests.tiny_models import model_in_this_process  # noqa: F401 (autouse)

CPU = torch.device("cpu")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
@torch.no_grad()
def test_text_steps_at_collapsed_positions_give_the_m_rope_logits(arch, tmp_path):
    """A prompt with an image's (unequal) M-RoPE positions fills two identical caches; then
    a text chunk beside a decode, and a decode, run at [3, T] equal positions in one and at
    their 1-D collapse (the fused attention-input path) in the other: the same logits and
    the same cache, to float32 rounding."""
    model_dir = make_tiny_vl_model(tmp_path, arch)
    hf_config = load_hf_config(model_dir)
    model = load_model(EngineConfig(model=str(model_dir), dtype="float32"), hf_config, CPU,
                       torch.float32, model_dir)
    mrope, flat = Paged(model, hf_config, block_size=4, seed=1), \
        Paged(model, hf_config, block_size=4, seed=1)
    image = ImageInput("h", offset=3, length=6, grid_thw=[1, 4, 6])  # 2x3 merged tokens
    prompts = [token_ids(14, seed=1), token_ids(9, seed=2)]
    tables = [mrope_positions(len(p), [image], 2) for p in prompts]
    assert all((table[0] != table[1]).any() for table, _ in tables)
    blocks = [mrope.blocks(24), mrope.blocks(24)]
    assert blocks == [flat.blocks(24), flat.blocks(24)]

    def run(paged: Paged, chunks, positions: torch.Tensor) -> torch.Tensor:
        input_ids, _, attn = paged.inputs(chunks)
        return model.compute_logits(model(input_ids, positions,
                                          ForwardContext(attn, paged.kv_caches)))

    prefill = [(blocks[0], prompts[0][:10], 0), (blocks[1], prompts[1], 0)]
    three = torch.cat([torch.from_numpy(tables[0][0][:, :10]),
                       torch.from_numpy(tables[1][0])], dim=1)
    for paged in (mrope, flat):
        run(paged, prefill, three)
    # the rest of the first prompt (text), then the second's first output token
    chunks = [(blocks[0], prompts[0][10:], 10), (blocks[1], [7], 9)]
    text = torch.cat([torch.from_numpy(tables[0][0][0, 10:]),
                      torch.tensor([9 + tables[1][1]])])
    decode = [(blocks[0], [5], 14), (blocks[1], [11], 10)]
    collapsed = torch.tensor([14 + tables[0][1], 10 + tables[1][1]])
    for step, positions in ((chunks, text), (decode, collapsed)):
        want = run(mrope, step, positions.expand(3, -1).contiguous())
        got = run(flat, step, positions)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    for (k_want, v_want), (k_got, v_got) in zip(mrope.kv_caches, flat.kv_caches):
        torch.testing.assert_close(k_got, k_want, atol=1e-6, rtol=0)
        torch.testing.assert_close(v_got, v_want, atol=1e-6, rtol=0)


def step_inputs(positions: torch.Tensor, image_rows=None) -> StepInputs:
    """The fields replays_graph reads; the rest empty."""
    attn = AttentionMetadata(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 0),
                             torch.zeros(1), torch.zeros(0), max_query_len=1, max_seq_len=1)
    return StepInputs(torch.zeros(positions.shape[-1], dtype=torch.int64), positions, attn,
                      torch.zeros(0), None, [], [], [], [], [], [], None, image_rows)


def test_steps_with_image_rows_run_eagerly_and_the_others_replay():
    table = np.array([[0, 1, 2, 2, 2, 5], [0, 1, 2, 3, 3, 5], [0, 1, 2, 3, 4, 5]])
    text = np.array([[7, 8], [7, 8], [7, 8]])
    assert mrope_positions_of_step(table, True).shape == (3, 6)
    assert mrope_positions_of_step(text, False).tolist() == [7, 8]
    with pytest.raises(AssertionError, match="three positions differ"):
        mrope_positions_of_step(table, False)
    rows = (torch.tensor([2, 3]), torch.zeros(2, 8))
    assert not replays_graph(step_inputs(torch.from_numpy(table), rows))  # Qwen2-VL, image
    assert not replays_graph(step_inputs(torch.arange(6), rows))  # LLaVA, image
    assert replays_graph(step_inputs(torch.tensor([7, 8])))  # text or decode
    assert not replays_graph(step_inputs(torch.from_numpy(text)))  # never [3, T] in a graph


class EagerGraphs(StepGraphs):
    """A runner's graphs computed eagerly on the CPU: each step copied into the static
    buffers and padded to its graph's size, then the model over them, as a replay
    computes. Records the keys and how the model was called outside them."""

    def __init__(self, runner: ModelRunner) -> None:
        config = runner.config
        super().__init__(runner.model, runner.kv_caches, config.max_num_seqs,
                         config.max_num_batched_tokens, config.max_model_len,
                         runner.block_size)
        self.replayed: list[GraphKey] = []
        self.eager: list[tuple[int, bool]] = []  # (positions' dims, has image rows)
        self.replaying = False
        forward = runner.model.forward

        def record(input_ids, positions, ctx, image_rows=None):
            if not self.replaying:
                self.eager.append((positions.dim(), image_rows is not None))
            return forward(input_ids, positions, ctx, image_rows)
        runner.model.forward = record

    def run(self, key, input_ids, positions, attn, hidden=None):
        self.replayed.append(key)
        self.load(key, input_ids, positions, attn, hidden)
        self.replaying = True
        try:
            return self.forward(key)[:input_ids.shape[0]]
        finally:
            self.replaying = False


def with_eager_graphs(llm: LLM) -> EagerGraphs:
    runner = llm.engine.runner
    runner.graphs = EagerGraphs(runner)
    return runner.graphs


PROMPT = f"{IMAGE}Describe the picture in a few words, please, and then count to five."


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen_vl_text_steps_through_the_graph_buffers_match_transformers(arch, tmp_path):
    """A 16-token budget: the image's chunks run eagerly at three positions a token; the
    text chunk after it and every decode go through the graphs' buffers at one, and the
    tokens, their logprobs and the prompt's are transformers'."""
    from transformers import AutoModelForImageTextToText

    model_dir = make_tiny_vl_model(tmp_path, arch)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              max_num_batched_tokens=16, max_num_seqs=2)
    graphs = with_eager_graphs(llm)
    check_against_reference(llm, hf, chat(PROMPT), [random_image(1)])
    assert graphs.eager and all(call == (2, True) for call in graphs.eager)
    assert [key.size for key in graphs.replayed if not key.mixed] == [1] * (MAX_TOKENS - 1)
    assert any(key.mixed for key in graphs.replayed)  # the text chunk after the image


def test_llava_text_steps_through_the_graph_buffers_give_the_eager_tokens(tmp_path):
    """LLaVA beside a text-only request: the steps with image rows run eagerly, the others
    replay (the two requests' decodes together too), and the tokens and prompt logprobs
    are the eager engine's (tests/test_vision_language.py checks those against
    transformers)."""
    model_dir = make_tiny_llava(tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=0, logprobs=0)
    requests = [{"prompt": chat("A <|image_pad|> or <|image_pad|>? Say which one."),
                 "multi_modal_data": {"image": [random_image(2), random_image(3)]}},
                chat("Only text here, and a little more of it.")]
    outs = []
    for graphs_on in (False, True):
        llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
                  max_num_batched_tokens=16, max_num_seqs=2)
        graphs = with_eager_graphs(llm) if graphs_on else None
        outs.append(llm.generate(requests, params, use_tqdm=False))
    assert graphs is not None
    assert graphs.eager and all(call == (1, True) for call in graphs.eager)
    assert any(not key.mixed and key.size == 2 for key in graphs.replayed)
    assert any(key.mixed for key in graphs.replayed)
    for eager, replayed in zip(*outs):
        assert replayed.outputs[0].token_ids == eager.outputs[0].token_ids
        for ours, want in zip(replayed.prompt_logprobs[1:], eager.prompt_logprobs[1:]):
            assert ours.keys() == want.keys()
            for token in ours:
                assert abs(ours[token].logprob - want[token].logprob) < 1e-5
