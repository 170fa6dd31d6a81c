"""The worker process: owns the weights, the KV cache and the sampler; executes plans in
order and returns each step's sampled tokens.

The event loop only does Redis: a reader task hands plans to the step thread
(services/worker/step_thread.py), which launches each as soon as it comes, and a writer task
commits the results it posts. Execution is asynchronous: a plan is launched on the device
before the previous step's tokens are copied back, so the device starts step N+1 while the
host ships step N's result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import anyio

from common import keys
from common.bus import Entry
from common.log import get_logger
from common.image_blobs import attach_pixels, lapsed_images
from common.messages import RequestFailed, StepPlan, StepResult, WorkerFailed, WorkerReady
from common.model_info import check_shard, resolve_engine
from common.service import (ALIVE_TTL_MS, ModelLoadFailed, ServiceContext, freeze_heap,
                            heartbeat, run_service)
from services.worker.executor import Executor, start_executor
from services.worker.failed_requests import FailedRequests
from services.worker.step_thread import StepThread

GROUP = "worker"
PREFETCH = 4
STEP_THREADS_JOIN_S = 10.0  # the step thread and its device waiter, once stopped

log = get_logger("headrace.worker")


class WorkerShell:
    def __init__(self, ctx: ServiceContext, executor: Executor) -> None:
        self.ctx, self.bus, self.executor = ctx, ctx.bus, executor
        self.shard = ctx.server.shard
        self.epoch = uuid.uuid4().hex[:12]
        self.failed = FailedRequests()

    async def run(self) -> None:
        await self.bus.ensure_group(keys.steps(self.shard), GROUP)
        stale = await self.bus.read(GROUP, self.ctx.consumer, {keys.steps(self.shard): "0"},
                                    count=100_000)
        await self.bus.ack(stale)  # plans left by a previous worker of this name
        config = self.executor.config
        ready = WorkerReady(worker_id=self.ctx.consumer, epoch=self.epoch,
                            num_blocks=self.executor.num_blocks, block_size=config.block_size,
                            max_model_len=config.max_model_len or 0,
                            pipeline_stages=config.pipeline_parallel_size)
        # alive before announced: the scheduler checks liveness as soon as it hears of us
        await self.bus.set_alive(keys.alive_worker(self.shard), self.epoch, ALIVE_TTL_MS)
        await self.bus.store(keys.worker_ready(self.shard), ready)
        await self.bus.publish(keys.results(self.shard), ready)
        log.info("worker ready", epoch=self.epoch, num_blocks=self.executor.num_blocks)
        results: asyncio.Queue[tuple[Entry | None, StepResult | BaseException | None]] = \
            asyncio.Queue()
        loop = asyncio.get_running_loop()
        steps = StepThread(self.executor, self.epoch,
                           lambda *item: loop.call_soon_threadsafe(results.put_nowait, item))
        steps.start()
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, self.bus, keys.alive_worker(self.shard), self.epoch,
                          self.ctx.stop)
            tg.start_soon(self._read, steps)
            await self._write(results)
            tg.cancel_scope.cancel()
        # its last post is out; the device waiter may still be in a call on the executor,
        # which serve() closes next
        steps.join(STEP_THREADS_JOIN_S)
        log.info("worker loop times", **steps.clock.summary())

    async def _read(self, steps: StepThread) -> None:
        try:
            while not self.ctx.stop.is_set():
                for entry in await self.bus.read(GROUP, self.ctx.consumer,
                                                 {keys.steps(self.shard): ">"},
                                                 count=PREFETCH,
                                                 block_ms=200):
                    if isinstance(entry.msg, StepPlan):
                        entry = dataclasses.replace(entry, msg=await self._runnable(entry.msg))
                    steps.put(entry)
        finally:
            steps.stop()

    async def _runnable(self, plan: StepPlan) -> StepPlan:
        """`plan` with its new requests' pixels, less the requests that cannot run (their
        pixels lapsed): the scheduler hears of those at once and ends them."""
        if plan.epoch != self.epoch:
            return plan  # the step thread skips it
        if plan.new:
            plan = await attach_pixels(self.bus, plan)
            for req_id, reason in lapsed_images(plan).items():
                log.warning("request failed", req_id=req_id, reason=reason)
                self.failed.add([req_id])
                await self.bus.publish(keys.results(self.shard),
                                       RequestFailed([req_id], reason, self.epoch))
        return self.failed.strip(plan)

    async def _write(self, results: asyncio.Queue) -> None:
        """Commit results as the step thread posts them, all that are waiting in one round
        trip, until it posts its last."""
        while True:
            batch = [await results.get()]
            while not results.empty():
                batch.append(results.get_nowait())
            done = [entry for entry, _ in batch if entry is not None]
            outputs = [(keys.results(self.shard), result) for entry, result in batch
                       if entry is not None and result is not None]
            await self.bus.commit(outputs, done=done)
            last, error = batch[-1]
            if last is None:
                if isinstance(error, BaseException):
                    raise error
                return


async def serve(ctx: ServiceContext) -> None:
    check_shard(ctx.engine, ctx.server)
    executor = await load(ctx)
    freeze_heap()
    try:
        await WorkerShell(ctx, executor).run()
    finally:
        executor.close()


async def load(ctx: ServiceContext) -> Executor:
    """The executor with the model loaded. A failure is published at the shard's
    worker:failed key (the gateways answer 503 with its reason while it is there) and ends
    the process with ModelLoadFailed. The key goes while a load is underway: a failure
    stored before is no answer for a worker that may yet load (fixed weights, a restart)."""
    key = keys.worker_failed(ctx.server.shard)
    before = await ctx.bus.load(key)
    await ctx.bus.forget(key)
    try:
        return await anyio.to_thread.run_sync(start_executor, resolve_engine(ctx.engine))
    except Exception as e:
        reason = one_line(e)
        same_model = isinstance(before, WorkerFailed) and before.model == ctx.engine.model
        failed = WorkerFailed(ctx.consumer, ctx.engine.model, reason,
                              before.failures + 1 if same_model else 1)
        await ctx.bus.store(key, failed)
        log.exception("cannot load the model", failures=failed.failures)
        raise ModelLoadFailed(reason) from e


def one_line(error: BaseException) -> str:
    """The exception's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def main(argv: list[str]) -> int:
    # a model no worker can run is refused before the process joins the others
    return run_service("worker", argv, serve, __doc__ or "", check=resolve_engine)
