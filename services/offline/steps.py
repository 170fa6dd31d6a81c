"""How the offline engine runs its steps: on a step thread beside its loop, or in the loop
(or, by default on a GPU, on a step thread in a worker process of its own:
`ProcessSteps`, services/offline/worker_process.py).

The loop (services/offline/engine.py) plans step N+1 while step N is out, then applies
step N's tokens. With `ThreadedSteps` the executor runs on the served worker's step thread
(services/worker/step_thread.py): a plan is prepared and launched there the moment the
loop queues it, and each step's result is posted the moment its tokens are on the host,
so the loop schedules, applies tokens and hands text to the detokenizer process while the
step thread prepares, launches and waits on the device. Both threads share the GIL; what
they overlap is the device's wait, torch's launches (which release the GIL) and the
loop's Python. Any executor runs there: one rank, a tensor-parallel group (the thread
forwards each call to the followers, in order) or pipeline stages (which hold their
newest steps until the loop asks for them: a DrainSteps order, as the served scheduler
sends). `InlineSteps` calls the executor from the loop, as the engine did before the
thread: tests compare the two.

Either way the loop takes results with a fixed lag, never "whatever is back": after
launching a step it applies every result but the newest `launch_lag` (those the
executor's launch leaves without results in the loop too). So each plan is made from the
same applied tokens however the threads are timed, and the plans, hence the outputs
(unseeded sampling included), are those of the in-line loop.
"""

from __future__ import annotations

import queue
import sys
import weakref
from typing import Protocol

from common.bus import Entry
from common.config import EngineConfig
from common.messages import DrainSteps, StepPlan, StepResult
from common.pipeline import held_steps
from common.service import GIL_SWITCH_S
from services.worker.executor import Executor
from services.worker.step_thread import StepThread

JOIN_WAIT_S = 10.0
LAUNCH_LAG = 3


class Steps(Protocol):
    def launch(self, plan: StepPlan) -> None:
        """Queue `plan` for the device."""

    def results(self, keep: int) -> list[StepResult]:
        """The results of the launched steps, oldest first: all but the newest `keep`
        (waiting for them; pipeline stages hand their held steps back on a drain, sent
        for keep 0); in the loop, what the executor's launches returned (the same with
        keep at `launch_lag`), and with keep 0 every one."""

    def close(self) -> None:
        """Finish what is launched and let the thread go (a second call does nothing)."""


class InlineSteps:
    """The executor called from the loop: `launch` returns once the plan is launched, with
    the results it completed (the previous step's) kept here until `results` may hand them
    out: all but the newest `keep` launched, as the threads do; `keep` 0 flushes."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._done: list[StepResult] = []
        self._in_flight = 0  # launched steps whose results were not handed out

    def launch(self, plan: StepPlan) -> None:
        self._done += self.executor.submit(plan)
        self._in_flight += 1

    def results(self, keep: int) -> list[StepResult]:
        if keep == 0:
            self._done += self.executor.flush()
        count = min(len(self._done), max(0, self._in_flight - keep))
        done, self._done = self._done[:count], self._done[count:]
        self._in_flight -= count
        return done

    def close(self) -> None:
        """Nothing runs beside the loop."""


class ThreadedSteps:
    """The executor on a step thread of its own; results come back through a queue."""

    def __init__(self, executor: Executor) -> None:
        posted: queue.SimpleQueue = queue.SimpleQueue()
        self._posted = posted
        # The poster holds the queue, not self: an engine dropped without close() is
        # collected, and its finalizer below stops the thread.
        self._thread = StepThread(executor, "", lambda *item: posted.put(item),
                                  log_slow_steps=False)
        self._in_flight = 0
        self._error: BaseException | None = None
        # The step thread waits for the GIL behind the loop's Python for up to the switch
        # interval each time the device hands it a result: 5 ms by default, several steps.
        # The services run at GIL_SWITCH_S for the same reason (common/service.py).
        self._switch_before = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_before, GIL_SWITCH_S))
        self._thread.start()
        self._stop = weakref.finalize(self, _stop_thread, self._thread, self._switch_before)

    def launch(self, plan: StepPlan) -> None:
        self._thread.put(Entry(stream="", id=b"", fields={}, msg=plan))
        self._in_flight += 1

    def results(self, keep: int) -> list[StepResult]:
        if keep == 0 and self._in_flight and self._thread.drains_on_order:
            self._thread.put(Entry(stream="", id=b"", fields={}, msg=DrainSteps()))
        done: list[StepResult] = []
        while self._in_flight > keep:
            if self._error is not None:
                raise self._error
            entry, result = self._posted.get()
            if entry is None:  # the thread ended: the executor failed, or close()
                self._error = result or RuntimeError("the engine's step thread has stopped")
                continue
            if result is None:  # a drain's answer: the steps it handed back came before
                continue
            self._in_flight -= 1
            done.append(result)
        return done

    def close(self) -> None:
        """The thread finishes the launched steps and ends; the switch interval is the
        caller's again."""
        if self._stop.alive:
            self._stop()
            self._thread.join(JOIN_WAIT_S)


def _stop_thread(thread: StepThread, switch_interval: float) -> None:
    thread.stop()
    sys.setswitchinterval(switch_interval)


def launch_lag(config: EngineConfig) -> int:
    """The launched steps without results once the newest is launched: three, or with
    pipeline stages the steps they hold (common/pipeline.py; two stages were measured with
    two out, benchmarks/pp-h200x2-overlap). One would do (the runner plans
    ahead of one step, services/worker/model_runner.py), but then a step's tokens must be
    applied and the plan after next made and launched while one step runs, and where a
    step is short the device waits: on the H100 the nano workload ran at 16,562 tok/s
    with two against 15,388 with one, its device idle 0.59 against 1.02 s between steps
    (with the worker process, one lease: benchmarks/issue31-h100/s8/lag); on another lease,
    alternating, 14,710 and 15,096 with two, 15,584 and 15,887 with three, 15,987 with four
    (benchmarks/issue31-h100/s12/lag.txt). The served scheduler keeps two to four out for
    the same reason (services/scheduler/inflight.py); here the number is fixed, so that the
    plans are the same however the threads run."""
    return held_steps(config.pipeline_parallel_size) or LAUNCH_LAG


def start_steps(executor: Executor, threaded: bool) -> Steps:
    return ThreadedSteps(executor) if threaded else InlineSteps(executor)
