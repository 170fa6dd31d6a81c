"""The executor: the one seam through which the worker shell and the offline engine drive
the model. It takes step plans and hands back step results; how many ranks compute them is
its business. Today it holds one rank, a ModelRunner in this process, and refuses a tensor-parallel size
above 1 (as every command line does before anything starts); tensor parallelism adds rank
processes behind these same methods."""

from __future__ import annotations

from common.messages import StepPlan, StepResult
from common.model_info import ResolvedModel
from services.worker.model_runner import ModelRunner


class Executor:
    def __init__(self, model: ResolvedModel) -> None:
        model.config.check_runnable()
        self.config = model.config
        self.runner = ModelRunner(model.config, model.hf_config, model.model_dir)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; returns the results of earlier steps it completed (at most one)."""
        return self.runner.submit(plan)

    def flush(self) -> list[StepResult]:
        """The last launched step's result, once it is complete."""
        return self.runner.flush()

    def step_done(self) -> bool:
        return self.runner.step_done()

    def wait_step_done(self) -> None:
        """Block (in a thread of the caller's) until the last step's tokens are back."""
        self.runner.wait_step_done()

    def forget_requests(self) -> None:
        """A new scheduler took over: drop every request's state (flush first)."""
        self.runner.forget_requests()
