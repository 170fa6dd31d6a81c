"""The fault matrix: while streams run through a real `headrace serve` of the demo model,
each process kind in turn is killed with SIGKILL (tokenizer, detokenizer, scheduler,
worker, gateway, redis-server), the worker is stopped for 20 s (SIGSTOP, then SIGCONT) and
a detokenizer is stalled. For each fault:

- no client hangs: every stream ends, with its text or an error event, and none waits
  longer than END_S for its next event after the fault;
- what passes through a stateless stage is neither lost nor duplicated: the greedy texts
  equal the ones served before any fault;
- the launcher restarts the process, and a new request succeeds within a stated bound;
- a stalled detokenizer's steps move to the other replica in under 2 s.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator

import aiohttp
import anyio
import psutil
import pytest
import redis
import redis.asyncio

from common import keys
from tests.e2e_fixtures import ServerProcess, serve_args, serving
from tests.sse_client import Streamed, stream_one

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPTS = ["The capital of France is", "def fibonacci(n):\n   ", "1, 2, 3, 5, 8, 13,",
           "Once upon a time, in a small village,"]
MAX_TOKENS = 32  # on CPU a stream takes seconds: a fault lands mid-stream
END_S = 10.0  # after a fault, no stream waits longer than this for its next event
RECOVER_S = 60.0  # a new request succeeds this soon after a process is restarted
STALL_GAP_S = 2.0  # the longest gap between chunks while a detokenizer is stalled
WORKER_STOP_S = 20.0
TOKENIZER_TRIES = 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("faults")
    args = [*serve_args(root / "run"), "--tokenizer-replicas", "2",
            "--detokenizer-replicas", "2", "--max-queue-len", "64"]
    with serving(args, root / "serve.log", root / "run") as served:
        yield served


@pytest.fixture(scope="module")
def baseline(server: ServerProcess) -> list[str]:
    """The greedy texts served before any fault."""
    outcomes = anyio.run(stream_all, server.url, PROMPTS)
    assert all(o.done and o.error is None for o in outcomes), outcomes
    return [o.text for o in outcomes]


def children(server: ServerProcess, name: str) -> list[psutil.Process]:
    """The launcher's live children of one kind ("redis-server" or a service name)."""
    found = []
    for child in psutil.Process(server.process.pid).children(recursive=True):
        try:
            cmdline, process_name = child.cmdline(), child.name()
        except psutil.NoSuchProcess:
            continue
        if process_name == name or ("services.cli" in cmdline and name in cmdline):
            found.append(child)
    return found


