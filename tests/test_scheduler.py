"""Scheduler core against a simulated worker.

The simulated worker keeps a "KV cache" of token ids, written by slot mapping and read back
through block tables, and its "model" derives the next token from that context. So a wrong
block table, a bad prefix-cache hit or a block shared while still being written changes the
output, and every schedule (chunked, cached, preempted, planned ahead) must reproduce the
reference continuation computed from the plain token sequence.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from common.messages import (AdmitRequest, DetokItem, LoRARequest, MessageError,
                             PooledOutput, StepLogprobs, StepPlan, StepResult, TokenBatch,
                             decode, encode, with_fields)
from common.sampling_params import RequestOutputKind, SamplingParams
from common.speculative import SpeculativeConfig
from common.token_columns import batch_items
from services.scheduler import core
from services.scheduler.core import Scheduler, SchedulerConfig

EOS = 2
VOCAB = 60


def next_token(context: list[int]) -> int:
    value = 7
    for i, t in enumerate(context):
        value = (value * 31 + t * (i + 3)) % 1_000_003
    return 3 + value % (VOCAB - 3)  # never EOS, so lengths are controlled by the tests


def reference(prompt: list[int], max_tokens: int, model=next_token) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(model(tokens))
    return tokens[len(prompt):]


@dataclass
class SimRequest:
    tokens: list[int]
    blocks: list[int]


@dataclass
class SimWorker:
    num_blocks: int
    block_size: int
    cache: list[int | None] = field(default_factory=list)
    reqs: dict[str, SimRequest] = field(default_factory=dict)
    overrides: dict[str, int] = field(default_factory=dict)  # req_id -> forced next token
    embeds: set[str] = field(default_factory=set)  # embedding requests: pooled, not sampled
    model: Callable[[list[int]], int] = next_token

    def __post_init__(self) -> None:
        self.cache = [None] * (self.num_blocks * self.block_size)

    def slot(self, req: SimRequest, pos: int) -> int:
        return req.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        for req_id in plan.finished:
            self.reqs.pop(req_id, None)
        for new in plan.new:
            assert new.req_id not in self.reqs
            self.reqs[new.req_id] = SimRequest(list(new.token_ids), list(new.block_ids))
            if new.embed:
                self.embeds.add(new.req_id)
        for cached in plan.cached:
            self.reqs[cached.req_id].blocks += cached.new_block_ids
        num_drafts = plan.num_draft_tokens or [0] * len(plan.req_ids)
        ends = np.cumsum(num_drafts, dtype=int)
        drafts = [plan.draft_token_ids[end - d:end] for d, end in zip(num_drafts, ends)]
        steps = list(zip(plan.req_ids, plan.num_scheduled_tokens, plan.num_computed_tokens,
                         drafts))
        assert len(set(plan.req_ids)) == len(plan.req_ids)
        for req_id, n, start, draft in steps:  # every write of the step precedes every read
            req = self.reqs[req_id]
            tokens = req.tokens + draft
            assert not draft or start + n == len(tokens), "drafts follow the last token"
            assert start + n <= len(tokens), "scheduled a token the worker does not know"
            assert (start + n - 1) // self.block_size < len(req.blocks), "no block for a token"
            for pos in range(start, start + n):
                self.cache[self.slot(req, pos)] = tokens[pos]
        out_ids, out_tokens, counts, pooled = [], [], [], []
        for req_id, n, start, draft in steps:
            req = self.reqs[req_id]
            end = start + n - len(draft)
            if end < len(req.tokens):
                continue  # a prefill chunk that does not reach the end samples nothing
            context = [self.cache[self.slot(req, pos)] for pos in range(start + n)]
            if req_id in self.embeds:  # "pooled": the whole prompt as the cache holds it
                pooled.append(PooledOutput(req_id, embedding_of(context)))
                continue
            sampled = self.verify(req_id, context, end, draft)
            req.tokens += sampled
            out_ids.append(req_id)
            out_tokens += sampled
            counts.append(len(sampled))
        return StepResult(plan.step, out_ids, out_tokens, embeddings=pooled,
                          num_tokens=counts if plan.num_draft_tokens else [])

    def verify(self, req_id: str, context: list[int], end: int, draft: list[int]
               ) -> list[int]:
        """Greedy verification: drafts are kept while they equal the model's next token
        at their position (read through the cache), then the model's own token follows."""
        sampled: list[int] = []
        for i in range(len(draft) + 1):
            sampled.append(self.overrides.get(req_id, self.model(context[:end + i])))
            if i == len(draft) or sampled[-1] != draft[i]:
                break
        return sampled


def embedding_of(context: list[int]) -> bytes:
    return np.asarray(context, "<f4").tobytes()


