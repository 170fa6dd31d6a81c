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

The last stage samples, finishes each step at once and broadcasts its StepResult over its
pipeline group; the other stages take it (in step order) and append its tokens to their
requests, so the first stage embeds those tokens later and plans still carry no token
ids. A stage sends without waiting for the next one to receive, and takes a result only
once it has launched as many steps after it as there are stages behind it: with N stages
up to N steps are in flight, each stage computing another. The scheduler makes that
possible (services/scheduler/core.py): it plans no request whose sampled token is still
in flight, and gives each step at most 1/N of the running requests.

A stage is passed, not looked up: the layers built inside `building_stage(stage)` read it,
as they read their tensor-parallel group (layers/parallel.py). Outside any, a model is
built whole, as stage 0 of 1.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

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
    pipeline of one stage, which never communicates)."""
    index: int = 0
    size: int = 1
    layers: range | None = None  # None: every layer
    ranks: list[int] = field(default_factory=lambda: [0])
    group: dist.ProcessGroup | None = None
    sending: tuple[dist.Work, torch.Tensor] | None = None  # the last send, and its tensor

    @property
    def behind(self) -> int:
        """The stages after this one: steps whose results it may leave in flight."""
        return self.size - 1 - self.index

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

    def share_result(self, result: StepResult | None, device: torch.device) -> StepResult:
        """The last stage's `result`, on every stage of this pipeline."""
        box = [encode(result) if result is not None else None]
        dist.broadcast_object_list(box, src=self.ranks[-1], group=self.group,
                                   device=device if device.type == "cuda" else None)
        return decode(box[0]) if result is None else result

    def min_over_stages(self, value: int, device: torch.device) -> int:
        """The smallest of the stages' `value`s: a number of KV blocks every stage holds."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


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
