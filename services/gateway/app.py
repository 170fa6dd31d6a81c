"""The gateway's HTTP API (aiohttp): OpenAI's completions, chat completions, embeddings and
models, plus /tokenize, /detokenize, /health (/ping), /version, /metrics and /openapi.json.

A generation call publishes one GenerateRequest per prompt and waits for every request's
first reply before it answers: that reply decides the HTTP status, also for a stream (a
prompt too long for the model is a 400, not a broken event stream). A call that ends
before its requests do (client gone, an error, shutdown) aborts them, so the scheduler
frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from aiohttp import web
from aiohttp.http_exceptions import PayloadEncodingError
from aiohttp.web_protocol import RequestPayloadError
from pydantic import BaseModel
from redis.exceptions import RedisError
from structlog.stdlib import BoundLogger

from common import keys
from common.bus import UNAVAILABLE, Bus, decode_value
from common.chat import chat_image_urls, chat_video_urls, render_chat
from common.config import ServerConfig
from common.errors import ApiError
from common.hops import DELIVERY_STAGE
from common.log import get_logger
from common.media import MediaRules, load_images, load_videos
from common.messages import Abort, LoRARequest, SchedulerStats, StoredResponse, WorkerFailed
from common.model_info import ModelInfo
from common.stalls import processes_health
from common.token_text import TokenTexts
from common.tokens import check_vocabulary
from common.vision import ImageTokens
from services.gateway.adapters import Adapters, check_new_name
from services.gateway.beam import search_beams
from services.gateway.core import (SHUTTING_DOWN, STALE_S, Applied, Backend, Call, Echo,
                                   Observed, Parsers, admission_error, load_failure, queue_depth,
                                   shard_states, shutting_down, worker_cannot_load)
from services.gateway.embeddings import EmbeddingCall, check_dimensions
from services.gateway.http_options import REQUEST_LOGGER, route_path, with_http_options
from services.gateway.metrics import Metrics
from services.gateway.outbox import Outbox
from services.gateway.protocol import (EmbeddingJob, Job, Limits, TokenizeJob, parse_detokenize,
                                       parse_embedding, parse_job, parse_tokenize)
from services.gateway.scoring import (check_scorable, parse_rerank, parse_score,
                                      rerank_response, score_response, scores)
from services.gateway.openapi import openapi_document, with_root_path
from services.gateway.request_bodies import (LoadLoRAAdapterRequest,
                                             UnloadLoRAAdapterRequest, validate)
from services.gateway.responses_api import (STORE_TTL_S, ResponseEvents, ResponsesCall,
                                            answered_messages, check_response_id,
                                            output_items, parse_responses, response_object,
                                            responses_call)
from services.gateway.replies import Inbox, Replies, next_replies
from services.gateway.response_bodies import (DetokenizeResponse, ErrorResponse, ModelCard,
                                              ModelList, TokenizeResponse, to_dict, to_json)
from services.gateway.tool_calls import check_tool_parser
from services.gateway.version import VERSION

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A look at the backend on a loop slowed by thousands of streams takes seconds; cut off
# at 2 s, no look finished and the gateway refused requests as if the scheduler were gone.
# Redis that does not answer still makes the state stale after STALE_S.
REFRESH_TIMEOUT_S = STALE_S
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# No OpenAI request nests anywhere near this deep (a JSON schema for structured outputs
# the most); deeper bodies would only reach recursion limits further on (the chat
# template, MessagePack) and fail there as 500s.
MAX_JSON_DEPTH = 64
INT_RANGE = (-2**63, 2**64 - 1)  # what MessagePack encodes
ENDING_S = 5.0  # after --shutdown-timeout, the calls' handlers get this long to send errors
OPENAPI = openapi_document(VERSION)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    def __init__(self, bus: Bus, server: ServerConfig, info: ModelInfo, model: str,
                 gateway_id: str) -> None:
        self.bus, self.server, self.info = bus, server, info
        self.id = gateway_id
        self.model_path = model
        self.names = list(server.served_model_name) or [model]
        self.max_model_len = info.max_model_len
        # /tokenize counts a vision-language model's image tokens (None: text only)
        self.image_tokens = ImageTokens.for_model(info.model_dir, info.hf_config,
                                                  info.tokenizer)
        self.metrics = Metrics(self.names[0], info.max_model_len)
        self.backend = Backend()
        # one reader of this gateway's replies
        self.replies = Replies(bus, gateway_id, self.metrics,
                               info.config.data_parallel_size)
        self.outbox = Outbox(bus)  # one writer of every call's requests and aborts
        self.token_text = TokenTexts(info.tokenizer)  # spells echoed prompt tokens
        self.started_at = int(time.time())
        self.tasks: set[asyncio.Task[None]] = set()
        self.draining = False
        self.limits = Limits(server.max_prompts_per_request, server.max_stop_strings,
                             server.max_stop_length, server.max_stop_token_ids,
                             server.max_n)
        check_tool_parser(server.tool_call_parser, server.tool_parser_plugin)
        self.parsers = Parsers(server.tool_call_parser, server.reasoning_parser)
        config = info.config
        self.adapters = (Adapters(bus, self.names[0], config.max_lora_rank)
                         if config.enable_lora else None)  # None: LoRA is off
        self.log = get_logger(__name__, gateway=gateway_id)
        # each request's lines, which --disable-log-requests silences (warnings stay)
        self.request_log = get_logger(REQUEST_LOGGER, gateway=gateway_id)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.errors, self.auth],
                              client_max_size=self.server.max_request_body)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        for prefix in ("", "/v1"):  # vLLM serves both
            app.router.add_post(prefix + "/score", self.score)
            app.router.add_post(prefix + "/rerank", self.rerank)
        app.router.add_post("/v2/rerank", self.rerank)  # Cohere's v2 path, as vLLM's
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve_response)
        app.router.add_delete("/v1/responses/{response_id}", self.delete_response)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/health", self.health)
        for ping in (app.router.add_get, app.router.add_post):
            ping("/ping", self.health)  # vLLM's name for it (SageMaker asks there)
        app.router.add_get("/version", self.version)
        app.router.add_get("/metrics", self.prometheus)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        return with_http_options(app, self.server)

    # --- middlewares ------------------------------------------------------------------

    @web.middleware
    async def errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as e:
            return self.error_response(request, e)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else {}
            message = (e.text if e.status == 413  # it names the limit and the size
                       else f"{e.reason}: {request.method} {request.path}")
            return self.error_response(request, ApiError(e.status, message), allow)
        except UNAVAILABLE as e:
            self.log.error("redis unreachable", path=request.path, error=str(e))
            return self.error_response(request, ApiError(503, "The server's Redis is "
                                                              "unreachable; try again later."))
        except Exception:  # a bug: the client still gets an OpenAI-shaped answer
            self.log.exception("request failed", path=request.path)
            return self.error_response(request, ApiError(500, "Internal server error."))

    @web.middleware
    async def auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.server.api_key
        if key and route_path(request, self.server.root_path).startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                raise ApiError(401, "Missing or invalid API key: send the header "
                                    "'Authorization: Bearer <key>'.")
        return await handler(request)

    def error_response(self, request: web.Request, error: ApiError,
                       headers: dict[str, str] | None = None) -> web.Response:
        if route_path(request, self.server.root_path) != "/health":  # probes ask often;
            # 503 there is a state, not news
            log = self.request_log.bind(rid=request["rid"]) if "rid" in request \
                else self.request_log
            log.info("request refused", path=request.path, status=error.status,
                     error=error.message)
        return web.json_response(error.body(), status=error.status,
                                 headers={**error.headers(), **(headers or {})})

    # --- generation -------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self.generate(request, chat=True)

    async def generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        job = parse_job(await read_json(request, self.server.body_timeout), chat,
                        self.limits)
        job.tokens_as_ids = job.tokens_as_ids or self.server.return_tokens_as_token_ids
        job.prompt_tokens_details = self.server.enable_prompt_tokens_details
        model, lora = await self.model_named(job.model)
        self.admit(job)
        if job.beam is not None:
            return await self.beam_search(request, job, model, lora)
        call = await self.new_call(job, model, lora, request)
        async with self.open_call(request, call, job.ignored) as (inbox, log):
            return await self.answer(request, call, inbox, log)

    async def beam_search(self, request: web.Request, job: Job, model: str,
                          lora: LoRARequest | None) -> web.StreamResponse:
        """use_beam_search: rounds of one-token calls, then the best beams as the call's
        choices (services/gateway/beam.py)."""
        call, applied = await search_beams(self, request, job, model, lora)
        async with self.open_call(request, call, job.ignored) as (inbox, log):
            if job.stream:
                return await self.stream(request, call, inbox, applied, 0.0, log)
            log.info("request finished", **to_dict(call.usage()))
            return json_body(call.response())

    @asynccontextmanager
    async def open_call(self, request: web.Request, call: Call | EmbeddingCall,
                        ignored: list[str]) -> AsyncIterator[tuple[Inbox, Any]]:
        """The call's inbox and logger while it runs; on the way out, whatever the reason,
        its unfinished requests are aborted and its inbox closed."""
        request["rid"] = call.id  # for the error middleware's log line
        log = self.request_log.bind(rid=call.id)
        if call.response_id != call.id:
            log = log.bind(request_id=call.response_id)
        if ignored:
            log.warning("ignored unknown request fields", fields=ignored)
        inbox = self.replies.open(call.rids)
        try:
            yield inbox, log
        except asyncio.CancelledError:
            log.info("client disconnected")
            raise
        finally:
            self.abort(call.unfinished_rids())
            self.replies.close(call.rids)

    def admit(self, job: Job) -> None:
        for prompt in job.prompts:
            if isinstance(prompt, list):
                check_vocabulary(prompt, self.info.vocab_size, "prompt")
        if job.tool_choice == "auto" and not self.server.enable_auto_tool_choice:
            raise ApiError(400, '"auto" tool choice needs the server flags '
                                "--enable-auto-tool-choice and --tool-call-parser; give "
                                "tool_choice \"none\", \"required\" or a function",
                           "tool_choice")
        if job.priority and self.info.config.scheduling_policy != "priority":
            raise ApiError(400, "'priority' needs --scheduling-policy priority; this server "
                                "schedules first come, first served", "priority")
        self.check_admission()

    def check_admission(self) -> None:
        if self.draining:
            raise SHUTTING_DOWN
        error = admission_error(self.backend, self.server.max_queue_len, time.monotonic())
        if error is not None:
            raise error

    async def answer(self, request: web.Request, call: Call, inbox: Inbox,
                     log: BoundLogger) -> web.StreamResponse:
        applied, sent = await self.start(call, inbox, log)
        if call.job.stream:
            return await self.stream(request, call, inbox, applied, sent, log)
        while not call.done:
            await self.receive(call, inbox)
        if call.error is not None:
            raise call.error
        log.info("request finished", **to_dict(call.usage()))
        return json_body(call.response())

    async def start(self, call: Call, inbox: Inbox, log: BoundLogger
                    ) -> tuple[list[Applied], float]:
        """Publish the call's requests and wait for their first replies, which decide the
        status; returns the deltas applied so far and when the oldest was sent."""
        await self.outbox.publish(keys.REQUESTS, *call.requests(self.id, time.time()))
        log.info("request queued", prompts=len(call.prompts), n=call.job.n,
                 stream=call.job.stream)
        applied: list[Applied] = []
        sent = 0.0
        while not call.started:
            more, sent = await self.receive(call, inbox)
            applied += more
        if call.error is not None:
            raise call.error
        return applied, sent

    async def new_call(self, job: Job, model: str, lora: LoRARequest | None,
                       request: web.Request | None = None) -> Call:
        """`request`: the client's, whose X-Request-Id (or the body's request_id) names
        the response; the requests on the bus keep an id of their own, unique even when
        two clients send the same one."""
        prefix = "chatcmpl-" if job.chat else "cmpl-"
        echoes = await anyio.to_thread.run_sync(self.echoes, job) if job.echo else None
        return Call(job, prefix + uuid.uuid4().hex, model, int(time.time()),
                    time.monotonic(), echoes, self.parsers, lora,
                    response_id(prefix, request, job.request_id))

    def echoes(self, job: Job) -> list[Echo]:
        tokenizer = self.info.tokenizer
        out = []
        for prompt in job.prompts:
            text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            first = ""
            if job.logprobs:  # the first prompt token has no logprob, but is listed
                ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                first = self.token_text(ids[0]) if ids else ""
            out.append(Echo(text, first))
        return out

    async def receive(self, call: Call, inbox: Inbox) -> tuple[list[Applied], float]:
        """The replies that came, applied to the call, and when the detokenizer sent the
        oldest of them (0 when unknown)."""
        applied: list[Applied] = []
        sent_at: list[float] = []
        for reply, stamps in await next_replies(inbox):
            applied += call.offer(reply, stamps)
            if stamps and stamps[-1]:
                sent_at.append(stamps[-1])
        self.record(call, call.observe(applied, time.monotonic()))
        return applied, min(sent_at, default=0.0)

    async def stream(self, request: web.Request, call: Call, inbox: Inbox,
                     applied: list[Applied], sent: float, log: BoundLogger
                     ) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            await send(response, call.opening_chunks() + call.chunks(applied))
            self.delivered(sent)
            while not call.done:
                applied, sent = await self.receive(call, inbox)
                await send(response, call.chunks(applied))
                self.delivered(sent)
            if call.error is not None:
                log.warning("request failed while streaming", status=call.error.status,
                            error=call.error.message)
                await send(response, [ErrorResponse.model_validate(call.error.body())])
            else:
                log.info("request finished", **to_dict(call.usage()))
                if call.job.include_usage:
                    await send(response, [call.usage_chunk()])
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            log.info("client disconnected")
        return response

    def abort(self, rids: list[str]) -> None:
        """Abort each request at its shard (every shard for one not routed yet, since the
        tokenizer may be routing it now); before the replies close, which forget shards."""
        by_shard: dict[int, list[str]] = {}
        for rid in rids:
            for shard in self.replies.shards_of(rid):
                by_shard.setdefault(shard, []).append(rid)
        if by_shard:
            self.spawn(self.publish_aborts(by_shard))

    async def publish_aborts(self, by_shard: dict[int, list[str]]) -> None:
        for shard, rids in by_shard.items():
            try:
                await self.outbox.publish(keys.control(shard), *[Abort(rid) for rid in rids])
            except RedisError as e:
                self.log.error("could not publish aborts", rids=rids, error=str(e))

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run `coro` to its end even if the handler that started it is cancelled."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        """Stop admitting (503 with Retry-After, and on /health, so that a balancer stops
        sending), let the calls in flight finish for up to `timeout_s`, then end the rest
        with an error: on a stream, an error event and [DONE]."""
        self.draining = True
        self.log.info("draining", requests=len(self.replies.inboxes), timeout_s=timeout_s)
        with anyio.move_on_after(timeout_s):
            await self.replies.all_closed()
        if self.replies.inboxes:
            self.log.warning("ending the requests still open",
                             requests=len(self.replies.inboxes))
            self.replies.fail_all(shutting_down)
            with anyio.move_on_after(ENDING_S):
                await self.replies.all_closed()

    async def finish_tasks(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)

    def delivered(self, sent: float) -> None:
        """Streamed replies reach the client as they are written; a whole response only at
        its end, so only streams time the detokenizer-to-client stage."""
        if sent:
            self.metrics.observe_stages([(DELIVERY_STAGE, max(0.0, time.time() - sent))])

    def record(self, call: Call, seen: Observed) -> None:
        metrics = self.metrics
        for histogram, values in ((metrics.time_to_first_token, seen.ttft),
                                  (metrics.inter_token_latency, seen.itl),
                                  (metrics.e2e_request_latency, seen.e2e)):
            for rid, value in values:
                metrics.observe(histogram, self.shard_label(rid), value)
        for rid, reason in seen.finish_reasons:
            metrics.count_success(self.shard_label(rid), reason)
        for done in seen.finished:
            metrics.observe_finished(self.shard_label(done.rid), done.prompt_tokens,
                                     done.generation_tokens, done.times)
        for rid, prompt_tokens in seen.requests:
            metrics.observe_params(self.shard_label(rid), call.job.n,
                                   self.max_tokens(call.job, prompt_tokens),
                                   call.most_generated(rid))

    def max_tokens(self, job: Job, prompt_tokens: int) -> int:
        """The max_tokens a request ran with, as the tokenizer resolved it: the client's
        (or the generation config's cap), at most the room left in the context."""
        room = self.max_model_len - prompt_tokens
        asked = self.info.defaults.cap(job.params.get("max_tokens"))
        return room if asked is None else min(asked, room)

    def shard_label(self, rid: str) -> str:
        """A request's tokens come after its Routed reply on the same stream, so its shard
        is known; "" only if a cluster delivered them out of order."""
        shard = self.replies.shard_of(rid)
        return "" if shard is None else str(shard)

    # --- the Responses API --------------------------------------------------------------

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses: a chat call on the conversation the request and its
        previous_response_id make; the answer is stored (store: true, the default) for
        retrieval and continuation by any gateway of this Redis."""
        req = parse_responses(await read_json(request, self.server.body_timeout))
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = (await self.stored_response(req.previous_response_id,
                                                  "previous_response_id")).messages
        rcall = responses_call(req, history, self.limits)
        model, lora = await self.model_named(rcall.job.model)
        self.admit(rcall.job)
        call = await self.new_call(rcall.job, model, lora)
        async with self.open_call(request, call, rcall.job.ignored) as (inbox, log):
            applied, sent = await self.start(call, inbox, log)
            if rcall.job.stream:
                return await self.stream_response(request, rcall, call, inbox, applied, sent,
                                                  log)
            while not call.done:
                await self.receive(call, inbox)
            if call.error is not None:
                raise call.error
            chat = call.response()
            choice = chat.choices[0]
            body = response_object(rcall, model, call.created, "completed",
                                   output_items(choice.message), chat.usage,
                                   choice.finish_reason)
            log.info("request finished", **to_dict(chat.usage))
            await self.store_response(rcall, body.model_dump(mode="json"))
            return json_body(body)

    async def stream_response(self, request: web.Request, rcall: ResponsesCall, call: Call,
                              inbox: Inbox, applied: list[Applied], sent: float,
                              log: BoundLogger) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        events = ResponseEvents(rcall, call.model, call.created)

        def moved(applied: list[Applied]) -> list[dict[str, Any]]:
            return [event for chunk in call.chunks(applied) for choice in chunk.choices
                    for event in events.feed(choice.delta)]
        try:
            await send_events(response, events.opening() + moved(applied))
            self.delivered(sent)
            while not call.done:
                applied, sent = await self.receive(call, inbox)
                await send_events(response, moved(applied))
                self.delivered(sent)
            if call.error is not None:
                log.warning("request failed while streaming", status=call.error.status,
                            error=call.error.message)
                await send_events(response, events.failed(call.error))
            else:
                finish = next(iter(call.choices.values())).finish_reason
                last = events.completed(call.usage(), finish)
                await send_events(response, last)
                log.info("request finished", **to_dict(call.usage()))
                await self.store_response(rcall, last[-1]["response"])
            await response.write_eof()
        except ConnectionResetError:
            log.info("client disconnected")
        return response

    async def store_response(self, rcall: ResponsesCall, body: dict[str, Any]) -> None:
        if rcall.store:
            stored = StoredResponse(json.dumps(body),
                                    rcall.conversation + answered_messages(body["output"]))
            await self.bus.store(keys.stored_response(rcall.id), stored, STORE_TTL_S)

    async def stored_response(self, response_id: str, param: str | None = None
                              ) -> StoredResponse:
        check_response_id(response_id, param)
        stored = await self.bus.load(keys.stored_response(response_id))
        if not isinstance(stored, StoredResponse):
            raise ApiError(404, f"No response with id {response_id!r}: it was not stored "
                                f"(store: false), or it is older than {STORE_TTL_S:g} s.",
                           param)
        return stored

    async def retrieve_response(self, request: web.Request) -> web.Response:
        stored = await self.stored_response(request.match_info["response_id"])
        return web.Response(text=stored.response, content_type="application/json")

    async def delete_response(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        await self.stored_response(response_id)  # 404 for one not stored
        await self.bus.forget(keys.stored_response(response_id))
        return web.json_response({"id": response_id, "object": "response.deleted",
                                  "deleted": True})

    # --- embeddings -------------------------------------------------------------------

    async def embeddings(self, request: web.Request) -> web.Response:
        job = parse_embedding(await read_json(request, self.server.body_timeout), self.limits)
        call = await self.embed(request, job, "embd-")
        return json_body(call.response())

    async def score(self, request: web.Request) -> web.Response:
        check_scorable(self.info.hf_config, request.path)
        pairs = parse_score(await read_json(request, self.server.body_timeout), self.limits)
        call = await self.embed(request, pairs.job, "score-")
        values = scores(pairs, call.embeddings())
        return json_body(score_response(call.response_id, call.created, call.model, values,
                                        call.prompt_tokens()))

    async def rerank(self, request: web.Request) -> web.Response:
        check_scorable(self.info.hf_config, request.path)
        rerank = parse_rerank(await read_json(request, self.server.body_timeout), self.limits)
        call = await self.embed(request, rerank.pairs.job, "rerank-")
        values = scores(rerank.pairs, call.embeddings())
        return json_body(rerank_response(call.response_id, call.model, rerank, values,
                                         call.prompt_tokens()))

    async def embed(self, request: web.Request, job: EmbeddingJob, prefix: str
                    ) -> EmbeddingCall:
        """One request per input, each answered by its embedding; the first error ends the
        call, as a generation call's does."""
        model, lora = await self.model_named(job.model)
        check_dimensions(job.dimensions, self.info.hf_config.hidden_size)
        for given in job.inputs:
            if isinstance(given, list):
                check_vocabulary(given, self.info.vocab_size, "input")
        self.check_admission()
        call = EmbeddingCall(job, prefix + uuid.uuid4().hex, model, int(time.time()), lora,
                             response_id(prefix, request, job.request_id))
        arrival = time.monotonic()
        async with self.open_call(request, call, job.ignored) as (inbox, log):
            await self.outbox.publish(keys.REQUESTS, *call.requests(self.id, time.time()))
            log.info("request queued", prompts=len(call.rids), embeddings=True)
            while not call.done:
                for reply, _ in await next_replies(inbox):
                    if (answer := call.offer(reply)) is not None:
                        self.record_embedding(answer.rid, time.monotonic() - arrival)
            if call.error is not None:
                raise call.error
            log.info("request finished", prompt_tokens=call.prompt_tokens())
            return call

    def record_embedding(self, rid: str, seconds: float) -> None:
        """An embedding request ends with its answer: vLLM counts it a success "stop"."""
        shard = self.shard_label(rid)
        self.metrics.observe(self.metrics.e2e_request_latency, shard, seconds)
        self.metrics.count_success(shard, "stop")

    # --- the backend ------------------------------------------------------------------

    async def refresh_backend(self) -> None:
        """Every shard's liveness keys, and the queue depth, for admission; the state stays
        as it was while Redis does not answer (it goes stale, see Backend.alive)."""
        shards = range(self.info.config.data_parallel_size)
        with anyio.move_on_after(REFRESH_TIMEOUT_S):
            try:
                values = await self.bus.values(*map(keys.alive_scheduler, shards),
                                               *map(keys.alive_worker, shards),
                                               *map(keys.scheduler_stats, shards),
                                               *map(keys.worker_failed, shards))
                streams = await self.bus.stream_infos(keys.REQUESTS)
                for shard in shards:
                    streams += await self.bus.stream_infos(keys.admit(shard))
            except RedisError as e:  # unreachable, or a key of an unexpected type
                self.log.warning("cannot see the backend", error=str(e))
                return
            n = len(shards)
            stats = [scheduler_stats(raw, s) for s, raw in enumerate(values[2 * n:3 * n])]
            failed = worker_failures(values[3 * n:])
            self.backend = Backend(shard_states(values[:2 * n], failed),
                                   queue_depth(streams, stats), time.monotonic())

    # --- the other routes -------------------------------------------------------------

    def served_name(self, name: str | None) -> str:
        """The name responses report (the first served one) for a model a client asked
        for; 404 for a model this server does not serve."""
        if name is not None and name not in self.names:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(map(repr, self.names))}.", "model")
        return self.names[0]

    async def model_named(self, name: str | None) -> tuple[str, LoRARequest | None]:
        """The name responses report and the adapter to run under: a LoRA adapter's own
        name, or the base model's served one; 404 for a model this server does not serve."""
        if self.adapters is not None and name is not None and name not in self.names:
            adapter = await self.adapters.get(name)
            if adapter is not None:
                return name, adapter.lora
        return self.served_name(name), None

    async def models(self, request: web.Request) -> web.Response:
        cards = [ModelCard(id=name, created=self.started_at, owned_by="headrace",
                           root=self.model_path, max_model_len=self.max_model_len)
                 for name in self.names]
        adapters = await self.adapters.all() if self.adapters is not None else {}
        cards += [ModelCard(id=name, created=self.started_at, owned_by="headrace",
                            root=adapter.lora.lora_path, parent=adapter.parent,
                            max_model_len=self.max_model_len)
                  for name, adapter in sorted(adapters.items())]
        return json_body(ModelList(data=cards))

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = validate(LoadLoRAAdapterRequest,
                        await read_json(request, self.server.body_timeout))
        check_new_name(body.lora_name, self.names)
        if not await self.lora_adapters().load(body.lora_name, body.lora_path):
            raise ApiError(400, f"The LoRA adapter {body.lora_name!r} is already loaded; "
                                "unload it first.", "lora_name")
        self.log.info("loaded a LoRA adapter", name=body.lora_name, path=body.lora_path)
        return web.Response(text=f"Success: LoRA adapter '{body.lora_name}' added "
                                 "successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        body = validate(UnloadLoRAAdapterRequest,
                        await read_json(request, self.server.body_timeout))
        adapter = await self.lora_adapters().unload(body.lora_name, body.lora_int_id)
        name = adapter.lora.lora_name
        self.log.info("unloaded a LoRA adapter", name=name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def lora_adapters(self) -> Adapters:
        if self.adapters is None:
            raise ApiError(400, "LoRA adapters are off on this server: start it with "
                                "--enable-lora to load them.")
        return self.adapters

    async def tokenize(self, request: web.Request) -> web.Response:
        job = parse_tokenize(await read_json(request, self.server.body_timeout))
        await self.model_named(job.model)  # an adapter's text is the base tokenizer's
        if job.ignored:
            self.log.warning("ignored unknown request fields", fields=job.ignored)
        ids = await anyio.to_thread.run_sync(self.token_ids, job)
        return json_body(TokenizeResponse(count=len(ids), max_model_len=self.max_model_len,
                                          tokens=ids))

    def token_ids(self, job: TokenizeJob) -> list[int]:
        tokenizer = self.info.tokenizer
        text = job.prompt
        if job.messages is not None:
            text = render_chat(tokenizer, job.messages, job.add_generation_prompt,
                               job.chat_template_kwargs)
        ids = list(tokenizer.encode(text, add_special_tokens=job.add_special_tokens))
        messages = job.messages or []
        urls, video_urls = chat_image_urls(messages), chat_video_urls(messages)
        if not urls and not video_urls:
            return ids
        if self.image_tokens is None:
            raise ApiError(400, "This model takes no images (it is not a vision-language "
                                "model).", "messages")
        if video_urls and self.image_tokens.video_token_id is None:
            raise ApiError(400, "This model takes no videos.", "messages")
        rules = MediaRules.from_config(self.info.config)
        images, videos = load_images(urls, rules), load_videos(video_urls, rules)
        return self.image_tokens.expand(ids, [image.size for image in images],
                                        [(len(f), f.shape[2], f.shape[1]) for f, _ in videos])

    async def detokenize(self, request: web.Request) -> web.Response:
        name, tokens = parse_detokenize(await read_json(request, self.server.body_timeout))
        await self.model_named(name)
        check_vocabulary(tokens, self.info.vocab_size, "tokens")
        text = await anyio.to_thread.run_sync(self.info.tokenizer.decode, tokens)
        return json_body(DetokenizeResponse(prompt=text))

    async def health(self, request: web.Request) -> web.Response:
        """200 while some shard has a scheduler and a worker; the body says which do."""
        if self.draining:
            raise ApiError(503, "Shutting down.")
        n = self.info.config.data_parallel_size
        alive = await self.bus.values(*map(keys.alive_scheduler, range(n)),
                                      *map(keys.alive_worker, range(n)),
                                      *map(keys.worker_failed, range(n)))
        states = shard_states(alive[:2 * n], worker_failures(alive[2 * n:]))
        if (failure := load_failure(states)) is not None:
            raise ApiError(503, "Not ready: " + worker_cannot_load(*failure))
        shards = {str(i): "up" if s.up else "down" for i, s in enumerate(states)}
        if "up" not in shards.values():
            missing = [name for name, values in (("scheduler", alive[:n]),
                                                 ("worker", alive[n:2 * n]))
                       if all(v is None for v in values)]
            raise ApiError(503, "Not ready: " + (f"no live {' and no live '.join(missing)}."
                                                 if missing else "no shard is up."))
        return web.json_response({"status": "ok", "shards": shards})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": VERSION})

    async def openapi(self, request: web.Request) -> web.Response:
        return web.json_response(with_root_path(OPENAPI, self.server.root_path))

    async def prometheus(self, request: web.Request) -> web.Response:
        shards = range(self.info.config.data_parallel_size)
        raws = await self.bus.values(*map(keys.scheduler_stats, shards))
        stats = {shard: s for shard, s in zip(shards, map(scheduler_stats, raws, shards))
                 if s is not None}
        self.metrics.set_scheduler_stats(stats)
        self.metrics.set_streams(await self.bus.stream_infos())
        self.metrics.set_process_stalls(await processes_health(self.bus))
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})


