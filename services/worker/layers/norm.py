"""RMSNorm as a module; the fused residual add is the kernel's."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import rms_norm
from services.worker.layers.linear import Checkpoint, ShardShapes, copy_checked, new_parameter


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = new_parameter(hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        copy_checked(param.data, loaded_weight, "RMSNorm")

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        return {None: tuple(param.shape)}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)
