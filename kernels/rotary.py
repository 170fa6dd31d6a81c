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
import triton
import triton.language as tl

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
    (q, k) in their dtypes. The one dispatch point for this op: CUDA tensors take the
    Triton kernel."""
    if q.is_cuda:
        return apply_rotary_triton(positions, q, k, cos_sin_cache)
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


def apply_rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        cos_sin_cache: torch.Tensor, q_out: torch.Tensor | None = None,
                        k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token rotates all its q and k heads (one cos/sin row read, one
    launch). q and k may be strided views of the fused qkv output; the results go to
    q_out and k_out, new contiguous tensors when None."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.is_contiguous()
    assert head_dim & (head_dim - 1) == 0 and cos_sin_cache.shape[1] == head_dim
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    assert q_out.is_contiguous() and k_out.is_contiguous()
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), num_heads, num_kv_heads,
        Q_HEADS=triton.next_power_of_2(num_heads), K_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, num_warps=4)
    return q_out, k_out


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, num_heads, num_kv_heads,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HALF: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.arange(0, HALF)
    row = cache_ptr + tl.load(positions_ptr + token) * (2 * HALF)
    cos = tl.load(row + cols)[None, :]
    sin = tl.load(row + HALF + cols)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * num_heads * 2 * HALF,
                  num_heads, cos, sin, Q_HEADS, HALF)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh,
                  k_out_ptr + token * num_kv_heads * 2 * HALF, num_kv_heads, cos, sin, K_HEADS,
                  HALF)


@triton.jit
def _rotate_heads(src_ptr, stride_h, dst_ptr, num_heads, cos, sin, HEADS: tl.constexpr,
                  HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    x1 = tl.load(src_ptr + heads * stride_h + cols, mask=mask, other=0.0)
    x2 = tl.load(src_ptr + heads * stride_h + HALF + cols, mask=mask, other=0.0)
    # rounded where the torch reference rounds (cos/sin to x's dtype, then each product,
    # then the sum), so low-precision results agree with it to the bit
    c, s = _round_like(cos, x1), _round_like(sin, x1)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = _round_like(a * c, x1) - _round_like(b * s, x1)
    out2 = _round_like(b * c, x1) + _round_like(a * s, x1)
    dst = dst_ptr + heads * (2 * HALF) + cols
    tl.store(dst, out1.to(x1.dtype), mask=mask)
    tl.store(dst + HALF, out2.to(x1.dtype), mask=mask)


@triton.jit
def _round_like(x, like):
    return x.to(like.dtype).to(tl.float32)
