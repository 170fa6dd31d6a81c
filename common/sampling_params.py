"""Sampling parameters, with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


class SamplingError(ValueError):
    """An invalid sampling parameter; `param` names it (OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Set by the tokenizer stage from the model, not by users: EOS ids end a request
    # unless ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "eos_token_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            elif isinstance(value, (str, int)):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n must be at least 1", "n", self.n)
        _check(-2.0 <= self.presence_penalty <= 2.0,
               "presence_penalty must be in [-2, 2]", "presence_penalty", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               "frequency_penalty must be in [-2, 2]", "frequency_penalty",
               self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be greater than 0",
               "repetition_penalty", self.repetition_penalty)
        _check(self.temperature >= 0.0, "temperature must be non-negative", "temperature",
               self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]", "top_p", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               "top_k must be 0 or -1 (disabled) or a positive integer", "top_k", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]", "min_p", self.min_p)
        _check(self.seed is None or isinstance(self.seed, int), "seed must be an integer",
               "seed", self.seed)
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                           and self.max_tokens >= 1),
               "max_tokens must be at least 1", "max_tokens", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
               "min_tokens must be non-negative", "min_tokens", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens must not exceed max_tokens", "min_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 0),
                   f"{name} must be a non-negative integer", name, value)
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be non-empty strings", "stop", self.stop)
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids",
               self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def stop_buffer_chars(self) -> int:
        """Characters of text held back while streaming so a stop string never leaks."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def check_logprobs(self, max_logprobs: int) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value <= max_logprobs,
                   f"{name} must be at most {max_logprobs} (--max-logprobs)", name, value)


def _check(ok: bool, message: str, param: str, value: Any) -> None:
    if not ok:
        raise SamplingError(f"{message}, got {value!r}", param)