def response_id(prefix: str, request: web.Request | None, given: str | None) -> str | None:
    """vLLM's id of a response: its prefix and the X-Request-Id header, else the body's
    request_id; None: neither was given."""
    header = None if request is None else request.headers.get("X-Request-Id")
    client_id = header if header is not None else given
    return None if client_id is None else prefix + client_id


def worker_failures(raws: list[bytes | None]) -> list[WorkerFailed | None]:
    """Each shard's stored WorkerFailed (None where there is none, or it is not one)."""
    found = [decode_value(keys.worker_failed(s), raw) for s, raw in enumerate(raws)]
    return [f if isinstance(f, WorkerFailed) else None for f in found]


def scheduler_stats(raw: bytes | None, shard: int) -> SchedulerStats | None:
    stats = decode_value(keys.scheduler_stats(shard), raw)
    return stats if isinstance(stats, SchedulerStats) else None


async def read_json(request: web.Request, timeout_s: float) -> Any:
    try:
        with anyio.fail_after(timeout_s):
            raw = await request.read()  # 413 past client_max_size
    except TimeoutError:
        raise ApiError(408, f"The request body did not arrive within --body-timeout "
                            f"{timeout_s:g} s.") from None
    except (PayloadEncodingError, RequestPayloadError) as e:
        raise ApiError(400, f"The request body does not decode as its Content-Encoding "
                            f"header says ({' '.join(str(e).split())}).") from None
    try:
        body = json.loads(raw)
        # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes; only
        # a body that has such an escape is encoded again to find out
        if SURROGATE_ESCAPE.search(raw):
            json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, f"The request body holds a lone UTF-16 surrogate "
                            f"({e.object[e.start:e.end]!r}), which is not text.") from None
    except ValueError as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, too_deep()) from None
    check_nesting_and_integers(body)
    return body


