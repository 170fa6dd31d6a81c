"""Embeddings from a model's final hidden states (after its final norm, before lm_head), as
vLLM's poolers make them: LAST takes the prompt's last token's state, MEAN averages every
prompt token's; both L2-normalized unless --override-pooler-config says not.

A prompt prefilled in chunks is pooled across its steps: MEAN adds each chunk's sum to a
running float32 sum that the request's worker state holds until its last chunk (and drops
with the state when the request ends or is preempted: a recompute starts a new sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Pooler:
    def __init__(self, pooling_type: str, normalize: bool) -> None:
        assert pooling_type in ("LAST", "MEAN"), pooling_type
        self.mean = pooling_type == "MEAN"
        self.normalize = normalize

    def add_chunk(self, hidden: torch.Tensor, first: int, count: int,
                  running: torch.Tensor | None) -> torch.Tensor | None:
        """What a request's pooling carries past its chunk hidden[first:first + count]:
        MEAN's running sum; LAST needs nothing, its token is in the last chunk."""
        if not self.mean:
            return None
        chunk = hidden[first:first + count].sum(0, dtype=torch.float32)
        return chunk if running is None else running + chunk

    def finish(self, hidden: torch.Tensor, last: int, running: torch.Tensor | None,
               num_tokens: int) -> torch.Tensor:
        """The float32 vector of a prompt of `num_tokens` whose last token is hidden[last],
        `running` being add_chunk's result over all of its chunks."""
        if self.mean:
            assert running is not None, "add_chunk first"
            return running / num_tokens
        return hidden[last].float()

    def normalized(self, vectors: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> the embeddings the API answers with."""
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors
