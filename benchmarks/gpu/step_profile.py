"""Where an in-process step's time goes on the nano workload: runs it with torch.profiler
over a window of decode steps and prints the device kernels and the host functions that
take the time, with the wall time per step and the device time per step.

    source .devkit/env.sh && python benchmarks/gpu/step_profile.py \
        --model .devkit/models/qwen3-0.6b-shape --load-format dummy --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import uuid
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench.throughput import run_inprocess  # noqa: E402
from benchmarks.bench.workloads import fixed_workload, nano_workload, with_output_len  # noqa: E402
from common.config import add_engine_args, engine_config_from_args  # noqa: E402
from services.offline.engine import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--skip", type=int, default=100, help="steps before the window")
    parser.add_argument("--window", type=int, default=30, help="steps profiled")
    parser.add_argument("--fixed", default=None, metavar="N,LEN",
                        help="N requests of LEN-token prompts instead of nano")
    add_engine_args(parser)
    args = parser.parse_args()
    # the executor in this thread: cProfile sees only the thread it runs in
    engine = Engine(engine_config_from_args(args), step_thread=False)
    if args.fixed:
        num, length = map(int, args.fixed.split(","))
        workload = fixed_workload("fixed", num, length, 1000,
                                  vocab_size=engine.runner.model.vocab_size)
    else:
        workload = nano_workload(256)
    run_inprocess(engine, with_output_len(workload, 4, 8))
    for i, (prompt, params) in enumerate(zip(workload.prompts, workload.params)):
        engine.add_request(f"{uuid.uuid4().hex[:6]}-{i}", prompt, params)
    for _ in range(args.skip):
        engine.step()
    torch.cuda.synchronize()
    running = len(engine.scheduler.running)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.window):
            engine.step()
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / args.window
    host = cProfile.Profile()
    start = time.perf_counter()
    with host:
        for _ in range(args.window):
            engine.step()
        torch.cuda.synchronize()
    host_wall = (time.perf_counter() - start) / args.window
    host_stats = io.StringIO()
    pstats.Stats(host, stream=host_stats).sort_stats("tottime").print_stats(30)
    pstats.Stats(host, stream=host_stats).sort_stats("cumtime").print_stats(40)
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events) / args.window
    lines = [f"running requests {running}; wall {wall * 1e3:.2f} ms/step (profiled); "
             f"device busy {device_us / 1e3:.2f} ms/step",
             events.table(sort_by="self_device_time_total", row_limit=25),
             events.table(sort_by="cpu_time_total", row_limit=40),
             f"host functions over the next {args.window} steps, "
             f"{host_wall * 1e3:.2f} ms/step under cProfile", host_stats.getvalue()]
    args.out.mkdir(parents=True, exist_ok=True)
    name = "step_profile" + (f"_fixed{num}x{length}" if args.fixed else "_nano")
    (args.out / f"{name}.txt").write_text("\n".join(lines))
    print(lines[0])


if __name__ == "__main__":
    main()
