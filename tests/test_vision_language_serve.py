"""A tiny Qwen2.5-VL through `headrace serve` and the openai client: base64 images, an
image URL served by a local HTTP server of the test's, a base64 mp4 video whose frames are
sampled, and every bad input a 400 naming it, with the server answering the next request
as before. Answers equal the offline LLM of the same messages, or of the same frames
(tests/test_vision_language.py checks that against transformers); usage counts the
image's and video's placeholder tokens."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image

from common import keys
from common.sampling_params import SamplingParams
from services.offline.llm import LLM
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serving, tiny_serve_args
from tests.media_files import COLOURS, decoded_frames, solid_video
from tests.tiny_models import make_tiny_vl_model

MAX_IMAGE_BYTES = 100_000


def png(seed: int, size: tuple[int, int] = (140, 112)) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3))
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype("uint8")).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": list(parts)}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image(url: str, detail: str | None = None) -> dict:
    return {"type": "image_url",
            "image_url": url if detail is None else {"url": url, "detail": detail}}


def video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """A directory with cat.png, served over HTTP on 127.0.0.1: (directory, base URL)."""
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(png(1))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_vl_model(tmp_path_factory.mktemp("vl"), "qwen2_5_vl")


@pytest.fixture(scope="module")
def served(model_dir, files, tmp_path_factory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("serve")
    args = tiny_serve_args(model_dir, root / "run", "--dtype", "float32",
                           "--allowed-media-domains", "127.0.0.1",
                           "--limit-mm-per-prompt", '{"image": 2, "video": 1}',
                           "--media-io-kwargs", '{"video": {"num_frames": 4}}',
                           "--max-image-bytes", str(MAX_IMAGE_BYTES),
                           # one request at a time: the others wait (a lapsed image's test)
                           "--max-num-seqs", "1")
    with serving(args, root / "serve.log", root / "run") as server:
        yield server


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=API_KEY, max_retries=0)


def ask(client: openai.OpenAI, messages: list[dict]):
    return client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6,
                                          temperature=0.0)


def test_base64_and_url_images_answer_as_the_offline_engine(client, files, model_dir):
    _, base = files
    conversations = [
        user(text("What is this?"), image(data_url(png(1)))),
        user(text("What is this?"), image(f"{base}/cat.png", "high")),
        user(text("Compare"), image(data_url(png(2))), image(data_url(png(1)), "low")),
    ]
    answers = [ask(client, messages) for messages in conversations]
    with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64,
             allowed_media_domains=["127.0.0.1"]) as llm:
        for messages, answer in zip(conversations, answers):
            expected = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=6),
                                use_tqdm=False)[0]
            assert answer.choices[0].message.content == expected.outputs[0].text
            # 20 placeholders per 112x140 image, counted as prompt tokens
            assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
            assert answer.usage.prompt_tokens > 20 * (len(messages[0]["content"]) - 1)

    # the URL and the base64 of the same file are the same image
    assert answers[1].choices[0].message.content == answers[0].choices[0].message.content


def test_large_pixels_travel_as_their_own_keys(client, served):
    """A 112x140 image's patches (376 KB of float32) leave the tokenizer as a key named by
    the image's hash, with a TTL; the streams carry only the key."""
    import redis

    from common.image_blobs import INLINE_MAX_BYTES

    ask(client, user(text("Keys?"), image(data_url(png(9)))))
    store = redis.Redis(unix_socket_path=str(served.run_dir / "redis.sock"))
    names = store.keys("hr:image:*")
    assert names and all(store.strlen(n) > INLINE_MAX_BYTES for n in names)
    assert all(0 < store.ttl(n) <= 3600 for n in names)
    for stream in (keys.admit(), keys.steps()):  # what is left of them
        assert all(len(fields[b"body"]) < INLINE_MAX_BYTES
                   for _, fields in store.xrange(stream))


def new_image_key(store, before: set[bytes], timeout_s: float = 30.0) -> bytes:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fresh := set(store.keys("hr:image:*")) - before:
            return fresh.pop()
        time.sleep(0.005)
    raise AssertionError("no new image key")


def test_an_image_key_lost_while_its_request_waits_fails_that_request_alone(
        client, served, model_dir):
    """One request runs at a time: while a long one runs, the key of a waiting request's
    image is deleted. That request ends with a 503 naming the image; the long one and a
    request waiting behind it answer as the offline engine, and the server serves on."""
    import redis

    store = redis.Redis(unix_socket_path=str(served.run_dir / "redis.sock"))
    long = user(text("Tell me a long story"))
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=long, max_tokens=120, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    chunks = iter(stream)
    story = [next(chunks).choices[0].delta.content or ""]  # it runs: the next ones wait
    lost_image, kept_image = user(text("Gone?"), image(data_url(png(21)))), \
        user(text("Here?"), image(data_url(png(22))))
    with ThreadPoolExecutor(2) as pool:
        before = set(store.keys("hr:image:*"))
        lost = pool.submit(ask, client, lost_image)
        store.delete(key := new_image_key(store, before))
        kept = pool.submit(ask, client, kept_image)
        new_image_key(store, before | {key})
        story += [c.choices[0].delta.content or "" for c in chunks if c.choices]
        with pytest.raises(openai.APIStatusError, match=key.decode()) as info:
            lost.result(timeout=120)
        answer = kept.result(timeout=120)
    assert info.value.status_code == 503
    with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64) as llm:
        expected = llm.chat([long, kept_image], [
            SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=6)], use_tqdm=False)
    assert "".join(story) == expected[0].outputs[0].text
    assert answer.choices[0].message.content == expected[1].outputs[0].text
    again = ask(client, lost_image)  # sent again, its image is stored again
    assert again.choices[0].finish_reason == "length"


