"""The in-process engine: the same cores the services run, wired without Redis.

A step is schedule, execute, postprocess. The Redis pipeline runs exactly these cores; only
the transport between them differs. Two things keep the device busy while the host works,
as the served pipeline's processes do: the scheduler plans step N+2 and the executor
launches it before step N's tokens are applied and detokenized (the plan-ahead of
services/scheduler/request.py; services/offline/steps.py says how many), and a
detokenizer process (services/offline/detokenizer.py) turns the tokens into text beside
this loop, so `step` returns the text of earlier steps as it comes back. LLM.generate asks
for each completion's text at its end (FINAL_ONLY, as vLLM's LLM does): the scheduler then
makes one item of the whole completion, not one a step, and most of the per-token work of
handing items over and taking text back goes.

The executor may instead run in a worker process (services/offline/worker_process.py), as
the served worker runs apart from the scheduler, so that the loop's Python and the step
thread's do not share one GIL: `worker_process=True`, or HEADRACE_WORKER_PROCESS=1 (as
vLLM's VLLM_ENABLE_V1_MULTIPROCESSING). Unset, it is on wherever the model runs on GPUs,
as vLLM's engine core runs in a process of its own by default. There the loop's host work
bounds the steps, and the child ran faster on the means of every lease that measured both:
two pipeline stages of Llama-3.1-8B at 13,988 tok/s against 11,964 (2x H200:
benchmarks/pp-h200x2-overlap/wp); one H100's nano workload at 16,157 against 15,824 tok/s,
and at 11,066 against 10,415 with logprobs=1 (one lease: benchmarks/issue31-h100/s11),
after 16,562, 16,460 and 16,277 against 14,043 and 16,640 (two leases: benchmarks/
issue31-h100/s8). The child's start-up (seconds) runs while this process loads the
tokenizer. On the CPU the model, not the host, is the bound, and the executor stays here.
The outputs are the same either way, token for token.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from common.config import ConfigError, EngineConfig
from common.lora import read_adapter_config
from common.messages import (DetokItem, ImageInput, LoRARequest, StepPlan, StepResult,
                             TextDelta, with_fields)
from common.model_info import load_model_info
from common.sampling_params import SamplingParams
from common.timing import PhaseClock
from services.detokenizer.core import Detokenizer
from services.offline.detokenizer import DetokenizerProcess
from services.offline.steps import Steps, launch_lag, start_steps
from services.offline.worker_process import ProcessSteps
from services.scheduler.core import Scheduler, SchedulerConfig
from services.tokenizer.core import InputProcessor
from services.worker.executor import Executor, start_executor
from services.worker.model_runner import ModelRunner, resolve_device

LOCAL_REPLY = "local"
WORKER_PROCESS_ENV = "HEADRACE_WORKER_PROCESS"
# objects allocated between young-generation collections while a batch runs (Python's
# default is 700)
BATCH_GC_THRESHOLD = 20_000


class Engine:
    def __init__(self, config: EngineConfig, detokenizer_process: bool = True,
                 step_thread: bool = True, worker_process: bool | None = None) -> None:
        """detokenizer_process=False detokenizes every item in this loop, as the engine
        did before the process: the same deltas, each returned by the step that made it;
        step_thread=False calls the executor from this loop, as the engine did before the
        thread (tests compare them); worker_process: the executor in a child process
        (`uses_worker_process`)."""
        # started first, so that the child loads the model while this process loads the
        # tokenizer
        worker = (ProcessSteps(config)
                  if uses_worker_process(config, step_thread, worker_process) else None)
        self.detokenizer_process: DetokenizerProcess | None = None
        try:
            self.info = load_model_info(config)
            self.config = self.info.config
            self.processor = InputProcessor.from_info(self.info)
            self.detokenizer = Detokenizer(self.info.tokenizer)
            # started before the model loads, so that its imports run meanwhile
            if detokenizer_process:
                self.detokenizer_process = DetokenizerProcess(
                    self.info.model_dir, self.detokenizer.with_texts, config.tokenizer,
                    config.trust_remote_code)
            self.executor: Executor | None = None  # none here with a worker process
            if worker is None:
                self.executor = start_executor(self.info.resolved)
                num_blocks = self.executor.num_blocks
            else:
                # the child loads the model meanwhile: logprobs' texts are one lookup a step
                self.detokenizer.token_text.preload(self.info.vocab_size)
                num_blocks = worker.ready()
        except BaseException:
            if worker is not None:
                worker.process.kill()  # it may be loading the model still
                worker.close()
            self._close_detokenizer_process()
            raise
        self.scheduler = Scheduler(SchedulerConfig.from_engine(self.config, num_blocks))
        self.on_plan: Callable[[StepPlan], None] | None = None  # benchmarks trace steps
        self.clock = PhaseClock()  # where the steps' time goes (benchmarks print it)
        self._adapters: dict[int, str] = {}  # LoRA id -> the path checked under it
        self.steps: Steps = worker if self.executor is None else start_steps(self.executor,
                                                                             step_thread)
        self.lag = launch_lag(self.config)

    def add_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, lora: LoRARequest | None = None,
                    images: list[ImageInput] | None = None) -> None:
        """images: the prompt's, from processor.with_images."""
        if lora is not None:
            self._check_adapter(lora)
        admit = self.processor.admit(rid, LOCAL_REPLY, prompt_token_ids, params,
                                     priority=priority, lora=lora, images=images)
        self.scheduler.add_request(admit)

    def _check_adapter(self, lora: LoRARequest) -> None:
        """Refuse an adapter here, with its reason, rather than in the worker's step."""
        if not self.config.enable_lora:
            raise ConfigError(f"LoRA adapter {lora.lora_name!r} given, but LoRA is off "
                              "(enable_lora=True, --enable-lora)")
        known = self._adapters.get(lora.lora_int_id)
        if known is None:
            read_adapter_config(lora.lora_path, self.config.max_lora_rank)
            self._adapters[lora.lora_int_id] = lora.lora_path
        elif known != lora.lora_path:
            raise ValueError(f"LoRA id {lora.lora_int_id} is {known}, not {lora.lora_path}: "
                             "each adapter needs its own lora_int_id")

    def add_embedding(self, rid: str, prompt_token_ids: list[int], priority: int = 0,
                      lora: LoRARequest | None = None) -> None:
        """An embedding request: its one TextDelta carries the embedding."""
        if lora is not None:
            self._check_adapter(lora)
        self.scheduler.add_request(self.processor.admit_embedding(
            rid, LOCAL_REPLY, prompt_token_ids, priority=priority, lora=lora))

    @property
    def runner(self) -> ModelRunner:
        """The rank in this process: benchmarks and the profiler inspect its model."""
        if self.executor is None:
            raise RuntimeError(
                "the model runs in the engine's worker process; pass worker_process=False "
                f"to Engine (or set {WORKER_PROCESS_ENV}=0) to have it in this one")
        return self.executor.runner

    def close(self) -> None:
        """Let the worker process, the tensor-parallel ranks and the detokenizer process
        go, so that another engine can start here (a second call does nothing)."""
        self.steps.close()
        if self.executor is not None:
            self.executor.close()
        self._close_detokenizer_process()

    def _close_detokenizer_process(self) -> None:
        if self.detokenizer_process is not None:
            self.detokenizer_process.close()

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_unfinished(self) -> bool:
        """Requests still running, or text still being detokenized."""
        process = self.detokenizer_process
        return self.scheduler.has_unfinished() or (process is not None and process.pending > 0)

    def step(self) -> list[TextDelta]:
        """Finish the oldest step out, plan and launch the next, then hand out text: the
        scheduler plans ahead of the tokens (see services/scheduler/request.py), so the
        device runs the step after while the host applies a step's tokens. What does not
        change the next plan (the detokenizer process's items, and the caller's work on the
        deltas this returns) comes after the launch, so that the device never waits on it.
        Returns the text that the loop detokenized and whatever the detokenizer process has
        sent back; with nothing left to run, it waits for the process."""
        clock = self.clock
        clock.start()
        # every result but the steps the last launch left out: each plan is made from the
        # same tokens however the step thread is timed (services/offline/steps.py)
        deltas, beside = self._apply(self.steps.results(keep=self.lag))
        plan = self.scheduler.schedule()
        if plan is not None:
            if self.on_plan is not None:
                self.on_plan(plan)
            self.steps.launch(plan)
        clock.lap("schedule")
        if plan is None:  # nothing to launch: the steps still out finish now
            more, more_beside = self._apply(self.steps.results(keep=0))
            deltas, beside = deltas + more, beside + more_beside
        process = self.detokenizer_process
        if process is not None:
            if beside:
                process.submit(beside)
                clock.lap("postprocess")
            deltas += process.collect(wait=plan is None and not deltas and not beside)
            clock.lap("collect")
        return deltas

    def _apply(self, results: list[StepResult]) -> tuple[list[TextDelta], list[DetokItem]]:
        """Apply `results` to the scheduler: the deltas of the items detokenized here, and
        the items left for the detokenizer process."""
        clock = self.clock
        clock.lap("execute")
        deltas: list[TextDelta] = []
        beside: list[DetokItem] = []
        for result in results:
            if result.logprobs is not None:
                result = self._with_texts(result)
            items = self.scheduler.update(result)
            clock.lap("update")
            if self.detokenizer_process is not None:
                beside += [item for item in items if not _decides_course(item)]
                items = [item for item in items if _decides_course(item)]
            deltas += self._detokenize(items)
            clock.lap("postprocess")
        return deltas, beside

    def _with_texts(self, result: StepResult) -> StepResult:
        """The step's logprobs with their tokens' texts, looked up as the step comes in:
        a FINAL_ONLY completion's all at its end took the loop a second of the nano
        workload's tail on an H200 (benchmarks/issue31-h200), where this step's lookups
        run while the device computes the next."""
        return with_fields(result, logprobs=self.detokenizer.spelled(result.logprobs))

    def _detokenize(self, items: list[DetokItem]) -> list[TextDelta]:
        """The items' deltas, made here; a stop string found aborts its request before the
        next plan."""
        deltas = []
        for item in items:
            delta, abort = self.detokenizer.process(item)
            if abort is not None:  # a stop string ended the completion
                self.scheduler.abort(abort.rid, abort.index, abort.reason, abort.stop_reason)
            deltas.append(delta)
        return deltas


