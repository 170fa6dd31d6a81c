"""Where the in-process loop's time goes on the nano workload, with the executor wherever
HEADRACE_WORKER_PROCESS puts it: the whole run under cProfile (the loop's thread only),
after one run without it, printing tok/s, the loop's phases and how far the detokenizer
process fell behind (its batches not yet back, after each step). --logprobs N: every
request also asks for N logprobs.

    source .devkit/env.sh && HEADRACE_WORKER_PROCESS=1 python benchmarks/gpu/loop_profile.py \
        --model .devkit/models/qwen3-0.6b-shape --load-format dummy --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.bench.throughput import run_inprocess, with_sampling  # noqa: E402
from benchmarks.bench.workloads import nano_workload, with_output_len  # noqa: E402
from common.config import add_engine_args, engine_config_from_args  # noqa: E402
from services.offline.engine import Engine  # noqa: E402


def pending_after_steps(engine: Engine) -> list[int]:
    """Wrap engine.step to record the detokenizer process's pending batches after each."""
    seen: list[int] = []
    step = engine.step

    def counted():
        deltas = step()
        if engine.detokenizer_process is not None:
            seen.append(engine.detokenizer_process.pending)
        return deltas

    engine.step = counted
    return seen


def step_times(engine: Engine) -> list[list[float]]:
    """Wrap the scheduler's update to record each result's stamps: when its plan was made,
    when the device started it, when its tokens were on the host."""
    seen: list[list[float]] = []
    update = engine.scheduler.update

    def recorded(result):
        seen.append(list(result.stamps))
        return update(result)

    engine.scheduler.update = recorded
    return seen


def timeline(stamps: list[list[float]]) -> str:
    """The device's idle time between steps (a step started after the one before was done:
    its plan came late), the steps' device time, and how long after a step's tokens were
    on the host the plan two steps on was made (the loop's turnaround)."""
    idle = sum(max(0.0, s[1] - p[2]) for p, s in zip(stamps, stamps[1:]))
    busy = sum(s[2] - s[1] for s in stamps)
    turns = sorted(s[0] - p[2] for p, s in zip(stamps, stamps[2:]))
    mid = turns[len(turns) // 2] if turns else 0.0
    return (f"device idle between steps {idle:.2f} s, steps {busy:.2f} s, loop turnaround "
            f"median {1e3 * mid:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--logprobs", type=int, default=None, metavar="N")
    add_engine_args(parser)
    args = parser.parse_args()
    engine = Engine(engine_config_from_args(args))
    warmup = with_output_len(nano_workload(256, seed=1), 4, 8)
    run_inprocess(engine, with_sampling(warmup, logprobs=args.logprobs))
    lines = []
    for profiled, seed in ((False, 0), (True, 2)):  # 2: no prefix the first run cached
        workload = with_sampling(nano_workload(256, seed=seed), logprobs=args.logprobs)
        seen = pending_after_steps(engine)
        stamps = step_times(engine)
        host = cProfile.Profile()
        if profiled:
            host.enable()
        result = run_inprocess(engine, workload)
        host.disable()
        del engine.step, engine.scheduler.update
        lines.append(f"{'under cProfile' if profiled else 'plain'}: "
                     f"{result.output_tokens / result.seconds:.0f} tok/s, {result.phases}; "
                     f"detokenizer batches pending after a step: max {max(seen, default=0)}, "
                     f"mean {sum(seen) / max(len(seen), 1):.2f}; {timeline(stamps)}")
        print(lines[-1], flush=True)
    stats = io.StringIO()
    pstats.Stats(host, stream=stats).sort_stats("tottime").print_stats(35)
    pstats.Stats(host, stream=stats).sort_stats("cumtime").print_stats(45)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "loop_profile.txt").write_text("\n".join(lines) + "\n" + stats.getvalue())
    engine.close()


if __name__ == "__main__":
    main()
