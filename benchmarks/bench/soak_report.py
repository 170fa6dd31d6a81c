"""What `headrace bench soak` records and concludes: samples, restarts and request outcomes
in; PASS/FAIL checks, samples.csv, report.md and soak.png out. Everything above the
writers at the end is pure, so the verdicts can be tested on made-up samples.

The growth rule, for every process and for Redis's used_memory: the last sample (taken
after the idle wait) may exceed the warm-up sample by at most the tolerance (default 10%
+ 20 MiB). The warm-up sample is the first one at or after 20% of the run; for a process
the soak restarted, at or after 20% of the new process's own life in the run and at least
SETTLE_S after it was first seen, so a replacement is compared with neither its
predecessor nor itself while loading (one restarted too late for that is skipped).
"""

from __future__ import annotations

import csv
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

MIB = 2**20
OK, ABORTED = "ok", "aborted"
CLIENT_ERROR, SERVER_ERROR = "4xx", "5xx"
STREAM_ERROR, BAD_ANSWER = "stream-error", "bad-answer"
CONNECTION, TIMEOUT = "connection-error", "timeout"
OUTCOMES = (OK, ABORTED, CLIENT_ERROR, SERVER_ERROR, STREAM_ERROR, BAD_ANSWER, CONNECTION,
            TIMEOUT)
INVALID = "invalid"  # the kind of request that must be refused
GAUGES = ("running", "waiting", "kv_cache_usage")
BACKLOG = "backlog"  # pending + lag summed over every consumer group
DEAD_STREAM = "hr:dead"
REPLY_PREFIX = "hr:replies:"
# XADD MAXLEN ~ trims whole radix-tree nodes, of up to 100 entries (stream-node-max-entries)
NODE_SLACK = 100
# a replacement loads its model files for seconds: its RSS before then is no baseline
SETTLE_S = 30.0
# a killed gateway's reply stream may linger this long before someone deletes it
REPLY_STREAM_GRACE_S = 300.0
PROCESS_ORDER = ("launcher", "redis", "worker", "scheduler", "tokenizer", "detokenizer",
                 "gateway")


# --- records ---------------------------------------------------------------------------

@dataclass(slots=True)
class Sample:
    t_s: float  # seconds since the traffic started
    phase: str  # "traffic", or "idle" for the last one, after the traffic stopped
    rss: dict[str, int] = field(default_factory=dict)  # process label -> bytes
    pids: dict[str, int] = field(default_factory=dict)
    redis_used_memory: int | None = None
    streams: dict[str, int] = field(default_factory=dict)  # hr:* stream -> XLEN
    gauges: dict[str, float] = field(default_factory=dict)  # GAUGES and BACKLOG
    healthy: bool = False  # GET /health answered 200

    @property
    def stream_total(self) -> int:
        return sum(self.streams.values())


@dataclass(slots=True)
class Restart:
    t_s: float
    label: str
    old_pid: int
    new_pid: int | None = None  # None: no replacement within the wait
    back_after_s: float | None = None


@dataclass(slots=True)
class Tally:
    counts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, outcome)
    notes: list[str] = field(default_factory=list)  # the first unexpected answers
    max_notes: int = 20

    def add(self, kind: str, outcome: str, note: str = "") -> None:
        self.counts[kind, outcome] += 1
        if not expected(kind, outcome) and len(self.notes) < self.max_notes:
            self.notes.append(f"{kind} -> {outcome}: {note}")

    def total(self, outcome: str, invalid: bool | None = None) -> int:
        """Requests with this outcome; of invalid kinds only, valid only, or all (None)."""
        return sum(n for (kind, o), n in self.counts.items()
                   if o == outcome and (invalid is None or (kind == INVALID) == invalid))

    def kinds(self) -> list[str]:
        return sorted({kind for kind, _ in self.counts})


def expected(kind: str, outcome: str) -> bool:
    """Whether an outcome is what a healthy server gives (connection errors happen while a
    killed gateway restarts; they are counted, not judged)."""
    if outcome == CONNECTION:
        return True
    return outcome == CLIENT_ERROR if kind == INVALID else outcome in (OK, ABORTED)


@dataclass(frozen=True, slots=True)
class Growth:
    ratio: float  # of the warm-up value
    slack_bytes: int

    def allows(self, before: int, after: int) -> bool:
        return after <= before * (1 + self.ratio) + self.slack_bytes

    def __str__(self) -> str:
        return f"{self.ratio:.0%} + {self.slack_bytes / MIB:g} MiB"


