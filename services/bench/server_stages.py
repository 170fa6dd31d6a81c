"""The server's own account of where requests spent their time: the `headrace:stage_seconds`
histogram of a Prometheus /metrics exposition (one series per `stage` label), scraped
before and after a benchmark run. The difference of the two scrapes is the run's share, so
whatever the server served before does not count; p50 and p90 are estimated from the
buckets as Prometheus' histogram_quantile does.
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
