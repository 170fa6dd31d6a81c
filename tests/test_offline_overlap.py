"""The offline engine overlaps its host work with the device's step, and its answers are the
in-line engine's to the token (issue 31 item 1).

Three overlaps, each observed through the engine's cores rather than through timing: step
N+1 is launched before step N's tokens are applied and detokenized (the scheduler's
plan-ahead); the executor runs on a step thread, so the loop plans the next step while the
last is inside the executor (counted with a slow executor); and the detokenizer process
turns tokens into text while the loop goes on (stopped with SIGSTOP, it holds no step
back). Stop strings, max_tokens, aborts and preemption stay exact with a step in flight: a
stop string's item is detokenized in the loop, and the loop applies results with a fixed
lag, so the scheduler plans exactly what the in-line engine plans. Nothing the engine
starts outlives it.
"""

from __future__ import annotations

import functools
import gc
import os
import random
import signal
import sys
import threading
import time

import pytest

from common.config import EngineConfig
from common.messages import StepPlan, TextDelta
from common.sampling_params import RequestOutputKind, SamplingParams
from services.offline import llm as llm_module
from services.offline import engine as engine_module
from services.offline.engine import WORKER_PROCESS_ENV, Engine
from services.offline.llm import LLM
from services.offline.steps import LAUNCH_LAG, start_steps
from tests.tiny_models import make_tiny_model

VOCAB = 512  # the tiny model's


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("overlap"), "llama"))


def make_engine(tiny: str, detokenizer_process: bool = True, step_thread: bool = True,
                **config) -> Engine:
    return Engine(EngineConfig(model=tiny, dtype="float32", device="cpu", **config),
                  detokenizer_process=detokenizer_process, step_thread=step_thread)


def inline_llm(monkeypatch, tiny: str, **config) -> LLM:
    """An LLM whose engine detokenizes and calls the executor in its loop: what every step
    returned before the detokenizer process and the step thread."""
    with monkeypatch.context() as patch:
        patch.setattr(llm_module, "Engine", functools.partial(
            Engine, detokenizer_process=False, step_thread=False))
        return LLM(tiny, dtype="float32", device="cpu", **config)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[TextDelta]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    deltas: list[TextDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    return deltas


def by_completion(deltas: list[TextDelta]) -> dict[tuple[str, int], list[tuple]]:
    """Each completion's deltas in order, without the (wall-clock) request stamps."""
    out: dict[tuple[str, int], list[tuple]] = {}
    for d in deltas:
        out.setdefault((d.rid, d.index), []).append(
            (d.seq, d.text, list(d.token_ids), d.finish_reason, d.stop_reason, d.logprobs))
    return out


def outputs(results) -> list[tuple]:
    return [(r.request_id, r.prompt_token_ids,
             [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
               c.finish_reason, c.stop_reason) for c in r.outputs]) for r in results]


def logprob_values_apart(outs: list[tuple]) -> tuple[list[tuple], list[float]]:
    """`outputs` with each logprob's value (and the cumulative logprob) taken out, and those
    values in order: another process's CPU matmuls may add up in another order (its own
    threads, fewer on a loaded machine), so its logprobs agree to float32's rounding, not to
    the bit, while its tokens and texts are the same."""
    rest, values = [], []
    for rid, prompt, completions in outs:
        kept = []
        for index, text, ids, logprobs, cumulative, finish, stop in completions:
            entries = [{token: (lp.rank, lp.decoded_token) for token, lp in step.items()}
                       for step in logprobs or []]
            values += [lp.logprob for step in logprobs or [] for lp in step.values()]
            values += [] if cumulative is None else [cumulative]
            kept.append((index, text, ids, entries, finish, stop))
        rest.append((rid, prompt, kept))
    return rest, values


