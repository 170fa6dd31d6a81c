"""Where a loop's time goes: seconds per phase, summed over its iterations. The engine's
step, the worker's and the scheduler's loops keep one each; benchmarks print them and the
services log theirs when they stop."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class PhaseClock:
    seconds: dict[str, float] = field(default_factory=dict)
    loops: int = 0
    _mark: float = field(default=0.0, repr=False)

    def start(self) -> None:
        """Begin an iteration: the next lap counts from now."""
        self._mark = time.perf_counter()
        self.loops += 1

    def lap(self, phase: str) -> None:
        """Charge the time since the last mark to `phase`."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._mark
        self._mark = now

    def summary(self) -> dict[str, float | int]:
        return {"loops": self.loops, **{f"{k}_s": round(v, 3) for k, v in self.seconds.items()}}
