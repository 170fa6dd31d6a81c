"""Linear layers split over the tensor-parallel group.

Column-parallel layers split their output features (no communication: each rank keeps its
slice of the activations); row-parallel layers split their input features and all-reduce
the partial sums. The fused layers (q/k/v, gate/up) lay their shards out per rank so that
one matmul serves all of them. What the matmul is, and which tensors it takes (a plain
weight, or 8-bit weights with their scales), is the layer's QuantMethod's
(layers/quantization); the layers shard every such tensor alike.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kernels.norm_seam import ResidualSum, SeamNorm
from services.worker.layers.checkpoint import CheckpointSlice, read_whole
from services.worker.layers.parallel import current_group, divide, kv_heads_per_rank
from services.worker.layers.quantization import current_method, quant_parameter
from services.worker.layers.quantization.base import ceil_div

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
    """A projection whose parameters its quantization method makes (the method in force
    where the model is built, see quantization.building_with) and whose weight_loader
    shards each of them along its output_dim / input_dim (quantization.quant_parameter)."""
    bias_in_matmul = True  # the matmul adds the bias (a row-parallel one adds it after)
    input_split = False  # the checkpoint's input features are split across ranks

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        """input_size, output_size: this rank's features."""
        super().__init__()
        self.tp = current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.input_size, self.output_size = input_size, output_size
        self.method = current_method()
        parts = [shard.size for shard in self.output_shards().values()]
        self.method.create_weights(self, input_size, parts, torch.get_default_dtype())
        self.bias = quant_parameter(torch.empty(self.output_size), output_dim=0,
                                    input_dim=None, loader=self.weight_loader) if bias else None

    @abc.abstractmethod
    def output_shards(self) -> dict[ShardId, OutputShard]:
        """Each shard id's place in this rank's output and in the checkpoint."""

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        """Copies this rank's shard of the full checkpoint tensor into param."""
        shards = self.output_shards()
        if shard_id is None and None not in shards:
            self.load_fused(param, loaded_weight, shards)
            return
        if shard_id not in shards:
            raise ValueError(f"{type(self).__name__}: shard id {shard_id!r} is not one of "
                             f"{list(shards)}")
        name = type(self).__name__ if shard_id is None else \
            f"{type(self).__name__}[{shard_id}]"
        if param.per_part:
            part = list(shards).index(shard_id)
            copy_checked(param.data[part], scalar(loaded_weight, name), name)
            return
        loaded_weight = self.input_shard(param, loaded_weight, name)
        if param.output_dim is None:
            copy_checked(param.data, loaded_weight, name)
            return
        dim, (offset, size, index, full) = param.output_dim, scaled(param, shards, shard_id)
        copy_checked(param.data.narrow(dim, offset, size),
                     take_shard(loaded_weight, dim, index, size, full, name), name)

    def input_shard(self, param: nn.Parameter, loaded_weight: Checkpoint,
                    name: str) -> Checkpoint:
        """This rank's input features of a row-parallel layer's parameter."""
        if not self.input_split or param.input_dim is None:
            return loaded_weight
        size = param.shape[param.input_dim]
        return take_shard(loaded_weight, param.input_dim, self.tp_rank, size,
                          size * self.tp_size, name)

    def load_fused(self, param: nn.Parameter, loaded_weight: Checkpoint,
                   shards: dict[ShardId, OutputShard]) -> None:
        """A checkpoint that stores the fused tensor itself (Phi-3's qkv_proj, [q; k; v]
        rows, and gate_up_proj, [gate; up]): each shard's rows of it, read lazily."""
        name = f"{type(self).__name__} (fused)"
        if param.per_part:  # one scale for the whole fused tensor serves every part
            param.data.copy_(scalar(loaded_weight, name).expand_as(param.data))
            return
        if param.output_dim is None:
            copy_checked(param.data, loaded_weight, name)
            return
        dim = param.output_dim
        places = [scaled(param, shards, shard_id) for shard_id in shards]
        total = sum(full for _, _, _, full in places)
        if loaded_weight.shape[dim] != total:
            raise ValueError(f"{name}: checkpoint tensor has shape "
                             f"{tuple(loaded_weight.shape)}, the model expects {total} along "
                             f"dimension {dim}; the weights do not match config.json")
        start = 0
        for offset, size, index, full in places:
            copy_checked(param.data.narrow(dim, offset, size),
                         loaded_weight.narrow(dim, start + index * size, size), name)
            start += full

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        """The full checkpoint tensor of each of param's shard ids, by its shape."""
        shards = self.output_shards()
        if param.per_part:
            return {shard_id: (1,) for shard_id in shards}
        shape = list(param.shape)
        if self.input_split and param.input_dim is not None:
            shape[param.input_dim] *= self.tp_size
        if param.output_dim is None:  # each fused part's checkpoint holds it whole (g_idx)
            return {shard_id: tuple(shape) for shard_id in shards}
        result = {}
        for shard_id in shards:
            shape[param.output_dim] = scaled(param, shards, shard_id)[3]
            result[shard_id] = tuple(shape)
        return result

    def forward(self, x: torch.Tensor | SeamNorm) -> torch.Tensor:
        """x W^T (+ bias); x a SeamNorm (layers/norm_seam.py decided the matmul takes it)
        is normed as the matmul loads it."""
        if isinstance(x, SeamNorm):
            return self.method.apply_seam(self, x, self.bias)
        return self.method.apply(self, x, self.bias)

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """What follows the matmul (a LoRA wrapper runs its own matmul, then this)."""
        return y


