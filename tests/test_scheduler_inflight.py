"""How far the scheduler plans ahead of the worker: the depth rule on its own, the drain
that a worker of pipeline stages needs, and the scheduler process's shell against a real
Redis with this test playing the worker."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest

from common import keys
from common.bus import Bus, Entry
from common.config import EngineConfig, ServerConfig
from common.messages import AdmitRequest, DrainSteps, StepPlan, StepResult, WorkerReady
from common.sampling_params import SamplingParams
from common.service import ServiceContext
from services.scheduler.inflight import IDLE_S, MAX_DEPTH, MIN_DEPTH, QUIET_STEPS, StepsInFlight
from services.scheduler import shell
from services.scheduler.shell import SchedulerShell


@dataclass
class Device:
    """Keeps the depth full and finishes one step per gap: a step starts `gap` after the
    one before it finished (0: its plan was queued in time)."""
    steps: StepsInFlight
    planned: int = 0
    finished: int = 0
    done: float = 1.0

    def run(self, gaps: list[float], step_s: float = 0.002) -> None:
        self.fill()
        for gap in gaps:
            started = self.done + gap
            self.done = started + step_s
            self.finished += 1
            self.steps.finished(self.finished, [started - 0.001, started, self.done])
            self.fill()

    def fill(self) -> None:
        while self.steps.may_plan():
            self.planned += 1
            self.steps.planned(self.planned)


def test_two_steps_in_flight_while_the_worker_keeps_up():
    steps = StepsInFlight()
    Device(steps).run([0.0] * 50)
    assert steps.depth == MIN_DEPTH == 2
    assert steps.inflight == 2 and not steps.may_plan()


def test_a_device_waiting_for_a_refill_plan_deepens_the_queue_up_to_the_max():
    steps = StepsInFlight()
    device = Device(steps)
    device.run([0.0] * 5 + [IDLE_S * 5] * 2)
    assert steps.depth == 3  # the steps planned before it deepened do not count again
    device.run([IDLE_S * 5] * 10)
    assert steps.depth == MAX_DEPTH


def test_a_quiet_run_brings_the_depth_back_down():
    steps = StepsInFlight(depth=3)
    Device(steps).run([0.0] * (QUIET_STEPS + 1))
    assert steps.depth == 2


def test_a_request_arriving_at_an_idle_engine_is_no_sign_of_starvation():
    steps = StepsInFlight()
    steps.planned(1)
    steps.idle()  # nothing more to plan
    steps.finished(1, [1.0, 1.0, 1.002])
    steps.planned(2)  # a new request, seconds later
    steps.finished(2, [5.0, 5.0, 5.002])
    assert steps.depth == MIN_DEPTH


# --- pipeline stages: the depth and the drain ----------------------------------------------

def test_stages_get_a_depth_of_one_more_than_their_count_at_least():
    """N stages hold N steps (common/pipeline.py): N + 1 must be out for one to return."""
    assert StepsInFlight(stages=2).depth == 3
    steps = StepsInFlight(stages=4)
    assert steps.depth == 5 and steps.max_depth == 6
    Device(steps).run([0.0] * QUIET_STEPS * 2)  # a quiet run never goes below the stages
    assert steps.depth == 5


def test_a_drain_goes_only_when_the_stages_hold_every_step_out():
    """Two stages hold the newest two steps they were sent; three the newest three."""
    steps = StepsInFlight(stages=2)
    steps.planned(1)
    assert steps.must_drain()  # step 1 is out, and the stages keep it
    steps.drained()
    assert not steps.must_drain()  # told once: they let it go
    steps.finished(1, [])
    steps.planned(2)
    steps.planned(3)
    assert steps.must_drain()  # both are held
    steps.planned(4)
    assert not steps.must_drain()  # launching 4 pushes 2 out
    steps.finished(2, [])
    assert steps.must_drain()  # 3 and 4 are held, and no plan follows them
    one = StepsInFlight()
    one.planned(1)
    assert not one.must_drain()  # one rank hands each step back when it is done
    three = StepsInFlight(stages=3)
    for step in (1, 2, 3, 4):
        three.planned(step)
    assert not three.must_drain()
    three.finished(1, [])
    assert three.must_drain()


# --- the shell: a new request's prefill waits behind at most one queued step ------------

async def next_order(bus: Bus, timeout_s: float = 5.0) -> StepPlan | DrainSteps:
    with anyio.fail_after(timeout_s):
        while True:
            entries = await bus.read("worker", "w", {keys.steps(): ">"}, count=1,
                                     block_ms=100)
            if entries:
                await bus.ack(entries)
                return entries[0].msg


async def next_plan(bus: Bus, timeout_s: float = 5.0) -> StepPlan:
    with anyio.fail_after(timeout_s):
        while True:
            entries = await bus.read("worker", "w", {keys.steps(): ">"}, count=1,
                                     block_ms=100)
            if entries:
                await bus.ack(entries)
                return entries[0].msg


async def no_plan_within(bus: Bus, seconds: float) -> bool:
    entries = await bus.read("worker", "w", {keys.steps(): ">"}, count=1,
                             block_ms=int(seconds * 1000))
    return not entries


def admission(rid: str) -> AdmitRequest:
    params = SamplingParams(max_tokens=50, ignore_eos=True, eos_token_ids=(0,))
    return AdmitRequest(rid, "gw", [5, 6, 7], params)


@pytest.mark.anyio
async def test_a_new_prefill_waits_behind_at_most_one_queued_step(redis_url):
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=256)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 30_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256))
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), bus, anyio.Event())
        tg.start_soon(SchedulerShell(ctx, config).run)

        await bus.publish(keys.admit(), admission("a"))
        first, second = await next_plan(bus), await next_plan(bus)
        assert [first.step, second.step] == [1, 2] and first.req_ids == ["a#0"]
        assert await no_plan_within(bus, 0.3)  # two in flight: nothing more is planned

        await bus.publish(keys.admit(), admission("b"))
        assert await no_plan_within(bus, 0.3)  # b waits for a slot, not for a timer
        await bus.publish(keys.results(), StepResult(1, ["a#0"], [9], epoch="epoch-1"))
        third = await next_plan(bus)
        # b's prefill is planned as soon as step 1 is done: only step 2 is ahead of it
        assert third.step == 3 and [r.req_id for r in third.new] == ["b#0"]
        ctx.stop.set()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
@pytest.mark.parametrize("early_rows, commits", [
    (2, [["plan"], ["tokens"]]), (3, [["plan", "tokens"]])])
async def test_many_rows_of_results_send_the_plans_before_their_tokens(
        redis_url, monkeypatch, early_rows, commits):
    """A result of EARLY_PLAN_ROWS rows or more: the round's plan leaves in a commit of its
    own, before the tokens are applied and encoded; fewer rows: plan and tokens in one."""
    monkeypatch.setattr(shell, "EARLY_PLAN_ROWS", early_rows)
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=256)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 30_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256))
        sent: list[list[str]] = []
        write = bus.write

        async def logged(records, done=()):  # the scheduler's: this test publishes too
            names = [fields["type"] for _, fields in records]
            if {"plan", "tokens"} & set(names):
                sent.append(names)
            return await write(records, done)
        monkeypatch.setattr(bus, "write", logged)
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), bus, anyio.Event())
        tg.start_soon(SchedulerShell(ctx, config).run)
        params = SamplingParams(max_tokens=50, ignore_eos=True, eos_token_ids=(0,), n=2)
        await bus.publish(keys.admit(), AdmitRequest("a", "gw", [5, 6, 7], params))
        assert [(await next_plan(bus)).step for _ in range(2)] == [1, 2]
        sent.clear()
        await bus.publish(keys.results(), StepResult(1, ["a#0", "a#1"], [9, 9],
                                                     epoch="epoch-1"))
        assert (await next_plan(bus)).step == 3
        with anyio.fail_after(5):
            while not any("tokens" in names for names in sent):
                await anyio.sleep(0.01)
        assert sent == commits
        ctx.stop.set()
        tg.cancel_scope.cancel()


def test_a_gap_small_beside_a_long_step_keeps_the_depth():
    """On the CPU a step takes ~100 ms and a hop a few: queueing deeper would only make
    new requests wait a whole step longer."""
    steps = StepsInFlight()
    device = Device(steps)
    device.run([0.004] * 20, step_s=0.1)
    assert steps.depth == MIN_DEPTH
    device.run([0.02] * 2, step_s=0.1)
    assert steps.depth == MIN_DEPTH + 1


@pytest.mark.anyio
@pytest.mark.parametrize("own_flag", [2, 1])
async def test_two_stages_are_told_to_drain_and_a_result_is_planned_on_at_once(
        redis_url, monkeypatch, own_flag):
    """One request on a worker of two stages: each plan is followed by a drain (the stages
    hold its step, and the request's next step needs that step's token). Its result is
    planned on in the round that applies it, not after the scheduler's next read times
    out. A scheduler started by hand without --pipeline-parallel-size 2 plans the same:
    the stage count is the worker's, from its announcement."""
    monkeypatch.setattr(shell, "READ_BLOCK_MS", 30_000)
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=256,
                          pipeline_parallel_size=own_flag)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 30_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256,
                                                      pipeline_stages=2))
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), bus, anyio.Event())
        scheduler = SchedulerShell(ctx, config)
        tg.start_soon(scheduler.run)

        await bus.publish(keys.admit(), admission("a"))
        for step in (1, 2, 3):
            plan = await next_order(bus)
            assert isinstance(plan, StepPlan) and plan.step == step and plan.req_ids == ["a#0"]
            drain = await next_order(bus)
            assert drain == DrainSteps("epoch-1", scheduler.epoch)
            await bus.publish(keys.results(), StepResult(step, ["a#0"], [9], epoch="epoch-1"))
        ctx.stop.set()
        tg.cancel_scope.cancel()


