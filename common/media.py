"""Image and video URLs into images and frames: base64 `data:` URLs always; http(s) URLs
only on a host of --allowed-media-domains, file:// URLs only under
--allowed-local-media-path; each within --max-image-bytes and (fetched)
--media-fetch-timeout. A video is decoded with PyAV and --media-io-kwargs' num_frames of
its frames are sampled uniformly, as vLLM's video loader does. Every refusal is a 400
naming the image or video and the reason. A fetch or a decode blocks its caller, which the
tokenizer shell runs in a thread, off its event loop; the gateway's /tokenize runs it in a
thread too."""

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

from common.config import DEFAULT_VIDEO_FRAMES
from common.errors import ApiError

FIELD = "messages"
# A frame's most pixels: PIL's decompression-bomb bound on images (a few bytes of video
# may claim huge frames, each held as RGB)
MAX_FRAME_PIXELS = 89_478_485


@dataclass(frozen=True, slots=True)
class MediaRules:
    allowed_domains: list[str] = field(default_factory=list)
    local_path: str | None = None
    timeout: float = 5.0
    max_bytes: int = 20 * 2 ** 20
    max_images: int | None = None  # --limit-mm-per-prompt's image count
    max_videos: int | None = None  # and its video count
    num_frames: int = DEFAULT_VIDEO_FRAMES  # sampled per video; -1: every frame

    @classmethod
    def from_config(cls, config: Any) -> MediaRules:
        limits = config.mm_limits()
        return cls(list(config.allowed_media_domains), config.allowed_local_media_path,
                   config.media_fetch_timeout, config.max_image_bytes,
                   limits.get("image"), limits.get("video"), config.video_num_frames())


def load_images(urls: list[str], rules: MediaRules) -> list[Any]:
    """The images the URLs hold, as RGB PIL images, in order."""
    _check_count(len(urls), rules.max_images, "images")
    return [decode_image(image_bytes(url, i, rules), i) for i, url in enumerate(urls)]


def load_videos(urls: list[str], rules: MediaRules) -> list[tuple[Any, dict[str, float]]]:
    """The videos the URLs hold, in order, each as the offline API takes one: (frames,
    {"fps": the sampled frames' rate}), frames a uint8 array [T, H, W, 3]."""
    _check_count(len(urls), rules.max_videos, "videos")
    return [decode_video(image_bytes(url, i, rules, "Video"), i, rules.num_frames)
            for i, url in enumerate(urls)]


def _check_count(count: int, most: int | None, kind: str) -> None:
    if most is not None and count > most:
        raise ApiError(400, f"At most {most} {kind} may be given per prompt "
                            f"(--limit-mm-per-prompt); got {count}.", FIELD)


def image_bytes(url: str, i: int, rules: MediaRules, kind: str = "Image") -> bytes:
    """The encoded bytes an image's (or, kind "Video", a video's) URL holds."""
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        data = _data_url(url, i, rules, kind)
    elif scheme in ("http", "https"):
        data = _fetch(url, i, rules, kind)
    elif scheme == "file":
        data = _local_file(url, i, rules, kind)
    else:
        raise ApiError(400, f"{kind} {i}: unsupported URL scheme {scheme or '(none)'!r}; "
                            "give a data:, http(s): or file: URL.", FIELD)
    if len(data) > rules.max_bytes:
        raise ApiError(400, f"{kind} {i} is too large: more than {rules.max_bytes} bytes "
                            "(--max-image-bytes).", FIELD)
    return data


def _data_url(url: str, i: int, rules: MediaRules, kind: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ApiError(400, f"{kind} {i}: a data: URL must be base64 "
                            f"(data:{kind.lower()}/...;base64,...).", FIELD)
    if len(payload) * 3 // 4 > rules.max_bytes:  # before decoding it
        raise ApiError(400, f"{kind} {i} is too large: more than {rules.max_bytes} bytes "
                            "(--max-image-bytes).", FIELD)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{kind} {i}: the data: URL is not valid base64.",
                       FIELD) from None


