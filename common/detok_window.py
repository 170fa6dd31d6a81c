"""The detokenization window: what context the scheduler sends with each step's new tokens
so that any detokenizer replica can turn them into text on its own (see
services/detokenizer/core.py for how the window is read). Both sides apply these rules."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from common.messages import DetokParams
from common.sampling_params import SamplingParams
from common.tokens import slice_tokens

MAX_CHAR_BYTES = 4  # a UTF-8 character; a byte token carries one of its bytes
# The window without stop strings: up to 3 tokens of a character begun before it, up to 3
# of one not finished after it, and room for a few whole characters between.
BASE_CONTEXT_TOKENS = 16


def stop_lookback(stop: Sequence[str]) -> int:
    """Characters before the new text where a stop string ending in it may start."""
    return max(map(len, stop)) - 1 if stop else 0


def make_context(prompt_ids: list[int], output_ids: list[int], num_new: int,
                 stop_buffer_chars: int) -> tuple[list[int], int]:
    """(context_ids, num_context_prompt) for a DetokItem of the last `num_new` of
    `output_ids`. `stop_buffer_chars` is the stop look-back, `stop_lookback(params.stop)`;
    each of those characters may take MAX_CHAR_BYTES byte tokens. The two lists are
    sliced, never joined: the scheduler builds one context per token it reports."""
    if not 0 <= num_new <= len(output_ids):
        raise ValueError(f"{num_new} new tokens do not fit the {len(output_ids)} output "
                         "tokens")
    end = len(prompt_ids) + len(output_ids) - num_new
    return context_before(prompt_ids, output_ids, end, context_span(stop_buffer_chars))


def context_before(prompt_ids: list[int], output_ids: list[int], end: int, span: int
                   ) -> tuple[list[int], int]:
    """make_context of the new tokens from position `end` on, for a request whose span is
    known: the served scheduler keeps it on the request and asks this for every
    one-token row it applies."""
    num_prompt = len(prompt_ids)
    start = max(0, end - span)
    return slice_tokens(prompt_ids, output_ids, start, end), max(0, num_prompt - start)


def context_span(stop_buffer_chars: int) -> int:
    """How many tokens before the new ones a context holds at most, for a request of this
    stop look-back."""
    return BASE_CONTEXT_TOKENS + MAX_CHAR_BYTES * stop_buffer_chars


def detok_params(params: SamplingParams) -> DetokParams:
    """The request's DetokParams, one object for all requests whose are equal: a
    TokenBatch carries each distinct object once (common/token_columns.py)."""
    return _shared_detok_params(tuple(params.stop), params.skip_special_tokens,
                                params.spaces_between_special_tokens,
                                params.include_stop_str_in_output)


@functools.lru_cache(maxsize=1024)
def _shared_detok_params(stop: tuple[str, ...], skip_special_tokens: bool,
                         spaces_between_special_tokens: bool,
                         include_stop_str_in_output: bool) -> DetokParams:
    return DetokParams(list(stop), skip_special_tokens, spaces_between_special_tokens,
                       include_stop_str_in_output)
