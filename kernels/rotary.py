"""Rotary position embedding, neox style (the two halves of the rotated dims are rotated as
pairs), from a cos/sin cache indexed by position.

The cache is [max_position, rotary_dim]: cos of every frequency in the first half, sin in the
second, both multiplied by the scheme's attention factor (YaRN, LongRoPE) as transformers
multiplies its cos and sin. rotary_dim = head_dim * partial_rotary_factor: only the first
rotary_dim dims of each head rotate, the rest pass through unchanged (Phi-4-mini, some
Qwen/GLM configs); the cache's width says which, so the apply functions need nothing more.

The frequency schemes (`ROPE_TYPES`) follow transformers' `ROPE_INIT_FUNCTIONS`, with two
choices made so that one cache serves every request and CUDA graphs see fixed tensors:
- "dynamic" (NTK-aware): transformers recomputes the frequencies on each forward from the
  current sequence length once it exceeds max_position_embeddings. We fix them once, as vLLM
  does, at the length max_position * factor: sequences of any length get the frequencies
  transformers would use at that length (so short ones differ from transformers, which keeps
  the unscaled frequencies there).
- "longrope" (Phi-3 128k): transformers takes the short factors while the sequence is at most
  original_max_position_embeddings long and the long factors beyond. We take the long factors
  for every position when max_position_embeddings > original_max_position_embeddings (the
  context can exceed the original one, vLLM's rule) and the short ones otherwise. A
  Phi-3-128k config therefore rotates prompts shorter than 4096 tokens with the long factors,
  where transformers would use the short ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

# YaRN's defaults where a config gives no beta_fast / beta_slow (the paper's values)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type", scaling.get("type", "default"))


def rotary_dim_of(head_dim: int, scaling: dict[str, Any] | None) -> int:
    """The leading dims of each head that rotate."""
    factor = (scaling or {}).get("partial_rotary_factor") or 1.0
    return int(head_dim * factor)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None = None,
                  max_position: int | None = None) -> torch.Tensor:
    """The float32 inverse frequencies, [rotary_dim // 2]. max_position is the config's
    max_position_embeddings: "dynamic" needs it, as do "yarn" and "longrope" without a
    `factor`, and "longrope" to pick its factors."""
    rope_type = rope_type_of(scaling)
    if rope_type not in INV_FREQ_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {list(ROPE_TYPES)}")
    dim = rotary_dim_of(head_dim, scaling)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return INV_FREQ_FUNCTIONS[rope_type](exponents, theta, scaling or {}, max_position)


def default_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                     max_position: int | None) -> torch.Tensor:
    return 1.0 / (theta ** exponents)


def linear_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                    max_position: int | None) -> torch.Tensor:
    # dividing the frequencies by factor is dividing the positions by it
    return default_inv_freq(exponents, theta, scaling, max_position) / scaling["factor"]


def dynamic_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                     max_position: int | None) -> torch.Tensor:
    assert max_position, "dynamic RoPE needs max_position_embeddings"
    factor, dim = scaling["factor"], 2 * len(exponents)
    # NTK-aware: a larger base, as transformers computes it for a sequence of
    # max_position * factor tokens (see the module docstring)
    seq_len = max_position * factor
    base = theta * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
    return default_inv_freq(exponents, base, scaling, max_position)


def llama3_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                    max_position: int | None) -> torch.Tensor:
    inv_freq = default_inv_freq(exponents, theta, scaling, max_position)
    factor = scaling["factor"]
    low_factor, high_factor = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # wavelengths longer than old_len / low_factor are slowed by factor, shorter than
    # old_len / high_factor are kept, and the band between is interpolated linearly in
    # old_len / wavelen
    blend = ((old_len / wavelen - low_factor) / (high_factor - low_factor)).clamp(0.0, 1.0)
    return (1 - blend) * inv_freq / factor + blend * inv_freq


def scaled_factor(scaling: dict[str, Any], max_position: int | None) -> float:
    """YaRN's and LongRoPE's factor: the config's, else how far max_position_embeddings
    extends the original context (Phi-3 and DeepSeek-V3 configs leave it out)."""
    if scaling.get("factor") is not None:
        return scaling["factor"]
    assert max_position, "a factor-less YaRN or LongRoPE config needs max_position_embeddings"
    return max_position / scaling["original_max_position_embeddings"]


def yarn_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                  max_position: int | None) -> torch.Tensor:
    factor, dim = scaled_factor(scaling, max_position), 2 * len(exponents)
    original = scaling["original_max_position_embeddings"]
    # the frequency indices that turn beta_fast and beta_slow times over the original
    # context bound a linear ramp: faster frequencies keep their values (extrapolate),
    # slower ones are divided by factor (interpolate), the band between is blended
    low = yarn_dim_of_turns(scaling.get("beta_fast") or YARN_BETA_FAST, dim, theta, original)
    high = yarn_dim_of_turns(scaling.get("beta_slow") or YARN_BETA_SLOW, dim, theta, original)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp, without dividing by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    powers = theta ** exponents
    kept = 1 - ramp
    return 1.0 / (factor * powers) * (1 - kept) + 1.0 / powers * kept


def yarn_dim_of_turns(turns: float, dim: int, theta: float, original: int) -> float:
    """The (fractional) frequency index whose wavelength fits `turns` times into the
    original context."""
    return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))


def longrope_inv_freq(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                      max_position: int | None) -> torch.Tensor:
    assert max_position, "LongRoPE needs max_position_embeddings to pick its factors"
    long = max_position > scaling["original_max_position_embeddings"]
    key = "long_factor" if long else "short_factor"
    factors = torch.tensor(scaling[key], dtype=torch.float32)
    if factors.shape != exponents.shape:
        raise ValueError(f"LongRoPE {key} has {len(factors)} entries; the rotary dim "
                         f"{2 * len(exponents)} needs {len(exponents)}")
    return 1.0 / (factors * theta ** exponents)


INV_FREQ_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    "default": default_inv_freq, "linear": linear_inv_freq, "dynamic": dynamic_inv_freq,
    "yarn": yarn_inv_freq, "longrope": longrope_inv_freq, "llama3": llama3_inv_freq}
ROPE_TYPES = tuple(INV_FREQ_FUNCTIONS)


def rope_attention_factor(scaling: dict[str, Any] | None,
                          max_position: int | None = None) -> float:
    """What cos and sin are multiplied by: the config's attention_factor, else YaRN's
    0.1 ln(factor) + 1 (or its mscale / mscale_all_dim ratio) and LongRoPE's
    sqrt(1 + ln(factor) / ln(original context)); 1 for the other schemes."""
    rope_type = rope_type_of(scaling)
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = scaled_factor(scaling, max_position)
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(
            scaling["original_max_position_embeddings"]))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
    return yarn_mscale(factor, 1.0)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float,
                       scaling: dict[str, Any] | None = None,
                       device: torch.device | None = None,
                       num_positions: int | None = None) -> torch.Tensor:
    """float32 [num_positions, rotary_dim]: cos in the first half, sin in the second, both
    times the attention factor. max_position is the config's max_position_embeddings;
    num_positions (max_position when None) the rows, more where YaRN or dynamic NTK
    stretch the context past it."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, max_position).to(device)
    positions = torch.arange(num_positions or max_position, dtype=torch.float32,
                             device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    return cache * rope_attention_factor(scaling, max_position)


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
    rotary_dim = 2 * cos.shape[-1]
    x1, x2 = x[..., :rotary_dim].chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]), dim=-1)


