"""The executor: the one seam through which the worker shell and the offline engine drive
the model. It takes step plans and hands back step results; how many ranks compute them is
its business. `start_executor` picks the implementation for the engine's sizes: the model
whole in this process (OneRankExecutor), rank 0 of a tensor-parallel group here with one
follower process per further rank (TensorParallelExecutor, services/worker/ranks.py), or
rank 0 of the first of a pipeline's stages, each stage a tensor-parallel group
(PipelineExecutor). A group's layers get their TPGroup and their PPStage from the executor
that builds them (layers/parallel.building_for, layers/pipeline.building_stage), never
from torch.distributed's global state.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch.distributed as dist

from common.config import EngineConfig
from common.messages import StepPlan, StepResult
from common.model_info import ResolvedModel, check_devices
from services.worker.layers.parallel import TPGroup, building_for
from services.worker.layers.pipeline import building_stage
from services.worker.model_runner import ModelRunner, resolve_device
from services.worker.ranks import (FLUSH, FORGET, Followers, OnLost, exit_on_rank_lost,
                                   join_group, leave_group)


class Executor(Protocol):
    config: EngineConfig  # the engine's, as the model's resolution completed it
    runner: ModelRunner  # the rank in this process: tools inspect its model

    @property
    def num_blocks(self) -> int:
        """KV cache blocks, the same on every rank."""

    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; returns the results of earlier steps it completed (at most one)."""

    def flush(self) -> list[StepResult]:
        """The last launched step's result, once it is complete."""

    def step_done(self) -> bool:
        """Whether the last launched step's tokens are back (flush would not wait)."""

    def wait_step_done(self) -> None:
        """Block (in a thread of the caller's) until the last step's tokens are back."""

    def forget_requests(self) -> None:
        """A new scheduler took over: drop every request's state (flush first)."""

    def close(self) -> None:
        """Let the ranks and their process group go, so another executor can start here."""


def start_executor(model: ResolvedModel, on_rank_lost: OnLost = exit_on_rank_lost
                   ) -> Executor:
    """The executor for `model`'s engine config, its model loaded. `on_rank_lost` runs when
    a follower rank dies (the default ends this process)."""
    config = model.config
    check_devices(config)
    # torch.distributed holds one world per process: the group's ranks could not join
    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel group is open in this process already: "
                           "close its engine first")
    if config.pipeline_parallel_size > 1:
        return PipelineExecutor(model, on_rank_lost)
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(model, on_rank_lost)
    return OneRankExecutor(model)


class OneRankExecutor:
    """The model whole in this process: each call is the runner's."""

    def __init__(self, model: ResolvedModel) -> None:
        self.config = model.config
        self.runner = ModelRunner(model.config, model.hf_config, model.model_dir, model.draft)

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def submit(self, plan: StepPlan) -> list[StepResult]:
        return self.runner.submit(plan)

    def flush(self) -> list[StepResult]:
        return self.runner.flush()

    def step_done(self) -> bool:
        return self.runner.step_done()

    def wait_step_done(self) -> None:
        self.runner.wait_step_done()

    def forget_requests(self) -> None:
        self.runner.forget_requests()

    def close(self) -> None:
        """Nothing to let go: the runner's memory goes with the executor."""


class TensorParallelExecutor(OneRankExecutor):
    """Rank 0 of a tensor-parallel group in this process, ranks 1..N-1 in follower
    processes that make every call rank 0 makes, in the same order: each call goes down
    their pipes before rank 0 makes it."""

    def __init__(self, model: ResolvedModel, on_rank_lost: OnLost) -> None:
        config = model.config
        self.followers: Followers | None = Followers(model, on_rank_lost)
        self.group: TPGroup | None = None
        self.failed = False  # a call raised here: the followers may be inside it still
        try:
            self.group, stage = join_group(0, model, self.followers.init_method,
                                           resolve_device(config))
            stage.inbox = self.followers.results
            with building_for(self.group), building_stage(stage):
                super().__init__(model)
        except BaseException:
            self.close()
            raise

    def submit(self, plan: StepPlan) -> list[StepResult]:
        assert self.followers is not None, "closed"
        with self._failing():
            self.followers.submit(plan)
            return super().submit(plan)

    def flush(self) -> list[StepResult]:
        assert self.followers is not None, "closed"
        with self._failing():
            self.followers.send(FLUSH)
            return super().flush()

    def forget_requests(self) -> None:
        assert self.followers is not None, "closed"
        with self._failing():
            self.followers.send(FORGET)
            super().forget_requests()

    @contextmanager
    def _failing(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.failed = True
            raise

    def close(self) -> None:
        """The followers finish their calls and exit; then the group goes (a second close
        does nothing)."""
        if self.followers is None:
            return
        self.followers.close(failed=self.failed)
        self.followers = None
        if self.group is not None:
            leave_group(self.group)
            self.group = None


class PipelineExecutor(TensorParallelExecutor):
    """The first stage's rank 0 here; the further ranks of its tensor-parallel group and
    every rank of the later stages in follower processes, each building only its stage's
    layers and KV cache (layers/pipeline.py). Each call goes to every rank, as for tensor
    parallelism; hidden states pass stage to stage inside the step, and the last stage's
    StepResult comes back to rank 0 down a pipe. With N stages, submit returns the result
    of the step N before the one it launches, so up to N + 1 steps of different requests
    are in flight (common/pipeline.py); flush returns every one still out. The results
    go on to the earlier stages' other ranks before the next call, so that they know the
    tokens it embeds."""

    def submit(self, plan: StepPlan) -> list[StepResult]:
        return self._forwarded(super().submit(plan))

    def flush(self) -> list[StepResult]:
        return self._forwarded(super().flush())

    def _forwarded(self, results: list[StepResult]) -> list[StepResult]:
        assert self.followers is not None, "closed"
        with self._failing():
            self.followers.forward(results)
        return results
