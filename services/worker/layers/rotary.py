"""Rotary embedding as a module, configured from a Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels.rotary import apply_rotary, rope_cos_sin_cache

DEFAULT_ROPE_THETA = 10000.0


def rope_settings(hf_config, layer_type: str | None = None
                  ) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling parameters or None). transformers 5 keeps both in
    `rope_parameters`, nested by layer type where the types differ (Gemma 3); older
    configs have `rope_theta` and `rope_scaling`."""
    params = getattr(hf_config, "rope_parameters", None)
    if params and layer_type in params:
        params = params[layer_type]
    if params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", DEFAULT_ROPE_THETA))
        return float(theta), dict(params)
    theta = getattr(hf_config, "rope_theta", None) or DEFAULT_ROPE_THETA
    scaling = getattr(hf_config, "rope_scaling", None)
    return float(theta), dict(scaling) if scaling else None


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache",
                             rope_cos_sin_cache(head_dim, max_position, theta, scaling),
                             persistent=False)

    @classmethod
    def from_config(cls, hf_config, head_dim: int, layer_type: str | None = None
                    ) -> RotaryEmbedding:
        """layer_type: the layers' entry of a nested `rope_parameters`, if it has one."""
        theta, scaling = rope_settings(hf_config, layer_type)
        return cls(head_dim, hf_config.max_position_embeddings, theta, scaling)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)
