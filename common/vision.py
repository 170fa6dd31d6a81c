"""What the torch-free stages know of a vision-language model's images: its placeholder
token and how many placeholders an image of a given size takes, from the image
processor's settings (preprocessor_config.json). The gateway's /tokenize counts image
tokens with it; the tokenizer stage runs the image processor itself
(services/tokenizer/images.py), whose grid this count equals (tests check both).

Gemma 3 frames each image: the prompt's `<start_of_image>` becomes "\n\n",
`<start_of_image>`, the image's tokens, `<end_of_image>`, "\n\n" (transformers'
Gemma3Processor does this to the text); here it is done to the token ids, merging the
newlines with those next to them as Gemma's tokenizer merges newline runs, as vLLM does."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import ApiError

MAX_ASPECT_RATIO = 200  # Qwen2-VL's processor refuses longer sides
LONGEST_NEWLINE_TOKEN = 32  # Gemma's tokenizer has single tokens up to 31 newlines


@dataclass(frozen=True, slots=True)
class ImageFrame:
    """The tokens a model puts around each image (Gemma 3), its placeholder replaced."""
    placeholder: int         # the prompt's token for an image (`<start_of_image>`)
    before: tuple[int, ...]  # "\n\n", <start_of_image>
    after: tuple[int, ...]   # <end_of_image>, "\n\n"
    newlines: dict[int, int]             # a newline token -> the newlines it holds
    runs: dict[int, tuple[int, ...]]     # a count of newlines -> the tokens it encodes to

    @classmethod
    def for_model(cls, hf_config: Any, tokenizer: Any) -> ImageFrame | None:
        """Gemma 3's frame; None for a model whose placeholder is its image token."""
        if getattr(hf_config, "mm_tokens_per_image", None) is None:
            return None
        runs = {n: tuple(tokenizer.encode("\n" * n, add_special_tokens=False))
                for n in range(1, LONGEST_NEWLINE_TOKEN + 1)}
        newlines = {t: len(text) for t in {t for ids in runs.values() for t in ids}
                    if (text := tokenizer.decode([t])) and set(text) == {"\n"}}
        boi, eoi = hf_config.boi_token_id, hf_config.eoi_token_id
        return cls(boi, (*runs[2], boi), (eoi, *runs[2]), newlines, runs)

    def expand(self, ids: Sequence[int], image_token: int, lengths: Sequence[int]
               ) -> tuple[list[int], list[int]]:
        """The prompt with its first len(lengths) placeholders framed around `length`
        image tokens each (a placeholder past them is kept as it is), and where each
        image's tokens start."""
        out: list[int] = []
        offsets: list[int] = []
        start = 0
        slots = [i for i, t in enumerate(ids) if t == self.placeholder][:len(lengths)]
        for slot, length in zip(slots, lengths):
            self._join(out, ids[start:slot], merge=bool(offsets))
            self._join(out, self.before, merge=True)
            offsets.append(len(out))
            out += [image_token] * length
            out += self.after
            start = slot + 1
        self._join(out, ids[start:], merge=bool(offsets))
        return out, offsets

    def _join(self, out: list[int], tokens: Sequence[int], merge: bool) -> None:
        """Append `tokens` to `out`. merge: one side is a frame's, so the newlines where
        they meet become one run, as the tokenizer would have read them (newlines
        elsewhere keep their tokens)."""
        head = 0
        while head < len(tokens) and tokens[head] in self.newlines:
            head += 1
        if not (merge and head and out and out[-1] in self.newlines):
            out += tokens
            return
        count = sum(self.newlines[t] for t in tokens[:head])
        while out and out[-1] in self.newlines:
            count += self.newlines[out.pop()]
        while count > LONGEST_NEWLINE_TOKEN:
            out += self.runs[LONGEST_NEWLINE_TOKEN]
            count -= LONGEST_NEWLINE_TOKEN
        out += self.runs[count]
        out += tokens[head:]


@dataclass(frozen=True, slots=True)
class ImageTokens:
    image_token_id: int
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    fixed: int | None = None  # LLaVA, Gemma 3: every image is one crop of this many tokens
    video_token_id: int | None = None  # None: the model takes no videos
    temporal_patch_size: int = 1  # frames per video patch (Qwen2-VL's 2)
    frame: ImageFrame | None = None  # Gemma 3's tokens around each image

    @classmethod
    def for_model(cls, model_dir: Path, hf_config: Any, tokenizer: Any = None
                  ) -> ImageTokens | None:
        """None for a text-only model. tokenizer: Gemma 3's, for the newlines of its
        frames (a stage that expands prompts passes it)."""
        if getattr(hf_config, "vision_config", None) is None:
            return None
        settings = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        vision = hf_config.vision_config
        tokens = getattr(hf_config, "mm_tokens_per_image", None)
        if tokens is not None:  # Gemma 3: a square crop's patches average-pooled
            side = vision.image_size // vision.patch_size
            return cls(hf_config.image_token_id, vision.patch_size,
                       side // math.isqrt(tokens), 0, 0, fixed=tokens,
                       frame=ImageFrame.for_model(hf_config, tokenizer)
                       if tokenizer is not None else None)
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
        if self.fixed is not None:  # LLaVA's and Gemma 3's square crops
            side = math.isqrt(self.fixed)
            return 1, side * self.merge_size, self.fixed // side * self.merge_size
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
        or framed (Gemma 3), and each video placeholder for its video (frames, width,
        height)."""
        if self.frame is not None:
            if ids.count(self.frame.placeholder) > len(sizes):
                raise ApiError(400, "The prompt has more image placeholders than images.",
                               "messages")
            return self.frame.expand(ids, self.image_token_id,
                                     [self.count(*size) for size in sizes])[0]
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