@dataclass
class Run:
    outputs: dict[tuple[str, int], list[int]]
    finish: dict[tuple[str, int], str]
    plans: list[StepPlan]
    embeddings: dict[str, bytes] = field(default_factory=dict)
    # per plan, the plans still in flight (results not applied) when it was made
    in_flight: list[list[StepPlan]] = field(default_factory=list)


def drive(sched: Scheduler, worker: SimWorker, lag: int = 0, max_steps: int = 10_000,
          on_step=None) -> Run:
    """Run to completion with `lag` plans in flight beyond the one executing."""
    outputs: dict[tuple[str, int], list[int]] = {}
    finish: dict[tuple[str, int], str] = {}
    embeddings: dict[str, bytes] = {}
    inflight: deque[StepPlan] = deque()
    plans, in_flight = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished() and not inflight:
            break
        plan = sched.schedule()
        if plan is not None:
            plans.append(plan)
            in_flight.append(list(inflight))
            inflight.append(plan)
        if inflight and (len(inflight) > lag or plan is None):
            for item in sched.update(worker.execute(inflight.popleft())):
                key = (item.rid, item.index)
                assert key not in finish, "tokens after the finish"
                outputs.setdefault(key, []).extend(item.new_token_ids)
                assert item.seq == len(outputs[key]) - len(item.new_token_ids)
                if item.finish_reason:
                    finish[key] = item.finish_reason
                if item.embedding is not None:
                    embeddings[item.rid] = item.embedding
        elif plan is None:
            raise AssertionError("scheduler is stuck: work left but nothing scheduled")
        if on_step:
            on_step(sched)
    else:
        raise AssertionError("did not finish")
    return Run(outputs, finish, plans, embeddings, in_flight)


def make(num_blocks=64, block_size=4, budget=64, max_seqs=16, max_len=256, caching=True,
         chunked=True, policy="fcfs", partial=(1, 1, 0), speculative=None,
         model=next_token) -> tuple[Scheduler, SimWorker]:
    config = SchedulerConfig(max_seqs, budget, max_len, block_size, num_blocks, caching,
                             chunked, policy, *partial, speculative=speculative)
    return Scheduler(config), SimWorker(num_blocks, block_size, model=model)


def admit(sched: Scheduler, rid: str, prompt: list[int], priority: int = 0,
          arrival: float = 0.0, lora: LoRARequest | None = None, **params) -> None:
    params.setdefault("eos_token_ids", (EOS,))
    sched.add_request(AdmitRequest(rid, "gw", prompt, SamplingParams(**params), arrival,
                                   priority, lora=lora))


def adapter(lora_id: int) -> LoRARequest:
    return LoRARequest(f"adapter{lora_id}", lora_id, f"/adapters/{lora_id}")


def admit_embedding(sched: Scheduler, rid: str, prompt: list[int]) -> None:
    sched.add_request(AdmitRequest(rid, "gw", prompt, SamplingParams(max_tokens=1),
                                   embed=True))


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("lag", [0, 1])
def test_batch_matches_reference_and_wastes_no_step(lag):
    sched, worker = make()
    ps = prompts(6)
    for i, p in enumerate(ps):
        admit(sched, f"r{i}", p, max_tokens=5 + i)
    run = drive(sched, worker, lag=lag)
    for i, p in enumerate(ps):
        assert run.outputs[(f"r{i}", 0)] == reference(p, 5 + i)
        assert run.finish[(f"r{i}", 0)] == "length"
    # planning ahead never computes a token past max_tokens: the last one is never fed back
    for i, p in enumerate(ps):
        computed = sum(n for pl in run.plans for r, n in zip(pl.req_ids, pl.num_scheduled_tokens)
                       if r == f"r{i}#0")
        assert computed == len(p) + (5 + i) - 1
    assert sched.kv.usage == 0.0 and not sched.running


def test_pipeline_stages_get_steps_of_other_requests_than_the_steps_in_flight():
    """With two stages three plans are in flight (common/pipeline.py): a request that
    samples in one plan is in neither of the next two (the first stage would lack its
    token), and a step takes at most a third of the running requests, so that decodes
    rotate among three steps."""
    sched, worker = make()
    sched.config = dataclasses.replace(sched.config, pipeline_stages=2)
    ps = prompts(6)
    for i, p in enumerate(ps):
        admit(sched, f"r{i}", p, max_tokens=8)
    run = drive(sched, worker, lag=2)
    for i, p in enumerate(ps):
        assert run.outputs[(f"r{i}", 0)] == reference(p, 8)
    lengths = {f"r{i}#0": len(p) for i, p in enumerate(ps)}
    assert max(len(out) for out in run.in_flight) == 2
    for plan, out in zip(run.plans, run.in_flight):
        for before in out:
            sampled = {r for r, start, n in zip(before.req_ids, before.num_computed_tokens,
                                                before.num_scheduled_tokens)
                       if start + n >= lengths[r]}
            assert not sampled & set(plan.req_ids), (before, plan)
    decodes = [plan for plan in run.plans
               if all(start >= lengths[r] for r, start in zip(plan.req_ids,
                                                                plan.num_computed_tokens))]
    assert decodes and max(len(plan.req_ids) for plan in decodes) <= 2


