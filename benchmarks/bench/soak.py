"""`headrace bench soak`: hours of mixed traffic against one `headrace serve`, its
stateless children killed in turn, and a sample every minute of what a leak would show.

    headrace bench soak --duration-s 1800 --out soak-out

It starts its own `headrace serve` (the demo model unless --model; its log and run
directory in --out) and, with --url, drives a running server instead (then without
restarts, sampling the processes it can find). --concurrency clients send, each one
request at a time: streamed and whole /v1/completions and /v1/chat/completions with varied
prompt lengths and small max_tokens, streams the client drops after a few events (an
abort), and invalid requests that must get a 4xx. Every --restart-every-s one tokenizer,
detokenizer or gateway (in turn) gets SIGKILL, and the launcher must start a new one.
Every --sample-every-s: the RSS of the launcher, every service replica and redis-server,
Redis's used_memory, XLEN of every hr:* stream, and the scheduler's gauges and the
consumer groups' backlog from /metrics. After the traffic and --idle-s of quiet, the last
sample must show the gauges at 0, nothing left in a consumer group and no process or
Redis grown past the tolerance since the warm-up (benchmarks/bench/soak_report.py says how).
Writes samples.csv, report.md and soak.png into --out; exits 1 on any FAIL. Ctrl-C ends
the traffic early; the idle wait, the last sample and the report still follow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import psutil
import redis.asyncio as aioredis
import uvloop
from prometheus_client.parser import text_string_to_metric_families
from redis.exceptions import RedisError

from benchmarks.bench.serve import WORDS, SseDecoder, metrics_url, redacted, scrape
from benchmarks.bench.soak_report import (ABORTED, BACKLOG, BAD_ANSWER, CLIENT_ERROR,
                                          CONNECTION, INVALID, MIB, OK, SERVER_ERROR,
                                          STREAM_ERROR, TIMEOUT, Check, Growth, Limits,
                                          Restart, Sample, Tally, format_report, plot,
                                          verdicts, write_csv)
from common.net import free_port
from common.redis_cluster import RedisCluster, plain_client, used_memory
from common.redis_server import SOCKET_NAME, spawn_child

REPO = Path(__file__).resolve().parents[2]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
KIND_WEIGHTS = {"completion": 3, "completion-stream": 3, "chat": 2, "chat-stream": 2,
                "abort": 1, INVALID: 1}
RESTART_ORDER = ("tokenizer", "detokenizer", "gateway")  # the stateless children
GAUGE_NAMES = {"headrace:num_requests_running": "running",
               "headrace:num_requests_waiting": "waiting",
               "headrace:kv_cache_usage_perc": "kv_cache_usage"}
BACKLOG_NAMES = ("headrace:stream_pending", "headrace:stream_lag")
CONNECTION_BACKOFF_S = 0.5  # a killed gateway is down for a second or more
RESTART_WAIT_S = 60.0  # the launcher's longest backoff is 10 s, a start a few more
POLL_S = 0.5
STOP_TIMEOUT_S = 120.0  # the gateways drain for --shutdown-timeout, then the others stop
HEALTH_TIMEOUT_S = 5.0


# --- the traffic (pure) -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Target:
    model: str
    max_model_len: int
    max_tokens: int  # the most a valid request asks for


@dataclass(frozen=True, slots=True)
class Call:
    kind: str
    path: str
    body: Any  # a JSON value, or bytes sent as they are (a broken body)
    stream: bool = False
    abort_after: int = 0  # events to read before disconnecting; 0: read them all


def prompt_words(rng: random.Random, limit: int) -> str:
    """Short, medium or long (up to `limit` words, each one token), a third each."""
    high = rng.choice((min(16, limit), min(96, limit), limit))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max(1, high))))


def sampling(rng: random.Random, max_tokens: int, stream: bool) -> dict[str, Any]:
    params: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream,
                              "temperature": rng.choice((0.0, 0.7, 1.0))}
    if rng.random() < 0.2:  # a stop string: the detokenizer ends the request early
        params["stop"] = ["."]
    if stream and rng.random() < 0.5:
        params["stream_options"] = {"include_usage": True}
    return params


def valid_call(rng: random.Random, target: Target, kind: str) -> Call:
    max_tokens = rng.randint(1, target.max_tokens)
    # half the context at most: the chat template adds a system prompt of its own
    prompt = prompt_words(rng, max(1, target.max_model_len // 2 - max_tokens))
    stream = kind.endswith("stream")
    body = {"model": target.model, **sampling(rng, max_tokens, stream)}
    if kind.startswith("chat"):
        return Call(kind, CHAT, body | {"messages": [{"role": "user", "content": prompt}]},
                    stream)
    return Call(kind, COMPLETIONS, body | {"prompt": prompt}, stream)


def abort_call(rng: random.Random, target: Target) -> Call:
    """A long stream (EOS ignored) whose client leaves after one to three events."""
    max_tokens = 2 * target.max_tokens
    prompt = prompt_words(rng, max(1, min(64, target.max_model_len // 2 - max_tokens)))
    body = {"model": target.model, "prompt": prompt, "stream": True,
            "max_tokens": max_tokens, "ignore_eos": True}
    return Call("abort", COMPLETIONS, body, True, rng.randint(1, 3))


def invalid_call(rng: random.Random, target: Target) -> Call:
    model = target.model
    too_long = " ".join(["the"] * (target.max_model_len + 8))  # refused behind the bus
    bodies = [(COMPLETIONS, {"model": model, "prompt": "Hi", "max_tokens": -1}),
              (COMPLETIONS, {"model": model, "max_tokens": 4}),
              (COMPLETIONS, {"model": "no-such-model", "prompt": "Hi"}),
              (CHAT, {"model": model, "messages": "Hi"}),
              (COMPLETIONS, b'{"prompt": "Hi", '),
              (COMPLETIONS, {"model": model, "prompt": too_long, "max_tokens": 4,
                             "stream": rng.random() < 0.5})]
    path, body = rng.choice(bodies)
    return Call(INVALID, path, body, isinstance(body, dict) and body.get("stream", False))


def plan_call(rng: random.Random, target: Target) -> Call:
    kind = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
    if kind == INVALID:
        return invalid_call(rng, target)
    if kind == "abort":
        return abort_call(rng, target)
    return valid_call(rng, target, kind)


# --- answers (pure) ---------------------------------------------------------------------

def status_outcome(status: int) -> str:
    if 400 <= status < 500:
        return CLIENT_ERROR
    return SERVER_ERROR if status >= 500 else BAD_ANSWER


def answer_outcome(raw: bytes) -> tuple[str, str]:
    """A whole (not streamed) 200 answer: it must be JSON with choices."""
    try:
        choices = json.loads(raw).get("choices")
    except (ValueError, AttributeError):
        choices = None
    return (OK, "") if choices else (BAD_ANSWER, raw[:200].decode(errors="replace"))


def event_outcome(payload: str) -> str | None:
    """The outcome a stream's `data:` payload settles, or None while the stream goes on."""
    if payload == "[DONE]":
        return OK
    try:
        chunk = json.loads(payload)
    except ValueError:
        return BAD_ANSWER
    return STREAM_ERROR if isinstance(chunk, dict) and "error" in chunk else None