def _fetch(url: str, i: int, rules: MediaRules, kind: str) -> bytes:
    _check_host(url, i, rules, kind)
    opener = urllib.request.build_opener(_CheckedRedirects(i, rules, kind))
    try:
        with opener.open(url, timeout=rules.timeout) as response:
            data = response.read(rules.max_bytes + 1)
    except (urllib.error.URLError, TimeoutError, OSError) as e:
        raise ApiError(400, f"{kind} {i}: could not fetch {url}: {e}", FIELD) from None
    return data


def _check_host(url: str, i: int, rules: MediaRules, kind: str) -> None:
    host = (urlparse(url).hostname or "").lower()
    if host not in {d.lower() for d in rules.allowed_domains}:
        raise ApiError(400, f"{kind} {i}: fetching from {host!r} is not allowed (the server "
                            f"takes {kind.lower()} URLs only from --allowed-media-domains).",
                       FIELD)


class _CheckedRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is followed only to an allowed host too."""

    def __init__(self, i: int, rules: MediaRules, kind: str) -> None:
        self.i, self.rules, self.kind = i, rules, kind

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        _check_host(newurl, self.i, self.rules, self.kind)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _local_file(url: str, i: int, rules: MediaRules, kind: str) -> bytes:
    if rules.local_path is None:
        raise ApiError(400, f"{kind} {i}: file: URLs are not allowed (the server takes them "
                            "only under --allowed-local-media-path).", FIELD)
    root = Path(rules.local_path).resolve()
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(root):
        raise ApiError(400, f"{kind} {i}: {path} is outside --allowed-local-media-path.",
                       FIELD)
    if not path.is_file():
        raise ApiError(400, f"{kind} {i}: no file {path}.", FIELD)
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


def decode_video(data: bytes, i: int, num_frames: int) -> tuple[Any, dict[str, float]]:
    """A video's frames, num_frames of them sampled uniformly over the whole video (its
    first and last among them; every frame if it has no more, or num_frames is -1), and
    the rate of the frames sampled: the video's own rate scaled by the share kept, so the
    frames keep their times (Qwen2.5-VL's time positions follow them). Only the frames
    sampled are converted to RGB and held."""
    import av
    import numpy as np

    try:
        total = _frame_count(data, i)
        picked = set(range(total) if num_frames == -1 or total <= num_frames else
                     np.linspace(0, total - 1, num_frames).astype(int).tolist())
        with av.open(io.BytesIO(data)) as container:
            stream = _video_stream(container, i)
            rate = float(stream.average_rate or stream.guessed_rate or 0)
            frames = [frame.to_ndarray(format="rgb24")
                      for k, frame in enumerate(container.decode(stream)) if k in picked]
        if not frames:
            raise ValueError("it has no frames")
        video = np.stack(frames)  # ValueError if the frames' size changes midway
    except (av.FFmpegError, ValueError, OSError) as e:  # FFmpegError: av.error's base
        raise ApiError(400, f"Video {i} could not be decoded: {e}", FIELD) from None
    fps = rate * len(frames) / total if rate > 0 else 0.0
    return video, ({"fps": fps} if fps else {})


def _frame_count(data: bytes, i: int) -> int:
    """The video's frames: as its container says (mp4 does), else counted by decoding
    (webm does not say)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = _video_stream(container, i)
        if stream.width * stream.height > MAX_FRAME_PIXELS:
            raise ApiError(400, f"Video {i} is too large: frames of {stream.width}x"
                                f"{stream.height} pixels (at most {MAX_FRAME_PIXELS}).",
                           FIELD)
        return stream.frames or sum(1 for _ in container.decode(stream))


def _video_stream(container: Any, i: int) -> Any:
    if not container.streams.video:
        raise ApiError(400, f"Video {i} could not be decoded: it has no video stream.",
                       FIELD)
    return container.streams.video[0]
