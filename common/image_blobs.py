"""Images' pixels beside the streams: an image larger than INLINE_MAX_BYTES leaves the
tokenizer as a key of its own (keys.image, named by the image's content hash, so a repeated
image is stored once), and its ImageInput carries the key. The admit, step and result
streams then carry only small entries, whatever the images weigh, and the scheduler keeps
no pixels; the worker reads the pixels of a plan's new requests before it runs the plan.
A key lives IMAGE_TTL_S past its last store: a request (or its recompute after
preemption) that outlives it fails its step."""

from __future__ import annotations

import dataclasses

from common import keys
from common.bus import Bus
from common.messages import AdmitRequest, ImageInput, StepPlan

INLINE_MAX_BYTES = 64 * 1024
IMAGE_TTL_S = 3600.0


async def detach_pixels(bus: Bus, admit: AdmitRequest) -> AdmitRequest:
    """`admit` with its large images' pixels stored under their keys."""
    large = [image for image in admit.images if len(image.pixels) > INLINE_MAX_BYTES]
    if not large:
        return admit
    await bus.store_blobs({keys.image(image.hash): image.pixels for image in large},
                          IMAGE_TTL_S)
    return dataclasses.replace(admit, images=[
        dataclasses.replace(image, pixels=b"", key=keys.image(image.hash))
        if len(image.pixels) > INLINE_MAX_BYTES else image for image in admit.images])


async def attach_pixels(bus: Bus, plan: StepPlan) -> StepPlan:
    """`plan` with the pixels of its new requests' stored images read back (one round
    trip); an image whose key lapsed stays without pixels (its step fails)."""
    wanted = sorted({image.key for new in plan.new for image in new.images
                     if image.key and not image.pixels})
    if not wanted:
        return plan
    found = dict(zip(wanted, await bus.values(*wanted)))
    return dataclasses.replace(plan, new=[
        dataclasses.replace(new, images=[_attached(image, found) for image in new.images])
        if new.images else new for new in plan.new])


def _attached(image: ImageInput, found: dict[str, bytes | None]) -> ImageInput:
    pixels = found.get(image.key) if image.key and not image.pixels else None
    return image if pixels is None else dataclasses.replace(image, pixels=pixels)
