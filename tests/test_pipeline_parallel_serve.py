"""`headrace serve --pipeline-parallel-size 2` on the CPU (gloo): streamed greedy texts
through the whole Redis pipeline equal the offline single-rank engine's, and a killed last
stage ends the shard's streams with an error within 10 s, after which the launcher starts
the shard (both stages) afresh and it serves again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from tests.e2e_fixtures import ServerProcess, serving, tiny_serve_args
from tests.test_faults import stream_all
from tests.test_tensor_parallel_serve import (END_S, PROMPTS, RECOVER_S, one_rank_texts,
                                              worker_and_ranks)
from tests.tiny_models import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.long]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the whole vocabulary of the test tokenizer, so that text prompts are in it
    return make_tiny_model(tmp_path_factory.mktemp("pp"), "llama", vocab_size=151936)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("pp-serve")
    args = tiny_serve_args(model_dir, root / "run", "--pipeline-parallel-size", "2",
                           "--max-model-len", "256")
    with serving(args, root / "serve.log") as served:
        yield served


def test_two_stages_serve_one_ranks_greedy_texts_and_a_killed_stage_comes_back(server,
                                                                              model_dir):
    worker, ranks = worker_and_ranks(server)
    assert len(ranks) == 1, ranks  # the first stage is the worker itself
    want = one_rank_texts(model_dir)
    outcomes = anyio.run(stream_all, server.url, PROMPTS)
    assert all(o.done and o.error is None for o in outcomes), outcomes
    assert [o.text for o in outcomes] == want

    killed_at = [0.0]

    async def kill() -> None:
        os.kill(ranks[0].pid, signal.SIGKILL)
        killed_at[0] = time.monotonic()

    outcomes = anyio.run(stream_all, server.url, PROMPTS, kill)
    for o in outcomes:
        assert o.done and o.error, o  # an error event, then [DONE]
        assert o.ended_at - killed_at[0] <= END_S, (o, server.log_tail())
    assert "pp-stage-1-tp-rank-0 died" in server.log_path.read_text()

    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        outcomes = anyio.run(stream_all, server.url, PROMPTS[:1])
        if outcomes[0].done and outcomes[0].error is None:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the shard did not come back:\n{server.log_tail()}")
    assert outcomes[0].text == want[0]
    new_worker, new_ranks = worker_and_ranks(server)
    assert new_worker.pid != worker.pid and len(new_ranks) == 1
