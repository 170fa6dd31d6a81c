"""The tokenizer stage's image and video inputs: image_url and video_url parts in chat
messages (data: URLs, and http(s) and file: URLs only where allowed), a video's frames
sampled as --media-io-kwargs says, --limit-mm-per-prompt, and every bad input a 400
naming it, before anything reaches the scheduler."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from common.chat import chat_image_urls, chat_video_urls, plain_conversation
from common.config import ConfigError, EngineConfig
from common.errors import ApiError
from common.media import MediaRules, load_images, load_videos
from tests.media_files import COLOURS, decoded_frames, solid_video


def png_bytes(size=(56, 56)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 60)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_image_url_parts_string_or_object_are_kept_for_the_template():
    url = data_url(png_bytes())
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": url},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]
    assert plain_conversation(messages)[0]["content"] == [
        {"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert chat_image_urls(messages) == [url, url]
    with pytest.raises(ApiError, match="image_url parts"):
        plain_conversation([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url, "detail": "huge"}}]}])


def test_video_url_parts_are_kept_for_the_template():
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}},
        {"type": "text", "text": "a"}, {"type": "video_url", "video_url": "http://x/v.mp4"}]}]
    assert plain_conversation(messages)[0]["content"] == [
        {"type": "video"}, {"type": "text", "text": "a"}, {"type": "video"}]
    assert chat_video_urls(messages) == ["data:video/mp4;base64,AA==", "http://x/v.mp4"]
    assert chat_image_urls(messages) == []
    with pytest.raises(ApiError, match="video_url and image_url parts"):
        plain_conversation([{"role": "user", "content": [
            {"type": "video_url", "video_url": {"uri": "x"}}]}])


def video_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("container_format, codec", [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_videos_decode_with_frames_sampled_uniformly(container_format, codec):
    """Six frames at 4 fps: four of them are frames 0, 1, 3 and 5, at 4 x 4/6 fps (the
    frames keep their times); -1 or a count above six takes every frame at 4 fps. The
    webm states no frame count: its frames are counted by decoding."""
    data = solid_video(fps=4, container_format=container_format, codec=codec)
    every = decoded_frames(data)
    assert every.shape == (6, 56, 56, 3)
    (frames, meta), = load_videos([video_url(data)], MediaRules(num_frames=4))
    np.testing.assert_array_equal(frames, every[[0, 1, 3, 5]])
    assert meta["fps"] == pytest.approx(4 * 4 / 6)
    colours = frames.reshape(4, -1, 3).mean(1)  # lossy, but each frame its own colour
    np.testing.assert_allclose(colours, np.array(COLOURS)[[0, 1, 3, 5]], atol=12)
    for num_frames in (-1, 6, 32):
        (frames, meta), = load_videos([video_url(data)], MediaRules(num_frames=num_frames))
        np.testing.assert_array_equal(frames, every)
        assert meta["fps"] == pytest.approx(4.0)


def test_bad_videos_are_400s_naming_the_problem():
    data = solid_video(COLOURS[:2])
    cases = [
        (MediaRules(), [video_url(b"not a video")], "Video 0 could not be decoded"),
        (MediaRules(), [video_url(data), video_url(b"\0" * 64)], "Video 1 could not be"),
        (MediaRules(), ["data:video/mp4;base64,@@@"], "Video 0: the data: URL is not valid"),
        (MediaRules(), ["http://example.com/v.mp4"], "Video 0: fetching from 'example.com'"),
        (MediaRules(max_bytes=100), [video_url(data)], "Video 0 is too large"),
        (MediaRules(max_videos=1), [video_url(data)] * 2, "At most 1 videos"),
    ]
    for rules, urls, message in cases:
        with pytest.raises(ApiError, match=message) as info:
            load_videos(urls, rules)
        assert info.value.status == 400 and info.value.param == "messages"


def test_media_io_kwargs_set_the_frames_sampled():
    assert EngineConfig(model="m").video_num_frames() == 32  # vLLM's default
    assert EngineConfig(model="m", media_io_kwargs='{"video": {"num_frames": 8}}'
                        ).video_num_frames() == 8
    assert EngineConfig(model="m", media_io_kwargs={"video": {"num_frames": -1}}
                        ).video_num_frames() == -1
    for bad in ('{"video": {"num_frames": 0}}', '{"video": {"fps": 2}}', '{"image": {}}',
                '{"video": {"num_frames": true}}', '[1]', 'nope'):
        with pytest.raises(ConfigError, match="--media-io-kwargs"):
            EngineConfig(model="m", media_io_kwargs=bad)


def test_data_urls_decode_and_bad_ones_are_named():
    image, = load_images([data_url(png_bytes((60, 40)))], MediaRules())
    assert image.size == (60, 40) and image.mode == "RGB"
    cases = [
        (data_url(b"not an image"), "Image 0 could not be decoded"),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png,raw", "must be base64"),
        ("http://example.com/cat.png", "not allowed"),
        ("file:///etc/passwd", "file: URLs are not allowed"),
        ("ftp://x/y.png", "unsupported URL scheme"),
    ]
    for url, message in cases:
        with pytest.raises(ApiError, match=message) as info:
            load_images([url], MediaRules())
        assert info.value.status == 400
    with pytest.raises(ApiError, match="too large"):
        load_images([data_url(png_bytes((300, 300)))], MediaRules(max_bytes=100))
    with pytest.raises(ApiError, match="At most 1 images"):
        load_images([data_url(png_bytes())] * 2, MediaRules(max_images=1))


def test_local_files_only_under_the_allowed_path(tmp_path):
    (tmp_path / "ok.png").write_bytes(png_bytes())
    image, = load_images([f"file://{tmp_path}/ok.png"], MediaRules(local_path=str(tmp_path)))
    assert image.size == (56, 56)
    with pytest.raises(ApiError, match="outside --allowed-local-media-path"):
        load_images([f"file://{tmp_path}/../x.png"], MediaRules(local_path=str(tmp_path)))


@pytest.mark.parametrize("size", [(56, 56), (140, 112), (30, 500), (1000, 700), (13, 40),
                                  (2000, 1500)])
def test_the_gateways_image_token_count_is_the_image_processors(size):
    """/tokenize counts an image's tokens without the image processor (the gateway has no
    torch): the count equals the processor's grid, also where it resizes up or down."""
    from transformers import Qwen2VLImageProcessor

    from common.vision import ImageTokens

    processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 64,
                                      patch_size=14, merge_size=2)
    grid = processor(images=[Image.new("RGB", size)], return_tensors="np")["image_grid_thw"]
    tokens = ImageTokens(7, 14, 2, 56 * 56, 28 * 28 * 64)
    assert tokens.count(*size) == int(grid.prod()) // 4
    assert tokens.expand([1, 7, 2], [size]) == [1] + [7] * tokens.count(*size) + [2]
    with pytest.raises(ApiError, match="too elongated"):
        tokens.count(2010, 10)
    # a video of five such frames: three pairs of frames (the last frame repeated)
    video = ImageTokens(7, 14, 2, 56 * 56, 28 * 28 * 64, video_token_id=8,
                        temporal_patch_size=2)
    assert video.expand([8, 7], [size], [(5, *size)]) == \
        [8] * 3 * tokens.count(*size) + [7] * tokens.count(*size)