# --- the processes ------------------------------------------------------------------------

def flag_value(cmdline: list[str], flag: str, default: str) -> str:
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else default


def process_label(cmdline: list[str]) -> str | None:
    """launcher, redis, or <service>-<replica> for a headrace process; None otherwise."""
    if cmdline and "redis-server" in cmdline[0]:  # it rewrites its title: one string
        return "redis"
    if "services.cli" not in cmdline[:-1]:
        return None
    command = cmdline[cmdline.index("services.cli") + 1]
    if command == "serve":
        return "launcher"
    return f"{command}-{flag_value(cmdline, '--replica', '0')}"


def restart_target(n: int, labels: Iterable[str]) -> str | None:
    """The n-th child to kill: the services in RESTART_ORDER in turn, each's replicas in
    turn (tokenizer-0, detokenizer-0, gateway-0, tokenizer-1, ...)."""
    service = RESTART_ORDER[n % len(RESTART_ORDER)]
    replicas = sorted(label for label in labels if label.rsplit("-", 1)[0] == service)
    return replicas[(n // len(RESTART_ORDER)) % len(replicas)] if replicas else None


def headrace_processes(launcher: psutil.Process | None) -> dict[str, psutil.Process]:
    """The launcher and its children by label. Direct children only: a process a service
    forks has that service's command line and would take its label."""
    try:
        found = [launcher, *launcher.children()] if launcher else []
    except psutil.Error:  # the launcher is gone
        return {}
    labeled: dict[str, psutil.Process] = {}
    for process in found:
        try:
            label = process_label(process.cmdline())
        except psutil.Error:  # it exited while we looked
            continue
        if label is not None:
            labeled[label] = process
    return labeled


def find_launcher(port: int) -> psutil.Process | None:
    """The launcher whose gateway listens on `port`, for --url."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        label = process_label(cmdline) or ""
        if label.startswith("gateway-") and flag_value(cmdline, "--port", "8000") == str(port):
            try:
                parent = process.parent()
                if parent is not None and process_label(parent.cmdline()) == "launcher":
                    return parent
            except psutil.Error:  # gone, or not ours to inspect
                continue
    return None


def redis_url_of(launcher: psutil.Process | None) -> str | None:
    """The REDIS_URL the launcher gave its children."""
    for process in headrace_processes(launcher).values():
        try:
            url = process.environ().get("REDIS_URL")
        except psutil.Error:
            continue
        if url:
            return url
    return None


# --- one sample ----------------------------------------------------------------------------

@dataclass(slots=True)
class Probe:
    """Where the samples come from."""
    session: aiohttp.ClientSession
    base_url: str
    redis: aioredis.Redis | RedisCluster | None
    launcher: psutil.Process | None
    started: float = field(default_factory=time.monotonic)

    def now(self) -> float:
        return time.monotonic() - self.started


def metrics_gauges(exposition: str | None) -> dict[str, float]:
    """The schedulers' gauges (requests summed over the shards, the fullest shard's KV
    usage) and the groups' backlog (pending + lag) from /metrics."""
    if exposition is None:
        return {}
    gauges: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in GAUGE_NAMES:
                name = GAUGE_NAMES[sample.name]
                merge = max if name == "kv_cache_usage" else sum
                gauges[name] = merge((gauges.get(name, 0.0), sample.value))
            elif sample.name in BACKLOG_NAMES:
                gauges[BACKLOG] = gauges.get(BACKLOG, 0.0) + sample.value
    if gauges:
        gauges.setdefault(BACKLOG, 0.0)  # no consumer group yet
    return gauges


def memory_of(processes: dict[str, psutil.Process]) -> tuple[dict[str, int], dict[str, int]]:
    rss, pids = {}, {}
    for label, process in processes.items():
        try:
            rss[label] = process.memory_info().rss
        except psutil.Error:
            continue
        pids[label] = process.pid
    return rss, pids


async def redis_state(client: aioredis.Redis | RedisCluster | None
                      ) -> tuple[int | None, dict[str, int]]:
    """used_memory and the XLEN of every hr:* stream; (None, {}) when Redis is away."""
    if client is None:
        return None, {}
    try:
        used = await used_memory(client)
        names = sorted({n.decode() async for n in client.scan_iter(match="hr:*",
                                                                   _type="stream")})
        async with client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.xlen(name)
            return used, dict(zip(names, await pipe.execute()))
    except RedisError:
        return None, {}


async def healthy(probe: Probe) -> bool:
    try:
        async with probe.session.get(probe.base_url + "/health", timeout=aiohttp.ClientTimeout(
                total=HEALTH_TIMEOUT_S)) as response:
            return response.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def take_sample(probe: Probe, phase: str) -> Sample:
    t_s = probe.now()
    rss, pids = memory_of(headrace_processes(probe.launcher))
    used, streams = await redis_state(probe.redis)
    gauges = metrics_gauges(await scrape(probe.session, metrics_url(probe.base_url)))
    return Sample(t_s, phase, rss, pids, used, streams, gauges, await healthy(probe))


async def sample_until(probe: Probe, every_s: float, stop: asyncio.Event,
                       samples: list[Sample]) -> None:
    n = 0
    while not stop.is_set():
        samples.append(await take_sample(probe, "traffic"))
        print(progress_line(samples[-1]), file=sys.stderr)
        n += 1
        await wait_or_stop(stop, n * every_s - probe.now())  # on a fixed grid, no drift


def progress_line(sample: Sample) -> str:
    rss = sum(sample.rss.values()) / MIB
    redis = (sample.redis_used_memory or 0) / MIB
    return (f"soak {sample.t_s:7.0f}s  RSS {rss:7.0f} MiB  Redis {redis:6.1f} MiB  "
            f"stream entries {sample.stream_total:7d}  {sample.gauges}")


async def wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), max(0.0, seconds))
    except asyncio.TimeoutError:
        pass


