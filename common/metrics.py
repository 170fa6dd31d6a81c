"""Prometheus metrics with vLLM's names under the `headrace:` prefix.

Each `Metrics` owns its registries, so tests and several engines in one process never share
counters. Totals that another process keeps (the scheduler's token and cache counters,
which it sends in `SchedulerStats`) are exposed as counters set to the latest absolute value.

Each data-parallel shard's figures are their own series, labelled `shard` (as vLLM labels
its engines): the scheduler's gauges and totals, and the request counters and latency
histograms, which the gateway files under the shard it routed the request to. The stage
histogram and the stream gauges are not labelled: stream names carry their shard already.

Several gateway processes on one host (`--api-server-count N`) share one port, so a scrape
lands on any of them. With PROMETHEUS_MULTIPROC_DIR set (the launcher sets it), each writes
what it observes (request counters and latency histograms) to prometheus-client's files
there, and every scrape sums all processes' files; the state read from Redis at scrape
time (scheduler gauges and totals, stream gauges) is the same for all and is not summed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from common.hops import STAGES
from common.messages import SchedulerStats

if TYPE_CHECKING:
    from common.bus import StreamInfo

PREFIX = "headrace:"
SHARD_LABEL = "shard"  # the data-parallel shard (scheduler and worker) a series is about

# vLLM's buckets: first tokens take milliseconds to minutes, the gaps between tokens
# milliseconds to seconds; ITL starts lower, since a small model decodes in 2-10 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# a hop between processes takes tens of microseconds to milliseconds; a step up to seconds
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
                 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

TOTALS = {
    "num_preemptions": "Cumulative number of preemptions by the scheduler.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_cache_queries": "Prefix cache queries, in tokens.",
    "prefix_cache_hits": "Prefix cache hits, in tokens.",
}


class TotalsCollector(Collector):
    """Counters whose value is a running total kept by another process, one series per
    shard: `set` takes the absolute total (a restarted source starts again from zero, which
    Prometheus reads as a counter reset); `clear` drops every shard's series."""

    def __init__(self, docs: Mapping[str, str]) -> None:
        self._docs = dict(docs)
        self._values: dict[str, dict[str, float]] = {name: {} for name in docs}

    def set(self, name: str, total: float, shard: int = 0) -> None:
        if name not in self._docs:
            raise KeyError(f"unknown counter {name!r}; known: {sorted(self._docs)}")
        if total < 0:
            raise ValueError(f"a counter total is never negative, got {name}={total}")
        self._values[name][str(shard)] = float(total)

    def value(self, name: str, shard: int = 0) -> float:
        return self._values[name][str(shard)]

    def clear(self) -> None:
        for series in self._values.values():
            series.clear()

    def collect(self) -> Iterator[Metric]:
        for name, doc in self._docs.items():
            family = CounterMetricFamily(PREFIX + name, doc, labels=[SHARD_LABEL])
            for shard, total in sorted(self._values[name].items()):
                family.add_metric([shard], total)
            yield family


class Metrics:
    def __init__(self) -> None:
        self.state = CollectorRegistry()  # read from Redis at scrape time
        self.observed = CollectorRegistry()  # what this process saw, summed over processes
        reg = self.state
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch.", [SHARD_LABEL],
            registry=reg)
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
            [SHARD_LABEL], registry=reg)
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
            [SHARD_LABEL], registry=reg)
        self.totals = TotalsCollector(TOTALS)
        reg.register(self.totals)
        self.stream_length = Gauge(
            PREFIX + "stream_length", "Entries in a stream.", ["stream"], registry=reg)
        self.stream_pending = Gauge(
            PREFIX + "stream_pending", "Entries delivered to a group and not acknowledged.",
            ["stream", "group"], registry=reg)
        self.stream_lag = Gauge(
            PREFIX + "stream_lag", "Entries not yet delivered to a group.",
            ["stream", "group"], registry=reg)
        reg = self.observed
        self.request_success = Counter(
            PREFIX + "request_success", "Requests that finished, by finish reason.",
            ["finished_reason", SHARD_LABEL], registry=reg)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to the first token.",
            [SHARD_LABEL], buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.",
            [SHARD_LABEL], buckets=ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            [SHARD_LABEL], buckets=E2E_BUCKETS, registry=reg)
        stage_seconds = Histogram(
            PREFIX + "stage_seconds", "Time a request or a step spent in one stage of the "
            "serving path, from the timestamps its messages carry (common/hops.py).",
            ["stage"], buckets=STAGE_BUCKETS, registry=reg)
        self.stages = {stage: stage_seconds.labels(stage) for stage in STAGES}
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self._summed = ProcessFiles(Path(shared)) if shared else self.observed

    def set_scheduler_stats(self, stats: Mapping[int, SchedulerStats]) -> None:
        """Gauges and totals from each shard's latest `SchedulerStats`; a shard without
        figures has no series."""
        gauges = (self.num_requests_running, self.num_requests_waiting,
                  self.kv_cache_usage_perc)
        for gauge in gauges:
            gauge.clear()
        self.totals.clear()
        for shard, figures in stats.items():
            self.num_requests_running.labels(shard).set(figures.num_running)
            self.num_requests_waiting.labels(shard).set(figures.num_waiting)
            self.kv_cache_usage_perc.labels(shard).set(figures.kv_cache_usage)
            for name in TOTALS:
                self.totals.set(name, getattr(figures, name), shard)

    def observe_stages(self, stages: Iterable[tuple[str, float]]) -> None:
        for stage, seconds in stages:
            self.stages[stage].observe(seconds)

    def set_streams(self, streams: Iterable[StreamInfo]) -> None:
        """Replace the per-stream gauges (streams and groups that vanished disappear)."""
        for gauge in (self.stream_length, self.stream_pending, self.stream_lag):
            gauge.clear()
        for stream in streams:
            self.stream_length.labels(stream.name).set(stream.length)
            for group in stream.groups:
                self.stream_pending.labels(stream.name, group.name).set(group.pending)
                if group.lag is not None:
                    self.stream_lag.labels(stream.name, group.name).set(group.lag)

    def render(self) -> bytes:
        return generate_latest(self.state) + generate_latest(self._summed)


class ProcessFiles:
    """The counters and histograms that every process sharing `path` has written.

    Gauges are left out: prometheus-client writes them there too in multiprocess mode,
    but ours are set at scrape time from Redis, so this process's own are current."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def collect(self) -> Iterable[Metric]:
        files = sorted(str(f) for kind in ("counter", "histogram")
                       for f in self.path.glob(f"{kind}_*.db"))
        return MultiProcessCollector.merge(files, accumulate=True)
