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
import json
import os
import platform
import time

import torch

from common.messages import StepPlan
from common.sampling_params import SamplingParams
from services.worker.block_table import BlockTable
from services.worker.inputs import prepare_inputs
from services.worker.request_state import RequestState

BLOCK_SIZE = 16
PROMPT_LEN = 32


def decode_step(rows: int, logprobs: int | None) -> tuple[StepPlan, list[RequestState],
                                                         BlockTable]:
    """A plan of `rows` one-token decodes whose last token is pending, and their states."""
    table = BlockTable(rows=rows, width=16)
    params = SamplingParams(temperature=0.0, logprobs=logprobs)
    states = []
    for i in range(rows):
        context = PROMPT_LEN + i % 128
        first = i * 16
        blocks = list(range(first, first + context // BLOCK_SIZE + 1))
        states.append(RequestState(f"r{i}", list(range(PROMPT_LEN)),
                                   list(range(context - PROMPT_LEN)), table.add(blocks),
                                   params, None, pending=1, sample_row=i))
    plan = StepPlan(step=1, req_ids=[s.req_id for s in states], num_scheduled_tokens=[1] * rows,
                    num_computed_tokens=[s.num_tokens for s in states])
    return plan, states, table


def time_steps(rows: int, logprobs: int | None, iterations: int) -> float:
    """Mean us a step over `iterations`, after as many untimed ones a tenth as long."""
    plan, states, table = decode_step(rows, logprobs)
    last_tokens = torch.zeros(rows, dtype=torch.int64)
    cpu = torch.device("cpu")
    for _ in range(max(1, iterations // 10)):
        prepare_inputs(plan, states, table, BLOCK_SIZE, last_tokens, cpu)
    started = time.perf_counter()
    for _ in range(iterations):
        prepare_inputs(plan, states, table, BLOCK_SIZE, last_tokens, cpu)
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
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "us_per_step": runs,
                       "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "python": platform.python_version()},
                      f, indent=2)
    return 0
