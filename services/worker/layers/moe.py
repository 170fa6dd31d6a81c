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
import torch.nn.functional as F
from torch import nn

from kernels.moe import fused_moe, select_experts
from services.worker.layers.linear import (Checkpoint, copy_checked, new_parameter,
                                           take_shard)
from services.worker.layers.parallel import divide, tp_rank, tp_size

# a checkpoint tensor of one expert: (expert index, "gate" | "up" | "down")
ExpertShard = tuple[int, str]


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every rank (the router and Qwen2-MoE's shared expert
    gate: a few rows that every rank needs in full)."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = new_parameter(output_size, input_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        copy_checked(param.data, loaded_weight, "ReplicatedLinear")

    def checkpoint_shapes(self, param: nn.Parameter) -> dict[None, tuple[int, ...]]:
        return {None: tuple(param.shape)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """Routed experts' gated SiLU MLPs: w13 [E, 2 * I/tp, H] (this rank's gate rows, then
    its up rows), w2 [E, H, I/tp]. forward returns this rank's partial sum."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int,
                 intermediate_size: int, renormalize: bool, round_weights: bool) -> None:
        """renormalize: the k routing weights are divided by their sum. round_weights: they
        are rounded to the activation dtype before use (Qwen MoE; Mixtral keeps float32)."""
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.round_weights = renormalize, round_weights
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.intermediate_full = intermediate_size
        shard = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.w13 = new_parameter(num_experts, 2 * shard, hidden_size, loader=self.weight_loader)
        self.w2 = new_parameter(num_experts, hidden_size, shard, loader=self.weight_loader)
        # distinct experts read, summed over calls: benchmarks count the weights a run
        # really read (updated on the device, inside CUDA graphs too)
        self.register_buffer("experts_read", torch.zeros(1, dtype=torch.int64),
                             persistent=False)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize,
                                      self.round_weights)
        return fused_moe(x, self.w13, self.w2, weights, ids, self.experts_read)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id: ExpertShard) -> None:
        expert, which = shard_id
        size = self.w2.shape[2]
        name = f"FusedMoE[{expert}, {which}]"
        if which == "down":  # [H, I]: this rank's columns
            copy_checked(param.data[expert], take_shard(loaded_weight, 1, self.tp_rank, size,
                                                        self.intermediate_full, name), name)
            return
        offset = {"gate": 0, "up": size}[which]
        copy_checked(param.data[expert].narrow(0, offset, size),
                     take_shard(loaded_weight, 0, self.tp_rank, size, self.intermediate_full,
                                name), name)

    def checkpoint_shapes(self, param: nn.Parameter
                          ) -> dict[ExpertShard, tuple[int, int]]:
        hidden, full = self.w2.shape[1], self.intermediate_full
        if param is self.w2:
            return {(e, "down"): (hidden, full) for e in range(self.num_experts)}
        return {(e, which): (full, hidden) for e in range(self.num_experts)
                for which in ("gate", "up")}
