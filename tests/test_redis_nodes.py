"""What the local Redis deployments share (benchmarks/bench/redis_nodes.py): a deployment
whose start fails part way leaves no node running."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.bench.redis_nodes import LocalNodes, spawn_node, stop_nodes

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


class HalfStarted(LocalNodes):
    """Starts one node, then fails as a second one would that never answers."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.nodes: list = []

    def start(self) -> None:
        self.nodes.append(spawn_node(SLEEPER, self.run_dir / "a"))
        raise TimeoutError("node b not ready")

    def stop(self) -> None:
        stop_nodes(self.nodes)


def test_a_deployment_that_fails_to_start_stops_the_nodes_it_started(tmp_path):
    deployment = HalfStarted(tmp_path)
    with pytest.raises(TimeoutError):
        with deployment:
            pass
    node, = deployment.nodes
    assert node.poll() is not None  # stopped, not left to outlive the test session
    assert (tmp_path / "a" / "redis.log").exists()
