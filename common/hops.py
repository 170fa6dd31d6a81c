"""Where a request's time goes: the timestamps messages carry, and the stages between them.

A request's own hops are stamped once, on its way in:

    arrival (gateway) -> tokenizer_in -> tokenizer_out -> first planned (scheduler)

and travel with it (AdmitRequest, then the scheduler's request) to its first token.
Every engine step is stamped on the token path:

    planned (scheduler) -> launched (worker) -> done (on the host) ->
    detokenizer_in -> detokenizer_out -> written to the client (gateway)

and the stamps travel with the step's messages (StepPlan, StepResult, TokenBatch,
ReplyBatch). The gateway turns them into `headrace:stage_seconds{stage=...}`, and each
finished completion's into vLLM's per-request phases (`request_times`): queue (reaching
the scheduler to its first plan), prefill (first plan to the host having its first
token), decode (first token to last, each when its step was done on the host).

Stamps are wall-clock seconds (`time.time()`): the processes of one host share that
clock; across hosts a stage also holds the hosts' clock offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# (stage, index of its start stamp); a stage ends at the next stamp
REQUEST_STAGES = (("gateway_to_tokenizer", 0), ("tokenizer", 1), ("admit_to_plan", 2))
STEP_STAGES = (("plan_to_worker", 0), ("step", 1), ("result_to_detokenizer", 2),
               ("detokenizer", 3))
DELIVERY_STAGE = "detokenizer_to_client"  # from detokenizer_out to the client write
STAGES = (*(s for s, _ in REQUEST_STAGES), *(s for s, _ in STEP_STAGES), DELIVERY_STAGE)

NUM_REQUEST_STAMPS = len(REQUEST_STAGES) + 1
NUM_STEP_STAMPS = len(STEP_STAGES) + 1
ADMITTED, FIRST_PLANNED = 2, 3  # request stamps: tokenizer_out, the scheduler's first plan
STEP_DONE = 2  # step stamps: the step's tokens on the host


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """One completion's phases, in seconds (vLLM's request_*_time_seconds)."""
    queue: float
    prefill: float
    decode: float
    per_output_token: float | None  # decode over the tokens after the first; None for one

    @property
    def inference(self) -> float:
        return self.prefill + self.decode


def request_stages(stamps: Sequence[float]) -> list[tuple[str, float]]:
    """The stages of a request's way in, from its full set of stamps (else none)."""
    return _stages(REQUEST_STAGES, stamps, NUM_REQUEST_STAMPS)


def step_stages(stamps: Sequence[float]) -> list[tuple[str, float]]:
    """The stages of one step's tokens up to the detokenizer's output (else none)."""
    return _stages(STEP_STAGES, stamps, NUM_STEP_STAMPS)


def _stages(stages: tuple[tuple[str, int], ...], stamps: Sequence[float],
            expected: int) -> list[tuple[str, float]]:
    if len(stamps) != expected or not all(stamps):
        return []  # a writer that does not stamp (an older one, or the offline engine)
    return [(name, max(0.0, stamps[i + 1] - stamps[i])) for name, i in stages]


def step_done(stamps: Sequence[float]) -> float:
    """When a step's tokens were on the host, from its stamps (0: not stamped)."""
    return stamps[STEP_DONE] if len(stamps) == NUM_STEP_STAMPS else 0.0


def request_times(request_stamps: Sequence[float], first_done: float, last_done: float,
                  num_tokens: int) -> RequestTimes | None:
    """A completion's phases from its request's stamps and the done stamps of the steps
    that made its first and last tokens; None where any is missing."""
    if len(request_stamps) != NUM_REQUEST_STAMPS or not all(request_stamps) \
            or not first_done or not last_done:
        return None
    planned = request_stamps[FIRST_PLANNED]
    decode = max(0.0, last_done - first_done)
    return RequestTimes(queue=max(0.0, planned - request_stamps[ADMITTED]),
                        prefill=max(0.0, first_done - planned), decode=decode,
                        per_output_token=decode / (num_tokens - 1) if num_tokens > 1 else None)
