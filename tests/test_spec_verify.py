"""Speculative verification (services/worker/spec_verify.py): a request accepts its drafts
up to the first the target rejects, then emits one token of its own (the replacement, or a
bonus token when every draft held); sampled rows keep the target's distribution."""

import pytest
import torch

from common.sampling_params import SamplingParams
from services.worker.sampler import Sampler, SamplingRow, make_generator
from services.worker.spec_verify import emitted_tokens, last_emitted, verify

GREEDY = SamplingRow(SamplingParams(temperature=0.0), [], [], None)
VOCAB = 6


def peaked(argmaxes: list[int], height: float = 50.0) -> torch.Tensor:
    """Logits [positions, VOCAB] whose position j all but surely picks argmaxes[j]."""
    logits = torch.zeros(len(argmaxes), VOCAB)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = height
    return logits


def test_greedy_accepts_the_drafts_up_to_the_first_mismatch():
    # row 0: drafts 2, 4, 1 against argmaxes 2, 4, 5 (and 3 after the last draft):
    #        2 and 4 are accepted, 1 is replaced by 5; the bonus position is not reached
    # row 1: drafts 1, 2 against 4, 2, 0: the first draft is rejected, so the matching
    #        second one counts for nothing: 4 alone
    # row 2: draft 3 against 3, then 0: accepted, and 0 is the bonus token
    logits = peaked([2, 4, 5, 3] + [4, 2, 0] + [3, 0])
    out = verify(Sampler(torch.device("cpu"), 0), logits, [GREEDY] * 3,
                 [[2, 4, 1], [1, 2], [3]]).tolist()
    # width 1 + 3 + 1: the count, then a token per position (past the count: padding)
    assert [row[:1 + row[0]] for row in out] == [[3, 2, 4, 5], [1, 4], [2, 3, 0]]
    assert [emitted_tokens(row) for row in out] == [[2, 4, 5], [4], [3, 0]]


def test_last_emitted_is_the_replacement_or_bonus_token_and_the_count():
    verified = torch.tensor([[3, 2, 4, 5, 3], [1, 4, 9, 9, 9], [2, 3, 0, 0, 0]])
    tokens, counts = last_emitted(verified)
    assert tokens.tolist() == [5, 4, 0]
    assert counts.tolist() == [3, 1, 2]


def test_a_sampled_row_accepts_a_sure_draft_and_replaces_an_impossible_one():
    row = SamplingRow(SamplingParams(temperature=1.0, top_k=3), [], [], None)
    # p is all but one-hot: draft 1 has p ~ 1 (accepted), draft 0 has p ~ 0 (rejected,
    # replaced by the draw from p without it: 5); the bonus position is not reached
    logits = peaked([1, 5, 2])
    out = verify(Sampler(torch.device("cpu"), 3), logits, [row], [[1, 0]]).tolist()
    assert emitted_tokens(out[0]) == [1, 5]
    # a draft outside top-k has p = 0 exactly: never accepted
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0, -2.0], [0.0] * VOCAB])
    for seed in range(20):
        out = verify(Sampler(torch.device("cpu"), seed), logits, [row], [[4]]).tolist()
        assert out[0][0] == 1 and out[0][1] in (0, 1, 2)

# --- rejection sampling keeps the target distribution -----------------------------------

LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 0.3],
                       [0.1, 1.5, -0.3, 0.0, 0.9, -2.0, 0.4, 1.1]])


def target(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's own processed distribution for one position, normalized."""
    sampler = Sampler(torch.device("cpu"), 0)
    probs = sampler.probs(row.unsqueeze(0), [SamplingRow(params, [], [], None)])[0]
    return probs / probs.sum()


def tv_bound(probs: torch.Tensor, n: int) -> float:
    """Six standard deviations of each frequency, summed: a TV distance this large has a
    probability far below 1e-6 for a correct sampler (and the seed is fixed anyway)."""
    return 0.5 * float((6 * (probs * (1 - probs) / n).sqrt()).sum()) + 1e-9


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.8, top_k=4),
                                    SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05)],
                         ids=["t1", "topk", "topp-minp"])
@pytest.mark.parametrize("draft", [3, 1, 5])  # likely, middling, unlikely (maybe cut off)
def test_rejection_sampling_keeps_the_target_distribution(params, draft):
    n = 30_000
    sampler = Sampler(torch.device("cpu"), 1234)
    logits = LOGITS.repeat(n, 1)  # each row: its draft position, then its bonus position
    out = verify(sampler, logits, [SamplingRow(params, [], [], None)] * n, [[draft]] * n)
    emitted, first, second = out[:, 0], out[:, 1], out[:, 2]
    p0, p1 = target(LOGITS[0], params), target(LOGITS[1], params)
    freq0 = torch.bincount(first, minlength=8).double() / n
    assert 0.5 * (freq0 - p0).abs().sum() < tv_bound(p0, n)
    # the bonus token after an accepted draft is a draw from the next position
    bonus = second[emitted == 2]
    assert torch.equal(emitted == 2, first == draft)
    if p0[draft] == 0:  # cut off by top-k/top-p/min-p: never accepted
        assert len(bonus) == 0
        return
    freq1 = torch.bincount(bonus, minlength=8).double() / len(bonus)
    assert 0.5 * (freq1 - p1).abs().sum() < tv_bound(p1, len(bonus))


def test_greedy_verification_is_exact_and_seeded_rows_repeat():
    sampler = Sampler(torch.device("cpu"), 0)
    logits = torch.randn(10, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingRow(SamplingParams(temperature=0.0), [], [], None)
    wrong = (best[1] + 1) % 50
    drafts = [[best[0], wrong], [best[3], best[4], best[5]], [], [(best[8] + 1) % 50]]
    out = verify(sampler, logits, [greedy] * 4, drafts).tolist()
    assert out[0][:1 + out[0][0]] == [2, best[0], best[1]]
    assert out[1][:1 + out[1][0]] == [4, best[3], best[4], best[5], best[6]]
    assert out[2][:1 + out[2][0]] == [1, best[7]]
    assert out[3][:1 + out[3][0]] == [1, best[8]]

    def seeded() -> list[list[int]]:
        row = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [],
                          make_generator(7, torch.device("cpu")))
        return verify(Sampler(torch.device("cpu"), 99), logits[:3], [row], [[1, 2]]).tolist()
    assert seeded() == seeded()
