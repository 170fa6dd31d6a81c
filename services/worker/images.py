"""A vision-language step's images: which image embedding rows go to which of the step's
tokens, and the encoder outputs they come from.

A request's image placeholders may be computed over several steps (chunked prefill cuts
anywhere), and the prefix cache may skip some of them; the step takes the rows of each
image that fall in its chunk. The vision encoder runs inside the step, for the images of
the step that no live request has encoded yet, in one call; an image's embeddings stay
cached under its content hash while a request that holds the image lives, so a long
prompt's chunks and identical images of concurrent requests encode once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from common.messages import ImageInput
from services.worker.request_state import RequestState

# patches and grids of images -> each image's token embeddings
Encoder = Callable[[torch.Tensor, list[tuple[int, int, int]]], list[torch.Tensor]]


@dataclass(frozen=True, slots=True)
class ImageSlice:
    """Rows [first, first + count) of `image`'s embeddings, for the step's tokens from
    batch index `token`."""
    image: ImageInput
    first: int
    count: int
    token: int


def step_image_slices(states: list[RequestState], query_start_loc: np.ndarray,
                      num_computed: np.ndarray, num_scheduled: np.ndarray
                      ) -> list[ImageSlice]:
    """The image rows each request's chunk of the step covers."""
    slices = []
    for i, state in enumerate(states):
        start, end = int(num_computed[i]), int(num_computed[i] + num_scheduled[i])
        for image in state.images:
            lo, hi = max(start, image.offset), min(end, image.offset + image.length)
            if lo < hi:
                slices.append(ImageSlice(image, lo - image.offset, hi - lo,
                                         int(query_start_loc[i]) + lo - start))
    return slices


def key_limits(slices: list[ImageSlice], positions: np.ndarray) -> np.ndarray | None:
    """The last context position each of the step's tokens attends to, where an image's
    tokens attend both ways (Gemma 3): its image's last; others their own. None when no
    such image is in the step. The scheduler computes each such image in one step
    (services/scheduler/core.py), so the keys up to its last are all there."""
    both_ways = [s for s in slices if s.image.bidirectional]
    if not both_ways:
        return None
    limits = positions.astype(np.int32)
    for s in both_ways:
        if s.first + s.count != s.image.length:
            raise ValueError(f"a step cut image {s.image.hash[:12]}, whose tokens attend "
                             "both ways, before its last token")
        limits[s.token:s.token + s.count] = s.image.offset + s.image.length - 1
    return limits


class EncoderCache:
    """Image embeddings by content hash, each kept while a request holding it lives."""

    def __init__(self, patch_dim: int, device: torch.device) -> None:
        self.patch_dim = patch_dim
        self.device = device
        self.embeds: dict[str, torch.Tensor] = {}
        self.holders: dict[str, set[str]] = {}  # hash -> ids of the live requests with it
        self.encoded = 0  # images the encoder ran on (tests count them)

    def hold(self, state: RequestState) -> None:
        for image in state.images:
            self.holders.setdefault(image.hash, set()).add(state.req_id)

    def release(self, state: RequestState) -> None:
        for image in state.images:
            holders = self.holders.get(image.hash)
            if holders is None:
                continue
            holders.discard(state.req_id)
            if not holders:
                del self.holders[image.hash]
                self.embeds.pop(image.hash, None)

    def rows(self, slices: list[ImageSlice], encode: Encoder
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, embedding rows) of the step's slices, encoding the images not
        cached yet in one call."""
        if not slices:
            return None
        missing = list({s.image.hash: s.image for s in slices
                        if s.image.hash not in self.embeds}.values())
        if missing:
            patches = torch.cat([patches_of(image, self.patch_dim) for image in missing])
            grids = [tuple(image.grid_thw) for image in missing]
            for image, embeds in zip(missing, encode(patches.to(self.device), grids)):
                self.embeds[image.hash] = embeds
            self.encoded += len(missing)
        index = np.concatenate([np.arange(s.token, s.token + s.count) for s in slices])
        rows = torch.cat([self.embeds[s.image.hash][s.first:s.first + s.count]
                          for s in slices])
        return torch.from_numpy(index).to(self.device), rows


def profile_image_grids(largest: tuple[int, int, int], merge: int, num_tokens: int,
                        most: int | None) -> list[tuple[int, int, int]]:
    """The images whose encoding a step of `num_tokens` may hold at once, at their largest
    (`largest`, a patch grid): a chunk encodes every image it touches whole, so it may
    touch one more than its tokens fill, cut at each end; `most`: the most images a step
    may have (--limit-mm-per-prompt's images times --max-num-seqs), None if unbounded."""
    if most == 0:
        return []
    t, h, w = largest
    per_image = t * h * w // merge ** 2
    count = -(-(num_tokens - 1) // per_image) + 1
    return [largest] * max(1, count if most is None else min(count, most))


def patches_of(image: ImageInput, patch_dim: int) -> torch.Tensor:
    """An image's patches from its message bytes (little-endian float32 rows)."""
    if not image.pixels:
        raise ValueError(f"image {image.hash[:12]} reached the worker without its pixels")
    return torch.frombuffer(bytearray(image.pixels), dtype=torch.float32).view(-1, patch_dim)


def mrope_step_positions(states: list[RequestState], positions: np.ndarray,
                         num_scheduled: np.ndarray) -> np.ndarray:
    """The step's three positions per token, [3, T], from its flat positions: a prompt
    token's from its request's table (RequestState.mrope), a later one's index plus the
    request's delta."""
    out = np.repeat(positions[None, :], 3, axis=0)
    cu = np.concatenate([[0], np.cumsum(num_scheduled)])
    for i, state in enumerate(states):
        if state.mrope is None:
            continue
        span = slice(int(cu[i]), int(cu[i + 1]))
        pos, prompt_len = positions[span], state.mrope.shape[1]
        out[:, span] = np.where(pos < prompt_len,
                                state.mrope[:, np.minimum(pos, prompt_len - 1)],
                                pos + state.mrope_delta)
    return out


def mrope_positions_of_step(positions: np.ndarray, has_images: bool) -> np.ndarray:
    """A step's M-RoPE positions as the model takes them: [3, T] where it has image rows,
    else [T]: its tokens are all text, whose three positions are equal, and M-RoPE at
    three equal positions is 1-D RoPE at that position (each frequency's angle comes from
    one of the three: layers/rotary.MRotaryEmbedding)."""
    if has_images:
        return positions
    assert (positions == positions[0]).all(), "a text token's three positions differ"
    return positions[0].copy()
