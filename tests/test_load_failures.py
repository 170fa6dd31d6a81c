"""A worker that cannot load its model: it publishes the reason at its shard's worker:failed
key and exits with LOAD_FAILED_EXIT; the launcher stops restarting it after
MAX_LOAD_FAILURES such exits in a row; the gateways answer generation and embedding calls,
and /health, with a 503 naming the reason while no worker runs; a worker that loads
clears it (the key goes while a load is underway)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest

from common import keys
from common.bus import Bus
from common.config import EngineConfig, ServerConfig
from common.messages import WorkerFailed
from common.service import LOAD_FAILED_EXIT, ModelLoadFailed, ServiceContext
from services.gateway.core import Backend, Shard, admission_error, load_failed, load_failure
from services.launcher import MAX_LOAD_FAILURES, Child, Supervisor
from services.worker.shell import load
from tests.e2e_fixtures import API_KEY, MODEL_NAME, ServerProcess, start_server, tiny_serve_args
from tests.tiny_models import make_tiny_model

FAILED = WorkerFailed("worker-0", "m", "SafetensorError: incomplete metadata", 3)
GIVE_UP_S = 300.0  # three worker starts and the backoff between them, on 2 busy cores


@dataclass
class Exited:
    """A child process that has exited with `returncode`."""
    returncode: int

    def poll(self) -> int:
        return self.returncode


def exits_until_down(codes: list[int]) -> int | None:
    """After how many of these exits in a row the supervisor keeps the worker down."""
    child = Child("worker", 0, [], {})
    supervisor = Supervisor([child])
    for n, code in enumerate(codes, start=1):
        child.process = Exited(code)  # type: ignore[assignment]
        if supervisor.stays_down(child):
            return n
    return None


def test_the_launcher_gives_up_after_load_failures_in_a_row():
    assert MAX_LOAD_FAILURES == 3
    assert exits_until_down([LOAD_FAILED_EXIT] * 3) == 3
    assert exits_until_down([LOAD_FAILED_EXIT] * 2 + [1] + [LOAD_FAILED_EXIT] * 2) is None
    assert exits_until_down([LOAD_FAILED_EXIT] * 2 + [-9] + [LOAD_FAILED_EXIT] * 3) == 6
    assert exits_until_down([1] * 10) is None  # crashes keep their restarts


def test_a_failed_worker_is_the_answer_only_while_no_shard_is_up():
    now = 1.0
    down = Shard(b"epoch", False, FAILED)
    assert load_failure([down, Shard(b"epoch-1", False)]) == (0, FAILED)
    error = admission_error(Backend([down], 0, now), 4, now)
    assert error is not None and error.status == 503
    assert FAILED.reason in error.message and "shard 0" in error.message
    assert error.body()["error"]["type"] == "ServiceUnavailableError"
    reply = load_failed(0, FAILED)("cmpl-1-0")  # for calls admitted before the failure
    assert (reply.rid, reply.status, reply.message) == ("cmpl-1-0", 503, error.message)
    up = Shard(b"epoch-1", True)
    assert load_failure([down, up]) is None
    assert admission_error(Backend([down, up], 0, now), 4, now) is None
    # a worker alive again (before its load cleared the key) is not a failed one
    assert load_failure([Shard(b"epoch", True, FAILED)]) is None
    assert load_failure([Shard(b"epoch", False)]) is None


def test_a_worker_publishes_its_load_failures_and_clears_them_once_it_loads(
        tmp_path, redis_url):
    model_dir = make_tiny_model(tmp_path, "qwen2")
    weights = model_dir / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) // 2])
    engine = EngineConfig(model=str(model_dir), device="cpu", max_model_len=64,
                          num_gpu_blocks_override=8, max_num_seqs=4)

    async def scenario() -> tuple[list[WorkerFailed], object]:
        seen = []
        async with Bus(redis_url) as bus:
            ctx = ServiceContext("worker", "0", engine, ServerConfig(), bus, anyio.Event())
            for _ in range(2):
                with pytest.raises(ModelLoadFailed, match="SafetensorError"):
                    await load(ctx)
                seen.append(await bus.load(keys.worker_failed(0)))
            weights.write_bytes(whole)
            (await load(ctx)).close()
            return seen, await bus.load(keys.worker_failed(0))

    seen, after = anyio.run(scenario)
    assert [f.failures for f in seen] == [1, 2]
    assert all(f.model == str(model_dir) and f.worker_id == "worker-0" for f in seen)
    assert seen[0].reason.startswith("SafetensorError: ") and "\n" not in seen[0].reason
    assert after is None


def log_records(server: ServerProcess) -> list[dict]:
    """The JSON log records, also those written right after a dying worker's
    interpreter-exit noise on the same line (nanobind's leak report ends without a
    newline), which ServerProcess.log_records skips."""
    records = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        start = line.find('{"')
        try:
            records.append(json.loads(line[start:]))
        except json.JSONDecodeError:
            continue  # no record, or two processes interleaved
    return records


def post(server: ServerProcess, path: str, body: dict, timeout_s: float = 30.0
         ) -> tuple[int, dict]:
    request = urllib.request.Request(
        server.url + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(server: ServerProcess, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def assert_names_the_reason(status: int, body: dict) -> None:
    assert status == 503, body
    error = body["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503, error
    assert "cannot load the model" in error["message"], error
    assert "SafetensorError: " in error["message"], error


@pytest.mark.slow
def test_serve_stops_a_worker_that_cannot_load_and_answers_503(tmp_path: Path):
    """Truncated weights pass the config check: the worker fails to load them three
    times, stays down, and the gateway refuses calls with the worker's reason; a call
    sent as soon as the gateway answers (admitted while the worker still loads, on most
    machines) ends with that reason too, rather than waiting for a worker that is not
    coming."""
    model_dir = make_tiny_model(tmp_path, "qwen2")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    server = start_server(tiny_serve_args(model_dir, tmp_path / "run", "--max-model-len",
                                          "64", "--num-gpu-blocks-override", "8"),
                          tmp_path / "serve.log")
    # token ids inside the tiny model's 512: its test tokenizer spells "hi" as 6004, which
    # the tokenizer stage refuses (400) whenever it is up before the worker gives up
    completion = {"model": MODEL_NAME, "prompt": [5, 6], "max_tokens": 2}
    try:
        server.wait_for("/health", (503,), timeout_s=GIVE_UP_S)  # no worker yet
        with ThreadPoolExecutor(1) as pool:
            early = pool.submit(post, server, "/v1/completions", completion, GIVE_UP_S)
            deadline = time.monotonic() + GIVE_UP_S
            while not any(r.get("event") == "the model failed to load; not restarting"
                          for r in log_records(server)):
                assert server.process.poll() is None, server.log_tail()
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.5)
            assert_names_the_reason(*early.result(timeout=60))
        launcher = [r for r in log_records(server) if r.get("service") == "launcher"]
        starts = [r for r in launcher if r.get("event") == "started"
                  and r.get("child") == "worker-0"]
        assert len(starts) == MAX_LOAD_FAILURES, server.log_tail()
        status, body = get(server, "/health")
        assert status == 503 and "SafetensorError" in body["error"]["message"], body
        assert_names_the_reason(*post(server, "/v1/completions", completion))
        assert_names_the_reason(*post(server, "/v1/embeddings",
                                      {"model": MODEL_NAME, "input": "hi"}))
        assert server.process.poll() is None  # the rest keeps serving its 503s
    finally:
        survivors = server.stop()
    assert not survivors, survivors
