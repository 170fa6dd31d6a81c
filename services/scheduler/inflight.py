"""How many steps the scheduler keeps planned ahead of the worker's results.

Two is the least that keeps the device busy: one step runs while the next is queued behind
it, and the plan after that is made while the queued one runs. Every step more in flight
is one more step that a new request's prefill waits behind, since plans are made in
order. So the depth starts at two and grows only when the worker shows it waited: a step
whose plan was held back by the depth (a refill) that started after the step before it
had finished means the device sat idle for want of a plan. An idle gap counts when it is
a tenth of a step or more: on a slow or synchronous device (the CPU) a hop costs a few
percent of a step, and a deeper queue would cost new requests a whole step. After a long
run without such a gap, the depth goes back down by one.

Pipeline stages (N of them) hold the results of the newest N steps they were sent until
later plans push them out (common/pipeline.py). So the depth is N + 1 at least, and when
every step still out is one the stages hold, no result would ever come back to free a
slot: the scheduler then sends the worker a drain (`must_drain`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.pipeline import held_steps, micro_batches

MIN_DEPTH, MAX_DEPTH = 2, 4
IDLE_S = 0.0002  # a device idle this long between two steps waited for a plan...
IDLE_FRACTION = 0.1  # ...if that is also this much of the step it waited for
QUIET_STEPS = 2000  # steps without such a wait before the depth shrinks by one


@dataclass(slots=True)
class StepsInFlight:
    stages: int = 1  # the worker's pipeline stages
    depth: int = MIN_DEPTH
    inflight: int = 0
    since_drain: int = 0  # steps planned since the last drain
    refills: set[int] = field(default_factory=set)  # steps planned the moment one freed
    held_back: bool = False  # the depth is full: the next plan is a refill
    last_done: float = 0.0  # when the latest step's result reached the worker's host
    quiet: int = 0
    last_planned: int = 0
    deepened_after: int = 0  # steps up to this one were planned before the last deepening

    def __post_init__(self) -> None:
        self.depth = max(self.depth, self.min_depth)

    @property
    def min_depth(self) -> int:
        return max(MIN_DEPTH, micro_batches(self.stages))

    @property
    def max_depth(self) -> int:
        return max(MAX_DEPTH, micro_batches(self.stages) + 1)

    def may_plan(self) -> bool:
        return self.inflight < self.depth

    def held(self) -> int:
        """The steps whose results the stages keep once they have launched every plan."""
        return min(self.since_drain, held_steps(self.stages))

    def must_drain(self) -> bool:
        """Whether every step out is held by the stages: with nothing more planned, their
        results come back only if the worker is told to let them go."""
        return 0 < self.inflight <= self.held()

    def drained(self) -> None:
        self.since_drain = 0

    def planned(self, step: int) -> None:
        if self.held_back:
            self.refills.add(step)
            self.held_back = False
        self.inflight += 1
        self.since_drain += 1
        self.last_planned = step
        self.held_back = self.inflight >= self.depth

    def idle(self) -> None:
        """Nothing left to plan: the next plan is not held back by the depth."""
        self.held_back = False

    def finished(self, step: int, stamps: Sequence[float]) -> None:
        """A step's result came back with its stamps (planned, started, done)."""
        self.inflight -= 1
        refill = step in self.refills
        self.refills.discard(step)
        if len(stamps) < 3 or not all(stamps):
            return
        idle, busy = stamps[1] - self.last_done, stamps[2] - stamps[1]
        starved = refill and self.last_done and idle > max(IDLE_S, IDLE_FRACTION * busy)
        self.last_done = stamps[2]
        if starved and step > self.deepened_after:
            self.depth, self.quiet = min(self.depth + 1, self.max_depth), 0
            self.deepened_after = self.last_planned
        elif (quiet := self.quiet + 1) >= QUIET_STEPS:
            self.depth, self.quiet = max(self.depth - 1, self.min_depth), 0
        else:
            self.quiet = quiet
