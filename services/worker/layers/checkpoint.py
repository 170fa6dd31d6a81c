"""A checkpoint tensor as the weight loaders see it: its full shape is known up front and
its rows are read when a loader narrows it, so each tensor-parallel rank reads only its
own shard of a safetensors file. Loaders also take plain tensors (dummy weights, tests)."""

from __future__ import annotations

import torch


class CheckpointSlice:
    """One tensor of an open safetensors file, not yet read."""

    def __init__(self, lazy) -> None:  # safetensors' PySafeSlice
        self.lazy = lazy
        self.shape = torch.Size(lazy.get_shape())

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.lazy[index]

    def read(self) -> torch.Tensor:
        return self.lazy[...]  # [:] would refuse a 0-d tensor (a KV cache scale)


def read_whole(tensor: torch.Tensor | CheckpointSlice) -> torch.Tensor:
    return tensor.read() if isinstance(tensor, CheckpointSlice) else tensor
