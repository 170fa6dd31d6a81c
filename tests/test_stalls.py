"""The pauses a process logs as they happen: a slow garbage collection, an event loop held
by one of its callbacks, and a step that kept the device long (common/stalls.py, the
worker's step thread)."""

from __future__ import annotations

import gc
import time

import anyio
import pytest
import structlog

from common.bus import Entry
from common.config import EngineConfig
from common.messages import StepPlan, StepResult
from common.stalls import watch_collections, watch_loop
from services.worker import step_thread
from services.worker.step_thread import StepThread


def slow_collections(slow_s: float, generation: int) -> list[dict]:
    """The "slow garbage collection" logs of one `gc.collect(generation)` watched with
    `slow_s`; the watcher is removed again afterwards."""
    before = list(gc.callbacks)
    try:
        with structlog.testing.capture_logs() as logs:
            watch_collections(slow_s=slow_s)
            gc.collect(generation)
    finally:
        gc.callbacks[:] = before
    return [entry for entry in logs if entry["event"] == "slow garbage collection"]


def test_a_slow_collection_is_logged_with_its_generation():
    garbage = [[i] for i in range(300_000)]  # tracked objects for a full collection to walk
    slow = slow_collections(0.0, 2)
    del garbage
    assert slow and slow[-1]["generation"] == 2 and slow[-1]["ms"] > 0
    assert slow[-1]["frozen"] >= 0 and slow[-1]["modules"] > 0


def test_watch_collections_stays_quiet_below_its_threshold():
    assert not slow_collections(60.0, 0)


@pytest.mark.anyio
async def test_a_blocked_event_loop_is_logged_with_how_long():
    with structlog.testing.capture_logs() as logs:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(watch_loop, 0.005, 0.05)
            await anyio.sleep(0.05)
            time.sleep(0.2)  # a callback that holds the loop
            await anyio.sleep(0.05)
            tasks.cancel_scope.cancel()
    stalls = [entry["ms"] for entry in logs if entry["event"] == "event loop stalled"]
    assert any(120 < ms < 1000 for ms in stalls), stalls


class TimedDevice:
    """An executor whose steps take the given seconds in turn and finish in submit, as on
    the CPU."""

    config = EngineConfig(model="m")

    def __init__(self, seconds: list[float]) -> None:
        self.seconds = iter(seconds)

    def submit(self, plan: StepPlan) -> list[StepResult]:
        time.sleep(next(self.seconds))
        return [StepResult(plan.step, plan.req_ids, [1] * len(plan.req_ids),
                           stamps=[time.time()])]

    def flush(self) -> list[StepResult]:
        return []

    def step_done(self) -> bool:
        return True

    def wait_step_done(self) -> None:
        pass

    def forget_requests(self) -> None:
        pass


def slow_steps(seconds: list[float]) -> list[dict]:
    """The "slow step" logs of a step thread that runs one plan per entry of `seconds`."""
    posted = []
    thread = StepThread(TimedDevice(seconds), "e1", lambda entry, result: posted.append(result))
    with structlog.testing.capture_logs() as logs:
        thread.start()
        for step in range(len(seconds)):
            thread.put(Entry("steps", b"1-0", {}, StepPlan(step, ["a", "b"], [7, 1], [0, 9],
                                                            epoch="e1")))
        thread.stop()
        deadline = time.monotonic() + 10
        while len(posted) <= len(seconds) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [r.step for r in posted[:-1]] == list(range(len(seconds))) and posted[-1] is None
    return [entry for entry in logs if entry["event"] == "slow step"]


def test_a_step_slower_than_usual_is_logged_with_its_shape():
    slow = slow_steps([0.0] * 5 + [step_thread.SLOW_STEP_S + 0.03, 0.0])
    assert len(slow) == 1 and slow[0]["step"] == 5 and slow[0]["tokens"] == 8
    assert slow[0]["requests"] == 2 and slow[0]["ms"] >= 1000 * step_thread.SLOW_STEP_S


def test_steps_that_are_all_slow_are_not_each_logged():
    slow = slow_steps([step_thread.SLOW_STEP_S + 0.03] * 4)  # a CPU's steps
    assert [entry["step"] for entry in slow] == [0]
