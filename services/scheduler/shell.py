"""The scheduler process: every request's state and the KV block table live here.

It reads admitted requests, aborts and step results, and keeps a few steps planned but
not yet reported (services/scheduler/inflight.py), so the worker does not wait on a Redis
hop: while the device runs step N+1, the plan of N+2 is made from N's result, before those
steps' tokens are known (see services/scheduler/request.py). A result frees its slot at
once; the next plan is made before the result's tokens are applied, and both leave in one
commit with the acknowledgements of what was read, unless the tokens are many: then the
plan goes first, on its own, and the worker has it while the tokens are applied. Commits
are written behind the loop (services/scheduler/commits.py): it reads on while Redis
answers them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable

import anyio

from common import keys
from common.bus import Entry, Output
from common.config import EngineConfig
from common.log import get_logger
from common.image_blobs import renew_every_s
from common.messages import (Abort, AdmitRequest, DrainSteps, ErrorReply, RequestFailed,
                             SchedulerStats, StepResult, WorkerReady)
from common.model_info import check_shard, resolve_engine
from common.service import ServiceContext, freeze_heap, heartbeat, run_service
from common.timing import PhaseClock
from services.scheduler.commits import CommitQueue
from services.scheduler.core import Scheduler, SchedulerConfig
from services.scheduler.inflight import StepsInFlight

GROUP = "scheduler"
READ_BLOCK_MS = 100
CHECK_WORKER_EVERY_S = 0.5
CHECK_GATEWAYS_EVERY_S = 1.0
STATS_EVERY_S = 0.5
# The figures outlive a scheduler killed without a word only this long: its shard's
# gauges then vanish from /metrics instead of reading their last value forever.
STATS_TTL_S = 20 * STATS_EVERY_S
WORKER_GRACE_S = 60.0  # admissions wait this long for a (new) worker, then get a 503
# From this many rows of results in a read, the plans leave in a commit of their own before
# the tokens are applied: applying and encoding a row's token costs the scheduler about
# 10 us (`headrace bench scheduler --served --n 4 --logprobs 5`, 2-CPU box), so at 64 rows
# the plans would wait several Redis round trips for them; at 256 rows (n=4 streams), 2.5 ms.
EARLY_PLAN_ROWS = 64

log = get_logger("headrace.scheduler")


class SchedulerShell:
    def __init__(self, ctx: ServiceContext, config: EngineConfig) -> None:
        self.ctx, self.bus, self.config = ctx, ctx.bus, config
        self.shard = ctx.server.shard
        self.epoch = uuid.uuid4().hex[:12]
        self.core: Scheduler | None = None
        self.worker_epoch = ""
        self.steps = StepsInFlight()
        self.commits = CommitQueue(ctx.bus)
        self.results: list[StepResult] = []  # taken this round, applied after planning
        self.next_worker_check = 0.0
        self.next_gateway_check = 0.0
        self.next_image_renewal = 0.0
        self.gateways_seen: set[str] = set()
        self.no_worker_since = time.monotonic()
        self.clock = PhaseClock()
        self.stats_due = anyio.Event()  # set when a round ended requests: publish at once
        self.last_stats: SchedulerStats | None = None

    async def run(self) -> None:
        for stream in (keys.admit(self.shard), keys.control(self.shard), keys.results(self.shard)):
            await self.bus.ensure_group(stream, GROUP)
        await self._discard_stale_results()
        ready = await self.bus.load(keys.worker_ready(self.shard))
        if isinstance(ready, WorkerReady):  # a worker already runs: take it over afresh
            await self.bus.commit(self._worker_ready(ready))
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, self.bus, keys.alive_scheduler(self.shard), self.epoch,
                          self.ctx.stop)
            tg.start_soon(self._publish_stats)
            tg.start_soon(self.commits.run)
            # what a previous incarnation left unread
            pending = {keys.admit(self.shard): "0", keys.control(self.shard): "0"}
            clock = self.clock
            while not self.ctx.stop.is_set():
                clock.start()
                unfinished = self._num_unfinished()
                streams = {keys.results(self.shard): ">", keys.control(self.shard): ">", **self._admissions(),
                           **pending}
                entries = await self.bus.read(GROUP, self.ctx.consumer, streams, count=512,
                                              block_ms=None if pending else READ_BLOCK_MS)
                clock.lap("read")
                pending = {}
                outputs = self._plan_round(entries)
                if outputs and self._rows_to_apply() >= EARLY_PLAN_ROWS:
                    await self.commits.put(outputs)
                    clock.lap("commit")
                    outputs = []
                outputs += self._result_round()
                await self.commits.put(outputs, done=entries)
                clock.lap("commit")
                if self._num_unfinished() < unfinished:
                    self.stats_due.set()
                await self.commits.put(await self._check_worker())
                await self._abort_orphans()
                await self._renew_images()
            await self.commits.flush()
            tg.cancel_scope.cancel()
        await self.bus.forget(keys.scheduler_stats(self.shard))  # stopped: no figures
        log.info("scheduler loop times", **self.clock.summary())

    def _plan_round(self, entries: list[Entry]) -> list[Output]:
        """What a read's entries send before its results' tokens: replies to what was
        read, then the plans. Planning comes before applying the results (the scheduler
        plans ahead of the tokens anyway), so that the tokens and the plans can leave in
        one round trip."""
        outputs = self._handle(entries)
        outputs += self._plan()
        self.clock.lap("schedule")
        return outputs

    def _result_round(self) -> list[Output]:
        """The results' tokens, then the plans they allow: another plan only where they
        may have woken a request the first plan could not take, since nothing else would
        wake it before the next read times out (READ_BLOCK_MS), and any drain."""
        woken = self._results_may_wake()
        unfinished = self._num_unfinished()
        outputs = self._apply_results()
        self.clock.lap("update")
        if woken or self._room_freed_for_waiting(unfinished):
            outputs += self._plan()
        outputs += self._drain()
        self.clock.lap("schedule")
        return outputs

    def _rows_to_apply(self) -> int:
        return sum(len(result.req_ids) for result in self.results)

    def _results_may_wake(self) -> bool:
        """Whether a request may wait for the tokens of this round's results: every
        request does under pipeline stages (only the last stage holds its token), and a
        speculating one waits for how many drafts were accepted (services/scheduler/core.py).
        Otherwise a request is planned ahead of its tokens, and the first plan took it."""
        if self.core is None or not self.results:
            return False
        config = self.core.config
        return config.pipeline_stages > 1 or config.speculative is not None

    def _room_freed_for_waiting(self, unfinished_before: int) -> bool:
        """Whether a request that the results ended left KV blocks and a seat
        (max_num_seqs) to a waiting one, which may not have fit in the first plan."""
        return (self.core is not None and len(self.core.waiting) > 0
                and self._num_unfinished() < unfinished_before)

    # --- inputs ---------------------------------------------------------------------------

    def _admissions(self) -> dict[str, str]:
        """Read new requests while a worker serves; without one, let them wait in their
        stream for a while (a worker is starting or restarting), then reject them."""
        waiting = time.monotonic() - self.no_worker_since < WORKER_GRACE_S
        return {} if self.core is None and waiting else {keys.admit(self.shard): ">"}

    def _handle(self, entries: Iterable[Entry]) -> list[Output]:
        outputs: list[Output] = []
        for entry in entries:
            msg = entry.msg
            if isinstance(msg, StepResult):
                self._take_result(msg)
            elif isinstance(msg, WorkerReady):
                outputs += self._worker_ready(msg)
            elif isinstance(msg, Abort):
                if self.core is not None:
                    self.core.abort(msg.rid, msg.index, msg.reason, msg.stop_reason)
            elif isinstance(msg, AdmitRequest):
                outputs += self._admit(msg)
            elif isinstance(msg, RequestFailed):
                outputs += self._request_failed(msg)
            else:
                log.warning("unexpected message", type=msg.TYPE, stream=entry.stream)
        return outputs

    def _take_result(self, result: StepResult) -> None:
        """Frees the step's slot now; its tokens are applied after the next plan is out."""
        if self.core is None or result.epoch != self.worker_epoch:
            return  # from a worker that is gone
        depth = self.steps.depth
        self.steps.finished(result.step, result.stamps)
        if self.steps.depth != depth:
            log.info("steps planned ahead", depth=self.steps.depth, step=result.step)
        self.results.append(result)

    def _apply_results(self) -> list[Output]:
        outputs: list[Output] = []
        for result in self.results:  # all of the current worker's: _worker_ready clears
            assert self.core is not None
            columns, logprobs = self.core.update_columns(result)
            if len(columns):
                outputs.append((keys.DETOK, columns.batch(result.step, result.stamps,
                                                          self.shard, logprobs)))
        self.results = []
        return outputs

    def _admit(self, req: AdmitRequest) -> list[Output]:
        if self.core is None:
            return [_error(req.reply_to, req.rid, 503, "no GPU worker is running; retry later",
                           "ServiceUnavailableError")]
        try:
            admitted = self.core.add_request(req)
        except ValueError as e:
            return [_error(req.reply_to, req.rid, 400, str(e))]
        if not admitted:
            log.info("dropped a repeated admission", rid=req.rid)
            return []
        log.debug("admitted", rid=req.rid, prompt_tokens=len(req.prompt_token_ids))
        return []

    def _request_failed(self, failed: RequestFailed) -> list[Output]:
        if self.core is None or failed.epoch != self.worker_epoch:
            return []
        ended = self.core.fail(failed.req_ids)
        for _, rid in ended:
            log.warning("request failed on the worker", rid=rid, reason=failed.message)
        return [_error(reply_to, rid, failed.status, failed.message, "ServiceUnavailableError")
                for reply_to, rid in ended]

    def _worker_ready(self, ready: WorkerReady) -> list[Output]:
        """A (re)started worker has an empty KV cache: whatever ran on the last one ends.
        Its block size and pipeline stages are what the plans follow, so a scheduler
        started by hand with other flags plans for the worker that runs them."""
        if ready.epoch == self.worker_epoch:
            return []  # the announcement in the stream of a worker taken over from its key
        outputs = self._fail_all("the GPU worker restarted; the request was aborted")
        if ready.max_model_len < self.config.max_model_len:  # type: ignore[operator]
            log.warning("worker serves a shorter max_model_len", worker=ready.max_model_len)
        if ready.pipeline_stages != self.config.pipeline_parallel_size:
            log.warning("planning for the worker's pipeline stages, not this scheduler's "
                        "--pipeline-parallel-size", worker=ready.pipeline_stages,
                        scheduler=self.config.pipeline_parallel_size)
        config = dataclasses.replace(self.config, block_size=ready.block_size)
        self.core = Scheduler(dataclasses.replace(
            SchedulerConfig.from_engine(config, ready.num_blocks),
            pipeline_stages=ready.pipeline_stages))
        self.worker_epoch, self.results = ready.epoch, []
        self.steps = StepsInFlight(self.core.config.pipeline_stages)
        log.info("worker ready", worker=ready.worker_id, epoch=ready.epoch,
                 num_blocks=ready.num_blocks)
        return outputs

    # --- outputs --------------------------------------------------------------------------

    def _plan(self) -> list[Output]:
        outputs: list[Output] = []
        while self.core is not None and self.steps.may_plan():
            plan = self.core.schedule()
            if plan is None:
                self.steps.idle()
                break
            outputs.append((keys.steps(self.shard), dataclasses.replace(
                plan, epoch=self.worker_epoch, scheduler_epoch=self.epoch)))
            self.steps.planned(plan.step)
        return outputs

    def _drain(self) -> list[Output]:
        """A drain when the worker's pipeline stages hold every step out
        (services/scheduler/inflight.py)."""
        if self.core is None or not self.steps.must_drain():
            return []
        self.steps.drained()
        return [(keys.steps(self.shard), DrainSteps(self.worker_epoch, self.epoch))]

    def _fail_all(self, reason: str) -> list[Output]:
        if self.core is None:
            return []
        outputs = [_error(reqs[0].reply_to, rid, 503, reason, "ServiceUnavailableError")
                   for rid, reqs in self.core.by_rid.items()]
        if outputs:
            log.error("ending every request", reason=reason, requests=len(outputs))
        return outputs

    async def _check_worker(self) -> list[Output]:
        """The worker's liveness key lapses a few seconds after it dies; then every request
        it held ends with an error instead of waiting for results that will never come."""
        now = time.monotonic()
        if self.core is None or now < self.next_worker_check:
            return []
        self.next_worker_check = now + CHECK_WORKER_EVERY_S
        alive, = await self.bus.values(keys.alive_worker(self.shard))
        if alive is not None and alive.decode() == self.worker_epoch:
            return []
        outputs = self._fail_all("the GPU worker stopped; the request was aborted")
        for rid in list(self.core.by_rid):  # they end with it: the gauges say so
            self.core.abort(rid)
        await self._store_stats()
        self.core, self.worker_epoch, self.steps = None, "", StepsInFlight()
        self.no_worker_since = now
        log.error("worker lost: waiting for a new one")
        return outputs

    async def _abort_orphans(self) -> None:
        """A killed gateway reads no more replies: once its liveness key, seen before, has
        lapsed, its requests end and free their KV blocks. (A bus client that keeps no
        key, like the benchmarks' driver, is never taken for gone.)"""
        now = time.monotonic()
        if self.core is None or now < self.next_gateway_check:
            return
        self.next_gateway_check = now + CHECK_GATEWAYS_EVERY_S
        by_gateway = self.core.rids_by_gateway()
        names = list(by_gateway)
        alive = await self.bus.values(*map(keys.alive_gateway, names)) if names else []
        live = {name for name, value in zip(names, alive) if value is not None}
        for name in (self.gateways_seen & by_gateway.keys()) - live:
            log.warning("gateway gone: ending its requests", gateway=name,
                        requests=len(by_gateway[name]))
            for rid in by_gateway[name]:
                self.core.abort(rid)
        self.gateways_seen = live

    async def _renew_images(self) -> None:
        """Keep the pixels of the requests held here in Redis while they wait, run or are
        preempted (common/image_blobs.py): all their keys in one round trip, a few times
        per TTL."""
        now = time.monotonic()
        ttl_s = self.ctx.server.image_ttl
        if self.core is None or now < self.next_image_renewal:
            return
        self.next_image_renewal = now + renew_every_s(ttl_s)
        if names := self.core.image_keys():
            if gone := await self.bus.renew(names, ttl_s):
                log.warning("image pixels gone from Redis", keys=len(gone), first=gone[0])

    def _num_unfinished(self) -> int:
        return 0 if self.core is None else len(self.core.requests)

    async def _publish_stats(self) -> None:
        """Every STATS_EVERY_S, and at once after a round that ended requests, so that the
        gauges read 0 as soon as the last request has ended."""
        while not self.ctx.stop.is_set():
            await self._store_stats()
            with anyio.move_on_after(STATS_EVERY_S):
                await self.stats_due.wait()
            self.stats_due = anyio.Event()

    async def _store_stats(self) -> None:
        """The core's figures; between workers (no core), the last ones, which read 0
        running (the lost worker's requests ended)."""
        if self.core is not None:
            self.last_stats = self.core.stats()
        if self.last_stats is not None:
            await self.bus.store(keys.scheduler_stats(self.shard), self.last_stats,
                                 ttl_s=STATS_TTL_S)

    async def _discard_stale_results(self) -> None:
        """Results and worker announcements a previous incarnation left unacknowledged
        refer to a state that is gone."""
        stale = await self.bus.read(GROUP, self.ctx.consumer, {keys.results(self.shard): "0"},
                                    count=10_000)
        if stale:
            await self.bus.ack(stale)


def _error(reply_to: str, rid: str, status: int, message: str,
           kind: str = "BadRequestError") -> Output:
    return (keys.replies(reply_to), ErrorReply(rid, status, message, kind))


async def serve(ctx: ServiceContext) -> None:
    check_shard(ctx.engine, ctx.server)
    config = resolve_engine(ctx.engine, torch_free=True).config
    freeze_heap()
    await SchedulerShell(ctx, config).run()


def main(argv: list[str]) -> int:
    return run_service("scheduler", argv, serve, __doc__ or "")
