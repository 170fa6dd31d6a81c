"""Real server processes for the HTTP tests: a lone gateway (tests/test_gateway.py) or a
whole `headrace serve` (tests/test_e2e.py), each on a free port with its log in a file,
stopped with SIGTERM, leaving no child process behind.

    from tests.e2e_fixtures import served  # a module-scoped `headrace serve` of the demo
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from aiohttp.web import StreamResponse

from common.net import free_port
from services.demo import demo_model_path
from tests.conftest import REPO, repo_env

MODEL_NAME = "smollm2"
API_KEY = "sk-headrace-test"
# The served pipeline of test_e2e: small limits, so the tests can reach each of them.
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 4
MAX_QUEUE_LEN = 4
MAX_REQUEST_BODY = 64 * 1024
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    run_dir: Path | None = None  # `headrace serve`'s: its embedded Redis's socket is there
    redis_url: str | None = None  # the Redis it was given, None for its embedded one

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log_records(self) -> list[dict]:
        """The JSON log lines (HEADRACE_LOG_FORMAT=json)."""
        records = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line two processes interleaved
        return records

    def status(self, path: str) -> int | None:
        """The HTTP status of GET `path`, or None while nothing answers."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as response:
                return response.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_for(self, path: str, statuses: tuple[int, ...],
                 timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            if self.status(path) in statuses:
                return
            time.sleep(0.2)
        raise TimeoutError(f"GET {path} did not answer {statuses} in {timeout_s}s:\n"
                           f"{self.log_tail()}")

    def stop(self) -> list[psutil.Process]:
        """SIGTERM, wait for the exit; returns the descendants still alive after it."""
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"the server ignored SIGTERM:\n{self.log_tail()}") from None
        _, alive = psutil.wait_procs(children, timeout=5)
        for child in alive:
            child.kill()
        return alive


def start_server(args: list[str], log_path: Path, **env: str) -> ServerProcess:
    """`python -m services.cli <args> --port <free port>`, logging JSON to `log_path`."""
    port = free_port()
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *args, "--port", str(port)], cwd=REPO,
        env=repo_env(HEADRACE_LOG_FORMAT="json", **env), stdout=log,
        stderr=subprocess.STDOUT)
    log.close()
    return ServerProcess(process, port, log_path)


@contextlib.contextmanager
def serving(args: list[str], log_path: Path, run_dir: Path | None = None
            ) -> Iterator[ServerProcess]:
    """`start_server`, healthy; stopped at the end, asserting that no child outlives it."""
    server = start_server(args, log_path)
    server.run_dir = run_dir
    try:
        server.wait_for("/health", (200,))
        yield server
    finally:
        survivors = server.stop()
        assert not survivors, f"children outlived the launcher: {survivors}"


def tiny_serve_args(model_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    """`headrace serve` of a tiny random model on the CPU (tests/tiny_models.py)."""
    return ["serve", str(model_dir), "--served-model-name", MODEL_NAME,
            "--run-dir", str(run_dir), "--api-key", API_KEY, "--device", "cpu", *extra]


def serve_args(run_dir: Path) -> list[str]:
    return ["serve", demo_model_path(), "--served-model-name", MODEL_NAME,
            "--run-dir", str(run_dir), "--api-key", API_KEY,
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--max-queue-len", str(MAX_QUEUE_LEN),
            "--max-request-body", str(MAX_REQUEST_BODY), "--enable-prompt-tokens-details"]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`headrace serve` of the demo SmolLM2 with its own embedded Redis (its own run
    dir), healthy; stopped with SIGTERM at the end of the module, asserting that the
    launcher exits cleanly and no child process survives it."""
    root = tmp_path_factory.mktemp("serve")
    server = start_server(serve_args(root / "run"), root / "serve.log")
    server.run_dir = root / "run"
    try:
        server.wait_for("/health", (200,))
    except BaseException:
        server.stop()
        raise
    yield server
    survivors = server.stop()
    assert server.process.returncode == 0, server.log_tail()
    assert not survivors, f"children outlived the launcher: {survivors}\n{server.log_tail()}"
    # stopped front to back: the scheduler never takes the shutdown for a lost worker
    assert "worker lost" not in server.log_path.read_text(errors="replace"), server.log_tail()


async def write_event(response: StreamResponse, chunk: dict) -> None:
    """One server-sent event of a scripted OpenAI stream (the fake servers of the bench
    tests)."""
    await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
