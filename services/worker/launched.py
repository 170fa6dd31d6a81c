"""A step launched on the device, and its result once its tokens are on the host.

Everything a step sends back (sampled tokens with their logprobs, verified drafts, the
draft model's proposals, embeddings) is copied to pinned host memory behind one CUDA event, recorded
after the last copy, so a single wait covers them all; on the CPU the values are on the
host already. The pinned blocks are the worker's, taken back once the step is finished.
Finishing a step appends its tokens to their requests (and their grammars) and turns them
into the StepResult the scheduler reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.messages import PooledOutput, PromptLogprobs, StepResult, with_fields
from services.worker.device_time import DeviceTimer, Span, mark
from services.worker.grammar import accept
from services.worker.request_state import RequestState
from services.worker.sampler import LogprobsLayout, unpack_logprobs
from services.worker.spec_verify import emitted_tokens


class PinnedBlocks:
    """Pinned host blocks for steps' outputs, each reused once its step is finished: a
    fresh block from torch's caching host allocator every step cost an H200's host 6-19 us
    a step more than a reused one (benchmarks/gpu/input_copies.py, issue 31)."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.Tensor]] = {}  # by size, powers of two

    def take(self, nbytes: int) -> torch.Tensor:
        size = max(64, 1 << max(nbytes - 1, 0).bit_length())
        free = self._free.get(size)
        return free.pop() if free else torch.empty(size, dtype=torch.uint8, pin_memory=True)

    def give_back(self, blocks: list[torch.Tensor]) -> None:
        for block in blocks:
            self._free.setdefault(block.numel(), []).append(block)


@dataclass(slots=True)
class Launched:
    """A step whose work is queued on the device; its tokens land in `host` when `done`
    fires."""
    step: int
    prompt_logprobs: list[PromptLogprobs]
    sampling: list[RequestState] = field(default_factory=list)
    # SamplerOutput.packed: a token per sampling row, then their logprobs if any
    host: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    done: torch.cuda.Event | None = None
    logprobs: LogprobsLayout | None = None  # which rows of `host` have logprobs
    on_host_at: float = 0.0  # wall clock; set at launch on a synchronous device (the CPU)
    pooled_states: list[RequestState] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # their embeddings, a row each, on the host when done
    spec: list[RequestState] = field(default_factory=list)  # verified drafts' requests
    spec_host: torch.Tensor | None = None  # spec_verify.verify's rows for them
    drafted: list[RequestState] = field(default_factory=list)  # the draft model's rows
    drafts_host: torch.Tensor | None = None  # their proposals, k each
    pinned: PinnedBlocks | None = None  # where the copies land, on a GPU
    blocks: list[torch.Tensor] = field(default_factory=list)  # those taken from it
    span: Span | None = None  # the device's time on the step (device_time.py)

    def to_host(self, values: torch.Tensor) -> torch.Tensor:
        """`values` on the host once `done` fires: the event is recorded again after each
        copy, so it stands for all of the step's."""
        if values.device.type != "cuda":
            return values
        assert self.pinned is not None
        nbytes = values.numel() * values.element_size()
        self.blocks.append(self.pinned.take(nbytes))
        host = self.blocks[-1][:nbytes].view(values.dtype).view(values.shape)
        host.copy_(values, non_blocking=True)
        self.done = mark(values.device)
        return host


def finish(launched: Launched, timer: DeviceTimer) -> StepResult:
    """The step's result, once its tokens are on the host; they are appended to their
    requests. `timer` measures its span, and earlier ones that ended."""
    if launched.done is not None:
        launched.done.synchronize()
    # when the tokens reached the host: the worker shell adds the plan's and the start's
    on_host = launched.on_host_at or time.time()
    token_ids = _append_sampled(launched)
    req_ids = [s.req_id for s in launched.sampling]
    logprobs = unpack_logprobs(launched.host, len(launched.sampling), launched.logprobs)
    num_tokens: list[int] = []
    if launched.spec_host is not None:  # then 1 + accepted tokens per speculating row
        emitted = _append_verified(launched)
        num_tokens = [1] * len(token_ids) + [len(tokens) for tokens in emitted]
        req_ids += [s.req_id for s in launched.spec]
        token_ids += [token for tokens in emitted for token in tokens]
        if logprobs is not None:  # the speculating rows asked for none
            logprobs = with_fields(logprobs, widths=logprobs.widths + [0] * len(launched.spec))
    num_drafts, drafts = _proposals(launched, req_ids)
    result = StepResult(step=launched.step, req_ids=req_ids,
                        token_ids=token_ids, logprobs=logprobs,
                        prompt_logprobs=launched.prompt_logprobs,
                        device_ms=timer.take_ms(launched.span),
                        stamps=[on_host], embeddings=_embeddings(launched),
                        num_tokens=num_tokens, num_draft_tokens=num_drafts,
                        draft_token_ids=drafts)
    if launched.pinned is not None:  # the result holds copies: the blocks are free again
        launched.pinned.give_back(launched.blocks)
    return result


def _append_sampled(launched: Launched) -> list[int]:
    """The sampled tokens, each appended to its request (and its grammar)."""
    token_ids = launched.host[:len(launched.sampling)].tolist()
    for state, token in zip(launched.sampling, token_ids):
        state.output_ids.append(token)
        state.pending -= 1
        if state.matcher is not None:
            accept(state.matcher, token, state.req_id)
    return token_ids


def _append_verified(launched: Launched) -> list[list[int]]:
    """Each speculating request's accepted drafts and own token, appended to it."""
    assert launched.spec_host is not None
    emitted = [emitted_tokens(row) for row in launched.spec_host.tolist()]
    for state, tokens in zip(launched.spec, emitted):
        state.output_ids += tokens
        state.pending -= 1
    return emitted


def _proposals(launched: Launched, req_ids: list[str]) -> tuple[list[int], list[int]]:
    """StepResult's num_draft_tokens and draft_token_ids, in the order of req_ids."""
    if launched.drafts_host is None:
        return [], []
    by_id = dict(zip((s.req_id for s in launched.drafted), launched.drafts_host.tolist()))
    drafts = [by_id.get(req_id, []) for req_id in req_ids]
    return [len(d) for d in drafts], [t for d in drafts for t in d]


def _embeddings(launched: Launched) -> list[PooledOutput]:
    """A completed step's embeddings, each as its little-endian float32 bytes."""
    if launched.pooled is None:
        return []
    vectors = launched.pooled.numpy().astype("<f4", copy=False)
    return [PooledOutput(state.req_id, vector.tobytes())
            for state, vector in zip(launched.pooled_states, vectors)]