@pytest.mark.anyio
async def test_a_scheduler_flagged_for_stages_plans_ahead_for_a_worker_of_one(redis_url):
    """The other way round: the worker runs one rank, so the scheduler plans the request's
    next step before the last one's token is back, and sends no drain."""
    config = EngineConfig(max_model_len=256, max_num_batched_tokens=256,
                          pipeline_parallel_size=2)
    async with Bus(redis_url) as bus, anyio.create_task_group() as tg:
        await bus.ensure_group(keys.steps(), "worker")
        await bus.set_alive(keys.alive_worker(), "epoch-1", 30_000)
        await bus.publish(keys.results(), WorkerReady("w", "epoch-1", 64, 16, 256))
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), bus, anyio.Event())
        tg.start_soon(SchedulerShell(ctx, config).run)
        await bus.publish(keys.admit(), admission("a"))
        orders = [await next_order(bus), await next_order(bus)]
        assert [(o.step, o.req_ids) for o in orders] == [(1, ["a#0"]), (2, ["a#0"])]
        ctx.stop.set()
        tg.cancel_scope.cancel()


# --- the shell's rounds: a second plan only where the results may have woken a request --

class Rounds:
    """The shell's rounds without Redis, counting the core's `schedule` calls per round."""

    def __init__(self, config: EngineConfig, stages: int = 1) -> None:
        no_bus: Bus = None  # type: ignore[assignment]  # a round does no I/O
        ctx = ServiceContext("scheduler", "t", config, ServerConfig(), no_bus, anyio.Event())
        self.shell = SchedulerShell(ctx, config)
        self.round(WorkerReady("w", "epoch-1", 64, 16, 256, pipeline_stages=stages))
        core = self.shell.core
        assert core is not None
        schedule, self.calls = core.schedule, 0

        def counted() -> StepPlan | None:
            self.calls += 1
            return schedule()
        core.schedule = counted  # type: ignore[method-assign]

    def round(self, *msgs: object) -> tuple[int, list[StepPlan]]:
        """One round's `schedule` calls and the plans it sends."""
        self.calls = 0
        entries = [Entry("s", b"0-1", {}, msg) for msg in msgs]
        outputs = self.shell._plan_round(entries) + self.shell._result_round()
        sent = [msg for _, msg in outputs]
        return self.calls, [msg for msg in sent if isinstance(msg, StepPlan)]

    def result(self, step: int, token: int = 9) -> StepResult:
        return StepResult(step, ["a#0"], [token], epoch="epoch-1")


