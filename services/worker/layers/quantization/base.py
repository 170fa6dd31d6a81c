"""How a linear layer holds and multiplies its weights: a QuantMethod makes the layer's
parameters, fixes them up once the checkpoint is in, and runs y = x W^T (+ bias).

Each parameter carries what the layer's weight_loader needs to take its tensor-parallel
shard of a checkpoint tensor (see `quant_parameter`), so a new format only describes its
tensors; the layers shard them all alike.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gemv import gemv
from kernels.norm_seam import ResidualSum, SeamNorm


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def quant_parameter(tensor: torch.Tensor, *, output_dim: int | None, input_dim: int | None,
                    loader: Callable[..., None], pack_dim: int | None = None,
                    pack_factor: int = 1, output_block: int = 1, per_part: bool = False
                    ) -> nn.Parameter:
    """A parameter the layer's weight_loader shards along output_dim / input_dim (None: not
    split that way). Along output_dim one element covers `output_block` output features
    (a 128 x 128 block scale: 128) times pack_factor if the values are packed there (int4
    in int32: 8), so a fused part of s features takes ceil(s / that) elements. per_part:
    one element per fused part (a per-tensor scale of q, k and v each), filled from each
    part's one-element checkpoint tensor."""
    param = nn.Parameter(tensor, requires_grad=False)
    param.output_dim, param.input_dim = output_dim, input_dim
    param.pack_dim, param.pack_factor = pack_dim, pack_factor
    param.output_block = output_block * (pack_factor if pack_dim == output_dim else 1)
    param.per_part = per_part
    param.weight_loader = loader
    return param


class QuantMethod(abc.ABC):
    """One per model (it holds the format's settings, the layers hold the tensors)."""
    name: str

    @abc.abstractmethod
    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        """Register the layer's parameters for this rank's sizes: input_size per-rank
        input features, output_sizes each fused part's per-rank output features."""

    def process_after_loading(self, layer: nn.Module) -> None:
        """Repack or requantize once every checkpoint tensor is in."""

    @abc.abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        """y = x W^T (+ bias), for x [..., input_size]; no host syncs (CUDA graphs)."""

    def apply_unsummed(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x W^T for a projection whose output only a norm takes, which adds up parts in
        its load (RowParallelLinear.parts_to_norm): a matmul that splits K may return its
        partial sums [..., parts, N] and save the launch that adds them. Else apply's."""
        return self.apply(layer, x, None)

    def takes_seam(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """Whether apply_seam serves a step of activations like x (kernels/norm_seam.py)."""
        return False

    def apply_seam(self, layer: nn.Module, x: torch.Tensor | SeamNorm,
                   bias: torch.Tensor | None, add_to: torch.Tensor | None = None
                   ) -> torch.Tensor | ResidualSum:
        """apply's product with a norm seam: x a SeamNorm to norm as it loads, or add_to
        a residual to add the product to. Only where takes_seam said so."""
        raise NotImplementedError(f"{self.name}: no norm seam")


class UnquantizedMethod(QuantMethod):
    """Weights in the model's dtype, [out, in]: cuBLAS, or for steps of the row counts in
    layer.gemv_rows the 16-bit GEMV (kernels/gemv.py), which the worker sets where the
    kernel was timed faster on the device (layers/gemv_choice.py); the row count is a
    shape, so each CUDA-graph batch size captures one of them."""
    name = "none"

    def create_weights(self, layer: nn.Module, input_size: int, output_sizes: list[int],
                       dtype: torch.dtype) -> None:
        layer.weight = quant_parameter(torch.empty(sum(output_sizes), input_size, dtype=dtype),
                                       output_dim=0, input_dim=1, loader=layer.weight_loader)
        layer.gemv_rows = range(0)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
        if x.numel() // x.shape[-1] in layer.gemv_rows:
            return gemv(x, layer.weight, bias)
        return F.linear(x, layer.weight, bias)

    def takes_seam(self, layer: nn.Module, x: torch.Tensor) -> bool:
        """One row where that row takes the GEMV."""
        return x.numel() == x.shape[-1] and 1 in layer.gemv_rows

    def apply_seam(self, layer: nn.Module, x: torch.Tensor | SeamNorm,
                   bias: torch.Tensor | None, add_to: torch.Tensor | None = None
                   ) -> torch.Tensor | ResidualSum:
        return gemv(x, layer.weight, bias, add_to)
