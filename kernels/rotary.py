"""Rotary position embedding, neox style (the two halves of each head are rotated as pairs),
from a cos/sin cache indexed by position.

The cache is [max_position, head_dim]: cos of every frequency in the first half, sin in the
second. Supported frequency schemes: the default one and Llama 3's ("llama3"), which slows
the low frequencies by `factor` and blends the band between them and the high ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch

ROPE_TYPES = ("default", "llama3")


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """The float32 inverse frequencies, [head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = rope_type_of(scaling)
    if rope_type == "llama3":
        return llama3_inv_freq(inv_freq, scaling)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    return inv_freq


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # wavelengths longer than old_len / low_factor are slowed by factor, shorter than
    # old_len / high_factor are kept, and the band between is interpolated linearly in
    # old_len / wavelen
    blend = ((old_len / wavelen - low_factor) / (high_factor - low_factor)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float,
                       scaling: dict[str, Any] | None = None,
                       device: torch.device | None = None) -> torch.Tensor:
    """float32 [max_position, head_dim]: cos in the first half, sin in the second."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    positions = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]; returns the rotated
    (q, k) in their dtypes. The one dispatch point for this op."""
    return apply_rotary_ref(positions, q, k, cos_sin_cache)


def apply_rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # cos and sin are rounded to x's dtype first, as the reference models do
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
