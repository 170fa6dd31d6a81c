"""Vision-language models (Qwen2-VL, Qwen2.5-VL) against transformers on the same tiny
random weights (CPU, float32), through the offline API: prompt logprobs and greedy tokens
for one and two images and for one video, with chunked prefill cutting an image's placeholders, the
prefix cache hitting a repeated image (and missing a different one), and at two
tensor-parallel ranks over gloo."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from common.sampling_params import SamplingParams
from services.offline.llm import LLM
from tests.tiny_models import make_tiny_vl_model

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_TOKENS = 6


def random_image(seed: int, size: tuple[int, int] = (140, 112)) -> Image.Image:
    """size (width, height): 112x140 px are 8x10 patches, 20 tokens after merging."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3))
    return Image.fromarray(pixels.astype("uint8"))


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen2_vl"])
def tiny_vl(request, tmp_path_factory):
    from transformers import AutoModelForImageTextToText

    model_dir = make_tiny_vl_model(tmp_path_factory.mktemp(request.param), request.param)
    hf = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf


def reference(hf, ids: list[int], pixels: torch.Tensor, grids: torch.Tensor
              ) -> tuple[list[float], list[int], list[float]]:
    """transformers' prompt logprobs (of tokens 1..), greedy tokens and their logprobs,
    recomputing the whole sequence each step (its M-RoPE positions from the full ids)."""
    image_token = hf.config.image_token_id
    seq = list(ids)
    prompt_lps: list[float] = []
    token_lps: list[float] = []
    with torch.no_grad():
        for step in range(MAX_TOKENS):
            input_ids = torch.tensor([seq])
            logits = hf(input_ids=input_ids, pixel_values=pixels, image_grid_thw=grids,
                        mm_token_type_ids=(input_ids == image_token).int()).logits[0]
            lp = torch.log_softmax(logits.float(), dim=-1)
            if step == 0:
                prompt_lps = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
            seq.append(int(logits[-1].argmax()))
            token_lps.append(float(lp[-1, seq[-1]]))
    return prompt_lps, seq[len(ids):], token_lps


def check_against_reference(llm: LLM, hf, prompt: str, images: list[Image.Image],
                            prompt_logprobs: bool = True) -> None:
    """Greedy tokens and their logprobs; the prompt's logprobs too where asked (a request
    for them skips the prefix cache, as vLLM's does)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0 if prompt_logprobs else None)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params,
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    image_token = hf.config.image_token_id
    processed = llm.engine.processor.images.image_processor(images=images,
                                                            return_tensors="pt")
    grids = processed["image_grid_thw"]
    assert ids.count(image_token) == int(grids.prod(-1).sum()) // 4  # expanded
    ref_prompt, ref_tokens, ref_token_lps = reference(hf, ids, processed["pixel_values"],
                                                      grids)
    completion = out.outputs[0]
    assert completion.token_ids == ref_tokens
    ours = [entry[token].logprob for entry, token in zip(completion.logprobs, ref_tokens)]
    np.testing.assert_allclose(ours, ref_token_lps, atol=2e-4, rtol=0)
    if prompt_logprobs:
        ours = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
        np.testing.assert_allclose(ours, ref_prompt, atol=2e-4, rtol=0)


def test_one_and_two_images_match_transformers(tiny_vl):
    model_dir, hf = tiny_vl
    llm = LLM(str(model_dir), dtype="float32", block_size=8, num_gpu_blocks_override=128)
    check_against_reference(llm, hf, chat(f"{IMAGE}What is this?"), [random_image(1)])
    check_against_reference(llm, hf, chat(f"Compare {IMAGE} and {IMAGE} please."),
                            [random_image(2), random_image(3, (84, 56))])


VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def random_video(seed: int, frames: int = 5, size: tuple[int, int] = (140, 112)) -> np.ndarray:
    """[frames, height, width, 3]: 112x140 px frames are 8x10 patches, 20 tokens each
    pair of frames after merging (an odd last frame is repeated to make its pair)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (frames, size[1], size[0], 3)).astype("uint8")


