"""`headrace serve MODEL [engine args] [server args]`: an embedded Redis (unless --redis-url
or REDIS_URL) and every service as a child process; a child that crashes is restarted, and
one that Redis refused stops serve. Ctrl-C or SIGTERM stops them all; each child also dies
with this process if it is killed (parent-death signal), so nothing is orphaned."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from redis.exceptions import RedisError

from common import keys
from common.bus import Bus

from common.config import (STAGE_COUNTS, ConfigError, EngineConfig, ServerConfig,
                           engine_args_to_cli, parse_configs, server_args_to_cli)
from common.lora import AdapterError, read_adapter_config
from common.log import configure_logging, get_logger
from common.model_info import check_devices, resolve_engine, shard_gpus
from common.model_support import REFUSED_EXIT, UnsupportedModel, refusal_line
from common.redis_server import EmbeddedRedis, redis_url_or_embedded, spawn_child
from common.service import LOAD_FAILED_EXIT, REDIS_REFUSED_EXIT, service_parser
from services.gateway.core import shard_states
from services.gateway.http_options import tls_context
from services.gateway.tool_calls import check_tool_parser

STOP_TIMEOUT_S = 15.0
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
MAX_LOAD_FAILURES = 3  # a model that failed to load this often in a row will not load

log = get_logger("headrace.launcher")


@dataclass(slots=True)
class Child:
    name: str
    replica: int
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen | None = None
    restarts: int = 0
    restart_at: float = 0.0
    started_at: float = field(default=0.0)
    load_failures: int = 0  # exits with LOAD_FAILED_EXIT in a row

    @property
    def label(self) -> str:
        return f"{self.name}-{self.replica}"

    def start(self) -> None:
        self.process = spawn_child(self.argv, env=self.env)
        self.started_at = time.monotonic()
        log.info("started", child=self.label, pid=self.process.pid)


def child_specs(engine: EngineConfig, server: ServerConfig, redis_url: str,
                metrics_dir: Path) -> list[Child]:
    """Every child's command line: a worker and a scheduler per shard, each worker on its
    shard's GPUs, then the shared stages. The gateways share `metrics_dir`, where each
    writes its counters and histograms so that a scrape of any of them sums all
    (services/gateway/metrics.py)."""
    flags = engine_args_to_cli(engine) + server_args_to_cli(server)
    env = {**os.environ, "REDIS_URL": redis_url, "PYTHONUNBUFFERED": "1"}
    gateway_env = {**env, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir.absolute())}

    def child(name: str, replica: int, extra: list[str], child_env: dict[str, str],
              replica_id: str = "") -> Child:
        return Child(name, replica, [sys.executable, "-m", "services.cli", name, *flags,
                                     "--replica", replica_id or str(replica), *extra],
                     child_env)
    children = []
    for shard in local_shards(engine, server):
        on_shard = ["--shard", str(shard)]
        worker_env = env
        if engine.data_parallel_size > 1 and engine.device != "cpu":
            # this host's GPUs, counted from its first shard
            worker_env = {**env, "CUDA_VISIBLE_DEVICES": shard_gpus(
                engine, shard - server.data_parallel_start_rank)}
        children += [child("worker", shard, on_shard, worker_env),
                     child("scheduler", shard, on_shard, env)]
    stages = ([("tokenizer", i) for i in range(server.tokenizer_replicas)]
              + [("detokenizer", i) for i in range(server.detokenizer_replicas)]
              + [("gateway", i) for i in range(server.api_server_count)])
    host = replica_prefix(engine, server)
    return children + [child(name, i, [], gateway_env if name == "gateway" else env,
                             host and f"{host}{i}")
                       for name, i in stages]


def local_shards(engine: EngineConfig, server: ServerConfig) -> range:
    """The shards this host runs: --data-parallel-size-local of them from
    --data-parallel-start-rank (all of them by default)."""
    start = server.data_parallel_start_rank
    local = server.data_parallel_size_local
    return range(start, start + (engine.data_parallel_size - start if local is None else local))


def replica_prefix(engine: EngineConfig, server: ServerConfig) -> str:
    """"" for a launcher that runs every shard; else "START." so that the replicas of the
    shared stages on different hosts have different consumer names (a gateway's names its
    reply stream, a tokenizer's its pending entries)."""
    if len(local_shards(engine, server)) == engine.data_parallel_size:
        return ""
    return f"{server.data_parallel_start_rank}."


def check_local_shards(engine: EngineConfig, server: ServerConfig) -> None:
    shards = local_shards(engine, server)
    if not shards or shards.stop > engine.data_parallel_size:
        raise ConfigError(f"--data-parallel-start-rank {shards.start} and "
                          f"--data-parallel-size-local {len(shards)} name shards past "
                          f"--data-parallel-size {engine.data_parallel_size}")


def fresh_metrics_dir(run_dir: Path) -> Path:
    """An empty directory for the gateways' metric files: counts start at zero each serve,
    and stay summed over a gateway's restarts within it."""
    path = run_dir / "metrics"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


class Supervisor:
    def __init__(self, children: list[Child], redis: EmbeddedRedis | None = None,
                 drain_s: float = 0.0) -> None:
        self.children = children
        self.redis = redis
        self.drain_s = drain_s  # the gateways' --shutdown-timeout
        self.stopping = False
        self.exit_code = 0

    def run(self, serving: Readiness) -> None:
        for child in self.children:
            child.start()
        announced = False
        while not self.stopping:
            self._restart_redis()
            self._restart_crashed()
            if not announced and serving.ready():
                log.info("serving", url=serving.url)
                announced = True
            time.sleep(0.2)

    def stop(self, *_: object) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        """Stop the gateways together, each draining its calls while the stages behind
        them still serve; then the other children one by one from the front to the back
        (worker), so that no stage takes a normal shutdown for the loss of the one
        behind it."""
        gateways = [c for c in self.children if c.name == "gateway"]
        _stop([c.process for c in gateways], self.drain_s + STOP_TIMEOUT_S)
        for child in reversed(self.children):
            if child.name != "gateway":
                _stop([child.process], STOP_TIMEOUT_S)

    def _restart_redis(self) -> None:
        """The embedded Redis died (its append-only file keeps the streams): start it
        again at once; the services reconnect on their own."""
        if self.redis is None or self.redis.process is None:
            return
        if (code := self.redis.process.poll()) is not None:
            log.error("redis-server exited; restarting it", code=code)
            self.redis.restart()

    def _restart_crashed(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if child.process is None or child.process.poll() is None:
                continue
            if child.process.returncode == REDIS_REFUSED_EXIT:
                self.give_up(child)
                return
            if child.restart_at == 0.0 and self.stays_down(child):
                continue
            if child.restart_at == 0.0:
                delay = RESTART_BACKOFF_S[min(child.restarts, len(RESTART_BACKOFF_S) - 1)]
                if now - child.started_at > 60:  # it had been healthy: forget old crashes
                    child.restarts, delay = 0, RESTART_BACKOFF_S[0]
                log.error("child exited; restarting", child=child.label,
                          code=child.process.returncode, in_s=delay)
                child.restart_at = now + delay
            elif now >= child.restart_at:
                child.restarts += 1
                child.restart_at = 0.0
                child.start()

    def give_up(self, child: Child) -> None:
        """Redis refused the child's credentials or its user's rights: a restart would be
        refused the same way, and every child of serve connects with the same URL, so no
        request could be served. serve stops, with this one line after the child's own."""
        print(f"headrace serve: {child.label} exited {REDIS_REFUSED_EXIT}: Redis refused its "
              "credentials (see its line above); not restarting it, stopping", file=sys.stderr)
        child.process = None
        self.exit_code = REDIS_REFUSED_EXIT
        self.stopping = True

    def stays_down(self, child: Child) -> bool:
        """A worker that failed to load the model MAX_LOAD_FAILURES times in a row stays
        down: another try would fail the same way (the gateways answer 503 with its
        reason). Called once per exit; the count restarts with any other exit."""
        if child.process is None or child.process.returncode != LOAD_FAILED_EXIT:
            child.load_failures = 0
            return False
        child.load_failures += 1
        if child.load_failures < MAX_LOAD_FAILURES:
            return False
        log.error("the model failed to load; not restarting", child=child.label,
                  failures=child.load_failures)
        child.process = None  # seen: the supervisor no longer watches it
        return True


def _stop(processes: list[subprocess.Popen | None], timeout_s: float) -> None:
    """SIGTERM to each running process, then wait for all; SIGKILL after `timeout_s`."""
    running = [p for p in processes if p is not None and p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True, slots=True)
class Readiness:
    """When the launcher says "serving": once the gateways' /health answers 200. A gateway
    that requires client certificates (--ssl-cert-reqs 2) refuses the launcher, which has
    none: its --ssl-certfile is a server's, signed by whoever signs servers, and the
    --ssl-ca-certs file holds certificates, not the keys to sign one. Then the launcher
    reads what /health reads: a gateway takes connections on the port, and Redis has a
    shard whose scheduler and worker are alive."""
    server: ServerConfig
    redis_url: str
    shards: int = 1

    @property
    def url(self) -> str:
        return f"{self.server.scheme}://{self.server.host}:{self.server.port}"

    def ready(self) -> bool:
        if self.server.ssl_cert_reqs != ssl.CERT_REQUIRED:
            return _healthy(self.url + "/health")
        return _listening(self.server.host, self.server.port) and anyio.run(self._a_shard_up)

    async def _a_shard_up(self) -> bool:
        n = self.shards
        try:
            with anyio.fail_after(2):
                async with Bus(self.redis_url, retry_timeout_s=0.5) as bus:
                    alive = await bus.values(*map(keys.alive_scheduler, range(n)),
                                             *map(keys.alive_worker, range(n)))
        except (TimeoutError, OSError, RedisError):  # Redis not (yet) there: not serving
            return False
        return any(shard.up for shard in shard_states(alive))


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _healthy(url: str) -> bool:
    context = None
    if url.startswith("https:"):  # our own gateway: its certificate may be self-signed
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=0.5, context=context) as response:
            return response.status == 200
    except OSError:
        return False


def sized_stages(server: ServerConfig, shards: int) -> ServerConfig:
    """The gateways, tokenizers and detokenizers not given as flags, sized from the cores
    this process may run on (a container's or taskset's share, not the host's), said in
    the log."""
    cores = len(os.sched_getaffinity(0))
    sized = server.sized(cores, shards)
    log.info("stages", cores=cores, gateways=sized.api_server_count,
             tokenizers=sized.tokenizer_replicas, detokenizers=sized.detokenizer_replicas,
             from_cores=["--" + name.replace("_", "-") for name in STAGE_COUNTS
                         if getattr(server, name) is None])
    return sized


def check_lora_modules(engine: EngineConfig, server: ServerConfig) -> None:
    """A bad --lora-modules adapter stops serve here, before a gateway that cannot start
    is restarted again and again."""
    base_names = server.served_model_name or [engine.model]
    for module in engine.loras():
        if module.name in base_names:
            raise ConfigError(f"--lora-modules: {module.name!r} is the base model's name")
        try:
            read_adapter_config(module.path, engine.max_lora_rank)
        except AdapterError as e:
            raise ConfigError(f"--lora-modules: {e}") from None


def check_tool_parsers(server: ServerConfig) -> None:
    """A --tool-call-parser that neither headrace nor the --tool-parser-plugin file
    registers stops serve here, with the names it knows, before the gateways start."""
    try:
        check_tool_parser(server.tool_call_parser, server.tool_parser_plugin)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_tls(server: ServerConfig) -> None:
    """A certificate or key the gateways cannot load stops serve here, before they are
    restarted again and again."""
    try:
        tls_context(server)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: {e}") from None


def main(argv: list[str]) -> int:
    parser = service_parser("serve", __doc__ or "")
    args, engine, server = parse_configs(parser, argv)
    configure_logging("launcher")
    try:  # a GGUF converts once, here; a model, or a shard the model or machine cannot
        # hold, is refused before Redis or any child starts
        check_tool_parsers(server)
        check_tls(server)
        resolve_engine(engine, torch_free=True)
        check_local_shards(engine, server)
        check_devices(engine, len(local_shards(engine, server)))
        check_lora_modules(engine, server)
    except UnsupportedModel as e:
        print(refusal_line(e), file=sys.stderr)
        return REFUSED_EXIT
    except ConfigError as e:
        parser.error(str(e))
    server = sized_stages(server, len(local_shards(engine, server)))
    run_dir = Path(server.run_dir)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    redis_url, redis = redis_url_or_embedded(server.redis_url, run_dir)
    supervisor = Supervisor(child_specs(engine, server, redis_url, fresh_metrics_dir(run_dir)),
                            redis, server.shutdown_timeout)
    signal.signal(signal.SIGTERM, supervisor.stop)
    signal.signal(signal.SIGINT, supervisor.stop)
    try:
        supervisor.run(Readiness(server, redis_url, engine.data_parallel_size))
    finally:
        supervisor.shutdown()
        if redis is not None:
            redis.stop()
    return supervisor.exit_code