# --- restarts -----------------------------------------------------------------------------

async def restart_one(probe: Probe, n: int) -> Restart | None:
    """SIGKILL the n-th target and wait for the launcher to start its replacement."""
    processes = headrace_processes(probe.launcher)
    label = restart_target(n, processes)
    if label is None:
        return None
    victim = processes[label]
    restart = Restart(probe.now(), label, victim.pid)
    try:
        victim.send_signal(signal.SIGKILL)
    except psutil.NoSuchProcess:
        return None  # it died on its own in between: the launcher restarts that too
    print(f"soak {restart.t_s:7.0f}s  killed {label} (pid {victim.pid})", file=sys.stderr)
    while probe.now() - restart.t_s < RESTART_WAIT_S:
        await asyncio.sleep(POLL_S)
        replacement = headrace_processes(probe.launcher).get(label)
        if replacement is not None and replacement.pid != victim.pid:
            restart.new_pid, restart.back_after_s = replacement.pid, probe.now() - restart.t_s
            break
    return restart


async def restart_until(probe: Probe, every_s: float, stop: asyncio.Event,
                        restarts: list[Restart]) -> None:
    n = 0
    while True:
        await wait_or_stop(stop, (n + 1) * every_s - probe.now())
        if stop.is_set():
            return
        if (restart := await restart_one(probe, n)) is not None:
            restarts.append(restart)
        n += 1


