"""`headrace bench validation`: what the gateway's pydantic models cost a request.

On bodies a client sends, times the request model's validation alone (what the models add
to a request: the target, issue 15, is under 50 microseconds) and the whole `parse_job`
(the model, then the sampling values checked by building a SamplingParams, which the
hand-written validation before the models did too); and the building and serialization
of one streamed chunk.

    headrace bench validation [--iterations N] [--json FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from benchmarks.bench.host_json import write_host_json
from common.messages import TextDelta, TokenLogprobs
from services.gateway import chunk_writer, parse_job, validate_body

TARGET_US = 50.0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
TURNS = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 80}
         for i in range(20)]
BODIES: dict[str, tuple[bool, dict[str, Any]]] = {
    "completion, prompt only": (False, {"model": "m", "prompt": "Hello"}),
    "chat, 2 messages, 8 sampling fields, stream": (True, {
        "model": "m", "messages": TURNS[:2], "temperature": 0.7, "top_p": 0.9, "top_k": 40,
        "max_tokens": 128, "seed": 1, "stop": ["\n\n"], "presence_penalty": 0.1,
        "frequency_penalty": 0.1, "stream": True, "stream_options": {"include_usage": True}}),
    "chat, 20 messages of 80 words": (True, {"model": "m", "messages": TURNS}),
    "chat, json_schema response_format": (True, {
        "model": "m", "messages": TURNS[:1],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "person", "schema": SCHEMA}}}),
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench validation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=20_000)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    models = {name: timed(lambda c=chat, b=body: validate_body(b, c), args.iterations)
              for name, (chat, body) in BODIES.items()}
    whole = {name: timed(lambda c=chat, b=body: parse_job(b, c), args.iterations)
             for name, (chat, body) in BODIES.items()}
    chunks = chunk_rows(args.iterations)
    for title, rows in (("request model only", models), ("parse_job whole", whole),
                        ("response chunk", chunks)):
        print(title)
        for name, row in rows.items():
            print(f"  {name:<48} p50 {row['p50_us']:7.2f} us  mean {row['mean_us']:7.2f} us")
    if args.json:
        write_host_json(args.json, {
            "iterations": args.iterations, "target_us": TARGET_US,
            "request_model_only": models, "parse_job_whole": whole, "chunk": chunks})
    over = [name for name, row in models.items() if row["p50_us"] > TARGET_US]
    print("PASS" if not over else f"OVER {TARGET_US:g} us: {', '.join(over)}")
    return 0 if not over else 1


def chunk_rows(iterations: int) -> dict[str, dict[str, float]]:
    """One streamed chat chunk: built from a text delta and serialized, plain and with
    top-5 logprobs."""
    rows = {}
    for name, body, logprobs in (("chat chunk, serialized", {}, []),
                                 ("chat chunk with top-5 logprobs, serialized",
                                  {"logprobs": True, "top_logprobs": 5},
                                  [TokenLogprobs(list(range(6)), [-0.5] * 6, 1,
                                                 ["tok"] * 6)])):
        job = parse_job({"messages": TURNS[:1], "stream": True, **body}, chat=True)
        write = chunk_writer(job, "chatcmpl-x", "m")
        seq = iter(range(10**9))

        def chunk() -> None:
            write(TextDelta("chatcmpl-x", 0, next(seq), " word", [5], 4, logprobs=logprobs))
        rows[name] = timed(chunk, iterations)
    return rows


def timed(work: Callable[[], Any], iterations: int) -> dict[str, float]:
    for _ in range(min(1000, iterations)):  # warm-up: caches, lazily built validators
        work()
    samples = []
    for _ in range(iterations):
        start = time.perf_counter_ns()
        work()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return {"p50_us": statistics.median(samples), "mean_us": statistics.fmean(samples),
            "p99_us": statistics.quantiles(samples, n=100)[98]}
