"""The gateway core: one API call's requests, the replies that build its choices, what it
answers (one response, or chunks), its latencies, and the admission decision. No I/O: the
shell feeds it messages and the clock, and writes what it returns.

A completions call with several prompts publishes one request per prompt; choice
`prompt_index * n + i` is completion `i` of prompt `prompt_index`. With best_of above n,
each request generates best_of completions (with their logprobs, the score), and the
response keeps the n of highest cumulative logprob, numbered as above.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.bus import StreamInfo
from common.errors import ApiError
from common.hops import RequestTimes, request_times, step_done
from common.messages import (ErrorReply, GenerateRequest, LoRARequest, SchedulerStats,
                             TextDelta, WorkerFailed)
from common.sampling_params import best_of_indices
from services.gateway import responses as shapes
from services.gateway.protocol import Job
from services.gateway.response_bodies import (ChatChoice, ChatChunkChoice, ChatMessage,
                                              CompletionChoice, DeltaMessage, Usage)
from services.gateway.tool_calls import (REASONING_FORMATS, OutputSplitter, ParsedCall, Piece,
                                         tool_parser)
from services.gateway.responses import Choice

# How long the scheduler may go unseen (Redis unreachable) before in-flight requests end;
# a scheduler that died is seen at once, when its liveness key expires.
STALE_S = 5.0


@dataclass(frozen=True, slots=True)
class Echo:
    """What `echo` puts before a prompt's completions."""
    text: str
    first_token: str = ""  # the first prompt token's text: it has no logprob of its own


@dataclass(slots=True)
class Prompt:
    rid: str
    source: str | list[int] | None  # None: a chat's conversation, which is the job's
    echo: Echo | None = None
    started: bool = False  # its first reply has come


@dataclass(slots=True)
class Timeline:
    """What a completion's stamps tell (wall clock, 0: not stamped): its request's way in,
    and when the steps of its first and last tokens were done on the host."""
    request_stamps: Sequence[float] = ()
    first_done: float = 0.0
    last_done: float = 0.0

    def note(self, delta: TextDelta, step_stamps: Sequence[float]) -> None:
        if delta.request_stamps:
            self.request_stamps = delta.request_stamps
        if delta.seq == 0:
            self.first_done = step_done(step_stamps)
        if delta.finish_reason is not None:
            self.last_done = step_done(step_stamps)


@dataclass(frozen=True, slots=True)
class Finished:
    """A completion that finished: what vLLM's per-request histograms take from it."""
    rid: str
    prompt_tokens: int
    generation_tokens: int
    times: RequestTimes | None  # None: its messages were not stamped


@dataclass(slots=True)
class Observed:
    """Latencies and finishes that some applied deltas add to the metrics, each with the
    request id it is of (the metrics name the request's shard)."""
    ttft: list[tuple[str, float]] = field(default_factory=list)
    itl: list[tuple[str, float]] = field(default_factory=list)
    e2e: list[tuple[str, float]] = field(default_factory=list)
    finish_reasons: list[tuple[str, str]] = field(default_factory=list)
    finished: list[Finished] = field(default_factory=list)  # per completion
    requests: list[tuple[str, int]] = field(default_factory=list)  # all n done: prompt tokens


Applied = tuple[Choice, TextDelta]


def request_ids(call_id: str, num_prompts: int) -> list[str]:
    if num_prompts == 1:
        return [call_id]
    return [f"{call_id}-{i}" for i in range(num_prompts)]


@dataclass(frozen=True, slots=True)
class Parsers:
    """The server's --tool-call-parser and --reasoning-parser."""
    tool_call: str | None = None
    reasoning: str | None = None


