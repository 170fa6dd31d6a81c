"""The gated activations of Llama-style MLPs as modules, chosen by the config's name."""

from __future__ import annotations

import torch
from torch import nn

from kernels.activation import gelu_tanh_and_mul, silu_and_mul


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


class GeluTanhAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu_tanh_and_mul(x)


# transformers' ACT2FN names
GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {"silu": SiluAndMul,
                                                  "gelu_pytorch_tanh": GeluTanhAndMul}


def gated_activation(name: str) -> nn.Module:
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {name!r}; supported: "
                         f"{', '.join(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]()
