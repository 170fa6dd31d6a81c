"""The scheduler core: every request's state, and what each engine step computes.

There is no prefill phase and no decode phase: each step shares one token budget, running
requests first, and every request's `num_computed_tokens` catches up with its
`num_tokens`. The scheduler plans ahead of the worker (see request.py), so `schedule` may be
called again before the previous step's `update`; results for requests that finished or
were aborted meanwhile are dropped. An embedding request is a prompt that is computed and
never sampled: it ends, freeing its blocks, when its embedding comes back.

Speculative decoding: a decoding request whose tokens are all known gets drafts, from its
own earlier tokens (ngram, common/speculative.py) or the draft model's proposal that came
back with its last token (draft_model, services/worker/draft.py), and is scheduled
1 + len(drafts) tokens in one step. With a draft model every allocation also holds k
lookahead slots past the step's tokens, where the draft writes its proposals' KV. How
many drafts the worker accepts is only known when the result comes back, so a request
that may speculate is never planned while one of its steps is in flight: it loses the
plan-ahead, the other requests of the batch keep it. On the result its accepted
tokens are appended one by one (a stop condition among them ends it there) and
`num_computed_tokens` moves back over the rejected drafts, whose KV slots the next steps
simply overwrite. Requests that need per-token state on the worker (grammars, penalties,
min_tokens, logprobs, logit_bias, allowed ids, bad words) decode one token at a time, as without it.

Pipeline stages (pipeline_stages > 1): a request's next input is the token its step in
flight samples, which only the last stage holds, so no request is planned while one of its
sampling steps is in flight; up to `max_num_seqs` requests run per stage, and a step
takes at most its share of them (common/pipeline.py), so that the steps in flight hold
different requests and every stage has a step to compute
(services/worker/layers/pipeline.py).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from dataclasses import dataclass, field

from common.config import EngineConfig
from common.detok_window import context_before, make_context
from common.hops import NUM_REQUEST_STAMPS
from common.messages import (AdmitRequest, CachedRequest, DetokItem, MessageError,
                             NewRequest, PooledOutput, SchedulerStats, StepLogprobs,
                             StepPlan, StepResult, TokenLogprobs)
from common.pipeline import max_running, micro_batches
from common.speculative import SpeculativeConfig, may_speculate, split_drafts
from common.token_columns import ItemFields, TokenColumns
from services.scheduler.kv_cache_manager import KVCacheManager
from services.scheduler.request import Request, Status

log = logging.getLogger("headrace.scheduler")
REMEMBERED_RIDS = 65_536  # far more than are admitted while a redelivery can be on its way


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0  # 0: no prompt is long, no chunk is capped
    max_loras: int = 1  # distinct LoRA adapters in one step
    speculative: SpeculativeConfig | None = None
    pipeline_stages: int = 1

    @classmethod
    def from_engine(cls, config: EngineConfig, num_blocks: int) -> SchedulerConfig:
        assert config.max_model_len and config.max_num_batched_tokens, "resolve the config"
        return cls(max_num_seqs=config.max_num_seqs,
                   max_num_batched_tokens=config.max_num_batched_tokens,
                   max_model_len=config.max_model_len, block_size=config.block_size,
                   num_blocks=num_blocks, enable_prefix_caching=config.enable_prefix_caching,
                   enable_chunked_prefill=config.enable_chunked_prefill,
                   policy=config.scheduling_policy,
                   max_num_partial_prefills=config.max_num_partial_prefills,
                   max_long_partial_prefills=config.max_long_partial_prefills,
                   long_prefill_token_threshold=config.long_prefill_token_threshold,
                   max_loras=config.max_loras,
                   speculative=config.speculative(),
                   pipeline_stages=config.pipeline_parallel_size)


@dataclass(slots=True)
class SpecDecodingStats:
    """vLLM v1's speculative decoding counters, over the scheduler's life."""
    num_drafts: int = 0  # steps of a request that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # drafts accepted at 0, 1, ...

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1


class WaitingQueue:
    """Requests ordered by (priority, admission order) for `priority`, by admission order
    for `fcfs`; a preempted request keeps its place, so it goes back ahead of later ones."""

    def __init__(self, policy: str) -> None:
        self._heap: list[tuple[tuple, Request]] = []
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._by_priority = policy == "priority"

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, req: Request) -> None:
        order = self._order.setdefault(req.req_id, next(self._counter))
        key = (req.priority, order) if self._by_priority else (order,)
        heapq.heappush(self._heap, (key, req))

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, req: Request) -> None:
        self._heap = [(k, r) for k, r in self._heap if r is not req]
        heapq.heapify(self._heap)

    def forget(self, req: Request) -> None:
        self._order.pop(req.req_id, None)

    def tokens_to_compute(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for _, r in self._heap)


class PartialPrefills:
    """The prompts whose prefill this step leaves unfinished. A waiting request may start
    one only while fewer than --max-num-partial-prefills are, and fewer than
    --max-long-partial-prefills of the long ones (prompts over
    --long-prefill-token-threshold) if it is long, as in vLLM: short prompts pass long
    ones."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.count = self.long = 0

    @classmethod
    def after(cls, batch: list[tuple[Request, int, list]], config: SchedulerConfig
              ) -> PartialPrefills:
        partial = cls(config)
        for req, n, _ in batch:
            partial.add(req, req.num_computed_tokens + n < req.num_tokens)
        return partial

    def is_long(self, req: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < req.num_prompt_tokens

    def admits(self, req: Request) -> bool:
        config = self.config
        return self.count < config.max_num_partial_prefills and (
            not self.is_long(req) or self.long < config.max_long_partial_prefills)

    def add(self, req: Request, unfinished: bool) -> None:
        if unfinished:
            self.count += 1
            self.long += self.is_long(req)


class StepAdapters:
    """The LoRA adapters of the step being planned: a request under another adapter waits
    once --max-loras are in it; the base model's never do."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.ids: set[int] = set()

    def admits(self, req: Request) -> bool:
        if req.lora is None:  # most requests: spare the property, asked twice a row a step
            return True
        return req.lora_id in self.ids or len(self.ids) < self.max_loras

    def add(self, req: Request) -> None:
        if req.lora is not None:
            self.ids.add(req.lora_id)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.by_rid: dict[str, list[Request]] = {}
        self.admitted: dict[str, None] = {}  # the latest request ids, oldest first
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.step = 0
        self._dropped: list[str] = []  # worker state to drop with the next plan
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.device_seconds = 0.0  # the steps' device time (services/worker/device_time.py)
        self.spec = SpecDecodingStats()
        # no draft model's slots to reserve past any request's tokens (_lookahead)
        self._no_lookahead = config.speculative is None or not config.speculative.uses_draft_model

    # --- requests ---------------------------------------------------------------------

    def add_request(self, admit: AdmitRequest) -> list[str]:
        """Admit a tokenized request; n > 1 becomes n completions. Returns their ids, none
        for a request id seen before: the gateways make each id unique, so that is the
        same admission delivered again (on a Redis Cluster, see common/redis_cluster.py)."""
        if admit.rid in self.admitted:
            return []
        num_prompt = len(admit.prompt_token_ids)
        for image in admit.images:
            if image.bidirectional and image.length > self.config.max_num_batched_tokens:
                raise ValueError(f"an image of {image.length} tokens, which this model "
                                 "computes in one step, does not fit "
                                 f"max_num_batched_tokens {self.config.max_num_batched_tokens}")
        # a completion needs a position to sample into; an embedding may fill the context
        limit = self.config.max_model_len + (1 if admit.embed else 0)
        if not 0 < num_prompt < limit:
            raise ValueError(f"prompt of {num_prompt} tokens does not fit max_model_len "
                             f"{self.config.max_model_len}")
        self.admitted[admit.rid] = None
        if len(self.admitted) > REMEMBERED_RIDS:
            del self.admitted[next(iter(self.admitted))]
        children = [self._child(admit, i) for i in range(admit.params.n)]
        for req in children:
            self.requests[req.req_id] = req
            self.waiting.push(req)
        self.by_rid[admit.rid] = children
        return [req.req_id for req in children]

    def abort(self, rid: str, index: int | None = None, reason: str = "abort",
              stop_reason: str | None = None) -> None:
        """End a request's completions (index None: all of them), e.g. the client left or
        the detokenizer matched a stop string."""
        for req in list(self.by_rid.get(rid, ())):
            if index is None or req.index == index:
                req.finish_reason, req.stop_reason = reason, stop_reason
                self._finish(req)

    def image_keys(self) -> list[str]:
        """The Redis keys of the pixels of every image a request held here has."""
        return sorted({image.key for req in self.requests.values() for image in req.images
                       if image.key})

    def fail(self, req_ids: list[str]) -> list[tuple[str, str]]:
        """End the client requests of these completions (the worker could not run them):
        (gateway, rid) of each still unanswered, once."""
        ended = []
        for req_id in req_ids:
            req = self.requests.get(req_id)
            if req is None or req.rid not in self.by_rid:
                continue  # ended meanwhile, or with a sibling of this call
            ended.append((req.reply_to, req.rid))
            self.abort(req.rid, reason="error")
        return ended

    def rids_by_gateway(self) -> dict[str, list[str]]:
        """The running requests' ids, by the gateway that waits for their replies."""
        by_gateway: dict[str, list[str]] = {}
        for rid, reqs in self.by_rid.items():
            by_gateway.setdefault(reqs[0].reply_to, []).append(rid)
        return by_gateway

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step -----------------------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        budget = self.config.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        adapters = StepAdapters(self.config.max_loras)
        batch, budget = self._schedule_running(budget, adapters)
        if self.num_preemptions == preemptions_before:  # no room to spare for new ones
            batch += self._schedule_waiting(budget, batch, adapters)
        if not batch:
            return None
        return self._make_plan(batch)

    def update(self, result: StepResult) -> list[DetokItem]:
        """Apply a step's sampled tokens; returns what the detokenizers should see, each
        item with its token's logprobs as a record."""
        self.device_seconds += result.device_ms / 1000
        return [DetokItem(*fields) for fields, _ in self._apply(result, records=True)]

    def update_columns(self, result: StepResult
                       ) -> tuple[TokenColumns, StepLogprobs | None]:
        """As `update`, but the items are a TokenBatch's columns and the step's sampled
        logprobs stay columns: row i of the second is the first's row i. A FINAL_ONLY
        completion still holds records until its end, and its row carries them."""
        self.device_seconds += result.device_ms / 1000
        columns = TokenColumns()
        rows: list[int] = []  # each row's row of the step's logprobs; -1: none, or its own
        if self._streams_one_token_a_row(result):
            self._apply_one_token_rows(result, columns, rows)
        else:
            for fields, row in self._apply(result, records=False):
                columns.append(*fields)
                rows.append(row)
        logprobs = result.logprobs
        return columns, None if logprobs is None else logprobs.select(rows)

    def _streams_one_token_a_row(self, result: StepResult) -> bool:
        """Whether every row of the result is one sampled token of a request that streams
        and has no drafts out: a served decode step's usual result, which
        _apply_one_token_rows writes straight into the columns."""
        if (result.num_tokens or result.num_draft_tokens or result.prompt_logprobs
                or result.embeddings):
            return False
        requests = self.requests
        for req_id in result.req_ids:
            req = requests.get(req_id)
            if req is not None and (req.final_only or req.num_drafts_in_flight):
                return False
        return True

    def _apply_one_token_rows(self, result: StepResult, columns: TokenColumns,
                              rows: list[int]) -> None:
        """_apply for such a result, without a record or a tuple a row: at 256 rows a step
        the served scheduler spent more time applying tokens than planning (issue 31).
        An item that carries more than its token (a request's first, or its last) takes
        _item_fields as _apply's do."""
        self._check_logprob_rows(result)
        requests, token_ids = self.requests, result.token_ids
        for row, req_id in enumerate(result.req_ids):
            req = requests.get(req_id)
            if req is None:
                continue  # finished or aborted after this step was planned
            req.num_pending -= 1
            token = token_ids[row]
            outputs = req.output_token_ids
            outputs.append(token)
            self._check_finish(req, token)
            seq = len(outputs) - 1
            if seq and req.finish_reason is None:
                prompt = req.prompt_token_ids
                num_prompt = len(prompt)
                context, num_context_prompt = context_before(prompt, outputs, num_prompt + seq,
                                                             req.context_span)
                columns.append_token(req.rid, req.index, req.reply_to, seq, token, context,
                                     num_context_prompt, req.detok_params, num_prompt)
            else:
                columns.append(*self._item_fields(req, [token], []))
                if req.finish_reason is not None:
                    self._finish(req)
            rows.append(row)
        self.generation_tokens += len(rows)

    def _apply(self, result: StepResult, records: bool) -> list[tuple[ItemFields, int]]:
        """Each item's fields (DetokItem's, in order) with its row of the step's logprobs
        columns (-1: none, or its own records)."""
        for chunk in result.prompt_logprobs:
            req = self.requests.get(chunk.req_id)
            if req is None:
                continue
            if chunk.start == len(req.prompt_logprobs):  # not a recompute after preemption
                req.prompt_logprobs.extend(chunk.rows())
        columns = self._check_logprob_rows(result)
        sampled = columns.rows() if columns is not None and records else None
        items: list[tuple[ItemFields, int]] = []
        counts = result.num_tokens or [1] * len(result.req_ids)
        ends = itertools.accumulate(counts)
        proposals = split_drafts(result.num_draft_tokens, result.draft_token_ids,
                                 len(result.req_ids))
        for row, (req_id, end, count, proposal) in enumerate(zip(result.req_ids, ends, counts,
                                                                 proposals)):
            req = self.requests.get(req_id)
            if req is None:
                continue  # finished or aborted after this step was planned
            req.num_pending -= 1
            kept = self._append_tokens(req, result.token_ids[end - count:end])
            if result.num_draft_tokens:  # without proposals, an older one no longer follows
                req.proposal, req.proposal_after = proposal, req.num_known_tokens
            if sampled is None and columns is not None and req.final_only:
                sampled = columns.rows()  # held until its end as records
            lps = [sampled[row]] if sampled is not None and sampled[row] is not None else []
            if not req.final_only:
                items.append((self._item_fields(req, kept, lps if records else []), row))
            else:
                req.held_logprobs += lps
                if req.finish_reason is not None:  # its whole output in one item
                    items.append((self._item_fields(req, req.output_token_ids,
                                                    req.held_logprobs), -1))
            if req.finish_reason is not None:
                self._finish(req)
        for pooled in result.embeddings:
            if (req := self.requests.get(pooled.req_id)) is not None:
                items.append((self._embedding_fields(req, pooled), -1))
        return items

    def _check_logprob_rows(self, result: StepResult) -> StepLogprobs | None:
        """The result's logprobs columns, refused unless they have a row a request."""
        columns = result.logprobs
        if columns is not None and len(columns.widths) != len(result.req_ids):
            raise MessageError(f"step {result.step} has logprobs for {len(columns.widths)} "
                               f"rows of its {len(result.req_ids)}")
        return columns

    def _append_tokens(self, req: Request, tokens: list[int]) -> list[int]:
        """Append a step's tokens up to the first that ends the request; a speculating
        request's computed tokens move back over its rejected drafts."""
        outputs = req.output_token_ids
        num_before = len(outputs)
        if req.num_drafts_in_flight:
            self.spec.add(req.num_drafts_in_flight, len(tokens) - 1)
            # its last token is sampled, not computed; a preemption may have reset it to 0
            req.num_computed_tokens = min(req.num_computed_tokens,
                                          req.num_known_tokens + len(tokens) - 1)
            req.num_drafts_in_flight = 0
        for token in tokens:
            outputs.append(token)
            self.generation_tokens += 1
            self._check_finish(req, token)
            if req.finish_reason is not None:
                break
        return outputs[num_before:]

    # --- scheduling -----------------------------------------------------------------------

    def _schedule_running(self, budget: int, adapters: StepAdapters
                          ) -> tuple[list[tuple[Request, int, list]], int]:
        batch: list[tuple[Request, int, list]] = []
        share = -(-len(self.running) // micro_batches(self.config.pipeline_stages))
        i = 0
        while i < len(self.running) and budget > 0 and len(batch) < share:
            req = self.running[i]
            n = self._num_to_schedule(req, budget)
            if n == 0 or not adapters.admits(req):
                i += 1
                continue
            new_blocks = self._allocate_or_preempt(req, n, i)
            if new_blocks is None:
                break  # req itself and every request after it were preempted
            batch.append((req, n, new_blocks))
            adapters.add(req)
            budget -= n
            i += 1
        return batch, budget

    def _schedule_waiting(self, budget: int, running: list[tuple[Request, int, list]],
                          adapters: StepAdapters) -> list[tuple[Request, int, list]]:
        """Start waiting requests after the step's `running` ones."""
        seats = max_running(self.config.max_num_seqs, self.config.pipeline_stages)
        if not self.waiting or len(self.running) >= seats:
            return []  # none can start: spare counting the running batch's prefills
        partial = PartialPrefills.after(running, self.config)
        batch: list[tuple[Request, int, list]] = []
        deferred: list[Request] = []
        while len(self.waiting) and budget > 0 and len(self.running) < seats:
            req = self.waiting.pop()
            if req.num_pending or not adapters.admits(req):
                # preempted with a sampled token still on its way, or its adapter must wait
                deferred.append(req)
                continue
            computed = self.kv.computed_blocks(req)
            num_cached = len(computed) * self.config.block_size
            remaining = req.num_tokens - num_cached
            n = whole_images(req, num_cached, min(remaining, budget,
                                                  self._chunk_cap(remaining)), budget)
            if n == 0:
                deferred.append(req)  # its next image does not fit what is left
                continue
            if n < remaining and not partial.admits(req):
                deferred.append(req)  # a shorter prompt behind it may still start
                continue
            new_blocks = None
            if n == remaining or self.config.enable_chunked_prefill:
                new_blocks = self.kv.allocate(req, n, computed,
                                              self._lookahead(num_cached + n))
            if new_blocks is None:
                deferred.append(req)
                break
            if req.status is Status.WAITING:
                req.num_cached_tokens = num_cached
                self.prompt_tokens += req.num_prompt_tokens
            req.num_computed_tokens = num_cached
            req.status = Status.RUNNING
            self.running.append(req)
            batch.append((req, n, computed + new_blocks))
            partial.add(req, n < remaining)
            adapters.add(req)
            budget -= n
        for req in deferred:
            self.waiting.push(req)
        return batch

    def _num_to_schedule(self, req: Request, budget: int) -> int:
        num_tokens = req.num_tokens
        remaining = num_tokens - req.num_computed_tokens
        if remaining <= 0 or not self._may_sample(req, num_tokens):
            return 0
        if req.num_pending and self.config.pipeline_stages > 1:
            return 0  # the first stage embeds the token in flight only once it is back
        if self._speculates(req):
            if req.num_pending:  # its drafts must follow the token still in flight
                return 0
            if remaining == 1:
                req.draft_token_ids = self._propose(req, budget - 1)
                return 1 + len(req.draft_token_ids)
        if remaining == 1 and not req.images:
            return 1  # the decode step: one token passes any cap of a positive budget
        n = min(remaining, budget, self._chunk_cap(remaining))
        if n < remaining and not self.config.enable_chunked_prefill:
            return 0
        return whole_images(req, req.num_computed_tokens, n, budget)

    def _speculates(self, req: Request) -> bool:
        """Whether the request may get drafts: it needs no per-token state on the worker."""
        return (self.config.speculative is not None and not req.embed
                and may_speculate(req.params, len(req.output_token_ids)))

    def _lookahead(self, num_slots: int) -> int:
        """The slots a draft model's proposals need past a request's first `num_slots`
        (never past max_model_len, where the worker writes none)."""
        spec = self.config.speculative
        if spec is None or not spec.uses_draft_model:
            return 0
        return max(0, min(spec.num_speculative_tokens, self.config.max_model_len - num_slots))

    def _propose(self, req: Request, room: int) -> list[int]:
        """Drafts after the request's known tokens, no more than the budget's `room` or
        than the tokens its max_tokens and max_model_len still allow after the next."""
        spec = self.config.speculative
        assert spec is not None
        k = min(spec.num_speculative_tokens, room,
                self.config.max_model_len - req.num_known_tokens - 1)
        max_tokens = req.params.max_tokens
        if max_tokens is not None:
            k = min(k, max_tokens - len(req.output_token_ids) - 1)
        if k <= 0:
            return []
        if spec.uses_draft_model:  # a proposal for older tokens does not follow these
            return req.proposal[:k] if req.proposal_after == req.num_known_tokens else []
        index = req.ngram_index
        index.extend(req.token_slice(len(index.tokens), req.num_known_tokens))
        return index.propose(k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _chunk_cap(self, remaining: int) -> int:
        """--long-prefill-token-threshold also bounds each step's chunk of a long prompt,
        as in vLLM v1, so that several prefills share a step's budget."""
        threshold = self.config.long_prefill_token_threshold
        return threshold if 0 < threshold < remaining else remaining

    def _may_sample(self, req: Request, num_tokens: int) -> bool:
        """False once the tokens already sampled (known or in flight; `num_tokens` with the
        prompt's) reach a length limit: scheduling another step would only compute a token
        that is thrown away."""
        if req.embed:  # it only computes its prompt
            return True
        max_tokens = req.params.max_tokens
        if max_tokens is not None and num_tokens - len(req.prompt_token_ids) >= max_tokens:
            return False
        return num_tokens < self.config.max_model_len

    def _allocate_or_preempt(self, req: Request, n: int, position: int) -> list | None:
        num_slots = req.num_computed_tokens + n
        if self._no_lookahead and self.kv.holds(req, num_slots):
            return []
        lookahead = self._lookahead(num_slots)
        while (new_blocks := self.kv.allocate(req, n, None, lookahead)) is None:
            victim = self._pick_victim(self.running[position:])
            self._preempt(victim)
            if victim is req:
                return None
        return new_blocks

    def _pick_victim(self, candidates: list[Request]) -> Request:
        if self.config.policy == "priority":
            return max(candidates, key=Request.sort_key)
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []  # proposed this round for a step it will not run
        req.status = Status.PREEMPTED
        if req.on_worker:
            req.on_worker = False
            self._dropped.append(req.req_id)
        self.waiting.push(req)
        self.num_preemptions += 1
        log.warning(
            "Request %s is preempted (recompute mode) because there is not enough KV cache "
            "space. This can affect the end-to-end performance. Increase "
            "gpu_memory_utilization or tensor_parallel_size to provide more KV cache "
            "memory. total_num_cumulative_preemption=%d", req.req_id, self.num_preemptions)

    def _make_plan(self, batch: list[tuple[Request, int, list]]) -> StepPlan:
        now = time.time()
        new, cached = [], []
        req_ids, num_scheduled, num_computed = [], [], []
        num_drafts: list[int] = []
        drafts: list[int] = []
        for req, n, new_blocks in batch:
            if not req.on_worker:
                new.append(NewRequest(req_id=req.req_id, token_ids=req.known_token_ids(),
                                      num_prompt_tokens=req.num_prompt_tokens,
                                      block_ids=self.kv.block_ids(req.req_id),
                                      params=req.params, embed=req.embed, lora=req.lora,
                                      images=req.images))
                req.on_worker = True
                if len(req.stamps) == NUM_REQUEST_STAMPS - 1:  # its first plan
                    req.stamps.append(now)
            elif new_blocks:
                cached.append(CachedRequest(req_id=req.req_id,
                                            new_block_ids=[b.block_id for b in new_blocks]))
            req_ids.append(req.req_id)
            num_scheduled.append(n)
            num_computed.append(req.num_computed_tokens)
            req.num_computed_tokens += n
            num_draft = req.num_drafts_in_flight = len(req.draft_token_ids)
            num_drafts.append(num_draft)
            if num_draft:
                drafts += req.draft_token_ids
                req.draft_token_ids = []
            if req.num_computed_tokens - num_draft == req.num_tokens and not req.embed:
                req.num_pending += 1  # this step samples the request's next token
        self.step += 1
        plan = StepPlan(step=self.step, req_ids=req_ids, num_scheduled_tokens=num_scheduled,
                        num_computed_tokens=num_computed, new=new, cached=cached,
                        finished=self._dropped, planned_at=now,
                        num_draft_tokens=num_drafts if drafts else [],
                        draft_token_ids=drafts)
        self._dropped = []
        return plan

    # --- finishing --------------------------------------------------------------------

    def _check_finish(self, req: Request, token: int) -> None:
        params = req.params
        num_output = len(req.output_token_ids)
        reached_min = num_output >= params.min_tokens
        # A grammar admits EOS only where it is complete, and then nothing else is left for
        # it to admit: its end ends the request (services/worker/grammar.py).
        eos_ends = params.structured_outputs is not None or (reached_min
                                                             and not params.ignore_eos)
        if eos_ends and token in params.eos_token_ids:
            req.finish_reason, req.stop_reason = "stop", None
        elif reached_min and token in params.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
        if req.finish_reason is None:
            max_tokens = params.max_tokens
            if ((max_tokens is not None and num_output >= max_tokens)
                    or len(req.prompt_token_ids) + num_output >= self.config.max_model_len):
                req.finish_reason = "length"

    def _finish(self, req: Request) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        self.kv.free(req)
        self.waiting.forget(req)
        if req.on_worker:
            self._dropped.append(req.req_id)
        del self.requests[req.req_id]
        siblings = self.by_rid[req.rid]
        siblings.remove(req)
        if not siblings:
            del self.by_rid[req.rid]

    def _child(self, admit: AdmitRequest, index: int) -> Request:
        params = admit.params
        if params.n > 1:  # siblings must not sample identically from one seed
            params = params.replace(n=1, seed=None if params.seed is None else params.seed + index)
        return Request(req_id=f"{admit.rid}#{index}", rid=admit.rid, index=index,
                       reply_to=admit.reply_to, prompt_token_ids=list(admit.prompt_token_ids),
                       params=params, arrival_time=admit.arrival_time or time.time(),
                       priority=admit.priority, stamps=list(admit.stamps), embed=admit.embed,
                       lora=admit.lora, images=list(admit.images),
                       # the first prompt token has no logprob; the worker scores the rest
                       prompt_logprobs=[] if params.prompt_logprobs is None else [None])

    def _item_fields(self, req: Request, new: list[int], logprobs: list[TokenLogprobs]
                     ) -> ItemFields:
        """The DetokItem of `new`, as its fields in order: a tuple, since the served
        scheduler writes them into a TokenBatch's columns and a record a row was most of
        what building the batch cost."""
        seq = len(req.output_token_ids) - len(new)
        first = seq == 0  # the first item also carries what the request brought in
        context, num_context_prompt = make_context(
            req.prompt_token_ids, req.output_token_ids, len(new), req.stop_lookback)
        return (req.rid, req.index, req.reply_to, seq, new, context, num_context_prompt,
                req.detok_params, len(req.prompt_token_ids), req.finish_reason,
                req.stop_reason, logprobs, req.prompt_logprobs if first else [],
                req.stamps if first else [], req.num_cached_tokens if first else 0, None)

    def _embedding_fields(self, req: Request, pooled: PooledOutput) -> ItemFields:
        """The embedding request's answer; it ends here. Its embedding counts even when it
        was preempted after its last chunk was planned: that step computed it whole."""
        req.finish_reason = "stop"  # as vLLM ends a pooling request
        self._finish(req)
        return (req.rid, req.index, req.reply_to, 0, [], [], 0, req.detok_params,
                req.num_prompt_tokens, req.finish_reason, None, [], [], req.stamps, 0,
                pooled.data)

    # --- introspection ------------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.stats.queries, prefix_cache_hits=self.kv.stats.hits,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            ts=time.time(), waiting_tokens=self.waiting.tokens_to_compute(),
            device_busy_seconds=self.device_seconds,
            spec_decode_num_drafts=self.spec.num_drafts,
            spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(self.spec.accepted_per_pos))


def whole_images(req: Request, start: int, n: int, budget: int) -> int:
    """The tokens to compute from `start`, at most n (or up to an image's end within the
    budget), such that no image whose tokens attend both ways (Gemma 3's) is cut: each of
    its tokens sees the image's last, so the chunk that computes any of them reaches it.
    A chunk that would end inside such an image ends before it, or, starting at or inside
    it, runs to its end if the budget holds it (past a --long-prefill-token-threshold
    cap); 0 when it cannot."""
    end = start + n
    for image in req.images:
        stop = image.offset + image.length
        if image.bidirectional and image.offset < end < stop:
            if image.offset > start:
                return image.offset - start
            return stop - start if stop - start <= budget else 0
    return n
