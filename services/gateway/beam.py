"""Served beam search (use_beam_search): the gateway drives common/beam_search.py as vLLM's
API server does. The search lives here, not in a stage behind the bus, because the
gateway is the one process that holds a call from its first round to its response: each
round is an ordinary call of one-token requests (a prompt per live beam, the prompt's
tokens and the beam's), so the tokenizer, scheduler and worker run them as any other,
and the scheduler's prefix cache serves the prefixes the beams share. The best beams
become the call's choices, decoded here with the tokenizer the gateway already holds,
and answer as one response or, streamed, as one chunk per choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
from aiohttp import web

from common.beam_search import BeamSearch
from common.chat import render_chat
from common.errors import ApiError
from common.messages import LoRARequest, TextDelta, TokenLogprobs
from common.model_info import ModelInfo
from common.token_text import TokenTexts
from services.gateway.core import Applied, Call
from services.gateway.protocol import Job

if TYPE_CHECKING:
    from services.gateway.app import Gateway


class BeamRounds:
    """One beam-search call's rounds, without I/O: the job of each round (a one-token
    request per live beam of every prompt), the searches advanced by the round's call
    once it is done, and at the end the best beams settled into the call's choices. The
    gateway and `headrace run-batch` drive it."""

    def __init__(self, job: Job, info: ModelInfo) -> None:
        """Encodes the prompts (a thread's work: chat templates)."""
        assert job.beam is not None
        self.job, self.tokenizer = job, info.tokenizer
        if 2 * job.beam.beam_width > info.config.max_logprobs:  # what each round asks
            raise ApiError(400, f"a beam search of n={job.beam.beam_width} beams asks for "
                                f"{2 * job.beam.beam_width} logprobs a round, more than "
                                f"--max-logprobs {info.config.max_logprobs}", "n")
        prompts = prompt_ids(info.tokenizer, job)
        for ids in prompts:
            check_room(len(ids), info.max_model_len)
        skip = job.params.get("skip_special_tokens", True)
        self.searches = [BeamSearch(ids, job.beam, info.eos_token_ids, info.max_model_len,
                                    lambda ids: info.tokenizer.decode(
                                        ids, skip_special_tokens=skip))
                         for ids in prompts]
        self.live: list[BeamSearch] = []  # the searches the current round runs

    @property
    def done(self) -> bool:
        return all(s.done for s in self.searches)

    def round_job(self) -> Job:
        """The next round's call: each live beam's tokens as a prompt of one token, with
        the 2n logprobs that rank its extensions."""
        assert self.job.beam is not None
        self.live = [s for s in self.searches if not s.done]
        params = self.job.beam.round_params()
        return Job(chat=False, model=self.job.model, priority=self.job.priority,
                   prompts=[beam.tokens for s in self.live for beam in s.live],
                   add_special_tokens=False,
                   params={"n": 1, "max_tokens": 1, "logprobs": params.logprobs,
                           "temperature": params.temperature})

    def advance(self, round_call: Call) -> None:
        """The round's answers, once its call is done (its error ends the search); with
        stop strings this decodes every candidate: a thread's work."""
        if round_call.error is not None:
            raise round_call.error
        answers = iter([offered(round_call.choices[rid, 0].logprobs)
                        for rid in round_call.rids])
        for search in self.live:
            search.advance([next(answers) for _ in search.live])

    def settle(self, call: Call, token_text: TokenTexts) -> list[Applied]:
        """The best beams as `call`'s choices (the call of `job`), each settled whole."""
        applied = []
        for delta in final_deltas(self.tokenizer, token_text, call, self.searches):
            choice = call.choices[delta.rid, delta.index]
            choice.settle(delta)
            applied.append((choice, delta))
        return applied


async def search_beams(gateway: Gateway, request: web.Request, job: Job, model: str,
                       lora: LoRARequest | None) -> tuple[Call, list[Applied]]:
    """Run the rounds; returns the call whose choices are the best beams, settled."""
    rounds = await anyio.to_thread.run_sync(BeamRounds, job, gateway.info)
    while not rounds.done:
        round_call = await gateway.new_call(rounds.round_job(), model, lora)
        async with gateway.open_call(request, round_call, []) as (inbox, log):
            await gateway.start(round_call, inbox, log)
            while not round_call.done:
                await gateway.receive(round_call, inbox)
        await anyio.to_thread.run_sync(rounds.advance, round_call)
    call = await gateway.new_call(job, model, lora, request)
    applied = await anyio.to_thread.run_sync(rounds.settle, call, gateway.token_text)
    return call, applied


def prompt_ids(tokenizer: Any, job: Job) -> list[list[int]]:
    """The token ids of each prompt, as the tokenizer stage makes them."""
    if job.chat:
        text = render_chat(tokenizer, job.messages, job.add_generation_prompt,
                           job.chat_template_kwargs, job.tools)
        return [list(tokenizer.encode(text, add_special_tokens=bool(job.add_special_tokens)))]
    return [list(tokenizer.encode(p, add_special_tokens=job.add_special_tokens is not False))
            if isinstance(p, str) else list(p) for p in job.prompts]


def check_room(num_prompt: int, max_model_len: int) -> None:
    if num_prompt >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} "
                            f"tokens. However, the prompt has {num_prompt} tokens, and a "
                            "beam search needs room for at least one more.", "prompt")


def offered(logprobs: list[Any]) -> dict[int, float]:
    """{token id: logprob} of a one-token request's single logprobs entry."""
    if not logprobs:
        return {}
    entry = logprobs[0]
    out: dict[int, float] = {}
    for token, logprob in zip(entry.token_ids, entry.logprobs):
        out.setdefault(token, logprob)
    return out


def final_deltas(tokenizer: Any, token_text: TokenTexts, call: Call,
                 searches: list[BeamSearch]) -> list[TextDelta]:
    """Each prompt's best beams as the one delta of each of its choices."""
    params = call.job.params
    skip = params.get("skip_special_tokens", True)
    top = params.get("logprobs")
    deltas = []
    for prompt, search in zip(call.prompts, searches):
        for index, beam in enumerate(search.best()):
            ids = search.output_ids(beam)
            text = beam.output_text
            if text is None:
                text = tokenizer.decode(ids, skip_special_tokens=skip) if ids else ""
            logprobs = ([] if top is None else
                        [chosen_logprobs(t, options, top, token_text)
                         for t, options in zip(ids, beam.logprobs)])
            deltas.append(TextDelta(prompt.rid, index, 0, text, ids, search.num_prompt,
                                    beam.finish_reason, beam.stop_reason, logprobs))
    return deltas


def chosen_logprobs(token: int, offered: dict[int, float], top: int,
                    token_text: TokenTexts) -> TokenLogprobs:
    """A beam's token and the `top` likeliest of those its round offered (at most 2n: a
    round asks for no more, as vLLM's), with their texts; the rank is among those."""
    chosen = offered[token]
    ranked = sorted(offered.items(), key=lambda item: -item[1])[:top]
    ids = [token] + [t for t, _ in ranked]
    return TokenLogprobs(ids, [chosen] + [lp for _, lp in ranked],
                         1 + sum(lp > chosen for lp in offered.values()),
                         [token_text(t) for t in ids])
