"""Linear layers split over the tensor-parallel group.

Column-parallel layers split their output features (no communication: each rank keeps its
slice of the activations); row-parallel layers split their input features and all-reduce
the partial sums. The fused layers (q/k/v, gate/up) lay their shards out per rank so that
one matmul serves all of them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.checkpoint import CheckpointSlice, read_whole
from services.worker.layers.parallel import (all_reduce, divide, kv_heads_per_rank, tp_rank,
                                              tp_size)

Checkpoint = torch.Tensor | CheckpointSlice
ShardId = str | int | None
ShardShapes = dict[ShardId, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class OutputShard:
    """Where one shard id's rows sit on this rank: `size` rows at `offset` in its output,
    which are block `index` (of `size` rows) of the checkpoint tensor's `full` rows. LoRA's
    B weights split the same way."""
    offset: int
    size: int
    index: int
    full: int


def copy_checked(dst: torch.Tensor, src: Checkpoint, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{name}: checkpoint shard has shape {tuple(src.shape)}, the model "
                         f"expects {tuple(dst.shape)}; the weights do not match config.json")
    dst.copy_(read_whole(src))


def take_shard(loaded: Checkpoint, dim: int, index: int, size: int, full: int,
               name: str) -> torch.Tensor:
    """Shard `index` of `size` rows along `dim` of a checkpoint tensor that must have
    `full` rows there."""
    if loaded.ndim <= dim or loaded.shape[dim] != full:
        raise ValueError(f"{name}: checkpoint tensor has shape {tuple(loaded.shape)}, the "
                         f"model expects {full} along dimension {dim}; the weights do not "
                         "match config.json")
    return loaded.narrow(dim, index * size, size)


def new_parameter(*shape: int, loader: Callable[..., None]) -> nn.Parameter:
    """An uninitialized parameter on the current default device and dtype."""
    param = nn.Parameter(torch.empty(*shape), requires_grad=False)
    param.weight_loader = loader
    return param


class LinearBase(nn.Module, abc.ABC):
    bias_in_matmul = True  # the matmul adds the bias (a row-parallel one adds it after)

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.weight = new_parameter(output_size, input_size, loader=self.weight_loader)
        self.bias = new_parameter(output_size, loader=self.weight_loader) if bias else None

    @abc.abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        """Copies this rank's shard of the full checkpoint tensor into param."""

    @abc.abstractmethod
    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        """The full checkpoint tensor of each of param's shard ids, by its shape."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the matmul (a LoRA wrapper runs its own matmul, then this)."""
        return y


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, tp_size(), "output size"), bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        shards = self.output_shards()
        if shard_id is None and None not in shards:
            self.load_fused(param, loaded_weight, shards)
            return
        if shard_id not in shards:
            raise ValueError(f"{type(self).__name__}: shard id {shard_id!r} is not one of "
                             f"{list(shards)}")
        shard = shards[shard_id]
        name = type(self).__name__ if shard_id is None else \
            f"{type(self).__name__}[{shard_id}]"
        copy_checked(param.data.narrow(0, shard.offset, shard.size),
                     take_shard(loaded_weight, 0, shard.index, shard.size, shard.full, name),
                     name)

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        return {shard_id: (shard.full, *param.shape[1:])
                for shard_id, shard in self.output_shards().items()}

    def load_fused(self, param: nn.Parameter, loaded_weight: Checkpoint,
                   shards: dict[ShardId, OutputShard]) -> None:
        """A checkpoint that stores the fused tensor itself (Phi-3's qkv_proj, [q; k; v]
        rows, and gate_up_proj, [gate; up]): each shard's rows of it, read lazily."""
        name = f"{type(self).__name__} (fused)"
        total = sum(shard.full for shard in shards.values())
        if loaded_weight.shape[0] != total:
            raise ValueError(f"{name}: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, the model expects {total} rows; "
                             "the weights do not match config.json")
        start = 0
        for shard in shards.values():
            copy_checked(param.data.narrow(0, shard.offset, shard.size),
                         loaded_weight.narrow(0, start + shard.index * shard.size, shard.size),
                         name)
            start += shard.full

    def output_shards(self) -> dict[ShardId, OutputShard]:
        """Each shard id's place in this rank's output and in the checkpoint."""
        size = self.weight.shape[0]
        return {None: OutputShard(0, size, self.tp_rank, size * self.tp_size)}


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up: shard ids 0 and 1)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)

    def output_shards(self) -> dict[ShardId, OutputShard]:
        sizes = [divide(s, self.tp_size, "output size") for s in self.output_sizes]
        return {i: OutputShard(sum(sizes[:i]), size, self.tp_rank, full)
                for i, (size, full) in enumerate(zip(sizes, self.output_sizes))}


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection (shard ids "q", "k", "v"). Each rank holds its query heads and
    their KV heads; with more ranks than KV heads, each KV head is replicated."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int,
                 total_num_kv_heads: int, bias: bool = False) -> None:
        size = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(total_num_heads, size, "number of attention heads")
        self.num_kv_heads = kv_heads_per_rank(total_num_kv_heads, size)
        self.total_num_kv_heads = total_num_kv_heads
        self.kv_replicas = max(1, size // total_num_kv_heads)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim * size
        super().__init__(hidden_size, output_size, bias)

    def output_shards(self) -> dict[ShardId, OutputShard]:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        # replicas of a KV head all read the same block of the checkpoint
        kv_rank, kv_full = self.tp_rank // self.kv_replicas, self.total_num_kv_heads * self.head_dim
        return {"q": OutputShard(0, q_size, self.tp_rank, q_size * self.tp_size),
                "k": OutputShard(q_size, kv_size, kv_rank, kv_full),
                "v": OutputShard(q_size + kv_size, kv_size, kv_rank, kv_full)}


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split across ranks; the partial sums are
    all-reduced, then the (unsplit) bias is added. Without a bias the reduction may be left
    to the norm that takes y (`reduce_results=False`, RMSNorm's `sums_ranks`), which fuses
    it with the residual add."""

    bias_in_matmul = False

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True) -> None:
        super().__init__(divide(input_size, tp_size(), "input size"), output_size, bias)
        assert reduce_results or not bias, "the bias goes on the reduced sum"
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        if param.ndim == 1:  # the bias is whole on every rank
            copy_checked(param.data, loaded_weight, "RowParallelLinear bias")
            return
        size = param.shape[1]
        copy_checked(param.data, take_shard(loaded_weight, 1, self.tp_rank, size,
                                            size * self.tp_size, "RowParallelLinear"),
                     "RowParallelLinear")

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        if param.ndim == 1:
            return {None: tuple(param.shape)}
        return {None: (param.shape[0], param.shape[1] * self.tp_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(F.linear(x, self.weight))

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums summed over the ranks, plus the bias (or left to the
        norm); a LoRA wrapper adds its partial delta before."""
        if not self.reduce_results:
            return y
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
