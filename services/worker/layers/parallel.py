"""The tensor-parallel group: rank, size and the two collectives the layers use.

Without an initialized torch.distributed process group a model runs as rank 0 of 1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenates every rank's x along the last dimension, in rank order."""
    size = tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (a KV cache all ranks can hold)."""
    if tp_size() == 1:
        return value
    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by the tensor parallel "
                         f"size ({denominator})")
    return numerator // denominator


def kv_heads_per_rank(total_num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: a share of them, or one replicated head when there are
    more ranks than KV heads."""
    if size >= total_num_kv_heads:
        divide(size, total_num_kv_heads, "tensor parallel size vs KV heads")
        return 1
    return divide(total_num_kv_heads, size, "number of KV heads")
