"""What the local Redis deployments share (the cluster of benchmarks/bench/redis_cluster.py,
which `headrace bench soak --hosts` also starts, and the tests' sentinel and TLS server): a
node started in a folder of its own, a stop that ends every node, and a `with` that leaves
no node behind when starting fails part way."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Self

from common.redis_server import spawn_child

STOP_TIMEOUT_S = 10.0


def spawn_node(args: list[str], node_dir: Path) -> subprocess.Popen[bytes]:
    """redis-server `args` (a data node or a sentinel) run in `node_dir`, its output added
    to node_dir/redis.log. In a session of its own: a Ctrl-C meant for the run that owns
    it does not kill it under that run, which stops it in order."""
    node_dir.mkdir(parents=True, exist_ok=True)
    with open(node_dir / "redis.log", "ab") as log:
        return spawn_child(args, cwd=node_dir, stdin=subprocess.DEVNULL, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)


def stop_nodes(nodes: Iterable[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to every node at once (they save nothing, so they exit fast), then SIGKILL
    to any that has not exited after STOP_TIMEOUT_S."""
    nodes = list(nodes)
    for node in nodes:
        node.terminate()
    for node in nodes:
        try:
            node.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            node.kill()
            node.wait()


def start_or_stop(start: Callable[[], object], stop: Callable[[], object]) -> None:
    """`start`; if it fails part way, `stop` what it had started before the error goes
    on: a context's `__enter__` that raises gets no `__exit__`."""
    try:
        start()
    except BaseException:
        stop()
        raise


class LocalNodes:
    """`with deployment:` runs its `start` and, on the way out, its `stop`."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        start_or_stop(self.start, self.stop)
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
