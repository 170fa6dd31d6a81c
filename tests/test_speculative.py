import json

import pytest
import torch

from common.config import ConfigError, EngineConfig
from common.speculative import NgramIndex, SpeculativeConfig, propose_ngram


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