def test_pipeline_stages_run_max_num_seqs_requests_each():
    """Two stages seat twice max_num_seqs, as vLLM V0's two virtual engines did."""
    sched, worker = make(max_seqs=2)
    sched.config = dataclasses.replace(sched.config, pipeline_stages=2)
    for i, p in enumerate(prompts(6)):
        admit(sched, f"r{i}", p, max_tokens=4)
    seated: list[int] = []
    drive(sched, worker, lag=2, on_step=lambda s: seated.append(len(s.running)))
    assert max(seated) == 4


def test_chunked_prefill_respects_the_budget_and_runs_decodes_first():
    sched, worker = make(budget=8, num_blocks=64)
    admit(sched, "short", [5, 6, 7], max_tokens=12)
    admit(sched, "long", list(range(3, 40)), max_tokens=3)
    run = drive(sched, worker, lag=1)
    assert run.outputs[("short", 0)] == reference([5, 6, 7], 12)
    assert run.outputs[("long", 0)] == reference(list(range(3, 40)), 3)
    assert all(sum(pl.num_scheduled_tokens) <= 8 for pl in run.plans)
    long_chunks = [n for pl in run.plans for r, n in zip(pl.req_ids, pl.num_scheduled_tokens)
                   if r == "long#0"]
    assert long_chunks[:5] == [5, 7, 7, 7, 7] and len(long_chunks) == 8  # 37 prompt + 3 out
    for pl in run.plans:  # a running decode always precedes prefill chunks in the batch
        if "short#0" in pl.req_ids and "long#0" in pl.req_ids:
            assert pl.req_ids.index("short#0") < pl.req_ids.index("long#0")


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched, worker = make(budget=40, chunked=False)
    admit(sched, "a", list(range(3, 33)), max_tokens=3)
    admit(sched, "b", list(range(5, 25)), max_tokens=3)
    run = drive(sched, worker)
    assert run.plans[0].req_ids == ["a#0"]  # b (20 tokens) does not fit next to a (30)
    assert run.outputs[("b", 0)] == reference(list(range(5, 25)), 3)


def chunks(run: Run, req_id: str) -> list[tuple[int, int]]:
    """(step, tokens) of each step that scheduled `req_id`."""
    return [(pl.step, n) for pl in run.plans
            for r, n in zip(pl.req_ids, pl.num_scheduled_tokens) if r == req_id]


def test_one_partial_prefill_at_a_time_by_default():
    sched, worker = make(budget=16, caching=False)
    long_a, long_b = list(range(3, 43)), list(range(50, 90))
    admit(sched, "a", long_a, max_tokens=2)
    admit(sched, "b", long_b, max_tokens=2)
    run = drive(sched, worker)
    a_prefill_done = chunks(run, "a#0")[2][0]  # 40 tokens in chunks of 16, 16, 8
    assert chunks(run, "b#0")[0][0] == a_prefill_done  # b starts in a's last chunk's step
    assert run.outputs[("b", 0)] == reference(long_b, 2)


def test_partial_prefills_share_the_budget_and_short_prompts_pass_long_ones():
    long_a, long_b, short = list(range(3, 43)), list(range(50, 90)), [7, 8, 9, 10, 11]
    sched, worker = make(budget=24, caching=False, partial=(2, 1, 10))
    for rid, prompt in (("a", long_a), ("b", long_b), ("c", short)):
        admit(sched, rid, prompt, max_tokens=2)
    run = drive(sched, worker)
    first = run.plans[0]
    # a's chunk is capped at the threshold; b, long too, waits (one long prefill at a time);
    # c, short, starts beside a
    assert first.req_ids == ["a#0", "c#0"] and first.num_scheduled_tokens == [10, 5]
    assert all(n <= 10 for _, n in chunks(run, "a#0") + chunks(run, "b#0"))
    b_start, a_last = chunks(run, "b#0")[0][0], chunks(run, "a#0")[3][0]
    assert b_start == a_last  # b starts once a's prefill ends
    for rid, prompt in (("a", long_a), ("b", long_b), ("c", short)):
        assert run.outputs[(rid, 0)] == reference(prompt, 2)
    sched, worker = make(budget=24, caching=False, partial=(2, 2, 10))
    admit(sched, "a", long_a, max_tokens=2)
    admit(sched, "b", long_b, max_tokens=2)
    assert drive(sched, worker).plans[0].num_scheduled_tokens == [10, 10]


