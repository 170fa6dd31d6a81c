"""How far the scheduler plans ahead of the worker: the depth rule on its own, and the
scheduler process's shell against a real Redis with this test playing the worker."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest

from common import keys
from common.bus import Bus
from common.config import EngineConfig, ServerConfig
from common.messages import AdmitRequest, StepPlan, StepResult, WorkerReady
from common.sampling_params import SamplingParams
from common.service import ServiceContext
from services.scheduler.inflight import IDLE_S, MAX_DEPTH, MIN_DEPTH, QUIET_STEPS, StepsInFlight
from services.scheduler.shell import SchedulerShell


@dataclass
class Device:
    """Keeps the depth full and finishes one step per gap: a step starts `gap` after the
    one before it finished (0: its plan was queued in time)."""
    steps: StepsInFlight
    planned: int = 0
    finished: int = 0
    done: float = 1.0

    def run(self, gaps: list[float], step_s: float = 0.002) -> None:
        self.fill()
        for gap in gaps:
            started = self.done + gap
            self.done = started + step_s
            self.finished += 1
            self.steps.finished(self.finished, [started - 0.001, started, self.done])
            self.fill()

    def fill(self) -> None:
        while self.steps.may_plan():
            self.planned += 1
            self.steps.planned(self.planned)


def test_two_steps_in_flight_while_the_worker_keeps_up():
    steps = StepsInFlight()
    Device(steps).run([0.0] * 50)
    assert steps.depth == MIN_DEPTH == 2
    assert steps.inflight == 2 and not steps.may_plan()


def test_a_device_waiting_for_a_refill_plan_deepens_the_queue_up_to_the_max():
    steps = StepsInFlight()
    device = Device(steps)
    device.run([0.0] * 5 + [IDLE_S * 5] * 2)
    assert steps.depth == 3  # the steps planned before it deepened do not count again
    device.run([IDLE_S * 5] * 10)
    assert steps.depth == MAX_DEPTH


def test_a_quiet_run_brings_the_depth_back_down():
    steps = StepsInFlight(depth=3)
    Device(steps).run([0.0] * (QUIET_STEPS + 1))
    assert steps.depth == 2


def test_a_request_arriving_at_an_idle_engine_is_no_sign_of_starvation():
    steps = StepsInFlight()
    steps.planned(1)
    steps.idle()  # nothing more to plan
    steps.finished(1, [1.0, 1.0, 1.002])
    steps.planned(2)  # a new request, seconds later
    steps.finished(2, [5.0, 5.0, 5.002])
    assert steps.depth == MIN_DEPTH


# --- the shell: a new request's prefill waits behind at most one queued step ------------

async def next_plan(bus: Bus, timeout_s: float = 5.0) -> StepPlan:
    with anyio.fail_after(timeout_s):
        while True:
            entries = await bus.read("worker", "w", {keys.steps(): ">"}, count=1,
                                     block_ms=100)
            if entries:
                await bus.ack(entries)
                return entries[0].msg


async def no_plan_within(bus: Bus, seconds: float) -> bool:
    entries = await bus.read("worker", "w", {keys.steps(): ">"}, count=1,
                             block_ms=int(seconds * 1000))
    return not entries


def admission(rid: str) -> AdmitRequest:
    params = SamplingParams(max_tokens=50, ignore_eos=True, eos_token_ids=(0,))
    return AdmitRequest(rid, "gw", [5, 6, 7], params)


@pytest.mark.anyio
async def test_a_new_prefill_waits_behind_at_most_one_queued_step(redis_url):
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=256)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 30_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256))
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), bus, anyio.Event())
        tg.start_soon(SchedulerShell(ctx, config).run)

        await bus.publish(keys.admit(), admission("a"))
        first, second = await next_plan(bus), await next_plan(bus)
        assert [first.step, second.step] == [1, 2] and first.req_ids == ["a#0"]
        assert await no_plan_within(bus, 0.3)  # two in flight: nothing more is planned

        await bus.publish(keys.admit(), admission("b"))
        assert await no_plan_within(bus, 0.3)  # b waits for a slot, not for a timer
        await bus.publish(keys.results(), StepResult(1, ["a#0"], [9], epoch="epoch-1"))
        third = await next_plan(bus)
        # b's prefill is planned as soon as step 1 is done: only step 2 is ahead of it
        assert third.step == 3 and [r.req_id for r in third.new] == ["b#0"]
        ctx.stop.set()
        tg.cancel_scope.cancel()


def test_a_gap_small_beside_a_long_step_keeps_the_depth():
    """On the CPU a step takes ~100 ms and a hop a few: queueing deeper would only make
    new requests wait a whole step longer."""
    steps = StepsInFlight()
    device = Device(steps)
    device.run([0.004] * 20, step_s=0.1)
    assert steps.depth == MIN_DEPTH
    device.run([0.02] * 2, step_s=0.1)
    assert steps.depth == MIN_DEPTH + 1