# --- the clients ----------------------------------------------------------------------------

def request_args(call: Call) -> dict[str, Any]:
    if isinstance(call.body, bytes):
        return {"data": call.body, "headers": {"Content-Type": "application/json"}}
    return {"json": call.body}


async def read_events(response: aiohttp.ClientResponse, abort_after: int) -> tuple[str, str]:
    decoder, events = SseDecoder(), 0
    async for data in response.content.iter_any():
        for payload in decoder.feed(data):
            if (outcome := event_outcome(payload)) is not None:
                return outcome, payload[:200]
            events += 1
            if events == abort_after:
                response.close()  # the client is gone: the gateway must abort it
                return ABORTED, ""
    return BAD_ANSWER, "the stream ended without [DONE]"


async def send(session: aiohttp.ClientSession, root: str, call: Call) -> tuple[str, str]:
    try:
        async with session.post(root + call.path, **request_args(call)) as response:
            if response.status != 200:
                text = (await response.text())[:200]
                return status_outcome(response.status), f"{response.status} {text}"
            if call.stream:
                return await read_events(response, call.abort_after)
            return answer_outcome(await response.read())
    except asyncio.TimeoutError:
        return TIMEOUT, f"{call.path} {str(call.body)[:100]}"
    except (aiohttp.ClientError, OSError) as e:
        return CONNECTION, f"{type(e).__name__}: {e}"


async def client(probe: Probe, target: Target, rng: random.Random, stop: asyncio.Event,
                 tally: Tally) -> None:
    while not stop.is_set():
        call = plan_call(rng, target)
        outcome, note = await send(probe.session, probe.base_url, call)
        tally.add(call.kind, outcome, note)
        if outcome == CONNECTION:
            await asyncio.sleep(CONNECTION_BACKOFF_S)


