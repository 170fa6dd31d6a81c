"""Speculative verification: how many of its drafts a speculating request accepts.

A speculating request's step computes its last token and the k drafts after it, so the
step has logits at 1 + k positions of the request: position j predicts the token after
draft j - 1, which draft j claims. Rejection sampling keeps the request's own
distribution p exactly (p is the sampler's, Sampler.probs, drawn with the same
generators): draft d is accepted with probability p(d) (greedy: when it is p's argmax);
the first rejected one is replaced by a draw from p without d, renormalized (greedy: the
argmax); when every draft is accepted a bonus token is drawn at the last position. So a
request emits its accepted drafts, then one token of its own: 1 to k + 1 tokens.
Only deterministic drafts (ngram, or a draft model's greedy tokens) are verified this way,
and only rows with raw logits (common/speculative.may_speculate).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kernels.sampling import greedy_tokens
from services.worker.sampler import Sampler, SamplingRow, to_device


def verify(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow],
           drafts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Verify each row's drafts. `logits` holds 1 + len(drafts[i]) positions of each row,
    in order. Returns int64 [rows, 1 + max drafts + 1]: the number of tokens each row
    emits, then its tokens: the accepted drafts and the replacement or bonus token."""
    counts = [1 + len(d) for d in drafts]
    width = max(counts)
    # each row's positions in `logits`, padded by repeating its last one
    position = [[start + min(j, n - 1) for j in range(width)]
                for start, n in zip(itertools.accumulate([0] + counts), counts)]
    padded = [list(d) + [-1] * (width - len(d)) for d in drafts]  # -1 never matches
    draft = to_device(padded, torch.int64, sampler.device)
    position_rows = [row for row, n in zip(rows, counts) for _ in range(n)]
    # position j of a row checks its draft j; its last position has none (-1)
    claims = to_device([t for d, n in zip(padded, counts) for t in d[:n]], torch.int64,
                       sampler.device)
    targets = _targets(sampler, logits, position_rows, claims)
    flat = to_device(position, torch.int64, sampler.device)
    accepted, replacement = (t[flat] for t in targets)
    tokens = torch.where(accepted, draft, replacement)
    emitted = accepted.long().cumprod(dim=1).sum(dim=1, keepdim=True) + 1
    return torch.cat([emitted, tokens], dim=1)


def emitted_tokens(row: list[int]) -> list[int]:
    """The tokens one row of verify's result emits (on the host)."""
    return row[1:1 + row[0]]


def last_emitted(verified: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of verify's result, on the device: its last emitted token (the replacement
    or bonus token), and how many tokens it emitted."""
    emitted = verified[:, 0]
    return verified.gather(1, emitted[:, None])[:, 0], emitted


def _targets(sampler: Sampler, logits: torch.Tensor, rows: Sequence[SamplingRow],
             drafts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position (one row each, its draft or -1): whether the draft is accepted, and
    the token that replaces it if not (the draw from p without the draft)."""
    greedy = greedy_tokens(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.greedy]
    accepted = greedy == drafts
    if not random_rows:
        return accepted, greedy
    index = to_device(random_rows, torch.int64, sampler.device)
    sub = [rows[i] for i in random_rows]
    probs = sampler.probs(logits.float()[index], sub)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    draft = drafts[index]
    has_draft = draft >= 0
    p_draft = probs.gather(1, draft.clamp_min(0).unsqueeze(1)).squeeze(1)
    uniform = _uniform(sampler, probs.shape[0], sub, probs.device)
    accepted.index_copy_(0, index, has_draft & (uniform < p_draft))
    # p - onehot(d), floored at 0, is p with d's entry zeroed: draw from that
    residual = probs.scatter(1, draft.clamp_min(0).unsqueeze(1),
                             torch.where(has_draft, 0.0, p_draft).unsqueeze(1))
    drawn = greedy_tokens(residual.div_(sampler.exponential_noise(residual, sub)))
    return accepted, greedy.index_copy(0, index, drawn)


def _uniform(sampler: Sampler, n: int, rows: Sequence[SamplingRow], device: torch.device
             ) -> torch.Tensor:
    """U[0, 1) per position, a seeded row's from its own generator, the others' from the
    sampler's."""
    uniform = torch.empty(n, device=device)
    if any(row.generator is None for row in rows):
        uniform.uniform_(generator=sampler.generator)
    for i, row in enumerate(rows):
        if row.generator is not None:
            uniform[i:i + 1].uniform_(generator=row.generator)
    return uniform
