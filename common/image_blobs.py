"""Images' pixels beside the streams: an image larger than INLINE_MAX_BYTES leaves the
tokenizer as a key of its own (keys.image, named by the image's content hash, so a repeated
image is stored once), and its ImageInput carries the key. The admit, step and result
streams then carry only small entries, whatever the images weigh, and the scheduler keeps
no pixels; the worker reads the pixels of a plan's new requests before it runs the plan.

A key lives --image-ttl past its last store or renewal. The scheduler renews the keys of
every request it holds (waiting, running or preempted) every quarter of that
(`renew_every_s`), one round trip for them all, so a key outlives its requests' wait and
a preemption's recompute, and lapses only once no request holds it. A key lost anyway
(Redis restarted without it, evicted, deleted) fails only its requests: the worker leaves
them out of their step and the scheduler answers each with a 503 (`lapsed_images`)."""

from __future__ import annotations

import dataclasses

from common import keys
from common.bus import Bus
from common.messages import AdmitRequest, ImageInput, StepPlan

INLINE_MAX_BYTES = 64 * 1024
IMAGE_TTL_S = 3600.0  # --image-ttl's default


def renew_every_s(ttl_s: float) -> float:
    """How often the scheduler renews its requests' keys: well inside their TTL."""
    return ttl_s / 4


async def detach_pixels(bus: Bus, admit: AdmitRequest, ttl_s: float = IMAGE_TTL_S
                        ) -> AdmitRequest:
    """`admit` with its large images' pixels stored under their keys."""
    large = [image for image in admit.images if len(image.pixels) > INLINE_MAX_BYTES]
    if not large:
        return admit
    await bus.store_blobs({keys.image(image.hash): image.pixels for image in large}, ttl_s)
    return dataclasses.replace(admit, images=[
        dataclasses.replace(image, pixels=b"", key=keys.image(image.hash))
        if len(image.pixels) > INLINE_MAX_BYTES else image for image in admit.images])


async def attach_pixels(bus: Bus, plan: StepPlan) -> StepPlan:
    """`plan` with the pixels of its new requests' stored images read back (one round
    trip); an image whose key lapsed stays without pixels (see lapsed_images)."""
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


def lapsed_images(plan: StepPlan) -> dict[str, str]:
    """The new requests of `plan` (pixels attached) that miss an image's pixels, each
    with the error that ends it."""
    failed = {}
    for new in plan.new:
        lapsed = [image for image in new.images if image.key and not image.pixels]
        if lapsed:
            failed[new.req_id] = (
                f"the pixels of image {lapsed[0].hash[:12]} ({lapsed[0].key}) were no longer "
                "in Redis when the request ran; send the request again")
    return failed
