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
from common.hops import request_times
from common.messages import Abort, SchedulerStats, TextDelta
from services.gateway.core import Call
from services.gateway.metrics import Metrics
from services.gateway.protocol import parse_job
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
                          generation_tokens=rng.randint(1, 10**6),
                          device_busy_seconds=rng.uniform(0, 100))


MODEL = "smol"


def labels(shard: int | str, **more: str) -> tuple:
    """A series' sorted labels: the model's name, the shard, and `more`."""
    return tuple(sorted({"model_name": MODEL, "shard": str(shard), **more}.items()))


def test_render_parses_has_vllm_names_and_a_series_per_shard():
    rng = random.Random(0)
    metrics = Metrics(MODEL)
    stats = {0: random_stats(rng), 1: random_stats(rng)}
    metrics.set_scheduler_stats(stats)
    for _ in range(3):
        metrics.count_success("0", "stop")
    metrics.count_success("1", "length")
    ttfts = [rng.uniform(0.01, 2.0) for _ in range(20)]
    for ttft in ttfts:
        metrics.observe(metrics.time_to_first_token, "1", ttft)
    metrics.observe(metrics.inter_token_latency, "0", 0.02)
    metrics.observe(metrics.e2e_request_latency, "0", 4.0)
    seen = families(metrics)
    for shard, figures in stats.items():
        value = {name: rows.get(labels(shard)) for name, rows in seen.items()}
        assert value["headrace:num_requests_running"] == figures.num_running
        assert value["headrace:num_requests_waiting"] == figures.num_waiting
        assert value["headrace:kv_cache_usage_perc"] == pytest.approx(figures.kv_cache_usage)
        assert value["headrace:num_preemptions_total"] == figures.num_preemptions
        assert value["headrace:prompt_tokens_total"] == figures.prompt_tokens
        assert value["headrace:generation_tokens_total"] == figures.generation_tokens
        assert value["headrace:prefix_cache_queries_total"] == 1000
        assert value["headrace:prefix_cache_hits_total"] == figures.prefix_cache_hits
        assert value["headrace:device_busy_seconds_total"] == pytest.approx(
            figures.device_busy_seconds)
        assert value["vllm:prompt_tokens_total"] == figures.prompt_tokens
    assert not any(name.startswith("vllm:device") for name in seen)  # headrace's own
    assert seen["headrace:request_success_total"] == {
        labels(0, finished_reason="stop"): 3, labels(1, finished_reason="length"): 1}
    shard_1 = labels(1)
    assert seen["headrace:time_to_first_token_seconds_count"] == {shard_1: 20}
    assert seen["headrace:time_to_first_token_seconds_sum"][shard_1] == pytest.approx(sum(ttfts))
    assert seen["headrace:inter_token_latency_seconds_count"] == {labels(0): 1}
    assert seen["headrace:e2e_request_latency_seconds_count"] == {labels(0): 1}
    metrics.set_scheduler_stats({1: stats[1]})  # shard 0's figures are gone: so are its series
    assert set(families(metrics)["headrace:prompt_tokens_total"]) == {shard_1}
    assert set(families(metrics)["headrace:num_requests_running"]) == {shard_1}


def test_totals_take_absolute_values_and_refuse_bad_ones():
    metrics = Metrics(MODEL)
    metrics.totals.set("prompt_tokens", 520)
    metrics.totals.set("prompt_tokens", 30, shard=1)
    metrics.totals.set("num_preemptions", 0)  # a restarted scheduler counts from zero again
    assert families(metrics)["headrace:prompt_tokens_total"] == {labels(0): 520,
                                                                 labels(1): 30}
    with pytest.raises(KeyError, match="unknown counter"):
        metrics.totals.set("tokens", 1)
    with pytest.raises(ValueError):
        metrics.totals.set("prompt_tokens", -5)


@pytest.mark.anyio
async def test_stream_gauges_follow_the_bus(redis_url):
    metrics = Metrics(MODEL)
    async with Bus(redis_url) as bus:
        await bus.publish("hr:requests", *[Abort(f"r{i}") for i in range(9)])
        await bus.ensure_group("hr:requests", "tok")
        await bus.read("tok", "t0", {"hr:requests": ">"}, count=4)
        metrics.set_streams(await bus.stream_infos())
        seen = families(metrics)
        model = ("model_name", MODEL)
        assert seen["headrace:stream_length"] == {(model, ("stream", "hr:requests")): 9}
        key = (("group", "tok"), model, ("stream", "hr:requests"))
        assert seen["headrace:stream_pending"] == {key: 4}
        assert seen["headrace:stream_lag"] == {key: 5}
        await bus.redis.delete("hr:requests")
        metrics.set_streams(await bus.stream_infos())
    assert "headrace:stream_length" not in families(metrics)


# --- per-request histograms, from the stamps the replies carry ---------------------------

# arrival, tokenizer in, tokenizer out (the scheduler has it), the scheduler's first plan
REQUEST_STAMPS = [100.0, 100.001, 100.002, 100.010]


def step_stamps(done: float) -> list[float]:
    """A step's stamps: planned, launched, done on the host, detokenizer in and out."""
    return [done - 0.004, done - 0.003, done, done + 0.001, done + 0.002]


Delivery = tuple[TextDelta, list[float]]


