"""One completion's state as the scheduler sees it.

The scheduler plans ahead of the worker: a request's `num_computed_tokens` advances when a
step is *scheduled*, and a token the worker will sample in that step is counted in
`num_pending` until the step's result arrives. `num_tokens` counts those pending
placeholders, so a decode step can be planned before the previous token is known. A
speculating request's drafts are computed but not counted in `num_tokens` (see core.py). An
embedding request samples nothing: it has no pending token, and ends when the worker
returns its embedding after the step that computed its last prompt token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.detok_window import context_span, detok_params, stop_lookback
from common.messages import DetokParams, ImageInput, LoRARequest, TokenLogprobs
from common.sampling_params import RequestOutputKind, SamplingParams
from common.speculative import NgramIndex
from common.tokens import slice_tokens


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    rid: str  # the client's request; n > 1 gives several completions of one rid
    index: int
    reply_to: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at first schedule, for stats
    status: Status = Status.WAITING
    on_worker: bool = False  # the worker holds this request's state
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    block_hashes: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    stamps: list[float] = field(default_factory=list)  # its way in, see common/hops.py
    embed: bool = False  # an embedding request (see the module doc)
    lora: LoRARequest | None = None  # its adapter, None: the base model
    images: list[ImageInput] = field(default_factory=list)  # its prompt's, in order
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for the next plan
    num_drafts_in_flight: int = 0  # drafts of the step whose result has not come back
    # its known tokens, indexed for ngram proposals as they become known
    ngram_index: NgramIndex = field(default_factory=NgramIndex)
    # a draft model's proposal (from the worker) and the num_known_tokens it follows
    proposal: list[int] = field(default_factory=list)
    proposal_after: int = 0
    # made once: every step's DetokItem of this request carries them
    detok_params: DetokParams = field(init=False)
    stop_lookback: int = field(init=False)
    context_span: int = field(init=False)  # the most tokens an item's context holds
    # one DetokItem at its end, not one a step (FINAL_ONLY without stop strings, whose
    # text could end it early); meanwhile its tokens' logprobs wait here
    final_only: bool = field(init=False)
    held_logprobs: list[TokenLogprobs] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.detok_params = detok_params(self.params)
        self.stop_lookback = stop_lookback(self.params.stop)
        self.context_span = context_span(self.stop_lookback)
        self.final_only = (self.params.output_kind == RequestOutputKind.FINAL_ONLY
                           and not self.params.stop)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Sequence length including tokens sampled but not yet reported."""
        # num_known_tokens spelled out: read a few times per token, a nested property costs
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    def known_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) without copying the whole sequence."""
        return slice_tokens(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def lora_id(self) -> int | None:
        return None if self.lora is None else self.lora.lora_int_id

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)
