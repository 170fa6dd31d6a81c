"""`headrace bench inputs`: the step it times is a decode step with every token in flight,
and the figures it writes are one a run a size."""

from __future__ import annotations

import json

from benchmarks.bench.inputs import main
from services.worker.synthetic_step import decode_step, decode_step_preparer


def test_the_timed_step_decodes_every_row_from_the_step_in_flight() -> None:
    _, states, _ = decode_step(5, logprobs=2)
    inputs = decode_step_preparer(5, logprobs=2)()
    assert inputs.input_ids.tolist() == [0, 1, 2, 3, 4]  # each row's pending token
    assert inputs.positions.tolist() == [s.num_tokens for s in states]
    assert inputs.sample_rows == [0, 1, 2, 3, 4]
    assert inputs.prompt_logprob_rows == inputs.pooling_rows == inputs.spec == []


def test_the_inputs_bench_writes_each_sizes_runs(tmp_path, capsys) -> None:
    out = tmp_path / "inputs.json"
    assert main(["--rows", "1", "4", "--iterations", "5", "--repeat", "2",
                 "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["us_per_step"]
    assert sorted(figures) == ["1", "4"]
    assert all(len(runs) == 2 and min(runs) > 0 for runs in figures.values())
    assert "us a step" in capsys.readouterr().out
