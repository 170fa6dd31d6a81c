"""What the offline engine's child processes (the detokenizer and the worker) share: a pipe
each way, a parent-side thread that reads everything the child sends, and the end.

Each child is `python -m <its module>` with the pipes' ends passed as file descriptors, not
a multiprocessing child: spawn would import the user's script again in the child, and fork
would copy a process that holds CUDA and torch's threads. It exits when its input pipe
closes, so it ends with the engine or with the process that started it. Imports no torch:
the detokenizer child starts without it.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path


def pipe() -> tuple[int, int]:
    """(write end, read end) of a new pipe."""
    read_end, write_end = os.pipe()
    return write_end, read_end


def start_child(module: str, args: list[str], child_ends: tuple[int, int]
                ) -> subprocess.Popen:
    """`python -m module args...`, given `child_ends`, its ends of the pipes (named in
    `args`); this process's copies of them are closed, so that the child's exit is the EOF
    of what it sends."""
    try:
        return subprocess.Popen([sys.executable, "-m", module, *args], pass_fds=child_ends,
                                env=child_env())
    finally:
        for end in child_ends:
            os.close(end)


def child_env() -> dict[str, str]:
    """This process's environment, with the directory that holds `services` first on the
    child's path: the child imports the same code however this process found it."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def start_reader(receive: Connection, name: str) -> tuple[threading.Thread,
                                                         queue.SimpleQueue[bytes | None]]:
    """A thread that queues every message the child sends as it comes, so that the child
    never blocks on a full pipe while the engine blocks sending it one; None once the child
    has exited. It holds no reference to its owner: an engine dropped without close()
    closes its end of the input pipe, the child exits, and so does the thread."""
    received: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    thread = threading.Thread(target=_read_all, args=(receive, received), name=name,
                              daemon=True)
    thread.start()
    return thread, received


def _read_all(receive: Connection, received: queue.SimpleQueue[bytes | None]) -> None:
    while True:
        try:
            received.put(receive.recv_bytes())
        except (EOFError, OSError):
            received.put(None)
            return


def end_child(send: Connection, process: subprocess.Popen, reader: threading.Thread,
              receive: Connection, wait_s: float) -> None:
    """Close the child's input and wait for it to exit (killed after `wait_s`), then for
    the reader. A second call does nothing."""
    if send.closed:
        return
    send.close()
    try:
        process.wait(wait_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    reader.join(wait_s)
    receive.close()


def exit_now(code: int) -> None:
    """The child's end, without the interpreter's teardown, as a tensor-parallel follower
    ends (services/worker/ranks.py, leave_now): on a loaded CPU the teardown outlasted the
    engine's wait at close(), which then killed the child."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
