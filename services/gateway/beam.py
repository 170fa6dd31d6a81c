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
from common.token_text import TokenTexts
from services.gateway.core import Applied, Call
from services.gateway.protocol import Job

if TYPE_CHECKING:
    from services.gateway.app import Gateway


async def search_beams(gateway: Gateway, request: web.Request, job: Job, model: str,
                       lora: LoRARequest | None) -> tuple[Call, list[Applied]]:
    """Run the rounds; returns the call whose choices are the best beams, settled."""
    assert job.beam is not None
    info = gateway.info
    prompts = await anyio.to_thread.run_sync(prompt_ids, info.tokenizer, job)
    for ids in prompts:
        check_room(len(ids), info.max_model_len)
    if 2 * job.beam.beam_width > info.config.max_logprobs:  # what each round asks
        raise ApiError(400, f"a beam search of n={job.beam.beam_width} beams asks for "
                            f"{2 * job.beam.beam_width} logprobs a round, more than "
                            f"--max-logprobs {info.config.max_logprobs}", "n")
    skip = job.params.get("skip_special_tokens", True)
    searches = [BeamSearch(ids, job.beam, info.eos_token_ids, info.max_model_len,
                           lambda ids: info.tokenizer.decode(ids, skip_special_tokens=skip))
                for ids in prompts]
    while live := [s for s in searches if not s.done]:
        answers = await run_round(gateway, request, job, model, lora,
                                  [beam.tokens for s in live for beam in s.live])
        # off the event loop: stop strings decode every candidate
        await anyio.to_thread.run_sync(advance, live, answers)
    call = await gateway.new_call(job, model, lora, request)
    deltas = await anyio.to_thread.run_sync(final_deltas, info.tokenizer, gateway.token_text,
                                            call, searches)
    applied = []
    for delta in deltas:
        choice = call.choices[delta.rid, delta.index]
        choice.settle(delta)
        applied.append((choice, delta))
    return call, applied


def advance(searches: list[BeamSearch], answers: list[dict[int, float]]) -> None:
    """Each search's round, from the answers of all their live beams in order."""
    offered = iter(answers)
    for search in searches:
        search.advance([next(offered) for _ in search.live])


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


async def run_round(gateway: Gateway, request: web.Request, job: Job, model: str,
                    lora: LoRARequest | None, beams: list[list[int]]
                    ) -> list[dict[int, float]]:
    """One round: each beam's next tokens and their logprobs, as the engine offers them."""
    assert job.beam is not None
    params = job.beam.round_params()
    round_job = Job(chat=False, model=job.model, prompts=beams, priority=job.priority,
                    add_special_tokens=False,
                    params={"n": 1, "max_tokens": 1, "logprobs": params.logprobs,
                            "temperature": params.temperature})
    call = await gateway.new_call(round_job, model, lora)
    async with gateway.open_call(request, call, []) as (inbox, log):
        await gateway.start(call, inbox, log)
        while not call.done:
            await gateway.receive(call, inbox)
    if call.error is not None:
        raise call.error
    return [offered(call.choices[rid, 0].logprobs) for rid in call.rids]


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
