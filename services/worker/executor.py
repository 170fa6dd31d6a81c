"""The executor: the one seam through which the worker shell and the offline engine drive
the model. It takes step plans and hands back step results; how many ranks compute them is
its business. Rank 0 is a ModelRunner in this process; with a tensor-parallel size above 1
it also drives one follower process per further rank (services/worker/ranks.py)."""

from __future__ import annotations

import torch.distributed as dist

from common.messages import StepPlan, StepResult
from common.model_info import ResolvedModel, check_devices
from services.worker.model_runner import ModelRunner, resolve_device
from services.worker.ranks import FLUSH, FORGET, Followers, OnLost, exit_on_rank_lost, join_group


class Executor:
    def __init__(self, model: ResolvedModel, on_rank_lost: OnLost = exit_on_rank_lost) -> None:
        config = self.config = model.config
        check_devices(config)
        if dist.is_initialized():  # the layers would shard for that group
            raise RuntimeError("a tensor-parallel group is open in this process already: "
                               "close its engine first")
        self.followers: Followers | None = None
        if config.tensor_parallel_size > 1:
            self.followers = Followers(model, on_rank_lost)
            join_group(0, config.tensor_parallel_size, self.followers.init_method,
                       resolve_device(config))
        try:
            self.runner = ModelRunner(config, model.hf_config, model.model_dir, model.draft)
        except BaseException:
            self.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; returns the results of earlier steps it completed (at most one)."""
        if self.followers is not None:
            self.followers.submit(plan)
        return self.runner.submit(plan)

    def flush(self) -> list[StepResult]:
        """The last launched step's result, once it is complete."""
        if self.followers is not None:
            self.followers.send(FLUSH)
        return self.runner.flush()

    def step_done(self) -> bool:
        return self.runner.step_done()

    def wait_step_done(self) -> None:
        """Block (in a thread of the caller's) until the last step's tokens are back."""
        self.runner.wait_step_done()

    def forget_requests(self) -> None:
        """A new scheduler took over: drop every request's state (flush first)."""
        if self.followers is not None:
            self.followers.send(FORGET)
        self.runner.forget_requests()

    def close(self) -> None:
        """Let the follower ranks go (they exit with this process anyway)."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None
