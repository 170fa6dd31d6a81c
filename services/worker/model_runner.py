"""The worker core: weights, the paged KV cache, and one engine step.

The worker knows every request's tokens itself (it sampled them), so a plan only says
which requests compute how many tokens from which position; the worker appends what it
samples before the scheduler hears of it (services/worker/request_state.py). A step reads
as a straight line: apply the plan's deltas, prepare the flattened inputs
(services/worker/inputs.py), run the model, sample, and finish the step before it
(services/worker/launched.py), whose tokens are copied back while this one runs.
Structured outputs' grammar state lives here too (services/worker/grammar.py says why),
and so do embedding requests' running sums: an embedding request samples nothing; the step
that computes its prompt's last token pools the hidden states into its embedding instead
(services/worker/pooler.py). A speculating request's step carries the scheduler's drafts
after its last token: the logits at those 1 + k positions are verified by rejection
sampling (services/worker/spec_verify.py), and it returns 1 to k + 1 tokens; the scheduler
never plans it while that step is in flight. Such steps have queries longer than one
token, so they replay the mixed CUDA graphs (or run eagerly past their largest size),
never the decode ones. With a draft model (services/worker/draft.py) every step also runs
the draft over the same inputs, and then k greedy draft tokens after each sampled token of
a request that may speculate; they return with the step's tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from common.config import EngineConfig
from common.vision import ImageTokens
from common.messages import PromptLogprobs, StepPlan, StepResult
from common.model_files import load_tokenizer
from common.model_info import DraftModel
from common.pipeline import held_steps
from common.sampling_params import SamplingParams
from common.speculative import may_speculate
from services.worker.block_table import BlockTable
from services.worker.cuda_graphs import MAX_TOKENS, GraphKey, StepGraphs, graph_tokens
from services.worker.device_time import DeviceTimer, mark
from services.worker.draft import DraftRunner
from services.worker.grammar import Grammars, MaskRow
from services.worker.images import (EncoderCache, key_limits, mrope_positions_of_step,
                                    mrope_step_positions, profile_image_grids,
                                    step_image_slices)
from services.worker.inputs import StepInputs, prepare_inputs, to_device
from services.worker.launched import Launched, PinnedBlocks, finish
from services.worker.layers.attention import Attention, AttentionMetadata, ForwardContext
from services.worker.layers.gemv_choice import choose_gemv
from services.worker.layers.parallel import min_over_ranks, tp_size, use_peer_all_reduce
from services.worker.layers.pipeline import (PPStage, append_result, building_stage,
                                             current_stage)
from services.worker.loader import load_model
from services.worker.lora import LoRAManager
from services.worker.memory import kv_cache_bytes_per_block, plan_num_blocks
from services.worker.models import kv_cache_shape
from services.worker.models.qwen2_vl import mrope_positions
from services.worker.pooler import Pooler
from services.worker.request_state import RequestState
from services.worker.sampler import (GRAPH_HEADS, GrammarMask, Sampler, SamplerOutput,
                                     SamplingRow, graph_head, graph_head_output,
                                     prompt_logprobs)
from services.worker.spec_verify import last_emitted, verify

log = logging.getLogger("headrace.worker")


@dataclass(slots=True)
class ProposalStarts:
    """Where the draft model's proposals start for some rows of a step: the token each
    just got and its position, on the device."""
    rows: list[int]  # batch rows
    states: list[RequestState]
    tokens: torch.Tensor
    positions: torch.Tensor


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, config.dtype)


FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}


def resolve_kv_cache_dtype(config: EngineConfig, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's dtype for auto (vLLM's meaning)."""
    return FP8_CACHE_DTYPES.get(config.kv_cache_dtype, dtype)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_dir,
                 draft: DraftModel | None = None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config, self.dtype)
        self.stage = current_stage()  # the executor builds us inside building_stage
        torch.manual_seed(config.seed)
        self.model = load_model(config, hf_config, self.device, self.dtype, model_dir)
        # before the memory plan: its weights and its KV bytes per block count. Under
        # pipeline stages the last stage, which samples, holds the whole draft.
        self.draft = None if draft is None or not self.stage.is_last \
            else self._build_draft(draft)
        # before the graphs capture it; eager steps keep cuBLAS, whose launches cost the
        # host less than a Triton kernel's
        if self.device.type == "cuda" and not config.enforce_eager:
            choose_gemv(self.model)
            if self.draft is not None:
                choose_gemv(self.draft.model)
        # before the memory plan and the graphs: its slots take memory, its layers are
        # captured
        self.lora = LoRAManager(self.model, config, self.device, self.dtype,
                                config.max_num_batched_tokens) if config.enable_lora else None
        self.block_size = config.block_size
        self.sampler = Sampler(self.device, config.seed)
        self.pooler = Pooler(*config.pooling())
        self.grammars = Grammars(lambda: load_tokenizer(model_dir, config.tokenizer),
                                 self.model.vocab_size, self.device)
        self.requests: dict[str, RequestState] = {}
        self.block_table = BlockTable()  # the requests' blocks, a row each
        self.images = EncoderCache(self.model.patch_dim, self.device) \
            if self.model.multimodal else None
        # the largest images the processor makes, for the memory profile
        self.image_tokens = ImageTokens.for_model(model_dir, hf_config) \
            if self.model.multimodal else None
        self._pending: Launched | None = None
        self._pinned = PinnedBlocks()  # the host side of launched steps' copies
        self._device_time = DeviceTimer()  # single-stage steps' only (device_time.py)
        self._unshared = 0  # a pipeline stage's launched steps whose results are not back
        self._last_tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        self._connect_peers()
        self.num_blocks = self.stage.min_over_stages(
            min_over_ranks(self._plan_num_blocks(), self.device), self.device)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        if self.draft is not None:
            self.draft.kv_caches = self.draft.allocate_kv_caches(self.num_blocks)
        self.graphs = self._capture_graphs()
        # after the capture: the graphs hold no scale calculation, and _run runs the steps
        # eagerly until the first real one has set the scales
        self.scales_pending = self._calculate_kv_scales()

    def _build_draft(self, draft: DraftModel) -> DraftRunner:
        with building_stage(PPStage()):  # every layer of the draft, not a stage's share
            return DraftRunner(self.config, draft, self.device, self.dtype)

    def _plan_num_blocks(self) -> int:
        config = self.config
        bytes_per_block = kv_cache_bytes_per_block(
            self.hf_config, config.block_size, self.kv_cache_dtype,
            config.tensor_parallel_size, self.model.num_layers)
        if self.draft is not None:
            bytes_per_block += self.draft.bytes_per_block()
        return plan_num_blocks(config, self, bytes_per_block)

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = kv_cache_shape(self.hf_config, num_blocks, self.block_size,
                               self.config.tensor_parallel_size)
        return [(torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                 torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device))
                for _ in range(self.model.num_layers)]

    def _calculate_kv_scales(self) -> list[Attention]:
        """The attention layers that set their fp8 KV scales from the first step's keys
        and values (--calculate-kv-scales)."""
        if not self.config.calculate_kv_scales or self.config.kv_cache_dtype == "auto":
            return []
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for attn in layers:
            attn.calculate_scales = True
        return layers

    # --- one step -----------------------------------------------------------------------

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Queue `plan` on the device and return the results of earlier steps that are now
        complete (at most one). A decode input whose token is still being copied back is
        gathered on the device from the previous step's samples, so the host prepares and
        launches this step while the device finishes the last one."""
        self._apply_plan(plan)
        if self.stage.size > 1:
            return self._submit_stage(plan)
        # On a synchronous device (the CPU) the last step is computed already: its tokens
        # go out now rather than after this step's compute.
        done = self._finish_last(self._pending is not None and self._pending.done is None)
        inputs = self._prepare(plan)
        begun = mark(self.device)
        hidden = self._run(inputs)
        # Penalties, min_tokens and grammars need the last step's tokens to sample: wait
        # for them now, while the device runs this step's forward pass.
        done += self._finish_last(any(s.pending and s.needs_history()
                                      for s in inputs.sampling))
        launched = self._sample(plan.step, inputs, hidden)
        self._pool(launched, inputs.pooling_rows, hidden)
        if begun is not None:
            launched.span = (begun, launched.done or mark(self.device))
        done += self._finish_last()
        self._pending = launched
        return done

    def _submit_stage(self, plan: StepPlan) -> list[StepResult]:
        """A pipeline stage's part of `plan` (layers/pipeline.py). The last stage samples,
        then finishes the step before and posts its result to rank 0, as one rank does
        (so its host prepares this step while its device computes the last; the two hold
        different requests); a stage before it sends its hidden states on. Rank 0 then
        takes the results of all but the newest `held_steps` of the steps it launched, so
        that many more are in flight; the other ranks get them forwarded
        (take_forwarded). None of this plan's requests has a token
        in flight (the scheduler plans none such), so the first stage knows every input."""
        inputs = self._prepare(plan)
        hidden = self._run(inputs)
        if self.stage.is_last:
            launched = self._sample(plan.step, inputs, hidden)
            self._pool(launched, inputs.pooling_rows, hidden)
            return self._post(self._finish_last(), launched)
        if self.stage.inbox is None:
            return []
        self._unshared += 1
        return self._take_results(held_steps(self.stage.size))

    def _take_results(self, keep: int) -> list[StepResult]:
        """The last stage's results of rank 0's oldest launched steps, leaving `keep` in
        flight; their tokens are appended to their requests."""
        done = []
        while self._unshared > keep:
            result = self.stage.take_result()
            append_result(self.requests, result)
            self._unshared -= 1
            done.append(result)
        return done

    def _post(self, done: list[StepResult], launched: Launched | None = None
              ) -> list[StepResult]:
        """The last stage's finished `done`, posted to rank 0; `launched` is pending."""
        self._pending = launched
        for result in done:
            self.stage.post_result(result)
        return done

    def take_forwarded(self, result: StepResult) -> None:
        """A result of the last stage that rank 0 forwards to a rank of an earlier stage."""
        append_result(self.requests, result)

    @torch.inference_mode()
    def flush(self) -> list[StepResult]:
        """The result of the last submitted step, once it is complete (on a pipeline
        stage, of every step still in flight)."""
        if self.stage.is_last and self.stage.size > 1:
            return self._post(self._finish_last())
        if self.stage.size > 1:
            return self._take_results(0) if self.stage.inbox is not None else []
        return self._finish_last()

    def step_done(self) -> bool:
        """Whether the last submitted step's tokens are on the host (flush won't wait)."""
        pending = self._pending
        return pending is None or pending.done is None or pending.done.query()

    def wait_step_done(self) -> None:
        """Block until the last submitted step's tokens are on the host."""
        pending = self._pending
        if pending is not None and pending.done is not None:
            pending.done.synchronize()

    def forget_requests(self) -> None:
        """Drop every request's state (a new scheduler took over); flush first."""
        assert self._pending is None and not self._unshared, \
            "a launched step still refers to these requests"
        self.requests.clear()
        self.block_table = BlockTable()
        if self.images is not None:
            self.images = EncoderCache(self.model.patch_dim, self.device)

    def _apply_plan(self, plan: StepPlan) -> None:
        for req_id in plan.finished:
            state = self.requests.pop(req_id, None)
            if state is None:
                continue
            self.block_table.release(state.table_row)
            if self.images is not None:
                self.images.release(state)
        for new in plan.new:
            state = self.requests[new.req_id] = RequestState.new(new, self.device,
                                                                 self.block_table)
            if self.images is not None and state.images and self.model.mrope:
                state.mrope, state.mrope_delta = mrope_positions(
                    len(state.prompt_ids), state.images, self.model.merge,
                    self.model.tokens_per_second)
                self.images.hold(state)
        for cached in plan.cached:
            self.block_table.extend(self.requests[cached.req_id].table_row,
                                    cached.new_block_ids)

    def _prepare(self, plan: StepPlan) -> StepInputs:
        states = [self.requests[req_id] for req_id in plan.req_ids]
        if self.lora is not None:
            self.lora.prepare([state.lora for state in states],
                              np.asarray(plan.num_scheduled_tokens, dtype=np.int64))
        inputs = prepare_inputs(plan, states, self.block_table, self.block_size,
                                self._last_tokens, self.device)
        if self.images is not None:
            self._add_images(plan, states, inputs)
        return inputs

    def _add_images(self, plan: StepPlan, states: list[RequestState], inputs: StepInputs
                    ) -> None:
        """A vision-language step: the embedding rows of the image placeholders it
        computes (encoded here where no live request did), how far an image's tokens see
        where they attend both ways, and under M-RoPE three positions per token, or one
        where the step has no image rows: its tokens are all text, whose three positions
        are equal, and M-RoPE at three equal positions is 1-D RoPE at that position. Such a
        step (every decode, the prompt's text chunks) is then a text model's step, which
        the captured graphs replay."""
        assert self.images is not None
        num_scheduled = np.asarray(plan.num_scheduled_tokens, dtype=np.int64)
        num_computed = np.asarray(plan.num_computed_tokens, dtype=np.int64)
        cu = np.concatenate([[0], np.cumsum(num_scheduled)])
        positions = np.arange(cu[-1]) + np.repeat(num_computed - cu[:-1], num_scheduled)
        slices = step_image_slices(states, cu, num_computed, num_scheduled)
        if self.model.mrope:
            inputs.positions = self._tensor(mrope_positions_of_step(
                mrope_step_positions(states, positions, num_scheduled), bool(slices)))
        inputs.image_rows = self.images.rows(slices, self.model.encode_images)
        limits = key_limits(slices, positions)
        if limits is not None:
            inputs.attn.key_limits = self._tensor(limits)

    def _run(self, inputs: StepInputs) -> torch.Tensor:
        """The step's hidden states, from a captured graph where one fits; the draft model
        computes the same inputs into its own KV cache."""
        graphs, attn = self.graphs, inputs.attn
        self.scales_pending = [m for m in self.scales_pending if m.calculate_scales]
        if self.scales_pending:
            graphs = None
        key = inputs.graph = None if graphs is None or not replays_graph(inputs) \
            else graphs.key(attn, inputs.input_ids.shape[0])
        if key is None and self.images is not None:
            hidden = self.model(inputs.input_ids, inputs.positions,
                                ForwardContext(attn, self.kv_caches), inputs.image_rows)
        else:
            hidden = self._forward(inputs, key)
        if self.draft is not None:
            self.draft.sync(inputs.input_ids, inputs.positions, attn)
        return hidden

    def _forward(self, inputs: StepInputs, key: GraphKey | None) -> torch.Tensor:
        """The model's forward pass, replayed by graph `key` where there is one. On a
        pipeline stage the hidden states of the stage before come in first and this
        stage's go on after, both outside the graph."""
        sent = None if self.stage.is_first else self.stage.recv_prev(
            (inputs.positions.shape[0], self.hf_config.hidden_size), self.dtype, self.device)
        if key is not None:
            assert self.graphs is not None
            hidden = self.graphs.run(key, inputs.input_ids, inputs.positions, inputs.attn,
                                     sent)
        else:
            hidden = self.model(inputs.input_ids, inputs.positions,
                                ForwardContext(inputs.attn, self.kv_caches), sent)
        if not self.stage.is_last:
            # a replay's output is the graph's buffer, which the next replay overwrites
            # while this send may still wait for the next stage
            self.stage.send_next(hidden if key is None else hidden.clone())
        return hidden

    def _sample(self, step: int, inputs: StepInputs, hidden: torch.Tensor) -> Launched:
        """Queue the step's tokens: sampled, verified drafts, and the draft model's
        proposals after them, each copied to the host behind the launched step's event."""
        launched = Launched(step, [self._prompt_logprobs(hidden, *row)
                                   for row in inputs.prompt_logprob_rows],
                            pinned=self._pinned)
        if not inputs.sampling and not inputs.spec:
            return launched
        sampled = self._sample_tokens(launched, inputs, hidden) if inputs.sampling else None
        verified = self._verify(launched, inputs, hidden) if inputs.spec else None
        if self.draft is not None:
            self._propose(launched, inputs, sampled, verified)
        launched.on_host_at = time.time() if launched.done is None else 0.0
        return launched

    def _sample_tokens(self, launched: Launched, inputs: StepInputs, hidden: torch.Tensor
                       ) -> torch.Tensor:
        """The tokens of the rows that reached their last token; they stay on the device
        too, for the next step's gathers. Returns them."""
        rows = [s.sampling_row() for s in inputs.sampling]
        out = self._sample_in_graph(inputs, rows)
        if out is None:
            logits = self.model.compute_logits(hidden[inputs.sample_indices])
            out = self.sampler.sample(logits, rows, self._grammar_mask(inputs.sampling))
        self._last_tokens = out.token_ids
        for row, state in enumerate(inputs.sampling):
            state.pending += 1
            state.sample_row = row
        launched.sampling = inputs.sampling
        launched.host = launched.to_host(out.packed)  # the logprobs too, in one copy
        launched.logprobs = out.logprobs
        return out.token_ids

    def _sample_in_graph(self, inputs: StepInputs, rows: list[SamplingRow]
                         ) -> SamplerOutput | None:
        """A decode step's greedy tokens, with logprobs=0 or 1, from a head of the graph
        that replayed it (cuda_graphs.py); None where the sampler must choose them: a
        random draw, processed logits, a grammar, or a row that does not sample."""
        if inputs.graph is None or len(rows) != inputs.input_ids.shape[0]:
            return None
        # graph_head first: a random row ends its scan, the grammars' scan after it
        k = graph_head(rows)
        if k is None or any(state.structured for state in inputs.sampling):
            return None
        assert self.graphs is not None
        out = self.graphs.sample(inputs.graph, k)
        return None if out is None else graph_head_output(out, rows, k)

    def _verify(self, launched: Launched, inputs: StepInputs, hidden: torch.Tensor
                ) -> torch.Tensor:
        """Verify the drafts of this step's speculating requests. Returns spec_verify's
        rows, on the device."""
        assert inputs.spec_indices is not None
        logits = self.model.compute_logits(hidden[inputs.spec_indices])
        states = [state for state, _ in inputs.spec]
        out = verify(self.sampler, logits, [s.sampling_row() for s in states],
                     [draft for _, draft in inputs.spec])
        for state in states:
            state.pending += 1
        launched.spec = states
        launched.spec_host = launched.to_host(out)
        return out

    def _propose(self, launched: Launched, inputs: StepInputs, sampled: torch.Tensor | None,
                 verified: torch.Tensor | None) -> None:
        """The draft model's proposals after this step's tokens, for the requests that may
        speculate next."""
        assert self.draft is not None
        parts = [part for part in (self._after_sampled(inputs, sampled),
                                   self._after_verified(inputs, verified))
                 if part is not None]
        if not parts:
            return
        rows = [row for part in parts for row in part.rows]
        states = [state for part in parts for state in part.states]
        drafts = self.draft.propose(
            torch.cat([part.tokens for part in parts]),
            torch.cat([part.positions for part in parts]),
            inputs.attn.block_tables[self._tensor(np.asarray(rows))],
            self._tensor(self.block_table.lengths[[s.table_row for s in states]]),
            int(inputs.seq_lens[rows].max()))
        launched.drafted = states
        launched.drafts_host = launched.to_host(drafts)

    def _after_sampled(self, inputs: StepInputs, sampled: torch.Tensor | None
                       ) -> ProposalStarts | None:
        """A sampled row's token is at the position after its computed ones."""
        keep = [j for j, s in enumerate(inputs.sampling) if _drafts_for(s)]
        if not keep:
            return None
        assert sampled is not None
        rows = [inputs.sample_rows[j] for j in keep]
        return ProposalStarts(rows, [inputs.sampling[j] for j in keep],
                              sampled[self._tensor(np.asarray(keep))],
                              self._tensor(inputs.seq_lens[rows]))

    def _after_verified(self, inputs: StepInputs, verified: torch.Tensor | None
                        ) -> ProposalStarts | None:
        """A verified row's last token is its replacement or bonus token, at the position
        after its accepted drafts: both read on the device, so the host does not wait for
        the verification."""
        keep = [j for j, (s, _) in enumerate(inputs.spec) if _drafts_for(s)]
        if not keep:
            return None
        assert verified is not None
        rows = [inputs.spec_rows[j] for j in keep]
        tokens, emitted = last_emitted(verified[self._tensor(np.asarray(keep))])
        num_drafts = np.asarray([len(inputs.spec[j][1]) for j in keep])
        return ProposalStarts(rows, [inputs.spec[j][0] for j in keep], tokens,
                              self._tensor(inputs.seq_lens[rows] - num_drafts - 1) + emitted)

    def _pool(self, launched: Launched, rows: list[tuple[RequestState, int, int, bool]],
              hidden: torch.Tensor) -> None:
        """Pool this step's embedding chunks; the requests whose prompt it finished get
        their embeddings copied to the host with the step's tokens."""
        states, vectors = [], []
        for state, first, count, last_chunk in rows:
            state.pooled = self.pooler.add_chunk(hidden, first, count, state.pooled)
            if last_chunk:
                states.append(state)
                vectors.append(self.pooler.finish(hidden, first + count - 1, state.pooled,
                                                  len(state.prompt_ids)))
        if not vectors:
            return
        launched.pooled_states = states
        launched.pooled = launched.to_host(self.pooler.normalized(torch.stack(vectors)))

    def _grammar_mask(self, sampling: list[RequestState]) -> GrammarMask | None:
        """The mask of this step's structured rows, None when it has none. Their tokens
        so far are on the host (submit waited for them)."""
        rows: list[MaskRow] = []
        for i, state in enumerate(sampling):
            if not state.structured:
                continue
            if state.matcher is None:
                state.matcher = self.grammars.matcher(state.req_id, state.params,
                                                      state.output_ids)
                state.structured = state.matcher is not None
            if state.structured and not state.matcher.is_terminated():
                rows.append((i, state.matcher, state.held_back()))
        return self.grammars.mask(rows) if rows else None

    def _prompt_logprobs(self, hidden: torch.Tensor, state: RequestState, first: int,
                         start: int, count: int) -> PromptLogprobs:
        logits = self.model.compute_logits(hidden[first:first + count])
        targets = torch.tensor(state.prompt_ids[start + 1:start + 1 + count], device=self.device)
        k = state.params.prompt_logprobs
        ids, lps, ranks = prompt_logprobs(logits, targets, k)
        return PromptLogprobs(state.req_id, start + 1, k, ids.flatten().tolist(),
                              lps.flatten().tolist(), ranks.tolist())

    # --- finishing a step ----------------------------------------------------------------

    def _finish_last(self, now: bool = True) -> list[StepResult]:
        """The last launched step's result (its tokens appended to their requests), when
        there is one and `now`."""
        launched = self._pending
        if not now or launched is None:
            return []
        self._pending = None
        return [finish(launched, self._device_time)]

    # --- set-up -------------------------------------------------------------------------

    def _connect_peers(self) -> None:
        """Small all-reduces over peer memory: those of every step a graph replays."""
        config = self.config
        if self.device.type != "cuda" or tp_size() == 1 or config.disable_custom_all_reduce:
            return
        assert config.max_num_batched_tokens is not None
        tokens = graph_tokens(config.max_num_seqs, config.max_num_batched_tokens)
        if use_peer_all_reduce(tokens, self.hf_config.hidden_size, self.dtype, self.device):
            log.info("all-reduces of up to %d tokens go over peer memory", tokens)

    def graph_head_bytes(self) -> int:
        """The logits the decode graphs' heads hold in the graphs' pool (cuda_graphs.py),
        the largest graph's: the lm_head's, in the model's dtype, and where the heads read
        compute_logits's (CausalLM.greedy_logits) their float32 copy. The top-logprobs
        kernel's own buffers, even at k = 20, are under 1% of them."""
        if not self.stage.is_last:
            return 0
        rows = min(self.config.max_num_seqs, MAX_TOKENS)  # the largest decode graph's
        copy = 4 if self.model.float_logits_only else 0
        return rows * self.model.vocab_size * (self.dtype.itemsize + copy)

    def _capture_graphs(self) -> StepGraphs | None:
        """None on the CPU and under --enforce-eager. A vision-language model's graphs
        wrap its language model alone (token ids to embeddings, 1-D positions): they
        replay its steps without image rows. A pipeline stage's wrap its layers alone: a
        stage after the first takes the hidden states received as a graph input. The
        draft model, whole on the last stage, is captured as on one rank."""
        config = self.config
        if self.device.type != "cuda" or config.enforce_eager:
            return None
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        graphs = StepGraphs(self.model, self.kv_caches, config.max_num_seqs,
                            config.max_num_batched_tokens, config.max_model_len,
                            self.block_size, None if self.stage.is_first else self.dtype,
                            GRAPH_HEADS if self.stage.is_last else ())
        start = time.perf_counter()
        graphs.capture()
        if self.draft is not None:
            self.draft.capture_graphs(config.max_num_seqs, config.max_num_batched_tokens)
        bounded = {size: spans for size, spans in graphs.decode_spans.items()
                   if len(spans) > 1}  # the other sizes' graphs hold any context
        log.info("captured CUDA graphs for steps of %s tokens, decodes of these sizes for "
                 "contexts up to these keys %s, in %.1f s", graphs.sizes, bounded,
                 time.perf_counter() - start)
        return graphs

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can plan (every token of the budget, the most
        requests, all sampling with top-k/top-p; for a vision-language model, the
        encoder's pass over the most and largest images a step may encode, whose rows
        then stand in for the step's first tokens), on a one-block cache whose writes are
        skipped: its peak memory is what a step needs beside the weights."""
        num_tokens = self.config.max_num_batched_tokens
        num_reqs = min(self.config.max_num_seqs, num_tokens)
        q_lens = np.full(num_reqs, num_tokens // num_reqs, dtype=np.int64)
        q_lens[: num_tokens % num_reqs] += 1
        cu = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu[1:])
        caches = self._allocate_kv_caches(1)
        max_blocks = -(-int(q_lens.max()) // self.block_size)
        attn = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros((num_reqs, max_blocks), dtype=torch.int32,
                                     device=self.device),
            query_start_loc=self._tensor(cu.astype(np.int32)),
            seq_lens=self._tensor(q_lens.astype(np.int32)),
            max_query_len=int(q_lens.max()), max_seq_len=int(q_lens.max()))
        input_ids = torch.randint(0, self.model.vocab_size, (num_tokens,), device=self.device)
        positions = self._tensor(np.arange(num_tokens) - np.repeat(cu[:-1], q_lens))
        if self.image_tokens is not None:  # the encoder's peak, and its rows held through
            images = self._profile_images(num_tokens)
            rows = torch.cat(images)[:num_tokens] if images else None
            extra = None if rows is None else (self._tensor(np.arange(rows.shape[0])), rows)
            if self.model.mrope:
                positions = positions.expand(3, -1).contiguous()
        else:
            extra = None if self.stage.is_first else torch.randn(
                num_tokens, self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        hidden = self.model(input_ids, positions, ForwardContext(attn, caches), extra)
        if not self.stage.is_last:  # no logits to sample
            return
        if self.draft is not None:  # its sync pass over the same step
            self.draft.forward(input_ids, positions, attn, self.draft.allocate_kv_caches(1))
        logits = self.model.compute_logits(hidden[self._tensor(cu[1:] - 1)])
        params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50)
        self.sampler.sample(logits, [SamplingRow(params, [], [], None)] * num_reqs)

    def _profile_images(self, num_tokens: int) -> list[torch.Tensor]:
        """The vision encoder's embeddings of dummy images at the largest size the image
        processor allows, as many as a step of `num_tokens` may encode (as vLLM profiles
        its encoder at --limit-mm-per-prompt's count and the largest item)."""
        assert self.image_tokens is not None
        limit = self.config.mm_limits().get("image")
        grids = profile_image_grids(
            self.image_tokens.largest_grid(), self.image_tokens.merge_size, num_tokens,
            None if limit is None else limit * self.config.max_num_seqs)
        if not grids:
            return []
        num_patches = sum(t * h * w for t, h, w in grids)
        patches = torch.randn(num_patches, self.model.patch_dim, device=self.device)
        return self.model.encode_images(patches, grids)

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return to_device(array, self.device)


def replays_graph(inputs: StepInputs) -> bool:
    """Whether a captured graph may replay a step: not where it has image rows (the
    vision encoder's embeddings and M-RoPE's three positions a token are no graph
    inputs); those steps run eagerly."""
    return inputs.image_rows is None and inputs.positions.dim() == 1


def _drafts_for(state: RequestState) -> bool:
    """Whether the draft model proposes for a request that sampled: the scheduler only
    places drafts where common/speculative.may_speculate allows (counting the token just
    sampled, which the worker holds as pending)."""
    return not state.embed and may_speculate(state.params,
                                             len(state.output_ids) + state.pending)
