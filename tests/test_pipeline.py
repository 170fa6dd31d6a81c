"""The four backend services as real processes linked by a real Redis (a single server, then
a 3-master Redis Cluster), driven from the bus the way a gateway drives them: outputs equal the in-process engine's, errors, aborts and
stop strings come back, replicas killed with SIGKILL lose nothing, and a dead worker ends
its requests with an error while a restarted one serves new requests."""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from benchmarks.bench.pipeline import CLIENT, LocalPipeline, Outcome, drive
from common import messages
from common import keys
from common.bus import Bus
from common.config import EngineConfig, ServerConfig
from common.messages import Abort, ErrorReply, GenerateRequest
from common.sampling_params import SamplingParams
from services.offline.llm import LLM
from services.scheduler.shell import STATS_TTL_S
from tests.redis_cluster import LocalCluster
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.anyio
BLOCKS = 128


class Pipeline(LocalPipeline):
    """On an embedded single Redis (`where="server"`) or on a 3-master Redis Cluster of its
    own (`"cluster"`)."""

    def __init__(self, root: Path, model: Path, where: str, tokenizers: int = 1,
                 detokenizers: int = 1):
        self.cluster = LocalCluster(root / "cluster") if where == "cluster" else None
        if self.cluster is not None:
            self.cluster.start()
        super().__init__(root, EngineConfig(model=str(model), num_gpu_blocks_override=BLOCKS),
                         ServerConfig(tokenizer_replicas=tokenizers,
                                      detokenizer_replicas=detokenizers, reclaim_idle_ms=1000),
                         redis_url=self.cluster.url if self.cluster else None)

    def stop(self) -> None:
        super().stop()
        if self.cluster is not None:
            self.cluster.stop()

    async def run(self, requests: list[GenerateRequest], timeout: float = 120.0,
                  during=None) -> dict[str, Outcome]:
        return await drive(self.url, requests, timeout, during)

    async def stats(self) -> messages.SchedulerStats:
        async with Bus(self.url) as bus:
            return messages.decode(await bus.redis.get(keys.scheduler_stats()))


def request(rid: str, prompt: list[int], **params) -> GenerateRequest:
    return GenerateRequest(rid, CLIENT, params, prompt_token_ids=prompt,
                           arrival_time=time.time())


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def offline(model: Path) -> LLM:
    return LLM(str(model), num_gpu_blocks_override=BLOCKS)


