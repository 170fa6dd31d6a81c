"""`headrace bench scheduler`: the core runs every request to its length, as the engine
would (prompts in chunks, which sample nothing before their last), and the figures it
writes add up."""

from __future__ import annotations

import json

from benchmarks.bench.scheduler import main, nano_requests


def test_the_scheduler_bench_generates_every_requests_tokens(tmp_path, capsys):
    out = tmp_path / "scheduler.json"
    assert main(["--num-prompts", "6", "--max-num-seqs", "4", "--repeat", "2",
                 "--max-num-batched-tokens", "256", "--pipeline-stages", "2",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    want = sum(r.params.max_tokens for r in nano_requests(6, 0))
    assert [run["tokens"] for run in figures["runs"]] == [want, want]
    for run in figures["runs"]:
        assert run["steps"] > 0 and run["schedule_s"] > 0 and run["update_s"] > 0
    assert "us/token" in capsys.readouterr().out


def test_the_served_path_encodes_every_step_of_n_completions_with_logprobs(tmp_path):
    """--served: update_columns and the encoding of plans and TokenBatches, each request's
    n completions run to their length, each token with its logprobs' columns."""
    out = tmp_path / "served.json"
    assert main(["--num-prompts", "3", "--max-num-seqs", "8", "--repeat", "1", "--n", "2",
                 "--logprobs", "3", "--served", "--json", str(out)]) == 0
    run, = json.loads(out.read_text())["runs"]
    assert run["tokens"] == 2 * sum(r.params.max_tokens for r in nano_requests(3, 0))
    assert run["encode_s"] > 0 and run["encode_us_per_token"] > 0
