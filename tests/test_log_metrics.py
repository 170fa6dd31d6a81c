"""Logging: JSON lines with the bound fields, stdlib records in the same format, env
overrides. Metrics: the exposition parses and carries vLLM's names under headrace:."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import textwrap

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.bus import Bus
from common.messages import Abort, SchedulerStats
from common.metrics import Metrics
from tests.conftest import REPO, repo_env

LOGGING_SCRIPT = textwrap.dedent("""
    import logging, structlog
    from common.log import configure_logging, get_logger
    configure_logging("tokenizer", replica=2)
    log = get_logger(stage="admit")
    structlog.contextvars.bind_contextvars(rid="req-7")
    log.info("admitted", prompt_tokens=12)
    log.debug("hidden at INFO")
    logging.getLogger("aiohttp.access").warning("GET %s %d", "/v1/models", 200)
    try:
        raise ValueError("bad prompt")
    except ValueError:
        log.exception("rejected", step=3)
""")


def run_logging(**env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", LOGGING_SCRIPT], cwd=REPO,
                          env=repo_env(**env), capture_output=True, text=True, timeout=60)


def test_json_lines_carry_service_replica_and_rid_when_not_a_tty():
    result = run_logging()
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["admitted", "GET /v1/models 200", "rejected"]
    for line in lines:
        assert (line["service"], line["replica"], line["rid"]) == ("tokenizer", 2, "req-7")
        assert "timestamp" in line and "level" in line
    assert lines[0]["prompt_tokens"] == 12 and lines[0]["stage"] == "admit"
    assert lines[1]["logger"] == "aiohttp.access" and lines[1]["level"] == "warning"
    assert lines[2]["step"] == 3 and "ValueError: bad prompt" in lines[2]["exception"]
    assert result.stdout == ""


def test_env_overrides_level_and_format():
    debug = run_logging(HEADRACE_LOG_LEVEL="debug")
    assert "hidden at INFO" in debug.stderr
    console = run_logging(HEADRACE_LOG_FORMAT="console")
    assert console.returncode == 0
    assert "admitted" in console.stderr and not console.stderr.lstrip().startswith("{")
    bad = run_logging(HEADRACE_LOG_FORMAT="xml")
    assert bad.returncode != 0 and "HEADRACE_LOG_FORMAT must be one of" in bad.stderr


def families(metrics: Metrics) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}} from the rendered text."""
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def random_stats(rng: random.Random) -> SchedulerStats:
    return SchedulerStats(num_running=rng.randint(1, 50), num_waiting=rng.randint(0, 50),
                          kv_cache_usage=rng.random(), num_preemptions=rng.randint(0, 9),
                          prefix_cache_queries=1000, prefix_cache_hits=rng.randint(0, 1000),
                          prompt_tokens=rng.randint(1, 10**6),
                          generation_tokens=rng.randint(1, 10**6))


def test_render_parses_has_vllm_names_and_a_series_per_shard():
    rng = random.Random(0)
    metrics = Metrics()
    stats = {0: random_stats(rng), 1: random_stats(rng)}
    metrics.set_scheduler_stats(stats)
    metrics.request_success.labels("stop", "0").inc(3)
    metrics.request_success.labels("length", "1").inc()
    ttfts = [rng.uniform(0.01, 2.0) for _ in range(20)]
    for ttft in ttfts:
        metrics.time_to_first_token.labels("1").observe(ttft)
    metrics.inter_token_latency.labels("0").observe(0.02)
    metrics.e2e_request_latency.labels("0").observe(4.0)
    seen = families(metrics)
    for shard, figures in stats.items():
        value = {name: rows.get((("shard", str(shard)),)) for name, rows in seen.items()}
        assert value["headrace:num_requests_running"] == figures.num_running
        assert value["headrace:num_requests_waiting"] == figures.num_waiting
        assert value["headrace:kv_cache_usage_perc"] == pytest.approx(figures.kv_cache_usage)
        assert value["headrace:num_preemptions_total"] == figures.num_preemptions
        assert value["headrace:prompt_tokens_total"] == figures.prompt_tokens
        assert value["headrace:generation_tokens_total"] == figures.generation_tokens
        assert value["headrace:prefix_cache_queries_total"] == 1000
        assert value["headrace:prefix_cache_hits_total"] == figures.prefix_cache_hits
    assert seen["headrace:request_success_total"] == {
        (("finished_reason", "stop"), ("shard", "0")): 3,
        (("finished_reason", "length"), ("shard", "1")): 1}
    shard_1 = (("shard", "1"),)
    assert seen["headrace:time_to_first_token_seconds_count"] == {shard_1: 20}
    assert seen["headrace:time_to_first_token_seconds_sum"][shard_1] == pytest.approx(sum(ttfts))
    assert seen["headrace:inter_token_latency_seconds_count"] == {(("shard", "0"),): 1}
    assert seen["headrace:e2e_request_latency_seconds_count"] == {(("shard", "0"),): 1}
    metrics.set_scheduler_stats({1: stats[1]})  # shard 0's figures are gone: so are its series
    assert set(families(metrics)["headrace:prompt_tokens_total"]) == {shard_1}
    assert set(families(metrics)["headrace:num_requests_running"]) == {shard_1}


def test_totals_take_absolute_values_and_refuse_bad_ones():
    metrics = Metrics()
    metrics.totals.set("prompt_tokens", 520)
    metrics.totals.set("prompt_tokens", 30, shard=1)
    metrics.totals.set("num_preemptions", 0)  # a restarted scheduler counts from zero again
    assert families(metrics)["headrace:prompt_tokens_total"] == {
        (("shard", "0"),): 520, (("shard", "1"),): 30}
    with pytest.raises(KeyError, match="unknown counter"):
        metrics.totals.set("tokens", 1)
    with pytest.raises(ValueError):
        metrics.totals.set("prompt_tokens", -5)


@pytest.mark.anyio
async def test_stream_gauges_follow_the_bus(redis_url):
    metrics = Metrics()
    async with Bus(redis_url) as bus:
        await bus.publish("hr:requests", *[Abort(f"r{i}") for i in range(9)])
        await bus.ensure_group("hr:requests", "tok")
        await bus.read("tok", "t0", {"hr:requests": ">"}, count=4)
        metrics.set_streams(await bus.stream_infos())
        seen = families(metrics)
        assert seen["headrace:stream_length"] == {(("stream", "hr:requests"),): 9}
        key = (("group", "tok"), ("stream", "hr:requests"))
        assert seen["headrace:stream_pending"] == {key: 4}
        assert seen["headrace:stream_lag"] == {key: 5}
        await bus.redis.delete("hr:requests")
        metrics.set_streams(await bus.stream_infos())
    assert "headrace:stream_length" not in families(metrics)
