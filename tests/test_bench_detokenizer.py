"""`headrace bench detokenizer`: the steps it times stream the README's text, and a replica's
deltas for them add up to each stream's decode."""

from __future__ import annotations

import json

from benchmarks.bench.detokenizer import main, step_batches
from common.messages import decode
from services.detokenizer import batch_detokenizer
from tests.text_fixtures import SMOLLM2_TOKENIZER_DIR, smollm2_tokenizer


def test_the_timed_steps_detokenize_to_each_streams_text() -> None:
    tokenizer = smollm2_tokenizer()
    batches = step_batches(tokenizer, streams=3, steps=20, logprobs=2)
    detokenize = batch_detokenizer(tokenizer)
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    for data in batches:
        deltas = detokenize(decode(data))
        assert len(deltas) == 3 and all(len(d.logprobs[0].texts) == 3 for d in deltas)
        for delta in deltas:
            texts[delta.rid] = texts.get(delta.rid, "") + delta.text
            tokens.setdefault(delta.rid, []).extend(delta.token_ids)
    for rid, ids in tokens.items():
        assert len(ids) == 20
        # the text held back at the end is a character not finished yet
        assert tokenizer.decode(ids).startswith(texts[rid]) and len(texts[rid]) > 20


def test_the_bench_writes_its_runs(tmp_path, capsys) -> None:
    out = tmp_path / "detok.json"
    assert main(["--tokenizer", str(SMOLLM2_TOKENIZER_DIR), "--streams", "4", "--steps", "8",
                 "--repeat", "2", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["us_per_token"]
    assert len(runs) == 2 and min(runs) > 0
    assert "us a token" in capsys.readouterr().out