def uses_worker_process(config: EngineConfig, step_thread: bool = True,
                        worker_process: bool | None = None) -> bool:
    """Whether an engine of `config` so built runs its executor in a worker process:
    `worker_process` if given, else HEADRACE_WORKER_PROCESS=0|1, else whether it runs on
    GPUs (the module's docstring says why). The child runs the executor
    on a step thread: step_thread=False cannot go with it, and keeps the executor here
    whatever the environment says."""
    if worker_process is None:
        worker_process = step_thread and _worker_process_chosen(_on_gpus(config))
    if worker_process and not step_thread:
        raise ValueError("step_thread=False calls the executor from the engine's loop: it "
                         "cannot go with worker_process=True")
    return worker_process


def _worker_process_chosen(default: bool) -> bool:
    chosen = os.environ.get(WORKER_PROCESS_ENV)
    if chosen is None:
        return default
    if chosen not in ("0", "1"):
        raise ConfigError(f"{WORKER_PROCESS_ENV}={chosen!r}: give 0 or 1")
    return chosen == "1"


def _on_gpus(config: EngineConfig) -> bool:
    return resolve_device(config).type == "cuda"


def _decides_course(item: DetokItem) -> bool:
    """Whether detokenizing `item` may change what the scheduler plans next: a stop string
    found in its text aborts the request. Such items are detokenized in the loop, as
    before the process existed, so the next plan is the same; an embedding's item is only
    passed through."""
    return bool(item.params.stop) or item.embedding is not None


@contextmanager
def fewer_collections() -> Iterator[None]:
    """Run a batch with the collector out of the loop's way, as the services freeze their
    heap (common/service.py): what is alive at its start (the model, the tokenizer, the
    requests) is left out of collections, and the young generation is collected every
    BATCH_GC_THRESHOLD allocations instead of 700. A step allocates a few objects a token
    (more with logprobs, which a FINAL_ONLY completion holds until its end), and each full
    collection walked torch's and the tokenizer's objects: on the CPU bench
    (benchmarks/offline-loop-cpu) the nano workload with logprobs=1 took 20-23 us of
    host work a token with the defaults and 11-12 with both. Both are undone on leaving;
    a heap the caller froze already stays as the caller left it."""
    thresholds = gc.get_threshold()
    freezing = gc.get_freeze_count() == 0
    if freezing:
        gc.freeze()
    gc.set_threshold(BATCH_GC_THRESHOLD, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if freezing:
            gc.unfreeze()