async def stream_all(url: str, prompts: list[str], fault=None,
                     at_once: bool = False) -> list[Streamed]:
    """Stream every prompt at once; `fault()` runs once every stream has its first
    chunk (`at_once`: as soon as they are sent)."""
    headers = {"Authorization": "Bearer sk-headrace-test"}
    outcomes: list[Streamed] = [Streamed() for _ in prompts]
    async with aiohttp.ClientSession(headers=headers,
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async with anyio.create_task_group() as tasks:
            for prompt, out in zip(prompts, outcomes):
                tasks.start_soon(stream_one, session, url, prompt, out, MAX_TOKENS)
            if fault is not None:
                while not at_once and not all(o.chunk_times or o.ended_at for o in outcomes):
                    await anyio.sleep(0.02)
                await fault()
    return outcomes


def request_ok(server: ServerProcess) -> bool:
    outcome = anyio.run(stream_all, server.url, PROMPTS[:1])[0]
    return outcome.done and outcome.error is None and bool(outcome.text)


def recovers(server: ServerProcess, within_s: float = RECOVER_S) -> float:
    """Seconds until a new request succeeds (the restarted process serves)."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if request_ok(server):
            return time.monotonic() - start
        time.sleep(0.5)
    raise AssertionError(f"no request succeeded for {within_s}s:\n{server.log_tail()}")


def kill(server: ServerProcess, name: str, sig: int = signal.SIGKILL) -> list[int]:
    targets = children(server, name)
    assert targets, f"no {name} process running"
    os.kill(targets[0].pid, sig)
    return [targets[0].pid]


def killing(server: ServerProcess, name: str, sig: int = signal.SIGKILL
            ) -> tuple[Callable[[], Awaitable[None]], list[int]]:
    """A fault that sends `sig` to one `name` process, and the list of pids it hit."""
    hit: list[int] = []

    async def fault() -> None:
        hit.extend(kill(server, name, sig))
    return fault, hit


def wait_restarted(server: ServerProcess, name: str, gone: list[int], count: int = 1) -> None:
    deadline = time.monotonic() + RECOVER_S
    while time.monotonic() < deadline:
        pids = [p.pid for p in children(server, name)]
        if len(pids) >= count and not set(pids) & set(gone):
            return
        time.sleep(0.2)
    raise AssertionError(f"the launcher did not restart {name}:\n{server.log_tail()}")


def replica_of(process: psutil.Process) -> str:
    cmdline = process.cmdline()
    return cmdline[cmdline.index("--replica") + 1]


def wait_consuming(server: ServerProcess, name: str, stream: str) -> None:
    """Every `name` replica takes entries of `stream` (a restarted one may still be
    loading its tokenizer): requests run until each replica had one delivered during the
    last of them."""
    client = redis.Redis(unix_socket_path=str(server.run_dir / "redis.sock"))
    deadline = time.monotonic() + RECOVER_S
    try:
        while time.monotonic() < deadline:
            start = time.monotonic()
            assert request_ok(server), server.log_tail()
            took_ms = 1000 * (time.monotonic() - start)
            idle = {row["name"].decode(): row["idle"]
                    for row in client.xinfo_consumers(stream, name)}
            if all(idle.get(f"{name}-{replica_of(p)}", took_ms + 1) <= took_ms
                   for p in children(server, name)):
                return
    finally:
        client.close()
    raise AssertionError(f"not every {name} reads {stream}:\n{server.log_tail()}")


def faulted(server: ServerProcess, fault, at_once: bool = False
            ) -> tuple[list[Streamed], float]:
    """Streams with `fault` run mid-way; the outcomes and when the fault was done."""
    fault_at = [0.0]

    async def at_fault() -> None:
        await fault()
        fault_at[0] = time.monotonic()

    return anyio.run(stream_all, server.url, PROMPTS, at_fault, at_once), fault_at[0]


async def holds_requests(client: redis.asyncio.Redis, consumer: str) -> bool:
    """Whether entries of hr:requests were delivered to `consumer` and not acknowledged."""
    return bool(await client.xpending_range(keys.REQUESTS, "tokenizer", "-", "+", 1,
                                            consumername=consumer))


def assert_all_end(outcomes: list[Streamed], fault_at: float, server: ServerProcess) -> None:
    """Every stream ended, none waited more than END_S for an event after the fault."""
    for o in outcomes:
        assert o.done or o.error, o
        assert o.longest_gap(fault_at) <= END_S and o.ended_at - max(
            [fault_at, *o.chunk_times]) <= END_S, (o, server.log_tail())


def assert_text_or_error(outcomes: list[Streamed], baseline: list[str]) -> None:
    """Each stream has its whole text (it was done when the fault struck) or ends with
    an error event and [DONE]; the fault struck at least one."""
    for o, text in zip(outcomes, baseline):
        assert o.done and (o.error or o.text == text), o
    assert any(o.error for o in outcomes), outcomes


# --- stateless stages: nothing lost, nothing duplicated ----------------------------------

def test_a_killed_tokenizer_loses_nothing(server, baseline):
    """Stopped first, so that its blocked read takes requests it never tokenizes; then
    killed: the restarted replica reads what it left pending."""
    for _ in range(TOKENIZER_TRIES):
        victim, outcomes, fault_at = stop_a_tokenizer_and_kill_it_if_it_holds_requests(server)
        assert_all_end(outcomes, fault_at, server)
        assert [o.error for o in outcomes] == [None] * len(PROMPTS), server.log_tail()
        assert [o.text for o in outcomes] == baseline
        if victim is not None:
            break
    else:
        pytest.fail(f"a stopped tokenizer took no request in {TOKENIZER_TRIES} tries")
    wait_restarted(server, "tokenizer", [victim], count=2)


def stop_a_tokenizer_and_kill_it_if_it_holds_requests(
        server: ServerProcess) -> tuple[int | None, list[Streamed], float]:
    """A stopped replica takes requests only while its last blocked read lasts (up to 1 s),
    and only those the other replica does not take first: if it took none, it is let go on
    and the streams are served by the other. The killed pid, if any, and the streams."""
    victim = children(server, "tokenizer")[0]
    consumer = "tokenizer-" + replica_of(victim)
    victim.send_signal(signal.SIGSTOP)
    killed: list[int] = []

    async def kill_once_it_holds_requests() -> None:
        client = redis.asyncio.Redis(unix_socket_path=str(server.run_dir / "redis.sock"))
        try:
            with anyio.move_on_after(1.5):
                while not await holds_requests(client, consumer):
                    await anyio.sleep(0.02)
                victim.send_signal(signal.SIGKILL)
                killed.append(victim.pid)
        finally:
            await client.aclose()
        if not killed:
            victim.send_signal(signal.SIGCONT)

    outcomes, fault_at = faulted(server, kill_once_it_holds_requests, at_once=True)
    return (killed[0] if killed else None), outcomes, fault_at


def test_a_killed_detokenizer_loses_nothing(server, baseline):
    fault, gone = killing(server, "detokenizer")

    outcomes, fault_at = faulted(server, fault)
    assert_all_end(outcomes, fault_at, server)
    assert [o.error for o in outcomes] == [None] * len(PROMPTS), server.log_tail()
    assert [o.text for o in outcomes] == baseline
    wait_restarted(server, "detokenizer", gone, count=2)


def test_a_stalled_detokenizer_hands_its_steps_over(server, baseline):
    wait_consuming(server, "detokenizer", keys.DETOK)  # the other one must take over
    stall, stalled = killing(server, "detokenizer", signal.SIGSTOP)

    try:
        outcomes, stall_at = faulted(server, stall)
    finally:
        for pid in stalled:
            os.kill(pid, signal.SIGCONT)
    assert [o.text for o in outcomes] == baseline
    gaps = [o.longest_gap(stall_at) for o in outcomes]
    assert max(gaps) < STALL_GAP_S, gaps


# --- stateful stages: a clear error, then service again ----------------------------------

@pytest.mark.parametrize("name", ["scheduler", "worker"])
def test_a_killed_stateful_stage_ends_its_streams_with_an_error(server, baseline, name):
    fault, gone = killing(server, name)

    outcomes, fault_at = faulted(server, fault)
    assert_all_end(outcomes, fault_at, server)
    assert_text_or_error(outcomes, baseline)
    wait_restarted(server, name, gone)
    recovers(server)


def test_a_killed_gateway_drops_its_connections_and_frees_its_requests(server, baseline):
    fault, gone = killing(server, "gateway")

    outcomes, fault_at = faulted(server, fault)
    assert_all_end(outcomes, fault_at, server)
    assert all(o.error and not o.done for o in outcomes), outcomes
    wait_restarted(server, "gateway", gone)
    recovers(server)
    assert anyio.run(idle_within, server, END_S), "the dead gateway's requests still run"


def test_a_worker_stopped_for_20s_ends_its_streams_then_is_replaced(server, baseline):
    stop, stopped = killing(server, "worker", signal.SIGSTOP)

    try:
        outcomes, stop_at = faulted(server, stop)
        assert_all_end(outcomes, stop_at, server)
        assert_text_or_error(outcomes, baseline)
        assert server.status("/health") == 503
        time.sleep(max(0.0, stop_at + WORKER_STOP_S - time.monotonic()))
    finally:
        os.kill(stopped[0], signal.SIGCONT)
    # it finds its liveness key lapsed, exits, and the launcher starts a fresh one
    wait_restarted(server, "worker", stopped)
    recovers(server)


def test_a_killed_redis_server_is_restarted_and_serves_again(server, baseline):
    fault, gone = killing(server, "redis-server")

    outcomes, fault_at = faulted(server, fault)
    assert_all_end(outcomes, fault_at, server)
    wait_restarted(server, "redis-server", gone)
    recovers(server)
    again = anyio.run(stream_all, server.url, PROMPTS)
    assert [o.text for o in again] == baseline


async def idle_within(server: ServerProcess, timeout_s: float) -> bool:
    """Whether the scheduler reports nothing running or waiting within `timeout_s`."""
    headers = {"Authorization": "Bearer sk-headrace-test"}
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(headers=headers) as session:
        while time.monotonic() < deadline:
            async with session.get(server.url + "/metrics") as response:
                text = await response.text()
            values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                      if line.startswith(("headrace:num_requests_running{",
                                          "headrace:num_requests_waiting{"))}
            if values and not any(values.values()):
                return True
            await anyio.sleep(0.5)
    return False
