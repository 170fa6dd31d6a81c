"""How many steps pipeline stages keep in flight, and so how a scheduler splits its
requests among them: the worker's stages, the served scheduler and the offline loop must
agree on it.

With N stages the first stage leaves the results of its newest N launched steps out: N - 1
for the stages behind it to compute, and one more so that the host applies a result and
plans the next step while the device still has a step queued (with N - 1, the first stage
ran dry every step while the host worked). So N + 1 steps are in flight, each of different
requests: the scheduler gives a step at most 1/(N + 1) of the running requests, and lets
up to `max_num_seqs` run per stage, as vLLM V0's virtual engines (one scheduler per stage,
each with its own `max_num_seqs`) did.
"""

from __future__ import annotations


def held_steps(stages: int) -> int:
    """Launched steps whose results the first stage leaves out (none without stages)."""
    return stages if stages > 1 else 0


def micro_batches(stages: int) -> int:
    """Steps in flight, each of different requests."""
    return held_steps(stages) + 1


def max_running(max_num_seqs: int, stages: int) -> int:
    """Requests that may run at once."""
    return max_num_seqs * stages