def test_one_video_matches_transformers(tiny_vl):
    """Five frames at 3 fps: three temporal patches (the last frame repeated), each
    2/3 s, so Qwen2.5-VL's time positions are 0, 2, 5 (4 tokens per second) and
    Qwen2-VL's 0, 1, 2. The encoder attends within each temporal patch."""
    model_dir, hf = tiny_vl
    llm = LLM(str(model_dir), dtype="float32", block_size=8, num_gpu_blocks_override=128,
              max_num_batched_tokens=32, max_num_seqs=2)  # chunks cut the video
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0, prompt_logprobs=0)
    frames = random_video(8)
    out = llm.generate({"prompt": chat(f"{VIDEO}What happens?"),
                        "multi_modal_data": {"video": (frames, {"fps": 3.0})}}, params,
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    _, (video,) = llm.engine.processor.with_images(
        llm.engine.processor.prompt_ids(chat(f"{VIDEO}What happens?"), None, None),
        [], [(frames, {"fps": 3.0})])
    assert video.grid_thw == [3, 8, 10] and ids.count(hf.config.video_token_id) == 60
    input_ids = torch.tensor([ids])
    pixels = torch.from_numpy(np.frombuffer(video.pixels, "<f4").reshape(240, -1).copy())
    kwargs = dict(pixel_values_videos=pixels, video_grid_thw=torch.tensor([[3, 8, 10]]),
                  mm_token_type_ids=2 * (input_ids == hf.config.video_token_id).int())
    if "2_5" in type(hf).__name__:
        kwargs["second_per_grid_ts"] = torch.tensor([2 / 3.0])
    seq, ref_lps = list(ids), []
    with torch.no_grad():
        for step in range(MAX_TOKENS):
            logits = hf(input_ids=torch.tensor([seq]), **{
                **kwargs, "mm_token_type_ids": 2 * (torch.tensor([seq]) ==
                                                    hf.config.video_token_id).int()}
                        ).logits[0]
            lp = torch.log_softmax(logits.float(), dim=-1)
            if step == 0:
                ref_prompt = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
            seq.append(int(logits[-1].argmax()))
            ref_lps.append(float(lp[-1, seq[-1]]))
    completion = out.outputs[0]
    assert completion.token_ids == seq[len(ids):]
    ours = [entry[t].logprob for entry, t in zip(completion.logprobs, completion.token_ids)]
    np.testing.assert_allclose(ours, ref_lps, atol=2e-4, rtol=0)
    ours = [entry[t].logprob for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    np.testing.assert_allclose(ours, ref_prompt, atol=2e-4, rtol=0)


def test_a_still_video_is_its_frame_on_both_time_slots(tiny_vl):
    """A video's temporal patch holds its two frames on the time axis: two copies of a
    frame give the image processor's patches of that frame (which repeats an image on
    it), so the layout matches transformers' for a still image."""
    model_dir, _ = tiny_vl
    prompts = LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=16
                  ).engine.processor.images
    frame = random_video(9, frames=1)
    (image,) = prompts.expand([prompts.image_token_id], [Image.fromarray(frame[0])])[1]
    (video,) = prompts.expand([prompts.video_token_id], [], [np.repeat(frame, 2, 0)])[1]
    assert video.grid_thw == image.grid_thw and video.pixels == image.pixels
    assert video.second_per_grid_t == 1.0 and image.second_per_grid_t == 0.0


def test_chunked_prefill_splits_an_image(tiny_vl):
    """A 16-token budget cuts the 20 placeholders of the first image (and the second's)
    across steps: each chunk takes its rows of the image's embeddings."""
    model_dir, hf = tiny_vl
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              max_num_batched_tokens=16, max_num_seqs=2)
    check_against_reference(llm, hf, chat(f"Look: {IMAGE} then {IMAGE}."),
                            [random_image(4), random_image(5)])
    assert llm.engine.runner.images.encoded == 2  # each image encoded once across chunks


def test_prefix_cache_hits_a_repeated_image_and_misses_another(tiny_vl):
    model_dir, hf = tiny_vl
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
              enable_prefix_caching=True)
    prompt = chat(f"{IMAGE}Describe the picture in a few words.")
    check_against_reference(llm, hf, prompt, [random_image(6)], prompt_logprobs=False)
    hits = llm.engine.scheduler.kv.stats.hits
    # the same image: a hit
    check_against_reference(llm, hf, prompt, [random_image(6)], prompt_logprobs=False)
    repeated = llm.engine.scheduler.kv.stats.hits - hits
    assert repeated >= 20  # the placeholders' blocks came from the cache
    # another image of the same size: the same token ids, but a miss from its first block
    check_against_reference(llm, hf, prompt, [random_image(7)], prompt_logprobs=False)
    other = llm.engine.scheduler.kv.stats.hits - hits - repeated
    # only the text before the image is shared: "<|im_start|>user\n<|vision_start|>"
    assert other < 8


def test_a_wrong_number_of_images_is_refused(tiny_vl):
    model_dir, _ = tiny_vl
    llm = LLM(str(model_dir), dtype="float32", block_size=8, num_gpu_blocks_override=32)
    with pytest.raises(Exception, match=r"1 image placeholders \(token \d+\) but 2 images"):
        llm.generate({"prompt": chat(f"{IMAGE}?"),
                      "multi_modal_data": {"image": [random_image(1), random_image(2)]}},
                     use_tqdm=False)


def test_two_ranks_over_gloo_match_transformers(tiny_vl):
    """Tensor parallelism: the decoder splits over two gloo ranks, each rank runs the
    (replicated) vision tower on the same plan's images, and chunks still cut images."""
    model_dir, hf = tiny_vl
    with LLM(str(model_dir), tensor_parallel_size=2, device="cpu", dtype="float32",
             block_size=4, num_gpu_blocks_override=128, max_num_batched_tokens=16,
             max_num_seqs=2) as llm:
        check_against_reference(llm, hf, chat(f"Look: {IMAGE} then {IMAGE}."),
                                [random_image(4), random_image(5)])


# --- LLaVA ---------------------------------------------------------------------------------

