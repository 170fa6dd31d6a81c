"""The server's own account of a benchmark run, from Prometheus /metrics expositions
scraped before and after it: where requests spent their time (the `headrace:stage_seconds`
histogram, one series per `stage` label), how much of the prompts each shard's prefix
cache held (the prefix_cache_queries/hits counters, one series per `shard` label) and how
long the GPUs worked on the steps (`headrace:device_busy_seconds`, summed over shards). The
difference of the two scrapes is the run's share, so whatever the server served before
does not count; p50 and p90 are estimated from the buckets as Prometheus'
histogram_quantile does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

STAGE_HISTOGRAM = "headrace:stage_seconds"
STAGE_LABEL = "stage"
# Whole-request histograms shown beside the stages: what of the client's TTFT the gateway
# saw (from the request's arrival to its first reply), the rest being HTTP and the client.
ROWS_OF = {"headrace:time_to_first_token_seconds": "gateway_ttft"}
CACHE_COUNTERS = {"headrace:prefix_cache_queries": "queries",
                  "headrace:prefix_cache_hits": "hits"}
DEVICE_BUSY = "headrace:device_busy_seconds"


@dataclass(slots=True)
class StageSeries:
    """One stage's cumulative histogram, summed over any labels besides the stage."""
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative
    count: float = 0.0
    sum: float = 0.0

    def since(self, earlier: StageSeries | None) -> StageSeries:
        """What was observed between `earlier` (a scrape before, or None) and this."""
        if earlier is None:
            return self
        return StageSeries({le: n - earlier.buckets.get(le, 0.0)
                            for le, n in self.buckets.items()},
                           self.count - earlier.count, self.sum - earlier.sum)


@dataclass(frozen=True, slots=True)
class StageStats:
    stage: str
    count: int
    mean_ms: float
    p50_ms: float  # estimated from the buckets
    p90_ms: float


def parse_stages(exposition: str) -> dict[str, StageSeries]:
    """The stage histogram's series by stage, in the order the exposition lists them, then
    those of ROWS_OF; empty where it has none of them or is not Prometheus text at all."""
    stages: dict[str, StageSeries] = {}
    try:
        families = [f for f in text_string_to_metric_families(exposition)
                    if f.name in (STAGE_HISTOGRAM, *ROWS_OF) and f.type == "histogram"]
    except ValueError:  # a page that is not an exposition
        return {}
    families.sort(key=lambda f: f.name != STAGE_HISTOGRAM)
    for family, sample in ((f, s) for f in families for s in f.samples):
        stage = ROWS_OF.get(family.name) or sample.labels.get(STAGE_LABEL)
        if stage is None:
            continue
        series = stages.setdefault(stage, StageSeries())
        if sample.name.endswith("_bucket"):
            le = float(sample.labels["le"])
            series.buckets[le] = series.buckets.get(le, 0.0) + sample.value
        elif sample.name.endswith("_count"):
            series.count += sample.value
        elif sample.name.endswith("_sum"):
            series.sum += sample.value
    return stages


def bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """Prometheus' histogram_quantile over cumulative buckets: find the bucket holding the
    q-th observation and interpolate linearly inside it (the first bucket starts at 0; a
    rank in the +Inf bucket gives the highest finite bound)."""
    rank = q * buckets[max(buckets)]  # the +Inf bucket counts every observation
    lower = below = 0.0
    for upper in sorted(buckets):
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def stage_breakdown(before: str | None, after: str) -> list[StageStats]:
    """Per stage observed between the two scrapes (`before` None: everything in `after`),
    in the order `after` lists the stages."""
    start = parse_stages(before) if before is not None else {}
    rows = []
    for stage, series in parse_stages(after).items():
        run = series.since(start.get(stage))
        if run.count > 0 and run.buckets:
            rows.append(StageStats(stage, round(run.count), 1000 * run.sum / run.count,
                                   1000 * bucket_quantile(0.5, run.buckets),
                                   1000 * bucket_quantile(0.9, run.buckets)))
    return rows


def format_stages(rows: list[StageStats]) -> str:
    name_width = max(len("Stage"), *(len(r.stage) for r in rows)) + 2
    width = name_width + 8 + 3 * 11
    lines = [" Server-side stages (from /metrics) ".center(width, "="),
             f"{'Stage':<{name_width}}{'count':>8}{'mean ms':>11}{'p50 ms':>11}{'p90 ms':>11}"]
    lines += [f"{r.stage:<{name_width}}{r.count:>8}{r.mean_ms:>11.2f}{r.p50_ms:>11.2f}"
              f"{r.p90_ms:>11.2f}" for r in rows]
    lines.append("=" * width)
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PrefixCache:
    """Prompt tokens one shard looked up in its prefix cache during the run, and found."""
    shard: str
    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def parse_counters(exposition: str, names: dict[str, str]) -> dict[tuple[str, str], float]:
    """{(shard, names[family]): total} of the counter families `names` keys; empty for a
    page that is not an exposition."""
    totals: dict[tuple[str, str], float] = {}
    try:
        families = list(text_string_to_metric_families(exposition))
    except ValueError:
        return {}
    for family in families:
        if family.name in names:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (sample.labels.get("shard", ""), names[family.name])
                    totals[key] = sample.value
    return totals


def parse_cache_counters(exposition: str) -> dict[tuple[str, str], float]:
    """{(shard, "queries" | "hits"): total}."""
    return parse_counters(exposition, CACHE_COUNTERS)


def device_busy(before: str | None, after: str | None) -> float | None:
    """Seconds the servers' GPUs worked on steps between the two scrapes, summed over
    shards; None where the server keeps no such counter or the last scrape failed."""
    end = {} if after is None else parse_counters(after, {DEVICE_BUSY: "busy"})
    if not end:
        return None
    start = parse_counters(before, {DEVICE_BUSY: "busy"}) if before is not None else {}
    return sum(total - start.get(key, 0.0) for key, total in end.items())


def prefix_cache_use(before: str | None, after: str) -> list[PrefixCache]:
    """Each shard's prefix-cache queries and hits between the two scrapes."""
    start = parse_cache_counters(before) if before is not None else {}
    end = parse_cache_counters(after)
    shards = sorted({shard for shard, _ in end}, key=lambda s: (len(s), s))
    return [PrefixCache(shard, *(round(end.get((shard, k), 0.0) - start.get((shard, k), 0.0))
                                 for k in ("queries", "hits"))) for shard in shards]


def format_prefix_cache(rows: list[PrefixCache]) -> str:
    total = PrefixCache("all", sum(r.queries for r in rows), sum(r.hits for r in rows))
    shards = ", ".join(f"shard {r.shard}: {r.hit_rate:.1%} of {r.queries}" for r in rows)
    return (f"Prefix cache hit rate: {total.hit_rate:.1%} of {total.queries} prompt tokens "
            f"({shards})")


def format_device_busy(busy_s: float, duration_s: float) -> str:
    share = busy_s / duration_s if duration_s > 0 else 0.0
    return f"GPU busy on steps: {busy_s:.2f} s of the run's {duration_s:.2f} s ({share:.1%})"