@dataclass(frozen=True, slots=True)
class Limits:
    growth: Growth
    warmup_fraction: float
    stream_maxlen: int


@dataclass(frozen=True, slots=True)
class Check:
    verdict: str  # PASS, FAIL or SKIP
    text: str

    @property
    def line(self) -> str:
        return f"{self.verdict}: {self.text}"


def check(passed: bool | None, text: str) -> Check:
    return Check("SKIP" if passed is None else "PASS" if passed else "FAIL", text)


# --- verdicts --------------------------------------------------------------------------

def verdicts(samples: list[Sample], restarts: list[Restart], tally: Tally, limits: Limits,
             exit_code: int | None) -> list[Check]:
    """Every check of the run; `exit_code` is the launcher's on SIGTERM (None: the soak
    drove a server it did not start)."""
    final = samples[-1]
    return [*answer_checks(tally), connection_check(tally, restarts),
            *rss_checks(samples, limits), redis_check(samples, limits),
            *idle_checks(final, limits), reply_stream_check(final, restarts),
            dead_letter_check(samples), restart_check(restarts),
            crash_check(samples, restarts), stop_check(exit_code)]


def answer_checks(tally: Tally) -> list[Check]:
    ok = tally.total(OK, invalid=False)
    broken = sum(tally.total(o) for o in (SERVER_ERROR, STREAM_ERROR, BAD_ANSWER))
    refused, accepted = tally.total(CLIENT_ERROR, invalid=False), tally.total(OK, invalid=True)
    return [check(ok > 0, f"requests succeeded: {ok}"),
            check(broken == 0, f"no 5xx, no error event in a stream, no malformed answer "
                               f"({broken} seen)"),
            check(tally.total(TIMEOUT) == 0,
                  f"no request hung past the timeout ({tally.total(TIMEOUT)} did)"),
            check(refused == 0 and accepted == 0,
                  f"valid requests never refused ({refused} were), invalid ones never "
                  f"accepted ({accepted} were)")]


def connection_check(tally: Tally, restarts: list[Restart]) -> Check:
    """Refused or cut connections are expected only while a killed gateway restarts."""
    errors = tally.total(CONNECTION)
    kills = sum(1 for r in restarts if r.label.startswith("gateway-"))
    return check(errors == 0 or kills > 0, f"connection errors only around gateway kills: "
                                           f"{errors} errors, {kills} gateway kills")


def warmup_sample(samples: list[Sample], label: str | None, fraction: float) -> Sample:
    """The sample to compare the last one with: for a process (`label`), among the samples
    of the pid it has in the last one; for Redis (None), among all."""
    last = samples[-1]
    life = samples if label is None else [s for s in samples
                                          if s.pids.get(label) == last.pids[label]]
    start = life[0].t_s + fraction * (last.t_s - life[0].t_s)
    if life[0] is not samples[0]:  # started during the run: maybe still loading then
        start = max(start, life[0].t_s + SETTLE_S)
    return next((s for s in life if s.t_s >= start), last)


def rss_checks(samples: list[Sample], limits: Limits) -> list[Check]:
    last = samples[-1]
    if not last.rss:
        return [check(None, "RSS: no headrace process found on this machine")]
    checks = []
    for label in sorted(last.rss, key=process_order):
        warm = warmup_sample(samples, label, limits.warmup_fraction)
        if warm is last:
            checks.append(check(None, f"RSS of {label}: restarted too late to judge"))
            continue
        before, after = warm.rss[label], last.rss[label]
        text = (f"RSS of {label}: {before / MIB:.1f} MiB at {clock(warm.t_s)} -> "
                f"{after / MIB:.1f} MiB at the end (tolerance {limits.growth})")
        checks.append(check(limits.growth.allows(before, after), text))
    return checks


def redis_check(samples: list[Sample], limits: Limits) -> Check:
    known = [s for s in samples if s.redis_used_memory is not None]
    if not known or known[-1] is not samples[-1]:
        return check(None, "Redis memory: Redis could not be read at the end")
    warm = warmup_sample(known, None, limits.warmup_fraction)
    before, after = warm.redis_used_memory or 0, samples[-1].redis_used_memory or 0
    return check(limits.growth.allows(before, after),
                 f"Redis used_memory bounded: {before / MIB:.1f} MiB at {clock(warm.t_s)} -> "
                 f"{after / MIB:.1f} MiB at the end (tolerance {limits.growth})")


