"""A local Sentinel deployment for the tests: a master, its replica and one sentinel
(quorum 1, down-after 1 s) on free ports of 127.0.0.1; `kill_master()` then
`wait_failed_over()` to make the replica take over."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import redis

from benchmarks.bench.redis_nodes import LocalNodes, spawn_node, stop_nodes
from common.net import free_port
from common.redis_server import RedisServerError, find_redis_binary

SERVICE = "mymaster"


class LocalSentinel(LocalNodes):
    def __init__(self, run_dir: Path, start_timeout_s: float = 20.0) -> None:
        self.run_dir = run_dir
        self.master_port, self.replica_port, self.sentinel_port = (free_port(), free_port(),
                                                                   free_port())
        self.start_timeout_s = start_timeout_s
        self.processes: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """The sentinel's URL, after an address where none listens: a client must skip
        a sentinel that is down."""
        return f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{self.sentinel_port}/" \
               f"{SERVICE}/0"

    def start(self) -> None:
        self._spawn(self.master_port, [])
        self._spawn(self.replica_port, ["--replicaof", "127.0.0.1", str(self.master_port)])
        conf = self.run_dir / "sentinel.conf"  # a sentinel rewrites its file: one of its own
        conf.write_text("".join(line + "\n" for line in self.sentinel_conf()))
        self._spawn(self.sentinel_port, [], config=conf, sentinel=True)
        self._wait(lambda: self.client(self.replica_port).info("replication")
                   ["master_link_status"] == "up")
        self._wait(lambda: int(self.client(self.sentinel_port).sentinel_master(SERVICE)
                               ["num-slaves"]) == 1)

    def sentinel_conf(self) -> list[str]:
        return [f"port {self.sentinel_port}", "bind 127.0.0.1",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 1",
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                f"sentinel failover-timeout {SERVICE} 10000"]

    def server_args(self, port: int) -> list[str]:
        """The server binary and how a data node listens on `port`."""
        return [find_redis_binary("redis-server"), "--port", str(port)]

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0)

    def master(self) -> int:
        """The port the sentinel names master now."""
        with self.client(self.sentinel_port) as client:
            return int(client.sentinel_get_master_addr_by_name(SERVICE)[1])

    def kill_master(self) -> int:
        port = self.master()
        self.processes[port].kill()
        self.processes[port].wait()
        return port

    def wait_failed_over(self, dead: int, timeout_s: float = 30.0) -> int:
        """Until the sentinel names another master, and that one takes writes."""
        def promoted() -> bool:
            port = self.master()
            return port != dead and self.client(port).info("replication")["role"] == "master"
        self._wait(promoted, timeout_s)
        return self.master()

    def stop(self) -> None:
        stop_nodes(self.processes.values())
        self.processes = {}

    def _spawn(self, port: int, extra: list[str], config: Path | None = None,
               sentinel: bool = False) -> None:
        node_dir = self.run_dir / str(port)
        binary, *listen = self.server_args(port)
        args = [binary]
        if config is not None:
            args.append(str(config))
        args += ["--sentinel"] if sentinel else [
            *listen, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(node_dir), *extra]
        self.processes[port] = spawn_node(args, node_dir)

    def _wait(self, ready: Callable[[], bool], timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while True:
            try:
                if ready():
                    return
            except (redis.RedisError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"sentinel set-up not ready in time; see "
                                       f"{self.run_dir}/*/redis.log")
            time.sleep(0.05)
