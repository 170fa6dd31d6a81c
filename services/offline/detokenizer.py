"""The offline engine's detokenizer process: the served pipeline's detokenizer core, run
beside the engine's loop rather than inside it.

Detokenization is pure host work, most of it Python holding the GIL, and on a GPU the
in-process loop is host-bound: its schedule, launch, update and detokenization run one after
another while the device waits (issue 31: detokenization was the largest part). A thread
would share the GIL with the loop; a process does not. So the engine sends each step's
DetokItems (one TokenBatch, as the scheduler sends hr:detok) down a pipe and takes the
TextDeltas (one ReplyBatch per batch, in order) when they are back, while it plans and
launches the next steps.

Only items whose text cannot change the scheduler's course come here: a stop string's abort
must reach the scheduler before it plans again, so those items stay in the engine's own
detokenizer (services/offline/engine.py), and every batch, hence every token, is the one the
in-line engine makes.

Logprobs do not cross the pipe: their only text is each entry's token text, a lookup in a
cached table, while the child spent more on unpacking them and packing them again with
their texts than on the text itself, and the loop waited on the full pipe (issue 31:
logprobs=1 cost the nano workload a third of its tokens per second). The parent keeps each
batch's logprobs and puts them, with their texts, on the deltas that come back.

The child is `python -m services.offline.detokenizer`, started as services/offline/
children.py says. It loads only the tokenizer (no torch).
"""

from __future__ import annotations

import argparse
import gc
import queue
import sys
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from common.messages import (DetokItem, ReplyBatch, TextDelta, TokenBatch, TokenLogprobs,
                             decode, encode, with_fields)
from common.token_columns import batch_items, token_batch
from services.offline.children import end_child, exit_now, pipe, start_child, start_reader

EXIT_WAIT_S = 10.0
WithTexts = Callable[[list[TokenLogprobs | None]], list[TokenLogprobs | None]]
# an item's (logprobs, prompt_logprobs), kept in the parent while its text is in the child
KeptLogprobs = tuple[list[TokenLogprobs], list[TokenLogprobs | None]]


class DetokenizerProcess:
    """The parent's end: `submit` a step's items, `collect` the deltas that are back.
    `with_texts` gives logprobs their entries' texts (Detokenizer.with_texts)."""

    def __init__(self, model_dir: Path, with_texts: WithTexts,
                 tokenizer: str | None = None, trust_remote_code: bool = False) -> None:
        self._with_texts = with_texts
        # per batch sent and not collected: its items' logprobs, None when it has none
        self._kept: deque[list[KeptLogprobs] | None] = deque()
        to_child, from_parent = pipe()
        to_parent, from_child = pipe()
        args = [str(model_dir), str(from_parent), str(to_parent)]
        if tokenizer is not None:
            args += ["--tokenizer", tokenizer]
        if trust_remote_code:
            args.append("--trust-remote-code")
        self.process = start_child(__name__, args, (from_parent, to_parent))
        self._send = Connection(to_child, readable=False)
        self._receive = Connection(from_child, writable=False)
        self._reader, self._replies = start_reader(self._receive, "detokenizer-replies")
        self.pending = 0  # batches sent whose deltas are not collected yet

    def submit(self, items: list[DetokItem]) -> None:
        kept: list[KeptLogprobs] | None = None
        if any(item.logprobs or item.prompt_logprobs for item in items):
            kept = [(item.logprobs, item.prompt_logprobs) for item in items]
            items = [with_fields(item, logprobs=[], prompt_logprobs=[])
                     if item.logprobs or item.prompt_logprobs else item for item in items]
        try:
            self._send.send_bytes(encode(token_batch(0, items)))
        except BrokenPipeError:
            raise self._exited() from None
        self._kept.append(kept)
        self.pending += 1

    def collect(self, wait: bool = False) -> list[TextDelta]:
        """The deltas of the batches back so far, in the order they were sent; with `wait`,
        of one batch at least, when one is pending."""
        deltas: list[TextDelta] = []
        while self.pending:
            try:
                data = self._replies.get(block=wait and not deltas)
            except queue.Empty:
                break
            if data is None:
                raise self._exited()
            self.pending -= 1
            reply: ReplyBatch = decode(data)
            kept = self._kept.popleft()
            deltas += reply.items if kept is None else [
                self._with_logprobs(delta, *lps) for delta, lps in zip(reply.items, kept)]
        return deltas

    def _with_logprobs(self, delta: TextDelta, logprobs: list[TokenLogprobs],
                       prompt_logprobs: list[TokenLogprobs | None]) -> TextDelta:
        """The delta with its item's logprobs, as the child's Detokenizer would have sent
        them."""
        if not logprobs and not prompt_logprobs:
            return delta
        return with_fields(delta, logprobs=self._with_texts(logprobs),
                           prompt_logprobs=self._with_texts(prompt_logprobs))

    def close(self) -> None:
        """The child sees its input end and exits (a second call does nothing)."""
        end_child(self._send, self.process, self._reader, self._receive, EXIT_WAIT_S)

    def _exited(self) -> RuntimeError:
        return RuntimeError("the offline detokenizer process exited (code "
                            f"{self.process.wait()}): see its error above")


# --- the child --------------------------------------------------------------------------

def serve(receive: Connection, send: Connection, tokenizer) -> None:
    """Answer each TokenBatch with a ReplyBatch of its deltas, until the input closes."""
    from services.detokenizer.core import Detokenizer

    detokenizer = Detokenizer(tokenizer)
    while True:
        try:
            batch: TokenBatch = decode(receive.recv_bytes())
        except EOFError:
            return
        # no item here has stop strings (the engine keeps those), so none aborts
        send.send_bytes(encode(ReplyBatch([detokenizer.process(item)[0]
                                           for item in batch_items(batch)])))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.offline.detokenizer",
                                     description="the offline engine's detokenizer process")
    parser.add_argument("model_dir")
    parser.add_argument("input_fd", type=int)
    parser.add_argument("output_fd", type=int)
    parser.add_argument("--tokenizer")
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)
    from common.model_files import load_tokenizer, transformers_without_torch

    transformers_without_torch(Path(args.model_dir), args.trust_remote_code)
    receive = Connection(args.input_fd, writable=False)
    send = Connection(args.output_fd, readable=False)
    tokenizer = load_tokenizer(args.model_dir, args.tokenizer, args.trust_remote_code)
    # full collections would walk the tokenizer's objects (common.service.freeze_heap
    # says what that cost the services; its log line would only be noise under a script)
    gc.collect()
    gc.freeze()
    serve(receive, send, tokenizer)
    return 0


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