def test_llava_images_count_one_crop_each(tmp_path):
    from common.model_files import load_hf_config
    from common.vision import ImageTokens
    from tests.tiny_models import make_tiny_llava

    model_dir = make_tiny_llava(tmp_path)
    tokens = ImageTokens.for_model(model_dir, load_hf_config(model_dir))
    assert tokens is not None and tokens.count(500, 30) == tokens.count(56, 56) == 16


def test_urls_fetch_from_allowed_hosts_and_redirects_stay_there(tmp_path):
    """A local HTTP server: its image loads when 127.0.0.1 is allowed; a redirect from it to
    a host that is not allowed is refused, as a URL to that host would be."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/away":
                self.send_response(302)
                self.send_header("Location", "http://localhost:1/x.png")
                self.end_headers()
                return
            body = png_bytes((40, 30))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        rules = MediaRules(allowed_domains=["127.0.0.1"])
        image, = load_images([f"{base}/cat.png"], rules)
        assert image.size == (40, 30)
        with pytest.raises(ApiError, match="'localhost' is not allowed"):
            load_images([f"{base}/away"], rules)
        with pytest.raises(ApiError, match="too large"):
            load_images([f"{base}/cat.png"], MediaRules(allowed_domains=["127.0.0.1"],
                                                        max_bytes=50))
    finally:
        server.shutdown()