def short_admission(rid: str, max_tokens: int) -> AdmitRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, eos_token_ids=(0,))
    return AdmitRequest(rid, "gw", [5, 6, 7], params)


def test_one_stage_without_speculation_plans_once_a_round():
    """Every step of `a` is planned ahead of its tokens, so a result wakes nothing: the
    round's one plan finds nothing more to do, and no second one asks again."""
    rounds = Rounds(EngineConfig(max_model_len=256, max_num_batched_tokens=256))
    calls, plans = rounds.round(short_admission("a", 2))
    assert (calls, [p.step for p in plans]) == (2, [1, 2])  # the depth is full
    for step in (1, 2):  # a's tokens are all in flight: nothing is left to plan
        assert rounds.round(rounds.result(step)) == (1, [])
    assert rounds.shell.core.requests == {}


def test_one_stage_plans_again_when_an_ended_request_frees_a_waiting_ones_seat():
    """b waits for a's seat (max_num_seqs=1); the round whose result ends a plans b's
    prefill, rather than leaving it to the next read's timeout."""
    rounds = Rounds(EngineConfig(max_model_len=256, max_num_batched_tokens=256,
                                 max_num_seqs=1))
    rounds.round(short_admission("a", 2), short_admission("b", 2))
    assert rounds.round(rounds.result(1)) == (1, [])
    calls, plans = rounds.round(rounds.result(2))
    assert calls == 3 and [r.req_id for r in plans[0].new] == ["b#0"]


@pytest.mark.parametrize("stages, speculative", [(2, None), (1, "ngram")])
def test_a_request_waiting_for_its_token_is_planned_in_the_round_that_brings_it(
        stages, speculative):
    """Under pipeline stages, or speculating, a's next step waits for its token: the
    round's first plan cannot take it, the second one after the result does."""
    spec = ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, '
            '"prompt_lookup_min": 1}') if speculative else None
    rounds = Rounds(EngineConfig(max_model_len=256, max_num_batched_tokens=256,
                                 speculative_config=spec), stages)
    calls, plans = rounds.round(short_admission("a", 50))
    assert [p.step for p in plans] == [1]  # then nothing until its token is back
    for step in (1, 2):
        calls, plans = rounds.round(rounds.result(step))
        assert [p.step for p in plans] == [step + 1] and plans[0].req_ids == ["a#0"]
