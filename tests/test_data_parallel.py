"""Data-parallel shards: the router's choices, then `headrace serve --data-parallel-size 2`
on the CPU with a tiny model, on a single Redis and on a 3-master Redis Cluster: every request answered once with the single shard's greedy
text, a shared prefix served by one shard (its prefix-cache counters), and a killed worker
taking down only its own shard's requests."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import keys
from common.bus import decode_value
from common.messages import SchedulerStats
from common.sampling_params import SamplingParams
from services import LLM
from services.tokenizer.routing import PREFIX_BLOCKS, STALE_S, Router
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, serving, tiny_serve_args
from tests.redis_cluster import LocalCluster, sync_client
from tests.test_faults import MAX_TOKENS, stream_all
from tests.tiny_models import make_tiny_model

BLOCK = 16
SLACK = 8192


def figures(waiting_tokens: int = 0, ts: float = 1.0) -> SchedulerStats:
    return SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0, ts=ts, waiting_tokens=waiting_tokens)


def two_shards(policy: str = "prefix") -> Router:
    router = Router(2, BLOCK, SLACK, policy)
    for shard in (0, 1):
        router.observe(shard, True, figures(), now=0.0)
    return router


def prompt(prefix_seed: int, suffix_seed: int, prefix_len: int = PREFIX_BLOCKS * BLOCK
           ) -> list[int]:
    head, tail = random.Random(prefix_seed), random.Random(-1 - suffix_seed)
    return ([head.randrange(50_000) for _ in range(prefix_len)]
            + [tail.randrange(50_000) for _ in range(40)])


# --- the router ----------------------------------------------------------------------------

def test_requests_sharing_their_first_blocks_go_to_one_shard_and_prefixes_spread():
    router = two_shards()
    for seed in range(20):
        shards = {router.route(prompt(seed, turn), now=0.1) for turn in range(5)}
        assert len(shards) == 1, seed
        for shard in (0, 1):  # what the router counted since the reading is forgotten
            router.observe(shard, True, figures(ts=2.0 + seed), now=0.1)
    chosen = [router.route(prompt(seed, 0), now=0.1) for seed in range(40)]
    assert 10 <= chosen.count(0) <= 30  # rendezvous hashing spreads the prefixes


def test_a_much_busier_preferred_shard_loses_the_request_to_the_least_loaded():
    router = two_shards()
    ids = prompt(1, 0)
    preferred = router.route(ids, now=0.1)
    other = 1 - preferred
    router.observe(preferred, True, figures(SLACK + 100, ts=2.0), now=0.2)
    router.observe(other, True, figures(50, ts=2.0), now=0.2)
    assert router.route(ids, now=0.3) == other
    router.observe(preferred, True, figures(SLACK - 100, ts=3.0), now=0.4)
    assert router.route(ids, now=0.5) == preferred  # within the slack: affinity wins


def test_what_the_router_sent_since_a_reading_counts_as_load():
    router = two_shards()
    ids = prompt(2, 0, prefix_len=SLACK)  # one request is a slack's worth of tokens
    first = router.route(ids, now=0.1)
    assert router.loads[first].tokens == len(ids)
    assert router.route(ids, now=0.1) == 1 - first  # the burst spills to the other shard
    router.observe(first, True, figures(ts=2.0), now=0.2)
    assert router.loads[first].tokens == 0


def test_a_shard_that_is_down_or_silent_gets_no_new_requests():
    router = two_shards()
    router.observe(1, False, figures(ts=2.0), now=1.0)  # its worker's key lapsed
    assert {router.route(prompt(s, 0), now=1.0) for s in range(20)} == {0}
    # shard 0's figures stop changing: past STALE_S it counts as gone
    router.observe(0, True, figures(ts=1.0), now=1.0 + STALE_S)
    router.observe(1, True, figures(ts=3.0), now=1.0 + STALE_S)
    assert {router.route(prompt(s, 0), now=1.0 + STALE_S + 0.1) for s in range(20)} == {1}


def test_with_no_shard_live_requests_still_follow_affinity():
    router = Router(2, BLOCK, SLACK)
    ids = prompt(3, 0)
    assert router.route(ids, now=0.0) == router.route(ids, now=0.0)


def test_a_prompt_shorter_than_a_block_goes_to_the_least_loaded_shard():
    router = two_shards()
    router.observe(0, True, figures(500, ts=2.0), now=0.1)
    assert router.route(list(range(BLOCK - 1)), now=0.2) == 1


def test_round_robin_takes_turns_whatever_the_prefix():
    router = two_shards("round_robin")
    assert [router.route(prompt(4, 0), now=0.1) for _ in range(4)] in ([0, 1, 0, 1],
                                                                        [1, 0, 1, 0])


# --- two shards served ---------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "Once upon a time", "Roses are red,", "import numpy as np", "Dear Sir,",
           "SELECT * FROM"]
END_S = 10.0
RECOVER_S = 90.0

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("dp"), "llama", vocab_size=151936)


@pytest.fixture(scope="module", params=["server", "cluster"])
def server(request: pytest.FixtureRequest, model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`headrace serve --data-parallel-size 2` on its embedded Redis, then on a 3-master
    Redis Cluster of its own."""
    root = tmp_path_factory.mktemp("dp-serve")
    args = tiny_serve_args(model_dir, root / "run", "--data-parallel-size", "2",
                           "--max-model-len", "512")
    redis_url = None
    with contextlib.ExitStack() as stack:
        if request.param == "cluster":
            redis_url = stack.enter_context(LocalCluster(root / "cluster")).url
            args += ["--redis-url", redis_url]
        served = stack.enter_context(serving(args, root / "serve.log", root / "run"))
        served.redis_url = redis_url
        wait_both_up(served)
        yield served


