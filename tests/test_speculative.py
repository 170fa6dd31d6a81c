import json

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.sampling_params import SamplingParams
from common.speculative import NgramIndex, SpeculativeConfig, propose_ngram
from services.worker.sampler import Sampler, SamplingRow, make_generator


def test_propose_takes_the_longest_suffix_and_its_latest_occurrence():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0..2 (followed by 9, 2): longer beats the later [2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [9, 2]
    # with max 2, [2, 3] occurred latest at 4..5, followed by 7, 8, 1
    assert propose_ngram(tokens, 3, 1, 2) == [7, 8, 1]


def test_propose_stops_at_the_end_and_respects_min():
    assert propose_ngram([5, 6, 5], 3, 1, 3) == [6, 5]
    assert propose_ngram([5, 6, 7, 5], 3, 2, 3) == []  # only a 1-token match
    assert propose_ngram([1, 2, 3], 3, 1, 3) == []
    assert propose_ngram([4], 3, 1, 3) == []
    assert propose_ngram([4, 4], 3, 1, 3) == [4]


def scan_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, scanning the whole context: the index's twin."""
    last = len(tokens) - 1
    for n in range(min(max_n, last), min_n - 1, -1):
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == tokens[last - n + 1:]:
                return tokens[end + 1:end + 1 + k]
    return []


def test_the_index_grown_as_tokens_arrive_proposes_what_a_full_scan_does():
    g = torch.Generator().manual_seed(0)
    for vocab, (min_n, max_n) in [(3, (1, 4)), (6, (2, 3)), (20, (1, 2))]:
        tokens = torch.randint(0, vocab, (300,), generator=g).tolist()
        index = NgramIndex()
        start = 0
        while start < len(tokens):
            step = int(torch.randint(1, 5, (1,), generator=g))  # 1 to 4 tokens at a time
            index.extend(tokens[start:start + step])
            start += step
            known = tokens[:start]
            assert index.propose(4, min_n, max_n) == scan_ngram(known, 4, min_n, max_n), known


def test_config_json_and_older_flags():
    text = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 1})
    assert EngineConfig(speculative_config=text).speculative() == SpeculativeConfig(3, 4, 1)
    older = EngineConfig(num_speculative_tokens=2, ngram_prompt_lookup_max=3)
    assert older.speculative() == SpeculativeConfig(2, 3, 3)
    assert EngineConfig().speculative() is None


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "ngram and draft_model only"),
    ({"method": "draft_model", "num_speculative_tokens": 3}, 'needs a string "model"'),
    ({"method": "ngram", "prompt_lookup_max": 3}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1,
      "prompt_lookup_min": 3}, "prompt_lookup_min <="),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2, "x": 1},
     "unknown"),
])
def test_config_refusals(value, words):
    with pytest.raises(ConfigError, match=words):
        EngineConfig(speculative_config=json.dumps(value))


def test_config_not_json():
    with pytest.raises(ConfigError, match="not JSON"):
        EngineConfig(speculative_config="{")


# --- rejection sampling (services/worker/sampler.py) -------------------------------------

LOGITS = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, -1.0, 0.7, 0.3],
                       [0.1, 1.5, -0.3, 0.0, 0.9, -2.0, 0.4, 1.1]])


def target(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampler's own processed distribution for one position, normalized."""
    sampler = Sampler(torch.device("cpu"), 0)
    probs = sampler._probs(row.unsqueeze(0), [SamplingRow(params, [], [], None)])[0]
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
    out = sampler.verify(logits, [SamplingRow(params, [], [], None)] * n, [[draft]] * n)
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
    out = sampler.verify(logits, [greedy] * 4, drafts).tolist()
    assert out[0][:1 + out[0][0]] == [2, best[0], best[1]]
    assert out[1][:1 + out[1][0]] == [4, best[3], best[4], best[5], best[6]]
    assert out[2][:1 + out[2][0]] == [1, best[7]]
    assert out[3][:1 + out[3][0]] == [1, best[8]]

    def seeded() -> list[list[int]]:
        row = SamplingRow(SamplingParams(temperature=1.0, seed=7), [], [],
                          make_generator(7, torch.device("cpu")))
        return Sampler(torch.device("cpu"), 99).verify(logits[:3], [row], [[1, 2]]).tolist()
    assert seeded() == seeded()