def completion(rid: str, index: int, dones: list[float], stamped: bool = True
               ) -> list[Delivery]:
    """One completion's replies: a token per step, done on the host at `dones`."""
    last = len(dones) - 1
    return [(TextDelta(rid, index, seq, "x", [7], 5, "length" if seq == last else None,
                       request_stamps=REQUEST_STAMPS if seq == 0 and stamped else []),
             step_stamps(done) if stamped else [])
            for seq, done in enumerate(dones)]


def record(metrics: Metrics, call: Call, batches: list[list[Delivery]]) -> None:
    """What the gateway does with each batch of replies (services/gateway/app.py)."""
    for batch in batches:
        applied = [a for delta, stamps in batch for a in call.offer(delta, stamps)]
        seen = call.observe(applied, now=200.0)
        for done in seen.finished:
            metrics.observe_finished("0", done.prompt_tokens, done.generation_tokens,
                                     done.times)
        for rid, prompt_tokens in seen.requests:
            metrics.observe_params("0", call.job.n, 16 - prompt_tokens,
                                   call.most_generated(rid))


def histogram(seen: dict, name: str) -> tuple[float, float] | None:
    """(count, sum) of shard 0's series of headrace:<name>, None without one."""
    if f"headrace:{name}_count" not in seen:
        return None
    return seen[f"headrace:{name}_count"][labels(0)], seen[f"headrace:{name}_sum"][labels(0)]


def test_request_times_need_every_stamp():
    times = request_times(REQUEST_STAMPS, 100.05, 100.09, 3)
    assert times is not None
    assert (times.queue, times.prefill, times.decode, times.inference, times.per_output_token
            ) == pytest.approx((0.008, 0.04, 0.04, 0.08, 0.02))
    assert request_times(REQUEST_STAMPS, 100.05, 100.05, 1).per_output_token is None
    assert request_times(REQUEST_STAMPS[:3], 100.05, 100.09, 3) is None
    assert request_times([0.0, *REQUEST_STAMPS[1:]], 100.05, 100.09, 3) is None
    assert request_times(REQUEST_STAMPS, 0.0, 100.09, 3) is None


def test_each_completion_observes_its_phases_and_each_request_its_params():
    """n=2: two completions of one request, their replies out of order and in batches;
    each completion's queue, prefill, decode, inference and time per output token come from
    its stamps, n and max_tokens once for the request."""
    metrics = Metrics(MODEL, max_model_len=16)
    call = Call(parse_job({"model": "m", "prompt": "hi", "n": 2}, False), "cmpl-x", "m", 1,
                99.0)
    first = completion("cmpl-x", 0, [100.05, 100.07, 100.09])
    second = completion("cmpl-x", 1, [100.05, 100.06])
    record(metrics, call, [[first[1], second[0]], [first[0], second[1]], [first[2]]])
    seen = families(metrics)
    assert histogram(seen, "request_queue_time_seconds") == pytest.approx((2, 0.016))
    assert histogram(seen, "request_prefill_time_seconds") == pytest.approx((2, 0.08))
    assert histogram(seen, "request_decode_time_seconds") == pytest.approx((2, 0.05))
    assert histogram(seen, "request_inference_time_seconds") == pytest.approx((2, 0.13))
    assert histogram(seen, "request_time_per_output_token_seconds") == pytest.approx((2, 0.03))
    assert histogram(seen, "request_prompt_tokens") == (2, 10)
    assert histogram(seen, "request_generation_tokens") == (2, 5)
    assert histogram(seen, "request_params_n") == (1, 2)
    assert histogram(seen, "request_params_max_tokens") == (1, 11)
    assert histogram(seen, "request_max_num_generation_tokens") == (1, 3)  # of 3 and 2
    assert seen["headrace:request_params_n_bucket"][labels(0, le="1.0")] == 0


def test_replies_without_stamps_observe_no_times():
    """The offline engine and older writers do not stamp: the counts are still observed,
    the phases are not; a one-token completion has no time per output token."""
    metrics = Metrics(MODEL)
    call = Call(parse_job({"model": "m", "prompt": ["a", "b"]}, False), "cmpl-y", "m", 1,
                99.0)
    record(metrics, call, [completion("cmpl-y-0", 0, [100.05, 100.06], stamped=False),
                           completion("cmpl-y-1", 0, [100.05])])
    seen = families(metrics)
    assert histogram(seen, "request_generation_tokens") == (2, 3)
    assert histogram(seen, "request_params_n") == (2, 2)
    for phase in ("queue", "prefill", "decode", "inference"):  # only the stamped one
        assert histogram(seen, f"request_{phase}_time_seconds")[0] == 1
    assert histogram(seen, "request_time_per_output_token_seconds") is None


def test_spec_decode_counters_come_from_the_scheduler_stats():
    metrics = Metrics(MODEL)
    stats = SchedulerStats(1, 0, 0.5, 0, 0, 0, 10, 20, spec_decode_num_drafts=4,
                           spec_decode_num_draft_tokens=12, spec_decode_num_accepted_tokens=7,
                           spec_decode_num_accepted_tokens_per_pos=[4, 2, 1])
    metrics.set_scheduler_stats({0: stats})
    seen = families(metrics)
    assert seen["headrace:spec_decode_num_drafts_total"] == {labels(0): 4}
    assert seen["headrace:spec_decode_num_draft_tokens_total"] == {labels(0): 12}
    assert seen["headrace:spec_decode_num_accepted_tokens_total"] == {labels(0): 7}
    assert seen["headrace:spec_decode_num_accepted_tokens_per_pos_total"] == {
        labels(0, position=str(pos)): total for pos, total in enumerate([4, 2, 1])}
