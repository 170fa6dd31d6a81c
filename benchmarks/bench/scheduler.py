"""`headrace bench scheduler`: the scheduler core's host time per generated token.

The scheduler core runs the nano workload's requests (prompt and output lengths uniform in
[100, 1024], as `bench throughput` draws them) against a worker that answers every step at
once, so only the core's Python is timed: `schedule` (planning, block allocation) and
`update` (appending tokens, finish checks, the detokenizers' items). Both run once per
engine step in the in-process loop and in the served scheduler, so their cost per token
bounds either path's throughput on a given host. No model and no GPU.

`--served` times what the served scheduler does instead: `update_columns`, which leaves a
step's logprobs as the worker's columns, and `encode`, the MessagePack of each plan and of
each step's TokenBatch. `--n` and `--logprobs` give every request n completions and each
sampled token that many logprobs (the detokenizer-bound workload of
benchmarks/gpu/stage_scaling.sh asks n=4, logprobs=5).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.bench.host_json import write_host_json
from benchmarks.bench.workloads import nano_workload
from common.messages import AdmitRequest, StepLogprobs, StepResult, encode
from services.scheduler import Scheduler, SchedulerConfig

NUM_BLOCKS = 1 << 20  # as many as the requests need: no preemption in the timed run
TOKEN = 7  # every step samples this token (ignore_eos: it ends nothing)


def nano_requests(num_prompts: int, seed: int, n: int = 1, logprobs: int | None = None
                  ) -> list[AdmitRequest]:
    """The nano workload's requests, admitted as the tokenizer would admit them."""
    workload = nano_workload(num_prompts, seed)
    return [AdmitRequest(f"r{i}", "bench", prompt, params.replace(n=n, logprobs=logprobs))
            for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params))]


def step_logprobs(rows: int, logprobs: int | None) -> StepLogprobs | None:
    """A step's logprobs columns as the worker sends them: every row logprobs + 1 entries."""
    if logprobs is None:
        return None
    width = logprobs + 1
    return StepLogprobs([width] * rows, [TOKEN] * (rows * width), [-0.5] * (rows * width),
                        [1] * rows)


def run(config: SchedulerConfig, requests: list[AdmitRequest], served: bool = False
        ) -> dict[str, float]:
    """Seconds in schedule, update and (served) encode over the whole run, steps and
    tokens reported."""
    scheduler = Scheduler(config)
    for admit in requests:
        scheduler.add_request(admit)
    logprobs = requests[0].params.logprobs
    schedule_s = update_s = encode_s = 0.0
    steps = tokens = 0
    clock = time.perf_counter
    while scheduler.has_unfinished():
        started = clock()
        plan = scheduler.schedule()
        schedule_s += clock() - started
        assert plan is not None, "nothing planned with requests left"
        # a prompt's chunk before its last samples nothing: as the worker, leave it out
        sampled = [rid for rid in plan.req_ids if scheduler.requests[rid].num_pending]
        result = StepResult(step=plan.step, req_ids=sampled, token_ids=[TOKEN] * len(sampled),
                            logprobs=step_logprobs(len(sampled), logprobs))
        started = clock()
        if served:
            rows, columns = scheduler.update_columns(result)
            updated = clock()
            encode(plan)
            encode(rows.batch(plan.step, logprobs=columns))
            encode_s += clock() - updated
            tokens += len(rows.new_token_ids)
        else:
            items = scheduler.update(result)
            updated = clock()
            tokens += sum(len(item.new_token_ids) for item in items)
        update_s += updated - started
        steps += 1
    return {"schedule_s": schedule_s, "update_s": update_s, "encode_s": encode_s,
            "steps": steps, "tokens": tokens}


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
    parser.add_argument("--n", type=int, default=1, help="completions a request")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="logprobs each sampled token carries")
    parser.add_argument("--served", action="store_true",
                        help="update_columns and encode, as the served scheduler does")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs,
                             max_num_batched_tokens=args.max_num_batched_tokens,
                             max_model_len=4096, block_size=16, num_blocks=NUM_BLOCKS,
                             pipeline_stages=args.pipeline_stages)
    runs = [run(config, nano_requests(args.num_prompts, args.seed, args.n, args.logprobs),
                args.served) for _ in range(args.repeat)]
    phases = ("schedule", "update", "encode") if args.served else ("schedule", "update")
    for figures in runs:
        per_token = {k: figures[f"{k}_s"] / figures["tokens"] * 1e6 for k in phases}
        figures.update({f"{k}_us_per_token": v for k, v in per_token.items()})
        print(f"steps {figures['steps']:6d}  tokens {figures['tokens']:7d}  "
              + "  ".join(f"{k} {v:6.2f} us/token" for k, v in per_token.items()))
    best = min(runs, key=lambda f: sum(f[f"{k}_s"] for k in phases))
    total = sum(best[f"{k}_us_per_token"] for k in phases)
    print(f"best: {' + '.join(phases)} {total:.2f} us/token")
    if args.json:
        write_host_json(args.json, {"args": vars(args), "runs": runs})
    return 0
