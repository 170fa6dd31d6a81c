"""`headrace bench inputs`: the worker's host time to prepare one decode step's inputs.

`services.worker.inputs.prepare_inputs` over a step of `--rows` decoding requests, each with
its sampled token still in flight (as the worker sees a decode step while the step before
runs), contexts of 32 to 159 tokens, greedy with `--logprobs`. The inputs go to the CPU
device, so this times the host's Python and numpy, not a copy. The worker's step thread
does this once a step before it launches the step: at a few hundred rows it is a share of
the step that no GPU hides.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench.host_json import write_host_json
from services.worker import decode_step_preparer


def time_steps(rows: int, logprobs: int | None, iterations: int) -> float:
    """Mean us a step over `iterations`, after as many untimed ones a tenth as long."""
    prepare = decode_step_preparer(rows, logprobs)
    for _ in range(max(1, iterations // 10)):
        prepare()
    started = time.perf_counter()
    for _ in range(iterations):
        prepare()
    return 1e6 * (time.perf_counter() - started) / iterations


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench inputs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 256])
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each size; the fastest is reported")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    runs = {rows: [time_steps(rows, args.logprobs, args.iterations)
                   for _ in range(args.repeat)] for rows in args.rows}
    for rows, times in runs.items():
        print(f"rows {rows:4d}: prepare_inputs {min(times):7.1f} us a step (best of "
              f"{len(times)}: {', '.join(f'{t:.1f}' for t in times)})")
    if args.json:
        write_host_json(args.json, {"args": vars(args), "us_per_step": runs})
    return 0