def test_each_step_is_launched_before_the_previous_ones_tokens_are_applied(tiny):
    engine = make_engine(tiny)
    events: list[tuple[str, int]] = []
    launch, update = engine.steps.launch, engine.scheduler.update
    process = engine.detokenizer_process
    submit = process.submit

    def queue_plan(plan: StepPlan):
        events.append(("launch", plan.step))
        return launch(plan)

    def apply(result):
        events.append(("apply", result.step))
        return update(result)

    def detokenize(items):
        events.append(("detokenize", len(items)))
        return submit(items)

    engine.steps.launch, engine.scheduler.update, process.submit = queue_plan, apply, detokenize
    run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=8)) for p in prompts(4)])
    engine.close()
    launched = [step for kind, step in events if kind == "launch"]
    applied = [step for kind, step in events if kind == "apply"]
    assert applied == launched  # every step's tokens, in order
    lag = engine.lag
    assert lag == LAUNCH_LAG
    for step in launched[:-lag]:  # the last ones have no successors to overlap
        apply_at = events.index(("apply", step))
        assert events.index(("launch", step + lag)) < apply_at
        # the text's work waits for the step after to be launched: the next plan needs
        # only the tokens
        after = events[apply_at + 1:]
        assert after[0] == ("launch", step + lag + 1) or after[0][0] == "apply"
        assert next(kind for kind, _ in after if kind != "apply") in ("launch", "detokenize")
    assert sum(n for kind, n in events if kind == "detokenize") == 4 * 8


class SlowExecutor:
    """The engine's executor, each submit taking `seconds` more with the GIL released (as
    a GPU step's preparation and launch partly do): records which thread ran each step and
    when, and which step was being submitted when each plan was made."""

    def __init__(self, executor, seconds: float) -> None:
        self.executor, self.seconds = executor, seconds
        self.submitting: int | None = None  # the step inside submit now
        self.threads: set[int] = set()

    def submit(self, plan: StepPlan):
        self.threads.add(threading.get_ident())
        self.submitting = plan.step
        try:
            time.sleep(self.seconds)
            return self.executor.submit(plan)
        finally:
            self.submitting = None

    def __getattr__(self, name: str):
        return getattr(self.executor, name)


def scheduled_during_steps(tiny: str, step_thread: bool) -> tuple[int, int, set[int]]:
    """(plans made while the step before them was inside the executor, plans, threads that
    submitted) for one batch through an engine whose executor is slow, and whose applying
    of a step's tokens takes a while too (with the GIL released, as a busy host gives it
    up at its switch interval)."""
    engine = make_engine(tiny, step_thread=step_thread)
    engine.steps.close()
    slow = SlowExecutor(engine.executor, seconds=0.03)
    engine.steps = start_steps(slow, threaded=step_thread)
    schedule, update = engine.scheduler.schedule, engine.scheduler.update
    overlapped, plans = 0, 0

    def plan_and_count():
        nonlocal overlapped, plans
        submitting = slow.submitting
        plan = schedule()
        if plan is not None:
            plans += 1
            overlapped += submitting is not None  # an earlier step in the executor
        return plan

    def slow_update(result):
        time.sleep(0.02)
        return update(result)

    engine.scheduler.schedule, engine.scheduler.update = plan_and_count, slow_update
    run(engine, [(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in prompts(4)])
    engine.close()
    return overlapped, plans, slow.threads


def test_the_next_step_is_scheduled_while_the_step_thread_runs_the_last(tiny):
    """Step k+1 is planned (and step k-1's tokens applied) on the loop's thread while step
    k is inside the executor on the step thread; the in-line loop never does that. (On
    the CPU a step's result goes out only with the next launch or once the thread finds
    nothing queued, so about every other plan overlaps here.)"""
    overlapped, plans, threads = scheduled_during_steps(tiny, step_thread=True)
    assert threads and threading.get_ident() not in threads
    assert plans >= 12 and overlapped >= plans // 4, (overlapped, plans)
    overlapped, plans, threads = scheduled_during_steps(tiny, step_thread=False)
    assert threads == {threading.get_ident()} and overlapped == 0


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in ("steps", "device-wait")]


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


@pytest.mark.parametrize("ending", ["close", "with", "collection"])
def test_nothing_outlives_the_llm(tiny, ending):
    """The step thread, its device waiter and the detokenizer process end with the LLM,
    however it ends, and the GIL switch interval is the script's again."""
    switch = sys.getswitchinterval()
    assert engine_threads() == []
    params = SamplingParams(temperature=0.0, max_tokens=4)
    if ending == "with":
        with LLM(tiny, dtype="float32", device="cpu") as llm:
            llm.generate(prompts(2), params, use_tqdm=False)
            assert len(engine_threads()) == 2
            process = llm.engine.detokenizer_process.process
    else:
        llm = LLM(tiny, dtype="float32", device="cpu")
        llm.generate(prompts(2), params, use_tqdm=False)
        process = llm.engine.detokenizer_process.process
        if ending == "close":
            llm.close()
        else:
            del llm
            gc.collect()
    assert wait_until(lambda: engine_threads() == []), engine_threads()
    assert process.wait(10) == 0
    assert sys.getswitchinterval() == switch


