"""Prometheus metrics with vLLM's names, every series labelled `model_name` (the served
model name, as vLLM labels its own).

Every series is exported under the `headrace:` prefix, and each of vLLM's series also under
vLLM's own `vllm:` (the same samples, renamed at scrape time), with the older names that
vLLM's published Grafana dashboard still queries (`vllm:gpu_cache_usage_perc`,
`vllm:time_per_output_token_seconds`): dashboards, alerts and autoscalers written for vLLM
work unchanged, and those written for headrace too. headrace's own series (the stage
histogram, the stream gauges) have no vLLM name and stay `headrace:` only.

Each `Metrics` owns its registries, so tests and several engines in one process never share
counters. Totals that another process keeps (the scheduler's token and cache counters,
which it sends in `SchedulerStats`) are exposed as counters set to the latest absolute value.

Each data-parallel shard's figures are their own series, labelled `shard` (as vLLM labels
its engines): the scheduler's gauges and totals, and the request counters and latency
histograms, which the gateway files under the shard it routed the request to. The stage
histogram and the stream gauges have no shard label: stream names carry their shard.

Each finished completion adds vLLM's per-request histograms (request_queue_time_seconds,
request_prefill_time_seconds, request_decode_time_seconds, request_inference_time_seconds,
request_time_per_output_token_seconds, request_prompt_tokens, request_generation_tokens),
the times only where its messages carried their stamps (common/hops.py); each finished
request (one prompt, all n of its completions) adds request_params_n and
request_params_max_tokens.

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

from common.hops import STAGES, RequestTimes
from common.messages import SchedulerStats

if TYPE_CHECKING:
    from common.bus import StreamInfo

PREFIX = "headrace:"
VLLM_PREFIX = "vllm:"
OWN_SERIES = ("stage_seconds", "stream_length", "stream_pending", "stream_lag",  # not vLLM's
              "process_worst_stall_seconds", "process_stalls", "device_busy_seconds")
# vLLM's older names of a series, which its published dashboard and many rules still read
VLLM_ALIASES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",),
                "inter_token_latency_seconds": ("time_per_output_token_seconds",)}
MODEL_LABEL = "model_name"  # the served model name
SHARD_LABEL = "shard"  # the data-parallel shard (scheduler and worker) a series is about
REQUEST_LABELS = [MODEL_LABEL, SHARD_LABEL]

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
# vLLM's buckets for a request's queue, prefill, decode and inference times are E2E's; a
# request's queue and prefill often take milliseconds here, so they start at one
PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, *E2E_BUCKETS)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10

TOTALS = {
    "num_preemptions": "Cumulative number of preemptions by the scheduler.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "prefix_cache_queries": "Prefix cache queries, in tokens.",
    "prefix_cache_hits": "Prefix cache hits, in tokens.",
    "device_busy_seconds": "Seconds the device spent on the engine's steps (CUDA events from "
                           "each step's forward to its tokens on the host).",
    "spec_decode_num_drafts": "Number of spec decoding drafts (a request's step with drafts).",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}


class TotalsCollector(Collector):
    """Counters whose value is a running total kept by another process, one series per
    shard: `set` takes the absolute total (a restarted source starts again from zero, which
    Prometheus reads as a counter reset); `clear` drops every shard's series."""

    def __init__(self, docs: Mapping[str, str], model_name: str = "") -> None:
        self._docs, self.model_name = dict(docs), model_name
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
            family = CounterMetricFamily(PREFIX + name, doc, labels=REQUEST_LABELS)
            for shard, total in sorted(self._values[name].items()):
                family.add_metric([self.model_name, shard], total)
            yield family


