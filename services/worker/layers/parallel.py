"""The tensor-parallel group: rank, size and the collectives the layers use.

A TPGroup is passed, not looked up: the layers built inside `building_for(group)` keep it
and communicate through its torch.distributed group only, so several groups (a pipeline's
stages) can live beside one another in one world. Outside any `building_for` a model is
built as rank 0 of 1, and its layers never communicate.

A decode step of a big model all-reduces a few kilobytes twice a layer, where the latency
of a call costs more than the data: on two H200s, about 9 us through NCCL inside a CUDA
graph (going by the step times with and without it) and 6.9 us through torch's one-shot
all-reduce over peer memory. On CUDA, messages of up to a CUDA-graphed step's rows go over
peer memory: the one-shot all-reduce for a bare one, and kernels/all_reduce.py for the one
after each row-parallel projection, fused with the residual add and RMSNorm that follow it.
`--disable-custom-all-reduce` turns both off (vLLM's name for its own such kernel). Larger
messages, and every message on the CPU, go through the group.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.all_reduce import MAX_PROGRAMS, all_reduce_rms_norm_triton
from kernels.norm import rms_norm

log = logging.getLogger(__name__)


class PeerAllReduce:
    """All-reduces through symmetric buffers every rank maps (torch's symm_mem): torch's
    one-shot kernel for a bare all-reduce, and kernels/all_reduce.py's for one fused with
    the residual add and RMSNorm. Each has its own buffer, as neither knows when a peer
    has finished reading the other's."""

    def __init__(self, group: dist.ProcessGroup, rows: int, hidden: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.hidden, self.half = hidden, rows * hidden
        self.buffer = symm_mem.empty(self.half, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

        def peer_addresses(tensor: torch.Tensor) -> torch.Tensor:
            handle = symm_mem.rendezvous(tensor, self.group_name)
            offset = tensor.data_ptr() - handle.buffer_ptrs[handle.rank]
            return torch.tensor([p + offset for p in handle.buffer_ptrs], dtype=torch.int64,
                                device=device)
        fused = symm_mem.empty(2 * self.half, dtype=dtype, device=device)
        flags = symm_mem.empty(MAX_PROGRAMS * self.world, dtype=torch.int64, device=device)
        flags.zero_()
        self.buffers, self.flags = peer_addresses(fused), peer_addresses(flags)
        self._symmetric = (fused, flags)  # the peers map them: they live as long as we do
        self.counters = torch.zeros(2, dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group)  # every rank's flags are zero before any rank signals

    def fits(self, x: torch.Tensor) -> bool:
        """The kernels read 16-byte vectors: a message must be whole ones."""
        return (x.dtype == self.buffer.dtype and x.numel() <= self.half
                and x.numel() * x.element_size() % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        part = self.buffer[:x.numel()]
        return torch.ops.symm_mem.one_shot_all_reduce_copy(
            part, x.contiguous().view(-1), "sum", self.group_name).view(x.shape)

    def fits_norm(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.shape[1] == self.hidden and self.fits(x)
                and x.is_contiguous() and residual.is_contiguous())

    def reduce_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return all_reduce_rms_norm_triton(x, residual, weight, eps, self.buffers, self.half,
                                          self.flags, self.counters, self.rank, self.world)


@dataclass(slots=True, eq=False)
class TPGroup:
    """One tensor-parallel group as its layers see it: this process's rank in it, its size,
    and the torch.distributed group its collectives go through (None for a group of one,
    which never communicates)."""
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    peer: PeerAllReduce | None = None  # small all-reduces over peer memory, once set up

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> TPGroup:
        """This process's place in `group`, a torch.distributed group it belongs to."""
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    def use_peer_all_reduce(self, rows: int, hidden: int, dtype: torch.dtype,
                            device: torch.device) -> bool:
        """Route all-reduces of up to `rows` rows of `hidden` elements of `dtype` through
        peer memory; False (and NCCL for everything) where symmetric memory cannot be set
        up."""
        assert self.group is not None, "a group of one reduces nothing"
        try:
            self.peer = PeerAllReduce(self.group, rows, hidden, dtype, device)
        except (RuntimeError, ImportError) as e:  # no P2P between the GPUs, an old torch
            log.warning("peer-memory all-reduce unavailable (%s); using NCCL for every size",
                        e)
            self.peer = None
        return self.peer is not None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.peer is not None and self.peer.fits(x):
            return self.peer(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_rms_norm(self, x: torch.Tensor, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """rms_norm(x summed over the ranks + residual): the end of a row-parallel
        projection whose reduction was left to the norm that follows it."""
        if self.peer is not None and self.peer.fits_norm(x, residual):
            return self.peer.reduce_norm(x, residual, weight, eps)
        return rms_norm(self.all_reduce(x), weight, eps, residual)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's x along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def max_over_ranks(self, x: torch.Tensor) -> torch.Tensor:
        """x, elementwise the largest over the ranks (in place)."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's `value` (a KV cache all ranks can hold)."""
        if self.size == 1:
            return value
        tensor = torch.tensor([value], device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return int(tensor.item())


# the group the layers built now belong to: set around a model's construction (as
# quantization.building_with sets their method) so that every model's code builds its
# layers unchanged; each layer keeps the group it was built in
_BUILDING: ContextVar[TPGroup] = ContextVar("tp_group", default=TPGroup())


def current_group() -> TPGroup:
    return _BUILDING.get()


@contextlib.contextmanager
def building_for(group: TPGroup) -> Iterator[TPGroup]:
    token = _BUILDING.set(group)
    try:
        yield group
    finally:
        _BUILDING.reset(token)


# For the runner's set-up (its KV cache size, its peer buffers), which the executor runs
# inside building_for, as it does the model's construction.
def tp_size() -> int:
    """The size of the group a model is being built for."""
    return current_group().size


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of the building group's ranks' `value`s."""
    return current_group().min_over_ranks(value, device)


def use_peer_all_reduce(rows: int, hidden: int, dtype: torch.dtype,
                        device: torch.device) -> bool:
    """TPGroup.use_peer_all_reduce for the group a model is being built for."""
    return current_group().use_peer_all_reduce(rows, hidden, dtype, device)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor parallel "
                         f"size ({denominator})")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: a share of them, or one replicated head when there are
    more ranks than KV heads."""
    if size >= total_num_kv_heads:
        divide(size, total_num_kv_heads, "tensor parallel size vs KV heads")
        return 1
    return divide(total_num_kv_heads, size, "number of KV heads")
