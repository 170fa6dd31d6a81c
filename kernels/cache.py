"""Writing a step's new K/V into the paged cache.

An fp8 cache stores x / scale saturated to the format's range (one scale per layer for K and
one for V, device tensors of shape [1] so that captured CUDA graphs read the current value);
the attention multiplies it back. Caches of the model's dtype take no scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """k, v: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot = block * block_size + offset, -1 skips the token (padding); k_scale,
    v_scale: float32 [1], needed by fp8 caches. The one dispatch point for this op: CUDA
    tensors take the Triton kernel."""
    if k.is_cuda:
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x in the cache's dtype: divided by scale and saturated when the cache is fp8 (a plain
    cast would turn values past the range into NaN for e4m3)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    assert scale is not None, "an fp8 KV cache needs its scale"
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    if x.dtype not in FP8_DTYPES:
        return x.to(dtype)
    assert scale is not None, "an fp8 KV cache needs its scale"
    return (x.float() * scale).to(dtype)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # flatten(0, 1) of a contiguous cache is a view, so the writes land in the cache
    k_cache.flatten(0, 1)[slots] = quantize(k[keep], k_cache.dtype, k_scale)
    v_cache.flatten(0, 1)[slots] = quantize(v[keep], v_cache.dtype, v_scale)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """One program per token copies all its K and V heads (k and v may be strided views of
    the fused qkv output)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1
    fp8 = k_cache.dtype in FP8_DTYPES
    assert not fp8 or (k_scale is not None and v_scale is not None), "fp8 needs scales"
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k_scale if fp8 else k_cache,
        v_scale if fp8 else v_cache, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_kv_heads, HEADS=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        DIM_BLOCK=triton.next_power_of_2(head_dim),
        FP8=fp8, FP8_MAX=torch.finfo(k_cache.dtype).max if fp8 else 0.0, num_warps=4)


@triton.jit
def _quantize(x, scale_ptr, FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    if FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr,
                     v_scale_ptr, stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
                     FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding: nothing to read or write
        return
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, DIM_BLOCK)[None, :]  # a head_dim of no power of two: masked past it
    mask = (heads < num_kv_heads) & (dims < HEAD_DIM)
    cache_offsets = slot * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    k = _quantize(k, k_scale_ptr, FP8, FP8_MAX)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    v = _quantize(v, v_scale_ptr, FP8, FP8_MAX)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
