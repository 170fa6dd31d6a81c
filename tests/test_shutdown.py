"""Graceful shutdown of a real `headrace serve`: on SIGTERM the gateway stops admitting
(503 with Retry-After, /health too), the requests in flight finish if they can within
--shutdown-timeout, the rest end with an error event and [DONE], and the launcher exits
cleanly with no process left behind."""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import aiohttp
import anyio
import psutil
import pytest

from tests.e2e_fixtures import API_KEY, MODEL_NAME, serve_args, start_server
from tests.sse_client import Streamed, stream_one

pytestmark = [pytest.mark.slow]

SHUTDOWN_TIMEOUT_S = 6.0


@dataclass
class Drain:
    short: Streamed
    long: Streamed
    term_at: float
    refused: tuple[int, str | None, str]  # status, Retry-After, error of a new request
    health: int


async def sigterm_mid_stream(url: str, launcher: psutil.Process) -> Drain:
    """A short and a long stream; SIGTERM once both have begun, then a new request and a
    health probe while the gateway drains."""
    short, long = Streamed(), Streamed()
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(stream_one, s, url, "Hello", short, 8)
            tasks.start_soon(stream_one, s, url, "Once upon a time", long, 400)
            while not (short.chunk_times and long.chunk_times):
                await anyio.sleep(0.02)
            launcher.send_signal(signal.SIGTERM)
            term_at = time.monotonic()
            await anyio.sleep(0.5)  # the signal reaches the gateway through the launcher
            body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as response:
                refused = (response.status, response.headers.get("Retry-After"),
                           (await response.json())["error"]["message"])
            async with s.get(url + "/health") as response:
                health = response.status
    return Drain(short, long, term_at, refused, health)


def test_sigterm_drains_then_ends_what_is_left(tmp_path):
    server = start_server([*serve_args(tmp_path / "run"), "--shutdown-timeout",
                           str(SHUTDOWN_TIMEOUT_S)], tmp_path / "serve.log")
    server.wait_for("/health", (200,))
    launcher = psutil.Process(server.process.pid)
    children = launcher.children(recursive=True)
    try:
        drain = anyio.run(sigterm_mid_stream, server.url, launcher)
        server.process.wait(SHUTDOWN_TIMEOUT_S + 30)
    finally:
        if server.process.poll() is None:
            server.process.kill()
    status, retry_after, message = drain.refused
    assert (status, retry_after) == (503, "1") and "shutting down" in message
    assert drain.health == 503
    assert drain.short.done and drain.short.error is None and drain.short.text, drain.short
    long = drain.long
    assert long.done and long.error and "--shutdown-timeout" in long.error, long
    assert SHUTDOWN_TIMEOUT_S - 1 <= long.ended_at - drain.term_at <= SHUTDOWN_TIMEOUT_S + 5
    assert server.process.returncode == 0, server.log_tail()
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"children outlived the launcher: {alive}"
