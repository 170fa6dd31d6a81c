"""Tensor-parallel ranks: one torch.distributed group (NCCL on CUDA, gloo on the CPU) whose
rank 0 lives in the process that drives the executor (the worker, or the offline engine).
Rank 0 starts a follower process for every further rank. Each rank builds the same
ModelRunner on its own device and runs the same calls in the same order: rank 0 forwards
each executor call down a pipe to the followers before making it itself.

Every rank samples. The LM head gathers the whole logits on each rank, and the samplers are
seeded alike, so all draw the same tokens; each keeps them for the decode inputs it gathers
on its own device, and no step waits on a broadcast of tokens. Only rank 0's results
leave.

A follower that dies takes the shard with it: with NCCL the others would wait in a
collective forever, so rank 0's process runs `on_lost` (the worker exits, and the launcher
starts the shard afresh). A follower whose rank 0 is gone exits too.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from common.messages import StepPlan, decode, encode
from common.model_info import ResolvedModel
from common.net import free_port
from services.worker.layers.parallel import TPGroup, building_for
from services.worker.model_runner import ModelRunner, resolve_device

log = logging.getLogger("headrace.worker")

SUBMIT, FLUSH, FORGET = b"s", b"f", b"r"
RANK_LOST_EXIT = 4
GROUP_TIMEOUT = timedelta(minutes=10)  # joining, and any one collective
PARENT_CHECK_S = 0.2
CLOSE_TIMEOUT_S = 10.0

OnLost = Callable[[str], None]


def join_group(rank: int, world: int, init_method: str, device: torch.device) -> TPGroup:
    """Joins the process group of `world` ranks as `rank`: the tensor-parallel group."""
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    else:  # the ranks share the CPU's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=init_method, rank=rank, world_size=world,
                            timeout=GROUP_TIMEOUT)
    return TPGroup.of(dist.group.WORLD)


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
        world = model.config.tensor_parallel_size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.on_lost = on_lost
        self.closing = False
        spawn = multiprocessing.get_context("spawn")  # no CUDA state or threads inherited
        self.pipes: list[Connection] = []
        self.processes: list[multiprocessing.process.BaseProcess] = []
        for rank in range(1, world):
            inbox, pipe = spawn.Pipe(duplex=False)
            process = spawn.Process(target=follow, name=f"tp-rank-{rank}", daemon=True,
                                    args=(rank, world, self.init_method, model, inbox,
                                          os.getpid()))
            process.start()
            inbox.close()  # the follower holds the only read end: our exit is its EOF
            self.pipes.append(pipe)
            self.processes.append(process)
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        atexit.register(self.close)  # before multiprocessing's own hook stops them

    def send(self, op: bytes, body: bytes = b"") -> None:
        for pipe in self.pipes:
            pipe.send_bytes(op + body)

    def submit(self, plan: StepPlan) -> None:
        self.send(SUBMIT, encode(plan))

    def close(self) -> None:
        """An orderly end: each follower finishes its calls, reads EOF and exits (the
        process group is rank 0's to leave)."""
        if self.closing:
            return
        self.closing = True
        atexit.unregister(self.close)
        for pipe in self.pipes:
            pipe.close()
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()

    def _watch(self) -> None:
        sentinels = {p.sentinel: p for p in self.processes}
        dead = sentinels[wait(list(sentinels))[0]]
        if not self.closing:
            dead.join()
            self.on_lost(f"tensor-parallel {dead.name} died (exit code {dead.exitcode})")


def follow(rank: int, world: int, init_method: str, model: ResolvedModel,
           inbox: Connection, parent: int) -> None:
    """A follower's life: join the group, build the rank's runner, then make rank 0's
    calls until its pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: rank 0 ends us
    threading.Thread(target=exit_with, args=(parent,), name="parent-watch",
                     daemon=True).start()
    with building_for(join_group(rank, world, init_method, resolve_device(model.config))):
        runner = ModelRunner(model.config, model.hf_config, model.model_dir)
    while True:
        try:
            order = inbox.recv_bytes()
        except EOFError:
            return
        op = order[:1]
        if op == SUBMIT:
            runner.submit(decode(order[1:]))
        elif op == FLUSH:
            runner.flush()
        elif op == FORGET:
            runner.forget_requests()


def exit_with(parent: int) -> None:
    """Rank 0 may die inside a collective, where our pipe's EOF would never be read."""
    while os.getppid() == parent:
        time.sleep(PARENT_CHECK_S)
    os._exit(RANK_LOST_EXIT)
