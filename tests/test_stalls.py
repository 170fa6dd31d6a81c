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
from common.messages import StepPlan, StepResult
from common.stalls import watch_collections, watch_loop
from services.worker import step_thread
from services.worker.step_thread import StepThread


def test_a_slow_collection_is_logged_with_its_generation():
    before = list(gc.callbacks)
    garbage = [[i] for i in range(300_000)]  # tracked objects for a full collection to walk
    try:
        with structlog.testing.capture_logs() as logs:
            watch_collections(slow_s=0.0)
            gc.collect(2)
    finally:
        gc.callbacks[:] = before
    del garbage
    slow = [entry for entry in logs if entry["event"] == "slow garbage collection"]
    assert slow and slow[-1]["generation"] == 2 and slow[-1]["ms"] > 0


def test_watch_collections_stays_quiet_below_its_threshold():
    before = list(gc.callbacks)
    try:
        with structlog.testing.capture_logs() as logs:
            watch_collections(slow_s=60.0)
            gc.collect(0)
    finally:
        gc.callbacks[:] = before
    assert not [entry for entry in logs if entry["event"] == "slow garbage collection"]


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


class SlowDevice:
    """An executor whose steps take `seconds` and finish in submit, as on the CPU."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def submit(self, plan: StepPlan) -> list[StepResult]:
        time.sleep(self.seconds)
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


@pytest.mark.parametrize("seconds, logged", [(step_thread.SLOW_STEP_S + 0.03, True),
                                             (0.0, False)])
def test_a_slow_step_is_logged_with_its_shape(seconds, logged):
    posted = []
    thread = StepThread(SlowDevice(seconds), "e1", lambda entry, result: posted.append(result))
    plan = StepPlan(4, ["a", "b"], [7, 1], [0, 9], epoch="e1")
    with structlog.testing.capture_logs() as logs:
        thread.start()
        thread.put(Entry("steps", b"1-0", {}, plan))
        thread.stop()
        deadline = time.monotonic() + 10
        while len(posted) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert posted[0].step == 4 and posted[1] is None
    slow = [entry for entry in logs if entry["event"] == "slow step"]
    if logged:
        assert len(slow) == 1 and slow[0]["step"] == 4 and slow[0]["tokens"] == 8
        assert slow[0]["requests"] == 2 and slow[0]["ms"] >= 1000 * step_thread.SLOW_STEP_S
    else:
        assert not slow
