"""`headrace bench <name> [args]`: each benchmark lives in benchmarks/bench/<name>.py and is
imported only when run, so `headrace bench bus` does not import torch."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS: dict[str, str] = {
    "bus": "round-trip latency and publish throughput of the Redis Streams bus",
    "throughput": "offline generation throughput (tokens/s) against the workload's floor",
    "latency": "latency of one batch: prefill and per-token decode times",
    "serve": "online serving through the gateway at one request rate: TTFT, ITL, TPOT, e2e",
    "soak": ("hours of mixed traffic, aborts and restarts: RSS, Redis memory and stream "
             "lengths per minute"),
    "validation": "what the gateway's request and response models cost per request",
    "scheduler": "the scheduler core's host time per generated token (no model)",
    "inputs": "the worker's host time to prepare a decode step's inputs (no model)",
    "detokenizer": "a detokenizer replica's host time per streamed token (no model)",
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = ["usage: headrace bench <name> [args]", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {text}" for name, text in BENCHMARKS.items()]
    lines += ["", "`headrace bench <name> --help` describes each benchmark's flags."]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"headrace bench: unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = f"{__name__}.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the benchmark exists but one of its imports is missing
        print(f"headrace bench: the {name!r} benchmark is not available in this install "
              f"({module_name} is missing)", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)
