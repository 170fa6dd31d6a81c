"""The tokenizer stage's image inputs: image_url parts in chat messages (data: URLs, and
http(s) and file: URLs only where allowed), --limit-mm-per-prompt, and every bad input a
400 naming it, before anything reaches the scheduler."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from common.chat import chat_image_urls, plain_conversation
from common.errors import ApiError
from common.media import MediaRules, load_images


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