def test_prefix_cache_hit_skips_computed_tokens():
    sched, worker = make(block_size=4)
    shared = list(range(3, 23))  # 20 tokens = 5 blocks
    admit(sched, "a", shared + [30], max_tokens=2)
    drive(sched, worker)
    admit(sched, "b", shared + [40, 41], max_tokens=4)
    run = drive(sched, worker)
    first = run.plans[0]
    assert first.new[0].req_id == "b#0" and first.num_computed_tokens == [20]
    assert first.num_scheduled_tokens == [2]
    assert run.outputs[("b", 0)] == reference(shared + [40, 41], 4)
    stats = sched.stats()
    assert stats.prefix_cache_hits == 20 and stats.prefix_cache_queries == 21 + 22


def test_same_step_siblings_share_prompt_blocks():
    sched, worker = make(block_size=4)
    prompt = list(range(3, 20))  # 17 tokens: 4 full blocks
    admit(sched, "n", prompt, n=3, max_tokens=4, temperature=0.0)
    run = drive(sched, worker)
    first = run.plans[0]
    blocks = [new.block_ids[:4] for new in first.new]
    assert blocks[0] == blocks[1] == blocks[2]  # one copy of the prompt's KV
    assert first.num_computed_tokens == [0, 16, 16]
    for i in range(3):
        assert run.outputs[("n", i)] == reference(prompt, 4)


def test_n_siblings_get_distinct_seeds():
    sched, _ = make()
    admit(sched, "s", [5, 6, 7], n=3, seed=10)
    assert [sched.requests[f"s#{i}"].params.seed for i in range(3)] == [10, 11, 12]


@pytest.mark.parametrize("lag", [0, 1])
def test_preemption_by_recompute_keeps_outputs_exact(lag, caplog):
    sched, worker = make(num_blocks=12, block_size=4, budget=32, max_seqs=8)
    ps = prompts(6, seed=3, lo=6, hi=14)
    for i, p in enumerate(ps):
        admit(sched, f"r{i}", p, max_tokens=12)
    run = drive(sched, worker, lag=lag)
    assert sched.num_preemptions > 0
    assert "is preempted" in caplog.text and "total_num_cumulative_preemption" in caplog.text
    for i, p in enumerate(ps):
        assert run.outputs[(f"r{i}", 0)] == reference(p, 12)
    assert sched.kv.usage == 0.0


@pytest.mark.parametrize("final_only", [True, False])
def test_columns_give_each_item_the_logprobs_records_give_it(final_only):
    """update_columns (the served scheduler's) leaves a step's sampled logprobs as columns,
    row i items[i]'s, which travel in the TokenBatch: joined back, every item is the one
    update (records) makes. Under preemption, one request aborted midway (its rows are
    left out), rows without logprobs (width 0), a request ended by a stop token and one
    with stop strings (a longer context); with and without a FINAL_ONLY completion (its
    item carries its own records). A step whose rows are all one streamed token takes the
    fast path, one with the FINAL_ONLY request's row the general one."""
    ps = prompts(6, seed=5, lo=6, hi=14)
    seen: dict[str, list[DetokItem]] = {}
    fast_steps = 0
    for way in ("records", "columns"):
        sched, worker = make(num_blocks=12, block_size=4, budget=32, max_seqs=8)
        for i, p in enumerate(ps):
            admit(sched, f"lp{i}" if i % 2 else f"r{i}", p, max_tokens=12,
                  logprobs=1 if i % 2 else None)
        admit(sched, "lp-stop", ps[1], max_tokens=12, logprobs=1,
              stop_token_ids=[reference(ps[1], 12)[6]])
        admit(sched, "stop-strings", ps[2], max_tokens=12, stop=["never", "nor this"])
        if final_only:
            admit(sched, "lp-final", ps[0], max_tokens=12, logprobs=1,
                  output_kind=RequestOutputKind.FINAL_ONLY)
        items = seen[way] = []
        execute, steps = worker.execute, iter(range(10_000))
        update, update_columns = sched.update, sched.update_columns

        def with_logprobs(plan: StepPlan, execute=execute) -> StepResult:
            result = execute(plan)
            widths = [2 if rid.startswith("lp") else 0 for rid in result.req_ids]
            ids = [x for rid, t in zip(result.req_ids, result.token_ids)
                   if rid.startswith("lp") for x in (t, t + 1)]
            return decode(encode(with_fields(result, logprobs=StepLogprobs(  # as sent
                widths, ids, [-x / 100 for x in ids], [x % 5 + 1 for x in ids[::2]]))))

        def applied(result: StepResult, sched=sched, way=way, items=items, steps=steps,
                    update=update, update_columns=update_columns) -> list[DetokItem]:
            if next(steps) == 6:
                sched.abort("lp3")
            if way == "records":
                out = update(result)
            else:
                written, columns = update_columns(result)
                batch = decode(encode(written.batch(result.step, logprobs=columns)))
                out = batch_items(batch, batch.logprobs.rows() if batch.logprobs else None)
            items.extend(out)
            return out

        def counted(*args: object, apply=sched._apply_one_token_rows) -> None:
            nonlocal fast_steps
            fast_steps += 1
            apply(*args)

        sched.update, worker.execute = applied, with_logprobs
        sched._apply_one_token_rows = counted
        drive(sched, worker, lag=1)
        assert sched.num_preemptions > 0
    assert seen["columns"] == seen["records"]
    assert fast_steps > 0
    with_lps = [item for item in seen["records"] if item.logprobs]
    assert {item.rid for item in with_lps} == {"lp1", "lp3", "lp5", "lp-stop"} | (
        {"lp-final"} if final_only else set())
    assert [len(item.logprobs) for item in with_lps if item.rid == "lp-final"] == (
        [12] if final_only else [])
    [last] = [item for item in seen["columns"] if item.rid == "lp-stop"][-1:]
    assert (last.finish_reason, last.seq) == ("stop", 6)
    longest = max(len(item.context_ids) for item in seen["columns"]
                  if item.rid == "stop-strings")
    assert longest > max(len(item.context_ids) for item in seen["columns"]
                         if item.rid == "r0")


