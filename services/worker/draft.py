"""The draft model of speculative decoding's draft_model method: a small model whose greedy
tokens the target verifies in the request's next step.

Its KV cache has as many blocks of the same size as the target's, and is addressed by the
same block tables and slot mappings, so the scheduler's one block allocation serves both.
Each step the draft first computes the target's own inputs (`sync`: prompt chunks, last
tokens and the drafts being verified), which keeps its KV equal to what its own prefill
would write at every position the target computed; KV at rejected drafts is overwritten
later, as the target's is. Then `propose` decodes k tokens greedily from the token each
request just sampled, at the position after its accepted ones (read on the device, so the
host does not wait for the verification). Those k positions lie in the k lookahead slots
the scheduler allocates beyond each step's tokens.
"""

from __future__ import annotations

import dataclasses

import torch

from common.config import EngineConfig
from common.model_info import DraftModel
from kernels.sampling import greedy_tokens
from services.worker.cuda_graphs import StepGraphs
from services.worker.layers.attention import AttentionMetadata, ForwardContext
from services.worker.loader import load_model
from services.worker.memory import kv_cache_bytes_per_block
from services.worker.models import kv_cache_shape


class DraftRunner:
    def __init__(self, config: EngineConfig, draft: DraftModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        spec = config.speculative()
        assert spec is not None and config.max_model_len is not None
        self.k = spec.num_speculative_tokens
        self.max_model_len = config.max_model_len
        self.block_size = config.block_size
        self.hf_config = draft.hf_config
        # The draft's KV cache stays in the model's dtype: an fp8 cache would need scales
        # of its own, and a small draft's cache is a small share of the memory.
        self.dtype, self.device = dtype, device
        # --quantization is the target's; a draft runs as its own config.json says
        self.model = load_model(dataclasses.replace(config, quantization=None),
                                draft.hf_config, device, dtype, draft.model_dir)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: StepGraphs | None = None

    def bytes_per_block(self) -> int:
        return kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype)

    def allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        shape = kv_cache_shape(self.hf_config, num_blocks, self.block_size, 1)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device))
                for _ in range(self.model.num_layers)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
                ) -> torch.Tensor:
        """The draft's hidden states, from a captured graph where one fits."""
        graphs = self.graphs if kv_caches is None else None
        key = None if graphs is None else graphs.key(attn, input_ids.shape[0])
        if key is not None:
            return graphs.run(key, input_ids, positions, attn)
        return self.model(input_ids, positions,
                          ForwardContext(attn, kv_caches or self.kv_caches))

    def sync(self, input_ids: torch.Tensor, positions: torch.Tensor,
             attn: AttentionMetadata) -> None:
        """Write the draft's KV for the step the target computes."""
        self.forward(input_ids, positions, attn)

    def propose(self, tokens: torch.Tensor, positions: torch.Tensor,
                block_tables: torch.Tensor, num_blocks: torch.Tensor,
                max_seq_len: int) -> torch.Tensor:
        """int64 [rows, k]: the greedy continuation of each row's `tokens` (the token it
        just sampled, at `positions`). block_tables and num_blocks (int64 [rows]): the
        rows' blocks. A position past max_model_len or its blocks writes nothing; such a
        row's later drafts are never used (the scheduler trims them)."""
        rows = tokens.shape[0]
        starts = torch.arange(rows + 1, dtype=torch.int32, device=tokens.device)
        capacity = torch.clamp(num_blocks * self.block_size, max=self.max_model_len)
        drafts = []
        for j in range(self.k):
            position = positions + j
            writable = position < capacity
            position = torch.minimum(position, capacity - 1)
            block = block_tables.gather(1, (position // self.block_size)[:, None])[:, 0]
            slots = torch.where(writable, block.long() * self.block_size
                                + position % self.block_size, -1)
            attn = AttentionMetadata(
                slot_mapping=slots, block_tables=block_tables, query_start_loc=starts,
                seq_lens=(position + 1).to(torch.int32), max_query_len=1,
                max_seq_len=min(max_seq_len + j + 1, self.max_model_len))
            hidden = self.forward(tokens, position, attn)
            tokens = greedy_tokens(self.model.greedy_logits(hidden))
            drafts.append(tokens)
        return torch.stack(drafts, dim=1)

    def capture_graphs(self, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        """Replay the draft's steps from CUDA graphs, as the target's (cuda_graphs.py)."""
        self.graphs = StepGraphs(self.model, self.kv_caches, max_num_seqs,
                                 max_num_batched_tokens, self.max_model_len, self.block_size)
        self.graphs.capture()
