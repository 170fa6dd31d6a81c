"""`headrace bench scheduler`: the scheduler core's host time per generated token.

The scheduler core runs the nano workload's requests (prompt and output lengths uniform in
[100, 1024], as `bench throughput` draws them) against a worker that answers every step at
once, so only the core's Python is timed: `schedule` (planning, block allocation) and
`update` (appending tokens, finish checks, the detokenizers' items). Both run once per
engine step in the in-process loop and in the served scheduler, so their cost per token
bounds either path's throughput on a given host. No model and no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from benchmarks.bench.workloads import nano_workload
from common.messages import AdmitRequest, StepResult
from services.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS = 1 << 20  # as many as the requests need: no preemption in the timed run
TOKEN = 7  # every step samples this token (ignore_eos: it ends nothing)


def nano_requests(num_prompts: int, seed: int) -> list[AdmitRequest]:
    """The nano workload's requests, admitted as the tokenizer would admit them."""
    workload = nano_workload(num_prompts, seed)
    return [AdmitRequest(f"r{i}", "bench", prompt, params)
            for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params))]


def run(config: SchedulerConfig, requests: list[AdmitRequest]) -> dict[str, float]:
    """Seconds in schedule and update over the whole run, steps and tokens reported."""
    scheduler = Scheduler(config)
    for admit in requests:
        scheduler.add_request(admit)
    schedule_s = update_s = 0.0
    steps = tokens = 0
    clock = time.perf_counter
    while scheduler.has_unfinished():
        started = clock()
        plan = scheduler.schedule()
        planned = clock()
        assert plan is not None, "nothing planned with requests left"
        # a prompt's chunk before its last samples nothing: as the worker, leave it out
        sampled = [rid for rid in plan.req_ids if scheduler.requests[rid].num_pending]
        items = scheduler.update(StepResult(step=plan.step, req_ids=sampled,
                                            token_ids=[TOKEN] * len(sampled)))
        schedule_s += planned - started
        update_s += clock() - planned
        steps += 1
        tokens += sum(len(item.new_token_ids) for item in items)
    return {"schedule_s": schedule_s, "update_s": update_s, "steps": steps,
            "tokens": tokens}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="headrace bench scheduler", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--pipeline-stages", type=int, default=1,
                        help="plan as for this many pipeline stages (common/pipeline.py)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs; the fastest is reported (the others show the noise)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=4096, block_size=16, num_blocks=NUM_BLOCKS,
                             pipeline_stages=args.pipeline_stages)
    runs = [run(config, nano_requests(args.num_prompts, args.seed))
            for _ in range(args.repeat)]
    for figures in runs:
        per_token = {k: figures[f"{k}_s"] / figures["tokens"] * 1e6
                     for k in ("schedule", "update")}
        figures.update({f"{k}_us_per_token": v for k, v in per_token.items()})
        print(f"steps {figures['steps']:6d}  tokens {figures['tokens']:7d}  "
              f"schedule {per_token['schedule']:6.2f} us/token  "
              f"update {per_token['update']:6.2f} us/token")
    best = min(runs, key=lambda f: f["schedule_s"] + f["update_s"])
    total = best["schedule_us_per_token"] + best["update_us_per_token"]
    print(f"best: schedule + update {total:.2f} us/token")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs,
                       "machine": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "python": platform.python_version()},
                      f, indent=2)
    return 0
