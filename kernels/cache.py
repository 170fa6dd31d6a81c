"""Writing a step's new K/V into the paged cache."""

from __future__ import annotations

import torch


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads,
    head_dim]; slot = block * block_size + offset, -1 skips the token (padding). The one
    dispatch point for this op."""
    write_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def write_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # flatten(0, 1) of a contiguous cache is a view, so the writes land in the cache
    k_cache.flatten(0, 1)[slots] = k[keep].to(k_cache.dtype)
    v_cache.flatten(0, 1)[slots] = v[keep].to(v_cache.dtype)
