"""Images into a prompt, for a vision-language model: the tokenizer stage's CPU work.

The model's own image processor (transformers', from preprocessor_config.json) resizes
and normalizes each image and cuts it into patches; each image's one placeholder token in
the prompt (`<|image_pad|>` for Qwen2-VL, config.image_token_id) becomes as many
placeholders as the image has merged patches, and the patches travel with the request
(common.messages.ImageInput) for the worker's vision encoder. The image processor imports
torch through transformers, so only a vision-language model's tokenizer loads it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import ApiError
from common.messages import ImageInput


class ImagePrompts:
    def __init__(self, image_processor: Any, image_token_id: int, merge: int,
                 patch_size: int) -> None:
        """merge: patches per token along each side (Qwen2-VL's 2, LLaVA's 1)."""
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge = merge
        self.patch_size = patch_size

    @classmethod
    def for_model(cls, model_dir: Path, hf_config: Any) -> ImagePrompts | None:
        """The model's image processing, None for a text-only model."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            return None
        from transformers import AutoImageProcessor

        return cls(AutoImageProcessor.from_pretrained(model_dir), hf_config.image_token_id,
                   getattr(vision, "spatial_merge_size", 1), vision.patch_size)

    def expand(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's placeholder repeated for its tokens, and the
        images as the worker takes them. `images`: PIL images, in placeholder order."""
        slots = [i for i, token in enumerate(ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise ApiError(400, f"The prompt has {len(slots)} image placeholders "
                                f"(token {self.image_token_id}) but {len(images)} images "
                                "were given.", "multi_modal_data")
        if not images:
            return ids, []
        try:
            processed = self.image_processor(images=images, return_tensors="np")
        except ValueError as e:  # e.g. an image too elongated for the processor
            raise ApiError(400, f"An image could not be processed: {e}", "messages") from None
        out_ids: list[int] = []
        inputs: list[ImageInput] = []
        done = 0
        for slot, (grid, pixels) in zip(slots, self._per_image(processed)):
            t, h, w = grid
            out_ids += ids[done:slot]
            length = t * h * w // self.merge ** 2
            inputs.append(ImageInput(hash=image_hash(pixels, grid), offset=len(out_ids),
                                     length=length, grid_thw=list(grid),
                                     pixels=pixels.tobytes()))
            out_ids += [self.image_token_id] * length
            done = slot + 1
        return out_ids + ids[done:], inputs

    def _per_image(self, processed: Any) -> list[tuple[tuple[int, int, int], np.ndarray]]:
        """Each image's patch grid (time, rows, columns) and pixels: Qwen2-VL's processor
        gives every image's patches as rows of one array, with the grids; a CLIP
        processor (LLaVA) one [C, H, W] crop per image."""
        pixels = np.ascontiguousarray(processed["pixel_values"], dtype="<f4")
        if "image_grid_thw" not in processed:
            _, _, height, width = pixels.shape
            grid = (1, height // self.patch_size, width // self.patch_size)
            return [(grid, image) for image in pixels]
        out, first = [], 0
        for t, h, w in np.asarray(processed["image_grid_thw"]).tolist():
            out.append(((t, h, w), pixels[first:first + t * h * w]))
            first += t * h * w
        return out


def image_hash(patches: np.ndarray, grid: tuple[int, int, int]) -> str:
    """The content hash of a processed image: its patches and their grid."""
    digest = hashlib.sha256(np.asarray(grid, dtype="<i8").tobytes())
    digest.update(patches.tobytes())
    return digest.hexdigest()