def test_an_engine_dropped_without_close_lets_its_step_thread_go(tiny):
    engine = make_engine(tiny, detokenizer_process=False)
    run(engine, [(prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=3))])
    assert len(engine_threads()) == 2
    del engine
    gc.collect()
    assert wait_until(lambda: engine_threads() == []), engine_threads()


def test_an_executor_error_reaches_the_caller(tiny):
    engine = make_engine(tiny)

    def fail(plan):
        raise ValueError("device lost")

    engine.executor.submit = fail
    engine.add_request("x", prompts(1)[0], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="device lost"):
        while engine.has_unfinished():
            engine.step()
    with pytest.raises(ValueError, match="device lost"):  # and again, never a hang
        engine.step()
    engine.close()
    assert wait_until(lambda: engine_threads() == [])


def test_the_loop_runs_ahead_of_the_detokenizer_process(tiny):
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=6, logprobs=1))
                for p in prompts(4, seed=1)]
    inline = make_engine(tiny, detokenizer_process=False, step_thread=False)
    expected = by_completion(run(inline, requests))
    inline.close()
    engine = make_engine(tiny)
    background = engine.detokenizer_process
    assert background is not None
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    deltas: list[TextDelta] = []
    os.kill(background.process.pid, signal.SIGSTOP)
    try:
        steps = 0
        while engine.scheduler.has_unfinished():
            deltas += engine.step()
            steps += 1
        # every token was sampled and applied with no text back: nothing waited for it
        assert deltas == [] and steps >= 6
        # one batch a step, but the steps out when nothing is left to plan go together: the
        # loop drains them
        assert background.pending >= 6 - engine.lag and engine.has_unfinished()
    finally:
        os.kill(background.process.pid, signal.SIGCONT)
    while engine.has_unfinished():
        deltas += engine.step()
    assert background.pending == 0
    assert by_completion(deltas) == expected
    engine.close()


def mixed_params(stops: list[str]) -> list[SamplingParams]:
    """Greedy with stop strings (from `stops`, strings the greedy answers contain), seeded
    with n=2 and logprobs, unseeded, and max_tokens, twice over."""
    return [SamplingParams(temperature=0.0, max_tokens=20, stop=[stops[0]]),
            SamplingParams(temperature=0.0, max_tokens=7),
            SamplingParams(temperature=0.9, seed=3, max_tokens=16, n=2, logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=20, stop=[stops[3]],
                           include_stop_str_in_output=True),
            SamplingParams(temperature=0.8, max_tokens=12),
            SamplingParams(temperature=0.0, max_tokens=20, logprobs=0, stop=[stops[5]]),
            ] * 2


