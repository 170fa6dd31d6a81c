"""The thread that drives the executor: it launches each plan the moment one is queued and
hands every step's result back to the event loop.

Launching the next step must not wait on the event loop: there it would queue behind the
Redis reads and writes, and the device would idle between steps. So the executor has a
thread of its own, woken by one queue: plans put by the event loop, and the word of a
waiter thread that the device finished the last step. A step's result goes out when the
next plan's launch completes it (the device already runs that plan), or, when no plan is
waiting, as soon as the device is done. Nothing polls.

Pipeline stages are the exception: they keep their newest steps in flight until later
plans push them out, and an inbox empty for a moment says nothing of the plans on their
way. So under stages the held steps come back only when the scheduler says no plan
follows (a DrainSteps order, services/scheduler/inflight.py), or at the end.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from common.bus import Entry
from common.log import get_logger
from common.messages import DrainSteps, StepPlan, StepResult
from common.timing import PhaseClock
from services.worker.executor import Executor

Post = Callable[[Entry | None, StepResult | BaseException | None], None]
# A step is logged as slow past both: far above any step of a small model's token budget
# on a GPU, and well above this worker's usual step (a CPU's steps are all slow).
SLOW_STEP_S = 0.05
SLOW_STEP_FACTOR = 4.0
DEVICE_DONE, STOP = object(), object()

log = get_logger(__name__)


class StepThread:
    def __init__(self, executor: Executor, epoch: str, post: Post,
                 log_slow_steps: bool = True) -> None:
        """`post(entry, result)` is called from this thread for every plan, in order:
        with the step's result, or None for a plan meant for another worker and for a
        drain; then once `post(None, None)` after `stop()`, or `post(None, error)` if the
        executor fails. The offline engine passes log_slow_steps=False: a script's output
        is its own."""
        self.executor, self.epoch, self.post = executor, epoch, post
        self.log_slow_steps = log_slow_steps
        self.scheduler_epoch = ""
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.launched: deque[tuple[Entry, float]] = deque()  # with when each was launched
        self.last_done = 0.0  # when the latest step's result reached the host
        self.usual_step_s = 0.0  # a moving average of the steps' device time
        self.clock = PhaseClock()
        self._arm: queue.SimpleQueue = queue.SimpleQueue()  # the waiter's orders
        self._waiting = False  # the waiter is watching the device for us
        # stages hold steps for later plans: they hand them back on a drain only
        self.drains_on_order = executor.config.pipeline_parallel_size > 1
        self._threads = [threading.Thread(target=self._run, name="steps", daemon=True),
                         threading.Thread(target=self._wait_device, name="device-wait",
                                          daemon=True)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def put(self, entry: Entry) -> None:
        self.inbox.put(entry)

    def stop(self) -> None:
        """Finish the queued plans, post their results, then post (None, None)."""
        self.inbox.put(STOP)

    def join(self, timeout: float | None = None) -> None:
        """Wait for both threads to end (after `stop()`)."""
        for thread in self._threads:
            thread.join(timeout)

    def _run(self) -> None:
        try:
            while self._handle(self._next()):
                pass
            self._deliver(self.executor.flush())
            self.post(None, None)
        except BaseException as e:  # the event loop raises it: the process must not hang
            self.post(None, e)
        finally:
            self._arm.put(STOP)

    def _next(self) -> object:
        """The next order. When none is queued and a step is out: its result goes out now
        if the device is done (on the CPU it always is), else the waiter is to tell us."""
        self.clock.start()
        if (self.launched and not self._waiting and self.inbox.empty()
                and not self.drains_on_order):
            if self.executor.step_done():
                return DEVICE_DONE
            self._waiting = True
            self._arm.put(True)
        item = self.inbox.get()
        self.clock.lap("wait")
        return item

    def _handle(self, item: object) -> bool:
        if item is STOP:
            return False
        if item is DEVICE_DONE:
            self._waiting = False
            if self.launched and self.inbox.empty() and self.executor.step_done():
                self._deliver(self.executor.flush())
                self.clock.lap("flush")
            return True
        assert isinstance(item, Entry)
        if isinstance(item.msg, DrainSteps):
            if item.msg.epoch == self.epoch:
                self._deliver(self.executor.flush())
                self.clock.lap("flush")
            self.post(item, None)
            return True
        plan: StepPlan = item.msg
        if plan.epoch != self.epoch:
            self.post(item, None)  # planned for a worker that is gone
            return True
        if plan.scheduler_epoch != self.scheduler_epoch:  # a new scheduler starts afresh
            self._deliver(self.executor.flush())
            self.executor.forget_requests()
            self.scheduler_epoch = plan.scheduler_epoch
        if not plan.req_ids:  # the worker left out all its requests (failed_requests.py)
            self._deliver(self.executor.flush())
            now = time.time()
            self.post(item, StepResult(plan.step, [], [], epoch=self.epoch,
                                       stamps=[plan.planned_at, now, now]))
            return True
        launched_at = time.time()
        done = self.executor.submit(plan)
        self.launched.append((item, launched_at))
        self._deliver(done)
        self.clock.lap("submit")
        return True

    def _deliver(self, results: list[StepResult]) -> None:
        for result in results:
            entry, launched_at = self.launched.popleft()
            done_at = result.stamps[-1]  # when the executor had its tokens
            # a step launched behind another starts when that one is done. Otherwise its
            # start is when this thread took its plan, its inputs not yet made: the
            # scheduler deepens its queue only for a device that waited with no plan here
            # (services/scheduler/inflight.py). A wait while the host made the inputs is
            # not one that plans further ahead help: stamped at the forward's launch
            # instead, the depth went to 4 at once, with no more requests/s
            # (benchmarks/issue31-h200, sixth session)
            started = max(launched_at, self.last_done)
            self.last_done = done_at
            if self.log_slow_steps:
                self._check_slow(entry.msg, done_at - started)
            self.post(entry, dataclasses.replace(
                result, epoch=self.epoch, stamps=[entry.msg.planned_at, started, done_at]))

    def _check_slow(self, plan: StepPlan, seconds: float) -> None:
        if seconds > max(SLOW_STEP_S, SLOW_STEP_FACTOR * self.usual_step_s):
            log.warning("slow step", step=plan.step, ms=round(1000 * seconds, 1),
                        usual_ms=round(1000 * self.usual_step_s, 1),
                        tokens=sum(plan.num_scheduled_tokens), requests=len(plan.req_ids),
                        new_requests=len(plan.new))
        if self.usual_step_s == 0.0:
            self.usual_step_s = seconds
        else:  # about the last 20 steps
            self.usual_step_s += (seconds - self.usual_step_s) / 20

    def _wait_device(self) -> None:
        while self._arm.get() is not STOP:
            self.executor.wait_step_done()
            self.inbox.put(DEVICE_DONE)
