"""Structured outputs on the worker: where the grammar state lives, and why.

The worker holds it. Each structured completion (each of n > 1 its own) has an xgrammar
GrammarMatcher beside the rest of its state (services/worker/request_state.py), advanced
with every token it samples as the token reaches the host; its compiled grammar comes from
a cache keyed by the spec, compiled with the model's tokenizer over the logits' width.

Why not the scheduler, as vLLM keeps it: the scheduler plans a step or two ahead of the
tokens, so when it plans a step it does not know the token the mask of that step depends
on, and the worker does (it sampled it); a mask made there would also cross the bus every
step (vocabulary / 8 bytes a request: 6 KB for 49k tokens) and wait a hop for its token.
In the worker the mask costs the wait for the previous step's tokens, which the worker
does while the device runs this step's forward pass (the forward needs no host tokens:
model_runner.py), then a few microseconds a row on the host; a step with no structured
row does none of it. The tokenizer stage has checked every spec (common/structured_outputs.py);
should one still fail to compile here, its request runs unconstrained and the error is
logged, rather than failing the process.

The matcher lives and dies with the request's state: dropped on finish, abort and
preemption alike. A preempted request comes back with all its tokens and its new matcher
replays its outputs. Prefix caching is untouched: the KV cache does not depend on the
grammar. The mask is applied to the logits outside any CUDA graph (the graphs end at the
hidden states), first thing in the sampler, so logprobs describe the masked distribution
as vLLM's do (its mask, too, goes on before the sampler takes logprobs).

Ending: the matcher admits the request's EOS ids only where the grammar is complete, and
the scheduler ends a structured request at EOS whatever ignore_eos says: past the end the
grammar has nothing to admit. min_tokens holds EOS and stop_token_ids back only while the
grammar admits something else, so a grammar that can only end, ends. A row planned before
its end was known (the scheduler runs ahead) finds its matcher terminated and samples
unmasked; the scheduler drops that token with the rest of the step's for the request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from common.sampling_params import SamplingError, SamplingParams
from common.structured_outputs import load_xgrammar, spec_key, to_grammar
from services.worker.sampler import GrammarMask

log = logging.getLogger("headrace.worker.grammar")
CACHE_SIZE = 128  # compiled grammars kept: a compile is tens of ms for a 50k vocabulary

MaskRow = tuple[int, Any, Sequence[int]]  # (row in the step's batch, matcher, held back ids)


class Grammars:
    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int,
                 device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._load_tokenizer = load_tokenizer
        self._compiler: Any = None  # built at the first structured request
        self._cache: dict[str, Any] = {}  # spec key -> CompiledGrammar, least recent first

    def matcher(self, req_id: str, params: SamplingParams, output_ids: Sequence[int]
                ) -> Any | None:
        """A matcher past `output_ids`, stopping at the request's EOS ids; None where the
        grammar does not compile (logged)."""
        assert params.structured_outputs is not None
        try:
            compiled = self._compiled(params.structured_outputs)
        except SamplingError as e:
            log.error("request %s runs unconstrained: %s", req_id, e)
            return None
        matcher = load_xgrammar().GrammarMatcher(
            compiled, override_stop_tokens=list(params.eos_token_ids) or None)
        for token in output_ids:
            accept(matcher, token, req_id)
        return matcher

    def mask(self, rows: Sequence[MaskRow]) -> GrammarMask:
        """The bitmask of each row's next token, filled on the host and sent to the device
        (from pinned memory: the copy does not wait for the device)."""
        pinned = self.device.type == "cuda"
        words = -(-self.vocab_size // 32)
        bitmask = torch.empty((len(rows), words), dtype=torch.int32, pin_memory=pinned)
        for j, (_, matcher, held_back) in enumerate(rows):
            matcher.fill_next_token_bitmask(bitmask, j)
            if held_back:
                hold_back(bitmask[j].numpy().view(np.uint32), held_back)
        index = torch.tensor([row for row, _, _ in rows], dtype=torch.int64,
                             pin_memory=pinned)
        return GrammarMask(bitmask.to(self.device, non_blocking=True),
                           index.to(self.device, non_blocking=True))

    def _compiled(self, spec: dict[str, Any]) -> Any:
        key = spec_key(spec)
        compiled = self._cache.pop(key, None)
        if compiled is None:
            compiled = self._compiler_for_model().compile_grammar(to_grammar(spec))
        self._cache[key] = compiled
        if len(self._cache) > CACHE_SIZE:
            del self._cache[next(iter(self._cache))]
        return compiled

    def _compiler_for_model(self) -> Any:
        if self._compiler is None:
            xgrammar = load_xgrammar()
            info = xgrammar.TokenizerInfo.from_huggingface(self._load_tokenizer(),
                                                           vocab_size=self.vocab_size)
            # the cache above keeps what is compiled, keyed by spec
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def accept(matcher: Any, token: int, req_id: str) -> None:
    """Advance a matcher by its request's sampled token. A terminated matcher takes no
    more: the tokens after its EOS are the ones the scheduler drops."""
    if not matcher.is_terminated() and not matcher.accept_token(token):
        log.warning("request %s: the grammar refused sampled token %d", req_id, token)


def hold_back(words: np.ndarray, token_ids: Sequence[int]) -> None:
    """Clear the bits of `token_ids` in one row of the bitmask, unless that would leave
    no token allowed (min_tokens gives way to a grammar that can only end)."""
    kept = words.copy()
    for token in token_ids:
        if token < 32 * len(words):
            kept[token >> 5] &= ~np.uint32(1 << (token & 31))
    if kept.any():
        words[:] = kept