@pytest.mark.parametrize("way", ["update", "update_columns"])
def test_logprobs_for_other_rows_than_the_steps_are_refused(way):
    sched, worker = make()
    admit(sched, "lp", [1, 2, 3], max_tokens=4, logprobs=1)
    result = worker.execute(sched.schedule())
    bad = with_fields(result, logprobs=StepLogprobs([1, 1], [5, 6], [-0.5, -0.5], [1, 1]))
    with pytest.raises(MessageError, match="logprobs for 2 rows of its 1"):
        getattr(sched, way)(bad)


@pytest.mark.parametrize("way", ["update", "update_columns"])
def test_the_steps_device_time_adds_up_in_the_stats(way):
    sched, worker = make()
    admit(sched, "a", [1, 2, 3], max_tokens=3)
    for device_ms in (1.5, 0.0, 2.25):  # 0: a step whose time an earlier result carried
        result = worker.execute(sched.schedule())
        getattr(sched, way)(with_fields(result, device_ms=device_ms))
    assert sched.stats().device_busy_seconds == pytest.approx(0.00375)
    assert not sched.has_unfinished()


@pytest.mark.parametrize("lag", [0, 1])
def test_a_final_only_completion_is_one_item_at_its_end(lag):
    """FINAL_ONLY (the offline LLM's): no item until the completion ends, then one with all
    of its tokens from seq 0, the prompt's tail as context and every token's logprobs,
    through preemption. With stop strings it goes a step at a time: its text may end it."""
    sched, worker = make(num_blocks=12, block_size=4, budget=32, max_seqs=8)
    final = RequestOutputKind.FINAL_ONLY
    ps = prompts(6, seed=3, lo=6, hi=14)
    for i, p in enumerate(ps):
        admit(sched, f"r{i}", p, max_tokens=12, output_kind=final)
    admit(sched, "stops", ps[0], max_tokens=12, output_kind=final, stop=["x"])
    admit(sched, "steps", ps[1], max_tokens=12)
    items: list[DetokItem] = []
    update, execute = sched.update, worker.execute

    def with_logprobs(plan: StepPlan) -> StepResult:  # a made-up logprob per token
        result = execute(plan)
        tokens = result.token_ids
        return with_fields(result, logprobs=StepLogprobs(
            [1] * len(tokens), tokens, [-t / 100 for t in tokens], [1] * len(tokens)))

    def recorded(result: StepResult) -> list[DetokItem]:
        items.extend(out := update(result))
        return out

    sched.update, worker.execute = recorded, with_logprobs
    run = drive(sched, worker, lag=lag)
    assert sched.num_preemptions > 0
    for i, p in enumerate(ps):
        [item] = [it for it in items if it.rid == f"r{i}"]
        assert item.new_token_ids == reference(p, 12) == run.outputs[(f"r{i}", 0)]
        assert (item.seq, item.finish_reason) == (0, "length")
        assert item.num_context_prompt == len(item.context_ids) > 0
        assert item.context_ids == p[-len(item.context_ids):]
        assert [lp.logprobs for lp in item.logprobs] == [[-t / 100] for t in reference(p, 12)]
    for rid in ("stops", "steps"):
        assert [len(it.new_token_ids) for it in items if it.rid == rid] == [1] * 12