async def learn_target(session: aiohttp.ClientSession, base_url: str, max_tokens: int
                       ) -> Target:
    """The served model's name and context length, from GET /v1/models; max_tokens kept
    to a quarter of the context, so that every valid request fits it."""
    async with session.get(base_url + "/v1/models") as response:
        response.raise_for_status()
        model = (await response.json())["data"][0]
    max_model_len = int(model.get("max_model_len") or 2048)
    return Target(model["id"], max_model_len, max(1, min(max_tokens, max_model_len // 4)))


# --- the run ---------------------------------------------------------------------------------

@dataclass(slots=True)
class SoakRun:
    samples: list[Sample] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)
    tally: Tally = field(default_factory=Tally)


async def drive(args: argparse.Namespace, base_url: str, redis_url: str | None,
                launcher: psutil.Process | None, restart_every_s: float) -> SoakRun:
    run = SoakRun()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    client_redis = plain_client(redis_url) if redis_url else None
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        target = await learn_target(session, base_url, args.max_tokens)
        probe = Probe(session, base_url, client_redis, launcher)
        stop = asyncio.Event()
        tasks = [client(probe, target, random.Random(args.seed * 1000 + i), stop, run.tally)
                 for i in range(args.concurrency)]
        tasks.append(sample_until(probe, args.sample_every_s, stop, run.samples))
        if restart_every_s > 0:
            tasks.append(restart_until(probe, restart_every_s, stop, run.restarts))
        running = asyncio.gather(*tasks)
        # Ctrl-C ends the traffic early; the idle wait, last sample and report still follow
        asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
        await wait_or_stop(stop, args.duration_s)
        stop.set()  # each client finishes the request it has open
        await running
        await asyncio.sleep(args.idle_s)
        run.samples.append(await take_sample(probe, "idle"))
        print(progress_line(run.samples[-1]), file=sys.stderr)
    if client_redis is not None:
        await client_redis.aclose()
    return run


# --- our own server ------------------------------------------------------------------------

@dataclass(slots=True)
class OwnServer:
    process: subprocess.Popen[bytes]
    url: str
    redis_url: str
    log_path: Path


def serve_command(args: argparse.Namespace, port: int, run_dir: Path) -> list[str]:
    model = args.model
    if model is None:
        from services.demo import demo_model_path  # imported only when it is needed
        model = demo_model_path()
    return [sys.executable, "-m", "services.cli", "serve", model, "--port", str(port),
            "--run-dir", str(run_dir), "--max-model-len", str(args.max_model_len),
            "--tokenizer-replicas", str(args.replicas),
            "--detokenizer-replicas", str(args.replicas),
            "--stream-maxlen", str(args.stream_maxlen), *shlex.split(args.serve_args)]


def start_serve(args: argparse.Namespace, out: Path) -> OwnServer:
    port, run_dir, log_path = free_port(), out / "run", out / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    with log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
        # spawn_child: the server dies with the soak, even if the soak is killed; its own
        # session: a Ctrl-C meant for the soak does not stop the server under it
        process = spawn_child(serve_command(args, port, run_dir), env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    return OwnServer(process, f"http://127.0.0.1:{port}", f"unix://{run_dir / SOCKET_NAME}",
                     log_path)


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


async def wait_healthy(server: OwnServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        probe = Probe(session, server.url, None, None)
        while not await healthy(probe):
            if server.process.poll() is not None:
                raise RuntimeError(f"headrace serve exited with {server.process.returncode}:"
                                   f"\n{log_tail(server.log_path)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"headrace serve was not healthy in {timeout_s:g} s:\n"
                                   f"{log_tail(server.log_path)}")
            await asyncio.sleep(POLL_S)


def stop_serve(server: OwnServer) -> int:
    """SIGTERM, and the launcher's exit code (-9 where it had to be killed)."""
    server.process.send_signal(signal.SIGTERM)
    try:
        return server.process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
        return -signal.SIGKILL


# --- the command ------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headrace bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("soak-out"),
                   help="directory for samples.csv, report.md, soak.png and the server's "
                        "log and run directory (default soak-out)")
    p.add_argument("--model", default=None,
                   help="model for the soak's own server (default: the bundled demo)")
    p.add_argument("--url", default=None,
                   help="drive this running server instead of starting one (no restarts)")
    p.add_argument("--redis-url", default=None,
                   help="with --url: its Redis (default: the REDIS_URL of its children)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--duration-s", type=float, default=1800.0,
                   help="seconds of traffic (default 1800)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="clients, each with one request open at a time (default 8)")
    p.add_argument("--restart-every-s", type=float, default=300.0,
                   help="SIGKILL a tokenizer, detokenizer or gateway (in turn) this often; "
                        "0: never (default 300)")
    p.add_argument("--sample-every-s", type=float, default=60.0,
                   help="seconds between samples (default 60)")
    p.add_argument("--idle-s", type=float, default=20.0,
                   help="quiet seconds after the traffic before the last sample (default 20)")
    p.add_argument("--max-tokens", type=int, default=24,
                   help="the most tokens a request asks for (default 24: the CPU is slow)")
    p.add_argument("--request-timeout-s", type=float, default=120.0,
                   help="seconds a request may take before it counts as hung (default 120)")
    p.add_argument("--max-model-len", type=int, default=512,
                   help="own server: its --max-model-len (default 512)")
    p.add_argument("--replicas", type=int, default=2,
                   help="own server: tokenizer and detokenizer replicas each (default 2)")
    p.add_argument("--stream-maxlen", type=int, default=2000,
                   help="own server: its --stream-maxlen, small so that the streams reach "
                        "their cap early; also the bound the idle streams are checked "
                        "against (with --url, give the server's) (default 2000)")
    p.add_argument("--serve-args", default="",
                   help="own server: more `headrace serve` flags, one shell-quoted string")
    p.add_argument("--start-timeout-s", type=float, default=300.0,
                   help="own server: seconds to wait for /health (default 300)")
    p.add_argument("--warmup-fraction", type=float, default=0.2,
                   help="growth is measured from the sample at this fraction of the run "
                        "(of a restarted process's life) to the last (default 0.2)")
    p.add_argument("--growth-ratio", type=float, default=0.10,
                   help="RSS and Redis memory may grow by this fraction ... (default 0.10)")
    p.add_argument("--growth-slack-mib", type=float, default=20.0,
                   help="... plus this many MiB (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the clients' requests")
    p.add_argument("--hosts", type=int, default=0,
                   help="N > 0: soak N simulated hosts (network namespaces, one shard each, "
                        "a Redis Cluster; needs root) with random host faults instead of "
                        "child kills (benchmarks/bench/soak_hosts.py) (default 0: one "
                        "server)")
    p.add_argument("--fault-every-s", type=float, default=120.0,
                   help="with --hosts: a random fault on a random host this often: its "
                        "link cut for 20 s, its processes killed, or loss and "
                        "latency (default 120)")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("duration_s", "sample_every_s", "concurrency", "max_tokens",
                 "request_timeout_s", "max_model_len", "replicas", "stream_maxlen"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if min(args.restart_every_s, args.idle_s, args.growth_ratio, args.growth_slack_mib) < 0:
        parser.error("--restart-every-s, --idle-s and the --growth-* settings must be >= 0")
    if args.hosts < 0 or args.fault_every_s <= 0:
        parser.error("--hosts must be >= 0 and --fault-every-s positive")
    if args.hosts and args.url:
        parser.error("--hosts starts its own hosts: give it no --url")
    if not 0 <= args.warmup_fraction < 1:
        parser.error("--warmup-fraction must be in [0, 1)")


def machine() -> str:
    return (f"{platform.platform()}, {platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.1f} GiB, "
            f"Python {platform.python_version()}")


def write_outputs(out: Path, argv: list[str], run: SoakRun, checks: list[Check]) -> None:
    command = "headrace bench soak " + shlex.join(redacted(argv))
    write_csv(out / "samples.csv", run.samples)
    (out / "report.md").write_text(format_report(command, machine(), run.samples,
                                                 run.restarts, run.tally, checks))
    plot(out / "soak.png", run.samples, run.restarts, command)


def limits_of(args: argparse.Namespace) -> Limits:
    return Limits(Growth(args.growth_ratio, int(args.growth_slack_mib * MIB)),
                  args.warmup_fraction, args.stream_maxlen)


def soak_url(args: argparse.Namespace) -> tuple[SoakRun, int | None]:
    base_url = args.url.rstrip("/").removesuffix("/v1")
    launcher = find_launcher(urlsplit(base_url).port or 80)
    redis_url = args.redis_url or redis_url_of(launcher)
    return uvloop.run(drive(args, base_url, redis_url, launcher, 0.0)), None


def soak_own(args: argparse.Namespace) -> tuple[SoakRun, int | None]:
    server = start_serve(args, args.out)
    try:
        uvloop.run(wait_healthy(server, args.start_timeout_s))
        launcher = psutil.Process(server.process.pid)
        run = uvloop.run(drive(args, server.url, server.redis_url, launcher,
                               args.restart_every_s))
    finally:
        code = stop_serve(server)
    return run, code


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    args.out = args.out.absolute()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hosts:
        from benchmarks.bench import soak_hosts  # needs root: imported only when asked
        return soak_hosts.main(args, argv, limits_of(args))
    try:
        run, exit_code = soak_url(args) if args.url else soak_own(args)
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as e:
        print(f"headrace bench soak: {e}", file=sys.stderr)
        return 1
    checks = verdicts(run.samples, run.restarts, run.tally, limits_of(args), exit_code)
    write_outputs(args.out, argv, run, checks)
    for line in (c.line for c in checks):
        print(line)
    print(f"report: {args.out / 'report.md'}")
    return 1 if any(c.verdict == "FAIL" for c in checks) else 0
