"""The pipeline stage a model is built for: which of its decoder layers this process
holds, and the point-to-point links to the stages beside it.

The layers split as vLLM splits them: evenly, the remainder going one each to the stages
before the last (which also holds the final norm and the LM head), or as
VLLM_PP_LAYER_PARTITION lists them ("10,11,11"). The first stage holds the embedding.
Between stages the residual stream travels whole: a stage ends by adding its last
layer's output (all-reduced over its tensor-parallel ranks where the layer left it
partial) to the residual, so the next stage starts like the first with one tensor
[tokens, hidden_size]. Each tensor-parallel rank of a stage sends to the rank of the same
index in the next one, over the default group (gloo on the CPU, NCCL on GPUs).

The last stage samples, and finishes each step once it has launched the next, as one rank
does, so its host prepares a step while its device computes the one before. Its
tensor-parallel rank 0 posts the StepResult down a pipe to global rank 0 (a thread writes
it, so the stage never waits for rank 0 to read), which forwards it to the ranks of the
stages before the last with its next call; they append its tokens to their requests, so
the first stage embeds those tokens later and plans still carry no token ids. Results
travel beside the device's streams, not over a collective: a broadcast would wait for
every stage's queued work, so the first stage's device ran dry while the host applied the
result. Rank 0 takes a result only once it has launched `common.pipeline.held_steps`
steps after it: with N stages up to N + 1 steps are in flight, each stage computing
another and one queued while the host plans. The scheduler makes that possible
(services/scheduler/core.py): it plans no request whose sampled token is still in flight,
and gives each step at most 1/(N + 1) of the running requests.

A stage is passed, not looked up: the layers built inside `building_stage(stage)` read it,
as they read their tensor-parallel group (layers/parallel.py). Outside any, a model is
built whole, as stage 0 of 1.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from common.messages import StepResult, decode, encode

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


def layer_partition(num_layers: int, size: int, override: str | None = None) -> list[int]:
    """Layers per stage: `override` (comma-separated counts), or an even split whose
    remainder goes to the stages before the last, the last of them first."""
    if override:
        counts = [int(part) for part in override.split(",")]
        if len(counts) != size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"{PARTITION_ENV}={override!r} must list {size} positive layer "
                             f"counts that sum to the model's {num_layers} layers")
        return counts
    if num_layers < size:
        raise ValueError(f"--pipeline-parallel-size {size} exceeds the model's {num_layers} "
                         "layers: each stage needs one at least")
    counts = [num_layers // size] * size
    for i in range(num_layers % size):
        counts[size - 2 - i] += 1
    return counts


def stage_layers(num_layers: int, size: int, index: int) -> range:
    """The decoder layers of stage `index` of `size` (VLLM_PP_LAYER_PARTITION if set)."""
    counts = layer_partition(num_layers, size, os.environ.get(PARTITION_ENV))
    start = sum(counts[:index])
    return range(start, start + counts[index])


@dataclass(slots=True, eq=False)
class PPStage:
    """This process's stage: its index among `size`, its layers, the global ranks of its
    pipeline (one per stage, this tensor-parallel rank's) and their group (None for a
    pipeline of one stage, which never communicates). Global rank 0 reads the results from
    `inbox`; the last stage's tensor-parallel rank 0 posts them to `outbox`."""
    index: int = 0
    size: int = 1
    layers: range | None = None  # None: every layer
    ranks: list[int] = field(default_factory=lambda: [0])
    group: dist.ProcessGroup | None = None
    sending: tuple[dist.Work, torch.Tensor] | None = None  # the last send, and its tensor
    inbox: Connection | None = None
    outbox: ResultPoster | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    def holds(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def send_next(self, hidden: torch.Tensor) -> None:
        """Sends without waiting for the next stage to take it (it may still be computing
        the step before): the send before this one must be complete first."""
        if self.sending is not None:
            self.sending[0].wait()
        hidden = hidden.contiguous()
        self.sending = (dist.isend(hidden, dst=self.ranks[self.index + 1]), hidden)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                  ) -> torch.Tensor:
        hidden = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(hidden, src=self.ranks[self.index - 1])
        return hidden

    def post_result(self, result: StepResult) -> None:
        if self.outbox is not None:
            self.outbox.post(result)

    def take_result(self) -> StepResult:
        """The last stage's next result, in step order (global rank 0 only)."""
        assert self.inbox is not None, "only global rank 0 takes results"
        try:
            return decode(self.inbox.recv_bytes())
        except EOFError:
            raise RuntimeError("the pipeline's last stage is gone: its results pipe "
                               "closed") from None

    def min_over_stages(self, value: int, device: torch.device) -> int:
        """The smallest of the stages' `value`s: a number of KV blocks every stage holds."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


class ResultPoster:
    """Writes the last stage's results down the pipe to rank 0 from a thread of its own: a
    large result fills the pipe until rank 0 reads it, which it does only after its next
    launch, and rank 0's launch may itself wait to write this stage its next call."""

    def __init__(self, pipe: Connection) -> None:
        self.pipe = pipe
        self.queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        threading.Thread(target=self._write, name="pp-results", daemon=True).start()

    def post(self, result: StepResult) -> None:
        self.queue.put(encode(result))

    def _write(self) -> None:
        try:
            while True:
                self.pipe.send_bytes(self.queue.get())
        except OSError:  # rank 0 is gone: this process ends at its inbox's EOF
            return


def append_result(requests: dict, result: StepResult) -> None:
    """A stage that did not sample appends the last stage's tokens to their requests
    (RequestStates by id), as finishing the step does there; not to those the plan that
    finishes it has finished or preempted already (the last stage's are orphans then)."""
    counts = result.num_tokens or [1] * len(result.req_ids)
    at = 0
    for req_id, count in zip(result.req_ids, counts):
        if req_id in requests:
            requests[req_id].output_ids += result.token_ids[at:at + count]
        at += count


_BUILDING: ContextVar[PPStage] = ContextVar("pp_stage", default=PPStage())


def current_stage() -> PPStage:
    return _BUILDING.get()


@contextlib.contextmanager
def building_stage(stage: PPStage) -> Iterator[PPStage]:
    token = _BUILDING.set(stage)
    try:
        yield stage
    finally:
        _BUILDING.reset(token)
