"""The offline engine's worker process: the executor (the model, and the ranks it leads) in
a child process, driven by the engine's loop through a pipe.

On a GPU the in-process engine is host-bound, and its loop and the step thread share one
GIL: while the loop schedules, applies tokens and hands out text, the step thread waits to
prepare and launch the next step (issue 31: 0.86x the served path's throughput). The served
path runs the scheduler and the worker in separate processes, and vLLM's offline engine
runs its engine core in another process; so does this. The child runs the worker's step
thread (services/worker/step_thread.py) as ThreadedSteps does in-process, and the loop
takes the results with the same fixed lag (services/offline/steps.py): the outputs are
the in-line engine's, token for token.

The engine config goes down once, pickled; then the plans, as the served pipeline sends
them (MessagePack StepPlans, and DrainSteps for pipeline stages). The child answers once
its model is loaded, with its KV cache's blocks (the engine's scheduler plans with them) or
the error the load raised, then sends each step's result the moment the step thread posts
it. It is `python -m services.offline.worker_process`, started as services/offline/
children.py says, with its own torch and CUDA.
"""

from __future__ import annotations

import gc
import pickle
import signal
import sys
import traceback
import weakref
from multiprocessing.connection import Connection

from common.bus import Entry
from common.config import EngineConfig
from common.messages import DrainSteps, StepPlan, StepResult, decode, encode
from common.model_info import resolve_engine
from common.service import GIL_SWITCH_S
from services.offline.children import end_child, exit_now, pipe, start_child, start_reader
from services.worker.executor import Executor, start_executor
from services.worker.step_thread import StepThread

EXIT_WAIT_S = 30.0  # the child finishes the launched steps and its followers exit
# what the child sends: one of these bytes, then its body
READY, REFUSED, RESULT, FAILED = b"k", b"n", b"r", b"x"


class ProcessSteps:
    """The parent's end, a `Steps` (services/offline/steps.py). The child loads the model
    while this process goes on (the engine loads its tokenizer meanwhile); `ready()`
    waits for it."""

    def __init__(self, config: EngineConfig) -> None:
        to_child, from_parent = pipe()
        to_parent, from_child = pipe()
        self.process = start_child(__name__, [str(from_parent), str(to_parent)],
                                   (from_parent, to_parent))
        self._send = Connection(to_child, readable=False)
        receive = Connection(from_child, writable=False)
        reader, self._received = start_reader(receive, "worker-results")
        # holds the child's handles, not self: an engine dropped without close() lets the
        # child go
        self._end = weakref.finalize(self, end_child, self._send, self.process, reader,
                                     receive, EXIT_WAIT_S)
        self._drains_on_order = config.pipeline_parallel_size > 1  # as the StepThread's
        self._in_flight = 0
        self._error: BaseException | None = None
        self._send.send_bytes(pickle.dumps(config))

    def ready(self) -> int:
        """The KV cache blocks of the child's executor, once its model is loaded; raises
        what loading it raised."""
        op, body = self._next()
        if op == REFUSED:
            error = pickle.loads(body)
            error.add_note("(raised in the engine's worker process, loading the model)")
            raise error
        return int(body)

    def launch(self, plan: StepPlan) -> None:
        self._order(plan)
        self._in_flight += 1

    def results(self, keep: int) -> list[StepResult]:
        if keep == 0 and self._in_flight and self._drains_on_order:
            self._order(DrainSteps())
        done: list[StepResult] = []
        while self._in_flight > keep:
            op, body = self._next()
            if op == FAILED:
                self._error = RuntimeError(f"the engine's worker process failed: "
                                           f"{body.decode()} (its traceback is above)")
                raise self._error
            self._in_flight -= 1
            done.append(decode(body))
        return done

    def close(self) -> None:
        """The child finishes the launched steps, closes its executor (its followers exit)
        and exits; a second call does nothing."""
        self._end()

    def _order(self, msg: StepPlan | DrainSteps) -> None:
        if self._error is not None:
            raise self._error
        try:
            self._send.send_bytes(encode(msg))
        except BrokenPipeError:
            raise self._exited() from None

    def _next(self) -> tuple[bytes, bytes]:
        """The child's next message: its op, its body."""
        if self._error is not None:
            raise self._error
        data = self._received.get()
        if data is None:
            raise self._exited()
        return data[:1], data[1:]

    def _exited(self) -> RuntimeError:
        self._error = RuntimeError("the engine's worker process exited (code "
                                   f"{self.process.wait()})")
        return self._error


# --- the child --------------------------------------------------------------------------

def serve(receive: Connection, send: Connection, executor: Executor) -> None:
    """Put each order on the step thread until the input closes, then let the thread
    finish them; it sends each result back as it posts it."""
    thread = StepThread(executor, "", lambda entry, result: post(send, result),
                        log_slow_steps=False)
    thread.start()
    while True:
        try:
            data = receive.recv_bytes()
        except EOFError:
            break
        thread.put(Entry(stream="", id=b"", fields={}, msg=decode(data)))
    thread.stop()
    thread.join()


def post(send: Connection, result: StepResult | BaseException | None) -> None:
    """The step thread's post: a step's result, or the error it ended with (a drain's
    answer and the end after stop() need no message)."""
    if isinstance(result, StepResult):
        send.send_bytes(RESULT + encode(result))
    elif isinstance(result, BaseException):
        traceback.print_exception(result)
        send.send_bytes(FAILED + f"{type(result).__name__}: {result}".encode())


def pickled_error(error: Exception) -> bytes:
    """`error` as the parent can raise it again: itself where it survives pickling (the
    in-process engine's type), else a RuntimeError with its text."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:
        return pickle.dumps(RuntimeError(f"{type(error).__name__}: {error}"))


def main(argv: list[str]) -> int:
    """argv: the file descriptors of the input pipe and the output pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's ^C: the engine ends us
    # the step thread and this reader share the GIL, as the worker service's threads do
    sys.setswitchinterval(GIL_SWITCH_S)
    receive = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    config: EngineConfig = pickle.loads(receive.recv_bytes())
    try:
        executor = start_executor(resolve_engine(config))
    except Exception as e:
        send.send_bytes(REFUSED + pickled_error(e))
        return 1
    send.send_bytes(READY + str(executor.num_blocks).encode())
    # full collections would walk the model's objects (common.service.freeze_heap)
    gc.collect()
    gc.freeze()
    try:
        serve(receive, send, executor)
    finally:
        executor.close()
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
