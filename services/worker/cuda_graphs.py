"""Decode steps replayed from CUDA graphs captured for a ladder of batch sizes.

A decode step of a small model is hundreds of tiny kernel launches; replaying a graph
issues them all at once. A step of n requests replays the smallest captured batch >= n:
its inputs are copied into the graph's static buffers, and the padding rows have context
length 0 and cache slot -1, so they attend to nothing and write nothing.
"""

from __future__ import annotations

import torch

from services.worker.layers.attention import AttentionMetadata, ForwardContext
from services.worker.models import CausalLM


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_batch (and max_batch itself)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 max_batch: int, max_model_len: int, block_size: int) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = capture_sizes(max_batch)
        self.max_model_len = max_model_len
        device = kv_caches[0][0].device
        max_blocks = -(-max_model_len // block_size)

        def ints(*shape: int, dtype=torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)
        self.input_ids = ints(max_batch, dtype=torch.int64)
        self.positions = ints(max_batch, dtype=torch.int64)
        self.slot_mapping = ints(max_batch, dtype=torch.int64)
        self.block_tables = ints(max_batch, max_blocks)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self.seq_lens = ints(max_batch)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's hidden states

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        self._pad_from(0)
        for size in reversed(self.sizes):  # largest first: later graphs reuse its memory
            self._forward(size)  # warm-up outside capture (compiles, allocates workspaces)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata) -> torch.Tensor:
        """The hidden states of a decode step of n <= max_batch requests."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.block_tables[:n, :attn.block_tables.shape[1]].copy_(attn.block_tables)
        self._pad_from(n, size)
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _pad_from(self, n: int, size: int | None = None) -> None:
        end = size or self.max_batch
        self.slot_mapping[n:end] = -1
        self.seq_lens[n:end] = 0

    def _forward(self, size: int) -> torch.Tensor:
        attn = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size],
                                 self.query_start_loc[:size + 1], self.seq_lens[:size],
                                 max_query_len=1, max_seq_len=self.max_model_len)
        return self.model(self.input_ids[:size], self.positions[:size],
                          ForwardContext(attn, self.kv_caches))