def apply_rotary_triton(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        cos_sin_cache: torch.Tensor, q_out: torch.Tensor | None = None,
                        k_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token rotates all its q and k heads (one cos/sin row read, one
    launch). q and k may be strided views of the fused qkv output; the results go to
    q_out and k_out, new contiguous tensors when None."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos_sin_cache.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.is_contiguous()
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if q_out is None else q_out
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if k_out is None else k_out
    assert q_out.is_contiguous() and k_out.is_contiguous()
    half, pass_dims = rotary_dim // 2, head_dim - rotary_dim
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache, q_out, k_out, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), num_heads, num_kv_heads,
        Q_HEADS=triton.next_power_of_2(num_heads), K_HEADS=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HALF=half, HALF_BLOCK=triton.next_power_of_2(half),
        PASS_BLOCK=triton.next_power_of_2(pass_dims) if pass_dims else 0, num_warps=4)
    return q_out, k_out


@triton.jit
def _rotary_kernel(positions_ptr, q_ptr, k_ptr, cache_ptr, q_out_ptr, k_out_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, num_heads, num_kv_heads,
                   Q_HEADS: tl.constexpr, K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HALF: tl.constexpr, HALF_BLOCK: tl.constexpr, PASS_BLOCK: tl.constexpr):
    # HALF: half the rotary dims; HALF_BLOCK: HALF rounded up to a power of two;
    # PASS_BLOCK: the pass-through dims (HEAD_DIM - 2 * HALF) rounded up, 0 without any
    token = tl.program_id(0)
    cols = tl.arange(0, HALF_BLOCK)
    row = cache_ptr + tl.load(positions_ptr + token) * (2 * HALF)
    if HALF_BLOCK == HALF:  # the usual shapes: no column mask
        cos = tl.load(row + cols)[None, :]
        sin = tl.load(row + HALF + cols)[None, :]
    else:
        cos = tl.load(row + cols, mask=cols < HALF, other=0.0)[None, :]
        sin = tl.load(row + HALF + cols, mask=cols < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, q_out_ptr + token * num_heads * HEAD_DIM,
                  num_heads, cos, sin, Q_HEADS, HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh,
                  k_out_ptr + token * num_kv_heads * HEAD_DIM, num_kv_heads, cos, sin, K_HEADS,
                  HEAD_DIM, HALF, HALF_BLOCK, PASS_BLOCK)


@triton.jit
def _rotate_heads(src_ptr, stride_h, dst_ptr, num_heads, cos, sin, HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HALF_BLOCK: tl.constexpr,
                  PASS_BLOCK: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    cols = tl.arange(0, HALF_BLOCK)[None, :]
    mask = heads < num_heads
    if HALF_BLOCK != HALF:
        mask = mask & (cols < HALF)
    src = src_ptr + heads * stride_h + cols
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    # rounded where the torch reference rounds (cos/sin to x's dtype, then each product,
    # then the sum), so low-precision results agree with it to the bit
    c, s = _round_like(cos, x1), _round_like(sin, x1)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    out1 = _round_like(a * c, x1) - _round_like(b * s, x1)
    out2 = _round_like(b * c, x1) + _round_like(a * s, x1)
    dst = dst_ptr + heads * HEAD_DIM + cols
    tl.store(dst, out1.to(x1.dtype), mask=mask)
    tl.store(dst + HALF, out2.to(x1.dtype), mask=mask)
    if PASS_BLOCK > 0:  # partial rotary: the dims after the rotated ones are copied
        rest = 2 * HALF + tl.arange(0, PASS_BLOCK)[None, :]
        rest_mask = (heads < num_heads) & (rest < HEAD_DIM)
        x = tl.load(src_ptr + heads * stride_h + rest, mask=rest_mask)
        tl.store(dst_ptr + heads * HEAD_DIM + rest, x, mask=rest_mask)


@triton.jit
def _round_like(x, like):
    return x.to(like.dtype).to(tl.float32)