def wait_both_up(server: ServerProcess) -> None:
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        stats = shard_stats(server, settle_s=0.0)  # only whether each has a live worker
        if all(s is not None for s in stats):
            return
        time.sleep(0.5)
    raise AssertionError(f"both shards never came up:\n{server.log_tail()}")


def shard_stats(server: ServerProcess, settle_s: float = 1.0) -> list[SchedulerStats | None]:
    """Each shard's latest figures (None for a shard without a live worker), after
    `settle_s` for the schedulers to publish what they did last (every 0.5 s)."""
    assert server.run_dir is not None
    time.sleep(settle_s)
    client = sync_client(server.redis_url or f"unix://{server.run_dir / 'redis.sock'}")
    try:
        # a shard publishes while it has a worker: a lapsed worker leaves the last figures
        alive = [client.get(keys.alive_worker(s)) for s in (0, 1)]
        raws = [client.get(keys.scheduler_stats(s)) for s in (0, 1)]
        return [decode_value(keys.scheduler_stats(s), raw) if up is not None else None
                for s, (up, raw) in enumerate(zip(alive, raws))]
    finally:
        client.close()


def single_shard_texts(model_dir: Path, prompts: list[str]) -> list[str]:
    llm = LLM(str(model_dir), device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def shard_workers(server: ServerProcess) -> dict[int, psutil.Process]:
    workers = {}
    for child in psutil.Process(server.process.pid).children():
        argv = child.cmdline()
        if "worker" in argv:
            workers[int(argv[argv.index("--shard") + 1])] = child
    return workers


@pytest.mark.slow
def test_two_shards_answer_every_request_once_with_one_shards_texts(server, model_dir):
    before = shard_stats(server)
    outcomes = anyio.run(stream_all, server.url, PROMPTS)
    assert all(o.done and o.error is None for o in outcomes), outcomes
    assert [o.text for o in outcomes] == single_shard_texts(model_dir, PROMPTS)
    after = shard_stats(server)
    served = [a.prompt_tokens - b.prompt_tokens for a, b in zip(after, before)]
    assert all(n > 0 for n in served), served  # both shards took some
    # /metrics: a series per shard, the schedulers' totals and the gateway's latencies
    samples = metric_samples(server)
    for shard, figures in enumerate(after):
        labels = (("model_name", MODEL_NAME), ("shard", str(shard)))
        assert samples["headrace:prompt_tokens_total", labels] == figures.prompt_tokens
        assert samples["headrace:time_to_first_token_seconds_count", labels] > 0
    assert sum(v for (name, _), v in samples.items()
               if name == "headrace:request_success_total") >= len(PROMPTS)


def metric_samples(server: ServerProcess) -> dict[tuple[str, tuple], float]:
    request = urllib.request.Request(server.url + "/metrics",
                                      headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.mark.slow
def test_requests_sharing_a_prefix_land_on_one_shard_and_hit_its_cache(server):
    system = " ".join(["You are a terse assistant who answers in one line."] * 8)
    prompts = [f"{system} Question {i}: what is {i} + {i}?" for i in range(6)]
    before = shard_stats(server)
    for text in prompts:  # one by one: each finds the prefix its predecessor cached
        (outcome,) = anyio.run(stream_all, server.url, [text])
        assert outcome.done and outcome.error is None, outcome
    after = shard_stats(server)
    queried = [a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before)]
    hits = [a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before)]
    assert sorted(q > 0 for q in queried) == [False, True], queried  # one shard took all
    shard = queried.index(max(queried))
    assert hits[shard] >= 5 * PREFIX_BLOCKS * BLOCK, hits  # the 5 after the first hit


@pytest.mark.slow
def test_a_killed_worker_ends_only_its_shards_requests_and_both_serve_after(server):
    workers = shard_workers(server)
    assert sorted(workers) == [0, 1]
    killed_at = [0.0]

    async def kill() -> None:
        os.kill(workers[1].pid, signal.SIGKILL)
        killed_at[0] = time.monotonic()

    outcomes = anyio.run(stream_all, server.url, PROMPTS, kill)
    failed = [o for o in outcomes if o.error]
    assert failed and len(failed) < len(outcomes), outcomes  # shard 1's only
    for o in outcomes:
        assert o.done, o
        if o.error:
            assert o.ended_at - killed_at[0] <= END_S, (o, server.log_tail())
    # meanwhile shard 0 serves every new request (the tokenizers saw shard 1's key lapse
    # when its scheduler did, a refresh ago)
    during = anyio.run(stream_all, server.url, PROMPTS)
    assert all(o.done and o.error is None for o in during), during
    wait_both_up(server)
    assert shard_workers(server)[1].pid != workers[1].pid
    before = shard_stats(server)
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:  # shard 1 takes requests again
        outcomes = anyio.run(stream_all, server.url, PROMPTS)
        assert all(o.done and o.error is None for o in outcomes), outcomes
        after = shard_stats(server)
        if after[1] is not None and after[1].prompt_tokens > before[1].prompt_tokens:
            break
    else:
        raise AssertionError(f"shard 1 took no request after its restart:\n{server.log_tail()}")
