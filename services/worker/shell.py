"""The worker process: owns the weights, the KV cache and the sampler; executes plans in
order and returns each step's sampled tokens.

A reader task prefetches plans and a writer task commits results while the model runs in
a thread, so Redis I/O never sits between two steps. Execution is asynchronous: a plan is
launched on the device before the previous step's tokens are copied back, so the device
starts step N+1 while the host ships step N's result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections import deque

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from common import keys
from common.bus import Entry
from common.log import get_logger
from common.messages import StepPlan, StepResult, WorkerReady
from common.model_info import resolve_engine
from common.service import ALIVE_TTL_MS, ServiceContext, heartbeat, run_service
from common.timing import PhaseClock
from services.worker.executor import Executor

GROUP = "worker"
PREFETCH = 4

log = get_logger("headrace.worker")


class WorkerShell:
    def __init__(self, ctx: ServiceContext, executor: Executor) -> None:
        self.ctx, self.bus, self.executor = ctx, ctx.bus, executor
        self.epoch = uuid.uuid4().hex[:12]
        self.scheduler_epoch = ""
        # plans on the device, results not yet out, with when each was launched
        self.launched: deque[tuple[Entry, float]] = deque()
        self.last_done = 0.0  # when the latest step's result reached the host
        self._receiving: asyncio.Future[Entry] | None = None  # the next plan, when it comes
        self._device: asyncio.Future[None] | None = None  # the device finishing a step
        self.clock = PhaseClock()

    async def run(self) -> None:
        await self.bus.ensure_group(keys.steps(), GROUP)
        stale = await self.bus.read(GROUP, self.ctx.consumer, {keys.steps(): "0"},
                                    count=100_000)
        await self.bus.ack(stale)  # plans left by a previous worker of this name
        config = self.executor.config
        ready = WorkerReady(worker_id=self.ctx.consumer, epoch=self.epoch,
                            num_blocks=self.executor.num_blocks, block_size=config.block_size,
                            max_model_len=config.max_model_len or 0)
        # alive before announced: the scheduler checks liveness as soon as it hears of us
        await self.bus.set_alive(keys.alive_worker(), self.epoch, ALIVE_TTL_MS)
        await self.bus.store(keys.worker_ready(), ready)
        await self.bus.publish(keys.results(), ready)
        log.info("worker ready", epoch=self.epoch, num_blocks=self.executor.num_blocks)
        plans_in, plans_out = anyio.create_memory_object_stream[Entry](PREFETCH)
        results_in, results_out = anyio.create_memory_object_stream[
            tuple[Entry, StepResult | None]](PREFETCH)
        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, self.bus, keys.alive_worker(), self.epoch, self.ctx.stop)
            tg.start_soon(self._read, plans_in)
            tg.start_soon(self._write, results_out)
            await self._execute(plans_out, results_in)
            tg.cancel_scope.cancel()
        log.info("worker loop times", **self.clock.summary())

    async def _read(self, plans: ObjectSendStream[Entry]) -> None:
        async with plans:
            while not self.ctx.stop.is_set():
                for entry in await self.bus.read(GROUP, self.ctx.consumer,
                                                 {keys.steps(): ">"}, count=PREFETCH,
                                                 block_ms=200):
                    await plans.send(entry)

    async def _execute(self, plans: ObjectReceiveStream[Entry],
                       results: ObjectSendStream[tuple[Entry, StepResult | None]]) -> None:
        """Launch each plan as it comes; a step's result goes out once the next step is
        queued behind it on the device, or once it is complete and no plan is waiting."""
        clock = self.clock
        async with results:
            while True:
                clock.start()
                entry = await self._next_plan(plans)
                clock.lap("wait_for_plan")
                if entry is None:
                    if not self.launched:
                        return  # the reader stopped and every result is out
                    done = await anyio.to_thread.run_sync(self.executor.flush)
                    clock.lap("flush")
                else:
                    done = await self._step(entry)
                    clock.lap("submit")
                    if done is None:
                        await results.send((entry, None))
                        continue
                for result in done:
                    finished, launched_at = self.launched.popleft()
                    done_at = result.stamps[-1]  # when the executor had its tokens
                    # a step launched behind another starts when that one is done
                    started = max(launched_at, self.last_done)
                    stamps = [finished.msg.planned_at, started, done_at]
                    self.last_done = done_at
                    await results.send((finished, dataclasses.replace(
                        result, epoch=self.epoch, stamps=stamps)))
                clock.lap("hand_to_writer")

    async def _next_plan(self, plans: ObjectReceiveStream[Entry]) -> Entry | None:
        """The next plan, or None when the step on the device completes (or the stream
        ends) before one arrives: whichever comes first wakes us, with no polling. Neither
        wait is ever cancelled (a cancelled receive could drop a plan handed to it); the
        one that loses stays pending for the next call."""
        while True:
            if self._receiving is None:
                self._receiving = asyncio.ensure_future(plans.receive())
            waits = {self._receiving}
            if self.launched and not self.executor.step_done():
                if self._device is None or self._device.done():
                    self._device = asyncio.ensure_future(
                        anyio.to_thread.run_sync(self.executor.wait_step_done))
                waits.add(self._device)
            elif self.launched and not self._receiving.done():
                return None  # the last step is complete and no plan waits
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if self._receiving.done():
                receiving, self._receiving = self._receiving, None
                try:
                    return receiving.result()
                except anyio.EndOfStream:
                    return None
            # a device wait ended: the loop sees whether it was the latest step's

    async def _step(self, entry: Entry) -> list[StepResult] | None:
        """Launch the plan; the results of earlier steps that it completed, or None when
        the plan is not for this worker."""
        plan: StepPlan = entry.msg
        if plan.epoch != self.epoch:
            return None  # planned for a worker that is gone
        done = []
        if plan.scheduler_epoch != self.scheduler_epoch:  # a new scheduler starts afresh
            done = await anyio.to_thread.run_sync(self.executor.flush)
            self.executor.forget_requests()
            self.scheduler_epoch = plan.scheduler_epoch
        launched_at = time.time()
        done += await anyio.to_thread.run_sync(self.executor.submit, plan)
        self.launched.append((entry, launched_at))
        return done

    async def _write(self, results: ObjectReceiveStream[tuple[Entry, StepResult | None]]
                     ) -> None:
        async with results:
            async for entry, result in results:
                await self.bus.commit([(keys.results(), result)] if result else [],
                                      done=[entry])


async def serve(ctx: ServiceContext) -> None:
    executor = await anyio.to_thread.run_sync(Executor, resolve_engine(ctx.engine))
    await WorkerShell(ctx, executor).run()


def main(argv: list[str]) -> int:
    return run_service("worker", argv, serve, __doc__ or "")
