"""Writing a step's new K/V into the paged cache."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot = block * block_size + offset, -1 skips the token (padding). The one
    dispatch point for this op: CUDA tensors take the Triton kernel."""
    if k.is_cuda:
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # flatten(0, 1) of a contiguous cache is a view, so the writes land in the cache
    k_cache.flatten(0, 1)[slots] = k[keep].to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = v[keep].to(v_cache.dtype)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """One program per token copies all its K and V heads (k and v may be strided views of
    the fused qkv output)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1 and head_dim & (head_dim - 1) == 0
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), num_kv_heads, HEADS=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, num_warps=4)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, num_kv_heads,
                     HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding: nothing to read or write
        return
    heads = tl.arange(0, HEADS)[:, None]
    dims = tl.arange(0, HEAD_DIM)[None, :]
    mask = heads < num_kv_heads
    cache_offsets = slot * num_kv_heads * HEAD_DIM + heads * HEAD_DIM + dims
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0)
    tl.store(k_cache_ptr + cache_offsets, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0)
    tl.store(v_cache_ptr + cache_offsets, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
