"""Tensor- and pipeline-parallel ranks: one torch.distributed world (NCCL on CUDA, gloo on
the CPU) whose rank 0 lives in the process that drives the executor (the worker, or the
offline engine). Rank 0 starts a follower process for every further rank. Each rank builds
its ModelRunner (its stage's layers, its tensor-parallel shard) on its own device and runs
the same calls in the same order: rank 0 forwards each executor call down a pipe to the
followers before making it itself. Global rank r is tensor-parallel rank r % tp of
pipeline stage r // tp; each stage's ranks form a tensor-parallel group, and the ranks of
one tensor-parallel index across the stages a pipeline group (layers/pipeline.py).

Every rank samples. The LM head gathers the whole logits on each rank, and the samplers are
seeded alike, so all draw the same tokens; each keeps them for the decode inputs it gathers
on its own device, and no step waits on a broadcast of tokens. Only rank 0's results
leave. Under pipeline stages only the last stage samples: its tensor-parallel rank 0 sends
its results to rank 0 down a pipe of their own, and rank 0 forwards them to the ranks of
the earlier stages with its next call (layers/pipeline.py).

A follower that dies takes the shard with it: with NCCL the others would wait in a
collective forever, so rank 0's process runs `on_lost` (the worker exits, and the launcher
starts the shard afresh). A follower whose rank 0 is gone exits too. At an orderly close
a follower exits with 0 as soon as it has made rank 0's last call (`leave_now`); after a
failed call rank 0 does not wait for its followers, which may wait in a collective that
it will never join.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import torch
import torch.distributed as dist

from common.messages import StepPlan, StepResult, decode, encode
from common.model_info import ResolvedModel
from common.net import free_port
from services.worker.layers.parallel import TPGroup, building_for
from services.worker.layers.pipeline import (PPStage, ResultPoster, building_stage,
                                             stage_layers)
from services.worker.model_runner import ModelRunner, resolve_device

log = logging.getLogger("headrace.worker")

SUBMIT, FLUSH, FORGET, RESULT = b"s", b"f", b"r", b"t"
RANK_LOST_EXIT = 4
GROUP_TIMEOUT = timedelta(minutes=10)  # joining, and any one collective
PARENT_CHECK_S = 0.2
CLOSE_TIMEOUT_S = 10.0

OnLost = Callable[[str], None]


def world_size(model: ResolvedModel) -> int:
    return model.config.tensor_parallel_size * model.config.pipeline_parallel_size


def join_group(rank: int, model: ResolvedModel, init_method: str, device: torch.device
               ) -> tuple[TPGroup, PPStage]:
    """Joins the world of ranks as `rank`; returns its tensor-parallel group and its
    pipeline stage. Every rank creates every subgroup, in the same order (as
    torch.distributed requires)."""
    world, tp = world_size(model), model.config.tensor_parallel_size
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:  # the ranks share the CPU's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=init_method, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    if world == tp:
        return TPGroup.of(dist.group.WORLD), PPStage()
    stages = world // tp
    index, tp_rank = divmod(rank, tp)
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) if tp > 1 else None
                 for s in range(stages)]
    pipelines = [list(range(t, world, tp)) for t in range(tp)]
    pp_groups = [dist.new_group(ranks) for ranks in pipelines]
    group = tp_groups[index]
    layers = stage_layers(model.hf_config.num_hidden_layers, stages, index)
    return (TPGroup.of(group) if group is not None else TPGroup(),
            PPStage(index, stages, layers, pipelines[tp_rank], pp_groups[tp_rank]))


def leave_group(group: TPGroup) -> None:
    """Tears the process group down, so that another can start in this process."""
    group.peer = None  # its symmetric buffers are the group's
    if dist.is_initialized():  # not if joining it failed
        dist.destroy_process_group()


def exit_on_rank_lost(reason: str) -> None:
    """The default `on_lost`: nothing can finish the shard's steps, so its process ends."""
    log.error("%s; the shard cannot go on without it, exiting", reason)
    logging.shutdown()
    os._exit(RANK_LOST_EXIT)


