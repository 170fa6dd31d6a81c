"""Image URLs into images: base64 `data:` URLs always; http(s) URLs only on a host of
--allowed-media-domains, file:// URLs only under --allowed-local-media-path; each within
--max-image-bytes and (fetched) --media-fetch-timeout. Every refusal is a 400 naming the
image and the reason. A fetch blocks its caller, which the tokenizer shell runs in a
thread, off its event loop; the gateway's /tokenize runs it in a thread too."""

from __future__ import annotations

import base64
import binascii
import io
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from common.errors import ApiError

FIELD = "messages"


@dataclass(frozen=True, slots=True)
class MediaRules:
    allowed_domains: list[str] = field(default_factory=list)
    local_path: str | None = None
    timeout: float = 5.0
    max_bytes: int = 20 * 2 ** 20
    max_images: int | None = None  # --limit-mm-per-prompt's image count

    @classmethod
    def from_config(cls, config: Any) -> MediaRules:
        return cls(list(config.allowed_media_domains), config.allowed_local_media_path,
                   config.media_fetch_timeout, config.max_image_bytes,
                   config.mm_limits().get("image"))


def load_images(urls: list[str], rules: MediaRules) -> list[Any]:
    """The images the URLs hold, as RGB PIL images, in order."""
    if rules.max_images is not None and len(urls) > rules.max_images:
        raise ApiError(400, f"At most {rules.max_images} images may be given per prompt "
                            f"(--limit-mm-per-prompt); got {len(urls)}.", FIELD)
    return [decode_image(image_bytes(url, i, rules), i) for i, url in enumerate(urls)]


def image_bytes(url: str, i: int, rules: MediaRules) -> bytes:
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, i, rules)
    elif scheme in ("http", "https"):
        data = _fetch(url, i, rules)
    elif scheme == "file":
        data = _local_file(url, i, rules)
    else:
        raise ApiError(400, f"Image {i}: unsupported URL scheme {scheme or '(none)'!r}; "
                            "give a data:, http(s): or file: URL.", FIELD)
    if len(data) > rules.max_bytes:
        raise ApiError(400, f"Image {i} is too large: more than {rules.max_bytes} bytes "
                            "(--max-image-bytes).", FIELD)
    return data


def _data_url(url: str, i: int, rules: MediaRules) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(400, f"Image {i}: a data: URL must be base64 "
                            "(data:image/...;base64,...).", FIELD)
    if len(payload) * 3 // 4 > rules.max_bytes:  # before decoding it
        raise ApiError(400, f"Image {i} is too large: more than {rules.max_bytes} bytes "
                            "(--max-image-bytes).", FIELD)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"Image {i}: the data: URL is not valid base64.", FIELD) from None


def _fetch(url: str, i: int, rules: MediaRules) -> bytes:
    _check_host(url, i, rules)
    opener = urllib.request.build_opener(_CheckedRedirects(i, rules))
    try:
        with opener.open(url, timeout=rules.timeout) as response:
            data = response.read(rules.max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ApiError(400, f"Image {i}: could not fetch {url}: {e}", FIELD) from None
    return data


def _check_host(url: str, i: int, rules: MediaRules) -> None:
    host = (urlparse(url).hostname or "").lower()
    if host not in {d.lower() for d in rules.allowed_domains}:
        raise ApiError(400, f"Image {i}: fetching from {host!r} is not allowed (the server "
                            "takes image URLs only from --allowed-media-domains).", FIELD)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to an allowed host too."""

    def __init__(self, i: int, rules: MediaRules) -> None:
        self.i, self.rules = i, rules

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.i, self.rules)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _local_file(url: str, i: int, rules: MediaRules) -> bytes:
    if rules.local_path is None:
        raise ApiError(400, f"Image {i}: file: URLs are not allowed (the server takes them "
                            "only under --allowed-local-media-path).", FIELD)
    root = Path(rules.local_path).resolve()
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(root):
        raise ApiError(400, f"Image {i}: {path} is outside --allowed-local-media-path.",
                       FIELD)
    if not path.is_file():
        raise ApiError(400, f"Image {i}: no file {path}.", FIELD)
    with path.open("rb") as f:
        return f.read(rules.max_bytes + 1)


def decode_image(data: bytes, i: int) -> Any:
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ApiError(400, f"Image {i} could not be decoded: {e}", FIELD) from None
    return image.convert("RGB")
