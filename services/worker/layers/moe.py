"""Mixture-of-experts layers: the router's top-k choice and every expert's weights in two
stacked tensors for kernels/moe.py.

Tensor parallelism splits each expert's intermediate dimension, as a dense MLP splits
its own: a rank holds its rows of every expert's gate and up projections and the matching
columns of its down projection, so its output is a partial sum. Like a row-parallel
projection without a bias, FusedMoE leaves that sum to the RMSNorm after it
(`sums_ranks`). Experts are never spread over ranks (no expert parallelism).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.moe import select_experts
from services.worker.layers.linear import (Checkpoint, copy_checked, new_parameter, scalar,
                                           take_shard)
from services.worker.layers.parallel import current_group, divide
from services.worker.layers.quantization import (UnquantizedMethod, current_method,
                                                 experts_method_for)
from services.worker.layers.quantization.base import ceil_div
from services.worker.layers.quantization.experts import GATE_UP

# a checkpoint tensor of one expert: (expert index, "gate" | "up" | "down")
ExpertShard = tuple[int, str]


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank (the router and Qwen2-MoE's shared expert
    gate: a few rows that every rank needs in full). Decode-sized steps may take the
    16-bit GEMV where the worker's start-up timing found it faster (gemv_choice.py)."""
    bias, bias_in_matmul = None, False

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size, loader=self.weight_loader)
        self.method = UnquantizedMethod()  # its apply: cuBLAS or the chosen GEMV
        self.gemv_rows = range(0)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        copy_checked(param.data, loaded_weight, "ReplicatedLinear")

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[None, tuple[int, ...]]:
        return {None: tuple(param.shape)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)


class FusedMoE(nn.Module):
    """Routed experts' gated SiLU MLPs: w13 [E, 2 * I/tp, H] (this rank's gate rows, then
    its up rows), w2 [E, H, I/tp], in the model's dtype or fp8 with scales: the experts'
    counterpart of the model's quantization method (quantization/experts.py) makes them.
    forward returns this rank's partial sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, round_weights: bool) -> None:
        """renormalize: the k routing weights are divided by their sum. round_weights: they
        are rounded to the activation dtype before use (Qwen MoE; Mixtral keeps float32)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.round_weights = renormalize, round_weights
        group = current_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.intermediate_full = intermediate_size
        self.shard = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.method = experts_method_for(current_method())
        self.method.create_weights(self, num_experts, hidden_size, self.shard,
                                   torch.get_default_dtype())
        # distinct experts read, summed over calls: benchmarks count the weights a run
        # really read (updated on the device, inside CUDA graphs too)
        self.register_buffer("experts_read", torch.zeros(1, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, sum_slots: bool = True
                ) -> torch.Tensor:
        """sum_slots=False: the k weighted terms [T, k, H] for the next norm to add up."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize,
                                      self.round_weights)
        return self.method.apply(self, x, weights, ids, sum_slots)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The tensors stacked by expert (weights and their scales): a step reads an
        expert's slice of each only if it routes a token there."""
        return [p for p in self.parameters() if p.ndim == 3]  # [E, rows, cols]

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id: ExpertShard) -> None:
        """One expert's checkpoint tensor of one part into its slice of param: gate's and
        up's rows of w13 (or their scales), or down's, this rank's intermediate features
        of it taken along param.split_dim."""
        expert, which = shard_id
        name = f"FusedMoE[{expert}, {which}]"
        dst = param.data[expert]
        if param.per_part:  # a per-tensor scale
            copy_checked(dst[param.parts.index(which)], scalar(loaded_weight, name), name)
            return
        if param.split_dim is None:
            copy_checked(dst, loaded_weight, name)
            return
        size = ceil_div(self.shard, param.block)
        full = ceil_div(self.intermediate_full, param.block)
        if param.parts == GATE_UP:  # gate's rows, then up's
            dst = dst.narrow(0, param.parts.index(which) * size, size)
        copy_checked(dst, take_shard(loaded_weight, param.split_dim, self.tp_rank, size,
                                     full, name), name)

    def checkpoint_shapes(self, param: nn.Parameter
                          ) -> dict[ExpertShard, tuple[int, ...]]:
        """Each expert's checkpoint tensor of each part param takes, by its shape."""
        shape = list(param.shape[1:])
        if param.per_part:
            shape = [1]
        elif param.split_dim is not None:
            shape[param.split_dim] = ceil_div(self.intermediate_full, param.block)
        return {(e, which): tuple(shape) for e in range(self.num_experts)
                for which in param.parts}
