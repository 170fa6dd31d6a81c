"""Beam search above the engine, as vLLM v1 runs it: each round asks the engine for one
token of every live beam, with the logprobs of its 2 * beam_width likeliest next tokens,
and keeps the beam_width best extensions. The engine sees ordinary one-token requests
whose prompts share their prefixes, which its prefix cache holds.

`BeamSearch` is one prompt's search, without I/O: the offline LLM and the gateway drive
it (services/offline/llm.py, services/gateway/beam.py), sending each round's requests and
handing back what they answered. Beams are ranked by vLLM's score, the cumulative logprob
over the length ** length_penalty, the length counting the prompt (an EOS aside).

Stop strings (beyond vLLM's beam search, which has none) end a beam as an EOS does: a
candidate whose generated text, decoded by the driver's `decode`, contains one is set
aside as ended, its text cut before the stop string (or after it, with
include_stop_str_in_output); its tokens stay whole, as a sampled request's do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.sampling_params import SamplingError, SamplingParams


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams, and early_stopping: end the search once beam_width beams
    have ended (transformers' early_stopping=True)."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False
    stop: Sequence[str] = ()  # strings that end a beam (a list is kept as a tuple)

    def __post_init__(self) -> None:
        _check(isinstance(self.stop, (list, tuple)) and all(
               isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings", "stop", self.stop)
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(_is_int(self.beam_width) and self.beam_width >= 1,
               "beam_width must be a positive integer", "beam_width", self.beam_width)
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1,
               "max_tokens must be a positive integer", "max_tokens", self.max_tokens)
        _check(_is_number(self.temperature) and math.isfinite(self.temperature)
               and self.temperature >= 0.0, "temperature must be a finite non-negative "
               "number", "temperature", self.temperature)
        _check(_is_number(self.length_penalty) and math.isfinite(self.length_penalty),
               "length_penalty must be a finite number", "length_penalty",
               self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "early_stopping"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a boolean", name,
                   getattr(self, name))

    def round_params(self) -> SamplingParams:
        """What each round asks of the engine for one beam."""
        return SamplingParams(max_tokens=1, logprobs=2 * self.beam_width,
                              temperature=float(self.temperature))


@dataclass(slots=True)
class BeamSearchSequence:
    """A beam: the prompt's tokens and those it generated (an ending EOS included), the
    logprobs each round offered it ({token id: logprob}), and how it ended (None while
    live; "length" when max_tokens ran out)."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_text: str | None = None  # a stop string ended it: the generated text, cut


@dataclass(slots=True)
class BeamSearchOutput:
    """One prompt's best beams, best first."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: Sequence[int], cum_logprob: float,
                      eos_token_ids: Sequence[int], length_penalty: float = 1.0) -> float:
    """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, the length
    counting every token but an ending EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


class BeamSearch:
    def __init__(self, prompt_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: Sequence[int], max_model_len: int | None = None,
                 decode: Callable[[Sequence[int]], str] | None = None) -> None:
        """`max_model_len`: a beam stops ("length") where the context is full. `decode`:
        generated tokens -> text, for the stop strings (needed when there are some)."""
        assert decode is not None or not params.stop, "stop strings need a decode"
        self.params = params
        self.decode = decode
        self.eos = tuple(eos_token_ids)
        self.num_prompt = len(prompt_ids)
        room = params.max_tokens if max_model_len is None else max_model_len - len(prompt_ids)
        self.max_rounds = min(params.max_tokens, room)
        self.live = [BeamSearchSequence(list(prompt_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.rounds = 0

    @property
    def done(self) -> bool:
        return (not self.live or self.rounds >= self.max_rounds
                or self.params.early_stopping and len(self.completed) >= self.params.beam_width)

    def advance(self, candidates: Sequence[dict[int, float]]) -> None:
        """One round: `candidates[i]` holds the next tokens the engine offered live beam i
        ({token id: logprob}, the sampled token and the top 2 * beam_width)."""
        assert len(candidates) == len(self.live), "one answer per live beam"
        grown = []
        for beam, options in zip(self.live, candidates):
            for token, logprob in options.items():
                seq = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [options],
                                         beam.cum_logprob + logprob)
                if token in self.eos and not self.params.ignore_eos:
                    seq.finish_reason, seq.stop_reason = "stop", token
                    self.completed.append(seq)
                elif self.params.stop and self._stopped(seq):
                    self.completed.append(seq)
                else:
                    grown.append(seq)
        self.live = sorted(grown, key=self.score, reverse=True)[:self.params.beam_width]
        self.rounds += 1

    def _stopped(self, seq: BeamSearchSequence) -> bool:
        """Whether a stop string is in the beam's text (its parent's had none: any is new);
        the first of the list that is, as vLLM's detokenizer checks them, ends it."""
        assert self.decode is not None
        text = self.decode(seq.tokens[self.num_prompt:])
        for stop in self.params.stop:
            at = text.find(stop)
            if at >= 0:
                end = at + len(stop) if self.params.include_stop_str_in_output else at
                seq.finish_reason, seq.stop_reason, seq.output_text = "stop", stop, text[:end]
                return True
        return False

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best beams, ended or not, best first."""
        for beam in self.live:
            beam.finish_reason = "length"
        ranked = sorted(self.completed + self.live, key=self.score, reverse=True)
        return ranked[:self.params.beam_width]

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos,
                                 self.params.length_penalty)

    def output_ids(self, beam: BeamSearchSequence) -> list[int]:
        """A beam's generated tokens, as a served completion shows them: an ending EOS
        only with include_stop_str_in_output."""
        ids = beam.tokens[self.num_prompt:]
        if (beam.finish_reason == "stop" and not self.params.include_stop_str_in_output
                and ids and ids[-1] in self.eos):
            return ids[:-1]
        return ids


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, message: str, param: str, value: object) -> None:
    if not ok:
        raise SamplingError(f"{message}, got {value!r}", param)