def scalar(loaded_weight: Checkpoint, name: str) -> torch.Tensor:
    """A per-tensor scale, whatever its checkpoint shape ([], [1] or [1, 1])."""
    value = read_whole(loaded_weight)
    if value.numel() != 1:
        raise ValueError(f"{name}: expected a one-element (per-tensor) checkpoint tensor, "
                         f"got shape {tuple(value.shape)}")
    return value.reshape(())


def scaled(param: nn.Parameter, shards: dict[ShardId, OutputShard], shard_id: ShardId
           ) -> tuple[int, int, int, int]:
    """(offset, size, index, full) of a shard along param's output_dim, where one element
    covers param.output_block output features: each fused part takes whole elements."""
    block = param.output_block
    offset = 0
    for other_id, shard in shards.items():
        if other_id == shard_id:
            if block > 1 and shard.full != shard.size and shard.size % block:
                raise ValueError(f"a rank's {shard.size} output features do not split into "
                                 f"whole blocks of {block}: use a smaller "
                                 "--tensor-parallel-size")
            return offset, ceil_div(shard.size, block), shard.index, ceil_div(shard.full, block)
        offset += ceil_div(shard.size, block)
    raise KeyError(shard_id)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, divide(output_size, current_group().size, "output size"),
                         bias)

    def output_shards(self) -> dict[ShardId, OutputShard]:
        size = self.output_size
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
        size = current_group().size
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
        super().__init__(divide(input_size, current_group().size, "input size"), output_size,
                         bias)
        assert reduce_results or not bias, "the bias goes on the reduced sum"
        self.reduce_results = reduce_results
        # set by a decoder layer whose next norm takes this output alone, on one rank: the
        # matmul may then leave the sum of a split K to that norm (QuantMethod.apply_unsummed)
        self.parts_to_norm = False

    input_split = True

    def output_shards(self) -> dict[ShardId, OutputShard]:
        """The output is whole on every rank."""
        return {None: OutputShard(0, self.output_size, 0, self.output_size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts_to_norm:
            return self.method.apply_unsummed(self, x)
        return self.finish(self.method.apply(self, x, None))

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> ResidualSum:
        """x W^T added to the residual stream in the matmul's epilogue, with the sum's
        squares for the norm that the next projection applies (layers/norm_seam.py
        decided it: one rank, no bias)."""
        return self.method.apply_seam(self, x, None, residual)

    def leave_parts_to_norm(self) -> None:
        """The next norm takes this output alone (kernels/norm.py adds parts up), which
        needs the sum over ranks and the bias left to it too: one rank, no bias."""
        self.parts_to_norm = not self.reduce_results and self.tp_size == 1

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums summed over the ranks, plus the bias (or left to the
        norm); a LoRA wrapper adds its partial delta before."""
        if not self.reduce_results:
            return y
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias
