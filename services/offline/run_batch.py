"""`headrace run-batch -i in.jsonl -o out.jsonl --model M`: an OpenAI batch file run through
the offline engine, as `vllm run-batch` does.

Each input line is a request of OpenAI's batch format, `{"custom_id", "method": "POST",
"url", "body"}`, for /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/score or
/v1/rerank (as vLLM's run-batch takes them). A body goes
the way a served request goes: the gateway's parsing and its call (services/gateway), the
tokenizer stage's processing, the engine's scheduler, executor and detokenizer; so an output
body is what the server would have answered. All requests run together (continuous
batching) and each output line is OpenAI's: `{"id", "custom_id", "response":
{"status_code", "request_id", "body"}, "error": null}`, in input order. A request the
server would refuse with an HTTP error is answered with that status and error body. A
line with `use_beam_search` runs its rounds as the gateway does (services/gateway/beam.py):
each round a call of one-token requests among the batch's others, then the best beams.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from common.config import ConfigError, add_engine_args, engine_config_from_args
from common.errors import ApiError
from common.model_support import REFUSED_EXIT, UnsupportedModel, refusal_line
from common.token_text import TokenTexts
from services.gateway.beam import BeamRounds
from services.gateway.core import Call
from services.gateway.embeddings import EmbeddingCall, check_dimensions
from services.gateway.protocol import Job, parse_embedding, parse_job
from services.gateway.response_bodies import to_dict
from services.gateway.scoring import (check_scorable, parse_rerank, parse_score,
                                      rerank_response, score_response, scores)

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
SCORE, RERANK = "/v1/score", "/v1/rerank"
URLS = (CHAT, COMPLETIONS, EMBEDDINGS, SCORE, RERANK)
LOCAL_REPLY = "batch"  # the reply_to of the requests; nothing reads it offline
# fields the gateway takes that a batch cannot honour
_REFUSED = {"stream": "a batch answers whole responses",
            "echo": "run-batch does not echo prompts"}


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


def read_batch(text: str, source: str = "the batch file") -> list[BatchLine]:
    """The requests of a batch file; a malformed line is a ValueError naming it."""
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{source} line {number}"
        try:
            item = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"{where} is not JSON: {e}") from None
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            raise ValueError(f"{where} needs a string 'custom_id'")
        if item.get("method", "POST") != "POST":
            raise ValueError(f"{where}: method {item['method']!r}; batch requests are POST")
        if item.get("url") not in URLS:
            raise ValueError(f"{where}: url {item.get('url')!r} is not one of "
                             f"{', '.join(URLS)}")
        if not isinstance(item.get("body"), dict):
            raise ValueError(f"{where} needs a JSON object 'body'")
        lines.append(BatchLine(item["custom_id"], item["url"], item["body"]))
    return lines


def output_line(line: BatchLine, request_id: str, status: int, body: dict[str, Any]
                ) -> dict[str, Any]:
    return {"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None}


class BatchRun:
    """The batch's calls on one engine: each line's call, its requests submitted to the
    engine, and the engine's deltas fed back to the calls."""

    def __init__(self, engine: Any, names: list[str]) -> None:
        self.engine, self.names = engine, names
        self.created = int(time.time())
        # by call id: what a score or rerank call answers from its embeddings
        self.shapes: dict[str, Callable[[EmbeddingCall], BaseModel]] = {}
        # by the id of a round's call: its beam search, and the line's model
        self.rounds: dict[str, tuple[BeamRounds, str]] = {}
        self.token_text = TokenTexts(engine.info.tokenizer)  # a beam's logprob tokens

    def run(self, lines: list[BatchLine], use_tqdm: bool = True) -> list[dict[str, Any]]:
        from tqdm import tqdm

        outputs: list[dict[str, Any] | None] = [None] * len(lines)
        calls: dict[str, tuple[int, Call | EmbeddingCall]] = {}
        for i, line in enumerate(lines):
            try:
                call = self.submit(line)
            except ApiError as e:
                outputs[i] = output_line(line, "", e.status, e.body())
                continue
            calls.update((rid, (i, call)) for rid in call.rids)
        bar = tqdm(total=len(lines), desc="Running batch", unit="req", disable=not use_tqdm,
                   initial=sum(o is not None for o in outputs))
        while self.engine.has_unfinished():
            for delta in self.engine.step():
                i, call = calls[delta.rid]
                call.offer(delta)
                if not call.done or outputs[i] is not None:
                    continue
                if call.id in self.rounds:
                    try:
                        call = self.next_round(call)
                    except ApiError as e:
                        call.error = e
                    if not call.done:  # the next round's call
                        calls.update((rid, (i, call)) for rid in call.rids)
                        continue
                outputs[i] = self.answer(lines[i], call)
                bar.update(1)
        bar.close()
        assert all(o is not None for o in outputs), "the engine stopped before every answer"
        return outputs  # type: ignore[return-value]

    def submit(self, line: BatchLine) -> Call | EmbeddingCall:
        """The line's call, its requests admitted to the engine (none if one is refused)."""
        for name, why in _REFUSED.items():
            if line.body.get(name):
                raise ApiError(400, f"{name!r} is not available in a batch: {why}", name)
        model = self.model(line.body.get("model"))
        call: Call | EmbeddingCall
        if line.url == EMBEDDINGS:
            job = parse_embedding(line.body)
            check_dimensions(job.dimensions, self.engine.info.hf_config.hidden_size)
            call = EmbeddingCall(job, "embd-" + uuid.uuid4().hex, model, self.created)
        elif line.url in (SCORE, RERANK):
            call = self.scoring_call(line, model)
        else:
            chat = line.url == CHAT
            job = parse_job(line.body, chat)
            if job.tool_choice == "auto":
                raise ApiError(400, "run-batch has no tool-call parser for tool_choice "
                                    "\"auto\": give \"none\", \"required\" or a function",
                               "tool_choice")
            if job.beam is not None:
                return self.start_round(BeamRounds(job, self.engine.info), model)
            call = self.call(job, model)
        self.add(call)
        return call

    def call(self, job: Job, model: str) -> Call:
        return Call(job, ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex, model,
                    self.created, time.monotonic(), response_id=(
                        None if job.request_id is None
                        else ("chatcmpl-" if job.chat else "cmpl-") + job.request_id))

    def add(self, call: Call | EmbeddingCall) -> None:
        """The call's requests admitted to the engine (none if one is refused)."""
        admits = [self.engine.processor.process(req)
                  for req in call.requests(LOCAL_REPLY, time.time())]
        for admit in admits:
            self.engine.scheduler.add_request(admit)

    def start_round(self, rounds: BeamRounds, model: str) -> Call:
        call = self.call(rounds.round_job(), model)
        self.rounds[call.id] = (rounds, model)
        self.add(call)
        return call

    def next_round(self, round_call: Call) -> Call:
        """After a beam search's round: the next round's call, or the search's own call
        with the best beams settled."""
        rounds, model = self.rounds.pop(round_call.id)
        rounds.advance(round_call)
        if not rounds.done:
            return self.start_round(rounds, model)
        call = self.call(rounds.job, model)
        rounds.settle(call, self.token_text)
        return call

    def scoring_call(self, line: BatchLine, model: str) -> EmbeddingCall:
        """The embeddings a score or rerank line needs, and how its answer is made."""
        check_scorable(self.engine.info.hf_config, line.url)
        if line.url == SCORE:
            pairs = parse_score(line.body)
            call = EmbeddingCall(pairs.job, "score-" + uuid.uuid4().hex, model, self.created)
            self.shapes[call.id] = lambda c: score_response(
                c.id, c.created, c.model, scores(pairs, c.embeddings()), c.prompt_tokens())
            return call
        rerank = parse_rerank(line.body)
        call = EmbeddingCall(rerank.pairs.job, "rerank-" + uuid.uuid4().hex, model,
                             self.created)
        self.shapes[call.id] = lambda c: rerank_response(
            c.id, c.model, rerank, scores(rerank.pairs, c.embeddings()), c.prompt_tokens())
        return call

    def model(self, name: Any) -> str:
        if name is not None and name not in self.names:
            raise ApiError(404, f"The model `{name}` does not exist; this batch runs "
                                f"{', '.join(map(repr, self.names))}.", "model")
        return self.names[0]

    def answer(self, line: BatchLine, call: Call | EmbeddingCall) -> dict[str, Any]:
        if call.error is not None:
            return output_line(line, call.id, call.error.status, call.error.body())
        shape = self.shapes.pop(call.id, None)
        body = shape(call) if shape is not None else call.response()  # type: ignore[arg-type]
        return output_line(line, call.id, 200, to_dict(body))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace run-batch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-i", "--input-file", required=True,
                        help="the batch file (JSON lines of OpenAI's batch format)")
    parser.add_argument("-o", "--output-file", required=True,
                        help="where the output lines go (JSON lines, in input order)")
    parser.add_argument("--served-model-name", nargs="+", default=[],
                        help="model names the bodies may give; the first is reported "
                             "(default: --model)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_engine_args(parser)
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = engine_config_from_args(args)
        lines = read_batch(Path(args.input_file).read_text(), args.input_file)
    except (ConfigError, ValueError, OSError) as e:
        parser.error(str(e))
    from services.offline.llm import LLM  # torch is imported only once the flags are valid

    try:
        llm = LLM(**dataclasses.asdict(config))
    except UnsupportedModel as e:
        print(refusal_line(e), file=sys.stderr)
        return REFUSED_EXIT
    except ConfigError as e:
        parser.error(str(e))
    names = list(args.served_model_name) or [config.model]
    outputs = BatchRun(llm.engine, names).run(lines, use_tqdm=not args.disable_tqdm)
    with open(args.output_file, "w") as out:
        out.writelines(json.dumps(o) + "\n" for o in outputs)
    failed = sum(o["response"]["status_code"] != 200 for o in outputs)
    print(f"run-batch: {len(outputs)} requests, {failed} failed; wrote {args.output_file}",
          file=sys.stderr)
    return 0