def idle_checks(final: Sample, limits: Limits) -> list[Check]:
    gauges = {name: final.gauges.get(name) for name in GAUGES}
    shown = ", ".join(f"{name}={value}" for name, value in gauges.items())
    backlog = final.gauges.get(BACKLOG)
    cap = limits.stream_maxlen + NODE_SLACK
    longest = max(final.streams.items(), key=lambda kv: kv[1], default=("none", 0))
    return [check(all(v == 0 for v in gauges.values()), f"gauges 0 when idle: {shown}"),
            check(backlog == 0, f"streams drained when idle: pending + lag over every "
                                f"consumer group = {backlog}"),
            check(bool(final.streams) and longest[1] <= cap,
                  f"streams bounded when idle: longest {longest[0]} = {longest[1]} entries "
                  f"(cap: --stream-maxlen {limits.stream_maxlen} + {NODE_SLACK})")]


def reply_stream_check(final: Sample, restarts: list[Restart]) -> Check:
    """One reply stream per running gateway, plus those of gateways killed lately."""
    replies = [name for name in final.streams if name.startswith(REPLY_PREFIX)]
    running = sum(1 for label in final.rss if label.startswith("gateway-"))
    recent = sum(1 for r in restarts if r.label.startswith("gateway-")
                 and final.t_s - r.t_s < REPLY_STREAM_GRACE_S)
    if not final.rss:
        return check(None, f"reply streams: {len(replies)} (gateways unknown)")
    return check(len(replies) <= running + recent,
                 f"no leaked reply streams: {len(replies)} for {running} running gateways "
                 f"and {recent} killed in the last {REPLY_STREAM_GRACE_S:.0f} s")


def dead_letter_check(samples: list[Sample]) -> Check:
    first, last = (s.streams.get(DEAD_STREAM, 0) for s in (samples[0], samples[-1]))
    return check(last <= first, f"no dead letters: {DEAD_STREAM} {first} -> {last} entries")


def restart_check(restarts: list[Restart]) -> Check:
    if not restarts:
        return check(None, "restarts: none made")
    back = [r for r in restarts if r.new_pid is not None]
    slowest = max((r.back_after_s or 0.0 for r in back), default=0.0)
    return check(len(back) == len(restarts),
                 f"every killed child came back: {len(back)} of {len(restarts)} "
                 f"(slowest {slowest:.1f} s)")


def unplanned_restarts(samples: list[Sample], restarts: list[Restart]) -> list[str]:
    """Processes whose pid changed between two samples without the soak killing them."""
    killed = {r.old_pid for r in restarts}
    seen: dict[str, int] = {}
    found: list[str] = []
    for sample in samples:
        for label, pid in sample.pids.items():
            if seen.get(label, pid) != pid and seen[label] not in killed:
                found.append(f"{label} (pid {seen[label]}, gone by {clock(sample.t_s)})")
            seen[label] = pid
    return found


def crash_check(samples: list[Sample], restarts: list[Restart]) -> Check:
    if not any(s.pids for s in samples):
        return check(None, "crashes: no headrace process found on this machine")
    found = unplanned_restarts(samples, restarts)
    return check(not found, f"no process died on its own: {', '.join(found) or 'none did'}")


def stop_check(exit_code: int | None) -> Check:
    if exit_code is None:
        return check(None, "clean stop: not the soak's server")
    return check(exit_code == 0, f"the launcher stopped cleanly on SIGTERM (exit {exit_code})")


# --- formatting ------------------------------------------------------------------------

def clock(t_s: float) -> str:
    minutes, seconds = divmod(int(round(t_s)), 60)
    return f"{minutes}:{seconds:02d}"


def process_order(label: str) -> tuple[int, str]:
    name = label.rsplit("-", 1)[0]
    rank = PROCESS_ORDER.index(name) if name in PROCESS_ORDER else len(PROCESS_ORDER)
    return rank, label


def process_labels(samples: list[Sample]) -> list[str]:
    return sorted({label for s in samples for label in s.rss}, key=process_order)