def test_priority_policy_orders_and_preempts_by_priority(caplog):
    sched, worker = make(num_blocks=8, block_size=4, budget=64, policy="priority")
    admit(sched, "low", list(range(3, 13)), priority=5, arrival=1.0, max_tokens=10)
    admit(sched, "high", list(range(13, 23)), priority=0, arrival=2.0, max_tokens=10)
    run = drive(sched, worker)
    assert run.plans[0].req_ids[0] == "high#0"
    # 8 blocks cannot hold both sequences to the end: the low-priority one is preempted
    assert sched.num_preemptions > 0
    assert "low#0 is preempted" in caplog.text and "high#0 is preempted" not in caplog.text
    assert run.outputs[("low", 0)] == reference(list(range(3, 13)), 10)


def test_abort_frees_blocks_and_drops_late_results():
    sched, worker = make()
    admit(sched, "a", [5, 6, 7, 8, 9], max_tokens=50)
    admit(sched, "b", [9, 8, 7], max_tokens=5)
    plan1 = sched.schedule()
    plan2 = sched.schedule()  # planned ahead, a is in it
    sched.update(worker.execute(plan1))
    sched.abort("a")
    items = sched.update(worker.execute(plan2))
    assert [i.rid for i in items] == ["b"]  # a's late token is dropped
    plan3 = sched.schedule()
    assert plan3.finished == ["a#0"] and "a#0" not in plan3.req_ids
    assert sched.kv.block_ids("a#0") == []


@pytest.mark.parametrize("lag", [0, 1])
def test_eos_stop_tokens_and_min_tokens(lag):
    sched, worker = make()
    worker.overrides = {"eos#0": EOS, "stopid#0": 17, "minimum#0": EOS, "ignore#0": EOS}
    admit(sched, "eos", [5, 6], max_tokens=10)
    admit(sched, "stopid", [5, 6], max_tokens=10, stop_token_ids=[17])
    admit(sched, "minimum", [5, 6], max_tokens=10, min_tokens=3)
    admit(sched, "ignore", [5, 6], max_tokens=4, ignore_eos=True)
    run = drive(sched, worker, lag=lag)
    assert run.outputs[("eos", 0)] == [EOS] and run.finish[("eos", 0)] == "stop"
    assert run.outputs[("stopid", 0)] == [17] and run.finish[("stopid", 0)] == "stop"
    assert run.outputs[("minimum", 0)] == [EOS] * 3
    assert run.outputs[("ignore", 0)] == [EOS] * 4 and run.finish[("ignore", 0)] == "length"


def test_max_model_len_ends_a_request():
    sched, worker = make(max_len=20)
    admit(sched, "a", list(range(3, 18)), max_tokens=100)
    run = drive(sched, worker, lag=1)
    assert len(run.outputs[("a", 0)]) == 5 and run.finish[("a", 0)] == "length"


def test_max_num_seqs_caps_the_batch():
    sched, worker = make(max_seqs=3, budget=64)
    for i, p in enumerate(prompts(7, seed=5)):
        admit(sched, f"r{i}", p, max_tokens=4)
    run = drive(sched, worker, lag=1,
                on_step=lambda s: pytest.fail("over max_num_seqs") if len(s.running) > 3 else None)
    assert all(len(pl.req_ids) <= 3 for pl in run.plans)
    assert len(run.outputs) == 7


def test_invalid_admissions_are_rejected():
    sched, _ = make(max_len=10)
    with pytest.raises(ValueError, match="max_model_len"):
        admit(sched, "long", list(range(3, 13)))
    with pytest.raises(ValueError, match="max_model_len"):
        admit(sched, "empty", [])


def test_an_admission_delivered_again_is_dropped_running_or_finished(monkeypatch):
    """At-least-once delivery (a tokenizer killed between its per-slot commits on a Redis
    Cluster) repeats an admission; the request runs once."""
    sched, worker = make()
    first = AdmitRequest("dup", "gw", [5, 6, 7], SamplingParams(max_tokens=3, n=2))
    assert sched.add_request(first) == ["dup#0", "dup#1"]
    assert sched.add_request(first) == []  # while it runs
    run = drive(sched, worker)
    assert sorted(run.finish) == [("dup", 0), ("dup", 1)]
    assert sched.add_request(first) == [] and not sched.has_unfinished()  # after it ended
    monkeypatch.setattr(core, "REMEMBERED_RIDS", 2)
    for rid in ("a", "b", "c"):
        sched.add_request(AdmitRequest(rid, "gw", [5], SamplingParams(max_tokens=1)))
    assert list(sched.admitted) == ["b", "c"]  # the memory is bounded, oldest out first
    assert sched.add_request(first) == ["dup#0", "dup#1"]


# --- embedding requests ------------------------------------------------------------------

