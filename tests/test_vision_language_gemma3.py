"""Gemma 3 with images (Gemma3ForConditionalGeneration) against transformers on the same
tiny random weights (CPU, float32), through the offline LLM: prompt logprobs and greedy
tokens for one and two images, with the image tokens attending to each other both ways
(transformers' token_type_ids mask), with chunked prefill around the images and a prefix
hit on a repeated image."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.sampling_params import SamplingParams
from services.offline.llm import LLM
from tests.test_vision_language import MAX_TOKENS, chat, random_image
from tests.tiny_models import make_tiny_gemma3_vl

IMAGE = "<start_of_image>"
TOKENS_PER_IMAGE = 4


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from transformers import Gemma3ForConditionalGeneration

    model_dir = make_tiny_gemma3_vl(tmp_path_factory.mktemp("gemma3"))
    hf = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model_dir, hf


def reference(hf, ids: list[int], pixels: torch.Tensor, both_ways: bool = True
              ) -> tuple[list[float], list[int]]:
    """transformers' prompt logprobs (of tokens 1..) and greedy tokens, recomputing the
    whole sequence each step; both_ways: pass token_type_ids, which make an image's tokens
    attend to each other both ways (without them the mask is causal)."""
    seq = list(ids)
    prompt_lps: list[float] = []
    with torch.no_grad():
        for step in range(MAX_TOKENS):
            input_ids = torch.tensor([seq])
            types = (input_ids == hf.config.image_token_id).long() if both_ways else None
            logits = hf(input_ids=input_ids, pixel_values=pixels,
                        token_type_ids=types).logits[0]
            if step == 0:
                lp = torch.log_softmax(logits[:-1].float(), dim=-1)
                prompt_lps = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
            seq.append(int(logits[-1].argmax()))
    return prompt_lps, seq[len(ids):]


def check(llm: LLM, hf, prompt: str, images: list, prompt_logprobs: bool = True) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            prompt_logprobs=0 if prompt_logprobs else None)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, params,
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids
    config = hf.config
    assert ids.count(config.image_token_id) == TOKENS_PER_IMAGE * len(images)
    assert ids.count(config.boi_token_id) == ids.count(config.eoi_token_id) == len(images)
    pixels = llm.engine.processor.images.image_processor(images=images,
                                                         return_tensors="pt")["pixel_values"]
    ref_prompt, ref_tokens = reference(hf, ids, pixels)
    assert out.outputs[0].token_ids == ref_tokens
    if prompt_logprobs:
        ours = [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], ids[1:])]
        np.testing.assert_allclose(ours, ref_prompt, atol=2e-4, rtol=0)
        # the test bites: a causal mask over the images gives other logprobs
        causal, _ = reference(hf, ids, pixels, both_ways=False)
        assert np.abs(np.asarray(causal) - np.asarray(ref_prompt)).max() > 1e-2
    return ids


def test_one_and_two_images_match_transformers(tiny_gemma3):
    model_dir, hf = tiny_gemma3
    with LLM(str(model_dir), dtype="float32", block_size=8,
             num_gpu_blocks_override=128) as llm:
        ids = check(llm, hf, chat(f"{IMAGE}What is this?"), [random_image(1)])
        # the frame: "\n\n" merged with the template's "\n" before it, <start_of_image>,
        # the image tokens, <end_of_image>, "\n\n"
        tokenizer = llm.engine.processor.tokenizer
        start = ids.index(hf.config.boi_token_id)
        assert tokenizer.decode(ids[start - 1:start]) == "\n\n\n"
        assert tokenizer.decode(ids[start + 5 + 1:start + 5 + 2]) == "\n\n"
        check(llm, hf, chat(f"Compare {IMAGE} and {IMAGE} please."),
              [random_image(2), random_image(3, (84, 56))])


def test_chunks_never_cut_an_image_and_a_repeated_image_hits(tiny_gemma3):
    """A 6-token budget would cut the images' tokens: each image's chunk is computed whole
    (ending before the image, or running to its end), and the prefix cache serves the
    same prompt and images again."""
    model_dir, hf = tiny_gemma3
    with LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=128,
             max_num_batched_tokens=6, max_num_seqs=2, enable_prefix_caching=True) as llm:
        prompt = chat(f"Look: {IMAGE} then {IMAGE} and say.")
        images = [random_image(4), random_image(5)]
        check(llm, hf, prompt, images)
        hits = llm.engine.scheduler.kv.stats.hits
        check(llm, hf, prompt, images, prompt_logprobs=False)
        assert llm.engine.scheduler.kv.stats.hits - hits >= 12


def test_two_ranks_over_gloo_match_transformers(tiny_gemma3):
    """Tensor parallelism: the decoder split over two gloo ranks, the tower whole on each."""
    model_dir, hf = tiny_gemma3
    with LLM(str(model_dir), tensor_parallel_size=2, device="cpu", dtype="float32",
             block_size=4, num_gpu_blocks_override=128, max_num_batched_tokens=8,
             max_num_seqs=2) as llm:
        check(llm, hf, chat(f"Look: {IMAGE} then {IMAGE}."), [random_image(4), random_image(5)])


def test_an_image_longer_than_a_step_is_refused(tiny_gemma3):
    model_dir, _ = tiny_gemma3
    with LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks_override=32,
             max_num_batched_tokens=3, max_num_seqs=2) as llm:
        with pytest.raises(ValueError, match="image of 4 tokens.*max_num_batched_tokens 3"):
            llm.generate({"prompt": chat(f"{IMAGE}?"),
                          "multi_modal_data": {"image": [random_image(1)]}}, use_tqdm=False)


def test_whole_images_moves_a_chunk_end_out_of_an_image():
    from common.messages import ImageInput
    from services.scheduler.core import whole_images

    image = ImageInput(hash="h", offset=10, length=6, grid_thw=[1, 4, 4], bidirectional=True)
    req = SimpleNamespace(images=[image])  # all whole_images reads of a request
    assert whole_images(req, 0, 12, budget=12) == 10      # ends before the image
    assert whole_images(req, 0, 16, budget=16) == 16      # holds it whole
    assert whole_images(req, 10, 4, budget=8) == 6        # starts at it: runs to its end
    assert whole_images(req, 12, 2, budget=8) == 4        # a prefix hit inside it
    assert whole_images(req, 10, 4, budget=5) == 0        # it does not fit: wait
    causal = ImageInput(hash="h", offset=10, length=6, grid_thw=[1, 4, 4])
    req.images = [causal]
    assert whole_images(req, 0, 12, budget=12) == 12      # a causal image may be cut


def test_a_frame_merges_its_newlines_with_those_next_to_it_only():
    """Gemma3Processor inserts "\\n\\n<start_of_image>...<end_of_image>\\n\\n" into the text,
    which the tokenizer then reads with the newlines around it as one run; the token-level
    frame gives the same, and leaves newlines away from images as they were."""
    from common.vision import ImageFrame

    newline = {1: 10, 2: 11, 3: 12, 4: 13, 5: 14}  # count -> token
    frame = ImageFrame(placeholder=7, before=(11, 7), after=(8, 11),
                       newlines={t: n for n, t in newline.items()},
                       runs={n: (t,) for n, t in newline.items()})
    ids, offsets = frame.expand([10, 10, 5, 10, 7, 10, 6, 7, 7], 9, [2, 1, 1])
    assert ids == [10, 10, 5,            # newlines away from an image keep their tokens
                   12, 7, 9, 9, 8,       # "\n" + "\n\n" before the frame: one run
                   12, 6,                # "\n\n" + "\n" after it
                   11, 7, 9, 8,          # after text: the frame's own "\n\n"
                   13, 7, 9, 8, 11]      # "\n\n" + "\n\n" between two frames
    assert offsets == [5, 12, 16]
    assert [ids[o] for o in offsets] == [9, 9, 9]


@pytest.mark.long  # a whole `headrace serve` start: make test-long
def test_a_served_chat_with_an_image_answers_as_the_offline_engine(tiny_gemma3, tmp_path):
    """Through `headrace serve` and the openai client: a base64 image_url answers as the
    offline LLM.chat of the same messages, usage and /tokenize count the framed image's
    tokens (the gateway frames it without the image processor)."""
    import json
    import urllib.request

    import openai

    from tests.e2e_fixtures import API_KEY, MODEL_NAME, serving, tiny_serve_args
    from tests.test_vision_language_serve import data_url, image, png, text, user

    model_dir, hf = tiny_gemma3
    messages = user(text("What is this?"), image(data_url(png(1))))
    args = tiny_serve_args(model_dir, tmp_path / "run", "--dtype", "float32")
    with serving(args, tmp_path / "serve.log", tmp_path / "run") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        answer = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                max_tokens=6, temperature=0.0)
        request = urllib.request.Request(
            server.url + "/tokenize",
            json.dumps({"model": MODEL_NAME, "messages": messages}).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            tokenized = json.loads(response.read())
    with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64) as llm:
        expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6),
                            use_tqdm=False)[0]
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert tokenized["tokens"] == expected.prompt_token_ids
    assert expected.prompt_token_ids.count(hf.config.image_token_id) == TOKENS_PER_IMAGE
