"""What the worker keeps of each request between steps: its tokens (it sampled them, so a
plan carries none), its row of the block table (services/worker/block_table.py), and the
per-request state of sampling, grammars, pooling and adapters. Made from a plan's
NewRequest, grown by its CachedRequest and by the tokens the worker samples, dropped when
the plan lists it as finished."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field
from typing import Any

import numpy as np
import torch

from common.messages import ImageInput, LoRARequest, NewRequest
from common.sampling_params import SamplingParams
from common.tokens import slice_tokens
from services.worker.block_table import BlockTable
from services.worker.sampler import SamplingRow, has_penalty, make_generator


@dataclass(slots=True)
class RequestState:
    req_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    table_row: int  # its blocks' row of the worker's BlockTable
    params: SamplingParams
    generator: torch.Generator | None
    pending: int = 0  # tokens sampled by launched steps, not yet copied back to the host
    sample_row: int = 0  # this request's row in the last launched step's samples
    structured: bool = False  # has a grammar (cleared if it fails to compile)
    matcher: Any = None  # its xgrammar GrammarMatcher, made at its first sampling step
    embed: bool = False  # an embedding request: pooled, never sampled
    pooled: torch.Tensor | None = None  # its pooling's running state (Pooler.add_chunk)
    lora: LoRARequest | None = None  # the adapter it runs under, None: the base model
    images: list[ImageInput] = field(default_factory=list)  # its prompt's, in order
    # a vision-language model's three positions of each prompt token, and what later
    # tokens add to their index (services/worker/models/qwen2_vl.mrope_positions);
    # None: every axis is the token's index
    mrope: np.ndarray | None = None
    mrope_delta: int = 0
    # Made once: its lists are the ones the request grows, and a 256-row step made one a
    # row each time, as it asked each row's fixed penalties again (issue 31).
    _row: SamplingRow = field(init=False)
    _penalised: bool = field(init=False)
    # it pools or asks for prompt logprobs: a step's inputs look such rows up by index
    special: bool = field(init=False)

    def __post_init__(self) -> None:
        self._row = SamplingRow(self.params, self.prompt_ids, self.output_ids, self.generator)
        self.special = self.embed or self.params.prompt_logprobs is not None
        self._penalised = (has_penalty(self.params)
                           or any(len(word) > 1 for word in self.params.bad_words_token_ids))

    @classmethod
    def new(cls, new: NewRequest, device: torch.device, table: BlockTable) -> RequestState:
        params = new.params
        generator = None if params.seed is None else make_generator(params.seed, device)
        return cls(new.req_id, list(new.token_ids[:new.num_prompt_tokens]),
                   list(new.token_ids[new.num_prompt_tokens:]), table.add(new.block_ids),
                   params, generator, structured=params.structured_outputs is not None,
                   embed=new.embed, lora=new.lora, images=list(new.images))

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host (the pending one excluded)."""
        return len(self.prompt_ids) + len(self.output_ids)

    def needs_history(self) -> bool:
        """Penalties, min_tokens, grammars and bad words of several tokens read the output
        so far."""
        return (self._penalised or self.structured
                or self.params.min_tokens > len(self.output_ids))

    def held_back(self) -> tuple[int, ...]:
        """The ids min_tokens keeps a structured request from sampling yet."""
        p = self.params
        if len(self.output_ids) >= p.min_tokens:
            return ()
        return (*p.eos_token_ids, *p.stop_token_ids)

    def tokens(self, start: int, end: int) -> list[int]:
        return slice_tokens(self.prompt_ids, self.output_ids, start, end)

    def sampling_row(self) -> SamplingRow:
        return self._row
