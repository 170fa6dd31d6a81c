"""The in-process engine: the same cores the services run, wired without Redis.

A step is schedule, execute, postprocess. The Redis pipeline runs exactly these cores; only
the transport between them differs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.config import EngineConfig
from common.timing import PhaseClock
from common.messages import DetokItem, StepPlan, TextDelta
from common.model_files import (load_generation_config, load_hf_config, load_tokenizer,
                                max_model_len_of, resolve_model)
from common.sampling_params import SamplingParams
from services.detokenizer.core import Detokenizer
from services.scheduler.core import Scheduler, SchedulerConfig
from services.tokenizer.core import InputProcessor
from services.tokenizer.defaults import SamplingDefaults, eos_token_ids, sampling_defaults
from services.worker.model_runner import ModelRunner

LOCAL_REPLY = "local"


@dataclass(slots=True)
class ModelInfo:
    """What every stage needs to know about the model besides its weights."""
    config: EngineConfig  # resolved: max_model_len and the token budget filled in
    model_dir: str
    tokenizer: object
    defaults: SamplingDefaults
    processor: InputProcessor


def load_model_info(config: EngineConfig) -> ModelInfo:
    model_dir = resolve_model(config.model, config.load_format)
    hf_config = load_hf_config(model_dir)
    config = config.resolved(max_model_len_of(hf_config))
    tokenizer = load_tokenizer(model_dir, config.tokenizer)
    generation_config = load_generation_config(model_dir)
    defaults = sampling_defaults(config.generation_config, generation_config)
    assert config.max_model_len is not None
    processor = InputProcessor(tokenizer, config.max_model_len, defaults, config.max_logprobs,
                               hf_config.vocab_size, eos_token_ids(tokenizer, generation_config))
    return ModelInfo(config, str(model_dir), tokenizer, defaults, processor)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.info = load_model_info(config)
        self.config = self.info.config
        hf_config = load_hf_config(self.info.model_dir)
        self.runner = ModelRunner(self.config, hf_config, self.info.model_dir)
        self.scheduler = Scheduler(SchedulerConfig.from_engine(self.config,
                                                               self.runner.num_blocks))
        self.detokenizer = Detokenizer(self.info.tokenizer)
        self.on_plan: Callable[[StepPlan], None] | None = None  # benchmarks trace steps
        self.clock = PhaseClock()  # where the steps' time goes (benchmarks print it)

    def add_request(self, rid: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0) -> None:
        admit = self.info.processor.admit(rid, LOCAL_REPLY, prompt_token_ids, params,
                                          priority=priority)
        self.scheduler.add_request(admit)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[TextDelta]:
        """Plan and launch the next step, then finish the previous one: the scheduler plans
        ahead of the tokens (see services/scheduler/request.py), so the host updates and
        detokenizes step N while the device runs step N+1."""
        clock = self.clock
        clock.start()
        plan = self.scheduler.schedule()
        if plan is not None and self.on_plan is not None:
            self.on_plan(plan)
        clock.lap("schedule")
        results = self.runner.submit(plan) if plan is not None else self.runner.flush()
        clock.lap("execute")
        deltas: list[TextDelta] = []
        for result in results:
            items = self.scheduler.update(result)
            clock.lap("update")
            deltas += self.postprocess(items)
            clock.lap("postprocess")
        return deltas

    def postprocess(self, items: list[DetokItem]) -> list[TextDelta]:
        deltas = []
        for item in items:
            delta, abort = self.detokenizer.process(item)
            if abort is not None:  # a stop string ended the completion
                self.scheduler.abort(abort.rid, abort.index, abort.reason, abort.stop_reason)
            deltas.append(delta)
        return deltas