def csv_row(sample: Sample) -> dict[str, object]:
    row: dict[str, object] = {"t_s": round(sample.t_s, 1), "phase": sample.phase,
                              "healthy": int(sample.healthy),
                              "redis_used_memory": sample.redis_used_memory,
                              "stream_count": len(sample.streams),
                              "stream_total": sample.stream_total}
    row |= {name: sample.gauges.get(name) for name in (*GAUGES, BACKLOG)}
    row |= {f"rss:{label}": rss for label, rss in sample.rss.items()}
    row |= {f"pid:{label}": pid for label, pid in sample.pids.items()}
    return row | {f"xlen:{name}": n for name, n in sample.streams.items()}


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def mib(value: int | None) -> str:
    return "" if value is None else f"{value / MIB:.0f}"


def gauge(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def samples_table(samples: list[Sample]) -> str:
    labels = process_labels(samples)
    header = ["t", "phase", "health", *(f"{label} MiB" for label in labels), "Redis MiB",
              "streams", "entries", *GAUGES, BACKLOG]
    rows = [[clock(s.t_s), s.phase, "up" if s.healthy else "DOWN",
             *(mib(s.rss.get(label)) for label in labels), mib(s.redis_used_memory),
             str(len(s.streams)), str(s.stream_total),
             *(gauge(s.gauges.get(name)) for name in (*GAUGES, BACKLOG))] for s in samples]
    return markdown_table(header, rows)


def outcomes_table(tally: Tally) -> str:
    rows = [[kind, *(str(tally.counts[kind, o]) for o in OUTCOMES)] for kind in tally.kinds()]
    rows.append(["all", *(str(tally.total(o)) for o in OUTCOMES)])
    return markdown_table(["kind", *OUTCOMES], rows)


def restarts_table(restarts: list[Restart]) -> str:
    if not restarts:
        return "None."
    rows = [[clock(r.t_s), r.label, str(r.old_pid), str(r.new_pid or "not back"),
             "" if r.back_after_s is None else f"{r.back_after_s:.1f}"] for r in restarts]
    return markdown_table(["t", "killed (-9)", "old pid", "new pid", "back after s"], rows)


def format_report(command: str, machine: str, samples: list[Sample], restarts: list[Restart],
                  tally: Tally, checks: list[Check]) -> str:
    failed = any(c.verdict == "FAIL" for c in checks)
    parts = ["# headrace bench soak", "", f"Command: `{command}`", "", f"Machine: {machine}", "",
             f"Result: **{'FAIL' if failed else 'PASS'}**", "", "## Checks", "",
             *(f"- {c.line}" for c in checks), "", "## Request outcomes", "",
             outcomes_table(tally), "", "## Restarts", "", restarts_table(restarts), "",
             "## Samples", "", "RSS in MiB per process label; `entries`: XLEN summed over "
             "the hr:* streams; gauges from the gateway's /metrics.", "",
             samples_table(samples), ""]
    if tally.notes:
        parts += ["## Unexpected answers (the first few)", "",
                  *(f"- {note}" for note in tally.notes), ""]
    return "\n".join(parts)


# --- writers -----------------------------------------------------------------------------

def write_csv(path: Path, samples: list[Sample]) -> None:
    rows = [csv_row(s) for s in samples]
    columns = list(dict.fromkeys(name for row in rows for name in row))
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, samples: list[Sample], restarts: list[Restart], title: str,
         marked: str = "a child killed") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.t_s / 60 for s in samples]
    fig, (rss, redis, streams) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for label in process_labels(samples):
        rss.plot(minutes, [s.rss[label] / MIB if label in s.rss else None for s in samples],
                 marker=".", label=label)
    rss.set_ylabel("RSS (MiB)")
    rss.legend(fontsize=7, ncol=3)
    redis.plot(minutes, [None if s.redis_used_memory is None else s.redis_used_memory / MIB
                         for s in samples], marker=".", color="tab:red")
    redis.set_ylabel("Redis used_memory (MiB)")
    streams.plot(minutes, [s.stream_total for s in samples], marker=".", color="tab:green")
    streams.set_ylabel("entries in hr:* streams")
    streams.set_xlabel("minutes since the traffic started")
    for ax in (rss, redis, streams):
        for r in restarts:
            ax.axvline(r.t_s / 60, color="grey", linestyle=":", linewidth=0.8)
    fig.suptitle(textwrap.fill(f"{title} (dotted: {marked})", 110), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
