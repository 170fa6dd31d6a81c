"""Images into a prompt, for a vision-language model: the tokenizer stage's CPU work.

The model's own image processor (transformers', from preprocessor_config.json) resizes
and normalizes each image and cuts it into patches; each image's one placeholder token in
the prompt (`<|image_pad|>` for Qwen2-VL, config.image_token_id) becomes as many
placeholders as the image has merged patches (Gemma 3: its `<start_of_image>` becomes the
framed image tokens, common.vision.ImageFrame; pan-and-scan crops off, as vLLM's default),
and the patches travel with the request
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
from common.vision import ImageFrame


DEFAULT_VIDEO_FPS = 2.0  # frames given without their rate (Qwen2.5-VL's processor's default)


class ImagePrompts:
    def __init__(self, image_processor: Any, image_token_id: int, merge: int,
                 patch_size: int, video_token_id: int | None = None,
                 temporal_patch_size: int = 1, frame: ImageFrame | None = None) -> None:
        """merge: patches per token along each side (Qwen2-VL's 2, LLaVA's 1, Gemma 3's
        pooling); video_token_id: the video placeholder of a model that takes videos
        (Qwen2-VL's frames go in pairs: temporal_patch_size 2); frame: the tokens around
        each image (Gemma 3), whose placeholder is then not the image token."""
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.merge = merge
        self.patch_size = patch_size
        self.video_token_id = video_token_id
        self.temporal_patch_size = temporal_patch_size
        self.frame = frame
        # Gemma 3's processor may crop an image into several (pan and scan); vLLM keeps
        # it off unless asked, and so does this
        self.options = {"do_pan_and_scan": False} if frame is not None else {}

    @classmethod
    def for_model(cls, model_dir: Path, hf_config: Any, tokenizer: Any = None
                  ) -> ImagePrompts | None:
        """The model's image processing, None for a text-only model; tokenizer: the
        model's (Gemma 3 frames its images with newlines)."""
        vision = getattr(hf_config, "vision_config", None)
        if vision is None:
            return None
        from transformers import AutoImageProcessor

        tokens = getattr(hf_config, "mm_tokens_per_image", None)
        merge = getattr(vision, "spatial_merge_size", 1)
        if tokens is not None:  # Gemma 3: patches average-pooled to tokens
            merge = vision.image_size // vision.patch_size // int(tokens ** 0.5)
        return cls(AutoImageProcessor.from_pretrained(model_dir), hf_config.image_token_id,
                   merge, vision.patch_size, getattr(hf_config, "video_token_id", None),
                   getattr(vision, "temporal_patch_size", 1),
                   ImageFrame.for_model(hf_config, tokenizer) if tokenizer is not None
                   else None)

    def expand(self, ids: list[int], images: list[Any], videos: list[Any] = ()
               ) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image's and video's placeholder repeated for its tokens,
        and the images and videos as the worker takes them. `images`: PIL images, in
        placeholder order; `videos`: each an array of frames [T, H, W, 3] (or a list of
        frames), or (frames, {"fps": ...}) as vLLM takes them."""
        if self.frame is not None:
            return self._framed(ids, images)
        items = dict(zip(self._slots(ids, self.image_token_id, len(images), "image"),
                         self._images(images)))
        if videos or self.video_token_id is not None:
            items.update(zip(self._slots(ids, self.video_token_id, len(videos), "video"),
                             map(self._video, videos)))
        out_ids: list[int] = []
        inputs: list[ImageInput] = []
        done = 0
        for slot in sorted(items):
            (t, h, w), pixels, second_per_grid_t = items[slot]
            out_ids += ids[done:slot]
            length = t * h * w // self.merge ** 2
            inputs.append(ImageInput(hash=image_hash(pixels, (t, h, w), second_per_grid_t),
                                     offset=len(out_ids),
                                     length=length, grid_thw=[t, h, w],
                                     pixels=pixels.tobytes(),
                                     second_per_grid_t=second_per_grid_t))
            out_ids += [ids[slot]] * length
            done = slot + 1
        return out_ids + ids[done:], inputs

    def _framed(self, ids: list[int], images: list[Any]) -> tuple[list[int], list[ImageInput]]:
        """Gemma 3: each `<start_of_image>` framed around its image's tokens."""
        assert self.frame is not None
        self._slots(ids, self.frame.placeholder, len(images), "image")
        processed = self._images(images)
        lengths = [t * h * w // self.merge ** 2 for (t, h, w), _, _ in processed]
        out_ids, offsets = self.frame.expand(ids, self.image_token_id, lengths)
        return out_ids, [ImageInput(hash=image_hash(pixels, grid), offset=offset,
                                    length=length, grid_thw=list(grid),
                                    pixels=pixels.tobytes(), bidirectional=True)
                         for (grid, pixels, _), offset, length
                         in zip(processed, offsets, lengths)]

    @staticmethod
    def _slots(ids: list[int], token: int | None, count: int, kind: str) -> list[int]:
        slots = [i for i, t in enumerate(ids) if t == token] if token is not None else []
        if token is None and count:
            raise ApiError(400, f"This model takes no {kind}s.", "multi_modal_data")
        if len(slots) != count:
            raise ApiError(400, f"The prompt has {len(slots)} {kind} placeholders "
                                f"(token {token}) but {count} {kind}s were given.",
                           "multi_modal_data")
        return slots

    def _images(self, images: list[Any]) -> list[tuple[tuple[int, int, int], np.ndarray, float]]:
        if not images:
            return []
        try:
            processed = self.image_processor(images=images, return_tensors="np",
                                             **self.options)
        except ValueError as e:  # e.g. an image too elongated for the processor
            raise ApiError(400, f"An image could not be processed: {e}", "messages") from None
        return [(grid, pixels, 0.0) for grid, pixels in self._per_image(processed)]

    def _video(self, video: Any) -> tuple[tuple[int, int, int], np.ndarray, float]:
        """A video's patches: each frame resized and normalized as the image processor
        does an image, and the frames taken in groups of temporal_patch_size (the last
        repeated to fill the final group), each group's patches holding its frames side
        by side on the time axis, as Qwen2-VL's video processor lays them out."""
        frames, meta = video if isinstance(video, tuple) else (video, {})
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[0] == 0 or frames.shape[-1] != 3:
            raise ApiError(400, "A video must be frames [T, H, W, 3], got an array of shape "
                                f"{list(frames.shape)}.", "multi_modal_data")
        fps = float(meta.get("fps") or DEFAULT_VIDEO_FPS)
        group = self.temporal_patch_size
        frames = np.concatenate([frames, frames[-1:].repeat(-len(frames) % group, axis=0)])
        processed = self._images(list(frames))
        _, h, w = processed[0][0]  # every frame has the first's size
        per_frame = [pixels.reshape(h * w, -1, group, self.patch_size, self.patch_size)[:, :, 0]
                     for _, pixels, _ in processed]
        steps = [np.stack(per_frame[i:i + group], axis=2).reshape(h * w, -1)
                 for i in range(0, len(per_frame), group)]
        return (len(steps), h, w), np.ascontiguousarray(np.concatenate(steps)), group / fps

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


def image_hash(patches: np.ndarray, grid: tuple[int, int, int],
               second_per_grid_t: float = 0.0) -> str:
    """The content hash of a processed image or video: its patches, their grid and (a
    video's) time spacing, which moves its tokens' positions and so their KV."""
    digest = hashlib.sha256(np.asarray(grid, dtype="<i8").tobytes())
    if second_per_grid_t:
        digest.update(np.float64(second_per_grid_t).tobytes())
    digest.update(patches.tobytes())
    return digest.hexdigest()