class Followers:
    """Rank 0's handle on ranks 1..N-1: their processes and the pipes to them."""

    def __init__(self, model: ResolvedModel, on_lost: OnLost = exit_on_rank_lost) -> None:
        world = world_size(model)
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.on_lost = on_lost
        self.closing = False
        spawn = multiprocessing.get_context("spawn")  # no CUDA state or threads inherited
        self.pipes: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        tp = model.config.tensor_parallel_size
        poster = world - tp if model.config.pipeline_parallel_size > 1 else None
        # the last stage's results, read by rank 0 (None without stages)
        self.results: Connection | None = None
        # the followers of the stages before the last, which take the results forwarded
        self.earlier: list[Connection] = []
        for rank in range(1, world):
            inbox, pipe = spawn.Pipe(duplex=False)
            outbox = None
            if rank == poster:
                self.results, outbox = spawn.Pipe(duplex=False)
            process = spawn.Process(target=follow, name=rank_name(rank, model), daemon=True,
                                    args=(rank, self.init_method, model, inbox,
                                          os.getpid(), outbox))
            process.start()
            inbox.close()  # the follower holds the only read end: our exit is its EOF
            if outbox is not None:
                outbox.close()  # its exit is the EOF of our results pipe
            self.pipes.append(pipe)
            if poster is not None and rank < poster:
                self.earlier.append(pipe)
            self.processes.append(process)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's own hook stops them

    def send(self, op: bytes, body: bytes = b"") -> None:
        for pipe in self.pipes:
            pipe.send_bytes(op + body)

    def submit(self, plan: StepPlan) -> None:
        self.send(SUBMIT, encode(plan))

    def forward(self, results: list[StepResult]) -> None:
        """The last stage's `results`, to the ranks of the stages before it."""
        for result in results:
            body = RESULT + encode(result)
            for pipe in self.earlier:
                pipe.send_bytes(body)

    def close(self, failed: bool = False) -> None:
        """An orderly end: each follower finishes its calls, reads EOF and exits (the
        process group is rank 0's to leave). After a call that `failed` on rank 0 the
        followers may wait in a collective that rank 0 left: they are killed at once."""
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.close)
        for pipe in self.pipes:
            pipe.close()
        if self.results is not None:
            self.results.close()
        deadline = time.monotonic() + (0.0 if failed else CLOSE_TIMEOUT_S)
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        dead = sentinels[wait(list(sentinels))[0]]
        if not self.closing:
            dead.join()
            self.on_lost(f"{dead.name} died (exit code {dead.exitcode})")


def rank_name(rank: int, model: ResolvedModel) -> str:
    tp = model.config.tensor_parallel_size
    if model.config.pipeline_parallel_size == 1:
        return f"tp-rank-{rank}"
    return f"pp-stage-{rank // tp}-tp-rank-{rank % tp}"


def follow(rank: int, init_method: str, model: ResolvedModel, inbox: Connection,
           parent: int, outbox: Connection | None = None) -> None:
    """A follower's life: join the group, build the rank's runner, then make rank 0's
    calls until its pipe closes. `outbox`: where the last stage posts its results."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: rank 0 ends us
    threading.Thread(target=exit_with, args=(parent,), name="parent-watch",
                     daemon=True).start()
    group, stage = join_group(rank, model, init_method, resolve_device(model.config))
    if outbox is not None:
        stage.outbox = ResultPoster(outbox)
    with building_for(group), building_stage(stage):
        # a draft model runs at one tensor-parallel rank only: a pipeline's last stage
        # builds it (the other stages leave it out)
        runner = ModelRunner(model.config, model.hf_config, model.model_dir, model.draft)
    while True:
        try:
            order = inbox.recv_bytes()
        except EOFError:  # rank 0 closed
            leave_now()
        op = order[:1]
        if op == SUBMIT:
            runner.submit(decode(order[1:]))
        elif op == FLUSH:
            runner.flush()
        elif op == FORGET:
            runner.forget_requests()
        elif op == RESULT:
            runner.take_forwarded(decode(order[1:]))


def leave_now() -> NoReturn:
    """A follower's end once rank 0 has closed: the process group is rank 0's to tear
    down, and the interpreter's own teardown is skipped: on a loaded CPU it was seen
    running for more than 8 s after the last call, past rank 0's wait (which then killed
    the follower), and with a gloo group still open it can abort
    (tests/test_tensor_parallel.py's rank helpers skip it for that reason)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def exit_with(parent: int) -> None:
    """Rank 0 may die inside a collective, where our pipe's EOF would never be read."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(RANK_LOST_EXIT)