class AcceptedPerPosition(Collector):
    """vLLM's spec_decode_num_accepted_tokens_per_pos: drafts accepted at each position of
    a step's drafts, a running total per shard and position kept by the scheduler."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.totals: dict[str, list[int]] = {}  # shard -> per position

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens at each draft position.",
                                     labels=[*REQUEST_LABELS, "position"])
        for shard, totals in sorted(self.totals.items()):
            for pos, total in enumerate(totals):
                family.add_metric([self.model_name, shard, str(pos)], total)
        yield family


class Metrics:
    def __init__(self, model_name: str, max_model_len: int = 8192) -> None:
        self.model_name = model_name
        self.state = CollectorRegistry()  # read from Redis at scrape time
        self.observed = CollectorRegistry()  # what this process saw, summed over processes
        self._state_series(self.state)
        self._latency_series(self.observed)
        self._request_series(self.observed, max_model_len)
        shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        self._summed = ProcessFiles(Path(shared)) if shared else self.observed

    def _state_series(self, reg: CollectorRegistry) -> None:
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests in the running batch.", REQUEST_LABELS,
            registry=reg)
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
            REQUEST_LABELS, registry=reg)
        self.kv_cache_usage_perc = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).",
            REQUEST_LABELS, registry=reg)
        self.totals = TotalsCollector(TOTALS, self.model_name)
        reg.register(self.totals)
        self.accepted_per_pos = AcceptedPerPosition(self.model_name)
        reg.register(self.accepted_per_pos)
        self.stream_length = Gauge(
            PREFIX + "stream_length", "Entries in a stream.", [MODEL_LABEL, "stream"],
            registry=reg)
        self.stream_pending = Gauge(
            PREFIX + "stream_pending", "Entries delivered to a group and not acknowledged.",
            [MODEL_LABEL, "stream", "group"], registry=reg)
        self.stream_lag = Gauge(
            PREFIX + "stream_lag", "Entries not yet delivered to a group.",
            [MODEL_LABEL, "stream", "group"], registry=reg)
        # a slow stage shows here (its heartbeat, in a thread, still says alive)
        self.process_worst_stall = Gauge(
            PREFIX + "process_worst_stall_seconds",
            "A live process's longest event-loop stall of the last 10 s.",
            [MODEL_LABEL, "process"], registry=reg)
        self.process_stalls = Gauge(
            PREFIX + "process_stalls", "A live process's event-loop stalls of the last 10 s.",
            [MODEL_LABEL, "process"], registry=reg)

    def _latency_series(self, reg: CollectorRegistry) -> None:
        self.request_success = Counter(
            PREFIX + "request_success", "Requests that finished, by finish reason.",
            [*REQUEST_LABELS, "finished_reason"], registry=reg)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to the first token.",
            REQUEST_LABELS, buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between consecutive tokens.",
            REQUEST_LABELS, buckets=ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last token.",
            REQUEST_LABELS, buckets=E2E_BUCKETS, registry=reg)
        stage_seconds = Histogram(
            PREFIX + "stage_seconds", "Time a request or a step spent in one stage of the "
            "serving path, from the timestamps its messages carry (common/hops.py).",
            [MODEL_LABEL, "stage"], buckets=STAGE_BUCKETS, registry=reg)
        self.stages = {stage: stage_seconds.labels(self.model_name, stage) for stage in STAGES}

    def _request_series(self, reg: CollectorRegistry, max_model_len: int) -> None:
        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, REQUEST_LABELS, buckets=tuple(buckets),
                             registry=reg)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from reaching the scheduler to its first "
            "plan.", PHASE_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Time from the first plan to the first token.",
            PHASE_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last.",
            PHASE_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Time from the first plan to the last token "
            "(prefill and decode).", PHASE_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Decode time per output token after "
            "the first.", ITL_BUCKETS)
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens a finished request generated.", tokens)
        self.request_params_n = histogram(
            "request_params_n", "The n of a finished request.", N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens a finished request ran with.",
            tokens)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "The most tokens one of a finished "
            "request's n completions generated.", tokens)

    # --- what the gateway observes --------------------------------------------------------

    def observe(self, histogram: Histogram, shard: str, value: float) -> None:
        histogram.labels(self.model_name, shard).observe(value)

    def count_success(self, shard: str, finished_reason: str) -> None:
        self.request_success.labels(self.model_name, shard, finished_reason).inc()

    def observe_finished(self, shard: str, prompt_tokens: int, generation_tokens: int,
                         times: RequestTimes | None) -> None:
        """A finished completion's counts, and its phases where known."""
        self.observe(self.request_prompt_tokens, shard, prompt_tokens)
        self.observe(self.request_generation_tokens, shard, generation_tokens)
        if times is None:
            return
        for histogram, seconds in ((self.request_queue_time, times.queue),
                                   (self.request_prefill_time, times.prefill),
                                   (self.request_decode_time, times.decode),
                                   (self.request_inference_time, times.inference),
                                   (self.request_time_per_output_token,
                                    times.per_output_token)):
            if seconds is not None:
                self.observe(histogram, shard, seconds)

    def observe_params(self, shard: str, n: int, max_tokens: int,
                       most_generated: int) -> None:
        """A finished request (all n completions): its parameters, and the most tokens one
        of its completions generated."""
        self.observe(self.request_params_n, shard, n)
        self.observe(self.request_params_max_tokens, shard, max_tokens)
        self.observe(self.request_max_num_generation_tokens, shard, most_generated)

    def observe_stages(self, stages: Iterable[tuple[str, float]]) -> None:
        for stage, seconds in stages:
            self.stages[stage].observe(seconds)

    # --- state read at scrape time --------------------------------------------------------

    def set_scheduler_stats(self, stats: Mapping[int, SchedulerStats]) -> None:
        """Gauges and totals from each shard's latest `SchedulerStats`; a shard without
        figures has no series."""
        gauges = (self.num_requests_running, self.num_requests_waiting,
                  self.kv_cache_usage_perc)
        for gauge in gauges:
            gauge.clear()
        self.totals.clear()
        self.accepted_per_pos.totals = {
            str(shard): list(figures.spec_decode_num_accepted_tokens_per_pos)
            for shard, figures in stats.items()}
        for shard, figures in stats.items():
            labels = (self.model_name, str(shard))
            self.num_requests_running.labels(*labels).set(figures.num_running)
            self.num_requests_waiting.labels(*labels).set(figures.num_waiting)
            self.kv_cache_usage_perc.labels(*labels).set(figures.kv_cache_usage)
            for name in TOTALS:
                self.totals.set(name, getattr(figures, name), shard)

    def set_streams(self, streams: Iterable[StreamInfo]) -> None:
        """Replace the per-stream gauges (streams and groups that vanished disappear)."""
        for gauge in (self.stream_length, self.stream_pending, self.stream_lag):
            gauge.clear()
        model = self.model_name
        for stream in streams:
            self.stream_length.labels(model, stream.name).set(stream.length)
            for group in stream.groups:
                self.stream_pending.labels(model, stream.name, group.name).set(group.pending)
                if group.lag is not None:
                    self.stream_lag.labels(model, stream.name, group.name).set(group.lag)

    def set_process_stalls(self, health: Mapping[str, Mapping[str, str]]) -> None:
        """Replace the per-process stall gauges from each live process's hr:health hash
        (common/stalls.py); a process that died drops out with its hash."""
        self.process_worst_stall.clear()
        self.process_stalls.clear()
        for process, fields in health.items():
            worst_ms = float(fields.get("worst_stall_ms", 0))
            self.process_worst_stall.labels(self.model_name, process).set(worst_ms / 1000)
            self.process_stalls.labels(self.model_name, process).set(
                float(fields.get("stalls", 0)))

    def render(self) -> bytes:
        families = [*self.state.collect(), *self._summed.collect()]
        return generate_latest(Families([*families, *vllm_families(families)]))


class Families:
    """Metric families collected once, as generate_latest takes a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def vllm_families(families: Iterable[Metric]) -> Iterator[Metric]:
    """vLLM's series among `families` under vLLM's names (and older aliases)."""
    for family in families:
        base = family.name.removeprefix(PREFIX)
        if base == family.name or base in OWN_SERIES:
            continue
        for name in (base, *VLLM_ALIASES.get(base, ())):
            yield renamed(family, VLLM_PREFIX + name)


def renamed(family: Metric, name: str) -> Metric:
    """A copy of `family` named `name`; its samples keep their suffixes (_total,
    _bucket, ...)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [sample._replace(name=name + sample.name[len(family.name):])
                    for sample in family.samples]
    return copy


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
