"""`headrace bench soak --hosts N`: the soak across simulated hosts (benchmarks/bench/hosts.py:
N network namespaces on a bridge, each a `headrace serve` with one data-parallel shard,
against a 3-master Redis Cluster on the bridge). Needs root.

    sudo headrace bench soak --hosts 2 --duration-s 1800 --out soak-hosts

The clients are spread over the hosts' gateways (client i sends to host i mod N). Besides
the mixed traffic of `headrace bench soak`, a quarter of the calls are greedy streams of a
few fixed prompts whose text is known from before the first fault: one that comes back
longer than it should, or repeats a piece, counts as a duplicated delivery, any other
difference as a wrong text (both must stay 0). Every --fault-every-s one random fault hits
one random host: its link cut for 20 s, its processes all killed (started again 10 s
later), or 10% loss and 200 ms latency each way for 30 s (lossy-link: tc netem, or where
the kernel has none a user-space forwarder spliced into the link; the report says which,
or why it was left out). Failed requests are counted with their reason; they may only
end while a fault lasts, until its host answers again, or within GRACE_S after. The memory
of every process of every host and of every Redis node is sampled as in the single-host
soak, with the same growth rule, plot and report."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import signal
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import psutil
import uvloop

from benchmarks.bench.hosts import (SimulatedHosts, link_impairment_kind,
                                   why_no_link_impairment, why_no_namespaces)
from benchmarks.bench.serve import SseDecoder, metrics_url, redacted, scrape
from benchmarks.bench.soak import (CONNECTION_BACKOFF_S, Call, Target, event_outcome,
                                   headrace_processes, learn_target, machine, memory_of,
                                   metrics_gauges, plan_call, progress_line, redis_state,
                                   send, wait_or_stop)
from benchmarks.bench.soak_report import (ABORTED, BAD_ANSWER, CLIENT_ERROR, CONNECTION,
                                          INVALID, OK, OUTCOMES, SERVER_ERROR, TIMEOUT,
                                          Check, Limits, Restart, Sample, Tally,
                                          check, clock, dead_letter_check, idle_checks,
                                          markdown_table, plot, redis_check, rss_checks,
                                          samples_table, write_csv)
from common.redis_cluster import plain_client

DUPLICATED, WRONG_TEXT = "duplicated", "wrong-text"
HOST_OUTCOMES = (*OUTCOMES, DUPLICATED, WRONG_TEXT)
GREEDY = "greedy-stream"
GREEDY_SHARE = 0.25
GREEDY_PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 5, 8,",
                  "Once upon a time", "Roses are red,", "import numpy as np",
                  "Dear Sir,", "SELECT * FROM")
LOSSY_LINK = "lossy-link"  # 10% loss and 200 ms latency each way
FAULTS = {"link-cut": 20.0, "host-killed": 10.0, LOSSY_LINK: 30.0}  # kind -> seconds held
GRACE_S = 60.0  # a failure this long after a fault healed is no longer the fault's
BACK_WAIT_S = 300.0  # a healed host answers /health again this soon


# --- the plan (pure) ----------------------------------------------------------------------

@dataclass(slots=True)
class Fault:
    t_s: float
    kind: str
    host: int
    healed_s: float | None = None
    back_after_s: float | None = None  # from the healing to the host's /health 200

    def covers(self, t_s: float) -> bool:
        """Whether a failure ending at `t_s` may be this fault's: until GRACE_S after the
        host answered again (a killed host's serve takes minutes to load on a busy CPU)."""
        if self.healed_s is None or self.back_after_s is None:
            return self.t_s <= t_s
        return self.t_s <= t_s <= self.healed_s + self.back_after_s + GRACE_S


def plan_fault(rng: random.Random, hosts: int, kinds: list[str]) -> tuple[str, int]:
    return rng.choice(kinds), rng.randrange(hosts)


def fault_kinds() -> tuple[list[str], str]:
    """The faults this machine can make, and a line on any it cannot."""
    if (reason := why_no_link_impairment()) is not None:
        return sorted(set(FAULTS) - {LOSSY_LINK}), f"{LOSSY_LINK} left out: {reason}"
    how = ("tc netem" if link_impairment_kind() == "netem"
           else "a user-space forwarder (the kernel has no netem)")
    return sorted(FAULTS), f"all faults available; {LOSSY_LINK} by {how}"


def greedy_call(rng: random.Random, target: Target) -> Call:
    body = {"model": target.model, "prompt": rng.choice(GREEDY_PROMPTS),
            "max_tokens": target.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    return Call(GREEDY, "/v1/completions", body, True)


def text_outcome(text: str, reference: str) -> str:
    """A greedy stream's text against the one served before any fault."""
    if text == reference:
        return OK
    if len(text) > len(reference) or repeats_a_piece(text, reference):
        return DUPLICATED
    return WRONG_TEXT


def repeats_a_piece(text: str, reference: str) -> bool:
    """`text` is the reference with some piece of it given twice (at least 2 characters)."""
    for start in range(len(text)):
        for end in range(start + 2, len(text) + 1):
            piece = text[start:end]
            if text[:end] + text[end:].replace(piece, "", 1) == reference:
                return True
    return False


def reason_of(outcome: str, note: str) -> str:
    """A failure's reason, with the numbers and ids that make each one different hidden."""
    return f"{outcome}: " + re.sub(r"[0-9a-f]{8,}|\d+", "#", note)[:120]


# --- the traffic ------------------------------------------------------------------------------

@dataclass(slots=True)
class HostTally:
    tally: Tally = field(default_factory=Tally)
    reasons: Counter[str] = field(default_factory=Counter)
    failed_at: list[float] = field(default_factory=list)  # t_s of each failed valid call

    def add(self, kind: str, outcome: str, note: str, t_s: float) -> None:
        self.tally.add(kind, outcome, note)
        failed = outcome not in (OK, ABORTED) and not (kind == INVALID
                                                       and outcome == CLIENT_ERROR)
        if failed:
            self.reasons[reason_of(outcome, note)] += 1
            self.failed_at.append(t_s)


async def read_text(response: aiohttp.ClientResponse) -> tuple[str, str, str]:
    """A stream's outcome, note and the text of its deltas."""
    decoder, text = SseDecoder(), []
    async for data in response.content.iter_any():
        for payload in decoder.feed(data):
            if (outcome := event_outcome(payload)) is not None:
                return outcome, payload[:200], "".join(text)
            text.append(json.loads(payload)["choices"][0]["text"])
    return BAD_ANSWER, "the stream ended without [DONE]", "".join(text)


async def send_greedy(session: aiohttp.ClientSession, root: str, call: Call,
                      references: dict[str, str]) -> tuple[str, str]:
    try:
        async with session.post(root + call.path, json=call.body) as response:
            if response.status != 200:
                return (CLIENT_ERROR if response.status < 500 else SERVER_ERROR,
                        f"{response.status} {(await response.text())[:200]}")
            outcome, note, text = await read_text(response)
    except asyncio.TimeoutError:
        return TIMEOUT, call.path
    except (aiohttp.ClientError, OSError) as e:
        return CONNECTION, f"{type(e).__name__}: {e}"
    if outcome != OK:
        return outcome, note
    reference = references[call.body["prompt"]]
    found = text_outcome(text, reference)
    return found, "" if found == OK else f"{text[:80]!r} for {reference[:80]!r}"


@dataclass(slots=True)
class Drive:
    hosts: SimulatedHosts
    session: aiohttp.ClientSession
    target: Target
    references: dict[str, str]
    kinds: list[str]
    started: float = field(default_factory=time.monotonic)
    tally: HostTally = field(default_factory=HostTally)
    faults: list[Fault] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)

    def now(self) -> float:
        return time.monotonic() - self.started


async def client(drive: Drive, host: int, rng: random.Random, stop: asyncio.Event) -> None:
    root = drive.hosts.members[host].url
    while not stop.is_set():
        if rng.random() < GREEDY_SHARE:
            call = greedy_call(rng, drive.target)
            outcome, note = await send_greedy(drive.session, root, call, drive.references)
        else:
            call = plan_call(rng, drive.target)
            outcome, note = await send(drive.session, root, call)
        drive.tally.add(call.kind, outcome, f"host {host}: {note}", drive.now())
        if outcome == CONNECTION:
            await asyncio.sleep(CONNECTION_BACKOFF_S)


async def learn_references(session: aiohttp.ClientSession, root: str, target: Target
                           ) -> dict[str, str]:
    """The greedy texts, from host 0 before any fault."""
    references = {}
    for prompt in GREEDY_PROMPTS:
        call = greedy_call(random.Random(0), target)
        body = dict(call.body, prompt=prompt)
        async with session.post(root + call.path, json=body) as response:
            response.raise_for_status()
            outcome, note, text = await read_text(response)
        if outcome != OK:
            raise RuntimeError(f"the reference for {prompt!r} failed: {note}")
        references[prompt] = text
    return references


# --- the faults ---------------------------------------------------------------------------

def fault_actions(hosts: SimulatedHosts, kind: str, i: int
                  ) -> tuple[Callable[[], None], Callable[[], None]]:
    if kind == "link-cut":
        return (lambda: hosts.cut_link(i)), (lambda: hosts.restore_link(i))
    if kind == "host-killed":
        return (lambda: hosts.kill_host(i)), (lambda: hosts.start(i))
    return (lambda: hosts.degrade_link(i, 10, 200)), (lambda: hosts.heal_link(i))


async def one_fault(drive: Drive, rng: random.Random) -> None:
    kind, i = plan_fault(rng, drive.hosts.hosts, drive.kinds)
    fault = Fault(drive.now(), kind, i)
    drive.faults.append(fault)
    hurt, heal = fault_actions(drive.hosts, kind, i)
    print(f"soak {fault.t_s:7.0f}s  fault {kind} on host {i}", flush=True)
    await asyncio.to_thread(hurt)
    await asyncio.sleep(FAULTS[kind])
    await asyncio.to_thread(heal)
    fault.healed_s = drive.now()
    while drive.now() - fault.healed_s < BACK_WAIT_S:
        if await asyncio.to_thread(drive.hosts.healthy, i):
            fault.back_after_s = drive.now() - fault.healed_s
            return
        await asyncio.sleep(1.0)


async def faults_until(drive: Drive, every_s: float, rng: random.Random,
                       stop: asyncio.Event) -> None:
    n = 0
    while True:
        n += 1
        await wait_or_stop(stop, n * every_s - drive.now())
        if stop.is_set():
            return
        await one_fault(drive, rng)  # the next one waits until this host is back


# --- samples ------------------------------------------------------------------------------

def all_processes(hosts: SimulatedHosts) -> dict[str, psutil.Process]:
    """Every host's launcher (launcher-I) and children, and every Redis node (redis-PORT)."""
    found: dict[str, psutil.Process] = {}
    for host in hosts.members:
        if host.process is None:
            continue
        try:
            launcher = psutil.Process(host.process.pid)
        except psutil.Error:
            continue
        for label, process in headrace_processes(launcher).items():
            found[f"launcher-{host.index}" if label == "launcher" else label] = process
    assert hosts.cluster is not None
    for port, node in hosts.cluster.by_port.items():
        try:
            found[f"redis-{port}"] = psutil.Process(node.pid)
        except psutil.Error:
            continue
    return found


async def take_sample(drive: Drive, redis: Any, phase: str) -> Sample:
    t_s = drive.now()
    rss, pids = memory_of(all_processes(drive.hosts))
    used, streams = await redis_state(redis)
    up = [await asyncio.to_thread(drive.hosts.healthy, i) for i in range(drive.hosts.hosts)]
    gauges: dict[str, float] = {}
    if any(up):  # the gauges are the schedulers' (every shard's): any gateway serves them
        root = drive.hosts.members[up.index(True)].url
        gauges = metrics_gauges(await scrape(drive.session, metrics_url(root)))
    return Sample(t_s, phase, rss, pids, used, streams, gauges, all(up))


async def sample_until(drive: Drive, redis: Any, every_s: float, stop: asyncio.Event) -> None:
    n = 0
    while not stop.is_set():
        drive.samples.append(await take_sample(drive, redis, "traffic"))
        print(progress_line(drive.samples[-1]), flush=True)
        n += 1
        await wait_or_stop(stop, n * every_s - drive.now())


# --- verdicts and report -------------------------------------------------------------------

def host_verdicts(drive: Drive, limits: Limits) -> list[Check]:
    tally, faults = drive.tally.tally, drive.faults
    ok = tally.total(OK, invalid=False)
    stray = [t for t in drive.tally.failed_at if not any(f.covers(t) for f in faults)]
    accepted = tally.total(OK, invalid=True)
    back = [f for f in faults if f.back_after_s is not None]
    slowest = max((f.back_after_s or 0.0 for f in back), default=0.0)
    return [check(ok > 0, f"requests succeeded: {ok}"),
            check(tally.total(DUPLICATED) == 0,
                  f"no duplicated delivery ({tally.total(DUPLICATED)} seen)"),
            check(tally.total(WRONG_TEXT) == 0,
                  f"no wrong greedy text ({tally.total(WRONG_TEXT)} seen)"),
            check(not stray, f"failures only while a fault lasted, until its host was "
                             f"back, or within {GRACE_S:.0f} s after: {len(drive.tally.failed_at)} failed, "
                             f"{len(stray)} outside (at {', '.join(map(clock, stray[:10]))})"),
            check(accepted == 0, f"invalid requests never accepted ({accepted} were)"),
            check(len(back) == len(faults) if faults else None,
                  f"every host came back after its fault: {len(back)} of {len(faults)} "
                  f"(slowest {slowest:.1f} s after healing)"),
            *rss_checks(drive.samples, limits), redis_check(drive.samples, limits),
            *idle_checks(drive.samples[-1], limits), dead_letter_check(drive.samples)]


def outcomes_table(tally: Tally) -> str:
    rows = [[kind, *(str(tally.counts[kind, o]) for o in HOST_OUTCOMES)]
            for kind in tally.kinds()]
    rows.append(["all", *(str(tally.total(o)) for o in HOST_OUTCOMES)])
    return markdown_table(["kind", *HOST_OUTCOMES], rows)


def faults_table(faults: list[Fault]) -> str:
    if not faults:
        return "None."
    rows = [[clock(f.t_s), f.kind, str(f.host),
             "" if f.healed_s is None else clock(f.healed_s),
             "not back" if f.back_after_s is None else f"{f.back_after_s:.1f}"]
            for f in faults]
    return markdown_table(["t", "fault", "host", "healed at", "healthy after s"], rows)


def format_report(command: str, drive: Drive, checks: list[Check], faults_line: str) -> str:
    failed = any(c.verdict == "FAIL" for c in checks)
    reasons = [[str(n), reason.replace("|", "/")]
               for reason, n in drive.tally.reasons.most_common()]
    return "\n".join([
        "# headrace bench soak --hosts", "", f"Command: `{command}`", "",
        f"Machine: {machine()}", "",
        f"Hosts: {drive.hosts.hosts} network namespaces on a bridge, each a `headrace serve` "
        f"of one data-parallel shard, against a 3-master Redis Cluster; faults drawn from "
        f"{', '.join(drive.kinds)} ({faults_line})", "",
        f"Result: **{'FAIL' if failed else 'PASS'}**", "", "## Checks", "",
        *(f"- {c.line}" for c in checks), "", "## Request outcomes", "",
        outcomes_table(drive.tally.tally), "", "## Failures by reason", "",
        markdown_table(["count", "reason"], reasons) if reasons else "None.", "",
        "## Faults", "", faults_table(drive.faults), "", "## Samples", "",
        "RSS in MiB per process (launcher-I, worker-S and scheduler-S of host S, "
        "tokenizer/detokenizer/gateway-I.0 of host I, redis-PORT per cluster node); "
        "Redis MiB: used_memory summed over the masters; health: every host's /health.",
        "", samples_table(drive.samples), ""])


# --- the run --------------------------------------------------------------------------------

async def drive_hosts(args: argparse.Namespace, hosts: SimulatedHosts, kinds: list[str]
                      ) -> Drive:
    assert hosts.cluster is not None
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    redis = plain_client(hosts.cluster.url)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        root = hosts.members[0].url
        target = await learn_target(session, root, args.max_tokens)
        drive = Drive(hosts, session, target, await learn_references(session, root, target),
                      kinds)
        stop = asyncio.Event()
        tasks = [client(drive, i % hosts.hosts, random.Random(args.seed * 1000 + i), stop)
                 for i in range(args.concurrency)]
        tasks += [sample_until(drive, redis, args.sample_every_s, stop),
                  faults_until(drive, args.fault_every_s, random.Random(args.seed), stop)]
        running = asyncio.gather(*tasks)
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        await wait_or_stop(stop, args.duration_s)
        stop.set()
        await running
        await asyncio.sleep(args.idle_s)
        drive.samples.append(await take_sample(drive, redis, "idle"))
        print(progress_line(drive.samples[-1]), flush=True)
    await redis.aclose()
    return drive


def serve_args(args: argparse.Namespace) -> list[str]:
    return ["--max-model-len", str(args.max_model_len), "--stream-maxlen",
            str(args.stream_maxlen), *(["--api-key", args.api_key] if args.api_key else []),
            *shlex.split(args.serve_args)]


def model_of(args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    from services.demo import demo_model_path  # imported only when it is needed
    return demo_model_path()


def main(args: argparse.Namespace, argv: list[str], limits: Limits) -> int:
    if (reason := why_no_namespaces()) is not None:
        print(f"headrace bench soak --hosts: {reason}")
        return 1
    kinds, faults_line = fault_kinds()
    try:
        with SimulatedHosts(args.out / "hosts", model_of(args), args.hosts,
                            serve_args(args)) as hosts:
            hosts.start_all()
            hosts.wait_healthy(args.start_timeout_s)
            drive = uvloop.run(drive_hosts(args, hosts, kinds))
            for i in range(hosts.hosts):
                hosts.stop_host(i)
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
        print(f"headrace bench soak --hosts: {e}")
        return 1
    command = "headrace bench soak " + shlex.join(redacted(argv))
    checks = host_verdicts(drive, limits)
    write_csv(args.out / "samples.csv", drive.samples)
    (args.out / "report.md").write_text(format_report(command, drive, checks, faults_line))
    marks = [Restart(f.t_s, f"{f.kind}@{f.host}", 0) for f in drive.faults]
    plot(args.out / "soak.png", drive.samples, marks, command, "a fault began")
    for line in (c.line for c in checks):
        print(line)
    print(f"report: {args.out / 'report.md'}")
    return 1 if any(c.verdict == "FAIL" for c in checks) else 0