def test_llava_matches_transformers(tmp_path):
    """LLaVA: CLIP features of the layer before the last (class token dropped) through the
    projector; one and two images, a 16-token budget cutting the second image."""
    from transformers import LlavaForConditionalGeneration

    from tests.tiny_models import make_tiny_llava

    model_dir = make_tiny_llava(tmp_path)
    hf = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    image_token = hf.config.image_token_id
    with LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
             max_num_batched_tokens=16, max_num_seqs=2) as llm:
        for prompt, images in ((chat("<|image_pad|>What is it?"), [random_image(1)]),
                               (chat("A <|image_pad|> or <|image_pad|>?"),
                                [random_image(2), random_image(3, (84, 56))])):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                    prompt_logprobs=0)
            out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}},
                               params, use_tqdm=False)[0]
            ids = out.prompt_token_ids
            assert ids.count(image_token) == 16 * len(images)
            pixels = llm.engine.processor.images.image_processor(
                images=images, return_tensors="pt")["pixel_values"]
            seq = list(ids)
            with torch.no_grad():
                for step in range(MAX_TOKENS):
                    logits = hf(input_ids=torch.tensor([seq]), pixel_values=pixels).logits[0]
                    if step == 0:
                        lp = torch.log_softmax(logits[:-1], dim=-1)
                        ref = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
                    seq.append(int(logits[-1].argmax()))
            ours = [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]
            np.testing.assert_allclose(ours, ref.tolist(), atol=2e-4, rtol=0)
            assert out.outputs[0].token_ids == seq[len(ids):]


def test_lora_and_draft_models_are_refused_for_vision_language_models(tmp_path):
    from common.config import ConfigError

    model_dir = make_tiny_vl_model(tmp_path, "qwen2_5_vl")
    with pytest.raises(ConfigError, match="LoRA is not supported on vision-language"):
        LLM(str(model_dir), enable_lora=True)
    with pytest.raises(ConfigError, match="draft model is not supported"):
        LLM(str(model_dir), speculative_config={"method": "draft_model", "model": str(model_dir),
                                                "num_speculative_tokens": 2})


def test_the_memory_profile_encodes_the_largest_images_a_step_may_hold(tmp_path):
    """The KV cache is sized after a step at the token budget whose images are encoded
    too: as many of the processor's largest images as the step may touch (capped by
    --limit-mm-per-prompt times --max-num-seqs), their rows in the decoder's input."""
    from transformers import AutoImageProcessor

    from common.config import EngineConfig
    from common.model_info import resolve_engine
    from services.worker.images import profile_image_grids
    from services.worker.model_runner import ModelRunner

    model_dir = make_tiny_vl_model(tmp_path, "qwen2_5_vl")
    config = EngineConfig(model=str(model_dir), dtype="float32", device="cpu",
                          num_gpu_blocks_override=16, max_num_batched_tokens=96,
                          max_num_seqs=2, limit_mm_per_prompt='{"image": 1}')
    resolved = resolve_engine(config)
    runner = ModelRunner(resolved.config, resolved.hf_config, resolved.model_dir)
    # the largest grid is the processor's for a huge image: 8x8 merged tokens
    largest = runner.image_tokens.largest_grid()
    processed = AutoImageProcessor.from_pretrained(model_dir)(
        images=[random_image(0, (2000, 2000))], return_tensors="np")
    assert processed["image_grid_thw"].tolist() == [list(largest)] == [[1, 16, 16]]

    encoded, decoded = [], []
    encode, forward = runner.model.encode_images, runner.model.forward
    runner.model.encode_images = lambda p, g: encoded.append((tuple(p.shape), g)) or encode(p, g)
    runner.model.forward = lambda ids, pos, ctx, rows: decoded.append(
        (ids.shape[0], tuple(pos.shape), None if rows is None else rows[1].shape[0])) or \
        forward(ids, pos, ctx, rows)
    runner.profile_run()
    # 96 tokens touch up to 3 images of 64 tokens; one per request, two requests a step
    assert encoded == [((2 * 256, runner.model.patch_dim), [(1, 16, 16)] * 2)]
    assert decoded == [(96, (3, 96), 96)]  # image rows over the whole step, M-RoPE axes

    assert profile_image_grids((1, 16, 16), 2, 96, None) == [(1, 16, 16)] * 3
    assert profile_image_grids((1, 16, 16), 2, 64, None) == [(1, 16, 16)] * 2
    assert profile_image_grids((1, 16, 16), 2, 1, None) == [(1, 16, 16)]
    assert profile_image_grids((1, 16, 16), 2, 96, 0) == []


def test_equal_sequences_are_batched_in_runs():
    """The vision attention's batches: back-to-back sequences of one length are one SDPA
    call (Qwen2.5-VL's windows), an empty one is skipped, another length starts a run."""
    from services.worker.models.qwen2_vl import equal_runs
    assert equal_runs([0, 4, 8, 8, 12, 14, 16, 19]) == [(0, 3, 4), (12, 2, 2), (16, 1, 3)]
    assert equal_runs([0]) == []