def scheduled(run: Run, req_id: str) -> list[tuple[int, int]]:
    """(first position, count) of each chunk `req_id` was planned."""
    return [(start, n) for plan in run.plans for r, n, start in
            zip(plan.req_ids, plan.num_scheduled_tokens, plan.num_computed_tokens)
            if r == req_id]


@pytest.mark.parametrize("lag", [0, 1])
def test_embeddings_compute_every_prompt_token_and_end_after_their_last_chunk(lag):
    sched, worker = make(block_size=4, budget=8)
    shared = list(range(3, 23))  # 5 full blocks, cached by the first request
    admit(sched, "gen", shared + [30], max_tokens=3)
    drive(sched, worker, lag=lag)
    admit_embedding(sched, "emb", shared + [40])
    ps = prompts(3, seed=8)
    for i, p in enumerate(ps):  # generation beside it is unchanged
        admit(sched, f"r{i}", p, max_tokens=4)
    run = drive(sched, worker, lag=lag)
    # no prefix-cache hit: every token computed, in chunks of the budget, nothing sampled
    assert scheduled(run, "emb#0") == [(0, 8), (8, 8), (16, 5)]
    assert run.embeddings == {"emb": embedding_of(shared + [40])}
    assert run.outputs[("emb", 0)] == [] and run.finish[("emb", 0)] == "stop"
    for i, p in enumerate(ps):
        assert run.outputs[(f"r{i}", 0)] == reference(p, 4)
    assert sched.kv.usage == 0.0 and not sched.running and not sched.has_unfinished()
    assert sched.stats().generation_tokens == 3 + 3 * 4


def test_an_embedding_may_fill_the_context():
    sched, worker = make(max_len=20, budget=8)
    admit_embedding(sched, "full", list(range(3, 23)))
    run = drive(sched, worker, lag=1)
    assert run.embeddings == {"full": embedding_of(list(range(3, 23)))}
    with pytest.raises(ValueError, match="max_model_len"):
        admit_embedding(sched, "over", list(range(3, 24)))


@pytest.mark.parametrize("lag", [0, 1])
def test_a_preempted_embedding_is_recomputed_whole(lag, caplog):
    sched, worker = make(num_blocks=10, block_size=4, budget=8)
    admit(sched, "r0", list(range(3, 9)), max_tokens=20)
    admit(sched, "r1", list(range(9, 15)), max_tokens=20)
    admit_embedding(sched, "e", list(range(20, 40)))  # the last admitted: the victim
    run = drive(sched, worker, lag=lag)
    starts = [start for start, _ in scheduled(run, "e#0")]
    assert starts.count(0) > 1 and "e#0 is preempted" in caplog.text
    assert run.embeddings == {"e": embedding_of(list(range(20, 40)))}
    for rid, prompt in (("r0", list(range(3, 9))), ("r1", list(range(9, 15)))):
        assert run.outputs[(rid, 0)] == reference(prompt, 20)
    assert sched.kv.usage == 0.0


def test_max_loras_bounds_the_adapters_of_a_step_and_the_base_model_never_waits():
    sched, worker = make(budget=256)
    sched.config = dataclasses.replace(sched.config, max_loras=2)
    ps = prompts(8, seed=3)
    lora_of = {}
    for i, p in enumerate(ps):
        lora_id = i % 4 or None  # 1, 2, 3 and the base model, twice each
        admit(sched, f"r{i}", p, max_tokens=6, lora=adapter(lora_id) if lora_id else None)
        lora_of[f"r{i}#0"] = lora_id
    run = drive(sched, worker, lag=1)
    for plan in run.plans:
        assert len({lora_of[r] for r in plan.req_ids} - {None}) <= 2
    assert {"r0#0", "r4#0"} <= set(run.plans[0].req_ids)  # base requests start at once
    assert {lora_of[r] for r in run.plans[0].req_ids} == {None, 1, 2}
    for i, p in enumerate(ps):
        assert run.outputs[(f"r{i}", 0)] == reference(p, 6)
    new = {n.req_id: n.lora for plan in run.plans for n in plan.new}
    assert new["r3#0"] == adapter(3) and new["r4#0"] is None


def test_prefix_cache_keys_on_the_adapter():
    sched, worker = make(block_size=4)
    shared = list(range(3, 23))  # 20 tokens = 5 blocks
    admit(sched, "a", shared + [30], max_tokens=2, lora=adapter(1))
    drive(sched, worker)
    hits = {}
    for rid, lora in [("other", adapter(2)), ("base", None), ("same", adapter(1))]:
        admit(sched, rid, shared + [40], max_tokens=2, lora=lora)
        hits[rid] = drive(sched, worker).plans[0].num_computed_tokens
    assert hits == {"other": [0], "base": [0], "same": [20]}


# --- speculative decoding (ngram) --------------------------------------------------------

SPEC = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


