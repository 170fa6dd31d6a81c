"""What the torch-free stages know of a vision-language model's images: its placeholder
token and how many placeholders an image of a given size takes, from the image
processor's settings (preprocessor_config.json). The gateway's /tokenize counts image
tokens with it; the tokenizer stage runs the image processor itself
(services/tokenizer/images.py), whose grid this count equals (tests check both)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ApiError

MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses longer sides


@dataclass(frozen=True, slots=True)
class ImageTokens:
    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    fixed: int | None = None  # LLaVA: every image is one crop of this many tokens
    video_token_id: int | None = None  # None: the model takes no videos
    temporal_patch_size: int = 1  # frames per video patch (Qwen2-VL's 2)

    @classmethod
    def for_model(cls, model_dir: Path, hf_config: Any) -> ImageTokens | None:
        """None for a text-only model."""
        if getattr(hf_config, "vision_config", None) is None:
            return None
        settings = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        vision = hf_config.vision_config
        if getattr(vision, "spatial_merge_size", None) is None:  # LLaVA's crops
            crop = settings.get("crop_size") or {}
            side = crop.get("height", vision.image_size) // vision.patch_size
            return cls(hf_config.image_token_id, vision.patch_size, 1, 0, 0,
                       fixed=side * (crop.get("width", vision.image_size) // vision.patch_size))
        size = settings.get("size") or {}
        return cls(hf_config.image_token_id, settings.get("patch_size", 14),
                   settings.get("merge_size", 2),
                   size.get("shortest_edge", settings.get("min_pixels", 56 * 56)),
                   size.get("longest_edge", settings.get("max_pixels", 28 * 28 * 1280)),
                   video_token_id=getattr(hf_config, "video_token_id", None),
                   temporal_patch_size=getattr(vision, "temporal_patch_size", 1))

    def count(self, width: int, height: int) -> int:
        """Placeholders of one image: its patches after resizing, merged."""
        if self.fixed is not None:
            return self.fixed
        h, w = self.resized(height, width)
        return (h // self.patch_size) * (w // self.patch_size) // self.merge_size ** 2

    def largest_grid(self) -> tuple[int, int, int]:
        """The patch grid (time, rows, columns) of an image with the most placeholders
        the processor can give one: max_pixels' worth of merged patches, as near a square
        as they go."""
        if self.fixed is not None:  # LLaVA's square crops
            side = math.isqrt(self.fixed)
            return 1, side, self.fixed // side
        tokens = self.max_pixels // (self.patch_size * self.merge_size) ** 2
        rows = math.isqrt(tokens)
        return 1, rows * self.merge_size, tokens // rows * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """The image processor's size for an image: sides multiples of patch x merge, the
        area within [min_pixels, max_pixels], the aspect ratio kept as well as that
        allows."""
        if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise ApiError(400, f"An image of {width}x{height} pixels is too elongated (the "
                                f"longer side at most {MAX_ASPECT_RATIO} times the shorter).",
                           "messages")
        factor = self.patch_size * self.merge_size
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h = max(factor, math.floor(height / beta / factor) * factor)
            w = max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h = math.ceil(height * beta / factor) * factor
            w = math.ceil(width * beta / factor) * factor
        return h, w

    def video_count(self, frames: int, width: int, height: int) -> int:
        """Placeholders of one video: each frame's as an image's, its frames taken
        temporal_patch_size at a time (an odd last one repeated to fill its group)."""
        return -(-frames // self.temporal_patch_size) * self.count(width, height)

    def expand(self, ids: list[int], sizes: list[tuple[int, int]],
               videos: list[tuple[int, int, int]] = ()) -> list[int]:
        """The prompt with each image placeholder repeated for its image (width, height),
        and each video placeholder for its video (frames, width, height)."""
        out: list[int] = []
        images, clips = iter(sizes), iter(videos)
        for token in ids:
            if token == self.image_token_id:
                out += [token] * self.count(*_next(images, "image"))
            elif token == self.video_token_id:
                out += [token] * self.video_count(*_next(clips, "video"))
            else:
                out.append(token)
        return out


def _next(items: Any, kind: str) -> Any:
    item = next(items, None)
    if item is None:
        raise ApiError(400, f"The prompt has more {kind} placeholders than {kind}s.",
                       "messages")
    return item
