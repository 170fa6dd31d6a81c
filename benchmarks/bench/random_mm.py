"""vLLM's random-mm dataset for `headrace bench serve`: each chat request is a text of random
words followed by images of random pixels, sent as OpenAI `image_url` parts holding base64
`data:image/jpeg` URLs.

The images per request are uniform in [floor(n * (1 - r)), ceil(n * (1 + r))] (n
--random-mm-base-items-per-request, r --random-mm-num-mm-items-range-ratio), at most the
image limit of --random-mm-limit-mm-per-prompt; each image's size is drawn from
--random-mm-bucket-config, vLLM's {(height, width, frames): probability} (zero-probability
buckets dropped, the rest renormalized). Pixels are independent and uniform, so the JPEGs
are as large as photos of their size get (the upload and the decoding at their worst), and
no two images of a run are the same (no encoder or prefix cache hit between requests).
Everything is drawn from --seed before the timed run: encoding a 1024x1024 JPEG takes tens
of milliseconds, which would otherwise count as the server's latency.
"""

from __future__ import annotations

import ast
import base64
import io
import json
import math
import random
from dataclasses import dataclass

import numpy as np

# vLLM's defaults (vllm/benchmarks/datasets): up to 255 images a prompt, half of them
# 256x256 and half 720x1280; its zero-probability video bucket is left out here
DEFAULT_LIMIT_MM_PER_PROMPT = '{"image": 255, "video": 1}'
DEFAULT_BUCKET_CONFIG = "{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}"
IMAGE_SEED_STREAM = 1  # the pixels' numpy stream, apart from the lengths' random.Random


class DatasetError(ValueError):
    """A random-mm setting that cannot make a dataset; the message names the flag."""


@dataclass(frozen=True, slots=True)
class ImageBucket:
    height: int
    width: int
    probability: float


@dataclass(frozen=True, slots=True)
class MultimodalSpec:
    """What the random-mm flags ask for, checked."""
    min_items: int
    max_items: int
    buckets: tuple[ImageBucket, ...]

    @classmethod
    def of(cls, base_items: int, range_ratio: float, limit_text: str, bucket_text: str
           ) -> MultimodalSpec:
        if base_items < 0:
            raise DatasetError("--random-mm-base-items-per-request must be at least 0, "
                               f"got {base_items}")
        if not 0 <= range_ratio <= 1:
            raise DatasetError("--random-mm-num-mm-items-range-ratio must be in [0, 1], "
                               f"got {range_ratio}")
        limit = parse_image_limit(limit_text)
        low = math.floor(base_items * (1 - range_ratio))
        high = min(limit, math.ceil(base_items * (1 + range_ratio)))
        if low > high:
            raise DatasetError(f"--random-mm-base-items-per-request {base_items} asks for "
                               f"at least {low} images a request, above the image limit "
                               f"{limit} of --random-mm-limit-mm-per-prompt")
        return cls(low, high, parse_buckets(bucket_text))


def parse_image_limit(text: str) -> int:
    """--random-mm-limit-mm-per-prompt: a JSON object of modality -> most items, as vLLM's
    serve flag of the same name; the image limit is what counts here."""
    try:
        limits = json.loads(text)
    except ValueError as e:
        raise DatasetError(f"--random-mm-limit-mm-per-prompt must be a JSON object such as "
                           f"'{{\"image\": 1}}' ({e}), got {text!r}") from None
    if not isinstance(limits, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for v in limits.values()):
        raise DatasetError("--random-mm-limit-mm-per-prompt must map modalities to counts "
                           f"of at least 0, such as '{{\"image\": 1}}', got {text!r}")
    if "image" not in limits:
        raise DatasetError(f"--random-mm-limit-mm-per-prompt {text!r} sets no image limit; "
                           "the buckets are images")
    return limits["image"]


def parse_buckets(text: str) -> tuple[ImageBucket, ...]:
    """--random-mm-bucket-config, vLLM's Python dict literal of (height, width, frames) ->
    probability, e.g. '{(1024, 1024, 1): 1.0}'. Frames above 1 are videos, which this
    benchmark does not make: a bucket of them with a probability above 0 is refused."""
    flag = "--random-mm-bucket-config"
    try:
        config = ast.literal_eval(text)
    except (ValueError, SyntaxError) as e:
        raise DatasetError(f"{flag} must be a dict literal such as '{{(1024, 1024, 1): 1.0}}' "
                           f"({type(e).__name__}), got {text!r}") from None
    if not isinstance(config, dict) or not config:
        raise DatasetError(f"{flag} must be a non-empty dict of (height, width, frames) -> "
                           f"probability, got {text!r}")
    buckets = []
    for key, probability in config.items():
        if not (isinstance(key, tuple) and len(key) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                        for v in key)):
            raise DatasetError(f"{flag}: each key must be (height, width, frames) of positive "
                               f"integers, got {key!r}")
        if not isinstance(probability, (int, float)) or isinstance(probability, bool) \
                or not probability >= 0:
            raise DatasetError(f"{flag}: the probability of {key} must be a number of at "
                               f"least 0, got {probability!r}")
        if probability == 0:
            continue
        height, width, frames = key
        if frames > 1:
            raise DatasetError(f"{flag}: {key} is a video bucket ({frames} frames); this "
                               "benchmark sends images only (frames 1)")
        buckets.append(ImageBucket(height, width, float(probability)))
    if not buckets:
        raise DatasetError(f"{flag}: every probability is 0, got {text!r}")
    total = sum(b.probability for b in buckets)
    return tuple(ImageBucket(b.height, b.width, b.probability / total) for b in buckets)


def image_sizes(spec: MultimodalSpec, rng: random.Random, n: int
                ) -> list[list[tuple[int, int]]]:
    """Each request's images as (height, width), drawn from the buckets."""
    sizes = [(b.height, b.width) for b in spec.buckets]
    weights = [b.probability for b in spec.buckets]
    return [rng.choices(sizes, weights, k=rng.randint(spec.min_items, spec.max_items))
            for _ in range(n)]


def random_jpeg_url(pixels: np.random.Generator, height: int, width: int) -> str:
    """A data URL of a JPEG of uniform random pixels (PIL's default quality, as vLLM's)."""
    from PIL import Image

    array = pixels.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_urls(sizes: list[list[tuple[int, int]]], seed: int) -> list[tuple[str, ...]]:
    """Each request's images as data URLs, their pixels drawn from `seed`."""
    pixels = np.random.default_rng([seed, IMAGE_SEED_STREAM])
    return [tuple(random_jpeg_url(pixels, h, w) for h, w in request) for request in sizes]
