"""RMSNorm as a module; the fused residual add is the kernel's, and so, for a norm after a
row-parallel projection that left its reduction to it, the all-reduce. Gemma's weighting,
(1 + weight) in float32, is a flag (kernels/norm.py), and two Gemma norms around a residual
add run as one kernel (norm_add_norm)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import gemma_norm_add_norm, rms_norm
from kernels.norm_seam import ResidualSum, SeamNorm
from services.worker.layers.linear import Checkpoint, ShardShapes, copy_checked, new_parameter
from services.worker.layers.parallel import current_group


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, sums_ranks: bool = False,
                 gemma: bool = False) -> None:
        """sums_ranks: an x that comes with a residual is each rank's partial sum.
        gemma: Gemma's weighting."""
        super().__init__()
        # the fused all-reduce kernel has Llama's weighting only
        assert not (sums_ranks and gemma), "a Gemma norm takes reduced inputs"
        self.eps, self.sums_ranks, self.gemma = eps, sums_ranks, gemma
        self.tp = current_group()
        self.weight = new_parameter(hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        copy_checked(param.data, loaded_weight, "RMSNorm")

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        return {None: tuple(param.shape)}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.sums_ranks and residual is not None:
            return self.tp.all_reduce_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, residual, gemma=self.gemma)

    def seam(self, summed: ResidualSum) -> SeamNorm:
        """This norm of a residual sum, left to the projection that takes it (Llama's
        weighting, one rank: layers/norm_seam.py)."""
        assert not (self.gemma or (self.sums_ranks and self.tp.size > 1)), \
            "a norm seam has Llama's weighting and a reduced input"
        return SeamNorm(summed, self.weight, self.eps)


def norm_add_norm(x: torch.Tensor, residual: torch.Tensor, first: RMSNorm, second: RMSNorm
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """second(first(x), residual): (the normed sum, the sum), as one kernel (Gemma's seam
    after attention: post-attention norm, residual add, pre-feedforward norm)."""
    assert first.gemma and second.gemma and first.eps == second.eps, "Gemma's norms only"
    return gemma_norm_add_norm(x, residual, first.weight, second.weight, first.eps)
