"""Shared fixtures: one real redis-server and one 3-master Redis Cluster for the session,
emptied before each test.

    def test_x(redis_url): ...                 # a clean Redis, "unix:///.../redis.sock"
    async def test_y(redis_url, restart_redis): # restart_redis(0.3): down 0.3 s, then up (AOF)
    def test_z(cluster_url): ...               # a clean cluster, "redis+cluster://..."
    def test_w(bus_url): ...                   # runs twice: on the server, on the cluster
    @pytest.mark.anyio                          # async tests run on asyncio
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from common.redis_server import EmbeddedRedis
from tests.redis_cluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def embedded_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(embedded_redis: EmbeddedRedis) -> str:
    if embedded_redis.process is None:  # a test stopped it and failed before starting it
        embedded_redis.start()
    client = embedded_redis.client()
    try:
        client.flushall()
    finally:
        client.close()
    return embedded_redis.url


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster: LocalCluster) -> str:
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture(params=["server", "cluster"])
def bus_url(request: pytest.FixtureRequest) -> str:
    """A clean single Redis server, then a clean Redis Cluster."""
    return request.getfixturevalue("redis_url" if request.param == "server" else "cluster_url")


@pytest.fixture
def restart_redis(embedded_redis: EmbeddedRedis) -> Callable[[float], None]:
    """`restart_redis(down_s=0.0)`: stop the session's Redis, wait, start it again on the
    same socket (data come back from the append-only file). Blocking: from async code use
    `anyio.to_thread.run_sync(restart_redis, down_s)`."""
    def restart(down_s: float = 0.0) -> None:
        embedded_redis.stop()
        time.sleep(down_s)
        embedded_redis.start()
    return restart


def repo_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess that imports this repository's packages."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def run_command(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m services.cli <args>` as a subprocess, from the repository root."""
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=REPO,
                          env=repo_env(**env), capture_output=True, text=True,
                          timeout=timeout)