@pytest.mark.parametrize("worker_process", ["0", "1"])
def test_outputs_equal_the_inline_engines_with_preemption(tiny, monkeypatch, worker_process):
    """Greedy, seeded and unseeded sampling, n=2, logprobs, stop strings and max_tokens,
    on a KV cache so small that requests are preempted and recomputed; with the executor
    on the step thread here, and in the worker process (services/offline/
    worker_process.py)."""
    config = {"num_gpu_blocks_override": 16, "block_size": 4}  # 64 token slots
    reference = inline_llm(monkeypatch, tiny, **config)
    batch = prompts(12, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    texts = [o.outputs[0].text for o in reference.generate(batch, greedy, use_tqdm=False)]
    stops = [text[6:8] for text in texts]  # strings the greedy answers do contain
    params = mixed_params(stops)
    expected = outputs(reference.generate(batch, params, use_tqdm=False))
    assert reference.engine.scheduler.num_preemptions > 0
    reference.close()
    monkeypatch.setenv(WORKER_PROCESS_ENV, worker_process)
    llm = LLM(tiny, dtype="float32", device="cpu", **config)
    assert (llm.engine.executor is None) == (worker_process == "1")
    llm.generate(batch, greedy, use_tqdm=False)  # the same ids as the reference's calls
    got = outputs(llm.generate(batch, params, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    llm.close()
    if worker_process == "0":
        assert got == expected
    else:  # logprob_values_apart says why not to the bit
        (got_rest, got_values), (rest, values) = map(logprob_values_apart, (got, expected))
        assert got_rest == rest
        assert got_values == pytest.approx(values, rel=1e-5, abs=1e-5)
    assert any(isinstance(c[6], str) for _, _, cs in got for c in cs)  # stop strings hit


def test_logprobs_and_their_texts_equal_the_inline_engines(tiny):
    """Logprobs stay in the parent while the child detokenizes (services/offline/
    detokenizer.py): the deltas, logprobs, prompt logprobs and their texts included, are
    those of the engine that detokenizes in its loop."""
    requests = [(prompt, SamplingParams(temperature=0.0, max_tokens=9, logprobs=3,
                                        prompt_logprobs=2 if i % 2 else None))
                for i, prompt in enumerate(prompts(6, seed=5))]
    requests.append((prompts(1, seed=6)[0], SamplingParams(temperature=0.0, max_tokens=5)))
    results = []
    for process in (True, False):
        engine = make_engine(tiny, detokenizer_process=process)
        deltas = run(engine, requests)
        engine.close()
        results.append((by_completion(deltas),
                        [(d.rid, d.prompt_logprobs) for d in deltas if d.prompt_logprobs]))
    assert results[0] == results[1]
    first = next(d for d in results[0][0][("0", 0)])
    assert first[5] and all(lp.texts for lp in first[5])  # texts are there to compare
    assert len(results[0][1]) == 3


@pytest.mark.parametrize("detokenizer_process", [True, False])
def test_a_final_only_completion_is_the_sum_of_its_steps(tiny, detokenizer_process):
    """LLM.generate's FINAL_ONLY: one delta a completion, at its end, holding what its
    steps' deltas add up to: text, token ids, logprobs with their texts, finish. Some
    completions end on a stop token, whose text is left out."""
    stop_ids = tuple(range(5, VOCAB, 29))

    def completions(kind: RequestOutputKind) -> dict[tuple[str, int], list[tuple]]:
        engine = make_engine(tiny, detokenizer_process)
        requests = [(p, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2,
                                       stop_token_ids=stop_ids, output_kind=kind,
                                       skip_special_tokens=i % 2 == 0))
                    for i, p in enumerate(prompts(8, seed=5))]
        try:
            return by_completion(run(engine, requests))
        finally:
            engine.close()

    steps, final = (completions(kind) for kind in (RequestOutputKind.CUMULATIVE,
                                                   RequestOutputKind.FINAL_ONLY))
    assert all(len(deltas) == 1 for deltas in final.values())
    assert {key: deltas[0][1:] for key, deltas in final.items()} == {
        key: ("".join(d[1] for d in deltas), [t for d in deltas for t in d[2]],
              deltas[-1][3], deltas[-1][4], [lp for d in deltas for lp in d[5]])
        for key, deltas in steps.items()}
    finishes = [deltas[0][3] for deltas in final.values()]
    assert "stop" in finishes and "length" in finishes
    assert all(deltas[0][1] for deltas in final.values())  # text to compare


def test_a_stop_string_ends_the_plans_as_in_the_loop(tiny):
    """A stop string's abort reaches the scheduler before it plans again: the request is in
    exactly one plan after the step whose token completed the string (the step in flight),
    and a max_tokens request in exactly max_tokens plans."""
    engine = make_engine(tiny)
    plans: list[StepPlan] = []
    engine.on_plan = plans.append
    batch = prompts(3, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    texts = {}
    for d in run(engine, [(p, greedy) for p in batch]):
        texts[d.rid] = texts.get(d.rid, "") + d.text
    stop = texts["0"][8:10]
    plans.clear()
    requests = [(batch[0], SamplingParams(temperature=0.0, max_tokens=20, stop=[stop])),
                (batch[1], SamplingParams(temperature=0.0, max_tokens=9)),
                (batch[2], greedy)]
    rids = ["a", "b", "c"]
    for rid, (prompt, params) in zip(rids, requests):
        engine.add_request(rid, prompt, params)
    deltas: list[TextDelta] = []
    while engine.has_unfinished():
        deltas += engine.step()
    engine.close()
    tokens = {rid: sum(len(d.token_ids) for d in deltas if d.rid == rid) for rid in rids}
    finish = {d.rid: (d.finish_reason, d.stop_reason) for d in deltas if d.finish_reason}
    in_plans = {rid: sum(f"{rid}#0" in p.req_ids for p in plans) for rid in rids}
    assert finish["a"] == ("stop", stop) and "".join(
        d.text for d in deltas if d.rid == "a") == texts["0"][:texts["0"].index(stop)]
    assert tokens["a"] < 20
    # the step that completed the stop string, and those out when its text came
    assert in_plans["a"] == tokens["a"] + engine.lag
    assert finish["b"] == ("length", None) and tokens["b"] == 9 and in_plans["b"] == 9


def test_an_abort_with_steps_in_flight_drops_their_tokens(tiny):
    engine = make_engine(tiny)
    plans: list[StepPlan] = []
    engine.on_plan = plans.append
    for rid, prompt in zip("ab", prompts(2, seed=5)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=30))
    deltas: list[TextDelta] = []
    for _ in range(5):
        deltas += engine.step()
    applied = len(engine.scheduler.by_rid["a"][0].output_token_ids)
    in_flight = sum("a#0" in p.req_ids for p in plans)
    # the steps the last plan was made ahead of are out, and that plan's
    assert in_flight == applied + engine.lag + 1
    engine.abort("a")
    plans_at_abort = len(plans)
    while engine.has_unfinished():
        deltas += engine.step()
    engine.close()
    assert not any("a#0" in p.req_ids for p in plans[plans_at_abort:])
    # the tokens applied before the abort come back as text; the in-flight steps' do not
    assert sum(len(d.token_ids) for d in deltas if d.rid == "a") == applied
    assert sum(len(d.token_ids) for d in deltas if d.rid == "b") == 30


def test_a_dead_detokenizer_process_is_an_error_and_close_ends_it(tiny):
    engine = make_engine(tiny)
    background = engine.detokenizer_process
    assert background is not None
    engine.add_request("x", prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=40))
    background.process.kill()
    background.process.wait()
    with pytest.raises(RuntimeError, match="detokenizer process exited"):
        while engine.has_unfinished():
            engine.step()
    engine.close()

    engine = make_engine(tiny)
    assert engine.detokenizer_process is not None
    process = engine.detokenizer_process.process
    run(engine, [(prompts(1)[0], SamplingParams(max_tokens=3))])
    engine.close()
    assert process.poll() == 0
    engine.close()  # a second close does nothing


def test_a_batch_runs_with_fewer_collections_and_leaves_them_as_they_were():
    gc.unfreeze()
    before = gc.get_threshold()
    with pytest.raises(KeyError):
        with engine_module.fewer_collections():
            assert gc.get_threshold() == (engine_module.BATCH_GC_THRESHOLD, *before[1:])
            assert gc.get_freeze_count() > 0  # the heap alive at the start
            raise KeyError("a failing batch restores them too")
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
    gc.freeze()  # a caller's own frozen heap is left frozen
    frozen = gc.get_freeze_count()
    try:
        with engine_module.fewer_collections():
            pass
        # neither thawed nor frozen again (which would take in the context manager's own
        # generator); frozen objects that another thread frees meanwhile leave the count
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()


def test_llm_generate_runs_its_batch_with_fewer_collections(tiny, monkeypatch):
    seen = []
    llm = LLM(tiny, dtype="float32", device="cpu")
    step = llm.engine.step

    def observed():
        seen.append(gc.get_threshold()[0])
        return step()

    monkeypatch.setattr(llm.engine, "step", observed)
    llm.generate([prompts(1)[0]], SamplingParams(temperature=0.0, max_tokens=4),
                 use_tqdm=False)
    llm.close()
    assert seen and set(seen) == {engine_module.BATCH_GC_THRESHOLD}
    assert gc.get_threshold()[0] != engine_module.BATCH_GC_THRESHOLD
