"""Sampling parameters, with vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
import typing
from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any

_GREEDY_EPS = 1e-5
_INT64 = 2**63
_INT32 = 2**31  # token ids travel as packed int32
MAX_N = 128  # completions per request
# vLLM's structured_outputs keys, one per request (common/structured_outputs.py compiles them)
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class SamplingError(ValueError):
    """An invalid sampling parameter; `param` names it (OpenAI's error field)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestOutputKind(enum.IntEnum):
    """vLLM's: what a caller of the engine gets back while a completion runs. The offline
    LLM asks for FINAL_ONLY, as vLLM's does: its completions' text is then detokenized
    once, at their end, instead of a step at a time (services/scheduler/core.py). A request
    with stop strings still goes a step at a time, since its text decides where it ends."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


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
    # vLLM's: exactly one of {"json": schema, "json_object": true, "regex": str,
    # "choice": [str, ...], "grammar": EBNF}. Plain `dict`, not dict[str, Any]: the gateway's
    # and the tokenizer's JSON types derive from the annotation. Left out of the hash, which
    # a dict has none of.
    structured_outputs: dict | None = field(default=None, hash=False)
    # OpenAI's: added to a token's logit before sampling, clamped to [-100, 100] as vLLM
    # does; JSON's string keys ("50256") become ids.
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    allowed_token_ids: tuple[int, ...] | None = None  # vLLM's: sample only among these
    # vLLM's: generate best_of completions, return the n of highest cumulative logprob
    # (the gateway and the offline LLM choose; the engine runs best_of completions).
    best_of: int | None = None
    # vLLM's: words never generated. The tokenizer stage spells each as token ids
    # (bad_words_token_ids), with and without a leading space, as vLLM does.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default=(), repr=False)
    # vLLM's; set by the offline LLM, never by a client of the server
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        for name in ("stop", "stop_token_ids", "eos_token_ids", "bad_words"):
            value = getattr(self, name)
            if value is None:
                value = ()
            elif isinstance(value, (str, int)):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        for name in _FLOAT_FIELDS:  # JSON's 2 is a float here; the bus carries it as one
            value = getattr(self, name)
            if _is_int(value):
                try:
                    object.__setattr__(self, name, float(value))
                except OverflowError:
                    raise SamplingError(f"{name} is too large for a 64-bit float, got "
                                        f"{value}", name) from None
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs",
                               _plain_structured_outputs(self.structured_outputs))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if not isinstance(self.bad_words_token_ids, tuple) or any(
                not isinstance(w, tuple) for w in self.bad_words_token_ids):
            object.__setattr__(self, "bad_words_token_ids",
                               tuple(tuple(w) for w in self.bad_words_token_ids))
        self._validate()

    def _validate(self) -> None:
        # Every integer crosses the bus as MessagePack, which holds 64 bits.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(not _is_int(value) or fits_int64(value),
                   f"{name} must be a 64-bit integer", name, value)
        # n completions cost n requests' state in every stage: OpenAI's own bound.
        _check(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}]", "n",
               self.n)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2.0 <= value <= 2.0, f"{name} must be in [-2, 2]",
                   name, value)
        _check(_is_number(self.repetition_penalty) and math.isfinite(self.repetition_penalty)
               and self.repetition_penalty > 0.0, "repetition_penalty must be a finite number "
               "greater than 0", "repetition_penalty", self.repetition_penalty)
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0.0, "temperature must be a finite non-negative number",
               "temperature", self.temperature)
        _check(_is_number(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]",
               "top_p", self.top_p)
        _check(_is_int(self.top_k) and self.top_k >= 0,
               "top_k must be 0 or -1 (disabled) or a positive integer", "top_k", self.top_k)
        _check(_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]",
               "min_p", self.min_p)
        _check(self.seed is None or _is_int(self.seed), "seed must be a 64-bit integer",
               "seed", self.seed)
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens must be at least 1", "max_tokens", self.max_tokens)
        _check(_is_int(self.min_tokens) and self.min_tokens >= 0,
               "min_tokens must be non-negative", "min_tokens", self.min_tokens)
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens,
               "min_tokens must not exceed max_tokens", "min_tokens", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and value >= 0),
                   f"{name} must be a non-negative integer", name, value)
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be non-empty strings", "stop", self.stop)
        for name in ("stop_token_ids", "eos_token_ids"):
            value = getattr(self, name)
            _check(all(_is_int(t) and 0 <= t < _INT32 for t in value),
                   f"{name} must be token ids (integers in [0, 2**31))", name, value)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a boolean", name,
                   getattr(self, name))
        if self.structured_outputs is not None:
            _check_structured_outputs(self.structured_outputs)
        _check(self.allowed_token_ids is None or (
            isinstance(self.allowed_token_ids, tuple) and self.allowed_token_ids != ()
            and all(_is_int(t) and 0 <= t < _INT32 for t in self.allowed_token_ids)),
            "allowed_token_ids must be a non-empty list of token ids (integers in "
            "[0, 2**31))", "allowed_token_ids", self.allowed_token_ids)
        _check(self.best_of is None or (_is_int(self.best_of) and self.n <= self.best_of
                                        <= MAX_N),
               f"best_of must be an integer in [n, {MAX_N}] (n is {self.n})", "best_of",
               self.best_of)
        _check(all(isinstance(w, str) and w.strip() for w in self.bad_words),
               "bad_words must be non-empty strings", "bad_words", self.bad_words)
        _check(all(w and all(_is_int(t) and 0 <= t < _INT32 for t in w)
                   for w in self.bad_words_token_ids),
               "bad_words_token_ids must be non-empty lists of token ids",
               "bad_words_token_ids", self.bad_words_token_ids)

    @property
    def num_generated(self) -> int:
        """How many completions the engine runs: best_of, or n."""
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def check_logprobs(self, max_logprobs: int) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value <= max_logprobs,
                   f"{name} must be at most {max_logprobs} (--max-logprobs)", name, value)


_INT_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                    if f.type in ("int", "int | None"))
_FLOAT_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.type == "float")
# Set by the tokenizer stage from the model, or by the offline LLM; never by a client.
INTERNAL_PARAMS = frozenset({"eos_token_ids", "bad_words_token_ids", "output_kind"})
# Every parameter a client may set, in field order: the one list the gateway, the tokenizer
# stage and `headrace generate` derive theirs from.
CLIENT_PARAMS = tuple(f.name for f in dataclasses.fields(SamplingParams)
                      if f.name not in INTERNAL_PARAMS)
_HINTS = typing.get_type_hints(SamplingParams)
_JSON_KINDS: dict[type, tuple[type, ...]] = {int: (int,), float: (int, float), bool: (bool,),
                                             str: (str,), tuple: (list,), dict: (dict,)}
_JSON_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
               list: "a list", dict: "an object"}


def json_kinds(name: str) -> tuple[type, ...]:
    """The JSON types a client may send for parameter `name` (null aside): a float
    parameter takes integers too, a tuple parameter a list."""
    hint = _HINTS[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    return _JSON_KINDS[typing.get_origin(hint) or hint]


def check_json_type(name: str, value: Any, kinds: tuple[type, ...]) -> None:
    """A SamplingError naming `name` unless `value` has one of the JSON types `kinds` (a
    JSON true is not a number)."""
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        wanted = " or ".join(_JSON_NAMES[k] for k in kinds)
        got = _JSON_NAMES.get(type(value), type(value).__name__)
        raise SamplingError(f"{name!r} must be {wanted}, got {got}", name)


def best_of_indices(cumulative_logprobs: Sequence[float], n: int) -> list[int]:
    """The indices of the n completions of highest cumulative logprob, best first (the
    earlier of a tie first): what best_of returns."""
    order = sorted(range(len(cumulative_logprobs)), key=lambda i: -cumulative_logprobs[i])
    return order[:n]


def fits_int64(value: int) -> bool:
    """Whether MessagePack, and so the bus, can carry this integer."""
    return -_INT64 <= value < _INT64


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str, param: str, value: Any) -> None:
    if not ok:
        raise SamplingError(f"{message}, got {value!r}", param)


def _plain_structured_outputs(spec: Any) -> Any:
    """A private copy of plain JSON, as the bus carries it: keys set to None dropped (a
    serialized vLLM StructuredOutputsParams has them all) and a schema given as a JSON
    string parsed. What does not fit is left for _check_structured_outputs to name."""
    if not isinstance(spec, dict):
        return spec
    spec = {key: value for key, value in spec.items() if value is not None}
    if isinstance(spec.get("json"), str):
        try:
            spec["json"] = json.loads(spec["json"])
        except ValueError:
            return spec
    try:
        return json.loads(json.dumps(spec))
    except (TypeError, ValueError, RecursionError):  # no JSON form, or absurdly deep
        return spec


_MAX_BIAS = 100.0  # OpenAI's range; vLLM clamps what lies outside it


def _logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias} from a dict keyed by ids or by their decimal strings (JSON's)."""
    name = "logit_bias"
    _check(isinstance(bias, dict), f"{name} must be an object mapping token ids to numbers",
           name, bias)
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        _check(_is_int(token) and 0 <= token < _INT32, f"{name} keys must be token ids "
               "(integers in [0, 2**31))", name, bias)
        _check(_is_number(value) and math.isfinite(value),
               f"{name} values must be finite numbers", name, bias)
        out[token] = max(-_MAX_BIAS, min(_MAX_BIAS, float(value)))
    return out


def _check_structured_outputs(spec: Any) -> None:
    """The shape of each kind; whether xgrammar takes the schema, regex or grammar is the
    tokenizer stage's check (common/structured_outputs.py)."""
    name = "structured_outputs"
    kinds = ", ".join(STRUCTURED_KINDS)
    _check(isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in STRUCTURED_KINDS,
           f"{name} must be an object with exactly one of the keys {kinds}", name, spec)
    _check(_bus_safe(spec), f"{name} must hold JSON values only, nested at most "
           f"{_MAX_JSON_DEPTH} deep, with integers of 64 bits", name, spec)
    kind, value = next(iter(spec.items()))
    if kind == "json" and isinstance(value, str):
        try:
            json.loads(value)
        except ValueError as e:
            raise SamplingError(f"{name}.json is not valid JSON: {e}", name) from None
    _check(_STRUCTURED_SHAPES[kind][0](value), f"{name}.{kind} must be "
           f"{_STRUCTURED_SHAPES[kind][1]}", name, value)


_MAX_JSON_DEPTH = 64  # far past any real schema; deeper ones would only strain the stages


def _bus_safe(value: Any, depth: int = 0) -> bool:
    """Plain JSON that MessagePack carries: string keys, integers that fit 64 bits."""
    if depth > _MAX_JSON_DEPTH:
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _bus_safe(v, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return all(_bus_safe(v, depth + 1) for v in value)
    if _is_int(value):
        return fits_int64(value)
    return value is None or isinstance(value, (str, float, bool))


_STRUCTURED_SHAPES: dict[str, tuple[Any, str]] = {
    "json": (lambda v: isinstance(v, dict), "a JSON schema (an object, or a string holding one)"),
    "json_object": (lambda v: v is True, "true"),
    "regex": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "choice": (lambda v: isinstance(v, list) and v != [] and all(isinstance(c, str) for c in v),
               "a non-empty list of strings"),
    "grammar": (lambda v: isinstance(v, str) and v.strip() != "",
                "a non-empty string (an EBNF grammar with a root rule)"),
}
