"""Images' pixels as Redis keys (common/image_blobs.py): the scheduler renews the keys of the
requests it holds, so they outlive a long wait; a key lost anyway fails only its requests,
which the worker leaves out of every plan until the scheduler has ended them. (Through
`headrace serve`: tests/test_vision_language_serve.py.)"""

from __future__ import annotations

import anyio
import pytest

from common import keys
from common.bus import Bus
from common.config import EngineConfig, ServerConfig
from common.image_blobs import attach_pixels, detach_pixels, lapsed_images
from common.messages import (Abort, AdmitRequest, CachedRequest, ErrorReply, ImageInput,
                             NewRequest, RequestFailed, StepPlan, WorkerReady)
from common.sampling_params import SamplingParams
from common.service import ServiceContext
from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.shell import SchedulerShell
from services.worker.failed_requests import FailedRequests

PIXELS = bytes(range(256)) * 400  # over INLINE_MAX_BYTES: stored as a key


def image(hash_: str = "ab" * 32) -> ImageInput:
    return ImageInput(hash=hash_, offset=1, length=2, grid_thw=[1, 2, 2], pixels=PIXELS)


def admission(rid: str, images: list[ImageInput], max_tokens: int = 50) -> AdmitRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, eos_token_ids=(0,))
    return AdmitRequest(rid, "gw", [5, 6, 6, 7], params, images=images)


def new(req_id: str, images: list[ImageInput] = ()) -> NewRequest:
    return NewRequest(req_id, [5, 6, 6, 7], 4, [0], SamplingParams(), images=list(images))


@pytest.mark.anyio
async def test_a_lapsed_key_names_its_request_and_the_others_keep_their_pixels(redis_url):
    async with Bus(redis_url) as bus:
        kept = await detach_pixels(bus, admission("a", [image("aa" * 32)]))
        lost = await detach_pixels(bus, admission("b", [image("bb" * 32)]))
        assert kept.images[0].key and not kept.images[0].pixels
        await bus.forget(lost.images[0].key)
        plan = StepPlan(1, ["a#0", "b#0"], [4, 4], [0, 0],
                        new=[new("a#0", kept.images), new("b#0", lost.images)])
        attached = await attach_pixels(bus, plan)
    assert attached.new[0].images[0].pixels == PIXELS
    failed = lapsed_images(attached)
    assert list(failed) == ["b#0"] and lost.images[0].key in failed["b#0"]


def test_failed_requests_are_left_out_until_a_plan_finishes_them():
    failed = FailedRequests()
    failed.add(["b#0"])
    plan = StepPlan(3, ["a#0", "b#0", "c#0"], [1, 3, 2], [9, 4, 0],
                    new=[new("b#0"), new("c#0")], cached=[CachedRequest("b#0", [7])],
                    num_draft_tokens=[0, 2, 1], draft_token_ids=[11, 12, 13])
    out = failed.strip(plan)
    assert out.req_ids == ["a#0", "c#0"] and out.num_scheduled_tokens == [1, 2]
    assert out.num_computed_tokens == [9, 0] and [n.req_id for n in out.new] == ["c#0"]
    assert out.cached == [] and out.num_draft_tokens == [0, 1]
    assert out.draft_token_ids == [13]
    # a plan of b alone runs nothing, and the state it drops goes with the next plan
    alone = failed.strip(StepPlan(4, ["b#0"], [1], [7], finished=["x#0"]))
    assert alone.req_ids == [] and alone.finished == []
    then = failed.strip(StepPlan(5, ["b#0", "a#0"], [1, 1], [8, 10], finished=["b#0"]))
    assert then.req_ids == ["a#0"] and then.finished == ["x#0", "b#0"]
    assert failed.ids == set()  # the scheduler ended b: it plans it no more


def test_the_scheduler_ends_a_failed_request_once_and_keeps_the_rest():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                             block_size=4, num_blocks=32)
    core = Scheduler(config)
    core.add_request(admission("a", []))
    two = admission("b", [image()])
    core.add_request(AdmitRequest(two.rid, two.reply_to, two.prompt_token_ids,
                                  two.params.replace(n=2), images=two.images))
    core.schedule()
    assert core.fail(["b#0", "b#1"]) == [("gw", "b")]
    assert set(core.requests) == {"a#0"}
    plan = core.schedule()
    assert sorted(plan.finished) == ["b#0", "b#1"] and plan.req_ids == ["a#0"]


async def plans(bus: Bus, stop: anyio.Event) -> None:
    """Play a worker that never finishes a step: the requests stay held."""
    while not stop.is_set():
        await bus.ack(await bus.read("worker", "w", {keys.steps(): ">"}, block_ms=100))


@pytest.mark.anyio
async def test_the_scheduler_renews_the_keys_of_the_requests_it_holds(redis_url):
    """A 1 s TTL: the keys of a waiting and of a running request outlive it while the
    scheduler holds them; a request ended, its key lapses. A RequestFailed from the worker
    ends its request with a 503 naming the image."""
    engine = EngineConfig(max_model_len=256, max_num_batched_tokens=256, max_num_seqs=1)
    server = ServerConfig(image_ttl=1.0)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.ensure_group(keys.replies("gw"), "gateway")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 60_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256))
        ctx = ServiceContext("scheduler", "t", engine, server, bus, anyio.Event())
        tg.start_soon(SchedulerShell(ctx, engine).run)
        tg.start_soon(plans, bus, ctx.stop)
        running = await detach_pixels(bus, admission("a", [image("aa" * 32)]), 1.0)
        waiting = await detach_pixels(bus, admission("b", [image("bb" * 32)]), 1.0)
        await bus.publish(keys.admit(), running, waiting)
        names = [running.images[0].key, waiting.images[0].key]
        await anyio.sleep(2.5)
        assert None not in await bus.values(*names)

        await bus.publish(keys.control(), Abort("b"))
        await anyio.sleep(2.0)
        assert await bus.values(*names) == [PIXELS, None]

        await bus.publish(keys.results(), RequestFailed(["a#0"], "pixels of aa gone",
                                                        "epoch-1"))
        with anyio.fail_after(5):
            while not (replies := await bus.read("gateway", "g", {keys.replies("gw"): ">"},
                                                 block_ms=100)):
                pass
        assert replies[0].msg == ErrorReply("a", 503, "pixels of aa gone",
                                            "ServiceUnavailableError")
        ctx.stop.set()
        tg.cancel_scope.cancel()
