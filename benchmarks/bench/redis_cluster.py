"""A local Redis Cluster for the tests and `headrace bench soak --hosts`: three masters
of the same redis-server binary on free TCP ports of 127.0.0.1 (or of `host`, an address
other machines reach), joined with `redis-cli --cluster create`; with `replicas=1`, a
replica for each master, and `kill(master_of(key))` then `wait_failed_over` to make one
fail over."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from pathlib import Path
from collections.abc import Callable

import redis
import redis.cluster
from redis.crc import key_slot

from benchmarks.bench.redis_nodes import LocalNodes, spawn_node, stop_nodes
from common.redis_cluster import is_cluster_url, startup_nodes
from common.redis_server import RedisServerError, find_redis_binary


class LocalCluster(LocalNodes):
    def __init__(self, run_dir: Path, masters: int = 3, start_timeout_s: float = 20.0,
                 replicas: int = 0, node_timeout_ms: int = 15_000,
                 host: str = "127.0.0.1") -> None:
        self.run_dir = run_dir
        self.host = host
        self.replicas = replicas
        self.ports = [_free_cluster_port() for _ in range(masters * (1 + replicas))]
        self.start_timeout_s = start_timeout_s
        # how long a master is unreachable before its replica takes over (Redis's default
        # is 15 s; the failover tests use 1 s)
        self.node_timeout_ms = node_timeout_ms
        self.processes: list[subprocess.Popen[bytes]] = []
        self.by_port: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"{self.host}:{port}" for port in self.ports)

    def start(self) -> None:
        for port in self.ports:
            node_dir = self.run_dir / str(port)
            self.by_port[port] = spawn_node(
                [*self.node_command(port), "--bind", self.host, "--cluster-enabled", "yes",
                 "--cluster-config-file", str(node_dir / "nodes.conf"),
                 "--cluster-node-timeout", str(self.node_timeout_ms),
                 "--dir", str(node_dir), "--appendonly", "no", "--save", "",
                 "--daemonize", "no"], node_dir)
            self.processes.append(self.by_port[port])
        for port in self.ports:
            self._wait(lambda client: bool(client.ping()), port)
        subprocess.run([*self.cli_command(), "--cluster", "create",
                        *(f"{self.host}:{port}" for port in self.ports),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=self.start_timeout_s)
        for port in self.ports:
            self._wait(self._settled, port)

    def node_command(self, port: int) -> list[str]:
        """The server and how it listens on `port` (a TLS cluster overrides both)."""
        return [find_redis_binary("redis-server"), "--port", str(port)]

    def cli_command(self) -> list[str]:
        return [find_redis_binary("redis-cli")]

    def _settled(self, client: redis.Redis) -> bool:
        """The node sees the cluster up, with every replica attached."""
        if client.cluster("info")["cluster_state"] != "ok":
            return False
        nodes = client.cluster("nodes").values()
        replicas = sum("slave" in node["flags"] and node["master_id"] != "-" for node in nodes)
        return replicas == len(self.ports) - len(self.ports) // (1 + self.replicas)

    def master_of(self, key: str) -> int:
        """The port of the master that serves `key`'s hash slot now."""
        for port, process in self.by_port.items():
            if process.poll() is not None:
                continue
            with self.client(port) as client:
                for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                    if start <= key_slot(key.encode()) <= end:
                        return int(master[1])
        raise RedisServerError("no live cluster node answers CLUSTER SLOTS")

    def kill(self, port: int) -> None:
        """SIGKILL one node: no goodbye, as when its host dies."""
        self.by_port[port].kill()
        self.by_port[port].wait()

    def wait_failed_over(self, key: str, dead: int, timeout_s: float = 30.0) -> int:
        """Until a live node serves `key`'s slot as master, in a cluster that says ok
        again; returns its port."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                master = self.master_of(key)
                if master != dead:
                    with self.client(master) as client:
                        if client.cluster("info")["cluster_state"] == "ok":
                            return master
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise RedisServerError(f"no replica took over {key}'s slot in {timeout_s}s")

    def flush(self) -> None:
        """FLUSHALL on each master (a replica refuses writes and follows its master)."""
        for port in self.ports:
            with self.client(port) as client:
                if client.info("replication")["role"] == "master":
                    client.flushall()

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host=self.host, port=port, socket_timeout=5.0)

    def stop(self) -> None:
        stop_nodes(self.processes)
        self.processes = []
        self.by_port = {}

    def _wait(self, ready: Callable[[redis.Redis], bool], port: int) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if any(process.poll() is not None for process in self.processes):
                raise RedisServerError(f"a cluster node exited; see {self.run_dir}/*/redis.log")
            try:
                with self.client(port) as client:
                    if ready(client):
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RedisServerError(f"cluster node on port {port} not ready in "
                                       f"{self.start_timeout_s}s")
            time.sleep(0.05)


def _free_cluster_port() -> int:
    """A port that is free along with its cluster bus port (+10000), so at most 55535."""
    while True:
        port = random.randint(20_000, 55_535)
        if _free(port) and _free(port + 10_000):
            return port


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def sync_client(url: str) -> redis.Redis | redis.cluster.RedisCluster:
    """A blocking client of a single server or of a cluster, for the tests' checks."""
    if not is_cluster_url(url):
        return redis.Redis.from_url(url)
    return redis.cluster.RedisCluster(startup_nodes=[
        redis.cluster.ClusterNode(node.host, node.port) for node in startup_nodes(url)])