@pytest.fixture(scope="module", params=["server", "cluster"])
def where(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def pipeline(model: Path, where: str, tmp_path_factory) -> Iterator[Pipeline]:
    pipe = Pipeline(tmp_path_factory.mktemp("pipeline"), model, where)
    yield pipe
    pipe.stop()


def offline_texts(llm: LLM, batch: list[list[int]], **params) -> list[tuple[list[int], str]]:
    outs = llm.generate(batch, SamplingParams(**params), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


async def test_greedy_outputs_equal_the_in_process_engine(pipeline, offline):
    batch = prompts(8)
    params = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}
    outcomes = await pipeline.run([request(f"g{i}", p, **params) for i, p in enumerate(batch)])
    expected = offline_texts(offline, batch, **params)
    for i, (token_ids, text) in enumerate(expected):
        choice = outcomes[f"g{i}"].choices[0]
        assert (choice.token_ids, choice.text) == (token_ids, text)
        assert choice.finish_reason == "length" and choice.num_prompt_tokens == len(batch[i])


async def test_n_logprobs_and_seed(pipeline):
    params = {"n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 6, "logprobs": 2}
    first = await pipeline.run([request("s1", [5, 6, 7, 8], **params)])
    again = await pipeline.run([request("s2", [5, 6, 7, 8], **params)])
    a, b = first["s1"].choices, again["s2"].choices
    assert sorted(a) == [0, 1] and a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != a[1].token_ids  # siblings draw from different seeds
    assert all(len(lp.token_ids) == 3 and lp.texts for lp in a[0].logprobs)


async def test_a_prompt_too_long_is_rejected_with_both_numbers(pipeline):
    outcome = (await pipeline.run([request("long", list(range(3, 500)) + [7] * 20)]))["long"]
    assert outcome.error is not None and outcome.error.status == 400
    assert "512" in outcome.error.message and "517" in outcome.error.message


async def test_abort_and_stop_strings_free_the_kv_cache(pipeline):
    async def abort_once_streaming(bus: Bus, outcomes: dict[str, Outcome]) -> None:
        if outcomes["a"].choices and outcomes["a"].error is None:
            await bus.publish(keys.control(), Abort("a"))
            outcomes["a"].error = ErrorReply("a", 499, "aborted by the test")
    long = {"max_tokens": 400, "ignore_eos": True}
    await pipeline.run([request("a", [5, 6, 7], **long)], during=abort_once_streaming)
    text = (await pipeline.run([request("t", [9, 10, 11], temperature=0.0, max_tokens=30,
                                        ignore_eos=True)]))["t"].choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stopped = (await pipeline.run([request("u", [9, 10, 11], temperature=0.0, max_tokens=400,
                                           ignore_eos=True, stop=[stop])]))["u"].choices[0]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop)
    assert stopped.text == text[:text.index(stop)]
    with anyio.fail_after(10):
        while (stats := await pipeline.stats()).num_running or stats.kv_cache_usage:
            await anyio.sleep(0.2)


async def test_replicas_killed_mid_run_lose_nothing(model, offline, where, tmp_path):
    """On a cluster a replica killed between its per-slot commits repeats outputs; the
    scheduler and the reply's `seq` order drop them (common/redis_cluster.py)."""
    pipe = Pipeline(tmp_path, model, where, tokenizers=3, detokenizers=3)
    try:
        batch = prompts(200, seed=1)
        params = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
        killed: list[str] = []

        async def kill_two_replicas(bus: Bus, outcomes: dict[str, Outcome]) -> None:
            if not killed and sum(bool(o.choices) for o in outcomes.values()) >= 20:
                killed.extend(["tokenizer-1", "detokenizer-1"])
                for label in killed:
                    pipe.kill(label)

        outcomes = await pipe.run([request(f"k{i}", p, **params) for i, p in enumerate(batch)],
                                  timeout=240, during=kill_two_replicas)
        assert killed, "the run ended before the kill"
        for i, (token_ids, text) in enumerate(offline_texts(offline, batch, **params)):
            choice = outcomes[f"k{i}"].choices[0]
            assert (choice.token_ids, choice.text) == (token_ids, text)
    finally:
        pipe.stop()


async def test_a_dead_worker_ends_its_requests_and_a_new_one_serves(pipeline):
    """On the module's pipeline, which the tests before it leave idle: the worker it
    restarts serves whatever comes after."""
    killed_at: list[float] = []

    async def kill_worker(bus: Bus, outcomes: dict[str, Outcome]) -> None:
        if outcomes["w"].choices and not killed_at:
            pipeline.kill("worker-0")
            killed_at.append(time.monotonic())

    outcome = (await pipeline.run([request("w", [5, 6, 7], max_tokens=400,
                                           ignore_eos=True)], during=kill_worker))["w"]
    assert outcome.error is not None and outcome.error.status == 503
    assert "worker stopped" in outcome.error.message
    assert time.monotonic() - killed_at[0] < 10
    stats = await pipeline.stats()  # its requests ended with it: the gauges read 0
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0)
    pipeline.start("worker-0")
    with anyio.fail_after(60):
        while True:  # the restarted worker announces itself; then requests run again
            again = (await pipeline.run([request(f"x{time.monotonic_ns()}", [5, 6],
                                                 max_tokens=4)]))
            result = next(iter(again.values()))
            if result.error is None:
                assert result.choices[0].finish_reason == "length"
                break
            assert result.error.status == 503
            await anyio.sleep(0.5)


async def test_a_stopped_schedulers_figures_go_with_it(model, tmp_path):
    """A killed scheduler's figures expire (its gauges vanish rather than read their last
    value forever); one stopped by SIGTERM removes them as it exits."""
    pipe = Pipeline(tmp_path, model, "server")
    key = keys.scheduler_stats()
    try:
        await pipe.wait_ready()
        async with Bus(pipe.url) as bus:
            for stop in ("kill", "terminate"):
                with anyio.fail_after(60):
                    while await bus.redis.get(key) is None:
                        await anyio.sleep(0.1)
                assert 0 < await bus.redis.pttl(key) <= STATS_TTL_S * 1000
                process = pipe.children["scheduler-0"].process
                if stop == "kill":
                    pipe.kill("scheduler-0")
                    limit = STATS_TTL_S + 2
                else:
                    process.send_signal(signal.SIGTERM)
                    process.wait(30)
                    limit = 0.5  # gone already: the scheduler forgot them as it stopped
                with anyio.fail_after(limit):
                    while await bus.redis.exists(key):
                        await anyio.sleep(0.1)
                pipe.start("scheduler-0")
    finally:
        pipe.stop()
