"""Rotary embedding as a module, configured from a Hugging Face config."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.model_files import max_model_len_of
from kernels.rotary import apply_rotary, rope_cos_sin_cache, rope_type_of, rotate

DEFAULT_ROPE_THETA = 10000.0
# the schemes whose parameters include the pretraining context length
NEEDS_ORIGINAL_LENGTH = ("llama3", "yarn", "longrope")


def rope_settings(hf_config, layer_type: str | None = None
                  ) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling parameters or None) of the layers of `layer_type` ("sliding_attention",
    "full_attention"); None where every layer shares one scheme. transformers 5 keeps both
    in `rope_parameters`, nested by layer type where they differ (Gemma 3); older configs
    have `rope_theta` and `rope_scaling`. The parameters are standardized here too, since a
    --rope-scaling override reaches them after transformers' standardization."""
    params = layer_params(getattr(hf_config, "rope_parameters", None), layer_type)
    if params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", DEFAULT_ROPE_THETA))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = getattr(hf_config, "rope_theta", None) or DEFAULT_ROPE_THETA
        old = getattr(hf_config, "rope_scaling", None)
        scaling = dict(old) if old else None
    return float(theta), standardized(scaling, hf_config)


def standardized(scaling: dict[str, Any] | None, hf_config) -> dict[str, Any] | None:
    """The scaling parameters with a config-level partial_rotary_factor joined and, where
    the scheme needs one, the original context length (the config's, else
    max_position_embeddings), as transformers standardizes them on load."""
    partial = getattr(hf_config, "partial_rotary_factor", None)
    if partial is not None:
        scaling = {"partial_rotary_factor": partial, **(scaling or {})}
    original = (getattr(hf_config, "original_max_position_embeddings", None)
                or getattr(hf_config, "max_position_embeddings", None))
    if scaling is not None and rope_type_of(scaling) in NEEDS_ORIGINAL_LENGTH and original:
        scaling.setdefault("original_max_position_embeddings", original)
    return scaling


def layer_params(params: dict[str, Any] | None, layer_type: str | None
                 ) -> dict[str, Any] | None:
    """The rope parameters of one layer type: the nested entry where the config has one
    per type, else the shared ones."""
    nested = [key for key, value in (params or {}).items() if isinstance(value, dict)]
    if not nested:
        return params
    assert params is not None
    if layer_type not in nested:
        raise ValueError(f"the config's rope_parameters are per layer type ({nested}); "
                         f"got layer_type={layer_type!r}")
    return params[layer_type]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None,
                 num_positions: int | None = None) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache",
                             rope_cos_sin_cache(head_dim, max_position, theta, scaling,
                                                num_positions=num_positions),
                             persistent=False)

    @classmethod
    def from_config(cls, hf_config, head_dim: int,
                    layer_type: str | None = None) -> RotaryEmbedding:
        """One cache for the layers of `layer_type` (None: for every layer)."""
        theta, scaling = rope_settings(hf_config, layer_type)
        # a row for every position the context may reach (common.model_files)
        return cls(head_dim, hf_config.max_position_embeddings, theta, scaling,
                   max_model_len_of(hf_config))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]; only the first
        rotary_dim dims of each head rotate where the config has a partial_rotary_factor."""
        return apply_rotary(positions, q, k, self.cos_sin_cache)


class MRotaryEmbedding(RotaryEmbedding):
    """Qwen2-VL's multimodal rotary embedding (M-RoPE): each token has three positions
    (time, height, width; equal for text), and the rotated dims are split in sections
    (`mrope_section`, in pairs) that take their angles from one of the three in turn."""

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None,
                 num_positions: int | None = None) -> None:
        super().__init__(head_dim, max_position, theta, scaling, num_positions)
        sections = list((scaling or {})["mrope_section"])
        # the axis (0 time, 1 height, 2 width) each frequency takes its position from
        self.register_buffer("axis_of_freq", torch.repeat_interleave(
            torch.arange(len(sections)) % 3, torch.tensor(sections)), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [3, T], or [T] for text alone (every axis the same)."""
        if positions.ndim == 1:
            return super().forward(positions, q, k)
        cos, sin = self.cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [3, T, half]
        assert cos.shape[-1] == self.axis_of_freq.numel(), "mrope_section must cover half a head"
        index = self.axis_of_freq[None, None, :].expand(1, *cos.shape[1:])
        cos, sin = cos.gather(0, index)[0], sin.gather(0, index)[0]
        return rotate(q, cos, sin), rotate(k, cos, sin)
