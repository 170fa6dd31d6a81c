"""Speculative decoding settings (vLLM's --speculative-config), the ngram proposer, and
which requests may speculate.

The ngram method (prompt lookup) drafts from the request's own tokens: a pure function of
them, so it runs in the scheduler, which knows every request's tokens (the worker would
have to send its proposals back before the scheduler could budget and place them).

The draft_model method drafts with a small model that shares the target's vocabulary. It
needs the model's weights and KV cache, so it runs in the worker, right after each step's
sampling: its greedy drafts come back with the step's tokens and the scheduler places them
in the request's next step, as it places ngram drafts (services/worker/draft.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.sampling_params import SamplingParams

NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
DRAFT_MODEL_KEYS = ("method", "model", "num_speculative_tokens", "draft_tensor_parallel_size")
UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp")


class SpeculativeConfigError(ValueError):
    """A speculative config headrace cannot run (common/config.py reports it)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 0  # ngram only
    prompt_lookup_min: int = 0  # ngram only
    method: str = "ngram"
    model: str | None = None  # draft_model: the draft's directory, .gguf or hub id

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise SpeculativeConfigError("num_speculative_tokens must be at least 1, got "
                                         f"{self.num_speculative_tokens}")
        if self.method == "draft_model":
            if not self.model:
                raise SpeculativeConfigError("draft_model needs the draft's \"model\"")
        elif not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeConfigError(
                "ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's object. As in vLLM, a "model" without a method is a draft model, and for
        ngram a missing prompt_lookup_min defaults to prompt_lookup_max and vice versa."""
        method = value.get("method") or ("draft_model" if "model" in value else None)
        if method in UNSUPPORTED_METHODS:
            raise SpeculativeConfigError(f"speculative method {method!r} is not supported: "
                                         "ngram and draft_model only")
        if method == "draft_model":
            return cls._draft_model(value)
        if method != "ngram":
            raise SpeculativeConfigError("speculative method must be 'ngram' or "
                                         f"'draft_model', got {method!r}")
        _check_keys("ngram", value, NGRAM_KEYS)
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if not isinstance(k, int) or not all(isinstance(v, (int, type(None))) for v in (lo, hi)):
            raise SpeculativeConfigError("ngram needs an integer num_speculative_tokens (and "
                                         "integer prompt_lookup_max/min)")
        if lo is None and hi is None:
            raise SpeculativeConfigError("ngram needs prompt_lookup_max or prompt_lookup_min")
        return cls(k, hi if hi is not None else lo, lo if lo is not None else hi)

    @classmethod
    def _draft_model(cls, value: dict[str, Any]) -> SpeculativeConfig:
        _check_keys("draft_model", value, DRAFT_MODEL_KEYS)
        k, model = value.get("num_speculative_tokens"), value.get("model")
        if not isinstance(k, int) or not isinstance(model, str):
            raise SpeculativeConfigError("draft_model needs a string \"model\" and an integer "
                                         "num_speculative_tokens")
        if value.get("draft_tensor_parallel_size", 1) != 1:
            raise SpeculativeConfigError(
                "draft_tensor_parallel_size must be 1: the draft runs whole on the first GPU")
        return cls(k, method="draft_model", model=model)


def _check_keys(method: str, value: dict[str, Any], known: tuple[str, ...]) -> None:
    unknown = set(value) - set(known)
    if unknown:
        raise SpeculativeConfigError(f"unknown {method} speculative settings "
                                     f"{sorted(unknown)}; known: {list(known)}")


def may_speculate(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a request's next step may carry drafts: the worker's verification
    (services/worker/spec_verify.py) needs raw logits, so none of the per-token state
    (penalties, min_tokens, logprobs, bias, allowed ids, bad words, grammars) that the
    worker applies one token at a time."""
    return (params.structured_outputs is None and params.logprobs is None
            and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
            and params.repetition_penalty == 1.0 and params.min_tokens <= num_output_tokens
            and params.logit_bias is None and params.allowed_token_ids is None
            and not params.bad_words_token_ids)


class NgramIndex:
    """A request's tokens and where each token occurs, grown as tokens arrive, so that a
    proposal costs what its candidate matches cost rather than a scan of the whole context
    (1.3 ms a request and step at 32k tokens in Python)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.positions: dict[int, list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.positions.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def propose(self, k: int, min_n: int, max_n: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix
        of the tokens (max_n down to min_n long); [] when no such suffix occurred before."""
        tokens = self.tokens
        last = len(tokens) - 1
        if last < 1:
            return []
        ends = self.positions[tokens[last]]  # ascending; its own last entry is `last`
        for n in range(min(max_n, last), min_n - 1, -1):
            suffix = tokens[last - n + 1:]
            for j in range(len(ends) - 2, -1, -1):  # latest first: its most recent context
                end = ends[j]
                if end >= n - 1 and tokens[end - n + 1:end + 1] == suffix:
                    return tokens[end + 1:end + 1 + k]
        return []


def split_drafts(counts: Sequence[int], flat: Sequence[int], rows: int) -> list[list[int]]:
    """The per-request lists that the messages carry flat beside their counts (StepPlan's
    drafts, StepResult's proposals); `rows` empty lists when there are no counts."""
    if not counts:
        return [[] for _ in range(rows)]
    ends = itertools.accumulate(counts)
    return [list(flat[end - n:end]) for n, end in zip(counts, ends)]


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """NgramIndex.propose on `tokens` from scratch."""
    index = NgramIndex()
    index.extend(tokens)
    return index.propose(k, min_n, max_n)
