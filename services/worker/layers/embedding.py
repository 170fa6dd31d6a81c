"""The token embedding and the LM head, both split over the vocabulary.

Each rank holds ceil(vocab / tp_size) rows; the last rank's rows past the vocabulary are
padding that no token id reaches and whose logits are cut off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import Checkpoint, ShardShapes, copy_checked, new_parameter
from services.worker.layers.parallel import current_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 shared_weight: nn.Parameter | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = current_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = shared_weight if shared_weight is not None else new_parameter(
            self.rows_per_rank, hidden_size, loader=self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded_weight: Checkpoint,
                      shard_id=None) -> None:
        if loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(f"{type(self).__name__}: checkpoint has {loaded_weight.shape[0]} "
                             f"vocabulary rows, config.json says {self.vocab_size}")
        rows = self.vocab_end - self.vocab_start
        param.data[rows:].zero_()
        copy_checked(param.data[:rows], loaded_weight.narrow(0, self.vocab_start, rows),
                     type(self).__name__)

    def checkpoint_shapes(self, param: nn.Parameter) -> ShardShapes:
        return {None: (self.vocab_size, param.shape[1])}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        ids = torch.where(local, input_ids - self.vocab_start, 0)
        out = F.embedding(ids, self.weight) * local[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> float32 logits over the whole vocabulary. Tied to an embedding, its
    weight is the embedding's parameter itself."""

    def __init__(self, vocab_size: int, hidden_size: int,
                 tied_embedding: VocabParallelEmbedding | None = None) -> None:
        shared = tied_embedding.weight if tied_embedding is not None else None
        super().__init__(vocab_size, hidden_size, shared)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.logits(hidden).float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits in the weight's dtype: a view, rows strided over a padded vocabulary."""
        logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size]