def repetitive(context: list[int]) -> int:
    """Mostly repeats the context from 5 tokens back (ngram drafts get accepted), but
    every 7th position departs from it (some drafts get rejected)."""
    if len(context) % 7 == 0 or len(context) < 5:
        return next_token(context)
    return context[-5]


def drafts_of(run: Run) -> tuple[int, int]:
    """(steps of a request with drafts, draft tokens) over a run's plans."""
    counts = [d for plan in run.plans for d in plan.num_draft_tokens if d]
    return len(counts), sum(counts)


@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("budget", [64, 10])
def test_speculation_reproduces_the_reference(lag, budget):
    sched, worker = make(budget=budget, speculative=SPEC, model=repetitive)
    batch = prompts(6, seed=3)
    for i, prompt in enumerate(batch):
        admit(sched, f"r{i}", prompt, max_tokens=40)
    run = drive(sched, worker, lag=lag)
    for i, prompt in enumerate(batch):
        assert run.outputs[(f"r{i}", 0)] == reference(prompt, 40, repetitive)
    assert all(sum(plan.num_scheduled_tokens) <= budget for plan in run.plans)
    num_drafts, num_draft_tokens = drafts_of(run)
    assert num_drafts > 0 and sched.spec.num_drafts == num_drafts
    assert sched.spec.num_draft_tokens == num_draft_tokens
    assert 0 < sched.spec.num_accepted_tokens < num_draft_tokens
    stats = sched.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (num_drafts, num_draft_tokens,
                                                       sched.spec.num_accepted_tokens)
    per_pos = stats.spec_decode_num_accepted_tokens_per_pos
    assert sum(per_pos) == stats.spec_decode_num_accepted_tokens and per_pos[0] >= per_pos[-1]
    assert sched.kv.pool.num_free == sched.kv.pool.num_blocks


@pytest.mark.parametrize("lag", [0, 1])
def test_speculation_with_preemption_keeps_outputs_exact(lag, caplog):
    sched, worker = make(num_blocks=14, block_size=4, budget=32, speculative=SPEC,
                         model=repetitive)
    batch = prompts(5, seed=4, lo=5, hi=12)
    for i, prompt in enumerate(batch):
        admit(sched, f"r{i}", prompt, max_tokens=24)
    run = drive(sched, worker, lag=lag)
    assert sched.num_preemptions > 0
    assert drafts_of(run)[0] > 0
    for i, prompt in enumerate(batch):
        assert run.outputs[(f"r{i}", 0)] == reference(prompt, 24, repetitive)


@pytest.mark.parametrize("lag", [0, 1])
def test_stops_among_accepted_drafts_end_the_request_there(lag):
    prompt = [10, 11, 12, 13, 14, 10, 11, 12, 13]
    full = reference(prompt, 30, repetitive)
    stop = full[12]
    first_stop = full.index(stop)
    sched, worker = make(speculative=SPEC, model=repetitive)
    admit(sched, "stop", prompt, max_tokens=30, stop_token_ids=(stop,))
    for max_tokens in (1, 2, 9, 10, 11):
        admit(sched, f"len{max_tokens}", prompt, max_tokens=max_tokens)
    run = drive(sched, worker, lag=lag)
    assert run.outputs[("stop", 0)] == full[:first_stop + 1]
    assert run.finish[("stop", 0)] == "stop"
    for max_tokens in (1, 2, 9, 10, 11):
        assert run.outputs[(f"len{max_tokens}", 0)] == full[:max_tokens]
        assert run.finish[(f"len{max_tokens}", 0)] == "length"
    assert sched.spec.num_accepted_tokens > 0


def test_speculation_stops_at_max_model_len():
    prompt = [10, 11, 12, 13, 14, 10, 11, 12]
    sched, worker = make(max_len=20, speculative=SPEC, model=repetitive)
    admit(sched, "r", prompt, max_tokens=100)
    run = drive(sched, worker)
    assert run.outputs[("r", 0)] == reference(prompt, 12, repetitive)
    assert run.finish[("r", 0)] == "length"


def test_requests_with_per_token_state_are_not_speculated():
    sched, worker = make(speculative=SPEC, model=repetitive)
    prompt = [10, 11, 12, 13, 14, 10, 11, 12]
    admit(sched, "pen", prompt, max_tokens=12, presence_penalty=0.5)
    admit(sched, "lp", prompt, max_tokens=12, logprobs=1)
    admit(sched, "min", prompt, max_tokens=12, min_tokens=4)
    run = drive(sched, worker, lag=1)
    drafted = {rid for plan in run.plans
               for rid, d in zip(plan.req_ids, plan.num_draft_tokens or []) if d}
    assert drafted == {"min#0"}  # only once its min_tokens are out
    for rid in ("pen", "lp", "min"):
        assert run.outputs[(rid, 0)] == reference(prompt, 12, repetitive)