class Call:
    def __init__(self, job: Job, call_id: str, model: str, created: int, arrival: float,
                 echoes: list[Echo] | None = None, parsers: Parsers = Parsers(),
                 lora: LoRARequest | None = None, response_id: str | None = None) -> None:
        """`call_id` names its requests on the bus (unique); `response_id` is the id the
        client sees, its X-Request-Id or request_id where it gave one (default call_id)."""
        self.job, self.id, self.model, self.created = job, call_id, model, created
        self.response_id = response_id or call_id
        self.lora = lora  # the adapter `model` names, None: the base model
        self.arrival = arrival  # on the clock `observe` gets
        sources: list[str | list[int] | None] = [None] if job.chat else list(job.prompts)
        echoes = echoes or [None] * len(sources)  # type: ignore[list-item]
        self.prompts = [Prompt(rid, source, echo) for rid, source, echo in
                        zip(request_ids(call_id, len(sources)), sources, echoes)]
        self.by_rid = {p.rid: p for p in self.prompts}
        self.width = job.num_generated  # completions generated per prompt
        self.choices = {(p.rid, i): Choice(k * self.width + i)
                        for k, p in enumerate(self.prompts) for i in range(self.width)}
        self.error: ApiError | None = None
        self.last_token_at: dict[int, float] = {}  # by choice index
        self.timelines = {c.index: Timeline() for c in self.choices.values()}
        self.observed_rids: set[str] = set()  # requests whose every completion finished
        self.opened: set[int] = set()  # choices that sent a chunk
        self.offsets: dict[int, int] = {}  # by choice: where its next logprob text starts
        self.parsers = parsers
        self.splitters = {i: self._splitter() for i in self.opened_indices()}
        self.calls_sent: dict[int, int] = {}  # by choice: tool calls streamed so far

    def opened_indices(self) -> list[int]:
        """The choices whose text goes through a splitter (tools or reasoning)."""
        if self._splitter() is None:
            return []
        return [c.index for c in self.choices.values()]

    def _splitter(self) -> OutputSplitter | None:
        job, reasoning = self.job, self._reasoning_parser()
        if job.tool_choice == "auto":
            return OutputSplitter(self.parsers.tool_call, reasoning, tools=job.tools,
                                  single_call=not job.parallel_tool_calls)
        if job.tool_choice in ("required", "function"):
            return OutputSplitter(forced="required" if job.tool_choice == "required"
                                  else job.tool_name, single_call=not job.parallel_tool_calls)
        return OutputSplitter(None, reasoning) if reasoning else None

    def _reasoning_parser(self) -> str | None:
        """The server's, with deepseek_v3 (vLLM's) made this call's: DeepSeek-V3.1's chat
        template opens <think> when chat_template_kwargs ask for thinking, so the output
        reads as deepseek_r1's; otherwise it has no reasoning."""
        name = self.parsers.reasoning
        if name != "deepseek_v3":
            return name
        kwargs = self.job.chat_template_kwargs or {}
        thinking = kwargs.get("thinking") or kwargs.get("enable_thinking")
        return "deepseek_r1" if thinking else None

    # --- state --------------------------------------------------------------------------

    @property
    def rids(self) -> list[str]:
        return [p.rid for p in self.prompts]

    @property
    def started(self) -> bool:
        """Every request has answered (or one failed): the HTTP status is known."""
        return self.error is not None or all(p.started for p in self.prompts)

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices.values())

    @property
    def done(self) -> bool:
        return self.error is not None or self.finished

    def unfinished_rids(self) -> list[str]:
        return [p.rid for p in self.prompts if not self._rid_finished(p.rid)]

    def _rid_finished(self, rid: str) -> bool:
        return all(self.choices[rid, i].finished for i in range(self.width))

    def _sorted_choices(self) -> list[Choice]:
        return sorted(self.choices.values(), key=lambda c: c.index)

    # --- in --------------------------------------------------------------------------

    def requests(self, reply_to: str, arrival_time: float) -> list[GenerateRequest]:
        job = self.job
        common = dict(reply_to=reply_to, params=self._params(), priority=job.priority,
                      arrival_time=arrival_time, add_special_tokens=job.add_special_tokens,
                      truncate_prompt_tokens=job.truncate_prompt_tokens, lora=self.lora)
        if job.chat:
            return [GenerateRequest(self.id, messages=job.messages,
                                    add_generation_prompt=job.add_generation_prompt,
                                    chat_template_kwargs=job.chat_template_kwargs,
                                    tools=job.tools, **common)]
        return [GenerateRequest(p.rid, prompt=p.source, **common) if isinstance(p.source, str)
                else GenerateRequest(p.rid, prompt_token_ids=p.source, **common)
                for p in self.prompts]

    def _params(self) -> dict[str, Any]:
        """The client's parameters; a tool or reasoning parser whose markers are special
        tokens ([TOOL_CALLS], [THINK]) has the detokenizer keep them, unless the client said
        otherwise, as vLLM's parsers adjust the request. best_of above n runs best_of
        completions with their logprobs."""
        job = self.job
        params = job.params
        if self.width > job.n:
            params = {**params, "n": self.width, "logprobs": params.get("logprobs") or 0}
            del params["best_of"]
        if "skip_special_tokens" in job.params or not self._markers_are_special_tokens():
            return params
        return {**params, "skip_special_tokens": False}

    def _markers_are_special_tokens(self) -> bool:
        tools, reasoning = self.parsers.tool_call, self._reasoning_parser()
        if self.job.tool_choice == "auto" and tools is not None \
                and tool_parser(tools).special_tokens:
            return True
        return reasoning is not None and REASONING_FORMATS[reasoning].special_tokens

    def offer(self, msg: TextDelta | ErrorReply, stamps: Sequence[float] = ()
              ) -> list[Applied]:
        """Apply one reply, with the stamps of the step that made it (common/hops.py);
        returns the deltas that became applicable. The first error of a request that still
        runs ends the whole call."""
        prompt = self.by_rid.get(msg.rid)
        if prompt is None:
            return []
        if isinstance(msg, ErrorReply):
            if self.error is None and not self._rid_finished(msg.rid):
                self.error = ApiError(msg.status, msg.message, msg.param, msg.kind)
            return []
        choice = self.choices.get((msg.rid, msg.index))
        if choice is None:
            return []
        prompt.started = True
        if not choice.finished:
            self.timelines[choice.index].note(msg, stamps)
        return [(choice, delta) for delta in choice.offer(msg)]

    def observe(self, applied: Iterable[Applied], now: float) -> Observed:
        seen = Observed()
        for choice, delta in applied:
            last = self.last_token_at.get(choice.index)
            if last is None:
                seen.ttft.append((delta.rid, now - self.arrival))
            else:
                seen.itl.append((delta.rid, now - last))
            self.last_token_at[choice.index] = now
            if delta.finish_reason is not None:
                seen.e2e.append((delta.rid, now - self.arrival))
                seen.finish_reasons.append((delta.rid, delta.finish_reason))
                seen.finished.append(self._finished(choice, delta.rid))
                if delta.rid not in self.observed_rids and self._rid_finished(delta.rid):
                    self.observed_rids.add(delta.rid)
                    seen.requests.append((delta.rid, choice.num_prompt_tokens))
        return seen

    def most_generated(self, rid: str) -> int:
        """The most tokens one of a request's n completions generated."""
        return max(len(self.choices[rid, i].token_ids) for i in range(self.width))

    def _finished(self, choice: Choice, rid: str) -> Finished:
        timeline = self.timelines[choice.index]
        tokens = len(choice.token_ids)
        times = request_times(timeline.request_stamps, timeline.first_done,
                              timeline.last_done, tokens)
        return Finished(rid, choice.num_prompt_tokens, tokens, times)

    # --- out: one response -------------------------------------------------------------

    def usage(self) -> Usage:
        """A prompt's counts come from one of its completions that answered: the n
        siblings share the prompt. Every generated completion counts, best_of's too."""
        firsts = [max((self.choices[p.rid, i] for i in range(self.width)),
                      key=lambda c: c.num_prompt_tokens) for p in self.prompts]
        completion_tokens = sum(len(c.token_ids) for c in self.choices.values())
        cached = (sum(c.num_cached_tokens for c in firsts)
                  if self.job.prompt_tokens_details else None)
        return shapes.usage(sum(c.num_prompt_tokens for c in firsts), completion_tokens,
                            cached)

    def _returned_choices(self) -> list[Choice]:
        """The choices a response shows, in order: with best_of above n, each prompt's n
        of highest cumulative logprob, renumbered."""
        if self.width == self.job.n:
            return self._sorted_choices()
        kept = []
        for k, prompt in enumerate(self.prompts):
            generated = [self.choices[prompt.rid, i] for i in range(self.width)]
            scores = [sum(lp.logprobs[0] for lp in c.logprobs) for c in generated]
            kept += [dataclasses.replace(generated[i], index=k * self.job.n + j)
                     for j, i in enumerate(best_of_indices(scores, self.job.n))]
        return kept

    def response(self) -> shapes.Body:
        choices = [self._final_choice(c) for c in self._returned_choices()]
        body = shapes.envelope(self.response_id, self.job.chat, self.created, self.model,
                               choices, stream=False, usage_counts=self.usage())
        if self.job.chat and "prompt_logprobs" in self.job.params:
            first = self._sorted_choices()[0]  # every choice shares the prompt
            body.prompt_logprobs = shapes.prompt_logprobs(first.prompt_logprobs)
        return body

    def _final_choice(self, choice: Choice) -> ChatChoice | CompletionChoice:
        if self.job.chat:
            logprobs = (shapes.chat_logprobs(choice.logprobs, self.job.tokens_as_ids)
                        if self.job.logprobs else None)
            splitter = self._splitter()
            if splitter is None:
                return shapes.chat_choice(choice.index, choice.text, logprobs,
                                          choice.finish_reason, choice.stop_reason)
            piece = splitter.feed(choice.text, finished=True)
            calls = piece.tool_calls + ([ParsedCall(piece.opened.name, piece.arguments,
                                                    piece.opened.id)] if piece.opened else [])
            message = ChatMessage.model_construct(
                content=piece.content or (None if calls else ""),
                reasoning_content=self._reasoning(piece),
                tool_calls=[shapes.tool_call(c) for c in calls])
            return ChatChoice.model_construct(
                index=choice.index, message=message, logprobs=logprobs,
                finish_reason=self._finish(choice.finish_reason, bool(piece.tool_calls)),
                stop_reason=choice.stop_reason)
        echo = self._echo(choice)
        logprobs = None
        if self.job.logprobs:
            entries = [*(choice.prompt_logprobs if echo else []), *choice.logprobs]
            logprobs = shapes.completion_logprobs(entries, 0, echo.first_token if echo else "",
                                                  self.job.tokens_as_ids)
        text = (echo.text if echo else "") + choice.text
        rows = None
        if "prompt_logprobs" in self.job.params and not self.job.echo:
            rows = shapes.prompt_logprobs(choice.prompt_logprobs)
        return shapes.completion_choice(choice.index, text, logprobs, choice.finish_reason,
                                        choice.stop_reason, rows)

    def _echo(self, choice: Choice) -> Echo | None:
        return self.prompts[choice.index // self.job.n].echo if self.job.echo else None

    # --- out: chunks ---------------------------------------------------------------------

    def opening_chunks(self) -> list[shapes.Body]:
        """Chat streams start with each choice's role."""
        if not self.job.chat:
            return []
        role = DeltaMessage.model_construct(role="assistant", content="")
        return [self._chunk([shapes.chat_delta(c.index, role)])
                for c in self._sorted_choices()]

    def chunks(self, applied: list[Applied]) -> list[shapes.Body]:
        """One chunk per choice that moved, in the order the choices moved."""
        by_choice: dict[int, tuple[Choice, list[TextDelta]]] = {}
        for choice, delta in applied:
            by_choice.setdefault(choice.index, (choice, []))[1].append(delta)
        chunks = []
        for choice, deltas in by_choice.values():
            chunk_choice = self._chunk_choice(choice, deltas)
            if chunk_choice is not None:
                chunks.append(self._chunk([chunk_choice]))
        return chunks

    def usage_chunk(self) -> shapes.Body:
        return shapes.envelope(self.response_id, self.job.chat, self.created, self.model,
                               [], stream=True, usage_counts=self.usage())

    def _chunk(self, choices: list[Any]) -> shapes.Body:
        """usage is null, or the counts so far with vLLM's continuous_usage_stats."""
        counts = self.usage() if self.job.continuous_usage else None
        return shapes.envelope(self.response_id, self.job.chat, self.created, self.model,
                               choices, stream=True, usage_counts=counts)

    def _chunk_choice(self, choice: Choice, deltas: list[TextDelta]
                      ) -> ChatChunkChoice | CompletionChoice | None:
        text = "".join(d.text for d in deltas)
        entries: list = [lp for d in deltas for lp in d.logprobs]
        finish = deltas[-1].finish_reason
        stop_reason = deltas[-1].stop_reason if finish is not None else None
        first_token = ""
        echo = self._echo(choice)
        if echo is not None and choice.index not in self.opened:
            text = echo.text + text
            entries = [*choice.prompt_logprobs, *entries]
            first_token = echo.first_token
        if not text and not entries and finish is None and not any(d.token_ids for d in deltas):
            return None  # nothing new: no token, no text
        # A step's tokens make a chunk even when their text is held back (a possible stop
        # string, a partial character) or empty, as vLLM sends them: a client sees each step.
        self.opened.add(choice.index)
        if self.job.chat:
            logprobs = (shapes.chat_logprobs(entries, self.job.tokens_as_ids)
                        if self.job.logprobs else None)
            delta, called = self._delta(choice.index, text, finish is not None)
            return shapes.chat_delta(choice.index, delta, logprobs,
                                     self._finish(finish, called), stop_reason)
        logprobs = None
        if self.job.logprobs:
            offset = self.offsets.get(choice.index, 0)
            logprobs = shapes.completion_logprobs(entries, offset, first_token,
                                                  self.job.tokens_as_ids)
            self.offsets[choice.index] = offset + shapes.logprobs_text_length(logprobs)
        return shapes.completion_choice(choice.index, text, logprobs, finish, stop_reason)


    # --- out: tool calls and reasoning ----------------------------------------------

    def _delta(self, index: int, text: str, finished: bool) -> tuple[DeltaMessage, bool]:
        """A chat chunk's delta, and whether this choice has called tools so far."""
        splitter = self.splitters.get(index)
        if splitter is None:
            return DeltaMessage.model_construct(content=text), False
        piece = splitter.feed(text, finished)
        calls = []
        if piece.opened is not None:
            calls.append(shapes.tool_call_delta(0, piece.opened, piece.arguments))
        elif piece.arguments:
            calls.append(shapes.arguments_delta(0, piece.arguments))
        calls += [shapes.tool_call_delta(d.index, d.opened, "") if d.opened is not None
                  else shapes.arguments_delta(d.index, d.arguments) for d in piece.calls]
        self.calls_sent[index] = (self.calls_sent.get(index, 0)
                                  + sum(d.opened is not None for d in piece.calls))
        reasoning = self._reasoning(piece)
        content = piece.content if piece.content or not (calls or reasoning) else None
        return DeltaMessage.model_construct(content=content, reasoning_content=reasoning,
                                            tool_calls=calls or None), \
            self.calls_sent[index] > 0

    def _reasoning(self, piece: Piece) -> str | None:
        return piece.reasoning or None if self.job.include_reasoning else None

    def _finish(self, finish: str | None, called: bool) -> str | None:
        """A choice that ended by calling tools (not a named function's arguments, which
        stop) finishes with "tool_calls", as OpenAI's and vLLM's do."""
        return "tool_calls" if finish == "stop" and called else finish


# --- admission ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Shard:
    """One data-parallel shard as the gateway last saw it."""
    scheduler_epoch: bytes | None = None  # None: no live scheduler; a restarted one has a new one
    worker_alive: bool = False
    worker_failed: WorkerFailed | None = None  # its worker's last load failure, until one starts

    @property
    def up(self) -> bool:
        return self.scheduler_epoch is not None and self.worker_alive


def shard_states(alive: list[bytes | None],
                 failed: Sequence[WorkerFailed | None] = ()) -> list[Shard]:
    """Shards from their liveness keys: every scheduler's (its epoch), then every
    worker's; and from each worker's load failure, where there is one."""
    n = len(alive) // 2
    failed = list(failed) or [None] * n
    return [Shard(alive[s], alive[n + s] is not None, failed[s]) for s in range(n)]


def load_failure(shards: Iterable[Shard]) -> tuple[int, WorkerFailed] | None:
    """A shard whose worker failed to load the model, while no shard is up: a request
    would wait for a worker that is not coming."""
    shards = list(shards)
    if any(s.up for s in shards):
        return None
    return next(((i, s.worker_failed) for i, s in enumerate(shards)
                 if s.worker_failed is not None and not s.worker_alive), None)


def worker_cannot_load(shard: int, failed: WorkerFailed) -> str:
    return (f"The worker of shard {shard} cannot load the model ({failed.failures} "
            f"attempt(s) failed): {failed.reason}")


def load_failed(shard: int, failed: WorkerFailed) -> Callable[[str], ErrorReply]:
    """The error that ends calls admitted before the worker's load failed."""
    message = worker_cannot_load(shard, failed)
    return lambda rid: ErrorReply(rid, 503, message, "ServiceUnavailableError")


@dataclass(slots=True)
class Backend:
    """What the gateway last saw of the stages behind it."""
    shards: list[Shard] = field(default_factory=list)
    queue_depth: int = 0
    seen_at: float = -math.inf  # when Redis last answered, on the clock `alive` gets

    def alive(self, now: float) -> bool:
        """Some shard's scheduler runs, as of a recent look."""
        return self.why_down(now) is None

    def why_down(self, now: float) -> Callable[[str], ErrorReply] | None:
        """The error the gateway's requests end with when it sees no scheduler, or has not
        seen Redis for STALE_S (a slow or lossy link: the stages may be well), else None."""
        if now - self.seen_at > STALE_S:
            return redis_out_of_sight
        if all(s.scheduler_epoch is None for s in self.shards):
            return scheduler_gone
        return None

    def lost_shards(self, before: Backend) -> list[tuple[int, Callable[[str], ErrorReply]]]:
        """Shards whose scheduler, there at the last look, is gone (its key lapsed) or was
        replaced within its predecessor's TTL (a new epoch): the requests it held are lost
        either way. Each with the error its requests end with."""
        lost: list[tuple[int, Callable[[str], ErrorReply]]] = []
        for shard, (was, now) in enumerate(zip(before.shards, self.shards)):
            if was.scheduler_epoch is None:
                continue
            if now.scheduler_epoch is None:
                lost.append((shard, scheduler_gone))
            elif now.scheduler_epoch != was.scheduler_epoch:
                lost.append((shard, scheduler_restarted))
        return lost


def dead_reply_streams(infos: Iterable[StreamInfo], alive: Iterable[bytes | None],
                       now_ms: float, idle_ms: float) -> list[str]:
    """The reply streams (`infos`) of gateways that were killed: no liveness key
    (`alive`, in the same order) and nothing added for `idle_ms`. A stopped gateway
    deletes its own; these would otherwise stay for good."""
    return [info.name for info, key in zip(infos, alive)
            if key is None and now_ms - int(info.last_id.split("-")[0]) > idle_ms]


ADMIT_SUFFIX = ":admit"  # every shard's admissions (common/keys.py)


def queue_depth(streams: Iterable[StreamInfo], stats: Iterable[SchedulerStats | None]) -> int:
    """Requests admitted to the pipeline that no stage has started on: entries the
    tokenizers have not read, tokenized requests the schedulers have not read, and the
    schedulers' waiting queues. A stream without a group counts whole: the group a stage
    creates later starts from its first entry."""
    depth = sum(s.num_waiting for s in stats if s is not None)
    for stream in streams:
        if stream.name == keys.REQUESTS or stream.name.endswith(ADMIT_SUFFIX):
            lags = [g.lag for g in stream.groups if g.lag is not None]
            depth += max(lags, default=0) if stream.groups else stream.length
    return depth


SHUTTING_DOWN = ApiError(503, "The server is shutting down; send the request again (to "
                              "another replica).")


def admission_error(backend: Backend, max_queue_len: int, now: float) -> ApiError | None:
    if (failure := load_failure(backend.shards)) is not None:
        return ApiError(503, worker_cannot_load(*failure))
    if (down := backend.why_down(now)) is redis_out_of_sight:
        return ApiError(503, f"This gateway has not reached Redis for {STALE_S:g} s; try "
                             "again later.")
    if down is not None:
        return ApiError(503, "The scheduler is not running; try again later.")
    if backend.queue_depth > max_queue_len:
        return ApiError(503, f"The server is overloaded: {backend.queue_depth} requests are "
                             f"queued, more than --max-queue-len {max_queue_len}. Try again "
                             "later.")
    return None


def shutting_down(rid: str) -> ErrorReply:
    return ErrorReply(rid, 503, "The server is shutting down and its --shutdown-timeout "
                                "ended before this request did.", "ServiceUnavailableError")


def scheduler_restarted(rid: str) -> ErrorReply:
    return ErrorReply(rid, 503, "The scheduler restarted and lost the request; send it "
                                "again.", "ServiceUnavailableError")


def redis_out_of_sight(rid: str) -> ErrorReply:
    return ErrorReply(rid, 503, f"This gateway has not reached Redis for {STALE_S:g} s; the "
                                "request was ended.", "ServiceUnavailableError")


def scheduler_gone(rid: str) -> ErrorReply:
    return ErrorReply(rid, 503, "The scheduler stopped (its liveness key expired); the "
                                "request was ended.", "ServiceUnavailableError")