@pytest.mark.parametrize("parts, message", [
    ([image(data_url(b"not a picture"))], "Image 0 could not be decoded"),
    ([image(data_url(png(3, (300, 300))))], "too large"),
    ([image("http://localhost:1/cat.png")], "'localhost' is not allowed"),
    ([image("file:///etc/hostname")], "file: URLs are not allowed"),
    ([image(data_url(png(1)))] * 3, "At most 2 images"),
    ([{"type": "image_url", "image_url": {"url": "x", "detail": "huge"}}], "image_url"),
    ([video(data_url(b"not a video", "video/mp4"))], "Video 0 could not be decoded"),
    ([video(data_url(solid_video(COLOURS[:2]), "video/mp4"))] * 2, "At most 1 videos"),
    ([video("http://localhost:1/clip.mp4")], "Video 0: fetching from 'localhost' is not"),
])
def test_bad_images_are_400s_naming_the_problem(client, parts, message):
    with pytest.raises(openai.BadRequestError, match=message) as info:
        ask(client, user(text("Look:"), *parts))
    assert info.value.status_code == 400
    ok = ask(client, user(text("Still there?"), image(data_url(png(4)))))
    assert ok.choices[0].finish_reason == "length"


def test_tokenize_counts_image_tokens(served, model_dir):
    """/tokenize of a chat with an image: its placeholders expanded, as the prompt the
    tokenizer stage builds."""
    import json
    import urllib.request

    messages = user(text("What is this?"), image(data_url(png(1))))
    request = urllib.request.Request(
        served.url + "/tokenize", json.dumps({"model": MODEL_NAME, "messages": messages}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.loads(response.read())
    with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64) as llm:
        expected = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert body["tokens"] == expected.prompt_token_ids
    assert body["count"] == len(expected.prompt_token_ids)


def test_a_base64_video_answers_as_the_offline_engine_given_its_sampled_frames(
        client, served, model_dir):
    """Six frames at 4 fps, --media-io-kwargs' num_frames 4: frames 0, 1, 3 and 5 are
    taken (uniformly, first and last among them) at 4 x 4/6 fps, so they keep their
    times. The answer, usage and /tokenize equal the offline engine's given those frames
    decoded here; 2 temporal patches of 4 tokens."""
    import json
    import urllib.request

    data = solid_video()
    messages = user(text("What happens?"), video(data_url(data, "video/mp4")))
    answer = ask(client, messages)
    request = urllib.request.Request(
        served.url + "/tokenize", json.dumps({"model": MODEL_NAME, "messages": messages}).encode(),
        {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        tokenized = json.loads(response.read())
    frames = decoded_frames(data)[[0, 1, 3, 5]]
    prompt = ("<|im_start|>user\nWhat happens?<|vision_start|><|video_pad|><|vision_end|>"
              "<|im_end|>\n<|im_start|>assistant\n")
    with LLM(str(model_dir), dtype="float32", num_gpu_blocks_override=64) as llm:
        expected = llm.generate({"prompt": prompt, "multi_modal_data": {
            "video": (frames, {"fps": 4 * 4 / 6})}},
            SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
        video_token = llm.engine.processor.images.video_token_id
    assert expected.prompt_token_ids.count(video_token) == 8
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert tokenized["tokens"] == expected.prompt_token_ids


def test_bench_serve_random_mm_sends_images_the_server_counts(served, model_dir, tmp_path):
    """`headrace bench serve --dataset random-mm` against the served model: every request
    answers, and its prompt tokens are its text's plus each image's 20 placeholders
    (112x140 pixels), as the model's tokenizer counts them."""
    import json

    from transformers import AutoTokenizer

    from benchmarks.bench import serve

    flags = ["--base-url", served.url, "--api-key", API_KEY, "--endpoint", "chat",
             "--dataset", "random-mm", "--num-prompts", "3", "--random-input-len", "5",
             "--random-output-len", "4", "--random-mm-base-items-per-request", "2",
             "--random-mm-limit-mm-per-prompt", '{"image": 2}',
             "--random-mm-bucket-config", "{(112, 140, 1): 1.0}", "--disable-tqdm"]
    result = tmp_path / "result.json"
    assert serve.main([*flags, "--save-result", str(result)]) == 0
    data = json.loads(result.read_text())
    assert data["summary"]["completed"] == 3 and data["summary"]["failed"] == 0
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    planned = serve.plan_requests(serve.build_parser().parse_args(flags))  # the same seed
    for plan, request in zip(planned, data["requests"]):
        text_and_slots = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": plan.prompt},
                                          {"type": "image"}, {"type": "image"}]}],
            add_generation_prompt=True, tokenize=True, return_dict=False)
        assert request["prompt_tokens"] == len(text_and_slots) + 2 * (20 - 1)
        assert request["output_tokens"] == 4
