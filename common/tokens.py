"""Rules about token ids that more than one stage applies."""

from __future__ import annotations

from collections.abc import Sequence

from common.errors import ApiError


def check_vocabulary(ids: Sequence[object], vocab_size: int, param: str) -> None:
    """Every id an integer in [0, vocab_size), or a 400 naming the first that is not."""
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(400, f"Token id {bad!r} is out of vocabulary: token ids must be "
                            f"integers in [0, {vocab_size}).", param)


def slice_tokens(prompt: list[int], output: list[int], start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output, without building the whole sequence."""
    num_prompt = len(prompt)
    if end <= num_prompt:
        return prompt[start:end]
    if start >= num_prompt:
        return output[start - num_prompt:end - num_prompt]
    return prompt[start:] + output[:end - num_prompt]