def too_deep() -> str:
    return f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} deep."


def check_nesting_and_integers(body: Any) -> None:
    """Lists and dicts at most MAX_JSON_DEPTH deep, and integers that MessagePack carries
    (64 bits), checked level by level without recursing."""
    level = [body]
    for _ in range(MAX_JSON_DEPTH + 1):
        for item in level:
            if isinstance(item, int) and not INT_RANGE[0] <= item <= INT_RANGE[1]:
                raise ApiError(400, "The request body holds an integer outside the 64-bit "
                                    "range.")
        level = [child for item in level if isinstance(item, (list, dict))
                 for child in (item.values() if isinstance(item, dict) else item)]
        if not level:
            return
    raise ApiError(400, too_deep())


async def send_events(response: web.StreamResponse, events: list[dict[str, Any]]) -> None:
    """Server-sent events named by their type, as the Responses API streams them."""
    if events:
        await response.write(b"".join(
            b"event: " + e["type"].encode() + b"\ndata: " + json.dumps(e).encode() + b"\n\n"
            for e in events))


async def send(response: web.StreamResponse, events: list[BaseModel]) -> None:
    if events:
        await response.write(b"".join(b"data: " + to_json(e) + b"\n\n" for e in events))


def json_body(body: BaseModel) -> web.Response:
    return web.Response(body=to_json(body), content_type="application/json")
