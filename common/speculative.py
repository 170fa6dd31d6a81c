"""Speculative decoding settings (vLLM's --speculative-config) and the ngram proposer.

The ngram method (prompt lookup) drafts from the request's own tokens: a pure function of
them, so it runs in the scheduler, which knows every request's tokens (the worker would
have to send its proposals back before the scheduler could budget and place them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NGRAM_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


class SpeculativeConfigError(ValueError):
    """A speculative config headrace cannot run (common/config.py reports it)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise SpeculativeConfigError("num_speculative_tokens must be at least 1, got "
                                         f"{self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise SpeculativeConfigError(
                "ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's object; a draft model is not supported yet. As in vLLM, a missing
        prompt_lookup_min defaults to prompt_lookup_max and vice versa."""
        method = value.get("method")
        if "model" in value or method in ("draft_model", "eagle", "eagle3", "medusa",
                                          "mlp_speculator", "deepseek_mtp"):
            raise SpeculativeConfigError(
                f"speculative method {method or 'draft_model'!r} is not supported yet: "
                "ngram only")
        if method != "ngram":
            raise SpeculativeConfigError(f"speculative method must be 'ngram', got {method!r}")
        unknown = set(value) - set(NGRAM_KEYS)
        if unknown:
            raise SpeculativeConfigError(f"unknown ngram speculative settings {sorted(unknown)}; "
                                         f"known: {list(NGRAM_KEYS)}")
        k = value.get("num_speculative_tokens")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if not isinstance(k, int) or not all(isinstance(v, (int, type(None))) for v in (lo, hi)):
            raise SpeculativeConfigError("ngram needs an integer num_speculative_tokens (and "
                                         "integer prompt_lookup_max/min)")
        if lo is None and hi is None:
            raise SpeculativeConfigError("ngram needs prompt_lookup_max or prompt_lookup_min")
        return cls(k, hi if hi is not None else lo, lo if lo is not None else hi)


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


def propose_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """NgramIndex.propose on `tokens` from scratch."""
    index = NgramIndex()
    index.extend(tokens)
    return index.propose(k, min_n, max_n)
