"""`headrace serve --tensor-parallel-size 2` on the CPU (gloo): streamed greedy texts through
the whole Redis pipeline equal the offline single-rank engine's, and a killed rank ends the
shard's streams with an error within 10 s, after which the launcher starts the shard afresh
and it serves again."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest

from common.sampling_params import SamplingParams
from services import LLM
from tests.e2e_fixtures import ServerProcess, serving, tiny_serve_args
from tests.test_faults import MAX_TOKENS, stream_all
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "Once upon a time"]
END_S = 10.0  # a killed rank's streams end this soon
RECOVER_S = 90.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the whole vocabulary of the test tokenizer, so that text prompts are in it
    return make_tiny_model(tmp_path_factory.mktemp("tp"), "llama", vocab_size=151936)


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("tp-serve")
    args = tiny_serve_args(model_dir, root / "run", "--tensor-parallel-size", "2",
                           "--max-model-len", "256")
    with serving(args, root / "serve.log") as served:
        yield served


def one_rank_texts(model_dir: Path) -> list[str]:
    llm = LLM(str(model_dir), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def worker_and_ranks(server: ServerProcess) -> tuple[psutil.Process, list[psutil.Process]]:
    for child in psutil.Process(server.process.pid).children():
        if "worker" in child.cmdline():  # beside its ranks, multiprocessing's resource tracker
            return child, [p for p in child.children()
                           if "--multiprocessing-fork" in p.cmdline()]
    raise AssertionError(f"no worker running:\n{server.log_tail()}")


def test_two_ranks_serve_one_ranks_greedy_texts(server, model_dir):
    worker, ranks = worker_and_ranks(server)
    assert len(ranks) == 1, ranks  # rank 0 is the worker itself
    outcomes = anyio.run(stream_all, server.url, PROMPTS)
    assert all(o.done and o.error is None for o in outcomes), outcomes
    assert [o.text for o in outcomes] == one_rank_texts(model_dir)


@pytest.mark.parametrize("victim", ["rank 1", "rank 0"])
def test_a_killed_rank_ends_the_shards_streams_and_the_shard_comes_back(server, model_dir,
                                                                        victim):
    """Rank 0 is the worker process: killed, it leaves its follower to notice and exit."""
    worker, (rank,) = worker_and_ranks(server)
    killed_at = [0.0]

    async def kill() -> None:
        os.kill(rank.pid if victim == "rank 1" else worker.pid, signal.SIGKILL)
        killed_at[0] = time.monotonic()

    outcomes = anyio.run(stream_all, server.url, PROMPTS, kill)
    for o in outcomes:
        assert o.done and o.error, o  # an error event, then [DONE]
        assert o.ended_at - killed_at[0] <= END_S, (o, server.log_tail())
    if victim == "rank 1":
        assert "tp-rank-1 died" in server.log_path.read_text()
    else:
        psutil.wait_procs([rank], timeout=5)
        assert not rank.is_running(), "rank 1 outlived its rank 0"

    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        outcomes = anyio.run(stream_all, server.url, PROMPTS[:1])
        if outcomes[0].done and outcomes[0].error is None:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the shard did not come back:\n{server.log_tail()}")
    assert outcomes[0].text == one_rank_texts(model_dir)[0]
    new_worker, new_ranks = worker_and_ranks(server)
    assert new_worker.pid != worker.pid and len(new_ranks) == 1
